"""``HeadLowRank`` with irregular per-head ranks: execution on the true ranks against the padded
execution it replaced: irregular ranks executed so that the executed FLOPs are the true ones,
and counted as executed.

A 12-head projection (``d_in = 768``, ``d_head = 64``) with per-head ranks as per-head eps
truncation gives them, at 512 / 2048 / 8192 tokens. Three jitted calls per row, interleaved
(median of ``--runs``): the dense ``[768, 768]`` leaf, the leaf as it runs now (both products on
the true ranks: ``x @ u[:, kept columns]``, then each head's lift) and the same leaf run padded
(the module's ``EXACT_BELOW`` set to 0 while tracing: how irregular ranks ran before
2026-11-27, with today's head-major lift). ``flop ratio`` = :func:`lowrank_jax.flops` of the
leaf as it runs now / dense; ``pad t/f`` uses the padded execution's FLOPs; outputs of the two
executions agree to float32 round-off (``rel diff``).

Usage::

    python -m benchmarks.layers head_lowrank --json head_lowrank.json
    python -m benchmarks.layers head_lowrank --quick
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import lowrank_jax as lj
from benchmarks import _harness as H
from lowrank_jax.leaves import head_lowrank as hl

GOAL = 1.15
RANK_SETS = {
    "spread 12-48": (20, 35, 12, 48, 30, 25, 40, 18, 33, 27, 45, 22),
    "spread 8-64": (8, 16, 24, 32, 40, 48, 56, 64, 12, 20, 28, 36),
    "near uniform 57-64": (60, 62, 58, 64, 61, 63, 59, 60, 62, 64, 57, 61),
}


def make_leaf(ranks: tuple, rng, d: int = 768, d_head: int = 64):
    """A random ``HeadLowRank`` leaf with per-head ``ranks``."""
    h, r = len(ranks), max(ranks)
    u = jnp.asarray(rng.normal(size=(d, h, r)) / np.sqrt(d), jnp.float32)
    v = jnp.asarray(rng.normal(size=(h, r, d_head)) / np.sqrt(r), jnp.float32)
    return lj.HeadLowRank(u, v, ranks=ranks)


def bench(name: str, ranks: tuple, leaf, x, *, runs: int) -> dict:
    """One row: the dense leaf, the leaf as it runs now and padded, timed in one loop."""
    n, r = x.shape[0], max(ranks)
    dense = lj.Dense(lj.materialize(leaf))
    fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    now = jax.jit(lambda lf, x: lj.linear(lf, x))
    padded = jax.jit(lambda lf, x: lj.linear(lf, x))
    saved = hl.EXACT_BELOW
    hl.EXACT_BELOW = 0.0  # traced now: this jit keeps the padded program
    try:
        jax.block_until_ready(padded(leaf, x))
        flops_pad = lj.flops(leaf, n)
    finally:
        hl.EXACT_BELOW = saved
    m = H.measure({"dense": lambda: fn(dense, x), "now": lambda: now(leaf, x),
                   "padded": lambda: padded(leaf, x)}, runs=runs, warmup=1,
                  check={"now": "padded"},
                  flops={"dense": lj.flops(dense, n), "now": lj.flops(leaf, n),
                         "padded": flops_pad})
    return {
        "ranks": name, "sum_ranks": sum(ranks), "max_rank": r, "tokens": n,
        "exact_path": leaf._exact_layout() is not None,
        "dense_ms": m.ms("dense"), "now_ms": m.ms("now"), "padded_ms": m.ms("padded"),
        "speedup_vs_padded": m.ratio("padded", "now"),
        "flop_ratio": m.flop_ratio("now", "dense"),
        "padded_flop_ratio": m.flop_ratio("padded", "dense"),
        "time_over_flop": m.time_per_flop("now", "dense"),
        "padded_time_over_flop": m.time_per_flop("padded", "dense"),
        "max_rel_diff": m.rel_error["now"], "other_load": m.load,
    }


TABLE = H.Table(
    H.Col("ranks", "ranks", width=20),
    H.Col("sum/pad", lambda r: r["sum_ranks"] / (12 * r["max_rank"]), ".2f", 8),
    H.Col("tokens", "tokens"), H.Col("dense ms", "dense_ms", ".2f", 9),
    H.Col("now ms", "now_ms", ".2f", 8), H.Col("padded ms", "padded_ms", ".2f"),
    H.Col("speedup", "speedup_vs_padded", ".2f"), H.Col("flops", "flop_ratio", ".2f", 6),
    H.Col("t/f", "time_over_flop", ".2f", 5), H.Col("pad t/f", "padded_time_over_flop", ".2f"),
    H.Col("rel diff", "max_rel_diff", ".1e"), H.Col("load", "other_load", "%", 5))


def goals(rows: list[dict]) -> dict:
    worst = max(rows, key=lambda r: r["time_over_flop"])
    met = sum(r["time_over_flop"] <= GOAL for r in rows)
    speed = sorted(r["speedup_vs_padded"] for r in rows if r["exact_path"])
    return {
        **H.goal("HeadLowRank, irregular ranks: time/FLOP (d 768, 12 heads)",
                 worst["time_over_flop"], target=f"<= {GOAL}", holds=met == len(rows),
                 measured=f"worst {worst['time_over_flop']:.2f} ({worst['ranks']}, "
                          f"{worst['tokens']} tokens); {met}/{len(rows)} rows meet it"),
        **H.goal("HeadLowRank, irregular ranks: on the true ranks vs padded (speed-up)",
                 speed[len(speed) // 2] if speed else None,
                 measured=(f"{speed[0]:.2f}-{speed[-1]:.2f}x over {len(speed)} rows" if speed
                           else "no row runs on the true ranks")),
    }


def main(argv=None) -> dict:
    p = H.parser(__doc__, quick="2048 tokens only, 15 runs")
    p.add_argument("--runs", type=int, default=None, help="default 30, quick 15")
    args = p.parse_args(argv)
    runs = args.runs or (15 if args.quick else 30)
    tokens = (2048,) if args.quick else (512, 2048, 8192)
    run = H.Run(__name__, argv, runs=runs, d_in=768, heads=12, d_head=64,
                exact_below=hl.EXACT_BELOW)
    rng = np.random.default_rng(0)
    print(f"# {run.describe()}; d_in 768, 12 heads of 64; median of {runs} interleaved runs")
    print(TABLE.header())
    rows = []
    for name, ranks in RANK_SETS.items():
        leaf = make_leaf(ranks, rng)
        for n in tokens:
            x = jnp.asarray(rng.normal(size=(n, 768)), jnp.float32)
            rows.append(bench(name, ranks, leaf, x, runs=runs))
            print(TABLE.line(rows[-1]), flush=True)
    return run.finish(args.json, rows=rows, goals=goals(rows))


if __name__ == "__main__":
    H.run_as_main(__spec__)
