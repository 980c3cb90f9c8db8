"""LayerNorm and T5 RMSNorm against plain float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.nn import NormConfig, apply_norm, init_norm

TOL = 1e-5


def rand(seed, shape, scale=1.0, shift=0.0):
    z = shift + scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(z.astype(np.float32))


def np_layer_norm(x, scale, bias, eps):
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    mean = x.sum(-1, keepdims=True) / d
    var = ((x - mean) ** 2).sum(-1, keepdims=True) / d  # biased variance
    y = (x - mean) / np.sqrt(var + eps) * np.asarray(scale, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


def np_rms_norm(x, scale, eps):
    # HF T5LayerNorm: variance = mean(x^2); x * rsqrt(variance + eps) * weight.
    x = np.asarray(x, np.float64)
    ms = (x ** 2).mean(-1, keepdims=True)
    return x / np.sqrt(ms + eps) * np.asarray(scale, np.float64)


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


norm = jax.jit(apply_norm, static_argnames=("cfg",))


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 1e-12, 0.5])
def test_layer_norm(use_bias, eps):
    cfg = NormConfig("layer", eps=eps, use_bias=use_bias)
    p = {"scale": rand(1, (12,), 0.5, 1.0)}
    if use_bias:
        p["bias"] = rand(2, (12,))
    x = rand(3, (2, 5, 12), 3.0, 2.0)  # non-zero mean: LayerNorm must subtract it
    ref = np_layer_norm(x, p["scale"], p.get("bias"), eps)
    assert max_err(norm(p, x, cfg=cfg), ref) <= TOL


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_norm_matches_t5(eps):
    cfg = NormConfig("rms", eps=eps)
    p = {"scale": rand(4, (12,), 0.5, 1.0)}
    x = rand(5, (2, 5, 12), 3.0, 2.0)
    y = norm(p, x, cfg=cfg)
    assert max_err(y, np_rms_norm(x, p["scale"], eps)) <= TOL
    # No mean subtraction: differs from LayerNorm on inputs with a mean.
    assert max_err(y, np_layer_norm(x, p["scale"], None, eps)) > 1e-2


def test_small_inputs_eps_matters():
    x = rand(6, (3, 8), 1e-3)
    for kind in ("layer", "rms"):
        cfg = NormConfig(kind, eps=1e-6)
        p = init_norm(8, cfg)
        ref = (np_rms_norm(x, p["scale"], 1e-6) if kind == "rms"
               else np_layer_norm(x, p["scale"], p["bias"], 1e-6))
        assert max_err(norm(p, x, cfg=cfg), ref) <= TOL


def test_init_norm():
    p = init_norm(6, NormConfig("layer"))
    assert set(p) == {"scale", "bias"}
    np.testing.assert_array_equal(np.asarray(p["scale"]), np.ones(6))
    np.testing.assert_array_equal(np.asarray(p["bias"]), np.zeros(6))
    assert set(init_norm(6, NormConfig("layer", use_bias=False))) == {"scale"}
    assert set(init_norm(6, NormConfig("rms"))) == {"scale"}  # T5: never a bias
    assert set(init_norm(6, NormConfig("rms", use_bias=True))) == {"scale"}


def test_low_precision_input_keeps_dtype():
    cfg = NormConfig("rms")
    x = rand(7, (2, 8)).astype(jnp.bfloat16)
    p = init_norm(8, cfg)
    y = apply_norm(p, x, cfg)
    assert y.dtype == jnp.bfloat16
    ref = np_rms_norm(np.asarray(x.astype(jnp.float32)), p["scale"], 1e-6)
    assert max_err(y.astype(jnp.float32), ref) <= 1e-2  # bfloat16 output rounding


def test_jit_eager_and_grad():
    cfg = NormConfig("layer")
    p = {"scale": rand(8, (8,), 0.5, 1.0), "bias": rand(9, (8,))}
    x = rand(10, (2, 3, 8))
    assert max_err(apply_norm(p, x, cfg), norm(p, x, cfg=cfg)) <= TOL
    g = jax.jit(jax.grad(lambda p: jnp.sum(apply_norm(p, x, cfg) ** 3)))(p)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)


@pytest.mark.parametrize("kwargs,field", [({"kind": "batch"}, "kind"), ({"eps": 0.0}, "eps"),
                                          ({"eps": -1.0}, "eps")])
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NormConfig(**kwargs)


def test_scale_shape_mismatch_raises():
    with pytest.raises(ValueError, match="'scale' must have shape"):
        apply_norm({"scale": jnp.ones(5)}, jnp.ones((2, 6)), NormConfig("rms"))
