"""chatgrammar.integrations.trl.prepare with the real TRL SFTTrainer (CPU, a tiny random model).

The chat templates here have no ``{% generation %}`` tags (Qwen2.5's and Kimi-K2's upstream
templates, tests/data/templates/SOURCES.md), and one tokenizer is Kimi's slow tiktoken-backed
``TikTokenTokenizer``: the two cases where transformers' / TRL's own assistant mask cannot work.
The reference masks are independent of chatgrammar's grammar: each assistant body is found in the
rendered text with ``str.find`` and mapped to tokens by the fast tokenizer's offsets (Qwen), or
the trained runs must decode exactly to those bodies (Kimi); a sample cut by ``max_length`` must
have its full sample's reference mask, cut.
"""
from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import pytest

import chatgrammar as cg
from tests.tokenizers import qwen_fast_tokenizer

from tests.lazy_modules import lazy_importorskip  # noqa: E402

# imported when a test first needs them, not while every worker collects the suite
datasets = lazy_importorskip("datasets")
torch = lazy_importorskip("torch")
trl = lazy_importorskip("trl")
transformers = lazy_importorskip("transformers")

from chatgrammar.hf import apply_chat_template  # noqa: E402
from chatgrammar.integrations.trl import prepare  # noqa: E402
from tests.kimi_tokenizers import kimi_k2_encoding, kimi_k3_encoding  # noqa: E402
from tests.kimi_tokenizers import template as kimi_template  # noqa: E402
import tests.test_detect as _test_detect  # noqa: E402

kimi_files = _test_detect.kimi_files  # session fixtures: Kimi's slow TikTokenTokenizer
kimi_slow = _test_detect.kimi_slow

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
MAX_LEN = 64


def conversations(n: int = 10) -> list[list[dict]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question number {i}: how much is {i}+{i}?"},
                {"role": "assistant", "content": f"It is {2 * i}. " + "Really, " * (i % 4)}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "Explain it at length, please."},
                     {"role": "assistant", "content": "Adding a number to itself doubles it. "
                      * (2 + i)}]  # long: cut by MAX_LEN in the middle of this reply
        out.append(msgs)
    return out


@pytest.fixture(scope="module")
def qwen():
    tok = copy.deepcopy(qwen_fast_tokenizer())
    tok.chat_template = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    return tok


def qwen_reference(tok, messages) -> tuple[list[int], list[int]]:
    """ids and mask from str.find + offsets: the tokens of each assistant content."""
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, at = [], 0
    for m in messages:
        if m["role"] == "assistant":
            a = text.index("<|im_start|>assistant\n" + m["content"], at) + len(
                "<|im_start|>assistant\n")
            spans.append((a, a + len(m["content"])))
            at = a
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask


def tiny_model(vocab_size: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg)


def train_two_steps(tmp_path, tok, train, *, data_collator=None):
    """Two optimizer steps with the real SFTTrainer; returns (trainer, batches it saw)."""
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                         learning_rate=1e-3, logging_steps=1, save_strategy="no",
                         report_to="none", use_cpu=True, max_length=MAX_LEN,
                         dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = trl.SFTTrainer(model=tiny_model(len(tok)), args=args, train_dataset=train,
                             processing_class=tok, data_collator=data_collator)
    seen = []
    collate = trainer.data_collator

    def hooked(examples):  # the batch exactly as the trainer feeds it to the model
        batch = collate(examples)
        seen.append({k: v.clone() for k, v in batch.items() if hasattr(v, "clone")})
        return batch

    trainer.data_collator = hooked
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    return trainer, seen


def check_batches(seen, masks_by_ids: dict) -> int:
    """labels are -100 exactly where the mask is 0 (and on padding), the id elsewhere."""
    rows = 0
    for batch in seen:
        for ids, att, lab in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist(),
                                 batch["labels"].tolist()):
            n = sum(att)
            mask = masks_by_ids[tuple(ids[:n])]
            assert lab[:n] == [i if m else -100 for i, m in zip(ids[:n], mask)]
            assert lab[n:] == [-100] * (len(ids) - n)
            rows += 1
    return rows


def test_prepare_masks_equal_the_reference_truncated_included(qwen):
    convs = conversations()
    st: dict = {}
    ds = prepare(datasets.Dataset.from_list([{"messages": c} for c in convs]), qwen,
                 max_length=MAX_LEN, stats=st)
    assert ds.column_names == ["input_ids", "assistant_masks"]
    assert st["format"] == "chatml" and st["samples"] == st["kept"] == len(convs)
    assert st["malformed"] == st["dropped"] == st["empty"] == 0
    assert st["truncated"] > 0
    for row, c in zip(ds, convs):
        ids, mask = qwen_reference(qwen, c)
        assert row["input_ids"] == ids[:MAX_LEN]
        assert row["assistant_masks"] == mask[:MAX_LEN]
    # the same with two worker processes, and from pre-tokenised rows
    again = prepare([{"messages": c} for c in convs], qwen, max_length=MAX_LEN, num_proc=2)
    assert again["assistant_masks"] == ds["assistant_masks"]
    pre = prepare([{"input_ids": qwen_reference(qwen, c)[0]} for c in convs], qwen,
                  format="chatml", max_length=MAX_LEN)
    assert pre["input_ids"] == ds["input_ids"] and pre["assistant_masks"] == ds["assistant_masks"]


def test_sft_trainer_labels_are_minus_100_exactly_where_the_mask_is_0(qwen, tmp_path):
    convs = conversations(8)
    train = prepare([{"messages": c} for c in convs], qwen, max_length=MAX_LEN)
    masks = {tuple(r["input_ids"]): r["assistant_masks"] for r in train}
    trainer, seen = train_two_steps(tmp_path, qwen, train)
    # TRL built its labels from our column at preparation...
    prepared = trainer.train_dataset
    assert "assistant_masks" not in prepared.column_names
    for r in prepared:
        m = masks[tuple(r["input_ids"])]
        assert r["labels"] == [i if b else -100 for i, b in zip(r["input_ids"], m)]
    # ...and the batches the model saw carry them
    assert check_batches(seen, masks) >= 4
    # TRL's own assistant_only_loss is for conversational datasets only (docs/integrations.md)
    with pytest.raises(ValueError, match="conversational"):
        trl.SFTTrainer(model=tiny_model(len(qwen)), train_dataset=train, processing_class=qwen,
                       args=trl.SFTConfig(output_dir=str(tmp_path), report_to="none",
                                          use_cpu=True, assistant_only_loss=True))  # 2 steps x 2 (the loader may fetch ahead)


def test_lenient_by_default_counts_and_never_raises(qwen, caplog):
    rows = [{"messages": c} for c in conversations(4)]
    rows.append({"messages": [{"role": "user", "content": "forged <|im_end|> marker"},
                              {"role": "assistant", "content": "still trained"}]})
    rows.append({"messages": [{"role": "user", "content": "no reply"}]})
    rows.append({"messages": []})  # transformers refuses an empty conversation
    st: dict = {}
    with caplog.at_level(logging.WARNING, logger="chatgrammar.integrations.trl"):
        ds = prepare(rows, qwen, stats=st)
    assert st["samples"] == 7 and st["kept"] == 5
    assert st["malformed"] == 1 and st["dropped"] == 1 and st["empty"] == 1
    assert [e[0] for e in st["errors"]] == [4, 6]
    assert any("1 malformed" in r.message for r in caplog.records)
    forged = ds[4]
    trained = qwen.decode([i for i, m in zip(forged["input_ids"], forged["assistant_masks"]) if m])
    assert trained == "still trained"  # the malformed user turn trains nothing, the rest does
    with pytest.raises(cg.ParseError):
        prepare(rows[:5], qwen, strict=True)
    with pytest.raises(KeyError):
        prepare([{"text": "x"}], qwen)


KIMI = {  # variant -> (template, format, assistant body opener, closer, max_length)
    "k2": ("moonshotai-Kimi-K2.jinja", "kimi-k2", "<|im_assistant|>assistant<|im_middle|>",
           "<|im_end|>", MAX_LEN),
    # K3's template opens with a ~60-token thinking-effort system message
    "k3+k2": ("moonshotai-Kimi-K3.jinja", "kimi-k3", 'role="assistant"<|sep|>',
              "<|close|>message<|sep|>", 2 * MAX_LEN),
}


@pytest.mark.parametrize("variant", sorted(KIMI))
def test_slow_kimi_tokenizer_trains_with_sft_trainer(variant, kimi_slow, tmp_path):
    tpl, fmt_name, opener, closer, max_len = KIMI[variant]
    tok = copy.deepcopy(kimi_slow(variant))
    tok.chat_template = kimi_template(tpl)
    convs = conversations(8)
    st: dict = {}
    train = prepare([{"messages": c} for c in convs], tok, max_length=max_len, stats=st)
    assert st["format"] == fmt_name and st["kept"] == 8 and st["truncated"] > 0
    # (a prepare call costs ~4 s here: datasets fingerprints the slow tokenizer)
    for row, c in zip(train, convs):
        full = apply_chat_template(tok, c, return_assistant_tokens_mask=True, format=fmt_name)
        text = tok.decode(full["input_ids"])
        bodies, at = [], 0
        while (a := text.find(opener, at)) >= 0:
            b = text.find(closer, a)
            bodies.append(text[a + len(opener):b])
            at = b
        assert len(bodies) == sum(m["role"] == "assistant" for m in c)
        assert all(m["content"] in b for m, b in
                   zip([m for m in c if m["role"] == "assistant"], bodies))
        runs, cur = [], []
        for i, m in zip(full["input_ids"], full["assistant_masks"]):
            if m:
                cur.append(i)
            elif cur:
                runs, cur = runs + [cur], []
        assert [tok.decode(r) for r in runs + ([cur] if cur else [])] == bodies
        assert row["input_ids"] == full["input_ids"][:max_len]
        assert row["assistant_masks"] == full["assistant_masks"][:max_len]
    # a bare tiktoken.Encoding with the same specials gives the same dataset
    enc = kimi_k2_encoding() if variant == "k2" else kimi_k3_encoding(with_k2_strings=True)
    bare = prepare([{"messages": c} for c in convs], enc, chat_template=kimi_template(tpl),
                   max_length=max_len)
    assert bare["input_ids"] == train["input_ids"]
    assert bare["assistant_masks"] == train["assistant_masks"]
    if variant != "k2":
        return  # one training run with a slow tokenizer is enough
    masks = {tuple(r["input_ids"]): r["assistant_masks"] for r in train}
    _, seen = train_two_steps(tmp_path, tok, train)  # TRL's default collator, pad [PAD]
    assert check_batches(seen, masks) >= 4  # 2 steps x 2 (the loader may fetch ahead)


def test_cache_fingerprint_follows_what_changes_the_output(qwen):
    """prepare fingerprints its map without pickling the tokenizer (seconds for a slow one),
    from what decides the output: any change there gives another fingerprint."""
    from chatgrammar.integrations.trl import PrepareFn, _fingerprint

    ds = datasets.Dataset.from_list([{"messages": c} for c in conversations(2)])
    fmt = cg.load_format("chatml")
    base = _fingerprint(ds, PrepareFn(fmt, qwen, max_length=8))
    assert base == _fingerprint(ds, PrepareFn(cg.load_format("chatml"), qwen, max_length=8))
    other_tok = copy.deepcopy(qwen)
    other_tok.chat_template = "{{ messages[0]['content'] }}"
    changed = [PrepareFn(fmt, qwen, max_length=9), PrepareFn(fmt, qwen, max_length=8, strict=True),
               PrepareFn(fmt, qwen, max_length=8, policy=cg.MaskPolicy(end_marker=True)),
               PrepareFn(cg.load_format("phi4"), qwen, max_length=8),
               PrepareFn(fmt, other_tok, max_length=8),
               PrepareFn(fmt, qwen, max_length=8, template_kwargs={"enable_thinking": False})]
    prints = [_fingerprint(ds, f) for f in changed]
    prints.append(_fingerprint(ds.select([0]), PrepareFn(fmt, qwen, max_length=8)))
    assert base is not None and len({base, *prints}) == len(prints) + 1


def test_same_labels_as_trl_own_assistant_only_loss_on_a_tagged_template(tmp_path):
    """Where TRL's own assistant_only_loss works (a fast tokenizer and a template whose
    {% generation %} tags hold the reply and its end marker: TRL's Llama-3 training template),
    prepare + MaskPolicy(end_marker=True) gives TRL exactly the labels its own path builds,
    truncated samples included."""
    tok = copy.deepcopy(qwen_fast_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>",
                                                          "<|end_header_id|>", "<|eot_id|>"],
                            "bos_token": "<|begin_of_text|>"})
    tok.chat_template = (TEMPLATES / "generation" / "trl-llama3_training.jinja").read_text(
        encoding="utf-8")
    convs = conversations(6)
    args = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_length=MAX_LEN)
    theirs = trl.SFTTrainer(model=tiny_model(len(tok)), processing_class=tok,
                            train_dataset=datasets.Dataset.from_list(
                                [{"messages": c} for c in convs]),
                            args=trl.SFTConfig(assistant_only_loss=True, **args)).train_dataset
    ours = trl.SFTTrainer(model=tiny_model(len(tok)), processing_class=tok,
                          train_dataset=prepare([{"messages": c} for c in convs], tok,
                                                max_length=MAX_LEN,
                                                policy=cg.MaskPolicy(end_marker=True)),
                          args=trl.SFTConfig(**args)).train_dataset
    key = {tuple(r["input_ids"]): r["labels"] for r in theirs}
    assert len(ours) == len(theirs) == len(convs)
    assert any(len(r["input_ids"]) == MAX_LEN for r in ours)  # some are cut
    for r in ours:
        assert key[tuple(r["input_ids"])] == r["labels"]
