"""The families bundled for issue 11 §2, checked from their data: ``formats/<name>.tests.yaml``.

For every family in :data:`FAMILIES`, every template its ``.tests.yaml`` lists (under
tests/data/templates, provenance in SOURCES.md) is checked with
:func:`chatgrammar.conformance.templates.check_template` over the conversation matrix — text mode and id
mode with the one-id-per-marker tokenizer, then id mode with a tokenizer carrying the family's
``special_ids`` at their real ids (Qwen's byte-level BPE ranks renumbered around them, so marker
strings typed in text are ordinary BPE pieces) — and must fail no case. Detection: each template
detects as its family; a tokenizer with the family's special ids does too when the family has a
token detector, and families whose markers are all text (no token detector) say so.

Nothing here names a template or a case: adding a family is adding its name to FAMILIES and its
``.tests.yaml`` (the data-driven format suite reads the same files).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import yaml

import chatgrammar as cg
from chatgrammar.conformance.templates import check_template
from chatgrammar.errors import DetectionError

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ROOT / "formats"
TEMPLATES = ROOT / "tests" / "data" / "templates"

#: The families added by issue 11 §2 (each has formats/<name>.yaml and <name>.tests.yaml).
FAMILIES = ("llama2", "zephyr", "tulu", "deepseek-llm", "deepseek-coder", "exaone",
            "openchat", "chatglm3", "glm-edge", "idefics3",
            "hunyuan", "baichuan2", "starcoder2-instruct",
            "jamba")
#: More of issue 11 §2's families (a second statement, so that both lists merge cleanly).
FAMILIES += ("alpaca", "internlm2", "solar-instruct", "nemotron4", "falcon", "h2o-danube",
             "openbuddy", "orion", "magicoder", "sea-lion", "instructlab")
#: Added later (a third statement, for the same reason).
FAMILIES += ("vicuna", "metharme")
#: 2026 releases found in the wild (a fourth statement).
FAMILIES += ("exaone4.5", "sarvam", "functionary-v2")


@lru_cache(maxsize=None)
def _facts(name: str) -> dict:
    """The family's ``.tests.yaml`` (read once: every test of a family reads it, some twice;
    callers only read it)."""
    # (libyaml's safe loader, as chatgrammar.conformance.format_tests reads tests.yaml: this
    # runs at collection, in every worker)
    return yaml.load((FORMATS / f"{name}.tests.yaml").read_text(encoding="utf-8"),
                     Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}


def _template_params():
    out = []
    for name in FAMILIES:
        for t in _facts(name).get("templates", []):
            out.append(pytest.param(name, t["file"], t.get("vars") or {},
                                    id=f"{name}-{t['file']}"))
    return out


def _special_ids(name: str, template: str | None = None) -> dict:
    """The family's ``special_ids``, or a template entry's own (a template of the family whose
    model has another tokenizer)."""
    for t in _facts(name).get("templates", []):
        if template is not None and t["file"] == template and t.get("special_ids"):
            return dict(t["special_ids"])
    return dict(_facts(name).get("special_ids") or {})


def _encoding(name: str, template: str | None = None):
    """Qwen's BPE with the family's special ids at their real ids (ordinary ranks renumbered
    around them: the order of merges, hence every tokenisation of text, is Qwen's)."""
    specials = {str(k): int(v) for k, v in _special_ids(name, template).items()}
    taken = set(specials.values())
    assert len(taken) == len(specials), f"{name}: two special tokens share an id"
    key = tuple(specials.items())
    if _uses()[key] > 1:  # (nine families are over Llama 2's ids: one build for all of them)
        return _shared_encoding(key)
    return _encoding_of(name, key)


@lru_cache(maxsize=None)
def _uses():
    """How many families use each special-id table (the family's, or a template's own)."""
    from collections import Counter

    uses: Counter = Counter()
    for name in FAMILIES:
        tables = {tuple(_special_ids(name).items())} | {
            tuple(_special_ids(name, t["file"]).items()) for t in _facts(name).get("templates", [])}
        uses.update({tuple((str(k), int(v)) for k, v in t) for t in tables})
    return uses


@lru_cache(maxsize=None)  # (the few tables several families use; emptied after the module)
def _shared_encoding(specials: tuple):
    from tests.format_kit import renumbered_encoding

    return renumbered_encoding.__wrapped__("shared-test", specials)


@lru_cache(maxsize=4)  # each holds Qwen's ranks (~35 MB); tests run family by family
def _encoding_of(name: str, specials: tuple):
    # keyed by the special ids (content), not by the template asked about: a family's
    # templates that share its ids, and its bare tokenizer, are one build
    from tests.format_kit import renumbered_encoding

    # (format_kit's ranks are read once per module, renumbered without a sort of the table)
    return renumbered_encoding.__wrapped__(f"{name}-test", specials)


def _chars(spans) -> set[int]:
    return {i for a, b in spans for i in range(a, b)}


def _failures(res, accepted: dict) -> list[str]:
    """Failing cases that are not accepted. An accepted case (``accepted:`` of the .tests.yaml,
    with its reason) may fail only by not parsing (a located ParseError, never a wrong mask), by
    training less than the template's assistant output (nothing outside it), or by training
    whitespace the template writes where the model's output would start — never a word of
    another message."""
    assert res.error is None, res.error
    out = []
    for c in res.cases:
        if c.status != "fail":
            continue
        if c.case in accepted:
            if "does not parse" in c.reason:
                continue
            found, expected = _chars(c.found), _chars(c.expected)
            extra = found - expected
            assert c.text is not None and all(c.text[i].isspace() for i in extra), (
                f"{c.case}: accepted, but {c.reason}")
            continue
        out.append(f"{c.case}: {c.reason}")
    return out


@pytest.mark.parametrize("name,template,variables", _template_params())
def test_template_conformance(name, template, variables):
    """Text mode and id mode (one id per marker) train exactly the assistant output."""
    res = check_template(cg.load_format(name), (TEMPLATES / template).read_text(encoding="utf-8"),
                         name=template, variables=variables)
    assert not _failures(res, _facts(name).get("refused") or {})
    assert res.counts()["pass"] > 0


@pytest.mark.parametrize("name,template,variables", _template_params())
def test_template_conformance_real_ids(name, template, variables):
    """Id mode with the family's real special ids agrees with text mode."""
    if not _special_ids(name, template):
        pytest.skip("no special ids recorded")
    res = check_template(cg.load_format(name), (TEMPLATES / template).read_text(encoding="utf-8"),
                         name=template, variables=variables, tokenizer=_encoding(name, template),
                         tokenizer_name=f"{name} special ids")
    assert not _failures(res, _facts(name).get("refused") or {})


def _as_parts(messages):
    """The same conversation with every string content as one text part."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), str):
            m["content"] = [{"type": "text", "text": m["content"]}]
        out.append(m)
    return out


@pytest.mark.parametrize("name,template,variables", _template_params())
def test_template_conformance_without_system(name, template, variables):
    """For templates that reject system messages (``no_system: true`` in the .tests.yaml), the
    whole matrix again with its system messages removed."""
    if not _facts(name).get("no_system"):
        pytest.skip("the template takes system messages")
    import dataclasses

    from chatgrammar.conformance.matrix import default_matrix

    cases = [dataclasses.replace(c, messages=[m for m in c.messages if m.get("role") != "system"])
             for c in default_matrix()]
    res = check_template(cg.load_format(name), (TEMPLATES / template).read_text(encoding="utf-8"),
                         name=template, variables=variables, cases=cases)
    assert not _failures(res, _facts(name).get("refused") or {})
    assert res.counts()["pass"] >= len(cases) // 2


@pytest.mark.parametrize("name,template,variables", _template_params())
def test_template_conformance_content_parts(name, template, variables):
    """For templates that render only content parts (``content_parts: true`` in the
    .tests.yaml), the whole matrix again with every content as text parts."""
    if not _facts(name).get("content_parts"):
        pytest.skip("the template renders string contents")
    import dataclasses

    from chatgrammar.conformance.matrix import default_matrix

    cases = [dataclasses.replace(c, messages=_as_parts(c.messages)) for c in default_matrix()]
    res = check_template(cg.load_format(name), (TEMPLATES / template).read_text(encoding="utf-8"),
                         name=template, variables=variables, cases=cases)
    assert not _failures(res, _facts(name).get("refused") or {})
    assert res.counts()["pass"] >= len(cases) // 2


@pytest.mark.parametrize("name,template,variables", _template_params())
def test_template_detects_as_family(name, template, variables):
    src = (TEMPLATES / template).read_text(encoding="utf-8")
    assert cg.detect_format(chat_template=src).name == name


@pytest.mark.parametrize("name", FAMILIES)
def test_tokenizer_detection(name):
    """A tokenizer with the family's special ids detects as the family. A family whose turn
    markers are all text has no token detector: its tokenizer alone is never detected as it
    (it is not detected, or as the family whose special tokens the vocabulary carries)."""
    fmt = cg.load_format(name)
    d = fmt.spec.detect
    if (d.require or d.require_any) and not _facts(name).get("special_ids"):
        pytest.skip("token detector, but no special ids recorded")
    enc = _encoding(name)
    if d.require or d.require_any:
        assert cg.detect_format(enc).name == name
    else:
        try:
            got = cg.detect_format(enc).name
        except DetectionError:
            got = None
        assert got != name


@pytest.mark.parametrize("name,template,variables", _template_params())
def test_tokenizer_with_template_never_detects_another_family(name, template, variables):
    """The family's tokenizer together with its own template: the family, or a
    DetectionError (template-only families), never another format."""
    src = (TEMPLATES / template).read_text(encoding="utf-8")
    try:
        got = cg.detect_format(_encoding(name, template), chat_template=src).name
    except DetectionError:
        return
    assert got == name
