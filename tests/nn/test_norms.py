"""LayerNorm and T5 RMSNorm against plain float64 NumPy; BatchNorm against PyTorch's
``BatchNorm1d``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.nn import (
    BatchNormConfig,
    NormConfig,
    apply_batch_norm,
    apply_norm,
    init_batch_norm,
    init_norm,
)

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
    with pytest.raises(ConfigError, match=field):
        NormConfig(**kwargs)


def test_scale_shape_mismatch_raises():
    with pytest.raises(ShapeError, match="'scale' must have shape"):
        apply_norm({"scale": jnp.ones(5)}, jnp.ones((2, 6)), NormConfig("rms"))


# ---------------------------------------------------------------------------------------------
# BatchNorm: PyTorch BatchNorm1d on [batch, features, time] is the reference.

bn = jax.jit(apply_batch_norm, static_argnames=("cfg", "train"))


@pytest.mark.parametrize("momentum,eps", [(0.1, 1e-5), (0.3, 1e-3)])
def test_batch_norm_matches_torch_train_then_eval(momentum, eps):
    import torch  # the reference; imported here so the other tests do not pay for it
    d = 6
    cfg = BatchNormConfig(eps=eps, momentum=momentum)
    params, state = init_batch_norm(d)
    params = {"scale": rand(20, (d,), 0.5, 1.0), "bias": rand(21, (d,))}
    ref = torch.nn.BatchNorm1d(d, eps=eps, momentum=momentum)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(np.array(params["scale"])))
        ref.bias.copy_(torch.tensor(np.array(params["bias"])))
    ref.train()
    for step in range(2):  # two training steps: running statistics follow PyTorch's update
        x = rand(22 + step, (4, d, 5), 2.0, 1.5)  # [batch, features, time] as torch wants it
        with torch.no_grad():
            y_ref = ref(torch.tensor(np.array(x))).numpy()
        y, state = bn(params, jnp.transpose(x, (0, 2, 1)), cfg=cfg, state=state, train=True)
        assert max_err(jnp.transpose(y, (0, 2, 1)), y_ref) <= TOL
        assert max_err(state["mean"], ref.running_mean.numpy()) <= TOL
        assert max_err(state["var"], ref.running_var.numpy()) <= TOL
    ref.eval()
    x = rand(30, (3, d, 7), 2.0, -1.0)
    with torch.no_grad():
        y_ref = ref(torch.tensor(np.array(x))).numpy()
    y, new_state = bn(params, jnp.transpose(x, (0, 2, 1)), cfg=cfg, state=state, train=False)
    assert max_err(jnp.transpose(y, (0, 2, 1)), y_ref) <= TOL
    for k in ("mean", "var"):  # evaluation leaves the running statistics unchanged
        np.testing.assert_array_equal(np.asarray(new_state[k]), np.asarray(state[k]))


def test_batch_norm_train_and_eval_against_numpy():
    # Independent of torch: statistics over every axis but the last, biased variance to
    # normalize, unbiased variance in the running average.
    d, cfg = 3, BatchNormConfig(eps=1e-5, momentum=0.25)
    params = {"scale": rand(40, (d,), 0.5, 1.0), "bias": rand(41, (d,))}
    state = {"mean": rand(42, (d,)), "var": rand(43, (d,), 0.1, 1.0)}
    x = rand(44, (2, 3, 4, d), 1.5, 0.5)  # any number of leading axes
    xn = np.asarray(x, np.float64).reshape(-1, d)
    mean, var = xn.mean(0), xn.var(0)
    scale, bias = np.asarray(params["scale"], np.float64), np.asarray(params["bias"], np.float64)
    y, new = bn(params, x, cfg=cfg, state=state, train=True)
    ref = (np.asarray(x, np.float64) - mean) / np.sqrt(var + 1e-5) * scale + bias
    assert max_err(y, ref) <= TOL
    n = xn.shape[0]
    assert max_err(new["mean"], 0.75 * np.asarray(state["mean"]) + 0.25 * mean) <= TOL
    assert max_err(new["var"], 0.75 * np.asarray(state["var"]) + 0.25 * var * n / (n - 1)) <= TOL
    y_eval, _ = bn(params, x, cfg=cfg, state=state, train=False)
    rm, rv = np.asarray(state["mean"], np.float64), np.asarray(state["var"], np.float64)
    assert max_err(y_eval, (np.asarray(x, np.float64) - rm) / np.sqrt(rv + 1e-5) * scale
                   + bias) <= TOL


def test_init_batch_norm_and_errors():
    params, state = init_batch_norm(4)
    np.testing.assert_array_equal(np.asarray(params["scale"]), np.ones(4))
    np.testing.assert_array_equal(np.asarray(params["bias"]), np.zeros(4))
    np.testing.assert_array_equal(np.asarray(state["mean"]), np.zeros(4))
    np.testing.assert_array_equal(np.asarray(state["var"]), np.ones(4))
    with pytest.raises(ConfigError, match="d must be a positive int"):
        init_batch_norm(0)
    with pytest.raises(ShapeError, match="'scale' must have shape"):
        apply_batch_norm(params, jnp.ones((2, 5)), BatchNormConfig(), state=state, train=True)
    for kwargs, field in (({"eps": 0.0}, "eps"), ({"momentum": 1.5}, "momentum")):
        with pytest.raises(ConfigError, match=field):
            BatchNormConfig(**kwargs)


def test_batch_norm_grad_reaches_params_not_state():
    cfg = BatchNormConfig()
    params, state = init_batch_norm(3)
    x = rand(50, (4, 5, 3))

    def loss(p):
        y, _ = apply_batch_norm(p, x, cfg, state=state, train=True)
        return jnp.sum(y * rand(51, (4, 5, 3)))

    g = jax.grad(loss)(params)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(params)
    # d/d bias of sum(y * r) is sum(r) over the batch axes.
    np.testing.assert_allclose(np.asarray(g["bias"]),
                               np.asarray(rand(51, (4, 5, 3)), np.float64).sum((0, 1)), atol=TOL)
