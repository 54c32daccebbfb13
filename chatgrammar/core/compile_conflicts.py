"""Conflict explanations: every LALR(1) conflict of a grammar that does not build strictly,
told in spec terms (elements, markers, a shortest input reaching it, the YAML location)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from .compile_grammar import HEADER, TEXT, rule_name, term_name
from .spec import FormatSpec

@dataclass(frozen=True)
class Conflict:
    """One LALR(1) conflict of a compiled grammar, in Lark's terms (see :func:`grammar_conflicts`).

    Attributes:
        kind: ``"shift/reduce"`` or ``"reduce/reduce"``.
        lookahead: the terminal on which the parser cannot decide (``M_<MARKER>``, ``TEXT``,
            ``HEADER`` or ``$END``).
        reduce: the rules that could be reduced, each ``(origin, expansion)``.
        shift: the items that could shift the lookahead, each ``(origin, expansion, dot)``.
        prefix: a shortest sequence of terminals that leads the parser into the conflict.
    """

    kind: str
    lookahead: str
    reduce: tuple
    shift: tuple
    prefix: tuple


@lru_cache(maxsize=64)
def grammar_conflicts(grammar: str) -> tuple[Conflict, ...]:
    """Every LALR(1) conflict of a grammar (empty when it builds with ``strict=True``).

    Runs Lark's own LALR analysis without its strict check, so that all conflicts are found,
    not just the first, together with a shortest input reaching each one.

    Args:
        grammar: a grammar produced by :func:`build_grammar`.

    Returns:
        The conflicts, in a stable order.
    """
    from lark.common import ParserConf
    from lark.load_grammar import load_grammar
    from lark.parsers.lalr_analysis import LALR_Analyzer

    g, _ = load_grammar(grammar, "<chatgrammar>", None, False)
    _, rules, _ = g.compile(["start"], set())
    an = LALR_Analyzer(ParserConf(rules, {}, ["start"]), debug=False, strict=False)
    an.compute_lr0_states()
    an.compute_reads_relations()
    an.compute_includes_lookback()
    an.compute_lookaheads()

    # Shortest terminal string each nonterminal derives (fixpoint), to spell example inputs.
    shortest: dict[str, tuple] = {}
    changed = True
    while changed:
        changed = False
        for r in rules:
            parts: list = []
            for s in r.expansion:
                if s.is_term:
                    parts.append(s.name)
                elif s.name in shortest:
                    parts.extend(shortest[s.name])
                else:
                    break
            else:
                cand = tuple(parts)
                old = shortest.get(r.origin.name)
                if old is None or len(cand) < len(old):
                    shortest[r.origin.name] = cand
                    changed = True

    # Shortest path (in symbols) from the start state to every state.
    start_state = an.lr0_start_states["start"]
    path: dict = {start_state: ()}
    queue = [start_state]
    while queue:
        nxt = []
        for st in queue:
            for sym, to in sorted(st.transitions.items(), key=lambda kv: kv[0].name):
                if to not in path:
                    path[to] = path[st] + (sym,)
                    nxt.append(to)
        queue = nxt

    def spell(symbols) -> tuple:
        out: list = []
        for s in symbols:
            out.extend([s.name] if s.is_term else shortest.get(s.name, (f"<{s.name}>",)))
        return tuple(out)

    def rule_of(r) -> tuple:
        return (r.origin.name, tuple(s.name for s in r.expansion))

    found: list[Conflict] = []
    for st in an.lr0_itemsets:
        if st not in path:
            continue
        for la, rs in st.lookaheads.items():
            if len(rs) > 1:
                kind = "reduce/reduce"
            elif la in st.transitions:
                kind = "shift/reduce"
            else:
                continue
            shifts = tuple(sorted({
                (rp.rule.origin.name, tuple(s.name for s in rp.rule.expansion), rp.index)
                for item in st.closure if not item.is_satisfied and item.next == la
                for rp in _lift(item, st)}))
            found.append(Conflict(kind, la.name, tuple(sorted(rule_of(r) for r in rs)),
                                  shifts if kind == "shift/reduce" else (),
                                  spell(path[st])))
    found.sort(key=lambda c: (len(c.prefix), c.kind, c.lookahead, c.reduce, c.shift))
    return tuple(found)


def _lift(item, state) -> list:
    """Replace an item of a Lark-internal rule (a repetition) at its start by the items of
    the spec rules that predicted it, so a conflict is shown against spec elements."""
    out, seen, todo = [], set(), [item]
    while todo:
        x = todo.pop()
        if not x.rule.origin.name.startswith("__"):
            out.append(x)
            continue
        if x in seen:
            continue
        seen.add(x)
        parents = [p for p in state.closure if not p.is_satisfied and p.next == x.rule.origin
                   and p != x]
        if x.index > 0 or not parents:
            out.append(x)
        else:
            todo.extend(parents)
    return out


_INTERNAL = re.compile(r"^__(?P<rule>\w+?)_(?:star|plus)_\d+$")


class _Namer:
    """Spells Lark's symbols and rules in spec terms (element and marker names)."""

    def __init__(self, spec: FormatSpec, grammar: str):
        self.spec = spec
        self.markers = {term_name(n): n for n in spec.markers}
        self.elements = {rule_name(n): n for n in spec.elements}
        self._alts: dict[str, list[tuple]] = {}
        try:
            from lark.load_grammar import load_grammar
            g, _ = load_grammar(grammar, "<chatgrammar>", None, False)
            _, rules, _ = g.compile(["start"], set())
            for r in rules:
                self._alts.setdefault(r.origin.name, []).append(
                    tuple(s.name for s in r.expansion))
        except Exception:  # naming is best effort; the conflict itself is already known
            pass

    def owners(self, name: str) -> list[str]:
        """The spec elements whose rules use a Lark-internal rule (Lark shares one repetition
        rule between identical sub-expressions, so there may be several)."""
        out: list[str] = []
        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for origin, alts in self._alts.items():
                if any(n in a for a in alts) and origin != n:
                    if origin in self.elements:
                        out.append(self.elements[origin])
                    elif origin.startswith("__"):
                        todo.append(origin)
        return sorted(set(out))

    def element_of(self, name: str) -> str | None:
        """The spec element a Lark rule belongs to (its own rule or one of its repetitions)."""
        if name in self.elements:
            return self.elements[name]
        owners = self.owners(name) if name.startswith("__") else []
        return owners[0] if owners else None

    def term(self, t: str) -> str:
        if t in self.markers:
            return self.markers[t]
        return {TEXT: "text", HEADER: "header-text", "$END": "end-of-input"}.get(t, t)

    def term_long(self, t: str) -> str:
        if t in self.markers:
            n = self.markers[t]
            return f"marker {n!r} ({self.spec.markers[n].text!r})"
        return {TEXT: "text", HEADER: "header text", "$END": "end of input"}.get(t, t)

    def symbol(self, s: str) -> str:
        if s.isupper() or s == "$END":
            return self.term(s)
        if s in self.elements:
            return f"<{self.elements[s]}>"
        if _INTERNAL.match(s):
            # a repetition: spell its one-step alternatives, (a | b)*
            alts = [a for a in self._alts.get(s, []) if s not in a]
            inner = " | ".join(" ".join(self.symbol(x) for x in a) for a in alts) or "…"
            return f"({inner})*"
        if s == "_item":
            return "<top-level item>"
        return s

    def construct(self, origin: str, expansion: tuple, dot: int | None = None) -> str:
        """``element 'x' (elements.x): a · (text)* e``."""
        el = self.element_of(origin)
        if origin in self.elements:
            head = f"element {el!r} (elements.{el})"
        elif el is not None:
            head = "a repetition inside " + " or ".join(
                f"element {o!r} (elements.{o})" for o in self.owners(origin))
        elif origin == "_item":
            head = "a top-level item (top / between / between_markers)"
        elif origin == "start":
            head = "the conversation (preamble, then top-level items)"
        else:
            head = origin
        syms = [self.symbol(s) for s in expansion]
        if dot is not None:
            syms.insert(dot, "·")
        body = " ".join(syms) if syms else "(empty)"
        return f"{head}: {body}"

    def example(self, terms: tuple) -> str:
        out = []
        for t in terms:
            if t in self.markers:
                out.append(self.spec.markers[self.markers[t]].text)
            else:
                out.append({TEXT: "…", HEADER: "…"}.get(t, ""))
        return "".join(out)


def _conflict_hint(c: Conflict, namer: _Namer) -> str | None:
    names = [namer.element_of(o) for o, _ in c.reduce] + \
            [namer.element_of(o) for o, _, _ in c.shift]
    els = sorted({n for n in names if n})
    if c.kind == "reduce/reduce" and len(els) >= 2 and all(o in namer.elements
                                                          for o, _ in c.reduce):
        return (f"elements {', '.join(repr(e) for e in els)} read the same input: give them "
                "different openers or close markers, or merge them into one element and tell "
                "them apart after parsing (role_by_marker, kind_by_tag, kind_by_attr)")
    origins = {o for o, _ in c.reduce} | {o for o, _, _ in c.shift}
    if "_item" in origins:
        return ("`between` text competes with an element that starts with text (no opener): "
                "give that element an opener, or narrow or drop `between`")
    no_open = [namer.element_of(o) for o, _, d in c.shift
               if d == 0 and o in namer.elements and not namer.spec.elements[namer.elements[o]].open]
    if c.kind == "shift/reduce" and no_open:
        return (f"element {no_open[0]!r} has no opener, so here the parser cannot tell whether "
                f"{namer.term_long(c.lookahead)} starts it or belongs to what encloses it: give "
                f"{no_open[0]!r} an opener marker")
    if c.kind == "shift/reduce" and els:
        return ("the parser cannot tell where one construct ends and the next begins: "
                "give the inner construct its own close marker, or make the optional part "
                "required")
    return None


def conflict_message(conflicts: tuple[Conflict, ...], spec: FormatSpec,
                      grammar: str) -> tuple[str, tuple]:
    """Render conflicts in spec terms; returns (message, YAML location of the first element)."""
    namer = _Namer(spec, grammar)
    # One entry per kind of conflict between the same constructs (Lark reports each state and
    # lookahead separately; the shortest example of each group is the readable one).
    groups: dict[tuple, list[Conflict]] = {}
    for c in conflicts:
        key = (c.kind, tuple(sorted({namer.element_of(o) or o for o, _ in c.reduce})),
               tuple(sorted({namer.element_of(o) or o for o, _, _ in c.shift})))
        groups.setdefault(key, []).append(c)
    # Conflicts between whole elements first (they say the most); repetitions inside an
    # element are often only a consequence of the same ambiguity.
    def internal_only(c: Conflict) -> bool:
        origins = [o for o, _ in c.reduce] + [o for o, _, _ in c.shift]
        return not any(o in namer.elements or o in ("_item", "start") for o in origins)

    for cs in groups.values():  # the representative: whole elements, then the shortest
        cs.sort(key=lambda c: (internal_only(c), len(c.prefix)))
    groups = dict(sorted(groups.items(), key=lambda kv: (internal_only(kv[1][0]),
                                                         len(kv[1][0].prefix))))
    loc: tuple = ()
    lines: list[str] = []
    for gi, (key, cs) in enumerate(groups.items()):
        if gi == 3:
            rest = sum(len(v) for v in list(groups.values())[3:])
            lines.append(f"(+{rest} more conflict{'s' if rest > 1 else ''})")
            break
        c = cs[0]
        las = ", ".join(dict.fromkeys(namer.term_long(x.lookahead) for x in cs))
        more = f" ({len(cs)} conflicts between these constructs; one is shown)" \
            if len(cs) > 1 else ""
        ex = namer.example(c.prefix)
        after = f"after {ex!r}" if ex else "at the start of the input"
        lines.append(f"{c.kind} conflict {after}, next: {las}{more}")
        if c.kind == "reduce/reduce":
            lines.append("  the input read so far completes more than one construct:")
            for o, e in c.reduce:
                lines.append("    - " + namer.construct(o, e, len(e)))
        else:
            (o, e), = c.reduce
            lines.append("  it could complete:")
            lines.append("    - " + namer.construct(o, e, len(e)))
            lines.append("  or continue:")
            for o2, e2, d2 in c.shift:
                lines.append("    - " + namer.construct(o2, e2, d2))
        hint = _conflict_hint(c, namer)
        if hint:
            lines.append(f"  hint: {hint}")
        if not loc:
            for o in [o for o, _ in c.reduce] + [o for o, _, _ in c.shift]:
                el = namer.element_of(o)
                if el is not None:
                    loc = ("elements", el)
                    break
    used = sorted({t for c in conflicts for t in c.prefix + (c.lookahead,)} & set(namer.markers))
    if used:
        lines.append("markers: " + ", ".join(
            f"{namer.markers[t]} = {spec.markers[namer.markers[t]].text!r}" for t in used))
    return "\n".join(lines), loc


