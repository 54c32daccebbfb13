"""Stage 3 — lexers: text or token ids → a short list of parser tokens.

A parser token is a tuple ``(type, start, end, value)``: ``type`` is a terminal name
(``M_<MARKER>``, ``TEXT`` or ``HEADER``), ``start``/``end`` are char offsets (text mode) or
token indices (id mode), ``value`` is the text where the grammar must read it (markers,
headers) and ``None`` for content runs, which are never copied or decoded.

Text mode finds every marker in one regex pass; id mode finds every marker id in one
vectorised numpy pass. Python then loops over *markers*, never over characters or tokens.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.compile import HEADER, HEADER_CHARS_PER_TOKEN, TEXT, term_name
from ..core.spec import FormatSpec
from .tokenizers import TokenizerAdapter

Tok = tuple  # (type, start, end, value)


@dataclass
class LexConfig:
    """Lexing facts derived from a spec (shared by both modes)."""

    marker_text: dict[str, str]              # terminal -> text
    special: dict[str, bool]                 # terminal -> must be one special id
    split_after: dict[str, str]              # opener terminal -> literal ending its header
    decode_after: dict[str | None, int]      # terminal (None: input start) -> header budget
    split_max: dict[str, int]
    regex: re.Pattern | None = None
    by_text: dict[str, str] = field(default_factory=dict)
    marker_prefixes: frozenset = frozenset()
    longest_marker: int = 0
    lstrip: frozenset = frozenset()          # terminals that absorb whitespace before them

    @classmethod
    def from_spec(cls, spec: FormatSpec) -> "LexConfig":
        marker_text = {term_name(n): m.text for n, m in spec.markers.items()}
        special = {term_name(n): m.special for n, m in spec.markers.items()}
        split_after: dict[str, str] = {}
        split_max: dict[str, int] = {}
        decode_after: dict[str, int] = {}
        for el in spec.elements.values():
            h = el.header
            if h is not None:
                if h.until_text is not None:
                    for o in el.open:
                        split_after[term_name(o)] = h.until_text
                        split_max[term_name(o)] = h.max_tokens
                else:
                    for o in el.open + h.markers:
                        decode_after[term_name(o)] = max(decode_after.get(term_name(o), 0),
                                                         h.max_tokens)
            if el.close and el.close.header is not None:
                ch = el.close.header
                for o in el.close.markers + ch.markers:
                    decode_after[term_name(o)] = max(decode_after.get(term_name(o), 0),
                                                     ch.max_tokens)
        # An element without an opener whose header ends at a marker (GigaChat's role name
        # before `<|role_sep|>`) starts right where what precedes it ended: the run there is
        # read as a header. Key None: the run at the start of the input.
        for name, el in spec.elements.items():
            if not el.open and el.header is not None and el.header.until is not None:
                for t in _opener_less_starts(spec, name):
                    decode_after[t] = max(decode_after.get(t, 0), el.header.max_tokens)
        texts = sorted(marker_text.values(), key=len, reverse=True)
        regex = re.compile("|".join(re.escape(t) for t in texts)) if texts else None
        by_text = {v: k for k, v in marker_text.items()}
        prefixes = frozenset(t[:k] for t in texts for k in range(1, len(t)))
        cfg = cls(marker_text, special, split_after, decode_after, split_max, regex, by_text,
                  prefixes, max((len(t) for t in texts), default=0))
        cfg.lstrip = frozenset(term_name(n) for n, m in spec.markers.items() if m.lstrip)
        return cfg


def _opener_less_starts(spec: FormatSpec, name: str) -> set:
    """The terminals after which element ``name`` (no opener) may start: the ends of the
    elements it follows (their close markers, close header ends and ``after`` markers), and
    for a top-level or preamble element also the preamble and between-turn markers and the
    start of the input (None)."""
    def ends(e) -> list[str]:
        c = e.close
        if c is None:
            return []
        return c.markers + c.after + ([c.header.until] if c.header and c.header.until else [])

    out: set = set()
    for el in spec.elements.values():
        if el.follow == name:
            out.update(term_name(m) for m in ends(el))
    if name in spec.top or name in spec.preamble:
        out.add(None)
        out.update(term_name(m) for m in spec.between_markers)
        out.update(term_name(p) for p in spec.preamble if p in spec.markers)
        for t in list(spec.top) + [p for p in spec.preamble if p in spec.elements]:
            out.update(term_name(m) for m in ends(spec.elements[t]))
    return out


# ----------------------------------------------------------------------------- text mode

def lex_text(text: str, cfg: LexConfig) -> list[Tok]:
    """Tokens of a rendered conversation (char offsets)."""
    toks: list[Tok] = []
    append = toks.append
    pos = 0
    prev = None
    by_text = cfg.by_text
    split_after, decode_after = cfg.split_after, cfg.decode_after
    split_max = cfg.split_max
    # runs the lexer reads (headers) go through _text_gap; every other run is a plain TEXT
    # token, appended here (most runs: this loop is the text-mode hot path)
    reads = split_after.keys() | decode_after.keys()
    for m in cfg.regex.finditer(text):
        s, e = m.span()
        if s > pos:
            if prev in reads:
                _text_gap(text, pos, s, prev, toks, split_after, decode_after, split_max)
            else:
                append((TEXT, pos, s, None))
        mt = m.group()
        prev = by_text[mt]
        append((prev, s, e, mt))
        pos = e
    if pos < len(text):
        _text_gap(text, pos, len(text), prev, toks, split_after, decode_after, split_max)
    if cfg.lstrip:
        absorb_lstrip(toks, cfg.lstrip, lambda s, e: text[s:e].isspace())
    return toks


def partial_marker_tail(text: str, cfg: LexConfig) -> int | None:
    """Where ``text`` ends inside a marker string (``"…<|im_e"``): the start of that fragment,
    or None. The fragment must lie after the last whole marker: ``"]~!b["`` ends with ``"["``,
    a prefix of ``"[e~["``, but that ``"["`` belongs to the complete marker before it."""
    longest = cfg.longest_marker
    if cfg.regex is None:
        return None
    done = 0
    for m in cfg.regex.finditer(text, max(0, len(text) - 2 * longest)):
        done = m.end()
    for k in range(min(len(text) - done, longest - 1), 0, -1):
        if text[-k:] in cfg.marker_prefixes:
            return len(text) - k
    return None


def absorb_lstrip(toks: list[Tok], lstrip: frozenset, is_space) -> None:
    """Merge a whitespace-only text run into the ``lstrip`` marker right after it (in place).

    ``is_space(s, e)`` says whether the run ``[s, e)`` is whitespace; only plain content runs
    are candidates (a header's text is never absorbed). Python loops over markers only.
    """
    out = 0
    for tok in list(toks):
        if (tok[0] in lstrip and out and toks[out - 1][0] == TEXT
                and toks[out - 1][2] == tok[1] and is_space(toks[out - 1][1], tok[1])):
            prev = toks[out - 1]
            toks[out - 1] = (tok[0], prev[1], tok[2], tok[3])
            continue
        toks[out] = tok
        out += 1
    del toks[out:]


def _text_gap(text, s, e, prev, toks, split_after, decode_after, split_max) -> None:
    # Headers are read within max_tokens * HEADER_CHARS_PER_TOKEN chars (id mode: max_tokens
    # tokens), so a spec's header pattern only ever runs on a bounded string; an over-long
    # header is cut at the budget and marked with "…", which fails its checks.
    if prev in split_after:
        d = split_after[prev]
        cap = split_max.get(prev, 64) * HEADER_CHARS_PER_TOKEN
        k = text.find(d, s, min(e, s + cap + len(d)))
        if k >= 0:
            h_end = k + len(d)
            toks.append((HEADER, s, h_end, text[s:h_end]))
        else:  # the header does not end within its budget: the whole run is header
            h_end = e
            toks.append((HEADER, s, e, text[s:e] if e - s <= cap else text[s:s + cap] + "…"))
        if h_end < e:
            toks.append((TEXT, h_end, e, None))
    elif prev in decode_after:
        cap = decode_after[prev] * HEADER_CHARS_PER_TOKEN
        toks.append((TEXT, s, e, text[s:e] if e - s <= cap else text[s:s + cap] + "…"))
    else:
        toks.append((TEXT, s, e, None))


# ----------------------------------------------------------------------------- id mode

# What the lexer does with the run of ordinary ids after a marker (the marker's *gap class*)
BODY, DECODE, SPLIT = 0, 1, 2
# An lstrip marker absorbs a whitespace run of at most this many ids before it.
LSTRIP_MAX = 16
_MEMO_MAX = 100_000


class IdPlan:
    """THE id-lexing plan of one (format, tokenizer) pair: every id-mode lexing rule lives
    here, and the three executors read it — :class:`IdLexer` (the reference: a token list,
    every case), the fast path's numpy pass (``FastMasker._symbols``) and the C executor
    (``_speedups.run`` / ``symbols``), which take its tables and memos and hand back the
    cases they do not execute (soft markers, straddles) to the reference.

    Attributes:
        terms: marker terminal per code ``1..len(terms)`` (code 0: the begin of input).
        marker_ids: terminal -> its single id.
        lut: code table indexed by ``id + 1`` (slot 0 catches negative ids, the last slot
            catches ids beyond every marker) → code (0 = ordinary id).
        missing: markers the tokenizer has no single id for (special ones make id mode
            unable to see them: reported by :func:`chatgrammar.Format.check_tokenizer`).
        soft_regex: soft markers without a single id, searched in decoded text runs.
        gclass: per code, the gap class of the run after it (``BODY``, ``DECODE``: a
            header read within ``budget`` ids, ``SPLIT``: a header that ends at the literal
            ``delim[code]``, searched within ``budget`` ids).
        budget: per code, the header budget in ids (0 for ``BODY``).
        lstrip_code: per code, True when the marker absorbs a whitespace run before it
            (None: no such marker).
    """

    def __init__(self, cfg: LexConfig, adapter: TokenizerAdapter):
        self.cfg = cfg
        self.adapter = adapter
        self._markers(cfg, adapter)
        k = len(self.terms)
        gclass, budget = [BODY] * (k + 1), [0] * (k + 1)
        for i, term in enumerate([None, *self.terms]):
            gclass[i], budget[i] = self.rule(term)
        self.gclass = np.asarray(gclass, dtype=np.int64)
        self.budget = np.asarray(budget, dtype=np.int64)
        self.by_code = list(zip(gclass, budget))  # the same, as Python ints (per marker)
        self.delim = {i: cfg.split_after[t] for i, t in enumerate(self.terms, start=1)
                      if t in cfg.split_after}
        lcodes = [False] + [t in cfg.lstrip for t in self.terms]
        self.lstrip_code = np.asarray(lcodes, dtype=bool) if any(lcodes) else None
        # the memos of the two rules that decode, read by the C executor too:
        # (code, prefix ids bytes) -> split_prefix's answer, and the same keyed as the C
        # executor looks it up (bytes(code) + prefix ids); run ids bytes -> blank or not
        self.split_memo: dict = {}
        self.split_c: dict = {}
        self.space_memo: dict = {}
        self._soft_lut: Any = False  # computed on first use (a pass over the vocabulary)

    def _markers(self, cfg: LexConfig, adapter: TokenizerAdapter) -> None:
        """The marker table: each marker's single id (or why it has none)."""
        self.terms: list[str] = []
        self.marker_ids: dict[str, int] = {}
        self.missing: list[str] = []
        soft_unmapped: list[str] = []
        for term, text in cfg.marker_text.items():
            tid = adapter.token_id(text, special=cfg.special[term])
            if tid is None:
                self.missing.append(term)
                if not cfg.special[term]:
                    soft_unmapped.append(text)
                continue
            self.marker_ids[term] = tid
        id_to_term: dict[int, str] = {}
        for term, tid in self.marker_ids.items():
            id_to_term.setdefault(tid, term)
        top = max(id_to_term) if id_to_term else 0
        self.lut = np.zeros(top + 3, dtype=np.int32)
        for tid, term in id_to_term.items():
            self.terms.append(term)
            self.lut[tid + 1] = len(self.terms)
        self.marker_range = self.restrict(self.lut)
        self.soft_regex = (re.compile("|".join(re.escape(t) for t in
                                               sorted(soft_unmapped, key=len, reverse=True)))
                           if soft_unmapped else None)

    def rule(self, term: str | None) -> tuple[int, int]:
        """``(gap class, budget)`` of the run after marker ``term`` (None: the input's start).
        A marker that opens a literal-ended header splits; one whose header (or close
        header) ends at a marker, and every place an opener-less element may start, reads
        its run as header text; anything else is content."""
        cfg = self.cfg
        if term in cfg.split_after:
            return SPLIT, cfg.split_max.get(term, 64)
        if term in cfg.decode_after:
            return DECODE, cfg.decode_after[term]
        return BODY, 0

    def codes(self, arr: np.ndarray) -> np.ndarray:
        """The code of every id (0: ordinary), one vectorised lookup."""
        idx = arr + 1
        np.clip(idx, 0, len(self.lut) - 1, out=idx)
        return self.lut[idx]

    @staticmethod
    def restrict(lut: np.ndarray) -> tuple[int, int, np.ndarray]:
        """``(lo, hi, lutr)``: a code table indexed by ``id + 1`` restricted to the ids that
        have a code, ``[lo, hi]`` (``lutr[id - lo]``, and a last 0 slot for ids above
        ``hi``): the form :meth:`find` and the C marker passes take."""
        ids = np.flatnonzero(lut)
        if not len(ids):
            return 0, -1, np.zeros(1, dtype=np.int64)
        lo, hi = int(ids.min()) - 1, int(ids.max()) - 1
        return lo, hi, np.concatenate([lut[lo + 1:hi + 2], [0]]).astype(np.int64)

    @staticmethod
    def find(arr: np.ndarray, lo: int, hi: int, lutr: np.ndarray, accel: Any = None):
        """THE marker search: ``(positions, codes)`` of the ids of ``arr`` that have a code in
        ``lutr`` (see :meth:`restrict`), in numpy, or in one C pass when ``accel`` (the
        ``_speedups`` module) is given. Negative ids are never markers."""
        if hi < 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        if accel is not None and arr.flags.c_contiguous:
            pos_b, code_b = accel.find_markers(arr, lo, lutr)
            return np.frombuffer(pos_b, dtype=np.int64), np.frombuffer(code_b, dtype=np.int64)
        cand = np.flatnonzero(arr >= lo)
        if not len(cand):
            return cand, cand
        codes = lutr.take(arr[cand] - lo, mode="clip")
        nz = np.flatnonzero(codes)
        if len(nz) != len(cand):
            cand, codes = cand[nz], codes[nz]
        return cand, codes

    def header_value(self, arr, s: int, e: int, budget: int) -> str:
        """The text of a header run ``[s, e)`` read within ``budget`` ids: an over-long one
        is cut there and marked ``…`` (its checks then reject it)."""
        dec = self.adapter.decode
        return dec(arr[s:e].tolist()) if e - s <= budget else \
            dec(arr[s:s + budget].tolist()) + "…"

    def split_prefix(self, arr, s: int, e: int, code: int) -> tuple[int, int]:
        """Where the literal-ended header after marker ``code`` ends in ``[s, e)``: the first
        ``k`` (within the budget) whose prefix ``arr[s:k]`` decodes to text holding the
        literal, as ``(k, 1)`` when the text ends with it, ``(k, -1)`` when the literal ends
        inside the last id (a straddle); ``(limit, 0)`` when no prefix holds it. Memoised
        on the prefix ids."""
        limit = min(e, s + self.by_code[code][1])
        memo = self.split_memo
        for k in range(s + 1, limit + 1):
            key = (code, arr[s:k].tobytes())
            r = memo.get(key)
            if r is None:
                txt = self.adapter.decode(arr[s:k].tolist())
                d = self.delim[code]
                j = txt.find(d)
                r = 0 if j < 0 else (-1 if j + len(d) < len(txt) else 1)
                if len(memo) > _MEMO_MAX:
                    memo.clear()
                    self.split_c.clear()
                memo[key] = r
                self.split_c[struct.pack("=q", code) + key[1]] = r
            if r:
                return k, r
        return limit, 0

    def blank(self, arr, s: int, e: int) -> bool:
        """The ``lstrip`` rule: is ``[s, e)`` a whitespace run a marker absorbs? At most
        LSTRIP_MAX ids that decode to whitespace or to nothing (SentencePiece decodes a lone
        "▁" to ""). Memoised on the run's ids."""
        if e - s > LSTRIP_MAX:
            return False
        key = arr[s:e].tobytes()
        sp = self.space_memo.get(key)
        if sp is None:
            sp = not self.adapter.decode(arr[s:e].tolist()).strip()
            if len(self.space_memo) > _MEMO_MAX:
                self.space_memo.clear()
            self.space_memo[key] = sp
        return sp

    @property
    def soft_lut(self) -> np.ndarray | None:
        """Boolean table over ids: True where the token may spell part of a soft marker the
        tokenizer has no single id for (None: none, or cannot tell for this tokenizer)."""
        if self._soft_lut is False:
            self._soft_lut = None if self.soft_regex is None else _soft_lut(self)
        return self._soft_lut


@dataclass
class IdLexer:
    """Id-mode lexer bound to one (format, tokenizer) pair: the reference executor of its
    :class:`IdPlan` (every case, token list out).

    Attributes:
        plan: the lexing plan (marker table, gap classes, budgets, the decoding rules).
        terms, marker_ids, lut, missing, soft_regex: the plan's (see :class:`IdPlan`).
    """

    cfg: LexConfig
    adapter: TokenizerAdapter
    plan: IdPlan

    @classmethod
    def build(cls, cfg: LexConfig, adapter: TokenizerAdapter) -> "IdLexer":
        return cls(cfg, adapter, IdPlan(cfg, adapter))

    terms = property(lambda self: self.plan.terms)
    marker_ids = property(lambda self: self.plan.marker_ids)
    lut = property(lambda self: self.plan.lut)
    missing = property(lambda self: self.plan.missing)
    soft_regex = property(lambda self: self.plan.soft_regex)

    def codes(self, arr: np.ndarray) -> np.ndarray:
        return self.plan.codes(arr)

    def lex(self, arr: np.ndarray, boundary: list) -> list[Tok]:
        """Tokens of an id sequence (token indices). ``boundary`` collects
        (token index, note) for span boundaries that fall inside a merged token."""
        plan = self.plan
        n = len(arr)
        pos, kinds = plan.find(arr, *plan.marker_range)  # (numpy: the reference's own)
        terms = plan.terms
        toks: list[Tok] = []
        append = toks.append
        text_of = self.cfg.marker_text
        soft = plan.soft_regex
        prev = 0  # the code of the marker before the run (0: the input's start)
        last = 0
        for p, k in zip(pos.tolist(), kinds.tolist()):
            if p > last:
                self._gap(arr, last, p, prev, toks, boundary, soft)
            term = terms[k - 1]
            append((term, p, p + 1, text_of[term]))
            prev, last = k, p + 1
        if last < n:
            self._gap(arr, last, n, prev, toks, boundary, soft)
        if self.cfg.lstrip:
            absorb_lstrip(toks, self.cfg.lstrip, lambda s, e: plan.blank(arr, s, e))
        return toks

    def _gap(self, arr, s, e, code, toks, boundary, soft) -> None:
        cls, budget = self.plan.by_code[code]
        if cls == SPLIT:
            self._split_gap(arr, s, e, code, toks, boundary, soft)
        elif cls == DECODE:
            self._decode_gap(arr, s, e, budget, toks, boundary, soft)
        else:
            self._body(arr, s, e, toks, boundary, soft)

    def _split_gap(self, arr, s, e, code, toks, boundary, soft) -> None:
        """A literal-ended header (:meth:`IdPlan.split_prefix`), then the body after it."""
        plan = self.plan
        k, r = plan.split_prefix(arr, s, e, code)
        dec = self.adapter.decode
        if r == 1:
            h_end = k
            toks.append((HEADER, s, k, dec(arr[s:k].tolist())))
        elif r == -1:
            # The header's last token also carries body text: it is assigned to the body
            # (so no trained character is left out) and the boundary is reported.
            d = plan.delim[code]
            txt = dec(arr[s:k].tolist())
            boundary.append((k - 1, f"header end {d!r} falls inside a merged token"))
            h_end = k - 1
            toks.append((HEADER, s, h_end, txt[:txt.find(d) + len(d)]))
        else:  # the header does not end within its budget (k: the budget's end): all header
            h_end = e
            toks.append((HEADER, s, e, dec(arr[s:k].tolist()) + "…" if k < e
                         else dec(arr[s:e].tolist())))
        if h_end < e:
            self._body(arr, h_end, e, toks, boundary, soft)

    def _decode_gap(self, arr, s, e, budget, toks, boundary, soft) -> None:
        """A header run read within ``budget`` ids (:meth:`IdPlan.header_value`)."""
        cut = self._soft_cut(arr, s, e, soft)
        if cut is not None:
            # A header that ends at a soft marker (an element without opener whose header
            # runs to `USER:`): the header is the run up to it, the rest is a body, as text
            # mode reads it. A token that straddles the marker's start (` USER`) stays with
            # the header text, as `_body` keeps it with the text before a marker.
            rest: list = []
            self._body(arr, cut, e, rest, boundary, soft)
            h_end = cut
            if rest and rest[0][0] == TEXT and rest[0][1] == cut:
                h_end, rest = rest[0][2], rest[1:]
            if h_end > s:
                self._decode_gap(arr, s, h_end, budget, toks, boundary, None)
            toks.extend(rest)
            return
        toks.append((TEXT, s, e, self.plan.header_value(arr, s, e, budget)))

    def _soft_cut(self, arr, s, e, soft) -> int | None:
        """The token where the first soft marker of a header run starts (the one holding its
        first character); None when there is none (or no soft marker at all)."""
        if soft is None:
            return None
        text, starts = self.adapter.decode_offsets(arr[s:e].tolist())
        m = soft.search(text)
        if m is None:
            return None
        return s + int(np.searchsorted(np.asarray(starts), m.start(), side="right")) - 1

    def _body(self, arr, s, e, toks, boundary, soft) -> None:
        if soft is None:
            toks.append((TEXT, s, e, None))
            return
        # Soft markers the tokenizer has no single id for: find them in the decoded run.
        text, starts = self.adapter.decode_offsets(arr[s:e].tolist())
        found = list(soft.finditer(text))
        if not found:
            toks.append((TEXT, s, e, None))
            return
        starts_a = np.asarray(starts + [len(text)])
        last = s
        for k, m in enumerate(found):
            cs, ce = m.span()
            # the next soft marker starts right where this one ends (`<|model|><|user|>`): a
            # token straddling the two holds no text, so it stays a marker's, never text
            touching = k + 1 < len(found) and found[k + 1].start() == ce
            t0 = int(np.searchsorted(starts_a, cs, side="right")) - 1
            t1 = int(np.searchsorted(starts_a, ce, side="left"))
            a, b = t0, max(t1, t0 + 1)
            # A token that straddles the marker's edge also carries the neighbouring text: it
            # stays with that text (the marker keeps at least one token), so no character of
            # the text is left out when the marker's block does not train (``</think>`` +
            # ``"\n\n"`` merged into ``">\n\n"``); the boundary is reported on that token.
            if starts_a[t0] != cs:
                boundary.append((s + t0, f"soft marker {m.group()!r} starts inside a token"))
                if b - a > 1:
                    a += 1
            if starts_a[t1] != ce:
                boundary.append((s + b - 1, f"soft marker {m.group()!r} ends inside a token"))
                if b - a > 1 and not touching:
                    b -= 1
            a, b = s + a, s + b
            if a < last:
                # it starts inside the token that ended the previous marker: it still is a
                # marker (zero-width when that token holds all of it), never silently text
                a = last
                b = max(b, a)
            if a > last:
                toks.append((TEXT, last, a, self._header_value(arr, toks, last, a)))
            toks.append((self.cfg.by_text[m.group()], a, b, m.group()))
            last = b
        if last < e:
            toks.append((TEXT, last, e, self._header_value(arr, toks, last, e)))

    def _header_value(self, arr, toks, s, e):
        """The value of the text run ``[s, e)`` that follows ``toks[-1]``: its decoded text
        when that is a soft marker found in decoded text whose header ends at a marker
        (ChatGLM2's `[Round ` before `]\n\n问：`), read within the header budget as after a
        marker id; None (never read) otherwise."""
        if not toks or toks[-1][0] not in self.cfg.decode_after or toks[-1][1] == toks[-1][2]:
            return None
        return self.plan.header_value(arr, s, e, self.cfg.decode_after[toks[-1][0]])


def _soft_lut(lx: IdPlan):
    """Boolean table over ids: True where the token may spell part of a soft marker the
    tokenizer has no single id for (None: cannot tell for this tokenizer).

    A soft marker found in a decoded run needs every one of its characters there; for each
    marker the printable ASCII character that the fewest tokens contain is chosen, and a run
    whose tokens contain none of the chosen characters cannot hold any soft marker (printable
    ASCII decodes from exactly the tokens whose bytes / byte-level pieces contain it). The
    format's own marker ids are never part of a run."""
    texts = [lx.cfg.marker_text[t] for t in lx.missing if not lx.cfg.special.get(t, True)]
    if not texts:
        return None
    a = lx.adapter
    enc = a._encoding
    if enc is not None and enc is a.tokenizer:
        ranks = getattr(enc, "_mergeable_ranks", None)
        if not isinstance(ranks, dict):
            return None
        size = max(enc.n_vocab, max(ranks.values(), default=0) + 1)
        pieces = [b""] * size
        for tb, r in ranks.items():
            pieces[r] = tb
        for sp, r in getattr(enc, "_special_tokens", {}).items():
            if r < size:
                pieces[r] = sp.encode("utf-8", "surrogatepass")
    else:
        tok = a.tokenizer
        conv = getattr(tok, "convert_ids_to_tokens", None)
        if conv is None or not hasattr(tok, "__len__"):
            return None
        try:
            size = len(tok)
            pieces = [p.encode("utf-8", "surrogatepass") if isinstance(p, str) else b"\x00"
                      for p in conv(list(range(size)))]
        except Exception:
            return None
        # byte-level BPE keeps printable ASCII as itself; SentencePiece pieces too (byte
        # fallback pieces spell "<0x3C>", which contains "<" anyway): a superset is safe
    # Which tokens contain a character, for every vocabulary-sized question at once: the
    # pieces' bytes joined by NULs and, for each byte, the token it belongs to. A printable
    # ASCII character is in a piece iff its byte is (UTF-8 never uses ASCII bytes inside a
    # multi-byte character; a byte-level piece is its bytes).
    blob = np.frombuffer(b"\x00".join(pieces), dtype=np.uint8)
    owner = np.repeat(np.arange(size, dtype=np.int32),
                      np.fromiter(map(len, pieces), dtype=np.int64, count=size) + 1)[:len(blob)]
    has: dict[str, np.ndarray] = {}
    lut = np.zeros(size, dtype=bool)
    for text in texts:
        chars = [c for c in dict.fromkeys(text) if c.isascii() and c.isprintable()
                 and not c.isspace()]
        if not chars:
            return None
        for c in chars:
            if c not in has:
                has[c] = np.zeros(size, dtype=bool)
                has[c][owner[blob == ord(c)]] = True
        lut |= has[min(chars, key=lambda c: int(has[c].sum()))]
    for tid in lx.marker_ids.values():
        if 0 <= tid < size:
            lut[tid] = False
    return lut


def as_id_array(ids: Any) -> np.ndarray:
    """ids (list, tuple, numpy, torch) → 1-D int64 numpy array (no copy when possible)."""
    if type(ids).__module__.startswith("torch"):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1:
        arr = arr.reshape(-1) if arr.size == 0 else arr
        if arr.ndim != 1:
            raise ValueError(f"expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype == object and arr.size and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in arr.tolist()):
        # Python ints beyond int64 are no token id of any tokenizer: clip them (they lex as
        # ordinary ids and decode as U+FFFD) rather than refuse a sequence of integers
        lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
        arr = np.array([min(max(int(x), lo), hi) for x in arr.tolist()], dtype=np.int64)
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return arr.astype(np.int64)
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    return arr
