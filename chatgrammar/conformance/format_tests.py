"""A format's test facts: ``<name>.tests.yaml`` beside its spec.

The facts a format is *tested* with are data that belongs to the format, not Python: the real
chat templates it must parse (and the template variables a tokenizer would pass them), its
family's special tokens at their real ids, and the conformance deviations the format makes on
purpose (with where they are documented). They live in ``formats/<name>.tests.yaml``; the
registry and ``chatgrammar validate`` never mistake that file for a spec. The conformance checker
reads ``accepted`` from it; the format suite (tests/) and ``tools/conformance.py`` read the rest.

Schema (every key optional)::

    templates:                     # real templates, under tests/data/templates/ of a checkout
      - file: Qwen-Qwen3.jinja     # provenance in tests/data/templates/SOURCES.md
        vars: {bos_token: "<s>"}   # template variables (a tokenizer's special_tokens_map)
        main: true                 # one of the format's main templates (reliability / fuzz tests)
        main_vars: {}              # the variables those tests render it with (default: vars)
        content_as_parts: true     # the template reads message content as a list of parts
    special_ids: {"<|im_start|>": 151644}   # the family's special tokens at their real ids
    tokenizers:                    # more id-mode fixtures by name: special ids, or a real one
      added: {special_ids: {"<think>": 200000}}
      other: {special_ids: {...}, use: detection}   # only for the detection checks
      qwen: {real: qwen}
      phi4: {real: qwen, add_special: ["<|im_sep|>"]}   # a real one plus added specials
    accepted:                      # matrix case shape -> why a conformance deviation is accepted
      repeated-prompt: "docs/formats.md, harmony: what is not trained"
    refused:                       # matrix case -> why the format refuses it on purpose: the
      tool-call: "docs/formats.md, …"  # parse raises a located ParseError (or trains only part
                                   # of the assistant output), never trains anything else
    no_system: true                # the template raises on a system message: the matrix is
                                   # also checked with system messages removed
    content_parts: true            # the template reads content parts only: the matrix is also
                                   # checked with string contents turned into text parts
    content: parts                 # the matrix check_template runs by default gives content
                                   # as text parts only (an inferred spec saved by
                                   # `chatgrammar infer -o`, verified so; or sharegpt:
                                   # every message also in from / value); default "string"
    rejects_tool_messages: "why"   # every tool conversation is a located ParseError by design
    rejects_consecutive_tool_messages: "why"   # two tool results in a row are (hunyuan)
      repeated-prompt: "docs/formats.md, harmony: what is not trained"

Example:
    >>> facts = tests_for(load_format("harmony"))             # doctest: +SKIP
    >>> facts["accepted"]                                     # doctest: +SKIP
    {'repeated-prompt': 'docs/formats.md, harmony: what is not trained'}
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from ..errors import SpecError

__all__ = ["TESTS_SUFFIX", "ACCEPTED_SHAPES", "is_tests_file", "tests_path", "read_tests",
           "tests_for", "check_tests"]

#: File-name ending of a format's test facts.
TESTS_SUFFIX = ".tests.yaml"

#: The deviation shapes :mod:`chatgrammar.conformance.templates` knows how to accept (see its docstring).
ACCEPTED_SHAPES = ("repeated-prompt", "unclosed-whitespace")

_TOP = {"templates", "special_ids", "tokenizers", "accepted", "refused", "no_system",
        "content_parts", "content", "rejects_tool_messages", "rejects_consecutive_tool_messages"}
_TEMPLATE = {"file", "vars", "main", "main_vars", "content_as_parts", "note", "special_ids"}


def is_tests_file(path: str | Path) -> bool:
    """Whether ``path`` names a format's test facts (``*.tests.yaml``), not a spec."""
    return Path(path).name.endswith(TESTS_SUFFIX)


def tests_path(spec_path: str | Path) -> Path:
    """``formats/x.yaml`` -> ``formats/x.tests.yaml``."""
    p = Path(spec_path)
    return p.with_name(p.name[: -len(p.suffix)] + TESTS_SUFFIX)


def check_tests(data: Any, file: str = "<tests.yaml>") -> list[str]:
    """The schema problems of a parsed tests.yaml (empty: valid).

    Args:
        data: the parsed YAML (None for an empty file).
        file: the file, for messages.

    Returns:
        One message per problem, each naming the key.
    """
    if data is None:
        return []
    if not isinstance(data, dict):
        return [f"{file}: a tests.yaml is a mapping (templates, special_ids, tokenizers, "
                "accepted)"]
    out = [f"{file}: unknown key {k!r} (known: {', '.join(sorted(_TOP))})"
           for k in data if k not in _TOP]
    for i, t in enumerate(data.get("templates") or []):
        if not isinstance(t, dict) or not isinstance(t.get("file"), str):
            out.append(f"{file}: templates[{i}] needs a `file:` (a .jinja name)")
            continue
        out += [f"{file}: templates[{i}]: unknown key {k!r}" for k in t if k not in _TEMPLATE]
        if not isinstance(t.get("vars", {}), dict) or not isinstance(t.get("main_vars", {}), dict):
            out.append(f"{file}: templates[{i}].vars is a mapping of template variables")
    ids = [("special_ids", data.get("special_ids") or {})]
    for name, tk in (data.get("tokenizers") or {}).items():
        if not isinstance(tk, dict) or not ({"special_ids", "real"} & set(tk)):
            out.append(f"{file}: tokenizers.{name} needs `special_ids:` or `real:`")
            continue
        ids.append((f"tokenizers.{name}.special_ids", tk.get("special_ids") or {}))
        out += [f"{file}: tokenizers.{name}: unknown key {k!r}" for k in tk
                if k not in ("special_ids", "real", "use", "add_special")]
        if "add_special" in tk and ("real" not in tk or not isinstance(tk["add_special"], list)):
            out.append(f"{file}: tokenizers.{name}.add_special is a list of strings added to "
                       "a `real:` tokenizer")
        if tk.get("use", "all") not in ("all", "detection"):
            out.append(f"{file}: tokenizers.{name}.use is `all` or `detection`")
    for where, table in ids:
        if not isinstance(table, dict) or not all(
                isinstance(k, str) and isinstance(v, int) for k, v in table.items()):
            out.append(f"{file}: {where} maps token strings to integer ids")
    for shape, why in (data.get("accepted") or {}).items():
        if shape not in ACCEPTED_SHAPES:
            out.append(f"{file}: accepted.{shape}: not a deviation shape the checker knows "
                       f"({', '.join(ACCEPTED_SHAPES)})")
        elif not isinstance(why, str) or not why.strip():
            out.append(f"{file}: accepted.{shape}: say where the deviation is documented")
    from .matrix import case_names  # (lazy: the matrix builds its cases on import)
    known = set(case_names())
    for case, why in (data.get("refused") or {}).items():
        if case not in known:
            out.append(f"{file}: refused.{case}: not a matrix case (chatgrammar.conformance.matrix)")
        elif not isinstance(why, str) or not why.strip():
            out.append(f"{file}: refused.{case}: say why the format refuses it")
    for flag in ("no_system", "content_parts"):
        if not isinstance(data.get(flag, False), bool):
            out.append(f"{file}: {flag} is true or false")
    if data.get("content", "string") not in ("string", "parts", "sharegpt"):
        out.append(f"{file}: content is `string`, `parts` or `sharegpt`")
    return out


# libyaml's safe loader when PyYAML has it (the same data, ~7x faster than the pure-Python one)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@lru_cache(maxsize=256)
def _read(path: str, mtime: float) -> dict:
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_SAFE_LOADER)
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"cannot read test facts: {exc}", file=path) from None
    problems = check_tests(data, path)
    if problems:
        raise SpecError("; ".join(problems), file=path)
    return data or {}


def read_tests(path: str | Path) -> dict:
    """A tests.yaml, parsed and checked; ``{}`` when the file does not exist.

    Raises:
        SpecError: the file is not valid test facts (unreadable, unknown keys, bad ids).
    """
    p = Path(path)
    try:
        mtime = p.stat().st_mtime
    except OSError:
        return {}
    return _read(str(p.resolve()), mtime)


def tests_for(fmt: Any) -> dict:
    """The test facts of a loaded format (the ``.tests.yaml`` beside its spec file), ``{}``
    for a format without one or without a file."""
    path = str(getattr(fmt, "path", None) or "")
    return read_tests(tests_path(path)) if path.endswith((".yaml", ".yml")) else {}
