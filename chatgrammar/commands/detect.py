"""``chatgrammar detect`` — which format a tokenizer and/or chat template speaks, and why.

``--tokenizer PATH_OR_NAME`` loads a transformers tokenizer offline (a local directory, or a
name already in the Hugging Face cache) with ``AutoTokenizer.from_pretrained``; tokenizers that
ship their own code (Kimi's ``TikTokenTokenizer``) need ``--trust-remote-code``. ``--template
FILE`` reads a Jinja chat template. Given both, they must agree. The output names the format,
the evidence that matched and the precedence rule that decided (``--output json`` for the same,
structured).

Exit codes: 0 detected; 1 no format matches, the inputs disagree, or the installed formats'
precedence is broken (one line on stderr); 2 usage error, missing file, tokenizer that cannot
be loaded (one line, no traceback).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import DetectionError
from ._common import UsageError, add_command, error_line, read_template, tokenizer_arg


def register(subparsers: Any) -> None:
    """Add ``chatgrammar detect`` (see the module docstring)."""
    parser = add_command(subparsers, run, __doc__, output="")
    parser.add_argument("--tokenizer", metavar="PATH_OR_NAME",
                        help="a local transformers tokenizer directory (or a name already in "
                             "the Hugging Face cache); loaded offline")
    parser.add_argument("--template", metavar="FILE",
                        help="a Jinja chat template file")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a tokenizer that ships its own Python code (e.g. Kimi's "
                             "tokenization_kimi.py) to run it")


def _err(msg: str) -> None:
    error_line("detect", msg)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _evidence_lines(name: str, ev: dict, winner: str | None) -> list[str]:
    lines = []
    mark = "*" if name == winner else " "
    t = ev.get("tokens")
    head = f"{mark} {name:<14}"
    if t is not None:
        ok = "match" if t["match"] else "no   "
        found = " ".join(f"{k}={v}" for k, v in t["found"].items()) or "-"
        s = f"{head} tokens   {ok}  found: {found}"
        if t["missing"]:
            s += "  missing: " + " ".join(t["missing"])
        if t.get("missing_any"):
            s += "  missing one of: " + " ".join(t["missing_any"])
        if t["forbidden_present"]:
            s += "  must be absent: " + " ".join(t["forbidden_present"])
        lines.append(s)
        head = " " * len(head)
    elif "tokens" in ev:
        lines.append(f"{head} tokens   -      (no token detector)")
        head = " " * len(head)
    c = ev.get("template")
    if c is not None:
        ok = {"match": "match", "mismatch": "no   ", "no-evidence": "-    "}[c["status"]]
        s = f"{head} template {ok}  found: {' '.join(c['found']) or '-'}"
        if c["missing"]:
            s += "  missing: " + " ".join(c["missing"])
        if c["forbidden_present"]:
            s += "  must be absent: " + " ".join(c["forbidden_present"])
        lines.append(s)
    return lines


def _has_evidence(ev: dict) -> bool:
    t, c = ev.get("tokens"), ev.get("template")
    return bool((t and (t["found"] or t["match"])) or (c and (c["found"] or c["match"])))


def _print_evidence(evidence: dict, winner: str | None, indent: str) -> None:
    """Formats with some evidence in detail; the others on one line (JSON has them all)."""
    shown = [n for n in sorted(evidence) if n == winner or _has_evidence(evidence[n])]
    for name in shown:
        for line in _evidence_lines(name, evidence[name], winner):
            print(indent + line)
    rest = [n for n in sorted(evidence) if n not in shown]
    if rest:
        print(f"{indent}  (none of the markers of: {', '.join(rest)})")


def _describe_inputs(args: argparse.Namespace, inputs: dict) -> str:
    parts = []
    if args.tokenizer:
        parts.append(f"tokenizer {args.tokenizer} ({inputs.get('tokenizer')})")
    if inputs.get("template") == "argument":
        parts.append(f"template {args.template}")
    elif inputs.get("template") == "tokenizer":
        parts.append("the tokenizer's own chat template")
    return ", ".join(parts)


def _inferred(tokenizer: Any, template: str | None, exc: DetectionError,
              args: argparse.Namespace) -> int | None:
    """No bundled format: a format inferred from the template (given, or the tokenizer's),
    when inference captures it; None otherwise (the detection error stands)."""
    from ..errors import InferenceError
    from ..conformance.infer import infer_format, template_of

    template = template or template_of(tokenizer)
    if template is None:
        return None
    try:
        fmt = infer_format(template, tokenizer=tokenizer)
    except InferenceError as err:
        args._inference_error = str(err)
        return None
    v = fmt.verification
    if args.output == "json":
        print(json.dumps({"format": fmt.name, "inferred": True,
                          "detection_error": _first_line(exc),
                          "verification": {"checked": list(v.checked),
                                           "rejected": dict(v.rejected),
                                           "notes": list(v.notes)},
                          "spec_yaml": fmt.spec_yaml}, indent=2, ensure_ascii=False))
        return 0
    print(f"format:   no bundled format; inferred {fmt.name} from the chat template")
    print(f"detect:   {_first_line(exc)}")
    print(f"verified: {v.summary()}")
    for note in v.notes:
        print(f"note:     {note}")
    print("spec:     chatgrammar infer TEMPLATE -o SPEC.yaml writes it (docs/inference.md)")
    return 0


def _auto_choice(det: Any, tokenizer: Any, template: str | None) -> str:
    """What ``mask -f auto`` / ``hf.map_fn("auto")`` use instead of the detected format, when
    that one only partly parses the chat template and an inferred one does better
    (:func:`chatgrammar.conformance.infer.resolve_format`); "" when they use the detected one."""
    from ..conformance.infer import _better_of, template_of

    fmt, how = _better_of(det, template or template_of(tokenizer), tokenizer, {})
    if how != "inferred":
        return ""
    v = det.verification.get(det.format) or {}
    return (f"{fmt.name}, inferred from the chat template ({fmt.verification.summary()}): "
            f"{det.format} only partly parses it ({v.get('status')}: {v.get('reason', '')})"
            [:400])


def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar detect``; returns the exit code."""
    from ..core.detect import explain_detection

    if not args.tokenizer and not args.template:
        raise UsageError("give --tokenizer PATH_OR_NAME, --template FILE, or both")
    template = read_template(args.template)
    tokenizer = tokenizer_arg(args.tokenizer, args.trust_remote_code)

    try:
        det = explain_detection(tokenizer, chat_template=template)
    except DetectionError as exc:
        inferred = _inferred(tokenizer, template, exc, args)
        if inferred is not None:
            return inferred
        if args.output == "json":
            print(json.dumps({"format": None, "error": str(exc),
                              "candidates": getattr(exc, "candidates", []),
                              "files": getattr(exc, "files", []),
                              "evidence": getattr(exc, "evidence", {})},
                             indent=2, ensure_ascii=False, default=str))
        else:
            evidence = getattr(exc, "evidence", {}) or {}
            if evidence:
                print("nothing matched; evidence per format:")
                _print_evidence(evidence, None, "  ")
        extra = getattr(args, "_inference_error", None)
        _err(_first_line(exc) + ("; and no format can be inferred from the template: "
                                 + extra.splitlines()[0] if extra else ""))
        return 1
    except TypeError as exc:  # the loaded object offers no tokenizer protocol
        _err(_first_line(exc))
        return 2

    if args.output == "json":
        print(json.dumps(det.to_dict(), indent=2, ensure_ascii=False))
        return 0
    print(f"format:   {det.format}  ({det.path})")
    print(f"input:    {_describe_inputs(args, det.inputs)}")
    print(f"matched:  {', '.join(det.matched)}")
    print(f"decided:  {det.decided_by}")
    for note in det.notes:
        print(f"note:     {note}")
    auto = _auto_choice(det, tokenizer, template)
    if auto:
        print(f"auto:     {auto}")
    print("evidence:")
    _print_evidence(det.evidence, det.format, "  ")
    return 0
