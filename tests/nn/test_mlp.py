"""MLP blocks (each activation, gated or not) against plain float64 NumPy."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import execution
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import Dense, LowRank, MaskedBinary, keep_inputs, keep_outputs, materialize
from lowrank_jax.nn import MLPConfig, apply_mlp, init_mlp
from lowrank_jax.nn import execution as strategy

TOL = 1e-5


def rand(seed, shape, scale=1.0):
    # Cast in NumPy: a float64 -> float32 cast in JAX would compile per shape.
    z = scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(z.astype(np.float32))


# Activations written from their definitions.
_erf = np.vectorize(math.erf)
NP_ACT = {
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                                     * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
}


def np_linear(leaf, x):
    y = x @ np.asarray(leaf.w, np.float64)
    return y if leaf.b is None else y + np.asarray(leaf.b, np.float64)


def np_mlp(p, x, activation, gated):
    x = np.asarray(x, np.float64)
    act = NP_ACT[activation]
    h = act(np_linear(p["wi_0"], x)) * np_linear(p["wi_1"], x) if gated else act(
        np_linear(p["wi"], x))
    return np_linear(p["wo"], h)


def dense_params(seed, cfg, d_model=8, d_ff=12, d_out=None):
    """Random Dense weights with init_mlp's names; random biases when cfg.use_bias."""
    d_out = d_model if d_out is None else d_out
    names = ["wi_0", "wi_1"] if cfg.gated else ["wi"]
    p = {}
    for i, n in enumerate(names):
        b = rand(seed + 10 + i, (d_ff,), 0.5) if cfg.use_bias else None
        p[n] = Dense(w=rand(seed + i, (d_model, d_ff), 1.5 / math.sqrt(d_model)), b=b)
    b = rand(seed + 20, (d_out,), 0.5) if cfg.use_bias else None
    p["wo"] = Dense(w=rand(seed + 5, (d_ff, d_out), 1.0 / math.sqrt(d_ff)), b=b)
    return p


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


mlp = jax.jit(apply_mlp, static_argnames=("cfg",))


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
def test_mlp_matches_reference(activation, gated, use_bias):
    cfg = MLPConfig(activation=activation, gated=gated, use_bias=use_bias)
    p = dense_params(1, cfg)
    x = rand(2, (2, 5, 8))
    assert max_err(mlp(p, x, cfg=cfg), np_mlp(p, x, activation, gated)) <= TOL


def test_gelu_variants_differ():
    # Exact erf gelu and tanh gelu must not be confused (T5 v1.1 uses the tanh form).
    x = np.linspace(-4, 4, 101)
    assert np.max(np.abs(NP_ACT["gelu"](x) - NP_ACT["gelu_tanh"](x))) > 1e-4
    cfg = MLPConfig(activation="gelu")
    p = dense_params(3, cfg)
    xx = rand(4, (1, 6, 8), 2.0)
    y_exact = mlp(p, xx, cfg=cfg)
    y_tanh = mlp(p, xx, cfg=MLPConfig(activation="gelu_tanh"))
    assert max_err(y_exact, y_tanh) > 1e-5
    assert max_err(y_exact, np_mlp(p, xx, "gelu", False)) <= TOL


def test_init_mlp_shapes():
    p = init_mlp(jax.random.PRNGKey(0), MLPConfig(use_bias=True), d_model=8, d_ff=12)
    assert set(p) == {"wi", "wo"}
    assert p["wi"].shape == (8, 12) and p["wo"].shape == (12, 8) and p["wi"].b is not None
    g = init_mlp(jax.random.PRNGKey(0), MLPConfig(gated=True), d_model=8, d_ff=12)
    assert set(g) == {"wi_0", "wi_1", "wo"} and g["wi_1"].shape == (8, 12) and g["wo"].b is None
    assert not np.array_equal(np.asarray(g["wi_0"].w), np.asarray(g["wi_1"].w))
    o = init_mlp(jax.random.PRNGKey(0), MLPConfig(), d_model=8, d_ff=12, d_out=5)
    assert o["wo"].shape == (12, 5)


def test_output_width_differs_from_input():
    cfg = MLPConfig(activation="relu", use_bias=True)
    p = dense_params(6, cfg, d_out=5)
    x = rand(7, (2, 3, 8))
    y = mlp(p, x, cfg=cfg)
    assert y.shape == (2, 3, 5)
    assert max_err(y, np_mlp(p, x, "relu", False)) <= TOL


@pytest.mark.parametrize("activation,gated", [("gelu", False), ("silu", True)])
def test_pruned_hidden_units_equal_zeroed_units(activation, gated):
    """Physically removing hidden units (keep_outputs on the input projections, keep_inputs on
    wo) equals zeroing their columns and biases: act(0) = 0 (and 0 * gate = 0)."""
    cfg = MLPConfig(activation=activation, gated=gated, use_bias=True)
    p = dense_params(8, cfg)
    keep = np.array([0, 3, 4, 7, 11])
    drop = np.setdiff1d(np.arange(12), keep)
    pruned, zeroed = {}, {}
    for n, leaf in p.items():
        if n == "wo":
            pruned[n] = keep_inputs(leaf, keep)
            zeroed[n] = leaf
        else:
            pruned[n] = keep_outputs(leaf, keep)
            w, b = np.asarray(leaf.w).copy(), np.asarray(leaf.b).copy()
            w[:, drop], b[drop] = 0, 0
            zeroed[n] = Dense(jnp.asarray(w), jnp.asarray(b))
    assert pruned["wo"].shape == (5, 8)
    x = rand(9, (2, 3, 8))
    y = mlp(pruned, x, cfg=cfg)
    assert max_err(y, np_mlp(zeroed, x, activation, gated)) <= TOL
    assert max_err(y, np_mlp(p, x, activation, gated)) > 1e-3


@pytest.mark.parametrize("gated", [False, True])
def test_compressed_leaves_equal_dense_materialization(gated):
    cfg = MLPConfig(activation="gelu_tanh", gated=gated, use_bias=True)
    p = {}
    names = ["wi_0", "wi_1"] if gated else ["wi"]
    for i, n in enumerate(names):
        if i == 0:
            p[n] = LowRank(u=rand(10, (8, 3), 0.5), v=rand(11, (3, 12), 0.5), b=rand(12, (12,)))
        else:
            p[n] = MaskedBinary(w=rand(13, (8, 12)), s=rand(14, (8, 12)), b=rand(15, (12,)),
                                keep=0.3)
    p["wo"] = MaskedBinary(w=rand(16, (12, 8)), s=rand(17, (12, 8)), b=None, keep=0.6)
    p_dense = {n: Dense(w=materialize(leaf), b=leaf.b) for n, leaf in p.items()}
    x = rand(18, (2, 4, 8))
    y = mlp(p, x, cfg=cfg)
    assert max_err(y, mlp(p_dense, x, cfg=cfg)) <= TOL
    assert max_err(y, np_mlp(p_dense, x, "gelu_tanh", gated)) <= TOL


def test_jit_eager_grad_and_no_retrace():
    cfg = MLPConfig(activation="silu", gated=True)
    p = dense_params(20, cfg)
    p["wi_1"] = LowRank(u=rand(21, (8, 2)), v=rand(22, (2, 12)))
    x = rand(23, (2, 3, 8))
    assert max_err(apply_mlp(p, x, cfg), mlp(p, x, cfg=cfg)) <= TOL
    g = jax.jit(jax.grad(lambda p: jnp.sum(apply_mlp(p, x, cfg) ** 2)))(p)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(p, x):
        return apply_mlp(p, x, cfg)

    f(p, x)
    f(p, x + 1.0)
    chex.clear_trace_counter()


@pytest.mark.parametrize("sizes,field", [
    ({"d_model": 0, "d_ff": 4}, "d_model"),
    ({"d_model": 4, "d_ff": -1}, "d_ff"),
    ({"d_model": 4, "d_ff": 4, "d_out": 0}, "d_out"),
    ({"d_model": 4, "d_ff": 2.0}, "d_ff"),
])
def test_bad_init_sizes_raise(sizes, field):
    with pytest.raises(ConfigError, match=field):
        init_mlp(jax.random.PRNGKey(0), MLPConfig(), **sizes)


@pytest.mark.parametrize("kwargs,field", [
    ({"activation": "tanh"}, "activation"),
    ({"gated": 1}, "gated"),
    ({"use_bias": "no"}, "use_bias"),
])
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        MLPConfig(**kwargs)


def test_wrong_input_width_raises():
    cfg = MLPConfig()
    with pytest.raises(ShapeError, match="d_in=8"):
        apply_mlp(dense_params(30, cfg), jnp.ones((2, 6)), cfg)
    # Mismatched parameters: a wo whose inputs do not match the hidden width.
    p = dense_params(31, cfg)
    with pytest.raises(ShapeError, match="d_in=10"):
        apply_mlp(dict(p, wo=Dense(rand(32, (10, 8)))), jnp.ones((2, 8)), cfg)


# -- token chunks on CPU (nn.mlp.token_chunks) ---------------------------------------------

def np_relu_mlp_grads(wi, wo, x):
    """Gradients of sum(relu(x @ wi) @ wo)^2) with respect to wi, wo and x, by hand."""
    pre = x @ wi
    h = np.maximum(pre, 0.0)
    y = h @ wo
    dy = 2.0 * y
    dh = (dy @ wo.T) * (pre > 0)
    return x.T @ dh, h.T @ dy, dh @ wi.T


@pytest.mark.parametrize("gated,activation", [(False, "relu"), (True, "gelu_tanh")])
def test_token_chunks_match_reference(monkeypatch, gated, activation):
    """An MLP run a chunk of tokens at a time (lax.map; forced here by the byte thresholds,
    with 10 tokens in 3 chunks of 4, two padding rows) equals the NumPy MLP, keeps the input's
    leading shape, and compressed leaves give what they give unchunked."""
    cfg = MLPConfig(activation=activation, gated=gated, use_bias=True)
    p = dense_params(40, cfg)
    x = rand(41, (2, 5, 8))
    comp = dict(p)
    first = "wi_0" if gated else "wi"
    comp[first] = LowRank(u=rand(42, (8, 3), 0.5), v=rand(43, (3, 12), 0.5), b=rand(44, (12,)))
    comp["wo"] = MaskedBinary(w=rand(45, (12, 8)), s=rand(46, (12, 8)), b=None, keep=0.6)
    run = jax.jit(lambda p, x: apply_mlp(p, x, cfg))
    whole = run(comp, x)
    chunks = execution.settings(cpu_chunks=True, mlp_chunk_above_bytes=0,
                                mlp_chunk_bytes=200)  # 10 tokens x 12 x 4 bytes = 480: 3 chunks
    with chunks:
        assert strategy.token_chunks(10, 12) == 3
        y = run(p, x)  # traced again: the settings are part of the trace's key
        got = run(comp, x)
        jaxpr = str(jax.make_jaxpr(lambda p, x: apply_mlp(p, x, cfg))(p, x))
    assert y.shape == (2, 5, 8)
    assert max_err(y, np_mlp(p, x, activation, gated)) <= TOL
    u, v = (np.asarray(a, np.float64) for a in (comp[first].u, comp[first].v))
    ref = dict(p, **{first: Dense(jnp.asarray((u @ v).astype(np.float32)), comp[first].b)})
    ref["wo"] = Dense(materialize(comp["wo"]), None)
    assert max_err(got, np_mlp(ref, x, activation, gated)) <= TOL
    assert max_err(got, whole) <= TOL
    assert "while" in jaxpr or "scan" in jaxpr  # the chunks really run as a loop


def test_token_chunk_gradient_matches_reference(monkeypatch):
    cfg = MLPConfig(activation="relu")
    p = {"wi": Dense(rand(50, (8, 12), 0.4)), "wo": Dense(rand(51, (12, 8), 0.3))}
    x = rand(52, (7, 8))
    with execution.settings(cpu_chunks=True, mlp_chunk_above_bytes=0,
                            mlp_chunk_bytes=100):  # 7 x 12 x 4 = 336 bytes: 4 chunks of 2
        assert strategy.token_chunks(7, 12) == 4
        gp, gx = jax.jit(jax.grad(lambda p, x: jnp.sum(apply_mlp(p, x, cfg) ** 2),
                                  argnums=(0, 1)))(p, x)
    want = np_relu_mlp_grads(*(np.asarray(a, np.float64) for a in (p["wi"].w, p["wo"].w, x)))
    for got, ref in zip((gp["wi"].w, gp["wo"].w, gx), want, strict=True):
        assert max_err(got, ref) <= 1e-4 * max(1.0, float(np.max(np.abs(ref))))


def test_token_chunks_policy(monkeypatch):
    # the defaults: above 16 MiB, chunks of at most 8 MiB
    assert jax.default_backend() == "cpu" and jax.device_count() > 1  # tests/conftest.py: 8
    assert strategy.token_chunks(16384, 3072) is None  # several devices: never chunked
    monkeypatch.setattr(jax, "device_count", lambda *a, **k: 1)
    # Chronos-Bolt-base batch: 1056 tokens x 3072 x 4 bytes = 12.4 MiB, below the threshold.
    assert strategy.token_chunks(1056, 3072) is None
    # ViT-Base, 32 images: 6304 x 3072 x 4 = 73.9 MiB -> 10 chunks of at most 8 MiB.
    assert strategy.token_chunks(6304, 3072) == 10
    assert strategy.token_chunks(16384, 3072) == 24
    assert strategy.token_chunks(6304, 3072, itemsize=2) == 5  # bf16 activations: half the bytes
    assert strategy.token_chunks(1, 1 << 24) is None  # one token cannot be split
    with execution.settings(mlp_chunk_bytes=1):
        assert strategy.token_chunks(6304, 3072) == 6304  # at most one chunk per token
    with execution.settings(mlp_chunk_above_bytes=None):
        assert strategy.token_chunks(16384, 3072) is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert strategy.token_chunks(16384, 3072) is None
    with execution.settings(cpu_chunks=True):  # forced on any backend
        assert strategy.token_chunks(16384, 3072) == 24


def test_no_token_chunks_with_several_devices(monkeypatch):
    """With a batch sharded over devices the MLP runs whole (a chunk loop over a sharded axis
    would gather the input onto every device) and its output stays sharded."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert jax.device_count() == 8  # tests/conftest.py
    cfg = MLPConfig(activation="gelu")
    p = dense_params(60, cfg)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.device_put(rand(61, (8, 3, 8)), NamedSharding(mesh, PartitionSpec("data")))
    run = jax.jit(lambda p, x: apply_mlp(p, x, cfg))
    with execution.settings(mlp_chunk_above_bytes=0,  # any size would be chunked
                            mlp_chunk_bytes=64):
        jaxpr = str(jax.make_jaxpr(lambda p, x: apply_mlp(p, x, cfg))(p, x))
        y = run(p, x)
    assert "scan" not in jaxpr and "while" not in jaxpr
    assert max_err(y, np_mlp(p, x, "gelu", False)) <= TOL
    assert y.sharding.spec == PartitionSpec("data")
