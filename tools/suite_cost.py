"""Run a command (by default the README's test command) and measure what it costs: wall time,
CPU seconds of every process in its tree (the pytest controller and each xdist worker), and the
peak of the memory summed over the whole tree, sampled from /proc.

Why a tree and not a name: pytest-xdist's workers are started through execnet as
``python -c "import sys;exec(eval(sys.stdin.readline()))"``, so ``pgrep -f "python -m pytest"``
finds only the controller. Every sample walks the children of the command's process instead.

Memory is read twice per sample: PSS (``/proc/<pid>/smaps_rollup``: pages shared between the
controller and the workers, e.g. the interpreter and numpy, counted once in total) and RSS
(``/proc/<pid>/status``: shared pages counted in every process, an upper bound). The summed
peak is the largest sum seen in one sample.

Usage::

    python tools/suite_cost.py                      # nice -n 10 python -m pytest
    python tools/suite_cost.py -- python -m pytest tests/test_fuzz.py -q
    python tools/suite_cost.py --interval 0.25 --json cost.json

Linux only (it reads /proc). It prints one line per process (pid, command, CPU-s, peak PSS,
peak RSS) and the totals; the command's exit status is its own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's children file: a process's children are
    listed under the thread that forked them)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def _tree(root: int) -> list[int]:
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(_children(pid))
    return seen


def _kb(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:300]
    except OSError:
        return "?"


def _ppid(pid: int) -> int | None:
    """The parent of ``pid``: which process forked or spawned it (a datasets ``num_proc``
    fork of an xdist worker and a Ray worker have the same interpreter command line)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def measure(cmd: list[str], interval: float = 0.5) -> dict:
    """Run ``cmd`` and sample its process tree every ``interval`` seconds.

    Args:
        cmd: the command and its arguments.
        interval: seconds between samples.

    Returns:
        A dict: ``rc``, ``wall_s``, ``peak_pss_mb`` and ``peak_rss_mb`` (largest sums over the
        tree in one sample), ``at_peak`` (when the PSS peak was sampled and each process's PSS
        then), ``processes`` (per pid: ``cmd``, ``cpu_s`` at its last sample,
        ``ppid``, ``peak_pss_mb``, ``peak_rss_mb``; the command up to 300 characters, so that
        e.g. Ray's agents are told apart).

    Raises:
        OSError: the command cannot be started.

    Example:
        >>> measure(["python", "-c", "pass"])["rc"]
        0
    """
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    procs: dict[int, dict] = {}
    peak_pss = peak_rss = 0
    at_peak: dict = {}
    while proc.poll() is None:
        pss_sum = rss_sum = 0
        sample: dict[int, float] = {}
        for pid in _tree(proc.pid):
            pss = _kb(f"/proc/{pid}/smaps_rollup", "Pss:")
            rss = _kb(f"/proc/{pid}/status", "VmRSS:")
            cpu = _cpu_seconds(pid)
            entry = procs.setdefault(pid, {"cmd": _cmdline(pid), "ppid": _ppid(pid),
                                           "cpu_s": 0.0,
                                           "peak_pss_mb": 0.0, "peak_rss_mb": 0.0})
            if cpu is not None:
                entry["cpu_s"] = cpu
            entry["peak_pss_mb"] = max(entry["peak_pss_mb"], pss / 1024)
            entry["peak_rss_mb"] = max(entry["peak_rss_mb"], rss / 1024)
            pss_sum += pss
            rss_sum += rss
            sample[pid] = round(pss / 1024, 1)
        if pss_sum > peak_pss:  # who held what at the summed peak
            at_peak = {"t_s": round(time.monotonic() - start, 1), "pss_mb": sample}
        peak_pss, peak_rss = max(peak_pss, pss_sum), max(peak_rss, rss_sum)
        time.sleep(interval)
    return {"rc": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
            "peak_pss_mb": round(peak_pss / 1024, 1), "peak_rss_mb": round(peak_rss / 1024, 1),
            "at_peak": at_peak,
            "processes": {pid: p for pid, p in procs.items() if p["cpu_s"] >= 1.0}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--json", help="also write the measurement to this file")
    ap.add_argument("cmd", nargs="*", help="the command (after --); default: the README's")
    args = ap.parse_args(argv)
    cmd = args.cmd or ["nice", "-n", "10", sys.executable, "-m", "pytest"]
    result = measure(cmd, args.interval)
    for pid, p in sorted(result["processes"].items()):
        print(f"{pid:>8} {p['cpu_s']:8.1f} CPU-s  PSS {p['peak_pss_mb']:7.0f} MB  "
              f"RSS {p['peak_rss_mb']:7.0f} MB  ppid {p['ppid']}  {p['cmd'][:100]}")
    print(f"wall {result['wall_s']} s, CPU {sum(p['cpu_s'] for p in result['processes'].values()):.1f}"
          f" s, summed peak PSS {result['peak_pss_mb']:.0f} MB (RSS {result['peak_rss_mb']:.0f} MB)"
          f", rc {result['rc']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result["rc"]


if __name__ == "__main__":
    sys.exit(main())
