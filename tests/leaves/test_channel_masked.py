"""ChannelMasked (eq. 4 of "Less is More") and ChannelPruned against NumPy references.

The mask-gradient identities are checked against gradients derived by hand in NumPy for a
two-layer network: for an output mask ``dL/dm_out,j = sum_i W_ij dL/dW_ij + b_j dL/db_j`` and
for an input mask ``dL/dm_in,i = sum_j W_ij dL/dW_ij`` (all masks at one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.errors import LeafTypeError, ShapeError
from lowrank_jax.leaves import (
    ChannelMasked,
    ChannelPruned,
    Dense,
    LowRank,
    bias_of,
    channel_masks,
    combine,
    count_rows,
    init_dense,
    init_head_lowrank,
    init_lowrank,
    init_masked_binary,
    kept_counts,
    mask_leaf,
    mask_partition,
    pruned_leaf,
    unmask,
    with_channel_masks,
)
from lowrank_jax.leaves.channel_masked import output_granularity, surgery_form

jax.config.update("jax_default_matmul_precision", "highest")

RNG = np.random.default_rng(0)


def dense(d_in, d_out, seed, bias=True):
    r = np.random.default_rng(seed)
    return Dense(w=jnp.asarray(r.normal(size=(d_in, d_out)), jnp.float32),
                 b=jnp.asarray(r.normal(size=d_out), jnp.float32) if bias else None)


def two_layer_numpy(w1, b1, w2, b2, c, x):
    """Hand-derived gradients of L = sum(c * y2^2), y2 = tanh(x W1 + b1) W2 + b2."""
    y1 = x @ w1 + b1
    z = np.tanh(y1)
    y2 = z @ w2 + b2
    dy2 = 2.0 * c * y2
    dw2, db2 = z.T @ dy2, dy2.sum(0)
    dz = dy2 @ w2.T
    dy1 = dz * (1.0 - z ** 2)
    dw1, db1 = x.T @ dy1, dy1.sum(0)
    return dw1, db1, dw2, db2


def test_mask_gradient_identities_against_hand_derived_numpy():
    l1, l2 = dense(5, 6, 1), dense(6, 3, 2)
    x = RNG.normal(size=(7, 5))
    c = RNG.normal(size=(7, 3))
    tree = {"l1": mask_leaf(l1), "l2": mask_leaf(l2)}
    masks, rest = mask_partition(tree)

    def loss(m):
        t = combine(m, rest)
        y = lj.linear(t["l2"], jnp.tanh(lj.linear(t["l1"], jnp.asarray(x, jnp.float32))))
        return jnp.sum(jnp.asarray(c, jnp.float32) * y ** 2)

    g = jax.grad(loss)(masks)
    w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in (l1.w, l1.b, l2.w, l2.b))
    dw1, db1, dw2, db2 = two_layer_numpy(w1, b1, w2, b2, c, x)
    for name, w, b, dw, db in (("l1", w1, b1, dw1, db1), ("l2", w2, b2, dw2, db2)):
        want_out = (w * dw).sum(0) + b * db
        want_in = (w * dw).sum(1)
        np.testing.assert_allclose(np.asarray(g[name].m_out), want_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(g[name].m_in), want_in, rtol=1e-4, atol=1e-5)
    # the weights are not differentiated: the mask tree holds masks only
    assert all(a.ndim == 1 for a in jax.tree_util.tree_leaves(g))


def test_masked_and_pruned_against_numpy_for_every_leaf_type():
    """The masked leaf is eq. 4, ``x (W * (m_in^T m_out)) + b * m_out`` with ``W`` the leaf's
    own dense matrix; physical removal (gather kept rows, scatter kept columns) gives the same,
    a NumPy slice of ``W``; for every leaf type (HeadLowRank: whole heads; MaskedBinary: mask
    and alpha frozen)."""
    k = jax.random.PRNGKey(4)
    cases = {
        "dense": (init_dense(k, 6, 8, bias=True), np.array([0, 1, 2, 5, 7])),
        "lowrank": (init_lowrank(k, 6, 8, 3, bias=True), np.array([1, 3, 4])),
        "head_lowrank": (init_head_lowrank(k, 6, 2, 4, 2), np.array([4, 5, 6, 7])),
        "masked_binary": (init_masked_binary(k, 6, 8, 0.5, bias=True), np.array([0, 2, 6])),
    }
    rows = np.array([0, 2, 3, 5])
    x = RNG.normal(size=(2, 3, 6)).astype(np.float32)
    for name, (leaf, cols) in cases.items():
        m_in = np.isin(np.arange(6), rows).astype(np.float32)
        m_out = np.isin(np.arange(8), cols).astype(np.float32)
        ml = mask_leaf(leaf, m_in, m_out)
        masked = lj.linear(ml, x)
        w = lj.materialize_host(leaf)
        b = np.zeros(8) if bias_of(leaf) is None else np.asarray(bias_of(leaf), np.float64)
        np.testing.assert_allclose(np.asarray(masked), x @ (w * np.outer(m_in, m_out)) + b * m_out,
                                   atol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(lj.materialize(ml)), w * np.outer(m_in, m_out),
                                   atol=1e-6, err_msg=name)
        assert ml.param_count() == leaf.param_count() and ml.flops(5) == leaf.flops(5)
        base = lj.keep_outputs(lj.keep_inputs(leaf, rows), cols)
        pr = pruned_leaf(base, rows, cols, 6, 8)
        assert isinstance(pr, ChannelPruned) and pr.shape == (6, 8)
        got = lj.linear(pr, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(masked), atol=1e-5, err_msg=name)
        want = np.zeros((2, 3, 8))
        want[..., cols] = x[..., rows] @ w[np.ix_(rows, cols)] + b[cols]
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=name)
        dense_w = np.zeros((6, 8))
        dense_w[np.ix_(rows, cols)] = w[np.ix_(rows, cols)]
        np.testing.assert_allclose(np.asarray(lj.materialize(pr)), dense_w, atol=1e-6)
        pb = np.asarray(pr.bias) if pr.bias is not None else np.zeros(8)
        np.testing.assert_allclose(pb, np.where(np.isin(np.arange(8), cols), b, 0), atol=1e-7)
        # counts are the smaller leaf's; kept_counts predicts them without slicing
        assert pr.param_count() == base.param_count() and pr.flops(3) == base.flops(3)
        assert kept_counts(surgery_form(leaf), m_in > 0, m_out > 0, 3) == (
            base.param_count(), base.flops(3)), name


def test_channel_pruned_surgery_composes():
    leaf = dense(6, 5, 7)
    pr = pruned_leaf(lj.keep_outputs(lj.keep_inputs(leaf, [1, 2, 4]), [0, 3]), [1, 2, 4],
                     [0, 3], 6, 5)
    sub = lj.keep_outputs(lj.keep_inputs(pr, np.array([0, 2, 4, 5])), np.array([1, 3, 4]))
    assert sub.shape == (4, 3)
    full = np.zeros((6, 5))
    full[np.ix_([1, 2, 4], [0, 3])] = np.asarray(leaf.w)[np.ix_([1, 2, 4], [0, 3])]
    np.testing.assert_allclose(np.asarray(lj.materialize(sub)), full[np.ix_([0, 2, 4, 5],
                                                                            [1, 3, 4])])
    bias = np.zeros(5)
    bias[[0, 3]] = np.asarray(leaf.b)[[0, 3]]
    np.testing.assert_allclose(np.asarray(sub.bias), bias[[1, 3, 4]])
    # nothing gathered and nothing scattered: the plain leaf
    assert pruned_leaf(leaf, None, np.arange(5), 6, 5) is leaf


def test_masks_stay_out_of_training_and_tree_helpers():
    tree = {"a": mask_leaf(dense(4, 3, 1)), "b": dense(3, 2, 2), "s": jnp.ones(3)}
    train, frozen = lj.partition(tree)
    assert train["a"].m_in is None and frozen["a"].m_in is not None
    assert train["a"].base.w is not None and frozen["a"].base.w is None
    masks = channel_masks(tree)
    assert list(masks) == ["a"] and masks["a"][0].shape == (4,)
    new = with_channel_masks(tree, {"a": (np.array([1, 0, 1, 1]), np.array([0, 1, 1]))})
    np.testing.assert_array_equal(channel_masks(new)["a"][1], [0, 1, 1])
    assert unmask(new)["a"] is new["a"].base
    with pytest.raises(KeyError, match="b"):
        with_channel_masks(tree, {"b": (np.ones(3), np.ones(2))})
    with pytest.raises(ShapeError, match="m_in"):
        ChannelMasked(base=dense(4, 3, 1), m_in=jnp.ones(5), m_out=jnp.ones(3))
    with pytest.raises(LeafTypeError, match="already masked"):
        ChannelMasked(base=tree["a"], m_in=jnp.ones(4), m_out=jnp.ones(3))
    with pytest.raises(ShapeError, match="rows"):
        ChannelPruned(base=dense(2, 3, 1), rows=(3, 1), cols=None, d_in_full=4, d_out_full=3)
    with pytest.raises(ShapeError, match="base has shape"):
        ChannelPruned(base=dense(2, 3, 1), rows=(0, 1, 2), cols=None, d_in_full=4, d_out_full=3)


def test_save_load_round_trip(tmp_path):
    from lowrank_jax.io import load_params, save_params

    leaf = dense(6, 5, 3)
    tree = {"m": mask_leaf(leaf, np.array([1, 0, 1, 1, 1, 0]), np.ones(5)),
            "p": pruned_leaf(lj.keep_inputs(leaf, [0, 2]), [0, 2], None, 6, 5)}
    save_params(tmp_path / "c", tree)
    back = load_params(tmp_path / "c")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    x = RNG.normal(size=(3, 6)).astype(np.float32)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(lj.linear(back[k], x)),
                                      np.asarray(lj.linear(tree[k], x)))


def test_granularity_and_row_counts():
    k = jax.random.PRNGKey(0)
    assert output_granularity(init_dense(k, 4, 4)) == 1
    assert output_granularity(init_head_lowrank(k, 8, 2, 4, 2)) == 4
    assert output_granularity(mask_leaf(init_head_lowrank(k, 8, 2, 4, 2))) == 4
    tree = {"a": init_dense(k, 4, 3), "b": LowRank(u=jnp.ones((3, 2)), v=jnp.ones((2, 2)))}

    def fn(t):
        x = jnp.ones((2, 5, 4))
        y = lj.linear(t["a"], x)
        return lj.linear(t["b"], y[:, :3]) + lj.linear(t["b"], y[:, :1]).sum()

    assert count_rows(fn, tree) == {"a": 10, "b": 6 + 2}
    assert count_rows(fn, tree, ["a"]) == {"a": 10}
