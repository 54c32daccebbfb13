"""The persistent compile cache (chatgrammar.cache): same results, never required, never stale."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar import cache
from chatgrammar.compile import Lark, _PassThroughLexer

ROOT = Path(__file__).resolve().parent.parent

SNIPPET = """
import json, time
import chatgrammar as cg
from chatgrammar import compile as c
from tests.kimi_tokenizers import kimi_k3_encoding, render_and_encode, template
calls = []
orig = c.Lark
c.Lark = lambda *a, **k: calls.append(1) or orig(*a, **k)
fmt = cg.load_format("kimi-k3")
enc = kimi_k3_encoding()
_, ids = render_and_encode(enc, template("moonshotai-Kimi-K3.jinja"), [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}])
print(json.dumps({"lark_builds": len(calls), "mask": fmt.loss_mask(ids, enc),
                  "grammar": fmt.grammar}))
"""


def _run(cache_dir: str) -> dict:
    env = dict(os.environ, CHATGRAMMAR_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, cwd=str(ROOT),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reads_the_cache_and_gets_the_same_result(tmp_path):
    first = _run(str(tmp_path))
    assert first["lark_builds"] == 1  # built once (kimi-k3 only)
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.pkl")) == ["lalr", "spec"]
    second = _run(str(tmp_path))
    assert second["lark_builds"] == 0  # tables from the cache
    assert second["mask"] == first["mask"] and sum(first["mask"]) > 0
    assert second["grammar"] == first["grammar"]
    off = _run("off")
    assert off["lark_builds"] == 1 and off["mask"] == first["mask"]


def test_read_only_or_missing_cache_dir_is_not_an_error(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(ro))
    try:
        if os.access(ro, os.W_OK):  # root ignores permissions: use a path under a file
            f = tmp_path / "a-file"
            f.write_text("x")
            monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(f / "cache"))
        assert cache.store("spec", "k", {"a": 1}) is False
        assert cache.load("spec", "k") is None
    finally:
        ro.chmod(stat.S_IRWXU)


def test_corrupt_entry_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(tmp_path))
    assert cache.store("lalr", "abc", [1, 2]) is True
    assert cache.load("lalr", "abc") == [1, 2]
    (tmp_path / "lalr-abc.pkl").write_bytes(b"not a pickle")
    assert cache.load("lalr", "abc") is None


def test_keys_depend_on_input_and_code(monkeypatch):
    a = cache.key_for("lalr", "start: A")
    assert a == cache.key_for("lalr", "start: A")
    assert a != cache.key_for("lalr", "start: B")
    cache.code_fingerprint.cache_clear()
    monkeypatch.setattr(cache, "CACHE_VERSION", cache.CACHE_VERSION + 1)
    try:
        assert cache.key_for("lalr", "start: A") != a
    finally:
        cache.code_fingerprint.cache_clear()


@pytest.mark.parametrize("name", cg.list_formats())
def test_tables_round_trip_exactly(name):
    # the driver's tables (built or loaded from the disk cache) are Lark's, action by action,
    # with Shift as `True` and Reduce as `False`
    fmt = cg.load_format(name)
    lk = Lark(fmt.grammar, parser="lalr", lexer=_PassThroughLexer, strict=True,
              maybe_placeholders=False)
    pt = lk.parser.parser.parser.parse_table
    from lark.parsers.lalr_analysis import Shift
    import pickle
    data = pickle.loads(pickle.dumps(cache.dump_tables(pt.states, pt.start_states["start"],
                                                       pt.end_states["start"], Shift)))
    # (Lark numbers states differently from one build to the next: the format's own tables
    # are checked for their form, the round trip for equality)
    assert fmt.tables.shift is True
    assert all(type(b) is bool for acts in fmt.tables.states.values() for b, _ in acts.values())
    assert len(fmt.tables.states) == len(pt.states)
    for states, start, end in (data[:3],):
        assert (start, end) == (pt.start_states["start"], pt.end_states["start"])
        assert states.keys() == pt.states.keys()
        for s, acts in pt.states.items():
            assert acts.keys() == states[s].keys()
            for t, (a, arg) in acts.items():
                b, brg = states[s][t]
                assert b is (a is Shift)
                if a is Shift:
                    assert brg == arg
                else:
                    assert (brg.origin.name, len(brg.expansion)) == (arg.origin.name,
                                                                     len(arg.expansion))