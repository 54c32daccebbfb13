"""A generic test tokenizer for any format: Qwen's real BPE ranks plus the format's markers.

The reliability, property and fuzz tests need an id-mode tokenizer for every bundled format,
including formats added after these tests were written. Real tokenizers exist for a few
families only, so this module builds one for any spec: a ``tiktoken.Encoding`` over Qwen2.5's
ranks (``tests/data/tokenizers/Qwen-Qwen2.5/qwen.tiktoken``, 151,643 ordinary ids) with each
of the format's marker strings registered as a special token, at ids just past the base
vocabulary (in marker declaration order).

Rendered conversations are encoded the way a trainer's tokenizer does it: template text with
specials allowed (a marker string the template writes becomes its one special id), message
text as ordinary text. To tell the two apart after rendering, message strings are *masked*
before rendering: every marker string typed in a message is replaced by a private-use
placeholder character, which :func:`encode_rendered` encodes as the marker's *ordinary* ids
and :func:`unmask` turns back into the marker string. So ``"<|im_end|>"`` typed by a user is
a run of ordinary ids in id mode (as with a real tokenizer) and the marker string in text mode.

Example:
    >>> fmt = cg.load_format("kimi-k2")                          # doctest: +SKIP
    >>> tok = format_encoding(fmt)                               # doctest: +SKIP
    >>> ids = encode_rendered(tok, rendered_text)                # doctest: +SKIP
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable

from tests.tokenizers import QWEN_BASE_VOCAB, QWEN_PATTERN, QWEN_TIKTOKEN

# Placeholders for marker strings typed inside message text: one private-use character per
# marker (U+F0000 plane 15, never produced by the tests' text strategies or by templates).
PLACEHOLDER_BASE = 0xF0000


@lru_cache(maxsize=None)
def _qwen_ranks() -> dict:
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(QWEN_TIKTOKEN))
    assert len(ranks) == QWEN_BASE_VOCAB
    return ranks


def marker_texts(fmt: Any, *, soft: bool = True) -> list[str]:
    """The marker strings of a format, in declaration order.

    Args:
        fmt: a :class:`chatgrammar.Format`.
        soft: include soft markers (``special: false``, e.g. ``<think>``).
    """
    return [m.text for m in fmt.spec.markers.values() if soft or m.special]


@lru_cache(maxsize=None)
def _encoding(name: str, markers: tuple[str, ...]) -> Any:
    import tiktoken

    specials = {t: QWEN_BASE_VOCAB + i for i, t in enumerate(markers)}
    return tiktoken.Encoding(name=f"fuzz-{name}", pat_str=QWEN_PATTERN,
                             mergeable_ranks=_qwen_ranks(), special_tokens=specials)


def format_encoding(fmt: Any, *, soft_as_specials: bool = True) -> Any:
    """A ``tiktoken.Encoding`` for ``fmt``: Qwen ranks + the format's markers as specials.

    Args:
        fmt: a :class:`chatgrammar.Format`.
        soft_as_specials: also give soft markers (``special: false``) their own id. With
            False they stay ordinary BPE text, and id mode must find them in decoded runs.

    Returns:
        The encoding (cached per format and marker set; shared, treat as read-only).
    """
    markers = tuple(marker_texts(fmt, soft=soft_as_specials))
    return _encoding(fmt.name + ("" if soft_as_specials else "-hard"), markers)


def placeholder_table(markers: Iterable[str]) -> dict[str, str]:
    """Marker string → its private-use placeholder character."""
    return {m: chr(PLACEHOLDER_BASE + i) for i, m in enumerate(markers)}


def mask_markers(value: Any, table: dict[str, str]) -> Any:
    """A copy of ``value`` (message / tool structures) with every marker string typed in a
    string replaced by its placeholder (longest markers first)."""
    order = sorted(table, key=len, reverse=True)
    if isinstance(value, str):
        for m in order:
            if m in value:
                value = value.replace(m, table[m])
        return value
    if isinstance(value, dict):
        return {mask_markers(k, table): mask_markers(v, table) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_markers(v, table) for v in value)
    return value


def unmask(text: str, table: dict[str, str]) -> str:
    """Placeholders back to the marker strings they stand for."""
    for m, ph in table.items():
        if ph in text:
            text = text.replace(ph, m)
    return text


def encode_rendered(enc: Any, text: str, table: dict[str, str] | None = None) -> list[int]:
    """Encode a rendering as a trainer would: template markers → special ids, message text
    (placeholders included) → ordinary ids.

    Args:
        enc: the encoding from :func:`format_encoding`.
        text: the rendering, with typed markers still masked by :func:`mask_markers`.
        table: the placeholder table used for masking (None: no placeholders).

    Returns:
        The ids; ``enc.decode(ids) == unmask(text, table)``.
    """
    if not table:
        return enc.encode(text, allowed_special="all")
    back = {ph: m for m, ph in table.items()}
    ids: list[int] = []
    seg = 0
    for i, ch in enumerate(text):
        if ch in back:
            if i > seg:
                ids.extend(enc.encode(text[seg:i], allowed_special="all"))
            ids.extend(enc.encode_ordinary(back[ch]))
            seg = i + 1
    if seg < len(text):
        ids.extend(enc.encode(text[seg:], allowed_special="all"))
    return ids


def token_char_starts(enc: Any, ids: list[int]) -> tuple[str, list[int]]:
    """(decoded text, char offset where each token starts) — tiktoken's own offsets."""
    text, offsets = enc.decode_with_offsets(ids)
    return text, list(offsets)


def expected_token_mask(char_mask: list[int], starts: list[int], n_chars: int) -> list[int]:
    """Project a per-char mask onto tokens: a token trains when any char it carries trains
    (the documented rule for a span boundary inside a merged token). A token carrying only
    part of one multi-byte char is given that char."""
    import numpy as np

    cm = np.asarray(char_mask, dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(cm)])
    st = np.asarray(starts, dtype=np.int64)
    en = np.concatenate([st[1:], [n_chars]]) if len(st) else st
    en = np.maximum(en, np.minimum(st + 1, n_chars))
    return ((prefix[en] - prefix[st]) > 0).astype(int).tolist()
