"""The runnable integrations in tools/examples work end to end."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from tests.kimi_tokenizers import kimi_k2_encoding, kimi_k3_encoding

EXAMPLES = Path(__file__).resolve().parent.parent / "tools" / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_k3_dataprep_writes_masks_and_trains_only_assistant_output(tmp_path):
    prep = _load("k3_drafter_dataprep")
    out = tmp_path / "masks.jsonl"
    assert prep.main(["--out", str(out)]) == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    src = [json.loads(l) for l in (EXAMPLES / "data" / "k3_conversations.jsonl").read_text().splitlines()]
    assert len(rows) == len(src)
    enc = kimi_k3_encoding(True)
    for row, sample in zip(rows, src):
        assert len(row["input_ids"]) == len(row["loss_mask"]) and row["num_trained"] > 0
        trained = enc.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m])
        for m in sample["messages"]:
            if m["role"] == "assistant" and m["content"]:
                assert m["content"] in trained
            elif m["role"] == "user":
                assert m["content"] not in trained
    # the user who typed "<|close|>message<|sep|>" did not break anything (id mode)
    assert rows[-1]["num_trained"] > 0


def test_modelopt_adapter_precedence_and_types():
    mo = _load("modelopt_adapter")
    rec = mo.ChatGrammarRecovery()
    k3 = kimi_k3_encoding(True)  # carries K2's strings too: must still be K3
    assert rec.detect(k3) and rec._format_for(k3).name == "kimi-k3"
    k2 = kimi_k2_encoding()
    assert rec.detect(k2) and rec._format_for(k2).name == "kimi-k2"
    ids = (k2.encode("<|im_user|>user<|im_middle|>q<|im_end|><|im_assistant|>assistant"
                     "<|im_middle|>", allowed_special="all") + k2.encode("the answer")
           + k2.encode("<|im_end|>", allowed_special="all"))
    mask = rec.compute(k2, ids)
    assert isinstance(mask, list) and k2.decode([i for i, m in zip(ids, mask) if m]) == "the answer"
    assert rec.compute(k2, np.asarray(ids)).tolist() == mask
    # every Kimi recovery agrees whatever the list order
    for r in mo.kimi_recoveries()[::-1]:
        if r.format in (None, "kimi-k2"):
            assert r.compute(k2, ids) == mask
