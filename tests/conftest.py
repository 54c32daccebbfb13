"""Suite-wide options and markers.

- ``--update-goldens``: the format suite (tests/test_formats.py) writes the expected files of
  tests/formats/<name>/goldens/ from what the formats do now, after checking that each is
  consistent (the marked text joins back to the rendering, spans sorted and inside their
  turns); review the diff before committing it.
- ``--runslow``: also run the tests marked ``slow`` (long inputs and fuzz sizes of the longer
  run); the default run keeps their guarantees at a smaller size.
"""
from __future__ import annotations

import os

import pytest


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
        import chatgrammar.render as _render

        monkeypatch.setattr(_render, "datetime", _FixedClock)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-input / large fuzz sizes; run with --runslow")
    if config.getoption("--runslow"):  # the longer fuzz campaign (tests/test_fuzz.py)
        os.environ.setdefault("CHATGRAMMAR_FUZZ_SECONDS", "60")
        os.environ.setdefault("CHATGRAMMAR_FUZZ_MIN_CASES", "300")


def pytest_collection_modifyitems(config, items):
    # the format suite runs format by format (each format's tokenizers are built once, used by
    # all its checks, and released before the next format: tests/test_formats.py)
    suite = [i for i in items if i.nodeid.startswith("tests/test_formats.py::")]
    if suite:
        first = items.index(suite[0])
        rest = [i for i in items if i not in set(suite)]
        order = sorted(suite, key=lambda i: getattr(getattr(i, "callspec", None), "params",
                                                    {}).get("name", ""))
        items[:] = rest[:first] + order + rest[first:]
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def update_goldens(request) -> bool:
    """Whether this run regenerates the format suite's goldens."""
    return bool(request.config.getoption("--update-goldens"))
