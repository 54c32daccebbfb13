"""``chatgrammar norm CONFIG`` — the final norm of a model's text backbone.

Prints how the config was resolved (``kimi_k3 → text_config → kimi_linear``), the norm kind
with its formula, and eps. Exit codes: 0 resolved; 1 the backbone is not in the table (the reason
is printed); 2 the config file is missing or unreadable (one line, no traceback).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import NormError
from ..core.norms import ARROW, trace_final_norm, load_norms, read_config
from ._common import add_command


def register(subparsers: Any) -> None:
    """Add ``chatgrammar norm`` (see the module docstring)."""
    parser = add_command(subparsers, run, __doc__, output="")
    parser.add_argument("config", metavar="CONFIG",
                        help="a config.json, or a model directory containing one")
    parser.add_argument("--norms", metavar="NORMS_YAML", default=None,
                        help="use this norms table instead of the bundled formats/norms.yaml")
    parser.add_argument("--transformers-version", metavar="VERSION", default=None,
                        help="the transformers version whose facts apply (default: the "
                             "installed one)")


def _write(text: str, stream: Any) -> None:
    # the path arrow is not encodable everywhere (e.g. a latin-1 terminal): degrade, never crash
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        text = text.replace(ARROW, " -> ").encode(encoding, "replace").decode(encoding)
    print(text, file=stream)


def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar norm``; returns the exit code."""
    try:
        config = read_config(args.config)
        table = load_norms(args.norms)
    except NormError as exc:
        _write(f"chatgrammar norm: error: {exc}", sys.stderr)
        return 2
    norm, path, why = trace_final_norm(config, table, args.transformers_version)

    if args.output == "json":
        payload = {
            "config": str(args.config),
            "resolved": norm is not None,
            "kind": norm.kind if norm else None,
            "model_type": norm.model_type if norm else None,
            "eps": norm.eps if norm else None,
            "path": path,
            "formula": table.kinds[norm.kind].formula if norm else None,
            "reason": why,
        }
        _write(json.dumps(payload, ensure_ascii=False, indent=2), sys.stdout)
        return 0 if norm else 1

    if norm is None:
        _write(f"path:    {path}", sys.stdout)
        _write("kind:    unknown", sys.stdout)
        _write(f"chatgrammar norm: unknown final norm: {why}", sys.stderr)
        return 1
    kind = table.kinds[norm.kind]
    eps = "unknown" if norm.eps is None else f"{norm.eps:g}"
    _write(f"path:    {norm.path}", sys.stdout)
    _write(f"kind:    {norm.kind}    {kind.formula}", sys.stdout)
    _write(f"eps:     {eps}", sys.stdout)
    _write(f"why:     {why}", sys.stdout)
    return 0
