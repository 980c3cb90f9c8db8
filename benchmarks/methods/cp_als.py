"""Seconds per CP-ALS iteration: ``lowrank_jax.decomp.cp_als`` against tensorly's ``parafac``.

Both decompose the same tensor from the same initial factors (``lowrank_jax.decomp.init_cp``
with ``init='svd'``, handed to tensorly as ``init=(weights, factors)`` in float64) for the same
number of iterations (``tol=0``), and both compute the relative error every iteration.
lowrank_jax runs in float32 (jit-compiled; the compile is excluded by a warm-up call with the
same shapes), tensorly with its NumPy backend in float64. Runs are interleaved (ours, then
tensorly's, ``--runs`` times) and the medians reported. Goal: faster than tensorly with the same
final relative error to 1e-4.

The tensors are query-key tensors of "Vision Transformer with Irregular Attention" with the bias
row and column (``augmented_joint``): ``385 x 385 x 6`` (DeiT-S: d = 384, 6 heads) at rank 96
and ``769 x 769 x 12`` (DeiT-B) at rank 168. No pretrained DeiT can be downloaded here, so the
attention weights are random (every slice then has rank 64, as a trained one does).

Usage::

    python -m benchmarks.methods cp_als --json cp_als.json        # both sizes
    python -m benchmarks.methods cp_als --quick                   # DeiT-S size, few iterations
    python -m benchmarks.methods cp_als --blas-threads 1 --json cp_als_1thread.json
"""

from __future__ import annotations

import os
import sys

# OpenBLAS (NumPy, hence tensorly) reads its thread count when NumPy is imported: set it first.
# On a busy machine its default threads can make the skinny products of ALS many times slower
# (measured here: 6 x 148225 @ 148225 x 96 takes 0.08 s with 1 thread, 0.9 s with 2, 5-7 s with
# the default under load), so the benchmark is run both ways. This works when NumPy is not
# imported yet (python -m benchmarks.methods cp_als imports nothing else first).
if "--blas-threads" in sys.argv:
    _n = sys.argv[sys.argv.index("--blas-threads") + 1]
    for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_v] = _n

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import lowrank_jax as lj  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from lowrank_jax import nn  # noqa: E402
from lowrank_jax.decomp import cp_als, cp_to_tensor, init_cp  # noqa: E402
from lowrank_jax.leaves import Dense, QueryKey, augmented_joint  # noqa: E402

CASES = {"deit-s": (384, 6, 96), "deit-b": (768, 12, 168)}
# default (iterations, runs) per case: tensorly takes seconds per iteration here
DEFAULTS = {"deit-s": (10, 3), "deit-b": (4, 2)}


def qk_tensor(d_model: int, heads: int, seed: int = 0) -> np.ndarray:
    """The augmented query-key tensor of a random biased attention block, float64."""
    cfg = nn.AttentionConfig(use_bias=True)
    p = nn.init_attention(jax.random.PRNGKey(seed), cfg, d_model=d_model, num_heads=heads)
    rng = np.random.default_rng(seed)

    def with_bias(leaf):
        return Dense(w=leaf.w, b=jnp.asarray(0.1 * rng.normal(size=leaf.d_out), jnp.float32))

    qk = QueryKey(q=with_bias(p["qk"].q), k=with_bias(p["qk"].k), widths=p["qk"].widths)
    return augmented_joint(qk)


def run_case(name: str, iters: int, runs: int) -> dict:
    import tensorly as tl
    from tensorly.decomposition import parafac

    d, heads, rank = CASES[name]
    t64 = qk_tensor(d, heads)
    t32 = jnp.asarray(t64, jnp.float32)
    _, init = init_cp(t32, rank)  # SVD initialisation (the third mode is padded randomly)
    init64 = [np.asarray(f, np.float64) for f in init]

    def ours():
        res = cp_als(t32, rank, init=(None, init), n_iter_max=iters, tol=0.0)
        jax.block_until_ready(res.errors)
        return res

    def theirs():
        return parafac(t64, rank, init=(np.ones(rank), [f.copy() for f in init64]),
                       n_iter_max=iters, tol=0, return_errors=True)

    out = {}

    def keep(name, fn):
        def call():
            out[name] = fn()
        return call

    ours()  # compile
    t = H.time_calls({"ours": keep("ours", ours), "theirs": keep("theirs", theirs)}, runs=runs,
                     warmup=0)
    res, ((_, ref_factors), ref_errors) = out["ours"], out["theirs"]
    err_ours = float(res.errors[iters - 1])
    err_theirs = float(ref_errors[-1])
    # the reported errors, checked against the factors (NumPy, float64)
    rec = np.asarray(cp_to_tensor(None, [np.asarray(f, np.float64) for f in res.factors]))
    err_check = float(np.linalg.norm(t64 - rec) / np.linalg.norm(t64))
    err_ref_check = float(np.linalg.norm(t64 - tl.cp_to_tensor((np.ones(rank), ref_factors))) /
                          np.linalg.norm(t64))
    so, st = t.median("ours") / iters, t.median("theirs") / iters
    return {
        "case": name, "shape": list(t64.shape), "rank": rank, "iterations": iters, "runs": runs,
        "seconds_per_iter_lowrank_jax": so, "seconds_per_iter_tensorly": st,
        "speedup": st / so,
        "final_error_lowrank_jax": err_ours, "final_error_tensorly": err_theirs,
        "error_difference": abs(err_ours - err_theirs),
        "final_error_lowrank_jax_recomputed": err_check,
        "final_error_tensorly_recomputed": err_ref_check,
        "dtype_lowrank_jax": "float32", "dtype_tensorly": "float64",
    }


TABLE = H.Table(
    H.Col("case", "case", width=8), H.Col("shape", lambda r: "x".join(map(str, r["shape"])),
                                          width=14),
    H.Col("R", "rank", width=4), H.Col("ours s/it", "seconds_per_iter_lowrank_jax", ".4f"),
    H.Col("tensorly s/it", "seconds_per_iter_tensorly", ".4f", 14),
    H.Col("speedup", "speedup", ".2f", 8), H.Col("err ours", "final_error_lowrank_jax", ".6f"),
    H.Col("err tensorly", "final_error_tensorly", ".6f"),
    H.Col("|diff|", "error_difference", ".2e", 9))


def main(argv=None) -> dict:
    ap = H.parser(__doc__, quick="DeiT-S size only, 5 iterations, 1 run")
    ap.add_argument("--iters", type=int, help="ALS iterations per run (default: 10 for "
                                               "deit-s, 4 for deit-b)")
    ap.add_argument("--runs", type=int, help="interleaved runs, medians reported (default: 3 "
                                              "for deit-s, 2 for deit-b)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--blas-threads", type=int, help="OpenBLAS/OpenMP threads for NumPy "
                                                     "(tensorly); default: the library's own")
    args = ap.parse_args(argv)
    if args.quick:
        plan = [("deit-s", 5, 1)]
    else:
        plan = [(c, args.iters or DEFAULTS[c][0], args.runs or DEFAULTS[c][1]) for c in args.cases]
    run = H.Run(__name__, argv, lowrank_jax=lj.__version__,
                blas_threads=os.environ.get("OPENBLAS_NUM_THREADS", "default"))
    rows = [run_case(c, iters, runs) for c, iters, runs in plan]
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    goals = {}
    for r in rows:
        goals.update(H.goal(
            f"CP-ALS {r['case']} ({'x'.join(map(str, r['shape']))}, rank {r['rank']}): "
            "seconds per iteration, tensorly / lowrank_jax", r["speedup"],
            target="> 1, final errors within 1e-4",
            holds=r["speedup"] > 1 and r["error_difference"] <= 1e-4,
            measured=f"{r['speedup']:.2f}x, final errors {r['final_error_lowrank_jax']:.6f} vs "
                     f"{r['final_error_tensorly']:.6f}"))
    return run.finish(args.json, rows=rows, goals=goals)


if __name__ == "__main__":
    H.run_as_main(__spec__)
