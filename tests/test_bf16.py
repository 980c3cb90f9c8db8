"""bf16 inference (lowrank_jax.nn.precision): every matmul on bfloat16 operands accumulated in
float32, checked against a NumPy emulation of that arithmetic (operands rounded to bf16,
products summed in float64), against the float32 forward of a compressed Chronos-Bolt (bf16
error), and in the program itself (each dot_general's operand dtypes and
preferred_element_type), inside jit, fori_loop and scan too."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import leaves as L
from lowrank_jax.errors import ConfigError
from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt
from lowrank_jax.nn.attention import fold_keys
from lowrank_jax.nn.precision import (
    bf16_forward,
    cast_weights,
    dot_accumulation_dtypes,
    with_matmul_dtype,
)


def bf16(a) -> np.ndarray:
    """NumPy: round to bfloat16 (round to nearest even), back to float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def rng_f32(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def mlp(params, x):
    h = jax.nn.relu(lj.linear(params["wi"], x))
    return lj.linear(params["wo"], h) * params["scale"]


def mlp_params():
    return {"wi": L.Dense(jnp.asarray(rng_f32(1, (24, 40))), jnp.asarray(rng_f32(2, (40,)))),
            "wo": L.LowRank(jnp.asarray(rng_f32(3, (40, 6))), jnp.asarray(rng_f32(4, (6, 16)))),
            "scale": jnp.asarray(rng_f32(5, (16,)))}


def test_mlp_equals_numpy_emulation_of_bf16_operands_float32_accumulation():
    p = mlp_params()
    x = rng_f32(6, (3, 7, 24))
    got = np.asarray(jax.jit(bf16_forward(mlp))(p, jnp.asarray(x)))
    assert got.dtype == np.float32 and got.shape == (3, 7, 16)
    # NumPy: weights stored in bf16 (cast_weights), matmul operands rounded to bf16, sums in
    # float64 (float32 accumulation differs from them by float32 round-off only), results in
    # float32; the bias add, relu and the non-leaf scale in float32.
    wi, bi = bf16(p["wi"].w), bf16(p["wi"].b)
    u, v = bf16(p["wo"].u), bf16(p["wo"].v)

    def f32(a):
        return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)

    h = np.maximum(f32(f32(bf16(x) @ wi) + bi), 0.0)
    t = f32(bf16(h) @ u)
    ref = f32(bf16(t) @ v) * np.asarray(p["scale"], np.float64)
    scale = (np.abs(bf16(h)) @ np.abs(u)) @ np.abs(v) * np.abs(np.asarray(p["scale"]))
    assert np.all(np.abs(got - ref) <= 1e-5 * scale + 1e-6)
    # ... and it is not the float32 forward: the operands really were rounded.
    full = np.asarray(jax.jit(mlp)(p, jnp.asarray(x)))
    assert np.max(np.abs(got - full)) > 1e-4 * np.max(np.abs(full))


def test_program_multiplies_bf16_and_accumulates_float32():
    p = mlp_params()
    x = jnp.asarray(rng_f32(6, (5, 24)))
    dots = dot_accumulation_dtypes(bf16_forward(mlp), p, x)
    assert len(dots) == 3
    assert all(pref == jnp.float32 and ops == (jnp.bfloat16, jnp.bfloat16)
               for pref, ops in dots), dots
    # The check can fail: the same program on bf16 weights and inputs, untransformed,
    # accumulates in bf16.
    plain = dot_accumulation_dtypes(mlp, cast_weights(p), x.astype(jnp.bfloat16))
    assert all(pref == jnp.bfloat16 for pref, _ in plain), plain


def test_cast_weights_touches_only_float_arrays_of_leaves():
    mb = L.init_masked_binary(jax.random.PRNGKey(0), 40, 8, 0.5)
    tree = {"dense": L.Dense(jnp.ones((3, 4)), jnp.ones((4,))), "norm": jnp.ones((4,)),
            "packed": L.PackedBinary.from_leaf(mb), "frozen": mb.freeze()}
    out = cast_weights(tree)
    assert out["dense"].w.dtype == jnp.bfloat16 and out["dense"].b.dtype == jnp.bfloat16
    assert out["norm"].dtype == jnp.float32
    assert out["packed"].sign_bits.dtype == jnp.uint32 and out["packed"].alpha.dtype == \
        jnp.bfloat16
    assert out["frozen"].signs.dtype == jnp.int8
    with pytest.raises(ConfigError, match="dtype"):
        cast_weights(tree, jnp.int8)
    with pytest.raises(ConfigError, match="accumulate"):
        with_matmul_dtype(mlp, accumulate=jnp.int32)


def test_loops_and_nested_jit_are_transformed():
    w = jnp.asarray(rng_f32(7, (8, 8)) / 3)

    def body(x):
        @jax.jit
        def step(v):
            return jnp.tanh(v @ w)
        y = jax.lax.fori_loop(0, 3, lambda i, v: step(v), x)
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), y, None, length=2)
        return y

    x = jnp.asarray(rng_f32(8, (4, 8)))
    f = with_matmul_dtype(body)
    dots = dot_accumulation_dtypes(f, x)
    assert len(dots) == 2 and all(p == jnp.float32 and o == (jnp.bfloat16, jnp.bfloat16)
                                  for p, o in dots), dots
    ref = np.asarray(x, np.float64)
    w64 = bf16(w)
    for _ in range(5):
        ref = np.tanh(np.asarray(bf16(ref) @ w64, np.float32).astype(np.float64))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x)), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("compressed", [True, False])
def test_chronos_bolt_bf16_error_is_bf16_sized(compressed):
    """Compressed (SVD attention, packed binary embedding) and dense: the dense decoder's
    cross-attention runs with its keys folded into the queries (its own einsums, which
    XLA:CPU must have bf16 kernels for)."""
    cfg = ChronosBoltConfig(t5=T5Config(vocab_size=2, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                        num_decoder_layers=1, num_heads=4),
                            context_length=64, prediction_length=16, input_patch_size=16,
                            input_patch_stride=16, use_reg_token=True)
    params = chronos_bolt.init(jax.random.PRNGKey(0), cfg)
    plan = lj.Plan((lj.Step("svd", (r"attn/(qk/q|qk/k|v|o)$",), {"rank": 4}),
                    lj.Step("binarize", (r"input_patch_embedding/",), {"keep": 0.5})))
    if compressed:
        small, _ = lj.apply_plan(params, plan, config=cfg, key=jax.random.PRNGKey(1))
        small = L.pack_binary_tree(small)
    else:
        small = params
        cross = params["decoder"]["layers"][0]["cross_attn"]
        assert fold_keys(cross, 1, 5)  # 4 patches + [REG]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 64)).cumsum(1), jnp.float32)

    def fwd(p, c):
        return chronos_bolt.forecast(p, c, cfg)

    y32 = np.asarray(jax.jit(fwd)(small, x))
    y16 = np.asarray(jax.jit(bf16_forward(fwd))(small, x))
    rel = np.max(np.abs(y16 - y32)) / np.max(np.abs(y32))
    assert 1e-5 < rel < 1e-2, rel  # bf16 has an 8-bit significand: 2^-9 = 2e-3 per rounding
    dots = dot_accumulation_dtypes(bf16_forward(fwd), small, x)
    assert dots and all(p == jnp.float32 and o == (jnp.bfloat16, jnp.bfloat16)
                        for p, o in dots)
