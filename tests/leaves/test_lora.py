"""LoRA leaves against NumPy: forward, materialize, surgery, counts, training (base frozen),
pruned bases (the update lives on the kept channels), save/load, sharded train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowrank_jax as lj
from lowrank_jax import train
from lowrank_jax.errors import ConfigError, LeafTypeError, ShapeError
from lowrank_jax.leaves import (
    ChannelPruned,
    Dense,
    LoRA,
    add_lora,
    init_dense,
    init_lora,
    init_lowrank,
    init_masked_binary,
    merge_lora,
    pruned_leaf,
)

jax.config.update("jax_default_matmul_precision", "highest")
RNG = np.random.default_rng(0)


def random_lora(base, r=2, scale=0.5, seed=0):
    g = np.random.default_rng(seed)
    return LoRA(base=base, a=jnp.asarray(g.normal(size=(base.d_in, r)), jnp.float32),
                b=jnp.asarray(g.normal(size=(r, base.d_out)), jnp.float32), scale=scale)


def test_forward_materialize_counts_and_surgery_against_numpy():
    k = jax.random.PRNGKey(1)
    for base in (init_dense(k, 6, 5, bias=True), init_lowrank(k, 6, 5, 2, bias=True),
                 init_masked_binary(k, 6, 5, 0.5).freeze()):
        leaf = random_lora(base)
        w0 = lj.materialize_host(base)
        b0 = np.zeros(5) if lj.leaves.bias_of(base) is None else np.asarray(
            lj.leaves.bias_of(base), np.float64)
        a, b = np.asarray(leaf.a, np.float64), np.asarray(leaf.b, np.float64)
        w = w0 + 0.5 * a @ b
        x = RNG.normal(size=(3, 6)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(lj.linear(leaf, x)), x @ w + b0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lj.materialize(leaf)), w, atol=1e-5)
        assert leaf.param_count() == base.param_count() + 2 * (6 + 5)
        assert leaf.flops(4) == base.flops(4) + 4 * 2 * (6 + 5)
        rows, cols = np.array([0, 2, 5]), np.array([1, 4])
        sub = lj.keep_outputs(lj.keep_inputs(leaf, rows), cols)
        np.testing.assert_allclose(np.asarray(lj.materialize(sub)), w[np.ix_(rows, cols)],
                                   atol=1e-5)


def test_init_is_the_base_and_only_the_update_trains():
    base = init_dense(jax.random.PRNGKey(2), 4, 3, bias=True)
    leaf = init_lora(jax.random.PRNGKey(3), base, 2, alpha=4.0)
    assert leaf.scale == 2.0 and np.all(np.asarray(leaf.b) == 0)
    x = RNG.normal(size=(8, 4)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(lj.linear(leaf, x)), np.asarray(lj.linear(base, x)))
    y = RNG.normal(size=(8, 3)).astype(np.float32)

    def loss_fn(p, batch, key):
        return jnp.mean((lj.linear(p["w"], batch["x"]) - batch["y"]) ** 2), {}

    opt = optax.sgd(0.1)
    step = train.make_train_step(loss_fn, opt)
    state = train.init_train_state({"w": leaf}, opt, key=jax.random.PRNGKey(0))
    assert state.params["w"].base.w is None and state.frozen["w"].a is None
    losses = []
    for _ in range(3):
        state, m = step(state, {"x": x, "y": y})
        losses.append(float(m["loss"]))
    out = train.full_params(state)["w"]
    np.testing.assert_array_equal(np.asarray(out.base.w), np.asarray(base.w))
    np.testing.assert_array_equal(np.asarray(out.base.b), np.asarray(base.b))
    assert not np.allclose(np.asarray(out.b), 0) and losses[-1] < losses[0]


def test_lora_on_a_pruned_leaf_uses_the_kept_channels():
    base = init_dense(jax.random.PRNGKey(4), 6, 5, bias=True)
    rows, cols = np.array([0, 3, 4]), np.array([1, 2])
    pr = pruned_leaf(lj.keep_outputs(lj.keep_inputs(base, rows), cols), rows, cols, 6, 5)
    ad = add_lora(jax.random.PRNGKey(5), pr, 8)
    assert isinstance(ad, ChannelPruned) and isinstance(ad.base, LoRA)
    assert ad.base.a.shape == (3, 2) and ad.base.b.shape == (2, 2)  # rank capped at 2
    trained = ad.base.__class__(base=ad.base.base, a=ad.base.a, b=jnp.ones((2, 2)),
                                scale=ad.base.scale)
    ad = ChannelPruned(base=trained, rows=ad.rows, cols=ad.cols, d_in_full=6, d_out_full=5)
    x = RNG.normal(size=(2, 6)).astype(np.float32)
    y = np.asarray(lj.linear(ad, x))
    assert np.all(y[:, [0, 3, 4]] == 0)  # removed outputs stay removed
    w = np.asarray(base.w, np.float64)[np.ix_(rows, cols)] + trained.scale * (
        np.asarray(trained.a, np.float64) @ np.ones((2, 2)))
    np.testing.assert_allclose(y[:, cols], x[:, rows] @ w + np.asarray(base.b)[cols], atol=1e-5)
    merged = merge_lora(ad)
    assert isinstance(merged.base, Dense)
    np.testing.assert_allclose(np.asarray(lj.linear(merged, x)), y, atol=1e-5)
    with pytest.raises(LeafTypeError, match="already"):
        add_lora(jax.random.PRNGKey(0), trained, 2)
    with pytest.raises(ConfigError, match="rank"):
        init_lora(jax.random.PRNGKey(0), base, 0)
    with pytest.raises(ShapeError, match="expected a"):
        LoRA(base=base, a=jnp.ones((5, 2)), b=jnp.ones((2, 5)))


def test_save_load_and_sharded_step(tmp_path):
    from jax.sharding import Mesh

    from lowrank_jax.io import load_params, save_params

    base = init_dense(jax.random.PRNGKey(6), 8, 8, bias=True)
    params = {"w": random_lora(base, r=4, seed=2)}
    save_params(tmp_path / "c", params)
    back = load_params(tmp_path / "c")
    assert isinstance(back["w"], LoRA) and back["w"].scale == 0.5
    np.testing.assert_array_equal(np.asarray(back["w"].a), np.asarray(params["w"].a))
    x = RNG.normal(size=(8, 8)).astype(np.float32)
    y = RNG.normal(size=(8, 8)).astype(np.float32)

    def loss_fn(p, batch, key):
        return jnp.mean((lj.linear(p["w"], batch["x"]) - batch["y"]) ** 2), {}

    opt = optax.sgd(0.05)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    single = train.make_train_step(loss_fn, opt)
    sharded = train.make_train_step(loss_fn, opt, mesh=mesh, axis_rules={"out": "model"})
    s1 = train.init_train_state(params, opt, key=jax.random.PRNGKey(0))
    s2 = train.init_train_state(params, opt, key=jax.random.PRNGKey(0))
    # placement comes from the LoRA leaf's logical axes: b is ('rank', 'out')
    assert tuple(sharded.state_shardings(s2).params["w"].b.spec) == (None, "model")
    for _ in range(2):
        s1, _ = single(s1, {"x": x, "y": y})
        s2, _ = sharded(s2, {"x": x, "y": y})
    for a, b in zip(jax.tree_util.tree_leaves(train.full_params(s1)),
                    jax.tree_util.tree_leaves(train.full_params(s2)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
