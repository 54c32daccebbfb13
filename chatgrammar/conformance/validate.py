"""``chatgrammar validate`` as a library: every check of a set of spec files, collected first,
then reported (check-jsonschema style).

Checks, per format spec:

1. **yaml** — syntax (safe loader) and duplicate keys;
2. **schema** — unknown keys, wrong types, missing keys: ALL of them, each located
   ``file:line:col`` with its YAML path (:func:`chatgrammar.core.spec.spec_errors`);
3. **patterns** — content patterns (``between``, header ``pattern``) that can swallow a marker,
   and marker strings hidden inside other marker strings;
4. **compile** — the semantic checks and the strict LALR(1) build; a conflict is reported
   against the spec's elements and markers (:func:`chatgrammar.core.compile.grammar_conflicts`);
5. **examples** — each embedded example (``⟦…⟧`` marks the expected trained text; ``policy:``
   overrides the default policy; ``error:`` means it must fail with that text in the message),
   run in text mode AND in id mode with a :class:`~chatgrammar.conformance.templates.MarkerTokenizer`;

and across the set:

6. **precedence** — :func:`chatgrammar.core.detect.check_precedence`: overlapping detectors must be
   ordered, no cycles, unique names;
7. **norms** — ``norms.yaml`` through :func:`chatgrammar.core.norms.validate_norms`;

and on request: **template** (a real chat template over the conversation matrix,
:mod:`chatgrammar.conformance.templates`) and **tokenizer** (every special marker is one special id; id
mode agrees with text mode).

Example:
    >>> report = validate_paths([])          # every bundled format and norms.yaml
    >>> report.ok, [p.render() for p in report.problems]   # doctest: +SKIP
    (True, [])
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from .._io import read_text
from ..core.compile import regex_risk
from ..errors import ChatGrammarError, CompileError, ParseError, SpecError
from .format_tests import is_tests_file, tests_path
from ..runtime.policy import MaskPolicy
from ..core.spec import (FormatSpec, SpecSource, check_node_graph, duplicate_keys, format_path,
                         spec_errors)

__all__ = ["Problem", "FileResult", "Report", "check_spec_text", "check_spec_file",
           "check_examples", "check_norms_file", "check_tokenizer", "parse_marked",
           "validate_paths", "resolve_paths", "is_norms_file"]

OPEN_MARK, CLOSE_MARK = "\u27e6", "\u27e7"   # ⟦ ⟧


# --------------------------------------------------------------------------- results

@dataclass(frozen=True)
class Problem:
    """One problem found by ``validate``.

    Attributes:
        file: the file concerned.
        message: what is wrong (may span several lines).
        check: which check found it (``yaml``, ``schema``, ``patterns``, ``compile``,
            ``examples``, ``precedence``, ``norms``, ``tests``, ``template``, ``tokenizer``).
        line, col: 1-based position, when known.
        path: the YAML path (``elements.turn.close``), when known.
        severity: ``"error"`` (fails validation) or ``"warning"``.
    """

    file: str
    message: str
    check: str
    line: int | None = None
    col: int | None = None
    path: str | None = None
    severity: str = "error"

    def render(self) -> str:
        """``file:line:col::path: message`` (check-jsonschema's ``{file}::{path}: {message}``,
        with the position where it is known). Continuation lines are indented."""
        where = self.file
        if self.line is not None:
            where += f":{self.line}:{self.col or 1}"
        where += f"::{self.path or '$'}"
        sev = "warning: " if self.severity == "warning" else ""
        msg = self.message.replace("\n", "\n    ")
        return f"{where}: {sev}{msg}"

    def to_dict(self) -> dict:
        """JSON-ready form (same content as :meth:`render`)."""
        return {"file": self.file, "line": self.line, "col": self.col, "path": self.path or "$",
                "check": self.check, "severity": self.severity, "message": self.message}

    @classmethod
    def from_error(cls, err: SpecError, check: str, severity: str = "error") -> "Problem":
        """A located :class:`SpecError` as a problem."""
        return cls(err.file or "<spec>", err.message, check, err.line, err.col, err.path,
                   severity)


@dataclass
class FileResult:
    """One checked file: ``kind`` is ``"format"``, ``"norms"`` or ``"tests"`` (a format's test
    facts); ``name`` the format name."""

    file: str
    kind: str
    name: str | None = None
    checks: list[str] = field(default_factory=list)


@dataclass
class Report:
    """Everything ``validate`` found.

    Attributes:
        files: the files checked.
        problems: every problem, in file order.
        conformance: one :class:`~chatgrammar.conformance.templates.ConformanceResult` per template.
        notes: things the user should know that are not problems (a check that could not run).
    """

    files: list[FileResult] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    conformance: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        """The problems that fail validation."""
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        """No error (warnings allowed)."""
        return not self.errors

    def to_dict(self) -> dict:
        """JSON-ready form: ``{"ok", "files", "problems", "conformance", "notes"}``."""
        return {"ok": self.ok,
                "files": [{"file": f.file, "kind": f.kind, "name": f.name, "checks": f.checks}
                          for f in self.files],
                "problems": [p.to_dict() for p in self.problems],
                "conformance": [c.to_dict() for c in self.conformance],
                "notes": list(self.notes)}


# --------------------------------------------------------------------------- yaml level

def _duplicate_keys(text: str, file: str) -> list[Problem]:
    """Duplicate mapping keys (the safe loader silently keeps the last one)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            check_node_graph(node, file)  # recursive aliases / alias bombs: no walk
    except (yaml.YAMLError, SpecError, RecursionError):
        return []  # reported by the schema stage with its position
    return [Problem(file, f"duplicate key {key!r} (first at line {first.line + 1}); YAML keeps "
                          "only the last one", "yaml", mark.line + 1, mark.column + 1,
                    format_path(path))
            for path, key, first, mark in duplicate_keys(node)]


# --------------------------------------------------------------------------- patterns

def _check_patterns(spec: FormatSpec, src: SpecSource) -> list[Problem]:
    """Content patterns that can swallow a marker; marker strings inside other markers."""
    out: list[Problem] = []
    pats: list[tuple[tuple, str]] = []
    if spec.between is not None:
        pats.append((("between",), spec.between))
    for en, el in spec.elements.items():
        if el.header is not None and el.header.pattern:
            pats.append((("elements", en, "header", "pattern"), el.header.pattern))
        if el.close is not None and el.close.header is not None and el.close.header.pattern:
            pats.append((("elements", en, "close", "header", "pattern"), el.close.header.pattern))
    for loc, pat in pats:
        try:
            rx = re.compile(pat, re.S)
        except re.error as exc:
            out.append(Problem.from_error(src.error(f"invalid regex {pat!r}: {exc}", loc),
                                          "patterns"))
            continue
        if regex_risk(pat):
            continue  # never run it (it may backtrack for hours): the compile stage reports it
        for mn, m in spec.markers.items():
            if rx.fullmatch(m.text):
                out.append(Problem.from_error(src.error(
                    f"content pattern {pat!r} can swallow marker {mn!r} ({m.text!r}); a content "
                    "pattern must not match a marker string", loc), "patterns"))
    texts = {mn: m.text for mn, m in spec.markers.items()}
    for a, ta in texts.items():
        for b, tb in texts.items():
            if a != b and ta != tb and ta in tb:
                out.append(Problem.from_error(src.error(
                    f"marker {a!r} ({ta!r}) is part of marker {b!r} ({tb!r}): text mode always "
                    f"takes the longer one; make sure {b!r} is one token in id mode too",
                    ("markers", b)), "patterns", severity="warning"))
    return out


# --------------------------------------------------------------------------- examples

def parse_marked(text: str) -> tuple[str, list[tuple[int, int]]]:
    """Split an example into its plain text and the ``⟦…⟧`` spans (offsets in the plain text).

    Raises:
        ValueError: unbalanced or nested marks.

    Example:
        >>> parse_marked("a⟦bc⟧d")
        ('abcd', [(1, 3)])
    """
    plain: list[str] = []
    spans: list[tuple[int, int]] = []
    start = None
    n = 0
    for ch in text:
        if ch == OPEN_MARK:
            if start is not None:
                raise ValueError(f"nested {OPEN_MARK} at plain char {n}")
            start = n
        elif ch == CLOSE_MARK:
            if start is None:
                raise ValueError(f"{CLOSE_MARK} without {OPEN_MARK} at plain char {n}")
            spans.append((start, n))
            start = None
        else:
            plain.append(ch)
            n += 1
    if start is not None:
        raise ValueError(f"{OPEN_MARK} at plain char {start} is never closed")
    return "".join(plain), spans


def _mask(spans: Iterable[tuple[int, int]], n: int) -> list[int]:
    m = [0] * n
    for s, e in spans:
        for k in range(s, e):
            m[k] = 1
    return m


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for k, v in enumerate(list(mask) + [0]):
        if v and start is None:
            start = k
        elif not v and start is not None:
            out.append((start, k))
            start = None
    return out


def _mark(text: str, spans: Iterable[tuple[int, int]]) -> str:
    out, pos = [], 0
    for s, e in sorted(spans):
        out += [text[pos:s], OPEN_MARK, text[s:e], CLOSE_MARK]
        pos = e
    out.append(text[pos:])
    return "".join(out)


def check_examples(fmt: Any, tokenizer: Any = None) -> list[Problem]:
    """Run a format's embedded examples in text mode and id mode.

    Id mode uses a :class:`~chatgrammar.conformance.templates.MarkerTokenizer` (each marker one id, each
    other character one id), and also ``tokenizer`` when given (then the trained text must be
    the same as in text mode). An example whose text ends inside a marker string (truncation
    in text) has no id-mode counterpart and runs in text mode only.

    Args:
        fmt: a compiled :class:`~chatgrammar.runtime.format.Format`.
        tokenizer: optional real tokenizer.

    Returns:
        One problem per failing example and mode.
    """
    from .templates import MarkerTokenizer

    src = fmt.source
    synth = MarkerTokenizer.for_format(fmt)
    out: list[Problem] = []

    def problem(i: int, msg: str, sub: tuple = ()) -> None:
        ex = fmt.spec.examples[i]
        label = f"example {ex.name!r}" if ex.name else f"example {i}"
        out.append(Problem.from_error(src.error(f"{label}: {msg}", ("examples", i) + sub),
                                      "examples"))

    for i, ex in enumerate(fmt.spec.examples):
        _check_example(fmt, ex, lambda msg, sub=(), i=i: problem(i, msg, sub), synth, tokenizer)
    return out


def _check_example(fmt: Any, ex: Any, problem: Any, synth: Any, tokenizer: Any) -> None:
    """One embedded example of :func:`check_examples`; ``problem(msg, sub=())`` records a
    failure located at the example (``sub``: the key inside it)."""
    try:
        plain, spans = parse_marked(ex.text)
    except ValueError as exc:
        problem(f"bad {OPEN_MARK}{CLOSE_MARK} marks: {exc}", ("text",))
        return
    try:
        policy = MaskPolicy.from_mapping(ex.policy, base=fmt.default_policy)
    except (ValueError, TypeError) as exc:
        problem(f"bad policy: {exc}", ("policy",))
        return
    ids, starts = synth.encode_with_offsets(plain)
    if ex.error is not None:
        _check_error_example(fmt, ex, plain, spans, ids, synth, problem)
        return
    want = _mask(spans, len(plain))
    try:
        conv = fmt.parse(plain)
    except ParseError as exc:
        problem(f"text mode does not parse it: {str(exc).splitlines()[0]}", ("text",))
        return
    got = conv.mask(policy)
    if got != want:
        problem("text mode trains something else.\n"
                f"expected: {_mark(plain, spans)}\n"
                f"found:    {_mark(plain, _runs(got))}", ("text",))
    if fmt._partial_marker_tail(plain) is not None:  # (the parser's own rule)
        # Text cut inside a marker string: only text can end there (in ids a marker is
        # one token), so there is no id-mode counterpart to compare with.
        return
    try:
        conv_ids = fmt.parse_ids(ids, synth)
    except ParseError as exc:
        problem(f"id mode does not parse it: {str(exc).splitlines()[0]}", ("text",))
        return
    bounds = starts + [len(plain)]
    got_ids = [0] * len(plain)
    for s in conv_ids.spans(policy):
        for k in range(bounds[s.start], bounds[s.end]):
            got_ids[k] = 1
    if got_ids != got:
        problem("id mode (one id per marker) disagrees with text mode.\n"
                f"text mode: {_mark(plain, _runs(got))}\n"
                f"id mode:   {_mark(plain, _runs(got_ids))}", ("text",))
    if tokenizer is not None:
        _check_with_tokenizer(fmt, plain, conv, policy, tokenizer, problem)


def _check_error_example(fmt: Any, ex: Any, plain: str, spans: list, ids: list[int],
                         synth: Any, problem: Any) -> None:
    """An ``error:`` example: both modes raise a ParseError whose message contains it."""
    if spans:
        problem(f"an `error:` example cannot also mark trained text with "
                f"{OPEN_MARK}{CLOSE_MARK}", ("text",))
    for mode in ("text", "id"):
        try:
            if mode == "text":
                fmt.parse(plain)
            else:
                fmt.parse_ids(ids, synth)
        except ParseError as exc:
            if ex.error not in str(exc):
                problem(f"{mode} mode fails, but its message does not contain "
                        f"{ex.error!r}: {str(exc).splitlines()[0]}", ("error",))
        else:
            problem(f"{mode} mode parses it, but the example expects an error "
                    f"containing {ex.error!r}", ("error",))


def _check_with_tokenizer(fmt: Any, plain: str, conv: Any, policy: Any, tokenizer: Any,
                          problem: Any) -> None:
    """Id mode with a real tokenizer trains the same text as text mode (``conv``)."""
    from .templates import encode_text
    from ..runtime.tokenizers import adapt

    rids = encode_text(tokenizer, plain)
    try:
        rconv = fmt.parse_ids(rids, tokenizer)
    except ParseError as exc:
        problem(f"id mode with the tokenizer does not parse it: "
                f"{str(exc).splitlines()[0]}", ("text",))
        return
    ad = adapt(tokenizer)
    t_text = [plain[s.start:s.end] for s in conv.spans(policy)]
    i_text = [ad.decode(rids[s.start:s.end]) for s in rconv.spans(policy)]
    if "".join(t_text) != "".join(i_text):
        problem("id mode with the tokenizer trains other text than text mode: "
                f"{''.join(i_text)!r} vs {''.join(t_text)!r}", ("text",))


# --------------------------------------------------------------------------- one spec

def check_spec_text(text: str, file: str) -> tuple[list[Problem], Any, tuple | None]:
    """Every per-file check of a format spec's source.

    Args:
        text: the YAML.
        file: its name for reports.

    Returns:
        ``(problems, format_or_None, (spec, source) or None)``: the compiled Format when the
        spec compiles, and the schema-valid spec (for the precedence check) when it has one.
    """
    from ..runtime.format import Format

    problems = _duplicate_keys(text, file)
    spec, src, errs = spec_errors(text, file)
    for e in errs:
        problems.append(Problem.from_error(e, "yaml" if e.message.startswith("YAML error")
                                           else "schema"))
    if spec is None:
        return problems, None, None
    pattern_problems = _check_patterns(spec, src)
    problems += pattern_problems
    fmt = None
    try:
        fmt = Format(spec, src)
    except CompileError as exc:
        # the compile stage stops at its first pattern problem, already reported above
        if not (exc.message.startswith("content pattern") and pattern_problems):
            problems.append(Problem.from_error(exc, "compile"))
    except SpecError as exc:
        problems.append(Problem.from_error(exc, "compile"))
    if fmt is not None:
        problems += check_examples(fmt)
        if not spec.examples:
            problems.append(Problem.from_error(src.error(
                "no embedded examples: validate cannot check what this format trains "
                "(add `examples:` with the trained text marked \u27e6\u2026\u27e7)", ()),
                "examples", severity="warning"))
    return problems, fmt, (spec, src)


def check_spec_file(path: str | Path) -> tuple[list[Problem], Any, tuple | None]:
    """:func:`check_spec_text` on a file.

    Raises:
        ChatGrammarError: the file is missing or unreadable (a usage error, not a problem of
            the spec).
    """
    return check_spec_text(_read(path), str(path))


def _read(path: str | Path) -> str:
    return read_text(path, ChatGrammarError)


# --------------------------------------------------------------------------- norms

def is_norms_file(path: str | Path, text: str | None = None) -> bool:
    """Whether a YAML file is a norms table rather than a format spec (named ``norms.yaml``,
    or a mapping with ``backbones`` and no ``markers``)."""
    p = Path(path)
    if p.stem == "norms":
        return True
    if text is None:
        return False
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return False
    return isinstance(data, dict) and "backbones" in data and "markers" not in data


def check_norms_file(path: str | Path) -> tuple[list[Problem], list[str]]:
    """Check a norms table with :func:`chatgrammar.core.norms.validate_norms`.

    Returns:
        ``(problems, notes)``; when the norms module offers no validation function, no
        problems and a note saying the check did not run.
    """
    _read(path)  # a missing / unreadable file is a usage error, as for specs
    try:
        from ..core import norms as norms_mod
    except ImportError as exc:  # pragma: no cover - only while norms.py is being written
        return [], [f"{path}: norms checks unavailable (chatgrammar.core.norms: {exc})"]
    fn = getattr(norms_mod, "validate_norms", None)
    if fn is None:  # pragma: no cover - same
        return [], [f"{path}: norms checks unavailable (chatgrammar.core.norms has no "
                    "validate_norms)"]
    out = []
    for p in fn(path):
        out.append(Problem(getattr(p, "file", str(path)), getattr(p, "message", str(p)),
                           "norms", getattr(p, "line", None), getattr(p, "col", None),
                           getattr(p, "path", None)))
    return out, []


def check_tests_file(path: str | Path, text: str) -> list[Problem]:
    """Check a format's test facts (``<name>.tests.yaml``, :mod:`chatgrammar.conformance.format_tests`)
    as test data: YAML and its schema, not as a spec."""
    from .format_tests import check_tests

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return [Problem(str(path), f"invalid YAML: {exc}", "tests")]
    return [Problem(str(path), m.split(": ", 1)[1] if m.startswith(f"{path}: ") else m, "tests")
            for m in check_tests(data, str(path))]


# --------------------------------------------------------------------------- tokenizer

def check_tokenizer(fmt: Any, tokenizer: Any, name: str = "tokenizer") -> list[Problem]:
    """Every special marker of a format is ONE special id of the tokenizer; examples agree.

    Args:
        fmt: the format.
        tokenizer: a transformers tokenizer, ``tiktoken.Encoding`` or minimal-protocol object.
        name: what to call the tokenizer in messages (its directory).

    Returns:
        The problems (located at the marker in the spec).
    """
    from ..runtime.tokenizers import adapt

    out: list[Problem] = []
    src = fmt.source
    ad = adapt(tokenizer)
    for mn, m in fmt.spec.markers.items():
        if not m.special:
            continue
        if ad.token_id(m.text, special=True) is None:
            soft = ad.token_id(m.text, special=False)
            why = (f"it is the ordinary id {soft}, not a special/added one" if soft is not None
                   else "it is split into several ids")
            out.append(Problem.from_error(src.error(
                f"marker {mn!r} ({m.text!r}) is not one special id of {name}: {why}; id mode "
                "cannot see it (make it `special: false` if it is an ordinary token)",
                ("markers", mn)), "tokenizer"))
    if out:
        return out  # without its markers, id mode cannot parse anything: nothing more to say
    for p in check_examples(fmt, tokenizer):
        if "with the tokenizer" in p.message:
            out.append(Problem(p.file, p.message, "tokenizer", p.line, p.col, p.path))
    return out


# --------------------------------------------------------------------------- the whole set

def resolve_paths(paths: Sequence[str]) -> list[Path]:
    """Command-line PATHs → files: a file as is, a directory → its ``*.yaml``, a bundled format
    name → its spec. No PATH → every bundled format, ``norms.yaml`` and the formats' test facts
    (``<name>.tests.yaml``, checked as test data).

    Raises:
        ChatGrammarError: a PATH that is neither a file, a directory nor a bundled name.
    """
    from ..core.registry import bundled_paths, formats_dir

    if not paths:
        out = list(bundled_paths().values())
        norms = formats_dir() / "norms.yaml"
        if norms.is_file():
            out.append(norms)
        out += [t for t in map(tests_path, bundled_paths().values()) if t.is_file()]
        return [_short(p) for p in out]
    out = []
    for s in paths:
        p = Path(s)
        if p.is_dir():
            found = sorted(q for q in list(p.glob("*.yaml")) + list(p.glob("*.yml"))
                           if not q.name.endswith(".tests.yaml"))  # test facts, not specs
            if not found:
                raise ChatGrammarError(f"no *.yaml files in directory {p}")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            bundled = bundled_paths()
            if s in bundled and not s.endswith((".yaml", ".yml")):
                out.append(_short(bundled[s]))
            else:
                import difflib
                close = difflib.get_close_matches(s, list(bundled), n=1)
                hint = f" (did you mean the bundled format {close[0]!r}?)" if close else ""
                raise ChatGrammarError(f"no such file: {s}{hint}")
    return out


def _short(p: Path) -> Path:
    """A bundled path relative to the working directory when it is below it (shorter
    reports), else as is."""
    try:
        return Path(p).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return Path(p)


def validate_paths(paths: Sequence[str | Path], *, precedence_with_bundled: bool = True
                   ) -> Report:
    """Run every per-file check and the cross-file precedence proof.

    Args:
        paths: spec / norms files (see :func:`resolve_paths` for names and directories); empty
            means every bundled format and ``norms.yaml``.
        precedence_with_bundled: prove precedence over the given specs together with the
            bundled and plugin formats (a given spec replaces a bundled one of the same name),
            since that is the set detection will choose from. False: only the given specs and
            the formats their ``precedence_over`` names (transitively).

    Returns:
        The :class:`Report` (``.formats`` maps format names to compiled formats).

    Raises:
        ChatGrammarError: a missing or unreadable file.
    """
    files = resolve_paths([str(p) for p in paths])
    report = Report()
    report.formats = {}  # type: ignore[attr-defined]
    checked: list[tuple] = []
    seen_files: set[str] = set()
    for f in files:
        key = str(Path(f).resolve())
        if key in seen_files:
            continue
        seen_files.add(key)
        text = _read(f)
        if is_norms_file(f, text):
            probs, notes = check_norms_file(f)
            report.problems += probs
            report.notes += notes
            report.files.append(FileResult(str(f), "norms", None,
                                           ["norms"] if not notes else []))
            continue
        if is_tests_file(f):
            probs = check_tests_file(f, text)
            report.problems += probs
            report.files.append(FileResult(str(f), "tests", None, ["tests"]))
            continue
        probs, fmt, pair = check_spec_text(text, str(f))
        report.problems += probs
        name = pair[0].name if pair else None
        checks = ["yaml", "schema"] + (["patterns", "compile"] if pair else []) + \
                 (["examples"] if fmt is not None else [])
        report.files.append(FileResult(str(f), "format", name, checks))
        if pair:
            checked.append(pair)
        if fmt is not None:
            report.formats[fmt.name] = fmt  # type: ignore[attr-defined]
    if checked:
        report.problems += _precedence(checked, seen_files, precedence_with_bundled)
        for fr in report.files:
            if fr.kind == "format" and fr.name:
                fr.checks.append("precedence")
    return report


def _precedence(checked: list[tuple], seen_files: set[str], with_bundled: bool
                ) -> list[Problem]:
    try:
        from ..core.detect import check_precedence
    except ImportError as exc:  # pragma: no cover
        return [Problem("<set>", f"precedence check unavailable: {exc}", "precedence",
                        severity="warning")]
    pool = list(checked)
    from ..core.registry import bundled_paths, plugin_paths
    from ..core.spec import read_spec
    names = {spec.name for spec, _ in checked}
    others: dict[str, tuple] = {}
    for name, p in {**plugin_paths(), **bundled_paths()}.items():
        if str(Path(p).resolve()) in seen_files:
            continue
        try:
            spec, src = read_spec(p)
        except SpecError:
            continue  # a broken bundled spec is reported when it is validated itself
        if spec.name not in names:  # a given file replaces the format of the same name
            others[spec.name] = (spec, src)
    if with_bundled:
        pool += list(others.values())
    else:
        # only the given specs, plus the formats they declare precedence over (transitively),
        # so that those names resolve
        todo = [n for spec, _ in checked for n in spec.detect.precedence_over]
        added: set[str] = set()
        while todo:
            n = todo.pop()
            if n in added or n not in others:
                continue
            added.add(n)
            pool.append(others[n])
            todo.extend(others[n][0].detect.precedence_over)
    given = {str(Path(src.file).resolve()) for _, src in checked}
    out = []
    for err in check_precedence(pool):
        files = [str(Path(f).resolve()) for f in getattr(err, "files", [err.file])]
        # only report what concerns a checked file (a problem among bundled formats alone
        # belongs to a run that validates them)
        if any(f in given for f in files) or not files:
            out.append(Problem.from_error(err, "precedence"))
    return out
