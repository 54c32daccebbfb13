"""Mask policies: which spans of a parsed conversation train."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field, fields
from typing import Any


def _field(default: Any, description: str) -> Any:
    # The description is the one home of what the field means: the Args of this docstring, the
    # spec's `policy:` model (chatgrammar.core.spec.Policy), its JSON Schema and the guide's key
    # reference are all generated from it.
    return field(default=default, metadata={"description": description})


@dataclass(frozen=True)
class MaskPolicy:
    """Which parts of a conversation are trained (mask 1).

    Args:
{args}
    Example:
        >>> MaskPolicy(thinking=False).allows("think")
        False
    """

    roles: tuple[str, ...] = _field(
        ("assistant",), "Roles whose turns train, after `role_aliases` (Gemma's `model` is "
                        "`assistant`).")
    thinking: bool = _field(
        True, "Train reasoning blocks (kind `think`). False drops the whole block, its tags "
              "included.")
    tool_calls: bool = _field(True, "Train tool-call blocks (kind `tool_call`).")
    end_marker: bool = _field(
        False, "Also train each trained turn's terminator (kind `end`: K2 `<|im_end|>`, K3 "
               "`<|close|>message<|sep|><|end_of_msg|>`).")
    last_turn_only: bool = _field(False, "Train only the last turn whose role trains.")
    truncated: bool = _field(
        True, "Train the content present in a turn cut off by the end of input.")
    exclude_kinds: tuple[str, ...] = _field(
        (), "Further span kinds never to train (`[media]`).")

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


def _args_doc(cls: type) -> str:
    """The ``Args:`` lines of ``cls``'s docstring, from its fields' descriptions."""
    lines = []
    for f in fields(cls):
        text = f.metadata["description"].replace("`", "``")
        lines += textwrap.wrap(f"{f.name}: {text}", 92, initial_indent=" " * 8,
                               subsequent_indent=" " * 12)
    return "\n".join(lines) + "\n\n"


if MaskPolicy.__doc__:  # (None under python -OO)
    MaskPolicy.__doc__ = MaskPolicy.__doc__.replace("{args}\n", _args_doc(MaskPolicy))
