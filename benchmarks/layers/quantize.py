"""Quantized leaves at inference: ``Int8`` (per output channel) and ``Int4`` (groups of 128 and
32 along ``d_in``) against the float32 ``Dense`` leaf, timed through ``lowrank_jax.linear`` in
one interleaved loop; with ``--quality``, the output error of round-to-nearest and GPTQ on a
random model of Chronos-Bolt-base's size.

Speed. For every width ``d`` and token count, the four ``[d, d]`` leaves (the integer ones
round-to-nearest quantizations of the dense leaf's weight) are called as
``jax.jit(lambda leaf, x: linear(leaf, x))`` with the leaf as an argument, after warm-up, each
call ended by ``block_until_ready``, the order reversed on every other run. The integer leaves
are weight-only: each call unpacks and dequantizes the weight to float32 inside the compiled
program, then multiplies in float32, so on a CPU they cost the float product plus the
dequantization; what they save is memory (``leaf MB``, the bytes of the arrays). Ratios are the
medians of the per-run ratios (both calls timed in the same run) with their quartiles
(``q25-q75``). Outputs are checked against NumPy (dequantize, then multiply, in float64):
``err`` is the largest ``|y - y_ref| / (|x| @ |W_q|)``.

Quality (``--quality``): a random model with Chronos-Bolt-base's sizes (``d_model`` 768,
``d_ff`` 3072, 12 + 12 layers, 12 heads of 64; weights ``N(0, 1/d_in)``, the queries' further
divided by ``sqrt(d_kv)`` as T5's initialization does (Hugging Face's ``T5PreTrainedModel.
_init_weights``), so that attention logits have unit scale; ``--no-query-scale`` leaves them
``N(0, 1/d_in)``, logits of standard deviation about 8), its attention and MLP
projections quantized by a plan, run on real series windows (the family's ``sample_inputs``);
the error is ``max |y_q - y| / max |y|`` of the normalized quantile outputs (the output scale),
and its RMS counterpart. Variants: RTN and GPTQ int8, RTN int4 g128, GPTQ int4 g128 (calibration through
the model's forward on other windows), and low rank (rank 32) plus an int4 g128 residual (the
same leaves cost a bit more: the rank-32 float32 factors). ``--quality-layers N`` shrinks the
stacks to ``N`` layers each (a quicker run, the same widths).

Usage::

    python -m benchmarks.layers quantize                 # d = 768, 1024, 2048; 64, 512, 2048 tokens
    python -m benchmarks.layers quantize --quick         # d = 768, 2048; 512 tokens; 5 runs
    python -m benchmarks.layers quantize --quick --json out.json
    python -m benchmarks.layers quantize --quick --quality --quality-layers 2
    python -m benchmarks.layers quantize --quick --demo    # the demo model's WQL, seeds 0 1 2

Demo (``--demo``): the dense Chronos-Bolt of ``lowrank-jax demo`` (d_model 64), pretrained
once per seed and cached like ``lowrank-jax frontier demo`` does, quantized (RTN int8, RTN and
GPTQ int4 with groups of 32, and low rank 4 with int8 factors plus an int4 g64 residual, about
the size of int4 g32), scored by WQL and MASE on the built-in series' held-out test windows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import lowrank_jax as lj
from benchmarks import _harness as H
from lowrank_jax import leaves as L

KINDS = ("dense", "int8", "int4_g128", "int4_g32")


def leaf_bytes(leaf) -> int:
    """Bytes of the arrays a leaf holds."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(leaf))


def make_leaves(d: int, seed: int) -> dict:
    w = np.random.default_rng(seed).standard_normal((d, d)).astype(np.float32) / np.sqrt(d)
    return {"dense": lj.Dense(jnp.asarray(w)), "int8": L.Int8.quantize(w),
            "int4_g128": L.Int4.quantize(w, group=128), "int4_g32": L.Int4.quantize(w, group=32)}


def bench(d: int, n_tokens: int, *, runs: int, warmup: int, seed: int = 0) -> dict:
    """One row: medians and ratios of the four leaves at ``[n_tokens, d] @ [d, d]``."""
    leaves = make_leaves(d, seed)
    x = jax.random.normal(jax.random.key(seed + 1), (n_tokens, d), jnp.float32)
    fn = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    m = H.measure({k: (lambda lf=leaves[k]: fn(lf, x)) for k in KINDS}, runs=runs, warmup=warmup)
    t = m.timings
    xs = np.asarray(x, np.float64)
    row = {"d": d, "tokens": n_tokens, **{f"{k}_ms": m.ms(k) for k in KINDS},
           **{f"{k}_bytes": leaf_bytes(leaves[k]) for k in KINDS},
           **{f"{k}_bits_per_weight": leaves[k].storage_bits() / d ** 2 for k in KINDS},
           "other_load": m.load,
           "times_ms": {k: [s * 1e3 for s in t.seconds(k)] for k in KINDS}}
    for k in KINDS[1:]:
        r = t.ratio(k, "dense").paired
        row[f"{k}_over_dense"] = r.median
        row[f"{k}_over_dense_q25"], row[f"{k}_over_dense_q75"] = r.q25, r.q75
        wq = L.materialize_host(leaves[k])
        ref = xs @ wq
        got = np.asarray(fn(leaves[k], x), np.float64)
        row[f"{k}_err"] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(xs) @ np.abs(wq),
                                                                     1e-30)))
    return row


TABLE = H.Table(
    H.Col("d", "d", width=5), H.Col("tokens", "tokens"), H.Col("dense ms", "dense_ms", ".3f", 9),
    H.Col("int8 ms", "int8_ms", ".3f"), H.Col("i4g128 ms", "int4_g128_ms", ".3f"),
    H.Col("i4g32 ms", "int4_g32_ms", ".3f"),
    *[H.Col(f"{k}/dense (q25-q75)",
            lambda r, k=k: f"{r[f'{k}_over_dense']:.2f} ({r[f'{k}_over_dense_q25']:.2f}-"
                           f"{r[f'{k}_over_dense_q75']:.2f})", width=22) for k in KINDS[1:]],
    H.Col("leaf MB d/8/4/4", lambda r: "/".join(f"{r[f'{k}_bytes'] / 1e6:.2f}" for k in KINDS),
          width=22),
    H.Col("err", lambda r: f"{max(r[f'{k}_err'] for k in KINDS[1:]):.1e}", width=8),
    H.Col("load", "other_load", "%", 5))


def goals(rows: list[dict]) -> dict:
    out = {}
    for k in KINDS[1:]:
        vals = [r[f"{k}_over_dense"] for r in rows]
        out.update(H.goal(f"{k} linear time / float32 Dense (weight-only, CPU)",
                          float(np.median(vals)),
                          measured=f"median {np.median(vals):.2f} over {len(rows)} rows, "
                                   f"range {min(vals):.2f}-{max(vals):.2f}"))
    big = max(rows, key=lambda r: r["d"])
    for k in KINDS[1:]:
        out.update(H.goal(f"{k} bits per weight (storage_bits / d^2), d = {big['d']}",
                          big[f"{k}_bits_per_weight"]))
    return out


# -- quality ---------------------------------------------------------------------------------

def bolt_base(layers: int):
    from lowrank_jax.models import ChronosBoltConfig, T5Config

    t5 = T5Config(vocab_size=2, d_model=768, d_kv=64, d_ff=3072, num_layers=layers,
                  num_decoder_layers=layers, num_heads=12)
    return ChronosBoltConfig(t5=t5, context_length=512, prediction_length=64,
                             input_patch_size=16, input_patch_stride=16, use_reg_token=True)


def quality(layers: int, samples: int, query_scale: bool = True) -> list[dict]:
    """Rows of the ``--quality`` run (module docstring)."""
    import time

    from lowrank_jax.compress import Step, apply_plan
    from lowrank_jax.models import chronos_bolt

    cfg = bolt_base(layers)
    shapes = jax.eval_shape(lambda: chronos_bolt.init(jax.random.PRNGKey(0), cfg))
    g = np.random.default_rng(0)

    def fill(path, s):
        name = L.path_str(path)
        if "scale" in str(path[-1]) or len(s.shape) == 1:
            return jnp.ones(s.shape, s.dtype) if "scale" in str(path[-1]) else jnp.zeros(
                s.shape, s.dtype)
        std = 1 / np.sqrt(np.prod(s.shape[:-1]))
        if query_scale and "/qk/q/" in name + "/":  # T5's initialization: unit-scale logits
            std /= np.sqrt(cfg.t5.d_kv)
        return jnp.asarray(g.standard_normal(s.shape) * std, s.dtype)

    params = jax.tree_util.tree_map_with_path(fill, shapes)
    inputs = chronos_bolt.sample_inputs(cfg, np.random.default_rng(123), 8)
    run = jax.jit(lambda p: chronos_bolt.apply(p, inputs, cfg)["quantile_preds"])
    y = np.asarray(run(params), np.float64)
    rules = [r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wo)$"]
    variants = [("rtn int8", {"bits": 8}),
                ("gptq int8", {"bits": 8, "algorithm": "gptq", "samples": samples}),
                ("rtn int4 g128", {"bits": 4, "group": 128}),
                ("gptq int4 g128", {"bits": 4, "group": 128, "algorithm": "gptq",
                                    "samples": samples}),
                ("lowrank 32 + int4 g128", {"bits": 4, "group": 128, "rank": 32})]
    rows = []
    dense_bits = lj.storage_bits(params)
    for name, s in variants:
        t0 = time.perf_counter()
        new, report = apply_plan(params, Step("quantize", rules, s), config=cfg)
        secs = time.perf_counter() - t0
        yq = np.asarray(run(new), np.float64)
        rows.append({
            "variant": name, "layers": layers, "settings": s, "seconds": secs,
            "max_err_over_scale": float(np.max(np.abs(yq - y)) / np.max(np.abs(y))),
            "rms_err_over_rms": float(np.sqrt(np.mean((yq - y) ** 2) / np.mean(y ** 2))),
            "size_ratio": lj.storage_bits(new) / dense_bits,
            "weights_bits_per_weight": sum(r.bits_after for r in report.rows) / sum(
                r.params_before for r in report.rows)})
        print(QTABLE.line(rows[-1]), flush=True)
    return rows


QTABLE = H.Table(
    H.Col("variant", "variant", width=24), H.Col("layers", "layers", width=6),
    H.Col("max err/scale", "max_err_over_scale", ".2e", 13),
    H.Col("rms err/rms", "rms_err_over_rms", ".2e", 11),
    H.Col("bits/weight", "weights_bits_per_weight", ".3f", 11),
    H.Col("model size", "size_ratio", ".3f", 10), H.Col("s", "seconds", ".0f", 5))


DEMO_VARIANTS = (
    ("rtn int8", {"bits": 8}),
    ("rtn int4 g32", {"bits": 4, "group": 32}),
    ("gptq int4 g32", {"bits": 4, "group": 32, "algorithm": "gptq", "data": "builtin"}),
    ("lowrank 4 (int8) + int4 g64", {"bits": 4, "group": 64, "rank": 4, "factor_bits": 8}),
    ("gptq lowrank 4 (int8) + int4 g64", {"bits": 4, "group": 64, "rank": 4, "factor_bits": 8,
                                          "algorithm": "gptq", "data": "builtin"}),
)


def demo(seeds: list[int], samples: int) -> list[dict]:
    """Rows of the ``--demo`` run: the demo's pretrained Chronos-Bolt (``lowrank-jax demo``'s
    dense model, pretrained once per seed and cached), its attention and MLP projections
    quantized, WQL and MASE on the held-out test windows of the built-in series against the
    dense model's. GPTQ calibrates on ``samples`` windows from the first 70 % of the series
    (``data='builtin'``), apart from the test windows."""
    from lowrank_jax.compress import Step, apply_plan
    from lowrank_jax.datasets import builtin_datasets
    from lowrank_jax.recipes.frontier import demo_model
    from lowrank_jax.recipes.pretrain_demo import eval_windows, forecast_scores, make_forward
    from lowrank_jax.recipes.progress import lines
    from lowrank_jax.train import WindowConfig

    groups, _ = builtin_datasets()
    rules = [r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wo)$"]
    rows = []
    for seed in seeds:
        cfg, params, _ = demo_model(quick=False, cache=None, status=lines(None, "benchmark"),
                                    seed=seed)
        wcfg = WindowConfig(context_length=cfg.context_length, horizon=cfg.prediction_length,
                            stride=cfg.prediction_length)
        win = eval_windows(groups, wcfg)
        fwd = make_forward(cfg)
        dense = forecast_scores(fwd, params, win)["pooled"]
        for name, st in DEMO_VARIANTS:
            st = {**st, "samples": samples} if st.get("algorithm") == "gptq" else st
            new, report = apply_plan(params, Step("quantize", rules, st), config=cfg)
            sc = forecast_scores(fwd, new, win)["pooled"]
            rows.append({
                "seed": seed, "variant": name, "settings": st, "dense_wql": dense["wql"],
                "wql": sc["wql"], "wql_rel": sc["wql"] / dense["wql"] - 1,
                "mase_rel": sc["mase"] / dense["mase"] - 1, "n_windows": sc["n_windows"],
                "weights_bits_per_weight": sum(r.bits_after for r in report.rows) / sum(
                    r.params_before for r in report.rows)})
            print(DTABLE.line(rows[-1]), flush=True)
    return rows


DTABLE = H.Table(
    H.Col("seed", "seed", width=4), H.Col("variant", "variant", width=34),
    H.Col("dense WQL", "dense_wql", ".4f", 9), H.Col("WQL", "wql", ".4f", 7),
    H.Col("WQL rel", lambda r: f"{100 * r['wql_rel']:+.2f}%", width=8),
    H.Col("MASE rel", lambda r: f"{100 * r['mase_rel']:+.2f}%", width=8),
    H.Col("bits/weight", "weights_bits_per_weight", ".3f", 11))


def demo_goals(rows: list[dict]) -> dict:
    out = {}
    by = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r["wql_rel"])

    def summary(v):
        vals = by[v]
        return (float(np.mean(vals)),
                f"mean {100 * np.mean(vals):+.2f}% over {len(vals)} seeds "
                f"({', '.join(f'{100 * x:+.2f}%' for x in vals)})")

    m, text = summary("rtn int8")
    out.update(H.goal("demo model WQL, RTN int8 vs dense (relative)", m, target="<= +0.5%",
                      holds=max(by["rtn int8"]) <= 0.005, measured=text))
    m, text = summary("gptq int4 g32")
    out.update(H.goal("demo model WQL, GPTQ int4 g32 vs dense (relative)", m, target="<= +2%",
                      holds=max(by["gptq int4 g32"]) <= 0.02, measured=text))
    better = [g < r for g, r in zip(by["gptq int4 g32"], by["rtn int4 g32"], strict=True)]
    out.update(H.goal("demo model WQL, GPTQ int4 g32 better than RTN int4 g32 (seeds)",
                      sum(better), target=f"{len(better)} of {len(better)}",
                      holds=all(better), measured=f"{sum(better)} of {len(better)} seeds"))
    for v in ("lowrank 4 (int8) + int4 g64", "gptq lowrank 4 (int8) + int4 g64"):
        m, text = summary(v)
        out.update(H.goal(f"demo model WQL, {v} vs dense (relative)", m, measured=text))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="d 768 and 2048, 512 tokens, 5 runs")
    p.add_argument("--d", type=int, nargs="+", default=None, help="widths (default 768 1024 2048)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="token counts (default 64 512 2048)")
    p.add_argument("--quality", action="store_true",
                   help="also the output error on a random Chronos-Bolt-base-sized model")
    p.add_argument("--quality-layers", type=int, default=12,
                   help="encoder and decoder layers of the quality model (default 12, the base's)")
    p.add_argument("--no-query-scale", action="store_true",
                   help="quality model: queries N(0, 1/d_in) like every weight (sharp attention)")
    p.add_argument("--samples", type=int, default=16, help="GPTQ calibration series (default 16)")
    p.add_argument("--demo", action="store_true",
                   help="also WQL of the demo's pretrained Chronos-Bolt, quantized (pretrains and "
                        "caches it per seed on first use)")
    p.add_argument("--demo-seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="pretraining seeds of the demo model (default 0 1 2)")
    p.add_argument("--demo-samples", type=int, default=64,
                   help="GPTQ calibration windows for the demo model (default 64)")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 15; quick 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up runs (default 2; quick 1)")
    args = p.parse_args(argv)
    dims = args.d or ([768, 2048] if args.quick else [768, 1024, 2048])
    tokens = args.tokens or ([512] if args.quick else [64, 512, 2048])
    runs = args.runs if args.runs is not None else (5 if args.quick else 15)
    warmup = 1 if args.quick else args.warmup
    run = H.Run(__name__, argv, runs=runs, warmup=warmup)
    print(f"# {run.describe()}; median of {runs} interleaved runs; ratios = median of per-run "
          "ratios to the float32 Dense leaf (quartiles in brackets); weight-only: dequantized "
          "to float32 inside the program; leaf MB = bytes of the arrays; err = max |y - y_np| / "
          "(|x| @ |W_q|); load = CPU share of other processes")
    print(TABLE.header())
    rows = []
    for d in dims:
        for n in tokens:
            rows.append(bench(d, n, runs=runs, warmup=warmup))
            print(TABLE.line(rows[-1]), flush=True)
    result_goals = goals(rows)
    extra = {}
    if args.quality:
        print(f"# quality: random Chronos-Bolt-base-sized model ({args.quality_layers} + "
              f"{args.quality_layers} layers), attention and MLP projections quantized; error "
              "of the normalized quantile outputs against the float32 model's")
        print(QTABLE.header())
        q = quality(args.quality_layers, args.samples, not args.no_query_scale)
        extra["quality_rows"] = q
        by = {r["variant"]: r for r in q}
        result_goals.update(H.goal(
            "RTN int8 output error / output scale, Chronos-Bolt-base-sized random model",
            by["rtn int8"]["max_err_over_scale"], target="<= 0.01",
            holds=by["rtn int8"]["max_err_over_scale"] <= 0.01, layers=args.quality_layers))
        result_goals.update(H.goal(
            "GPTQ int8 output error / output scale, Chronos-Bolt-base-sized random model",
            by["gptq int8"]["max_err_over_scale"], target="<= 0.01",
            holds=by["gptq int8"]["max_err_over_scale"] <= 0.01, layers=args.quality_layers))
        result_goals.update(H.goal(
            "GPTQ int4 g128 output error / RTN int4 g128's (same size)",
            by["gptq int4 g128"]["rms_err_over_rms"] / by["rtn int4 g128"]["rms_err_over_rms"],
            target="< 1", holds=by["gptq int4 g128"]["rms_err_over_rms"]
            < by["rtn int4 g128"]["rms_err_over_rms"]))
        result_goals.update(H.goal(
            "low rank 32 + int4 g128 residual output error / plain RTN int4 g128's",
            by["lowrank 32 + int4 g128"]["rms_err_over_rms"]
            / by["rtn int4 g128"]["rms_err_over_rms"],
            measured=f"{by['lowrank 32 + int4 g128']['rms_err_over_rms']:.3e} vs "
                     f"{by['rtn int4 g128']['rms_err_over_rms']:.3e} at "
                     f"{by['lowrank 32 + int4 g128']['weights_bits_per_weight']:.3f} vs "
                     f"{by['rtn int4 g128']['weights_bits_per_weight']:.3f} bits per weight"))
    if args.demo:
        print("# demo: the demo's pretrained Chronos-Bolt (d_model 64, so groups of 32), "
              "attention and MLP projections quantized; pooled WQL and MASE on the held-out "
              "test windows, relative to the dense model's")
        print(DTABLE.header())
        d = demo(args.demo_seeds, args.demo_samples)
        extra["demo_rows"] = d
        result_goals.update(demo_goals(d))
    return run.finish(args.json, rows=rows, goals=result_goals, **extra)


if __name__ == "__main__":
    H.run_as_main(__spec__)
