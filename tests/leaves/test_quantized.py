"""Int8 / Int4 / FakeQuant / ProductLeaf / SumLeaf: codes and products against a NumPy
round-to-nearest reference (dequantize, then multiply in float64), exact storage counts, the
size on disk, bit-exact save/load, exact surgery (irregular groups after removing inputs),
placement, and the straight-through estimator."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lowrank_jax import leaves as L
from lowrank_jax.errors import ConfigError, ShapeError


def f32(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def np_rtn(w, bits, group, zero_point, scale_dtype, scales=None):
    """NumPy reference: codes, scales and zeros per group of rows (last group shorter), and the
    dequantized matrix, in float64 from float32 arithmetic of the scale. ``scales`` (``[G,
    d_out]``): take these (a leaf's, as stored) instead of computing them: XLA may divide by
    the constant ``qmax`` through its reciprocal, one ulp away from NumPy's quotient."""
    w = np.asarray(w, np.float32)
    d_in, d_out = w.shape
    g = d_in if group is None else group
    qmax = 2 ** (bits - 1) - 1
    cs, ss, zs, deq = [], [], [], []
    for s in range(0, d_in, g):
        blk = w[s:s + g]
        if zero_point:
            lo = np.minimum(blk.min(0), 0)
            hi = np.maximum(blk.max(0), 0)
            flat = (lo == 0) & (hi == 0)
            lo, hi = np.where(flat, -1, lo), np.where(flat, 1, hi)
            scale = ((hi - lo) / np.float32(15)).astype(np.float32)
        else:
            amax = np.abs(blk).max(0)
            scale = np.where(amax == 0, np.float32(1), amax / np.float32(qmax)).astype(np.float32)
        if scale_dtype == "bfloat16":
            scale = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
        if scales is not None:
            np.testing.assert_allclose(scales[len(ss)], scale, rtol=2.0 ** -22, atol=0)
            scale = np.asarray(scales[len(ss)], np.float32)
        if zero_point:
            zero = np.clip(np.round(-lo / scale), 0, 15)
            c = np.clip(np.round(blk / scale) + zero, 0, 15)
        else:
            zero = np.zeros_like(scale)
            c = np.clip(np.round(blk / scale), -qmax, qmax)
        cs.append(c)
        ss.append(scale)
        zs.append(zero)
        deq.append((c.astype(np.float64) - zero) * scale.astype(np.float64))
    return np.concatenate(cs), np.stack(ss), np.stack(zs), np.concatenate(deq)


def nbytes(tree):
    return sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_int8_codes_and_product_match_numpy(scale_dtype):
    w, b = f32(0, (70, 9)), f32(1, (9,))
    leaf = L.Int8.quantize(w, jnp.asarray(b), scale_dtype=scale_dtype)
    c, s, _, deq = np_rtn(w, 8, None, False, scale_dtype,
                          np.asarray(leaf.scale, np.float32)[None])
    np.testing.assert_array_equal(np.asarray(leaf.q), c.astype(np.int8))
    np.testing.assert_array_equal(np.asarray(leaf.scale, np.float32), s[0])
    assert leaf.scale.dtype == jnp.dtype(scale_dtype)
    x = f32(2, (3, 5, 70))
    ref = x.astype(np.float64) @ deq + b
    for y in (L.linear(leaf, jnp.asarray(x)), jax.jit(L.linear)(leaf, jnp.asarray(x))):
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(L.materialize(leaf)), deq, rtol=1e-6, atol=0)
    # exact counts: the arrays' bytes x 8
    assert leaf.storage_bits() == nbytes(leaf) * 8 == 70 * 9 * 8 + 9 * (
        32 if scale_dtype == "float32" else 16) + 9 * 32
    assert leaf.param_count() == 70 * 9 + 9 + 9
    assert leaf.flops(4) == 4 * 70 * 9


def np_w8a8(x, q, scale, b=None):
    """NumPy W8A8 reference: each row of ``x`` quantized (``s = max |x| * float32(1/127)``,
    ``round(x * (1 / s))``, clip to +-127), the integer product in int64, rescaled by row scale
    x column scale in float32."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    sx = np.where(amax == 0, np.float32(1), amax * np.float32(1 / 127)).astype(np.float32)
    xq = np.clip(np.round(x * (np.float32(1) / sx)), -127, 127).astype(np.int64)
    acc = xq @ np.asarray(q).astype(np.int64)
    y = acc.astype(np.float32) * sx * np.asarray(scale, np.float32)
    return y if b is None else y + np.asarray(b, np.float32), xq, sx


def test_int8_activations_product_matches_numpy():
    w, b = f32(30, (300, 9)), f32(31, (9,))
    leaf = L.Int8A8.quantize(w, jnp.asarray(b))
    weight_only = L.Int8.quantize(w, jnp.asarray(b))
    np.testing.assert_array_equal(np.asarray(leaf.q), np.asarray(weight_only.q))
    x = f32(32, (2, 5, 300)) * np.float32(10) ** np.linspace(-3, 3, 5, dtype=np.float32)[:, None]
    x[0, 1] = 0.0  # a row of zeros: scale 1, output the bias
    x[1, 2, 7] = 500.0  # an outlier: a coarse grid for the rest of its row
    ref, xq, sx = np_w8a8(x, leaf.q, leaf.scale, b)
    codes, scale = L.quantized.quantize_rows(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(codes), xq)
    np.testing.assert_array_equal(np.asarray(scale), sx)
    assert codes.dtype == jnp.int8 and scale.dtype == jnp.float32
    # codes bit for bit also on a large array, where values at a rounding midpoint occur (a
    # division x / s compiled as x * (1 / s) moves some of them to the next code)
    big = np.asarray(jax.random.normal(jax.random.key(1), (2048, 768), jnp.float32))
    amax = np.abs(big).max(-1, keepdims=True)
    sb = (amax * np.float32(1 / 127)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(L.quantized.quantize_rows)(big)[0]),
                                  np.clip(np.round(big * (np.float32(1) / sb)), -127, 127))
    for y in (L.linear(leaf, jnp.asarray(x)), jax.jit(L.linear)(leaf, jnp.asarray(x))):
        assert y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(L.linear(leaf, jnp.asarray(x)))[0, 1], b)
    # the activations' rounding is real: not the weight-only product
    wo = np.asarray(L.linear(weight_only, jnp.asarray(x)), np.float64)
    assert np.abs(wo - ref).max() > 1e3 * np.abs(np.asarray(jax.jit(L.linear)(
        leaf, jnp.asarray(x))) - ref).max()
    # the integer product in the compiled program
    hlo = jax.jit(L.linear).lower(leaf, jnp.asarray(x)).as_text()
    assert "xi8>, tensor<300x9xi8>) -> tensor<2x5x9xi32>" in hlo
    # materialize: the dequantized weight; counts those of the weight-only leaf
    np.testing.assert_array_equal(np.asarray(L.materialize(leaf)),
                                  np.asarray(L.materialize(weight_only)))
    assert leaf.storage_bits() == weight_only.storage_bits() == nbytes(leaf) * 8
    assert leaf.param_count() == weight_only.param_count()
    assert leaf.flops(7) == 7 * 300 * 9
    # bfloat16 inputs: computed in float32, returned in bfloat16
    yb = L.linear(L.Int8A8.quantize(w), jnp.asarray(x[0], jnp.bfloat16))
    assert yb.dtype == jnp.bfloat16
    # surgery keeps the kind; the product on the kept inputs matches NumPy
    rows, cols = np.array([0, 4, 100, 299]), np.array([2, 8])
    kept = L.keep_outputs(L.keep_inputs(leaf, rows), cols)
    assert type(kept) is L.Int8A8
    xs = f32(33, (4, 4))
    np.testing.assert_allclose(np.asarray(L.linear(kept, jnp.asarray(xs))),
                               np_w8a8(xs, np.asarray(leaf.q)[rows][:, cols],
                                       np.asarray(leaf.scale)[cols], b[cols])[0], rtol=1e-6,
                               atol=1e-6)
    # built from the options
    assert type(L.quantize_weight(w, bits=8, activations="int8")) is L.Int8A8
    assert type(L.quantized.Int8A8.from_int8(weight_only)) is L.Int8A8
    with pytest.raises(ConfigError, match="int8 activations need 8-bit weights.*bits=4"):
        L.quantize_weight(w, bits=4, activations="int8")
    with pytest.raises(ConfigError, match="activations must be None.*'fp8'"):
        L.quantize_weight(w, bits=8, activations="fp8")


@pytest.mark.parametrize("d_in,group,zero_point,scale_dtype", [
    (128, 32, False, "float32"), (128, 64, True, "float32"), (256, 128, False, "bfloat16"),
    (100, 32, False, "float32"),   # last group of 4 rows
    (101, 64, True, "bfloat16"),   # odd: padded nibble, last group of 37
    (45, None, False, "float32"),  # one group per output channel
])
def test_int4_codes_and_product_match_numpy(d_in, group, zero_point, scale_dtype):
    w = f32(3, (d_in, 11))
    w[:, 3] = 0.0  # a zero column: scale 1 or range [-1, 1]
    leaf = L.Int4.quantize(w, group=group, zero_point=zero_point, scale_dtype=scale_dtype)
    c, s, z, deq = np_rtn(w, 4, group, zero_point, scale_dtype,
                          np.asarray(leaf.scale, np.float32))
    nib = np.asarray(leaf.nibbles()).astype(np.int64)
    np.testing.assert_array_equal(nib, c + (0 if zero_point else 8))
    np.testing.assert_array_equal(np.asarray(leaf.scale, np.float32), s)
    if zero_point:
        np.testing.assert_array_equal(np.asarray(leaf.zero), z.astype(np.uint8))
    else:
        assert leaf.zero is None
    # packing: row 2k low nibble, 2k+1 high nibble, independent of unpack_nibbles
    p = np.asarray(leaf.packed)
    assert p.dtype == np.uint8 and p.shape == ((d_in + 1) // 2, 11)
    np.testing.assert_array_equal(p & 15, nib[0::2])
    np.testing.assert_array_equal((p >> 4)[: d_in // 2], nib[1::2])
    if d_in % 2:
        assert not (p[-1] >> 4).any()
    x = f32(4, (2, 7, d_in))
    ref = x.astype(np.float64) @ deq
    for y in (L.linear(leaf, jnp.asarray(x)), jax.jit(L.linear)(leaf, jnp.asarray(x))):
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    n_groups = -(-d_in // (group or d_in))
    sbits = 32 if scale_dtype == "float32" else 16
    want = ((d_in + 1) // 2) * 11 * 8 + n_groups * 11 * (sbits + (8 if zero_point else 0))
    assert leaf.storage_bits() == nbytes(leaf) * 8 == want
    assert leaf.param_count() == d_in * 11 + n_groups * 11 * (2 if zero_point else 1)


@pytest.mark.parametrize("scale_dtype,bits_per_weight", [("float32", 4.25), ("bfloat16", 4.125)])
def test_int4_group128_bits_per_weight(scale_dtype, bits_per_weight):
    leaf = L.Int4.quantize(f32(5, (512, 64)), group=128, scale_dtype=scale_dtype)
    assert leaf.storage_bits() / (512 * 64) == bits_per_weight


def test_int4_save_load_bit_exact_and_size_on_disk(tmp_path):
    from lowrank_jax.io import load_params, save_params

    tree = {"a": L.Int4.quantize(f32(6, (2048, 512)), jnp.asarray(f32(7, (512,))), group=128),
            "z": L.Int4.quantize(f32(8, (33, 5)), group=32, zero_point=True,
                                 scale_dtype="bfloat16"),
            "q": L.Int8.quantize(f32(9, (16, 4))),
            "a8": L.Int8A8.quantize(f32(9, (16, 4)), jnp.ones(4))}
    save_params(tmp_path / "c", tree)
    back = load_params(tmp_path / "c")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(back),
                    strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back["z"].group_sizes == (32, 1)
    assert type(back["a8"]) is L.Int8A8
    # size on disk within 5 % of the counted storage, for an int4 matrix of 1 M weights whose
    # codes are uniform on 0 .. 15 (4 bits of entropy each: the checkpoint writer compresses,
    # so codes of a Gaussian weight, with less entropy, take less room on disk than counted)
    r = np.random.default_rng(0)
    sizes = L.quantized.group_sizes_for(2048, 128)
    one = L.Int4.from_codes(r.integers(0, 16, (2048, 512)), r.random((16, 512), np.float32),
                            r.integers(0, 16, (16, 512)), group_sizes=sizes)
    (tmp_path / "one").mkdir()
    save_params(tmp_path / "one" / "c", {"a": one})
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "one")
                  for f in fs)
    counted = L.storage_bits({"a": one}) / 8
    assert abs(on_disk - counted) / counted < 0.05, (on_disk, counted)


@pytest.mark.parametrize("make", [
    lambda w: L.Int8.quantize(w, jnp.arange(6.0)),
    lambda w: L.Int4.quantize(w, jnp.arange(6.0), group=16),
    lambda w: L.Int4.quantize(w, group=16, zero_point=True, scale_dtype="bfloat16"),
])
def test_surgery_is_exact(make):
    w = f32(10, (50, 6))
    leaf = make(w)
    dense = np.asarray(L.materialize(leaf))
    rows = np.array([0, 3, 15, 16, 17, 40, 49])  # groups keep 3, 3, 0 (dropped), 2 rows
    kept = L.keep_inputs(leaf, rows)
    np.testing.assert_array_equal(np.asarray(L.materialize(kept)), dense[rows])
    assert kept.storage_bits() == nbytes(kept) * 8
    cols = np.array([1, 4])
    out = L.keep_outputs(leaf, cols)
    np.testing.assert_array_equal(np.asarray(L.materialize(out)), dense[:, cols])
    x = jnp.asarray(f32(11, (3, 7)))
    b = L.bias_of(leaf)
    ref = np.asarray(x, np.float64) @ dense[rows] + (0 if b is None else np.asarray(b))
    np.testing.assert_allclose(np.asarray(L.linear(kept, x)), ref, rtol=1e-5, atol=1e-5)
    empty = L.keep_inputs(leaf, np.zeros(0, np.int64))
    assert empty.shape == (0, 6)
    assert np.asarray(L.linear(empty, jnp.zeros((2, 0)))).shape == (2, 6)


def test_irregular_groups_after_surgery_requantize_nothing():
    leaf = L.Int4.quantize(f32(12, (64, 3)), group=16)
    kept = L.keep_inputs(leaf, np.array([1, 2, 20, 40, 41, 42, 63]))
    assert kept.group_sizes == (2, 1, 3, 1)
    assert kept.scale.shape == (4, 3)
    np.testing.assert_array_equal(np.asarray(kept.scale), np.asarray(leaf.scale))


def test_placement_names_axes_and_shards():
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    tree = {"i4": L.Int4.quantize(f32(13, (64, 8)), group=32),
            "i8": L.Int8.quantize(f32(14, (64, 8)))}
    specs = L.partition_specs(tree, mesh, {"out": "model"})
    assert tuple(specs["i4"].packed) == (None, "model")
    assert tuple(specs["i4"].scale) == (None, "model")
    assert tuple(specs["i8"].q) == (None, "model")


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ConfigError, match="scale dtype"):
        L.Int4.quantize(f32(0, (8, 2)), scale_dtype="float16")
    with pytest.raises(ConfigError, match="group"):
        L.Int4.quantize(f32(0, (8, 2)), group=0)
    with pytest.raises(ShapeError, match="packed must be uint8"):
        L.Int4(packed=jnp.zeros((3, 2), jnp.int8), scale=jnp.ones((1, 2)), d_in=6,
               group_sizes=(6,))
    with pytest.raises(ShapeError, match="group_sizes"):
        L.Int4(packed=jnp.zeros((3, 2), jnp.uint8), scale=jnp.ones((1, 2)), d_in=6,
               group_sizes=(4,))
    with pytest.raises(ConfigError, match="bits"):
        L.quantize_weight(f32(0, (8, 2)), bits=3)


def test_product_and_sum_of_quantized_leaves_match_numpy():
    u, v, r = f32(15, (40, 6)), f32(16, (6, 9)), f32(17, (40, 9))
    qu, qv = L.Int4.quantize(u, group=8), L.Int8.quantize(v)
    prod = L.ProductLeaf(qu, qv, jnp.asarray(f32(18, (9,))))
    du = np_rtn(u, 4, 8, False, "float32", np.asarray(qu.scale))[3]
    dv = np_rtn(v, 8, None, False, "float32", np.asarray(qv.scale)[None])[3]
    x = f32(19, (5, 40))
    np.testing.assert_allclose(np.asarray(L.linear(prod, jnp.asarray(x))),
                               x.astype(np.float64) @ du @ dv + f32(18, (9,)), rtol=1e-5,
                               atol=1e-5)
    assert prod.storage_bits() == nbytes(prod) * 8
    assert prod.flops(3) == 3 * (40 * 6 + 6 * 9)
    res = L.Int4.quantize(r, group=8)
    s = L.SumLeaf(res, L.ProductLeaf(jnp.asarray(u), jnp.asarray(v)))
    dr = np_rtn(r, 4, 8, False, "float32", np.asarray(res.scale))[3]
    np.testing.assert_allclose(np.asarray(jax.jit(L.linear)(s, jnp.asarray(x))),
                               x.astype(np.float64) @ (dr + u.astype(np.float64) @ v),
                               rtol=1e-5, atol=1e-5)
    assert s.storage_bits() == nbytes(s) * 8
    kept = L.keep_inputs(s, np.array([0, 5, 39]))
    np.testing.assert_allclose(np.asarray(L.materialize(kept)),
                               np.asarray(L.materialize(s))[[0, 5, 39]], rtol=1e-6, atol=1e-6)
    assert L.is_quantized(s) and L.is_quantized(prod) and not L.is_quantized(L.Dense(u))
    flat = L.dequantize_tree({"s": s, "p": prod, "d": L.Dense(jnp.asarray(u))})
    assert not L.is_quantized(flat)
    np.testing.assert_array_equal(np.asarray(L.materialize(flat["s"])),
                                  np.asarray(L.materialize(s)))
    np.testing.assert_array_equal(np.asarray(L.bias_of(flat["p"])), f32(18, (9,)))


def test_fake_quant_forward_is_the_frozen_leaf_and_gradient_passes_straight_through():
    w = f32(20, (48, 5))
    fq = L.FakeQuant(jnp.asarray(w), bits=4, group=16)
    frozen = fq.freeze()
    np.testing.assert_array_equal(np.asarray(L.materialize(fq)), np.asarray(L.materialize(frozen)))
    assert fq.storage_bits() == frozen.storage_bits()
    assert fq.param_count() == frozen.param_count()
    x = jnp.asarray(f32(21, (4, 48)))
    g = jax.grad(lambda leaf: jnp.sum(L.linear(leaf, x) ** 2))(fq).w
    # straight through: d/dw sum((x Q)^2) with dQ/dw = I is x^T (2 x Q)
    y = np.asarray(x, np.float64) @ np.asarray(L.materialize(frozen), np.float64)
    np.testing.assert_allclose(np.asarray(g), np.asarray(x, np.float64).T @ (2 * y), rtol=1e-4,
                               atol=1e-4)
    f8 = L.FakeQuant(jnp.asarray(w), bits=8, group=None)
    np.testing.assert_allclose(np.asarray(L.materialize(f8)),
                               np_rtn(w, 8, None, False, "float32",
                                      np.asarray(f8.freeze().scale)[None])[3], rtol=1e-6, atol=0)


def test_guide_examples_run(capsys):
    import pathlib
    import re

    guide = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "quantization.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S)
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"quantization.md python block {i}", "exec"), {})  # noqa: S102
    assert "4.25 8.0625" in capsys.readouterr().out
