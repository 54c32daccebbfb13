"""The text-mode memo (chatgrammar.runtime.textpath): ``Format.parse`` answers from it exactly as
the full pipeline does, including the Conversations it defers (turns built on first access,
spans and trained turns answered from span plans until then)."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

import chatgrammar as cg
from chatgrammar.conformance.matrix import iter_renderable
from chatgrammar.errors import ParseError
from chatgrammar.runtime.format import _NO_MEMO
from chatgrammar.runtime.textpath import TextMemo, _unknown_shape_is_safe
from tests.fuzz_tokenizers import engine_templates
from tests.test_fastpath import _bench

POLICIES = [None, cg.MaskPolicy(thinking=False, end_marker=True),
            cg.MaskPolicy(roles=("assistant", "user"), tool_calls=False, truncated=False),
            cg.MaskPolicy(last_turn_only=True), cg.MaskPolicy(end_marker=False)]


def _texts(fmt) -> list[str]:
    out = []
    for _name, tpl, kw in engine_templates(fmt)[:1]:
        for r in iter_renderable(tpl, **kw):
            if r.text is not None:
                out += [r.text, r.text[:len(r.text) // 2], r.text[:-3]]
    return out


def _answers(conv) -> tuple:
    # spans and trained turns first: on a deferred Conversation these come from its plan
    return tuple((conv.spans(p), conv.trained_turns(p)) for p in POLICIES) + (conv.mask(),)


def _built(conv) -> tuple:
    return ([dataclasses.asdict(t) for t in conv.turns], [str(w) for w in conv.warnings],
            conv.length, conv.text)


def _ref(fmt, text, strict):
    try:
        conv = fmt._parse_full(text, strict, _NO_MEMO)
    except ParseError as exc:
        return ("error", str(exc))
    return _answers(conv), _built(conv)


def _got(fmt, text, strict):
    try:
        conv = fmt.parse(text, strict=strict)
    except ParseError as exc:
        return ("error", str(exc))
    return _answers(conv), _built(conv)


@pytest.mark.parametrize("name", cg.list_formats())
def test_deferred_answers_equal_the_full_parse_on_every_format(name):
    fmt = cg.load_format(name)
    texts = _texts(fmt)
    assert texts
    for strict in (True, False):
        for _ in range(2):  # the second pass is served from the memo
            for t in texts:
                assert _got(fmt, t, strict) == _ref(fmt, t, strict), t[:300]


@pytest.mark.parametrize("version", ["kimi-k2", "kimi-k3"])
def test_the_workload_takes_the_vectorised_path_and_defers(version):
    bench = _bench()
    fmt = cg.load_format(version)
    memo = fmt._text_memo or TextMemo(fmt)
    fmt._text_memo = memo
    assert memo.vec
    warm, _ = bench.workload(version, 30, seed="tp-warm")
    for t in warm:
        fmt.parse(t)
    texts, _ = bench.workload(version, 30, seed="tp-fresh")
    before = memo.stats["fast"]
    for t in texts:
        conv = fmt.parse(t)
        if conv._plan is None:
            continue
        assert conv._turns is None  # deferred: nothing built yet
        want = fmt._parse_full(t, True, _NO_MEMO)
        for p in POLICIES:
            assert conv.spans(p) == want.spans(p)
            assert conv.trained_turns(p) == want.trained_turns(p)
        assert conv._turns is None
        assert _built(conv) == _built(want)
    assert memo.stats["fast"] - before >= 20


def test_most_formats_take_the_vectorised_path():
    vec = [n for n in cg.list_formats() if TextMemo(cg.load_format(n)).vec]
    assert {"kimi-k2", "kimi-k3"} <= set(vec)
    assert len(vec) >= len(cg.list_formats()) // 2


def test_unknown_marker_shaped_strings_take_the_full_parse():
    fmt = cg.load_format("kimi-k2")
    good = ("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
            "hello<|im_end|>")
    for _ in range(2):
        fmt.parse(good)
    for bad in (good.replace("hello", "he<|im_bogus|>llo"),
                good.replace("hi", "h<|im_bogus|>i"),
                good.replace("hello", "<|im_end|x")):
        for strict in (True, False):
            assert _got(fmt, bad, strict) == _ref(fmt, bad, strict)


def test_the_unknown_shape_check_refuses_what_it_cannot_prove():
    fmt = cg.load_format("kimi-k3")
    drv, cfg = fmt._driver, fmt._lexcfg
    assert _unknown_shape_is_safe(drv, cfg)

    class Cfg:
        def __init__(self, texts):
            self.by_text = {t: f"M{i}" for i, t in enumerate(texts)}

    # a marker inside which the shape can start, or one the shape could run past
    assert not _unknown_shape_is_safe(drv, Cfg(["<|open|>", "x<|y"]))
    assert not _unknown_shape_is_safe(drv, Cfg(["<|open|>", "<|"]))
    assert not _unknown_shape_is_safe(drv, Cfg(["<|open|>", "<|a|><|b|>"]))
    assert _unknown_shape_is_safe(drv, Cfg(["<|open|>", "<think>"]))


def test_a_deferred_conversation_pickles_copies_and_follows_edits(monkeypatch):
    # (about the deferred Conversation itself: verify mode builds its turns to check them)
    monkeypatch.delenv("CHATGRAMMAR_VERIFY", raising=False)
    bench = _bench()
    fmt = cg.load_format("kimi-k3")
    texts, _ = bench.workload("kimi-k3", 4, seed="tp-pickle")
    for t in texts:
        fmt.parse(t)
    conv = fmt.parse(texts[0])
    want = fmt._parse_full(texts[0], True, _NO_MEMO)
    assert conv._plan is not None
    assert _built(pickle.loads(pickle.dumps(conv))) == _built(want)
    conv = fmt.parse(texts[0])
    assert _built(copy.deepcopy(conv)) == _built(want)
    conv = fmt.parse(texts[0])
    trained = conv.trained_turns()
    assert trained and conv.spans()
    conv.turns[trained[-1]].valid = False  # an edit to the built turns is seen
    assert conv.trained_turns() == trained[:-1]
    assert all(s.turn != trained[-1] for s in conv.spans())
    conv2 = fmt.parse(texts[0])
    conv2.turns = conv2.turns[:1]
    assert conv2.trained_turns() == [i for i in trained if i < 1]


def test_verify_mode_checks_the_span_plans(monkeypatch):
    from chatgrammar.errors import VerifyError

    bench = _bench()
    fmt = cg.load_format("kimi-k2")
    texts, _ = bench.workload("kimi-k2", 4, seed="tp-verify")
    monkeypatch.delenv("CHATGRAMMAR_VERIFY", raising=False)  # (the suite may run with it)
    for t in texts:
        fmt.parse(t)
    assert fmt.parse(texts[0])._plan is not None
    monkeypatch.setenv("CHATGRAMMAR_VERIFY", "1")
    assert fmt.parse(texts[0]).spans() == fmt._parse_full(texts[0], True, _NO_MEMO).spans()
    memo = fmt._text_memo
    pk = memo.policy_key(fmt.default_policy)
    for tpls in memo.simple.values():
        for tp in tpls:
            if tp.by_policy.get(pk):
                ks, ds, ke, de, kind = tp.by_policy[pk][0]
                tp.by_policy[pk] = ((ks, ds + 1, ke, de, kind),) + tp.by_policy[pk][1:]
    with pytest.raises(VerifyError):
        fmt.parse(texts[0])
    memo.items.clear()
    memo.simple.clear()
