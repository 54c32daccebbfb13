"""Regex safety of a spec's patterns: the compile stage's check that a header, content or
``between`` pattern cannot backtrack catastrophically on a header-length string, and that a
repeated body cannot be split two ways (:func:`regex_risk`, used by
:func:`chatgrammar.core.compile_checks.check_spec` and ``chatgrammar validate``).

Also the bounds that make those strings header-length, shared with the lexers.
"""
from __future__ import annotations

import re
import time

try:  # Python 3.11+: the regex parser moved; the old module name warns
    import re._parser as sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]

# A spec's patterns run on header strings of bounded length: at most ``max_tokens`` tokens in
# id mode, at most ``max_tokens * HEADER_CHARS_PER_TOKEN`` characters in text mode (a longer
# header is cut there and fails its checks). `between` text is read up to BETWEEN_MAX_TOKENS
# tokens in id mode and BETWEEN_MAX_CHARS chars in text mode: between-text is whitespace, and
# 16 whitespace tokens can hold 2,048 chars (Qwen's longest is 128 spaces), so text mode must
# accept at least that much to agree with id mode. 64 tokens, not 16: a Jinja-indented
# template (chujiezheng/chat_templates' multi-line ones) writes 17+ whitespace characters
# between turns, which a tokenizer without merged whitespace ids (one id per character, as
# conformance's MarkerTokenizer) spells as that many tokens.
HEADER_CHARS_PER_TOKEN = 16
BETWEEN_MAX_TOKENS = 64
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


def _cpu_time(rx: re.Pattern, s: str) -> float:
    """CPU seconds this thread spends on one ``rx.fullmatch(s)``."""
    t0 = time.thread_time()
    rx.fullmatch(s)
    return time.thread_time() - t0


def _regex_slow(rx: re.Pattern, tree, max_len: int) -> str | None:
    """Time ``fullmatch`` on adversarial strings up to ``max_len`` chars: runs of each
    character the pattern names (and a few others), then a character that breaks the match.
    Catches polynomial blow-ups (``\\w*\\w*\\w*!``) the static check lets through."""
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
            # CPU time of this thread, not wall time: other processes on a loaded machine
            # (a training node, a CI runner) must not make a safe pattern look slow. The best
            # of three is kept before rejecting, so one descheduling or cache miss cannot.
            if (_cpu_time(rx, s) > _REGEX_PROBE_BUDGET
                    and min(_cpu_time(rx, s) for _ in range(3)) > _REGEX_PROBE_BUDGET):
                return (f"matching a {n}-character string of {ch!r} takes over "
                        f"{_REGEX_PROBE_BUDGET * 1000:.0f} ms (overlapping quantifiers): "
                        "simplify the pattern or lower the header's max_tokens")
        if n >= max_len:
            return None
        n *= 2


def regex_risk(pattern: str, max_len: int = 64 * HEADER_CHARS_PER_TOKEN) -> str | None:
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


