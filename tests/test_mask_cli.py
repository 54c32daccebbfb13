"""``chatgrammar mask`` end to end: JSONL and Parquet, a tokenizer directory saved offline,
``-j 2``, the rejects file, the summary and exit codes."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.cli import main
from chatgrammar.conformance.render import render_chat
from tests.tokenizers import qwen_fast_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TEMPLATE = (Path(__file__).resolve().parent / "data" / "templates" / "generation"
            / "trl-qwen2_5_training.jinja").read_text(encoding="utf-8")
SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    # a shallow copy: only chat_template is rebound on it, the cached tokenizer stays as it is
    t = copy.copy(qwen_fast_tokenizer())
    t.chat_template = TEMPLATE
    t.save_pretrained(str(d))
    return d


def _conv(i: int) -> list[dict]:
    msgs = [{"role": "system", "content": "Be brief."}] if i % 4 == 0 else []
    msgs += [{"role": "user", "content": f"What is {i} + {i}?"},
             {"role": "assistant", "content": f"It is {2 * i}."}]
    if i % 3 == 0:
        msgs += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
    return msgs


def _expected(messages):
    tok = qwen_fast_tokenizer()
    ids = tok(render_chat(TEMPLATE, messages, **SPECIALS), add_special_tokens=False)["input_ids"]
    return ids, cg.load_format("chatml").parse_ids(ids, tok).mask()


def _read(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_messages_and_ids_with_rejects_and_summary(tmp_path, tok_dir, capsys):
    rows = [{"messages": _conv(i)} for i in range(9)]
    good_ids, good_mask = _expected(_conv(100))
    rows.append({"input_ids": good_ids})                       # row 9: ids as given
    rows.append({"input_ids": [151645, 151645, 872]})          # row 10: does not parse
    rows.append({"messages": []})                              # row 11: template rejects it
    rows.append({"neither": True})                             # row 12
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    out = tmp_path / "out.jsonl"
    summary = tmp_path / "summary.json"
    rc = main(["mask", "-f", "chatml", "--tokenizer", str(tok_dir), str(src), str(out),
               "--summary", str(summary), "--chunk-size", "4"])
    assert rc == 1  # some rows were rejected
    got = _read(out)
    assert [r["row"] for r in got] == list(range(10))
    for r in got[:9]:
        ids, mask = _expected(rows[r["row"]]["messages"])
        assert r["input_ids"] == ids and r["loss_mask"] == mask
        assert r["num_trained"] == sum(mask) > 0
    assert got[9]["input_ids"] == good_ids and got[9]["loss_mask"] == good_mask
    rejects = _read(Path(str(out) + ".rejects.jsonl"))
    assert [(r["row"], r["stage"]) for r in rejects] == [
        (10, "parse"), (11, "input"), (12, "input"), (13, "input")]
    assert "ParseError" in rejects[0]["error"] and "im_end" in rejects[0]["error"]
    s = json.loads(summary.read_text())
    assert (s["samples"], s["written"], s["rejected"]) == (14, 10, 4)
    assert s["tokens"] == sum(len(r["input_ids"]) for r in got)
    assert s["trained_tokens"] == sum(r["num_trained"] for r in got)
    assert 0 < s["trained_fraction"] < 1
    assert s["roles"]["assistant"] == sum(len([m for m in rows[i]["messages"]
                                               if m["role"] == "assistant"]) for i in range(9)) + 1
    err = capsys.readouterr().err
    assert "rejected" in err and "turns per role" in err


def test_parquet_in_and_out_with_two_workers_and_auto_format(tmp_path, tok_dir):
    rows = [{"messages": _conv(i)} for i in range(10)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out.parquet"
    rc = main(["mask", "--tokenizer", str(tok_dir), str(src), str(out), "-j", "2",
               "--chunk-size", "3", "--end-marker"])
    assert rc == 0
    assert not Path(str(out) + ".rejects.jsonl").exists()
    got = _read(out)
    assert [r["row"] for r in got] == list(range(10))
    pol = cg.MaskPolicy(end_marker=True)
    tok = qwen_fast_tokenizer()
    for r in got:
        ids, _ = _expected(rows[r["row"]]["messages"])
        assert r["input_ids"] == ids
        assert r["loss_mask"] == cg.load_format("chatml").parse_ids(ids, tok).mask(pol)


def test_usage_errors_exit_2(tmp_path, tok_dir):
    src = tmp_path / "in.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n')
    assert main(["mask", "-f", "chatml", "--tokenizer", str(tok_dir), str(src),
                 str(tmp_path / "out.csv")]) == 2
    assert main(["mask", "-f", "chatml", "--tokenizer", str(tmp_path / "nope"), str(src),
                 str(tmp_path / "out.jsonl")]) == 2
    assert main(["mask", "-f", "no-such-format", "--tokenizer", str(tok_dir), str(src),
                 str(tmp_path / "out.jsonl")]) == 2
    assert main(["mask", "-f", "chatml", "--tokenizer", str(tok_dir),
                 str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl")]) == 2


@pytest.mark.parametrize("out_ext", [".parquet", ".jsonl"])
def test_parquet_token_ids_stay_columnar_and_reject_bad_rows(tmp_path, tok_dir, out_ext):
    good = [_expected(_conv(i)) for i in range(7)]
    ids = [g[0] for g in good]
    ids.insert(3, [151645, 151645, 872])           # row 3 does not parse
    src = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))}), src)
    out = tmp_path / f"out{out_ext}"
    rc = main(["mask", "-f", "chatml", "--tokenizer", str(tok_dir), str(src), str(out),
               "--chunk-size", "4"])
    assert rc == 1
    got = _read(out)
    assert [r["row"] for r in got] == [0, 1, 2, 4, 5, 6, 7]
    for r, (want_ids, want_mask) in zip(got, good):
        assert r["input_ids"] == want_ids and r["loss_mask"] == want_mask
        assert r["num_trained"] == sum(want_mask)
    rejects = _read(Path(str(out) + ".rejects.jsonl"))
    assert [(r["row"], r["stage"]) for r in rejects] == [(3, "parse")]
