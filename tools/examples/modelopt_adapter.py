"""A drop-in loss-mask recovery with the shape of NVIDIA Model-Optimizer's per-model ones.

Model-Optimizer's speculative-decoding data pipeline keeps a list of "loss-mask recoveries",
each with a ``name``, a ``detect(tokenizer)`` predicate and ``compute(tokenizer, input_ids)``
returning one 0/1 value per id; the first whose ``detect`` answers yes is used. That
first-match rule is how a Kimi-K3 tokenizer (which also carries K2's ``<|im_*|>`` strings)
ended up with the K2 scanner and an all-zero mask.

:class:`ChatGrammarRecovery` has the same shape but one instance covers every bundled format:
``detect`` asks chatgrammar's detector (declared precedence, proven unambiguous) and
``compute`` runs the format's grammar on the ids. ``compute`` is strict by default: a sample
that does not fit raises ``cg.ParseError`` instead of returning zeros; pass ``strict=False`` to
get a full-length mask with the malformed parts untrained.

Example:
    >>> recovery = ChatGrammarRecovery()                  # doctest: +SKIP
    >>> if recovery.detect(tokenizer):                    # doctest: +SKIP
    ...     mask = recovery.compute(tokenizer, input_ids) # list in -> list out
"""
from __future__ import annotations

from typing import Any

import chatgrammar as cg


class ChatGrammarRecovery:
    """Loss-mask recovery backed by chatgrammar.

    Args:
        format: a format name to force (e.g. ``"kimi-k3"``); None detects it per tokenizer.
        policy: a :class:`chatgrammar.MaskPolicy`; None uses the format's default.
        strict: raise on malformed samples (default) instead of masking them out.
    """

    name = "chatgrammar"

    def __init__(self, format: str | None = None, policy: cg.MaskPolicy | None = None,
                 strict: bool = True):
        self.format = format
        self.policy = policy
        self.strict = strict
        self._cache: dict[int, Any] = {}

    def _format_for(self, tokenizer: Any):
        key = id(tokenizer)
        fmt = self._cache.get(key)
        if fmt is None:
            fmt = cg.load_format(self.format) if self.format else cg.detect_format(tokenizer)
            self._cache[key] = fmt
        return fmt

    def detect(self, tokenizer: Any) -> bool:
        """True when some chatgrammar format (or the forced one) fits this tokenizer."""
        try:
            fmt = self._format_for(tokenizer)
        except cg.ChatGrammarError:
            return False
        return not fmt.missing_markers(tokenizer) or self.format is None

    def compute(self, tokenizer: Any, input_ids: Any):
        """One 0/1 value per id (list → list, numpy → numpy, torch → torch.long)."""
        return self._format_for(tokenizer).loss_mask(input_ids, tokenizer, policy=self.policy,
                                                     strict=self.strict)


def kimi_recoveries() -> list[ChatGrammarRecovery]:
    """Replacements for the per-model Kimi recoveries, in any order: precedence is the
    registry's, not the list's."""
    return [ChatGrammarRecovery("kimi-k2"), ChatGrammarRecovery("kimi-k3"), ChatGrammarRecovery()]
