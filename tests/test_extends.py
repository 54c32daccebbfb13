"""`extends:` — a spec derived from a bundled format or another spec file."""
from __future__ import annotations

import re

import pytest

import chatgrammar as cg
from chatgrammar.core import registry
from chatgrammar.conformance.validate import validate_paths
from tests.fuzz_tokenizers import encode_rendered, format_encoding

# Phi-4's layout written as a change to ChatML: one more marker, a marker-ended header instead
# of a line, Phi-4's generation prompt. Everything else (elements, between, policy) is ChatML's.
PHI4_FROM_CHATML = """\
name: phi4-derived
extends: chatml
markers:
  im_sep: {text: "<|im_sep|>"}
elements:
  turn:
    header:
      until_text: null            # drop ChatML's line-ended header ...
      until: im_sep               # ... for one that ends at <|im_sep|>
      pattern: "(?P<role>[A-Za-z_][A-Za-z0-9_.-]*)"
      max_tokens: 16
generation_prompt: ["<|im_start|>assistant<|im_sep|>"]
"""


def _strip(text: str) -> str:
    return text.replace("⟦", "").replace("⟧", "")


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_a_derived_spec_parses_like_the_format_it_imitates(tmp_path):
    derived = cg.load_format(_write(tmp_path, "phi4-derived.yaml", PHI4_FROM_CHATML))
    phi4 = cg.load_format("phi4")
    assert derived.name == "phi4-derived"
    # inherited: ChatML's elements and policy; not inherited: detect, examples, covers
    assert set(derived.spec.elements) == set(cg.load_format("chatml").spec.elements)
    assert derived.spec.detect.require == [] and derived.spec.examples == []
    assert derived.spec.covers == []
    enc = format_encoding(phi4)
    for ex in phi4.spec.examples:
        text = _strip(ex.text)
        policy = cg.MaskPolicy(**ex.policy) if ex.policy else None
        want = phi4.parse(text).mask(policy)
        assert derived.parse(text).mask(policy) == want, ex.name
        ids = encode_rendered(enc, text)
        assert derived.loss_mask(ids, enc, policy=policy) == \
            phi4.loss_mask(ids, enc, policy=policy), ex.name
        assert [t.role for t in derived.parse(text).turns] == \
            [t.role for t in phi4.parse(text).turns]


def test_null_removes_inherited_entries_and_lists_are_replaced(tmp_path):
    p = _write(tmp_path, "slim.yaml", """\
name: slim
extends: chatml
policy: {roles: [assistant, user]}
between_markers: [endoftext]
""")
    slim = cg.load_format(p)
    assert slim.spec.policy.roles == ["assistant", "user"]
    assert slim.spec.policy.thinking == cg.load_format("chatml").spec.policy.thinking
    assert slim.spec.between_markers == ["endoftext"]
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
    got = [text[s.start:s.end] for s in slim.parse(text).spans()]
    assert got == ["Hi", "Yo"]
    # removing an element the base's turn still names is a located compile error
    p2 = _write(tmp_path, "broken.yaml", "name: broken\nextends: chatml\nelements:\n"
                "  think: null\n")
    with pytest.raises(cg.SpecError, match="think"):
        cg.load_format(p2)


def test_a_chain_of_files_relative_to_each_other(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path, "sub/mid.yaml", "name: mid\nextends: ../phi4-derived.yaml\n"
           "policy: {end_marker: true}\n")
    _write(tmp_path, "phi4-derived.yaml", PHI4_FROM_CHATML)
    top = cg.load_format(_write(tmp_path, "top.yaml", "name: top\nextends: sub/mid.yaml\n"
                                "policy: {thinking: false}\n"))
    assert top.spec.policy.end_marker is True and top.spec.policy.thinking is False
    text = "<|im_start|>user<|im_sep|>Q<|im_end|><|im_start|>assistant<|im_sep|>" \
           "<think>t</think>A<|im_end|>"
    conv = top.parse(text)
    assert "".join(text[s.start:s.end] for s in conv.spans()) == "A<|im_end|>"


def _err(path) -> cg.SpecError:
    with pytest.raises(cg.SpecError) as info:
        cg.load_format(path)
    return info.value


def test_errors_name_the_file_they_are_in(tmp_path):
    # an error in the child: the child's file and line
    e = _err(_write(tmp_path, "kid.yaml", "name: kid\nextends: chatml\nelements:\n  turn:\n"
                                          "    bogus: 1\n"))
    assert (e.file, e.line, e.col) == (str(tmp_path / "kid.yaml"), 5, 5), str(e)
    # an error inherited from the base: the base's file and line
    chatml = registry.bundled_paths()["chatml"].read_text(encoding="utf-8")
    bad = chatml.replace("elements:\n", "elements:\n  junk: {oops: 1}\n", 1)
    _write(tmp_path, "base.yaml", bad)
    e = _err(_write(tmp_path, "kid2.yaml", "name: kid2\nextends: base.yaml\n"))
    line = bad.splitlines().index("  junk: {oops: 1}") + 1
    assert (e.file, e.line) == (str(tmp_path / "base.yaml"), line), str(e)
    assert "oops" in str(e)


def test_unknown_bases_and_cycles_are_located_errors(tmp_path):
    e = _err(_write(tmp_path, "typo.yaml", "name: typo\nextends: chatmll\n"))
    assert (e.line, e.col) == (2, 10) and "did you mean 'chatml'" in str(e)
    e = _err(_write(tmp_path, "nofile.yaml", "name: nofile\nextends: ./missing.yaml\n"))
    assert e.line == 2 and "missing.yaml" in str(e)
    _write(tmp_path, "a.yaml", "name: a\nextends: b.yaml\n")
    _write(tmp_path, "b.yaml", "name: b\nextends: a.yaml\n")
    e = _err(tmp_path / "a.yaml")
    assert "cycle" in str(e) and re.search(r"a\.yaml -> .*b\.yaml -> .*a\.yaml", str(e))
    e = _err(_write(tmp_path, "num.yaml", "name: num\nextends: 3\n"))
    assert e.line == 2 and "extends" in str(e)
    e = _err(_write(tmp_path, "self.yaml", "name: self\nextends: self.yaml\n"))
    assert "cycle" in str(e)


def test_validate_reports_a_derived_spec(tmp_path):
    good = _write(tmp_path, "phi4-derived.yaml", PHI4_FROM_CHATML)
    bad = _write(tmp_path, "bad.yaml", "name: bad\nextends: chatml\nmarkers:\n"
                                       "  im_start: {text: [7]}\n")
    report = validate_paths([str(good), str(bad)], precedence_with_bundled=False)
    errors = [(p.file, p.line) for p in report.errors]
    assert errors == [(str(bad), 4)], [p.render() for p in report.problems]
    assert "phi4-derived" in report.formats


def test_an_edited_base_is_seen_by_its_derived_spec(tmp_path, monkeypatch):
    # the on-disk spec cache is keyed by the file's own bytes: a derived spec is never served
    # from it, so a change to its base takes effect
    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(tmp_path / "cache"))
    _write(tmp_path, "base.yaml", PHI4_FROM_CHATML.replace("name: phi4-derived", "name: base"))
    kid = _write(tmp_path, "kid.yaml", "name: kid\nextends: base.yaml\n")
    assert cg.load_format(kid).spec.policy.roles == ["assistant"]
    _write(tmp_path, "base.yaml", PHI4_FROM_CHATML.replace("name: phi4-derived", "name: base")
           + "policy: {roles: [user]}\n")
    registry._load_path.cache_clear()
    assert cg.load_format(kid).spec.policy.roles == ["user"]
