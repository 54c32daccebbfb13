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
from chatgrammar.runtime.lexers import LSTRIP_MAX
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
    # the symbols: an executor that read another header id is caught (chatml: its role is
    # read from the header, so the key holds the header's ids; kimi-k2's headers are keyed
    # by their length class, lexers.value_free_openers)
    fmt = cg.load_format("chatml")
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


# ---------------------------------------------------------------- K10: C's one merge

def _c_check(fm, batch) -> int:
    """The C executor's own pass 1 (``_speedups.lex``: the plan's steps in C) through
    verify_lex on each sample alone and on the batch packed into one sequence, and equal to
    the numpy executor's tables wherever both take the sample; how many C took."""
    took = 0
    packed = [x for ids in batch[:8] for x in ids]
    for ids in [*batch, packed]:
        arr = np.asarray(ids, dtype=np.int64)
        for given in (list(ids), arr):  # (C reads a list and an int64 buffer alike)
            c = fm.c_lex(given)
            if c is None:
                continue
            took += 1
            assert fm.verify_lex(arr, [0, len(arr)], 0, c)
            p = fm._lex(arr, [0, len(arr)])
            if not p[-1][0]:
                assert c[:5] == p[:5]
    return took


@pytest.mark.skipif(fastpath._speedups is None, reason="accelerator not built")
@pytest.mark.parametrize("name", cg.list_formats())
def test_the_c_merge_is_the_builder_on_every_format(name):
    # C's pass 1 is the plan's one merge executed in C: for every bundled format's id
    # fixtures (whole, cut; alone and packed), after the memo learned them (C reads the
    # split and lstrip memos the Python engine fills), its tables are the builder's
    fmt = cg.load_format(name)
    by_enc: dict = {}
    for enc, ids in _samples(fmt):
        by_enc.setdefault(id(enc), (enc, []))[1].append(ids)
    took, soft = 0, False
    for enc, batch in by_enc.values():
        fm = fmt._fast_masker(enc)
        soft |= fm.soft_lut is not None
        if fm.plan is None:
            continue
        for ids in batch:
            fmt.loss_mask(ids, enc, strict=False)
        fmt.loss_mask([x for ids in batch[:8] for x in ids], enc, strict=False)
        took += _c_check(fm, batch)
    enabled = any(fmt._fast_masker(enc).plan is not None for enc, _ in by_enc.values())
    assert took or soft or not enabled


def test_no_second_merge_in_c():
    # the batch symbol pass (`symbols`, a second writing of the merge) is gone: C has one
    # merge, run's pass 1, which `lex` exposes
    if fastpath._speedups is not None:
        assert not hasattr(fastpath._speedups, "symbols")
        assert hasattr(fastpath._speedups, "lex")


@pytest.mark.parametrize("blanks", [3, LSTRIP_MAX, LSTRIP_MAX + 1])
def test_lstrip_after_a_literal_ended_header_is_one_rule(blanks, monkeypatch):
    # an lstrip marker right after a literal-ended header's run: every executor splits the
    # header first and then absorbs the blank text after it, as the reference does (the
    # executors used to hand short runs back and, past LSTRIP_MAX ids of header + text,
    # disagreed with the builder)
    fmt = cg.load_format("gemma4")
    enc = next(e for e, _ in _samples(fmt) if fmt._fast_masker(e).lstrip_code is not None)
    fm = fmt._fast_masker(enc)
    ids = [fm.lx.marker_ids["M_TURN_OPEN"], *enc.encode("model\n"), *enc.encode(" ") * blanks,
           fm.lx.marker_ids["M_EOS"]]
    arr = np.asarray(ids, dtype=np.int64)
    fmt.parse_ids(ids, enc, strict=False)
    lexed = fm._lex(arr, [0, len(arr)])
    assert lexed[-1] == [None] and fm.verify_lex(arr, [0, len(arr)], 0, lexed)
    if fm.plan is not None:
        fmt.loss_mask(ids, enc, strict=False)  # (the memos C reads are filled)
        assert fm.verify_lex(arr, [0, len(arr)], 0, fm.c_lex(ids))
    monkeypatch.setenv("CHATGRAMMAR_VERIFY", "1")
    assert fmt.loss_mask(ids, enc, strict=False) == \
        fmt.parse_ids(ids, enc, strict=False).mask()
