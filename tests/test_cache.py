"""The persistent compile cache (chatgrammar.core.cache): same results, never required, never stale,
and never a way to run code (JSON entries; a private directory; planted, corrupt or foreign
entries are rebuilt)."""
from __future__ import annotations

import json
import os
import pickle
import stat
import warnings
import subprocess
import sys
from pathlib import Path

import pytest

import chatgrammar as cg
from chatgrammar.core import cache
from chatgrammar.core.compile import Lark, _PassThroughLexer

ROOT = Path(__file__).resolve().parent.parent

SNIPPET = """
import json, time
import chatgrammar as cg
from chatgrammar.core import compile as c
from tests.kimi_tokenizers import kimi_k3_encoding, render_and_encode, template
calls = []
orig = c.Lark
c.Lark = lambda *a, **k: calls.append(1) or orig(*a, **k)
fmt = cg.load_format("kimi-k3")
enc = kimi_k3_encoding()
_, ids = render_and_encode(enc, template("moonshotai-Kimi-K3.jinja"), [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}])
mask = fmt.loss_mask(ids, enc)  # (first: cached tables decode, or are rebuilt, on first use)
print(json.dumps({"lark_builds": len(calls), "mask": mask,
                  "grammar": fmt.grammar, "path": fmt.path}))
"""


def _run(cache_dir: str) -> dict:
    env = dict(os.environ, CHATGRAMMAR_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, cwd=str(ROOT),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reads_the_cache_and_gets_the_same_result(tmp_path):
    first = _run(str(tmp_path))
    assert first["lark_builds"] == 1  # built once (kimi-k3 only)
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.json")) == ["lalr", "spec"]
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
    (tmp_path / "lalr-abc.json").write_bytes(b"not json")
    assert cache.load("lalr", "abc") is None
    # an entry copied under another key, or written by another cache version, is foreign
    assert cache.store("lalr", "def", [3]) is True
    (tmp_path / "lalr-abc.json").write_bytes((tmp_path / "lalr-def.json").read_bytes())
    assert cache.load("lalr", "abc") is None
    entry = json.loads((tmp_path / "lalr-def.json").read_bytes())
    (tmp_path / "lalr-def.json").write_text(json.dumps({**entry, "v": cache.CACHE_VERSION - 1}))
    assert cache.load("lalr", "def") is None


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
    monkeypatch.setattr(cg, "__version__", cg.__version__ + ".post1")
    try:
        assert cache.key_for("lalr", "start: A") != a  # the package version is in the key
    finally:
        monkeypatch.undo()
        cache.code_fingerprint.cache_clear()
    assert cache.key_for("lalr", "start: A") == a


def test_the_directory_is_created_private(tmp_path, monkeypatch):
    d = tmp_path / "a" / "cache"
    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(d))
    old = os.umask(0)
    try:
        assert cache.store("lalr", "k", [1]) is True
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "lalr-k.json").stat().st_mode) == 0o600


def _refused(d: Path, monkeypatch, why: str) -> None:
    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(d))
    before = sorted(p.name for p in d.iterdir())
    with pytest.warns(RuntimeWarning, match=why):
        assert cache.load("lalr", "k") is None  # (d holds a valid entry for k: not read)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per directory and reason
        assert cache.load("lalr", "k") is None
        assert cache.store("lalr", "k2", [1]) is False
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written


def _plant(d: Path) -> None:
    (d / "lalr-k.json").write_text(json.dumps({"v": cache.CACHE_VERSION, "kind": "lalr",
                                               "key": "k", "data": [1]}))


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o720])
def test_a_directory_others_can_write_is_refused_with_a_warning(tmp_path, monkeypatch, mode):
    d = tmp_path / "shared"
    d.mkdir()
    _plant(d)
    d.chmod(mode)
    _refused(d, monkeypatch, "writable by group or others")


@pytest.mark.skipif(not hasattr(os, "chown") or os.geteuid() != 0, reason="needs root to chown")
def test_a_directory_of_another_user_is_refused_with_a_warning(tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    _plant(d)
    os.chown(d, 4242, -1)
    _refused(d, monkeypatch, "owned by uid 4242")


@pytest.mark.skipif(not hasattr(os, "chown") or os.geteuid() != 0, reason="needs root to chown")
def test_an_entry_of_another_user_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(tmp_path))
    assert cache.store("lalr", "k", [1]) is True
    os.chown(tmp_path / "lalr-k.json", 4242, -1)
    assert cache.load("lalr", "k") is None
    (tmp_path / "lalr-k.json").unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps({"v": cache.CACHE_VERSION,
                                                          "kind": "lalr", "key": "k",
                                                          "data": [1]}))
    (tmp_path / "lalr-k.json").symlink_to(tmp_path / "elsewhere.json")
    assert cache.load("lalr", "k") is None  # (a symlink is never followed)


def test_off_disables_the_cache(tmp_path, monkeypatch):
    for off in ("off", "0", "none", ""):
        monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", off)
        assert cache.cache_dir() is None and cache.usable_dir(create=True) is None
        assert cache.store("lalr", "k", [1]) is False
        assert cache.load("lalr", "k") is None
    assert list(tmp_path.iterdir()) == []


def test_the_size_bound_evicts_the_oldest_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CHATGRAMMAR_CACHE_MAX_MB", str(10_000 / 2**20))  # 10,000 bytes
    (tmp_path / "mine.txt").write_text("x" * 5000)  # not ours: never counted nor removed
    old_pickle = tmp_path / ("spec-" + "0" * 40 + ".pkl")  # version 1: evicted first
    old_pickle.write_bytes(b"x" * 100)
    for i in range(8):  # (eviction only touches names this module writes: hex keys)
        assert cache.store("lalr", f"{i:040x}", "y" * 2000) is True
        os.utime(tmp_path / f"lalr-{i:040x}.json", (1_000_000 + i, 1_000_000 + i))
    names = {p.name for p in tmp_path.iterdir()}
    ours = [p for p in tmp_path.iterdir() if p.name.startswith("lalr-")]
    assert sum(p.stat().st_size for p in ours) <= 10_000
    assert "mine.txt" in names and old_pickle.name not in names
    kept = sorted(int(p.name[5:-5], 16) for p in ours)
    assert kept == list(range(8 - len(kept), 8)) and len(kept) >= 3  # the newest stay
    assert cache.load("lalr", f"{7:040x}") == "y" * 2000


def _keys(name: str) -> tuple[str, str]:
    fmt = cg.load_format(name)
    return (cache.key_for("spec", Path(fmt.path).read_bytes()),
            cache.key_for("lalr", fmt.grammar))


class _Payload:
    """Unpickling this runs ``open(target, "w")``: the side effect a planted pickle would have."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_planted_pickle_never_runs(tmp_path):
    # Version 1 unpickled whatever the directory held: a pickle planted under an entry's name
    # ran code when the format loaded. Now an entry is JSON; the pickle is a corrupt entry.
    spec_key, lalr_key = _keys("kimi-k3")
    target = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(str(target)))
    cdir = tmp_path / "cache"
    cdir.mkdir(mode=0o700)
    for kind, key in (("spec", spec_key), ("lalr", lalr_key)):
        for suffix in (".json", ".pkl"):
            (cdir / f"{kind}-{key}{suffix}").write_bytes(payload)
    pickle.loads(payload)  # (the payload works: unpickling it does create the file)
    assert target.exists()
    target.unlink()
    got = _run(str(cdir))
    assert not target.exists()
    assert got["lark_builds"] == 1 and sum(got["mask"]) > 0  # rebuilt, silently
    entry = json.loads((cdir / f"spec-{spec_key}.json").read_bytes())  # and now a real entry
    assert entry["key"] == spec_key and entry["kind"] == "spec"
    assert _run(str(cdir))["lark_builds"] == 0


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong-shape", "bad-state"])
def test_a_corrupt_or_foreign_entry_is_rebuilt(tmp_path, damage):
    cdir = tmp_path / "cache"
    first = _run(str(cdir))
    spec_key, lalr_key = _keys("kimi-k3")
    for kind, key in (("spec", spec_key), ("lalr", lalr_key)):
        p = cdir / f"{kind}-{key}.json"
        entry = json.loads(p.read_bytes())
        if damage == "garbage":
            p.write_bytes(os.urandom(256))
        elif damage == "truncated":
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
        elif damage == "wrong-shape":
            p.write_text(json.dumps({**entry, "data": {"states": "nope"}}))
        else:  # consistent JSON whose tables name a state that does not exist
            # (a spec entry holds its tables as one JSON string, decoded on first use)
            tables = json.loads(entry["data"]["tables"]) if kind == "spec" else entry["data"]
            tables["states"][0][2][0] = 2 * 10_000 + 1
            if kind == "spec":
                entry["data"]["tables"] = json.dumps(tables)
            p.write_text(json.dumps(entry))
    again = _run(str(cdir))
    assert again["lark_builds"] == 1 and again["mask"] == first["mask"]
    assert _run(str(cdir))["lark_builds"] == 0  # the rebuilt entries are read back


def test_entries_are_keyed_by_content_not_path(tmp_path, monkeypatch):
    from chatgrammar.core import compile as c, registry

    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(tmp_path / "cache"))
    src = Path(cg.load_format("chatml").path).read_bytes()
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_bytes(src)
    b.write_bytes(src)
    fa = cg.load_format(str(a))
    registry._load_path.cache_clear()
    c._lalr.cache_clear()
    built = []
    orig = c.Lark
    monkeypatch.setattr(c, "Lark", lambda *x, **k: built.append(1) or orig(*x, **k))
    fb = cg.load_format(str(b))
    assert built == []  # b's entry is a's
    assert (fa.path, fb.path) == (str(a), str(b))
    assert fb.source.where(("elements",))[0] == str(b)
    assert fb.source.marks == fa.source.marks  # (positions are read again from the bytes)


@pytest.mark.parametrize("name", cg.list_formats())
def test_spec_entries_round_trip_exactly(name):
    from chatgrammar.core.spec import read_spec

    fmt = cg.load_format(name)
    data = json.loads(json.dumps(cache.encode_spec(fmt.spec, fmt.source, fmt.tables)))
    spec, src, tables = cache.decode_spec(data, fmt.path, Path(fmt.path).read_bytes())
    assert spec == fmt.spec
    assert src.marks == read_spec(fmt.path)[1].marks and src.file == fmt.path
    assert (tables.grammar, tables.start_state, tables.end_state, tables.shift) == (
        fmt.tables.grammar, fmt.tables.start_state, fmt.tables.end_state, fmt.tables.shift)
    assert (tables.starters, tables.close_terms, tables.until_terms) == (
        fmt.tables.starters, fmt.tables.close_terms, fmt.tables.until_terms)
    assert tables.states.keys() == fmt.tables.states.keys()
    for s, acts in fmt.tables.states.items():
        assert acts.keys() == tables.states[s].keys()
        for t, (a, arg) in acts.items():
            b, brg = tables.states[s][t]
            assert b is a
            assert brg == arg  # a state, or a Lark Rule equal to the original


@pytest.mark.parametrize("name", cg.list_formats())
def test_tables_round_trip_exactly(name):
    # the driver's tables (built or loaded from the disk cache) are Lark's, action by action,
    # with Shift as `True` and Reduce as `False`
    fmt = cg.load_format(name)
    lk = Lark(fmt.grammar, parser="lalr", lexer=_PassThroughLexer, strict=True,
              maybe_placeholders=False)
    pt = lk.parser.parser.parser.parse_table
    from lark.parsers.lalr_analysis import Shift
    data = cache.decode_tables(json.loads(json.dumps(cache.encode_tables(*cache.dump_tables(
        pt.states, pt.start_states["start"], pt.end_states["start"], Shift)))))
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

def test_a_derived_spec_is_cached_with_its_chain_and_locates_like_a_fresh_load(tmp_path,
                                                                               monkeypatch):
    from chatgrammar.core import compile as c, registry, spec as spec_mod

    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(tmp_path / "cache"))
    base = tmp_path / "base.yaml"
    base.write_bytes(Path(cg.load_format("chatml").path).read_bytes()
                     .replace(b"name: chatml", b"name: base", 1))
    (tmp_path / "sub").mkdir()
    mid = tmp_path / "sub" / "mid.yaml"
    mid.write_text("name: mid\nextends: ../base.yaml\npolicy: {end_marker: true}\n")
    kid = tmp_path / "kid.yaml"
    kid.write_text("name: kid\nextends: sub/mid.yaml\n")
    fresh = cg.load_format(kid)
    registry._load_path.cache_clear()
    c._lalr.cache_clear()
    reads, builds = [], []
    orig_yaml, orig_lark = spec_mod.load_yaml, c.Lark
    monkeypatch.setattr(spec_mod, "load_yaml", lambda *a: reads.append(1) or orig_yaml(*a))
    monkeypatch.setattr(c, "Lark", lambda *a, **k: builds.append(1) or orig_lark(*a, **k))
    cached = cg.load_format(kid)
    assert (reads, builds) == ([], [])  # from the entry: no YAML read, no Lark build
    assert cached.spec == fresh.spec and cached.grammar == fresh.grammar
    text = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    assert cached.parse(text).spans() == fresh.parse(text).spans()
    # an inherited key is located in the base's file, as by a fresh load (read on demand)
    for loc in (("elements",), ("policy", "end_marker"), ("name",)):
        assert cached.source.where(loc) == fresh.source.where(loc)
    assert Path(cached.source.where(("elements",))[0]).resolve() == base.resolve()
    # a base edited: the entry does not hold any more; the edit is seen
    base.write_bytes(base.read_bytes() + b"\n# an edit\n")
    registry._load_path.cache_clear()
    reads.clear()
    again = cg.load_format(kid)
    assert reads and again.spec == fresh.spec


def test_a_cached_load_decodes_tables_and_builds_the_driver_on_first_use(tmp_path, monkeypatch):
    from chatgrammar.core import compile as c, registry

    monkeypatch.setenv("CHATGRAMMAR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "k3.yaml"
    path.write_bytes(Path(cg.load_format("kimi-k3").path).read_bytes())
    fresh = cg.load_format(path)
    registry._load_path.cache_clear()
    c._lalr.cache_clear()
    fmt = cg.load_format(path)
    assert isinstance(fmt.tables, cache.LazyTables) and fmt.tables.__dict__["_states"] is None
    assert "_driver" not in fmt.__dict__
    text = ("<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|>yo<|close|>message<|sep|><|end_of_msg|>")
    assert fmt.parse(text).spans() == fresh.parse(text).spans()
    assert fmt.tables.__dict__["_states"] is not None  # decoded once it parsed
    assert (fmt.tables.start_state, fmt.tables.end_state, fmt.tables.shift) == (
        fresh.tables.start_state, fresh.tables.end_state, True)
