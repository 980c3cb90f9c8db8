"""CPQueryKey, BTDQueryKey and augmented_joint against NumPy and tensorly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import nn
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import BTDQueryKey, CPQueryKey, Dense, QueryKey, augmented_joint

F, H = 12, 3
RNG = np.random.default_rng(0)


def dense(d_in, d_out, seed, bias=True):
    r = np.random.default_rng(seed)
    return Dense(w=jnp.asarray(r.normal(size=(d_in, d_out)) / np.sqrt(d_in), jnp.float32),
                 b=jnp.asarray(r.normal(size=d_out), jnp.float32) if bias else None)


def aug(leaf) -> np.ndarray:
    """``[W; b]`` in float64: the factor over the input with a constant feature 1."""
    w = np.asarray(leaf.w, np.float64)
    b = np.zeros(w.shape[1]) if leaf.b is None else np.asarray(leaf.b, np.float64)
    return np.concatenate([w, b[None]], 0)


def x_aug(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.concatenate([x, np.ones((*x.shape[:-1], 1))], -1)


@pytest.fixture(scope="module")
def xs():
    return (jnp.asarray(RNG.normal(size=(2, 5, F)), jnp.float32),
            jnp.asarray(RNG.normal(size=(2, 7, F)), jnp.float32))


def test_augmented_joint_of_a_query_key_with_biases():
    q, k = dense(F, 8, 1), dense(F, 8, 2)
    qk = QueryKey(q=q, k=k, widths=(3, 5))
    y = augmented_joint(qk)
    qa, ka = aug(q), aug(k)
    want = np.stack([qa[:, :3] @ ka[:, :3].T, qa[:, 3:] @ ka[:, 3:].T], -1)
    np.testing.assert_allclose(y, want, atol=1e-12)
    np.testing.assert_allclose(y[:F, :F], np.asarray(qk.joint(), np.float64), atol=1e-5)


def cp_qk(rank=5, seed=3):
    r = np.random.default_rng(seed)
    return CPQueryKey(q=dense(F, rank, seed + 1), k=dense(F, rank, seed + 2),
                      mix=jnp.asarray(r.normal(size=(H, rank)), jnp.float32))


def test_cp_scores_equal_the_tensor_rebuilt_by_tensorly(xs):
    tl = pytest.importorskip("tensorly")
    qk = cp_qk()
    y = tl.cp_to_tensor((np.ones(5), [aug(qk.q), aug(qk.k), np.asarray(qk.mix, np.float64)]))
    xq, xk = xs
    want = np.einsum("bqi,ijh,bkj->bhqk", x_aug(xq), y, x_aug(xk))
    np.testing.assert_allclose(np.asarray(lj.attention_logits(qk, xq, xk)), want, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(augmented_joint(qk), y, atol=1e-10)
    np.testing.assert_allclose(np.asarray(qk.joint()), y[:F, :F], atol=1e-5)
    assert qk.score_flops(5, 7) == 5 * H * 5 + 5 * 7 * H * 5


RANKS = (2, 0, 4)  # a rank-0 term, irregular ranks


def btd_qk(mix=None, seed=5):
    r = np.random.default_rng(seed)
    mix = r.normal(size=(H, 3)) if mix is None else mix
    return BTDQueryKey(q=dense(F, sum(RANKS), seed + 1), k=dense(F, sum(RANKS), seed + 2),
                       mix=jnp.asarray(mix, jnp.float32), ranks=RANKS)


def btd_reference(qk, xq, xk) -> np.ndarray:
    """sum_t C(h, t) (x A_t + a_t)(x B_t + b_t)^T, term by term, no padding."""
    qa, ka, c = aug(qk.q), aug(qk.k), np.asarray(qk.mix, np.float64)
    off = np.concatenate([[0], np.cumsum(RANKS)])
    terms = [np.einsum("bqi,il,jl,bkj->bqk", x_aug(xq), qa[:, off[t]:off[t + 1]],
                       ka[:, off[t]:off[t + 1]], x_aug(xk)) for t in range(3)]
    return np.einsum("ht,tbqk->bhqk", c, np.stack(terms))


def test_btd_scores_against_numpy(xs):
    qk = btd_qk()
    xq, xk = xs
    np.testing.assert_allclose(np.asarray(lj.attention_logits(qk, xq, xk)),
                               btd_reference(qk, xq, xk), rtol=1e-5, atol=1e-5)
    qa, ka = aug(qk.q), aug(qk.k)
    y = np.stack([qa[:, :2] @ ka[:, :2].T, np.zeros((F + 1, F + 1)), qa[:, 2:] @ ka[:, 2:].T], -1)
    want = np.einsum("ijt,ht->ijh", y, np.asarray(qk.mix, np.float64))
    np.testing.assert_allclose(augmented_joint(qk), want, atol=1e-10)
    np.testing.assert_allclose(np.asarray(qk.joint()), want[:F, :F], atol=1e-5)
    assert qk.score_flops(5, 7) == 5 * 7 * 3 * 4 + 5 * 7 * H * 3


def test_btd_as_cp_gives_the_btd_scores_and_counts_what_it_executes(xs):
    qk = btd_qk()  # ranks (2, 0, 4): a rank-0 term, biases on both sides
    xq, xk = xs
    cp = qk.as_cp()
    assert isinstance(cp, CPQueryKey) and cp.rank == sum(qk.ranks) and cp.num_heads == H
    np.testing.assert_allclose(np.asarray(lj.attention_logits(cp, xq, xk)),
                               btd_reference(qk, xq, xk), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cp.mix),
                               np.asarray(qk.mix)[:, [0, 0, 2, 2, 2, 2]], atol=0)
    assert cp.score_flops(5, 7) == 5 * H * 6 + 5 * 7 * H * 6


def test_rank_zero_head_attends_uniformly_without_nan(xs):
    """With C = I the head of the rank-0 term has constant logits: uniform attention; the
    gradients are finite and only reach the real columns."""
    qk = btd_qk(mix=np.eye(3))
    xq, _ = xs
    lg = lj.attention_logits(qk, xq, xq)
    assert float(jnp.abs(lg[:, 1]).max()) == 0.0
    params = {"qk": qk, "v": dense(F, 6, 7), "o": dense(6, F, 8),
              "heads": lj.HeadLayout.uniform(3, 2, 0.5)}
    cfg = nn.AttentionConfig(use_bias=True)

    def loss(p):
        return jnp.sum(nn.apply_attention(p, xq, cfg) ** 2)

    val, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert bool(jnp.isfinite(val))
    for g in jax.tree_util.tree_leaves(grads):
        assert bool(jnp.all(jnp.isfinite(g)))
    assert grads["qk"].q.w.shape == (F, 6)  # no padded parameters exist
    assert float(jnp.abs(grads["qk"].q.w).max()) > 0


def test_truncatt_as_block_diagonal_cp_gives_identical_scores(xs):
    """App. A.4: TruncAtt is CP-SlimAtt with S^Q = [U_1..U_H], S^K = [V_1..V_H] and a
    block-diagonal fusion matrix of singular values."""
    r = np.random.default_rng(9)
    y = r.normal(size=(F, F, H))
    ranks = (2, 3, 1)
    us, vs, lam = [], [], []
    for h, rk in enumerate(ranks):
        u, s, vt = np.linalg.svd(y[:, :, h])
        us.append(u[:, :rk] * np.sqrt(s[:rk]))
        vs.append(vt[:rk].T * np.sqrt(s[:rk]))
        lam.append(s[:rk])
    trunc = QueryKey(q=Dense(jnp.asarray(np.concatenate(us, 1), jnp.float32)),
                     k=Dense(jnp.asarray(np.concatenate(vs, 1), jnp.float32)), widths=ranks)
    blk = np.zeros((H, sum(ranks)))
    off = np.concatenate([[0], np.cumsum(ranks)])
    su, sv = [], []
    for h in range(H):
        blk[h, off[h]:off[h + 1]] = lam[h]
        su.append(us[h] / np.sqrt(lam[h]))
        sv.append(vs[h] / np.sqrt(lam[h]))
    cp = CPQueryKey(q=Dense(jnp.asarray(np.concatenate(su, 1), jnp.float32)),
                    k=Dense(jnp.asarray(np.concatenate(sv, 1), jnp.float32)),
                    mix=jnp.asarray(blk, jnp.float32))
    xq, xk = xs
    np.testing.assert_allclose(np.asarray(lj.attention_logits(cp, xq, xk)),
                               np.asarray(lj.attention_logits(trunc, xq, xk)), rtol=1e-5,
                               atol=1e-5)


def test_surgery_against_numpy(xs):
    xq, xk = xs
    for qk in (cp_qk(), btd_qk()):
        full = np.asarray(lj.attention_logits(qk, xq, xk))
        kept = qk.keep_heads(np.array([0, 2]))
        assert kept.num_heads == 2
        np.testing.assert_allclose(np.asarray(lj.attention_logits(kept, xq, xk)), full[:, [0, 2]],
                                   atol=1e-6)
        idx = np.array([1, 4, 5, 11])
        sub = qk.keep_inputs(idx, "q")
        xz = np.zeros_like(np.asarray(xq))
        xz[..., idx] = np.asarray(xq)[..., idx]
        np.testing.assert_allclose(np.asarray(lj.attention_logits(sub, xq[..., idx], xk)),
                                   np.asarray(lj.attention_logits(qk, jnp.asarray(xz), xk)),
                                   rtol=1e-5, atol=1e-5)
        assert qk.keep_inputs(idx, "k").d_k_in == 4


def test_counts_checkpoint_and_trainable_split(tmp_path):
    from lowrank_jax.io import load_params, save_params

    qk = btd_qk()
    assert lj.param_count(qk) == 2 * (F + 1) * 6 + H * 3
    assert lj.flops(qk, 10) == 10 * 2 * F * 6
    tree = {"attn": {"qk": qk}, "cp": cp_qk()}
    save_params(tmp_path / "ck", tree)
    back = load_params(tmp_path / "ck")
    assert isinstance(back["attn"]["qk"], BTDQueryKey) and back["attn"]["qk"].ranks == RANKS
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mask = lj.trainable_mask(tree)
    assert all(jax.tree_util.tree_leaves(mask))  # factors and fusion matrices all train


def test_bad_shapes_and_masks_are_refused(xs):
    with pytest.raises(ShapeError, match=r"mix must be \[heads, terms=3\]"):
        BTDQueryKey(q=dense(F, 6, 1), k=dense(F, 6, 2), mix=jnp.ones((H, 2)), ranks=RANKS)
    with pytest.raises(ShapeError, match="'k' has 5 outputs but sum\\(ranks\\) is 6"):
        BTDQueryKey(q=dense(F, 6, 1), k=dense(F, 5, 2), mix=jnp.ones((H, 3)), ranks=RANKS)
    with pytest.raises(ShapeError, match="'q' has 4 outputs but the rank of mix is 5"):
        CPQueryKey(q=dense(F, 4, 1), k=dense(F, 5, 2), mix=jnp.ones((H, 5)))
    xq, _ = xs
    with pytest.raises(ConfigError, match="qkv_keep"):
        cp_qk().logits(xq, xq, q_mask=jnp.ones((5, 5)))
