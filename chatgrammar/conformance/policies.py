"""Masks under every mask policy a trainer uses, checked against the template.

:func:`chatgrammar.conformance.templates.check_template` proves, case by case, that a format
trains exactly the assistant output (reasoning and tool calls included) and, with
``end_marker``, its terminator. A trainer also masks with other policies: no reasoning
(``MaskPolicy(thinking=False)``), no tool calls (``tool_calls=False``), the last reply only
(``last_turn_only=True``), system prompts too (``roles=("assistant", "system")``). A format
that types a message's reasoning as content passes the default check and still trains that
reasoning under ``thinking=False``: a silently wrong mask.

:func:`check_policies` re-checks each passing case of a conformance result under each policy of
:data:`POLICIES`. The expectation comes from the template alone, never from the format's spans:
the case's own strings (:class:`chatgrammar.conformance.matrix.AssistantOutput`: content,
reasoning, tool-call names and argument values) located in the rendering inside each assistant
message's region (found by render-diffing, ``CaseResult.regions``), and the default mask that
the case was proven right with:

- ``thinking=False``: no character of the message's reasoning trains; its content and tool
  calls still do; nothing trains that the default policy does not train;
- ``tool_calls=False``: no tool-call name or argument value trains; content and reasoning still
  do; nothing new trains;
- ``last_turn_only``: exactly the default mask of the last assistant message trains;
- ``end_marker``: the default mask, each message extended to the end of its region (its
  terminator as the template writes it);
- ``roles+system``: the default mask, plus the system message's content where the format has a
  system turn; never a user or tool message's words, nor a marker.

Each policy is also run in id mode (one id per marker, :class:`MarkerTokenizer`): through
``Format.parse_ids`` and the memoised fast path (``Format.loss_mask``), which must both train
what text mode trains.

Example:
    >>> res = check_template(fmt, template)                         # doctest: +SKIP
    >>> check_policies(fmt, res)["thinking=False"]                  # doctest: +SKIP
    []
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Iterable

from ..errors import DeviationWarning, ParseError
from ..runtime.policy import MaskPolicy
from ..runtime.spans import merge_spans
from .folds import moved
from .matrix import shared_case

__all__ = ["POLICIES", "WARNED", "check_policies", "is_warned"]

#: The mark of a problem the format warned about (a :class:`DeviationWarning` at mask time):
#: ``"case: warned: problem"``. Wrong, but never silent.
WARNED = "warned: "

#: The problems a plain-text warning covers: reasoning or a call the format types no block for.
_UNTYPED = "(untyped:"

#: Everything of the assistant trains (the policy the default check proves right).
_OUTPUT = MaskPolicy(roles=("assistant",), thinking=True, tool_calls=True)

#: The non-default policies every passing case is re-checked under (name -> policy).
POLICIES: dict[str, MaskPolicy] = {
    "thinking=False": MaskPolicy(thinking=False),
    "tool_calls=False": MaskPolicy(tool_calls=False),
    "last_turn_only": MaskPolicy(last_turn_only=True),
    "end_marker": MaskPolicy(end_marker=True),
    "roles+system": MaskPolicy(roles=("assistant", "system")),
}


def _chars(spans: Iterable[tuple[int, int]]) -> set[int]:
    return {k for s, e in spans for k in range(s, e)}


def _occurrences(R: str, word: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """Every occurrence of ``word`` in ``R[lo:hi]``."""
    out, k = [], R.find(word, lo, hi) if word else -1
    while k >= 0:
        out.append((k, k + len(word)))
        k = R.find(word, k + 1, hi)
    return out


def _words(R: str, region: tuple, out) -> dict[str, list[tuple[int, int]]]:
    """Where the message's content, reasoning and tool-call strings are in its region: a
    tool-call string inside the content or the reasoning is theirs."""
    _, s0, _, _, end = region
    content = _occurrences(R, out.content, s0, end)
    reasoning = _occurrences(R, out.reasoning or "", s0, end)
    taken = _chars(content) | _chars(reasoning)
    calls = [o for c in out.tool_calls for w in c.strings()
             for o in _occurrences(R, w, s0, end) if not set(range(*o)) & taken]
    return {"content": content, "reasoning": reasoning, "tool_call": calls}


def _show(R: str, k: int) -> str:
    return repr(R[max(0, k - 20):k + 20])


def _drop_problems(R: str, got: set, base: set, regions, outputs, dropped: str,
                   typed: set) -> list[str]:
    """``thinking=False`` / ``tool_calls=False``: the ``dropped`` strings never train, the
    others still do, and nothing trains that the default does not. ``typed``: the chars the
    format types as the dropped kind (only to say why: in a message with none of them the
    template writes its reasoning / calls as plain text, or in tags the format has no markers
    for)."""
    problems = []
    new = got - base
    if new:
        k = min(new)
        problems.append(f"trains char {k} that the default policy does not: {_show(R, k)}")
    for region, out in zip(regions, outputs):
        for what, occ in _words(R, region, out).items():
            for s, e in occ:
                inside = set(range(s, e))
                if what == dropped and inside & got:
                    why = "" if set(range(region[1], region[4])) & typed else (
                        f" {_UNTYPED} the format types no block of that kind in this "
                        "message; the template writes it as plain text or in tags it has no "
                        "markers for)")
                    problems.append(f"message [{region[0]}]: its {what.replace('_', ' ')} "
                                    f"{R[s:e]!r} at char {s} still trains{why}")
                elif what != dropped and inside <= base and not inside <= got and not (
                        what == "content" and inside <= typed and dropped == "tool_call"):
                    # (content the template itself writes inside the call block, after the
                    # call's marker — vLLM's Mistral '[TOOL_CALLS]' + content — is the call:
                    # the model writes it as one)
                    problems.append(f"message [{region[0]}]: its {what.replace('_', ' ')} "
                                    f"{R[s:e]!r} at char {s} no longer trains")
    return problems


def _last_turn_problems(R: str, got: set, base: set, regions) -> list[str]:
    if not regions:
        return [f"trains char {min(got)}" ] if got else []
    _, s0, _, _, end = regions[-1]
    want = {k for k in base if s0 <= k < end}
    return _diff(R, got, want, "the last assistant message's default mask")


def _repeated_openers(res, conv) -> set[int]:
    """The headers of the later turns of a message the template renders as several assistant
    turns, where the default check accepted that as the ``repeated-prompt`` deviation (the
    repeated opener stays untrained under every policy: a turn's spans never depend on the
    turn before it)."""
    several = {int(m.group(1)) for d in res.deviations
               for m in [re.match(r"message \[(\d+)\] \(assistant\) is rendered as several "
                                  r"turns", d)] if m}
    out: set[int] = set()
    for i, _, start, _, end in res.regions:
        if i in several:
            out |= {k for t in conv.turns if t.role == "assistant" and start < t.start < end
                    and t.body_start is not None for k in range(t.start, t.body_start)}
    return out


def _end_marker_problems(R: str, got: set, base: set, regions, fmt,
                         repeated: set = frozenset()) -> list[str]:
    """``end_marker``: the default mask, each assistant message trained on to the end of its
    region (a message the default trains nothing of: from its output start). Beyond that only
    a turn's terminator may train, right after trained text, where a message's output
    starts or inside the region of a message the default trains nothing of: close markers of turns and whitespace (a ChatML template that closes a turn only
    when another follows writes it in the next message's rendering; one message rendered as
    several turns closes each)."""
    want = set(base)
    starts = set()
    empty = set()   # the regions of messages the default trains nothing of
    for _, s0, start, _, end in regions:
        inside = [k for k in base if s0 <= k < end]
        want |= set(range(max(inside) + 1 if inside else start, end))
        starts |= {s0, start, end}
        if not inside:
            empty |= set(range(s0, end))
    want -= repeated - base  # (a header the format trains part of, trained_after, stays)
    if not want <= got:
        return _diff(R, got & want, want, "the default mask up to the end of each assistant "
                     "message")
    closes = _chars(o for t in _top_close_texts(fmt) for o in _occurrences(R, t, 0, len(R)))
    for s, e in _runs(got - want):
        # (an empty reply's terminator is all it writes: CodeLlama-70B's ' Source:
        # assistant\n\n  <step>', whose region the locator starts after the '<step>')
        if not (s - 1 in want or s in starts or s in empty) or any(
                not (k in closes or R[k].isspace()) for k in range(s, e)):
            return [f"trains char {s}, which is neither the assistant output nor its "
                    f"terminator: {_show(R, s)}"]
    return []


def _in_regions(regions, n: int) -> set[int]:
    return {k for _, s0, _, _, end in regions for k in range(s0, min(end, n))}


def _runs(chars: set[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[s, e)`` of consecutive positions."""
    out: list[list[int]] = []
    for k in sorted(chars):
        if out and out[-1][1] == k:
            out[-1][1] = k + 1
        else:
            out.append([k, k + 1])
    return [(s, e) for s, e in out]


def _turn_elements(fmt) -> list:
    """The top-level elements and the ``follow`` elements they chain to (Mistral's reply)."""
    spec, out, todo = fmt.spec, [], list(fmt.spec.top)
    while todo:
        el = spec.elements.get(todo.pop())
        if el is not None and el not in out:
            out.append(el)
            if el.follow:
                todo.append(el.follow)
    return out


def _top_close_texts(fmt) -> set[str]:
    """The texts of the markers that close a turn (with their ``after`` markers)."""
    spec = fmt.spec
    names = {n for el in _turn_elements(fmt) if el.close
             for n in list(el.close.markers) + list(el.close.after)}
    return {spec.markers[n].text for n in names if n in spec.markers}


def _top_open_texts(fmt) -> set[str]:
    """The texts of the markers that open a turn."""
    spec = fmt.spec
    return {spec.markers[o].text for el in _turn_elements(fmt) for o in el.open
            if o in spec.markers}


def _diff(R: str, got: set, want: set, what: str) -> list[str]:
    if got == want:
        return []
    k = min(got ^ want)
    return [f"{'trains' if k in got else 'does not train'} char {k} ({what}): {_show(R, k)}"]


def _others(R: str, case, res, conv, fmt) -> set[int]:
    """Chars no system policy may train: the words of user and tool messages, the assistant
    messages' regions, turn openers."""
    out = set()
    for m in case.messages:
        if m.get("role") in ("user", "tool") and isinstance(m.get("content"), str):
            out |= _chars(_occurrences(R, m["content"], 0, len(R)))
    out |= _in_regions(res.regions, len(R))
    # a turn opener where a turn starts (one quoted inside a system prompt's tool
    # instructions, Phi-4-mini's `<|tool|>…<|/tool|>`, is that prompt's text)
    opens = _top_open_texts(fmt)
    starts = {t.start for t in conv.turns}
    return out | _chars(o for t in opens for o in _occurrences(R, t, 0, len(R))
                        if o[0] in starts)


def _system_problems(R: str, got: set, base: set, case, res, conv, fmt) -> list[str]:
    """``roles+system``: the default mask plus system text; never a user's or a tool's
    message, an assistant message's untrained text or a turn opener; and the system message's
    content trains where the format has a system turn."""
    problems = []
    if not base <= got:
        k = min(base - got)
        problems.append(f"no longer trains char {k}: {_show(R, k)}")
    others = _others(R, case, res, conv, fmt)
    bad = (got - base) & others
    if bad:
        k = min(bad)
        problems.append(f"trains char {k} of a user, tool or assistant message or a turn "
                        f"opener: {_show(R, k)}")
    # Harmony renders the system message as a `developer` turn: not the role asked for. A
    # system turn of blank text (alpaca's BOS body, `<s>\n` before a template's
    # `### Instruction:` section that holds the system prompt: a user section by its marker)
    # holds no system message: the format then has no system turn for it
    if any(t.role == "system" and R[t.body_start:t.body_end].strip() for t in conv.turns
           if t.body_start is not None):
        for m in case.messages:
            text = m.get("content")
            if isinstance(text, list):
                text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
            if m.get("role") != "system" or not text:
                continue
            occ = [o for o in _occurrences(R, text, 0, len(R)) if not set(range(*o)) & others
                   and not any(t.role == "developer" and t.start <= o[0] < t.end
                               for t in conv.turns)]
            if occ and not any(set(range(*o)) <= got for o in occ):
                problems.append(f"the system prompt {text[:40]!r} at char {occ[0][0]} does "
                                "not train")
    return problems


def policy_problems(name: str, R: str, got: set, base: set, case, res, conv, fmt) -> list[str]:
    """What is wrong with the chars ``got`` that policy ``name`` trains on case ``case``
    (``base``: what the default trains, proven right; ``res``: the passing CaseResult)."""
    regions, outputs = res.regions, case.outputs
    if name in ("thinking=False", "tool_calls=False"):
        kind = "think" if name == "thinking=False" else "tool_call"
        typed = _chars((s.start, s.end) for s in conv.spans(_OUTPUT) if s.kind == kind)
        return _drop_problems(R, got, base, regions, outputs,
                              "reasoning" if kind == "think" else "tool_call", typed)
    if name == "last_turn_only":
        return _last_turn_problems(R, got, base, regions)
    if name == "end_marker":
        return _end_marker_problems(R, got, base, regions, fmt, _repeated_openers(res, conv))
    if name == "roles+system":
        return _system_problems(R, got, base, case, res, conv, fmt)
    raise KeyError(name)


def _id_parse(fmt, R: str, synth) -> tuple:
    """``(ids, char bounds of each id, parse_ids result or the ParseError's message)`` of
    ``R`` in id mode (one id per marker): the parse does not depend on the policy, so each
    case is encoded and parsed once for every policy checked (:func:`_id_problems`)."""
    ids, starts = synth.encode_with_offsets(R)
    try:
        conv_ids = fmt.parse_ids(ids, synth)
    except ParseError as exc:
        conv_ids = exc.message
    return ids, starts + [len(R)], conv_ids


def _id_problems(fmt, parsed: tuple, synth, policy: MaskPolicy, got: set) -> str | None:
    """Id mode (parse and fast path, one id per marker) must train what text mode trains
    (``parsed``: the case's :func:`_id_parse`)."""
    ids, bounds, conv_ids = parsed
    if isinstance(conv_ids, str):
        return f"id mode does not parse: {conv_ids}"
    idspans = merge_spans((s.start, s.end) for s in conv_ids.spans(policy))
    if _chars((bounds[s], bounds[e]) for s, e in idspans) != got:
        return "id mode (Format.parse_ids) trains otherwise than text mode"
    want = [0] * len(ids)
    for s, e in idspans:
        want[s:e] = [1] * (e - s)
    if list(fmt.loss_mask(ids, synth, policy=policy)) != want:
        return "the fast path (Format.loss_mask) trains otherwise than Format.parse_ids"
    return None


def is_warned(problem: str) -> bool:
    """Whether a :func:`check_policies` problem (``"case: …"``) is one the format warned
    about."""
    return problem.partition(": ")[2].startswith(WARNED)


def _warned(problems: list[str], said: list, shifted: set[int] = frozenset()) -> bool:
    """Every problem is plain-text reasoning or a plain-text tool call still training (each
    policy of POLICIES drops one kind), or is at a char of text the template moved into
    another role's turn or into reasoning (``shifted``: the format's ``role_folds``,
    :func:`chatgrammar.conformance.folds.moved`), and the format said so at mask time."""
    told = any(issubclass(w.category, DeviationWarning) for w in said)
    return told and all(_UNTYPED in p or _at(p) in shifted for p in problems)


def _at(problem: str) -> int | None:
    """The char a problem is at (``"… char 167 …"``), or None."""
    m = re.search(r"\bchar (\d+)", problem)
    return int(m.group(1)) if m else None


def _shifted(fmt, R: str, case, conv) -> set[int]:
    """The chars of ``R`` that the template moved as the format declares (``role_folds``)."""
    folds = getattr(fmt.spec, "role_folds", None)
    if not folds:
        return set()
    found = moved(R, case.messages, case.outputs, conv)
    return {k for (src, dst), chars in found.items() if folds.get(src) == dst for k in chars}


def check_policies(fmt, result, *, policies: dict[str, MaskPolicy] | None = None,
                   synth: Any = None) -> dict[str, list[str]]:
    """Re-check every passing case of a conformance result under other mask policies.

    Args:
        fmt: the format the result was checked with.
        result: its :class:`~chatgrammar.conformance.templates.ConformanceResult` (the cases
            of the built-in matrix).
        policies: name -> policy (default :data:`POLICIES`).
        synth: the marker tokenizer for id mode (default: the format's).

    Returns:
        Policy name -> ``["case: problem", …]`` (empty: every passing case trains right
        under that policy). A problem the format warned about at mask time (tool calls or
        reasoning it declares written as plain text, ``plain_text_tool_calls`` /
        ``plain_text_reasoning``; text its template moves into another role's turn, the
        format's ``role_folds``: a
        :class:`~chatgrammar.DeviationWarning`) reads ``"case: warned: problem"``
        (:func:`is_warned`): wrong, never silent.

    Example:
        >>> check_policies(load_format("qwen3"), check_template(fmt, tpl))  # doctest: +SKIP
        {'thinking=False': [], 'tool_calls=False': [], ...}
    """
    from .templates import MarkerTokenizer, OUTPUT_POLICY, parses_of

    policies = POLICIES if policies is None else policies
    synth = synth or MarkerTokenizer.for_format(fmt)
    out: dict[str, list[str]] = {name: [] for name in policies}
    for res in result.cases:
        if res.status != "pass" or res.text is None:
            continue
        R, case = res.text, shared_case(res.case)  # (only read)
        # (the check that passed the case parsed it in both modes: those parses, else anew)
        conv, parsed = parses_of(fmt, R, synth) or (fmt.parse(R), _id_parse(fmt, R, synth))
        base = _chars(merge_spans((s.start, s.end) for s in conv.spans(OUTPUT_POLICY)))
        shifted = _shifted(fmt, R, case, conv)
        for name, policy in policies.items():
            # what the format says at mask time (a plain-text tool-call DeviationWarning)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always", DeviationWarning)
                got = _chars(merge_spans((s.start, s.end) for s in conv.spans(policy)))
                problems = policy_problems(name, R, got, base, case, res, conv, fmt)
                ids_problem = _id_problems(fmt, parsed, synth, policy, got)
            if ids_problem:
                problems.append(ids_problem)
            if problems:
                more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
                mark = WARNED if _warned(problems, said, shifted) else ""
                out[name].append(f"{res.case}: {mark}{problems[0]}{more}")
    return out
