"""CP-ALS and the error-preserving correction against tensorly and plain NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.decomp import cp_als, cp_epc, cp_to_tensor, init_cp, mttkrp, unfold
from lowrank_jax.errors import ConfigError, ShapeError

tl = pytest.importorskip("tensorly")
from tensorly.decomposition import parafac  # noqa: E402


def planted(seed: int, shape=(20, 20, 4), rank: int = 6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.einsum("ir,jr,kr->ijk", *[rng.normal(size=(d, rank)) for d in shape])


@pytest.fixture(scope="module")
def noisy():
    t = planted(10, (12, 10, 5), 3)
    return t + 0.1 * np.random.default_rng(11).normal(size=t.shape)


def test_cp_to_tensor_mttkrp_unfold_against_tensorly():
    rng = np.random.default_rng(0)
    w = rng.uniform(0.5, 2, size=3)
    fs = [rng.normal(size=(d, 3)) for d in (4, 5, 6)]
    np.testing.assert_allclose(np.asarray(cp_to_tensor(jnp.asarray(w), [jnp.asarray(f) for f in fs])),
                               tl.cp_to_tensor((w, fs)), rtol=1e-5, atol=1e-5)
    t = rng.normal(size=(4, 5, 6))
    for mode in range(3):
        np.testing.assert_allclose(np.asarray(unfold(jnp.asarray(t), mode)), tl.unfold(t, mode),
                                   atol=1e-6)
        want = tl.unfold(t, mode) @ tl.tenalg.khatri_rao(fs, skip_matrix=mode)
        np.testing.assert_allclose(np.asarray(mttkrp(jnp.asarray(t), fs, mode)), want, rtol=1e-4,
                                   atol=1e-4)


def test_svd_init_as_tensorly(noisy):
    _, ours = init_cp(jnp.asarray(noisy, jnp.float32), 3)
    ref = tl.decomposition._cp.initialize_cp(noisy, 3, init="svd")
    for a, b in zip(ours, ref.factors, strict=True):  # singular vectors are defined up to sign
        np.testing.assert_allclose(np.abs(np.asarray(a)), np.abs(b), rtol=1e-4, atol=1e-4)


def test_same_errors_as_tensorly_from_the_same_initialisation(noisy):
    _, init = init_cp(jnp.asarray(noisy, jnp.float32), 4)  # mode 2 (5) >= 4: no random columns
    start = [np.asarray(f, np.float64) for f in init]
    (_, ref_f), ref_err = parafac(noisy, 4, init=(np.ones(4), [f.copy() for f in start]),
                                  n_iter_max=25, tol=0, return_errors=True)
    res = cp_als(jnp.asarray(noisy, jnp.float32), 4, init=(None, init), n_iter_max=25, tol=0.0)
    assert int(res.n_iter) == 25
    # float32 against float64, along the whole history
    np.testing.assert_allclose(np.asarray(res.errors), np.asarray(ref_err), atol=1e-4)
    ours = np.asarray(cp_to_tensor(res.weights, res.factors), np.float64)
    np.testing.assert_allclose(ours, tl.cp_to_tensor((np.ones(4), ref_f)), atol=1e-3)
    # the reported error is the error of the returned factors
    np.testing.assert_allclose(float(res.errors[-1]),
                               np.linalg.norm(noisy - ours) / np.linalg.norm(noisy), rtol=1e-4)
    assert np.all(np.diff(np.asarray(res.errors)) <= 1e-6)  # ALS never increases the error


def test_stops_on_tolerance_and_pads_history_with_nan(noisy):
    res = cp_als(jnp.asarray(noisy, jnp.float32), 4, n_iter_max=25, tol=1e-4)
    n = int(res.n_iter)
    errs = np.asarray(res.errors)
    assert 1 < n < 25
    assert abs(errs[n - 2] - errs[n - 1]) < 1e-4 and np.all(np.abs(np.diff(errs[:n - 1])) >= 1e-4)
    assert np.all(np.isnan(errs[n:]))


def test_recovers_planted_rank_over_a_vmapped_batch():
    batch = jnp.asarray(np.stack([planted(s) for s in range(5)]), jnp.float32)
    run = jax.vmap(lambda t: cp_als(t, 6, n_iter_max=300, tol=1e-9, linesearch=True))
    res = run(batch)
    final = [float(res.errors[i, int(res.n_iter[i]) - 1]) for i in range(5)]
    # float32 resolves about 2e-7; tensorly from random starts recovers 4 of 5 (float64)
    assert sum(e < 1e-5 for e in final) >= 4, final
    for i in range(5):  # each tensor's factors rebuild it (NumPy), each stops on its own
        rec = np.einsum("ir,jr,kr->ijk", *[np.asarray(f[i], np.float64) for f in res.factors])
        np.testing.assert_allclose(np.linalg.norm(rec - np.asarray(batch[i])) /
                                   np.linalg.norm(np.asarray(batch[i])), final[i], rtol=1e-2,
                                   atol=1e-6)
    assert len(set(np.asarray(res.n_iter).tolist())) > 1


def numpy_als(t, factors, l2, sweeps):
    """Regularised normal-equation ALS with column balancing, written plainly."""
    def balance(fs):
        norms = np.stack([np.linalg.norm(f, axis=0) for f in fs])
        g = np.exp(np.log(norms).mean(0))
        return [f * (g / n) for f, n in zip(fs, norms, strict=True)]

    fs = balance([np.asarray(f, np.float64) for f in factors])
    v_r = range(fs[0].shape[1])
    for _ in range(sweeps):
        for m in range(3):
            others = [fs[i] for i in range(3) if i != m]
            v = (others[0].T @ others[0]) * (others[1].T @ others[1]) + l2 * np.eye(len(v_r))
            kr = tl.tenalg.khatri_rao(fs, skip_matrix=m)
            fs[m] = np.linalg.solve(v.T, (tl.unfold(t, m) @ kr).T).T
        fs = balance(fs)
    return fs


def test_l2_regularisation_against_numpy(noisy):
    _, init = init_cp(jnp.asarray(noisy, jnp.float32), 4)
    res = cp_als(jnp.asarray(noisy, jnp.float32), 4, init=(None, init), n_iter_max=25, tol=0.0,
                 l2_reg=0.05)
    want = numpy_als(noisy, init, 0.05, 25)
    for a, b in zip(res.factors, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-4)
    plain = cp_als(jnp.asarray(noisy, jnp.float32), 4, init=(None, init), n_iter_max=25, tol=0.0)
    assert sum(float(jnp.sum(f * f)) for f in res.factors) < sum(
        float(jnp.sum(f * f)) for f in plain.factors)


def test_epc_removes_cancelling_terms_within_the_error_bound():
    """A rank-3 model plus two huge rank-1 terms that cancel: the same tensor, enormous norms.
    The correction keeps the error within delta and shrinks the factors."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        good = [rng.normal(size=(d, 3)) for d in (9, 8, 7)]
        t = np.einsum("ir,jr,kr->ijk", *good) + 0.05 * rng.normal(size=(9, 8, 7))
        big = [rng.normal(size=(d, 1)) * 20 for d in (9, 8, 7)]
        bad = [np.concatenate([g, b, b * (-1 if m == 0 else 1)], 1)
               for m, (g, b) in enumerate(zip(good, big, strict=True))]
        delta = np.linalg.norm(t - tl.cp_to_tensor((np.ones(5), bad)))
        res = cp_epc(jnp.asarray(t), None, [jnp.asarray(f) for f in bad], n_iter_max=200)
        fs = [np.asarray(f) for f in res.factors]
    err = np.linalg.norm(t - tl.cp_to_tensor((np.ones(5), fs)))
    assert err <= delta * (1 + 1e-9)
    before = sum(np.sum(f * f) for f in bad)
    after = sum(np.sum(f * f) for f in fs)
    assert after < 0.05 * before, (before, after)


def test_bad_inputs_name_the_parameter():
    t = jnp.ones((3, 4, 5))
    with pytest.raises(ConfigError, match="rank must be an int >= 1, got 0"):
        cp_als(t, 0)
    with pytest.raises(ShapeError, match=r"factor 1 must have shape \(4, 2\), got \(3, 2\)"):
        cp_als(t, 2, init=(None, [jnp.ones((3, 2)), jnp.ones((3, 2)), jnp.ones((5, 2))]))
    with pytest.raises(ShapeError, match="at least 2 modes"):
        cp_als(jnp.ones(4), 1)
    with pytest.raises(ConfigError, match="init must be"):
        cp_als(t, 2, init="hosvd")
