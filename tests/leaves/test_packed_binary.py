"""PackedBinary: bit packing against NumPy's packbits, packed ``linear`` = the float
masked-binary leaf's output exactly (eager and jit), the XNOR/popcount identity, the stored
bits, and save/load through lowrank_jax.io holding uint32 words."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import leaves as L
from lowrank_jax.errors import LeafTypeError, ShapeError


def f32(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def masked(seed=0, d_in=45, d_out=7, keep=0.5, bias=False):
    b = jnp.asarray(f32(seed + 2, (d_out,))) if bias else None
    return L.MaskedBinary(jnp.asarray(f32(seed, (d_in, d_out))),
                          jnp.asarray(f32(seed + 1, (d_in, d_out))), b, keep=keep)


def test_pack_bits_matches_numpy_packbits_and_round_trips():
    r = np.random.default_rng(0)
    bits = r.random((5, 70)) < 0.4
    words = L.pack_bits(bits)
    assert words.dtype == np.uint32 and words.shape == (5, 3)
    # Independent reference: numpy packbits (little bit order) on 96 zero-padded bits, read as
    # little-endian uint32 words.
    padded = np.concatenate([bits, np.zeros((5, 26), bool)], axis=1)
    ref = np.packbits(padded, axis=1, bitorder="little").view("<u4")
    np.testing.assert_array_equal(words, ref)
    back = np.asarray(L.unpack_bits(jnp.asarray(words), 70))
    np.testing.assert_array_equal(back.astype(bool), bits)
    np.testing.assert_array_equal(np.asarray(jax.jit(L.unpack_bits, static_argnums=1)(
        jnp.asarray(words), 70)).astype(bool), bits)


@pytest.mark.parametrize("d_in,d_out,keep,bias", [(45, 7, 0.5, False), (32, 5, 0.25, True),
                                                  (3, 40, 0.9, False)])
def test_packed_linear_equals_masked_binary_exactly(d_in, d_out, keep, bias):
    mb = masked(1, d_in, d_out, keep, bias)
    pb = L.PackedBinary.from_leaf(mb)
    assert pb.shape == mb.shape and pb.n_keep == mb.n_keep
    # Planes against NumPy: mask bit = top-|s| mask, sign bit = w < 0 where kept (pruned
    # positions store sign bit 0).
    sign, mask = (np.asarray(a) for a in pb.planes())
    np.testing.assert_array_equal(mask, np.asarray(mb.mask()))
    np.testing.assert_array_equal(sign * mask,
                                  np.where(np.asarray(mb.w) >= 0, 1.0, -1.0) * mask)
    x = jnp.asarray(f32(9, (6, 4, d_in)))
    np.testing.assert_array_equal(np.asarray(L.linear(pb, x)), np.asarray(L.linear(mb, x)))
    np.testing.assert_array_equal(np.asarray(jax.jit(L.linear)(pb, x)),
                                  np.asarray(jax.jit(L.linear)(mb, x)))
    np.testing.assert_array_equal(np.asarray(L.materialize(pb)), np.asarray(L.materialize(mb)))
    # Counts: two bit planes with padding, float32 alpha, bias; executed flops are dense.
    words = -(-d_in // 32)
    assert L.storage_bits(pb) == 2 * d_out * words * 32 + 32 + (32 * d_out if bias else 0)
    assert L.flops(pb, 3) == 3 * d_in * d_out
    assert L.param_count(pb) == L.param_count(mb)


def test_xnor_popcount_equals_integer_matmul():
    pb = L.PackedBinary.from_leaf(masked(3, 70, 9, 0.5))
    r = np.random.default_rng(4)
    x = np.where(r.random((5, 70)) < 0.5, -1.0, 1.0).astype(np.float32)
    got = np.asarray(L.xnor_dot(pb, L.pack_pm1(jnp.asarray(x))))
    assert got.dtype == np.int32
    ternary = pb.signs_int8().astype(np.int64)
    np.testing.assert_array_equal(got, x.astype(np.int64) @ ternary)
    with pytest.raises(ShapeError):
        L.xnor_dot(pb, jnp.zeros((5, 2), jnp.uint32))


def test_surgery_and_bad_input():
    mb = masked(5, 40, 6, 0.5, bias=True)
    pb = L.PackedBinary.from_leaf(mb)
    idx = np.array([0, 3, 39])
    x = jnp.asarray(f32(6, (2, 3)))
    np.testing.assert_array_equal(np.asarray(L.linear(L.keep_inputs(pb, idx), x)),
                                  np.asarray(L.linear(L.keep_inputs(mb, idx), x)))
    out = L.keep_outputs(pb, np.array([1, 5]))
    xo = jnp.asarray(f32(7, (2, 40)))
    np.testing.assert_array_equal(np.asarray(L.linear(out, xo)),
                                  np.asarray(L.linear(mb, xo))[:, [1, 5]])
    with pytest.raises(LeafTypeError):
        L.PackedBinary.from_leaf(L.Dense(jnp.ones((2, 2))))
    with pytest.raises(ShapeError):
        L.PackedBinary(jnp.zeros((3, 1), jnp.int32), jnp.zeros((3, 1), jnp.uint32),
                       jnp.float32(1.0), d_in=4)


def test_packed_tree_saved_as_bits(tmp_path):
    from lowrank_jax.io import load_params, save_params

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"a": L.FixedBias(L.init_masked_binary(k[0], 64, 64, 0.5), jnp.ones((64,))),
              "b": [L.init_masked_binary(k[1], 64, 128, 0.25)], "n": jnp.ones((3,))}
    packed = L.pack_binary_tree(params)
    assert isinstance(packed["a"], L.FixedBias) and isinstance(packed["a"].leaf, L.PackedBinary)
    assert isinstance(packed["b"][0], L.PackedBinary)
    save_params(tmp_path / "p", packed)
    back = load_params(tmp_path / "p")
    assert back["b"][0].sign_bits.dtype == jnp.uint32 and back["b"][0].n_keep == \
        packed["b"][0].n_keep
    x = jnp.asarray(f32(1, (2, 64)))
    for name in ("a",):
        np.testing.assert_array_equal(np.asarray(L.linear(back[name], x)),
                                      np.asarray(L.linear(params[name], x)))
    np.testing.assert_array_equal(np.asarray(L.linear(back["b"][0], x)),
                                  np.asarray(L.linear(params["b"][0], x)))
    # The stored words: 2 bits per weight in the array files, not 32.
    save_params(tmp_path / "f", jax.tree_util.tree_map(lambda a: a, params))

    def arrays_bytes(p):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p / "arrays")
                   for f in fs)
    assert arrays_bytes(tmp_path / "p") < arrays_bytes(tmp_path / "f")
    # 2 bit planes of ceil(64 / 32) = 2 words per output, a float32 alpha, float biases.
    assert lj.storage_bits(packed) == (2 * 64 * 2 * 32 + 32 + 64 * 32) + (2 * 128 * 2 * 32 + 32) \
        + 3 * 32
