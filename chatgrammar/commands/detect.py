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
import sys
from pathlib import Path
from typing import Any

from ..errors import DetectionError


class _UsageError(Exception):
    """Exit 2 with a one-line message."""


def register(subparsers: Any) -> None:
    """Add the ``detect`` subcommand to the ``chatgrammar`` parser.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.
    """
    parser = subparsers.add_parser(
        "detect",
        help="detect the chat format of a tokenizer and/or chat template, and say why",
        description="Detect which format a tokenizer (its special tokens) and/or a Jinja chat "
                    "template (its literal markers) speaks. Precedence between formats is "
                    "declared in the specs and proven total before anything is detected.",
    )
    parser.add_argument("--tokenizer", metavar="PATH_OR_NAME",
                        help="a local transformers tokenizer directory (or a name already in "
                             "the Hugging Face cache); loaded offline")
    parser.add_argument("--template", metavar="FILE",
                        help="a Jinja chat template file")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a tokenizer that ships its own Python code (e.g. Kimi's "
                             "tokenization_kimi.py) to run it")
    parser.add_argument("--output", choices=("text", "json"), default="text",
                        help="output format (default: text)")
    parser.set_defaults(func=run)


def _err(msg: str) -> None:
    print(f"chatgrammar detect: error: {msg}", file=sys.stderr)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """Load a transformers tokenizer offline, for ``chatgrammar detect``.

    Args:
        name_or_path: a local tokenizer directory (a ``tokenizer_config.json`` /
            ``tokenizer.json`` file stands for its directory), or a name in the local cache.
        trust_remote_code: let a tokenizer that ships its own code run it.

    Returns:
        The tokenizer.

    Raises:
        _UsageError: transformers missing, path missing, remote code not allowed, or any load
            failure (one line).
    """
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise _UsageError("--tokenizer needs transformers: pip install 'chatgrammar[transformers]'")
    p = Path(name_or_path).expanduser()
    looks_like_path = (p.exists() or name_or_path.startswith((".", "/", "~"))
                       or name_or_path.count("/") > 1 or "\\" in name_or_path)
    if looks_like_path and not p.exists():
        raise _UsageError(f"no such tokenizer directory: {name_or_path}")
    if p.is_file():
        if p.name in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
            p = p.parent
        else:
            raise _UsageError(f"--tokenizer expects a tokenizer directory, got the file {p}")
    target = str(p) if p.exists() else name_or_path
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # keep stderr to our one line
    try:
        return AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code,
                                             local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - every failure is one line, exit 2
        msg = _first_line(exc)
        if not trust_remote_code and ("trust_remote_code" in str(exc)
                                      or "custom code" in str(exc)):
            raise _UsageError(f"the tokenizer at {target} ships its own code; rerun with "
                              "--trust-remote-code to allow it to run") from None
        raise _UsageError(f"cannot load tokenizer {target!r} offline: "
                          f"{type(exc).__name__}: {msg}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


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


def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar detect``; returns the exit code."""
    from ..detect import explain_detection

    if not args.tokenizer and not args.template:
        _err("give --tokenizer PATH_OR_NAME, --template FILE, or both")
        return 2
    try:
        template = None
        if args.template:
            tp = Path(args.template)
            if not tp.is_file():
                raise _UsageError(f"no such template file: {args.template}")
            try:
                template = tp.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise _UsageError(f"cannot read {args.template}: {exc}") from None
        tokenizer = (load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
                     if args.tokenizer else None)
    except _UsageError as exc:
        _err(str(exc))
        return 2

    try:
        det = explain_detection(tokenizer, chat_template=template)
    except DetectionError as exc:
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
        _err(_first_line(exc))
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
    print("evidence:")
    _print_evidence(det.evidence, det.format, "  ")
    return 0
