"""Semantic checks Lark cannot do (:func:`check_spec`): every name refers to something declared,
every construct is used where it means something, no pattern can backtrack catastrophically
or swallow a marker. Each failure is a :class:`CompileError` located in the YAML.
"""
from __future__ import annotations

import re
from typing import Any

from .compile_regex import BETWEEN_MAX_CHARS, HEADER_CHARS_PER_TOKEN, regex_risk
from ..errors import CompileError
from .spec import Element, FormatSpec, SpecSource

def check_spec(spec: FormatSpec, src: SpecSource) -> None:
    """Semantic checks Lark cannot do: every name refers to something declared, every
    construct is used where it means something, and no pattern can backtrack catastrophically
    or swallow a marker.

    Args:
        spec: the schema-checked spec.
        src: where it came from, to locate errors.

    Raises:
        CompileError: the first problem, located in the YAML (the checks run in the order of
            :class:`_SpecChecks`' methods, element by element).
    """
    ck = _SpecChecks(spec, src)
    ck.marker_texts()
    ck.top_level()
    split_delims: dict[str, str] = {}  # opener marker -> the literal its headers end at
    for ename, el in spec.elements.items():
        ck.element_references(ename, el)
        ck.element_shape(ename, el)
        base = ("elements", ename)
        ck.header(el, base + ("header",), el.header, split_delims)
        if el.close:
            ck.header(el, base + ("close", "header"), el.close.header, split_delims)
            ck.close(ename, el)
    ck.split_openers(split_delims)
    ck.prompts_and_policy()


class _SpecChecks:
    """The parts of :func:`check_spec`, each raising a located :class:`CompileError`."""

    def __init__(self, spec: FormatSpec, src: SpecSource):
        self.spec = spec
        self.src = src
        self.markers = spec.markers

    def fail(self, message: str, loc: tuple) -> CompileError:
        return self.src.error(message, loc, CompileError)

    # -------------------------------------------------------------- names and patterns
    def need_marker(self, name: str, loc: tuple) -> None:
        if name not in self.markers:
            raise self.fail(f"unknown marker {name!r}; declared markers: "
                            f"{', '.join(sorted(self.markers))}", loc)

    def need_element(self, name: str, loc: tuple) -> None:
        if name not in self.spec.elements:
            raise self.fail(f"unknown element {name!r}; declared elements: "
                            f"{', '.join(sorted(self.spec.elements))}", loc)

    def pattern(self, p: str | None, loc: tuple, max_len: int) -> None:
        """A regex of the spec: no catastrophic backtracking, and no marker matched whole."""
        if p is None:
            return
        risk = regex_risk(p, max_len)
        if risk:
            raise self.fail(risk, loc)
        rx = re.compile(p, re.S)
        for mname, m in self.markers.items():
            if rx.fullmatch(m.text):
                raise self.fail(f"content pattern {p!r} can swallow marker {mname!r} "
                                f"({m.text!r})", loc)

    # -------------------------------------------------------------- the spec's top level
    def marker_texts(self) -> None:
        texts: dict[str, str] = {}
        for name, m in self.markers.items():
            if m.text in texts:
                raise self.fail(f"marker text {m.text!r} is declared twice ({texts[m.text]!r} "
                                f"and {name!r})", ("markers", name))
            texts[m.text] = name

    def top_level(self) -> None:
        spec = self.spec
        for i, n in enumerate(spec.top):
            self.need_element(n, ("top", i))
        for i, n in enumerate(spec.preamble):
            if n not in self.markers and n not in spec.elements:
                raise self.fail(f"preamble item {n!r} is neither a marker nor an element",
                                ("preamble", i))
        for i, n in enumerate(spec.between_markers):
            self.need_marker(n, ("between_markers", i))
        self.pattern(spec.between, ("between",), BETWEEN_MAX_CHARS)
        self.pattern(spec.trailing, ("trailing",), BETWEEN_MAX_CHARS)

    def prompts_and_policy(self) -> None:
        for i, g in enumerate(self.spec.generation_prompt):
            if not g:
                raise self.fail("empty generation prompt", ("generation_prompt", i))
        for r in self.spec.policy.roles:
            if not r:
                raise self.fail("empty role", ("policy", "roles"))

    # -------------------------------------------------------------- one element
    def element_references(self, ename: str, el: Element) -> None:
        """Openers, children, inner markers and the follow element exist and fit."""
        base = ("elements", ename)
        for i, o in enumerate(el.open):
            self.need_marker(o, base + ("open", i))
        for k in el.role_by_marker:
            if k not in el.open:
                raise self.fail(f"role_by_marker key {k!r} is not one of this element's "
                                "openers", base + ("role_by_marker", k))
        for i, c in enumerate(el.children):
            self.need_element(c, base + ("children", i))
        for i, m in enumerate(el.inner_markers):
            self.need_marker(m, base + ("inner_markers", i))
            if el.close is not None and m in el.close.markers and el.close.header is not None:
                # the close is then the last such marker (runtime/parse.py, _is_last_close),
                # which a close header's text after it would hide
                raise self.fail(f"inner marker {m!r} is also a close marker: the close cannot "
                                "have a header", base + ("inner_markers", i))
        if el.follow:
            self.need_element(el.follow, base + ("follow",))
            if self.spec.elements[el.follow].open:
                raise self.fail("a follow element must have no opener (it starts where this "
                                "one closes)", base + ("follow",))
            if self.spec.elements[el.follow].close is None:
                raise self.fail("a follow element needs a close marker", base + ("follow",))

    def element_shape(self, ename: str, el: Element) -> None:
        """How the element starts and ends: opener / close, ``ends_with_parent``, ``lead``."""
        spec, base = self.spec, ("elements", ename)
        if not el.open and el.close is None:
            # the one exception: a leading text element of the preamble (DeepSeek's bare
            # system text after BOS), which runs to the first top-level opener
            if ename not in spec.preamble or ename in spec.top or any(
                    ename in pel.children or pel.follow == ename
                    for pel in spec.elements.values()):
                raise self.fail("an element needs an opener or a close marker (only a "
                                "preamble element may have neither: leading text)", base)
        if el.ends_with_parent:
            self.ends_with_parent(ename, el)
        elif el.kind_when_cut is not None:
            raise self.fail("`kind_when_cut` is for an `ends_with_parent` element (one that "
                            "runs to its parent's close)", base + ("kind_when_cut",))
        if el.lead:
            if not all(el.lead):
                raise self.fail("empty `lead`", base + ("lead",))
            for lead in el.lead:
                inside = [mn for mn, m in self.markers.items() if m.text in lead]
                if inside:
                    raise self.fail(f"`lead` {lead!r} contains marker {inside[0]!r}; a lead "
                                    "is plain text", base + ("lead",))

    def ends_with_parent(self, ename: str, el: Element) -> None:
        spec, base = self.spec, ("elements", ename)
        if el.close is not None or not el.open or el.follow:
            raise self.fail("an `ends_with_parent` element needs an opener and neither a "
                            "close marker nor a follow element", base)
        if ename in spec.top or ename in spec.preamble:
            raise self.fail("an `ends_with_parent` element must be a child, not a top-level "
                            "item", base)
        for pname, pel in spec.elements.items():
            # the parent's close ends it; a parent that itself runs to its own parent's
            # close (a chain of them: Functionary's `>>>` segments) ends there too
            if ename in pel.children and pel.close is None and not pel.ends_with_parent:
                raise self.fail(f"`ends_with_parent` element {ename!r} is a child of "
                                f"{pname!r}, which has no close marker", base)

    def header(self, el: Element, hloc: tuple, h: Any, split_delims: dict[str, str]) -> None:
        """An element header or a close header (``hloc`` ends with ``("close", "header")``);
        records the literal each opener's headers end at in ``split_delims``."""
        if h is None:
            return
        is_close = hloc[-2:] == ("close", "header")
        if (h.until is None) == (h.until_text is None):
            raise self.fail("a header needs exactly one of `until` (a marker) or "
                            "`until_text` (a literal)", hloc)
        if h.until is not None:  # an empty name is an unknown marker too
            self.need_marker(h.until, hloc + ("until",))
        if h.until_text == "":
            raise self.fail("empty `until_text`", hloc + ("until_text",))
        for i, hm in enumerate(h.markers):
            self.need_marker(hm, hloc + ("markers", i))
        self.pattern(h.pattern, hloc + ("pattern",), h.max_tokens * HEADER_CHARS_PER_TOKEN)
        if h.trained_after is not None:
            if is_close:
                raise self.fail("`trained_after` is for an element's header (a close header "
                                "is part of the terminator)", hloc + ("trained_after",))
            if h.pattern is None or h.trained_after not in re.compile(
                    h.pattern, re.S).groupindex:
                raise self.fail(f"`trained_after` names {h.trained_after!r}, which is not a "
                                "named group of this header's `pattern`",
                                hloc + ("trained_after",))
        if h.until_text is not None:
            if is_close:
                raise self.fail("a close header must end at a marker (`until`)", hloc)
            if not el.open:
                raise self.fail("`until_text` needs an opener marker", hloc)
            for o in el.open:
                prev = split_delims.get(o)
                if prev is not None and prev != h.until_text:
                    raise self.fail(f"marker {o!r} opens headers ending at both {prev!r} and "
                                    f"{h.until_text!r}; the lexer cannot tell them apart", hloc)
                split_delims[o] = h.until_text

    def close(self, ename: str, el: Element) -> None:
        """The close markers, and the close keys that only mean something in some places."""
        base, close, top = ("elements", ename, "close"), el.close, self.spec.top
        for i, c in enumerate(close.markers):
            self.need_marker(c, base + ("markers", i))
        if not close.required and ename not in top and not (
                el.open and any(ename in e.children for e in self.spec.elements.values())):
            # a child ends at its parent's close or a sibling's opener: without an opener of
            # its own, where it starts could not be told either
            raise self.fail("`close.required: false` is for top-level elements (they end "
                            "where the next one opens) and children with an opener (they "
                            "end where their parent's close or a sibling's opener comes)",
                            base + ("required",))
        if close.roles and ename not in top:
            raise self.fail("`close.roles` is for top-level elements (a turn of another "
                            "role ends where the next one opens)", base + ("roles",))
        for i, r in enumerate(close.roles):
            if not r:
                raise self.fail("empty role", base + ("roles", i))
        for i, c in enumerate(close.after):
            self.need_marker(c, base + ("after", i))
        for i, c in enumerate(close.follow_after):
            self.need_marker(c, base + ("follow_after", i))
            if c not in close.markers:
                raise self.fail(f"`follow_after` marker {c!r} is not one of this element's "
                                "close markers", base + ("follow_after", i))
        for i, c in enumerate(close.untrained_when_empty):
            if c not in close.markers:
                raise self.fail(f"`untrained_when_empty` marker {c!r} is not one of this "
                                "element's close markers", base + ("untrained_when_empty", i))
        if close.follow_after and (not el.follow or close.header is not None):
            # the follow comes right after the marker, within the same alternative (`after`
            # markers follow only the other close markers)
            raise self.fail("`close.follow_after` needs a `follow` element, and a close "
                            "marker without a close header", base + ("follow_after",))
        if close.opens_follow:
            # the follow element must start right at the marker: no header of its own to
            # read first, and nothing of this element's end after the marker
            f = self.spec.elements.get(el.follow) if el.follow else None
            if f is None or f.header is not None or close.header is not None or close.after:
                raise self.fail("`close.opens_follow` needs a `follow` element without a "
                                "header, and a close marker without a close header or "
                                "`after` markers", base + ("opens_follow",))

    def split_openers(self, split_delims: dict[str, str]) -> None:
        """Markers opening ``until_text`` headers must not open elements with marker-ended
        headers too (the lexer splits the text run after such an opener)."""
        for ename, el in self.spec.elements.items():
            if el.header and el.header.until and any(o in split_delims for o in el.open):
                raise self.fail("this element's opener also opens an element whose header "
                                "ends at a literal; the lexer cannot tell them apart",
                                ("elements", ename, "open"))
