"""Stage 3 — lexers: text or token ids → a short list of parser tokens.

A parser token is a tuple ``(type, start, end, value)``: ``type`` is a terminal name
(``M_<MARKER>``, ``TEXT`` or ``HEADER``), ``start``/``end`` are char offsets (text mode) or
token indices (id mode), ``value`` is the text where the grammar must read it (markers,
headers) and ``None`` for content runs, which are never copied or decoded.

Text mode finds every marker in one regex pass; id mode finds every marker id in one
vectorised numpy pass. Python then loops over *markers*, never over characters or tokens.
"""
from __future__ import annotations

import bisect
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.compile import HEADER, HEADER_CHARS_PER_TOKEN, TEXT, term_name
from ..core.spec import FormatSpec
from ..core.memo import LRU
from .tokenizers import TokenizerAdapter, vocab_key

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
    # openers whose header's text nothing reads (value_free_openers): a memo key holds its
    # length class, not its ids
    value_free: frozenset = frozenset()

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
        cfg.value_free = value_free_openers(spec)
        return cfg


def value_free_openers(spec: FormatSpec) -> frozenset:
    """The opener terminals whose header's text (the run after them, read as a header) can
    change neither a mask nor whether the input parses: every element they open has a header
    that ends at a marker and sets nothing that reads its text (no ``pattern``, ``attributes``,
    ``trained_after``, header ``markers``, ``until_text`` or any key not known here: every
    other header key at its default), and no ``tag``, ``kind_by_tag``, ``kind_by_attr`` or
    ``lead``; the marker has no other use in the spec (no close, ``after``, inner, header,
    preamble or between-turn marker); and no element without an opener reads a header (its
    run may be read as between-turn text). Such a header's text only becomes the span's
    ``header`` (the role comes from the opener or the element, no policy reads it), so the
    item memo keys it by its length class alone (``IdPlan.value_free``). Conservative: any
    other use, or a spec key this rule does not know, makes the value matter.

    Args:
        spec: the compiled format spec.

    Returns:
        The terminal names (``term_name``) of those openers.

    Example:
        >>> sorted(value_free_openers(load_format("kimi-k2").spec))  # doctest: +SKIP
        ['IM_ASSISTANT', 'IM_SYSTEM', 'IM_USER', 'MEDIA_START', 'TC_BEGIN']
    """
    from ..core.spec import Header
    if any(not el.open and el.header is not None for el in spec.elements.values()):
        return frozenset()
    hdef = {k: f.get_default(call_default_factory=True) for k, f in Header.model_fields.items()}
    free: dict[str, bool] = {}
    other: set = set(spec.between_markers) | {p for p in spec.preamble if p in spec.markers}
    for el in spec.elements.values():
        other.update(el.inner_markers)
        for h in (el.header, el.close.header if el.close else None):
            if h is not None:
                other.update(h.markers)
                other.update([h.until] if h.until else [])
        if el.close is not None:
            other.update(el.close.markers + el.close.after + el.close.follow_after)
        h = el.header
        plain = (h is not None and h.until is not None and not el.lead and el.tag is None
                 and not el.kind_by_tag and not el.kind_by_attr
                 and all(getattr(h, k) == v for k, v in hdef.items()
                         if k not in ("until", "required", "max_tokens")))
        for m in el.open:
            free[m] = free.get(m, True) and plain
    return frozenset(term_name(m) for m, ok in free.items() if ok and m not in other)


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
# Stream.sst of a run that is no literal-ended header (or whose split an executor did not
# apply: it hands the sample back); else IdPlan.split_prefix's answer (1, -1, 0)
NO_SPLIT = 2
# An lstrip marker absorbs a whitespace run of at most this many ids before it: as many as
# `between` text reads (core.compile_regex.BETWEEN_MAX_TOKENS), so untrimmed Jinja indentation
# before a marker is read alike in both places (text mode has no limit).
LSTRIP_MAX = 64
_MEMO_MAX = 100_000
_TEXT_MEMO_MAX = 20_000
# why an executor hands a sample back to the reference (FastMasker.reasons, fmt.stats())
HANDBACK_SPLIT = "header literal not found within its budget, or straddling"


class Stream:
    """The symbol stream of one or more samples, as marker arrays (what :meth:`IdPlan.stream`
    builds; the reference's token list, :meth:`IdPlan.tokens`, and the fast path's symbol
    tables are read from it).

    Entry ``t`` is a marker of code ``K[t]`` over ids ``[P[t], mend[t])`` (code 0: a sample's
    begin, zero width; a soft marker found in decoded text may span several ids, or none),
    then the run of ordinary ids after it, ``[mend[t], P[t + 1])`` (``P[T]`` is the input's
    length).

    Attributes:
        P, K, mend: as above (int64; ``P`` has ``T + 1`` values).
        hend: the end of the run's literal-ended header (``HEADER [mend, hend)``, then
            ``TEXT [hend, P[t + 1])``); the run's end where it has none.
        sst: ``NO_SPLIT``, or :meth:`IdPlan.split_prefix`'s answer for the run's header
            (1: ends with an id, -1: a straddle, the header's last id is the body's; 0: no
            literal within the budget, the whole run is header).
        cls: the gap class of the run (``BODY``, ``DECODE``: its text is read as a header,
            ``SPLIT``).
        bidx: the index of each sample's begin entry (None: one sample).
    """

    __slots__ = ("P", "K", "mend", "hend", "sst", "cls", "bidx")

    def __init__(self, P, K, mend, hend, sst, cls, bidx):
        self.P, self.K, self.mend, self.hend = P, K, mend, hend
        self.sst, self.cls, self.bidx = sst, cls, bidx

    def sample_of(self, i: int) -> int:
        """The sample entry ``i`` belongs to."""
        return 0 if self.bidx is None else int(np.searchsorted(self.bidx, i, side="right")) - 1


class IdPlan:
    """THE id-lexing plan of one (format, tokenizer) pair: every id-mode lexing rule lives
    here, and so does the one builder of the symbol stream, :meth:`stream`, which applies
    them to marker arrays. The reference lexer (:class:`IdLexer`: :meth:`stream`, then
    :meth:`tokens`) and the fast path's numpy pass (``FastMasker._symbols``: :meth:`stream`,
    then the memo's key tables) are this builder; the C executor (``_speedups.run`` /
    ``symbols``) executes the same plan from its tables and memos, handing back what it does
    not execute (soft markers, straddles), and ``FastMasker.verify_lex`` proves it equal.

    Attributes:
        terms: marker terminal per code ``1..len(terms)`` (code 0: the begin of input).
        soft_terms: soft markers without a single id, codes ``len(terms) + 1 ...`` (found
            in decoded runs by :meth:`soft_search`; only the reference's stream holds them).
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
        # the run after a soft marker found in decoded text is read as a header where its
        # marker's header ends at a marker (never split: the literal rule is an opener id's)
        rules = [self.rule(t) for t in [None, *self.terms]] + [
            (DECODE, cfg.decode_after[t]) if t in cfg.decode_after else (BODY, 0)
            for t in self.soft_terms]
        self.gclass = np.asarray([r[0] for r in rules], dtype=np.int64)
        self.budget = np.asarray([r[1] for r in rules], dtype=np.int64)
        self.by_code = rules  # the same, as Python ints (per marker)
        # per code: a header whose text nothing reads (LexConfig.value_free): the memo's key
        # holds its length class (empty, within the budget, longer), not its ids
        self.value_free = np.asarray(
            [False] + [r[0] == DECODE and t in cfg.value_free
                       for r, t in zip(rules[1:], self.terms)] + [False] * len(self.soft_terms),
            dtype=bool)
        self.has_split = bool((self.gclass == SPLIT).any())
        self.delim = {i: cfg.split_after[t] for i, t in enumerate(self.terms, start=1)
                      if t in cfg.split_after}
        every = [*self.terms, *self.soft_terms]
        lcodes = [False] + [t in cfg.lstrip for t in every]
        self.lstrip_code = np.asarray(lcodes, dtype=bool) if any(lcodes) else None
        # each code's terminal and text (the reference's marker tokens)
        self._term_list = [None, *every]
        self._text_list = [None, *(cfg.marker_text[t] for t in every)]
        self.split_code = self.gclass == SPLIT
        self.soft_code = {cfg.marker_text[t]: k + 1 + i for i, t in enumerate(self.soft_terms)}
        # the memos of the two rules that decode, read by the C executor too:
        # (code, prefix ids bytes) -> split_prefix's answer, and the same keyed as the C
        # executor looks it up (bytes(code) + prefix ids); run ids bytes -> blank or not
        self.split_memo: dict = {}
        self.split_c: dict = {}
        self.space_memo: dict = {}
        self.text_memo: dict = {}  # run ids bytes -> decoded text (IdPlan.text)
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
        self.soft_terms = [cfg.by_text[t] for t in soft_unmapped]
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
        cand = (arr >= lo).nonzero()[0]
        if not len(cand):
            return cand, cand
        codes = lutr.take(arr[cand] - lo, mode="clip")
        nz = codes.nonzero()[0]
        if len(nz) != len(cand):
            cand, codes = cand[nz], codes[nz]
        return cand, codes

    # ------------------------------------------------------------- the symbol stream
    def stream(self, arr, starts: list[int], cand, codes, *, handback: list | None = None,
               boundary: list | None = None) -> Stream:
        """THE builder of the symbol stream of the samples ``arr[starts[j]:starts[j + 1]]``
        from their markers (``cand``, ``codes``: :meth:`find`'s answer), applying every rule
        of the plan in the reference's order: literal-ended headers (:meth:`split_prefix`),
        soft markers in decoded runs (:meth:`soft_search`), ``lstrip`` (:meth:`blank`).

        Args:
            handback: None for the reference (every case executed). For an executor that
                hands samples back (the fast path): per sample, None or why it already goes
                to the reference; the decoding rules skip those, anything the executor does
                not take (a straddle, no literal within the budget) sets its reason there,
                and soft markers are not searched (the executor hands back every sample
                that may spell one).
            boundary: if given, collects ``(id index, note)`` for each span boundary that
                falls inside a merged token, in input order (the reference's
                ``Conversation.boundaries``).

        Returns:
            The :class:`Stream`.
        """
        # The plan's steps, in this order; the C executor (_speedups.c, find_symbols) runs
        # the same steps, one function each, over the same plan arrays and memos:
        st = _merge_begins(arr, starts, cand, codes)             # 1. begins
        st.cls = self.gclass[st.K]                               # 2. classes
        straddles: list = []
        if self.has_split:                                       # 3. split
            straddles = self._split_runs(arr, st, handback)
        else:
            st.hend = st.P[1:]  # (a view: the runs' ends, whatever lstrip moves)
        if self.soft_regex is not None and handback is None:     # (soft: the reference's)
            st = self._soft_runs(arr, st, boundary)
        elif boundary is not None:
            boundary.extend(self._straddle_note(st, i) for i in straddles)
        if self.lstrip_code is not None:                         # 4. lstrip
            self._lstrip(arr, st)
        return st  # (5. the key tables: FastMasker._tables, C step_tables)

    def _split_runs(self, arr, st: Stream, handback) -> list[int]:
        """Each literal-ended header run split where :meth:`split_prefix` says (an executor
        applies exact ends only); the entries whose header end straddles an id."""
        P, K, mend = st.P, st.K, st.mend
        st.hend = hend = P[1:].copy()
        st.sst = sst = np.full(len(K), NO_SPLIT, dtype=np.int64)
        idx = self.split_code[K].nonzero()[0].tolist()
        if not idx:
            return []
        starts, ends, codes = mend[idx].tolist(), P[1:][idx].tolist(), K[idx].tolist()
        done, rs, hs, straddles = [], [], [], []
        for i, s, e, code in zip(idx, starts, ends, codes):
            if s >= e:
                continue
            j = st.sample_of(i) if handback is not None else 0
            if handback is not None and handback[j]:
                continue
            k, r = self.split_prefix(arr, s, e, code)
            if handback is not None and r != 1:
                handback[j] = HANDBACK_SPLIT
                continue
            done.append(i)
            rs.append(r)
            hs.append(k if r == 1 else (k - 1 if r == -1 else e))
            if r == -1:
                straddles.append(i)
        if done:
            sst[done] = rs
            hend[done] = hs
        return straddles

    def _lstrip(self, arr, st: Stream) -> None:
        """The ``lstrip`` rule (:meth:`blank`) on the stream, after the split: a marker that
        absorbs whitespace starts at the start of a whitespace-only text run right before
        it (the text after a literal-ended header, or the whole run after any other marker);
        the run is gone. The same for the reference and an executor (a run whose split an
        executor did not apply is in a sample it hands back). Python loops over those
        markers only."""
        P, K, mend = st.P, st.K, st.mend
        has_split = self.has_split
        for i in self.lstrip_code[K].nonzero()[0].tolist():
            s0, e0 = int(mend[i - 1]), int(P[i])
            if has_split and st.cls[i - 1] == SPLIT:
                if st.sst[i - 1] == NO_SPLIT:
                    continue  # (an empty run; or its sample is handed back)
                s0 = int(st.hend[i - 1])
            if 0 < e0 - s0 <= LSTRIP_MAX and self.blank(arr, s0, e0):
                P[i] = s0
                if has_split:
                    st.hend[i - 1] = s0  # (a header's end is its run's end, or s0 already)

    def _straddle_note(self, st: Stream, i: int) -> tuple[int, str]:
        return (int(st.hend[i]),
                f"header end {self.delim[int(st.K[i])]!r} falls inside a merged token")

    def _soft_runs(self, arr, st: Stream, boundary: list | None) -> Stream:
        """Soft markers without a single id, found in the decoded runs (:meth:`soft_search`)
        and inserted into the stream as entries of their own. A header run read as text
        (``DECODE``) that holds one ends where the first one starts (:meth:`soft_cut`: an
        element without an opener whose header runs to `USER:`), as text mode reads it; the
        text after a literal-ended header is searched like any content run. Python loops over
        runs (one decode each), never over ids."""
        P, K, mend = st.P, st.K, st.mend
        sst = st.sst if self.has_split else None
        seg = mend if sst is None else np.where(sst != NO_SPLIT, st.hend, mend)
        todo = P[1:] > seg
        if sst is not None:
            todo |= sst == -1
        at: list[int] = []  # per soft marker found: the entry it follows
        rows: list[list[int]] = []  # its entry: P, K, mend, cls (, sst, hend)
        notes = [] if boundary is None else boundary
        by_code = self.by_code
        segl, ends, cls = seg.tolist(), P[1:].tolist(), st.cls.tolist()
        for t in todo.nonzero()[0].tolist():
            if sst is not None and sst[t] == -1:
                notes.append(self._straddle_note(st, t))
            s, e = segl[t], ends[t]
            if s >= e:
                continue
            if cls[t] == DECODE:
                cut = self.soft_cut(arr, s, e)
                if cut is None:
                    continue
                s = cut
            for a, b, code in self.soft_search(arr, s, e, notes):
                at.append(t)
                # the run after a zero-width soft marker is never read (no header text)
                rows.append([a, code, b, by_code[code][0] if b > a else BODY, NO_SPLIT, b])
        if not at:
            return st
        # the entries merged in order: old entry t, then the soft markers found after it
        # (one list step per soft marker, the old entries copied in slices)
        cols = [P[:-1], K, mend, st.cls] + ([] if sst is None else [sst, st.hend])
        old = list(zip(*(c.tolist() for c in cols)))
        rows_in: list = []
        prev = 0
        for t, r in zip(at, rows):
            rows_in += old[prev:t + 1]
            rows_in.append(r[:len(cols)])
            prev = t + 1
        rows_in += old[prev:]
        new = np.array(rows_in, dtype=np.int64)
        T, m = len(K), len(at)
        nP = np.empty(T + m + 1, dtype=np.int64)
        nP[:-1], nP[-1] = new[:, 0], P[-1]
        out = Stream(nP, new[:, 1].copy(), new[:, 2].copy(), None, None, new[:, 3].copy(),
                     None if st.bidx is None else
                     st.bidx + np.searchsorted(np.asarray(at), st.bidx, side="left"))
        if sst is None:
            out.hend = nP[1:]
        else:  # (a run that is no literal-ended header ends where the next entry starts)
            out.sst = new[:, 4].copy()
            out.hend = np.where(out.sst == NO_SPLIT, nP[1:], new[:, 5])
        return out

    # ------------------------------------------------------------- the rules that decode
    def header_value(self, arr, s: int, e: int, budget: int) -> str:
        """The text of a header run ``[s, e)`` read within ``budget`` ids: an over-long one
        is cut there and marked ``…`` (its checks then reject it)."""
        return self.text(arr, s, e) if e - s <= budget else \
            self.text(arr, s, s + budget) + "…"

    def text(self, arr, s: int, e: int) -> str:
        """``adapter.decode`` of ``arr[s:e]``, memoised on the ids for runs of at most 64
        (headers repeat: role names, tags; a decode costs more than the lookup)."""
        if e - s > 64:
            return self.adapter.decode(arr[s:e].tolist())
        key = arr[s:e].tobytes()
        txt = self.text_memo.get(key)
        if txt is None:
            txt = self.adapter.decode(arr[s:e].tolist())
            if len(self.text_memo) >= _TEXT_MEMO_MAX:
                self.text_memo.clear()
            self.text_memo[key] = txt
        return txt

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

    def split_text(self, arr, s: int, h: int, code: int, r: int) -> str:
        """The text of the literal-ended header ``[s, h)`` after marker ``code``, for
        :meth:`split_prefix`'s answer ``r``: up to and including the literal (a straddle:
        the literal's end inside id ``h``, which the body holds), or the whole run read
        within the budget (no literal there)."""
        if r == 1:
            return self.text(arr, s, h)
        if r == -1:
            txt, d = self.text(arr, s, h + 1), self.delim[code]
            return txt[:txt.find(d) + len(d)]
        return self.header_value(arr, s, h, self.by_code[code][1])

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

    def soft_cut(self, arr, s: int, e: int) -> int | None:
        """The id where the first soft marker of the decoded run ``[s, e)`` starts (the one
        holding its first character); None when there is none."""
        text, starts = self.adapter.decode_offsets(arr[s:e].tolist())
        m = self.soft_regex.search(text)
        if m is None:
            return None
        return s + bisect.bisect_right(starts, m.start()) - 1

    def soft_search(self, arr, s: int, e: int, notes: list) -> list[tuple[int, int, int]]:
        """The soft markers of the decoded run ``[s, e)`` as ``(start, end, code)`` id spans,
        in order; each boundary inside a merged token is appended to ``notes``.

        A token that straddles a marker's edge also carries the neighbouring text: it stays
        with that text (the marker keeps at least one token), so no character of the text is
        left out when the marker's block does not train (``</think>`` + ``"\\n\\n"`` merged
        into ``">\\n\\n"``). A marker that starts in the token that ended the previous one
        starts at that token's end (it may be zero-width): it still is a marker, never
        silently text."""
        text, starts = self.adapter.decode_offsets(arr[s:e].tolist())
        found = list(self.soft_regex.finditer(text))
        if not found:
            return []
        starts_a = starts + [len(text)]  # (ascending: bisect is numpy's searchsorted)
        out = []
        last = s
        for k, m in enumerate(found):
            cs, ce = m.span()
            # the next soft marker starts right where this one ends (`<|model|><|user|>`): a
            # token straddling the two holds no text, so it stays a marker's, never text
            touching = k + 1 < len(found) and found[k + 1].start() == ce
            t0 = bisect.bisect_right(starts_a, cs) - 1
            t1 = bisect.bisect_left(starts_a, ce)
            a, b = t0, max(t1, t0 + 1)
            if starts_a[t0] != cs:
                notes.append((s + t0, f"soft marker {m.group()!r} starts inside a token"))
                if b - a > 1:
                    a += 1
            if starts_a[t1] != ce:
                notes.append((s + b - 1, f"soft marker {m.group()!r} ends inside a token"))
                if b - a > 1 and not touching:
                    b -= 1
            a, b = s + a, s + b
            if a < last:
                a = last
                b = max(b, a)
            out.append((a, b, self.soft_code[m.group()]))
            last = b
        return out

    # ------------------------------------------------------------- the reference's tokens
    def tokens(self, arr, st: Stream) -> list[Tok]:
        """The reference's parser tokens, read from the stream: per entry its marker, then
        its run (``TEXT``; or ``HEADER`` and the ``TEXT`` after it), with the text of the
        runs the grammar reads (a header read within its budget, :meth:`header_value`; a
        literal-ended one, :meth:`split_text`) and None for content. One step per entry (a
        marker and the run after it: the list the driver reads), never per id."""
        K, P, mend, cls = st.K.tolist(), st.P.tolist(), st.mend.tolist(), st.cls.tolist()
        terms, texts, by_code = self._term_list, self._text_list, self.by_code
        split = self.has_split
        hend = st.hend.tolist() if split else None
        sst = st.sst.tolist() if split else None
        out: list[Tok] = []
        app = out.append
        for i, k in enumerate(K):
            if k:
                app((terms[k], P[i], mend[i], texts[k]))
            s, e = mend[i], P[i + 1]
            if split and sst[i] != NO_SPLIT:
                h = hend[i]
                app((HEADER, s, h, self.split_text(arr, s, h, k, sst[i])))
                if e > h:
                    app((TEXT, h, e, None))
            elif e > s:
                app((TEXT, s, e, self.header_value(arr, s, e, by_code[k][1])
                     if cls[i] == DECODE else None))
        return out

    @property
    def soft_lut(self) -> np.ndarray | None:
        """Boolean table over ids: True where the token may spell part of a soft marker the
        tokenizer has no single id for (None: none, or cannot tell for this tokenizer)."""
        if self._soft_lut is False:
            self._soft_lut = None if self.soft_regex is None else _soft_lut(self)
        return self._soft_lut


def _merge_begins(arr, starts: list[int], cand, codes) -> Stream:
    """The stream's entries before any rule: each sample's begin (code 0, zero width) merged
    before its markers (one id each)."""
    N = len(arr)
    S = len(starts) - 1
    M = len(cand)
    T = M + S
    P = np.empty(T + 1, dtype=np.int64)
    K = np.zeros(T, dtype=np.int64)
    if S == 1:
        bidx = None
        P[0] = 0
        P[1:T] = cand
        K[1:] = codes
        mend = P[:-1] + 1
        mend[0] = 0
    else:
        bof = np.asarray(starts[:-1], dtype=np.int64)
        bidx = np.searchsorted(cand, bof, side="left") + np.arange(S)
        real = np.ones(T, dtype=bool)
        real[bidx] = False
        P[:-1][real] = cand
        P[bidx] = bof
        K[real] = codes
        mend = P[:-1] + 1
        mend[bidx] = bof
    P[T] = N
    return Stream(P, K, mend, None, None, None, bidx)


@dataclass
class IdLexer:
    """Id-mode lexer bound to one (format, tokenizer) pair: the reference executor of its
    :class:`IdPlan` (every case, token list out): the plan's marker search, its stream
    builder and the tokens read from that stream.

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

    def stream(self, arr: np.ndarray, boundary: list) -> Stream:
        """The symbol stream of one id sequence, every rule applied (see :meth:`lex`)."""
        plan = self.plan
        pos, kinds = plan.find(arr, *plan.marker_range)
        return plan.stream(arr, [0, len(arr)], pos, kinds, boundary=boundary)

    def lex(self, arr: np.ndarray, boundary: list) -> list[Tok]:
        """Tokens of an id sequence (token indices). ``boundary`` collects
        (token index, note) for span boundaries that fall inside a merged token."""
        return self.plan.tokens(arr, self.stream(arr, boundary))


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
    contains = _char_tables(lx.adapter)
    if contains is None:
        return None
    size, has_char = contains
    has: dict[str, np.ndarray] = {}
    lut = np.zeros(size, dtype=bool)
    for text in texts:
        chars = [c for c in dict.fromkeys(text) if c.isascii() and c.isprintable()
                 and not c.isspace()]
        if not chars:
            return None
        for c in chars:
            if c not in has:
                has[c] = has_char(c)
        lut |= has[min(chars, key=lambda c: int(has[c].sum()))]
    for tid in lx.marker_ids.values():
        if 0 <= tid < size:
            lut[tid] = False
    return lut


def _pieces_tables(pieces: list[bytes]):
    """``c -> bool array``: which of ``pieces`` (by index) hold the ASCII character ``c``.

    For every vocabulary-sized question at once: the pieces' bytes joined by NULs and, for
    each byte, the piece it belongs to. A printable ASCII character is in a piece iff its
    byte is (UTF-8 never uses ASCII bytes inside a multi-byte character; a byte-level piece
    is its bytes)."""
    size = len(pieces)
    blob = np.frombuffer(b"\x00".join(pieces), dtype=np.uint8)
    owner = np.repeat(np.arange(size, dtype=np.int32),
                      np.fromiter(map(len, pieces), dtype=np.int64, count=size) + 1)[:len(blob)]

    def has_char(c: str) -> np.ndarray:
        out = np.zeros(size, dtype=bool)
        out[owner[blob == ord(c)]] = True
        return out

    return has_char


# A tiktoken vocabulary's answers of _pieces_tables for its ranks (piece -> rank 0..n-1 in
# order), by the vocabulary's content (tokenizers.vocab_key): the formats over the same ranks,
# and each new Encoding object over them, share one table per character instead of joining
# the 150k pieces again (~25 ms a tokenizer). (A few MB each: the joined pieces, their owners.)
_RANK_CHARS = LRU(2)


def _char_tables(a: TokenizerAdapter):
    """(vocabulary size, ``c -> bool array over ids``: the tokens whose pieces hold ``c``)
    for the adapter's tokenizer, or None where its pieces cannot be read."""
    enc = a._encoding
    if enc is not None and enc is a.tokenizer:
        ranks = getattr(enc, "_mergeable_ranks", None)
        if not isinstance(ranks, dict):
            return None
        size = max(enc.n_vocab, max(ranks.values(), default=0) + 1)
        specials = [(r, sp.encode("utf-8", "surrogatepass"))
                    for sp, r in getattr(enc, "_special_tokens", {}).items() if r < size]
        n = len(ranks)
        if n and np.array_equal(np.array(list(ranks.values())), np.arange(n)):
            # the ranks' tables, shared by content; the specials written over them
            key = vocab_key(enc)
            entry = _RANK_CHARS.get(key)
            if entry is None:
                entry = (_pieces_tables(list(ranks)), {})
                _RANK_CHARS.put(key, entry)
            ordinary, done = entry

            def has_char(c: str) -> np.ndarray:
                if c not in done:
                    done[c] = ordinary(c)
                out = np.zeros(size, dtype=bool)
                out[:n] = done[c]
                b = ord(c)
                for r, sp in specials:
                    out[r] = b in sp
                return out

            return size, has_char
        pieces = [b""] * size
        for tb, r in ranks.items():
            pieces[r] = tb
        for r, sp in specials:
            pieces[r] = sp
        return size, _pieces_tables(pieces)
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
    return size, _pieces_tables(pieces)


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
