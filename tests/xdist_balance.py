"""How the whole suite is shared between its two pytest-xdist workers (tests/conftest.py).

``--dist loadfile`` hands out whole files in order of their number of tests, so the suite's
wall time was that of the worker that drew the heaviest files: a file's number of tests says
little about its cost (test_fuzz: 64 tests, ~50 CPU-s; test_wild: 240 tests, ~40 CPU-s), and a
140 CPU-s file drawn last leaves the other worker idle. Here the work units are:

- the heavy files whose tests run format by format (conftest.py's ``BY_FORMAT`` and
  ``FRESH_PER_TEST``) cut into contiguous chunks of about :data:`CHUNK_CPU_S` each: a chunk
  is a range of formats, and each format's tokenizers are still built once;
- the files whose tests start processes of their own (conftest.py's ``WITH_CHILDREN``: a
  local Ray runtime, ``chatgrammar mask -j 2``, ``datasets`` ``num_proc=2``) together, one
  after the other in one unit: each adds 0.5-1 GB of children to its worker for a while,
  and two of them at once on the two workers made the suite's summed memory peak;
- every other file whole, as before.

Units are handed out heaviest first, each to the worker that runs out of work first (the
longest-processing-time rule): the two workers then finish within about one small unit of
each other. Which worker runs which test changes; what each test runs and asserts does not
(every test starts from fresh per-format state, conftest.py's ``_release_between_formats``
and the module-scoped fixtures are set up in whichever worker runs the chunk).
"""
from __future__ import annotations

import math

from xdist.scheduler import LoadScopeScheduling

# CPU seconds per test file, measured on the 2-core machine (CHATGRAMMAR_TEST_COSTLOG, one
# run of the whole suite; `python tools/suite_cost.py` re-measures). Only the order of the
# work and where the heavy files are cut depend on them: a stale figure costs balance, never
# a test. A file not listed counts CPU_PER_TEST per test. Measured on the merged tree of
# session 10 (one quiet-machine run of the whole suite, CHATGRAMMAR_TEST_COSTLOG).
COST = {
    "tests/test_formats.py": 139,
    "tests/test_fastpath.py": 96,
    "tests/test_wild.py": 90,
    "tests/test_one_engine.py": 66,
    "tests/test_fuzz.py": 59,
    "tests/test_reliability.py": 52,
    "tests/test_properties.py": 45,
    "tests/test_speedups.py": 42,
    "tests/test_integration_trl.py": 27,
    "tests/test_infer.py": 24,
    "tests/test_cli.py": 17,
    "tests/test_hf.py": 17,
    "tests/test_textpath.py": 17,
    "tests/test_mask_cli.py": 16,
    "tests/test_detect.py": 11,
    "tests/test_new_families.py": 11,
}
CPU_PER_TEST = 0.05
TOGETHER = "tests/(files that start processes)"  # the unit of plan()'s ``together`` files
CHUNK_CPU_S = 25.0


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def plan(collection: list[str], split: tuple = (), together: tuple = ()
         ) -> tuple[dict[str, str], dict[str, float]]:
    """The work units of a collection.

    Args:
        collection: the collected node ids, in the workers' order (by format in the modules
            tests/conftest.py orders so).
        split: the files that may be cut into chunks (those ordered format by format).
        together: the files that run in one unit, one after the other (those whose tests start
            processes of their own: their children never run on both workers at once).

    Returns:
        ``(scope_of, cost)``: each node id's unit, and each unit's estimated CPU seconds.

    Example:
        >>> scope_of, cost = plan(["tests/test_a.py::t1", "tests/test_a.py::t2"])
        >>> scope_of["tests/test_a.py::t2"], cost["tests/test_a.py"]
        ('tests/test_a.py', 0.1)
    """
    by_file: dict[str, list[str]] = {}
    for nodeid in collection:
        by_file.setdefault(file_of(nodeid), []).append(nodeid)
    scope_of: dict[str, str] = {}
    cost: dict[str, float] = {}
    for f, ids in by_file.items():
        total = COST.get(f, CPU_PER_TEST * len(ids))
        if f in together:
            cost[TOGETHER] = cost.get(TOGETHER, 0.0) + total
            scope_of.update(dict.fromkeys(ids, TOGETHER))
            continue
        chunks = max(1, min(len(ids), math.ceil(total / CHUNK_CPU_S))) if f in split else 1
        for k in range(chunks):
            part = ids[k * len(ids) // chunks:(k + 1) * len(ids) // chunks]
            unit = f if chunks == 1 else f"{f}::part{k + 1}of{chunks}"
            cost[unit] = total * len(part) / len(ids)
            scope_of.update(dict.fromkeys(part, unit))
    return scope_of, cost


class BalancedScheduling(LoadScopeScheduling):
    """pytest-xdist's scope scheduling over the units of :func:`plan`, heaviest first."""

    _scope_of: dict[str, str] = {}
    split: tuple = ()  # the files plan() may cut (set by tests/conftest.py)
    together: tuple = ()  # the files plan() runs as one unit (set by tests/conftest.py)

    def _split_scope(self, nodeid: str) -> str:
        return self._scope_of.get(nodeid) or file_of(nodeid)

    def schedule(self) -> None:
        """As ``LoadScopeScheduling.schedule``, with the work queue of :func:`plan` ordered
        by estimated cost instead of by number of tests."""
        assert self.collection_is_completed
        if self.collection is not None:
            for node in self.nodes:
                self._reschedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = list(next(iter(self.registered_collections.values())))
        if not self.collection:
            return
        self._scope_of, cost = plan(self.collection, self.split, self.together)
        units: dict[str, dict[str, bool]] = {}
        for nodeid in self.collection:
            units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
        for scope in sorted(units, key=lambda s: -cost[s]):  # stable: ties keep file order
            self.workqueue[scope] = units[scope]
        for _ in range(max(0, len(self.nodes) - len(self.workqueue))):
            unused, _assigned = self.assigned_work.popitem()
            unused.shutdown()
        for node in self.nodes:
            self._assign_work_unit(node)
        for node in self.nodes:
            self._reschedule(node)
        if not self.workqueue:
            for node in self.nodes:
                node.shutdown()
