"""Multi-head attention with T5 relative position bias and fixed Q/K/V activation masks.

An attention block's parameters are ``{'qk', 'v', 'o', 'heads'}``:

* ``qk``: a query-key object (:class:`~lowrank_jax.QueryKey` by default: weight leaves ``q``,
  ``k`` and per-head widths); the logits come from :func:`~lowrank_jax.attention_logits`, so a
  factorization of the joint query-key tensor plugs in without a branch here;
* ``v``, ``o``: ordinary weight leaves (any type), applied with :func:`~lowrank_jax.linear`;
* ``heads``: the static :class:`~lowrank_jax.HeadLayout` (kept head ids, value widths, scale).

Every size is read from these parameters, so each layer of a stack may have its own head count
and widths (structured pruning, per-head truncation). Heads are head-major in the projection
outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import (
    QK,
    Dense,
    HeadLayout,
    LowRank,
    QueryKey,
    attention_logits,
    bias_of,
    head_offsets,
    init_dense,
    keep_inputs,
    keep_outputs,
    linear,
    merge_heads,
    split_heads,
)
from lowrank_jax.leaves.base import Leaf
from lowrank_jax.leaves.channel_masked import ChannelPruned
from lowrank_jax.nn.execution import cpu_chunks
from lowrank_jax.nn.masks import combine_masks, qkv_activation_masks

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# T5 relative position bias.

@dataclasses.dataclass(frozen=True)
class RelativeBiasConfig:
    """T5 relative position bias (Raffel et al. 2020, sec. 2.1; HF ``T5Attention``).

    Attributes:
      num_buckets: number of buckets (shared by both directions when bidirectional).
      max_distance: distances at or beyond this share the last bucket.
      bidirectional: ``True`` for encoders. Decoder stacks always use causal buckets
        (``bidirectional=False``), as Hugging Face does, whatever this field says.
    """

    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True

    def __post_init__(self):
        if not isinstance(self.num_buckets, int) or self.num_buckets < 4:
            raise ConfigError(
                f"RelativeBiasConfig: num_buckets must be an int >= 4, got {self.num_buckets!r}"
            )
        if not isinstance(self.max_distance, int) or self.max_distance <= self.num_buckets // 2:
            raise ConfigError(
                "RelativeBiasConfig: max_distance must be an int > num_buckets // 2 = "
                f"{self.num_buckets // 2} (the log-spaced buckets need room), "
                f"got {self.max_distance!r}"
            )


@functools.partial(jax.jit, static_argnames=("bidirectional", "num_buckets", "max_distance"))
def relative_position_bucket(relative_position: Array, *, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> Array:
    """Bucket of each relative position, exactly as Hugging Face T5 ``_relative_position_bucket``.

    Small distances get one bucket each; larger ones share log-spaced buckets up to
    ``max_distance``; beyond that, the last bucket. Bidirectional: half the buckets for
    positive positions (keys after the query), half for the rest. Causal: only non-positive
    positions are distinguished (positive ones map to bucket 0). The logarithm is taken in
    float32 and truncated toward zero, as in the reference.

    Args:
      relative_position: integer array, ``memory_position - query_position``.
      bidirectional: whether keys after the query are distinguished.
      num_buckets: total number of buckets.
      max_distance: distance from which the last bucket is used.

    Returns:
      int32 array of buckets in ``[0, num_buckets)``, same shape as ``relative_position``.
    """
    rp = jnp.asarray(relative_position).astype(jnp.int32)
    buckets = jnp.zeros_like(rp)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rp > 0).astype(jnp.int32) * num_buckets
        rp = jnp.abs(rp)
    else:
        rp = -jnp.minimum(rp, 0)
    # rp is now in [0, inf). Half of the buckets are exact increments.
    max_exact = num_buckets // 2
    is_small = rp < max_exact
    # The other half are logarithmically bigger bins up to max_distance. jnp.maximum(rp, 1)
    # only avoids log(0) in the branch that is_small discards.
    large = max_exact + (
        jnp.log(jnp.maximum(rp, 1).astype(jnp.float32) / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(is_small, rp, large)


def init_relative_bias(key: Array, cfg: RelativeBiasConfig, num_heads: int, *,
                       std: float = 0.02, dtype=jnp.float32) -> Array:
    """A relative-bias table ``float[num_buckets, num_heads]`` with ``N(0, std^2)`` entries.

    Args:
      key: PRNG key.
      cfg: bucket configuration.
      num_heads: number of attention heads.
      std: standard deviation of the initial entries.

    Returns:
      ``[num_buckets, num_heads]``.
    """
    return std * jax.random.normal(key, (cfg.num_buckets, num_heads), dtype)


def relative_bias(table: Array, q_len: int, k_len: int, cfg: RelativeBiasConfig, *,
                  q_offset: int | Array = 0) -> Array:
    """Additive attention bias from a relative-bias table (HF T5 ``compute_bias``).

    The relative position is ``memory_position - query_position`` with positions
    ``arange(k_len)`` and ``q_offset + arange(q_len)``.

    Args:
      table: ``[num_buckets, heads]``.
      q_len: number of queries.
      k_len: number of keys.
      cfg: bucket configuration (its ``bidirectional`` is used as given).
      q_offset: position of the first query (an int, or a traced scalar in cached decoding,
        where the queries are the tokens at ``index, index + 1, ...`` of a longer sequence).

    Returns:
      ``float[1, heads, q_len, k_len]``.
    """
    table = jnp.asarray(table)
    if table.ndim != 2 or table.shape[0] != cfg.num_buckets:
        raise ShapeError(
            f"relative_bias: table must be [num_buckets={cfg.num_buckets}, heads], "
            f"got shape {tuple(table.shape)}"
        )
    if isinstance(q_offset, (int, np.integer)):
        rel = np.arange(k_len)[None, :] - (int(q_offset) + np.arange(q_len))[:, None]
    else:  # a traced position: [q_len, k_len]
        rel = (jnp.arange(k_len)[None, :]
               - (jnp.asarray(q_offset, jnp.int32) + jnp.arange(q_len))[:, None])
    buckets = relative_position_bucket(
        rel, bidirectional=cfg.bidirectional, num_buckets=cfg.num_buckets,
        max_distance=cfg.max_distance,
    )
    values = table[buckets]  # [q_len, k_len, heads]
    return jnp.transpose(values, (2, 0, 1))[None]  # [1, heads, q_len, k_len]


# ---------------------------------------------------------------------------------------------
# Multi-head attention.

@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What an attention block means; its sizes come from its parameters.

    Attributes:
      use_bias: :func:`init_attention` creates biases on the four projections (BERT/ViT:
        ``True``; T5: ``False``). Parameters with or without biases run either way.
      scaled: :func:`init_attention` sets the logit scale to ``1/sqrt(d_head)`` (``False``:
        1, as T5, which folds the scale into its initialization). The scale is stored in the
        block's :class:`~lowrank_jax.HeadLayout`, so it stays the original one when heads or
        channels are removed later.
      qkv_keep: keep fraction of the fixed Q/K/V activation masks ("Sparse Binary Transformers
        for Multivariate Time Series Modeling", sec. 3.3.1); ``None`` disables them. They need a
        query-key object with per-head query and key activations (:class:`QueryKey`). The
        masks are drawn over the block's *current* widest head: removing channels inside heads
        changes which mask entries the kept channels meet, so channel pruning and fixed
        activation masks do not compose yet (removing whole heads of equal width does).
      qkv_mask_seed: base seed of those masks; layer ``l`` uses ``qkv_mask_seed + l``.
    """

    use_bias: bool = False
    scaled: bool = True
    qkv_keep: float | None = None
    qkv_mask_seed: int = 0

    def __post_init__(self):
        for name in ("use_bias", "scaled"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"AttentionConfig: {name} must be a bool, got "
                                  f"{getattr(self, name)!r}", where=name, expected="bool",
                                  actual=getattr(self, name))
        if self.qkv_keep is not None and not (
            isinstance(self.qkv_keep, (int, float)) and 0.0 < self.qkv_keep <= 1.0
        ):
            raise ConfigError(
                f"AttentionConfig: qkv_keep must be None or in (0, 1], got {self.qkv_keep!r}",
                where="qkv_keep", expected="None or (0, 1]", actual=self.qkv_keep)
        if not isinstance(self.qkv_mask_seed, int):
            raise ConfigError(
                f"AttentionConfig: qkv_mask_seed must be an int, got {self.qkv_mask_seed!r}",
                where="qkv_mask_seed", expected="int", actual=self.qkv_mask_seed)


def _positive(owner: str, name: str, val, allow_none: bool = False) -> None:
    if val is None and allow_none:
        return
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
        raise ConfigError(f"{owner}: {name} must be a positive int, got {val!r}", where=name,
                          expected="int >= 1", actual=val)


def init_attention(key: Array, cfg: AttentionConfig, *, d_model: int, num_heads: int,
                   d_head: int | None = None, d_kv_in: int | None = None,
                   d_v: int | None = None, d_out: int | None = None) -> dict:
    """Dense attention parameters ``{'qk', 'v', 'o', 'heads'}``.

    Args:
      key: PRNG key.
      cfg: attention configuration.
      d_model: width of the queries' input.
      num_heads: number of heads.
      d_head: query/key width per head; default ``d_model // num_heads`` (which must divide).
        ``num_heads * d_head != d_model`` is allowed (T5).
      d_kv_in: width of the keys'/values' input (cross-attention); default ``d_model``.
      d_v: value width per head; default ``d_head``.
      d_out: output width; default ``d_model``.

    Returns:
      ``qk``: :class:`~lowrank_jax.QueryKey` with ``q: [d_model, h*d_head]``,
      ``k: [d_kv_in, h*d_head]``; ``v: [d_kv_in, h*d_v]``; ``o: [h*d_v, d_out]`` (Dense leaves,
      zero biases if ``cfg.use_bias``); ``heads``: ``HeadLayout.uniform(h, d_v, scale)`` with
      ``scale = 1/sqrt(d_head)`` if ``cfg.scaled`` else 1.
    """
    owner = "init_attention"
    _positive(owner, "d_model", d_model)
    _positive(owner, "num_heads", num_heads)
    for name, val in (("d_head", d_head), ("d_kv_in", d_kv_in), ("d_v", d_v), ("d_out", d_out)):
        _positive(owner, name, val, allow_none=True)
    if d_head is None:
        if d_model % num_heads:
            raise ConfigError(
                f"{owner}: num_heads={num_heads} does not divide d_model={d_model}; pass d_head "
                "explicitly for num_heads * d_head != d_model", where="num_heads",
                expected=f"a divisor of {d_model}", actual=num_heads)
        d_head = d_model // num_heads
    d_kv_in = d_model if d_kv_in is None else d_kv_in
    d_v = d_head if d_v is None else d_v
    d_out = d_model if d_out is None else d_out
    kq, kk, kv, ko = jax.random.split(key, 4)
    b = cfg.use_bias
    scale = 1.0 / math.sqrt(d_head) if cfg.scaled else 1.0
    return {
        "qk": QueryKey(q=init_dense(kq, d_model, num_heads * d_head, bias=b),
                       k=init_dense(kk, d_kv_in, num_heads * d_head, bias=b),
                       widths=(d_head,) * num_heads),
        "v": init_dense(kv, d_kv_in, num_heads * d_v, bias=b),
        "o": init_dense(ko, num_heads * d_v, d_out, bias=b),
        "heads": HeadLayout.uniform(num_heads, d_v, scale),
    }


def _check_broadcast(name: str, arr: Array, target: tuple[int, ...], hint: str) -> None:
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


def _select_heads(name: str, arr: Array, ids: tuple[int, ...]) -> Array:
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
    if not isinstance(qk, QK):
        raise ShapeError(f"{where}: 'qk' must be a query-key object (QueryKey, ...), got "
                         f"{type(qk).__name__}", where=f"{where}/qk")
    if not isinstance(heads, HeadLayout):
        raise ShapeError(f"{where}: 'heads' must be a HeadLayout, got {type(heads).__name__}",
                         where=f"{where}/heads")
    if qk.num_heads != heads.num_heads:
        raise ShapeError(f"{where}: the query-key object has {qk.num_heads} heads but the head "
                         f"layout has {heads.num_heads}", where=f"{where}/qk",
                         expected=heads.num_heads, actual=qk.num_heads)
    d_v_out = v.d_out if isinstance(v, Leaf) else np.shape(v)[-1]
    d_o_in = o.d_in if isinstance(o, Leaf) else np.shape(o)[0]
    if d_v_out != heads.d_v or d_o_in != heads.d_v:
        raise ShapeError(
            f"{where}: value widths {heads.v} sum to {heads.d_v}, but 'v' has {d_v_out} outputs "
            f"and 'o' {d_o_in} inputs", where=f"{where}/v", expected=heads.d_v,
            actual=(d_v_out, d_o_in))
    return qk, v, o, heads


def apply_attention(params: dict, x: Array, cfg: AttentionConfig, *, kv: Array | None = None,
                    mask: Array | None = None, bias: Array | None = None,
                    layer_index: int = 0) -> Array:
    """Multi-head (self- or cross-) attention.

    ``softmax(scale * logits + bias) v`` per head, with ``logits`` from the block's query-key
    object and ``scale`` from its head layout. Masked logits are set to ``finfo(float32).min``
    (as Hugging Face T5 does) and the softmax runs in float32. With ``cfg.qkv_keep`` set,
    queries, keys and values of every head are multiplied by the fixed activation masks of
    :func:`~lowrank_jax.nn.qkv_activation_masks` with seed ``cfg.qkv_mask_seed + layer_index``
    ("Sparse Binary Transformers", sec. 3.3.1); the q mask is drawn over ``q_len`` and the k/v
    masks over ``k_len``, each over the widest head.

    Args:
      params: ``{'qk', 'v', 'o', 'heads'}`` (:func:`init_attention`).
      x: queries' input ``[batch, q_len, d_q_in]``.
      cfg: attention configuration.
      kv: keys'/values' input ``[batch, k_len, d_kv_in]`` (cross-attention); default ``x``.
      mask: boolean, ``True`` = may attend, broadcastable to ``[batch, H, q_len, k_len]``.
      bias: additive logit bias broadcastable to ``[batch, H, q_len, k_len]`` (for example
        :func:`relative_bias`). For a mask or bias with a head axis of size ``H > 1``, axis 1
        indexes the model's *original* heads: the block takes the columns of the heads it kept
        (``params['heads'].ids``), so a stack's shared relative-bias table serves layers that
        lost different heads.
      layer_index: static layer number (selects the activation-mask seed).

    Returns:
      ``[batch, q_len, d_out]``.
    """
    qk, v, o, heads = attention_params(params, "apply_attention")
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != qk.d_q_in:
        raise ShapeError(
            f"apply_attention: x must be [batch, q_len, d_model={qk.d_q_in}], got shape "
            f"{tuple(x.shape)}", where="x", expected=qk.d_q_in, actual=tuple(x.shape))
    kv = x if kv is None else jnp.asarray(kv)
    if kv.ndim != 3 or kv.shape[-1] != qk.d_k_in or kv.shape[0] != x.shape[0]:
        raise ShapeError(
            f"apply_attention: kv must be [batch={x.shape[0]}, k_len, d_kv_in={qk.d_k_in}], "
            f"got shape {tuple(kv.shape)}", where="kv", expected=qk.d_k_in,
            actual=tuple(kv.shape))
    batch, q_len, _ = x.shape
    k_len = kv.shape[1]
    bias, mask = _bias_and_mask(bias, mask, heads, (batch, heads.num_heads, q_len, k_len))

    q_mask = k_mask = v_mask = None
    if cfg.qkv_keep is not None:
        if not isinstance(qk, QueryKey):
            raise ConfigError(
                f"apply_attention: qkv_keep needs per-head query and key activations (a "
                f"QueryKey); this block's query-key object is a {type(qk).__name__}",
                where="qkv_keep")
        seed = cfg.qkv_mask_seed + layer_index
        w_qk, w_v = max(qk.widths, default=0), max(heads.v, default=0)
        if w_qk:
            q_mask = qkv_activation_masks(seed, q_len, w_qk, cfg.qkv_keep)["q"]
            k_mask = qkv_activation_masks(seed, k_len, w_qk, cfg.qkv_keep)["k"]
        if w_v:
            v_mask = qkv_activation_masks(seed, k_len, w_v, cfg.qkv_keep)["v"]

    folding = None if cfg.qkv_keep is not None else _fold_factors(qk, v, heads, q_len, k_len)
    if folding is not None:
        return _folded_attention(folding, qk, v, o, heads, x, kv, bias=bias, mask=mask)
    vals = split_heads(linear(v, kv), heads.v)  # [batch, k_len, h, max(w_v)]
    if v_mask is not None:
        vals = vals * v_mask[:, None, :].astype(vals.dtype)
    chunk = batch_chunk(batch, heads.num_heads, q_len, k_len, qk=qk)
    if chunk is None:
        logits = attention_logits(qk, x, kv, q_mask=q_mask, k_mask=k_mask)  # [b, h, q, k]
        return _attend(logits, vals, o, heads, bias=bias, mask=mask)

    # Projections on the whole batch where the query-key type separates them (QK.queries /
    # QK.keys): only the logits, softmax and values run per chunk.
    apart = type(qk).queries is not QK.queries and type(qk).keys is not QK.keys

    def one_chunk(xs):  # logits, softmax and weighted values of `chunk` sequences
        if apart:
            logits = qk.logits_from_queries(xs["q"], xs["k"])
        else:
            logits = attention_logits(qk, xs["x"], xs["kv"], q_mask=q_mask, k_mask=k_mask)
        probs = _probabilities(logits, heads, bias=xs.get("bias", bias),
                               mask=xs.get("mask", mask)).astype(xs["vals"].dtype)
        return jnp.einsum("bhqk,bhkd->bhqd", probs, xs["vals"])  # [chunk, h, q, max(w_v)]

    # Values and the loop's output with the heads leading (as _weighted_values on CPU): each
    # chunk's products are then batched over heads with every operand contiguous per head
    # (1.24x faster at 32 x 197 and 32 x 256 tokens, 1.44x at 8 x 512 than values as
    # [b, k, h, w_v], per chunk of one sequence; the two transposes outside the loop included).
    vals = jnp.swapaxes(vals, 1, 2)  # [batch, h, k_len, max(w_v)]
    if apart:
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


#: :func:`apply_attention` folds the key and value projections into the queries when that
#: executes fewer multiply-adds (:func:`fold_keys`); ``False``: never.
FOLD_KEYS = True


def _factors(w) -> tuple[Array | None, Array, tuple[int, ...] | None] | None:
    """``(u, v, rows)`` with ``W = u @ v`` applied to the inputs at ``rows`` (``None``: all)
    for the weights attention can fold: a :class:`~lowrank_jax.Dense` leaf or a plain weight
    array (``u`` is ``None``, ``W = v``), a :class:`~lowrank_jax.LowRank` leaf, or either
    inside a :class:`~lowrank_jax.leaves.ChannelPruned` that removed input channels only
    (structured pruning's residual-stream rows). Read as they are stored: nothing is computed.
    ``None`` for every other leaf."""
    rows = None
    if type(w) is ChannelPruned:
        if w.cols is not None:
            return None
        rows, w = w.rows, w.base
    if type(w) is Dense:
        return None, w.w, rows
    if type(w) is LowRank:
        return w.u, w.v, rows
    if isinstance(w, Leaf) or np.ndim(w) != 2:
        return None
    return None, jnp.asarray(w), rows


def _projection_flops(w, rows: int) -> int:
    """Multiply-adds of projecting ``rows`` rows through ``w`` (a leaf's own count)."""
    if isinstance(w, Leaf):
        return w.flops(rows)
    return rows * int(np.shape(w)[0]) * int(np.shape(w)[1])


def _fold_flops(factors, width: int) -> tuple[int, int]:
    """``(multiply-adds, d)``: one head's ``width``-vector through ``W^T`` onto the ``d``
    inputs the weight reads (or the other way): ``width * d`` dense, ``(width + d) * r``
    through rank-``r`` factors."""
    u, v, _ = factors
    if u is None:
        return width * int(v.shape[0]), int(v.shape[0])
    return (width + int(u.shape[0])) * int(u.shape[1]), int(u.shape[0])


def fold_keys(params: dict, q_len: int, k_len: int) -> bool:
    """Whether :func:`apply_attention` runs this block with the keys and values folded into
    the queries (see :func:`_folded_attention`) for ``q_len`` queries against ``k_len`` keys.

    Not from any paper: an exact reassociation that pays when few queries meet many keys, such
    as a one-token decoder's cross-attention (Chronos-Bolt decodes a single token against the
    encoder output). Head ``h``'s logits ``(x W^Q_h)(x_kv W^K_h)^T`` are computed as
    ``((x W^Q_h) (W^K_h)^T) x_kv^T``, and its values ``p_h (x_kv W^V_h)`` as
    ``(p_h x_kv) W^V_h``: the ``k_len`` rows of the key and value projections are replaced by
    ``q_len * heads`` vectors of the input's width. A rank-``r`` key or value leaf
    (:class:`~lowrank_jax.LowRank`, ``W = U V``) is folded through its factors, never rebuilt:
    ``((x W^Q_h) V_h^T) U^T`` and ``((p_h x_kv) U) V_h``. Chosen when, per sequence,

        q_len * h * (fold(k) + 2 * k_len * d_kv + fold(v))
          < flops(k, k_len) + flops(v, k_len) + q_len * k_len * h * (w_qk + w_v)

    with ``fold(W) = w * d_kv`` for a dense weight and ``(w + d_kv) * r`` for rank-``r``
    factors (``w`` the widest head), ``flops`` the leaves' own counts of projecting the keys'
    ``k_len`` rows, and ``d_kv`` the input width the weight reads (``2 * k_len * d_kv`` is
    the sum over the key and value weights); for a :class:`~lowrank_jax.QueryKey` whose ``k``
    and the block's ``v`` are dense weights (:class:`~lowrank_jax.Dense` or plain arrays) or
    :class:`~lowrank_jax.LowRank` leaves, bare or inside a
    :class:`~lowrank_jax.leaves.ChannelPruned` that removed input channels only (a
    structurally pruned model's residual-stream rows: the folded vectors then have the kept
    inputs' width), without fixed activation masks.
    Self-attention never qualifies with dense weights (``q_len == k_len`` costs more folded).
    ``FOLD_KEYS = False`` turns it off. The counts of :func:`attention_score_flops`, of the
    leaves and of :func:`lowrank_jax.leaves.count_rows` are those of the projected block.

    Measured (``benchmarks/peak.py``, 2-core AVX-512 CPU, batch 32 x 33 encoder rows): the
    Chronos-Bolt-base decoder took 83-92 ms instead of 224-252 ms, the whole forward 1.07-1.15x
    less time.
    """
    qk, v, _, heads = attention_params(params, "fold_keys")
    return _fold_factors(qk, v, heads, q_len, k_len) is not None


def _fold_factors(qk: QK, v, heads: HeadLayout, q_len: int, k_len: int):
    """The key's and the value's :func:`_factors` where :func:`fold_keys` says fold, else
    ``None``."""
    if not FOLD_KEYS or not isinstance(qk, QueryKey):
        return None
    fk, fv = _factors(qk.k), _factors(v)
    if fk is None or fv is None:
        return None
    h = heads.num_heads
    w_qk, w_v = max(qk.widths, default=0), max(heads.v, default=0)
    (in_k, d_k), (out_v, d_v) = _fold_flops(fk, w_qk), _fold_flops(fv, w_v)
    projected = (_projection_flops(qk.k, k_len) + _projection_flops(v, k_len)
                 + q_len * k_len * h * (w_qk + w_v))
    folded = q_len * h * (in_k + k_len * (d_k + d_v) + out_v)
    return (fk, fv) if folded < projected else None


def _folded_attention(factors, qk: QueryKey, v, o, heads: HeadLayout, x: Array, kv: Array, *,
                      bias, mask) -> Array:
    """:func:`apply_attention` with the key and value projections folded into the queries
    (:func:`fold_keys`; ``factors`` from :func:`_fold_factors`): the same block, reassociated.

    A key bias would add ``q_h . b^K_h`` to all logits of a query alike, which the softmax
    does not see (a masked logit stays ``finfo(float32).min``): it is left out. A value bias is
    added after the weighted sum (every probability row sums to 1, a fully masked row
    included: it is uniform)."""
    (u_k, v_k, rows_k), (u_v, v_v, rows_v) = factors
    kv_k = kv if rows_k is None else kv[..., np.asarray(rows_k, np.int64)]  # inputs it reads
    kv_v = kv if rows_v is None else kv[..., np.asarray(rows_v, np.int64)]
    q = qk.queries(x)  # [b, q_len, h, w_qk]
    lift_k = split_heads(v_k, qk.widths)  # [d_kv or r, h, w_qk], zero-padded
    if u_k is None:
        folded = jnp.einsum("bqhw,dhw->bhqd", q, lift_k)  # [b, h, q_len, d_kv]
    else:
        folded = jnp.einsum("bhqr,dr->bhqd", jnp.einsum("bqhw,rhw->bhqr", q, lift_k), u_k)
    logits = jnp.einsum("bhqd,bkd->bhqk", folded, kv_k)
    probs = _probabilities(logits, heads, bias=bias, mask=mask).astype(kv.dtype)
    # Heads before queries in `mixed`: XLA:CPU (jax 0.10) has no bf16 x bf16 -> f32 kernel for
    # the same product written "bhqk,bkd->bqhd" (bf16_forward failed on it).
    mixed = jnp.einsum("bhqk,bkd->bhqd", probs, kv_v)  # [b, h, q_len, d of v's inputs]
    lift_v = split_heads(v_v, heads.v)  # [d_kv or r, h, w_v]
    if u_v is not None:
        mixed = jnp.einsum("bhqd,dr->bhqr", mixed, u_v)  # [b, h, q_len, r]
    out = jnp.einsum("bhqd,dhw->bqhw", mixed, lift_v)  # [b, q_len, h, w_v]
    if bias_of(v) is not None:
        out = out + split_heads(bias_of(v), heads.v)
    return linear(o, merge_heads(out, heads.v))


#: On CPU, :func:`apply_attention` computes the logits, softmax and weighted values a chunk of
#: the batch at a time when the whole batch's float32 logits would take more than this many
#: bytes (``None``: never) ...
CHUNK_ABOVE_BYTES: int | None = 64 << 20
#: ... or, for a query-key object other than a :class:`~lowrank_jax.QueryKey` (CP-SlimAtt's
#: ``CPQueryKey``, BTD's ``BTDQueryKey``: logits built from shared factors), this many bytes
#: when it is the smaller (``None``: as ``CHUNK_ABOVE_BYTES``) ...
FACTORED_CHUNK_ABOVE_BYTES: int | None = 8 << 20
#: ... in chunks of as many sequences as keep a chunk's logits within this many bytes (at
#: least one sequence; the largest divisor of the batch).
CHUNK_BYTES = 2 << 20


def batch_chunk(batch: int, heads: int, q_len: int, k_len: int, *,
                qk: QK | None = None) -> int | None:
    """Sequences per chunk of :func:`apply_attention` on this backend, or ``None`` (the whole
    batch at once). ``qk``: the block's query-key object (its type picks the threshold;
    ``None``: a :class:`~lowrank_jax.QueryKey`'s).

    Not from any paper: an execution choice for CPUs. The logits ``[batch, H, q, k]`` of a
    large batch do not fit in the caches, and the softmax and the weighted sum then read them
    back from memory; chunk by chunk (``lax.map``) they stay in cache. On a 2-core AVX-512 CPU
    the attention of 32 sequences of 256 tokens with 12 heads of 64 ran 1.9x faster one
    sequence at a time (295 -> 154 ms), 6.5x with heads of rank 6 (194 -> 30 ms); chunks of
    four sequences (12.6 MB of logits) were slower than none (``benchmarks/attention.py``).
    Those figures are with glibc's default ``malloc``, which also maps and unmaps the whole
    batch's logits on every call; with freed memory kept in one arena
    (:func:`lowrank_jax.runtime.keep_freed_memory` with ``one_arena=True``) whole d 768 blocks
    ran 30-50 % faster and chunking gained 1.03-1.25x over them. Since the weighted sum runs
    with the heads leading in both executions (:func:`_weighted_values`), whole blocks are
    1.2-1.4x faster and chunks gain 0.91-1.08x at 8 x 256 tokens, 1.06-1.55x at 32 x 256 and
    0.97-1.01x for a ViT-Base-width encoder on 32 images (two runs, freed memory kept). What
    they still gained then was mostly page faults: glibc maps a block larger than a thread
    arena's 64 MB heap afresh on every call even with freed memory kept, and with tcmalloc
    preloaded (no faults) chunks gained 0.84-1.02x over eight sizes. So since 2026-11-28 the
    threshold is 64 MB (it was 8 MB): with freed memory kept, chunks gain 1.02-1.40x above it
    (32 x 256, 64 x 197, 8 and 16 x 512 tokens) and lost up to 8 % below it (32 x 197: 0.92x,
    4 x 512: 1.06-1.09x is the one size below it they helped); they also hold fewer
    temporaries under differentiation. CP-SlimAtt and BTD query-keys, whose logits are built
    from shared factors with more memory traffic per logit, still gain from the cache: 1.06-1.14x
    at 12-48 MB of logits with freed memory kept and 1.08-1.12x with tcmalloc (d 768, 12
    heads, CP rank 74, BTD term ranks 5 and 14); they keep the 8 MB threshold
    (``FACTORED_CHUNK_ABOVE_BYTES``).
    Off on GPU and TPU (their fused attention kernels need the whole batch), on a CPU backend
    with more than one device (a batch sharded over devices would be gathered onto each:
    :func:`~lowrank_jax.nn.execution.cpu_chunks`) and for ``CHUNK_ABOVE_BYTES = None``. The
    projections run on the whole batch (those of the queries and keys through
    :meth:`~lowrank_jax.QK.queries` / :meth:`~lowrank_jax.QK.keys`; a query-key type without
    them computes its logits, projections included, per chunk). Values are the same up to
    float32 round-off. Read when a function is traced.
    """
    if CHUNK_ABOVE_BYTES is None or not cpu_chunks():
        return None
    above = CHUNK_ABOVE_BYTES
    if qk is not None and not isinstance(qk, QueryKey) and FACTORED_CHUNK_ABOVE_BYTES is not None:
        above = min(above, FACTORED_CHUNK_ABOVE_BYTES)
    per_seq = 4 * heads * q_len * k_len
    if batch <= 1 or batch * per_seq <= above:
        return None
    chunk = max(1, min(batch, CHUNK_BYTES // max(per_seq, 1)))
    while batch % chunk:
        chunk -= 1
    return chunk if chunk < batch else None


def _bias_and_mask(bias, mask, heads: HeadLayout, target: tuple[int, ...]):
    """Check a bias and a mask against ``[batch, heads, q_len, k_len]``; keep the block's
    heads of per-head ones."""
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.ndim == 4:
            bias = _select_heads("bias", bias, heads.ids)
        _check_broadcast("bias", bias, target, "Use relative_bias(...) or a [1, h, q, k] array.")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ShapeError(
                f"apply_attention: mask must be boolean (True = attend), got dtype {mask.dtype}; "
                "pass additive masks as bias=", where="mask", expected="bool",
                actual=str(mask.dtype))
        if mask.ndim == 4:
            mask = _select_heads("mask", mask, heads.ids)
        _check_broadcast("mask", mask, target, "Build masks with padding_mask / causal_mask.")
    return bias, mask


def _attend(logits: Array, vals: Array, o, heads: HeadLayout, *, bias, mask) -> Array:
    """``o(softmax(scale * logits + bias) vals)``: logits ``[b, h, q, k]``, per-head values
    ``[b, k, h, w_v]``; masked logits become ``finfo(float32).min``, softmax in float32."""
    return linear(o, _weighted_values(logits, vals, heads, bias=bias, mask=mask))


def _probabilities(logits: Array, heads: HeadLayout, *, bias, mask) -> Array:
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


def _weighted_values(logits: Array, vals: Array, heads: HeadLayout, *, bias, mask) -> Array:
    """``softmax(scale * logits + bias) vals`` with the heads merged: ``[b, q, sum(w_v)]``.

    On CPU the weighted sum runs with the heads leading (values transposed to ``[b, h, k,
    w_v]``, the product ``[b, h, q, w_v]`` transposed back): every operand of the per-head
    products is then contiguous, 1.3-1.9x faster for the attention core at 32 x 33 (Chronos-Bolt),
    8 x 64, 2 x 256 and 1 x 512 tokens with 12 heads of 64 on a 2-core AVX-512 CPU (the same
    layout as :func:`apply_attention`'s chunks). Other backends keep the einsum as written and
    leave the layout to XLA (not measured there)."""
    probs = _probabilities(logits, heads, bias=bias, mask=mask).astype(vals.dtype)
    if jax.default_backend() == "cpu":
        out = jnp.einsum("bhqk,bhkd->bhqd", probs, jnp.swapaxes(vals, 1, 2))
        out = jnp.swapaxes(out, 1, 2)  # [batch, q_len, h, max(w_v)]
    else:
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, vals)  # [batch, q_len, h, max(w_v)]
    return merge_heads(out, heads.v)  # [batch, q_len, sum(w_v)]


# ---------------------------------------------------------------------------------------------
# Key-value cache (autoregressive decoding).

def _no_activation_masks(cfg: AttentionConfig, owner: str) -> None:
    if cfg.qkv_keep is not None:
        raise ConfigError(
            f"{owner}: fixed Q/K/V activation masks (qkv_keep) are drawn over the whole "
            "sequence length and are not supported in cached decoding; decode without a cache",
            where="qkv_keep", expected=None, actual=cfg.qkv_keep)


def _known_int(index) -> int | None:
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


def attention_cache(params: dict, kv: Array) -> dict:
    """The key-value cache of an attention block for a fixed keys'/values' input (the encoder
    output of a cross-attention): computed once, read at every decoding step.

    Args:
      params: ``{'qk', 'v', 'o', 'heads'}``.
      kv: ``[batch, k_len, d_kv_in]``.

    Returns:
      ``{'k': qk.keys(kv) [batch, k_len, ...], 'v': per-head values [batch, k_len, h, w_v]}``
      (the keys' layout is the query-key type's: per-head keys for a ``QueryKey``, ``R``
      shared coordinates for a CP factorization, ...).
    """
    qk, v, _, heads = attention_params(params, "attention_cache")
    kv = jnp.asarray(kv)
    if kv.ndim != 3 or kv.shape[-1] != qk.d_k_in:
        raise ShapeError(f"attention_cache: kv must be [batch, k_len, d_kv_in={qk.d_k_in}], got "
                         f"shape {tuple(kv.shape)}", where="kv", expected=qk.d_k_in,
                         actual=tuple(kv.shape))
    return {"k": qk.keys(kv), "v": split_heads(linear(v, kv), heads.v)}


def init_attention_cache(params: dict, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty (zero) self-attention cache of ``max_len`` positions, shaped like
    :func:`attention_cache` of a ``[batch, max_len, d_kv_in]`` input (shapes only: nothing is
    computed)."""
    qk, _, _, _ = attention_params(params, "init_attention_cache")
    _positive("init_attention_cache", "batch", batch)
    _positive("init_attention_cache", "max_len", max_len)
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
    k_len, held = cache["k"].shape[1], cache["k"].shape[0]
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
        known = _known_int(index)
        if known is not None and not 0 <= known <= k_len - n:
            raise ShapeError(f"apply_attention_cached: {n} tokens at index {known} do not fit a "
                             f"cache of {k_len} positions", where="index",
                             expected=f"[0, {k_len - n}]", actual=known)
        new = {"k": qk.keys(x), "v": split_heads(linear(v, x), heads.v)}
        cache = {name: jax.lax.dynamic_update_slice_in_dim(
            cache[name], new[name].astype(cache[name].dtype), index, axis=1)
            for name in ("k", "v")}
        pos = jnp.asarray(index, jnp.int32) + jnp.arange(n)  # [n]
        visible = jnp.arange(k_len)[None, :] <= pos[:, None]  # [n, k_len]
        mask = combine_masks(visible[None, None], mask)
    bias, mask = _bias_and_mask(bias, mask, heads, (batch, heads.num_heads, n, k_len))
    logits = qk.logits_from_keys(x, cache["k"])  # [b, h, n, k_len]
    return _attend(logits, cache["v"], o, heads, bias=bias, mask=mask), cache


def attention_score_flops(params: dict, q_len: int, k_len: int) -> int:
    """Multiply-adds of one attention block beyond its projections, per batch element, as
    executed: the logits (:meth:`~lowrank_jax.QK.score_flops`) and the weighted sum of the
    values (``q_len * k_len * h * max(v widths)``). These grow with the square of the sequence
    length and are not part of :func:`lowrank_jax.flops`, which counts weight leaves. Both
    count the block with its keys and values projected, also where :func:`apply_attention`
    folds them into the queries (:func:`fold_keys`) and does less."""
    qk, _, _, heads = attention_params(params, "attention_score_flops")
    return qk.score_flops(q_len, k_len) + int(q_len) * int(k_len) * heads.num_heads * max(
        heads.v, default=0)


def keep_heads(params: dict, idx) -> dict:
    """An attention block restricted to the heads at positions ``idx`` of its layout.

    Physical removal: the query-key object keeps those heads (:meth:`QK.keep_heads`), the value
    projection keeps their output columns and the output projection their input rows; the head
    layout keeps their original ids (for relative-bias tables) and the original scale. The
    result computes exactly what the block computes with the other heads' value (or output)
    weights zeroed.

    Args:
      params: ``{'qk', 'v', 'o', 'heads'}``.
      idx: positions (in the current layout) of the heads to keep, sorted and distinct. Empty
        keeps no head: the block then adds the output projection's bias alone (zeros without
        one), as the block with every value weight zeroed does.
    """
    qk, v, o, heads = attention_params(params, "keep_heads")
    idx = np.asarray(idx, np.int64)
    if idx.ndim != 1 or np.any(np.diff(idx) <= 0) or (idx.size and (
            idx.min() < 0 or idx.max() >= heads.num_heads)):
        raise ShapeError(f"keep_heads: head positions must be sorted, distinct and in "
                         f"[0, {heads.num_heads}), got {idx.tolist()}", where="idx",
                         expected=f"[0, {heads.num_heads})", actual=idx.tolist())
    off = head_offsets(heads.v)
    cols = np.concatenate([np.arange(off[h], off[h + 1]) for h in idx] or
                          [np.zeros(0, np.int64)]).astype(np.int64)
    return {**params, "qk": qk.keep_heads(idx), "v": keep_outputs(v, cols),
            "o": keep_inputs(o, cols), "heads": heads.keep(idx)}


def head_widths(tree, path: str) -> tuple[int, ...] | None:
    """How the weight at ``path`` of ``tree`` splits into heads, from the enclosing attention
    block's parameters (shapes come from the params, never from a config).

    * ``'.../attn/qk/q'`` and ``'.../attn/qk/k'``: the outputs, by the query-key object's
      per-head widths (``QueryKey.widths``);
    * ``'.../attn/v'``: the outputs, by the head layout's value widths;
    * ``'.../attn/o'``: the *inputs*, by the value widths;
    * anything else (or a query-key object without per-head widths): ``None``.
    """
    from lowrank_jax.leaves import get_path

    parts = path.split("/")
    for depth, tail in ((2, ("qk", "q")), (2, ("qk", "k")), (1, ("v",)), (1, ("o",))):
        if len(parts) > depth and tuple(parts[-depth:]) == tail:
            block = get_path(tree, "/".join(parts[:-depth]))
            if not isinstance(block, dict) or not isinstance(block.get("heads"), HeadLayout):
                return None
            if tail[0] == "qk":
                qk = block["qk"]
                return tuple(qk.widths) if isinstance(qk, QueryKey) else None
            return tuple(block["heads"].v)
    return None
