"""Optional heavy dependencies of the integration tests, imported when a test first uses them.

``pytest.importorskip`` at module level imports torch, modelopt, TRL or datasets while the
suite is *collected*, in every process that collects it (each pytest-xdist worker collects
every file): seconds of CPU and hundreds of MB per process, for tests that run in one of them.
:func:`lazy_importorskip` skips the module at collection when the package is not installed
(as ``importorskip`` does) but imports it only on first attribute access; a package that is
installed but fails to import skips the test that needed it.
"""
from __future__ import annotations

import importlib
import importlib.util
import warnings

import pytest


class LazyModule:
    """A module imported on first attribute access (``torch.tensor``, ``trl.SFTTrainer``).

    Args:
        name: the dotted module name.
        quiet: ignore the ``UserWarning`` s its import emits (modelopt's "transformers X is not
            tested with this modelopt").
    """

    def __init__(self, name: str, quiet: bool = False):
        self.__dict__.update(_name=name, _quiet=quiet, _module=None)

    def _load(self):
        if self._module is None:
            try:
                with warnings.catch_warnings():
                    if self._quiet:
                        warnings.simplefilter("ignore", UserWarning)
                    self.__dict__["_module"] = importlib.import_module(self._name)
            except ImportError as exc:
                pytest.skip(f"could not import {self._name!r}: {exc}")
        return self._module

    def __getattr__(self, attr: str):
        # pytest's collection probes every module-level object (``__test__``,
        # ``_pytestfixturefunction``, ``pytestmark``, ...): those must not import the module
        if attr.startswith("__") or "pytest" in attr or attr.startswith("_mock"):
            raise AttributeError(attr)
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_importorskip(name: str, *, quiet: bool = False) -> LazyModule:
    """``pytest.importorskip(name)`` for module level, importing at first use.

    Raises:
        pytest.skip.Exception: (at collection) the top-level package is not installed.
    """
    if importlib.util.find_spec(name.partition(".")[0]) is None:
        pytest.skip(f"could not import {name!r}: not installed", allow_module_level=True)
    return LazyModule(name, quiet)
