"""MaskedBinary's reference Biprop forward/backward (against hand-derived NumPy), its
U(+-1/sqrt(fan_in)) init, FixedBias (a frozen bias), and FrozenBinary: what a trained
MaskedBinary becomes (``freeze``), its counts, and that its signs and gain stay out of
``jax.grad`` through ``partition`` / ``combine``."""

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
    # Reference: the signs of the kept entries and alpha = ||M w||_1 / floor(k n) (NumPy; the
    # reference divisor: floor(0.3 * 35) = 10 while 11 entries are kept).
    w, m = np.asarray(mb.w, np.float64), np.asarray(mb.mask(), np.float64)
    assert m.sum() == 11 and lj.alpha_divisor(35, 0.3) == 10
    np.testing.assert_array_equal(np.asarray(fb.signs), np.where(w >= 0, 1, -1) * m)
    np.testing.assert_allclose(float(fb.alpha), np.sum(np.abs(w) * m) / 10, rtol=1e-6)
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


# ---------------------------------------------------------------------------------------------
# The reference Biprop estimator.

def biprop_forward_np(w, s, keep):
    """chrundle/biprop GetQuantnet_binary.forward in NumPy (float64): M on the top
    n - floor((1-k) n) |s|, alpha = sum(|w| M) / floor(k n), W_eff = sign(w) alpha M."""
    n = w.size
    j = int((1 - keep) * n)
    order = np.argsort(np.abs(s).reshape(-1), kind="stable")
    m = np.zeros(n)
    m[order[j:]] = 1
    m = m.reshape(w.shape)
    alpha = np.sum(np.abs(w) * m) / int(keep * n)
    return np.where(w >= 0, 1.0, -1.0) * alpha * m, m


def test_gradient_matches_hand_derived_reference_two_layers():
    """L = sum((relu(x W1 + b1) W2)^2) with both W masked-binary: the score gradients are
    (dL/dW_eff * W) * sign(S) per layer (no alpha path, nothing to W), derived by hand."""
    r = np.random.default_rng(3)
    w1, s1 = r.normal(size=(6, 8)), r.normal(size=(6, 8))
    w2, s2 = r.normal(size=(8, 3)), r.normal(size=(8, 3))
    b1 = r.normal(size=(8,))
    x = r.normal(size=(5, 6))
    k1, k2 = 0.3, 0.5
    l1 = lj.MaskedBinary(jnp.asarray(w1, jnp.float32), jnp.asarray(s1, jnp.float32),
                         jnp.asarray(b1, jnp.float32), keep=k1)
    l2 = lj.MaskedBinary(jnp.asarray(w2, jnp.float32), jnp.asarray(s2, jnp.float32), keep=k2)
    params = {"l1": l1, "l2": l2}
    train, frozen = lj.partition(params)
    assert train["l1"].w is None and frozen["l1"].s is None

    def loss(t):
        p = lj.combine(t, frozen)
        h = jax.nn.relu(lj.linear(p["l1"], jnp.asarray(x, jnp.float32)))
        return jnp.sum(lj.linear(p["l2"], h) ** 2)

    g = jax.grad(loss)(train)
    # NumPy, float64, by hand.
    w1e, _ = biprop_forward_np(w1, s1, k1)
    w2e, _ = biprop_forward_np(w2, s2, k2)
    z = x @ w1e + b1
    h = np.maximum(z, 0)
    y = h @ w2e
    gy = 2 * y
    g_w2e = h.T @ gy
    gz = (gy @ w2e.T) * (z > 0)
    g_w1e = x.T @ gz
    np.testing.assert_allclose(np.asarray(g["l2"].s), g_w2e * w2 * np.sign(s2), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(g["l1"].s), g_w1e * w1 * np.sign(s1), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(g["l1"].b), gz.sum(0), rtol=1e-5, atol=1e-5)
    # The forward value is eq. 2 with the reference divisor.
    np.testing.assert_allclose(np.asarray(lj.materialize(l1)), w1e, rtol=1e-6, atol=1e-7)


def test_optax_step_changes_scores_only_and_mask_size():
    import optax

    leaf = lj.init_masked_binary(jax.random.PRNGKey(4), 10, 7, keep=0.5)
    assert int(np.asarray(leaf.mask()).sum()) == 70 - int(0.5 * 70)
    train, frozen = lj.partition({"l": leaf})
    opt = optax.adam(1e-2)
    st = opt.init(train)
    x = jnp.ones((3, 10))
    g = jax.grad(lambda t: jnp.sum(lj.linear(lj.combine(t, frozen)["l"], x) ** 3))(train)
    upd, _ = opt.update(g, st, train)
    new = lj.combine(optax.apply_updates(train, upd), frozen)["l"]
    assert new.w is leaf.w
    assert not np.array_equal(np.asarray(new.s), np.asarray(leaf.s))


def test_init_uniform_fan_in_and_independent_draws():
    a = lj.init_masked_binary(jax.random.PRNGKey(0), 64, 128, keep=0.5, bias=True)
    b = lj.init_masked_binary(jax.random.PRNGKey(1), 64, 128, keep=0.5)
    bound = 1 / np.sqrt(64)
    for arr in (a.w, a.s, a.b):
        v = np.asarray(arr)
        assert np.all(np.abs(v) <= bound) and np.abs(v).max() > 0.95 * bound
    w = np.asarray(a.w).ravel()
    # U(-c, c): mean 0, variance c^2/3 (8192 draws: generous 5-sigma bounds)
    assert abs(w.mean()) < 5 * bound / np.sqrt(3 * w.size)
    assert abs(w.var() / (bound**2 / 3) - 1) < 0.05
    assert not np.array_equal(np.asarray(a.w), np.asarray(a.s))
    assert not np.array_equal(np.asarray(a.w), np.asarray(b.w))
    with pytest.raises(lj_errors().ConfigError):
        lj.init_masked_binary(jax.random.PRNGKey(0), 0, 3, keep=0.5)


def lj_errors():
    import lowrank_jax.errors as e
    return e


def test_fixed_bias_is_frozen_and_adds():
    inner = lj.init_masked_binary(jax.random.PRNGKey(2), 5, 4, keep=0.5)
    b = jnp.asarray(f32(1, (4,)))
    leaf = lj.FixedBias(inner, b)
    x = jnp.asarray(f32(2, (3, 5)))
    ref = np.asarray(x, np.float64) @ np.asarray(lj.materialize(inner), np.float64) + np.asarray(b)
    np.testing.assert_allclose(np.asarray(lj.linear(leaf, x)), ref, atol=TOL)
    train, frozen = lj.partition({"l": leaf})
    assert train["l"].b is None and train["l"].leaf.w is None and train["l"].leaf.s is not None
    assert lj.param_count(leaf) == lj.param_count(inner) + 4
    assert lj.storage_bits(leaf) == lj.storage_bits(inner) + 4 * 32
    with pytest.raises(lj_errors().ShapeError):
        lj.FixedBias(inner, jnp.zeros((3,)))


@pytest.mark.parametrize("divisor", ["reference", "kept"])
def test_alpha_divisor_against_numpy(divisor):
    """``alpha = sum(|w| M) / floor(k n)`` (reference Biprop) or ``/ n_keep`` (the paper's
    ``||M||_1``, lowrank_jax 0.1 checkpoints): n = 35, k = 0.3 gives 10 vs 11."""
    rng = np.random.default_rng(5)
    w, s = rng.normal(size=(5, 7)).astype(np.float32), rng.normal(size=(5, 7)).astype(np.float32)
    leaf = lj.MaskedBinary(w=jnp.asarray(w), s=jnp.asarray(s), keep=0.3, divisor=divisor)
    n_keep = 35 - int(0.7 * 35)
    order = np.argsort(-np.abs(s).reshape(-1))[:n_keep]
    m = np.zeros(35)
    m[order] = 1
    m = m.reshape(5, 7)
    div = {"reference": int(0.3 * 35), "kept": n_keep}[divisor]
    assert (div, n_keep) == ((10, 11) if divisor == "reference" else (11, 11))
    alpha = float((np.abs(w.astype(np.float64)) * m).sum() / div)
    np.testing.assert_allclose(float(leaf.alpha()), alpha, rtol=1e-6)
    want = alpha * np.where(w >= 0, 1.0, -1.0) * m
    np.testing.assert_allclose(np.asarray(lj.materialize(leaf)), want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="divisor"):
        lj.MaskedBinary(w=jnp.asarray(w), s=jnp.asarray(s), keep=0.3, divisor="mean")
