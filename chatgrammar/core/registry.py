"""Bundled formats, plugins (entry-point group ``chatgrammar.formats``) and loading."""
from __future__ import annotations

import difflib
import os
import threading
from functools import lru_cache
import sys
from importlib import resources
from pathlib import Path

from ..errors import SpecError
from ..runtime.format import Format
from ..conformance.format_tests import is_tests_file
from .spec import read_spec

ENTRY_POINT_GROUP = "chatgrammar.formats"
_lock = threading.RLock()


@lru_cache(maxsize=1)
def formats_dir() -> Path:
    """The directory of bundled specs: ``chatgrammar/formats`` in a wheel, ``formats/`` next to
    the package in a checkout or editable install — always the one belonging to the
    ``chatgrammar`` package actually imported."""
    # the package root, wherever this module lives inside it
    here = Path(sys.modules[__name__.split(".")[0]].__file__).resolve().parent
    for p in (here / "formats", here.parent / "formats"):
        if p.is_dir() and any(p.glob("*.yaml")):
            return p
    try:
        p = Path(str(resources.files("chatgrammar.formats")))
        if p.is_dir():
            return p.resolve()
    except (ModuleNotFoundError, TypeError):
        pass
    return here.parent / "formats"


def bundled_paths() -> dict[str, Path]:
    """Bundled format name → spec path (norms.yaml and ``*.tests.yaml``, a format's test
    facts, are not formats)."""
    d = formats_dir()
    try:
        stamp = d.stat().st_mtime_ns  # a file added or removed changes the directory's mtime
    except OSError:
        stamp = None
    return dict(_bundled_paths(str(d), stamp))


@lru_cache(maxsize=8)
def _bundled_paths(d: str, stamp) -> tuple:
    return tuple((p.stem, p) for p in sorted(Path(d).glob("*.yaml")) if is_spec_file(p))


def is_spec_file(path: Path) -> bool:
    """Whether a ``*.yaml`` of a formats directory is a spec: not ``norms.yaml``, not a
    format's test facts (``<name>.tests.yaml``, :mod:`chatgrammar.conformance.format_tests`)."""
    return path.stem != "norms" and not is_tests_file(path)


_EPS: dict[tuple, tuple] = {}


def _format_entry_points() -> tuple:
    """The ``chatgrammar.formats`` entry points, read again only when the places distributions
    are found in change: ``sys.path`` itself or the modification time of one of its
    directories (installing or removing a distribution adds or removes an entry there).
    Scanning every installed distribution's metadata costs ~3 ms, and detection (each
    ``detect_format``) and :func:`list_formats` ask each time."""
    from importlib.metadata import entry_points

    stamps = []
    for d in sys.path:
        try:
            stamps.append((d, os.stat(d or ".").st_mtime_ns))
        except OSError:
            stamps.append((d, None))
    key = tuple(stamps)
    hit = _EPS.get(key)
    if hit is not None:
        return hit
    try:
        eps = tuple(entry_points(group=ENTRY_POINT_GROUP))
    except TypeError:  # Python < 3.10 API
        eps = tuple(entry_points().get(ENTRY_POINT_GROUP, []))
    _EPS.clear()  # (one entry: the current places)
    _EPS[key] = eps
    return eps


def _plugin_specs() -> list[tuple[str, Path]]:
    """Every spec file of every ``chatgrammar.formats`` entry point: (entry-point name, path),
    duplicates kept."""
    out: list[tuple[str, Path]] = []
    for ep in _format_entry_points():
        try:
            obj = ep.load()
            target = obj() if callable(obj) else obj
            p = Path(str(target))
        except Exception as exc:  # a broken plugin must not break the bundled formats
            import warnings
            warnings.warn(f"chatgrammar plugin {ep.name!r} failed to load: {exc}")
            continue
        paths = sorted(p.glob("*.yaml")) if p.is_dir() else [p]
        out.extend((ep.name, q) for q in paths if is_spec_file(q))
    return out


def plugin_paths() -> dict[str, Path]:
    """Third-party formats: each entry point of group ``chatgrammar.formats`` names a spec
    file, a directory of specs, or a callable returning either."""
    out: dict[str, Path] = {}
    for _, q in _plugin_specs():
        out.setdefault(q.stem, q)
    return out


def spec_sources() -> list[tuple[Path, str]]:
    """Every spec file the registry sees, with its origin (``"bundled"`` or
    ``"plugin <entry point>"``), bundled first; nothing deduplicated.

    Detection loads this list (not :func:`list_formats`, where a plugin file named like a
    bundled one is shadowed) so that the precedence proof sees, and reports, two specs claiming
    one format name instead of letting one of them win by lookup order.
    """
    out = [(p, "bundled") for p in bundled_paths().values()]
    out += [(q, f"plugin {name}") for name, q in _plugin_specs()]
    return out


def list_formats() -> list[str]:
    """Names of the bundled formats (plugins included), sorted.

    Example:
        >>> "kimi-k3" in cg.list_formats()
        True
    """
    names = set(bundled_paths()) | set(plugin_paths())
    return sorted(names)


@lru_cache(maxsize=128)
def _load_path(path: str, mtime: float) -> Format:
    # Reading YAML is half of a cold load: the parsed spec is cached on disk with its tables,
    # keyed by the file's bytes (see chatgrammar.core.cache: JSON, rebuilt when it does not
    # decode). A spec that extends another depends on its bases' bytes too: its entry records
    # the chain (each base's path and hash), checked before the entry is used.
    from . import cache

    try:
        data = Path(path).read_bytes()
    except OSError:
        data = None
    key = cache.key_for("spec", data) if data is not None else None
    hit = cache.load("spec", key) if key is not None else None

    def store(spec, src, tables) -> None:
        bases = cache.extends_chain(path) if spec.extends else []
        cache.store("spec", key, cache.encode_spec(spec, src, tables, bases))

    if hit is not None:
        # stored only after it compiled, by the same code (the key's fingerprint covers
        # spec.py, compile.py and lark's version)
        try:
            if hit["bases"] and not cache.bases_hold(hit["bases"], path):
                raise LookupError("a base changed")
            spec, src, tables = cache.decode_spec(hit, path, data, rebuilt=store)
            if bool(spec.extends) != bool(hit["bases"]):
                raise LookupError("extends without its chain")
        except Exception:
            pass
        else:
            return Format(spec, src, tables=tables)
    spec, src = read_spec(path)
    fmt = Format(spec, src)
    fmt._driver  # (built now: a spec the driver refuses fails to load, and is never stored)
    if key is not None:
        try:
            store(spec, src, fmt.tables)
        except Exception:  # (a chain that no longer reads: just not cached)
            pass
    return fmt


def load_format(name_or_path) -> Format:
    """Load a bundled format by name, or a spec by path.

    Args:
        name_or_path: ``"kimi-k3"``, or a path to a YAML spec.

    Returns:
        The compiled :class:`Format` (cached: a second load is a dictionary lookup).

    Raises:
        SpecError: unknown name (with a suggestion), unreadable or invalid spec.
        CompileError: the spec does not compile to an unambiguous grammar.

    Example:
        >>> cg.load_format("kimi-k2").name
        'kimi-k2'
    """
    if isinstance(name_or_path, Format):
        return name_or_path
    s = str(name_or_path)
    p = Path(s)
    if not (s.endswith((".yaml", ".yml")) or p.is_file()):
        bundled = bundled_paths()
        # a bundled name wins over plugins anyway: only scan entry points (slow: it reads
        # every installed distribution's metadata) for other names
        known = bundled if s in bundled else {**plugin_paths(), **bundled}
        if s not in known:
            close = difflib.get_close_matches(s, list(known), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SpecError(f"Unknown format {s!r}.{hint} Known: {', '.join(sorted(known))}")
        p = known[s]
        # bundled paths are in a resolved directory (formats_dir()): one lstat instead of
        # realpath's chain of them, unless the file itself is a link
        resolved = s in bundled and not p.is_symlink()
    else:
        resolved = False
    try:
        mtime = p.stat().st_mtime
    except OSError:
        raise SpecError("no such file", file=str(p)) from None
    with _lock:
        return _load_path(str(p) if resolved else str(p.resolve()), mtime)


def all_formats() -> list[Format]:
    """Every bundled and plugin format, loaded."""
    return [load_format(n) for n in list_formats()]
