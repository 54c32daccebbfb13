"""`close.roles`: a close marker only some roles' turns end with.

Nemotron Nano v2 opens user and assistant turns with the same `<SPECIAL_11>` and tells them
apart by the role line; only the assistant turn ends with `<SPECIAL_12>`. One element with
`close: {markers: [end], roles: [assistant]}` says that: a user turn ends where the next turn
opens, complete and silently; an assistant turn without its close is an error (or, with
`required: false`, a warning and an incomplete turn).
"""
from __future__ import annotations

import pytest

import chatgrammar as cg
from chatgrammar.conformance.templates import MarkerTokenizer
from chatgrammar.errors import CompileError

SPEC = """
name: roles-test
markers:
  open: {text: "<A>"}
  sep: {text: "<S>"}
  end: {text: "<E>"}
elements:
  turn:
    open: open
    header: {until: sep, pattern: "(?P<role>user|assistant|system)"}
    close: {markers: [end], roles: [assistant]%s}
top: [turn]
"""


def fmt_of(tmp_path, extra: str = "") -> cg.Format:
    p = tmp_path / "roles.yaml"
    p.write_text(SPEC % extra, encoding="utf-8")
    return cg.load_format(str(p))


def both_modes(fmt, text: str, **kw):
    tok = MarkerTokenizer.for_format(fmt)
    ids, starts = tok.encode_with_offsets(text)
    conv_t = fmt.parse(text, **kw)
    conv_i = fmt.parse_ids(ids, tok, **kw)
    bounds = starts + [len(text)]
    assert [(t.role, t.complete, t.valid) for t in conv_t.turns] == \
        [(t.role, t.complete, t.valid) for t in conv_i.turns]
    assert [(s.start, s.end) for s in conv_t.spans()] == \
        [(bounds[s.start], bounds[s.end]) for s in conv_i.spans()]
    assert [w.message for w in conv_t.warnings] == [w.message for w in conv_i.warnings]
    return conv_t


def test_unlisted_roles_end_at_the_next_turn_complete_and_silently(tmp_path):
    fmt = fmt_of(tmp_path)
    text = "<A>system<S>Be brief.<A>user<S>Hi<A>assistant<S>Hello<E><A>user<S>Bye<A>assistant<S>Ciao<E>"
    conv = both_modes(fmt, text)
    assert not conv.warnings
    assert [(t.role, t.complete) for t in conv.turns] == [
        ("system", True), ("user", True), ("assistant", True), ("user", True),
        ("assistant", True)]
    user = conv.turns[1]
    assert text[user.start:user.end] == "<A>user<S>Hi" and user.block.close is None
    assert [text[s.start:s.end] for s in conv.spans()] == ["Hello", "Ciao"]
    ends = [text[s.start:s.end] for s in conv.spans(cg.MaskPolicy(end_marker=True))
            if s.kind == "end"]
    assert ends == ["<E>", "<E>"]  # no zero-width end span for the user turns
    # a user turn trains like any other when the policy asks for it (no terminator to train)
    got = [text[s.start:s.end] for s in conv.spans(cg.MaskPolicy(roles=("user",),
                                                                   end_marker=True))]
    assert got == ["Hi", "Bye"]


def test_a_listed_role_without_its_close_is_an_error(tmp_path):
    fmt = fmt_of(tmp_path)
    text = "<A>user<S>Hi<A>assistant<S>Hello<A>user<S>Bye<A>assistant<S>Ciao<E>"
    with pytest.raises(cg.ParseError, match="missing end '<E>' before the next turn") as e:
        fmt.parse(text)
    assert e.value.offset == text.index("<A>user<S>Bye")
    conv = both_modes(fmt, text, strict=False)
    assert [w.message for w in conv.warnings] == ["missing end '<E>' before the next turn"]
    assert [t.valid for t in conv.turns] == [True, False, True, True]
    assert [text[s.start:s.end] for s in conv.spans()] == ["Ciao"]  # later turns still train


def test_required_false_makes_it_a_warning_and_a_cut(tmp_path):
    fmt = fmt_of(tmp_path, ", required: false")
    text = "<A>user<S>Hi<A>assistant<S>Hello<A>user<S>Bye<A>assistant<S>Ciao<E>"
    conv = both_modes(fmt, text)
    assert [w.message for w in conv.warnings] == \
        ["missing end '<E>': the element ends where the next one opens"]
    assert [(t.role, t.complete) for t in conv.turns] == [
        ("user", True), ("assistant", False), ("user", True), ("assistant", True)]
    assert [text[s.start:s.end] for s in conv.spans()] == ["Hello", "Ciao"]
    assert [text[s.start:s.end] for s in conv.spans(cg.MaskPolicy(truncated=False))] == ["Ciao"]


def test_end_of_input_is_a_cut_for_every_role(tmp_path):
    fmt = fmt_of(tmp_path)
    for text, role in (("<A>user<S>Hi<A>assistant<S>Hel", "assistant"),
                       ("<A>user<S>Hi<A>assistant<S>Hello<E><A>user<S>By", "user")):
        conv = both_modes(fmt, text)
        assert not conv.warnings
        assert conv.turns[-1].role == role and not conv.turns[-1].complete
    text = "<A>user<S>Hi<A>assistant<S>Hel"
    assert [text[s.start:s.end] for s in fmt.parse(text).spans()] == ["Hel"]
    assert fmt.parse(text).spans(cg.MaskPolicy(truncated=False)) == []


def test_roles_is_for_top_level_elements(tmp_path):
    p = tmp_path / "nested.yaml"
    p.write_text("""
name: nested-roles
markers:
  open: {text: "<A>"}
  end: {text: "<E>"}
  t: {text: "<T>"}
  tc: {text: "</T>"}
elements:
  turn: {open: open, close: {markers: [end]}, role: assistant, children: [think]}
  think: {open: t, close: {markers: [tc], roles: [assistant]}}
top: [turn]
""", encoding="utf-8")
    with pytest.raises(CompileError, match="`close.roles` is for top-level elements"):
        cg.load_format(str(p)).grammar


def test_fast_path_memoises_turns_that_end_without_a_close(tmp_path):
    """The fast path's automaton adds the same zero-width close as the driver: a batch of
    such conversations is served from the memo and equals the full parse."""
    fmt = fmt_of(tmp_path)
    tok = MarkerTokenizer.for_format(fmt)
    texts = [f"<A>user<S>Hi {i}<A>assistant<S>Hello {i}<E><A>user<S>More<A>assistant<S>Ok<E>"
             for i in range(40)]
    batch = [tok.encode_with_offsets(t)[0] for t in texts]
    want = [fmt.parse_ids(ids, tok).mask() for ids in batch]
    assert fmt.loss_masks(batch, tok) == want  # the first batch teaches the memo
    fm = fmt._fast_masker(tok)
    assert fm.stats["fast"] == 0
    assert fmt.loss_masks(batch, tok) == want
    assert fm.stats["fast"] == len(batch), fm.stats
    # text mode's memo too
    for t in texts:
        assert fmt.parse(t).mask() == fmt.parse(t).mask()
    assert fmt._text_memo.stats["fast"] > 0, fmt._text_memo.stats
