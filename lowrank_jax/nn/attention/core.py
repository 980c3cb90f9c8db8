"""What every execution of attention shares: the block's parameters, masks and biases, the
softmax and the weighted sum of the values.

The strategies (:mod:`lowrank_jax.nn.attention.strategies`) and cached decoding
(:mod:`lowrank_jax.nn.attention.cache`) are built on these functions, so that they compute the
block :func:`lowrank_jax.nn.apply_attention` defines.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import QK, HeadLayout, is_query_key, linear, merge_heads, weight_shape
from lowrank_jax.nn import execution
from lowrank_jax.nn.masks import combine_masks

Array = jax.Array


def positive(owner: str, name: str, val, allow_none: bool = False) -> None:
    if val is None and allow_none:
        return
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
        raise ConfigError(f"{owner}: {name} must be a positive int, got {val!r}", where=name,
                          expected="int >= 1", actual=val)


def check_broadcast(name: str, arr: Array, target: tuple[int, ...], hint: str) -> None:
    shape = tuple(arr.shape)
    ok = len(shape) == len(target)
    if ok:
        try:
            ok = np.broadcast_shapes(shape, target) == target
        except ValueError:
            ok = False
    if not ok:
        raise ShapeError(
            f"apply_attention: {name} must be 4-D and broadcastable to "
            f"[batch, heads, q_len, k_len] = {list(target)}, got shape {list(shape)}. {hint}",
            where=name, expected=list(target), actual=list(shape))


def select_heads(name: str, arr: Array, ids: tuple[int, ...]) -> Array:
    """A per-head mask or bias is indexed by *original* head: keep the block's heads."""
    n = arr.shape[1]
    if n == 1 or ids == tuple(range(n)):
        return arr
    if max(ids, default=-1) >= n:
        raise ShapeError(
            f"apply_attention: {name} has {n} heads on axis 1, but the block keeps original "
            f"heads {ids}; pass a per-head {name} over the model's original heads (or one "
            "shared by all heads)", where=name, expected=f"> {max(ids)}", actual=n)
    return arr[:, np.asarray(ids, np.int64)]  # int64 also when no head is kept


def attention_params(params: dict, where: str = "attention") -> tuple[QK, object, object,
                                                                      HeadLayout]:
    """``(qk, v, o, heads)`` of an attention block, checked for consistency."""
    if not isinstance(params, dict) or not {"qk", "v", "o", "heads"} <= set(params):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ShapeError(
            f"{where}: attention parameters must be a dict with 'qk', 'v', 'o' and 'heads' "
            f"(from init_attention), got {got}. Parameter trees of lowrank_jax 0.1 ('q', 'k', "
            "'v', 'o') are upgraded by lowrank_jax.io.load_model (model checkpoints) or "
            "lowrank_jax.io.upgrade_attention (bare parameter trees)",
            where=where, expected=["heads", "o", "qk", "v"], actual=got)
    qk, v, o, heads = params["qk"], params["v"], params["o"], params["heads"]
    if not is_query_key(qk):
        raise ShapeError(f"{where}: 'qk' must be a query-key object (QueryKey, ...), got "
                         f"{type(qk).__name__}", where=f"{where}/qk")
    if not isinstance(heads, HeadLayout):
        raise ShapeError(f"{where}: 'heads' must be a HeadLayout, got {type(heads).__name__}",
                         where=f"{where}/heads")
    if qk.num_heads != heads.num_heads:
        raise ShapeError(f"{where}: the query-key object has {qk.num_heads} heads but the head "
                         f"layout has {heads.num_heads}", where=f"{where}/qk",
                         expected=heads.num_heads, actual=qk.num_heads)
    d_v_out, d_o_in = weight_shape(v)[-1], weight_shape(o)[0]
    if d_v_out != heads.d_v or d_o_in != heads.d_v:
        raise ShapeError(
            f"{where}: value widths {heads.v} sum to {heads.d_v}, but 'v' has {d_v_out} outputs "
            f"and 'o' {d_o_in} inputs", where=f"{where}/v", expected=heads.d_v,
            actual=(d_v_out, d_o_in))
    return qk, v, o, heads


def bias_and_mask(bias, mask, heads: HeadLayout, target: tuple[int, ...]):
    """Check a bias and a mask against ``[batch, heads, q_len, k_len]``; keep the block's
    heads of per-head ones."""
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.ndim == 4:
            bias = select_heads("bias", bias, heads.ids)
        check_broadcast("bias", bias, target, "Use relative_bias(...) or a [1, h, q, k] array.")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ShapeError(
                f"apply_attention: mask must be boolean (True = attend), got dtype {mask.dtype}; "
                "pass additive masks as bias=", where="mask", expected="bool",
                actual=str(mask.dtype))
        if mask.ndim == 4:
            mask = select_heads("mask", mask, heads.ids)
        check_broadcast("mask", mask, target, "Build masks with padding_mask / causal_mask.")
    return bias, mask


def attend(logits: Array, vals: Array, o, heads: HeadLayout, *, bias, mask,
           values_heads_first: bool = False) -> Array:
    """``o(softmax(scale * logits + bias) vals)``: logits ``[b, h, q, k]``, per-head values
    ``[b, k, h, w_v]`` (``[b, h, k, w_v]`` with ``values_heads_first``, the layout of a
    key-value cache); masked logits become ``finfo(float32).min``, softmax in float32."""
    return linear(o, weighted_values(logits, vals, heads, bias=bias, mask=mask,
                                     values_heads_first=values_heads_first))


def probabilities(logits: Array, heads: HeadLayout, *, bias, mask) -> Array:
    """``softmax(scale * logits + bias)`` in float32, masked logits ``finfo(float32).min``:
    ``[b, h, q, k]``."""
    logits = logits.astype(jnp.float32)
    if heads.scale != 1.0:
        logits = logits * np.float32(heads.scale)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1)


def weighted_values(logits: Array, vals: Array, heads: HeadLayout, *, bias, mask,
                    values_heads_first: bool = False) -> Array:
    """``softmax(scale * logits + bias) vals`` with the heads merged: ``[b, q, sum(w_v)]``.

    ``vals`` is ``[b, k, h, w_v]``, or ``[b, h, k, w_v]`` with ``values_heads_first`` (a
    key-value cache's layout, read as it is stored). Where
    :func:`lowrank_jax.nn.execution.heads_first` says so (CPU by default) the weighted sum runs
    with the heads leading (values ``[b, k, h, w_v]`` transposed to ``[b, h, k, w_v]``, the
    product ``[b, h, q, w_v]`` transposed back), the layout of the chunked strategy."""
    probs = probabilities(logits, heads, bias=bias, mask=mask).astype(vals.dtype)
    if not values_heads_first and execution.heads_first():
        vals, values_heads_first = jnp.swapaxes(vals, 1, 2), True
    if values_heads_first:  # the product batched over (batch, heads), transposed back
        out = jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", probs, vals), 1, 2)
    else:
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, vals)
    # out: [batch, q_len, h, max(w_v)]
    return merge_heads(out, heads.v)  # [batch, q_len, sum(w_v)]


# ---------------------------------------------------------------------------------------------
# Cached decoding: the one write into a key-value buffer and the one causal mask over it, shared
# by the ordinary, grouped-query and factored caches.


def write_positions(buf: Array, new: Array, index, axis: int) -> Array:
    """``new`` written into ``buf`` at positions ``index .. index + n - 1`` of ``axis`` (``n =
    new.shape[axis]``), cast to ``buf``'s dtype; in place inside a compiled loop
    (``dynamic_update_slice``)."""
    return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), index, axis=axis)


def causal_key_mask(index, n: int, k_len: int, mask: Array | None) -> Array:
    """Boolean ``[batch or 1, 1, n, k_len]``: query ``i`` (buffer position ``index + i``) sees
    the positions ``<= index + i`` that ``mask`` (boolean, broadcastable; padding ``False``)
    allows."""
    pos = jnp.asarray(index, jnp.int32) + jnp.arange(n)  # [n]
    visible = (jnp.arange(k_len)[None, :] <= pos[:, None])[None, None]  # [1, 1, n, k_len]
    return combine_masks(visible, mask)


__all__ = ["attend", "attention_params", "bias_and_mask", "causal_key_mask", "check_broadcast",
           "positive", "probabilities", "select_heads", "weighted_values", "write_positions"]
