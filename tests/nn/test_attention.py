"""Multi-head attention and T5 relative bias against plain float64 NumPy references."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.leaves import (
    Dense,
    HeadLowRank,
    LowRank,
    MaskedBinary,
    materialize,
)
from lowrank_jax.nn import (
    AttentionConfig,
    RelativeBiasConfig,
    apply_attention,
    causal_mask,
    combine_masks,
    init_attention,
    init_relative_bias,
    padding_mask,
    qkv_activation_masks,
    relative_bias,
    relative_position_bucket,
    step_t_mask,
)

TOL = 1e-5
F32_MIN = float(np.finfo(np.float32).min)


# ---------------------------------------------------------------------------------------------
# Plain float64 reference.

def np_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def np_linear(leaf, x):
    """x @ w + b for a Dense leaf, in float64."""
    y = x @ np.asarray(leaf.w, np.float64)
    return y if leaf.b is None else y + np.asarray(leaf.b, np.float64)


def np_attention(p, x, *, heads, d_head, scaled=True, kv=None, mask=None, bias=None,
                 act_masks=None):
    """Loop over batch and heads; act_masks = (mq [q, d_head], mk [k, d_head], mv [k, d_head])."""
    x = np.asarray(x, np.float64)
    kvx = x if kv is None else np.asarray(kv, np.float64)
    batch, q_len, _ = x.shape
    k_len = kvx.shape[1]
    full = (batch, heads, q_len, k_len)
    mask = None if mask is None else np.broadcast_to(np.asarray(mask), full)
    bias = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    out = np.zeros((batch, q_len, heads * d_head))
    for b in range(batch):
        q_all = np_linear(p["q"], x[b])
        k_all = np_linear(p["k"], kvx[b])
        v_all = np_linear(p["v"], kvx[b])
        for h in range(heads):
            cols = slice(h * d_head, (h + 1) * d_head)  # head-major layout
            q, k, v = q_all[:, cols], k_all[:, cols], v_all[:, cols]
            if act_masks is not None:
                mq, mk, mv = (np.asarray(m, np.float64) for m in act_masks)
                q, k, v = q * mq, k * mk, v * mv
            s = q @ k.T
            if scaled:
                s = s / math.sqrt(d_head)
            if bias is not None:
                s = s + bias[b, h]
            if mask is not None:
                s = np.where(mask[b, h], s, F32_MIN)
            out[b, :, cols] = np_softmax(s) @ v
    return np_linear(p["o"], out)


def densify(leaf):
    return Dense(w=materialize(leaf), b=leaf.b)


def rand(seed, shape, scale=1.0):
    # NumPy draws: jax.random would compile a sampler per shape and slow the suite down.
    # Cast in NumPy: a float64 -> float32 cast in JAX would compile per shape.
    z = scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(z.astype(np.float32))


def dense_params(seed, cfg):
    """Random Dense q/k/v/o (NumPy-drawn), with random biases when cfg.use_bias."""
    shapes = {"q": (cfg.d_model, cfg.inner_dim), "k": (cfg.kv_dim, cfg.inner_dim),
              "v": (cfg.kv_dim, cfg.inner_dim), "o": (cfg.inner_dim, cfg.d_model)}
    p = {}
    for i, (name, (d_in, d_out)) in enumerate(shapes.items()):
        w = rand(seed * 10 + i, (d_in, d_out), 1.0 / math.sqrt(d_in))
        b = rand(seed * 10 + 5 + i, (d_out,), 0.5) if cfg.use_bias else None
        p[name] = Dense(w=w, b=b)
    return p


# Jitted once per (cfg, layer_index, shapes): much faster than op-by-op eager dispatch.
attend = jax.jit(apply_attention, static_argnames=("cfg", "layer_index"))


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---------------------------------------------------------------------------------------------
# Attention.

@pytest.mark.parametrize("scaled,use_bias", [(True, True), (False, False)])
def test_self_attention_matches_reference(scaled, use_bias):
    cfg = AttentionConfig(d_model=16, num_heads=4, scaled=scaled, use_bias=use_bias)
    p = dense_params(0, cfg)  # non-zero biases when use_bias, so that they are checked
    x = rand(1, (2, 5, 16))
    y = attend(p, x, cfg=cfg)
    ref = np_attention(p, x, heads=4, d_head=4, scaled=scaled)
    assert y.shape == (2, 5, 16)
    assert max_err(y, ref) <= TOL


def test_scaled_and_unscaled_differ():
    # Guards against a reference and an implementation that both ignore `scaled`.
    cfg = AttentionConfig(d_model=16, num_heads=2)
    p = dense_params(0, cfg)
    x = rand(1, (1, 4, 16), 2.0)
    y1 = attend(p, x, cfg)
    y2 = attend(p, x, dataclasses.replace(cfg, scaled=False))
    assert max_err(y1, y2) > 1e-3


@pytest.mark.parametrize("d_model,heads,d_head", [(12, 3, 5), (10, 4, 2)])
def test_head_width_independent_of_d_model(d_model, heads, d_head):
    cfg = AttentionConfig(d_model=d_model, num_heads=heads, d_head=d_head, scaled=False)
    p = dense_params(2, cfg)
    assert p["q"].shape == (d_model, heads * d_head)
    assert p["o"].shape == (heads * d_head, d_model)
    x = rand(3, (2, 6, d_model))
    ref = np_attention(p, x, heads=heads, d_head=d_head, scaled=False)
    assert max_err(attend(p, x, cfg), ref) <= TOL


def test_padding_and_causal_masks():
    cfg = AttentionConfig(d_model=8, num_heads=2)
    p = dense_params(4, cfg)
    x = rand(5, (3, 6, 8))
    valid = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], bool)
    for mask in (padding_mask(valid), causal_mask(6), combine_masks(padding_mask(valid),
                                                                    causal_mask(6))):
        ref = np_attention(p, x, heads=2, d_head=4, mask=np.asarray(mask))
        assert max_err(attend(p, x, cfg, mask=mask), ref) <= TOL
    # Masked keys have no influence: changing padded tokens leaves the valid rows unchanged.
    y = attend(p, x, cfg, mask=padding_mask(valid))
    x2 = x.at[1, 3:].set(100.0)
    y2 = attend(p, x2, cfg, mask=padding_mask(valid))
    assert max_err(y[1, :3], y2[1, :3]) <= TOL


def test_per_head_mask():
    cfg = AttentionConfig(d_model=8, num_heads=2)
    p = dense_params(6, cfg)
    x = rand(7, (2, 4, 8))
    mask = np.random.default_rng(8).random((2, 2, 4, 4)) < 0.6
    mask[..., 0] = True  # every row keeps at least one key
    ref = np_attention(p, x, heads=2, d_head=4, mask=mask)
    assert max_err(attend(p, x, cfg, mask=jnp.asarray(mask)), ref) <= TOL


def test_step_t_mask_in_attention():
    w = 5
    cfg = AttentionConfig(d_model=8, num_heads=2)
    p = dense_params(9, cfg)
    x = rand(10, (2, w, 8))
    y = attend(p, x, cfg, mask=step_t_mask(w))
    ref = np_attention(p, x, heads=2, d_head=4, mask=np.asarray(step_t_mask(w)))
    assert max_err(y, ref) <= TOL
    # Past steps attend only themselves: their output is o(v(x_i)).
    v_only = np_linear(p["o"], np_linear(p["v"], np.asarray(x, np.float64)))
    assert max_err(y[:, : w - 1], v_only[:, : w - 1]) <= TOL


def test_fully_masked_row_is_uniform_like_hf():
    # All keys masked: every logit is finfo.min, so the softmax is uniform (HF T5 behaviour).
    cfg = AttentionConfig(d_model=8, num_heads=2)
    p = dense_params(11, cfg)
    x = rand(12, (1, 3, 8))
    mask = jnp.zeros((1, 1, 3, 3), bool)
    y = attend(p, x, cfg, mask=mask)
    assert bool(jnp.all(jnp.isfinite(y)))
    v_mean = np_linear(p["v"], np.asarray(x[0], np.float64)).mean(axis=0)
    expected = np_linear(p["o"], v_mean)
    assert max_err(y[0], np.broadcast_to(expected, (3, 8))) <= TOL


@pytest.mark.parametrize("bias_shape", [(3, 2, 4, 6), (1, 1, 1, 6)])
def test_additive_bias(bias_shape):
    cfg = AttentionConfig(d_model=8, num_heads=2, scaled=False, d_kv_in=8)
    p = dense_params(13, cfg)
    x, kv = rand(14, (3, 4, 8)), rand(15, (3, 6, 8))
    bias = rand(16, bias_shape, 2.0)
    ref = np_attention(p, x, heads=2, d_head=4, scaled=False, kv=kv, bias=bias)
    assert max_err(attend(p, x, cfg, kv=kv, bias=bias), ref) <= TOL


def test_cross_attention():
    cfg = AttentionConfig(d_model=12, num_heads=3, d_head=3, d_kv_in=10)
    p = dense_params(17, cfg)
    assert p["q"].shape == (12, 9) and p["k"].shape == (10, 9) and p["v"].shape == (10, 9)
    x, enc = rand(18, (2, 4, 12)), rand(19, (2, 7, 10))
    mask = padding_mask(np.array([[1] * 7, [1] * 4 + [0] * 3], bool))
    y = attend(p, x, cfg, kv=enc, mask=mask)
    ref = np_attention(p, x, heads=3, d_head=3, kv=enc, mask=np.asarray(mask))
    assert y.shape == (2, 4, 12)
    assert max_err(y, ref) <= TOL


# ---------------------------------------------------------------------------------------------
# Fixed Q/K/V activation masks (seed 003 sec. 3.3.1).

@pytest.mark.parametrize("layer_index", [0, 2])
def test_qkv_activation_masks_applied(layer_index):
    cfg = AttentionConfig(d_model=12, num_heads=3, qkv_keep=0.5, qkv_mask_seed=5)
    p = dense_params(20, cfg)
    x = rand(21, (2, 6, 12))
    m = qkv_activation_masks(5 + layer_index, 6, 4, 0.5)
    ref = np_attention(p, x, heads=3, d_head=4, act_masks=(m["q"], m["k"], m["v"]))
    y = attend(p, x, cfg, layer_index=layer_index)
    assert max_err(y, ref) <= TOL
    unmasked = np_attention(p, x, heads=3, d_head=4)
    assert max_err(y, unmasked) > 1e-3
    other = qkv_activation_masks(5 + layer_index + 1, 6, 4, 0.5)
    ref_other = np_attention(p, x, heads=3, d_head=4, act_masks=(other["q"], other["k"],
                                                                  other["v"]))
    assert max_err(y, ref_other) > 1e-3


def test_qkv_activation_masks_in_cross_attention():
    # The q mask is drawn over q_len, the k/v masks over k_len.
    cfg = AttentionConfig(d_model=8, num_heads=2, d_kv_in=6, qkv_keep=0.75, qkv_mask_seed=1)
    p = dense_params(22, cfg)
    x, enc = rand(23, (2, 3, 8)), rand(24, (2, 5, 6))
    mq = qkv_activation_masks(1, 3, 4, 0.75)["q"]
    mkv = qkv_activation_masks(1, 5, 4, 0.75)
    ref = np_attention(p, x, heads=2, d_head=4, kv=enc, act_masks=(mq, mkv["k"], mkv["v"]))
    assert max_err(attend(p, x, cfg, kv=enc), ref) <= TOL


def test_qkv_value_mask_identical_across_heads():
    # q = 0 gives uniform attention, v = o = identity: head h of the output at any position is
    # the key-average of the value mask, so every head must show the same [d_head] vector.
    heads, d_head, seq = 3, 4, 5
    d = heads * d_head
    cfg = AttentionConfig(d_model=d, num_heads=heads, qkv_keep=0.5, qkv_mask_seed=7)
    eye = jnp.eye(d)
    p = {"q": Dense(jnp.zeros((d, d))), "k": Dense(eye), "v": Dense(eye), "o": Dense(eye)}
    x = jnp.ones((1, seq, d))
    y = np.asarray(attend(p, x, cfg)).reshape(seq, heads, d_head)
    mv = np.asarray(qkv_activation_masks(7, seq, d_head, 0.5)["v"], np.float64)
    for h in range(heads):
        np.testing.assert_allclose(y[:, h, :], np.broadcast_to(mv.mean(0), (seq, d_head)),
                                   atol=TOL)


def test_qkv_masks_not_in_params_or_gradient():
    cfg = AttentionConfig(d_model=8, num_heads=2, qkv_keep=0.5)
    p = dense_params(25, cfg)
    assert set(p) == {"q", "k", "v", "o"}
    x = rand(26, (2, 4, 8))
    g = jax.grad(lambda p: jnp.sum(attend(p, x, cfg) ** 2))(p)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)


# ---------------------------------------------------------------------------------------------
# Leaves: every projection may be compressed; the block never branches on the leaf type.

def compressed_params(seed, d, heads, d_head, bias=True):
    """q: HeadLowRank with irregular ranks, k: LowRank, v: MaskedBinary, o: LowRank."""
    inner = heads * d_head
    b = (lambda i, n: rand(seed + i, (n,), 0.5)) if bias else (lambda i, n: None)
    q = HeadLowRank(u=rand(seed, (d, heads, 3), 0.5), v=rand(seed + 1, (heads, 3, d_head), 0.5),
                    b=b(2, inner), ranks=(3, 1, 2)[:heads] + (3,) * max(0, heads - 3))
    k = LowRank(u=rand(seed + 3, (d, 2), 0.5), v=rand(seed + 4, (2, inner), 0.5), b=b(5, inner))
    v = MaskedBinary(w=rand(seed + 6, (d, inner)), s=rand(seed + 7, (d, inner)), b=b(8, inner),
                     keep=0.5)
    o = LowRank(u=rand(seed + 9, (inner, 3), 0.5), v=rand(seed + 10, (3, d), 0.5), b=b(11, d))
    return {"q": q, "k": k, "v": v, "o": o}


def test_compressed_leaves_equal_their_dense_materialization():
    heads, d_head, d = 3, 4, 10
    cfg = AttentionConfig(d_model=d, num_heads=heads, d_head=d_head, use_bias=True)
    p = compressed_params(27, d, heads, d_head)
    p_dense = {n: densify(leaf) for n, leaf in p.items()}
    x = rand(31, (2, 5, d))
    mask = causal_mask(5)
    y = attend(p, x, cfg, mask=mask)
    y_dense = attend(p_dense, x, cfg, mask=mask)
    assert max_err(y, y_dense) <= TOL
    ref = np_attention(p_dense, x, heads=heads, d_head=d_head, mask=np.asarray(mask))
    assert max_err(y, ref) <= TOL


def test_init_attention_shapes_and_leaves():
    cfg = AttentionConfig(d_model=8, num_heads=2, d_kv_in=12, use_bias=True)
    p = init_attention(jax.random.PRNGKey(0), cfg)
    assert set(p) == {"q", "k", "v", "o"}
    assert p["q"].shape == (8, 8) and p["k"].shape == (12, 8) and p["v"].shape == (12, 8)
    assert p["o"].shape == (8, 8)
    for leaf in p.values():
        assert isinstance(leaf, Dense) and leaf.b is not None
        assert float(jnp.abs(leaf.b).max()) == 0.0
    assert not np.array_equal(np.asarray(p["k"].w), np.asarray(p["v"].w))
    shapes = jax.eval_shape(lambda k: init_attention(k, dataclasses.replace(cfg, use_bias=False)),
                            jax.random.PRNGKey(0))
    assert all(isinstance(leaf, Dense) and leaf.b is None for leaf in shapes.values())


# ---------------------------------------------------------------------------------------------
# jit, grad, retracing.

def test_jit_matches_eager_and_grad_structure():
    cfg = AttentionConfig(d_model=8, num_heads=2, qkv_keep=0.5)
    p = compressed_params(32, 8, 2, 4, bias=False)
    x = rand(33, (2, 4, 8))
    bias = rand(34, (1, 2, 4, 4))
    f = lambda p, x: apply_attention(p, x, cfg, mask=causal_mask(4), bias=bias, layer_index=1)
    assert max_err(jax.jit(f)(p, x), f(p, x)) <= TOL
    g = jax.jit(jax.grad(lambda p: jnp.sum(f(p, x) ** 2)))(p)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)
    assert float(jnp.abs(g["q"].u).sum()) > 0


def test_no_retrace_on_second_call():
    cfg = AttentionConfig(d_model=8, num_heads=2, qkv_keep=0.5)
    p = dense_params(35, cfg)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(p, x):
        return apply_attention(p, x, cfg, mask=causal_mask(4))

    f(p, rand(36, (2, 4, 8)))
    f(p, rand(37, (2, 4, 8)))
    chex.clear_trace_counter()


def test_config_is_hashable_static_arg():
    cfg = AttentionConfig(d_model=8, num_heads=2)
    assert hash(cfg) == hash(AttentionConfig(d_model=8, num_heads=2))
    p = dense_params(38, cfg)
    f = jax.jit(apply_attention, static_argnames=("cfg",))
    x = rand(39, (1, 3, 8))
    assert max_err(f(p, x, cfg=cfg), apply_attention(p, x, cfg)) <= TOL


# ---------------------------------------------------------------------------------------------
# Errors.

def test_heads_not_dividing_d_model_raises():
    with pytest.raises(ValueError, match=r"num_heads=3 does not divide d_model=16"):
        AttentionConfig(d_model=16, num_heads=3)
    assert AttentionConfig(d_model=16, num_heads=3, d_head=5).inner_dim == 15


@pytest.mark.parametrize("kwargs,field", [
    ({"d_model": 0, "num_heads": 1}, "d_model"),
    ({"d_model": 8, "num_heads": 0}, "num_heads"),
    ({"d_model": 8, "num_heads": 2, "d_head": 0}, "d_head"),
    ({"d_model": 8, "num_heads": 2, "qkv_keep": 1.5}, "qkv_keep"),
    ({"d_model": 8, "num_heads": 2, "qkv_keep": 0.0}, "qkv_keep"),
])
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AttentionConfig(**kwargs)


def test_bad_mask_and_bias_raise():
    cfg = AttentionConfig(d_model=8, num_heads=2)
    p = dense_params(40, cfg)
    x = rand(41, (2, 4, 8))
    with pytest.raises(ValueError, match="mask must be 4-D"):
        apply_attention(p, x, cfg, mask=jnp.ones((4, 4), bool))
    with pytest.raises(ValueError, match="mask must be 4-D"):
        apply_attention(p, x, cfg, mask=jnp.ones((2, 3, 4, 4), bool))  # 3 heads, not 2
    with pytest.raises(ValueError, match="mask must be boolean"):
        apply_attention(p, x, cfg, mask=jnp.ones((1, 1, 4, 4)))
    with pytest.raises(ValueError, match="bias must be 4-D"):
        apply_attention(p, x, cfg, bias=jnp.ones((1, 2, 4, 5)))
    with pytest.raises(ValueError, match="x must be"):
        apply_attention(p, rand(42, (2, 4, 6)), cfg)
    with pytest.raises(ValueError, match="kv must be"):
        apply_attention(p, x, cfg, kv=rand(43, (2, 5, 6)))


def test_projection_width_mismatch_raises():
    cfg = AttentionConfig(d_model=8, num_heads=2)
    p = dense_params(44, cfg)
    p["k"] = Dense(w=rand(45, (8, 6)))
    with pytest.raises(ValueError, match="projection 'k' must output"):
        apply_attention(p, rand(46, (1, 3, 8)), cfg)


# ---------------------------------------------------------------------------------------------
# T5 relative position bias.

def hf_t5_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """Plain-Python transcription of HF ``T5Attention._relative_position_bucket`` (one int)."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += num_buckets if relative_position > 0 else 0
        relative_position = abs(relative_position)
    else:
        relative_position = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if relative_position < max_exact:
        return relative_buckets + relative_position
    large = max_exact + int(
        math.log(relative_position / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    )
    return relative_buckets + min(large, num_buckets - 1)


# Outputs of transformers' T5Attention._relative_position_bucket (num_buckets=32,
# max_distance=128), recorded once from the PyTorch implementation.
HF_GOLDEN_BIDIRECTIONAL = {
    -1000: 15, -200: 15, -128: 15, -127: 15, -100: 15, -64: 14, -63: 13, -33: 12, -32: 12,
    -31: 11, -17: 10, -16: 10, -15: 9, -9: 8, -8: 8, -7: 7, -1: 1, 0: 0, 1: 17, 2: 18, 7: 23,
    8: 24, 9: 24, 11: 24, 12: 25, 15: 25, 16: 26, 22: 26, 23: 27, 31: 27, 32: 28, 45: 28,
    46: 29, 63: 29, 64: 30, 90: 30, 91: 31, 127: 31, 128: 31, 129: 31, 500: 31,
}
HF_GOLDEN_CAUSAL = {
    -1000: 31, -200: 31, -128: 31, -127: 31, -100: 30, -64: 26, -63: 26, -33: 21, -32: 21,
    -31: 21, -17: 16, -16: 16, -15: 15, -9: 9, -8: 8, -7: 7, -1: 1, 0: 0, 1: 0, 2: 0, 64: 0,
    500: 0,
}


@pytest.mark.parametrize("bidirectional,golden", [(True, HF_GOLDEN_BIDIRECTIONAL),
                                                  (False, HF_GOLDEN_CAUSAL)])
def test_relative_position_bucket_hf_golden(bidirectional, golden):
    pos = np.array(list(golden))
    got = relative_position_bucket(pos, bidirectional=bidirectional, num_buckets=32,
                                   max_distance=128)
    assert np.asarray(got).tolist() == list(golden.values())
    assert [hf_t5_bucket(int(r), bidirectional) for r in pos] == list(golden.values())


@pytest.mark.parametrize("num_buckets,max_distance",
                         [(32, 128), (32, 64), (64, 256), (16, 20), (8, 30), (128, 1000)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bucket_matches_hf_formula(num_buckets, max_distance, bidirectional):
    pos = np.arange(-1500, 1501)
    got = np.asarray(relative_position_bucket(pos, bidirectional=bidirectional,
                                              num_buckets=num_buckets,
                                              max_distance=max_distance))
    ref = [hf_t5_bucket(int(r), bidirectional, num_buckets, max_distance) for r in pos]
    np.testing.assert_array_equal(got, ref)
    assert got.min() == 0 and got.max() == num_buckets - 1


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_bias_values(bidirectional):
    cfg = RelativeBiasConfig(num_buckets=8, max_distance=10, bidirectional=bidirectional)
    table = init_relative_bias(jax.random.PRNGKey(47), cfg, 3, std=1.0)
    assert table.shape == (8, 3)
    q_len, k_len = 4, 13
    b = np.asarray(relative_bias(table, q_len, k_len, cfg))
    assert b.shape == (1, 3, q_len, k_len)
    t = np.asarray(table)
    for h in range(3):
        for i in range(q_len):
            for j in range(k_len):
                bucket = hf_t5_bucket(j - i, bidirectional, 8, 10)  # memory minus query
                assert b[0, h, i, j] == t[bucket, h]


def test_relative_bias_in_attention_and_jit():
    cfg = AttentionConfig(d_model=8, num_heads=2, scaled=False)
    rcfg = RelativeBiasConfig()
    p = dense_params(48, cfg)
    table = rand(49, (rcfg.num_buckets, 2))
    x = rand(50, (2, 5, 8))
    f = lambda p, table, x: apply_attention(p, x, cfg, bias=relative_bias(table, 5, 5, rcfg))
    y = jax.jit(f)(p, table, x)
    ref = np_attention(p, x, heads=2, d_head=4, scaled=False,
                       bias=np.asarray(relative_bias(table, 5, 5, rcfg)))
    assert max_err(y, ref) <= TOL
    g = jax.jit(jax.grad(lambda t: jnp.sum(f(p, t, x) ** 2)))(table)
    assert g.shape == table.shape


@pytest.mark.parametrize("kwargs,field", [({"num_buckets": 2}, "num_buckets"),
                                          ({"num_buckets": 32, "max_distance": 16},
                                           "max_distance")])
def test_relative_bias_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RelativeBiasConfig(**kwargs)


def test_relative_bias_table_shape_checked():
    with pytest.raises(ValueError, match="table must be"):
        relative_bias(jnp.zeros((16, 2)), 3, 3, RelativeBiasConfig())
