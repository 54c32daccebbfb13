"""Test helpers of the reliability suite: a generic tokenizer for any format (Qwen's real BPE
ranks plus the format's markers), each format's main templates, and the contract checker.

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

:func:`format_templates` names the real chat templates each bundled format is exercised with
(``main: true`` in its ``formats/<name>.tests.yaml``), and
:func:`check_contract` runs one input through both strictness levels and checks the whole
contract of docs/reliability.md, failing with a ready-made regression file.

Example:
    >>> fmt = cg.load_format("kimi-k2")                          # doctest: +SKIP
    >>> tok = format_encoding(fmt)                               # doctest: +SKIP
    >>> ids = encode_rendered(tok, rendered_text)                # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from tests.tokenizers import QWEN_BASE_VOCAB, QWEN_PATTERN, QWEN_TIKTOKEN  # noqa: F401 (re-exported: test_speedups)

def long_run() -> bool:
    """Whether this is the longer run: ``CHATGRAMMAR_LONG=1`` in the environment (``--runslow``
    sets it too, tests/conftest.py). The long-input, fuzz and property tests marked ``long``
    (pyproject's markers) then run at their full budgets; the default run keeps every check at
    a smaller size (issue 14: the suite in about 5 minutes on 2 cores)."""
    return os.environ.get("CHATGRAMMAR_LONG", "") not in ("", "0")


def sized(default: Any, long: Any) -> Any:
    """``long`` in the longer run (:func:`long_run`), else ``default``.

    Example:
        >>> sized(1_000, 5_000) in (1_000, 5_000)
        True
    """
    return long if long_run() else default


# Placeholders for marker strings typed inside message text: one private-use character per
# marker (U+F0000 plane 15, never produced by the tests' text strategies or by templates).
PLACEHOLDER_BASE = 0xF0000


def _qwen_ranks() -> dict:
    from tests.tokenizers import qwen_ranks

    return qwen_ranks()  # (the one shared copy)


def marker_texts(fmt: Any, *, soft: bool = True) -> list[str]:
    """The marker strings of a format, in declaration order.

    Args:
        fmt: a :class:`chatgrammar.Format`.
        soft: include soft markers (``special: false``, e.g. ``<think>``).
    """
    return [m.text for m in fmt.spec.markers.values() if soft or m.special]


@lru_cache(maxsize=4)  # each holds Qwen's ranks (~35 MB): the suites run format by format
def _encoding(markers: tuple[str, ...]) -> Any:
    """Keyed by the marker set alone (content): a format without soft markers gets the same
    encoding for both soft-marker settings, and formats declaring the same markers share one
    (106 distinct sets for 134 format x setting pairs; each build is ~0.15 CPU-s of Rust)."""
    import tiktoken

    specials = {t: QWEN_BASE_VOCAB + i for i, t in enumerate(markers)}
    name = "fuzz-" + hashlib.sha256("\0".join(markers).encode()).hexdigest()[:12]
    return tiktoken.Encoding(name=name, pat_str=QWEN_PATTERN,
                             mergeable_ranks=_qwen_ranks(), special_tokens=specials)


def format_encoding(fmt: Any, *, soft_as_specials: bool = True) -> Any:
    """A ``tiktoken.Encoding`` for ``fmt``: Qwen ranks + the format's markers as specials.

    Args:
        fmt: a :class:`chatgrammar.Format`.
        soft_as_specials: also give soft markers (``special: false``) their own id. With
            False they stay ordinary BPE text, and id mode must find them in decoded runs.

    Returns:
        The encoding (cached per marker set; shared, treat as read-only).
    """
    markers = tuple(marker_texts(fmt, soft=soft_as_specials))
    return _SHARED.get(markers) or _encoding(markers)


class _SharedEncodings:
    """The encodings of the two marker sets the most bundled formats share (``('<s>',
    '</s>')``: nine formats' set without soft markers), kept while a module runs: the suites
    run format by format in name order, which the four-entry cache above cannot follow
    between the formats that share them (~8 builds of ~0.15 CPU-s saved per module).
    Dropped with the other test caches after each module (``cache_clear``, called by
    tests/conftest.py); which sets are shared is computed once per process."""

    _sets: frozenset | None = None
    _got: dict = {}

    @classmethod
    def get(cls, markers: tuple[str, ...]) -> Any:
        if cls._sets is None:
            import collections

            import chatgrammar as cg

            users: dict = collections.defaultdict(set)
            for name in cg.list_formats():
                fmt = cg.load_format(name)
                for soft in (True, False):
                    users[tuple(marker_texts(fmt, soft=soft))].add(name)
            top = sorted((k for k in users if len(users[k]) > 1),
                         key=lambda k: (-len(users[k]), k))
            cls._sets = frozenset(top[:2])
        if markers not in cls._sets:
            return None
        if markers not in cls._got:
            cls._got[markers] = _encoding.__wrapped__(markers)
        return cls._got[markers]

    @classmethod
    def cache_clear(cls) -> None:
        cls._got = {}

    @classmethod
    def cache_info(cls) -> dict:
        return {"shared": sorted(cls._sets or ()), "built": len(cls._got)}


_SHARED = _SharedEncodings


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


# ------------------------------------------------------------------------ templates per format

TEMPLATES_DIR = Path(__file__).resolve().parent / "data" / "templates"

# Templates that read every message's content as a list of parts (``content_as_parts: true``
# in the format's tests.yaml; MiniMax-M1 reads ``message['content'][0]['text']``). The generic tests build conversations with string content,
# so these templates get a Jinja prelude that turns each string content into one text part (a
# tool result's part also names the tool) before the template's own code runs: the template
# then renders exactly what it renders for the same conversation given as parts.
_PARTS_PRELUDE = (
    "{%- set _cg = namespace(items=[]) -%}"
    "{%- for _m in messages -%}"
    "{%- if _m.content is not defined or _m.content is none or _m.content is string -%}"
    "{%- set _p = {'type': 'text', 'text': (_m.content if _m.content is string else '')} -%}"
    "{%- if _m.role == 'tool' -%}{%- set _p = dict(_p, name=(_m.name or '')) -%}{%- endif -%}"
    "{%- set _cg.items = _cg.items + [dict(_m, content=[_p])] -%}"
    "{%- else -%}{%- set _cg.items = _cg.items + [_m] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set messages = _cg.items -%}")

def format_test_facts(fmt: Any) -> dict:
    """The format's ``formats/<name>.tests.yaml`` (its test facts), or ``{}`` (shared between
    callers: treat as read-only)."""
    p = Path(fmt.path).with_name(f"{fmt.name}.tests.yaml")
    if not p.is_file():
        return {}
    return _parsed_facts(p.read_text(encoding="utf-8"))


@lru_cache(maxsize=8)
def _parsed_facts(text: str) -> dict:
    # keyed by the file's content: the property tests ask once per drawn conversation, and
    # parsing a large tests.yaml (llama4's) each time was most of a test's cost
    import yaml

    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}


def rejected_by_design(fmt: Any, messages: list) -> str | None:
    """Why the format rejects (a located ParseError) every rendering of this conversation by
    design, or None. ``rejects_tool_messages: REASON`` in the format's .tests.yaml: its templates
    drop tool messages or print them like answers, so a tool conversation cannot be read
    safely (docs/formats.md names these formats)."""
    facts = format_test_facts(fmt)
    reason = facts.get("rejects_tool_messages")
    if reason and any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        return reason
    # ``rejects_consecutive_tool_messages``: two tool results in a row (hunyuan)
    reason = facts.get("rejects_consecutive_tool_messages")
    roles = [m.get("role") for m in messages]
    if reason and any(a == b == "tool" for a, b in zip(roles, roles[1:])):
        return reason
    return None


def messages_for(fmt: Any, messages: list) -> list:
    """The conversation as the format's templates take it: without system messages where its
    .tests.yaml says ``no_system: true`` (the template raises on them)."""
    if format_test_facts(fmt).get("no_system"):
        return [m for m in messages if m.get("role") != "system"]
    return messages


def engine_templates(fmt: Any) -> list[tuple[str, str, dict]]:
    """The templates the fast-path equality tests render: the main ones, else the format's
    first template (every format is checked fast == full pipeline, including formats whose
    templates are not yet in the fuzz and property suites)."""
    main = format_templates(fmt)
    if main:
        return main
    ts = tests_for_format(fmt).get("templates") or []
    out = []
    for t in ts[:1]:
        parts = t.get("content_as_parts") or tests_for_format(fmt).get("content_parts")
        src = (TEMPLATES_DIR / t["file"]).read_text(encoding="utf-8")
        out.append((t["file"], (_PARTS_PRELUDE if parts else "") + src, dict(t.get("vars") or {})))
    return out


def tests_for_format(fmt: Any) -> dict:
    from chatgrammar.conformance.format_tests import tests_for

    return tests_for(fmt)


def format_templates(fmt: Any) -> list[tuple[str, str, dict]]:
    """``(file name, template source, special-token kwargs)`` for each main template of a
    format: the ``templates:`` of its test facts (``formats/<name>.tests.yaml``) marked
    ``main: true``, with their ``main_vars`` (default ``vars``); a template marked ``content_as_parts`` gets the
    prelude above."""
    from chatgrammar.conformance.format_tests import tests_for

    out = []
    facts = tests_for(fmt)
    ts = facts.get("templates") or []
    for t in ts:
        if not t.get("main"):
            continue
        parts = t.get("content_as_parts") or facts.get("content_parts")
        prelude = _PARTS_PRELUDE if parts else ""
        src = (TEMPLATES_DIR / t["file"]).read_text(encoding="utf-8")
        out.append((t["file"], prelude + src, dict(t.get("main_vars", t.get("vars")) or {})))
    return out


# ------------------------------------------------------------------------ the contract

# Tokenizers a regression file can name (``"tokenizer"``): the fuzz tokenizer of the format,
# its variant with soft markers left as text, and the real ones of tests/tokenizers.py.
REAL_TOKENIZERS = {
    "qwen": ("chatml", lambda: _tk().qwen_fast_tokenizer()),
    # Qwen2.5's vocabulary without Qwen3's additions (<think>, <tool_response> are text)
    "qwen2.5": ("chatml", lambda: _tk().qwen25_encoding()),
    "mistral-v3": ("mistral", lambda: _tk().mistral_tokenizer("v3")),
    "mistral-v3-slow": ("mistral", lambda: _tk().mistral_tokenizer("v3", fast=False)),
    "mistral-v7": ("mistral", lambda: _tk().mistral_tokenizer("v7")),
    "mistral-v7-slow": ("mistral", lambda: _tk().mistral_tokenizer("v7", fast=False)),
    "phi3": ("phi3", lambda: _tk().phi3_tokenizer()),
}


def _tk():
    from tests import tokenizers

    return tokenizers


def named_tokenizer(fmt: Any, name: str) -> Any:
    """``"fuzz"`` / ``"fuzz-hard"`` (:func:`format_encoding` with soft markers as ids / as
    text) or a real tokenizer of :data:`REAL_TOKENIZERS`."""
    if name in ("fuzz", "fuzz-hard"):
        return format_encoding(fmt, soft_as_specials=name == "fuzz")
    return REAL_TOKENIZERS[name][1]()


def marker_id_table(fmt: Any, tok: Any) -> dict[int, str]:
    """Special id → marker text, for the markers of ``fmt`` the tokenizer has one id for."""
    lx = fmt.id_lexer(tok)
    return {tid: lx.cfg.marker_text[term] for term, tid in lx.marker_ids.items()}


def regression_snippet(fmt: Any, mode: str, data: Any, enc: Any = None, note: str = "",
                       tokenizer: str = "fuzz") -> str:
    """A ``tests/data/regressions/<format>/<name>.json`` body for a failing input (marker ids
    spelled as their marker text), to paste into a regression file."""
    import json

    if mode == "ids":
        specials = marker_id_table(fmt, enc) if enc is not None else {}
        data = [specials.get(int(i), int(i)) for i in data]
    body = {"description": note, "found_by": "tests/test_fuzz.py", "mode": mode,
            "tokenizer": tokenizer, "input": data, "strict": "ok"}
    if mode == "text":
        del body["tokenizer"]
    return (f"--- regression file for tests/data/regressions/{fmt.name}/<name>.json ---\n"
            + json.dumps(body, ensure_ascii=False))


_MEMOLESS: dict[int, tuple[Any, Any]] = {}


def _memoless(fmt: Any) -> Any:
    """The same format with its text-mode memo switched off (chatgrammar.runtime.textpath.TextMemo):
    every parse takes the full pipeline."""
    hit = _MEMOLESS.get(id(fmt))
    if hit is not None and hit[0] is fmt:
        return hit[1]
    from chatgrammar.runtime.format import Format

    plain = Format(fmt.spec, fmt.source)
    try:
        from chatgrammar.runtime.textpath import TextMemo
    except ImportError:  # no memo in this version: the plain format is the format
        TextMemo = None
    if TextMemo is not None and hasattr(plain, "_text_memo"):
        memo = TextMemo(plain)
        memo.enabled = False
        plain._text_memo = memo
    if len(_MEMOLESS) >= 2:  # a copy holds its own tables and per-tokenizer state: few kept
        _MEMOLESS.clear()
    _MEMOLESS[id(fmt)] = (fmt, plain)
    return plain


def _summary(conv: Any, policies=()) -> tuple:
    turns = tuple((t.role, t.start, t.end, t.complete, t.valid, t.generation_prompt)
                  for t in conv.turns)
    return (turns, tuple(conv.warnings), tuple(tuple(conv.spans(p)) for p in (None,) +
                                               tuple(policies)))


def check_contract(fmt: Any, data: Any, mode: str, enc: Any = None, *, policies=(),
                   tokenizer: str = "fuzz") -> tuple:
    """Run both modes of the reliability contract on one input; returns (strict result —
    a Conversation or the ParseError —, lenient Conversation).

    Checked: strict parsing returns or raises a ParseError (offset within the input, expected
    markers, excerpt) and nothing else; lenient parsing never raises; every mask has exactly
    one 0/1 value per input position; spans are sorted, non-overlapping, inside the input,
    under the default and every extra policy; when strict succeeds, lenient agrees with it
    (same spans, same warnings); text mode agrees with a memo-less parse, and id mode's
    ``loss_mask`` / ``loss_masks`` fast path with ``parse_ids``.

    Raises:
        AssertionError: a violation, with a regression-file snippet for the input.
    """
    import numpy as np

    from chatgrammar.errors import ParseError

    n = len(data)

    def run(strict: bool):
        if mode == "text":
            return fmt.parse(data, strict=strict)
        return fmt.parse_ids(data, enc, strict=strict)

    def fail(msg: str):
        raise AssertionError(f"{fmt.name} [{mode}]: {msg}\n"
                             + regression_snippet(fmt, mode, data, enc, msg, tokenizer))

    def check_conv(conv, label: str):
        if conv.length != n:
            fail(f"{label}: conversation length {conv.length} != input length {n}")
        for pol in (None,) + tuple(policies):
            m = conv.mask_array(pol)
            if m.shape != (n,) or (n and not np.isin(m, (0, 1)).all()):
                fail(f"{label}: mask shape {m.shape} / values not 0/1 (policy {pol})")
            last = 0
            for s in conv.spans(pol):
                if not (last <= s.start < s.end <= n):
                    fail(f"{label}: span {s} out of order or out of bounds (policy {pol})")
                last = s.end
        for t in conv.turns:
            if not (0 <= t.start <= t.end <= n):
                fail(f"{label}: turn {t.role} [{t.start}, {t.end}) out of bounds")

    try:
        strict = run(True)
    except ParseError as exc:
        if exc.offset is None or not (0 <= exc.offset <= n):
            fail(f"ParseError without a valid offset: {exc.offset!r}")
        if not isinstance(exc.excerpt, str) or not str(exc):
            fail("ParseError without an excerpt / message")
        strict = exc
    except RecursionError:
        fail("strict parsing hit RecursionError")
    except Exception as exc:  # noqa: BLE001 - any other exception type is the violation
        fail(f"strict parsing raised {type(exc).__name__}: {exc}")
    else:
        check_conv(strict, "strict")
    try:
        lenient = run(False)
    except Exception as exc:  # noqa: BLE001
        fail(f"lenient parsing raised {type(exc).__name__}: {exc}")
    check_conv(lenient, "lenient")
    if mode == "text":
        # Format.parse may rebuild items from its memo: a memo-less parse must agree exactly
        plain = _memoless(fmt)
        try:
            ref = plain.parse(data, strict=True)
        except ParseError as exc:
            ref = exc
        if isinstance(ref, ParseError) != isinstance(strict, ParseError):
            fail(f"memoised and plain parses disagree: {strict!r} vs {ref!r}")
        ref_l = plain.parse(data, strict=False)
        for got, want in ((lenient, ref_l),) + (() if isinstance(strict, ParseError) else
                                                ((strict, ref),)):
            if _summary(got, policies) != _summary(want, policies):
                fail("memoised parse differs from the plain parse")
    if mode == "ids":
        # the memoised fast path of loss_mask / loss_masks must give exactly the parse's mask
        for pol in (None,) + tuple(policies):
            try:
                fast = fmt.loss_mask(data, enc, policy=pol, strict=True)
            except ParseError:
                if not isinstance(strict, ParseError):
                    fail(f"loss_mask raised where parse_ids did not (policy {pol})")
            except Exception as exc:  # noqa: BLE001
                fail(f"loss_mask raised {type(exc).__name__}: {exc}")
            else:
                if isinstance(strict, ParseError):
                    fail(f"parse_ids raised {strict.message!r} but loss_mask did not")
                if not np.array_equal(np.asarray(fast), strict.mask_array(pol)):
                    fail(f"loss_mask differs from parse_ids(...).mask_array() (policy {pol})")
            try:
                fast = fmt.loss_masks([data, data], enc, policy=pol, strict=False)
            except Exception as exc:  # noqa: BLE001
                fail(f"lenient loss_masks raised {type(exc).__name__}: {exc}")
            want = lenient.mask_array(pol)
            if len(fast) != 2 or not all(np.array_equal(np.asarray(f), want) for f in fast):
                fail(f"lenient loss_masks differs from parse_ids(...).mask_array() "
                     f"(policy {pol})")
    if not isinstance(strict, ParseError):
        if lenient.warnings != strict.warnings:
            fail(f"strict parse succeeded but lenient reports more: {lenient.warnings[:3]} "
                 f"vs {strict.warnings[:3]}")
        if lenient.spans() != strict.spans():
            fail("strict and lenient parses of a valid input train different spans")
    return strict, lenient
