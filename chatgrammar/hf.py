"""Hugging Face integrations: a picklable batched map function for ``datasets``, and
:func:`apply_chat_template`, transformers' own call with an exact assistant mask.

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

import weakref
from typing import Any

from .runtime.format import Format
from .runtime.policy import MaskPolicy
from .core.registry import load_format

__all__ = ["MaskFn", "map_fn", "apply_chat_template", "mask_batch"]


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
        # "auto": the bundled format detected for the tokenizer / template, else one inferred
        # from the chat template and verified (chatgrammar.conformance.infer); format_source says which
        self.format_source = "given"
        if isinstance(fmt, str) and fmt == "auto":
            from .conformance.infer import resolve_format
            self.fmt, self.format_source = resolve_format(
                tokenizer, chat_template=template, **dict(template_kwargs or {}))
        else:
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
        src = "" if self.format_source == "given" else f" ({self.format_source})"
        return f"MaskFn({self.fmt.name!r}{src}, policy={self.policy!r}, strict={self.strict})"

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
        from .conformance.render import special_token_vars

        return tpl, {**special_token_vars(tok), **self.template_kwargs}

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
                    from .conformance.render import render_chat

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
        fmt: a :class:`~chatgrammar.Format`, a format name / spec path, or ``"auto"``: the
            bundled format detected for the tokenizer / template, else one inferred from the
            chat template (:func:`chatgrammar.infer_format`); ``MaskFn.format_source`` and its
            repr say which (``"detected"`` / ``"inferred"``).
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
        SpecError: unknown format. ValueError: bad ``on_error``. DetectionError /
        InferenceError: ``"auto"`` finds no bundled format and cannot infer one.

    Example:
        >>> ds = ds.map(map_fn("kimi-k3", tok), batched=True, num_proc=4)  # doctest: +SKIP
    """
    return MaskFn(fmt, tokenizer, policy=policy, strict=strict, template=template,
                  template_kwargs=template_kwargs, on_error=on_error,
                  messages_column=messages_column, ids_column=ids_column)


# ------------------------------------------------------------------ apply_chat_template

def _is_tiktoken(tok: Any) -> bool:
    return type(tok).__name__ == "Encoding" and hasattr(tok, "encode_single_token")


def _is_hf_tokenizer(tok: Any) -> bool:
    """A transformers tokenizer (fast or slow, remote code included): it has its own
    ``apply_chat_template`` and is callable."""
    return callable(getattr(tok, "apply_chat_template", None)) and callable(tok) \
        and not _is_tiktoken(tok)


def _is_batched(conversation: Any) -> bool:
    # transformers' rule: a list whose first element is a list (or has .messages) is a batch
    return isinstance(conversation, (list, tuple)) and len(conversation) > 0 and (
        isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))


_DETECTED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def format_for(fmt: Any, tokenizer: Any, chat_template: str | None) -> Format:
    """``fmt`` loaded, or (None) the format detected from the tokenizer and template, memoised
    per tokenizer object (weakly: nothing is kept alive) and its content version and template,
    so a data loader does not re-run detection per sample and a tokenizer that gains tokens
    is detected again.

    Args:
        fmt: a format name, spec path or Format; None detects it.
        tokenizer: the tokenizer detection reads.
        chat_template: the template detection reads (None: the tokenizer's).

    Returns:
        The Format.

    Raises:
        DetectionError: ``fmt`` is None and no format matches.
    """
    if fmt is not None:
        return load_format(fmt)
    from .core.detect import detect_format
    from .runtime.tokenizers import content_version

    own = getattr(tokenizer, "chat_template", None)
    key = (content_version(tokenizer), chat_template,
           own if isinstance(own, str) else repr(own))
    try:
        seen = _DETECTED.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: detect each call
        return detect_format(tokenizer, chat_template=chat_template)
    hit = seen.get(key)
    if hit is None:
        if len(seen) > 8:
            seen.clear()
        hit = seen[key] = detect_format(tokenizer, chat_template=chat_template)
    return hit


def chat_template_of(tokenizer: Any, chat_template: str | None, tools: Any) -> str:
    """The template transformers' ``get_chat_template`` would pick (a named one, the
    ``tool_use`` one when tools are given and it exists, else ``default``)."""
    t = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        if chat_template is not None and chat_template in t:  # a template name
            return t[chat_template]
        if tools is not None and "tool_use" in t:
            return t["tool_use"]
        t = t.get("default")
    if not t:
        raise ValueError("no chat template: pass chat_template= or use a tokenizer that has one")
    return t


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    if _is_tiktoken(tokenizer):
        return tokenizer.encode(text, allowed_special="all")
    if callable(tokenizer):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    enc = getattr(tokenizer, "encode", None)
    if callable(enc):
        return list(enc(text))
    raise TypeError(f"{type(tokenizer).__name__} cannot tokenise text (it has no encode): "
                    "give input_ids instead")


def mask_batch(fmt: Format, tokenizer: Any, batch: list, *, policy: MaskPolicy | None = None,
               strict: bool = True) -> tuple[list[list[int]], list]:
    """Masks of many id lists, strict or lenient, with what went wrong per sample.

    Args:
        fmt: the format. tokenizer: its tokenizer. batch: lists of ids.
        policy: None = the format's default.
        strict: True raises the first sample's :class:`~chatgrammar.ChatGrammarError`;
            False never raises on a sample: a malformed part trains nothing.

    Returns:
        ``(masks, problems)``: one ``list[int]`` per sample, and per sample ``None`` (clean)
        or a short text saying what was skipped (lenient mode only).

    Raises:
        ChatGrammarError: (strict only) the first sample that does not fit the format.

    Example:
        >>> masks, problems = mask_batch(cg.load_format("chatml"), tok, [ids_a, ids_b],
        ...                              strict=False)                  # doctest: +SKIP
    """
    pol = policy or fmt.default_policy
    batch = [list(x) for x in batch]
    problems: list = [None] * len(batch)
    if strict:
        return fmt.loss_masks(batch, tokenizer, policy=pol, strict=True), problems
    # the batch API records the samples that do not fit (one vectorised pass for all); only
    # those are parsed again leniently, to train what is well formed in them
    errs: list = []
    masks = list(fmt.loss_masks(batch, tokenizer, policy=pol, strict=True, on_error="record",
                                errors=errs))
    for j, err in enumerate(errs):
        if err is None:
            continue
        first = f"{type(err).__name__}: {err}"
        try:
            conv = fmt.parse_ids(batch[j], tokenizer, strict=False)
            m = conv.mask(pol)
            why = "; ".join(str(w) for w in conv.warnings[:3]) or first
        except Exception as exc:  # noqa: BLE001 - lenient: recorded, never raised
            m, why = [0] * len(batch[j]), f"{type(exc).__name__}: {exc}"
        masks[j] = list(m)
        problems[j] = why.splitlines()[0][:300] if why else "malformed"
    return masks, problems


def _truncating(truncation: Any) -> bool:
    return bool(truncation) and truncation not in ("do_not_truncate",)


def apply_chat_template(
    tokenizer: Any,
    conversation: Any,
    tools: list | None = None,
    documents: list | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tokenize: bool = True,
    padding: Any = False,
    truncation: Any = False,
    max_length: int | None = None,
    return_tensors: Any = None,
    return_dict: bool = True,
    return_assistant_tokens_mask: bool = False,
    tokenizer_kwargs: dict | None = None,
    *,
    format: Format | str | None = None,  # noqa: A002 - the name the rest of the API uses
    policy: MaskPolicy | None = None,
    strict: bool = True,
    **kwargs: Any,
):
    """transformers' ``apply_chat_template`` with an assistant mask that does not need
    ``{% generation %}`` tags, a fast tokenizer, or a transformers tokenizer at all.

    Same arguments, defaults and return types as
    ``tokenizer.apply_chat_template`` of transformers 5 (``return_dict=True`` by default):
    with ``return_assistant_tokens_mask=True`` the result is a ``BatchEncoding`` with
    ``input_ids``, ``attention_mask`` and ``assistant_masks`` — lists for one conversation,
    lists of lists for a batch, ``(batch, n)`` tensors with ``return_tensors`` ("pt" / "np";
    one conversation gives ``(1, n)``, as in transformers). The mask comes from the chat
    format's grammar (``format``, detected from the tokenizer by default) parsing the token ids,
    so it is exact for templates without generation tags (where transformers returns all
    zeros), for slow tokenizers (Kimi's tiktoken-backed ``TikTokenTokenizer``) and for a bare
    ``tiktoken.Encoding``.

    Rendering and tokenisation: a transformers tokenizer renders and tokenises with its own
    ``apply_chat_template`` (so ``input_ids`` and ``attention_mask`` are exactly transformers'
    output, padding and truncation included); a ``tiktoken.Encoding`` (or any object with
    ``encode``) is rendered with chatgrammar's sandboxed renderer (:func:`chatgrammar.conformance.render.
    render_chat`, byte-identical to transformers) and encoded with specials allowed.

    Masks: computed on the ids the model sees. Right truncation (the default side) masks the
    cut sequence, so an assistant turn cut by ``max_length`` trains what is left of it (under
    ``MaskPolicy(truncated=True)``, the default). Left truncation masks the whole conversation
    and keeps the tail. Padding positions are 0.

    Without ``return_assistant_tokens_mask`` the call is exactly the tokenizer's own (for a
    transformers tokenizer).

    Args:
        tokenizer: a transformers tokenizer (fast or slow), a ``tiktoken.Encoding``, or an
            object with ``encode`` + ``convert_tokens_to_ids`` + ``decode``.
        conversation: a list of message dicts, or a list of such lists (a batch).
        tools, documents, chat_template, add_generation_prompt, continue_final_message,
        tokenize, padding, truncation, max_length, return_tensors, return_dict,
        tokenizer_kwargs: as in transformers (``padding`` needs a transformers tokenizer).
        return_assistant_tokens_mask: add ``assistant_masks`` (1 where the policy trains).
        format: the chat format (name, path or :class:`~chatgrammar.Format`); None detects it
            with :func:`chatgrammar.detect_format`.
        policy: the :class:`~chatgrammar.MaskPolicy`; None = the format's default.
        strict: True (default) raises a :class:`~chatgrammar.ParseError` when the ids do not fit
            the format; False trains nothing where they do not.
        **kwargs: template variables (``enable_thinking=False``...), as in transformers.

    Returns:
        What transformers returns for the same arguments: a ``BatchEncoding`` (or a plain dict
        when transformers is not installed), a list of ids (``return_dict=False``) or the
        rendered text (``tokenize=False``).

    Raises:
        ValueError: ``return_assistant_tokens_mask`` without ``tokenize`` and ``return_dict``,
            with ``continue_final_message``, an empty conversation, no chat template, padding
            with a non-transformers tokenizer.
        DetectionError: ``format=None`` and no format matches the tokenizer.
        ParseError: (strict) the rendered ids do not fit the format.
        TemplateError: the template rejected the conversation (non-transformers tokenizers;
            a transformers tokenizer raises its own errors).

    Example:
        >>> from chatgrammar.hf import apply_chat_template
        >>> out = apply_chat_template(tok, messages, return_assistant_tokens_mask=True)  # doctest: +SKIP
        >>> out["assistant_masks"]                                    # doctest: +SKIP
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    """
    return_dict = _check_apply_args(conversation, tokenize, return_dict,
                                    return_assistant_tokens_mask, continue_final_message)
    batched = _is_batched(conversation)
    convs = list(conversation) if batched else [conversation]
    opts = dict(tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                continue_final_message=continue_final_message, padding=padding,
                truncation=truncation, max_length=max_length, return_tensors=return_tensors,
                return_dict=return_dict, return_mask=return_assistant_tokens_mask,
                fmt=format, policy=policy, strict=strict, kwargs=kwargs)
    if _is_hf_tokenizer(tokenizer):
        return _apply_hf(tokenizer, conversation, convs, batched,
                         tokenizer_kwargs=tokenizer_kwargs, **opts)
    return _apply_plain(tokenizer, convs, batched, **opts)


def _check_apply_args(conversation: Any, tokenize: bool, return_dict: bool,
                      return_mask: bool, continue_final_message: Any) -> Any:
    """The argument combinations :func:`apply_chat_template` refuses, as transformers does.

    Returns:
        The ``return_dict`` in effect (``False`` without ``tokenize``).

    Raises:
        ValueError: a mask without ``tokenize`` and ``return_dict``, a mask with
            ``continue_final_message``, or an empty conversation.
    """
    if not tokenize:
        return_dict = False
    if return_mask and not (return_dict and tokenize):
        raise ValueError("`return_assistant_tokens_mask=True` requires `return_dict=True` "
                         "and `tokenize=True`")
    if return_mask and continue_final_message:
        raise ValueError("continue_final_message is not compatible with "
                         "return_assistant_tokens_mask.")
    if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at "
                         "least one message.")
    return return_dict


def _apply_hf(tok, conversation, convs, batched, *, tools, documents, chat_template,
              add_generation_prompt, continue_final_message, tokenize, padding, truncation,
              max_length, return_tensors, return_dict, return_mask, tokenizer_kwargs, fmt,
              policy, strict, kwargs):
    common = dict(tools=tools, documents=documents, chat_template=chat_template,
                  add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:
        common["continue_final_message"] = continue_final_message
    if tokenizer_kwargs:
        common["tokenizer_kwargs"] = tokenizer_kwargs
    if not return_mask:  # exactly the tokenizer's own call
        return tok.apply_chat_template(conversation, tokenize=tokenize, padding=padding,
                                       truncation=truncation, max_length=max_length,
                                       return_tensors=return_tensors, return_dict=return_dict,
                                       **common)
    out = tok.apply_chat_template(conversation, tokenize=True, padding=padding,
                                  truncation=truncation, max_length=max_length,
                                  return_tensors=None, return_dict=True, **common)
    rows = out["input_ids"] if batched else [out["input_ids"]]
    att = out.get("attention_mask")
    att_rows = (att if batched else [att]) if att is not None else None
    spans: list[tuple[int, int]] = []
    real: list[list[int]] = []
    for j, ids in enumerate(rows):
        ids = list(ids)
        if att_rows is None:
            if padding not in (False, None, "do_not_pad"):
                raise ValueError("padding needs the tokenizer to return an attention_mask")
            s, e = 0, len(ids)
        else:
            on = [k for k, a in enumerate(att_rows[j]) if a]
            s, e = (on[0], on[-1] + 1) if on else (0, 0)
        spans.append((s, e))
        real.append(ids[s:e])
    left = _truncating(truncation) and getattr(tok, "truncation_side", "right") == "left"
    # a template given here is evidence for detection too (one the tokenizer carries is
    # looked up by detect_format itself)
    src = chat_template_of(tok, chat_template, tools) if chat_template is not None else None
    f = format_for(fmt, tok, src)
    if left:  # mask the whole conversation, keep the tail the tokenizer kept
        full = tok.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                       return_tensors=None, **common)["input_ids"]
        full = full if batched else [full]
        masks, _ = mask_batch(f, tok, full, policy=policy, strict=strict)
        masks = [m[len(m) - len(r):] if r else [] for m, r in zip(masks, real)]
    else:
        masks, _ = mask_batch(f, tok, real, policy=policy, strict=strict)
    mrows = []
    for (s, e), ids, m in zip(spans, rows, masks):
        row = [0] * len(ids)
        row[s:e] = m
        mrows.append(row)
    out["assistant_masks"] = mrows if batched else mrows[0]
    if return_tensors:
        if not batched:
            for k in list(out.keys()):
                out[k] = [out[k]]
        out.convert_to_tensors(tensor_type=return_tensors)
    return out


def _batch_encoding(data: dict, return_tensors: Any):
    try:
        from transformers import BatchEncoding
    except ImportError:  # plain dict; numpy tensors only
        if return_tensors in ("np", "numpy"):
            import numpy as np
            return {k: np.asarray(v, dtype=np.int64) for k, v in data.items()}
        if return_tensors in ("pt", "torch"):
            import torch
            return {k: torch.tensor(v, dtype=torch.long) for k, v in data.items()}
        return data
    return BatchEncoding(data, tensor_type=return_tensors)


def _apply_plain(tok, convs, batched, *, tools, documents, chat_template, add_generation_prompt,
                 continue_final_message, tokenize, padding, truncation, max_length,
                 return_tensors, return_dict, return_mask, fmt, policy, strict, kwargs):
    from .conformance.render import render_chat

    template = chat_template_of(tok, chat_template, tools)
    specials = dict(getattr(tok, "special_tokens_map", None) or {})
    texts = [render_chat(template, c, tools=tools, documents=documents,
                         add_generation_prompt=add_generation_prompt,
                         continue_final_message=continue_final_message,
                         **{**specials, **kwargs}) for c in convs]
    if not tokenize:
        return texts if batched else texts[0]
    if padding not in (False, None, "do_not_pad"):
        raise ValueError("padding needs a transformers tokenizer (this one has no pad token)")
    full = [_encode_text(tok, t) for t in texts]
    cut = full
    left = getattr(tok, "truncation_side", "right") == "left"
    if _truncating(truncation) and max_length is not None:
        cut = [x[len(x) - max_length:] if left and len(x) > max_length else x[:max_length]
               for x in full]
    if not return_dict:
        return cut if batched else cut[0]
    data: dict = {"input_ids": cut, "attention_mask": [[1] * len(x) for x in cut]}
    if return_mask:
        f = format_for(fmt, tok, template)
        if left and cut is not full:
            masks, _ = mask_batch(f, tok, full, policy=policy, strict=strict)
            masks = [m[len(m) - len(c):] if c else [] for m, c in zip(masks, cut)]
        else:
            masks, _ = mask_batch(f, tok, cut, policy=policy, strict=strict)
        data["assistant_masks"] = masks
    if not batched and not return_tensors:
        data = {k: v[0] for k, v in data.items()}
    return _batch_encoding(data, return_tensors)
