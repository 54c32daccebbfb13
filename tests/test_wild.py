"""Templates in the wild: what a user gets from each real chat template of
``tests/data/templates/wild`` (provenance in its SOURCES.md), pinned by its ``expected.yaml``.

For every template, ``tools/wild.py`` does what a user does: ``cg.detect_format(chat_template=T)``
and, when a bundled format is detected, checks it against the template over the whole
conversation matrix (``chatgrammar.conformance.templates.check_template``: the masks of every case, in
text mode and in id mode with one id per marker); else ``cg.infer_format(T)`` and the same check
of the inferred format. Each template is then ``detected`` / ``inferred`` (every case trains
exactly the assistant output), ``safe`` (a clear error: DetectionError and InferenceError, or
located ParseErrors on the shapes that do not fit) or ``SILENT WRONG``.

The test asserts:

- nothing is ever SILENT WRONG (a mask that differs with no error) and nothing crashes —
  except the known defects pinned ``SILENT WRONG`` (with their reason) in expected.yaml, which
  xfail until they are fixed;
- a template pinned ``bundled NAME`` or ``inferred`` stays fully correct (a detected bundled
  format must be NAME; detection may instead hand it to inference, which must then be right);
- a template pinned ``refused`` fails safely — or got better (it may become fully correct:
  run ``python tools/wild.py --write-expected`` to pin that);
- under every other mask policy a trainer uses (``chatgrammar.conformance.policies.POLICIES``)
  no case that passes with the default trains otherwise than the template says — except the
  known defects pinned under ``policy_wrong`` in expected.yaml (those may get fixed, never
  spread to another policy).

Cheap: about 0.2 s a template (inference is cached by template hash).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import wild  # noqa: E402  (tools/wild.py)

EXPECTED = wild.load_expected()
TEMPLATES = sorted(wild.WILD.glob("*.jinja"))


def test_every_wild_template_is_pinned():
    """Each template on disk has its expected outcome, and each pinned one is on disk."""
    on_disk = {p.name for p in TEMPLATES}
    pinned = {k for k, v in EXPECTED.items() if "outcome" in v}
    assert on_disk == pinned, (f"not pinned: {sorted(on_disk - pinned)}; "
                               f"gone: {sorted(pinned - on_disk)} "
                               "(python tools/wild.py --write-expected)")


def test_every_wild_template_has_its_source():
    """Provenance: every template has its line in wild/SOURCES.md."""
    sources = (wild.WILD / "SOURCES.md").read_text(encoding="utf-8")
    missing = [p.name for p in TEMPLATES if f"`{p.name}`" not in sources]
    assert not missing, missing


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.name for p in TEMPLATES])
def test_wild_template(path):
    entry = EXPECTED.get(path.name) or {}
    res = wild.classify(path, entry.get("vars"))
    detail = f"{res.outcome} ({res.format}): {res.reason}\n" + "\n".join(res.failures)
    if entry.get("outcome") == "SILENT WRONG" and res.outcome == "SILENT WRONG":
        # a known defect, pinned with its reason in expected.yaml (and listed in the report);
        # once fixed this passes and --write-expected pins the new outcome
        pytest.xfail(f"known silent wrong mask: {entry.get('reason', '')}")
    assert res.outcome not in ("SILENT WRONG", "CRASH"), detail
    want = entry.get("outcome", "")
    if want.startswith("bundled "):
        assert res.outcome in ("detected", "inferred"), detail
        if res.outcome == "detected":
            assert res.format == want.split(" ", 1)[1], detail
    elif want == "inferred":
        assert res.outcome in ("detected", "inferred"), detail
    elif want == "warned":
        assert res.outcome in ("warned", "detected", "inferred"), detail
    else:
        assert res.outcome in ("safe", "detected", "inferred"), detail
    known = entry.get("policy_wrong") or {}
    wrong = [f for f in res.policy_failures if f.partition(": ")[0] not in known]
    assert not wrong, "wrong under a mask policy:\n" + "\n".join(wrong)


def test_policy_counts_pinned():
    """The per-policy counts in expected.yaml are those of the templates pinned there: no
    template is wrong under a policy without its ``policy_wrong`` entry."""
    counts = wild.load_policy_counts()
    assert set(counts) == set(wild.POLICIES), "python tools/wild.py --write-expected"
    for name, tally in counts.items():
        pinned = sum(1 for e in EXPECTED.values() if name in (e.get("policy_wrong") or {}))
        assert tally["wrong"] == pinned, (name, tally, pinned)
