"""The optional C accelerator (chatgrammar/runtime/_speedups.c) against the numpy / struct code it
replaces: unit properties of each pass, and whole masks with and without it on real renders."""
from __future__ import annotations

import functools
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chatgrammar as cg
from chatgrammar.runtime import fastpath
from tests.fuzz_tokenizers import format_encoding
from tests.test_fastpath import POLICIES, _bench, _samples, _slow_masks

S = fastpath._speedups
needs_c = pytest.mark.skipif(S is None, reason="accelerator disabled (CHATGRAMMAR_PURE)")
I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def test_accelerator_is_built():
    # setup.py marks the extension optional, so a broken build would pass silently and only
    # show up as a slower loss_mask. A machine that cannot build it says so explicitly.
    if os.environ.get("CHATGRAMMAR_PURE"):
        pytest.skip("CHATGRAMMAR_PURE is set")
    assert S is not None, ("chatgrammar.runtime._speedups did not build (needs a C compiler and the "
                           "Python headers); set CHATGRAMMAR_PURE=1 to run without it")


def test_pure_env_disables_it():
    code = "import chatgrammar.runtime.fastpath as f; print(f._speedups is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "CHATGRAMMAR_PURE": "1"}, check=True)
    assert out.stdout.strip() == "True"


# ----------------------------------------------------------------------------- pack_many

@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(I64, max_size=40), max_size=6))
def test_pack_many_is_native_int64(lists):
    total = sum(map(len, lists))
    got = np.frombuffer(S.pack_many(lists, total), dtype=np.int64)
    want = struct.pack(f"{total}q", *[x for lst in lists for x in lst])
    assert got.tobytes() == want


@needs_c
def test_pack_many_refuses_what_the_general_conversion_must_handle():
    with pytest.raises(OverflowError):
        S.pack_many([[1, 2**63]], 2)
    for bad in ([[1, True]], [[1, np.int64(2)]], [[1, 2.0]], [(1, 2)]):
        with pytest.raises(TypeError):
            S.pack_many(bad, 2)
    with pytest.raises(ValueError):
        S.pack_many([[1, 2]], 3)
    with pytest.raises(ValueError):
        S.pack_many([[1, 2]], 1)
    buf = bytearray(32)
    assert S.pack_many([[7, -8]], 2, buf) is buf and buf[:16] == struct.pack("2q", 7, -8)
    with pytest.raises(ValueError):  # too small
        S.pack_many([[1, 2, 3, 4, 5]], 5, buf)
    with pytest.raises(ValueError):  # not a bytearray
        S.pack_many([[1]], 1, b"\0" * 8)


@needs_c
def test_lists_the_accelerator_refuses_still_give_the_general_result():
    # ids_input falls back to as_id_array: bools / numpy ints are ints, huge ints are clipped
    for ids in ([1, True, 3], [1, np.int64(2), 3], [1, 2**70, -2**70]):
        arr, _ = fastpath.ids_input(ids)
        assert arr.dtype == np.int64
        assert arr.tolist() == [min(max(int(x), -2**63), 2**63 - 1) for x in ids]
    arr = fastpath._pack_many([[1, 2], [True, 7], [2**70]], [2, 2, 1])
    assert arr.tolist() == [1, 2, 1, 7, 2**63 - 1]


# ----------------------------------------------------------------------------- find_markers

def _numpy_markers(arr, lo, lut):
    span = len(lut) - 1
    d = arr.astype(object) - lo
    ok = np.array([0 <= x < span for x in d.tolist()], dtype=bool)
    pos = np.flatnonzero(ok)
    codes = lut[(arr[pos] - lo)] if len(pos) else np.empty(0, np.int64)
    keep = codes != 0
    return pos[keep].tolist(), codes[keep].tolist()


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-5, 40) | I64, max_size=200), st.integers(-3, 30),
       st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_find_markers_matches_numpy(ids, lo, lut):
    arr = np.asarray(ids, dtype=np.int64)
    lut_a = np.asarray([*lut, 0], dtype=np.int64)  # the last slot is the "above" 0
    pos, codes = S.find_markers(arr, lo, lut_a)
    assert (np.frombuffer(pos, np.int64).tolist(),
            np.frombuffer(codes, np.int64).tolist()) == _numpy_markers(arr, lo, lut_a)


@needs_c
def test_find_markers_wants_int64():
    with pytest.raises(TypeError):
        S.find_markers(np.zeros(3, np.int32), 0, np.zeros(2, np.int64))
    with pytest.raises(TypeError):
        S.find_markers(np.zeros(3, np.int64), 0, np.zeros(2, np.float64))


# ----------------------------------------------------------------------------- mask_list

@needs_c
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 60).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted)
                         .map(lambda ab: (ab[0], ab[1], 0)), max_size=5))))
def test_mask_list(case):
    n, spans = case
    want = [0] * n
    for a, b, _ in spans:
        want[a:b] = [1] * (b - a)
    got = S.mask_list(n, spans)
    assert got == want and all(type(x) is int for x in got)


@needs_c
def test_mask_list_checks_spans():
    with pytest.raises(ValueError):
        S.mask_list(3, [(2, 4, 0)])
    with pytest.raises(ValueError):
        S.mask_list(3, [(2, 1, 0)])
    with pytest.raises(TypeError):
        S.mask_list(3, [[0, 1]])


# ----------------------------------------------------------------------------- whole masks

def _masks(fmt, samples, policy, monkeypatch, pure: bool):
    monkeypatch.setattr(fastpath, "_speedups", None if pure else S)
    out = []
    for enc, ids in samples:
        try:
            out.append(fmt.loss_mask(ids, enc, policy=policy, strict=False))
        except cg.ParseError:
            out.append(cg.ParseError)
    by_enc: dict = {}
    for enc, ids in samples:
        by_enc.setdefault(id(enc), (enc, []))[1].append(ids)
    batches = [fmt.loss_masks(b, enc, policy=policy, strict=False) for enc, b in by_enc.values()]
    return out, batches


@needs_c
@pytest.mark.parametrize("name", ["kimi-k2", "kimi-k3", "chatml", "harmony", "llama3"])
def test_masks_are_the_same_with_and_without_it(name, monkeypatch):
    fmt = cg.load_format(name)
    samples = _samples(fmt)
    slow = _slow_masks(fmt, samples, POLICIES[:2], False)  # one lenient parse per sample
    for k, policy in enumerate(POLICIES[:2]):
        for _ in range(2):  # the second round is served by the memo
            c = _masks(fmt, samples, policy, monkeypatch, pure=False)
            p = _masks(fmt, samples, policy, monkeypatch, pure=True)
            assert c == p
            # and both are the full pipeline's mask
            assert c[0] == [slow[k, i] for i in range(len(samples))]


@needs_c
@pytest.mark.parametrize("version", ["kimi-k2", "kimi-k3"])
def test_benchmark_workload_same_with_and_without_it(version, monkeypatch):
    bench = _bench()
    _texts, ids = bench.workload(version, 16, seed=3)
    enc = bench.kimi_encoding(version)
    fmt = cg.load_format(version)
    with_c = [fmt.loss_mask(x, enc) for x in ids]
    monkeypatch.setattr(fastpath, "_speedups", None)
    assert with_c == [fmt.loss_mask(x, enc) for x in ids] == fmt.loss_masks(ids, enc)


@needs_c
@pytest.mark.parametrize("pure", [False, True])
def test_marker_pass_is_the_same_from_id_0_and_ignores_negative_ids(pure, monkeypatch):
    # Widening the marker range down to id 0 (as a tokenizer whose marker is id 0 has it) must
    # not change the lexing, and negative ids are never markers (the full lexer's slot 0).
    fmt = cg.load_format("chatml")
    enc = format_encoding(fmt)
    samples = [ids for e, ids in _samples(fmt) if e is not None][:6]
    monkeypatch.setattr(fastpath, "_speedups", None if pure else S)
    fm = fmt._fast_masker(enc)
    for ids in samples:
        arr = np.asarray([-1, *ids, -(2**63), -5], dtype=np.int64)
        want = fm._lex(arr, [0, len(arr)])
        lo, lutr = fm.lo, fm.lutr
        try:
            fm.lo, fm.lutr = 0, np.concatenate([np.zeros(lo, np.int64), lutr])
            got = fm._lex(arr, [0, len(arr)])
        finally:
            fm.lo, fm.lutr = lo, lutr
        assert got == want


# ----------------------------------------------------------------------------- symbols

def _lex_both(fm, arr, starts, monkeypatch):
    monkeypatch.setattr(fastpath, "_speedups", S)
    c = fm._lex(arr, starts)
    monkeypatch.setattr(fastpath, "_speedups", None)
    p = fm._lex(arr, starts)
    monkeypatch.setattr(fastpath, "_speedups", S)
    return c, p


def _c_lexable():
    out = []
    for name in cg.list_formats():
        fmt = cg.load_format(name)
        enc = format_encoding(fmt)
        fm = fmt._fast_masker(enc)
        if fm.enabled and not fm.has_split and fm.lstrip_code is None and fm.hi >= 0:
            out.append(name)
    return out


def _c_lexable_shared() -> list[str]:
    """:func:`_c_lexable`, computed once per source state and shared through a file.

    It builds a tokenizer and a fast masker for every format (~8 CPU-s), at import, so every
    xdist worker paid it at collection although only one runs this file (issue 14). The
    answer is kept under .pytest_cache, keyed by a hash of everything it depends on (the
    package's sources, the formats, the test tokenizers and their ranks file, tiktoken's
    version, CHATGRAMMAR_PURE);
    a lock makes a second worker wait for the first one's answer instead of recomputing it.
    Any change to those inputs computes it afresh, so the ids collected are what
    :func:`_c_lexable` says now.
    """
    import fcntl
    import hashlib
    import importlib.metadata
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    files = sorted([*(root / "chatgrammar").rglob("*.py"), *(root / "formats").glob("*.yaml"),
                    root / "tests" / "fuzz_tokenizers.py", Path(__file__).resolve()])
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    from tests.fuzz_tokenizers import QWEN_TIKTOKEN  # the ranks: by size and mtime
    ranks = os.stat(QWEN_TIKTOKEN)
    h.update(f"{sys.version}|{importlib.metadata.version('tiktoken')}|"
             f"{ranks.st_size}|{ranks.st_mtime_ns}|"
             f"{os.environ.get('CHATGRAMMAR_PURE', '')}".encode())
    cache = root / ".pytest_cache" / "chatgrammar"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / "c_lexable.lock", "a+")
    except OSError:  # a read-only checkout: just compute it
        return _c_lexable()
    path = cache / f"c_lexable-{h.hexdigest()[:20]}.json"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
        out = _c_lexable()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out), encoding="utf-8")
        os.replace(tmp, path)
        return out


C_LEXABLE = _c_lexable_shared()


def test_the_c_symbol_pass_serves_the_kimi_formats():
    assert {"kimi-k2", "kimi-k3"} <= set(C_LEXABLE)


@needs_c
@pytest.mark.parametrize("name", C_LEXABLE)
def test_symbol_tables_are_the_same_from_c_and_numpy(name, monkeypatch):
    fmt = cg.load_format(name)
    samples = [(enc, ids) for enc, ids in _samples(fmt)]
    by_enc: dict = {}
    for enc, ids in samples:
        by_enc.setdefault(id(enc), (enc, []))[1].append(ids)
    for enc, batch in by_enc.values():
        fm = fmt._fast_masker(enc)
        for ids in batch:
            arr = np.asarray(ids, dtype=np.int64)
            c, p = _lex_both(fm, arr, [0, len(arr)], monkeypatch)
            assert c == p
        # a batch with empty samples and marker-only samples mixed in
        mixed = [[], *batch[:8], [], [batch[0][0]] if batch[0] else []]
        arr = np.asarray([x for ids in mixed for x in ids], dtype=np.int64)
        starts = [0]
        for ids in mixed:
            starts.append(starts[-1] + len(ids))
        c, p = _lex_both(fm, arr, starts, monkeypatch)
        assert c == p


@functools.lru_cache(maxsize=None)
def _k3_masker():
    enc = _bench().kimi_encoding("kimi-k3")
    return cg.load_format("kimi-k3")._fast_masker(enc)


@needs_c
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_symbol_tables_on_random_id_streams(data):
    fm = _k3_masker()
    markers = [int(t) - 1 for t in np.flatnonzero(fm.lut)]
    ids = data.draw(st.lists(st.sampled_from(markers) | st.integers(0, 200_000), max_size=80))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=4)))
    starts = [0, *cuts, len(ids)]
    arr = np.asarray(ids, dtype=np.int64)
    with pytest.MonkeyPatch.context() as mp:
        c, p = _lex_both(fm, arr, starts, mp)
    assert c == p


@needs_c
def test_symbols_checks_its_inputs():
    # (the batch `symbols` pass, a second merge in C, is gone: C's one merge is run's pass 1,
    # which `lex` exposes) its plan is checked: not a tuple, tables of different lengths, a
    # gap class the plan has not, ids that are no int64 buffer
    fm = _k3_masker()
    plan, x = fm.plan, [1, 2, 3]
    assert S.lex(plan, x) is not None
    with pytest.raises(TypeError):
        S.lex(list(plan), x)
    with pytest.raises(ValueError):  # a budget table shorter than the gap classes
        S.lex((*plan[:3], plan[3][:-8], *plan[4:]), x)
    with pytest.raises(ValueError):
        S.lex((*plan[:2], np.full(len(fm.gclass), 7, np.int64).tobytes(), *plan[3:]), x)
    with pytest.raises(TypeError):
        S.lex(plan, np.zeros(3, dtype=np.float64))


# ----------------------------------------------------------------------------- scratch buffer

@needs_c
def test_long_inputs_reuse_a_per_thread_buffer_without_mixing_samples(monkeypatch):
    # inputs of at least _SCRATCH_MIN ids are packed into one buffer kept per thread; a call
    # must never see another call's ids, in sequence or from concurrent threads
    import threading

    monkeypatch.setattr(fastpath, "_SCRATCH_MIN", 64)
    bench = _bench()
    _texts, ids = bench.workload("kimi-k2", 8, seed=11)
    enc = bench.kimi_encoding("kimi-k2")
    fmt = cg.load_format("kimi-k2")
    want = [fmt.parse_ids(x, enc).mask() for x in ids]
    long_ = [x for x in ids if len(x) >= 64]
    assert len(long_) >= 4
    assert [fmt.loss_mask(x, enc) for x in ids] == want
    assert fmt.loss_masks(ids, enc) == want
    monkeypatch.setattr(fastpath, "_BATCH_TOKENS", 500)  # many groups, one buffer
    assert fmt.loss_masks(ids, enc) == want
    # a batch mixing lists and arrays converts each list on its own: no two may share a buffer
    mixed = [x if i % 3 else np.asarray(x) for i, x in enumerate(ids)]
    monkeypatch.setattr(fastpath, "_BATCH_TOKENS", 1 << 30)
    got = fmt.loss_masks(mixed, enc)
    assert [g if type(g) is list else g.tolist() for g in got] == want
    errors: list = []

    def worker(order):
        try:
            for _ in range(20):
                for i in order:
                    if fmt.loss_mask(ids[i], enc) != want[i]:
                        errors.append(i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(o,)) for o in
               (range(len(ids)), range(len(ids) - 1, -1, -1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ----------------------------------------------------------------------------- run (executor)

def _classes(version: str, ids: list[list[int]]):
    """The bench's input classes made from ``ids``: (name, inputs, loss_mask kwargs)."""
    pack = [[t for x in ids[i:i + 4] for t in x] for i in range(0, len(ids), 4)]
    return [("whole", ids, {}), ("truncated", [x[:300] for x in ids], {}),
            ("last_turn_only", ids, {"policy": cg.MaskPolicy(last_turn_only=True)}),
            ("lenient", ids, {"strict": False}), ("packed", pack, {}),
            ("numpy", [np.asarray(x, dtype=np.int64) for x in ids], {}),
            ("policy", ids, {"policy": POLICIES[2]})]


@needs_c
@pytest.mark.parametrize("version", ["kimi-k2", "kimi-k3"])
def test_the_c_executor_equals_the_reference_on_every_input_class(version):
    # Two passes over fresh data (the first teaches the memo, mostly through the Python engine
    # and windows; the second is the C executor's): every answer is the full pipeline's.
    bench = _bench()
    enc = bench.kimi_encoding(version)
    fmt = cg.load_format(version)
    _texts, ids = bench.workload(version, 24, seed=11)
    fm = fmt._fast_masker(enc)
    parsed: dict = {}  # the reference parse of each distinct input and strictness, once

    def reference(x, strict, policy):
        key = (np.asarray(x, dtype=np.int64).tobytes(), strict)
        if key not in parsed:
            parsed[key] = fmt.parse_ids(x, enc, strict=strict)
        return parsed[key].mask(policy)

    for _ in range(2):
        before = fm.stats["c"]
        for cls, xs, kw in _classes(version, ids):
            for x in xs:
                got = fmt.loss_mask(x, enc, **kw)
                if cls == "numpy":
                    assert isinstance(got, np.ndarray) and got.dtype == np.int64
                    got = got.tolist()
                assert len(got) == len(x)
                want = reference(x, kw.get("strict", True), kw.get("policy"))
                assert got == want, (version, cls)
    assert fm.stats["c"] - before >= sum(len(xs) for _, xs, _ in _classes(version, ids)) // 2
    assert fmt.stats()["ids"]["c"] >= fm.stats["c"]  # (summed over its tokenizers)


def _k2_run(n: int, seed: int):
    """kimi-k2, its bench tokenizer, ``n`` bench samples, and the C memo of its default
    policy: ``(fmt, enc, ids, masker, hit)`` (``hit``: what ``_speedups.run`` takes)."""
    bench = _bench()
    enc = bench.kimi_encoding("kimi-k2")
    fmt = cg.load_format("kimi-k2")
    _texts, ids = bench.workload("kimi-k2", n, seed=seed)
    fm = fmt._fast_masker(enc)
    return fmt, enc, ids, fm, fm._c_policy(fmt.default_policy)


@needs_c
def test_the_c_executor_hands_back_what_it_does_not_memoise():
    fmt, enc, ids, fm, hit = _k2_run(4, 12)
    for x in ids:
        fmt.loss_mask(x, enc)
    x = ids[0]
    assert S.run(fm.plan, x, hit[1], hit[2], None) == fmt.parse_ids(x, enc).mask()
    # ids it does not read itself (not an exact int): the general conversion decides
    assert S.run(fm.plan, [*x[:-1], np.int64(x[-1])], hit[1], hit[2], None) is None
    assert S.run(fm.plan, [*x[:-1], 2**70], hit[1], hit[2], None) is None
    # an empty memo: the keys of the items it lacks
    missing = S.run(fm.plan, x, {}, False, None)
    assert type(missing) is tuple and missing
    assert all(type(k) is bytes and 0 <= w0 <= a < w1 <= len(x) for k, w0, w1, a in missing)
    assert all(k in fm.items for k, _, _, _ in missing)
    # a syntax error (an end marker first): never an answer. The walk first asks for the
    # automaton entries it lacks (the configuration, then the symbols from there: bytes);
    # once they are filled (a syntax error there), the Python engine takes the sample.
    bad = [163586, *x]
    need = S.run(fm.plan, bad, hit[1], hit[2], None)
    assert type(need) is bytes and int.from_bytes(need[:8], sys.byteorder) == 0
    assert fm._c_auto(need) is False
    assert S.run(fm.plan, bad, hit[1], hit[2], None) is None
    with pytest.raises(cg.ParseError):
        fmt.loss_mask([163586, *x], enc)
    assert fmt.loss_mask([163586, *x], enc, strict=False) == \
        fmt.parse_ids([163586, *x], enc, strict=False).mask()
    # numpy in needs an output buffer of the same length
    with pytest.raises(ValueError):
        S.run(fm.plan, np.asarray(x, dtype=np.int64), hit[1], False, None)
    assert fmt.loss_mask([], enc) == [] and fmt.loss_mask([], enc) == []


@needs_c
def test_a_retry_resumes_the_sample_handed_back_and_only_that_one():
    fmt, enc, ids, fm, hit = _k2_run(6, 13)
    for x in ids[:4]:
        fmt.loss_mask(x, enc)
    x, y = ids[0], ids[1]
    want_x, want_y = fmt.parse_ids(x, enc).mask(), fmt.parse_ids(y, enc).mask()
    # handed back (an empty memo), then resumed on the same object: the symbol tables C kept
    missing = S.run(fm.plan, x, {}, False, None)
    assert type(missing) is tuple
    assert S.run(fm.plan, x, hit[1], hit[2], None, False, True) == want_x
    # after an answer nothing is kept: `resume` on the same object reads it afresh
    assert S.run(fm.plan, x, hit[1], hit[2], None, False, True) == want_x
    # another sample (or the same one changed in length) is never resumed from x's tables
    assert type(S.run(fm.plan, x, {}, False, None)) is tuple
    assert S.run(fm.plan, y, hit[1], hit[2], None, False, True) == want_y
    assert type(S.run(fm.plan, x, {}, False, None)) is tuple
    # nor from tables read with another plan (another format's engine on the same list)
    f3 = cg.load_format("kimi-k3")
    fm3 = f3._fast_masker(enc)
    h3 = fm3._c_policy(f3.default_policy)
    assert type(S.run(fm.plan, x, {}, False, None)) is tuple
    fresh = S.run(fm3.plan, x, h3[1], h3[2], None)
    assert type(S.run(fm.plan, x, {}, False, None)) is tuple
    assert S.run(fm3.plan, x, h3[1], h3[2], None, False, True) == fresh
    x2 = [*x, *y]  # (learned first: two samples back to back meet new configurations)
    want2 = fmt.loss_mask(x2, enc)
    assert want2 == fmt.parse_ids(x2, enc).mask()
    assert type(S.run(fm.plan, x, {}, False, None)) is tuple
    assert S.run(fm.plan, x2, hit[1], hit[2], None, False, True) == want2
    # numpy in, resumed into the same output buffer
    a = np.asarray(x, dtype=np.int64)
    out = np.zeros(len(a), dtype=np.int64)
    assert type(S.run(fm.plan, a, {}, False, out)) is tuple
    assert S.run(fm.plan, a, hit[1], hit[2], out, False, True) is True
    assert out.tolist() == want_x
    # a long sample with new items learns them and is answered (through the resumed retries)
    big = [t for z in ids for t in z]
    assert fmt.loss_mask(big[:len(big) - 7], enc) == fmt.parse_ids(big[:len(big) - 7],
                                                                   enc).mask()


@needs_c
@pytest.mark.parametrize("name", ["chatml", "llama2", "mistral", "deepseek-v3", "gemma",
                                  "internlm2"])
def test_the_c_executor_runs_literal_ended_headers_and_lstrip(name):
    """Formats whose lexing plan has literal-ended headers (`until_text`) or `lstrip` markers
    run on the C executor too (it reads the memos of those two rules, which the Python
    engine fills), and give the reference mask, cut samples included."""
    fmt = cg.load_format(name)
    samples = _samples(fmt)
    assert samples
    for enc, _ in samples[:1]:
        fm = fmt._fast_masker(enc)
        assert fm.plan is not None
        assert fm.has_split or fm.lstrip_code is not None
    inputs = [(enc, ids[:k]) for enc, ids in samples for k in {len(ids), len(ids) // 2,
                                                               len(ids) - 1} if k > 0]
    c0 = sum(fmt._fast_masker(enc).stats["c"] for enc, _ in samples[:1])
    for _ in range(2):  # the second round is served by the C executor's memo
        for enc, ids in inputs:
            try:
                want = fmt.parse_ids(ids, enc, strict=False).mask()
            except cg.ParseError:
                continue
            assert fmt.loss_mask(ids, enc, strict=False) == want, name
            arr = np.asarray(ids, dtype=np.int64)
            assert fmt.loss_mask(arr, enc, strict=False).tolist() == want, name
    assert sum(fmt._fast_masker(enc).stats["c"] for enc, _ in samples[:1]) > c0, name


@needs_c
def test_cpu_torch_tensors_take_the_c_executor():
    torch = pytest.importorskip("torch")
    bench = _bench()
    enc = bench.kimi_encoding("kimi-k2")
    fmt = cg.load_format("kimi-k2")
    _texts, ids = bench.workload("kimi-k2", 4, seed=21)
    fm = fmt._fast_masker(enc)
    for x in ids:
        fmt.loss_mask(x, enc)
    before = fm.stats["c"]
    for x in ids:
        for t in (torch.tensor(x), torch.tensor(x, dtype=torch.int32)):
            got = fmt.loss_mask(t, enc)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.long
            assert got.tolist() == fmt.parse_ids(x, enc).mask()
    assert fm.stats["c"] - before == 2 * len(ids)
    # a strided (non-contiguous) tensor is read through a copy: same answer
    t = torch.stack([torch.tensor(ids[0]), torch.tensor(ids[0])], dim=1)[:, 0]
    assert not t.is_contiguous()
    assert fmt.loss_mask(t, enc).tolist() == fmt.parse_ids(ids[0], enc).mask()


def test_cut_headers_share_an_item_by_what_the_parse_reads():
    """A sample cut inside an XTML header (kimi-k3) is memoised under what the parse reads
    of that header (Driver.cut_header_reading): a cut at another id of the same kind of
    header is served without a parse, and every answer is the reference's."""
    bench = _bench()
    enc = bench.kimi_encoding("kimi-k3")
    fmt = cg.load_format("kimi-k3")
    assert fmt._driver.cut_header_terms == {"M_OPEN": "open", "M_CLOSE": "close"}
    assert fmt._driver.cut_header_openers == {"M_OPEN"}
    _texts, ids = bench.workload("kimi-k3", 8, seed=22)
    policies = [None, cg.MaskPolicy(thinking=False), cg.MaskPolicy(truncated=False),
                cg.MaskPolicy(last_turn_only=True)]
    for x in ids:
        for k in range(1, min(len(x), 700)):
            conv = None  # the reference: one parse per cut, every policy's mask from it
            for pol in policies:
                got = fmt.loss_mask(x[:k], enc, policy=pol)
                conv = fmt.parse_ids(x[:k], enc) if conv is None else conv
                assert got == conv.mask(pol), (k, pol)
    assert fmt.stats()["ids"]["alias"] > 0
    # formats whose headers are read otherwise never share cut items this way
    for name in ("kimi-k2", "chatml", "llama3", "harmony"):
        assert cg.load_format(name)._driver.cut_header_terms == {}


@needs_c
@pytest.mark.long
@pytest.mark.parametrize("name", ["kimi-k3", "chatml", "llama2"])
def test_verify_mode_checks_the_new_c_paths(name, monkeypatch):
    """CHATGRAMMAR_VERIFY=1 checks every answer of the C executor against the full pipeline:
    cut samples (kimi-k3's cut headers served through their reading), literal-ended headers
    and lstrip markers (chatml, llama2) included.

    Budget (issue 14, marker ``long``): each sample is cut at about 20 evenly spaced points in
    the default run; the longer run (``CHATGRAMMAR_LONG=1``, or ``--runslow``)
    cuts it at about 60 (the budget before; every verified answer is a full parse)."""
    from tests.fuzz_tokenizers import long_run

    points = 60 if long_run() else 20
    monkeypatch.setenv("CHATGRAMMAR_VERIFY", "1")
    if name == "kimi-k3":
        bench = _bench()
        enc = bench.kimi_encoding(name)
        _texts, ids = bench.workload(name, 4, seed=23)
        samples = [(enc, x) for x in ids]
    else:
        samples = _samples(cg.load_format(name))
    fmt = cg.load_format(name)
    for _ in range(2):
        for enc, x in samples:
            for k in range(1, len(x) + 1, max(1, len(x) // points)):
                try:
                    fmt.loss_mask(x[:k], enc, strict=False)  # raises VerifyError on a difference
                except cg.ParseError:  # pragma: no cover - lenient mode never raises
                    raise
    st = fmt.stats()["ids"]
    assert st["verified"] > 0 and st["c"] > 0


@needs_c
def test_the_c_executor_asks_about_a_generation_prompt_only_when_the_tail_fits_in_one():
    # The last turn may be a generation prompt only when its markers are in one and it is no
    # longer (tiktoken: every other id adds at least one byte); else the C executor answers
    # without asking the driver. Both answers equal the reference.
    fmt, enc, ids, fm, hit = _k2_run(3, 13)
    gp = enc.encode("<|im_assistant|>assistant<|im_middle|>", allowed_special="all")
    x = ids[0]
    short, long_ = x + gp, x + gp + enc.encode(" word" * 30)
    for _ in range(2):
        for y in (x, short, long_):
            assert fmt.loss_mask(y, enc) == fmt.parse_ids(y, enc).mask()
    r = S.run(fm.plan, short, hit[1], hit[2], None)
    assert type(r) is tuple and r[0] == len(x)  # the driver's rule decides (it is one)
    assert type(S.run(fm.plan, long_, hit[1], hit[2], None)) is list
    assert sum(fmt.loss_mask(short, enc)[len(x):]) == 0
    assert sum(fmt.loss_mask(long_, enc)[len(short):]) == 30
