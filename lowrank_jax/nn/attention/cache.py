"""Attention against cached keys and values (autoregressive decoding).

A block's cache holds what :meth:`lowrank_jax.QK.keys` keeps of the keys (per-head keys for a
``QueryKey``, shared coordinates for a CP factorization) and the per-head values, heads before
positions (``[batch, heads, len, w_v]``: the layout the weighted sum reads, so that a decoding
step reads the cache as it is stored instead of copying it); the decoder stack's cache
(:mod:`lowrank_jax.nn.decoding`) is a list of these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import linear, split_heads
from lowrank_jax.nn.attention.block import AttentionConfig
from lowrank_jax.nn.attention.core import (
    attend,
    attention_params,
    bias_and_mask,
    causal_key_mask,
    positive,
    write_positions,
)

Array = jax.Array


def _no_activation_masks(cfg: AttentionConfig, owner: str) -> None:
    if cfg.qkv_keep is not None:
        raise ConfigError(
            f"{owner}: fixed Q/K/V activation masks (qkv_keep) are drawn over the whole "
            "sequence length and are not supported in cached decoding; decode without a cache",
            where="qkv_keep", expected=None, actual=cfg.qkv_keep)


def known_int(index) -> int | None:
    """``index`` as an int when its value is known here (a Python or NumPy int, or a concrete
    array outside ``jit``), else ``None`` (traced: the caller cannot check it)."""
    if isinstance(index, jax.core.Tracer):
        return None
    try:
        return int(index)
    except (TypeError, ValueError):
        return None


def _group_queries(arr, held: int, group: int, n: int):
    """A mask or bias for queries stacked ``[held, group * n]`` (see
    :func:`apply_attention_cached`): given per sequence ``[held * group, h, n or 1, k]``, per
    cache row ``[held or 1, h, n or 1, k]``; anything else is left for the shape check."""
    if arr is None:
        return None
    arr = jnp.asarray(arr)
    if arr.ndim != 4:
        return arr
    b, h, q, k = arr.shape
    if q == 1 and b in (1, held):
        return arr  # broadcasts over the stacked queries as it is
    if q not in (1, n):
        return arr
    arr = jnp.broadcast_to(arr, (b, h, n, k))
    if b == held * group:
        arr = arr.reshape(held, group, h, n, k).transpose(0, 2, 1, 3, 4)
        return arr.reshape(held, h, group * n, k)
    return jnp.tile(arr, (1, 1, group, 1)) if b in (1, held) else arr


def values_heads_first(v, heads, x: Array) -> Array:
    """Per-head values of ``x [batch, len, d]`` as a cache keeps them: ``[batch, heads, len,
    max(w_v)]`` (zero-padded per head)."""
    return jnp.swapaxes(split_heads(linear(v, x), heads.v), 1, 2)


def attention_cache(params: dict, kv: Array) -> dict:
    """The key-value cache of an attention block for a fixed keys'/values' input (the encoder
    output of a cross-attention): computed once, read at every decoding step.

    Args:
      params: ``{'qk', 'v', 'o', 'heads'}``.
      kv: ``[batch, k_len, d_kv_in]``.

    Returns:
      ``{'k': qk.keys(kv), 'v': per-head values [batch, h, k_len, w_v]}`` (the keys' layout
      is the query-key type's, positions on axis :meth:`~lowrank_jax.QK.keys_axis`: per-head
      keys ``[batch, h, k_len, w]`` for a ``QueryKey``, ``R`` shared coordinates
      ``[batch, k_len, R]`` for a CP factorization, ...).
    """
    qk, v, _, heads = attention_params(params, "attention_cache")
    kv = jnp.asarray(kv)
    if kv.ndim != 3 or kv.shape[-1] != qk.d_k_in:
        raise ShapeError(f"attention_cache: kv must be [batch, k_len, d_kv_in={qk.d_k_in}], got "
                         f"shape {tuple(kv.shape)}", where="kv", expected=qk.d_k_in,
                         actual=tuple(kv.shape))
    return {"k": qk.keys(kv), "v": values_heads_first(v, heads, kv)}


def init_attention_cache(params: dict, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty (zero) self-attention cache of ``max_len`` positions, shaped like
    :func:`attention_cache` of a ``[batch, max_len, d_kv_in]`` input (shapes only: nothing is
    computed)."""
    qk, _, _, _ = attention_params(params, "init_attention_cache")
    positive("init_attention_cache", "batch", batch)
    positive("init_attention_cache", "max_len", max_len)
    spec = jax.ShapeDtypeStruct((int(batch), int(max_len), qk.d_k_in), dtype)
    shapes = jax.eval_shape(lambda x: attention_cache(params, x), spec)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def apply_attention_cached(params: dict, x: Array, cfg: AttentionConfig, cache: dict, *,
                           index: int | Array | None = None, mask: Array | None = None,
                           bias: Array | None = None) -> tuple[Array, dict]:
    """Attention of new queries against cached keys and values (autoregressive decoding).

    Two uses:

    * **self-attention** (``index`` given): ``x`` holds the ``n`` tokens at positions
      ``index .. index + n - 1``; their keys and values are written into the cache there, and
      query ``i`` attends to the cached positions ``<= index + i`` (causal; later buffer slots
      are masked). ``index + n`` must not exceed the cache length (``dynamic_update_slice``
      would clamp the write: this cannot be checked on traced indices).
    * **cross-attention** (``index=None``): the cache (from :func:`attention_cache`) is read
      as it is and returned unchanged. It may hold ``batch / g`` rows: sequences
      ``b g .. (b + 1) g - 1`` then share row ``b`` (the ``g`` sample paths drawn for one
      encoder input, Hugging Face's ``num_return_sequences`` order), and their queries are
      stacked against it in one product: ``g`` times less cache memory read per step.

    The result equals :func:`apply_attention` of the whole sequence at those positions (to
    float32 round-off: the logits of the masked slots are ``finfo(float32).min``, whose
    softmax weight is exactly 0).

    Args:
      params: ``{'qk', 'v', 'o', 'heads'}``; the query-key type must implement
        :meth:`~lowrank_jax.QK.keys` / :meth:`~lowrank_jax.QK.logits_from_keys`.
      x: ``[batch, n, d_q_in]``.
      cfg: attention configuration (``qkv_keep`` is not supported here).
      cache: ``{'k', 'v'}`` of :func:`init_attention_cache` or :func:`attention_cache`.
      index: position of ``x``'s first token (int or traced int32 scalar), or ``None``.
      mask: extra boolean mask broadcastable to ``[batch, heads, n, cache length]`` (for
        example the encoder padding in cross-attention; with a shared cache it may also have
        the cache's batch).
      bias: additive bias broadcastable to ``[batch, heads, n, cache length]``
        (:func:`relative_bias` with ``q_offset=index``).

    Returns:
      ``(out [batch, n, d_out], cache)``.
    """
    qk, v, o, heads = attention_params(params, "apply_attention_cached")
    _no_activation_masks(cfg, "apply_attention_cached")
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != qk.d_q_in:
        raise ShapeError(
            f"apply_attention_cached: x must be [batch, n, d_model={qk.d_q_in}], got shape "
            f"{tuple(x.shape)}", where="x", expected=qk.d_q_in, actual=tuple(x.shape))
    if not isinstance(cache, dict) or set(cache) != {"k", "v"}:
        raise ShapeError("apply_attention_cached: cache must be a dict {'k', 'v'} (from "
                         "init_attention_cache or attention_cache)", where="cache",
                         expected=["k", "v"],
                         actual=sorted(cache) if isinstance(cache, dict) else type(cache))
    batch, n, _ = x.shape
    k_len, held = cache["v"].shape[2], cache["k"].shape[0]
    group = batch // held if held and batch % held == 0 else 0
    if held != batch and (index is not None or not group):
        raise ShapeError(
            f"apply_attention_cached: the cache holds {held} sequences, x {batch}"
            + ("" if index is not None else " (a fixed cache may hold a divisor of x's batch)"),
            where="cache", expected=batch, actual=held)
    if index is None and group > 1:
        # Sequences b * group .. (b + 1) * group - 1 share cache row b (samples of one input):
        # their queries are stacked along the query axis, one product per cache row.
        out, _ = apply_attention_cached(params, x.reshape(held, group * n, x.shape[-1]), cfg,
                                        cache, mask=_group_queries(mask, held, group, n),
                                        bias=_group_queries(bias, held, group, n))
        return out.reshape(batch, n, out.shape[-1]), cache
    if index is not None:
        known = known_int(index)
        if known is not None and not 0 <= known <= k_len - n:
            raise ShapeError(f"apply_attention_cached: {n} tokens at index {known} do not fit a "
                             f"cache of {k_len} positions", where="index",
                             expected=f"[0, {k_len - n}]", actual=known)
        new = {"k": qk.keys(x), "v": values_heads_first(v, heads, x)}
        axes = {"k": qk.keys_axis(), "v": 2}  # the positions' axis of each
        cache = {name: write_positions(cache[name], new[name], index, axes[name])
                 for name in ("k", "v")}
        mask = causal_key_mask(index, n, k_len, mask)
    bias, mask = bias_and_mask(bias, mask, heads, (batch, heads.num_heads, n, k_len))
    logits = qk.logits_from_keys(x, cache["k"])  # [b, h, n, k_len]
    return attend(logits, cache["v"], o, heads, bias=bias, mask=mask,
                  values_heads_first=True), cache


__all__ = ["apply_attention_cached", "attention_cache", "init_attention_cache", "known_int",
           "values_heads_first"]
