"""T5 encoder-decoder (Raffel et al. 2020), v1.0 (relu) and v1.1 (gated-gelu), from nn blocks.

Matches Hugging Face ``T5ForConditionalGeneration`` in inference: RMS layer norm, pre-norm
residuals, unscaled attention, one relative-position-bias table per stack (HF keeps it in layer
0 and shares it down the stack; here the stack owns it as ``'rel_bias'``), no relative bias in
cross-attention, ``d_kv * num_heads != d_model`` allowed. Every weight matrix is a leaf, so any
projection may be ``Dense``, ``LowRank``, ``HeadLowRank`` or ``MaskedBinary``.

Parameter tree::

    {'shared': [vocab, d_model],                 # token embedding (raw array)
     'encoder': init_encoder(...) tree,          # layers/i/{attn,attn_norm,mlp,mlp_norm}, ...
     'decoder': init_decoder(...) tree,          # layers/i/{self_attn,...,cross_attn,...}, ...
     'lm_head': Dense [d_model, vocab]}          # only when not tie_word_embeddings
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowrank_jax.leaves import init_dense, linear
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
    apply_encoder,
    init_decoder,
    init_encoder,
    padding_mask,
)

Array = jax.Array

# HF ``feed_forward_proj`` -> (nn activation, gated). HF maps "gated-gelu" to "gelu_new" (tanh
# approximation) for backward compatibility, while a plain "gelu" is the exact erf form.
_FEED_FORWARD = {
    "relu": ("relu", False),
    "gelu": ("gelu", False),
    "gelu_new": ("gelu_tanh", False),
    "silu": ("silu", False),
    "gated-relu": ("relu", True),
    "gated-gelu": ("gelu_tanh", True),
    "gated-gelu_new": ("gelu_tanh", True),
    "gated-silu": ("silu", True),
}


@dataclasses.dataclass(frozen=True)
class T5Config:
    """T5 hyper-parameters (names as in Hugging Face ``T5Config``).

    Attributes:
      tie_word_embeddings: the LM head is the transposed ``shared`` embedding (no
        ``'lm_head'`` in the tree). ``False``: a separate ``'lm_head'`` leaf (T5 v1.1).
      scale_decoder_outputs: multiply the decoder output by ``d_model ** -0.5`` before the LM
        head. ``None`` (default) means "equal to ``tie_word_embeddings``", the classic rule
        (T5 v1.0 scales, v1.1 does not). transformers >= 5 stores it explicitly.
      num_decoder_layers: ``None`` means ``num_layers``.
    """

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool | None = None
    layer_norm_epsilon: float = 1e-6
    decoder_start_token_id: int = 0
    pad_token_id: int = 0
    eos_token_id: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                     "relative_attention_num_buckets", "relative_attention_max_distance"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"T5Config: {name} must be a positive int, got {val!r}")
        if self.num_decoder_layers is not None and (
            not isinstance(self.num_decoder_layers, int) or self.num_decoder_layers < 1
        ):
            raise ValueError(
                f"T5Config: num_decoder_layers must be None or a positive int, "
                f"got {self.num_decoder_layers!r}"
            )
        if self.feed_forward_proj not in _FEED_FORWARD:
            raise ValueError(
                f"T5Config: feed_forward_proj must be one of {tuple(_FEED_FORWARD)}, "
                f"got {self.feed_forward_proj!r}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict) -> "T5Config":
        """Build from a Hugging Face ``config.json`` dict (unknown keys are ignored).

        ``scale_decoder_outputs`` is read when present (transformers >= 5 writes it and forces
        ``tie_word_embeddings=True``); otherwise it follows ``tie_word_embeddings``.
        """
        tie = bool(d.get("tie_word_embeddings", True))
        scale = d.get("scale_decoder_outputs", None)
        eos = d.get("eos_token_id", 1)
        if isinstance(eos, (list, tuple)):
            eos = eos[0]
        pad = d.get("pad_token_id", 0)
        pad = 0 if pad is None else int(pad)
        start = d.get("decoder_start_token_id", None)
        return cls(
            vocab_size=int(d["vocab_size"]),
            d_model=int(d["d_model"]),
            d_kv=int(d["d_kv"]),
            d_ff=int(d["d_ff"]),
            num_layers=int(d["num_layers"]),
            num_decoder_layers=(None if d.get("num_decoder_layers") is None
                                else int(d["num_decoder_layers"])),
            num_heads=int(d["num_heads"]),
            relative_attention_num_buckets=int(d.get("relative_attention_num_buckets", 32)),
            relative_attention_max_distance=int(d.get("relative_attention_max_distance", 128)),
            feed_forward_proj=str(d.get("feed_forward_proj", "relu")),
            tie_word_embeddings=tie,
            scale_decoder_outputs=None if scale is None else bool(scale),
            layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-6)),
            decoder_start_token_id=pad if start is None else int(start),
            pad_token_id=pad,
            eos_token_id=1 if eos is None else int(eos),
        )

    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` fields this config determines."""
        return {
            "model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
            "vocab_size": self.vocab_size, "d_model": self.d_model, "d_kv": self.d_kv,
            "d_ff": self.d_ff, "num_layers": self.num_layers,
            "num_decoder_layers": self.decoder_layers, "num_heads": self.num_heads,
            "relative_attention_num_buckets": self.relative_attention_num_buckets,
            "relative_attention_max_distance": self.relative_attention_max_distance,
            "feed_forward_proj": self.feed_forward_proj,
            "tie_word_embeddings": self.tie_word_embeddings,
            "scale_decoder_outputs": self.scales_decoder_outputs,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "decoder_start_token_id": self.decoder_start_token_id,
            "pad_token_id": self.pad_token_id, "eos_token_id": self.eos_token_id,
            "is_encoder_decoder": True,
        }

    # -- derived ---------------------------------------------------------------------------

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    @property
    def scales_decoder_outputs(self) -> bool:
        if self.scale_decoder_outputs is None:
            return self.tie_word_embeddings
        return self.scale_decoder_outputs

    @property
    def is_gated(self) -> bool:
        return _FEED_FORWARD[self.feed_forward_proj][1]

    def _attention(self) -> AttentionConfig:
        return AttentionConfig(d_model=self.d_model, num_heads=self.num_heads, d_head=self.d_kv,
                               use_bias=False, scaled=False)

    def _mlp(self) -> MLPConfig:
        act, gated = _FEED_FORWARD[self.feed_forward_proj]
        return MLPConfig(d_model=self.d_model, d_ff=self.d_ff, activation=act, gated=gated)

    def _norm(self) -> NormConfig:
        return NormConfig(kind="rms", eps=self.layer_norm_epsilon)

    def _relative_bias(self, bidirectional: bool) -> RelativeBiasConfig:
        return RelativeBiasConfig(num_buckets=self.relative_attention_num_buckets,
                                  max_distance=self.relative_attention_max_distance,
                                  bidirectional=bidirectional)

    @property
    def encoder(self) -> EncoderConfig:
        """The :class:`~lowrank_jax.nn.EncoderConfig` of the encoder stack."""
        layer = EncoderLayerConfig(attention=self._attention(), mlp=self._mlp(),
                                   norm=self._norm(), prenorm=True)
        return EncoderConfig(layer=layer, num_layers=self.num_layers, final_norm=True,
                             relative_bias=self._relative_bias(True))

    @property
    def decoder(self) -> DecoderConfig:
        """The :class:`~lowrank_jax.nn.DecoderConfig` of the decoder stack."""
        layer = DecoderLayerConfig(self_attention=self._attention(),
                                   cross_attention=self._attention(), mlp=self._mlp(),
                                   norm=self._norm(), prenorm=True)
        return DecoderConfig(layer=layer, num_layers=self.decoder_layers, final_norm=True,
                             relative_bias=self._relative_bias(False))


def init(key: Array, cfg: T5Config) -> dict:
    """Random T5 parameters (Dense leaves; ``N(0, 1)`` embedding as HF's initializer).

    Args:
      key: PRNG key.
      cfg: model configuration.

    Returns:
      ``{'shared', 'encoder', 'decoder'}`` plus ``'lm_head'`` when the head is untied.
    """
    ks, ke, kd, kh = jax.random.split(key, 4)
    params = {
        "shared": jax.random.normal(ks, (cfg.vocab_size, cfg.d_model), jnp.float32),
        "encoder": init_encoder(ke, cfg.encoder),
        "decoder": init_decoder(kd, cfg.decoder),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = init_dense(kh, cfg.d_model, cfg.vocab_size)
    return params


def _embed(params: dict, ids: Array, name: str) -> Array:
    ids = jnp.asarray(ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"t5: {name} must be an integer array [batch, seq], got shape {tuple(ids.shape)} "
            f"and dtype {ids.dtype}"
        )
    return jnp.take(params["shared"], ids, axis=0)  # [batch, seq, d_model]


def _mask(m: Array | None) -> Array | None:
    return None if m is None else padding_mask(m)  # [batch, 1, 1, k]


def encode(params: dict, cfg: T5Config, *, input_ids: Array,
           attention_mask: Array | None = None) -> Array:
    """Encoder states (HF ``model.encoder(...).last_hidden_state``).

    Args:
      params: model parameters.
      cfg: model configuration.
      input_ids: ``int[batch, s]``.
      attention_mask: ``[batch, s]``, 1 for real tokens and 0 for padding.

    Returns:
      ``[batch, s, d_model]``.
    """
    x = _embed(params, input_ids, "input_ids")
    return apply_encoder(params["encoder"], x, cfg.encoder, mask=_mask(attention_mask))


def decode(params: dict, cfg: T5Config, *, decoder_input_ids: Array, encoder_hidden: Array,
           attention_mask: Array | None = None,
           decoder_attention_mask: Array | None = None) -> Array:
    """Decoder states after the final norm (HF ``model.decoder(...).last_hidden_state``).

    Args:
      decoder_input_ids: ``int[batch, t]``, used as given (no shift).
      encoder_hidden: ``[batch, s, d_model]``.
      attention_mask: encoder padding ``[batch, s]`` (masks the cross-attention keys).
      decoder_attention_mask: decoder padding ``[batch, t]`` (causal masking is always on).

    Returns:
      ``[batch, t, d_model]``.
    """
    y = _embed(params, decoder_input_ids, "decoder_input_ids")
    return apply_decoder(params["decoder"], y, encoder_hidden, cfg.decoder,
                         self_mask=_mask(decoder_attention_mask),
                         cross_mask=_mask(attention_mask))


def lm_logits(params: dict, cfg: T5Config, hidden: Array) -> Array:
    """LM head: ``hidden * d_model**-0.5`` (if scaling) times the tied embedding or lm_head."""
    if cfg.scales_decoder_outputs:
        hidden = hidden * (cfg.d_model ** -0.5)
    if cfg.tie_word_embeddings:
        return jnp.einsum("...d,vd->...v", hidden, params["shared"])  # [..., vocab]
    return linear(params["lm_head"], hidden)  # [..., vocab]


def shift_right(labels: Array, cfg: T5Config) -> Array:
    """HF ``_shift_right``: prepend the start token, drop the last, replace -100 by pad."""
    labels = jnp.asarray(labels)
    start = jnp.full((labels.shape[0], 1), cfg.decoder_start_token_id, labels.dtype)
    shifted = jnp.concatenate([start, labels[:, :-1]], axis=1)
    return jnp.where(shifted == -100, cfg.pad_token_id, shifted)


def apply(params: dict, cfg: T5Config, *, input_ids: Array | None = None,
          attention_mask: Array | None = None, decoder_input_ids: Array | None = None,
          decoder_attention_mask: Array | None = None, encoder_outputs: Array | None = None,
          labels: Array | None = None) -> dict:
    """Forward pass of ``T5ForConditionalGeneration`` (inputs and outputs named as in HF).

    Args:
      params: model parameters.
      cfg: model configuration.
      input_ids: encoder tokens ``int[batch, s]`` (not needed if ``encoder_outputs`` given).
      attention_mask: encoder padding mask ``[batch, s]`` (1 = token, 0 = padding).
      decoder_input_ids: decoder tokens ``int[batch, t]``, used as given (HF does not shift
        them); if ``None``, ``shift_right(labels)``.
      decoder_attention_mask: decoder padding mask ``[batch, t]``; causal masking always on.
      encoder_outputs: precomputed encoder states ``[batch, s, d_model]``.
      labels: target tokens ``int[batch, t]`` (-100 = ignore): adds a mean cross-entropy
        ``'loss'`` over the non-ignored positions.

    Returns:
      ``{'last_hidden_state': decoder states [batch, t, d_model],
      'encoder_last_hidden_state': [batch, s, d_model], 'logits': [batch, t, vocab]}`` and
      ``'loss'`` when ``labels`` is given.
    """
    if decoder_input_ids is None:
        if labels is None:
            raise ValueError(
                "t5.apply: pass decoder_input_ids or labels (for encoder states alone, "
                "use t5.encode)"
            )
        decoder_input_ids = shift_right(labels, cfg)
    if encoder_outputs is None:
        if input_ids is None:
            raise ValueError("t5.apply: pass input_ids (or precomputed encoder_outputs)")
        enc = encode(params, cfg, input_ids=input_ids, attention_mask=attention_mask)
    else:
        enc = jnp.asarray(encoder_outputs)
    dec = decode(params, cfg, decoder_input_ids=decoder_input_ids, encoder_hidden=enc,
                 attention_mask=attention_mask, decoder_attention_mask=decoder_attention_mask)
    logits = lm_logits(params, cfg, dec)  # [batch, t, vocab]
    out = {"last_hidden_state": dec, "encoder_last_hidden_state": enc, "logits": logits}
    if labels is not None:
        labels = jnp.asarray(labels)
        valid = labels != -100
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
        out["loss"] = jnp.sum(nll * valid) / jnp.maximum(jnp.sum(valid), 1)
    return out
