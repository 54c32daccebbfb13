"""TRL integration: a pre-tokenised dataset whose ``assistant_masks`` TRL's ``SFTTrainer`` uses.

``prepare(dataset, tokenizer)`` renders each conversation with the tokenizer's chat template,
tokenises it, cuts it to ``max_length`` and masks it with the chat format's grammar. The result
has two columns, ``input_ids`` and ``assistant_masks``. TRL (1.16) treats a dataset with an
``input_ids`` column as already processed and builds its ``labels`` from ``assistant_masks``
itself (``-100`` where the mask is 0), with no ``{% generation %}`` tag, no fast tokenizer and no
``assistant_only_loss`` needed:

    >>> from chatgrammar.integrations.trl import prepare
    >>> from trl import SFTConfig, SFTTrainer
    >>> train = prepare(ds, tok, max_length=4096)                        # doctest: +SKIP
    >>> SFTTrainer(model, args=SFTConfig(max_length=4096), train_dataset=train,
    ...            processing_class=tok).train()                          # doctest: +SKIP

Install with ``pip install 'chatgrammar[trl]'``. This module imports ``datasets`` only when
``prepare`` runs, and never imports torch or trl.
"""
from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass
from typing import Any

from ..runtime.format import Format
from ..hf import format_for, apply_chat_template, mask_batch
from ..runtime.policy import MaskPolicy

__all__ = ["prepare", "PrepareFn"]

log = logging.getLogger("chatgrammar.integrations.trl")

# per-row status, in the private column _STATUS
OK, MALFORMED, DROPPED = 0, 1, 2
_STATUS, _ERROR, _CUT = "chatgrammar_status", "chatgrammar_error", "chatgrammar_truncated"
_TRAINED = "chatgrammar_trained"
_PRIVATE = [_STATUS, _ERROR, _CUT, _TRAINED]


@dataclass(eq=False)  # (identity equality: a map function, not a value)
class PrepareFn:
    """The batched map function behind :func:`prepare` (picklable: the format pickles as its
    spec path, the tokenizer as it pickles itself), usable on its own in a ``datasets`` map.

    Calling it on a batch (a dict of column lists with ``messages`` or ``input_ids``) returns
    ``input_ids``, ``assistant_masks`` and three bookkeeping columns :func:`prepare` counts and
    removes: ``chatgrammar_status`` (0 clean, 1 malformed parts trained nothing, 2 unusable:
    dropped), ``chatgrammar_error`` (why, or None) and ``chatgrammar_truncated`` (cut by
    ``max_length``).
    """

    fmt: Format
    tokenizer: Any
    _: KW_ONLY
    policy: MaskPolicy | None = None
    max_length: int | None = None
    strict: bool = False
    chat_template: str | None = None
    template_kwargs: dict | None = None
    messages_column: str = "messages"

    def __post_init__(self) -> None:
        self.template_kwargs = dict(self.template_kwargs or {})  # (a copy: never the caller's)

    def __repr__(self) -> str:
        return (f"PrepareFn({self.fmt.name!r}, policy={self.policy!r}, "
                f"max_length={self.max_length}, strict={self.strict})")

    def _ids(self, batch: dict, i: int) -> list[int]:
        if "input_ids" in batch:
            return [int(x) for x in batch["input_ids"][i]]
        import json

        tools = batch.get("tools")
        tools = tools[i] if tools is not None else None
        tools = json.loads(tools) if isinstance(tools, str) else tools
        kw = dict(self.template_kwargs)
        per_row = batch.get("chat_template_kwargs")
        if per_row is not None and per_row[i]:
            kw.update(per_row[i])
        ids = apply_chat_template(self.tokenizer, batch[self.messages_column][i],
                                  tools=tools or None, chat_template=self.chat_template,
                                  tokenize=True, return_dict=False, **kw)
        return [int(x) for x in ids]

    def __call__(self, batch: dict) -> dict:
        if "input_ids" not in batch and self.messages_column not in batch:
            raise KeyError(f"the dataset has neither 'input_ids' nor {self.messages_column!r}")
        n = len(batch["input_ids"] if "input_ids" in batch else batch[self.messages_column])
        rows: list = []
        status = [OK] * n
        errors: list = [None] * n
        cut = [False] * n
        for i in range(n):
            try:
                ids = self._ids(batch, i)
                if not ids:
                    raise ValueError("the conversation rendered to no tokens")
            except Exception as exc:
                if self.strict:
                    raise
                status[i], errors[i] = DROPPED, f"{type(exc).__name__}: {exc}"[:500]
                ids = []
            if self.max_length is not None and len(ids) > self.max_length:
                ids, cut[i] = ids[:self.max_length], True  # TRL's keep_start, masked as cut
            rows.append(ids)
        keep = [j for j in range(n) if status[j] != DROPPED]
        masks, problems = mask_batch(self.fmt, self.tokenizer, [rows[j] for j in keep],
                                     policy=self.policy, strict=self.strict)
        out_masks: list = [[] for _ in range(n)]
        for j, m, p in zip(keep, masks, problems):
            out_masks[j] = m
            if p is not None:
                status[j], errors[j] = MALFORMED, p
        return {"input_ids": rows, "assistant_masks": out_masks, _STATUS: status,
                _ERROR: errors, _CUT: cut, _TRAINED: [sum(m) for m in out_masks]}


def prepare(dataset: Any, tokenizer: Any, *, format: Format | str | None = None,  # noqa: A002
            policy: MaskPolicy | None = None, max_length: int | None = None,
            num_proc: int | None = None, strict: bool = False,
            chat_template: str | None = None, template_kwargs: dict | None = None,
            messages_column: str = "messages", drop_empty: bool = True,
            stats: dict | None = None):
    """A ``datasets.Dataset`` of ``input_ids`` + ``assistant_masks`` for TRL's ``SFTTrainer``.

    Each row's ``messages`` (OpenAI / transformers layout; optional ``tools`` and
    ``chat_template_kwargs`` columns as TRL reads them) is rendered with the chat template and
    tokenised exactly as ``tokenizer.apply_chat_template`` does (a ``tiktoken.Encoding``: with
    chatgrammar's sandboxed renderer), cut to ``max_length`` (keeping the start, as TRL does)
    and masked by the format's grammar on the cut ids, so a turn cut mid-way trains what is left
    of it. Rows that already have ``input_ids`` are cut and masked as they are.

    Give the trainer the same ``max_length`` (``SFTConfig(max_length=...)``, or None): TRL cuts
    its labels again, which is then a no-op. Leave ``assistant_only_loss`` and
    ``completion_only_loss`` unset: the masks are already in the dataset, and TRL's
    ``assistant_only_loss=True`` requires a conversational (un-tokenised) dataset.

    Lenient by default (a data loader must not stop a run on one bad sample): a sample whose
    ids do not fit the format trains nothing where they do not fit (the rest of it trains) and
    is counted; a sample that cannot be rendered or tokenised (the template rejects it) is
    dropped and counted; with ``drop_empty`` a sample whose mask is all zeros (no assistant
    output, or cut inside a header) is dropped and counted, as TRL itself drops fully masked
    samples. The counts are logged once (logger ``chatgrammar.integrations.trl``, a warning
    when anything was malformed or dropped) and written into ``stats``. ``strict=True`` raises
    the first error instead.

    Args:
        dataset: a ``datasets.Dataset`` (or a list of row dicts) with a ``messages`` or an
            ``input_ids`` column.
        tokenizer: a transformers tokenizer (fast or slow, e.g. Kimi's ``TikTokenTokenizer``),
            or a ``tiktoken.Encoding`` (then pass ``chat_template``).
        format: the chat format (name, spec path or :class:`~chatgrammar.Format`); None
            detects it from the tokenizer and template (:func:`chatgrammar.detect_format`).
        policy: the :class:`~chatgrammar.MaskPolicy`; None = the format's default.
        max_length: cut every sample to this many tokens (None: no cut).
        num_proc: worker processes for ``Dataset.map`` (the tokenizer must pickle).
        strict: raise on the first bad sample instead of counting it.
        chat_template: a Jinja template instead of the tokenizer's own.
        template_kwargs: template variables for every row (``enable_thinking=False``...).
        messages_column: the conversation column.
        drop_empty: drop samples that train nothing (default True).
        stats: a dict to fill with ``samples``, ``kept``, ``malformed``, ``dropped``,
            ``empty``, ``truncated``, ``tokens``, ``trained`` and ``errors`` (the first few).

    Returns:
        A ``datasets.Dataset`` with exactly the columns ``input_ids`` and ``assistant_masks``
        (one 0/1 per id), in input order minus the dropped rows.

    Raises:
        ImportError: ``datasets`` is not installed (``pip install 'chatgrammar[trl]'``).
        DetectionError: ``format=None`` and no format matches the tokenizer.
        KeyError: the dataset has neither ``messages`` nor ``input_ids``.
        ChatGrammarError, TemplateError: (strict) the first bad sample.

    Example:
        >>> train = prepare(ds, tok, max_length=2048, stats=(st := {}))   # doctest: +SKIP
        >>> st["malformed"], st["dropped"]                                 # doctest: +SKIP
        (0, 0)
    """
    dataset = _as_dataset(dataset, messages_column, max_length)
    cols = dataset.column_names
    src = None
    if chat_template is not None:
        from ..hf import chat_template_of
        src = chat_template_of(tokenizer, chat_template, None)
    fmt = format_for(format, tokenizer, src)
    fn = PrepareFn(fmt, tokenizer, policy=policy, max_length=max_length, strict=strict,
                   chat_template=chat_template, template_kwargs=template_kwargs,
                   messages_column=messages_column)
    out = dataset.map(fn, batched=True, batch_size=256, num_proc=num_proc,
                      remove_columns=cols, desc="chatgrammar: masking",
                      new_fingerprint=_fingerprint(dataset, fn))
    st, keep = _counted(out, fmt.name, drop_empty)
    if stats is not None:
        stats.clear()
        stats.update(st)
    if not all(keep):
        out = out.select([i for i, k in enumerate(keep) if k])
    return out.remove_columns(_PRIVATE)


def _as_dataset(dataset: Any, messages_column: str, max_length: int | None) -> Any:
    """:func:`prepare`'s input as a ``datasets.Dataset``, its arguments checked.

    Raises:
        ImportError: ``datasets`` is not installed.
        TypeError: neither a ``datasets.Dataset`` nor a list of rows.
        KeyError: no ``input_ids`` and no ``messages_column`` column.
        ValueError: ``max_length`` below 1.
    """
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - the extra pulls it in
        raise ImportError("chatgrammar.integrations.trl needs the 'datasets' package: "
                          "pip install 'chatgrammar[trl]'") from exc
    if isinstance(dataset, list):
        dataset = datasets.Dataset.from_list(dataset)
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"prepare() takes a datasets.Dataset, got {type(dataset).__name__}")
    cols = dataset.column_names
    if "input_ids" not in cols and messages_column not in cols:
        raise KeyError(f"the dataset has neither 'input_ids' nor {messages_column!r} "
                       f"(columns: {cols})")
    if max_length is not None and max_length < 1:
        raise ValueError("max_length must be positive")
    return dataset


def _counted(out: Any, fmt_name: str, drop_empty: bool) -> tuple[dict, list[bool]]:
    """The counts of :func:`prepare` (its ``stats``) over the mapped dataset ``out`` and which
    rows to keep; logs them once (a warning when anything was malformed or dropped)."""
    status = out[_STATUS]
    cut = out[_CUT]
    masks_ok = [s != DROPPED for s in status]
    trained = out[_TRAINED]
    lens = _lengths(out)
    empty = [ok and t == 0 for ok, t in zip(masks_ok, trained)]
    keep = [ok and not (drop_empty and e) for ok, e in zip(masks_ok, empty)]
    errs = [(i, e) for i, e in enumerate(out[_ERROR]) if e is not None]
    st = {"samples": len(status), "kept": sum(keep),
          "malformed": sum(s == MALFORMED for s in status),
          "dropped": sum(s == DROPPED for s in status), "empty": sum(empty),
          "truncated": sum(cut), "tokens": sum(n for n, k in zip(lens, keep) if k),
          "trained": sum(t for t, k in zip(trained, keep) if k),
          "format": fmt_name, "errors": errs[:10]}
    msg = (f"chatgrammar prepare ({fmt_name}): {st['kept']} of {st['samples']} samples kept; "
           f"{st['malformed']} malformed (trained nothing where malformed), {st['dropped']} "
           f"unusable, {st['empty']} train nothing{' (dropped)' if drop_empty else ''}, "
           f"{st['truncated']} cut at max_length")
    if errs:
        msg += f"; first problem: row {errs[0][0]}: {errs[0][1]}"
    (log.warning if st["malformed"] or st["dropped"] or (drop_empty and st["empty"])
     else log.info)(msg)
    return st, keep


def _tokenizer_key(tok: Any) -> Any:
    """What determines a tokenizer's ids, cheaper to hash than the tokenizer itself (datasets
    pickles the whole object: ~4 s for Kimi's slow tokenizer), or None (then datasets hashes
    the tokenizer as usual). Fast tokenizers: the backend's full JSON definition; tiktoken and
    tiktoken-backed slow tokenizers: pattern, ranks and specials; plus the added tokens, special
    tokens and chat template of a transformers wrapper."""
    from ..runtime.tokenizers import _tiktoken_encoding

    wrapper = [type(tok).__module__, type(tok).__qualname__,
               getattr(tok, "chat_template", None),
               sorted((getattr(tok, "special_tokens_map", None) or {}).items(), key=str),
               sorted((getattr(tok, "added_tokens_encoder", None) or {}).items()),
               getattr(tok, "truncation_side", None)]
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "to_str", None)):
        return wrapper + ["fast", backend.to_str()]
    enc = _tiktoken_encoding(tok)
    if enc is not None:
        ranks = getattr(enc, "_mergeable_ranks", None)
        if not isinstance(ranks, dict):
            return None
        return wrapper + ["tiktoken", enc.name, getattr(enc, "_pat_str", None),
                          _ranks_digest(ranks),
                          sorted(getattr(enc, "_special_tokens", {}).items())]
    return None


def _ranks_digest(ranks: dict) -> str:
    """A stable digest of a tiktoken vocabulary (pieces in rank order): datasets' Hasher
    pickles its input with dill's pure-Python pickler, ~160k (bytes, rank) tuples took ~4 CPU-s
    per ``prepare`` call; the C pickler and sha256 take milliseconds for the same content."""
    import hashlib
    import pickle

    return hashlib.sha256(pickle.dumps(sorted(ranks.items(), key=lambda kv: kv[1]),
                                       protocol=4)).hexdigest()


def _fingerprint(dataset: Any, fn: PrepareFn) -> str | None:
    """The cache fingerprint of prepare's map (None: let datasets compute it)."""
    key = _tokenizer_key(fn.tokenizer)
    if key is None or not getattr(dataset, "_fingerprint", None):
        return None
    from datasets.fingerprint import Hasher

    from .. import __version__

    path = fn.fmt.path
    try:
        with open(path, "rb") as f:
            spec_bytes = f.read()
    except (OSError, TypeError):
        spec_bytes = None
    return Hasher.hash(["chatgrammar.integrations.trl.prepare", __version__,
                        dataset._fingerprint, key, fn.fmt.name, str(path), spec_bytes,
                        fn.fmt.grammar, repr(fn.fmt.default_policy), repr(fn.policy),
                        fn.max_length, fn.strict, fn.chat_template,
                        sorted(fn.template_kwargs.items(), key=str), fn.messages_column])


def _lengths(ds: Any) -> list[int]:
    """Lengths of the ``input_ids`` lists, read from Arrow without building Python lists."""
    import pyarrow.compute as pc

    col = ds.data.column("input_ids")
    return pc.list_value_length(col).to_pylist()
