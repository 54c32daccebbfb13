"""NVIDIA Model-Optimizer: chatgrammar as its loss-mask recovery and final-norm table.

Model-Optimizer's speculative-decoding data paths (the streaming dataset's
``_tokenize_with_loss_mask`` and the offline ``OfflineSupervisedDataset``) ask
``modelopt.torch.utils.loss_mask.get_loss_mask_recovery(tokenizer)`` for the first registered
:class:`~modelopt.torch.utils.loss_mask.LossMaskRecovery` whose ``detect`` says yes, then call
its ``compute(tokenizer, input_ids)``. First match wins, so a Kimi-K3 tokenizer (which also
carries K2's ``<|im_*|>`` strings) gets the K2 scanner and all-zero masks. The drafter's
``FakeBaseModel`` picks its final norm with ``_select_final_norm_type`` from a hard-coded table.

Two lines make both chatgrammar's::

    from chatgrammar.integrations import modelopt as cg_modelopt
    cg_modelopt.install()

:func:`install` puts one chatgrammar recovery first in the registry (every bundled format, the
declared detection precedence) and makes the final-norm selection read ``formats/norms.yaml``
with exact torch modules (:func:`chatgrammar.build_final_norm`), so Kimi-K3 (``kimi_linear``),
Gemma 4 and gpt-oss get a norm. :func:`recovery` builds the recovery without registering it.

In a data loader the recovery is lenient by default: a malformed sample (e.g. a marker string a
user typed, which a Kimi tokenizer turns into the special id) trains nothing where it is
malformed, is counted (:func:`stats`) and logged (rate-limited, logger
``chatgrammar.integrations.modelopt``), and never raises; ``strict=True`` raises
:class:`chatgrammar.ParseError` instead.

Requires ``nvidia-modelopt`` (``pip install 'chatgrammar[modelopt]'``); importing this module
imports it and torch.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import numpy as np

try:
    import torch
    from modelopt.torch.utils import loss_mask as _loss_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"chatgrammar.integrations.modelopt needs nvidia-modelopt and torch "
                      f"(pip install 'chatgrammar[modelopt]'): {exc}") from exc

import chatgrammar as cg
from chatgrammar.errors import ChatGrammarError, DetectionError

__all__ = ["ChatGrammarRecovery", "install", "install_final_norm", "needs_decoding",
           "recovery", "select_final_norm_type", "stats", "uninstall"]

NAME = "chatgrammar"
log = logging.getLogger(__name__)

#: Log the first few malformed samples one by one, then only at these counts (10, 100, …).
_LOG_FIRST = 5


# ------------------------------------------------------------------------------------------
# Tokenizers without decode()
# ------------------------------------------------------------------------------------------

class _IdsOnly:
    """A view of a tokenizer that has ``convert_tokens_to_ids`` but no ``decode``.

    Every marker string of the registry's formats that converts to one real id (not the unk
    id) counts as a special token. ``decode`` is not available: formats whose ids are read
    without decoding (Kimi-K2: the role comes from its marker) work; the others are not
    detected (:func:`needs_decoding`).
    """

    def __init__(self, tokenizer: Any, strings: list[str]):
        self.tokenizer = tokenizer
        unk = getattr(tokenizer, "unk_token_id", None)
        self._added: dict[str, int] = {}
        for s in strings:
            try:
                i = tokenizer.convert_tokens_to_ids(s)
            except Exception:  # noqa: BLE001 - a tokenizer may raise on unknown strings
                continue
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i != unk:
                self._added[s] = i
        self.all_special_ids = sorted(set(self._added.values()))

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._added.get(token)

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self._added)

    def decode(self, ids: Any, **kwargs: Any) -> str:
        raise NotImplementedError(f"{type(self.tokenizer).__name__} has no decode()")


def needs_decoding(fmt: cg.Format, tokenizer: Any = None) -> bool:
    """Whether parsing ``fmt`` in id mode must decode ordinary ids to text.

    True when a header is read as text (a role name, XTML attributes, a pattern, a text
    terminator), a role is not given by a marker, an element has a lead text or a tag, turns
    are separated by text, or a soft marker (``special: false``) is not one id of
    ``tokenizer`` (it is then found in the decoded text).

    Args:
        fmt: a :class:`chatgrammar.Format`.
        tokenizer: the tokenizer the soft markers are looked up in (None: soft markers count
            as needing text).

    Returns:
        bool.

    Example:
        >>> needs_decoding(cg.load_format("kimi-k3"))
        True
    """
    spec = fmt.spec
    # whitespace between turns (Kimi-K2's current template: "\n" after its default system turn)
    # needs no decoding where a sample has none; where one has, decode() is called, fails, and
    # that sample is counted and trains nothing (never a wrong mask)
    if (spec.between and spec.between not in (r"\s*", r"\s+", r"\n*", r"\n")) or any(el.lead or el.tag or el.kind_by_tag or el.kind_by_attr
                           for el in spec.elements.values()):
        return True
    for name, el in spec.elements.items():
        for h in (el.header, el.close.header if el.close else None):
            if h is not None and (h.until_text or h.pattern or h.attributes or h.trained_after):
                return True
        if name in spec.top and el.role is None and set(el.role_by_marker) != set(el.open):
            return True
    soft = [m.text for m in spec.markers.values() if not m.special]
    if soft:
        if tokenizer is None:
            return True
        from chatgrammar.runtime.tokenizers import adapt
        adapter = adapt(tokenizer)
        if any(adapter.token_id(t, special=False) is None for t in soft):
            return True
    return False


def _marker_strings() -> list[str]:
    from chatgrammar.core.detect import detection_formats

    out: dict[str, None] = {}
    for fmt in detection_formats():
        for m in fmt.spec.markers.values():
            out[m.text] = None
    return list(out)


# ------------------------------------------------------------------------------------------
# The recovery
# ------------------------------------------------------------------------------------------

class _Resolved:
    __slots__ = ("fmt", "tokenizer", "why")

    def __init__(self, fmt: cg.Format | None, tokenizer: Any, why: str = ""):
        self.fmt, self.tokenizer, self.why = fmt, tokenizer, why


class ChatGrammarRecovery:
    """The ``detect`` / ``compute`` pair behind :func:`recovery`, with its counters.

    Args:
        format: a format name or spec path to force; None detects one per tokenizer
            (declared precedence). A forced format applies only to tokenizers for which
            detection decides it (it never demands every marker of the spec).
        policy: a :class:`chatgrammar.MaskPolicy`; None uses the format's default.
        strict: raise on malformed samples instead of masking them out.
    """

    def __init__(self, format: str | None = None, policy: cg.MaskPolicy | None = None,
                 strict: bool = False):
        self.format = format
        self.policy = policy
        self.strict = strict
        self._lock = threading.Lock()
        # resolutions by the tokenizer's content (content_key); each object remembers its key
        # and the content_version it was computed at, so one that gains tokens is resolved again
        self._by_content: dict[tuple, _Resolved] = {}
        self._by_tok: "weakref.WeakKeyDictionary[Any, tuple[tuple, tuple]]" = \
            weakref.WeakKeyDictionary()
        self.counts = {"samples": 0, "malformed": 0, "failed": 0, "undetected": 0}

    # -------------------------------------------------------------- resolution (cached)
    def _resolve(self, tokenizer: Any) -> _Resolved:
        """The format for ``tokenizer``, cached by its content (see the cache above)."""
        from chatgrammar.runtime.tokenizers import content_key, content_version

        ver = content_version(tokenizer)
        try:
            seen = self._by_tok.get(tokenizer)
        except TypeError:  # not weak-referenceable / not hashable: by content each call
            seen = None
        if seen is not None and seen[0] == ver and seen[1] in self._by_content:
            return self._by_content[seen[1]]
        as_tok = tokenizer if callable(getattr(tokenizer, "decode", None)) else \
            _IdsOnly(tokenizer, _marker_strings())
        try:
            ckey = content_key(as_tok)
        except TypeError:  # no tokenizer protocol at all: nothing to cache
            return self._resolve_uncached(tokenizer)
        res = self._by_content.get(ckey)
        if res is None:
            res = self._resolve_uncached(tokenizer)
        with self._lock:
            if len(self._by_content) >= 64:
                self._by_content.clear()
            self._by_content[ckey] = res
            try:
                self._by_tok[tokenizer] = (ver, ckey)
            except TypeError:
                pass
        return res

    def _resolve_uncached(self, tokenizer: Any) -> _Resolved:
        tok = tokenizer
        no_decode = not callable(getattr(tokenizer, "decode", None))
        if no_decode:
            if not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
                return _Resolved(None, tokenizer, "the tokenizer has no convert_tokens_to_ids")
            tok = _IdsOnly(tokenizer, _marker_strings())
        try:
            fmt = self._detect(tok)
        except (ChatGrammarError, TypeError) as exc:
            return _Resolved(None, tok, str(exc).splitlines()[0])
        if fmt is None:
            return _Resolved(None, tok, f"detection does not decide {self.format}")
        if no_decode and needs_decoding(fmt, tok):
            return _Resolved(None, tok, f"{fmt.name} reads text, and the tokenizer has no "
                                        "decode()")
        return _Resolved(fmt, tok)

    def _detect(self, tok: Any) -> cg.Format | None:
        from chatgrammar.core.detect import _tokens_evidence, explain_detection
        from chatgrammar.runtime.tokenizers import adapt

        if self.format is None:
            return cg.detect_format(tok)
        forced = cg.load_format(self.format)
        try:
            det = explain_detection(tok)
        except DetectionError:
            det = None
        if det is not None and forced.name in {f for f in det.evidence}:
            # a registry format: it applies where detection (declared precedence) picks it
            return forced if det.format == forced.name else None
        ev = _tokens_evidence(forced, adapt(tok))  # a spec outside the registry: its detector
        return forced if ev is not None and ev["match"] else None

    # -------------------------------------------------------------- Model-Optimizer's API
    def detect(self, tokenizer: Any) -> bool:
        """True when a chatgrammar format applies to ``tokenizer``. Never raises.

        Args:
            tokenizer: any object; False for what chatgrammar cannot use (no protocol, no
                ``decode`` where the format reads text, no format detected).

        Returns:
            bool.
        """
        try:
            return self._resolve(tokenizer).fmt is not None
        except Exception:  # noqa: BLE001 - a registry's detect must never raise
            return False

    def compute(self, tokenizer: Any, input_ids: Any) -> torch.Tensor:
        """The loss mask of ``input_ids``: a ``torch.long`` tensor of the input's shape.

        Args:
            tokenizer: the tokenizer the ids come from.
            input_ids: a list of ints (or of rows), a numpy array, or a torch tensor, 1-D or
                ``(batch, n)`` (e.g. ``(1, n)``).

        Returns:
            ``torch.long``, same shape as ``input_ids`` (on the input tensor's device); 1 where
            the format's policy trains.

        Raises:
            ChatGrammarError: only with ``strict=True`` (a malformed sample, or no format).
        """
        rows, shape, device = _rows(input_ids)
        try:
            res = self._resolve(tokenizer)
        except Exception as exc:  # noqa: BLE001 - a broken tokenizer: no format, no raise
            if self.strict:
                raise
            res = _Resolved(None, tokenizer, f"{type(exc).__name__}: {exc}")
        if res.fmt is None:
            if self.strict:
                raise DetectionError(f"chatgrammar: no format for this tokenizer: {res.why}")
            self._count("undetected", res.why)
            masks = [np.zeros(len(r), np.int64) for r in rows]
        else:
            masks = [self._mask(res, r) for r in rows]
        out = np.concatenate(masks) if masks else np.zeros(0, np.int64)
        t = torch.from_numpy(out.astype(np.int64, copy=False)).reshape(shape)
        return t.to(device) if device is not None else t

    def _mask(self, res: _Resolved, ids: np.ndarray) -> np.ndarray:
        with self._lock:
            self.counts["samples"] += 1
        fmt, tok = res.fmt, res.tokenizer
        try:
            return np.asarray(fmt.loss_mask(ids, tok, policy=self.policy, strict=True))
        except ChatGrammarError as exc:
            if self.strict:
                raise
            self._count("malformed", str(exc).splitlines()[0])
            try:  # lenient: what does not fit trains nothing, the rest trains as usual
                return np.asarray(fmt.loss_mask(ids, tok, policy=self.policy, strict=False))
            except Exception as exc2:  # noqa: BLE001
                self._count("failed", f"{fmt.name}: {type(exc2).__name__}: {exc2}")
        except Exception as exc:  # noqa: BLE001 - never raise out of a data loader
            if self.strict:
                raise
            self._count("failed", f"{fmt.name}: {type(exc).__name__}: {exc}")
        return np.zeros(len(ids), np.int64)

    def _count(self, what: str, why: str) -> None:
        with self._lock:
            self.counts[what] += 1
            n = self.counts[what]
        if n <= _LOG_FIRST or _is_power_of_ten(n):
            log.warning("chatgrammar loss mask: %s sample #%d trains nothing where it does not "
                        "fit (%s)%s", what, n, why,
                        "" if n < _LOG_FIRST else "; further ones are logged at 10, 100, …")


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1 and n != 0


def _rows(input_ids: Any) -> tuple[list[np.ndarray], tuple[int, ...], Any]:
    """Input → (rows of int64 ids, the shape to give the mask, the device or None)."""
    device = None
    if isinstance(input_ids, torch.Tensor):
        device = input_ids.device
        arr = input_ids.detach().to("cpu").numpy()
    else:
        arr = np.asarray(input_ids)
    if arr.dtype == object or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"input_ids must be integer ids, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    shape = arr.shape
    if arr.ndim == 1:
        return [arr], shape, device
    if arr.ndim == 0:
        raise TypeError("input_ids must be a sequence of ids, not a scalar")
    flat = arr.reshape(-1, shape[-1])
    return [np.ascontiguousarray(r) for r in flat], shape, device


def recovery(format: str | None = None, policy: cg.MaskPolicy | None = None,
             strict: bool = False) -> "_loss_mask.LossMaskRecovery":
    """A Model-Optimizer ``LossMaskRecovery`` backed by chatgrammar (not registered).

    Args:
        format: a format name (``"kimi-k3"``) or spec path to force; None detects the format
            per tokenizer with chatgrammar's declared precedence. A forced format answers
            ``detect`` only where detection decides it.
        policy: a :class:`chatgrammar.MaskPolicy`; None uses the format's default.
        strict: raise :class:`chatgrammar.ParseError` on malformed samples (default: mask them
            out, count and log them, never raise).

    Returns:
        ``modelopt.torch.utils.loss_mask.LossMaskRecovery(name="chatgrammar", detect, compute)``;
        ``compute`` returns a ``torch.long`` mask of the input's shape.

    Example:
        >>> rec = recovery()                                   # doctest: +SKIP
        >>> rec.detect(tokenizer) and rec.compute(tokenizer, ids)  # doctest: +SKIP
    """
    impl = ChatGrammarRecovery(format, policy, strict)
    name = NAME if format is None else f"{NAME}:{format}"
    return _loss_mask.LossMaskRecovery(name=name, detect=impl.detect, compute=impl.compute)


def _ours(rec: Any) -> bool:
    return isinstance(getattr(getattr(rec, "detect", None), "__self__", None),
                      ChatGrammarRecovery)


def stats(rec: Any) -> dict[str, int]:
    """Counters of a recovery made by :func:`recovery` / :func:`install`.

    Args:
        rec: the ``LossMaskRecovery``.

    Returns:
        ``{"samples", "malformed", "failed", "undetected"}`` (per process).

    Example:
        >>> stats(install())["malformed"]  # doctest: +SKIP
        0
    """
    if not _ours(rec):
        raise TypeError("not a chatgrammar recovery")
    return dict(rec.detect.__self__.counts)


def install(format: str | None = None, policy: cg.MaskPolicy | None = None,
            strict: bool = False, *, final_norm: bool = True) -> "_loss_mask.LossMaskRecovery":
    """Make Model-Optimizer use chatgrammar: its loss-mask recovery first, its final norms.

    Idempotent: a second call replaces the recovery the first one registered (the registry
    holds one chatgrammar entry) and leaves the final-norm selection installed once.

    Args:
        format, policy, strict: as in :func:`recovery`.
        final_norm: also install :func:`install_final_norm`.

    Returns:
        The registered recovery.

    Example:
        >>> from chatgrammar.integrations import modelopt as cg_modelopt  # doctest: +SKIP
        >>> cg_modelopt.install()                                          # doctest: +SKIP
    """
    rec = recovery(format, policy, strict)
    registry = _loss_mask._RECOVERIES  # Model-Optimizer's list; first match wins
    registry[:] = [rec] + [r for r in registry if not _ours(r)]
    if final_norm:
        install_final_norm()
    return rec


def uninstall() -> None:
    """Undo :func:`install`: remove chatgrammar's recoveries and restore the norm selection."""
    registry = _loss_mask._RECOVERIES
    registry[:] = [r for r in registry if not _ours(r)]
    _uninstall_final_norm()


def install_final_norm() -> None:
    """Make ``FakeBaseModel``'s final-norm selection use ``formats/norms.yaml``.

    ``_select_final_norm_type(model_type, base_cfg)`` resolves the text backbone with
    :func:`chatgrammar.resolve_final_norm` (installed transformers version) and returns a key
    ``"chatgrammar:<kind>@<eps>"`` that ``_FINAL_NORM_CLASSES`` turns into the exact module
    (:func:`chatgrammar.build_final_norm`'s); unknown backbones and norms with a bias (whose
    bias Model-Optimizer does not load) get no norm. Idempotent.
    """
    _install_final_norm()


def select_final_norm_type(model_type: str | None, base_cfg: Any = None) -> str | None:
    """The installed replacement of Model-Optimizer's ``_select_final_norm_type``.

    Args:
        model_type: the backbone's ``model_type``.
        base_cfg: the (text) config, when known.

    Returns:
        A ``_FINAL_NORM_CLASSES`` key, or None (no norm: unknown backbone or a norm with a
        bias).
    """
    return _select(model_type, base_cfg)

# ------------------------------------------------------------------------------------------
# Final norms: FakeBaseModel's _select_final_norm_type / _FINAL_NORM_CLASSES
# ------------------------------------------------------------------------------------------

_KEY_PREFIX = "chatgrammar:"
_installed: dict[str, Any] = {}


def _norm_key(kind: str, eps: float | None) -> str:
    return f"{_KEY_PREFIX}{kind}" + (f"@{eps!r}" if eps is not None else "")


def _select(model_type: str | None, base_cfg: Any = None) -> str | None:
    from chatgrammar.core.norms import explain_final_norm, load_norms

    table = load_norms()
    config = base_cfg if base_cfg is not None else {"model_type": model_type}
    try:
        norm, why = explain_final_norm(config)
        if norm is None and model_type in table.outer_types and \
                table.outer_types[model_type].text_type:
            # only the wrapper's type is known (no text config): its declared backbone
            norm, why = explain_final_norm(
                {"model_type": table.outer_types[model_type].text_type})
    except Exception as exc:  # noqa: BLE001 - selection must not break model loading
        log.warning("chatgrammar final norm: cannot resolve %r: %s", model_type, exc)
        return None
    if norm is None:
        log.warning("chatgrammar final norm: none for %s (%s)", model_type, why)
        return None
    if table.kinds[norm.kind].bias:
        log.warning("chatgrammar final norm: %s has a bias, which FakeBaseModel does not load; "
                    "no norm built (%s)", norm.kind, why)
        return None
    return _norm_key(norm.kind, norm.eps)


class _NormFactory:
    """``_FINAL_NORM_CLASSES[key](hidden_size, eps=…, dtype=…)`` → the exact module."""

    def __init__(self, kind: str, eps: float | None):
        self.kind, self.eps = kind, eps

    def __call__(self, hidden_size: int, eps: float = 1e-6, dtype: Any = torch.bfloat16
                 ) -> torch.nn.Module:
        from chatgrammar.core.norm_torch import FinalNormModule
        from chatgrammar.core.norms import load_norms

        kind = load_norms().kinds[self.kind]
        # the table's eps (read from the backbone's own attribute) wins over FakeBaseConfig's
        # rms_norm_eps, which Nemotron-H's config does not have
        return FinalNormModule(kind, hidden_size, self.eps if self.eps is not None else eps,
                               dtype if isinstance(dtype, torch.dtype) else getattr(
                                   torch, str(dtype).rsplit(".", 1)[-1]))


class _NormClasses(dict):
    """Model-Optimizer's classes, plus every ``chatgrammar:<kind>@<eps>`` key on demand (so a
    saved FakeBaseConfig's ``final_norm_type`` rebuilds in a new process after install())."""

    def __missing__(self, key: str) -> Any:
        if not isinstance(key, str) or not key.startswith(_KEY_PREFIX):
            raise KeyError(key)
        from chatgrammar.core.norms import load_norms

        kind, _, eps = key[len(_KEY_PREFIX):].partition("@")
        if kind not in load_norms().kinds:
            raise KeyError(key)
        factory = _NormFactory(kind, float(eps) if eps else None)
        self[key] = factory
        return factory


def _install_final_norm() -> None:
    from modelopt.torch.speculative.plugins import modeling_fakebase as fakebase
    from modelopt.torch.speculative.plugins import modeling_final_norm as final_norm

    if "select" in _installed:
        return
    from chatgrammar.core.norms import load_norms

    _installed["select"] = final_norm._select_final_norm_type
    _installed["classes"] = final_norm._FINAL_NORM_CLASSES
    _installed["paths"] = list(fakebase._FINAL_NORM_PATHS)
    classes = _NormClasses(final_norm._FINAL_NORM_CLASSES)
    for mod in (final_norm, fakebase):
        mod._select_final_norm_type = select_final_norm_type
        mod._FINAL_NORM_CLASSES = classes
    # where the norm tensor lives in checkpoints whose final norm is not `norm`
    modules = sorted({b.transformers["module"] for b in load_norms().backbones.values()
                      if b.transformers})
    for m in modules:
        for path in (f"model.{m}", f"language_model.model.{m}", f"model.language_model.{m}"):
            if path not in fakebase._FINAL_NORM_PATHS:
                fakebase._FINAL_NORM_PATHS.append(path)


def _uninstall_final_norm() -> None:
    if "select" not in _installed:
        return
    from modelopt.torch.speculative.plugins import modeling_fakebase as fakebase
    from modelopt.torch.speculative.plugins import modeling_final_norm as final_norm

    for mod in (final_norm, fakebase):
        mod._select_final_norm_type = _installed["select"]
        mod._FINAL_NORM_CLASSES = _installed["classes"]
    fakebase._FINAL_NORM_PATHS[:] = _installed["paths"]
    _installed.clear()
