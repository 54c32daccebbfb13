"""Infer a verified format spec from a chat template (:func:`infer_format`).

A chat template is a function from conversations to text. Rendered (in the sandbox of
:mod:`chatgrammar.conformance.render`, exactly as transformers renders) on conversations whose every value
is a unique sentinel, whatever is not a sentinel is the template's scaffolding. Comparing the
scaffolding across probes gives each role's header and terminator, the text between turns, the
BOS / preamble / default system prompt, the generation prompt, and the reasoning and tool-call
wrappers. From them a spec is written in the ordinary spec language (YAML), compiled strictly
and checked against the same template over the ``validate --template`` matrix
(:func:`chatgrammar.conformance.templates.check_template`) before it is returned. Whatever cannot be
captured raises :class:`~chatgrammar.errors.InferenceError`. See docs/inference.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import ChatGrammarError, DeviationWarning, InferenceError
from ..runtime.format import Format
from .render import RenderTimeout, TemplateError, compile_template, render_chat
from .folds import declare_folds
from ..core.memo import LRU
from ..core.spec import parse_spec

__all__ = ["infer_format", "InferredFormat", "Verification", "CrossCheck", "cross_check"]

# ------------------------------------------------------------------------------- sentinels
# Short alphanumeric values that survive strip/trim/split and that no template inspects.
SYS, U1, A1, U2, A2, U3 = "qzs01x", "qzu01x", "qza01x", "qzu02x", "qza02x", "qzu03x"
RS1, RS2 = "qzr01x", "qzr02x"           # reasoning
FN, ARGK, ARGV = "qzfnx", "qzargx", "qzvalx"   # a tool call: function, argument, value
TR1 = "qzt01x"                           # a tool result
_ALL = (SYS, U1, A1, U2, A2, U3, RS1, RS2, FN, ARGK, ARGV, TR1)

#: Strings shaped like special tokens (used when no tokenizer says which strings are special).
_MARKERISH = re.compile(
    r"<\|[^<>|\s]{0,48}\|>"                      # <|im_start|>, <|user|>
    r"|<\|[A-Z_]{1,48} \|>"                      # axolotl's Aya <|USER_TOKEN |> (a typo)
    r"|<｜[^<>\s]{1,48}?｜>"                     # DeepSeek's <｜User｜>
    r"|<</?[A-Z_]{1,16}>>"                       # <<SYS>>
    r"|</?[A-Za-z_][\w:.\-]{0,40}\|?>"           # <s>, </s>, <think>, <start_of_turn>, <turn|>
    r"|<\|?[A-Za-z_][\w:.\-]{0,40}>"             # <|turn>
    r"|<\[/?[A-Za-z]\w{1,40}\]>"                 # Jibay's <[role_user]>, <[role_user_end]>
    r"|\[/?[A-Za-z][A-Za-z_]{1,30}\]"            # [INST], [/INST], [TOOL_CALLS], [gMASK]
)
_SPECIAL_SHAPE = re.compile(r"<\|[^<>|\s]{0,48}\|>|<｜[^<>\s]{1,48}｜>")
_THINK_ON = {"enable_thinking": True, "thinking": True}
_THINK_OFF = {"enable_thinking": False, "thinking": False}
_TOOLS = [{"type": "function", "function": {
    "name": FN, "description": "A tool.",
    "parameters": {"type": "object", "properties": {ARGK: {"type": "string",
                                                           "description": "An argument."}},
                   "required": [ARGK]}}}]


def _u(text: str) -> dict:
    return {"role": "user", "content": text}


def _a(text: str, **kw: Any) -> dict:
    return {"role": "assistant", "content": text, **kw}


def _s(text: str) -> dict:
    return {"role": "system", "content": text}


def _call(call_id: str = "call00001") -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": FN, "arguments": {ARGK: ARGV}}}


# --------------------------------------------------------------------------------- probing
class _Probe:
    """Renders sentinel conversations (cached), recording the shapes the template rejects."""

    def __init__(self, template: str, variables: dict, timeout: float):
        self.template = template
        self.variables = variables
        self.timeout = timeout
        self.cache: dict[str, str | None] = {}
        self.rejected: dict[str, str] = {}
        self.parts = False  # content given as a list of text parts
        self.sharegpt = False  # messages also in ShareGPT's keys (from / value)
        self.tools: list | None = None  # tools always declared (a template that needs them)
        self.unsplit: dict[str, tuple[str, str]] = {}  # role -> text only the shorter render has
        self.prefills: list = []  # (whitespace before, text) a forced prompt adds to the header
        self.folded: set = set()  # roles whose message renders only once a later one exists
        self.forced = ""  # a suffix every rendering ends with (a forced generation prompt)
        self.moved: dict[str, str] = {}  # shape -> a message rendered before an earlier one

    def content(self, m: dict) -> dict:
        if self.sharegpt:
            from .matrix import SHAREGPT_FROM
            m = {**m, "from": SHAREGPT_FROM.get(m.get("role"), m.get("role")),
                 "value": m.get("content")}
        if self.parts and isinstance(m.get("content"), str) and m["content"]:
            return {**m, "content": [{"type": "text", "text": m["content"]}]}
        return m

    @property
    def shape(self) -> str:
        """The matrix content shape verification gives (matrix.default_matrix)."""
        return "parts" if self.parts else "sharegpt" if self.sharegpt else "string"

    def render(self, msgs: list[dict], *, agp: bool = False, tools: list | None = None,
               extra: dict | None = None, shape: str = "") -> str | None:
        msgs = [self.content(m) for m in msgs]
        tools = tools if tools is not None else self.tools
        key = json.dumps([msgs, agp, tools, extra, self.parts, self.sharegpt], sort_keys=True)
        if key in self.cache:
            return self.cache[key]
        try:
            text = render_chat(self.template, msgs, tools=tools, add_generation_prompt=agp,
                               timeout=self.timeout, **{**self.variables, **(extra or {})})
        except RenderTimeout as exc:
            raise InferenceError(f"the template does not render within the time limit "
                                 f"({exc.message})", where=shape or "a probe") from None
        except TemplateError as exc:
            m = re.search(r"'(\w*_tokens?)' is undefined", exc.message)
            if exc.kind == "undefined" and m:
                raise InferenceError(f"the template needs the variable {m.group(1)!r} (a "
                                     f"tokenizer special token): pass {m.group(1)}=... or a "
                                     "tokenizer", where=shape or "a probe") from None
            self.rejected.setdefault(shape or "probe", f"[{exc.kind}] {exc.message}")
            text = None
        except (ValueError, TypeError) as exc:
            self.rejected.setdefault(shape or "probe", str(exc))
            text = None
        self.cache[key] = text
        return text


def _show(text: str, n: int = 60) -> str:
    """``text`` quoted for a message, clipped to ``n`` characters."""
    return repr(text if len(text) <= n else text[:n - 1] + "…")


def _sentinel(m: dict) -> str | None:
    c = m.get("content")
    if isinstance(c, list):
        c = "".join(p.get("text", "") for p in c)
    return c if c in _ALL else None


@dataclass
class _Msg:
    """One message located in a rendering: its head (text before its value since the previous
    kept message's value) and its term (text after its value up to the next head)."""
    index: int
    role: str
    pos: int
    end: int
    head: str | None = None
    term: str | None = None


def _locate(probe: _Probe, msgs: list[dict], R: str, shape: str, **kw: Any) -> list[_Msg]:
    """The messages whose value is rendered in their own place, with heads and terms."""
    kept: list[_Msg] = []
    last_end = 0
    for i, m in enumerate(msgs):
        s = _sentinel(m)
        if s is None:
            continue
        pos = R.find(s, last_end)
        if pos < 0:
            if m["role"] != "system" and kept and 0 <= R.find(s) < kept[-1].pos:
                # moved before an earlier message (govindramesh's Llama 3 prints every user
                # turn, then every reply): said when the template cannot be captured
                probe.moved.setdefault(shape, f"message [{i}] ({m['role']}) is rendered "
                                              f"before message [{kept[-1].index}] "
                                              f"({kept[-1].role})")
            continue  # dropped, or moved before an earlier message
        if m["role"] == "system" and R.find(s, pos + len(s)) >= 0:
            # the system prompt printed twice (PiVoT-MoE prints the last system message, then
            # every message): no copy is the turn's own, the text is before the first turn
            continue
        own = probe.render(msgs[:i + 1], shape=shape, **kw)
        if own is not None and s not in own:
            probe.folded.add(m["role"])
            continue  # folded: rendered only once a later message exists
        kept.append(_Msg(i, m["role"], pos, pos + len(s)))
        last_end = pos + len(s)
    if not kept:
        return kept
    kept[0].head = R[:kept[0].pos]
    for prev, cur in zip(kept, kept[1:]):
        gap = R[prev.end:cur.pos]
        own = probe.render(msgs[:cur.index], shape=shape, **kw)
        if own is not None and probe.forced and own.endswith(probe.forced) and \
                len(own) - len(probe.forced) >= prev.end:
            # a generation prompt the template always prints (StarCoder2-Instruct's final
            # "### Response\n") is not the previous turn's terminator
            own = own[:len(own) - len(probe.forced)]
        if own is not None and own.startswith(R[:prev.end]):
            t = own[prev.end:]
            split = len(os.path.commonprefix([t, gap]))
            split = min(_snap(_PLAIN, t, split), _snap(_PLAIN, gap, split))
            # what only the shorter rendering has must be a closing (an EOS), never text
            if not t[split:].strip() or _MARKERISH.fullmatch(t[split:].strip()) or \
                    _SPECIAL_SHAPE.fullmatch(t[split:].strip()) or \
                    all(is_m or not p.strip() for is_m, p in _PLAIN.pieces(t[split:])):
                prev.term, cur.head = gap[:split], gap[split:]
            elif cur.role == "assistant" and split == len(gap) and gap.strip() and \
                    _PLAIN.pieces(gap.lstrip())[0][0] and \
                    own == probe.render(msgs[:cur.index], agp=True, shape=shape, **kw):
                # the template always ends a conversation before a reply with the generation
                # prompt, which prefills text the reply's own rendering lacks (Apriel 1.6's
                # '<|begin_assistant|>\nHere are my reasoning steps:\n'; history replies are
                # written without it): what both have is the reply's header, the rest is a
                # prefill of the prompt only (listed in generation_prompt, never trained)
                prev.term, cur.head = "", gap
                probe.prefills.append((gap[:len(gap) - len(gap.lstrip())], t[split:]))
            else:  # for the refusal's message: what only the shorter rendering has
                probe.unsplit.setdefault(cur.role, (t[split:], gap[split:]))
        # else: the earlier messages render differently once this one exists (Qwen3's last
        # assistant turn): where the terminator ends cannot be told from this probe
    kept[-1].term = R[kept[-1].end:]
    return kept


# ------------------------------------------------------------------------------- markers
@dataclass
class _Lexicon:
    """The marker strings of a template: shaped like special tokens, or the tokenizer's."""
    specials: frozenset = frozenset()   # one special/added id of the tokenizer
    extra: tuple = ()                   # literal role strings promoted to (soft) markers
    found: set = field(default_factory=set)

    def rx(self) -> re.Pattern:
        alts = sorted(set(self.specials) | set(self.extra), key=len, reverse=True)
        parts = [re.escape(a) for a in alts if a] + [_MARKERISH.pattern]
        return re.compile("|".join(parts))

    def pieces(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        at = 0
        for m in self.rx().finditer(text):
            if m.start() > at:
                out.append((False, text[at:m.start()]))
            out.append((True, m.group()))
            at = m.end()
        if at < len(text):
            out.append((False, text[at:]))
        return out

    def special(self, marker: str, tokenizer: Any) -> bool:
        """With a tokenizer: one special/added id of it. Without: shaped like ``<|…|>``."""
        if tokenizer is not None:
            from ..runtime.tokenizers import adapt

            return marker in self.specials or adapt(tokenizer).token_id(marker, True) is not None
        return bool(_SPECIAL_SHAPE.fullmatch(marker))


_PLAIN = _Lexicon()


def _tokenizer_specials(tokenizer: Any) -> frozenset:
    """The strings that are one special/added id of the tokenizer."""
    if tokenizer is None:
        return frozenset()
    from ..runtime.tokenizers import adapt

    ad = adapt(tokenizer)
    names = [n for n in ad.added_vocab() if isinstance(n, str) and n.strip()]
    return frozenset(n for n in names if ad.token_id(n, True) is not None)


def _tokenizer_vars(tokenizer: Any) -> dict:
    if tokenizer is None:
        return {}
    from .render import special_token_vars

    try:
        return dict(special_token_vars(tokenizer))
    except Exception:  # noqa: BLE001
        return {}


# ------------------------------------------------------------------------------ analysis
@dataclass
class _Shape:
    """What the probes show: the raw material of the spec."""
    heads: dict = field(default_factory=dict)      # role -> header text (not first turn)
    terms: dict = field(default_factory=dict)      # role -> terminator text
    first: dict = field(default_factory=dict)      # role -> head of a first turn (preamble in)
    first_sys: str | None = None                   # a first user head holding a folded system
    gens: list = field(default_factory=list)       # generation prompts seen
    gen_ws: list = field(default_factory=list)     # whitespace the renders write before them
    closing: list = field(default_factory=list)    # text only the very end carries
    bare_system: bool = False
    think: tuple | None = None                     # (open, close)
    call: tuple | None = None                      # (open, close or None, inner markers)
    plain_calls: bool = False                      # a call written with no marker before it
    plain_reasoning: bool = False                  # reasoning written with no marker around it
    tool_head: str | None = None
    decl: tuple | None = None                      # a tool-declaration block (open, close)
    decl_text: tuple | None = None                 # bare declarations: (close, inner markers)
    glue: list = field(default_factory=list)       # markers seen before some headers
    renders: list = field(default_factory=list)    # every probe rendering
    opening: set = field(default_factory=set)      # markers that start a header
    after_tool_head: str | None = None
    reply_after_reply: bool = False                # a headerless answer after a dropped tool
    blocks: list = field(default_factory=list)     # fixed (open, close) blocks before headers
    renamed: tuple | None = None                   # (history, prompt) names of the assistant
    unjoined: Exception | None = None              # why the role-name forms failed
    counters: dict = field(default_factory=dict)   # role -> (text before, after) a counter
    call_ends_turn: str | None = None              # the marker after a call ends its turn
    notes: list = field(default_factory=list)


def _split_term(lex: _Lexicon, term: str, opening: set = frozenset(),
                closers: set = frozenset()) -> tuple[str, str]:
    """A terminator as ``[text] markers [whitespace]``, and what follows it (the next turn's
    header, printed by this turn: from a marker that starts headers, ``opening``)."""
    ps = lex.pieces(term)
    k = 0
    if k < len(ps) and not ps[k][0] and k + 1 < len(ps):
        k += 1                                  # text before the close marker (body)
    k0 = k
    while k < len(ps):
        if ps[k][0] and (k == k0 or ps[k][1] not in opening):
            k += 1
        elif k > k0 and not ps[k][0] and not ps[k][1].strip() and k + 1 < len(ps) and \
                ps[k + 1][0] and ps[k + 1][1] in closers and ps[k + 1][1] not in opening:
            k += 1   # '</tool_response>\n<|im_end|>': whitespace between two closing markers
        else:
            break
    if k < len(ps) and not ps[k][0] and not ps[k][1].strip():
        k += 1
    if k < len(ps) and not any(p[0] for p in ps[:k]):
        k = 0 if ps[0][0] else k                # no close marker: all of it is whitespace
    cut = sum(len(p[1]) for p in ps[:k])
    return term[:cut], term[cut:]


def _one(lex: _Lexicon, values: dict, role: str, what: str, suffix: bool) -> tuple:
    """The part every rendering of a role's header (``suffix``: the common tail, what is
    before it being the previous turn's end) or terminator (the common head) shares, and the
    pieces some renderings add to it."""
    seen = values.get(role)
    if not seen:
        return None, []
    uniq = list(dict.fromkeys(t for t, _ in seen))
    if len(uniq) == 1:
        return uniq[0], []
    rev = (lambda t: t[::-1]) if suffix else (lambda t: t)
    common = rev(os.path.commonprefix([rev(t) for t in uniq]))
    raw = common.lstrip() if suffix else common
    # never cut inside a marker
    ref = uniq[0]
    cut = len(ref) - len(common) if suffix else len(common)
    bounds = [0]
    for _, p in lex.pieces(ref):
        bounds.append(bounds[-1] + len(p))
    if suffix:
        cut = min((b for b in bounds if b >= cut), default=len(ref))
        common = ref[cut:]
    else:
        cut = max((b for b in bounds if b <= cut), default=0)
        common = ref[:cut]
    if suffix and raw.strip() and len(raw) > len(common) and all(
            all(m or not p.strip() for m, p in lex.pieces(t[:len(t) - len(raw)]))
            for t in uniq):
        # headers that differ only by whitespace or markers before a common text header
        # (WizardLM-2's '\nUSER: ' vs ' USER: ', OpenBuddy's '</s>\nUser: ' vs 'User: ')
        common = raw
    extra = []
    for t in uniq:
        rest = t[:len(t) - len(common)] if suffix else t[len(common):]
        extra.extend(p for m, p in lex.pieces(rest) if m)
    if suffix and any(not m and p.strip() for t in uniq
                      for m, p in lex.pieces(t[:len(t) - len(common)])):
        count = _counter(uniq)
        if count is not None:
            values.setdefault("_counters", {})[role] = count
            return uniq[0].lstrip(), []
        a, b = uniq[0], uniq[1]
        wa = next(w for t, w in seen if t == a)
        wb = next(w for t, w in seen if t == b)
        raise InferenceError(f"{role} turns render {what} differently: {a!r} ({wa}) vs {b!r} "
                             f"({wb})", where=f"probes {wa}, {wb}")
    return common, extra


def _counter(headers: list) -> tuple | None:
    """``(before, after)`` where every header is ``before + N + after`` with a number ``N``
    that differs between them (LongCat's ``[Round 0] USER:``, ``[Round 1] USER:``: a round
    counter), else None. Whitespace before the header is the previous turn's end."""
    shapes = [re.fullmatch(r"(\D*?)([0-9]{1,6})(\D*)", h.lstrip()) for h in headers]
    if not all(shapes) or len({m.group(2) for m in shapes}) < 2 or \
            len({(m.group(1), m.group(3)) for m in shapes}) != 1:
        return None
    before, after = shapes[0].group(1), shapes[0].group(3)
    # the counter sits between two texts, each of which reads as a marker of its own
    return (before, after) if before.strip() and after.strip() else None


def _counted_headers(spec: dict, sh: _Shape) -> None:
    """A header with a counter (``sh.counters``: ``[Round N] USER:``) written as one marker
    becomes the spec language's counter header, as ``chatglm2``'s: the text before the number
    opens the turn, ``header: {until: <the text after it>, pattern: '[0-9]{1,6}'}``."""
    for before, after in sh.counters.values():
        rx = re.compile(re.escape(before) + r"[0-9]{1,6}" + re.escape(after.rstrip()))
        for mname, m in list(spec["markers"].items()):
            users = [el for el in spec["elements"].values() if el.get("open") == mname]
            if not rx.fullmatch(m["text"]) or not users or any("header" in el for el in users):
                continue
            rest = m["text"][len(before):].lstrip("0123456789")
            spec["markers"][mname] = {"text": before, "special": False}
            spec["markers"][mname + "_end"] = {"text": rest, "special": False}
            for el in users:
                el["header"] = {"until": mname + "_end", "pattern": "[0-9]{1,6}"}
            sh.notes.append(f"a counter in the header: {before!r} N {after!r}")


def _call_terminator(spec: dict, sh: _Shape, lex: _Lexicon, tokenizer: Any) -> None:
    """The marker that ends a tool-calling reply in place of the terminator
    (``sh.call_ends_turn``: Solar Open's ``<|calls|>``) closes the assistant turns too."""
    text = sh.call_ends_turn
    if text is None:
        return
    name = next((n for n, m in spec["markers"].items() if m["text"] == text), None)
    if name is None:
        name = _Names()(text)
        while name in spec["markers"]:
            name += "_2"
        spec["markers"][name] = {"text": text, "special": lex.special(text, tokenizer)}
    for el in spec["elements"].values():
        close = el.get("close")
        if el.get("role") in (None, "assistant") and "open" in el and close and \
                el.get("kind") is None and name not in close["markers"]:
            close["markers"].append(name)


def _collect(lex: _Lexicon, located: list[_Msg], shape: str, heads: dict, terms: dict,
             first: dict, last_terms: dict, opening: set = frozenset(),
             closers: set = frozenset()) -> None:
    """Heads and terms of one probe's messages, with a header printed by the previous turn
    moved to the turn it opens."""
    carry = ""
    for k, m in enumerate(located):
        head = carry + (m.head or "")
        carry = ""
        if k == 0:
            first.setdefault(m.role, []).append((head, shape))
        elif m.head is not None:
            heads.setdefault(m.role, []).append((head, shape))
        if m.term is None:
            continue
        if k == len(located) - 1:
            last_terms.setdefault(m.role, []).append((m.term, shape))
            continue
        if located[k + 1].index != m.index + 1:
            continue  # messages in between are not located: no terminator to tell
        term, carry = _split_term(lex, m.term, opening, closers)
        terms.setdefault(m.role, []).append((term, shape))


_BASIC = {
    "u-a-u-a": [_u(U1), _a(A1), _u(U2), _a(A2)],
    "s-u-a-u-a": [_s(SYS), _u(U1), _a(A1), _u(U2), _a(A2)],
    "u-a-u-a-u": [_u(U1), _a(A1), _u(U2), _a(A2), _u(U3)],
}


def _basic(probe: _Probe, lex: _Lexicon, sh: _Shape) -> None:
    heads: dict = {}
    terms: dict = {}
    first: dict = {}
    last: dict = {}
    runs = []
    for name, msgs in _BASIC.items():
        R = probe.render(msgs, shape=name)
        if R is not None:
            runs.append((name, _locate(probe, msgs, R, name)))
    seen_any = bool(runs)
    opening = set()   # markers that start a header (where a turn prints the next one's)
    for _, located in runs:
        for m in located[1:]:
            ps = lex.pieces((m.head or "").lstrip())
            if ps and ps[0][0]:
                opening.add(ps[0][1])
    closers = set()
    for _, located in runs:
        for m in located:
            ps = [q for q in lex.pieces(m.term or "") if q[1].strip()]
            if ps and ps[0][0]:
                closers.add(ps[0][1])
        if located:   # the first turn's header shows every marker a header starts with
            opening.update(p for is_m, p in lex.pieces(located[0].head or "") if is_m)
    opening -= closers
    _lazy_terminator(lex, runs, opening)
    sh.opening = opening
    for name, located in runs:
        if name.startswith("s-") and not any(m.role == "system" for m in located):
            sh.notes.append("the system message is folded into a later turn")
        _collect(lex, located, name, heads, terms, first, last, opening)
    if not seen_any and probe.tools is None:
        probe.tools = list(_TOOLS)   # templates that iterate over `tools` unconditionally
        probe.cache.clear()
        probe.rejected.clear()
        return _basic(probe, lex, sh)
    if not seen_any:
        why = "; ".join(f"{k}: {v}" for k, v in probe.rejected.items())
        raise InferenceError(f"the template rejects every basic conversation ({why})",
                             where="probes " + ", ".join(_BASIC))
    if "assistant" not in heads and "assistant" not in first and "assistant" in probe.unsplit:
        extra, _ = probe.unsplit["assistant"]
        raise InferenceError(
            f"the conversation before an assistant message ends with {_show(extra)}, which is "
            "not there once the assistant message follows (a forced generation prompt that "
            "prefills text, or a fixed suffix no message owns): where the model's output "
            "starts cannot be told", where="probes " + ", ".join(_BASIC))
    if "assistant" not in heads and "assistant" not in first and "assistant" in probe.folded \
            and not any(m.role == "assistant" for _, located in runs for m in located):
        raise InferenceError("an assistant message is rendered only once a later message "
                             "follows it (the last one of a conversation is dropped): the "
                             "reply to train is not in the rendering",
                             where="probes " + ", ".join(_BASIC))
    if "assistant" not in heads and "assistant" not in first:
        raise InferenceError("no assistant message is rendered with its content in place: "
                             "the template never emits an assistant turn",
                             where="probes " + ", ".join(_BASIC))
    for vals in heads.values():
        vals[:] = [(_fixed_blocks(lex, h, sh), w) for h, w in vals]
    for vals in first.values():   # (a default system turn there is a turn, not a block)
        vals[:] = [(_fixed_blocks(lex, h, sh, known=True), w) for h, w in vals]
    for role in ("user", "assistant"):
        h, extra = _one(lex, heads, role, "their header", suffix=role != "assistant")
        if h is not None:
            sh.heads[role] = h
            sh.glue.extend(extra)
    sh.counters = heads.pop("_counters", {})
    for role in ("system", "user", "assistant"):
        t, _ = _one(lex, terms, role, "their terminator", suffix=False)
        if t is not None:
            sh.terms[role] = t
    _header_in_terminator(lex, sh)
    for role, vals in first.items():
        sh.first[role] = vals[0][0]
    for head, shape in first.get("user", []):
        if shape.startswith("s-") and SYS in head and "system" not in first:
            sh.first_sys = head   # the system text folded before the first user header
    # what the last message's terminator adds to the ordinary one (an EOS at the very end)
    for role, vals in last.items():
        base = sh.terms.get(role)
        for t, _ in vals:
            if base is not None and t.startswith(base.rstrip()):
                rest = t[len(base.rstrip()):]
                if rest.strip():
                    sh.closing.append(rest.strip())
            elif base is None and t.strip():
                sh.terms.setdefault(role, _split_term(lex, t)[0])


def _fixed_blocks(lex: _Lexicon, head: str, sh: _Shape, known: bool = False) -> str:
    """``head`` without the fixed blocks before its opener, recorded in ``sh.blocks``: a
    marker, text that holds no message value, its closing twin (Jibay's
    '<[role_reasoning_effort]>\nReasoning Effort is Medium\n<[role_reasoning_effort_end]>'
    after the system turn). Such a block is an untrained system element of its own. ``known``:
    only the blocks found already."""
    ps = lex.pieces(head)
    out, i = [], 0
    while i < len(ps):
        is_m, p = ps[i]
        twin = _mirror(p) if is_m else ""
        j = next((k for k in range(i + 1, len(ps)) if ps[k][0]), None)
        if twin and j is not None and ps[j][1] == twin and j + 1 < len(ps) and any(
                q[0] for q in ps[j + 1:]) and not any(v in t for _, t in ps[i:j] for v in _ALL) \
                and (not known or (p, twin) in sh.blocks):
            if (p, twin) not in sh.blocks:
                sh.blocks.append((p, twin))
            i = j + 1
            while i < len(ps) and not ps[i][0] and not ps[i][1].strip():
                i += 1   # the whitespace after it is between-turn text
            continue
        out.append(p)
        i += 1
    return "".join(out)


def _lazy_terminator(lex: _Lexicon, runs: list, opening: set) -> None:
    """A terminator the template prints only once another message follows (FinguAI's ChatML:
    '<|im_end|>\n' before each next '<|im_start|>', never after the last message): every later
    header starts with the same marker before its opener, and no terminator has it. It is
    moved back to the turn it ends (the last turn of a conversation then has none: the
    candidates with an optional terminator take it)."""
    pairs = [(prev, cur) for _, located in runs for prev, cur in zip(located, located[1:])
             if cur.head is not None]
    # keyed by the role of the turn it ends: a role whose turns have a terminator of their
    # own prints none lazily (Apertus ends user turns with <|user_end|>, and its assistant
    # turns with an <|assistant_end|> printed only before the next user header)
    termed = {m.role for _, located in runs for m in located[:-1] if (m.term or "").strip()}
    if not pairs or not {p.role for p, _ in pairs} - termed:
        return
    # per role: Apriel 1.6 writes '<|end|>' before each later user header only (its user turns
    # have no terminator, its assistant turns one printed only once a user message follows)
    heads0 = [(located[0].head or "") for _, located in runs if located]
    # the marker after it must open a header where no terminator precedes it (a first turn's
    # head): GLM-4.5's '<|assistant|>\n<think></think>' is a header, not a lazy terminator
    first_marks = {p for h in heads0 for m, p in lex.pieces(h) if m}
    firsts: dict = {}
    for prev, cur in pairs:
        ps = [q for q in lex.pieces(cur.head) if q[0] or q[1].strip()]
        ok = len(ps) >= 2 and ps[0][0] and ps[1][0] and ps[1][1] in first_marks
        firsts.setdefault(prev.role, set()).add(ps[0][1] if ok else None)
    lazy = {r: next(iter(f)) for r, f in firsts.items() if len(f) == 1 and None not in f
            and r not in termed}
    for role, marker in list(lazy.items()):
        if marker in opening and all(h.lstrip().startswith(marker) for h in heads0):
            del lazy[role]   # the marker opens every first turn too: it is a header's
    if not lazy:
        return
    for prev, cur in pairs:
        if prev.term is None or prev.role not in lazy:
            continue
        marker = lazy[prev.role]
        at = cur.head.find(marker)
        rest = cur.head[at + len(marker):]
        ws = rest[:len(rest) - len(rest.lstrip())]
        cut = at + len(marker) + len(ws)
        prev.term, cur.head = prev.term + cur.head[:cut], cur.head[cut:]
    for marker in set(lazy.values()):
        if not any(h.lstrip().startswith(marker) for h in heads0):
            opening.discard(marker)


def _header_in_terminator(lex: _Lexicon, sh: _Shape) -> None:
    """A user turn whose only "terminator" is a marker no other turn ends with, before an
    assistant turn whose header has no marker: that marker is the assistant's header, printed
    by the user turn (GLM-Edge's ``<|user|>\nU<|assistant|>\nA``)."""
    head = sh.heads.get("assistant")
    term = sh.terms.get("user")
    if head is None or not term or any(m for m, _ in lex.pieces(head)):
        return
    ps = [q for q in lex.pieces(term) if q[1].strip()]
    if len(ps) != 1 or not ps[0][0]:
        return
    marker = ps[0][1]
    if re.match(r"</|\[/|<\|/", marker) or re.search(r"end|close|eot|eos|stop", marker, re.I):
        return  # shaped like a terminator (Mistral's [/INST]): the reply has no header
    others = [sh.terms.get(r) or "" for r in ("system", "assistant")]
    if any(marker in t for t in others):
        return
    sh.terms["user"] = term[:term.index(marker)]
    # where the user's rendering stops, the assistant's output starts: what follows the
    # marker ("\n") is the assistant's (it trains, as the template's prompt says)
    sh.heads["assistant"] = term[term.index(marker):]
    sh.opening.add(marker)
    sh.notes.append(f"the user turn prints the assistant's header {marker!r}")


def _snap(lex: _Lexicon, text: str, at: int, lo: int = 0) -> int:
    """``at``, moved back to the start of the marker it falls inside (never below ``lo``)."""
    pos = 0
    for is_marker, p in lex.pieces(text):
        if pos < at < pos + len(p) and is_marker:
            return max(pos, lo)
        pos += len(p)
        if pos >= at:
            break
    return at


_GEN = {
    "u-a-u+gen": [_u(U1), _a(A1), _u(U2)],
    "u+gen": [_u(U1)],
    "s-u+gen": [_s(SYS), _u(U1)],
}


def _generation(probe: _Probe, lex: _Lexicon, sh: _Shape) -> str | None:
    """The generation prompts (what ``add_generation_prompt`` appends), the main one first."""
    main = None
    for name, msgs in _GEN.items():
        for kw in (None, _THINK_ON, _THINK_OFF):
            r0 = probe.render(msgs, extra=kw, shape=name)
            r1 = probe.render(msgs, agp=True, extra=kw, shape=name)
            if r0 is None or r1 is None:
                continue
            last = r1.rfind(msgs[-1]["content"]) + len(msgs[-1]["content"])
            cp = len(os.path.commonprefix([r0, r1]))
            cp = max(_snap(lex, r1, cp, last), last) if cp >= last else cp
            g = r1[cp:]
            if main is None and kw is None:
                main = g
            if g.strip():
                sh.gens.append(g.lstrip())
                before = r1[:len(r1) - len(g.lstrip())]
                ws = before[len(before.rstrip()):]
                if ws and ws not in sh.gen_ws:
                    sh.gen_ws.append(ws)
            if r0[cp:].strip() and r0[cp:].strip() not in sh.closing:
                sh.closing.append(r0[cp:].strip())
    return main


def _assistant_header(lex: _Lexicon, sh: _Shape, g: str | None) -> str:
    """The assistant's header, without a trailing opened block (``<think>\n``: a prefill of
    the body's own structure, which trains as the body's)."""
    head = _assistant_head(lex, sh, g)
    ps = lex.pieces(head)
    k = len(ps)
    if k and not ps[k - 1][0] and not ps[k - 1][1].strip():
        k -= 1
    if k > 1 and ps[k - 1][0] and re.fullmatch(r"<\w+>", ps[k - 1][1]):
        cut = sum(len(p) for _, p in ps[:k - 1])
        sh.notes.append(f"the generation prompt prefills {head[cut:]!r}: it opens the body")
        return head[:cut]
    return head


def _assistant_head(lex: _Lexicon, sh: _Shape, g: str | None) -> str:
    head = sh.heads.get("assistant")
    if head is None:
        raise InferenceError("the assistant turn's header cannot be told: no probe renders an "
                             "assistant message after another message", where="basic probes")
    g = (g or "").lstrip()
    head_ws = head[:len(head) - len(head.lstrip())]
    body = head[len(head_ws):]
    if not g or body.endswith(g):
        return body
    if g.endswith(body) and body.strip() and all(
            m or not p.strip() for m, p in lex.pieces(g[:len(g) - len(body)])):
        return body   # the prompt closes the last turn first ('<|im_end|>\n' + header)
    if body.startswith(g) or g.startswith(body):
        return g if body.startswith(g) else body
    renamed = _renamed_prompt(body, g)
    others = [h for r, h in list(sh.heads.items()) + list(sh.first.items()) if r != "assistant"]
    if renamed and not any(re.search(r"\b" + re.escape(renamed[1]) + r"\b", h) for h in others):
        # the prompt names the assistant otherwise than the history (Asimov's '### Assistant: '
        # vs '### assistant: ', saiga's '<s>bot\n' vs '<s>assistant\n'): the history's header
        # is the assistant's, the prompt's name opens an assistant turn too (never another
        # role's: a name no probed role writes), and the prompt is a generation prompt
        sh.renamed = renamed
        sh.notes.append(f"the generation prompt {g!r} names the assistant {renamed[1]!r}, the "
                        f"history {renamed[0]!r}: both open assistant turns")
        return body
    cut = _snap(lex, body, len(os.path.commonprefix([body, g])))
    ps = lex.pieces(body[:cut])
    while ps and ps[-1][0]:
        cut -= len(ps.pop()[1])   # a marker where they part opens the body (a prefill)
    sh.notes.append(f"the generation prompt {g!r} differs from the assistant header {body!r}: "
                    f"header taken as {body[:cut]!r}")
    return body[:cut]


def _renamed_prompt(body: str, g: str) -> tuple | None:
    """``(history name, prompt name)`` where the assistant header ``body`` and the prompt
    ``g`` differ only in the role word between a shared (non-blank) lead and separator."""
    cp = len(os.path.commonprefix([body, g]))
    while cp and body[cp - 1].isalnum():
        cp -= 1
    if not body[:cp].strip():
        return None
    a = re.match(r"([A-Za-z][\w-]*)(\W*)$", body[cp:])
    b = re.match(r"([A-Za-z][\w-]*)(\W*)$", g[cp:])
    if not a or not b or a.group(1) == b.group(1) or a.group(2).rstrip() != b.group(2).rstrip() \
            or not a.group(2).strip(" ") or b.group(2)[:len(a.group(2))] != a.group(2):
        return None   # (the separator must be there, the prompt's may end with more space)
    return a.group(1), b.group(1)


def _reasoning(probe: _Probe, lex: _Lexicon, sh: _Shape, h_a: str) -> None:
    """The think block's markers, from a last assistant turn with ``reasoning_content``."""
    for kw in (None, _THINK_ON):
        msgs = [_u(U1), _a(A1, reasoning_content=RS1)]
        R = probe.render(msgs, extra=kw, shape="reasoning")
        if R is None or RS1 not in R or A1 not in R:
            continue
        r, a = R.find(RS1), R.find(A1)
        if r > a:
            sh.notes.append("reasoning is rendered after the answer: left as content")
            return
        start = R.find(h_a, R.find(U1)) + len(h_a) if h_a else R.find(U1) + len(U1)
        x = [p for m, p in lex.pieces(R[start:r]) if m]
        y = [p for m, p in lex.pieces(R[r + len(RS1):a]) if m]
        if x and y:
            sh.think = (x[-1], y[0])
        else:
            # (the spec says so: thinking=False then warns, runtime.policy.warn_untyped)
            sh.plain_reasoning = True
            sh.notes.append("reasoning is rendered without markers: it trains as content")
        return
    for g in sh.gens:  # an empty think block in a generation prompt (thinking switched off)
        tail = [p for m, p in lex.pieces(g[len(h_a):]) if m] if g.startswith(h_a) else []
        twin = _mirror(tail[0]) if tail else ""
        if tail and twin and (tail[1:2] == [twin] or re.fullmatch(r"<\w+>", tail[0])
                              or any(twin in r for r in probe.cache.values() if r)):
            sh.think = (tail[0], twin)
            sh.notes.append("the think block is known from the generation prompt only")
            return


def _mirror(marker: str) -> str:
    """The closing twin of an opening marker: ``<x>``/``</x>``, ``[X]``/``[/X]``,
    ``…begin…``/``…end…``, ``…start…``/``…end…``, ``…open…``/``…close…``."""
    for a, b in (("begin", "end"), ("start", "end"), ("open", "close"), ("BEGIN", "END"),
                 ("START", "END")):
        if a in marker:
            return marker.replace(a, b)
    if marker.startswith("<") and not marker.startswith(("</", "<[")):
        return "</" + marker[1:]
    if marker.startswith("[") and not marker.startswith("[/"):
        return "[/" + marker[1:]
    if marker.startswith("<[") and marker.endswith("]>"):
        return marker[:-2] + "_end]>"   # Jibay's <[role_x]> / <[role_x_end]>
    return ""


def _tools(probe: _Probe, lex: _Lexicon, sh: _Shape, h_a: str) -> None:
    """The tool-call wrapper and the tool turn's header, from a call, its result, an answer."""
    probe.render([_u(U1), _a(A1)], tools=_TOOLS, shape="tools-declared")
    probe.render([_s(SYS), _u(U1), _a(A1)], tools=_TOOLS, shape="tools-declared")
    msgs = [_u(U1), _a("", tool_calls=[_call()]),
            {"role": "tool", "tool_call_id": "call00001", "name": FN, "content": TR1},
            _a(A2)]
    R = probe.render(msgs, tools=_TOOLS, shape="tool-call")
    if R is None:
        msgs = [_s(SYS)] + msgs
        R = probe.render(msgs, tools=_TOOLS, shape="tool-call")
    if R is None:   # templates that only take arguments as a JSON string (FireFunction v2)
        call = _call()
        call["function"]["arguments"] = json.dumps({ARGK: ARGV})
        msgs = [m if m.get("role") != "assistant" or "tool_calls" not in m
                else {**m, "tool_calls": [call]} for m in msgs]
        R = probe.render(msgs, tools=_TOOLS, shape="tool-call (string arguments)")
    if R is not None and TR1 not in R and A2 in R:
        before = R[:R.find(A2)]
        term = sh.terms.get("assistant") or ""
        if term.strip() and before.endswith(term) and not before.endswith(h_a):
            # the tool message is dropped and the answer follows the tool-calling reply with
            # no header of its own (Phi-3's template prints the assistant header in the user
            # turn): a headerless reply may follow an assistant turn
            sh.reply_after_reply = True
            sh.notes.append("tool messages are dropped; the answer after them has no header")
    if R is None or TR1 not in R or A2 not in R:
        sh.notes.append("no tool-call probe renders: tool calls are left to verification")
        return
    # the tool turn and the answer after it
    located = _locate(probe, msgs, R, "tool-call", tools=_TOOLS)
    closes = {p for t in sh.terms.values() for m, p in lex.pieces(t)[:1] if m}
    for prev, cur in zip(located, located[1:]):
        # a tool turn whose close the next message prints (Hermes writes <|im_end|> after a
        # run of tool messages): the close is the tool turn's, not the next header's
        ps = lex.pieces(cur.head or "")
        k = 1 if ps and not ps[0][0] and not ps[0][1].strip() else 0
        if prev.role == "tool" and prev.term is not None and len(ps) > k + 1 and ps[k][0] \
                and ps[k][1] in closes and ps[k][1] not in prev.term:
            cut = sum(len(p) for _, p in ps[:k + 1])
            prev.term, cur.head = prev.term + cur.head[:cut], cur.head[cut:]
    heads: dict = {}
    terms: dict = {}
    first: dict = {}
    last: dict = {}
    _collect(lex, located, "tool-call", heads, terms, first, last, sh.opening, closes)
    if heads.get("tool"):
        sh.tool_head = heads["tool"][0][0]
    else:  # from the last marker before the result that starts a header
        seg = R[:R.find(TR1)]
        at = max((seg.rfind(o) for o in sh.opening), default=-1)
        if at >= 0 and not any(x in seg[at:] for x in _ALL):
            sh.tool_head = seg[at:]
        else:
            # after the tool-calling reply's terminator (Apriel 1.5: '<|end|>\n</s>' then
            # '<|tool_result|>\n'): what is left before the result is the tool's header
            ends = [p for m, p in lex.pieces(sh.terms.get("assistant") or "") if m]
            at = seg.rfind(ends[0]) if ends else -1
            rest = seg[at + len(ends[0]):] if at >= 0 else ""
            if rest.strip() and not any(x in rest for x in _ALL) and \
                    any(m for m, _ in lex.pieces(rest)):
                sh.tool_head = rest.lstrip()
    if sh.tool_head:   # a terminator printed lazily before the tool's header (FinguAI)
        ps = lex.pieces(sh.tool_head.lstrip())
        ends = {p for t in sh.terms.values() for m, p in lex.pieces(t)[:1] if m}
        if len(ps) > 1 and ps[0][0] and ps[0][1] in ends and ps[1:] and \
                any(m for m, _ in ps[1:]):
            sh.tool_head = "".join(p for _, p in ps[1:]).lstrip()
    if terms.get("tool"):
        sh.terms.setdefault("tool", terms["tool"][0][0])
    if heads.get("assistant"):
        sh.after_tool_head = heads["assistant"][-1][0]
    _call_block(lex, sh, R, h_a)
    _declarations(probe, lex, sh)


def _call_block(lex: _Lexicon, sh: _Shape, R: str, h_a: str) -> None:
    """The tool-call element's markers, from a rendering of a call, its result, an answer:
    the markers before the call's function name (or first argument) and after its last
    argument (or name) that no turn uses."""
    u_end = R.find(U1) + len(U1)
    t = R.find(TR1)
    f = R.find(FN, u_end)
    v = R.rfind(ARGV, 0, t)
    k = R.find(ARGK, u_end)
    if 0 <= k < v < f < t:
        # the arguments before the name (vLLM's Hermes template writes '{ "arguments": {…},
        # "name": "NAME"}'): the call runs from the first argument to after the name
        f, v = k, f + len(FN) - len(ARGV)
    if 0 <= f < v < t:
        start = R.find(h_a, u_end) + len(h_a) if h_a and R.find(h_a, u_end) >= 0 else u_end
        struct = {p for t in list(sh.heads.values()) + list(sh.terms.values())
                  + list(sh.first.values()) + [sh.tool_head or ""]
                  for m, p in lex.pieces(t) if m}
        x = [p for m, p in lex.pieces(R[start:f]) if m and p not in struct]
        if sh.think and sh.think[1] in x:
            x = x[x.index(sh.think[1]) + 1:]
        closes = {p for m, p in lex.pieces(sh.terms.get("assistant", "")) if m}
        tail = lex.pieces(R[v + len(ARGV):t])
        y: list[str] = []
        for m, p in tail:
            if m and (p in closes or p in struct):
                break
            if m:
                y.append(p)
        inner = [p for m, p in lex.pieces(R[f:v]) if m and p not in struct]
        # no marker before the call: plain text no grammar tells from the answer (the spec
        # says so: tool_calls=False then warns, runtime.policy.warn_untyped)
        sh.plain_calls = not x
        if x:
            mirror = _mirror(x[0])
            ends = mirror if mirror in y else y[-1] if y else None
            if ends is not None and ends != mirror and closes and tail and \
                    not any(m and p in closes for m, p in tail) and not sh.plain_calls:
                # the last marker after the call is no twin of its opener and the turn's
                # terminator is not printed after it (Solar Open writes '<|calls|>' where
                # other turns write '<|end|>'): it ends the turn, not the block, and trains
                # only as a terminator (end_marker), as the bundled solar-open says
                sh.call_ends_turn = ends
                y = [q for q in y if q != ends]
                ends = None
            sh.call = (x[0], ends, tuple(dict.fromkeys(x[1:] + inner
                                                       + [q for q in y if q != ends])))


def _declarations(probe: _Probe, lex: _Lexicon, sh: _Shape) -> None:
    """A tool-declaration block of its own (Mistral's ``[AVAILABLE_TOOLS]…[/AVAILABLE_TOOLS]``):
    what declaring tools inserts, when it is wrapped in markers no turn uses."""
    msgs = [_u(U1), _a(A1)]
    r0 = probe.render(msgs, shape="tools-declared")
    r1 = probe.render(msgs, tools=_TOOLS, shape="tools-declared")
    if r0 is None or r1 is None or r0 == r1:
        return
    cp = len(os.path.commonprefix([r0, r1]))
    cs = len(os.path.commonprefix([r0[cp:][::-1], r1[cp:][::-1]]))
    ps = lex.pieces(r1[_snap(lex, r1, cp):len(r1) - cs])
    marks = [p for m, p in ps if m]
    struct = {p for t in list(sh.heads.values()) + list(sh.terms.values())
              + list(sh.first.values()) for m, p in lex.pieces(t) if m}
    new = [p for p in marks if p not in struct]
    before = [q for q in lex.pieces(r1[:_snap(lex, r1, cp)].rstrip()) if q[1]]
    if before and not before[-1][0]:
        return  # inside a turn's text (Qwen's <tools> in the system prompt)
    lead = [q for q in ps if q[1].strip()]
    if len(new) >= 2 and _mirror(new[0]) in new and lead and lead[0] == (True, new[0]):
        sh.decl = (new[0], _mirror(new[0]))


def _decl_text(lex: _Lexicon, text: str, closes: set, opening: set) -> tuple | None:
    """``(close, inner markers, length)`` when ``text`` (what precedes the first turn's
    header, BOS excluded) is tool declarations written as bare text and ended with the turns'
    terminator: it names the probe's function and may hold marker-shaped words, none of them
    a turn opener or a terminator (vLLM's Hermes tool templates: 'You are a function calling
    AI model … <tools> … </tool_call><|im_end|>' before '<|im_start|>system'). Else None."""
    body = text.rstrip()
    ps = [q for q in lex.pieces(body) if q[1]]
    if len(ps) < 2 or ps[0][0] or not ps[0][1].strip() or FN not in body:
        return None
    closed = ps[-1][0] and ps[-1][1] in closes
    if not closed and ps[-1][0]:
        return None
    # without a close (LongCat's '# Tools … # Messages\n' before 'SYSTEM:' or the first
    # user header): it ends where the first turn opens, as a bare system text does
    inner = [p for m, p in (ps[:-1] if closed else ps) if m]
    if any(p in closes or p in opening for p in inner):
        return None
    return (ps[-1][1] if closed else None), tuple(dict.fromkeys(inner)), len(text)


def _declaration_text(probe: _Probe, lex: _Lexicon, sh: _Shape) -> None:
    """Tool declarations printed as bare text before the first turn, ended with the turns'
    terminator (:func:`_decl_text`): from what declaring tools inserts, or, for a template
    that is always probed with tools, from the first turn's head (the text is then taken out
    of it, so that the header is read as in later turns). They become an untrained system
    element of the preamble, with the marker-shaped words as its inner markers."""
    closes = {p for t in sh.terms.values() for m, p in lex.pieces(t)[:1] if m}
    # the markers later turns' headers hold (the first turn's head holds the declarations)
    heads = {p for t in sh.heads.values() for m, p in lex.pieces(t) if m}
    msgs = [_u(U1), _a(A1)]
    r0 = probe.render(msgs, shape="tools-declared")
    r1 = probe.render(msgs, tools=_TOOLS, shape="tools-declared")
    if r0 is not None and r1 is not None and r0 != r1:
        cp = _snap(lex, r1, len(os.path.commonprefix([r0, r1])))
        cs = len(os.path.commonprefix([r0[cp:][::-1], r1[cp:][::-1]]))
        seg = r1[cp:len(r1) - cs]
        if not r0[:cp].strip() or all(m for m, p in lex.pieces(r0[:cp]) if p.strip()):
            found = _decl_text(lex, seg, closes, heads)
            if found:
                sh.decl_text = found[:2]
        return
    user = (sh.heads.get("user") or "").lstrip()
    first = sh.first.get("user")
    if probe.tools is None or not user or first is None or not first.endswith(user):
        return
    pre = first[:len(first) - len(user)]
    ps = lex.pieces(pre)
    k = 0
    while k < len(ps) and (ps[k][0] and ps[k][1] not in heads or not ps[k][1].strip()):
        k += 1   # the BOS and whitespace before the declarations
    lead = "".join(p for _, p in ps[:k])
    found = _decl_text(lex, pre[len(lead):], closes, heads)
    if not found or found[0] is None:   # (a closeless one only where declaring tools adds it)
        return
    sh.decl_text = found[:2]
    cut = len(lead) + found[2]
    decl = pre[len(lead):cut]
    for role, head in list(sh.first.items()):
        if head.startswith(lead + decl):
            sh.first[role] = lead + head[cut:]
    if sh.first_sys is not None and sh.first_sys.startswith(lead + decl):
        sh.first_sys = lead + sh.first_sys[cut:]
    sh.notes.append("tool declarations are printed as bare text before the first turn")


# -------------------------------------------------------------------------------- design
class _Names:
    """Marker names for the spec, readable and unique."""

    def __init__(self) -> None:
        self.by_text: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        if text not in self.by_text:
            base = re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "m"
            if not base[0].isalpha():
                base = "m_" + base
            base = base[:32]
            name, n = base, 2
            while name in self.by_text.values():
                name, n = f"{base}_{n}", n + 1
            self.by_text[text] = name
        return self.by_text[text]


@dataclass
class _Head:
    """A header cut into: glue markers before the opener, the opener, the rest (pieces)."""
    glue: list
    opener: str | None
    rest: list


def _cut_head(lex: _Lexicon, head: str, openers: set | None = None) -> _Head:
    ps = lex.pieces(head.lstrip())
    if not ps:
        return _Head([], None, [])
    if not ps[0][0]:
        # a header without a marker ("USER: "): its words become a soft marker
        text = ps[0][1]
        word = text.rstrip()
        if not word:
            return _Head([], None, ps)
        lex.extra = tuple(dict.fromkeys(lex.extra + (word,)))
        rest = [(False, text[len(word):])] if text[len(word):] else []
        return _Head([], word, rest + ps[1:])
    k = 0
    while k + 1 < len(ps) and ps[k + 1][0] and (openers is None or ps[k][1] not in openers):
        k += 1
    return _Head([p for _, p in ps[:k]], ps[k][1], ps[k + 1:])


def _term_parts(lex: _Lexicon, term: str | None) -> tuple[list, bool]:
    """Close markers of a terminator (first, then the ones right after it), and whether
    whitespace follows."""
    if not term:
        return [], False
    ps = lex.pieces(term)
    if ps and not ps[0][0] and len(ps) > 1:
        ps = ps[1:]                             # text before the close is body
    marks = []
    for m, p in ps:
        if not m:
            break
        marks.append(p)
    ws = any(not m and not p.strip() for m, p in ps)
    return marks, ws


def _more_names(renders: list, opener: str, kind: str, sep: str, known: set) -> list[str]:
    """Role names the renders write after ``opener`` that no probed role has (Kimi's
    ``tool_declare``, Granite's ``available_tools``): turns of their own, never trained."""
    body = r"([A-Za-z_][^\n<>|]{0,40}?)" if kind == "until_text" else r"([^<>\n]{0,64}?)"
    rx = re.compile(re.escape(opener) + body + re.escape(sep))
    out: list[str] = []
    for text in renders:
        for m in rx.finditer(text):
            n = m.group(1)
            if n and n not in known and n not in out and not any(s in n for s in _ALL):
                out.append(n)
    return out


def _named_header(texts: dict) -> tuple | None:
    """Where one role's header writes the message's name after the role word (a tool result's
    ``tool name=get_weather\n``) and the others end with the separator that follows it: that
    role's text becomes its word (in ``texts``), and ``(role, pattern)`` reads the name as an
    attribute after that word only."""
    for r, t in texts.items():
        m = re.fullmatch(r"([A-Za-z_][\w.\-]*)( \w{1,16}=)" + re.escape(FN) + r"(\W*)", t)
        if m and all(u.endswith(m.group(3)) and FN not in u for q, u in texts.items() if q != r):
            texts[r] = m.group(1) + m.group(3)
            word = re.escape(m.group(1))
            return r, f"(?:(?<={word}){re.escape(m.group(2))}[^\n<>]{{1,64}})?"
    return None


def _role_names(roles: dict, lex: _Lexicon, where: str, opener: str = "",
                renders: list | None = None) -> tuple[str, str, dict, str | None]:
    """For roles sharing an opener, headers ``NAME<sep>`` or ``NAME<marker>``: the header
    form (``until_text`` separator or ``until`` marker), the pattern, the aliases, the lead."""
    rests = {r: h.rest for r, h in roles.items()}
    shapes = {tuple(m for m, _ in rest) for rest in rests.values()}
    named = None
    if all(s and s[0] is False for s in shapes) and len({s[:2] for s in shapes}) == 1 \
            and next(iter(shapes))[1:2] == (True,):
        until = {rest[1][1] for rest in rests.values()}
        if len(until) != 1:
            raise InferenceError(f"roles {', '.join(roles)} share the opener but end their "
                                 f"headers with different markers {sorted(until)}", where=where)
        names = {r: rest[0][1] for r, rest in rests.items()}
        sep, kind = until.pop(), "until"
        lead = None
        a = rests.get("assistant")
        if a and len(a) > 2 and not a[2][0]:
            lead = a[2][1]
    elif all(len(rest) >= 1 and not rest[0][0] for rest in rests.values()):
        texts = {r: rest[0][1] for r, rest in rests.items()}
        named = _named_header(texts)
        # NAME then its separator: the separators' common head ends every header
        seps = [re.match(r"[A-Za-z_][\w.\-]*([^A-Za-z0-9]*)", t) for t in texts.values()]
        sep = os.path.commonprefix([m.group(1) for m in seps]) if all(seps) else ""
        # the header line ends at its newline; whitespace every role writes after it (the
        # blank line of 'assistant\n\n') is the header's lead, never the reply's output
        more = sep[sep.index("\n") + 1:] if "\n" in sep else ""
        sep = sep if "\n" not in sep else sep[:sep.index("\n") + 1]
        if not sep:
            raise InferenceError(f"roles {', '.join(roles)} share the opener and their "
                                 f"headers {sorted(texts.values())} end with no common "
                                 "separator", where=where)
        names = {r: t[:t.index(sep)] for r, t in texts.items()}
        kind, lead = "until_text", (more if more.isspace() else None)
    elif not any(p.strip() for rest in rests.values() for _, p in rest):
        raise InferenceError(f"roles {', '.join(roles)} share the opener {opener!r} and write "
                             "nothing after it: only a turn's position says whose it is, which "
                             "a system message or a dropped turn makes lie", where=where)
    else:
        raise InferenceError(f"the headers of roles {', '.join(roles)} have no common form: "
                             + ", ".join(f"{r}: {''.join(p for _, p in h.rest)!r}"
                                         for r, h in roles.items()), where=where)
    by_name: dict[str, str] = {}
    dup: list[str] = []
    generic = False
    for r, n in list(names.items()):
        if FN in n:   # the tool's name is the role (Kimi-K2-Thinking's tool results)
            generic = True
            dup.append(r)
            del names[r]
    for r, n in names.items():
        if not n or not re.fullmatch(r"[^\n]{1,64}", n):
            raise InferenceError(f"the {r} header's role name {n!r} cannot be read",
                                 where=where)
        if n in by_name and by_name[n] != r:
            if "assistant" in (r, by_name[n]):
                raise InferenceError(f"assistant and {r if r != 'assistant' else by_name[n]} "
                                     f"turns have the same header {n!r}", where=where)
            dup.append(r)
            continue
        by_name.setdefault(n, r)
    for n in _more_names(renders or [], opener, kind, sep, set(by_name)):
        if n != "assistant":
            by_name[n] = n
    alts = "|".join(re.escape(n) for n in sorted(by_name, key=len, reverse=True))
    if generic:
        alts += r"|(?!assistant\b)[A-Za-z_][\w.:-]{0,63}"
    pattern = f"(?P<role>{alts})" + (named[1] if named and kind == "until_text" else "") \
        + (re.escape(sep) if kind == "until_text" else "")
    aliases = {n: r for n, r in by_name.items() if n != r}
    return kind, sep, {"pattern": pattern, "aliases": aliases, "dup": dup}, lead


@dataclass
class _Plan:
    """The spec being written (a plain dict), with the markers it uses."""
    names: _Names = field(default_factory=_Names)
    elements: dict = field(default_factory=dict)
    top: list = field(default_factory=list)
    preamble: list = field(default_factory=list)
    between_markers: list = field(default_factory=list)
    aliases: dict = field(default_factory=dict)
    between: bool = False
    follow_from: list = field(default_factory=list)   # elements the headerless reply follows
    ws_after: dict = field(default_factory=dict)      # close marker -> whitespace after it
    ws_before: dict = field(default_factory=dict)     # close marker -> whitespace before it

    def m(self, text: str) -> str:
        return self.names(text)


def _heads(lex: _Lexicon, sh: _Shape, h_a: str) -> tuple[dict, list, bool]:
    """Every role's header cut at its opener; the preamble markers; a bare system text."""
    user = sh.heads.get("user")
    if user is None:
        user = sh.first.get("user", "")
    cut = {"assistant": _cut_head(lex, h_a), "user": _cut_head(lex, user)}
    openers = {c.opener for c in cut.values() if c.opener}
    bare = False
    preamble: list = []
    first_u = sh.first.get("user")
    at = first_u.find(user.lstrip()) if first_u is not None and user.strip() else -1
    if at >= 0:
        # before the header: BOS or a default system turn; after it: a folded system text
        pre = first_u[:at] if not first_u.endswith(user.lstrip()) else \
            first_u[:len(first_u) - len(user.lstrip())]
        ps = [q for q in lex.pieces(pre) if q[0] or q[1].strip()]   # whitespace: between
        k = 0
        while k < len(ps) and ps[k][0] and ps[k][1] not in openers:
            k += 1
        if ps and k == len(ps):
            preamble = [p for _, p in ps]
        elif ps[k:] and not any(m for m, _ in ps[k:]) and "".join(p for _, p in ps[k:]).strip() \
                and not ("system" in sh.first and sh.first["system"].strip()
                         and pre.startswith(sh.first["system"].rstrip())):
            # (not a default system *turn*: Vigogne's '<s><|system|>: DEFAULT\n' is one)
            # a default system text, bare before the first turn, after the BOS (Magicoder's
            # "<bos>You are an exceptionally intelligent coding assistant …\n\n")
            preamble = [p for _, p in ps[:k]]
            bare = True
    _folded_system_turn(lex, sh, user, openers)
    if sh.first_sys is not None and user.strip() and not bare and "system" not in sh.first:
        # a system message rendered as bare text before the first user turn, only once a user
        # message follows it (AmberChat's "<s>SYSTEM\n###Human: …", ChatQA's "System: …")
        fs = sh.first_sys
        pre = fs[:fs.rfind(user.lstrip())] if fs.rfind(user.lstrip()) >= 0 else ""
        ps = [q for q in lex.pieces(pre) if q[0] or q[1].strip()]
        k = 0
        while k < len(ps) and ps[k][0] and ps[k][1] not in openers:
            k += 1
        rest = "".join(p for _, p in ps[k:])
        if SYS in rest and not any(m for m, _ in ps[k:]):
            preamble = list(dict.fromkeys(preamble + [p for _, p in ps[:k]]))
            bare = True
    if "system" in sh.first:
        head = sh.first["system"]
        for p in preamble:   # the BOS the first turn always has
            if head.startswith(p):
                head = head[len(p):]
        c = _cut_head(lex, head, openers)
        no_close = not _term_parts(lex, sh.terms.get("system"))[0]
        if c.opener is not None and c.opener not in openers and not c.rest and no_close \
                and c.opener not in lex.extra:
            c = _Head(c.glue + [c.opener], None, [])
        if c.opener is None or (c.opener not in openers and c.opener in lex.extra
                                and not c.rest and not c.opener.endswith((":", "："))):
            bare = True
        else:
            cut["system"] = c
        preamble = list(dict.fromkeys(preamble + list(c.glue)))
    if sh.tool_head is not None and sh.tool_head.strip():
        c = _cut_head(lex, sh.tool_head, openers | {cut.get("system", cut["user"]).opener})
        if c.opener:
            cut["tool"] = c
    return cut, preamble, bare


def _folded_system_turn(lex: _Lexicon, sh: _Shape, user: str, openers: set) -> None:
    """A system message rendered only once a user message follows it, as a turn of its own
    (saiga: ``<s>system\nS</s>\n<s>user\n…``, printed at the first user turn): its header
    (an opener of the other turns, then text) and terminator (a marker) are the system's."""
    fs = sh.first_sys
    if fs is None or "system" in sh.first or not user.strip() or SYS not in fs:
        return
    at = fs.rfind(user.lstrip())
    if at < 0:
        return
    head, term = fs[:fs.index(SYS)], fs[fs.index(SYS) + len(SYS):at]
    ps = [q for q in lex.pieces(head) if q[0] or q[1].strip()]
    tm = [q for q in lex.pieces(term) if q[1].strip()]
    if len(ps) >= 2 and ps[-2][0] and ps[-2][1] in openers and not ps[-1][0] and tm \
            and tm[0][0] and all(m for m, _ in tm):
        sh.first["system"] = head
        sh.terms.setdefault("system", term)


def _close(plan: _Plan, lex: _Lexicon, sh: _Shape, roles: list[str]) -> dict | None:
    """The close of an element: the terminators' first markers (a role whose terminator
    holds the others' close further on — a tool result's ``</tool_response><|im_end|>`` —
    closes with that one), the markers right after them, and the roles that have one."""
    parts = {r: _term_parts(lex, sh.terms.get(r)) for r in roles}
    firsts = [parts[r][0][0] for r in ("assistant", "user", "system") if r in parts
              and parts[r][0]]
    primary = max(firsts, key=firsts.count) if firsts else None
    if primary is None and roles == ["tool"]:
        # a tool turn with an opener of its own (_joined_openers) closes as the others do
        every = [_term_parts(lex, sh.terms.get(r))[0] for r in ("assistant", "user", "system")]
        firsts = [m[0] for m in every if m]
        primary = max(firsts, key=firsts.count) if firsts else None
    closes: list[str] = []
    after: list[str] = []
    with_close: list[str] = []
    for r in roles:
        marks, ws = parts[r]
        plan.between = plan.between or ws
        term = sh.terms.get(r) or ""
        if marks and term.endswith(marks[-1] + term[term.rfind(marks[-1]) + len(marks[-1]):]):
            tail = term[term.rfind(marks[-1]) + len(marks[-1]):]
            if tail and not tail.strip():
                plan.ws_after.setdefault(marks[-1], set()).add(tail)
        if primary and primary not in marks and marks and r == "tool":
            # Hermes' tool turn ends '</tool_response>\n<|im_end|>': the others' close, further
            # on after whitespace, closes it too (the wrapper is text of its body)
            ps = [q for q in lex.pieces(term) if q[0] or q[1].strip()]
            if len(ps) > 1 and not ps[0][0]:
                ps = ps[1:]   # text before the close is body (a quoted result's '"}')
            names = [p for _, p in ps]
            if primary in names and all(m for m, _ in ps[:names.index(primary)]):
                marks = names[names.index(primary):]
                marks = marks[:next((k for k, (m, _) in enumerate(ps[names.index(primary):])
                                     if not m), len(marks))]
        if primary in marks:
            marks = marks[marks.index(primary):]
        if marks and term[:1].isspace() and term.lstrip().startswith(marks[0]):
            # Apriel 1.6's '\n<|end|>': the newline is the close's, not the reply's
            plan.ws_before.setdefault(marks[0], set()).add(term[:len(term) - len(term.lstrip())])
        if marks:
            closes.append(marks[0])
            after.extend(marks[1:])
            with_close.append(r)
    if not closes:
        return None
    out: dict = {"markers": [plan.m(c) for c in dict.fromkeys(closes)]}
    extra = [a for a in dict.fromkeys(after) if a not in closes]
    if extra:
        out["after"] = [plan.m(a) for a in extra]
    known = [r for r in roles if r in sh.terms]
    if len(with_close) < len(known):
        out["roles"] = sorted(set(with_close))
    return out


def _turn_element(plan: _Plan, lex: _Lexicon, sh: _Shape, opener: str,
                  roles: dict) -> tuple[str, dict]:
    where = "role header" + ("s " if len(roles) > 1 else " ") + ", ".join(roles)
    el: dict = {"open": plan.m(opener)}
    if len(roles) == 1:
        r, c = next(iter(roles.items()))
        name = f"{r}_turn"
        el["role"] = r
        rest = list(c.rest)
        if len(rest) >= 2 and not rest[0][0] and rest[1][0]:
            el["header"] = {"until": plan.m(rest[1][1]), "max_tokens": 32}
            if r == "assistant":   # other roles never train: their header may say anything
                el["header"]["pattern"] = re.escape(rest[0][1])
            rest = rest[2:]
        elif rest and rest[0][0]:
            el["header"] = {"until": plan.m(rest[0][1]), "max_tokens": 32}
            rest = rest[1:]
        if r == "assistant" and rest:
            if len(rest) > 1 or rest[0][0]:
                raise InferenceError("the assistant header "
                                     f"{opener + ''.join(p for _, p in c.rest)!r} is not "
                                     "an opener, a header and a literal", where=where)
            el["lead"] = rest[0][1]
    else:
        name = "turn"
        kind, sep, pat, lead = _role_names(roles, lex, where, opener, sh.renders)
        el["header"] = {kind: plan.m(sep) if kind == "until" else sep,
                        "pattern": pat["pattern"], "max_tokens": 32}
        plan.aliases.update(pat["aliases"])
        if sh.renamed and "assistant" in roles:
            # the prompt's name for the assistant reads as the assistant (_renamed_prompt)
            if not re.search(r"[(|]" + re.escape(re.escape(sh.renamed[1])) + r"[|)]",
                             pat["pattern"]):
                pat["pattern"] = pat["pattern"].replace(
                    "(?P<role>", "(?P<role>" + re.escape(sh.renamed[1]) + "|", 1)
            plan.aliases[sh.renamed[1]] = "assistant"
        if lead:
            el["lead"] = lead
        roles = {r: c for r, c in roles.items() if r not in pat["dup"]}
    close = _close(plan, lex, sh, list(roles))
    if close:
        el["close"] = close
    return name, el


def _opener_turns(plan: _Plan, lex: _Lexicon, sh: _Shape, opener: str, roles: dict) -> list:
    """The elements of the roles sharing ``opener``: one turn element (role names read from
    the header), or one per role where whole headers tell them apart (:func:`_joined_openers`)."""
    # a prompt naming the assistant otherwise is told by whole headers: the checker's oracle
    # (and a reader) then sees the prompt's header as one marker
    split = _joined_openers(lex, sh, opener, roles) \
        if sh.renamed and "assistant" in roles and len(roles) > 1 else None
    try:
        if not split:
            return [_turn_element_or_merged(plan, lex, sh, opener, roles)]
    except InferenceError as exc:
        split = _joined_openers(lex, sh, opener, roles)
        if split is None:
            raise
        sh.unjoined = exc
    return [_turn_element(plan, lex, sh, c.opener, {r: c}) for r, c in split.items()]


def _joined_openers(lex: _Lexicon, sh: _Shape, opener: str, roles: dict) -> dict | None:
    """Roles sharing an opener whose role names no common separator ends (hydrology's
    ChatML writes ``<|im_start|>user\n`` but ``<|im_start|>assistant`` glued to the reply;
    Asimov's ``### user: `` / ``### assistant: ``): each role's whole header, opener and
    role text, becomes one soft opener marker of its own, so the roles are told by it (the
    ``role_by_marker`` shape); None where a header holds another marker or two are alike."""
    texts = {}
    for r, c in roles.items():
        if c.glue or not c.rest or c.rest[0][0] or not c.rest[0][1].strip():
            return None
        # what follows the role text (a tool's <tool_response>) is body, as with role names
        texts[r] = opener + c.rest[0][1]
        if any(v in texts[r] for v in _ALL):
            return None   # a value in the header (a tool's name): no fixed opener
    for r in [r for r in texts if r != "assistant"]:
        # an untrained role written exactly as another (Qwen's tool results as user turns):
        # the user's header (or the first's) stands for both; they parse as that role
        twin = next((q for q in texts if q != r and q != "assistant" and texts[q] == texts[r]
                     and (q == "user" or (r != "user" and list(texts).index(q) <
                                          list(texts).index(r)))), None)
        if twin is not None:
            del texts[r]
            sh.notes.append(f"{r} messages are rendered as {twin} turns ({texts[twin]!r}): "
                            "they parse as such, never trained")
    if len(set(texts.values())) < len(texts) or any(
            a != b and b.startswith(a) for a in texts.values() for b in texts.values()):
        return None   # one header a prefix of another: the longer could never be read
    lex.extra = tuple(dict.fromkeys(lex.extra + tuple(texts.values())))
    sh.notes.append("the roles' headers share an opener but no separator: each whole header "
                    "is an opener of its own")
    return {r: _Head([], t, []) for r, t in texts.items()}


def _turn_element_or_merged(plan: _Plan, lex: _Lexicon, sh: _Shape, opener: str,
                            roles: dict) -> tuple[str, dict]:
    """:func:`_turn_element`; where tool results share another untrained role's opener with a
    header the role-name forms cannot read (sglang's Phi-4-mini writes a tool result as
    ``<|user|>\\nTool response for NAME:\\n…``), the tool turn is a turn of that role: its text
    is that role's body, which never trains (verification then checks the masks)."""
    try:
        return _turn_element(plan, lex, sh, opener, roles)
    except InferenceError:
        if "assistant" in roles or len(roles) < 2:
            raise
    others = {r: c for r, c in roles.items() if r != "tool"}
    if len(others) > 1 and len({"".join(p for _, p in c.rest) for c in others.values()}) == 1:
        # untrained roles written exactly alike (FairMind's Phi-3 prints a system message as
        # a user turn): one of them, the user's, stands for all
        keep = "user" if "user" in others else next(iter(others))
        sh.notes.append(f"{', '.join(r for r in others if r != keep)} messages are rendered "
                        f"as {keep} turns: they parse as such, never trained")
        others = {keep: others[keep]}
    elif len(others) == len(roles):
        raise InferenceError(f"the headers of roles {', '.join(roles)} after {opener!r} "
                             "cannot be told apart and have no common form", where="role headers")
    if "tool" in roles:
        sh.notes.append(f"tool results are rendered as {'/'.join(others)} turns (opener "
                        f"{opener!r}): they parse as such, never trained")
    return _turn_element(plan, lex, sh, opener, others)


def _renamed_opener(plan: _Plan, lex: _Lexicon, sh: _Shape) -> None:
    """Where the generation prompt names the assistant otherwise (``sh.renamed``) and the
    assistant turn has an opener of its own holding the history's name, the prompt's form of
    that opener opens an assistant turn too."""
    if not sh.renamed:
        return
    texts = {n: t for t, n in plan.names.by_text.items()}
    for e in plan.top:
        el = plan.elements[e]
        t = texts.get(el.get("open")) if isinstance(el.get("open"), str) else None
        if el.get("role") != "assistant" or not t or sh.renamed[0] not in t:
            continue
        k = t.rindex(sh.renamed[0])
        alt = t[:k] + sh.renamed[1] + t[k + len(sh.renamed[0]):]
        lex.extra = tuple(dict.fromkeys(lex.extra + (alt,)))
        el["open"] = [el["open"], plan.m(alt)]


def _blocks(plan: _Plan, sh: _Shape) -> list[str]:
    """The think and tool-call elements; returns the children a turn may hold."""
    children = []
    if sh.think:
        plan.elements["think"] = {"open": plan.m(sh.think[0]),
                                  "close": {"markers": [plan.m(sh.think[1])]}, "kind": "think"}
        children.append("think")
    if sh.call:
        open_, close, inner = sh.call
        el: dict = {"open": plan.m(open_), "kind": "tool_call"}
        if close:
            el["close"] = {"markers": [plan.m(close)]}
        else:
            el["ends_with_parent"] = True
            inner = (open_,) + tuple(inner)   # one block per reply: calls repeat the opener
        inner = [plan.m(x) for x in dict.fromkeys(inner) if x != close]
        if inner:
            el["inner_markers"] = inner
        plan.elements["tool_call"] = el
        children.append("tool_call")
    return children


def _reply(plan: _Plan, lex: _Lexicon, sh: _Shape, h_a: str) -> dict:
    """The headerless assistant reply that follows the other turns (Mistral's after
    ``[/INST]``)."""
    close = _close(plan, lex, sh, ["assistant"])
    if close is None:
        raise InferenceError("assistant turns have neither a header nor a terminator",
                             where="role headers")
    el = {"role": "assistant", "close": close}
    ws = sh.heads.get("assistant") or ""
    if ws and not ws.strip() and not h_a:
        # no generation prompt, and history replies start with whitespace (Ministral 3's
        # '[/INST]\nA</s>'): the header's own line end, not the model's output
        el["lead"] = ws
    return el


def _headerless_replies(plan: _Plan, sh: _Shape) -> None:
    """Headerless assistant replies that may ``follow`` an assistant turn (the answer after a
    dropped tool message) or a tool turn (the answer after a tool result)."""
    a_el = plan.elements.get("assistant_turn") or plan.elements.get("turn")
    if sh.reply_after_reply and a_el is not None and a_el.get("close") \
            and "reply" not in plan.elements:
        plan.elements["reply_after_reply"] = {
            "role": "assistant", "close": json.loads(json.dumps(a_el["close"])),
            "follow": "reply_after_reply"}
        a_el["follow"] = "reply_after_reply"
    t_el = plan.elements.get("tool_turn")
    if sh.after_tool_head is not None and not sh.after_tool_head.strip() and t_el is not None \
            and t_el.get("close") and "reply" not in plan.elements and a_el is not None \
            and a_el.get("close"):
        # the answer after a tool result has no header of its own (DeepSeek-R1-Distill:
        # '<｜tool▁outputs▁end｜>It is sunny…<｜end▁of▁sentence｜>'): a headerless assistant reply
        # may follow a tool turn
        plan.elements["reply_after_tool"] = {
            "role": "assistant", "close": {"markers": list(a_el["close"]["markers"])}}
        t_el["follow"] = "reply_after_tool"


#: Headerless assistant elements (``follow`` targets): they hold the same blocks as a turn.
_REPLIES = ("reply", "reply_after_reply", "reply_after_tool")


def _loose_markers(plan: _Plan) -> list[str]:
    """The plan's markers no element opens, ends a header at, or closes with: markers that may
    stand inside a turn's body (``inner_markers``)."""
    structural = set()
    for el in plan.elements.values():
        o = el.get("open")
        structural.update([o] if isinstance(o, str) else o or [])
        for h in (el.get("header") or {}, (el.get("close") or {}).get("header") or {}):
            if h.get("until"):
                structural.add(h["until"])
        structural.update((el.get("close") or {}).get("markers", []))
        structural.update((el.get("close") or {}).get("after", []))
    return [n for n in plan.names.by_text.values() if n not in structural]


def _system_text(plan: _Plan, lex: _Lexicon, sh: _Shape, cut: dict, children: list) -> dict:
    """The element of a bare system text before the first turn."""
    el: dict = {"role": "system"}
    # a bare system text ended by a marker (Taiwan-LLM's 'SYSTEM TEXT</s>USER: …',
    # TenyxChat's 'System:…<|end_of_turn|>'): that marker closes it
    marks = _term_parts(lex, sh.terms.get("system"))[0]
    if not marks and sh.first.get("user"):
        ps = [q for q in lex.pieces(sh.first["user"]) if q[0] or q[1].strip()]
        k = next((i for i, q in enumerate(ps) if not q[0]), None)
        if k is not None:
            marks = [p for _, p in ps[k + 1:k + 2] if _] if len(ps) > k + 1 and \
                ps[k + 1][0] and ps[k + 1][1] not in lex.extra and \
                ps[k + 1][1] not in {c.opener for c in cut.values()} else []
    if marks:
        el["close"] = {"markers": [plan.m(marks[0])]}
    if children:
        el["children"] = list(children)
    return el


def _prompts_and_plain_text(spec: dict, sh: _Shape, h_a: str, betweens: list) -> None:
    """The spec's generation prompts, and what it declares written as plain text (a policy
    that drops such calls or reasoning then warns: runtime.policy.warn_untyped)."""
    # a rendering that ends with the header short of its trailing space is a prompt too
    # (sglang's Sarashina prints '### Assistant:' after a last user message whatever
    # add_generation_prompt says, its replies '### Assistant: …'): unlisted, that empty last
    # turn was the reply last_turn_only trained
    bare_h = [h_a.strip()] if h_a.strip() != h_a.lstrip() and any(
        r.endswith(h_a.strip()) for r in sh.renders) else []
    gens = [g for g in dict.fromkeys([h_a.lstrip()] + sh.gens + bare_h) if g]
    # a prompt that starts with a between-turn marker (Aya's '<|START_OF_TURN_TOKEN |>' before
    # '<|CHATBOT_TOKEN |>', the turn's opener): the final turn is what follows it
    gens = list(dict.fromkeys(gens + [g[len(b):] for g in gens for b in betweens
                                      if g.startswith(b) and g[len(b):].strip()]))
    gens = list(dict.fromkeys(gens + _switched_prompts(gens, h_a)))
    if gens:
        spec["generation_prompt"] = gens
    if sh.plain_calls:
        spec["plain_text_tool_calls"] = True
    if sh.plain_reasoning:
        spec["plain_text_reasoning"] = True


def _switched_prompts(gens: list, h_a: str) -> list:
    """A prompt that writes a switch in words before the assistant header, which history
    replies lack (LongCat-Flash-Chat's ``/think_off ASSISTANT:<longcat_think>…``, replies
    `` ASSISTANT:A``): the switch is read as the last turn's text, so the prompt's final turn
    is what follows it, from the header on (with the whitespace before it, and without)."""
    head = h_a.strip()
    out = []
    for g in gens:
        at = g.find(head) if head else -1
        if at <= 0 or not g[:at].strip() or _MARKERISH.search(g[:at]):
            continue
        ws = len(g[:at]) - len(g[:at].rstrip())
        out += [g[at:], g[at - ws:]] if ws else [g[at:]]
    return out


def _design(lex: _Lexicon, sh: _Shape, h_a: str, tokenizer: Any, name: str) -> dict:
    """The spec (a plain dict) the shape describes."""
    plan = _Plan()
    cut, preamble, bare = _heads(lex, sh, h_a)
    glue: list[str] = []
    groups: dict = {}
    for r, c in cut.items():
        glue.extend(g for g in c.glue if g not in preamble or r != "system")
        groups.setdefault(c.opener, {})[r] = c
    for opener, roles in groups.items():
        same = "tool" in roles and "assistant" in roles and (
            "".join(p for _, p in roles["tool"].rest).strip()
            == "".join(p for _, p in roles["assistant"].rest).strip())
        if same or ("tool" in roles and "assistant" in roles and opener is None):
            # tool results rendered like assistant turns: no spec can tell them apart (the
            # tool cases of the matrix then fail verification, with that reason)
            sh.notes.append("tool results are rendered with the assistant's header")
            roles = {r: c for r, c in roles.items() if r != "tool"}
        if opener is not None:
            for ename, el in _opener_turns(plan, lex, sh, opener, roles):
                plan.elements[ename] = el
                plan.top.append(ename)
            continue
        if set(roles) - {"assistant"}:
            raise InferenceError(f"{', '.join(sorted(set(roles) - {'assistant'}))} turns have "
                                 "no header to tell them by", where="role headers")
        plan.elements["reply"] = _reply(plan, lex, sh, h_a)
    _headerless_replies(plan, sh)
    _renamed_opener(plan, lex, sh)
    if sh.decl:
        plan.elements["tool_declarations"] = {"open": plan.m(sh.decl[0]), "role": "system",
                                              "close": {"markers": [plan.m(sh.decl[1])]}}
        plan.top.append("tool_declarations")
    for k, (o, c) in enumerate(sh.blocks):
        bname = "fixed_block" + (str(k + 1) if k else "")
        plan.elements[bname] = {"open": plan.m(o), "role": "system",
                                "close": {"markers": [plan.m(c)]}}
        plan.top.append(bname)
    if sh.decl_text:
        close, inner = sh.decl_text
        el = {"role": "system", "close": {"markers": [plan.m(close)]}} if close else \
            {"role": "system"}
        if inner:
            el["inner_markers"] = [plan.m(x) for x in inner]
        plan.elements["tool_declarations_text"] = el
    children = _blocks(plan, sh)
    for ename, el in plan.elements.items():
        if ename in plan.top or ename in _REPLIES:
            if children:
                el["children"] = list(children)
            if "reply" in plan.elements and ename in plan.top:
                if "close" not in el:
                    raise InferenceError("a turn before a headerless assistant reply has no "
                                         "terminator to end at", where=f"element {ename}")
                el["follow"] = "reply"
    loose = _loose_markers(plan)
    for ename, el in plan.elements.items():
        if (ename in plan.top or ename in _REPLIES) and loose:
            el["inner_markers"] = list(loose)
    glue = [g for g in dict.fromkeys(glue + sh.glue)]
    closing = [c for c in sh.closing if lex.pieces(c) and all(m for m, _ in lex.pieces(c))]
    betweens = list(dict.fromkeys(glue + [p for c in closing for _, p in lex.pieces(c)]))
    opener_texts = {t for t, n in plan.names.by_text.items()
                    for e in plan.top if plan.elements[e].get("open") == n}
    betweens = [b for b in betweens if b not in opener_texts]   # the next turn's header
    preamble = [p for p in preamble if p not in betweens]
    if bare:
        plan.elements["system_text"] = _system_text(plan, lex, sh, cut, children)
    spec: dict = {
        "name": name,
        "description": "Inferred from a chat template by chatgrammar.infer_format and verified "
                       "against it over the validate --template matrix.",
        "markers": {},
        "elements": plan.elements,
        "top": plan.top,
    }
    pre = [plan.m(p) for p in preamble] + (["tool_declarations_text"] if sh.decl_text else []) \
        + (["system_text"] if bare else [])
    if pre:
        spec["preamble"] = pre
    if plan.between or "reply" not in plan.elements:
        spec["between"] = "\\s*"
    if betweens:
        spec["between_markers"] = [plan.m(b) for b in betweens]
    # markers between turns or only at the very end (InternLM2's '</s>' after the last reply,
    # Apriel 1.5's after every reply): a candidate ends the turns with them (close.after)
    spec["_closing"] = [plan.m(b) for b in betweens]
    if plan.aliases:
        spec["role_aliases"] = dict(plan.aliases)
    _prompts_and_plain_text(spec, sh, h_a, betweens)
    spec["policy"] = {"roles": ["assistant"]}
    if "tool results are rendered with the assistant's header" in sh.notes:
        spec["_alternate"] = True
    spec["_ws_after"] = {plan.m(t): next(iter(w)) for t, w in plan.ws_after.items()
                         if len(w) == 1}
    spec["_lstrip_close"] = {plan.m(t): next(iter(w)) for t, w in plan.ws_before.items()
                             if len(w) == 1}
    spec["markers"] = {n: {"text": t, "special": lex.special(t, tokenizer)}
                       for t, n in plan.names.by_text.items()}
    return spec


# ------------------------------------------------------------------------- verification
@dataclass(frozen=True)
class Verification:
    """How an inferred format was checked against its template.

    Attributes:
        checked: matrix cases rendered and checked (all passed).
        rejected: matrix case -> why the template rejects it (skipped, not failed).
        probes_rejected: probe -> why the template rejects it (recorded, not fatal).
        notes: what inference noticed (a folded system prompt, a header printed by the
            previous turn, reasoning dropped from history …).
        deviations: the documented deviations the checker accepted (:data:`ACCEPTED`: the
            whitespace after a reply the template never closes trains with it), one per kind.
        refused: ``(matrix case, why)`` for the shapes the format refuses on purpose with a
            located ParseError (a template that renders tool results with the assistant's
            header: its tool messages; :data:`TOOL_AS_ASSISTANT`).
        content: ``"parts"`` when the template prints message content only as a list of
            text parts, and the matrix was given content so
            (:func:`chatgrammar.conformance.matrix.as_parts`); ``"sharegpt"`` when it reads
            ShareGPT's ``from`` / ``value`` keys only, and every message was also given so
            (:func:`chatgrammar.conformance.matrix.as_sharegpt`); else ``"string"``.
    """

    checked: tuple = ()
    rejected: tuple = ()
    probes_rejected: tuple = ()
    notes: tuple = ()
    deviations: tuple = ()
    refused: tuple = ()
    content: str = "string"

    def summary(self) -> str:
        """One line: ``verified on 18 matrix cases; the template rejects 2: tool-call, …``."""
        s = f"verified on {len(self.checked)} matrix case{'s' if len(self.checked) != 1 else ''}"
        if self.content == "parts":
            s += " (content as lists of text parts)"
        elif self.content == "sharegpt":
            s += " (messages in ShareGPT's from / value keys)"
        if self.deviations:
            s += "; the whitespace after an unclosed reply trains (unclosed-whitespace)"
        if self.refused:
            s += (f"; refuses {len(self.refused)} on purpose (tool results: a located "
                  "ParseError): "
                  + ", ".join(name for name, _ in self.refused))
        if self.rejected:
            s += (f"; the template rejects {len(self.rejected)}: "
                  + ", ".join(name for name, _ in self.rejected))
        return s


class InferredFormat(Format):
    """A :class:`~chatgrammar.Format` written by :func:`infer_format`.

    Attributes:
        spec_yaml: the spec, as YAML text (save it and ``cg.load_format(path)`` it, or name it
            in ``extends:``).
        verification: the :class:`Verification` it passed.
    """

    spec_yaml: str
    verification: Verification

    def __reduce__(self):
        # picklable for worker processes: rebuilt from its YAML (never from a path)
        return (_from_yaml, (self.spec_yaml, self.verification))


def _from_yaml(text: str, verification: Verification | None = None) -> InferredFormat:
    spec, src = parse_spec(text, "<inferred>")
    fmt = InferredFormat(spec, src)
    fmt.spec_yaml = text
    fmt.verification = verification or Verification()
    return fmt


class _Dumper(yaml.SafeDumper):
    """Readable YAML: strings with control characters double-quoted on one line, markers as
    flow mappings."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    if any(c in data for c in "\n\t\r") or data != data.strip():
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style='"')
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str)


def _emit(spec: dict, header: str) -> str:
    markers = spec.pop("markers")
    body = yaml.dump(spec, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    lines = ["markers:"]
    for name, m in markers.items():
        flow = yaml.dump(m, Dumper=_Dumper, default_flow_style=True, allow_unicode=True,
                         sort_keys=False, width=10 ** 6).strip()
        lines.append(f"  {name}: {flow}")
    spec["markers"] = markers
    head, rest = body.split("elements:", 1)
    text = header + head + "\n".join(lines) + "\nelements:" + rest
    return text if text.endswith("\n") else text + "\n"


def _tags(case: str) -> frozenset:
    from .matrix import shared_case

    try:
        return shared_case(case).tags
    except KeyError:
        return frozenset()


def _messages(case: str) -> list:
    from .matrix import shared_case

    try:
        return list(shared_case(case).messages)
    except KeyError:
        return []


#: Matrix cases a candidate spec is checked on first: one that fails there is not checked on
#: the rest (most candidates fail on these; the survivor is then checked on every case).
_QUICK = ("basic", "no-system", "multi-turn", "tool-call", "parallel-tool-calls")


def _verify(fmt: Format, template: str, variables: dict, tokenizer: Any,
            timeout: float, quick: bool = False, content: str = "string") -> tuple[Any, list]:
    from .matrix import shared_matrix
    from .templates import check_template

    cases = shared_matrix(content)  # (the matrix copied once: the check only reads it)
    cases = [c for c in cases if c.name in _QUICK] if quick else cases

    # the one deviation a bundled closeless format (falcon, sea-lion, nemotron4) also makes,
    # in the checker's precise shape: an assistant turn the template never closes ends where
    # the next turn opens, and the whitespace the template writes there trains with it
    res = check_template(fmt, template, name="template", variables=variables,
                         tokenizer=tokenizer, timeout=timeout, accepted=ACCEPTED, refused={},
                         cases=cases)
    if res.error:
        raise InferenceError(res.error, where="verification")
    fails = [c for c in res.cases if c.status == "fail"]
    return res, fails


#: The deviations an inferred spec may make (:data:`chatgrammar.conformance.templates.DEVIATION_SHAPES`),
#: reported in ``Verification.deviations``.
ACCEPTED = {"unclosed-whitespace": "docs/inference.md, turns without a terminator: the "
                                   "whitespace before the next turn trains with the reply"}

# ------------------------------------------------------------------------------ the entry
#: Per-render time limit (seconds) of the probes and of verification.
TIMEOUT = 10.0
_CACHE_SIZE = 64
_CACHE = LRU(_CACHE_SIZE)   # key -> (spec YAML, Verification): data, rebuilt per hit


def _key(template: str, variables: dict, tokenizer: Any) -> str:
    h = hashlib.sha256(template.encode("utf-8", "surrogatepass"))
    h.update(json.dumps(variables, sort_keys=True, default=repr).encode())
    if tokenizer is not None:
        h.update(type(tokenizer).__name__.encode())
        h.update(json.dumps(sorted(_tokenizer_specials(tokenizer))).encode())
    return h.hexdigest()


def _shape(probe: _Probe, lex: _Lexicon) -> tuple[_Shape, str]:
    """Probe the template; returns the shape and the assistant header."""
    msgs = _BASIC["u-a-u-a"]
    R = probe.render(msgs, shape="u-a-u-a") or probe.render(_BASIC["s-u-a-u-a"],
                                                             shape="s-u-a-u-a")
    if (R is None or U1 not in R) and re.search(r"""\[\s*['"](?:from|value)['"]\s*\]|\.from\b""",
                                               probe.template):
        # a ShareGPT template (`message['from'] == 'human'`, `message['value']`): probed, and
        # verified over the matrix, with every message also in those keys
        probe.sharegpt = True
        S = probe.render(msgs, shape="u-a-u-a (ShareGPT keys)") or probe.render(
            _BASIC["s-u-a-u-a"], shape="s-u-a-u-a (ShareGPT keys)")
        if S is None or U1 not in S:
            probe.sharegpt = False   # not that either (and what it rejected is not said)
            for k in [k for k in probe.rejected if k.endswith("(ShareGPT keys)")]:
                del probe.rejected[k]
        else:
            R = S
            probe.cache.clear()
            probe.rejected.clear()
    if R is None or U1 not in R:
        # a template that prints content only as a list of text parts (the multimodal
        # layout: `for part in message.content`), dropping or rejecting a string: probed,
        # and verified over the matrix, with content so given (verification.content)
        probe.parts = True
        P = probe.render(msgs, shape="u-a-u-a (content parts)") or probe.render(
            _BASIC["s-u-a-u-a"], shape="s-u-a-u-a (content parts)")
        if R is not None and (P is None or U1 not in P):
            raise InferenceError("the template does not print message content, neither as a "
                                 "string nor as a list of text parts", where="probe u-a-u-a")
        if P is None or U1 not in P:
            probe.parts = False   # rejected either way: _basic says why
        else:
            probe.cache.clear()
            probe.rejected.clear()
    sh = _Shape()
    if probe.sharegpt:
        sh.notes.append("the template reads ShareGPT's message keys (from / value): verified "
                        "with every message also given so")
    if probe.parts:
        sh.notes.append("the template prints message content only when it is a list of text "
                        "parts: verified with content so given (a string content prints "
                        "nothing, and trains nothing)")
    probe.forced = _forced_suffix(probe)
    if probe.forced:
        sh.notes.append(f"every rendering ends with {probe.forced!r} (a generation prompt "
                        "printed even without add_generation_prompt)")
    _basic(probe, lex, sh)
    g = _generation(probe, lex, sh)
    if not (g or "").strip() and probe.forced:
        g = probe.forced   # the prompt printed after every conversation is the generation one
    h_a = _assistant_header(lex, sh, g)
    for ws, extra in dict.fromkeys(probe.prefills):
        # also with the whitespace before it, which an lstrip opener takes into the last turn
        sh.gens += [h_a.lstrip() + extra] + ([ws + h_a.lstrip() + extra] if ws else [])
        sh.notes.append(f"the generation prompt is always printed and prefills {extra!r}, "
                        "which history replies lack")
    _reasoning(probe, lex, sh, h_a)
    _tools(probe, lex, sh, h_a)
    _declaration_text(probe, lex, sh)
    sh.renders = [t for t in probe.cache.values() if t]
    if sh.after_tool_head is not None and sh.after_tool_head.strip() != h_a.strip() \
            and sh.heads.get("assistant", "").strip() != sh.after_tool_head.strip():
        sh.notes.append(f"assistant turns render differently after a tool turn: "
                        f"{sh.after_tool_head!r} vs {h_a!r}")
    return sh, h_a


def _forced_suffix(probe: _Probe) -> str:
    """The text every rendering ends with whatever its last message (the template prints its
    generation prompt unconditionally), or "": from ``[u]`` and ``[u, a]``, rendered with and
    without ``add_generation_prompt``."""
    r_u = probe.render([_u(U1)], shape="u")
    r_ug = probe.render([_u(U1)], agp=True, shape="u+gen")
    r_ua = probe.render([_u(U1), _a(A1)], shape="u-a")
    if not r_u or r_u != r_ug or not r_ua or U1 not in r_u or A1 not in r_ua:
        return ""
    x, y = r_u[r_u.rfind(U1) + len(U1):], r_ua[r_ua.rfind(A1) + len(A1):]
    ends = [x[::-1], y[::-1]]
    # with no message at all, only the forced prompt is left (Llama-3-style templates whose
    # turns all end with the same <|eot_id|> the prompt would otherwise take)
    r_0 = probe.render([], shape="no messages")
    if r_0:
        ends.append(r_0[::-1])
    n = len(os.path.commonprefix(ends))
    tail = x[len(x) - n:] if n else ""
    # only the assistant's whole header (what precedes its value), never a part of it that
    # the reply goes on from (GLM-Edge ends with "<|assistant|>", its replies with "\n")
    # a marker every turn ends with (<|eot_id|>) is the turn's, not the prompt's: what an
    # assistant turn is followed by before a user turn starts with it too
    r_uau = probe.render([_u(U1), _a(A1), _u(U2)], shape="u-a-u")
    if r_uau and A1 in r_uau and U2 in r_uau:
        between = r_uau[r_uau.find(A1) + len(A1):r_uau.find(U2)]
        ps = _PLAIN.pieces(between)
        if ps and ps[0][0] and tail.startswith(ps[0][1]) and len(tail) > len(ps[0][1]):
            tail = tail[len(ps[0][1]):]
    before = r_ua[:r_ua.rfind(A1)]
    # a history reply may start with whitespace the prompt lacks (theroyallab's
    # '<|end_header_id|>\n' prompt, '<|end_header_id|>\n\nA' replies): that is output
    if not tail.strip() or not (before.endswith(tail) or before.rstrip().endswith(
            tail.rstrip()) and before[len(before.rstrip()):].startswith(tail[len(tail.rstrip()):])):
        return ""
    for text in (x, y):   # never from inside a marker ("|>\n" of two different markers)
        at = len(text) - len(tail)
        if _snap(_PLAIN, text, at) != at or (0 < at and _snap(_PLAIN, text, at + 1) < at):
            return ""
    return tail


def _copy(spec: dict) -> dict:
    return json.loads(json.dumps(spec))


def _variants(spec: dict) -> list[dict]:
    """The designed spec, then the cheap alternatives, in a fixed order: between-turn text or
    not; whitespace before a turn's opener absorbed by it (``lstrip``) instead; the
    terminator joined with its whitespace; the EOS as an optional close; no whitespace lead;
    markers after the terminator; no tool-call block; last, optional terminators."""
    ws_after = spec.pop("_ws_after", {})
    eos = spec.pop("_eos", None)
    closing = spec.pop("_closing", [])
    nolead = spec.pop("_nolead", False)
    alternate = spec.pop("_alternate", False)
    ws_before = spec.pop("_lstrip_close", {})
    trailing = spec.pop("_trailing", False)
    gen_ws = spec.pop("_gen_ws", [])
    out = [spec]
    alt = _copy(spec)
    if "between" in alt:
        del alt["between"]
    else:
        alt["between"] = "\\s*"
    out.append(alt)
    out.append(_lstrip_variant(spec))
    if ws_before:   # whitespace before a terminator marker belongs to it, not to the body
        out += _each(out, lambda cand: _ws_joined_close(cand, ws_before))
    if alternate:   # tool results with the assistant's header: answers only after questions
        out[:0] = _closed_by_next(spec, _lstrip_variant(spec), alternate=alternate)
    lstripped = _lstrip_variant(spec)
    if "reply_after_reply" in spec["elements"]:
        # no answer right after an answer (the template drops tool messages): the dropped
        # tool shapes are then refused, and the terminator needs no whitespace of its own
        out += [_without_reply_after_reply(c) for c in (spec, alt, lstripped)]
    out += _closed_by_next(spec, lstripped)
    if closing:   # InternLM2's '<|im_end|>\n</s>': the '</s>' takes the newline before it
        for base in (spec, lstripped):
            alt = _closing_after(base, closing)
            alt["between"] = "\\s*"
            for m in closing:
                alt["markers"][m]["lstrip"] = True
            out.append(alt)
    out += _joined_terminators(spec, lstripped, ws_after, bool(closing))
    out += _eos_variants(spec, lstripped, eos)
    out += [c for c in (_bare_reasoning_close(spec), _bare_reasoning_close(lstripped))
            if c is not None]
    out += [c for c in (_trimmed(spec), _trimmed(lstripped)) if c is not None]
    if nolead:
        out += _each(out, _without_lead)
        out += _each(out, _trained_role_line)
    if closing:
        out += _each(out, lambda cand: _closing_after(cand, closing))
    blocks = [n for n, el in spec["elements"].items() if el.get("kind") == "tool_call"]
    if blocks:
        # before giving the calls up as plain text: a call block that may be unclosed (the
        # system prompt's tool instructions print its opener alone)
        out += [c for c in (_open_blocks(b, blocks) for b in (spec, lstripped)) if c is not None]
        out += _each(out, lambda cand: _without_blocks(cand, blocks))
    # last resort, after every strict candidate: a turn's terminator may be missing, the turn
    # then ends at the next turn's opener (Falcon-H1 / Bielik leave the tool-declaring system
    # turn without <|im_end|>; the bundled chatml says the same). Roles are still told by the
    # header, so nothing is trained that a strict spec would not train.
    out += _each(out, _optional_close)
    for cand in out:
        if trailing and "between" not in cand:
            cand["trailing"] = "\\s*"
        if gen_ws and any(m.get("lstrip") for m in cand["markers"].values()):
            # an opener that lstrips takes the whitespace before a final prompt into the last
            # turn (a template indented in Jinja writes "\n    " before it): that turn, with
            # its whitespace, is the prompt too
            gens = cand.get("generation_prompt", [])
            cand["generation_prompt"] = list(dict.fromkeys(
                gens + [w + g for g in gens for w in gen_ws if not g[:1].isspace()]))
    # identical candidates once; at most _MAX_CANDIDATES, in this order (deterministic: the
    # combinations of several alternatives come last and are the first to go)
    seen, uniq = set(), []
    for cand in out:
        key = json.dumps(cand, sort_keys=True)
        if key not in seen:
            seen.add(key)
            uniq.append(cand)
    return uniq[:_MAX_CANDIDATES]


def _ws_joined_close(cand: dict, ws_before: dict) -> dict:
    """``cand`` with each close marker of ``ws_before`` (name -> the whitespace a terminator
    always has before it) joined with that whitespace into one soft marker: Apriel 1.6 ends a
    reply with '\n<|end|>', and a reply's text ending in that newline (lstrip takes only a
    whitespace-only run) is not the model's output."""
    alt = _copy(cand)
    for name, ws in ws_before.items():
        new = name + "_ws_before"
        alt["markers"][new] = {"text": ws + alt["markers"][name]["text"], "special": False}
        for el in alt["elements"].values():
            close = el.get("close") or {}
            if name in close.get("markers", []):
                close["markers"] = [new if n == name else n for n in close["markers"]]
        # an input ending in that whitespace ends inside the joined marker, which text mode
        # leaves out of the parse: a generation prompt ending with it is seen without it
        gens = alt.get("generation_prompt", [])
        alt["generation_prompt"] = list(dict.fromkeys(
            gens + [g[:len(g) - len(ws)] for g in gens if g.endswith(ws) and g[:-len(ws)]]))
    return alt


def _without_reply_after_reply(cand: dict) -> dict:
    alt = _copy(cand)
    del alt["elements"]["reply_after_reply"]
    for el in alt["elements"].values():
        if el.get("follow") == "reply_after_reply":
            del el["follow"]
    return alt


def _joined_follow(cand: dict) -> bool:
    """A terminator joined with its whitespace so that an answer right after an answer (a
    dropped tool message) can follow it: exact output masks, but ``end_marker`` trains the
    whitespace. A candidate without that answer (the tool shapes refused) is preferred."""
    return "reply_after_reply" in cand["elements"] and any(
        n.endswith("_ws") for n in cand["markers"])


def _each(out: list, make: Any) -> list:
    """``make(candidate)`` for each candidate so far, where it changes something."""
    return [alt for alt in (make(cand) for cand in list(out)) if alt is not None]


def _lstrip_variant(spec: dict) -> dict:
    alt = _copy(spec)
    alt.pop("between", None)
    for name in alt["top"]:
        o = alt["elements"][name].get("open")
        for m in [o] if isinstance(o, str) else o or []:
            alt["markers"][m]["lstrip"] = True
    used = {m for el in alt["elements"].values()
            for m in (el.get("close") or {}).get("markers", [])}
    # a BOS after the template's indentation (AmberChat), also one printed before every turn
    # (chujiezheng's Mistral: '        <s>[INST] …', a between-turn marker)
    for m in alt.get("preamble", []) + alt.get("between_markers", []):
        if m in alt["markers"] and m not in used:   # (OLMo's EOS is also its BOS)
            alt["markers"][m]["lstrip"] = True
    return alt


#: The role whose turn follows a turn of this role in every conversation the matrix holds.
_NEXT_ROLE = {"system": "user", "user": "assistant"}


def _turn_names(spec: dict) -> list[str]:
    """The top-level elements and the ``follow`` elements they lead to (the turns)."""
    out = list(spec["top"]) + [e for e in _REPLIES if e in spec["elements"]]
    for name in out:
        nxt = spec["elements"].get(name, {}).get("follow")
        if nxt and nxt not in out:
            out.append(nxt)
    return out


def _closed_by_next(spec: dict, lstripped: dict, alternate: bool = False) -> list:
    """Turns without a terminator (Tulu's and Alpaca's questions: ``<|user|>\nQ\n`` up to
    the next ``<|assistant|>``) closed by the opener of the turn that always follows them,
    which then ``follow``s without its opener (the bundled tulu spec's shape). Every turn then
    has a terminator, so the whitespace after one is between-turn text (``between``) instead of
    a part of the terminator: the end span is the terminator alone, as in the bundled specs.
    The turn keeps its opener in ``top`` too (an answer right after an answer, where the
    template drops tool messages) — except with ``alternate``: a template that renders tool
    results with the assistant's header (Vicuna-era ``else`` branches) then gets a spec in
    which an answer can only follow a question, so a tool result (a second assistant-headed
    turn in a row) is a located ParseError, never trained."""
    out = []
    for base in (lstripped, spec):
        alt = _copy(base)
        els = alt["elements"]
        by_role = {els[n].get("role"): n for n in alt["top"]
                   if els[n].get("open") and els[n].get("role")}
        done: dict = {}

        def close_by_next(name: str) -> bool:
            el = els[name]
            nxt = by_role.get(_NEXT_ROLE.get(el.get("role"), ""))
            if nxt is None or nxt == name or "follow" in el:
                return False
            opener = els[nxt]["open"]
            markers = [opener] if isinstance(opener, str) else list(opener)
            if nxt not in done:
                copy = {k: v for k, v in _copy(els[nxt]).items() if k != "open"}
                cname = done[nxt] = f"{els[nxt]['role']}_after_opener"
                els[cname] = copy
                if "close" not in copy and not close_by_next(cname):
                    return False
                if copy.get("role") == "assistant":
                    _lead_prompt(alt, opener, copy)
            el["close"] = {"markers": markers, "follow_after": list(markers)}
            el["follow"] = done[nxt]
            return True

        # a bare system text after the BOS (Alpaca's, Vicuna's): a system turn opened by the
        # BOS, as the bundled alpaca spec says (empty when there is no system message)
        pre = alt.get("preamble", [])
        bare = [n for n in pre if n in els and "open" not in els[n] and "close" not in els[n]]
        if bare:
            at = pre.index(bare[0])
            if bare != pre[at:at + 1] or els[bare[0]].get("role") != "system":
                continue
        headed = False
        if bare and at > 0 and pre[at - 1] in alt["markers"]:
            els[bare[0]]["open"] = pre[at - 1]
            alt["preamble"] = pre[:at - 1] + pre[at + 1:]
            alt["top"].insert(0, bare[0])
        elif bare:
            # no marker before it (Vicuna 1.1's 'SYSTEM TEXT\n\nUSER: …'): the system text is
            # the header of an opener-less question that runs up to the user's opener, as the
            # bundled vicuna spec says; the same element takes the whitespace before every
            # later question, so there is no between-turn text
            user = by_role.get("user")
            if user is None or not isinstance(els[user].get("open"), str):
                continue
            del els[bare[0]]
            els["question_after_text"] = {"role": "user", "header": {
                "until": els[user]["open"], "max_tokens": 4096}}
            alt["preamble"] = pre[:at] + pre[at + 1:]
            alt["top"].insert(0, "question_after_text")
            if not close_by_next("question_after_text"):
                continue
            headed = True
        if "preamble" in alt and not alt["preamble"]:
            del alt["preamble"]
        closeless = [n for n in alt["top"] if "close" not in els[n] and els[n].get("open")]
        if not (closeless or headed) or not all(close_by_next(n) for n in closeless):
            continue
        if headed:
            alt.pop("between", None)
        else:
            alt["between"] = "\\s*"
        if alternate and not _answers_only_after_questions(alt, done, alternate):
            continue
        out.append(alt)
    return out


def _lead_prompt(alt: dict, opener: Any, copy: dict) -> None:
    """The answer that follows a question's close (``copy``: the opener-less assistant
    element) starts after the opener: a generation prompt is, for it, the lead alone (Vigogne's
    '<|assistant|>:' leaves ':' to the reply; unlisted, that final turn was a reply of its own,
    the one last_turn_only trained)."""
    lead = copy.get("lead")
    if lead and isinstance(lead, str) and isinstance(opener, str) and any(
            g == alt["markers"][opener]["text"] + lead for g in alt.get("generation_prompt", [])):
        alt["generation_prompt"] = list(dict.fromkeys(alt["generation_prompt"] + [lead]))


def _answers_only_after_questions(alt: dict, done: dict, alternate: Any) -> bool:
    """Make ``alt`` (from :func:`_closed_by_next`, ``done``: top element -> its opener-less
    copy) a spec in which an answer only follows a question: the assistant element leaves
    ``top``. ``alternate`` is the generation prompt the template prints after every
    conversation, if any. False when there is no such answer element."""
    els = alt["elements"]
    answers = [n for n in alt["top"] if els[n].get("role") == "assistant" and n in done]
    if not answers or not done.get(answers[0]):
        return False
    alt["top"] = [n for n in alt["top"] if n not in answers]
    opener = els[answers[0]].get("open")
    copy = els.get(done.get(answers[0], ""), {})
    if isinstance(alternate, str) and isinstance(opener, str) and copy.get("close") \
            and alternate.strip() == alt["markers"][opener]["text"].strip():
        # a generation prompt printed after every conversation (StarCoder2-Instruct's
        # '### Response\n'): after an answer its opener may follow the terminator
        # (close.after, never a turn; the checker counts it to the answer's end);
        # text after it is a ParseError
        copy["close"]["after"] = list(dict.fromkeys(copy["close"].get("after", []) + [opener]))
        alt["markers"][opener]["lstrip"] = True
    _lead_prompt(alt, opener, copy)
    used = {v for el in els.values() for k in ("follow", "children")
            for v in ([el[k]] if isinstance(el.get(k), str) else el.get(k) or [])}
    for n in answers:
        if n not in used:
            del els[n]
    return True


def _joined_terminators(spec: dict, lstripped: dict, ws_after: dict, closing: bool) -> list:
    """Turns without a terminator (or a headerless reply that may follow a turn's close, or
    markers after the close) cannot share text with between-turn whitespace: the whitespace a
    terminator is always followed by becomes part of it (soft). A marker of its own: the same
    marker elsewhere (OLMo's <|endoftext|> is also its BOS) stays as is."""
    closeless = [n for n in lstripped["top"] + lstripped.get("preamble", [])
                 if n in lstripped["elements"] and "close" not in lstripped["elements"][n]]
    follows = any("follow" in el for el in lstripped["elements"].values())
    if not ws_after or not (closeless or follows or closing):
        return []
    out = []
    for base in (lstripped, spec):
        alt = _copy(base)
        alt.pop("between", None)
        for name, ws in ws_after.items():
            new = name + "_ws"
            alt["markers"][new] = {"text": alt["markers"][name]["text"] + ws, "special": False}
            for el in alt["elements"].values():
                close = el.get("close") or {}
                for key in ("markers", "after"):
                    if name in close.get(key, []):
                        close[key] = [new if n == name else n for n in close[key]]
        out.append(alt)
    return out


def _eos_variants(spec: dict, lstripped: dict, eos: dict | None) -> list:
    """A layout with no terminator at all (DeciLM's "### User:\n…\n### Assistant:\n…\n"): a
    turn ends where the next opens, or at the EOS a pipeline appends, as the bundled falcon /
    sea-lion specs say. Such a turn is unclosed, so the whitespace the template writes before
    the next turn trains with it: the one accepted deviation (ACCEPTED)."""
    closeless = [n for n in spec["top"] if n in spec["elements"]
                 and "close" not in spec["elements"][n]]
    if not eos or not closeless or any(m["text"] == eos["text"]
                                       for m in spec["markers"].values()):
        return []
    out = []
    for base in (spec, lstripped):
        alt = _copy(base)
        alt["markers"]["eos"] = dict(eos)
        for n in closeless:
            alt["elements"][n]["close"] = {"markers": ["eos"], "required": False}
            # the whitespace the template writes before the next turn is not trained (the
            # spec key `trim_end`, as the bundled falcon / sea-lion specs): no deviation
            alt["elements"][n]["trim_end"] = True
        out.append(alt)
    return out


def _bare_reasoning_close(cand: dict) -> dict | None:
    """A reply header that ends at the reasoning block's closer, read as an empty reasoning
    block instead: Poolside's Laguna writes ``<assistant>\\n</think>\\nA`` for a reply
    without reasoning (its thinking-off prompt ends with that ``</think>``) but the whole
    block, ``<assistant>\\n<think>\\nR\\n</think>\\nA``, for one with reasoning, so a
    header read up to ``</think>`` meets ``<think>`` first. The header's whitespace becomes the
    turn's ``lead`` and the closer alone an element of the reasoning kind with no text (the
    marker only). None when no turn has such a header."""
    alt = _copy(cand)
    blocks = {m: (name, el["kind"]) for name, el in alt["elements"].items()
              if el.get("kind") in ("think", "reasoning") and el.get("open")
              for m in (el.get("close") or {}).get("markers", [])}
    hit = False
    for name in _turn_names(alt):
        el = alt["elements"].get(name)
        head = (el or {}).get("header") or {}
        if el is None or el.get("role") != "assistant" or head.get("until") not in blocks \
                or el.get("lead") is not None or set(head) - {"until", "pattern", "max_tokens"}:
            continue
        pat = head.get("pattern", "")
        lit = re.sub(r"\\(.)", r"\1", pat, flags=re.S)
        if re.fullmatch(pat, lit, re.S) is None or (pat and not lit.isspace()):
            continue   # only a whitespace header: what it reads is then the turn's lead
        block, kind = blocks[head["until"]]
        bare = f"{block}_bare_close"
        alt["elements"][bare] = {"open": head["until"], "text": False, "kind": kind}
        del el["header"]
        if lit:
            el["lead"] = lit
        el["children"] = [c for c in el.get("children", []) if c != bare] + [bare]
        hit = True
    return alt if hit else None


def _trimmed(cand: dict) -> dict | None:
    """Assistant turns without a terminator that do not keep the whitespace they end with
    (``trim_end``): OpenBuddy writes an empty tool-calling reply as 'Assistant: </s>', and
    the space is the header's, not the model's output. None when no such turn."""
    alt = _copy(cand)
    hit = False
    for name in _turn_names(alt):
        el = alt["elements"].get(name)
        if el is not None and el.get("role") == "assistant" and "close" not in el \
                and not el.get("trim_end"):
            el["trim_end"] = True
            hit = True
    return alt if hit else None


def _without_lead(cand: dict) -> dict | None:
    """A template without a generation prompt (aanaphi2's '### Assistant: A\n'): the space
    after the role word is the reply's first character, not a header lead; so is the text
    after a role marker (SLM-ToG's '[ASSISTANT]: A': the prompt would end at the marker)."""
    alt = _copy(cand)
    hit = False
    for el in alt["elements"].values():
        if el.get("role") == "assistant" and el.get("lead") is not None:
            del el["lead"]
            hit = True
    return alt if hit else None


def _trained_role_line(cand: dict) -> dict | None:
    """A template without a generation prompt whose turns share an opener and name the role
    as text (NLPark AnFeng's ChatML: ``<|im_start|>assistant\n…`` with nothing for
    ``add_generation_prompt``): the prompt ends at the opener, so the role line is the model's
    output and trains with the reply (``trained_after`` an empty group at the start of the
    header; only the assistant's turns train, the role still picks the turn)."""
    alt = _copy(cand)
    hit = False
    names = [n for n, r in (alt.get("role_aliases") or {}).items() if r == "assistant"]
    if "assistant" not in (alt.get("role_aliases") or {}):
        names.append("assistant")
    ahead = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    for el in alt["elements"].values():
        h = el.get("header") or {}
        if h.get("until_text") and "(?P<role>" in h.get("pattern", "") \
                and "trained_after" not in h:
            # only an assistant's role line is output (the group takes no part in another
            # role's header, which then stays untrained under any policy)
            h["pattern"] = (f"(?:(?P<out>)(?=(?:{ahead}){re.escape(h['until_text'])}))?"
                            + h["pattern"])
            h["trained_after"] = "out"
            hit = True
    return alt if hit else None


def _closing_after(cand: dict, closing: list) -> dict:
    """Markers between turns or at the very end as ``close.after`` of the top-level turns."""
    alt = _copy(cand)
    alt["between_markers"] = [b for b in alt.get("between_markers", []) if b not in closing]
    if not alt["between_markers"]:
        del alt["between_markers"]
    for ename, el in alt["elements"].items():
        close = el.get("close")
        if ename not in _turn_names(alt):
            continue
        if close and not close.get("header") and not close.get("opens_follow") \
                and not close.get("follow_after"):
            close["after"] = list(dict.fromkeys(close.get("after", []) + closing))
    return alt


def _open_blocks(cand: dict, blocks: list) -> dict | None:
    """Tool-call blocks whose close may be missing (``close.required: false`` on a child):
    Qwen-style tool instructions print `<tool_call>` unclosed ('output the <tool_call> block
    first'); the block then runs to its turn's close or the next block's opener, and the calls
    stay typed (``tool_calls=False`` drops them)."""
    alt = _copy(cand)
    changed = False
    for n in blocks:
        close = alt["elements"][n].get("close")
        if close and alt["elements"][n].get("open") and close.get("required", True):
            close["required"] = False
            changed = True
    return alt if changed else None


def _without_blocks(cand: dict, blocks: list) -> dict:
    """Tool-call markers a system prompt also writes as text ('use <tools> tags like these
    …'): no call block; its markers are loose markers of every body (the call is then trained
    as plain assistant text, the oracle's output all the same)."""
    alt = _copy(cand)
    alt["plain_text_tool_calls"] = True   # (the calls are then plain text: said when dropped)
    loose: list = []
    for n in blocks:
        el = alt["elements"].pop(n)
        o = el.get("open")
        loose += ([o] if isinstance(o, str) else list(o or []))
        loose += (el.get("close") or {}).get("markers", []) + el.get("inner_markers", [])
    for ename, el in alt["elements"].items():
        if "children" in el:
            el["children"] = [c for c in el["children"] if c not in blocks]
            if not el["children"]:
                del el["children"]
        if ename in _turn_names(alt):
            el["inner_markers"] = list(dict.fromkeys(el.get("inner_markers", []) + loose))
    return alt


def _optional_close(cand: dict) -> dict | None:
    opt = _copy(cand)
    changed = False
    for name in opt["top"]:
        close = opt["elements"].get(name, {}).get("close")
        if close and close.get("required", True):
            close["required"] = False
            changed = True
    return opt if changed else None


#: How many candidate specs inference verifies at most for one template.
_MAX_CANDIDATES = 40


_UNKNOWN = re.compile(r"unknown marker '([^']+)'")


def _infer(template: str, variables: dict, tokenizer: Any, name: str) -> InferredFormat:
    probe = _Probe(template, variables, TIMEOUT)
    try:
        return _infer_probed(template, variables, tokenizer, name, probe)
    except InferenceError as exc:
        if not probe.moved:
            raise
        shape, what = next(iter(probe.moved.items()))
        # the reason that matters: a format reads turns in the order they are written, and
        # which message a moved text belongs to is not in the text
        raise InferenceError(f"the template renders messages out of order ({what}, probe "
                             f"{shape}): the text no longer says which reply answers which "
                             f"message; {exc.message}", where=exc.where,
                             details=exc.details) from None


def _infer_probed(template: str, variables: dict, tokenizer: Any, name: str,
                  probe: "_Probe") -> InferredFormat:
    lex = _Lexicon(specials=_tokenizer_specials(tokenizer))
    sh, h_a = _shape(probe, lex)
    notes = list(sh.notes)
    try:
        return _infer_designed(template, variables, tokenizer, name, probe, lex, sh, h_a)
    except InferenceError as exc:
        err = exc
    if sh.decl_text is not None and sh.decl_text[0] is None:
        # closeless bare declarations (LongCat's) that no candidate verifies with: read
        # without them, as before that rule (a bare system text after them, DeepSeek's,
        # makes two closeless elements in a row: an ambiguous grammar)
        sh.decl_text, sh.notes = None, notes
        try:
            return _infer_designed(template, variables, tokenizer, name, probe, lex, sh, h_a)
        except InferenceError as exc:
            err = exc
    if sh.unjoined is not None:
        # read by whole headers (_joined_openers) it did not verify either: the reason the
        # role-name forms gave is the one to report (Harmony's "no common separator")
        raise sh.unjoined from None
    raise err


def _infer_designed(template: str, variables: dict, tokenizer: Any, name: str,
                    probe: "_Probe", lex: _Lexicon, sh: "_Shape", h_a: str) -> InferredFormat:
    spec = _design(lex, sh, h_a, tokenizer, name)
    _counted_headers(spec, sh)
    _call_terminator(spec, sh, lex, tokenizer)
    return _infer_spec(template, variables, tokenizer, name, probe, lex, sh, h_a, spec)


def _infer_spec(template: str, variables: dict, tokenizer: Any, name: str, probe: "_Probe",
                lex: _Lexicon, sh: "_Shape", h_a: str, spec: dict) -> InferredFormat:
    if not [g for g in sh.gens if g.strip()]:
        spec["_nolead"] = True   # no generation prompt: the oracle starts output after the word
    if probe.forced and spec.get("_alternate"):
        spec["_alternate"] = probe.forced   # the prompt printed after every conversation
    full = probe.render([_u(U1), _a(A1), _u(U2), _a(A2)], shape="u-a-u-a")
    if full and full[-1:].isspace():
        # whitespace after the last turn (a template indented in Jinja, Ministral's
        # '</s>\n\n'): where a candidate has no `between` (its openers `lstrip` the
        # whitespace between turns, or a headerless reply follows a turn), that whitespace
        # is no turn and never trains (`trailing`)
        spec["_trailing"] = True
    if sh.gen_ws and spec.get("generation_prompt"):
        spec["_gen_ws"] = list(sh.gen_ws)
    eos = variables.get("eos_token")
    if isinstance(eos, str) and eos.strip() and "eos" not in spec["markers"]:
        spec["_eos"] = {"text": eos, "special": lex.special(eos, tokenizer)}
    # Markers only some matrix shapes render (Kimi-K2's tool-call section markers): the parse
    # names them as unknown; they become loose markers of every turn's body (text of it that
    # is never structure) and the spec is tried again — a few rounds at most.
    # A format that refuses the tool shapes is kept only while no retry parses them too.
    best: InferredFormat | None = None
    for _ in range(8):
        try:
            fmt = _try_variants(template, variables, tokenizer, name, probe, sh, spec)
        except InferenceError as exc:
            found = sorted(set(_UNKNOWN.findall(str(exc) + exc.details)))
            if not found or not _add_loose(spec, found, lex, tokenizer):
                if best is not None:
                    return best
                raise
            continue
        found = sorted(set(_UNKNOWN.findall(" ".join(w for _, w in fmt.verification.refused))))
        if not found or not _add_loose(spec, found, lex, tokenizer):
            return fmt
        best = best or fmt
    return best or _try_variants(template, variables, tokenizer, name, probe, sh, spec)


def _add_loose(spec: dict, texts: list, lex: _Lexicon, tokenizer: Any) -> bool:
    """Declare ``texts`` as markers allowed inside every top-level body; False when nothing
    new was added."""
    known = {m["text"] for m in spec["markers"].values()}
    added = False
    for t in texts:
        if t in known:
            continue
        base = re.sub(r"[^a-z0-9]+", "_", t.lower()).strip("_") or "m"
        base = ("m_" + base if not base[0].isalpha() else base)[:32]
        mname, n = base, 2
        while mname in spec["markers"]:
            mname, n = f"{base}_{n}", n + 1
        spec["markers"][mname] = {"text": t, "special": lex.special(t, tokenizer)}
        for ename in list(spec["top"]) + [e for e in _REPLIES if e in spec["elements"]]:
            el = spec["elements"].get(ename)
            if el is not None:
                el["inner_markers"] = list(dict.fromkeys(el.get("inner_markers", []) + [mname]))
        added = True
    return added


def _try_variants(template: str, variables: dict, tokenizer: Any, name: str, probe: "_Probe",
                  sh: "_Shape", spec: dict) -> InferredFormat:
    spec = json.loads(json.dumps(spec))  # _variants pops keys of its argument
    header = (f"# {name}: inferred by chatgrammar.infer_format from a chat template "
              f"(sha256 {name[9:]}…).\n# Review it, then rename it and add detect: / examples: "
              "to bundle it (docs/inference.md).\n")
    if probe.sharegpt:
        header += ("# Verified with messages in ShareGPT's keys (from / value; the template "
                   "reads no role / content):\n# its .tests.yaml says `content: sharegpt` "
                   "(chatgrammar infer -o writes it).\n")
    if probe.parts:
        # the spec language has no key for it: the saved spec's test facts carry it, so that
        # `chatgrammar validate SPEC --template T` checks it as it was verified
        header += ("# Verified with message content as lists of text parts (the template "
                   "prints no string content):\n# its .tests.yaml says `content: parts` "
                   "(chatgrammar infer -o writes it).\n")
    first_problem: InferenceError | None = None
    fewest: tuple | None = None   # (quick cases failed, failing cases) of first_problem's
    fallback = None   # a candidate that refuses only the tool shapes (a located ParseError)
    for cand in _variants(spec):
        text = _emit(cand, header)
        try:
            fmt = _from_yaml(text)
        except ChatGrammarError as exc:
            first_problem = first_problem or InferenceError(
                f"the inferred spec does not compile: {str(exc).splitlines()[0]}",
                where="compile", details=text)
            continue
        content = probe.shape
        res, fails = _verify(fmt, template, variables, tokenizer, TIMEOUT, quick=True,
                             content=content)
        # a candidate that passes the quick cases got further than one that does not
        got = (2 if fails and not _tool_parse_errors(fails) else 1 if fails else 0, len(fails))
        if not fails or _tool_parse_errors(fails):
            res, fails = _verify(fmt, template, variables, tokenizer, TIMEOUT, content=content)
            got = (got[0], len(fails))
        refused = _refused_tool_shapes(fmt, probe, sh, fails)
        if refused or (not fails and _joined_follow(cand)):
            # kept unless a better candidate comes: one that parses every case with exact
            # end spans > one that refuses only the tool shapes > one whose terminator holds
            # the whitespace after it (end_marker) > one that does both
            rank = (1 if refused else 2) + (2 if _joined_follow(cand) else 0)
            if fallback is None or rank < fallback[0]:
                fallback = (rank, fmt, res, refused)
            continue
        tool_as_assistant = "tool results are rendered with the assistant's header" in sh.notes \
            or all(f.reason.startswith("trains text outside the assistant messages")
                   and f.text is not None and any(
                       m.get("role") == "tool" and isinstance(m.get("content"), str)
                       and m["content"] and m["content"] in f.reason
                       for m in _messages(f.case)) for f in fails)
        if fails and tool_as_assistant and all("tool-results" in _tags(f.case) for f in fails):
            first_problem = InferenceError(
                "the template renders tool results as assistant turns (with the assistant's "
                "header): in the rendered text a tool result cannot be told from a reply, so it "
                "would train as assistant text; no format is returned, not even for "
                "conversations without tool messages, since a mask is computed from the text "
                "alone and cannot know that a conversation has none (the spec is right on "
                + ", ".join(c.case for c in res.cases if c.status == "pass") + ")",
                where="case " + fails[0].case, details=fails[0].details + "\n\n" + text)
            break
        after_tool = [n for n in sh.notes if n.startswith("assistant turns render differently")]
        if fails and after_tool and all("tool-results" in _tags(f.case) for f in fails):
            first_problem = InferenceError(
                after_tool[0] + f"; the spec cannot follow it (case {fails[0].case!r}: "
                f"{fails[0].reason})", where="case " + fails[0].case,
                details=fails[0].details + "\n\n" + text)
            fewest = (-1, 0)   # the reason to give
            continue
        if fails:
            c = fails[0]
            # the candidate that failed the fewest cases says the most about what no spec
            # can say (vLLM's teleflm example: the indentation between two replies once a
            # tool call is dropped, not the first candidate's unread indentation)
            if first_problem is None or first_problem.where == "compile" or (
                    fewest is not None and got < fewest):
                fewest = got
                first_problem = InferenceError(
                    f"the inferred spec fails matrix case {c.case!r}: {c.reason}"
                    + (f" [{len(fails) - 1} more case(s) fail]" if len(fails) > 1 else ""),
                    where=f"case {c.case}", details=c.details + "\n\n" + text)
            continue
        return _verified(fmt, res, probe, sh, ())
    if fallback is not None:
        return _verified(*fallback[1:3], probe, sh, fallback[3])
    assert first_problem is not None
    raise first_problem


def _verified(fmt: InferredFormat, res: Any, probe: "_Probe", sh: "_Shape",
              refused: tuple) -> InferredFormat:
    notes = list(sh.notes)
    for m in fmt.spec.markers.values():
        base = m.text.rstrip()
        if base != m.text and any(o.text == base for o in fmt.spec.markers.values()):
            # a terminator joined with its whitespace (a headerless reply may follow it):
            # the output masks are exact, the end span holds the whitespace too
            notes.append(f"the terminator {base!r} is joined with the whitespace after it "
                         f"({m.text!r}): with end_marker=True that whitespace trains with it")
    for name, el in fmt.spec.elements.items():
        if el.close is not None and el.role == "assistant" and any(
                fmt.spec.markers[a].text.strip() in (probe.forced or "\0").strip()
                for a in el.close.after):
            # the prompt printed after every conversation, after the last answer's terminator
            notes.append(f"the generation prompt printed after every conversation "
                         f"({probe.forced!r}) ends the last answer (close.after of {name!r}): "
                         "with end_marker=True it trains with that answer's terminator")
    fmt.verification = Verification(
        checked=tuple(c.case for c in res.cases if c.status == "pass"),
        rejected=tuple((c.case, c.reason) for c in res.cases if c.status == "skip"),
        probes_rejected=tuple(probe.rejected.items()), notes=tuple(notes),
        deviations=tuple(dict.fromkeys(
            re.sub(r"at char \d+: ", "", d) for c in res.cases for d in c.deviations))[:4],
        refused=refused, content=probe.shape)
    return fmt


def _tool_parse_errors(fails: list) -> bool:
    """Every failure is a text-mode ParseError on a matrix case with tool results."""
    return bool(fails) and all("tool-results" in _tags(f.case) and f.reason.startswith(
        "does not parse (text mode)") for f in fails)


#: Why an inferred format refuses the tool shapes of a template that renders tool results
#: with the assistant's header.
TOOL_AS_ASSISTANT = ("the template renders tool results with the assistant's header: the "
                     "format refuses tool messages (a located ParseError: an answer right "
                     "after an answer), never trains them")
#: Why an inferred format refuses the tool shapes of a template whose tool results it does not
#: parse (rendered as bare text with no header, or in a way the spec cannot say).
TOOL_UNPARSED = ("the format does not parse the template's tool results (a located "
                 "ParseError), never trains them")


def _refused_tool_shapes(fmt: Format, probe: "_Probe", sh: "_Shape", fails: list) -> tuple:
    """``(case, why)`` of the matrix cases a candidate refuses on purpose, or ``()``.

    Only a candidate whose every failure is a text-mode ParseError on a case with tool
    results: a template that renders tool results with the assistant's header gets a spec in
    which an answer follows only a question, so a tool result (an assistant-headed turn right
    after an answer) cannot parse; one that renders them as bare text (WiNGPT2) or otherwise
    beyond the spec does not parse there either. Conversations that end with the tool result,
    with and without a generation prompt, must not train it either; else ``()``.
    """
    from ..errors import ParseError
    from .templates import OUTPUT_POLICY

    if not _tool_parse_errors(fails):
        return ()
    tool = {"role": "tool", "tool_call_id": "call00001", "content": TR1}
    for msgs in ([_u(U1), _a("", tool_calls=[_call()]), tool],
                 [_u(U1), _a(A1), tool], [_s(SYS), _u(U1), _a(A1), tool, _a(A2)]):
        for agp in (False, True):
            text = probe.render(msgs, agp=agp, shape="tool result at the end")
            if text is None:
                continue
            try:
                conv = fmt.parse(text)
            except ParseError:
                continue
            if any(TR1 in text[s.start:s.end] for s in conv.spans(OUTPUT_POLICY)):
                return ()
    why = TOOL_AS_ASSISTANT if "tool results are rendered with the assistant's header" \
        in sh.notes else TOOL_UNPARSED
    return tuple((f.case, f"{why}: {f.reason}") for f in fails)


def infer_format(chat_template: str, *, tokenizer: Any = None, **template_kwargs: Any
                 ) -> InferredFormat:
    """Infer a format from a chat template, verified against it before it is returned.

    The template is rendered in the sandbox (as transformers renders it) on sentinel
    conversations; the spec written from the renders is compiled strictly and must pass every
    case of the ``validate --template`` matrix the template accepts. See docs/inference.md.

    Args:
        chat_template: the Jinja source of the chat template.
        tokenizer: optional; its special tokens map (``bos_token``, ``eos_token`` …) is passed
            to the template, and a marker is ``special`` exactly when it is one special/added
            id of it (verification then also runs in id mode with it).
        **template_kwargs: template variables (``bos_token="<s>"``, ``eos_token=…``, switches
            such as ``enable_thinking``); they win over the tokenizer's.

    Returns:
        An :class:`InferredFormat` named ``inferred-<8 hex>`` (the template's hash with the
        variables), with ``spec_yaml`` and ``verification``. Cached by that hash, in memory.

    Raises:
        InferenceError: the template does not compile, runs out of time or leaves the sandbox,
            never renders an assistant turn, needs a variable that was not passed, or shows a
            structure the spec language cannot say, or the inferred spec fails a matrix case
            (the message says which and why).

    Example:
        >>> tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}"
        ...        "<|im_end|>\\n{% endfor %}{% if add_generation_prompt %}"
        ...        "<|im_start|>assistant\\n{% endif %}")
        >>> fmt = infer_format(tpl)
        >>> fmt.parse("<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello"
        ...           "<|im_end|>\\n").trained_text()
        ['Hello']
    """
    if not isinstance(chat_template, str) or not chat_template.strip():
        raise InferenceError("the chat template is empty", where="input")
    variables = {**_tokenizer_vars(tokenizer), **template_kwargs}
    key = _key(chat_template, variables, tokenizer)
    hit = _CACHE.get(key)
    if hit is not None:
        return _warn_deviations(_from_yaml(*hit))
    try:
        compile_template(chat_template)
    except TemplateError as exc:
        raise InferenceError(f"the template does not compile: {exc.message}",
                             where="template") from None
    try:
        fmt = _infer(chat_template, variables, tokenizer, f"inferred-{key[:8]}")
    except InferenceError:
        # a bundled family's template that writes a fixed text before every conversation
        fmt = _after_fixed_text(chat_template, variables, tokenizer, f"inferred-{key[:8]}")
        if fmt is None:
            raise
    except ChatGrammarError:
        raise
    except RecursionError:
        raise InferenceError("the template nests too deeply to probe", where="template") from None
    except Exception as exc:  # a shape the derivation did not foresee: refuse, never crash
        raise InferenceError(f"inference cannot read this template ({type(exc).__name__}: "
                             f"{exc})", where="derivation") from exc
    # messages the template writes as another role's turn: declared (spec key role_folds),
    # so a policy they change warns at mask time (chatgrammar.conformance.folds)
    fmt = declare_folds(fmt, chat_template, variables)
    _CACHE.put(key, (fmt.spec_yaml, fmt.verification))
    return _warn_deviations(fmt)


def _after_fixed_text(template: str, variables: dict, tokenizer: Any, name: str
                      ) -> InferredFormat | None:
    """A bundled format, derived (``extends:``) to read a fixed text the template writes
    before every conversation as an untrained preamble marker: iboriss's Gemma 4 copy renders
    its ``#`` comment lines before the first turn, and the bundled gemma4 reads the rest. The
    text is what every basic probe's rendering starts with, up to its first marker-shaped
    string; it must be written literally in the template, whose copy without it a bundled
    format is detected for and verified on. The derived format is checked over the matrix on
    the template itself, with the bundled format's ``refused:`` shapes (kept as its
    ``verification.refused``). None where any of this does not hold."""
    from ..core.detect import explain_detection
    from ..errors import DetectionError
    from .format_tests import tests_for
    from .templates import check_template

    probe = _Probe(template, variables, TIMEOUT)
    try:
        renders = [probe.render(m, shape=n) for n, m in _BASIC.items()]
    except InferenceError:
        return None
    renders = [r for r in renders if r is not None]
    text = os.path.commonprefix(renders) if len(renders) >= 2 else ""
    m = _MARKERISH.search(text)
    text = text[:m.start()] if m else ""
    if len(text.strip()) < 8 or any(v in text for v in _ALL) or template.count(text) != 1:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            det = explain_detection(tokenizer, chat_template=template.replace(text, "", 1))
    except DetectionError:
        return None
    if ((det.verification or {}).get(det.format) or {}).get("status") != "verified" or \
            not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", det.format):
        return None
    base = det.fmt.spec
    marker = "fixed_text"
    while marker in base.markers:
        marker += "_"
    spec = {"name": name,
            "description": f"{det.format}, after a fixed text the template writes before "
                           "every conversation (inferred by chatgrammar.infer_format)",
            "extends": det.format,
            "markers": {marker: {"text": text, "special": False}},
            "preamble": [marker] + list(base.preamble or [])}
    header = (f"# {name}: the bundled {det.format} format, with the fixed text this chat "
              "template writes before every\n# conversation as an untrained preamble marker "
              "(chatgrammar.infer_format, docs/inference.md).\n")
    try:
        fmt = _from_yaml(header + yaml.dump(spec, Dumper=_Dumper, sort_keys=False,
                                            allow_unicode=True, width=100))
    except ChatGrammarError:
        return None
    refused = dict(tests_for(det.fmt).get("refused") or {})
    res = check_template(fmt, template, name="template", variables=variables,
                         tokenizer=tokenizer, timeout=TIMEOUT, refused=refused)
    passed = [c.case for c in res.cases if c.status == "pass"]
    if res.error or len(passed) < 6 or any(c.status == "fail" for c in res.cases):
        return None
    fmt.verification = Verification(
        checked=tuple(passed),
        rejected=tuple((c.case, c.reason) for c in res.cases
                       if c.status == "skip" and c.case not in refused),
        notes=(f"the template writes {_show(text)} before every conversation: an untrained "
               f"preamble marker of the bundled {det.format} format, which reads the rest",),
        refused=tuple((c.case, refused[c.case]) for c in res.cases
                      if c.status == "skip" and c.case in refused))
    return fmt


def _warn_deviations(fmt: InferredFormat) -> InferredFormat:
    # a mask that differs from the template's exact turns must never be silent: the accepted
    # deviation (whitespace after an unclosed reply trains) is said once per call site
    if fmt.verification is not None and fmt.verification.deviations:
        warnings.warn(f"{fmt.name}: the template never closes a reply, and the whitespace it "
                      "writes after one trains with the reply (accepted deviation "
                      "unclosed-whitespace; see fmt.verification.deviations)",
                      DeviationWarning, stacklevel=3)
    return fmt


def template_of(tokenizer: Any) -> str | None:
    """A tokenizer's own chat template (the ``default`` one of a named set), or None."""
    t = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    t = t.get("default") if isinstance(t, dict) else t
    return t if isinstance(t, str) and t.strip() else None


def resolve_format(tokenizer: Any = None, *, chat_template: str | None = None,
                   **template_kwargs: Any) -> tuple[Format, str]:
    """The bundled format detected for a tokenizer / template, else one inferred.

    What ``chatgrammar mask -f auto``, ``chatgrammar detect`` and ``chatgrammar.hf.map_fn``
    (``fmt="auto"``) use.

    Args:
        tokenizer: the tokenizer (its special tokens and its own chat template), or None.
        chat_template: the chat template (default: the tokenizer's).
        **template_kwargs: template variables for inference.

    Returns:
        ``(format, how)``: ``how`` is ``"detected"`` (a bundled or plugin format) or
        ``"inferred"`` (:func:`infer_format`; the format's ``verification`` says how it was
        checked): nothing is detected, or the detected format only partly parses the
        template (its verdict is ``partial``: some renderings are located ParseErrors) and
        the inferred one verifies on more matrix cases with no accepted deviation.

    Raises:
        DetectionError: nothing is detected and there is no template to infer from.
        InferenceError: nothing is detected and the template cannot be captured (the message
            says both).

    Example:
        >>> fmt, how = resolve_format(chat_template=open("vicuna.jinja").read())  # doctest: +SKIP
        >>> how                                                                   # doctest: +SKIP
        'inferred'
    """
    from ..core.detect import detect_format, explain_detection
    from ..errors import DetectionError

    template = chat_template or template_of(tokenizer)
    try:
        # the tokenizer's own template counts: Qwen's vocabulary with a non-ChatML template
        # is not ChatML
        det = explain_detection(tokenizer, chat_template=template)
    except DetectionError as exc:
        if template is None:
            raise
        why = str(exc).splitlines()[0]
    else:
        return _better_of(det, template, tokenizer, template_kwargs)
    try:
        return infer_format(template, tokenizer=tokenizer, **template_kwargs), "inferred"
    except InferenceError as exc:
        if tokenizer is not None and chat_template is None:
            try:  # what detection said before templates counted: the tokenizer alone
                return detect_format(tokenizer), "detected"
            except DetectionError:
                pass
        raise InferenceError(f"no bundled format ({why}); and inference fails: {exc.message}",
                             where=exc.where, details=exc.details) from None


def _better_of(det: Any, template: str | None, tokenizer: Any, kwargs: dict
               ) -> tuple[Format, str]:
    """The detected format, unless it is only ``partial`` on the template (some renderings
    are located ParseErrors; or, with the caller's variables, none parses or a mask is wrong)
    and the format inferred from the template verifies on more matrix cases, with no
    accepted deviation: then the inferred one (a variant of a bundled family that its spec
    does not accept yet still gets exact masks)."""
    from ..core.detect import verify_candidate

    v = (det.verification or {}).get(det.format) or {}
    if template is None:
        return det.fmt, "detected"
    if kwargs:   # the variables the caller renders with (detection may have guessed others)
        v = verify_candidate(det.fmt, [template], {k: x for k, x in kwargs.items()
                                                   if isinstance(x, str)})
    if v.get("status") not in ("partial", "unparsable", "wrong"):
        return det.fmt, "detected"
    try:
        fmt = infer_format(template, tokenizer=tokenizer, **(kwargs or dict(v.get("vars") or {})))
    except InferenceError:
        return det.fmt, "detected"
    if not fmt.verification.deviations and len(fmt.verification.checked) > v.get("passed", 0):
        return fmt, "inferred"
    return det.fmt, "detected"


@dataclass(frozen=True)
class CrossCheck:
    """How an inferred format's masks compare with a bundled format's over the matrix.

    Attributes:
        equal: matrix cases where both formats give the same mask (with and without the
            terminator trained).
        differ: ``(case, why)`` for each case where they do not (a different mask, or one of
            them does not parse the rendering).
        rejected: matrix cases the template rejects (not compared).
        refused: ``(case, why)`` for each case where they differ because the bundled format
            refuses that shape on purpose (``refused:`` of its test facts, with the reason
            given there: a located ParseError, or a documented whitespace deviation), or the
            inferred format does (its ``verification.refused``: a located ParseError), so
            neither side is wrong by accident.
    """

    equal: tuple = ()
    differ: tuple = ()
    rejected: tuple = ()
    refused: tuple = ()

    @property
    def agree(self) -> bool:
        """True when the masks are equal on every case the template renders and that the
        bundled format does not refuse on purpose."""
        return bool(self.equal) and not self.differ


def cross_check(inferred: Format, bundled: Format, chat_template: str, *,
                cases: Any = None, timeout: float | None = 10.0,
                refused: dict | None = None, **template_kwargs: Any) -> CrossCheck:
    """Compare two formats' masks over the conversation matrix rendered with a template.

    Every matrix case the template renders is parsed (text mode) with both formats; their
    masks must be equal under the output policy, with and without the terminator trained.
    Where they differ, one of the two is wrong for that template (docs/inference.md), unless
    the bundled format refuses that case on purpose (``refused``): such a case is reported in
    ``CrossCheck.refused`` with the bundled format's reason, not as a difference.

    Args:
        inferred: usually :func:`infer_format`'s result for the template.
        bundled: the bundled format the template is assigned to.
        chat_template: the Jinja source of the chat template.
        cases: matrix cases (default: :func:`chatgrammar.conformance.matrix.default_matrix`).
        timeout: per-render time limit in seconds.
        refused: matrix case -> why the bundled format refuses it on purpose (default: the
            ``refused:`` of the bundled format's test facts, ``formats/<name>.tests.yaml``).
        **template_kwargs: template variables (``bos_token="<s>"`` …).

    Returns:
        A :class:`CrossCheck`; ``.agree`` is True when no rendered case differs (cases the
        bundled format refuses on purpose are in ``.refused``).

    Example:
        >>> tpl = open("Qwen-Qwen3.jinja").read()                        # doctest: +SKIP
        >>> cross_check(infer_format(tpl), load_format("chatml"), tpl).agree  # doctest: +SKIP
        True
    """
    from .templates import OUTPUT_POLICY
    from ..errors import ParseError
    from .matrix import default_matrix, render_case

    if refused is None:
        from .format_tests import tests_for
        refused = dict(tests_for(bundled).get("refused") or {})
    # the shapes the inferred format refuses on purpose (its Verification.refused)
    own = dict(getattr(getattr(inferred, "verification", None), "refused", ()) or ())
    policies = (OUTPUT_POLICY, OUTPUT_POLICY.replace(end_marker=True))
    equal, differ, rejected, on_purpose = [], [], [], []
    for case in (default_matrix() if cases is None else cases):
        try:
            text = render_case(chat_template, case, timeout=timeout, **template_kwargs).text
        except (TemplateError, RenderTimeout):
            rejected.append(case.name)
            continue
        masks = []
        for fmt in (inferred, bundled):
            try:
                conv = fmt.parse(text)
                masks.append([conv.mask(p) for p in policies])
            except ParseError as exc:
                masks.append(f"{fmt.name} does not parse it: {exc.message}")
        a, b = masks
        if a == b:
            equal.append(case.name)
        elif case.name in refused:
            on_purpose.append((case.name, f"{bundled.name} refuses it on purpose: "
                                          f"{refused[case.name]}"))
        elif case.name in own and isinstance(a, str):
            on_purpose.append((case.name, f"{inferred.name} refuses it on purpose: "
                                          f"{own[case.name]}"))
        elif isinstance(a, str) or isinstance(b, str):
            differ.append((case.name, a if isinstance(a, str) else b))
        else:
            which = "with the terminator" if a[0] == b[0] else "output"
            k = 0 if which == "output" else 1
            pos = next(i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y) \
                if len(a[k]) == len(b[k]) else min(len(a[k]), len(b[k]))
            differ.append((case.name, f"masks differ ({which}) from char {pos}: "
                                      f"{text[max(0, pos - 20):pos + 40]!r}"))
    return CrossCheck(tuple(equal), tuple(differ), tuple(rejected), tuple(on_purpose))
