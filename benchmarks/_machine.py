"""Machine-load helpers shared by the benchmark scripts (Linux ``/proc/stat``; None elsewhere)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

# The benchmarks run as the lowrank-jax command does: glibc malloc keeps freed memory for reuse
# (lowrank_jax.runtime.keep_freed_memory, applied when lowrank_jax is imported), so large XLA
# buffers are not page-faulted in again on every call. LOWRANK_JAX_KEEP_FREED_MEMORY=0 measures
# glibc's default; benchmarks/allocator.py compares the two.
os.environ.setdefault("LOWRANK_JAX_KEEP_FREED_MEMORY", "1")


def malloc_setting() -> str:
    """How ``malloc`` runs in this process, for a benchmark's header and JSON: a preloaded
    allocator's file name, or glibc's with what :mod:`lowrank_jax.runtime` set."""
    from lowrank_jax import runtime

    lib = runtime.preloaded_malloc()
    if lib is not None:
        return f"{os.path.basename(lib)} (preloaded)"
    kept = runtime.freed_memory_kept()
    return {True: "glibc, freed memory kept", "one_arena": "glibc, freed memory kept, one arena",
            False: "glibc defaults", None: "glibc defaults"}[kept]


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


def time_interleaved(fns: list, runs: int, warmup: int, *, cpu: bool = False):
    """Seconds of each zero-argument ``fn`` per run, calls interleaved within each run and the
    order reversed on every other run (no call is always first after a pause or always right
    after the most expensive one).

    Returns one list of wall-clock seconds per ``fn``; with ``cpu=True`` a pair ``(wall,
    cpu)``, ``cpu`` holding this process's CPU seconds (all threads, ``time.process_time``)
    per call: what a call cost this process, while wall time also holds the waits for cores
    that other processes were using.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    wall: list[list[float]] = [[] for _ in fns]
    cpu_s: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    for i in range(runs):
        for j in (order if i % 2 == 0 else order[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            fns[j]()
            wall[j].append(time.perf_counter() - t0)
            cpu_s[j].append(time.process_time() - c0)
    return (wall, cpu_s) if cpu else wall


def _plain(obj):
    """JSON for what ``json`` does not know: NumPy/JAX scalars and arrays, anything else by str."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def write_json(path: str, obj, *, indent: int = 1, allow_nan: bool = True) -> None:
    """Write a benchmark's result to ``path`` whole or not at all.

    The JSON is written to a temporary file in the same folder and renamed over ``path``, so an
    interrupted or failing run (a value ``json`` cannot encode, a full disk) leaves the previous
    file as it was rather than half of a new one. NumPy scalars and arrays are written as
    numbers and lists, anything else ``json`` cannot encode as its ``str``.
    """
    path = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, allow_nan=allow_nan, default=_plain)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"wrote {path}")


def compile_with(fn, args, **settings):
    """``fn`` compiled for ``args`` under the execution settings ``settings``
    (:func:`lowrank_jax.execution.settings`, for example ``fold_keys=False`` or
    ``attention_chunk_above_bytes=None``): the benchmarks compile one program per setting and
    time them in one loop. The settings are part of ``jax.jit``'s cache key, so one jitted
    function serves every setting."""
    import jax

    from lowrank_jax import execution

    with execution.settings(**settings):
        return jax.jit(fn).lower(*args).compile()


def chunked_speedup_goal(name: str, rows: list[dict], chunk_key: str) -> dict:
    """The ``goals`` entry of a chunked-against-whole benchmark (reported, no target): the
    median ``speedup`` over the rows whose ``chunk_key`` is not ``None``; printed too."""
    sel = [r for r in rows if r[chunk_key] is not None]
    value = statistics.median(r["speedup"] for r in sel) if sel else None
    print(f"# {name}: median {'n/a' if value is None else f'{value:.2f}'} over the chunked rows")
    return {name: {"value": value, "goal": "reported", "holds": None,
                   "detail": {f"{r['what']}, {r['tokens']} tokens": r["speedup"] for r in sel}}}
