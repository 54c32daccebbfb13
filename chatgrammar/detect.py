"""Format detection with declared precedence.

Each spec's ``detect`` says which tokens must be single special/added ids (``require``,
``require_any``), which must not (``absent``), and which literals a chat template of the
family emits (``template`` / ``template_absent``). Among matching formats, declared
``precedence_over`` decides; never file or import order.
"""
from __future__ import annotations

from typing import Any

from .errors import DetectionError
from .format import Format
from .registry import all_formats
from .tokenizers import adapt


def _tokenizer_evidence(fmt: Format, adapter) -> tuple[bool, list[str], list[str]]:
    d = fmt.spec.detect
    have, miss = [], []
    for t in d.require:
        (have if adapter.token_id(t, special=True) is not None else miss).append(t)
    if d.require_any:
        hit = [t for t in d.require_any if adapter.token_id(t, special=True) is not None]
        if hit:
            have.extend(hit)
        else:
            miss.append("one of " + ", ".join(d.require_any))
    bad = [t for t in d.absent if adapter.token_id(t, special=True) is not None]
    ok = not miss and not bad and bool(d.require or d.require_any)
    return ok, have, miss + [f"(absent) {t}" for t in bad]


def _template_evidence(fmt: Format, template: str) -> tuple[bool, list[str], list[str]]:
    d = fmt.spec.detect
    have = [t for t in d.template if t in template]
    miss = [t for t in d.template if t not in template]
    bad = [t for t in d.template_absent if t in template]
    ok = bool(d.template) and not miss and not bad
    return ok, have, miss + [f"(absent) {t}" for t in bad]


def _template_of(tokenizer: Any) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()), None)
    return t if isinstance(t, str) else None


def resolve_precedence(names: list[str], formats: dict[str, Format]) -> list[str]:
    """Drop every candidate that another candidate declares (transitively) precedence over."""
    beats: dict[str, set[str]] = {n: set(formats[n].spec.detect.precedence_over) for n in names}
    changed = True
    while changed:  # transitive closure over a small set
        changed = False
        for a in names:
            for b in list(beats[a]):
                extra = beats.get(b, set()) - beats[a]
                if extra:
                    beats[a] |= extra
                    changed = True
    return [n for n in names if not any(n in beats[m] for m in names if m != n)]


def explain_detection(tokenizer: Any = None, *, chat_template: str | None = None) -> dict:
    """Detection with its reasons: ``{"format", "matched", "evidence", "decided_by"}``."""
    if tokenizer is None and chat_template is None:
        raise DetectionError("detect_format() needs a tokenizer, a chat_template, or both")
    if chat_template is None and tokenizer is not None:
        chat_template = None  # the tokenizer's ids are the evidence; its template is a bonus
    formats = {f.name: f for f in all_formats()}
    adapter = adapt(tokenizer) if tokenizer is not None else None
    evidence: dict[str, dict] = {}
    matched: list[str] = []
    for name, fmt in formats.items():
        ok = True
        ev: dict = {}
        if adapter is not None:
            t_ok, have, miss = _tokenizer_evidence(fmt, adapter)
            ev["tokens_found"], ev["tokens_missing"] = have, miss
            ok = ok and t_ok
        if chat_template is not None:
            c_ok, have, miss = _template_evidence(fmt, chat_template)
            ev["template_found"], ev["template_missing"] = have, miss
            ok = ok and c_ok
        evidence[name] = ev
        if ok:
            matched.append(name)
    if not matched:
        def score(n):
            ev = evidence[n]
            f = len(ev.get("tokens_found", [])) + len(ev.get("template_found", []))
            m = len(ev.get("tokens_missing", [])) + len(ev.get("template_missing", []))
            return f / (f + m) if f + m else 0.0
        near = sorted(formats, key=score, reverse=True)[:3]
        lines = [f"  {n}: found {evidence[n].get('tokens_found', []) + evidence[n].get('template_found', [])}, "
                 f"missing {evidence[n].get('tokens_missing', []) + evidence[n].get('template_missing', [])}"
                 for n in near]
        raise DetectionError("no format matches; nearest candidates:\n" + "\n".join(lines))
    winners = resolve_precedence(matched, formats)
    if len(winners) != 1:
        raise DetectionError(f"ambiguous: {', '.join(sorted(matched))} all match and declare no "
                             "precedence between them")
    decided = ("only match" if len(matched) == 1 else
               f"{winners[0]} takes precedence over {', '.join(m for m in matched if m != winners[0])}")
    return {"format": winners[0], "matched": matched, "evidence": evidence, "decided_by": decided}


def detect_format(tokenizer: Any = None, *, chat_template: str | None = None) -> Format:
    """Which format a tokenizer (and/or chat template) speaks.

    Args:
        tokenizer: a transformers tokenizer, ``tiktoken.Encoding`` or minimal-protocol object;
            its markers must be single special/added ids.
        chat_template: a Jinja chat template's source.

    Returns:
        The :class:`Format`.

    Raises:
        DetectionError: nothing matches (with what was looked for and the nearest candidates),
            or several match without a declared precedence.

    Example:
        >>> cg.detect_format(k3_tokenizer).name   # doctest: +SKIP
        'kimi-k3'
    """
    from .registry import load_format
    return load_format(explain_detection(tokenizer, chat_template=chat_template)["format"])
