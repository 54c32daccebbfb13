"""What the subcommands share: the usage-error type and its exit code, and the policy flags.

(Not a subcommand: ``chatgrammar.cli`` skips modules whose name starts with ``_``.)
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any, Callable

from ..runtime.policy import MaskPolicy

def _policy_fields(kind: str) -> tuple[tuple[str, str], ...]:
    # (name, help) of MaskPolicy's fields of one type: the help is the field's description,
    # the one home of what it means (see chatgrammar.runtime.policy)
    return tuple((f.name, f.metadata["description"].replace("`", ""))
                 for f in dataclasses.fields(MaskPolicy)
                 if str(f.type).replace("typing.", "").startswith(kind))


#: Policy fields a boolean flag pair sets (``--thinking`` / ``--no-thinking`` …), with help.
POLICY_FLAGS = _policy_fields("bool")
#: Policy fields a comma-separated list sets (``--roles assistant,tool``), with help.
POLICY_LISTS = _policy_fields("tuple")


class UsageError(Exception):
    """A problem with how the command was called: one line on stderr, exit code 2."""


def add_command(subparsers: Any, run: Callable[[argparse.Namespace], int], doc: str, *,
                output: str | None = None) -> argparse.ArgumentParser:
    """Add a subcommand whose body is ``run``; its :class:`UsageError` exits 2.

    The command's module docstring is the one home of its help: its first line (the command
    in double backticks, an em dash, what it does) names the command and gives its line in
    ``chatgrammar --help``; the rest is the text of ``chatgrammar NAME --help``.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.
        run: the command's body, ``run(args) -> exit code``.
        doc: the command module's ``__doc__``.
        output: the help of an ``--output text|json`` option; ``None`` adds none.

    Returns:
        The subcommand's parser, for its own arguments.

    Example:
        >>> p = add_command(subparsers, run, __doc__, output="")   # doctest: +SKIP
    """
    first, _, body = doc.strip().partition("\n")
    name = re.match(r"``chatgrammar ([\w-]+)", first).group(1)
    p = subparsers.add_parser(name, help=_plain(first.split(" — ", 1)[1].rstrip(".")),
                              description=_plain(body.strip()),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    if output is not None:
        add_output_arg(p, output)
    p.set_defaults(func=lambda args: guarded(name, run, args))
    return p


def _plain(rst: str) -> str:
    # the docstring's reST (``code``, :func:`x`) as terminal text
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", rst).replace("``", "")


def add_output_arg(parser: argparse.ArgumentParser, text: str = "") -> None:
    """The ``--output text|json`` option (default text)."""
    parser.add_argument("--output", choices=("text", "json"), default="text",
                        help=text or "output format (default: text)")


def add_tokenizer_args(parser: argparse.ArgumentParser,
                       text: str = "a local transformers tokenizer directory (loaded offline)", *,
                       required: bool = False) -> None:
    """``--tokenizer DIR`` and ``--trust-remote-code`` (read with :func:`tokenizer_arg`)."""
    parser.add_argument("--tokenizer", metavar="DIR", required=required, help=text)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let --tokenizer run the directory's own tokenizer code (e.g. "
                             "Kimi's tokenization_kimi.py)")


def error_line(name: str, exc: BaseException | str) -> None:
    """Print ``chatgrammar NAME: error: …`` on stderr."""
    print(f"chatgrammar {name}: error: {exc}", file=sys.stderr)


def load_format_arg(spec: str) -> Any:
    """:func:`chatgrammar.load_format` for a ``-f NAME|PATH`` argument.

    Raises:
        UsageError: no such format name or file (exit 2).
        ChatGrammarError: the spec exists but is invalid (exit 1).
    """
    from ..errors import ChatGrammarError
    from ..core.registry import load_format

    try:
        return load_format(spec)
    except ChatGrammarError as exc:
        if "Unknown format" in str(exc) or "no such file" in str(exc):
            raise UsageError(str(exc)) from None
        raise


def tokenizer_arg(path: str | None, trust_remote_code: bool = False) -> Any:
    """The ``--tokenizer DIR`` argument loaded offline (``None`` when not given).

    Raises:
        UsageError: the tokenizer cannot be loaded (exit 2).
    """
    from ..runtime.tokenizers import TokenizerLoadError, load_tokenizer

    if not path:
        return None
    try:
        return load_tokenizer(path, trust_remote_code=trust_remote_code)
    except TokenizerLoadError as exc:
        raise UsageError(exc.args[0]) from None


def read_template(path: str | None) -> str | None:
    """The ``--template FILE`` argument's text (``None`` when not given).

    Raises:
        UsageError: the file is missing or unreadable (exit 2).
    """
    from .._io import read_text

    return None if path is None else read_text(path, UsageError)


def key_values(items: list[str], flag: str) -> dict:
    """``KEY=VALUE`` arguments as a dict; VALUE is JSON if it parses as JSON, else a string.

    Raises:
        UsageError: an item without ``=``.
    """
    import json

    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"{flag} takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def guarded(name: str, fn: Callable[[argparse.Namespace], int],
            args: argparse.Namespace) -> int:
    """Run ``fn(args)``; a :class:`UsageError` becomes ``chatgrammar NAME: error: …`` on
    stderr and exit code 2.

    Args:
        name: the subcommand, for the message.
        fn: the command body.
        args: its parsed arguments.

    Returns:
        ``fn``'s exit code, or 2.
    """
    try:
        return fn(args)
    except UsageError as exc:
        error_line(name, exc)
        return 2


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    """The policy flags every masking command takes (default: the format's own policy)."""
    g = parser.add_argument_group("policy (default: the format's declared policy)")
    for field, text in POLICY_LISTS:
        g.add_argument("--" + field.replace("_", "-"), metavar="A,B,…",
                       help=text + " Comma-separated.")
    for field, text in POLICY_FLAGS:
        g.add_argument("--" + field.replace("_", "-"), action=argparse.BooleanOptionalAction,
                       default=None, help=text)


def policy_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The policy fields the flags set, for ``MaskPolicy.replace(**changes)``."""
    changes: dict[str, Any] = {}
    for field, _ in POLICY_LISTS:
        v = getattr(args, field)
        if v:
            changes[field] = tuple(r.strip() for r in v.split(",") if r.strip())
    for field, _ in POLICY_FLAGS:
        v = getattr(args, field)
        if v is not None:
            changes[field] = v
    return changes


def policy_for(fmt: Any, args: argparse.Namespace) -> Any:
    """The format's default policy with the flags applied.

    Raises:
        UsageError: the flags make an invalid policy.
    """
    changes = policy_changes(args)
    try:
        return fmt.default_policy.replace(**changes) if changes else fmt.default_policy
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad policy: {exc}") from None
