"""The row computation of ``benchmarks/methods/pruning.py`` on a tiny Chronos-Bolt (no
timings).

"Less is More: Unlocking Specialization of Time Series Foundation Models via Structured Pruning"
(arXiv:2505.23195): a model pruned to a target by Algorithm 1 (on random importance scores, as
the benchmark does) and removed physically must give the masked model's forecasts to 1e-5; its
parameter ratio must be the stored array sizes of the pruned tree over the dense tree's (counted
here with NumPy, not by the leaves); its FLOP ratio must be the hand count from the architecture
(every weight's kept ``d_in x d_out`` times the rows it sees in Chronos-Bolt: patches for the
input embedding, encoder tokens in the encoder and for the cross-attention keys and values, one
step elsewhere in the decoder; plus the score products ``q_len k_len heads (max q/k width +
max v width)``); and what the whole model lost must be what the pruning structure counted.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

import lowrank_jax as lj
from lowrank_jax.leaves import get_path
from lowrank_jax.leaves.channel_masked import ChannelPruned


def load_bench():
    return importlib.import_module("benchmarks.methods.pruning")


def array_size(tree) -> int:
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(tree)))


def hand_flops(cfg, params) -> int:
    """Multiply-adds per series of one forward, from the architecture (see the module doc)."""
    patches = cfg.num_patches(cfg.context_length)
    enc = patches + 1  # [REG] token
    total = 0
    for path, leaf in lj.named_leaves(params):
        if not isinstance(leaf, lj.leaves.Leaf):
            continue
        d_in, d_out = leaf.base.shape if isinstance(leaf, ChannelPruned) else leaf.shape
        if path.startswith("input_patch_embedding/"):
            rows = patches
        elif path.startswith("encoder/") or (
                "/cross_attn/" in path and path.endswith(("/qk/k", "/v"))):
            rows = enc
        else:  # the decoder's single step and the output embedding
            rows = 1
        total += d_in * d_out * rows
    blocks = [(f"encoder/layers/{i}/attn", enc, enc) for i in range(cfg.t5.num_layers)]
    for i in range(cfg.t5.num_decoder_layers):
        blocks += [(f"decoder/layers/{i}/self_attn", 1, 1), (f"decoder/layers/{i}/cross_attn", 1,
                                                             enc)]
    for path, q_len, k_len in blocks:
        block = get_path(params, path)
        heads = block["heads"]
        qk = max(block["qk"].widths, default=0)
        total += q_len * k_len * heads.num_heads * (qk + max(heads.v, default=0))
    return int(total)


def test_pruning_benchmark_row_invariants():
    pb = load_bench()
    cfg = pb.bolt_config(d_model=32, num_heads=4, d_ff=64, encoder_layers=2, decoder_layers=1,
                         context_length=64, prediction_length=16)
    params = pb.init_params(cfg, seed=1)
    context = jnp.asarray(np.cumsum(np.random.default_rng(0).normal(size=(3, 64)), 1),
                          jnp.float32)
    out = pb.prune_row(cfg, params, 0.5, context, seed=2, steps=2)
    row, pruned, masked = out["row"], out["pruned"], out["masked"]
    # physically pruned = masked, on the normalized scale
    assert row["max_abs_diff_masked"] <= 1e-5
    run = jax.jit(lambda p: pb.normalized_output(p, cfg, context))
    assert float(jnp.max(jnp.abs(run(pruned) - run(masked)))) == row["max_abs_diff_masked"]
    # the target is met (by at most a few units more) and something is really gone
    assert 0.5 <= row["pruned_fraction"] < 0.55
    assert any(isinstance(n, ChannelPruned) for _, n in lj.named_leaves(pruned))
    # parameters: NumPy sizes of the arrays, not the leaves' counts
    dense_n, pruned_n = array_size(params), array_size(pruned)
    assert row["params_dense"] == dense_n and row["params_pruned"] == pruned_n
    assert abs(row["param_ratio"] - pruned_n / dense_n) <= 1e-12 and row["param_ratio"] < 0.9
    # FLOPs: the hand count from the architecture
    dense_f, pruned_f = hand_flops(cfg, params), hand_flops(cfg, pruned)
    assert row["flops_dense"] == dense_f and row["flops_pruned"] == pruned_f
    assert abs(row["flop_ratio"] - pruned_f / dense_f) <= 1e-12 and row["flop_ratio"] < 0.9
    # what the whole model lost is what the pruning structure counted (the rest is untouched)
    assert dense_n - pruned_n == row["prunable_params_dense"] - row["prunable_params_pruned"]
    assert dense_f - pruned_f == row["prunable_flops_dense"] - row["prunable_flops_pruned"]
    assert abs(1 - row["prunable_params_pruned"] / row["prunable_params_dense"]
               - row["pruned_fraction"]) <= 1e-12
