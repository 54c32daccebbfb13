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

import re
import weakref
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import chatgrammar as cg
from tests.tokenizers import QWEN_PATTERN, qwen_ranks  # noqa: F401 (qwen_ranks: re-exported)

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"


@lru_cache(maxsize=None)
def template(name: str) -> str:
    """A real chat template of tests/data/templates (provenance in its SOURCES.md)."""
    return (TEMPLATES / name).read_text(encoding="utf-8")


def renumbered_ranks(taken) -> dict:
    """Qwen's ranks renumbered monotonically around the ids ``taken`` (the merge order is
    kept): the rank ``r`` piece gets the ``r``-th id that is not taken. Where no taken id is
    below the base vocabulary that is Qwen's own dict, shared (read-only) by every such
    encoding instead of a copy each."""
    ranks = qwen_ranks()
    n = len(ranks)
    low = sorted(i for i in set(taken) if 0 <= i < n + len(taken))
    if not low or low[0] >= n:
        return ranks
    pieces = _pieces_by_rank()
    # the ids not taken, in order (a mask: np.setdiff1d sorts and hashes all 151k ids, ~70 ms
    # per encoding, of which the suite builds hundreds)
    free = np.ones(n + len(low), dtype=bool)
    free[np.asarray(low, np.int64)] = False
    return dict(zip(pieces, np.flatnonzero(free)[:n].tolist()))


@lru_cache(maxsize=1)
def _pieces_by_rank() -> tuple:
    ranks = qwen_ranks()
    pieces = sorted(ranks, key=ranks.__getitem__)
    assert [ranks[p] for p in pieces] == list(range(len(pieces)))  # ranks are 0..n-1
    return tuple(pieces)


@lru_cache(maxsize=4)
def renumbered_encoding(name: str, specials: tuple):
    """Qwen's BPE ranks renumbered monotonically around the special ids.

    Args:
        name: the Encoding's name.
        specials: ``((text, id), ...)`` — the family's special tokens at their ids.

    Returns:
        A ``tiktoken.Encoding`` in which every special is one id and ordinary text is Qwen's
        BPE (same merges, ids shifted past the specials, :func:`renumbered_ranks`).
    """
    import tiktoken

    table = dict(specials)
    return tiktoken.Encoding(name=name, pat_str=QWEN_PATTERN,
                             mergeable_ranks=renumbered_ranks(table.values()),
                             special_tokens=table)


def is_tiktoken(tok) -> bool:
    """Whether ``tok`` is a ``tiktoken.Encoding`` (else a transformers tokenizer)."""
    return hasattr(tok, "decode_with_offsets")


def encode_ids(tok, text: str) -> list[int]:
    """The ids of ``text`` as a template's rendering: the special strings it writes become
    their ids, nothing is added (no BOS)."""
    if is_tiktoken(tok):
        return tok.encode(text, allowed_special="all")
    return tok.encode(text, add_special_tokens=False)


def encode_with_ranges(tok, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """The ids of ``text`` (specials written by the template become their ids) and each
    token's character range ``[start, end)`` (a token that starts inside a multi-byte
    character covers that character). A transformers fast tokenizer gives its offset
    mapping; a slow one has no offsets (``None``: id mode is then compared turn by turn on
    the decoded text, :func:`check_id_mode`)."""
    if not is_tiktoken(tok):
        if not getattr(tok, "is_fast", False):
            return tok.encode(text, add_special_tokens=False), None
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    memo = _encoded_texts(tok)
    hit = memo.get(text)
    if hit is not None:  # (copies: callers may edit what they get)
        return list(hit[0]), list(hit[1])
    ids, ranges = _tiktoken_ranges(tok, text)
    if len(memo) >= 512:
        del memo[next(iter(memo))]
    memo[text] = (tuple(ids), tuple(ranges))
    return ids, ranges


# per tiktoken Encoding (an immutable vocabulary; held weakly: the memo goes with it), the
# texts encoded so far: a format's renderings are encoded by its matrix, batch and truncation
# checks alike, on the same tokenizers
_ENCODED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _encoded_texts(tok) -> dict:
    memo = _ENCODED.get(tok)
    if memo is None:
        memo = _ENCODED[tok] = {}
    return memo


def _tiktoken_ranges(tok, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    ids = tok.encode(text, allowed_special="all")
    if not ids:
        assert text == ""
        return ids, []
    # the token bytes once; every offset from them at once (tiktoken's ``decode_with_offsets``
    # gives the same starts through a Python loop over every byte of every token, ~40% of
    # this function, and decoded the tokens a second time)
    pieces = tok.decode_tokens_bytes(ids)
    joined = b"".join(pieces)
    assert joined.decode("utf-8", errors="strict") == text
    raw = np.frombuffer(joined, dtype=np.uint8)
    lead = (raw & 0xC0) != 0x80  # the first byte of a character (not a continuation byte)
    leads = np.cumsum(lead)  # characters begun up to and including each byte
    lens = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    bounds = np.cumsum(lens)
    first = bounds - lens
    # a token starts at the character of its first byte: the characters begun before that
    # byte, less one when the byte continues a character begun in an earlier token
    # (tiktoken's rule: ``max(0, text_len - (0x80 <= token[0] < 0xC0))``)
    before = leads[first] - lead[first]
    starts = np.maximum(0, before - ~lead[first]).tolist()
    # a token ends after the characters whose first byte it holds
    ends = leads[bounds - 1].tolist()
    assert ends[-1] == len(text)
    return ids, [(a, max(b, a + 1)) for a, b in zip(starts, ends)]


def decoded_turns_agree(conv, conv_ids, text: str, ids, tok, policy=None) -> None:
    """Without offsets (a slow SentencePiece tokenizer): the trained ids of every turn decode
    to that turn's text-mode trained text (SentencePiece may drop or merge spaces)."""
    per_ids: dict[int, list[int]] = {}
    for s in conv_ids.spans(policy):
        per_ids.setdefault(s.turn, []).extend(ids[s.start:s.end])
    per_txt: dict[int, str] = {}
    for s in conv.spans(policy):
        per_txt[s.turn] = per_txt.get(s.turn, "") + text[s.start:s.end]
    assert sorted(per_ids) == sorted(per_txt), policy
    for t, tids in per_ids.items():
        dec = tok.decode(tids, skip_special_tokens=False)
        assert dec.split() == per_txt[t].split() or \
            "".join(dec.split()) == "".join(per_txt[t].split()), (t, dec, per_txt[t])


def mapped_mask(conv: cg.Conversation, ranges, n_chars: int, policy=None) -> list[int]:
    """The documented rule: a token is trained iff it overlaps a trained character of the
    text-mode parse ``conv``."""
    chars = np.zeros(n_chars + 1, dtype=np.int64)
    for s in conv.spans(policy):
        chars[s.start:s.end] = 1
    return _overlaps(chars, ranges, n_chars)


def _overlaps(chars, ranges, n_chars: int) -> list[int]:
    """1 for each ``(a, b)`` of ``ranges`` with ``b > a`` that holds a set character of
    ``chars`` (vectorised: one prefix sum, one gather)."""
    csum = np.concatenate([[0], np.cumsum(chars[:n_chars])])
    if not len(ranges):
        return []
    r = np.asarray(ranges, dtype=np.int64)
    a, b = r[:, 0], r[:, 1]
    return ((b > a) & (csum[b] - csum[a] > 0)).astype(int).tolist()


def _differing(m, want) -> set[int]:
    """The positions where two equally long 0/1 lists differ."""
    return set(np.flatnonzero(np.asarray(m) != np.asarray(want)).tolist())


def parse_example(text: str) -> tuple[str, list[tuple[int, int]]]:
    """An embedded example's text without its ``⟦…⟧`` marks, and the marked spans."""
    plain, spans, start, n = [], [], None, 0
    for piece in _MARK_SPLIT.split(text):  # (the marks and the runs between them)
        if piece == "⟦":
            start = n
        elif piece == "⟧":
            spans.append((start, n))
        else:
            plain.append(piece)
            n += len(piece)
    return "".join(plain), spans


_MARK_SPLIT = re.compile("([⟦⟧])")


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
                  boundaries: str | None = None, conv_mask: bool = False,
                  straddling: bool = False, per_kind: bool = False) -> cg.Conversation:
    """Id mode is the text-mode parse ``conv``, token for token: same turns (``turn_fields``),
    same spans and, for each of ``policies``, ``loss_mask`` is :func:`mapped_mask`.

    Args:
        warnings: ``"count"`` (as many as in text mode), ``"none"`` or ``"messages"`` (the same
            messages as in text mode).
        boundaries: ``None`` (not checked), ``"none"`` (no boundary inside a token) or
            ``"soft"`` (only soft markers' edges inside merged tokens).
        conv_mask: also check ``conv_ids.mask(policy)``.
        straddling: the documented exception of a boundary inside a merged token: the mask
            may differ from the mapped one only at the tokens ``conv_ids.boundaries`` reports
            (and spans are compared only when there is none).
        per_kind: also compare, kind by kind, the tokens id mode gives each span kind with
            the tokens overlapping a character of that kind (same exception).
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
    odd = {b.offset for b in conv_ids.boundaries} if straddling else set()
    for policy in policies:
        if not odd:
            assert [(s.kind, s.role, s.turn) for s in conv_ids.spans(policy)] == \
                [(s.kind, s.role, s.turn) for s in conv.spans(policy)]
        got = fmt.loss_mask(ids, tok, policy=policy)
        masks = [got] + ([conv_ids.mask(policy)] if conv_mask else [])
        if ranges is None:  # no offsets: turn by turn on the decoded text
            decoded_turns_agree(conv, conv_ids, text, ids, tok, policy)
            assert all(m == conv_ids.mask(policy) and len(m) == len(ids) for m in masks)
            continue
        want = mapped_mask(conv, ranges, len(text), policy)
        if per_kind:
            for kind in {s.kind for s in conv.spans(policy)}:
                sub = [s for s in conv.spans(policy) if s.kind == kind]
                chars = np.zeros(len(text) + 1, dtype=np.int64)
                for s in sub:
                    chars[s.start:s.end] = 1
                want_k = _overlaps(chars, ranges, len(text))
                got_k = [0] * len(ids)
                for s in conv_ids.spans(policy):
                    if s.kind == kind:
                        got_k[s.start:s.end] = [1] * (s.end - s.start)
                assert _differing(got_k, want_k) <= odd, kind
        for m in masks:
            assert len(m) == len(ids)
            assert _differing(m, want) <= odd, policy
    return conv_ids


def check_embedded_examples(fmt: cg.Format, tok, *, text_only_suffix: str | None = None,
                            error_match: str | None = None, check_mask=None,
                            skip_marker_cuts: bool = False) -> int:
    """Every embedded example of ``fmt``: the marked spans in text mode (an ``error:`` example
    raises in both modes), and in id mode ``loss_mask`` against :func:`mapped_mask` and the
    same roles.

    Args:
        text_only_suffix: an example text ending so (a cut inside a marker string) is checked
            in text mode only (the truncation tests cover it).
        error_match: what a ParseError must match (default: the example's ``error``).
        check_mask: ``(got, want, conv_ids, policy, name)`` comparing the id-mode mask with the
            mapped one (default: equal).
        skip_marker_cuts: check in text mode only every example whose text ends inside a
            marker string (a proper prefix of two characters or more).

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
        if skip_marker_cuts and any(fmt.spec.markers[m].text in text
                                    for m in fmt.missing_markers(tok)):
            continue  # a special marker this vocabulary lacks is text there, not a marker
        if skip_marker_cuts and any(text.endswith(m.text[:k]) for m in fmt.spec.markers.values()
                                    for k in range(2, len(m.text))):
            continue  # a text cut inside a marker string (ids are never cut inside one id)
        ids, ranges = encode_with_ranges(tok, text)
        conv_ids = fmt.parse_ids(ids, tok)
        got = fmt.loss_mask(ids, tok, policy=policy)
        if ranges is None:  # a slow tokenizer: no offsets
            decoded_turns_agree(conv, conv_ids, text, ids, tok, policy)
            assert [t.role for t in conv_ids.turns] == [t.role for t in conv.turns], ex.name
            checked += 1
            continue
        mapped = mapped_mask(conv, ranges, len(text), policy)
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


# ============================================================================ the format suite
# tests/test_formats.py runs every format that has a data folder, tests/formats/<name>/, through
# the same checks; docs/writing-a-format.md ("A format's tests") says what the folder holds.
# Everything below reads that folder and the format's formats/<name>.tests.yaml; nothing here
# names a format.

import copy as _copy  # noqa: E402
import json as _json  # noqa: E402

import yaml as _yaml  # noqa: E402

from chatgrammar.conformance.format_tests import tests_for  # noqa: E402
from chatgrammar.conformance.matrix import MatrixCase, default_matrix  # noqa: E402
from chatgrammar.conformance.render import RenderTimeout, TemplateError, render_chat  # noqa: E402

SUITE_DIR = Path(__file__).resolve().parent / "formats"
_MARKS = ("\u27e6", "\u27e7")  # ⟦ ⟧


def policy_key(p: dict | None) -> str:
    """``None`` -> ``"default"`` (the format's own policy); ``{"thinking": False}`` ->
    ``"thinking=false"`` (a MaskPolicy with those fields, the rest MaskPolicy's defaults)."""
    if p is None:
        return "default"
    return ",".join(f"{k}={_json.dumps(v)}" for k, v in sorted(p.items()))


def make_policy(p: dict | None):
    return None if p is None else cg.MaskPolicy(**p)


class FormatData:
    """A format's test data: ``tests/formats/<name>/suite.yaml`` (the cases beyond the matrix,
    policies, truncation points, detection expectations, hooks) plus ``formats/<name>.tests.yaml``
    (templates, variables, special ids, accepted deviations).

    Args:
        fmt: the loaded format (its ``.tests.yaml`` is read beside its spec file).
        folder: the data folder (default ``tests/formats/<fmt.name>``).
    """

    def __init__(self, fmt: cg.Format, folder: Path | None = None):
        self.fmt = fmt
        self.name = fmt.name
        self.folder = Path(folder) if folder else SUITE_DIR / fmt.name
        self.facts = tests_for(fmt)
        p = self.folder / "suite.yaml"
        self.data = (_yaml.load(p.read_text(encoding="utf-8"),
                                Loader=getattr(_yaml, "CSafeLoader", _yaml.SafeLoader))
                     if p.is_file() else {}) or {}
        self.goldens: dict[str, dict] = {}
        self._cases: list[MatrixCase] | None = None
        self._by_name: dict[str, MatrixCase] | None = None
        self._templates: list[dict] | None = None
        self._renders: dict[tuple, object] = {}

    # ---------------------------------------------------------------- cases and templates
    def cases(self) -> list[MatrixCase]:
        """The built-in matrix (unless ``matrix: false``) plus the folder's own ``cases``."""
        if self._cases is not None:
            return self._cases
        out = default_matrix() if self.data.get("matrix", True) else []
        for c in self.data.get("cases") or []:
            out.append(MatrixCase(c["name"], c.get("description", ""),
                                  _copy.deepcopy(c["messages"]), tools=_copy.deepcopy(c.get("tools")),
                                  add_generation_prompt=bool(c.get("add_generation_prompt")),
                                  template_kwargs=dict(c.get("template_kwargs") or {}),
                                  tags=frozenset(c.get("tags") or ())))
        self._cases = out
        return out

    def case(self, name: str) -> MatrixCase:
        by_name = self._by_name
        if by_name is None:
            by_name = self._by_name = {}
            for c in self.cases():
                by_name.setdefault(c.name, c)  # (the first of a name, as before)
        return by_name[name]

    def templates(self) -> list[dict]:
        """The tests.yaml templates plus ``templates:`` of suite.yaml (same keys; ``file``
        relative to tests/data/templates), each with its ``tokenizer`` (default ``default``)."""
        if self._templates is not None:
            return self._templates
        out = [dict(t) for t in self.facts.get("templates") or []]
        out += [dict(t) for t in self.data.get("templates") or []]
        opts = self.data.get("template_options") or {}
        for t in out:
            t.update(opts.get(t["file"], {}))
            t.setdefault("tokenizer", self.data.get("tokenizer", "default"))
        self._templates = out
        return out

    def template(self, file: str) -> dict:
        return next(t for t in self.templates() if t["file"] == file)

    def id_tokenizers(self, file: str) -> list[str]:
        """The tokenizers a template's renderings are checked with in id mode: the
        template's ``tokenizer`` when it names one, else every tokenizer of the format with
        special ids."""
        t = self.template(file)
        base = [t["tokenizer"]] if t["tokenizer"] != "default" or t.get("only_tokenizer") \
            else self.tokenizer_names()
        return base + [n for n in t.get("id_tokenizers") or () if n not in base]

    def policies(self) -> list[dict | None]:
        return list(self.data.get("policies") or [None, {"end_marker": True},
                                                   {"thinking": False}, {"tool_calls": False},
                                                   {"last_turn_only": True}])

    def tokenizer_names(self, detection: bool = False) -> list[str]:
        """``default`` and the ``tokenizers:`` with special ids (``use: detection`` ones only
        for the detection checks)."""
        return ["default"] + [n for n, tk in (self.facts.get("tokenizers") or {}).items()
                              if "special_ids" in tk
                              and (detection or tk.get("use", "all") == "all")]

    def tokenizer(self, name: str = "default"):
        """``default``: the format's ``special_ids`` over Qwen's renumbered BPE (the format's
        markers over Qwen's ranks when it has none); else a ``tokenizers:`` entry."""
        if name == "default":
            ids = self.facts.get("special_ids")
            if not ids:
                from tests.fuzz_tokenizers import format_encoding

                return format_encoding(self.fmt)
        else:
            tk = self.facts["tokenizers"][name]
            if "real" in tk:
                return real_tokenizer(tk["real"], tuple(tk.get("add_special") or ()))
            ids = tk["special_ids"]
        return special_ids_encoding(tuple(ids.items()))

    # ---------------------------------------------------------------- rendering
    def source(self, file: str) -> str:
        return template(file)

    def render(self, file: str, case: MatrixCase) -> str:
        """The case rendered with the template as transformers does (raises TemplateError).
        Rendered once per template and case (the matrix, batch, truncation and contrast
        checks all read the same rendering; the template's outcome, text or error, is kept)."""
        key = (file, case.name, id(case))
        if key not in self._renders:
            t = self.template(file)
            from tests.fuzz_tokenizers import _PARTS_PRELUDE

            src = (_PARTS_PRELUDE if t.get("content_as_parts") else "") + self.source(file)
            # ``case.render_kwargs()`` without its deep copies, and no copy of the messages:
            # render_chat rebuilds messages, tools and template variables from plain values
            # before the template sees them, so no template edits a case
            kw = {**(t.get("vars") or {}), "tools": case.tools,
                  "add_generation_prompt": case.add_generation_prompt, **case.template_kwargs}
            try:
                self._renders[key] = render_chat(src, case.messages, **kw)
            except RenderTimeout:
                raise  # (a slow machine's accident, not the template's outcome: not kept)
            except TemplateError as exc:
                self._renders[key] = exc.with_traceback(None)
        out = self._renders[key]
        if isinstance(out, TemplateError):
            # a copy: the kept error never carries a traceback (whose frames would keep the
            # caller's tokenizers alive after the suite has dropped them)
            err = out.__class__.__new__(out.__class__)
            err.args, err.__dict__ = out.args, dict(out.__dict__)
            raise err
        return out

    # ---------------------------------------------------------------- goldens
    def golden_path(self, file: str) -> Path:
        return self.folder / "goldens" / (Path(file).name.removesuffix(".jinja") + ".json")

    def golden(self, file: str) -> dict:
        """The expectations of one template (``goldens/<template>.json``; ``_format.json``
        for the format-level ones), cached."""
        if file not in self.goldens:
            p = self.golden_path(file)
            self.goldens[file] = _json.loads(p.read_text(encoding="utf-8")) if p.is_file() \
                else {}
        return self.goldens[file]


@lru_cache(maxsize=8)  # one format's own (mistral names 6): cleared by the suite per format
def real_tokenizer(name: str, add_special: tuple = ()):
    """A real tokenizer of ``tests.fuzz_tokenizers.REAL_TOKENIZERS`` (a tests.yaml
    ``tokenizers: {x: {real: NAME}}``), with ``add_special`` strings added as special tokens to
    a copy (a stand-in for a model whose own tokenizer is not in the corpus: its base
    vocabulary plus its markers at new ids). Kept for one format at a time: the suite clears
    them when the format changes (a smaller bound rebuilt the copies of a format that names
    more, in turn, for every one of its renderings)."""
    import copy

    from tests.fuzz_tokenizers import REAL_TOKENIZERS

    tok = REAL_TOKENIZERS[name][1]()
    if not add_special:
        return tok
    tok = copy.deepcopy(tok)
    before = len(tok)
    tok.add_special_tokens({"additional_special_tokens": list(add_special)})
    assert len(tok) == before + len(add_special), (name, add_special)
    return tok


@lru_cache(maxsize=3)
def id_encoding(specials: tuple):
    """Qwen's BPE renumbered around ``specials`` (few kept: each costs tens of MB)."""
    return renumbered_encoding.__wrapped__("suite-" + str(hash(specials) & 0xFFFFFFFF),
                                           specials)


#: Special-id tables that several formats of the suite use (tests/test_formats.py names them
#: at collection: the nine formats over Llama 2's ids, ...): their encodings are built once for
#: the module (:func:`shared_encoding`), not once per format.
SHARED_TABLES: set = set()


@lru_cache(maxsize=None)  # (only SHARED_TABLES' few; emptied after each module, as every cache)
def shared_encoding(specials: tuple):
    """:func:`id_encoding`'s encoding of a table of :data:`SHARED_TABLES`, kept across formats."""
    return id_encoding.__wrapped__(specials)


def special_ids_encoding(specials: tuple, *, keep: bool = True):
    """The encoding of a special-id table: the shared one when several formats use the table,
    else :func:`id_encoding`'s (``keep=False``: a fresh one, kept by no cache)."""
    if specials in SHARED_TABLES:
        return shared_encoding(specials)
    return id_encoding(specials) if keep else id_encoding.__wrapped__(specials)


def marked(text: str, spans) -> str:
    """``text`` with each merged span ``(start, end)`` wrapped in ``⟦ ⟧``."""
    out, pos = [], 0
    for s, e in spans:
        out += [text[pos:s], _MARKS[0], text[s:e], _MARKS[1]]
        pos = e
    out.append(text[pos:])
    return "".join(out)


def record(fmt: cg.Format, text: str, policies) -> dict:
    """What the golden of one rendering holds: the trained text marked inline (the format's
    default policy), the turns, the warnings, and every policy's spans."""
    conv = fmt.parse(text)
    spans = {policy_key(p): [[s.kind, s.start, s.end, s.turn] for s in conv.spans(make_policy(p))]
             for p in policies}
    return {"marked": marked(text, merged_spans(conv.spans())),
            "turns": [[t.role, t.start, t.end, t.complete, t.generation_prompt, t.block.close]
                      for t in conv.turns],
            "blocks": [[[b.kind or b.name, b.start, b.end] for b in t.block.children]
                       for t in conv.turns],
            "warnings": [w.message for w in conv.warnings],
            "spans": spans}


def check_record(rec: dict) -> None:
    """A golden is consistent: the marks join back to the text, spans are sorted, disjoint and
    inside their turn, and the default policy's spans are the marked ones."""
    text, spans = parse_example(rec["marked"])
    turns = rec["turns"]
    for key, ss in rec["spans"].items():
        last = 0
        for kind, s, e, turn in ss:
            assert last <= s < e <= len(text), (key, kind, s, e)
            assert turns[turn][1] <= s and e <= turns[turn][2], (key, kind, s, e, turn)
            last = e
    if "default" in rec["spans"]:
        got = merged_spans(type("S", (), {"start": s, "end": e})
                           for _, s, e, _ in rec["spans"]["default"])
        assert got == spans


def truncation_cuts(n: int, stride: int) -> list[int]:
    """The cuts ``0..n`` checked at ``stride`` (every cut at 1; the last always)."""
    return sorted(set(range(0, n + 1, stride)) | {n})


def subsample(rec: dict, stride: int) -> dict:
    """A full truncation record (every cut) reduced to the cuts of :func:`truncation_cuts`."""
    out = {}
    for mode, r in rec.items():
        cuts = truncation_cuts(len(r["trained"]) - 1, stride)
        keep = set(cuts)
        out[mode] = {k: ([r[k][c] for c in cuts] if isinstance(r[k], list)
                         else {m: [c for c in v if c in keep] for m, v in r[k].items()
                               if any(c in keep for c in v)})
                     for k in r}
    return out


def truncation_record(fmt: cg.Format, text: str, tok, within_whole: bool = True,
                      stride: int = 1) -> dict:
    """Every cut of a rendering, both modes: per cut the trained count (default policy and
    ``truncated=False``), the number of turns and whether the last is complete, the warnings and the strict-mode errors (each
    distinct message with the cuts it appears at; -1 counts at a rejected cut). ``within_whole``: no cut trains a position the whole does not."""
    done = cg.MaskPolicy(truncated=False)

    def one(parse, mask, n, full):
        trained, untruncated, turns, warns = [], [], [], {}
        errors: dict[str, list[int]] = {}
        full = np.asarray(full, dtype=np.int8)
        for k in truncation_cuts(n, stride):
            try:
                conv = parse(k)
            except cg.ParseError as exc:  # strict parsing rejects this cut: say where
                errors.setdefault(exc.message, []).append(k)
                trained.append(-1)
                untruncated.append(-1)
                turns.append([-1, False])
                continue
            m = mask(k, conv)
            assert len(m) == k and m == conv.mask()
            cut = np.asarray(m, dtype=np.int8)  # (0/1 each: compared and counted at once)
            assert not within_whole or not (cut > full[:k]).any(), \
                ("trains more than the whole", k)
            trained.append(int(cut.sum()))
            untruncated.append(int(np.count_nonzero(conv.mask(done))))
            turns.append([len(conv.turns), bool(conv.turns) and conv.turns[-1].complete])
            for w in conv.warnings:
                warns.setdefault(w.message, []).append(k)
        return {"trained": trained, "trained_untruncated": untruncated, "turns": turns,
                "warnings": warns, "errors": errors}

    ids, _ = encode_with_ranges(tok, text)
    return {"text": one(lambda k: fmt.parse(text[:k]), lambda k, conv: conv.mask(), len(text),
                        fmt.parse(text).mask()),
            "ids": one(lambda c: fmt.parse_ids(ids[:c], tok),
                       lambda c, conv: fmt.loss_mask(ids[:c], tok), len(ids),
                       fmt.parse_ids(ids, tok).mask())}


class IdsOnlyTokenizer:
    """The least a tokenizer gives id mode (``convert_tokens_to_ids``, ``decode``): the special
    ids of a table, a few ordinary ids as words, and a placeholder for every other id, for
    third-party id fixtures whose vocabulary is not in the corpus (content is never decoded).

    Args:
        special_ids: special string → id.
        words: ordinary id → its text (header words the format must read).
    """

    def __init__(self, special_ids: dict, words: dict):
        self.special = dict(special_ids)
        self.by_id = {v: k for k, v in self.special.items()} | dict(words)

    def convert_tokens_to_ids(self, text):
        return self.special.get(text)

    def decode(self, ids, **_):
        return "".join(self.by_id.get(int(i), "\u00b7") for i in ids)
