"""The grammar a spec compiles to: one Lark rule ``e_<name>`` per element, one terminal
``M_<NAME>`` per marker, plus ``TEXT`` (a run of text between markers) and ``HEADER`` (the
head of a text run after an opener whose header ends at a literal, e.g. the ChatML role line).
"""
from __future__ import annotations

import re
from functools import lru_cache

from .spec import Element, FormatSpec

TEXT = "TEXT"
HEADER = "HEADER"


_NON_WORD = re.compile(r"[^A-Za-z0-9]")


@lru_cache(maxsize=4096)
def term_name(marker: str) -> str:
    return "M_" + _NON_WORD.sub("_", marker).upper()


@lru_cache(maxsize=4096)
def rule_name(element: str) -> str:
    return "e_" + _NON_WORD.sub("_", element).lower()


def _element_rule(name: str, el: Element, elements: dict[str, Element],
                  preamble: bool = False, between: tuple = (), lead: bool = False) -> list[str]:
    alts: list[str] = []
    opens = " | ".join(term_name(o) for o in el.open)
    open_part = f"({opens})" if len(el.open) > 1 else opens
    tails = [c for c in el.children if elements[c].ends_with_parent]
    # a child without an opener starts with the body's text, so it can only open the body
    # (DeepSeek-V4's reasoning before a lone `</think>`): anywhere else its text could not be
    # told from the body's own
    firsts = [c for c in el.children if not elements[c].open]
    body_items = (([TEXT] if el.text else [])
                  + [rule_name(c) for c in el.children if c not in tails and c not in firsts]
                  + [term_name(m) for m in el.inner_markers])
    # leading text of the preamble (no opener; or no opener and no close): never empty, or
    # `start` is ambiguous (an empty one would read nothing before its close or the first turn)
    # An element without close or header whose opener may also stand alone between turns
    # (`between_markers`: Mistral's `<s>` opening a bare system prompt) has a body: a lone
    # marker is the between-turn marker.
    nonempty = (not el.open and (not el.close or preamble)) or (
        el.open and not el.close and el.header is None and set(el.open) & set(between))
    body = ("(" + " | ".join(body_items) + (")+" if nonempty else ")*")
            if body_items else "")
    if lead and body_items == [TEXT]:
        # a child without opener that holds only text: one run of it (a repetition would
        # compete with the parent body's own text)
        body = f"{TEXT}?"
    if tails:  # children that run to this element's close can only come last
        body += " (" + " | ".join(rule_name(c) for c in tails) + ")?"
    if firsts:
        body = "(" + " | ".join(rule_name(c) for c in firsts) + ")? " + body
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
    if el.close and el.close.follow_after:
        # the follow comes after these close markers, always, and after no other
        fa = el.close.follow_after
        after = "".join(f" {term_name(a)}?" for a in el.close.after)
        calts = ([term_name(c) + after for c in el.close.markers if c not in fa]
                 + [f"{term_name(c)} {rule_name(el.follow)}" for c in el.close.markers
                    if c in fa])
        close = f"({' | '.join(calts)})" if len(calts) > 1 else calts[0]
        follow = ""
    h = el.header
    if h is None:
        alts.append(f"{open_part} {body} {close}{follow}")
    elif h.until:
        # without an opener the header text is what starts the element: it cannot be empty
        # (so `between` text at the end of the input is not also an empty turn's header)
        inner = (f"({' | '.join([TEXT] + [term_name(m) for m in h.markers])})"
                 + ("*" if el.open else "+") if h.markers else TEXT + ("?" if el.open else ""))
        alts.append(f"{open_part} {inner} {term_name(h.until)} {body} {close}{follow}")
        if not h.required:
            # header without its terminator: the element has no body (trains nothing)
            alts.append(f"{open_part} {inner} {close}{follow}")
    else:
        alts.append(f"{open_part} {HEADER}? {body} {close}{follow}")
    return [f"{rule_name(name)}: " + "\n    | ".join(a.strip() for a in alts)]


def bare_preamble(spec: FormatSpec) -> list[str]:
    """The preamble elements that start with text (no opener): bare text before the first
    turn (DeepSeek's and Yi-1.5's system prompt)."""
    return [p for p in spec.preamble if p in spec.elements and not spec.elements[p].open]


def build_grammar(spec: FormatSpec) -> str:
    """The compiled Lark grammar source for a spec (self-contained; terminals declared)."""
    terms = [term_name(m) for m in spec.markers] + [TEXT, HEADER]
    lines = [f"// chatgrammar format {spec.name!r} — generated, do not edit",
             f"%declare {' '.join(terms)}", ""]
    pre = " ".join(
        f"{term_name(p) if p in spec.markers else rule_name(p)}?" for p in spec.preamble)
    items = [rule_name(t) for t in spec.top]
    items += [term_name(m) for m in spec.between_markers]
    bare = bare_preamble(spec)
    if spec.between is not None and bare:
        # A bare text element of the preamble (Yi-1.5's system prompt before the first turn)
        # and `between` text would both read leading text: the leading text is always the
        # preamble element (the driver drops it when `between` accepts it whole), and
        # between-turn text belongs to the item before it, so no item starts with text. A
        # preamble entry takes the text after it too, unless a bare element may follow it
        # (or it is one without a close, whose body already runs to the first turn).
        last_bare = max(spec.preamble.index(b) for b in bare)
        parts = []
        for k, p in enumerate(spec.preamble):
            sym = term_name(p) if p in spec.markers else rule_name(p)
            el = spec.elements.get(p)
            if k >= last_bare and not (el is not None and not el.open and el.close is None):
                parts.append(f"({sym} {TEXT}?)?")
            else:
                parts.append(f"{sym}?")
        lines.append(f"start: {' '.join(parts)} _item*")
        items = [f"{i} {TEXT}?" for i in items]
    else:
        lines.append(f"start: {pre} _item*".replace("  ", " "))
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
    leads = {c for el in spec.elements.values() for c in el.children
             if not spec.elements[c].open}
    for n in seen:
        lines.extend(_element_rule(n, spec.elements[n], spec.elements, n in spec.preamble,
                                   tuple(spec.between_markers), n in leads))
    return "\n".join(lines) + "\n"
