"""Real variants of the bundled families, and "a marker the spec does not know is never
assistant text".

1. **Variant templates** (data-driven): every template of a ``formats/<name>.tests.yaml`` that is a
   variant of its family — under ``tests/data/templates/derived/`` (llama.cpp, Unsloth and
   Hugging Face revisions; provenance in tests/data/templates/SOURCES.md) or listed in
   :data:`VARIANTS_AT_TOP` — is rendered over the whole conversation matrix exactly as
   transformers renders it, and each case must parse and train exactly the assistant output in
   text mode and in id mode (one id per marker), through
   :func:`chatgrammar.conformance.templates.check_template`. Shapes the template rejects are skipped, and
   :data:`MIN_PASS` says how many cases of each template must really be checked.
2. **Unknown markers** (:mod:`chatgrammar.runtime.parse`, ``_Ctx._unknown_markers``): a string shaped
   like the format's special markers that is none of them (text mode), or a special/added id of
   such a text (id mode), inside a turn of a trained role is a located ``ParseError`` in strict
   mode, and in lenient mode a warning and nothing trained of that turn — on the full parse
   (``fmt.parse`` / ``fmt.parse_ids``) and on the memoised fast path (``fmt.loss_mask`` /
   ``fmt.loss_masks``), which must agree with the full parse.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

import chatgrammar as cg
from chatgrammar.conformance.templates import OUTPUT_POLICY, check_template
from chatgrammar.conformance.matrix import default_matrix, get_case
from chatgrammar.conformance.render import render_chat

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ROOT / "formats"
TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"

#: Variants of a family that sit at the top of tests/data/templates (not under derived/).
VARIANTS_AT_TOP = {"LFM2-8B-A1B.jinja", "fireworks-ai-llama-3-firefunction-v2.jinja"}

#: How many matrix cases each variant template must pass (the others it rejects: tool shapes
#: of the llama.cpp-edited Kimi templates call ``list.append`` in a sandbox that forbids it,
#: llama.cpp's R1 template cannot ``tojson`` a generator, content parts where templates
#: concatenate strings).
MIN_PASS = {
    "derived/Kimi-K2-Instruct.jinja": 15,
    "derived/Kimi-K2-Thinking.jinja": 15,
    "derived/llama-cpp-deepseek-r1.jinja": 13,
    "derived/unsloth-Nemotron-3-Nano.jinja": 19,
    "derived/llama-cpp-lfm2.jinja": 19,
    "LFM2-8B-A1B.jinja": 19,
    "derived/llama-cpp-microsoft-Phi-4-mini-instruct.jinja": 19,
    "derived/gemma4.jinja": 20,
    "derived/unsloth-Magistral-Small-2509.jinja": 20,
    "derived/unsloth-mistral-Devstral-Small-2507.jinja": 20,
    "derived/unsloth-Apriel-1.5.jinja": 20,
    "derived/THUDM-glm-4-9b-chat.jinja": 20,
    "derived/Apriel-1.6-15b-Thinker-fixed.jinja": 17,
    "fireworks-ai-llama-3-firefunction-v2.jinja": 16,   # reads `functions`, `datetime`
}

#: Cases a variant template is known to fail, with the reason (docs/formats.md says the same).
KNOWN_FAIL = {
    # the template writes "\n<|end|>" after a history reply and nothing after the final one:
    # the oracle gives that "\n" to the next message, the format to the reply (as in 1.5)
    "derived/Apriel-1.6-15b-Thinker-fixed.jinja": {"multi-turn", "multi-turn-no-system",
                                                   "generation-prompt"},
}


def _variants() -> list[tuple[str, str, dict]]:
    out = []
    for p in sorted(FORMATS.glob("*.tests.yaml")):
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        name = p.name[:-len(".tests.yaml")]
        for t in data.get("templates") or ():
            f = t["file"]
            if f.startswith("derived/") or f in VARIANTS_AT_TOP:
                out.append((name, f, dict(t.get("vars") or {})))
    # Apriel 1.6 is not in apriel.tests.yaml (not claimed yet: 17/20, no detector); its
    # matrix is still pinned here with its known failures
    out.append(("apriel", "derived/Apriel-1.6-15b-Thinker-fixed.jinja",
                {"bos_token": "<s>", "eos_token": "</s>"}))
    return out


VARIANTS = _variants()


def test_every_variant_is_listed():
    """Each derived/ template of the corpus copy belongs to a format, or is named here as one
    no bundled format covers (with the reason)."""
    not_bundled = {
        # RWKV World ("User: …\n\nAssistant:"): no bundled family
        "derived/llama-cpp-rwkv-world.jinja",
    }
    listed = {f for _, f, _ in VARIANTS}
    on_disk = {f"derived/{p.name}" for p in (TEMPLATES / "derived").glob("*.jinja")}
    assert on_disk - listed == not_bundled
    assert set(MIN_PASS) == listed


@pytest.mark.parametrize("name,tfile,variables", VARIANTS,
                         ids=[f"{n}:{t}" for n, t, _ in VARIANTS])
def test_variant_template_matrix(name, tfile, variables):
    fmt = cg.load_format(name)
    res = check_template(fmt, (TEMPLATES / tfile).read_text(encoding="utf-8"), name=tfile,
                         variables=variables)
    assert res.error is None, res.error
    known = KNOWN_FAIL.get(tfile, set())
    fails = [f"{c.case}: {c.reason}" for c in res.cases
             if c.status == "fail" and c.case not in known]
    assert not fails, "\n".join(fails)
    assert {c.case for c in res.cases if c.status == "fail"} == known  # none fixed unnoticed
    assert res.counts()["pass"] >= MIN_PASS[tfile], res.summary()


#: Real variants from tests/data/templates/wild (provenance in its SOURCES.md) that their
#: family's spec accepts: (format, file, variables, cases that must pass).
WILD_VARIANTS = [
    # Jinja-indented R1 tool templates: spaces before <｜tool▁outputs▁begin｜> and
    # <｜tool▁outputs▁end｜> (both markers lstrip them)
    ("deepseek-v3", "vllm-tool_chat_template_deepseekr1.jinja",
     {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}, 19),
    ("deepseek-v3", "euclidgame-mathconstruct-DeepSeek-R1-Distill.jinja",
     {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}, 19),
]


@pytest.mark.parametrize("name,tfile,variables,n_pass", WILD_VARIANTS,
                         ids=[f"{n}:{t}" for n, t, _, _ in WILD_VARIANTS])
def test_wild_variant_template_matrix(name, tfile, variables, n_pass):
    """Each real variant passes every matrix case it renders (tool shapes included), and
    detection picks its family for it."""
    src = (TEMPLATES / "wild" / tfile).read_text(encoding="utf-8")
    fmt = cg.load_format(name)
    res = check_template(fmt, src, name=tfile, variables=variables)
    assert res.error is None, res.error
    assert res.counts()["fail"] == 0, [f"{c.case}: {c.reason}" for c in res.cases
                                       if c.status == "fail"]
    assert res.counts()["pass"] >= n_pass, res.summary()
    assert cg.detect_format(chat_template=src).name == name


def test_llama_cpp_r1_tool_shapes_with_a_list():
    """llama.cpp's R1 template writes its tool instructions, with an example call in the real
    markers, before the system text; Jinja2 cannot ``tojson`` the generator it builds them
    from, so the same template with ``| list`` renders the tool shapes: every one passes (the
    example call is a block of the system text, never trained)."""
    src = (TEMPLATES / "derived/llama-cpp-deepseek-r1.jinja").read_text(encoding="utf-8")
    patched = src.replace("map(attribute='function') | tojson",
                          "map(attribute='function') | list | tojson")
    assert patched != src
    fmt = cg.load_format("deepseek-v3")
    tool_cases = [c for c in default_matrix() if c.tools]
    res = check_template(fmt, patched, name="llama-cpp-deepseek-r1 | list", cases=tool_cases,
                         variables={"bos_token": "<｜begin▁of▁sentence｜>",
                                    "eos_token": "<｜end▁of▁sentence｜>"})
    assert res.counts()["fail"] == 0, [c.reason for c in res.cases if c.status == "fail"]
    assert res.counts()["pass"] == len(tool_cases)


def test_kimi_k2_instruct_newline_after_default_system():
    """The issue's seed case: without a system message, HF's Kimi-K2-Instruct template writes
    ``<|im_end|>\\n`` after its default system turn; the newline never trains."""
    fmt = cg.load_format("kimi-k2")
    case = get_case("no-system")
    text = render_chat((TEMPLATES / "derived/Kimi-K2-Instruct.jinja").read_text(), case.messages)
    assert "<|im_end|>\n<|im_user|>" in text
    conv = fmt.parse(text)
    assert [t.role for t in conv.turns] == ["system", "user", "assistant"]
    assert conv.trained_text(OUTPUT_POLICY) == [case.messages[-1]["content"]]


# --------------------------------------------------------------------------- unknown markers


class AddedTok:
    """A minimal tokenizer whose markers — the format's and ``extra`` — are single special ids
    (listed in ``added_tokens_encoder``, as transformers tokenizers do); every other character
    is one id."""

    CHAR0 = 1000

    def __init__(self, markers, extra=()):
        self.added_tokens_encoder = {m: 1 + i for i, m in enumerate([*markers, *extra])}
        self.inv = {v: k for k, v in self.added_tokens_encoder.items()}
        self._rx = re.compile("|".join(re.escape(m) for m in
                                       sorted(self.added_tokens_encoder, key=len, reverse=True)))

    def convert_tokens_to_ids(self, token):
        if token in self.added_tokens_encoder:
            return self.added_tokens_encoder[token]
        return self.CHAR0 + ord(token) if len(token) == 1 else None

    def decode(self, ids, **_):
        return "".join(self.inv[i] if i in self.inv else chr(i - self.CHAR0)
                       for i in map(int, ids))

    def encode(self, text, *, specials=True):
        """Ids of ``text``; with ``specials=False`` the marker strings are typed text."""
        out, pos = [], 0
        for m in (self._rx.finditer(text) if specials else ()):
            out += [self.CHAR0 + ord(c) for c in text[pos:m.start()]]
            out.append(self.added_tokens_encoder[m.group()])
            pos = m.end()
        return out + [self.CHAR0 + ord(c) for c in text[pos:]]


#: (format, rendering with one unknown marker in an assistant turn, the unknown marker, text that
#: must never train). GLM has no end-of-turn token: a tool result under a role marker the spec
#: lacks would otherwise run on as the assistant's text — the silent wrong mask of issue 11
#: (GLM-4-9B-Chat's `<|tool|>`, now a marker of glm4; here a made-up `<|function|>`).
UNKNOWN = [
    ("glm4",
     "[gMASK]<sop><|user|>\nWeather?<|assistant|>\n<think></think>\n<tool_call>get_weather\n"
     "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call><|function|>\n"
     "<tool_response>\nsunny\n</tool_response><|assistant|>\n<think></think>\nSunny.",
     "<|function|>", "sunny"),
    ("chatml",
     "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{}\n"
     "</tool_call><|observation|>sunny<|im_end|>\n<|im_start|>assistant\nSunny.<|im_end|>\n",
     "<|observation|>", "sunny"),
    ("deepseek-v3",
     "<｜begin▁of▁sentence｜><｜User｜>Weather?<｜Assistant｜>Checking.<｜tool▁result｜>sunny"
     "<｜end▁of▁sentence｜>",
     "<｜tool▁result｜>", "sunny"),
    ("llama3",
     "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\nChecking.<|tool_output|>sunny<|eot_id|>",
     "<|tool_output|>", "sunny"),
]


def _ids_case(name, text, unknown):
    fmt = cg.load_format(name)
    tok = AddedTok([m.text for m in fmt.spec.markers.values()], extra=[unknown])
    return fmt, tok, tok.encode(text)


@pytest.mark.parametrize("name,text,unknown,never", UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_unknown_marker_text_mode(name, text, unknown, never):
    fmt = cg.load_format(name)
    at = text.index(unknown)
    # the text memo (Format.parse's fast path) has learnt the same shape from a clean sample
    clean = text.replace(unknown, "x" * len(unknown))
    for _ in range(3):
        fmt.parse(clean)
    with pytest.raises(cg.ParseError) as ei:
        fmt.parse(text)
    err = ei.value
    assert err.offset == at and err.found == unknown and err.expected and err.mode == "text"
    assert "unknown marker" in err.message
    conv = fmt.parse(text, strict=False)
    assert any("unknown marker" in w.message and w.offset == at for w in conv.warnings)
    lo = text.index(never, at)
    mask = conv.mask(OUTPUT_POLICY)
    assert not any(mask[lo:lo + len(never)]), "the unknown turn's text trains"
    # the turn that holds it trains nothing, the others still train
    bad = [t for t in conv.turns if t.start <= at < t.end]
    assert bad and not bad[0].valid
    assert not any(mask[bad[0].start:bad[0].end])


@pytest.mark.parametrize("name,text,unknown,never", UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_unknown_marker_id_mode_full_and_fast(name, text, unknown, never):
    fmt, tok, ids = _ids_case(name, text, unknown)
    at = ids.index(tok.added_tokens_encoder[unknown])
    with pytest.raises(cg.ParseError) as ei:
        fmt.parse_ids(ids, tok)
    assert ei.value.offset == at and ei.value.found == unknown and ei.value.mode == "ids"
    for policy in (None, OUTPUT_POLICY):
        with pytest.raises(cg.ParseError):
            fmt.loss_mask(ids, tok, policy=policy)               # fast path, list input
        with pytest.raises(cg.ParseError):
            fmt.loss_mask(np.asarray(ids), tok, policy=policy)   # numpy input
        with pytest.raises(cg.ParseError):
            fmt.loss_masks([ids, ids], tok, policy=policy)       # batch
        conv = fmt.parse_ids(ids, tok, strict=False)
        assert any("unknown marker" in w.message and w.offset == at for w in conv.warnings)
        want = list(conv.mask_array(policy or fmt.default_policy))
        assert list(fmt.loss_mask(ids, tok, policy=policy, strict=False)) == want
        assert [list(m) for m in fmt.loss_masks([ids, ids], tok, policy=policy,
                                                strict=False)] == [want, want]
        bad = [t for t in conv.turns if t.start <= at < t.end]
        assert bad and not bad[0].valid and not any(want[bad[0].start:bad[0].end])


@pytest.mark.parametrize("name,text,unknown,never", UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_unknown_marker_typed_as_text_is_content_in_id_mode(name, text, unknown, never):
    """Id mode is authoritative: the same string typed by the assistant (ordinary ids) is
    text, and trains as the assistant's (known markers stay markers)."""
    fmt, tok, _ = _ids_case(name, text, unknown)
    at = text.index(unknown)
    ids = tok.encode(text[:at]) + tok.encode(unknown, specials=False) + tok.encode(text[at + len(unknown):])
    conv = fmt.parse_ids(ids, tok)
    assert not conv.warnings
    k = len(tok.encode(text[:at]))
    assert conv.mask_array(OUTPUT_POLICY)[k] == 1
    assert list(fmt.loss_mask(ids, tok, policy=OUTPUT_POLICY)) == list(conv.mask_array(OUTPUT_POLICY))


def test_unknown_special_outside_trained_turns_is_content():
    """Special tokens the spec does not know inside a user turn (a VL model's image tokens)
    train nothing anyway: no error, in both modes, and the fast path agrees."""
    fmt = cg.load_format("chatml")
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
            "<|im_start|>assistant\nA cat.<|im_end|>\n")
    conv = fmt.parse(text)
    assert conv.trained_text(OUTPUT_POLICY) == ["A cat."] and not conv.warnings
    tok = AddedTok([m.text for m in fmt.spec.markers.values()],
                   extra=["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    ids = tok.encode(text)
    want = list(fmt.parse_ids(ids, tok).mask_array(fmt.default_policy))
    assert sum(want) == len("A cat.")
    assert list(fmt.loss_mask(ids, tok)) == want
    assert [list(m) for m in fmt.loss_masks([ids, ids[:20], ids], tok)] == \
        [want, list(fmt.parse_ids(ids[:20], tok).mask_array(fmt.default_policy)), want]


def test_unknown_marker_shapes():
    """Shapes come from the spec's special markers; bracket- and tag-like ones give none."""
    from chatgrammar.runtime.parse import unknown_marker_shape
    shape = {n: unknown_marker_shape(cg.load_format(n).spec) for n in cg.list_formats()}
    assert shape["chatml"].fullmatch("<|observation|>")
    assert shape["deepseek-v3"].fullmatch("<｜tool▁result｜>")
    assert not shape["chatml"].search("a <b>tag</b> and [1] and </div>")
    assert shape["gemma"] is None                    # <start_of_turn>: tags are text too often
    assert not shape["mistral"] or not shape["mistral"].search("</div> [/b]")


@pytest.mark.parametrize("name,text,unknown,never", UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_unknown_marker_after_the_fast_path_learnt_the_shape(name, text, unknown, never):
    """The fast path memoises an item by its markers and the presence of content runs: once a
    clean sample of the same shape is learnt, a sample whose content holds an unknown marker id
    must still take the full pipeline (it would otherwise reuse the clean item's spans)."""
    fmt, tok, ids = _ids_case(name, text, unknown)
    uid = tok.added_tokens_encoder[unknown]
    clean = [tok.CHAR0 + ord("x") if i == uid else i for i in ids]
    want_clean = list(fmt.parse_ids(clean, tok).mask_array(fmt.default_policy))
    for _ in range(3):
        assert list(fmt.loss_mask(clean, tok)) == want_clean
    with pytest.raises(cg.ParseError):
        fmt.loss_mask(ids, tok)
    lenient = list(fmt.parse_ids(ids, tok, strict=False).mask_array(fmt.default_policy))
    assert list(fmt.loss_mask(ids, tok, strict=False)) == lenient != want_clean


def test_glm4_9b_chat_tool_message_is_a_tool_turn():
    """GLM-4-9B-Chat's template writes a Hugging Face `tool` message as `<|tool|>\n…`, a role
    marker GLM's vocabulary lacks: a tool turn of glm4 (never trained), in both modes."""
    fmt = cg.load_format("glm4")
    case = get_case("tool-call-with-content")
    text = render_chat((TEMPLATES / "derived/THUDM-glm-4-9b-chat.jinja").read_text(),
                       case.messages)
    assert "<|tool|>\nRover finds water ice." in text
    conv = fmt.parse(text)
    assert [t.role for t in conv.turns] == ["user", "assistant", "tool", "assistant"]
    assert "".join(conv.trained_text(OUTPUT_POLICY)) == \
        "\nLet me search for that.\nA rover found water ice on Mars."
    tok = AddedTok([m.text for m in fmt.spec.markers.values() if m.special])
    ids = tok.encode(text)   # `<|tool|>` (soft) as ordinary ids: found in the decoded text
    want = fmt.parse_ids(ids, tok).mask_array(OUTPUT_POLICY)
    assert list(fmt.loss_mask(ids, tok, policy=OUTPUT_POLICY)) == list(want)
    assert tok.decode([i for i, m in zip(ids, want) if m]) == \
        "\nLet me search for that.\nA rover found water ice on Mars."


def test_unknown_bracket_marker_id_mode_only():
    """Brackets and tags give no text-mode shape (`[TODO]` typed in an answer is text), but in
    id mode a special id `[TOOL_RESPONSE]` Mistral's spec does not know, inside the reply, is
    an unknown marker; text mode keeps the string as content."""
    fmt = cg.load_format("mistral")
    text = "<s>[INST] Q [/INST] A [TOOL_RESPONSE] sunny</s>"
    assert fmt.parse(text).trained_text(OUTPUT_POLICY) == [" A [TOOL_RESPONSE] sunny"]
    fmt, tok, ids = _ids_case("mistral", text, "[TOOL_RESPONSE]")
    at = ids.index(tok.added_tokens_encoder["[TOOL_RESPONSE]"])
    with pytest.raises(cg.ParseError) as ei:
        fmt.parse_ids(ids, tok)
    assert ei.value.offset == at and ei.value.found == "[TOOL_RESPONSE]"
    with pytest.raises(cg.ParseError):
        fmt.loss_mask(ids, tok)
    lenient = fmt.parse_ids(ids, tok, strict=False)
    assert not any(lenient.mask_array(OUTPUT_POLICY))
    assert list(fmt.loss_mask(ids, tok, strict=False)) == \
        list(lenient.mask_array(fmt.default_policy))


def test_apriel_16_turns():
    """Apriel 1.6: only assistant turns end with <|end|> (the others at the next opener, a last
    reply without it is cut and trains); its forced generation prompt trains nothing; the 1.5
    layout still needs its <|end|> (the error still says `unexpected`)."""
    fmt = cg.load_format("apriel")
    text = ("<s><|begin_system|>\nBe brief.\n<|begin_user|>\nQ\n\n<|begin_assistant|>\nA\n<|end|>\n"
            "<|begin_tool_result|>\nok\n\n<|begin_assistant|>\nB")
    conv = fmt.parse(text)
    assert [t.role for t in conv.turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.trained_text(OUTPUT_POLICY) == ["A\n", "B"] and not conv.warnings
    tok = AddedTok([m.text for m in fmt.spec.markers.values() if m.special])
    ids = tok.encode(text)
    assert list(fmt.loss_mask(ids, tok, policy=OUTPUT_POLICY)) == \
        list(fmt.parse_ids(ids, tok).mask_array(OUTPUT_POLICY))
    prompt = "<|begin_user|>\nQ\n\n<|begin_assistant|>\nHere are my reasoning steps:\n"
    assert fmt.parse(prompt).turns[-1].generation_prompt
    with pytest.raises(cg.ParseError, match="unexpected assistant"):
        fmt.parse("<|user|>\nQ\n<|assistant|>\nA\n<|end|>\n")
    lenient = fmt.parse("<|user|>\nQ\n<|assistant|>\nA\n<|end|>\n", strict=False)
    assert lenient.warnings and lenient.trained_text(OUTPUT_POLICY) == ["A\n"]


@pytest.mark.parametrize("tfile", ["derived/Kimi-K2-Instruct.jinja",
                                   "derived/Kimi-K2-Thinking.jinja"])
def test_kimi_k2_variants_with_the_real_special_ids(tfile):
    """The seed family's current templates, in id mode on a tiktoken Encoding carrying Kimi's
    real special ids (tests/kimi_tokenizers.py) as well as with one id per marker."""
    from tests.kimi_tokenizers import kimi_k2_encoding
    res = check_template(cg.load_format("kimi-k2"), (TEMPLATES / tfile).read_text(),
                         name=tfile, tokenizer=kimi_k2_encoding(), tokenizer_name="kimi-k2")
    assert res.counts() == {"pass": 15, "fail": 0, "skip": 5}, \
        [c.reason for c in res.cases if c.status == "fail"]
