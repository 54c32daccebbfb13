"""Exact fast path for loss masks over token ids (``Format.loss_mask`` / ``loss_masks``).

The full pipeline (id lexer → LALR driver → Blocks → Conversation → spans) costs a few
microseconds per parser token in Python. Training data repeats itself: a conversation is a
sequence of *items* (turns) whose shapes recur — "user turn", "assistant turn with reasoning and
a response", "assistant turn with one tool call" — so this module memoises the work at the item
level, keyed by everything the item's parse can depend on:

1. **Lexing, vectorised.** The rules are the lexing plan's (:class:`~chatgrammar.runtime.
   lexers.IdPlan`), and so is the one builder of the symbol stream, ``IdPlan.stream``: the
   reference ``IdLexer`` reads its token list from that stream, and this module its symbol
   tables (:meth:`FastMasker._symbols`). Marker ids are found with numpy, or in one C pass by
   the optional accelerator (``chatgrammar/runtime/_speedups.c``: list conversion, marker
   search, symbol tables and list masks), an executor of the same plan that
   :meth:`FastMasker.verify_lex` checks against the builder. No Python code looks
   at ordinary ids one by one. Each marker and the run of ordinary ids after it form one *symbol*: the marker's
   kind and the run's shape (none / text / header / header + text). The runs the lexer decodes
   (headers) contribute their ids to the key; content runs contribute only their presence.
2. **Parsing, memoised.** The LALR automaton is run over symbols with memoised transitions
   (stack configuration × symbol → configuration, reductions), so one step is one list lookup;
   the reductions of a top-level item mark item boundaries.
3. **Semantics, memoised.** An item's turns (roles, kinds, trained spans) are computed once by
   the full pipeline — on the first sample in which the item's key appears — expressed in
   *slots* (token boundaries of the item) and reused for every later item with the same key.
   Anything else the parse reads from the input (``between`` text, ``lead`` literals) is
   recorded as a read plan and its ids join the key. Under a policy, the trained spans of an
   item are :meth:`Conversation.spans` of the item's own turns, so policy semantics are never
   re-implemented here.

Truncation (an item cut by the end of input) and ``last_turn_only`` are cases of the same
memo (a cut item is keyed also by the configuration it ends in). Whatever the memo does not
hold falls back to the full pipeline for that sample, which also gives its errors: structure
errors, lenient-mode warnings, span boundaries inside merged tokens, soft markers that may
occur in a content run, headers that end by a literal not found within their budget; a new
item shape in a long sample is learned from a window around it (:meth:`FastMasker.
_learn_window`). The result is always exactly ``parse_ids(...).mask_array(policy)``
(tests/test_fastpath.py and tests/test_speedups.py check it on many inputs).

4. **The C executor.** ``_speedups.run`` executes one sample end to end over the same plan
   (:meth:`FastMasker._c_plan`: marker table, run shapes, header budgets, soft-marker
   pieces, generation prompts' markers), the same automaton table (``_Automaton.table``) and
   the same item memo (keys are the bytes :func:`_item_key` builds; per policy a packed
   record of the item's spans, :func:`_c_record`). The two lexing rules that decode (a
   literal-ended header's end, :meth:`IdPlan.split_prefix`; an ``lstrip`` marker's
   whitespace, :meth:`IdPlan.blank`) it reads from those rules' memos. It applies only what
   the Python engine memoised and hands back anything else (:meth:`FastMasker.run_c`).
   An item cut inside a header whose cut text the parse reads only through
   :meth:`Driver.cut_reading` is memoised under that reading too (:meth:`FastMasker._alias`).

The text-mode memo for :meth:`Format.parse` (``TextMemo``) lives in
:mod:`chatgrammar.runtime.textpath`; it reuses this module's automaton and item machinery.

Memory is bounded: at most 200k stack configurations (none deeper than 128) and 200k item keys
per (format, tokenizer); past that, entries are dropped or samples take the full pipeline.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
import struct
import sys
import threading
from typing import Any

import numpy as np

try:  # optional C passes (setup.py builds them); same results without, ~2x slower list input
    from . import _speedups
except ImportError:  # pragma: no cover - depends on the build
    _speedups = None
if os.environ.get("CHATGRAMMAR_PURE"):
    _speedups = None

from ..core.compile import HEADER, TEXT
from .parse import unknown_marker_ids
from ..errors import ParseError, VerifyError
from .lexers import BODY, DECODE, LSTRIP_MAX, SPLIT, IdLexer, as_id_array
from .parse import Source, plain_reduce
from .policy import MaskPolicy, last_run
from .spans import Conversation, Issue

# run shapes after a marker (low two bits of a symbol)
NONE, RUN, HEAD, HEAD_RUN = 0, 1, 2, 3
_MAX_STACKS = 200_000
# Memo size bounds: a long run over data with free-text headers (K2's message names) or varying
# between-text learns a new item / variant per sample; unbounded, that is a memory leak
# (~6 KB per item). Items beyond _MAX_ITEMS start the memo afresh; an item with more than
# _MAX_PROGS variants of what its parse reads stops being memoised (it stays on the slow path).
_MAX_ITEMS = 20_000
_MAX_PROGS = 64
# Configurations deeper than this are not memoised (a stack tuple per configuration would cost
# memory quadratic in the nesting depth): such inputs take the full, non-recursive parser.
_MAX_DEPTH = 128
# A sample at least this long with a new item shape is learned from a window around the
# new item (FastMasker._learn_window) rather than parsed whole.
_WINDOW_MIN = 1024
# A learning parse of at most this many lexer tokens also learns its items cut after each
# marker and content run (FastMasker._prefix_cuts): a window, or a short sample.
_PREFIX_TOKENS = 512
# and at most this many of them per parse
_PREFIX_LEARN = 96
# ... and only while the memo's items repeat: over each stretch of this many learning parses,
# at most _LEARN_RATE of the samples seen needed one. On data whose items never repeat nearly
# every sample is a learning parse and its cut items are never asked for (learning them made
# each sample ~3x dearer); the rate is checked again at each stretch's end. The first
# _LEARN_WARM learning parses always learn them (a young memo's cut items are the common
# shapes, which truncated samples ask for next): a bounded one-time cost.
_LEARN_STRETCH = 16
_LEARN_RATE = 0.5
_LEARN_WARM = 256
# loss_masks works through a batch in groups of about this many tokens (2 MB as int64)
_BATCH_TOKENS = 1 << 18
# The walk steps GRAM symbols at a time: one dict lookup per GRAM markers.
GRAM = 4
FLAG_BITS = 3 * GRAM
FLAG_MASK = (1 << FLAG_BITS) - 1
PAD_SYM = 0xFFFF


class _Automaton:
    """LALR over symbols with memoised transitions.

    A configuration is the parser's state stack (a tuple), interned to a small int ``sid``.
    ``table[sid][sym]`` is ``None`` (not computed yet), ``-1`` (syntax error: the slow path
    reports it) or ``new_sid << 3 | flags`` where flag bit ``j`` says that a top-level item
    ended just before sub-token ``j`` of the symbol (0: the marker, 1: the run or header,
    2: the text after a header).
    """

    def __init__(self, drv, terms: list[str], nsym: int):
        self.states = drv.states
        self.core = drv.core
        self.item_rules = frozenset({"_item"} | set(drv.preamble_rules))
        # (the core's implicit close: the memo only holds items whose parse had no warning)
        self.terms = terms          # code k (1-based) -> terminal; code 0 is begin-of-input
        self.nsym = nsym
        self.lock = threading.Lock()
        self.stacks: list[tuple] = []
        self.ids: dict[tuple, int] = {}
        self.table: list[list] = []
        self.tgram: list[dict] = []
        self.end_flags: list = []
        self._intern((drv.tables.start_state,))

    def _intern(self, stack: tuple) -> int:
        sid = self.ids.get(stack)
        if sid is None:
            with self.lock:  # rows first, then the id: a reader never sees a missing row
                sid = self.ids.get(stack)
                if sid is None:
                    sid = len(self.stacks)
                    self.stacks.append(stack)
                    self.table.append([None] * self.nsym)
                    self.tgram.append({})
                    self.end_flags.append(None)
                    self.ids[stack] = sid
        return sid

    def _step(self, stack: list, term: str) -> bool | None:
        """Feed ``term`` with the driver's own core (:meth:`~chatgrammar.runtime.parse.
        LalrCore.feed`: its reductions and its implicit close); True if a top-level item was
        reduced, None on a syntax error (``stack`` is then unchanged)."""
        trial = list(stack)
        hit = [False]
        red = plain_reduce(self.states, trial, self.item_rules, hit)
        core = self.core

        def close(c) -> None:
            trial.append(core.feed(trial, c, red))  # can_feed said it shifts

        target = core.feed(trial, term, red, close)
        if target < 0:
            return None
        trial.append(target)
        stack[:] = trial
        return hit[0]

    def fill(self, sid: int, sym: int) -> int:
        code, shape = sym >> 2, sym & 3
        subs: list[tuple[int, str]] = []
        if code:
            subs.append((1, self.terms[code - 1]))
        if shape == RUN:
            subs.append((2, TEXT))
        elif shape == HEAD:
            subs.append((2, HEADER))
        elif shape == HEAD_RUN:
            subs += [(2, HEADER), (4, TEXT)]
        stack = list(self.stacks[sid])
        flags = 0
        for bit, term in subs:
            hit = self._step(stack, term)
            if hit is None:
                self.table[sid][sym] = -1
                return -1
            if hit:
                flags |= bit
        if len(stack) > _MAX_DEPTH:
            return -1  # pathological nesting: not memoised, the slow path parses it
        st = tuple(stack)
        if st not in self.ids and len(self.stacks) >= _MAX_STACKS:
            return -1
        nsid = self._intern(st)
        if self.end_flags[nsid] is None:
            # the end of input from a new configuration, now: the C walk then never hands a
            # sample back (and reads it again) only because an input ends there
            self.end(nsid)
        v = nsid << 3 | flags
        self.table[sid][sym] = v
        return v

    def fill_gram(self, sid: int, gram: bytes) -> int:
        """``GRAM`` symbols at once (``PAD_SYM`` pads the last gram): ``new_sid << FLAG_BITS |
        flags`` with bit ``3t + s`` set when an item ended before sub-token ``s`` of symbol
        ``t``; -1 on a syntax error."""
        cur = sid
        flags = 0
        for t, sym in enumerate(np.frombuffer(gram, dtype=np.uint16).tolist()):
            if sym == PAD_SYM:
                continue
            v = self.table[cur][sym]
            if v is None:
                v = self.fill(cur, sym)
            if v < 0:
                return -1  # not memoised: errors are rare and the slow path reports them
            flags |= (v & 7) << (3 * t)
            cur = v >> 3
        v = cur << FLAG_BITS | flags
        self.tgram[sid][gram] = v
        return v

    def end(self, sid: int):
        """End of input from ``sid``: None (not a clean end: the input ends inside an item),
        else True when the end reduced a last item."""
        hit = self.end_flags[sid]
        if hit is None:
            stack = list(self.stacks[sid])
            got = [False]
            ok = self.core.end(stack, plain_reduce(self.states, stack, self.item_rules, got))
            hit = got[0] if ok else -1
            self.end_flags[sid] = hit
        return None if hit == -1 else hit


class _Item:
    """The memoised semantics of one item key: its read plan and, per read result, its turns."""

    __slots__ = ("plan", "progs", "unstable")

    def __init__(self, plan: tuple):
        self.plan = plan            # ((slot_s, slot_e, limit), ...) relative to the item
        self.progs: dict = {}       # read-result key -> _Prog (text mode: turn templates)
        self.unstable = False

    @classmethod
    def of(cls, items: dict, key, plan: tuple, reset) -> "_Item | None":
        """The item of ``key`` to learn into (id and text memos alike): made when new
        (``reset()`` first when ``items`` holds ``_MAX_ITEMS``); None when the parse read
        other things than the item's plan says (it is then unstable: that key stays slow)."""
        it = items.get(key)
        if it is None:
            if len(items) > _MAX_ITEMS:
                reset()
            it = items[key] = cls(plan)
        elif it.plan != plan:
            it.unstable = True
            return None
        return it

    def wants(self, rkey) -> bool:
        """Whether to learn the item's result for the reads ``rkey``: not held yet and room
        for it (past ``_MAX_PROGS`` variants what the parse reads varies without end: the
        item becomes unstable and stays slow)."""
        if rkey in self.progs:
            return False
        if len(self.progs) >= _MAX_PROGS:
            self.unstable = True
            self.progs.clear()
            return False
        return True

    def find(self, read, data, pos, base: int):
        """``(result, None)`` for this input, or ``(None, why)``: the result memoised under
        what the plan's reads give here (``read(data, pos, base + s, base + e, limit)`` per
        read: :func:`_read_key` over ids, ``textpath._text_read`` over text)."""
        if self.unstable:
            return None, "item whose reads vary"
        rkey = tuple([read(data, pos, base + s, base + e, lim) for s, e, lim in self.plan]) \
            if self.plan else ()
        got = self.progs.get(rkey)
        return (got, None) if got is not None else (None, "new text read by the parse")


class _Prog:
    """Turns of an item (slot-relative), and their trained spans per policy."""

    __slots__ = ("turns", "starts", "slot_of", "runs", "by_policy")

    def __init__(self, turns: list, starts: list[int], slot_of: dict[int, int],
                 runs: tuple = ()):
        self.turns = turns          # Turn objects (positions of the sample they came from)
        self.starts = starts        # slot of each turn's start
        self.slot_of = slot_of      # position in that sample -> slot
        # (position, slot, n): a run whose first n ids are part of the item's key, so a
        # position inside them (a header's `trained_after` start) is that slot + an offset
        self.runs = runs
        self.by_policy: dict = {}   # policy -> tuple of (slot_a, da, slot_b, db, turn index)

    def place(self, pos: int):
        """``(slot, offset)`` of a position of the harvested sample, or None."""
        k = self.slot_of.get(pos)
        if k is not None:
            return k, 0
        for p0, k, n in self.runs:
            if p0 < pos <= p0 + n:
                return k, pos - p0
        return None


class _Reference:
    """A mask the full pipeline computed (not the C executor): returned as it is."""

    __slots__ = ("mask",)

    def __init__(self, mask):
        self.mask = mask


class FastMasker:
    """Exact, memoised loss masks for one (format, tokenizer) pair. See the module docstring.

    Args:
        fmt: the :class:`~chatgrammar.runtime.format.Format`.
        lx: its id lexer bound to the tokenizer.
    """

    def __init__(self, fmt, lx: IdLexer):
        self.fmt = fmt
        self.lx = lx
        self.drv = fmt._driver
        self.enabled = True
        self.disabled: str | None = None  # why every sample takes the full pipeline
        self.adapter = lx.adapter
        plan = self.lexplan = lx.plan  # the lexing rules: one plan, this is an executor
        k = len(lx.terms)
        self.nsym = (k + 1) * 4
        # the id markers' codes (0..k): the plan's soft markers without an id are found in
        # decoded runs, which this executor hands back
        gclass, budget = plan.gclass[:k + 1], plan.budget[:k + 1]
        if int(budget.max(initial=0)) >= 60_000:
            self.enabled = False
            self.disabled = "a header budget of 60k tokens or more"
        refused = spec_refusal(fmt.spec)
        if refused:
            self.enabled = False
            self.disabled = refused
        self.gclass, self.budget = gclass, budget  # (the plan's, for the id markers' codes)
        vfree = plan.value_free[:k + 1]
        self.vfree = vfree if vfree.any() else None
        self.has_split = plan.has_split
        lstrip = None if plan.lstrip_code is None else plan.lstrip_code[:k + 1]
        self.lstrip_code = lstrip if lstrip is not None and lstrip.any() else None
        self.space_memo = plan.space_memo
        # Special/added ids of markers the format does not know (parse.unknown_marker_ids) are
        # found with the markers, under a code of their own (`unk_code`): a sample holding one
        # takes the full pipeline, which reports it where it would train.
        unk = unknown_marker_ids(self.drv, lx.adapter)[0]
        self.unk_code = k + 1 if len(unk) else 0
        mlut = lx.lut
        if len(unk):
            mlut = np.zeros(max(len(lx.lut), int(unk.max()) + 3), dtype=lx.lut.dtype)
            mlut[:len(lx.lut)] = lx.lut
            mlut[unk + 1] = self.unk_code
        # (lut is indexed by id + 1; marker ids are [lo, hi])
        self.lo, self.hi, self.lutr = plan.restrict(mlut)
        self.lut = lx.lut
        self.auto = _Automaton(self.drv, lx.terms, self.nsym)
        self.has_values = bool((self.gclass != BODY).any())
        self.pad = np.full(GRAM, PAD_SYM, dtype=np.uint16).tobytes()
        self._policy_ids: dict = {}
        self._policy_by_obj: dict[int, tuple] = {}
        self.concat_decode = (lx.adapter.kind == "tiktoken"
                              and not any("\ufffd" in g for g in self.drv.gen_prompts))
        self.items: dict = {}
        self.split_memo = plan.split_memo
        self._canon: np.ndarray | None = None  # see _learn
        # the same results keyed as the C executor looks them up: bytes(code, prefix ids)
        self.split_c = plan.split_c
        self.soft_lut = None
        if lx.soft_regex is not None:
            self.soft_lut = plan.soft_lut
            if self.soft_lut is None:
                self.enabled = False
                self.disabled = "soft markers this tokenizer's pieces cannot be searched for"
        # Opener codes whose header, cut by the end of input, the parse reads only through
        # Driver.cut_header_reading: an item cut there is also memoised under that reading
        # (_alias), so a cut at another id of the same header needs no parse.
        self.cut_codes = {
            i: t for i, t in enumerate(lx.terms, start=1)
            if t in self.drv.cut_header_terms and gclass[i] == DECODE} \
            if self.has_values and not self.has_split else {}
        self._alias_of: dict[bytes, bytes] = {}  # cut item key -> its _alias (bounded)
        self.prefix_ok = self._prefixes_apply(fmt.spec)
        # (learning parses, samples) at the start of the current stretch; its verdict
        self._stretch = (0, 0)
        self._cuts_on = True
        self.stats = {"fast": 0, "slow": 0, "harvest": 0, "c": 0, "alias": 0}
        self.reasons: dict[str, int] = {}   # slow samples by why
        self._why = None
        # What the C executor reads: item key -> packed spans, one dict per policy (filled by
        # _fast from the same memo), and the plan tuple (None: the numpy executor only).
        self.cmemo: dict[int, dict] = {}
        self._cpol: dict[int, tuple] = {}
        self.plan = self._c_plan()

    def _c_plan(self):
        """The lexing plan and automaton as the C executor takes them (``_speedups.run``):
        the plan's own arrays for the id markers' codes (the restricted marker table with
        ``unk_code``, ``gclass``, ``budget``, ``lstrip_code``, ``LSTRIP_MAX``) and the memos of
        its two rules that decode (:meth:`IdPlan.split_prefix`'s ``split_c``,
        :meth:`IdPlan.blank`'s ``space_memo``), which the C executor reads and the Python
        engine fills; the automaton's table and end flags. None where the accelerator is not
        built."""
        if _speedups is None or not hasattr(_speedups, "run") or not self.enabled:
            return None
        soft = None if self.soft_lut is None else self.soft_lut.astype(np.uint8).tobytes()
        lstrip = None if self.lstrip_code is None else \
            self.lstrip_code.astype(np.int64).tobytes()
        return (self.lo, self.lutr.astype(np.int64).tobytes(),
                self.gclass.astype(np.int64).tobytes(), self.budget.astype(np.int64).tobytes(),
                lstrip, LSTRIP_MAX, self.unk_code, soft,
                self.split_c if self.has_split else None, self.space_memo,
                self.has_values, self._gen_table(), self.auto.table, self.auto.end_flags,
                None if self.vfree is None else self.vfree.astype(np.int64).tobytes())

    def _prefixes_apply(self, spec) -> bool:
        """Whether a learning parse also teaches the memo its items cut after each content
        run (:meth:`_prefix_cuts`, :meth:`_learn_cut`): where the reference lexer's tokens of such a prefix
        are the whole input's up to there (no literal-ended header, ``lstrip`` marker or
        decoded soft marker changes a run by what follows it), its end of input reads no
        text (no element without an opener where ``between`` is set) and building a parent
        never changes a child block (the saved configurations share them)."""
        drv = self.drv
        return (self.enabled and not self.has_split and self.lstrip_code is None
                and self.lx.soft_regex is None
                and not (drv.openerless_headers and drv.between is not None)
                and not any(el.kind_when_cut is not None
                            or (el.close is not None and el.close.opens_follow)
                            for el in spec.elements.values()))

    def _gen_table(self) -> bytes | None:
        """Per marker code, the generation prompts its text occurs in (a bit mask) and its
        length, after the longest prompt's length and what each other id adds at least: a
        last turn whose markers cannot all be in one prompt, or that is longer than any, is
        no generation prompt, so the C executor need not ask the driver
        (``_generation_prompt``). Where decoding is byte-concatenative (``concat_decode``)
        lengths are UTF-8 bytes and every other id adds one (a tiktoken id has at least one
        byte; a tail that decodes to a prompt holds exactly its bytes); else characters, and
        the other ids add nothing (a SentencePiece piece may decode to nothing)."""
        gps = sorted(self.drv.gen_prompts)
        if not gps:
            return None
        size = (lambda t: len(t.encode("utf-8"))) if self.concat_decode else len
        words = [max(map(size, gps)), 1 if self.concat_decode else 0,
                 -1, 0]  # code 0 (begin of input) is no marker
        for term in self.lx.terms:
            text = self.lx.cfg.marker_text[term]
            m = sum(1 << g for g, gp in enumerate(gps) if text in gp) if len(gps) < 63 else -1
            words += [m, size(text)]
        return struct.pack(f"={len(words)}q", *words)

    def _disable(self, why: str) -> None:
        self.enabled = False
        self.disabled = why
        self.plan = None

    def forget(self) -> None:
        """Drop every memoised item (both executors' views of the memo)."""
        self.items.clear()
        for cm in self.cmemo.values():
            cm.clear()

    def _forget_key(self, key: bytes) -> None:
        for cm in self.cmemo.values():
            cm.pop(key, None)

    def run_c(self, ids, policy: MaskPolicy, strict: bool):
        """The C executor on one sample: the mask (a list for a list, a numpy int64 array for
        an int64 array, a ``torch.long`` tensor for a CPU tensor), or None when it does not
        take the sample (the caller runs the Python engine, which then teaches it)."""
        plan = self.plan
        if plan is None or _speedups is None:  # (tests and the bench switch it off live)
            return None
        if type(ids) is list:
            out = None
        elif (type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1
              and ids.flags.c_contiguous):
            out = np.zeros(len(ids), dtype=np.int64)
        elif type(ids).__module__ == "torch":
            return self._c_torch(ids, policy, strict)
        else:
            return None
        hit = self._cpol.get(id(policy))
        if hit is None or hit[0] is not policy:
            hit = self._c_policy(policy)
        r = _speedups.run(plan, ids, hit[1], hit[2], out)
        if type(r) is not list and r is not True:
            r = self._c_retry(ids, r, hit, policy, strict, out)
            if r is None:
                return None  # the Python engine takes it
            if type(r) is _Reference:
                return r.mask  # the full pipeline's own answer
        st = self.stats
        st["fast"] += 1
        st["c"] += 1
        if out is not None:
            r = out
        if verify_enabled():
            a = ids_input(ids)[0]
            # the C executor's own pass 1 (its merge) against the builder, then the mask
            lexed = self.c_lex(ids)
            if lexed is None:  # (a memo it read was cleared in between: numpy's then)
                lexed = self._lex(a, [0, len(a)])
            self.verify_lex(a, [0, len(a)], 0, lexed)
            self._verify(a, r, policy, strict)
        return r

    def c_lex(self, ids):
        """The C executor's symbol tables of one sample (``_speedups.lex``: its pass 1, the
        plan's steps in C), in :meth:`_lex`'s form; None where it hands the sample back or
        the accelerator is not built. :meth:`verify_lex` checks them against the builder."""
        if self.plan is None or _speedups is None:
            return None
        if type(ids) is not list:
            ids = np.ascontiguousarray(ids_input(ids)[0])
        got = _speedups.lex(self.plan, ids)
        if got is None:
            return None
        return (*got, [0, (len(got[4]) - 1) // 3], [None])

    def _c_retry(self, ids, r, hit, policy, strict, out):
        """What :meth:`run_c` does with an answer of the C executor that is not a mask:
        items its memo lacks (filled from the Python memo, learned from a window, or the
        whole sample parsed by the full pipeline, whose mask is returned as it is: a list or
        an int64 array), automaton entries its walk lacks (filled here: the walk goes on
        in C, not in the Python engine), or a last turn that may be a generation prompt."""
        plan = self.plan
        # (each retry resumes the same sample: C keeps its symbol tables, so a 1M-token
        # sequence is read once however many entries it makes the memo learn)
        if type(r) is bytes:
            if not self._c_auto(r):
                return None
            r = _speedups.run(plan, ids, hit[1], hit[2], out, False, True)
            if type(r) is bytes:
                return None  # (an entry the automaton does not memoise: too deep, too many)
        if type(r) is tuple and type(r[0]) is tuple:
            # items the C memo lacks: fill those the memo knows (or learn them), once
            if not self._c_fill(r, hit):
                learned = self._c_learn(ids, r, hit)
                if learned is None:
                    return _Reference(self._c_whole(ids, policy, strict))
                if not learned:
                    return None
            r = _speedups.run(plan, ids, hit[1], hit[2], out, False, True)
        if type(r) is tuple and len(r) == 2 and type(r[0]) is int:
            # the last turn may be a generation prompt (the driver's rule decides); r[1] is
            # the answer when it is not
            if not self._c_not_gen_prompt(ids, r[0]):
                return None
            r = r[1]
        return r if type(r) is list or r is True else None

    def _c_auto(self, need: bytes) -> bool:
        """Fill the automaton's table where the C walk stopped (``need``: the configuration,
        then the symbols from there to the end, as ``_speedups.run`` returns them) and the
        end of input from where they lead. One lookup per symbol, as :meth:`_walk`; False on
        a syntax error or an entry the automaton does not memoise (the Python engine then
        takes the sample and reports it)."""
        auto = self.auto
        sid = int.from_bytes(need[:8], sys.byteorder, signed=True)
        table = auto.table
        for sym in np.frombuffer(need, dtype=np.uint16, offset=8).tolist():
            v = table[sid][sym]
            if v is None:
                v = auto.fill(sid, sym)
            if v < 0:
                return False
            sid = v >> 3
        auto.end(sid)
        return True

    def _c_torch(self, ids, policy: MaskPolicy, strict: bool):
        """A 1-D CPU tensor read through numpy (no copy for a contiguous int64 one): the C
        executor's mask as a ``torch.long`` tensor, or None (the Python engine takes it).
        torch is already imported by whoever made the tensor; chatgrammar never imports it."""
        torch = sys.modules.get("torch")
        if torch is None or type(ids) is not torch.Tensor:
            return None
        try:
            if ids.device.type != "cpu" or ids.dim() != 1 or ids.is_floating_point() \
                    or ids.is_complex() or ids.dtype == torch.bool:
                return None
            a = np.ascontiguousarray(ids.numpy(), dtype=np.int64)
        except (RuntimeError, TypeError, ValueError):
            return None
        m = self.run_c(a, policy, strict)
        if m is None:
            return None
        return torch.from_numpy(m)

    def _alias(self, key: bytes) -> bytes | None:
        """The key of an item cut inside the header of its last marker (one of
        ``cut_codes``: an opener, or a close marker with a close header) with that header's
        ids replaced by what the parse reads of them (:meth:`Driver.cut_reading` of the text
        the lexer gives it); None for any other item."""
        if not self.cut_codes or len(key) < 32:
            return None
        a_off, nslots, tail = _KEY_HEAD.unpack_from(key)
        if tail < 0:
            return None
        nsym = (a_off + nslots - 1) // 3 + 1
        mend = 24 + 8 * nsym
        last = int.from_bytes(key[mend - 8:mend], sys.byteorder, signed=True)
        sym, vlen = last >> 16, last & 0xFFFF
        code = sym >> 2
        if code not in self.cut_codes or (sym & 3) not in (NONE, RUN):
            return None
        # (a new cut item asks for its alias three times: C's fill, the learn, its memo entry)
        got = self._alias_of.get(key)
        if got is not None:
            return got
        if len(self._alias_of) >= 1024:
            self._alias_of.clear()
        m = int(self.budget[code])
        take = min(vlen, m)
        vals = np.frombuffer(key, dtype=np.int64, count=take, offset=len(key) - 8 * take)
        # the text the reference lexer reads there (the plan's rule, from the key's ids)
        text = self.lexplan.header_value(vals, 0, vlen, m) if take else \
            ("\u2026" if vlen > m else "")
        reading = self.drv.cut_reading(self.cut_codes[code], text)
        got = self._alias_of[key] = b"".join((
            b"cut-header\0", key[:mend - 8], (sym << 16).to_bytes(8, sys.byteorder, signed=True),
            key[mend:len(key) - 8 * take], repr(reading).encode()))
        return got

    def _resolve(self, key: bytes):
        """The memoised item of ``key`` through its :meth:`_alias` (registered under ``key``
        too), or None."""
        alias = self._alias(key)
        if alias is None:
            return None
        it = self.items.get(alias)
        if it is None or it.plan or it.unstable:
            return None
        self.items[key] = it
        self.stats["alias"] += 1
        return it

    def _c_fill(self, keys: list, hit: tuple) -> bool:
        """The C records of memoised items the C memo lacks (they were learned, but not
        used under this policy yet). False when one is not memoised (a new item shape)."""
        policy, cm, _, base = hit
        pid = self._pid(base)
        for key, _w0, _w1, _a in keys:
            it = self.items.get(key) or self._resolve(key)
            if it is None or it.plan or it.unstable:
                return False
            prog = it.progs.get(())
            if prog is None:
                return False
            sp = prog.by_policy.get(pid) or self._policy_spans(prog, base, pid)
            if sp is None:
                return False
            cm[key] = _c_record(prog, sp)
        return True

    def _c_learn(self, ids, keys: tuple, hit: tuple) -> bool | None:
        """New item shapes: each learned by a full parse of the window of ids around it the
        C executor gives (as :meth:`_learn_window` does), then filled as in
        :meth:`_c_fill`. False when the memo still lacks one (the Python engine takes the
        sample); None when a new item's window is the whole sample (or the sample is short):
        the full pipeline must parse the sample itself (:meth:`_c_whole`)."""
        n = len(ids)
        items = self.items
        for key, w0, w1, a in keys:
            if key in items or self._resolve(key) is not None:
                continue
            canon = self._canon
            if canon is not None and w1 == n and a > w0 and key[16:24] != b"\xff" * 8:
                # An item cut by the end of input: its key holds everything its parse
                # depends on, so any short whole first item can stand before it (a window
                # that does not teach the key falls back to the real one below).
                self._learn_from(np.concatenate([canon, ids_input(ids[a:w1])[0]]))
                if key in items:
                    continue
            if n < _WINDOW_MIN or w1 - w0 >= n:
                return None  # the window is the sample: the full pipeline parses it
            # (only the window's ids are converted: a 1M-token sample is not read again)
            if not self._learn_from(np.array(ids_input(ids[w0:w1])[0])):
                return False
        return self._c_fill(keys, hit)

    def _learn_from(self, window: np.ndarray) -> bool:
        """Teach the memo the items of ``window`` (a full parse, lenient); False when it
        does not parse."""
        self.stats["window"] = self.stats.get("window", 0) + 1
        try:
            self._harvest(window, self.fmt.default_policy, False, mask=False)
        except ParseError:
            return False
        return True

    def _c_whole(self, ids, policy: MaskPolicy, strict: bool):
        """A sample with a new item shape that no window can teach: the full pipeline (the
        reference) computes its mask, as :meth:`_slow_sample` would after the numpy
        executor's walk, and teaches the memo. Errors are the user's."""
        self.stats["slow"] += 1
        why = "new item shape"
        self.reasons[why] = self.reasons.get(why, 0) + 1
        arr = ids_input(ids)[0]
        out, _ = self._harvest(arr, policy, strict)
        if type(ids) is list:
            return list(out)
        return np.frombuffer(out, dtype=np.uint8).astype(np.int64)

    def _c_not_gen_prompt(self, ids, start: int) -> bool:
        """True when the tail from ``start`` is certainly no generation prompt: decoding is
        byte-concatenative here (``concat_decode``), so the driver's per-run join can equal
        a prompt only if one decode of the whole tail does (as in _generation_prompt)."""
        if not self.concat_decode:
            return False
        tail = ids[start:]
        return self.adapter.decode(tail if type(tail) is list else tail.tolist()) \
            not in self.drv.gen_prompts

    def _c_policy(self, policy: MaskPolicy) -> tuple:
        # last_turn_only selects among the turns the base policy trains (as _fast does)
        last = policy.last_turn_only
        base = policy.replace(last_turn_only=False) if last else policy
        cm = self.cmemo.get(self._pid(base))
        if cm is None:
            if len(self.cmemo) > 64:
                for d in self.cmemo.values():
                    d.clear()
            cm = self.cmemo[self._pid(base)] = {}
        if len(self._cpol) > 256:
            self._cpol.clear()
        hit = self._cpol[id(policy)] = (policy, cm, last, base)
        return hit

    # ------------------------------------------------------------------ public
    def mask(self, arr: np.ndarray, lst, policy: MaskPolicy, strict: bool,
             tokenizer: Any):
        """The mask of one sample — a ``list[int]`` when the input was a list (``lst``), else
        a 0/1 bytearray — exactly ``parse_ids(...).mask_array(policy)``."""
        return self.masks_flat(arr, [0, len(arr)], policy, strict, as_list=lst is not None)[0]

    def masks(self, batch, policy: MaskPolicy, strict: bool, tokenizer: Any, *,
              roles: list | None = None, errors: list | None = None) -> list:
        """Masks of many samples (see :meth:`chatgrammar.Format.loss_masks`): one conversion
        and one vectorised marker pass over the concatenated batch. ``roles`` / ``errors``
        as in :meth:`masks_flat` (a failed sample's mask is None)."""
        batch = list(batch)
        if roles is not None:
            roles[:] = []
        if errors is not None:
            errors[:] = []
        if not batch:
            return []
        lens = [len(x) for x in batch]
        if len(batch) > 1 and sum(lens) > _BATCH_TOKENS:
            # Groups of about _BATCH_TOKENS: the per-token passes then run in cache, and the
            # per-call overhead is still paid once per many samples.
            out: list = []
            i = 0
            while i < len(batch):
                j, n = i, 0
                while j < len(batch) and (j == i or n + lens[j] <= _BATCH_TOKENS):
                    n += lens[j]
                    j += 1
                r = [] if roles is not None else None
                e = [] if errors is not None else None
                out += self.masks(batch[i:j], policy, strict, tokenizer, roles=r, errors=e)
                if r is not None:
                    roles += r
                if e is not None:
                    errors += e
                i = j
            return out
        all_lists = all(type(x) is list for x in batch)
        if all_lists:
            arr = _pack_many(batch, lens)
        else:
            arrs = [ids_input(x)[0] for x in batch]
            arr = np.concatenate(arrs)
            lens = [len(a) for a in arrs]
        starts = [0, *itertools.accumulate(lens)]
        out = self.masks_flat(arr, starts, policy, strict, as_list=all_lists, roles=roles,
                              errors=errors)
        if all_lists:
            return out
        return [None if m is None else mask_like(x, m) for x, m in zip(batch, out)]

    def masks_flat(self, arr: np.ndarray, starts: list[int], policy: MaskPolicy,
                   strict: bool, *, roles: list | None = None,
                   errors: list | None = None, as_list: bool = False) -> list:
        """Masks of the samples ``arr[starts[j]:starts[j + 1]]`` (0/1 bytearrays, or lists
        of ints with ``as_list``).

        Args:
            as_list: build ``list[int]`` masks directly (what list callers get back).
            roles: if given, ``roles[j]`` is set to the list of sample ``j``'s turn roles.
            errors: if given, a sample whose parse raises gets ``None`` as its mask and its
                exception in ``errors[j]`` (instead of the exception propagating).
        """
        S = len(starts) - 1
        lexed = self._lex(arr, starts) if self.enabled else None
        outs: list = [None] * S
        if roles is not None:
            roles[:] = [None] * S
        if errors is not None:
            errors[:] = [None] * S
        why: list = [self.disabled] * S if lexed is None else lexed[-1]
        if lexed is not None:
            pid = self._pid(policy)
            for j in range(S):
                if why[j]:  # the lexer says this sample needs the full pipeline
                    continue
                got = [] if roles is not None else None
                spans = self._fast(arr, starts, j, lexed, policy, pid, got)
                if spans is None and self._why == "new item shape" and \
                        self._learn_window(arr, starts, j, lexed):
                    got = [] if roles is not None else None
                    spans = self._fast(arr, starts, j, lexed, policy, pid, got)
                if spans is None:
                    why[j] = self._why
                    continue
                outs[j] = _mask_of(starts[j + 1] - starts[j], spans, as_list)
                self.stats["fast"] += 1
                if roles is not None:
                    roles[j] = got
        check = verify_enabled()
        for j in range(S):
            if outs[j] is None:
                self._slow_sample(arr, starts, j, why[j], policy, strict, outs, roles, errors,
                                  as_list)
            elif check:
                self.verify_lex(arr, starts, j, lexed)
                self._verify(arr[starts[j]:starts[j + 1]], outs[j], policy, strict)
        return outs

    def _learn_window(self, arr, starts, j, lexed) -> bool:
        """A new item shape in a long sample: the full pipeline parses a window of the
        sample — from the item before the new one to the end of the item after it (or the
        sample's end) — and the memo learns its items, instead of parsing the whole sample.
        An item's key holds everything its parse depends on, so what a window teaches is
        what the whole sample would (the same rule that lets one sample teach another).
        True when the window parsed cleanly."""
        prev, b, bounds = self._miss
        B = lexed[4]
        s0, n = starts[j], starts[j + 1]
        if n - s0 < _WINDOW_MIN:
            return False
        k = bounds.index(b)
        w0 = B[prev]
        w1 = B[bounds[k + 1]] if k + 1 < len(bounds) else n
        if w1 - w0 >= n - s0:
            return False  # the window is the sample: the full pipeline parses it anyway
        self.stats["window"] = self.stats.get("window", 0) + 1
        try:
            self._harvest(arr[w0:w1], self.fmt.default_policy, False)
        except ParseError:
            return False
        return True

    def _slow_sample(self, arr, starts, j, why, policy, strict, outs, roles, errors,
                     as_list) -> None:
        """Sample ``j`` through the full pipeline (the reference semantics), counted by why."""
        self.stats["slow"] += 1
        reason = why or "unknown"
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        a = arr[starts[j]:starts[j + 1]]
        try:
            outs[j], turns = self._harvest(a, policy, strict)
        except Exception as exc:
            if errors is None or not isinstance(exc, ParseError):
                raise
            errors[j] = exc
            return
        if as_list:
            outs[j] = list(outs[j])
        if roles is not None:
            roles[j] = [t.role for t in turns]

    def _verify(self, a: np.ndarray, got, policy: MaskPolicy, strict: bool) -> None:
        """``CHATGRAMMAR_VERIFY=1``: the fast answer against the full pipeline (no memo)."""
        self.stats["verified"] = self.stats.get("verified", 0) + 1
        fmt = self.fmt
        try:
            want = fmt.parse_ids(a, self.adapter, strict=strict).mask_array(policy).tolist()
        except ParseError as exc:
            raise VerifyError(f"{fmt.name}: the fast path gave a mask where the reference "
                              f"raises {exc}") from exc
        if list(got) != want:
            diff = next(i for i, (x, y) in enumerate(zip(list(got), want)) if x != y)
            raise VerifyError(f"{fmt.name}: fast mask differs from the reference at token "
                              f"{diff} of {len(want)} (policy {policy}, strict={strict})")

    def _pid(self, policy: MaskPolicy) -> int:
        # policies are frozen dataclasses whose hash is recomputed on every call: look the
        # object up by identity first (the object is kept, so its id is never reused)
        hit = self._policy_by_obj.get(id(policy))
        if hit is not None and hit[0] is policy:
            return hit[1]
        pid = self._policy_ids.get(policy)
        if pid is None:
            pid = self._policy_ids[policy] = len(self._policy_ids)
        if len(self._policy_by_obj) > 256:
            self._policy_by_obj.clear()
        self._policy_by_obj[id(policy)] = (policy, pid)
        return pid

    # ------------------------------------------------------------------ lexing
    def _lex(self, arr: np.ndarray, starts: list[int]):
        """Vectorised lexing of all samples at once. Per marker (each sample's begin-of-input
        included): its symbol, its header ids (the key), its slot positions."""
        S = len(starts) - 1
        cand, codes = self.lexplan.find(arr, self.lo, self.hi, self.lutr, _speedups)
        slow: list = [None] * S  # per sample: None, or why it needs the full pipeline
        if self.unk_code and len(codes):
            unk = codes == self.unk_code
            if unk.any():  # a marker the format does not know: the full parse judges it
                for j in set(np.searchsorted(starts, cand[unk], side="right").tolist()):
                    if 1 <= j <= S:
                        slow[j - 1] = "a special id the format does not know"
                keep = ~unk
                cand, codes = cand[keep], codes[keep]
        if self.soft_lut is not None:
            body = arr[(arr >= 0) & (arr < len(self.soft_lut))]
            if self.soft_lut[body].any():  # a soft marker may be spelled by ordinary ids
                hits = np.flatnonzero(self.soft_lut[np.clip(arr, 0, len(self.soft_lut) - 1)]
                                      & (arr >= 0) & (arr < len(self.soft_lut)))
                for j in set(np.searchsorted(starts, hits, side="right").tolist()):
                    if 1 <= j <= S:
                        slow[j - 1] = "soft marker may be spelled in a content run"
        return self._symbols(arr, starts, cand, codes, slow)

    def _symbols(self, arr, starts, cand, codes, slow):
        """The symbol tables of :meth:`_lex` from the marker positions and codes: the plan's
        one stream builder (:meth:`IdPlan.stream`, which hands back in ``slow`` what this
        executor does not take), then the memo's view of it (:meth:`_tables`). The C
        executor's pass (``find_symbols`` in ``_speedups.c``: the same steps over the same
        arrays) is checked against it (:meth:`verify_lex`)."""
        return self._tables(arr, self.lexplan.stream(arr, starts, cand, codes, handback=slow),
                            slow)

    def _tables(self, arr, st, slow):
        """The memo's tables of a symbol stream (the plan's last step; C ``step_tables``):
        per entry its symbol (``code * 4`` + the run's shape), its meta word and header ids
        (the item key: a ``DECODE`` run's first ``budget`` ids, and whether it is longer, as
        :meth:`IdPlan.header_value` reads it, except a header nothing reads
        (:attr:`IdPlan.value_free`), whose length class alone is its meta word's length:
        0 empty, 1 within the budget, 2 longer; a split header's ids; nothing of a content
        run), its slots (marker start, run start, header end)."""
        P, Kx, mend = st.P, st.K, st.mend
        N = len(arr)
        T = len(Kx)
        glen = P[1:] - mend
        sym = Kx * 4 + (glen > 0)
        split_at = st.hend
        if self.has_split:
            sp = st.sst == 1  # (the builder applies exact ends only for an executor)
            sym[sp] = Kx[sp] * 4 + np.where(split_at[sp] < P[1:][sp], HEAD_RUN, HEAD)
        if self.has_values:
            dec = st.cls == DECODE
            bud = np.where(dec, self.budget[Kx], 0)
            take = np.minimum(glen, bud)
            vlen = np.minimum(glen, bud + dec)
            if self.vfree is not None:
                # a header nothing reads (IdPlan.value_free): its length class alone
                fr = dec & self.vfree[Kx]
                take[fr] = 0
                vlen[fr] = (glen[fr] > 0).astype(np.int64) + (glen[fr] > bud[fr])
            if self.has_split:
                sp = st.cls == SPLIT
                take[sp] = vlen[sp] = (split_at - mend)[sp]
            off = np.zeros(T + 1, dtype=np.int64)
            np.cumsum(take, out=off[1:])
            total = int(off[-1])
            if total:
                sel = np.flatnonzero(take)
                gidx = np.repeat(mend[sel] - off[sel], take[sel]) + np.arange(total)
                vals = arr[gidx].tobytes()
            else:
                vals = b""
            meta = (sym * 65536 + vlen).tobytes()
            off_l = off.tolist()
        else:
            vals = b""
            meta = sym.tobytes()
            off_l = None
        symb = sym.astype(np.uint16).tobytes()
        slots = np.empty((T, 3), dtype=np.int64)
        slots[:, 0] = P[:-1]
        slots[:, 1] = mend
        slots[:, 2] = split_at
        B = slots.ravel().tolist()
        B.append(N)
        bl = [0, T] if st.bidx is None else [*st.bidx.tolist(), T]
        return symb, meta, vals, off_l, B, bl, slow

    # ------------------------------------------------------------------ fast masks
    def _walk(self, lexed, j):
        """Sample ``j`` through the memoised automaton: ``(bounds, tail)``, the item bounds
        (slot indices; the last is the sample's end) and, when the input ends inside an
        item (truncation), the configuration it ends in (else None). None on a syntax error
        (the full pipeline reports it or recovers)."""
        symb, bl = lexed[0], lexed[5]
        b0, b1 = bl[j], bl[j + 1]
        G = GRAM
        chunk = symb[2 * b0:2 * b1]
        rem = (b1 - b0) % G
        if rem:
            chunk += self.pad[:2 * (G - rem)]
        auto = self.auto
        tg = auto.tgram
        sid = 0
        bounds: list[int] = []
        base = 3 * b0
        for k in range(0, len(chunk), 2 * G):
            g = chunk[k:k + 2 * G]
            v = tg[sid].get(g)
            if v is None:
                v = auto.fill_gram(sid, g)
            if v < 0:
                return None
            sid = v >> FLAG_BITS
            f = v & FLAG_MASK
            if f:
                # bit 3t + s: an item ended before sub-token s of the gram's symbol t
                slot = base + 3 * (k >> 1)
                while f:
                    low = f & -f
                    bounds.append(slot + low.bit_length() - 1)
                    f ^= low
        hit = auto.end_flags[sid]
        if hit is None:
            auto.end(sid)
            hit = auto.end_flags[sid]
        if hit == -1:
            # end of input inside an item: that item, closed as the driver closes a cut
            # input, is memoised like any other, keyed also by the configuration it ends in
            if bounds and bounds[-1] >= 3 * b1:
                return None
            bounds.append(3 * b1)
            return bounds, sid
        if hit:
            bounds.append(3 * b1)
        return bounds, None

    def _fast(self, arr, starts, j, lexed, policy, pid, roles=None):
        """Sample ``j``'s trained spans (sample-local ``(start, end, turn)``), or None when it
        needs the full pipeline (``self._why`` says why)."""
        walked = self._walk(lexed, j)
        if walked is None:
            self._why = "syntax error (strict raises, lenient recovers)"
            return None
        bounds, tail = walked
        B, bl = lexed[4], lexed[5]
        n, s0 = starts[j + 1], starts[j]
        last_only = policy.last_turn_only
        if last_only:
            policy = policy.replace(last_turn_only=False)
            pid = self._pid(policy)
        spans: list = []
        chosen: list = []   # global index of each turn the policy selects
        think: set = set()  # those of them that are reasoning turns (last_run keeps them)
        last = None
        nturn = 0
        a = 3 * bl[j]
        items = self.items
        cm = self.cmemo.get(pid) if self.plan is not None else None
        meta, vals, off = lexed[1], lexed[2], lexed[3]
        end = bounds[-1] if bounds else -1
        prev = a
        for b in bounds:
            if b <= a:
                continue
            key = _item_key(meta, vals, off, a, b, tail if b == end else None)
            it = items.get(key)
            if it is None and b == end and tail is not None:
                it = self._resolve(key)
            prog = None
            if it is not None and not it.plan and not it.unstable:
                prog = it.progs.get(())
            if prog is None:
                prog = self._prog(arr, lexed, it, a)  # (says why when it has none)
                if prog is None:
                    self._miss = (prev, b, bounds)  # where: see _learn_window
                    return None
            sp = prog.by_policy.get(pid)
            if sp is None:
                sp = self._policy_spans(prog, policy, pid)
                if sp is None:
                    self._why = "a span edge outside the item's slots"
                    return None
            if cm is not None and not it.plan and key not in cm:
                cm[key] = _c_record(prog, sp)  # the C executor's view of this memo entry
            if prog.turns:
                last = (prog, a, nturn)
                if roles is not None:
                    roles.extend(t.role for t in prog.turns)
            for ra, da, rb, db, t in sp[0]:  # sample-local positions
                spans.append((B[a + ra] + da - s0, B[a + rb] + db - s0, nturn + t))
            if last_only:
                chosen.extend([nturn + t for t in sp[1]])
                think.update(nturn + t for t in sp[1] if prog.turns[t].block.kind == "think")
            nturn += len(prog.turns)
            prev, a = a, b
        if last is not None and self.drv.gen_prompts:
            prog, pbase, first = last
            tslot = pbase + prog.starts[-1]
            start = B[tslot]
            if n - start <= 64 and self._generation_prompt(arr, B, tslot, start, s0, n):
                final = nturn - 1
                spans = [s for s in spans if s[2] != final]
                if chosen and chosen[-1] == final:
                    chosen.pop()
        if last_only:
            keep = set(last_run(chosen, think.__contains__))  # (the policy's one rule)
            spans = [s for s in spans if s[2] in keep]
        return spans

    def _prog(self, arr, lexed, it, a: int):
        """The memoised turns of the item ``it`` starting at slot ``a`` (its read plan read
        from this input), or None (``self._why``)."""
        if it is None:
            self._why = "new item shape"
            return None
        prog, why = it.find(_read_key, arr, lexed[4], a)
        if prog is None:
            self._why = why
        return prog

    def _policy_spans(self, prog: _Prog, policy: MaskPolicy, pid: int):
        # The item's own turns through Conversation.spans: policy semantics live in one place.
        conv = Conversation(format=self.fmt.name, mode="ids", length=1 << 62, turns=prog.turns,
                            warnings=[], boundaries=[], default_policy=policy)
        out = []
        for s in conv.spans(policy):
            ra, rb = prog.place(s.start), prog.place(s.end)
            if ra is None or rb is None:
                return None
            if out and out[-1][4] == s.turn and out[-1][2:4] == ra:  # abutting: one span
                out[-1] = (*out[-1][:2], *rb, s.turn)
            else:
                out.append((*ra, *rb, s.turn))
        # the turns last_turn_only chooses among (Conversation's own selection)
        res = (tuple(out), tuple(conv.trained_turns(policy)))
        if len(prog.by_policy) > 64:
            prog.by_policy.clear()
        prog.by_policy[pid] = res
        return res

    def _generation_prompt(self, arr, B, slot: int, start: int, s0: int, n: int) -> bool:
        """The driver's own generation-prompt rule, on the tokens from the last turn's start
        (sample-local positions, as the driver sees them)."""
        if self.concat_decode:
            # Decoding is byte-concatenative here: the driver's per-run join can equal a
            # generation prompt (which holds no U+FFFD) only if one decode of the whole tail
            # does.
            if self.adapter.decode(arr[start:n].tolist()) not in self.drv.gen_prompts:
                return False
        toks = []
        j = slot
        while B[j] < n:
            s, e = B[j], B[j + 1]
            if e > s:
                toks.append((TEXT, s - s0, e - s0, None))
            j += 1
        fake = _FakeTurn(start - s0)
        src = Source("ids", n - s0, arr=arr[s0:n], adapter=self.adapter)
        self.drv._mark_generation_prompt([fake], src, toks)
        return fake.generation_prompt

    # ------------------------------------------------------------------ slow path + memo
    def _harvest(self, arr, policy, strict, mask: bool = True) -> tuple[bytearray, list]:
        """The full pipeline for one sample (its errors are the user's); a clean parse also
        teaches the memo the items it contains. ``mask=False``: only learn (the mask is
        None)."""
        fmt, lx = self.fmt, self.lx
        warnings: list[Issue] = []
        boundaries: list = []
        src = _RecordingSource("ids", len(arr), arr=arr, adapter=lx.adapter,
                               boundaries=boundaries)
        toks = lx.lex(arr, boundaries)
        src.recording = True
        # (cut items fill the memo faster than whole ones: past half its bound, only those)
        cuts = self._prefix_cuts(arr, toks) \
            if self.prefix_ok and len(self.items) < _MAX_ITEMS // 2 else None
        saves = None if not cuts else [c[0] for c in cuts]
        # (a parse only to learn leaves generation prompts unmarked: _learn_item stores every
        # turn unmarked, and each answer applies the driver's rule to its own last turn)
        turns = self.drv.run(toks, src, strict, warnings, gen_prompt=mask, saves=saves)
        conv = Conversation(format=fmt.name, mode="ids", length=len(arr), turns=turns,
                            warnings=warnings, boundaries=[Issue(p, m) for p, m in boundaries],
                            default_policy=fmt.default_policy)
        out = bytearray(conv.mask_array(policy).tobytes()) if mask else None
        if self.enabled and not warnings and not boundaries:
            try:
                self._learn(arr, toks, turns, src.reads, cuts and (cuts, saves))
            except _NoCache:
                pass
        return out, turns

    def _prefix_cuts(self, arr, toks) -> list | None:
        """The prefixes of a short input whose last item the memo does not hold yet, ending
        right after a marker or after the run that follows it (where ``max_length`` cuts,
        at every symbol boundary): ``(token index, item key)`` each, at most
        ``_PREFIX_LEARN``. Keyed as :meth:`_walk` keys the last item: the symbols up to
        there, the last one without its run when the cut is right after its marker, and the
        configuration they end in when that is inside an item (else the item is whole
        there: an element whose ``after`` markers are left out). None (nothing learned)
        while nearly every sample needs a learning parse (:meth:`_learn_cuts`; ``stats()``
        counts such parses as ``cut_skip``)."""
        if len(toks) > _PREFIX_TOKENS:
            return None
        if not self._learn_cuts():
            self.stats["cut_skip"] = self.stats.get("cut_skip", 0) + 1
            return None
        lexed = self._lex(arr, [0, len(arr)])
        if lexed[-1][0]:
            return None
        syms = np.frombuffer(lexed[0], dtype=np.uint16).tolist()
        meta, vals, off = lexed[1], lexed[2], lexed[3]
        auto, items = self.auto, self.items
        table = auto.table
        out: list = []
        sid, ends, k = 0, [], 0  # configuration, item bounds so far, tokens so far
        for t, sym in enumerate(syms):
            shape = sym & 3
            if shape not in (NONE, RUN):
                return None
            code = sym >> 2
            k += code > 0
            for bare in ((True, False) if shape == RUN and code else (False,)):
                s = sym - RUN if bare else sym
                v = table[sid][s]
                if v is None:
                    v = auto.fill(sid, s)
                if v < 0:
                    return None
                cut = ends + [3 * t + bit for bit in range(3) if v >> bit & 1]
                if not bare:
                    sid, ends = v >> 3, cut  # (the walk goes on with the symbol as it is)
                n_tok = k + (not bare and shape == RUN)
                clean = auto.end(v >> 3)
                if clean is False or n_tok >= len(toks):
                    continue  # no item ends there, or it is the whole input
                # (a clean end: the last item is whole there, `after` markers left out)
                tail = -1 if clean else v >> 3
                a = cut[-1] if cut else 0
                ia = a // 3
                if bare:  # the symbol without its run: no header ids
                    word = s * 65536 if off is not None else s
                    key = b"".join((
                        _KEY_HEAD.pack(a - 3 * ia, 3 * t + 3 - a, tail), meta[8 * ia:8 * t],
                        word.to_bytes(8, sys.byteorder, signed=True),
                        b"" if off is None else vals[8 * off[ia]:8 * off[t]]))
                else:
                    key = _item_key(meta, vals, off, a, 3 * t + 3, None if clean else tail)
                if key not in items:
                    out.append((n_tok, key))
            k += shape == RUN
        return out[:_PREFIX_LEARN]

    def _learn_cuts(self) -> bool:
        """Whether learning parses learn their cut items now: always for the first
        ``_LEARN_WARM``; then, at the end of each stretch of ``_LEARN_STRETCH`` learning
        parses, yes when at most ``_LEARN_RATE`` of the samples seen in it needed one (the
        memo's items repeat, so its cut items will be asked for), no when nearly every sample
        is learned (items that never repeat)."""
        st = self.stats
        h, n = st["harvest"], st["fast"] + st["slow"]
        if h < _LEARN_WARM:
            return True
        h0, n0 = self._stretch
        if h - h0 >= _LEARN_STRETCH:
            self._cuts_on = h - h0 <= _LEARN_RATE * max(n - n0, 1)
            self._stretch = (h, n)
        return self._cuts_on

    def _learn(self, arr, toks, turns, reads, pre=None) -> None:
        lexed = self._lex(arr, [0, len(arr)])
        if lexed[-1][0]:
            raise _NoCache
        B = lexed[4]
        syms = np.frombuffer(lexed[0], dtype=np.uint16).tolist()
        if not self._same_tokens(toks, syms, B):
            # the lexer does something this model does not: say so (stats, verify mode)
            self._disable("the vectorised lexer disagrees with the reference lexer")
            if verify_enabled():
                raise VerifyError(f"{self.fmt.name}: {self.disabled}")
            raise _NoCache
        walked = self._walk(lexed, 0)
        if walked is None:
            raise _NoCache
        bounds, tail = walked
        self.stats["harvest"] += 1
        if bounds and bounds[0] > 0 and (len(bounds) > 1 or tail is None):
            # a short whole first item: what stands before a cut item in _c_learn's windows
            e0 = B[bounds[0]]
            if e0 <= 64 and (self._canon is None or e0 < len(self._canon)):
                self._canon = np.array(arr[:e0], dtype=np.int64)
        segs, per_seg, reads_seg = _segments(bounds, B, turns, reads)
        for (a, b), sturns, sreads in zip(segs, per_seg, reads_seg):
            self._learn_item(arr, lexed, a, b, tail if b == bounds[-1] else None, sturns,
                             sreads)
        if pre and len(pre[0]) == len(pre[1]):
            # each cut this parse passed, learned now from the configuration saved there
            # (kept, they would hold every parse's stacks; learned, a cut item is ~1 KB)
            for (k, key), sv in zip(*pre):
                self._learn_cut(key, (sv, arr, toks, reads, k))

    def _learn_cut(self, key: bytes, got: tuple) -> bool:
        """Truncation as a case of the core: the cut item ``key``, if an earlier parse passed
        that cut (:meth:`_prefix_cuts`), learned from the configuration the driver saved
        there (:meth:`Driver.resume` feeds the end of input as a parse of that prefix
        would), not from a parse of a window. Keyed from the prefix's own symbol tables
        (checked against the reference tokens up to there); the default policy's record is
        written for the C executor at once. ``got``: the saved configuration, the parsed
        input, its tokens, its reads and the prefix's token count. False when not learned.

        Raises:
            VerifyError: (``CHATGRAMMAR_VERIFY=1``) the prefix's symbols do not describe the
                input's tokens up to there."""
        if key in self.items:
            return False
        sv, arr, toks, reads, k = got
        e = toks[k - 1][2]
        pre = arr[:e]
        lexed = self._lex(pre, [0, e])
        walked = self._walk(lexed, 0)
        if walked is None or lexed[-1][0]:
            return False
        bounds, tail = walked
        B = lexed[4]
        a = bounds[-2] if len(bounds) > 1 else 0
        if _item_key(lexed[1], lexed[2], lexed[3], a, bounds[-1], tail) != key:
            return False
        if verify_enabled() and not self._same_tokens(
                toks[:k], np.frombuffer(lexed[0], dtype=np.uint16).tolist(), B):
            # (_prefixes_apply's conditions make the prefix's tokens the input's up to there)
            raise VerifyError(f"{self.fmt.name}: a prefix's tokens are not the input's")
        warnings: list = []
        bnd: list = []
        src = _RecordingSource("ids", e, arr=pre, adapter=self.lx.adapter, boundaries=bnd)
        src.recording = True
        try:
            turns = self.drv.resume(sv, src, warnings)
            if warnings or bnd:
                return False
            _, per_seg, reads_seg = _segments(bounds, B, turns, reads[:sv.nreads] + src.reads)
            self._learn_item(pre, lexed, a, bounds[-1], tail, per_seg[-1], reads_seg[-1])
        except (ParseError, _NoCache):
            return False
        self.stats["resumed"] = self.stats.get("resumed", 0) + 1
        it = self.items.get(key)
        prog = None if it is None or it.plan or it.unstable else it.progs.get(())
        cm = self.cmemo.get(self._pid(self.fmt.default_policy)) if self.plan else None
        if cm is not None and prog is not None:
            base = self.fmt.default_policy
            sp = prog.by_policy.get(self._pid(base)) or \
                self._policy_spans(prog, base, self._pid(base))
            if sp is not None:
                cm[key] = _c_record(prog, sp)
        return prog is not None

    def _learn_item(self, arr, lexed, a, b, tail, sturns, sreads) -> None:
        B, off = lexed[4], lexed[3]
        key = _item_key(lexed[1], lexed[2], off, a, b, tail)
        plan, slot_of = _read_plan(B, a, b, sreads)
        new = key not in self.items
        it = _Item.of(self.items, key, plan, self.forget)
        if it is not None and new and tail is not None and not plan:
            alias = self._alias(key)
            if alias is not None:
                self.items.setdefault(alias, it)
        rkey = () if it is None else \
            tuple([_read_key(arr, B, a + s, a + e, lim) for s, e, lim in plan])
        if it is None or not it.wants(rkey):
            if it is None or it.unstable:
                self._forget_key(key)  # (the C executor's view of it too)
            return
        # (the harvested turns are the memo's own: only a generation prompt needs a copy)
        cturns = [dataclasses.replace(t, generation_prompt=False) if t.generation_prompt else t
                  for t in sturns]
        try:
            tstarts = [slot_of[t.start] for t in sturns]
        except KeyError:
            raise _NoCache from None
        ia, ib = a // 3, (b - 1) // 3 + 1
        # keyed runs (decoded headers): what the parse reads of them is in the key
        runs = () if off is None else tuple(
            (B[3 * i + 1], 3 * i + 1 - a, off[i + 1] - off[i]) for i in range(ia, ib)
            if off[i + 1] > off[i] and a <= 3 * i + 1 <= b)
        # and the ids the parse read (a `lead` literal, a header position): in the key too
        runs += tuple((B[a + ks], ks, _read_len(B[a + ks], B[a + ke], lim))
                      for ks, ke, lim in plan)
        it.progs[rkey] = _Prog(cturns, tstarts, slot_of, runs)

    def verify_lex(self, arr: np.ndarray, starts: list[int], j: int, lexed) -> bool:
        """Sample ``j``'s symbol tables (``lexed``, from :meth:`_lex`: the C ``symbols``
        pass, or the stream builder over a batch) against the one stream builder's on that
        sample alone (:meth:`IdPlan.stream`, as the reference lexer runs it): the same
        symbols, slots, key words and header ids; the reference's tokens read from that
        stream (:meth:`IdPlan.tokens`) are the ones the symbols describe, and every header
        text they hold is the one the item key determines (its ids, read within the
        budget). ``CHATGRAMMAR_VERIFY=1`` runs it on every fast sample, the C executor's
        included; tests/test_one_engine.py on every bundled format's fixtures. False when the
        sample is the reference's alone (the executors hand it back: soft markers,
        straddles, …).

        Raises:
            VerifyError: on any difference.
        """
        if lexed[-1][j] or (self.lx.soft_regex is not None and self.soft_lut is None):
            return False  # (soft markers the executors cannot search for: all handed back)
        s0 = starts[j]
        a = arr[s0:starts[j + 1]]
        b0, b1 = lexed[5][j], lexed[5][j + 1]
        syms = np.frombuffer(lexed[0], dtype=np.uint16)[b0:b1].tolist()
        B = [x - s0 for x in lexed[4][3 * b0:3 * b1 + 1]]
        boundary: list = []
        st = self.lx.stream(a, boundary)
        want = self._tables(a, st, [None])
        off = lexed[3]
        ok = (not boundary and want[0] == lexed[0][2 * b0:2 * b1]
              and want[1] == lexed[1][8 * b0:8 * b1] and want[4] == B
              and (off is None or want[2] == lexed[2][8 * off[b0]:8 * off[b1]]))
        toks = self.lexplan.tokens(a, st) if ok else None
        ok = ok and self._same_tokens(toks, syms, B)
        if ok and self.has_values:
            # (None: a header nothing reads, keyed by its length class, checked by the tables)
            got = [t[3] for t in toks if t[0] in (TEXT, HEADER) and t[3] is not None]
            keyed = self._key_reads(lexed, b0, b1, syms)
            ok = len(got) == len(keyed) and all(k is None or k == g for g, k in zip(got, keyed))
        if not ok:
            raise VerifyError(f"{self.fmt.name}: the vectorised lexer disagrees with the "
                              f"reference lexer on a sample of {len(a)} ids")
        return True

    def _key_reads(self, lexed, b0: int, b1: int, syms: list) -> list[str]:
        """The header texts symbols ``b0:b1`` read, from their item-key ids alone (None for
        a header nothing reads: the key holds its length class only)."""
        meta = np.frombuffer(lexed[1], dtype=np.int64)
        vals = np.frombuffer(lexed[2], dtype=np.int64)
        off, plan = lexed[3], self.lexplan
        out = []
        for t in range(b0, b1):
            code, vlen = syms[t - b0] >> 2, int(meta[t]) & 0xFFFF
            ids = vals[off[t]:off[t + 1]]
            if vlen and plan.value_free[code]:
                out.append(None)
            elif vlen and plan.gclass[code] == DECODE:
                out.append(plan.header_value(ids, 0, vlen, int(plan.budget[code])))
            elif vlen and plan.gclass[code] == SPLIT:
                out.append(self.adapter.decode(ids.tolist()))
        return out

    def _same_tokens(self, toks, syms, B) -> bool:
        """The slow lexer's tokens are exactly the ones the symbols describe."""
        want = []
        terms = self.lx.terms
        for i, c in enumerate(syms):
            code, shape = c >> 2, c & 3
            if code:
                want.append((terms[code - 1], B[3 * i], B[3 * i + 1]))
            if shape == RUN:
                want.append((TEXT, B[3 * i + 1], B[3 * i + 3]))
            elif shape == HEAD:
                want.append((HEADER, B[3 * i + 1], B[3 * i + 3]))
            elif shape == HEAD_RUN:
                want.append((HEADER, B[3 * i + 1], B[3 * i + 2]))
                want.append((TEXT, B[3 * i + 2], B[3 * i + 3]))
        return want == [(t[0], t[1], t[2]) for t in toks]


_KEY_HEAD = struct.Struct("=3q")


def _item_key(meta: bytes, vals: bytes, off, a: int, b: int, tail) -> bytes:
    """The memo key of the item ``[a, b)`` (slots), as bytes of native int64: its first slot
    within its first symbol, its slot count, the configuration an item cut by the end of input
    ends in (``tail``; -1 for a whole item), its symbols' meta words and its header ids. The C
    executor (``_speedups.run``) builds exactly these bytes, so both look up one memo."""
    ia, ib = a // 3, (b - 1) // 3 + 1
    head = _KEY_HEAD.pack(a - 3 * ia, b - a, -1 if tail is None else tail)
    if off is not None:
        return head + meta[8 * ia:8 * ib] + vals[8 * off[ia]:8 * off[ib]]
    return head + meta[8 * ia:8 * ib]


def _c_record(prog: _Prog, sp: tuple) -> bytes:
    """An item's spans under one policy as the C executor reads them: native int64
    ``[turns, slot of the last turn's start, spans, chosen turns, (slot_a, da, slot_b, db,
    turn) per span..., chosen turn indices...]``; a reasoning turn's index is written ``~t``
    (last_turn_only keeps it with the answer after it: runtime.policy.last_run)."""
    spans, chosen = sp
    words = [len(prog.turns), prog.starts[-1] if prog.starts else -1, len(spans), len(chosen)]
    for x in spans:
        words.extend(x)
    words.extend(~t if prog.turns[t].block.kind == "think" else t for t in chosen)
    return struct.pack(f"={len(words)}q", *words)


def _mask_of(n: int, spans, as_list: bool):
    """A mask of ``n`` values with 1 on ``spans`` (``(start, end, turn)``)."""
    if as_list and _speedups is not None:
        return _speedups.mask_list(n, spans)
    if as_list:
        m = [0] * n
        for a, b, _ in spans:
            m[a:b] = (1,) * (b - a)
        return m
    m = bytearray(n)
    for a, b, _ in spans:
        m[a:b] = b"\x01" * (b - a)
    return m


# os.environ.get costs microseconds (it encodes the key): read the mapping behind it, looked
# up on each call (a library may replace os.environ, as datasets' multiprocessing does)
_VERIFY_KEY = (os.environ.encodekey("CHATGRAMMAR_VERIFY")
               if hasattr(os.environ, "_data") and hasattr(os.environ, "encodekey") else None)


def verify_enabled() -> bool:
    """``CHATGRAMMAR_VERIFY=1``: every fast answer is checked against the full pipeline."""
    env = getattr(os.environ, "_data", None)
    if _VERIFY_KEY is not None and env is not None:
        v = env.get(_VERIFY_KEY)
        return v is not None and v not in (b"", b"0", "", "0")
    return os.environ.get("CHATGRAMMAR_VERIFY", "") not in ("", "0")


class _NoCache(Exception):
    pass


class _FakeTurn:
    __slots__ = ("start", "generation_prompt")

    def __init__(self, start: int):
        self.start = start
        self.generation_prompt = False


class _RecordingSource(Source):
    """A :class:`Source` that records what the parse reads (so the read data joins the key)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.reads: list[tuple[int, int, int]] = []
        self.recording = False

    def read(self, s: int, e: int, limit: int = 64):
        if self.recording and not _in_generation_prompt():
            self.reads.append((s, e, limit))
        return super().read(s, e, limit)

    def locate(self, s: int, e: int, chars: int, limit: int = 64):
        if self.recording and chars > 0:
            self.reads.append((s, e, limit))  # id mode decodes at most `limit` tokens of it
        return super().locate(s, e, chars, limit)

    def match_lead(self, s: int, e: int, lead: str):
        if self.recording:
            self.reads.append((s, e, -len(lead)))  # negative: a lead match (see _read_key)
        return super().match_lead(s, e, lead)


def _in_generation_prompt() -> bool:
    # The final turn's generation-prompt check is redone on every sample (FastMasker.
    # _generation_prompt): its reads are not part of any item's key.
    f = sys._getframe(2)
    for _ in range(3):
        if f is None:
            return False
        if f.f_code.co_name == "_mark_generation_prompt":
            return True
        f = f.f_back
    return False


def _segments(bounds, pos, turns, reads) -> tuple[list, list, list]:
    """Cut a sample at its item bounds (indices into ``pos``, the token / char position of
    each parser symbol) and bucket the parse's turns and reads per item. Raises _NoCache when
    a turn or a read crosses items (the sample cannot be memoised)."""
    segs = []
    a = 0
    for b in bounds:
        if b > a:
            segs.append((a, b))
            a = b
    starts_pos = [pos[a] for a, _ in segs]
    per_seg: list[list] = [[] for _ in segs]
    for t in turns:
        j = bisect.bisect_right(starts_pos, t.start) - 1
        if j < 0 or not (pos[segs[j][0]] <= t.start < pos[segs[j][1]]):
            raise _NoCache
        per_seg[j].append(t)
    reads_seg: list[list] = [[] for _ in segs]
    for s, e, lim in reads:
        j = bisect.bisect_right(starts_pos, s) - 1
        if j < 0 or s >= pos[segs[j][1]]:
            if e <= s:
                continue  # an empty read past every item depends on nothing
            raise _NoCache
        reads_seg[j].append((s, e, lim))
    return segs, per_seg, reads_seg


def _read_plan(pos, a: int, b: int, sreads) -> tuple[tuple, dict[int, int]]:
    """An item's reads as (start slot, end slot, limit), relative to the item ``[a, b)``, and
    the map position → slot they were computed with."""
    slot_of: dict[int, int] = {}
    for j in range(b, a - 1, -1):
        slot_of.setdefault(pos[j], j - a)
    plan = []
    for s, e, lim in sreads:
        if s not in slot_of or e not in slot_of:
            raise _NoCache
        plan.append((slot_of[s], slot_of[e], lim))
    return tuple(plan), slot_of


def _read_len(s: int, e: int, limit: int) -> int:
    """How many ids of the read ``[s, e)`` its key holds (see :func:`_read_key`)."""
    if limit < 0:
        limit = 4 - limit
    return max(0, min(e - s, limit))


def _read_key(arr, B, js: int, je: int, limit: int):
    # what an id-mode read of [s, e) can depend on: its length up to a bound, and its ids
    # (a lead match, recorded as -len(lead), reads at most len(lead) + 4 tokens)
    s, e = B[js], B[je]
    if limit < 0:
        limit = 4 - limit
    k = min(e - s, limit + 1)
    return k, arr[s:s + min(k, limit)].tobytes()


def spec_refusal(spec) -> str | None:
    """Why the memo can never serve a format, from its spec alone (None: it can).

    An element with ``trim_end``: where an unterminated body ends depends on its last tokens'
    text, which the item memo does not key on. (A header budget of 60k tokens or more is the
    other refusal; it needs the lexing plan.)

    Args:
        spec: a :class:`~chatgrammar.core.spec.FormatSpec`.

    Returns:
        The reason, as ``stats()`` and ``FastMasker.disabled`` report it, or None.

    Example:
        >>> import chatgrammar as cg
        >>> spec_refusal(cg.load_format("kimi-k2").spec) is None
        True
    """
    if any(el.trim_end for el in spec.elements.values()):
        return "an element with trim_end (its body's end depends on its text)"
    return None


# ----------------------------------------------------------------------------- conversion

def ids_input(ids: Any, *, scratch: bool = False) -> tuple[np.ndarray, list | None]:
    """``ids`` → (int64 array, the Python list when the input is one, else None).

    A list of Python ints is converted by the C accelerator (``chatgrammar.runtime._speedups``), or
    with ``struct`` where it is not built (still about twice as fast as ``np.asarray``, which
    first infers the dtype); anything else goes through
    :func:`~chatgrammar.runtime.lexers.as_id_array` (same errors as ``parse_ids``).

    Args:
        scratch: a long list may be packed into this thread's reusable buffer; the array is
            then valid only until the next scratch packing in this thread (one call's use).
    """
    if type(ids) is list:
        try:
            return np.frombuffer(_pack(ids, scratch), dtype=np.int64), ids
        except (struct.error, TypeError, ValueError, OverflowError):
            pass
    return as_id_array(ids), None


def _pack(lst: list, scratch: bool = False) -> bytes:
    if _speedups is not None:
        return _c_pack((lst,), len(lst), scratch)
    return struct.pack(f"{len(lst)}q", *lst)


# Long inputs are packed into a buffer kept per thread: a fresh multi-megabyte buffer is fresh
# pages, and faulting them in costs more than packing (measured ~2.5 µs per 4 KB page on a VM:
# ~5 ms per million tokens). The packed array is only read during the call that packed it.
_SCRATCH = threading.local()
_SCRATCH_MIN = 1 << 14  # ints: smaller buffers come from the heap anyway
_SCRATCH_MAX = 1 << 24  # ints: keep at most 128 MB per thread


def _c_pack(lsts, total: int, scratch: bool):
    if not scratch or total < _SCRATCH_MIN:
        return _speedups.pack_many(lsts, total)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < 8 * total:
        buf = bytearray(8 * total)
        if total <= _SCRATCH_MAX:
            _SCRATCH.buf = buf
    _speedups.pack_many(lsts, total, buf)
    return memoryview(buf)[:8 * total]


def _pack_many(lsts: list[list], lens: list[int]) -> np.ndarray:
    """Many lists of ints → one int64 array (each packed straight into a shared buffer).

    The array may live in this thread's reusable buffer (see ``_c_pack``): use it before the
    next packing in the same thread."""
    if _speedups is not None:
        try:
            # (one packing per call, consumed by the caller's masks_flat before any other)
            return np.frombuffer(_c_pack(lsts, sum(lens), True), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            return np.concatenate([ids_input(x)[0] for x in lsts])
    buf = bytearray(8 * sum(lens))
    o = 0
    try:
        for x, n in zip(lsts, lens):
            struct.pack_into(f"{n}q", buf, o, *x)
            o += 8 * n
    except (struct.error, TypeError, OverflowError):
        return np.concatenate([ids_input(x)[0] for x in lsts])
    return np.frombuffer(buf, dtype=np.int64)


def mask_like(ids: Any, m):
    """A 0/1 bytearray → the container kind of ``ids`` (list / numpy int64 / torch.long);
    a mask that is already a list is returned as it is."""
    if type(m) is list:
        return m
    mod = type(ids).__module__
    if mod.startswith("torch"):
        import torch
        return torch.from_numpy(np.frombuffer(m, dtype=np.uint8).astype(np.int64)).to(ids.device)
    if isinstance(ids, np.ndarray):
        return np.frombuffer(m, dtype=np.uint8).astype(np.int64)
    return list(m)
