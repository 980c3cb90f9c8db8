"""A key-value cache that gets smaller with low-rank compression (cached decoding).

A value projection stored as factors ``W_v = U_v V_v`` (a low-rank leaf,
:meth:`~lowrank_jax.leaves.Leaf.factors`) lets the cache keep ``x U_v`` (``r`` numbers per token)
instead of the values (``heads * w``): head ``h``'s output is
``sum_k p_hk (x_k U_v V_v,h + b_h) = (sum_k p_hk x_k U_v) V_v,h + b_h``, since every row of
probabilities sums to 1. Likewise low-rank keys ``W_k = U_k V_k`` of an ordinary block (GPT-2,
no rotary embeddings): the query is folded through ``V_k`` (``q_h V_k,h^T``, ``r`` numbers) and
the cache keeps ``x U_k``; the key bias adds ``q_h . b_k,h`` to every logit of a query alike,
which the softmax does not see, so it is left out. Both are exact reassociations (equal to the
full cache to float32 round-off).

With rotary embeddings (Llama-style blocks) the key factor cannot be folded: the rotation
``R(p)`` sits between ``V_k`` and the product (``q_h^T R(p' - p) (x U_k V_k,h)^T`` depends on
the key position through ``R``), so those blocks keep full rotated keys and compress the
values alone.

A layer's factored cache is a dict with, per side, either the full entry (``'k'``: what the
query-key object's :meth:`~lowrank_jax.QK.keys` returns, ``'v'``: per-head values ``[batch,
heads, max_len, w]``, as in :func:`~lowrank_jax.nn.init_attention_cache`) or the factored one
(``'ku'``, ``'vu'``: ``[batch, max_len, r]``); a side is factored when its weight has factors
of rank below its output width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import factors, linear, merge_heads, split_heads, weight_shape
from lowrank_jax.nn.attention.cache import values_heads_first
from lowrank_jax.nn.attention.core import (
    attention_params,
    causal_key_mask,
    probabilities,
    write_positions,
)
from lowrank_jax.nn.attention.grouped import (
    GroupedAttentionConfig,
    _attend,
    _grouped_probs,
    _project,
    _ungroup,
    grouped_params,
    heads_major,
    is_grouped_block,
    kv_index,
)

Array = jax.Array


def _low_rank(w):
    """The factors of ``w`` when caching ``x U`` is smaller than caching ``x W``."""
    f = factors(w)
    if f is None or f.first is None:
        return None
    return f if int(np.shape(f.second)[0]) < weight_shape(w)[-1] else None


def _reads(x: Array, f) -> Array:
    return x if f.rows is None else x[..., np.asarray(f.rows, np.int64)]


def factored_sides(params: dict) -> dict:
    """``{'k': Factors or None, 'v': Factors or None}``: which sides of a block's cache are
    kept factored (keys never for a grouped block with rotary embeddings)."""
    if is_grouped_block(params):
        _, _, v, _, _, _, _ = grouped_params(params, "factored_sides")
        return {"k": None, "v": _low_rank(v)}
    qk, v, _, _ = attention_params(params, "factored_sides")
    proj = qk.projections()
    return {"k": None if proj is None else _low_rank(proj.k), "v": _low_rank(v)}


def init_factored_cache(params: dict, batch: int, max_len: int, *, rotary: bool = False,
                        dtype=jnp.float32) -> dict:
    """An empty factored cache of one block (module docstring)."""
    sides = factored_sides(params)
    if is_grouped_block(params):
        _, _, _, _, _, kvh, w = grouped_params(params, "init_factored_cache")
        full = (int(batch), kvh.num_heads, int(max_len), w)
        out = {"k": jnp.zeros(full, dtype)}
        if sides["v"] is None:
            out["v"] = jnp.zeros(full, dtype)
        else:
            out["vu"] = jnp.zeros((int(batch), int(max_len), np.shape(sides["v"].second)[0]),
                                  dtype)
        return out
    del rotary
    qk, _, _, heads = attention_params(params, "init_factored_cache")
    out = {}
    if sides["k"] is None:
        spec = jax.ShapeDtypeStruct((int(batch), int(max_len), qk.d_k_in), dtype)
        out["k"] = jnp.zeros(jax.eval_shape(qk.keys, spec).shape, dtype)
    else:
        out["ku"] = jnp.zeros((int(batch), int(max_len), np.shape(sides["k"].second)[0]), dtype)
    if sides["v"] is None:
        out["v"] = jnp.zeros((int(batch), heads.num_heads, int(max_len),
                              max(heads.v, default=0)), dtype)
    else:
        out["vu"] = jnp.zeros((int(batch), int(max_len), np.shape(sides["v"].second)[0]), dtype)
    return out


def cache_bytes_per_token(cache: dict, max_len: int) -> int:
    """Bytes one token takes in a layer's cache (full or factored) of ``max_len`` positions:
    the sum over its entries of ``size * itemsize / (batch * max_len)``, whatever the entry's
    layout (positions second in ``[batch, max_len, ...]`` entries, third in per-head
    ``[batch, heads, max_len, w]`` ones)."""
    out = 0
    for name, a in cache.items():
        shape = tuple(int(s) for s in a.shape)
        if len(shape) < 2 or int(max_len) not in shape[1:]:
            raise ShapeError(f"cache_bytes_per_token: entry {name!r} of shape {shape} has no "
                             f"axis of {max_len} positions", where=name, expected=max_len,
                             actual=shape)
        out += int(np.prod(shape)) // (shape[0] * int(max_len)) * jnp.dtype(a.dtype).itemsize
    return out


def _values_out(probs: Array, cache: dict, fv, v_widths) -> Array:
    """Weighted values ``[b, n, H, w]`` from the cache: probabilities ``[b, H, n, k]``."""
    if fv is None:
        return jnp.einsum("bhnk,bhkw->bnhw", probs, cache["v"].astype(probs.dtype))
    mixed = jnp.einsum("bhnk,bkr->bnhr", probs, cache["vu"].astype(probs.dtype))
    lift = split_heads(fv.second, v_widths)  # [r, H, w]
    out = jnp.einsum("bnhr,rhw->bnhw", mixed, lift)
    return out if fv.bias is None else out + split_heads(fv.bias, v_widths)


def apply_attention_factored(params: dict, x: Array, cfg, cache: dict, *, index,
                             mask: Array | None = None, positions: Array | None = None
                             ) -> tuple[Array, dict]:
    """Attention of ``n`` new tokens against a factored cache (module docstring); equals
    :func:`~lowrank_jax.nn.apply_attention_cached` (ordinary blocks) or
    :func:`~lowrank_jax.nn.attention.grouped.apply_grouped_attention_cached` (grouped blocks,
    ``cfg`` a :class:`GroupedAttentionConfig`, ``positions`` given) on the full cache.

    Returns:
      ``(out [batch, n, d_out], cache)``.
    """
    sides = factored_sides(params)
    n = x.shape[1]
    if is_grouped_block(params):
        if not isinstance(cfg, GroupedAttentionConfig):
            raise ConfigError("apply_attention_factored: a grouped block needs its "
                              "GroupedAttentionConfig", where="cfg",
                              expected="GroupedAttentionConfig", actual=type(cfg).__name__)
        _, _, _, o, qh, kvh, w = grouped_params(params)
        qs, ks, vs = _project(params, cfg, x, positions)
        cache = _write(cache, "k", heads_major(ks), index, 2)
        fv = sides["v"]
        cache = (_write(cache, "v", heads_major(vs), index, 2) if fv is None
                 else _write(cache, "vu", linear_first(x, fv), index, 1))
        mask = causal_key_mask(index, n, cache["k"].shape[2], mask)
        idx = kv_index(qh, kvh, cfg.group)
        if fv is None:
            return linear(o, _attend(qs, cache["k"], cache["v"], idx, qh, mask)), cache
        probs, used = _grouped_probs(qs, cache["k"], idx, qh, mask)  # [b, g, r * n, k]
        b, g, m, k_len = probs.shape
        mixed = (probs.reshape(b, g * m, k_len) @ cache["vu"].astype(probs.dtype))
        lift = split_heads(fv.second, kvh.v)  # [rank, G, w]
        bias = None if fv.bias is None else split_heads(fv.bias, kvh.v)  # [G, w]
        if used is not None:
            lift = lift[:, used]
            bias = None if bias is None else bias[used]
        out = jnp.einsum("bgmr,rgw->bgmw", mixed.reshape(b, g, m, -1), lift)
        if bias is not None:
            out = out + bias[None, :, None, :]
        return linear(o, _ungroup(out, n)), cache
    qk, v, o, heads = attention_params(params, "apply_attention_factored")
    proj = qk.projections()
    q = qk.queries(x)  # [b, n, H, w]
    fk, fv = sides["k"], sides["v"]
    if fk is None:
        cache = _write(cache, "k", qk.keys(x), index, qk.keys_axis())
        logits = qk.logits_from_queries(q, cache["k"])
    else:
        cache = _write(cache, "ku", linear_first(x, fk), index, 1)
        fold = jnp.einsum("bnhw,rhw->bhnr", q, split_heads(fk.second, proj.widths))
        logits = jnp.einsum("bhnr,bkr->bhnk", fold, cache["ku"])
    cache = (_write(cache, "v", values_heads_first(v, heads, x), index, 2) if fv is None
             else _write(cache, "vu", linear_first(x, fv), index, 1))
    k_len = logits.shape[-1]
    probs = probabilities(logits, heads, bias=None, mask=causal_key_mask(index, n, k_len, mask))
    out = _values_out(probs, cache, fv, heads.v)
    return linear(o, merge_heads(out, heads.v)), cache


def _write(cache: dict, name: str, new: Array, index, axis: int) -> dict:
    """``cache`` with ``new`` written into entry ``name`` (see ``write_positions``)."""
    return {**cache, name: write_positions(cache[name], new, index, axis)}


def linear_first(x: Array, f) -> Array:
    """``x[..., rows] @ first``: what a factored cache keeps of ``x`` (``[..., r]``)."""
    return _reads(x, f) @ f.first.astype(x.dtype)


__all__ = ["apply_attention_factored", "cache_bytes_per_token", "factored_sides",
           "init_factored_cache", "linear_first"]
