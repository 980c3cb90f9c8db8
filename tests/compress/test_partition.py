"""Assignment (Algorithm 1, LP), off-diagonal factors, rank rule, baselines, counts and error
bounds of "Partitioning Transformer Networks with Low Intercommunication", each against an
independent NumPy / scipy reference written here."""

import itertools

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

import lowrank_jax as lj
from lowrank_jax.compress import partitioning as pt
from lowrank_jax.compress.partitioning import counts as ct
from lowrank_jax.errors import ConfigError, ShapeError


def literal_algorithm1(D, variant):
    """Algorithm 1 of the paper, line by line (box: global argmax; prose: rows in order)."""
    D = np.array(D, dtype=float)
    d1, m = D.shape
    sets = [[] for _ in range(m)]
    for step in range(d1):
        if variant == "global":
            i, k = np.unravel_index(np.argmax(D), D.shape)  # line 3
        else:
            i, k = step, int(np.argmax(D[step]))
        sets[k].append(i)  # line 4
        D[i, :] = -np.inf  # line 5
        if len(sets[k]) == d1 // m:  # lines 6-7
            D[:, k] = -np.inf
    out = np.empty(d1, int)
    for k, s in enumerate(sets):
        out[s] = k
    return out


def objective(D, a):
    return float(D[np.arange(len(a)), a].sum())


def optimum(D):
    """The best equal split: an assignment problem with every machine repeated d1/M times."""
    d1, m = D.shape
    cost = np.repeat(D, d1 // m, axis=1)
    rows, cols = linear_sum_assignment(cost, maximize=True)
    out = np.empty(d1, int)
    out[rows] = cols // (d1 // m)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("variant", ["global", "rows"])
def test_fast_greedy_equals_literal_algorithm1(seed, variant):
    rng = np.random.default_rng(seed)
    shape = [(12, 3), (16, 4), (24, 8), (8, 2)][seed]
    D = rng.normal(size=shape)
    if seed % 2:
        D = rng.integers(0, 3, size=shape).astype(float)  # many ties
    want = literal_algorithm1(D, variant)
    np.testing.assert_array_equal(pt.algorithm1(D, variant), want)
    np.testing.assert_array_equal(pt.algorithm1_literal(D, variant), want)
    assert np.all(np.bincount(want, minlength=shape[1]) == shape[0] // shape[1])


def test_box_and_prose_variants_differ_and_lp_is_optimal_and_integral():
    rng = np.random.default_rng(0)
    D = rng.normal(size=(64, 8)) ** 2
    g, rows = pt.algorithm1(D, "global"), pt.algorithm1(D, "rows")
    assert not np.array_equal(g, rows)
    lp, z = pt.lp_assignment(D, return_solution=True)
    np.testing.assert_allclose(z, np.round(z), atol=1e-9)  # integral vertex
    assert np.all(np.round(z).sum(1) == 1) and np.all(np.round(z).sum(0) == 8)
    best = objective(D, optimum(D))
    assert objective(D, lp) == pytest.approx(best, rel=1e-12)
    assert objective(D, lp) >= max(objective(D, g), objective(D, rows)) - 1e-12
    assert pt.assignment_objective(D, lp) == pytest.approx(best, rel=1e-12)


def test_lp_against_brute_force_on_a_tiny_problem():
    D = np.random.default_rng(3).normal(size=(6, 3))
    best = max(objective(D, np.array(a)) for a in itertools.product(range(3), repeat=6)
               if np.all(np.bincount(a, minlength=3) == 2))
    assert pt.assignment_objective(D, pt.lp_assignment(D)) == pytest.approx(best, rel=1e-12)


def planted(seed=0, m=4, a=6, c=6, rank=2, noise=1e-3):
    """w = block diagonal under a hidden output permutation + rank-2 + noise (library
    orientation [d_in, d_out]); the output set each machine should get."""
    rng = np.random.default_rng(seed)
    d_in, d_out = m * a, m * c
    w = noise * rng.normal(size=(d_in, d_out))
    w += 0.3 * rng.normal(size=(d_in, rank)) @ rng.normal(size=(rank, d_out)) / np.sqrt(d_in)
    hidden = rng.permutation(d_out)
    sets = [np.sort(hidden[k * c:(k + 1) * c]) for k in range(m)]
    for k in range(m):
        w[k * a:(k + 1) * a][:, sets[k]] += rng.normal(size=(a, c))
    return w, sets


@pytest.mark.parametrize("method", ["greedy", "lp"])
def test_planted_blocks_are_recovered(method):
    w, sets = planted()
    a = pt.assign(pt.block_energy(w, 4), method)
    for k, s in enumerate(sets):
        np.testing.assert_array_equal(np.nonzero(a == k)[0], s)
    dec = pt.decompose(w, 4, assignment=method)
    new_err = np.linalg.norm(dec.w - dec.approx(2)) / np.linalg.norm(dec.w)
    svd_err = np.linalg.norm(w - pt.svd_method_matrix(w, 4, 2)) / np.linalg.norm(w)
    assert new_err < 5e-3 < 0.3 < svd_err  # noise level vs. the blocks the SVD method drops


def test_block_energy_and_traces_against_numpy():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(12, 8))
    D = pt.block_energy(w, 4)
    for i in range(8):
        for k in range(4):
            assert D[i, k] == pytest.approx(sum(w[j, i] ** 2 for j in range(3 * k, 3 * k + 3)))
    a = pt.algorithm1(D)
    tr0, tr1 = pt.machine_traces(D, a)
    for k in range(4):
        col = w[3 * k:3 * k + 3].T  # W_m' [d1, d0/M] (paper orientation)
        own = col[a == k]
        assert tr0[k] == pytest.approx(np.trace(col.T @ col))  # eq. 109
        assert tr1[k] == pytest.approx(np.trace(col.T @ col) - np.trace(own.T @ own))  # eq. 103
    assert np.all(tr1 <= tr0 + 1e-12)  # eq. 111
    np.testing.assert_array_equal(pt.machine_order(np.array([1, 0, 1, 0])), [1, 3, 0, 2])


def reference_offdiag(w_perm, m, r):
    """Per machine: W~_m' [(M-1) c, a] (paper orientation) and its rank-r truncation."""
    d_in, d_out = w_perm.shape
    a, c = d_in // m, d_out // m
    out = []
    for p in range(m):
        col = w_perm[p * a:(p + 1) * a].T
        tilde = np.concatenate([col[k * c:(k + 1) * c] for k in range(m) if k != p])
        u, s, vt = np.linalg.svd(tilde, full_matrices=False)
        out.append((tilde, (u[:, :r] * s[:r]) @ vt[:r], s))
    return out


def test_decomposition_leaf_against_numpy():
    rng = np.random.default_rng(2)
    w, b = rng.normal(size=(12, 16)), rng.normal(size=16)
    dec = pt.decompose(w, 4, bias=b)
    perm = dec.perm
    np.testing.assert_array_equal(np.sort(perm), np.arange(16))
    for k in range(4):  # machine k's outputs, in machine order
        np.testing.assert_array_equal(np.sort(perm[4 * k:4 * k + 4]),
                                      np.nonzero(dec.assignment == k)[0])
    wp = w[:, perm]
    for r in (0, 1, 3):
        leaf = dec.leaf(r)
        got = lj.materialize_host(leaf)
        ref = reference_offdiag(wp, 4, r)
        for p in range(4):
            np.testing.assert_allclose(got[3 * p:3 * p + 3, 4 * p:4 * p + 4],
                                       wp[3 * p:3 * p + 3, 4 * p:4 * p + 4], atol=1e-6)
            blocks = [got[3 * p:3 * p + 3, 4 * k:4 * k + 4].T for k in range(4) if k != p]
            np.testing.assert_allclose(np.concatenate(blocks), ref[p][1], atol=1e-5)
            tail = np.linalg.norm(ref[p][0] - ref[p][1])  # Eckart-Young: the tail energy
            assert tail == pytest.approx(np.sqrt(np.sum(ref[p][2][r:] ** 2)), rel=1e-9)
        np.testing.assert_allclose(np.asarray(leaf.bias), b[perm], rtol=1e-6)
        assert leaf.rank == r
    assert dec.max_rank == 3  # d* = min((M - 1) d1 / M, d0 / M) = min(12, 3), eq. 75
    assert dec.error(3) < 1e-12
    s_max = np.linalg.norm(wp - dec.approx(1), 2) / np.linalg.norm(wp, 2)
    assert dec.error(1) == pytest.approx(s_max, rel=1e-12)


def test_rank_rule_and_its_guarantee():
    rng = np.random.default_rng(4)
    w = rng.normal(size=(16, 16)) * np.linspace(1, 0.01, 16)
    dec = pt.decompose(w, 4)
    x = rng.normal(size=(50, 16))
    for eps in (3.0, 1.0, 0.3, 0.05):
        r = pt.rank_for_eps(dec.sigma, eps, 4)
        s = np.concatenate([dec.sigma, np.zeros((4, 1))], axis=1)
        want = min(k for k in range(s.shape[1]) if s[:, k].max() <= eps / 2.0)  # eqs. 100-101
        assert r == want
        delta = np.linalg.norm(x @ (dec.w - dec.approx(r)), axis=1)
        assert np.all(delta <= eps * np.linalg.norm(x, axis=1) + 1e-12)  # eq. 92
    assert dec.rank_for_eps(0.1, relative=True) == pt.rank_for_eps(
        dec.sigma, 0.1 * np.linalg.norm(dec.w, 2), 4)
    with pytest.raises(ConfigError, match="eps"):
        pt.rank_for_eps(dec.sigma, 0.0, 4)


def test_baselines_against_numpy():
    rng = np.random.default_rng(5)
    w = rng.normal(size=(12, 10))
    got = pt.svd_method_matrix(w, 3, 2)
    for p in range(3):
        u, s, vt = np.linalg.svd(w[4 * p:4 * p + 4].T, full_matrices=False)  # W_m' (eq. 18)
        np.testing.assert_allclose(got[4 * p:4 * p + 4].T, (u[:, :2] * s[:2]) @ vt[:2],
                                   atol=1e-12)
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    np.testing.assert_allclose(pt.full_svd_matrix(w, 6), (u[:, :6] * s[:6]) @ vt[:6], atol=1e-12)
    x = rng.normal(size=(7, 12))
    want = np.linalg.norm(x @ (w - got), axis=1) / np.linalg.norm(x @ w, axis=1)
    np.testing.assert_allclose(pt.relative_output_errors(w, got, x), want, rtol=1e-12)


def test_error_bounds_hold_per_sample():
    rng = np.random.default_rng(6)
    w = rng.normal(size=(16, 24))
    dec = pt.decompose(w, 4)
    x = rng.normal(size=(40, 16)) * rng.uniform(0.1, 3, size=(40, 1))
    for r in (0, 1, 2, 3):
        t = pt.error_terms(dec, r, x)
        ref = reference_offdiag(dec.w, 4, r)
        for p in range(4):  # eq. 80: ||Delta_m'|| is the off-diagonal residual applied to x_m'
            direct = np.linalg.norm(x[:, 4 * p:4 * p + 4] @ (ref[p][0] - ref[p][1]).T, axis=1)
            np.testing.assert_allclose(t["delta_m"][:, p], direct, rtol=1e-9, atol=1e-12)
        direct = np.linalg.norm(x @ (dec.w - dec.approx(r)), axis=1)
        np.testing.assert_allclose(t["delta"], direct, rtol=1e-12)
        tol = 1e-9
        assert np.all(t["delta_m"] <= t["eq83"] + tol)  # eq. 83
        assert np.all(t["delta"] <= t["delta_m"].sum(1) + tol)  # eq. 84
        assert np.all(t["delta_m"].sum(1) <= t["eq85"] + tol)  # eq. 85
        assert np.all(t["eq85"] <= t["eq86"] + tol)  # eq. 86
        assert np.all(t["eq85"] <= t["eq90"] + tol)  # eqs. 87-90 (Jensen)
        assert np.all(t["eq90"] <= t["eq92"] + tol)  # eq. 92
        assert np.all(t["rel"] <= t["eq94"] + tol)  # eq. 94
    assert np.all(dec.sigma[:, 0] <= dec.sigma0[:, 0] + 1e-12)  # eq. 112


def test_counts_equal_the_equations():
    d0, d1, m, r = 3072, 3072, 32, 10
    kappa, gamma = ct.kappa_gamma(d0, d1, m, r)
    d = d0
    # the worked numbers (Fig. 4's setting at r = 10)
    assert ct.n2_new(d0, d1, m, r) == 1_277_952
    assert ct.n1_svd_method(d0, d1, m, r) == 1_013_760
    assert ct.n0_full_svd(d0, d1, m, r) == 1_966_080
    assert ct.flops_new_machine(d0, d1, m, r) == 81_024
    for d0, d1, m, r in [(3072, 3072, 32, 10), (64, 256, 8, 3), (256, 64, 4, 5)]:
        kappa, gamma = ct.kappa_gamma(d0, d1, m, r)
        d = d0
        assert ct.comm_new(r) == ct.comm_baseline_regular(r) == r  # eqs. 23, 34
        assert ct.comm_baseline_central(d1) == d1  # eq. 24
        assert ct.storage_baseline_total(d0, d1, m, r) == pytest.approx(
            (m - 1) * ct.storage_baseline_regular(d0, m, r)
            + ct.storage_baseline_central(d0, d1, m, r))  # eq. 37 = 35 + 36
        assert ct.storage_baseline_total_eq40(d, kappa, gamma, m) == pytest.approx(
            r * d0 + (m * r + 1) * d1)  # eq. 40
        assert ct.storage_new_total(d0, d1, m, r) == pytest.approx(
            m * ct.storage_new_machine(d0, d1, m, r))  # eq. 43 = M x eq. 42
        assert ct.storage_new_total_eq44(d, kappa, gamma, m) == pytest.approx(
            d0 * d1 / m + r * d0 + (m - 1) * r * d1 + d1)  # eq. 44
        assert ct.flops_baseline_total(d0, d1, m, r) == pytest.approx(
            (m - 1) * ct.flops_baseline_regular(d0, m, r)
            + ct.flops_baseline_central(d0, d1, m, r))  # eq. 48 = 46 + 47
        eq48 = 2 * r * d0 + 2 * m * r * d1 + m * d1
        assert ct.flops_baseline_total_eq49_corrected(d, kappa, gamma, m, r) == pytest.approx(eq48)
        assert ct.flops_baseline_total_eq49(d, kappa, gamma, m, r) != pytest.approx(eq48)
        assert ct.flops_new_total(d0, d1, m, r) == pytest.approx(
            m * ct.flops_new_machine(d0, d1, m, r))  # eq. 52 = M x eq. 51
        assert ct.flops_new_total_eq53(d, kappa, gamma, m, r) == pytest.approx(
            2 * d0 * d1 / m + 2 * (m - 1) * r * d1 + m * d1)  # eq. 53
        assert ct.n0_gamma(d, kappa, gamma) == pytest.approx(m * r * (d0 + d1))  # eq. 60
        assert ct.n1_gamma(d, kappa, gamma, m) == pytest.approx(m * r * (d0 / m + d1))  # 61
        assert ct.n2_gamma(d, kappa, gamma, m) == pytest.approx(
            d1 * d0 / m + (m - 1) * d1 * r + r * d0)  # eq. 62 = eq. 59
        assert ct.storage_new_total(d0, d1, m, r) - d1 == pytest.approx(
            ct.n2_new(d0, d1, m, r))  # N2 is eq. 43 without the bias
        e = ct.executed(d0, d1, m, r)
        # eq. 51 leaves out the message's 2 r d0 / M (eq. 29); what runs has it
        assert e.flops_machine == pytest.approx(ct.flops_new_machine(d0, d1, m, r)
                                                + 2 * r * d0 / m)
        assert e.params_machine == pytest.approx(ct.storage_new_machine(d0, d1, m, r))
        assert e.macs_total == pytest.approx(ct.n2_new(d0, d1, m, r))
        assert e.sent == r and e.received == (m - 1) * r
    # Fig. 4: kappa = 1, gamma = 1/3, as fractions of d^2
    for m in (2, 8, 64):
        d = 96 * m
        r = d // (3 * m)
        assert ct.n0_full_svd(d, d, m, r) / d**2 == pytest.approx(2 / 3)
        assert ct.n1_svd_method(d, d, m, r) / d**2 == pytest.approx((1 + 1 / m) / 3)
        assert ct.n2_new(d, d, m, r) / d**2 == pytest.approx(1 / 3 + 1 / m)


def test_leaf_counts_equal_the_equations():
    rng = np.random.default_rng(7)
    w, b = rng.normal(size=(16, 24)), rng.normal(size=24)
    leaf = pt.decompose(w, 4, bias=b).leaf(3)
    assert leaf.param_count() == ct.storage_new_total(16, 24, 4, 3)  # eq. 43
    assert leaf.flops(5) == 5 * ct.n2_new(16, 24, 4, 3)  # eq. 59 multiply-adds per token
    assert leaf.bytes_sent(1) == 3 * 4  # eq. 34: r float32 numbers


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ShapeError, match="d_in = 10 is not divisible by machines = 4"):
        pt.block_energy(np.ones((10, 8)), 4)
    with pytest.raises(ConfigError, match="variant"):
        pt.algorithm1(np.ones((4, 2)), "columns")
    with pytest.raises(ConfigError, match="assignment must be one of"):
        pt.assign(np.ones((4, 2)), "random")
    with pytest.raises(ShapeError, match="every machine 2 outputs"):
        pt.decompose(np.ones((4, 4)), 2, assignment=np.array([0, 0, 0, 1]))
