"""The format suite's hooks: checks that are one format's own and cannot be data.

A format's ``tests/formats/<name>/suite.yaml`` names its hooks (``hooks: [name, ...]``); the
suite (tests/test_formats.py) calls each with the format's :class:`tests.format_kit.FormatData`.
A hook is the last resort: a case, policy, cut, detection expectation or typed-marker input is
data; a hook is for what a rendering and a golden cannot say (a property of a tokenizer, a
comparison with another format's parse, a third-party golden file). Each hook says why it is
one.
"""
from __future__ import annotations

from pathlib import Path

import chatgrammar as cg
from tests.format_kit import FormatData


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

    from chatgrammar.conformance.render import render_chat
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


def trl_generation_parity(fd: FormatData) -> None:
    """``hooks``, with ``trl:`` in suite.yaml (TRL training template under
    tests/data/templates/generation → ``template`` it copies, ``slack``: a marker TRL's span
    may start after although the format trains it, ``prefill``: that marker is prepended to
    TRL's span): with ``end_marker=True`` the format's spans cover TRL's ``{% generation %}``
    spans exactly, and the TRL copy renders what the original renders. TRL's spans come from
    the renderer, not a golden: hence a hook."""
    from chatgrammar.conformance.render import TemplateError, render_chat_with_spans
    from tests.format_kit import TEMPLATES, check_id_mode

    for name, x in fd.data["trl"].items():
        src = (TEMPLATES / "generation" / name).read_text(encoding="utf-8")
        slack, prefill = x.get("slack") or "", x.get("prefill") or ""
        t = fd.template(x["template"])
        checked = 0
        for case in fd.cases():
            try:
                res = render_chat_with_spans(src, case.messages,  # (it copies them)
                                             **{**(t.get("vars") or {}), **case.render_kwargs()})
            except TemplateError:
                continue
            text = res.text
            assert text == fd.render(x["template"], case), case.name
            conv = fd.fmt.parse(text)
            ours = conv.spans(cg.MaskPolicy(end_marker=True))
            assert len(res.generation_spans) == sum(1 for m in case.messages
                                                    if m["role"] == "assistant")
            covered = set()
            for gs, ge in res.generation_spans:
                inside = [s for s in ours if gs - len(slack) <= s.start and s.end <= ge]
                covered.update(id(s) for s in inside)
                want = text[gs:ge]
                if prefill:
                    assert text[gs - len(prefill):gs] == prefill
                    want = prefill + want
                assert "".join(text[s.start:s.end] for s in inside) == want, case.name
            assert covered == {id(s) for s in ours}, case.name
            check_id_mode(fd.fmt, text, conv, fd.tokenizer(t["tokenizer"]),
                          [None, cg.MaskPolicy(end_marker=True)])
            checked += 1
        assert checked >= x.get("min_cases", 1), name


def deviations_need_the_tests_yaml(fd: FormatData) -> None:
    """``hooks``: the conformance deviations the format's tests.yaml accepts are accepted for
    it only: the same spec copied under another name without its tests.yaml fails exactly the
    cases that deviated (each with a reason, containing every ``deviation_reasons`` string of
    the suite.yaml), on every template. About the checker and a second spec file: hence a
    hook."""
    import tempfile
    from pathlib import Path

    from chatgrammar.conformance.templates import check_template

    spec = Path(fd.fmt.path).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{fd.name}-copy.yaml"
        path.write_text(spec.replace(f"name: {fd.name}", f"name: {fd.name}-copy", 1),
                        encoding="utf-8")
        copy_fmt = cg.load_format(path)
        seen = 0
        for t in fd.templates():
            ours = check_template(fd.fmt, fd.source(t["file"]), variables=t.get("vars"))
            theirs = check_template(copy_fmt, fd.source(t["file"]), variables=t.get("vars"))
            deviated = {c.case for c in ours.cases if c.deviations}
            failed = {c.case: c.reason for c in theirs.cases if c.status == "fail"}
            assert set(failed) == deviated, t["file"]
            for why in fd.data.get("deviation_reasons") or ():  # what each failure says
                assert all(why in r for r in failed.values()), (t["file"], why, failed)
            seen += len(deviated)
        assert seen, "no template of the format shows a deviation"


def no_other_template_detects_as_this(fd: FormatData) -> None:
    """``hooks``: no template of tests/data/templates outside the format's own detects as it
    (its template detector is specific). About every other template: hence a hook."""
    from tests.format_kit import TEMPLATES

    mine = {Path(t["file"]).name for t in fd.templates()}
    others = [p for p in TEMPLATES.glob("*.jinja") if p.name not in mine]
    assert others
    for p in others:
        src = p.read_text(encoding="utf-8")
        # detection takes a format among those whose detector matches (``matched``, the
        # marker evidence, the same with or without verification): where this format's does
        # not match, the full detection (verifying candidates over the matrix, ~45 ms per
        # template) cannot give it, so it runs only where it does
        try:
            if fd.name not in cg.explain_detection(chat_template=src, verify=False).matched:
                continue
            got = cg.detect_format(chat_template=src).name
        except cg.DetectionError:
            continue
        assert got != fd.name, p.name


def cohere_fixed_suffix_is_no_message(fd: FormatData) -> None:
    """``hooks``: R7B's tool_use template ends every rendering with `<|START_OF_TURN_TOKEN|>
    <|CHATBOT_TOKEN|>`: the checker gives it to no message, so the last reply's expected region
    ends at its own terminator. About the checker's expected spans: hence a hook."""
    from chatgrammar.conformance.templates import check_template

    file = "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"
    res = check_template(fd.fmt, fd.source(file), variables=fd.template(file).get("vars"))
    basic = next(c for c in res.cases if c.case == "basic")
    tail = "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    assert basic.status == "pass" and basic.text.endswith("<|END_OF_TURN_TOKEN|>" + tail)
    assert basic.expected[-1][1] == len(basic.text) - len(tail + "<|END_OF_TURN_TOKEN|>")


def same_ids_same_masks(fd: FormatData) -> None:
    """``hooks``, with ``tokenizers_agree: {pairs: [[a, b], ...], min_compared: N}``: two
    implementations of one vocabulary (a fast and a slow tokenizer) give the same masks on
    every rendering they encode to the same ids (the slow one has no offsets, so this is what
    ties its masks to the checked ones), on every template checked with both. About two
    tokenizers at once: hence a hook."""
    from chatgrammar.conformance.render import TemplateError
    from tests.format_kit import encode_ids

    x = fd.data["tokenizers_agree"]
    compared = 0
    for t in fd.templates():
        names = fd.id_tokenizers(t["file"])
        for a, b in x["pairs"]:
            if a not in names or b not in names:
                continue
            ta, tb = fd.tokenizer(a), fd.tokenizer(b)
            for c in fd.cases():
                try:
                    text = fd.render(t["file"], c)
                except TemplateError:
                    continue
                ia, ib = encode_ids(ta, text), encode_ids(tb, text)
                if ia == ib:
                    compared += 1
                    assert fd.fmt.loss_mask(ia, ta) == fd.fmt.loss_mask(ib, tb), (t["file"], c.name)
    assert compared >= x.get("min_compared", 1), compared


def conformance_expected_regions(fd: FormatData) -> None:
    """``hooks``, with ``expected_regions: [{template, case, last_starts_with}]``: where the
    render-diff checker expects a case's last trained region to start (e.g. the reply after
    tool outputs trains from right after the marker the template prompts with). About the
    checker's expected spans: hence a hook."""
    from chatgrammar.conformance.templates import check_template

    for x in fd.data["expected_regions"]:
        t = fd.template(x["template"])
        res = check_template(fd.fmt, fd.source(x["template"]), name=x["template"],
                             variables=t.get("vars"))
        c = next(c for c in res.cases if c.case == x["case"])
        assert c.text[c.expected[-1][0]:].startswith(x["last_starts_with"]), c.expected
