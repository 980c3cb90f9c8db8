"""Encoder/decoder layers and stacks against a plain float64 NumPy composition."""

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
    is_leaf,
    materialize,
    param_count,
)
from lowrank_jax.nn import (
    AttentionConfig,
    DecoderConfig,
    DecoderLayerConfig,
    EncoderConfig,
    EncoderLayerConfig,
    MLPConfig,
    NormConfig,
    RelativeBiasConfig,
    apply_decoder,
    apply_decoder_layer,
    apply_encoder,
    apply_encoder_layer,
    init_decoder,
    init_decoder_layer,
    init_encoder,
    init_encoder_layer,
    padding_mask,
    qkv_activation_masks,
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
    y = x @ np.asarray(leaf.w, np.float64)
    return y if leaf.b is None else y + np.asarray(leaf.b, np.float64)


def np_norm(p, x, cfg):
    scale = np.asarray(p["scale"], np.float64)
    if cfg.kind == "rms":
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.eps) * scale
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + cfg.eps) * scale
    return y + np.asarray(p["bias"], np.float64) if "bias" in p else y


_erf = np.vectorize(math.erf)
NP_ACT = {
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                                     * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
}


def np_mlp(p, x, cfg):
    act = NP_ACT[cfg.activation]
    if cfg.gated:
        h = act(np_linear(p["wi_0"], x)) * np_linear(p["wi_1"], x)
    else:
        h = act(np_linear(p["wi"], x))
    return np_linear(p["wo"], h)


def np_attention(p, x, cfg, *, kv=None, mask=None, bias=None, layer_index=0):
    kvx = x if kv is None else kv
    batch, q_len, _ = x.shape
    k_len = kvx.shape[1]
    heads, dh = cfg.num_heads, cfg.head_dim
    full = (batch, heads, q_len, k_len)
    mask = None if mask is None else np.broadcast_to(np.asarray(mask), full)
    bias = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    if cfg.qkv_keep is not None:
        seed = cfg.qkv_mask_seed + layer_index
        mq = np.asarray(qkv_activation_masks(seed, q_len, dh, cfg.qkv_keep)["q"], np.float64)
        mkv = qkv_activation_masks(seed, k_len, dh, cfg.qkv_keep)
        mk, mv = (np.asarray(mkv[n], np.float64) for n in "kv")
    out = np.zeros((batch, q_len, heads * dh))
    for b in range(batch):
        q_all, k_all, v_all = (np_linear(p["q"], x[b]), np_linear(p["k"], kvx[b]),
                               np_linear(p["v"], kvx[b]))
        for h in range(heads):
            cols = slice(h * dh, (h + 1) * dh)
            q, k, v = q_all[:, cols], k_all[:, cols], v_all[:, cols]
            if cfg.qkv_keep is not None:
                q, k, v = q * mq, k * mk, v * mv
            s = q @ k.T
            if cfg.scaled:
                s = s / math.sqrt(dh)
            if bias is not None:
                s = s + bias[b, h]
            if mask is not None:
                s = np.where(mask[b, h], s, F32_MIN)
            out[b, :, cols] = np_softmax(s) @ v
    return np_linear(p["o"], out)


def np_residual(prenorm, norm_p, norm_cfg, x, fn):
    if prenorm:
        return x + fn(np_norm(norm_p, x, norm_cfg))
    return np_norm(norm_p, x + fn(x), norm_cfg)


def np_encoder_layer(p, x, cfg, *, mask=None, bias=None, layer_index=0):
    attn = lambda h: np_attention(p["attn"], h, cfg.attention, mask=mask, bias=bias,
                                  layer_index=layer_index)
    x = np_residual(cfg.prenorm, p["attn_norm"], cfg.norm, x, attn)
    return np_residual(cfg.prenorm, p["mlp_norm"], cfg.norm, x,
                       lambda h: np_mlp(p["mlp"], h, cfg.mlp))


def np_decoder_layer(p, x, enc, cfg, *, self_mask=None, cross_mask=None, self_bias=None,
                     cross_bias=None, layer_index=0):
    t = x.shape[1]
    smask = np.tril(np.ones((t, t), bool))[None, None]  # causal, always on
    if self_mask is not None:
        smask = smask & np.asarray(self_mask)
    sa = lambda h: np_attention(p["self_attn"], h, cfg.self_attention, mask=smask,
                                bias=self_bias, layer_index=layer_index)
    ca = lambda h: np_attention(p["cross_attn"], h, cfg.cross_attention, kv=enc,
                                mask=cross_mask, bias=cross_bias, layer_index=layer_index)
    x = np_residual(cfg.prenorm, p["self_attn_norm"], cfg.norm, x, sa)
    x = np_residual(cfg.prenorm, p["cross_attn_norm"], cfg.norm, x, ca)
    return np_residual(cfg.prenorm, p["mlp_norm"], cfg.norm, x,
                       lambda h: np_mlp(p["mlp"], h, cfg.mlp))


def hf_t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Plain-Python transcription of HF ``T5Attention._relative_position_bucket``."""
    ret = 0
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if relative_position > 0 else 0
        relative_position = abs(relative_position)
    else:
        relative_position = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if relative_position < max_exact:
        return ret + relative_position
    large = max_exact + int(math.log(relative_position / max_exact)
                            / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(large, num_buckets - 1)


def np_relative_bias(table, q_len, k_len, bidirectional, num_buckets, max_distance):
    table = np.asarray(table, np.float64)
    out = np.zeros((1, table.shape[1], q_len, k_len))
    for i in range(q_len):
        for j in range(k_len):
            out[0, :, i, j] = table[hf_t5_bucket(j - i, bidirectional, num_buckets,
                                                 max_distance)]
    return out


def np_encoder(p, x, cfg, *, mask=None):
    x = np.asarray(x, np.float64)
    bias = None
    if cfg.relative_bias is not None:
        rb = cfg.relative_bias
        bias = np_relative_bias(p["rel_bias"], x.shape[1], x.shape[1], rb.bidirectional,
                                rb.num_buckets, rb.max_distance)
    hidden = []
    for i, lp in enumerate(p["layers"]):
        hidden.append(x)
        x = np_encoder_layer(lp, x, cfg.layer, mask=mask, bias=bias, layer_index=i)
    if cfg.final_norm:
        x = np_norm(p["final_norm"], x, cfg.layer.norm)
    return x, hidden


def np_decoder(p, x, enc, cfg, *, self_mask=None, cross_mask=None):
    x, enc = np.asarray(x, np.float64), np.asarray(enc, np.float64)
    bias = None
    if cfg.relative_bias is not None:  # decoders always use causal buckets (HF is_decoder)
        rb = cfg.relative_bias
        bias = np_relative_bias(p["rel_bias"], x.shape[1], x.shape[1], False, rb.num_buckets,
                                rb.max_distance)
    hidden = []
    for i, lp in enumerate(p["layers"]):
        hidden.append(x)
        x = np_decoder_layer(lp, x, enc, cfg.layer, self_mask=self_mask, cross_mask=cross_mask,
                             self_bias=bias, layer_index=i)
    if cfg.final_norm:
        x = np_norm(p["final_norm"], x, cfg.layer.norm)
    return x, hidden


# ---------------------------------------------------------------------------------------------
# Helpers.

def rand(seed, shape, scale=1.0):
    # Cast in NumPy: a float64 -> float32 cast in JAX would compile per shape.
    z = scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(z.astype(np.float32))


def random_params(init_fn, cfg, seed):
    """Params with ``init_fn``'s exact tree structure, drawn with NumPy (no compile).

    Weights ~ N(0, 1/d_in); norm scales ~ 1 + N(0, 0.2^2); biases ~ N(0, 0.2^2); relative-bias
    tables ~ N(0, 1), so every parameter visibly matters.
    """
    shapes = jax.eval_shape(lambda k: init_fn(k, cfg), jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = jax.tree_util.keystr(path)
        z = rng.standard_normal(s.shape)
        if "rel_bias" in name:
            val = z
        elif len(s.shape) == 2:
            val = z / math.sqrt(s.shape[0])
        elif "scale" in name:
            val = 1.0 + 0.2 * z
        else:
            val = 0.2 * z
        return jnp.asarray(val.astype(s.dtype))

    return jax.tree_util.tree_map_with_path(draw, shapes)


def densify(tree):
    """Every weight leaf -> Dense(materialize(leaf), leaf.b)."""
    return jax.tree_util.tree_map(
        lambda n: Dense(w=materialize(n), b=n.b) if is_leaf(n) else n, tree, is_leaf=is_leaf)


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


T5_NORM = NormConfig("rms", eps=1e-6)
BERT_NORM = NormConfig("layer", eps=1e-12, use_bias=True)


def t5_layer(d=8, heads=2, d_head=3, d_ff=12, **attn_kw):
    attn = AttentionConfig(d_model=d, num_heads=heads, d_head=d_head, scaled=False, **attn_kw)
    mlp = MLPConfig(d_model=d, d_ff=d_ff, activation="gelu_tanh", gated=True)
    return EncoderLayerConfig(attention=attn, mlp=mlp, norm=T5_NORM, prenorm=True)


def bert_layer(d=8, heads=2, d_ff=12):
    attn = AttentionConfig(d_model=d, num_heads=heads, use_bias=True)
    mlp = MLPConfig(d_model=d, d_ff=d_ff, activation="gelu", use_bias=True)
    return EncoderLayerConfig(attention=attn, mlp=mlp, norm=BERT_NORM, prenorm=False)


def t5_decoder_layer(d=8, heads=2, d_head=3, d_enc=6, prenorm=True, norm=T5_NORM):
    self_attn = AttentionConfig(d_model=d, num_heads=heads, d_head=d_head, scaled=False)
    cross = AttentionConfig(d_model=d, num_heads=heads, d_head=d_head, scaled=False,
                            d_kv_in=d_enc)
    mlp = MLPConfig(d_model=d, d_ff=12, activation="relu")
    return DecoderLayerConfig(self_attention=self_attn, cross_attention=cross, mlp=mlp,
                              norm=norm, prenorm=prenorm)


enc_layer = jax.jit(apply_encoder_layer, static_argnames=("cfg", "layer_index"))
dec_layer = jax.jit(apply_decoder_layer, static_argnames=("cfg", "layer_index"))
encoder = jax.jit(apply_encoder, static_argnames=("cfg", "return_hidden"))
decoder = jax.jit(apply_decoder, static_argnames=("cfg", "return_hidden"))


# ---------------------------------------------------------------------------------------------
# Layers.

def test_prenorm_encoder_layer_t5():
    cfg = t5_layer()
    p = random_params(init_encoder_layer, cfg, 1)
    assert set(p) == {"attn", "attn_norm", "mlp", "mlp_norm"}
    assert set(p["attn_norm"]) == {"scale"}  # RMSNorm: no bias
    x = rand(2, (2, 5, 8))
    bias = rand(3, (1, 2, 5, 5))
    y = enc_layer(p, x, cfg, bias=bias)
    ref = np_encoder_layer(p, np.asarray(x, np.float64), cfg, bias=bias)
    assert max_err(y, ref) <= TOL


def test_postnorm_encoder_layer_bert():
    cfg = bert_layer()
    p = random_params(init_encoder_layer, cfg, 4)
    assert set(p["mlp_norm"]) == {"scale", "bias"}
    x = rand(5, (2, 5, 8))
    mask = padding_mask(np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], bool))
    y = enc_layer(p, x, cfg, mask=mask)
    ref = np_encoder_layer(p, np.asarray(x, np.float64), cfg, mask=np.asarray(mask))
    assert max_err(y, ref) <= TOL
    # Post-norm output is normalized: per-token (y - bias)/scale has zero mean, unit variance.
    z = (np.asarray(y, np.float64) - np.asarray(p["mlp_norm"]["bias"])) / np.asarray(
        p["mlp_norm"]["scale"])
    np.testing.assert_allclose(z.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(z.var(-1), 1.0, atol=1e-4)


def test_prenorm_and_postnorm_differ():
    cfg = bert_layer()
    p = random_params(init_encoder_layer, cfg, 6)
    x = rand(7, (1, 4, 8))
    y_post = enc_layer(p, x, cfg)
    y_pre = enc_layer(p, x, dataclasses.replace(cfg, prenorm=True))
    assert max_err(y_post, y_pre) > 1e-2
    ref_pre = np_encoder_layer(p, np.asarray(x, np.float64), dataclasses.replace(cfg,
                                                                                  prenorm=True))
    assert max_err(y_pre, ref_pre) <= TOL


@pytest.mark.parametrize("prenorm,norm", [(True, T5_NORM), (False, BERT_NORM)])
def test_decoder_layer(prenorm, norm):
    cfg = t5_decoder_layer(prenorm=prenorm, norm=norm)
    p = random_params(init_decoder_layer, cfg, 8)
    assert set(p) == {"self_attn", "self_attn_norm", "cross_attn", "cross_attn_norm", "mlp",
                      "mlp_norm"}
    assert p["cross_attn"]["k"].shape == (6, 6)  # d_enc=6 -> heads*d_head=6
    x, enc = rand(9, (2, 4, 8)), rand(10, (2, 7, 6))
    cross_mask = padding_mask(np.array([[1] * 7, [1] * 5 + [0] * 2], bool))
    self_mask = padding_mask(np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool))
    self_bias = rand(11, (1, 2, 4, 4))
    y = dec_layer(p, x, enc, cfg, self_mask=self_mask, cross_mask=cross_mask,
                  self_bias=self_bias)
    ref = np_decoder_layer(p, np.asarray(x, np.float64), np.asarray(enc, np.float64), cfg,
                           self_mask=np.asarray(self_mask), cross_mask=np.asarray(cross_mask),
                           self_bias=self_bias)
    assert max_err(y, ref) <= TOL


def test_decoder_layer_is_causal():
    # Changing a later decoder token never changes earlier outputs.
    cfg = t5_decoder_layer()
    p = random_params(init_decoder_layer, cfg, 12)
    x, enc = rand(13, (1, 5, 8)), rand(14, (1, 3, 6))
    y1 = dec_layer(p, x, enc, cfg)
    y2 = dec_layer(p, x.at[0, 3:].add(5.0), enc, cfg)
    assert max_err(y1[0, :3], y2[0, :3]) <= TOL
    assert max_err(y1[0, 3:], y2[0, 3:]) > 1e-3


def test_encoder_layer_qkv_masks_use_layer_index():
    cfg = t5_layer(qkv_keep=0.5, qkv_mask_seed=3)
    p = random_params(init_encoder_layer, cfg, 15)
    x = rand(16, (2, 5, 8))
    for li in (0, 4):
        ref = np_encoder_layer(p, np.asarray(x, np.float64), cfg, layer_index=li)
        assert max_err(enc_layer(p, x, cfg, layer_index=li), ref) <= TOL


# ---------------------------------------------------------------------------------------------
# Stacks.

def test_encoder_stack_shared_relative_bias_and_hidden():
    rb = RelativeBiasConfig(num_buckets=8, max_distance=12)
    cfg = EncoderConfig(layer=t5_layer(), num_layers=3, final_norm=True, relative_bias=rb)
    p = random_params(init_encoder, cfg, 17)
    assert set(p) == {"layers", "rel_bias", "final_norm"}
    assert isinstance(p["layers"], list) and len(p["layers"]) == 3
    assert p["rel_bias"].shape == (8, 2)
    assert all("rel_bias" not in str(jax.tree_util.tree_structure(lp)) for lp in p["layers"])
    x = rand(18, (2, 14, 8))  # longer than max_distance: log buckets and clipping both hit
    mask = padding_mask(np.array([[1] * 14, [1] * 9 + [0] * 5], bool))
    y, hidden = encoder(p, x, cfg, mask=mask, return_hidden=True)
    ref, ref_hidden = np_encoder(p, x, cfg, mask=np.asarray(mask))
    assert max_err(y, ref) <= TOL
    assert len(hidden) == 3
    for h, rh in zip(hidden, ref_hidden, strict=True):
        assert max_err(h, rh) <= TOL
    assert max_err(hidden[0], x) == 0.0  # the input of layer 0 is the stack input
    y_only = encoder(p, x, cfg, mask=mask)
    assert max_err(y_only, y) == 0.0


def test_encoder_stack_no_final_norm_postnorm():
    cfg = EncoderConfig(layer=bert_layer(), num_layers=2, final_norm=False)
    p = random_params(init_encoder, cfg, 21)
    assert set(p) == {"layers"}
    x = rand(22, (2, 4, 8))
    ref, _ = np_encoder(p, x, cfg)
    assert max_err(encoder(p, x, cfg), ref) <= TOL


def test_encoder_stack_flow_of_ranks_leaves_equal_dense():
    # Layers with different leaf types and ranks in one list (not stackable, hence no scan).
    cfg = EncoderConfig(layer=t5_layer(qkv_keep=0.75), num_layers=2,
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = random_params(init_encoder, cfg, 23)
    d, inner = 8, 6
    for i, r in enumerate((3, 1)):
        lp = p["layers"][i]
        lp["attn"]["q"] = HeadLowRank(u=rand(30 + i, (d, 2, r)), v=rand(40 + i, (2, r, 3)))
        lp["attn"]["o"] = LowRank(u=rand(50 + i, (inner, r)), v=rand(60 + i, (r, d)))
        lp["mlp"]["wi_1"] = MaskedBinary(w=rand(70 + i, (d, 12)), s=rand(80 + i, (d, 12)),
                                         keep=0.25 * (i + 1))
    counts = [param_count(lp) for lp in p["layers"]]
    assert len(set(counts)) == 2  # the layers really differ
    x = rand(24, (2, 5, 8))
    y = encoder(p, x, cfg)
    p_dense = densify(p)
    assert max_err(y, encoder(p_dense, x, cfg)) <= TOL
    ref, _ = np_encoder(p_dense, x, cfg)
    assert max_err(y, ref) <= TOL


def test_decoder_stack_causal_relative_bias():
    # bidirectional=True in the config: decoders still use causal buckets (HF is_decoder).
    rb = RelativeBiasConfig(num_buckets=8, max_distance=12, bidirectional=True)
    cfg = DecoderConfig(layer=t5_decoder_layer(), num_layers=2, relative_bias=rb)
    p = random_params(init_decoder, cfg, 25)
    assert set(p) == {"layers", "rel_bias", "final_norm"} and len(p["layers"]) == 2
    x, enc = rand(26, (2, 13, 8)), rand(27, (2, 5, 6))
    cross_mask = padding_mask(np.array([[1] * 5, [1] * 3 + [0] * 2], bool))
    y, hidden = decoder(p, x, enc, cfg, cross_mask=cross_mask, return_hidden=True)
    ref, ref_hidden = np_decoder(p, x, enc, cfg, cross_mask=np.asarray(cross_mask))
    assert max_err(y, ref) <= TOL
    assert len(hidden) == 2 and max_err(hidden[1], ref_hidden[1]) <= TOL
    # Causal: later decoder positions never influence earlier outputs.
    y2 = decoder(p, x.at[:, 7:].add(3.0), enc, cfg, cross_mask=cross_mask)
    assert max_err(y[:, :7], y2[:, :7]) <= TOL


def test_decoder_stack_self_mask_no_bias():
    cfg = DecoderConfig(layer=t5_decoder_layer(prenorm=False, norm=BERT_NORM), num_layers=2,
                        final_norm=False)
    p = random_params(init_decoder, cfg, 28)
    assert set(p) == {"layers"}
    x, enc = rand(29, (2, 4, 8)), rand(30, (2, 3, 6))
    self_mask = padding_mask(np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool))
    y = decoder(p, x, enc, cfg, self_mask=self_mask)
    ref, _ = np_decoder(p, x, enc, cfg, self_mask=np.asarray(self_mask))
    assert max_err(y, ref) <= TOL


def test_init_stacks():
    layer = EncoderLayerConfig(attention=AttentionConfig(d_model=8, num_heads=2),
                               mlp=MLPConfig(d_model=8, d_ff=12), norm=T5_NORM)
    cfg = EncoderConfig(layer=layer, num_layers=2,
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = init_encoder(jax.random.PRNGKey(0), cfg)
    assert set(p) == {"layers", "rel_bias", "final_norm"} and len(p["layers"]) == 2
    w0, w1 = (np.asarray(lp["attn"]["q"].w) for lp in p["layers"])
    assert w0.shape == (8, 8) and not np.array_equal(w0, w1)  # distinct keys per layer
    np.testing.assert_array_equal(np.asarray(p["final_norm"]["scale"]), np.ones(8))
    assert p["rel_bias"].shape == (8, 2) and float(jnp.abs(p["rel_bias"]).max()) > 0
    dcfg = DecoderConfig(layer=t5_decoder_layer(), num_layers=3, final_norm=False)
    shapes = jax.eval_shape(lambda k: init_decoder(k, dcfg), jax.random.PRNGKey(0))
    assert set(shapes) == {"layers"} and len(shapes["layers"]) == 3
    assert shapes["layers"][2]["cross_attn"]["k"].shape == (6, 6)


# ---------------------------------------------------------------------------------------------
# jit / eager / grad / retracing.

def test_encoder_jit_eager_grad_no_retrace():
    cfg = EncoderConfig(layer=t5_layer(), num_layers=2,
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = random_params(init_encoder, cfg, 31)
    p["layers"][1]["attn"]["k"] = LowRank(u=rand(32, (8, 2)), v=rand(33, (2, 6)))
    x = rand(34, (1, 4, 8))
    assert max_err(apply_encoder(p, x, cfg), encoder(p, x, cfg)) <= TOL

    @chex.assert_max_traces(n=1)
    def loss(p, x):
        return jnp.sum(apply_encoder(p, x, cfg) ** 2)

    grad = jax.jit(jax.grad(loss))
    g = grad(p, x)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)
    assert float(jnp.abs(g["rel_bias"]).sum()) > 0  # the shared table gets a gradient
    grad(p, x * 2.0)  # a second call with new values must not retrace
    chex.clear_trace_counter()


def test_decoder_grad_structure():
    cfg = DecoderConfig(layer=t5_decoder_layer(), num_layers=1,
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = random_params(init_decoder, cfg, 35)
    x, enc = rand(36, (1, 4, 8)), rand(37, (1, 3, 6))
    g = jax.jit(jax.grad(lambda p: jnp.sum(apply_decoder(p, x, enc, cfg) ** 2)))(p)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)


# ---------------------------------------------------------------------------------------------
# Errors.

def test_layer_config_mismatch_raises():
    attn = AttentionConfig(d_model=8, num_heads=2)
    with pytest.raises(ValueError, match="mlp.d_model must equal"):
        EncoderLayerConfig(attention=attn, mlp=MLPConfig(d_model=6, d_ff=4), norm=T5_NORM)
    with pytest.raises(ValueError, match="d_kv_in"):
        EncoderLayerConfig(attention=dataclasses.replace(attn, d_kv_in=6),
                           mlp=MLPConfig(d_model=8, d_ff=4), norm=T5_NORM)
    with pytest.raises(ValueError, match="cross_attention.d_model"):
        DecoderLayerConfig(self_attention=attn,
                           cross_attention=AttentionConfig(d_model=6, num_heads=2),
                           mlp=MLPConfig(d_model=8, d_ff=4), norm=T5_NORM)
    with pytest.raises(ValueError, match="norm must be a NormConfig"):
        EncoderLayerConfig(attention=attn, mlp=MLPConfig(d_model=8, d_ff=4), norm="rms")


def test_stack_config_and_params_mismatch_raise():
    with pytest.raises(ValueError, match="num_layers"):
        EncoderConfig(layer=t5_layer(), num_layers=0)
    with pytest.raises(ValueError, match="layer must be a DecoderLayerConfig"):
        DecoderConfig(layer=t5_layer(), num_layers=1)
    with pytest.raises(ValueError, match="relative_bias must be a RelativeBiasConfig"):
        EncoderConfig(layer=t5_layer(), num_layers=1, relative_bias=32)
    cfg = EncoderConfig(layer=t5_layer(), num_layers=2, final_norm=False)
    p = random_params(init_encoder, cfg, 38)
    with pytest.raises(ValueError, match="params hold 1 layers"):
        apply_encoder({"layers": p["layers"][:1]}, rand(39, (1, 3, 8)), cfg)


def test_encoder_mask_of_wrong_rank_raises():
    cfg = EncoderConfig(layer=t5_layer(), num_layers=1, final_norm=False)
    p = random_params(init_encoder, cfg, 40)
    with pytest.raises(ValueError, match="mask must be 4-D"):
        apply_encoder(p, rand(41, (2, 3, 8)), cfg, mask=jnp.ones((2, 3), bool))
