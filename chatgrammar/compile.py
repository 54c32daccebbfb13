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
from dataclasses import dataclass
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


_NON_WORD = re.compile(r"[^A-Za-z0-9]")


@lru_cache(maxsize=4096)
def term_name(marker: str) -> str:
    return "M_" + _NON_WORD.sub("_", marker).upper()


@lru_cache(maxsize=4096)
def rule_name(element: str) -> str:
    return "e_" + _NON_WORD.sub("_", element).lower()


class _PassThroughLexer(Lexer):
    """Lark needs a lexer class; chatgrammar lexes itself, so this one is never used to lex."""

    def __init__(self, lexer_conf):  # noqa: D401 - Lark API
        pass

    def lex(self, data):  # pragma: no cover - the driver in parse.py feeds tokens directly
        yield from data


# ----------------------------------------------------------------------------- semantic checks

# A spec's patterns run on header strings of bounded length: at most ``max_tokens`` tokens in
# id mode, at most ``max_tokens * HEADER_CHARS_PER_TOKEN`` characters in text mode (a longer
# header is cut there and fails its checks). `between` text is read up to BETWEEN_MAX_TOKENS
# tokens in id mode and BETWEEN_MAX_CHARS chars in text mode: between-text is whitespace, and
# 16 whitespace tokens can hold 2,048 chars (Qwen's longest is 128 spaces), so text mode must
# accept at least that much to agree with id mode.
HEADER_CHARS_PER_TOKEN = 16
BETWEEN_MAX_TOKENS = 16
BETWEEN_MAX_CHARS = 4096

_REPEAT_OPS = (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT)
_NO_BACKTRACK_OPS = tuple(op for op in (getattr(sre_parse, "POSSESSIVE_REPEAT", None),
                                        getattr(sre_parse, "ATOMIC_GROUP", None))
                          if op is not None)
_ZERO_WIDTH_OPS = (sre_parse.AT, sre_parse.ASSERT, sre_parse.ASSERT_NOT)
_CATEGORY_RX = {"DIGIT": re.compile(r"\d"), "SPACE": re.compile(r"\s"),
                "WORD": re.compile(r"\w"), "LINEBREAK": re.compile(r"\n")}
# Characters tried when deciding whether two first-character sets overlap (together with
# every literal and range end of the two sets): one of each category and its complement.
_PROBE_CHARS = ("a", "Z", "_", "0", "9", "\u0663", "é", "Ж", "中", " ", "\t", "\n", "\r",
                "\u00a0", "\x00", "\x7f", "!", '"', "\\", "-", "=", "<", "\U0010fffd")
_ANY = (("any",),)
_REGEX_PROBE_BUDGET = 0.05  # seconds one fullmatch of a header-length string may take


def _first(seq) -> tuple[tuple, bool]:
    """(first-character atoms, nullable) of a parsed regex sequence.

    Atoms: ``("lit", cp)``, ``("range", lo, hi)``, ``("cat", name)``, ``("not", atoms)``,
    ``("any",)``. Over-approximated where unsure (a back-reference matches anything).
    """
    atoms: list = []
    for op, av in seq:
        if op is sre_parse.LITERAL:
            atoms.append(("lit", av))
            return tuple(atoms), False
        if op is sre_parse.NOT_LITERAL:
            atoms.append(("not", (("lit", av),)))
            return tuple(atoms), False
        if op is sre_parse.ANY:
            return tuple(atoms) + _ANY, False
        if op is sre_parse.IN:
            inner, neg = [], False
            for iop, iav in av:
                if iop is sre_parse.NEGATE:
                    neg = True
                elif iop is sre_parse.LITERAL:
                    inner.append(("lit", iav))
                elif iop is sre_parse.RANGE:
                    inner.append(("range",) + tuple(iav))
                elif iop is sre_parse.CATEGORY:
                    inner.append(("cat", str(iav)))
                else:
                    inner.append(("any",))
            atoms.extend([("not", tuple(inner))] if neg else inner)
            return tuple(atoms), False
        if op in _ZERO_WIDTH_OPS:
            continue
        if op is sre_parse.SUBPATTERN or op in _NO_BACKTRACK_OPS and not isinstance(av, tuple):
            sub = av[-1] if op is sre_parse.SUBPATTERN else av
            a, nullable = _first(sub)
        elif op in _REPEAT_OPS or op in _NO_BACKTRACK_OPS:
            lo, _hi, sub = av
            a, nullable = _first(sub)
            nullable = nullable or lo == 0
        elif op is sre_parse.BRANCH:
            a, nullable = (), False
            for alt in av[1]:
                aa, n = _first(alt)
                a, nullable = a + aa, nullable or n
        else:  # group references, conditionals, anything unknown: may match anything
            a, nullable = _ANY, True
        atoms.extend(a)
        if not nullable:
            return tuple(atoms), False
    return tuple(atoms), True


def _member(ch: str, atoms: tuple, icase: bool) -> bool:
    cands = {ch, ch.lower(), ch.upper()} if icase else {ch}
    for a in atoms:
        kind = a[0]
        for c in cands:
            if kind == "any":
                return True
            if kind == "lit" and ord(c) == a[1]:
                return True
            if kind == "range" and a[1] <= ord(c) <= a[2]:
                return True
            if kind == "cat":
                name = a[1].rsplit("_", 1)[-1]
                rx = _CATEGORY_RX.get(name)
                hit = True if rx is None else bool(rx.match(c))
                if "_NOT_" in a[1]:
                    hit = not hit if rx is not None else True
                if hit:
                    return True
            if kind == "not" and not _member(c, a[1], False):
                return True
    return False


def _overlap(a: tuple, b: tuple, icase: bool) -> bool:
    """Could one character start both? (Tested on every literal / range end of either set and
    one character of each class, which finds any overlap of these set shapes.)"""
    if not a or not b:
        return False
    chars = set(_PROBE_CHARS)
    stack = list(a) + list(b)
    while stack:
        x = stack.pop()
        if x[0] == "lit":
            chars.add(chr(x[1]))
        elif x[0] == "range":
            chars.update((chr(x[1]), chr(x[2])))
        elif x[0] == "not":
            stack.extend(x[1])
    return any(_member(c, a, icase) and _member(c, b, icase) for c in chars)


def _ambiguous_body(seq, follow: tuple, icase: bool) -> str | None:
    """Inside a repeated body: can a backtracking matcher split the same input in more than
    one way? ``follow``: first characters of whatever comes after ``seq`` (the rest of the
    body, then the next iteration)."""
    items = list(seq)
    for i, (op, av) in enumerate(items):
        rest, rest_nullable = _first(items[i + 1:])
        after = rest + follow if rest_nullable else rest
        if op in _NO_BACKTRACK_OPS:
            continue  # possessive / atomic: never re-entered by backtracking
        if op in _REPEAT_OPS:
            lo, hi, sub = av
            sub_first, _ = _first(sub)
            if hi != lo and _overlap(sub_first, after, icase):
                return ("a quantifier inside a repeated group can give characters to what "
                        "follows it (nested or overlapping quantifiers, as in (a+)+ or "
                        r"(\w+\s?)*): catastrophic backtracking")
            hit = _ambiguous_body(sub, sub_first + after, icase)
            if hit:
                return hit
        elif op is sre_parse.SUBPATTERN:
            hit = _ambiguous_body(av[-1], after, icase)
            if hit:
                return hit
        elif op is sre_parse.BRANCH:
            firsts = []
            for alt in av[1]:
                f, nullable = _first(alt)
                firsts.append(f + after if nullable else f)
                hit = _ambiguous_body(alt, after, icase)
                if hit:
                    return hit
            for j in range(len(firsts)):
                for k in range(j + 1, len(firsts)):
                    if _overlap(firsts[j], firsts[k], icase):
                        return ("alternatives inside a repeated group can match the same text "
                                "(as in (a|a)* or (a|ab|b)*): catastrophic backtracking")
    return None


def _regex_slow(rx: re.Pattern, tree, max_len: int) -> str | None:
    """Time ``fullmatch`` on adversarial strings up to ``max_len`` chars: runs of each
    character the pattern names (and a few others), then a character that breaks the match.
    Catches polynomial blow-ups (``\\w*\\w*\\w*!``) the static check lets through."""
    import time

    alphabet: dict[str, None] = dict.fromkeys("a 0")
    stack = [tree]
    while stack and len(alphabet) < 24:
        seq = stack.pop()
        for op, av in seq:
            if op is sre_parse.LITERAL:
                alphabet[chr(av)] = None
            elif op is sre_parse.IN:
                for iop, iav in av:
                    if iop is sre_parse.LITERAL:
                        alphabet[chr(iav)] = None
                    elif iop is sre_parse.RANGE:
                        alphabet[chr(iav[0])] = None
            elif op is sre_parse.SUBPATTERN:
                stack.append(av[-1])
            elif op in _REPEAT_OPS or op in _NO_BACKTRACK_OPS and isinstance(av, tuple):
                stack.append(av[2])
            elif op is sre_parse.BRANCH:
                stack.extend(av[1])
    n = 16
    while True:
        n = min(n, max_len)
        for ch in alphabet:
            s = ch * n + "\x00"
            t0 = time.perf_counter()
            rx.fullmatch(s)
            if time.perf_counter() - t0 > _REGEX_PROBE_BUDGET:
                return (f"matching a {n}-character string of {ch!r} takes over "
                        f"{_REGEX_PROBE_BUDGET * 1000:.0f} ms (overlapping quantifiers): "
                        "simplify the pattern or lower the header's max_tokens")
        if n >= max_len:
            return None
        n *= 2


def _regex_risk(pattern: str, max_len: int = 64 * HEADER_CHARS_PER_TOKEN) -> str | None:
    """Why ``pattern`` is unsafe to run on untrusted header text of up to ``max_len`` chars,
    or None.

    Rejected: invalid patterns; a repeated group whose body can match the empty string
    (``(a?)*``) or can split the same text in more than one way — a quantifier that can give
    characters to what follows it (``(a+)+b``, ``(\\w+\\s?)*$``, ``(.*a){20}``) or alternatives
    that can start alike (``(a|a)*``, ``(a|b|ab)*``) — the shapes of catastrophic (exponential)
    backtracking; and, as a measured safety net for polynomial blow-ups, a pattern whose
    ``fullmatch`` on an adversarial string of ``max_len`` chars takes over 50 ms.
    Possessive quantifiers and atomic groups (Python 3.11+) never backtrack and are accepted.
    """
    try:
        tree = sre_parse.parse(pattern)
        rx = re.compile(pattern, re.S)
    except re.error as exc:
        return f"invalid regex: {exc}"
    except RecursionError:
        return "regex nested too deeply"
    icase = bool(tree.state.flags & re.IGNORECASE)
    stack = [tree]
    try:
        while stack:
            seq = stack.pop()
            for op, av in seq:
                if op in _REPEAT_OPS:
                    lo, hi, sub = av
                    if hi > 1:
                        sub_first, nullable = _first(sub)
                        if nullable:
                            return ("a repeated group that can match the empty string "
                                    "(as in (a?)*): catastrophic backtracking")
                        hit = _ambiguous_body(sub, sub_first, icase)
                        if hit:
                            return hit
                    stack.append(sub)
                elif op in _NO_BACKTRACK_OPS:
                    stack.append(av[2] if isinstance(av, tuple) else av)
                elif op is sre_parse.SUBPATTERN:
                    stack.append(av[-1])
                elif op is sre_parse.BRANCH:
                    stack.extend(av[1])
                elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):
                    stack.append(av[1])
    except RecursionError:
        return "regex nested too deeply"
    return _regex_slow(rx, tree, max_len)


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
        risk = _regex_risk(p, max_len)
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
        if el.lead is not None:
            if not el.lead:
                raise self.fail("empty `lead`", base + ("lead",))
            inside = [mn for mn, m in self.markers.items() if m.text in el.lead]
            if inside:
                raise self.fail(f"`lead` {el.lead!r} contains marker {inside[0]!r}; a lead is "
                                "plain text", base + ("lead",))

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
        if not close.required and ename not in top:
            raise self.fail("`close.required: false` is for top-level elements (they end "
                            "where the next one opens)", base + ("required",))
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
        if close.follow_after and (not el.follow or close.header is not None or close.after):
            # the follow comes right after the marker, within the same alternative
            raise self.fail("`close.follow_after` needs a `follow` element, and a close "
                            "marker without a close header or `after` markers",
                            base + ("follow_after",))
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


# ----------------------------------------------------------------------------- grammar

def _element_rule(name: str, el: Element, elements: dict[str, Element]) -> list[str]:
    alts: list[str] = []
    opens = " | ".join(term_name(o) for o in el.open)
    open_part = f"({opens})" if len(el.open) > 1 else opens
    tails = [c for c in el.children if elements[c].ends_with_parent]
    body_items = (([TEXT] if el.text else [])
                  + [rule_name(c) for c in el.children if c not in tails]
                  + [term_name(m) for m in el.inner_markers])
    # leading text of the preamble (no opener, no close): never empty, or `start` is ambiguous
    body = ("(" + " | ".join(body_items) + (")+" if not el.open and not el.close else ")*")
            if body_items else "")
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
    if el.close and el.close.follow_after:
        # the follow comes after these close markers, always, and after no other
        fa = el.close.follow_after
        calts = ([term_name(c) for c in el.close.markers if c not in fa]
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
    # Lark's LALR analysis is most of a cold load: tables are also cached on disk, keyed by
    # the grammar text (see chatgrammar.cache; a grammar with conflicts raises, never cached).
    # Actions are kept as (is_shift, arg) pairs whether built or loaded; the driver tests
    # `is_shift is True`. The disk entry is JSON (data that cannot run code): a corrupt or
    # foreign one does not decode and is rebuilt.
    from . import cache

    key = cache.key_for("lalr", grammar)
    hit = cache.load("lalr", key)
    if hit is not None:
        try:
            return (*cache.decode_tables(hit), True)
        except Exception:  # an entry of another shape: rebuild it
            pass
    lk = Lark(grammar, parser="lalr", lexer=_PassThroughLexer, strict=True,
              maybe_placeholders=False)
    pt = lk.parser.parser.parser.parse_table
    from lark.parsers.lalr_analysis import Shift
    data = cache.dump_tables(pt.states, pt.start_states["start"], pt.end_states["start"], Shift)
    cache.store("lalr", key, cache.encode_tables(*data))
    return (*data, True)


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


def _conflict_message(conflicts: tuple[Conflict, ...], spec: FormatSpec,
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


def compile_spec(spec: FormatSpec, src: SpecSource) -> ParseTables:
    """Check a spec and build its LALR tables (cached by grammar text).

    Raises:
        CompileError: semantic problems, or a grammar conflict (reported against the spec
            elements and markers involved, with a shortest input that reaches it: see
            :func:`grammar_conflicts`).
    """
    check_spec(spec, src)
    grammar = build_grammar(spec)
    try:
        states, start, end, shift = _lalr(grammar)
    except GrammarError as exc:
        conflicts = grammar_conflicts(grammar)
        if not conflicts:  # not a conflict (should not happen for generated grammars)
            raise src.error(f"grammar does not build: {exc}", (), CompileError) from None
        msg, loc = _conflict_message(conflicts, spec, grammar)
        n = len(conflicts)
        raise src.error(f"grammar is ambiguous ({n} LALR conflict{'s' if n > 1 else ''}): "
                        + msg, loc, CompileError) from None
    starters = frozenset(k for k, (a, _) in states[start].items() if k.isupper() and k != "$END")
    close_terms = frozenset(term_name(c) for el in spec.elements.values() if el.close
                            for c in el.close.markers)
    until_terms = frozenset(
        term_name(h.until) for el in spec.elements.values()
        for h in (el.header, el.close.header if el.close else None) if h is not None and h.until)
    return ParseTables(states, start, end, shift, grammar, starters, close_terms, until_terms)


def spec_digest(spec: FormatSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]
