"""Leaf types against plain NumPy: forward, materialize, counts, gradients, jit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import leaves as lj
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import keep_count


def rng(seed=0):
    return np.random.default_rng(seed)


def test_dense_forward_and_counts():
    r = rng()
    w, b, x = r.normal(size=(6, 4)), r.normal(size=4), r.normal(size=(3, 5, 6))
    leaf = lj.Dense(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32))
    y = lj.linear(leaf, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(y), x @ w + b, atol=1e-5)
    assert lj.param_count(leaf) == 6 * 4 + 4
    assert lj.storage_bits(leaf) == (6 * 4 + 4) * 32
    assert lj.flops(leaf, 10) == 10 * 6 * 4


def test_plain_array_is_a_dense_weight():
    r = rng(1)
    w, x = r.normal(size=(5, 3)).astype(np.float32), r.normal(size=(2, 5)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lj.linear(jnp.asarray(w), x)), x @ w, atol=1e-5)


def test_lowrank_forward_counts_and_materialize():
    r = rng(2)
    u, v, b = r.normal(size=(8, 3)), r.normal(size=(3, 5)), r.normal(size=5)
    x = r.normal(size=(7, 8))
    leaf = lj.LowRank(*(jnp.asarray(a, jnp.float32) for a in (u, v, b)))
    np.testing.assert_allclose(
        np.asarray(lj.linear(leaf, jnp.asarray(x, jnp.float32))), x @ (u @ v) + b, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(lj.materialize(leaf)), u @ v, atol=1e-5)
    assert leaf.rank == 3 and leaf.shape == (8, 5)
    assert lj.param_count(leaf) == 3 * (8 + 5) + 5
    assert lj.flops(leaf, 4) == 4 * 3 * (8 + 5)


def _head_reference(x, u, v, ranks):
    # u [d_in, h, r], v [h, r, d_h]: head i uses its first ranks[i] columns only.
    outs = []
    for i, ri in enumerate(ranks):
        outs.append(x @ u[:, i, :ri] @ v[i, :ri, :])
    return np.concatenate(outs, axis=-1)


@pytest.mark.parametrize("ranks", [None, (3, 1, 2)])
def test_head_lowrank_matches_per_head_numpy(ranks):
    r = rng(3)
    d_in, h, rmax, dh = 10, 3, 3, 4
    u, v, x = (
        r.normal(size=(d_in, h, rmax)),
        r.normal(size=(h, rmax, dh)),
        r.normal(size=(2, 6, d_in)),
    )
    leaf = lj.HeadLowRank(jnp.asarray(u, jnp.float32), jnp.asarray(v, jnp.float32), ranks=ranks)
    eff = ranks or (rmax,) * h
    ref = _head_reference(x, u, v, eff)
    np.testing.assert_allclose(
        np.asarray(lj.linear(leaf, jnp.asarray(x, jnp.float32))), ref, atol=1e-5
    )
    dense_ref = np.concatenate([u[:, i, :ri] @ v[i, :ri, :] for i, ri in enumerate(eff)], axis=1)
    np.testing.assert_allclose(np.asarray(lj.materialize(leaf)), dense_ref, atol=1e-5)
    assert leaf.shape == (d_in, h * dh)
    assert lj.param_count(leaf) == sum(ri * (d_in + dh) for ri in eff)
    # FLOPs count what runs: irregular ranks summing to 6 of 9 run on the true ranks.
    assert lj.flops(leaf, 5) == 5 * sum(eff) * (d_in + dh)


def test_head_lowrank_nearly_uniform_ranks_run_padded():
    """Ranks summing to >= 90 % of the padded ones run both products padded (masked): same
    outputs as the per-head reference, FLOPs of the padded products."""
    r = rng(5)
    d_in, h, rmax, dh = 7, 10, 4, 3
    ranks = (4,) * 9 + (3,)
    u, v, x = r.normal(size=(d_in, h, rmax)), r.normal(size=(h, rmax, dh)), r.normal(size=(5, d_in))
    leaf = lj.HeadLowRank(jnp.asarray(u, jnp.float32), jnp.asarray(v, jnp.float32), ranks=ranks)
    assert leaf._exact_layout() is None
    np.testing.assert_allclose(np.asarray(lj.linear(leaf, jnp.asarray(x, jnp.float32))),
                               _head_reference(x, u, v, ranks), atol=1e-5)
    assert lj.flops(leaf, 5) == 5 * h * rmax * (d_in + dh)
    zero = lj.HeadLowRank(jnp.asarray(u, jnp.float32), jnp.asarray(v, jnp.float32),
                          ranks=(0,) * h)  # every head at rank 0: exact path, zero output
    assert np.all(np.asarray(lj.linear(zero, jnp.asarray(x, jnp.float32))) == 0)
    assert lj.flops(zero, 5) == 0


def test_head_lowrank_padding_gets_no_gradient():
    r = rng(4)
    u = jnp.asarray(r.normal(size=(6, 2, 3)), jnp.float32)
    v = jnp.asarray(r.normal(size=(2, 3, 2)), jnp.float32)
    leaf = lj.HeadLowRank(u, v, ranks=(3, 1))
    x = jnp.asarray(r.normal(size=(4, 6)), jnp.float32)
    g = jax.grad(lambda lf: jnp.sum(lj.linear(lf, x) ** 2))(leaf)
    assert np.all(np.asarray(g.u)[:, 1, 1:] == 0) and np.all(np.asarray(g.v)[1, 1:, :] == 0)
    assert np.any(np.asarray(g.u)[:, 0, :] != 0)


def _biprop_reference(w, s, keep):
    n = w.size
    j = int((1 - keep) * n)  # reference GetSubnet: drop the j lowest |scores|
    order = np.argsort(np.abs(s).reshape(-1), kind="stable")
    m = np.zeros(n)
    m[order[j:]] = 1
    m = m.reshape(w.shape)
    alpha = np.sum(np.abs(w) * m) / max(1, int(keep * n))  # reference divisor floor(k n)
    return alpha * np.where(w >= 0, 1.0, -1.0) * m, m, alpha


@pytest.mark.parametrize("keep", [0.5, 0.3, 0.75, 1.0, 0.01])
def test_masked_binary_forward_is_exact(keep):
    r = rng(5)
    w = r.normal(size=(12, 9)).astype(np.float32)
    s = r.normal(size=(12, 9)).astype(np.float32)
    leaf = lj.MaskedBinary(jnp.asarray(w), jnp.asarray(s), keep=keep)
    w_eff, m, alpha = _biprop_reference(w.astype(np.float64), s, keep)
    got = np.asarray(lj.materialize(leaf))
    # Exact: every entry is 0 or +-alpha with the reference mask and sign.
    np.testing.assert_array_equal(got != 0, m.astype(bool))
    np.testing.assert_array_equal(np.sign(got), np.sign(w_eff))
    np.testing.assert_allclose(np.abs(got[m.astype(bool)]), alpha, rtol=1e-6)
    assert int(m.sum()) == leaf.n_keep == keep_count(w.size, keep)
    x = r.normal(size=(3, 12)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lj.linear(leaf, jnp.asarray(x))), x @ w_eff, atol=1e-5)


def test_keep_count_rounding_documented():
    # n - floor((1 - keep) n), as in the reference Biprop code.
    assert keep_count(48, 0.3) == 15  # 0.7 * 48 = 33.6 -> drop 33
    assert keep_count(10, 0.5) == 5
    assert keep_count(7, 1.0) == 7
    assert keep_count(3, 0.01) == 1


def test_masked_binary_counts():
    leaf = lj.init_masked_binary(jax.random.PRNGKey(0), 16, 8, keep=0.25, bias=True)
    n_keep = keep_count(128, 0.25)
    assert lj.param_count(leaf) == n_keep + 1 + 8
    assert lj.storage_bits(leaf) == n_keep + 32 + 8 * 32
    assert lj.flops(leaf, 3) == 3 * n_keep


def test_masked_binary_straight_through_and_no_bool_leaves():
    r = rng(6)
    leaf = lj.init_masked_binary(jax.random.PRNGKey(1), 6, 5, keep=0.4, bias=True)
    x = jnp.asarray(r.normal(size=(4, 6)), jnp.float32)
    params = {"layer": leaf}
    train, frozen = lj.partition(params)
    assert train["layer"].w is None and frozen["layer"].s is None

    def loss(t):
        return jnp.sum(lj.linear(lj.combine(t, frozen)["layer"], x) ** 2)

    g = jax.grad(loss)(train)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(train)
    for a in jax.tree_util.tree_leaves(g):
        assert a.dtype != jnp.bool_
    gs = np.asarray(g["layer"].s)
    # Straight-through: scores of *dropped* weights get gradient too (a hard mask would give 0).
    dropped = ~np.asarray(leaf.mask(), bool)
    assert np.any(gs[dropped] != 0)

    # Independent check of the reference Biprop gradient by hand (chrundle/biprop
    # GetQuantnet_binary): y = x @ W_eff + b, L = sum(y^2), dL/dW_eff = x^T 2y and
    # dL/ds = (dL/dW_eff * w) * sign(s), no path through alpha.
    w = np.asarray(leaf.w, np.float64)
    s = np.asarray(leaf.s, np.float64)
    w_eff, m, alpha = _biprop_reference(w, s, 0.4)
    xn = np.asarray(x, np.float64)
    y = xn @ w_eff + np.asarray(leaf.b)
    gW = xn.T @ (2 * y)
    g_ref = gW * w * np.sign(s)
    np.testing.assert_allclose(gs, g_ref, rtol=1e-4, atol=1e-4)


def test_jit_matches_eager_and_no_retrace():
    r = rng(7)
    leaves = [
        lj.Dense(jnp.asarray(r.normal(size=(8, 4)), jnp.float32)),
        lj.LowRank(
            jnp.asarray(r.normal(size=(8, 2)), jnp.float32),
            jnp.asarray(r.normal(size=(2, 4)), jnp.float32),
        ),
        lj.HeadLowRank(
            jnp.asarray(r.normal(size=(8, 2, 2)), jnp.float32),
            jnp.asarray(r.normal(size=(2, 2, 2)), jnp.float32),
            ranks=(2, 1),
        ),
        lj.init_masked_binary(jax.random.PRNGKey(2), 8, 4, keep=0.5),
    ]
    x = jnp.asarray(r.normal(size=(3, 8)), jnp.float32)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(tree, x):
        return [lj.linear(lf, x) for lf in tree]

    a = f(leaves, x)
    b = f(leaves, x + 1.0)  # same shapes: no retrace
    eager = [lj.linear(lf, x) for lf in leaves]
    for got, ref in zip(a, eager, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
    assert len(b) == 4


def test_tree_counts_sum_over_leaves():
    key = jax.random.PRNGKey(0)
    tree = {
        "a": lj.init_dense(key, 4, 3, bias=True),
        "b": [lj.init_lowrank(key, 6, 5, 2), jnp.ones((7,))],
    }
    assert lj.param_count(tree) == 15 + 2 * 11 + 7
    assert lj.storage_bits(tree) == 32 * (15 + 22 + 7)
    assert lj.flops(tree, 2) == 2 * (12 + 22)


@pytest.mark.parametrize(
    "make, match, error",
    [
        (lambda: lj.Dense(jnp.ones((3,))), r"2-D .* got shape \(3,\)", ShapeError),
        (lambda: lj.LowRank(jnp.ones((4, 2)), jnp.ones((3, 5))), r"u \(4, 2\) and v \(3, 5\)",
         ShapeError),
        (
            lambda: lj.Dense(jnp.ones((3, 2)), jnp.ones((3,))),
            r"bias b must have shape \(2,\), got \(3,\)",
            ShapeError,
        ),
        (
            lambda: lj.MaskedBinary(jnp.ones((2, 2)), jnp.ones((2, 2)), keep=1.5),
            r"keep fraction .* 1\.5",
            ConfigError,
        ),
        (lambda: lj.HeadLowRank(jnp.ones((4, 2, 3)), jnp.ones((2, 3, 2)), ranks=(4, 1)), r"ranks",
         ShapeError),
        (lambda: lj.FrozenBinary(jnp.ones((3,), jnp.int8), jnp.float32(1.0)), r"signs must be 2-D",
         ShapeError),
    ],
)
def test_bad_leaves_raise_clear_errors(make, match, error):
    # The library's own error kinds, which also stay ValueErrors for existing callers.
    with pytest.raises(error, match=match) as info:
        make()
    assert isinstance(info.value, ValueError)


def test_linear_rejects_wrong_input_dim():
    leaf = lj.LowRank(jnp.ones((4, 2)), jnp.ones((2, 3)))
    with pytest.raises(ShapeError, match=r"d_in=4.*\(5, 3\)"):
        lj.linear(leaf, jnp.ones((5, 3)))


def test_tree_rebuilds_skip_construction_checks():
    """JAX may rebuild leaves with scalars or stacked children; only user construction checks."""
    import optax

    r = rng(8)
    tree = {
        "a": lj.LowRank(jnp.asarray(r.normal(size=(5, 2)), jnp.float32),
                        jnp.asarray(r.normal(size=(2, 3)), jnp.float32)),
        "b": lj.HeadLowRank(jnp.ones((4, 2, 2)), jnp.ones((2, 2, 3)), ranks=(2, 1)),
        "c": lj.init_masked_binary(jax.random.PRNGKey(0), 4, 3, keep=0.5),
    }
    norm = float(optax.tree.norm(tree))
    ref = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree_util.tree_leaves(tree)))
    assert norm == pytest.approx(ref, rel=1e-6)
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), tree)  # e.g. pmap outputs
    assert stacked["a"].u.shape == (2, 5, 2) and stacked["b"].ranks == (2, 1)
    # per-device slices are leaves again, equal to the original
    first = jax.tree_util.tree_map(lambda x: x[0], stacked)
    np.testing.assert_array_equal(np.asarray(lj.materialize(first["a"])),
                                  np.asarray(lj.materialize(tree["a"])))
    # direct construction still validates
    with pytest.raises(ValueError, match="LowRank"):
        lj.LowRank(jnp.ones((2, 3, 4)), jnp.ones((4, 2)))
