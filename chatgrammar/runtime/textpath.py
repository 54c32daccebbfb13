"""Exact memo for :meth:`Format.parse` (text mode).

Same idea as :class:`chatgrammar.runtime.fastpath.FastMasker` for token ids: the lexer's tokens
are walked through the memoised LALR automaton to find the top-level items; an item seen before
is rebuilt from a template — fresh Turn and Block objects carrying this text's positions — so
the Conversation is identical to a full parse (tests/test_fastpath.py compares them field by
field; ``CHATGRAMMAR_VERIFY=1`` checks every memo answer against the full parse).
"""
from __future__ import annotations

import dataclasses

from ..core.compile import HEADER, HEADER_CHARS_PER_TOKEN, TEXT
from .fastpath import (_MAX_DEPTH, _MAX_ITEMS, _MAX_PROGS, _MAX_STACKS, _Automaton, _Item,
                       _NoCache, _read_plan, _RecordingSource, _segments)
from .lexers import lex_text
from .parse import Source
from .spans import Conversation


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
    __slots__ = ("base", "start", "end", "block")

    def __init__(self, t, place):
        self.base = dict(t.__dict__)
        self.base["generation_prompt"] = False
        self.start, self.end = place(t.start), place(t.end)
        self.block = _BlockTpl(t.block, place)

    def make(self, bounds: list[int], a: int, turn_cls, block_cls):
        t = object.__new__(turn_cls)
        d = dict(self.base)
        d["start"] = bounds[a + self.start[0]] + self.start[1]
        d["end"] = bounds[a + self.end[0]] + self.end[1]
        d["block"] = self.block.make(bounds, a, block_cls)
        t.__dict__ = d
        return t


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

    def _step(self, sid: int, term: str) -> int:
        auto = self.auto
        stack = list(auto.stacks[sid])
        hit = auto._step(stack, term)
        if hit is None or len(stack) > _MAX_DEPTH:
            v = -1
        else:
            st = tuple(stack)
            if st not in auto.ids and len(auto.stacks) >= _MAX_STACKS:
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
            if it is None or it.unstable:
                self._why = "new item shape" if it is None else "item whose reads vary"
                return None
            if it.plan:
                rkey = tuple(_text_read(text, pos, a + s, a + e, lim) for s, e, lim in it.plan)
            else:
                rkey = ()
            tpls = it.progs.get(rkey)
            if tpls is None:
                self._why = "new text read by the parse"
                return None
            for tp in tpls:
                turns.append(tp.make(pos, a, self.turn_cls, self.block_cls))
            a = b
        src = Source("text", n, text=text)
        self.drv._mark_generation_prompt(turns, src, toks)
        self.stats["fast"] += 1
        return Conversation(format=fmt.name, mode="text", length=n, turns=turns, warnings=[],
                            boundaries=[], default_policy=fmt.default_policy, text=text)

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
            it = self.items.get(key)
            if it is None:
                if len(self.items) > _MAX_ITEMS:
                    self.items.clear()
                it = self.items[key] = _Item(plan)
            elif it.plan != plan:
                it.unstable = True
                continue
            rkey = tuple(_text_read(text, pos, a + s, a + e, lim) for s, e, lim in plan)
            if rkey not in it.progs and len(it.progs) >= _MAX_PROGS:
                it.unstable = True  # what the parse reads varies without end: stay slow
                it.progs.clear()
            elif rkey not in it.progs:
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


def _text_read(text: str, pos: list[int], js: int, je: int, limit: int):
    # what a text-mode read of [s, e) can depend on: its length up to a bound, and its text
    s, e = pos[js], pos[je]
    cap = -limit if limit < 0 else limit * HEADER_CHARS_PER_TOKEN
    k = min(e - s, cap + 1)
    return k, text[s:s + min(k, cap)]
