"""Machine-load helpers shared by the benchmark scripts (Linux ``/proc/stat``; None elsewhere)."""

from __future__ import annotations

import os


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, elapsed CPU seconds, this process's CPU seconds)."""
    try:
        with open("/proc/stat") as f:
            jiffies = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None  # not Linux
    hz = os.sysconf("SC_CLK_TCK")
    idle = jiffies[3] + jiffies[4]  # idle + iowait
    t = os.times()
    return (sum(jiffies) - idle) / hz, sum(jiffies) / hz, t.user + t.system


def other_load(before, after) -> float | None:
    """Fraction of the machine's CPU time used by other processes between two snapshots.

    The timings are only as good as the machine is quiet; this is printed next to them.
    """
    if before is None or after is None or after[1] <= before[1]:
        return None
    others = (after[0] - before[0]) - (after[2] - before[2])
    return min(1.0, max(0.0, others / (after[1] - before[1])))
