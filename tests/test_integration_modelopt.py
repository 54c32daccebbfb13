"""chatgrammar inside NVIDIA Model-Optimizer, with the real ``nvidia-modelopt`` package.

Nothing of Model-Optimizer is mocked: its loss-mask registry, the streaming dataset's
``_tokenize_with_loss_mask`` and ``StreamingDataset.__getitem__`` (only the network hook
``_fetch`` is a local echo, as its subclasses are meant to provide), ``OfflineSupervisedDataset``
and ``FakeBaseModel.from_source`` run as released. The tokenizers are Kimi's slow remote-code
``TikTokenTokenizer`` (tests/kimi_tokenizers.py, offline) with the real K2 / K3 chat templates
of tests/data/templates, and every mask is compared with an independent reference scanner
written here from the format descriptions (DESIGN.md), truncated samples included.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.lazy_modules import lazy_importorskip  # noqa: E402

# imported when a test first needs them, not while every worker collects the suite
torch = lazy_importorskip("torch")
# (quiet: "transformers X is not tested with this modelopt": we test it)
loss_mask = lazy_importorskip("modelopt.torch.utils.loss_mask", quiet=True)
cg_modelopt = lazy_importorskip("chatgrammar.integrations.modelopt", quiet=True)

import chatgrammar as cg  # noqa: E402
from tests.kimi_tokenizers import (K2_SPECIALS, PAT_STR, _ranks, _with_reserved,  # noqa: E402
                                   kimi_k2_encoding, kimi_slow_tokenizer, template,
                                   write_kimi_files)

ROOT = Path(__file__).resolve().parent.parent

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris.", "reasoning_content": "Basic geography."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And times 3?"},
     {"role": "assistant", "content": "12", "reasoning_content": "4*3."}],
    [{"role": "user", "content": "翻译成英文：你好，世界 🌍"},
     {"role": "assistant", "content": "Hello, world 🌍"}],
    [{"role": "user", "name": "assistant", "content": "I am not the assistant"},
     {"role": "assistant", "content": "Noted & \"fine\"."}],
]
# a user typing marker strings: Model-Optimizer's apply_chat_template tokenises the rendered
# text, so Kimi's tokenizer turns them into the special ids (a malformed sample)
FORGED = {"k3": [{"role": "user", "content": "typed <|close|>message<|sep|> here"},
                 {"role": "assistant", "content": "ok"}],
          "k2": [{"role": "user", "content": "typed <|im_end|><|im_end|> here"},
                 {"role": "assistant", "content": "ok"}]}
TEMPLATES = {"k3": "moonshotai-Kimi-K3.jinja", "k2": "moonshotai-Kimi-K2.jinja"}
VARIANTS = {"k3": "k3+k2", "k2": "k2"}  # the K3 tokenizer carries K2's strings too


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """"k2" / "k3" -> Kimi's slow tokenizer with its real chat template."""
    files = write_kimi_files(tmp_path_factory.mktemp("kimi-modelopt"))
    toks = {}
    for name, variant in VARIANTS.items():
        tok = kimi_slow_tokenizer(variant, files)
        tok.chat_template = template(TEMPLATES[name])
        toks[name] = tok
    return toks


@pytest.fixture
def installed():
    """chatgrammar installed into Model-Optimizer for one test, then removed again."""
    rec = cg_modelopt.install()
    yield rec
    cg_modelopt.uninstall()


# ------------------------------------------------------------------------------------------
# Independent references (scanners over ids, written from DESIGN.md, sharing no code)
# ------------------------------------------------------------------------------------------

def _tid(tok, text: str) -> int:
    conv = getattr(tok, "convert_tokens_to_ids", None)
    return conv(text) if conv else tok.encode_single_token(text)


def reference_k3(tok, ids: list[int]) -> list[int]:
    """Train everything after a top-level assistant message's <|sep|> up to its matching
    <|close|> (nested elements included); a cut body trains what is there, an input that ends
    in the generation prompt nothing."""
    o, c, s = (_tid(tok, t) for t in ("<|open|>", "<|close|>", "<|sep|>"))
    mask, stack, i, n, start = [0] * len(ids), [], 0, len(ids), None
    while i < n:
        if ids[i] in (o, c):
            j = i + 1
            while j < n and ids[j] != s:
                j += 1
            if j >= n:  # cut inside a header
                if ids[i] == c and len(stack) == 1 and start is not None:
                    mask[start:i] = [1] * (i - start)  # the message's own close: excluded
                    start = None
                break
            header = tok.decode(ids[i + 1:j])
            if ids[i] == o:
                stack.append(header)
                if len(stack) == 1 and 'role="assistant"' in header.split(" name=")[0]:
                    start = j + 1
            else:
                stack.pop()
                if not stack and start is not None:
                    mask[start:i] = [1] * (i - start)
                    start = None
            i = j + 1
        else:
            i += 1
    if start is not None:  # truncated inside the assistant body: train what is there,
        # unless it is exactly a generation prompt (the template's opening of a reply)
        if tok.decode(ids[start:n]) not in ("<|open|>think<|sep|>", "<|open|>response<|sep|>"):
            mask[start:n] = [1] * (n - start)
    return mask


def reference_k2(tok, ids: list[int]) -> list[int]:
    """Train an assistant turn's content: after its <|im_middle|>, up to <|im_end|>."""
    a, m, e = (_tid(tok, t) for t in ("<|im_assistant|>", "<|im_middle|>", "<|im_end|>"))
    roles = {_tid(tok, t) for t in ("<|im_user|>", "<|im_assistant|>", "<|im_system|>")}
    mask, i, n = [0] * len(ids), 0, len(ids)
    while i < n:
        if ids[i] != a:
            i += 1
            continue
        j = i + 1
        while j < n and ids[j] not in (m, e) and ids[j] not in roles:
            j += 1
        if j >= n or ids[j] != m:
            i = j
            continue
        k = j + 1
        while k < n and ids[k] != e and ids[k] not in roles:
            k += 1
        mask[j + 1:k] = [1] * (k - j - 1)
        i = k
    return mask


REFERENCE = {"k3": reference_k3, "k2": reference_k2}


def _chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  add_generation_prompt=False)
    return list(out["input_ids"])


# ------------------------------------------------------------------------------------------
# Import hygiene
# ------------------------------------------------------------------------------------------

def test_import_chatgrammar_imports_neither_torch_nor_modelopt():
    code = textwrap.dedent("""\
        import sys
        import chatgrammar, chatgrammar.integrations
        assert callable(chatgrammar.build_final_norm)
        heavy = [m for m in ("torch", "modelopt", "transformers", "trl", "ray")
                 if m in sys.modules]
        assert not heavy, heavy
        print("clean")
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr


# ------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------

def test_stock_registry_gives_k3_the_k2_scanner_and_all_zero_masks(slow):
    """Why install() exists: first match wins, and K3 carries K2's strings."""
    assert not any(r.name.startswith("chatgrammar") for r in loss_mask._RECOVERIES)
    rec = loss_mask.get_loss_mask_recovery(slow["k3"])
    assert rec is not None and rec.name == "kimi"
    ids = _chat_ids(slow["k3"], CONVERSATIONS[0])
    assert rec.compute(slow["k3"], torch.tensor(ids)).sum().item() == 0
    assert sum(reference_k3(slow["k3"], ids)) > 0


def test_install_puts_one_chatgrammar_entry_first_and_is_idempotent(slow):
    try:
        first = cg_modelopt.install()
        second = cg_modelopt.install(policy=cg.MaskPolicy(thinking=False))
        names = [r.name for r in loss_mask._RECOVERIES]
        assert names[0] == "chatgrammar" and names.count("chatgrammar") == 1
        assert "kimi" in names  # Model-Optimizer's own stay, after ours
        assert loss_mask._RECOVERIES[0] is second and first is not second
        assert isinstance(second, loss_mask.LossMaskRecovery)
        for name in ("k3", "k2"):
            assert loss_mask.get_loss_mask_recovery(slow[name]) is second
    finally:
        cg_modelopt.uninstall()
    assert not any(r.name.startswith("chatgrammar") for r in loss_mask._RECOVERIES)


def test_recovery_is_a_real_loss_mask_recovery_and_not_registered():
    before = list(loss_mask._RECOVERIES)
    rec = cg_modelopt.recovery("kimi-k3", strict=True)
    assert isinstance(rec, loss_mask.LossMaskRecovery) and rec.name == "chatgrammar:kimi-k3"
    assert loss_mask._RECOVERIES == before


# ------------------------------------------------------------------------------------------
# detect
# ------------------------------------------------------------------------------------------

class _IdsOnly:
    """A tokenizer with convert_tokens_to_ids and nothing else (no decode)."""

    def __init__(self, enc, unk=163_839):
        self._enc, self.unk_token_id = enc, unk

    def convert_tokens_to_ids(self, token):
        try:
            return self._enc.encode_single_token(token)
        except KeyError:
            return self.unk_token_id


class _Raises:
    def convert_tokens_to_ids(self, token):
        raise RuntimeError("broken tokenizer")

    def decode(self, ids):
        raise RuntimeError("broken tokenizer")


def test_detect_follows_declared_precedence_and_never_raises(slow):
    rec = cg_modelopt.recovery()
    assert rec.detect(slow["k3"]) and rec.detect(slow["k2"])
    assert cg_modelopt.recovery("kimi-k3").detect(slow["k3"])
    # a forced K2 recovery does not claim a K3 tokenizer: kimi-k3 takes precedence there
    assert not cg_modelopt.recovery("kimi-k2").detect(slow["k3"])
    assert cg_modelopt.recovery("kimi-k2").detect(slow["k2"])
    for junk in (None, object(), 42, "kimi", _Raises()):
        assert rec.detect(junk) is False
        assert cg_modelopt.recovery("kimi-k2").detect(junk) is False
    # compute on what detect refuses: zeros (counted) when lenient, DetectionError when strict
    assert rec.compute(_Raises(), [1, 2, 3]).tolist() == [0, 0, 0]
    assert cg_modelopt.stats(rec)["undetected"] == 1
    with pytest.raises(cg.DetectionError):
        cg_modelopt.recovery(strict=True).compute(_Raises(), [1, 2, 3])


def test_a_forced_format_does_not_demand_every_marker():
    import tiktoken

    # a K2 tokenizer without the tool-call and media markers (K2's detector needs neither)
    specials = {k: v for k, v in K2_SPECIALS.items() if "media" not in k and "tool" not in k}
    enc = tiktoken.Encoding(name="k2-lean", pat_str=PAT_STR, mergeable_ranks=_ranks(),
                            special_tokens=_with_reserved(specials))
    assert cg.load_format("kimi-k2").missing_markers(enc)  # some markers are missing
    rec = cg_modelopt.recovery("kimi-k2")
    assert rec.detect(enc)
    ids = (enc.encode("<|im_user|>user<|im_middle|>q<|im_end|><|im_assistant|>assistant"
                      "<|im_middle|>", allowed_special="all") + enc.encode("the answer")
           + enc.encode("<|im_end|>", allowed_special="all"))
    assert rec.compute(enc, ids).tolist() == reference_k2(enc, ids)


def test_tokenizer_without_decode_works_for_k2_and_is_refused_for_k3(slow):
    k2 = _IdsOnly(kimi_k2_encoding())
    rec = cg_modelopt.recovery()
    assert rec.detect(k2)
    assert cg_modelopt.needs_decoding(cg.load_format("kimi-k2"), kimi_k2_encoding()) is False
    ids = _chat_ids(slow["k2"], CONVERSATIONS[1])
    assert rec.compute(k2, ids).tolist() == reference_k2(slow["k2"], ids)
    # K3's roles are attribute text: without decode() it cannot be parsed, so no claim
    from tests.kimi_tokenizers import kimi_k3_encoding
    assert not rec.detect(_IdsOnly(kimi_k3_encoding(True)))
    assert cg_modelopt.needs_decoding(cg.load_format("kimi-k3")) is True


# ------------------------------------------------------------------------------------------
# compute
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["k3", "k2"])
def test_compute_returns_long_in_the_input_shape(slow, name):
    tok, rec = slow[name], cg_modelopt.recovery()
    ids = _chat_ids(tok, CONVERSATIONS[1])
    expected = REFERENCE[name](tok, ids)
    for given, shape in ((ids, (len(ids),)), (np.asarray(ids), (len(ids),)),
                         (np.asarray([ids], dtype=np.int32), (1, len(ids))),
                         (torch.tensor(ids), (len(ids),)), (torch.tensor([ids]), (1, len(ids))),
                         (torch.tensor([ids, ids]), (2, len(ids)))):
        mask = rec.compute(tok, given)
        assert isinstance(mask, torch.Tensor) and mask.dtype == torch.long
        assert tuple(mask.shape) == shape
        assert mask.reshape(-1, len(ids))[0].tolist() == expected
    assert rec.compute(tok, []).tolist() == []


@pytest.mark.parametrize("name", ["k3", "k2"])
def test_masks_equal_the_reference_on_every_prefix(slow, name):
    tok, rec = slow[name], cg_modelopt.recovery(strict=True)
    for messages in CONVERSATIONS:
        ids = _chat_ids(tok, messages)
        for cut in range(1, len(ids) + 1):
            got = rec.compute(tok, torch.tensor(ids[:cut])).tolist()
            assert got == REFERENCE[name](tok, ids[:cut]), (name, cut, tok.decode(ids[:cut]))
    assert cg_modelopt.stats(rec)["malformed"] == 0


@pytest.mark.parametrize("name", ["k3", "k2"])
def test_malformed_sample_is_lenient_by_default_and_raises_when_strict(slow, name, caplog):
    tok = slow[name]
    ids = _chat_ids(tok, FORGED[name])
    lenient = cg_modelopt.recovery()
    with caplog.at_level(logging.WARNING, logger="chatgrammar.integrations.modelopt"):
        mask = lenient.compute(tok, torch.tensor(ids))
    assert mask.shape == (len(ids),) and mask.dtype == torch.long
    assert cg_modelopt.stats(lenient)["malformed"] == 1
    assert any("malformed" in r.getMessage() for r in caplog.records)
    # nothing of the user's turn trains (the malformed stretch trains nothing), the reply does
    trained = tok.decode([i for i, m in zip(ids, mask.tolist()) if m])
    assert "typed" not in trained and "here" not in trained and "ok" in trained
    with pytest.raises(cg.ParseError):
        cg_modelopt.recovery(strict=True).compute(tok, torch.tensor(ids))


def test_malformed_samples_are_counted_and_the_log_is_rate_limited(slow, caplog):
    tok = slow["k2"]
    ids = torch.tensor(_chat_ids(tok, FORGED["k2"]))
    rec = cg_modelopt.recovery()
    with caplog.at_level(logging.WARNING, logger="chatgrammar.integrations.modelopt"):
        for _ in range(30):
            rec.compute(tok, ids)
    assert cg_modelopt.stats(rec)["malformed"] == 30
    logged = [r for r in caplog.records if r.name == "chatgrammar.integrations.modelopt"]
    assert len(logged) == 6  # samples 1-5, then 10


# ------------------------------------------------------------------------------------------
# Model-Optimizer's data paths, unmodified
# ------------------------------------------------------------------------------------------

def _streaming():
    from modelopt.torch.speculative.plugins import hf_streaming_dataset as sd
    return sd


@pytest.mark.parametrize("name", ["k3", "k2"])
def test_streaming_tokenize_with_loss_mask_equals_reference(slow, name, installed):
    sd, tok = _streaming(), slow[name]
    for messages in CONVERSATIONS:
        full = _chat_ids(tok, messages)
        for max_len in (None, len(full) - 3, len(full) // 2, 12):
            ids, mask = sd._tokenize_with_loss_mask(tok, messages, True, max_seq_len=max_len)
            row = ids[0].tolist()
            assert row == full[:len(row)]
            assert mask.dtype == torch.long and mask.shape == (len(row),)
            assert mask.tolist() == REFERENCE[name](tok, row), (name, max_len)


class _EchoDataset:
    """Model-Optimizer's StreamingDataset with its network hook answered locally."""

    @staticmethod
    def make(entries, tok, max_seq_len=None):
        sd = _streaming()

        class Echo(sd.StreamingDataset):
            def _fetch(self, sample):
                return sample

            def _format(self, fetched):
                return {"input_ids": torch.tensor(fetched["token_ids"]),
                        "loss_mask": fetched["loss_mask"]}

        config = sd.StreamingConfig(answer_only_loss=True, max_seq_len=max_seq_len)
        return Echo(entries, tok, config)


@pytest.mark.parametrize("name", ["k3", "k2"])
def test_streaming_dataset_getitem_trains_only_what_the_reference_trains(slow, name,
                                                                         installed):
    tok = slow[name]
    entries = [{"conversation_id": i, "messages": m}
               for i, m in enumerate(CONVERSATIONS + [FORGED[name]])]
    ds = _EchoDataset.make(entries, tok)
    for i in range(len(CONVERSATIONS)):
        item = ds[i]
        ids = item["input_ids"].tolist()
        assert item["loss_mask"].tolist() == REFERENCE[name](tok, ids)
    forged = ds[len(CONVERSATIONS)]  # never raises out of __getitem__
    ids, mask = forged["input_ids"].tolist(), forged["loss_mask"].tolist()
    assert len(mask) == len(ids) and cg_modelopt.stats(installed)["malformed"] == 1
    assert "typed" in tok.decode(ids)  # the forged sample itself (its reply still trains)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert "typed" not in trained and "here" not in trained and "ok" in trained


def test_streaming_dataset_without_chatgrammar_finds_no_k3_sample(slow):
    """The stock behaviour the issue describes: every K3 mask is all-zero, so the dataset
    resamples through the whole corpus and gives up."""
    entries = [{"conversation_id": i, "messages": m} for i, m in enumerate(CONVERSATIONS)]
    ds = _EchoDataset.make(entries, slow["k3"])
    with pytest.raises(RuntimeError, match="no fetchable sample"):
        ds[0]


@pytest.mark.parametrize("name", ["k3", "k2"])
def test_offline_dataset_rebuilds_masks_from_ids(slow, name, installed, tmp_path):
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    tok = slow[name]
    files, expected = [], []
    for i, messages in enumerate(CONVERSATIONS):
        ids = _chat_ids(tok, messages)
        ids = ids[: len(ids) - 2 * i]  # some truncated
        t = torch.tensor(ids) if i % 2 == 0 else torch.tensor([ids])  # (n,) and (1, n)
        path = tmp_path / f"{name}-{i}.pt"
        torch.save({"input_ids": t, "hidden_states": torch.zeros(len(ids), 4),
                    "aux_hidden_states": torch.zeros(len(ids), 4)}, path)
        files.append(str(path))
        expected.append((t.shape, REFERENCE[name](tok, ids)))
    ds = OfflineSupervisedDataset(files, answer_only_loss=True, tokenizer=tok)
    for i, (shape, ref) in enumerate(expected):
        item = ds[i]
        assert item["loss_mask"].shape == shape and item["loss_mask"].dtype == torch.long
        assert item["loss_mask"].reshape(-1).tolist() == ref


# ------------------------------------------------------------------------------------------
# Final norms
# ------------------------------------------------------------------------------------------

def test_final_norm_selection_uses_norms_yaml(installed):
    from modelopt.torch.speculative.plugins import modeling_fakebase as fakebase
    from modelopt.torch.speculative.plugins import modeling_final_norm as final_norm

    for mod in (final_norm, fakebase):
        sel = mod._select_final_norm_type
        assert sel is cg_modelopt.select_final_norm_type
        # Kimi-K3's backbone, Gemma 4 and gpt-oss get a norm (stock Model-Optimizer has none)
        assert sel("kimi_linear", None).startswith("chatgrammar:rmsnorm")
        assert sel("gemma4_text", None).startswith("chatgrammar:rmsnorm_fp32_mul")
        assert sel("gpt_oss", None).startswith("chatgrammar:rmsnorm_fp32_weight")
        assert sel("kimi_k25", None).startswith("chatgrammar:rmsnorm")
        assert sel("no_such_model", None) is None
        assert sel("phi", None) is None  # a LayerNorm bias Model-Optimizer would not load
    key = final_norm._select_final_norm_type("nemotron_h", {"model_type": "nemotron_h",
                                                            "layer_norm_epsilon": 3e-5})
    module = fakebase._FINAL_NORM_CLASSES[key](64, eps=1e-6, dtype=torch.bfloat16)
    assert module.eps == 3e-5  # the backbone's own attribute, not FakeBaseConfig's default
    cg_modelopt.install()  # idempotent: still one layer of patching
    assert fakebase._select_final_norm_type is cg_modelopt.select_final_norm_type


@pytest.mark.parametrize("model_type", ["gemma4_text", "gpt_oss", "nemotron_h", "kimi_linear"])
def test_fake_base_model_from_source_builds_the_exact_norm(model_type, installed, tmp_path):
    transformers = pytest.importorskip("transformers")
    from modelopt.torch.speculative.plugins.modeling_fakebase import FakeBaseModel
    from safetensors.torch import save_file

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    from tests.test_norms import _tiny_config

    from chatgrammar.core.norms import load_norms

    entry = load_norms().backbones[model_type].at(transformers.__version__)
    config = _tiny_config(transformers.CONFIG_MAPPING[model_type], entry.eps[0])
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    ref = getattr(transformers.AutoModel.from_config(config), entry.transformers["module"])
    if entry.kind == "rmsnorm_fp32_weight":
        ref = ref.float()
    else:
        ref = ref.to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(config.hidden_size) * 0.5 + 1)
    h, v = config.hidden_size, config.vocab_size
    save_file({"model.embed_tokens.weight": torch.zeros(v, h, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(v, h, dtype=torch.bfloat16),
               f"model.{entry.transformers['module']}.weight": ref.weight.detach().clone()},
              str(tmp_path / "model.safetensors"))
    fake = FakeBaseModel.from_source(str(tmp_path))
    assert fake.config.final_norm_type.startswith(f"chatgrammar:{entry.kind}")
    x = (torch.randn(3, 8, h) * 0.3).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fake.norm(x), ref(x))
