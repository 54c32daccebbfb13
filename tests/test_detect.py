"""Format detection with declared precedence: tokenizers (tiktoken, minimal protocol, Kimi's
remote-code slow tokenizer), real chat templates, the template-as-evidence rule, the precedence
proof over bundled formats and entry-point plugins, and ``chatgrammar detect``.

The Kimi tokenizers carry Kimi's real special ids over Qwen's BPE ranks (tests/kimi_tokenizers.py).
The slow one (tests/kimi_tokenizers.py) is a faithful minimal equivalent of
``TikTokenTokenizer(PreTrainedTokenizer)`` from
Kimi's ``tokenization_kimi.py`` (:data:`TOKENIZATION_KIMI`), written to disk so the very same
file also serves as the remote code of a local tokenizer directory for ``AutoTokenizer``.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import tiktoken

import chatgrammar as cg
import chatgrammar.core.registry as registry
from chatgrammar.cli import main
from chatgrammar.core.detect import (PrecedenceError, check_precedence, detection_formats,
                                explain_detection)
from tests.kimi_tokenizers import (_NAMED, K2_SPECIALS, K3_SPECIALS, PAT_STR,
                                   kimi_k2_encoding, kimi_k3_encoding, kimi_slow_tokenizer,
                                   template, tokenizer_config, write_kimi_files)

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
K2_T, K2T_T, K3_T = ("moonshotai-Kimi-K2.jinja", "moonshotai-Kimi-K2-Thinking.jinja",
                     "moonshotai-Kimi-K3.jinja")
VARIANTS = ["k2", "k3", "k3+k2"]
EXPECTED = {"k2": "kimi-k2", "k3": "kimi-k3", "k3+k2": "kimi-k3"}


# --------------------------------------------------------------------------- tokenizers

def encoding(variant: str) -> tiktoken.Encoding:
    return {"k2": kimi_k2_encoding, "k3": kimi_k3_encoding,
            "k3+k2": lambda: kimi_k3_encoding(with_k2_strings=True)}[variant]()


class MinimalTokenizer:
    """The minimal protocol: ``convert_tokens_to_ids`` and ``decode``, nothing else. Unknown
    strings map to an unk id, as most tokenizers do (the caller must check the round trip)."""

    def __init__(self, enc: tiktoken.Encoding, unk: int = 163_839):
        self._enc, self._unk = enc, unk

    def convert_tokens_to_ids(self, token: str) -> int:
        try:
            return self._enc.encode_single_token(token)
        except KeyError:
            return self._unk

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

@pytest.fixture(scope="session")
def kimi_files(tmp_path_factory) -> Path:
    """tiktoken.model + tokenization_kimi.py (see tests/kimi_tokenizers.write_kimi_files)."""
    return write_kimi_files(tmp_path_factory.mktemp("kimi-files"))


@pytest.fixture(scope="session")
def kimi_slow(kimi_files):
    """variant -> Kimi's slow TikTokenTokenizer (built once per variant, shared)."""
    return lambda variant: kimi_slow_tokenizer(variant, kimi_files)


def make_tokenizer(kind: str, variant: str, kimi_slow):
    if kind == "tiktoken":
        return encoding(variant)
    if kind == "minimal":
        return MinimalTokenizer(encoding(variant))
    return kimi_slow(variant)


# --------------------------------------------------------------------------- the slow tokenizer

def test_slow_tokenizer_is_shaped_like_kimis(kimi_slow):
    k2, k3, k3k2 = kimi_slow("k2"), kimi_slow("k3"), kimi_slow("k3+k2")
    for s, i in K2_SPECIALS.items():
        assert k2.convert_tokens_to_ids(s) == i, s
    for s, i in K3_SPECIALS.items():
        assert k3.convert_tokens_to_ids(s) == i and k3k2.convert_tokens_to_ids(s) == i, s
    # K3 alone: K2's strings are not tokens at all (they fall back to [UNK]).
    assert k3.convert_tokens_to_ids("<|im_end|>") == 163_839
    # K3 with the constructor's default list: K2's strings appended past the base vocabulary.
    appended = {s: k3k2.convert_tokens_to_ids(s) for s in
                ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>")}
    assert all(i >= 163_840 for i in appended.values()), appended
    assert k3k2.decode([appended["<|im_end|>"]], skip_special_tokens=False) == "<|im_end|>"
    # Structural markers encode to one id; the same string typed as text would not.
    ids = k3.encode('<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>')
    assert ids[0] == 163_587 and ids[-1] == 163_586 and k3.decode(ids).startswith("<|open|>")
    assert 163_587 not in k3.encode("<|open|>", allow_special_tokens=False)


# --------------------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("kind", ["tiktoken", "minimal", "slow"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_detects_kimi_tokenizers(kind, variant, kimi_slow):
    tok = make_tokenizer(kind, variant, kimi_slow)
    fmt = cg.detect_format(tok)
    assert isinstance(fmt, cg.Format) and fmt.name == EXPECTED[variant]

    det = explain_detection(tok)
    assert det.format == EXPECTED[variant]
    found = det.evidence[EXPECTED[variant]]["tokens"]["found"]
    if variant == "k2":
        assert found == {s: K2_SPECIALS[s] for s in found}
        assert "kimi-k3" not in det.matched
    else:
        assert found == {s: K3_SPECIALS[s] for s in found} and len(found) == 4
    if variant == "k3":
        assert "kimi-k2" not in det.matched
    if variant == "k3+k2":
        # Both detectors match; the declared precedence decides, not registration order.
        assert {"kimi-k2", "kimi-k3"} <= set(det.matched)
        k2_ids = det.evidence["kimi-k2"]["tokens"]["found"]
        assert set(k2_ids) == {"<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"}
        assert all(i >= 163_840 for i in k2_ids.values()), k2_ids
        assert det.rule["kind"] == "precedence"
        assert det.rule["chains"]["kimi-k2"] == ["kimi-k3", "kimi-k2"]
        assert det.rule["declared_in"]["kimi-k3"].endswith("kimi-k3.yaml")
        assert "kimi-k3 takes precedence over" in det.decided_by


@pytest.mark.parametrize("order", [("kimi-k2", "kimi-k3"), ("kimi-k3", "kimi-k2")])
def test_order_of_the_format_set_is_irrelevant(order):
    fmts = [cg.load_format(n) for n in order]
    det = explain_detection(encoding("k3+k2"), formats=fmts)
    assert det.format == "kimi-k3" and det.rule["kind"] == "precedence"


def test_markers_spelled_by_ordinary_ids_do_not_count():
    # Qwen's BPE spells "<|open|>" etc. with several ordinary ids, and a minimal-protocol
    # tokenizer that maps the string to one ORDINARY id that does not decode back is rejected.
    enc = tiktoken.Encoding(name="kimi-none", pat_str=PAT_STR,
                            mergeable_ranks=kimi_k2_encoding()._mergeable_ranks,
                            special_tokens={"[BOS]": 163_584, "[EOS]": 163_585})

    class Liar(MinimalTokenizer):
        def convert_tokens_to_ids(self, token):
            return 27  # an ordinary id (it decodes to "<"), whatever the string

    for tok in (enc, MinimalTokenizer(enc), Liar(enc)):
        with pytest.raises(cg.DetectionError):
            explain_detection(tok, formats=[cg.load_format("kimi-k2"), cg.load_format("kimi-k3")])


@pytest.mark.parametrize("kind", ["tiktoken", "minimal", "slow"])
def test_no_markers_is_a_detection_error(kind, kimi_slow):
    enc = tiktoken.Encoding(name="kimi-none", pat_str=PAT_STR,
                            mergeable_ranks=kimi_k2_encoding()._mergeable_ranks,
                            special_tokens={**_NAMED, **{f"<|reserved_token_{i}|>": i for i in
                                                          range(163_586, 163_838)}})
    tok = {"tiktoken": enc, "minimal": MinimalTokenizer(enc),
           "slow": kimi_slow("none") if kind == "slow" else None}[kind]
    with pytest.raises(cg.DetectionError) as ei:
        cg.detect_format(tok)
    err = ei.value
    assert not isinstance(err, PrecedenceError)
    msg = str(err)
    assert msg.startswith("no format matches this tokenizer")
    # What was looked for, per format.
    assert "kimi-k2: special tokens <|im_user|>, <|im_assistant|>, <|im_middle|>, <|im_end|>" in msg
    assert "kimi-k3: special tokens <|open|>, <|close|>, <|sep|>, <|end_of_msg|>" in msg
    assert sorted(err.evidence["kimi-k3"]["tokens"]["missing"]) == sorted(K3_SPECIALS)


def test_nearest_candidates_are_ranked_by_evidence_found():
    enc = tiktoken.Encoding(name="kimi-half", pat_str=PAT_STR,
                            mergeable_ranks=kimi_k2_encoding()._mergeable_ranks,
                            special_tokens={"<|im_user|>": 163_587, "<|im_end|>": 163_586,
                                            "<|open|>": 163_600})
    with pytest.raises(cg.DetectionError) as ei:
        cg.detect_format(enc)
    err = ei.value
    # kimi-k2 has 2 of its 4 markers; others (kimi-k3: 1 of 4) rank after it.
    assert err.candidates[0] == "kimi-k2"
    assert str(err).splitlines()[0].startswith("no format matches this tokenizer (Encoding); "
                                               "nearest: kimi-k2")
    ranked = [line.split(":")[0].strip() for line in str(err).splitlines()[2:]]
    assert ranked.index("kimi-k2") < ranked.index("kimi-k3")
    assert "found 2 of 4; missing <|im_assistant|>, <|im_middle|>" in str(err)


def test_needs_some_input():
    with pytest.raises(cg.DetectionError, match="needs a tokenizer"):
        cg.detect_format()
    with pytest.raises(TypeError):
        cg.detect_format(object())


# --------------------------------------------------------------------------- templates

@pytest.mark.parametrize("name,expected", [(K2_T, "kimi-k2"), (K2T_T, "kimi-k2"),
                                           (K3_T, "kimi-k3")])
def test_real_templates(name, expected):
    src = template(name)
    assert cg.detect_format(chat_template=src).name == expected
    det = explain_detection(chat_template=src)
    assert det.inputs["template"] == "argument" and det.rule["kind"] == "only-match"
    assert det.evidence[expected]["template"]["status"] == "match"


@pytest.mark.parametrize("path", sorted(p for p in TEMPLATES.glob("*.jinja")
                                        if not p.name.startswith("moonshotai-")),
                         ids=lambda p: p.name)
def test_other_templates_never_detect_as_kimi(path):
    kimi = [cg.load_format("kimi-k2"), cg.load_format("kimi-k3")]
    with pytest.raises(cg.DetectionError, match="no format matches this chat template"):
        explain_detection(chat_template=path.read_text(encoding="utf-8"), formats=kimi)


# --------------------------------------------------------------------------- template + tokenizer

def with_template(tok, src):
    t = copy.copy(tok)
    t.chat_template = src
    return t


def test_tokenizer_template_agreeing_confirms(kimi_slow):
    # The K3 template rules kimi-k2 out on its own; precedence would have picked kimi-k3 anyway.
    det = explain_detection(with_template(kimi_slow("k3+k2"), template(K3_T)))
    assert det.format == "kimi-k3" and det.inputs["template"] == "tokenizer"
    assert {"kimi-k2", "kimi-k3"} <= set(det.matched) and "kimi-k2" not in det.candidates
    assert any("rules out kimi-k2" in n for n in det.notes)
    assert det.rule["kind"] == "template" and det.rule["precedence_alone"] == "kimi-k3"
    assert "precedence alone agrees" in det.decided_by


def test_tokenizer_template_can_rule_a_candidate_out(kimi_slow):
    # A K3 vocabulary whose chat template renders K2 markup: its data is K2-formatted, and K2's
    # markers are single ids of this tokenizer; picking K3 would fail on every sample.
    tok = with_template(kimi_slow("k3+k2"), template(K2_T))
    det = explain_detection(tok)
    assert det.format == "kimi-k2" and set(det.matched) >= {"kimi-k2", "kimi-k3"}
    assert "kimi-k3" not in det.candidates
    assert any("rules out kimi-k3" in n and "missing <|open|>" in n for n in det.notes)
    assert det.rule["template_ruled_out"] == ["kimi-k3"]
    assert "precedence alone would have picked kimi-k3" in det.decided_by


def test_tokenizer_template_cannot_override_tokens(kimi_slow):
    # K2 vocabulary carrying a K3 template: K3's markers are not ids of this tokenizer, so the
    # template cannot make it K3; and kimi-k2, what the tokens say, parses none of what that
    # template renders. Data rendered with the tokenizer's own template would get no correct
    # mask: an error naming both sides, never a silent pick.
    with pytest.raises(cg.DetectionError, match="does not parse the tokenizer's own chat "
                       "template") as ei:  # (one candidate: "it does not parse")
        explain_detection(with_template(kimi_slow("k2"), template(K3_T)))
    msg = str(ei.value)
    assert "kimi-k2: unparsable" in msg and "looks like kimi-k3" in msg
    assert ei.value.candidates == ["kimi-k2"]
    # without verification the token evidence is kept, the template's literals noted
    det = explain_detection(with_template(kimi_slow("k2"), template(K3_T)), verify=False)
    assert det.format == "kimi-k2" and det.verification == {}
    assert any("kimi-k3" in n and "token evidence kept" in n for n in det.notes)
    # the real K2 template verifies
    det = explain_detection(with_template(kimi_slow("k2"), template(K2_T)))
    assert det.format == "kimi-k2" and det.verification["kimi-k2"]["status"] == "verified"


def test_given_template_must_agree_with_tokenizer(kimi_slow):
    with pytest.raises(cg.DetectionError, match="disagree") as ei:
        cg.detect_format(kimi_slow("k2"), chat_template=template(K3_T))
    assert "kimi-k2" in str(ei.value) and "kimi-k3" in str(ei.value)
    assert set(ei.value.candidates) >= {"kimi-k2", "kimi-k3"}
    # Agreeing: the template picks among what the tokens allow.
    assert cg.detect_format(kimi_slow("k3+k2"), chat_template=template(K2_T)).name == "kimi-k2"
    assert cg.detect_format(kimi_slow("k3+k2"), chat_template=template(K3_T)).name == "kimi-k3"
    assert cg.detect_format(encoding("k2"), chat_template=template(K2T_T)).name == "kimi-k2"


def test_template_alone_does_not_make_a_tokenizer_match(kimi_slow):
    with pytest.raises(cg.DetectionError) as ei:
        cg.detect_format(with_template(kimi_slow("none"), template(K2_T)))
    assert "chat template looks like kimi-k2" in str(ei.value)


# --------------------------------------------------------------------------- verification

TULU2 = "allenai-tulu-2-7b.jinja"
GRITLM = "GritLM-GritLM-7B.jinja"   # Tulu 2's layout: the case verification exists for


def _loose_zephyr(tmp_path, over=("tulu",)) -> cg.Format:
    """Zephyr's spec with a detector that only asks for the tags (no `template_absent`):
    its literals accept Tulu 2's template, whose user turns have no EOS (GritLM's case)."""
    import yaml

    data = yaml.safe_load((ROOT / "formats" / "zephyr.yaml").read_text(encoding="utf-8"))
    data["name"] = "zephyr-loose"
    data["detect"] = {"template": ["<|user|>", "<|assistant|>"], "precedence_over": list(over)}
    data.pop("examples", None)
    p = tmp_path / "zephyr-loose.yaml"
    p.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    return cg.load_format(str(p))


@pytest.mark.parametrize("name", [TULU2, GRITLM])
def test_verification_rules_out_a_literal_match_that_masks_wrongly(tmp_path, name):
    src = (TEMPLATES / name).read_text(encoding="utf-8")
    loose, tulu = _loose_zephyr(tmp_path), cg.load_format("tulu")
    # marker evidence and precedence alone pick the loose Zephyr: every answer untrained
    assert explain_detection(chat_template=src, formats=[loose, tulu],
                             verify=False).format == "zephyr-loose"
    det = explain_detection(chat_template=src, formats=[loose, tulu])
    assert det.format == "tulu" and det.candidates == ["tulu"]
    assert det.verification["zephyr-loose"]["status"] == "wrong"
    assert "nothing of it is trained" in det.verification["zephyr-loose"]["reason"]
    assert det.verification["tulu"]["status"] == "verified"
    assert det.rule["verification_ruled_out"] == ["zephyr-loose"]
    assert det.rule["precedence_before_verification"] == "zephyr-loose"
    assert any("rules out zephyr-loose: wrong" in n for n in det.notes)
    assert "ruled out" in det.decided_by and "verified against the given" in det.decided_by
    # the order the formats come in changes nothing
    assert explain_detection(chat_template=src, formats=[tulu, loose]).format == "tulu"


def test_verification_failing_everywhere_is_an_error(tmp_path):
    src = (TEMPLATES / TULU2).read_text(encoding="utf-8")
    with pytest.raises(cg.DetectionError, match="does not parse the chat template "
                       "correctly") as ei:
        explain_detection(chat_template=src, formats=[_loose_zephyr(tmp_path, ())])
    assert ei.value.candidates == ["zephyr-loose"]
    assert ei.value.evidence["zephyr-loose"]["verification"]["status"] == "wrong"
    assert "zephyr-loose: wrong (" in str(ei.value)


def test_verification_is_cached_by_content(monkeypatch):
    import chatgrammar.conformance.templates as conformance
    import chatgrammar.core.detect as detect

    src = (TEMPLATES / "HuggingFaceH4-zephyr-7b-beta.jinja").read_text(encoding="utf-8")
    src += "{# a comment no other test renders #}"
    calls = []
    real = conformance.check_template
    monkeypatch.setattr(conformance, "check_template",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    first = explain_detection(chat_template=src)
    n = len(calls)
    assert first.format == "zephyr" and n >= 1
    again = explain_detection(chat_template=src)
    assert len(calls) == n and again.verification == first.verification
    # a fresh Format object of the same spec hits the same entry (keyed by content, not id)
    detect.verify_candidate(cg.load_format(str(ROOT / "formats" / "zephyr.yaml")), [src])
    assert len(calls) == n
    explain_detection(chat_template="{#- another #}" + src)   # another template: verified again
    assert len(calls) > n


def test_partial_verification_is_kept_with_a_note():
    # FairMind's Phi-3 fine-tune renders the system prompt as a user turn followed by an
    # empty `<|assistant|>` header: those shapes are a located ParseError for phi3 (Gemma 4's
    # one such shape is now refused on purpose: formats/gemma4.tests.yaml, `refused:`)
    src = (TEMPLATES / "wild" / "FairMind-Phi-3-mini-4k-instruct-bnb-4bit-Ita.jinja").read_text(
        encoding="utf-8")
    det = explain_detection(chat_template=src)
    assert det.format == "phi3" and det.verification["phi3"]["status"] == "partial"
    assert any("ParseError" in n for n in det.notes)


def test_every_bundled_template_detects_as_its_format_verified():
    """Each real template a format's test facts list (and that detects by template) is
    verified for that format: verification never loses a right answer."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the same data, ~7x faster
    for facts_file in sorted((ROOT / "formats").glob("*.tests.yaml")):
        name = facts_file.name[: -len(".tests.yaml")]
        for t in (yaml.load(facts_file.read_text(encoding="utf-8"), Loader=loader) or {}).get(
                "templates") or []:
            src = (TEMPLATES / t["file"]).read_text(encoding="utf-8")
            try:
                plain = explain_detection(chat_template=src, verify=False).format
            except cg.DetectionError:
                continue
            det = explain_detection(chat_template=src)
            status = det.verification[det.format]["status"]
            assert (det.format, status in ("verified", "partial")) == (
                plain, True), (t["file"], det.decided_by)


# --------------------------------------------------------------------------- the proof

def test_bundled_formats_prove_total_precedence():
    fmts = [cg.load_format(str(p)) for p, _ in registry.spec_sources()]
    problems = check_precedence(fmts)
    assert problems == [], "\n".join(str(p) for p in problems)
    assert {f.name for f in detection_formats()} >= {"kimi-k2", "kimi-k3"}


PLUGIN_TEMPLATE = """\
name: {name}
description: test plugin — K2-like turns plus an extra marker
markers:
  im_user: {{text: "<|im_user|>"}}
  im_assistant: {{text: "<|im_assistant|>"}}
  im_middle: {{text: "<|im_middle|>"}}
  im_end: {{text: "<|im_end|>"}}
  acme: {{text: "<|acme|>"}}
elements:
  turn:
    open: [im_user, im_assistant, acme]
    role_by_marker: {{im_user: user, im_assistant: assistant, acme: system}}
    header: {{until: im_middle, required: false}}
    close: {{markers: [im_end]}}
top: [turn]
detect:
{detect}
"""

# Overlaps kimi-k2 (a tokenizer with K2's markers and <|acme|> matches both); kept apart from
# kimi-k3 by `absent` (a tokenizer with XTML markers is not this K2 derivative).
OVERLAPS_K2 = """\
  require: ["<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<|acme|>"]
  absent: ["<|open|>"]
  template: ["<|acme|>"]
  template_absent: ["<|open|>"]"""


def plugin_spec(name: str, detect: str) -> str:
    return PLUGIN_TEMPLATE.format(name=name, detect=detect)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Install spec files as an entry-point plugin: a dist-info with an entry point of group
    ``chatgrammar.formats`` in a directory put on sys.path. Bundled formats are narrowed to
    kimi-k2 / kimi-k3 so each test sees exactly the plugin-vs-Kimi relation it sets up (the
    whole bundled set is proven by test_bundled_formats_prove_total_precedence)."""
    real = registry.bundled_paths
    monkeypatch.setattr(registry, "bundled_paths",
                        lambda: {k: v for k, v in real().items() if k in ("kimi-k2", "kimi-k3")})

    def install(specs: dict[str, str]) -> dict[str, Path]:
        mod = f"cg_plugin_{uuid.uuid4().hex[:10]}"
        spec_dir = tmp_path / f"{mod}_specs"
        spec_dir.mkdir()
        paths = {}
        for fname, text in specs.items():
            paths[fname] = spec_dir / fname
            paths[fname].write_text(text, encoding="utf-8")
        (tmp_path / f"{mod}.py").write_text(f"SPECS = {str(spec_dir)!r}\n", encoding="utf-8")
        dist = tmp_path / f"{mod}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {mod}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[chatgrammar.formats]\nacme = {mod}:SPECS\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        return paths

    return install


def k2_plus(extra: dict[str, int]) -> tiktoken.Encoding:
    base = kimi_k2_encoding()
    return tiktoken.Encoding(name="kimi-k2-plus", pat_str=PAT_STR,
                             mergeable_ranks=base._mergeable_ranks,
                             special_tokens={**base._special_tokens, **extra})


def test_plugin_overlapping_k2_without_order_is_an_error(plugins):
    paths = plugins({"acme.yaml": plugin_spec("acme", OVERLAPS_K2)})
    assert "acme" in cg.list_formats()
    with pytest.raises(PrecedenceError) as ei:
        cg.detect_format(encoding("k2"))  # even a tokenizer only K2 matches: the set is broken
    err = ei.value
    assert isinstance(err, cg.DetectionError) and isinstance(err, cg.SpecError)
    msg = str(err)
    assert str(paths["acme.yaml"]) in msg and str(ROOT / "formats" / "kimi-k2.yaml") in msg
    assert err.file == str(paths["acme.yaml"]) and err.path == "detect" and err.line
    assert set(err.formats) == {"acme", "kimi-k2"}
    assert "<|acme|>" in msg and "precedence_over" in msg


def test_plugin_with_declared_order_is_detected_as_declared(plugins):
    plugins({"acme.yaml": plugin_spec("acme", OVERLAPS_K2 + "\n  precedence_over: [kimi-k2]")})
    both = k2_plus({"<|acme|>": 163_600})
    det = explain_detection(both)
    assert det.format == "acme" and set(det.matched) == {"acme", "kimi-k2"}
    assert det.rule["chains"] == {"kimi-k2": ["acme", "kimi-k2"]}
    assert det.rule["declared_in"]["acme"].endswith("acme.yaml")
    assert cg.detect_format(encoding("k2")).name == "kimi-k2"
    assert cg.detect_format(encoding("k3+k2")).name == "kimi-k3"


def test_plugin_order_is_transitive(plugins):
    # acme > kimi-k3 > kimi-k2: acme and kimi-k2 overlap and are ordered through kimi-k3.
    plugins({"acme.yaml": plugin_spec("acme", OVERLAPS_K2 + "\n  precedence_over: [kimi-k3]")})
    det = explain_detection(k2_plus({"<|acme|>": 163_600}))
    assert det.format == "acme" and "kimi-k3" not in det.matched
    assert det.rule["chains"]["kimi-k2"] == ["acme", "kimi-k3", "kimi-k2"]
    assert "acme > kimi-k3 > kimi-k2" in det.decided_by


def test_plugin_made_disjoint_with_absent_needs_no_order(plugins):
    plugins({"acme.yaml": plugin_spec("acme", """\
  require: ["<|acme|>", "<|im_end|>"]
  absent: ["<|im_user|>", "<|open|>"]
  template: ["<|acme|>"]
  template_absent: ["<|im_assistant|>", "<|open|>"]""")})
    assert cg.detect_format(encoding("k2")).name == "kimi-k2"
    assert cg.detect_format(k2_plus({"<|acme|>": 163_600})).name == "kimi-k2"
    acme_only = tiktoken.Encoding(name="acme", pat_str=PAT_STR,
                                  mergeable_ranks=kimi_k2_encoding()._mergeable_ranks,
                                  special_tokens={"<|acme|>": 163_600, "<|im_end|>": 163_586})
    assert cg.detect_format(acme_only).name == "acme"


def test_template_overlap_alone_needs_an_order(plugins):
    paths = plugins({"acme.yaml": plugin_spec("acme", """\
  require: ["<|acme|>"]
  absent: ["<|im_user|>", "<|open|>"]
  template: ["<|acme|>"]
  template_absent: ["<|open|>"]""")})
    problems = check_precedence([cg.load_format(str(p)) for p, _ in registry.spec_sources()])
    assert len(problems) == 1 and set(problems[0].formats) == {"acme", "kimi-k2"}
    assert "one chat template" in str(problems[0]) and "one tokenizer" not in str(problems[0])
    assert str(paths["acme.yaml"]) in str(problems[0])


def test_precedence_cycle_is_an_error(plugins):
    a = plugin_spec("acme", OVERLAPS_K2 + "\n  precedence_over: [kimi-k2, acme-two]")
    b = plugin_spec("acme-two", OVERLAPS_K2 + "\n  precedence_over: [acme]")
    paths = plugins({"acme.yaml": a, "acme-two.yaml": b})
    with pytest.raises(PrecedenceError) as ei:
        cg.detect_format(encoding("k2"))
    problems = ei.value.problems
    cycles = [p for p in problems if p.message.startswith("precedence cycle:")]
    assert len(cycles) == 1
    assert set(cycles[0].formats) == {"acme", "acme-two"}
    assert str(paths["acme.yaml"]) in str(cycles[0]) and str(paths["acme-two.yaml"]) in str(cycles[0])
    assert "acme > acme-two > acme" in str(cycles[0])


def test_precedence_over_unknown_or_self_is_an_error(plugins):
    plugins({"acme.yaml": plugin_spec("acme", OVERLAPS_K2 + "\n  precedence_over: [kimi-k22]"),
             "zed.yaml": plugin_spec("zed", """\
  require: ["<|zed|>"]
  absent: ["<|im_user|>", "<|acme|>", "<|open|>"]
  precedence_over: [zed]""")})
    problems = check_precedence([cg.load_format(str(p)) for p, _ in registry.spec_sources()])
    text = "\n".join(str(p) for p in problems)
    assert "'kimi-k22', which is not a format" in text and "Did you mean 'kimi-k2'?" in text
    assert "zed declares precedence over itself" in text
    located = [p for p in problems if "kimi-k22" in p.message][0]
    assert located.path == "detect.precedence_over[0]" and located.line


def test_two_files_claiming_one_name_is_an_error(plugins):
    paths = plugins({"kimi-k2.yaml": plugin_spec("kimi-k2", OVERLAPS_K2)})
    with pytest.raises(PrecedenceError, match="declared by 2 spec files") as ei:
        cg.detect_format(encoding("k3"))
    assert str(paths["kimi-k2.yaml"]) in str(ei.value)
    assert str(ROOT / "formats" / "kimi-k2.yaml") in str(ei.value)


def test_proof_accepts_uncompiled_specs():
    from chatgrammar.core.spec import parse_spec

    a = parse_spec(plugin_spec("acme", OVERLAPS_K2), "acme.yaml")
    k2 = cg.load_format("kimi-k2")
    problems = check_precedence([a, k2])
    assert len(problems) == 1 and problems[0].file == "acme.yaml"


# --------------------------------------------------------------------------- CLI

def run_cli(capsys, *argv):
    rc = main(["detect", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_template(capsys):
    rc, out, err = run_cli(capsys, "--template", str(TEMPLATES / K3_T))
    assert rc == 0 and err == ""
    assert out.splitlines()[0].startswith("format:   kimi-k3")
    assert "decided:  kimi-k3 is the only format whose evidence matches" in out
    assert "<|open|> <|sep|> <|end_of_msg|>" in out

    rc, out, err = run_cli(capsys, "--template", str(TEMPLATES / K2T_T), "--output", "json")
    data = json.loads(out)
    assert rc == 0 and data["format"] == "kimi-k2"
    assert data["rule"] == {"kind": "only-match"}
    assert data["verification"]["kimi-k2"]["status"] == "verified"
    assert data["evidence"]["kimi-k2"]["template"]["found"] == ["<|im_assistant|>",
                                                                "<|im_middle|>"]


def test_cli_errors_are_one_line(capsys, tmp_path):
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    rc, out, err = run_cli(capsys, "--template", str(plain))
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith("chatgrammar detect: error: no format matches this chat template")
    assert "kimi-k2" in out and "Traceback" not in out + err

    rc, out, err = run_cli(capsys, "--template", str(plain), "--output", "json")
    assert rc == 1 and json.loads(out)["format"] is None

    for argv in (["--template", str(tmp_path / "missing.jinja")], [],
                 ["--tokenizer", str(tmp_path / "no-such-dir")],
                 ["--tokenizer", str(tmp_path)]):  # a directory with no tokenizer in it
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2, argv
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)


def write_kimi_dir(root: Path, kimi_files: Path, variant: str, chat_template: str | None) -> Path:
    d = root / f"kimi-{variant.replace('+', '-')}"
    d.mkdir()
    for name in ("tiktoken.model", "tokenization_kimi.py"):
        (d / name).write_bytes((kimi_files / name).read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(variant), indent=1))
    if chat_template is not None:
        (d / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return d


def test_cli_remote_code_tokenizer_needs_the_flag(capsys, tmp_path, kimi_files):
    d = write_kimi_dir(tmp_path, kimi_files, "k3+k2", None)
    rc, out, err = run_cli(capsys, "--tokenizer", str(d))
    assert rc == 2 and "--trust-remote-code" in err and len(err.strip().splitlines()) == 1


def test_cli_kimi_k3_tokenizer_directory(tmp_path, kimi_files):
    """End to end in a fresh process: AutoTokenizer loads the remote-code K3 tokenizer (which
    carries K2's strings) offline; detect prints kimi-k3 and the precedence rule."""
    # Like Kimi-K3's repository: no Jinja template (it renders in Python), so the tokens and
    # the declared precedence decide.
    d = write_kimi_dir(tmp_path, kimi_files, "k3+k2", None)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "chatgrammar", "detect", "--tokenizer", str(d),
           "--trust-remote-code"]
    p = subprocess.run(cmd + ["--output", "json"], capture_output=True, text=True, env=env,
                       cwd=str(ROOT), timeout=300)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["format"] == "kimi-k3" and data["inputs"]["template"] is None
    assert data["inputs"]["tokenizer"] == "TikTokenTokenizer"
    assert data["rule"]["chains"]["kimi-k2"] == ["kimi-k3", "kimi-k2"]
    assert all(v >= 163_840 for v in data["evidence"]["kimi-k2"]["tokens"]["found"].values())
    assert data["evidence"]["kimi-k3"]["tokens"]["found"] == K3_SPECIALS
