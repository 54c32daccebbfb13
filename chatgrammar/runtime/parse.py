"""Stage 4 — the LALR driver with an embedded, tree-less, non-recursive transformer.

The driver runs Lark's LALR(1) tables (built with ``strict=True`` in
:mod:`chatgrammar.core.compile`) over the lexers' short token lists. Each element rule is turned
into a :class:`~chatgrammar.runtime.spans.Block` at the moment it is reduced (bottom-up), so no tree
is ever walked and depth costs no recursion. Top-level items become Turns as soon as they
are reduced.

End of input inside an element is truncation, not an error: the driver closes what is open
with zero-width synthetic terminators (the turn is marked incomplete). In lenient mode a
structure error drops the item in progress (reported on ``Conversation.warnings``) and
parsing resumes at the next token that can start a turn.
"""
from __future__ import annotations

import bisect
import fnmatch
import re
from functools import lru_cache
from typing import Any

from ..core.compile import (BETWEEN_MAX_CHARS, BETWEEN_MAX_TOKENS, HEADER, HEADER_CHARS_PER_TOKEN,
                            TEXT, ParseTables, rule_name, term_name)
from ..errors import ParseError
from .spans import Block, Issue, Turn
from ..core.spec import ROLE_NAMES, Element, FormatSpec
from ..core.compile_grammar import bare_preamble

SYNTH = object()  # value of zero-width synthetic terminators added at end of input
# value of a zero-width close the driver adds where a top-level element whose close may be
# missing (`close.required: false`, `close.roles`) ends at the next opener
IMPLICIT = object()

_XTML_HEAD = re.compile(r'\s*([A-Za-z_][\w.\-:]*)((?:\s+[\w.\-:]+="[^"]*")*)\s*\Z')
_XTML_ATTR = re.compile(r'([\w.\-:]+)="([^"]*)"')
_XTML_UNESC = re.compile(r"&(amp|quot);")


def parse_xtml_head(text: str) -> tuple[str, dict] | None:
    """``tag key="value" …`` → (tag, attrs) with ``&amp;``/``&quot;`` unescaped, or None."""
    # Headers repeat ("message role=\"assistant\"", "think"...): memoised; the attrs dict
    # is copied so no two blocks share one.
    hit = _xtml_head(text)
    return None if hit is None else (hit[0], dict(hit[1]))


@lru_cache(maxsize=4096)
def _xtml_head(text: str) -> tuple[str, dict] | None:
    m = _XTML_HEAD.match(text)
    if not m:
        return None
    attrs: dict[str, str] = {}
    for k, v in _XTML_ATTR.findall(m.group(2)):
        if k in attrs:
            return None  # duplicate attribute: malformed
        attrs[k] = _XTML_UNESC.sub(lambda x: "&" if x.group(1) == "amp" else '"', v)
    return m.group(1), attrs


ERROR, ACCEPT = -1, -2


def lalr_step(states: list, shift: Any, stack: list, term: str, reduce) -> int:
    """THE LALR step of chatgrammar, used by the driver and by the fast path's automaton:
    feed ``term`` from the configuration ``stack`` (a list of states).

    Each reduction ``term`` triggers is handed to ``reduce(rule)``, which pops the rule's
    states, pushes the goto state (and does whatever else its caller builds: Blocks, item
    bounds). Returns the state to shift to (the caller pushes it, with its value), ``ACCEPT``
    when ``$END`` reduced the start rule, or ``ERROR`` when the table has no action (the
    reductions already made stay on the stack)."""
    for _ in range(1_000_000):
        act = states[stack[-1]].get(term)
        if act is None:
            return ERROR
        action, arg = act
        if action is shift:
            return arg
        if reduce(arg) is False:
            return ERROR
        if term == "$END" and arg.origin.name == "start":
            return ACCEPT
    return ERROR


def plain_reduce(states: list, stack: list, items: frozenset, hit: list):
    """A ``reduce`` for :func:`lalr_step` on a bare state stack: pops, pushes the goto and
    sets ``hit[0]`` when the rule is in ``items`` (a top-level item ended). Returns False
    when there is no goto (a broken configuration)."""
    def reduce(rule) -> bool:
        size = len(rule.expansion)
        if size:
            del stack[-size:]
        name = rule.origin.name
        if name in items:
            hit[0] = True
        if name == "start":
            return True
        goto = states[stack[-1]].get(name)
        if goto is None:
            return False
        stack.append(goto[1])
        return True
    return reduce


class LalrCore:
    """THE LALR core of chatgrammar: one per format, used by the driver (:meth:`Driver.run`,
    with Blocks as values) and by every memo's automaton (``fastpath._Automaton``, on bare
    state stacks), so the rules below exist once.

    * :meth:`feed` — feed a symbol (:func:`lalr_step`), and **the implicit close**: where
      the symbol opens a top-level element and cannot be shifted, the first close that may
      be missing (``close.required: false`` or ``close.roles``) that the configuration
      accepts is fed first, then the symbol once more (and so on, an unclosed child first,
      then its turn); a child's close that may be missing is so fed before its parent's
      close or a sibling's opener;
    * :meth:`can_feed` — would a symbol be shifted, without changing the configuration;
    * :meth:`end` — end of input on a configuration that is complete (``$END`` accepted).
      Closing a configuration cut by the end of input is the driver's ``_finish``; a memo
      keys an item cut there by its configuration and learns it from that parse.
    """

    def __init__(self, tables: ParseTables, implicit_closes: dict[str, tuple]):
        """``implicit_closes``: terminal -> the closes that may be missing, to try (in order)
        where that terminal cannot be shifted (:meth:`Driver.implicit_closes`)."""
        self.states = tables.states
        self.shift = tables.shift
        self.starters = tables.starters
        self.implicit = implicit_closes

    def feed(self, stack: list, term: str, reduce, on_close=None) -> int:
        """Feed ``term`` from ``stack``; returns the state to shift to (the caller pushes it,
        with its value) or ``ERROR`` / ``ACCEPT`` as :func:`lalr_step`.

        With ``on_close``, the implicit close: ``on_close(c)`` must feed the close ``c``
        (with the caller's value for it: :meth:`feed` again, without ``on_close``), after
        which ``term`` is fed once more; again while it cannot be shifted and another close
        that may be missing can (an unclosed child's, then its turn's)."""
        target = lalr_step(self.states, self.shift, stack, term, reduce)
        if target >= 0 or on_close is None:
            return target
        cands = self.implicit.get(term)
        # one close per open element that may miss it, innermost first (a child's, then its
        # turn's): at most as many as the configuration is deep
        for _ in range(len(stack) if cands else 0):
            c = next((c for c in cands if self.can_feed(stack, c)), None)
            if c is None:
                return target
            on_close(c)
            target = lalr_step(self.states, self.shift, stack, term, reduce)
            if target >= 0:
                return target
        return target

    def end(self, stack: list, reduce) -> bool:
        """Feed ``$END``: True when the start rule was reduced (the input is complete)."""
        return lalr_step(self.states, self.shift, stack, "$END", reduce) == ACCEPT

    def can_feed(self, state_stack: list[int], term: str) -> bool:
        """Would ``term`` be shifted (after any reductions) from this configuration?
        Simulated on a virtual stack, so deep stacks are never copied."""
        states, shift = self.states, self.shift
        depth = len(state_stack)
        overlay: list[int] = []
        for _ in range(10_000):
            top = overlay[-1] if overlay else state_stack[depth - 1]
            act = states[top].get(term)
            if act is None:
                return False
            action, arg = act
            if action is shift:
                return True
            size = len(arg.expansion)
            while size and overlay:
                overlay.pop()
                size -= 1
            depth -= size
            top = overlay[-1] if overlay else state_stack[depth - 1]
            if term == "$END" and depth == 1 and not overlay and arg.origin.name == "start":
                return True
            goto = states[top].get(arg.origin.name)
            if goto is None:
                return False
            overlay.append(goto[1])
        return False


class _Splice(list):
    """Children of an inlined rule, spliced into the parent (Lark's ``_rule`` semantics)."""

    __slots__ = ()


class Source:
    """Access to the input for the few places that must read text (headers, between-text,
    generation prompt)."""

    def __init__(self, mode: str, n: int, text: str | None = None, arr=None, adapter=None,
                 boundaries: list | None = None):
        self.mode, self.n, self.text, self.arr, self.adapter = mode, n, text, arr, adapter
        # (token index, note) of span boundaries inside a merged token (id mode)
        self.boundaries = boundaries if boundaries is not None else []

    def match_lead(self, s: int, e: int, lead: str) -> tuple[int, str]:
        """How much of the run ``[s, e)`` an element's ``lead`` literal covers.

        Returns ``(units, status)``: ``"whole"`` (the run starts with the lead, which ends at
        ``s + units``), ``"straddle"`` (id mode: the lead ends inside token ``s + units``),
        ``"partial"`` (the whole run is a proper prefix of the lead) or ``"absent"``.
        """
        if e <= s:
            return 0, "absent"
        if self.mode == "text":
            t = self.text[s:e]
            if t.startswith(lead):
                return len(lead), "whole"
            return (e - s, "partial") if lead.startswith(t) else (0, "absent")
        txt = ""
        # a token decodes to at least one char (or a replacement char): len(lead) + a few
        # tokens always suffice
        for k in range(1, min(e - s, len(lead) + 4) + 1):
            txt = self.adapter.decode(self.arr[s:s + k].tolist())
            if len(txt) >= len(lead):
                if not txt.startswith(lead):
                    return 0, "absent"
                return (k, "whole") if len(txt) == len(lead) else (k - 1, "straddle")
            if not lead.startswith(txt):
                return 0, "absent"
        return e - s, "partial"

    def locate(self, s: int, e: int, chars: int, limit: int = 64) -> tuple[int, bool]:
        """Where char ``chars`` of the run ``[s, e)`` (decoded on its own, as the lexer reads
        headers) falls: ``(position, straddles)``. Id mode: the index of the token that holds
        that char, ``straddles`` True when the char is not that token's first (the token also
        carries text before it); at most ``limit`` tokens are decoded (a header's budget)."""
        if chars <= 0:
            return s, False
        if self.mode == "text":
            return min(s + chars, e), False
        stop = min(e, s + limit)
        text, starts = self.adapter.decode_offsets(self.arr[s:stop].tolist())
        if chars >= len(text):
            return stop, False
        t = bisect.bisect_right(starts, chars) - 1
        return s + t, starts[t] != chars

    def read(self, s: int, e: int, limit: int = 64) -> str | None:
        """The text of ``[s, e)``, or None when longer than ``limit`` tokens (text mode:
        ``limit * HEADER_CHARS_PER_TOKEN`` chars): spec patterns only see bounded strings."""
        if self.mode == "text":
            return self.text[s:e] if e - s <= limit * HEADER_CHARS_PER_TOKEN else None
        if e - s > limit:
            return None
        return self.adapter.decode(self.arr[s:e].tolist())

    def excerpt(self, offset: int) -> str:
        if self.mode == "text":
            a, b = max(0, offset - 40), min(self.n, offset + 40)
            left = self.text[a:offset].replace("\n", "⏎")
            right = self.text[offset:b].replace("\n", "⏎")
            return f"  {left}{right}\n  {' ' * len(left)}^"
        a, b = max(0, offset - 8), min(self.n, offset + 8)
        ids = self.arr[a:b].tolist()
        left = " ".join(str(x) for x in ids[:offset - a])
        right = " ".join(str(x) for x in ids[offset - a:])
        try:
            dec = self.adapter.decode(self.arr[a:b].tolist()).replace("\n", "⏎")
        except Exception:
            dec = "?"
        return f"  ids {left} | {right}\n  text {dec!r}"


class Driver:
    """Parses token lists of one format. Built once per format (cheap, cached by Format)."""

    def __init__(self, spec: FormatSpec, tables: ParseTables):
        self.spec = spec
        self.tables = tables
        self.states = tables.states
        self.shift = tables.shift
        self.marker_by_term = {term_name(n): n for n in spec.markers}
        self.marker_text = {term_name(n): m.text for n, m in spec.markers.items()}
        self.elements = {rule_name(n): (n, el) for n, el in spec.elements.items()}
        self.preamble_rules = {rule_name(p) for p in spec.preamble if p in spec.elements}
        self.top_rules = {rule_name(t) for t in spec.top}
        # markers that may open more input: tried last when closing a cut input (a close
        # marker that a `follow_after` element must follow would open another element)
        self.ambiguous_terms = frozenset(
            term_name(m) for el in spec.elements.values()
            for m in el.inner_markers + el.open + (el.close.follow_after if el.close else []))
        self.between = re.compile(spec.between, re.S) if spec.between is not None else None
        self.trailing = re.compile(spec.trailing, re.S) if spec.trailing is not None else None
        # bare text preamble elements read by the grammar where `between` text could also be
        # (compile_grammar.bare_preamble): whitespace `between` accepts whole is no turn
        self.bare_between = frozenset(rule_name(p) for p in bare_preamble(spec)) \
            if spec.between is not None else frozenset()
        # close markers that are also inner markers of the same element (Granite Code's blank
        # line after every message, which a message may hold too): the grammar ends such an
        # element with the last of them, `(TEXT | M)* M`, so the block builder takes one as the
        # close only where nothing but `after` markers or the follow comes after it
        self.inner_closes = {
            n: ic for n, el in spec.elements.items() if el.close is not None
            for ic in [frozenset(term_name(m) for m in el.inner_markers)
                       & frozenset(term_name(c) for c in el.close.markers)] if ic}
        # An element without an opener whose header ends at a marker (GigaChat's role text)
        # can start in the text at the end of the input; only then is that text read at the
        # end (a read the memoised fast path would have to key every sample on).
        self.openerless_headers = any(not el.open and el.header is not None
                                      and el.header.until is not None
                                      for el in spec.elements.values())
        # A marker the spec does not know is never assistant text: strings shaped like this
        # format's special markers (``unknown_marker_shape``) inside a turn of a trained role
        # are a problem of that turn (``_Ctx._unknown_markers``)
        self.unknown_rx = unknown_marker_shape(spec)
        # id mode counts only special/added ids, never typed text: brackets and tags too
        self.unknown_rx_ids = unknown_marker_shape(spec, ids=True)
        self.known_texts = frozenset(m.text for m in spec.markers.values())
        # every prefix of a marker text ("" included): `g in known_prefixes` is
        # `any(t.startswith(g) for t in known_texts)` as one set lookup
        self.known_prefixes = frozenset(t[:i] for t in self.known_texts
                                        for i in range(len(t) + 1))
        self.checked_roles = frozenset(spec.policy.roles) if spec.policy is not None \
            else frozenset(("assistant",))
        self.aliases = {k: v for k, v in spec.role_aliases.items() if not _is_glob(k)}
        # glob keys ("functions.*", "*") name roles no exact key and no canonical role matches
        self.alias_globs = [(k, v) for k, v in spec.role_aliases.items() if _is_glob(k)]
        self.gen_prompts = set(spec.generation_prompt)
        self.max_gen = max((len(g) for g in spec.generation_prompt), default=0)
        self.patterns = {}
        for n, el in spec.elements.items():
            for h in (el.header, el.close.header if el.close else None):
                if h is not None and h.pattern:
                    self.patterns[id(h)] = re.compile(h.pattern, re.S)
        # per-element terminal sets, precomputed for the block builder
        self.el_info: dict[str, tuple] = {}
        for n, el in spec.elements.items():
            h = el.header
            until = term_name(h.until) if h and h.until else None
            hmarks = frozenset(term_name(m) for m in h.markers) if h else frozenset()
            closes = frozenset(term_name(c) for c in el.close.markers) if el.close else frozenset()
            ch = el.close.header if el.close else None
            cuntil = term_name(ch.until) if ch is not None else None
            after = frozenset(term_name(a) for a in el.close.after) if el.close else frozenset()
            self.el_info[n] = (until, hmarks, closes, cuntil, after)
        # close markers that may be missing: the element then ends at the next top-level opener
        # (whether that is a cut, an error or the turn's normal end is decided with its role)
        # state stack at end of input -> the synthetic terminators that close it (_finish)
        self._closings: dict[tuple, tuple] = {}
        self._closing_cands: dict[int, tuple] = {}  # parser state -> closing candidates
        # (token, state stack) -> the lenient recovery's warning text (_skipped_note)
        self._notes: dict[tuple, str] = {}
        self.cut_header_terms = self._cut_header_terms(spec)
        self.cut_header_openers = frozenset(t for t, how in self.cut_header_terms.items()
                                            if how == "open")
        # children whose close may be missing (they end at what cannot continue their body)
        self.open_kids = frozenset(
            n for n, el in spec.elements.items() if n not in spec.top and el.open
            and el.close is not None and not el.close.required)
        self.implicit_closes = self._implicit_closes(spec, tables, self.open_kids)
        self.core = LalrCore(tables, self.implicit_closes)
        self._can_feed = self.core.can_feed

    @staticmethod
    def _implicit_closes(spec: FormatSpec, tables: ParseTables,
                         open_kids: frozenset) -> dict[str, tuple]:
        """Terminal -> the close markers that may be missing, tried where it cannot be
        shifted. A top-level element's (``close.required: false``, ``close.roles``) before
        a top-level opener; a child's (``close.required: false``) before its parent's close,
        a sibling's opener, or a top-level opener (its turn's close may then be missing too):
        children's first, the innermost open element being the one that can take its
        close. ``open_kids``: the children whose close may be missing."""
        top = tuple(dict.fromkeys(
            term_name(c) for n in spec.top
            if spec.elements[n].close is not None
            and (not spec.elements[n].close.required or spec.elements[n].close.roles)
            for c in spec.elements[n].close.markers))
        kids: dict[str, list[str]] = {}  # trigger -> child closes
        for pel in spec.elements.values():
            opt = [spec.elements[c] for c in dict.fromkeys(pel.children) if c in open_kids]
            if not opt:
                continue
            triggers = [o for c in pel.children for o in spec.elements[c].open]
            triggers += pel.close.markers if pel.close is not None else []
            for t in triggers:
                kids.setdefault(term_name(t), []).extend(
                    term_name(m) for e in opt for m in e.close.markers)
        every_kid = tuple(dict.fromkeys(c for cs in kids.values() for c in cs))
        out = {t: tuple(dict.fromkeys(cs)) for t, cs in kids.items()}
        if top or every_kid:
            for t in tables.starters:
                out[t] = tuple(dict.fromkeys(out.get(t, ()) + every_kid + top))
        return {t: cs for t, cs in out.items() if cs}

    def _cut_header_terms(self, spec: FormatSpec) -> dict[str, str]:
        """Markers whose header, cut by the end of input, the parse reads only through
        :meth:`cut_reading`: ``"open"`` for an opener whose every element has an ``until``
        header with ``attributes: xtml`` and nothing else (no pattern, no header markers, no
        ``trained_after``, no ``lead``); ``"close"`` for a close marker whose every element
        has a close header (a cut close header is never read: ``_close`` checks the close tag
        of complete terminators only). Such a marker has no other use in the spec."""
        if self.openerless_headers:
            return {}
        from ..core.spec import Header
        hdef = {k: f.get_default(call_default_factory=True)
                for k, f in Header.model_fields.items()}
        used: dict[str, int] = {}
        how: dict[str, str | None] = {}

        def use(names) -> None:
            for m in names or ():
                used[m] = used.get(m, 0) + 1

        def want(m: str, kind: str | None) -> None:
            how[m] = kind if how.get(m, kind) == kind else None
        for el in spec.elements.values():
            use(el.inner_markers)
            for h in (el.header, el.close.header if el.close else None):
                if h is not None:
                    use(h.markers)
                    use([h.until] if h.until else [])
            h = el.header
            plain = (h is not None and h.until is not None and h.attributes == "xtml"
                     and not el.lead
                     and all(getattr(h, k) == v for k, v in hdef.items()
                             if k not in ("until", "attributes", "max_tokens")))
            for m in el.open:
                want(m, "open" if plain else None)
            if el.close is not None:
                use(el.close.after)
                use(el.close.follow_after)
                ch = el.close.header
                for m in el.close.markers:
                    want(m, "close" if ch is not None and ch.until is not None else None)
        use([p for p in spec.preamble if p in spec.markers])
        use(spec.between_markers)
        return {term_name(m): k for m, k in how.items() if k is not None and not used.get(m)}

    def cut_reading(self, term: str, text: str):
        """All that a parse takes from the text of the header after ``term`` (one of
        :attr:`cut_header_terms`) cut by the end of input: an opener's
        :meth:`cut_header_reading`; nothing (None) for a close header."""
        return self.cut_header_reading(text) if self.cut_header_terms[term] == "open" else None

    @staticmethod
    def cut_header_reading(text: str):
        """All that a parse takes from the text of a header in :attr:`cut_header_openers`
        cut by the end of input: its XTML reading ``(tag, attrs)``, or None. (The block's
        tag, attributes, validity, role and kind follow from it; nothing of the element
        trains but by its kind.) ``_read_header`` reads every XTML header with it."""
        return parse_xtml_head(text) if text else None

    def alias(self, role: str) -> str:
        """The canonical role: an exact ``role_aliases`` key, else (for a role that is not
        canonical already) the first glob key that matches, else the role itself."""
        if role in self.aliases:
            return self.aliases[role]
        if self.alias_globs and role not in ROLE_NAMES:
            for pat, target in self.alias_globs:
                if fnmatch.fnmatchcase(role, pat):
                    return target
        return role

    # ------------------------------------------------------------------ naming for errors
    def describe(self, term: str) -> str:
        if term == "$END":
            return "end of input"
        if term == TEXT:
            return "text"
        if term == HEADER:
            return "header text"
        if term in self.marker_text:
            return f"{self.marker_by_term[term]} {self.marker_text[term]!r}"
        return term

    def expected(self, state: int, stack: list | None = None) -> list[str]:
        """What the parser accepts next, in spec terms. Given the parse stack, only what it
        really accepts: LALR merges the lookaheads of states that share a repetition, so a
        state alone can list a sibling element's close marker."""
        keys = [k for k in self.states[state] if k.isupper() or k == "$END"]
        if stack is not None:
            keys = [k for k in keys if self._can_feed(stack, k)]
        order = {TEXT: 1, HEADER: 2, "$END": 3}
        return [self.describe(k) for k in sorted(keys, key=lambda k: (order.get(k, 0), k))]

    def _skipped_note(self, ttype: str, state_stack: list) -> str:
        """The lenient warning for a token the parse cannot take (the strict ParseError's
        message and its first six expected constructs). Lenient recovery on a flood of stray
        markers meets the same few configurations again and again: the text is kept per
        (token, state stack) for short stacks, and no excerpt is built (a warning has none)."""
        key = (ttype, tuple(state_stack)) if len(state_stack) <= 64 else None
        note = self._notes.get(key) if key is not None else None
        if note is None:
            expected = self.expected(state_stack[-1], state_stack)
            note = (f"skipped malformed input: unexpected {self.describe(ttype)}; expected "
                    f"{', '.join(expected[:6])}")
            if key is not None:
                if len(self._notes) > 4096:
                    self._notes.clear()
                self._notes[key] = note
        return note

    # ------------------------------------------------------------------ main loop
    def run(self, toks: list[tuple], src: Source, strict: bool,
            warnings: list[Issue], gen_prompt: bool = True,
            saves: list | None = None) -> list[Turn]:
        """The turns of ``toks`` (see the module docstring). ``gen_prompt=False`` leaves the
        last turn's generation-prompt mark unset: the fast path's learning parses do (its
        memo keeps no mark; the rule is applied to each sample it answers).

        ``saves``: ascending token indices ``i``; each is replaced by the parser's saved
        configuration before ``toks[i]`` (:class:`Saved`), from which :meth:`resume` finishes
        the parse of ``toks[:i]`` exactly as a parse of that prefix would (LALR reads no
        further ahead than the token it feeds)."""
        start_state = self.tables.start_state
        turns: list[Turn] = []
        ctx = _Ctx(self, src, strict, warnings, turns)
        reduce = ctx.reduce
        state_stack = [start_state]
        value_stack: list[Any] = []
        i, n = 0, len(toks)
        resync_at = -1
        implicit_at = -1
        marks = iter(saves) if saves else iter(())
        saved: list = []
        at = next(marks, -1)
        def red(rule) -> None:
            reduce(rule, state_stack, value_stack)

        def close(c) -> None:
            # a top-level element whose close may be missing ends where the next one opens
            nonlocal implicit_at
            implicit_at = i
            ctx.implicit_next = ttype  # what came instead of the close
            self._feed(ctx, state_stack, value_stack, (c, tok[1], tok[1], IMPLICIT))

        feed = self.core.feed
        while i < n:
            if i == at:
                saved.append(Saved(i, state_stack, value_stack, ctx, len(warnings)))
                at = next(marks, -1)
            tok = toks[i]
            ttype = tok[0]
            target = feed(state_stack, ttype, red, close if implicit_at != i else None)
            if target >= 0:
                state_stack.append(target)
                value_stack.append(tok)
                i += 1
                continue
            if (ttype == TEXT and i == n - 1 and self.trailing is not None
                    and tok[2] == src.n and self._can_feed(state_stack, "$END")
                    and self.trailing_ok(src, tok)):
                # text at the very end, after complete turns, that `trailing` accepts
                # (Mistral-7B-v0.1's `eos_token + ' '`): no turn, never trained
                i += 1
                continue
            # ---- structure error
            if strict:
                raise ParseError("unexpected " + self.describe(ttype), offset=tok[1],
                                 expected=self.expected(state_stack[-1], state_stack),
                                 mode=src.mode, format=self.spec.name,
                                 excerpt=src.excerpt(tok[1]))
            warnings.append(Issue(tok[1], self._skipped_note(ttype, state_stack)))
            if self._can_feed(state_stack, "$END"):
                # everything before the bad token is complete: flush its pending reductions
                # so finished turns are kept
                self._feed(ctx, state_stack, value_stack, ("$END", tok[1], tok[1], SYNTH))
            state_stack = [start_state]
            value_stack = []
            if ttype in self.tables.starters and resync_at != i:
                resync_at = i
                continue
            i += 1
            while i < n and toks[i][0] not in self.tables.starters:
                i += 1
            resync_at = i
        self._finish(ctx, state_stack, value_stack, src, strict, warnings)
        if gen_prompt:
            self._mark_generation_prompt(turns, src, toks)
        if saves is not None:
            saves[:] = saved
        return turns

    def resume(self, saved: "Saved", src: Source, warnings: list[Issue]) -> list[Turn]:
        """The turns of the prefix ``toks[:saved.i]`` (lenient; ``src`` is that prefix's
        source): the end of input fed from the configuration :meth:`run` saved there, the
        same :meth:`_finish` a parse of the prefix ends with. One use per ``saved``."""
        ctx = _Ctx(self, src, False, warnings, saved.turns)
        ctx.pending_preamble = saved.preamble
        ctx.implicit_next = saved.implicit_next
        self._finish(ctx, saved.states, saved.values, src, False, warnings)
        return saved.turns

    def _finish(self, ctx, state_stack, value_stack, src, strict, warnings) -> None:
        """Feed end of input, closing open elements with synthetic terminators (truncation).

        Which terminators close a configuration depends on its state stack only (unless an
        element without an opener may start in the text at the end, which reads that text):
        the sequence found once is kept per stack (``_closings``) and fed directly after."""
        end = src.n
        memo = None
        if not (self.openerless_headers and self.between is not None) and \
                len(state_stack) <= 256:
            key = tuple(state_stack)
            seq = self._closings.get(key)
            if seq is not None:
                for c in seq:
                    self._feed(ctx, state_stack, value_stack, (c, end, end, SYNTH))
                return
            memo = []
        if self._finish_search(ctx, state_stack, value_stack, end, memo):
            if memo is not None:
                if len(self._closings) > 4096:
                    self._closings.clear()
                self._closings[key] = tuple(memo)
            return
        if strict:
            raise ParseError("unexpected end of input", offset=end,
                             expected=self.expected(state_stack[-1], state_stack),
                             mode=src.mode, format=self.spec.name, excerpt=src.excerpt(end))
        warnings.append(Issue(end, "dropped an unfinishable item at end of input"))

    def _finish_search(self, ctx, state_stack, value_stack, end, fed) -> bool:
        """The closing search of :meth:`_finish`: True once ``$END`` was fed; each term fed
        is appended to ``fed`` (when not None)."""
        states = self.states
        src = ctx.src
        prefs = (self.tables.close_terms, self.tables.until_terms)
        tried: set = set()
        for _ in range(4 * len(state_stack) + 16):
            top = value_stack[-1] if value_stack else None
            if (self.openerless_headers and self.between is not None
                    and type(top) is tuple and top[0] == TEXT
                    and top[2] == end and self._can_feed(state_stack, "$END")
                    and not self.between_ok(src, top)):
                # Text at the end that `between` does not accept, where an element without an
                # opener may start: that element, cut inside its header (GigaChat's
                # `…<|message_sep|>\n\nassis`), not malformed between-turn text.
                u = next((u for u in sorted(self.tables.until_terms)
                          if self._can_feed(state_stack, u)), None)
                if u is not None:
                    self._feed(ctx, state_stack, value_stack, (u, end, end, SYNTH))
                    continue
            if self._can_feed(state_stack, "$END"):
                if fed is not None:
                    fed.append("$END")
                self._feed(ctx, state_stack, value_stack, ("$END", end, end, SYNTH))
                return True
            top_state = state_stack[-1]
            cands = self._closing_cands.get(top_state)
            if cands is None:
                acts = states[top_state]
                # A close marker that also opens an element or is some body's inner marker
                # (DeepSeek's `</think>` / `<think>`) may be shifted into a body instead of
                # closing anything: try it after the pure closers, and never twice from the
                # same configuration (that would cycle). (The order depends on the state
                # only: kept per state.)
                amb = self.ambiguous_terms
                cands = self._closing_cands[top_state] = tuple(
                    [k for k in acts if k in prefs[0] and k not in amb] +
                    [k for k in acts if k in prefs[0] and k in amb] +
                    [k for k in acts if k in prefs[1]] +
                    sorted(k for k in acts if k.startswith("M_") and k not in prefs[0]
                           and k not in prefs[1]))
            for c in cands:
                key = (state_stack[-1], len(state_stack), c)
                if key in tried:
                    continue
                tried.add(key)
                if self._can_feed(state_stack, c):
                    if fed is not None:
                        fed.append(c)
                    self._feed(ctx, state_stack, value_stack, (c, end, end, SYNTH))
                    break
            else:
                break
        return False

    def between_ok(self, src: Source, tok: tuple) -> bool:
        """Does the text run ``tok`` match ``between``? Read within 16 tokens (id mode) or
        BETWEEN_MAX_CHARS chars (text mode: ``read()`` counts HEADER_CHARS_PER_TOKEN chars per
        unit of ``limit``)."""
        txt = src.read(tok[1], tok[2], limit=BETWEEN_MAX_TOKENS if src.mode == "ids" else
                       BETWEEN_MAX_CHARS // HEADER_CHARS_PER_TOKEN)
        return txt is not None and self.between.fullmatch(txt) is not None

    def trailing_ok(self, src: Source, tok: tuple) -> bool:
        """Does the final text run ``tok`` match ``trailing``? Read as ``between`` text is."""
        txt = src.read(tok[1], tok[2], limit=BETWEEN_MAX_TOKENS if src.mode == "ids" else
                       BETWEEN_MAX_CHARS // HEADER_CHARS_PER_TOKEN)
        return txt is not None and self.trailing.fullmatch(txt) is not None

    def _feed(self, ctx, state_stack, value_stack, tok) -> None:
        """Feed a token the configuration accepts (checked with :meth:`_can_feed`)."""
        target = self.core.feed(state_stack, tok[0],
                                lambda rule: ctx.reduce(rule, state_stack, value_stack))
        if target >= 0:
            state_stack.append(target)
            value_stack.append(tok)

    def _mark_generation_prompt(self, turns: list[Turn], src: Source, toks: list) -> None:
        if not turns or not self.gen_prompts:
            return
        last = turns[-1]
        if src.mode == "text":
            if src.n - last.start <= self.max_gen:
                tail = src.text[last.start:]
                last.generation_prompt = tail in self.gen_prompts
        elif src.n - last.start <= 64:
            # Each lexer token (a marker, a run between markers) decoded on its own, as the
            # lexer reads headers: decoding across a special id can add text (SentencePiece
            # writes "<|assistant|> \n" for <|assistant|> ▁ \n, and "\n" for ▁ \n alone).
            tail = "".join(src.read(t[1], t[2]) or "" for t in toks if t[1] >= last.start)
            last.generation_prompt = tail in self.gen_prompts


class Saved:
    """A parser configuration :meth:`Driver.run` saved before token ``i``: copies of its
    stacks (a reduction extends the left ``_Splice`` of a repetition in place, so those are
    copied too; tokens and built blocks are shared: building a parent reads its children
    and, outside ``kind_when_cut`` and ``opens_follow``, never changes them) and of what the
    reduction callbacks carry."""

    __slots__ = ("i", "states", "values", "turns", "preamble", "implicit_next", "nwarn",
                 "nreads")

    def __init__(self, i: int, states: list, values: list, ctx: "_Ctx", nwarn: int):
        self.i = i
        # (what a recording source had read by then: fastpath's learning keys on it)
        self.nreads = len(getattr(ctx.src, "reads", ()))
        self.states = list(states)
        self.values = [_Splice(v) if type(v) is _Splice else v for v in values]
        self.turns = list(ctx.turns)
        self.preamble = list(ctx.pending_preamble)
        self.implicit_next = ctx.implicit_next
        self.nwarn = nwarn


class _Ctx:
    """Reduction callbacks (the embedded transformer) for one parse."""

    def __init__(self, drv: Driver, src: Source, strict: bool, warnings: list[Issue],
                 turns: list[Turn]):
        self.drv, self.src, self.strict, self.warnings, self.turns = drv, src, strict, \
            warnings, turns
        self.pending_preamble: list[Turn] = []
        self.implicit_next: str | None = None  # the token an implicit close was added before

    def problem(self, offset: int, message: str, block: Block | None = None, *,
                expected: list[str] | tuple = (), found: str | None = None) -> None:
        if self.strict:
            raise ParseError(message, offset=offset, mode=self.src.mode,
                             format=self.drv.spec.name, excerpt=self.src.excerpt(offset),
                             expected=expected, found=found)
        self.warnings.append(Issue(offset, message))
        if block is not None:
            block.valid = False

    def reduce(self, rule, state_stack: list, value_stack: list) -> None:
        size = len(rule.expansion)
        if size:
            vals = value_stack[-size:]
            del state_stack[-size:]
            del value_stack[-size:]
        else:
            vals = []
        name = rule.origin.name
        drv = self.drv
        if name in drv.elements:
            value = self.element(name, _flatten(vals))
            if name in drv.preamble_rules and self._at_top(value_stack):
                if not (name in drv.bare_between and not value.children
                        and drv.between_ok(self.src, (TEXT, value.start, value.body_end
                                                      if value.body_end is not None
                                                      else value.end))):
                    self.emit(value)
                elif value.follow is not None:
                    # leading whitespace `between` accepts is not a bare system prompt; what
                    # follows its close is still a turn
                    self.emit(value.follow)
        elif name == "_item":
            self.item(_flatten(vals))
            value = None
        elif name == "start":
            # text right after a preamble entry (compile_grammar: a bare system prompt's
            # grammar reads it there, not as an item) is between-turn text like an item's
            self.item([v for v in vals if type(v) is tuple and v[0] == TEXT])
            value = None
        else:  # Lark-internal repetition / inlined rules: splice, reusing the left list
            if vals and type(vals[0]) is _Splice:
                value = vals[0]
                for v in vals[1:]:
                    if type(v) is _Splice:
                        value.extend(v)
                    elif v is not None:
                        value.append(v)
            else:
                value = _Splice(_flatten(vals))
        state_stack.append(drv.states[state_stack[-1]][name][1])
        value_stack.append(value)

    # -------------------------------------------------------------- top-level items
    def item(self, vals: list) -> None:
        drv = self.drv
        for v in vals:
            if isinstance(v, Block):
                self.emit(v)
            elif v[0] == TEXT and drv.between is not None:
                if not drv.between_ok(self.src, v):
                    self.problem(v[1], "text between turns does not match `between` "
                                       f"({drv.spec.between!r})")

    def emit(self, b: Block) -> None:
        top = b
        while b is not None:
            if b is not top and b.start == b.end and not b.complete:
                # a follow of which nothing was written: the input ended where it must come
                # (`close.follow_after`); it is no turn
                break
            self.turns.append(self.turn(b))
            b = b.follow

    def turn(self, b: Block) -> Turn:
        el = self.drv.spec.elements.get(b.name)
        role = self._raw_role(b, el)
        if role is None:
            role = "unknown"
            if b.valid and b.complete and b.body_start is not None:
                self.problem(b.start, "cannot tell the role of this turn", b)
        role = self.drv.alias(role)
        if role in self.drv.checked_roles and b.valid and b.body_start is not None:
            self._unknown_markers(b, el, role)
        return Turn(role=role, start=b.start, end=b.end, complete=b.complete, block=b,
                    valid=b.valid)

    def _unknown_markers(self, b: Block, el: Element | None, role: str) -> None:
        """A marker the spec does not know, inside a turn that trains, is never trained as
        that turn's text: a located problem (strict: ParseError; lenient: a warning, and the
        turn trains nothing). Text mode: a string shaped like the format's special markers
        that is none of them; id mode: one special/added id of such a text."""
        drv, src = self.drv, self.src
        s, e = b.body_start, b.body_end if b.body_end is not None else b.end
        if e <= s:
            return
        at = found = None
        if src.mode == "text":
            if drv.unknown_rx is None:
                return
            for m in drv.unknown_rx.finditer(src.text, s, e):
                # a known marker's own text (or its head: Tulu's tag is "<|user|>\n") is not
                # unknown: where it stands in a body it is that body's text by the grammar
                if m.group() not in drv.known_prefixes:
                    at, found = m.start(), m.group()
                    break
        elif src.adapter is not None and src.arr is not None:
            ids, texts = unknown_marker_ids(drv, src.adapter)
            if len(ids):
                import numpy as np
                # (np.isin costs tens of µs on a short run: the ids' range, then the few
                # candidates in it against the sorted ids)
                run = src.arr[s:e]
                cand = np.flatnonzero((run >= ids[0]) & (run <= ids[-1]))
                if len(cand):
                    vals = run[cand]
                    k = np.minimum(np.searchsorted(ids, vals), len(ids) - 1)
                    hit = cand[ids[k] == vals]
                    if len(hit):
                        at = s + int(hit[0])
                        found = texts.get(int(src.arr[at]))
        if at is None:
            return
        exp: list[str] = []
        if el is not None:
            if el.close is not None:
                exp += [drv.describe(term_name(c)) for c in el.close.markers]
            for c in el.children:
                exp += [drv.describe(term_name(o)) for o in drv.spec.elements[c].open]
            exp += [drv.describe(term_name(m)) for m in el.inner_markers]
        exp.append("text")
        self.problem(at, f"unknown marker {found!r} in a turn of role {role!r}: the format "
                         "does not know it, so it is never trained as that turn's text "
                         f"(expected one of: {', '.join(dict.fromkeys(exp))})", b,
                     expected=list(dict.fromkeys(exp)), found=found)

    @staticmethod
    def _raw_role(b: Block, el: Element | None) -> str | None:
        """The role as written (before ``role_aliases``): the element's, its opener's, or the
        header's ``role`` attribute; None when it cannot be told."""
        role = el.role if el is not None else None
        if role is None and el is not None and b.open in el.role_by_marker:
            role = el.role_by_marker[b.open]
        if role is None:
            role = b.attrs.get("role")
        return role

    # -------------------------------------------------------------- elements
    def element(self, rname: str, ch: list) -> Block:
        """The Block of a reduced element from its children ``ch`` (tokens and blocks), read
        in order: opener, header, body, terminator, follow."""
        drv = self.drv
        ename, el = drv.elements[rname]
        until, hmarks, closes, cuntil, after = drv.el_info[ename]
        b = Block(name=ename, start=0, end=0)
        if el.open:
            tok = ch[0]
            b.open = drv.marker_by_term[tok[0]]
            b.start = tok[1]
            pos, i = tok[2], 1
        else:
            b.start = _start_of(ch[0]) if ch else 0
            pos, i = b.start, 0
        b.header_start = b.header_end = pos
        i, pos, has_body, complete, header_whole, hparts = self._header(b, el, ch, i, pos,
                                                                          until, closes)
        lead_run = None
        last_run = None
        if has_body:
            i, lead_run = self._body(b, el, ch, i, pos, closes)
            if el.trim_end and i > 0 and not isinstance(ch[i - 1], Block) \
                    and ch[i - 1][0] == TEXT and ch[i - 1][2] == b.body_end:
                last_run = ch[i - 1][1]
        end = b.body_end if b.body_end is not None else pos
        i, end, closed_ok, implicit = self._close(b, el, ch, i, end, closes, cuntil, after)
        if last_run is not None and b.close is None:
            self._trim_end(b, max(last_run, b.body_start))
        complete = complete and closed_ok
        if i < len(ch) and isinstance(ch[i], Block):
            b.follow = ch[i]
            if b.close is not None and el.close.opens_follow:
                # the close marker is the first thing of the follow element (``opens_follow``)
                f = b.follow
                f.start = f.header_start = f.header_end = b.close_start
                if f.body_start is not None:
                    f.body_start = b.close_start
                end = b.close_end = b.close_start
        b.end = end
        b.complete = complete and all(c.complete for c in b.children)
        if el.header is not None:
            self._read_header(b, el, header_whole, hparts)
        if implicit is not None and el.close.roles:
            role = self._raw_role(b, el)
            if role is not None and drv.alias(role) not in el.close.roles:
                # this role's turns have no terminator: ending at the next turn is no cut
                b.complete = all(c.complete for c in b.children)
            else:
                self._missing_close(b, el, implicit)
        if lead_run is not None and b.body_end > b.body_start:
            self._skip_lead(b, el.lead, lead_run)
        self._end_rules(b, el)
        b.kind = self._kind(b, el)
        return b

    def _end_rules(self, b: Block, el: Element) -> None:
        """What a block's end says about its parts, once it is built: an ``ends_with_parent``
        last child of a block without its close takes its ``kind_when_cut``; an empty body
        closed by one of ``close.untrained_when_empty`` has no end span (the template's stop
        for the tool, not the model's)."""
        if not b.complete and b.children:
            cel = self.drv.spec.elements.get(b.children[-1].name)
            if cel is not None and cel.kind_when_cut is not None:
                b.children[-1].kind = cel.kind_when_cut
        if (b.close is not None and b.close in el.close.untrained_when_empty
                and not b.children and (b.body_end or 0) <= (b.body_start or 0)):
            b.close_end = b.close_start

    def _header(self, b: Block, el: Element, ch: list, i: int, pos: int, until, closes):
        """Read the header part of ``ch`` from ``i``: ``(i, pos, has_body, complete,
        header_whole, header tokens)``; sets ``b.header`` and ``b.header_end``."""
        h = el.header
        n = len(ch)
        has_body, complete, header_whole = True, True, False
        hparts: list = []  # the header's tokens (where its text comes from)
        if h is None:
            return i, pos, has_body, complete, header_whole, hparts
        if until is not None:
            parts = []
            while i < n:
                c = ch[i]
                if isinstance(c, Block) or c[0] == until or c[0] in closes:
                    break
                parts.append(c)
                i += 1
            if i < n and not isinstance(ch[i], Block) and ch[i][0] == until:
                ut = ch[i]
                if ut[3] is SYNTH:
                    complete = False
                header_whole = ut[3] is not SYNTH
                b.header_end = ut[1]
                pos = ut[2]
                i += 1
            else:
                has_body = False
                header_whole = i < n and _real(ch[i])
                if parts:
                    b.header_end = parts[-1][2]
                pos = b.header_end
            b.header = "".join(p[3] if isinstance(p[3], str) else "" for p in parts)
            hparts = parts
        else:
            if i < n and not isinstance(ch[i], Block) and ch[i][0] == HEADER:
                ht = ch[i]
                b.header = ht[3]
                hparts = [ht]
                b.header_end = pos = ht[2]
                i += 1
            else:
                b.header = ""
            header_whole = b.header.endswith(h.until_text) or (i < n and _real(ch[i]))
        return i, pos, has_body, complete, header_whole, hparts

    def _body(self, b: Block, el: Element, ch: list, i: int, pos: int, closes):
        """Read the body from ``i`` (children, text) up to the terminator or a follow:
        ``(i, end of the text run a lead may cover, or None)``."""
        n = len(ch)
        lead_run = None
        b.body_start = pos
        if el.lead and i < n and not isinstance(ch[i], Block) and ch[i][0] == TEXT \
                and ch[i][1] == pos:
            lead_run = ch[i][2]
        kids = b.children
        follow_rule = rule_name(el.follow) if el.follow else None
        while i < n:
            c = ch[i]
            if isinstance(c, Block):
                if follow_rule and c.name == el.follow and i == n - 1:
                    break
                kids.append(c)
            elif c[0] in closes:
                ic = self.drv.inner_closes.get(b.name)
                if ic is None or c[0] not in ic or self._is_last_close(b.name, el, ch, i):
                    break
            i += 1
        last = ch[i - 1] if i > 0 else None
        b.body_end = _end_of(last) if last is not None and i > 0 else pos
        if b.body_end < b.body_start:
            b.body_end = b.body_start
        return i, lead_run

    def _is_last_close(self, ename: str, el: Element, ch: list, i: int) -> bool:
        """Is the close marker ``ch[i]``, which is also an inner marker, the element's close:
        is nothing but ``after`` markers (and the follow, last) after it?"""
        after = self.drv.el_info[ename][4]
        n = len(ch)
        for j in range(i + 1, n):
            c = ch[j]
            if isinstance(c, Block):
                if not (el.follow and c.name == el.follow and j == n - 1):
                    return False
            elif c[0] not in after:
                return False
        return True

    def _close(self, b: Block, el: Element, ch: list, i: int, end: int, closes, cuntil, after):
        """Read the terminator from ``i`` (close marker, close header, ``after`` markers):
        ``(i, end, complete, the implicit close token or None)``."""
        n = len(ch)
        complete = True
        implicit = None  # the close the driver added at the next opener (none was written)
        if i < n and not isinstance(ch[i], Block) and ch[i][0] in closes:
            ct = ch[i]
            b.close = self.drv.marker_by_term[ct[0]]
            b.close_start = ct[1]
            if ct[3] is IMPLICIT and not el.close.required and b.name in self.drv.open_kids:
                # a child whose close may be missing ends where its parent's close or a
                # sibling's opener comes: as the template writes it, complete
                b.close = None
            elif ct[3] is SYNTH or ct[3] is IMPLICIT:
                complete = False
                b.close = None  # no marker was written: the end of input closed it
                if ct[3] is IMPLICIT:
                    implicit = ct
                    if not el.close.roles:  # `required: false`: missing for every role
                        self._missing_close(b, el, ct)
            end = ct[2]
            i += 1
            if cuntil is not None:
                parts = []
                while i < n and not isinstance(ch[i], Block) and ch[i][0] != cuntil:
                    parts.append(ch[i])
                    i += 1
                if i < n and not isinstance(ch[i], Block) and ch[i][0] == cuntil:
                    if ch[i][3] is SYNTH:
                        complete = False
                    end = ch[i][2]
                    i += 1
                ctext = "".join(p[3] if isinstance(p[3], str) else "" for p in parts)
                if complete and el.header is not None and el.header.attributes == "xtml":
                    self._check_close_tag(b, ctext, ct[1])
            while i < n and not isinstance(ch[i], Block) and ch[i][0] in after:
                end = ch[i][2]
                i += 1
            b.close_end = end
        elif el.close is not None:
            complete = False
        return i, end, complete, implicit

    @staticmethod
    def _kind(b: Block, el: Element) -> str | None:
        """The block's kind: declared, by tag, or by attribute."""
        kind = el.kind
        if kind is None and b.tag is not None:
            kind = el.kind_by_tag.get(b.tag)
        if kind is None and el.kind_by_attr:
            for attr, table in el.kind_by_attr.items():
                v = b.attrs.get(attr)
                if v is not None and (v in table or "*" in table):
                    return table[v] if v in table else table["*"]  # "*": any other value
        return kind

    def _missing_close(self, b: Block, el: Element, ct: tuple) -> None:
        """A turn that needs its close ends at the next opener without it: an error, or with
        ``close.required: false`` a warning (the turn stays incomplete)."""
        what = self.drv.describe(ct[0])
        if el.close.required and not el.close.roles:
            # this element's close is never optional; the driver offered one because another
            # element with the same close marker may miss it: what came is unexpected here
            nxt = self.drv.describe(self.implicit_next) if self.implicit_next else "input"
            self.problem(ct[1], f"unexpected {nxt}: missing {what} before the next turn", b)
        elif el.close.required:
            self.problem(ct[1], f"missing {what} before the next turn", b)
        else:
            self.warnings.append(Issue(ct[1], f"missing {what}: the element ends where the "
                                              "next one opens"))

    def _at_top(self, value_stack: list) -> bool:
        """Only preamble items below: a preamble element reduced at the top of the input, not
        the same element nested in a turn (whose opener is below it)."""
        pre = self.drv.spec.preamble
        by_term = self.drv.marker_by_term
        return all(v.name in pre if isinstance(v, Block) else
                   type(v) is tuple and by_term.get(v[0]) in pre for v in value_stack)

    def _read_header(self, b: Block, el: Element, must_be_whole: bool,
                     parts: list | None = None) -> None:
        """Check and read a header. ``must_be_whole``: something real follows it (its
        terminator, a marker, a block), so it is checked even when the input ends later in
        the element; only a header cut by the end of input escapes the checks (and then
        nothing of the element trains). ``parts``: the header's tokens, to place
        ``trained_after``."""
        h = el.header
        text = b.header or ""
        m = None
        if h.attributes == "xtml":
            parsed = self.drv.cut_header_reading(text)
            if parsed is None:
                if must_be_whole:
                    self.problem(b.header_start, f"malformed XTML header {text[:60]!r}", b)
                else:
                    b.valid = False  # cut inside its header: nothing of it can be read
                return
            b.tag, b.attrs = parsed
            if el.tag is not None and b.tag != el.tag and must_be_whole:
                self.problem(b.header_start, f"expected a <{el.tag}> element, found "
                                             f"<{b.tag}>", b)
            return
        if h.pattern:
            rx = self.drv.patterns[id(h)]
            m = rx.fullmatch(text)
            if m is None:
                if b.body_start is not None and must_be_whole:
                    self.problem(b.header_start, f"header {text[:60]!r} does not match "
                                                 f"{h.pattern!r}", b)
                elif b.body_start is not None:
                    b.body_start = b.body_end  # cut inside its header: trains nothing
                return
            b.attrs = {k: v for k, v in m.groupdict().items() if v is not None}
        if h.until_text is not None and b.body_start is not None and \
                not text.endswith(h.until_text):
            # header cut off by the end of input (or missing): nothing of the body trains
            if must_be_whole and h.required:
                self.problem(b.header_start, f"header does not end with {h.until_text!r}", b)
            b.body_start = b.body_end
            return
        if h.trained_after is not None and m is not None and must_be_whole and b.valid \
                and b.body_start is not None and m.end(h.trained_after) >= 0:
            b.train_start = self._header_position(b, parts or [], m.end(h.trained_after),
                                                  h.max_tokens)

    def _header_position(self, b: Block, parts: list, chars: int, limit: int) -> int:
        """The input position of char ``chars`` of the header text, from the header's tokens.
        In id mode a token holding that char and text before it is the start (it trains, so
        no trained character is left out) and the boundary is reported."""
        acc = 0
        for p in parts:
            txt = p[3] if isinstance(p[3], str) else ""
            if chars < acc + len(txt):
                if p[0] not in (TEXT, HEADER):
                    # inside a marker's text: the whole marker trains, in both modes
                    at, straddle = p[1], chars > acc and self.src.mode == "ids"
                else:
                    at, straddle = self.src.locate(p[1], p[2], chars - acc, limit)
                if straddle:
                    self.src.boundaries.append(
                        (at, "header `trained_after` boundary falls inside a merged token "
                             "(trained)"))
                return at
            acc += len(txt)
        return parts[-1][2] if parts else b.header_end

    def _trim_end(self, b: Block, run_start: int) -> None:
        """Move the end of an unterminated body before the whitespace it ends with
        (``trim_end``). Only the tail is read: a window of chars in text mode, one token at a
        time (at most BETWEEN_MAX_TOKENS) in id mode."""
        src, e = self.src, b.body_end
        if src.mode == "text":
            s = max(run_start, e - BETWEEN_MAX_CHARS)
            t = src.read(s, e, limit=BETWEEN_MAX_CHARS // HEADER_CHARS_PER_TOKEN)
            if t is not None:
                b.body_end = max(b.body_start, s + len(t.rstrip()))
            return
        for _ in range(BETWEEN_MAX_TOKENS):
            if e <= run_start:
                break
            t = src.read(e - 1, e, limit=1)
            if t is None:
                break
            if t.strip():
                if e - 1 == run_start and any(
                        m.endswith(t[:k]) for k in range(len(t.rstrip()), len(t) + 1)
                        for m in self.drv.known_texts):
                    # the run's first token also ends a soft marker (`Falcon:\n` + `\n` as
                    # one `:\n\n` piece): its text is the marker's, the rest is whitespace
                    e -= 1
                elif t != t.rstrip():
                    # a token holding text and whitespace stays trained (text mode trains its
                    # text part only): a boundary inside a merged token
                    src.boundaries.append(
                        (e - 1, "trailing whitespace inside a merged token (trained)"))
                break
            e -= 1
        b.body_end = max(b.body_start, e)

    def _skip_lead(self, b: Block, leads: list[str], run_end: int) -> None:
        """Move the body start past the element's ``lead`` (it belongs to the header): the
        first alternative the body starts with; else the first the run is a proper prefix of
        (a run cut inside the lead trains nothing of it)."""
        partial = None
        for lead in leads:
            units, status = self.src.match_lead(b.body_start, min(run_end, b.body_end), lead)
            if status == "partial":
                partial = units if partial is None else partial
                continue
            if status == "absent":
                continue
            b.body_start += units
            if status == "straddle":
                self.src.boundaries.append(
                    (b.body_start, f"lead {lead!r} ends inside a merged token (trained)"))
            return
        if partial is not None:
            b.body_start += partial

    def _check_close_tag(self, b: Block, ctext: str, offset: int) -> None:
        tag = ctext.strip()
        parsed = parse_xtml_head(b.header or "")
        if parsed and tag != parsed[0]:
            self.problem(offset, f"close tag {tag!r} does not match open tag {parsed[0]!r}", b)


def unknown_marker_shape(spec: FormatSpec, *, ids: bool = False) -> re.Pattern | None:
    """The shape of this format's special markers, as a regex: for each special marker
    ``PREFIX inner SUFFIX`` (``<|`` ``im_end`` ``|>``, ``<｜`` ``User`` ``｜>``), where prefix and
    suffix are the runs of punctuation around a word-like inner part and together hold at
    least 3 characters and are not only brackets and slashes, the same prefix and suffix
    around any word-like inner part. None when no marker has such a shape (``[INST]``,
    ``</s>``, ``<start_of_turn>`` and ``<bos>`` give none: brackets and tags are ordinary text
    too often). A string of that shape that is none
    of the spec's markers is an *unknown marker* (see ``_Ctx._unknown_markers``). With
    ``ids=True`` (id mode, where only a special/added id can be one), 2 characters of brackets
    or tags suffice: Mistral's ``[TOOL_CONTENT]``, Gemma's ``<start_of_image>``."""
    pairs: dict[tuple[str, str], None] = {}
    for m in spec.markers.values():
        if not m.special:
            continue
        mt = re.fullmatch(r"([^\w\s]+)((?:\w|[.:\-\u2581])+)([^\w\s]+)", m.text)
        if mt is None:
            continue
        pre, suf = mt.group(1), mt.group(3)
        # at least 3 characters, not only brackets and slashes (`</s>`, `[/INST]` would make
        # every closing HTML tag or `[/b]` in content a marker)
        if ids or (len(pre) + len(suf) >= 3 and set(pre + suf) - set("<>/[]")):
            pairs[(pre, suf)] = None
    if not pairs:
        return None
    inner = r"(?:\w|[.:\-\u2581]){1,48}"
    alts = sorted((re.escape(p) + inner + re.escape(q) for p, q in pairs), key=len,
                  reverse=True)
    return re.compile("|".join(alts))


def unknown_marker_ids(drv: "Driver", adapter: Any) -> tuple:
    """The tokenizer's special/added ids whose text has the shape of the format's special
    markers (:func:`unknown_marker_shape`) but is none of them: (sorted id array, id → text).
    Cached on the adapter, per format."""
    cache = adapter.__dict__.setdefault("_cg_unknown_markers", {})
    rx = drv.unknown_rx_ids
    key = (drv.spec.name, rx.pattern if rx is not None else None)
    got = cache.get(key)
    if got is None:
        import numpy as np
        texts: dict[int, str] = {}
        if rx is not None:
            try:
                vocab = adapter.added_vocab()
            except Exception:  # a tokenizer that cannot list its added tokens: nothing known
                vocab = {}
            for text, tid in vocab.items():
                if (isinstance(text, str) and text not in drv.known_texts
                        and rx.fullmatch(text)):
                    texts[int(tid)] = text
        got = cache[key] = (np.array(sorted(texts), dtype=np.int64), texts)
    return got


def _is_glob(key: str) -> bool:
    return any(c in key for c in "*?[")


def _flatten(vals: list) -> list:
    out: list = []
    for v in vals:
        if type(v) is _Splice:
            out.extend(v)
        elif v is not None:
            out.append(v)
    return out


def _real(x) -> bool:
    """A block, or a token that is in the input (not a synthetic terminator)."""
    return isinstance(x, Block) or (x[3] is not SYNTH and x[3] is not IMPLICIT)


def _start_of(x) -> int:
    return x.start if isinstance(x, Block) else x[1]


def _end_of(x) -> int:
    return x.end if isinstance(x, Block) else x[2]
