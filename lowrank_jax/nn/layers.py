"""Encoder/decoder layers and stacks (pre-norm as T5/ViT, post-norm as BERT).

Stacks keep per-layer parameters in a Python list and loop in Python (no ``scan``): layers may
hold leaves of different ranks (flow-of-ranks, seed 000 sec. 5), which stacked parameters
cannot.
"""

from __future__ import annotations

import dataclasses

import jax

from lowrank_jax.nn.attention import (
    AttentionConfig,
    RelativeBiasConfig,
    apply_attention,
    init_attention,
    init_relative_bias,
    relative_bias,
)
from lowrank_jax.nn.masks import causal_mask, combine_masks
from lowrank_jax.nn.mlp import MLPConfig, apply_mlp, init_mlp
from lowrank_jax.nn.norms import NormConfig, apply_norm, init_norm

Array = jax.Array


def _check_type(owner: str, name: str, val, cls) -> None:
    if not isinstance(val, cls):
        raise ValueError(f"{owner}: {name} must be a {cls.__name__}, got {type(val).__name__}")


def _check_self_attention(owner: str, name: str, cfg: AttentionConfig, d_model: int) -> None:
    if cfg.d_model != d_model:
        raise ValueError(
            f"{owner}: {name}.d_model must equal the layer width {d_model}, got {cfg.d_model}"
        )
    if cfg.kv_dim != d_model:
        raise ValueError(
            f"{owner}: {name} is a self-attention, so its d_kv_in must be None or "
            f"{d_model}, got {cfg.d_kv_in}"
        )


def _residual(prenorm: bool, norm_params, norm_cfg, x, fn):
    """Pre-norm ``x + fn(norm(x))`` or post-norm ``norm(x + fn(x))``."""
    if prenorm:
        return x + fn(apply_norm(norm_params, x, norm_cfg))
    return apply_norm(norm_params, x + fn(x), norm_cfg)


# ---------------------------------------------------------------------------------------------
# Layers.

@dataclasses.dataclass(frozen=True)
class EncoderLayerConfig:
    """Self-attention + MLP with residuals.

    Attributes:
      attention: self-attention configuration (``d_kv_in`` must be ``None`` or ``d_model``).
      mlp: MLP configuration (same ``d_model``).
      norm: configuration of both norms.
      prenorm: ``x + f(norm(x))`` (T5, ViT) if ``True``, else ``norm(x + f(x))`` (BERT).
    """

    attention: AttentionConfig
    mlp: MLPConfig
    norm: NormConfig
    prenorm: bool = True

    def __post_init__(self):
        owner = "EncoderLayerConfig"
        _check_type(owner, "attention", self.attention, AttentionConfig)
        _check_type(owner, "mlp", self.mlp, MLPConfig)
        _check_type(owner, "norm", self.norm, NormConfig)
        _check_self_attention(owner, "attention", self.attention, self.d_model)
        if self.mlp.d_model != self.d_model:
            raise ValueError(
                f"{owner}: mlp.d_model must equal attention.d_model={self.d_model}, "
                f"got {self.mlp.d_model}"
            )

    @property
    def d_model(self) -> int:
        return self.attention.d_model


def init_encoder_layer(key: Array, cfg: EncoderLayerConfig) -> dict:
    """Parameters ``{'attn', 'attn_norm', 'mlp', 'mlp_norm'}`` of an encoder layer.

    Args:
      key: PRNG key.
      cfg: layer configuration.

    Returns:
      The parameter dict (weights are Dense leaves).
    """
    ka, km = jax.random.split(key)
    return {
        "attn": init_attention(ka, cfg.attention),
        "attn_norm": init_norm(cfg.d_model, cfg.norm),
        "mlp": init_mlp(km, cfg.mlp),
        "mlp_norm": init_norm(cfg.d_model, cfg.norm),
    }


def apply_encoder_layer(params: dict, x: Array, cfg: EncoderLayerConfig, *,
                        mask: Array | None = None, bias: Array | None = None,
                        layer_index: int = 0) -> Array:
    """Encoder layer: self-attention then MLP, each with a residual and a norm.

    Args:
      params: from :func:`init_encoder_layer`.
      x: ``[batch, seq, d_model]``.
      cfg: layer configuration.
      mask: boolean attention mask broadcastable to ``[batch, heads, seq, seq]``.
      bias: additive attention bias (e.g. a relative bias ``[1, heads, seq, seq]``).
      layer_index: static layer number (seeds the fixed Q/K/V activation masks).

    Returns:
      ``[batch, seq, d_model]``.
    """
    def attn(h):
        return apply_attention(params["attn"], h, cfg.attention, mask=mask, bias=bias,
                               layer_index=layer_index)

    x = _residual(cfg.prenorm, params["attn_norm"], cfg.norm, x, attn)  # [batch, seq, d_model]
    return _residual(cfg.prenorm, params["mlp_norm"], cfg.norm, x,
                     lambda h: apply_mlp(params["mlp"], h, cfg.mlp))


@dataclasses.dataclass(frozen=True)
class DecoderLayerConfig:
    """Causal self-attention + cross-attention on the encoder output + MLP.

    Attributes:
      self_attention: self-attention configuration (``d_kv_in`` ``None`` or ``d_model``).
      cross_attention: cross-attention configuration; its ``d_kv_in`` is the encoder width.
      mlp: MLP configuration.
      norm: configuration of the three norms.
      prenorm: pre-norm (T5) if ``True``, else post-norm (original Transformer / BART).
    """

    self_attention: AttentionConfig
    cross_attention: AttentionConfig
    mlp: MLPConfig
    norm: NormConfig
    prenorm: bool = True

    def __post_init__(self):
        owner = "DecoderLayerConfig"
        _check_type(owner, "self_attention", self.self_attention, AttentionConfig)
        _check_type(owner, "cross_attention", self.cross_attention, AttentionConfig)
        _check_type(owner, "mlp", self.mlp, MLPConfig)
        _check_type(owner, "norm", self.norm, NormConfig)
        _check_self_attention(owner, "self_attention", self.self_attention, self.d_model)
        for name in ("cross_attention", "mlp"):
            d = getattr(self, name).d_model
            if d != self.d_model:
                raise ValueError(
                    f"{owner}: {name}.d_model must equal self_attention.d_model="
                    f"{self.d_model}, got {d}"
                )

    @property
    def d_model(self) -> int:
        return self.self_attention.d_model


def init_decoder_layer(key: Array, cfg: DecoderLayerConfig) -> dict:
    """Parameters ``{'self_attn', 'self_attn_norm', 'cross_attn', 'cross_attn_norm', 'mlp',
    'mlp_norm'}`` of a decoder layer.

    Args:
      key: PRNG key.
      cfg: layer configuration.

    Returns:
      The parameter dict (weights are Dense leaves).
    """
    ks, kc, km = jax.random.split(key, 3)
    d = cfg.d_model
    return {
        "self_attn": init_attention(ks, cfg.self_attention),
        "self_attn_norm": init_norm(d, cfg.norm),
        "cross_attn": init_attention(kc, cfg.cross_attention),
        "cross_attn_norm": init_norm(d, cfg.norm),
        "mlp": init_mlp(km, cfg.mlp),
        "mlp_norm": init_norm(d, cfg.norm),
    }


def apply_decoder_layer(params: dict, x: Array, enc: Array, cfg: DecoderLayerConfig, *,
                        self_mask: Array | None = None, cross_mask: Array | None = None,
                        self_bias: Array | None = None, cross_bias: Array | None = None,
                        layer_index: int = 0) -> Array:
    """Decoder layer: causal self-attention, cross-attention on ``enc``, MLP.

    The causal mask is always applied to the self-attention (ANDed with ``self_mask``).

    Args:
      params: from :func:`init_decoder_layer`.
      x: decoder states ``[batch, t, d_model]``.
      enc: encoder output ``[batch, s, d_enc]`` (``d_enc`` = ``cross_attention.d_kv_in`` or
        ``d_model``).
      cfg: layer configuration.
      self_mask: extra boolean mask for the self-attention, broadcastable to
        ``[batch, heads, t, t]`` (e.g. decoder padding).
      cross_mask: boolean mask broadcastable to ``[batch, heads, t, s]`` (encoder padding).
      self_bias: additive self-attention bias (e.g. causal relative bias).
      cross_bias: additive cross-attention bias (T5 uses none).
      layer_index: static layer number (seeds the fixed Q/K/V activation masks).

    Returns:
      ``[batch, t, d_model]``.
    """
    t = x.shape[1]
    smask = combine_masks(causal_mask(t), self_mask)  # [.., t, t]

    def self_attn(h):
        return apply_attention(params["self_attn"], h, cfg.self_attention, mask=smask,
                               bias=self_bias, layer_index=layer_index)

    def cross_attn(h):
        return apply_attention(params["cross_attn"], h, cfg.cross_attention, kv=enc,
                               mask=cross_mask, bias=cross_bias, layer_index=layer_index)

    x = _residual(cfg.prenorm, params["self_attn_norm"], cfg.norm, x, self_attn)
    x = _residual(cfg.prenorm, params["cross_attn_norm"], cfg.norm, x, cross_attn)
    return _residual(cfg.prenorm, params["mlp_norm"], cfg.norm, x,
                     lambda h: apply_mlp(params["mlp"], h, cfg.mlp))  # [batch, t, d_model]


# ---------------------------------------------------------------------------------------------
# Stacks.

def _check_stack(owner: str, cfg, layer_cls) -> None:
    _check_type(owner, "layer", cfg.layer, layer_cls)
    if not isinstance(cfg.num_layers, int) or cfg.num_layers < 1:
        raise ValueError(f"{owner}: num_layers must be a positive int, got {cfg.num_layers!r}")
    if cfg.relative_bias is not None:
        _check_type(owner, "relative_bias", cfg.relative_bias, RelativeBiasConfig)


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """A stack of identical-shape encoder layers.

    Attributes:
      layer: configuration of every layer.
      num_layers: number of layers.
      final_norm: apply a final norm (``layer.norm``) after the last layer (pre-norm models).
      relative_bias: if set, the stack owns one T5 relative-bias table (``'rel_bias'``),
        computed once and added in every layer (T5 shares layer 0's bias down the stack).
    """

    layer: EncoderLayerConfig
    num_layers: int
    final_norm: bool = True
    relative_bias: RelativeBiasConfig | None = None

    def __post_init__(self):
        _check_stack("EncoderConfig", self, EncoderLayerConfig)


def _init_stack(key: Array, cfg, init_layer, num_heads: int) -> dict:
    """Layers in a list, then the optional final norm and shared relative-bias table."""
    keys = jax.random.split(key, cfg.num_layers + 1)
    params = {"layers": [init_layer(k, cfg.layer) for k in keys[:-1]]}
    if cfg.final_norm:
        params["final_norm"] = init_norm(cfg.layer.d_model, cfg.layer.norm)
    if cfg.relative_bias is not None:
        params["rel_bias"] = init_relative_bias(keys[-1], cfg.relative_bias, num_heads)
    return params


def init_encoder(key: Array, cfg: EncoderConfig) -> dict:
    """Parameters of an encoder stack.

    Args:
      key: PRNG key.
      cfg: stack configuration.

    Returns:
      ``{'layers': [layer params, ...]}`` plus ``'final_norm'`` and ``'rel_bias'``
      (``[num_buckets, heads]``) when configured.
    """
    return _init_stack(key, cfg, init_encoder_layer, cfg.layer.attention.num_heads)


def apply_encoder(params: dict, x: Array, cfg: EncoderConfig, *, mask: Array | None = None,
                  return_hidden: bool = False):
    """Run the encoder stack.

    Args:
      params: from :func:`init_encoder`.
      x: ``[batch, seq, d_model]`` (already embedded).
      cfg: stack configuration.
      mask: boolean attention mask broadcastable to ``[batch, heads, seq, seq]`` (e.g.
        :func:`~lowrank_jax.nn.padding_mask`).
      return_hidden: also return the states entering each layer (flow-of-ranks analysis,
        seed 000 sec. 5).

    Returns:
      ``y [batch, seq, d_model]``, or ``(y, [x_0, ..., x_{L-1}])`` where ``x_l`` is the input
      of layer ``l``.
    """
    _check_num_layers("apply_encoder", params, cfg)
    seq = x.shape[1]
    bias = None
    if cfg.relative_bias is not None:
        bias = relative_bias(params["rel_bias"], seq, seq, cfg.relative_bias)  # [1, h, s, s]
    hidden = []
    for i, lp in enumerate(params["layers"]):
        hidden.append(x)
        x = apply_encoder_layer(lp, x, cfg.layer, mask=mask, bias=bias, layer_index=i)
    if cfg.final_norm:
        x = apply_norm(params["final_norm"], x, cfg.layer.norm)
    return (x, hidden) if return_hidden else x


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A stack of decoder layers.

    Attributes:
      layer: configuration of every layer.
      num_layers: number of layers.
      final_norm: apply a final norm after the last layer.
      relative_bias: if set, one self-attention relative-bias table (``'rel_bias'``) shared by
        every layer. Decoders always use causal buckets (``bidirectional=False``), as Hugging
        Face T5 does for ``is_decoder``, whatever ``relative_bias.bidirectional`` says.
        Cross-attention gets no relative bias (as T5).
    """

    layer: DecoderLayerConfig
    num_layers: int
    final_norm: bool = True
    relative_bias: RelativeBiasConfig | None = None

    def __post_init__(self):
        _check_stack("DecoderConfig", self, DecoderLayerConfig)


def init_decoder(key: Array, cfg: DecoderConfig) -> dict:
    """Parameters of a decoder stack.

    Args:
      key: PRNG key.
      cfg: stack configuration.

    Returns:
      ``{'layers': [layer params, ...]}`` plus ``'final_norm'`` and ``'rel_bias'``
      (``[num_buckets, heads]``) when configured.
    """
    return _init_stack(key, cfg, init_decoder_layer, cfg.layer.self_attention.num_heads)


def apply_decoder(params: dict, x: Array, enc: Array, cfg: DecoderConfig, *,
                  self_mask: Array | None = None, cross_mask: Array | None = None,
                  return_hidden: bool = False):
    """Run the decoder stack (causal self-attention always on).

    Args:
      params: from :func:`init_decoder`.
      x: decoder inputs ``[batch, t, d_model]`` (already embedded).
      enc: encoder output ``[batch, s, d_enc]``.
      cfg: stack configuration.
      self_mask: extra boolean self-attention mask (the causal mask is always added).
      cross_mask: boolean cross-attention mask broadcastable to ``[batch, heads, t, s]``.
      return_hidden: also return the states entering each layer.

    Returns:
      ``y [batch, t, d_model]``, or ``(y, [x_0, ..., x_{L-1}])``.
    """
    _check_num_layers("apply_decoder", params, cfg)
    t = x.shape[1]
    bias = None
    if cfg.relative_bias is not None:
        causal_cfg = dataclasses.replace(cfg.relative_bias, bidirectional=False)
        bias = relative_bias(params["rel_bias"], t, t, causal_cfg)  # [1, h, t, t]
    hidden = []
    for i, lp in enumerate(params["layers"]):
        hidden.append(x)
        x = apply_decoder_layer(lp, x, enc, cfg.layer, self_mask=self_mask,
                                cross_mask=cross_mask, self_bias=bias, layer_index=i)
    if cfg.final_norm:
        x = apply_norm(params["final_norm"], x, cfg.layer.norm)
    return (x, hidden) if return_hidden else x


def _check_num_layers(owner: str, params: dict, cfg) -> None:
    n = len(params["layers"])
    if n != cfg.num_layers:
        raise ValueError(
            f"{owner}: params hold {n} layers under 'layers', but cfg.num_layers = "
            f"{cfg.num_layers}"
        )

