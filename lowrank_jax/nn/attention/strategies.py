"""Ways to execute the attention block other than the plain one: keys and values folded into
the queries, the projections that read the same input as one product, and the batch a chunk
at a time.

Each computes exactly the block :func:`lowrank_jax.nn.apply_attention` defines (up to float
round-off); which one runs is decided by :mod:`lowrank_jax.nn.execution` from the execution
settings (:mod:`lowrank_jax.execution`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.leaves import HeadLayout, attention_logits, linear, merge_heads, split_heads
from lowrank_jax.nn import execution
from lowrank_jax.nn.attention.core import attend, probabilities

Array = jax.Array


def folded(plan, qk, o, heads: HeadLayout, x: Array, kv: Array, *, bias, mask) -> Array:
    """The block with the key and value projections folded into the queries
    (:func:`lowrank_jax.nn.execution.fold_plan`; ``plan`` its key and value
    :class:`~lowrank_jax.leaves.Factors`): the same block, reassociated.

    A key bias would add ``q_h . b^K_h`` to all logits of a query alike, which the softmax
    does not see (a masked logit stays ``finfo(float32).min``): it is left out. A value bias is
    added after the weighted sum (every probability row sums to 1, a fully masked row
    included: it is uniform)."""
    fk, fv = plan
    widths = qk.projections().widths
    kv_k = kv if fk.rows is None else kv[..., np.asarray(fk.rows, np.int64)]  # inputs it reads
    kv_v = kv if fv.rows is None else kv[..., np.asarray(fv.rows, np.int64)]
    q = qk.queries(x)  # [b, q_len, h, w_qk]
    lift_k = split_heads(fk.second, widths)  # [d_kv or r, h, w_qk], zero-padded
    if fk.first is None:
        fold = jnp.einsum("bqhw,dhw->bhqd", q, lift_k)  # [b, h, q_len, d_kv]
    else:
        fold = jnp.einsum("bhqr,dr->bhqd", jnp.einsum("bqhw,rhw->bhqr", q, lift_k), fk.first)
    logits = jnp.einsum("bhqd,bkd->bhqk", fold, kv_k)
    probs = probabilities(logits, heads, bias=bias, mask=mask).astype(kv.dtype)
    # Heads before queries in `mixed`: XLA:CPU (jax 0.10) has no bf16 x bf16 -> f32 kernel for
    # the same product written "bhqk,bkd->bqhd" (bf16_forward failed on it).
    mixed = jnp.einsum("bhqk,bkd->bhqd", probs, kv_v)  # [b, h, q_len, d of v's inputs]
    lift_v = split_heads(fv.second, heads.v)  # [d_kv or r, h, w_v]
    if fv.first is not None:
        mixed = jnp.einsum("bhqd,dr->bhqr", mixed, fv.first)  # [b, h, q_len, r]
    out = jnp.einsum("bhqd,dhw->bqhw", mixed, lift_v)  # [b, q_len, h, w_v]
    if fv.bias is not None:
        out = out + split_heads(fv.bias, heads.v)
    return linear(o, merge_heads(out, heads.v))


def shared_input(flat: list, qk, o, heads: HeadLayout, x: Array, *, bias, mask, q_mask,
                 k_mask, v_mask) -> Array:
    """The block from projections computed together (:func:`lowrank_jax.nn.execution.shared_input`):
    ``flat`` is ``[x q, x k, x v]`` (self-attention) or ``[kv k, kv v]`` (cross-attention: the
    queries are projected here), each ``[batch, len, width]``.

    The separable per-head form (:class:`lowrank_jax.leaves.Projections`) defines the rest:
    per-head queries and keys are the projections split by head widths (times the fixed
    activation masks), head ``h``'s logits their dot products; then the softmax and the
    weighted sum as in the plain block, a chunk of the batch at a time where
    :func:`lowrank_jax.nn.execution.batch_chunk` says so."""
    widths = qk.projections().widths
    if len(flat) == 3:
        q = split_heads(flat[0], widths)  # [b, q_len, h, w_qk]
        if q_mask is not None:
            q = q * q_mask[:, None, :].astype(q.dtype)
    else:
        q = qk.queries(x, q_mask=q_mask)
    k = split_heads(flat[-2], widths)  # [b, k_len, h, w_qk]
    if k_mask is not None:
        k = k * k_mask[:, None, :].astype(k.dtype)
    vals = split_heads(flat[-1], heads.v)  # [b, k_len, h, max(w_v)]
    if v_mask is not None:
        vals = vals * v_mask[:, None, :].astype(vals.dtype)
    batch, q_len, k_len = x.shape[0], q.shape[1], k.shape[1]
    chunk = execution.batch_chunk(batch, heads.num_heads, q_len, k_len)
    if chunk is not None:
        return chunked(chunk, qk, vals, o, heads, x, None, bias=bias, mask=mask, q_mask=None,
                       k_mask=None, projected=(q, k))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    return attend(logits, vals, o, heads, bias=bias, mask=mask)


def chunked(chunk: int, qk, vals: Array, o, heads: HeadLayout, x: Array, kv: Array, *,
            bias, mask, q_mask, k_mask, projected=None) -> Array:
    """The block ``chunk`` sequences at a time (:func:`lowrank_jax.nn.execution.batch_chunk`):
    logits, softmax and weighted values per chunk (``lax.map``), the projections on the whole
    batch where the query-key object separates them (:meth:`lowrank_jax.QK.separable`).

    ``vals``: the per-head values ``[batch, k_len, h, max(w_v)]`` (activation mask applied).
    ``projected``: per-head queries and keys of the separable per-head form already computed
    (:func:`shared_input`; masks applied), whose logits are their dot products.
    """
    batch = x.shape[0]
    apart = projected is not None or qk.separable()

    def one_chunk(xs):  # logits, softmax and weighted values of `chunk` sequences
        if projected is not None:
            logits = jnp.einsum("bqhd,bkhd->bhqk", xs["q"], xs["k"])
        elif apart:
            logits = qk.logits_from_queries(xs["q"], xs["k"])
        else:
            logits = attention_logits(qk, xs["x"], xs["kv"], q_mask=q_mask, k_mask=k_mask)
        probs = probabilities(logits, heads, bias=xs.get("bias", bias),
                              mask=xs.get("mask", mask)).astype(xs["vals"].dtype)
        return jnp.einsum("bhqk,bhkd->bhqd", probs, xs["vals"])  # [chunk, h, q, max(w_v)]

    # Values and the loop's output with the heads leading (as weighted_values on CPU): each
    # chunk's products are then batched over heads with every operand contiguous per head
    # (1.24x faster at 32 x 197 and 32 x 256 tokens, 1.44x at 8 x 512 than values as
    # [b, k, h, w_v], per chunk of one sequence; the two transposes outside the loop included).
    vals = jnp.swapaxes(vals, 1, 2)  # [batch, h, k_len, max(w_v)]
    if projected is not None:
        xs = {"q": projected[0], "k": projected[1], "vals": vals}
    elif apart:
        xs = {"q": qk.queries(x, q_mask=q_mask), "k": qk.keys(kv, k_mask=k_mask), "vals": vals}
    else:
        xs = {"x": x, "kv": kv, "vals": vals}
    for name, arr in (("bias", bias), ("mask", mask)):
        if arr is not None and arr.ndim == 4 and arr.shape[0] == batch:
            xs[name] = arr  # per sequence: chunked with the inputs; else shared by all chunks
    xs = {k: a.reshape(batch // chunk, chunk, *a.shape[1:]) for k, a in xs.items()}
    # Under differentiation each chunk is recomputed in the backward pass (jax.checkpoint):
    # its probabilities are not stored for the whole batch (54 % fewer temporaries, and the
    # gradient as fast as unchunked at 32 x 256 tokens instead of 7 % slower).
    out = jax.lax.map(jax.checkpoint(one_chunk), xs)  # [batch / chunk, chunk, h, q, w_v]
    out = jnp.swapaxes(out.reshape(batch, *out.shape[2:]), 1, 2)  # [batch, q, h, max(w_v)]
    return linear(o, merge_heads(out, heads.v))


__all__ = ["chunked", "folded", "shared_input"]
