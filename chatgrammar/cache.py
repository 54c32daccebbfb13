"""Persistent compile cache: parsed specs and LALR tables, pickled in a user cache directory.

Loading a format costs two things: reading its YAML (PyYAML's pure-Python composer, twice: for
values and for ``file:line:col`` marks) and Lark's LALR analysis. Both depend only on their
input and on the code that computes them, so both are cached on disk:

- ``spec-<key>.pkl``: ``(FormatSpec, SpecSource, ParseTables)`` of a spec that compiled, keyed
  by the spec file's path and bytes;
- ``lalr-<key>.pkl``: the parse tables, keyed by the compiled grammar text.

Every key also hashes a *code fingerprint* — the source of the modules that produce the cached
objects (``spec.py``, ``compile.py``, this file), the versions of lark, pydantic and PyYAML, the
Python version and :data:`CACHE_VERSION` — so an upgrade or a local edit never reads a stale
entry. Entries are written atomically (temporary file + ``os.replace``); a read-only or missing
directory just means no cache (nothing is ever required from it), and an unreadable entry is
ignored and rebuilt.

Location: ``$CHATGRAMMAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/chatgrammar``, else
``~/.cache/chatgrammar``. ``CHATGRAMMAR_CACHE_DIR=off`` (or ``0``, ``none``, empty) disables it.
The cache holds pickles: it is trusted like the user's own files (do not point it at a
directory others can write).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

CACHE_VERSION = 1
_OFF = {"", "0", "off", "none", "false", "no"}


def cache_dir() -> Path | None:
    """The cache directory in use, or None when caching is disabled."""
    env = os.environ.get("CHATGRAMMAR_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "chatgrammar"


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Hash of everything that shapes a cached object besides its own input."""
    h = hashlib.sha256(f"chatgrammar-cache-{CACHE_VERSION}|{sys.version}".encode())
    here = Path(__file__).resolve().parent
    for name in ("spec.py", "compile.py", "cache.py"):
        try:
            h.update((here / name).read_bytes())
        except OSError:
            h.update(name.encode())
    for mod in ("lark", "pydantic", "yaml"):
        try:
            h.update(f"{mod}={__import__(mod).__version__}".encode())
        except Exception:
            h.update(mod.encode())
    return h.hexdigest()


def key_for(*parts: bytes | str) -> str:
    """A cache key: the fingerprint and ``parts``, hashed."""
    h = hashlib.sha256(code_fingerprint().encode())
    for p in parts:
        b = p.encode("utf-8", "surrogatepass") if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:40]


def load(kind: str, key: str) -> Any | None:
    """The cached object, or None (absent, disabled, unreadable: never an error)."""
    d = cache_dir()
    if d is None:
        return None
    try:
        with open(d / f"{kind}-{key}.pkl", "rb") as f:
            return pickle.load(f)
    except Exception:
        return None


def store(kind: str, key: str, obj: Any) -> bool:
    """Write ``obj`` atomically; False (silently) when the cache cannot be written."""
    d = cache_dir()
    if d is None:
        return False
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{kind}-", suffix=".tmp", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, d / f"{kind}-{key}.pkl")
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return True
    except Exception:
        return False


# ----------------------------------------------------------------------------- LALR tables

def dump_tables(states: dict, start: int, end: int, shift: Any) -> tuple:
    """Lark's parse table in a picklable form, and the form the driver uses: each action is
    ``(is_shift, arg)`` (Lark's ``Shift`` / ``Reduce`` are singletons compared with ``is``;
    ``arg`` is the next state or the rule to reduce — Lark rules pickle)."""
    return ({s: {t: (a is shift, arg) for t, (a, arg) in acts.items()}
             for s, acts in states.items()}, start, end)
