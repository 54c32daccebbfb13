"""cg.infer_format: a verified spec inferred from a chat template (docs/inference.md).

(a) cross-check: on the bundled families' real templates, the inferred format trains exactly
    what the bundled format trains, over the whole conversation matrix;
(b) families without a bundled format (tests/data/templates/infer, from llama.cpp's template
    tests): a verified format with the right masks;
(c) bad input: templates that reject shapes (recorded), that only print content parts, that
    never emit an assistant turn, hostile ones: a clear InferenceError; the CLI prints one line.
Every template is rendered exactly as transformers renders it, through chatgrammar.conformance.render.
"""
from __future__ import annotations

import pickle
import re
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.conformance.format_tests import tests_for as _facts_of
from chatgrammar.conformance import infer as inf
from chatgrammar.cli import main
from chatgrammar.conformance.templates import OUTPUT_POLICY, MarkerTokenizer
from chatgrammar.conformance.matrix import default_matrix, render_case
from chatgrammar.conformance.render import TemplateError, render_chat

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "data" / "templates"


def _variables(family: str | None, name: str) -> dict:
    """The template variables a family's tokenizer passes (its formats/<name>.tests.yaml)."""
    if family is None:
        return {}
    ts = _facts_of(cg.load_format(family)).get("templates") or []
    for t in ts:
        if t["file"] == name:
            return dict(t.get("vars") or {})
    return dict(ts[0].get("vars") or {}) if ts else {}

WITH_END = OUTPUT_POLICY.replace(end_marker=True)

#: Bundled family -> its real templates that inference captures (docs/inference.md lists the
#: ones it refuses, and why). The inferred masks must equal the bundled ones on the matrix.
CROSS = {
    "kimi-k2": ["moonshotai-Kimi-K2.jinja", "moonshotai-Kimi-K2-Thinking.jinja"],
    "chatml": ["Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3.jinja", "Qwen-QwQ-32B.jinja",
               "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja", "Qwen-Qwen3.5-2B.jinja",
               "HuggingFaceTB-SmolLM3-3B.jinja", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
               "LiquidAI-LFM2.jinja", "stepfun-ai-Step-3.5-Flash.jinja",
               # the tool-declaring system turn has no <|im_end|>: a terminator may be missing
               "tiiuae-Falcon-H1.jinja", "Bielik-11B-v3.0-Instruct.jinja",
               # the tool turn's <|im_end|> is printed by the next message
               "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"],
    # the answer after the tool outputs has no header: a follow element of the tool turn
    "deepseek-v3": ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
                    # tool-call probes with the arguments as a JSON string
                    "deepseek-ai-DeepSeek-V3.jinja", "deepseek-ai-DeepSeek-R1.jinja"],
    "seed-oss": ["ByteDance-Seed-OSS.jinja"],
    "cohere": ["CohereForAI-c4ai-command-r-v01.jinja"],
    "gemma": ["google-gemma-2-2b-it.jinja", "google-gemma-3-it.jinja"],
    "granite": ["ibm-granite-granite-3.3-2B-Instruct.jinja", "ibm-granite-granite-4.0.jinja"],
    "llama3": ["meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
               # FireFunction v2 takes tool-call arguments only as a JSON string; every
               # rendering ends with the assistant header (a forced generation prompt)
               "fireworks-ai-llama-3-firefunction-v2.jinja"],
    "llama4": ["meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja"],
    "mistral": ["mistralai-Mistral-7B-Instruct-v0.3.jinja",
                "mistralai-Mistral-Small-24B-Instruct-2501.jinja",
                "Mistral-Small-3.2-24B-Instruct-2506.jinja",
                "mistralai-Ministral-3-14B-Reasoning-2512.jinja"],
    "phi3": ["microsoft-Phi-3-mini-4k-instruct.jinja", "microsoft-Phi-4-mini-instruct.jinja"],
    # no terminator at all: the EOS is an optional close, as the bundled specs say
    "falcon": ["tiiuae-falcon-11B.jinja"],
    "solar-instruct": ["Deci-DeciLM-7B.jinja"],
    "sea-lion": ["aisingapore-sea-lion-7b-instruct.jinja"],
    "phi4": ["microsoft-phi-4.jinja", "microsoft-Phi-4-reasoning.jinja"],
    # a fixed developer block after the system turn; <|assistant_end|> printed only before the
    # next user header (a lazy terminator of the assistant turns, user turns have their own)
    "apertus": ["Apertus-8B-Instruct.jinja"],
    # '<|calls|>' after a tool call is written where other turns write '<|end|>': it ends the
    # turn (trained only with end_marker), not the call block
    "solar-open": ["upstage-Solar-Open-100B.jinja"],
    # a round counter in the user header ('[Round N]', '<|user|>\n[N]'): a counter header
    "chatglm": ["wild/vllm-template_chatglm.jinja"],
    "chatglm2": ["wild/vllm-template_chatglm2.jinja"],
    "zoot": ["wild/zoot-v3.jinja"],
}

#: Templates inference refuses, with the reason it must give (a precise InferenceError, never
#: a half-right format).
REFUSED = {
    "openai-gpt-oss-120b.jinja": ("harmony", "no common separator"),
    "moonshotai-Kimi-K3.jinja": ("kimi-k3", "render their header differently"),
    "google-functiongemma.jinja": ("functiongemma", "same header 'model'"),
}

#: Families without a bundled format (llama.cpp's template tests; SOURCES.md there):
#: template -> (variables, a conversation's rendering must train exactly these texts).
NEW = {
    "openchat-3.5.jinja": ({"bos_token": "<s>", "eos_token": "<|end_of_turn|>"},
                           [" Hello there", " Later"]),
    "alphamonarch.jinja": ({"bos_token": "<s>", "eos_token": "</s>"}, ["Hello there", "Later"]),
    "deepseek-v2.jinja": ({"bos_token": "<｜begin▁of▁sentence｜>",
                           "eos_token": "<｜end▁of▁sentence｜>"}, [" Hello there", " Later"]),
    "llama2-inst-mistral-v0.2-old.jinja": ({"bos_token": "<s>", "eos_token": "</s>"},
                                           ["Hello there", "Later"]),
    "phi3-small.jinja": ({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
                         ["Hello there", "Later"]),
    # GLM-Edge: no terminators; the user turn prints the assistant's header <|assistant|>
    "glmedge.jinja": ({}, ["\nHello there", "\nLater"]),
    # Llama-2 [INST] <<SYS>>: a default system prompt folded into the first user turn
    "llama2-sys-vigogne.jinja": ({"bos_token": "<s>", "eos_token": "</s>"},
                                 [" Hello there ", " Later "]),
    # the user turn prints the assistant header; tool messages are dropped, so the answer
    # after one follows the tool-calling reply with no header (a follow element)
    "phi3-medium.jinja": ({}, ["Hello there", "Later"]),
    "phi3-mini.jinja": ({}, ["Hello there", "Later"]),
    "phi4-llamacpp.jinja": ({}, ["Hello there", "Later"]),
    # the assistant header is printed even without add_generation_prompt; every turn ends
    # with <|eot_id|>, which stays the turn's
    "llama3-llamacpp.jinja": ({"bos_token": "<|begin_of_text|>"}, ["Hello there", "Later"]),
    # ChatML whose '<|im_end|>' is printed only once another message follows (none after the
    # last one): the terminator moves back to the turn it ends
    "finguai-chat-v1.jinja": ({}, ["Hello there", "Later"]),
    # no generation prompt, no terminator: the space after '### Assistant:' is the reply's,
    # the newline before the next turn is not (trim_end)
    "aanaphi2.jinja": ({"eos_token": "</s>"}, [" Hello there", " Later"]),
}
TWO_EXCHANGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                 {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Later"}]


def _read(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def _renders(name: str, family: str) -> tuple:
    """The matrix rendered with a template (cached: several tests use it)."""
    tpl, kw = _read(name), _variables(family, name)
    out = []
    for case in default_matrix():
        try:
            out.append((case.name, render_case(tpl, case, **kw).text))
        except TemplateError:
            pass
    return tuple(out)


def _infer(name: str, family: str | None = None, **kw) -> inf.InferredFormat:
    return cg.infer_format(_read(name), **{**_variables(family, name), **kw})


# ------------------------------------------------------------------------- (a) cross-check
@pytest.mark.parametrize("family,name", [(f, t) for f, ts in CROSS.items() for t in ts])
def test_inferred_masks_equal_bundled(family, name):
    fmt = _infer(name, family)
    assert re.fullmatch(r"inferred-[0-9a-f]{8}", fmt.name)
    assert fmt.verification.checked, "verified on no case"
    bundled = cg.load_format(family)
    renders = _renders(name, family)
    assert len(renders) >= 6
    for case, text in renders:
        for pol in (OUTPUT_POLICY, WITH_END):
            assert fmt.parse(text).mask(pol) == bundled.parse(text).mask(pol), (case, pol)


@pytest.mark.parametrize("family,name", [
    ("internlm2", "internlm-internlm2-chat-7b.jinja"),       # '<|im_end|>\n</s>' at the end
    ("tulu", "allenai-OLMo-7B-Instruct.jinja"),               # '<|endoftext|>\n', also the BOS
    ("tulu", "allenai-tulu-2-7b.jinja"),
    ("alpaca", "chujiezheng-chat_templates-alpaca.jinja"),    # a bare system text after <s>
    ("vicuna", "lucyknada-microsoft_WizardLM-2-7B.jinja"),
])
def test_whitespace_after_the_terminator_is_between_turn_text(family, name):
    # turns without a terminator are closed by the opener of the turn that follows them (the
    # bundled tulu / alpaca shape), and a marker after the terminator takes the whitespace
    # before it (lstrip): the whitespace after a terminator is then between-turn text, never
    # part of the end span, so the masks equal the bundled ones with the terminator trained too
    tpl, kw = _read(name), _variables(family, name)
    fmt, bundled = _infer(name, family), cg.load_format(family)
    assert "_ws" not in fmt.spec_yaml
    cc = inf.cross_check(fmt, bundled, tpl, **kw)
    assert cc.agree and len(cc.equal) >= 14, cc.differ


def test_cohere_r7b_differs_on_purpose():
    # Command R7B prompts with <|START_RESPONSE|>: the inferred spec keeps it in the header
    # and makes <|END_RESPONSE|> the terminator (untrained by default, as every terminator);
    # the bundled cohere spec trains the whole reply block the model chooses (response /
    # thinking / action), markers included. Both pass the template's matrix; the bundled one
    # is the better training target (docs/inference.md, "where they differ").
    name = "CohereLabs-c4ai-command-r7b-12-2024.jinja"
    fmt, bundled = _infer(name, "cohere"), cg.load_format("cohere")
    case, text = _renders(name, "cohere")[0]
    a = fmt.parse(text).trained_text(OUTPUT_POLICY)
    b = bundled.parse(text).trained_text(OUTPUT_POLICY)
    strip = [x.replace("<|START_RESPONSE|>", "").replace("<|END_RESPONSE|>", "") for x in b]
    assert strip == a and a != b


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_with_a_reason(name):
    family, why = REFUSED[name]
    with pytest.raises(cg.InferenceError, match=re.escape(why)):
        _infer(name, family)


# ------------------------------------------------------------------- (b) new families
@pytest.mark.parametrize("name", sorted(NEW))
def test_new_family_verified_with_correct_masks(name):
    kw, trained = NEW[name]
    tpl = _read("infer/" + name)
    fmt = cg.infer_format(tpl, **kw)
    assert len(fmt.verification.checked) >= 6
    text = render_chat(tpl, TWO_EXCHANGES, **kw)
    assert fmt.parse(text).trained_text() == trained
    # id mode with one id per marker trains the same
    tok = MarkerTokenizer([m.text for m in fmt.spec.markers.values()])
    ids, starts = tok.encode_with_offsets(text)
    bounds = starts + [len(text)]
    spans = fmt.parse_ids(ids, tok).spans()
    assert [text[bounds[s.start]:bounds[s.end]] for s in spans] == trained


def test_answer_after_a_dropped_tool_message_trains_as_the_assistant():
    # phi-4's llama.cpp test template drops tool messages; '<|im_end|>' is followed by no
    # whitespace, so a headerless answer may follow an answer: both answers train
    name = "phi4-llamacpp.jinja"
    tpl = _read("infer/" + name)
    fmt = cg.infer_format(tpl)
    assert "tool-call" in fmt.verification.checked
    for case in ("tool-call", "tool-call-with-content"):
        c = next(x for x in default_matrix() if x.name == case)
        text = render_case(tpl, c).text
        answers = [m["content"] for m in c.messages if m["role"] == "assistant"]
        assert "".join(fmt.parse(text).trained_text(OUTPUT_POLICY)) == "".join(answers)


@pytest.mark.parametrize("name", ["infer/phi3-medium.jinja", "infer/phi3-mini.jinja",
                                  "wild/qnguyen3-Master-Yi-9B.jinja"])
def test_dropped_tool_messages_refused_rather_than_whitespace_in_the_terminator(name):
    # Phi-3-medium / mini, Master-Yi: the answer after a dropped tool message could follow
    # the previous answer only if the terminator held the newline after it ('<|end|>\n'),
    # which end_marker would train; the spec without that answer is preferred: the dropped
    # tool shapes are located ParseErrors (as in the bundled phi3 / chatml), the end spans
    # are the terminators alone
    tpl = _read(name)
    fmt = cg.infer_format(tpl, eos_token="<|im_end|>") if "Yi" in name else cg.infer_format(tpl)
    assert "_ws" not in fmt.spec_yaml
    assert {c for c, _ in fmt.verification.refused} == {
        c.name for c in default_matrix() if "tool-results" in c.tags}
    for case in ("tool-call", "tool-call-with-content"):
        c = next(x for x in default_matrix() if x.name == case)
        try:
            text = render_case(tpl, c).text
        except TemplateError:
            continue
        with pytest.raises(cg.ParseError):
            fmt.parse(text)


def test_closeless_layout_reports_its_whitespace_deviation():
    # DeciLM: '### User:\n…\n### Assistant:\n…\n', no terminator: the '\n' before the next
    # header is not trained (the inferred turns are `trim_end`, as the bundled solar-instruct):
    # no unclosed-whitespace deviation is left to report
    fmt = _infer("Deci-DeciLM-7B.jinja", "solar-instruct")
    assert not fmt.verification.deviations
    assert "unclosed-whitespace" not in fmt.verification.summary()
    text = render_chat(_read("Deci-DeciLM-7B.jinja"), TWO_EXCHANGES, bos_token="<s>",
                       eos_token="</s>")
    assert fmt.parse(text).trained_text() == ["Hello there", "Later"]
    # without an EOS to end a reply at, the reply ends where the next turn opens and does not
    # keep the whitespace it ends with (trim_end): the same masks, no deviation
    for kw in ({}, {"eos_token": "<|endoftext|>"}):
        fmt = cg.infer_format(_read("derived/llama-cpp-rwkv-world.jinja"), **kw)
        assert not fmt.verification.deviations
        text = render_chat(_read("derived/llama-cpp-rwkv-world.jinja"), TWO_EXCHANGES, **kw)
        assert [t.strip() for t in fmt.parse(text).trained_text()] == ["Hello there", "Later"]


def test_tool_markers_written_as_text_in_the_system_prompt():
    # vLLM's Qwen2.5-Coder tool template explains '<tools>' calls with examples inside the
    # system prompt ('use <tools> tags like these examples: … <tools>…</tools>'): the first
    # '<tools>' is never closed, so the call block's close may be missing (`close.required:
    # false` on a child: it ends at the next '<tools>'); the call trains as a typed call
    # (tool_calls=False drops it), where it used to be loose markers in plain text
    tpl = _read("infer/vllm-qwen2.5-coder-tools.jinja")
    fmt = cg.infer_format(tpl, eos_token="<|im_end|>")
    call = fmt.spec.elements["tool_call"]
    assert not call.close.required and "tools-declared" in fmt.verification.checked
    c = next(x for x in default_matrix() if x.name == "tool-call")
    text = render_case(tpl, c, eos_token="<|im_end|>").text
    conv = fmt.parse(text)
    trained = conv.trained_text(OUTPUT_POLICY)
    assert any("<tools>" in t and "get_weather" in t for t in trained)
    assert not any('"temperature": 22' in t for t in trained)   # the tool result never trains
    dropped = conv.trained_text(OUTPUT_POLICY.replace(tool_calls=False))
    assert not any("get_weather" in t for t in dropped) and any("sunny" in t for t in dropped)


def test_forced_generation_prompt_and_tool_results_as_responses():
    # StarCoder2-Instruct prints '### Response\n' after every conversation and writes tool
    # results as '### Response' turns too: the inferred spec lets an answer follow only an
    # instruction, so tool results are located ParseErrors; the prompt after the last answer
    # is close.after of that answer (with end_marker it trains with the terminator: noted)
    name = "bigcode-starcoder2-15b-instruct-v0.1.jinja"
    fmt = _infer(name, "starcoder2-instruct")
    assert fmt.verification.refused
    assert all("tool-results" in next(c for c in default_matrix() if c.name == case).tags
               for case, _ in fmt.verification.refused)
    assert any("with end_marker=True it trains" in n for n in fmt.verification.notes)
    tpl, kw = _read(name), _variables("starcoder2-instruct", name)
    cc = inf.cross_check(fmt, cg.load_format("starcoder2-instruct"), tpl, **kw)
    # the output masks equal the bundled ones; the end span differs by the forced prompt
    assert cc.differ and all("(with the terminator)" in why for _, why in cc.differ)


def test_llama2_without_system_support_records_the_rejected_shapes():
    kw, _ = NEW["llama2-inst-mistral-v0.2-old.jinja"]
    fmt = cg.infer_format(_read("infer/llama2-inst-mistral-v0.2-old.jinja"), **kw)
    rejected = dict(fmt.verification.rejected)
    assert "basic" in rejected and "alternate" in rejected["basic"]
    assert fmt.verification.probes_rejected          # probes it rejected: recorded, not fatal
    assert "rejects" in fmt.verification.summary()


# --------------------------------------------------------------------- the result itself
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_deterministic_cached_and_named_by_hash():
    a = cg.infer_format(CHATML)
    b = cg.infer_format(CHATML)
    assert a.spec_yaml == b.spec_yaml and a.name == b.name
    assert a is not b                      # the cache keeps text, never a live object
    inf._CACHE.clear()
    assert cg.infer_format(CHATML).spec_yaml == a.spec_yaml
    assert cg.infer_format(CHATML, bos_token="<s>").name != a.name   # kwargs are in the key


def test_spec_yaml_loads_extends_and_pickles(tmp_path):
    fmt = cg.infer_format(CHATML)
    p = tmp_path / "mine.yaml"
    p.write_text(fmt.spec_yaml, encoding="utf-8")
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    assert cg.load_format(p).parse(text).trained_text() == ["Hello"]
    child = tmp_path / "child.yaml"
    child.write_text("name: mine-derived\nextends: mine.yaml\npolicy: {end_marker: true}\n",
                     encoding="utf-8")
    assert "".join(cg.load_format(child).parse(text).trained_text()) == "Hello<|im_end|>"
    again = pickle.loads(pickle.dumps(fmt))
    assert again.spec_yaml == fmt.spec_yaml and again.parse(text).trained_text() == ["Hello"]


def test_never_trains_a_role_it_did_not_see_as_assistant():
    fmt = cg.infer_format(CHATML)
    # a role name the template was never seen to write as the assistant's is not assistant
    with pytest.raises(cg.ParseError):
        fmt.parse("<|im_start|>bot\nforged<|im_end|>\n")
    conv = fmt.parse("<|im_start|>tool\nresult<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n")
    assert conv.trained_text() == []


def test_gemma_model_role_is_the_assistant_and_assistant_is_not_a_name():
    fmt = _infer("google-gemma-3-it.jinja", "gemma")
    assert fmt.spec.role_aliases.get("model") == "assistant"
    with pytest.raises(cg.ParseError):
        fmt.parse("<start_of_turn>assistant\nforged<end_of_turn>\n")


def test_tokenizer_decides_special_and_passes_its_tokens():
    class Tok(MarkerTokenizer):
        special_tokens_map = {"eos_token": "<|im_end|>"}

    tpl = CHATML.replace("<|im_end|>", "{{ eos_token }}")
    fmt = cg.infer_format(tpl, tokenizer=Tok(["<|im_start|>", "<|im_end|>"]))
    specials = {m.text: m.special for m in fmt.spec.markers.values()}
    assert specials == {"<|im_start|>": True, "<|im_end|>": True}
    # a marker that is no single id of the tokenizer is soft; verification also runs in id
    # mode with the tokenizer, and refuses the spec where that mode cannot parse it
    try:
        fmt2 = cg.infer_format(CHATML, tokenizer=Tok(["<|im_end|>"]))
    except cg.InferenceError as exc:
        assert "id mode" in str(exc)
    else:
        assert {m.text: m.special for m in fmt2.spec.markers.values()}["<|im_start|>"] is False


def test_resolve_format_prefers_a_bundled_one():
    fmt, how = inf.resolve_format(chat_template=_read("meta-llama-Llama-3.1-8B-Instruct.jinja"))
    assert (fmt.name, how) == ("llama3", "detected")
    # DeepSeek-V2's template now detects as the bundled deepseek-llm; AlphaMonarch's
    # `<s>user\n…</s>` family has no bundled format
    fmt, how = inf.resolve_format(chat_template=_read("infer/deepseek-v2.jinja"),
                                  bos_token="", eos_token="<｜end▁of▁sentence｜>")
    assert (fmt.name, how) == ("deepseek-llm", "detected")
    fmt, how = inf.resolve_format(chat_template=_read("infer/alphamonarch.jinja"),
                                  bos_token="<s>", eos_token="</s>")
    assert how == "inferred" and fmt.name.startswith("inferred-")


class _CallableTok(MarkerTokenizer):
    """A picklable one-id-per-marker tokenizer with the transformers call protocol."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}


def test_map_fn_auto_says_inferred():
    from chatgrammar.hf import map_fn

    tpl = _read("infer/alphamonarch.jinja")   # (no bundled format: OpenChat's is bundled now)
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    probe = cg.infer_format(tpl, **kw)

    tok = _CallableTok([m.text for m in probe.spec.markers.values()])
    tok.chat_template = tpl
    fn = map_fn("auto", tok, template_kwargs=kw)
    assert fn.format_source == "inferred" and "(inferred)" in repr(fn)
    out = pickle.loads(pickle.dumps(fn))({"messages": [TWO_EXCHANGES]})
    assert out["num_trained"][0] == len("Hello there") + len("Later")


# ------------------------------------------------------------------------ (c) bad input
PARTS_ONLY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for p in m.content %}"
              "{{ p.text }}{% endfor %}<|im_end|>\n{% endfor %}")
# prints no content at all, neither a string nor a list of text parts
NO_CONTENT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n<|im_end|>\n{% endfor %}")
NO_ASSISTANT = ("{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
                "<|end|>{% endif %}{% endfor %}")
SOME_SHAPES = ("{% for m in messages %}{% if m.role == 'system' %}"
               "{{ raise_exception('System role not supported') }}{% endif %}"
               "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


_LOOP = "{% for m in messages %}<|im_start|>{{ m.role }}HDR{{ m.content }}<|im_end|>SEP{% endfor %}"
#: Layouts written inline: name -> (template, a conversation's rendering trains exactly these
#: texts). Each is inferred and verified on the whole matrix.
LAYOUTS = {
    # a blank line after every role line ('assistant\n\n'): the header's lead, not output
    "blank-line-after-role": (
        _LOOP.replace("HDR", "\n\n").replace("SEP", "\n")
        + "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}",
        ["Hello there", "Later"]),
    # '<|endoftext|>' (no variable) written only when no generation prompt follows
    "closing-marker-without-prompt": (
        _LOOP.replace("HDR", "\n").replace("SEP", "\n")
        + "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<|endoftext|>"
          "{% endif %}", ["Hello there", "Later"]),
    # a closing run of markers (keshavchand's loss markers) instead, after a blank-line header
    "closing-markers-without-prompt": (
        _LOOP.replace("HDR", "\n\n").replace("SEP", "")
        + "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% else %}<|loss_start|>"
          "<|endoftext|><|loss_end|>{% endif %}", ["Hello there", "Later"]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_inline_layout_inferred(name):
    tpl, trained = LAYOUTS[name]
    fmt = cg.infer_format(tpl)
    assert len(fmt.verification.checked) == 20 and not fmt.verification.deviations
    text = render_chat(tpl, TWO_EXCHANGES)
    assert fmt.parse(text).trained_text() == trained
    # a turn of an unknown role is never assistant text
    with pytest.raises(cg.ParseError):
        fmt.parse(text.replace("<|im_start|>user", "<|im_start|>critic", 1))


def test_closing_marker_without_prompt_checks_with_the_bundled_chatml():
    # the checker's oracle takes the literal closing marker for a tail no message owns,
    # also where the rendering ends with the generation prompt (case generation-prompt)
    from chatgrammar.conformance.templates import check_template
    res = check_template(cg.load_format("chatml"), LAYOUTS["closing-marker-without-prompt"][0])
    assert res.ok and res.counts()["pass"] == 20, res.summary()


SHAREGPT = ("{% for m in messages %}{% if m['from'] == 'human' %}<|user|>{{ m['value'] }}<|end|>"
            "{% elif m['from'] == 'gpt' %}<|bot|>{{ m['value'] }}<|end|>{% else %}<|sys|>"
            "{{ m['value'] }}<|end|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|bot|>{% endif %}")


def test_sharegpt_template_inferred_and_checked_with_sharegpt_keys(tmp_path):
    # a template that reads ShareGPT's from / value only (axolotl / unsloth fine-tunes):
    # probed and verified with every message also in those keys; the saved spec's test
    # facts say so, and check_template gives them again
    from chatgrammar.conformance.matrix import SHAREGPT_FROM
    fmt = cg.infer_format(SHAREGPT)
    assert fmt.verification.content == "sharegpt" and len(fmt.verification.checked) >= 19
    msgs = [{**m, "from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in TWO_EXCHANGES]
    assert fmt.parse(render_chat(SHAREGPT, msgs)).trained_text() == ["Hello there", "Later"]
    p, spec = tmp_path / "sg.jinja", tmp_path / "sg.yaml"
    p.write_text(SHAREGPT, encoding="utf-8")
    assert main(["infer", str(p), "-o", str(spec)]) == 0
    assert "content: sharegpt" in (tmp_path / "sg.tests.yaml").read_text(encoding="utf-8")
    from chatgrammar.conformance.templates import check_template
    assert check_template(cg.load_format(spec), SHAREGPT).ok


@pytest.mark.parametrize("name,family", [("wild/alexsobolev-IcaroLM.jinja", "chatml"),
                                         ("wild/AliAbdelrasheed-maqa_llama_4bit.jinja", "llama3")])
def test_sharegpt_template_checks_with_the_bundled_format(name, family):
    # every string case is rejected ('dict object' has no attribute 'from'): the check runs
    # again with the messages also in ShareGPT's keys, as the template's data gives them
    from chatgrammar.conformance.templates import check_template
    res = check_template(cg.load_format(family), _read(name),
                         variables=_variables(family, name))
    assert res.ok and res.counts()["pass"] >= 19, res.summary()


def test_fixed_text_before_a_bundled_layout_extends_the_bundled_format():
    tpl = _read("wild/iboriss-gemma-4-12b-llamacpp.jinja")
    fmt = cg.infer_format(tpl, bos_token="<bos>", eos_token="<eos>")
    assert "extends: gemma4" in fmt.spec_yaml and "fixed_text" in fmt.spec.preamble
    # the saved spec loads (extends names the bundled format) and masks the same
    again = inf._from_yaml(fmt.spec_yaml)
    text = render_chat(tpl, TWO_EXCHANGES, bos_token="<bos>", eos_token="<eos>")
    assert again.parse(text).trained_text() == fmt.parse(text).trained_text()
    # without the fixed text in front, no such format: nothing to derive
    assert inf._after_fixed_text(CHATML, {}, None, "inferred-00000000") is None


def test_template_rejecting_some_shapes_is_recorded():
    fmt = cg.infer_format(SOME_SHAPES)
    assert "basic" in dict(fmt.verification.rejected)
    assert any("System role" in why for _, why in fmt.verification.probes_rejected)


@pytest.mark.parametrize("template,message", [
    (NO_CONTENT, "list of text parts"),
    (NO_ASSISTANT, "never emits an assistant turn"),
    ("{% for m in messages %}{{ m.content }}", "does not compile"),
    ("   ", "empty"),
    ("{{ bos_token + messages[0].content }}", "bos_token"),
    ("{{ ''.__class__.__mro__ }}", "[security]"),
])
def test_bad_templates_raise_inference_error(template, message):
    with pytest.raises(cg.InferenceError, match=re.escape(message)):
        cg.infer_format(template, **({} if "bos_token" in template else {}))



#: Templates no bundled format takes, that inference refuses on purpose (docs/inference.md,
#: "Families without a bundled format"): template -> (variables, the reason it must give).
REFUSED_UNBUNDLED = {
    # the last assistant message of a conversation is never rendered
    "infer/yandexgpt5.jinja": ({}, "rendered only once a later message follows it"),
    # additional_special_tokens[i] is read: a tokenizer variable, named as bos_token is
    "infer/gigachat-20b.jinja": ({"bos_token": "", "eos_token": ""},
                                 "needs the variable 'additional_special_tokens'"),
    # every user turn first, then every reply: the reason says so
    "wild/govindramesh-emergent-alignment.jinja": (
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "the template renders messages out of order (message [2] (user) is rendered before "
        "message [1] (assistant)"),
}


def test_vicuna_tool_results_as_answers_refused_by_the_inferred_format():
    """Vicuna 1.1 prints tool results with the assistant's header after a bare system text:
    the inferred spec reads the system text as the header of an opener-less question (the
    bundled vicuna shape) and lets an answer follow only a question, so tool results are
    located ParseErrors; the bundled vicuna format is detected first all the same."""
    tpl = _read("infer/vicuna-1.1.jinja")
    fmt = cg.infer_format(tpl)
    assert {c for c, _ in fmt.verification.refused} == {
        c.name for c in default_matrix() if "tool-results" in c.tags}
    assert cg.detect_format(None, chat_template=tpl).name == "vicuna"
    # the same layout with other role words (no bundled format has them)
    other = ("{% for m in messages %}{% if m.role == 'system' %}{{ m.content + '\n\n' }}"
             "{% elif m.role == 'user' %}{{ '### Human: ' + m.content + '\n' }}{% else %}"
             "{{ '### Assistant: ' + m.content + eos_token + '\n' }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}{{ '### Assistant:' }}{% endif %}")
    fmt = cg.infer_format(other, eos_token="</s>")
    assert len(fmt.verification.refused) == 5
    msgs = [{"role": "system", "content": "Be brief."}] + TWO_EXCHANGES
    conv = fmt.parse(render_chat(other, msgs, eos_token="</s>"))
    assert [t.strip() for t in conv.trained_text(OUTPUT_POLICY)] == ["Hello there", "Later"]
    with pytest.raises(cg.ParseError):
        fmt.parse(render_chat(other, msgs[:3] + [{"role": "tool", "content": "sunny"}],
                              eos_token="</s>"))


def test_tool_results_as_assistant_turns_are_refused_by_the_inferred_format():
    """Orca-Vicuna prints every non-user, non-system message with `ASSISTANT:`: the inferred
    spec lets an answer follow only a question (the bundled vicuna shape), so a tool result (an
    answer right after an answer) is a located ParseError, listed in `verification.refused`;
    conversations without tool messages train exactly the answers."""
    name = "infer/orca-vicuna.jinja"
    tpl, kw = _read(name), {"bos_token": "<s>", "eos_token": "</s>"}
    fmt = cg.infer_format(tpl, **kw)
    refused = dict(fmt.verification.refused)
    assert set(refused) == {c.name for c in default_matrix() if "tool-results" in c.tags}
    assert all(why.startswith(inf.TOOL_AS_ASSISTANT) for why in refused.values())
    assert "refuses 5 on purpose" in fmt.verification.summary()
    tool = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check."},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    for msgs, agp in ((tool, False), (tool, True),
                      (tool + [{"role": "assistant", "content": "Sunny."}], False)):
        with pytest.raises(cg.ParseError):
            fmt.parse(render_chat(tpl, msgs, add_generation_prompt=agp, **kw))
    conv = fmt.parse(render_chat(tpl, TWO_EXCHANGES, **kw))
    assert [t.strip() for t in conv.trained_text(OUTPUT_POLICY)] == ["Hello there", "Later"]
    # the bundled vicuna format refuses the same shapes: the cross-check agrees
    cc = inf.cross_check(fmt, cg.load_format("vicuna"), tpl, **kw)
    assert cc.agree, cc.differ


def test_a_format_that_parses_the_tool_shapes_is_preferred_to_one_that_refuses_them():
    # Falcon-RW chat: a candidate that refuses the tool shapes comes first, a later one parses
    # them; the later one is returned
    fmt = cg.infer_format(_read("wild/ericzzz-falcon-rw-1b-chat.jinja"),
                          bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    assert not fmt.verification.refused


@pytest.mark.parametrize("name", sorted(REFUSED_UNBUNDLED))
def test_unbundled_template_refused_with_a_reason(name):
    kw, why = REFUSED_UNBUNDLED[name]
    tpl = _read(name)
    with pytest.raises(cg.DetectionError):
        cg.detect_format(None, chat_template=tpl)
    with pytest.raises(cg.InferenceError, match=re.escape(why)):
        inf.resolve_format(chat_template=tpl, **kw)


def test_partial_detection_gives_way_to_an_exact_inferred_format():
    # Yi-1.5-Chat: ChatML with a bare system text before the first turn; the bundled chatml is
    # detected but only partly parses it (located ParseErrors); the inferred format verifies
    # on every case without a deviation, so resolve_format (mask -f auto, hf.map_fn) takes it
    tpl = _read("wild/01-ai-Yi-1.5-34B-Chat.jinja")
    kw = {"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>"}
    assert cg.detect_format(None, chat_template=tpl).name == "chatml"
    fmt, how = inf.resolve_format(chat_template=tpl, **kw)
    assert how == "inferred" and not fmt.verification.deviations
    msgs = [{"role": "system", "content": "Be brief."}] + TWO_EXCHANGES
    conv = fmt.parse(render_chat(tpl, msgs, **kw))
    assert conv.trained_text(OUTPUT_POLICY) == ["Hello there", "Later"]
    # a bundled format that verifies on the template stays
    name = "Qwen-Qwen2.5-7B-Instruct.jinja"
    fmt, how = inf.resolve_format(chat_template=_read(name), **_variables("chatml", name))
    assert (fmt.name, how) == ("chatml", "detected")


def test_cross_check_agrees_and_says_where_formats_differ():
    name = "Qwen-Qwen2.5-7B-Instruct.jinja"
    tpl = _read(name)
    cc = inf.cross_check(_infer(name, "chatml"), cg.load_format("chatml"), tpl,
                         **_variables("chatml", name))
    assert cc.agree and len(cc.equal) >= 15 and not cc.differ
    # GLM-Edge: an empty assistant message renders '<|assistant|>\n'; the bundled glm-edge
    # trains that '\n' (the model's first output after the prompt, as in every other turn),
    # the inferred spec lets the next marker's lstrip take it (docs/inference.md)
    name = "THUDM-glm-edge-1.5b-chat.jinja"
    tpl = _read(name)
    # (a deviation the bundled format makes on purpose: its tests.yaml `refused:` says so, and
    # the cross-check reports it as such, not as a difference)
    glm = cg.load_format("glm-edge")
    cc = inf.cross_check(_infer(name, "glm-edge"), glm, tpl)
    assert cc.agree and not cc.differ
    assert {c for c, _ in cc.refused} == {"tool-call", "tool-call-string-args",
                                          "parallel-tool-calls", "reasoning-tool-call",
                                          "empty-assistant"}
    assert all("glm-edge refuses it on purpose" in why for _, why in cc.refused)
    cc = inf.cross_check(_infer(name, "glm-edge"), glm, tpl, refused={})
    assert not cc.agree and not cc.refused
    assert all("masks differ (output)" in why for _, why in cc.differ)
    # a format that does not parse a rendering is a difference too, with its error (DeepSeek-V2
    # drops tool messages; deepseek-llm refuses the answer that follows on purpose)
    name = "deepseek-ai-DeepSeek-V2-Chat.jinja"
    tpl = _read(name)
    kw = _variables("deepseek-llm", name)
    ds = cg.load_format("deepseek-llm")
    cc = inf.cross_check(_infer(name, "deepseek-llm"), ds, tpl, **kw)
    assert cc.agree and len(cc.refused) == 5
    cc = inf.cross_check(_infer(name, "deepseek-llm"), ds, tpl, refused={}, **kw)
    assert cc.differ and all("deepseek-llm does not parse it" in why for _, why in cc.differ)


def test_hostile_template_hits_the_time_limit(monkeypatch):
    monkeypatch.setattr(inf, "TIMEOUT", 0.3)
    with pytest.raises(cg.InferenceError, match="time limit"):
        cg.infer_format("{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}"
                        "{% endfor %}")


def test_inference_error_is_a_chatgrammar_error():
    assert issubclass(cg.InferenceError, cg.ChatGrammarError)


# -------------------------------------------------------------------------------- CLI
def test_cli_prints_spec_and_summary(tmp_path, capsys):
    p = tmp_path / "t.jinja"
    p.write_text(CHATML, encoding="utf-8")
    assert main(["infer", str(p)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# inferred-") and "elements:" in out
    assert "verified on" in err
    spec = tmp_path / "s.yaml"
    assert main(["infer", str(p), "-o", str(spec)]) == 0
    out, _ = capsys.readouterr()
    assert "written to" in out and "verified on" in out
    assert cg.load_format(spec).name.startswith("inferred-")
    assert not (tmp_path / "s.tests.yaml").exists()   # nothing refused, nothing accepted


def test_cli_writes_the_refused_shapes_beside_the_spec(tmp_path, capsys):
    # the tool shapes an inferred format refuses on purpose go to <spec>.tests.yaml, so that
    # `chatgrammar validate SPEC --template T` passes the saved spec as inference verified it
    tpl = str(TEMPLATES / "infer" / "orca-vicuna.jinja")
    spec = tmp_path / "ov.yaml"
    assert main(["infer", tpl, "--var", "bos_token=<s>", "--var", "eos_token=</s>",
                 "-o", str(spec)]) == 0
    assert "ov.tests.yaml" in capsys.readouterr()[0]
    facts = _facts_of(cg.load_format(spec))
    assert set(facts["refused"]) == {c.name for c in default_matrix() if "tool-results" in c.tags}
    assert main(["validate", str(spec), "--template", tpl, "--var", "bos_token=<s>",
                 "--var", "eos_token=</s>"]) == 0


@pytest.mark.parametrize("template,code", [(NO_ASSISTANT, 1), ("{% if %}", 1), (None, 2)])
def test_cli_errors_are_one_line(tmp_path, capsys, template, code):
    p = tmp_path / "t.jinja"
    if template is not None:
        p.write_text(template, encoding="utf-8")
    assert main(["infer", str(p)]) == code
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_detect_says_inferred(tmp_path, capsys):
    p = tmp_path / "t.jinja"
    # a family no bundled format has, that needs no tokenizer variable
    p.write_text("{% for m in messages %}<|begin_turn|>{{ m.role }}\n{{ m.content }}"
                 "<|end_turn|>\n{% endfor %}{% if add_generation_prompt %}<|begin_turn|>"
                 "assistant\n{% endif %}", encoding="utf-8")
    assert main(["detect", "--template", str(p)]) == 0
    out, _ = capsys.readouterr()
    assert "no bundled format; inferred inferred-" in out
    # a detected format that only partly parses the template: detect says what auto uses
    assert main(["detect", "--template",
                 str(TEMPLATES / "wild" / "01-ai-Yi-1.5-34B-Chat.jinja")]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("format:   chatml") and "auto:     inferred-" in out


def test_real_tokenizer_markers_and_id_mode():
    from tests.tokenizers import qwen_fast_tokenizer

    tok = qwen_fast_tokenizer()
    fmt = _infer("Qwen-Qwen2.5-7B-Instruct.jinja", tokenizer=tok)   # eos_token from the tokenizer
    specials = {m.text: m.special for m in fmt.spec.markers.values()}
    assert specials["<|im_start|>"] and specials["<|im_end|>"] and specials["<tool_call>"]
    text = render_chat(_read("Qwen-Qwen2.5-7B-Instruct.jinja"), TWO_EXCHANGES)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = fmt.loss_mask(ids, tok)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello thereLater"


def test_mask_auto_falls_back_to_inference(tmp_path, capsys):
    import copy
    import json

    from tests.tokenizers import mistral_tokenizer

    # Mistral's vocabulary (its <s> / </s> are special ids) with a template no bundled format
    # speaks (`<s>ROLE\n…</s>`): detection says the two disagree, inference captures it
    tpl = _read("infer/alphamonarch.jinja")
    tok = copy.deepcopy(mistral_tokenizer("v3"))
    tok.chat_template = tpl
    d = tmp_path / "tok"
    tok.save_pretrained(str(d))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": TWO_EXCHANGES}) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(["mask", "--tokenizer", str(d), str(src), str(out)]) == 0
    err = capsys.readouterr().err
    assert "no bundled format; inferred" in err
    row = json.loads(out.read_text().splitlines()[0])
    trained = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert tok.decode(trained).replace(" ", "") == "HellothereLater"


def test_cache_keeps_nothing_alive():
    import gc
    import weakref

    # (the tokenizer itself is the adapter cache's business, chatgrammar.runtime.tokenizers)
    fmt = cg.infer_format(CHATML, tokenizer=MarkerTokenizer(["<|im_start|>", "<|im_end|>"]))
    fref = weakref.ref(fmt)
    del fmt
    gc.collect()
    assert fref() is None
    assert all(isinstance(y, str) and isinstance(v, inf.Verification)
               for y, v in inf._CACHE.values())


def test_an_accepted_deviation_is_never_silent():
    """A closeless layout's inferred format used to train the whitespace after a reply (the
    accepted unclosed-whitespace deviation, warned with a DeviationWarning); its turns are now
    `trim_end`: nothing deviates, nothing is warned, on the first call and from the cache."""
    import warnings

    import chatgrammar as cg

    template = ("{% for message in messages %}{% if message['role'] == 'user' %}"
                "{{ 'USER: ' + message['content'] + ' ' }}{% elif message['role'] == 'assistant' %}"
                "{{ 'ASSISTANT: ' + message['content'] + ' ' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}")
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fmt = cg.infer_format(template, bos_token="<s>", eos_token="</s>")
        assert not fmt.verification.deviations
        assert not any(issubclass(w.category, cg.DeviationWarning) for w in caught)
        text = "USER: Hi ASSISTANT: Hello there USER: Bye ASSISTANT: Later "
        assert [t.strip() for t in fmt.parse(text).trained_text()] == ["Hello there", "Later"]
        assert not any(t.endswith(" ") for t in fmt.parse(text).trained_text())


#: Real templates of the wild set captured by a general rule (docs/inference.md): template ->
#: (variables, what a two-exchange rendering trains).
WILD_CLASSES = {
    # Jinja indentation: the generation prompt's leading whitespace differs from the history's
    "wild/LLM360-AmberChat.jinja": ({"bos_token": "<s>", "eos_token": "</s>"},
                                    [" Hello there", " Later"]),
    "wild/nvidia-ChatQA.jinja": ({"bos_token": "<s>", "eos_token": "</s>"},
                                 [" Hello there", " Later"]),
    "wild/vllm-template_llava.jinja": ({"bos_token": "<s>", "eos_token": "</s>"},
                                       [" Hello there", " Later"]),
    "wild/vllm-template_qwen2_audio.jinja": ({"eos_token": "<|im_end|>"},
                                             ["Hello there", "Later"]),
    # no generation prompt at all: the prompt ends at <|im_start|>, the role line is output
    "wild/NLPark-AnFeng_v3_Avocet.jinja": ({}, ["assistant\nHello there", "assistant\nLater"]),
    # tool results written as user turns ('<|user|>\nTool response for NAME:\n…')
    "wild/sglang-tool_chat_template_phi4mini.jinja": ({}, ["\nHello there", "\nLater"]),
    # a system message written exactly as a user turn
    "wild/FairMind-Phi-3-mini-4k-instruct-bnb-4bit-Ita.jinja": ({"bos_token": "<s>"},
                                                                ["Hello there", "Later"]),
    # tool declarations as bare text before the first turn, ended with <|im_end|>
    "wild/vllm-tool_chat_template_hermes.jinja": ({"eos_token": "<|im_end|>"},
                                                  ["Hello there", "Later"]),
    # a generation prompt always printed, prefilling text history replies lack
    "wild/ServiceNow-AI-Apriel-1.6-15b-Thinker-fixed.jinja": ({"bos_token": "<s>"},
                                                              ["Hello there", "Later"]),
    # an empty reply written 'Assistant: </s>': the space is no output (trim_end)
    "wild/OpenBuddy-openbuddy-mistral2-7b-v20.3-32k.jinja": ({"eos_token": "</s>"},
                                                            [" Hello there", " Later"]),
    # Jinja indentation between turns ('\n    ' before each header, lstripped by the openers)
    # and after the last one (`trailing`); the final prompt with that indentation trains nothing
    "wild/chujiezheng-openchat.jinja": ({"bos_token": "<s>", "eos_token": "<|end_of_turn|>"},
                                        [" Hello there", " Later"]),
    # Jinja indentation before a BOS printed before every question ('        <s>[INST] …':
    # the between-turn marker lstrips it) and a newline after '[/INST]' that the reply's
    # indentation follows (no generation prompt: the indentation is output, the newline the
    # question's: '[/INST]\n' joined)
    "wild/chujiezheng-mistral.jinja": ({"bos_token": "<s>", "eos_token": "</s>"},
                                       ["         Hello there ", "         Later "]),
    # a generation prompt printed after every conversation, '…<|end_header_id|>\n', while
    # history replies follow '…<|end_header_id|>\n\n': the forced prompt is the assistant
    # header and the second newline is output (before, the spec did not compile)
    "wild/theroyallab-chatml_with_headers.jinja": ({"bos_token": "", "eos_token": "<|im_end|>"},
                                                   ["\nHello there", "\nLater"]),
    # a Qwen3 fine-tuning template whose history replies follow '<|im_start|>assistant' with
    # no newline (the prompt has one) and whose tool results are user turns: whole headers
    # tell the roles apart, the tool results parse as the user turns they are written as
    "wild/opfernandez-qwen3.jinja": ({"bos_token": "", "eos_token": "<|im_end|>"},
                                     ["Hello there", "<think>\n\n</think>", "\n\nLater"]),
    # '#' comment lines written as text before every conversation, then Gemma 4: the bundled
    # gemma4, derived (extends) with that text as an untrained preamble marker
    "wild/iboriss-gemma-4-12b-llamacpp.jinja": ({"bos_token": "<bos>", "eos_token": "<eos>"},
                                                ["Hello there", "Later"]),
}


@pytest.mark.parametrize("name", sorted(WILD_CLASSES))
def test_wild_template_classes_are_captured(name):
    kw, want = WILD_CLASSES[name]
    tpl = _read(name)
    fmt = cg.infer_format(tpl, **kw)
    v = fmt.verification
    assert len(v.checked) >= 14 and not v.deviations, v.summary()
    assert fmt.parse(render_chat(tpl, TWO_EXCHANGES, **kw)).trained_text() == want
    # a turn of another family is never assistant text: a ParseError, or nothing trained
    try:
        conv = fmt.parse("<s>[INST] Hi [/INST] Hello there</s>")
    except cg.ParseError:
        return
    assert not conv.trained_text(OUTPUT_POLICY)


def test_tool_declarations_written_as_bare_text():
    # vLLM's Hermes tool template: 'You are a function calling AI model … <tools> … </tools>
    # … <tool_call>…</tool_call><|im_end|>' before the first '<|im_start|>' turn, only when
    # tools are declared: an untrained system element of the preamble, closed by <|im_end|>,
    # whose marker-shaped words are its inner markers; the call trains, the result does not
    tpl, kw = _read("wild/vllm-tool_chat_template_hermes.jinja"), {"eos_token": "<|im_end|>"}
    fmt = cg.infer_format(tpl, **kw)
    el = fmt.spec.elements["tool_declarations_text"]
    assert el.role == "system" and "tool_declarations_text" in fmt.spec.preamble
    c = next(x for x in default_matrix() if x.name == "tool-call")
    text = render_case(tpl, c, **kw).text
    trained = fmt.parse(text).trained_text(OUTPUT_POLICY)
    assert any("get_weather" in t and "<tool_call>" in t for t in trained)
    assert not any("function calling AI model" in t or "temperature" in t for t in trained)
    # its call writes the arguments before the name: still one tool_call block
    conv = fmt.parse(text)
    calls = [s for s in conv.spans(OUTPUT_POLICY) if s.kind == "tool_call"]
    assert calls and "get_weather" in text[calls[0].start:calls[0].end]
    assert not any("get_weather" in t for t in conv.trained_text(
        OUTPUT_POLICY.replace(tool_calls=False)))


def test_forced_prompt_prefill_is_a_generation_prompt():
    # Apriel 1.6 ends every conversation before a reply with '<|begin_assistant|>\nHere are my
    # reasoning steps:\n', which history replies lack: the header is what both have, the
    # prefill is one of the generation prompts (a final one trains nothing)
    tpl = _read("derived/Apriel-1.6-15b-Thinker-fixed.jinja")
    fmt = cg.infer_format(tpl, bos_token="<s>")
    assert any(g.endswith("Here are my reasoning steps:\n") for g in fmt.spec.generation_prompt)
    text = render_chat(tpl, TWO_EXCHANGES[:3], bos_token="<s>", add_generation_prompt=True)
    assert fmt.parse(text).trained_text() == ["Hello there"]


def test_indented_generation_prompt_trains_nothing():
    # chujiezheng's openchat template writes '\n    ' before every header, the final prompt
    # included: the opener lstrips it into the last turn, which is still the prompt
    kw = {"bos_token": "<s>", "eos_token": "<|end_of_turn|>"}
    tpl = _read("wild/chujiezheng-openchat.jinja")
    fmt = cg.infer_format(tpl, **kw)
    text = render_chat(tpl, TWO_EXCHANGES[:3], add_generation_prompt=True, **kw)
    assert text.endswith("\n    GPT4 Correct Assistant:\n")
    conv = fmt.parse(text)
    assert conv.trained_text() == [" Hello there"]
    assert conv.turns[-1].generation_prompt
    # the whitespace after the last turn is no turn and never trains
    full = render_chat(tpl, TWO_EXCHANGES, **kw)
    assert full.endswith("\n") and fmt.spec.trailing == "\\s*"
    assert fmt.parse(full + "\n  \n").trained_text() == [" Hello there", " Later"]


def test_reply_that_starts_with_the_headers_newline():
    # a Ministral 3 fine-tune: no generation prompt, history replies start with a newline
    # ('[/INST]\nA</s>\n\n'): that newline is the headerless reply's `lead` (never output), the
    # '\n\n' after the last turn is `trailing`; a ChatML turn is never assistant text
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    tpl = _read("wild/NC0DER-Maistros-Ministral-3-8B-Instruct-2512.jinja")
    fmt = cg.infer_format(tpl, **kw)
    assert len(fmt.verification.checked) >= 19 and not fmt.verification.deviations
    assert fmt.spec.elements["reply"].lead == ["\n"]
    assert fmt.parse(render_chat(tpl, TWO_EXCHANGES, **kw)).trained_text() == [
        "Hello there", "Later"]
    try:
        conv = fmt.parse("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>")
    except cg.ParseError:
        return
    assert not conv.trained_text(OUTPUT_POLICY)


def test_fixed_block_between_turns_is_an_untrained_element():
    # Jibay's template writes '<[role_reasoning_effort]>\nReasoning Effort is Medium\n
    # <[role_reasoning_effort_end]>' after the system turn, whatever the conversation: a
    # marker, text holding no message, its twin ('<[x]>' / '<[x_end]>') is an element of its
    # own, role system, never trained; a forged assistant header there is no turn either
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    tpl = _read("wild/Jibay-Ai-Jibay_Chat_Format.jinja")
    fmt = cg.infer_format(tpl, **kw)
    assert len(fmt.verification.checked) >= 19
    block = fmt.spec.elements["fixed_block"]
    assert block.role == "system" and fmt.spec.markers[block.open[0]].text == \
        "<[role_reasoning_effort]>"
    text = render_chat(tpl, TWO_EXCHANGES, **kw)
    assert "Reasoning Effort is Medium" in text
    assert fmt.parse(text).trained_text() == ["Hello there", "Later"]
    forged = text.replace("Reasoning Effort is Medium", "<[role_assistant]>Sure")
    try:
        conv = fmt.parse(forged)
    except cg.ParseError:
        return
    assert "Sure" not in "".join(conv.trained_text(OUTPUT_POLICY))


def test_no_generation_prompt_after_a_role_marker():
    # SLM-ToG writes '[ASSISTANT]: A' and prints nothing for add_generation_prompt: the prompt
    # ends at the marker, so ': ' is the reply's first characters, not a header lead
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    tpl = _read("wild/yijie-cheng-SLM-ToG.jinja")
    fmt = cg.infer_format(tpl, **kw)
    assert len(fmt.verification.checked) >= 19
    text = render_chat(tpl, TWO_EXCHANGES, **kw)
    assert fmt.parse(text).trained_text() == [": Hello there", ": Later"]


def _trained(fmt, tpl, msgs, agp=False, **kw) -> list:
    return fmt.parse(render_chat(tpl, msgs, add_generation_prompt=agp, **kw)).trained_text(
        OUTPUT_POLICY)


def test_whole_headers_open_turns_when_role_names_have_no_separator():
    # skrkc's hydrology ChatML writes '<|im_start|>user\n' but '<|im_start|>assistant' glued to
    # the reply: no separator ends every role name, so each whole header is an opener of its
    # own (a tool turn closes with the others' '<|im_end|>' after its '</tool_response>')
    kw = {"eos_token": "<|im_end|>"}
    tpl = _read("wild/skrkc-hydrology-tool-assistant.jinja")
    fmt = cg.infer_format(tpl, **kw)
    assert len(fmt.verification.checked) == 20 and not fmt.verification.refused
    assert [t.strip() for t in _trained(fmt, tpl, TWO_EXCHANGES, **kw)] == ["Hello there",
                                                                           "Later"]
    assert [t for t in _trained(fmt, tpl, TWO_EXCHANGES[:3], True, **kw)] == ["Hello there"]
    forged = render_chat(tpl, TWO_EXCHANGES, **kw).replace("<|im_start|>user\nBye",
                                                           "<|im_start|>botBye")
    with pytest.raises(cg.ParseError):
        fmt.parse(forged)


def test_a_role_name_without_separator_keeps_the_precise_refusal():
    # Harmony's roles share '<|start|>' with no common separator: read by whole headers it does
    # not verify either, so the role-name form's reason is the one reported
    with pytest.raises(cg.InferenceError, match="no common separator"):
        _infer("openai-gpt-oss-120b.jinja", "harmony")


@pytest.mark.parametrize("name,kw,prompt", [
    # '### Assistant: ' as the prompt, '### assistant: ' in history (Asimov)
    ("wild/prithivida-Asimov-7B-v2.jinja", {"bos_token": "<s>", "eos_token": "</s>"},
     "### Assistant: "),
    # '<s>bot\n' as the prompt, '<s>assistant\n' in history; the system turn is printed only
    # once a user message follows it (saiga)
    ("wild/chujiezheng-saiga.jinja", {"bos_token": "<s>", "eos_token": "</s>"}, "<s>bot\n"),
])
def test_a_generation_prompt_that_names_the_assistant_otherwise(name, kw, prompt):
    tpl = _read(name)
    fmt = cg.infer_format(tpl, **kw)
    assert len(fmt.verification.checked) >= 14 and not fmt.verification.refused
    msgs = [{"role": "system", "content": "Be brief."}] + TWO_EXCHANGES
    assert [t.strip().removesuffix("</s>") for t in _trained(fmt, tpl, msgs, **kw)] == [
        "Hello there", "Later"]
    text = render_chat(tpl, msgs[:4], add_generation_prompt=True, **kw)
    assert prompt in text
    assert [t.strip().removesuffix("</s>") for t in fmt.parse(text).trained_text(
        OUTPUT_POLICY)] == ["Hello there"]   # the final prompt trains nothing
    # the system text never trains, and a header naming another role is no assistant turn
    assert "Be brief." not in "".join(_trained(fmt, tpl, msgs, **kw))
    forged = render_chat(tpl, msgs, **kw).replace("Bye", prompt.replace("ssistant", "gent")
                                                  .replace("bot", "bat") + "Sure")
    try:
        conv = fmt.parse(forged)
    except cg.ParseError:
        return
    assert "Sure" not in "".join(conv.trained_text(OUTPUT_POLICY))


def test_a_system_prompt_printed_twice_is_text_before_the_first_turn():
    # PiVoT-MoE prints the last system message, then every message (the system one again):
    # no copy is a turn of its own; both are the bare system text before the first turn
    tpl = _read("wild/maywell-PiVoT-MoE.jinja")
    fmt = cg.infer_format(tpl)
    assert len(fmt.verification.checked) == 20
    msgs = [{"role": "system", "content": "Be brief."}] + TWO_EXCHANGES
    assert render_chat(tpl, msgs).startswith("Be brief.Be brief.")
    assert [t.strip() for t in _trained(fmt, tpl, msgs)] == ["Hello there", "Later"]


def test_marker_shaped_strings_with_a_space_before_the_bar():
    # axolotl's Aya template writes '<|START_OF_TURN_TOKEN |><|USER_TOKEN |>' (a space before
    # '|>'): still marker-shaped, soft (no tokenizer has them as one id)
    kw = {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>"}
    tpl = _read("wild/axolotl-aya.jinja")
    fmt = cg.infer_format(tpl, **kw)
    assert len(fmt.verification.checked) >= 14
    assert {"<|USER_TOKEN |>", "<|CHATBOT_TOKEN |>"} <= {m.text for m in
                                                        fmt.spec.markers.values()}
    assert not any(m.special for m in fmt.spec.markers.values() if " " in m.text)
    assert [t.strip() for t in _trained(fmt, tpl, TWO_EXCHANGES, **kw)] == ["Hello there",
                                                                           "Later"]


def test_tool_results_as_assistant_turns_refusal_says_no_format_is_returned():
    # StableLM's template prints every non-user message as '<|ASSISTANT|>': from the text a
    # tool result cannot be told from a reply, and a mask sees only the text, so even a
    # format for conversations without tool messages would be a silent wrong mask on one
    # with them: the whole template is refused, saying so
    with pytest.raises(cg.InferenceError, match="no format is returned, not even for "
                                                "conversations without tool messages"):
        inf.resolve_format(chat_template=_read("wild/theroyallab-stablelm.jinja"),
                           bos_token="<s>", eos_token="</s>")


def test_a_tool_name_after_the_role_word_is_read_as_an_attribute():
    # a ChatML layout that writes the tool's name in the tool result's header
    # ('<|im_start|>tool name=get_weather\n'): the role is the word, the name an attribute
    # allowed after 'tool' only, so 'assistant name=…' is no assistant turn
    tpl = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] }}{% if m['role'] == 'tool' %}"
           "{{ ' name=' + m['name'] }}{% endif %}{{ '\\n' + m['content'] + '<|im_end|>\\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    fmt = cg.infer_format(tpl)
    assert len(fmt.verification.checked) >= 19 and not fmt.verification.refused
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check."},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."}]
    text = render_chat(tpl, msgs)
    assert "<|im_start|>tool name=get_weather\n" in text
    assert fmt.parse(text).trained_text(OUTPUT_POLICY) == ["Let me check.", "Sunny."]
    with pytest.raises(cg.ParseError):
        fmt.parse(text.replace("tool name=get_weather", "assistant name=get_weather"))


def test_long_jinja_indentation_reads_alike_in_both_modes():
    # chujiezheng's Falcon template, indented in Jinja without whitespace control: every
    # rendering starts with 19 chars of spaces and newlines, one id each for the conformance
    # MarkerTokenizer. Id mode read `between` text within 16 ids, so it took that indentation
    # for a bare system prompt, trained under roles+system (text mode did not): a silent
    # wrong mask under that policy. Read within BETWEEN_MAX_TOKENS (64) ids, both agree.
    from chatgrammar.conformance.policies import POLICIES
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    tpl = _read("wild/chujiezheng-falcon.jinja")
    fmt = cg.infer_format(tpl, **kw)
    text = render_chat(tpl, TWO_EXCHANGES, **kw)
    assert text.startswith(" " * 8 + "\n" + " " * 8 + "\n")
    synth = MarkerTokenizer.for_format(fmt)
    ids, starts = synth.encode_with_offsets(text)
    bounds = starts + [len(text)]
    for policy in (OUTPUT_POLICY, POLICIES["roles+system"]):
        by_text = [text[s.start:s.end] for s in fmt.parse(text).spans(policy)]
        by_ids = [text[bounds[s.start]:bounds[s.end]] for s in
                  fmt.parse_ids(ids, synth).spans(policy)]
        assert by_ids == by_text
        assert [t.strip() for t in by_text] == ["Hello there", "Later"]


def test_reasoning_closer_alone_is_an_empty_reasoning_block():
    # Poolside's Laguna XS.2 (2026): a reply without reasoning is '<assistant>\n</think>\nA',
    # one with reasoning '<assistant>\n<think>\nR\n</think>\nA'. The first reading took
    # '\n</think>' for the reply header and refused the second ('<think>' inside a header);
    # the closer alone is an empty reasoning block (a text-less element of the think kind)
    kw = {"bos_token": "\u3008|EOS|\u3009", "eos_token": "\u3008|EOS|\u3009"}
    tpl = _read("wild/poolside-Laguna-XS.2.jinja")
    fmt = cg.infer_format(tpl, **kw)
    assert len(fmt.verification.checked) >= 18
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there", "reasoning_content": "greet"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Later"}]
    text = render_chat(tpl, msgs, **kw)
    assert "<assistant>\n<think>\ngreet\n</think>\nHello there" in text
    assert "<assistant>\n</think>\nLater" in text
    conv = fmt.parse(text)
    assert [t.strip() for t in conv.trained_text(cg.MaskPolicy(thinking=False))] \
        == ["Hello there", "Later"]
    assert "greet" in "".join(conv.trained_text(OUTPUT_POLICY))


#: Real templates that print message content only when it is a list of text parts (a string
#: prints nothing, or raises): vision fine-tunes' multimodal layout -> (variables, what a
#: two-exchange rendering with content as parts trains).
PARTS_CLASSES = {
    # a SmolVLM fine-tune: 'User: …<end_of_utterance>\nAssistant: …' over `for line in content`
    "wild/Timestep-AI-timestep.jinja": ({"eos_token": "<|im_end|>"}, [" Hello there", " Later"]),
    # the same, with content[0].get('type') (a string content raises) and <tool_call> blocks
    "wild/mjschock-timestep.jinja": ({"eos_token": "<|im_end|>"}, [" Hello there", " Later"]),
    # axolotl's LLaVA: 'USER: … ASSISTANT: … ', a bare system text, no terminator but the EOS
    "wild/axolotl-llava.jinja": ({"bos_token": "<s>", "eos_token": "</s>"},
                                 [" Hello there", " Later"]),
}


@pytest.mark.parametrize("name", sorted(PARTS_CLASSES))
def test_content_only_as_text_parts_is_verified_with_text_parts(name):
    from chatgrammar.conformance.matrix import as_parts, get_case
    from chatgrammar.conformance.templates import check_template, content_shape

    kw, want = PARTS_CLASSES[name]
    tpl = _read(name)
    fmt = cg.infer_format(tpl, **kw)
    v = fmt.verification
    assert v.content == "parts" and content_shape(fmt) == "parts"
    assert len(v.checked) >= 14 and not v.deviations and "text parts" in v.summary()
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in TWO_EXCHANGES]
    assert [t.strip() for t in fmt.parse(render_chat(tpl, parts, **kw)).trained_text()] == \
        [w.strip() for w in want]
    # the check of the format (what `tools/wild.py` runs) gives the matrix content as parts
    res = check_template(fmt, tpl, variables=kw, cases=[as_parts(get_case("basic"))])
    assert res.ok, [c.reason for c in res.cases]
    # a string content prints nothing (or the template raises): nothing but whitespace trains,
    # never a user's or a system's text
    for case in default_matrix():
        if "content-parts" in case.tags:
            continue   # already given as parts
        try:
            text = render_case(tpl, case, **kw).text
        except TemplateError:
            continue
        try:
            trained = fmt.parse(text).trained_text(OUTPUT_POLICY)
        except cg.ParseError:
            continue
        assert not "".join(trained).strip(), (case.name, trained)


def test_parts_only_template_is_inferred_with_parts():
    fmt = cg.infer_format(PARTS_ONLY)
    assert fmt.verification.content == "parts"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]
    # no generation prompt: the role line is output (docs/inference.md, NLPark's AnFeng)
    assert fmt.parse(render_chat(PARTS_ONLY, msgs)).trained_text() == ["assistant\nHello"]


def test_round_counter_in_the_user_header():
    # LongCat-Flash-Chat: '[Round 0] USER:Q ASSISTANT:A</longcat_s> [Round 1] USER:…': the
    # user header carries a per-round counter; it becomes chatglm2's counter header (open at
    # the text before the number, header until the text after it, pattern [0-9]{1,6}). Its
    # tool declarations are bare text before the first turn with no close ('# Tools … #
    # Messages\n'): an untrained preamble element that ends where the first turn opens
    kw = {"bos_token": "<longcat_s>", "eos_token": "</longcat_s>"}
    tpl = _read("infer/longcat-flash-chat-no-thinking-switch.jinja")
    fmt = cg.infer_format(tpl, **kw)
    v = fmt.verification
    assert len(v.checked) >= 14 and "tools-declared" in v.checked, v.summary()
    assert any("counter" in n for n in v.notes)
    user = next(el for el in fmt.spec.elements.values() if el.role == "user")
    assert user.header is not None
    text = render_chat(tpl, TWO_EXCHANGES + [{"role": "user", "content": "Again"},
                                             {"role": "assistant", "content": "Sure"}], **kw)
    assert "[Round 2] USER:Again" in text
    assert fmt.parse(text).trained_text() == ["Hello there", "Later", "Sure"]
    # a round header is never an assistant turn, whatever its number
    with pytest.raises(cg.ParseError):
        fmt.parse("[Round 0] USER:Hi ASSISTANT:Hello</longcat_s> [Round x] USER:Bye")


def test_a_thinking_switch_written_before_the_assistant_header():
    # LongCat-Flash-Chat's prompts write a switch in words before the assistant header that
    # history replies lack: ' /think_on ASSISTANT:<longcat_think>\n', ' /think_off
    # ASSISTANT:<longcat_think>\n\n</longcat_think>\n', replies ' ASSISTANT:A</longcat_s>'.
    # The switch is prompt text (read as the user turn's), the header is never output (the
    # checker's oracle: whatever the prompt writes is prompt, also where it writes it after a
    # switch), and the prompt's final turn is what follows the switch
    from chatgrammar.conformance.matrix import get_case
    from chatgrammar.conformance.templates import check_template

    kw = {"bos_token": "<longcat_s>", "eos_token": "</longcat_s>"}
    tpl = _read("wild/meituan-longcat-LongCat-Flash-Chat.jinja")
    fmt = cg.infer_format(tpl, **kw)
    v = fmt.verification
    assert {"reasoning-thinking-on", "reasoning-thinking-off",
            "generation-prompt-thinking-off", "multi-turn"} <= set(v.checked), v.summary()
    msgs = TWO_EXCHANGES[:1]
    for think, after in ((True, "<longcat_think>\n"),
                         (False, "<longcat_think>\n\n</longcat_think>\n")):
        text = render_chat(tpl, msgs, add_generation_prompt=True, enable_thinking=think, **kw)
        assert text.endswith(" ASSISTANT:" + after) and "/think_" in text
        conv = fmt.parse(text)
        assert not "".join(conv.trained_text(OUTPUT_POLICY)).strip()
        assert not "".join(conv.trained_text(OUTPUT_POLICY.replace(
            last_turn_only=True))).strip()
    text = render_chat(tpl, TWO_EXCHANGES, enable_thinking=True, **kw)
    assert fmt.parse(text).trained_text() == ["Hello there", "Later"]
    # the oracle: with the switch, the reply's header is not output (it is in the prompt)
    res = check_template(fmt, tpl, variables=kw, cases=[get_case("reasoning-thinking-on")])
    assert res.ok and any("before the header" in n for c in res.cases for n in c.notes)
    # a tool result is refused (a located ParseError), never trained
    assert {c for c, _ in v.refused} >= {"tool-call", "parallel-tool-calls"}


def test_a_marker_written_after_a_call_in_place_of_the_terminator_ends_the_turn():
    # Solar Open: '<|begin|>assistant<|tool_calls|>…<|tool_call:end|><|calls|><|begin|>tool…'
    # where other replies end with '<|end|>': '<|calls|>' closes the turn (trained only with
    # end_marker, as the bundled solar-open says), the call block ends with its turn
    tpl = _read("upstage-Solar-Open-100B.jinja")
    fmt = cg.infer_format(tpl)
    assert not fmt.verification.refused and len(fmt.verification.checked) >= 19
    reply = next(el for el in fmt.spec.elements.values() if el.role == "assistant" and el.close)
    assert "<|calls|>" in [fmt.spec.markers[m].text for m in reply.close.markers]
    text = render_case(tpl, next(c for c in default_matrix() if c.name == "tool-call")).text
    conv = fmt.parse(text)
    assert not any("<|calls|>" in t for t in conv.trained_text(OUTPUT_POLICY))
    assert any("<|calls|>" in t for t in conv.trained_text(WITH_END))
    assert any("get_weather" in t for t in conv.trained_text(OUTPUT_POLICY))
    assert not any("get_weather" in t for t in conv.trained_text(
        OUTPUT_POLICY.replace(tool_calls=False)))


def test_a_saved_parts_only_spec_is_validated_with_text_parts(tmp_path, capsys):
    # a saved inferred spec has no `verification`: `chatgrammar infer -o` writes the content
    # shape it was verified with into SPEC.tests.yaml (`content: parts`), so `chatgrammar
    # validate SPEC --template T` checks the saved spec over the same parts matrix; without it,
    # the string matrix renders no message text and every case fails
    from chatgrammar.conformance.templates import content_shape

    tpl = str(TEMPLATES / "wild" / "Timestep-AI-timestep.jinja")
    spec = tmp_path / "ts.yaml"
    assert main(["infer", tpl, "--var", "eos_token=<|im_end|>", "-o", str(spec)]) == 0
    assert "ts.tests.yaml" in capsys.readouterr()[0]
    assert "content: parts" in spec.read_text(encoding="utf-8")   # said in the spec's header
    saved = cg.load_format(spec)
    assert _facts_of(saved)["content"] == "parts" and content_shape(saved) == "parts"
    assert main(["validate", str(spec), "--template", tpl, "--var", "eos_token=<|im_end|>"]) == 0
    capsys.readouterr()
    (tmp_path / "ts.tests.yaml").unlink()
    assert main(["validate", str(spec), "--template", tpl, "--var", "eos_token=<|im_end|>"]) == 1


def test_tool_call_opener_unclosed_in_tool_instructions_stays_a_typed_call():
    # The community "Qwen3.6 Barubary v2" template (wild/pok14575-ops-Vivianna.jinja) prints
    # '<tool_call>' unclosed in its tool instructions: the call block's close may be missing
    # (`close.required: false` on a child), so calls stay typed instead of plain text, and
    # tool_calls=False drops them without a DeviationWarning
    tpl = _read("wild/pok14575-ops-Vivianna.jinja")
    fmt = cg.infer_format(tpl)
    el = fmt.spec.elements["tool_call"]
    assert el.close is not None and not el.close.required
    assert not fmt.spec.plain_text_tool_calls and "tools-declared" in fmt.verification.checked
    text = render_case(tpl, next(c for c in default_matrix() if c.name == "tool-call")).text
    conv = fmt.parse(text)
    assert any("get_weather" in t for t in conv.trained_text(OUTPUT_POLICY))
    with warnings.catch_warnings():
        warnings.simplefilter("error", cg.DeviationWarning)
        dropped = conv.trained_text(OUTPUT_POLICY.replace(tool_calls=False))
    assert not any("get_weather" in t for t in dropped)
