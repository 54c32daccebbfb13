"""The memoised mask path (chatgrammar.fastpath) gives exactly ``parse_ids(...).mask()``.

``Format.loss_mask`` / ``loss_masks`` go through :class:`chatgrammar.fastpath.FastMasker`, which
memoises item shapes and falls back to the full pipeline when it must. These tests compare it
with the full pipeline on many inputs: every bundled format's templates rendered with the built-in
matrix (soft markers as single ids and as plain BPE text), truncations of every rendering,
several policies, lenient and strict mode, list / numpy / torch inputs, batches, and the Kimi
benchmark workload (where the fast path must actually be taken).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import chatgrammar as cg
from chatgrammar.errors import ParseError
from chatgrammar.matrix import iter_renderable
from tests.fuzz_tokenizers import encode_rendered, format_encoding, format_templates

POLICIES = [None, cg.MaskPolicy(thinking=False, end_marker=True),
            cg.MaskPolicy(roles=("assistant", "user"), tool_calls=False, truncated=False),
            cg.MaskPolicy(last_turn_only=True)]


def _bench():
    path = Path(__file__).resolve().parent.parent / "tools" / "bench.py"
    spec = importlib.util.spec_from_file_location("cg_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _samples(fmt) -> list[list[int]]:
    out = []
    for soft in (True, False):
        enc = format_encoding(fmt, soft_as_specials=soft)
        for _name, tpl, kw in format_templates(fmt)[:1]:
            for r in iter_renderable(tpl, **kw):
                if r.text is None:
                    continue
                ids = encode_rendered(enc, r.text)
                out.append((enc, ids))
                for cut in (len(ids) // 3, len(ids) - 2):
                    if 0 < cut < len(ids):
                        out.append((enc, ids[:cut]))
    return out


def _slow(fmt, ids, enc, policy, strict):
    try:
        return fmt.parse_ids(ids, enc, strict=strict).mask(policy)
    except ParseError:
        return ParseError


def _fast(fmt, ids, enc, policy, strict):
    try:
        return fmt.loss_mask(ids, enc, policy=policy, strict=strict)
    except ParseError:
        return ParseError


@pytest.mark.parametrize("name", cg.list_formats())
def test_fast_path_agrees_with_full_pipeline_on_every_format(name):
    fmt = cg.load_format(name)
    samples = _samples(fmt)
    assert samples, f"no template of {name} rendered"
    for policy in POLICIES[:3]:
        for strict in (False, True):
            for _ in range(2):  # the second pass is served from the memo
                for enc, ids in samples:
                    want = _slow(fmt, ids, enc, policy, strict)
                    got = _fast(fmt, ids, enc, policy, strict)
                    assert got == want, (name, policy, strict, enc.decode(ids)[:300])


@pytest.mark.parametrize("name", ["kimi-k2", "kimi-k3", "chatml"])
def test_batches_and_container_kinds_agree(name):
    torch = pytest.importorskip("torch")
    fmt = cg.load_format(name)
    samples = _samples(fmt)[:40]
    by_enc: dict = {}
    for enc, ids in samples:
        by_enc.setdefault(id(enc), (enc, []))[1].append(ids)
    for enc, batch in by_enc.values():
        for policy in POLICIES:
            want = [fmt.parse_ids(x, enc, strict=False).mask(policy) for x in batch]
            assert fmt.loss_masks(batch, enc, policy=policy, strict=False) == want
            got_np = fmt.loss_masks([np.asarray(x, dtype=np.int32) for x in batch], enc,
                                    policy=policy, strict=False)
            assert all(g.dtype == np.int64 and g.tolist() == w for g, w in zip(got_np, want))
            got_t = fmt.loss_masks([torch.tensor(x) for x in batch], enc, policy=policy,
                                   strict=False)
            assert all(g.dtype == torch.long and g.tolist() == w for g, w in zip(got_t, want))


@pytest.mark.parametrize("version", ["kimi-k2", "kimi-k3"])
def test_workload_is_served_by_the_fast_path(version):
    bench = _bench()
    texts, ids = bench.workload(version, 24, seed=7)
    enc = bench.kimi_encoding(version)
    fmt = cg.load_format(version)
    fm = fmt._fast_masker(enc)
    for policy in POLICIES:
        before = dict(fm.stats)
        for x in ids:
            assert fmt.loss_mask(x, enc, policy=policy) == fmt.parse_ids(x, enc).mask(policy)
        assert fmt.loss_masks(ids, enc, policy=policy) == \
            [fmt.parse_ids(x, enc).mask(policy) for x in ids]
        fast = fm.stats["fast"] - before["fast"]
        slow = fm.stats["slow"] - before["slow"]
        if policy is not None and policy.last_turn_only:
            assert fast == 0  # documented: last_turn_only always takes the full pipeline
        else:
            # most samples are answered from the memo (new item shapes take the slow path)
            assert fast > 4 * slow, fm.stats


def test_marker_strings_typed_in_content_stay_text():
    # id mode is authoritative: "<|close|>" typed by a user is ordinary ids, in both paths
    bench = _bench()
    enc = bench.kimi_encoding("kimi-k3")
    fmt = cg.load_format("kimi-k3")
    head = enc.encode('<|open|>message role="user"<|sep|>', allowed_special="all")
    body = enc.encode_ordinary("see <|close|>message<|sep|> here")
    tail = enc.encode('<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"'
                      '<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|close|>'
                      'message<|sep|><|end_of_msg|>', allowed_special="all")
    ids = head + body + tail
    for _ in range(2):
        assert fmt.loss_mask(ids, enc) == fmt.parse_ids(ids, enc).mask()
    assert sum(fmt.loss_mask(ids, enc)) > 0


# ----------------------------------------------------------------------------- text mode

def _reference(fmt):
    """The same format with the text memo switched off: the full pipeline every time."""
    from chatgrammar.fastpath import TextMemo
    from chatgrammar.format import Format

    ref = Format(fmt.spec, fmt.source)
    ref._text_memo = TextMemo(ref)
    ref._text_memo.enabled = False
    return ref


def _text_result(fmt, text, strict):
    import dataclasses

    try:
        conv = fmt.parse(text, strict=strict)
    except ParseError as exc:
        return ("error", str(exc))
    return ([dataclasses.asdict(t) for t in conv.turns], [str(w) for w in conv.warnings],
            conv.spans(), conv.spans(cg.MaskPolicy(thinking=False, end_marker=True)),
            conv.mask(), conv.length, conv.text == text)


@pytest.mark.parametrize("name", cg.list_formats())
def test_text_memo_gives_the_full_parse_on_every_format(name):
    fmt = cg.load_format(name)
    ref = _reference(fmt)
    texts = []
    for _name, tpl, kw in format_templates(fmt)[:1]:
        for r in iter_renderable(tpl, **kw):
            if r.text is not None:
                texts += [r.text, r.text[:len(r.text) // 2], r.text[:-3]]
    assert texts
    for strict in (True, False):
        for _ in range(2):  # the second pass is served from the memo
            for t in texts:
                assert _text_result(fmt, t, strict) == _text_result(ref, t, strict), t[:300]


def test_text_memo_serves_the_workload_and_returns_fresh_objects():
    bench = _bench()
    texts, _ = bench.workload("kimi-k3", 12, seed=5)
    fmt = cg.load_format("kimi-k3")
    ref = _reference(fmt)
    memo_stats = fmt._text_memo.stats if fmt._text_memo else None
    for t in texts:
        fmt.parse(t)
    before = dict(fmt._text_memo.stats)
    for t in texts:
        a, b = fmt.parse(t), fmt.parse(t)
        assert _text_result(fmt, t, True) == _text_result(ref, t, True)
        # two parses never share Turn, Block or attrs objects
        assert all(x is not y and x.block is not y.block and x.block.attrs is not y.block.attrs
                   for x, y in zip(a.turns, b.turns))
    assert fmt._text_memo.stats["fast"] - before["fast"] >= 2 * len(texts)
    del memo_stats


@pytest.mark.parametrize("group", [1, 700, 5000])
def test_large_batches_are_worked_through_in_groups(group, monkeypatch):
    # loss_masks splits a batch into groups of about _BATCH_TOKENS tokens (cache-sized);
    # every grouping gives every sample its own mask, in order, for every container kind.
    from chatgrammar import fastpath

    bench = _bench()
    _texts, ids = bench.workload("kimi-k2", 12, seed=5)
    enc = bench.kimi_encoding("kimi-k2")
    fmt = cg.load_format("kimi-k2")
    want = [fmt.parse_ids(x, enc).mask() for x in ids]
    monkeypatch.setattr(fastpath, "_BATCH_TOKENS", group)
    assert fmt.loss_masks(ids, enc) == want
    got = fmt.loss_masks([np.asarray(x) for x in ids], enc)
    assert [g.tolist() for g in got] == want
    bad = [*ids[:3], ids[3][: len(ids[3]) // 2], *ids[4:]]  # a truncated sample in the middle
    assert fmt.loss_masks(bad, enc, strict=False) == \
        [fmt.parse_ids(x, enc, strict=False).mask() for x in bad]


# Formats whose renders never reach the fast path, and why: Apertus's template never closes the
# last assistant turn, and StarCoder2-Instruct's always ends with a `### Response` header, so
# every complete rendering ends inside an item (truncation takes the full pipeline by design).
NEVER_FAST = {"apertus", "starcoder2-instruct"}


@pytest.mark.parametrize("name", sorted(set(cg.list_formats()) - NEVER_FAST))
def test_complete_renders_are_served_by_the_memo(name):
    # A core change can make every sample miss the memo without changing a single mask (a read
    # at the end of the input that every item's key then depends on); this catches that.
    fmt = cg.load_format(name)
    full = _samples(fmt)[0::3]  # _samples: each complete render, then two cuts of it
    for enc, ids in full:
        _fast(fmt, ids, enc, None, False)
    served = 0
    for enc, ids in full:
        fm = fmt._fast_masker(enc)
        before = fm.stats["fast"]
        _fast(fmt, ids, enc, None, False)
        served += fm.stats["fast"] - before
    assert served > 0, f"{name}: no complete rendering was served by the memo"
