"""Exact memo for :meth:`Format.parse` (text mode).

Same idea as :class:`chatgrammar.runtime.fastpath.FastMasker` for token ids: the text's
markers are walked through the memoised LALR automaton to find the top-level items; an item
seen before is rebuilt from a template — fresh Turn and Block objects carrying this text's
positions — so the Conversation is identical to a full parse.

Two executors of that memo:

- **vectorised** (:meth:`TextMemo._vec_lookup`), for every format whose unknown-marker shape
  cannot overlap a marker (:func:`_unknown_shape_is_safe`; :func:`_vec_refusal` lists the
  other reasons): one ``re.split`` by ``markers | unknown-marker shape`` and, after an opener
  whose header ends at a literal, that header (:func:`_header_group`); symbols / part
  boundaries / header runs / ``lstrip`` absorptions from C-level ``map``, ``accumulate``,
  ``compress`` and byte tables, the automaton walked ``_WALK`` symbols per lookup, one
  dictionary lookup per item. Its Conversation is *deferred* (:meth:`Conversation.deferred`): turns are built on
  first access; until then ``spans()`` and ``trained_turns()`` come from :class:`_Plan`, the
  templates' span plans (:meth:`_TurnTpl.span_plan`), computed once per policy by
  :func:`chatgrammar.runtime.spans.turn_spans` itself;
- **per token** (:meth:`TextMemo.lookup` otherwise): the lexer's tokens, walked one by one.

tests/test_textpath.py and tests/test_fastpath.py compare both with the full parse field by
field; ``CHATGRAMMAR_VERIFY=1`` checks every memo answer (spans first, then the built turns)
against the full parse.
"""
from __future__ import annotations

import dataclasses
import os
import re
from bisect import bisect_left
from itertools import accumulate, compress, repeat

from ..core.compile import HEADER, HEADER_CHARS_PER_TOKEN, TEXT
from . import fastpath as _fp  # (its memo bounds are read there, where tests may change them)
from .fastpath import (HEAD, HEAD_RUN, RUN, _Automaton, _FakeTurn, _Item, _NoCache,
                       _read_plan, _RecordingSource, _segments)
from .lexers import lex_text
from .parse import Source
from .policy import last_run
from .spans import Block, Conversation, Span, Turn, turn_spans

_MISSING = object()
# the vectorised walk's window (symbols per lookup) and the bound on its memo (entries)
_WALK = 16
_MAX_WIDE = 200_000
_MAX_POLICIES = 64
_PAD_BYTES = b"\xff" * _WALK
_new = object.__new__


# Block fields the text memo knows; every position field is relocated, the others copied.
# A Block with other fields (the core grew one) disables the memo: never a silent mistake.
_BLOCK_POS = ("start", "end", "header_start", "header_end", "body_start", "body_end",
              "close_start", "close_end", "train_start")
_BLOCK_OTHER = ("name", "open", "header", "attrs", "tag", "kind", "close", "children",
                "complete", "valid", "follow")
_TURN_FIELDS = ("role", "start", "end", "complete", "block", "generation_prompt", "valid")


def _fields_known() -> bool:
    from .spans import Block, Turn

    return ({f.name for f in dataclasses.fields(Block)} == set(_BLOCK_POS + _BLOCK_OTHER)
            and {f.name for f in dataclasses.fields(Turn)} == set(_TURN_FIELDS))


def _placer(slot_of: dict[int, int], runs: tuple):
    """position → ``(slot, offset)``: a token boundary, or a position inside a run whose
    text is part of the item's key (a header, text the parse read); else :class:`_NoCache`."""
    def place(pos: int) -> tuple[int, int]:
        k = slot_of.get(pos)
        if k is not None:
            return k, 0
        for p0, k, n in runs:
            if p0 < pos <= p0 + n:
                return k, pos - p0
        raise _NoCache
    return place


class _BlockTpl:
    """A harvested block with its positions as item-relative slots (token boundaries), plus
    an offset for positions inside keyed runs."""

    __slots__ = ("base", "pos", "children", "follow")

    def __init__(self, b, place):
        self.base = dict(b.__dict__)
        self.pos = []
        for f in _BLOCK_POS:
            v = self.base[f]
            if v is not None:
                k, d = place(v)
                self.pos.append((f, k, d))
        self.children = [_BlockTpl(c, place) for c in b.children]
        self.follow = _BlockTpl(b.follow, place) if b.follow is not None else None

    def make(self, bounds: list[int], a: int, block_cls):
        b = object.__new__(block_cls)
        d = dict(self.base)
        for f, k, off in self.pos:
            d[f] = bounds[a + k] + off
        d["attrs"] = dict(d["attrs"]) if d["attrs"] else {}
        d["children"] = [c.make(bounds, a, block_cls) for c in self.children] \
            if self.children else []
        if self.follow is not None:
            d["follow"] = self.follow.make(bounds, a, block_cls)
        b.__dict__ = d
        return b


class _TurnTpl:
    __slots__ = ("base", "start", "end", "block", "role", "meta", "hB", "place",
                 "by_policy")

    def __init__(self, t, place, hB: list | None = None):
        self.base = dict(t.__dict__)
        self.base["generation_prompt"] = False
        self.start, self.end = place(t.start), place(t.end)
        self.block = _BlockTpl(t.block, place)
        self.role = t.role
        # (the last: a reasoning turn, which last_turn_only keeps with the answer after it)
        self.meta = (t.role, t.valid, t.complete, t.block.kind == "think")
        # the harvested item's part boundaries and the placer: this turn's trained spans per
        # policy, in slots (from a fresh copy of the turn: the harvested one is the caller's)
        self.hB, self.place = hB, place
        self.by_policy: dict = {}

    def span_plan(self, policy, pk: int) -> tuple | None:
        """This turn's trained spans under ``policy`` (when it trains) as
        ``(start slot, offset, end slot, offset, kind)`` each, or None when a span boundary
        is not a position the template can place. Computed once per policy from the harvested
        turn by :func:`chatgrammar.runtime.spans.turn_spans` itself: positions of a keyed item
        compare the same way in every text with that key (the lengths that vary, content runs,
        are never empty there), so the spans of any such text are these, relocated."""
        got = self.by_policy.get(pk, _MISSING)  # (pk: the policy's number, TextMemo.policy_key)
        if got is _MISSING:
            out: list = []
            if self.hB is not None:
                turn_spans(self.make(self.hB, 0, Turn, Block), 0, policy, out)
                try:
                    got = tuple((*self.place(sp.start), *self.place(sp.end), sp.kind)
                                for sp in out)
                except _NoCache:
                    got = None
            else:
                got = None
            self.by_policy[pk] = got
        return got

    def make(self, bounds: list[int], a: int, turn_cls, block_cls):
        t = object.__new__(turn_cls)
        d = dict(self.base)
        d["start"] = bounds[a + self.start[0]] + self.start[1]
        d["end"] = bounds[a + self.end[0]] + self.end[1]
        d["block"] = self.block.make(bounds, a, block_cls)
        t.__dict__ = d
        return t


class _Plan:
    """What a memo-answered Conversation knows before its turns are built: per turn its
    template and item start slot, the part boundaries of the text, and whether the last turn
    is a generation prompt. Answers :meth:`Conversation.spans` / ``trained_turns`` exactly as
    the built turns would (see :meth:`_TurnTpl.span_plan`), or None (then they are built)."""

    __slots__ = ("B", "turns", "gp", "memo")

    def __init__(self, B: list[int], turns: list, gp: bool, memo: "TextMemo"):
        self.B, self.turns, self.gp, self.memo = B, turns, gp, memo

    def trained(self, policy) -> list[int]:
        roles = set(policy.roles)
        truncated = policy.truncated
        turns = self.turns
        last = len(turns) - 1
        chosen = [i for i, (tp, _) in enumerate(turns)
                  if tp.meta[0] in roles and tp.meta[1] and (tp.meta[2] or truncated)
                  and not (i == last and self.gp)]
        if not policy.last_turn_only:
            return chosen
        return last_run(chosen, lambda i: turns[i][0].meta[3])

    def spans(self, policy) -> list | None:
        pk = self.memo.policy_key(policy)
        if pk is None:
            return None
        B, turns = self.B, self.turns
        out: list = []
        append = out.append
        for i in self.trained(policy):
            tp, a = turns[i]
            sp = tp.span_plan(policy, pk)
            if sp is None:
                return None
            role = tp.role
            for ks, ds, ke, de, kind in sp:
                x = _new(Span)  # (a frozen dataclass: its __init__ costs 2x this)
                d = x.__dict__
                d["start"] = B[a + ks] + ds
                d["end"] = B[a + ke] + de
                d["role"] = role
                d["kind"] = kind
                d["turn"] = i
                append(x)
        return out


class TextMemo:
    """Exact memo for :meth:`chatgrammar.Format.parse` (text mode).

    Same idea as :class:`FastMasker`: the lexer's tokens are walked through the memoised LALR
    automaton to find the top-level items; an item seen before (same token types, same header
    texts, same text read by the parse) is rebuilt from its template — fresh Turn and Block
    objects with the positions of this text — instead of being parsed. Misses, warnings,
    text cut inside a marker and anything else unusual take the full pipeline, which then
    teaches the memo. ``Format.parse`` gives identical Conversations either way
    (tests/test_fastpath.py compares them field by field).
    """

    def __init__(self, fmt):
        from .spans import Block, Turn

        self.fmt = fmt
        self.drv = fmt._driver
        self.enabled = _fields_known()
        self.block_cls, self.turn_cls = Block, Turn
        self.auto = _Automaton(self.drv, [], 0)
        self.trans: list[dict] = [{}]
        self.items: dict = {}
        self.stats = {"fast": 0, "slow": 0, "harvest": 0}
        self.reasons: dict[str, int] = {}   # full parses by why
        self._why: str | None = None
        self._vec_setup(fmt._lexcfg)

    def _step(self, sid: int, term: str) -> int:
        auto = self.auto
        stack = list(auto.stacks[sid])
        hit = auto._step(stack, term)
        if hit is None or len(stack) > _fp._MAX_DEPTH:
            v = -1
        else:
            st = tuple(stack)
            if st not in auto.ids and len(auto.stacks) >= _fp._MAX_STACKS:
                return -1
            nsid = auto._intern(st)
            while len(self.trans) <= nsid:
                self.trans.append({})
            v = nsid << 1 | (1 if hit else 0)
        self.trans[sid][term] = v
        return v

    def _walk(self, toks: list) -> list[int] | None:
        trans = self.trans
        sid = 0
        bounds: list[int] = []
        for i, t in enumerate(toks):
            v = trans[sid].get(t[0])
            if v is None:
                v = self._step(sid, t[0])
                trans = self.trans
            if v < 0:
                return None
            sid = v >> 1
            if v & 1:
                bounds.append(i)
        hit = self.auto.end(sid)
        if hit is None:
            return None
        if hit:
            bounds.append(len(toks))
        return bounds

    # ------------------------------------------------------------------ the vectorised path
    #
    # One ``re.split`` of the text by the marker regex gives every part: run, marker, run, …
    # (runs may be empty). For a format with literal-ended headers (ChatML's role line) the
    # splitter has a second group, the header after such an opener exactly as ``lex_text``
    # finds it (:func:`_header_group`), so each symbol is three parts: marker, header, run.
    # Part boundaries come from ``itertools.accumulate`` over the part lengths, symbols (a
    # marker and the shape of what follows it, as the id path's FastMasker steps them) from
    # ``map`` over the parts, ``lstrip`` from ``map(str.isspace)`` over the runs and the
    # markers' table, and the automaton is walked ``_WALK`` symbols per dictionary lookup: no
    # Python code runs per character, and none per marker beyond those C-level maps. Item keys
    # are the item's symbol bytes (which parts are empty, which runs an ``lstrip`` marker
    # absorbed) and its header texts; templates are placed on part indices.
    #
    # A key byte is ``code << 2 | header part non-empty << 1 | run non-empty``, and bit 7 when
    # the run is absorbed by the ``lstrip`` marker after it; ``walk_tbl`` maps it to the
    # automaton's symbol (``code << 2 | shape``: NONE, RUN, HEAD, HEAD_RUN).

    def _vec_setup(self, cfg) -> None:
        self.vec = False
        why = _vec_refusal(self, cfg)
        self.path = "per-token: " + why
        if why:
            return
        drv = self.drv
        self.S = 3 if cfg.split_after else 2
        self.splitter, self.fast_splitter, self.rare = _splitters(cfg, drv.unknown_rx)
        self.terms = sorted(set(cfg.by_text.values()))
        code4 = {t: (k + 1) << 2 for k, t in enumerate(self.terms)}
        self.sym_of = {txt: code4[term] for txt, term in cfg.by_text.items()}
        # runs the parse reads (headers): keyed by their text; None: the run at input start
        self.hdr0 = None in cfg.decode_after
        self.vauto = _Automaton(drv, self.terms, (len(self.terms) + 1) * 4)
        self._vec_tables(cfg)
        self.simple: dict = {}  # item key -> templates, for items whose parse reads nothing
        self._policies: dict = {}
        self._last_policy: tuple = (None, None)
        self.wide: list[dict] = [{}]
        self.wide_entries = 0
        self.vec = True
        self.path = "vectorised"

    def _vec_tables(self, cfg) -> None:
        """The byte tables of the split: key byte -> walk symbol (``walk_tbl``, None when the
        two are the same), -> 1 where the run is read as a header (``hdr_table``), -> 1 where
        the run is a TEXT token an ``lstrip`` marker may absorb (``text_tbl``); marker code ->
        1 for an ``lstrip`` marker (``lstrip_tbl``, None without one)."""
        split = {k + 1 for k, t in enumerate(self.terms) if t in cfg.split_after}
        read = {k + 1 for k, t in enumerate(self.terms) if t in cfg.decode_after} - split
        if self.hdr0:
            read.add(0)
        cmask = 0x7C if cfg.lstrip else 0xFC
        walk, hdr, text = bytearray(256), bytearray(256), bytearray(256)
        for x in range(256):
            code, hb, rb = (x & cmask) >> 2, x >> 1 & 1, x & 1
            ab = bool(cfg.lstrip) and x >> 7
            if code in split:  # (lex_text's _text_gap: HEADER, then TEXT; no literal: HEADER)
                shape = (HEAD_RUN if rb and not ab else HEAD) if hb else (HEAD if rb else 0)
            else:
                shape = RUN if rb and not ab else 0
            walk[x] = code << 2 | shape
            hdr[x] = rb and not hb and (code in read or code in split)
            text[x] = rb and not (code in split and not hb)
        self.walk_tbl = bytes(walk) if split or cfg.lstrip else None
        self.hdr_table, self.text_tbl = bytes(hdr), bytes(text)
        self.lstrip_tbl = None
        if cfg.lstrip:
            ls = bytearray(256)  # (indexed by a marker's code byte, (k + 1) << 2)
            for k, t in enumerate(self.terms):
                ls[(k + 1) << 2] = t in cfg.lstrip
            self.lstrip_tbl = bytes(ls)

    def _vec_walk(self, sw: bytes) -> list[int] | None:
        """Item bounds as part indices (symbol ``j``, byte ``j`` of ``sw``, is parts
        ``S*j - S + 1 .. S*j``: its marker, its header part when ``S`` is 3, the run after
        it), or None: a syntax error or an input that ends inside an item.

        The automaton is stepped ``_WALK`` symbols per dictionary lookup: ``wide[sid]`` maps
        a window of symbols to the configuration after it and the item bounds inside it,
        filled from the automaton's per-symbol table on a miss."""
        n = len(sw)
        pad = -n % _WALK
        buf = sw + _PAD_BYTES[:pad] if pad else sw
        wide = self.wide
        S = self.S
        sid = 0
        bounds: list[int] = []
        for k in range(0, len(buf), _WALK):
            g = buf[k:k + _WALK]
            v = wide[sid].get(g)
            if v is None:
                v = self._fill_wide(sid, g)
                if v is None:
                    return None
            sid, offs = v
            if offs:
                bounds.extend([S * k + o for o in offs])
        hit = self.vauto.end(sid)
        if hit is None:
            return None
        if hit:
            bounds.append(S * (n - 1) + 1)
        return bounds

    def _fill_wide(self, sid: int, g: bytes):
        auto = self.vauto
        S = self.S
        cur = sid
        offs: list[int] = []
        for t, sym in enumerate(g):
            if sym == 255:
                continue
            v = auto.table[cur][sym]
            if v is None:
                v = auto.fill(cur, sym)
            if v < 0:
                return None  # a syntax error: the full parse reports it
            # (an item ends before the marker, before the header or run, before the run
            # after a header)
            if v & 1:
                offs.append(S * t - S + 1)
            if v & 2:
                offs.append(S * t - S + 2)
            if v & 4:
                offs.append(S * t)
            cur = v >> 3
        while len(self.wide) < len(auto.stacks):
            self.wide.append({})
        got = (cur, tuple(offs))
        if self.wide_entries < _MAX_WIDE:
            self.wide[sid][g] = got
            self.wide_entries += 1
        return got

    def _vec_split(self, text: str):
        """``(parts, bounds, B, sb, hp, hv)`` of ``text`` (parts, item bounds, part
        boundaries, key bytes, part indices of the non-empty header runs and their text), or
        a reason string."""
        sp = self.fast_splitter
        if sp is None or any(map(text.__contains__, self.rare)):
            sp = self.splitter
        parts = sp.split(text)
        S = self.S
        mk = parts[1::S]
        n = len(mk) + 1
        # symbol j: the code of marker j (none for j = 0) | which parts after it are empty
        try:
            codes = bytes(map(self.sym_of.__getitem__, mk))
        except KeyError:  # the split's other alternative: a marker-shaped unknown string
            return "a marker-shaped string the format does not know"
        runs = parts[0::S]
        x = int.from_bytes(bytes(map(bool, runs)), "little") | \
            int.from_bytes(codes, "little") << 8
        if S == 3:
            x |= int.from_bytes(bytes(map(bool, parts[2::3])), "little") << 9
        sb = x.to_bytes(n, "little")
        ab = 0
        if self.lstrip_tbl is not None:
            # lex_text's absorb_lstrip: a whitespace-only TEXT run right before an lstrip marker
            ab = (int.from_bytes(bytes(map(str.isspace, runs[:-1])), "little")
                  & int.from_bytes(codes.translate(self.lstrip_tbl), "little")
                  & int.from_bytes(sb.translate(self.text_tbl), "little"))
            if ab:
                sb = (x | ab << 7).to_bytes(n, "little")
        bounds = self._vec_walk(sb if self.walk_tbl is None else sb.translate(self.walk_tbl))
        if bounds is None:
            return "syntax error or end of input inside an item"
        if ab:  # an item that starts at an lstrip marker starts where the run it absorbed does
            bounds = [b - 1 if b % S == 1 and sb[(b - 1) // S] & 128 else b for b in bounds]
        B = [0]
        B.extend(accumulate(map(len, parts)))
        if S == 2:
            hp = list(compress(range(0, 2 * n, 2), sb.translate(self.hdr_table)))
        else:  # header parts (an opener's literal-ended header) and runs read as headers
            ind = bytearray(len(parts))
            ind[0::3] = sb.translate(self.hdr_table)
            ind[2::3] = bytes(map(bool, parts[2::3]))
            hp = list(compress(range(len(parts)), ind))
        return parts, bounds, B, sb, hp, list(map(parts.__getitem__, hp))

    def _vec_key(self, hv: list, sb: bytes, hp: list, a: int, b: int) -> tuple:
        # an item's key: which part of a symbol it starts and ends at, its symbols' key bytes
        # (markers, which parts are empty, absorbed runs) and its header runs' text (hv: the
        # text of each hp). (Part p belongs to symbol (p + S - 1) // S.)
        lo, hi = bisect_left(hp, a), bisect_left(hp, b)
        S = self.S
        return (a % S | (b % S) << 2, sb[(a + S - 1) // S:(b + S - 2) // S + 1], tuple(hv[lo:hi]))

    def _vec_lookup(self, text: str):
        got = self._vec_split(text)
        if type(got) is str:
            self._why = got
            return None
        parts, bounds, B, sb, hp, hv = got
        simple = self.simple
        S = self.S
        S1, S2 = S - 1, S - 2
        turns: list = []
        a = lo = 0
        for b in bounds:
            if b <= a:
                continue
            # (the item key of _vec_key, inline: header runs are found in order)
            hi = bisect_left(hp, b, lo)
            k = (a % S | (b % S) << 2, sb[(a + S1) // S:(b + S2) // S + 1], tuple(hv[lo:hi]))
            tpls = simple.get(k)
            if tpls is None:
                tpls = self._vec_item(text, B, k, a)
                if tpls is None:
                    return None
            turns.extend(zip(tpls, repeat(a, len(tpls))))
            a, lo = b, hi
        n = len(text)
        gp = False
        if turns:
            drv = self.drv
            tp, a = turns[-1]
            start = B[a + tp.start[0]] + tp.start[1]
            if drv.gen_prompts and n - start <= drv.max_gen:  # (the driver's own test next)
                last = _FakeTurn(start)
                drv._mark_generation_prompt([last], Source("text", n, text=text), None)
                gp = last.generation_prompt
        self.stats["fast"] += 1
        turn_cls, block_cls = self.turn_cls, self.block_cls

        def build() -> list:
            out = [tp.make(B, a, turn_cls, block_cls) for tp, a in turns]
            if gp:
                out[-1].generation_prompt = True
            return out

        fmt = self.fmt
        return Conversation.deferred(format=fmt.name, mode="text", length=n,
                                     default_policy=fmt.default_policy, text=text,
                                     build=build, plan=_Plan(B, turns, gp, self))

    def policy_key(self, policy) -> int | None:
        """A small number per distinct policy (span plans are kept per number; hashing a
        policy costs more than a lookup by identity), or None past ``_MAX_POLICIES`` of them
        (then spans are computed from the built turns)."""
        last = self._last_policy
        if last[0] is policy:
            return last[1]
        pk = self._policies.get(policy)
        if pk is None:
            if len(self._policies) >= _MAX_POLICIES:
                return None
            pk = self._policies.setdefault(policy, len(self._policies))
        self._last_policy = (policy, pk)
        return pk

    def _vec_item(self, text: str, B: list, key: tuple, a: int):
        """The templates of an item that reads text, or None (with the reason)."""
        it = self.items.get(key)
        if it is None or it.unstable:
            self._why = "new item shape" if it is None else "item whose reads vary"
            return None
        plan = it.plan
        if len(plan) == 1:  # (most: the text between turns, read by the `between` check)
            s, e, lim = plan[0]
            rkey = (_text_read(text, B, a + s, a + e, lim),)
        else:
            rkey = tuple([_text_read(text, B, a + s, a + e, lim) for s, e, lim in plan])
        tpls = it.progs.get(rkey)
        if tpls is None:
            self._why = "new text read by the parse"
        return tpls

    def _vec_tokens(self, parts: list, B: list, sb: bytes) -> list:
        """The reference's token list (``lex_text``'s) as the split and its key bytes describe
        it: one step per symbol, run where a sample is learned (:meth:`_vec_learn` compares
        the two, so the split is proven equal to the lexer on every text the memo learns
        from, not assumed)."""
        cfg, S = self.fmt._lexcfg, self.S
        walk = self.walk_tbl
        toks: list = []
        start = None  # where an lstrip marker's token starts (the run it absorbed)
        for j in range(len(sb)):
            term = None  # (the begin of input)
            if j:
                m = S * j - S + 1
                term = self.terms[(self.sym_of[parts[m]] >> 2) - 1]
                toks.append((term, B[m] if start is None else start, B[m + 1], parts[m]))
            x = sb[j]
            shape = (walk[x] if walk is not None else x) & 3
            r = S * j
            start = B[r] if x & 128 else None
            if S == 3 and j and parts[r - 1]:
                toks.append((HEADER, B[r - 1], B[r], parts[r - 1]))
                if shape == HEAD_RUN:
                    toks.append((TEXT, B[r], B[r + 1], None))
            elif shape == HEAD:  # no literal within the budget: the whole run is header
                toks.append((HEADER, B[r], B[r + 1],
                             _cut(parts[r], cfg.split_max.get(term, 64))))
            elif shape == RUN:
                read = self.hdr_table[x] and term in cfg.decode_after
                toks.append((TEXT, B[r], B[r + 1],
                             _cut(parts[r], cfg.decode_after[term]) if read else None))
        return toks

    def _vec_learn(self, text, toks, turns, reads) -> None:
        got = self._vec_split(text)
        if type(got) is str:
            raise _NoCache
        parts, bounds, B, sb, hp, hv = got
        if self._vec_tokens(parts, B, sb) != toks:  # (never seen: the proof's net)
            self.vec = False
            self.path = "per-token: the split differed from lex_text on a learned text"
            self._reset()
            raise _NoCache
        self.stats["harvest"] += 1
        segs, per_seg, reads_seg = _segments(bounds, B, turns, reads)
        for (a, b), sturns, sreads in zip(segs, per_seg, reads_seg):
            key = self._vec_key(hv, sb, hp, a, b)
            plan, slot_of = _read_plan(B, a, b, sreads)
            it = _Item.of(self.items, key, plan, self._reset)
            rkey = () if it is None else \
                tuple([_text_read(text, B, a + s, a + e, lim) for s, e, lim in plan])
            if it is None or not it.wants(rkey):
                if it is None or it.unstable:
                    self.simple.pop(key, None)
            else:
                # keyed runs (headers: their whole text is in the key) and the text the
                # parse read
                runs = [(B[k], k - a, len(parts[k])) for k in hp if a <= k < b]
                for ks, ke, lim in plan:
                    cap = -lim if lim < 0 else lim * HEADER_CHARS_PER_TOKEN
                    runs.append((B[a + ks], ks, max(0, min(B[a + ke] - B[a + ks], cap))))
                place = _placer(slot_of, tuple(runs))
                hB = B[a:b + 1]
                it.progs[rkey] = [_TurnTpl(t, place, hB) for t in sturns]
                if not plan:  # an item that reads nothing: one lookup serves it
                    self.simple[key] = it.progs[rkey]

    @staticmethod
    def _key(toks: list, a: int, b: int) -> tuple:
        return tuple([(t[0], t[3]) for t in toks[a:b]])

    def lookup(self, text: str):
        """The Conversation of ``text`` from the memo, or None (the caller parses it)."""
        self._why = "memo disabled (the core's Block / Turn fields changed)"
        if not self.enabled:
            return None
        fmt = self.fmt
        self._why = "input ends inside a marker"
        if fmt._partial_marker_tail(text) is not None:
            return None
        if self.vec:
            return self._vec_lookup(text)
        rx = self.drv.unknown_rx
        if rx is not None and not self.drv.known_prefixes.issuperset(
                rx.findall(text) if rx.groups == 0 else [m.group() for m in rx.finditer(text)]):
            self._why = "a marker-shaped string the format does not know"
            return None  # a marker the spec does not know: the full parse judges where it is
        toks = lex_text(text, fmt._lexcfg)
        bounds = self._walk(toks)
        self._why = "syntax error or end of input inside an item"
        if bounds is None:
            return None
        n = len(text)
        pos = [t[1] for t in toks]
        pos.append(n)
        turns: list = []
        a = 0
        for b in bounds:
            if b <= a:
                continue
            it = self.items.get(self._key(toks, a, b))
            if it is None:
                self._why = "new item shape"
                return None
            tpls, why = it.find(_text_read, text, pos, a)
            if tpls is None:
                self._why = why
                return None
            for tp in tpls:
                turns.append(tp.make(pos, a, self.turn_cls, self.block_cls))
            a = b
        src = Source("text", n, text=text)
        self.drv._mark_generation_prompt(turns, src, toks)
        self.stats["fast"] += 1
        return Conversation(format=fmt.name, mode="text", length=n, turns=turns, warnings=[],
                            boundaries=[], default_policy=fmt.default_policy, text=text)

    def _reset(self) -> None:
        """Start the memo afresh (it holds ``_MAX_ITEMS`` items)."""
        self.items.clear()
        getattr(self, "simple", {}).clear()

    def count_slow(self) -> None:
        """Count one full parse, by the reason the last lookup gave."""
        self.stats["slow"] += 1
        why = self._why or "unknown"
        self.reasons[why] = self.reasons.get(why, 0) + 1
        self._why = None

    def source(self, n: int, text: str) -> Source:
        """The Source the full pipeline should use (it records what the parse reads)."""
        src = _RecordingSource("text", n, text=text)
        src.recording = True
        return src

    def learn(self, text: str, toks: list, turns: list, src) -> None:
        """Remember the items of a clean full parse."""
        self.count_slow()
        if not self.enabled or not isinstance(src, _RecordingSource):
            return
        try:
            if self.vec:
                self._vec_learn(text, toks, turns, src.reads)
            else:
                self._learn(text, toks, turns, src.reads)
        except _NoCache:
            pass

    def _learn(self, text, toks, turns, reads) -> None:
        bounds = self._walk(toks)
        if bounds is None:
            raise _NoCache
        self.stats["harvest"] += 1
        n = len(text)
        pos = [t[1] for t in toks]
        pos.append(n)
        segs, per_seg, reads_seg = _segments(bounds, pos, turns, reads)
        for (a, b), sturns, sreads in zip(segs, per_seg, reads_seg):
            key = self._key(toks, a, b)
            plan, slot_of = _read_plan(pos, a, b, sreads)
            it = _Item.of(self.items, key, plan, self._reset)
            rkey = () if it is None else \
                tuple([_text_read(text, pos, a + s, a + e, lim) for s, e, lim in plan])
            if it is not None and it.wants(rkey):
                # keyed runs: header / decoded texts (their value is in the key; an over-long
                # one is cut and marked with "…") and the text the parse read
                runs = []
                for j in range(a, b):
                    t = toks[j]
                    if t[0] in (TEXT, HEADER) and isinstance(t[3], str):
                        n = len(t[3]) if len(t[3]) == t[2] - t[1] else len(t[3]) - 1
                        runs.append((t[1], j - a, n))
                for ks, ke, lim in plan:
                    cap = -lim if lim < 0 else lim * HEADER_CHARS_PER_TOKEN
                    runs.append((pos[a + ks], ks, max(0, min(pos[a + ke] - pos[a + ks], cap))))
                place = _placer(slot_of, tuple(runs))
                it.progs[rkey] = [_TurnTpl(t, place) for t in sturns]


def _vec_refusal(memo: TextMemo, cfg) -> str:
    """Why the vectorised executor cannot run this format's lexing plan ("" when it can):
    each reason is shown by ``fmt.stats()["text"]["path"]``."""
    if not memo.enabled:
        return "memo disabled (the core's Block / Turn fields changed)"
    if cfg.regex is None or not all(cfg.by_text):
        return "a format without markers"
    drv = memo.drv
    if drv.unknown_rx is not None and not _unknown_shape_is_safe(drv, cfg):
        return "the unknown-marker shape may overlap a marker"
    nsym = (len(set(cfg.by_text.values())) + 1) * 4
    if nsym > 255 or (cfg.lstrip and nsym > 128):
        return "too many markers for a symbol byte"  # (255 pads the last window)
    if any(not d for d in cfg.split_after.values()):
        return "an empty header literal"
    texts = list(cfg.by_text)
    for t in cfg.split_after:
        o = cfg.marker_text[t]
        if any(m != o and (m.endswith(o) or o.endswith(m)) for m in texts):
            return "a marker text ends like a literal-ended opener"  # (_header_group)
    return ""


def _splitters(cfg, U) -> tuple:
    """``(splitter, fast splitter, rare)``: the split of the text by its markers (the
    lexer's regex, as a trie: :func:`_trie`), the unknown-marker shape ``U`` and, with
    literal-ended headers, their headers (:func:`_header_group`); and the same without the
    ``rare`` markers (those whose first character is not the most common one), exact on a
    text that holds none of them: its pattern starts with one literal character, which
    ``re`` searches for several times faster than for a set of first characters (ChatML's
    ``**IMPORTANT**`` and ``Please only call`` markers). ``rare`` holds their first 16
    characters (a text without them holds none of those markers; ``str.find`` skips
    through a text fastest with a needle of about that length). No fast splitter (None)
    when every marker starts alike or the shape starts otherwise."""
    pairs = _shape_pairs(U) if U is not None else []
    texts = list(cfg.by_text)
    firsts = [t[0] for t in texts]
    c0 = max(sorted(set(firsts)), key=firsts.count)
    rare = tuple(dict.fromkeys(t[:16] for t in texts if t[0] != c0))
    full = _splitter(cfg, texts, U, pairs)
    if not rare or any(p[0] != c0 for p, _ in pairs):
        return full, None, ()
    return full, _splitter(cfg, [t for t in texts if t[0] == c0], U, pairs), rare


def _splitter(cfg, texts: list, U, pairs: list) -> re.Pattern:
    # (the trie's first branching bare, not in a group: then every alternative starts with a
    # literal and ``re`` scans for their first characters instead of trying each position)
    alts = _trie(sorted(texts), top=True) + ("|" + U.pattern if U is not None else "")
    first = {t[0] for t in texts} | {p[0] for p, _ in pairs}
    hdr = "(" + _header_group(cfg, alts, first) + ")" if cfg.split_after else ""
    return re.compile("(" + alts + ")" + hdr)


def _trie(words: list[str], top: bool = False) -> str:
    """A regex that matches, at a position, the longest of ``words`` that matches there (as
    the lexer's alternation sorted longest first does), written as a trie: one branch per
    next character, the word's end last. ``re`` then tries one branch per character instead
    of every word. (Depth: the branching levels, at most one per word.)"""
    pre = os.path.commonprefix(words)
    rest = [w[len(pre):] for w in words]
    groups: dict[str, list[str]] = {}
    for w in rest:
        if w:
            groups.setdefault(w[0], []).append(w)
    alts = [_trie(g) for g in groups.values()]
    if not alts:
        return re.escape(pre)
    if len(alts) == 1 and "" not in rest:
        return re.escape(pre) + alts[0]
    if top and not pre and "" not in rest:
        return "|".join(alts)
    return re.escape(pre) + "(?:" + "|".join(alts) + ("|)" if "" in rest else ")")


def _header_group(cfg, alts: str, first: set) -> str:
    """The splitter's second group: right after an opener whose header ends at a literal
    (``LexConfig.split_after``), that header exactly as ``lex_text`` (``_text_gap``) finds
    it, else the empty string.

    ``_text_gap`` takes the first occurrence of the literal ``d`` that starts within the
    budget (``split_max * HEADER_CHARS_PER_TOKEN`` chars) and ends before the next marker;
    here: at most ``cap`` characters at none of which a marker (or an unknown marker shape:
    ``alts`` is the splitter's own alternation, ``first`` its first characters) starts,
    lazily, then ``d`` with no marker starting inside it. Where no such header exists the
    group is empty and the run after the opener is the header (``_text_gap``'s no-literal
    case). The opener is told by a lookbehind (:func:`_vec_refusal` refuses a format where
    another marker's text ends like it). Consuming the header moves no marker: none starts
    inside it."""
    cls = "".join("\\" + c if c in "\\]^-[" else c for c in sorted(first))
    # A character no marker starts with is free; one a marker may start with is free where no
    # marker starts. The two alternatives must be disjoint: with `(?!alts)(?s:.)` as the
    # second, every free character matched both ways and a header with no literal before the
    # next marker (`<|im_start|>System: …<|im_end|>`) backtracked through 2^n ways.
    free = f"(?:[^{cls}]|(?!{alts})[{cls}])" if cls else "(?s:.)"
    out = []
    for t in sorted(cfg.split_after, key=lambda t: len(cfg.marker_text[t]), reverse=True):
        d = cfg.split_after[t]
        cap = cfg.split_max.get(t, 64) * HEADER_CHARS_PER_TOKEN
        lit = "".join(("(?!" + alts + ")" if c in first else "") + re.escape(c) for c in d)
        out.append(f"(?<={re.escape(cfg.marker_text[t])}){free}{{0,{cap}}}?{lit}")
    return "|".join(out) + "|"


def _cut(run: str, budget: int) -> str:
    # a header run read within its budget, as lex_text's _text_gap reads it
    cap = budget * HEADER_CHARS_PER_TOKEN
    return run if len(run) <= cap else run[:cap] + "\u2026"


def _text_read(text: str, pos: list[int], js: int, je: int, limit: int):
    # what a text-mode read of [s, e) can depend on: its length up to a bound, and its text
    s, e = pos[js], pos[je]
    cap = -limit if limit < 0 else limit * HEADER_CHARS_PER_TOKEN
    k = min(e - s, cap + 1)
    return k, text[s:s + min(k, cap)]


def _unknown_shape_is_safe(drv, cfg) -> bool:
    """Whether one split by ``markers | unknown-marker shape`` can stand for the two scans
    of the reference (the lexer's marker regex, then the unknown-marker check that every
    string of that shape is a known marker or its head): true when the shape's alternatives
    are ``PREFIX inner SUFFIX`` with punctuation-only prefix and suffix (the form
    :func:`chatgrammar.runtime.parse.unknown_marker_shape` builds) and every marker text

    - that the shape can start inside (strictly after its first character) — none may;
    - that begins like a prefix is one whole ``PREFIX inner SUFFIX`` match, after which no
      alternative with that prefix could go on matching (no suffix extends its suffix).

    Then a split that finds only known markers took no shape match, so it found exactly
    the lexer's markers, and every place the shape matches is the start of a known marker
    where the match is a head of that marker. Otherwise the two scans run as before."""
    U = drv.unknown_rx
    pairs = _shape_pairs(U)
    if pairs is None:
        return False
    inner = re.compile(r"[\w.:\-\u2581]")
    if any(not p or not q or inner.search(p) or inner.search(q) or p.isspace() or q.isspace()
           or any(c.isspace() for c in p + q) for p, q in pairs):
        return False
    rebuilt = "|".join(sorted((re.escape(p) + _INNER + re.escape(q) for p, q in pairs),
                              key=len, reverse=True))
    if rebuilt != U.pattern:
        return False
    for m in cfg.by_text:
        for k in range(1, len(m)):
            tail = m[k:]
            if any(tail.startswith(p) or p.startswith(tail) for p, _ in pairs):
                return False
        heads = [(p, q) for p, q in pairs if m.startswith(p) or p.startswith(m)]
        if not heads:
            continue
        full = [(p, q) for p, q in heads if len(m) > len(p) + len(q) and m.startswith(p)
                and m.endswith(q) and re.fullmatch(r"[\w.:\-\u2581]{1,48}",
                                                   m[len(p):len(m) - len(q)])]
        if len(full) != 1:
            return False
        p0, q0 = full[0]
        if any(p == p0 and q != q0 and (q.startswith(q0) or q0.startswith(q))
               for p, q in heads) or any(p != p0 for p, _ in heads):
            return False
    return True


def _shape_pairs(U) -> list | None:
    """The ``(PREFIX, SUFFIX)`` of each alternative of the unknown-marker shape ``U`` (the
    form :func:`chatgrammar.runtime.parse.unknown_marker_shape` builds), or None."""
    pieces = U.pattern.split(_INNER)
    # pattern = pre0 INNER suf0|pre1 INNER suf1|...: pieces = [pre0, suf0|pre1, ..., sufN]
    if len(pieces) < 2:
        return None
    try:
        texts = [_unescape(pieces[0])]
        for mid in pieces[1:-1]:
            suf, pre = mid.split("|")  # (escaped punctuation never holds a bare "|")
            texts += [_unescape(suf), _unescape(pre)]
        texts.append(_unescape(pieces[-1]))
    except ValueError:
        return None
    return [(texts[i], texts[i + 1]) for i in range(0, len(texts), 2)]


_INNER = r"(?:\w|[.:\-\u2581]){1,48}"  # (as parse.unknown_marker_shape writes it)


def _unescape(s: str) -> str:
    """The literal text of a ``re.escape``-d string (raises ValueError for anything else)."""
    out = re.sub(r"\\(.)", r"\1", s)
    if re.escape(out) != s:
        raise ValueError(s)
    return out
