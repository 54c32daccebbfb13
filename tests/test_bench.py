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
    row = {"samples": 2, "tokens": 8000, "chars": 30000, "big_tokens": 1_000_000, "ours": 40.0,
           "ours_batch": 50.0, "ours_numpy": 70.0, "scanner": 20.0, "numpy": 60.0, "ours_1m": 35.0,
           "ours_pure": 30.0, "accelerated": True, "text_ours": 100.0, "text_regex": 120.0}
    results = {"kimi-k2": row, "kimi-k3": row, "chatml": None,
               "compile": {"formats": 12, "cold_s": 0.6, "cached_s": 0.02, "import_s": 0.4}}

    class Args:
        rounds = 5

    text = bench.report(results, {"cpu": "test", "cores": "2"}, Args)
    for needle in ("## Machine", "- cpu: test", "| kimi-k2 | 2 | 4000 | 40.0 | 50.0 | 20.0 | "
                   "60.0 | 2.00 | 2.50 | 1.50 |", "| kimi-k2 | 70.0 | 3.50 |",
                   "| kimi-k3 | 30.0 | 1.50 |", "## Linear cost", "| kimi-k3 | 1000000 | 35.0 | 1.14 |",
                   "## Text mode", "0.83", "Skipped: the `chatml` format", "## Compile",
                   "| 12 | 0.600 | 0.0200 | 0.400 |"):
        assert needle in text, needle
