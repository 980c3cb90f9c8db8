"""Compressed Chronos-Bolt forwards against dense, with the products that read one input fused
or not, in float32 and under ``bf16_forward``.

The question (a compressed model should be faster than its dense parent in proportion to its
FLOPs): a small Chronos-Bolt (d_model 256, 8 heads of 32, d_ff 1024, 4 + 4 layers, context 512
= 32 patches + ``[REG]``, 16 series), randomly initialised, with

* ``dense``: the model as initialised;
* ``svd``: every attention weight (q, k, v, o of the three attention kinds) given the spectrum
  ``s_1 exp(-j / tau)``, ``tau = min(d_in, d_out) / 8`` (a stand-in for trained weights, as in
  ``benchmarks/models/forward.py``), then ``compress(eps=0.1)``; the dense model gets the same
  shaped weights, so all models share them;
* ``svd+mlp``: the same plus every MLP's hidden units cut to ``--mlp-keep`` (0.3) of ``d_ff``
  (physically narrower ``wi`` and ``wo``, the units of largest ``||wi[:, h]|| ||wo[h, :]||``);
* ``floor``: every attention weight at rank 1 and every MLP cut to one hidden unit: nearly no
  weight FLOPs left, so its time is what compression cannot remove (norms, softmax, attention
  scores, casts, the patch embeddings), the fixed part of every model's time.

Each model runs under the execution settings ``fuse_products=False`` (``unfused``: q, k and v
as three products) and ``fuse_products=True`` (``fused``: one product for the first factors of
weights that read the same input, :func:`lowrank_jax.nn.execution.shared_input`), in float32
and through :func:`lowrank_jax.nn.bf16_forward` (weights cast once). All contenders run in one
interleaved loop; ratios are of medians of that loop (wall clock, and this process's CPU
time), with the quartiles of the per-round ratios, and of the fastest calls (``best``: the
least disturbed on a busy machine). FLOPs: counted (each weight leaf's multiply-adds at the
rows it sees, :func:`lowrank_jax.compress.frontier.measure.model_flops`; attention scores
excluded) on every backend, and XLA's ``cost_analysis`` of each compiled forward on CPU (which
counts the dots; XLA's GPU count leaves out cuBLAS calls, so it is not used there). Outputs
are checked against the unfused twin of each model.

Usage::

    python -m benchmarks.models matrix_units              # 16 series, 20 runs
    python -m benchmarks.models matrix_units --quick      # 2 layers each side, 5 runs
    python -m benchmarks.models matrix_units --json mu.json --runs 30 --series 32
    python -m benchmarks.models matrix_units --matmul-precision highest   # full float32 on GPU
"""

from __future__ import annotations

from benchmarks import _harness as H


def shape_spectra(params, tau_div: float = 8.0):
    """Every attention weight ``W`` (Dense) replaced by ``U diag(s_1 exp(-j / tau)) V^T``."""
    import numpy as np

    from lowrank_jax.compress import ATTENTION_QKVO, select
    from lowrank_jax.leaves import Dense, bias_of, get_path, materialize_host, replace_paths

    new = {}
    for sel in select(params, ATTENTION_QKVO):
        node = get_path(params, sel.path)
        w = materialize_host(node)
        u, s, vt = np.linalg.svd(w, full_matrices=False)
        tau = min(w.shape) / tau_div
        s2 = s[0] * np.exp(-np.arange(s.size) / tau)
        new[sel.path] = Dense(w=np.asarray((u * s2) @ vt, np.float32), b=bias_of(node))
    return replace_paths(params, new)


def prune_mlps(params, keep: float):
    """Every ``.../mlp`` block's hidden units cut to ``round(keep * d_ff)``."""
    import numpy as np

    from lowrank_jax.leaves import (
        get_path,
        keep_inputs,
        keep_outputs,
        materialize_host,
        named_leaves,
        replace_paths,
    )

    new = {}
    for path, node in named_leaves(params):
        if not path.endswith("/mlp/wi"):
            continue
        base = path[: -len("/wi")]
        wo = get_path(params, base + "/wo")
        score = (np.linalg.norm(materialize_host(node), axis=0)
                 * np.linalg.norm(materialize_host(wo), axis=1))
        k = max(1, round(keep * score.size))
        idx = np.sort(np.argsort(-score, kind="stable")[:k])
        new[base + "/wi"] = keep_outputs(node, idx)
        new[base + "/wo"] = keep_inputs(wo, idx)
    return replace_paths(params, new)


TABLE = H.Table(
    H.Col("model", "model", width=8), H.Col("dtype", "dtype", width=5),
    H.Col("FLOPs", "flop_ratio", ".2f"), H.Col("XLA", "flop_ratio_xla", ".2f"),
    H.Col("unfused ms", "ms_unfused", ".2f", 10), H.Col("fused ms", "ms_fused", ".2f", 9),
    H.Col("fused/unfused", "fused_over_unfused", ".3f", 13),
    H.Col("q25-q75", "fused_spread", width=11),
    H.Col("cpu", "fused_over_unfused_cpu", ".3f"), H.Col("best", "fused_over_unfused_min", ".3f"),
    H.Col("| time/dense unf.", "ratio_unfused", ".3f", 16),
    H.Col("cpu", "ratio_unfused_cpu", ".3f"), H.Col("best", "ratio_unfused_min", ".3f"),
    H.Col("| time/dense fused", "ratio_fused", ".3f", 17),
    H.Col("best", "ratio_fused_min", ".3f"),
    H.Col("max rel err", "rel_err", ".1e", 11))


def _best(t, num: str, den: str) -> float:
    """Fastest call of ``num`` over fastest of ``den`` (the least disturbed on a busy machine)."""
    return min(t.seconds(num)) / min(t.seconds(den))


def main(argv=None) -> dict:
    p = H.parser(__doc__, quick="2 + 2 layers, 8 series, 5 runs")
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--series", type=int, default=None)
    p.add_argument("--eps", type=float, default=0.1)
    p.add_argument("--mlp-keep", type=float, default=0.3)
    p.add_argument("--no-bf16", action="store_true", help="float32 contenders only")
    p.add_argument("--matmul-precision", choices=("default", "high", "highest"), default=None,
                   help="execution setting matmul_precision for every contender (default: "
                        "the backend's; on a GPU 'highest' is full float32 instead of TF32)")
    args = p.parse_args(argv)
    runs = args.runs or (5 if args.quick else 20)
    series = args.series or (8 if args.quick else 16)
    layers = 2 if args.quick else 4

    import jax
    import numpy as np

    from lowrank_jax import execution
    from lowrank_jax.compress import compress
    from lowrank_jax.models import chronos_bolt as cb
    from lowrank_jax.models import t5
    from lowrank_jax.nn import bf16_forward, cast_weights

    run = H.Run(__name__, argv, runs=runs, series=series, layers=layers, eps=args.eps,
                mlp_keep=args.mlp_keep, matmul_precision=args.matmul_precision)
    prec = args.matmul_precision
    t5c = t5.T5Config(vocab_size=2, d_model=256, d_kv=32, num_heads=8, d_ff=1024,
                      num_layers=layers, num_decoder_layers=layers, feed_forward_proj="relu")
    cfg = cb.ChronosBoltConfig(t5=t5c, context_length=512, use_reg_token=True)
    dense = shape_spectra(cb.init(jax.random.key(0), cfg))
    svd, _ = compress(dense, eps=args.eps)
    floor, _ = compress(dense, rank=1, keep_dense_if_larger=False)
    models = {"dense": dense, "svd": svd, "svd+mlp": prune_mlps(svd, args.mlp_keep),
              "floor": prune_mlps(floor, 1e-9)}
    ctx = np.random.default_rng(0).normal(size=(series, 512)).astype(np.float32)

    def forward(p, x):
        return cb.forecast(p, x, cfg)

    f32 = jax.jit(forward)
    b16 = jax.jit(bf16_forward(forward, cast=False))
    dtypes = {"f32": (f32, lambda p: p)} if args.no_bf16 else {
        "f32": (f32, lambda p: p), "bf16": (b16, cast_weights)}

    from lowrank_jax.compress.frontier.measure import model_flops

    counted = {m: model_flops(cfg, p, {"context": ctx}) for m, p in models.items()}
    on_cpu = jax.default_backend() == "cpu"
    calls, check, flops = {}, {}, {}
    for dt, (fn, cast) in dtypes.items():
        for m, params in models.items():
            pp = cast(params)
            for fuse in ("unfused", "fused"):
                name = f"{m} {dt} {fuse}"

                def call(fn=fn, pp=pp, on=fuse == "fused"):
                    with execution.settings(fuse_products=on, matmul_precision=prec):
                        return fn(pp, ctx)

                calls[name] = call
                if fuse == "fused":
                    check[name] = f"{m} {dt} unfused"
                if on_cpu:
                    with execution.settings(fuse_products=fuse == "fused",
                                            matmul_precision=prec):
                        cost = fn.lower(pp, ctx).compile().cost_analysis()
                    cost = cost[0] if isinstance(cost, list) else cost
                    flops[name] = float(cost.get("flops", 0.0))
    print(f"# {run.describe()}; {series} series x 512 context; median of {runs} interleaved "
          "runs; ratios of medians (wall; cpu: this process's CPU time), q25-q75 of the "
          "per-round ratios, best: fastest over fastest", flush=True)
    meas = H.measure(calls, runs=runs, warmup=2, check=check, flops=flops)
    t = meas.timings
    print(TABLE.header())
    rows = []
    for dt in dtypes:
        for m in models:
            u, f = f"{m} {dt} unfused", f"{m} {dt} fused"
            r = t.ratio(f, u)
            row = {"model": m, "dtype": dt, "flop_ratio": counted[m] / counted["dense"],
                   "flop_ratio_xla": (flops[u] / flops[f"dense {dt} unfused"] if on_cpu
                                      else None),
                   "ms_unfused": meas.ms(u), "ms_fused": meas.ms(f),
                   "fused_over_unfused": r.value,
                   "fused_spread": f"{r.paired.q25:.3f}-{r.paired.q75:.3f}",
                   "fused_over_unfused_cpu": t.ratio(f, u, cpu=True).value,
                   "fused_over_unfused_min": _best(t, f, u),
                   "ratio_unfused": meas.ratio(u, f"dense {dt} unfused"),
                   "ratio_unfused_cpu": t.ratio(u, f"dense {dt} unfused", cpu=True).value,
                   "ratio_unfused_min": _best(t, u, f"dense {dt} unfused"),
                   "ratio_fused": meas.ratio(f, f"dense {dt} fused"),
                   "ratio_fused_min": _best(t, f, f"dense {dt} fused"),
                   "ratio_unfused_spread": [t.ratio(u, f"dense {dt} unfused").paired.q25,
                                            t.ratio(u, f"dense {dt} unfused").paired.q75],
                   "rel_err": meas.rel_error.get(f, 0.0), "other_load": meas.load}
            rows.append(row)
            print(TABLE.line(row), flush=True)
    goals = {}
    for row in rows:
        if row["model"] in ("dense", "floor"):
            continue
        goals.update(H.goal(
            f"{row['model']} {row['dtype']}: time ratio to dense over its FLOP ratio "
            "(unfused, fused)",
            [row["ratio_unfused"] / row["flop_ratio"], row["ratio_fused"] / row["flop_ratio"]],
            measured=f"{row['ratio_unfused'] / row['flop_ratio']:.2f} unfused, "
                     f"{row['ratio_fused'] / row['flop_ratio']:.2f} fused (FLOP ratio "
                     f"{row['flop_ratio']:.2f})"))
    for dt in dtypes:
        fl = next(r for r in rows if r["model"] == "floor" and r["dtype"] == dt)
        goals.update(H.goal(f"floor {dt}: time of a model with nearly no weight FLOPs over "
                            "dense (fixed share)", fl["ratio_unfused"],
                            measured=f"{fl['ratio_unfused']:.2f} (best {fl['ratio_unfused_min']:.2f}"
                                     f", cpu {fl['ratio_unfused_cpu']:.2f}) at FLOP ratio "
                                     f"{fl['flop_ratio']:.2f}"))
    for row in rows:
        goals.update(H.goal(f"{row['model']} {row['dtype']}: fused / unfused time",
                            row["fused_over_unfused"],
                            measured=f"{row['fused_over_unfused']:.3f} ({row['fused_spread']})"))
    return run.finish(args.json, rows=rows, goals=goals)


if __name__ == "__main__":
    H.run_as_main(__spec__)
