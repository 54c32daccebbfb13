"""Mask policies: which spans of a parsed conversation train."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MaskPolicy:
    """Which parts of a conversation are trained (mask 1).

    Args:
        roles: roles whose turns train (after role aliases: Gemma's ``model`` is ``assistant``).
        thinking: train reasoning blocks (kind ``think``). False drops the whole block,
            its tags included.
        tool_calls: train tool-call blocks (kind ``tool_call``).
        end_marker: also train the turn terminator (kind ``end``: e.g. K2 ``<|im_end|>``,
            K3 ``<|close|>message<|sep|><|end_of_msg|>``).
        last_turn_only: train only the last turn whose role trains.
        truncated: train the content present in a turn cut off by the end of input.
        exclude_kinds: further span kinds never to train (e.g. ``("media",)``).

    Example:
        >>> MaskPolicy(thinking=False).allows("think")
        False
    """

    roles: tuple[str, ...] = ("assistant",)
    thinking: bool = True
    tool_calls: bool = True
    end_marker: bool = False
    last_turn_only: bool = False
    truncated: bool = True
    exclude_kinds: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.roles, str):
            object.__setattr__(self, "roles", (self.roles,))
        else:
            object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "exclude_kinds", tuple(self.exclude_kinds))

    def allows(self, kind: str) -> bool:
        """Whether spans of ``kind`` train under this policy."""
        if kind in self.exclude_kinds:
            return False
        if kind == "think":
            return self.thinking
        if kind == "tool_call":
            return self.tool_calls
        if kind == "end":
            return self.end_marker
        return True

    def replace(self, **changes: Any) -> "MaskPolicy":
        """A copy with some fields changed."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(changes)
        return MaskPolicy(**data)

    @classmethod
    def from_mapping(cls, data: dict | None, base: "MaskPolicy | None" = None) -> "MaskPolicy":
        base = base or cls()
        if not data:
            return base
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown policy field(s): {', '.join(sorted(unknown))}")
        return base.replace(**{k: (tuple(v) if isinstance(v, (list, tuple)) else v)
                               for k, v in data.items()})
