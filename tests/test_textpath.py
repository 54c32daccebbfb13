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
        # the reference once per text (the full parse without the memo: it teaches the memo
        # nothing, so both passes below meet the memo as before)
        want = [_ref(fmt, t, strict) for t in texts]
        for _ in range(2):  # the second pass is served from the memo
            for t, w in zip(texts, want):
                assert _got(fmt, t, strict) == w, t[:300]


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


# ---------------------------------------------------------------- literal-ended headers, lstrip
# (T9, #12: ChatML's role line and `lstrip` markers on the vectorised path)

# every bundled format whose text lexing has a literal-ended header or an lstrip marker
_SPLIT_OR_LSTRIP = ["apriel", "breeze", "chatml", "functionary-v3", "functiongemma", "gemma",
                    "hyperclovax-seed", "inkbot", "internlm2", "llama2", "minimax-m1",
                    "mistral", "nemotron-nano-v2", "nemotron4", "seed-oss", "zoot"]


def test_literal_ended_headers_and_lstrip_take_the_vectorised_path():
    for name in _SPLIT_OR_LSTRIP:
        fmt = cg.load_format(name)
        cfg = fmt._lexcfg
        assert cfg.split_after or cfg.lstrip, name
        assert fmt.stats()["text"]["path"] == "vectorised", name
    # a format the vectorised executor cannot run says why, never silently
    path = cg.load_format("phi3").stats()["text"]["path"]
    assert path.startswith("per-token: ") and len(path) > len("per-token: ")


def _lexes_like_the_reference(fmt, texts):
    from chatgrammar.runtime.lexers import lex_text

    memo = TextMemo(fmt)
    assert memo.vec
    # the item walk is not what is compared here (the masks below are): without it a text
    # that ends inside an item (nemotron4 writes no terminator after the last turn) is split
    # and lexed too
    memo._vec_walk = lambda sw: []
    split = 0
    for t in texts:
        got = memo._vec_split(t)
        if type(got) is str:
            continue
        split += 1
        parts, _bounds, B, sb, _hp, _hv = got
        assert memo._vec_tokens(parts, B, sb) == lex_text(t, fmt._lexcfg), t[:300]
    return split


CHATML_EDGES = [
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n",
    # a header cut by the end of input, an empty one, one that never ends
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assis",
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|><|im_end|>\n",
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant" + "x" * 1100 + "\nA<|im_end|>\n",
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant" + "x" * 1023 + "\nA<|im_end|>\n",
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant" + "x" * 1024 + "\nA<|im_end|>\n",
    # a marker, or an unknown marker shape, before the header's newline
    "<|im_start|>user<think>\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n",
    "<|im_start|>environment name=<|plugin|>\nok<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n",
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant<|im_end|>\n",
    # the header's newline right before a marker; a body that is only the header
    "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\nA<|im_end|>",
    # lstrip: Gemma's EOS after the last answer, after whitespace, after a header
    "<bos><|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n<eos>",
    "<|im_start|>user\nQ<|im_end|> \n\t <eos>",
    "<|im_start|>user\nQ<|im_end|><eos>",
    "<|im_start|>user\n  <eos>",
    "<|im_start|>user  <eos>",
    "  <eos><|im_start|>user\nQ<|im_end|>\n",
    "<|im_start|>user\nQ<|im_end|>\nx <eos>",
    # markers that start otherwise (the full splitter), typed marker-like text
    "<|startoftext|>**IMPORTANT**: The syntax for calling the tools is: <|tool_call_start|>J"
    "<|tool_call_end|>. Please only call tools in the specified manner.<|im_start|>user\nQ"
    "<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n",
    "<|im_start|>user\n**IMPORTANT** Please <|im_e<|im_end|>\n<|im_start|>assistant\nA<|im_end|>",
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_e",
]


def test_chatml_edges_lex_and_parse_like_the_reference():
    fmt = cg.load_format("chatml")
    assert _lexes_like_the_reference(fmt, CHATML_EDGES) >= len(CHATML_EDGES) - 4
    for strict in (True, False):
        for _ in range(2):  # the second pass is served from the memo
            for t in CHATML_EDGES:
                assert _got(fmt, t, strict) == _ref(fmt, t, strict), t[:300]
    assert fmt.stats()["text"]["fast"] > 0


@pytest.mark.parametrize("name", _SPLIT_OR_LSTRIP)
def test_split_and_lstrip_formats_lex_like_the_reference(name):
    fmt = cg.load_format(name)
    texts = _texts(fmt)
    # (and with whitespace before every marker: the runs an lstrip marker absorbs)
    cfg = fmt._lexcfg
    texts += [cfg.regex.sub(lambda m: " \n" + m.group(), t) for t in texts[::3]]
    assert _lexes_like_the_reference(fmt, texts) > 0
    for strict in (True, False):
        for _ in range(2):
            for t in texts:
                assert _got(fmt, t, strict) == _ref(fmt, t, strict), t[:300]


def test_the_chatml_workload_takes_the_vectorised_path_and_defers():
    bench = _bench()
    fmt = cg.load_format("chatml")
    for t in bench.text_workload("chatml", 30, "tp-warm"):
        fmt.parse(t)
    before = fmt.stats()["text"]["fast"]
    for t in bench.text_workload("chatml", 30, "tp-fresh"):
        conv = fmt.parse(t)
        want = fmt._parse_full(t, True, _NO_MEMO)
        for p in POLICIES:
            assert conv.spans(p) == want.spans(p)
            assert conv.trained_turns(p) == want.trained_turns(p)
        assert _built(conv) == _built(want)
    st = fmt.stats()["text"]
    assert st["path"] == "vectorised" and st["fast"] - before >= 20


def test_a_split_that_differs_from_the_lexer_switches_the_vectorised_path_off(monkeypatch):
    monkeypatch.delenv("CHATGRAMMAR_VERIFY", raising=False)
    fmt = cg.load_format("chatml")
    memo = fmt._text_memo = TextMemo(fmt)
    monkeypatch.setattr(memo, "_vec_tokens", lambda *a: [])
    text = CHATML_EDGES[0]
    want = _ref(fmt, text, True)
    assert _got(fmt, text, True) == want
    assert not memo.vec and fmt.stats()["text"]["path"].startswith("per-token: the split")
    for _ in range(2):
        assert _got(fmt, text, True) == want


def test_the_marker_trie_matches_what_the_lexer_regex_matches():
    import random
    import re

    from chatgrammar.runtime.textpath import _trie

    rng = random.Random(9)
    for _ in range(300):
        words = list({"".join(rng.choice("ab<|") for _ in range(rng.randint(1, 5)))
                      for _ in range(rng.randint(1, 8))})
        flat = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
        for top in (False, True):
            trie = re.compile(_trie(sorted(words), top=top))
            for _ in range(5):
                s = "".join(rng.choice("ab<|x") for _ in range(40))
                assert [m.span() for m in trie.finditer(s)] == \
                       [m.span() for m in flat.finditer(s)], (words, s)


@pytest.mark.parametrize("name", cg.list_formats())
def test_every_vectorised_splitter_passes_the_regex_safety_check(name):
    # The splitter runs on untrusted text: it must pass the check every spec regex passes
    # (core.compile_regex.regex_risk). The first literal-ended header group did not: its two
    # alternatives matched the same characters, and a header with no literal before the next
    # marker backtracked exponentially (`<|im_start|>System: …<|im_end|>` never returned).
    from chatgrammar.core.compile_regex import regex_risk

    memo = TextMemo(cg.load_format(name))
    for rx in (getattr(memo, "splitter", None), getattr(memo, "fast_splitter", None)):
        if rx is not None:  # (none: the format takes the per-token text path)
            assert regex_risk(rx.pattern, max_len=256) is None, (name, rx.pattern[:200])


def test_a_header_with_no_literal_before_the_next_marker_is_a_parse_error_not_a_hang():
    fmt = cg.load_format("chatml")
    text = ("<|im_start|>System: You are a helpful assistant." + " word" * 400
            + "<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n")
    with pytest.raises(ParseError):
        fmt.parse(text, strict=True)
    assert fmt.parse(text, strict=False) is not None
