"""Host BLAS threads for the decompositions of ``compress``: OpenBLAS's default (one thread per
core) against one thread (:func:`lowrank_jax.runtime.blas_threads`), on an idle machine and on a
busy one.

The SVDs of ``compress`` run in NumPy's LAPACK on the host. OpenBLAS's threads spin while they
wait for work; when other processes hold the cores, they wait for cores instead. Each workload
runs with the default thread count and with ``blas_threads(1)`` in one process, the two calls of
a pair back to back and their order swapped every other run (``_machine.time_interleaved``), so
the load of the machine hits both sides of every ratio. Two conditions, one after the other:
"idle" (nothing started by the script) and "busy" (one busy-looping Python process per core,
started by the script and stopped after). The machine may be shared: its load average
(``os.getloadavg``) before and after each condition and the share of its CPU time that other
processes than this one used meanwhile (``_machine.other_load``, the hogs included) are printed
and written with the timings.

Workloads: 48 truncated SVDs of 512 x 512 float32 matrices through the library's own path
(``truncated_svd``, SVD in float64); ``apply_plan`` of one ``svd`` step (eps 0.3, attention
projections) on a Chronos-Bolt with d_model 512, 2 + 2 layers (24 matrices of 512 x 512);
without ``--quick`` also 2 SVDs of 2048 x 2048 (where more threads could pay on an idle
machine).

The table gives per condition and workload the median seconds of each setting and the ratio
``default s / one-thread s`` of each pair: median, smallest and largest (above 1: one thread is
faster).

Figures: ``benchmarks/README.md`` (one thread 1.5-15.6x faster in 17 of 18 pairs on a shared
2-core machine, also for 2048 x 2048).

Usage::

    python benchmarks/blas_threads.py --json blas_threads.json   # 5 pairs per row
    python benchmarks/blas_threads.py --runs 3                   # 35 min on a shared 2-core CPU
    python benchmarks/blas_threads.py --quick                    # 3 pairs, 16 SVDs, no 2048
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

from _machine import cpu_snapshot, malloc_setting, other_load, time_interleaved, write_json


def blas_info() -> list[dict]:
    """The BLAS libraries loaded in this process and their default thread counts."""
    from threadpoolctl import threadpool_info

    return [{k: i.get(k) for k in ("internal_api", "num_threads", "version", "filepath")}
            for i in threadpool_info() if i.get("user_api") == "blas"]


def workloads(quick: bool) -> dict:
    """``{name: zero-argument call}``: the host-side work of ``compress``."""
    import jax
    import numpy as np

    from lowrank_jax.compress import ATTENTION_QKVO, Plan, Step, apply_plan
    from lowrank_jax.compress.svd import truncated_svd
    from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt

    rng = np.random.default_rng(0)
    n = 16 if quick else 48
    mats = [rng.normal(size=(512, 512)).astype(np.float32) for _ in range(n)]
    work = {f"{n} SVDs of 512 x 512 (truncated_svd)":
            lambda: [truncated_svd(m, eps=0.3) for m in mats]}
    t5 = T5Config(vocab_size=2, d_model=512, d_kv=64, d_ff=1024, num_layers=2,
                  num_decoder_layers=2, num_heads=8)
    cfg = ChronosBoltConfig(t5=t5, context_length=64, prediction_length=16, input_patch_size=16,
                            input_patch_stride=16, use_reg_token=True)
    params = chronos_bolt.init(jax.random.PRNGKey(0), cfg)
    plan = Plan((Step("svd", ATTENTION_QKVO, {"eps": 0.3}),))
    # blas_threads=None: the setting of the surrounding block (default or one thread) decides
    work["apply_plan: svd, Chronos-Bolt d_model 512, 24 matrices"] = (
        lambda: apply_plan(params, plan, config=cfg, blas_threads=None))
    if not quick:
        big = [rng.normal(size=(2048, 2048)).astype(np.float32) for _ in range(2)]
        work["2 SVDs of 2048 x 2048 (truncated_svd)"] = (
            lambda: [truncated_svd(m, eps=0.3) for m in big])
    return work


def start_hogs(n: int) -> list[subprocess.Popen]:
    """``n`` busy-looping Python processes (stopped by :func:`stop_hogs`)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for p in hogs:
        p.kill()
    for p in hogs:
        p.wait()


def measure(work: dict, runs: int) -> list[dict]:
    """Each workload, default threads against one thread, ``runs`` interleaved pairs."""
    from lowrank_jax import runtime

    rows = []
    for name, fn in work.items():
        def one(fn=fn):
            with runtime.blas_threads(1):
                fn()

        (wall, cpu) = time_interleaved([fn, one], runs, 0, cpu=True)
        ratios = [d / o for d, o in zip(wall[0], wall[1], strict=True)]
        rows.append({"what": name, "default_s": wall[0], "one_s": wall[1],
                     "default_cpu_s": cpu[0], "one_cpu_s": cpu[1],
                     "default_median_s": statistics.median(wall[0]),
                     "one_median_s": statistics.median(wall[1]),
                     "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios)})
        r = rows[-1]
        print(f"  {name:<64} {r['default_median_s']:8.2f} {r['one_median_s']:8.2f} "
              f"{r['ratio_median']:6.2f} {r['ratio_min']:6.2f}-{r['ratio_max']:.2f}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--quick", action="store_true", help="3 pairs, 16 SVDs, no 2048 x 2048")
    ap.add_argument("--runs", type=int, help="pairs per row (default 5; quick 3)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 1,
                    help="busy-looping processes of the busy condition (default: one per core)")
    args = ap.parse_args()
    runs = args.runs or (3 if args.quick else 5)

    work = workloads(args.quick)
    for fn in work.values():  # warm up (imports, the model's first jnp conversions)
        fn()
    info = blas_info()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"malloc: {malloc_setting()}; BLAS: "
          + ", ".join(f"{i['internal_api']} {i['version']} ({i['num_threads']} threads)"
                      for i in info))
    print(f"# {runs} pairs per row; ratio = default s / one-thread s (above 1: one thread faster)")
    print(f"  {'what':<64} {'default':>8} {'one':>8} {'ratio':>6} {'range':>9}")
    conditions = []
    for cond in ("idle", "busy"):
        hogs = start_hogs(args.hogs) if cond == "busy" else []
        try:
            if hogs:
                time.sleep(1.0)  # let them start
            load0, snap0 = os.getloadavg(), cpu_snapshot()
            print(f"{cond}: load average {load0[0]:.2f} (1 min) before"
                  + (f", {len(hogs)} busy-looping processes started" if hogs else ""), flush=True)
            rows = measure(work, runs)
            load1, snap1 = os.getloadavg(), cpu_snapshot()
        finally:
            stop_hogs(hogs)
        others = other_load(snap0, snap1)
        print(f"{cond}: load average {load1[0]:.2f} after; other processes used "
              f"{'n/a' if others is None else f'{100 * others:.0f}%'} of the machine's CPU "
              "time meanwhile", flush=True)
        conditions.append({"condition": cond, "hogs": len(hogs), "loadavg_before": load0,
                           "loadavg_after": load1, "other_load": others, "rows": rows})
    if args.json:
        write_json(args.json, {"runs": runs, "cores": os.cpu_count(), "blas": info,
                               "malloc": malloc_setting(), "python": sys.version.split()[0],
                               "note": "the machine may be shared: see each condition's load",
                               "conditions": conditions})
    return 0


if __name__ == "__main__":
    sys.exit(main())
