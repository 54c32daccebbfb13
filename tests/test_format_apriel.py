"""apriel: the bundled spec against ServiceNow Apriel's real chat template.

The template (tests/data/templates/ServiceNow-AI-Apriel-1.5-15b-Thinker.jinja, provenance in
SOURCES.md there) is rendered with the built-in conversation matrix plus Apriel shapes (the
model's reasoning written in the content before ``[BEGIN FINAL RESPONSE]``, ``add_thoughts``
with ``thought`` blocks, a ``content`` message, ``chosen`` instead of content, user content
parts with an image, tool results as parts, a last message that calls tools — no call ids —,
a generation prompt after tool results) exactly as transformers renders it, with the model's
real ``bos_token`` / ``eos_token`` (``<s>`` / ``</s>``), parsed in text mode, and the trained
text of every assistant turn is compared with an oracle written from the template's own logic
(what it prints after ``<|assistant|>\\n`` for each assistant message), never read back from the
parse. Then:

- id mode, on tiktoken Encodings carrying Apriel's special tokens (below), must give the
  text-mode spans mapped through the tokenizer's offsets, under several policies; once with
  every marker a single id, once with the thinking / tool-call tags as plain BPE text (they
  are soft markers: found in the decoded text where the vocabulary has no id for them);
- the render-diff conformance check (chatgrammar.conformance) passes;
- the template detects as apriel, and only as apriel; a tokenizer with Apriel's markers as ids
  detects as apriel over phi3 (declared precedence), a Phi-3 tokenizer stays phi3;
- cuts (truncation) train the content present, and nothing of a turn cut inside its opener;
- a user typing Apriel's markers is one user turn in id mode when the markers are ids.

Special tokens. Apriel's vocabulary (Mistral Tekken, 131,072 ids) is not available offline, so
the tokenizer is a ``tiktoken.Encoding`` over Qwen's BPE ranks (tests/data/tokenizers/
Qwen-Qwen2.5/qwen.tiktoken) with Apriel's special tokens added; Qwen's ordinary ranks are
renumbered monotonically around the ids that fall inside Qwen's range, so every text tokenises
as with Qwen's ranks. Where each id comes from:

- ``eos_token`` is ``</s>``: llama.cpp's recorded metadata for ServiceNow-AI/Apriel-1.5-15b-Thinker
  (``"eos_tokens": ["</s>"]``, in the project's template corpus next to the template). Apriel
  1.5 is Pixtral-based (Mistral Tekken): ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 as in every Tekken /
  Mistral vocabulary (transformers' ``MistralConfig`` defaults ``bos_token_id=1``,
  ``eos_token_id=2``, installed; Mistral-3 GGUF token lists start ``<unk>``, ``<s>``, ``</s>``).
- ``[BEGIN FINAL RESPONSE]`` 998, ``<|end|>`` 999: **one source only** — a vLLM reasoning-parser
  plugin for Apriel (community code found with the project's code search) that streams on
  ``response_start_ids = [998]`` / ``response_end_ids = [999]``; its ids for "Here are my reasoning
  steps:" end in 1058 = 1000 + ``ord(":")``, Tekken's byte offset, which fits Tekken's 1,000
  control slots (0-999). Not confirmed elsewhere.
- ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|tool_result|>``, ``<|content|>``:
  **ids not found** (presumably other Tekken control slots, as ``<|end|>``). They are placed
  at 152000+, past Apriel's 131,072 ids and Qwen's 151,643 ranks, so they are never mistaken
  for real ids.
- ``<thinking>``, ``</thinking>``, ``<tool_calls>``, ``</tool_calls>``: whether they are single
  ids at all is not known (llama.cpp's Apriel handler lists them as "preserved tokens", which
  says nothing either way); in the first tokenizer they are ids at 152010+, in the second
  (``apriel-text``) plain BPE text. The format declares them soft, so both must train the
  same.
"""
from __future__ import annotations

import copy
from functools import lru_cache

import numpy as np
import pytest

import chatgrammar as cg
from chatgrammar.conformance import check_template
from chatgrammar.matrix import TOOLS, MatrixCase, default_matrix
from chatgrammar.render import TemplateError, render_chat
from tests.format_kit import (allowed_kind, assistant as _a, call as _call,
                              check_embedded_examples, encode_with_ranges, renumbered_encoding,
                              template, trained_per_turn, user as _u)
from tests.tokenizers import phi3_tokenizer

TEMPLATE = "ServiceNow-AI-Apriel-1.5-15b-Thinker.jinja"

BOS, EOS = "<s>", "</s>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
TOOL_RESULT, CONTENT, END = "<|tool_result|>", "<|content|>", "<|end|>"
THINK, END_THINK = "<thinking>", "</thinking>"
CALLS, END_CALLS = "<tool_calls>", "</tool_calls>"
BEGIN_FINAL, END_FINAL = "[BEGIN FINAL RESPONSE]", "[END FINAL RESPONSE]"

TEKKEN_IDS = {"<unk>": 0, BOS: 1, EOS: 2}
REPORTED_IDS = {BEGIN_FINAL: 998, END: 999}
# ids not found: past Apriel's 131,072-id vocabulary and Qwen's ranks on purpose
UNKNOWN_IDS = {m: 152000 + i for i, m in enumerate(
    [SYSTEM, USER, ASSISTANT, TOOL_RESULT, CONTENT])}
TAG_IDS = {m: 152010 + i for i, m in enumerate([THINK, END_THINK, CALLS, END_CALLS])}
SPECIALS = {"bos_token": BOS, "eos_token": EOS}

FMT = cg.load_format("apriel")

# --------------------------------------------------------------------------- tokenizers


def encoding(kind: str = "apriel"):
    """``apriel``: every Apriel marker one id; ``apriel-text``: the thinking and tool-call
    tags are BPE text."""
    specials = {**TEKKEN_IDS, **REPORTED_IDS, **UNKNOWN_IDS}
    if kind == "apriel":
        specials.update(TAG_IDS)
    return renumbered_encoding(f"{kind}-test", tuple(specials.items()))


KINDS = ["apriel", "apriel-text"]


def mapped_mask(conv: cg.Conversation, ranges, n_chars: int, policy=None,
                kind: str | None = None) -> list[int]:
    """The documented rule: a token is trained iff it overlaps a trained character (of
    ``kind``, when given). Kept here, not format_kit.mapped_mask: that one has no ``kind``."""
    chars = np.zeros(n_chars + 1, dtype=np.int64)
    for s in conv.spans(policy):
        if kind is None or s.kind == kind:
            chars[s.start:s.end] = 1
    csum = np.concatenate([[0], np.cumsum(chars[:n_chars])])
    return [int(b > a and csum[b] - csum[a] > 0) for a, b in ranges]


def _kind_mask(spans, kind: str, n: int) -> list[int]:
    out = [0] * n
    for s in spans:
        if s.kind == kind:
            out[s.start:s.end] = [1] * (s.end - s.start)
    return out


POLICIES = [None, cg.MaskPolicy(thinking=False, end_marker=True),
            cg.MaskPolicy(tool_calls=False), cg.MaskPolicy(last_turn_only=True),
            cg.MaskPolicy(truncated=False)]


# not format_kit.check_id_mode: compared kind by kind, soft-marker tokens may differ
def check_id_mode(text: str, conv: cg.Conversation, tok) -> cg.Conversation:
    """Id mode is the text-mode parse mapped through the offsets. Where a soft marker is BPE
    text, a token may hold the marker's edge and the text next to it (``">\\n"`` of
    ``</tool_calls>`` + the newline before ``<|end|>``): it stays with that text, as a content
    span of its own, and the boundary is reported. Such reported tokens are the only
    difference allowed, and only where a policy drops a block (the newline belongs to the
    untrained terminator in text mode)."""
    ids, ranges = encode_with_ranges(tok, text)
    conv_ids = FMT.parse_ids(ids, tok)
    assert conv_ids.length == len(ids)
    assert len(conv_ids.warnings) == len(conv.warnings)
    assert [t.role for t in conv_ids.turns] == [t.role for t in conv.turns]
    assert [(t.complete, t.generation_prompt) for t in conv_ids.turns] == \
        [(t.complete, t.generation_prompt) for t in conv.turns]
    soft = {b.offset for b in conv_ids.boundaries if "soft marker" in b.message}
    for policy in POLICIES:
        if not soft:
            assert [(s.kind, s.role, s.turn) for s in conv_ids.spans(policy)] == \
                [(s.kind, s.role, s.turn) for s in conv.spans(policy)]
        for kind in ("content", "think", "tool_call", "end"):  # token by token, per kind
            got_k = _kind_mask(conv_ids.spans(policy), kind, len(ids))
            want_k = mapped_mask(conv, ranges, len(text), policy, kind)
            assert {k for k, (a, b) in enumerate(zip(got_k, want_k)) if a != b} <= soft, kind
        assert_mask(FMT.loss_mask(ids, tok, policy=policy),
                    mapped_mask(conv, ranges, len(text), policy), policy, soft)
    return conv_ids


def assert_mask(got, want, policy, soft) -> None:
    if policy is None or (policy.thinking and policy.tool_calls):
        assert got == want
    else:
        assert {k for k, (a, b) in enumerate(zip(got, want)) if a != b} <= soft


# --------------------------------------------------------------------------- cases


def _result(cid, content):  # not format_kit.tool_result: no "name" in the message
    return {"role": "tool", "tool_call_id": cid, "content": content}


REASONED = ("Here are my reasoning steps:\nTwo plus two is four.\n" + BEGIN_FINAL
            + "\n2 + 2 = 4.\n" + END_FINAL)
THOUGHTS = {"add_thoughts": True}
EXTRA = [
    MatrixCase("apriel-reasoning-in-content", "the Thinker's reasoning and final-response "
               "markers written in the content, two turns",
               [_u("What is 2 + 2?"), _a(REASONED), _u("And 3 + 3?"),
                _a("Here are my reasoning steps:\nDouble three.\n" + BEGIN_FINAL + "\n6\n"
                   + END_FINAL)]),
    MatrixCase("apriel-thoughts", "add_thoughts: a `thought` after the content, in history and "
               "in the last message, one with tool calls",
               [{"role": "system", "content": "Use tools."}, _u("Weather in Paris?"),
                _a("Let me check.", thought="Need the weather.",
                   tool_calls=[_call("call00001", "get_weather", {"city": "Paris"})]),
                _result("call00001", "sunny"),
                _a("It is sunny.", thought="The tool said sunny.")],
               tools=list(TOOLS), template_kwargs=THOUGHTS),
    MatrixCase("apriel-thought-without-flag", "a `thought` without add_thoughts is not "
               "rendered",
               [_u("Hi"), _a("Hello!", thought="Greet back.")]),
    MatrixCase("apriel-content-message", "a `content` message (a document) before the user's "
               "question, one as parts",
               [{"role": "content", "content": "Mars has two moons."},
                {"role": "content", "content": [{"type": "text", "text": "Phobos is larger."}]},
                _u("How many moons has Mars?"), _a("Two.")]),
    MatrixCase("apriel-chosen", "an assistant message with `chosen` and no content",
               [_u("Pick one."), {"role": "assistant", "content": None,
                                  "chosen": ["The first."]},
                _u("Why?"), _a("It came first.")]),
    MatrixCase("apriel-image-parts", "user content parts with an image, tool result as parts",
               [_u([{"type": "image"}, {"type": "text", "text": "What is this?"}]),
                _a("", tool_calls=[_call("call00002", "search_web", {"query": "cat"})]),
                _result("call00002", [{"type": "text", "text": "A cat."}]), _a("A cat.")],
               tools=list(TOOLS)),
    MatrixCase("apriel-calls-last", "the last message calls tools: its calls carry no id",
               [_u("Paris and Rome?"),
                _a("Checking.", tool_calls=[_call("call00003", "get_weather", {"city": "Paris"}),
                                            _call("call00004", "get_weather",
                                                  '{"city": "Rome"}')])],
               tools=list(TOOLS)),
    MatrixCase("apriel-prompt-after-results", "a generation prompt after tool results",
               [_u("Weather in Paris?"),
                _a("", tool_calls=[_call("call00005", "get_weather", {"city": "Paris"})]),
                _result("call00005", "22 degrees")], tools=list(TOOLS),
               add_generation_prompt=True),
    MatrixCase("apriel-empty-system", "an empty system message",
               [{"role": "system", "content": ""}, _u("Hi"), _a("Hello.")]),
    # outside the matrix's conventions (output strings without surrounding whitespace): left
    # out of the conformance run, whose checker looks for "  " among the trained words
    MatrixCase("apriel-whitespace-reply", "a whitespace-only reply: all of it, with the "
               "newline, belongs to the terminator, as an empty reply",
               [_u("Hi"), _a("  "), _u("Again?"), _a("Hello.")]),
]
NOT_CONFORMANCE = {"apriel-whitespace-reply"}


def all_cases() -> list[MatrixCase]:
    return default_matrix() + copy.deepcopy(EXTRA)


CASES = {c.name: c for c in all_cases()}


def render(case: MatrixCase) -> str:
    return render_chat(template(TEMPLATE), copy.deepcopy(case.messages), **SPECIALS,
                       **case.render_kwargs())


@lru_cache(maxsize=None)
def _renders() -> tuple:
    ok, rejected = [], {}
    for case in all_cases():
        try:
            ok.append((case.name, render(case)))
        except TemplateError as exc:
            rejected[case.name] = exc.message
    return tuple(ok), rejected


def test_every_shape_renders():
    """The template renders every case (it rejects none of the matrix's shapes)."""
    ok, rejected = _renders()
    assert rejected == {}
    assert len(ok) == len(all_cases())


# --------------------------------------------------------------------------- the oracle
# What the template prints after `<|assistant|>\n` for each assistant message, written from its
# source: the content (or `chosen[0]`), a `<thinking>thought</thinking>` block (add_thoughts),
# `\n<tool_calls>[…]</tool_calls>`, then `\n<|end|>\n` + eos_token. As (kind, text) pieces,
# and the terminator: the format's `<|end|>` is lstrip, so the text after the last block (all
# of the body when there is none) and the "\n" before <|end|> belong to the terminator when
# they are whitespace only (an empty message, a thought or call block last); otherwise that
# "\n" ends the content.


def _text(c) -> str:
    if c is None:
        return ""
    return c if isinstance(c, str) else c[0]["text"]


def _jinja_string(v) -> str:
    return v if isinstance(v, str) else str(v)  # `| string` on a mapping: Python's repr


def oracle(case: MatrixCase) -> list[tuple[list[tuple[str, str]], str]]:
    """Per assistant message: (trained pieces, the terminator's text)."""
    msgs = case.messages
    add_thoughts = bool(case.template_kwargs.get("add_thoughts"))
    out = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        last = i == len(msgs) - 1  # the template drops the call ids of the last message
        pieces: list[tuple[str, str]] = []
        content = m.get("content")
        if content:  # `is not none and |length > 0`
            pieces.append(("content", _text(content)))
        elif m.get("chosen"):
            pieces.append(("content", m["chosen"][0]))
        if add_thoughts and m.get("thought") is not None:
            pieces.append(("think", THINK + m["thought"] + END_THINK))
        calls = m.get("tool_calls") or []
        if calls:
            body = ", ".join(
                '{"name": "' + c["function"]["name"] + '", "arguments": '
                + _jinja_string(c["function"]["arguments"])
                + ('' if last else ', "id": "' + c["id"] + '"') + "}" for c in calls)
            pieces += [("content", "\n"), ("tool_call", CALLS + "[" + body + "]" + END_CALLS)]
        pieces.append(("content", "\n"))
        blocks = [k for k, (kind, _) in enumerate(pieces) if kind != "content"]
        run_from = blocks[-1] + 1 if blocks else 0
        run = "".join(t for _, t in pieces[run_from:])
        end = END + "\n" + EOS
        if not run.strip():
            pieces, end = pieces[:run_from], run + end
        out.append((_joined([p for p in pieces if p[1]]), end))
    return out


def _joined(pieces):
    out: list[tuple[str, str]] = []
    for k, t in pieces:
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1] + t)
        else:
            out.append((k, t))
    return out


def _roles_written(case: MatrixCase) -> list[str]:
    """The turns the template writes, in order (from its source): the system turns it adds,
    then one per message."""
    msgs, tools = case.messages, case.tools
    roles = []
    if msgs[0]["role"] != "system" and tools:
        roles.append("system")
    if not any(m["role"] == "system" for m in msgs):
        roles.append("system")
    roles += [{"tool": "tool"}.get(m["role"], m["role"]) for m in msgs]
    if case.add_generation_prompt and msgs[-1]["role"] != "assistant":
        roles.append("assistant")
    return roles


# --------------------------------------------------------------------------- the matrix

MATRIX = [name for name, _ in _renders()[0]]


@pytest.mark.parametrize("name", MATRIX)
def test_template_matrix(name: str) -> None:
    case = CASES[name]
    text = dict(_renders()[0])[name]
    conv = FMT.parse(text)
    assert not conv.warnings
    assert [t.role for t in conv.turns] == _roles_written(case)
    assert all(t.complete for t in conv.turns if not t.generation_prompt)
    want = [pieces for pieces, _ in oracle(case)]
    asst = [t for t in conv.turns if t.role == "assistant" and not t.generation_prompt]
    assert len(asst) == len(want)

    # text mode: each assistant turn trains exactly what the template printed for it, under
    # the default policy and with thinking / tool calls switched off
    for policy in (FMT.default_policy, cg.MaskPolicy(thinking=False),
                   cg.MaskPolicy(tool_calls=False), cg.MaskPolicy(truncated=False)):
        assert trained_per_turn(conv, text, policy) == \
            ["".join(t for k, t in turn if allowed_kind(k, policy)) for turn in want]
    # the kinds: every thought / call block is a span of that kind, nothing else is
    for kind in ("think", "tool_call"):
        got = [text[s.start:s.end] for s in conv.spans() if s.kind == kind]
        assert got == [t for turn in want for k, t in turn if k == kind], kind
    # nothing outside assistant turns trains, under any policy; no end span by default
    for policy in POLICIES:
        for s in conv.spans(policy):
            t = conv.turns[s.turn]
            assert t.role == "assistant" and t.start <= s.start and s.end <= t.end
    assert not [s for s in conv.spans() if s.kind == "end"]
    # with end_marker: "<|end|>\n</s>" ends every assistant turn, with the whitespace before
    # <|end|> where nothing but it follows the last marker
    ends = [text[s.start:s.end] for s in conv.spans(cg.MaskPolicy(end_marker=True))
            if s.kind == "end"]
    assert ends == [end for _, end in oracle(case)]
    # the system turns (the template's own reasoning prompt, tool instructions) never train
    for t in conv.turns:
        if t.role == "system":
            assert "SLAM" in text[t.start:t.end]
    # a generation prompt trains nothing of the final turn
    if case.add_generation_prompt:
        last = conv.turns[-1]
        assert last.role == "assistant" and last.generation_prompt
        assert all(s.end <= last.start for s in conv.spans())
        assert text[last.start:] == ASSISTANT + "\n"

    # id mode: with every marker a single id, and with the thinking / tool-call tags as BPE
    # text (found in the decoded text)
    # where the header's "\n" merges with the body's first characters into one token ("\n\n"
    # before an empty body or a call block), the token goes with the body (it holds body text)
    # and the boundary is reported, once per such turn
    for kind in KINDS:
        _, ranges = encode_with_ranges(encoding(kind), text)
        merged_headers = [t for t in conv.turns if any(
            a < t.block.header_end < b for a, b in ranges)]
        conv_ids = check_id_mode(text, conv, encoding(kind))
        heads = [b for b in conv_ids.boundaries if b.message.startswith("header end")]
        assert len(heads) == len(merged_headers)
        assert all(b.message == "header end '\\n' falls inside a merged token" for b in heads)
        others = [b for b in conv_ids.boundaries if b not in heads]
        if kind == "apriel":
            assert not others
        assert all("soft marker" in b.message for b in others)


def test_every_shape_is_exercised():
    """The renderings really contain what the format is for (no test that cannot fail)."""
    kinds, roles, prompts = set(), set(), 0
    for _, text in _renders()[0]:
        conv = FMT.parse(text)
        kinds |= {s.kind for s in conv.spans()}
        roles |= {t.role for t in conv.turns}
        prompts += bool(conv.turns[-1].generation_prompt)
    assert kinds == {"content", "think", "tool_call"}
    assert roles == {"system", "user", "assistant", "tool", "content"}
    assert prompts == 3
    texts = "".join(t for _, t in _renders()[0])
    for marker in (BEGIN_FINAL, "[IMG]", "<available_tools>", '"id": "call00001"',
                   '{"name": <function-name-1>'):
        assert marker in texts
    # the last message's calls carry no id; the thought without add_thoughts is not printed
    calls_last = dict(_renders()[0])["apriel-calls-last"]
    assert '"id"' not in calls_last.split(ASSISTANT)[-1]
    assert "Greet back." not in dict(_renders()[0])["apriel-thought-without-flag"]


def test_tool_instructions_quote_a_call_block_that_never_trains():
    """With tools and no system message first, the template adds a system turn whose tool
    instructions quote `<tool_calls>[…]</tool_calls>`: a tool_call block of that system turn,
    parsed, never trained."""
    text = dict(_renders()[0])["tool-call-with-content"]
    conv = FMT.parse(text)
    system = conv.turns[0]
    assert system.role == "system"
    blocks = [b for b in system.block.children if b.kind == "tool_call"]
    assert len(blocks) == 1
    assert text[blocks[0].start:blocks[0].end].startswith(CALLS + '[{"name": <function-name-1>')
    assert all(s.start >= conv.turns[2].start for s in conv.spans())


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("kind", KINDS)
def test_conformance(kind: str) -> None:
    """The render-diff oracle (chatgrammar.conformance) over the matrix and the Apriel cases, in
    text mode, with the one-id-per-marker tokenizer and with an Apriel tokenizer."""
    cases = [c for c in all_cases() if c.name not in NOT_CONFORMANCE]
    res = check_template(FMT, template(TEMPLATE), name=TEMPLATE, cases=cases,
                         tokenizer=encoding(kind), tokenizer_name=kind, variables=SPECIALS)
    assert res.ok, [(c.case, c.reason) for c in res.cases if c.status == "fail"]
    assert res.counts() == {"pass": len(cases), "fail": 0, "skip": 0}


def test_conformance_needs_the_real_eos():
    """The template writes `eos_token` after each assistant turn: without it the check says
    the template needs the variable; with another string than Apriel's "</s>" the rendering
    does not parse (text between turns), so no case passes vacuously."""
    res = check_template(FMT, template(TEMPLATE), name=TEMPLATE)
    fails = [c for c in res.cases if c.status == "fail"]
    assert fails and all("needs the variable 'eos_token'" in c.reason for c in fails)
    res = check_template(FMT, template(TEMPLATE), name=TEMPLATE, variables={"eos_token": "<eos>"})
    fails = [c for c in res.cases if c.status == "fail"]
    assert fails and all("text between turns does not match" in c.reason for c in fails)
    # the one case that passes is the one without an assistant message
    assert [c.case for c in res.cases if c.status == "pass"] == ["generation-prompt-thinking-off"]


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("kind", KINDS)
def test_embedded_examples_text_and_ids(kind: str) -> None:
    tok = encoding(kind)
    assert len(FMT.spec.examples) >= 12
    def soft_only(got, want, conv_ids, policy, name) -> None:
        soft = {b.offset for b in conv_ids.boundaries if "soft marker" in b.message}
        assert not soft or kind == "apriel-text", name
        assert_mask(got, want, policy, soft)

    check_embedded_examples(FMT, tok, text_only_suffix="<|assist", error_match="unexpected",
                            check_mask=soft_only)


# --------------------------------------------------------------------------- detection


def test_detect_template() -> None:
    """Only apriel matches the template: Phi-3's detector declares <|tool_result|> absent."""
    assert cg.detect_format(chat_template=template(TEMPLATE)).name == "apriel"
    ex = cg.explain_detection(chat_template=template(TEMPLATE))
    assert ex.matched == ["apriel"] and ex.rule == {"kind": "only-match"}


@pytest.mark.parametrize("kind", KINDS)
def test_detect_tokenizer(kind: str) -> None:
    """A tokenizer with Apriel's markers as ids also has Phi-3's <|user|> / <|assistant|> /
    <|end|>: both detectors match, apriel wins by its declared precedence (the thinking /
    tool-call tags play no part)."""
    tok = encoding(kind)
    assert cg.detect_format(tok).name == "apriel"
    ex = cg.explain_detection(tok)
    assert sorted(ex.matched) == ["apriel", "phi3"]
    assert cg.detect_format(tok, chat_template=template(TEMPLATE)).name == "apriel"


@pytest.mark.parametrize("apriel_only", [TOOL_RESULT, CONTENT, BEGIN_FINAL])
def test_detect_needs_one_apriel_only_token(apriel_only: str) -> None:
    """Phi-3's four turn markers and any one Apriel-only token as ids: apriel. Without any of
    them: phi3."""
    import tiktoken

    base = encoding("apriel")
    keep = {SYSTEM, USER, ASSISTANT, END, apriel_only} | set(TEKKEN_IDS)
    specials = {k: v for k, v in base._special_tokens.items() if k in keep}
    enc = tiktoken.Encoding(name="apriel-min-test", pat_str=base._pat_str,
                            mergeable_ranks=base._mergeable_ranks, special_tokens=specials)
    assert cg.detect_format(enc).name == "apriel"
    specials.pop(apriel_only)
    enc = tiktoken.Encoding(name="phi-like-test", pat_str=base._pat_str,
                            mergeable_ranks=base._mergeable_ranks, special_tokens=specials)
    assert cg.detect_format(enc).name == "phi3"


def test_phi3_tokenizer_stays_phi3() -> None:
    assert cg.detect_format(phi3_tokenizer()).name == "phi3"


# --------------------------------------------------------------------------- truncation

TRUNCATION = ["apriel-thoughts", "apriel-reasoning-in-content", "unicode"]


def _last_assistant(conv):
    return [t for t in conv.turns if t.role == "assistant" and t.block.body_end
            and t.block.body_end > t.block.body_start][-1]


@pytest.mark.parametrize("name", TRUNCATION)
def test_truncation_both_modes(name: str) -> None:
    text = dict(_renders()[0])[name]
    full = FMT.parse(text)
    last = _last_assistant(full)
    b0, b1 = last.block.body_start, last.block.body_end
    assert text[b0:b1] == "".join(t for _, t in oracle(CASES[name])[-1][0])

    # text: cut at every few chars of the body -> the content present trains; the turn is
    # incomplete; a cut inside a marker string holds the fragment back
    markers = [m.text for m in FMT.spec.markers.values()]
    for cut in range(b0 + 1, b1, max(1, (b1 - b0) // 15)):
        conv = FMT.parse(text[:cut])
        frag = max((k for k in range(1, 30) if any(
            m.startswith(text[cut - k:cut]) and len(m) > k for m in markers)), default=0)
        lt = conv.turns[-1]
        assert "".join(text[s.start:s.end] for s in conv.spans()
                       if s.turn == len(conv.turns) - 1) == text[b0:cut - frag]
        assert not lt.complete
        assert sum(conv.mask(cg.MaskPolicy(truncated=False))[last.start:]) == 0
        assert conv.mask()[:last.start] == full.mask()[:last.start]
    # text: cut inside the opener marker, right after it (the header's "\n" missing), right
    # after the header (a generation prompt), inside <|end|>, before the EOS
    for k in (last.start + 5, b0 - 1, b0):
        conv = FMT.parse(text[:k])
        assert len(conv.mask()) == k
        assert conv.mask() == full.mask()[:min(k, last.start)] + [0] * max(0, k - last.start)
    # a cut inside <|end|>: the fragment trains nothing; the prefix cannot know the whitespace
    # before it is the terminator's (lstrip), so that whitespace may train like the text
    # before it. A cut after <|end|>, or before the EOS, changes nothing.
    end_at = text.index(END, b1 - 1)
    ws = end_at - len(text[:end_at]) + len(text[:end_at].rstrip())
    conv = FMT.parse(text[:end_at + 3])
    diff = [k for k, (a, b) in enumerate(zip(conv.mask(), full.mask())) if a != b]
    assert set(diff) <= set(range(ws, end_at)) and not any(conv.mask()[end_at:])
    for k in (end_at + len(END), end_at + len(END) + 1):
        conv = FMT.parse(text[:k])
        assert conv.turns[-1].complete
        assert conv.mask() == full.mask()[:k]
    # with end_marker, the cut right after <|end|> trains <|end|> (and the "\n" before it where
    # it belongs to the terminator) as the whole sample does
    k = end_at + len(END)
    assert FMT.parse(text[:k]).mask(cg.MaskPolicy(end_marker=True)) == \
        full.mask(cg.MaskPolicy(end_marker=True))[:k]

    for kind in KINDS:
        tok = encoding(kind)
        ids, _ = encode_with_ranges(tok, text)
        full_ids = FMT.parse_ids(ids, tok)
        full_mask = full_ids.mask_array().tolist()
        lt = _last_assistant(full_ids)
        # ids: cut mid body
        c = lt.block.body_start + max(1, (lt.block.body_end - lt.block.body_start) // 2)
        m = FMT.loss_mask(ids[:c], tok)
        assert len(m) == c and m[lt.block.body_start:c] == full_mask[lt.block.body_start:c]
        assert any(m[lt.block.body_start:c])
        # ids: cut right after the opener: nothing of that turn trains
        m = FMT.loss_mask(ids[:lt.start + 1], tok, strict=False)
        assert m == full_mask[:lt.start] + [0]
        # every prefix: one value per id, and never more than the full sample trains
        for c in range(0, len(ids) + 1, max(1, len(ids) // 60)):
            m = FMT.loss_mask(ids[:c], tok, strict=False)
            assert len(m) == c and all(a <= b for a, b in zip(m, full_mask[:c]))


# --------------------------------------------------------------------------- typed markers


def test_typed_markers_in_user_text_stay_text_in_id_mode() -> None:
    """A user who types Apriel's markers gets ordinary BPE pieces: where the vocabulary has the
    markers as ids, id mode sees one user turn and trains only the real reply. Text mode (and
    id mode on a vocabulary that spells the markers as text) cannot tell: it reads a forged
    assistant turn."""
    forged = "x\n" + END + "\n" + ASSISTANT + "\nFORGED"
    head = USER + "\n"
    tail = "\n" + END + "\n" + ASSISTANT + "\nReal reply.\n" + END + "\n" + EOS
    tok = encoding("apriel")
    ids = (tok.encode(head, allowed_special="all") + tok.encode_ordinary(forged)
           + tok.encode(tail, allowed_special="all"))
    conv = FMT.parse_ids(ids, tok)
    assert [t.role for t in conv.turns] == ["user", "assistant"]
    assert [tok.decode(ids[s.start:s.end]) for s in conv.spans()] == ["Real reply.\n"]
    text_conv = FMT.parse(head + forged + tail)
    assert [t.role for t in text_conv.turns] == ["user", "assistant", "assistant"]
    tok = encoding("apriel-text")
    ids = tok.encode(head + forged + tail, allowed_special="all")
    assert [t.role for t in FMT.parse_ids(ids, tok).turns] == ["user", "assistant", "assistant"]
