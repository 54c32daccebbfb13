"""Suite-wide options and markers.

- ``--update-goldens``: the format suite (tests/test_formats.py) writes the expected files of
  tests/formats/<name>/goldens/ from what the formats do now, after checking that each is
  consistent (the marked text joins back to the rendering, spans sorted and inside their
  turns); review the diff before committing it.
- ``--runslow``: also run the tests marked ``slow`` (long inputs and fuzz sizes of the longer
  run); the default run keeps their guarantees at a smaller size.

Cost (issue 14: the whole suite in about 5 minutes and under 4 GB on 2 cores): the whole suite
runs on two pytest-xdist workers (``pytest_cmdline_main``; named files, ``-k`` and
``--update-goldens`` stay in one process), sharing cost-balanced units, the heaviest files cut
into chunks of formats (tests/xdist_balance.py); the format-parametrised modules run format by
format; after each module the test helpers' cached tokenizers and the formats' per-tokenizer
state are dropped (``_release_between_modules``).
"""
from __future__ import annotations

import os

import pytest


def _rewrite_only_the_suites_asserts() -> None:
    """pytest rewrites the asserts of every module of a distribution that registers a pytest
    plugin: all of hypothesis (~110 modules), anyio and xdist, parsed and recompiled in every
    process (nothing is cached under ``PYTHONDONTWRITEBYTECODE``): ~4 CPU-s per process for
    assertion messages of those libraries' internal asserts, which never concern a test here.
    Their modules then import as they are installed; the suite's own test modules and
    conftest are rewritten as before (they are not marked names, pytest's file patterns pick
    them)."""
    import sys

    try:
        from _pytest.assertion.rewrite import AssertionRewritingHook
    except ImportError:  # a pytest without it: nothing to undo
        return
    for hook in sys.meta_path:
        marked = getattr(hook, "_must_rewrite", None)
        if isinstance(hook, AssertionRewritingHook) and isinstance(marked, set):
            marked -= {"hypothesis", "_hypothesis_globals", "_hypothesis_pytestplugin",
                       "anyio", "xdist"}
            getattr(hook, "_marked_for_rewrite_cache", {}).clear()


_rewrite_only_the_suites_asserts()


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="regenerate tests/formats/*/goldens from the current formats")
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (the longer run)")


class _FixedClock:
    """Templates that print today's date (``strftime_now``: Hunyuan, Llama 3.1, …) render the
    same text in every run, so that goldens of their renderings hold on any day."""

    @staticmethod
    def now(tz=None):
        import datetime as _dt

        return _dt.datetime(2026, 1, 15, 12, 0, 0, tzinfo=tz)


@pytest.fixture(autouse=True)
def _fixed_clock_for_goldens(request, monkeypatch):
    # only the format suite's goldens need it; render parity tests compare with transformers,
    # whose strftime_now reads the real clock
    if request.node.nodeid.startswith("tests/test_formats.py::"):
        import chatgrammar.conformance.render as _render

        monkeypatch.setattr(_render, "datetime", _FixedClock)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the option
def pytest_cmdline_main(config):
    """The whole suite (``python -m pytest``, no paths given) runs on two workers, file by
    file, when pytest-xdist is installed (the ``test`` extra has it) and the caller did not
    choose (``-n``, ``-p no:xdist``). A run of named files or ``-k`` stays in one process."""
    whole = getattr(config, "args_source", None) in (pytest.Config.ArgsSource.TESTPATHS,
                                                     pytest.Config.ArgsSource.INVOCATION_DIR)
    if getattr(config.option, "numprocesses", "absent") is not None or not whole \
            or os.environ.get("PYTEST_XDIST_WORKER") or config.getoption("usepdb", False) \
            or getattr(config.option, "keyword", "") or config.getoption("--update-goldens"):
        return
    config.option.numprocesses = 2
    config.option.dist = "loadfile"
    config._chatgrammar_balanced = True  # tests/xdist_balance.py shares the work


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # xdist's (absent without it); before its own
def pytest_xdist_make_scheduler(config, log):
    """The whole suite's two workers get cost-balanced work units (tests/xdist_balance.py:
    heavy files cut into chunks of formats, heaviest first) instead of whole files by number
    of tests; an explicit ``-n``/``--dist`` keeps pytest-xdist's own scheduling (unless
    ``CHATGRAMMAR_XDIST_BALANCE=1``: how the balancing is tried on a few files)."""
    if not (getattr(config, "_chatgrammar_balanced", False)
            or os.environ.get("CHATGRAMMAR_XDIST_BALANCE") == "1"):
        return None
    from tests.xdist_balance import BalancedScheduling

    sched = BalancedScheduling(config, log)
    sched.split = tuple(p.split("::")[0] for p in BY_FORMAT + FRESH_PER_TEST)
    sched.together = WITH_CHILDREN
    return sched


# modules whose tests start processes holding 0.5-1 GB for a while (a local Ray runtime and its
# workers; ``chatgrammar mask -j 2``'s spawned workers, each importing transformers and loading
# the tokenizer; ``datasets`` ``map(num_proc=2)`` forks, each unpickling the tokenizer): the
# balanced run gives them to one worker, one after the other (tests/xdist_balance.py), so that
# two of them never add their children to the summed memory at the same time
WITH_CHILDREN = ("tests/test_integration_ray.py", "tests/test_mask_cli.py",
                 "tests/test_hf.py", "tests/test_integration_trl.py")


def _return_large_blocks_to_the_system() -> None:
    """Blocks of 1 MB and more are always their own mapping, given back to the system when
    freed (glibc's default threshold rises to the largest block freed so far, so that the
    suite's many large temporary blocks, e.g. each tiktoken vocabulary's tables, are carved
    from the heap instead, which then fragments and only grows). Elsewhere: a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def pytest_configure(config):
    _return_large_blocks_to_the_system()
    config.addinivalue_line("markers", "slow: long-input / large fuzz sizes; run with --runslow")
    if config.getoption("--runslow"):  # the longer fuzz campaign (tests/test_fuzz.py)
        os.environ.setdefault("CHATGRAMMAR_FUZZ_SECONDS", "60")
        os.environ.setdefault("CHATGRAMMAR_FUZZ_MIN_CASES", "300")
        # and the full budgets of the tests marked ``long`` (sized down by default)
        os.environ.setdefault("CHATGRAMMAR_LONG", "1")


# modules whose tests run format by format (each format's tokenizers are built once, used by
# all its checks, then dropped by bounded caches: tests/test_formats.py releases them itself)
BY_FORMAT = ("tests/test_formats.py::", "tests/test_new_families.py::")
# modules whose tests over every format (``name``) also run format by format, so that the
# format's generic tokenizers (tests.fuzz_tokenizers.format_encoding: a tiktoken build over
# Qwen's 151k ranks each, soft markers as ids and as text) are built once per format, not once
# per test; each test still starts from the format's fresh per-tokenizer state and memos
# (``_release_between_formats``), as when they ran test by test over all formats.
# test_one_engine's two all-format tests (C == builder == numpy) read test_fastpath's
# ``_samples``, kept for the current format only: run format by format, they share one build
# of each format's renders and encodings (~0.4 CPU-s a format) instead of two; the same for
# test_speedups' tests over formats (chatml, llama2, the kimis: in three to five tests each)
FRESH_PER_TEST = ("tests/test_fastpath.py::", "tests/test_reliability.py::",
                  "tests/test_fuzz.py::", "tests/test_one_engine.py::",
                  "tests/test_speedups.py::")


def pytest_collection_modifyitems(config, items):
    for prefix in BY_FORMAT + FRESH_PER_TEST:
        suite = [i for i in items if i.nodeid.startswith(prefix)]
        if suite:
            first = items.index(suite[0])
            chosen = set(suite)
            rest = [i for i in items if i not in chosen]
            order = sorted(suite, key=lambda i: getattr(getattr(i, "callspec", None), "params",
                                                        {}).get("name", ""))
            items[:] = rest[:first] + order + rest[first:]
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``CHATGRAMMAR_TEST_CPULOG=FILE``: each test's CPU seconds (setup, call and teardown)
    appended to FILE (wall time on a shared machine says little about a test's cost), with
    the worker and its resident and peak memory after the test (which test raised the peak)."""
    log = os.environ.get("CHATGRAMMAR_TEST_CPULOG")
    if not log:
        yield
        return
    import time

    cpu = time.process_time()
    yield
    status = _status()
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"{time.process_time() - cpu:.4f}\t{item.nodeid}\t"
                f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t"
                f"{status.get('VmRSS', '?').strip()}\t{status.get('VmHWM', '?').strip()}\n")


def _status() -> dict:
    """This process's /proc/self/status fields (empty where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}


def pytest_collection_finish(session):
    """What collection built (every module, format, test item: most of the heap) lives to the
    end: moved out of the garbage collector's sight, so that each later collection (the
    interpreter's own, and the explicit ones between formats and modules) walks only what the
    tests allocate since, not the whole heap again."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def update_goldens(request) -> bool:
    """Whether this run regenerates the format suite's goldens."""
    return bool(request.config.getoption("--update-goldens"))


_last_format: list = [None]


@pytest.fixture(autouse=True)
def _release_between_formats(request):
    """In a module parametrised by format (``name``), when the format changes, the previous
    one drops its per-tokenizer state and its text memo: a fuzz or reliability loop over every
    format otherwise keeps each format's memos (bounded per format, not over 51 of them)."""
    name = getattr(getattr(request.node, "callspec", None), "params", {}).get("name")
    prev = _last_format[0]
    if isinstance(name, str) and name != prev:
        _last_format[0] = name
        if isinstance(prev, str):
            _drop_format_state(prev)
    if isinstance(name, str) and request.node.nodeid.startswith(FRESH_PER_TEST):
        _drop_format_state(name)  # what an earlier test of the same format taught stays out
    yield


def _drop_format_state(name: str) -> None:
    try:
        import chatgrammar as cg
        from chatgrammar.core.registry import bundled_paths

        # (a bundled name first: list_formats reads every installed distribution's metadata
        # for plugins, ~20 ms, and this runs before every test of the by-format modules)
        if name not in bundled_paths() and name not in cg.list_formats():
            return
        fmt = cg.load_format(name)
    except Exception:  # not a format name (a parameter of another kind)
        return
    for attr in ("_states", "_by_obj"):
        cache = getattr(fmt, attr, None)
        if cache is not None:  # a dict, or a WeakKeyDictionary
            cache.clear()
    if hasattr(fmt, "_text_memo"):
        fmt._text_memo = None


@pytest.fixture(autouse=True, scope="module")
def _release_between_modules(request):
    """After each test module, drop what it built and nothing else keeps: the test helpers'
    cached tokenizers (every ``functools.lru_cache`` of a ``tests.*`` module: a Qwen-ranks
    vocabulary is ~35 MB, transformers tokenizers more), every loaded format's per-tokenizer
    state, then give the freed heap back to the system. The suite's peak is then one module's
    working set, not the sum of all of them.

    ``CHATGRAMMAR_TEST_COSTLOG=FILE``: each module's CPU seconds and the process's resident
    and peak memory after it are appended to FILE (how the suite's cost is measured)."""
    import time

    cpu = time.process_time()
    yield
    _release()
    log = os.environ.get("CHATGRAMMAR_TEST_COSTLOG")
    if log:
        status = _status()
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{request.node.nodeid}\t"
                    f"{time.process_time() - cpu:.1f}\t{status.get('VmRSS', '?').strip()}\t"
                    f"{status.get('VmHWM', '?').strip()}\n")


def _release() -> None:
    import gc
    import sys

    for mod_name, mod in list(sys.modules.items()):
        if not (mod_name.startswith("tests.") or mod_name.startswith("test_")) or mod is None:
            continue
        for value in list(vars(mod).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and hasattr(value, "cache_info"):
                clear()
    try:
        import chatgrammar as cg
        from chatgrammar.runtime import tokenizers as cg_tokenizers

        for name in cg.list_formats():
            _drop_format_state(name)
        from tests import fuzz_tokenizers

        fuzz_tokenizers._MEMOLESS.clear()  # the memo-less copies of formats (check_contract)
        adapters = getattr(cg_tokenizers, "_ADAPTERS", None)
        if hasattr(adapters, "clear"):
            adapters.clear()
    except Exception:  # a module that broke the registry reports that itself
        pass
    gc.collect()
    _malloc_trim()


def _malloc_trim() -> None:
    """glibc keeps freed arenas mapped; ``malloc_trim`` returns them (elsewhere: a no-op)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
