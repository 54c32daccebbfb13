"""Messages a template writes as another role's turn: found per template, declared on the format.

Some real templates move a message: Unsloth's ChatML and Zephyr templates render every role but
user and assistant (tool results included) as a *system* turn; a Mistral template folds the
system prompt into the last user turn when tools are given; the first gpt-oss template writes an
assistant message's content beside a tool call as an ``analysis`` (reasoning) message. The
format then parses the rendering exactly and the default mask is right, but no grammar can tell
the moved text from the turn that holds it: a policy that trains one side and not the other
(``roles=("assistant", "system")``, ``thinking=False``) trains it as that turn's text.

When a format is resolved *for* a template (:func:`chatgrammar.conformance.infer.resolve_format`,
:func:`~chatgrammar.conformance.infer.infer_format`), :func:`declare_folds` renders the matrix
cases that hold such messages, finds where each one lands (:func:`moved`) and returns the
format with the spec's ``role_folds`` set: every mask API then warns
(:func:`chatgrammar.runtime.policy.warn_untyped`, a :class:`~chatgrammar.DeviationWarning`)
under a policy the fold changes, and :func:`chatgrammar.conformance.policies.check_policies`
counts those cases as warned. The default policy trains neither side: its masks never change.

Example:
    >>> fmt = declare_folds(load_format("chatml"), unsloth_chatml)   # doctest: +SKIP
    >>> fmt.spec.role_folds                                          # doctest: +SKIP
    {'tool': 'system'}
"""
from __future__ import annotations

import hashlib
import threading
import warnings
from typing import Any

import yaml

from ..errors import DeviationWarning, ParseError, TemplateError
from ..runtime.format import Format
from ..runtime.policy import FOLDS, MaskPolicy

__all__ = ["declare_folds", "find_folds", "moved", "with_role_folds"]

#: Roles whose messages a template may write as another role's turn (the matrix has them).
_MOVABLE = ("system", "tool")

#: The assistant's whole output (what the default check proves right).
_OUTPUT = MaskPolicy(roles=("assistant",), thinking=True, tool_calls=True)

# Both caches are keyed by content (the spec's own data, the template's hash) and bounded:
# they keep no caller's format alive by identity, and a long run that resolves many
# templates does not grow them without end.
_cache: dict[tuple, dict] = {}
_made: dict[tuple, Format] = {}
_lock = threading.Lock()
_BOUND = 256


def _spec_key(fmt: Format) -> str:
    """The format's content: its validated spec, hashed (not its identity or its path)."""
    return hashlib.sha256(fmt.spec.model_dump_json().encode()).hexdigest()


def _put(cache: dict, key: tuple, value) -> None:
    with _lock:
        if len(cache) >= _BOUND:
            cache.clear()
        cache[key] = value


def _occurrences(R: str, word: str) -> list[tuple[int, int]]:
    out, k = [], R.find(word) if word else -1
    while k >= 0:
        out.append((k, k + len(word)))
        k = R.find(word, k + 1)
    return out


def _trained(conv, policy: MaskPolicy) -> set[int]:
    with warnings.catch_warnings():   # (a probing policy's own warnings say nothing)
        warnings.simplefilter("ignore", DeviationWarning)
        return {k for s in conv.spans(policy) for k in range(s.start, s.end)}


def moved(R: str, messages: list[dict], outputs, conv) -> dict[tuple[str, str], set[int]]:
    """Where a rendering holds a message as something else.

    Args:
        R: the rendering of ``messages``.
        messages: the conversation (message dicts).
        outputs: its assistant outputs (``MatrixCase.outputs``).
        conv: ``R`` parsed by the format.

    Returns:
        ``(src, dst)`` -> the chars of ``R`` so written: a ``system`` / ``tool`` message's
        content that does not train with its own role but trains as the turn of role ``dst``
        that holds it; ``("content", "think")``: an assistant message's content inside a span
        the format types as reasoning (kind ``think``), nowhere as content.

    Example:
        >>> case = get_case("tool-call")                                 # doctest: +SKIP
        >>> R = render_case(unsloth_chatml, case).text                   # doctest: +SKIP
        >>> list(moved(R, case.messages, case.outputs, chatml.parse(R)))  # doctest: +SKIP
        [('tool', 'system')]
    """
    found: dict[tuple[str, str], set[int]] = {}
    for m in messages:
        src, text = m.get("role"), m.get("content")
        if src not in _MOVABLE or not isinstance(text, str) or not text.strip():
            continue
        occ = _occurrences(R, text)
        own = _trained(conv, MaskPolicy(roles=(src,))) if occ else set()
        if not occ or any(set(range(*o)) <= own for o in occ):
            continue
        for s, e in occ:
            dst = next((t.role for t in conv.turns if t.start <= s < t.end), None)
            if dst in (None, src) or not set(range(s, e)) <= _trained(
                    conv, MaskPolicy(roles=(dst,))):
                continue
            found.setdefault((src, dst), set()).update(range(s, e))
    spans = conv.spans(_OUTPUT)
    think = {k for sp in spans if sp.kind == "think" for k in range(sp.start, sp.end)}
    content = {k for sp in spans if sp.kind != "think" for k in range(sp.start, sp.end)}
    for out in outputs:
        occ = [set(range(*o)) for o in _occurrences(R, out.content.strip())]
        if occ and all(o <= think and not o & content for o in occ):
            found.setdefault(("content", "think"), set()).update(*occ)
    return found


def _cases(content: str = "string") -> list:
    from .matrix import shared_matrix
    # (only read)
    return [c for c in shared_matrix(content) if c.tags & {"system", "tools", "tool-results"}]


def find_folds(fmt: Format, template: str, variables: dict | None = None, *,
               timeout: float | None = 10.0) -> dict[str, str]:
    """The messages ``template`` writes as another role's turn, as ``fmt`` parses it.

    Args:
        fmt: the format resolved for the template.
        template: the Jinja source of the chat template.
        variables: template variables (``bos_token`` …).
        timeout: per-render time limit in seconds.

    Returns:
        A ``role_folds`` mapping (``{"tool": "system"}``; empty when nothing moves). Cases the
        template rejects or the format does not parse are skipped (the conformance check
        reports those).

    Example:
        >>> find_folds(load_format("mistral"), ciscai_template)   # doctest: +SKIP
        {'system': 'user'}
    """
    from .templates import render_whole

    folds: dict[str, str] = {}
    rendered = False
    for content in ("string", "sharegpt"):
        # (a ShareGPT template, `message['from']`, renders no string case: its messages are
        # then also given in ShareGPT's keys, as check_template does)
        for case in _cases(content):
            try:
                # (the renderings every check of the template shares: detection's candidates,
                # then the check of the format taken, render the same cases)
                R = render_whole(template, case, variables or {}, timeout)
            except TemplateError:
                continue
            rendered = True
            try:
                conv = fmt.parse(R)
            except ParseError:
                continue
            for src, dst in moved(R, case.messages, case.outputs, conv):
                folds.setdefault(src, dst)
        if rendered:
            break
    return folds


def with_role_folds(fmt: Format, folds: dict[str, str]) -> Format:
    """``fmt`` with the spec's ``role_folds`` set to ``folds`` (the same compiled tables: the
    grammar does not change, only what a mask warns about). An inferred format's
    ``spec_yaml`` says it too.

    Args:
        fmt: a format.
        folds: a ``role_folds`` mapping.

    Returns:
        A new format of the same class and name (``fmt`` itself when ``folds`` is what its
        spec declares already).

    Example:
        >>> with_role_folds(load_format("chatml"), {"tool": "system"}).spec.role_folds
        {'tool': 'system'}
    """
    if dict(fmt.spec.role_folds) == dict(folds):
        return fmt
    spec = fmt.spec.model_copy(update={FOLDS: dict(folds)})
    new = type(fmt)(spec, fmt.source, tables=fmt.tables)
    if hasattr(fmt, "spec_yaml"):   # (an InferredFormat: its YAML is what it pickles as)
        new.spec_yaml = fmt.spec_yaml.rstrip("\n") + "\n" + yaml.safe_dump(
            {FOLDS: dict(folds)}, sort_keys=False)
        new.verification = fmt.verification
    return new


def _reload(path: str, folds: dict[str, str]) -> Format:
    # (how a format with folds declared for a template unpickles: Format.__reduce__)
    from ..core.registry import load_format
    return with_role_folds(load_format(path), folds)


def declare_folds(fmt: Format, template: str | None, variables: dict | None = None
                  ) -> Format:
    """``fmt`` with the ``role_folds`` that ``template`` shows (:func:`find_folds`), cached by
    the format, the template and the variables.

    Args:
        fmt: the format resolved for the template.
        template: its Jinja source (None: ``fmt`` unchanged).
        variables: template variables (only strings count).

    Returns:
        ``fmt``, or a copy that declares the folds (:func:`with_role_folds`).

    Example:
        >>> declare_folds(load_format("mistral"), ciscai_template).spec.role_folds  # doctest: +SKIP
        {'system': 'user'}
    """
    if not template:
        return fmt
    vars_ = {k: v for k, v in (variables or {}).items() if isinstance(v, str)}
    spec_key = _spec_key(fmt)
    key = (spec_key, hashlib.sha256(template.encode()).hexdigest(), tuple(sorted(vars_.items())))
    with _lock:
        folds = _cache.get(key)
    if folds is None:
        try:
            folds = find_folds(fmt, template, vars_)
        except TemplateError:   # (a template that does not compile: nothing to declare)
            folds = {}
        _put(_cache, key, folds)
    if not folds:
        return fmt
    # (one folded format per format and folds: its memo and per-tokenizer state stay warm
    # across calls, as the bundled format's do)
    made = (spec_key, tuple(sorted(folds.items())))
    with _lock:
        hit = _made.get(made)
    if hit is not None:
        return hit
    new = with_role_folds(fmt, {**fmt.spec.role_folds, **folds})
    _put(_made, made, new)
    return new
