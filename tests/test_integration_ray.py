"""The Ray Data recipe of docs/scale.md, run for real: ``map_fn`` inside ``map_batches``.

A local Ray runtime (2 CPUs, no dashboard), a small in-memory dataset, the recipe's function
verbatim; every mask equals the one ``fmt.parse_ids(ids, tok).mask()`` gives in this process.
Ray is started once for the module and shut down after it.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.hf import map_fn
from tests.tokenizers import qwen_fast_tokenizer

from tests.lazy_modules import lazy_importorskip  # noqa: E402

# imported when the module's first test starts Ray, not while every worker collects the suite
ray = lazy_importorskip("ray")
ray_data = lazy_importorskip("ray.data")

TEMPLATE = (Path(__file__).resolve().parent / "data" / "templates"
            / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, ignore_reinit_error=True)
    ctx = ray_data.DataContext.get_current()
    ctx.enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tok():
    # a shallow copy: only chat_template is rebound on it, the cached tokenizer stays as it is
    t = copy.copy(qwen_fast_tokenizer())
    t.chat_template = TEMPLATE
    return t


def _messages(i: int) -> list[dict]:
    msgs = [{"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}: " + "word " * (i % 5)}]
    if i % 2:
        msgs += [{"role": "user", "content": "And?"}, {"role": "assistant", "content": "More."}]
    return msgs


def test_map_batches_recipe_gives_exact_masks(ray_local, tok):
    fmt = cg.load_format("chatml")
    rows = [tok.apply_chat_template(_messages(i), return_dict=True)["input_ids"]
            for i in range(24)]
    rows.append([151645, 151645, 872])  # malformed: recorded, never an empty mask

    # --- the recipe (docs/scale.md, "Ray Data") ---
    fn = map_fn("chatml", tok, on_error="record")   # shipped to the workers by pickling

    def add_masks(batch: dict) -> dict:
        out = fn({k: list(v) for k, v in batch.items()})
        return {"input_ids": out["input_ids"], "loss_mask": out["loss_mask"],
                "num_trained": out["num_trained"], "chatgrammar_error": out["chatgrammar_error"]}

    ds = (ray_data.from_items([{"row": i, "input_ids": ids} for i, ids in enumerate(rows)])
          .map_batches(add_masks, batch_size=8, batch_format="numpy", concurrency=1))
    # --- end of recipe ---
    got = ds.take_all()
    assert len(got) == len(rows)
    by_ids = {}
    for r in got:
        if r["chatgrammar_error"] is None:
            by_ids[tuple(int(x) for x in r["input_ids"])] = r
        else:
            assert "ParseError" in r["chatgrammar_error"] and r["loss_mask"] is None
    assert len(by_ids) == len(rows) - 1
    for ids in rows[:-1]:
        r = by_ids[tuple(ids)]
        want = fmt.parse_ids(ids, tok).mask()
        assert [int(x) for x in r["loss_mask"]] == want
        assert int(r["num_trained"]) == sum(want) > 0


def test_map_batches_from_messages(ray_local, tok):
    """Rows carrying messages: numpy batches hold them as object arrays of dicts; the same
    recipe function renders them with the tokenizer's chat template."""
    fmt = cg.load_format("chatml")
    fn = map_fn(fmt, tok)

    def add_masks(batch: dict) -> dict:
        out = fn({k: list(v) for k, v in batch.items()})
        return {"input_ids": out["input_ids"], "loss_mask": out["loss_mask"]}

    items = [{"messages": _messages(i)} for i in range(10)]
    got = (ray_data.from_items(items)
           .map_batches(add_masks, batch_size=4, batch_format="numpy", concurrency=1)
           .take_all())
    want = {}
    for it in items:
        ids = tok.apply_chat_template(it["messages"], return_dict=True)["input_ids"]
        want[tuple(ids)] = fmt.parse_ids(ids, tok).mask()
    assert len(got) == len(items)
    for r in got:
        assert [int(x) for x in r["loss_mask"]] == want[tuple(int(x) for x in r["input_ids"])]
