"""The offline tokenizer builders of tests/tokenizers.py produce the real ids.

Known ids come from the models' published tokenizer_config.json / tokenizer.json (Qwen2.5/Qwen3,
Mistral v0.3, Phi-3) and, for Phi-3, from llama.cpp's own tokenizer test vectors shipped with the
GGUF. The rendered chats of each family's template must put every control marker on one id.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from chatgrammar.conformance.matrix import default_matrix, iter_renderable
from chatgrammar.conformance.render import render_chat

from tests import tokenizers as tk  # noqa: E402
from tests.lazy_modules import lazy_importorskip  # noqa: E402

# skips the module at collection when transformers is not installed, imports it when the
# first test runs (not while every worker collects the suite)
_transformers = lazy_importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def _needs_transformers():
    _transformers._load()  # installed but failing to import: every test here skips, as before

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"


def _renderings(template_name: str, **special_tokens):
    template = (TEMPLATES / template_name).read_text(encoding="utf-8")
    return [(case, text) for case, text, reason in iter_renderable(template, **special_tokens)
            if reason is None]


# --------------------------------------------------------------------------------- Qwen
@pytest.fixture(scope="module")
def qwen():
    pytest.importorskip("tiktoken")
    return tk.qwen_fast_tokenizer()


def test_qwen_added_tokens_at_real_ids(qwen):
    assert len(qwen) == 151_669
    for token_id, content, special in tk.QWEN_ADDED_TOKENS:
        assert qwen.convert_tokens_to_ids(content) == token_id
        assert qwen.encode(content, add_special_tokens=False) == [token_id]
        assert qwen.convert_ids_to_tokens(token_id) == content
        assert (content in qwen.all_special_tokens) == special, content
    assert qwen.eos_token == "<|im_end|>" and qwen.pad_token == "<|endoftext|>"
    assert qwen.bos_token is None


@pytest.mark.parametrize("text, ids", [
    # ids of the real Qwen2.5 / Qwen3 tokenizer
    ("Hello world", [9707, 1879]),
    ("<|im_start|>system\n", [151644, 8948, 198]),
    ("<|im_start|>user\n", [151644, 872, 198]),
    ("<|im_start|>assistant\n", [151644, 77091, 198]),
    ("<|im_end|>\n", [151645, 198]),
    ("<think>\n\n</think>\n\n", [151667, 271, 151668, 271]),
    ("12345", [16, 17, 18, 19, 20]),  # Qwen splits digits one by one
])
def test_qwen_known_ids(qwen, text, ids):
    assert qwen.encode(text, add_special_tokens=False) == ids
    assert qwen.decode(ids) == text


def test_qwen_tiktoken_agrees_with_fast_tokenizer(qwen):
    enc = tk.qwen_tiktoken_encoding()
    assert enc.n_vocab == 151_669
    assert enc.encode("<|im_start|>user\n", allowed_special="all") == [151644, 872, 198]
    texts = [text for name in ("Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3.jinja")
             for _, text in _renderings(name)]
    assert len(texts) > 30
    for text in texts:
        ids = enc.encode(text, allowed_special="all")
        assert ids == qwen.encode(text, add_special_tokens=False)
        assert enc.decode(ids) == text


def test_qwen_rendered_markers_are_single_ids(qwen):
    for case, text in _renderings("Qwen-Qwen3.jinja"):
        ids = qwen.encode(text, add_special_tokens=False)
        assert ids.count(151644) == text.count("<|im_start|>"), case.name
        assert ids.count(151645) == text.count("<|im_end|>"), case.name
        assert ids.count(151657) == text.count("<tool_call>"), case.name
        assert ids.count(151667) == text.count("<think>"), case.name
        assert qwen.decode(ids) == text


def test_qwen_apply_chat_template_matches_render_chat(qwen):
    template = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    for case in default_matrix(tags={"tool-calls"}):
        expected = qwen.apply_chat_template(case.messages, chat_template=template,
                                            tokenize=False, **case.render_kwargs())
        assert render_chat(template, case.messages, **qwen.special_tokens_map,
                           **case.render_kwargs()) == expected


# ------------------------------------------------------------------------------ Mistral
MISTRAL_CONTROL = {"<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 5,
                   "[AVAILABLE_TOOLS]": 6, "[/AVAILABLE_TOOLS]": 7, "[TOOL_RESULTS]": 8,
                   "[/TOOL_RESULTS]": 9}
MISTRAL_V7_CONTROL = {**MISTRAL_CONTROL, "[SYSTEM_PROMPT]": 16, "[/SYSTEM_PROMPT]": 17,
                      "[TOOL_CONTENT]": 18}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("version, control", [("v3", MISTRAL_CONTROL),
                                              ("v7", MISTRAL_V7_CONTROL)])
def test_mistral_control_tokens(version, control, fast):
    pytest.importorskip("sentencepiece")
    tok = tk.mistral_tokenizer(version, fast=fast)
    assert len(tok) == 32_768
    assert tok.convert_tokens_to_ids("<unk>") == 0
    for piece, token_id in control.items():
        assert tok.convert_tokens_to_ids(piece) == token_id, piece
        assert tok.encode(piece, add_special_tokens=False) == [token_id], piece
    ids = tok.encode("[INST] What is 2 + 2?[/INST] 4</s>", add_special_tokens=False)
    assert ids[0] == 3 and ids[-1] == 2 and ids.count(4) == 1


def test_mistral_fast_and_slow_on_rendered_chats():
    pytest.importorskip("sentencepiece")
    fast, slow = tk.mistral_tokenizer("v3"), tk.mistral_tokenizer("v3", fast=False)
    renderings = _renderings("mistralai-Mistral-7B-Instruct-v0.3.jinja",
                             bos_token="<s>", eos_token="</s>")
    assert len(renderings) == len(default_matrix())  # the template accepts every case
    for case, text in renderings:
        ids = fast.encode(text, add_special_tokens=False)
        assert ids.count(3) == text.count("[INST]") and ids.count(2) == text.count("</s>")
        assert ids.count(5) == text.count("[TOOL_CALLS]"), case.name
        slow_ids = slow.encode(text, add_special_tokens=False)
        assert fast.decode(ids) == text and slow.decode(slow_ids) == text, case.name
        if "multiline" in case.tags:
            # SentencePiece's BPE and the converted tokenizers BPE split the indented code line
            # differently ("▁▁▁▁ return" vs "▁▁▁ ▁return"): a real fast/slow divergence.
            assert slow_ids != ids
            continue
        assert slow_ids == ids, case.name


# -------------------------------------------------------------------------------- Phi-3
@pytest.fixture(scope="module")
def phi3():
    pytest.importorskip("gguf")
    return tk.phi3_tokenizer()


def test_phi3_control_tokens(phi3):
    assert len(phi3) == 32_064
    for piece, token_id in {"<|endoftext|>": 32000, "<|assistant|>": 32001, "<|system|>": 32006,
                            "<|end|>": 32007, "<|user|>": 32010, "<s>": 1, "</s>": 2}.items():
        assert phi3.convert_tokens_to_ids(piece) == token_id, piece
        assert phi3.encode(piece, add_special_tokens=False) == [token_id], piece


def test_phi3_matches_llamacpp_test_vectors(phi3):
    vectors = tk.phi3_test_vectors()
    assert len(vectors) > 40
    for text, expected in vectors:
        assert phi3.encode(text, add_special_tokens=False) == expected, repr(text)


def test_phi3_gguf_template_renders_like_transformers(phi3):
    assert phi3.chat_template and "<|assistant|>" in phi3.chat_template
    for case, text in [(c, t) for c, t, r in iter_renderable(
            phi3.chat_template, **phi3.special_tokens_map) if r is None]:
        expected = phi3.apply_chat_template(case.messages, tokenize=False,
                                            **case.render_kwargs())
        assert text == expected, case.name
        ids = phi3.encode(text, add_special_tokens=False)
        assert ids.count(32010) == text.count("<|user|>")
        assert ids.count(32007) == text.count("<|end|>")
