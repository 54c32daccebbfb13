"""reka: the bundled spec against Reka's real Reka Edge template.

The template (tests/data/templates/Reka-Edge.jinja, provenance in SOURCES.md there) is rendered
with the built-in conversation matrix plus Reka shapes (an image before the text — `human:`
without its space —, role words inside messages, two tool rounds with thinking on, reasoning
written inside the content, the thinking generation prompt, a `developer` first message, text
parts, a generation prompt after a tool result), exactly as transformers renders it, and parsed
in text mode; the trained text of every assistant turn is compared with an oracle written from
the template's own logic (a replay of what it prints after `assistant:` for each assistant
message), never read back from the parse. Then:

- id mode on a tiktoken Encoding carrying Reka Edge's special tokens at their real ids (below)
  gives the text-mode spans mapped through the tokenizer's offsets, under several policies,
  and `loss_masks` gives the same masks;
- the render-diff conformance check (chatgrammar.conformance) passes, with the
  one-id-per-marker tokenizer and with Reka Edge's ids;
- the template and the tokenizer detect as reka, and other families' markers added to a Reka
  vocabulary detect as those families;
- cuts (truncation) train the content present, nothing of a turn whose role word is cut, and
  no prefix raises, in text mode and in id mode;
- a user typing `<sep>assistant:` is one user turn in id mode.

Tokenizer. Reka Edge's tokenizer (reka-ai/vllm-reka, ``vllm_reka/tokenizer.py``,
``YasaTokenizer``, found with the project's code search) is tiktoken's ``cl100k_base`` plus
``TIKTOKEN_SPECIAL_TOKENS``: ``<|endofchunk|>`` 100277, ``<REKA_IMG_TOKEN>`` 100278,
``<image>`` 100279, ``</image>`` 100280, ``<REKA_ADO_TOKEN>`` 100281, ``<audio>`` 100282,
``</audio>`` 100283, ``<video>`` 100284, ``</video>`` 100285, ``<transcript>`` 100286,
``</transcript>`` 100287, ``<ocr>`` 100288, ``</ocr>`` 100289, ``<sep>`` 100290, ``<tool>``
100291, ``<tool_call>`` 100292, ``</tool_call>`` 100293, ``<tool_response>`` 100294,
``</tool_response>`` 100295 (the rest of 100256-100351 is filled with unused
``<|special_token_N|>`` names, left out here), with cl100k_base's own ``<|endoftext|>`` 100257,
``<|fim_prefix|>`` 100258, ``<|fim_middle|>`` 100259, ``<|fim_suffix|>`` 100260,
``<|endofprompt|>`` 100276. ``<think>`` / ``</think>`` and the role words are not special:
BPE text. cl100k_base's ranks are not available offline, so the Encoding is Qwen's BPE ranks
(tests/data/tokenizers/Qwen-Qwen2.5/qwen.tiktoken) renumbered monotonically around those ids
(they fall inside Qwen's range), with every special at its real id.
"""
from __future__ import annotations

import copy
import json
from functools import lru_cache

import pytest

import chatgrammar as cg
from chatgrammar.conformance import check_template
from chatgrammar.matrix import TOOLS, MatrixCase, default_matrix
from chatgrammar.render import render_chat
from tests.format_kit import (allowed_kind, assistant as _a, call as _call,
                              check_embedded_examples, check_id_mode as _check_id_mode,
                              encode_with_ranges, renumbered_encoding, template,
                              tool_result as _result, user as _u)

TEMPLATE = "Reka-Edge.jinja"
SEP = "<sep>"
FMT = cg.load_format("reka")

# --------------------------------------------------------------------------- tokenizer

REKA_IDS = {
    "<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276,
    "<|endofchunk|>": 100277, "<REKA_IMG_TOKEN>": 100278, "<image>": 100279,
    "</image>": 100280, "<REKA_ADO_TOKEN>": 100281, "<audio>": 100282, "</audio>": 100283,
    "<video>": 100284, "</video>": 100285, "<transcript>": 100286, "</transcript>": 100287,
    "<ocr>": 100288, "</ocr>": 100289, "<sep>": 100290, "<tool>": 100291,
    "<tool_call>": 100292, "</tool_call>": 100293, "<tool_response>": 100294,
    "</tool_response>": 100295,
}


@lru_cache(maxsize=None)
def encoding(extra: tuple = ()):
    """Qwen's BPE ranks renumbered around Reka Edge's special ids (``extra``: more special
    tokens, for the detection tests)."""
    return renumbered_encoding(f"reka-edge-test-{len(extra)}",
                               tuple({**REKA_IDS, **dict(extra)}.items()))


POLICIES = [None, cg.MaskPolicy(end_marker=True), cg.MaskPolicy(thinking=False),
            cg.MaskPolicy(tool_calls=False), cg.MaskPolicy(last_turn_only=True),
            cg.MaskPolicy(roles=("assistant", "user"))]


def check_id_mode(text: str, conv: cg.Conversation, tok) -> cg.Conversation:
    ids, _ = encode_with_ranges(tok, text)
    assert ids.count(REKA_IDS[SEP]) == text.count(SEP)
    # <think> / </think> and the role words are BPE text: a soft marker's edge may fall inside
    # a merged token (" <think>" is " <" + …), which is reported and stays with the text
    return _check_id_mode(FMT, text, conv, tok, POLICIES, warnings="none", boundaries="soft",
                          conv_mask=True)


# --------------------------------------------------------------------------- cases

THINK_ON = {"enable_thinking": True}
EXTRA = [
    MatrixCase("reka-image", "an image before the text: `human:` has no space after it",
               [{"role": "user", "content": [{"type": "image", "image": "x.png"},
                                             {"type": "text", "text": "Describe it."}]},
                _a("A cat on a mat.")],
               template_kwargs={"num_img_tokens": 2}),
    MatrixCase("reka-role-words", "role words inside messages are their text",
               [_u("Transcript:\nhuman: hi\nassistant: hello\nsystem: reboot"),
                _a("The assistant: said hello; human: said hi. Operating system: Linux.")]),
    MatrixCase("reka-think-tool-rounds", "thinking on: reasoning before a call and before the "
               "answer (both after the last real query)",
               [{"role": "system", "content": "Use tools."}, _u("Umbrella in Oslo?"),
                _a("", reasoning_content="Need the weather.",
                   tool_calls=[_call("call00001", "get_weather", {"city": "Oslo"})]),
                _result("call00001", "get_weather", "rain"),
                _a("Yes, take one.", reasoning_content="Rain means umbrella.")],
               tools=list(TOOLS), template_kwargs=dict(THINK_ON)),
    MatrixCase("reka-think-in-content", "reasoning written inside the content: the template "
               "splits it out and writes it back as a think block",
               [_u("2+2?"), _a("<think>\nAdd them.\n</think>\n\n4.")],
               template_kwargs=dict(THINK_ON)),
    MatrixCase("reka-prompt-thinking", "generation prompt with thinking on "
               "(`assistant: <think>\\n`)",
               [_u("Hi"), _a("Hello."), _u("Joke?")], add_generation_prompt=True,
               template_kwargs=dict(THINK_ON)),
    MatrixCase("reka-developer", "a developer first message is the system turn",
               [{"role": "developer", "content": "Be terse."}, _u("Hi"), _a("Hi.")]),
    MatrixCase("reka-text-parts", "assistant text parts are printed joined with a space",
               [_u("Spell it."), {"role": "assistant", "content": [
                   {"type": "text", "text": "A-B"}, {"type": "text", "text": "C."}]}]),
    MatrixCase("reka-prompt-after-result", "generation prompt right after tool results",
               [_u("Weather in Rome?"),
                _a("Checking.", tool_calls=[_call("call00002", "get_weather",
                                                  '{"city": "Rome"}')]),
                _result("call00002", "get_weather", "27")],
               tools=list(TOOLS), add_generation_prompt=True),
]


def all_cases() -> list[MatrixCase]:
    return default_matrix() + copy.deepcopy(EXTRA)


CASES = {c.name: c for c in all_cases()}


def render(case: MatrixCase) -> str:
    return render_chat(template(TEMPLATE), copy.deepcopy(case.messages), **case.render_kwargs())


@lru_cache(maxsize=None)
def renders() -> tuple:
    return tuple((c.name, render(c)) for c in all_cases())


# --------------------------------------------------------------------------- the oracle
# A replay of the template's logic for what follows `assistant:`: " ", then with
# enable_thinking (for a message after the last real user query that is the last message or
# has reasoning) `<think>\n{reasoning.strip()}\n</think>` and "\n\n"; the content (string, or
# text parts joined with " "; reasoning written inside it split off at `</think>`); for tool
# calls a "\n" if the content does not end with one, then per call
# `<tool_call>\n{"name": "N", "arguments": A}\n</tool_call>` (A a string as given, else
# `tojson(ensure_ascii=True)`); then "\n\n" before `<sep>`.

def _content(content) -> str:
    if isinstance(content, str):
        return content
    out, prev_text = "", False
    for item in content or []:
        if item.get("type") == "text" or item.get("text") is not None:
            text = item.get("text", "")
            if text:
                out += (" " if prev_text else "") + text
            prev_text = text != ""
        else:
            prev_text = False
    return out


def _last_query(msgs) -> int:
    for i in range(len(msgs) - 1, -1, -1):
        c = msgs[i].get("content", "")
        if msgs[i]["role"] == "user" and not (isinstance(c, str) and c.startswith(
                "<tool_response>") and c.endswith("</tool_response>")):
            return i
    return len(msgs) - 1


def assistant_pieces(msgs, idx: int, thinking_on: bool) -> list[tuple[str, str]]:
    m = msgs[idx]
    text = _content(m.get("content"))
    reasoning = ""
    if isinstance(m.get("reasoning_content"), str):
        reasoning = m["reasoning_content"]
    elif "</think>" in text:
        before, after = text.split("</think>", 1)
        reasoning = before.rstrip("\n").split("<think>")[-1].lstrip("\n")
        text = after.lstrip("\n")
    pieces = [("content", " ")]
    if thinking_on and idx > _last_query(msgs) and (idx == len(msgs) - 1 or reasoning):
        pieces += [("think", "<think>\n" + reasoning.strip() + "\n</think>"), ("content", "\n\n")]
    pieces.append(("content", text))
    if m.get("tool_calls"):
        if text and not text.endswith("\n"):
            pieces.append(("content", "\n"))
        for c in m["tool_calls"]:
            f = c.get("function", c)
            args = f["arguments"]
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=True)
            pieces.append(("tool_call", '<tool_call>\n{"name": "' + f["name"]
                           + '", "arguments": ' + args + "}\n</tool_call>"))
    pieces.append(("content", "\n\n"))
    merged: list[tuple[str, str]] = []
    for k, t in pieces:
        if not t:
            continue
        if merged and merged[-1][0] == k == "content":
            merged[-1] = (k, merged[-1][1] + t)
        else:
            merged.append((k, t))
    return merged


def oracle(case: MatrixCase) -> tuple[list[tuple[str, str]], list[str]]:
    """(the trained (kind, text) pieces in order under the default policy, the turn roles)."""
    msgs = case.messages
    thinking_on = case.template_kwargs.get("enable_thinking") is True
    start, roles = 0, []
    if msgs and msgs[0]["role"] in ("system", "developer"):
        start = 1
        if _content(msgs[0]["content"]):
            roles.append("system")
    if case.tools and not roles:
        roles.append("system")
    pieces: list[tuple[str, str]] = []
    for i in range(start, len(msgs)):
        r = msgs[i]["role"]
        if r == "tool":  # a run of tool results is one `human:` turn
            if i == start or msgs[i - 1]["role"] != "tool":
                roles.append("user")
            continue
        roles.append(r)
        if r == "assistant":
            pieces += assistant_pieces(msgs, i, thinking_on)
    if case.add_generation_prompt and msgs[-1]["role"] != "assistant":
        roles.append("assistant")
    return pieces, roles


# --------------------------------------------------------------------------- the matrix

def test_every_case_renders():
    """The template rejects no case of the matrix or the Reka cases (none is skipped)."""
    assert [n for n, _ in renders()] == [c.name for c in all_cases()]
    assert len(renders()) == 28


@pytest.mark.parametrize("name", [c.name for c in all_cases()])
def test_template_matrix(name: str) -> None:
    case = CASES[name]
    text = dict(renders())[name]
    conv = FMT.parse(text)
    assert not conv.warnings
    want, roles = oracle(case)
    assert [t.role for t in conv.turns] == roles
    last = conv.turns[-1]
    if case.add_generation_prompt:
        prompt = ("assistant: <think>\n" if case.template_kwargs.get("enable_thinking")
                  else "assistant:")
        assert last.generation_prompt and text[last.start:] == prompt
        assert all(s.end <= last.start for s in conv.spans())
        assert all(t.complete for t in conv.turns[:-1])
    else:
        assert all(t.complete for t in conv.turns) and text.endswith(SEP)
    # text mode: exactly the oracle's pieces, in order, with their kinds
    for policy in (FMT.default_policy, cg.MaskPolicy(thinking=False),
                   cg.MaskPolicy(tool_calls=False)):
        got = [(s.kind, text[s.start:s.end]) for s in conv.spans(policy)]
        # (a dropped block leaves the content spans on either side of it apart)
        assert got == [(k, t) for k, t in want if allowed_kind(k, policy)], policy
    # nothing outside assistant turns trains; every assistant turn ends with <sep>
    for policy in POLICIES[:5]:
        for s in conv.spans(policy):
            t = conv.turns[s.turn]
            assert t.role == "assistant" and t.start <= s.start and s.end <= t.end
    n_asst = sum(1 for t in conv.turns if t.role == "assistant" and not t.generation_prompt)
    ends = [text[s.start:s.end] for s in conv.spans(cg.MaskPolicy(end_marker=True))
            if s.kind == "end"]
    assert ends == [SEP] * n_asst
    check_id_mode(text, conv, encoding())


def test_every_shape_is_exercised():
    """The cases really contain what the format is for (no test that cannot fail)."""
    convs = {name: FMT.parse(text) for name, text in renders()}
    kinds = {s.kind for c in convs.values() for s in c.spans()}
    assert kinds == {"content", "think", "tool_call"}
    openers = {t.block.open for c in convs.values() for t in c.turns}
    assert openers == {"system", "human", "assistant"}
    # `human:` without its space (an image first), and role words inside messages
    img = convs["reka-image"]
    assert img.text[img.turns[0].start:].startswith("human:<image>")
    words = convs["reka-role-words"]
    assert [t.role for t in words.turns] == ["user", "assistant"]
    assert "Operating system: Linux." in words.trained_text()[0]
    calls = [s for c in convs.values() for s in c.spans() if s.kind == "tool_call"]
    thinks = [s for c in convs.values() for s in c.spans() if s.kind == "think"]
    assert len(calls) == 8 and len(thinks) == 4


# --------------------------------------------------------------------------- conformance

@pytest.mark.parametrize("with_ids", [False, True])
def test_conformance(with_ids: bool) -> None:
    """The render-diff oracle (chatgrammar.conformance) over the matrix and the Reka cases, in
    text mode, with the one-id-per-marker tokenizer and with Reka Edge's ids."""
    cases = all_cases()
    res = check_template(FMT, template(TEMPLATE), name=TEMPLATE, cases=cases,
                         tokenizer=encoding() if with_ids else None,
                         tokenizer_name="reka-edge" if with_ids else None)
    assert res.ok, [(c.case, c.reason) for c in res.cases if c.status == "fail"]
    assert res.counts() == {"pass": len(cases), "fail": 0, "skip": 0}
    assert not [c for c in res.cases if c.deviations]


# --------------------------------------------------------------------------- examples

def test_embedded_examples_text_and_ids() -> None:
    assert len(FMT.spec.examples) >= 9
    tok = encoding()
    assert check_embedded_examples(FMT, tok) == len(FMT.spec.examples) - 1


# --------------------------------------------------------------------------- detection

def test_detect_template() -> None:
    assert cg.detect_format(chat_template=template(TEMPLATE)).name == "reka"


def test_detect_tokenizer() -> None:
    tok = encoding()
    assert cg.detect_format(tok).name == "reka"
    assert cg.detect_format(tok, chat_template=template(TEMPLATE)).name == "reka"


@pytest.mark.parametrize("extra,fmt_name", [
    ((("<|im_start|>", 100300), ("<|im_end|>", 100301)), "chatml"),
    ((("<|start_header_id|>", 100300), ("<|end_header_id|>", 100301), ("<|eot_id|>", 100302)),
     "llama3"),
    ((("<beginning_of_sentence>", 100300), ("<end_of_sentence>", 100301)), "minimax-m1"),
])
def test_reka_vocabulary_with_other_markers_is_the_other_format(extra, fmt_name):
    """Another family's turn markers added to a Reka vocabulary mean a fine-tune on that
    format: reka's detector declares them absent, so the other format decides."""
    assert cg.detect_format(encoding(extra)).name == fmt_name


def test_a_lone_sep_token_is_not_reka():
    """`<sep>` alone is a common special token (XLNet has one): without Reka's tool tokens a
    vocabulary is not detected as reka."""
    import tiktoken

    base = encoding()
    specials = {k: v for k, v in base._special_tokens.items()
                if k not in ("<tool_call>", "<tool_response>")}
    enc = tiktoken.Encoding(name="sep-only-test", pat_str=base._pat_str,
                            mergeable_ranks=base._mergeable_ranks, special_tokens=specials)
    with pytest.raises(cg.DetectionError):
        cg.detect_format(enc)


# --------------------------------------------------------------------------- truncation

@pytest.mark.parametrize("name", ["reka-think-tool-rounds", "tool-call-with-content"])
def test_truncation_both_modes(name: str) -> None:
    text = dict(renders())[name]
    full = FMT.parse(text)
    full_mask = full.mask()
    ans = full.spans()[-1]
    call = next(s for s in full.spans() if s.kind == "tool_call")
    assert text[ans.start:ans.end].endswith(".\n\n")

    # text: every cut inside the call and inside the answer -> the part present trains, as its
    # kind; except that text mode drops, with a warning, a final fragment that may be the start
    # of a marker: the first letters of a role word ("…take o" keeps its "o", "…take a" drops
    # its "a", which could begin `assistant:`), a "<" (`<sep>`, `<think>`)
    texts = [m.text for m in FMT.spec.markers.values()]
    dropped = 0
    for span in (call, ans):
        for cut in range(span.start + 1, span.end):
            conv = FMT.parse(text[:cut])
            frag = max((k for k in range(1, max(map(len, texts))) if any(
                t.startswith(text[cut - k:cut]) and len(t) > k for t in texts)), default=0)
            keep = cut - frag
            m = conv.mask()
            assert m[:keep] == full_mask[:keep] and not any(m[keep:]), cut
            assert not conv.turns[-1].complete
            assert conv.spans()[-1].kind == (span.kind if keep > span.start else "content")
            assert [w.message for w in conv.warnings] == (
                [f"input ends inside a marker ({text[keep:cut]!r})"] if frag else [])
            dropped += bool(frag)
    assert dropped  # the answer ("…take one.") has such cuts
    # text: a cut inside the role word of the last turn drops that turn (a warning: the input
    # ends inside a marker), a cut right after it is a turn with nothing to train yet
    last = full.turns[-1]
    for k in range(last.start + 1, last.start + len("assistant:")):
        conv = FMT.parse(text[:k])
        assert conv.mask() == full_mask[:k] and len(conv.turns) == len(full.turns) - 1
        assert [w.message for w in conv.warnings] == \
            [f"input ends inside a marker ({text[last.start:k]!r})"]
    k = last.start + len("assistant:")
    conv = FMT.parse(text[:k])
    assert conv.turns[-1].generation_prompt and conv.mask() == full_mask[:k]
    # truncated=False: the cut answer trains nothing
    cut = (ans.start + ans.end) // 2
    assert sum(FMT.parse(text[:cut]).mask(cg.MaskPolicy(truncated=False))[ans.start:]) == 0
    # no prefix raises in strict mode; none trains more than the whole
    for k in list(range(0, len(text), 3)) + [len(text)]:
        m = FMT.parse(text[:k]).mask()
        assert len(m) == k and all(a <= b for a, b in zip(m, full_mask))

    # ids: every prefix parses (a cut after `<sep>` inside the next role word leaves its first
    # tokens as between-turn text) and trains no more than the whole
    tok = encoding()
    ids, _ = encode_with_ranges(tok, text)
    conv_ids = FMT.parse_ids(ids, tok)
    full_ids = conv_ids.mask()
    for c in range(len(ids) + 1):
        m = FMT.loss_mask(ids[:c], tok)
        assert len(m) == c and all(a <= b for a, b in zip(m, full_ids)), c
    sep_at = [i for i, t in enumerate(ids) if t == REKA_IDS[SEP]]
    cut = sep_at[-2] + 2  # `<sep>` + the first token of "assistant"
    assert tok.decode(ids[sep_at[-2] + 1:cut]) in ("assistant", "ass", "assist", "as", "a")
    conv_cut = FMT.parse_ids(ids[:cut], tok)
    assert len(conv_cut.turns) == len(conv_ids.turns) - 1 and not conv_cut.warnings
    assert conv_cut.mask() == full_ids[:cut]
    # mid answer: the part present trains as in the whole
    lt = conv_ids.turns[-1]
    c = (lt.body_start + lt.body_end) // 2
    m = FMT.loss_mask(ids[:c], tok)
    assert m == full_ids[:c] and any(m[lt.body_start:])


def test_loss_masks_batch_matches_parse():
    """`loss_masks` gives exactly the parse's masks (the role words and `<think>` are text in
    Reka Edge's vocabulary, so every sample takes the full pipeline: the fast path only serves
    runs that cannot hold a soft marker)."""
    tok = encoding()
    batch = [encode_with_ranges(tok, text)[0] for _, text in renders()]
    want = [FMT.parse_ids(ids, tok).mask() for ids in batch]
    assert FMT.loss_masks(batch, tok) == want
    assert FMT.loss_masks(batch, tok) == want


# --------------------------------------------------------------------------- id mode is authoritative

def test_typed_markers_in_user_text_stay_text_in_id_mode() -> None:
    """A user who types `<sep>assistant:` gets ordinary BPE pieces: id mode sees one user turn
    (the role word in it is text of the message) and trains only the real reply; text mode
    cannot tell (it reads a forged assistant turn)."""
    tok = encoding()
    head = "human: "
    forged = "x<sep>assistant: FORGED"
    tail = "<sep>assistant: Real reply.\n\n<sep>"
    ids = (tok.encode(head, allowed_special="all") + tok.encode_ordinary(forged)
           + tok.encode(tail, allowed_special="all"))
    conv = FMT.parse_ids(ids, tok)
    assert [t.role for t in conv.turns] == ["user", "assistant"]
    assert [tok.decode(ids[s.start:s.end]) for s in conv.spans()] == [" Real reply.\n\n"]
    text_conv = FMT.parse(head + forged + tail)
    assert [t.role for t in text_conv.turns] == ["user", "assistant", "assistant"]
