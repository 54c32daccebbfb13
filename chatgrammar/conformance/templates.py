"""Template conformance: does a format parse what a real chat template renders, and train
exactly the assistant output?

:func:`check_template` renders every conversation of the built-in matrix
(:mod:`chatgrammar.conformance.matrix`) with a real Jinja chat template (:mod:`chatgrammar.conformance.render`, byte for
byte as transformers renders), parses each rendering with the format, and compares what the
format trains with what the template says the assistant produced. Shapes the template rejects
(it raises on them) are skipped and reported with the template's reason.

The expected spans come from the template alone, by render-diffing (never from the spec):

- message ``i`` occupies ``[len(B_i), len(B_i+1))`` of the full rendering ``R``, where ``B_k``
  is the rendering of the first ``k`` messages (when ``R`` starts with it; a template that
  renders a message differently once later messages exist — Kimi-K2-Thinking drops history
  reasoning — falls back to the parsed turn's extent, and says so in the case's notes; a
  message rendered as several consecutive assistant turns, such as a Harmony analysis message
  and the final answer, is located as that run of turns). Whitespace that ends ``B_k`` with or
  without a generation prompt but is not in ``R`` (R1-Distill-Qwen's ``"\n"`` after
  ``<｜tool▁outputs▁end｜>``) is the end of the prompt: message ``k`` starts where ``R`` leaves
  ``B_k``;
- the assistant output starts after the template's generation prompt ``g_i`` (the difference
  between ``B_i`` rendered with and without ``add_generation_prompt``; where the message is
  rendered with less than that — a prefilled ``<think>\n`` that history turns do not repeat —
  the part they share). A format may start training earlier only at a marker of ``g_i`` that
  opens a block of the body (a think block, Kimi-K3's ``<|open|>think<|sep|>``): that tail of
  the prompt is a *prefill* of the assistant's own structure. Training the role header fails;
- the output runs to the end of the message's region, trailing whitespace excluded, with the
  end-of-turn terminator included when the policy trains it (``end_marker``); with the default
  policy the terminator is the format's ``end`` span, which must lie at the very end of the
  region and contain none of the assistant's words;
- nothing outside the assistant messages trains (system, user and tool messages, text the
  template adds before the first message, a trailing generation prompt);
- a difference a format makes on purpose, in the precise shape its test facts name
  (``accepted:`` in ``formats/<name>.tests.yaml``, :data:`DEVIATION_SHAPES`), passes with
  ``CaseResult.deviations`` (and a note) saying so.

Every case also runs in id mode with :class:`MarkerTokenizer` (each marker one id, every other
character one id), and with a real tokenizer when one is given: both must agree with text mode.

Example:
    >>> from chatgrammar.core.registry import load_format
    >>> res = check_template(load_format("kimi-k2"), open("moonshotai-Kimi-K2.jinja").read())
    ... # doctest: +SKIP
    >>> res.ok, res.counts()                                         # doctest: +SKIP
    (True, {'pass': 20, 'fail': 0, 'skip': 0})
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from ..core.memo import LRU, PerObject
from ..errors import ParseError
from ..runtime.format import Format
from .format_tests import ACCEPTED_SHAPES, tests_for
from .matrix import MatrixCase, shared_matrix
from ..runtime.policy import MaskPolicy
from .render import (RenderTimeout, TemplateError, compile_template, render_chat,
                     special_token_vars)
from ..runtime.spans import merge_spans

__all__ = ["MarkerTokenizer", "CaseResult", "ConformanceResult", "check_template",
           "encode_text", "marked", "OUTPUT_POLICY"]

OPEN_MARK, CLOSE_MARK = "\u27e6", "\u27e7"   # ⟦ ⟧, as in embedded examples

#: What "the assistant output" means here: every assistant block (reasoning and tool calls
#: included), terminator excluded — whatever the format's own default policy says.
OUTPUT_POLICY = MaskPolicy(roles=("assistant",), thinking=True, tool_calls=True,
                           end_marker=False, last_turn_only=False, truncated=True)
_WITH_END = OUTPUT_POLICY.replace(end_marker=True)

#: Differences from "train exactly the assistant output" that a format may make on purpose.
#: A format accepts one only by naming it, with where it is documented, under ``accepted:`` in
#: its test facts (``formats/<name>.tests.yaml``, :mod:`chatgrammar.conformance.format_tests`). The checker
#: reports it (``CaseResult.deviations`` and a note), never as a pass without a word, and only
#: in the precise shape named:
#:
#: ``repeated-prompt``: one message the template renders as several turns of the assistant,
#: each later turn opening with exactly the template's generation prompt (e.g. an analysis
#: message, then the assistant header again and the final answer or a tool call), after
#: nothing but the whitespace the template writes between turns (HyperCLOVA X's "\n"). The
#: model writes that repeated opener itself, but the format trains every turn from after its
#: role, as it does after the generation prompt: which turn follows which is not part of one
#: turn's parse, and a turn's spans never depend on its neighbours.
#:
#: ``unclosed-whitespace``: an assistant turn the template never closes (a tool-use template
#: that writes no terminator after a tool-calling message, a layout with no terminator at all)
#: ends where the next turn opens, or where the rendering ends, and the whitespace the template
#: writes before that opener (or after the last message) trains with the body: with no
#: terminator, the parse cannot tell the template's separator from the model's last
#: characters.
DEVIATION_SHAPES = ACCEPTED_SHAPES


# --------------------------------------------------------------------------- tokenizer

class MarkerTokenizer:
    """A minimal-protocol tokenizer built from a spec's markers, so that id mode can be checked
    without a real tokenizer: each marker string is one id (ids ``0..k-1``), every other
    character is one id (``k + ord(char)``).

    Args:
        markers: the marker strings (a spec's ``markers[*].text``).

    Example:
        >>> tok = MarkerTokenizer(["<a>", "<b>"])
        >>> ids, starts = tok.encode_with_offsets("<a>hi<b>")
        >>> tok.decode(ids), starts
        ('<a>hi<b>', [0, 3, 4, 5])
    """

    def __init__(self, markers: Iterable[str]):
        texts = sorted(set(markers))
        self.marker_ids = {t: i for i, t in enumerate(texts)}
        self.by_id = {i: t for t, i in self.marker_ids.items()}
        self.base = len(texts)
        by_len = sorted(texts, key=len, reverse=True)
        self._rx = re.compile("|".join(re.escape(t) for t in by_len)) if texts else None

    @classmethod
    def for_format(cls, fmt: Format) -> "MarkerTokenizer":
        """The tokenizer for a format's markers: one object per Format (held weakly), so
        every check of that format (each :func:`check_template` case, then
        :func:`~chatgrammar.conformance.policies.check_policies`) meets the same tokenizer
        and reuses the format's id lexer and fast-path memo for it. A minimal-protocol
        object has no readable vocabulary, so the format keys its per-tokenizer state by the
        object: a new one per call rebuilt the lexer and masker each time. The object holds
        only the marker table (it never changes), so sharing it is safe."""
        if cls is not MarkerTokenizer:
            return cls(m.text for m in fmt.spec.markers.values())
        return _SYNTHS(fmt)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of a marker string or of one character; None otherwise."""
        if token in self.marker_ids:
            return self.marker_ids[token]
        if len(token) == 1:
            return self.base + ord(token)
        return None

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        """Ids back to text (exact inverse of :meth:`encode`)."""
        out = []
        for i in ids:
            i = int(i)
            if i < self.base:
                out.append(self.by_id.get(i, "\ufffd"))
            else:
                try:
                    out.append(chr(i - self.base))
                except (ValueError, OverflowError):
                    out.append("\ufffd")
        return "".join(out)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """``(ids, start char of each id)``; marker strings anywhere in ``text`` become marker
        ids (as a tokenizer splitting special tokens out of the text does)."""
        ids: list[int] = []
        starts: list[int] = []
        pos = 0
        matches = self._rx.finditer(text) if self._rx else ()
        shift = self.base.__add__  # (the text between markers is mapped at C speed)
        for m in list(matches) + [None]:
            end = m.start() if m is not None else len(text)
            ids.extend(map(shift, map(ord, text[pos:end])))
            starts.extend(range(pos, end))
            if m is not None:
                ids.append(self.marker_ids[m.group()])
                starts.append(m.start())
                pos = m.end()
        return ids, starts

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return self.encode_with_offsets(text)[0]


#: The marker tokenizer of each Format object (MarkerTokenizer.for_format).
_SYNTHS = PerObject(lambda fmt: MarkerTokenizer(m.text for m in fmt.spec.markers.values()))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Tokenise a rendered conversation the way training pipelines do: special tokens written
    by the template become their special ids, nothing is added (no BOS)."""
    enc = getattr(tokenizer, "encode", None)
    if type(tokenizer).__name__ == "Encoding" and hasattr(tokenizer, "special_tokens_set"):
        return list(tokenizer.encode(text, allowed_special="all"))
    try:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except TypeError:
        return list(enc(text))



# --------------------------------------------------------------------------- results

@dataclass
class CaseResult:
    """One matrix case rendered with one template.

    Attributes:
        case: the case name.
        status: ``"pass"``, ``"fail"`` or ``"skip"`` (the template rejects this shape).
        reason: one line: why it failed or was skipped (empty on pass).
        details: for a failure, the conversation and the rendering with the expected and the
            found trained spans marked ``⟦…⟧``.
        text: the rendering (None when skipped).
        expected: expected trained spans (char offsets, half-open, merged).
        found: spans the format trains under :data:`OUTPUT_POLICY` (merged).
        notes: remarks that are not failures (prefill trained, region located by the parse,
            boundaries inside merged tokens, documented deviations).
        deviations: differences from the assistant output that the format makes on purpose
            and documents (``accepted:`` of its tests.yaml); the case still passes.
        regions: of a passing case, each assistant message located from the template alone,
            ``(message, region start, output start, earliest training start, output end)``
            (what :mod:`chatgrammar.conformance.policies` checks the other policies against).
        message_starts: of a passing case, message ``k`` -> where it starts in the rendering
            (the length of the rendering of the first ``k`` messages; None where the template
            renders them differently once later ones exist).
    """

    case: str
    status: str
    reason: str = ""
    details: str = ""
    text: str | None = None
    expected: list = field(default_factory=list)
    found: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    deviations: list = field(default_factory=list)
    regions: list = field(default_factory=list)
    message_starts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"case": self.case, "status": self.status, "reason": self.reason,
                "details": self.details, "text": self.text,
                "expected": [list(s) for s in self.expected],
                "found": [list(s) for s in self.found], "notes": list(self.notes),
                "deviations": list(self.deviations)}


@dataclass
class ConformanceResult:
    """A format checked against one template over the matrix.

    Attributes:
        format: the format name.
        template: the template's name (file name).
        cases: one :class:`CaseResult` per matrix case, in matrix order.
        tokenizer: the real tokenizer also checked (its path), or None.
        error: set when nothing could be checked (the template does not compile).
    """

    format: str
    template: str
    cases: list[CaseResult] = field(default_factory=list)
    tokenizer: str | None = None
    error: str | None = None

    def counts(self) -> dict[str, int]:
        """``{"pass": n, "fail": n, "skip": n}``."""
        out = {"pass": 0, "fail": 0, "skip": 0}
        for c in self.cases:
            out[c.status] = out.get(c.status, 0) + 1
        return out

    @property
    def ok(self) -> bool:
        """No case failed and the template compiled."""
        return self.error is None and all(c.status != "fail" for c in self.cases)

    def summary(self) -> str:
        """``kimi-k2 × moonshotai-Kimi-K2.jinja: 20 pass, 0 fail, 0 skipped``."""
        if self.error:
            return f"{self.format} × {self.template}: {self.error}"
        c = self.counts()
        return (f"{self.format} × {self.template}: {c['pass']} pass, {c['fail']} fail, "
                f"{c['skip']} skipped")

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"format": self.format, "template": self.template, "tokenizer": self.tokenizer,
                "ok": self.ok, "error": self.error, "counts": self.counts(),
                "cases": [c.to_dict() for c in self.cases]}


# --------------------------------------------------------------------------- helpers

def marked(text: str, spans: Iterable[tuple[int, int]], open_: str = OPEN_MARK,
           close: str = CLOSE_MARK) -> str:
    """``text`` with each span wrapped in ``⟦ ⟧`` (the embedded-example notation).

    Example:
        >>> marked("abcdef", [(1, 3)])
        'a⟦bc⟧def'
    """
    out, pos = [], 0
    for s, e in sorted(spans):
        out.append(text[pos:s])
        out.append(open_ + text[s:e] + close)
        pos = e
    out.append(text[pos:])
    return "".join(out)


_merge = merge_spans  # (the one span-merge helper, chatgrammar.runtime.spans)


def _clip(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if min(e, hi) > max(s, lo)]


def _show(s: str, limit: int = 60) -> str:
    r = repr(s)
    return r if len(r) <= limit else r[:limit - 4] + "...'"


def _describe_message(i: int, m: dict) -> str:
    role = m.get("role", "?")
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    parts = []
    if m.get("reasoning_content"):
        parts.append(f"reasoning={_show(m['reasoning_content'], 50)}")
    if content:
        parts.append(_show(content, 70))
    for c in m.get("tool_calls") or ():
        fn = c.get("function", {})
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        parts.append(f"call {fn.get('name')}({args})")
    if role == "tool":
        parts.insert(0, f"[{m.get('tool_call_id')}]")
    return f"    [{i}] {role}: " + (" ".join(parts) if parts else "(empty)")


def _indent(text: str, pad: str = "      ") -> str:
    return "\n".join(pad + line for line in text.split("\n"))


def _mask_of(spans: Iterable[tuple[int, int]], n: int) -> bytearray:
    m = bytearray(n)
    for s, e in spans:
        m[s:e] = b"\x01" * (e - s)
    return m


# --------------------------------------------------------------------------- the oracle

def _named(variables: dict, template: str) -> dict:
    """The variables whose name the template's source contains."""
    return {k: v for k, v in variables.items() if not isinstance(k, str) or k in template}


class _RenderMemo(LRU):
    """Renderings of matrix conversations, shared by every check of the same template in this
    process: detection verifies candidates, inference verifies its variants, then the chosen
    format is checked again, each over the same renderings of the same template (about half of
    a wild template's renders were repeats). A rendering depends on the template's source, the
    messages, tools, flags and variables only, so that is the key (by content; nothing of the
    caller's is kept, the entries are strings); bounded (least recently used out). Not memoised:
    a template that reads the clock (``strftime_now``) or draws at random (``random``), and a
    render that timed out (a longer limit may finish it)."""

    MAX = 4096

    def __init__(self) -> None:
        super().__init__(self.MAX)

    @staticmethod
    def key_of(template: str, case: MatrixCase, variables: dict) -> tuple | None:
        """The content key of (template, case, variables), or None where renders vary. Of the
        variables and switches, only those the template's source names are in the key: Jinja
        looks a variable up only by a name written in the source (the sandbox reaches no
        context by other means), so one it never names cannot change a rendering (detection
        tries up to six variable sets; a template that prints no ``bos_token`` renders the
        same under each)."""
        if "strftime_now" in template or "random" in template:
            return None
        try:
            what = json.dumps([case.messages, case.tools, _named(case.template_kwargs, template),
                               _named(variables, template)], sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError):  # not plain JSON: no reliable content key
            return None
        return (template, what)

    def render(self, key: tuple | None, k: int, agp: bool, extra: tuple, render: Any) -> tuple:
        """``("ok", text)`` or ``("error", kind, message, lineno)`` (``kind`` a TemplateError
        kind, or ``"value"`` / ``"type"`` for ValueError / TypeError) of ``render()``, memoised
        under ``key`` (None: not memoised); a RenderTimeout propagates (and is counted in
        :data:`_TIMEOUTS`)."""
        full = None if key is None else key + (k, agp, extra)
        if full is not None:
            hit = self.get(full)
            if hit is not None:
                return hit
        try:
            out: tuple = ("ok", render())
        except RenderTimeout:
            _TIMEOUTS[0] += 1
            raise
        except TemplateError as exc:
            out = ("error", exc.kind, exc.message, exc.lineno)
        except (ValueError, TypeError) as exc:
            out = ("error", "value" if isinstance(exc, ValueError) else "type", str(exc), None)
        if full is not None:
            self.put(full, out)
        return out


#: Renders that ran out of time in this process, ever: a case check that met one is not kept
#: by :data:`_CHECKS` (a longer limit, or a less loaded machine, may finish it).
_TIMEOUTS = [0]
#: Case checks that may have tried the variables' values as closing tails (_message_starts),
#: ever: such a check is kept by :data:`_CHECKS` for the same variables only.
_TAILS_READ = [0]


_RENDERS = _RenderMemo()


class _Renderer:
    """Renders prefixes of one case with one template (memoised, and shared through
    :data:`_RENDERS` with other checks of the same template)."""

    def __init__(self, template: str, case: MatrixCase, variables: dict, timeout: float | None):
        self.template, self.case, self.variables, self.timeout = template, case, variables, \
            timeout
        self._memo: dict = {}
        self._key = _RenderMemo.key_of(template, case, variables)

    def __call__(self, k: int, agp: bool = False, extra: dict | None = None) -> str | None:
        key = (k, agp, tuple(sorted((extra or {}).items())))
        if key not in self._memo:
            kwargs = {**self.variables, **self.case.template_kwargs, **(extra or {})}
            try:
                got = _RENDERS.render(self._key, k, agp, key[2], lambda: render_chat(
                    self.template, self.case.messages[:k], tools=self.case.tools,
                    add_generation_prompt=agp, timeout=self.timeout, **kwargs))
            except RenderTimeout:
                got = ("error",)
            self._memo[key] = got[1] if got[0] == "ok" else None
        return self._memo[key]


def _fixed_suffix(renders: Sequence[str], openers: "_Openers",
                  marker_rx: re.Pattern | None) -> str:
    """Text a template writes after the messages whatever they are: the common suffix of the
    renderings of every prefix of the conversation, from its first turn opener on (Command
    R+'s closing instruction turn, the `<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>` Command R7B's
    tool-use template always ends with). It belongs to no message. Empty when fewer than two
    renderings, or when the common suffix holds no turn opener (a turn's own terminator)."""
    if len(renders) < 2 or marker_rx is None:
        return ""
    cs = os.path.commonprefix([b[::-1] for b in renders])[::-1]
    for m in marker_rx.finditer(cs):
        if m.group() in openers.turn:
            return cs[m.start():]
    return ""


def _snap_into_marker(g: str, p: int, marker_rx: re.Pattern | None) -> int:
    """A cut point inside a marker string moves back to the marker's start."""
    if marker_rx is not None:
        for m in marker_rx.finditer(g):
            if m.start() < p < m.end():
                return m.start()
    return p


def _generation_prompt(r: _Renderer, i: int, cut: int | None = None) -> str | None:
    """What ``add_generation_prompt`` appends after the first ``i`` messages (``cut``: where
    the messages' own rendering ends, when the template closes it with a tail)."""
    b, g = r(i), r(i, True)
    if b is None or g is None:
        return None
    n = len(b) if cut is None else cut
    if g.startswith(b[:n]):
        return g[n:]
    k = len(os.path.commonprefix([b[:n], g]))
    if cut is None and b[k:].isspace():
        # whitespace the template prints at the very end whether or not a prompt follows
        # (Unsloth's one-line templates): the prompt is what follows the shared part
        return g[k:]
    if n and g.count(b[:n]) == 1 and g.index(b[:n]) > 0:
        # a turn the template writes in front only when a prompt follows (MuseGlimmer's
        # default system message, printed with a generation prompt or tools): the messages'
        # own rendering is intact inside, and the prompt is what follows it
        return g[g.index(b[:n]) + n:]
    return None


def _prefix_in(b: str | None, R: str, marker_rx: re.Pattern | None,
               tails: Sequence[str] = (), g: str | None = None) -> tuple[int | None, str]:
    """How much of ``b`` (a rendering of the first messages) the full rendering ``R`` starts
    with: all of it, or all but a closing tail a template adds only when no generation prompt
    follows (Phi-3's EOS). A tail counts only if ``g`` (the same messages rendered with
    ``add_generation_prompt``) confirms it: ``g`` continues where ``b`` minus the tail ends, and
    does not contain the tail there. Candidates: ``tails`` (the special-token variables), then
    any tail ``R`` ends with too. Returns (length or None, the tail)."""
    if b is None:
        return None, ""
    if R.startswith(b):
        return len(b), ""
    if g is None or g.startswith(b):
        # Whitespace a template prints at the very end of a rendering whether or not a
        # generation prompt follows (R1-Distill-Qwen's "\n" after <｜tool▁outputs▁end｜>) is the
        # tail of the prompt, absent once the next message is rendered: that message starts
        # where R leaves b.
        k = len(os.path.commonprefix([b, R]))
        if b[k:].isspace():
            return k, ""
        return None, ""

    def ok(cut: int) -> bool:
        if not (R.startswith(b[:cut]) and g.startswith(b[:cut])):
            return False
        # never cut inside a marker
        return marker_rx is None or not any(m.start() < cut < m.end()
                                            for m in marker_rx.finditer(b))

    for t in tails:
        if t and b.endswith(t) and ok(len(b) - len(t)):
            return len(b) - len(t), t
    if marker_rx is not None:
        # a closing tail of markers only, that no variable names (a literal '<|endoftext|>'
        # or '<|loss_start|><|im_end|><|loss_end|>' in `{% else %}`), while R ends with the
        # prompt: where b and g part, from a marker's start on
        k = _snap_into_marker(b, len(os.path.commonprefix([b, g])), marker_rx)
        if 0 < k < len(b) and ok(k) and not marker_rx.sub("", b[k:]).strip():
            return k, b[k:]
    n = 0
    while n < len(b) and n < len(R) and b[-1 - n] == R[-1 - n]:
        n += 1
    for L in range(1, n + 1):
        if ok(len(b) - L):
            return len(b) - L, b[len(b) - L:]
    return None, ""


def _switch_before_header(g: str, m: str, marker_rx: re.Pattern | None) -> int:
    """Where the header starts in a generation prompt ``g`` that writes a switch before it,
    which history replies lack (LongCat-Flash-Chat prompts with ``' /think_on ASSISTANT:'``
    and renders a reply ``' ASSISTANT:A'``): the offset ``j > 0`` of ``g`` from which it shares
    the most with the message's rendering ``m``, more than ``g``'s own start does, when that
    shared part holds more than whitespace and ``g[:j]`` is words (no marker). Else 0.
    Whatever ``g`` holds is prompt text, so the shared part is never output either."""
    def shared(j: int) -> int:
        return len(os.path.commonprefix([m[:len(g) - j], g[j:]]))

    base, best, at = shared(0), 0, 0
    for j in range(1, len(g)):
        k = shared(j)
        if k > best:
            best, at = k, j
    if not at or best <= base or not m[:best].strip() or not g[:at].strip():
        return 0
    return 0 if marker_rx is not None and marker_rx.search(g[:at]) else at


class _Openers:
    """Which marker strings are the role header of a turn (turn openers, header terminators,
    header markers) and which belong to the body's structure (everything else)."""

    def __init__(self, fmt: Format):
        spec = fmt.spec
        self.turn: set[str] = set()
        self.header: set[str] = set()
        for t in spec.top:
            el = spec.elements.get(t)
            if el is None:
                continue
            self.turn |= {spec.markers[o].text for o in el.open if o in spec.markers}
            h = el.header
            if h is not None:
                names = ([h.until] if h.until else []) + list(h.markers)
                self.header |= {spec.markers[n].text for n in names if n in spec.markers}
        nested = {c for el in spec.elements.values() for c in el.children}
        self.block_open = {spec.markers[o].text for n in nested if n in spec.elements
                           for o in spec.elements[n].open if o in spec.markers}
        self.all = {m.text for m in spec.markers.values()}

    def prefill_start(self, g: str, marker_rx: re.Pattern | None) -> int:
        """Where the generation prompt ``g`` stops being the role header: at the first marker,
        after the turn's own opener, that is not part of a turn header (a think block opening
        or closing, an XTML ``response`` element), with the whitespace just before it. What
        follows is a prefill of the assistant's own structure, which a format may train."""
        if marker_rx is None:
            return len(g)
        seen_turn = False
        for m in marker_rx.finditer(g):
            t = m.group()
            if t in self.turn and not seen_turn:
                seen_turn = True
                continue
            if m.start() > 0 and (t not in self.turn and t not in self.header
                                  or t in self.block_open):
                k = m.start()
                while k > 0 and g[k - 1].isspace():
                    k -= 1
                return k
        return len(g)

    def leading_glue(self, text: str, marker_rx: re.Pattern | None) -> int:
        """Length of the run of markers (and whitespace) a message's rendering starts with,
        up to the first marker that opens a body block."""
        if marker_rx is None:
            return 0
        k = 0
        while True:
            while k < len(text) and text[k].isspace():
                k += 1
            m = marker_rx.match(text, k)
            if m is None or m.group() in self.block_open:
                return k
            k = m.end()


# --------------------------------------------------------------------------- one case

def _render_case(template: str, case: MatrixCase, variables: dict,
                 timeout: float | None) -> "str | CaseResult":
    """The case rendered whole, or the CaseResult saying why it cannot be (skip / fail)."""
    try:
        got = _RENDERS.render(
            _RenderMemo.key_of(template, case, variables), len(case.messages),
            case.add_generation_prompt, (), lambda: render_chat(
                template, case.messages, tools=case.tools,
                add_generation_prompt=case.add_generation_prompt, timeout=timeout,
                **{**variables, **case.template_kwargs}))
    except RenderTimeout as exc:
        got = ("error", exc.kind, exc.message, exc.lineno)
    if got[0] == "ok":
        return got[1]
    _, kind, message, _lineno = got
    if kind in ("value", "type"):
        return CaseResult(case.name, "skip", f"cannot render: {message}")
    m = re.search(r"'(\w*_token)' is undefined", message)
    if kind == "undefined" and m:
        # not a shape the template rejects: a tokenizer variable the caller did not pass
        return CaseResult(case.name, "fail", f"the template needs the variable {m.group(1)!r} "
                          f"(a tokenizer special token): pass it (--var "
                          f"{m.group(1)}=...) or a tokenizer")
    return CaseResult(case.name, "skip", f"template rejects it: [{kind}] {message}")


def render_whole(template: str, case: MatrixCase, variables: dict,
                 timeout: float | None) -> str:
    """``case`` rendered whole with ``variables`` (the case's switches win), as
    :func:`chatgrammar.conformance.matrix.render_case` renders it, memoised in the renders
    every check of the template shares (:data:`_RENDERS`).

    Args:
        template: the Jinja source.
        case: the matrix case.
        variables: template variables (``bos_token`` …).
        timeout: per-render time limit in seconds.

    Returns:
        The rendering.

    Raises:
        TemplateError: the template rejects the case or fails (RenderTimeout included).
        ValueError, TypeError: as :func:`~chatgrammar.conformance.render.render_chat`.

    Example:
        >>> render_whole("{{ messages|length }}", get_case("basic"), {}, 10.0)  # doctest: +SKIP
        '3'
    """
    got = _RENDERS.render(
        _RenderMemo.key_of(template, case, variables), len(case.messages),
        case.add_generation_prompt, (), lambda: render_chat(
            template, case.messages, tools=case.tools,
            add_generation_prompt=case.add_generation_prompt, timeout=timeout,
            **{**variables, **case.template_kwargs}))
    if got[0] == "ok":
        return got[1]
    _, kind, message, lineno = got
    if kind == "value":
        raise ValueError(message)
    if kind == "type":
        raise TypeError(message)
    raise TemplateError(message, kind=kind, lineno=lineno)


def _message_starts(R: str, r: Any, n: int, variables: dict, openers: Any,
                    marker_rx: Any) -> tuple[dict, str, str]:
    """Where message k starts in R (None where the template renders the first k messages
    differently once later ones exist), the closing tail, and the fixed suffix.

    The start is the length of the rendering of the first k messages, less the closing tail
    some templates add when no generation prompt follows (Phi-3's EOS)."""
    B = {k: r(k) for k in range(1, n + 1)}
    P: dict[int, int | None] = {}
    tail = ""
    tails = sorted({v for v in variables.values() if isinstance(v, str) and v}, key=len,
                   reverse=True)
    suffix = _fixed_suffix([b for b in B.values() if b is not None], openers, marker_rx)
    for k in B:
        b = B[k]
        if suffix and b is not None and b.endswith(suffix) and \
                R.startswith(b[:len(b) - len(suffix)]):
            P[k] = len(b) - len(suffix)  # the fixed suffix belongs to no message
            continue
        # the rendering with a generation prompt only matters where R does not start with b
        # (_prefix_in reads it nowhere else): not rendered for the others
        g = None if b is None or R.startswith(b) else r(k, True)
        if g is not None:
            _TAILS_READ[0] += 1  # _prefix_in may try the tails (the variables' values)
        P[k], t = _prefix_in(b, R, marker_rx, tails, g)
        tail = tail or t
    return P, tail, suffix


def _assistant_runs(conv: Any) -> list[list]:
    """Runs of consecutive assistant turns: one message the template renders as several turns
    (Harmony: an analysis message, then the final answer or a tool call)."""
    runs: list[list] = []
    prev_asst = False
    for t in conv.turns:
        asst_turn = t.role == "assistant" and not t.generation_prompt
        if asst_turn and prev_asst:
            runs[-1].append(t)
        elif asst_turn:
            runs.append([t])
        prev_asst = asst_turn
    return runs


def _expected_spans(regions: list, found_end: list, end_spans: list) -> list:
    """Expected spans for display: each message's output, up to the format's terminator when
    it sits at the end."""
    expected: list[tuple[int, int]] = []
    for i, s0, start, allowed, end in regions:
        region_found = _clip(found_end, s0, end)
        a = region_found[0][0] if region_found and allowed <= region_found[0][0] <= start \
            else start
        z = end
        for es, ee in end_spans:
            if ee == end and a <= es <= end:
                z = es
        expected.append((a, z))
    return _merge(expected)


def _check_case(fmt: Format, template: str, case: MatrixCase, variables: dict,
                synth: MarkerTokenizer, tokenizer: Any, timeout: float | None,
                accepted: dict[str, str]) -> CaseResult:
    r = _Renderer(template, case, variables, timeout)
    R = _render_case(template, case, variables, timeout)
    if isinstance(R, CaseResult):  # the template rejects the case, or needs a variable
        return R
    conversation = "\n".join(_describe_message(i, m) for i, m in enumerate(case.messages))
    res = CaseResult(case.name, "pass", text=R)

    def fail(reason: str, extra: str = "") -> CaseResult:
        res.status = "fail"
        res.reason = reason
        lines = [f"  conversation ({case.description}):", conversation]
        if res.expected or res.found or extra == "":
            lines += ["  rendered, expected trained spans marked ⟦…⟧:",
                      _indent(marked(R, res.expected)),
                      "  rendered, spans the format trains marked ⟦…⟧:",
                      _indent(marked(R, res.found))]
        if extra:
            lines.append(extra)
        res.details = "\n".join(lines)
        return res

    parsed = _parse_modes(fmt, R, synth, tokenizer, res)
    if isinstance(parsed, tuple) and isinstance(parsed[0], str):
        return fail(*parsed)
    conv, conv_ids = parsed
    found = res.found
    found_end = _merge((s.start, s.end) for s in conv.spans(_WITH_END))
    end_spans = [(s.start, s.end) for s in conv.spans(_WITH_END) if s.kind == "end"]

    # ---- 4. expected spans, from the template alone
    loc = _Locator(template, case, variables, timeout, r, R, fmt, synth._rx)
    asst = [i for i, m in enumerate(case.messages) if m.get("role") == "assistant"]
    turns = [t for t in conv.turns if t.role == "assistant" and not t.generation_prompt]
    runs = _assistant_runs(conv)
    # (message, region start, output start, earliest allowed training start, output end)
    regions: list[tuple[int, int, int, int, int]] = []
    g_of: dict[int, str] = {}  # message -> its generation prompt (header) as located
    for k, i in enumerate(asst):
        span = loc.message_span(k, i, turns, runs, len(asst), res)
        if isinstance(span, str):
            return fail(span)
        region, g_of[i] = loc.region(i, *span, res)
        regions.append(region)

    res.expected = _expected_spans(regions, found_end, end_spans)
    turn_starts = {t.start for t in turns}
    problems = _outside_problems(R, found, regions, turns, accepted, res)
    problems += _message_problems(R, found, found_end, end_spans, regions, case.outputs, g_of,
                                  turn_starts, accepted, res)
    if problems:
        uniq = list(dict.fromkeys(problems))
        more = f" (+{len(uniq) - 1} more)" if len(uniq) > 1 else ""
        return fail(uniq[0] + more, "  problems:\n" + "\n".join("    - " + p for p in uniq))
    if conv_ids.boundaries:
        res.notes.extend(str(b) for b in conv_ids.boundaries)
    res.notes = list(dict.fromkeys(res.notes))
    res.regions, res.message_starts = regions, dict(loc.P)
    return res


#: Case checks by content, shared by every check in this process: detection verifies a
#: candidate over the matrix, then ``validate --template`` / ``tools/wild.py`` check the format
#: taken with the same template, variables and deviations again (inference re-verifies its
#: chosen spec the same way). Each entry is a private copy of a :class:`CaseResult`; a hit
#: hands out a fresh copy, so no caller sees another's objects.
_CHECKS = LRU(512)


#: What a case check reads of a format: its spec (the parse, the markers of id mode), hashed
#: once per Format object (held weakly).
_format_key = PerObject(lambda fmt: hashlib.sha256(
    fmt.spec.model_dump_json().encode("utf-8", "surrogatepass")).hexdigest())


def _copy_case(res: CaseResult) -> CaseResult:
    """A copy of a case result that shares nothing mutable with it (its items are tuples and
    strings)."""
    return replace(res, expected=list(res.expected), found=list(res.found),
                   notes=list(res.notes), deviations=list(res.deviations),
                   regions=list(res.regions), message_starts=dict(res.message_starts))


def _checked_case(fmt: Format, template: str, case: MatrixCase, variables: dict,
                  synth: MarkerTokenizer, tokenizer: Any, timeout: float | None,
                  accepted: dict[str, str]) -> CaseResult:
    """:func:`_check_case`, memoised by content in :data:`_CHECKS` (format spec, template,
    conversation, flags, the variables the template names, accepted deviations). Not
    memoised: a check with a real tokenizer, a template whose renders vary
    (:meth:`_RenderMemo.key_of`), and a check during which a render ran out of time (its
    answer depends on the limit and the machine's load).

    The other variables change no rendering; their values matter only as the closing tails
    :func:`_message_starts` tries where a rendering of the first messages is not a prefix of
    the whole one. An entry made without reading the tails serves any variables; one that
    read them, only the same variables.

    Likewise the accepted deviations matter only where the check looks one up (a turn
    without a terminator, a message rendered as several turns): an entry made without
    looking any up serves any accepted deviations (inference verifies its spec with its own,
    then ``validate`` / ``tools/wild.py`` check the format taken with the format's: the same
    answer wherever none was looked up); one that looked, only the same ones."""
    rkey = None if tokenizer is not None else _RenderMemo.key_of(template, case, variables)
    try:
        facts = json.dumps(variables, sort_keys=True, ensure_ascii=False)
        acc = json.dumps(accepted, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        rkey = None
    if rkey is None:
        return _check_case(fmt, template, case, variables, synth, tokenizer, timeout, accepted)
    base = rkey + (_format_key(fmt), case.name, case.description, case.add_generation_prompt)
    for key in (base + (None,), base + (acc,)):
        hit = _CHECKS.get(key)
        if hit is not None and hit[1] in (None, facts):
            return _copy_case(hit[0])
    timeouts, tails = _TIMEOUTS[0], _TAILS_READ[0]
    watched = _Watched(accepted)
    res = _check_case(fmt, template, case, variables, synth, tokenizer, timeout, watched)
    if _TIMEOUTS[0] == timeouts:
        _CHECKS.put(base + ((acc,) if watched.read else (None,)),
                    (_copy_case(res), None if _TAILS_READ[0] == tails else facts))
    return res


class _Watched(dict):
    """Accepted deviations that note whether a case check looked one up (``read``)."""

    read = False

    def __contains__(self, key: object) -> bool:
        self.read = True
        return dict.__contains__(self, key)

    def __getitem__(self, key: Any) -> Any:
        self.read = True
        return dict.__getitem__(self, key)


#: The latest renderings' parses in both modes, ``(format key, rendering) -> (synth, text-mode
#: Conversation, (ids, char bound of each id, id-mode Conversation))``:
#: :func:`chatgrammar.conformance.policies.check_policies` re-reads the passing cases of the
#: check just made, under five more policies, from the same parses (a parse does not depend
#: on the policy; the Conversations are only read). Bounded: a matrix's worth, and more.
_PARSES = LRU(64)


def parses_of(fmt: Format, R: str, synth: Any) -> tuple | None:
    """The parses of a rendering that a check of ``fmt`` just made in both modes with this
    ``synth`` (:data:`_PARSES`).

    Args:
        fmt: the format checked.
        R: the rendering.
        synth: the marker tokenizer of id mode (only the very object the check used counts).

    Returns:
        ``(conv, (ids, bounds, conv_ids))``: the text-mode Conversation, the ids, the char
        bound of each id (and the length) and the id-mode Conversation; None when no such
        parse is kept.

    Example:
        >>> parses_of(fmt, res.cases[0].text, MarkerTokenizer.for_format(fmt))  # doctest: +SKIP
        (Conversation(...), ([...], [...], Conversation(...)))
    """
    hit = _PARSES.get((_format_key(fmt), R))
    return hit[1:] if hit is not None and hit[0] is synth else None


def _parse_modes(fmt: Format, R: str, synth: MarkerTokenizer, tokenizer: Any,
                 res: CaseResult):
    """Steps 1–3 of a case: text mode, id mode with the marker tokenizer (must agree with text
    mode exactly), and a real tokenizer when given. Returns ``(conv, conv_ids)`` (and sets
    ``res.found``), or ``(reason, extra)`` of the failure."""
    try:
        conv = fmt.parse(R)
    except ParseError as exc:
        return (f"does not parse (text mode): {exc.message} at char {exc.offset}",
                "  rendered:\n" + _indent(R) + "\n  error:\n" + _indent(str(exc)))
    res.found = _merge((s.start, s.end) for s in conv.spans(OUTPUT_POLICY))
    ids, starts = synth.encode_with_offsets(R)
    try:
        conv_ids = fmt.parse_ids(ids, synth)
    except ParseError as exc:
        return (f"text mode parses but id mode does not: {exc.message} at token "
                f"{exc.offset}", "")
    bounds = starts + [len(R)]
    _PARSES.put((_format_key(fmt), R), (synth, conv, (ids, bounds, conv_ids)))
    for pol in (OUTPUT_POLICY, _WITH_END):
        a = _merge((s.start, s.end) for s in conv.spans(pol))
        b = _merge((bounds[s.start], bounds[s.end]) for s in conv_ids.spans(pol))
        if a != b:
            ma, mb = _mask_of(a, len(R)), _mask_of(b, len(R))
            at = next(k for k in range(len(R)) if ma[k] != mb[k])
            return (f"id mode (one id per marker) disagrees with text mode at char {at} "
                    f"({'trained' if mb[at] else 'not trained'} in id mode)", "")
    if tokenizer is not None:
        problem = _check_real_ids(fmt, tokenizer, R, conv, res)
        if problem:
            return (problem, "")
    return conv, conv_ids


class _Locator:
    """Where each assistant message of one rendering is, from the template alone: its span,
    the generation prompt that heads it, and where its output starts."""

    def __init__(self, template: str, case: MatrixCase, variables: dict,
                 timeout: float | None, r: "_Renderer", R: str, fmt: Format, marker_rx):
        self.template, self.variables, self.timeout = template, variables, timeout
        self.r, self.R, self.marker_rx = r, R, marker_rx
        self.openers = _Openers(fmt)
        self.P, self.tail, self.suffix = _message_starts(R, r, len(case.messages), variables,
                                                         self.openers, marker_rx)
        self.stable = {k: self.P[k] is not None for k in self.P}
        self._drop_unrendered_calls(case)
        self._generic_g: str | None = None

    def _drop_unrendered_calls(self, case: MatrixCase) -> None:
        """An assistant message whose tool calls the template drops while it is the last
        message (vLLM's Nemotron templates keep only its content there) is rendered in full
        only once later messages exist: the rendering of the messages up to it ends before
        its calls, so its end is located by the parse, not by that rendering."""
        R, P = self.R, self.P
        for out in case.outputs:
            k = out.message_index + 1
            s = P.get(k - 1) if k > 1 else 0
            if not out.tool_calls or not self.stable.get(k) or s is None:
                continue
            names = [c.name for c in out.tool_calls]
            if not any(nm in R[s:P[k]] for nm in names) and all(nm in R[P[k]:] for nm in names):
                self.stable[k] = False

    def message_span(self, k: int, i: int, turns, runs, n_asst: int,
                     res: CaseResult) -> tuple[int, int] | str:
        """Message ``i`` (the ``k``-th assistant message): ``(start, end)`` in the rendering,
        located by the parse where the template renders it differently once later messages
        exist; or the failure reason."""
        P, R = self.P, self.R
        s = P[i] if i >= 1 and self.stable.get(i) else None
        e = P[i + 1] if self.stable.get(i + 1) else None
        if e is not None and e == len(R) and self.tail and R.endswith(self.tail):
            e -= len(self.tail)  # the closing tail belongs to no message
        if s is None or e is None:
            if len(turns) == n_asst:
                first = last = turns[k]
            elif len(runs) == n_asst:
                first, last = runs[k][0], runs[k][-1]
            else:
                return (f"the template renders {n_asst} assistant message(s) but the "
                        f"format parses {len(turns)} assistant turn(s)")
            s = first.start if s is None else s
            e = last.end if e is None else e
            while e < len(R) and R[e].isspace():
                e += 1
            res.notes.append("some messages located by the parse (the template renders them "
                             "differently once later messages exist)")
        return s, e

    def _prompt(self, i: int) -> str:
        """The generation prompt before message ``i`` as the template writes it."""
        g = _generation_prompt(self.r, i, self.P.get(i)) if i >= 1 else None
        suffix = self.suffix
        if suffix and g is not None and g.startswith(suffix) and len(g) > len(suffix):
            # the prompt follows the fixed suffix (Command R+: the instruction turn, then
            # `<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>`); where the suffix is all the template
            # adds (Command R7B always prompts), the suffix is the prompt
            g = g[len(suffix):]
        if g is None:
            if self._generic_g is None:
                probe = MatrixCase("probe", "", [{"role": "user", "content": "x"}])
                gr = _Renderer(self.template, probe, self.variables, self.timeout)
                self._generic_g = _generation_prompt(gr, 1) or ""
            g = self._generic_g
        return g

    def region(self, i: int, s: int, e: int, res: CaseResult) -> tuple[tuple, str]:
        """``((i, start, output start, earliest training start, output end), header)`` of
        message ``i`` spanning ``R[s:e]``."""
        R, rx, openers = self.R, self.marker_rx, self.openers
        g = self._prompt(i)
        if not g and e > s:
            # the template renders the same with and without a generation prompt (Apriel
            # 1.6 forces one): the message's leading markers are its header
            g = R[s:s + openers.leading_glue(R[s:e], rx)].rstrip()
            if R.startswith("\n", s + len(g)):
                g += "\n"  # the header's own line end, not the body's leading whitespace
        if g[:1].isspace() and g.strip() and not R.startswith(g, s):
            # the prompt's leading whitespace differs from what the history writes before the
            # header (templates indented in Jinja: AmberChat writes "\n    ###Assistant:" as
            # its prompt and "\n        ###Assistant: " in history, qwen2-audio's prompt
            # starts with the newline the rendering without it ends with): that whitespace is
            # between-turn text either way, and the header is compared from its first
            # non-space character — where that shares more of the header than the whitespace
            # did (DeepSeek-V3.2's "\n\n<think></think>" prompt before a "\n\n</think>" reply
            # shares only the whitespace: the reply starts there)
            g2, s2 = g.lstrip(), s + len(R[s:e]) - len(R[s:e].lstrip())
            was = _snap_into_marker(g, len(os.path.commonprefix([R[s:s + len(g)], g])), rx)
            now = _snap_into_marker(g2, len(os.path.commonprefix([R[s2:s2 + len(g2)], g2])),
                                    rx)
            if now > was:
                g, s = g2, s2
        if g and not g[0].isspace():
            # whitespace before the message's header is between-turn text, not the message
            # (Unsloth's one-line templates write "  " before a turn, one " " of which ends
            # the rendering of the previous messages)
            while s < e and R[s].isspace() and not R.startswith(g, s):
                s += 1
        j = _switch_before_header(g, R[s:e], rx) if not R.startswith(g, s) else 0
        if j:
            res.notes.append(f"the generation prompt {_show(g)} writes {_show(g[:j])} before "
                             "the header the message is rendered with: prompt text, not output")
            g = g[j:]
        if not R.startswith(g, s):
            # The template prompts with more than it renders for this message (a prefilled
            # "<think>\n" that history turns do not repeat): the header is the common part.
            common = len(os.path.commonprefix([R[s:s + len(g)], g]))
            cut = _snap_into_marker(g, common, rx)
            if cut == 0:
                # nothing in common (a message glued to the previous one, e.g. opened by the
                # marker that closes the tool outputs): its leading markers are the header
                glue = openers.leading_glue(R[s:e], rx)
                if R[s:s + glue].isspace():
                    # only whitespace, no marker: the message's own leading text (vLLM's
                    # DeepSeek-V3 tool template indents every reply after the `<｜Assistant｜>`
                    # its previous message wrote, as its R1 template does after the prompt's)
                    glue = 0
                head, p = R[s:s + glue], glue
            else:
                head, p = g[:cut], min(openers.prefill_start(g, rx), cut)
            res.notes.append(f"the template prompts with {_show(g)} but renders the message "
                             f"with {_show(R[s:s + len(g)])}: header taken as {_show(head)}")
            g = head
        else:
            p = openers.prefill_start(g, rx)
        out_end = s + len(R[s:e].rstrip())
        return (i, s, s + len(g), s + p, max(out_end, s + len(g))), g


def _outside_problems(R: str, found, regions, turns, accepted: dict,
                      res: CaseResult) -> list[str]:
    """Nothing outside the assistant outputs trains (a trained header inside an assistant
    message is reported with that message): the problems, deviations recorded on ``res``."""
    problems: list[str] = []
    allowed_mask = _mask_of(((s0, end) for _, s0, _, _, end in regions), len(R))
    for s, e in found:
        bad = [k for k in range(s, e) if not allowed_mask[k]]
        if bad:
            k0 = bad[0]
            k1 = k0
            while k1 < e and not allowed_mask[k1]:
                k1 += 1
            unclosed = [t for t in turns if t.start < k0 and t.end == k1 and not t.complete]
            if (R[k0:k1].isspace() and k0 > 0 and allowed_mask[k0 - 1] and unclosed
                    and "unclosed-whitespace" in accepted):
                _deviate(res, f"the assistant turn at char {unclosed[0].start} has no "
                         f"terminator: {_show(R[k0:k1])} before the next turn trains with it "
                         f"({accepted['unclosed-whitespace']})")
                continue
            problems.append(f"trains text outside the assistant messages at char {k0}: "
                            f"{_show(R[k0:k1])}")
            break

    return problems


def _message_problems(R: str, found, found_end, end_spans, regions, outputs, g_of: dict,
                      turn_starts: set, accepted: dict, res: CaseResult) -> list[str]:
    """Each assistant message trains exactly its output: from after the generation prompt (or
    an allowed prefill) to its end, its words included, the terminator only as the format's
    end span. The problems, deviations recorded on ``res``."""
    problems: list[str] = []
    for (i, s0, start, allowed, end), case_out in zip(regions, outputs):
        with_end = _clip(found_end, s0, end)
        body = _clip(found, s0, end)
        if start >= end:
            continue  # nothing for the assistant to produce (and nothing trained: see above)
        if not with_end:
            problems.append(f"message [{i}] (assistant): nothing of it is trained; expected "
                            f"{_show(R[start:end])}")
            continue
        a, z = with_end[0][0], with_end[-1][1]
        for (_, gs), (ge, _) in zip(with_end, with_end[1:]):
            # the repeated opener may follow the whitespace the template writes between turns
            # (HyperCLOVA X's "<|im_end|>\n<|im_start|>assistant"): that separator is no
            # assistant word either, and it is left untrained like the opener
            ps = ge - len(g_of[i])
            if (g_of[i] and ps >= gs and R[ps:ge] == g_of[i] and not R[gs:ps].strip()
                    and ps in turn_starts and "repeated-prompt" in accepted):
                _deviate(res, f"message [{i}] (assistant) is rendered as several turns; each "
                         f"later one opens with the generation prompt {_show(g_of[i])}, "
                         f"untrained ({accepted['repeated-prompt']})")
                continue
            problems.append(f"message [{i}] (assistant): the trained text has a gap at chars "
                            f"{gs}-{ge}: {_show(R[gs:ge])}")
            break
        if a > start:
            problems.append(f"message [{i}] (assistant): training starts at char {a}, expected "
                            f"{start} (right after the generation prompt); untrained: "
                            f"{_show(R[start:a])}")
        elif a < allowed:
            problems.append(f"message [{i}] (assistant): its header is trained from char {a}: "
                            f"{_show(R[a:start])} (of the generation prompt, only a prefill of "
                            "the body's own structure, such as an opened think block, may be)")
        elif a < start:
            res.notes.append("trains the thinking prefill of the generation prompt too: "
                             f"{_show(R[a:start])}")
        if z != end:
            what = f"; untrained: {_show(R[z:end])}" if z < end else ""
            problems.append(f"message [{i}] (assistant): training (with the terminator) ends "
                            f"at char {z}, expected {end} (the end of the message){what}")
        # the words of the message must be trained (the terminator must not swallow them)
        zb = body[-1][1] if body else a
        for word in case_out.strings(reasoning=True):
            k = R.find(word, start, end)
            while k >= 0:
                if not any(bs <= k and k + len(word) <= be for bs, be in body):
                    problems.append(f"message [{i}] (assistant): {_show(word)} at char {k} is "
                                    "not trained")
                    break
                k = R.find(word, k + 1, end)
        if body and zb < end and R[zb:end].strip() and not any(
                es == zb for es, _ in end_spans):
            problems.append(f"message [{i}] (assistant): {_show(R[zb:end])} after the trained "
                            "text is neither trained nor the format's end-of-turn")
    return problems


def _deviate(res: CaseResult, dev: str) -> None:
    """Record an accepted deviation on the case (it still passes, with a note)."""
    res.deviations.append(dev)
    res.notes.append("documented deviation: " + dev)


def _check_real_ids(fmt: Format, tokenizer: Any, R: str, conv, res: CaseResult) -> str | None:
    """Id mode with a real tokenizer must train the same text as text mode."""
    from ..runtime.tokenizers import adapt

    ids = encode_text(tokenizer, R)
    try:
        conv_ids = fmt.parse_ids(ids, tokenizer)
    except ParseError as exc:
        return (f"text mode parses but id mode ({type(tokenizer).__name__}) does not: "
                f"{exc.message} at token {exc.offset}")
    ad = adapt(tokenizer)
    # a span's text is what the span adds to the decoding of the sample before it: decoding
    # a span alone drops its leading space with a SentencePiece decoder (Mistral's " reply" is
    # "▁reply", which decodes alone to "reply"), and byte-fallback pieces need their neighbours
    prefix: dict[int, str] = {}

    def upto(k: int) -> str:
        if k not in prefix:
            prefix[k] = ad.decode(ids[:k])
        return prefix[k]

    def span_text(a: int, b: int) -> str:
        head, whole = upto(a), upto(b)
        return whole[len(head):] if whole.startswith(head) else ad.decode(ids[a:b])

    by_turn_t: dict[int, str] = {}
    by_turn_i: dict[int, str] = {}
    for s in conv.spans(OUTPUT_POLICY):
        by_turn_t[s.turn] = by_turn_t.get(s.turn, "") + R[s.start:s.end]
    for s in conv_ids.spans(OUTPUT_POLICY):
        by_turn_i[s.turn] = by_turn_i.get(s.turn, "") + span_text(s.start, s.end)
    if list(by_turn_t.values()) != list(by_turn_i.values()):
        ta, ia = list(by_turn_t.values()), list(by_turn_i.values())
        for k in range(max(len(ta), len(ia))):
            x = ta[k] if k < len(ta) else None
            y = ia[k] if k < len(ia) else None
            if x != y:
                if conv_ids.boundaries and x is not None and y is not None and x in y:
                    res.notes.append("id mode trains a merged token across a boundary: "
                                     f"{_show(y)} vs {_show(x)}")
                    continue
                return (f"id mode ({type(tokenizer).__name__}) trains {_show(y or '')} where "
                        f"text mode trains {_show(x or '')}")
    res.notes.extend(f"id mode: {b}" for b in conv_ids.boundaries)
    return None


# --------------------------------------------------------------------------- public entry

def check_template(fmt: Format, template: str, *, name: str = "template",
                   cases: Sequence[MatrixCase] | None = None, tokenizer: Any = None,
                   tokenizer_name: str | None = None, variables: dict | None = None,
                   timeout: float | None = 10.0,
                   accepted: dict[str, str] | None = None,
                   refused: dict[str, str] | None = None) -> ConformanceResult:
    """Check one (format, chat template) pair over the conversation matrix.

    Args:
        fmt: the format (``load_format("kimi-k3")``).
        template: the Jinja source of the chat template.
        name: what to call the template in results (its file name).
        cases: the matrix cases (default: :func:`chatgrammar.conformance.matrix.default_matrix`).
        tokenizer: a real tokenizer to check id mode with as well (optional). Its special
            tokens map (``bos_token``…) is passed to the template, as transformers does.
        tokenizer_name: what to call the tokenizer in results.
        variables: extra template variables (``bos_token="<s>"``…); they override the
            tokenizer's.
        timeout: per-render time limit in seconds.
        accepted: deviation shape -> where it is documented (:data:`DEVIATION_SHAPES`); default
            the ``accepted:`` of the format's test facts (``<spec>.tests.yaml`` beside its spec
            file, :func:`chatgrammar.conformance.format_tests.tests_for`), none for a format without them.
        refused: matrix case -> why the format refuses that shape on purpose; default the
            ``refused:`` of the format's test facts. Such a case is reported ``"skip"`` when it
            fails safely (a located ParseError, or training only part of the assistant output
            plus whitespace) and stays a failure otherwise.

    Returns:
        A :class:`ConformanceResult`; ``.ok`` is False when a case fails. A template that does
        not compile gives a result with ``error`` set and no cases.

    Example:
        >>> res = check_template(load_format("kimi-k3"), k3_template, name="Kimi-K3.jinja")
        ... # doctest: +SKIP
        >>> [c.case for c in res.cases if c.status == "fail"]   # doctest: +SKIP
        []
    """
    out = ConformanceResult(fmt.name, name, tokenizer=tokenizer_name)
    try:
        compile_template(template)
    except TemplateError as exc:
        out.error = f"template does not compile: {exc}"
        return out
    vars_ = {**special_token_vars(tokenizer), **(variables or {})}
    synth = MarkerTokenizer.for_format(fmt)
    if accepted is None:
        accepted = dict(tests_for(fmt).get("accepted") or {})
    if refused is None:
        refused = dict(tests_for(fmt).get("refused") or {})
    default = cases is None
    if cases is None:
        cases = shared_matrix(content_shape(fmt))
    for _ in range(2):
        for case in cases:
            try:
                res = _checked_case(fmt, template, case, vars_, synth, tokenizer, timeout,
                                    accepted)
            except Exception as exc:  # one broken case must not hide the others' results
                res = CaseResult(case.name, "fail", f"error while checking this case: "
                                 f"{type(exc).__name__}: {exc}")
            out.cases.append(_refusal(res, refused))
        if not (default and content_shape(fmt) == "string" and _reads_sharegpt(out.cases)):
            break
        # a ShareGPT template (`message['from'] == 'human'`, `message['value']`) rejects every
        # case: checked again with the messages also in those keys, as its data gives them
        cases, out.cases = shared_matrix("sharegpt"), []
    return out


_SHAREGPT_KEY = re.compile(r"has no attribute '(?:from|value)'")


def _reads_sharegpt(cases: Sequence[CaseResult]) -> bool:
    """The template rejected every case for want of ShareGPT's ``from`` / ``value`` keys."""
    return bool(cases) and all(c.status == "skip" for c in cases) and \
        any(_SHAREGPT_KEY.search(c.reason or "") for c in cases)


def content_shape(fmt: Format) -> str:
    """How the matrix gives message content to a format's template: ``"parts"`` for a format
    verified on content as lists of text parts (an inferred format whose template prints
    content only so: ``verification.content``; a saved one's ``content: parts`` test fact),
    ``"sharegpt"`` for one verified on messages in ShareGPT's ``from`` / ``value`` keys, else
    ``"string"``.

    Args:
        fmt: a format.

    Returns:
        ``"string"``, ``"parts"`` or ``"sharegpt"``
        (:func:`chatgrammar.conformance.matrix.default_matrix`).
    """
    shape = getattr(getattr(fmt, "verification", None), "content", None) or \
        tests_for(fmt).get("content")
    return shape if shape in ("parts", "sharegpt") else "string"


def _refusal(res: CaseResult, refused: dict[str, str]) -> CaseResult:
    """A failing case the format refuses on purpose (``refused:`` of its test facts) becomes a
    skip — only when it failed safely: it does not parse (a located ParseError), or what it
    trains is inside the assistant output apart from whitespace. Anything else stays a failure:
    a refusal never excuses training another message's text."""
    if res.status != "fail" or res.case not in refused:
        return res
    if "does not parse" not in res.reason:
        extra = {i for a, b in res.found for i in range(a, b)} - {
            i for a, b in res.expected for i in range(a, b)}
        if res.text is None or not all(res.text[i].isspace() for i in extra):
            return res
    return CaseResult(res.case, "skip", f"refused by the format ({refused[res.case]}): "
                      f"{res.reason}", res.details, res.text, res.expected, res.found, res.notes,
                      res.deviations)
