"""Stage 5 — the typed result: Conversation → Turns → Blocks, and trained Spans."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import numpy as np

from .policy import MaskPolicy, last_run, warn_untyped


@dataclass(frozen=True)
class Span:
    """A trained region: ``[start, end)`` in chars (text mode) or token indices (id mode).

    ``kind`` is ``"content"``, ``"think"``, ``"tool_call"``, ``"end"`` or a spec-declared kind;
    ``turn`` is the index of the turn in :attr:`Conversation.turns`.
    """

    start: int
    end: int
    role: str
    kind: str
    turn: int


@dataclass(frozen=True)
class Issue:
    """Something lenient parsing skipped, or a boundary that fell inside a merged token."""

    offset: int
    message: str

    def __str__(self) -> str:
        return f"at {self.offset}: {self.message}"


@dataclass(eq=False)
class Block:
    """One parsed element: a turn's body element, or a nested block (think, tool call,
    channel, XTML element). Offsets are half-open; ``body_*`` is None when it has no body."""

    name: str
    start: int
    end: int
    open: Optional[str] = None            # opener marker name
    header: Optional[str] = None          # header text as written
    header_start: int = 0
    header_end: int = 0
    attrs: dict = field(default_factory=dict)
    tag: Optional[str] = None
    kind: Optional[str] = None
    body_start: Optional[int] = None
    body_end: Optional[int] = None
    close_start: Optional[int] = None     # terminator region (close marker, close header, after)
    close_end: Optional[int] = None
    close: Optional[str] = None           # close marker name (None: none written, input ended)
    # where the turn's trained region starts when part of its header is model output
    # (``header.trained_after``); None: at ``body_start``
    train_start: Optional[int] = None
    children: list = field(default_factory=list)
    complete: bool = True
    valid: bool = True
    follow: Optional["Block"] = None

    def walk(self) -> Iterator["Block"]:
        """This block and every nested block, depth-first, without recursion."""
        stack = [self]
        while stack:
            b = stack.pop()
            yield b
            stack.extend(reversed(b.children))


@dataclass(eq=False)
class Turn:
    """One message of the conversation.

    Attributes:
        role: canonical role (after aliases), from the opener marker, the header, or the
            XTML ``role`` attribute — never from a substring test.
        start, end: extent, terminator included.
        complete: False when the input ended inside the turn (truncation).
        generation_prompt: the input ends with this turn's generation prompt (trains nothing).
        valid: False when lenient parsing found the turn malformed (it trains nothing).
        block: the parsed element (header, attrs, body, nested blocks).
    """

    role: str
    start: int
    end: int
    complete: bool
    block: Block
    generation_prompt: bool = False
    valid: bool = True

    @property
    def header(self) -> Optional[str]:
        return self.block.header

    @property
    def attrs(self) -> dict:
        return self.block.attrs

    @property
    def body_start(self) -> Optional[int]:
        return self.block.body_start

    @property
    def body_end(self) -> Optional[int]:
        return self.block.body_end


class Conversation:
    """A parsed conversation.

    Attributes:
        format: the format name.
        mode: ``"text"`` (char offsets) or ``"ids"`` (token offsets).
        length: number of chars / ids — every mask has exactly this many values.
        turns: the turns, in order.
        warnings: what lenient parsing skipped (empty after a clean parse).
        boundaries: span boundaries that fell inside a merged token (id mode), with the rule
            applied: the straddling token is trained (no trained character is left out).
        default_policy: the format's declared default policy (``policy=None``).
        plain_text: what the format declares its templates write as plain text (span kind ->
            the spec's ``plain_text_tool_calls`` / ``plain_text_reasoning``), or None:
            :meth:`spans` with a policy that drops such a kind warns
            (:class:`~chatgrammar.DeviationWarning`) that those still train.
    """

    #: set by the Format that parsed it (Format._conv); None: every block is typed
    plain_text: "dict | None" = None

    def __init__(self, *, format: str, mode: str, length: int, turns: list[Turn],
                 warnings: list[Issue], boundaries: list[Issue], default_policy: MaskPolicy,
                 text: str | None = None):
        self.format = format
        self.mode = mode
        self.length = length
        self._turns = turns
        # a deferred conversation (the text memo's, chatgrammar.runtime.textpath): turns built
        # on first access; until then spans and trained turns come from ``_plan``
        self._build = self._plan = None
        self.warnings = warnings
        self.boundaries = boundaries
        self.default_policy = default_policy
        self.text = text

    @classmethod
    def deferred(cls, *, format: str, mode: str, length: int, default_policy: MaskPolicy,
                 text: str | None, build, plan) -> "Conversation":
        """A clean Conversation whose turns ``build()`` makes on first access of
        :attr:`turns`; until then :meth:`spans` and :meth:`trained_turns` ask ``plan``
        (``plan.trained(policy)`` / ``plan.spans(policy)``, which may answer None: then the
        turns are built). Both give exactly what the built turns give."""
        conv = object.__new__(cls)  # (what __init__ sets, without its keyword call)
        conv.__dict__.update(format=format, mode=mode, length=length, _turns=None,
                             _build=build, _plan=plan, warnings=[], boundaries=[],
                             default_policy=default_policy, text=text)
        return conv

    def __getstate__(self) -> dict:
        self.turns  # (a deferred conversation pickles built: its builder is a closure)
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        if "turns" in state:  # (pickled before turns became a property)
            state["_turns"] = state.pop("turns")
        state.setdefault("_build", None)
        state.setdefault("_plan", None)
        self.__dict__.update(state)

    @property
    def turns(self) -> list[Turn]:
        """The turns, in order."""
        t = self._turns
        if t is None:
            t = self._turns = self._build()
            self._build = self._plan = None
        return t

    @turns.setter
    def turns(self, value: list[Turn]) -> None:
        self._turns = value
        self._build = self._plan = None

    def __repr__(self) -> str:
        roles = ",".join(t.role for t in self.turns[:8]) + ("…" if len(self.turns) > 8 else "")
        return (f"Conversation(format={self.format!r}, mode={self.mode!r}, length={self.length}, "
                f"turns=[{roles}], warnings={len(self.warnings)})")

    def spans(self, policy: MaskPolicy | None = None) -> list[Span]:
        """The trained spans under ``policy`` (None: the format's default): sorted and
        non-overlapping.

        A turn's body trains as its own kind (``"content"`` unless the element declares one),
        from ``Block.train_start`` when the header's tail is model output
        (``header.trained_after``);
        each nested block at any depth is a span of its own kind (a block without a kind takes
        its parent's), and a block whose kind the policy drops is left out whole, tags and
        nested blocks included.

        Example:
            >>> conv.spans(cg.MaskPolicy(thinking=False))  # doctest: +SKIP
            [Span(start=120, end=133, role='assistant', kind='content', turn=3)]
        """
        policy = policy or self.default_policy
        if self.plain_text is not None and policy._drops:
            warn_untyped(self.format, self.plain_text, policy)
        if self._plan is not None:
            got = self._plan.spans(policy)
            if got is not None:
                return got
        out: list[Span] = []
        turns = self.turns
        for i in self.trained_turns(policy):
            turn_spans(turns[i], i, policy, out)
        return out

    def trained_turns(self, policy: MaskPolicy | None = None) -> list[int]:
        """Indices of the turns that train under ``policy``: role in ``roles``, valid, not a
        generation prompt, complete or ``truncated`` set; with ``last_turn_only`` the last run
        of them: the last, with the reasoning turns right before it
        (:func:`~chatgrammar.runtime.policy.last_run`).

        Example:
            >>> conv.trained_turns(cg.MaskPolicy(last_turn_only=True))  # doctest: +SKIP
            [3]
        """
        policy = policy or self.default_policy
        if self._plan is not None:
            got = self._plan.trained(policy)
            if got is not None:
                return got
        roles = set(policy.roles)
        chosen = [i for i, t in enumerate(self.turns)
                  if t.role in roles and t.valid and not t.generation_prompt
                  and (t.complete or policy.truncated)]
        if not policy.last_turn_only:
            return chosen
        turns = self.turns
        return last_run(chosen, lambda i: turns[i].block.kind == "think")

    def mask_array(self, policy: MaskPolicy | None = None) -> np.ndarray:
        """The mask as a numpy int8 array of length :attr:`length`."""
        m = np.zeros(self.length, dtype=np.int8)
        for s in self.spans(policy):
            m[s.start:s.end] = 1
        return m

    def mask(self, policy: MaskPolicy | None = None) -> list[int]:
        """One 0/1 value per char (text mode) or per id (id mode)."""
        return self.mask_array(policy).tolist()

    def trained_text(self, policy: MaskPolicy | None = None) -> list[str]:
        """Text mode only: the text of each trained span (handy in tests and docs)."""
        if self.text is None:
            raise ValueError("trained_text() needs a text-mode conversation")
        return [self.text[s.start:s.end] for s in self.spans(policy)]


def turn_spans(t: Turn, i: int, policy: MaskPolicy, out: list) -> None:
    """Append the trained spans of turn ``t`` (index ``i``, chosen to train under ``policy``)
    to ``out``: see :meth:`Conversation.spans`."""
    b = t.block
    if b.body_start is None:
        return
    base = b.kind or "content"
    # the header's model-written tail (``header.trained_after``) trains with the body
    cur = b.body_start if b.train_start is None else b.train_start
    for c in b.children:
        if c.start < b.body_start:
            continue  # before the body (a header that never ended): not trained
        if c.start > cur and policy.allows(base):
            out.append(Span(cur, c.start, t.role, base, i))
        k = c.kind or base
        if c.end > c.start and policy.allows(k):
            out.extend(Span(s, e, t.role, kk, i) for s, e, kk in _segments(c, k, policy))
        cur = max(cur, c.end)
    if b.body_end is not None and b.body_end > cur and policy.allows(base):
        out.append(Span(cur, b.body_end, t.role, base, i))
    # a turn whose own kind the policy drops (a Harmony analysis message under
    # thinking=False) does not train its terminator either
    if (policy.end_marker and t.complete and b.close_start is not None
            and b.close_end > b.close_start and policy.allows(base)):
        out.append(Span(b.close_start, b.close_end, t.role, "end", i))


def _segments(block: Block, kind: str, policy: MaskPolicy) -> list[tuple[int, int, str]]:
    """``(start, end, kind)`` pieces of a trained block, in order: a nested block with a kind
    of its own is its own piece (a block without one takes its parent's kind), a nested block
    whose kind the policy drops is left out whole; equal neighbours are merged. Iterative, so
    deep nesting costs no recursion."""
    out: list[tuple[int, int, str]] = []
    stack = [[block, kind, 0, block.start]]  # frames: block, its kind, next child, cursor
    while stack:
        fr = stack[-1]
        blk, k, j, cur = fr
        if j < len(blk.children):
            g = blk.children[j]
            fr[2] = j + 1
            if g.start > cur:
                out.append((cur, g.start, k))
            fr[3] = max(cur, g.end)
            gk = g.kind or k
            if g.end > g.start and policy.allows(gk):
                stack.append([g, gk, 0, g.start])
            continue
        if blk.end > cur:
            out.append((cur, blk.end, k))
        stack.pop()
    return merge_spans(out, by_kind=True)


def merge_spans(spans: Iterable[tuple], *, by_kind: bool = False) -> list[tuple]:
    """The sorted union of ``[start, end)`` ranges: overlapping or abutting ones merge into
    one, empty ones vanish. (The package's one span-merge helper.)

    Args:
        spans: ``(start, end)`` or ``(start, end, kind)`` tuples, in any order.
        by_kind: only neighbours with the same third field (kind) merge. Without it, a merged
            range keeps the third field, if any, of its first span.

    Returns:
        The merged tuples, sorted, of the same width as the input's.

    Example:
        >>> merge_spans([(4, 6), (0, 2), (2, 3), (5, 8)])
        [(0, 3), (4, 8)]
    """
    out: list[list] = []
    for sp in sorted(spans):
        s, e = sp[0], sp[1]
        if e <= s:
            continue
        last = out[-1] if out else None
        if last is not None and s <= last[1] and (not by_kind or last[2] == sp[2]):
            if e > last[1]:
                last[1] = e
        else:
            out.append(list(sp))
    return [tuple(x) for x in out]
