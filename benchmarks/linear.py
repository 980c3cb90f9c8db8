"""Time ``linear`` on ``LowRank`` leaves against the dense leaf they replace.

For every model width ``d`` and token count, three ``LowRank`` leaves whose FLOP ratio to the
dense ``[d, d]`` leaf is about 0.1, 0.25 and 0.5 (rank ``r = round(ratio * d / 2)``; the table
reports the exact ratio of the rank used, from :func:`lowrank_jax.flops`) are timed in the same
loop as the dense leaf, so machine noise hits all of them alike. Each figure is the median of
``--runs`` calls of ``jax.jit(lambda leaf, x: linear(leaf, x))`` (the leaf is an argument, not
a constant folded into the program), after warm-up, each call ended by ``block_until_ready``.

The figure of merit is ``time ratio / FLOP ratio``: 1.0 means the factorized product runs at
the dense product's speed per multiply-add; the goal is ``<= 1.15``.

Usage::

    python benchmarks/linear.py                 # d = 1024, 768, 512; 512, 2048, 8192 tokens
    python benchmarks/linear.py --quick         # fewer runs, for a smoke test
    python benchmarks/linear.py --json out.json --d 768 --tokens 8192 --runs 60
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

GOAL = 1.15


def bench(d: int, n_tokens: int, ratios: list[float], *, runs: int, warmup: int,
          seed: int = 0) -> list[dict]:
    """Rows of the table for one ``(d, n_tokens)``: one row per target FLOP ratio."""
    kx, kd, *kl = jax.random.split(jax.random.key(seed), 2 + len(ratios))
    x = jax.random.normal(kx, (n_tokens, d), jnp.float32)  # [tokens, d]
    dense = lj.init_dense(kd, d, d)
    ranks = [max(1, round(q * d / 2)) for q in ratios]
    lowranks = [lj.init_lowrank(k, d, d, r) for k, r in zip(kl, ranks, strict=True)]
    fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    before = cpu_snapshot()
    calls = [lambda lf=lf: jax.block_until_ready(fn(lf, x)) for lf in [dense, *lowranks]]
    med = [statistics.median(t) for t in time_interleaved(calls, runs, warmup)]
    load = other_load(before, cpu_snapshot())
    dense_flops = lj.flops(dense, n_tokens)
    rows = []
    for q, r, leaf, t in zip(ratios, ranks, lowranks, med[1:], strict=True):
        flop_ratio = lj.flops(leaf, n_tokens) / dense_flops
        time_ratio = t / med[0]
        rows.append({
            "d": d, "tokens": n_tokens, "target_ratio": q, "rank": r,
            "flop_ratio": flop_ratio, "dense_ms": med[0] * 1e3, "lowrank_ms": t * 1e3,
            "time_ratio": time_ratio, "time_per_flop_ratio": time_ratio / flop_ratio,
            "other_load": load,
        })
    return rows


HEADER = (f"{'d':>4} {'tokens':>6} {'target':>6} {'rank':>4} {'flop ratio':>10} "
          f"{'dense ms':>9} {'lowrank ms':>10} {'time ratio':>10} {'time/flop':>9} "
          f"{'other load':>10}")


def format_row(row: dict) -> str:
    flag = "" if row["time_per_flop_ratio"] <= GOAL else "  > goal"
    load = "n/a" if row["other_load"] is None else f"{100 * row['other_load']:.0f}%"
    return (f"{row['d']:>4} {row['tokens']:>6} {row['target_ratio']:>6.2f} {row['rank']:>4} "
            f"{row['flop_ratio']:>10.4f} {row['dense_ms']:>9.3f} {row['lowrank_ms']:>10.3f} "
            f"{row['time_ratio']:>10.3f} {row['time_per_flop_ratio']:>9.2f} {load:>10}{flag}")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, nargs="+", default=[1024, 768, 512], help="model widths")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                   help="target FLOP ratios of the low-rank leaves to the dense one")
    p.add_argument("--runs", type=int, default=None, help="timed runs per leaf (default 30)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="5 runs, 1 warm-up: a smoke test")
    p.add_argument("--json", metavar="PATH", help="write the rows (and the setup) as JSON")
    args = p.parse_args(argv)
    runs = args.runs if args.runs is not None else (5 if args.quick else 30)
    warmup = 1 if args.quick else args.warmup

    setup = {
        "jax": jax.__version__, "backend": jax.default_backend(),
        "devices": [str(dv) for dv in jax.devices()], "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "runs": runs,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "keep_freed_memory": lj.runtime.freed_memory_kept(),
    }
    print(f"# jax {setup['jax']} on {setup['backend']} ({setup['cpu_count']} CPUs), median of "
          f"{runs} interleaved runs; time/flop = (lowrank ms / dense ms) / flop ratio, "
          f"goal <= {GOAL}; other load = CPU share used by other processes meanwhile; malloc "
          f"keeps freed memory: {bool(setup['keep_freed_memory'])}")
    print(HEADER)
    rows = []
    for d in args.d:
        for n in args.tokens:
            for row in bench(d, n, args.ratios, runs=runs, warmup=warmup):
                print(format_row(row), flush=True)
                rows.append(row)
    worst = max(r["time_per_flop_ratio"] for r in rows)
    print(f"# worst time/flop ratio {worst:.2f} (goal <= {GOAL}): "
          f"{sum(r['time_per_flop_ratio'] <= GOAL for r in rows)}/{len(rows)} rows meet it")
    if args.json:
        write_json(args.json, {"setup": setup, "rows": rows})
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
