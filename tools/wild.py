"""Templates in the wild: what a user gets from each real chat template, as a table.

For every template in ``tests/data/templates/wild`` (provenance in its ``SOURCES.md``; the
variables a template is rendered with — ``bos_token``, ``eos_token`` — in its
``expected.yaml``), do what a user does with nothing but the template:

1. ``cg.detect_format(chat_template=T)``. When a bundled format is detected, check it against
   the template over the conversation matrix (``chatgrammar.conformance.templates.check_template``: text
   mode and id mode with one id per marker), exactly what ``chatgrammar validate FORMAT
   --template T`` does.
2. Else ``cg.infer_format(T)`` (it verifies itself over the same matrix; a refusal is an
   ``InferenceError``), and check the inferred format the same way.

Each template is then one of:

- ``detected`` / ``inferred``: every case the template renders gets exactly the assistant
  output trained, except the shapes the format refuses on purpose with a located ParseError
  (a bundled format's ``refused:``; an inferred format's ``verification.refused``: tool
  results a template renders with the assistant's header).
- ``safe``: a clear error (DetectionError + InferenceError, or a located ParseError on the
  shapes that do not fit) and no wrong mask.
- ``warned``: some case trains something other than the assistant output, and the format was
  returned with a :class:`chatgrammar.DeviationWarning` saying what (the accepted
  ``unclosed-whitespace`` deviation of an inferred closeless layout): wrong, but never silent.
- ``SILENT WRONG``: some case trains something other than the assistant output and nothing
  raised — the outcome that must never happen.

Then every case that passes is re-checked under each non-default mask policy a trainer uses
(:data:`chatgrammar.conformance.policies.POLICIES`: ``thinking=False``, ``tool_calls=False``,
``last_turn_only``, ``end_marker``, ``roles+system``), the expected mask again from the
template alone: per template and policy ``correct`` / ``safe`` / ``warned`` (its default outcome)
or ``wrong`` (some case trains otherwise under that policy, without an error).

Usage::

    python tools/wild.py                          # print the markdown table
    python tools/wild.py -o /work/wild_results.md # write it (--append NOTES.md adds notes)
    python tools/wild.py -v FILE.jinja …          # some templates, with failure reasons
    python tools/wild.py --json                   # machine-readable

Exit code: 0 when nothing is SILENT WRONG and nothing is wrong under a policy but the known
defects ``expected.yaml`` pins (``policy_wrong``), 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

import chatgrammar as cg  # noqa: E402
from chatgrammar.conformance.policies import POLICIES, check_policies, is_warned  # noqa: E402
from chatgrammar.conformance.templates import check_template  # noqa: E402

WILD = ROOT / "tests" / "data" / "templates" / "wild"


@dataclass
class WildResult:
    """The outcome of one template.

    Attributes:
        template: file name.
        outcome: ``detected``, ``inferred``, ``safe`` or ``SILENT WRONG``.
        format: the format used (bundled name or ``inferred-…``), or None.
        how: ``detected`` / ``inferred`` / ``none``.
        counts: matrix counts of the check (pass / fail / skip) and ``unsafe`` (fails that
            train wrongly instead of raising).
        reason: why it is not fully correct (the first failure or the refusal).
        failures: ``case: reason`` of every failing case.
        policies: policy name (:data:`chatgrammar.conformance.policies.POLICIES`) ->
            ``correct`` / ``safe`` / ``warned`` / ``wrong``: the cases that pass under the
            default policy, re-checked under that policy (``wrong``: some case trains
            otherwise than the template says, with no error).
        policy_failures: ``policy: case: problem`` of every case wrong under a policy.
        policy_warned: the same, of the cases wrong under a policy with a
            :class:`chatgrammar.DeviationWarning` at mask time (plain-text tool calls).
        seconds: time taken.
    """

    template: str
    outcome: str
    format: str | None = None
    how: str = "none"
    counts: dict = field(default_factory=dict)
    reason: str = ""
    failures: list = field(default_factory=list)
    policies: dict = field(default_factory=dict)
    policy_failures: list = field(default_factory=list)
    policy_warned: list = field(default_factory=list)
    seconds: float = 0.0


def load_expected(wild: Path = WILD) -> dict:
    """``expected.yaml`` of the wild folder: template file -> entry (``vars``, ``outcome``…)."""
    p = wild / "expected.yaml"
    if not p.exists():
        return {}
    data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    return data.get("templates") or {}


def default_vars(template: str) -> dict:
    """The special tokens a family's tokenizer would pass, guessed from the template's own
    markers when ``expected.yaml`` names none (transformers passes the tokenizer's
    ``special_tokens_map``; a template that prints ``bos_token`` needs the real one)."""
    if "<|im_end|>" in template or "<|im_start|>" in template:
        return {"bos_token": "", "eos_token": "<|im_end|>"}
    if "<|eot_id|>" in template or "<|start_header_id|>" in template:
        return {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    if "<start_of_turn>" in template or "<|turn>" in template:  # Gemma 2/3, Gemma 4
        return {"bos_token": "<bos>", "eos_token": "<eos>"}
    if "<|end|>" in template and "<|assistant|>" in template:
        return {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
    return {"bos_token": "<s>", "eos_token": "</s>"}


def family_vars(fmt, template: str) -> dict:
    """The variables the detected family's own templates are checked with (its tests.yaml:
    what that family's tokenizer passes), else :func:`default_vars`."""
    from chatgrammar.conformance.format_tests import tests_for
    for t in tests_for(fmt).get("templates") or []:
        if t.get("vars"):
            return {**default_vars(template), **t["vars"]}
    return default_vars(template)


def _unsafe(reason: str) -> bool:
    """A failing case is safe when the format refused to parse it (a located ParseError, in
    text mode or in id mode); anything else (a mask that differs, id mode training otherwise
    than text mode) trained wrongly without an error."""
    return "does not parse" not in reason and "but id mode does not" not in reason


def classify(path: Path, variables: dict | None = None, *, timeout: float = 10.0) -> WildResult:
    """Run what a user runs on one template and classify the result.

    Args:
        path: the template file.
        variables: template variables (default: :func:`default_vars`).
        timeout: per-render time limit.

    Returns:
        A :class:`WildResult`.
    """
    t0 = time.perf_counter()
    text = path.read_text(encoding="utf-8")
    vars_ = dict(default_vars(text) if variables is None else variables)
    res = WildResult(path.name, "safe")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fmt = _resolve(text, vars_, res, t0, variables or {})
    if fmt is None:
        res.policies = {name: _POLICY_OUTCOME.get(res.outcome, res.outcome) for name in POLICIES}
        return res
    warned = any(issubclass(w.category, cg.DeviationWarning) for w in said)
    return _check(fmt, text, path, variables, vars_, res, t0, warned, timeout)


#: A template's outcome under a policy where no case is wrong under it: its default outcome.
_POLICY_OUTCOME = {"detected": "correct", "inferred": "correct", "safe": "safe",
                   "warned": "warned", "SILENT WRONG": "wrong", "CRASH": "CRASH"}


def _check_policies(fmt, chk, res: WildResult) -> None:
    """Re-check the passing cases under every policy of POLICIES (``res.policies``)."""
    try:
        problems = check_policies(fmt, chk)
    except Exception as exc:  # a traceback is a bug, never a safe failure
        problems = {name: [f"policy check raised {type(exc).__name__}: {exc}"[:200]]
                    for name in POLICIES}
    for name, found in problems.items():
        wrong = [f for f in found if not is_warned(f)]
        res.policies[name] = "wrong" if wrong else "warned" if found else \
            _POLICY_OUTCOME.get(res.outcome, res.outcome)
        res.policy_failures += [f"{name}: {f[:220]}" for f in wrong]
        res.policy_warned += [f"{name}: {f[:220]}" for f in found if is_warned(f)]


def _resolve(text: str, vars_: dict, res: WildResult, t0: float, given: dict):
    """Detect, else infer (what a user does); None (and ``res`` says why) when neither works.
    ``given``: the variables expected.yaml names (what the model's tokenizer passes); ``vars_``
    adds guessed ones for inference."""
    from chatgrammar.conformance.infer import resolve_format
    try:
        # what `chatgrammar mask -f auto` / hf.map_fn("auto") use: the detected format, or an
        # inferred one where nothing is detected or the detected one only partly parses
        fmt, res.how = resolve_format(chat_template=text, **given)
        if res.how == "inferred" and not given and vars_:
            # the check renders with the variables a tokenizer of the family passes
            # (default_vars); the user's tokenizer passes the same ones to inference
            try:
                fmt = cg.infer_format(text, **vars_)
            except cg.InferenceError:
                pass
        return fmt
    except cg.InferenceError:
        pass
    try:
        fmt = cg.detect_format(chat_template=text)
        res.how = "detected"
    except cg.DetectionError as exc:
        det_reason = str(exc).splitlines()[0]
        try:
            fmt = cg.infer_format(text, **vars_)
            res.how = "inferred"
        except cg.ChatGrammarError as exc2:
            res.reason = (f"not detected ({det_reason[:80]}); inference refused: "
                          f"{str(exc2).splitlines()[0][:160]}")
            res.seconds = time.perf_counter() - t0
            return None
        except Exception as exc2:  # a traceback is a bug, never a safe failure
            res.outcome = "CRASH"
            res.reason = f"infer_format raised {type(exc2).__name__}: {exc2}"[:200]
            res.seconds = time.perf_counter() - t0
            return None
    return fmt


def _check(fmt, text: str, path: Path, variables: dict | None, vars_: dict, res: WildResult,
           t0: float, warned: bool, timeout: float) -> WildResult:
    """Check the format taken over the matrix and classify (``warned``: a DeviationWarning was
    issued for it)."""
    res.format = fmt.name
    if variables is None and res.how == "detected":
        vars_ = family_vars(fmt, text)
    # the shapes an inferred format refuses on purpose (tool results a template renders with
    # the assistant's header: a located ParseError) count as a bundled format's `refused:`
    refused = dict(getattr(getattr(fmt, "verification", None), "refused", ()) or ()) \
        if res.how == "inferred" else None
    chk = check_template(fmt, text, name=path.name, variables=vars_, timeout=timeout,
                         refused=refused)
    if chk.error:
        res.reason = chk.error[:200]
        res.policies = {name: "safe" for name in POLICIES}
        res.seconds = time.perf_counter() - t0
        return res
    counts = chk.counts()
    fails = [c for c in chk.cases if c.status == "fail"]
    counts["unsafe"] = sum(_unsafe(c.reason) for c in fails)
    res.counts = counts
    res.failures = [f"{c.case}: {c.reason.splitlines()[0][:200] if c.reason else ''}"
                    for c in fails]
    if counts["pass"] == 0 and not fails:
        res.reason = "the template rejects every case of the matrix"
    elif not fails:
        res.outcome = res.how
    elif counts["unsafe"] and warned:
        res.outcome = "warned"
        res.reason = next(f for f, c in zip(res.failures, fails) if _unsafe(c.reason))
    elif counts["unsafe"]:
        res.outcome = "SILENT WRONG"
        res.reason = next(f for f, c in zip(res.failures, fails) if _unsafe(c.reason))
    else:
        res.reason = res.failures[0]
    _check_policies(fmt, chk, res)
    res.seconds = time.perf_counter() - t0
    return res


def run(paths: list[Path], expected: dict | None = None) -> list[WildResult]:
    """Classify every template (variables from ``expected``)."""
    expected = load_expected() if expected is None else expected
    out = []
    for p in paths:
        entry = expected.get(p.name) or {}
        out.append(classify(p, entry.get("vars")))
    return out


def expected_entry(r: WildResult) -> dict:
    """What ``expected.yaml`` pins for one result: ``outcome`` is ``bundled <name>``,
    ``inferred`` or ``refused`` (with the first reason); ``policy_wrong``: the policies under
    which some case is wrong (a known defect, with its first problem); ``policy_warned``: those
    under which it is wrong with the format's DeviationWarning (plain-text calls/reasoning)."""
    if r.outcome == "detected":
        out = {"outcome": f"bundled {r.format}"}
    elif r.outcome == "inferred":
        out = {"outcome": "inferred"}
    elif r.outcome == "warned":
        out = {"outcome": "warned", "reason": r.reason[:160]}
    else:
        out = {"outcome": "refused" if r.outcome == "safe" else r.outcome,
               "reason": r.reason[:160]}
    for key, found in (("policy_wrong", r.policy_failures), ("policy_warned", r.policy_warned)):
        first: dict = {}
        for f in found:
            name, _, problem = f.partition(": ")
            first.setdefault(name, problem[:160])
        if first:
            out[key] = first
    return out


def policy_counts(results: list[WildResult]) -> dict:
    """Policy name -> ``{correct, safe, warned, wrong, untyped}`` counts over the templates
    (``untyped``: of the wrong ones, those whose every problem is reasoning or a tool call in
    a message the format types no such block in: plain text, or tags it has no markers for)."""
    out = {}
    for name in POLICIES:
        tally = {"correct": 0, "safe": 0, "warned": 0, "wrong": 0, "untyped": 0}
        for r in results:
            v = r.policies.get(name, "safe")
            tally[v] = tally.get(v, 0) + 1
            mine = [f for f in r.policy_failures if f.startswith(name + ": ")]
            if v == "wrong" and all("(untyped:" in f for f in mine):
                tally["untyped"] += 1
        out[name] = tally
    return out


def entry_policy_outcome(entry: dict, policy: str) -> str:
    """What a pinned entry says a template gets under ``policy``: ``wrong`` / ``warned`` when
    it is pinned so, else its default outcome (``correct`` / ``safe`` / ``warned`` / ``wrong``)."""
    if policy in (entry.get("policy_wrong") or {}):
        return "wrong"
    if policy in (entry.get("policy_warned") or {}):
        return "warned"
    outcome = entry.get("outcome", "")
    if outcome.startswith("bundled ") or outcome == "inferred":
        return "correct"
    return {"refused": "safe", "warned": "warned", "SILENT WRONG": "wrong"}.get(outcome, outcome)


def entry_policy_counts(entries: dict) -> dict:
    """:func:`policy_counts` recomputed from pinned entries alone (``untyped``: the wrong ones
    whose pinned problem is an untyped block), so pins can be merged without re-running all."""
    out = {}
    for name in POLICIES:
        tally = {"correct": 0, "safe": 0, "warned": 0, "wrong": 0, "untyped": 0}
        for entry in entries.values():
            v = entry_policy_outcome(entry, name)
            tally[v] = tally.get(v, 0) + 1
            if v == "wrong" and "(untyped:" in (entry.get("policy_wrong") or {}).get(name, ""):
                tally["untyped"] += 1
        out[name] = tally
    return out


def write_expected(results: list[WildResult], wild: Path = WILD, *, merge: bool = False) -> None:
    """Record ``results`` in ``expected.yaml`` (the variables already there are kept).

    Args:
        results: the templates classified.
        wild: the wild folder.
        merge: keep the pinned entries of templates not in ``results`` (a run on some
            templates pins those only) and recount ``policy_counts`` from all entries.
    """
    old = load_expected(wild)
    out = {k: v for k, v in old.items() if "outcome" in v} if merge else {}
    for r in results:
        entry = {k: v for k, v in (old.get(r.template) or {}).items() if k == "vars"}
        entry.update(expected_entry(r))
        out[r.template] = entry
    out = dict(sorted(out.items()))
    counts = entry_policy_counts(out) if merge else policy_counts(results)
    head = ("# tests/data/templates/wild/expected.yaml: what a user gets from each real template\n"
            "# (tools/wild.py --write-expected; checked by tests/test_wild.py). outcome:\n"
            "# `bundled NAME` (detected, every matrix case right), `inferred` (cg.infer_format,\n"
            "# every case right) or `refused` (a clear error: DetectionError + InferenceError, or\n"
            "# located ParseErrors on the shapes that do not fit; never a wrong mask). vars: what\n"
            "# the model's tokenizer passes to the template (default: tools/wild.py default_vars /\n"
            "# the detected family's).\n")
    head += ("# policy_wrong: policies (chatgrammar.conformance.policies.POLICIES) under which\n"
             "# some case trains otherwise than the template says (known defects, first problem).\n"
             "# policy_warned: the same where the format declares it (plain_text_tool_calls /\n"
             "# plain_text_reasoning) and warns at mask time (cg.DeviationWarning): never silent.\n"
             "# policy_counts: per policy, templates correct / safe / warned / wrong.\n")
    (wild / "expected.yaml").write_text(
        head + yaml.safe_dump({"policy_counts": counts, "templates": out},
                              sort_keys=False, allow_unicode=True, width=100),
        encoding="utf-8")


def load_policy_counts(wild: Path = WILD) -> dict:
    """The ``policy_counts`` pinned in ``expected.yaml`` (policy -> outcome -> templates)."""
    p = wild / "expected.yaml"
    data = yaml.safe_load(p.read_text(encoding="utf-8")) or {} if p.exists() else {}
    return data.get("policy_counts") or {}


def table(results: list[WildResult]) -> str:
    """The markdown report: totals, then one row per template."""
    n = len(results)
    tally: dict[str, int] = {}
    for r in results:
        tally[r.outcome] = tally.get(r.outcome, 0) + 1
    correct = tally.get("detected", 0) + tally.get("inferred", 0)
    lines = [
        "# Templates in the wild",
        "",
        f"Generated by `python tools/wild.py -o …` over tests/data/templates/wild "
        f"({n} real templates, provenance in its SOURCES.md).",
        "",
        f"- fully correct: **{correct}/{n}** ({100 * correct / max(n, 1):.0f}%): detected "
        f"{tally.get('detected', 0)}, inferred {tally.get('inferred', 0)}",
        f"- safe failure (clear error, no wrong mask): {tally.get('safe', 0)}",
        f"- wrong with a warning (an accepted deviation, cg.DeviationWarning): "
        f"{tally.get('warned', 0)}",
        f"- **SILENT WRONG: {tally.get('SILENT WRONG', 0)}**"
        + (f" · CRASH: {tally['CRASH']}" if tally.get("CRASH") else ""),
        "",
        "Under the other mask policies a trainer uses (the cases that pass with the default, "
        "re-checked: `chatgrammar.conformance.policies`), templates:",
        "",
        "| policy | correct | safe | warned | wrong | of which untyped |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t in policy_counts(results).items():
        lines.append(f"| `{name}` | {t['correct']} | {t['safe']} | {t['warned']} | "
                     f"**{t['wrong']}** | {t['untyped']} |")
    lines += ["", "`untyped`: the format types no tool-call (or reasoning) block in that "
              "message, so the policy cannot drop it: the template writes the call as plain "
              "text, no marker around it (Llama 3.x JSON and pythonic calls, xLAM, Gemma 3 "
              "pythonic, Phi-4-mini JSON: no grammar can tell it from the answer), or in tags "
              "the format does not read as markers (Qwen2.5-Coder's `<tools>`). `warned`: such "
              "a template whose format declares it (`plain_text_tool_calls` / "
              "`plain_text_reasoning`; or `role_folds`: the template writes a message as "
              "another role's turn, Unsloth's ChatML tool results as system turns) and says so "
              "with a `cg.DeviationWarning` when the "
              "policy is asked for: wrong, never silent (`policy_warned` in expected.yaml)."]
    lines += [
        "",
        "| template | outcome | format | pass | fail | unsafe | skip | wrong under | reason |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    order = {"SILENT WRONG": 0, "CRASH": 0, "warned": 1, "safe": 1, "inferred": 2, "detected": 3}
    for r in sorted(results, key=lambda r: (order.get(r.outcome, 9), r.template)):
        c = r.counts
        reason = r.reason.replace("|", "\\|").replace("\n", " ")[:220]
        lines.append(f"| {r.template} | {r.outcome} | {r.format or '–'} | {c.get('pass', '')} | "
                     f"{c.get('fail', '')} | {c.get('unsafe', '')} | {c.get('skip', '')} | "
                     f"{', '.join(k for k, v in r.policies.items() if v == 'wrong')} | "
                     f"{reason} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("templates", nargs="*", type=Path, help="template files (default: all wild)")
    ap.add_argument("-o", "--output", type=Path, help="write the markdown table here")
    ap.add_argument("--append", type=Path, action="append", default=[],
                    help="with -o: append this (markdown notes) file after the table")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failing case")
    ap.add_argument("--write-expected", action="store_true",
                    help="record the outcomes in the wild folder's expected.yaml (keeps vars; "
                         "with TEMPLATES, pins those and keeps every other entry)")
    args = ap.parse_args(argv)
    paths = args.templates or sorted(WILD.glob("*.jinja"))
    results = run(paths)
    pinned = {k: set(v.get("policy_wrong") or ()) for k, v in load_expected().items()}
    if args.write_expected:
        # templates named on the command line are pinned among the others
        write_expected(results, merge=bool(args.templates))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    else:
        md = table(results)
        if args.output:
            extra = "".join(p.read_text(encoding="utf-8") for p in args.append)
            args.output.write_text(md + extra, encoding="utf-8")
        print(md)
        if args.verbose:
            for r in results:
                if r.failures or r.policy_failures:
                    print(f"## {r.template} ({r.format})")
                    for f in r.failures + r.policy_failures:
                        print(f"  - {f}")
    bad = any(r.outcome in ("SILENT WRONG", "CRASH") for r in results)
    # a policy a template is wrong under that expected.yaml does not pin as a known defect
    new = any(v == "wrong" and k not in pinned.get(r.template, ()) for r in results
              for k, v in r.policies.items())
    return 1 if bad or new else 0


if __name__ == "__main__":
    sys.exit(main())
