"""Stage 2 — ``FormatSpec`` → one self-contained Lark grammar + terminal table.

The grammar is built by Lark as LALR(1) with ``strict=True``, so a spec whose grammar has a
shift/reduce or reduce/reduce conflict is rejected: a spec that compiles is unambiguous.
Lark never checks that a content pattern cannot swallow a marker; :func:`check_spec` does.

Terminals: one ``M_<NAME>`` per marker, ``TEXT`` (one run of text between markers) and
``HEADER`` (the head of a text run after an opener whose header ends at a literal, e.g. the
ChatML role line). Rules: one ``e_<name>`` per element.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from lark import Lark

try:  # Python 3.11+: the regex parser moved; the old module name warns
    import re._parser as sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]
from lark.exceptions import GrammarError
from lark.lexer import Lexer

from .errors import CompileError
from .spec import Element, FormatSpec, SpecSource

TEXT = "TEXT"
HEADER = "HEADER"


def term_name(marker: str) -> str:
    return "M_" + re.sub(r"[^A-Za-z0-9]", "_", marker).upper()


def rule_name(element: str) -> str:
    return "e_" + re.sub(r"[^A-Za-z0-9]", "_", element).lower()


class _PassThroughLexer(Lexer):
    """Lark needs a lexer class; chatgrammar lexes itself, so this one is never used to lex."""

    def __init__(self, lexer_conf):  # noqa: D401 - Lark API
        pass

    def lex(self, data):  # pragma: no cover - the driver in parse.py feeds tokens directly
        yield from data


# ----------------------------------------------------------------------------- semantic checks

_NESTED_QUANT = (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", None))


def _regex_risk(pattern: str) -> str | None:
    """Reject patterns with a quantified group that itself contains an unbounded quantifier
    (``(a+)+``, ``(\\w*)*``): the classic catastrophic-backtracking shape."""
    try:
        tree = sre_parse.parse(pattern)
    except re.error as exc:
        return f"invalid regex: {exc}"

    def walk(items, under_repeat: bool) -> str | None:
        stack = [(items, under_repeat)]
        while stack:
            seq, under = stack.pop()
            for op, av in seq:
                if op in _NESTED_QUANT and op is not None:
                    lo, hi, sub = av
                    unbounded = hi == sre_parse.MAXREPEAT or hi > 1000
                    if under and unbounded:
                        return "nested unbounded quantifiers can backtrack catastrophically"
                    stack.append((sub, under or unbounded))
                elif op is sre_parse.SUBPATTERN:
                    stack.append((av[-1], under))
                elif op is sre_parse.BRANCH:
                    for b in av[1]:
                        stack.append((b, under))
        return None

    return walk(tree, False)


def check_spec(spec: FormatSpec, src: SpecSource) -> None:
    """Semantic checks Lark cannot do. Raises CompileError located in the YAML."""
    markers = spec.markers
    texts: dict[str, str] = {}
    for name, m in markers.items():
        if m.text in texts:
            raise src.error(f"marker text {m.text!r} is declared twice ({texts[m.text]!r} and "
                            f"{name!r})", ("markers", name), CompileError)
        texts[m.text] = name

    def need_marker(name: str, loc: tuple) -> None:
        if name not in markers:
            raise src.error(f"unknown marker {name!r}; declared markers: "
                            f"{', '.join(sorted(markers))}", loc, CompileError)

    def need_element(name: str, loc: tuple) -> None:
        if name not in spec.elements:
            raise src.error(f"unknown element {name!r}; declared elements: "
                            f"{', '.join(sorted(spec.elements))}", loc, CompileError)

    def check_pattern(p: str | None, loc: tuple) -> None:
        if p is None:
            return
        risk = _regex_risk(p)
        if risk:
            raise src.error(risk, loc, CompileError)
        rx = re.compile(p, re.S)
        for mname, m in markers.items():
            if rx.fullmatch(m.text):
                raise src.error(f"content pattern {p!r} can swallow marker {mname!r} "
                                f"({m.text!r})", loc, CompileError)

    for i, n in enumerate(spec.top):
        need_element(n, ("top", i))
    for i, n in enumerate(spec.preamble):
        if n not in markers and n not in spec.elements:
            raise src.error(f"preamble item {n!r} is neither a marker nor an element",
                            ("preamble", i), CompileError)
    for i, n in enumerate(spec.between_markers):
        need_marker(n, ("between_markers", i))
    check_pattern(spec.between, ("between",))

    split_delims: dict[str, str] = {}
    for ename, el in spec.elements.items():
        base = ("elements", ename)
        for i, o in enumerate(el.open):
            need_marker(o, base + ("open", i))
        for k in el.role_by_marker:
            if k not in el.open:
                raise src.error(f"role_by_marker key {k!r} is not one of this element's openers",
                                base + ("role_by_marker", k), CompileError)
        for i, c in enumerate(el.children):
            need_element(c, base + ("children", i))
        for i, m in enumerate(el.inner_markers):
            need_marker(m, base + ("inner_markers", i))
        if el.follow:
            need_element(el.follow, base + ("follow",))
            if spec.elements[el.follow].open:
                raise src.error("a follow element must have no opener (it starts where this one "
                                "closes)", base + ("follow",), CompileError)
            if spec.elements[el.follow].close is None:
                raise src.error("a follow element needs a close marker", base + ("follow",),
                                CompileError)
        if not el.open and el.close is None:
            raise src.error("an element needs an opener or a close marker", base, CompileError)
        if el.ends_with_parent:
            if el.close is not None or not el.open or el.follow:
                raise src.error("an `ends_with_parent` element needs an opener and neither a "
                                "close marker nor a follow element", base, CompileError)
            if ename in spec.top or ename in spec.preamble:
                raise src.error("an `ends_with_parent` element must be a child, not a top-level "
                                "item", base, CompileError)
            for pname, pel in spec.elements.items():
                if ename in pel.children and pel.close is None:
                    raise src.error(f"`ends_with_parent` element {ename!r} is a child of "
                                    f"{pname!r}, which has no close marker",
                                    base, CompileError)
        if el.lead is not None:
            if not el.lead:
                raise src.error("empty `lead`", base + ("lead",), CompileError)
            inside = [mn for mn, m in markers.items() if m.text in el.lead]
            if inside:
                raise src.error(f"`lead` {el.lead!r} contains marker {inside[0]!r}; a lead is "
                                "plain text", base + ("lead",), CompileError)
        for hloc, h in ((base + ("header",), el.header),
                        (base + ("close", "header"), el.close.header if el.close else None)):
            if h is None:
                continue
            if (h.until is None) == (h.until_text is None):
                raise src.error("a header needs exactly one of `until` (a marker) or "
                                "`until_text` (a literal)", hloc, CompileError)
            if h.until:
                need_marker(h.until, hloc + ("until",))
            for i, hm in enumerate(h.markers):
                need_marker(hm, hloc + ("markers", i))
            check_pattern(h.pattern, hloc + ("pattern",))
            if h.until_text is not None:
                if hloc[-2:] == ("close", "header"):
                    raise src.error("a close header must end at a marker (`until`)", hloc,
                                    CompileError)
                if not el.open:
                    raise src.error("`until_text` needs an opener marker", hloc, CompileError)
                for o in el.open:
                    prev = split_delims.get(o)
                    if prev is not None and prev != h.until_text:
                        raise src.error(f"marker {o!r} opens headers ending at both {prev!r} and "
                                        f"{h.until_text!r}; the lexer cannot tell them apart",
                                        hloc, CompileError)
                    split_delims[o] = h.until_text
        if el.close:
            for i, c in enumerate(el.close.markers):
                need_marker(c, base + ("close", "markers", i))
            for i, c in enumerate(el.close.after):
                need_marker(c, base + ("close", "after", i))
    # markers opening until_text headers must not open other elements with marker headers
    for ename, el in spec.elements.items():
        if el.header and el.header.until and any(o in split_delims for o in el.open):
            raise src.error("this element's opener also opens an element whose header ends at a "
                            "literal; the lexer cannot tell them apart",
                            ("elements", ename, "open"), CompileError)
    for i, g in enumerate(spec.generation_prompt):
        if not g:
            raise src.error("empty generation prompt", ("generation_prompt", i), CompileError)
    for r in spec.policy.roles:
        if not r:
            raise src.error("empty role", ("policy", "roles"), CompileError)


# ----------------------------------------------------------------------------- grammar

def _element_rule(name: str, el: Element, elements: dict[str, Element]) -> list[str]:
    alts: list[str] = []
    opens = " | ".join(term_name(o) for o in el.open)
    open_part = f"({opens})" if len(el.open) > 1 else opens
    tails = [c for c in el.children if elements[c].ends_with_parent]
    body_items = ([TEXT] + [rule_name(c) for c in el.children if c not in tails]
                  + [term_name(m) for m in el.inner_markers])
    body = "(" + " | ".join(body_items) + ")*"
    if tails:  # children that run to this element's close can only come last
        body += " (" + " | ".join(rule_name(c) for c in tails) + ")?"
    close = ""
    if el.close:
        cm = " | ".join(term_name(c) for c in el.close.markers)
        close = f"({cm})" if len(el.close.markers) > 1 else cm
        ch = el.close.header
        if ch is not None:
            inner = (f"({' | '.join([TEXT] + [term_name(m) for m in ch.markers])})*"
                     if ch.markers else f"{TEXT}?")
            close += f" {inner} {term_name(ch.until)}"
        for a in el.close.after:
            close += f" {term_name(a)}?"
    follow = f" {rule_name(el.follow)}?" if el.follow else ""
    h = el.header
    if h is None:
        alts.append(f"{open_part} {body} {close}{follow}")
    elif h.until:
        inner = (f"({' | '.join([TEXT] + [term_name(m) for m in h.markers])})*"
                 if h.markers else f"{TEXT}?")
        alts.append(f"{open_part} {inner} {term_name(h.until)} {body} {close}{follow}")
        if not h.required:
            # header without its terminator: the element has no body (trains nothing)
            alts.append(f"{open_part} {inner} {close}{follow}")
    else:
        alts.append(f"{open_part} {HEADER}? {body} {close}{follow}")
    return [f"{rule_name(name)}: " + "\n    | ".join(a.strip() for a in alts)]


def build_grammar(spec: FormatSpec) -> str:
    """The compiled Lark grammar source for a spec (self-contained; terminals declared)."""
    terms = [term_name(m) for m in spec.markers] + [TEXT, HEADER]
    lines = [f"// chatgrammar format {spec.name!r} — generated, do not edit",
             f"%declare {' '.join(terms)}", ""]
    pre = " ".join(
        f"{term_name(p) if p in spec.markers else rule_name(p)}?" for p in spec.preamble)
    lines.append(f"start: {pre} _item*".replace("  ", " "))
    items = [rule_name(t) for t in spec.top]
    items += [term_name(m) for m in spec.between_markers]
    if spec.between is not None:
        items.append(TEXT)
    lines.append("_item: " + " | ".join(items))
    # only elements reachable from the top / preamble go into the grammar
    seen: list[str] = []
    todo = [t for t in spec.top] + [p for p in spec.preamble if p in spec.elements]
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.append(n)
        el = spec.elements[n]
        todo.extend(el.children)
        if el.follow:
            todo.append(el.follow)
    for n in seen:
        lines.extend(_element_rule(n, spec.elements[n], spec.elements))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- tables

@dataclass
class ParseTables:
    """What the driver in :mod:`chatgrammar.parse` needs from Lark's LALR analysis."""

    states: dict
    start_state: int
    end_state: int
    shift: Any
    grammar: str
    starters: frozenset  # terminals that can start a top-level item
    close_terms: frozenset
    until_terms: frozenset


@lru_cache(maxsize=256)
def _lalr(grammar: str) -> tuple:
    lk = Lark(grammar, parser="lalr", lexer=_PassThroughLexer, strict=True,
              maybe_placeholders=False)
    pt = lk.parser.parser.parser.parse_table
    from lark.parsers.lalr_analysis import Shift
    return pt.states, pt.start_states["start"], pt.end_states["start"], Shift


def _conflict_message(exc: Exception, spec: FormatSpec) -> tuple[str, tuple]:
    msg = str(exc)
    loc: tuple = ()
    for ename in spec.elements:
        if rule_name(ename) in msg:
            loc = ("elements", ename)
            break
    # Rename Lark's internal names into spec terms.
    for ename in spec.elements:
        msg = msg.replace(rule_name(ename), f"element {ename!r}")
    for mname in spec.markers:
        msg = re.sub(rf"\b{term_name(mname)}\b", f"marker {mname!r}", msg)
    return msg, loc


def compile_spec(spec: FormatSpec, src: SpecSource) -> ParseTables:
    """Check a spec and build its LALR tables (cached by grammar text).

    Raises:
        CompileError: semantic problems, or a grammar conflict (reported against the spec
            elements involved).
    """
    check_spec(spec, src)
    grammar = build_grammar(spec)
    try:
        states, start, end, shift = _lalr(grammar)
    except GrammarError as exc:
        msg, loc = _conflict_message(exc, spec)
        raise src.error("grammar is ambiguous (LALR conflict): " + msg.splitlines()[0]
                        + ("\n" + "\n".join(msg.splitlines()[1:]) if "\n" in msg else ""),
                        loc, CompileError) from None
    starters = frozenset(k for k, (a, _) in states[start].items() if k.isupper() and k != "$END")
    close_terms = frozenset(term_name(c) for el in spec.elements.values() if el.close
                            for c in el.close.markers)
    until_terms = frozenset(
        term_name(h.until) for el in spec.elements.values()
        for h in (el.header, el.close.header if el.close else None) if h is not None and h.until)
    return ParseTables(states, start, end, shift, grammar, starters, close_terms, until_terms)


def spec_digest(spec: FormatSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]
