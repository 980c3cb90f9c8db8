"""Host BLAS threads for the decompositions of ``compress``: OpenBLAS's default (one thread per
core) against one thread (:func:`lowrank_jax.runtime.blas_threads`), on an idle machine and on a
busy one.

The SVDs of ``compress`` run in NumPy's LAPACK on the host. OpenBLAS's threads spin while they
wait for work; when other processes hold the cores, they wait for cores instead. Each workload
runs with the default thread count and with ``blas_threads(1)`` in one process, the two calls of
a pair back to back and their order swapped every other run (``lowrank_jax.timing``), so
the load of the machine hits both sides of every ratio. Two conditions, one after the other:
"idle" (nothing started by the script) and "busy" (one busy-looping Python process per core,
started by the script and stopped after). The machine may be shared: its load average
(``os.getloadavg``) before and after each condition and the share of its CPU time that other
processes than this one used meanwhile (``lowrank_jax.timing.other_load``, the hogs included) are printed
and written with the timings.

Workloads: 48 truncated SVDs of 512 x 512 float32 matrices through the library's own path
(``truncated_svd``, SVD in float64); ``apply_plan`` of one ``svd`` step (eps 0.3, attention
projections) on a Chronos-Bolt with d_model 512, 2 + 2 layers (24 matrices of 512 x 512);
without ``--quick`` also 2 SVDs of 2048 x 2048 (where more threads could pay on an idle
machine).

The table gives per condition and workload the median seconds of each setting and the ratio
``default s / one-thread s`` of each pair: median, smallest and largest (above 1: one thread is
faster).

Figures: ``docs/benchmarks.md`` (one thread 1.5-15.6x faster in 17 of 18 pairs on a shared
2-core machine, also for 2048 x 2048).

Usage::

    python -m benchmarks.machine blas_threads --json blas_threads.json   # 5 pairs per row
    python -m benchmarks.machine blas_threads --runs 3         # 35 min on a shared 2-core CPU
    python -m benchmarks.machine blas_threads --quick          # 3 pairs, 16 SVDs, no 2048
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from benchmarks import _harness as H


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

        t = H.time_calls({"default": fn, "one": one}, runs=runs, warmup=0)
        ratio = t.ratio("default", "one").paired
        rows.append({"what": name, "default_s": list(t.seconds("default")),
                     "one_s": list(t.seconds("one")),
                     "default_cpu_s": list(t.seconds("default", cpu=True)),
                     "one_cpu_s": list(t.seconds("one", cpu=True)),
                     "default_median_s": t.median("default"), "one_median_s": t.median("one"),
                     "ratio_median": ratio.median, "ratio_min": ratio.min,
                     "ratio_max": ratio.max})
        r = rows[-1]
        print(f"  {name:<64} {r['default_median_s']:8.2f} {r['one_median_s']:8.2f} "
              f"{r['ratio_median']:6.2f} {r['ratio_min']:6.2f}-{r['ratio_max']:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = H.parser(__doc__, quick="3 pairs, 16 SVDs, no 2048 x 2048")
    ap.add_argument("--runs", type=int, help="pairs per row (default 5; quick 3)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 1,
                    help="busy-looping processes of the busy condition (default: one per core)")
    args = ap.parse_args(argv)
    runs = args.runs or (3 if args.quick else 5)
    run = H.Run(__name__, argv, runs=runs, hogs=args.hogs)

    work = workloads(args.quick)
    for fn in work.values():  # warm up (imports, the model's first jnp conversions)
        fn()
    info = blas_info()
    print(f"# {run.describe()}; BLAS: "
          + ", ".join(f"{i['internal_api']} {i['version']} ({i['num_threads']} threads)"
                      for i in info))
    print(f"# {runs} pairs per row; ratio = default s / one-thread s (above 1: one thread faster)")
    print(f"  {'what':<64} {'default':>8} {'one':>8} {'ratio':>6} {'range':>9}")
    from lowrank_jax import timing

    conditions = []
    for cond in ("idle", "busy"):
        hogs = start_hogs(args.hogs) if cond == "busy" else []
        try:
            if hogs:
                time.sleep(1.0)  # let them start
            load0, snap0 = os.getloadavg(), timing.cpu_snapshot()
            print(f"{cond}: load average {load0[0]:.2f} (1 min) before"
                  + (f", {len(hogs)} busy-looping processes started" if hogs else ""), flush=True)
            rows = measure(work, runs)
            load1, snap1 = os.getloadavg(), timing.cpu_snapshot()
        finally:
            stop_hogs(hogs)
        others = timing.other_load(snap0, snap1)
        print(f"{cond}: load average {load1[0]:.2f} after; other processes used "
              f"{'n/a' if others is None else f'{100 * others:.0f}%'} of the machine's CPU "
              "time meanwhile", flush=True)
        conditions.append({"condition": cond, "hogs": len(hogs), "loadavg_before": load0,
                           "loadavg_after": load1, "other_load": others, "rows": rows})
    goals = {}
    for c in conditions:
        ratios = [r["ratio_median"] for r in c["rows"]]
        goals.update(H.goal(
            f"host SVDs of compress, {c['condition']} machine: default BLAS threads time / one "
            "thread (median over workloads)", statistics.median(ratios),
            measured=f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} workloads; other "
                     f"load {H.percent(c['other_load'])}"))
    rows = [{"condition": c["condition"], **r} for c in conditions for r in c["rows"]]
    run.finish(args.json, rows=rows, goals=goals, blas=info,
               note="the machine may be shared: see each condition's load",
               conditions=conditions)
    return 0


if __name__ == "__main__":
    H.run_as_main(__spec__)
