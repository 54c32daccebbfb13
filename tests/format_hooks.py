"""The format suite's hooks: checks that are one format's own and cannot be data.

A format's ``tests/formats/<name>/suite.yaml`` names its hooks (``hooks: [name, ...]``); the
suite (tests/test_formats.py) calls each with the format's :class:`tests.format_kit.FormatData`.
A hook is the last resort: a case, policy, cut, detection expectation or typed-marker input is
data; a hook is for what a rendering and a golden cannot say (a property of a tokenizer, a
comparison with another format's parse, a third-party golden file). Each hook says why it is
one.
"""
from __future__ import annotations

import pytest  # noqa: F401  (hooks use pytest.raises)

import chatgrammar as cg  # noqa: F401
from tests.format_kit import FormatData  # noqa: F401


def straddling_only(got, want, conv_ids, policy, name) -> None:
    """``examples_mask_check``: id mode differs from the mapped mask only at tokens straddling
    a reported boundary (a soft marker whose edge falls inside a merged BPE token: the
    documented rule trains the whole token, which text offsets cannot say)."""
    assert {i for i, (a, b) in enumerate(zip(got, want)) if a != b} <= \
        {b.offset for b in conv_ids.boundaries}, name


def soft_straddling_only(got, want, conv_ids, policy, name) -> None:
    """``examples_mask_check``: as :func:`straddling_only`, for soft-marker boundaries only,
    and only under a policy that drops a block (with every block trained, the mapped mask is
    exact: the straddling token trains either way)."""
    soft = {b.offset for b in conv_ids.boundaries if "soft marker" in b.message}
    if policy is None or (policy.thinking and policy.tool_calls):
        assert got == want, name
    else:
        assert {k for k, (a, b) in enumerate(zip(got, want)) if a != b} <= soft, name


def fast_path_serves_repeats(fd: FormatData) -> None:
    """``hooks``: complete renderings end between turns, so after the first sample of each
    shape ``loss_masks`` takes the memoised fast path for most of a repeated batch (same
    masks). A property of the engine's statistics, not of a rendering: hence a hook."""
    from tests.format_kit import encode_with_ranges

    tok = fd.tokenizer()
    batch = []
    for t in fd.templates():
        for c in fd.cases():
            try:
                batch.append(encode_with_ranges(tok, fd.render(t["file"], c))[0])
            except Exception:  # a shape the template rejects
                continue
    want = [fd.fmt.parse_ids(ids, tok).mask() for ids in batch]
    assert fd.fmt.loss_masks(batch, tok) == want
    fm = fd.fmt._fast_masker(tok)
    before = dict(fm.stats)
    assert fd.fmt.loss_masks(batch, tok) == want
    assert fm.stats["fast"] - before["fast"] > len(batch) // 2, fm.stats


def granite_llamacpp_goldens(fd: FormatData) -> None:
    """``hooks``: llama.cpp's Granite renderings (tests/data/granite/llamacpp-granite-cases.json):
    IBM's Granite 3.0 template reproduces llama.cpp's expected output, and llama.cpp's own
    tool-call renderings (pseudo-roles, not renderable from a case) train the assistant
    contents and each call (Granite 4 form `<|tool_call|><tool_call>…</tool_call>`). A third
    party's golden file with its own schema: hence a hook."""
    import copy
    import json
    import re

    from chatgrammar.render import render_chat
    from tests.format_kit import TEMPLATES, check_id_mode, trained_per_turn

    data = json.loads((TEMPLATES.parent / "granite" / "llamacpp-granite-cases.json")
                      .read_text(encoding="utf-8"))
    g30 = next(c for c in data["cases"] if c["name"] == "ibm-granite/granite-3.0-8b-instruct")
    assert (TEMPLATES.parent / "granite" / "granite-3.0-8b-instruct.jinja").read_text(
        encoding="utf-8") == g30["template_str"]
    text = render_chat(g30["template_str"], copy.deepcopy(data["conversation"]),
                       add_generation_prompt=data["add_generation_prompt"])
    assert text == g30["expected_output"]
    fmt, checked = fd.fmt, 0
    for c in data["cases"]:
        text = c["expected_output_jinja"] or c["expected_output"]
        conv = fmt.parse(text)
        assert not conv.warnings
        want = [m["content"] for m in data["conversation"] if m["role"] == "assistant"]
        calls = re.findall(r'\{"assistant_tool_call", "((?:[^"\\]|\\.)*)"\}',
                           c.get("extra_conversation_cpp", ""))
        want += ["<|tool_call|>" + json.loads('"' + s + '"') for s in calls]
        assert trained_per_turn(conv, text) == want, c["name"]
        assert [s.kind for s in conv.spans() if s.kind != "content"] == ["tool_call"] * len(calls)
        assert conv.turns[-1].generation_prompt
        if calls:
            assert [t.role for t in conv.turns][-2] == "tool"   # tool_response
        for tk in fd.tokenizer_names():
            check_id_mode(fmt, text, conv, fd.tokenizer(tk), [None],
                          warnings="none", turn_fields=("role", "generation_prompt"))
        checked += 1
    assert checked == 4
