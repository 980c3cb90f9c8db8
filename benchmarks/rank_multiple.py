"""Time ``LowRank`` leaves at a rank against the same leaf with the rank rounded up.

``compress(..., rank_multiple=k)`` (the ``svd`` method's ``rank_multiple`` setting) rounds every
rank it decides up to a multiple of ``k``: more singular values, so never a larger error, and
on some hardware a faster product. This script measures whether it is faster here: for every
width ``d``, token count and rank ``r`` (ranks an eps truncation could give, mostly not
multiples of 8), ``linear(leaf, x)`` of a ``[d, d]`` ``LowRank`` leaf of rank ``r`` is timed in
one interleaved loop with the leaves of rank ``round_up(r, 8)`` and ``round_up(r, 16)``; the
table gives each one's milliseconds and ``speed-up = time(r) / time(rounded)`` (above 1: the
larger rank is faster) next to the FLOP factor ``rounded / r`` it pays for it.

Usage::

    python benchmarks/rank_multiple.py                      # d 512/768/1024, 2048 + 8192 tokens
    python benchmarks/rank_multiple.py --quick              # d 768, 2048 tokens, fewer ranks
    python benchmarks/rank_multiple.py --json rank_multiple.json --runs 40
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
from _machine import cpu_snapshot, other_load, time_interleaved, write_json  # benchmarks/_machine.py

try:
    import lowrank_jax as lj
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lowrank_jax as lj

from lowrank_jax.compress.svd_method import round_up

RANKS = [20, 22, 26, 28, 30, 36, 40, 44, 52, 58, 62]
QUICK_RANKS = [22, 26, 30, 40, 58]
MULTIPLES = (8, 16)


def bench(d: int, n_tokens: int, r: int, *, runs: int, warmup: int, seed: int = 0) -> dict:
    """One row: rank ``r`` against its round-ups, timed in one loop."""
    ranks = sorted({r, *(round_up(r, k, d) for k in MULTIPLES)})
    kx, *kl = jax.random.split(jax.random.key(seed + r), 1 + len(ranks))
    x = jax.random.normal(kx, (n_tokens, d), jnp.float32)
    leaves = {q: lj.init_lowrank(k, d, d, q) for k, q in zip(kl, ranks, strict=True)}
    fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    before = cpu_snapshot()
    calls = [lambda lf=lf: jax.block_until_ready(fn(lf, x)) for lf in leaves.values()]
    med = dict(zip(ranks, (statistics.median(t) for t in time_interleaved(calls, runs, warmup)),
                   strict=True))
    row = {"d": d, "tokens": n_tokens, "rank": r, "ms": 1e3 * med[r],
           "other_load": other_load(before, cpu_snapshot())}
    for k in MULTIPLES:
        q = round_up(r, k, d)
        row[f"rank_{k}"] = q
        row[f"ms_{k}"] = 1e3 * med[q]
        row[f"speedup_{k}"] = med[r] / med[q]
        row[f"flops_{k}"] = q / r
    return row


def summary(rows: list[dict]) -> dict:
    """Per multiple: how often rounding up was faster, and the median speed-up."""
    out = {}
    for k in MULTIPLES:
        rounded = [row for row in rows if row[f"rank_{k}"] != row["rank"]]
        faster = [row for row in rounded if row[f"speedup_{k}"] > 1.0]
        out[k] = {"rounded": len(rounded), "faster": len(faster),
                  "median_speedup": (statistics.median(row[f"speedup_{k}"] for row in rounded)
                                     if rounded else None),
                  "faster_ranks": sorted({row["rank"] for row in faster})}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, nargs="+", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--ranks", type=int, nargs="+", default=None)
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="d 768, 2048 tokens, 5 ranks, 10 runs")
    p.add_argument("--json", help="write the rows and the summary here")
    args = p.parse_args(argv)
    d_list = args.d or ([768] if args.quick else [512, 768, 1024])
    tokens = args.tokens or ([2048] if args.quick else [2048, 8192])
    ranks = args.ranks or (QUICK_RANKS if args.quick else RANKS)
    runs = args.runs or (10 if args.quick else 30)
    print(f"# jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} CPUs), median "
          f"of {runs} interleaved runs; speed-up = time(rank) / time(rounded rank), FLOPs = "
          "rounded / rank; other load = CPU share used by other processes meanwhile")
    print(f"{'d':>5} {'tokens':>6} {'rank':>4} {'ms':>8} | {'r8':>3} {'ms':>8} {'speed-up':>8} "
          f"{'FLOPs':>5} | {'r16':>3} {'ms':>8} {'speed-up':>8} {'FLOPs':>5} | load")
    rows = []
    for d in d_list:
        for n in tokens:
            for r in ranks:
                if r >= d:
                    continue
                row = bench(d, n, r, runs=runs, warmup=3)
                rows.append(row)
                print(f"{d:5d} {n:6d} {r:4d} {row['ms']:8.3f} | "
                      + " | ".join(f"{row[f'rank_{k}']:3d} {row[f'ms_{k}']:8.3f} "
                                   f"{row[f'speedup_{k}']:8.2f} {row[f'flops_{k}']:5.2f}"
                                   for k in MULTIPLES)
                      + f" | {row['other_load']:.0%}", flush=True)
    summ = summary(rows)
    for k, s in summ.items():
        med = "-" if s["median_speedup"] is None else f"{s['median_speedup']:.2f}"
        print(f"# rank_multiple={k}: faster in {s['faster']}/{s['rounded']} rounded rows, median "
              f"speed-up {med}; faster at ranks {s['faster_ranks']}")
    goals = {  # rows of benchmarks/run_all.py's table: reported, no target
        f"LowRank leaf, rank rounded up to a multiple of {k} (compress rank_multiple={k}): "
        "median speed-up over the ranks it changes": {
            "value": s["median_speedup"], "goal": "reported", "holds": None,
            "faster": f"{s['faster']}/{s['rounded']}"}
        for k, s in summ.items()}
    if args.json:
        write_json(args.json, {"machine": platform.processor() or platform.machine(),
                               "jax": jax.__version__, "runs": runs, "rows": rows,
                               "summary": {str(k): v for k, v in summ.items()},
                               "goals": goals})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
