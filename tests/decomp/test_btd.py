"""BTD-(L,L,1) (Algorithms 1-3 of "Vision Transformer with Irregular Attention") against NumPy.

Runs in float64 (``jax.enable_x64``), as the compression methods do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.decomp import BTDResult, btd_from_cp, btd_ll1, btd_to_tensor, fit_term
from lowrank_jax.errors import ConfigError

RANKS = (2, 3, 5, 6)  # planted per-head ranks
SIZE = 20


def planted_btd(seed: int, ranks=RANKS, c=None):
    rng = np.random.default_rng(seed)
    a = [rng.normal(size=(SIZE, r)) for r in ranks]
    b = [rng.normal(size=(SIZE, r)) for r in ranks]
    c = np.eye(len(ranks)) if c is None else c
    t = sum(np.einsum("ij,k->ijk", a[h] @ b[h].T, c[:, h]) for h in range(len(ranks)))
    return t, a, b


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def numpy_term_error(t, res: BTDResult) -> float:
    a, b, c = (np.asarray(x, np.float64) for x in (res.a, res.b, res.c))
    rec = np.einsum("til,tjl,kt->ijk", a, b, c)
    return float(np.linalg.norm(t - rec) / np.linalg.norm(t))


def test_btd_to_tensor_against_numpy():
    rng = np.random.default_rng(0)
    a, b, c = rng.normal(size=(3, 5, 2)), rng.normal(size=(3, 4, 2)), rng.normal(size=(6, 3))
    want = sum(np.einsum("ij,k->ijk", a[t] @ b[t].T, c[:, t]) for t in range(3))
    np.testing.assert_allclose(np.asarray(btd_to_tensor(a, b, c)), want, atol=1e-12)


def test_algorithm2_fits_one_exact_term_in_one_iteration():
    rng = np.random.default_rng(1)
    a, b, c = rng.normal(size=(SIZE, 4)), rng.normal(size=(SIZE, 4)), rng.normal(size=5)
    t = np.einsum("ij,k->ijk", a @ b.T, c)
    res = fit_term(jnp.asarray(t), 4, n_iter_max=15, tol=0.0)
    assert float(res.errors[0]) < 1e-10  # after the first iteration
    assert numpy_term_error(t, res) < 1e-10
    # c is the unit vector along the true c (up to sign)
    np.testing.assert_allclose(np.abs(np.asarray(res.c[:, 0])), np.abs(c) / np.linalg.norm(c),
                               atol=1e-10)


def test_algorithm2_error_never_increases_on_a_noisy_tensor():
    rng = np.random.default_rng(2)
    t = rng.normal(size=(SIZE, SIZE, 4))
    res = fit_term(jnp.asarray(t), 4, n_iter_max=15, tol=0.0)
    errs = np.asarray(res.errors)
    assert np.all(np.diff(errs) <= 1e-12)
    assert numpy_term_error(t, res) == pytest.approx(errs[-1], rel=1e-10)


def permuted_cp(seed: int):
    """An exact CP model of a C = I block-term tensor, columns shuffled and rescaled (no ALS)."""
    t, a, b = planted_btd(seed)
    rng = np.random.default_rng(seed + 100)
    fa, fb = np.concatenate(a, 1), np.concatenate(b, 1)
    fc = np.concatenate([np.outer(np.eye(len(RANKS))[:, h], np.ones(r))
                         for h, r in enumerate(RANKS)], 1)
    perm = rng.permutation(fa.shape[1])
    scale = rng.uniform(0.5, 2.0, fa.shape[1]) * rng.choice([-1.0, 1.0], fa.shape[1])
    return t, fa[:, perm] / scale, fb[:, perm], fc[:, perm] * scale


def test_algorithm1_recovers_planted_ranks_and_algorithm3_converges_in_one_sweep():
    t, fa, fb, fc = permuted_cp(3)
    # a cap that does not bind gives Algorithm 1's assignment
    init = btd_from_cp(None, [jnp.asarray(fa), jnp.asarray(fb), jnp.asarray(fc)], max_rank=6)
    assert tuple(np.asarray(init.ranks)) == RANKS
    np.testing.assert_array_equal(np.asarray(init.c), np.eye(4))
    assert numpy_term_error(t, init) < 1e-12
    res = btd_ll1(jnp.asarray(t), init=init, n_iter_max=20)
    assert float(res.errors[0]) < 1e-8  # after one sweep
    assert numpy_term_error(t, res) < 1e-8


def test_algorithm1_cap_redistributes_columns():
    t, fa, fb, fc = permuted_cp(4)
    init = btd_from_cp(None, [jnp.asarray(fa), jnp.asarray(fb), jnp.asarray(fc)], max_rank=4)
    ranks = np.asarray(init.ranks)
    assert ranks.max() <= 4 and ranks.sum() == sum(RANKS)
    assert init.a.shape == (4, SIZE, 4)
    with pytest.raises(ConfigError, match="do not fit"):
        btd_from_cp(None, [jnp.asarray(fa), jnp.asarray(fb), jnp.asarray(fc)], max_rank=3)


def test_full_pipeline_from_cp_recovers_a_planted_tensor():
    t, _, _ = planted_btd(5)
    res = btd_ll1(jnp.asarray(t), sum(RANKS), max_rank=6, n_iter_max=20, tol=1e-12)
    assert sorted(np.asarray(res.ranks).tolist()) == sorted(RANKS)
    n = int(res.n_iter)
    errs = np.asarray(res.errors)[:n]
    assert numpy_term_error(t, res) < 1e-6
    assert errs[-1] == pytest.approx(numpy_term_error(t, res), rel=1e-6, abs=1e-12)
    # warm-started sweeps never increase the residual
    assert np.all(np.diff(errs) <= 1e-12 * max(1.0, errs[0]))


def test_slices_init_is_truncatt_and_sweeps_improve_on_it():
    t, _, _ = planted_btd(6, c=np.eye(4) + 0.3 * np.random.default_rng(7).normal(size=(4, 4)))
    t = t + 0.01 * np.random.default_rng(8).normal(size=t.shape)
    ranks = (1, 2, 4, 6)
    tail = sum(float(np.sum(np.linalg.svd(t[:, :, h], compute_uv=False)[r:] ** 2))
               for h, r in enumerate(ranks))
    truncatt = np.sqrt(tail) / np.linalg.norm(t)
    res = btd_ll1(jnp.asarray(t), init="slices", ranks=ranks, n_iter_max=20, tol=0.0)
    errs = np.asarray(res.errors)
    assert errs[0] <= truncatt + 1e-12  # the first sweep starts from per-slice truncated SVDs
    assert np.all(np.diff(errs) <= 1e-12)
    assert errs[-1] < 0.9 * truncatt  # mixing the terms across slices helps here
    assert tuple(np.asarray(res.ranks)) == ranks


def test_rank_zero_term_is_zero_and_finite():
    t, _, _ = planted_btd(9)
    res = btd_ll1(jnp.asarray(t), init="slices", ranks=(0, 3, 5, 6), n_iter_max=20)
    for x in (res.a, res.b, res.c, res.errors[: int(res.n_iter)]):
        assert bool(jnp.all(jnp.isfinite(x)))
    assert float(jnp.abs(res.a[0]).max()) == 0.0 and float(jnp.abs(res.b[0]).max()) == 0.0
    # padded columns of every term stay exactly zero
    for h, r in enumerate((0, 3, 5, 6)):
        assert float(jnp.abs(res.a[h][:, r:]).max(initial=0.0)) == 0.0


def mixed_tensor(seed: int):
    """A block-term tensor whose fusion matrix mixes the terms, plus noise: the terms of the
    other slices would fit part of any slice."""
    rng = np.random.default_rng(seed)
    t, _, _ = planted_btd(seed, c=np.eye(4) + 0.3 * rng.normal(size=(4, 4)))
    return t + 0.01 * rng.normal(size=t.shape)


def test_rank_zero_slice_is_held_at_zero_and_printed_algorithm_leaks_into_it():
    t = mixed_tensor(12)
    ranks = (0, 3, 5, 6)
    res = btd_ll1(jnp.asarray(t), init="slices", ranks=ranks, n_iter_max=20, tol=0.0)
    c = np.asarray(res.c)
    assert np.all(c[0] == 0.0)  # row 0 of C: exactly zero in every term
    np.testing.assert_allclose(np.linalg.norm(c[:, 1:], axis=0), 1.0, rtol=1e-12)
    rec = np.einsum("til,tjl,kt->ijk", *(np.asarray(x, np.float64) for x in (res.a, res.b, res.c)))
    assert np.all(rec[:, :, 0] == 0.0)  # the model's slice 0 is exactly zero
    errs = np.asarray(res.errors)
    assert np.all(np.diff(errs) <= 1e-12)  # still monotone under the constraint
    # Algorithm 3 as printed: the other terms fit part of slice 0
    free = btd_ll1(jnp.asarray(t), init="slices", ranks=ranks, n_iter_max=20, tol=0.0,
                   zero_empty=False)
    assert np.abs(np.asarray(free.c)[0]).max() > 1e-2
    assert float(free.errors[-1]) < errs[-1]


def test_held_slice_is_the_same_problem_as_the_tensor_without_it():
    """With slice 0 held at zero, the sweeps solve the BTD of the other slices: the same
    factors as an unconstrained run on ``T[:, :, 1:]`` (three terms), and
    ``err^2 ||T||^2 = err_sub^2 ||T_sub||^2 + ||T_0||^2``."""
    t = mixed_tensor(13)
    ranks = (0, 3, 5, 6)
    res = btd_ll1(jnp.asarray(t), init="slices", ranks=ranks, n_iter_max=15, tol=0.0)
    sub = btd_ll1(jnp.asarray(t[:, :, 1:]), init="slices", ranks=ranks[1:], n_iter_max=15,
                  tol=0.0, zero_empty=False)
    np.testing.assert_allclose(np.asarray(res.c)[1:, 1:], np.asarray(sub.c), atol=1e-10)
    np.testing.assert_allclose(np.asarray(btd_to_tensor(res.a[1:], res.b[1:], res.c[1:, 1:])),
                               np.asarray(btd_to_tensor(sub.a, sub.b, sub.c)), atol=1e-10)
    n, n_sub, n0 = (np.linalg.norm(x) for x in (t, t[:, :, 1:], t[:, :, 0]))
    np.testing.assert_allclose(np.asarray(res.errors) ** 2 * n ** 2,
                               np.asarray(sub.errors) ** 2 * n_sub ** 2 + n0 ** 2, rtol=1e-10)


def test_held_rows_from_algorithm1_and_a_general_start():
    """Algorithm 1 at a total rank below the number of slices leaves terms empty: their slices
    stay zero. A start whose C has weight in a held row loses it; a live term whose start lies
    wholly in held rows restarts from its own slice (no zero c, no NaN)."""
    t = mixed_tensor(14)
    res = btd_ll1(jnp.asarray(t), 2, n_iter_max=10)
    ranks = np.asarray(res.ranks)
    assert int((ranks == 0).sum()) >= 2
    c = np.asarray(res.c)
    assert np.all(c[ranks == 0] == 0.0)
    start = btd_ll1(jnp.asarray(t), init="slices", ranks=(0, 3, 5, 6), n_iter_max=1,
                    zero_empty=False)
    c0 = np.asarray(start.c).copy()
    c0[:, 1] = np.eye(4)[0]  # term 1 starts wholly in the held row 0
    start = start._replace(c=jnp.asarray(c0))
    res = btd_ll1(jnp.asarray(t), init=start, n_iter_max=10, tol=0.0)
    c = np.asarray(res.c)
    assert np.all(np.isfinite(c)) and np.all(c[0] == 0.0)
    assert np.linalg.norm(c[:, 1]) == pytest.approx(1.0)


def test_vmap_over_a_batch_equals_single_runs():
    ts = jnp.asarray(np.stack([planted_btd(s)[0] + 0.1 * np.random.default_rng(s).normal(
        size=(SIZE, SIZE, 4)) for s in (10, 11)]))
    run = jax.vmap(lambda x: btd_ll1(x, init="slices", ranks=(2, 2, 3, 6), n_iter_max=20,
                                     tol=0.0))
    batched = run(ts)
    single = btd_ll1(ts[1], init="slices", ranks=(2, 2, 3, 6), n_iter_max=20, tol=0.0)
    np.testing.assert_allclose(np.asarray(batched.errors[1]), np.asarray(single.errors),
                               rtol=1e-10)
    np.testing.assert_allclose(np.asarray(btd_to_tensor(batched.a[1], batched.b[1], batched.c[1])),
                               np.asarray(btd_to_tensor(single.a, single.b, single.c)), atol=1e-10)


def test_bad_inputs():
    with pytest.raises(ConfigError, match="needs the total rank"):
        btd_ll1(jnp.ones((4, 4, 2)))
    with pytest.raises(ConfigError, match="ranks, one per slice"):
        btd_ll1(jnp.ones((4, 4, 2)), init="slices", ranks=(1,))
    with pytest.raises(ConfigError, match="rank must be an int >= 0"):
        fit_term(jnp.ones((4, 4, 2)), -1)
    one = fit_term(jnp.ones((4, 4, 2)), 1)  # one term for two slices
    with pytest.raises(ConfigError, match="zero_empty pairs term t with frontal slice t"):
        btd_ll1(jnp.ones((4, 4, 2)), init=one)
    with pytest.raises(ConfigError, match="zero_empty must be a bool"):
        btd_ll1(jnp.ones((4, 4, 2)), init="slices", ranks=(1, 1), zero_empty=1)
