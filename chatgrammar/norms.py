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

Public names: :class:`FinalNorm`, :func:`resolve_final_norm`, :func:`explain_final_norm`,
:func:`final_norm_kind`, :func:`apply_norm`, :func:`validate_norms`, :func:`load_norms`,
:func:`read_config`, :func:`norms_path`, :class:`NormProblem`, :class:`NormsTable`,
:class:`NormKind`, :class:`Backbone`.

transformers is never imported here except by :func:`validate_norms` (guarded, to recognise
multimodal wrapper types); numpy is only needed by :func:`apply_norm`.
"""
from __future__ import annotations

import difflib
import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

from .errors import NormError

#: Where a multimodal config keeps its text backbone, in lookup order.
TEXT_CONFIG_KEYS: tuple[str, ...] = ("text_config", "llm_config", "language_config")

#: The arrow used in :attr:`FinalNorm.path`.
ARROW = " → "

_MAX_DEPTH = 8

_MULTIPLY = ("after_cast", "float32")
_WEIGHT_DTYPES = ("model", "float32")
_OFFSET_DTYPES = ("float32", "weight")

_TOP_KEYS = {"version", "eps_attributes", "kinds", "backbones", "overrides", "outer_types"}
_KIND_KEYS = {"formula", "description", "center", "offset", "bias", "multiply", "weight_dtype",
              "offset_dtype"}
_KIND_REQUIRED = ("formula", "center", "offset", "bias", "multiply", "weight_dtype")
_BACKBONE_KEYS = {"kind", "eps", "eps_default", "source", "transformers", "note"}
_BACKBONE_REQUIRED = ("kind", "eps", "source")
_TRANSFORMERS_KEYS = {"model_type", "module", "class"}
_OVERRIDE_KEYS = {"when", "kind", "source", "note"}
_OVERRIDE_REQUIRED = ("when", "kind", "source")
_OUTER_KEYS = {"text_key", "text_type", "source", "note"}
_OUTER_REQUIRED = ("text_key", "source")


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
    """

    model_type: str
    kind: str
    eps: tuple[str, ...]
    eps_default: float | None
    source: str
    transformers: Mapping[str, str] | None = None
    note: str = ""


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

    It sits with the bundled format specs (:func:`chatgrammar.registry.formats_dir`).

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
# Validation (works on the YAML node tree so every problem has a line and column)
# --------------------------------------------------------------------------------------------

class _Checker:
    def __init__(self, file: str):
        self.file = file
        self.problems: list[NormProblem] = []

    def add(self, message: str, node: Any = None, path: str | None = None) -> None:
        line = col = None
        if node is not None and getattr(node, "start_mark", None) is not None:
            line, col = node.start_mark.line + 1, node.start_mark.column + 1
        self.problems.append(NormProblem(message, self.file, line, col, path))

    def mapping(self, node: Any, path: str, what: str) -> list[tuple[Any, Any]] | None:
        """The (key node, value node) pairs of a mapping; reports duplicates and non-strings."""
        if not isinstance(node, yaml.MappingNode):
            self.add(f"{what} must be a mapping", node, path)
            return None
        seen: dict[str, Any] = {}
        pairs = []
        for knode, vnode in node.value:
            if not isinstance(knode, yaml.ScalarNode) or knode.tag != "tag:yaml.org,2002:str":
                self.add(f"keys of {what} must be strings", knode, path)
                continue
            if knode.value in seen:
                first = seen[knode.value].start_mark.line + 1
                self.add(f"duplicate key {knode.value!r} (first defined on line {first})",
                         knode, _join(path, knode.value))
                continue
            seen[knode.value] = knode
            pairs.append((knode, vnode))
        return pairs

    def keys(self, pairs: list[tuple[Any, Any]], allowed: set[str], required: Iterable[str],
             node: Any, path: str, what: str) -> dict[str, tuple[Any, Any]]:
        out = {}
        for knode, vnode in pairs:
            if knode.value not in allowed:
                hint = _did_you_mean(knode.value, allowed)
                self.add(f"unknown key {knode.value!r} in {what}{hint}; allowed: "
                         + ", ".join(sorted(allowed)), knode, _join(path, knode.value))
            else:
                out[knode.value] = (knode, vnode)
        for req in required:
            if req not in out:
                self.add(f"{what} is missing required key {req!r}", node, path)
        return out


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _value(node: Any) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _scalar(ck: _Checker, node: Any, path: str, types: tuple[type, ...], what: str) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        ck.add(f"{what} must be a {' or '.join(t.__name__ for t in types)}", node, path)
        return None
    value = _value(node)
    if isinstance(value, bool) and bool not in types:
        ck.add(f"{what} must be a {' or '.join(t.__name__ for t in types)}, not a boolean",
               node, path)
        return None
    if not isinstance(value, types):
        ck.add(f"{what} must be a {' or '.join(t.__name__ for t in types)}, "
               f"got {type(value).__name__} {value!r}", node, path)
        return None
    if isinstance(value, str) and not value.strip():
        ck.add(f"{what} must not be empty", node, path)
        return None
    return value


def _str_list(ck: _Checker, node: Any, path: str, what: str) -> tuple[str, ...] | None:
    if isinstance(node, yaml.ScalarNode):
        v = _scalar(ck, node, path, (str,), what)
        return (v,) if v is not None else None
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        ck.add(f"{what} must be a string or a non-empty list of strings", node, path)
        return None
    out = []
    for i, item in enumerate(node.value):
        v = _scalar(ck, item, f"{path}[{i}]", (str,), what)
        if v is None:
            return None
        out.append(v)
    return tuple(out)


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


def _check(text: str, file: str, *, use_transformers: bool) -> tuple[list[NormProblem],
                                                                    NormsTable | None]:
    ck = _Checker(file)
    try:
        root, _ = _compose(text, file)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        msg = "invalid YAML: " + " ".join(
            str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x
        ) if mark else f"invalid YAML: {exc}"
        return [NormProblem(msg.strip(), file, mark.line + 1 if mark else None,
                            mark.column + 1 if mark else None)], None
    if root is None:
        return [NormProblem("the norms file is empty", file)], None
    top_pairs = ck.mapping(root, "", "the norms file")
    if top_pairs is None:
        return ck.problems, None
    top = ck.keys(top_pairs, _TOP_KEYS, ("version", "kinds", "backbones"), root, "",
                  "the norms file")

    if "version" in top:
        v = _scalar(ck, top["version"][1], "version", (int,), "version")
        if v is not None and v != 1:
            ck.add(f"unsupported version {v} (this chatgrammar reads version 1)",
                   top["version"][1], "version")

    eps_attributes: tuple[str, ...] = ()
    if "eps_attributes" in top:
        eps_attributes = _str_list(ck, top["eps_attributes"][1], "eps_attributes",
                                   "eps_attributes") or ()

    # kinds ---------------------------------------------------------------------------------
    kinds: dict[str, NormKind] = {}
    if "kinds" in top:
        kinds_node = top["kinds"][1]
        for knode, vnode in ck.mapping(kinds_node, "kinds", "kinds") or []:
            name, path = knode.value, f"kinds.{knode.value}"
            pairs = ck.mapping(vnode, path, f"kind {name!r}")
            if pairs is None:
                continue
            got = ck.keys(pairs, _KIND_KEYS, _KIND_REQUIRED, knode, path, f"kind {name!r}")
            vals: dict[str, Any] = {}
            ok = all(r in got for r in _KIND_REQUIRED)
            for key, types in (("formula", (str,)), ("description", (str,)),
                               ("center", (bool,)), ("offset", (int, float)),
                               ("bias", (bool,)), ("multiply", (str,)),
                               ("weight_dtype", (str,)), ("offset_dtype", (str,))):
                if key in got:
                    vals[key] = _scalar(ck, got[key][1], f"{path}.{key}", types, key)
                    ok = ok and vals[key] is not None
            for key, allowed in (("multiply", _MULTIPLY), ("weight_dtype", _WEIGHT_DTYPES),
                                 ("offset_dtype", _OFFSET_DTYPES)):
                if vals.get(key) is not None and vals[key] not in allowed:
                    ck.add(f"{key} must be one of {', '.join(allowed)}; got {vals[key]!r}",
                           got[key][1], f"{path}.{key}")
                    ok = False
            if vals.get("offset") is not None and vals["offset"] not in (0, 1):
                ck.add(f"offset must be 0 or 1; got {vals['offset']!r}", got["offset"][1],
                       f"{path}.offset")
                ok = False
            if ok:
                kinds[name] = NormKind(name=name, formula=vals["formula"],
                                       center=vals["center"], offset=float(vals["offset"]),
                                       bias=vals["bias"], multiply=vals["multiply"],
                                       weight_dtype=vals["weight_dtype"],
                                       description=vals.get("description") or "",
                                       offset_dtype=vals.get("offset_dtype") or "float32")
        known_kinds = {k.value for k, _ in (kinds_node.value if isinstance(
            kinds_node, yaml.MappingNode) else [])}
    else:
        known_kinds = set()

    def check_kind(node: Any, path: str) -> str | None:
        name = _scalar(ck, node, path, (str,), "kind")
        if name is None:
            return None
        if name not in known_kinds:
            ck.add(f"unknown kind {name!r}{_did_you_mean(name, known_kinds)}; known kinds: "
                   + (", ".join(sorted(known_kinds)) or "(none)"), node, path)
            return None
        return name

    # outer types ---------------------------------------------------------------------------
    outer_types: dict[str, OuterType] = {}
    if "outer_types" in top:
        for knode, vnode in ck.mapping(top["outer_types"][1], "outer_types",
                                       "outer_types") or []:
            name, path = knode.value, f"outer_types.{knode.value}"
            pairs = ck.mapping(vnode, path, f"outer type {name!r}")
            if pairs is None:
                continue
            got = ck.keys(pairs, _OUTER_KEYS, _OUTER_REQUIRED, knode, path,
                          f"outer type {name!r}")
            vals = {k: _scalar(ck, got[k][1], f"{path}.{k}", (str,), k) for k in got}
            if vals.get("text_key") is not None and vals["text_key"] not in TEXT_CONFIG_KEYS:
                ck.add(f"text_key must be one of {', '.join(TEXT_CONFIG_KEYS)}; got "
                       f"{vals['text_key']!r}", got["text_key"][1], f"{path}.text_key")
                vals["text_key"] = None
            if all(vals.get(k) is not None for k in _OUTER_REQUIRED) and all(
                    v is not None for v in vals.values()):
                outer_types[name] = OuterType(name, vals["text_key"], vals.get("text_type"),
                                              vals["source"], vals.get("note") or "")

    # backbones -----------------------------------------------------------------------------
    wrappers = _transformers_wrappers() if use_transformers else None
    backbones: dict[str, Backbone] = {}
    if "backbones" in top:
        for knode, vnode in ck.mapping(top["backbones"][1], "backbones", "backbones") or []:
            name, path = knode.value, f"backbones.{knode.value}"
            outer_problem = False
            if name in outer_types:
                o = outer_types[name]
                inner = f" (its text backbone is under {o.text_key}" + (
                    f": {o.text_type})" if o.text_type else ")")
                ck.add(f"{name!r} is an outer multimodal model_type, listed in outer_types"
                       f"{inner}; key the table on the text backbone", knode, path)
                outer_problem = True
            elif wrappers is not None and wrappers(name) is not None:
                text_key, inner_type = wrappers(name)
                hint = f"; key it on {inner_type!r}" if inner_type else \
                    "; key the table on the text backbone"
                ck.add(f"{name!r} is an outer multimodal model_type: transformers declares its "
                       f"text backbone under {text_key}{hint}", knode, path)
                outer_problem = True
            pairs = ck.mapping(vnode, path, f"backbone {name!r}")
            if pairs is None:
                continue
            got = ck.keys(pairs, _BACKBONE_KEYS, _BACKBONE_REQUIRED, knode, path,
                          f"backbone {name!r}")
            kind = check_kind(got["kind"][1], f"{path}.kind") if "kind" in got else None
            eps = _str_list(ck, got["eps"][1], f"{path}.eps", "eps") if "eps" in got else None
            eps_default = None
            eps_default_ok = True
            if "eps_default" in got:
                eps_default = _scalar(ck, got["eps_default"][1], f"{path}.eps_default",
                                      (int, float), "eps_default")
                eps_default_ok = eps_default is not None
                if eps_default is not None and not (eps_default > 0 and math.isfinite(
                        eps_default)):
                    ck.add(f"eps_default must be a positive number; got {eps_default!r}",
                           got["eps_default"][1], f"{path}.eps_default")
                    eps_default_ok = False
            source = _scalar(ck, got["source"][1], f"{path}.source", (str,),
                             "source") if "source" in got else None
            note = _scalar(ck, got["note"][1], f"{path}.note", (str,), "note") \
                if "note" in got else ""
            tf = None
            tf_ok = True
            if "transformers" in got:
                tnode = got["transformers"][1]
                tpairs = ck.mapping(tnode, f"{path}.transformers", "transformers")
                if tpairs is None:
                    tf_ok = False
                else:
                    tgot = ck.keys(tpairs, _TRANSFORMERS_KEYS, ("module", "class"), tnode,
                                   f"{path}.transformers", "transformers")
                    tf = {k: _scalar(ck, tgot[k][1], f"{path}.transformers.{k}", (str,), k)
                          for k in tgot}
                    tf_ok = all(v is not None for v in tf.values()) and all(
                        k in tf for k in ("module", "class"))
            if (kind and eps and source and eps_default_ok and tf_ok and note is not None
                    and not outer_problem):
                backbones[name] = Backbone(name, kind, eps,
                                           float(eps_default) if eps_default is not None
                                           else None, source, tf, note or "")

    # overrides -----------------------------------------------------------------------------
    overrides: list[FlagOverride] = []
    if "overrides" in top:
        for knode, vnode in ck.mapping(top["overrides"][1], "overrides", "overrides") or []:
            flag, path = knode.value, f"overrides.{knode.value}"
            pairs = ck.mapping(vnode, path, f"override {flag!r}")
            if pairs is None:
                continue
            got = ck.keys(pairs, _OVERRIDE_KEYS, _OVERRIDE_REQUIRED, knode, path,
                          f"override {flag!r}")
            kind = check_kind(got["kind"][1], f"{path}.kind") if "kind" in got else None
            when = None
            if "when" in got:
                if isinstance(got["when"][1], yaml.ScalarNode):
                    when = _value(got["when"][1])
                else:
                    ck.add("when must be a scalar (the flag value that triggers the override)",
                           got["when"][1], f"{path}.when")
            source = _scalar(ck, got["source"][1], f"{path}.source", (str,), "source") \
                if "source" in got else None
            note = _scalar(ck, got["note"][1], f"{path}.note", (str,), "note") \
                if "note" in got else ""
            if kind and source and when is not None and note is not None:
                overrides.append(FlagOverride(flag, when, kind, source, note or ""))

    problems = sorted(ck.problems, key=lambda p: (p.line or 0, p.col or 0))
    if problems:
        return problems, None
    return [], NormsTable(file, kinds, backbones, tuple(overrides), outer_types, eps_attributes)


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


def explain_final_norm(config: Any, *, table: NormsTable | None = None
                       ) -> tuple[FinalNorm | None, str]:
    """Resolve a config's final norm and say why.

    Resolution: starting from the outer config, descend into ``text_config``, ``llm_config``
    or ``language_config`` (or, for config objects, ``get_text_config()``) as long as there is
    one; the innermost ``model_type`` is the text backbone. A flag override (``use_gemma_norm:
    true``) on the backbone config or any enclosing config decides the kind whatever the type
    says, because some wrappers coerce their text config's ``model_type`` (e.g. to
    ``mixtral``). Otherwise the backbone's ``model_type`` is looked up in the table. eps is read
    from the backbone config's declared attribute(s), else the table's ``eps_default``.

    Args:
        config: a config dict, a path to ``config.json`` (or a model directory), or a
            transformers config object.
        table: a :class:`NormsTable` to use instead of the bundled one.

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
    norm, path, why = _explain(config, table or load_norms())
    return norm, f"{path}: {why}"


def _explain(config: Any, table: NormsTable) -> tuple[FinalNorm | None, str, str]:
    """(FinalNorm or None, resolution path, why)."""
    node = _as_config(config)
    chain = [node]
    steps: list[str] = []
    seen = {id(node)}
    while True:
        mt = _get(node, "model_type")
        steps.append(mt if isinstance(mt, str) and mt else "<no model_type>")
        sub = _text_sub_config(node)
        if sub is None:
            break
        node, via = sub
        if id(node) in seen or len(chain) >= _MAX_DEPTH:
            return None, ARROW.join(steps), "text sub-configs nest in a cycle or too deep"
        seen.add(id(node))
        chain.append(node)
        steps.append(via)
    model_type = _get(node, "model_type")
    model_type = model_type if isinstance(model_type, str) and model_type else None

    # a flag override on the backbone or any enclosing config (innermost first)
    for override in table.overrides:
        for level in reversed(chain):
            value = _get(level, override.flag)
            if value is not None and value == override.when and type(value) is type(
                    override.when):
                entry = table.backbones.get(model_type) if model_type else None
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
    entry = table.backbones.get(model_type)
    if entry is not None:
        eps, eps_name = _eps_of(node, entry.eps)
        if eps is None:
            eps = entry.eps_default
        return (FinalNorm(entry.kind, model_type, eps, path), path,
                f"{model_type} is a text backbone in norms.yaml → kind {entry.kind}; "
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


def resolve_final_norm(config: Any, *, table: NormsTable | None = None) -> FinalNorm | None:
    """The final norm of a config's text backbone, or None when it is unknown.

    Same resolution as :func:`explain_final_norm`, without the reason (call that to learn why
    a config resolved to None).

    Args:
        config: a config dict, a path to ``config.json`` (or a model directory), or a
            transformers config object.
        table: a :class:`NormsTable` to use instead of the bundled one.

    Returns:
        A :class:`FinalNorm` (``kind``, ``model_type``, ``eps``, ``path``) or None.

    Raises:
        NormError: the config file cannot be read, or the argument is not a config.

    Example:
        >>> resolve_final_norm({"model_type": "kimi_k3",
        ...                     "text_config": {"model_type": "kimi_linear"}}).kind
        'rmsnorm'
    """
    return explain_final_norm(config, table=table)[0]


def final_norm_kind(model_type: str, *, table: NormsTable | None = None) -> str | None:
    """The bare table lookup: a text-backbone ``model_type`` → its norm kind.

    No resolution happens: an outer wrapper type (``kimi_k3``, ``gemma3``) is not a key and
    answers None.

    Args:
        model_type: a text-backbone ``model_type``.
        table: a :class:`NormsTable` to use instead of the bundled one.

    Returns:
        The kind name, or None if the type is not in the table.

    Example:
        >>> final_norm_kind("gemma3_text")
        'rmsnorm_one_plus'
        >>> final_norm_kind("kimi_k3") is None
        True
    """
    entry = (table or load_norms()).backbones.get(model_type)
    return entry.kind if entry else None


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
    "ARROW", "Backbone", "FinalNorm", "FlagOverride", "NormKind", "NormProblem", "NormsTable",
    "OuterType", "TEXT_CONFIG_KEYS", "apply_norm", "explain_final_norm", "final_norm_kind",
    "load_norms", "norms_path", "read_config", "resolve_final_norm", "validate_norms",
]
