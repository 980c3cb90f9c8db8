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

    python -m benchmarks.layers rank_multiple               # d 512/768/1024, 2048 + 8192 tokens
    python -m benchmarks.layers rank_multiple --quick       # d 768, 2048 tokens, fewer ranks
    python -m benchmarks.layers rank_multiple --json rank_multiple.json --runs 40
    python -m benchmarks.layers rank_multiple --dtype bfloat16 --multiples 8 16 32

``--dtype bfloat16`` stores the factors in bf16 and multiplies bf16 operands with float32
accumulation (:func:`lowrank_jax.nn.bf16_forward`), the form a CPU with bf16 matrix units
(AMX tiles of 16 rows x 32 bf16) or a GPU's tensor cores run.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

import lowrank_jax as lj
from benchmarks import _harness as H
from lowrank_jax.compress.svd_method import round_up

RANKS = [20, 22, 26, 28, 30, 36, 40, 44, 52, 58, 62]
QUICK_RANKS = [22, 26, 30, 40, 58]
MULTIPLES = (8, 16)


def bench(d: int, n_tokens: int, r: int, *, runs: int, warmup: int, seed: int = 0,
          multiples=MULTIPLES, dtype: str = "float32") -> dict:
    """One row: rank ``r`` against its round-ups, timed in one loop."""
    from lowrank_jax.nn import bf16_forward, cast_weights

    ranks = sorted({r, *(round_up(r, k, d) for k in multiples)})
    kx, *kl = jax.random.split(jax.random.key(seed + r), 1 + len(ranks))
    x = jax.random.normal(kx, (n_tokens, d), jnp.float32)
    leaves = {q: lj.init_lowrank(k, d, d, q) for k, q in zip(kl, ranks, strict=True)}
    if dtype == "bfloat16":
        leaves = {q: cast_weights(lf) for q, lf in leaves.items()}
        fn = jax.jit(bf16_forward(lambda leaf, x: lj.linear(leaf, x), cast=False))
    else:
        fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    m = H.measure({q: (lambda lf=lf: fn(lf, x)) for q, lf in leaves.items()}, runs=runs,
                  warmup=warmup)
    med = {q: m.timings.median(str(q)) for q in ranks}
    row = {"d": d, "tokens": n_tokens, "rank": r, "ms": 1e3 * med[r], "other_load": m.load}
    for k in multiples:
        q = round_up(r, k, d)
        row[f"rank_{k}"] = q
        row[f"ms_{k}"] = 1e3 * med[q]
        row[f"speedup_{k}"] = med[r] / med[q]
        row[f"flops_{k}"] = q / r
    return row


def summary(rows: list[dict], multiples=MULTIPLES) -> dict:
    """Per multiple: how often rounding up was faster, and the median speed-up."""
    out = {}
    for k in multiples:
        rounded = [row for row in rows if row[f"rank_{k}"] != row["rank"]]
        faster = [row for row in rounded if row[f"speedup_{k}"] > 1.0]
        out[k] = {"rounded": len(rounded), "faster": len(faster),
                  "median_speedup": (statistics.median(row[f"speedup_{k}"] for row in rounded)
                                     if rounded else None),
                  "faster_ranks": sorted({row["rank"] for row in faster})}
    return out


def table(multiples=MULTIPLES) -> H.Table:
    """The printed table for these multiples."""
    return H.Table(
        H.Col("d", "d", width=5), H.Col("tokens", "tokens"), H.Col("rank", "rank"),
        H.Col("ms", "ms", ".3f", 8),
        *(c for k in multiples for c in (
            H.Col(f"| r{k}", f"rank_{k}", width=5), H.Col("ms", f"ms_{k}", ".3f", 8),
            H.Col("speed-up", f"speedup_{k}", ".2f"), H.Col("FLOPs", f"flops_{k}", ".2f"))),
        H.Col("| load", "other_load", "%"))


TABLE = table()


def main(argv=None) -> dict:
    p = H.parser(__doc__, quick="d 768, 2048 tokens, 5 ranks, 10 runs")
    p.add_argument("--d", type=int, nargs="+", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--ranks", type=int, nargs="+", default=None)
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--multiples", type=int, nargs="+", default=list(MULTIPLES))
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    multiples = tuple(args.multiples)
    tab = table(multiples)
    d_list = args.d or ([768] if args.quick else [512, 768, 1024])
    tokens = args.tokens or ([2048] if args.quick else [2048, 8192])
    ranks = args.ranks or (QUICK_RANKS if args.quick else RANKS)
    runs = args.runs or (10 if args.quick else 30)
    run = H.Run(__name__, argv, runs=runs, multiples=list(multiples), dtype=args.dtype)
    print(f"# {run.describe()}; median of {runs} interleaved runs; speed-up = time(rank) / "
          "time(rounded rank), FLOPs = rounded / rank; other load = CPU share used by other "
          "processes meanwhile")
    print(tab.header())
    rows = []
    for d in d_list:
        for n in tokens:
            for r in ranks:
                if r >= d:
                    continue
                rows.append(bench(d, n, r, runs=runs, warmup=3, multiples=multiples,
                                  dtype=args.dtype))
                print(tab.line(rows[-1]), flush=True)
    summ = summary(rows, multiples)
    goals = {}
    for k, s in summ.items():
        med = "-" if s["median_speedup"] is None else f"{s['median_speedup']:.2f}"
        goals.update(H.goal(
            f"LowRank leaf{'' if args.dtype == 'float32' else ' (' + args.dtype + ')'}, rank "
            f"rounded up to a multiple of {k} (compress rank_multiple={k}): median speed-up "
            "over the ranks it changes", s["median_speedup"],
            measured=f"median {med}; faster in {s['faster']}/{s['rounded']} rounded rows, at "
                     f"ranks {s['faster_ranks']}", faster=f"{s['faster']}/{s['rounded']}"))
    return run.finish(args.json, rows=rows, goals=goals,
                      summary={str(k): v for k, v in summ.items()})


if __name__ == "__main__":
    H.run_as_main(__spec__)
