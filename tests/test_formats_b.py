"""mistral, deepseek-v3, harmony, glm4, minimax-m2: the bundled specs against their real templates.

Every template is rendered with the built-in conversation matrix (plus a few family-specific
cases) exactly as transformers renders it (:mod:`chatgrammar.render`), parsed in text mode, and
the trained text of each assistant turn is compared with an oracle written from the template's
own logic (what it prints for each assistant message), never read back from the parse. Then:

- id mode, on real tokenizers (Mistral's SentencePiece v3 / v7, fast and slow; for the other
  families tiktoken Encodings with their real special ids, :mod:`tests.family_tokenizers`),
  must give the text-mode spans mapped through the tokenizer's offsets (a token a span boundary
  falls inside is trained and reported on ``Conversation.boundaries``);
- TRL's training templates (``{% generation %}``) cover the same assistant output, up to the
  documented differences (docs/formats.md);
- every template and tokenizer detects as its format;
- cuts (truncation) train the content present, and nothing of a turn cut inside its header.

Shapes a template rejects are listed in ``REJECTED`` with the template's reason: a template that
starts or stops rejecting one fails :func:`test_rejected_shapes_are_the_templates_own`.
"""
from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.conformance import check_template
from chatgrammar.matrix import MatrixCase, default_matrix, get_case
from chatgrammar.registry import formats_dir
from chatgrammar.render import TemplateError, render_chat, render_chat_with_spans
from tests.family_tokenizers import REAL_IDS, SPECIAL_TOKENS, encoding_for
from tests.format_kit import encode_with_ranges, mapped_mask, merged_spans, parse_example
from tests.tokenizers import mistral_tokenizer

DATA = Path(__file__).resolve().parent / "data"
TEMPLATES = DATA / "templates"
GOLDENS = DATA / "goldens" / "openai-harmony"

V03 = "mistralai-Mistral-7B-Instruct-v0.3.jinja"
NEMO = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
SMALL3 = "mistralai-Mistral-Small-24B-Instruct-2501.jinja"
SMALL32 = "Mistral-Small-3.2-24B-Instruct-2506.jinja"
MINISTRAL = "mistralai-Ministral-3-14B-Reasoning-2512.jinja"
DSV3 = "deepseek-ai-DeepSeek-V3.jinja"
DSR1 = "deepseek-ai-DeepSeek-R1.jinja"
DQWEN = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
DLLAMA = "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
DSV31 = "deepseek-ai-DeepSeek-V3.1.jinja"
DSV32 = "deepseek-ai-DeepSeek-V3.2.jinja"
GPTOSS = "openai-gpt-oss-120b.jinja"
GLM45 = "zai-org-GLM-4.5.jinja"
GLM46 = "GLM-4.6.jinja"
GLM47 = "GLM-4.7-Flash.jinja"
MINIMAX = "MiniMax-M2.jinja"

FAMILY = {V03: "mistral", NEMO: "mistral", SMALL3: "mistral", SMALL32: "mistral",
          MINISTRAL: "mistral", DSV3: "deepseek-v3", DSR1: "deepseek-v3",
          DQWEN: "deepseek-v3", DLLAMA: "deepseek-v3", DSV31: "deepseek-v3",
          DSV32: "deepseek-v3", GPTOSS: "harmony", GLM45: "glm4", GLM46: "glm4", GLM47: "glm4",
          MINIMAX: "minimax-m2"}
MISTRAL_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
# which SentencePiece model carries a template's markers (v3: no [SYSTEM_PROMPT]; v7 has it)
MISTRAL_SPM = {V03: "v3", NEMO: "v3", SMALL3: "v7", SMALL32: "v7", MINISTRAL: "v7"}


def specials(tpl: str) -> dict:
    fam = FAMILY[tpl]
    return MISTRAL_SPECIALS if fam == "mistral" else SPECIAL_TOKENS[fam]


@lru_cache(maxsize=None)
def template(name: str) -> str:
    path = TEMPLATES / name
    if not path.exists():
        path = TEMPLATES / "generation" / name
    return path.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- extra cases

def _u(text):
    return {"role": "user", "content": text}


def _call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _tool(cid, name, content):
    return {"role": "tool", "tool_call_id": cid, "name": name, "content": content}


_WEATHER = json.dumps({"city": "Paris"})
EXTRA = [
    MatrixCase("think-blocks", "Mistral reasoning models: content as text and thinking chunks",
               [{"role": "system", "content": "Think first."}, _u("Is 7 prime?"),
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "No divisors."},
                                                  {"type": "text", "text": "Yes."}]}]),
    MatrixCase("two-tool-rounds", "two tool-calling messages (string arguments), then an answer",
               [_u("Weather in Paris, then Rome?"),
                {"role": "assistant", "content": "",
                 "tool_calls": [_call("call00001", "get_weather", _WEATHER)]},
                _tool("call00001", "get_weather", "sunny"),
                {"role": "assistant", "content": "",
                 "tool_calls": [_call("call00002", "get_weather", json.dumps({"city": "Rome"}))]},
                _tool("call00002", "get_weather", "rain"),
                {"role": "assistant", "content": "Paris sunny, Rome rain."}]),
    MatrixCase("null-content-parallel", "tool calls with content None and two tool outputs",
               [_u("Weather in Paris and Rome?"),
                {"role": "assistant", "content": None,
                 "tool_calls": [_call("call00001", "get_weather", _WEATHER),
                                _call("call00002", "get_weather", json.dumps({"city": "Rome"}))]},
                _tool("call00001", "get_weather", "sunny"), _tool("call00002", "get_weather", "rain"),
                {"role": "assistant", "content": "Sunny and rain."}]),
    MatrixCase("tool-thinking-on", "reasoning around a tool call with thinking switched on",
               [_u("Umbrella in Paris?"),
                {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
                 "tool_calls": [_call("call00005", "get_weather", {"city": "Paris"})]},
                _tool("call00005", "get_weather", "sunny"),
                {"role": "assistant", "content": "No umbrella.", "reasoning_content": "Sunny."}],
               tools=None, template_kwargs={"thinking": True, "enable_thinking": True}),
]


def all_cases() -> list[MatrixCase]:
    return default_matrix() + copy.deepcopy(EXTRA)


def render(tpl: str, case: MatrixCase) -> str:
    return render_chat(template(tpl), copy.deepcopy(case.messages),
                       **{**specials(tpl), **case.render_kwargs()})


@lru_cache(maxsize=None)
def _renders(tpl: str) -> tuple:
    ok, rejected = [], {}
    for case in all_cases():
        try:
            ok.append((case.name, render(tpl, case)))
        except TemplateError as exc:
            rejected[case.name] = exc.message
    return tuple(ok), rejected


CASES = {c.name: c for c in all_cases()}

# The shapes each template rejects, and why (the template's own error). Everything else renders
# and is checked.
_DICT_ARGS = "can only concatenate str (not \"dict\") to str"
_LIST_CONTENT = "can only concatenate str (not \"list\") to str"
_STR_ARGS = "'str object' has no attribute 'items'"
_ROLES = "Only user, system and assistant roles are supported!"
_NO_TOOLS = ("tool-call", "tool-call-string-args", "tool-call-with-content",
             "parallel-tool-calls", "reasoning-tool-call", "two-tool-rounds",
             "null-content-parallel", "tool-thinking-on")
_NO_CONTENT = "'dict object' has no attribute 'content'"  # content None is dropped
_CONCAT = "can only concatenate"
REJECTED: dict[str, dict[str, str]] = {
    NEMO: {"content-parts": _LIST_CONTENT, "think-blocks": _CONCAT},
    SMALL3: {**{c: _ROLES for c in _NO_TOOLS if c != "null-content-parallel"},
             "null-content-parallel": _NO_CONTENT,
             "think-blocks": "'dict object' has no attribute 'text'"},
    SMALL32: {"think-blocks": "Only text and image blocks are supported"},
    MINISTRAL: {"empty-assistant": "Assistant message must have a string or a list of chunks"},
    DSV3: {c: _DICT_ARGS for c in ("tool-call", "tool-call-with-content", "parallel-tool-calls",
                                   "reasoning-tool-call", "tool-thinking-on")}
    | {"content-parts": _LIST_CONTENT, "think-blocks": _LIST_CONTENT,
       "null-content-parallel": _NO_CONTENT},
    DQWEN: {"content-parts": _LIST_CONTENT, "think-blocks": _LIST_CONTENT,
            "null-content-parallel": _NO_CONTENT},
    DLLAMA: {"content-parts": _LIST_CONTENT, "think-blocks": _LIST_CONTENT,
             "null-content-parallel": _NO_CONTENT},
    DSV31: {c: _DICT_ARGS for c in ("tool-call", "tool-call-with-content", "parallel-tool-calls",
                                    "reasoning-tool-call", "tool-thinking-on")}
    | {"content-parts": _LIST_CONTENT, "think-blocks": _CONCAT,
       "null-content-parallel": _NO_CONTENT},
    DSV32: {c: "No filter named 'from_json'" for c in ("tool-call-string-args",
                                                       "two-tool-rounds",
                                                       "null-content-parallel")}
    | {"content-parts": _LIST_CONTENT},
    GPTOSS: {"content-parts": _LIST_CONTENT, "think-blocks": _LIST_CONTENT},
    GLM45: {c: _STR_ARGS for c in ("tool-call-string-args", "two-tool-rounds",
                                   "null-content-parallel")},
    GLM46: {c: "Invalid tool call arguments" for c in ("tool-call-string-args", "two-tool-rounds",
                                                       "null-content-parallel")},
    GLM47: {c: _STR_ARGS for c in ("tool-call-string-args", "two-tool-rounds",
                                   "null-content-parallel")},
    MINIMAX: {c: _STR_ARGS for c in ("tool-call-string-args", "two-tool-rounds",
                                     "null-content-parallel")},
}
# DSR1 is DSV3's template with another generation prompt
REJECTED[DSR1] = REJECTED[DSV3]


@pytest.mark.parametrize("tpl", list(FAMILY))
def test_rejected_shapes_are_the_templates_own(tpl):
    _, rejected = _renders(tpl)
    want = REJECTED.get(tpl, {})
    assert sorted(rejected) == sorted(want)
    for name, why in want.items():
        assert why in rejected[name], (name, rejected[name])


# ----------------------------------------------------------------------------- oracles
# What each template prints for each assistant message between the turn's header (marker) and
# its terminator, written from the template source; one string per assistant turn of the parse.

def _tj(x) -> str:
    return json.dumps(x, ensure_ascii=False)


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content or ""


def oracle_mistral(tpl: str, case: MatrixCase) -> list[str]:
    out = []
    for m in case.messages:
        if m["role"] != "assistant":
            continue
        calls = m.get("tool_calls")
        if tpl in (V03, NEMO):
            if calls:
                items = [_tj(c["function"])[:-1] + f', "id": "{c["id"]}"}}' for c in calls]
                out.append("[TOOL_CALLS]" + (" " if tpl == V03 else "") + "[" + ", ".join(items)
                           + "]")
            else:
                out.append(" " + _text(m["content"]).strip() if tpl == V03 else m["content"])
        elif tpl == SMALL3:
            c = m["content"]
            out.append(c if isinstance(c, str) else c[0]["text"])
        elif tpl == SMALL32:
            if calls:
                out.append("".join(f"[TOOL_CALLS]{c['function']['name']}[CALL_ID]{c['id']}"
                                   f"[ARGS]{_tj(c['function']['arguments'])}" for c in calls))
            else:
                out.append(_text(m["content"]))
        else:  # MINISTRAL
            c = m["content"]
            s = ""
            if isinstance(c, str):
                s = c
            elif c:
                for b in c:
                    s += b["text"] if b["type"] == "text" else f"[THINK]{b['thinking']}[/THINK]"
            for call in calls or ():
                a = call["function"]["arguments"]
                a = (a or "{}") if isinstance(a, str) else _tj(a)
                s += f"[TOOL_CALLS]{call['function']['name']}[ARGS]{a}"
            out.append(s)
    return out


def oracle_deepseek(tpl: str, case: MatrixCase) -> list[str]:
    msgs, out = case.messages, []
    if tpl in (DSV3, DSR1, DQWEN, DLLAMA):
        distill = tpl in (DQWEN, DLLAMA)
        is_first = is_tool = False
        for m in msgs:
            role = m["role"]
            if role == "user":
                is_tool = False
            calls_path = (m.get("content") is None) if distill else ("tool_calls" in m)
            if role == "assistant" and calls_path:
                is_tool = False
                s = ""
                for c in m["tool_calls"]:
                    f = c["function"]
                    one = (f"<｜tool▁call▁begin｜>{c['type']}<｜tool▁sep｜>{f['name']}\n```json\n"
                           f"{f['arguments']}\n```<｜tool▁call▁end｜>")
                    if not is_first:
                        s += (m.get("content") or "") + "<｜tool▁calls▁begin｜>" + one
                        is_first = True
                    else:
                        s += "\n" + one
                        if distill:  # the distill templates close the section per call
                            s += "<｜tool▁calls▁end｜>"
                out.append(s if distill else s + "<｜tool▁calls▁end｜>")
            elif role == "assistant":
                if is_tool:
                    out.append(m["content"])
                    is_tool = False
                else:
                    out.append(m["content"].split("</think>")[-1])
            elif role == "tool":
                is_tool = True
    elif tpl == DSV31:
        is_first = is_tool = last_user = False
        for m in msgs:
            role = m["role"]
            if role == "user":
                is_tool = is_first = False
                last_user = True
            elif role == "assistant" and m.get("tool_calls") is not None:
                s = "</think>" if last_user else ""
                last_user = is_first = is_tool = False
                for c in m["tool_calls"]:
                    f = c["function"]
                    one = f"<｜tool▁call▁begin｜>{f['name']}<｜tool▁sep｜>{f['arguments']}<｜tool▁call▁end｜>"
                    if not is_first:
                        s += (m.get("content") or "") + "<｜tool▁calls▁begin｜>" + one
                        is_first = True
                    else:
                        s += one
                out.append(s + "<｜tool▁calls▁end｜>")
            elif role == "assistant":
                s = "</think>" if last_user else ""
                last_user = False
                c = m["content"]
                if not is_tool and "</think>" in c:
                    c = c.split("</think>", 1)[1]
                is_tool = False
                out.append(s + c)
            elif role == "tool":
                last_user, is_tool = False, True
    else:  # DSV32
        kw = case.template_kwargs
        thinking = kw.get("thinking", kw.get("enable_thinking", False))
        last_user = max(i for i, m in enumerate(msgs) if m["role"] in ("user", "developer"))
        pending_asst = pending_tool = False
        for i, m in enumerate(msgs):
            if m["role"] == "user":
                pending_asst, pending_tool = True, False
            elif m["role"] == "assistant":
                on = i > last_user and thinking
                r = m.get("reasoning_content") or ""
                if pending_asst:
                    s = f"<think>{r}</think>" if on else "</think>"
                elif pending_tool:
                    # the function results end at the `<think>` / `</think>` that opens the
                    # reply (`close.opens_follow`): it trains with the reply
                    s = f"<think>{r}</think>" if on else "</think>"
                else:
                    s = ""
                pending_asst = pending_tool = False
                c = m.get("content") or ""
                s += c if isinstance(c, str) else str(c)  # a list prints as its repr
                if m.get("tool_calls"):
                    s += "\n\n<｜DSML｜function_calls>\n"
                    for c in m["tool_calls"]:
                        s += f'<｜DSML｜invoke name="{c["function"]["name"]}">\n'
                        for k, v in c["function"]["arguments"].items():
                            st, vv = ("true", v) if isinstance(v, str) else ("false", _tj(v))
                            s += f'<｜DSML｜parameter name="{k}" string="{st}">{vv}</｜DSML｜parameter>\n'
                        s += "</｜DSML｜invoke>\n"
                    s += "</｜DSML｜function_calls>"
                out.append(s)
            elif m["role"] == "tool":
                pending_tool = True  # (one call per round in these cases)
    return out


def oracle_harmony(tpl: str, case: MatrixCase) -> list[str]:
    # every Harmony message trains from after `<|start|>assistant`: the header the model
    # writes itself (recipient, channel, content type, <|message|>) and the text
    msgs = case.messages
    loop = msgs[1:] if msgs[0]["role"] in ("system", "developer") else msgs
    analysis, final = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>"
    out = []
    for i, m in enumerate(loop):
        if m["role"] != "assistant":
            continue
        thinking = m.get("reasoning_content")  # rendered under `thinking` too
        if "tool_calls" in m:
            future_final = any(f["role"] == "assistant" and "tool_calls" not in f
                               for f in loop[i + 1:])
            if m.get("content") and not future_final:
                out.append(analysis + m["content"])
            elif thinking and not future_final:
                out.append(analysis + thinking)
            f = m["tool_calls"][0]["function"]
            out.append(f" to=functions.{f['name']}<|channel|>commentary json<|message|>"
                       + _tj(f["arguments"]))
        elif i == len(loop) - 1 and not case.add_generation_prompt:
            if thinking is not None:
                out.append(analysis + thinking)
            out.append(final + m["content"])
        else:
            out.append(final + m["content"])
    return out


def oracle_glm(tpl: str, case: MatrixCase) -> list[str]:
    msgs, out = case.messages, []
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        content = _text(m["content"])
        r = m.get("reasoning_content") or ""
        if tpl == GLM47:
            s = f"<think>{r.strip()}</think>" if (i > last_user and r) else "</think>"
            s += content.strip()
            for c in m.get("tool_calls") or ():
                f = c["function"]
                s += "<tool_call>" + f["name"] + "".join(
                    f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else _tj(v)}"
                    "</arg_value>" for k, v in f["arguments"].items()) + "</tool_call>"
        else:
            s = f"\n<think>{r.strip()}</think>" if (i > last_user and r) else "\n<think></think>"
            if content.strip():
                s += "\n" + content.strip()
            for c in m.get("tool_calls") or ():
                f = c["function"]
                s += "\n<tool_call>" + f["name"] + "\n" + "".join(
                    f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else _tj(v)}"
                    "</arg_value>\n" for k, v in f["arguments"].items()) + "</tool_call>"
        out.append(s)
    return out


def oracle_minimax(tpl: str, case: MatrixCase) -> list[str]:
    msgs = case.messages
    conv = msgs[1:] if msgs[0]["role"] == "system" else msgs
    last_user = max((i for i, m in enumerate(conv) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        r = m.get("reasoning_content") or ""
        s = f"<think>\n{r}\n</think>\n\n" if (r and i > last_user) else ""
        s += _text(m["content"])
        if m.get("tool_calls"):
            s += "\n<minimax:tool_call>\n"
            for c in m["tool_calls"]:
                f = c["function"]
                s += f'<invoke name="{f["name"]}">\n' + "".join(
                    f'<parameter name="{k}">{v if isinstance(v, str) else _tj(v)}</parameter>\n'
                    for k, v in f["arguments"].items()) + "</invoke>\n"
            s += "</minimax:tool_call>"
        out.append(s)
    return out


ORACLES = {"mistral": oracle_mistral, "deepseek-v3": oracle_deepseek, "harmony": oracle_harmony,
           "glm4": oracle_glm, "minimax-m2": oracle_minimax}


def trained_per_turn(conv: cg.Conversation, text: str, policy=None) -> list[str]:
    """Trained text of every assistant turn (generation prompts left out), in order."""
    got: dict[int, str] = {}
    for s in conv.spans(policy):
        got[s.turn] = got.get(s.turn, "") + text[s.start:s.end]
    return [got.get(i, "") for i, t in enumerate(conv.turns)
            if t.role == "assistant" and not t.generation_prompt]


# ----------------------------------------------------------------------------- id mode helpers

# Mistral's v11+ / v13 (Tekken) control tokens that the offline SentencePiece v7 model lacks;
# Small-3.2 and Ministral-3 renders use them.
V13_CONTROLS = ["[CALL_ID]", "[ARGS]", "[THINK]", "[/THINK]"]


@lru_cache(maxsize=None)
def mistral_v13_like(fast: bool):
    """Mistral's v7 SentencePiece tokenizer plus the v11/v13 control tokens as special tokens
    (new ids past the vocabulary), standing in for the Tekken tokenizer of Small-3.2 and
    Ministral-3, which is not available offline."""
    tok = copy.deepcopy(mistral_tokenizer("v7", fast=fast))
    tok.add_special_tokens({"additional_special_tokens": V13_CONTROLS})
    return tok


def tokenizers_for(tpl: str) -> list:
    fam = FAMILY[tpl]
    if fam == "mistral":
        if tpl in (SMALL32, MINISTRAL):
            return [mistral_v13_like(True), mistral_v13_like(False)]
        v = MISTRAL_SPM[tpl]
        return [mistral_tokenizer(v, fast=True), mistral_tokenizer(v, fast=False)]
    return [encoding_for(fam)]


def encode(tok, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """ids and per-token char ranges (None for a slow tokenizer, which has no offsets)."""
    if type(tok).__name__ == "Encoding":
        return encode_with_ranges(tok, text)
    if getattr(tok, "is_fast", False):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    return tok.encode(text, add_special_tokens=False), None


POLICIES = [None, cg.MaskPolicy(thinking=False, end_marker=True),
            cg.MaskPolicy(tool_calls=False, end_marker=False)]


def check_id_mode(fmt: cg.Format, text: str, conv: cg.Conversation, tok) -> cg.Conversation:
    ids, ranges = encode(tok, text)
    conv_ids = fmt.parse_ids(ids, tok)
    assert not conv_ids.warnings and conv_ids.length == len(ids)
    assert [t.role for t in conv_ids.turns] == [t.role for t in conv.turns]
    assert [t.generation_prompt for t in conv_ids.turns] == \
        [t.generation_prompt for t in conv.turns]
    for policy in POLICIES:
        got = fmt.loss_mask(ids, tok, policy=policy)
        assert [(s.kind, s.role, s.turn) for s in conv_ids.spans(policy)] == \
            [(s.kind, s.role, s.turn) for s in conv.spans(policy)]
        if ranges is not None:
            assert got == mapped_mask(conv, ranges, len(text), policy)
        else:  # slow SentencePiece: no offsets; the decoded trained ids of every turn must
            # spell the text-mode trained text (SentencePiece drops a leading space on decode)
            per_ids: dict[int, list[int]] = {}
            for s in conv_ids.spans(policy):
                per_ids.setdefault(s.turn, []).extend(ids[s.start:s.end])
            per_txt: dict[int, str] = {}
            for s in conv.spans(policy):
                per_txt[s.turn] = per_txt.get(s.turn, "") + text[s.start:s.end]
            assert sorted(per_ids) == sorted(per_txt)
            for t, tids in per_ids.items():
                dec = tok.decode(tids, skip_special_tokens=False)
                assert dec.split() == per_txt[t].split() or \
                    "".join(dec.split()) == "".join(per_txt[t].split())
    return conv_ids


# ----------------------------------------------------------------------------- the matrix

MATRIX = [(tpl, name) for tpl in FAMILY for name, _ in _renders(tpl)[0]]


@pytest.mark.parametrize("tpl,name", MATRIX, ids=[f"{t.removesuffix('.jinja')}-{n}"
                                                  for t, n in MATRIX])
def test_template_matrix(tpl: str, name: str) -> None:
    case = CASES[name]
    text = dict(_renders(tpl)[0])[name]
    fmt = cg.load_format(FAMILY[tpl])
    conv = fmt.parse(text)
    assert not conv.warnings

    # text mode: each assistant turn trains exactly what the template printed for it
    exact = fmt.default_policy.replace(end_marker=False)
    assert trained_per_turn(conv, text, exact) == ORACLES[FAMILY[tpl]](tpl, case)
    # nothing outside assistant turns trains, under any policy
    for policy in POLICIES:
        for s in conv.spans(policy):
            t = conv.turns[s.turn]
            assert t.role == "assistant" and t.start <= s.start and s.end <= t.end
    # the default policy: mistral also trains every complete reply's </s>
    ends = [text[s.start:s.end] for s in conv.spans() if s.kind == "end"]
    if FAMILY[tpl] == "mistral":
        assert ends == ["</s>"] * sum(1 for t in conv.turns if t.role == "assistant"
                                      and t.complete)
    else:
        assert ends == []
    # a generation prompt trains nothing of the final turn
    if case.add_generation_prompt:
        last = conv.turns[-1]
        assert last.role != "assistant" or last.generation_prompt
        assert all(s.end <= last.start for s in conv.spans())

    for tok in tokenizers_for(tpl):
        check_id_mode(fmt, text, conv, tok)


# Two more upstream Mistral templates, as generated by mistral-common's template generator
# (copied from llama.cpp's tests/test-chat-template.cpp): "v1" writes " [INST] " after <s> and
# after </s>; "v7" (Mistral-Large-Instruct-2411) writes " " + content.
MISTRAL_V1 = (
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}"
    "\n    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}"
    "\n{%- endif %}\n\n{{- bos_token }}\n{%- for message in loop_messages %}\n    {%- if (message['role'] "
    "== 'user') != (loop.index0 % 2 == 0) %}\n        {{- raise_exception('After the optional system "
    "message, conversation roles must alternate user/assistant/user/assistant/...') }}\n    {%- endif %}"
    "\n    {%- if message['role'] == 'user' %}\n        {%- if loop.first and system_message is defined %}"
    "\n            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n        {%- endif %}"
    "\n    {%- elif message['role'] == 'assistant' %}\n        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n        {{- raise_exception('Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!') }}\n    {%- endif %}\n{%- endfor %}\n")
MISTRAL_V7_2411 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
    "message['content'] + '[/INST]' }}{% elif message['role'] == 'system' %}{{ '[SYSTEM_PROMPT] ' + "
    "message['content'] + '[/SYSTEM_PROMPT]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + "
    "message['content'] + eos_token }}{% else %}{{ raise_exception('Only user, system and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("tpl,version", [(MISTRAL_V1, "v3"), (MISTRAL_V7_2411, "v7")],
                         ids=["v1", "v7-large-2411"])
@pytest.mark.parametrize("name", ["basic", "multi-turn", "multi-turn-no-system", "unicode",
                                  "special-chars", "multiline", "generation-prompt"])
def test_more_mistral_templates(tpl: str, version: str, name: str) -> None:
    case = get_case(name)
    text = render_chat(tpl, copy.deepcopy(case.messages), **MISTRAL_SPECIALS,
                       **case.render_kwargs())
    fmt = cg.load_format("mistral")
    conv = fmt.parse(text)
    want = [" " + m["content"] for m in case.messages if m["role"] == "assistant"]
    assert trained_per_turn(conv, text, fmt.default_policy.replace(end_marker=False)) == want
    for tok in (mistral_tokenizer(version, fast=True), mistral_tokenizer(version, fast=False)):
        check_id_mode(fmt, text, conv, tok)


def test_mistral_fast_and_slow_agree_where_the_ids_agree():
    fmt = cg.load_format("mistral")
    compared = 0
    for tpl in (V03, NEMO, SMALL3, SMALL32, MINISTRAL):
        fast, slow = tokenizers_for(tpl)
        for _, text in _renders(tpl)[0]:
            a = fast.encode(text, add_special_tokens=False)
            b = slow.encode(text, add_special_tokens=False)
            if a == b:
                compared += 1
                assert fmt.loss_mask(a, fast) == fmt.loss_mask(b, slow)
    assert compared >= 20


# ----------------------------------------------------------------------------- embedded examples

FAMILIES = ("mistral", "deepseek-v3", "harmony", "glm4", "minimax-m2")


@pytest.mark.parametrize("name", FAMILIES)
def test_embedded_examples_text_and_ids(name: str) -> None:
    fmt = cg.load_format(name)
    assert len(fmt.spec.examples) >= 6
    tok = mistral_v13_like(True) if name == "mistral" else encoding_for(name)
    for ex in fmt.spec.examples:
        text, want = parse_example(ex.text)
        policy = cg.MaskPolicy.from_mapping(ex.policy, fmt.default_policy) if ex.policy else None
        conv = fmt.parse(text)
        assert merged_spans(conv.spans(policy)) == want, ex.name
        if any(m.text[:k] and text.endswith(m.text[:k]) for m in fmt.spec.markers.values()
               for k in range(2, len(m.text))):
            # a text cut inside a marker string: in ids a marker is one id, so there the
            # fragment is ordinary text (covered by test_truncation_both_modes instead)
            continue
        ids, ranges = encode(tok, text)
        conv_ids = fmt.parse_ids(ids, tok)
        assert fmt.loss_mask(ids, tok, policy=policy) == \
            mapped_mask(conv, ranges, len(text), policy), ex.name
        assert [t.role for t in conv_ids.turns] == [t.role for t in conv.turns], ex.name


# ----------------------------------------------------------------------------- conformance

_REPEATED_PROMPT = {"reasoning", "reasoning-thinking-on", "reasoning-tool-call"}


@pytest.mark.parametrize("tpl", [GPTOSS, DSV3, DSR1, DQWEN, DLLAMA, DSV31, DSV32])
def test_conformance_trains_what_the_model_writes(tpl: str) -> None:
    """The render-diff oracle (chatgrammar.conformance): each assistant message trains from
    where the template's generation prompt ends. Harmony: after `<|start|>assistant`, with the
    one documented deviation (a message rendered as several Harmony messages leaves each later
    `<|start|>assistant` untrained). R1-Distill-Qwen prompts with `<｜tool▁outputs▁end｜>\n`:
    the reply after tool outputs trains from right after the marker."""
    fam = FAMILY[tpl]
    res = check_template(cg.load_format(fam), template(tpl), name=tpl,
                         variables=SPECIAL_TOKENS[fam] if fam == "deepseek-v3" else None)
    assert res.ok, [(c.case, c.reason) for c in res.cases if c.status == "fail"]
    devs = {c.case for c in res.cases if c.deviations}
    assert devs == (_REPEATED_PROMPT if tpl == GPTOSS else set())
    for c in res.cases:
        assert all(d.startswith("message [") and "'<|start|>assistant', untrained" in d
                   for d in c.deviations)
        if tpl == DQWEN and c.case == "tool-call":
            assert c.text[c.expected[-1][0]:].startswith("It is sunny")


def test_conformance_deviation_is_accepted_only_for_the_format_that_documents_it(tmp_path):
    """The same spec under another name gets no pass for the repeated `<|start|>assistant`."""
    spec = (formats_dir() / "harmony.yaml").read_text(encoding="utf-8")
    path = tmp_path / "harmony-copy.yaml"
    path.write_text(spec.replace("name: harmony", "name: harmony-copy", 1), encoding="utf-8")
    res = check_template(cg.load_format(path), template(GPTOSS))
    failed = {c.case: c.reason for c in res.cases if c.status == "fail"}
    assert set(failed) == _REPEATED_PROMPT
    assert all("the trained text has a gap" in r and "'<|start|>assistant'" in r
               for r in failed.values())


# ----------------------------------------------------------------------------- harmony goldens

# Header words of the two o200k_harmony id goldens, at their o200k ids. They are read off
# openai/harmony's own expected parse of these goldens (tests/test_harmony.py: channels
# "analysis"/"final", recipient "lookup_weather", content type "code"): e.g. the second message
# of test_simple_tool_call is `<|start|> 173781 316 28 29712 170154 <|channel|> 35644 3490
# <|message|>` = `assistant to=lookup_weather<|channel|>analysis code`.
O200K_HEADER_WORDS = {173781: "assistant", 316: " to", 28: "=", 29712: "lookup",
                      170154: "_weather", 35644: "analysis", 17196: "final", 3490: " code"}


class _HarmonyIdsOnly:
    """Minimal-protocol tokenizer for the id goldens: o200k_harmony's special ids, the header
    words above, and a placeholder for every other ordinary id (content is never decoded)."""

    def __init__(self):
        self.special = dict(REAL_IDS["harmony"])
        self.by_id = {v: k for k, v in self.special.items()} | O200K_HEADER_WORDS

    def convert_tokens_to_ids(self, text):
        return self.special.get(text)

    def decode(self, ids, **_):
        return "".join(self.by_id.get(int(i), "·") for i in ids)


def _golden(name: str) -> str:
    # as openai/harmony loads them: CRLF normalised, trailing whitespace trimmed
    return (GOLDENS / name).read_text(encoding="utf-8").replace("\r\n", "\n").rstrip()


TEXT_GOLDENS = sorted(p.name for p in GOLDENS.glob("*.txt")
                      if not re.fullmatch(r"[\d\s]+", _golden(p.name)))
ID_GOLDENS = sorted(p.name for p in GOLDENS.glob("*.txt") if p.name not in TEXT_GOLDENS)


@pytest.mark.parametrize("name", TEXT_GOLDENS)
def test_harmony_text_goldens(name: str) -> None:
    fmt = cg.load_format("harmony")
    text = _golden(name)
    if not text.startswith("<|start|>"):
        # a completion (parse_messages_from_completion_tokens(…, role=assistant)): the
        # assistant header before it is implied
        text = "<|start|>assistant" + text
    conv = fmt.parse(text)
    assert not conv.warnings
    roles = {t.role for t in conv.turns}
    assert roles <= {"system", "developer", "user", "assistant", "tool"}
    for s in conv.spans():
        assert conv.turns[s.turn].role == "assistant"
    check_id_mode(fmt, text, conv, encoding_for("harmony"))
    if text.endswith("<|start|>assistant"):
        assert conv.turns[-1].generation_prompt and not [
            s for s in conv.spans() if s.turn == len(conv.turns) - 1]


def test_harmony_golden_channels_typed():
    fmt = cg.load_format("harmony")
    conv = fmt.parse(_golden("test_keep_analysis_between_finals.txt"))
    assert [t.block.kind for t in conv.turns if t.role == "assistant"] == \
        ["content", "think", "content"]
    assert conv.trained_text(cg.MaskPolicy(thinking=False)) == \
        ["<|channel|>final<|message|>4", "<|channel|>final<|message|>8"]
    conv = fmt.parse(_golden("test_does_not_drop_if_ongoing_analysis.txt"))
    call = [t for t in conv.turns if t.attrs.get("to") == "functions.lookup_weather"][0]
    assert call.role == "assistant" and call.block.kind == "tool_call"
    assert call.attrs["content_type"] == "json"
    tool = [t for t in conv.turns if t.attrs.get("role") == "functions.lookup_weather"][0]
    assert tool.role == "tool"
    conv = fmt.parse("<|start|>assistant" + _golden("test_streamable_parser.txt"))
    assert [(t.role, t.block.kind) for t in conv.turns] == \
        [("assistant", "think"), ("assistant", "tool_call"), ("tool", "tool_call")]


@pytest.mark.parametrize("name", ID_GOLDENS)
def test_harmony_id_goldens(name: str) -> None:
    fmt = cg.load_format("harmony")
    ids = [200006, 173781] + [int(x) for x in _golden(name).split()]  # <|start|>assistant
    tok = _HarmonyIdsOnly()
    conv = fmt.parse_ids(ids, tok)
    assert not conv.warnings
    msgs = [(t.attrs.get("channel"), t.attrs.get("to"), t.attrs.get("content_type"), t.complete)
            for t in conv.turns]
    if name == "test_simple_reasoning_response.txt":
        assert msgs == [("analysis", None, None, True), ("final", None, None, False)]
        kinds = ["think", "content"]
    else:
        assert msgs == [("analysis", None, None, True),
                        ("analysis", "lookup_weather", "code", False)]
        kinds = ["think", "tool_call"]
    assert [t.role for t in conv.turns] == ["assistant", "assistant"]
    assert [s.kind for s in conv.spans()] == kinds
    # the trained ids are exactly each message after `<|start|>assistant` (the header the
    # model writes, then the content) up to its end
    for s, t in zip(conv.spans(), conv.turns):
        assert ids[t.start:s.start] == [200006, 173781]
        assert s.end == (t.end - 1 if t.complete else len(ids))
    assert conv.spans(cg.MaskPolicy(thinking=False))[0].kind == kinds[1]


# ----------------------------------------------------------------------------- TRL parity

TRL = {"trl-deepseekv3_training.jinja": "deepseek-v3", "trl-gptoss_training.jinja": "harmony",
       "trl-glm4moe_training.jinja": "glm4"}
_HARMONY_OPENER = "<|start|>assistant"


def _trl_renders(name: str):
    fam = TRL[name]
    for case in all_cases():
        try:
            yield case, render_chat_with_spans(template(name), copy.deepcopy(case.messages),
                                               **{**SPECIAL_TOKENS[fam], **case.render_kwargs()})
        except TemplateError:
            continue


@pytest.mark.parametrize("name", list(TRL))
def test_trl_generation_parity(name: str) -> None:
    """Our spans (end_marker=True) cover the same assistant output as TRL's {% generation %}
    spans; the differences are the documented ones (docs/formats.md):

    - deepseek-v3: TRL also trains the turn's opener (`<｜Assistant｜>`, or the
      `<｜tool▁outputs▁end｜>` the reply follows), which is prompt here;
    - harmony: one TRL span covers all of an assistant message's Harmony messages, each with
      its `<|start|>assistant`; ours are per message and start after `<|start|>assistant`
      (the rest of the header is model output and trains);
    - glm4: TRL appends the *next* role marker (`<|user|>`, `<|observation|>`, `<|system|>`) to
      the span, even after the last message; here a turn ends where that marker starts.
    """
    fam = TRL[name]
    fmt = cg.load_format(fam)
    tok = encoding_for(fam)
    checked = 0
    for case, res in _trl_renders(name):
        text = res.text
        conv = fmt.parse(text)
        assert not conv.warnings
        ours = conv.spans(cg.MaskPolicy(end_marker=True))
        n_asst_msgs = sum(1 for m in case.messages if m["role"] == "assistant")
        assert len(res.generation_spans) == n_asst_msgs
        covered = set()
        for gs, ge in res.generation_spans:
            inside = [s for s in ours if gs <= s.start and s.end <= ge]
            covered.update(id(s) for s in inside)
            got = "".join(text[s.start:s.end] for s in inside)
            gen = text[gs:ge]
            if fam == "deepseek-v3":
                # (none for a 2nd tool-calling message: the template drops <｜Assistant｜>)
                opener = next((o for o in ("<｜Assistant｜>", "<｜tool▁outputs▁end｜>")
                               if gen.startswith(o)), "")
                assert got == gen[len(opener):], case.name
            elif fam == "harmony":
                assert got == gen.replace(_HARMONY_OPENER, ""), case.name
            else:
                nxt = next(r for r in ("<|user|>", "<|observation|>", "<|system|>")
                           if gen.endswith(r))
                assert got == gen[:-len(nxt)], case.name
        # and we train nothing TRL does not
        assert covered == {id(s) for s in ours}, case.name
        # id mode agrees on the TRL renders too
        check_id_mode(fmt, text, conv, tok)
        checked += 1
    assert checked >= 12


# ----------------------------------------------------------------------------- detection

@pytest.mark.parametrize("tpl", list(FAMILY) + list(TRL))
def test_detect_template(tpl: str) -> None:
    fam = FAMILY.get(tpl) or TRL[tpl]
    assert cg.detect_format(chat_template=template(tpl)).name == fam


@pytest.mark.parametrize("fam", ["harmony", "deepseek-v3", "glm4", "minimax-m2"])
def test_detect_tokenizer(fam: str) -> None:
    assert cg.detect_format(encoding_for(fam)).name == fam


@pytest.mark.parametrize("version", ["v3", "v7"])
@pytest.mark.parametrize("fast", [True, False])
def test_detect_mistral_tokenizers(version: str, fast: bool) -> None:
    assert cg.detect_format(mistral_tokenizer(version, fast=fast)).name == "mistral"


def test_distill_tokenizer_carrying_chatml_detects_as_deepseek():
    # R1-Distill-Qwen's tokenizer is Qwen's plus DeepSeek's markers
    import tiktoken

    from tests.tokenizers import QWEN_IDS
    base = encoding_for("deepseek-v3")
    extra = {t: 300000 + i for i, t in enumerate(QWEN_IDS) if t not in REAL_IDS["deepseek-v3"]}
    enc = tiktoken.Encoding(name="distill-qwen-test", pat_str=base._pat_str,
                            mergeable_ranks=base._mergeable_ranks,
                            special_tokens={**base._special_tokens, **extra})
    assert cg.detect_format(enc).name == "deepseek-v3"


# ----------------------------------------------------------------------------- truncation

TRUNCATION = {GPTOSS: "reasoning", DSR1: "tool-call-string-args",
              DSV31: "tool-call-string-args", GLM45: "tool-call", MINIMAX: "tool-call",
              V03: "tool-call", SMALL32: "tool-call"}


def _last_assistant(conv):
    return [t for t in conv.turns if t.role == "assistant" and t.body_end
            and t.body_end > t.body_start][-1]


def _header_cuts(conv, last, marker_len: int) -> list[int]:
    """Cut points inside the last assistant turn's header: inside its opener marker, and
    inside its header text when it has one; for a reply without a header (Mistral, DeepSeek's
    reply after tool outputs), inside the marker that closes the turn before it."""
    if last.body_start == last.start:
        return [last.start - 2]
    cuts = [last.start + marker_len // 2]
    if last.block.header_end > last.block.header_start + 1:
        cuts.append(last.block.header_end - 1)
    return cuts


@pytest.mark.parametrize("tpl", list(TRUNCATION))
def test_truncation_both_modes(tpl: str) -> None:
    fmt = cg.load_format(FAMILY[tpl])
    text = dict(_renders(tpl)[0])[TRUNCATION[tpl]]
    full = fmt.parse(text)
    last = _last_assistant(full)
    # where the turn starts training: its body, or (Harmony) its header after the role
    ts = last.body_start if last.block.train_start is None else last.block.train_start
    whole = text[ts:last.body_end]

    # text: cut mid content -> the content present trains (with the header's trained tail)
    cut = last.body_start + max(1, (last.body_end - last.body_start) // 2)
    conv = fmt.parse(text[:cut])
    assert "".join(trained_per_turn(conv, text[:cut])[-1:]) == whole[:cut - ts]
    if fmt.spec.elements[last.block.name].close is not None:
        assert not conv.turns[-1].complete
        assert sum(conv.mask(cg.MaskPolicy(truncated=False))[last.start:]) == 0
    else:  # glm4: no terminator, so a cut turn cannot be told from a finished one
        assert conv.turns[-1].complete
    # text: cut inside the header -> nothing of that turn trains
    opener = fmt.spec.markers[last.block.open].text if last.block.open else ""
    for k in _header_cuts(full, last, len(opener)):
        conv = fmt.parse(text[:k])
        assert len(conv.mask()) == k
        assert conv.mask() == full.mask()[:min(k, last.start)] + [0] * max(0, k - last.start)

    for tok in tokenizers_for(tpl)[:1]:
        ids, ranges = encode(tok, text)
        full_ids = fmt.parse_ids(ids, tok)
        full_mask = full_ids.mask_array().tolist()
        last_ids = _last_assistant(full_ids)
        # ids: cut mid content
        c = last_ids.body_start + max(1, (last_ids.body_end - last_ids.body_start) // 2)
        m = fmt.loss_mask(ids[:c], tok)
        assert len(m) == c and m[last_ids.body_start:c] == full_mask[last_ids.body_start:c]
        assert any(m[last_ids.body_start:c])
        # ids: cut inside the header (right after its opener; Harmony / MiniMax: also one
        # token before the header ends) -> nothing of it
        cuts = [last_ids.start + 1] if last_ids.body_start > last_ids.start else \
            [last_ids.start - 1]
        if last_ids.block.header_end - last_ids.block.header_start > 1:
            cuts.append(last_ids.block.header_end - 1)
        for c in cuts:
            m = fmt.loss_mask(ids[:c], tok)
            assert len(m) == c and m == full_mask[:min(c, last_ids.start)] + \
                [0] * max(0, c - last_ids.start)
        # every prefix: one value per id, and never more than the full sample trains
        for c in range(0, len(ids) + 1, max(1, len(ids) // 60)):
            m = fmt.loss_mask(ids[:c], tok, strict=False)
            assert len(m) == c and all(a <= b for a, b in zip(m, full_mask[:c]))


# ----------------------------------------------------------------------------- boundaries

def test_boundary_inside_merged_token_is_trained_and_reported():
    # MiniMax: `]~b]ai\n` then "\n<minimax:tool_call>": Qwen's BPE merges the header's "\n"
    # with the body's "\n" into one token
    fmt = cg.load_format("minimax-m2")
    text = dict(_renders(MINIMAX)[0])["tool-call"]
    enc = encoding_for("minimax-m2")
    conv = fmt.parse(text)
    conv_ids = check_id_mode(fmt, text, conv, enc)
    assert conv_ids.boundaries and all("merged token" in b.message for b in conv_ids.boundaries)
    ids = enc.encode(text, allowed_special="all")
    for b in conv_ids.boundaries:
        assert enc.decode([ids[b.offset]]) == "\n\n"
        assert conv_ids.mask()[b.offset] == 1


def test_deepseek_distill_whitespace_before_tool_output_is_not_a_reply():
    fmt = cg.load_format("deepseek-v3")
    text = dict(_renders(DQWEN)[0])["parallel-tool-calls"]
    assert "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>" in text
    conv = fmt.parse(text)
    assert [t.role for t in conv.turns] == ["system", "user", "assistant", "tool", "tool",
                                            "assistant"]
