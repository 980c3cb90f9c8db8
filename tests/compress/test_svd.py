"""truncated_svd, head_truncated_svd, project_inputs, compare_truncations vs plain NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lowrank_jax.compress import (
    compare_truncations,
    head_truncated_svd,
    project_inputs,
    truncated_svd,
)
from lowrank_jax.errors import LeafTypeError, PlanError
from lowrank_jax.leaves import (
    Dense,
    HeadLowRank,
    LowRank,
    init_masked_binary,
    linear,
    materialize,
)


def with_spectrum(rng, m, n, sv):
    """``[m, n]`` float64 matrix with singular values ``sv`` (random orthogonal factors)."""
    k = len(sv)
    q1, _ = np.linalg.qr(rng.standard_normal((m, k)))
    q2, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return (q1 * np.asarray(sv, np.float64)) @ q2.T


def np_truncate(w, r):
    """Reference: best rank-r approximation by NumPy's SVD."""
    U, s, Vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
    return (U[:, :r] * s[:r]) @ Vt[:r]


def spec_norm(a):
    return np.linalg.norm(np.asarray(a, np.float64), 2)


def dense64(leaf):
    return np.asarray(materialize(leaf), np.float64)


# ---------------------------------------------------------------------------------------------
# truncated_svd

def test_full_rank_reproduces_float32():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((12, 20)).astype(np.float32)
    leaf = truncated_svd(w, rank=12)
    assert isinstance(leaf, LowRank) and leaf.u.dtype == jnp.float32 and leaf.rank == 12
    w_r = np.asarray(materialize(leaf))
    assert np.linalg.norm(w_r - w) / np.linalg.norm(w) <= 1e-5


def test_truncation_error_is_next_singular_value():
    rng = np.random.default_rng(1)
    sv = np.array([5.0, 3.0, 2.5, 1.0, 0.4, 0.1, 0.02, 0.01])
    w = with_spectrum(rng, 16, 10, sv).astype(np.float32)
    for r in range(1, 8):
        leaf = truncated_svd(w, rank=r)
        err = spec_norm(w.astype(np.float64) - dense64(leaf)) / spec_norm(w)
        assert abs(err - sv[r] / sv[0]) <= 1e-4, r
        # and it is the best rank-r approximation, the NumPy one
        ref = np_truncate(w, r)
        assert np.max(np.abs(dense64(leaf) - ref)) <= 1e-5 * sv[0]


def test_balanced_split():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((9, 14))
    s = np.linalg.svd(w, compute_uv=False)
    leaf = truncated_svd(w, rank=5)
    u, v = np.asarray(leaf.u, np.float64), np.asarray(leaf.v, np.float64)
    # u = U sqrt(S), v = sqrt(S) V^T  =>  u^T u = S = v v^T
    np.testing.assert_allclose(u.T @ u, np.diag(s[:5]), atol=1e-5)
    np.testing.assert_allclose(v @ v.T, np.diag(s[:5]), atol=1e-5)


def test_eps_keeps_eps_rank_and_bound():
    rng = np.random.default_rng(3)
    sv = np.array([2.0, 1.6, 1.0, 0.6, 0.2, 0.05])
    w = with_spectrum(rng, 12, 12, sv)
    for eps, expected in [(0.9, 1), (0.7, 2), (0.4, 3), (0.25, 4), (0.05, 5), (0.01, 6)]:
        leaf = truncated_svd(w, eps=eps)
        assert leaf.rank == expected == int(np.sum(sv / sv[0] > eps))
        err = spec_norm(w - dense64(leaf))
        assert err <= eps * spec_norm(w) * (1 + 1e-5)


def test_eps_keeps_at_least_one():
    w = np.outer(np.arange(1.0, 5.0), np.ones(3))  # rank 1
    leaf = truncated_svd(w, eps=0.999)
    assert leaf.rank == 1
    np.testing.assert_allclose(dense64(leaf), w, rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(2, 20), n=st.integers(2, 20), seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_property_truncation(m, n, seed, data):
    rng = np.random.default_rng(seed)
    k = min(m, n)
    sv = np.sort(rng.uniform(0.01, 10.0, size=k))[::-1]
    w = with_spectrum(rng, m, n, sv)
    r = data.draw(st.integers(1, k))
    leaf = truncated_svd(w.astype(np.float32), rank=r)
    err = spec_norm(w.astype(np.float32).astype(np.float64) - dense64(leaf)) / spec_norm(w)
    expected = sv[r] / sv[0] if r < k else 0.0
    assert abs(err - expected) <= 1e-4
    # eps truncation: exactly the eps-rank, and the guarantee
    eps = data.draw(st.floats(0.001, 0.999))
    assume(np.all(np.abs(sv / sv[0] - eps) > 1e-9))
    leaf = truncated_svd(w, eps=eps)
    assert leaf.rank == max(1, int(np.sum(sv / sv[0] > eps)))
    assert spec_norm(w - dense64(leaf)) <= eps * sv[0] * (1 + 1e-5)


def test_dense_bias_kept_and_lowrank_retruncated():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    leaf = truncated_svd(Dense(w=jnp.asarray(w), b=jnp.asarray(b)), rank=3)
    assert leaf.b is not None
    np.testing.assert_array_equal(np.asarray(leaf.b), b)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(leaf, x)), x @ np_truncate(w, 3) + b,
                               rtol=1e-4, atol=1e-5)

    u = rng.standard_normal((10, 5)).astype(np.float32)
    v = rng.standard_normal((5, 7)).astype(np.float32)
    lr = LowRank(u=jnp.asarray(u), v=jnp.asarray(v), b=jnp.asarray(b[:1].repeat(7)))
    lr2 = truncated_svd(lr, rank=2)
    ref = np_truncate(u.astype(np.float64) @ v.astype(np.float64), 2)
    np.testing.assert_allclose(dense64(lr2), ref, atol=1e-4 * spec_norm(ref))
    assert lr2.b is lr.b


def test_dtype_preserved():
    w = jnp.asarray(np.random.default_rng(5).standard_normal((6, 6)), jnp.bfloat16)
    leaf = truncated_svd(Dense(w), rank=2)
    assert leaf.u.dtype == jnp.bfloat16 and leaf.v.dtype == jnp.bfloat16


@pytest.mark.parametrize("kwargs, bad", [
    (dict(eps=0.1, rank=2), "rank=2"),
    (dict(), "eps=None"),
    (dict(eps=0.0), "0.0"),
    (dict(eps=1.0), "1.0"),
    (dict(eps=-0.5), "-0.5"),
    (dict(rank=0), "0"),
    (dict(rank=7), "7"),
    (dict(rank=2.5), "2.5"),
    (dict(rank=True), "True"),
])
def test_truncated_svd_errors(kwargs, bad):
    w = np.ones((6, 8))
    with pytest.raises(ValueError) as e:
        truncated_svd(w, path="layers/1/attn/q", **kwargs)
    msg = str(e.value)
    assert "layers/1/attn/q" in msg and bad in msg


def test_truncated_svd_bad_weights():
    with pytest.raises(ValueError, match=r"enc/w.*2-D.*\(2, 3, 4\)"):
        truncated_svd(np.ones((2, 3, 4)), rank=1, path="enc/w")
    w = np.ones((4, 4))
    w[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"enc/w.*non-finite"):
        truncated_svd(w, rank=1, path="enc/w")
    with pytest.raises(LeafTypeError, match="MaskedBinary"):  # a TypeError
        import jax

        truncated_svd(init_masked_binary(jax.random.PRNGKey(0), 4, 4, 0.5), rank=1)


def test_head_lowrank_leaf_is_retruncated_from_its_product():
    rng = np.random.default_rng(11)
    u = rng.standard_normal((9, 2, 3)).astype(np.float32)
    v = rng.standard_normal((2, 3, 4)).astype(np.float32)
    leaf = HeadLowRank(u=jnp.asarray(u), v=jnp.asarray(v), ranks=(3, 2))
    u64 = u.astype(np.float64) * (np.arange(3)[None, None, :] < np.array([3, 2])[None, :, None])
    prod = np.einsum("ihr,hrd->ihd", u64, v.astype(np.float64)).reshape(9, 8)
    np.testing.assert_allclose(dense64(truncated_svd(leaf, rank=2)), np_truncate(prod, 2),
                               atol=1e-4)


# ---------------------------------------------------------------------------------------------
# head_truncated_svd

def test_head_truncated_svd_per_head_equals_numpy():
    rng = np.random.default_rng(6)
    d_in, h, d_h = 10, 3, 4
    w = rng.standard_normal((d_in, h * d_h)).astype(np.float32)
    leaf = head_truncated_svd(w, h, rank=2)
    assert isinstance(leaf, HeadLowRank) and leaf.ranks is None
    assert leaf.u.shape == (d_in, h, 2) and leaf.v.shape == (h, 2, d_h)
    dense = dense64(leaf)
    for i in range(h):
        ref = np_truncate(w[:, i * d_h:(i + 1) * d_h], 2)
        np.testing.assert_allclose(dense[:, i * d_h:(i + 1) * d_h], ref, atol=1e-5)
    # per-head sketches beat one shared sketch of the same per-head rank ("Understanding
    # Transformers for Time Series", Thm. 6)
    shared = np_truncate(w, 2)
    assert spec_norm(w - dense) < spec_norm(w - shared)


def test_head_truncated_svd_irregular_ranks():
    rng = np.random.default_rng(7)
    d_in, d_h = 8, 5
    spectra = [[1.0, 0.1, 0.05, 0.01, 0.001],
               [1.0, 0.9, 0.8, 0.1, 0.01],
               [1.0, 0.7, 0.02, 0.01, 0.001]]
    heads = [with_spectrum(rng, d_in, d_h, s) for s in spectra]
    w = np.concatenate(heads, axis=1)
    b = rng.standard_normal(3 * d_h)
    leaf = head_truncated_svd(Dense(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)),
                              3, eps=0.5)
    expected = [int(np.sum(np.asarray(s) > 0.5)) for s in spectra]
    assert expected == [1, 3, 2]
    assert leaf.ranks == tuple(expected) and leaf.max_rank == 3
    # padding is zero and masked
    assert np.all(np.asarray(leaf.u)[:, 0, 1:] == 0) and np.all(np.asarray(leaf.v)[0, 1:] == 0)
    ref = np.concatenate([np_truncate(hd, r) for hd, r in zip(heads, expected, strict=True)],
                         axis=1)
    np.testing.assert_allclose(dense64(leaf), ref, atol=1e-5)
    x = rng.standard_normal((2, 3, d_in)).astype(np.float32)
    y = np.asarray(linear(leaf, jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(y, x @ ref + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, x @ dense64(leaf) + b.astype(np.float32), rtol=1e-5,
                               atol=1e-5)
    # each head meets its own eps guarantee
    for i, hd in enumerate(heads):
        blk = dense64(leaf)[:, i * d_h:(i + 1) * d_h]
        assert spec_norm(hd - blk) <= 0.5 * spec_norm(hd) * (1 + 1e-5)


def test_head_truncated_svd_takes_head_widths():
    rng = np.random.default_rng(12)
    w = rng.standard_normal((10, 12))
    a = head_truncated_svd(w, (4, 4, 4), rank=2)
    b = head_truncated_svd(w, 3, rank=2)
    np.testing.assert_array_equal(dense64(a), dense64(b))
    for i in range(3):
        np.testing.assert_allclose(dense64(a)[:, 4 * i:4 * (i + 1)],
                                   np_truncate(w[:, 4 * i:4 * (i + 1)], 2), atol=1e-5)
    # a HeadLowRank holds equal-width heads: a pruned block's irregular heads are refused
    with pytest.raises(PlanError, match=r"attn/qk/q.*equal width.*\(4, 5, 3\)"):
        head_truncated_svd(w, (4, 5, 3), rank=1, path="attn/qk/q")
    with pytest.raises(ValueError, match=r"attn/qk/q.*sum to 11.*d_out=12"):
        head_truncated_svd(w, (4, 4, 3), rank=1, path="attn/qk/q")


def test_head_truncated_svd_errors():
    w = np.ones((6, 10))
    with pytest.raises(ValueError, match=r"attn/q.*divides d_out=10.*got 3"):
        head_truncated_svd(w, 3, rank=1, path="attn/q")
    with pytest.raises(ValueError, match=r"attn/q.*\[1, 5\].*got 6"):
        head_truncated_svd(w, 2, rank=6, path="attn/q")
    with pytest.raises(ValueError, match=r"attn/q.*exactly one"):
        head_truncated_svd(w, 2, path="attn/q")


# ---------------------------------------------------------------------------------------------
# project_inputs and compare_truncations

def test_project_inputs_exact_on_rank_r_inputs():
    rng = np.random.default_rng(8)
    d_in, d_out, r, n = 16, 12, 4, 64
    x = (rng.standard_normal((n, r)) @ rng.standard_normal((r, d_in))).astype(np.float32)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    leaf = project_inputs(w, x.reshape(4, 16, d_in), rank=r)
    assert leaf.rank == r
    y = x.astype(np.float64) @ w
    y_proj = np.asarray(linear(leaf, jnp.asarray(x)), np.float64)
    assert np.linalg.norm(y_proj - y) / np.linalg.norm(y) <= 1e-5
    # plain weight truncation at the same rank does not preserve these outputs
    y_svd = np.asarray(linear(truncated_svd(w, rank=r), jnp.asarray(x)), np.float64)
    assert np.linalg.norm(y_svd - y) / np.linalg.norm(y) > 0.1
    # u is an orthonormal basis of the row space of x, v = u^T w
    u = np.asarray(leaf.u, np.float64)
    np.testing.assert_allclose(u.T @ u, np.eye(r), atol=1e-5)
    _, _, vt = np.linalg.svd(x.astype(np.float64), full_matrices=False)
    np.testing.assert_allclose(u @ u.T, vt[:r].T @ vt[:r], atol=1e-5)
    np.testing.assert_allclose(np.asarray(leaf.v), u.T @ w, atol=1e-5)


def test_project_inputs_eps_and_bias():
    rng = np.random.default_rng(9)
    d_in = 10
    x = with_spectrum(rng, 50, d_in, [3.0, 2.0, 1.0, 0.2, 0.1, 0.01])
    w = rng.standard_normal((d_in, 7))
    b = rng.standard_normal(7)
    leaf = project_inputs(Dense(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)), x,
                          eps=0.3)
    assert leaf.rank == 3
    assert leaf.b is not None
    with pytest.raises(ValueError, match=r"blk/w.*\[1, 7\].*got 8"):
        project_inputs(w, x, rank=8, path="blk/w")
    with pytest.raises(ValueError, match=r"blk/w.*d_in=10.*\(50, 9\)"):
        project_inputs(w, x[:, :9], rank=2, path="blk/w")


def test_compare_truncations_numbers():
    rng = np.random.default_rng(10)
    d_in, d_out, n = 12, 9, 40
    x = with_spectrum(rng, n, d_in, np.geomspace(1.0, 1e-3, d_in))
    w = rng.standard_normal((d_in, d_out))
    rows = compare_truncations(w, x, [1, 3, 6, 9])
    U, s, Vt = np.linalg.svd(w)
    _, _, xvt = np.linalg.svd(x)
    y = x @ w
    for row, r in zip(rows, [1, 3, 6, 9], strict=True):
        w_svd = (U[:, :r] * s[:r]) @ Vt[:r]
        B = xvt[:r].T
        w_proj = B @ B.T @ w
        assert row["rank"] == r
        assert row["svd_weight_error"] == pytest.approx(
            np.linalg.norm(w - w_svd, 2) / np.linalg.norm(w, 2), rel=1e-9, abs=1e-12)
        assert row["proj_weight_error"] == pytest.approx(
            np.linalg.norm(w - w_proj, 2) / np.linalg.norm(w, 2), rel=1e-9)
        assert row["svd_output_error"] == pytest.approx(
            np.linalg.norm(y - x @ w_svd) / np.linalg.norm(y), rel=1e-9, abs=1e-12)
        assert row["proj_output_error"] == pytest.approx(
            np.linalg.norm(y - x @ w_proj) / np.linalg.norm(y), rel=1e-9)
    # the input projection wins on outputs, plain SVD on the weight
    assert rows[1]["proj_output_error"] < rows[1]["svd_output_error"]
    assert rows[1]["svd_weight_error"] <= rows[1]["proj_weight_error"]
