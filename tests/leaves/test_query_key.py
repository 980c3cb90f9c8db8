"""QueryKey (the default query-key object) against per-head float64 NumPy loops: logits with
irregular head widths, the joint tensor ``Y_h = W^Q_h (W^K_h)^T``, counts and surgery."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import leaves as lj
from lowrank_jax.errors import ShapeError

TOL = 1e-5
WIDTHS = (3, 0, 5, 2)  # irregular, with an empty head
D_Q, D_K = 7, 6
TOTAL = sum(WIDTHS)


def f32(seed, shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def offsets(widths):
    return np.concatenate([[0], np.cumsum(widths)]).astype(int)


def make_qk(seed=0, widths=WIDTHS, bias=True):
    """QueryKey with Dense q [D_Q, sum] and k [D_K, sum] and the NumPy arrays it holds."""
    n = sum(widths)
    wq, wk = f32(seed, (D_Q, n), 0.5), f32(seed + 1, (D_K, n), 0.5)
    bq = f32(seed + 2, (n,)) if bias else np.zeros(n, np.float32)
    bk = f32(seed + 3, (n,)) if bias else np.zeros(n, np.float32)
    qk = lj.QueryKey(q=lj.Dense(jnp.asarray(wq), jnp.asarray(bq) if bias else None),
                     k=lj.Dense(jnp.asarray(wk), jnp.asarray(bk) if bias else None),
                     widths=widths)
    return qk, dict(wq=wq, wk=wk, bq=bq, bk=bk)


def np_logits(a, widths, xq, xkv, q_mask=None, k_mask=None):
    """Per-head loop: head h multiplies its own columns; masks apply to its first w_h columns."""
    off = offsets(widths)
    xq, xkv = np.asarray(xq, np.float64), np.asarray(xkv, np.float64)
    q_all = xq @ a["wq"] + a["bq"]  # [b, q, sum]
    k_all = xkv @ a["wk"] + a["bk"]  # [b, k, sum]
    out = np.zeros((xq.shape[0], len(widths), xq.shape[1], xkv.shape[1]))
    for h, w in enumerate(widths):
        q, k = q_all[..., off[h]:off[h + 1]], k_all[..., off[h]:off[h + 1]]
        if q_mask is not None:
            q = q * q_mask[:, :w]
        if k_mask is not None:
            k = k * k_mask[:, :w]
        out[:, h] = np.einsum("bqd,bkd->bqk", q, k)  # width 0: zeros
    return out


XQ, XKV = f32(10, (2, 4, D_Q)), f32(11, (2, 5, D_K))
logits = jax.jit(lj.attention_logits)


def test_logits_irregular_widths_match_numpy():
    qk, a = make_qk()
    got = np.asarray(logits(qk, jnp.asarray(XQ), jnp.asarray(XKV)))
    assert got.shape == (2, 4, 4, 5)
    np.testing.assert_allclose(got, np_logits(a, WIDTHS, XQ, XKV), atol=TOL)
    assert np.all(got[:, 1] == 0)  # the width-0 head has constant logits


def test_logits_with_activation_masks():
    qk, a = make_qk(1)
    rng = np.random.default_rng(12)
    mq = (rng.random((4, max(WIDTHS))) < 0.5).astype(np.float32)  # [q_len, max width]
    mk = (rng.random((5, max(WIDTHS))) < 0.5).astype(np.float32)  # [k_len, max width]
    got = lj.attention_logits(qk, jnp.asarray(XQ), jnp.asarray(XKV), q_mask=mq, k_mask=mk)
    np.testing.assert_allclose(np.asarray(got), np_logits(a, WIDTHS, XQ, XKV, mq, mk), atol=TOL)


def test_logits_of_compressed_leaves_equal_dense():
    # q as LowRank, k as HeadLowRank (uniform widths 2 x 3): the dispatch is leaf-agnostic.
    u, v = f32(20, (D_Q, 2)), f32(21, (2, 6))
    hu, hv = f32(22, (D_K, 3, 2)), f32(23, (3, 2, 2))
    qk = lj.QueryKey.uniform(lj.LowRank(jnp.asarray(u), jnp.asarray(v)),
                             lj.HeadLowRank(jnp.asarray(hu), jnp.asarray(hv)), 3)
    assert qk.widths == (2, 2, 2)
    wk = np.concatenate([hu[:, h].astype(np.float64) @ hv[h] for h in range(3)], axis=1)
    a = dict(wq=u.astype(np.float64) @ v, wk=wk, bq=0.0, bk=0.0)
    np.testing.assert_allclose(np.asarray(logits(qk, jnp.asarray(XQ), jnp.asarray(XKV))),
                               np_logits(a, (2, 2, 2), XQ, XKV), atol=TOL)


def test_joint_slices_are_per_head_products():
    qk, a = make_qk(2)
    y = np.asarray(qk.joint())
    assert y.shape == (D_Q, D_K, 4)
    off = offsets(WIDTHS)
    for h in range(4):
        ref = a["wq"][:, off[h]:off[h + 1]].astype(np.float64) @ a["wk"][:, off[h]:off[h + 1]].T
        np.testing.assert_allclose(y[:, :, h], ref, atol=TOL)
    assert np.all(y[:, :, 1] == 0)
    # Without biases, logits_h = x_q Y_h x_kv^T: the joint tensor is the whole interaction.
    qk0, _ = make_qk(2, bias=False)
    got = np.asarray(logits(qk0, jnp.asarray(XQ), jnp.asarray(XKV)))
    ref = np.einsum("bqi,ijh,bkj->bhqk", XQ.astype(np.float64), y, XKV.astype(np.float64))
    np.testing.assert_allclose(got, ref, atol=TOL)


def test_score_flops_count_padded_heads():
    qk, _ = make_qk()
    # Executed: every head padded to the widest one (5), as documented for QueryKey.
    assert qk.score_flops(4, 9) == 4 * 9 * 4 * 5
    uni, _ = make_qk(widths=(2, 2, 2))
    assert uni.score_flops(3, 3) == 3 * 3 * sum((2, 2, 2))
    assert qk.num_heads == 4 and qk.d_q_in == D_Q and qk.d_k_in == D_K


def test_keep_heads():
    qk, a = make_qk(3)
    kept = qk.keep_heads(np.array([0, 2]))
    assert kept.widths == (3, 5) and kept.q.shape == (D_Q, 8) and kept.k.shape == (D_K, 8)
    full = np_logits(a, WIDTHS, XQ, XKV)
    np.testing.assert_allclose(np.asarray(logits(kept, jnp.asarray(XQ), jnp.asarray(XKV))),
                               full[:, [0, 2]], atol=TOL)
    # Removing the widest head lowers the executed count.
    assert qk.keep_heads([0, 3]).score_flops(4, 5) == 4 * 5 * 2 * 3


def test_keep_channels_equals_zeroed_channels():
    """Dropping query/key channels equals zeroing those columns (and biases) of q and k."""
    qk, a = make_qk(4)
    keep = np.array([0, 2, 3, 5, 7])  # head 0 keeps 2 of 3, head 2 keeps 3 of 5, head 3 none
    kept = qk.keep_channels(keep)
    assert kept.widths == (2, 0, 3, 0)
    zeroed = {n: arr.copy() for n, arr in a.items()}
    drop = np.setdiff1d(np.arange(TOTAL), keep)
    for n in ("wq", "wk"):
        zeroed[n][:, drop] = 0
    for n in ("bq", "bk"):
        zeroed[n][drop] = 0
    got = np.asarray(logits(kept, jnp.asarray(XQ), jnp.asarray(XKV)))
    np.testing.assert_allclose(got, np_logits(zeroed, WIDTHS, XQ, XKV), atol=TOL)


@pytest.mark.parametrize("side", ["q", "k"])
def test_keep_inputs_per_side(side):
    qk, a = make_qk(5)
    d = D_Q if side == "q" else D_K
    idx = np.array([0, 2, d - 1])
    kept = qk.keep_inputs(idx, side)
    assert (kept.d_q_in, kept.d_k_in) == ((3, D_K) if side == "q" else (D_Q, 3))
    xq, xkv = XQ.copy(), XKV.copy()
    x = xq if side == "q" else xkv
    x0 = np.zeros_like(x)
    x0[..., idx] = x[..., idx]
    ref = np_logits(a, WIDTHS, x0, xkv) if side == "q" else np_logits(a, WIDTHS, xq, x0)
    args = (xq[..., idx], xkv) if side == "q" else (xq, xkv[..., idx])
    got = np.asarray(logits(kept, *(jnp.asarray(t) for t in args)))
    np.testing.assert_allclose(got, ref, atol=TOL)
    with pytest.raises(ShapeError, match="side"):
        qk.keep_inputs(idx, "v")


def test_grad_reaches_only_real_columns():
    """d sum(logits) / d W^Q_h = outer(sum_i x_q[i], sum_j k_h[j]) for every real column."""
    qk, a = make_qk(6)
    xq, xkv = XQ[:1], XKV[:1]
    g = jax.jit(jax.grad(lambda t: jnp.sum(lj.attention_logits(t, jnp.asarray(xq),
                                                                jnp.asarray(xkv)))))(qk)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(qk)
    k_all = xkv[0].astype(np.float64) @ a["wk"] + a["bk"]  # [k, sum]
    ref = np.outer(xq[0].sum(0), k_all.sum(0))  # every column belongs to exactly one head
    np.testing.assert_allclose(np.asarray(g.q.w), ref, rtol=1e-5, atol=1e-4)


def test_bad_query_key_objects_raise():
    w8, w6 = lj.Dense(jnp.zeros((4, 8))), lj.Dense(jnp.zeros((4, 6)))
    with pytest.raises(ShapeError, match=r"'k' has 6 outputs .* sum to 8"):
        lj.QueryKey(q=w8, k=w6, widths=(4, 4))
    with pytest.raises(ShapeError, match="does not divide"):
        lj.QueryKey.uniform(w8, w8, 3)
    with pytest.raises(ShapeError, match="ints >= 0"):
        lj.QueryKey(q=w8, k=w8, widths=(10, -2))
    with pytest.raises(ShapeError, match="query-key object"):
        lj.attention_logits(w8, jnp.zeros((1, 2, 4)), jnp.zeros((1, 2, 4)))


def test_query_key_is_a_container_in_the_tree():
    qk, _ = make_qk(7)
    tree = {"attn": {"qk": qk}}
    names = [p for p, _ in lj.named_leaves(tree)]
    assert names == ["attn/qk/q", "attn/qk/k"]  # its weight leaves, at readable paths
    assert lj.param_count(tree) == 2 * (D_Q * TOTAL + TOTAL) - (D_Q - D_K) * TOTAL
    assert lj.flops(tree, 3) == 3 * (D_Q + D_K) * TOTAL
    assert lj.meta_fields(qk) == ("widths",)
    # Widths are static: different widths give different tree structures (a new compile).
    other = lj.QueryKey(q=qk.q, k=qk.k, widths=(2, 1, 5, 2))
    assert jax.tree_util.tree_structure(other) != jax.tree_util.tree_structure(qk)
