"""``HeadLowRank`` with irregular per-head ranks: execution on the true ranks against the padded
execution it replaced (issue 15, goal 1: "execute irregular ranks so that executed FLOPs are the
true ones, and count what is executed").

A 12-head projection (``d_in = 768``, ``d_head = 64``) with per-head ranks as per-head eps
truncation gives them, at 512 / 2048 / 8192 tokens. Three jitted calls per row, interleaved
(median of ``--runs``): the dense ``[768, 768]`` leaf, the leaf as it runs now (both products on
the true ranks: ``x @ u[:, kept columns]``, then each head's lift) and the same leaf run padded
(the module's ``EXACT_BELOW`` set to 0 while tracing: how irregular ranks ran before
2026-11-27, with today's head-major lift). ``flop ratio`` = :func:`lowrank_jax.flops` of the
leaf as it runs now / dense; ``pad t/f`` uses the padded execution's FLOPs; outputs of the two
executions agree to float32 round-off (``rel diff``).

Usage::

    python benchmarks/head_lowrank.py --json head_lowrank.json
    python benchmarks/head_lowrank.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _machine import cpu_snapshot, other_load, time_interleaved, write_json  # benchmarks/_machine.py

try:
    import lowrank_jax as lj
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lowrank_jax as lj
from lowrank_jax.leaves import head_lowrank as hl  # noqa: E402

RANK_SETS = {
    "spread 12-48": (20, 35, 12, 48, 30, 25, 40, 18, 33, 27, 45, 22),
    "spread 8-64": (8, 16, 24, 32, 40, 48, 56, 64, 12, 20, 28, 36),
    "near uniform 57-64": (60, 62, 58, 64, 61, 63, 59, 60, 62, 64, 57, 61),
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="2048 tokens only, 15 runs")
    p.add_argument("--runs", type=int, default=None, help="default 30, quick 15")
    args = p.parse_args(argv)
    runs = args.runs or (15 if args.quick else 30)
    tokens = (2048,) if args.quick else (512, 2048, 8192)
    d, h, dh = 768, 12, 64
    rng = np.random.default_rng(0)
    fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    saved = hl.EXACT_BELOW
    rows = []
    before = cpu_snapshot()
    for name, ranks in RANK_SETS.items():
        r = max(ranks)
        u = jnp.asarray(rng.normal(size=(d, h, r)) / np.sqrt(d), jnp.float32)
        v = jnp.asarray(rng.normal(size=(h, r, dh)) / np.sqrt(r), jnp.float32)
        leaf = lj.HeadLowRank(u, v, ranks=ranks)
        dense = lj.Dense(lj.materialize(leaf))
        for n in tokens:
            x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
            now = jax.jit(lambda lf, x: lj.linear(lf, x))
            padded = jax.jit(lambda lf, x: lj.linear(lf, x))
            y_now = now(leaf, x)
            hl.EXACT_BELOW = 0.0  # traced now: this jit keeps the padded program
            try:
                y_pad = padded(leaf, x)
                flops_pad = lj.flops(leaf, n)
            finally:
                hl.EXACT_BELOW = saved
            calls = {"dense": lambda x=x, w=dense: fn(w, x),
                     "now": lambda x=x, f=now, lf=leaf: f(lf, x),
                     "padded": lambda x=x, f=padded, lf=leaf: f(lf, x)}
            times = time_interleaved([lambda c=c: jax.block_until_ready(c())
                                      for c in calls.values()], runs, 1)
            med = {k: statistics.median(t) for k, t in zip(calls, times, strict=True)}
            f_dense, f_now = lj.flops(dense, n), lj.flops(leaf, n)
            rows.append({
                "ranks": name, "sum_ranks": sum(ranks), "max_rank": r, "tokens": n,
                "exact_path": leaf._exact_layout() is not None,
                "dense_ms": med["dense"] * 1e3, "now_ms": med["now"] * 1e3,
                "padded_ms": med["padded"] * 1e3, "speedup_vs_padded": med["padded"] / med["now"],
                "flop_ratio": f_now / f_dense, "padded_flop_ratio": flops_pad / f_dense,
                "time_over_flop": med["now"] / med["dense"] / (f_now / f_dense),
                "padded_time_over_flop": med["padded"] / med["dense"] / (flops_pad / f_dense),
                "max_rel_diff": float(jnp.max(jnp.abs(y_now - y_pad)) / jnp.max(jnp.abs(y_pad))),
            })
    load = other_load(before, cpu_snapshot())
    print(f"# jax {jax.__version__}, {os.cpu_count()} CPUs; d_in {d}, {h} heads of {dh}; median "
          f"of {runs} interleaved runs; other load "
          f"{'n/a' if load is None else f'{100 * load:.0f}%'}")
    print(f"{'ranks':<20} {'sum/pad':>8} {'tokens':>6} {'dense ms':>9} {'now ms':>8} "
          f"{'padded ms':>9} {'speedup':>7} {'flops':>6} {'t/f':>5} {'pad t/f':>7} {'rel diff':>8}")
    for r in rows:
        print(f"{r['ranks']:<20} {r['sum_ranks'] / (12 * r['max_rank']):>8.2f} {r['tokens']:>6} "
              f"{r['dense_ms']:>9.2f} {r['now_ms']:>8.2f} {r['padded_ms']:>9.2f} "
              f"{r['speedup_vs_padded']:>7.2f} {r['flop_ratio']:>6.2f} {r['time_over_flop']:>5.2f} "
              f"{r['padded_time_over_flop']:>7.2f} {r['max_rel_diff']:>8.1e}")
    result = {"setup": {"jax": jax.__version__, "d_in": d, "heads": h, "d_head": dh,
                        "runs": runs, "other_load": load, "exact_below": saved},
              "rows": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
