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
- :func:`allowed_kind`, :func:`trained_per_turn`: what a policy trains, for the oracles;
- :func:`check_id_mode` / :func:`check_embedded_examples`: id mode against the text-mode parse,
  and the format's embedded ``examples:`` in both modes;
- message builders for the matrix-style cases.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

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


def allowed_kind(kind: str, policy: cg.MaskPolicy) -> bool:
    """Whether ``policy`` trains a span of ``kind`` ("think" / "tool_call" may be dropped)."""
    return not ((kind == "think" and not policy.thinking)
                or (kind == "tool_call" and not policy.tool_calls))


def trained_per_turn(conv: cg.Conversation, text: str, policy=None, *, role: str = "assistant",
                     prompted: bool = False) -> list[str]:
    """Trained text of every ``role`` turn (generation prompts left out), in order.
    ``prompted``: the final turn is left out too (the caller checks it)."""
    got: dict[int, str] = {}
    for s in conv.spans(policy):
        got[s.turn] = got.get(s.turn, "") + text[s.start:s.end]
    last = len(conv.turns) - 1 if prompted else None
    return [got.get(i, "") for i, t in enumerate(conv.turns)
            if t.role == role and not t.generation_prompt and i != last]


def check_id_mode(fmt: cg.Format, text: str, conv: cg.Conversation, tok, policies, *,
                  warnings: str = "count",
                  turn_fields: tuple = ("role", "complete", "generation_prompt"),
                  boundaries: str | None = None, conv_mask: bool = False) -> cg.Conversation:
    """Id mode is the text-mode parse ``conv``, token for token: same turns (``turn_fields``),
    same spans and, for each of ``policies``, ``loss_mask`` is :func:`mapped_mask`.

    Args:
        warnings: ``"count"`` (as many as in text mode), ``"none"`` or ``"messages"`` (the same
            messages as in text mode).
        boundaries: ``None`` (not checked), ``"none"`` (no boundary inside a token) or
            ``"soft"`` (only soft markers' edges inside merged tokens).
        conv_mask: also check ``conv_ids.mask(policy)``.
    """
    ids, ranges = encode_with_ranges(tok, text)
    conv_ids = fmt.parse_ids(ids, tok)
    assert conv_ids.length == len(ids)
    if warnings == "none":
        assert not conv_ids.warnings
    elif warnings == "messages":
        assert [w.message for w in conv_ids.warnings] == [w.message for w in conv.warnings]
    else:
        assert len(conv_ids.warnings) == len(conv.warnings)
    if boundaries == "none":
        assert not conv_ids.boundaries
    elif boundaries == "soft":
        assert all(b.message.startswith("soft marker ") for b in conv_ids.boundaries)
    assert [tuple(getattr(t, f) for f in turn_fields) for t in conv_ids.turns] == \
        [tuple(getattr(t, f) for f in turn_fields) for t in conv.turns]
    for policy in policies:
        assert [(s.kind, s.role, s.turn) for s in conv_ids.spans(policy)] == \
            [(s.kind, s.role, s.turn) for s in conv.spans(policy)]
        want = mapped_mask(conv, ranges, len(text), policy)
        if conv_mask:
            assert conv_ids.mask(policy) == want
        assert fmt.loss_mask(ids, tok, policy=policy) == want
    return conv_ids


def check_embedded_examples(fmt: cg.Format, tok, *, text_only_suffix: str | None = None,
                            error_match: str | None = None, check_mask=None) -> int:
    """Every embedded example of ``fmt``: the marked spans in text mode (an ``error:`` example
    raises in both modes), and in id mode ``loss_mask`` against :func:`mapped_mask` and the
    same roles.

    Args:
        text_only_suffix: an example text ending so (a cut inside a marker string) is checked
            in text mode only (the truncation tests cover it).
        error_match: what a ParseError must match (default: the example's ``error``).
        check_mask: ``(got, want, conv_ids, policy, name)`` comparing the id-mode mask with the
            mapped one (default: equal).

    Returns:
        How many examples were checked in id mode.
    """
    checked = 0
    for ex in fmt.spec.examples:
        text, want = parse_example(ex.text)
        if ex.error:
            with pytest.raises(cg.ParseError, match=error_match or ex.error):
                fmt.parse(text)
            with pytest.raises(cg.ParseError, match=error_match or ex.error):
                fmt.parse_ids(encode_with_ranges(tok, text)[0], tok)
            continue
        policy = cg.MaskPolicy.from_mapping(ex.policy, fmt.default_policy) if ex.policy else None
        conv = fmt.parse(text)
        assert merged_spans(conv.spans(policy)) == want, ex.name
        if text_only_suffix is not None and text.endswith(text_only_suffix):
            continue
        ids, ranges = encode_with_ranges(tok, text)
        conv_ids = fmt.parse_ids(ids, tok)
        got, mapped = fmt.loss_mask(ids, tok, policy=policy), \
            mapped_mask(conv, ranges, len(text), policy)
        if check_mask is None:
            assert got == mapped, ex.name
        else:
            check_mask(got, mapped, conv_ids, policy, ex.name)
        assert [t.role for t in conv_ids.turns] == [t.role for t in conv.turns], ex.name
        checked += 1
    return checked


def user(text) -> dict:
    return {"role": "user", "content": text}


def assistant(text, **kw) -> dict:
    return {"role": "assistant", "content": text, **kw}


def call(cid: str, name: str, args) -> dict:
    """An OpenAI-style tool call."""
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def tool_result(cid: str, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "name": name, "content": content}
