"""chatml, phi4, llama3, gemma, phi3: the bundled specs against their real upstream templates.

Every template is rendered with the built-in conversation matrix exactly as transformers renders
it (:mod:`chatgrammar.render`), parsed in text mode and in id mode, and checked against an oracle
the parser does not influence:

- **where each assistant message's output lies** comes from the template itself: rendering the
  messages before it with ``add_generation_prompt=True`` tells how many assistant headers precede
  it; its output runs from the end of that header in the full render to the family's
  terminator (so trimming templates — Gemma, Llama 3 — are compared as they render);
- **what it must contain**: the message's content and reasoning whenever the template renders
  them anywhere, and its tool calls for templates that render tool calls.

Id mode uses real tokenizers built offline (see the builders below) and must equal the text-mode
spans mapped through the tokenizer's offsets; a token where a span boundary falls inside it is
trained and reported on ``Conversation.boundaries``. Shapes a template rejects are listed in
``REJECTED`` with the template's reason: a template that starts or stops rejecting one fails.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import chatgrammar as cg
from chatgrammar.matrix import default_matrix, get_case
from chatgrammar.render import TemplateError, render_chat, render_chat_with_spans
from tests.tokenizers import (QWEN_ADDED_TOKENS, QWEN_PATTERN, QWEN_TIKTOKEN, phi3_tokenizer,
                              qwen_fast_tokenizer)

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
FORMATS = ("chatml", "phi4", "llama3", "gemma", "phi3")


# ----------------------------------------------------------------------------- tokenizers

@lru_cache(maxsize=None)
def _qwen_ranks() -> dict:
    from tiktoken.load import load_tiktoken_bpe

    return load_tiktoken_bpe(str(QWEN_TIKTOKEN))


def _tiktoken(name: str, shift_from: int, specials: dict[str, int]):
    """Qwen's BPE ranks with ``specials`` at their real ids. Ranks >= ``shift_from`` move up by
    256 to free the id range the specials need: a monotone shift keeps the merge order, so the
    text tokenises exactly as Qwen's does (only the ids of those ranks change)."""
    import tiktoken

    ranks = {b: (r if r < shift_from else r + 256) for b, r in _qwen_ranks().items()}
    assert not set(specials.values()) & set(ranks.values())
    return tiktoken.Encoding(name=name, pat_str=QWEN_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)


# Llama 3 / 3.1 special ids (tokenizer_config.json added_tokens_decoder of Meta-Llama-3.1).
LLAMA3_SPECIALS = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001,
                   "<|reserved_special_token_0|>": 128002, "<|reserved_special_token_1|>": 128003,
                   "<|finetune_right_pad_id|>": 128004, "<|reserved_special_token_2|>": 128005,
                   "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
                   "<|eom_id|>": 128008, "<|eot_id|>": 128009, "<|python_tag|>": 128010}
# Gemma 2 special ids (tokenizer.json of gemma-2-2b-it; Gemma 3 numbers its turn markers one lower,
# 105/106, which changes nothing the tests check: the markers stay single special ids).
GEMMA_SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4,
                  "<start_of_turn>": 106, "<end_of_turn>": 107}


@lru_cache(maxsize=None)
def llama3_encoding():
    """No Llama 3 tokenizer is in the corpus: Qwen's ranks (shifted past 128000) with Llama 3's
    special tokens at their real ids 128000-128010."""
    return _tiktoken("llama3-specials-on-qwen-ranks", 128000, LLAMA3_SPECIALS)


@lru_cache(maxsize=None)
def gemma_encoding():
    """No Gemma tokenizer is in the corpus: Qwen's ranks shifted up by 256 with Gemma's special
    tokens at their real ids (<pad> 0, <eos> 1, <bos> 2, <start_of_turn> 106, <end_of_turn> 107)."""
    return _tiktoken("gemma-specials-on-qwen-ranks", 0, GEMMA_SPECIALS)


@lru_cache(maxsize=None)
def qwen25_encoding():
    """Qwen2.5's vocabulary (no Qwen3 additions): <think>, </think>, <tool_response> are plain
    text there, so id mode must find the soft markers in decoded text."""
    import tiktoken

    specials = {c: i for i, c, _ in QWEN_ADDED_TOKENS if i <= 151664}
    return tiktoken.Encoding(name="qwen2.5-no-qwen3-additions", pat_str=QWEN_PATTERN,
                             mergeable_ranks=_qwen_ranks(), special_tokens=specials)


@lru_cache(maxsize=None)
def phi4_like_tokenizer():
    """No Phi-4 tokenizer is in the corpus: Qwen's fast tokenizer (which has <|im_start|>,
    <|im_end|>, <|endoftext|>, <think>) plus ``<|im_sep|>`` added as a special token (id 151669;
    Phi-4's real id is 100266)."""
    tok = copy.deepcopy(qwen_fast_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|im_sep|>"]})
    assert tok.convert_tokens_to_ids("<|im_sep|>") == 151669
    return tok


LFM2_SPECIALS = ["<|startoftext|>", "<|tool_list_start|>", "<|tool_list_end|>",
                 "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>",
                 "<|tool_response_end|>"]


@lru_cache(maxsize=None)
def lfm2_like_tokenizer():
    """No LFM2 tokenizer is in the corpus: Qwen's fast tokenizer plus LFM2's BOS and tool
    markers added as special tokens (new ids from 151669; LFM2's own ids are small)."""
    tok = copy.deepcopy(qwen_fast_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": LFM2_SPECIALS})
    assert tok.convert_tokens_to_ids("<|startoftext|>") == 151669
    return tok


TOKENIZERS = {
    "qwen": qwen_fast_tokenizer,
    "lfm2": lfm2_like_tokenizer,
    "qwen2.5": qwen25_encoding,
    "phi4": phi4_like_tokenizer,
    "phi3": phi3_tokenizer,
    "llama3": llama3_encoding,
    "gemma": gemma_encoding,
}


def encode(tok, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` (special tokens allowed, none added) and each token's char range."""
    if hasattr(tok, "decode_with_offsets"):  # tiktoken.Encoding
        ids = tok.encode(text, allowed_special="all")
        dec, starts = tok.decode_with_offsets(ids)
        assert dec == text
        ends = starts[1:] + [len(text)]
        # a token that starts inside a multi-byte char shares its start with the previous one
        return ids, [(s, max(e, s + 1)) for s, e in zip(starts, ends)]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]


# ----------------------------------------------------------------------------- templates

@dataclass(frozen=True)
class Tpl:
    file: str
    fmt: str
    tokenizers: tuple[str, ...]
    header: str                  # the assistant header the template writes (oracle only)
    tool_calls: bool = False     # the template renders assistant tool calls
    specials: tuple = ()         # (name, value) special tokens beyond the family's


SPECIAL_TOKENS = {  # what apply_chat_template passes (the tokenizer's special_tokens_map)
    "chatml": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    "phi4": dict(bos_token="<|endoftext|>", eos_token="<|im_end|>"),
    "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                   date_string="26 Jul 2024"),  # Llama 3.2 would otherwise print today's date
    "gemma": dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
    "phi3": dict(bos_token="<s>", eos_token="<|endoftext|>"),
}
TERMINATORS = {"chatml": ("<|im_end|>",), "phi4": ("<|im_end|>",),
               "llama3": ("<|eot_id|>", "<|eom_id|>"), "gemma": ("<end_of_turn>",),
               "phi3": ("<|end|>",)}

_CHATML_H = "<|im_start|>assistant\n"
_Q = ("qwen", "qwen2.5")
TEMPLATE_TABLE = [
    Tpl("Qwen-Qwen2.5-7B-Instruct.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen-Qwen2.5-VL.jinja", "chatml", _Q, _CHATML_H),
    Tpl("Qwen-Qwen3-0.6B.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen-Qwen3.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen-QwQ-32B.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen-Qwen3-Instruct-2507.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen-Qwen3-VL.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen-Qwen3.5-2B.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen3.5-4B.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen-Qwen3.6.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen3-Coder.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("HuggingFaceTB-SmolLM3-3B.jinja", "chatml", _Q, _CHATML_H),
    Tpl("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "chatml", _Q, _CHATML_H,
        tool_calls=True),
    Tpl("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "chatml", _Q, _CHATML_H,
        tool_calls=True),
    Tpl("MiMo-VL.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("tiiuae-Falcon-H1.jinja", "chatml", _Q, _CHATML_H),
    # other ChatML-family templates of the corpus
    Tpl("Qwen-Qwen3-235B-A22B.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("nvidia-NVIDIA-Nemotron-3-Super.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("nvidia-NVIDIA-Nemotron-3-Ultra.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("StepFun3.5-Flash.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("stepfun-ai-Step-3.5-Flash.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("Bielik-11B-v3.0-Instruct.jinja", "chatml", _Q, _CHATML_H, tool_calls=True),
    Tpl("LiquidAI-LFM2.jinja", "chatml", ("lfm2",), _CHATML_H,
        specials=(("bos_token", "<|startoftext|>"),)),
    Tpl("LFM2.5-Instruct.jinja", "chatml", ("lfm2",), _CHATML_H,
        specials=(("bos_token", "<|startoftext|>"),)),
    Tpl("LFM2.5-8B-A1B.jinja", "chatml", ("lfm2",), _CHATML_H, tool_calls=True,
        specials=(("bos_token", "<|startoftext|>"),)),
    Tpl("microsoft-phi-4.jinja", "phi4", ("phi4",), "<|im_start|>assistant<|im_sep|>"),
    Tpl("microsoft-Phi-4-reasoning.jinja", "phi4", ("phi4",), "<|im_start|>assistant<|im_sep|>"),
    Tpl("meta-llama-Meta-Llama-3-8B-Instruct.jinja", "llama3", ("llama3",),
        "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    Tpl("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3", ("llama3",),
        "<|start_header_id|>assistant<|end_header_id|>\n\n", tool_calls=True),
    Tpl("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3", ("llama3",),
        "<|start_header_id|>assistant<|end_header_id|>\n\n", tool_calls=True),
    Tpl("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3", ("llama3",),
        "<|start_header_id|>assistant<|end_header_id|>\n\n", tool_calls=True),
    Tpl("meetkai-functionary-medium-v3.1.jinja", "llama3", ("llama3",),
        "<|start_header_id|>assistant<|end_header_id|>\n\n", tool_calls=True),
    Tpl("google-gemma-2-2b-it.jinja", "gemma", ("gemma",), "<start_of_turn>model\n"),
    Tpl("google-gemma-3-it.jinja", "gemma", ("gemma",), "<start_of_turn>model\n"),
    Tpl("google-gemma-3n.jinja", "gemma", ("gemma",), "<start_of_turn>model\n"),
    Tpl("microsoft-Phi-3-mini-4k-instruct.jinja", "phi3", ("phi3",), "<|assistant|>\n"),
    Tpl("microsoft-Phi-3.5-mini-instruct.jinja", "phi3", ("phi3",), "<|assistant|>\n"),
    # Phi-4-mini's own tokenizer (o200k-based) is not in the corpus: Phi-3's carries the same
    # role markers as special ids; <|tool|> & co. are then soft markers found in text.
    Tpl("microsoft-Phi-4-mini-instruct.jinja", "phi3", ("phi3",), "<|assistant|>"),
]
TPL = {t.file: t for t in TEMPLATE_TABLE}

_STR_CONTENT = "[runtime] TypeError: can only concatenate str (not \"list\") to str"
_NO_SYSTEM = "[raised] System role not supported"
_ALTERNATE = "[raised] Conversation roles must alternate user/assistant/user/assistant/..."
_NO_TOOLS = "[runtime] TypeError: 'NoneType' object is not iterable"
_ITEMS = "[runtime] TypeError: Can only get item pairs from a mapping."
# Shapes each template rejects (case -> the template's own reason). Everything else renders
# and must parse. content-parts: templates that concatenate content as a string; Hermes tool_use
# templates need `tools`; Gemma has no tool role and Gemma 2 no system role; Llama 3.1+ allow one
# tool call per message; the Qwen3.5/3.6/Coder XML tool-call templates need dict arguments.
REJECTED: dict[str, dict[str, str]] = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": {"content-parts": _STR_CONTENT},
    "Qwen-Qwen2.5-VL.jinja": {},
    "Qwen-Qwen3-0.6B.jinja": {"content-parts": _STR_CONTENT},
    "Qwen-Qwen3.jinja": {"content-parts": _STR_CONTENT},
    "Qwen-QwQ-32B.jinja": {"content-parts": _STR_CONTENT},
    "Qwen-Qwen3-Instruct-2507.jinja": {"content-parts": _STR_CONTENT},
    "Qwen-Qwen3-VL.jinja": {},
    "Qwen-Qwen3.5-2B.jinja": {"tool-call-string-args": _ITEMS},
    "Qwen3.5-4B.jinja": {"tool-call-string-args": _ITEMS},
    "Qwen-Qwen3.6.jinja": {"tool-call-string-args": _ITEMS},
    "Qwen3-Coder.jinja": {"tool-call-string-args": _ITEMS, "content-parts": _STR_CONTENT},
    "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja": {"tool-call-string-args": _ITEMS,
                                                "content-parts": _STR_CONTENT},
    "HuggingFaceTB-SmolLM3-3B.jinja": {
        "content-parts": "[undefined] 'list object' has no attribute 'replace'"},
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": None,  # filled below
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": None,
    "MiMo-VL.jinja": {"content-parts": _STR_CONTENT},
    "tiiuae-Falcon-H1.jinja": {"content-parts": _STR_CONTENT},
    "microsoft-phi-4.jinja": {"content-parts": _STR_CONTENT},
    "microsoft-Phi-4-reasoning.jinja": {"content-parts": _STR_CONTENT},
    "Qwen-Qwen3-235B-A22B.jinja": {"content-parts": _STR_CONTENT},
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": {"tool-call-string-args": _ITEMS,
                                                  "content-parts": _STR_CONTENT},
    "nvidia-NVIDIA-Nemotron-3-Super.jinja": {"tool-call-string-args": _ITEMS,
                                             "content-parts": _STR_CONTENT},
    "nvidia-NVIDIA-Nemotron-3-Ultra.jinja": {"tool-call-string-args": _ITEMS,
                                             "content-parts": _STR_CONTENT},
    "StepFun3.5-Flash.jinja": {"tool-call-string-args": _ITEMS},
    "stepfun-ai-Step-3.5-Flash.jinja": {"tool-call-string-args": _ITEMS},
    "Bielik-11B-v3.0-Instruct.jinja": {"content-parts": _STR_CONTENT},
    "LiquidAI-LFM2.jinja": {"content-parts": _STR_CONTENT},
    "LFM2.5-Instruct.jinja": {"content-parts": _STR_CONTENT},
    "LFM2.5-8B-A1B.jinja": {
        "tool-call-string-args": "[undefined] 'str object' has no attribute 'items'"},
    "meta-llama-Meta-Llama-3-8B-Instruct.jinja": {},
    # functionary v3.1 concatenates string arguments only
    "meetkai-functionary-medium-v3.1.jinja": {
        **{c: "[runtime] TypeError: can only concatenate str (not \"dict\") to str"
           for c in ("tool-call", "tool-call-with-content", "parallel-tool-calls",
                     "reasoning-tool-call")},
        "content-parts": _STR_CONTENT},
    "meta-llama-Llama-3.1-8B-Instruct.jinja": {
        "parallel-tool-calls": "[raised] This model only supports single tool-calls at once!"},
    "meta-llama-Llama-3.2-3B-Instruct.jinja": {
        "parallel-tool-calls": "[raised] This model only supports single tool-calls at once!"},
    "meta-llama-Llama-3.3-70B-Instruct.jinja": {
        "parallel-tool-calls": "[raised] This model only supports single tool-calls at once!"},
    "google-gemma-2-2b-it.jinja": None,
    "google-gemma-3-it.jinja": None,
    "google-gemma-3n.jinja": None,
    "microsoft-Phi-3-mini-4k-instruct.jinja": {"content-parts": _STR_CONTENT},
    "microsoft-Phi-3.5-mini-instruct.jinja": {"content-parts": _STR_CONTENT},
    "microsoft-Phi-4-mini-instruct.jinja": {"content-parts": _STR_CONTENT},
}
_TOOL_CASES = {c.name for c in default_matrix() if c.tools}
_TOOL_RESULT_CASES = {c.name for c in default_matrix(tags={"tool-results"})}
for _f in ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
           "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"):
    REJECTED[_f] = {c.name: _NO_TOOLS for c in default_matrix() if c.name not in _TOOL_CASES}
for _f in ("google-gemma-3-it.jinja", "google-gemma-3n.jinja"):
    REJECTED[_f] = {c: _ALTERNATE for c in _TOOL_RESULT_CASES}
REJECTED["google-gemma-2-2b-it.jinja"] = {
    c.name: (_ALTERNATE if c.name in _TOOL_RESULT_CASES and "system" not in c.tags
             else _NO_SYSTEM)
    for c in default_matrix() if "system" in c.tags or c.name in _TOOL_RESULT_CASES}

# Renders that carry a deliberate parse warning (and why).
EXPECTED_WARNINGS = {
    # Falcon-H1 never closes the system turn it writes when tools are declared.
    **{("tiiuae-Falcon-H1.jinja", c): "missing im_end" for c in _TOOL_CASES},
    # Bielik does not close the user turn of a <|function_output|> tool result that is a JSON
    # object.
    **{("Bielik-11B-v3.0-Instruct.jinja", c): "missing im_end"
       for c in ("tool-call", "tool-call-string-args", "parallel-tool-calls",
                 "reasoning-tool-call")},
}


def template(name: str) -> str:
    p = TEMPLATES / name
    return (p if p.exists() else TEMPLATES / "generation" / name).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- checks

def render(tpl: Tpl, case, messages=None, **over) -> str:
    kw = {**SPECIAL_TOKENS[tpl.fmt], **dict(tpl.specials), **case.render_kwargs(), **over}
    return render_chat(template(tpl.file), copy.deepcopy(messages or case.messages), **kw)


def assistant_regions(tpl: Tpl, case, full: str) -> list[tuple[int, int]]:
    """The oracle: per assistant message, the (start, end) of its output in ``full``."""
    out = []
    term = TERMINATORS[tpl.fmt]
    for o in case.outputs:
        prefix = render(tpl, case, case.messages[:o.message_index], add_generation_prompt=True)
        nth = prefix.count(tpl.header)  # the template's own count of assistant headers so far
        pos = -1
        for _ in range(nth):
            pos = full.find(tpl.header, pos + 1)
            assert pos >= 0, (tpl.file, case.name, "assistant header missing from the render")
        start = pos + len(tpl.header)
        end = min(k for k in (full.find(t, start) for t in term) if k >= 0)
        out.append((start, end))
    return out


def char_mask(conv: cg.Conversation, policy=None) -> np.ndarray:
    return conv.mask_array(policy).astype(bool)


def check_ids_agree(text: str, conv: cg.Conversation, fmt: cg.Format, tok, policies) -> None:
    """Id mode on the tokenised render equals the text-mode spans mapped through offsets."""
    ids, offsets = encode(tok, text)
    iconv = fmt.parse_ids(ids, tok)
    assert [t.role for t in iconv.turns] == [t.role for t in conv.turns]
    assert [t.generation_prompt for t in iconv.turns] == [t.generation_prompt for t in conv.turns]
    straddle = {b.offset for b in iconv.boundaries}
    for pol in policies:
        cm = char_mask(conv, pol)
        im = iconv.mask_array(pol).astype(bool)
        assert len(im) == len(ids)
        for i, (a, b) in enumerate(offsets):
            # a token is trained iff it carries trained text: no trained char is left out
            assert im[i] == bool(cm[a:b].any()), (i, ids[i], text[a:b], pol)
            # and its text lies inside a trained span — unless a span boundary falls inside
            # it, which is reported (the documented rule: the straddling token is trained)
            if im[i] and not cm[a:b].all():
                assert i in straddle, (i, text[a:b], pol, iconv.boundaries)


POLICIES = (None, cg.MaskPolicy(thinking=False, end_marker=True),
            cg.MaskPolicy(tool_calls=False))


def _renderable(tpl: Tpl):
    """(case, text, None) for each matrix case the template renders, (case, None, reason) for
    each it rejects."""
    for case in default_matrix():
        try:
            yield case, render(tpl, case), None
        except TemplateError as exc:
            yield case, None, f"[{exc.kind}] {exc.message}"


def _merged(spans) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and out[-1][1] == s.start:
            out[-1] = (out[-1][0], s.end)
        else:
            out.append((s.start, s.end))
    return out


@pytest.mark.parametrize("tpl", TEMPLATE_TABLE, ids=lambda t: t.file.removesuffix(".jinja"))
def test_template_matrix(tpl: Tpl) -> None:
    fmt = cg.load_format(tpl.fmt)
    rejected = {}
    for case, text, reason in _renderable(tpl):
        if text is None:
            rejected[case.name] = reason
            continue
        conv = fmt.parse(text)
        want_warn = EXPECTED_WARNINGS.get((tpl.file, case.name))
        if want_warn:
            assert conv.warnings and all(want_warn in w.message for w in conv.warnings)
        else:
            assert not conv.warnings, (case.name, conv.warnings)
        # ---- the oracle: each assistant message trains exactly its rendered output
        regions = assistant_regions(tpl, case, text)
        turns = [t for t in conv.turns if t.role == "assistant" and not t.generation_prompt]
        assert len(turns) == len(regions), (case.name, [t.role for t in conv.turns])
        spans = conv.spans()
        by_turn: dict[int, list] = {}
        for s in spans:
            by_turn.setdefault(s.turn, []).append(s)
        for t, (start, end), out in zip(turns, regions, case.outputs):
            k = conv.turns.index(t)
            got = by_turn.pop(k, [])
            assert t.body_start == start and t.body_end == end, (case.name, out.message_index)
            if start < end:
                assert _merged(got) == [(start, end)], case.name
            else:
                assert not got
            rendered = text[start:end]
            for s in ([out.content] + ([out.reasoning] if out.reasoning else [])):
                if s and s in text:  # the template keeps it: it is in this message's output
                    assert s in rendered, (case.name, s)
            if tpl.tool_calls:
                for call in out.tool_calls:
                    for s in call.strings():
                        assert s in rendered, (case.name, s)
        assert not by_turn, f"{case.name}: non-assistant turns trained: {by_turn}"
        if case.add_generation_prompt:  # the prompt trains nothing of the final turn
            assert conv.turns[-1].generation_prompt and conv.turns[-1].role == "assistant"
            assert all(s.turn != len(conv.turns) - 1 for s in spans)
        if tpl.fmt == "chatml":  # reasoning and tool calls are typed blocks, not content
            for s in conv.spans():
                piece = text[s.start:s.end]
                assert ("<think>" in piece) <= (s.kind == "think"), (case.name, piece)
                assert ("<tool_call>" in piece) <= (s.kind == "tool_call"), (case.name, piece)
        # ---- id mode agrees
        for tk in tpl.tokenizers:
            check_ids_agree(text, conv, fmt, TOKENIZERS[tk](), POLICIES)
    assert rejected == REJECTED[tpl.file], "the shapes this template rejects changed"



# ----------------------------------------------------------------------------- embedded examples

FAMILY_TOKENIZERS = {"chatml": ("qwen", "qwen2.5", "lfm2"), "phi4": ("phi4",),
                     "llama3": ("llama3",), "gemma": ("gemma",), "phi3": ("phi3",)}


def _example(text: str) -> tuple[str, list[tuple[int, int]]]:
    """Example text without its ⟦…⟧ marks, and the marked (expected trained) ranges."""
    out, spans, start = [], [], None
    for ch in text:
        if ch == "⟦":
            start = sum(map(len, out))
        elif ch == "⟧":
            spans.append((start, sum(map(len, out))))
        else:
            out.append(ch)
    return "".join(out), spans


@pytest.mark.parametrize("name", FORMATS)
def test_embedded_examples(name: str) -> None:
    fmt = cg.load_format(name)
    assert fmt.spec.examples
    for ex in fmt.spec.examples:
        text, want = _example(ex.text)
        policy = cg.MaskPolicy.from_mapping(ex.policy, fmt.default_policy) if ex.policy else None
        conv = fmt.parse(text)
        assert _merged(conv.spans(policy)) == want, ex.name
        if any("inside a marker" in w.message for w in conv.warnings):
            continue  # text cut inside a marker string: ids are never cut inside one id
        checked = 0
        for tk in FAMILY_TOKENIZERS[name]:
            tok = TOKENIZERS[tk]()
            if any(fmt.spec.markers[m].text in text for m in fmt.missing_markers(tok)):
                continue  # a special marker this vocabulary lacks is text there, not a marker
            check_ids_agree(text, conv, fmt, tok, (policy,))
            checked += 1
        assert checked, ex.name


# ----------------------------------------------------------------------------- TRL parity

@dataclass(frozen=True)
class Trl:
    file: str
    fmt: str
    tokenizer: str | None = None   # a fast tokenizer for transformers' own assistant mask
    specials: tuple = ()


TRL_TABLE = [
    Trl("trl-qwen2_5_training.jinja", "chatml", "qwen"),
    Trl("trl-qwen2_5_vl_training.jinja", "chatml", "qwen"),
    Trl("trl-qwen3_training.jinja", "chatml", "qwen"),
    Trl("trl-qwen3_instruct_2507_training.jinja", "chatml", "qwen"),
    Trl("trl-qwen3_vl_training.jinja", "chatml", "qwen"),
    Trl("trl-qwen3_5_think_training.jinja", "chatml", "qwen"),
    Trl("trl-qwen3_5_nothink_training.jinja", "chatml", "qwen"),
    Trl("trl-qwen3_6_training.jinja", "chatml", "qwen"),
    Trl("microsoft-Phi-4-reasoning.jinja", "phi4", "phi4"),  # upstream {% generation %}
    Trl("LiquidAI-LFM2.5-native-generation.jinja", "chatml", "lfm2",  # upstream too
        specials=(("bos_token", "<|startoftext|>"),)),
    Trl("trl-llama3_training.jinja", "llama3"),
    Trl("trl-gemma_training.jinja", "gemma"),
    Trl("trl-gemma3_training.jinja", "gemma"),
    Trl("trl-phi3_training.jinja", "phi3", "phi3"),
    Trl("trl-phi3_5_training.jinja", "phi3", "phi3"),
]
END_POLICY = cg.MaskPolicy(end_marker=True)


@pytest.mark.parametrize("trl", TRL_TABLE, ids=lambda t: t.file.removesuffix(".jinja"))
def test_trl_generation_parity(trl: Trl) -> None:
    """Our spans (end_marker=True) cover the same assistant output as the {% generation %}
    spans transformers records, up to template whitespace (TRL also trains the "\\n" after the
    end marker, Qwen2.5's "\\n" after the role). Only difference: Phi-3's TRL variant also
    trains the closing <|endoftext|> after the last assistant turn, which we treat as a
    between-turns marker (it is not part of any turn)."""
    fmt = cg.load_format(trl.fmt)
    src = template(trl.file)
    checked = 0
    for case in default_matrix():
        kw = {**SPECIAL_TOKENS[trl.fmt], **dict(trl.specials), **case.render_kwargs()}
        try:
            r = render_chat_with_spans(src, copy.deepcopy(case.messages), **kw)
        except TemplateError:
            continue
        text = r.text
        theirs = np.zeros(len(text), bool)
        for a, b in r.generation_spans:
            theirs[a:b] = True
        if trl.fmt == "phi3" and text.endswith("<|endoftext|>") and not case.add_generation_prompt:
            assert theirs[-len("<|endoftext|>"):].all()  # the documented difference
            theirs[-len("<|endoftext|>"):] = False
        ours = char_mask(fmt.parse(text), END_POLICY)
        visible = np.array([not c.isspace() for c in text], bool)
        diff = np.flatnonzero((theirs != ours) & visible)
        assert not diff.size, (case.name, text[max(0, diff[0] - 30):diff[0] + 30])
        assert ours.any() == bool(case.outputs) or case.add_generation_prompt
        if trl.tokenizer is not None:
            _token_parity(trl, case, fmt)
        checked += 1
    assert checked >= 5


def _token_parity(trl: Trl, case, fmt: cg.Format) -> None:
    """Against transformers' own ``return_assistant_tokens_mask`` (a fast tokenizer)."""
    tok = TOKENIZERS[trl.tokenizer]()
    kw = {k: v for k, v in case.render_kwargs().items()}
    out = tok.apply_chat_template(copy.deepcopy(case.messages), chat_template=template(trl.file),
                                  tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kw)
    ids = out["input_ids"]  # (rendered with the tokenizer's own special tokens)
    theirs = np.asarray(out["assistant_masks"], bool)
    ours = np.asarray(fmt.loss_mask(ids, tok, policy=END_POLICY), bool)
    assert theirs.any() == ours.any() == any(o.content or o.tool_calls for o in case.outputs), \
        case.name
    last = len(ids) - 1
    for i in np.flatnonzero(theirs != ours):
        piece = tok.decode([ids[i]], skip_special_tokens=False)
        if piece.strip() == "":
            continue  # template whitespace (the "\n" after <|im_end|>, SentencePiece's "▁")
        if trl.fmt == "phi3" and i == last and piece == "<|endoftext|>":
            continue  # the documented difference (see test_trl_generation_parity)
        pytest.fail(f"{case.name}: token {i} {piece!r}: transformers {theirs[i]}, ours {ours[i]}")


# ----------------------------------------------------------------------------- detection

@pytest.mark.parametrize("tpl", TEMPLATE_TABLE, ids=lambda t: t.file.removesuffix(".jinja"))
def test_detect_template(tpl: Tpl) -> None:
    assert cg.detect_format(chat_template=template(tpl.file)).name == tpl.fmt


@pytest.mark.parametrize("trl", TRL_TABLE, ids=lambda t: t.file.removesuffix(".jinja"))
def test_detect_trl_template(trl: Trl) -> None:
    assert cg.detect_format(chat_template=template(trl.file)).name == trl.fmt


@pytest.mark.parametrize("tk,want", [("qwen", "chatml"), ("qwen2.5", "chatml"), ("phi4", "phi4"),
                                     ("phi3", "phi3"), ("llama3", "llama3"), ("gemma", "gemma")])
def test_detect_tokenizer(tk: str, want: str) -> None:
    assert cg.detect_format(TOKENIZERS[tk]()).name == want


def test_phi4_takes_precedence_over_chatml() -> None:
    """A Phi-4 tokenizer also carries ChatML's <|im_start|> / <|im_end|>: both match, phi4 wins
    by its declared precedence (never by file order); the same for its templates."""
    from chatgrammar.detect import explain_detection

    for kw in ({"tokenizer": phi4_like_tokenizer()},
               {"chat_template": template("microsoft-phi-4.jinja")}):
        ex = explain_detection(**kw)
        assert ex.format == "phi4" and "chatml" in ex.matched, ex


# ----------------------------------------------------------------------------- truncation

TRUNCATION = {  # format -> (template, case): a multi-turn render of the family
    "chatml": ("Qwen-Qwen3-0.6B.jinja", "reasoning"),
    "phi4": ("microsoft-phi-4.jinja", "multi-turn"),
    "llama3": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "multi-turn"),
    "gemma": ("google-gemma-3-it.jinja", "multi-turn"),
    "phi3": ("microsoft-Phi-3-mini-4k-instruct.jinja", "multi-turn"),
}


def _truncation_setup(name: str):
    file, case_name = TRUNCATION[name]
    tpl, case = TPL[file], get_case(case_name)
    text = render(tpl, case)
    regions = assistant_regions(tpl, case, text)
    return tpl, case, text, regions, cg.load_format(name), TOKENIZERS[tpl.tokenizers[0]]()


def _trained_by_turn(conv) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list] = {}
    for s in conv.spans():
        out.setdefault(s.turn, []).append(s)
    return {k: _merged(v) for k, v in out.items()}


@pytest.mark.parametrize("name", FORMATS)
def test_truncated_mid_content(name: str) -> None:
    """Cut by max_length inside the last assistant output: what is there trains (text and
    ids), the turn is incomplete, earlier turns are unaffected."""
    tpl, case, text, regions, fmt, tok = _truncation_setup(name)
    s, e = regions[-1]
    cut = s + (e - s) // 2
    conv = fmt.parse(text[:cut])
    last = conv.turns[-1]
    assert last.role == "assistant" and not last.complete and not last.generation_prompt
    got = _trained_by_turn(conv)
    assert got.pop(len(conv.turns) - 1) == [(s, cut)]
    assert sorted(sum(got.values(), [])) == [r for r in regions[:-1] if r[0] < r[1]]
    # id mode: the id sequence cut inside the same content
    ids, offsets = encode(tok, text)
    k = next(i for i, (a, b) in enumerate(offsets) if b > cut)
    end = offsets[k - 1][1]
    iconv = fmt.parse_ids(ids[:k], tok)
    assert not iconv.turns[-1].complete and iconv.turns[-1].role == "assistant"
    trained = [r for r in regions[:-1]] + [(s, end)]
    want = [any(a < re_ and b > rs for rs, re_ in trained) for a, b in offsets[:k]]
    assert iconv.mask() == [int(w) for w in want]
    (span,) = [x for x in iconv.spans() if x.turn == len(iconv.turns) - 1]
    assert offsets[span.start][0] == s and offsets[span.end - 1][1] == end


@pytest.mark.parametrize("name", FORMATS)
def test_truncated_inside_header(name: str) -> None:
    """Cut inside the last assistant header: nothing of that turn trains (text and ids), the
    turns before still do."""
    tpl, case, text, regions, fmt, tok = _truncation_setup(name)
    s, _ = regions[-1]
    h = s - len(tpl.header)
    earlier = [r for r in regions[:-1] if r[0] < r[1]]
    opener_len = {"chatml": 12, "phi4": 12, "llama3": 19, "gemma": 15, "phi3": 13}[name]
    for cut in range(h + opener_len, s):  # every cut after the opener marker, inside the header
        conv = fmt.parse(text[:cut])
        assert not conv.turns[-1].complete
        assert sorted(sum(_trained_by_turn(conv).values(), [])) == earlier, repr(text[h:cut])
    ids, offsets = encode(tok, text)
    j = next(i for i, (a, b) in enumerate(offsets) if a == h)  # the opener id
    first_body = next(i for i, (a, b) in enumerate(offsets) if a >= s)
    for k in range(j + 1, first_body):
        iconv = fmt.parse_ids(ids[:k], tok)
        trained = [i for i, m in enumerate(iconv.mask()) if m]
        assert all(offsets[i][1] <= h for i in trained), (k, tok.decode(ids[j:k]))
        assert any(iconv.mask()) == bool(earlier)


def test_truncated_inside_reasoning_chatml() -> None:
    """Qwen3: cut inside the last turn's <think> block: the reasoning present trains as think."""
    tpl = TPL["Qwen-Qwen3-0.6B.jinja"]
    case = get_case("reasoning-thinking-on")
    text = render(tpl, case)
    at = text.index(case.outputs[-1].reasoning) + 10
    fmt = cg.load_format("chatml")
    conv = fmt.parse(text[:at])
    spans = [s for s in conv.spans() if s.turn == len(conv.turns) - 1]
    assert [(s.kind, text[s.start:s.end]) for s in spans] == [
        ("think", "<think>\n" + case.outputs[-1].reasoning[:10])]
    assert conv.spans(cg.MaskPolicy(thinking=False))[-1:] == [] or all(
        s.turn != len(conv.turns) - 1 for s in conv.spans(cg.MaskPolicy(thinking=False)))
    tok = qwen_fast_tokenizer()
    ids, offsets = encode(tok, text)
    k = next(i for i, (a, b) in enumerate(offsets) if b > at)
    iconv = fmt.parse_ids(ids[:k], tok)
    last = [s for s in iconv.spans() if s.turn == len(iconv.turns) - 1]
    assert [s.kind for s in last] == ["think"]
    assert tok.decode(ids[last[0].start:last[0].end]).startswith("<think>\n")


# ----------------------------------------------------------------------------- family details

def test_llama31_builtin_tool_call_python_tag_and_eom() -> None:
    """Llama 3.1 built-in tools: `<|python_tag|>NAME.call(…)<|eom_id|>` is a tool_call span
    ended by <|eom_id|>; the result comes back as an `ipython` turn (role tool, never trains)."""
    tpl = TPL["meta-llama-Llama-3.1-8B-Instruct.jinja"]
    messages = [
        {"role": "user", "content": "Search for Mars news."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call00001", "type": "function",
             "function": {"name": "brave_search", "arguments": {"query": "Mars news"}}}]},
        {"role": "tool", "tool_call_id": "call00001", "name": "brave_search",
         "content": "Rover finds ice."},
        {"role": "assistant", "content": "A rover found ice."}]
    text = render_chat(template(tpl.file), messages, builtin_tools=["brave_search"],
                       **SPECIAL_TOKENS["llama3"])
    assert '<|python_tag|>brave_search.call(query="Mars news")<|eom_id|>' in text
    fmt = cg.load_format("llama3")
    conv = fmt.parse(text)
    assert [t.role for t in conv.turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert [(s.kind, text[s.start:s.end]) for s in conv.spans()] == [
        ("tool_call", '<|python_tag|>brave_search.call(query="Mars news")'),
        ("content", "A rover found ice.")]
    assert [text[s.start:s.end] for s in conv.spans(cg.MaskPolicy(end_marker=True))
            if s.kind == "end"] == ["<|eom_id|>", "<|eot_id|>"]
    assert [s.kind for s in conv.spans(cg.MaskPolicy(tool_calls=False))] == ["content"]
    check_ids_agree(text, conv, fmt, llama3_encoding(), POLICIES)


def test_lead_inside_a_merged_token_is_trained_and_reported() -> None:
    """Content starting with "\\n" after Llama 3's "\\n\\n" lead: BPE merges "\\n\\n\\n" into one
    token; it carries header and content, so it is trained and the boundary is reported."""
    fmt, enc = cg.load_format("llama3"), llama3_encoding()
    text = "<|start_header_id|>assistant<|end_header_id|>\n\n\nHi<|eot_id|>"
    assert fmt.parse(text).trained_text() == ["\nHi"]
    ids = enc.encode(text, allowed_special="all")
    assert enc.decode([ids[3]]) == "\n\n\n"
    conv = fmt.parse_ids(ids, enc)
    assert conv.mask() == [0, 0, 0, 1, 1, 0] and [b.offset for b in conv.boundaries] == [3]


def test_soft_marker_straddling_a_token_stays_with_the_text() -> None:
    """Qwen2.5's vocabulary has no <think>/</think> ids: "</think>\\n\\n" tokenises as "</",
    "think", ">\\n\\n". With thinking off, the content "\\n\\n" still trains: its token goes with
    the content (it is reported), never silently dropped with the think block."""
    fmt, enc = cg.load_format("chatml"), qwen25_encoding()
    text = "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nA<|im_end|>"
    ids = enc.encode(text, allowed_special="all")
    conv = fmt.parse_ids(ids, enc)
    trained = [enc.decode([i]) for i, m in zip(ids, conv.mask(cg.MaskPolicy(thinking=False)))
               if m]
    assert trained == [">\n\n", "A"]
    assert any("ends inside a token" in b.message for b in conv.boundaries)


def test_phi3_generation_prompt_in_ids() -> None:
    """Phi-3's SentencePiece writes <|assistant|> ▁ \\n for the generation prompt; decoded
    across the special id that reads "<|assistant|> \\n", yet it is the generation prompt."""
    fmt, tok = cg.load_format("phi3"), phi3_tokenizer()
    text = "<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids, _ = encode(tok, text)
    conv = fmt.parse_ids(ids, tok)
    assert conv.turns[-1].generation_prompt and not any(conv.mask())


@pytest.mark.parametrize("yaml_text,message", [
    ("""name: x
markers: {a: {text: "<a>"}, b: {text: "<b>"}, t: {text: "<t>"}}
elements:
  turn: {open: a, close: {markers: [b]}, children: [tail]}
  tail: {open: t, ends_with_parent: true, close: {markers: [b]}}
top: [turn]
""", "needs an opener and neither a close marker"),
    ("""name: x
markers: {a: {text: "<a>"}, b: {text: "<b>"}}
elements:
  turn: {open: a, ends_with_parent: true}
top: [turn]
""", "must be a child"),
    ("""name: x
markers: {a: {text: "<a>"}, b: {text: "<b>"}}
elements:
  turn: {open: a, close: {markers: [b]}, lead: "\\n<b>"}
top: [turn]
""", "contains marker"),
    ("""name: x
markers: {a: {text: "<a>"}, b: {text: "<b>"}, t: {text: "<t>"}, u: {text: "<u>"}}
elements:
  turn: {open: a, close: {markers: [b]}, children: [inner]}
  inner: {open: t, close: {markers: [u], required: false}}
top: [turn]
""", "is for top-level elements"),
])
def test_new_constructs_are_checked(yaml_text: str, message: str) -> None:
    from chatgrammar.format import Format
    from chatgrammar.spec import parse_spec

    with pytest.raises(cg.CompileError, match=message):
        Format(*parse_spec(yaml_text, "x.yaml"))
