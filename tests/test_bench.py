"""tools/bench.py's helpers: its workload, its tokenizers and every baseline it times agree
with chatgrammar on real renders (a strong correctness check in itself). Behaviour only: no
wall-clock assertion."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import chatgrammar as cg
from tests.kimi_tokenizers import kimi_k2_encoding, kimi_k3_encoding


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "tools" / "bench.py"
    spec = importlib.util.spec_from_file_location("cg_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", params=["kimi-k2", "kimi-k3"])
def data(request, bench):
    v = request.param
    texts, ids = bench.workload(v, 8, seed=3)
    return v, texts, ids


def test_bench_tokenizers_match_the_test_tokenizers(bench):
    for v, ref in (("kimi-k2", kimi_k2_encoding()), ("kimi-k3", kimi_k3_encoding())):
        enc = bench.kimi_encoding(v)
        assert enc._special_tokens == ref._special_tokens
        text = "<|im_user|>user<|im_middle|>12345 héllo<|im_end|><|open|>x<|sep|>"
        assert enc.encode(text, allowed_special="all") == ref.encode(text, allowed_special="all")


def test_workload_shape(bench, data):
    v, texts, ids = data
    assert len(texts) == len(ids) == 8
    enc = bench.kimi_encoding(v)
    for t, x in zip(texts, ids):
        assert enc.decode(x) == t
    fmt = cg.load_format(v)
    # every sample is a clean parse with at least one trained assistant turn
    for t in texts:
        conv = fmt.parse(t)
        assert not conv.warnings and conv.spans()
        assert {"user", "assistant"} <= {turn.role for turn in conv.turns}


def test_scanners_and_numpy_bounds_agree_with_our_masks(bench, data):
    v, texts, ids = data
    enc = bench.kimi_encoding(v)
    fmt = cg.load_format(v)
    for x in ids:
        ours = fmt.loss_mask(x, enc)
        assert sum(ours) > 0
        if v == "kimi-k2":
            assert bench.scan_k2(x) == ours
            assert bench.numpy_k2(x) == ours
        else:
            assert bench.scan_k3(x, enc.decode) == ours
            assert bench.numpy_k3(x, enc.decode) == ours
    assert fmt.loss_masks(ids, enc) == [fmt.loss_mask(x, enc) for x in ids]
    # one long sequence (samples back to back), as the linearity row times it
    big = [t for x in ids for t in x]
    scan = bench.scan_k2(big) if v == "kimi-k2" else bench.scan_k3(big, enc.decode)
    assert fmt.loss_mask(big, enc) == scan


def test_regex_baseline_extracts_the_trained_text(bench, data):
    v, texts, _ = data
    fmt = cg.load_format(v)
    for t in texts:
        merged: list = []
        for s in fmt.parse(t).spans():
            if merged and merged[-1][1] == s.start:
                merged[-1] = (merged[-1][0], s.end)
            else:
                merged.append((s.start, s.end))
        assert bench.regex_spans(v, t) == merged


def test_chatml_text_workload_parses_and_its_regex_finds_each_reply(bench):
    # the text table's ChatML row: TRL Qwen2.5 renders, each a clean strict parse; the
    # regex baseline finds one body per assistant turn, inside that turn
    fmt = cg.load_format("chatml")
    texts = bench.text_workload("chatml", 6, "test")
    assert texts == bench.text_workload("chatml", 6, "test")  # (a seed gives one draw)
    for t in texts:
        conv = fmt.parse(t)
        assert not conv.warnings and conv.spans()
        found = bench.regex_spans("chatml", t)
        turns = [u for u in conv.turns if u.role == "assistant"]
        assert len(found) == len(turns)
        assert all(u.start <= a <= b <= u.end for (a, b), u in zip(found, turns))


def test_scanner_semantics_on_hand_made_inputs(bench):
    A, M, E, U = 163588, 163601, 163586, 163587
    assert bench.scan_k2([U, 1, M, 2, E, A, 3, M, 4, 5, E]) == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0]
    assert bench.scan_k2([A, 3, M, 4, 5]) == [0, 0, 0, 1, 1]  # truncated: trains what is there
    enc = bench.kimi_encoding("kimi-k3")
    ids = enc.encode('<|open|>message role="user" name="assistant"<|sep|>hi<|close|>message'
                     '<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>'
                     'response<|sep|>yo<|close|>response<|sep|><|close|>message<|sep|>'
                     '<|end_of_msg|>', allowed_special="all")
    got = bench.scan_k3(ids, enc.decode)
    assert got == cg.load_format("kimi-k3").loss_mask(ids, enc)
    assert enc.decode([t for t, m in zip(ids, got) if m]) == \
        "<|open|>response<|sep|>yo<|close|>response<|sep|>"


def test_report_renders_every_section(bench):
    def row(x):
        return {"ratio": x, "ratios": [x, x + 1], "rate": 10 * x, "ns": 10.0 / x}

    res = {c: row(3.0) for c in bench.CLASSES}
    res["1M cut"] = row(2.5)
    res["text"] = {**row(1.5), "regex_rate": 7.0}
    res.update(_slow={"new item shape": 3}, _fast=100, _samples=10, _rounds=2,
               _accelerated=True)
    results = {"kimi-k2": res, "kimi-k3": res, "chatml": None,
               "chatml text": {**row(0.5), "regex_rate": 9.0},
               "compile": {"formats": 12, "cold_s": 0.6, "cached_s": 0.02, "import_s": 0.4}}

    class Args:
        rounds = 2

    text = bench.report(results, {"cpu": "test", "cores": "2"}, Args)
    for needle in ("## Machine", "- cpu: test", "first pass over fresh data",
                   "| whole samples | 3.00× | 3.00× | 30.0 | 30.0 | 3.00 4.00 | 3.00 4.00 |",
                   "| one ~1M-token sequence cut mid-turn | 2.50× |",
                   "| kimi-k2 | 3.3 | 4.0 | 1.20 |", "new item shape: 3", "## Text mode",
                   "| kimi-k3 | 15.0 | 7.0 | 1.50 |", "| chatml (TRL Qwen2.5 renders) | 5.0 | 9.0 | 0.50 |", "Skipped: the `chatml` format",
                   "## Compile", "| 12 | 0.600 | 0.0200 | 0.400 |", "## Targets"):
        assert needle in text, needle
    met = {label: ok for label, _, ok in bench.targets(results)}
    assert met["kimi-k2: whole samples ≥ 3× the scanner"]
    assert not met["kimi-k2: whole samples, numpy in (numpy out) ≥ 5× the scanner"]
    assert met["kimi-k2: 1M-token sequence per token ≤ 1.2× a sample's"] is True


@pytest.mark.parametrize("version", ["kimi-k2", "kimi-k3"])
def test_class_inputs_cover_every_class(bench, version):
    _texts, ids = bench.workload(version, 16, seed=4)
    fmt = cg.load_format(version)
    enc = bench.kimi_encoding(version)
    for cls in bench.CLASSES:
        xs, kw = bench.class_inputs(version, ids, cls)
        assert xs and cls in bench.CLASS_LABEL
        for x in xs:  # ours equals the reference on every class
            got = fmt.loss_mask(x, enc, **kw)
            got = got if type(got) is list else got.tolist()
            assert got == fmt.parse_ids(x, enc, strict=kw.get("strict", True)).mask(
                kw.get("policy"))
    trunc = bench.class_inputs(version, ids, "truncated")[0]
    assert all(len(x) <= bench.MAX_LENGTH for x in trunc)
    assert sum(len(x) for x in bench.class_inputs(version, ids, "packed")[0]) == \
        sum(map(len, ids))
    (cut,), _ = bench.class_inputs(version, ids, "1M cut")
    mask = bench._scanner_for(version, "whole")(cut)
    assert mask[-1] == 1  # cut inside trained assistant content
    assert bench.last_span_only([0, 1, 1, 0, 1, 0]) == [0, 0, 0, 0, 1, 0]
