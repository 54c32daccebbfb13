"""The ``chatgrammar`` command line.

Each subcommand lives in ``chatgrammar/commands/<name>.py`` and exposes
``register(subparsers)``; the parser stores a ``func(args) -> int`` on the namespace.
Errors from chatgrammar are printed as one clear message (never a traceback);
exit codes: 0 ok, 1 problems found, 2 usage error.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from .errors import ChatGrammarError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chatgrammar",
        description="Declarative chat-format grammars: parse chat renders, compute loss masks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from . import commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0) if exc.code in (0, None) else 2
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except ChatGrammarError as exc:
        print(f"chatgrammar: error: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:
        print(f"chatgrammar: error: no such file: {exc.filename or exc}", file=sys.stderr)
        return 2
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        print(f"chatgrammar: error: cannot read input: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chatgrammar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
