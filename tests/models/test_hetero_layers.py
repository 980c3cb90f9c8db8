"""Models whose layers differ in head count and MLP width: init, run, save, load and train.

Shapes come from the parameters, so a T5, Chronos-Bolt, ViT or BERT whose every layer has its
own head count and MLP width (what structured pruning produces) must go through the whole
library. Each layer's output is also checked against a NumPy re-implementation of one
attention block on the sliced weights, so a block that read its sizes from the config would
fail here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowrank_jax as lj
from lowrank_jax import models, nn, train
from lowrank_jax.io import load_model, save_model
from lowrank_jax.models import BertConfig, ChronosBoltConfig, T5Config, ViTConfig

SIZES = [nn.LayerSizes(num_heads=1, d_head=4, d_ff=8), nn.LayerSizes(num_heads=3, d_head=4, d_ff=24)]


def t5_cfg():
    return T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                    num_heads=4, feed_forward_proj="gated-gelu")


CASES = {
    "t5": (t5_cfg(), dict(encoder_layers=SIZES, decoder_layers=SIZES[::-1])),
    "chronos_bolt": (ChronosBoltConfig(t5=T5Config(vocab_size=2, d_model=16, d_kv=4, d_ff=32,
                                                   num_layers=2, num_decoder_layers=2, num_heads=4),
                                       context_length=32, prediction_length=8, input_patch_size=8,
                                       input_patch_stride=8, use_reg_token=True),
                     dict(encoder_layers=SIZES, decoder_layers=SIZES[::-1])),
    "vit": (ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=32, num_labels=3), dict(layers=SIZES)),
    "bert": (BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=32, max_position_embeddings=40, num_labels=2),
             dict(layers=SIZES)),
}


def batch_for(name, cfg, rng):
    fam = models.family_of(cfg)
    inputs = fam.sample_inputs(cfg, rng, 4)
    if name == "t5":
        inputs["labels"] = inputs["decoder_input_ids"]
    elif name == "chronos_bolt":
        inputs["target"] = jnp.asarray(rng.normal(size=(4, cfg.prediction_length)), jnp.float32)
    else:
        inputs["labels"] = jnp.asarray(rng.integers(0, cfg.num_labels, size=4))
    return inputs


@pytest.mark.parametrize("name", list(CASES))
def test_per_layer_sizes_init_run_save_load_train(name, tmp_path):
    cfg, layers = CASES[name]
    fam = models.family_of(cfg)
    params = fam.init(jax.random.PRNGKey(0), cfg, **layers)
    # every layer has the sizes it was given, read back from the parameters
    heads = {p: n for p, n in lj.named_leaves(params) if p.endswith("attn/qk/q")}
    for path, q in heads.items():
        i = lj.leaves.layer_index(path)
        want = (SIZES[::-1] if "decoder/" in path else SIZES)[i]
        assert q.d_out == want.num_heads * want.d_head, path
    rng = np.random.default_rng(0)
    batch = batch_for(name, cfg, rng)
    inputs = {k: v for k, v in batch.items() if k not in ("target",)}
    if name in ("vit", "bert"):
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
    # one compiled forward (the shapes are read from the parameters while tracing, as eagerly;
    # op-by-op eager dispatch compiled every op of these unusual shapes anew: 4 s instead of 1)
    run = jax.jit(lambda p, x: models.apply(p, x, cfg))
    out = run(params, inputs)
    key = fam.primary_outputs[0]
    assert bool(jnp.all(jnp.isfinite(out[key])))
    # save / load: same outputs
    save_model(tmp_path / "m", cfg, params)
    cfg2, back = load_model(tmp_path / "m")
    assert cfg2 == cfg
    np.testing.assert_array_equal(np.asarray(run(back, inputs)[key]),
                                  np.asarray(out[key]))
    # train: the family's loss decreases over a few steps of one batch and only values change
    opt = optax.adam(1e-2)
    step = train.make_train_step(fam.loss(cfg), opt)
    state = train.init_train_state(params, opt, key=jax.random.PRNGKey(1))
    losses = []
    for _ in range(5):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    trained = train.full_params(state)
    assert jax.tree_util.tree_structure(trained) == jax.tree_util.tree_structure(params)


def np_attention(block, x, scale_expected):
    """One attention block in NumPy from its dense weights, looping over heads."""
    qk, heads = block["qk"], block["heads"]

    def dense(leaf):
        b = lj.leaves.bias_of(leaf)
        return (np.asarray(lj.materialize(leaf), np.float64),
                0.0 if b is None else np.asarray(b, np.float64))

    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = map(dense, (qk.q, qk.k, block["v"], block["o"]))
    q, k, v = x @ wq + bq, x @ wk + bk, x @ wv + bv
    assert heads.scale == pytest.approx(scale_expected)
    out = np.zeros((x.shape[0], wo.shape[1]))
    qo = vo = 0
    for w_qk, w_v in zip(qk.widths, heads.v, strict=True):
        logits = q[:, qo:qo + w_qk] @ k[:, qo:qo + w_qk].T * heads.scale
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out += (p @ v[:, vo:vo + w_v]) @ wo[vo:vo + w_v]
        qo, vo = qo + w_qk, vo + w_v
    return out + bo


def test_attention_of_a_narrow_vit_layer_against_numpy():
    cfg, layers = CASES["vit"]
    params = models.vit.init(jax.random.PRNGKey(3), cfg, **layers)
    x = np.random.default_rng(4).normal(size=(1, 5, 16))
    for i, sizes in enumerate(SIZES):
        block = params["encoder"]["layers"][i]["attn"]
        got = nn.apply_attention(block, jnp.asarray(x, jnp.float32), cfg.encoder.layer.attention)
        # make the biases non-zero so that a bias bug cannot hide behind the zero init
        block = {**block, "qk": lj.QueryKey(
            q=block["qk"].q.with_bias(jnp.linspace(-1, 1, block["qk"].q.d_out)),
            k=block["qk"].k.with_bias(jnp.linspace(1, -1, block["qk"].k.d_out)),
            widths=block["qk"].widths),
            "v": block["v"].with_bias(jnp.linspace(-0.5, 0.5, block["v"].d_out))}
        got = nn.apply_attention(block, jnp.asarray(x, jnp.float32), cfg.encoder.layer.attention)
        want = np_attention(block, x[0], 1 / np.sqrt(sizes.d_head))
        np.testing.assert_allclose(np.asarray(got)[0], want, atol=1e-5)
