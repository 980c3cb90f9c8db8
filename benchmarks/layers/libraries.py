"""Do other libraries run a ``LowRank`` leaf's skinny products faster than XLA:CPU?

A ``LowRank`` leaf's time ratio to the dense ``[d, d]``
leaf should be within 1.15x of its FLOP ratio. At FLOP ratio 0.1 (rank ``0.05 d``) XLA:CPU misses
it (``linear.py``): the first product ``x @ u`` has only ``r`` output columns and the second
``t @ v`` an inner dimension of ``r``, shapes a matrix-multiply kernel runs below its square
rate. This script asks whether that is XLA's kernel or the shapes: it times the same two
products, and the dense product they replace, in JAX (``jax.jit`` of
:func:`lowrank_jax.linear`), in PyTorch (``(x @ u) @ v``: oneDNN / MKL on x86) and in NumPy
(its BLAS, OpenBLAS in the PyPI wheels), all in one interleaved loop on the same float32
arrays, so machine noise hits every library alike.

The same for ``HeadLowRank`` leaves with irregular per-head ranks (12 heads of 64, d 768; the
rank sets of ``head_lowrank.py``): JAX's ``linear`` against PyTorch and NumPy running the same
execution, one product on the true ranks then a lift per head.

Per library, ``time/flop = (lowrank ms / dense ms) / flop ratio`` against that library's own
dense product (1.0: the factorized product runs at the dense rate per multiply-add); ``jax /
best`` is JAX's low-rank time over the fastest other library's. Single calls, as a user would
make them (JAX also pays dispatch, PyTorch and NumPy allocate their outputs).

Threads: PyTorch ``set_num_threads(cpu_count)``, NumPy's BLAS and XLA with their defaults
(all cores). Set here before the libraries are imported: ``OMP_WAIT_POLICY=PASSIVE``
(PyTorch's OpenMP workers) and ``OPENBLAS_THREAD_TIMEOUT=4`` (OpenBLAS's workers, 2^4 cycles):
otherwise a library's workers spin after each product and take the cores from the next call in
the loop. Without the second, OpenBLAS's spinning made JAX's calls 1.4x slower on the 2-core
test machine (d 768, 2048 tokens).

Usage::

    python -m benchmarks.layers libraries --json libraries.json   # d 1024/768/512 x 512/2048/8192
    python -m benchmarks.layers libraries --quick                 # d 768, 2048 tokens, 5 runs
    python -m benchmarks.layers libraries --no-head               # LowRank rows only
"""

from __future__ import annotations

import os
import statistics

# Before torch and numpy are imported: their worker threads otherwise spin after each product
# and take the cores from the next call in the interleaved loop (docstring).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import lowrank_jax as lj  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from benchmarks.layers.head_lowrank import RANK_SETS  # noqa: E402

LIBRARIES = ("jax", "torch", "numpy")


def blas_name() -> str:
    """The BLAS NumPy was built against (``numpy.show_config``), or ``"unknown"``."""
    try:
        cfg = np.show_config(mode="dicts")
        return str(cfg["Build Dependencies"]["blas"]["name"])
    except Exception:  # noqa: BLE001 (older NumPy: no mode="dicts")
        return "unknown"


def gaussian(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A float32 ``[rows, cols]`` matrix of normal entries with variance ``1 / rows``."""
    return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(rows)).astype(np.float32)


def check_and_time(calls: dict, runs: int, warmup: int, what: str) -> tuple[dict, float | None]:
    """Check each library's outputs against NumPy's (relative error < 1e-4), then time every
    call in one interleaved loop. ``calls``: ``{library: [zero-argument call, ...]}``, the same
    products in the same order for every library. Returns ``({library: [median ms, ...]},
    other load)``."""
    k = len(calls["numpy"])
    flat = {f"{lib} {i}": c for lib in LIBRARIES for i, c in enumerate(calls[lib])}
    m = H.measure(flat, runs=runs, warmup=warmup,
                  check={f"{lib} {i}": f"numpy {i}" for lib in ("jax", "torch") for i in range(k)})
    for name, err in m.rel_error.items():
        if not err < 1e-4:
            raise AssertionError(f"{what}: {name.split()[0]} differs from numpy on product "
                                 f"{name.split()[1]}: {err:.2e}")
    return {lib: [m.ms(f"{lib} {i}") for i in range(k)] for lib in LIBRARIES}, m.load


def bench(d: int, n_tokens: int, ratios: list[float], *, runs: int, warmup: int,
          seed: int = 0) -> list[dict]:
    """Rows for one ``(d, n_tokens)``: one per target FLOP ratio, every library's figures."""
    import torch

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, d), dtype=np.float32)  # [tokens, d]
    w = gaussian(rng, d, d)
    ranks = [max(1, round(q * d / 2)) for q in ratios]
    factors = [(gaussian(rng, d, r), gaussian(rng, r, d)) for r in ranks]

    lin = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    xj = jnp.asarray(x)
    jleaves = [lj.Dense(w=jnp.asarray(w))] + [lj.LowRank(u=jnp.asarray(u), v=jnp.asarray(v))
                                             for u, v in factors]
    xt = torch.from_numpy(x)
    wt = torch.from_numpy(w)
    tfactors = [(torch.from_numpy(u), torch.from_numpy(v)) for u, v in factors]

    calls = {"jax": [lambda lf=lf: jax.block_until_ready(lin(lf, xj)) for lf in jleaves],
             "torch": [lambda: xt @ wt] + [lambda u=u, v=v: (xt @ u) @ v for u, v in tfactors],
             "numpy": [lambda: x @ w] + [lambda u=u, v=v: (x @ u) @ v for u, v in factors]}
    ms, load = check_and_time(calls, runs, warmup, f"d {d}, {n_tokens} tokens")
    dense_flops = lj.flops(jleaves[0], n_tokens)
    rows = []
    for i, (q, r) in enumerate(zip(ratios, ranks, strict=True)):
        flop_ratio = lj.flops(jleaves[1 + i], n_tokens) / dense_flops
        row = {"d": d, "tokens": n_tokens, "target_ratio": q, "rank": r, "flop_ratio": flop_ratio,
               "other_load": load}
        for lib in LIBRARIES:
            row[f"{lib}_dense_ms"] = ms[lib][0]
            row[f"{lib}_lowrank_ms"] = ms[lib][1 + i]
            row[f"{lib}_time_per_flop_ratio"] = ms[lib][1 + i] / ms[lib][0] / flop_ratio
            # the low-rank product's rate against this library's own dense rate
        others = [lib for lib in LIBRARIES if lib != "jax"]
        best = min(others, key=lambda lib: ms[lib][1 + i])
        row["best_other"] = best
        row["jax_over_best_lowrank"] = ms["jax"][1 + i] / ms[best][1 + i]
        row["jax_over_best_dense"] = ms["jax"][0] / min(ms[lib][0] for lib in others)
        row["best_time_per_flop_ratio"] = min(row[f"{lib}_time_per_flop_ratio"]
                                              for lib in LIBRARIES)
        rows.append(row)
    return rows


def bench_head(name: str, ranks: tuple, n_tokens: int, *, runs: int, warmup: int,
               d: int = 768, d_head: int = 64, seed: int = 0) -> dict:
    """One row for a ``HeadLowRank`` leaf with per-head ``ranks`` (``d`` inputs, heads of
    ``d_head``): JAX's ``linear`` of the leaf, and in PyTorch and NumPy the same execution
    (one ``x @ [u_1 .. u_h]`` product, then each head's lift on its own columns,
    concatenated), each against its library's dense ``[d, h * d_head]`` product."""
    import torch

    rng = np.random.default_rng(seed)
    h, rmax = len(ranks), max(ranks)
    x = rng.standard_normal((n_tokens, d), dtype=np.float32)
    w = gaussian(rng, d, h * d_head)
    us = [gaussian(rng, d, r) for r in ranks]
    vs = [gaussian(rng, r, d_head) for r in ranks]
    u_all = np.concatenate(us, axis=1)
    offs = np.cumsum([0, *ranks])
    u_pad = np.zeros((d, h, rmax), np.float32)
    v_pad = np.zeros((h, rmax, d_head), np.float32)
    for i, r in enumerate(ranks):
        u_pad[:, i, :r], v_pad[i, :r] = us[i], vs[i]
    leaf = lj.HeadLowRank(jnp.asarray(u_pad), jnp.asarray(v_pad), ranks=tuple(ranks))
    dense = lj.Dense(w=jnp.asarray(w))
    lin = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    xj = jnp.asarray(x)
    xt, wt, ut = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(u_all)
    vts = [torch.from_numpy(v) for v in vs]

    def torch_heads():
        t = xt @ ut
        return torch.cat([t[:, offs[i]:offs[i + 1]] @ vts[i] for i in range(h)], 1)

    def numpy_heads():
        t = x @ u_all
        return np.concatenate([t[:, offs[i]:offs[i + 1]] @ vs[i] for i in range(h)], 1)

    calls = {"jax": [lambda: jax.block_until_ready(lin(dense, xj)),
                     lambda: jax.block_until_ready(lin(leaf, xj))],
             "torch": [lambda: xt @ wt, torch_heads],
             "numpy": [lambda: x @ w, numpy_heads]}
    ms, load = check_and_time(calls, runs, warmup, f"HeadLowRank {name}, {n_tokens} tokens")
    flop_ratio = lj.flops(leaf, n_tokens) / lj.flops(dense, n_tokens)
    row = {"ranks_name": name, "ranks": list(ranks), "tokens": n_tokens,
           "flop_ratio": flop_ratio, "other_load": load}
    for lib in LIBRARIES:
        d_ms, h_ms = ms[lib]
        row[f"{lib}_dense_ms"], row[f"{lib}_ms"] = d_ms, h_ms
        row[f"{lib}_time_per_flop_ratio"] = h_ms / d_ms / flop_ratio
    row["jax_over_best"] = row["jax_ms"] / min(row["torch_ms"], row["numpy_ms"])
    return row


#: HeadLowRank rank sets (12 heads of 64, d 768): the irregular ones of head_lowrank.py (its
#: near-uniform set has a FLOP ratio above 1: not a compression).
HEAD_RANKS = {k: v for k, v in RANK_SETS.items() if k.startswith("spread")}


TABLE = H.Table(
    H.Col("d", "d", width=4), H.Col("tokens", "tokens"), H.Col("rank", "rank"),
    H.Col("flop ratio", "flop_ratio", ".4f"),
    *(c for lib in LIBRARIES for c in (H.Col(f"{lib} ms", f"{lib}_lowrank_ms", ".3f", 9),
                                       H.Col(f"{lib} t/f", f"{lib}_time_per_flop_ratio", ".2f", 9))),
    H.Col("jax/best lr", "jax_over_best_lowrank", ".2f"),
    H.Col("jax/best dense", "jax_over_best_dense", ".2f"), H.Col("load", "other_load", "%", 5))
HEAD_TABLE = H.Table(
    H.Col("ranks", "ranks_name", width=14), H.Col("tokens", "tokens"),
    H.Col("flop ratio", "flop_ratio", ".3f"),
    *(H.Col(f"{lib} t/f", f"{lib}_time_per_flop_ratio", ".2f", 9) for lib in LIBRARIES),
    H.Col("jax/best", "jax_over_best", ".2f"))


def summary(rows: list[dict], target: float) -> dict:
    """Per library, the time/FLOP range at the FLOP ratio nearest ``target``, and JAX's time
    over the fastest other library's (median and range over the sizes)."""
    near = [r for r in rows if abs(r["target_ratio"] - target) < 1e-9]
    out = {"target_ratio": target, "rows": len(near)}
    for lib in LIBRARIES:
        v = [r[f"{lib}_time_per_flop_ratio"] for r in near]
        out[lib] = [min(v), max(v)] if v else None
    v = [r["jax_over_best_lowrank"] for r in near]
    out["jax_over_best_lowrank"] = ({"median": statistics.median(v), "range": [min(v), max(v)]}
                                    if v else None)
    return out


def goals(rows: list[dict], summaries: list[dict], head_rows: list[dict]) -> dict:
    """Reported: each library's time/FLOP at the lowest FLOP ratio, JAX against the fastest
    other library, and the same for the HeadLowRank rows."""
    low = min(summaries, key=lambda s: s["target_ratio"])
    libs = ", ".join(f"{lib} {low[lib][0]:.2f}-{low[lib][1]:.2f}" for lib in LIBRARIES)
    none = all(low[lib][0] > 1.15 for lib in ("torch", "numpy"))
    ratio = sorted(r["jax_over_best_lowrank"] for r in rows)
    med = ratio[len(ratio) // 2]
    out = {
        **H.goal(f"LowRank products at FLOP ratio ~{low['target_ratio']:g} in other libraries: "
                 "time/FLOP against each library's dense product", low["torch"][0],
                 measured=f"{libs} over {low['rows']} sizes"
                          + (" (none meets 1.15 in any library)" if none else "")),
        **H.goal("LowRank leaf: JAX time / fastest of PyTorch and NumPy, same products", med,
                 measured=f"median {med:.2f} ({ratio[0]:.2f}-{ratio[-1]:.2f}) over "
                          f"{len(ratio)} rows"),
    }
    if head_rows:
        rng = {lib: (min(r[f"{lib}_time_per_flop_ratio"] for r in head_rows),
                     max(r[f"{lib}_time_per_flop_ratio"] for r in head_rows))
               for lib in LIBRARIES}
        out.update(H.goal(
            "HeadLowRank, irregular ranks, in other libraries: time/FLOP against each library's "
            "dense product", rng["torch"][0],
            measured=", ".join(f"{lib} {lo:.2f}-{hi:.2f}" for lib, (lo, hi) in rng.items())
                     + f" over {len(head_rows)} rows"))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="one size, 5 runs: a smoke test")
    p.add_argument("--d", type=int, nargs="+", default=None,
                   help="model widths (default 1024 768 512; quick 768)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="token counts (default 512 2048 8192; quick 2048)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                   help="target FLOP ratios of the low-rank leaves to the dense one")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 30; quick 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--head-tokens", type=int, nargs="+", default=None,
                   help="token counts of the HeadLowRank rows (default 2048 8192; quick 2048)")
    p.add_argument("--no-head", action="store_true", help="skip the HeadLowRank rows")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    runs = args.runs if args.runs is not None else (5 if args.quick else 30)
    warmup = 1 if args.quick else args.warmup
    ds = args.d or ([768] if args.quick else [1024, 768, 512])
    tokens = args.tokens or ([2048] if args.quick else [512, 2048, 8192])
    head_tokens = args.head_tokens or ([2048] if args.quick else [2048, 8192])
    run = H.Run(__name__, argv, torch=torch.__version__, numpy=np.__version__,
                openblas_thread_timeout=os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                numpy_blas=blas_name(), torch_threads=torch.get_num_threads(), runs=runs,
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
    s = run.setup
    print(f"# {run.describe()}; torch {s['torch']} ({s['torch_threads']} threads), numpy "
          f"{s['numpy']} ({s['numpy_blas']}); median of {runs} interleaved runs; t/f = (lowrank "
          "ms / dense ms) / flop ratio within each library; jax/best = JAX's time over the "
          "fastest of torch and numpy")
    print(TABLE.header())
    rows = []
    for d in ds:
        for n in tokens:
            for row in bench(d, n, args.ratios, runs=runs, warmup=warmup):
                print(TABLE.line(row), flush=True)
                rows.append(row)
    head_rows = []
    if not args.no_head:
        print("# HeadLowRank, irregular ranks (d 768, 12 heads of 64): the first product on the "
              "true ranks, then each head's lift; t/f against each library's dense product")
        print(HEAD_TABLE.header())
        for name, ranks in HEAD_RANKS.items():
            for n in head_tokens:
                head_rows.append(bench_head(name, ranks, n, runs=runs, warmup=warmup))
                print(HEAD_TABLE.line(head_rows[-1]), flush=True)
    summaries = [summary(rows, q) for q in args.ratios]
    for sm in summaries:
        jb = sm["jax_over_best_lowrank"]
        print(f"# FLOP ratio ~{sm['target_ratio']}: time/flop "
              + ", ".join(f"{lib} {sm[lib][0]:.2f}-{sm[lib][1]:.2f}" for lib in LIBRARIES)
              + f"; jax / fastest other {jb['median']:.2f} ({jb['range'][0]:.2f}-"
              f"{jb['range'][1]:.2f})")
    return run.finish(args.json, rows=rows, goals=goals(rows, summaries, head_rows),
                      summary=summaries, head_rows=head_rows)


if __name__ == "__main__":
    H.run_as_main(__spec__)
