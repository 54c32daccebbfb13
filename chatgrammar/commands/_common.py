"""What the subcommands share: the usage-error type and its exit code, and the policy flags.

(Not a subcommand: ``chatgrammar.cli`` skips modules whose name starts with ``_``.)
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

#: Policy fields a boolean flag pair sets (``--thinking`` / ``--no-thinking`` …), with help.
POLICY_FLAGS = (
    ("thinking", "train reasoning blocks (--no-thinking: don't)"),
    ("tool_calls", "train tool-call blocks (--no-tool-calls: don't)"),
    ("end_marker", "train turn terminators"),
    ("last_turn_only", "train only the last trainable turn"),
    ("truncated", "train a turn cut off by the end of input (--no-truncated: don't)"),
)


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
    g.add_argument("--roles", metavar="ROLE,…", help="roles that train (e.g. assistant,tool)")
    for field, text in POLICY_FLAGS:
        g.add_argument("--" + field.replace("_", "-"), action=argparse.BooleanOptionalAction,
                       default=None, help=text)


def policy_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The policy fields the flags set, for ``MaskPolicy.replace(**changes)``."""
    changes: dict[str, Any] = {}
    if args.roles:
        changes["roles"] = tuple(r.strip() for r in args.roles.split(",") if r.strip())
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
