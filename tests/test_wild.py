"""Templates in the wild: what a user gets from each real chat template of
``tests/data/templates/wild`` (provenance in its SOURCES.md), pinned by its ``expected.yaml``.

For every template, ``tools/wild.py`` does what a user does: ``cg.detect_format(chat_template=T)``
and, when a bundled format is detected, checks it against the template over the whole
conversation matrix (``chatgrammar.conformance.templates.check_template``: the masks of every case, in
text mode and in id mode with one id per marker); else ``cg.infer_format(T)`` and the same check
of the inferred format. Each template is then ``detected`` / ``inferred`` (every case trains
exactly the assistant output), ``safe`` (a clear error: DetectionError and InferenceError, or
located ParseErrors on the shapes that do not fit) or ``SILENT WRONG``.

The test asserts:

- nothing is ever SILENT WRONG (a mask that differs with no error) and nothing crashes —
  except the known defects pinned ``SILENT WRONG`` (with their reason) in expected.yaml, which
  xfail until they are fixed;
- a template pinned ``bundled NAME`` or ``inferred`` stays fully correct (a detected bundled
  format must be NAME; detection may instead hand it to inference, which must then be right);
- a template pinned ``refused`` fails safely — or got better (it may become fully correct:
  run ``python tools/wild.py --write-expected`` to pin that);
- under every other mask policy a trainer uses (``chatgrammar.conformance.policies.POLICIES``)
  no case that passes with the default trains otherwise than the template says — except the
  known defects pinned under ``policy_wrong`` in expected.yaml (those may get fixed, never
  spread to another policy).

Cheap: about 0.2 s a template (inference is cached by template hash).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import wild  # noqa: E402  (tools/wild.py)

EXPECTED = wild.load_expected()
TEMPLATES = sorted(wild.WILD.glob("*.jinja"))


def test_every_wild_template_is_pinned():
    """Each template on disk has its expected outcome, and each pinned one is on disk."""
    on_disk = {p.name for p in TEMPLATES}
    pinned = {k for k, v in EXPECTED.items() if "outcome" in v}
    assert on_disk == pinned, (f"not pinned: {sorted(on_disk - pinned)}; "
                               f"gone: {sorted(pinned - on_disk)} "
                               "(python tools/wild.py --write-expected)")


def test_every_wild_template_has_its_source():
    """Provenance: every template has its line in wild/SOURCES.md."""
    sources = (wild.WILD / "SOURCES.md").read_text(encoding="utf-8")
    missing = [p.name for p in TEMPLATES if f"`{p.name}`" not in sources]
    assert not missing, missing


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.name for p in TEMPLATES])
def test_wild_template(path):
    entry = EXPECTED.get(path.name) or {}
    res = wild.classify(path, entry.get("vars"))
    detail = f"{res.outcome} ({res.format}): {res.reason}\n" + "\n".join(res.failures)
    if entry.get("outcome") == "SILENT WRONG" and res.outcome == "SILENT WRONG":
        # a known defect, pinned with its reason in expected.yaml (and listed in the report);
        # once fixed this passes and --write-expected pins the new outcome
        pytest.xfail(f"known silent wrong mask: {entry.get('reason', '')}")
    assert res.outcome not in ("SILENT WRONG", "CRASH"), detail
    want = entry.get("outcome", "")
    if want.startswith("bundled "):
        assert res.outcome in ("detected", "inferred"), detail
        if res.outcome == "detected":
            assert res.format == want.split(" ", 1)[1], detail
    elif want == "inferred":
        assert res.outcome in ("detected", "inferred"), detail
    elif want == "warned":
        assert res.outcome in ("warned", "detected", "inferred"), detail
    else:
        assert res.outcome in ("safe", "detected", "inferred"), detail
    known = entry.get("policy_wrong") or {}
    wrong = [f for f in res.policy_failures if f.partition(": ")[0] not in known]
    assert not wrong, "wrong under a mask policy:\n" + "\n".join(wrong)


def test_policy_counts_pinned():
    """The per-policy counts in expected.yaml are those of the templates pinned there: no
    template is wrong under a policy without its ``policy_wrong`` entry (one the format warns
    about, ``policy_warned``, counts warned)."""
    counts = wild.load_policy_counts()
    assert set(counts) == set(wild.POLICIES), "python tools/wild.py --write-expected"
    for name, tally in counts.items():
        pinned = sum(1 for e in EXPECTED.values() if name in (e.get("policy_wrong") or {}))
        assert tally["wrong"] == pinned, (name, tally, pinned)
        warned = sum(1 for e in EXPECTED.values() if name in (e.get("policy_warned") or {}))
        assert tally["warned"] >= warned, (name, tally, warned)


# ---------------------------------------------------------------- the policy check itself
# Each defect the policy check found, pinned under its policy: the bundled format is right on
# the template, and the spec as it was (reconstructed with `extends`) is caught.

from chatgrammar.conformance.matrix import get_case  # noqa: E402
from chatgrammar.conformance.policies import check_policies, is_warned  # noqa: E402
from chatgrammar.conformance.templates import check_template  # noqa: E402

import chatgrammar as cg  # noqa: E402

_DS_VARS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
# deepseek-v3 before the fixes: `</think>` an inner marker of the assistant's content, no
# leading reasoning block, DSML calls plain text
_DS_BEFORE = """\
extends: deepseek-v3
name: deepseek-v3-before
elements:
  assistant:
    children: [think, tool_calls, tool_call]
    inner_markers: [think_close, tool_calls_end]
"""

# deepseek-v3 before the DSML fix: the DSML calls plain text (the reasoning fix kept)
_DS_BEFORE_DSML = """\
extends: deepseek-v3
name: deepseek-v3-before-dsml
markers: {dsml_open_v32: null, dsml_close_v32: null, dsml_open_v4: null, dsml_close_v4: null,
          dsml_open_v41: null, dsml_close_v41: null}
elements:
  system: {inner_markers: [think_open, think_close]}
  assistant: {children: [lead_think, think, tool_calls, tool_call]}
  outputs_reply: {children: [think, tool_calls, tool_call]}
  reply: {children: [think, tool_calls, tool_call]}
  dsml_calls: null
"""


def _policy_problems(fmt, template: str, cases: list[str], variables: dict) -> dict:
    chk = check_template(fmt, (wild.WILD / template).read_text(encoding="utf-8"),
                         cases=[get_case(c) for c in cases], variables=variables)
    assert chk.ok, chk.summary()
    return check_policies(fmt, chk)


def _spec(tmp_path_factory, text: str):
    p = tmp_path_factory.mktemp("ds") / "before.yaml"
    p.write_text(text, encoding="utf-8")
    return cg.load_format(str(p))


@pytest.fixture(scope="module")
def deepseek_before(tmp_path_factory):
    return _spec(tmp_path_factory, _DS_BEFORE)


@pytest.fixture(scope="module")
def deepseek_before_dsml(tmp_path_factory):
    return _spec(tmp_path_factory, _DS_BEFORE_DSML)


def test_sglang_deepseek_v4_reasoning_never_trains_without_thinking(deepseek_before):
    """sglang's DeepSeek-V4 template writes the last turn as `REASONING</think>answer`: read
    as content, thinking=False trained the reasoning; now it is a reasoning block."""
    args = ("sglang-tool_chat_template_deepseekv4.jinja", ["reasoning-thinking-on"], _DS_VARS)
    got = _policy_problems(cg.load_format("deepseek-v3"), *args)
    assert not any(got.values()), got
    before = _policy_problems(deepseek_before, *args)["thinking=False"]
    assert before and "reasoning '7 has no divisors" in before[0], before


def test_deepseek_v4_dsml_calls_dropped_without_tool_calls(deepseek_before_dsml):
    """DeepSeek-V4's DSML tool calls were content: tool_calls=False trained them."""
    args = ("deepseek-ai-DeepSeek-V4.jinja", ["tool-call", "tool-call-with-content"], _DS_VARS)
    got = _policy_problems(cg.load_format("deepseek-v3"), *args)
    assert not any(got.values()), got
    before = _policy_problems(deepseek_before_dsml, *args)["tool_calls=False"]
    assert before and "untyped" in before[0], before


@pytest.mark.parametrize("template,fmt,variables", [
    ("RLHFlow-LLaMA3-SFT.jinja", "llama3",
     {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    ("dreamgen-opus-v1.2-7b.jinja", "chatml", {"bos_token": "", "eos_token": "<|im_end|>"}),
])
def test_unlisted_generation_prompt_no_longer_eats_last_turn_only(template, fmt, variables):
    """An unlisted generation prompt was an empty cut turn, the last: last_turn_only trained
    nothing."""
    got = _policy_problems(cg.load_format(fmt), template, ["generation-prompt"], variables)
    assert not got["last_turn_only"], got


@pytest.mark.parametrize("template,fmt,variables", [
    ("nvidia-Llama-3_3-Nemotron-Super-49B-v1_5.jinja", "llama3",
     {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    ("vllm-tool_chat_template_olmo3.jinja", "chatml", {"bos_token": "", "eos_token": "<|im_end|>"}),
])
def test_marked_tool_calls_dropped_without_tool_calls(template, fmt, variables):
    """Nemotron-Super's <TOOLCALL> and OLMo 3's <function_calls> blocks were content."""
    got = _policy_problems(cg.load_format(fmt), template, ["tool-call", "parallel-tool-calls"],
                           variables)
    assert not got["tool_calls=False"], got


def test_minicpm3_tool_template_checked_without_tool_calls():
    """vLLM's MiniCPM3 tool template (chatml): its <|tool_call_start|> calls are dropped under
    tool_calls=False, the content around them still trains."""
    got = _policy_problems(cg.load_format("chatml"), "vllm-tool_chat_template_minicpm3.jinja",
                           ["tool-call", "tool-call-with-content", "parallel-tool-calls"],
                           {"bos_token": "", "eos_token": "<|im_end|>"})
    assert not any(got.values()), got


_LLAMA_VARS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def test_untyped_tool_calls_are_warned_not_silent():
    """A tool call the template writes as plain JSON (Llama 3.1 JSON calls) cannot be dropped
    by any grammar: llama3 declares it (`plain_text_tool_calls`), tool_calls=False warns at
    mask time, and the check counts it warned (wrong, never silent), saying why."""
    got = _policy_problems(cg.load_format("llama3"), "vllm-tool_chat_template_llama3.1_json.jinja",
                           ["tool-call"], _LLAMA_VARS)["tool_calls=False"]
    assert got and all(is_warned(p) for p in got) and "untyped" in got[0], got


def test_undeclared_untyped_tool_calls_are_wrong(tmp_path):
    """The same format without the declaration: the check says wrong (no warning)."""
    p = tmp_path / "bare.yaml"
    p.write_text("extends: llama3\nname: llama3-undeclared\nplain_text_tool_calls: false\n",
                 encoding="utf-8")
    got = _policy_problems(cg.load_format(str(p)), "vllm-tool_chat_template_llama3.1_json.jinja",
                           ["tool-call"], _LLAMA_VARS)["tool_calls=False"]
    assert got and not any(is_warned(p) for p in got), got


@pytest.mark.parametrize("template,fmt,variables", [
    ("vllm-tool_chat_template_llama3.2_pythonic.jinja", "llama3", _LLAMA_VARS),
    ("vllm-tool_chat_template_xlam_qwen.jinja", "chatml",
     {"bos_token": "", "eos_token": "<|im_end|>"}),
    ("vllm-tool_chat_template_gemma3_pythonic.jinja", "gemma",
     {"bos_token": "<bos>", "eos_token": "<eos>"}),
])
def test_plain_text_tool_calls_warn_on_every_mask_api(template, fmt, variables):
    """Text mode, id mode, the fast path and the batch API all say it (a DeviationWarning,
    strict or lenient, never an error); with tool calls kept, or a policy that trains no
    assistant, nothing is said."""
    import warnings
    from chatgrammar.conformance.render import render_chat
    from chatgrammar.conformance.templates import MarkerTokenizer
    f = cg.load_format(fmt)
    case = get_case("tool-call")
    R = render_chat((wild.WILD / template).read_text(encoding="utf-8"), case.messages,
                    tools=case.tools, **variables)
    tok = MarkerTokenizer.for_format(f)
    ids, _ = tok.encode_with_offsets(R)
    drop = cg.MaskPolicy(tool_calls=False)
    calls = [lambda: f.parse(R).mask(drop), lambda: f.parse(R, strict=False).spans(drop),
             lambda: f.parse_ids(ids, tok).mask(drop),
             lambda: f.loss_mask(ids, tok, policy=drop),
             lambda: f.loss_mask(ids, tok, policy=drop, strict=False),
             lambda: f.loss_masks([ids, ids], tok, policy=drop, on_error="record", errors=[])]
    for call in calls:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            call()
        dev = [w for w in said if issubclass(w.category, cg.DeviationWarning)]
        assert len(dev) == 1 and "plain text" in str(dev[0].message), said
    with warnings.catch_warnings():
        warnings.simplefilter("error", cg.DeviationWarning)
        f.parse(R).mask(cg.MaskPolicy())
        f.loss_mask(ids, tok)
        f.parse(R).mask(cg.MaskPolicy(roles=("system",), tool_calls=False))
    # the call still trains (the template writes it as the answer), exactly as without it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.DeviationWarning)
        assert f.loss_mask(ids, tok, policy=drop) == f.loss_mask(ids, tok)


def _think_formats() -> list[str]:
    from chatgrammar.core.registry import list_formats
    out = []
    for name in list_formats():
        spec = cg.load_format(name).spec
        if any(e.kind == "think" and e.open for e in spec.elements.values()):
            out.append(name)
    return out


def _assert_refused_or_untrained(fmt, text: str, reasoning: str, where: str) -> None:
    """`text` (a reasoning turn with its opener taken out) is a ParseError, or the
    `reasoning` in it does not train under thinking=False."""
    try:
        conv = fmt.parse(text)
    except cg.ParseError:
        return
    k = text.find(reasoning)
    trained = [s for s in conv.spans(cg.MaskPolicy(thinking=False)) if s.start <= k < s.end]
    assert not trained, f"{where}: reasoning trains under thinking=False"


@pytest.mark.parametrize("name", _think_formats())
def test_reasoning_without_its_opener_never_trains_without_thinking(name):
    """DeepSeek-V4's shape in every thinking format: a format's own template renders a
    reasoning turn, its think opener is taken out (`…REASONING</think>answer`, a completion
    stored after a prefilled `<think>`): the format refuses it (a located ParseError) or
    types it as reasoning; thinking=False never trains it."""
    from chatgrammar.conformance.format_tests import tests_for
    from chatgrammar.conformance.render import render_chat
    fmt = cg.load_format(name)
    spec = fmt.spec
    opens = {spec.markers[o].text for e in spec.elements.values() if e.kind == "think"
             for o in e.open if o in spec.markers}
    for t, case in [(t, get_case(c)) for c in ("reasoning-thinking-on", "reasoning")
                    for t in tests_for(fmt).get("templates") or []]:
        said = case.outputs[-1].reasoning
        path = ROOT / "tests" / "data" / "templates" / t["file"]
        try:
            R = render_chat(path.read_text(encoding="utf-8"), case.messages,
                            **{**(t.get("vars") or {}), **case.template_kwargs})
        except Exception:  # noqa: BLE001 - a template that rejects the shape: try the next
            continue
        k = R.find(said)
        at, opener = max((R.rfind(o, 0, k), o) for o in opens) if k >= 0 else (-1, "")
        if at < 0:
            continue
        _assert_refused_or_untrained(fmt, R[:at] + R[at + len(opener):], said,
                                     f"{name} × {t['file']}")
        return
    # no template renders `reasoning_content`: the format's own examples with a think block
    closes = {spec.markers[c].text for e in spec.elements.values() if e.kind == "think"
              and e.close for c in e.close.markers if c in spec.markers}
    for ex in spec.examples or ():
        text = ex.text.replace("\u27e6", "").replace("\u27e7", "")
        for o in opens:
            at = text.find(o)
            end = min((k for k in (text.find(c, at + len(o)) for c in closes) if k >= 0),
                      default=-1) if at >= 0 else -1
            body = text[at + len(o):end].strip() if end > 0 else ""
            if not body:
                continue
            _assert_refused_or_untrained(fmt, text[:at] + text[at + len(o):], body,
                                         f"{name} example {ex.name!r}")
            return
    pytest.skip("neither a template nor an example of the format writes a think block")


def _vars(template: str, fmt: str) -> dict:
    """The variables tools/wild.py renders ``template`` with (expected.yaml's, else the
    detected family's)."""
    given = (EXPECTED.get(template) or {}).get("vars")
    text = (wild.WILD / template).read_text(encoding="utf-8")
    return given or wild.family_vars(cg.load_format(fmt), text)


@pytest.mark.parametrize("template,fmt,variables", [
    ("naver-hyperclovax-seed-think-14b-vllm.jinja", "hyperclovax-seed", None),
    ("vllm-tool_chat_template_muse_glimmer.jinja", "muse-glimmer", None),
])
def test_last_turn_only_trains_the_whole_last_message(template, fmt, variables):
    """One assistant message rendered as a reasoning turn and an answer turn (HyperCLOVA X's
    `assistant/think`, Muse Glimmer's `to=self`): last_turn_only trains both, in text mode, id
    mode and the fast path (the check runs all three); before, only the answer turn."""
    got = _policy_problems(cg.load_format(fmt), template,
                           ["reasoning", "reasoning-thinking-on", "reasoning-tool-call"],
                           _vars(template, fmt))
    assert not got["last_turn_only"], got


def test_last_turn_only_keeps_two_replies_apart():
    """Two assistant messages in a row (a template that drops the tool result between them)
    are two replies: last_turn_only trains the last one only, never the one before."""
    got = _policy_problems(cg.load_format("phi3"), "vllm-tool_chat_template_phi4_mini.jinja",
                           ["tool-call-with-content"],
                           _vars("vllm-tool_chat_template_phi4_mini.jinja", "phi3"))
    assert not got["last_turn_only"], got


@pytest.mark.parametrize("template,fmt,case,policy", [
    # an empty reply's terminator is all it writes (CodeLlama-70B: ' Source: assistant\n\n  <step>')
    ("codellama-CodeLlama-70b-Instruct-hf.jinja", "codellama-70b", "empty-assistant",
     "end_marker"),
    # the system prompt in a `### Instruction:` section (a user section by its marker) after a
    # blank BOS body: no system turn holds it
    ("LoneStriker-TinyLlama-1.1B-32k-Instruct-3.0bpw-h6-exl2.jinja", "alpaca", "basic",
     "roles+system"),
    # vLLM's Mistral writes the message's content after [TOOL_CALLS]: it is the call
    ("vllm-tool_chat_template_mistral.jinja", "mistral", "tool-call-with-content",
     "tool_calls=False"),
])
def test_checker_edge_cases_now_right(template, fmt, case, policy):
    """Three cases the policy check called wrong where the format is right."""
    got = _policy_problems(cg.load_format(fmt), template, [case], _vars(template, fmt))
    assert not got[policy], got


@pytest.mark.parametrize("template", ["bofenghuang-vigogne-2-7b-chat.jinja",
                                      "sglang-vision_template_sarashina_vl.jinja"])
def test_inferred_generation_prompt_is_no_reply(template):
    """Vigogne's '<|assistant|>:' (the header owned by the question before it) and Sarashina's
    '### Assistant:' (printed after a last user message whatever add_generation_prompt says)
    are generation prompts of the inferred format: last_turn_only trains the last reply, not
    that empty prompt."""
    path = wild.WILD / template
    res = wild.classify(path, (EXPECTED.get(template) or {}).get("vars"))
    assert res.outcome == "inferred" and res.policies["last_turn_only"] == "correct", res


def test_plain_text_reasoning_is_declared_and_warned():
    """Apriel 1.6 writes its reasoning as plain text before '[BEGIN FINAL RESPONSE]': the
    inferred format declares it (`plain_text_reasoning`), so thinking=False warns."""
    template = "ServiceNow-AI-Apriel-1.6-15b-Thinker-fixed.jinja"
    res = wild.classify(wild.WILD / template, (EXPECTED.get(template) or {}).get("vars"))
    assert res.policies["thinking=False"] == "warned", res
    assert res.policy_warned and all("untyped" in w for w in res.policy_warned), res


@pytest.mark.parametrize("template", ["CohereForAI-c4ai-command-r-plus-tool_use.jinja",
                                      "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"])
def test_tool_results_in_system_turns_never_train_as_system(template):
    """Cohere writes tool results into system turns (R+'s `<results>`, R7B's
    `<|START_TOOL_RESULT|>`): they are kind tool_response, which trains only with the tool
    role among the roles, so a policy that trains system prompts never trains a tool's words
    (asking for the tool role too trains them, inside the system turn that holds them)."""
    f = cg.load_format("cohere")
    text = (ROOT / "tests" / "data" / "templates" / template).read_text(encoding="utf-8")
    chk = check_template(f, text, cases=[get_case("tool-call")],
                         variables={"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>"})
    assert chk.ok, chk.summary()
    assert not check_policies(f, chk)["roles+system"]
    R = chk.cases[0].text
    conv = f.parse(R)
    result = 'condition'  # (the tool result's key: in no other message)
    assert result in R
    for roles, trains in ((("assistant", "system"), False),
                          (("assistant", "system", "tool"), True)):
        got = "".join(conv.trained_text(cg.MaskPolicy(roles=roles)))
        assert (result in got) is trains, (roles, got)


@pytest.mark.parametrize("template,fmt,variables", [
    ("sglang-tool_chat_template_deepseekv31.jinja", "deepseek-v3",
     {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}),
    ("chujiezheng-llama-3-chat.jinja", "llama3",
     {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    ("chujiezheng-llama-3.2-1B-Instruct.jinja", "llama3",
     {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})])
def test_jinja_indented_templates_fit_their_family(template, fmt, variables):
    """Templates whose untrimmed Jinja lines write whitespace around the turns: before the
    BOS (`lstrip`), 17+ characters between turns (id mode reads up to BETWEEN_MAX_TOKENS),
    and inside or after the generation prompt (sglang V3.1's `<｜Assistant｜>    </think>`,
    a stray newline after Llama 3's header: listed prompts, which train nothing)."""
    path = wild.WILD / template
    chk = check_template(cg.load_format(fmt), path.read_text(encoding="utf-8"),
                         variables=variables)
    assert chk.ok, chk.summary()


def test_gemma4_eos_after_turn_ends_that_turn():
    """A Gemma 4 fine-tune writes the tokenizer's EOS after every `<turn|>` (shivaylamba's):
    it is that turn's end (`close.after`, with the newline before it: `lstrip`), trained only
    with end_marker, and a lone EOS elsewhere is no turn's."""
    f = cg.load_format("gemma4")
    text = ("<bos><|turn>user\nHi<turn|>\n<eos><|turn>model\nHello<turn|>\n<eos>")
    conv = f.parse(text)
    assert [t.role for t in conv.turns] == ["user", "assistant"]
    assert conv.trained_text() == ["Hello"]
    assert "".join(conv.trained_text(cg.MaskPolicy(end_marker=True))) == "Hello<turn|>\n<eos>"
    with pytest.raises(cg.ParseError):
        f.parse("<bos><|turn>user\nHi<eos><turn|>\n")


def test_functionary_tool_results_have_the_tool_role():
    """Functionary v2 writes a tool result under its function's name (`<|from|>get_weather`):
    that turn's role is `tool` (`role_aliases: {"*": tool}`), so role_folds reads no fold
    of the tool into a role named after the function."""
    from chatgrammar.conformance.folds import find_folds
    f = cg.load_format("functionary-v2")
    t = ("<|from|>user\n<|recipient|>all\n<|content|>W?\n<|from|>assistant\n<|recipient|>"
         "get_weather\n<|content|>{}<|stop|>\n<|from|>get_weather\n<|recipient|>all\n"
         "<|content|>sunny\n<|from|>assistant\n<|recipient|>all\n<|content|>Sunny<|stop|>\n")
    assert [x.role for x in f.parse(t).turns] == ["user", "assistant", "tool", "assistant"]
    src = (wild.WILD / "meetkai-functionary-medium-v2.2.jinja").read_text(encoding="utf-8")
    assert find_folds(f, src, {"bos_token": "<s>", "eos_token": "</s>"}) == {}
