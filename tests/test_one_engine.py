"""Issue 12, "one engine": the id-lexing rules live in one plan (``lexers.IdPlan``) with one
builder of the symbol stream (``IdPlan.stream``), which the reference lexer (``IdLexer.lex``:
the stream, then ``IdPlan.tokens``) and the numpy pass (``FastMasker._symbols``: the stream,
then the memo's tables) both are; the C passes execute the same plan. The LALR rules live in
one core (``parse.LalrCore``), used by the driver and by the memo's automaton. The C executor
is run against the builder here on every bundled format's id fixtures (the renders of
tests/test_fastpath.py's ``_samples``: whole and cut, soft markers as ids and as ordinary
text), and the builder over a packed batch against itself on each sample alone, with and
without the C accelerator.
"""
from __future__ import annotations

import numpy as np
import pytest

import chatgrammar as cg
from chatgrammar.errors import VerifyError
from chatgrammar.runtime import fastpath
from chatgrammar.runtime.parse import LalrCore
from tests.test_fastpath import _samples


def _check(fm, batch) -> int:
    """verify_lex on each sample alone and on the batch packed (the multi-sample tables);
    the number of samples an executor of the plan lexed (not handed back)."""
    checked = 0
    for ids in batch:
        arr = np.asarray(ids, dtype=np.int64)
        checked += fm.verify_lex(arr, [0, len(arr)], 0, fm._lex(arr, [0, len(arr)]))
    mixed = [[], *batch[:8], []]
    arr = np.asarray([x for ids in mixed for x in ids], dtype=np.int64)
    starts = [0]
    for ids in mixed:
        starts.append(starts[-1] + len(ids))
    lexed = fm._lex(arr, starts)
    for j in range(len(mixed)):
        fm.verify_lex(arr, starts, j, lexed)
    return checked


@pytest.mark.parametrize("name", cg.list_formats())
def test_plan_executors_agree_on_every_format(name, monkeypatch):
    fmt = cg.load_format(name)
    by_enc: dict = {}
    for enc, ids in _samples(fmt):
        by_enc.setdefault(id(enc), (enc, []))[1].append(ids)
    checked, soft = 0, False
    for enc, batch in by_enc.values():
        fm = fmt._fast_masker(enc)
        soft |= fm.soft_lut is not None
        # the C passes (marker search, symbols), then numpy alone; also where the memo is
        # off (trim_end): the lexing is the same
        for accel in ([fastpath._speedups, None] if fastpath._speedups else [None]):
            monkeypatch.setattr(fastpath, "_speedups", accel)
            checked += _check(fm, batch)
    # the executors lex some fixture of every format, unless its soft markers are ordinary
    # text to this tokenizer (falcon's `User:`): a sample that may spell one is handed back
    assert checked or soft or not by_enc


def test_verify_lex_catches_a_plan_executor_that_disagrees():
    fmt = cg.load_format("chatml")
    enc, ids = next(iter(_samples(fmt)))
    fm = fmt._fast_masker(enc)
    arr = np.asarray(ids, dtype=np.int64)
    symb, *rest = fm._lex(arr, [0, len(arr)])
    syms = np.frombuffer(symb, dtype=np.uint16).copy()
    syms[1] ^= 1  # a run the reference has, dropped (or one it lacks, added)
    with pytest.raises(VerifyError):
        fm.verify_lex(arr, [0, len(arr)], 0, (syms.tobytes(), *rest))


def test_verify_lex_catches_an_executor_whose_key_ids_differ():
    # the tables' item-key words and header ids are compared with the builder's, not only
    # the symbols: an executor that read another header id is caught
    fmt = cg.load_format("kimi-k2")
    enc, ids = next(iter(_samples(fmt)))
    fm = fmt._fast_masker(enc)
    arr = np.asarray(ids, dtype=np.int64)
    lexed = fm._lex(arr, [0, len(arr)])
    assert fm.verify_lex(arr, [0, len(arr)], 0, lexed) and lexed[2]
    vals = np.frombuffer(lexed[2], dtype=np.int64).copy()
    vals[0] += 1
    with pytest.raises(VerifyError):
        fm.verify_lex(arr, [0, len(arr)], 0, (*lexed[:2], vals.tobytes(), *lexed[3:]))


@pytest.mark.parametrize("name", ["chatml", "zephyr", "falcon", "chatglm2"])
def test_the_reference_lexer_is_the_stream_builder(name, monkeypatch):
    # IdLexer.lex builds its tokens from IdPlan.stream, nothing else; over a packed batch the
    # builder gives each sample the stream it gives it alone (the soft markers it inserts
    # included: the second encoding spells them as ordinary text)
    from chatgrammar.runtime import lexers

    fmt = cg.load_format(name)
    by_enc: dict = {}
    for enc, ids in _samples(fmt):
        by_enc.setdefault(id(enc), (enc, []))[1].append(ids)
    calls = []
    real = lexers.IdPlan.stream
    monkeypatch.setattr(lexers.IdPlan, "stream",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    for enc, batch in by_enc.values():
        lx = fmt.id_lexer(enc)
        plan = lx.plan
        arrs = [np.asarray(ids, dtype=np.int64) for ids in batch]
        alone = [lx.stream(a, []) for a in arrs]
        assert [lx.lex(a, []) for a in arrs] == [plan.tokens(a, st) for a, st in
                                                 zip(arrs, alone)]
        assert len(calls) == 2 * len(batch)
        arr = np.concatenate(arrs)
        starts = [0]
        for a in arrs:
            starts.append(starts[-1] + len(a))
        st = plan.stream(arr, starts, *plan.find(arr, *plan.marker_range))
        ends = [*st.bidx.tolist(), len(st.K)]
        for j, want in enumerate(alone):
            b0, b1, s0 = ends[j], ends[j + 1], starts[j]
            assert (st.P[b0:b1 + 1] - s0).tolist() == want.P.tolist(), (name, j)
            for f in ("K", "mend", "hend", "cls", "sst"):
                got, exp = getattr(st, f), getattr(want, f)
                if f in ("mend", "hend"):
                    got = got - s0
                assert (exp is None) == (got is None) and \
                    (exp is None or got[b0:b1].tolist() == exp.tolist()), (name, j, f)
        del calls[:]


def test_one_lalr_core_per_format():
    fmt = cg.load_format("kimi-k3")
    drv = fmt._driver
    assert isinstance(drv.core, LalrCore)
    enc = next(iter(_samples(fmt)))[0]
    assert fmt._fast_masker(enc).auto.core is drv.core
    assert drv._can_feed == drv.core.can_feed


@pytest.mark.parametrize("accel", [True, False])
def test_verify_mode_checks_the_lexing_of_every_fast_answer(accel, monkeypatch):
    if accel and fastpath._speedups is None:
        pytest.skip("accelerator not built")
    if not accel:
        monkeypatch.setattr(fastpath, "_speedups", None)
    fmt = cg.load_format("chatml")
    samples = _samples(fmt)[:6]
    for enc, ids in samples:  # the memo learns them (no verify mode yet)
        fmt.loss_mask(ids, enc)
    monkeypatch.setenv("CHATGRAMMAR_VERIFY", "1")
    calls = []
    real = fastpath.FastMasker.verify_lex
    monkeypatch.setattr(fastpath.FastMasker, "verify_lex",
                        lambda self, *a: calls.append(1) or real(self, *a))
    for enc, ids in samples:
        fmt.loss_mask(ids, enc)
        fmt.loss_masks([ids, ids], enc)
    assert calls
    # a lexing executor that disagrees with the builder is an error in verify mode (C or
    # numpy: its symbols against the reference tokens read from the builder's stream)
    monkeypatch.setattr(fastpath.FastMasker, "_same_tokens", lambda self, *a: False)
    with pytest.raises(VerifyError):
        for enc, ids in samples:
            fmt.loss_mask(ids, enc)
