"""Hugging Face ``datasets`` integration: a picklable batched map function.

Example:
    >>> import chatgrammar as cg
    >>> from chatgrammar.hf import map_fn
    >>> ds = ds.map(map_fn("chatml", tok), batched=True, num_proc=8)  # doctest: +SKIP

``map_fn`` returns a :class:`MaskFn`: a plain object (no closures, no lambdas) that pickles by
value — the format by its spec path (rebuilt from the compile cache in each worker), the
tokenizer as the tokenizer pickles — so ``Dataset.map(..., num_proc=N)`` can ship it to worker
processes, and ``datasets`` can fingerprint it for its cache. The same callable works as a Ray
Data ``map_batches`` function (batch format ``"default"`` / dict of lists) and inside a Spark
``mapInPandas`` function (see docs/scale.md).
"""
from __future__ import annotations

from typing import Any

from .format import Format
from .policy import MaskPolicy
from .registry import load_format

__all__ = ["MaskFn", "map_fn"]


class MaskFn:
    """Batched ``messages`` / ``input_ids`` → ``input_ids`` + ``loss_mask`` + ``num_trained``.

    Built by :func:`map_fn`; see there for the arguments. Calling it on a batch (a dict of
    column lists) returns the new columns.
    """

    def __init__(self, fmt: Format | str, tokenizer: Any, *, policy: MaskPolicy | None = None,
                 strict: bool = True, template: str | None = None,
                 template_kwargs: dict | None = None, on_error: str = "raise",
                 messages_column: str = "messages", ids_column: str = "input_ids"):
        if on_error not in ("raise", "record"):
            raise ValueError("on_error must be 'raise' or 'record'")
        self.fmt = load_format(fmt)
        self.tokenizer = tokenizer
        self.policy = policy
        self.strict = strict
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        self.on_error = on_error
        self.messages_column = messages_column
        self.ids_column = ids_column

    def __repr__(self) -> str:
        return f"MaskFn({self.fmt.name!r}, policy={self.policy!r}, strict={self.strict})"

    # the tokenizer's chat template and special tokens, looked up once per process
    def _render_setup(self) -> tuple[str, dict]:
        tpl = self.template
        tok = self.tokenizer
        if tpl is None:
            t = getattr(tok, "chat_template", None)
            tpl = t.get("default") if isinstance(t, dict) else t
        if not tpl:
            raise ValueError("rows carry messages but there is no chat template: pass "
                             "template= to map_fn or use a tokenizer that has one")
        specials = {k: v for k, v in (getattr(tok, "special_tokens_map", None) or {}).items()
                    if isinstance(v, str)}
        return tpl, {**specials, **self.template_kwargs}

    def _encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if hasattr(tok, "encode") and type(tok).__name__ == "Encoding":  # tiktoken
            return tok.encode(text, allowed_special="all")
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def __call__(self, batch: dict) -> dict:
        """Map one batch (dict of column lists) to ``input_ids``, ``loss_mask``,
        ``num_trained`` (and ``chatgrammar_error`` with ``on_error="record"``)."""
        ids_col = batch.get(self.ids_column)
        msgs_col = batch.get(self.messages_column)
        n = len(ids_col if ids_col is not None else msgs_col if msgs_col is not None else [])
        if ids_col is None and msgs_col is None:
            raise KeyError(f"the batch has neither {self.ids_column!r} nor "
                           f"{self.messages_column!r}")
        setup = None
        all_ids: list = []
        errors: list = [None] * n
        for i in range(n):
            ids = ids_col[i] if ids_col is not None else None
            try:
                if ids is None:
                    if setup is None:
                        setup = self._render_setup()
                    from .render import render_chat

                    tools = batch.get("tools")
                    text = render_chat(setup[0], msgs_col[i],
                                       tools=(tools[i] if tools is not None else None) or None,
                                       **setup[1])
                    ids = self._encode(text)
                all_ids.append(list(ids))
            except Exception as exc:
                if self.on_error == "raise":
                    raise
                errors[i] = f"{type(exc).__name__}: {exc}"
                all_ids.append([])
        perr: list = []
        masks = self.fmt.loss_masks(all_ids, self.tokenizer, policy=self.policy,
                                    strict=self.strict, on_error=self.on_error, errors=perr)
        out_mask: list = []
        trained: list = []
        for i, m in enumerate(masks):
            if errors[i] is None and perr and perr[i] is not None:
                errors[i] = f"{type(perr[i]).__name__}: {perr[i]}"
            if errors[i] is not None:
                out_mask.append(None)  # never an empty mask: the error says why
                trained.append(None)
            else:
                out_mask.append(m)
                trained.append(m.count(1))
        out = {"input_ids": [x if e is None else None for x, e in zip(all_ids, errors)],
               "loss_mask": out_mask, "num_trained": trained}
        if self.on_error == "record":
            out["chatgrammar_error"] = errors
        return out


def map_fn(fmt: Format | str, tokenizer: Any, *, policy: MaskPolicy | None = None,
           strict: bool = True, template: str | None = None,
           template_kwargs: dict | None = None, on_error: str = "raise",
           messages_column: str = "messages", ids_column: str = "input_ids") -> MaskFn:
    """A picklable function for ``Dataset.map(fn, batched=True, num_proc=N)``.

    Rows with token ids (``ids_column``) are masked as they are; rows with messages
    (``messages_column``, plus an optional ``tools`` column) are rendered with ``template`` (or
    the tokenizer's chat template, special tokens passed as transformers passes them) and
    tokenised without adding special tokens, then masked.

    Args:
        fmt: a :class:`~chatgrammar.Format` or a format name / spec path.
        tokenizer: a transformers tokenizer or ``tiktoken.Encoding`` (picklable).
        policy: the :class:`~chatgrammar.MaskPolicy`; None uses the format's default.
        strict: structure errors raise (default); False skips malformed parts.
        template: a Jinja chat template for message rows.
        template_kwargs: extra template variables (``enable_thinking=False``...).
        on_error: ``"raise"`` (default: the map fails on the first bad row) or ``"record"``
            (the row gets ``loss_mask=None`` and the message in ``chatgrammar_error``; filter
            them out or inspect them — they are never given an empty mask).
        messages_column, ids_column: input column names.

    Returns:
        A :class:`MaskFn` producing ``input_ids``, ``loss_mask`` and ``num_trained``.

    Raises:
        SpecError: unknown format. ValueError: bad ``on_error``.

    Example:
        >>> ds = ds.map(map_fn("kimi-k3", tok), batched=True, num_proc=4)  # doctest: +SKIP
    """
    return MaskFn(fmt, tokenizer, policy=policy, strict=strict, template=template,
                  template_kwargs=template_kwargs, on_error=on_error,
                  messages_column=messages_column, ids_column=ids_column)
