"""``chatgrammar formats`` — the bundled (and plugin) formats and the models they cover.

Exit codes: 0 listed; 1 a spec could not be read (listed with its error).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import ChatGrammarError
from ._common import add_command


def register(subparsers: Any) -> None:
    """Add ``chatgrammar formats`` (see the module docstring)."""
    add_command(subparsers, run, __doc__, output="")


def _entries() -> list[dict]:
    from ..core.registry import bundled_paths, plugin_paths
    from ..core.spec import read_spec

    out = []
    bundled = bundled_paths()
    for name, path in sorted({**plugin_paths(), **bundled}.items()):
        entry: dict = {"name": name, "path": str(path),
                       "origin": "bundled" if name in bundled else "plugin"}
        try:
            spec, _ = read_spec(path)
        except ChatGrammarError as exc:
            entry["error"] = str(exc)
        else:
            entry["name"] = spec.name
            entry["covers"] = list(spec.covers)
            entry["description"] = " ".join((spec.description or "").split())
        out.append(entry)
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar formats``; returns the exit code."""
    entries = _entries()
    if args.output == "json":
        print(json.dumps(entries, ensure_ascii=False, indent=2))
    else:
        width = max((len(e["name"]) for e in entries), default=0)
        for e in entries:
            if "error" in e:
                print(f"{e['name']:<{width}}  (cannot read: {e['error']})")
                continue
            covers = "; ".join(e["covers"]) or "(no `covers:` declared)"
            origin = "" if e["origin"] == "bundled" else "  [plugin]"
            print(f"{e['name']:<{width}}  {covers}{origin}")
    return 1 if any("error" in e for e in entries) else 0
