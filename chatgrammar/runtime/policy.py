"""Mask policies: which spans of a parsed conversation train."""
from __future__ import annotations

import textwrap
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar

from ..errors import DeviationWarning


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
                        "`assistant`). A tool's output (kind `tool_response`, in whatever "
                        "turn a template writes it: Cohere's system turns, Qwen's user turns) "
                        "trains only with `tool` among them.")
    thinking: bool = _field(
        True, "Train reasoning blocks (kind `think`). False drops the whole block, its tags "
              "included.")
    tool_calls: bool = _field(True, "Train tool-call blocks (kind `tool_call`).")
    end_marker: bool = _field(
        False, "Also train each trained turn's terminator (kind `end`: K2 `<|im_end|>`, K3 "
               "`<|close|>message<|sep|><|end_of_msg|>`).")
    last_turn_only: bool = _field(
        False, "Train only the last turn whose role trains, with the reasoning turns right "
               "before it: one message a template renders as a reasoning turn and an answer "
               "turn (Harmony's analysis and final channels) trains whole.")
    truncated: bool = _field(
        True, "Train the content present in a turn cut off by the end of input.")
    exclude_kinds: tuple[str, ...] = _field(
        (), "Further span kinds never to train (`[media]`).")
    #: whether the policy may drop a kind (set per object in __post_init__; an object
    #: unpickled from a version without it reads this default: check)
    _drops: ClassVar[bool] = True

    def __post_init__(self):
        if isinstance(self.roles, str):
            object.__setattr__(self, "roles", (self.roles,))
        else:
            object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "exclude_kinds", tuple(self.exclude_kinds))
        # (whether a kind may be dropped or a role other than the assistant's trains: the one
        # test the mask entry points make before runtime.policy.warn_untyped, on their hot
        # path)
        object.__setattr__(self, "_drops", not (self.thinking and self.tool_calls)
                           or bool(self.exclude_kinds) or self.roles != ("assistant",))

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
        if kind == "tool_response":
            # (a tool's words are never another role's text, whichever turn holds them)
            return "tool" in self.roles
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


def last_run(chosen: list[int], reasoning: Callable[[int], bool] = lambda i: False
             ) -> list[int]:
    """What ``last_turn_only`` keeps of the turns a policy trains (``chosen``, ascending turn
    indices): the last one, with the reasoning turns right before it (``reasoning(i)``: turn
    ``i``'s body is reasoning, kind ``think``). One assistant message that a
    template renders as a reasoning turn and an answer turn (Harmony's ``analysis`` then
    ``final``, HyperCLOVA X's ``assistant/think`` then ``assistant``, Solar Open, Muse
    Glimmer's ``to=self``) is such a run; a turn of another role ends it, and so does an
    answer turn (two assistant messages in a row, a template that drops the tool result
    between them, are two replies: the last one trains). The one definition read by the
    parsed conversation, the text memo and the fast path (whose C executor keeps the same
    run).

    Example:
        >>> last_run([1, 3, 5, 6], reasoning={5}.__contains__)
        [5, 6]
        >>> last_run([1, 3, 5, 6])
        [6]
    """
    k = len(chosen) - 1
    while k > 0 and chosen[k - 1] == chosen[k] - 1 and reasoning(chosen[k - 1]):
        k -= 1
    return chosen[max(k, 0):]


#: A spec's ``plain_text_*`` keys: span kind -> (spec key, the policy field that drops the
#: kind, what it is in words).
PLAIN_TEXT = {"tool_call": ("plain_text_tool_calls", "tool_calls", "tool calls"),
              "think": ("plain_text_reasoning", "thinking", "reasoning")}


#: The key of :func:`plain_text_kinds`'s answer that holds the spec's ``role_folds``.
FOLDS = "role_folds"


def plain_text_kinds(spec: Any) -> dict | None:
    """The kinds a spec declares its templates write as plain text (kind -> its key's value:
    ``True`` or how they are written) and, under :data:`FOLDS`, the messages they write as
    another role's turn or as reasoning (the spec's ``role_folds``), or None when it declares
    none."""
    out = {k: getattr(spec, key) for k, (key, _, _) in PLAIN_TEXT.items() if getattr(spec, key)}
    folds = getattr(spec, FOLDS, None)
    if folds:
        out[FOLDS] = dict(folds)
    return out or None


def _fold_says(src: str, dst: str, policy: MaskPolicy) -> str | None:
    """What a fold (``src`` written as ``dst``, a ``role_folds`` entry) does under ``policy``,
    or None when the policy trains both sides alike."""
    if dst == "think":  # (an assistant message's content written as reasoning)
        if "assistant" in policy.roles and not policy.allows("think"):
            return ("some assistant content is written as reasoning: thinking=False drops it "
                    "with the reasoning")
        return None
    if (src in policy.roles) == (dst in policy.roles):
        return None
    what = "content" if src == "content" else f"{src} messages"
    how = (f"train as {dst} text" if dst in policy.roles
           else f"do not train with the {src} role")
    return f"its template writes some {what} as {dst} turns: they {how}"


def warn_untyped(name: str, plain: dict, policy: MaskPolicy, stacklevel: int = 3) -> None:
    """Warn (:class:`~chatgrammar.DeviationWarning`) when ``policy`` drops a kind that the
    format declares its templates write as plain text (``plain``, from
    :func:`plain_text_kinds`: the spec's ``plain_text_tool_calls`` / ``plain_text_reasoning``):
    no grammar tells such a call or such reasoning from the answer, so it trains as assistant
    text. A warning, never an error (strict or lenient: the input parses; inside a data
    loader nothing raises), said once per call site by Python's default filter.

    Args:
        name: the format's name.
        plain: kind -> the spec key's value (True, or how the template writes it).
        policy: the mask policy asked for.
        stacklevel: as in :func:`warnings.warn` (3: the caller of the public method).

    Example:
        >>> warn_untyped("llama3", {"tool_call": True}, MaskPolicy())  # (silent: calls train)

    A format resolved for a template that writes a message as another role's turn (the
    spec's ``role_folds``, under :data:`FOLDS` in ``plain``) warns the same way when the
    policy trains one side of the fold and not the other: such text trains as the turn that
    holds it (Unsloth's ChatML tool results as system text under ``roles=("assistant",
    "system")``).
    """
    for src, dst in (plain.get(FOLDS) or {}).items():
        said = _fold_says(src, dst, policy)
        if said:
            warnings.warn(f"{name}: {said}, which no grammar tells apart (the spec's "
                          f"{FOLDS}: {src}: {dst})", DeviationWarning, stacklevel=stacklevel)
    if "assistant" not in policy.roles:
        return
    for kind, how in plain.items():
        if kind == FOLDS or policy.allows(kind):
            continue
        key, field_, what = PLAIN_TEXT[kind]
        how = f" ({how})" if isinstance(how, str) else ""
        warnings.warn(f"{name}: {field_}=False drops only the {what} a marker sets apart; "
                      f"this format's templates also write {what} as plain text{how}, which "
                      f"no grammar tells from the answer: those train as assistant text (the "
                      f"spec's {key})", DeviationWarning, stacklevel=stacklevel)


if MaskPolicy.__doc__:  # (None under python -OO)
    MaskPolicy.__doc__ = MaskPolicy.__doc__.replace("{args}\n", _args_doc(MaskPolicy))
