"""The surgery protocol of every leaf type against dense float64 NumPy references.

``keep_inputs`` / ``keep_outputs`` remove channels physically (the result is smaller and
computes ``x[..., idx] @ W[idx]`` or ``(x @ W + b)[..., idx]``); ``bias`` / ``with_bias`` read
and replace the bias without looking inside the leaf.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import leaves as lj
from lowrank_jax.errors import ShapeError

TOL = 1e-5
D_IN, D_OUT = 8, 6  # HeadLowRank: 3 heads of d_head 2, ranks (2, 1, 2)
KINDS = ["dense", "lowrank", "head_lowrank", "masked_binary", "frozen_binary"]

lin = jax.jit(lj.linear)  # one compile per leaf structure instead of op-by-op dispatch


def f32(seed, shape, scale=1.0):
    """NumPy-drawn float32 array (NumPy draws avoid a compile per shape)."""
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def biprop_np(w, s, keep):
    """Reference Biprop weight (GetSubnet rounding): alpha * sign(w) * M, in float64."""
    w = np.asarray(w, np.float64)
    n = w.size
    j = int((1 - keep) * n)  # the j lowest |scores| are dropped
    order = np.argsort(np.abs(np.asarray(s, np.float64)).reshape(-1), kind="stable")
    m = np.zeros(n)
    m[order[j:]] = 1
    m = m.reshape(w.shape)
    alpha = np.sum(np.abs(w) * m) / max(1, int(keep * n))  # reference divisor floor(k n)
    return alpha * np.where(w >= 0, 1.0, -1.0) * m


def make_leaf(kind, seed=0, bias=True):
    """A leaf of ``kind`` with shape [D_IN, D_OUT] and its dense float64 weight (NumPy)."""
    b = f32(seed + 9, (D_OUT,)) if bias else None
    bj = None if b is None else jnp.asarray(b)
    if kind == "dense":
        w = f32(seed, (D_IN, D_OUT))
        return lj.Dense(jnp.asarray(w), bj), w.astype(np.float64)
    if kind == "lowrank":
        u, v = f32(seed, (D_IN, 3)), f32(seed + 1, (3, D_OUT))
        return lj.LowRank(jnp.asarray(u), jnp.asarray(v), bj), u.astype(np.float64) @ v
    if kind == "head_lowrank":
        ranks = (2, 1, 2)
        u, v = f32(seed, (D_IN, 3, 2)), f32(seed + 1, (3, 2, 2))
        leaf = lj.HeadLowRank(jnp.asarray(u), jnp.asarray(v), bj, ranks=ranks)
        dense = np.concatenate([u[:, h, :r].astype(np.float64) @ v[h, :r]
                                for h, r in enumerate(ranks)], axis=1)
        return leaf, dense
    if kind in ("masked_binary", "frozen_binary"):
        w, s = f32(seed, (D_IN, D_OUT)), f32(seed + 1, (D_IN, D_OUT))
        leaf = lj.MaskedBinary(jnp.asarray(w), jnp.asarray(s), bj, keep=0.4)
        if kind == "frozen_binary":
            leaf = leaf.freeze()
        return leaf, biprop_np(w, s, 0.4)
    raise AssertionError(kind)


def np_apply(dense, b, x):
    y = np.asarray(x, np.float64) @ dense
    return y if b is None else y + np.asarray(b, np.float64)


X = f32(100, (5, D_IN))


# ---------------------------------------------------------------------------------------------
# keep_inputs / keep_outputs.

@pytest.mark.parametrize("kind", KINDS)
def test_keep_inputs_matches_numpy(kind):
    leaf, dense = make_leaf(kind)
    idx = np.array([0, 2, 3, 7])
    kept = lj.keep_inputs(leaf, idx)
    assert kept.shape == (4, D_OUT) and leaf.shape == (D_IN, D_OUT)  # the input is untouched
    ref = np_apply(dense[idx], leaf.bias, X[:, idx])
    np.testing.assert_allclose(np.asarray(lin(kept, jnp.asarray(X[:, idx]))), ref, atol=TOL)
    # Equivalent view: the full leaf on inputs that are zero on the removed channels.
    x0 = np.zeros_like(X)
    x0[:, idx] = X[:, idx]
    np.testing.assert_allclose(np.asarray(lin(leaf, jnp.asarray(x0))), ref, atol=TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_keep_outputs_matches_numpy(kind):
    leaf, dense = make_leaf(kind)
    # HeadLowRank loses whole heads only: heads 0 and 2 (d_head 2).
    idx = np.array([0, 1, 4, 5]) if kind == "head_lowrank" else np.array([1, 2, 5])
    kept = lj.keep_outputs(leaf, idx)
    assert kept.shape == (D_IN, len(idx)) and leaf.shape == (D_IN, D_OUT)
    ref = np_apply(dense, leaf.bias, X)[:, idx]
    np.testing.assert_allclose(np.asarray(lin(kept, jnp.asarray(X))), ref, atol=TOL)
    np.testing.assert_allclose(np.asarray(lj.materialize(kept)), dense[:, idx], atol=TOL)


def test_keep_outputs_is_physically_smaller():
    lr, _ = make_leaf("lowrank")
    kept = lr.keep_outputs(np.array([1, 2, 5]))
    assert kept.rank == 3 and kept.v.shape == (3, 3) and kept.b.shape == (3,)
    assert lj.param_count(kept) == 3 * (D_IN + 3) + 3
    hl, _ = make_leaf("head_lowrank")
    kh = lj.keep_outputs(hl, np.array([2, 3, 4, 5]))  # heads 1 and 2
    assert kh.num_heads == 2 and kh.ranks == (1, 2) and kh.u.shape == (D_IN, 2, 2)
    assert lj.param_count(kh) == (1 + 2) * (D_IN + 2) + 4
    kin = lj.keep_inputs(hl, np.array([1, 6]))
    assert kin.u.shape == (2, 3, 2) and kin.ranks == (2, 1, 2)


@pytest.mark.parametrize("idx", [[0, 1, 2], [1, 2], [0, 1, 3]])
def test_head_lowrank_keep_outputs_partial_head_raises(idx):
    leaf, _ = make_leaf("head_lowrank")
    with pytest.raises(ShapeError, match="whole heads"):
        lj.keep_outputs(leaf, np.array(idx))


def test_masked_binary_surgery_freezes_and_is_exact():
    """Removing channels of a MaskedBinary must not re-rank scores or change alpha: the frozen
    slice computes exactly what the masked leaf computed on the kept channels."""
    leaf, _ = make_leaf("masked_binary")
    x = jnp.asarray(X)
    full = np.asarray(lj.linear(leaf, x))
    out_idx = np.array([0, 3, 4])
    ko = lj.keep_outputs(leaf, out_idx)
    assert isinstance(ko, lj.FrozenBinary)
    np.testing.assert_array_equal(np.asarray(lj.linear(ko, x)), full[:, out_idx])
    np.testing.assert_array_equal(np.asarray(lj.materialize(ko)),
                                  np.asarray(lj.materialize(leaf))[:, out_idx])
    in_idx = np.array([1, 2, 6])
    ki = lj.keep_inputs(leaf, in_idx)
    assert isinstance(ki, lj.FrozenBinary)
    np.testing.assert_array_equal(np.asarray(lj.materialize(ki)),
                                  np.asarray(lj.materialize(leaf))[in_idx])
    x0 = np.zeros_like(X)
    x0[:, in_idx] = X[:, in_idx]
    # Same weights exactly; a shorter dot product may round differently in the last bit.
    np.testing.assert_allclose(np.asarray(lj.linear(ki, jnp.asarray(X[:, in_idx]))),
                               np.asarray(lj.linear(leaf, jnp.asarray(x0))), atol=TOL)
    # A re-ranked slice would keep a different number of weights; the frozen one keeps the
    # masked leaf's own kept entries of those columns.
    mask = np.asarray(leaf.mask())
    assert ko.n_keep == int(mask[:, out_idx].sum())


def test_plain_arrays_are_sliced():
    w = f32(7, (D_IN, D_OUT))
    np.testing.assert_array_equal(np.asarray(lj.keep_inputs(jnp.asarray(w), [1, 4])), w[[1, 4]])
    np.testing.assert_array_equal(np.asarray(lj.keep_outputs(jnp.asarray(w), np.array([0, 5]))),
                                  w[:, [0, 5]])


BAD_IDX = [  # "n" stands for the size of the sliced dimension (one past the last channel)
    ([2, 1], "sorted and distinct"),
    ([1, 1], "sorted and distinct"),
    ([0, "n"], "must lie in"),
    ([-1, 2], "must lie in"),
    ([[0, 1]], "1-D integer"),
    ([0.0, 1.0], "1-D integer"),
]


@pytest.mark.parametrize("idx,match", BAD_IDX)
@pytest.mark.parametrize("target", ["dense", "masked_binary", "array"])
def test_bad_indices_raise(idx, match, target):
    w = jnp.asarray(f32(8, (D_IN, D_OUT))) if target == "array" else make_leaf(target)[0]
    for fn, n in ((lj.keep_inputs, D_IN), (lj.keep_outputs, D_OUT)):
        with pytest.raises(ShapeError, match=match):
            fn(w, np.asarray([n if i == "n" else i for i in idx]))


# ---------------------------------------------------------------------------------------------
# bias / with_bias.

@pytest.mark.parametrize("kind", KINDS)
def test_bias_and_with_bias(kind):
    leaf, dense = make_leaf(kind)
    np.testing.assert_array_equal(np.asarray(leaf.bias), f32(9, (D_OUT,)))
    assert lj.bias_of(leaf) is leaf.bias
    nb = f32(55, (D_OUT,))
    swapped = leaf.with_bias(jnp.asarray(nb))
    assert type(swapped) is type(leaf)
    assert lj.meta_fields(leaf) == lj.meta_fields(swapped)
    for f in lj.meta_fields(leaf):  # static sizes (ranks, keep) survive
        assert getattr(swapped, f) == getattr(leaf, f)
    np.testing.assert_allclose(np.asarray(lin(swapped, jnp.asarray(X))), np_apply(dense, nb, X),
                               atol=TOL)
    np.testing.assert_array_equal(np.asarray(leaf.bias), f32(9, (D_OUT,)))  # not mutated
    none = leaf.with_bias(None)
    assert none.bias is None
    np.testing.assert_allclose(np.asarray(lin(none, jnp.asarray(X))), np_apply(dense, None, X),
                               atol=TOL)
    assert lj.param_count(leaf) == lj.param_count(none) + D_OUT
    back = none.with_bias(jnp.asarray(nb))
    np.testing.assert_array_equal(np.asarray(back.bias), nb)
    with pytest.raises(ShapeError, match="bias"):
        leaf.with_bias(jnp.zeros((D_OUT + 1,)))


def test_bias_of_plain_array_is_none():
    assert lj.bias_of(jnp.zeros((3, 2))) is None


def _stored_bias_leaf(name, b):
    """A [D_IN, D_OUT] leaf of the class ``name`` whose bias is its field ``b``."""
    w, w2 = f32(60, (D_IN, D_OUT)), f32(61, (D_IN, D_OUT))
    if name in ("Dense", "LowRank", "HeadLowRank", "MaskedBinary", "FrozenBinary"):
        kind = {"Dense": "dense", "LowRank": "lowrank", "HeadLowRank": "head_lowrank",
                "MaskedBinary": "masked_binary", "FrozenBinary": "frozen_binary"}[name]
        return make_leaf(kind)[0].with_bias(b)
    if name == "PackedBinary":
        return lj.pack_binary_tree([lj.MaskedBinary(jnp.asarray(w), jnp.asarray(w2), b, keep=0.4)])[0]
    if name in ("Int8", "Int8A8"):
        return getattr(lj, name).quantize(w, b)
    if name == "Int4":
        return lj.Int4.quantize(w, b, group=4)
    if name == "FakeQuant":
        return lj.FakeQuant(jnp.asarray(w), b, bits=4, group=4)
    if name == "ProductLeaf":
        return lj.ProductLeaf(lj.Int8.quantize(f32(62, (D_IN, 3))), jnp.asarray(f32(63, (3, D_OUT))), b)
    if name == "SumLeaf":
        return lj.SumLeaf(jnp.asarray(w), lj.Dense(jnp.asarray(w2)), b)
    if name == "FixedBias":
        return lj.FixedBias(lj.Dense(jnp.asarray(w)), b)
    raise AssertionError(name)


STORED_BIAS = ["Dense", "LowRank", "HeadLowRank", "MaskedBinary", "FrozenBinary", "PackedBinary",
               "Int8", "Int8A8", "Int4", "FakeQuant", "ProductLeaf", "SumLeaf", "FixedBias"]
# Leaves with a field ``b`` that is not their bias as stored: LoRA's ``b`` is its up factor (the
# bias is the base leaf's); Partitioned stores its bias per machine ([machines, d_out/machines]).
OTHER_B = {"LoRA", "Partitioned"}


def test_every_leaf_with_a_field_b_is_covered():
    with_b = {cls.__name__ for name, cls in lj.node_types().items()
              if name.startswith("lowrank_jax.") and issubclass(cls, lj.Leaf)
              and "b" in lj.data_fields(cls)}
    assert with_b == set(STORED_BIAS) | OTHER_B


@pytest.mark.parametrize("name", STORED_BIAS)
def test_stored_bias_is_the_field_b_and_with_bias_round_trips(name):
    b, nb = jnp.asarray(f32(64, (D_OUT,))), jnp.asarray(f32(65, (D_OUT,)))
    leaf = _stored_bias_leaf(name, b)
    assert type(leaf).__name__ == name
    b = leaf.bias
    assert b is leaf.b  # the stored array itself, not a copy (a builder may have cast it)
    np.testing.assert_array_equal(np.asarray(b), f32(64, (D_OUT,)))
    x = jnp.asarray(X)
    none = leaf.with_bias(None)
    assert lj.bias_of(none) is None
    swapped = leaf.with_bias(nb)
    assert type(swapped) is type(leaf) and swapped.bias is nb and leaf.bias is b
    assert lj.meta_fields(swapped) == lj.meta_fields(leaf)
    for f in lj.meta_fields(leaf):
        assert getattr(swapped, f) == getattr(leaf, f)
    for f in lj.data_fields(leaf):  # everything but the bias is carried over as it is
        assert f == "b" or getattr(swapped, f) is getattr(leaf, f)
    # the new bias is the one added: y(with nb) - y(without) = nb (float32 addition)
    y0 = np.asarray(lin(none, x), np.float64)
    np.testing.assert_allclose(np.asarray(lin(swapped, x), np.float64) - y0, np.broadcast_to(
        np.asarray(nb, np.float64), y0.shape), atol=TOL)
    back = swapped.with_bias(b)
    assert type(back) is type(leaf) and back.bias is b
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(leaf)
    again = none.with_bias(b)  # FixedBias without a bias is its wrapped leaf: that one takes b
    assert again.bias is b
    np.testing.assert_allclose(np.asarray(lin(again, x)), np.asarray(lin(leaf, x)), atol=TOL)
    assert lj.param_count(leaf) == lj.param_count(none) + D_OUT
