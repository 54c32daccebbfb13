"""``chatgrammar grammar NAME|PATH`` — print the compiled Lark grammar of a format.

The grammar is what the spec compiles to (strict LALR(1)); reading it is the quickest way to see
how elements, headers and markers became rules and terminals. Exit codes: 0 printed; 1 the spec
is invalid or does not compile (the error names file:line:col); 2 usage error.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ChatGrammarError
from ._common import add_command, error_line, load_format_arg


def register(subparsers: Any) -> None:
    """Add ``chatgrammar grammar`` (see the module docstring)."""
    p = add_command(subparsers, run, __doc__,
                    output="text: the grammar; json: {format, path, grammar, terminals}")
    p.add_argument("format", metavar="NAME|PATH", help="a bundled format name or a spec file")


def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar grammar``; returns the exit code."""
    from ..core.compile import HEADER, TEXT, term_name

    try:
        fmt = load_format_arg(args.format)
    except ChatGrammarError as exc:  # an invalid spec (a missing one is a UsageError: exit 2)
        error_line("grammar", exc)
        return 1
    terminals = {term_name(n): m.text for n, m in fmt.spec.markers.items()}
    if args.output == "json":
        print(json.dumps({"format": fmt.name, "path": str(fmt.path), "grammar": fmt.grammar,
                          "terminals": {**terminals, TEXT: None, HEADER: None}},
                         ensure_ascii=False, indent=2))
        return 0
    sys.stdout.write(fmt.grammar)
    width = max((len(t) for t in terminals), default=0)
    print("\n// terminals")
    for t, text in terminals.items():
        print(f"//   {t:<{width}}  {text!r}")
    print(f"//   {TEXT:<{width}}  a run of text between markers")
    print(f"//   {HEADER:<{width}}  a header cut from the text after an opener (until_text)")
    return 0
