"""Templates that write a message as another role's turn (the spec key ``role_folds``).

Real templates (tests/data/templates/folds, provenance in wild/SOURCES.md; CISCai's Mistral in
wild/): Unsloth's ChatML and Zephyr templates write every role but user and assistant, tool
results included, as a system turn; CISCai's Mistral folds the system prompt into the last user
turn when tools are given; the first gpt-oss template writes an assistant message's content
beside a tool call as an ``analysis`` message. The format resolved for such a template parses
it exactly, and the default mask is right; a policy that trains one side of the fold and not
the other must never be silently wrong: the format declares the fold and every mask API warns.
"""
from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.conformance.folds import find_folds, with_role_folds
from chatgrammar.conformance.infer import resolve_format
from chatgrammar.conformance.matrix import default_matrix, get_case, render_case
from chatgrammar.conformance.templates import MarkerTokenizer
from chatgrammar.runtime.policy import warn_untyped

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import wild  # noqa: E402

DATA = ROOT / "tests" / "data" / "templates"

#: template -> (the format resolved for it, the folds it declares, the policy they change)
CASES = {
    "folds/unsloth-chatml.jinja": ("chatml", {"tool": "system"}, "roles+system"),
    "folds/unsloth-zephyr.jinja": ("inferred", {"tool": "system"}, "roles+system"),
    "wild/CISCai-Mistral-7B-Instruct-v0.3-SOTA-GGUF.jinja": (
        "mistral", {"system": "user"}, "roles+system"),
    "folds/EchoCog-gpt-oss-20b.jinja": ("harmony", {"content": "think"}, "thinking=False"),
}

SYSTEM = cg.MaskPolicy(roles=("assistant", "system"))


def _vars(text: str) -> dict:
    return wild.default_vars(text)


def _resolve(rel: str):
    text = (DATA / rel).read_text(encoding="utf-8")
    try:
        fmt, _ = resolve_format(chat_template=text)
    except cg.InferenceError:   # (Zephyr needs its eos_token: what its tokenizer passes)
        fmt = cg.infer_format(text, **_vars(text))
    return fmt, text


@pytest.mark.parametrize("rel", list(CASES))
def test_the_resolved_format_declares_the_fold(rel):
    name, folds, _ = CASES[rel]
    fmt, _ = _resolve(rel)
    assert fmt.name.startswith(name), fmt.name
    assert {k: fmt.spec.role_folds.get(k) for k in folds} == folds, fmt.spec.role_folds


def test_an_inferred_fold_is_in_its_yaml_and_survives_pickling():
    fmt, _ = _resolve("folds/unsloth-zephyr.jinja")
    assert "role_folds:\n  tool: system" in fmt.spec_yaml
    again = pickle.loads(pickle.dumps(fmt))   # (rebuilt from its YAML: the fold is there)
    assert again.spec.role_folds == {"tool": "system"}


@pytest.mark.parametrize("rel", list(CASES))
def test_the_policy_check_counts_the_fold_warned_never_wrong(rel):
    """tools/wild.py: the policy the fold changes is ``warned`` (was ``wrong``); no other
    policy is wrong, and the default outcome is fully correct."""
    _, _, policy = CASES[rel]
    expected = (wild.load_expected().get(Path(rel).name) or {}).get("vars")
    res = wild.classify(DATA / rel, expected)
    assert res.outcome in ("detected", "inferred"), res
    assert res.policies[policy] == "warned", res
    assert "wrong" not in res.policies.values(), res


def _mask_calls(fmt, text: str, policy) -> list[tuple[str, list]]:
    """Each mask API on one rendering, with what it warned."""
    tok = MarkerTokenizer.for_format(fmt)
    ids, _ = tok.encode_with_offsets(text)
    out = []
    for what, call in (("spans", lambda: fmt.parse(text).spans(policy)),
                       ("loss_mask", lambda: fmt.loss_mask(ids, tok, policy=policy)),
                       ("loss_masks", lambda: fmt.loss_masks([ids], tok, policy=policy))):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            call()
        out.append((what, [str(w.message) for w in said
                           if issubclass(w.category, cg.DeviationWarning)]))
    return out


def test_the_folded_format_is_one_object_per_template():
    """Detecting twice hands back the same format (its memo and tokenizer state stay warm)."""
    text = (DATA / "folds" / "unsloth-chatml.jinja").read_text(encoding="utf-8")
    assert cg.detect_format(chat_template=text) is cg.detect_format(chat_template=text)


def test_a_detected_fold_survives_pickling():
    """A worker process (hf.map_fn with num_proc) gets the fold with the format."""
    fmt, _ = _resolve("folds/unsloth-chatml.jinja")
    again = pickle.loads(pickle.dumps(fmt))
    assert again.name == "chatml" and again.spec.role_folds == {"tool": "system"}
    assert pickle.loads(pickle.dumps(cg.load_format("chatml"))).spec.role_folds == {}


def test_every_mask_api_warns_under_the_policy_a_fold_changes():
    fmt, text = _resolve("folds/unsloth-chatml.jinja")
    R = render_case(text, get_case("tool-call")).text
    for what, said in _mask_calls(fmt, R, SYSTEM):
        assert any("tool messages as system turns" in s and "role_folds" in s
                   for s in said), (what, said)
    for what, said in _mask_calls(fmt, R, cg.MaskPolicy(roles=("assistant", "tool"))):
        assert any("do not train with the tool role" in s for s in said), (what, said)


@pytest.mark.parametrize("rel", list(CASES))
def test_the_default_policy_neither_warns_nor_changes(rel):
    """A fold changes no default mask: the same masks as the format without it, silently."""
    fmt, text = _resolve(rel)
    plain = with_role_folds(fmt, {})
    assert plain.spec.role_folds == {}
    for case in default_matrix(tags={"tools"}):
        try:
            R = render_case(text, case, **_vars(text)).text
        except cg.TemplateError:
            continue
        for what, said in _mask_calls(fmt, R, None):
            assert not [s for s in said if "role_folds" in s], (case.name, what, said)
        assert fmt.parse(R).mask() == plain.parse(R).mask(), case.name


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja"])
def test_a_template_that_moves_nothing_declares_nothing(name):
    """ChatML as Qwen writes it (tool results as `<tool_response>` in a user turn, typed
    tool_response: no role's text) declares no fold, and roles+system says nothing of one."""
    text = (DATA / name).read_text(encoding="utf-8")
    fmt = cg.detect_format(chat_template=text)
    assert fmt.spec.role_folds == {}, fmt.spec.role_folds
    R = render_case(text, get_case("tool-call")).text
    for what, said in _mask_calls(fmt, R, SYSTEM):
        assert not [s for s in said if "role_folds" in s], (what, said)


def test_warn_untyped_says_a_fold_only_where_the_policy_splits_it():
    plain = {"role_folds": {"tool": "system", "content": "think"}}
    cases = [(cg.MaskPolicy(), 0), (SYSTEM, 1), (cg.MaskPolicy(roles=("assistant", "tool")), 1),
             (cg.MaskPolicy(roles=("assistant", "system", "tool")), 0),
             (cg.MaskPolicy(thinking=False), 1)]
    for policy, n in cases:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            warn_untyped("x", plain, policy)
        assert len(said) == n, (policy, [str(w.message) for w in said])
