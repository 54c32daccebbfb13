"""The runnable integrations in tools/examples work end to end."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tests.kimi_tokenizers import kimi_k3_encoding

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


def test_k3_dataprep_runs_without_model_optimizer(tmp_path):
    """README quick start command 1 runs the example after `pip install '.[tiktoken]'`: no
    torch, no Model-Optimizer. With their import blocked it takes the direct chatgrammar path."""
    import subprocess

    out = tmp_path / "masks.jsonl"
    code = ("import sys, runpy\n"
            "for m in ('torch', 'modelopt', 'transformers'): sys.modules[m] = None\n"
            f"sys.argv = ['k3_drafter_dataprep.py', '--out', {str(out)!r}]\n"
            f"runpy.run_path({str(EXAMPLES / 'k3_drafter_dataprep.py')!r}, run_name='__main__')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "masks:  chatgrammar (fmt.loss_mask)" in res.stdout
    assert out.read_text().count("\n") == 5


def test_k3_dataprep_through_model_optimizer_gives_the_same_masks(tmp_path, capsys):
    """With nvidia-modelopt installed the example goes through Model-Optimizer's own registry
    after install(); the masks are exactly chatgrammar's."""
    import pytest

    pytest.importorskip("modelopt.torch.utils.loss_mask")
    from chatgrammar.integrations import modelopt as cg_modelopt

    prep = _load("k3_drafter_dataprep")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    try:
        assert prep.main(["--out", str(a), "--mask-with", "modelopt"]) == 0
        assert "Model-Optimizer's loss-mask registry (chatgrammar:kimi-k3)" in \
            capsys.readouterr().out
    finally:
        cg_modelopt.uninstall()
    assert prep.main(["--out", str(b), "--mask-with", "chatgrammar"]) == 0
    assert a.read_text() == b.read_text()
