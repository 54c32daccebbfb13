"""The conformance checker's id mode with a real SentencePiece tokenizer (chatgrammar.conformance.templates).

Mistral's replies follow ``[/INST]`` with a space: SentencePiece encodes it into the first
token of the reply (``▁The``), and decoding that span alone drops the space. The checker must
read a span's text from the decoding of the whole sample, or it reports every case of the
bundled ``mistral`` format as failing (a checker bug, not a mask bug).
"""
from __future__ import annotations

from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.conformance.templates import check_template
from chatgrammar.conformance.matrix import default_matrix
from tests.tokenizers import mistral_tokenizer

TEMPLATE = (Path(__file__).resolve().parent / "data" / "templates"
            / "mistralai-Mistral-7B-Instruct-v0.3.jinja")


@pytest.mark.parametrize("fast", [True, False])
def test_mistral_real_tokenizer_keeps_the_leading_space(fast):
    tok = mistral_tokenizer("v3", fast=fast)
    cases = [c for c in default_matrix()
             if c.name in ("basic", "multi-turn", "unicode", "empty-assistant", "tool-call")]
    res = check_template(cg.load_format("mistral"), TEMPLATE.read_text(encoding="utf-8"),
                         name=TEMPLATE.name, tokenizer=tok, cases=cases)
    assert res.counts()["fail"] == 0, [(c.case, c.reason) for c in res.cases
                                       if c.status == "fail"]
    assert res.counts()["pass"] == len(cases)

