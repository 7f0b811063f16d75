"""What a node's processes hold in memory, read from `/proc` (Linux).

A node is several processes: the Python process that serves, the DHT process hivemind forks from it, the
`p2pd` daemon, and torch's shared-memory manager. The honest figure for "memory this node takes" is the sum of
their proportional set sizes (PSS, `/proc/PID/smaps_rollup`): pages the forked DHT process still shares with
its parent are counted once, split between them, where a sum of RSS would count them twice. Nodes measure
their fixed overhead with it before loading any block (`MemoryPlan.overhead`), and tests and benchmarks hold
nodes to their offer with it.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def children(pid: int) -> list[int]:
    """Direct children of `pid` (empty where `/proc` cannot say)."""
    found = []
    for task in (_PROC / str(pid) / "task").glob("*/children"):
        try:
            found += [int(p) for p in task.read_text().split()]
        except OSError:
            continue
    return found


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, parents first."""
    tree, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        if current in tree:
            continue
        tree.append(current)
        queue += children(current)
    return tree


def _rollup(pid: int, field: str) -> int:
    try:
        for line in (_PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_pss(pid: int | None = None) -> int:
    """Bytes of PSS of process `pid` (default: this one) and all its descendants; 0 where `/proc` has none."""
    return sum(_rollup(p, "Pss") for p in process_tree(pid if pid is not None else os.getpid()))


def tree_rss(pid: int | None = None) -> int:
    """Bytes of RSS summed over the process tree (counts shared pages once per process: an upper bound)."""
    return sum(_rollup(p, "Rss") for p in process_tree(pid if pid is not None else os.getpid()))


def available() -> bool:
    """Whether this system reports PSS (`/proc/self/smaps_rollup`, Linux 4.14+)."""
    return (_PROC / "self" / "smaps_rollup").is_file()


def _status(field: str) -> int:
    try:
        for line in (_PROC / "self" / "status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss() -> int:
    """Bytes resident in this process now (VmRSS)."""
    return _status("VmRSS")


def peak_rss() -> int:
    """This process's peak resident bytes since it started or since :func:`reset_peak` (VmHWM)."""
    return _status("VmHWM")


def reset_peak() -> bool:
    """Reset this process's peak resident set to its current one (Linux `clear_refs` 5); False where the
    kernel does not allow it, and then :func:`peak_rss` keeps the older peak."""
    try:
        (_PROC / "self" / "clear_refs").write_text("5")
        return True
    except OSError:
        return False
