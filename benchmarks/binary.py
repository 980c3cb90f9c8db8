"""Binary leaves at inference: ``MaskedBinary`` (training form), ``FrozenBinary`` (mask and gain
precomputed, ``int8`` signs), ``PackedBinary`` (sign and mask bits in ``uint32`` words) and the
``Dense`` leaf they replace, timed through ``lowrank_jax.linear`` in one interleaved loop.

For every model width ``d`` and token count, the four ``[d, d]`` leaves (keep fraction 0.5 for
the binary ones; the packed and frozen leaves are the masked one's ``freeze()`` and
``PackedBinary.from_leaf``) are called as ``jax.jit(lambda leaf, x: linear(leaf, x))`` with the
leaf as an argument, after warm-up, each call ended by ``block_until_ready``; the order within
a run is reversed on every other run. Each figure is a median over runs; the packed / frozen
ratio is the median of the per-run ratios (both timed within the same run), in wall-clock time
and in this process's CPU time (less sensitive to other processes on a shared machine).

Goal (issue 15, goal 5): the packed leaf's ``linear`` at least as fast as the float
masked-binary leaf with its mask precomputed, i.e. ``packed / frozen <= 1``. The ``masked``
column is the training form, which recomputes the top-k mask of its scores on every call.
``leaf MB`` is the bytes of each leaf's arrays (what a model holds in memory), not its
accounting in bits. The outputs of the packed and frozen leaves are compared too (they are
equal bit for bit on CPU).

``--sparse`` adds what sparse execution would give (issue 15, goal 1: a binary leaf's time
against its FLOP count, which is its non-zero multiply-adds): the frozen leaf's matrix as a
``jax.experimental.sparse.BCSR`` (compressed sparse rows of ``W^T``, product ``(W^T @ x^T)^T``;
BCOO was 10x slower in a trial) at the run's keep fraction and at 0.25, 0.1, 0.03 and 0.01, timed
against the dense leaf and the frozen leaf at the same keep in one interleaved loop, with its
outputs checked against the frozen leaf's. Where PyTorch is installed, the same loop also times
its compressed-sparse-row product (``torch.sparse_csr`` of ``W^T`` times ``x^T``) against its
own dense ``x @ W`` (``torch.set_num_threads(cpu_count)``, ``OMP_WAIT_POLICY=PASSIVE`` set
before torch is imported), to tell a missing kernel in JAX from what the shapes allow.

Usage::

    python benchmarks/binary.py                 # d = 512, 768, 1024; 512, 2048, 8192 tokens
    python benchmarks/binary.py --quick         # d = 512, 1024; 512 and 2048 tokens; 5 runs
    python benchmarks/binary.py --json out.json --d 1024 --tokens 8192 --runs 20
    python benchmarks/binary.py --sparse --d 1024 --tokens 512 2048   # sparse execution too
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

# before torch is imported (--sparse): its OpenMP workers otherwise spin after each product and
# take the cores from the next call in the interleaved loop
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _machine import (  # noqa: E402 (benchmarks/_machine.py)
    cpu_snapshot,
    other_load,
    time_interleaved,
    write_json,
)

try:
    import lowrank_jax as lj
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lowrank_jax as lj
from lowrank_jax import leaves as L

GOAL = 1.0  # packed / frozen time
KINDS = ("dense", "masked", "frozen", "packed")


def leaf_bytes(leaf) -> int:
    """Bytes of the arrays a leaf holds (device memory of its parameters)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(leaf))


def make_leaves(d: int, keep: float, seed: int) -> dict:
    kd, km = jax.random.split(jax.random.key(seed))
    masked = L.init_masked_binary(km, d, d, keep)
    return {"dense": lj.init_dense(kd, d, d), "masked": masked, "frozen": masked.freeze(),
            "packed": L.PackedBinary.from_leaf(masked)}


def bench(d: int, n_tokens: int, *, keep: float, runs: int, warmup: int, seed: int = 0) -> dict:
    """One row: medians of the four leaves at ``[n_tokens, d] @ [d, d]``."""
    leaves = make_leaves(d, keep, seed)
    x = jax.random.normal(jax.random.key(seed + 1), (n_tokens, d), jnp.float32)
    fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    same = bool(np.array_equal(np.asarray(fn(leaves["packed"], x)),
                               np.asarray(fn(leaves["frozen"], x))))
    calls = [lambda lf=leaves[k]: jax.block_until_ready(fn(lf, x)) for k in KINDS]
    before = cpu_snapshot()
    times, cpu_times = time_interleaved(calls, runs, warmup, cpu=True)
    load = other_load(before, cpu_snapshot())
    t = dict(zip(KINDS, times, strict=True))
    c = dict(zip(KINDS, cpu_times, strict=True))
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    ratio = statistics.median(p / f for p, f in zip(t["packed"], t["frozen"], strict=True))
    cpu_ratio = statistics.median(p / f for p, f in zip(c["packed"], c["frozen"], strict=True))
    return {
        "d": d, "tokens": n_tokens, "keep": keep,
        **{f"{k}_ms": med[k] for k in KINDS},
        "packed_over_frozen": ratio, "packed_over_frozen_cpu": cpu_ratio,
        "frozen_over_dense": statistics.median(f / g for f, g in zip(t["frozen"], t["dense"],
                                                                     strict=True)),
        "masked_over_dense": statistics.median(m / g for m, g in zip(t["masked"], t["dense"],
                                                                    strict=True)),
        **{f"{k}_bytes": leaf_bytes(leaves[k]) for k in KINDS},
        "packed_equals_frozen": same, "other_load": load,
        "times_ms": {k: [s * 1e3 for s in v] for k, v in t.items()},
        "cpu_ms": {k: [s * 1e3 for s in v] for k, v in c.items()},
    }


SPARSE_KEEPS = (0.25, 0.1, 0.03, 0.01)  # the paper prunes 50, 75 and 90 %


def bench_sparse(d: int, n_tokens: int, keeps, *, runs: int, warmup: int,
                 seed: int = 0) -> list[dict]:
    """Rows for sparse execution: one per keep fraction, the BCSR product's time against the
    dense leaf's and the frozen leaf's (same keep), and ``time/flop`` = (sparse / dense time)
    / keep, the figure goal 1 asks of a leaf whose FLOPs are its non-zeros."""
    from jax.experimental import sparse

    x = jax.random.normal(jax.random.key(seed + 1), (n_tokens, d), jnp.float32)
    dense = lj.init_dense(jax.random.key(seed), d, d)
    fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    sp = jax.jit(lambda wt, x: (wt @ x.T).T)  # BCSR is implemented as the left operand only
    frozen, csr = [], []
    for i, k in enumerate(keeps):
        f = L.init_masked_binary(jax.random.key(seed + 10 + i), d, d, k).freeze()
        frozen.append(f)
        csr.append(sparse.BCSR.fromdense(lj.materialize(f).T))  # [d_out, d_in]
    calls = [lambda: jax.block_until_ready(fn(dense, x))]
    for f, c in zip(frozen, csr, strict=True):
        calls += [lambda f=f: jax.block_until_ready(fn(f, x)),
                  lambda c=c: jax.block_until_ready(sp(c, x))]
    torch_calls = _torch_sparse_calls(np.asarray(x), np.asarray(lj.materialize(dense)),
                                      [np.asarray(lj.materialize(f)) for f in frozen])
    n_jax = len(calls)
    calls += torch_calls
    before = cpu_snapshot()
    med = [statistics.median(t) * 1e3 for t in time_interleaved(calls, runs, warmup)]
    load = other_load(before, cpu_snapshot())
    rows = []
    for i, (k, f, c) in enumerate(zip(keeps, frozen, csr, strict=True)):
        ref = np.asarray(fn(f, x), np.float64)
        got = np.asarray(sp(c, x), np.float64)
        scale = np.abs(np.asarray(x)) @ np.abs(np.asarray(lj.materialize(f)))
        flop_ratio = f.n_keep / (d * d)
        row = {
            "d": d, "tokens": n_tokens, "keep": k, "nnz": int(c.nse), "flop_ratio": flop_ratio,
            "dense_ms": med[0], "frozen_ms": med[1 + 2 * i], "sparse_ms": med[2 + 2 * i],
            "sparse_over_dense": med[2 + 2 * i] / med[0],
            "time_per_flop_ratio": med[2 + 2 * i] / med[0] / flop_ratio,
            "max_err_over_scale": float(np.max(np.abs(got - ref) / np.maximum(scale, 1e-30))),
            "other_load": load}
        if torch_calls:
            t_dense, t_sparse = med[n_jax], med[n_jax + 1 + i]
            got_t = np.asarray(torch_calls[1 + i](), np.float64)
            row.update({"torch_dense_ms": t_dense, "torch_sparse_ms": t_sparse,
                        "torch_sparse_over_dense": t_sparse / t_dense,
                        "torch_time_per_flop_ratio": t_sparse / t_dense / flop_ratio,
                        "torch_max_err_over_scale": float(np.max(
                            np.abs(got_t - ref) / np.maximum(scale, 1e-30)))})
        rows.append(row)
    return rows


def _torch_sparse_calls(x: np.ndarray, w_dense: np.ndarray, ws: list) -> list:
    """PyTorch's dense ``x @ W`` and, per matrix of ``ws``, its CSR product ``(W^T x^T)^T``, as
    zero-argument calls returning NumPy arrays (``[]`` where torch is not installed)."""
    try:
        import torch
    except ImportError:
        return []
    import warnings

    torch.set_num_threads(os.cpu_count() or 1)
    xt, wd = torch.from_numpy(np.array(x)), torch.from_numpy(np.array(w_dense))  # writable
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        csr = [torch.from_numpy(np.ascontiguousarray(w.T)).to_sparse_csr() for w in ws]
    calls = [lambda: (xt @ wd).numpy()]
    calls += [lambda c=c: (c @ xt.T).T.numpy() for c in csr]
    return calls


HEADER = (f"{'d':>5} {'tokens':>6} {'dense ms':>9} {'masked ms':>9} {'frozen ms':>9} "
          f"{'packed ms':>9} {'packed/frozen':>13} {'(cpu)':>6} {'frozen/dense':>12} "
          f"{'leaf MB d/m/f/p':>24} "
          f"{'load':>5}")


def format_row(r: dict) -> str:
    mb = "/".join(f"{r[f'{k}_bytes'] / 1e6:.2f}" for k in KINDS)
    load = "n/a" if r["other_load"] is None else f"{100 * r['other_load']:.0f}%"
    flag = "" if r["packed_over_frozen"] <= GOAL else "  > goal"
    return (f"{r['d']:>5} {r['tokens']:>6} {r['dense_ms']:>9.3f} {r['masked_ms']:>9.3f} "
            f"{r['frozen_ms']:>9.3f} {r['packed_ms']:>9.3f} {r['packed_over_frozen']:>13.3f} "
            f"{r['packed_over_frozen_cpu']:>6.3f} {r['frozen_over_dense']:>12.3f} {mb:>24} "
            f"{load:>5}{flag}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, nargs="+", default=None, help="widths (default 512 768 1024)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="token counts (default 512 2048 8192)")
    p.add_argument("--keep", type=float, default=0.5, help="keep fraction of the binary leaves")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 15; quick 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="d 512 1024, 512 and 2048 tokens, 5 runs")
    p.add_argument("--sparse", action="store_true",
                   help="also time sparse (BCSR) execution at the keep fraction and at "
                        f"{', '.join(map(str, SPARSE_KEEPS))}")
    p.add_argument("--json", metavar="PATH", help="write the rows (and the setup) as JSON")
    args = p.parse_args(argv)
    dims = args.d or ([512, 1024] if args.quick else [512, 768, 1024])
    tokens = args.tokens or ([512, 2048] if args.quick else [512, 2048, 8192])
    runs = args.runs if args.runs is not None else (5 if args.quick else 15)
    warmup = 1 if args.quick else args.warmup

    setup = {"jax": jax.__version__, "backend": jax.default_backend(),
             "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
             "runs": runs, "warmup": warmup, "keep": args.keep,
             "packed_kernel": L.packed_kernels.use_kernel(),
             "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(f"# jax {setup['jax']} on {setup['backend']} ({setup['cpu_count']} CPUs), keep "
          f"{args.keep}, median of {runs} interleaved runs; packed/frozen = median of per-run "
          f"ratios (goal <= {GOAL:g}), (cpu) the same for this process's CPU time; Pallas packed "
          f"kernel in use: {setup['packed_kernel']}; "
          "leaf MB = bytes of the leaf's arrays (dense/masked/frozen/packed); load = CPU share "
          "of other processes")
    print(HEADER)
    rows = []
    for d in dims:
        for n in tokens:
            row = bench(d, n, keep=args.keep, runs=runs, warmup=warmup)
            print(format_row(row), flush=True)
            rows.append(row)
    worst = max(r["packed_over_frozen"] for r in rows)
    met = sum(r["packed_over_frozen"] <= GOAL for r in rows)
    med_cpu = statistics.median(r["packed_over_frozen_cpu"] for r in rows)
    print(f"# packed/frozen in CPU time: median {med_cpu:.3f}, worst "
          f"{max(r['packed_over_frozen_cpu'] for r in rows):.3f}")
    print(f"# packed/frozen: worst {worst:.3f}, median "
          f"{statistics.median(r['packed_over_frozen'] for r in rows):.3f} (goal <= {GOAL:g}): "
          f"{met}/{len(rows)} rows meet it; packed == frozen outputs in "
          f"{sum(r['packed_equals_frozen'] for r in rows)}/{len(rows)} rows")
    med = statistics.median(r["packed_over_frozen"] for r in rows)
    # Goal 1 for binary leaves: time ratio to dense over the FLOP ratio the leaf reports (its
    # non-zero multiply-adds, keep * dense); the product runs densely, so this is ~1 / keep.
    tpf = [r["frozen_over_dense"] / args.keep for r in rows]
    big = max(rows, key=lambda r: (r["d"], r["tokens"]))
    goals = {
        "packed_vs_frozen": {"value": med, "worst": worst, "goal": f"median <= {GOAL:g}",
                             "holds": med <= GOAL, "cpu_time_median": med_cpu},
        "binary_time_per_flop": {"value": max(tpf), "goal": "<= 1.15", "holds": max(tpf) <= 1.15},
        "leaf_bytes": {"value": {k: big[f"{k}_bytes"] for k in KINDS}, "d": big["d"],
                       "goal": "reported", "holds": None},
    }
    result = {"setup": setup, "goals": goals, "rows": rows}
    if args.sparse:
        keeps = sorted({args.keep, *SPARSE_KEEPS}, reverse=True)
        print("# sparse execution (jax.experimental.sparse BCSR of W^T): time against the dense "
              "leaf; time/flop = (sparse / dense time) / (non-zeros / d^2); err = max |sparse - "
              "frozen| / (|x| @ |W|)")
        print(f"{'d':>5} {'tokens':>6} {'keep':>5} {'dense ms':>9} {'frozen ms':>9} "
              f"{'sparse ms':>9} {'sparse/dense':>12} {'time/flop':>9} {'err':>8} "
              f"{'torch sparse/dense':>18} {'torch t/f':>9} {'load':>5}")
        sparse_rows = []
        for d in dims:
            for n in tokens:
                for r in bench_sparse(d, n, keeps, runs=runs, warmup=warmup):
                    load = "n/a" if r["other_load"] is None else f"{100 * r['other_load']:.0f}%"
                    print(f"{r['d']:>5} {r['tokens']:>6} {r['keep']:>5g} {r['dense_ms']:>9.3f} "
                          f"{r['frozen_ms']:>9.3f} {r['sparse_ms']:>9.3f} "
                          f"{r['sparse_over_dense']:>12.3f} {r['time_per_flop_ratio']:>9.2f} "
                          f"{r['max_err_over_scale']:>8.1e} "
                          f"{r.get('torch_sparse_over_dense', float('nan')):>18.3f} "
                          f"{r.get('torch_time_per_flop_ratio', float('nan')):>9.2f} "
                          f"{load:>5}", flush=True)
                    sparse_rows.append(r)
        result["sparse_rows"] = sparse_rows
        goals["binary_time_per_flop_sparse"] = {
            "value": min(r["time_per_flop_ratio"] for r in sparse_rows), "goal": "reported",
            "holds": None, "best_keep": min(sparse_rows,
                                            key=lambda r: r["time_per_flop_ratio"])["keep"]}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
