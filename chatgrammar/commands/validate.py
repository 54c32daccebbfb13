"""``chatgrammar validate [PATH…]`` — check format specs (and norms.yaml) before anyone trains.

Every check runs and every problem is collected before anything is reported
(check-jsonschema style): one line ``file:line:col::yaml.path: message`` per problem in text,
the same content with ``--output json``. See :mod:`chatgrammar.conformance.validate` for the checks.

Exit codes: 0 no errors (warnings allowed); 1 problems found; 2 usage error (a missing or
unreadable file, a bad option).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ChatGrammarError
from ._common import (UsageError, add_command, add_tokenizer_args, key_values, read_template,
                      tokenizer_arg)


def register(subparsers: Any) -> None:
    """Add ``chatgrammar validate`` (see the module docstring)."""
    p = add_command(subparsers, run, __doc__, output="")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="spec files, directories of specs, bundled format names, or norms.yaml")
    p.add_argument("--template", action="append", default=[], metavar="FILE",
                   help="a Jinja chat template to check against its format (repeatable)")
    p.add_argument("-f", "--format", dest="format", metavar="NAME|PATH",
                   help="the format the --template / --tokenizer belong to (default: the only "
                        "spec given, else detected from the template / tokenizer)")
    add_tokenizer_args(p, "a local transformers tokenizer directory: every special marker "
                          "must be one special id, and id mode must agree with text mode")
    p.add_argument("--var", action="append", default=[], metavar="KEY=VALUE",
                   help="a template variable for --template (bos_token=<s>); VALUE is JSON if "
                        "it parses as JSON, else a string (repeatable)")
    p.add_argument("--case", action="append", default=[], metavar="NAME",
                   help="only these matrix cases (repeatable; default: all)")
    p.add_argument("--isolated", action="store_true",
                   help="prove detector precedence among the given specs only (default: together "
                        "with the bundled and plugin formats, the set detection chooses from)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also list the files and template cases that pass")


def _beaten(cands: list, formats: dict) -> list:
    """Drop candidates another candidate takes (transitive) precedence over."""
    beats = {n: set(formats[n].spec.detect.precedence_over) for n in cands}
    changed = True
    while changed:
        changed = False
        for a in cands:
            for b in list(beats[a]):
                extra = beats.get(b, set()) - beats[a]
                if extra:
                    beats[a] |= extra
                    changed = True
    return [n for n in cands if not any(n in beats[m] for m in cands if m != n)]


def _pick_for_template(src: str, formats: dict) -> tuple[Any, str | None]:
    cands = [n for n, f in formats.items() if f.spec.detect.template
             and all(t in src for t in f.spec.detect.template)
             and not any(t in src for t in f.spec.detect.template_absent)]
    return _pick(cands, formats, "template")


def _pick_for_tokenizer(tok: Any, formats: dict) -> tuple[Any, str | None]:
    from ..runtime.tokenizers import adapt

    ad = adapt(tok)
    cands = []
    for n, f in formats.items():
        d = f.spec.detect
        if not (d.require or d.require_any):
            continue
        has = lambda t: ad.token_id(t, special=True) is not None  # noqa: E731
        if all(has(t) for t in d.require) and (not d.require_any or any(
                has(t) for t in d.require_any)) and not any(has(t) for t in d.absent):
            cands.append(n)
    return _pick(cands, formats, "token")


def _pick(cands: list, formats: dict, detector: str) -> tuple[Any, str | None]:
    """The one candidate left after precedence, or None and why not."""
    win = _beaten(cands, formats)
    if len(win) == 1:
        return formats[win[0]], None
    if not cands:
        return None, f"no checked format's {detector} detector matches it"
    return None, f"several formats match it ({', '.join(sorted(cands))})"


def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar validate``; returns the exit code (a UsageError is the caller's: 2)."""
    from ..conformance.templates import check_template
    from ..conformance.matrix import default_matrix
    from ..core.registry import load_format
    from ..conformance.validate import Problem, check_tokenizer, validate_paths

    variables = key_values(args.var, "--var")
    templates = [(t, read_template(t)) for t in args.template]
    cases = None
    if args.case:
        known = {c.name: c for c in default_matrix()}
        bad = [c for c in args.case if c not in known]
        if bad:
            raise UsageError(f"unknown matrix case(s) {', '.join(bad)}; known: {', '.join(known)}")
        cases = [known[c] for c in args.case]
    try:
        report = validate_paths(args.paths, precedence_with_bundled=not args.isolated)
    except ChatGrammarError as exc:
        raise UsageError(str(exc)) from None
    formats: dict = dict(getattr(report, "formats", {}))

    pinned = None
    if args.format:
        if args.format in formats:
            pinned = formats[args.format]
        else:
            try:
                pinned = load_format(args.format)
            except ChatGrammarError as exc:
                raise UsageError(f"--format: {exc}") from None
    elif (templates or args.tokenizer):
        given = [f for f in report.files if f.kind == "format"]
        if args.paths and len(given) == 1 and given[0].name in formats:
            pinned = formats[given[0].name]
        elif args.paths and len(given) == 1:
            # the one spec given does not compile: nothing to check the template against
            report.notes.append("the template / tokenizer checks did not run: the spec does "
                                "not compile")
            templates = []
            args.tokenizer = None

    tokenizer = tokenizer_arg(args.tokenizer, args.trust_remote_code)

    pool = formats
    if not pool:
        from ..core.registry import all_formats
        try:
            pool = {f.name: f for f in all_formats()}
        except ChatGrammarError:
            pool = {}
    tok_formats: list = []
    for tpath, tsrc in templates:
        fmt, why = (pinned, None) if pinned is not None else _pick_for_template(tsrc, pool)
        if fmt is None:
            report.problems.append(Problem(tpath, f"cannot tell which format this template is "
                                                  f"for: {why}; pass -f NAME", "template"))
            continue
        res = check_template(fmt, tsrc, name=tpath, cases=cases, tokenizer=tokenizer,
                             tokenizer_name=args.tokenizer, variables=variables)
        report.conformance.append(res)
        if res.error:
            report.problems.append(Problem(tpath, res.error, "template"))
        for c in res.cases:
            if c.status == "fail":
                report.problems.append(Problem(
                    tpath, f"{fmt.name}: {c.reason}\n{c.details}", "template", path=c.case))
        if fmt not in tok_formats:
            tok_formats.append(fmt)
    if tokenizer is not None:
        if pinned is not None and pinned not in tok_formats:
            tok_formats.append(pinned)
        if not tok_formats:
            fmt, why = _pick_for_tokenizer(tokenizer, pool)
            if fmt is None:
                report.problems.append(Problem(args.tokenizer, f"cannot tell which format this "
                                                               f"tokenizer is for: {why}; pass "
                                                               "-f NAME", "tokenizer"))
            else:
                tok_formats.append(fmt)
        for fmt in tok_formats:
            report.problems += check_tokenizer(fmt, tokenizer, args.tokenizer)

    if args.output == "json":
        data = report.to_dict()
        data["summary"] = _summary(report)
        print(json.dumps(data, ensure_ascii=False, indent=2))
    else:
        _print_text(report, args.verbose)
    return 0 if report.ok else 1


def _summary(report) -> str:
    n_err = len(report.errors)
    n_warn = len(report.problems) - n_err
    kinds = [f for f in report.files if f.kind == "format"]
    norms = [f for f in report.files if f.kind == "norms"]
    what = f"{len(kinds)} format spec{'s' if len(kinds) != 1 else ''}"
    if norms:
        what += f", {len(norms)} norms table{'s' if len(norms) != 1 else ''}"
    facts = [f for f in report.files if f.kind == "tests"]
    if facts:
        what += f", {len(facts)} test-facts file{'s' if len(facts) != 1 else ''}"
    for c in report.conformance:
        what += f", template {Path(c.template).name}"
    if n_err:
        files = len({p.file for p in report.errors})
        head = (f"{n_err} error{'s' if n_err > 1 else ''} in {files} "
                f"file{'s' if files > 1 else ''}")
    else:
        head = "ok"
    warn = f", {n_warn} warning{'s' if n_warn > 1 else ''}" if n_warn else ""
    return f"validate: {head}{warn} ({what} checked)"


def _write(text: str) -> None:
    enc = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(enc)
    except (UnicodeEncodeError, LookupError):
        text = text.encode(enc, "backslashreplace").decode(enc)
    print(text)


def _print_text(report, verbose: bool) -> None:
    for p in report.problems:
        _write(p.render())
    for c in report.conformance:
        _write(c.summary())
        for case in c.cases:
            if case.status == "skip":
                _write(f"  skipped {case.case}: {case.reason}")
            elif case.status == "fail":
                _write(f"  FAIL {case.case}: {case.reason}")
            elif verbose:
                _write(f"  pass {case.case}" + (f" ({'; '.join(case.notes)})"
                                                 if case.notes else ""))
    if verbose:
        for f in report.files:
            bad = any(p.file == f.file and p.severity == "error" for p in report.problems)
            _write(f"{'FAIL' if bad else 'ok  '} {f.file}"
                   + (f" ({f.name})" if f.name else "") + f": {', '.join(f.checks)}")
    for n in report.notes:
        _write(f"note: {n}")
    _write(_summary(report))
