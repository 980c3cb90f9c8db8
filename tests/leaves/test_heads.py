"""HeadLayout (static head ids, value widths, scale) and split_heads / merge_heads against NumPy
slicing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import leaves as lj
from lowrank_jax.errors import ShapeError

WIDTHS = (3, 0, 5, 2)


def f32(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def np_split(y, widths):
    """[..., sum(w)] -> [..., h, max(w)], each head's columns first, zeros after."""
    off = np.concatenate([[0], np.cumsum(widths)]).astype(int)
    out = np.zeros((*y.shape[:-1], len(widths), max(widths)), y.dtype)
    for h, w in enumerate(widths):
        out[..., h, :w] = y[..., off[h]:off[h] + w]
    return out


@pytest.mark.parametrize("widths", [WIDTHS, (4, 4, 4), (1,), (0, 2)])
def test_split_and_merge_heads(widths):
    y = f32(0, (2, 3, sum(widths)))
    s = np.asarray(lj.split_heads(jnp.asarray(y), widths))
    np.testing.assert_array_equal(s, np_split(y, widths))
    np.testing.assert_array_equal(np.asarray(lj.merge_heads(jnp.asarray(s), widths)), y)
    np.testing.assert_array_equal(lj.head_offsets(widths),
                                  np.concatenate([[0], np.cumsum(widths)]))
    assert lj.is_uniform(widths) == (len(set(widths)) == 1)


def test_split_heads_padding_gets_no_gradient():
    y = jnp.asarray(f32(1, (3, sum(WIDTHS))))
    r = f32(2, (3, 4, 5))  # weights on the padded layout, padding included
    g = jax.grad(lambda t: jnp.sum(lj.split_heads(t, WIDTHS) * r))(y)
    # Each real entry gets its own weight; padding weights reach nothing.
    ref = np.concatenate([r[:, h, :w] for h, w in enumerate(WIDTHS)], axis=-1)
    np.testing.assert_array_equal(np.asarray(g), ref)


def test_split_heads_wrong_width_raises():
    with pytest.raises(ShapeError, match=r"expected 10 features"):
        lj.split_heads(jnp.zeros((2, 9)), WIDTHS)


def test_head_layout_fields_and_keep():
    lay = lj.HeadLayout(ids=(0, 2, 5, 6), v=(4, 2, 0, 3), scale=0.5)
    assert lay.num_heads == 4 and lay.d_v == 9 and lay.scale == 0.5
    kept = lay.keep([1, 3])
    assert kept.ids == (2, 6) and kept.v == (2, 3) and kept.scale == 0.5  # scale stays
    uni = lj.HeadLayout.uniform(3, 4, scale=0.25)
    assert uni.ids == (0, 1, 2) and uni.v == (4, 4, 4) and uni.d_v == 12 and uni.scale == 0.25
    # Ints given as NumPy ints are normalized to Python ints (hashable, static).
    np_ints = lj.HeadLayout(ids=np.array([1, 0]), v=np.array([2, 2]))
    assert np_ints.ids == (1, 0) and all(type(i) is int for i in np_ints.ids + np_ints.v)


def test_head_layout_is_static():
    lay = lj.HeadLayout.uniform(2, 3, 0.5)
    assert jax.tree_util.tree_leaves(lay) == []
    # Everything is in the tree structure: a different layout is a different program.
    for other in (lj.HeadLayout.uniform(2, 3, 1.0), lj.HeadLayout((0, 2), (3, 3), 0.5),
                  lj.HeadLayout((0, 1), (3, 2), 0.5)):
        assert jax.tree_util.tree_structure(other) != jax.tree_util.tree_structure(lay)
    assert jax.tree_util.tree_structure(lj.HeadLayout.uniform(2, 3, 0.5)) == \
        jax.tree_util.tree_structure(lay)
    assert lj.meta_fields(lay) == ("ids", "v", "scale") and lj.data_fields(lay) == ()


@pytest.mark.parametrize("kwargs,match", [
    (dict(ids=(0, 1), v=(2,)), "ids has 2 heads but v has 1"),
    (dict(ids=(0, 0), v=(2, 2)), "distinct"),
    (dict(ids=(0, 1), v=(2, -1)), "ints >= 0"),
    (dict(ids=(0, 1.5), v=(2, 2)), "ints >= 0"),
    (dict(ids=(0, 1), v=(True, 2)), "ints >= 0"),
    (dict(ids=3, v=(2,)), "sequence of ints"),
])
def test_bad_head_layouts_raise(kwargs, match):
    with pytest.raises(ShapeError, match=match):
        lj.HeadLayout(**kwargs)
