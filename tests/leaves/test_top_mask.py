"""``top_mask`` (Biprop's eq. 1 mask, selected by radix select) against NumPy: the
``keep_count`` largest ``|scores|``, ties at the threshold broken towards the lowest flat index
(``lax.top_k``'s order, which the selection replaced), NaN as the largest; float32, bfloat16
and float64 scores; eager and jit; and through ``MaskedBinary``'s forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import leaves as L


def np_top_mask(scores, keep: float) -> np.ndarray:
    """NumPy: rank |s| descending (NaN first), ties by ascending flat index, keep the first
    n - floor((1 - keep) n)."""
    a = np.abs(np.asarray(scores, np.float64)).reshape(-1)
    n = a.size
    k = n - int((1.0 - keep) * n)
    key = np.where(np.isnan(a), np.inf, a)
    nan_first = ~np.isnan(a)  # False (NaN) sorts first
    order = np.lexsort((np.arange(n), -key, nan_first))
    m = np.zeros(n)
    m[order[:k]] = 1.0
    return m.reshape(np.shape(scores))


@pytest.mark.parametrize("shape,keep", [((7, 5), 0.3), ((45, 7), 0.5), ((64, 96), 0.9),
                                        ((33, 31), 1.0), ((16, 16), 0.001), ((300, 200), 0.25)])
def test_matches_numpy_on_random_scores(shape, keep):
    s = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    want = np_top_mask(s, keep)
    got = np.asarray(L.top_mask(jnp.asarray(s), keep))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(jax.jit(L.top_mask, static_argnums=1)(
        jnp.asarray(s), keep)), want)
    assert got.sum() == L.keep_count(s.size, keep)


@pytest.mark.parametrize("keep", [0.3, 0.5, 0.77])
def test_ties_keep_the_lowest_indices_and_nan_counts_as_largest(keep):
    r = np.random.default_rng(1)
    s = r.integers(-3, 4, (40, 25)).astype(np.float32)  # many equal |s|, +-x and 0 included
    s[r.integers(0, 40, 5), r.integers(0, 25, 5)] = np.nan
    np.testing.assert_array_equal(np.asarray(L.top_mask(jnp.asarray(s), keep)),
                                  np_top_mask(s, keep))
    # the order lax.top_k gives (the previous selection), on NaN-free ties
    t = np.nan_to_num(s, nan=2.0)
    k = L.keep_count(t.size, keep)
    idx = np.asarray(jax.lax.top_k(jnp.abs(jnp.asarray(t)).reshape(-1), k)[1])
    ref = np.zeros(t.size)
    ref[idx] = 1
    np.testing.assert_array_equal(np.asarray(L.top_mask(jnp.asarray(t), keep)).reshape(-1), ref)


def test_bfloat16_and_float64_scores():
    s = np.random.default_rng(2).standard_normal((50, 20)).astype(np.float32)
    sb = jnp.asarray(s, jnp.bfloat16)  # rounding makes ties
    got = np.asarray(L.top_mask(sb, 0.4))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.astype(np.float64),
                                  np_top_mask(np.asarray(sb, np.float32), 0.4))
    with jax.enable_x64(True):
        s64 = jnp.asarray(s.astype(np.float64) + 1e-12 * np.arange(s.size).reshape(s.shape))
        got = np.asarray(L.top_mask(s64, 0.4))
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, np_top_mask(np.asarray(s64), 0.4))


def test_masked_binary_forward_uses_the_numpy_mask():
    r = np.random.default_rng(3)
    w, s = r.standard_normal((48, 24)).astype(np.float32), r.standard_normal((48, 24))
    s = s.astype(np.float32)
    mb = L.MaskedBinary(jnp.asarray(w), jnp.asarray(s), keep=0.4)
    m = np_top_mask(s, 0.4)
    alpha = np.sum(np.abs(w.astype(np.float64)) * m) / int(0.4 * w.size)
    x = r.standard_normal((5, 48)).astype(np.float32)
    want = x.astype(np.float64) @ (np.where(w >= 0, 1.0, -1.0) * alpha * m)
    np.testing.assert_allclose(np.asarray(jax.jit(L.linear)(mb, jnp.asarray(x))), want,
                               rtol=0, atol=1e-5 * np.abs(want).max())
