"""Quantized leaves at inference: ``Int8`` (per output channel) and ``Int4`` (groups of 128 and
32 along ``d_in``) against the float32 ``Dense`` leaf, timed through ``lowrank_jax.linear`` in
one interleaved loop; with ``--quality``, the output error of round-to-nearest and GPTQ on a
random model of Chronos-Bolt-base's size.

Speed. For every width ``d`` and token count, the five ``[d, d]`` leaves (the integer ones
round-to-nearest quantizations of the dense leaf's weight) are called as
``jax.jit(lambda leaf, x: linear(leaf, x))`` with the leaf as an argument, after warm-up, each
call ended by ``block_until_ready``, the order reversed on every other run. The integer leaves
are weight-only: each call unpacks and dequantizes the weight to float32 inside the compiled
program, then multiplies in float32, so on a CPU they cost the float product plus the
dequantization; what they save is memory (``leaf MB``, the bytes of the arrays). ``w8a8``
(``Int8A8``) rounds every row of ``x`` to int8 inside the program and multiplies the int8 codes
with an int32 accumulator, then rescales (``int8_a8/int8``: its time over the weight-only
int8 leaf's, in the same runs). Ratios are the
medians of the per-run ratios (both calls timed in the same run) with their quartiles
(``q25-q75``). Outputs are checked against NumPy (dequantize, then multiply, in float64):
``err`` is the largest ``|y - y_ref| / (|x| @ |W_q|)`` (for ``w8a8`` the reference rounds
the rows of ``x`` first, then multiplies in float64).

Quality (``--quality``): a random model with Chronos-Bolt-base's sizes (``d_model`` 768,
``d_ff`` 3072, 12 + 12 layers, 12 heads of 64; weights ``N(0, 1/d_in)``, the queries' further
divided by ``sqrt(d_kv)`` as T5's initialization does (Hugging Face's ``T5PreTrainedModel.
_init_weights``), so that attention logits have unit scale; ``--no-query-scale`` leaves them
``N(0, 1/d_in)``, logits of standard deviation about 8), its attention and MLP
projections quantized by a plan, run on real series windows (the family's ``sample_inputs``).
Errors against the float32 model's quantile outputs, both as ``max |y_q - y| / max |y|`` ("max
err/max") and ``sqrt(mean (y_q - y)^2 / mean y^2)`` ("rms err/rms"): on the normalized outputs
(``(pred - loc) / scale`` per series, the scale the model works in) and, under "units", on the
forecasts in the series' own units (where the series with the largest values dominate).
Variants: RTN int8; a reference row, the float weights plus Gaussian noise of RTN int8's
Frobenius norm per weight (what any perturbation of that size does to this model); RTN int8
with int8 activations (``w8a8``, :class:`~lowrank_jax.leaves.Int8A8`); GPTQ int8; RTN and GPTQ
int4 g128 (GPTQ calibrated through the model's forward on other windows); and at equal size,
plain int4 g64 and g32 against low rank plus an int4 g128 residual whose rank is chosen per
weight from the storage counts so that each weight takes the storage of the plain int4 leaf
(``plain``: its bits per weight; ``ranks``: the ranks, one per weight shape), with int8 factors
(g64 and g32 sizes) and int4 factors (g32 size); last, low rank 32 with float32 factors plus an
int4 g128 residual (6.35 bits per weight). ``--quality-layers N`` shrinks the stacks to ``N``
layers each (a quicker run, the same widths); ``--quality-variants`` runs some variants only.

Usage::

    python -m benchmarks.layers quantize                 # d = 768, 1024, 2048; 64, 512, 2048 tokens
    python -m benchmarks.layers quantize --quick         # d = 768, 2048; 512 tokens; 5 runs
    python -m benchmarks.layers quantize --quick --json out.json
    python -m benchmarks.layers quantize --quick --quality --quality-layers 2
    python -m benchmarks.layers quantize --no-speed --quality --quality-variants "rtn int8" noise
    python -m benchmarks.layers quantize --quick --demo    # the demo model's WQL, seeds 0 1 2
    python -m benchmarks.layers quantize --no-speed --lm            # LM perplexity, ~12 min
    python -m benchmarks.layers quantize --no-speed --lm --quick    # a smoke test, ~2 min

Demo (``--demo``): the dense Chronos-Bolt of ``lowrank-jax demo`` (d_model 64), pretrained
once per seed and cached like ``lowrank-jax frontier demo`` does, quantized (RTN int8, RTN and
GPTQ int4 with groups of 32, and low rank 4 with int8 factors plus an int4 g64 residual, about
the size of int4 g32), scored by WQL and MASE on the built-in series' held-out test windows.

Language model (``--lm``): a Llama-style model (d_model 256, 4 layers, 8 query heads of 32
over 4 key-value heads, d_ff 768, vocabulary 4096, tied embeddings; ``--quick``: 2 layers,
d_ff 512, vocabulary 1024, shorter windows and fewer steps) pretrained per seed on the Python
standard library's source as ``python -m benchmarks.methods lm_study`` does (same corpus split,
byte-level BPE, windows, AdamW with warm-up and cosine decay), its attention and MLP
projections quantized (RTN and GPTQ at int8, int4 g128 and int4 g32; at the size of int4 g32,
low rank plus an int4 g128 residual with int8 or int4 factors, RTN, and with int4 factors
GPTQ, the ranks chosen per weight from the storage counts as in ``--quality``; GPTQ calibrated
on ``--lm-samples`` training windows through the model's forward), scored by perplexity on
windows of the held-out files against the dense model's. The tied embedding table stays
float32, so the whole model shrinks less than the projections' bits per weight say (``model
size``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import lowrank_jax as lj
from benchmarks import _harness as H
from lowrank_jax import leaves as L

KINDS = ("dense", "int8", "int8_a8", "int4_g128", "int4_g32")


def leaf_bytes(leaf) -> int:
    """Bytes of the arrays a leaf holds."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(leaf))


def make_leaves(d: int, seed: int) -> dict:
    w = np.random.default_rng(seed).standard_normal((d, d)).astype(np.float32) / np.sqrt(d)
    return {"dense": lj.Dense(jnp.asarray(w)), "int8": L.Int8.quantize(w),
            "int8_a8": L.Int8A8.quantize(w), "int4_g128": L.Int4.quantize(w, group=128),
            "int4_g32": L.Int4.quantize(w, group=32)}


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
        xk = np_rows_int8(xs) if k == "int8_a8" else xs  # W8A8: x rounded per row, as NumPy
        ref = xk @ wq
        got = np.asarray(fn(leaves[k], x), np.float64)
        row[f"{k}_err"] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(xk) @ np.abs(wq),
                                                                     1e-30)))
    r = t.ratio("int8_a8", "int8").paired
    row["int8_a8_over_int8"], row["int8_a8_over_int8_q25"] = r.median, r.q25
    row["int8_a8_over_int8_q75"] = r.q75
    return row


def np_rows_int8(x: np.ndarray) -> np.ndarray:
    """NumPy reference of :func:`lowrank_jax.leaves.quantized.quantize_rows`: ``x`` (float32
    values) rounded to int8 codes per row and scaled back, in float64."""
    x32 = np.asarray(x, np.float32)
    amax = np.abs(x32).max(-1, keepdims=True)
    sx = np.where(amax == 0, np.float32(1), amax * np.float32(1 / 127)).astype(np.float32)
    codes = np.clip(np.round(x32 * (np.float32(1) / sx)), -127, 127)
    return codes.astype(np.float64) * sx.astype(np.float64)


TABLE = H.Table(
    H.Col("d", "d", width=5), H.Col("tokens", "tokens"), H.Col("dense ms", "dense_ms", ".3f", 9),
    H.Col("int8 ms", "int8_ms", ".3f"), H.Col("w8a8 ms", "int8_a8_ms", ".3f"),
    H.Col("i4g128 ms", "int4_g128_ms", ".3f"), H.Col("i4g32 ms", "int4_g32_ms", ".3f"),
    *[H.Col(f"{k}/dense (q25-q75)",
            lambda r, k=k: f"{r[f'{k}_over_dense']:.2f} ({r[f'{k}_over_dense_q25']:.2f}-"
                           f"{r[f'{k}_over_dense_q75']:.2f})", width=22) for k in KINDS[1:]],
    H.Col("int8_a8/int8 (q25-q75)",
          lambda r: f"{r['int8_a8_over_int8']:.2f} ({r['int8_a8_over_int8_q25']:.2f}-"
                    f"{r['int8_a8_over_int8_q75']:.2f})", width=22),
    H.Col("leaf MB d/8/8/4/4", lambda r: "/".join(f"{r[f'{k}_bytes'] / 1e6:.2f}" for k in KINDS),
          width=26),
    H.Col("err", lambda r: f"{max(r[f'{k}_err'] for k in KINDS[1:]):.1e}", width=8),
    H.Col("load", "other_load", "%", 5))


def goals(rows: list[dict]) -> dict:
    out = {}
    for k in KINDS[1:]:
        vals = [r[f"{k}_over_dense"] for r in rows]
        what = "int8 weights and activations" if k == "int8_a8" else "weight-only"
        out.update(H.goal(f"{k} linear time / float32 Dense ({what}, CPU)",
                          float(np.median(vals)),
                          measured=f"median {np.median(vals):.2f} over {len(rows)} rows, "
                                   f"range {min(vals):.2f}-{max(vals):.2f}"))
    vals = [r["int8_a8_over_int8"] for r in rows]
    out.update(H.goal("int8_a8 (W8A8) linear time / weight-only int8 (CPU)",
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


def int4_bits(d_in: int, d_out: int, group: int | None) -> int:
    """Storage bits of an ``Int4`` ``[d_in, d_out]`` with float32 scales, no zero points."""
    g = d_in if group is None else min(group, d_in)
    return -(-d_in // 2) * d_out * 8 + -(-d_in // g) * d_out * 32


def lowrank_residual_bits(d_in: int, d_out: int, rank: int, group: int,
                          factor_bits: int | None) -> int:
    """Storage bits of the ``quantize`` method's low rank plus int4 residual (``rank``,
    ``group`` for the residual and ``U``, ``factor_bits`` 8, 4 or ``None`` for float32 factors;
    float32 scales): the residual's ``Int4``, ``U [d_in, r]`` and ``V [r, d_out]`` (``V``'s
    group capped at ``r``)."""
    r = rank
    if r == 0:
        return int4_bits(d_in, d_out, group)
    if factor_bits is None:
        factors = 32 * r * (d_in + d_out)
    elif factor_bits == 8:
        factors = 8 * r * (d_in + d_out) + 32 * (r + d_out)
    else:
        factors = int4_bits(d_in, r, group) + int4_bits(r, d_out, min(group, r))
    return int4_bits(d_in, d_out, group) + factors


def matching_rank(d_in: int, d_out: int, target_bits: int, group: int,
                  factor_bits: int | None) -> int:
    """The rank whose low rank plus int4 residual (:func:`lowrank_residual_bits`) comes
    nearest ``target_bits`` (the smaller rank on a tie)."""
    best = min(range(min(d_in, d_out) + 1), key=lambda r: (abs(
        lowrank_residual_bits(d_in, d_out, r, group, factor_bits) - target_bits), r))
    return int(best)


def equal_size_rules(params, rules: list[str], plain_group: int, group: int,
                     factor_bits: int | None) -> tuple[list, dict]:
    """Per-weight rules of a low rank plus int4 g``group`` residual whose rank makes each
    weight's storage nearest that of plain int4 g``plain_group`` (same float32 scales):
    ``([(path regex, {'rank': r}), ...], {path: (rank, bits, plain bits)})``."""
    import re

    out, info = [], {}
    for path, node in L.named_leaves(params):
        if not any(re.search(r, path) for r in rules):
            continue
        d_in, d_out = (int(d) for d in L.weight_shape(node))
        target = int4_bits(d_in, d_out, plain_group)
        r = matching_rank(d_in, d_out, target, group, factor_bits)
        out.append(("^" + re.escape(path) + "$", {"rank": r}))
        info[path] = (r, lowrank_residual_bits(d_in, d_out, r, group, factor_bits), target)
    return out, info


#: ``--quality`` variants: ``(name, settings, equal size)``; ``equal size`` ``(plain group,
#: factor bits)``: the rank of each weight chosen so that low rank (``factor bits``) plus an
#: int4 g128 residual takes the storage of plain int4 with groups of ``plain group``.
QUALITY_VARIANTS = (
    ("rtn int8", {"bits": 8}, None),
    ("rtn w8a8", {"bits": 8, "activations": "int8"}, None),
    ("gptq int8", {"bits": 8, "algorithm": "gptq"}, None),
    ("rtn int4 g128", {"bits": 4, "group": 128}, None),
    ("gptq int4 g128", {"bits": 4, "group": 128, "algorithm": "gptq"}, None),
    ("rtn int4 g64", {"bits": 4, "group": 64}, None),
    ("lowrank (int8) + int4 g128 = g64 size", {"bits": 4, "group": 128, "factor_bits": 8},
     (64, 8)),
    ("rtn int4 g32", {"bits": 4, "group": 32}, None),
    ("lowrank (int8) + int4 g128 = g32 size", {"bits": 4, "group": 128, "factor_bits": 8},
     (32, 8)),
    ("lowrank (int4) + int4 g128 = g32 size", {"bits": 4, "group": 128, "factor_bits": 4},
     (32, 4)),
    ("lowrank 32 (f32) + int4 g128", {"bits": 4, "group": 128, "rank": 32}, None),
)


def quality_model(layers: int, query_scale: bool = True):
    """``(config, params)`` of the ``--quality`` model (module docstring)."""
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

    return cfg, jax.tree_util.tree_map_with_path(fill, shapes)


def output_errors(yq: tuple, y: tuple) -> dict:
    """The error measures of the ``--quality`` table: on the normalized quantile outputs
    (``(pred - loc) / scale`` per series, the model's own scale) and on the forecasts in the
    series' units; each as ``max |y_q - y| / max |y|`` and ``sqrt(mean (y_q - y)^2 / mean
    y^2)``."""
    out = {}
    for key, a, b in (("", y[0], yq[0]), ("_units", y[1], yq[1])):
        out["max_err_over_scale" + key] = float(np.max(np.abs(b - a)) / np.max(np.abs(a)))
        out["rms_err_over_rms" + key] = float(np.sqrt(np.mean((b - a) ** 2) / np.mean(a ** 2)))
    return out


def quality(layers: int, samples: int, query_scale: bool = True,
            only: list[str] | None = None) -> list[dict]:
    """Rows of the ``--quality`` run (module docstring); ``only``: the variants to run (names
    of :data:`QUALITY_VARIANTS` and ``'noise'``; default all)."""
    import time

    from lowrank_jax.compress import Step, apply_plan
    from lowrank_jax.models import chronos_bolt

    cfg, params = quality_model(layers, query_scale)
    inputs = chronos_bolt.sample_inputs(cfg, np.random.default_rng(123), 8)

    def forward(p):
        o = chronos_bolt.apply(p, inputs, cfg)
        loc, scale = o["loc_scale"]
        pred = o["quantile_preds"]
        return (pred - loc[:, :, None]) / scale[:, :, None], pred

    run = jax.jit(forward)
    y = tuple(np.asarray(a, np.float64) for a in run(params))
    rules = [r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wo)$"]
    rows = []
    dense_bits = lj.storage_bits(params)

    def add(name, s, new, report, secs, **extra):
        rows.append({
            "variant": name, "layers": layers, "settings": s, "seconds": secs,
            **output_errors(tuple(np.asarray(a, np.float64) for a in run(new)), y),
            "size_ratio": lj.storage_bits(new) / dense_bits,
            "weights_bits_per_weight": sum(r.bits_after for r in report.rows) / sum(
                r.params_before for r in report.rows), **extra})
        print(QTABLE.line(rows[-1]), flush=True)

    for name, s, equal in QUALITY_VARIANTS:
        if only and name not in only and not (name == "rtn int8" and "noise" in only):
            continue
        s = {**s, "samples": samples} if s.get("algorithm") == "gptq" else dict(s)
        extra = {}
        step_rules = rules
        if equal:
            step_rules, info = equal_size_rules(params, rules, equal[0], s["group"], equal[1])
            ranks = sorted({v[0] for v in info.values()})
            extra = {"ranks": ranks, "plain_bits_per_weight": sum(v[2] for v in info.values())
                     / sum(np.prod(L.weight_shape(L.get_path(params, p))) for p in info)}
        t0 = time.perf_counter()
        new, report = apply_plan(params, Step("quantize", step_rules, s), config=cfg)
        secs = time.perf_counter() - t0
        if equal:  # the storage the ranks were chosen from is the storage measured
            want = {p: v[1] for p, v in info.items()}
            got = {r.path: r.bits_after for r in report.rows}
            assert got == want, [(p, got[p], want[p]) for p in want if got[p] != want[p]][:3]
        if not only or name in only:
            add(name, s, new, report, secs, **extra)
        if name == "rtn int8" and (not only or "noise" in only):
            # the same relative size of perturbation as RTN int8's, per weight, but Gaussian
            g = np.random.default_rng(1)
            noisy = {}
            for r in report.rows:
                w = L.materialize_host(L.get_path(params, r.path))
                e = g.standard_normal(w.shape)
                e *= np.linalg.norm(w - L.materialize_host(L.get_path(new, r.path))) / \
                    np.linalg.norm(e)
                noisy[r.path] = lj.Dense(jnp.asarray(w + e, jnp.float32))
            add("noise, RTN int8's size", {"noise": "gaussian"},
                L.replace_paths(params, noisy), report, 0.0)
    return rows


QTABLE = H.Table(
    H.Col("variant", "variant", width=38), H.Col("layers", "layers", width=6),
    H.Col("max err/max", "max_err_over_scale", ".2e", 11),
    H.Col("rms err/rms", "rms_err_over_rms", ".2e", 11),
    H.Col("units: max", "max_err_over_scale_units", ".2e", 10),
    H.Col("units: rms", "rms_err_over_rms_units", ".2e", 10),
    H.Col("bits/weight", "weights_bits_per_weight", ".3f", 11),
    H.Col("plain", lambda r: f"{r['plain_bits_per_weight']:.3f}" if "plain_bits_per_weight" in r
          else "", width=6),
    H.Col("ranks", lambda r: ",".join(map(str, r["ranks"])) if "ranks" in r else "", width=8),
    H.Col("model size", "size_ratio", ".3f", 10), H.Col("s", "seconds", ".0f", 5))


def quality_goals(rows: list[dict], layers: int) -> dict:
    """The issue's goals measured by ``--quality`` (those whose variants ran)."""
    by = {r["variant"]: r for r in rows}
    out = {}
    for v in ("rtn int8", "gptq int8", "rtn w8a8"):
        if v in by:
            r = by[v]
            out.update(H.goal(
                f"{v} output error (max |err| / max |y|, normalized outputs), "
                "Chronos-Bolt-base-sized random model", r["max_err_over_scale"], target="<= 0.01",
                holds=r["max_err_over_scale"] <= 0.01, layers=layers,
                measured=f"max {r['max_err_over_scale']:.2e}, RMS {r['rms_err_over_rms']:.2e}; "
                         f"in the series' units max {r['max_err_over_scale_units']:.2e}, RMS "
                         f"{r['rms_err_over_rms_units']:.2e}"))
    if "gptq int4 g128" in by and "rtn int4 g128" in by:
        g, r = by["gptq int4 g128"]["rms_err_over_rms"], by["rtn int4 g128"]["rms_err_over_rms"]
        out.update(H.goal("GPTQ int4 g128 output error / RTN int4 g128's (same size)", g / r,
                          target="< 1", holds=g < r))
    for low, plain in (("lowrank (int8) + int4 g128 = g64 size", "rtn int4 g64"),
                       ("lowrank (int8) + int4 g128 = g32 size", "rtn int4 g32"),
                       ("lowrank (int4) + int4 g128 = g32 size", "rtn int4 g32"),
                       ("lowrank 32 (f32) + int4 g128", "rtn int4 g128")):
        if low in by and plain in by:
            a, b = by[low], by[plain]
            out.update(H.goal(
                f"{low} output error / {plain}'s (RMS, normalized outputs)",
                a["rms_err_over_rms"] / b["rms_err_over_rms"],
                measured=f"{a['rms_err_over_rms']:.3e} vs {b['rms_err_over_rms']:.3e} at "
                         f"{a['weights_bits_per_weight']:.3f} vs "
                         f"{b['weights_bits_per_weight']:.3f} bits per weight"))
    return out


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


# -- decoder-only language model ---------------------------------------------------------------

#: Sizes of the ``--lm`` model: the full run and ``--quick``. ``d_model`` 256 so that groups of
#: 128 are real groups (two per column of every attention projection, ``d_ff / 128`` in the
#: down projection) and not one scale per channel.
LM_SIZES = {
    "full": dict(d_model=256, layers=4, heads=8, kv_heads=4, d_ff=768, vocab=4096, seq=128,
                 batch=8, steps=400, lr=3e-3, corpus_bytes=3_000_000, eval_windows=128),
    "quick": dict(d_model=256, layers=2, heads=8, kv_heads=4, d_ff=512, vocab=1024, seq=64,
                  batch=8, steps=120, lr=5e-3, corpus_bytes=400_000, eval_windows=48),
}

#: ``--lm`` variants: ``(name, settings, equal size)`` as :data:`QUALITY_VARIANTS`.
LM_VARIANTS = (
    ("rtn int8", {"bits": 8}, None),
    ("gptq int8", {"bits": 8, "algorithm": "gptq"}, None),
    ("rtn int4 g128", {"bits": 4, "group": 128}, None),
    ("gptq int4 g128", {"bits": 4, "group": 128, "algorithm": "gptq"}, None),
    ("rtn int4 g32", {"bits": 4, "group": 32}, None),
    ("gptq int4 g32", {"bits": 4, "group": 32, "algorithm": "gptq"}, None),
    ("rtn lowrank (int8) + int4 g128 = g32 size", {"bits": 4, "group": 128, "factor_bits": 8},
     (32, 8)),
    ("rtn lowrank (int4) + int4 g128 = g32 size", {"bits": 4, "group": 128, "factor_bits": 4},
     (32, 4)),
    ("gptq lowrank (int4) + int4 g128 = g32 size", {"bits": 4, "group": 128, "factor_bits": 4,
                                                    "algorithm": "gptq"}, (32, 4)),
)
LM_SOURCE = "benchmark_quantize_lm"


def lm(seeds: list[int], samples: int, quick: bool, steps: int | None = None) -> tuple:
    """Rows and setup of the ``--lm`` run: a Llama-style model (RMSNorm, rotary embeddings,
    SwiGLU, grouped-query attention with two query heads per key-value head, tied embeddings)
    pretrained per seed on the standard library's source as ``benchmarks.methods lm_study``
    does (its corpus, byte-level BPE, windows and AdamW schedule), its attention and MLP
    projections quantized, held-out perplexity against the dense model's. The tied embedding
    table stays float32. GPTQ calibrates on ``samples`` training windows through the model's
    forward (a registered batch source), apart from the held-out files."""
    import time

    from benchmarks.methods.lm_study import corpus_windows, fit, perplexity_fn, window_batches
    from lowrank_jax.compress import Step, apply_plan
    from lowrank_jax.compress.prune import register_batches
    from lowrank_jax.models import LlamaConfig, llama

    c = dict(LM_SIZES["quick" if quick else "full"])
    if steps:
        c["steps"] = steps
    t0 = time.perf_counter()
    corpus, train, held = corpus_windows(c)
    cfg = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["d_model"],
                      intermediate_size=c["d_ff"], num_hidden_layers=c["layers"],
                      num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                      max_position_embeddings=c["seq"] + 1, tie_word_embeddings=True)
    setup = {"config": c, "corpus": corpus.info(), "train_windows": int(train.shape[0]),
             "held_out_windows": int(held.shape[0]), "calibration_windows": samples,
             "data_seconds": time.perf_counter() - t0}
    print(f"# lm: corpus {corpus.info()}; {train.shape[0]} training and {held.shape[0]} "
          f"held-out windows of {c['seq'] + 1} tokens; {c['steps']} steps of {c['batch']}",
          flush=True)
    loss_fn = llama.loss(cfg)
    # calibration: training windows drawn apart from the batch order (seed + 2000)
    register_batches(LM_SOURCE, lambda config, *, batch_size, seed: window_batches(
        train, batch_size, seed + 2000))
    # equal chunks of 16 windows: the mean of the chunks' means is the mean
    perplexity = perplexity_fn(loss_fn, held[:len(held) - len(held) % 16])

    rules = [r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi_0|wi_1|wo)$"]
    rows = []
    for seed in seeds:
        t1 = time.perf_counter()
        dense = fit(loss_fn, llama.init(jax.random.PRNGKey(seed), cfg), train,
                    steps=c["steps"], seed=seed, lr=c["lr"], batch=c["batch"])
        fit_s = time.perf_counter() - t1
        dense_ppl = perplexity(dense)
        dense_bits = lj.storage_bits(dense)
        row = {"seed": seed, "variant": "dense", "ppl": dense_ppl, "ppl_rel": 0.0,
               "weights_bits_per_weight": 32.0, "size_ratio": 1.0, "seconds": fit_s}
        rows.append(row)
        print(LTABLE.line(row), flush=True)
        for name, st, equal in LM_VARIANTS:
            if st.get("algorithm") == "gptq":
                st = {**st, "data": LM_SOURCE, "samples": samples, "seed": seed}
            step_rules = rules
            if equal:  # ranks per weight: the storage of plain int4 g{equal[0]}
                step_rules, info = equal_size_rules(dense, rules, equal[0], st["group"],
                                                    equal[1])
            t1 = time.perf_counter()
            new, report = apply_plan(dense, Step("quantize", step_rules, st), config=cfg)
            if equal:
                assert {r.path: r.bits_after for r in report.rows} == {
                    p: v[1] for p, v in info.items()}
            secs = time.perf_counter() - t1
            ppl = perplexity(new)
            row = {"seed": seed, "variant": name, "settings": st, "ppl": ppl,
                   "ppl_rel": ppl / dense_ppl - 1, "seconds": secs,
                   "size_ratio": lj.storage_bits(new) / dense_bits,
                   "weights_bits_per_weight": sum(r.bits_after for r in report.rows) / sum(
                       r.params_before for r in report.rows)}
            if equal:
                row.update(ranks=sorted({v[0] for v in info.values()}),
                           plain_bits_per_weight=sum(v[2] for v in info.values()) / sum(
                               r.params_before for r in report.rows))
            rows.append(row)
            print(LTABLE.line(row), flush=True)
    setup["seconds"] = time.perf_counter() - t0
    return rows, setup


LTABLE = H.Table(
    H.Col("seed", "seed", width=4), H.Col("variant", "variant", width=42),
    H.Col("ppl", "ppl", ".3f", 8),
    H.Col("ppl rel", lambda r: f"{100 * r['ppl_rel']:+.2f}%", width=8),
    H.Col("bits/weight", "weights_bits_per_weight", ".3f", 11),
    H.Col("plain", lambda r: f"{r['plain_bits_per_weight']:.3f}" if "plain_bits_per_weight" in r
          else "", width=6),
    H.Col("ranks", lambda r: ",".join(map(str, r["ranks"])) if "ranks" in r else "", width=9),
    H.Col("model size", "size_ratio", ".3f", 10), H.Col("s", "seconds", ".0f", 5))


def lm_goals(rows: list[dict]) -> dict:
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r["ppl_rel"])

    def text(v):
        vals = by[v]
        return (f"mean {100 * np.mean(vals):+.2f}% over {len(vals)} seeds "
                f"({', '.join(f'{100 * x:+.2f}%' for x in vals)})")

    out = {}
    out.update(H.goal("LM held-out perplexity, RTN int8 vs dense (relative)",
                      float(np.mean(by["rtn int8"])), measured=text("rtn int8")))
    out.update(H.goal("LM held-out perplexity, GPTQ int4 g128 vs dense (relative)",
                      float(np.mean(by["gptq int4 g128"])), target="<= +2%",
                      holds=max(by["gptq int4 g128"]) <= 0.02, measured=text("gptq int4 g128")))
    for g in ("g128", "g32"):
        better = [a < b for a, b in zip(by[f"gptq int4 {g}"], by[f"rtn int4 {g}"], strict=True)]
        out.update(H.goal(f"LM perplexity, GPTQ int4 {g} better than RTN int4 {g} (seeds)",
                          sum(better), target=f"{len(better)} of {len(better)}",
                          holds=all(better), measured=f"{sum(better)} of {len(better)} seeds; "
                          f"RTN {text(f'rtn int4 {g}')}; GPTQ {text(f'gptq int4 {g}')}"))
    for algo, fb in (("rtn", 8), ("rtn", 4), ("gptq", 4)):
        low, plain = f"{algo} lowrank (int{fb}) + int4 g128 = g32 size", f"{algo} int4 g32"
        if low in by:
            better = [a < b for a, b in zip(by[low], by[plain], strict=True)]
            out.update(H.goal(f"LM perplexity, {low} vs {plain} (same size)",
                              float(np.mean(by[low]) - np.mean(by[plain])),
                              measured=f"lower in {sum(better)} of {len(better)} seeds; "
                                       f"low rank {text(low)}; plain {text(plain)}"))
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
    p.add_argument("--quality-variants", nargs="+", default=None,
                   help="run only these --quality variants (names in the table; 'noise' for "
                        "the Gaussian perturbation of RTN int8's size)")
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
    p.add_argument("--lm", action="store_true",
                   help="also held-out perplexity of a small Llama-style model pretrained on the "
                        "standard library's source, quantized (--quick: a smaller model)")
    p.add_argument("--lm-seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="pretraining seeds of the LM (default 0 1 2)")
    p.add_argument("--lm-samples", type=int, default=32,
                   help="GPTQ calibration windows for the LM (default 32)")
    p.add_argument("--lm-steps", type=int, default=None,
                   help="LM pretraining steps (default 400; quick 120)")
    p.add_argument("--no-speed", action="store_true",
                   help="skip the speed table (run only --quality, --demo or --lm)")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 15; quick 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up runs (default 2; quick 1)")
    args = p.parse_args(argv)
    dims = args.d or ([768, 2048] if args.quick else [768, 1024, 2048])
    tokens = args.tokens or ([512] if args.quick else [64, 512, 2048])
    runs = args.runs if args.runs is not None else (5 if args.quick else 15)
    warmup = 1 if args.quick else args.warmup
    run = H.Run(__name__, argv, runs=runs, warmup=warmup)
    rows = []
    if args.no_speed:
        print(f"# {run.describe()}; speed table skipped (--no-speed)")
    else:
        print(f"# {run.describe()}; median of {runs} interleaved runs; ratios = median of "
              "per-run ratios to the float32 Dense leaf (quartiles in brackets); int8, int4: "
              "weight-only, dequantized to float32 inside the program; w8a8 (int8_a8): rows of "
              "x rounded to int8, int8 x int8 product in int32; leaf MB = bytes of the arrays; "
              "err = max |y - y_np| / (|x| @ |W_q|) (x rounded per row for w8a8); load = CPU "
              "share of other processes")
        print(TABLE.header())
        for d in dims:
            for n in tokens:
                rows.append(bench(d, n, runs=runs, warmup=warmup))
                print(TABLE.line(rows[-1]), flush=True)
    result_goals = goals(rows) if rows else {}
    extra = {}
    if args.quality:
        print(f"# quality: random Chronos-Bolt-base-sized model ({args.quality_layers} + "
              f"{args.quality_layers} layers), attention and MLP projections quantized; error "
              "of the quantile outputs against the float32 model's: max err/max = max |y_q - y|"
              " / max |y| and rms err/rms on the normalized outputs ((pred - loc) / scale per "
              "series); units: the same on the forecasts in the series' units; plain = bits "
              "per weight of the plain int4 leaf the ranks were matched to")
        print(QTABLE.header())
        q = quality(args.quality_layers, args.samples, not args.no_query_scale,
                    args.quality_variants)
        extra["quality_rows"] = q
        result_goals.update(quality_goals(q, args.quality_layers))
    if args.demo:
        print("# demo: the demo's pretrained Chronos-Bolt (d_model 64, so groups of 32), "
              "attention and MLP projections quantized; pooled WQL and MASE on the held-out "
              "test windows, relative to the dense model's")
        print(DTABLE.header())
        d = demo(args.demo_seeds, args.demo_samples)
        extra["demo_rows"] = d
        result_goals.update(demo_goals(d))
    if args.lm:
        size = "quick" if args.quick else "full"
        sizes = {**LM_SIZES[size], **({"steps": args.lm_steps} if args.lm_steps else {})}
        print(f"# lm: a Llama-style model ({size} size: {sizes}) pretrained on the "
              "standard library's source, attention and MLP projections quantized (tied "
              "embeddings float32); held-out perplexity relative to the dense model's; "
              "bits/weight over the quantized projections; model size = storage over the "
              "dense model's; s = pretraining (dense) or quantization seconds")
        print(LTABLE.header())
        lrows, lsetup = lm(args.lm_seeds, args.lm_samples, args.quick, args.lm_steps)
        extra.update(lm_rows=lrows, lm_setup=lsetup)
        result_goals.update(lm_goals(lrows))
    return run.finish(args.json, rows=rows, goals=result_goals, **extra)


if __name__ == "__main__":
    H.run_as_main(__spec__)
