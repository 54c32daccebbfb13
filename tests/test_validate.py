"""``chatgrammar validate`` as a library: spec files, conflicts, examples, precedence, and the
template conformance check on the real Kimi templates.

Spec files are data: every ``tests/data/specs/good/*.yaml`` must validate without errors, and
every ``tests/data/specs/bad/*.yaml`` states in leading ``# expect: <message substring> @
<line>:<col>`` comments each problem it must produce, and where.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.core.compile import grammar_conflicts
from chatgrammar.conformance.templates import MarkerTokenizer, check_template, marked
from chatgrammar.conformance.matrix import case_names, get_case
from chatgrammar.core.spec import parse_spec, spec_errors
from chatgrammar.conformance.validate import (check_examples, check_tokenizer, parse_marked,
                                  validate_paths)
from tests.kimi_tokenizers import kimi_k2_encoding, kimi_k3_encoding

DATA = Path(__file__).resolve().parent / "data"
SPECS = DATA / "specs"
TEMPLATES = DATA / "templates"
FORMATS = Path(__file__).resolve().parent.parent / "formats"
GOOD = sorted((SPECS / "good").glob("*.yaml"))
BAD = sorted((SPECS / "bad").glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (?P<msg>.+) @ (?P<line>\d+):(?P<col>\d+)\s*$")


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def expectations(path: Path) -> list[tuple[str, int, int]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        m = EXPECT.match(line)
        if m:
            out.append((m["msg"], int(m["line"]), int(m["col"])))
    return out


# ------------------------------------------------------------------ spec files (data-driven)

def test_spec_folders_are_populated():
    assert len(GOOD) >= 3 and len(BAD) >= 12
    for path in BAD:
        assert expectations(path), f"{path.name} has no '# expect: … @ line:col' comment"


@pytest.mark.parametrize("path", GOOD, ids=[p.stem for p in GOOD])
def test_good_spec_validates(path):
    report = validate_paths([path], precedence_with_bundled=False)
    assert report.ok, "\n".join(p.render() for p in report.problems)
    assert report.files[0].kind == "format"
    assert "examples" in report.files[0].checks
    fmt = cg.load_format(path)
    assert fmt.spec.examples, "a good spec shows what it trains"


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_spec_reports_each_expected_problem_where_it_is(path):
    report = validate_paths([path], precedence_with_bundled=False)
    assert not report.ok
    errors = report.errors
    for msg, line, col in expectations(path):
        hits = [p for p in errors if msg in p.message]
        assert hits, f"no problem containing {msg!r}; got:\n" + "\n".join(
            p.render() for p in errors)
        assert any((p.line, p.col) == (line, col) for p in hits), \
            f"{msg!r} reported at {[(p.line, p.col) for p in hits]}, expected {(line, col)}"
        assert all(p.file == str(path) for p in hits)


def test_all_schema_problems_of_a_file_are_collected():
    path = SPECS / "bad" / "wrong-types.yaml"
    spec, src, errs = spec_errors(path.read_text(encoding="utf-8"), str(path))
    assert spec is None and src is not None
    assert len(errs) == 5
    assert [e.path for e in errs] == ["name", "markers.a.special", "elements.t.close.markers",
                                      "elements.t.children_of", "top"]
    # the raising API still reports the first one, and says how many more there are
    with pytest.raises(cg.SpecError, match=r"kebab-case.*\(\+4 more problems\)"):
        parse_spec(path.read_text(encoding="utf-8"), str(path))


def test_bundled_kimi_specs_validate():
    report = validate_paths([FORMATS / "kimi-k2.yaml", FORMATS / "kimi-k3.yaml"],
                            precedence_with_bundled=False)
    assert report.ok, "\n".join(p.render() for p in report.problems)
    assert {f.name for f in report.files} == {"kimi-k2", "kimi-k3"}


# ------------------------------------------------------------------ conflicts in spec terms

def test_conflict_names_elements_markers_and_a_shortest_input():
    path = SPECS / "bad" / "conflict-same-opener.yaml"
    with pytest.raises(cg.CompileError) as info:
        cg.load_format(path)
    err = info.value
    assert err.path == "elements.x" and (err.line, err.col) == (8, 6)
    text = str(err)
    assert "element 'x' (elements.x): a e ·" in text
    assert "element 'y' (elements.y): a e ·" in text
    assert "markers: a = '<a>', e = '<e>'" in text
    assert "e_x" not in text and "M_A" not in text  # no Lark-internal names
    spec, _ = parse_spec(path.read_text(encoding="utf-8"), str(path))
    from chatgrammar.core.compile import build_grammar
    conflicts = grammar_conflicts(build_grammar(spec))
    assert {c.kind for c in conflicts} == {"reduce/reduce"}
    assert conflicts[0].prefix == ("M_A", "M_E")


def test_shift_reduce_conflict_shows_both_constructs():
    with pytest.raises(cg.CompileError) as info:
        cg.load_format(SPECS / "bad" / "conflict-follow.yaml")
    text = str(info.value)
    assert "it could complete:\n    - element 'y' (elements.y): b f ·" in text
    assert "or continue:\n    - element 'z' (elements.z): · (text)* g" in text


# ------------------------------------------------------------------ examples

def test_parse_marked():
    assert parse_marked("a⟦bc⟧d⟦e⟧") == ("abcde", [(1, 3), (4, 5)])
    for bad in ("a⟦b", "a⟧b", "⟦a⟦b⟧⟧"):
        with pytest.raises(ValueError):
            parse_marked(bad)


def test_examples_run_in_text_and_id_mode():
    # A spec whose grammar is right but whose example expects the wrong span: the problem
    # names the example and shows expected vs found, in the notation of examples.
    src = (FORMATS / "kimi-k2.yaml").read_text(encoding="utf-8")
    src = src.replace("⟦Hello!⟧<|im_end|>", "⟦Hello!<|im_end|>⟧", 1)
    spec, source = parse_spec(src, "k2-variant.yaml")
    problems = check_examples(cg.Format(spec, source))
    assert len(problems) == 1
    p = problems[0]
    assert p.path == "examples[0].text" and "example 'basic'" in p.message
    assert "expected: " in p.message and "<|im_middle|>⟦Hello!⟧<|im_end|>" in p.message


def test_marker_tokenizer_is_one_id_per_marker_and_per_char():
    tok = MarkerTokenizer(["<|open|>", "<|sep|>"])
    ids, starts = tok.encode_with_offsets("<|open|>ab<|sep|>")
    assert ids == [tok.marker_ids["<|open|>"], tok.base + ord("a"), tok.base + ord("b"),
                   tok.marker_ids["<|sep|>"]]
    assert starts == [0, 8, 9, 10]
    assert tok.decode(ids) == "<|open|>ab<|sep|>"
    assert tok.convert_tokens_to_ids("<|sep|>") == tok.marker_ids["<|sep|>"]
    assert tok.convert_tokens_to_ids("<|nope|>") is None


# ------------------------------------------------------------------ precedence across files

def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


FAMILY = """name: {name}
markers: {{a: {{text: "<a>"}}, e: {{text: "<e>"}}, x: {{text: "{extra}"}}}}
elements: {{t: {{open: a, close: {{markers: [e]}}, role: assistant, inner_markers: [x]}}}}
top: [t]
detect:
  require: ["<a>", "<e>"{more}]
  precedence_over: {over}
examples: [{{text: "<a>⟦x⟧<e>"}}]
"""


def test_overlapping_detectors_without_order_name_both_files(tmp_path):
    a = _write(tmp_path, "fam-a.yaml", FAMILY.format(name="fam-a", extra="<xa>", more="",
                                                     over="[]"))
    b = _write(tmp_path, "fam-b.yaml", FAMILY.format(name="fam-b", extra="<xb>",
                                                     more=', "<xb>"', over="[]"))
    report = validate_paths([a, b], precedence_with_bundled=False)
    probs = [p for p in report.errors if p.check == "precedence"]
    assert len(probs) == 1, [p.render() for p in report.problems]
    msg = probs[0].message
    assert str(a) in msg and str(b) in msg
    assert "neither declares precedence" in msg and probs[0].path == "detect"
    # declaring the order fixes it
    b.write_text(FAMILY.format(name="fam-b", extra="<xb>", more=', "<xb>"', over="[fam-a]"),
                 encoding="utf-8")
    assert validate_paths([a, b], precedence_with_bundled=False).ok


def test_precedence_cycle_is_an_error_naming_both_files(tmp_path):
    a = _write(tmp_path, "cyc-a.yaml", FAMILY.format(name="cyc-a", extra="<xa>", more="",
                                                     over="[cyc-b]"))
    b = _write(tmp_path, "cyc-b.yaml", FAMILY.format(name="cyc-b", extra="<xb>", more="",
                                                     over="[cyc-a]"))
    report = validate_paths([a, b], precedence_with_bundled=False)
    cycles = [p for p in report.errors if "precedence cycle" in p.message]
    assert len(cycles) == 1
    assert str(a) in cycles[0].message and str(b) in cycles[0].message


def test_isolated_precedence_pulls_in_the_formats_a_spec_names():
    # kimi-k3 declares precedence over kimi-k2: validated alone, kimi-k2 is brought in so the
    # name resolves, and the declared order settles their overlap.
    report = validate_paths([FORMATS / "kimi-k3.yaml"], precedence_with_bundled=False)
    assert report.ok, "\n".join(p.render() for p in report.problems)


# ------------------------------------------------------------------ tokenizer checks

def test_tokenizer_check_accepts_kimi_k3_and_reports_missing_markers():
    k3 = cg.load_format("kimi-k3")
    assert check_tokenizer(k3, kimi_k3_encoding(with_k2_strings=True), "k3") == []
    probs = check_tokenizer(k3, kimi_k2_encoding(), "k2-tokenizer")
    names = sorted(re.search(r"marker '(\w+)'", p.message).group(1) for p in probs)
    assert names == ["close", "end_of_msg", "open", "sep"]
    assert all(p.check == "tokenizer" and p.path.startswith("markers.") for p in probs)
    assert "is not one special id of k2-tokenizer" in probs[0].message


# ------------------------------------------------------------------ template conformance

@pytest.mark.parametrize("fmt_name, tpl", [
    ("kimi-k2", "moonshotai-Kimi-K2.jinja"),
    ("kimi-k2", "moonshotai-Kimi-K2-Thinking.jinja"),
    ("kimi-k3", "moonshotai-Kimi-K3.jinja"),
])
def test_real_kimi_templates_conform(fmt_name, tpl):
    res = check_template(cg.load_format(fmt_name), template(tpl), name=tpl)
    assert res.ok, "\n".join(f"{c.case}: {c.reason}\n{c.details}" for c in res.cases
                             if c.status == "fail")
    assert [c.case for c in res.cases] == case_names()
    assert res.counts()["pass"] == len(case_names())  # these templates reject no shape
    by = {c.case: c for c in res.cases}
    # the expected spans come from the template, and the format trains exactly them
    for c in res.cases:
        assert c.found == c.expected, c.case
    tc = by["tool-call"]
    trained = [tc.text[s:e] for s, e in tc.found]
    assert any("celsius" in t for t in trained)  # the tool call's arguments train
    assert "It is sunny and 22 degrees in Paris." in "".join(trained)
    assert not any("You are a helpful assistant" in t for t in trained)
    assert by["generation-prompt-thinking-off"].found == []


def test_kimi_k3_trains_the_prefilled_think_opening():
    res = check_template(cg.load_format("kimi-k3"), template("moonshotai-Kimi-K3.jinja"),
                         cases=[get_case("basic")])
    c = res.cases[0]
    assert c.status == "pass"
    (s, e), = c.found
    assert c.text[s:e].startswith("<|open|>think<|sep|>")
    assert c.text[s:e].endswith("<|close|>response<|sep|>")
    assert any("prefill" in n for n in c.notes)


def test_kimi_k3_conforms_in_id_mode_with_a_real_bpe_tokenizer():
    res = check_template(cg.load_format("kimi-k3"), template("moonshotai-Kimi-K3.jinja"),
                         cases=[get_case(n) for n in ("basic", "tool-call", "unicode",
                                                      "special-chars")],
                         tokenizer=kimi_k3_encoding(with_k2_strings=True))
    assert res.ok, [c.reason for c in res.cases]


def test_mismatched_template_fails_every_case_with_the_conversation_shown():
    res = check_template(cg.load_format("kimi-k3"), template("moonshotai-Kimi-K2.jinja"),
                         name="moonshotai-Kimi-K2.jinja")
    assert not res.ok
    assert res.counts() == {"pass": 0, "fail": len(case_names()), "skip": 0}
    c = res.cases[0]
    assert c.reason.startswith("does not parse (text mode)")
    assert "[2] assistant: 'The capital of France is Paris.'" in c.details
    assert "<|im_assistant|>assistant<|im_middle|>" in c.details


def _variant(tmp_path, name, old, new):
    src = (FORMATS / "kimi-k2.yaml").read_text(encoding="utf-8")
    assert old in src
    src = src.replace(old, new).replace("name: kimi-k2", f"name: {name}")
    p = tmp_path / f"{name}.yaml"
    p.write_text(src, encoding="utf-8")
    return cg.load_format(p)


def test_a_format_that_trains_the_role_header_fails(tmp_path):
    fmt = _variant(tmp_path, "k2-header-trained",
                   "    header: {until: im_middle, required: false}\n",
                   "    inner_markers: [im_middle]\n")
    res = check_template(fmt, template("moonshotai-Kimi-K2.jinja"), cases=[get_case("basic")])
    c = res.cases[0]
    assert c.status == "fail"
    assert "its header is trained" in c.reason and "'assistant<|im_middle|>'" in c.reason
    # the rendering is shown twice, expected and found spans marked
    assert "<|im_middle|>⟦The capital of France is Paris.⟧<|im_end|>" in c.details
    assert "<|im_assistant|>⟦assistant<|im_middle|>The capital" in c.details


def test_a_format_that_swaps_roles_fails(tmp_path):
    fmt = _variant(tmp_path, "k2-roles-swapped", "im_user: user, im_assistant: assistant",
                   "im_user: assistant, im_assistant: user")
    res = check_template(fmt, template("moonshotai-Kimi-K2.jinja"), cases=[get_case("basic")])
    c = res.cases[0]
    assert c.status == "fail"
    assert "trains text outside the assistant messages" in c.reason
    assert "What is the capital of France?" in c.reason


def test_a_template_variable_left_out_is_a_failure_not_a_skip():
    tpl = "{{ bos_token + messages[0].content }}"
    res = check_template(cg.load_format("kimi-k2"), tpl, cases=[get_case("basic")])
    assert res.cases[0].status == "fail"
    assert "bos_token" in res.cases[0].reason


def test_shapes_the_template_rejects_are_skipped_with_its_reason():
    tpl = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}"
           "{% endif %}" + template("moonshotai-Kimi-K2.jinja"))
    res = check_template(cg.load_format("kimi-k2"), tpl,
                         cases=[get_case("basic"), get_case("no-system")])
    assert [c.status for c in res.cases] == ["skip", "pass"]
    assert "no system role" in res.cases[0].reason


def test_marked():
    assert marked("abcdef", [(1, 3), (4, 5)]) == "a⟦bc⟧d⟦e⟧f"
