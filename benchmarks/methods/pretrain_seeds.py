"""The demo's pretraining comparison over several seeds: mean and spread per method.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility" (sec. 5, App. K Tables 3-4) compares, at one budget, a model pretrained with
the flow-of-ranks rank schedule against one pretrained with a uniform rank, and both against
truncated SVD of a pretrained dense model. At the demo's scale the differences between the
pretrained rows are a few percent, the size of the seed-to-seed spread, so one seed says
little. This script runs the comparison of ``lowrank-jax demo`` (part 3,
:func:`lowrank_jax.recipes.run_pretraining_demo`) once per seed (the seed sets the
initialization, the order of the training batches and the factor draws; the data and the test
windows are the same) and reports, per method, the mean, the sample standard deviation
(``ddof=1``), min and max of the relative WQL and MASE and of the size and time ratios, and in
how many seeds flow-of-ranks beats the uniform rank.

Usage::

    python -m benchmarks.methods pretrain_seeds --json seeds.json        # 600 steps, seeds 0 1 2
    python -m benchmarks.methods pretrain_seeds --quick --seeds 0 1 --json q.json
"""

from __future__ import annotations

import math
import time

import numpy as np

from benchmarks import _harness as H
from lowrank_jax.datasets import builtin_datasets
from lowrank_jax.recipes import run_pretraining_demo
from lowrank_jax.runtime import one_blas_thread

METRICS = ("wql", "mase", "size_ratio", "time_ratio")


def method_key(name: str) -> str:
    """Rows named by their settings (``pretrained flow-of-ranks [4, 7, 9, 11]``) grouped under
    the method, with the settings kept in the row (they are the same for every seed)."""
    for prefix in ("pretrained flow-of-ranks", "pretrained uniform rank"):
        if name.startswith(prefix):
            return prefix
    return name


def summarize(runs: list[dict]) -> dict:
    """Per method: ``{metric: {mean, std, min, max, values}}`` over the seeds, and the names
    the method had in each seed."""
    by: dict[str, dict] = {}
    for run in runs:
        for row in run["rows"]:
            entry = by.setdefault(method_key(row["method"]), {"names": [], "values": {}})
            entry["names"].append(row["method"])
            for m in METRICS:
                entry["values"].setdefault(m, []).append(row[m])
    out = {}
    for key, entry in by.items():
        stats = {}
        for m, vals in entry["values"].items():
            a = np.asarray(vals, np.float64)
            stats[m] = {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
                        "min": float(a.min()), "max": float(a.max()), "values": a.tolist()}
        out[key] = {"names": sorted(set(entry["names"])), "n": len(entry["names"]), **stats}
    return out


def wins(runs: list[dict], a: str, b: str, metric: str) -> int:
    """In how many seeds method ``a`` has a lower ``metric`` than method ``b``."""
    n = 0
    for run in runs:
        rows = {method_key(r["method"]): r for r in run["rows"]}
        n += rows[a][metric] < rows[b][metric]
    return n


def format_table(summary: dict, n_seeds: int) -> str:
    lines = [f"{'method':<40} {'size':>6} {'time (mean +- std)':>19} "
             f"{'WQL (mean +- std) [min, max]':>30} {'MASE (mean +- std) [min, max]':>31}"]
    for key, s in summary.items():
        name = s["names"][0] if len(s["names"]) == 1 else key
        lines.append(
            f"{name:<40} {s['size_ratio']['mean']:>6.3f} "
            f"{s['time_ratio']['mean']:>9.3f} +- {s['time_ratio']['std']:<5.3f} "
            f"{s['wql']['mean']:>8.3f} +- {s['wql']['std']:.3f} [{s['wql']['min']:.3f}, "
            f"{s['wql']['max']:.3f}] "
            f"{s['mase']['mean']:>8.3f} +- {s['mase']['std']:.3f} [{s['mase']['min']:.3f}, "
            f"{s['mase']['max']:.3f}]")
    lines.append(f"({n_seeds} seeds; relative to the dense model of the same seed; std with "
                 "ddof=1)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = H.parser(__doc__, quick="the demo's --quick setting (2+1 layers, 40 steps)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, help="training steps per model (default: the demo's)")
    ap.add_argument("--progress", action="store_true", help="training progress bars")
    args = ap.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds) or any(s < 0 for s in args.seeds):
        ap.error(f"--seeds must be distinct ints >= 0, got {args.seeds}")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be an int >= 1, got {args.steps}")

    t0 = time.perf_counter()
    bench = H.Run(__name__, argv, seeds=args.seeds, quick=args.quick)
    datasets = builtin_datasets()
    runs = []
    with one_blas_thread():
        for seed in args.seeds:
            ts = time.perf_counter()
            run = run_pretraining_demo(quick=args.quick, steps=args.steps, seed=seed,
                                       progress=args.progress, datasets=datasets)
            run["printed"] = run.text  # the demo's own table per seed goes to the JSON only
            runs.append(run)
            print(f"seed {seed}: {time.perf_counter() - ts:.0f} s; "
                  + ", ".join(f"{method_key(r['method']).replace('pretrained ', '')} WQL "
                              f"{r['wql']:.3f}" for r in run["rows"]
                              if r["method"].startswith("pretrained")), flush=True)
    summary = summarize(runs)
    n = len(runs)
    print()
    print(format_table(summary, n))
    flow, uni = "pretrained flow-of-ranks", "pretrained uniform rank"
    counts = {m: wins(runs, flow, uni, m) for m in ("wql", "mase")}
    print(f"flow-of-ranks has the lower WQL than uniform in {counts['wql']} of {n} seeds, the "
          f"lower MASE in {counts['mase']} of {n}")
    seconds = time.perf_counter() - t0
    goals = H.goal("demo pretraining: seeds in which flow-of-ranks has the lower WQL than a "
                   "uniform rank", counts["wql"], measured=f"{counts['wql']} of {n} (MASE: "
                   f"{counts['mase']} of {n})")
    rows = [{"method": key, **{m: s[m]["mean"] for m in METRICS},
             **{f"{m}_std": s[m]["std"] for m in METRICS}} for key, s in summary.items()]
    bench.finish(args.json, rows=rows, goals=goals, seeds=args.seeds, quick=args.quick,
                 steps=runs[0]["steps"], summary=summary,
                 flow_beats_uniform={**counts, "of": n}, seconds=seconds,
                 runs=[{k: v for k, v in r.items() if k != "plots"} for r in runs])
    return 0 if all(math.isfinite(s["wql"]["mean"]) for s in summary.values()) else 1


if __name__ == "__main__":
    H.run_as_main(__spec__)
