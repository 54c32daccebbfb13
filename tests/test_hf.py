"""chatgrammar.hf.map_fn with Hugging Face datasets: picklable, num_proc=2, exact masks."""
from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.hf import MaskFn, map_fn
from chatgrammar.render import render_chat
from tests.tokenizers import qwen_fast_tokenizer

datasets = pytest.importorskip("datasets")

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
    t = copy.deepcopy(qwen_fast_tokenizer())
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
