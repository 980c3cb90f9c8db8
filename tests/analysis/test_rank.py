"""eps-rank, spectra and embeddings against NumPy constructions with known spectra."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.analysis import (
    analyze,
    chebyshev_embedding,
    embedding_rank,
    eps_rank,
    hidden_state_ranks,
    normalized_spectrum,
    output_head_widths,
    sample_patches,
    singular_values,
    weight_ranks,
)


def with_spectrum(s, m, n, seed=0):
    r = np.random.default_rng(seed)
    a, _ = np.linalg.qr(r.normal(size=(m, len(s))))
    b, _ = np.linalg.qr(r.normal(size=(n, len(s))))
    return (a * np.asarray(s)) @ b.T


def test_eps_rank_prescribed_spectrum():
    s = np.array([10.0, 5.0, 1.0, 0.2, 0.05, 0.001])
    w = with_spectrum(s, 20, 12).astype(np.float32)
    # sigma_j / sigma_1 = 1, .5, .1, .02, .005, .0001
    assert eps_rank(w, 0.6) == 1
    assert eps_rank(w, 0.3) == 2
    assert eps_rank(w, 0.05) == 3
    assert eps_rank(w, 0.01) == 4
    assert eps_rank(w, [0.3, 0.003]) == [2, 5]
    np.testing.assert_allclose(normalized_spectrum(w)[:6], s / s[0], rtol=1e-5, atol=1e-7)


def test_eps_rank_of_leaves_uses_the_product():
    r = np.random.default_rng(1)
    leaf = lj.LowRank(
        jnp.asarray(r.normal(size=(16, 3)), jnp.float32),
        jnp.asarray(r.normal(size=(3, 10)), jnp.float32),
    )
    assert eps_rank(leaf, 1e-4) == 3


@pytest.mark.parametrize("eps", [0.0, 1.0, -0.1, 2])
def test_eps_out_of_range(eps):
    with pytest.raises(ValueError, match=r"eps must be .* \(0, 1\), got"):
        eps_rank(np.eye(3), eps)


def test_non_2d_names_the_parameter():
    with pytest.raises(
        ValueError, match=r"layers/0/attn/q: expected a 2-D matrix, got shape \(3,\)"
    ):
        singular_values(np.ones(3), name="layers/0/attn/q")


@pytest.mark.parametrize("k", [1, 3, 8])
def test_chebyshev_embedding_is_rank_k_and_chebyshev(k):
    x = np.linspace(-15, 15, 400)
    emb = chebyshev_embedding(x, k, 64, key=jax.random.PRNGKey(0))
    assert emb.shape == (400, 64)
    assert eps_rank(emb, 1e-5) == k
    # Independent reference: T_j(t) = cos(j arccos t); emb = F @ U^T with orthonormal U.
    t = x / 15.0
    f = np.stack([np.cos(j * np.arccos(t)) for j in range(1, k + 1)], axis=1)
    ut, *_ = np.linalg.lstsq(f, emb.astype(np.float64), rcond=None)  # [k, d]
    np.testing.assert_allclose(f @ ut, emb, atol=1e-5)
    np.testing.assert_allclose(ut @ ut.T, np.eye(k), atol=1e-5)


def test_embedding_rank_and_patches():
    s = np.array([4.0, 2.0, 0.5, 1e-4])
    emb = with_spectrum(s, 200, 32)
    out = embedding_rank(emb, eps=(0.1, 1e-3))
    assert out["eps_rank"] == {0.1: 3, 1e-3: 3}
    np.testing.assert_allclose(out["singular_values"][:4], s, rtol=1e-6)
    p = sample_patches([np.arange(35.0), np.array([1.0, np.nan, 2.0, 3.0, 4.0])], patch=4)
    assert p.shape == (8 + 1, 4)
    a = np.arange(35.0)
    np.testing.assert_allclose(p[:8].reshape(-1), ((a - a.mean()) / a.std())[:32], atol=1e-12)
    b = np.array([1.0, 2.0, 3.0, 4.0])  # NaN dropped
    np.testing.assert_allclose(p[8], (b - b.mean()) / b.std(), atol=1e-12)


def test_hidden_state_ranks_flatten_tokens():
    h0 = with_spectrum([1.0, 0.5], 24, 8).reshape(2, 12, 8)
    h1 = with_spectrum([1.0, 0.5, 0.2, 0.1], 24, 8).reshape(2, 12, 8)
    rows = hidden_state_ranks([h0, h1], eps=(0.01,))
    assert [r.eps_ranks[0.01] for r in rows] == [2, 4]
    assert rows[0].n_tokens == 24


def _block(q, k, widths, v_widths):
    """An attention block whose heads split q/k at ``widths`` and v/o at ``v_widths``."""
    d = q.shape[0]
    dv = sum(v_widths)
    return {"qk": lj.QueryKey(q=lj.Dense(jnp.asarray(q)), k=lj.Dense(jnp.asarray(k)),
                              widths=widths),
            "v": lj.Dense(jnp.ones((d, dv))), "o": lj.Dense(jnp.ones((dv, d))),
            "heads": lj.HeadLayout(ids=tuple(range(len(widths))), v=v_widths)}


def test_weight_ranks_report_per_head_blocks():
    d, h, dh = 12, 3, 4
    blocks = [with_spectrum(np.ones(r), d, dh, seed=r) for r in (1, 2, 4)]
    q = np.concatenate(blocks, axis=1).astype(np.float32)
    params = {"layers": [{"attn": _block(q, q[:, ::-1].copy(), (dh,) * h, (dh,) * h),
                          "norm": jnp.ones(d)}]}
    rows = {r.path: r for r in weight_ranks(params, eps=(1e-3,))}
    row = rows["layers/0/attn/qk/q"]
    assert row.layer == 0 and row.leaf_type == "Dense" and row.shape == (d, h * dh)
    assert row.head_eps_ranks[1e-3] == [1, 2, 4]
    assert row.eps_ranks[1e-3] == np.linalg.matrix_rank(q.astype(np.float64), tol=1e-4)
    # v splits its outputs into heads too (rank 1 each: all ones); o consumes heads: no split
    assert rows["layers/0/attn/v"].head_eps_ranks[1e-3] == [1, 1, 1]
    assert rows["layers/0/attn/o"].head_eps_ranks is None
    assert "norm" not in " ".join(rows)


def test_weight_ranks_per_head_with_irregular_widths():
    """A pruned block: heads of widths 2, 5, 3 are split at the block's own offsets."""
    d = 12
    blocks = [with_spectrum(np.ones(r), d, w, seed=r) for r, w in ((1, 2), (3, 5), (2, 3))]
    q = np.concatenate(blocks, axis=1).astype(np.float32)
    params = {"layers": [{"attn": _block(q, q, (2, 5, 3), (4, 4, 4))}]}
    report = analyze(params, eps=(1e-3,))
    row = next(w for w in report.weights if w.path == "layers/0/attn/qk/k")
    assert row.head_eps_ranks[1e-3] == [1, 3, 2]
    assert output_head_widths(params, "layers/0/attn/qk/k") == (2, 5, 3)
    assert output_head_widths(params, "layers/0/attn/v") == (4, 4, 4)
    assert output_head_widths(params, "layers/0/attn/o") is None
    summary = report.layer_summary()
    assert summary[0]["layer"] == 0 and summary[0]["n_weights"] == 4
