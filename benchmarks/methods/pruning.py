"""Physically pruned vs masked vs dense Chronos-Bolt ("Less is More: Unlocking Specialization of
Time Series Foundation Models via Structured Pruning", arXiv:2505.23195): measured speed-up.

A model of Chronos-Bolt-base's shape (d_model 768, 12 heads of 64, d_ff 3072, ReLU MLPs,
12 encoder + 12 decoder layers, context 2048 in patches of 16, horizon 64; random weights) gets
channel masks on every attention and MLP projection (``add_channel_masks``, the library's
default rules) and is pruned to 30 / 50 / 70 % of its prunable parameters. Each row compares
three models on the same inputs:

* **dense**: the original model;
* **masked**: the same model with the masks as forward-pass inputs (eq. 4): it computes
  everything, so its time should be the dense time (``masked_time_ratio`` ~ 1);
* **pruned**: ``remove_masked`` of the masked model: fewer heads, narrower q/k and v/o widths
  and MLPs, and residual-width channels as row/column slices (``ChannelPruned``).

**Masks.** Algorithm 1 (``progressive_prune``: the global ranking, the dependency groups and the
bisection to the exact target) run for ``--prune-steps`` batches on *random importance scores*:
the loss handed to it is ``sum_i r_i m_i`` with ``r_i ~ U(0, 1)`` drawn afresh for every batch,
so that eq. 6 gives every unit a random score. The masks are thus random structured masks at
the target, with the structure Algorithm 1 produces (input and output channels of every weight
are units of their own). What is measured is the cost of what is kept, not which channels are
kept; a trained model's masks concentrate differently (e.g. whole heads), which changes the
layout but not the FLOP accounting.

Columns: ``pruned_fraction`` (of the prunable parameters, as the target counts it);
``param_ratio`` and ``flop_ratio`` (whole model, pruned / dense: parameters stored, and
multiply-adds of every weight leaf with the rows it sees plus the attention score products,
:func:`lowrank_jax.flops` + :func:`lowrank_jax.nn.attention_score_flops`); ``time_ratio``
(pruned / dense) and ``masked_time_ratio`` (masked / dense): medians over ``--rounds`` rounds of
one interleaved run, every round calling every model once (the order reversed on every other
round), each call a jitted forward (parameters as arguments) ended by ``block_until_ready``;
``max_abs_diff_masked``: max |pruned - masked| of the quantile forecasts on the model's
normalized scale. Goal: ``time_ratio <= 1.2 flop_ratio``. ``other load`` is the share
of the machine's CPU time that other processes used during the timing (``/proc/stat``).

Usage::

    python -m benchmarks.methods pruning --json pruning.json
    python -m benchmarks.methods pruning --quick            # 2 + 2 layers, fewer rounds: < 3 minutes
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import lowrank_jax as lj
from benchmarks import _harness as H
from lowrank_jax import nn
from lowrank_jax.compress.prune import (
    add_channel_masks,
    find_blocks,
    progressive_prune,
    token_counts,
)
from lowrank_jax.leaves import get_path, mask_partition
from lowrank_jax.leaves.channel_masked import count_rows
from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt

GOAL = 1.2
FRACTIONS = (0.3, 0.5, 0.7)
MASKS = ("Algorithm 1 (progressive_prune) on random importance scores: loss sum_i r_i m_i, "
         "r_i ~ U(0,1) per batch; random structured masks at the target")


def bolt_config(*, d_model: int = 768, num_heads: int = 12, d_ff: int = 3072,
                encoder_layers: int = 12, decoder_layers: int = 12, context_length: int = 2048,
                prediction_length: int = 64, patch: int = 16) -> ChronosBoltConfig:
    """Chronos-Bolt-base's shape by default (``amazon/chronos-bolt-base``: T5 with d_model 768,
    12 heads of 64, d_ff 3072, ReLU, 12 + 12 layers; context 2048, patches of 16, horizon 64)."""
    t5 = T5Config(vocab_size=2, d_model=d_model, d_kv=d_model // num_heads, d_ff=d_ff,
                  num_layers=encoder_layers, num_decoder_layers=decoder_layers,
                  num_heads=num_heads, feed_forward_proj="relu")
    return ChronosBoltConfig(t5=t5, context_length=context_length,
                             prediction_length=prediction_length, input_patch_size=patch,
                             input_patch_stride=patch, use_reg_token=True)


def init_params(cfg: ChronosBoltConfig, seed: int = 0):
    """Random parameters of the model's structure, drawn with NumPy (fast for a large model):
    weights ~ N(0, 1/d_in) so activations keep their scale through the layers, norm scales 1,
    biases small."""
    fam = lj.models.family_of(cfg)
    shapes = jax.eval_shape(lambda: fam.init(jax.random.PRNGKey(0), cfg))
    g = np.random.default_rng(seed)

    def draw(s):
        if len(s.shape) == 2:
            return jnp.asarray(g.normal(size=s.shape) / np.sqrt(s.shape[0]), s.dtype)
        if len(s.shape) == 1:
            return jnp.asarray(1.0 + 0.1 * g.normal(size=s.shape), s.dtype)
        return jnp.asarray(0.1 * g.normal(size=s.shape), s.dtype)

    return jax.tree_util.tree_map(draw, shapes)


def random_score_loss(seed: int):
    """``loss(params, batch, key) = sum_i r_i m_i`` over every mask entry of ``params``, with
    ``r`` uniform in (0, 1) drawn from ``(seed, batch['j'])``: per-sample gradient ``r_i``, so
    eq. 6 scores each unit ``|-r + r^2/2|``, increasing in ``r``: a uniformly random ranking."""

    def loss(params, batch, key):
        del key
        masks, _ = mask_partition(params)
        base = jax.random.fold_in(jax.random.PRNGKey(seed), batch["j"][0])
        total = 0.0
        for i, m in enumerate(jax.tree_util.tree_leaves(masks)):
            r = jax.random.uniform(jax.random.fold_in(base, i), m.shape)
            total = total + jnp.sum(r * m)
        return total, {}

    return loss


def model_flops(params, cfg: ChronosBoltConfig, inputs: dict) -> int:
    """Multiply-adds of one forward pass of ``inputs``, per sample: every weight leaf with the
    rows it sees (:func:`~lowrank_jax.leaves.count_rows`) plus the attention score products of
    every attention block (:func:`lowrank_jax.nn.attention_score_flops`)."""
    batch = int(inputs["context"].shape[0])
    rows = count_rows(lambda p: chronos_bolt.apply(p, inputs, cfg), params)
    total = sum(get_path(params, p).flops(n) for p, n in rows.items())
    for path, block in find_blocks(params)[0]:
        v = rows[f"{path}/v"]  # keys and values read the same rows
        q, k = rows.get(f"{path}/qk/q", v), rows.get(f"{path}/qk/k", v)
        # rows = batch x tokens: the score products are counted per batch element
        total += batch * nn.attention_score_flops(block, q // batch, k // batch)
    return int(total) // batch


def normalized_output(params, cfg: ChronosBoltConfig, context):
    """Quantile forecasts on the model's normalized scale (before the un-normalization by each
    series' location and scale)."""
    out = chronos_bolt.apply(params, {"context": context}, cfg)
    loc, scale = out["loc_scale"]
    return (out["quantile_preds"] - loc[:, :, None]) / scale[:, :, None]


def prune_row(cfg: ChronosBoltConfig, params, fraction: float, context, *, seed: int = 0,
              steps: int = 4, by: str = "params") -> dict:
    """One row without timings: masks at ``fraction`` (module docstring), the pruned model,
    the counts and the pruned-vs-masked difference.

    Returns:
      ``{'row': {...}, 'masked': tree, 'pruned': tree}``.
    """
    masked0 = add_channel_masks(params)
    tokens = token_counts(cfg, params)
    batches = [{"j": np.full((1,), j, np.int32)} for j in range(steps)]
    t0 = time.perf_counter()
    result = progressive_prune(masked0, random_score_loss(seed), batches, target=fraction,
                               steps=steps, by=by, tokens=tokens, config=cfg)
    pruned = result.structure.remove(result.removal)
    prune_s = time.perf_counter() - t0
    inputs = {"context": context}
    run = jax.jit(lambda p, c: normalized_output(p, cfg, c))
    got, want = run(pruned, context), run(result.params, context)
    dense_params, pruned_params = lj.param_count(params), lj.param_count(pruned)
    dense_flops = model_flops(params, cfg, inputs)
    pruned_flops = model_flops(pruned, cfg, inputs)
    heads = [(int(r.sum()), r.size) for r in result.removal.heads.values()]
    hidden = [(int(r.sum()), r.size) for r in result.removal.hidden.values()]
    row = {
        "target": fraction,
        "pruned_fraction": result.params_fraction,
        "pruned_flops_fraction": result.flops_fraction,
        "param_ratio": pruned_params / dense_params,
        "flop_ratio": pruned_flops / dense_flops,
        "params_dense": dense_params, "params_pruned": pruned_params,
        "flops_dense": dense_flops, "flops_pruned": pruned_flops,
        "prunable_params_dense": result.structure.total_params,
        "prunable_params_pruned": result.structure.counts(result.removal)[0],
        "prunable_flops_dense": result.structure.total_flops,
        "prunable_flops_pruned": result.structure.counts(result.removal)[1],
        "heads_kept": sum(h for h, _ in heads), "heads_total": sum(t for _, t in heads),
        "mlp_hidden_kept": sum(h for h, _ in hidden),
        "mlp_hidden_total": sum(t for _, t in hidden),
        "max_abs_diff_masked": float(jnp.max(jnp.abs(got - want))),
        "prune_seconds": prune_s,
    }
    return {"row": row, "masked": result.params, "pruned": pruned}


def time_models(cfg: ChronosBoltConfig, models: dict, context, rounds: int) -> dict:
    """Median seconds per forward of every model, interleaved: each round calls each model once,
    the order reversed on every other round. Returns ``{'median_s': {...}, 'other_load'}``."""
    fwd = jax.jit(lambda p, c: chronos_bolt.forecast(p, c, cfg))
    # warm-up: compile, and one warm call of each
    m = H.measure({n: (lambda p=p: fwd(p, context)) for n, p in models.items()}, runs=rounds,
                  warmup=2)
    return {"median_s": {n: m.timings.median(n) for n in models}, "other_load": m.load,
            "all_s": {n: list(m.timings.seconds(n)) for n in models}}


TABLE = H.Table(
    H.Col("pruned", "pruned_fraction", ".3f", 7), H.Col("params", "param_ratio", ".3f", 7),
    H.Col("FLOPs", "flop_ratio", ".3f", 7), H.Col("time", "time_ratio", ".3f", 7),
    H.Col("masked", "masked_time_ratio", ".3f", 7), H.Col("time/FLOP", "time_over_flop", ".2f"),
    H.Col("pruned ms", "pruned_ms", ".1f"), H.Col("|pruned-masked|", "max_abs_diff_masked", ".2e"),
    H.Col("", lambda r: "" if r["meets_goal"] else f"> goal ({GOAL})"))


def main(argv=None) -> dict:
    p = H.parser(__doc__, quick="2 encoder + 2 decoder layers (same widths), fewer rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 11, quick 9)")
    p.add_argument("--batch", type=int, default=4, help="series per forward (default 4)")
    p.add_argument("--prune-steps", type=int, default=None,
                   help="Algorithm 1 batches (default 4, quick 2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    layers = 2 if args.quick else 12
    rounds = args.rounds or (9 if args.quick else 11)
    batch = args.batch
    prune_steps = args.prune_steps or (2 if args.quick else 4)
    cfg = bolt_config(encoder_layers=layers, decoder_layers=layers)
    params = init_params(cfg, args.seed)
    g = np.random.default_rng(args.seed)
    context = jnp.asarray(np.cumsum(g.normal(size=(batch, cfg.context_length)), 1), jnp.float32)
    t5 = cfg.t5
    run = H.Run(__name__, argv, quick=args.quick, encoder_layers=t5.num_layers,
                decoder_layers=t5.num_decoder_layers, d_model=t5.d_model,
                num_heads=t5.num_heads, d_ff=t5.d_ff, context_length=cfg.context_length,
                prediction_length=cfg.prediction_length, batch=batch, rounds=rounds,
                prune_steps=prune_steps, seed=args.seed, masks=MASKS)
    print(f"# Chronos-Bolt, {t5.num_layers}+{t5.num_decoder_layers} layers, d_model {t5.d_model}, "
          f"{t5.num_heads} heads, d_ff {t5.d_ff}, context {cfg.context_length} "
          f"({cfg.num_patches(cfg.context_length) + 1} encoder tokens), batch {batch}; "
          f"{lj.param_count(params) / 1e6:.1f} M parameters")
    print(f"# masks: {MASKS}", flush=True)
    rows, models = [], {"dense": params}
    for f in FRACTIONS:
        out = prune_row(cfg, params, f, context, seed=args.seed, steps=prune_steps)
        rows.append(out["row"])
        models[f"masked {f:g}"] = out["masked"]
        models[f"pruned {f:g}"] = out["pruned"]
        print(f"  pruned to {f:.0%}: {out['row']['heads_kept']}/{out['row']['heads_total']} "
              f"heads, {out['row']['mlp_hidden_kept']}/{out['row']['mlp_hidden_total']} MLP "
              f"channels kept ({out['row']['prune_seconds']:.1f} s)", flush=True)
    tm = time_models(cfg, models, context, rounds)
    med = tm["median_s"]
    for r, f in zip(rows, FRACTIONS, strict=True):
        r["time_ratio"] = med[f"pruned {f:g}"] / med["dense"]
        r["masked_time_ratio"] = med[f"masked {f:g}"] / med["dense"]
        r["time_over_flop"] = r["time_ratio"] / r["flop_ratio"]
        r["meets_goal"] = bool(r["time_over_flop"] <= GOAL)
        r["dense_ms"] = 1e3 * med["dense"]
        r["pruned_ms"] = 1e3 * med[f"pruned {f:g}"]
        r["masked_ms"] = 1e3 * med[f"masked {f:g}"]
    load = "n/a" if tm["other_load"] is None else f"{100 * tm['other_load']:.0f}%"
    print(f"\n# median of {rounds} interleaved rounds (other load {load}); dense "
          f"{1e3 * med['dense']:.1f} ms per forward of {batch} series")
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    run.setup["loop_other_load"] = tm["other_load"]
    return run.finish(args.json, rows=rows, goals=goals(rows, tm["other_load"]))


def goals(rows: list[dict], load: float | None) -> dict:
    worst = max(rows, key=lambda r: r["time_over_flop"])
    ok = sum(r["time_over_flop"] <= GOAL for r in rows)
    detail = ", ".join(f"{r['target']:g}: {r['time_over_flop']:.2f}" for r in rows)
    return H.goal("physically pruned Chronos-Bolt time/FLOP", worst["time_over_flop"],
                  target=f"<= {GOAL}", holds=ok == len(rows),
                  measured=f"worst {worst['time_over_flop']:.2f} (pruned {detail}); "
                           f"{ok}/{len(rows)} meet it; load {H.percent(load)}")


if __name__ == "__main__":
    H.run_as_main(__spec__)
