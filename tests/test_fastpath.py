"""The memoised mask path (chatgrammar.runtime.fastpath) gives exactly ``parse_ids(...).mask()``.

``Format.loss_mask`` / ``loss_masks`` go through :class:`chatgrammar.runtime.fastpath.FastMasker`, which
memoises item shapes and falls back to the full pipeline when it must. These tests compare it
with the full pipeline on many inputs: every bundled format's templates rendered with the built-in
matrix (soft markers as single ids and as plain BPE text), truncations of every rendering,
several policies, lenient and strict mode, list / numpy / torch inputs, batches, and the Kimi
benchmark workload (where the fast path must actually be taken).
"""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import chatgrammar as cg
from chatgrammar.errors import ParseError
from chatgrammar.conformance.matrix import iter_renderable
from chatgrammar.runtime.fastpath import spec_refusal as fastpath_spec_refusal
from tests.fuzz_tokenizers import encode_rendered, engine_templates, format_encoding

POLICIES = [None, cg.MaskPolicy(thinking=False, end_marker=True),
            cg.MaskPolicy(roles=("assistant", "user"), tool_calls=False, truncated=False),
            cg.MaskPolicy(last_turn_only=True)]


@lru_cache(maxsize=1)
def _bench():
    """tools/bench.py as a module, loaded once per test module (tests/conftest.py drops it
    after each, as every ``lru_cache`` of a tests.* module): its own memos (the Kimi
    encodings, each ~0.5 CPU-s with its ranks file) then serve every test of the module
    instead of being rebuilt by each call. Read-only."""
    path = Path(__file__).resolve().parent.parent / "tools" / "bench.py"
    spec = importlib.util.spec_from_file_location("cg_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _samples(fmt) -> list[list[int]]:
    """``(encoding, ids)`` of each complete render of the format's first engine template, with
    two cuts of it, for both soft-marker encodings (shared between the tests of one format,
    see :class:`_OneFormatMemo`: treat as read-only)."""
    return _OneFormatMemo.get(fmt, "samples", lambda: _build_samples(fmt))


class _OneFormatMemo:
    """The test inputs of one format, built once while the tests of that format run
    (tests/conftest.py runs this module format by format: four tests of a format render the
    same templates and encode the same samples). Keyed by the format's name and its spec's
    source text (content, never an object's id); only the current format's inputs are kept
    (memory: one format's renders), and ``cache_clear`` (called by tests/conftest.py after
    each module, as for every ``lru_cache`` of a tests.* module) drops them."""

    _key: tuple | None = None
    _got: dict = {}

    @classmethod
    def get(cls, fmt, what: str, build):
        key = (fmt.name, fmt.source)
        if cls._key != key:
            cls._key, cls._got = key, {}
        if what not in cls._got:
            cls._got[what] = build()
        return cls._got[what]

    @classmethod
    def cache_clear(cls) -> None:
        cls._key, cls._got = None, {}

    @classmethod
    def cache_info(cls) -> dict:
        return {"format": cls._key and cls._key[0], "inputs": sorted(cls._got)}


def _rendered(fmt) -> list[str]:
    """The texts of the built-in matrix the format's first engine template renders (the
    cases it refuses left out), rendered once per format (:class:`_OneFormatMemo`)."""
    return _OneFormatMemo.get(fmt, "rendered", lambda: [
        r.text for _name, tpl, kw in engine_templates(fmt)[:1]
        for r in iter_renderable(tpl, **kw) if r.text is not None])


def _build_samples(fmt) -> list:
    out = []
    for soft in (True, False):
        enc = format_encoding(fmt, soft_as_specials=soft)
        for text in _rendered(fmt):
            ids = encode_rendered(enc, text)
            out.append((enc, ids))
            for cut in (len(ids) // 3, len(ids) - 2):
                if 0 < cut < len(ids):
                    out.append((enc, ids[:cut]))
    return out


def _slow_masks(fmt, samples, policies, strict) -> dict:
    """``{(policy index, sample index): parse_ids(...).mask(policy)}`` (``ParseError`` where
    it raises): the full pipeline's answer for every sample under every policy, from ONE
    parse per sample (a parse does not depend on the policy: ``mask(policy)`` reads it; a
    strict ParseError is every policy's answer). The tests compare each fast answer, first
    pass and memo pass, with these; the fast calls are made in the same order as before."""
    out = {}
    for i, (enc, ids) in enumerate(samples):
        try:
            conv = fmt.parse_ids(ids, enc, strict=strict)
        except ParseError:
            conv = None
        for k, policy in enumerate(policies):
            out[k, i] = ParseError if conv is None else conv.mask(policy)
    return out


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
    slow = {strict: _slow_masks(fmt, samples, POLICIES[:3], strict) for strict in (False, True)}
    for k, policy in enumerate(POLICIES[:3]):
        for strict in (False, True):
            for _ in range(2):  # the second pass is served from the memo
                for i, (enc, ids) in enumerate(samples):
                    want = slow[strict][k, i]
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
        # most samples are answered from the memo (new item shapes take the slow path),
        # last_turn_only included
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
    from chatgrammar.runtime.textpath import TextMemo
    from chatgrammar.runtime.format import Format

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
    texts = [x for r in _rendered(fmt) for x in (r, r[:len(r) // 2], r[:-3])]
    assert texts
    for strict in (True, False):
        # the reference (memo off: the same full parse every time) once per text
        want = [_text_result(ref, t, strict) for t in texts]
        for _ in range(2):  # the second pass is served from the memo
            for t, w in zip(texts, want):
                assert _text_result(fmt, t, strict) == w, t[:300]


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
    from chatgrammar.runtime import fastpath

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
# Falcon, Nemotron-4, SEA-LION and SOLAR-Instruct answers have no terminator (the next header
# or the end of input ends them): the same holds.
NEVER_FAST = {"apertus", "starcoder2-instruct", "falcon", "nemotron4", "sea-lion",
              "solar-instruct"}


# and the formats the fast path refuses by their spec (a `trim_end` element), by design
NEVER_FAST |= {n for n in cg.list_formats()
               if fastpath_spec_refusal(cg.load_format(n).spec)}


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


# ----------------------------------------------------------------------------- one engine

def _cut_points(n: int, stride: int) -> list[int]:
    """The cuts ``1..n-1`` at ``stride`` (every cut at 1; the last one always)."""
    return sorted(set(range(1, n, stride)) | ({n - 1} if n > 1 else set()))


def _every_cut_samples(fmt, limit=3):
    """Complete renders of the format's first template (both soft-marker encodings), at most
    ``limit`` per encoding: ``(encoding, ids, j)``, ``j`` the render's rank for its
    encoding; the test cuts each."""
    return [(enc, encode_rendered(enc, text), j)
            for enc in (format_encoding(fmt, soft_as_specials=soft) for soft in (True, False))
            for j, text in enumerate(_rendered(fmt)[:limit])]


@pytest.mark.long
@pytest.mark.parametrize("name", cg.list_formats())
def test_truncation_at_every_cut_is_the_reference_and_served_fast(name):
    """Truncation is a case of the memoised core (an item cut by the end of input is keyed by
    the configuration it ends in): at every cut, the fast answer is the reference's, under
    several policies (last_turn_only included) and in both modes; a second pass is served
    from the memo.

    Budget (issue 14: long inputs sized, marker ``long``): per encoding (soft markers as ids,
    and as text) the first two complete renders; the default run cuts the first at every
    position and the second at every third position (and its last); the longer run
    (``CHATGRAMMAR_LONG=1``, or ``--runslow``) cuts both at every position (the budget before
    issue 14's sizing)."""
    fmt = cg.load_format(name)
    every = os.environ.get("CHATGRAMMAR_LONG", "") not in ("", "0")
    cuts = [(enc, ids[:k]) for enc, ids, j in _every_cut_samples(fmt, 2)
            for k in _cut_points(len(ids), 1 if every or j == 0 else 3)]
    combos = ((None, True), (None, False), (cg.MaskPolicy(last_turn_only=True), True),
              (cg.MaskPolicy(thinking=False, end_marker=True, truncated=False), False))
    slow = {strict: _slow_masks(fmt, cuts, [p for p, s in combos if s == strict], strict)
            for strict in (True, False)}
    for policy, strict in combos:
        k = [p for p, s in combos if s == strict].index(policy)
        for _ in range(2):
            for i, (enc, ids) in enumerate(cuts):
                assert _fast(fmt, ids, enc, policy, strict) == slow[strict][k, i], \
                    (name, policy, strict, len(ids))
    fm = [fmt._fast_masker(enc) for enc, _ in cuts[:1]][0]
    assert fm.stats["fast"] > 0 or name in NEVER_FAST


@pytest.mark.parametrize("version", ["kimi-k2", "kimi-k3"])
def test_every_input_class_is_served_by_the_memo(version):
    # the bench's input classes (truncated, last_turn_only, lenient, packed, a long sequence
    # cut mid-turn) take the fast core once the memo is warm, and equal the reference
    bench = _bench()
    enc = bench.kimi_encoding(version)
    fmt = cg.load_format(version)
    _texts, warm = bench.workload(version, 24, seed=11)
    _texts, fresh = bench.workload(version, 24, seed=12)
    for cls in bench.CLASSES:
        for x in bench.class_inputs(version, warm, cls)[0]:
            fmt.loss_mask(x, enc, **bench.class_inputs(version, warm[:1], cls)[1])
    for cls in bench.CLASSES:
        xs, kw = bench.class_inputs(version, fresh, cls)
        before = fmt.stats()["ids"]
        for x in xs:
            got = fmt.loss_mask(x, enc, **kw)
            want = fmt.parse_ids(x, enc, strict=kw.get("strict", True)).mask(kw.get("policy"))
            assert (got if type(got) is list else got.tolist()) == want, cls
        after = fmt.stats()["ids"]
        fast, slow = after["fast"] - before["fast"], after["slow"] - before["slow"]
        assert fast >= 2 * slow, (cls, after["reasons"])


# ----------------------------------------------------------------------------- per-tokenizer state

_K2_TEXT = ("<|im_user|>user<|im_middle|>hi there<|im_end|><|im_assistant|>assistant<|im_middle|>"
            "hello, how can I help?<|im_end|>")


def test_per_tokenizer_state_keeps_no_tokenizer_alive():
    # a tokenizer passed to loss_mask / parse_ids is freed once the caller drops it (the
    # per-tokenizer state holds it weakly), and an equal tokenizer reuses the same state
    import gc
    import weakref

    import tiktoken

    from tests.kimi_tokenizers import K2_SPECIALS, PAT_STR, _ranks, _with_reserved

    fmt = cg.load_format("kimi-k2")

    def make():
        return tiktoken.Encoding(name="k2-leak-test", pat_str=PAT_STR, mergeable_ranks=_ranks(),
                                 special_tokens=_with_reserved(K2_SPECIALS))

    enc = make()
    ids = enc.encode(_K2_TEXT, allowed_special="all")
    want = fmt.parse_ids(ids, enc).mask()
    assert sum(want) > 0
    for _ in range(2):
        assert fmt.loss_mask(ids, enc) == want
    assert fmt.loss_masks([ids, ids], enc) == [want, want]
    masker = fmt._fast_masker(enc)
    ref = weakref.ref(enc)
    del enc
    gc.collect()
    assert ref() is None, "a per-tokenizer cache keeps the tokenizer alive"
    other = make()  # same content: same state, rebound to the new object
    assert fmt._fast_masker(other) is masker
    assert fmt.loss_mask(ids, other) == want
    ref2 = weakref.ref(other)
    del other
    gc.collect()
    assert ref2() is None


def test_a_tokenizer_that_gains_special_tokens_gets_a_fresh_lexer():
    # training scripts call add_special_tokens after the tokenizer was first used: the state
    # follows the tokenizer's content, so the new marker ids are seen (no stale lexer)
    pytest.importorskip("transformers")
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from tests.tokenizers import qwen_fast_tokenizer

    fmt = cg.load_format("chatml")
    ref = qwen_fast_tokenizer()
    # Qwen's BPE with no added token: exactly what TikTokenConverter(qwen.tiktoken) converts
    # (the same JSON), taken from the shared tokenizer's backend instead of converting the
    # 151k ranks again (~2.5 CPU-s; issue 14)
    state = json.loads(ref.backend_tokenizer.to_str())
    state["added_tokens"], state["normalizer"] = [], None
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)))
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>\n"
    before = tok.encode(text, add_special_tokens=False)
    try:  # without the specials the markers are ordinary text: no turn can train
        assert sum(fmt.loss_mask(before, tok, strict=False)) == 0
    except ParseError:
        pass
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>",
                                                          "<|im_end|>"]})
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ref.encode(text, add_special_tokens=False)
    want = fmt.parse_ids(ids, ref).mask()
    assert sum(want) > 0
    assert fmt.loss_mask(ids, tok) == want
    assert fmt.parse_ids(ids, tok).mask() == want


# ----------------------------------------------------------------------------- verify, stats, API

def _k2_ids():
    from tests.kimi_tokenizers import kimi_k2_encoding

    enc = kimi_k2_encoding()
    return enc, enc.encode(_K2_TEXT, allowed_special="all")


def test_verify_mode_checks_every_fast_answer_and_raises_on_a_difference(monkeypatch):
    from chatgrammar.errors import VerifyError

    enc, ids = _k2_ids()
    fmt = cg.load_format("kimi-k2")
    want = fmt.parse_ids(ids, enc).mask()
    fmt.loss_mask(ids, enc)  # teaches the memo
    monkeypatch.setenv("CHATGRAMMAR_VERIFY", "1")
    before = fmt.stats()["ids"]["verified"]
    assert fmt.loss_mask(ids, enc) == want
    assert fmt.loss_masks([ids, ids[:9]], enc) == [want, fmt.parse_ids(ids[:9], enc).mask()]
    assert fmt.stats()["ids"]["verified"] >= before + 2
    # a wrong memo entry (a bug) is caught, never returned
    fm = fmt._fast_masker(enc)
    for it in fm.items.values():
        for prog in it.progs.values():
            for pid, (spans, chosen) in list(prog.by_policy.items()):
                prog.by_policy[pid] = (tuple((a, da, b, db + 1, t) for a, da, b, db, t in spans)
                                       , chosen)
    for cm in fm.cmemo.values():  # the C executor's view of the memo, rebuilt from the above
        cm.clear()
    with pytest.raises(VerifyError):
        fmt.loss_mask(ids, enc)
    with pytest.raises(VerifyError):  # and the C executor, now taught the wrong entry
        fmt.loss_mask(ids, enc)
    fm.forget()
    monkeypatch.delenv("CHATGRAMMAR_VERIFY")
    assert fmt.loss_mask(ids, enc) == want


def test_verify_mode_checks_the_text_memo(monkeypatch):
    from chatgrammar.errors import VerifyError

    fmt = cg.load_format("kimi-k2")
    conv = fmt.parse(_K2_TEXT)
    fmt.parse(_K2_TEXT)
    monkeypatch.setenv("CHATGRAMMAR_VERIFY", "1")
    before = fmt.stats()["text"]["verified"]
    assert fmt.parse(_K2_TEXT).spans() == conv.spans()
    assert fmt.stats()["text"]["verified"] == before + 1
    memo = fmt._text_memo
    for it in memo.items.values():
        for tpls in it.progs.values():
            for tp in tpls:
                tp.base["role"] = "system"  # a corrupted template
    with pytest.raises(VerifyError):
        fmt.parse(_K2_TEXT)
    memo.items.clear()


def test_stats_count_samples_by_path_and_reason():
    enc, ids = _k2_ids()
    fmt = cg.load_format("kimi-k2")
    fmt._fast_masker(enc).items.clear()
    s0 = fmt.stats()["ids"]
    fmt.loss_mask(ids, enc)                      # a new item shape: full pipeline
    fmt.loss_mask(ids, enc)                      # then the memo
    broken = [163586] + ids                    # an <|im_end|> before any turn
    fmt.loss_mask(broken, enc, strict=False)     # lenient repair: full pipeline
    s1 = fmt.stats()["ids"]
    assert s1["fast"] - s0["fast"] >= 1
    assert s1["slow"] - s0["slow"] == 2
    grew = {k: v - s0["reasons"].get(k, 0) for k, v in s1["reasons"].items()}
    assert grew.get("new item shape", 0) >= 1
    assert any("syntax error" in k and n for k, n in grew.items()), grew
    assert set(fmt.stats()) == {"ids", "text"}


def test_loss_masks_records_errors_per_sample():
    enc, ids = _k2_ids()
    fmt = cg.load_format("kimi-k2")
    broken = [163586] + ids
    with pytest.raises(ParseError):
        fmt.loss_masks([ids, broken], enc)
    errors: list = []
    roles: list = []
    got = fmt.loss_masks([ids, broken, ids], enc, on_error="record", errors=errors, roles=roles)
    want = fmt.parse_ids(ids, enc).mask()
    assert got[0] == want and got[1] is None and got[2] == want
    assert errors[0] is None and isinstance(errors[1], ParseError) and errors[2] is None
    assert roles[0] == ["user", "assistant"] and roles[1] is None
    # a columnar chunk: one flat array and its offsets; masks are 0/1 bytearrays
    flat = np.asarray(ids + broken, dtype=np.int64)
    errs: list = []
    cols = fmt.loss_masks(flat, enc, offsets=[0, len(ids), len(flat)], on_error="record",
                          errors=errs)
    assert list(cols[0]) == want and cols[1] is None and isinstance(errs[1], ParseError)
    arrs = fmt.loss_masks([np.asarray(ids), np.asarray(broken)], enc, on_error="record")
    assert arrs[0].tolist() == want and arrs[1] is None
    with pytest.raises(ValueError):
        fmt.loss_masks([ids], enc, on_error="ignore")


def test_adapter_follows_a_tokenizer_that_gains_special_tokens():
    # adapt() is cached per object but checked against the tokenizer's content: a marker added
    # after first use is found (a cache keyed by the object alone kept the old lookups)
    from chatgrammar.runtime.tokenizers import adapt
    from tests.tokenizers import qwen_fast_tokenizer

    import copy

    tok = copy.deepcopy(qwen_fast_tokenizer())  # (the shared one stays as it is)
    before = adapt(tok)
    assert before.token_id("<|cg_new|>", True) is None
    tok.add_special_tokens({"additional_special_tokens": ["<|cg_new|>"]})
    after = adapt(tok)
    assert after is not before
    assert after.token_id("<|cg_new|>", True) == tok.convert_tokens_to_ids("<|cg_new|>")


# ----------------------------------------------------------------------------- P8: list masks, learning parses

_K3_TURNS = ('<|open|>message role="user"<|sep|>hi there<|close|>message<|sep|><|end_of_msg|>'
             '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>let me see'
             '<|close|>think<|sep|><|open|>response<|sep|>hello, how can I help?'
             '<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>')


def test_long_list_masks_equal_the_reference_under_every_policy():
    # The C executor writes a list mask in one forward pass over spans in order (abutting
    # spans of consecutive blocks, a cut last turn, last_turn_only's selection): a long
    # packed sequence and its cuts give the reference's mask, served by the C executor once
    # the memo is warm.
    from tests.kimi_tokenizers import kimi_k3_encoding

    enc = kimi_k3_encoding()
    fmt = cg.load_format("kimi-k3")
    one = enc.encode(_K3_TURNS, allowed_special="all")
    big = one * 300
    cuts = [big, big[:len(big) - 7], big[:len(one) * 150 + 26]]  # (+23: a generation prompt)
    for policy in POLICIES:
        for ids in cuts:
            fmt.loss_mask(ids, enc, policy=policy)  # (learns what is new)
            c0 = fmt.stats()["ids"]["c"]
            got = fmt.loss_mask(ids, enc, policy=policy)
            assert got == fmt.parse_ids(ids, enc).mask(policy), (policy, len(ids))
            if fmt._fast_masker(enc).plan is not None:
                assert fmt.stats()["ids"]["c"] == c0 + 1, policy


def test_learning_parses_leave_generation_prompts_to_each_answer():
    # A parse that only teaches the memo (Driver.run(gen_prompt=False)) does not mark the
    # last turn a generation prompt: the memo keeps turns unmarked, and each answer applies
    # the driver's rule to its own last turn. A generation prompt learned from such a parse
    # still trains nothing; the same turn with one more token is an ordinary cut turn.
    from chatgrammar.runtime.parse import Source
    from tests.kimi_tokenizers import kimi_k3_encoding

    enc = kimi_k3_encoding()
    fmt = cg.load_format("kimi-k3")
    gp = enc.encode(_K3_TURNS[:_K3_TURNS.index("<|open|>message role=\"assistant\"")]
                    + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
                    allowed_special="all")
    lx = fmt.id_lexer(enc)
    arr = np.asarray(gp, dtype=np.int64)
    src = Source("ids", len(arr), arr=arr, adapter=lx.adapter)
    marked = fmt._driver.run(lx.lex(arr, []), src, True, [])
    unmarked = fmt._driver.run(lx.lex(arr, []), src, True, [], gen_prompt=False)
    assert marked[-1].generation_prompt and not unmarked[-1].generation_prompt
    fm = fmt._fast_masker(enc)
    fm.forget()
    assert fm._learn_from(arr)  # learn only
    for ids in (gp, gp + enc.encode("ok"), gp[:-1]):
        assert fmt.loss_mask(ids, enc) == fmt.parse_ids(ids, enc).mask(), len(ids)
    assert not any(t.generation_prompt for it in fm.items.values() for p in it.progs.values()
                   for t in p.turns)


@pytest.mark.parametrize("version", ["kimi-k2", "kimi-k3"])
def test_driver_resumes_a_prefix_from_a_saved_configuration(version):
    # Driver.run(saves=...) keeps the parser's configuration before each given token;
    # Driver.resume finishes the prefix from it: the same turns (and so the same masks under
    # every policy) as a parse of that prefix alone, at every token boundary.
    from chatgrammar.runtime.parse import Source
    from chatgrammar.runtime.spans import Conversation

    bench = _bench()
    enc = bench.kimi_encoding(version)
    fmt = cg.load_format(version)
    ids = bench.workload(version, 1, seed=3)[1][0][:600]
    lx = fmt.id_lexer(enc)
    arr = np.asarray(ids, dtype=np.int64)
    toks = lx.lex(arr, [])
    drv = fmt._driver
    saves = list(range(1, len(toks)))
    drv.run(toks, Source("ids", len(arr), arr=arr, adapter=lx.adapter), False, [],
            gen_prompt=False, saves=saves)
    assert [s.i for s in saves] == list(range(1, len(toks)))
    for sv in saves:
        e = toks[sv.i - 1][2]
        src = Source("ids", e, arr=arr[:e], adapter=lx.adapter)
        warnings: list = []
        got = drv.resume(sv, src, warnings)
        want = drv.run(toks[:sv.i], Source("ids", e, arr=arr[:e], adapter=lx.adapter),
                       False, [], gen_prompt=False)
        assert not warnings
        for policy in POLICIES:
            conv = [Conversation(format=fmt.name, mode="ids", length=e, turns=t, warnings=[],
                                 boundaries=[], default_policy=fmt.default_policy).mask(policy)
                    for t in (got, want)]
            assert conv[0] == conv[1], (sv.i, policy)
        assert [(t.role, t.start, t.end, t.complete) for t in got] == \
            [(t.role, t.start, t.end, t.complete) for t in want]


@pytest.mark.parametrize("version", ["kimi-k2", "kimi-k3"])
def test_cuts_of_a_learned_item_are_served_without_a_new_parse(version):
    # Learning a conversation also learns its items cut after every marker and run, from the
    # driver's saved configurations (stats: "resumed"): every such cut of it is then answered
    # by the memo (no window, no full parse) and equals the reference.
    bench = _bench()
    enc = bench.kimi_encoding(version)
    fmt = cg.load_format(version)
    ids = bench.workload(version, 1, seed=4)[1][0][:400]
    fmt.loss_mask(ids, enc)
    fm = fmt._fast_masker(enc)
    assert fm.stats.get("resumed", 0) > 0
    lx = fmt.id_lexer(enc)
    ends = sorted({t[2] for t in lx.lex(np.asarray(ids, dtype=np.int64), [])})[:-1]
    before = dict(fm.stats)
    for e in ends:
        assert fmt.loss_mask(ids[:e], enc) == fmt.parse_ids(ids[:e], enc).mask(), e
    assert fm.stats["slow"] == before["slow"]
    assert fm.stats.get("window", 0) == before.get("window", 0)
    assert fm.stats["fast"] == before["fast"] + len(ends)



def test_cut_items_are_learned_only_while_items_repeat(monkeypatch, request):
    # K10: a learning parse resumes its cuts (stats "resumed") only while, over the last
    # stretch of learning parses, at most half the samples needed one; on samples whose items
    # never repeat it stops ("cut_skip"), and comes back once the memo answers most samples.
    # The masks are the reference's throughout.
    from chatgrammar.runtime import fastpath

    bench = _bench()
    enc = bench.kimi_encoding("kimi-k2")
    fmt = cg.load_format("kimi-k2")
    fm = fmt._fast_masker(enc)
    fm.forget()
    # (kimi-k2's tool names are header text nothing reads, keyed by their length class alone:
    # lexers.value_free_openers. Keyed by their ids again here, these items never repeat.)
    monkeypatch.setattr(fm, "vfree", None)
    if fm.plan is not None:
        monkeypatch.setattr(fm, "plan", fm._c_plan())
    request.addfinalizer(fm.forget)
    monkeypatch.setattr(fastpath, "_LEARN_STRETCH", 2)
    monkeypatch.setattr(fastpath, "_LEARN_WARM", 0)
    st = fm.stats
    monkeypatch.setattr(fm, "_stretch", (st["harvest"], st["fast"] + st["slow"]))
    monkeypatch.setattr(fm, "_cuts_on", True)
    xs = bench.never_repeating("kimi-k2", 12, seed="cut-test")

    def run(batch):
        for x in batch:
            assert fmt.loss_mask(x, enc) == fmt.parse_ids(x, enc).mask()
        return st.get("resumed", 0), st.get("cut_skip", 0)

    r0 = st.get("resumed", 0)
    r1, k1 = run(xs[:4])
    assert r1 > r0  # (the first stretch learns them)
    r2, k2 = run(xs[4:8])
    assert r2 == r1 and k2 > k1  # every sample was a learning parse: off
    for _ in range(10):
        run(xs[:8])  # memoised: answered without a parse
    r3, _ = run(xs[8:])
    assert r3 > r2  # the memo answers most samples again: on


_K2_CALL = ("<|im_system|>system<|im_middle|>You are helpful.<|im_end|><|im_user|>user"
            "<|im_middle|>Find it.<|im_end|><|im_assistant|>assistant<|im_middle|>Sure."
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0"
            "<|tool_call_argument_begin|>{{\"q\": \"x\"}}<|tool_call_end|>"
            "<|tool_calls_section_end|><|im_end|><|im_system|>{name}<|im_middle|>found"
            "<|im_end|><|im_assistant|>assistant<|im_middle|>Done.<|im_end|>")


def test_headers_nothing_reads_are_keyed_by_their_length_class(monkeypatch):
    # K10b: kimi-k2's tool-call header (`functions.NAME:IDX`) and its turn headers are text
    # nothing reads (lexers.value_free_openers): samples that differ only in a tool name are
    # one item shape, served by the memo (no learning parse) with the reference's mask under
    # every policy, by the C executor and by the numpy one; a name longer than the header
    # budget is its own length class. Where a header's value does matter (kimi-k3: the role is
    # the XTML header's `role` attribute) the key still holds its ids.
    from tests.kimi_tokenizers import kimi_k2_encoding, kimi_k3_encoding

    enc = kimi_k2_encoding()
    fmt = cg.load_format("kimi-k2")
    fm = fmt._fast_masker(enc)
    code = fm.lexplan.lut[enc.encode_single_token("<|tool_call_begin|>") + 1]
    assert fm.vfree is not None and fm.vfree[code]
    names = ["a", "get_weather", "search_the_web_for_recent_news_articles_about_x",
             "n" * 300, "q" * 400]
    xs = [enc.encode(_K2_CALL.format(name=n), allowed_special="all") for n in names]
    want = _slow_masks(fmt, [(enc, x) for x in xs], POLICIES, True)
    for c_off in (False, True):
        fm.forget()
        if c_off:
            monkeypatch.setattr(fm, "plan", None)
        for k, policy in enumerate(POLICIES):
            for i, x in enumerate(xs):
                h = fm.stats["harvest"]
                assert _fast(fmt, x, enc, policy, True) == want[k, i], (c_off, k, i)
                if i not in (0, 3):  # (0: the first shape, 3: the first name over budget)
                    assert fm.stats["harvest"] == h, (c_off, k, i)
        assert fm.stats["harvest"] >= 1
    monkeypatch.undo()
    fm.forget()

    enc3 = kimi_k3_encoding()
    fmt3 = cg.load_format("kimi-k3")
    fm3 = fmt3._fast_masker(enc3)
    assert not fm3.lexplan.value_free.any() and fm3.vfree is None
    text = ('<|open|>message role="user"<|sep|>Q<|close|>message<|sep|><|end_of_msg|>'
            '<|open|>message role="{r}"<|sep|>A<|close|>message<|sep|><|end_of_msg|>')
    ys = [enc3.encode(text.format(r=r), allowed_special="all") for r in ("assistant", "user")]
    want3 = [fmt3.parse_ids(y, enc3).mask() for y in ys]
    assert want3[0] != want3[1]
    for y, w in zip(ys * 2, want3 * 2):
        assert fmt3.loss_mask(y, enc3) == w
    lexed = fm3._lex(np.asarray(ys[0], dtype=np.int64), [0, len(ys[0])])
    assert len(lexed[2]) > 0  # (the key's header ids)
