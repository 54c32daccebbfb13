"""The ``chatgrammar`` console script: validate, grammar, formats, schema, show.

The tests check exit codes and output: 0 ok, 1 problems found, 2 usage error, and a one-line
error (never a traceback) for bad input. Most run ``chatgrammar.cli.main`` in this process
(the same argv, stdin, cwd and COLUMNS as a subprocess would get; an uncaught exception becomes
a traceback on stderr and exit 1, as in a real run), because a subprocess pays interpreter
start and the package import each time (issue 14: most of this file's CPU). A few tests
(``real=True``, and ``python -m chatgrammar``) still run the real installed console script
(``chatgrammar``; ``python -m chatgrammar`` when it is not on PATH) in a subprocess, so the
entry point, its exit codes and its traceback-free errors stay covered end to end.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shutil
import subprocess
import runpy
import sys
import traceback
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
SPECS = DATA / "specs"
TEMPLATES = DATA / "templates"
FORMATS = ROOT / "formats"
K2, K2T, K3 = (str(TEMPLATES / n) for n in ("moonshotai-Kimi-K2.jinja",
                                            "moonshotai-Kimi-K2-Thinking.jinja",
                                            "moonshotai-Kimi-K3.jinja"))
K3_TEXT = ('<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
           '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>greet<|close|>think<|sep|>'
           '<|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|>'
           '<|end_of_msg|>')
SCRIPT = shutil.which("chatgrammar")
CMD = [SCRIPT] if SCRIPT else [sys.executable, "-m", "chatgrammar"]


def run(*args, stdin: str | None = None, cmd=None, real: bool = False
        ) -> subprocess.CompletedProcess:
    """Run the CLI with ``args``: in this process, unless ``real`` (the installed console
    script in a subprocess) or ``cmd`` names another command (``[sys.executable]`` with a
    tools/ script as first arg runs that script in this process; anything else, e.g.
    ``python -m chatgrammar``, a subprocess)."""
    argv = [str(a) for a in args]
    if real or (cmd is not None and cmd != [sys.executable]):
        env = {**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "200"}
        return subprocess.run([*(cmd or CMD), *argv], input=stdin, capture_output=True,
                              text=True, encoding="utf-8", env=env, cwd=ROOT, timeout=600)
    if cmd is None:
        from chatgrammar.cli import main
        entry = ["chatgrammar", *argv]
    else:  # [sys.executable, "tools/x.py", ...]: the script as __main__
        def main(_argv, script=str(ROOT / argv[0])):
            runpy.run_path(script, run_name="__main__")
        entry = argv
    return _in_process(main, entry, stdin)


def _in_process(main, argv: list[str], stdin: str | None) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    old = (sys.argv, sys.stdin, os.environ.get("COLUMNS"), os.getcwd())
    sys.argv, sys.stdin = argv, io.StringIO(stdin or "")
    os.environ["COLUMNS"] = "200"
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv[1:])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except Exception:  # what the interpreter would print, and its exit status
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.stdin = old[0], old[1]
        if old[2] is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old[2]
        os.chdir(old[3])
    return subprocess.CompletedProcess(argv, int(code or 0), out.getvalue(), err.getvalue())


def one_line_error(p: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


# ------------------------------------------------------------------ validate

def test_validate_good_specs():
    p = run("validate", SPECS / "good", "--isolated", "-v")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1] == "validate: ok (4 format specs checked)"
    assert p.stdout.count("ok   ") == 4
    assert "yaml, schema, patterns, compile, examples, precedence" in p.stdout


def test_validate_reports_every_problem_located_then_a_summary():
    bad = SPECS / "bad" / "wrong-types.yaml"
    p = run("validate", bad, "--isolated")
    assert p.returncode == 1
    lines = p.stdout.strip().splitlines()
    assert lines[-1] == "validate: 5 errors in 1 file (1 format spec checked)"
    assert f"{bad}:9:29::markers.a.special: Input should be a valid boolean, unable to " \
           "interpret input (got 'maybe')" in lines
    assert f"{bad}:12:37::elements.t.children_of: unknown key 'children_of'" in lines
    assert sum(1 for ln in lines if ln.startswith(f"{bad}:")) == 5


def test_validate_json_has_the_same_content():
    bad = SPECS / "bad" / "wrong-types.yaml"
    text = run("validate", bad, "--isolated")
    js = run("validate", bad, "--isolated", "--output", "json")
    assert js.returncode == 1
    data = json.loads(js.stdout)
    assert data["ok"] is False and data["files"][0]["kind"] == "format"
    rendered = [f"{q['file']}:{q['line']}:{q['col']}::{q['path']}: {q['message']}"
                for q in data["problems"]]
    assert rendered == text.stdout.strip().splitlines()[:-1]
    assert data["summary"] == text.stdout.strip().splitlines()[-1]
    assert {q["check"] for q in data["problems"]} == {"schema"}


def test_validate_compile_conflict_in_spec_terms():
    p = run("validate", SPECS / "bad" / "conflict-same-opener.yaml", "--isolated")
    assert p.returncode == 1
    assert "::elements.x: grammar is ambiguous (4 LALR conflicts): reduce/reduce conflict " \
           "after '<a><e>'" in p.stdout
    assert "    - element 'y' (elements.y): a e ·" in p.stdout


@pytest.mark.parametrize("args, needle", [
    (["validate", "no/such/spec.yaml"], "no such file: no/such/spec.yaml"),
    (["validate", "kimi-k"], "did you mean the bundled format 'kimi-k3'?"),
    (["validate", "kimi-k3", "--template", "no/such.jinja"], "no such file: no/such.jinja"),
    (["validate", "kimi-k3", "--var", "bos_token"], "--var takes KEY=VALUE"),
    (["validate", "kimi-k3", "--case", "nope"], "unknown matrix case(s) nope"),
    (["validate", "kimi-k3", "--tokenizer", "no/such/dir"], "no such tokenizer directory"),
])
def test_validate_usage_errors_are_one_line_exit_2(args, needle):
    p = run(*args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert needle in one_line_error(p)


def test_unreadable_inputs_exit_2(tmp_path):
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes("name: caf\xe9\n".encode("latin-1"))
    p = run("validate", binary)
    assert p.returncode == 2 and "not UTF-8" in one_line_error(p)
    (tmp_path / "empty").mkdir()
    p = run("validate", tmp_path / "empty")
    assert p.returncode == 2 and "no *.yaml files" in one_line_error(p)


def test_unknown_command_and_no_command_are_usage_errors():
    p = run("frobnicate", real=True)  # the installed console script, end to end
    assert p.returncode == 2 and "invalid choice: 'frobnicate'" in p.stderr
    assert "Traceback" not in p.stderr
    assert run(real=True).returncode == 2


def test_validate_real_kimi_templates_pass():
    p = run("validate", "kimi-k2", "--isolated", "--template", K2, "--template", K2T)
    assert p.returncode == 0, p.stdout
    assert f"kimi-k2 × {K2}: 20 pass, 0 fail, 0 skipped" in p.stdout
    assert f"kimi-k2 × {K2T}: 20 pass, 0 fail, 0 skipped" in p.stdout
    p = run("validate", "kimi-k3", "--isolated", "--template", K3, "-v")
    assert p.returncode == 0, p.stdout
    assert f"kimi-k3 × {K3}: 20 pass, 0 fail, 0 skipped" in p.stdout
    assert "  pass tool-call" in p.stdout


def test_validate_picks_the_format_of_a_template_from_the_specs_given():
    p = run("validate", "kimi-k2", "kimi-k3", "--isolated", "--template", K3, "--case", "basic")
    assert p.returncode == 0, p.stdout
    assert f"kimi-k3 × {K3}: 1 pass, 0 fail, 0 skipped" in p.stdout


def test_validate_mismatched_template_fails_and_shows_the_conversation():
    p = run("validate", "kimi-k3", "--isolated", "--template", K2)
    assert p.returncode == 1
    assert f"kimi-k3 × {K2}: 0 pass, 20 fail, 0 skipped" in p.stdout
    first = next(ln for ln in p.stdout.splitlines() if ln.startswith(K2))
    assert first == f"{K2}::basic: kimi-k3: does not parse (text mode): unexpected text at char 0"
    assert "[2] assistant: 'The capital of France is Paris.'" in p.stdout
    assert "<|im_assistant|>assistant<|im_middle|>The capital of France is Paris." in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("validate: 20 errors in 1 file")


def test_validate_template_mismatch_marks_expected_and_found_spans(tmp_path):
    spec = (FORMATS / "kimi-k2.yaml").read_text(encoding="utf-8")
    spec = spec.replace("    header: {until: im_middle, required: false}\n",
                        "    inner_markers: [im_middle]\n").replace("name: kimi-k2",
                                                                   "name: k2-variant")
    (tmp_path / "k2-variant.yaml").write_text(spec, encoding="utf-8")
    p = run("validate", tmp_path / "k2-variant.yaml", "--isolated", "--template", K2,
            "--case", "basic")
    assert p.returncode == 1
    assert "its header is trained from char 154: 'assistant<|im_middle|>'" in p.stdout
    assert "rendered, expected trained spans marked ⟦…⟧:" in p.stdout
    assert "<|im_middle|>⟦The capital of France is Paris.⟧<|im_end|>" in p.stdout
    assert "<|im_assistant|>⟦assistant<|im_middle|>The capital of France is Paris.⟧" in p.stdout


def test_validate_everything_bundled():
    """No PATH: every bundled format and norms.yaml, precedence proven over the whole set."""
    p = run("validate")
    summary = p.stdout.strip().splitlines()[-1]
    n = len([f for f in FORMATS.glob("*.yaml")
             if f.stem != "norms" and not f.name.endswith(".tests.yaml")])
    facts = len(list(FORMATS.glob("*.tests.yaml")))
    assert f"({n} format specs, 1 norms table, {facts} test-facts files checked)" in summary
    assert p.returncode == 0, p.stdout[-4000:]
    assert summary.startswith("validate: ok")


# ------------------------------------------------------------------ --tokenizer DIR

@pytest.fixture(scope="module")
def k3_tokenizer(tmp_path_factory):
    """A real byte-level BPE (Qwen's ranks) with Kimi-K3's four markers as special tokens,
    saved as a transformers tokenizer directory; returns (directory, tokenizer)."""
    from tests.tokenizers import qwen_fast_tokenizer
    tok = copy.deepcopy(qwen_fast_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|open|>", "<|close|>", "<|sep|>",
                                                          "<|end_of_msg|>"]})
    path = tmp_path_factory.mktemp("k3tok")
    tok.save_pretrained(str(path))
    return path, tok


def test_validate_with_a_tokenizer_directory(k3_tokenizer, tmp_path):
    k3_tokenizer_dir, tok = k3_tokenizer
    p = run("validate", "kimi-k3", "--isolated", "--tokenizer", k3_tokenizer_dir,
            "--template", K3, "--case", "basic", "--case", "tool-call", "--case", "unicode")
    assert p.returncode == 0, p.stdout
    assert f"kimi-k3 × {K3}: 3 pass, 0 fail, 0 skipped" in p.stdout
    # the same text as token ids, shown in id mode
    ids = tok(K3_TEXT, add_special_tokens=False)["input_ids"]
    (tmp_path / "ids.json").write_text(json.dumps(ids), encoding="utf-8")
    p = run("show", "-f", "kimi-k3", "--ids", "--tokenizer", k3_tokenizer_dir,
            tmp_path / "ids.json", "--output", "json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["mode"] == "ids" and data["length"] == len(ids)
    assert "".join(s["text"] for s in data["spans"]) == (
        "<|open|>think<|sep|>greet<|close|>think<|sep|><|open|>response<|sep|>Hello!"
        "<|close|>response<|sep|>")


def test_validate_reports_a_marker_that_is_not_one_special_id(k3_tokenizer, tmp_path):
    # the same tokenizer directory with <|sep|> taken out of its added tokens
    src, _ = k3_tokenizer
    d = tmp_path / "tok"
    d.mkdir()
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] != "<|sep|>"]
    (d / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in ("additional_special_tokens", "extra_special_tokens"):
        if isinstance(cfg.get(key), list):
            cfg[key] = [t for t in cfg[key] if t != "<|sep|>"]
    cfg.pop("added_tokens_decoder", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    p = run("validate", "kimi-k3", "--isolated", "--tokenizer", d)
    assert p.returncode == 1, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if "::markers.sep:" in ln)
    assert line.endswith(f"marker 'sep' ('<|sep|>') is not one special id of {d}: it is split "
                         "into several ids; id mode cannot see it (make it `special: false` if "
                         "it is an ordinary token)")
    assert "::markers.open:" not in p.stdout


# ------------------------------------------------------------------ grammar, formats, schema

def test_grammar():
    p = run("grammar", "kimi-k3")
    assert p.returncode == 0
    assert "e_message: M_OPEN TEXT? M_SEP (TEXT | e_element)* M_CLOSE TEXT? M_SEP " \
           "M_END_OF_MSG?" in p.stdout
    assert re.search(r"//\s+M_SEP\s+'<\|sep\|>'", p.stdout)
    js = json.loads(run("grammar", FORMATS / "kimi-k2.yaml", "--output", "json").stdout)
    assert js["format"] == "kimi-k2" and js["terminals"]["M_IM_END"] == "<|im_end|>"
    p = run("grammar", "kimi-k9")
    assert p.returncode == 2 and "Did you mean 'kimi-k" in one_line_error(p)
    p = run("grammar", SPECS / "bad" / "conflict-same-opener.yaml")
    assert p.returncode == 1 and "grammar is ambiguous" in p.stderr
    assert "Traceback" not in p.stderr


def test_formats():
    p = run("formats")
    assert p.returncode == 0
    k2 = next(ln for ln in p.stdout.splitlines() if ln.startswith("kimi-k2 "))
    assert "Kimi-K2-Thinking" in k2
    data = json.loads(run("formats", "--output", "json").stdout)
    by = {e["name"]: e for e in data}
    assert by["kimi-k3"]["covers"] == ["Kimi-K3"] and by["kimi-k3"]["origin"] == "bundled"
    assert {"kimi-k2", "kimi-k3"} <= set(by)


def test_schema_is_the_committed_copy_and_validates_specs(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    p = run("schema")
    assert p.returncode == 0
    committed = (ROOT / "docs" / "format-spec.schema.json").read_text(encoding="utf-8")
    assert p.stdout == committed, \
        "docs/format-spec.schema.json is stale: run `chatgrammar schema -o " \
        "docs/format-spec.schema.json`"
    assert run("schema", "-o", tmp_path / "s.json").returncode == 0
    assert (tmp_path / "s.json").read_text(encoding="utf-8") == committed
    schema = json.loads(committed)
    v = jsonschema.Draft202012Validator(schema)
    for f in [*FORMATS.glob("kimi-k?.yaml"), *(SPECS / "good").glob("*.yaml")]:
        errs = list(v.iter_errors(yaml.safe_load(f.read_text(encoding="utf-8"))))
        assert not errs, (f.name, [e.message for e in errs])
    bad = yaml.safe_load((SPECS / "bad" / "wrong-types.yaml").read_text(encoding="utf-8"))
    msgs = " | ".join(e.message for e in v.iter_errors(bad))
    assert "'maybe' is not of type 'boolean'" in msgs and "children_of" in msgs
    assert "does not match" in msgs  # the kebab-case name


def test_schema_describes_every_key():
    from chatgrammar.commands.schema import build_schema
    schema = build_schema()
    nodes = {"FormatSpec": schema, **schema["$defs"]}
    missing = [f"{m}.{k}" for m, node in nodes.items()
               for k, prop in node.get("properties", {}).items() if "description" not in prop]
    assert not missing, f"give these keys a Field(description=...) in chatgrammar/core/spec.py: " \
                        f"{missing}"
    assert all(node.get("description") for node in nodes.values())  # (model docstrings)


def test_the_guide_key_reference_is_generated_from_the_models(tmp_path):
    from chatgrammar.commands.schema import reference_markdown, splice_reference
    from chatgrammar.core.spec import FormatSpec
    guide = (ROOT / "docs" / "writing-a-format.md").read_text(encoding="utf-8")
    assert reference_markdown() in guide, \
        "the key reference of docs/writing-a-format.md is stale: run " \
        "`chatgrammar schema --markdown -o docs/writing-a-format.md`"
    assert splice_reference(guide) == guide
    for key, info in FormatSpec.model_fields.items():  # every description, word for word
        assert " ".join(info.description.split()).replace("|", "\\|") in reference_markdown()
    p = run("schema", "--markdown")
    assert p.returncode == 0 and p.stdout == reference_markdown()
    stale = tmp_path / "guide.md"
    stale.write_text(guide.replace("| `lstrip` |", "| `lstrip` (old) |"), encoding="utf-8")
    assert run("schema", "--markdown", "-o", stale).returncode == 0
    assert stale.read_text(encoding="utf-8") == guide
    (tmp_path / "plain.md").write_text("# no reference here\n", encoding="utf-8")
    p = run("schema", "--markdown", "-o", tmp_path / "plain.md")
    assert p.returncode == 2 and "no generated key reference" in p.stderr


def test_the_spec_policy_is_mask_policy():
    import dataclasses

    import chatgrammar as cg
    from chatgrammar.runtime.format import Format
    from chatgrammar.core.spec import Policy, parse_spec
    fields = dataclasses.fields(cg.MaskPolicy)
    assert list(Policy.model_fields) == [f.name for f in fields]  # exclude_kinds included
    for f in fields:
        assert Policy.model_fields[f.name].description == f.metadata["description"]
        assert f.name in cg.MaskPolicy.__doc__
    assert cg.MaskPolicy.from_mapping(Policy().model_dump()) == cg.MaskPolicy()
    # a spec's default policy takes every MaskPolicy field, exclude_kinds too
    text = (FORMATS / "kimi-k3.yaml").read_text(encoding="utf-8")
    text = text.replace("\npolicy:\n", "\npolicy:\n  exclude_kinds: [think]\n", 1)
    assert "exclude_kinds" in text
    fmt = Format(*parse_spec(text, "k3-no-think.yaml"))
    assert fmt.default_policy.exclude_kinds == ("think",)
    assert fmt.parse(K3_TEXT).trained_text() == [
        "<|open|>response<|sep|>Hello!<|close|>response<|sep|>"]


def test_the_guide_documents_every_key():
    from chatgrammar.commands.schema import build_schema
    guide = (ROOT / "docs" / "writing-a-format.md").read_text(encoding="utf-8")
    schema = build_schema()
    nodes = {"FormatSpec": schema, **schema["$defs"]}
    keys = {k for node in nodes.values() for k in node.get("properties", {})}
    undocumented = sorted(k for k in keys if f"`{k}`" not in guide)
    assert not undocumented, f"docs/writing-a-format.md does not document: {undocumented}"


# ------------------------------------------------------------------ show

@pytest.fixture
def k3_file(tmp_path):
    f = tmp_path / "k3.txt"
    f.write_text(K3_TEXT, encoding="utf-8")
    return f


def test_show_marks_trained_spans_with_turn_labels(k3_file):
    p = run("show", "-f", "kimi-k3", k3_file)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "turn 0 · user · trains nothing · chars [0, 73)" in lines
    assert "turn 1 · assistant · trains think, content · chars [73, 248)" in lines
    assert ('<|open|>message role="assistant"<|sep|>⟦<|open|>think<|sep|>greet<|close|>think'
            '<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|>⟧<|close|>message'
            '<|sep|><|end_of_msg|>') in lines
    assert lines[-1] == "2 turns, 99 of 248 chars trained (39.9%)"


def test_show_policy_flags(k3_file):
    p = run("show", "-f", "kimi-k3", k3_file, "--no-thinking", "--end-marker")
    assert p.returncode == 0
    assert ("greet<|close|>think<|sep|>⟦<|open|>response<|sep|>Hello!<|close|>response<|sep|>"
            "<|close|>message<|sep|><|end_of_msg|>⟧") in p.stdout
    assert "turn 1 · assistant · trains content, end" in p.stdout
    p = run("show", "-f", "kimi-k3", k3_file, "--roles", "user,assistant", "--last-turn-only",
            "--output", "json")
    spans = json.loads(p.stdout)["spans"]
    assert {s["turn"] for s in spans} == {1}
    p = run("show", "-f", "kimi-k3", k3_file, "--roles", "user", "--output", "json")
    data = json.loads(p.stdout)
    assert [s["text"] for s in data["spans"]] == ["Hi"] and data["policy"]["roles"] == ["user"]


def test_show_colours_in_a_terminal(k3_file):
    p = run("show", "-f", "kimi-k3", k3_file, "--color", "always")
    assert p.returncode == 0
    assert "\x1b[" in p.stdout and "⟦" not in p.stdout


def test_show_html(k3_file, tmp_path):
    out = tmp_path / "page.html"
    p = run("show", "-f", "kimi-k3", k3_file, "--html", out)
    assert p.returncode == 0 and out.is_file()
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert '<span class="t k-think" title="turn 1 · assistant · think">&lt;|open|&gt;think' in page
    assert '<span class="t k-content" title="turn 1 · assistant · content">' in page
    assert "turn 0 · user · trains nothing" in page


def test_show_reads_stdin_and_renders_messages_with_a_template():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    p = run("show", "-f", "kimi-k2", "--template", K2, stdin=json.dumps(messages))
    assert p.returncode == 0, p.stderr
    assert "<|im_assistant|>assistant<|im_middle|>⟦Hello!⟧<|im_end|>" in p.stdout


def test_show_parse_error_and_lenient():
    broken = '<|open|>message role="user"<|sep|>Hi<|close|>message<|open|>'
    p = run("show", "-f", "kimi-k3", stdin=broken, real=True)  # stdin and exit 1, end to end
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("chatgrammar: error: kimi-k3: unexpected open '<|open|>' at char")
    p = run("show", "-f", "kimi-k3", "--lenient", stdin=broken)
    assert p.returncode == 0
    assert "warning: at " in p.stdout


@pytest.mark.parametrize("args, needle", [
    (["show", "-f", "kimi-k3", "--ids"], "--ids needs --tokenizer DIR"),
    (["show", "no/such/file.txt", "-f", "kimi-k3"], "no such file: no/such/file.txt"),
    (["show", "-"], "which format? pass -f NAME"),
    (["show", "-f", "kimi-k9"], "Unknown format 'kimi-k9'"),
])
def test_show_usage_errors(args, needle):
    p = run(*args, stdin="")
    assert p.returncode == 2, p.stdout + p.stderr
    assert needle in one_line_error(p)


def test_conformance_runner():
    p = run("tools/conformance.py", "-f", "kimi-k2", "-f", "kimi-k3", cmd=[sys.executable])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| kimi-k2 | moonshotai-Kimi-K2-Thinking.jinja | 20 | 0 | 0 |" in p.stdout
    assert "| kimi-k3 | moonshotai-Kimi-K3.jinja | 20 | 0 | 0 |" in p.stdout
    # (kimi-k2's derived/ templates reject 5 tool shapes each)
    assert "5 pairs, 100 cases: 90 pass, 0 fail, 10 skipped." in p.stdout
    # what resolve_format uses, and the inference cross-check (or why inference refuses)
    assert "| 20 | 0 | 0 | bundled kimi-k2 | agree (20) |" in p.stdout
    assert "| 20 | 0 | 0 | bundled kimi-k3 | refused: user turns render" in p.stdout
    p = run("tools/conformance.py", "-f", "kimi-k4", cmd=[sys.executable])
    assert p.returncode == 2 and "unknown format(s): kimi-k4" in p.stderr


def test_python_dash_m_is_the_same_cli():
    p = run("grammar", "kimi-k2", cmd=[sys.executable, "-m", "chatgrammar"])
    assert p.returncode == 0 and "e_turn:" in p.stdout
