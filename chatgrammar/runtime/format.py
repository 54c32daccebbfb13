"""``Format``: a compiled spec with the user-facing parse / parse_ids / loss_mask calls."""
from __future__ import annotations

import functools

import threading
import weakref
from typing import Any

import numpy as np

from ..core.compile import ParseTables, compile_spec, term_name
from ..errors import VerifyError
from .fastpath import FastMasker, ids_input, mask_like, verify_enabled
from .textpath import TextMemo
from .lexers import IdLexer, LexConfig, as_id_array, lex_text, partial_marker_tail
from .parse import Driver, Source
from .policy import MaskPolicy, plain_text_kinds, warn_untyped
from .spans import Conversation, Issue
from ..core.spec import FormatSpec, SpecSource
from .tokenizers import TokenizerAdapter, content_key, content_version


class Format:
    """A chat format compiled from its YAML spec.

    Attributes:
        name: the format id (``"kimi-k3"``).
        spec: the validated :class:`~chatgrammar.core.spec.FormatSpec`.
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
        # tool calls / reasoning written as plain text: a policy that drops them warns
        # (runtime.policy.warn_untyped); None when the spec declares none
        self._plain = plain_text_kinds(spec)
        # per-tokenizer state by content key; a live tokenizer -> (its content version, content
        # key) is only a shortcut past hashing the vocabulary, held weakly: it goes with the
        # tokenizer, and a content version that moved (added tokens) misses it
        self._states: dict[Any, _TokState] = {}
        self._by_obj: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # (state, content version) of the last tokenizer seen: a call with the same one (the
        # state's adapter holds it, weakly) skips the dictionary lookups
        self._last_tok: tuple | None = None
        self._text_memo: TextMemo | None = None
        self._lock = threading.Lock()

    @functools.cached_property
    def _driver(self) -> Driver:
        # built on first use, like the lexer below: a load (detection loads every format) need
        # not build every driver, nor decode every cached table (chatgrammar.core.cache)
        return Driver(self.spec, self.tables)

    @functools.cached_property
    def _lexcfg(self) -> LexConfig:
        # built on first use: loading every format (detection does) need not compile every
        # format's lexer regexes
        return LexConfig.from_spec(self.spec)

    def __repr__(self) -> str:
        return f"Format({self.name!r}, path={self.path!r})"

    def __reduce__(self):
        # Picklable for worker processes: rebuilt (from the compile cache) on the other side.
        from ..core.registry import load_format
        if self.spec.role_folds:   # (declared for a template: chatgrammar.conformance.folds)
            from ..conformance.folds import _reload
            return (_reload, (self.path, dict(self.spec.role_folds)))
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
        # Items seen before are rebuilt from the memo (chatgrammar.runtime.textpath.TextMemo); the
        # result is identical to the full parse below, which teaches the memo.
        memo = self._text_memo
        if memo is None:
            memo = self._text_memo = TextMemo(self)
        conv = memo.lookup(text)
        if conv is not None:
            self._conv(conv)
            if verify_enabled():
                # verify mode: the memo's Conversation against the full parse
                memo.stats["verified"] = memo.stats.get("verified", 0) + 1
                want = self._parse_full(text, strict, _NO_MEMO)
                # (spans first: a deferred Conversation answers them from its plan)
                if conv.spans() != want.spans() or _facts(conv) != _facts(want):
                    raise VerifyError(f"{self.name}: the text memo's parse differs from the "
                                      f"full parse of a {len(text)}-char input")
            return conv
        return self._parse_full(text, strict, memo)

    def _parse_full(self, text: str, strict: bool, memo) -> Conversation:
        """The reference text-mode pipeline (lex, LALR driver); a clean parse teaches
        ``memo``."""
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
        if cut is None and not warnings:
            memo.learn(text, toks, turns, src)
        else:
            memo.count_slow()
        return self._conv(Conversation(format=self.name, mode="text", length=len(text),
                                       turns=turns, warnings=warnings, boundaries=[],
                                       default_policy=self.default_policy, text=text))

    def _conv(self, conv: Conversation) -> Conversation:
        # a conversation of this format says, when asked to drop tool calls or reasoning,
        # that plain-text ones still train (Conversation.spans -> runtime.policy.warn_untyped)
        if self._plain is not None:
            conv.plain_text = self._plain
        return conv

    def _partial_marker_tail(self, text: str) -> int | None:
        # one rule for the whole package: chatgrammar.runtime.lexers.partial_marker_tail
        return partial_marker_tail(text, self._lexcfg)

    # ------------------------------------------------------------------ id mode
    def _tok_state(self, tokenizer: Any) -> "_TokState":
        """The per-tokenizer state (id lexer, fast masker), keyed by the tokenizer's content
        (:func:`~chatgrammar.runtime.tokenizers.content_key`), never by the object: a tokenizer that
        gains special tokens gets a fresh lexer, equal tokenizers share one, and no tokenizer
        is kept alive (the state's adapter holds it weakly and is rebound on each lookup)."""
        if isinstance(tokenizer, TokenizerAdapter):
            tokenizer = tokenizer.tokenizer
        last = self._last_tok
        if last is not None:
            ref = last[0].adapter._ref
            if ref is not None and ref() is tokenizer and last[1] == content_version(tokenizer):
                return last[0]
        try:
            hit = self._by_obj.get(tokenizer)
        except TypeError:  # not weakly referenceable, or unhashable: no shortcut
            hit = None
        if hit is not None and hit[0] == content_version(tokenizer):
            st = self._states.get(hit[1])
            if st is not None:
                if st.adapter._ref is None or st.adapter._ref() is not tokenizer:
                    st.adapter.rebind(tokenizer)
                self._last_tok = (st, hit[0])
                return st
        ver = content_version(tokenizer)
        ckey = content_key(tokenizer)
        with self._lock:
            st = self._states.get(ckey)
            if st is None:
                if len(self._states) >= 32:
                    self._states.clear()
                st = self._states[ckey] = _TokState(self, TokenizerAdapter(tokenizer))
            else:
                st.adapter.rebind(tokenizer)
            try:
                self._by_obj[tokenizer] = (ver, ckey)
                self._last_tok = (st, ver)
            except TypeError:  # kept nowhere: its content key is computed on each call
                pass
        return st

    def id_lexer(self, tokenizer: Any) -> IdLexer:
        """The id lexer bound to ``tokenizer`` (cached by the tokenizer's content)."""
        return self._tok_state(tokenizer).lexer

    def _fast_masker(self, tokenizer: Any) -> FastMasker:
        """The memoised exact mask path bound to ``tokenizer`` (see :mod:`chatgrammar.runtime.fastpath`)."""
        return self._tok_state(tokenizer).masker

    def stats(self) -> dict:
        """How this format's samples were computed, by path and by reason.

        ``ids`` counts :meth:`loss_mask` / :meth:`loss_masks` samples: ``fast`` (the memoised
        engine), ``c`` (of those, the ones the C executor computed), ``slow`` (the full
        pipeline, which also teaches the memo), ``harvest`` (full parses whose items were
        memoised), ``window`` (windows of a long sample parsed to learn a new item shape
        there instead of the whole sample), ``alias`` (items cut inside a header served
        through what the parse reads of that header), ``verified`` (fast answers checked in verify mode,
        ``CHATGRAMMAR_VERIFY=1``) and ``reasons`` (slow samples by why: a new item shape, a
        syntax error, ...). ``text`` counts :meth:`parse` calls the same way, and its
        ``path`` says which executor the memo runs (``"vectorised"``, or ``"per-token: "``
        and why the vectorised one cannot run this format's lexing).

        Returns:
            ``{"ids": {...}, "text": {...}}`` (fresh dicts; counters since the format loaded).

        Example:
            >>> fmt.stats()["ids"]["reasons"]  # doctest: +SKIP
            {'new item shape': 5}
        """
        ids = {"fast": 0, "c": 0, "slow": 0, "harvest": 0, "window": 0, "alias": 0,
               "verified": 0, "reasons": {}}
        for st in list(self._states.values()):
            fm = st._masker
            if fm is None:
                continue
            for k, v in fm.stats.items():
                ids[k] = ids.get(k, 0) + v
            for k, v in fm.reasons.items():
                ids["reasons"][k] = ids["reasons"].get(k, 0) + v
        text = {"fast": 0, "slow": 0, "harvest": 0, "verified": 0, "reasons": {}}
        memo = self._text_memo
        if memo is not None:
            for k, v in memo.stats.items():
                text[k] = text.get(k, 0) + v
            text["reasons"] = dict(memo.reasons)
        # which executor answers from the memo: "vectorised", or "per-token: <why not>"
        text["path"] = (memo or TextMemo(self)).path
        return {"ids": ids, "text": text}

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
        return self._conv(Conversation(format=self.name, mode="ids", length=len(arr),
                                       turns=turns, warnings=warnings,
                                       boundaries=[Issue(p, m) for p, m in boundaries],
                                       default_policy=self.default_policy))

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
        # fast path (chatgrammar.runtime.fastpath), which falls back to exactly that when it must.
        st = self._tok_state(tokenizer)
        fm = st._masker or st.masker
        pol = policy or self.default_policy
        if self._plain is not None and pol._drops:
            warn_untyped(self.name, self._plain, pol)
        # The C executor of the same plan and memo takes the sample when everything it needs
        # is memoised; else the Python engine does (and teaches it).
        m = fm.run_c(ids, pol, strict)
        if m is not None:
            return m
        arr, lst = ids_input(ids, scratch=True)  # (the array is used by this call only)
        m = fm.mask(arr, lst, pol, strict, tokenizer)
        return mask_like(ids, m)

    def loss_masks(self, batch: Any, tokenizer: Any, *,
                   policy: MaskPolicy | None = None, strict: bool = True,
                   on_error: str = "raise", errors: list | None = None,
                   roles: list | None = None, offsets: Any = None) -> list:
        """:meth:`loss_mask` over many samples, for loaders that hold a batch.

        The samples' ids are converted and searched for markers in one vectorised pass over
        the concatenated batch; each sample then gets exactly the mask :meth:`loss_mask`
        gives it.

        Args:
            batch: a sequence of samples (each a list of ints, numpy array or torch tensor);
                or, with ``offsets``, ONE flat 1-D array of the ids of all samples.
            tokenizer: see :meth:`parse_ids`.
            policy: a :class:`MaskPolicy`; None uses the format's default.
            strict: as in :meth:`loss_mask`.
            on_error: ``"raise"`` (default): the first sample that does not parse raises;
                ``"record"``: its mask is None and its error goes to ``errors``.
            errors: with ``on_error="record"``, filled with one entry per sample: None or
                the :class:`ParseError` of that sample.
            roles: if given, filled with each sample's turn roles (None for a failed one).
            offsets: sample ``j`` is ``batch[offsets[j]:offsets[j + 1]]`` (``offsets[0] ==
                0``, the last is ``len(batch)``): a columnar chunk (Arrow, a packed dataset)
                without one Python object per sample. Masks are then 0/1 ``bytearray``s.

        Returns:
            One mask per sample, each of the same container kind as its sample.

        Raises:
            ParseError: (strict, ``on_error="raise"``) a sample does not fit the format.
            ValueError: ``on_error`` is neither ``"raise"`` nor ``"record"``.

        Example:
            >>> fmt.loss_masks([ids_a, ids_b], tok)  # doctest: +SKIP
            >>> errs = []
            >>> fmt.loss_masks(batch, tok, on_error="record", errors=errs)  # doctest: +SKIP
        """
        if on_error not in ("raise", "record"):
            raise ValueError(f"on_error must be 'raise' or 'record', not {on_error!r}")
        fm = self._fast_masker(tokenizer)
        pol = policy or self.default_policy
        if self._plain is not None and pol._drops:
            warn_untyped(self.name, self._plain, pol)
        errs = errors if errors is not None else []
        rec = errs if on_error == "record" else None
        if offsets is not None:
            arr = as_id_array(batch)
            starts = [int(x) for x in np.asarray(offsets).tolist()]
            if not starts or starts[0] != 0 or starts[-1] != len(arr) or any(
                    b < a for a, b in zip(starts, starts[1:])):
                raise ValueError("offsets must rise from 0 to len(batch)")
            return fm.masks_flat(arr, starts, pol, strict, roles=roles, errors=rec)
        return fm.masks(batch, pol, strict, tokenizer, roles=roles, errors=rec)


def _facts(conv: Conversation) -> tuple:
    """Everything a Conversation says, by value (Turn and Block compare by identity)."""
    import dataclasses

    return ([dataclasses.asdict(t) for t in conv.turns], conv.warnings, conv.boundaries,
            conv.length, conv.mode)


class _NoMemo:
    """A text memo that knows nothing (verify mode's reference parse)."""

    stats: dict = {}

    def lookup(self, text: str):
        return None

    def source(self, n: int, text: str) -> Source:
        return Source("text", n, text=text)

    def learn(self, *a) -> None:
        pass

    def count_slow(self) -> None:
        pass


_NO_MEMO = _NoMemo()


class _TokState:
    """What a format keeps per tokenizer content: its id lexer and, built on first use, its
    fast masker. Holds the tokenizer only weakly (through ``adapter``)."""

    def __init__(self, fmt: Format, adapter: TokenizerAdapter):
        self.fmt = fmt
        self.adapter = adapter
        self.lexer = IdLexer.build(fmt._lexcfg, adapter)
        self._masker: FastMasker | None = None

    @property
    def masker(self) -> FastMasker:
        if self._masker is None:
            self._masker = FastMasker(self.fmt, self.lexer)
        return self._masker
