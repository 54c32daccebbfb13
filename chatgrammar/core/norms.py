"""Final-norm table: which norm a model's text backbone applies before the LM head.

Rebuilding teacher logits from un-normed hidden states (drafter training: EAGLE-3, DFlash, …)
needs the exact final norm of the text backbone, including where it casts. ``formats/norms.yaml``
holds that as data:

- ``kinds``: each norm kind with its formula and the parameters that make it numerically exact
  (mean-centred or not, ``w`` or ``1 + w``, bias, multiply-then-cast or cast-then-multiply,
  whether the weight stays in fp32);
- ``backbones``: text-backbone ``model_type`` → kind, the config attribute(s) holding eps, and the
  source of the fact;
- ``overrides``: config flags that win over the type (``use_gemma_norm: true``);
- ``outer_types``: remote-code multimodal wrappers transformers does not know, which must never
  be table keys.

The table is keyed on the **text backbone**, never on an outer VLM wrapper: Kimi-K3's outer
config says ``kimi_k3``, its ``text_config`` says ``kimi_linear``, and the final norm is
``kimi_linear``'s. :func:`resolve_final_norm` walks a config down to that backbone.

Facts that changed across transformers versions say so (``by_version``: a version range per
fact); resolution follows the installed transformers version or the one the caller names.
The file is validated by pydantic models whose errors are located (``file:line:col`` and the
YAML path) through the YAML node tree, as format specs are (:mod:`chatgrammar.core.spec`).

Public names: :class:`FinalNorm`, :func:`resolve_final_norm`, :func:`explain_final_norm`,
:func:`final_norm_kind`, :func:`build_final_norm`, :func:`apply_norm`, :func:`validate_norms`,
:func:`load_norms`, :func:`read_config`, :func:`norms_path`, :class:`NormProblem`,
:class:`NormsTable`, :class:`NormKind`, :class:`Backbone`, :class:`BackboneVersion`,
:func:`version_in_range`, :func:`installed_transformers_version`.

transformers is never imported here except by :func:`validate_norms` (guarded, to recognise
multimodal wrapper types); numpy is only needed by :func:`apply_norm`, torch only by
:func:`build_final_norm`.
"""
from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Mapping, Optional

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictStr, ValidationError,
                      ValidationInfo)

from ..errors import NormError
from .spec import SpecSource, duplicate_keys, format_path, node_marks

#: Where a multimodal config keeps its text backbone, in lookup order.
TEXT_CONFIG_KEYS: tuple[str, ...] = ("text_config", "llm_config", "language_config")

#: The arrow used in :attr:`FinalNorm.path`.
ARROW = " → "

_MAX_DEPTH = 8

_MULTIPLY = ("after_cast", "float32")
_WEIGHT_DTYPES = ("model", "float32")
_OFFSET_DTYPES = ("float32", "weight")
_STATISTICS = ("manual", "fused")
_INV_SQRT = ("rsqrt", "pow")


# --------------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FinalNorm:
    """The final norm of a config's text backbone.

    Attributes:
        kind: a kind name from ``norms.yaml`` (``"rmsnorm"``, ``"rmsnorm_one_plus"``, …).
        model_type: the text backbone's ``model_type`` (the table key that matched, or the
            backbone's type when a flag override decided the kind).
        eps: the epsilon read from the text config (or the table's documented default when the
            config omits it); ``None`` if neither exists.
        path: how the resolution got there, e.g. ``"kimi_k3 → text_config → kimi_linear"``.
    """

    kind: str
    model_type: str
    eps: float | None
    path: str


@dataclass(frozen=True)
class NormKind:
    """One norm kind: its formula and the parameters :func:`apply_norm` implements.

    Attributes:
        name: the kind's key in ``norms.yaml``.
        formula: the formula, for humans.
        center: subtract the mean first (LayerNorm) instead of pure RMS scaling.
        offset: the weight is used as ``offset + w`` (1 for Gemma-style norms, else 0).
        bias: a bias is added after scaling.
        multiply: ``"after_cast"`` — the normalised activations are cast to the input dtype,
            then multiplied by the weight (Llama); ``"float32"`` — the scaling (and bias) happen
            in fp32 and the result is cast once (Gemma, gpt-oss, LayerNorm).
        weight_dtype: ``"model"`` — the weight lives in the model dtype; ``"float32"`` — it is
            kept in fp32 whatever the model dtype (gpt-oss's ``_keep_in_fp32_modules``).
        description: free text.
        offset_dtype: where ``offset + w`` is formed for a ``float32`` multiply: ``"float32"``
            — ``1 + w.float()`` (Gemma); ``"weight"`` — ``w + 1`` in the weight's own dtype,
            rounded to it before the fp32 multiply (Nemotron's ``LayerNorm1P``). Irrelevant when
            ``offset`` is 0; an ``after_cast`` kind always forms it in the weight's dtype.
        statistics: ``"manual"`` — mean / variance and the scaling are explicit torch ops
            (every RMSNorm, Cohere's LayerNorm); ``"fused"`` — one
            ``torch.nn.functional.layer_norm`` call (``nn.LayerNorm``, Nemotron's LayerNorm1P).
            Same maths, different fp32 rounding: it matters only for bit-exact modules
            (:func:`chatgrammar.build_final_norm`).
    """

    name: str
    formula: str
    center: bool
    offset: float
    bias: bool
    multiply: str
    weight_dtype: str
    description: str = ""
    offset_dtype: str = "float32"
    statistics: str = "manual"


@dataclass(frozen=True)
class Backbone:
    """A text backbone's entry in the table.

    Attributes:
        model_type: the table key.
        kind: its norm kind.
        eps: the config attribute(s) holding eps, in lookup order.
        eps_default: eps when the config omits the attribute (the config class default).
        source: where the fact comes from.
        transformers: ``{"model_type", "module", "class"}`` naming the transformers module that
            implements this backbone's final norm (used by the numeric-truth tests), or None.
        note: free text.
        inv_sqrt: ``"rsqrt"`` (``torch.rsqrt``, the default) or ``"pow"``
            (``torch.pow(·, -0.5)``, Gemma 4): which op the module uses for 1/sqrt, which only
            a bit-exact module must know.
        by_version: facts that differ in some transformers versions (:class:`BackboneVersion`);
            the entry's own facts hold for every version none of them matches. Use
            :meth:`at` for the facts of one version.
    """

    model_type: str
    kind: str
    eps: tuple[str, ...]
    eps_default: float | None
    source: str
    transformers: Mapping[str, str] | None = None
    note: str = ""
    inv_sqrt: str = "rsqrt"
    by_version: tuple["BackboneVersion", ...] = ()

    def at(self, transformers_version: str | None) -> "Backbone":
        """The entry as it holds for one transformers version.

        Args:
            transformers_version: e.g. ``"5.14.1"``; None means the entry's own facts (the
                versions no :attr:`by_version` item matches).

        Returns:
            A :class:`Backbone` without ``by_version``: the first matching item's facts over
            the entry's.

        Example:
            >>> load_norms().backbones["nemotron_h"].at("5.14.1").kind
            'rmsnorm'
        """
        if not self.by_version:
            return self
        for v in self.by_version if transformers_version is not None else ():
            if version_in_range(transformers_version, v.transformers):
                facts = {k: getattr(v, k) for k in ("kind", "eps", "eps_default", "inv_sqrt")
                         if getattr(v, k) is not None}
                return replace(self, **facts, source=v.source, note=v.note or self.note,
                               by_version=())
        return replace(self, by_version=())


@dataclass(frozen=True)
class BackboneVersion:
    """Facts of a backbone that hold for a range of transformers versions only.

    Attributes:
        transformers: the version range, e.g. ``"<5.18"`` or ``">=5.15,<5.24"`` (comparisons
            ``< <= > >= == !=`` joined by commas).
        kind, eps, eps_default, inv_sqrt: the facts that differ there (None: as the entry).
        source: where the fact comes from (the transformers version's module).
        note: free text.
    """

    transformers: str
    source: str
    kind: str | None = None
    eps: tuple[str, ...] | None = None
    eps_default: float | None = None
    inv_sqrt: str | None = None
    note: str = ""


_RANGE_ITEM = re.compile(r"\s*(<=|>=|==|!=|<|>)\s*(\d+(?:\.\d+)*)\s*")


def parse_version_range(text: str) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """``">=5.15,<5.24"`` → ``((">=", (5, 15)), ("<", (5, 24)))``; None if it is not one."""
    items = []
    for part in text.split(","):
        m = _RANGE_ITEM.fullmatch(part)
        if m is None:
            return None
        items.append((m.group(1), tuple(int(x) for x in m.group(2).split("."))))
    return tuple(items)


def _version_tuple(version: str) -> tuple[int, ...]:
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if m is None:
        raise NormError(f"not a version: {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def version_in_range(version: str, text: str) -> bool:
    """Whether a transformers version (``"5.14.1"``, ``"5.25.0.dev0"``) is in a range.

    Example:
        >>> version_in_range("5.14.1", "<5.18"), version_in_range("5.18.0", "<5.18")
        (True, False)
    """
    items = parse_version_range(text)
    if items is None:
        raise NormError(f"not a version range: {text!r}")
    v = _version_tuple(version)
    for op, bound in items:
        n = max(len(v), len(bound))
        a, b = v + (0,) * (n - len(v)), bound + (0,) * (n - len(bound))
        ok = {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b,
              "!=": a != b}[op]
        if not ok:
            return False
    return True


@functools.lru_cache(maxsize=1)
def installed_transformers_version() -> str | None:
    """The installed transformers' version (read from its metadata: transformers is not
    imported), or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class FlagOverride:
    """A config flag that decides the kind whatever the ``model_type`` says."""

    flag: str
    when: Any
    kind: str
    source: str
    note: str = ""


@dataclass(frozen=True)
class OuterType:
    """A multimodal wrapper type (never a table key) and where its text backbone lives."""

    model_type: str
    text_key: str
    text_type: str | None
    source: str
    note: str = ""


@dataclass(frozen=True)
class NormsTable:
    """A loaded, validated ``norms.yaml``."""

    file: str
    kinds: Mapping[str, NormKind]
    backbones: Mapping[str, Backbone]
    overrides: tuple[FlagOverride, ...] = ()
    outer_types: Mapping[str, OuterType] = field(default_factory=dict)
    eps_attributes: tuple[str, ...] = ()


@dataclass(frozen=True)
class NormProblem:
    """One problem found in a norms file.

    Attributes:
        message: what is wrong.
        file: the norms file.
        line, col: 1-based position of the offending YAML node, when known.
        path: the YAML path (``backbones.gemma3.kind``), when known.
    """

    message: str
    file: str
    line: int | None = None
    col: int | None = None
    path: str | None = None

    def render(self) -> str:
        """``file:line:col: path: message``."""
        where = self.file
        if self.line is not None:
            where += f":{self.line}:{self.col or 1}"
        if self.path:
            where += f": {self.path}"
        return f"{where}: {self.message}"

    __str__ = render


# --------------------------------------------------------------------------------------------
# Locating and loading norms.yaml
# --------------------------------------------------------------------------------------------

def norms_path() -> Path:
    """The bundled ``norms.yaml``.

    It sits with the bundled format specs (:func:`chatgrammar.core.registry.formats_dir`).

    Returns:
        The path of the bundled file.

    Example:
        >>> norms_path().name
        'norms.yaml'
    """
    from .registry import formats_dir  # one rule for where bundled data lives

    return formats_dir() / "norms.yaml"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NormError(f"{path}: no such norms file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NormError(f"{path}: cannot read norms file: {exc}") from None


def _compose(text: str, file: str) -> tuple[Any, Any]:
    """Parse YAML safely; return (node tree, plain data)."""
    loader = yaml.SafeLoader(text)
    loader.name = file
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except RecursionError:  # PyYAML composes recursively: a deeply nested file is invalid
        raise yaml.YAMLError("YAML nested too deeply") from None
    finally:
        loader.dispose()
    return node, data


def validate_norms(path: str | os.PathLike[str] | None = None, *,
                   use_transformers: bool = True) -> list[NormProblem]:
    """Check a norms file and return every problem found (an empty list means valid).

    Checks: YAML syntax (safe loader), unknown or duplicate keys at every level, required keys,
    value types, kinds referenced by backbones and overrides exist, and **no outer multimodal
    type is a table key** — whether it is one of the file's ``outer_types`` or a type that
    transformers (if importable) declares with a text sub-config.

    Args:
        path: the norms file; ``None`` checks the bundled one.
        use_transformers: consult ``transformers.CONFIG_MAPPING`` to recognise wrapper types
            (skipped silently when transformers is not installed).

    Returns:
        A list of :class:`NormProblem`, each with ``file``, ``line``, ``col`` and YAML ``path``
        where known, in file order.

    Example:
        >>> validate_norms()
        []
    """
    p = Path(path) if path is not None else norms_path()
    file = str(p)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return [NormProblem("no such norms file", file)]
    except (OSError, UnicodeDecodeError) as exc:
        return [NormProblem(f"cannot read norms file: {exc}", file)]
    problems, _ = _check(text, file, use_transformers=use_transformers)
    return problems


def load_norms(path: str | os.PathLike[str] | None = None) -> NormsTable:
    """Load and validate a norms file.

    The bundled table is cached; explicit paths are read each time. The transformers check of
    :func:`validate_norms` is not run here (loading must stay cheap); run ``validate`` for it.

    Args:
        path: a norms YAML file; ``None`` for the bundled ``formats/norms.yaml``.

    Returns:
        The :class:`NormsTable`.

    Raises:
        NormError: the file cannot be read or is invalid (the message lists every problem).

    Example:
        >>> load_norms().backbones["kimi_linear"].kind
        'rmsnorm'
    """
    if path is None:
        return _load_bundled()
    return _load(Path(path))


@functools.lru_cache(maxsize=1)
def _load_bundled() -> NormsTable:
    return _load(norms_path())


def _load(p: Path) -> NormsTable:
    file = str(p)
    problems, table = _check(_read_text(p), file, use_transformers=False)
    if problems or table is None:
        listing = "\n".join("  " + pr.render() for pr in problems)
        raise NormError(f"{file}: invalid norms table ({len(problems)} problem"
                        f"{'s' if len(problems) != 1 else ''}):\n{listing}")
    return table


# --------------------------------------------------------------------------------------------
# Validation: pydantic models over the YAML data, errors located through the YAML node tree
# (the same scheme as format specs, chatgrammar.core.spec)
# --------------------------------------------------------------------------------------------

def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""



def _transformers_wrappers() -> Callable[[str], tuple[str, str | None] | None] | None:
    """A lookup: type → (text sub-config key, its model_type or None) when transformers declares
    that type with a text sub-config, else None. None itself when transformers is missing."""
    try:
        from transformers import CONFIG_MAPPING  # optional, and slow to import
    except Exception:  # pragma: no cover - depends on the environment
        return None

    def lookup(model_type: str) -> tuple[str, str | None] | None:
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:
            return None
        subs = getattr(cls, "sub_configs", None) or {}
        for text_key in TEXT_CONFIG_KEYS:
            if text_key in subs:
                inner = getattr(subs[text_key], "model_type", None)
                return text_key, inner if isinstance(inner, str) and inner else None
        return None

    return lookup



def _what(v: Any) -> str:
    return f"{type(v).__name__} {v!r}"


def _text(v: Any, info: ValidationInfo) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{info.field_name} must be a str, got {_what(v)}")
    if not v.strip():
        raise ValueError(f"{info.field_name} must not be empty")
    return v


def _free_text(v: Any, info: ValidationInfo) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{info.field_name} must be a str, got {_what(v)}")
    return v


def _flag(v: Any, info: ValidationInfo) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{info.field_name} must be a bool, got {_what(v)}")
    return v


def _choice(*allowed: str) -> Any:
    def check(v: Any, info: ValidationInfo) -> str:
        if v not in allowed or not isinstance(v, str):
            raise ValueError(f"{info.field_name} must be one of {', '.join(allowed)}; got {v!r}")
        return v
    return Annotated[str, BeforeValidator(check)]


def _offset(v: Any, info: ValidationInfo) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v not in (0, 1):
        raise ValueError(f"offset must be 0 or 1; got {v!r}")
    return float(v)


def _positive(v: Any, info: ValidationInfo) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{info.field_name} must be a number, got {_what(v)}")
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{info.field_name} must be a positive number; got {v!r}")
    return float(v)


def _names(v: Any, info: ValidationInfo) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(
            isinstance(s, str) and s.strip() for s in items):
        raise ValueError(f"{info.field_name} must be a string or a non-empty list of strings")
    return tuple(items)


def _scalar_value(v: Any, info: ValidationInfo) -> Any:
    if v is None or isinstance(v, (dict, list)):
        raise ValueError("when must be a scalar (the flag value that triggers the override)")
    return v


def _version(v: Any, info: ValidationInfo) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"version must be an int, got {_what(v)}")
    if v != 1:
        raise ValueError(f"unsupported version {v} (this chatgrammar reads version 1)")
    return v


def _range(v: Any, info: ValidationInfo) -> str:
    if not isinstance(v, str) or parse_version_range(v) is None:
        raise ValueError(f"{info.field_name} must be a transformers version range such as "
                         f"'<5.18' or '>=5.15,<5.24'; got {v!r}")
    return v


_Text = Annotated[str, BeforeValidator(_text)]
_FreeText = Annotated[str, BeforeValidator(_free_text)]
_Flag = Annotated[bool, BeforeValidator(_flag)]
_Names = Annotated[tuple[str, ...], BeforeValidator(_names)]
_Positive = Annotated[float, BeforeValidator(_positive)]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _KindSchema(_Schema):
    formula: _Text
    description: _FreeText = ""
    center: _Flag
    offset: Annotated[float, BeforeValidator(_offset)]
    bias: _Flag
    multiply: _choice(*_MULTIPLY)
    weight_dtype: _choice(*_WEIGHT_DTYPES)
    offset_dtype: _choice(*_OFFSET_DTYPES) = "float32"
    statistics: _choice(*_STATISTICS) = "manual"


class _TransformersSchema(_Schema):
    model_type: Optional[_Text] = None
    module: _Text
    class_: _Text = Field(alias="class")


class _VersionSchema(_Schema):
    transformers: Annotated[str, BeforeValidator(_range)]
    kind: Optional[_Text] = None
    eps: Optional[_Names] = None
    eps_default: Optional[_Positive] = None
    inv_sqrt: Optional[_choice(*_INV_SQRT)] = None
    source: _Text
    note: _FreeText = ""


class _BackboneSchema(_Schema):
    kind: _Text
    eps: _Names
    eps_default: Optional[_Positive] = None
    source: _Text
    transformers: Optional[_TransformersSchema] = None
    inv_sqrt: _choice(*_INV_SQRT) = "rsqrt"
    by_version: list[_VersionSchema] = Field(default_factory=list)
    note: _FreeText = ""


class _OverrideSchema(_Schema):
    when: Annotated[Any, BeforeValidator(_scalar_value)]
    kind: _Text
    source: _Text
    note: _FreeText = ""


class _OuterSchema(_Schema):
    text_key: _choice(*TEXT_CONFIG_KEYS)
    text_type: Optional[_Text] = None
    source: _Text
    note: _FreeText = ""


class _NormsSchema(_Schema):
    version: Annotated[int, BeforeValidator(_version)]
    eps_attributes: _Names = ()
    kinds: dict[StrictStr, _KindSchema]
    overrides: dict[StrictStr, _OverrideSchema] = Field(default_factory=dict)
    outer_types: dict[StrictStr, _OuterSchema] = Field(default_factory=dict)
    backbones: dict[StrictStr, _BackboneSchema]


def _schema_at(loc: tuple) -> tuple[type[BaseModel] | None, str]:
    """The model validating the mapping at ``loc``, and how to name it in a message."""
    if not loc:
        return _NormsSchema, "the norms file"
    top = {"kinds": (_KindSchema, "kind"), "backbones": (_BackboneSchema, "backbone"),
           "overrides": (_OverrideSchema, "override"), "outer_types": (_OuterSchema,
                                                                       "outer type")}
    if len(loc) == 1:
        return None, str(loc[0])
    model, noun = top.get(loc[0], (None, str(loc[0])))
    if len(loc) == 2:
        return model, f"{noun} {loc[1]!r}"
    if loc[0] == "backbones" and loc[2] == "transformers" and len(loc) == 3:
        return _TransformersSchema, "transformers"
    if loc[0] == "backbones" and loc[2] == "by_version" and len(loc) == 4:
        return _VersionSchema, f"by_version[{loc[3]}] of backbone {loc[1]!r}"
    return None, format_path(loc)


def _allowed(model: type[BaseModel]) -> list[str]:
    return sorted(f.alias or name for name, f in model.model_fields.items())


def _required(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items() if f.is_required()]


class _Locator:
    """file + YAML positions → :class:`NormProblem`."""

    def __init__(self, file: str, marks: dict):
        self.src = SpecSource(file, marks)
        self.problems: list[NormProblem] = []

    def add(self, message: str, loc: tuple = (), key: bool = False) -> None:
        _, line, col = self.src.where(tuple(loc), key=key)
        self.problems.append(NormProblem(message, self.src.file, line, col,
                                         format_path(tuple(loc)) or None))


def _schema_problem(err: dict, at: _Locator) -> None:
    """One pydantic error → a located problem, in norms terms."""
    loc = tuple(x for x in err["loc"] if x != "[key]")
    kind = err["type"]
    if kind == "extra_forbidden":
        model, what = _schema_at(loc[:-1])
        allowed = _allowed(model) if model else []
        at.add(f"unknown key {loc[-1]!r} in {what}{_did_you_mean(str(loc[-1]), allowed)}; "
               f"allowed: {', '.join(allowed)}", loc, key=True)
    elif kind == "missing":
        _, what = _schema_at(loc[:-1])
        at.add(f"{what} is missing required key {loc[-1]!r}", loc[:-1], key=True)
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        _, what = _schema_at(loc)
        at.add(f"{what} must be a mapping", loc)
    elif "[key]" in err["loc"]:
        _, what = _schema_at(loc[:-1])
        at.add(f"keys of {what} must be strings", loc, key=True)
    elif kind == "value_error":
        at.add(err["msg"].removeprefix("Value error, "), loc)
    else:
        at.add(f"{format_path(loc)}: {err['msg']}", loc)


def _duplicates(root: Any, at: _Locator) -> None:
    """PyYAML keeps the last of two equal keys silently: report every duplicate."""
    for path, key, first, mark in duplicate_keys(root):
        at.problems.append(NormProblem(
            f"duplicate key {key!r} (first defined on line {first.line + 1})", at.src.file,
            mark.line + 1, mark.column + 1, format_path(path)))


def _cross_checks(data: dict, at: _Locator, use_transformers: bool) -> None:
    """What one model cannot see: kinds referenced elsewhere, outer types used as keys."""
    section = {k: data.get(k) if isinstance(data.get(k), dict) else {}
               for k in ("kinds", "backbones", "overrides", "outer_types")}
    known = {k for k in section["kinds"] if isinstance(k, str)}

    def check_kind(value: Any, loc: tuple) -> None:
        if isinstance(value, str) and value.strip() and value not in known:
            at.add(f"unknown kind {value!r}{_did_you_mean(value, known)}; known kinds: "
                   + (", ".join(sorted(known)) or "(none)"), loc)

    wrappers = _transformers_wrappers() if use_transformers else None
    for name, entry in section["backbones"].items():
        loc = ("backbones", name)
        outer = section["outer_types"].get(name)
        if isinstance(outer, dict):
            text_key, text_type = outer.get("text_key"), outer.get("text_type")
            inner = f" (its text backbone is under {text_key}" + (
                f": {text_type})" if text_type else ")")
            at.add(f"{name!r} is an outer multimodal model_type, listed in outer_types{inner}; "
                   "key the table on the text backbone", loc, key=True)
        elif wrappers is not None and wrappers(name) is not None:
            text_key, inner_type = wrappers(name)
            hint = f"; key it on {inner_type!r}" if inner_type else \
                "; key the table on the text backbone"
            at.add(f"{name!r} is an outer multimodal model_type: transformers declares its "
                   f"text backbone under {text_key}{hint}", loc, key=True)
        if isinstance(entry, dict):
            check_kind(entry.get("kind"), loc + ("kind",))
            versions = entry.get("by_version")
            for i, item in enumerate(versions if isinstance(versions, list) else []):
                if isinstance(item, dict):
                    check_kind(item.get("kind"), loc + ("by_version", i, "kind"))
    for flag, entry in section["overrides"].items():
        if isinstance(entry, dict):
            check_kind(entry.get("kind"), ("overrides", flag, "kind"))


def _table(file: str, s: _NormsSchema) -> NormsTable:
    kinds = {name: NormKind(name=name, **k.model_dump()) for name, k in s.kinds.items()}
    backbones = {}
    for name, b in s.backbones.items():
        tf = b.transformers.model_dump(by_alias=True, exclude_none=True) if b.transformers \
            else None
        versions = tuple(BackboneVersion(**v.model_dump()) for v in b.by_version)
        backbones[name] = Backbone(name, b.kind, b.eps, b.eps_default, b.source, tf, b.note,
                                   inv_sqrt=b.inv_sqrt, by_version=versions)
    overrides = tuple(FlagOverride(flag, o.when, o.kind, o.source, o.note)
                      for flag, o in s.overrides.items())
    outer = {name: OuterType(name, o.text_key, o.text_type, o.source, o.note)
             for name, o in s.outer_types.items()}
    return NormsTable(file, kinds, backbones, overrides, outer, s.eps_attributes)


def _check(text: str, file: str, *, use_transformers: bool) -> tuple[list[NormProblem],
                                                                    NormsTable | None]:
    """Every problem of a norms file (YAML, schema, cross-references), or its table."""
    try:
        root, data = _compose(text, file)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        msg = "invalid YAML: " + " ".join(
            str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x
        ) if mark else f"invalid YAML: {exc}"
        return [NormProblem(msg.strip(), file, mark.line + 1 if mark else None,
                            mark.column + 1 if mark else None)], None
    if root is None:
        return [NormProblem("the norms file is empty", file)], None
    at = _Locator(file, node_marks(root))
    if not isinstance(data, dict):
        at.add("the norms file must be a mapping")
        return at.problems, None
    _duplicates(root, at)
    schema = None
    try:
        schema = _NormsSchema.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            _schema_problem(err, at)
    _cross_checks(data, at, use_transformers)
    problems = sorted(at.problems, key=lambda p: (p.line or 0, p.col or 0))
    if problems or schema is None:
        return problems, None
    return [], _table(file, schema)


# --------------------------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------------------------

def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``config.json`` (or the ``config.json`` inside a model directory).

    Args:
        path: a JSON file, or a directory containing ``config.json``.

    Returns:
        The decoded JSON object.

    Raises:
        NormError: the file is missing, unreadable, not JSON, or not a JSON object.

    Example:
        >>> read_config("model/config.json")["model_type"]  # doctest: +SKIP
        'kimi_k3'
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NormError(f"no such config file: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NormError(f"cannot read config {p}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NormError(f"{p}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise NormError(f"{p}: a config must be a JSON object, got {type(data).__name__}")
    return data


def _get(node: Any, key: str) -> Any:
    if isinstance(node, Mapping):
        return node.get(key)
    try:
        return getattr(node, key, None)
    except Exception:  # config objects may raise on ambiguous attributes; treat as absent
        return None


def _is_config(value: Any) -> bool:
    if value is None or isinstance(value, (str, bytes, int, float, bool, list, tuple)):
        return False
    return isinstance(value, Mapping) or hasattr(value, "model_type")


def _text_sub_config(node: Any) -> tuple[Any, str] | None:
    for key in TEXT_CONFIG_KEYS:
        sub = _get(node, key)
        if _is_config(sub) and sub is not node:
            return sub, key
    if not isinstance(node, Mapping):
        get_text = getattr(node, "get_text_config", None)
        if callable(get_text):
            try:
                sub = get_text()
            except Exception:
                sub = None
            if _is_config(sub) and sub is not node:
                return sub, "get_text_config()"
    return None


def _as_config(config: Any) -> Any:
    if isinstance(config, (str, os.PathLike)):
        return read_config(config)
    if isinstance(config, Mapping) or hasattr(config, "model_type") or hasattr(
            config, "get_text_config"):
        return config
    raise NormError(f"cannot resolve a final norm from a {type(config).__name__}: pass a "
                    "config dict, a path to config.json, or a transformers config")


def _eps_of(node: Any, names: Iterable[str]) -> tuple[float | None, str | None]:
    for name in names:
        value = _get(node, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), name
    return None, None


def explain_final_norm(config: Any, *, table: NormsTable | None = None,
                       transformers_version: str | None = None
                       ) -> tuple[FinalNorm | None, str]:
    """Resolve a config's final norm and say why.

    Resolution: starting from the outer config, descend into ``text_config``, ``llm_config``
    or ``language_config`` (or, for config objects, ``get_text_config()``) as long as there is
    one; the innermost ``model_type`` is the text backbone. A flag override (``use_gemma_norm:
    true``) on the backbone config or any enclosing config decides the kind whatever the type
    says, because some wrappers coerce their text config's ``model_type`` (e.g. to
    ``mixtral``). Otherwise the backbone's ``model_type`` is looked up in the table, with the
    facts of the transformers version in use (:meth:`Backbone.at`). eps is read from the
    backbone config's declared attribute(s), else the table's ``eps_default``.

    Args:
        config: a config dict, a path to ``config.json`` (or a model directory), or a
            transformers config object.
        table: a :class:`NormsTable` to use instead of the bundled one.
        transformers_version: the transformers version whose facts apply (``"5.14.1"``);
            None: the installed one (:func:`installed_transformers_version`), or the entries'
            own facts when transformers is not installed.

    Returns:
        ``(FinalNorm, reason)`` when resolved, ``(None, reason)`` when the backbone is unknown.
        The reason is one line, ``"<resolution path>: <why>"``, so it names the path even when
        there is no FinalNorm.

    Raises:
        NormError: the config file cannot be read, or the argument is not a config.

    Example:
        >>> cfg = {"model_type": "kimi_k3",
        ...        "text_config": {"model_type": "kimi_linear", "rms_norm_eps": 1e-5}}
        >>> norm, why = explain_final_norm(cfg)
        >>> norm.path
        'kimi_k3 → text_config → kimi_linear'
        >>> explain_final_norm({"model_type": "kimi_k3"})[1]  # doctest: +ELLIPSIS
        'kimi_k3: kimi_k3 is an outer multimodal model_type ...'
    """
    norm, path, why = trace_final_norm(config, table or load_norms(), transformers_version)
    return norm, f"{path}: {why}"


def _walk(config: Any) -> tuple[list[Any], list[str], str | None]:
    """(configs from the outer one down to the backbone, path steps, problem or None)."""
    node = _as_config(config)
    chain = [node]
    steps: list[str] = []
    seen = {id(node)}
    while True:
        mt = _get(node, "model_type")
        steps.append(mt if isinstance(mt, str) and mt else "<no model_type>")
        sub = _text_sub_config(node)
        if sub is None:
            return chain, steps, None
        node, via = sub
        if id(node) in seen or len(chain) >= _MAX_DEPTH:
            return chain, steps, "text sub-configs nest in a cycle or too deep"
        seen.add(id(node))
        chain.append(node)
        steps.append(via)


def _entry(table: NormsTable, model_type: str | None, version: str | None
           ) -> tuple[Backbone | None, str]:
    """The backbone entry at a transformers version, and a note when a range decided."""
    entry = table.backbones.get(model_type) if model_type else None
    if entry is None or not entry.by_version:
        return entry, ""
    version = version if version is not None else installed_transformers_version()
    at = entry.at(version)
    if at.source != entry.source:
        item = next(v for v in entry.by_version if version_in_range(version, v.transformers))
        return at, f" (transformers {version}: the fact for {item.transformers})"
    return at, ""


def trace_final_norm(config: Any, table: NormsTable, transformers_version: str | None = None
                     ) -> tuple[FinalNorm | None, str, str]:
    """:func:`explain_final_norm` with the resolution path also when nothing resolves.

    Args:
        config: as for :func:`resolve_final_norm`.
        table: the norms table.
        transformers_version: the version whose facts apply (None: the installed one).

    Returns:
        ``(FinalNorm or None, the path walked ("kimi_k3 → text_config → kimi_linear"), why)``.

    Example:
        >>> trace_final_norm({"model_type": "llama"}, load_norms())[1]
        'llama'
    """
    chain, steps, problem = _walk(config)
    if problem:
        return None, ARROW.join(steps), problem
    node = chain[-1]
    model_type = _get(node, "model_type")
    model_type = model_type if isinstance(model_type, str) and model_type else None
    entry, when = _entry(table, model_type, transformers_version)

    # a flag override on the backbone or any enclosing config (innermost first)
    for override in table.overrides:
        for level in reversed(chain):
            value = _get(level, override.flag)
            if value is not None and value == override.when and type(value) is type(
                    override.when):
                names = entry.eps if entry else table.eps_attributes
                eps, eps_name = _eps_of(node, names)
                if eps is None and entry is not None:
                    eps = entry.eps_default
                flag_step = f"{override.flag}={json.dumps(override.when)}"
                mt_name = model_type or "<no model_type>"
                return (FinalNorm(override.kind, mt_name, eps, ARROW.join([*steps, flag_step])),
                        ARROW.join([*steps, flag_step]),
                        f"the flag {flag_step} overrides the model_type ({mt_name}) → kind "
                        f"{override.kind}; {_eps_reason(eps, eps_name, entry)}")

    path = ARROW.join(steps)
    if model_type is None:
        where = "text backbone config" if len(chain) > 1 else "config"
        return None, path, f"the {where} has no model_type"
    if entry is not None:
        eps, eps_name = _eps_of(node, entry.eps)
        if eps is None:
            eps = entry.eps_default
        return (FinalNorm(entry.kind, model_type, eps, path), path,
                f"{model_type} is a text backbone in norms.yaml → kind {entry.kind}{when}; "
                f"{_eps_reason(eps, eps_name, entry)}")
    if model_type in table.outer_types:
        o = table.outer_types[model_type]
        return None, path, (f"{model_type} is an outer multimodal model_type whose final norm "
                            f"belongs to its text backbone under {o.text_key}, but this config "
                            f"has no {o.text_key}")
    return None, path, (f"model_type {model_type!r} is not a text backbone in norms.yaml"
                        f"{_did_you_mean(model_type, table.backbones)}; refusing to guess its "
                        "final norm")


def _eps_reason(eps: float | None, name: str | None, entry: Backbone | None = None) -> str:
    if name is not None:
        return f"eps {eps:g} from {name}"
    if eps is not None:
        attrs = "/".join(entry.eps) if entry else "eps"
        return f"eps {eps:g} is the default (the config has no {attrs})"
    return "eps unknown (the config has no eps attribute and the table no default)"


def resolve_final_norm(config: Any, *, table: NormsTable | None = None,
                       transformers_version: str | None = None) -> FinalNorm | None:
    """The final norm of a config's text backbone, or None when it is unknown.

    Same resolution as :func:`explain_final_norm`, without the reason (call that to learn why
    a config resolved to None).

    Args:
        config: a config dict, a path to ``config.json`` (or a model directory), or a
            transformers config object.
        table: a :class:`NormsTable` to use instead of the bundled one.
        transformers_version: whose facts apply (default: the installed transformers').

    Returns:
        A :class:`FinalNorm` (``kind``, ``model_type``, ``eps``, ``path``) or None.

    Raises:
        NormError: the config file cannot be read, or the argument is not a config.

    Example:
        >>> resolve_final_norm({"model_type": "kimi_k3",
        ...                     "text_config": {"model_type": "kimi_linear"}}).kind
        'rmsnorm'
        >>> resolve_final_norm({"model_type": "nemotron_h"}, transformers_version="5.14.1").kind
        'rmsnorm'
    """
    return explain_final_norm(config, table=table, transformers_version=transformers_version)[0]


def final_norm_kind(model_type: str, *, table: NormsTable | None = None,
                    transformers_version: str | None = None) -> str | None:
    """The bare table lookup: a text-backbone ``model_type`` → its norm kind.

    No resolution happens: an outer wrapper type (``kimi_k3``, ``gemma3``) is not a key and
    answers None.

    Args:
        model_type: a text-backbone ``model_type``.
        table: a :class:`NormsTable` to use instead of the bundled one.
        transformers_version: whose facts apply (default: the installed transformers').

    Returns:
        The kind name, or None if the type is not in the table.

    Example:
        >>> final_norm_kind("gemma3_text")
        'rmsnorm_one_plus'
        >>> final_norm_kind("kimi_k3") is None
        True
    """
    entry, _ = _entry(table or load_norms(), model_type, transformers_version)
    return entry.kind if entry else None


def build_final_norm(config: Any, *, dtype: Any = None, table: NormsTable | None = None,
                     transformers_version: str | None = None, hidden_size: int | None = None):
    """The exact final norm of a config's text backbone, as a torch module.

    Bit-exact with transformers' own final-norm module of that backbone (same ops, same
    dtypes) in float32 and bfloat16, for every backbone of ``norms.yaml`` and the
    transformers version whose facts apply. torch is imported here, never by
    ``import chatgrammar``.

    Args:
        config: as in :func:`resolve_final_norm` (dict, ``config.json`` path or model
            directory, transformers config).
        dtype: the model dtype (``torch.bfloat16``, ``"bfloat16"``, …); None: the config's
            ``dtype`` / ``torch_dtype``, else float32. A kind whose weight transformers keeps in
            fp32 (gpt-oss) keeps it in fp32 whatever the dtype.
        table: a :class:`NormsTable` to use instead of the bundled one.
        transformers_version: whose facts apply (default: the installed transformers').
        hidden_size: the normalised size (default: the backbone config's ``hidden_size``).

    Returns:
        A ``torch.nn.Module`` (:class:`chatgrammar.core.norm_torch.FinalNormModule`) whose ``weight``
        (and ``bias``, for LayerNorms with one) takes the checkpoint's norm tensor, e.g.
        ``norm.load_state_dict({"weight": state["model.norm.weight"]})``.

    Raises:
        NormError: the backbone is unknown (the reason says why), eps or hidden_size is
            unknown, or the dtype is unsupported.

    Example:
        >>> norm = build_final_norm({"model_type": "kimi_k3", "text_config": {  # doctest: +SKIP
        ...     "model_type": "kimi_linear", "hidden_size": 7168}}, dtype="bfloat16")
    """
    import torch

    from .norm_torch import FinalNormModule

    table = table or load_norms()
    norm, path, why = trace_final_norm(config, table, transformers_version)
    if norm is None:
        raise NormError(f"no final norm for this config: {path}: {why}")
    chain, _, _ = _walk(config)
    if norm.eps is None:
        raise NormError(f"{path}: the config gives no eps and the table no default")
    size = hidden_size if hidden_size is not None else _get(chain[-1], "hidden_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise NormError(f"{path}: the backbone config has no hidden_size; pass hidden_size=")
    if dtype is None:
        dtype = next((d for level in reversed(chain) for d in (
            _get(level, "dtype"), _get(level, "torch_dtype")) if d is not None), "float32")
    torch_dtype = getattr(torch, _dtype_name(dtype))
    entry, _ = _entry(table, norm.model_type, transformers_version)
    overridden = entry is None or entry.kind != norm.kind
    inv_sqrt = "rsqrt" if overridden else entry.inv_sqrt
    return FinalNormModule(table.kinds[norm.kind], size, norm.eps, torch_dtype, inv_sqrt)


# --------------------------------------------------------------------------------------------
# Numeric reference
# --------------------------------------------------------------------------------------------

_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).rsplit(".", 1)[-1].lower()  # accepts "torch.bfloat16", np.float16, …
    if name.startswith("<class 'numpy"):  # pragma: no cover - np.float16 as a type
        name = name.split("numpy.")[-1].rstrip("'>")
    if name not in _DTYPE_ALIASES:
        try:
            import numpy as np

            name = np.dtype(dtype).name
        except Exception:
            pass
    if name not in _DTYPE_ALIASES:
        raise NormError(f"unsupported dtype {dtype!r}: use float32, bfloat16 or float16")
    return _DTYPE_ALIASES[name]


def _rounder(dtype: str):
    import numpy as np

    if dtype == "float32":
        return lambda a: np.asarray(a, dtype=np.float32)
    if dtype == "float16":
        return lambda a: np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)

    def to_bf16(a: Any) -> Any:
        # round-to-nearest-even to the top 16 bits of the fp32 pattern (what torch does)
        a = np.ascontiguousarray(a, dtype=np.float32)
        bits = a.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.astype(np.uint32).view(np.float32)
        return np.where(np.isnan(a), a, out)

    return to_bf16


def apply_norm(kind: str | NormKind, x: Any, weight: Any = None, eps: float = 1e-6,
               bias: Any = None, dtype: Any = "float32", *,
               table: NormsTable | None = None) -> Any:
    """Reference implementation (numpy) of a norm kind, cast-exact for the given dtype.

    ``x`` is taken to be in ``dtype`` (it is rounded to it first). Statistics are computed in
    fp32 over the last axis, as transformers does. The weight is rounded to ``dtype`` unless the
    kind keeps it in fp32; then the kind's ``multiply`` decides whether the normalised values
    are cast before the multiply (Llama) or the product is cast once (Gemma, gpt-oss,
    LayerNorm). bfloat16 is emulated with round-to-nearest-even.

    Args:
        kind: a kind name from the table, or a :class:`NormKind`.
        x: activations, shape ``(..., hidden)``.
        weight: shape ``(hidden,)``; None means a scale of 1 (no learned weight).
        eps: the epsilon added to the variance.
        bias: shape ``(hidden,)`` for kinds with a bias; None means 0.
        dtype: the model/input dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (torch
            and numpy dtypes are accepted too).
        table: the table to look ``kind`` up in (default: bundled).

    Returns:
        A float32 numpy array of x's shape whose values are exactly representable in ``dtype``
        (except for an ``after_cast`` kind with an fp32 weight, whose product is fp32, as in
        torch's type promotion).

    Raises:
        NormError: unknown kind or unsupported dtype.

    Example:
        >>> import numpy as np
        >>> y = apply_norm("rmsnorm", np.array([[3.0, 4.0]]), np.array([1.0, 2.0]), eps=0.0)
        >>> [round(float(v), 4) for v in y[0]]
        [0.8485, 2.2627]
    """
    import numpy as np

    if not isinstance(kind, NormKind):
        kinds = (table or load_norms()).kinds
        if kind not in kinds:
            raise NormError(f"unknown norm kind {kind!r}{_did_you_mean(str(kind), kinds)}")
        kind = kinds[kind]
    rnd = _rounder(_dtype_name(dtype))
    f32 = np.float32

    h = rnd(x)
    if kind.center:
        h = (h - h.mean(axis=-1, keepdims=True, dtype=f32)).astype(f32)
    var = (h * h).mean(axis=-1, keepdims=True, dtype=f32)
    xhat = (h * (f32(1.0) / np.sqrt(var + f32(eps)))).astype(f32)

    if weight is None:
        w = np.zeros(h.shape[-1], f32) if kind.offset else np.ones(h.shape[-1], f32)
    else:
        w = np.asarray(weight, dtype=f32)
    model_weight = kind.weight_dtype == "model"
    if model_weight:
        w = rnd(w)
    b = None
    if kind.bias and bias is not None:
        b = rnd(bias) if model_weight else np.asarray(bias, dtype=f32)

    if kind.multiply == "float32":
        scale = (w + f32(kind.offset)).astype(f32) if kind.offset else w
        if kind.offset and kind.offset_dtype == "weight" and model_weight:
            scale = rnd(scale)  # `weight + 1.0` in the model dtype, then the fp32 multiply
        y = (xhat * scale).astype(f32)
        if b is not None:
            y = (y + b).astype(f32)
        return rnd(y)
    # after_cast: cast the normalised values to the input dtype, then multiply in the weight's
    # dtype (torch promotes bf16 × fp32 to fp32, so an fp32 weight gives an fp32 result)
    out = rnd if model_weight else (lambda a: np.asarray(a, dtype=f32))
    scale = out((w + f32(kind.offset)).astype(f32)) if kind.offset else w
    y = out((rnd(xhat) * scale).astype(f32))
    if b is not None:
        y = out((y + b).astype(f32))
    return y


__all__ = [
    "ARROW", "Backbone", "BackboneVersion", "FinalNorm", "FlagOverride", "NormKind",
    "NormProblem", "NormsTable", "OuterType", "TEXT_CONFIG_KEYS", "apply_norm",
    "build_final_norm", "explain_final_norm", "final_norm_kind", "installed_transformers_version",
    "load_norms", "norms_path", "parse_version_range", "read_config", "resolve_final_norm",
    "validate_norms", "version_in_range",
]
