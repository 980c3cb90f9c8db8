"""FrozenBinary: what a trained MaskedBinary becomes (``freeze``), its counts, and that its signs
and gain stay out of ``jax.grad`` through ``partition`` / ``combine``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import leaves as lj

TOL = 1e-5


def f32(seed, shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def masked(seed=0, keep=0.3, bias=True):
    w, s = f32(seed, (7, 5)), f32(seed + 1, (7, 5))
    b = jnp.asarray(f32(seed + 2, (5,))) if bias else None
    return lj.MaskedBinary(jnp.asarray(w), jnp.asarray(s), b, keep=keep)


def test_freeze_is_bit_identical_and_counts_match():
    mb = masked()
    fb = mb.freeze()
    assert isinstance(fb, lj.FrozenBinary) and fb.signs.dtype == jnp.int8
    assert fb.alpha.dtype == mb.w.dtype and fb.alpha.shape == ()
    # Reference: the signs of the kept entries and alpha = ||M w||_1 / ||M||_1 (NumPy).
    w, m = np.asarray(mb.w, np.float64), np.asarray(mb.mask(), np.float64)
    np.testing.assert_array_equal(np.asarray(fb.signs), np.where(w >= 0, 1, -1) * m)
    np.testing.assert_allclose(float(fb.alpha), np.sum(np.abs(w) * m) / m.sum(), rtol=1e-6)
    x = jnp.asarray(f32(10, (4, 7)))
    np.testing.assert_array_equal(np.asarray(lj.linear(fb, x)), np.asarray(lj.linear(mb, x)))
    np.testing.assert_array_equal(np.asarray(lj.materialize(fb)),
                                  np.asarray(lj.materialize(mb)))
    n_keep = lj.keep_count(35, 0.3)
    assert fb.n_keep == mb.n_keep == n_keep
    assert lj.param_count(fb) == lj.param_count(mb) == n_keep + 1 + 5
    assert lj.storage_bits(fb) == lj.storage_bits(mb) == n_keep + 32 + 5 * 32
    assert lj.flops(fb, 3) == lj.flops(mb, 3) == 3 * n_keep


def test_frozen_binary_forward_and_counts_from_signs():
    signs = np.array([[1, 0, -1], [0, 0, 1], [-1, 1, 0], [0, 0, 0]], np.int8)  # 5 non-zero
    b = f32(3, (3,))
    fb = lj.FrozenBinary(jnp.asarray(signs), jnp.float32(0.75), jnp.asarray(b))
    x = f32(4, (2, 4))
    ref = x.astype(np.float64) @ (0.75 * signs) + b
    np.testing.assert_allclose(np.asarray(lj.linear(fb, jnp.asarray(x))), ref, atol=TOL)
    np.testing.assert_array_equal(np.asarray(lj.materialize(fb)), 0.75 * signs)
    assert fb.shape == (4, 3) and fb.n_keep == 5
    assert lj.param_count(fb) == 5 + 1 + 3
    assert lj.storage_bits(fb) == 5 + 32 + 3 * 32  # one bit per kept sign, float32 alpha
    assert lj.flops(fb, 6) == 6 * 5
    # Counts after surgery follow the kept signs only.
    kept = lj.keep_outputs(fb, np.array([0, 2]))
    assert kept.n_keep == 4 and lj.param_count(kept) == 4 + 1 + 2
    assert lj.flops(lj.keep_inputs(fb, np.array([1, 3])), 2) == 2 * 1


def test_grad_through_partition_leaves_signs_and_alpha_frozen():
    fb = masked(5, keep=0.5).freeze()
    params = {"fb": fb, "d": lj.Dense(jnp.asarray(f32(20, (5, 2))))}
    mask = lj.trainable_mask(params)
    assert mask["fb"].signs is False and mask["fb"].alpha is False and mask["fb"].b is True
    train, frozen = lj.partition(params)
    assert train["fb"].signs is None and train["fb"].alpha is None
    assert frozen["fb"].b is None and frozen["fb"].signs is fb.signs
    x = jnp.asarray(f32(21, (3, 7)))

    def loss(t):
        p = lj.combine(t, frozen)
        return jnp.sum(lj.linear(p["d"], lj.linear(p["fb"], x)) ** 2)

    g = jax.grad(loss)(train)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(train)
    assert g["fb"].signs is None and g["fb"].alpha is None
    # NumPy reference: h = x @ (alpha signs) + b, y = h @ W_d, L = sum(y^2).
    wf = float(fb.alpha) * np.asarray(fb.signs, np.float64)
    wd = np.asarray(params["d"].w, np.float64)
    h = np.asarray(x, np.float64) @ wf + np.asarray(fb.b, np.float64)
    gy = 2 * (h @ wd)
    np.testing.assert_allclose(np.asarray(g["fb"].b), (gy @ wd.T).sum(0), rtol=1e-5, atol=TOL)
    np.testing.assert_allclose(np.asarray(g["d"].w), h.T @ gy, rtol=1e-5, atol=TOL)
    # One SGD step on the trainable part: signs and alpha are carried over untouched.
    stepped = lj.combine(jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, train, g), frozen)
    assert stepped["fb"].signs is fb.signs and stepped["fb"].alpha is fb.alpha
    assert not np.array_equal(np.asarray(stepped["fb"].b), np.asarray(fb.b))
    # Without the split, jax.grad refuses the int8 signs: the reason for partition.
    with pytest.raises(TypeError):
        jax.grad(lambda f: jnp.sum(lj.linear(f, x)))(fb)


def test_frozen_binary_jit_and_trainable_tree_has_no_bools():
    fb = masked(7).freeze()
    x = jnp.asarray(f32(8, (2, 7)))
    np.testing.assert_array_equal(np.asarray(jax.jit(lj.linear)(fb, x)),
                                  np.asarray(lj.linear(fb, x)))
    train, _ = lj.partition({"fb": fb})
    assert all(a.dtype != jnp.bool_ for a in jax.tree_util.tree_leaves(train))
