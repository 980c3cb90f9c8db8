"""Time ``linear`` on ``LowRank`` leaves against the dense leaf they replace.

For every model width ``d`` and token count, three ``LowRank`` leaves whose FLOP ratio to the
dense ``[d, d]`` leaf is about 0.1, 0.25 and 0.5 (rank ``r = round(ratio * d / 2)``; the table
reports the exact ratio of the rank used, from :func:`lowrank_jax.flops`) are timed in the same
loop as the dense leaf, so machine noise hits all of them alike. Each figure is the median of
``--runs`` calls of ``jax.jit(lambda leaf, x: linear(leaf, x))`` (the leaf is an argument, not
a constant folded into the program), after warm-up, each call ended by ``block_until_ready``.

The figure of merit is ``time ratio / FLOP ratio``: 1.0 means the factorized product runs at
the dense product's speed per multiply-add; the goal is ``<= 1.15``. It is measured twice:

* ``single``: one product per jitted call. Each call also pays JAX's dispatch, the wake-up of
  XLA's threads and an input out of cache (30-60 us per product at 512 tokens on the 2-core
  test machine, a sixth of a 0.3 ms product at d 512).
* ``in program``: ``--chain`` products (default 4, each with its own random leaf) applied one
  after the other inside one jitted program, as a model's layers run; the time per product is
  the program's time over ``--chain``, so dispatch is paid once per program. This is the figure
  the goal is judged on (``run_all.py``), since a leaf in a model never runs as a call of its
  own; both are printed.

Usage::

    python benchmarks/linear.py                 # d = 1024, 768, 512; 512, 2048, 8192 tokens
    python benchmarks/linear.py --quick         # fewer runs, for a smoke test
    python benchmarks/linear.py --json out.json --d 768 --tokens 8192 --runs 60
    python benchmarks/linear.py --chain 0       # single calls only (the table before 2026-11-28)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
from _machine import (  # benchmarks/_machine.py
    cpu_snapshot,
    malloc_setting,
    other_load,
    time_interleaved,
    write_json,
)

try:
    import lowrank_jax as lj
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lowrank_jax as lj

GOAL = 1.15


def bench(d: int, n_tokens: int, ratios: list[float], *, runs: int, warmup: int, chain: int = 4,
          seed: int = 0) -> list[dict]:
    """Rows of the table for one ``(d, n_tokens)``: one row per target FLOP ratio.

    Single calls and (``chain > 0``) programs of ``chain`` products are timed in the same
    interleaved loop.
    """
    n = max(chain, 1)
    kx, *keys = jax.random.split(jax.random.key(seed), 1 + n * (1 + len(ratios)))
    x = jax.random.normal(kx, (n_tokens, d), jnp.float32)  # [tokens, d]
    ranks = [max(1, round(q * d / 2)) for q in ratios]
    # kinds[0]: chain-many dense [d, d] leaves; kinds[1 + i]: LowRank leaves of rank ranks[i]
    kinds = [[lj.init_dense(k, d, d) for k in keys[:n]]]
    for i, r in enumerate(ranks):
        kinds.append([lj.init_lowrank(k, d, d, r) for k in keys[n * (1 + i):n * (2 + i)]])
    fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))

    def program(leaves, x):
        for leaf in leaves:  # unrolled: `chain` products one after the other
            x = lj.linear(leaf, x)
        return x

    prog = jax.jit(program)
    calls = [lambda lf=leaves[0]: jax.block_until_ready(fn(lf, x)) for leaves in kinds]
    if chain:
        calls += [lambda lv=leaves: jax.block_until_ready(prog(lv, x)) for leaves in kinds]
    before = cpu_snapshot()
    med = [statistics.median(t) for t in time_interleaved(calls, runs, warmup)]
    load = other_load(before, cpu_snapshot())
    dense_flops = lj.flops(kinds[0][0], n_tokens)
    rows = []
    for i, (q, r) in enumerate(zip(ratios, ranks, strict=True)):
        flop_ratio = lj.flops(kinds[1 + i][0], n_tokens) / dense_flops
        time_ratio = med[1 + i] / med[0]
        row = {
            "d": d, "tokens": n_tokens, "target_ratio": q, "rank": r,
            "flop_ratio": flop_ratio, "dense_ms": med[0] * 1e3, "lowrank_ms": med[1 + i] * 1e3,
            "time_ratio": time_ratio, "time_per_flop_ratio": time_ratio / flop_ratio,
            "chain": chain, "other_load": load,
        }
        if chain:
            k = len(kinds)
            prog_ratio = med[k + 1 + i] / med[k]
            row.update({"program_dense_ms": med[k] * 1e3 / chain,
                        "program_lowrank_ms": med[k + 1 + i] * 1e3 / chain,
                        "program_time_ratio": prog_ratio,
                        "program_time_per_flop_ratio": prog_ratio / flop_ratio})
        rows.append(row)
    return rows


def judged(row: dict) -> float:
    """The time/FLOP figure the goal is judged on: in a program when measured, else single."""
    return row.get("program_time_per_flop_ratio", row["time_per_flop_ratio"])


HEADER = (f"{'d':>4} {'tokens':>6} {'target':>6} {'rank':>4} {'flop ratio':>10} "
          f"{'dense ms':>9} {'lowrank ms':>10} {'time ratio':>10} {'time/flop':>9} "
          f"{'prog dense':>10} {'prog lowrank':>12} {'prog t/f':>8} {'other load':>10}")


def format_row(row: dict) -> str:
    flag = "" if judged(row) <= GOAL else "  > goal"
    load = "n/a" if row["other_load"] is None else f"{100 * row['other_load']:.0f}%"
    prog = (f"{row['program_dense_ms']:>10.3f} {row['program_lowrank_ms']:>12.3f} "
            f"{row['program_time_per_flop_ratio']:>8.2f}" if "program_time_ratio" in row
            else f"{'-':>10} {'-':>12} {'-':>8}")
    return (f"{row['d']:>4} {row['tokens']:>6} {row['target_ratio']:>6.2f} {row['rank']:>4} "
            f"{row['flop_ratio']:>10.4f} {row['dense_ms']:>9.3f} {row['lowrank_ms']:>10.3f} "
            f"{row['time_ratio']:>10.3f} {row['time_per_flop_ratio']:>9.2f} {prog} "
            f"{load:>10}{flag}")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, nargs="+", default=[1024, 768, 512], help="model widths")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                   help="target FLOP ratios of the low-rank leaves to the dense one")
    p.add_argument("--runs", type=int, default=None, help="timed runs per leaf (default 30)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chain", type=int, default=4,
                   help="products per program for the 'in program' figures (0: single calls only)")
    p.add_argument("--quick", action="store_true", help="5 runs, 1 warm-up: a smoke test")
    p.add_argument("--json", metavar="PATH", help="write the rows (and the setup) as JSON")
    args = p.parse_args(argv)
    runs = args.runs if args.runs is not None else (5 if args.quick else 30)
    warmup = 1 if args.quick else args.warmup

    setup = {
        "jax": jax.__version__, "backend": jax.default_backend(),
        "devices": [str(dv) for dv in jax.devices()], "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "runs": runs, "chain": args.chain,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "keep_freed_memory": lj.runtime.freed_memory_kept(), "malloc": malloc_setting(),
    }
    print(f"# jax {setup['jax']} on {setup['backend']} ({setup['cpu_count']} CPUs), median of "
          f"{runs} interleaved runs; time/flop = (lowrank ms / dense ms) / flop ratio, one "
          f"product per call; prog = per product in a program of {args.chain} (judged), "
          f"goal <= {GOAL}; other load = CPU share used by other processes meanwhile; malloc: "
          f"{setup['malloc']}")
    print(HEADER)
    rows = []
    for d in args.d:
        for n in args.tokens:
            for row in bench(d, n, args.ratios, runs=runs, warmup=warmup, chain=args.chain):
                print(format_row(row), flush=True)
                rows.append(row)
    for name, key in (("single call", "time_per_flop_ratio"),
                      ("in a program", "program_time_per_flop_ratio")):
        got = [r for r in rows if key in r]
        if got:
            worst = max(got, key=lambda r: r[key])
            print(f"# {name}: worst time/flop ratio {worst[key]:.2f} (d {worst['d']}, "
                  f"{worst['tokens']} tokens, rank {worst['rank']}; goal <= {GOAL}): "
                  f"{sum(r[key] <= GOAL for r in got)}/{len(got)} rows meet it")
    if args.json:
        write_json(args.json, {"setup": setup, "rows": rows})
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
