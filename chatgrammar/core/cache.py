"""Persistent compile cache: parsed specs and LALR tables, stored as JSON in a private directory.

Loading a format costs two things: reading its YAML (PyYAML's pure-Python composer, twice: for
values and for ``file:line:col`` marks) and Lark's LALR analysis. Both depend only on their
input and on the code that computes them, so both are cached on disk:

- ``spec-<key>.json``: a spec that compiled, with its parse tables, keyed by the spec file's
  bytes (not its path: the path is filled in on load, and the YAML positions errors are
  located with are composed again from those bytes only if an error needs one);
- ``lalr-<key>.json``: the parse tables of a grammar, keyed by the grammar text.

**Data, never code.** Entries are JSON: loading one runs ``json.loads`` and rebuilds plain
objects (pydantic validates the spec again, Lark ``Rule`` objects are constructed from names),
so a file planted in the directory can at worst be a wrong entry, never run anything. (An
authenticated pickle — an HMAC under a per-user key — was the alternative: it needs a secret
kept somewhere, and one leaked or shared key, e.g. a home directory mounted on many machines,
turns the cache back into code execution. JSON needs no secret and is about as fast here:
the tables are flat lists of names and numbers; a cached load of all bundled formats takes
~16 ms of CPU, against ~14 ms with pickles.) And against a *wrong* entry:

- the directory is created ``0700``; one owned by another user, or writable by group or others
  (a shared ``CHATGRAMMAR_CACHE_DIR`` on a cluster, ``/tmp``), is refused: the process runs
  without a cache and says so once (a :class:`RuntimeWarning`);
- an entry is read only when it is a regular file owned by the user (no symlink), records the
  key it was stored under and decodes to objects of the expected shape; anything else —
  corrupt, truncated, foreign, from another version — is ignored and silently rebuilt;
- every key hashes a *code fingerprint*: the package version, the source of the modules that
  produce the cached objects (``spec.py``, ``policy.py``, ``compile.py`` and its parts, this
  file), the versions of lark, pydantic and PyYAML, the Python version and
  :data:`CACHE_VERSION`, so an upgrade or a local edit never reads a stale entry.

Entries are written atomically (temporary file + ``os.replace``). The directory is bounded:
after a write, the oldest entries are removed until it holds at most :func:`max_bytes`
(``$CHATGRAMMAR_CACHE_MAX_MB``, default 64 MB; all bundled formats take about 0.4 MB). A
read-only, missing or refused directory just means no cache: nothing is ever required from it.

Location: ``$CHATGRAMMAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/chatgrammar``, else
``~/.cache/chatgrammar``. ``CHATGRAMMAR_CACHE_DIR=off`` (or ``0``, ``none``, empty) disables it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
import threading
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

from .compile import ParseTables

CACHE_VERSION = 3
_OFF = {"", "0", "off", "none", "false", "no"}
_SUFFIX = ".json"
#: names this module writes (``.pkl``: version 1's pickles, never read, evicted first)
_OURS = re.compile(r"(?:spec|lalr)-[0-9a-f]{40}\.(?:json|pkl)|\.(?:spec|lalr)-.*\.tmp")
_DEFAULT_MAX_MB = 64
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_warned: set[tuple[str, str]] = set()
_decode_lock = threading.Lock()  # (LazyTables: one decode per entry, whatever the threads)


def cache_dir() -> Path | None:
    """The configured cache directory, or None when caching is disabled.

    This is where the cache would live; whether it is used is decided by
    :func:`usable_dir` (which refuses a directory others can write).
    """
    env = os.environ.get("CHATGRAMMAR_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "chatgrammar"


def max_bytes() -> int:
    """The size bound of the cache directory, in bytes (``$CHATGRAMMAR_CACHE_MAX_MB``)."""
    try:
        mb = float(os.environ.get("CHATGRAMMAR_CACHE_MAX_MB", _DEFAULT_MAX_MB))
    except ValueError:
        mb = _DEFAULT_MAX_MB
    return max(0, int(mb * 1024 * 1024))


def _uid() -> int | None:
    geteuid = getattr(os, "geteuid", None)  # (not on Windows: no owner check there)
    return geteuid() if geteuid is not None else None


def _refusal(st: os.stat_result) -> str | None:
    """Why a directory with this ``stat`` may not hold the cache, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _warn_once(d: Path, why: str) -> None:
    if (str(d), why) in _warned:
        return
    _warned.add((str(d), why))
    warnings.warn(f"chatgrammar: compile cache disabled: {d} {why}; formats still load, "
                  f"uncached (use a private directory, or CHATGRAMMAR_CACHE_DIR=off)",
                  RuntimeWarning, stacklevel=3)


def usable_dir(create: bool = False) -> Path | None:
    """The cache directory when it may be used, else None (disabled, missing, or refused with
    a one-time warning).

    Args:
        create: create a missing directory (``0700``; parents with the default mode).
    """
    d = cache_dir()
    if d is None:
        return None
    try:
        st = os.stat(d)
    except FileNotFoundError:
        if not create:
            return None
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)  # (makedirs' mode is filtered by the umask)
            st = os.stat(d)
        except OSError:
            return None
    except OSError:
        return None
    why = _refusal(st)
    if why is not None:
        _warn_once(d, why)
        return None
    return d


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Hash of everything that shapes a cached object besides its own input."""
    from .. import __version__

    h = hashlib.sha256(f"chatgrammar-{__version__}-cache-{CACHE_VERSION}|{sys.version}".encode())
    from . import compile, compile_checks, compile_conflicts, compile_grammar, compile_regex
    from ..runtime import policy
    from . import spec

    # the modules by object, not by file name, so the hash follows them wherever they live
    for mod in (spec, policy, compile, compile_checks, compile_grammar, compile_regex,
                compile_conflicts, sys.modules[__name__]):
        try:
            h.update(Path(mod.__file__).read_bytes())
        except OSError:
            h.update(mod.__name__.encode())
    for mod in ("lark", "pydantic", "yaml"):
        try:
            h.update(f"{mod}={__import__(mod).__version__}".encode())
        except Exception:
            h.update(mod.encode())
    return h.hexdigest()


def key_for(*parts: bytes | str) -> str:
    """A cache key: the fingerprint and ``parts``, hashed (40 hex digits)."""
    h = hashlib.sha256(code_fingerprint().encode())
    for p in parts:
        b = p.encode("utf-8", "surrogatepass") if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:40]


def _read(d: Path, name: str) -> bytes | None:
    """The bytes of entry ``name`` if it is a regular file of this user, not a symlink."""
    try:
        fd = os.open(d / name, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        uid = _uid()
        if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def load(kind: str, key: str) -> Any | None:
    """The JSON value stored under ``(kind, key)``, or None (absent, disabled, refused,
    unreadable, corrupt or stored under another key: never an error)."""
    d = usable_dir()
    if d is None:
        return None
    raw = _read(d, f"{kind}-{key}{_SUFFIX}")
    if raw is None:
        return None
    try:
        entry = json.loads(raw)
        if entry["kind"] == kind and entry["key"] == key and entry["v"] == CACHE_VERSION:
            return entry["data"]
    except Exception:
        pass
    return None


def store(kind: str, key: str, obj: Any) -> bool:
    """Write the JSON value ``obj`` atomically; False (silently) when the cache cannot be
    written (disabled, refused, read-only, or ``obj`` is not JSON)."""
    d = usable_dir(create=True)
    if d is None:
        return False
    try:
        blob = json.dumps({"v": CACHE_VERSION, "kind": kind, "key": key, "data": obj},
                          ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError):
        return False
    # (a unique name: concurrent writers of one key each replace the entry atomically; a
    # temporary file left by a crash counts toward the size bound and is evicted with the rest)
    tmp = d / f".{kind}-{key}.{os.getpid()}-{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, d / f"{kind}-{key}{_SUFFIX}")
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except Exception:
        return False
    _evict(d, max_bytes())
    return True


def _evict(d: Path, limit: int) -> None:
    """Remove this module's oldest files from ``d`` until they total at most ``limit`` bytes
    (version 1's pickles first, then by modification time)."""
    try:
        entries = []
        with os.scandir(d) as it:
            for e in it:
                if _OURS.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    entries.append((not e.name.endswith(".pkl"), st.st_mtime, e.name,
                                    st.st_size))
    except OSError:
        return
    total = sum(e[3] for e in entries)
    if total <= limit:
        return
    for _, _, name, size in sorted(entries):
        try:
            os.unlink(d / name)
        except OSError:
            continue
        total -= size
        if total <= limit:
            return


# ----------------------------------------------------------------------------- LALR tables

def dump_tables(states: dict, start: int, end: int, shift: Any) -> tuple:
    """Lark's parse table in the form the driver uses: each action is ``(is_shift, arg)``
    (Lark's ``Shift`` / ``Reduce`` are singletons compared with ``is``; ``arg`` is the next
    state or the Lark rule to reduce).

    Returns:
        ``(states, start, end)``; :func:`encode_tables` makes it JSON.
    """
    return ({s: {t: (a is shift, arg) for t, (a, arg) in acts.items()}
             for s, acts in states.items()}, start, end)


def encode_tables(states: dict, start: int, end: int) -> dict:
    """The driver's tables (see :func:`dump_tables`) as a JSON value of names and integers
    (flat integer lists: they decode fastest).

    - ``names``: every string, once (row keys, symbol names, aliases);
    - ``symbols``: ``[name, flags]`` pairs, flattened (flags: 1 terminal, 2 ``filter_out``);
    - ``options``: Lark ``RuleOptions`` as lists; ``null`` for none;
    - ``rules``: ``[origin symbol, order, alias name or -1, options, expansion symbols…]``;
    - ``states``: ``[state, [name, …], [code, …]]``, code ``2 * next_state + 1`` for a shift
      and ``2 * rule`` for a reduce.

    Example:
        >>> states, s, e = decode_tables(encode_tables(states, s, e))  # doctest: +SKIP
    """
    names: list = []
    symbols: list = []
    options: list = []
    rules: list = []
    index: dict = {}

    def intern(table: list, key: Any, item: Any, width: int = 1) -> int:
        i = index.get(key)
        if i is None:
            i = index[key] = len(table) // width
            table.extend(item) if width > 1 else table.append(item)
        return i

    def name(x: str) -> int:
        return intern(names, ("n", x), x)

    def sym(x: Any) -> int:
        flags = (1 if x.is_term else 0) | (2 if getattr(x, "filter_out", False) else 0)
        return intern(symbols, ("s", x.name, flags), (name(x.name), flags), 2)

    def rule(r: Any) -> int:
        i = index.get(("r", id(r)))
        if i is None:
            o = r.options
            opts = None if o is None else [o.keep_all_tokens, o.expand1, o.priority,
                                           o.template_source, list(o.empty_indices)]
            k = intern(options, ("o", repr(opts)), opts)
            i = index[("r", id(r))] = len(rules)
            rules.append([sym(r.origin), r.order, -1 if r.alias is None else name(r.alias), k,
                          *map(sym, r.expansion)])
        return i

    rows = []
    for s, acts in states.items():
        keys = [name(t) for t in acts]
        codes = [2 * arg + 1 if is_shift else 2 * rule(arg) for is_shift, arg in acts.values()]
        rows.append([s, keys, codes])
    return {"names": names, "symbols": symbols, "options": options, "rules": rules,
            "states": rows, "start": start, "end": end}


def decode_tables(data: dict) -> tuple:
    """Inverse of :func:`encode_tables`: ``(states, start, end)`` with Lark ``Rule`` objects
    rebuilt from names (only names and numbers are read: nothing in the data can execute).

    Raises:
        Exception: (KeyError, TypeError, ValueError, IndexError) ``data`` is not an encoding
            of consistent tables.
    """
    from lark.grammar import NonTerminal, Rule, RuleOptions, Terminal

    names = data["names"]
    if not all(type(n) is str for n in names):
        raise TypeError("names")
    flat = data["symbols"]
    symbols = [Terminal(names[flat[j]], bool(flat[j + 1] & 2)) if flat[j + 1] & 1
               else NonTerminal(names[flat[j]]) for j in range(0, len(flat), 2)]
    options = [None if o is None else RuleOptions(
        bool(o[0]), bool(o[1]), o[2] if type(o[2]) is int else None,
        o[3] if type(o[3]) is str else None, tuple(map(bool, o[4]))) for o in data["options"]]
    rules = [Rule(symbols[r[0]], [symbols[x] for x in r[4:]], r[1],
                  None if r[2] < 0 else names[r[2]], options[r[3]]) for r in data["rules"]]
    rows = data["states"]
    ids = [r[0] for r in rows]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise TypeError("state")
    # One shared action tuple per code; every code must name a state or a rule that exists.
    actions: list = [None] * (2 * max(max(ids, default=0), len(rules)) + 2)
    for i in ids:
        actions[2 * i + 1] = (True, i)
    for i, r in enumerate(rules):
        actions[2 * i] = (False, r)
    states = {}
    for i, keys, codes in rows:
        if len(keys) != len(codes) or min(codes, default=0) < 0 or min(keys, default=0) < 0:
            raise ValueError("row")
        row = dict(zip(map(names.__getitem__, keys), map(actions.__getitem__, codes)))
        if None in row.values():
            raise ValueError("an action naming no state or rule")
        states[i] = row
    start, end = data["start"], data["end"]
    if start not in states or end not in states:
        raise ValueError("start / end state")
    return states, start, end


# ----------------------------------------------------------------------------- compiled specs

def encode_spec(spec: Any, src: Any, tables: Any, bases: list | None = None) -> dict:
    """A compiled spec — ``(FormatSpec, SpecSource, ParseTables)`` — as a JSON value.

    Not stored: the file name (entries are keyed by content) and the source positions (they
    are needed only to locate an error, and are read again from the spec's text then: see
    :func:`decode_spec`). The parse tables are stored as one JSON string, decoded only when
    the format first parses (a load need not decode every format's tables).

    Args:
        bases: for a spec with ``extends``, its chain of bases as ``[ref, path, sha256 of the
            file's bytes]`` each (see :func:`extends_chain`): the entry is keyed by the spec's
            own bytes and holds only for these bases' bytes, checked on load.
    """
    return {"spec": spec.model_dump_json(),  # (a string: pydantic parses it fastest)
            "tables": json.dumps(encode_tables(tables.states, tables.start_state,
                                               tables.end_state), separators=(",", ":")),
            "start": tables.start_state, "end": tables.end_state,
            "grammar": tables.grammar, "starters": sorted(tables.starters),
            "close_terms": sorted(tables.close_terms), "until_terms": sorted(tables.until_terms),
            "bases": list(bases or [])}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extends_chain(file: str) -> list:
    """The ``extends`` chain of the spec ``file``: ``[ref, resolved base path, sha256 of its
    bytes]`` for each base, nearest first (what a cached entry of ``file`` depends on besides
    its own bytes). Only called for a spec that compiled (its chain resolves)."""
    from .spec import _base_path, load_yaml

    out: list = []
    cur = file
    data, _ = load_yaml(Path(cur).read_text(encoding="utf-8"), cur)
    while isinstance(data, dict) and isinstance(data.get("extends"), str):
        base = _base_path(data["extends"], cur)
        if base is None:
            raise ValueError("unresolved base")
        out.append([data["extends"], str(base.resolve()), _digest(base)])
        cur = str(base)
        data, _ = load_yaml(base.read_text(encoding="utf-8"), cur)
    return out


def bases_hold(bases: list, file: str) -> bool:
    """Whether a cached entry's ``extends`` chain (see :func:`extends_chain`) still resolves
    from ``file`` to the same files with the same bytes."""
    from .spec import _base_path

    cur = file
    try:
        for ref, path, digest in bases:
            base = _base_path(ref, cur)
            if base is None or str(base.resolve()) != path or _digest(base) != digest:
                return False
            cur = str(base)
    except (OSError, TypeError, ValueError):
        return False
    return True


def _source(file: str, text: bytes, extends: bool):
    from .spec import SpecSource, load_yaml, read_spec

    if not extends:
        def marks() -> dict:
            try:
                return load_yaml(text.decode("utf-8"), file)[1]
            except Exception:  # (cannot happen for the bytes that compiled; no position then)
                return {}
        return SpecSource(file, marks)

    class _Inherited(SpecSource):
        # positions and origins of a spec with ``extends``: from the whole chain, on demand
        def __init__(self):
            super().__init__(file, self._read)
            self._full = None

        def _read(self) -> dict:
            if self._full is None:
                try:
                    self._full = read_spec(file)[1]
                except Exception:
                    self._full = SpecSource(file, {})
            return self._full.marks

        @property
        def origins(self) -> dict:
            self._read()
            return self._full.origins

        @origins.setter
        def origins(self, value) -> None:
            pass  # (set by SpecSource.__init__: always read from the chain instead)

    return _Inherited()


def decode_spec(data: dict, file: str, text: bytes, rebuilt: Any = None) -> tuple:
    """Inverse of :func:`encode_spec`, with the spec validated again by its pydantic model.

    Args:
        data: what :func:`encode_spec` returned (read back from JSON).
        file: the spec file, as its :class:`~chatgrammar.core.spec.SpecSource` names it.
        text: the spec file's bytes (the entry's key): its YAML positions are composed again
            from them if an error ever needs one.
        rebuilt: called with ``(spec, src, tables)`` when the parse tables, decoded on first
            use, turn out not to decode and are compiled again instead (the caller stores
            the entry again).

    Returns:
        ``(FormatSpec, SpecSource, ParseTables)``; the tables' states decode on first use
        (an entry whose tables do not decode then is compiled again, silently).

    Raises:
        Exception: (any) ``data`` is not such an encoding; the caller rebuilds the entry.
    """
    from .spec import FormatSpec

    spec = FormatSpec.model_validate_json(data["spec"])
    blob = data["tables"]
    if type(blob) is not str or type(data["start"]) is not int or type(data["end"]) is not int:
        raise TypeError("tables")
    src = _source(file, text, bool(spec.extends))
    tables = LazyTables(blob, data["start"], data["end"], str(data["grammar"]),
                        frozenset(map(str, data["starters"])),
                        frozenset(map(str, data["close_terms"])),
                        frozenset(map(str, data["until_terms"])), spec, src, rebuilt)
    return spec, src, tables


class LazyTables(ParseTables):
    """:class:`~chatgrammar.core.compile.ParseTables` whose states (and start / end
    state) decode from a cache entry's JSON on first use. An entry whose tables do not
    decode, or decode to other start / end states than it records, is compiled again
    from the spec (Lark), as a cold load would."""

    def __init__(self, blob, start, end, grammar, starters, close_terms, until_terms,
                 spec, src, rebuilt):
        self.__dict__.update(_blob=blob, _start=start, _end=end, grammar=grammar,
                             starters=starters, close_terms=close_terms,
                             until_terms=until_terms, _spec=spec, _src=src,
                             _rebuilt=rebuilt, _states=None, _shift=True)

    def _resolve(self) -> dict:
        d = self.__dict__
        if d["_states"] is None:
            with _decode_lock:
                if d["_states"] is None:
                    self._decode(d)
        return d["_states"]

    @staticmethod
    def _decode(d: dict) -> None:
        try:
            states, start, end = decode_tables(json.loads(d["_blob"]))
            if (start, end) != (d["_start"], d["_end"]):
                raise ValueError("start / end state")
        except Exception:  # a corrupt entry: compile the spec again, silently
            from .compile import compile_spec

            t = compile_spec(d["_spec"], d["_src"])
            states, d["_start"], d["_end"], d["_shift"] = (
                t.states, t.start_state, t.end_state, t.shift)
            if d["_rebuilt"] is not None:
                try:
                    d["_rebuilt"](d["_spec"], d["_src"], t)
                except Exception:
                    pass
        d["_states"] = states
        d["_blob"] = d["_spec"] = d["_src"] = d["_rebuilt"] = None

    @property
    def states(self) -> dict:
        return self._resolve()

    @property
    def start_state(self) -> int:
        self._resolve()
        return self.__dict__["_start"]

    @property
    def end_state(self) -> int:
        self._resolve()
        return self.__dict__["_end"]

    @property
    def shift(self) -> Any:
        self._resolve()
        return self.__dict__["_shift"]


