"""What the per-format test files (tests/test_format_*.py) share.

Each of those files checks one bundled format against its real templates: renders the matrix,
compares the trained text with an oracle written from the template, and checks id mode on a
tokenizer carrying the family's special tokens at their real ids. The pieces that do not depend
on the family live here:

- :func:`qwen_ranks` / :func:`renumbered_encoding`: a ``tiktoken.Encoding`` over Qwen's
  byte-level BPE ranks (tests/data/tokenizers/Qwen-Qwen2.5/qwen.tiktoken, Qwen's split
  pattern) with the family's special tokens at their ids; Qwen's ranks are renumbered
  monotonically around those ids (the merge order is kept, so the BPE is unchanged);
- :func:`encode_with_ranges` and :func:`mapped_mask`: ids plus each token's character range,
  and the documented id-mode rule (a token trains iff it overlaps a trained character);
- :func:`parse_example` / :func:`merged_spans`: the ``⟦…⟧`` notation of embedded examples;
- message builders for the matrix-style cases.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

import chatgrammar as cg
from tests.tokenizers import QWEN_BASE_VOCAB, QWEN_PATTERN, QWEN_TIKTOKEN

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"


@lru_cache(maxsize=None)
def template(name: str) -> str:
    """A real chat template of tests/data/templates (provenance in its SOURCES.md)."""
    return (TEMPLATES / name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def qwen_ranks() -> dict:
    """Qwen2.5's 151,643 BPE ranks."""
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(QWEN_TIKTOKEN))
    assert len(ranks) == QWEN_BASE_VOCAB
    return ranks


@lru_cache(maxsize=None)
def renumbered_encoding(name: str, specials: tuple):
    """Qwen's BPE ranks renumbered monotonically around the special ids.

    Args:
        name: the Encoding's name.
        specials: ``((text, id), ...)`` — the family's special tokens at their ids.

    Returns:
        A ``tiktoken.Encoding`` in which every special is one id and ordinary text is Qwen's
        BPE (same merges, ids shifted past the specials).
    """
    import tiktoken

    table = dict(specials)
    taken = set(table.values())
    ranks, next_id = {}, 0
    for piece, _ in sorted(qwen_ranks().items(), key=lambda kv: kv[1]):
        while next_id in taken:
            next_id += 1
        ranks[piece] = next_id
        next_id += 1
    return tiktoken.Encoding(name=name, pat_str=QWEN_PATTERN, mergeable_ranks=ranks,
                             special_tokens=table)


def encode_with_ranges(tok, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The ids of ``text`` (specials written by the template become their ids) and each
    token's character range ``[start, end)`` (a token that starts inside a multi-byte
    character covers that character)."""
    ids = tok.encode(text, allowed_special="all")
    dec, starts = tok.decode_with_offsets(ids)
    assert dec == text
    ends, n = [], 0
    for t in ids:
        n += sum(1 for c in tok.decode_single_token_bytes(t) if not 0x80 <= c < 0xC0)
        ends.append(n)
    assert ends[-1:] in ([len(text)], [])
    return ids, [(a, max(b, a + 1)) for a, b in zip(starts, ends)]


def mapped_mask(conv: cg.Conversation, ranges, n_chars: int, policy=None) -> list[int]:
    """The documented rule: a token is trained iff it overlaps a trained character of the
    text-mode parse ``conv``."""
    chars = np.zeros(n_chars + 1, dtype=np.int64)
    for s in conv.spans(policy):
        chars[s.start:s.end] = 1
    csum = np.concatenate([[0], np.cumsum(chars[:n_chars])])
    return [int(b > a and csum[b] - csum[a] > 0) for a, b in ranges]


def parse_example(text: str) -> tuple[str, list[tuple[int, int]]]:
    """An embedded example's text without its ``⟦…⟧`` marks, and the marked spans."""
    plain, spans, start, n = [], [], None, 0
    for ch in text:
        if ch == "⟦":
            start = n
        elif ch == "⟧":
            spans.append((start, n))
        else:
            plain.append(ch)
            n += 1
    return "".join(plain), spans


def merged_spans(spans) -> list[tuple[int, int]]:
    """Abutting spans (objects with ``start`` / ``end``) merged into ``(start, end)`` runs."""
    out: list[list[int]] = []
    for s in spans:
        if out and out[-1][1] == s.start:
            out[-1][1] = s.end
        else:
            out.append([s.start, s.end])
    return [tuple(x) for x in out]


def user(text) -> dict:
    return {"role": "user", "content": text}


def assistant(text, **kw) -> dict:
    return {"role": "assistant", "content": text, **kw}


def call(cid: str, name: str, args) -> dict:
    """An OpenAI-style tool call."""
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def tool_result(cid: str, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "name": name, "content": content}
