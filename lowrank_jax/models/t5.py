"""T5 encoder-decoder (Raffel et al. 2020), v1.0 (relu) and v1.1 (gated-gelu), from nn blocks.

Matches Hugging Face ``T5ForConditionalGeneration`` in inference: RMS layer norm, pre-norm
residuals, unscaled attention, one relative-position-bias table per stack (HF keeps it in layer
0 and shares it down the stack; here the stack owns it as ``'rel_bias'``), no relative bias in
cross-attention, ``d_kv * num_heads != d_model`` allowed. Every weight matrix is a leaf, so any
projection may be ``Dense``, ``LowRank``, ``HeadLowRank`` or ``MaskedBinary``. The config holds
the Hugging Face sizes (what :func:`init` builds by default and what an export writes); the
forward pass reads every size from the parameters, so each layer may have its own head count
and MLP width (``init(..., encoder_layers=..., decoder_layers=...)``, or structured pruning).

Parameter tree::

    {'shared': [vocab, d_model],                 # token embedding (raw array)
     'encoder': init_encoder(...) tree,          # layers/i/{attn/{qk,v,o,heads},attn_norm,...}
     'decoder': init_decoder(...) tree,          # layers/i/{self_attn,...,cross_attn,...}, ...
     'lm_head': Dense [d_model, vocab]}          # only when not tie_word_embeddings
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.leaves import init_dense, linear
from lowrank_jax.leaves.masked_binary import kth_largest_key
from lowrank_jax.models.common import check_inputs, check_token_ids, layer_sizes
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.models.hf import (
    HFConfigFiles,
    HFRow,
    HFSpec,
    Widen,
    attention_rows,
    hf_files_field,
    mlp_rows,
    norm_rows,
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
    apply_decoder,
    apply_decoder_step,
    apply_encoder,
    init_decoder,
    init_decoder_cache,
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
      hf_files: the Hugging Face configuration files the model was loaded from (set by
        ``load_pretrained``; see :class:`~lowrank_jax.models.hf.HFConfigFiles`), written back
        by an export; not compared, hashed or shown.
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
    hf_files: HFConfigFiles | None = hf_files_field()

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                     "relative_attention_num_buckets", "relative_attention_max_distance"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ConfigError(f"T5Config: {name} must be a positive int, got {val!r}")
        if self.num_decoder_layers is not None and (
            not isinstance(self.num_decoder_layers, int) or self.num_decoder_layers < 1
        ):
            raise ConfigError(
                f"T5Config: num_decoder_layers must be None or a positive int, "
                f"got {self.num_decoder_layers!r}"
            )
        if self.feed_forward_proj not in _FEED_FORWARD:
            raise ConfigError(
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

    @property
    def activation(self) -> str:
        """The :data:`lowrank_jax.nn.ACTIVATIONS` name of ``feed_forward_proj``."""
        return _FEED_FORWARD[self.feed_forward_proj][0]

    def _mlp(self) -> MLPConfig:
        act, gated = _FEED_FORWARD[self.feed_forward_proj]
        return MLPConfig(activation=act, gated=gated)

    def _norm(self) -> NormConfig:
        return NormConfig(kind="rms", eps=self.layer_norm_epsilon)

    def _relative_bias(self, bidirectional: bool) -> RelativeBiasConfig:
        return RelativeBiasConfig(num_buckets=self.relative_attention_num_buckets,
                                  max_distance=self.relative_attention_max_distance,
                                  bidirectional=bidirectional)

    @property
    def encoder(self) -> EncoderConfig:
        """The :class:`~lowrank_jax.nn.EncoderConfig` of the encoder stack (unscaled attention,
        RMS norm, pre-norm, relative bias)."""
        layer = EncoderLayerConfig(attention=AttentionConfig(scaled=False), mlp=self._mlp(),
                                   norm=self._norm(), prenorm=True)
        return EncoderConfig(layer=layer, final_norm=True, relative_bias=self._relative_bias(True))

    @property
    def decoder(self) -> DecoderConfig:
        """The :class:`~lowrank_jax.nn.DecoderConfig` of the decoder stack."""
        attn = AttentionConfig(scaled=False)
        layer = DecoderLayerConfig(self_attention=attn, cross_attention=attn, mlp=self._mlp(),
                                   norm=self._norm(), prenorm=True)
        return DecoderConfig(layer=layer, final_norm=True,
                             relative_bias=self._relative_bias(False))

    @property
    def encoder_sizes(self) -> tuple[LayerSizes, ...]:
        """The Hugging Face sizes of every encoder layer (what :func:`init` builds)."""
        return LayerSizes.uniform(self.num_layers, num_heads=self.num_heads, d_head=self.d_kv,
                                  d_ff=self.d_ff)

    @property
    def decoder_sizes(self) -> tuple[LayerSizes, ...]:
        """The Hugging Face sizes of every decoder layer."""
        return LayerSizes.uniform(self.decoder_layers, num_heads=self.num_heads,
                                  d_head=self.d_kv, d_ff=self.d_ff)


def init(key: Array, cfg: T5Config, *, encoder_layers=None, decoder_layers=None) -> dict:
    """Random T5 parameters (Dense leaves; ``N(0, 1)`` embedding as HF's initializer).

    Args:
      key: PRNG key.
      cfg: model configuration.
      encoder_layers, decoder_layers: optional per-layer :class:`~lowrank_jax.nn.LayerSizes`
        (one per layer) for a model whose layers differ in head count, head width or MLP width;
        default ``cfg.encoder_sizes`` / ``cfg.decoder_sizes``.

    Returns:
      ``{'shared', 'encoder', 'decoder'}`` plus ``'lm_head'`` when the head is untied.
    """
    enc = layer_sizes(encoder_layers, cfg.encoder_sizes, "t5.init: encoder_layers",
                       cfg.num_layers)
    dec = layer_sizes(decoder_layers, cfg.decoder_sizes, "t5.init: decoder_layers",
                       cfg.decoder_layers)
    ks, ke, kd, kh = jax.random.split(key, 4)
    params = {
        "shared": jax.random.normal(ks, (cfg.vocab_size, cfg.d_model), jnp.float32),
        "encoder": init_encoder(ke, cfg.encoder, d_model=cfg.d_model, layers=enc),
        "decoder": init_decoder(kd, cfg.decoder, d_model=cfg.d_model, layers=dec),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = init_dense(kh, cfg.d_model, cfg.vocab_size)
    return params


def _embed(params: dict, ids: Array, name: str) -> Array:
    ids = check_token_ids(ids, params["shared"].shape[0], name, "t5")
    return jnp.take(params["shared"], ids, axis=0)  # [batch, seq, d_model]


def _mask(m: Array | None) -> Array | None:
    return None if m is None else padding_mask(m)  # [batch, 1, 1, k]


def encode(params: dict, input_ids: Array, cfg: T5Config, *,
           attention_mask: Array | None = None) -> Array:
    """Encoder states (HF ``model.encoder(...).last_hidden_state``).

    Args:
      params: model parameters.
      input_ids: ``int[batch, s]``.
      cfg: model configuration.
      attention_mask: ``[batch, s]``, 1 for real tokens and 0 for padding.

    Returns:
      ``[batch, s, d_model]``.
    """
    x = _embed(params, input_ids, "input_ids")
    return apply_encoder(params["encoder"], x, cfg.encoder, mask=_mask(attention_mask))


def decode(params: dict, decoder_input_ids: Array, cfg: T5Config, *, enc: Array,
           attention_mask: Array | None = None,
           decoder_attention_mask: Array | None = None) -> Array:
    """Decoder states after the final norm (HF ``model.decoder(...).last_hidden_state``).

    Args:
      params: model parameters.
      decoder_input_ids: ``int[batch, t]``, used as given (no shift).
      cfg: model configuration.
      enc: encoder states ``[batch, s, d_model]``.
      attention_mask: encoder padding ``[batch, s]`` (masks the cross-attention keys).
      decoder_attention_mask: decoder padding ``[batch, t]`` (causal masking is always on).

    Returns:
      ``[batch, t, d_model]``.
    """
    y = _embed(params, decoder_input_ids, "decoder_input_ids")
    return apply_decoder(params["decoder"], y, cfg.decoder, enc=enc,
                         self_mask=_mask(decoder_attention_mask),
                         cross_mask=_mask(attention_mask))


def lm_logits(params: dict, hidden: Array, cfg: T5Config) -> Array:
    """LM head: ``hidden * d_model**-0.5`` (if scaling) times the tied embedding or lm_head."""
    if cfg.scales_decoder_outputs:
        hidden = hidden * (cfg.d_model ** -0.5)
    if cfg.tie_word_embeddings:
        return jnp.einsum("...d,vd->...v", hidden, params["shared"])  # [..., vocab]
    return linear(params["lm_head"], hidden)  # [..., vocab]


# ---------------------------------------------------------------------------------------------
# Autoregressive decoding.

def init_cache(params: dict, cfg: T5Config, *, enc: Array, max_len: int,
               batch: int | None = None) -> dict:
    """A key-value cache for decoding ``max_len`` positions against encoder states ``enc``
    (:func:`lowrank_jax.nn.init_decoder_cache`: the cross-attention keys and values are
    computed here, once; ``batch`` a multiple of ``enc``'s for several sample paths per
    input)."""
    return init_decoder_cache(params["decoder"], cfg.decoder, enc=enc, max_len=max_len,
                              batch=batch)


def decode_step(params: dict, decoder_input_ids: Array, cfg: T5Config, cache: dict, *,
                attention_mask: Array | None = None) -> tuple[Array, dict]:
    """Decoder states of the next tokens, with a key-value cache.

    Equals the last positions of :func:`decode` on the whole sequence so far (tested).

    Args:
      params: model parameters.
      decoder_input_ids: ``int[batch, n]``, the tokens at positions ``cache['index'] ..``.
      cfg: model configuration.
      cache: from :func:`init_cache` or the previous step.
      attention_mask: encoder padding ``[batch, s]``.

    Returns:
      ``(states [batch, n, d_model], cache)``.
    """
    y = _embed(params, decoder_input_ids, "decoder_input_ids")
    return apply_decoder_step(params["decoder"], y, cfg.decoder, cache,
                              cross_mask=_mask(attention_mask))


def decode_loop(params: dict, enc: Array, cfg: T5Config, key: Array, choose, *, steps: int,
                attention_mask: Array | None = None, repeats: int = 1,
                use_cache: bool = True) -> Array:
    """Generate ``steps`` tokens from the start token (a building block of :func:`generate`
    and Chronos' sampler; traceable, call it inside ``jit``).

    Step ``t`` feeds the token chosen at step ``t - 1`` (the start token at ``t = 0``), reads
    the LM logits of that position and calls ``choose(logits [batch, vocab], t, subkey) ->
    int[batch]``, with ``key, subkey = jax.random.split(key)`` at every step.

    ``repeats`` sequences are decoded per encoder row (``enc: [rows, s, d]`` gives
    ``rows * repeats`` sequences, row ``b`` serving ``b * repeats ..``, HF's
    ``num_return_sequences`` order); with the cache, the encoder's keys and values are kept once
    per row.

    ``use_cache=True`` keeps the keys and values of earlier positions
    (:func:`decode_step`: ``O(steps)`` projection work); ``False`` re-runs the decoder on a
    fixed ``[batch, steps + 1]`` token buffer at every step (``O(steps^2)``: position ``t``
    only sees tokens ``<= t``, so later slots do not matter), the reference the cached path is
    tested against.

    Returns:
      ``int32[rows * repeats, steps]``.
    """
    batch = enc.shape[0] * repeats
    start = jnp.full((batch,), cfg.decoder_start_token_id, jnp.int32)
    out = jnp.zeros((batch, steps), jnp.int32)

    def pick(hidden_t, t, key):
        logits = lm_logits(params, hidden_t, cfg)  # [batch, vocab]
        key, sub = jax.random.split(key)
        return jnp.asarray(choose(logits, t, sub), jnp.int32), key

    if use_cache:
        cache = init_cache(params, cfg, enc=enc, max_len=steps, batch=batch)

        def step(t, carry):
            cache, prev, out, key = carry
            hidden, cache = decode_step(params, prev[:, None], cfg, cache,
                                        attention_mask=attention_mask)  # [batch, 1, d]
            tok, key = pick(hidden[:, 0], t, key)
            return cache, tok, out.at[:, t].set(tok), key

        return jax.lax.fori_loop(0, steps, step, (cache, start, out, key))[2]

    if repeats > 1:
        enc = jnp.repeat(enc, repeats, axis=0)  # [batch, s, d]
        if attention_mask is not None:
            attention_mask = jnp.repeat(attention_mask, repeats, axis=0)
    buf = jnp.concatenate([start[:, None], jnp.zeros((batch, steps), jnp.int32)], axis=1)

    def step_uncached(t, carry):
        buf, key = carry
        hidden = decode(params, buf, cfg, enc=enc, attention_mask=attention_mask)
        h_t = jax.lax.dynamic_index_in_dim(hidden, t, axis=1, keepdims=False)  # [batch, d]
        tok, key = pick(h_t, t, key)
        return jax.lax.dynamic_update_index_in_dim(buf, tok, t + 1, axis=1), key

    return jax.lax.fori_loop(0, steps, step_uncached, (buf, key))[0][:, 1:]


def kth_largest(x: Array, k: int) -> Array:
    """The ``k``-th largest entry of every row of a float32 array, exactly
    (``jax.lax.top_k(x, k)[0][..., -1]``).

    A bitwise binary search: float32 values map to unsigned integers in the same order, and
    the 32 bits of the answer are decided from the top one down, each by counting the entries
    at or above a candidate (:func:`lowrank_jax.leaves.masked_binary.kth_largest_key`, the
    radix select of Biprop's masks; ``32`` passes over the row). On XLA:CPU this is
    about 18x faster than ``lax.top_k`` for a ``[20, 4096]`` row block with ``k = 50`` (0.6 vs
    10.6 ms), which made top-k the largest part of a Chronos decoding step. NaNs are not
    supported.

    Args:
      x: ``float32[..., n]``.
      k: in ``[1, n]``.

    Returns:
      ``float32[...]``.
    """
    x = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = jnp.uint32(0x80000000)
    # Order-preserving map: negative floats reversed below the positive ones.
    keys = jnp.where(bits >= sign, ~bits, bits | sign)
    res = kth_largest_key(keys, k)
    bits = jnp.where(res >= sign, res & ~sign, ~res)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def warp_logits(logits: Array, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float = 1.0) -> Array:
    """Hugging Face's sampling warpers in their order: temperature, top-k, top-p.

    Removed entries become ``-inf``; ``top_k`` 0/None and ``top_p >= 1`` disable those steps.
    """
    logits = logits.astype(jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k:
        kth = kth_largest(logits, min(int(top_k), logits.shape[-1]))[..., None]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(logits, axis=-1)  # ascending, as HF
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        remove_sorted = (cum <= 1.0 - top_p).at[..., -1].set(False)  # keep >= 1 token
        remove = jnp.take_along_axis(remove_sorted, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(remove, -jnp.inf, logits)
    return logits


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "min_new_tokens",
                                             "do_sample", "temperature", "top_k", "top_p",
                                             "use_cache"))
def _generate(params, input_ids, attention_mask, cfg, key, *, max_new_tokens, min_new_tokens,
              do_sample, temperature, top_k, top_p, use_cache):
    enc = encode(params, input_ids, cfg, attention_mask=attention_mask)

    def choose(logits, t, sub):
        if min_new_tokens:  # HF MinNewTokensLengthLogitsProcessor
            logits = jnp.where((t < min_new_tokens)
                               & (jnp.arange(logits.shape[-1]) == cfg.eos_token_id),
                               -jnp.inf, logits)
        if not do_sample:
            return jnp.argmax(logits, axis=-1)
        logits = warp_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        return jax.random.categorical(sub, logits, axis=-1)

    toks = decode_loop(params, enc, cfg, key, choose, steps=max_new_tokens,
                       attention_mask=attention_mask, use_cache=use_cache)
    # HF: a finished sequence emits pad_token_id after its EOS.
    after_eos = jnp.cumsum(toks == cfg.eos_token_id, axis=1) - (toks == cfg.eos_token_id) > 0
    return jnp.where(after_eos, cfg.pad_token_id, toks)


def generate(params: dict, input_ids: Array, cfg: T5Config, *,
             attention_mask: Array | None = None, max_new_tokens: int = 20,
             min_new_tokens: int = 0, do_sample: bool = False, key: Array | None = None,
             temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
             use_cache: bool = True) -> Array:
    """Autoregressive generation, as Hugging Face ``T5ForConditionalGeneration.generate``.

    Greedy by default (``do_sample=False``: equal to HF's greedy ``generate``, tested), or
    sampling after the temperature / top-k / top-p warpers. The encoder runs once; with
    ``use_cache`` (default) each step projects only the new token (:func:`decode_step`).
    After a sequence's EOS its tokens are ``pad_token_id`` (HF does the same). Shapes are
    static: all ``max_new_tokens`` steps run, where HF stops once every sequence has
    finished (its output is then shorter and equals a prefix of this one).

    Args:
      params: model parameters.
      input_ids: encoder tokens ``int[batch, s]``.
      cfg: model configuration.
      attention_mask: encoder padding ``[batch, s]`` (1 = token).
      max_new_tokens: tokens to generate.
      min_new_tokens: EOS is suppressed for the first ``min_new_tokens`` steps.
      do_sample: sample instead of taking the argmax.
      key: PRNG key (required when sampling).
      temperature, top_k, top_p: the sampling warpers (:func:`warp_logits`).
      use_cache: keep a key-value cache (``False``: re-run the decoder on the prefix at every
        step, ``O(max_new_tokens^2)`` work; for comparison).

    Returns:
      ``int32[batch, max_new_tokens]``, without the decoder start token that HF's output
      begins with.
    """
    ids = check_token_ids(input_ids, params["shared"].shape[0], "input_ids", "t5.generate")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
            max_new_tokens < 1):
        raise ConfigError(f"t5.generate: max_new_tokens must be a positive int, got "
                          f"{max_new_tokens!r}", where="max_new_tokens", expected="int >= 1",
                          actual=max_new_tokens)
    if do_sample and key is None:
        raise ConfigError("t5.generate: sampling needs a PRNG key (key=jax.random.PRNGKey(...))",
                          where="key", expected="a PRNG key", actual=None)
    mask = jnp.ones(ids.shape, jnp.int32) if attention_mask is None else jnp.asarray(
        attention_mask)
    return _generate(params, ids, mask, cfg, jax.random.PRNGKey(0) if key is None else key,
                     max_new_tokens=max_new_tokens, min_new_tokens=int(min_new_tokens),
                     do_sample=bool(do_sample), temperature=float(temperature),
                     top_k=int(top_k) if top_k else None, top_p=float(top_p),
                     use_cache=bool(use_cache))


def shift_right(labels: Array, cfg: T5Config) -> Array:
    """HF ``_shift_right``: prepend the start token, drop the last, replace -100 by pad."""
    labels = jnp.asarray(labels)
    start = jnp.full((labels.shape[0], 1), cfg.decoder_start_token_id, labels.dtype)
    shifted = jnp.concatenate([start, labels[:, :-1]], axis=1)
    return jnp.where(shifted == -100, cfg.pad_token_id, shifted)


INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask",
          "encoder_outputs", "labels")


def token_loss(logits: Array, labels: Array) -> Array:
    """Mean cross-entropy over the labels that are not ``-100`` (HF's convention)."""
    labels = jnp.asarray(labels)
    valid = labels != -100
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * valid) / jnp.maximum(jnp.sum(valid), 1)


def apply(params: dict, inputs: dict, cfg: T5Config) -> dict:
    """Forward pass of ``T5ForConditionalGeneration`` (inputs and outputs named as in HF).

    Args:
      params: model parameters.
      inputs: a dict with
        ``input_ids``: encoder tokens ``int[batch, s]`` (not needed with ``encoder_outputs``);
        ``attention_mask``: encoder padding mask ``[batch, s]`` (1 = token, 0 = padding);
        ``decoder_input_ids``: decoder tokens ``int[batch, t]``, used as given (HF does not
        shift them); if absent, ``shift_right(labels)``;
        ``decoder_attention_mask``: decoder padding mask ``[batch, t]`` (causal masking is
        always on); ``encoder_outputs``: precomputed encoder states ``[batch, s, d_model]``;
        ``labels``: target tokens ``int[batch, t]`` (-100 = ignore): adds a mean cross-entropy
        ``'loss'`` over the non-ignored positions.
      cfg: model configuration.

    Returns:
      ``{'last_hidden_state': decoder states [batch, t, d_model],
      'encoder_last_hidden_state': [batch, s, d_model], 'logits': [batch, t, vocab]}`` and
      ``'loss'`` when ``labels`` is given.
    """
    inputs = check_inputs(inputs, INPUTS, "t5.apply")
    labels = inputs.get("labels")
    decoder_input_ids = inputs.get("decoder_input_ids")
    attention_mask = inputs.get("attention_mask")
    if decoder_input_ids is None:
        if labels is None:
            raise DataError(
                "t5.apply: pass decoder_input_ids or labels (for encoder states alone, "
                "use t5.encode)", where="inputs", expected="decoder_input_ids or labels")
        decoder_input_ids = shift_right(labels, cfg)
    if inputs.get("encoder_outputs") is None:
        if inputs.get("input_ids") is None:
            raise DataError("t5.apply: pass input_ids (or precomputed encoder_outputs)",
                            where="inputs", expected="input_ids")
        enc = encode(params, inputs["input_ids"], cfg, attention_mask=attention_mask)
    else:
        enc = jnp.asarray(inputs["encoder_outputs"])
    dec = decode(params, decoder_input_ids, cfg, enc=enc, attention_mask=attention_mask,
                 decoder_attention_mask=inputs.get("decoder_attention_mask"))
    logits = lm_logits(params, dec, cfg)  # [batch, t, vocab]
    out = {"last_hidden_state": dec, "encoder_last_hidden_state": enc, "logits": logits}
    if labels is not None:
        out["loss"] = token_loss(logits, labels)
    return out


def sample_inputs(cfg: T5Config, rng: np.random.Generator, batch: int) -> dict:
    """Random token inputs (32 encoder, 16 decoder tokens; some padding in the first row)."""
    ids = rng.integers(2, cfg.vocab_size, size=(batch, 32))
    mask = np.ones_like(ids)
    mask[0, -5:] = 0
    dec = rng.integers(2, cfg.vocab_size, size=(batch, 16))
    return {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(mask, jnp.int32),
            "decoder_input_ids": jnp.asarray(dec, jnp.int32)}


def loss(cfg: T5Config):
    """Default objective: token cross-entropy of ``apply(params, batch, cfg)`` on
    ``batch['labels']`` (-100 ignored)."""

    def loss_fn(params, batch, key):
        del key  # no dropout
        return apply(params, batch, cfg)["loss"], {}

    return loss_fn


# ---------------------------------------------------------------------------------------------
# Hugging Face mapping (``T5ForConditionalGeneration``), shared with Chronos and Chronos-Bolt.

def hf_key_table(cfg: T5Config, *, lm_head: bool | None = None) -> list[HFRow]:
    """Every tensor of a ``T5ForConditionalGeneration`` checkpoint of ``cfg``.

    Hugging Face keeps each stack's relative-bias table in its layer 0 and shares it down the
    stack; here the stack owns it (``'encoder/rel_bias'``, ``[buckets, heads]`` over original
    heads). The embedding copies ``encoder/decoder.embed_tokens`` are tied to ``shared`` (see
    :func:`hf_optional_keys`).

    Args:
      cfg: the model configuration.
      lm_head: include ``lm_head.weight`` (default: iff the head is untied).

    Returns:
      The rows: attention and MLP rows carry the head structure export needs to zero-pad
      layers with fewer heads or a narrower MLP than ``cfg``.
    """
    untied = (not cfg.tie_word_embeddings) if lm_head is None else lm_head
    d, ff, h, dk = cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.d_kv
    mlp_names = ("wi_0", "wi_1", "wo") if cfg.is_gated else ("wi", "wo")
    table = Widen("head_table", 1, num_heads=h)
    rel = (cfg.relative_attention_num_buckets, h)
    rows = [HFRow("shared.weight", "shared", "array", (cfg.vocab_size, d))]

    def attn(prefix: str, path: str) -> list[HFRow]:
        return attention_rows({n: f"{prefix}.{n}" for n in "qkvo"}, path, d_q=d, d_kv_in=d,
                              d_out=d, num_heads=h, d_head=dk, scale=1.0, bias=False)

    def mlp(prefix: str, path: str) -> list[HFRow]:
        return mlp_rows({n: f"{prefix}.DenseReluDense.{n}" for n in mlp_names}, path,
                        d_model=d, d_ff=ff, bias=False)

    for i in range(cfg.num_layers):
        b, p = f"encoder.block.{i}", f"encoder/layers/{i}"
        rows += attn(f"{b}.layer.0.SelfAttention", f"{p}/attn")
        rows += norm_rows(f"{b}.layer.0.layer_norm", f"{p}/attn_norm", d, bias=False)
        rows += mlp(f"{b}.layer.1", f"{p}/mlp")
        rows += norm_rows(f"{b}.layer.1.layer_norm", f"{p}/mlp_norm", d, bias=False)
    rows.append(HFRow("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                      "encoder/rel_bias", "array", rel, table))
    rows += norm_rows("encoder.final_layer_norm", "encoder/final_norm", d, bias=False)
    for i in range(cfg.decoder_layers):
        b, p = f"decoder.block.{i}", f"decoder/layers/{i}"
        rows += attn(f"{b}.layer.0.SelfAttention", f"{p}/self_attn")
        rows += norm_rows(f"{b}.layer.0.layer_norm", f"{p}/self_attn_norm", d, bias=False)
        rows += attn(f"{b}.layer.1.EncDecAttention", f"{p}/cross_attn")
        rows += norm_rows(f"{b}.layer.1.layer_norm", f"{p}/cross_attn_norm", d, bias=False)
        rows += mlp(f"{b}.layer.2", f"{p}/mlp")
        rows += norm_rows(f"{b}.layer.2.layer_norm", f"{p}/mlp_norm", d, bias=False)
    rows.append(HFRow("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                      "decoder/rel_bias", "array", rel, table))
    rows += norm_rows("decoder.final_layer_norm", "decoder/final_norm", d, bias=False)
    if untied:
        rows.append(HFRow("lm_head.weight", "lm_head", "linear", (cfg.vocab_size, d)))
    return rows


def hf_optional_keys(cfg: T5Config, *, lm_head: bool | None = None) -> dict:
    """Keys a T5 checkpoint may carry that hold nothing new: the tied embedding copies, a
    tied ``lm_head.weight`` (a live module's state dict has it) and the cross-attention
    relative bias Hugging Face never uses (its ``_keys_to_ignore_on_load_unexpected``).

    Args:
      cfg: the model configuration.
      lm_head: accept ``lm_head.weight`` (default: iff the head is tied); ``None`` shape
        means any shape.
    """
    emb = (cfg.vocab_size, cfg.d_model)
    out = {"encoder.embed_tokens.weight": emb, "decoder.embed_tokens.weight": emb,
           "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight":
               (cfg.relative_attention_num_buckets, cfg.num_heads)}
    if cfg.tie_word_embeddings if lm_head is None else lm_head:
        out["lm_head.weight"] = emb
    return out


def resolve_head(cfg: T5Config, state) -> T5Config:
    """Decide tied vs untied head from the weights as well as the config.

    transformers >= 5 always writes ``tie_word_embeddings: true`` (and a separate
    ``scale_decoder_outputs``), while older T5 v1.1 checkpoints store ``tie_word_embeddings:
    false`` and a distinct ``lm_head.weight``. A state dict from an in-memory tied module also
    carries ``lm_head.weight``, equal to ``shared.weight``. So: an ``lm_head.weight`` that
    differs from ``shared.weight`` means an untied head, whatever the config says (the decoder
    scaling is unaffected: it is ``scale_decoder_outputs``).

    Args:
      cfg: the configuration read from ``config.json``.
      state: the checkpoint's tensors ``{key: array}``.

    Returns:
      ``cfg``, untied if the checkpoint's head is.
    """
    head, shared = state.get("lm_head.weight"), state.get("shared.weight")
    if cfg.tie_word_embeddings and head is not None and shared is not None:
        if np.shape(head) != np.shape(shared) or not np.array_equal(head, shared):
            return dataclasses.replace(cfg, tie_word_embeddings=False,
                                       scale_decoder_outputs=cfg.scales_decoder_outputs)
    return cfg


def detect_hf(hf_config: dict) -> bool:
    """A plain T5 ``config.json`` (Chronos checkpoints are T5 too but have ``chronos_config``)."""
    archs = hf_config.get("architectures") or []
    is_t5 = hf_config.get("model_type") == "t5" or any(str(a).startswith("T5") for a in archs)
    return is_t5 and "chronos_config" not in hf_config


def config_from_hf(hf_config: dict, state) -> T5Config:
    """:class:`T5Config` from a ``config.json`` dict and the checkpoint's tensors (tied or
    untied head, :func:`resolve_head`)."""
    return resolve_head(T5Config.from_hf_dict(hf_config), state)


HF_SPEC = HFSpec(detect=detect_hf, config_from_hf=config_from_hf,
                 config_to_hf=lambda cfg: cfg.to_hf_dict(), key_table=hf_key_table,
                 optional=hf_optional_keys)

FAMILY = register_family(ModelFamily(
    name="t5", config_cls=T5Config, init=init, apply=apply, sample_inputs=sample_inputs,
    primary_outputs=("logits",), token_outputs=True, loss=loss, hf=HF_SPEC))


__all__ = [
    "FAMILY", "T5Config", "apply", "decode", "decode_loop", "decode_step", "encode", "generate",
    "init", "init_cache", "lm_logits", "loss", "sample_inputs", "shift_right", "token_loss",
    "warp_logits",
]
