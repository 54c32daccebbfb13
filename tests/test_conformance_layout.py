"""The conformance checker on indentation-heavy templates (chatgrammar.conformance.templates).

Templates whose Jinja blocks are indented and not trimmed (chujiezheng's AmberChat and ChatQA,
vLLM's llava example) write other layout whitespace around their generation prompt
(``"\\n    ###Assistant:\\n"``) than around the message they render (``"        ###Assistant: A"``).
The checker reads the message's header as the prompt without that whitespace: what trains is the
answer after ``###Assistant:``, never the header and never the layout around it.
"""
from __future__ import annotations

from pathlib import Path

import chatgrammar as cg
from chatgrammar.conformance.matrix import default_matrix, render_case
from chatgrammar.conformance.templates import check_template

WILD = Path(__file__).resolve().parent / "data" / "templates" / "wild"
VARS = {"bos_token": "<s>", "eos_token": "</s>"}
CASES = ("basic", "multi-turn", "empty-assistant", "generation-prompt")

# an AmberChat spec as a user would write it: the header `###Assistant:`, the answer after it
AMBER = """
name: amber-draft
markers:
  bos: {text: "<s>", lstrip: true}
  human: {text: "###Human: ", special: false, lstrip: true}
  assistant: {text: "###Assistant:", special: false, lstrip: true}
elements:
  system: {role: system}
  user: {open: human, role: user, trim_end: true}
  reply: {open: assistant, role: assistant, trim_end: true}
top: [user, reply]
preamble: [bos, system]
generation_prompt: ["###Assistant:"]
"""


def _check(tmp_path, spec: str, *, trains_header: bool = False):
    text = spec.replace('"###Assistant:"', '"###Assistant"') if trains_header else spec
    path = tmp_path / "amber-draft.yaml"
    path.write_text(text, encoding="utf-8")
    fmt = cg.load_format(str(path))
    src = (WILD / "LLM360-AmberChat.jinja").read_text(encoding="utf-8")
    cases = [c for c in default_matrix() if c.name in CASES]
    return check_template(fmt, src, name="LLM360-AmberChat.jinja", cases=cases, variables=VARS)


def test_indented_prompt_whitespace_is_layout(tmp_path):
    res = _check(tmp_path, AMBER)
    assert res.counts()["fail"] == 0, [(c.case, c.reason) for c in res.cases]
    assert res.counts()["pass"] == len(CASES)


def test_a_trained_header_still_fails(tmp_path):
    # the same spec with the colon of the header in the body: it trains ":" of the header
    res = _check(tmp_path, AMBER, trains_header=True)
    assert res.counts()["fail"] > 0


def test_inference_captures_the_indented_templates():
    for name in ("LLM360-AmberChat.jinja", "nvidia-ChatQA.jinja", "vllm-template_llava.jinja"):
        src = (WILD / name).read_text(encoding="utf-8")
        fmt = cg.infer_format(src, **VARS)
        conv = fmt.parse(render_case(src, _case("basic"), **VARS).text)
        assert [t.strip() for t in conv.trained_text()] == ["The capital of France is Paris."], name


def _case(name: str):
    return next(c for c in default_matrix() if c.name == name)
