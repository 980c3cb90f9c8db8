"""What the attention block computes: its config, its parameters (``init_attention``), the block
(``apply_attention``), head surgery (``keep_heads``) and its counts.

The parameters and their layout are described in :mod:`lowrank_jax.nn.attention`; how the block
executes is chosen in :mod:`lowrank_jax.nn.execution` and carried out in
:mod:`lowrank_jax.nn.attention.strategies`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import (
    HeadLayout,
    QueryKey,
    attention_logits,
    head_offsets,
    init_dense,
    is_query_key,
    keep_inputs,
    keep_outputs,
    linear,
    split_heads,
)
from lowrank_jax.nn import execution
from lowrank_jax.nn.attention import strategies
from lowrank_jax.nn.attention.core import attend, attention_params, bias_and_mask, positive
from lowrank_jax.nn.masks import qkv_activation_masks

Array = jax.Array


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
    positive(owner, "d_model", d_model)
    positive(owner, "num_heads", num_heads)
    for name, val in (("d_head", d_head), ("d_kv_in", d_kv_in), ("d_v", d_v), ("d_out", d_out)):
        positive(owner, name, val, allow_none=True)
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

    How it runs (keys folded into few queries, the projections that read the same input as
    one product, a CPU batch in chunks, the weighted sum's layout) is decided by
    :mod:`lowrank_jax.nn.execution` from the execution settings
    (:func:`lowrank_jax.execution.settings`); the result is the same up to float round-off.
    """
    qk, v, o, heads = attention_params(params, "apply_attention")
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != qk.d_q_in:
        raise ShapeError(
            f"apply_attention: x must be [batch, q_len, d_model={qk.d_q_in}], got shape "
            f"{tuple(x.shape)}", where="x", expected=qk.d_q_in, actual=tuple(x.shape))
    self_attention = kv is None or kv is x
    kv = x if kv is None else jnp.asarray(kv)
    if kv.ndim != 3 or kv.shape[-1] != qk.d_k_in or kv.shape[0] != x.shape[0]:
        raise ShapeError(
            f"apply_attention: kv must be [batch={x.shape[0]}, k_len, d_kv_in={qk.d_k_in}], "
            f"got shape {tuple(kv.shape)}", where="kv", expected=qk.d_k_in,
            actual=tuple(kv.shape))
    batch, q_len, _ = x.shape
    k_len = kv.shape[1]
    bias, mask = bias_and_mask(bias, mask, heads, (batch, heads.num_heads, q_len, k_len))

    q_mask = k_mask = v_mask = None
    if cfg.qkv_keep is not None:
        proj = qk.projections()
        if proj is None:
            raise ConfigError(
                f"apply_attention: qkv_keep needs per-head query and key activations (a "
                f"query-key object with projections(), such as QueryKey); this block's "
                f"query-key object is a {type(qk).__name__}", where="qkv_keep")
        seed = cfg.qkv_mask_seed + layer_index
        w_qk, w_v = max(proj.widths, default=0), max(heads.v, default=0)
        if w_qk:
            q_mask = qkv_activation_masks(seed, q_len, w_qk, cfg.qkv_keep)["q"]
            k_mask = qkv_activation_masks(seed, k_len, w_qk, cfg.qkv_keep)["k"]
        if w_v:
            v_mask = qkv_activation_masks(seed, k_len, w_v, cfg.qkv_keep)["v"]

    plan = None if cfg.qkv_keep is not None else execution.fold_plan(qk, v, heads, q_len, k_len)
    if plan is not None:
        return strategies.folded(plan, qk, o, heads, x, kv, bias=bias, mask=mask)
    proj = qk.projections()
    if proj is not None:  # q, k, v (or k, v) as one product where execution says so
        flat = execution.shared_input(
            [proj.q, proj.k, v] if self_attention else [proj.k, v], x if self_attention else kv)
        if flat is not None:
            return strategies.shared_input(flat, qk, o, heads, x, bias=bias, mask=mask,
                                           q_mask=q_mask, k_mask=k_mask, v_mask=v_mask)
    vals = split_heads(linear(v, kv), heads.v)  # [batch, k_len, h, max(w_v)]
    if v_mask is not None:
        vals = vals * v_mask[:, None, :].astype(vals.dtype)
    chunk = execution.batch_chunk(batch, heads.num_heads, q_len, k_len,
                                  factored=qk.projections() is None)
    if chunk is not None:
        return strategies.chunked(chunk, qk, vals, o, heads, x, kv, bias=bias, mask=mask,
                                  q_mask=q_mask, k_mask=k_mask)
    logits = attention_logits(qk, x, kv, q_mask=q_mask, k_mask=k_mask)  # [b, h, q, k]
    return attend(logits, vals, o, heads, bias=bias, mask=mask)


def fold_keys(params: dict, q_len: int, k_len: int) -> bool:
    """Whether :func:`apply_attention` runs this block with the keys and values folded into
    the queries for ``q_len`` queries against ``k_len`` keys, under the active execution
    settings (the decision and its cost model: :func:`lowrank_jax.nn.execution.fold_plan`).
    The counts of :func:`attention_score_flops`, of the leaves and of
    :func:`lowrank_jax.leaves.count_rows` are those of the projected block."""
    qk, v, _, heads = attention_params(params, "fold_keys")
    return execution.fold_plan(qk, v, heads, q_len, k_len) is not None


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
    * in a grouped-query block (:mod:`lowrank_jax.nn.attention.grouped`): ``q`` and ``o``
      by its query heads, ``k`` and ``v`` by its key-value heads;
    * anything else (or a query-key object without per-head widths): ``None``.
    """
    from lowrank_jax.leaves import get_path
    from lowrank_jax.nn.attention.grouped import grouped_head_widths, is_grouped_block

    parts = path.split("/")
    for depth, tail in ((2, ("qk", "q")), (2, ("qk", "k")), (1, ("v",)), (1, ("o",))):
        if len(parts) > depth and tuple(parts[-depth:]) == tail:
            block = get_path(tree, "/".join(parts[:-depth]))
            if is_grouped_block(block):  # grouped-query: q, o by query heads; k, v by kv heads
                return grouped_head_widths(block, tail)
            if not isinstance(block, dict) or not isinstance(block.get("heads"), HeadLayout):
                return None
            if tail[0] == "qk":
                proj = block["qk"].projections() if is_query_key(block["qk"]) else None
                return None if proj is None else tuple(proj.widths)
            return tuple(block["heads"].v)
    return None


__all__ = ["AttentionConfig", "apply_attention", "attention_score_flops", "fold_keys",
           "head_widths", "init_attention", "keep_heads"]
