"""Cached autoregressive decoding of a decoder stack (key-value cache).

Without a cache, generating ``T`` tokens runs the decoder on the whole prefix at every step:
``O(T^2)`` projection work. With it, each step projects only the new tokens and attends to the
keys and values kept from earlier steps; the cross-attention's keys and values of the encoder
output are computed once.

The cache is a plain pytree with static shapes (one ``jit`` compilation serves every step)::

    {'index': int32[],                          # position of the next token
     'layers': [{'self': {'k', 'v'},            # max_len positions: written step by step
                 'cross': {'k', 'v'}}, ...]}    # s positions: the encoder output's

The values are ``[batch, heads, len, w_v]``. The keys' layout is the query-key type's
(:meth:`lowrank_jax.QK.keys`): per-head keys ``[batch, heads, len, w]`` for a ``QueryKey``,
``R`` coordinates shared by all heads (``[batch, len, R]``) for a CP-factorized query-key
tensor, so a compressed attention also keeps a smaller cache. Every weight is applied through
:func:`lowrank_jax.linear`, so low-rank, binary and pruned leaves decode as they run forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ShapeError
from lowrank_jax.nn.attention.cache import (
    apply_attention_cached,
    attention_cache,
    init_attention_cache,
    known_int,
)
from lowrank_jax.nn.layers import (
    DecoderConfig,
    _layers,
    decoder_layer_body,
    decoder_self_bias,
)
from lowrank_jax.nn.norms import apply_norm

Array = jax.Array


def init_decoder_cache(params: dict, cfg: DecoderConfig, *, enc: Array, max_len: int,
                       batch: int | None = None, dtype=jnp.float32) -> dict:
    """A decoder stack's cache: empty self-attention buffers of ``max_len`` positions and the
    cross-attention keys and values of ``enc``.

    Args:
      params: from :func:`~lowrank_jax.nn.init_decoder`.
      cfg: stack configuration.
      enc: encoder output ``[batch, s, d_enc]``.
      max_len: number of decoder positions the cache holds (tokens fed to the decoder,
        including the start token).
      batch: number of sequences decoded (default ``enc``'s batch). A multiple ``g`` of
        ``enc``'s batch: sequences ``b g .. (b + 1) g - 1`` all read encoder row ``b`` (sample
        paths of one input, Hugging Face's ``num_return_sequences`` order), and the
        cross-attention cache is kept once per encoder row, not once per sequence.
      dtype: dtype of the self-attention buffers.

    Returns:
      ``{'index': 0, 'layers': [{'self': {'k', 'v'}, 'cross': {'k', 'v'}}, ...]}``.
    """
    del cfg  # sizes come from the parameters
    enc = jnp.asarray(enc)
    if enc.ndim != 3:
        raise ShapeError(f"init_decoder_cache: enc must be [batch, s, d_enc], got shape "
                         f"{tuple(enc.shape)}", where="enc", expected="[batch, s, d_enc]",
                         actual=tuple(enc.shape))
    layers = _layers("init_decoder_cache", params)
    rows = enc.shape[0]
    batch = rows if batch is None else batch
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1 or (
            batch % rows):
        raise ShapeError(f"init_decoder_cache: batch must be a positive multiple of enc's "
                         f"{rows} rows, got {batch!r}", where="batch",
                         expected=f"a multiple of {rows}", actual=batch)
    return {
        "index": jnp.zeros((), jnp.int32),
        "layers": [{"self": init_attention_cache(lp["self_attn"], batch, max_len, dtype),
                    "cross": attention_cache(lp["cross_attn"], enc)} for lp in layers],
    }


def _check_cache(params: dict, cache) -> list:
    layers = _layers("apply_decoder_step", params)
    held = cache.get("layers") if isinstance(cache, dict) else None
    if not (isinstance(held, (list, tuple)) and "index" in cache and len(held) == len(layers)):
        raise ShapeError(f"apply_decoder_step: cache must be init_decoder_cache(...) of this "
                         f"stack ({len(layers)} layers)", where="cache",
                         expected=f"{len(layers)} layers",
                         actual=(f"{len(held)} layers" if isinstance(held, (list, tuple))
                                 else type(cache).__name__))
    return layers


def apply_decoder_step(params: dict, x: Array, cfg: DecoderConfig, cache: dict, *,
                       cross_mask: Array | None = None) -> tuple[Array, dict]:
    """Run the decoder stack on the next ``n`` tokens with a key-value cache.

    Equals the last ``n`` positions of :func:`~lowrank_jax.nn.apply_decoder` on the whole
    sequence so far (to float32 round-off; tested against it). The causal mask is implied by
    the positions; decoder padding (``self_mask`` of ``apply_decoder``) has no counterpart:
    generated tokens are never padding.

    Args:
      params: from :func:`~lowrank_jax.nn.init_decoder`.
      x: embedded tokens ``[batch, n, d_model]`` at positions ``index .. index + n - 1``.
      cfg: stack configuration (``qkv_keep`` activation masks are not supported).
      cache: from :func:`init_decoder_cache` or a previous step.
      cross_mask: boolean mask broadcastable to ``[batch, heads, n, s]`` (encoder padding);
        with a cache shared by sample paths, ``[enc batch, 1, 1, s]`` serves them all.

    Returns:
      ``(y [batch, n, d_model], cache)`` with ``cache['index']`` advanced by ``n``.
    """
    layers = _check_cache(params, cache)
    x = jnp.asarray(x)
    if x.ndim != 3:
        raise ShapeError(f"apply_decoder_step: x must be [batch, n, d_model], got shape "
                         f"{tuple(x.shape)}", where="x", expected="[batch, n, d_model]",
                         actual=tuple(x.shape))
    n = x.shape[1]
    index = cache["index"]
    max_len = cache["layers"][0]["self"]["v"].shape[2]  # [batch, heads, max_len, w_v]
    known = known_int(index)
    if known is not None and known + n > max_len:
        raise ShapeError(f"apply_decoder_step: {n} more tokens at position {known} exceed "
                         f"the cache's {max_len} positions", where="cache",
                         expected=f"<= {max_len}", actual=known + n)
    bias = decoder_self_bias(params, cfg, n, max_len, q_offset=index)  # [1, H, n, max_len]
    lc = cfg.layer
    new_layers = []
    for lp, c in zip(layers, cache["layers"], strict=True):
        new = {}

        def self_attn(h, lp=lp, c=c, new=new):
            out, new["self"] = apply_attention_cached(lp["self_attn"], h, lc.self_attention,
                                                      c["self"], index=index, bias=bias)
            return out

        def cross_attn(h, lp=lp, c=c, new=new):
            out, new["cross"] = apply_attention_cached(lp["cross_attn"], h, lc.cross_attention,
                                                       c["cross"], mask=cross_mask)
            return out

        x = decoder_layer_body(lp, x, lc, self_attn, cross_attn)
        new_layers.append(new)
    if cfg.final_norm:
        x = apply_norm(params["final_norm"], x, lc.norm)
    return x, {"index": index + n, "layers": new_layers}


__all__ = ["apply_decoder_step", "init_decoder_cache"]
