"""Encoder/decoder layers and stacks against a plain float64 NumPy composition."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import (
    Dense,
    HeadLayout,
    HeadLowRank,
    LowRank,
    MaskedBinary,
    QueryKey,
    is_leaf,
    keep_inputs,
    keep_outputs,
    materialize,
    param_count,
)
from lowrank_jax.nn import (
    AttentionConfig,
    DecoderConfig,
    DecoderLayerConfig,
    EncoderConfig,
    EncoderLayerConfig,
    LayerSizes,
    MLPConfig,
    NormConfig,
    RelativeBiasConfig,
    apply_attention,
    apply_attention_cached,
    apply_decoder,
    apply_decoder_layer,
    apply_decoder_step,
    apply_encoder,
    apply_encoder_layer,
    causal_mask,
    init_attention,
    init_attention_cache,
    init_decoder,
    init_decoder_cache,
    init_decoder_layer,
    init_encoder,
    init_encoder_layer,
    init_mlp,
    keep_heads,
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
    """Loop over batch and heads. Sizes come from the parameters (each layer may have its own);
    the scale is ``1/sqrt(d_head)`` of the block's widest (original) head when ``cfg.scaled``.
    A per-head mask or bias (head axis > 1) is read at the head's original id."""
    kvx = x if kv is None else kv
    batch, q_len, _ = x.shape
    k_len = kvx.shape[1]
    widths, v_widths, ids = p["qk"].widths, p["heads"].v, p["heads"].ids
    oq = np.concatenate([[0], np.cumsum(widths)]).astype(int)
    ov = np.concatenate([[0], np.cumsum(v_widths)]).astype(int)
    dh = max(widths)
    scale = 1.0 / math.sqrt(dh) if cfg.scaled else 1.0

    def per_head(arr, b, h, dtype):
        arr = np.asarray(arr, dtype)
        return np.broadcast_to(arr[b if arr.shape[0] > 1 else 0,
                                   ids[h] if arr.shape[1] > 1 else 0], (q_len, k_len))

    if cfg.qkv_keep is not None:
        seed = cfg.qkv_mask_seed + layer_index
        mq = np.asarray(qkv_activation_masks(seed, q_len, dh, cfg.qkv_keep)["q"], np.float64)
        mk = np.asarray(qkv_activation_masks(seed, k_len, dh, cfg.qkv_keep)["k"], np.float64)
        mv = np.asarray(qkv_activation_masks(seed, k_len, max(v_widths), cfg.qkv_keep)["v"],
                        np.float64)
    out = np.zeros((batch, q_len, sum(v_widths)))
    for b in range(batch):
        q_all, k_all, v_all = (np_linear(p["qk"].q, x[b]), np_linear(p["qk"].k, kvx[b]),
                               np_linear(p["v"], kvx[b]))
        for h in range(len(widths)):
            q, k = q_all[:, oq[h]:oq[h + 1]], k_all[:, oq[h]:oq[h + 1]]
            v = v_all[:, ov[h]:ov[h + 1]]
            if cfg.qkv_keep is not None:
                q, k, v = q * mq[:, :widths[h]], k * mk[:, :widths[h]], v * mv[:, :v_widths[h]]
            s = q @ k.T * scale
            if bias is not None:
                s = s + per_head(bias, b, h, np.float64)
            if mask is not None:
                s = np.where(per_head(mask, b, h, bool), s, F32_MIN)
            out[b, :, ov[h]:ov[h + 1]] = np_softmax(s) @ v
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


def random_params(init_fn, seed):
    """Params with ``init_fn(key)``'s exact tree structure, drawn with NumPy (no compile).

    Weights ~ N(0, 1/d_in); norm scales ~ 1 + N(0, 0.2^2); biases ~ N(0, 0.2^2); relative-bias
    tables ~ N(0, 1), so every parameter visibly matters.
    """
    shapes = jax.eval_shape(init_fn, jax.random.PRNGKey(0))
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
    """Every weight leaf -> Dense(materialize(leaf), leaf.bias); containers are kept."""
    return jax.tree_util.tree_map(
        lambda n: Dense(w=materialize(n), b=n.bias) if is_leaf(n) else n, tree, is_leaf=is_leaf)


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


T5_NORM = NormConfig("rms", eps=1e-6)
BERT_NORM = NormConfig("layer", eps=1e-12, use_bias=True)
D = 8  # residual width of every test model
T5_SIZES = LayerSizes(num_heads=2, d_head=3, d_ff=12)  # num_heads * d_head != d_model (T5)
BERT_SIZES = LayerSizes(num_heads=2, d_head=4, d_ff=12)


def t5_layer(**attn_kw):
    attn = AttentionConfig(scaled=False, **attn_kw)
    mlp = MLPConfig(activation="gelu_tanh", gated=True)
    return EncoderLayerConfig(attention=attn, mlp=mlp, norm=T5_NORM, prenorm=True)


def bert_layer():
    attn = AttentionConfig(use_bias=True)
    mlp = MLPConfig(activation="gelu", use_bias=True)
    return EncoderLayerConfig(attention=attn, mlp=mlp, norm=BERT_NORM, prenorm=False)


def t5_decoder_layer(prenorm=True, norm=T5_NORM):
    self_attn = AttentionConfig(scaled=False)
    cross = AttentionConfig(scaled=False)
    mlp = MLPConfig(activation="relu")
    return DecoderLayerConfig(self_attention=self_attn, cross_attention=cross, mlp=mlp,
                              norm=norm, prenorm=prenorm)


def enc_layer_params(cfg, seed, sizes=T5_SIZES):
    return random_params(lambda k: init_encoder_layer(k, cfg, d_model=D, sizes=sizes), seed)


def dec_layer_params(cfg, seed, d_enc=6):
    return random_params(lambda k: init_decoder_layer(k, cfg, d_model=D, sizes=T5_SIZES,
                                                      d_enc=d_enc), seed)


def encoder_params(cfg, seed, num_layers, sizes=T5_SIZES):
    return random_params(lambda k: init_encoder(k, cfg, d_model=D,
                                                layers=(sizes,) * num_layers), seed)


def decoder_params(cfg, seed, num_layers, d_enc=6):
    return random_params(lambda k: init_decoder(k, cfg, d_model=D,
                                                layers=LayerSizes.uniform(
                                                    num_layers, num_heads=2, d_head=3, d_ff=12),
                                                d_enc=d_enc), seed)


enc_layer = jax.jit(apply_encoder_layer, static_argnames=("cfg", "layer_index"))
dec_layer = jax.jit(apply_decoder_layer, static_argnames=("cfg", "layer_index"))
encoder = jax.jit(apply_encoder, static_argnames=("cfg", "return_hidden"))
decoder = jax.jit(apply_decoder, static_argnames=("cfg", "return_hidden"))


# ---------------------------------------------------------------------------------------------
# Layers.

def test_prenorm_encoder_layer_t5():
    cfg = t5_layer()
    p = enc_layer_params(cfg, 1)
    assert set(p) == {"attn", "attn_norm", "mlp", "mlp_norm"}
    assert set(p["attn_norm"]) == {"scale"}  # RMSNorm: no bias
    assert p["attn"]["qk"].widths == (3, 3) and p["attn"]["heads"].scale == 1.0  # T5: unscaled
    x = rand(2, (2, 5, 8))
    bias = rand(3, (1, 2, 5, 5))
    y = enc_layer(p, x, cfg, bias=bias)
    ref = np_encoder_layer(p, np.asarray(x, np.float64), cfg, bias=bias)
    assert max_err(y, ref) <= TOL


def test_postnorm_encoder_layer_bert():
    cfg = bert_layer()
    p = enc_layer_params(cfg, 4, BERT_SIZES)
    assert set(p["mlp_norm"]) == {"scale", "bias"}
    assert p["attn"]["heads"].scale == 0.5  # scaled: 1/sqrt(d_head=4)
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
    p = enc_layer_params(cfg, 6, BERT_SIZES)
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
    p = dec_layer_params(cfg, 8)
    assert set(p) == {"self_attn", "self_attn_norm", "cross_attn", "cross_attn_norm", "mlp",
                      "mlp_norm"}
    assert p["cross_attn"]["qk"].k.shape == (6, 6)  # d_enc=6 -> heads*d_head=6
    assert p["cross_attn"]["v"].shape == (6, 6) and p["self_attn"]["qk"].k.shape == (8, 6)
    x, enc = rand(9, (2, 4, 8)), rand(10, (2, 7, 6))
    cross_mask = padding_mask(np.array([[1] * 7, [1] * 5 + [0] * 2], bool))
    self_mask = padding_mask(np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool))
    self_bias = rand(11, (1, 2, 4, 4))
    y = dec_layer(p, x, cfg, enc=enc, self_mask=self_mask, cross_mask=cross_mask,
                  self_bias=self_bias)
    ref = np_decoder_layer(p, np.asarray(x, np.float64), np.asarray(enc, np.float64), cfg,
                           self_mask=np.asarray(self_mask), cross_mask=np.asarray(cross_mask),
                           self_bias=self_bias)
    assert max_err(y, ref) <= TOL


def test_decoder_layer_is_causal():
    # Changing a later decoder token never changes earlier outputs.
    cfg = t5_decoder_layer()
    p = dec_layer_params(cfg, 12)
    x, enc = rand(13, (1, 5, 8)), rand(14, (1, 3, 6))
    y1 = dec_layer(p, x, cfg, enc=enc)
    y2 = dec_layer(p, x.at[0, 3:].add(5.0), cfg, enc=enc)
    assert max_err(y1[0, :3], y2[0, :3]) <= TOL
    assert max_err(y1[0, 3:], y2[0, 3:]) > 1e-3


def test_encoder_layer_qkv_masks_use_layer_index():
    cfg = t5_layer(qkv_keep=0.5, qkv_mask_seed=3)
    p = enc_layer_params(cfg, 15)
    x = rand(16, (2, 5, 8))
    for li in (0, 4):
        ref = np_encoder_layer(p, np.asarray(x, np.float64), cfg, layer_index=li)
        assert max_err(enc_layer(p, x, cfg, layer_index=li), ref) <= TOL


def test_layer_sizes_set_every_width():
    # d_v differs from d_head; every size is an init argument, none is in the config.
    sizes = LayerSizes(num_heads=3, d_head=2, d_ff=5, d_v=4)
    cfg = bert_layer()
    p = enc_layer_params(cfg, 42, sizes)
    attn = p["attn"]
    assert attn["qk"].widths == (2, 2, 2) and attn["heads"].v == (4, 4, 4)
    assert attn["v"].shape == (8, 12) and attn["o"].shape == (12, 8)
    assert attn["heads"].scale == pytest.approx(1 / math.sqrt(2))
    assert p["mlp"]["wi"].shape == (8, 5) and p["mlp"]["wo"].shape == (5, 8)
    x = rand(43, (2, 4, 8))
    assert max_err(enc_layer(p, x, cfg), np_encoder_layer(p, np.asarray(x, np.float64),
                                                          cfg)) <= TOL
    assert LayerSizes.uniform(2, num_heads=3, d_head=2, d_ff=5, d_v=4) == (sizes, sizes)


# ---------------------------------------------------------------------------------------------
# Stacks.

def test_encoder_stack_shared_relative_bias_and_hidden():
    rb = RelativeBiasConfig(num_buckets=8, max_distance=12)
    cfg = EncoderConfig(layer=t5_layer(), final_norm=True, relative_bias=rb)
    p = encoder_params(cfg, 17, 3)
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
    cfg = EncoderConfig(layer=bert_layer(), final_norm=False)
    p = encoder_params(cfg, 21, 2, BERT_SIZES)
    assert set(p) == {"layers"}
    x = rand(22, (2, 4, 8))
    ref, _ = np_encoder(p, x, cfg)
    assert max_err(encoder(p, x, cfg), ref) <= TOL


def test_encoder_stack_flow_of_ranks_leaves_equal_dense():
    # Layers with different leaf types and ranks in one list (not stackable, hence no scan).
    cfg = EncoderConfig(layer=t5_layer(qkv_keep=0.75),
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = encoder_params(cfg, 23, 2)
    d, inner = 8, 6
    for i, r in enumerate((3, 1)):
        lp = p["layers"][i]
        q = HeadLowRank(u=rand(30 + i, (d, 2, r)), v=rand(40 + i, (2, r, 3)))
        lp["attn"]["qk"] = QueryKey(q=q, k=lp["attn"]["qk"].k, widths=(3, 3))
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


def test_encoder_stack_per_layer_sizes():
    # Layers of different head counts and widths; the shared table covers the most heads.
    sizes = (LayerSizes(num_heads=4, d_head=2, d_ff=12), LayerSizes(num_heads=2, d_head=3,
                                                                     d_ff=6, d_v=5))
    cfg = EncoderConfig(layer=bert_layer(),
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = random_params(lambda k: init_encoder(k, cfg, d_model=D, layers=sizes), 90)
    assert p["rel_bias"].shape == (8, 4)
    l0, l1 = (lp["attn"] for lp in p["layers"])
    assert l0["qk"].widths == (2,) * 4 and l1["qk"].widths == (3, 3) and l1["heads"].v == (5, 5)
    assert l1["heads"].ids == (0, 1) and p["layers"][1]["mlp"]["wi"].shape == (8, 6)
    x = rand(91, (2, 6, 8))
    ref, _ = np_encoder(p, x, cfg)
    assert max_err(encoder(p, x, cfg), ref) <= TOL


def test_encoder_stack_with_pruned_heads_reads_shared_table_by_id():
    """Layer 1 keeps original heads (1, 3) of 4: its relative bias is columns 1 and 3 of the
    shared table, and the stack equals the unpruned one with heads 0 and 2 of layer 1 silenced
    (their value columns zeroed)."""
    sizes = LayerSizes(num_heads=4, d_head=2, d_ff=12)
    cfg = EncoderConfig(layer=t5_layer(),
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = encoder_params(cfg, 92, 2, sizes)
    attn = p["layers"][1]["attn"]
    keep = np.array([1, 3])
    vcols = np.array([2, 3, 6, 7])
    pruned = dict(p, layers=[p["layers"][0], dict(p["layers"][1], attn={
        "qk": attn["qk"].keep_heads(keep), "v": keep_outputs(attn["v"], vcols),
        "o": keep_inputs(attn["o"], vcols), "heads": attn["heads"].keep(keep)})])
    assert pruned["layers"][1]["attn"]["heads"].ids == (1, 3)
    wv = np.asarray(attn["v"].w).copy()
    wv[:, [0, 1, 4, 5]] = 0
    silenced = dict(p, layers=[p["layers"][0], dict(p["layers"][1], attn=dict(
        attn, v=Dense(jnp.asarray(wv))))])
    x = rand(93, (2, 6, 8))
    y = encoder(pruned, x, cfg)
    assert max_err(y, encoder(silenced, x, cfg)) <= TOL
    ref, _ = np_encoder(pruned, x, cfg)
    assert max_err(y, ref) <= TOL
    assert max_err(y, encoder(p, x, cfg)) > 1e-3


def test_decoder_stack_causal_relative_bias():
    # bidirectional=True in the config: decoders still use causal buckets (HF is_decoder).
    rb = RelativeBiasConfig(num_buckets=8, max_distance=12, bidirectional=True)
    cfg = DecoderConfig(layer=t5_decoder_layer(), relative_bias=rb)
    p = decoder_params(cfg, 25, 2)
    assert set(p) == {"layers", "rel_bias", "final_norm"} and len(p["layers"]) == 2
    x, enc = rand(26, (2, 13, 8)), rand(27, (2, 5, 6))
    cross_mask = padding_mask(np.array([[1] * 5, [1] * 3 + [0] * 2], bool))
    y, hidden = decoder(p, x, cfg, enc=enc, cross_mask=cross_mask, return_hidden=True)
    ref, ref_hidden = np_decoder(p, x, enc, cfg, cross_mask=np.asarray(cross_mask))
    assert max_err(y, ref) <= TOL
    assert len(hidden) == 2 and max_err(hidden[1], ref_hidden[1]) <= TOL
    # Causal: later decoder positions never influence earlier outputs.
    y2 = decoder(p, x.at[:, 7:].add(3.0), cfg, enc=enc, cross_mask=cross_mask)
    assert max_err(y[:, :7], y2[:, :7]) <= TOL


def test_decoder_stack_self_mask_no_bias():
    cfg = DecoderConfig(layer=t5_decoder_layer(prenorm=False, norm=BERT_NORM), final_norm=False)
    p = decoder_params(cfg, 28, 2)
    assert set(p) == {"layers"}
    x, enc = rand(29, (2, 4, 8)), rand(30, (2, 3, 6))
    self_mask = padding_mask(np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool))
    y = decoder(p, x, cfg, enc=enc, self_mask=self_mask)
    ref, _ = np_decoder(p, x, enc, cfg, self_mask=np.asarray(self_mask))
    assert max_err(y, ref) <= TOL


def test_init_stacks():
    layer = EncoderLayerConfig(attention=AttentionConfig(), mlp=MLPConfig(), norm=T5_NORM)
    cfg = EncoderConfig(layer=layer,
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = init_encoder(jax.random.PRNGKey(0), cfg, d_model=8,
                     layers=LayerSizes.uniform(2, num_heads=2, d_head=4, d_ff=12))
    assert set(p) == {"layers", "rel_bias", "final_norm"} and len(p["layers"]) == 2
    w0, w1 = (np.asarray(lp["attn"]["qk"].q.w) for lp in p["layers"])
    assert w0.shape == (8, 8) and not np.array_equal(w0, w1)  # distinct keys per layer
    np.testing.assert_array_equal(np.asarray(p["final_norm"]["scale"]), np.ones(8))
    assert p["rel_bias"].shape == (8, 2) and float(jnp.abs(p["rel_bias"]).max()) > 0
    dcfg = DecoderConfig(layer=t5_decoder_layer(), final_norm=False)
    shapes = jax.eval_shape(
        lambda k: init_decoder(k, dcfg, d_model=8, d_enc=6,
                               layers=LayerSizes.uniform(3, num_heads=2, d_head=3, d_ff=12)),
        jax.random.PRNGKey(0))
    assert set(shapes) == {"layers"} and len(shapes["layers"]) == 3
    assert shapes["layers"][2]["cross_attn"]["qk"].k.shape == (6, 6)


# ---------------------------------------------------------------------------------------------
# jit / eager / grad / retracing.

def test_encoder_jit_eager_grad_no_retrace():
    cfg = EncoderConfig(layer=t5_layer(),
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = encoder_params(cfg, 31, 2)
    qk = p["layers"][1]["attn"]["qk"]
    p["layers"][1]["attn"]["qk"] = QueryKey(q=qk.q, k=LowRank(u=rand(32, (8, 2)),
                                                              v=rand(33, (2, 6))),
                                            widths=qk.widths)
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
    cfg = DecoderConfig(layer=t5_decoder_layer(),
                        relative_bias=RelativeBiasConfig(num_buckets=8, max_distance=12))
    p = decoder_params(cfg, 35, 1)
    x, enc = rand(36, (1, 4, 8)), rand(37, (1, 3, 6))
    g = jax.jit(jax.grad(lambda p: jnp.sum(apply_decoder(p, x, cfg, enc=enc) ** 2)))(p)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)


# ---------------------------------------------------------------------------------------------
# Errors.

def test_layer_parameter_mismatch_raises():
    # Configs no longer carry widths: a mismatch shows up in the parameters, as a ShapeError
    # that names the problem (raised while tracing, before anything runs).
    cfg = t5_layer()
    p = enc_layer_params(cfg, 44)
    x = rand(45, (1, 3, 8))
    narrow_mlp = random_params(lambda k: init_mlp(k, cfg.mlp, d_model=6, d_ff=4), 1)
    with pytest.raises(ShapeError, match="d_in=6"):
        enc_layer(dict(p, mlp=narrow_mlp), x, cfg)
    cross_like = random_params(lambda k: init_attention(k, cfg.attention, d_model=8,
                                                        num_heads=2, d_kv_in=6), 2)
    with pytest.raises(ShapeError, match="kv must be"):  # keys expect 6 features
        enc_layer(dict(p, attn=cross_like), x, cfg)
    dcfg = t5_decoder_layer()
    dp = dec_layer_params(dcfg, 46)
    narrow_cross = random_params(lambda k: init_attention(k, dcfg.cross_attention, d_model=6,
                                                          num_heads=2, d_kv_in=6), 3)
    with pytest.raises(ShapeError, match="x must be"):
        dec_layer(dict(dp, cross_attn=narrow_cross), x, dcfg, enc=rand(47, (1, 2, 6)))
    with pytest.raises(ConfigError, match="norm must be a NormConfig"):
        EncoderLayerConfig(attention=AttentionConfig(), mlp=MLPConfig(), norm="rms")
    with pytest.raises(ConfigError, match="cross_attention must be a AttentionConfig"):
        DecoderLayerConfig(self_attention=AttentionConfig(), cross_attention=None,
                           mlp=MLPConfig(), norm=T5_NORM)
    with pytest.raises(ConfigError, match="sizes must be a LayerSizes"):
        init_encoder_layer(jax.random.PRNGKey(0), cfg, d_model=8, sizes=(2, 3, 12))


@pytest.mark.parametrize("kwargs,field", [
    ({"num_heads": 0, "d_head": 2, "d_ff": 4}, "num_heads"),
    ({"num_heads": 2, "d_head": -1, "d_ff": 4}, "d_head"),
    ({"num_heads": 2, "d_head": 2, "d_ff": 1.5}, "d_ff"),
    ({"num_heads": 2, "d_head": 2, "d_ff": 4, "d_v": 0}, "d_v"),
])
def test_bad_layer_sizes_raise(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LayerSizes(**kwargs)


def test_stack_config_and_params_mismatch_raise():
    with pytest.raises(ConfigError, match="num_layers"):
        LayerSizes.uniform(0, num_heads=2, d_head=3, d_ff=12)
    with pytest.raises(ConfigError, match="non-empty sequence of LayerSizes"):
        init_encoder(jax.random.PRNGKey(0), EncoderConfig(layer=t5_layer()), d_model=8,
                     layers=[])
    with pytest.raises(ConfigError, match="non-empty sequence of LayerSizes"):
        init_encoder(jax.random.PRNGKey(0), EncoderConfig(layer=t5_layer()), d_model=8,
                     layers=T5_SIZES)
    with pytest.raises(ConfigError, match="layer must be a DecoderLayerConfig"):
        DecoderConfig(layer=t5_layer())
    with pytest.raises(ConfigError, match="relative_bias must be a RelativeBiasConfig"):
        EncoderConfig(layer=t5_layer(), relative_bias=32)
    with pytest.raises(ConfigError, match="final_norm must be a bool"):
        EncoderConfig(layer=t5_layer(), final_norm=1)
    cfg = EncoderConfig(layer=t5_layer(), final_norm=False)
    p = encoder_params(cfg, 38, 2)
    with pytest.raises(ShapeError, match="non-empty list under 'layers'"):
        apply_encoder({"layers": []}, rand(39, (1, 3, 8)), cfg)
    # The stack runs as many layers as its parameters hold.
    x = rand(39, (1, 3, 8))
    one = {"layers": p["layers"][:1]}
    ref, _ = np_encoder(one, x, cfg)
    assert max_err(encoder(one, x, cfg), ref) <= TOL


def test_encoder_mask_of_wrong_rank_raises():
    cfg = EncoderConfig(layer=t5_layer(), final_norm=False)
    p = encoder_params(cfg, 40, 1)
    with pytest.raises(ShapeError, match="mask must be 4-D"):
        apply_encoder(p, rand(41, (2, 3, 8)), cfg, mask=jnp.ones((2, 3), bool))


# ---------------------------------------------------------------------------------------------
# Cached decoding (key-value cache).

decoder_step = jax.jit(apply_decoder_step, static_argnames=("cfg",))


def lowrank_of(leaf, r, seed):
    """A LowRank leaf of rank ``r`` with NumPy-drawn factors and the leaf's bias."""
    d_in, d_out = leaf.w.shape
    return LowRank(u=rand(seed, (d_in, r), d_in ** -0.5), v=rand(seed + 1, (r, d_out)), b=leaf.b)


@pytest.mark.parametrize("prenorm,norm", [(True, T5_NORM), (False, BERT_NORM)])
def test_cached_decoder_steps_match_numpy_reference(prenorm, norm):
    """Three tokens at once, then one at a time: every position equals the float64 NumPy decoder
    on the whole sequence (causal relative bias whose log buckets are reached, encoder padding,
    a LowRank leaf, and a layer with fewer heads than the other)."""
    rb = RelativeBiasConfig(num_buckets=8, max_distance=12)
    cfg = DecoderConfig(layer=t5_decoder_layer(prenorm, norm), relative_bias=rb)
    p = decoder_params(cfg, 120, 2)
    l0 = p["layers"][0]
    l0 = dict(l0, self_attn=dict(l0["self_attn"], v=lowrank_of(l0["self_attn"]["v"], 2, 121)),
              mlp=dict(l0["mlp"], wi=lowrank_of(l0["mlp"]["wi"], 3, 123)))
    p = dict(p, layers=[l0, dict(p["layers"][1], self_attn=keep_heads(
        p["layers"][1]["self_attn"], [1]), cross_attn=keep_heads(p["layers"][1]["cross_attn"],
                                                                  [0]))])
    assert p["layers"][1]["self_attn"]["heads"].ids == (1,)
    steps = 11
    x, enc = rand(124, (2, steps, 8)), rand(125, (2, 5, 6))
    valid = np.array([[1] * 5, [1] * 3 + [0] * 2], bool)
    ref, _ = np_decoder(densify(p), x, enc, cfg, cross_mask=padding_mask(valid))

    cache = init_decoder_cache(p, cfg, enc=enc, max_len=steps)
    cross = padding_mask(valid)
    outs = []
    y, cache = decoder_step(p, x[:, :3], cfg, cache, cross_mask=cross)
    outs.append(y)
    for t in range(3, steps):
        y, cache = decoder_step(p, x[:, t:t + 1], cfg, cache, cross_mask=cross)
        outs.append(y)
    assert int(cache["index"]) == steps
    got = jnp.concatenate(outs, axis=1)
    assert max_err(got, ref) <= TOL
    # The cache holds the per-head keys and values of every position, heads before positions:
    # [batch, heads, max_len, width].
    assert cache["layers"][1]["self"]["k"].shape == (2, 1, steps, 3)
    assert cache["layers"][0]["cross"]["v"].shape == (2, 2, 5, 3)


def factorized_block(kind, seed):
    """An attention block (d_model 8, 3 heads of value width 2) with a CP or BTD query-key."""
    from lowrank_jax.leaves import BTDQueryKey, CPQueryKey

    q, k = (Dense(rand(seed + i, (8, 5), 8 ** -0.5), rand(seed + 2 + i, (5,), 0.2))
            for i in range(2))
    if kind == "cp":
        qk = CPQueryKey(q=q, k=k, mix=rand(seed + 4, (3, 5)))
    else:
        qk = BTDQueryKey(q=q, k=k, mix=rand(seed + 4, (3, 2)), ranks=(3, 2))
    return {"qk": qk, "v": Dense(rand(seed + 5, (8, 6), 8 ** -0.5)),
            "o": Dense(rand(seed + 6, (6, 8), 6 ** -0.5)),
            "heads": HeadLayout.uniform(3, 2, 0.5)}


@pytest.mark.parametrize("kind", ["cp", "btd"])
def test_cached_attention_with_factorized_query_key(kind):
    """CP and BTD query-key tensors cache their own key coordinates (R numbers per key for CP)
    and decode step by step as the whole-sequence attention with a causal mask computes."""
    block = factorized_block(kind, 130)
    cfg = AttentionConfig()
    x = rand(137, (2, 6, 8))
    full = apply_attention(block, x, cfg, mask=causal_mask(6))
    cache = init_attention_cache(block, 2, 6)
    assert cache["k"].shape == ((2, 6, 5) if kind == "cp" else (2, 6, 2, 3))
    outs = []
    for t in range(6):
        y, cache = apply_attention_cached(block, x[:, t:t + 1], cfg, cache, index=t)
        outs.append(y)
    assert max_err(jnp.concatenate(outs, axis=1), full) <= TOL



@pytest.mark.parametrize("heads_first", [True, False])
def test_cached_attention_reads_heads_first_caches_with_irregular_widths(heads_first):
    """Self- and cross-attention against a cache stored heads first (keys [b, h, len, w], values
    [b, h, len, w_v], zero-padded per head: query-key widths 3, 1, 2, value widths 2, 3, 1)
    equal the NumPy attention, with the weighted sum heads first or not."""
    from lowrank_jax import execution
    from lowrank_jax.nn import attention_cache

    widths, v_widths = (3, 1, 2), (2, 3, 1)
    block = {"qk": QueryKey(q=Dense(rand(160, (8, 6), 8 ** -0.5), rand(161, (6,), 0.2)),
                            k=Dense(rand(162, (7, 6), 7 ** -0.5), rand(163, (6,), 0.2)),
                            widths=widths),
             "v": Dense(rand(164, (7, 6), 7 ** -0.5), rand(165, (6,), 0.2)),
             "o": Dense(rand(166, (6, 8), 6 ** -0.5)),
             "heads": HeadLayout(ids=(0, 1, 2), v=v_widths, scale=1 / math.sqrt(3))}
    self_block = dict(block, qk=QueryKey(q=block["qk"].q, k=Dense(rand(167, (8, 6), 8 ** -0.5)),
                                         widths=widths),
                      v=Dense(rand(168, (8, 6), 8 ** -0.5)))
    cfg = AttentionConfig()
    x, enc = rand(169, (2, 5, 8)), rand(170, (2, 4, 7))
    valid = np.array([[1] * 4, [1] * 2 + [0] * 2], bool)
    with execution.settings(heads_first=heads_first):
        cache = init_attention_cache(self_block, 2, 5)
        assert cache["k"].shape == (2, 3, 5, 3) and cache["v"].shape == (2, 3, 5, 3)
        outs = []
        for lo, hi in ((0, 2), (2, 3), (3, 5)):
            y, cache = apply_attention_cached(self_block, x[:, lo:hi], cfg, cache, index=lo)
            outs.append(y)
        cross = attention_cache(block, enc)
        assert cross["k"].shape == (2, 3, 4, 3) and cross["v"].shape == (2, 3, 4, 3)
        got_cross, _ = apply_attention_cached(block, x, cfg, cross, mask=padding_mask(valid))
    want = np_attention(self_block, np.asarray(x, np.float64), cfg, mask=np.asarray(causal_mask(5)))
    assert max_err(jnp.concatenate(outs, axis=1), want) <= TOL
    want = np_attention(block, np.asarray(x, np.float64), cfg, kv=np.asarray(enc, np.float64),
                        mask=np.asarray(padding_mask(valid)))
    assert max_err(got_cross, want) <= TOL

def test_cached_decoding_errors():
    rb = RelativeBiasConfig(num_buckets=8, max_distance=12)
    cfg = DecoderConfig(layer=t5_decoder_layer(), relative_bias=rb)
    p = decoder_params(cfg, 140, 2)
    enc = rand(141, (1, 3, 6))
    cache = init_decoder_cache(p, cfg, enc=enc, max_len=4)
    x = rand(142, (1, 5, 8))
    with pytest.raises(ShapeError, match="exceed the cache's 4 positions"):
        apply_decoder_step(p, x, cfg, dict(cache, index=0))
    with pytest.raises(ShapeError, match="2 more tokens at position 3"):  # a concrete array
        apply_decoder_step(p, x[:, :2], cfg, dict(cache, index=jnp.asarray(3, jnp.int32)))
    with pytest.raises(ShapeError, match="2 layers"):
        apply_decoder_step(p, x[:, :1], cfg, dict(cache, layers=cache["layers"][:1]))
    block = p["layers"][0]["self_attn"]
    with pytest.raises(ShapeError, match="do not fit a cache of 4 positions"):
        apply_attention_cached(block, x[:, :2], AttentionConfig(), cache["layers"][0]["self"],
                               index=3)
    with pytest.raises(ConfigError, match="qkv_keep"):
        apply_attention_cached(block, x[:, :1], AttentionConfig(qkv_keep=0.5),
                               cache["layers"][0]["self"], index=0)
    from lowrank_jax.leaves import CompressedKeys

    ck = CompressedKeys.from_query_key(block["qk"], jnp.ones((2, 3, 3)), jnp.zeros(2))
    with pytest.raises(ConfigError, match="CompressedKeys does not support key-value caching"):
        init_attention_cache(dict(block, qk=ck), 1, 4)


def test_cache_writes_and_causal_mask_equal_numpy_and_reject_non_boolean_masks():
    from lowrank_jax.nn.attention.core import causal_key_mask, write_positions
    from lowrank_jax.nn.attention.grouped import (
        GroupedAttentionConfig,
        apply_grouped_attention_cached,
        init_grouped_attention,
        init_grouped_cache,
    )

    rng = np.random.default_rng(0)
    buf, new = rng.normal(size=(2, 3, 7, 4)), rng.normal(size=(2, 3, 2, 4))
    want = buf.copy()
    want[:, :, 4:6] = new
    got = write_positions(jnp.asarray(buf, jnp.float32), jnp.asarray(new), 4, 2)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want.astype(np.float32), rtol=0, atol=0)
    pad = rng.random((2, 1, 1, 7)) > 0.3
    i, k = np.arange(3)[:, None], np.arange(7)[None, :]
    np.testing.assert_array_equal(np.asarray(causal_key_mask(2, 3, 7, jnp.asarray(pad))),
                                  (k <= 2 + i)[None, None] & pad)
    np.testing.assert_array_equal(np.asarray(causal_key_mask(jnp.int32(2), 3, 7, None)),
                                  (k <= 2 + i)[None, None])
    # a 0/1 integer mask is refused by every cached path, not read as a boolean
    ints = jnp.ones((1, 1, 1, 4), jnp.int32)
    cfg = GroupedAttentionConfig(group=2)
    block = init_grouped_attention(jax.random.key(0), cfg, d_model=8, num_heads=4,
                                   num_kv_heads=2, d_head=2)
    x = jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.float32)
    with pytest.raises(ShapeError, match="boolean"):
        apply_grouped_attention_cached(block, x, cfg, init_grouped_cache(block, 1, 4), index=0,
                                       positions=jnp.zeros((1, 1), jnp.int32), mask=ints)
    plain = init_attention(jax.random.key(1), AttentionConfig(), d_model=8, num_heads=2,
                           d_head=4)
    with pytest.raises(ShapeError, match="boolean"):
        apply_attention_cached(plain, x, AttentionConfig(), init_attention_cache(plain, 1, 4),
                               index=0, mask=ints)


@pytest.mark.parametrize("per_sequence_mask", [False, True])
def test_cached_decoder_shares_the_encoder_cache_between_sample_paths(per_sequence_mask):
    """Three sequences per encoder row (HF's num_return_sequences order): the cross-attention
    cache is kept once per row, and every position equals the NumPy decoder on the repeated
    encoder output, with the padding given per row or (different) per sequence."""
    rb = RelativeBiasConfig(num_buckets=8, max_distance=12)
    cfg = DecoderConfig(layer=t5_decoder_layer(), relative_bias=rb)
    p = decoder_params(cfg, 150, 2)
    enc = rand(151, (2, 5, 6))
    valid = np.array([[1] * 5, [1] * 3 + [0] * 2], bool)
    if per_sequence_mask:
        valid = np.repeat(valid, 3, axis=0)
        valid[1, 4] = valid[5, 1] = False
    x = rand(152, (6, 4, 8))
    per_seq = valid if per_sequence_mask else np.repeat(valid, 3, axis=0)
    ref, _ = np_decoder(p, x, np.repeat(np.asarray(enc), 3, axis=0), cfg,
                        cross_mask=np.asarray(padding_mask(per_seq)))
    cache = init_decoder_cache(p, cfg, enc=enc, max_len=4, batch=6)
    assert cache["layers"][0]["cross"]["k"].shape[0] == 2
    assert cache["layers"][0]["self"]["k"].shape[0] == 6
    outs = []
    for t in range(4):
        y, cache = decoder_step(p, x[:, t:t + 1], cfg, cache, cross_mask=padding_mask(valid))
        outs.append(y)
    assert max_err(jnp.concatenate(outs, axis=1), ref) <= TOL
    with pytest.raises(ShapeError, match="multiple of enc's 2 rows"):
        init_decoder_cache(p, cfg, enc=enc, max_len=4, batch=5)
