"""Every crash or contract violation ever found, kept as data and replayed.

One JSON file per case under ``tests/data/regressions/<format>/<name>.json`` (the folder names
the format); each is a test of its own. Fields:

- ``description``: what broke and what the fixed behaviour is; ``found_by``: where it showed up.
- ``mode``: ``"text"`` or ``"ids"``.
- ``input``: a string (text mode), or a list (id mode) whose ints are ordinary ids of the fuzz
  tokenizer (:mod:`tests.fuzz_tokenizers`: Qwen ranks, so stable) or anything a tokenizer must
  survive (negative, out of range), and whose strings are marker texts, standing for that
  marker's special id (stable when a spec gains markers). Long inputs may be given as
  ``{"concat": [[piece, count], ...]}``: each piece (a string, or a list as above) repeated.
- ``tokenizer``: id mode only: ``"fuzz"`` (every marker one special id), ``"fuzz-hard"``
  (soft markers stay ordinary text, found in decoded runs), or a real tokenizer of
  ``tests.fuzz_tokenizers.REAL_TOKENIZERS`` (``"qwen"``, ``"mistral-v3"``, ``"phi3"``, ...).
- ``strict``: ``"ok"`` (parses) or ``"ParseError"`` (raises it, with an offset).
- ``spans`` (optional): the trained ``[start, end]`` spans of the lenient parse under the
  format's default policy; ``warnings`` (optional): whether lenient parsing reports any.

Whatever the file says, the contract is checked too: lenient parsing never raises and its mask
has one value per input position; strict parsing raises nothing but ``ChatGrammarError``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.errors import ChatGrammarError, ParseError
from tests.fuzz_tokenizers import marker_id_table, named_tokenizer

ROOT = Path(__file__).resolve().parent / "data" / "regressions"
CASES = sorted(ROOT.glob("*/*.json"))


def _expand(raw, mode: str, fmt, enc):
    """The input the case describes: text, or a list of ids."""
    if isinstance(raw, dict):
        parts = []
        for piece, count in raw["concat"]:
            parts.extend([_expand(piece, mode, fmt, enc)] * count)
        return "".join(parts) if mode == "text" else [i for p in parts for i in p]
    if mode == "text":
        assert isinstance(raw, str)
        return raw
    if isinstance(raw, str):
        raw = [raw]
    if hasattr(enc, "special_tokens_set"):  # tiktoken: the id encode() emits, not the adapter's
        return [i if isinstance(i, int) else enc.encode(i, allowed_special={i})[0] for i in raw]
    ids_of = {text: tid for tid, text in marker_id_table(fmt, enc).items()}
    return [i if isinstance(i, int) else ids_of[i] for i in raw]


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_regression(path):
    case = json.loads(path.read_text(encoding="utf-8"))
    # a folder may hold the spec its cases replay (a draft that is not bundled)
    spec = path.parent / "spec.yaml"
    fmt = cg.load_format(spec if spec.exists() else path.parent.name)
    mode = case["mode"]
    enc = None
    if mode == "ids":
        enc = named_tokenizer(fmt, case.get("tokenizer", "fuzz"))
    data = _expand(case["input"], mode, fmt, enc)

    def run(strict: bool):
        if mode == "text":
            return fmt.parse(data, strict=strict)
        return fmt.parse_ids(data, enc, strict=strict)

    # strict: the declared outcome, and never anything but a ChatGrammarError
    if case["strict"] == "ok":
        run(True)
    else:
        assert case["strict"] == "ParseError", case["strict"]
        with pytest.raises(ParseError) as info:
            run(True)
        assert info.value.offset is not None and 0 <= info.value.offset <= len(data)
    # lenient: never raises, one mask value per input position
    try:
        conv = run(False)
    except ChatGrammarError as exc:  # pragma: no cover - the failure message is the point
        pytest.fail(f"lenient parsing raised {exc!r}")
    mask = conv.mask()
    assert len(mask) == len(data)
    assert set(mask) <= {0, 1}
    if "spans" in case:
        assert [[s.start, s.end] for s in conv.spans()] == case["spans"]
    if "warnings" in case:
        assert bool(conv.warnings) == case["warnings"], conv.warnings


def test_regression_folders_name_formats():
    """A regression folder must name a bundled format, or hold the draft spec its cases replay
    (``spec.yaml``) (a typo would fail to load: catch it with a clear message)."""
    known = set(cg.list_formats())
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir()):
        assert folder.name in known or (folder / "spec.yaml").exists(), (
            f"{folder}: no bundled format {folder.name!r} and no spec.yaml")
