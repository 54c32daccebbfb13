"""What the subcommands share: the usage-error type and its exit code, and the policy flags.

(Not a subcommand: ``chatgrammar.cli`` skips modules whose name starts with ``_``.)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable

from ..policy import MaskPolicy

def _policy_fields(kind: str) -> tuple[tuple[str, str], ...]:
    # (name, help) of MaskPolicy's fields of one type: the help is the field's description,
    # the one home of what it means (see chatgrammar.policy)
    return tuple((f.name, f.metadata["description"].replace("`", ""))
                 for f in dataclasses.fields(MaskPolicy)
                 if str(f.type).replace("typing.", "").startswith(kind))


#: Policy fields a boolean flag pair sets (``--thinking`` / ``--no-thinking`` …), with help.
POLICY_FLAGS = _policy_fields("bool")
#: Policy fields a comma-separated list sets (``--roles assistant,tool``), with help.
POLICY_LISTS = _policy_fields("tuple")


class UsageError(Exception):
    """A problem with how the command was called: one line on stderr, exit code 2."""


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
        print(f"chatgrammar {name}: error: {exc}", file=sys.stderr)
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
