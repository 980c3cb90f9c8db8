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

Goal: the packed leaf's ``linear`` at least as fast as the float
masked-binary leaf with its mask precomputed, i.e. ``packed / frozen <= 1``. The ``masked``
column is the training form, which recomputes the top-k mask of its scores on every call.
``leaf MB`` is the bytes of each leaf's arrays (what a model holds in memory), not its
accounting in bits. The outputs of the packed and frozen leaves are compared too (they are
equal bit for bit on CPU).

``--sparse`` adds what sparse execution would give (a binary leaf's time against its FLOP
count, which is its non-zero multiply-adds): the frozen leaf's matrix as a
``jax.experimental.sparse.BCSR`` (compressed sparse rows of ``W^T``, product ``(W^T @ x^T)^T``;
BCOO was 10x slower in a trial) at the run's keep fraction and at 0.25, 0.1, 0.03 and 0.01, timed
against the dense leaf and the frozen leaf at the same keep in one interleaved loop, with its
outputs checked against the frozen leaf's. Where PyTorch is installed, the same loop also times
its compressed-sparse-row product (``torch.sparse_csr`` of ``W^T`` times ``x^T``) against its
own dense ``x @ W`` (``torch.set_num_threads(cpu_count)``, ``OMP_WAIT_POLICY=PASSIVE`` set
before torch is imported), to tell a missing kernel in JAX from what the shapes allow.

Usage::

    python -m benchmarks.layers binary            # d = 512, 768, 1024; 512, 2048, 8192 tokens
    python -m benchmarks.layers binary --quick    # d = 512, 1024; 512 and 2048 tokens; 5 runs
    python -m benchmarks.layers binary --json out.json --d 1024 --tokens 8192 --runs 20
    python -m benchmarks.layers binary --sparse --d 1024 --tokens 512 2048   # sparse execution too
"""

from __future__ import annotations

import os
import statistics

# before torch is imported (--sparse): its OpenMP workers otherwise spin after each product and
# take the cores from the next call in the interleaved loop
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import lowrank_jax as lj  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from lowrank_jax import leaves as L  # noqa: E402

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
    m = H.measure({k: (lambda lf=leaves[k]: fn(lf, x)) for k in KINDS}, runs=runs,
                  warmup=warmup, check={"packed": "frozen"})
    t = m.timings
    return {
        "d": d, "tokens": n_tokens, "keep": keep,
        **{f"{k}_ms": m.ms(k) for k in KINDS},
        "packed_over_frozen": t.ratio("packed", "frozen").paired.median,
        "packed_over_frozen_cpu": t.ratio("packed", "frozen", cpu=True).paired.median,
        "frozen_over_dense": t.ratio("frozen", "dense").paired.median,
        "masked_over_dense": t.ratio("masked", "dense").paired.median,
        **{f"{k}_bytes": leaf_bytes(leaves[k]) for k in KINDS},
        "packed_equals_frozen": m.max_abs_error["packed"] == 0.0, "other_load": m.load,
        "times_ms": {k: [s * 1e3 for s in t.seconds(k)] for k in KINDS},
        "cpu_ms": {k: [s * 1e3 for s in t.seconds(k, cpu=True)] for k in KINDS},
    }


SPARSE_KEEPS = (0.25, 0.1, 0.03, 0.01)  # the paper prunes 50, 75 and 90 %


def bench_sparse(d: int, n_tokens: int, keeps, *, runs: int, warmup: int,
                 seed: int = 0) -> list[dict]:
    """Rows for sparse execution: one per keep fraction, the BCSR product's time against the
    dense leaf's and the frozen leaf's (same keep), and ``time/flop`` = (sparse / dense time)
    / keep, the time per FLOP of a leaf whose FLOPs are its non-zeros."""
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
    calls = {"dense": lambda: fn(dense, x)}
    for i, (f, c) in enumerate(zip(frozen, csr, strict=True)):
        calls[f"frozen {i}"] = lambda f=f: fn(f, x)
        calls[f"sparse {i}"] = lambda c=c: sp(c, x)
    torch_calls = _torch_sparse_calls(np.asarray(x), np.asarray(lj.materialize(dense)),
                                      [np.asarray(lj.materialize(f)) for f in frozen])
    calls.update({f"torch {i}": c for i, c in enumerate(torch_calls)})
    m = H.measure(calls, runs=runs, warmup=warmup)
    load = m.load
    rows = []
    for i, (k, f, c) in enumerate(zip(keeps, frozen, csr, strict=True)):
        ref = np.asarray(fn(f, x), np.float64)
        got = np.asarray(sp(c, x), np.float64)
        scale = np.abs(np.asarray(x)) @ np.abs(np.asarray(lj.materialize(f)))
        flop_ratio = f.n_keep / (d * d)
        row = {
            "d": d, "tokens": n_tokens, "keep": k, "nnz": int(c.nse), "flop_ratio": flop_ratio,
            "dense_ms": m.ms("dense"), "frozen_ms": m.ms(f"frozen {i}"),
            "sparse_ms": m.ms(f"sparse {i}"), "sparse_over_dense": m.ratio(f"sparse {i}", "dense"),
            "time_per_flop_ratio": m.ratio(f"sparse {i}", "dense") / flop_ratio,
            "max_err_over_scale": float(np.max(np.abs(got - ref) / np.maximum(scale, 1e-30))),
            "other_load": load}
        if torch_calls:
            t_dense, t_sparse = m.ms("torch 0"), m.ms(f"torch {1 + i}")
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


TABLE = H.Table(
    H.Col("d", "d", width=5), H.Col("tokens", "tokens"), H.Col("dense ms", "dense_ms", ".3f", 9),
    H.Col("masked ms", "masked_ms", ".3f"), H.Col("frozen ms", "frozen_ms", ".3f"),
    H.Col("packed ms", "packed_ms", ".3f"), H.Col("packed/frozen", "packed_over_frozen", ".3f"),
    H.Col("(cpu)", "packed_over_frozen_cpu", ".3f", 6),
    H.Col("frozen/dense", "frozen_over_dense", ".3f"),
    H.Col("leaf MB d/m/f/p", lambda r: "/".join(f"{r[f'{k}_bytes'] / 1e6:.2f}" for k in KINDS),
          width=24),
    H.Col("load", "other_load", "%", 5),
    H.Col("", lambda r: "" if r["packed_over_frozen"] <= GOAL else "> goal"))
SPARSE_TABLE = H.Table(
    H.Col("d", "d", width=5), H.Col("tokens", "tokens"), H.Col("keep", "keep", "g", 5),
    H.Col("dense ms", "dense_ms", ".3f", 9), H.Col("frozen ms", "frozen_ms", ".3f"),
    H.Col("sparse ms", "sparse_ms", ".3f"), H.Col("sparse/dense", "sparse_over_dense", ".3f"),
    H.Col("time/flop", "time_per_flop_ratio", ".2f"), H.Col("err", "max_err_over_scale", ".1e", 8),
    H.Col("torch sparse/dense", "torch_sparse_over_dense", ".3f"),
    H.Col("torch t/f", "torch_time_per_flop_ratio", ".2f"), H.Col("load", "other_load", "%", 5))


def goals(rows: list[dict], keep: float) -> dict:
    """Packed against frozen (the goal), binary time/FLOP (FLOPs = non-zeros: the product runs
    densely, so this is ~1 / keep) and the leaves' bytes at the largest size."""
    med = statistics.median(r["packed_over_frozen"] for r in rows)
    worst = max(r["packed_over_frozen"] for r in rows)
    med_cpu = statistics.median(r["packed_over_frozen_cpu"] for r in rows)
    tpf = max(r["frozen_over_dense"] / keep for r in rows)
    big = max(rows, key=lambda r: (r["d"], r["tokens"]))
    b = {k: big[f"{k}_bytes"] for k in KINDS}
    sizes = ", ".join(f"d {r['d']}/{r['tokens']}: {r['packed_over_frozen']:.2f}" for r in rows)
    load = H.percent(max((r["other_load"] or 0) for r in rows))
    return {
        **H.goal("binary leaf (frozen) time/FLOP, FLOPs = non-zeros", tpf, target="<= 1.15",
                 holds=tpf <= 1.15,
                 measured=f"worst {tpf:.2f} (the product runs densely: ~1/keep)"),
        **H.goal("PackedBinary linear time / FrozenBinary", med, target=f"median <= {GOAL:g}",
                 holds=med <= GOAL, worst=worst, cpu_time_median=med_cpu,
                 measured=f"median {med:.3f}, worst {worst:.3f} ({sizes}); in CPU time median "
                          f"{med_cpu:.3f}; load up to {load}"),
        **H.goal(f"binary leaf memory, d = {big['d']} (bytes of the arrays)", b, d=big["d"],
                 measured=f"dense {b['dense'] / 1e6:.2f} MB, masked {b['masked'] / 1e6:.2f}, "
                          f"frozen {b['frozen'] / 1e6:.2f}, packed {b['packed'] / 1e6:.3f} "
                          f"({b['dense'] / b['packed']:.1f}x smaller than dense)"),
    }


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="d 512 1024, 512 and 2048 tokens, 5 runs")
    p.add_argument("--d", type=int, nargs="+", default=None, help="widths (default 512 768 1024)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="token counts (default 512 2048 8192)")
    p.add_argument("--keep", type=float, default=0.5, help="keep fraction of the binary leaves")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 15; quick 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sparse", action="store_true",
                   help="also time sparse (BCSR) execution at the keep fraction and at "
                        f"{', '.join(map(str, SPARSE_KEEPS))}")
    args = p.parse_args(argv)
    dims = args.d or ([512, 1024] if args.quick else [512, 768, 1024])
    tokens = args.tokens or ([512, 2048] if args.quick else [512, 2048, 8192])
    runs = args.runs if args.runs is not None else (5 if args.quick else 15)
    warmup = 1 if args.quick else args.warmup
    run = H.Run(__name__, argv, runs=runs, warmup=warmup, keep=args.keep,
                packed_kernel=L.packed_kernels.use_kernel())
    print(f"# {run.describe()}; keep {args.keep}, median of {runs} interleaved runs; "
          f"packed/frozen = median of per-run ratios (goal <= {GOAL:g}), (cpu) the same for "
          f"this process's CPU time; Pallas packed kernel in use: "
          f"{run.setup['packed_kernel']}; leaf MB = bytes of the leaf's arrays "
          "(dense/masked/frozen/packed); load = CPU share of other processes")
    print(TABLE.header())
    rows = []
    for d in dims:
        for n in tokens:
            rows.append(bench(d, n, keep=args.keep, runs=runs, warmup=warmup))
            print(TABLE.line(rows[-1]), flush=True)
    print(f"# packed == frozen outputs in {sum(r['packed_equals_frozen'] for r in rows)}/"
          f"{len(rows)} rows")
    result_goals = goals(rows, args.keep)
    extra = {}
    if args.sparse:
        keeps = sorted({args.keep, *SPARSE_KEEPS}, reverse=True)
        print("# sparse execution (jax.experimental.sparse BCSR of W^T): time against the dense "
              "leaf; time/flop = (sparse / dense time) / (non-zeros / d^2); err = max |sparse - "
              "frozen| / (|x| @ |W|)")
        print(SPARSE_TABLE.header())
        sparse_rows = []
        for d in dims:
            for n in tokens:
                for r in bench_sparse(d, n, keeps, runs=runs, warmup=warmup):
                    print(SPARSE_TABLE.line(r), flush=True)
                    sparse_rows.append(r)
        extra["sparse_rows"] = sparse_rows
        best = min(sparse_rows, key=lambda r: r["time_per_flop_ratio"])
        result_goals.update(H.goal(
            "binary leaf time/FLOP executed as a sparse matrix (BCSR), best keep",
            best["time_per_flop_ratio"], best_keep=best["keep"],
            measured=f"{best['time_per_flop_ratio']:.2f} at keep {best['keep']:g}"))
    return run.finish(args.json, rows=rows, goals=result_goals, **extra)


if __name__ == "__main__":
    H.run_as_main(__spec__)
