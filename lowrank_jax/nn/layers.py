"""Encoder/decoder layers and stacks (pre-norm as T5/ViT, post-norm as BERT).

Configs say what a layer means (norm kind, pre- or post-norm, activation, attention scaling);
every size is read from the parameters. Initialization takes the sizes: one
:class:`LayerSizes` per layer, so each layer may have its own head count, head width and MLP
width (what structured pruning produces, and what a model can be built with).

Stacks keep per-layer parameters in a Python list and loop in Python (no ``scan``): layers may
hold leaves of different ranks and widths (flow-of-ranks, "Understanding Transformers for Time
Series", sec. 5; pruning), which stacked parameters cannot.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from lowrank_jax.errors import ConfigError, ShapeError
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
        raise ConfigError(f"{owner}: {name} must be a {cls.__name__}, got {type(val).__name__}",
                          where=name, expected=cls.__name__, actual=type(val).__name__)


@dataclasses.dataclass(frozen=True)
class LayerSizes:
    """Sizes of one encoder or decoder layer, for initialization.

    Attributes:
      num_heads: attention heads (self- and, in a decoder, cross-attention).
      d_head: query/key width per head.
      d_ff: MLP hidden width.
      d_v: value width per head (default ``d_head``).
    """

    num_heads: int
    d_head: int
    d_ff: int
    d_v: int | None = None

    def __post_init__(self):
        for name in ("num_heads", "d_head", "d_ff", "d_v"):
            val = getattr(self, name)
            if val is None and name == "d_v":
                continue
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ConfigError(f"LayerSizes: {name} must be a positive int, got {val!r}",
                                  where=name, expected="int >= 1", actual=val)

    @classmethod
    def uniform(cls, num_layers: int, *, num_heads: int, d_head: int, d_ff: int,
                d_v: int | None = None) -> tuple["LayerSizes", ...]:
        """``num_layers`` identical layers."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError(f"LayerSizes.uniform: num_layers must be a positive int, got "
                              f"{num_layers!r}", where="num_layers")
        return (cls(num_heads, d_head, d_ff, d_v),) * num_layers


def _check_sizes(owner: str, layers) -> tuple[LayerSizes, ...]:
    if isinstance(layers, LayerSizes) or not isinstance(layers, (list, tuple)) or not layers:
        raise ConfigError(f"{owner}: layers must be a non-empty sequence of LayerSizes (one per "
                          f"layer; LayerSizes.uniform(n, ...) for identical ones), got "
                          f"{layers!r}", where="layers")
    for i, s in enumerate(layers):
        _check_type(owner, f"layers[{i}]", s, LayerSizes)
    return tuple(layers)


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
      attention: self-attention configuration.
      mlp: MLP configuration.
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


def init_encoder_layer(key: Array, cfg: EncoderLayerConfig, *, d_model: int,
                       sizes: LayerSizes) -> dict:
    """Parameters ``{'attn', 'attn_norm', 'mlp', 'mlp_norm'}`` of an encoder layer.

    Args:
      key: PRNG key.
      cfg: layer configuration.
      d_model: residual width.
      sizes: head count, head widths and MLP width of this layer.

    Returns:
      The parameter dict (weights are Dense leaves).
    """
    _check_type("init_encoder_layer", "sizes", sizes, LayerSizes)
    ka, km = jax.random.split(key)
    return {
        "attn": init_attention(ka, cfg.attention, d_model=d_model, num_heads=sizes.num_heads,
                               d_head=sizes.d_head, d_v=sizes.d_v),
        "attn_norm": init_norm(d_model, cfg.norm),
        "mlp": init_mlp(km, cfg.mlp, d_model=d_model, d_ff=sizes.d_ff),
        "mlp_norm": init_norm(d_model, cfg.norm),
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
      bias: additive attention bias over the model's original heads (e.g. a relative bias
        ``[1, heads, seq, seq]``).
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
      self_attention: self-attention configuration.
      cross_attention: cross-attention configuration.
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


def init_decoder_layer(key: Array, cfg: DecoderLayerConfig, *, d_model: int, sizes: LayerSizes,
                       d_enc: int | None = None) -> dict:
    """Parameters ``{'self_attn', 'self_attn_norm', 'cross_attn', 'cross_attn_norm', 'mlp',
    'mlp_norm'}`` of a decoder layer.

    Args:
      key: PRNG key.
      cfg: layer configuration.
      d_model: residual width.
      sizes: head count (of both attentions), head widths and MLP width of this layer.
      d_enc: width of the encoder output that the cross-attention reads (default ``d_model``).

    Returns:
      The parameter dict (weights are Dense leaves).
    """
    _check_type("init_decoder_layer", "sizes", sizes, LayerSizes)
    ks, kc, km = jax.random.split(key, 3)
    d = d_model
    heads = dict(num_heads=sizes.num_heads, d_head=sizes.d_head, d_v=sizes.d_v)
    return {
        "self_attn": init_attention(ks, cfg.self_attention, d_model=d, **heads),
        "self_attn_norm": init_norm(d, cfg.norm),
        "cross_attn": init_attention(kc, cfg.cross_attention, d_model=d, d_kv_in=d_enc, **heads),
        "cross_attn_norm": init_norm(d, cfg.norm),
        "mlp": init_mlp(km, cfg.mlp, d_model=d, d_ff=sizes.d_ff),
        "mlp_norm": init_norm(d, cfg.norm),
    }


def apply_decoder_layer(params: dict, x: Array, cfg: DecoderLayerConfig, *, enc: Array,
                        self_mask: Array | None = None, cross_mask: Array | None = None,
                        self_bias: Array | None = None, cross_bias: Array | None = None,
                        layer_index: int = 0) -> Array:
    """Decoder layer: causal self-attention, cross-attention on ``enc``, MLP.

    The causal mask is always applied to the self-attention (ANDed with ``self_mask``).

    Args:
      params: from :func:`init_decoder_layer`.
      x: decoder states ``[batch, t, d_model]``.
      cfg: layer configuration.
      enc: encoder output ``[batch, s, d_enc]``.
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

    return decoder_layer_body(params, x, cfg, self_attn, cross_attn)  # [batch, t, d_model]


def decoder_layer_body(params: dict, x: Array, cfg: DecoderLayerConfig, self_attn,
                       cross_attn) -> Array:
    """A decoder layer's residual wiring around given attention functions (``h -> out``):
    self-attention, cross-attention, MLP, each with its norm (pre- or post-norm). Shared by
    :func:`apply_decoder_layer` and cached decoding (:mod:`lowrank_jax.nn.decoding`)."""
    x = _residual(cfg.prenorm, params["self_attn_norm"], cfg.norm, x, self_attn)
    x = _residual(cfg.prenorm, params["cross_attn_norm"], cfg.norm, x, cross_attn)
    return _residual(cfg.prenorm, params["mlp_norm"], cfg.norm, x,
                     lambda h: apply_mlp(params["mlp"], h, cfg.mlp))


# ---------------------------------------------------------------------------------------------
# Stacks.

def _check_stack(owner: str, cfg, layer_cls) -> None:
    _check_type(owner, "layer", cfg.layer, layer_cls)
    if not isinstance(cfg.final_norm, bool):
        raise ConfigError(f"{owner}: final_norm must be a bool, got {cfg.final_norm!r}",
                          where="final_norm")
    if cfg.relative_bias is not None:
        _check_type(owner, "relative_bias", cfg.relative_bias, RelativeBiasConfig)


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """A stack of encoder layers (as many as its parameters hold).

    Attributes:
      layer: configuration of every layer.
      final_norm: apply a final norm (``layer.norm``) after the last layer (pre-norm models).
      relative_bias: if set, the stack owns one T5 relative-bias table (``'rel_bias'``,
        ``[num_buckets, heads]`` over the model's original heads), computed once and added in
        every layer (T5 shares layer 0's bias down the stack); each layer takes the columns of
        the heads it keeps.
    """

    layer: EncoderLayerConfig
    final_norm: bool = True
    relative_bias: RelativeBiasConfig | None = None

    def __post_init__(self):
        _check_stack("EncoderConfig", self, EncoderLayerConfig)


def _init_stack(key: Array, cfg, layers: tuple[LayerSizes, ...], d_model: int,
                init_layer) -> dict:
    """Layers in a list, then the optional final norm and shared relative-bias table."""
    keys = jax.random.split(key, len(layers) + 1)
    params = {"layers": [init_layer(k, s) for k, s in zip(keys[:-1], layers, strict=True)]}
    if cfg.final_norm:
        params["final_norm"] = init_norm(d_model, cfg.layer.norm)
    if cfg.relative_bias is not None:
        heads = max(s.num_heads for s in layers)
        params["rel_bias"] = init_relative_bias(keys[-1], cfg.relative_bias, heads)
    return params


def init_encoder(key: Array, cfg: EncoderConfig, *, d_model: int,
                 layers: Sequence[LayerSizes]) -> dict:
    """Parameters of an encoder stack.

    Args:
      key: PRNG key.
      cfg: stack configuration.
      d_model: residual width.
      layers: one :class:`LayerSizes` per layer.

    Returns:
      ``{'layers': [layer params, ...]}`` plus ``'final_norm'`` and ``'rel_bias'``
      (``[num_buckets, max heads]``) when configured.
    """
    layers = _check_sizes("init_encoder", layers)
    return _init_stack(key, cfg, layers, d_model,
                       lambda k, s: init_encoder_layer(k, cfg.layer, d_model=d_model, sizes=s))


def _layers(owner: str, params: dict) -> list:
    layers = params.get("layers") if isinstance(params, dict) else None
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ShapeError(f"{owner}: params must hold a non-empty list under 'layers', got "
                         f"{type(layers).__name__}", where="layers")
    return layers


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
        "Understanding Transformers for Time Series", sec. 4).

    Returns:
      ``y [batch, seq, d_model]``, or ``(y, [x_0, ..., x_{L-1}])`` where ``x_l`` is the input
      of layer ``l``.
    """
    layers = _layers("apply_encoder", params)
    seq = x.shape[1]
    bias = None
    if cfg.relative_bias is not None:
        bias = relative_bias(params["rel_bias"], seq, seq, cfg.relative_bias)  # [1, H, s, s]
    hidden = []
    for i, lp in enumerate(layers):
        hidden.append(x)
        x = apply_encoder_layer(lp, x, cfg.layer, mask=mask, bias=bias, layer_index=i)
    if cfg.final_norm:
        x = apply_norm(params["final_norm"], x, cfg.layer.norm)
    return (x, hidden) if return_hidden else x


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A stack of decoder layers (as many as its parameters hold).

    Attributes:
      layer: configuration of every layer.
      final_norm: apply a final norm after the last layer.
      relative_bias: if set, one self-attention relative-bias table (``'rel_bias'``) shared by
        every layer. Decoders always use causal buckets (``bidirectional=False``), as Hugging
        Face T5 does for ``is_decoder``, whatever ``relative_bias.bidirectional`` says.
        Cross-attention gets no relative bias (as T5).
    """

    layer: DecoderLayerConfig
    final_norm: bool = True
    relative_bias: RelativeBiasConfig | None = None

    def __post_init__(self):
        _check_stack("DecoderConfig", self, DecoderLayerConfig)


def init_decoder(key: Array, cfg: DecoderConfig, *, d_model: int, layers: Sequence[LayerSizes],
                 d_enc: int | None = None) -> dict:
    """Parameters of a decoder stack.

    Args:
      key: PRNG key.
      cfg: stack configuration.
      d_model: residual width.
      layers: one :class:`LayerSizes` per layer.
      d_enc: width of the encoder output (default ``d_model``).

    Returns:
      ``{'layers': [layer params, ...]}`` plus ``'final_norm'`` and ``'rel_bias'``
      (``[num_buckets, max heads]``) when configured.
    """
    layers = _check_sizes("init_decoder", layers)
    return _init_stack(key, cfg, layers, d_model,
                       lambda k, s: init_decoder_layer(k, cfg.layer, d_model=d_model, sizes=s,
                                                       d_enc=d_enc))


def decoder_self_bias(params: dict, cfg: DecoderConfig, q_len: int, k_len: int, *,
                      q_offset=0) -> Array | None:
    """The stack's self-attention relative bias ``[1, H, q_len, k_len]`` (``None`` without a
    table), always with causal buckets (HF ``is_decoder``); queries start at ``q_offset``."""
    if cfg.relative_bias is None:
        return None
    causal_cfg = dataclasses.replace(cfg.relative_bias, bidirectional=False)
    return relative_bias(params["rel_bias"], q_len, k_len, causal_cfg, q_offset=q_offset)


def apply_decoder(params: dict, x: Array, cfg: DecoderConfig, *, enc: Array,
                  self_mask: Array | None = None, cross_mask: Array | None = None,
                  return_hidden: bool = False):
    """Run the decoder stack (causal self-attention always on).

    Args:
      params: from :func:`init_decoder`.
      x: decoder inputs ``[batch, t, d_model]`` (already embedded).
      cfg: stack configuration.
      enc: encoder output ``[batch, s, d_enc]``.
      self_mask: extra boolean self-attention mask (the causal mask is always added).
      cross_mask: boolean cross-attention mask broadcastable to ``[batch, heads, t, s]``.
      return_hidden: also return the states entering each layer.

    Returns:
      ``y [batch, t, d_model]``, or ``(y, [x_0, ..., x_{L-1}])``.
    """
    layers = _layers("apply_decoder", params)
    t = x.shape[1]
    bias = decoder_self_bias(params, cfg, t, t)  # [1, H, t, t] or None
    hidden = []
    for i, lp in enumerate(layers):
        hidden.append(x)
        x = apply_decoder_layer(lp, x, cfg.layer, enc=enc, self_mask=self_mask,
                                cross_mask=cross_mask, self_bias=bias, layer_index=i)
    if cfg.final_norm:
        x = apply_norm(params["final_norm"], x, cfg.layer.norm)
    return (x, hidden) if return_hidden else x


__all__ = [
    "DecoderConfig", "DecoderLayerConfig", "EncoderConfig", "EncoderLayerConfig", "LayerSizes",
    "apply_decoder", "apply_decoder_layer", "apply_encoder", "apply_encoder_layer",
    "decoder_layer_body", "decoder_self_bias", "init_decoder", "init_decoder_layer",
    "init_encoder", "init_encoder_layer",
]
