"""Attention masks and fixed Q/K/V activation masks ("Sparse Binary Transformers", sec. 3.3)
against plain loops."""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrank_jax.nn import (
    activation_keep_count,
    causal_mask,
    combine_masks,
    padding_mask,
    qkv_activation_masks,
    step_t_mask,
)


def test_padding_mask_values_and_shape():
    valid = np.array([[1, 1, 0, 0], [1, 1, 1, 1]])
    m = np.asarray(padding_mask(valid))
    assert m.shape == (2, 1, 1, 4) and m.dtype == bool
    for b in range(2):
        for j in range(4):
            assert m[b, 0, 0, j] == bool(valid[b, j])


def test_padding_mask_wrong_rank_raises():
    with pytest.raises(ValueError, match="valid must be 2-D"):
        padding_mask(np.ones((2, 3, 4)))


@pytest.mark.parametrize("q_len,k_len", [(5, 5), (3, 7), (1, 4)])
def test_causal_mask_matches_loop(q_len, k_len):
    m = np.asarray(causal_mask(q_len, k_len))
    assert m.shape == (1, 1, q_len, k_len) and m.dtype == bool
    offset = k_len - q_len  # queries are the last q_len positions of the keys
    for i in range(q_len):
        for j in range(k_len):
            assert m[0, 0, i, j] == (j <= i + offset)


def test_causal_mask_default_square_is_lower_triangular():
    np.testing.assert_array_equal(np.asarray(causal_mask(4))[0, 0], np.tril(np.ones((4, 4), bool)))


@pytest.mark.parametrize("w", [2, 3, 6])
def test_step_t_mask_matches_paper_figure(w):
    m = np.asarray(step_t_mask(w))
    assert m.shape == (1, 1, w, w) and m.dtype == bool
    t = w - 1
    for i in range(w):
        for j in range(w):
            if i == t:  # the current step attends every earlier step, not itself
                expected = j < t
            else:  # every past step attends only itself
                expected = i == j
            assert m[0, 0, i, j] == expected, (i, j)


def test_step_t_mask_rejects_window_one():
    with pytest.raises(ValueError, match="w must be >= 2"):
        step_t_mask(1)


def test_combine_masks():
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    pad = padding_mask(np.array([[1, 1, 1, 0]]))  # [1, 1, 1, 4]
    cau = causal_mask(4)  # [1, 1, 4, 4]
    only = combine_masks(None, cau, None)
    np.testing.assert_array_equal(np.asarray(only), np.asarray(cau))
    both = np.asarray(combine_masks(pad, None, cau))
    assert both.shape == (1, 1, 4, 4)
    for i in range(4):
        for j in range(4):
            assert both[0, 0, i, j] == ((j <= i) and j < 3)


def test_combine_masks_rejects_non_boolean():
    with pytest.raises(ValueError, match="boolean"):
        combine_masks(causal_mask(3), jnp.ones((1, 1, 3, 3)))


def _round_half_up_keep(n, keep):
    # Independent reference: exact rational arithmetic on the decimal value of keep.
    return math.floor(Fraction(repr(keep)) * n + Fraction(1, 2))


@pytest.mark.parametrize(
    "n,keep,expected",
    [(10, 0.15, 2), (10, 0.25, 3), (7, 0.5, 4), (20, 0.35, 7), (1, 0.4, 0), (1, 0.5, 1),
     (9, 1.0, 9), (12, 0.75, 9)],
)
def test_activation_keep_count_rounds_half_up(n, keep, expected):
    assert activation_keep_count(n, keep) == expected
    assert _round_half_up_keep(n, keep) == expected


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), keep=st.floats(0.001, 1.0))
def test_activation_keep_count_property(n, keep):
    assert activation_keep_count(n, keep) == _round_half_up_keep(n, keep)


@pytest.mark.parametrize("keep", [0.0, -0.1, 1.5])
def test_activation_keep_count_rejects_bad_keep(keep):
    with pytest.raises(ValueError, match="keep must be in"):
        activation_keep_count(10, keep)


@pytest.mark.parametrize("seq_len,d_head,keep", [(7, 4, 0.5), (5, 6, 0.25), (3, 8, 1.0)])
def test_qkv_activation_masks_kept_count_and_values(seq_len, d_head, keep):
    masks = qkv_activation_masks(0, seq_len, d_head, keep)
    assert set(masks) == {"q", "k", "v"}
    expected = _round_half_up_keep(seq_len * d_head, keep)
    for m in masks.values():
        m = np.asarray(m)
        assert m.shape == (seq_len, d_head) and m.dtype == np.float32
        assert set(np.unique(m)) <= {0.0, 1.0}
        assert int(m.sum()) == expected


def test_qkv_activation_masks_deterministic_and_seeded():
    a = qkv_activation_masks(3, 16, 8, 0.5)
    b = qkv_activation_masks(3, 16, 8, 0.5)
    c = qkv_activation_masks(4, 16, 8, 0.5)
    for name in "qkv":
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    # 64 of 128 kept: two independent draws coincide with probability ~1e-37.
    assert not np.array_equal(np.asarray(a["q"]), np.asarray(c["q"]))
    assert not np.array_equal(np.asarray(a["q"]), np.asarray(a["k"]))
    assert not np.array_equal(np.asarray(a["k"]), np.asarray(a["v"]))


def test_qkv_activation_masks_positions_are_uniform():
    # Over many seeds every position is kept about keep of the time: the kept set is a random
    # subset, not e.g. the first n_keep positions. Fixed seeds, so this is deterministic.
    freq = np.mean([qkv_activation_masks(s, 6, 4, 0.5)["v"] for s in range(100)], axis=0)
    assert np.all(np.abs(freq - 0.5) < 0.2), freq


def test_qkv_activation_masks_are_constants_under_jit():
    # Called while tracing, the masks are still concrete values (compile-time constants).
    seen = {}

    @jax.jit
    def f(x):
        m = qkv_activation_masks(1, 4, 2, 0.5)["q"]
        seen["m"] = m
        return x * m

    out = f(jnp.ones((4, 2)))
    assert isinstance(seen["m"], np.ndarray) and not seen["m"].flags.writeable
    np.testing.assert_array_equal(np.asarray(out), qkv_activation_masks(1, 4, 2, 0.5)["q"])
