"""Conformance runner: every bundled format × its real chat templates × the conversation matrix.

For each (format, template) pair named by the format's test facts (``templates:`` in
``formats/<name>.tests.yaml``), renders every case of the built-in matrix
with the template exactly as transformers does, parses it with the format (text mode, and id
mode with a one-id-per-marker tokenizer), and checks that what the format trains is exactly the
assistant output (see :mod:`chatgrammar.conformance.templates` for the oracle). Prints a markdown report;
``--write`` stores it as ``docs/conformance.md``.

Usage::

    python tools/conformance.py                      # print the report
    python tools/conformance.py --write              # regenerate docs/conformance.md
    python tools/conformance.py -f kimi-k3 -v        # one format, with failure details
    python tools/conformance.py --no-inference       # without the used / inferred-vs-bundled columns

The summary's ``used`` column is what ``chatgrammar.conformance.infer.resolve_format`` picks for each
template; ``inferred vs bundled`` compares the format inferred from the template with the
bundled one over the matrix (``chatgrammar.conformance.infer.cross_check``), or says why inference refuses.

Exit code: 0 when no case fails, 1 otherwise (2: usage error).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from chatgrammar.conformance.folds import declare_folds  # noqa: E402
from chatgrammar.conformance.policies import POLICIES, check_policies, is_warned  # noqa: E402
from chatgrammar.conformance.templates import check_template  # noqa: E402
from chatgrammar.errors import ChatGrammarError  # noqa: E402
from chatgrammar.conformance.format_tests import tests_for  # noqa: E402
from chatgrammar.conformance.matrix import case_names  # noqa: E402
from chatgrammar.core.registry import list_formats, load_format  # noqa: E402

TEMPLATE_DIR = ROOT / "tests" / "data" / "templates"
DEFAULT_OUT = ROOT / "docs" / "conformance.md"



def templates_of(name: str) -> list[tuple[str, dict]]:
    """``(template file, template variables)`` for each template a format is checked against:
    the ``templates:`` of its test facts (``formats/<name>.tests.yaml``; provenance of the
    files in tests/data/templates/SOURCES.md). Variables are what transformers would pass from
    the family's tokenizer (``special_tokens_map``), only the ones the templates read."""
    facts = tests_for(load_format(name))
    return [(t["file"], dict(t.get("vars") or {})) for t in facts.get("templates") or []]


MARK = {"pass": "✓", "fail": "✗", "skip": "–", "deviation": "✓†"}


def run(formats: list[str], template_dir: Path) -> tuple[list, list[str]]:
    """Check every (format, template) pair; returns (results, missing template files)."""
    results, missing = [], []
    for name in formats:
        fmt = load_format(name)
        for tname, variables in templates_of(name):
            path = template_dir / tname
            if not path.is_file():
                missing.append(f"{name}: {tname}")
                continue
            results.append(check_template(fmt, path.read_text(encoding="utf-8"), name=tname,
                                          variables=variables))
    return results, missing


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _short(message: str, n: int = 90) -> str:
    """The first clause of an error message, at most ``n`` characters."""
    first = message.splitlines()[0] if message else ""
    return first if len(first) <= n else first[:n - 1].rstrip() + "…"


_RESOLVED: dict = {}


def inference_of(name: str, tname: str, template: str, variables: dict) -> tuple[str, str]:
    """``(used, agreement)`` cells for one (format, template) pair, cached per pair.

    ``used``: what :func:`chatgrammar.conformance.infer.resolve_format` picks for the template with its
    variables (``bundled <name>``, ``inferred``, or ``none: <reason>``). ``agreement``: how the
    inferred format's masks compare with the bundled format's over the matrix
    (:func:`chatgrammar.conformance.infer.cross_check`): ``agree (N)``, ``differ: <cases>``, or
    ``refused: <short reason>`` where inference raises InferenceError.
    """
    from chatgrammar.conformance import infer as inf
    from chatgrammar.errors import InferenceError

    key = (name, tname, tuple(sorted((k, repr(v)) for k, v in variables.items())))
    if key in _RESOLVED:
        return _RESOLVED[key]
    try:
        fmt, how = inf.resolve_format(chat_template=template, **variables)
        used = f"bundled {fmt.name}" if how == "detected" else "inferred"
    except ChatGrammarError as exc:
        used = f"none: {_short(exc.message if hasattr(exc, 'message') else str(exc), 60)}"
    try:
        inferred = inf.infer_format(template, **variables)
    except InferenceError as exc:
        agreement = f"refused: {_short(exc.message)}"
    else:
        cc = inf.cross_check(inferred, load_format(name), template, **variables)
        # cases the bundled format refuses on purpose (its tests.yaml `refused:`) are said
        # as such: neither side is wrong by accident there
        by = sorted({w.split(" refuses it on purpose")[0] for _, w in cc.refused})
        by = [("inferred" if b.startswith("inferred-") else b) for b in by]
        why = (f"; {len(cc.refused)} refused on purpose by {' and '.join(by)}: "
               + ", ".join(f"`{c}`" for c, _ in cc.refused[:2])
               + (" …" if len(cc.refused) > 2 else "")) if cc.refused else ""
        if cc.agree:
            agreement = f"agree ({len(cc.equal)}{why})"
        elif not cc.equal and not cc.differ:
            agreement = "– (no case rendered)"
        else:
            agreement = (f"differ on {len(cc.differ)}: "
                         + ", ".join(f"`{c}`" for c, _ in cc.differ[:4])
                         + (" …" if len(cc.differ) > 4 else "") + why)
    _RESOLVED[key] = (used, agreement)
    return used, agreement


def inference_cells(formats: list[str], template_dir: Path) -> dict:
    """``(format, template) -> (used, agreement)`` for every pair (see :func:`inference_of`)."""
    out = {}
    for name in formats:
        for tname, variables in templates_of(name):
            path = template_dir / tname
            if path.is_file():
                out[(name, tname)] = inference_of(name, tname, path.read_text(encoding="utf-8"),
                                                  variables)
    return out


def inference_counts(cells: dict) -> str:
    """One summary line over :func:`inference_cells`."""
    used = [u for u, _ in cells.values()]
    agr = [a for _, a in cells.values()]
    return (f"Resolution: {sum(u.startswith('bundled') for u in used)} bundled, "
            f"{sum(u == 'inferred' for u in used)} inferred, "
            f"{sum(u.startswith('none') for u in used)} neither. Inference cross-check: "
            f"{sum(a.startswith('agree') for a in agr)} agree, "
            f"{sum(a.startswith('differ') for a in agr)} differ, "
            f"{sum(a.startswith('refused') for a in agr)} refused "
            "(docs/inference.md says which side is wrong where they differ).")


def policy_results(results: list, template_dir: Path | None = None) -> dict:
    """(format, template) -> policy name -> ``["case: problem", …]`` for every checked pair
    (:func:`chatgrammar.conformance.policies.check_policies` on its passing cases). With
    ``template_dir``, the format as resolved for the template: with the messages it writes
    as another role's turn declared (``role_folds``, :func:`declare_folds`), as a user gets
    it from ``detect_format(chat_template=…)``."""
    out = {}
    for r in results:
        if not r.error:
            fmt = load_format(r.format)
            path = template_dir / r.template if template_dir is not None else None
            if path is not None and path.is_file():
                variables = dict(templates_of(r.format)).get(r.template) or {}
                fmt = declare_folds(fmt, path.read_text(encoding="utf-8"), variables)
            out[(r.format, r.template)] = check_policies(fmt, r)
    return out


def policy_lines(policies: dict) -> list[str]:
    """The "Under other mask policies" section: per policy, pairs right and wrong; then the
    first problem of each wrong pair."""
    lines = ["## Under other mask policies", "",
             "Each passing case re-checked under each policy: no reasoning trains under "
             "`thinking=False`, no tool-call name or argument under `tool_calls=False`, and the "
             "other words of the message still do; `last_turn_only` trains exactly the last "
             "assistant message; `end_marker` adds each message's terminator and nothing else; "
             "`roles+system` adds the system prompt and never a user's or a tool's words; id "
             "mode (parse and fast path) agrees. \"untyped\": the template writes the call or "
             "the reasoning as plain text, with no marker a grammar could tell it by. "
             "\"warned\": such a case where the format declares it (`plain_text_tool_calls`, "
             "`plain_text_reasoning`; `role_folds`: the template writes a message as another "
             "role's turn) and says so at mask time with a `DeviationWarning`: "
             "wrong, never silent.", "",
             "| policy | pairs right | pairs warned | pairs wrong |", "|---|---:|---:|---:|"]
    for name in POLICIES:
        wrong = sum(1 for v in policies.values()
                    if any(not is_warned(p) for p in v.get(name) or ()))
        warned = sum(1 for v in policies.values() if v.get(name)) - wrong
        lines.append(f"| `{name}` | {len(policies) - wrong - warned} | {warned} | {wrong} |")
    lines.append("")
    for (f, t), v in policies.items():
        for name, problems in v.items():
            bad = [p for p in problems if not is_warned(p)]
            if bad:
                lines.append(f"- **{f} × {t}**, `{name}`: {_cell(bad[0])}"
                             + (f" (+{len(bad) - 1} more cases)" if len(bad) > 1 else ""))
    return lines + [""]


def markdown(results: list, missing: list[str], formats: list[str],
             inference: dict | None = None, policies: dict | None = None) -> str:
    """The report: summary, per-case grid, failure and skip reasons (``policies``: the
    :func:`policy_results`, a section of their own)."""
    cases = case_names()
    lines = [
        "# Conformance: bundled formats × real chat templates",
        "",
        "Generated by `python tools/conformance.py --write`; do not edit by hand. Each template",
        "(tests/data/templates, provenance in its SOURCES.md) renders the built-in conversation",
        "matrix (`chatgrammar.conformance.matrix`) exactly as transformers does; the format must parse every",
        "rendering, in text mode and in id mode (one id per marker), and train exactly the",
        "assistant output: after the template's generation prompt (or from a body block it",
        "prefills, such as an opened think block), up to the end of the message, terminator",
        "excluded, and nothing outside assistant messages. `chatgrammar validate FORMAT",
        "--template FILE` runs the same check for one pair and shows every mismatch. Shapes a",
        "template rejects (it raises) are skipped. Every case that passes is then re-checked",
        "under the other mask policies a trainer uses (`thinking=False`, `tool_calls=False`,",
        "`last_turn_only`, `end_marker`, `roles+system`: `chatgrammar.conformance.policies`),",
        "the expected mask again from the template alone: the case's own reasoning, tool-call",
        "and content strings located inside each assistant message (see \"Under other mask",
        "policies\" below).",
        "",
        f"Legend: {MARK['pass']} pass · {MARK['deviation']} pass with a documented deviation "
        f"(listed below) · {MARK['fail']} fail · {MARK['skip']} skipped (the template rejects "
        "this conversation).",
        "",
        "## Summary",
        "",
        "| format | template | pass | fail | skipped |",
        "|---|---|---:|---:|---:|",
    ]
    if inference is not None:  # what resolve_format uses, and the inference cross-check
        lines[-2:] = ["| format | template | pass | fail | skipped | used | inferred vs bundled |",
                      "|---|---|---:|---:|---:|---|---|"]
    for r in results:
        c = r.counts()
        extra = ""
        if inference is not None:
            u, a = inference.get((r.format, r.template), ("", ""))
            extra = f" {_cell(u)} | {_cell(a)} |"
        if r.error:
            lines.append(f"| {r.format} | {r.template} | – | – | – |{extra}")
            continue
        lines.append(f"| {r.format} | {r.template} | {c['pass']} | {c['fail']} | {c['skip']} |"
                     f"{extra}")
    tot = {k: sum(r.counts()[k] for r in results) for k in ("pass", "fail", "skip")}
    lines += ["", f"{len(results)} pairs, {sum(tot.values())} cases: {tot['pass']} pass, "
                  f"{tot['fail']} fail, {tot['skip']} skipped.", ""]
    if inference is not None:
        lines += ["`used`: what `chatgrammar.conformance.infer.resolve_format(chat_template=…, **vars)` picks "
                  "for the template; `inferred vs bundled`: whether the format inferred from "
                  "the template (`cg.infer_format`) gives the bundled format's masks on every "
                  "matrix case the template renders (`chatgrammar.conformance.infer.cross_check`), or why "
                  "inference refuses the template.", "", inference_counts(inference), ""]

    lines += ["## Cases", "", "Columns are the matrix cases, in order: "
              + ", ".join(f"{i + 1} `{c}`" for i, c in enumerate(cases)) + ".", ""]
    head = "| format | template | " + " | ".join(str(i + 1) for i in range(len(cases))) + " |"
    lines += [head, "|---|---|" + "|".join(":-:" for _ in cases) + "|"]
    for r in results:
        by = {c.case: "deviation" if c.status == "pass" and c.deviations else c.status
              for c in r.cases}
        cells = " | ".join(MARK.get(by.get(c, ""), " ") for c in cases)
        lines.append(f"| {r.format} | {r.template} | {cells} |")
    lines.append("")

    fails = [(r, c) for r in results for c in r.cases if c.status == "fail"]
    if fails or any(r.error for r in results):
        lines += ["## Failures", "", "First reason of each failing case; run `chatgrammar "
                  "validate FORMAT --template FILE --case NAME` for the rendering with the "
                  "expected and the found spans marked.", ""]
        for r in results:
            if r.error:
                lines.append(f"- **{r.format} × {r.template}**: {_cell(r.error)}")
        for r, c in fails:
            lines.append(f"- **{r.format} × {r.template}**, `{c.case}`: {_cell(c.reason)}")
        lines.append("")
    devs = [(r, c, d) for r in results for c in r.cases if c.status == "pass"
            for d in dict.fromkeys(c.deviations)]
    if devs:
        lines += ["## Documented deviations", "",
                  "Cases that pass with a difference from the assistant output which the format "
                  "makes on purpose and documents (`accepted:` in `formats/<name>.tests.yaml`).", ""]
        for r, c, d in devs:
            lines.append(f"- **{r.format} × {r.template}**, `{c.case}`: {_cell(d)}")
        lines.append("")
    if policies is not None:
        lines += policy_lines(policies)
    skips: dict[tuple, list[str]] = {}
    for r in results:
        for c in r.cases:
            if c.status == "skip":
                skips.setdefault((r.format, r.template, c.reason), []).append(c.case)
    if skips:
        lines += ["## Skipped shapes", ""]
        for (f, t, why), names in skips.items():
            lines.append(f"- {f} × {t}: {', '.join(f'`{n}`' for n in names)} — {_cell(why)}")
        lines.append("")
    assigned = {n: [t for t, _ in templates_of(n)] for n in list_formats()}
    unassigned = sorted(set(p.relative_to(TEMPLATE_DIR).as_posix()
                            for pat in ("*.jinja", "derived/*.jinja")
                            for p in TEMPLATE_DIR.glob(pat))
                        - {t for ts in assigned.values() for t in ts})
    if unassigned:
        lines += ["## Templates without a bundled format", "",
                  "In tests/data/templates but not covered by any bundled format yet: "
                  + ", ".join(unassigned) + ".", ""]
    if missing:
        lines += ["## Missing template files", "", *[f"- {m}" for m in missing], ""]
    no_templates = [f for f in formats if not assigned.get(f)]
    if no_templates:
        lines += ["## Formats without templates here", "", ", ".join(no_templates), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-f", "--format", action="append", default=[], metavar="NAME",
                    help="only these formats (repeatable; default: every bundled format)")
    ap.add_argument("--templates", default=str(TEMPLATE_DIR), metavar="DIR",
                    help="where the template files are (default: tests/data/templates)")
    ap.add_argument("--write", nargs="?", const=str(DEFAULT_OUT), metavar="FILE",
                    help="write the markdown report (default file: docs/conformance.md)")
    ap.add_argument("--no-inference", action="store_true",
                    help="leave out the resolution / inference cross-check columns")
    ap.add_argument("--no-policies", action="store_true",
                    help="leave out the re-check under the other mask policies")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print every failing case with its rendering and marked spans")
    args = ap.parse_args(argv)
    known = list_formats()
    formats = args.format or known
    bad = [f for f in formats if f not in known]
    if bad:
        print(f"conformance: unknown format(s): {', '.join(bad)}", file=sys.stderr)
        return 2
    try:
        results, missing = run(formats, Path(args.templates))
    except ChatGrammarError as exc:
        print(f"conformance: error: {exc}", file=sys.stderr)
        return 2
    cells = None if args.no_inference else inference_cells(formats, Path(args.templates))
    pols = None if args.no_policies else policy_results(results, Path(args.templates))
    report = markdown(results, missing, formats, cells, pols)
    if args.write:
        Path(args.write).write_text(report, encoding="utf-8")
        print(f"wrote {args.write}", file=sys.stderr)
    else:
        sys.stdout.write(report)
    if args.verbose:
        for r in results:
            for c in r.cases:
                if c.status == "fail":
                    print(f"\n### {r.format} × {r.template} · {c.case}: {c.reason}\n{c.details}",
                          file=sys.stderr)
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
