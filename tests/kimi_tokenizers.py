"""Kimi tokenizers for the tests, offline: tiktoken Encodings with Kimi's real special ids.

Kimi's own BPE ranks (``tiktoken.model``) are not available offline; the base vocabulary here is
Qwen's byte-level BPE ranks (tests/data/tokenizers/Qwen-Qwen2.5/qwen.tiktoken, 151,643 ranks) —
what matters for the engine is that specials sit at Kimi's real ids past the base vocabulary and
that message text is ordinary BPE. Special ids (Kimi-K2 ``tokenizer_config.json``
``added_tokens_decoder``; K3's from the issue / its reference encoder):

- K2: ``[BOS]`` 163584, ``[EOS]`` 163585, ``<|im_end|>`` 163586, ``<|im_user|>`` 163587,
  ``<|im_assistant|>`` 163588, ``<|start_header_id|>`` 163590, ``<|end_header_id|>`` 163591,
  ``[EOT]`` 163593, ``<|im_system|>`` 163594, tool-call markers 163595–163599,
  ``<|im_middle|>`` 163601, media markers 163602–163605, ``<think>`` 163606, ``</think>`` 163607;
  every other id of 163584..163839 is ``<|reserved_token_N|>``.
- K3: ``<|end_of_msg|>`` 163586, ``<|open|>`` 163587, ``<|close|>`` 163588, ``<|sep|>`` 163589;
  a real K3 tokenizer also registers K2's ``<|im_*|>`` strings as added ids past the base
  vocabulary (163840+): :func:`kimi_k3_encoding` ``(with_k2_strings=True)``.

:func:`render_and_encode` encodes template text with specials allowed and message text with
none, so a ``<|close|>`` typed in user text stays ordinary ids (what a real pipeline does when it
tokenises messages separately, and what id mode must get right).
"""
from __future__ import annotations

import copy
import re
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
QWEN_TIKTOKEN = DATA / "tokenizers" / "Qwen-Qwen2.5" / "qwen.tiktoken"
TEMPLATES = DATA / "templates"

# Kimi's pre-tokenizer is GPT-4-like; exact splitting is irrelevant to the engine.
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

K2_SPECIALS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
    "<|im_assistant|>": 163588, "<|start_header_id|>": 163590, "<|end_header_id|>": 163591,
    "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601, "<|media_start|>": 163602, "<|media_content|>": 163603,
    "<|media_end|>": 163604, "<|media_pad|>": 163605, "<think>": 163606, "</think>": 163607,
}
K3_SPECIALS = {"<|end_of_msg|>": 163586, "<|open|>": 163587, "<|close|>": 163588,
               "<|sep|>": 163589}
K2_STRINGS_IN_K3 = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                    "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


@lru_cache(maxsize=None)
def _ranks() -> dict:
    from tiktoken.load import load_tiktoken_bpe
    return load_tiktoken_bpe(str(QWEN_TIKTOKEN))


def _with_reserved(specials: dict[str, int]) -> dict[str, int]:
    used = set(specials.values())
    out = dict(specials)
    for i in range(163584, 163840):
        if i not in used:
            out[f"<|reserved_token_{i}|>"] = i
    return out


@lru_cache(maxsize=None)
def kimi_k2_encoding():
    """tiktoken Encoding with Kimi-K2's special ids (shared; read-only)."""
    import tiktoken
    return tiktoken.Encoding(name="kimi-k2-test", pat_str=PAT_STR, mergeable_ranks=_ranks(),
                             special_tokens=_with_reserved(K2_SPECIALS))


@lru_cache(maxsize=None)
def kimi_k3_encoding(with_k2_strings: bool = False):
    """tiktoken Encoding with Kimi-K3's special ids; optionally K2's strings at 163840+."""
    import tiktoken
    specials = _with_reserved(K3_SPECIALS)
    if with_k2_strings:
        for i, s in enumerate(K2_STRINGS_IN_K3):
            specials[s] = 163840 + i
    return tiktoken.Encoding(name=f"kimi-k3-test{'-k2' if with_k2_strings else ''}",
                             pat_str=PAT_STR, mergeable_ranks=_ranks(), special_tokens=specials)


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


_SENT = re.compile("\ue000(\\d+)\ue001")


def render_and_encode(enc, template_src: str, messages: list[dict], **kwargs) -> tuple[str, list[int]]:
    """Render ``messages`` with a real template (exactly as transformers) and tokenise it:
    template text with specials allowed, message text (content, reasoning) with none.

    Returns:
        (rendered text, ids); ``enc.decode(ids) == text``.
    """
    from chatgrammar.render import render_chat

    text = render_chat(template_src, messages, **kwargs)
    originals: list[str] = []

    def sub(v: str) -> str:
        originals.append(v)
        return f"\ue000{len(originals) - 1}\ue001"

    masked = copy.deepcopy(messages)
    for m in masked:
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str) and m[key]:
                m[key] = sub(m[key])
    with_sent = render_chat(template_src, masked, **kwargs)
    ids: list[int] = []
    pos = 0
    rebuilt = []
    for mt in _SENT.finditer(with_sent):
        part = with_sent[pos:mt.start()]
        ids += enc.encode(part, allowed_special="all")
        msg = originals[int(mt.group(1))]
        ids += enc.encode(msg, allowed_special=set(), disallowed_special=())
        rebuilt += [part, msg]
        pos = mt.end()
    ids += enc.encode(with_sent[pos:], allowed_special="all")
    rebuilt.append(with_sent[pos:])
    assert "".join(rebuilt) == text, "template transforms message text; cannot split the render"
    assert enc.decode(ids) == text
    return text, ids
