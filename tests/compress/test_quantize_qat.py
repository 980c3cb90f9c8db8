"""Quantization-aware training: a Chronos-Bolt whose MLPs are low rank with 4-bit factors by
design (FakeQuant factors, float master weights, straight-through gradients) trains end to
end with the library's train step on a real series, its master weights move, and freezing gives
integer leaves whose forward equals the fake-quantized one."""

import re

import jax
import numpy as np

from lowrank_jax.datasets import builtin_series
from lowrank_jax.leaves import (
    as_fake_quant,
    freeze_fake_quant,
    get_path,
    init_lowrank,
    is_quantized,
    map_with_path,
    materialize,
    named_leaves,
    storage_bits,
)
from lowrank_jax.models import chronos_bolt, family_of
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.train import default_optimizer, full_params, init_train_state, make_train_step

BOLT = chronos_bolt.ChronosBoltConfig(
    t5=T5Config(vocab_size=1, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                feed_forward_proj="relu"),
    context_length=48, prediction_length=12, input_patch_size=8, input_patch_stride=8)


def _model():
    shapes = jax.eval_shape(lambda: chronos_bolt.init(jax.random.PRNGKey(0), BOLT))
    rng = np.random.default_rng(0)

    def fill(path, x):
        name = str(path[-1])
        if "scale" in name:
            return np.ones(x.shape, np.float32)
        if len(x.shape) == 1:
            return np.zeros(x.shape, np.float32)
        return (rng.standard_normal(x.shape) / np.sqrt(np.prod(x.shape[:-1]))).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(fill, shapes)
    key = jax.random.PRNGKey(1)

    def rewrite(path, node):
        if re.search(r"mlp/(wi|wo)$", path):
            d_in, d_out = node.shape
            return as_fake_quant(init_lowrank(jax.random.fold_in(key, len(path)), d_in, d_out, 8),
                                 bits=4, group=16)
        return node

    return map_with_path(rewrite, params)


def test_low_rank_4bit_by_design_trains_end_to_end():
    params = _model()
    series, _ = builtin_series()
    y = np.asarray(series[0], np.float32)
    ctx, h = BOLT.context_length, BOLT.prediction_length
    starts = np.arange(0, 32)
    batch = {"context": np.stack([y[s:s + ctx] for s in starts]),
             "target": np.stack([y[s + ctx:s + ctx + h] for s in starts])}
    steps = 14
    opt = default_optimizer(learning_rate=1e-2, total_steps=steps, warmup_steps=2)
    step = make_train_step(family_of(BOLT).loss(BOLT), opt)
    state = init_train_state(params, opt, key=jax.random.key(0))
    losses = []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses
    trained = full_params(state)
    p = "encoder/layers/0/mlp/wi"
    u0 = np.asarray(get_path(params, p + "/first/w"))
    u1 = np.asarray(get_path(trained, p + "/first/w"))
    assert np.abs(u1 - u0).max() > 1e-3  # gradients reached the master weights
    frozen = freeze_fake_quant(trained)
    fq = [q for q, _ in named_leaves(trained) if re.search(r"mlp/(wi|wo)$", q)]
    assert len(fq) == 4
    for q in fq:  # every fake-quantized weight: the integer leaves compute what was trained
        assert is_quantized(get_path(frozen, q)) and not is_quantized(get_path(trained, q))
        np.testing.assert_array_equal(np.asarray(materialize(get_path(frozen, q))),
                                      np.asarray(materialize(get_path(trained, q))))
        assert storage_bits(get_path(frozen, q)) == storage_bits(get_path(trained, q))
