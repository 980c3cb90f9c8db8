"""Key compression of "Partitioning Transformer Networks with Low Intercommunication", sec. III.A
(eqs. 123-136), against definitions evaluated pair by pair in NumPy."""

import numpy as np
import pytest

from lowrank_jax.compress import partitioning as pt
from lowrank_jax.errors import ConfigError, ShapeError


@pytest.fixture(scope="module")
def qk():
    rng = np.random.default_rng(0)
    mix = rng.normal(size=(6, 6)) * np.linspace(2, 0.2, 6)
    q = rng.normal(size=(30, 6)) @ mix + 0.5
    k = rng.normal(size=(25, 6)) @ mix.T - 0.3
    return q, k


def pairs_of(q, k, pairs):
    if pairs == "all":
        return [(a, b) for a in q for b in k]
    return list(zip(q, k, strict=True))


@pytest.mark.parametrize("pairs", ["all", "matched"])
def test_c_qk_is_its_definition(qk, pairs):
    q, k = qk
    if pairs == "matched":
        k = k[:25]
        q = q[:25]
    ps = pairs_of(q, k, pairs)
    e_qk = np.mean([np.outer(a, b) for a, b in ps], axis=0)
    want = np.mean([(np.outer(a, b) - e_qk) @ (np.outer(b, a) - e_qk.T) for a, b in ps], axis=0)
    np.testing.assert_allclose(pt.c_qk(q, k, pairs=pairs), want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(pt.c_k(k), np.cov(k.T, bias=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["cqk", "pca"])
def test_estimate_bound_and_exactness(qk, method):
    q, k = qk
    basis = pt.key_basis(q, k, method=method)
    u = basis.u
    np.testing.assert_allclose(u.T @ u, np.eye(6), atol=1e-12)
    exact = q @ k.T
    e_kq = np.outer(k.mean(0), q.mean(0))  # E[k q^T] over all pairs
    c = pt.c_qk(q, k)
    for num in range(7):
        fk = basis.compress(k, num)
        np.testing.assert_allclose(fk, k @ u[:, :num], atol=1e-12)  # eq. 123
        g = basis.estimate(q, fk, num)
        tail = sum(u[:, i] @ e_kq @ u[:, i] for i in range(num, 6))
        np.testing.assert_allclose(g, (q @ u[:, :num]) @ (k @ u[:, :num]).T + tail,
                                   atol=1e-10)  # eq. 124
        err = exact - g
        assert abs(err.mean()) < 1e-9  # the constant term is the tail's mean
        bound = sum(np.sqrt(u[:, i] @ c @ u[:, i]) for i in range(num, 6))  # eq. 134
        assert basis.bound[num] == pytest.approx(bound, abs=1e-10)
        assert np.abs(err).mean() <= bound + 1e-9  # eqs. 125-134, for this sample
    np.testing.assert_allclose(basis.estimate(q, basis.compress(k, 6), 6), exact, atol=1e-10)
    rel = pt.relative_logit_errors(q, k, basis, 6)
    assert np.nanmax(rel) < 1e-8


def test_c_qk_basis_minimizes_the_bound(qk):
    q, k = qk
    best = pt.key_basis(q, k, method="cqk")
    pca = pt.key_basis(q, k, method="pca")
    c = pt.c_qk(q, k)
    rand, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(6, 6)))
    for num in range(7):
        other = sum(np.sqrt(max(rand[:, i] @ c @ rand[:, i], 0.0)) for i in range(num, 6))
        assert best.bound[num] <= pca.bound[num] + 1e-10
        assert best.bound[num] <= other + 1e-10
    assert np.all(np.diff(best.eigenvalues) <= 1e-12)


def test_bad_inputs():
    with pytest.raises(ShapeError, match="same d_k"):
        pt.key_basis(np.ones((3, 4)), np.ones((3, 5)))
    with pytest.raises(ConfigError, match="method"):
        pt.key_basis(np.ones((3, 4)), np.ones((3, 4)), method="svd")
    with pytest.raises(ShapeError, match="as many queries as keys"):
        pt.c_qk(np.ones((3, 4)), np.ones((2, 4)), pairs="matched")


def test_compress_keys_plan_method():
    import jax

    import lowrank_jax as lj
    from lowrank_jax import nn
    from lowrank_jax.errors import PlanError
    from lowrank_jax.leaves.partitioned import CompressedKeys

    cfg = nn.AttentionConfig(use_bias=True)
    params = {"attn": nn.init_attention(jax.random.PRNGKey(0), cfg, d_model=8, num_heads=2)}
    x = np.random.default_rng(4).normal(size=(3, 5, 8)).astype(np.float32)
    step = lambda k: lj.Plan((lj.Step("compress_keys", (r"attn/qk$",), {"keys": k}),))  # noqa
    for num in (1, 4):
        new, report = lj.apply_plan(params, step(num), inputs={"attn/qk/q": x})
        ck = new["attn"]["qk"]
        assert isinstance(ck, CompressedKeys) and ck.num_coefficients == num
        row = report.row("attn/qk")
        assert row.kind == "compressed-keys" and row.details["bytes_per_key"] == num * 2 * 4
        # the basis and the constant are key_basis' on the calibration activations, per head
        q = np.asarray(lj.linear(params["attn"]["qk"].q, x)).reshape(-1, 2, 4)
        k = np.asarray(lj.linear(params["attn"]["qk"].k, x)).reshape(-1, 2, 4)
        logits = np.asarray(lj.attention_logits(ck, x.reshape(1, 15, 8), x.reshape(1, 15, 8)))
        for h in range(2):
            b = pt.key_basis(q[:, h], k[:, h])
            want = b.estimate(q[:, h], b.compress(k[:, h], num), num)
            np.testing.assert_allclose(logits[0, h], want, rtol=1e-4, atol=1e-4)
            err = np.abs(q[:, h] @ k[:, h].T - want).mean()
            assert err <= row.details["bound"][h] + 1e-6  # eq. 134
    assert row.error < 1e-6  # K = d_head: exact
    y = nn.apply_attention(dict(params["attn"], qk=ck), x, cfg)
    want = nn.apply_attention(params["attn"], x, cfg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=1e-5)
    with pytest.raises(PlanError, match="estimated from data"):
        lj.apply_plan(params, step(2))
