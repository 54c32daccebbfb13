"""``Format``: a compiled spec with the user-facing parse / parse_ids / loss_mask calls."""
from __future__ import annotations

import functools

import threading
from typing import Any, Sequence

import numpy as np

from .compile import ParseTables, compile_spec, term_name
from .fastpath import FastMasker, TextMemo, ids_input, mask_like
from .lexers import IdLexer, LexConfig, as_id_array, lex_text
from .parse import Driver, Source
from .policy import MaskPolicy
from .spans import Conversation, Issue
from .spec import FormatSpec, SpecSource
from .tokenizers import adapt


class Format:
    """A chat format compiled from its YAML spec.

    Attributes:
        name: the format id (``"kimi-k3"``).
        spec: the validated :class:`~chatgrammar.spec.FormatSpec`.
        grammar: the compiled Lark grammar source.
        default_policy: the spec's declared :class:`MaskPolicy` (used when ``policy=None``).
        path: the spec file.
    """

    def __init__(self, spec: FormatSpec, src: SpecSource, *, tables: ParseTables | None = None):
        self.spec = spec
        self.source = src
        self.path = src.file
        self.name = spec.name
        # `tables`: this spec's compiled tables, from the disk cache (see registry._load_path)
        self.tables: ParseTables = tables if tables is not None else compile_spec(spec, src)
        self.grammar: str = self.tables.grammar
        self.default_policy = MaskPolicy.from_mapping(spec.policy.model_dump())
        self._driver = Driver(spec, self.tables)
        self._id_lexers: dict[int, tuple[Any, IdLexer]] = {}
        self._fast: dict[int, tuple[Any, FastMasker]] = {}
        self._text_memo: TextMemo | None = None
        self._lock = threading.Lock()

    @functools.cached_property
    def _lexcfg(self) -> LexConfig:
        # built on first use: loading every format (detection does) need not compile every
        # format's lexer regexes
        return LexConfig.from_spec(self.spec)

    def __repr__(self) -> str:
        return f"Format({self.name!r}, path={self.path!r})"

    def __reduce__(self):
        # Picklable for worker processes: rebuilt (from the compile cache) on the other side.
        from .registry import load_format
        return (load_format, (self.path,))

    # ------------------------------------------------------------------ text mode
    def parse(self, text: str, *, strict: bool = True) -> Conversation:
        """Parse a rendered conversation (offsets are characters).

        Args:
            text: the rendered conversation, exactly as the chat template produced it.
            strict: raise on structure errors (default); False skips what cannot be parsed
                and reports it on ``Conversation.warnings``.

        Returns:
            The :class:`Conversation`.

        Raises:
            ParseError: (strict) with the char offset, the expected markers and an excerpt.

        Example:
            >>> fmt = cg.load_format("kimi-k2")  # doctest: +SKIP
            >>> fmt.parse(text).mask()            # doctest: +SKIP
        """
        if not isinstance(text, str):
            raise TypeError(f"parse() takes a str, got {type(text).__name__}; "
                            "use parse_ids() for token ids")
        # Items seen before are rebuilt from the memo (chatgrammar.fastpath.TextMemo); the
        # result is identical to the full parse below, which teaches the memo.
        memo = self._text_memo
        if memo is None:
            memo = self._text_memo = TextMemo(self)
        conv = memo.lookup(text)
        if conv is not None:
            return conv
        warnings: list[Issue] = []
        src = memo.source(len(text), text)
        cut = self._partial_marker_tail(text)
        toks = lex_text(text if cut is None else text[:cut], self._lexcfg)
        if cut is not None:
            # Text cut inside a marker string (e.g. "…<|im_e"): the fragment is not content;
            # parse as if the input ended before it, and report it.
            warnings.append(Issue(cut, f"input ends inside a marker ({text[cut:]!r})"))
            src = Source("text", cut, text=text[:cut])
        turns = self._driver.run(toks, src, strict, warnings)
        if cut is not None:
            for t in turns:
                if t.end > cut:
                    t.end = cut
        elif not warnings:
            memo.learn(text, toks, turns, src)
        return Conversation(format=self.name, mode="text", length=len(text), turns=turns,
                            warnings=warnings, boundaries=[], default_policy=self.default_policy,
                            text=text)

    def _partial_marker_tail(self, text: str) -> int | None:
        longest = self._lexcfg.longest_marker
        # The fragment must lie after the last whole marker: "]~!b[" ends with "[", a prefix
        # of "[e~[", but that "[" belongs to the complete marker before it.
        done = 0
        for m in self._lexcfg.regex.finditer(text, max(0, len(text) - 2 * longest)):
            done = m.end()
        for k in range(min(len(text) - done, longest - 1), 0, -1):
            frag = text[-k:]
            if frag in self._lexcfg.marker_prefixes:
                return len(text) - k
        return None

    # ------------------------------------------------------------------ id mode
    def id_lexer(self, tokenizer: Any) -> IdLexer:
        """The id lexer bound to ``tokenizer`` (cached per tokenizer object)."""
        key = id(tokenizer)
        hit = self._id_lexers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        with self._lock:
            lx = IdLexer.build(self._lexcfg, adapt(tokenizer))
            if len(self._id_lexers) > 32:
                self._id_lexers.clear()
            self._id_lexers[key] = (tokenizer, lx)
        return lx

    def _fast_masker(self, tokenizer: Any) -> FastMasker:
        """The memoised exact mask path bound to ``tokenizer`` (see :mod:`chatgrammar.fastpath`)."""
        key = id(tokenizer)
        hit = self._fast.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        fm = FastMasker(self, self.id_lexer(tokenizer))
        with self._lock:
            if len(self._fast) > 32:
                self._fast.clear()
            self._fast[key] = (tokenizer, fm)
        return fm

    def missing_markers(self, tokenizer: Any) -> list[str]:
        """Special markers of this format the tokenizer has no single special id for."""
        lx = self.id_lexer(tokenizer)
        by_term = {term_name(n): n for n in self.spec.markers}
        return [by_term[t] for t in lx.missing if self.spec.markers[by_term[t]].special]

    def parse_ids(self, ids: Any, tokenizer: Any, *, strict: bool = True) -> Conversation:
        """Parse token ids (offsets are token indices). Id mode is authoritative: a marker
        counts only where it is one special id, so marker strings typed in message text are
        ordinary tokens.

        Args:
            ids: a sequence of ints, a 1-D numpy array or torch tensor.
            tokenizer: a transformers tokenizer, a ``tiktoken.Encoding`` or a minimal-protocol
                object (``convert_tokens_to_ids`` + ``decode``).
            strict: as in :meth:`parse`.

        Returns:
            The :class:`Conversation` (``mode == "ids"``).

        Raises:
            ParseError: (strict) with the token index, expected markers and an excerpt.

        Example:
            >>> conv = fmt.parse_ids(ids, tok)    # doctest: +SKIP
        """
        arr = as_id_array(ids)
        lx = self.id_lexer(tokenizer)
        warnings: list[Issue] = []
        boundaries: list = []
        src = Source("ids", len(arr), arr=arr, adapter=lx.adapter, boundaries=boundaries)
        toks = lx.lex(arr, boundaries)
        turns = self._driver.run(toks, src, strict, warnings)
        return Conversation(format=self.name, mode="ids", length=len(arr), turns=turns,
                            warnings=warnings,
                            boundaries=[Issue(p, m) for p, m in boundaries],
                            default_policy=self.default_policy)

    def loss_mask(self, ids: Any, tokenizer: Any, *, policy: MaskPolicy | None = None,
                  strict: bool = True):
        """One 0/1 value per id: 1 where the policy trains.

        Args:
            ids: list/tuple of ints, numpy array or torch tensor.
            tokenizer: see :meth:`parse_ids`.
            policy: a :class:`MaskPolicy`; None uses the format's default.
            strict: raise on structure errors (default) or skip them (never raises on structure).

        Returns:
            Same container kind as ``ids``: list in → ``list[int]``, numpy in → numpy int64
            array, torch in → ``torch.long`` tensor on the same device.

        Raises:
            ParseError: (strict) the ids do not fit the format.

        Example:
            >>> fmt.loss_mask([163587, 1, 163601, 2, 163586], tok)  # doctest: +SKIP
        """
        # Same result as parse_ids(ids, tokenizer).mask_array(policy), through the memoised
        # fast path (chatgrammar.fastpath), which falls back to exactly that when it must.
        arr, lst = ids_input(ids, scratch=True)  # (the array is used by this call only)
        fm = self._fast_masker(tokenizer)
        m = fm.mask(arr, lst, policy or self.default_policy, strict, tokenizer)
        return mask_like(ids, m)

    def loss_masks(self, batch: Sequence[Any], tokenizer: Any, *,
                   policy: MaskPolicy | None = None, strict: bool = True) -> list:
        """:meth:`loss_mask` over many samples, for loaders that hold a batch.

        The samples' ids are converted and searched for markers in one vectorised pass over
        the concatenated batch; each sample then gets exactly the mask :meth:`loss_mask`
        gives it.

        Args:
            batch: a sequence of samples (each a list of ints, numpy array or torch tensor).
            tokenizer: see :meth:`parse_ids`.
            policy: a :class:`MaskPolicy`; None uses the format's default.
            strict: as in :meth:`loss_mask`.

        Returns:
            One mask per sample, each of the same container kind as its sample.

        Raises:
            ParseError: (strict) a sample does not fit the format.

        Example:
            >>> fmt.loss_masks([ids_a, ids_b], tok)  # doctest: +SKIP
        """
        fm = self._fast_masker(tokenizer)
        return fm.masks(batch, policy or self.default_policy, strict, tokenizer)


def _like(ids: Any, m: np.ndarray):
    mod = type(ids).__module__
    if mod.startswith("torch"):
        import torch
        return torch.from_numpy(m.astype(np.int64)).to(ids.device)
    if isinstance(ids, np.ndarray):
        return m.astype(np.int64)
    return m.tolist()
