"""Format detection with declared precedence.

Each spec's ``detect:`` section is its detector:

- ``require`` / ``require_any``: strings the tokenizer must map to ONE special or added id
  (all of ``require``, at least one of ``require_any``); ordinary BPE pieces that happen to spell
  a marker do not count;
- ``absent``: strings that must NOT be single special/added ids;
- ``template`` / ``template_absent``: literals a chat template of the family contains / never
  contains (checked on the template's source);
- ``precedence_over``: the formats this one wins against when both match.

Precedence is declared, never derived from file or import order, and the registry *proves* it is
total where it matters before anything is detected (:func:`check_precedence`): two detectors
that can both match one input (tokenizer or template) must be ordered, directly or through a
chain of declarations; a cycle, an unknown name or two files claiming one format name are
errors too. Bundled formats and plugins (entry-point group ``chatgrammar.formats``) take part
in the same proof.

Which evidence decides (see docs/detection.md):

1. ``detect_format(tokenizer)``: the tokenizer's special ids decide. If the tokenizer carries a
   ``chat_template``, it is extra evidence that can only *rule out*: among the formats whose
   tokens match, those whose template detector fails on it are dropped, unless that drops them
   all, in which case the template is ignored (token evidence wins; ids are what gets parsed)
   and the detection says so in its notes.
2. ``detect_format(chat_template=...)``: the template's literals decide.
3. ``detect_format(tokenizer, chat_template=...)``: both must agree (a format must match the
   tokens and not be ruled out by the template); if they disagree, :class:`DetectionError`.

Among the remaining candidates, declared precedence picks exactly one.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from .memo import LRU, PerObject
from ..errors import DetectionError, PrecedenceError  # (PrecedenceError: defined there, re-exported)
from ..runtime.format import Format
from ..conformance.format_tests import tests_for
from ..runtime.tokenizers import adapt

__all__ = ["Detection", "PrecedenceError", "VERDICTS", "check_precedence", "detect_format",
           "detection_formats", "explain_detection", "prove_precedence", "verify_candidate"]


# --------------------------------------------------------------------------- the proof

@dataclass
class _Entry:
    """One spec in the proof: a compiled Format, or a (FormatSpec, SpecSource) pair (specs that
    do not compile can still be checked by ``chatgrammar validate``)."""

    name: str
    spec: Any
    src: Any
    file: str


def _entries(formats: Iterable[Any]) -> list[_Entry]:
    out = []
    for f in formats:
        if isinstance(f, tuple):
            spec, src = f
            out.append(_Entry(spec.name, spec, src, str(getattr(src, "file", "<spec>"))))
        else:
            out.append(_Entry(f.name, f.spec, getattr(f, "source", None), str(f.path)))
    return out


def _token_detector(d) -> bool:
    return bool(d.require or d.require_any)


def _token_witness(a, b) -> list[str] | None:
    """Strings that, as the special tokens of one tokenizer, make both detectors match; None
    when no tokenizer can match both (any set of strings can be a tokenizer's specials: a real
    Kimi-K3 tokenizer carries K2's markers)."""
    if not (_token_detector(a) and _token_detector(b)):
        return None  # a detector without token evidence never matches a tokenizer
    forbidden = set(a.absent) | set(b.absent)
    need = list(dict.fromkeys([*a.require, *b.require]))
    if forbidden & set(need):
        return None
    for any_of in (a.require_any, b.require_any):
        if not any_of or any(t in need for t in any_of):
            continue
        pick = next((t for t in any_of if t not in forbidden), None)
        if pick is None:
            return None
        need.append(pick)
    return need


def _template_witness(a, b) -> list[str] | None:
    """Literals that, in one template, make both template detectors match; None if impossible.

    A template containing each required literal once, separated by a character that occurs in
    no forbidden literal, contains a forbidden literal only inside a required one; so both can
    match exactly when no forbidden literal is a substring of a required one.
    """
    if not (a.template and b.template):
        return None
    need = list(dict.fromkeys([*a.template, *b.template]))
    forbidden = [*a.template_absent, *b.template_absent]
    if any(f in r for f in forbidden for r in need):
        return None
    return need


def _problem(e: _Entry, message: str, loc: tuple, *, files: Sequence[str],
             formats: Sequence[str]) -> "PrecedenceError":
    line = col = None
    if e.src is not None:
        line, col = e.src.locate(loc)
    path = "".join(f"[{x}]" if isinstance(x, int) else ("." if i else "") + str(x)
                   for i, x in enumerate(loc)) or None
    return PrecedenceError(message, files=files, formats=formats, file=e.file, line=line,
                           col=col, path=path)


def _graph(entries: Sequence[Any]) -> dict[str, set[str]]:
    names = {e.name for e in entries}
    return {e.name: {n for n in e.spec.detect.precedence_over if n in names} for e in entries}


def _closure(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Transitive closure (who beats whom, directly or through a chain), iteratively."""
    out: dict[str, set[str]] = {}
    for start in graph:
        seen: set[str] = set()
        stack = list(graph[start])
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(graph.get(n, ()))
        out[start] = seen
    return out


def _chain(graph: dict[str, set[str]], a: str, b: str) -> list[str]:
    """Shortest declared chain a > … > b (breadth-first, deterministic); [] if none."""
    prev: dict[str, str | None] = {a: None}
    frontier = [a]
    while frontier and b not in prev:
        nxt = []
        for n in frontier:
            for m in sorted(graph.get(n, ())):
                if m not in prev:
                    prev[m] = n
                    nxt.append(m)
        frontier = nxt
    if b not in prev or a == b:
        return []
    path = [b]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])  # type: ignore[arg-type]
    return path[::-1]


def _cycle_through(graph: dict[str, set[str]], n: str) -> list[str]:
    """A shortest declared cycle n > … > n."""
    best: list[str] = []
    for m in sorted(graph.get(n, ())):
        back = [n] if m == n else _chain(graph, m, n)
        if back and (not best or len(back) + 1 < len(best)):
            best = [n] + back if m != n else [n, n]
    return best


def _is_bundled(file: str) -> bool:
    from .registry import formats_dir

    try:
        return Path(file).resolve().parent == formats_dir().resolve()
    except OSError:
        return False


def _quote(items: Iterable[str]) -> str:
    return ", ".join(items)


def check_precedence(formats: Iterable[Any]) -> list["PrecedenceError"]:
    """Prove that detection over a set of formats is never a coin flip.

    Checks, over the whole set: format names are unique; every name in a ``precedence_over``
    is a format of the set and not the format itself; the declarations have no cycle; and every
    pair of formats whose detectors can both match one input is ordered, directly or through a
    chain of declarations. "Can both match" is decided exactly: one tokenizer whose special
    tokens satisfy both token detectors exists unless a required token of one is ``absent`` in
    the other (or a ``require_any`` list is entirely absent); one chat template satisfying both
    template detectors exists unless a ``template_absent`` literal is a substring of a required
    literal. Any string can be a tokenizer's special token, so disjoint marker sets are NOT
    enough (a real Kimi-K3 tokenizer carries Kimi-K2's ``<|im_*|>`` strings).

    Args:
        formats: :class:`~chatgrammar.runtime.format.Format` objects, or ``(FormatSpec, SpecSource)``
            pairs (specs that do not compile can still be checked).

    Returns:
        Every problem found (empty: detection is decided), each a :class:`PrecedenceError`
        (a :class:`SpecError` located at the ``detect`` section concerned) whose message names
        every file involved.

    Example:
        >>> check_precedence(all_formats())   # doctest: +SKIP
        []
    """
    entries = sorted(_entries(formats), key=lambda e: (e.name, e.file))
    by_name: dict[str, list[_Entry]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e)
    unique = [g[0] for g in by_name.values()]
    problems = _duplicate_name_problems(by_name) + _reference_problems(unique, by_name)
    graph = _graph(unique)
    beats = _closure(graph)
    problems += _cycle_problems(unique, by_name, graph, beats)
    return problems + _overlap_problems(unique, beats)


def _duplicate_name_problems(by_name: dict[str, list["_Entry"]]) -> list["PrecedenceError"]:
    """A format name declared by more than one spec file (:func:`check_precedence`)."""
    problems = []
    for name, group in by_name.items():
        if len(group) > 1:
            files = [e.file for e in group]
            problems.append(_problem(
                group[1], f"format name {name!r} is declared by {len(group)} spec files: "
                f"{_quote(files)}; detection would pick one by lookup order (rename one)",
                ("name",), files=files, formats=[name]))
    return problems


def _reference_problems(unique: list["_Entry"], by_name: dict) -> list["PrecedenceError"]:
    """``precedence_over`` entries naming the format itself or no format of the set."""
    names = sorted(by_name)
    problems = []
    for e in unique:
        for i, other in enumerate(e.spec.detect.precedence_over):
            loc = ("detect", "precedence_over", i)
            if other == e.name:
                problems.append(_problem(e, f"{e.name} declares precedence over itself", loc,
                                         files=[e.file], formats=[e.name]))
            elif other not in by_name:
                close = difflib.get_close_matches(other, names, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                problems.append(_problem(
                    e, f"{e.name} declares precedence over {other!r}, which is not a format of "
                    f"the checked set ({_quote(names)}).{hint}", loc,
                    files=[e.file], formats=[e.name]))
    return problems


def _cycle_problems(unique: list["_Entry"], by_name: dict, graph: dict, beats: dict
                    ) -> list["PrecedenceError"]:
    """One problem per cycle of ``precedence_over`` declarations (a strongly connected set
    of formats; a format over itself is reported by :func:`_reference_problems`)."""
    names = sorted(by_name)
    files_of = {e.name: e.file for e in unique}
    cyclic = sorted(n for n in names if n in beats[n] and n != "")
    reported: set[frozenset] = set()
    problems = []
    for n in cyclic:
        if any(x == n for x in graph[n]):
            continue  # already reported as "over itself"
        comp = frozenset(m for m in names if n in beats[m] and m in beats[n])
        if comp in reported:
            continue
        reported.add(comp)
        loop = _cycle_through(graph, n)
        problems.append(_problem(
            by_name[n][0], "precedence cycle: " + " > ".join(loop) + " ("
            + _quote(f"{m}: {files_of[m]}" for m in sorted(comp))
            + "); none can win: remove one of these precedence_over entries",
            ("detect", "precedence_over"), files=[files_of[m] for m in sorted(comp)],
            formats=sorted(comp)))
    return problems


def _overlap_problems(unique: list["_Entry"], beats: dict) -> list["PrecedenceError"]:
    """Pairs of formats whose detectors can both match one input (a tokenizer or a chat
    template: the witnesses) and that no chain of declarations orders."""
    in_cycle = {n for n in beats if n in beats[n]}
    problems = []
    for i, a in enumerate(unique):
        for b in unique[i + 1:]:
            if a.name in in_cycle and b.name in in_cycle:
                continue  # the cycle is the problem to fix first
            if b.name in beats[a.name] or a.name in beats[b.name]:
                continue
            da, db = a.spec.detect, b.spec.detect
            tok = _token_witness(da, db)
            tpl = _template_witness(da, db)
            if tok is None and tpl is None:
                continue
            how = []
            if tok is not None:
                how.append(f"one tokenizer (e.g. one with special tokens {_quote(tok)})")
            if tpl is not None:
                how.append(f"one chat template (e.g. one containing {_quote(tpl)})")
            fix = []
            only_b = [t for t in db.require if t not in da.require]
            if tok is not None and only_b:
                fix.append(f"`absent: [\"{only_b[0]}\"]` to {a.name}")
            # Located at the spec that is not bundled, when one is a plugin or a new file: that
            # is the one whose author has to add the order.
            at = a if (_is_bundled(b.file) and not _is_bundled(a.file)) else b
            problems.append(_problem(
                at, f"{a.name} ({a.file}) and {b.name} ({b.file}) can both match "
                + " and ".join(how) + ", and neither declares precedence over the other: add "
                f"`precedence_over: [{a.name}]` to {b.name}'s detect (or [{b.name}] to "
                f"{a.name}'s), or make the detectors exclusive with `absent` / `template_absent`"
                + (f" (e.g. {fix[0]})" if fix else ""), ("detect",),
                files=[a.file, b.file], formats=[a.name, b.name]))
    return problems


def prove_precedence(formats: Iterable[Format]) -> list[Format]:
    """:func:`check_precedence`, raising the problems instead of returning them.

    Returns:
        The formats (a list), when the proof holds.

    Raises:
        PrecedenceError: the first problem; its message counts the others and
            ``.problems`` lists them all.
    """
    fmts = list(formats)
    problems = check_precedence(fmts)
    if problems:
        first = problems[0]
        if len(problems) > 1:
            more = len(problems) - 1
            first = PrecedenceError(
                f"{first.message} (+{more} more precedence problem{'s' if more > 1 else ''})",
                files=sorted({f for p in problems for f in p.files}),
                formats=sorted({n for p in problems for n in p.formats}),
                file=first.file, line=first.line, col=first.col, path=first.path)
        first.problems = problems  # type: ignore[attr-defined]
        raise first
    return fmts


_proof_lock = threading.Lock()
_proof_cache: dict[tuple, list[Format]] = {}


def detection_formats() -> list[Format]:
    """Every format the registry sees (bundled and plugins), loaded and proven.

    The precedence proof runs here, each time the set of spec files (or one of them) changes,
    so a broken set never reaches detection.

    Raises:
        PrecedenceError: the declared precedence is not total where detectors overlap.
        SpecError: a spec file does not load.
    """
    from .registry import load_format, spec_sources

    sources = spec_sources()
    key = []
    for p, _origin in sources:
        # the path as given and its file's stat (a stat follows symlinks): resolving each
        # path cost ~20 ms per call over the bundled set, and this runs on every detection
        try:
            st = os.stat(p)
            key.append((str(p), st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            key.append((str(p), None))
    key_t = tuple(key)
    with _proof_lock:
        hit = _proof_cache.get(key_t)
        if hit is not None:
            return hit
    fmts = [load_format(str(p)) for p, _ in sources]
    prove_precedence(fmts)
    with _proof_lock:
        if len(_proof_cache) > 16:
            _proof_cache.clear()
        _proof_cache[key_t] = fmts
    return fmts


# --------------------------------------------------------------------------- evidence

def _template_text(t: Any) -> str | None:
    """A chat template's source: a string, a dict of named templates (``default`` first, else
    all of them), or transformers' older list of ``{"name", "template"}``."""
    if isinstance(t, str):
        return t
    if isinstance(t, dict):
        if isinstance(t.get("default"), str):
            return t["default"]
        parts = [v for v in t.values() if isinstance(v, str)]
        return "\n".join(parts) if parts else None
    if isinstance(t, (list, tuple)):
        parts = [d.get("template") for d in t if isinstance(d, dict)]
        parts = [p for p in parts if isinstance(p, str)]
        if parts:
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            if isinstance(named.get("default"), str):
                return named["default"]
            return "\n".join(parts)
    return None


def _tokens_evidence(fmt: Format, adapter) -> dict | None:
    d = fmt.spec.detect
    if not _token_detector(d):
        return None
    found: dict[str, int] = {}
    missing: list[str] = []
    for t in d.require:
        tid = adapter.token_id(t, special=True)
        if tid is None:
            missing.append(t)
        else:
            found[t] = tid
    any_hit: dict[str, int] = {}
    for t in d.require_any:
        tid = adapter.token_id(t, special=True)
        if tid is not None:
            any_hit[t] = tid
    found.update(any_hit)
    forbidden = {}
    for t in d.absent:
        tid = adapter.token_id(t, special=True)
        if tid is not None:
            forbidden[t] = tid
    ok = not missing and (not d.require_any or bool(any_hit)) and not forbidden
    return {"require": list(d.require), "require_any": list(d.require_any),
            "absent": list(d.absent), "found": found, "missing": missing,
            "missing_any": [] if (any_hit or not d.require_any) else list(d.require_any),
            "forbidden_present": forbidden, "match": ok}


def _template_evidence(fmt: Format, template: str) -> dict:
    d = fmt.spec.detect
    found = [t for t in d.template if t in template]
    missing = [t for t in d.template if t not in template]
    forbidden = [t for t in d.template_absent if t in template]
    if forbidden or missing:
        status = "mismatch"
    elif d.template:
        status = "match"
    else:
        status = "no-evidence"  # the spec says nothing positive about templates
    return {"require": list(d.template), "absent": list(d.template_absent), "found": found,
            "missing": missing, "forbidden_present": forbidden, "status": status,
            "match": status == "match"}


# --------------------------------------------------------------------------- verification
#
# Literal evidence only says a template *mentions* a family's markers; a template with the same
# tags in another layout (GritLM's Tulu-2 template, which Zephyr's literals accept) then gets a
# format that trains nothing, silently. So a candidate is also checked against the template
# itself: the conformance matrix is rendered with it in the sandbox and parsed with the
# candidate (chatgrammar.conformance.templates.check_template, text mode and id mode with one id per
# marker), and a candidate that trains a wrong mask, or parses none of the renderings, is out.

#: Per-render time limit of a verification (a timeout is a case skipped, never a crash).
VERIFY_TIMEOUT = 2.0
#: Template variables tried, after the format's own test facts, when no tokenizer gives them
#: (the Llama / Mistral SentencePiece defaults most templates that print them expect).
_GUESSED_VARS = ({}, {"bos_token": "<s>", "eos_token": "</s>"})
_VERDICTS_MAX = 1024
_verdicts = LRU(_VERDICTS_MAX)

#: What a verdict's ``status`` means, best first.
VERDICTS = {
    "verified": "every matrix case the template renders parses and trains the assistant output",
    "partial": "some renderings do not parse (a located ParseError, never a wrong mask); the "
               "others train exactly the assistant output",
    "unverified": "no rendering could be checked (the template renders no matrix case, or "
                  "needs a variable detection does not have)",
    "unparsable": "none of the template's renderings parses with this format",
    "wrong": "the format trains a wrong mask on a rendering of this template",
}
_RANK = {s: i for i, s in enumerate(VERDICTS)}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _spec_content(fmt: Format) -> str:
    facts = tests_for(fmt)
    payload = json.dumps([fmt.spec.model_dump(mode="json"), facts.get("accepted"),
                          facts.get("refused")], sort_keys=True, default=str)
    return _sha(payload)


#: A format's content: its spec and the deviations its test facts accept (both change a
#: verdict), hashed once per Format object (held weakly).
_spec_key = PerObject(_spec_content)


def _variable_sets(fmt: Format, given: dict | None) -> list[dict]:
    """The template variables a candidate is verified with: the tokenizer's special tokens
    when it has any, else those the format's test facts render its real templates with, then
    none, then Llama's ``<s>`` / ``</s>``."""
    if given:
        return [dict(given)]
    sets: list[dict] = []
    for t in tests_for(fmt).get("templates") or []:
        v = {k: x for k, x in (t.get("vars") or {}).items() if isinstance(x, str)}
        if v not in sets:
            sets.append(v)
    for v in _GUESSED_VARS:
        if v not in sets:
            sets.append(dict(v))
    return sets[:6]


def _verify_once(fmt: Format, template: str, variables: dict) -> dict:
    from ..conformance.templates import check_template

    res = check_template(fmt, template, variables=variables, timeout=VERIFY_TIMEOUT)
    if res.error:
        return {"status": "unverified", "vars": variables, "reason": res.error,
                "passed": 0, "failed": [], "skipped": 0}
    passed = [c.case for c in res.cases if c.status == "pass"]
    skipped = [c for c in res.cases if c.status == "skip"]
    fails = [c for c in res.cases if c.status == "fail"]
    needs = [c for c in fails if c.reason.startswith("the template needs the variable")]
    refused = [c for c in fails if c.reason.startswith(("does not parse", "text mode parses "
                                                        "but id mode does not"))]
    wrong = [c for c in fails if c not in needs and c not in refused]
    failed = [[c.case, c.reason.splitlines()[0][:300]] for c in wrong + refused + needs]
    if wrong:
        status = "wrong"
    elif needs:
        status = "unverified"   # these variables are not the ones the template needs
    elif refused and not passed:
        status = "unparsable"
    elif refused:
        status = "partial"
    elif passed:
        status = "verified"
    else:
        status = "unverified"
    reason = ""
    if failed:
        reason = f"{failed[0][0]}: {failed[0][1]}" + (
            f" (+{len(failed) - 1} more case{'s' if len(failed) > 2 else ''})"
            if len(failed) > 1 else "")
    elif status == "unverified":
        reason = "the template renders no matrix case" + (
            f" ({skipped[0].reason.splitlines()[0][:200]})" if skipped else "")
    return {"status": status, "vars": variables, "reason": reason, "passed": len(passed),
            "failed": failed, "skipped": len(skipped), "lacks_variables": bool(needs)}


def verify_candidate(fmt: Format, templates: Sequence[str], variables: dict | None = None
                     ) -> dict:
    """Check a format against chat templates over the conformance matrix; cached by content.

    Each template is rendered over the built-in matrix in the sandbox and every rendering is
    parsed with the format (:func:`chatgrammar.conformance.templates.check_template`); the verdict is
    the best over the variable sets tried (:func:`_variable_sets`) and the worst over the
    templates. Cached by (template hash, spec hash, variables), in memory, bounded; no Format,
    tokenizer or template object is kept.

    Args:
        fmt: the candidate format.
        templates: the chat templates' sources (a named set: each of them).
        variables: template variables from the tokenizer (``bos_token`` …); None or empty:
            those of the format's test facts, then a few usual ones.

    Returns:
        ``{"status": one of VERDICTS, "reason": one line, "vars": the variables used,
        "passed": n, "failed": [[case, reason], …], "skipped": n}``.

    Example:
        >>> verify_candidate(load_format("zephyr"), [gritlm_template])["status"]  # doctest: +SKIP
        'wrong'
    """
    worst: dict | None = None
    for template in templates:
        best: dict | None = None
        for v in _variable_sets(fmt, variables):
            key = _sha(json.dumps([_sha(template), _spec_key(fmt), v], sort_keys=True))
            hit = _verdicts.get(key)
            if hit is None:
                hit = _verify_once(fmt, template, v)
                _verdicts.put(key, hit)
            # a variable set the template lacks a variable of says nothing about the format
            if best is None or (best.get("lacks_variables") and not hit.get("lacks_variables")) \
                    or (best.get("lacks_variables") == hit.get("lacks_variables")
                        and _RANK[hit["status"]] < _RANK[best["status"]]):
                best = hit
            if best["status"] == "verified":
                break
        assert best is not None
        if worst is None or _RANK[best["status"]] > _RANK[worst["status"]]:
            worst = best
    assert worst is not None
    return copy.deepcopy(worst)


def _templates_to_verify(t: Any) -> list[str]:
    """The renderable templates of a chat template value: the string, the ``default`` of a
    named set, else every named one."""
    if isinstance(t, str):
        return [t] if t.strip() else []
    if isinstance(t, dict):
        if isinstance(t.get("default"), str):
            return [t["default"]]
        return [v for v in t.values() if isinstance(v, str) and v.strip()]
    if isinstance(t, (list, tuple)):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if isinstance(named.get("default"), str):
            return [named["default"]]
        return [v for v in named.values() if isinstance(v, str) and v.strip()]
    return []


def _verified_pick(candidates: list[str], by_name: dict[str, Format], templates: list[str],
                   variables: dict | None, verification: dict[str, dict]
                   ) -> tuple[list[str], list[str]]:
    """Precedence among the candidates, each winner verified before it is taken: a winner
    that fails is ruled out and precedence picks again among the rest (the same answer as
    verifying all of them first, at the cost of the ones actually tried).

    Returns:
        ``(left, ruled_out)``: ``left`` starts with the verified winner (empty when every
        candidate fails); formats never reached are not verified.
    """
    left = list(candidates)
    ruled_out: list[str] = []
    while left:
        name, _, _ = _resolve(left, by_name)
        v = verification[name] = verify_candidate(by_name[name], templates, variables)
        if v["status"] in ("verified", "partial", "unverified"):
            return [name] + [n for n in left if n != name], ruled_out
        left.remove(name)
        ruled_out.append(name)
    return [], ruled_out


def _verification_line(name: str, v: dict) -> str:
    s = f"{name}: {v['status']}"
    if v.get("reason"):
        s += f" ({v['reason']})"
    return s


def _score(ev: dict) -> tuple[float, int]:
    f = m = 0
    for kind in ("tokens", "template"):
        e = ev.get(kind)
        if not e:
            continue
        f += len(e["found"])
        m += len(e["missing"]) + len(e.get("missing_any") and [1] or []) + \
            len(e["forbidden_present"])
    return (f / (f + m) if f + m else 0.0, f)


def _describe(name: str, ev: dict) -> str:
    parts = []
    t = ev.get("tokens")
    if t is not None:
        want = list(t["require"])
        if t["require_any"]:
            want.append("one of " + "/".join(t["require_any"]))
        n_want = len(t["require"]) + (1 if t["require_any"] else 0)
        n_found = n_want - len(t["missing"]) - (1 if t["missing_any"] else 0)
        s = f"special tokens {_quote(want)} (found {n_found} of {n_want}"
        if t["missing"] and n_found:
            s += "; missing " + _quote(t["missing"])
        s += ")"
        if t["forbidden_present"]:
            s += "; must not have " + _quote(t["forbidden_present"])
        parts.append(s)
    elif "tokens" in ev:
        parts.append("no token detector")
    c = ev.get("template")
    if c is not None and (c["require"] or c["absent"]):
        s = f"template literals {_quote(c['require'])} (found {len(c['found'])} of {len(c['require'])})"
        if c["forbidden_present"]:
            s += "; must not contain " + _quote(c["forbidden_present"])
        parts.append(s)
    return f"{name}: " + "; ".join(parts or ["declares no detector"])


@dataclass
class Detection:
    """The outcome of detection and its reasons.

    Attributes:
        format: the detected format's name.
        path: its spec file.
        matched: formats whose evidence matched, before the template narrowed them.
        candidates: the formats precedence chose among.
        decided_by: one sentence: why this format (only match, or which precedence rule).
        rule: the same, structured: ``{"kind": "only-match"}``; ``{"kind": "precedence",
            "winner", "over", "chains": {loser: [winner, …, loser]}, "declared_in": {name: file}}``;
            or ``{"kind": "template", …}`` when a chat template ruled out all but one of the
            token matches. Whenever the template narrowed the token matches, the rule also has
            ``template_ruled_out`` and ``precedence_alone`` (what precedence over the token
            matches alone would pick).
        evidence: per format, what was looked for and found (``tokens`` / ``template``).
        inputs: ``{"tokenizer": type name or None, "tokenizer_kind", "template": "argument" |
            "tokenizer" | None}``.
        notes: how the tokenizer's own chat template was used (narrowed, or ignored and why),
            and what the verification against the chat template found.
        verification: per format verified against the chat template, its verdict
            (:func:`verify_candidate`: ``status`` one of :data:`VERDICTS`, ``reason``,
            ``passed``, ``failed``, ``skipped``, ``vars``); empty without a template. Only the
            formats precedence reached are verified (``verification[format]["status"]`` is
            the winner's verdict). When a candidate failed, the rule also has
            ``verification_ruled_out`` and ``precedence_before_verification``.
        fmt: the :class:`Format` object.
    """

    format: str
    path: str
    matched: list[str]
    candidates: list[str]
    decided_by: str
    rule: dict
    evidence: dict[str, dict]
    inputs: dict
    notes: list[str] = field(default_factory=list)
    verification: dict[str, dict] = field(default_factory=dict)
    fmt: Format | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """JSON-ready dict (everything but the Format object)."""
        return _jsonable({k: v for k, v in self.__dict__.items() if k != "fmt"})


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _resolve(candidates: list[str], by_name: dict[str, Format]) -> tuple[str, dict, str]:
    graph = _graph(list(by_name.values()))
    beats = _closure(graph)
    winners = [c for c in candidates if not any(c in beats[o] for o in candidates if o != c)]
    if len(winners) != 1:
        # Unreachable once the proof holds; kept so a bug can never become a coin flip.
        raise DetectionError(
            f"ambiguous: {_quote(sorted(candidates))} all match and declare no precedence "
            "between them", candidates=sorted(candidates))
    w = winners[0]
    if len(candidates) == 1:
        return w, {"kind": "only-match"}, f"{w} is the only format whose evidence matches"
    over = sorted(c for c in candidates if c != w)
    chains = {b: _chain(graph, w, b) for b in over}
    declared = {}
    for ch in chains.values():
        for a in ch[:-1]:
            declared[a] = str(by_name[a].path)
    rule = {"kind": "precedence", "winner": w, "over": over, "chains": chains,
            "declared_in": declared}
    why = "; ".join(" > ".join(ch) for ch in chains.values())
    where = _quote(f"{Path(p).name}: detect.precedence_over" for p in declared.values())
    return w, rule, f"{w} takes precedence over {_quote(over)} ({why}; declared in {where})"


def _no_match(what: str, evidence: dict[str, dict], considered: list[str],
              extra: str = "") -> DetectionError:
    ranked = sorted(considered, key=lambda n: (-_score(evidence[n])[0], -_score(evidence[n])[1], n))
    near = [n for n in ranked if _score(evidence[n])[1] > 0][:3]
    head = (f"no format matches {what}; nearest: {_quote(near)}" if near else
            f"no format matches {what}; none of the markers any format looks for is there")
    if extra:
        head += f" ({extra})"
    lines = [head, "looked for:"] + ["  " + _describe(n, evidence[n]) for n in ranked]
    return DetectionError("\n".join(lines), candidates=near, evidence=evidence)


def _chat_template_of(tokenizer: Any, chat_template: Any) -> tuple[str | None, str | None, Any]:
    """``(template text, where it came from, the raw value)`` for :func:`explain_detection`:
    the given ``chat_template`` (``"argument"``), else the tokenizer's own (``"tokenizer"``).

    Raises:
        TypeError: ``chat_template`` is given but holds no template text.
    """
    if chat_template is not None:
        template = _template_text(chat_template)
        if template is None:
            raise TypeError(f"chat_template must be a str (a Jinja template's source), got "
                            f"{type(chat_template).__name__}")
        return template, "argument", chat_template
    if tokenizer is not None:
        raw_template = getattr(tokenizer, "chat_template", None)
        template = _template_text(raw_template)
        return template, ("tokenizer" if template is not None else None), raw_template
    return None, None, None


def _evidence(by_name: dict[str, Format], adapter: Any, template: str | None) -> dict[str, dict]:
    """Each format's marker evidence: in the tokenizer's vocabulary and in the template."""
    evidence: dict[str, dict] = {}
    for name in sorted(by_name):
        fmt = by_name[name]
        ev: dict = {}
        if adapter is not None:
            ev["tokens"] = _tokens_evidence(fmt, adapter)
        if template is not None:
            ev["template"] = _template_evidence(fmt, template)
        evidence[name] = ev
    return evidence


def _narrowed(name: str, rule: dict, why: str, matched: list[str], candidates: list[str],
              verified: list[str], by_name: dict, template_source: str | None
              ) -> tuple[dict, str]:
    """The template's literals narrowed the token matches: the rule and reason say so, and
    whether precedence alone (over the token matches) would have picked the same format."""
    by_prec, _, _ = _resolve(matched, by_name)
    ruled_out = [n for n in matched if n not in candidates]
    whose = "given" if template_source == "argument" else "tokenizer's"
    why = (f"{name}: the {whose} chat template rules out {_quote(ruled_out)}, which "
           f"the tokens also match; " + (why if len(verified) > 1 else
                                         f"{name} is the only candidate left")
           + (f"; precedence alone agrees ({by_prec})" if by_prec == name else
              f"; precedence alone would have picked {by_prec}"))
    rule = {**rule, "template_ruled_out": ruled_out, "precedence_alone": by_prec}
    if rule["kind"] == "only-match":
        rule["kind"] = "template"
    return rule, why


def explain_detection(tokenizer: Any = None, *, chat_template: Any = None,
                      formats: Iterable[Format] | None = None, verify: bool = True
                      ) -> Detection:
    """Detect a format and say why (the evidence per format, the verification against the
    chat template and the deciding rule).

    Args:
        tokenizer: a transformers tokenizer (fast or slow), a ``tiktoken.Encoding`` or an
            object with ``convert_tokens_to_ids`` and ``decode``.
        chat_template: a Jinja chat template's source (or a dict of named templates).
        formats: the formats to choose from (default: the registry, bundled + plugins); the
            precedence proof runs on them either way.
        verify: check each candidate against the chat template (given, or the tokenizer's
            own) over the conformance matrix before it is taken (default). ``False``: marker
            evidence and precedence only, as :func:`check_precedence` reasons.

    Returns:
        A :class:`Detection`.

    Raises:
        DetectionError: nothing matches (message: what was looked for, nearest candidates);
            the tokenizer and the given template disagree; or no candidate parses the chat
            template correctly (the message gives each one's failing case).
        PrecedenceError: the format set's declared precedence is not total (also a
            DetectionError).
        TypeError: the tokenizer offers no supported protocol.

    Example:
        >>> explain_detection(k3_tokenizer).decided_by   # doctest: +SKIP
        'kimi-k3 takes precedence over kimi-k2 (kimi-k3 > kimi-k2; declared in ...)'
    """
    if tokenizer is None and chat_template is None:
        raise DetectionError("detect_format() needs a tokenizer, a chat_template, or both")
    fmts = detection_formats() if formats is None else prove_precedence(formats)
    by_name = {f.name: f for f in fmts}
    adapter = adapt(tokenizer) if tokenizer is not None else None

    template, template_source, raw_template = _chat_template_of(tokenizer, chat_template)
    evidence = _evidence(by_name, adapter, template)

    inputs = {"tokenizer": type(tokenizer).__name__ if tokenizer is not None else None,
              "tokenizer_kind": adapter.kind if adapter is not None else None,
              "template": template_source}
    notes: list[str] = []
    matched, candidates = _candidates(by_name, evidence, adapter, template, template_source,
                                      inputs, notes)

    verification: dict[str, dict] = {}
    ruled_by_check: list[str] = []
    verified = candidates
    vtemplates = _templates_to_verify(raw_template) if (verify and template is not None) else []
    if vtemplates:
        from ..conformance.render import special_token_vars

        variables = special_token_vars(tokenizer) if tokenizer is not None else None
        verified, ruled_by_check = _verified_pick(candidates, by_name, vtemplates, variables,
                                                  verification)
        if not verified:
            raise _verification_failed(candidates, verification, template_source, adapter,
                                       evidence)

    name, rule, why = _resolve(verified, by_name)
    if len(candidates) < len(matched):
        rule, why = _narrowed(name, rule, why, matched, candidates, verified, by_name,
                              template_source)
    if vtemplates:
        why = _with_verification(name, why, rule, verification, ruled_by_check, candidates,
                                 by_name, template_source, notes)
    fmt = by_name[name]
    if vtemplates:
        # messages the template writes as another role's turn: declared on the format taken
        # for it (spec key role_folds), so a policy they change warns at mask time
        from ..conformance.folds import declare_folds
        for t in vtemplates:
            fmt = declare_folds(fmt, t, (verification.get(name) or {}).get("vars"))
    return Detection(format=name, path=str(fmt.path), matched=matched, candidates=verified,
                     decided_by=why, rule=rule, evidence=evidence, inputs=inputs, notes=notes,
                     verification=verification, fmt=fmt)


def _candidates(by_name: dict[str, Format], evidence: dict, adapter: Any, template: str | None,
                template_source: str | None, inputs: dict, notes: list[str]
                ) -> tuple[list[str], list[str]]:
    """``(matched, candidates)`` from the marker evidence: what matched (tokens, else the
    template's literals) and what the template's literals leave of it."""
    if adapter is None:
        matched = [n for n in sorted(by_name) if evidence[n]["template"]["match"]]
        if not matched:
            raise _no_match("this chat template", evidence,
                            [n for n in sorted(by_name) if by_name[n].spec.detect.template
                             or by_name[n].spec.detect.template_absent] or sorted(by_name))
        return matched, matched
    tok_what = f"this tokenizer ({inputs['tokenizer']})"
    matched = [n for n in sorted(by_name)
               if evidence[n]["tokens"] is not None and evidence[n]["tokens"]["match"]]
    considered = [n for n in sorted(by_name) if evidence[n]["tokens"] is not None]
    if not matched:
        extra = ""
        if template is not None:
            tpl = [n for n in sorted(by_name) if evidence[n]["template"]["match"]]
            if tpl:
                extra = (f"the {'given' if template_source == 'argument' else 'tokenizer'}"
                         f"'s chat template looks like {_quote(tpl)}, but the tokenizer "
                         "lacks its markers as special tokens")
        raise _no_match(tok_what, evidence, considered or sorted(by_name), extra)
    if template is None:
        return matched, matched
    compatible = [n for n in matched if evidence[n]["template"]["status"] != "mismatch"]
    ruled_out = [n for n in matched if n not in compatible]
    tpl_says = [n for n in sorted(by_name) if evidence[n]["template"]["match"]]
    if compatible:
        if ruled_out:
            whose = "given" if template_source == "argument" else "tokenizer's"
            notes.append(
                f"the {whose} chat template rules out {_quote(ruled_out)} ("
                + "; ".join(f"{n}: " + _template_gap(evidence[n]["template"])
                            for n in ruled_out) + ")")
        return matched, compatible
    if template_source == "argument":
        raise DetectionError(
            f"the tokenizer and the chat template disagree: the tokenizer's special "
            f"tokens match {_quote(matched)}, the chat template "
            + (f"matches {_quote(tpl_says)}" if tpl_says else "matches no format")
            + " (" + "; ".join(f"{n}: " + _template_gap(evidence[n]["template"])
                              for n in matched) + ")",
            candidates=matched + [n for n in tpl_says if n not in matched],
            evidence=evidence)
    # The tokenizer's own template lacks the literals of every format its tokens match. The
    # literals may just be spelled otherwise: the verification against the template (when it
    # runs) decides whether the token matches can parse it.
    notes.append(
        "the tokenizer's own chat template "
        + (f"looks like {_quote(tpl_says)}" if tpl_says else "matches no format")
        + f", which its special tokens do not support (its literals rule out {_quote(matched)})"
        "; token evidence kept, the template only verifies it")
    return matched, matched


def _verification_failed(candidates: list[str], verification: dict[str, dict],
                         template_source: str | None, adapter: Any,
                         evidence: dict) -> DetectionError:
    lines = ["  " + _verification_line(n, verification[n]) for n in candidates]
    looks = sorted(n for n, ev in evidence.items()
                   if (ev.get("template") or {}).get("match") and n not in candidates)
    if template_source == "tokenizer":
        head = (f"the tokenizer's special tokens match {_quote(candidates)}, but "
                + ("it does not parse" if len(candidates) == 1 else "none of them parses")
                + " the tokenizer's own chat template correctly"
                + (f" (the template looks like {_quote(looks)}, whose markers are not special "
                   "tokens of this tokenizer)" if looks else "")
                + ": data rendered with "
                "that template would not get a correct loss mask (pass chat_template= the "
                "template your data is rendered with, or, if that template is not how your "
                "data is rendered, load the format by name)")
    else:
        what = ("the tokenizer's special tokens and the chat template both point to"
                if adapter is not None else "the chat template's markers point to")
        head = (f"{what} {_quote(candidates)}, but "
                + ("it does not parse" if len(candidates) == 1 else "none of them parses")
                + " the chat template correctly (checked over the conformance "
                "matrix); no bundled format is used rather than a wrong mask")
    return DetectionError("\n".join([head, "verification:"] + lines), candidates=candidates,
                          evidence={n: {**evidence.get(n, {}), "verification": verification[n]}
                                    for n in candidates})


def _with_verification(name: str, why: str, rule: dict, verification: dict[str, dict],
                       ruled: list[str], candidates: list[str], by_name: dict[str, Format],
                       template_source: str | None, notes: list[str]) -> str:
    """The decision sentence and notes, with what the verification did."""
    whose = "given" if template_source == "argument" else "tokenizer's own"
    v = verification[name]
    if ruled:
        by_prec, _, _ = _resolve(candidates, by_name)
        rule["verification_ruled_out"] = list(ruled)
        rule["precedence_before_verification"] = by_prec
        notes.append(f"verification against the {whose} chat template rules out "
                     + "; ".join(_verification_line(n, verification[n]) for n in ruled))
        why += (f"; {_quote(ruled)} ruled out: "
                + "; ".join(f"{n} {verification[n]['status']} on the template" for n in ruled))
    if v["status"] == "verified":
        why += (f"; verified against the {whose} chat template ({v['passed']} matrix case"
                f"{'s' if v['passed'] != 1 else ''} pass)")
    elif v["status"] == "partial":
        why += f"; partly verified against the {whose} chat template"
        notes.append(f"{name} parses only part of what the {whose} chat template renders: "
                     f"{v['reason']}; samples of those shapes raise a located ParseError "
                     "(lenient mode: train nothing there and warn)")
    else:
        why += f"; not verified against the {whose} chat template"
        msg = (f"{name} could not be verified against the {whose} chat template "
               f"({v['reason']}); detected from marker evidence only")
        notes.append(msg)
        warnings.warn(f"chatgrammar detection: {msg}", RuntimeWarning, stacklevel=4)
    return why


def _template_gap(ev: dict) -> str:
    bits = []
    if ev["missing"]:
        bits.append("missing " + _quote(ev["missing"]))
    if ev["forbidden_present"]:
        bits.append("contains " + _quote(ev["forbidden_present"]))
    return ", ".join(bits) or "matches"


def detect_format(tokenizer: Any = None, *, chat_template: Any = None,
                  verify: bool = True) -> Format:
    """Which format a tokenizer (and/or chat template) speaks.

    The tokenizer's special ids are the evidence that counts (they are what gets parsed); a
    ``chat_template`` the tokenizer carries can only rule candidates out; a ``chat_template``
    given here must agree with the tokenizer. Among the candidates left, the precedence
    declared in the specs decides, and the winner is **verified against the chat template**
    (given, or the tokenizer's own): the conformance matrix is rendered with it in the sandbox
    and must parse with the format and train exactly the assistant output. A candidate that
    trains a wrong mask, or parses none of the renderings, is ruled out and precedence picks
    again; when none is left, :class:`DetectionError` says why (never a silently wrong mask).
    Verdicts are cached by content (template, spec, variables). Before anything is detected,
    the registry proves that declared precedence is total wherever two detectors overlap. Use
    :func:`explain_detection` for the reasons.

    Args:
        tokenizer: a transformers tokenizer (fast or slow, including remote-code slow ones such
            as Kimi's ``TikTokenTokenizer``), a ``tiktoken.Encoding``, or an object with
            ``convert_tokens_to_ids`` and ``decode``; markers count only as single
            special/added ids.
        chat_template: a Jinja chat template's source.
        verify: verify the candidates against the chat template (default True).

    Returns:
        The :class:`Format`.

    Raises:
        DetectionError: nothing matches (listing what was looked for and the nearest
            candidates, also on ``.candidates`` / ``.evidence``), the tokenizer and the template
            disagree, no candidate parses the chat template (the given one or the tokenizer's
            own) correctly, or the registry's precedence is not total
            (:class:`PrecedenceError`).

    Example:
        >>> cg.detect_format(k3_tokenizer).name   # doctest: +SKIP
        'kimi-k3'
    """
    det = explain_detection(tokenizer, chat_template=chat_template, verify=verify)
    return det.fmt  # type: ignore[return-value]
