"""chatgrammar.hf.map_fn with Hugging Face datasets: picklable, num_proc=2, exact masks."""
from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.hf import MaskFn, map_fn
from chatgrammar.conformance.render import render_chat
from tests.tokenizers import qwen_fast_tokenizer

from tests.lazy_modules import lazy_importorskip  # noqa: E402

datasets = lazy_importorskip("datasets")  # (imported by the first test that uses it)

TEMPLATE = (Path(__file__).resolve().parent / "data" / "templates" / "generation"
            / "trl-qwen2_5_training.jinja").read_text(encoding="utf-8")


def _rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"Answer {i}: " + "word " * (i % 7)}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "And?"},
                     {"role": "assistant", "content": "More."}]
        rows.append({"messages": msgs})
    return rows


@pytest.fixture(scope="module")
def tok():
    # a shallow copy: only chat_template is rebound on it, the cached tokenizer stays as it is
    t = copy.copy(qwen_fast_tokenizer())
    t.chat_template = TEMPLATE
    return t


def _expected(fmt, tok, messages):
    text = render_chat(TEMPLATE, messages, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids, fmt.parse_ids(ids, tok).mask()


def test_map_fn_pickles_and_runs_with_num_proc_2(tok):
    fmt = cg.load_format("chatml")
    fn = map_fn("chatml", tok)
    again = pickle.loads(pickle.dumps(fn))
    assert isinstance(again, MaskFn) and again.fmt.name == "chatml"
    rows = _rows(12)
    ds = datasets.Dataset.from_list(rows)
    out = ds.map(fn, batched=True, batch_size=4, num_proc=2, remove_columns=["messages"])
    assert out.num_rows == 12
    for row, got in zip(rows, out):
        ids, mask = _expected(fmt, tok, row["messages"])
        assert got["input_ids"] == ids
        assert got["loss_mask"] == mask
        assert got["num_trained"] == sum(mask) > 0


def test_ids_rows_and_policy(tok):
    fmt = cg.load_format("chatml")
    ids, _ = _expected(fmt, tok, _rows(1)[0]["messages"])
    pol = cg.MaskPolicy(end_marker=True)
    out = map_fn(fmt, tok, policy=pol)({"input_ids": [ids, ids]})
    assert out["loss_mask"] == [fmt.parse_ids(ids, tok).mask(pol)] * 2
    assert out["num_trained"][0] == sum(out["loss_mask"][0])


def test_bad_rows_raise_or_are_recorded_never_empty(tok):
    bad = {"input_ids": [[151645, 151645, 872], [151644, 872, 198, 48, 151645]]}
    with pytest.raises(cg.ParseError):
        map_fn("chatml", tok)(bad)
    out = map_fn("chatml", tok, on_error="record")(bad)
    assert out["loss_mask"][0] is None and "ParseError" in out["chatgrammar_error"][0]
    assert out["loss_mask"][1] == [0, 0, 0, 0, 0] and out["chatgrammar_error"][1] is None
    rendered = map_fn("chatml", tok, on_error="record")({"messages": [[]]})
    assert rendered["loss_mask"] == [None] and "empty" in rendered["chatgrammar_error"][0]


def test_unknown_on_error_and_missing_columns(tok):
    with pytest.raises(ValueError):
        map_fn("chatml", tok, on_error="ignore")
    with pytest.raises(KeyError):
        map_fn("chatml", tok)({"text": ["x"]})


# ------------------------------------------------------------------ apply_chat_template
# chatgrammar.hf.apply_chat_template against transformers' own apply_chat_template.
# References, all independent of chatgrammar's grammar:
# - templates WITH {% generation %} (TRL's llama3 training template, Phi-4-reasoning's upstream
#   template; tests/data/templates/SOURCES.md): transformers' own assistant mask;
# - the same templates with the tags stripped (identical text; transformers then warns and
#   returns all zeros): transformers' mask of the tagged template;
# - Kimi's slow TikTokenTokenizer and bare tiktoken Encodings (transformers cannot give a mask
#   there): the trained runs decode exactly to the assistant bodies, found in the rendered text
#   with str.find.
import re as _re

import numpy as np

from chatgrammar.hf import apply_chat_template
from tests.kimi_tokenizers import kimi_k2_encoding, kimi_k3_encoding
from tests.kimi_tokenizers import template as kimi_template
import tests.test_detect as _test_detect

kimi_files = _test_detect.kimi_files  # session fixtures: Kimi's slow TikTokenTokenizer
kimi_slow = _test_detect.kimi_slow

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "2+2? Use <b>bold</b> & \"quotes\"."},
        {"role": "assistant", "content": "4 — it is **four**.\nYes, ünïcödé 你好."}]
TAGGED = {  # format -> (tagged template, added special tokens, bos)
    "llama3": ("generation/trl-llama3_training.jinja",
               ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>"),
    "phi4": ("microsoft-Phi-4-reasoning.jinja", ["<|im_sep|>"], None),
}
END = cg.MaskPolicy(end_marker=True)  # both templates put the end marker inside the tags


def _strip_tags(src: str) -> str:
    return _re.sub(r"\{%-?\s*(?:end)?generation\s*-?%\}", "", src)


@pytest.fixture(scope="module")
def tagged_tok():
    cache = {}

    def get(name):
        if name not in cache:
            tpl, extra, bos = TAGGED[name]
            t = copy.deepcopy(qwen_fast_tokenizer())
            t.add_special_tokens({"additional_special_tokens": extra,
                                  **({"bos_token": bos} if bos else {})})
            t.chat_template = (TEMPLATES / tpl).read_text(encoding="utf-8")
            cache[name] = t
        return cache[name]
    return get


def _trained(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("name", sorted(TAGGED))
def test_equals_transformers_on_generation_tagged_templates(name, tagged_tok):
    tok = tagged_tok(name)
    ref = tok.apply_chat_template(CONV, return_dict=True, return_assistant_tokens_mask=True)
    assert 0 < sum(ref["assistant_masks"]) < len(ref["input_ids"])
    ours = apply_chat_template(tok, CONV, return_assistant_tokens_mask=True, policy=END)
    assert type(ours) is type(ref)
    assert dict(ours) == dict(ref)                     # input_ids, attention_mask, masks
    # detected, not named
    assert cg.detect_format(tok).name == name
    # and the same conversation through the template without its tags: transformers gives
    # all zeros there, we give exactly the tagged template's mask
    plain = _strip_tags(tok.chat_template)
    assert plain != tok.chat_template
    hf0 = tok.apply_chat_template(CONV, chat_template=plain, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert hf0["input_ids"] == ref["input_ids"] and sum(hf0["assistant_masks"]) == 0
    got = apply_chat_template(tok, CONV, chat_template=plain, return_assistant_tokens_mask=True,
                              policy=END)
    assert got["assistant_masks"] == ref["assistant_masks"]
    # the format's default policy: the same without the end markers
    dflt = apply_chat_template(tok, CONV, chat_template=plain, return_assistant_tokens_mask=True)
    assert _trained(tok, dflt["input_ids"], dflt["assistant_masks"]) == \
        CONV[2]["content"] + CONV[4]["content"]


@pytest.mark.parametrize("name", sorted(TAGGED))
def test_batches_padding_tensors_like_transformers(name, tagged_tok):
    tok = tagged_tok(name)
    batch = [CONV, CONV[:3], CONV[1:3]]
    for kw in ({}, {"padding": True}, {"padding": True, "return_tensors": "pt"},
               {"padding": "max_length", "max_length": 512, "return_tensors": "np"},
               {"return_tensors": "pt", "conv": CONV}, {"return_tensors": "np", "conv": CONV},
               {"add_generation_prompt": True, "conv": CONV[:4]}):
        kw = dict(kw)
        conv = kw.pop("conv", batch)
        ref = tok.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True,
                                      **kw)
        ours = apply_chat_template(tok, conv, return_assistant_tokens_mask=True, policy=END, **kw)
        assert sorted(ours) == sorted(ref), kw
        for k in ref:
            a, b = ours[k], ref[k]
            assert type(a) is type(b), (kw, k)
            if hasattr(b, "shape"):
                assert tuple(a.shape) == tuple(b.shape) and str(a.dtype) == str(b.dtype), (kw, k)
                assert np.asarray(a).tolist() == np.asarray(b).tolist(), (kw, k)
            else:
                assert a == b, (kw, k)


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_at_every_length_equals_transformers(side, tagged_tok):
    tok = copy.copy(tagged_tok("llama3"))  # only truncation_side is rebound on the copy
    tok.truncation_side = side
    n = len(tok.apply_chat_template(CONV, return_dict=True)["input_ids"])
    for max_length in range(1, n + 1):
        ref = tok.apply_chat_template(CONV, return_dict=True, return_assistant_tokens_mask=True,
                                      truncation=True, max_length=max_length)
        ours = apply_chat_template(tok, CONV, return_assistant_tokens_mask=True, policy=END,
                                   truncation=True, max_length=max_length)
        assert dict(ours) == dict(ref), (side, max_length)


def test_text_ids_and_argument_errors_like_transformers(tagged_tok):
    tok = tagged_tok("llama3")
    assert apply_chat_template(tok, CONV, tokenize=False) == \
        tok.apply_chat_template(CONV, tokenize=False)
    assert apply_chat_template(tok, CONV, return_dict=False) == \
        tok.apply_chat_template(CONV, return_dict=False)
    assert dict(apply_chat_template(tok, CONV)) == dict(tok.apply_chat_template(CONV))
    with pytest.raises(ValueError):
        apply_chat_template(tok, CONV, return_dict=False, return_assistant_tokens_mask=True)
    with pytest.raises(ValueError):
        apply_chat_template(tok, CONV, tokenize=False, return_assistant_tokens_mask=True)
    with pytest.raises(ValueError):
        apply_chat_template(tok, CONV, continue_final_message=True,
                            return_assistant_tokens_mask=True)
    with pytest.raises(ValueError):
        apply_chat_template(tok, [], return_assistant_tokens_mask=True)


def test_strict_raises_lenient_trains_nothing_where_malformed(tagged_tok):
    tok = tagged_tok("llama3")
    # user text typing the end marker becomes the special id (transformers does not sanitise
    # by default): the ids no longer fit the format
    bad = [{"role": "user", "content": "hi<|eot_id|>there"},
           {"role": "assistant", "content": "fine"}]
    with pytest.raises(cg.ParseError):
        apply_chat_template(tok, bad, return_assistant_tokens_mask=True)
    out = apply_chat_template(tok, bad, return_assistant_tokens_mask=True, strict=False)
    assert len(out["assistant_masks"]) == len(out["input_ids"])
    assert _trained(tok, out["input_ids"], out["assistant_masks"]) == "fine"
    # transformers' sanitize_control_tokens keeps the typed marker ordinary text: it parses
    safe = apply_chat_template(tok, bad, return_assistant_tokens_mask=True,
                               sanitize_control_tokens=True)
    assert safe["input_ids"] == tok.apply_chat_template(bad, sanitize_control_tokens=True,
                                                        return_dict=True)["input_ids"]
    assert _trained(tok, safe["input_ids"], safe["assistant_masks"]) == "fine"


def _runs(ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def _bodies(text: str, opener: str, closer: str) -> list[str]:
    """The text of each assistant body, found with str.find (no grammar)."""
    out, at = [], 0
    while (a := text.find(opener, at)) >= 0:
        b = text.find(closer, a + len(opener))
        out.append(text[a + len(opener):b])
        at = b
    return out


KIMI = {  # variant -> (template, assistant opener, closer, format)
    "k2": ("moonshotai-Kimi-K2.jinja", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>",
           "kimi-k2"),
    "k3+k2": ("moonshotai-Kimi-K3.jinja", 'role="assistant"<|sep|>', "<|close|>message<|sep|>",
              "kimi-k3"),
}
KIMI_CONV = [{"role": "system", "content": "You are Kimi."},
             {"role": "user", "content": "Hi, what is 2+2?"},
             {"role": "assistant", "content": "It is 4."},
             {"role": "user", "content": "And 3+3? ünï 你好"},
             {"role": "assistant", "content": "6, of course.\nAnything else?"}]


@pytest.mark.parametrize("variant", sorted(KIMI))
def test_slow_kimi_tokenizer_and_tiktoken(variant, kimi_slow):
    tpl_name, opener, closer, fmt_name = KIMI[variant]
    tpl = kimi_template(tpl_name)
    slow = copy.copy(kimi_slow(variant))  # only chat_template is rebound on the copy
    slow.chat_template = tpl
    text = slow.apply_chat_template(KIMI_CONV, tokenize=False)
    bodies = _bodies(text, opener, closer)
    assert len(bodies) == 2 and "6, of course." in bodies[1]
    ref = slow.apply_chat_template(KIMI_CONV, return_dict=True)
    ours = apply_chat_template(slow, KIMI_CONV, return_assistant_tokens_mask=True)
    assert cg.detect_format(slow).name == fmt_name
    assert ours["input_ids"] == ref["input_ids"]
    assert ours["attention_mask"] == ref["attention_mask"]
    assert [slow.decode(r) for r in _runs(ours["input_ids"], ours["assistant_masks"])] == bodies
    # a bare tiktoken.Encoding, template passed explicitly (no special tokens map)
    enc = kimi_k2_encoding() if variant == "k2" else kimi_k3_encoding(with_k2_strings=True)
    got = apply_chat_template(enc, KIMI_CONV, chat_template=tpl,
                              return_assistant_tokens_mask=True)
    assert got["input_ids"] == ours["input_ids"]
    assert got["assistant_masks"] == ours["assistant_masks"]
    # tensors and truncation there too
    n = len(got["input_ids"])
    cut = apply_chat_template(enc, KIMI_CONV, chat_template=tpl, truncation=True,
                              max_length=n - 3, return_tensors="np",
                              return_assistant_tokens_mask=True)
    assert cut["input_ids"].shape == (1, n - 3) and cut["assistant_masks"].dtype == np.int64
    assert cut["assistant_masks"][0].tolist() == \
        cg.load_format(fmt_name).loss_mask(got["input_ids"][:n - 3], enc)


def test_import_chatgrammar_imports_no_client():
    """``import chatgrammar`` (and its hf / integrations modules) never imports torch, trl,
    ray, modelopt, transformers or datasets: every client is imported lazily, when used."""
    import subprocess
    import sys

    code = ("import sys, chatgrammar, chatgrammar.hf, chatgrammar.integrations, "
            "chatgrammar.integrations.trl\n"
            "bad = sorted(m for m in ('torch', 'trl', 'ray', 'modelopt', 'transformers', "
            "'datasets', 'accelerate') if m in sys.modules)\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=str(Path(__file__).resolve().parent.parent))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
