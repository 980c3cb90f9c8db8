"""Grouped-query causal self-attention with rotary position embeddings (Llama-style blocks).

Grouped-query attention ("GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints", arXiv:2305.13245) lets ``group`` query heads share one key head and one
value head. The block's parameters::

    {'qk': {'q': leaf [d, H * w], 'k': leaf [d, G * w]},   # weight leaves (any type)
     'v': leaf [d, G * w], 'o': leaf [H * w, d],
     'q_heads': HeadLayout(ids of the H query heads, v=(w,) * H, scale=1/sqrt(w)),
     'kv_heads': HeadLayout(ids of the G key-value heads, v=(w,) * G)}

Query head with original id ``i`` reads key-value head ``i // group`` (``group`` is the
original ratio ``num_attention_heads / num_key_value_heads``, a field of
:class:`GroupedAttentionConfig`), so removing query heads or whole key-value groups keeps every
remaining head reading the keys it was trained with. Every weight goes through
:func:`lowrank_jax.linear`, so any leaf type runs here, forward and cached.

Rotary embeddings (:mod:`lowrank_jax.nn.rotary`) rotate the per-head queries and keys by their
positions before the product. That puts a position-dependent rotation between the query and key
weights, ``q_h^T R(p' - p) k_h``, so the joint query-key tensor ``W^Q_h (W^K_h)^T`` of a block
without rotary embeddings has no fixed counterpart here: factorizations of that tensor (CP,
block terms) and folding the key factor into the queries are not exact, while per-head low-rank
queries and keys (each projection on its own) are.

The key-value cache holds rotated keys and values once per key-value head:
``{'k', 'v': [batch, G, max_len, w]}`` (``H / G`` times smaller than per query head). Heads come
before positions so that the products of a decoding step read the cache as it is stored:
queries are grouped by their key-value head (``[b, G, r * n, w]``, ``r = H / G``), never the
keys and values expanded to all query heads.
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
    init_dense,
    keep_inputs,
    keep_outputs,
    linear,
    split_heads,
    weight_shape,
)
from lowrank_jax.nn.attention.core import (
    causal_key_mask,
    positive,
    probabilities,
    write_positions,
)
from lowrank_jax.nn.rotary import RopeConfig, apply_rotary, inv_frequencies, rotary_angles

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GroupedAttentionConfig:
    """What a grouped-query attention block means.

    Attributes:
      group: query heads per key-value head in the original model
        (``num_attention_heads // num_key_value_heads``).
      rope: rotary embedding settings, or ``None`` for no rotary embeddings.
      qkv_bias: :func:`init_grouped_attention` creates q, k, v biases.
      o_bias: it creates an output bias.
    """

    group: int = 1
    rope: RopeConfig | None = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False

    def __post_init__(self):
        positive("GroupedAttentionConfig", "group", self.group)
        if self.rope is not None and not isinstance(self.rope, RopeConfig):
            raise ConfigError(f"GroupedAttentionConfig: rope must be a RopeConfig or None, got "
                              f"{type(self.rope).__name__}", where="rope")


def init_grouped_attention(key: Array, cfg: GroupedAttentionConfig, *, d_model: int,
                           num_heads: int, num_kv_heads: int, d_head: int) -> dict:
    """Dense grouped-query attention parameters (module docstring).

    Args:
      key: PRNG key.
      cfg: block configuration (``cfg.group`` must be ``num_heads // num_kv_heads``).
      d_model: model width.
      num_heads, num_kv_heads: query heads and key-value heads.
      d_head: per-head width of queries, keys and values.
    """
    owner = "init_grouped_attention"
    for name, val in (("d_model", d_model), ("num_heads", num_heads),
                      ("num_kv_heads", num_kv_heads), ("d_head", d_head)):
        positive(owner, name, val)
    if num_heads != num_kv_heads * cfg.group:
        raise ConfigError(f"{owner}: num_heads={num_heads} must be num_kv_heads={num_kv_heads} "
                          f"times the config's group={cfg.group}", where="num_heads",
                          expected=num_kv_heads * cfg.group, actual=num_heads)
    kq, kk, kv, ko = jax.random.split(key, 4)
    b = cfg.qkv_bias
    return {
        "qk": {"q": init_dense(kq, d_model, num_heads * d_head, bias=b),
               "k": init_dense(kk, d_model, num_kv_heads * d_head, bias=b)},
        "v": init_dense(kv, d_model, num_kv_heads * d_head, bias=b),
        "o": init_dense(ko, num_heads * d_head, d_model, bias=cfg.o_bias),
        "q_heads": HeadLayout.uniform(num_heads, d_head, 1.0 / math.sqrt(d_head)),
        "kv_heads": HeadLayout.uniform(num_kv_heads, d_head),
    }


def grouped_params(params, where: str = "grouped attention"):
    """``(q, k, v, o, q_heads, kv_heads, width)`` of a block, checked for consistency."""
    need = {"qk", "v", "o", "q_heads", "kv_heads"}
    if not isinstance(params, dict) or not need <= set(params) or not isinstance(
            params["qk"], dict) or not {"q", "k"} <= set(params["qk"]):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ShapeError(f"{where}: grouped attention parameters must be a dict with "
                         f"{sorted(need)} and qk = {{'q', 'k'}} (init_grouped_attention), got "
                         f"{got}", where=where, expected=sorted(need), actual=got)
    qh, kvh = params["q_heads"], params["kv_heads"]
    if not isinstance(qh, HeadLayout) or not isinstance(kvh, HeadLayout):
        raise ShapeError(f"{where}: 'q_heads' and 'kv_heads' must be HeadLayouts", where=where)
    widths = set(qh.v) | set(kvh.v)
    if len(widths) > 1:
        raise ShapeError(f"{where}: every query and key-value head must have one width, got "
                         f"{sorted(widths)}", where=where, expected="one width",
                         actual=sorted(widths))
    w = widths.pop() if widths else 0
    q, k, v, o = params["qk"]["q"], params["qk"]["k"], params["v"], params["o"]
    checks = (("qk/q", weight_shape(q)[-1], qh.num_heads * w),
              ("qk/k", weight_shape(k)[-1], kvh.num_heads * w),
              ("v", weight_shape(v)[-1], kvh.num_heads * w),
              ("o", weight_shape(o)[0], qh.num_heads * w))
    for name, got, want in checks:
        if got != want:
            raise ShapeError(f"{where}/{name}: expected {want} head channels "
                             f"({qh.num_heads} query / {kvh.num_heads} key-value heads of width "
                             f"{w}), got {got}", where=f"{where}/{name}", expected=want,
                             actual=got)
    return q, k, v, o, qh, kvh, w


def kv_index(q_heads: HeadLayout, kv_heads: HeadLayout, group: int,
             where: str = "grouped attention") -> np.ndarray:
    """For every query head, the position of its key-value head in ``kv_heads``."""
    pos = {i: n for n, i in enumerate(kv_heads.ids)}
    out = []
    for i in q_heads.ids:
        if i // group not in pos:
            raise ShapeError(f"{where}: query head {i} reads key-value head {i // group}, which "
                             f"the block no longer has (key-value heads {kv_heads.ids})",
                             where=where, expected=i // group, actual=kv_heads.ids)
        out.append(pos[i // group])
    return np.asarray(out, np.int64)


def _regular(idx: np.ndarray, n_kv: int) -> int | None:
    """The common group size when query heads come in equal consecutive runs per kv head."""
    if n_kv == 0 or len(idx) % n_kv:
        return None
    r = len(idx) // n_kv
    return r if np.array_equal(idx, np.repeat(np.arange(n_kv), r)) else None


def heads_major(x: Array) -> Array:
    """Per-head keys or values from ``[b, n, G, w]`` (as projected) to the cache's layout
    ``[b, G, n, w]``."""
    return jnp.swapaxes(x, 1, 2)


def _grouped_probs(q: Array, keys: Array, idx: np.ndarray, heads: HeadLayout,
                   mask: Array | None):
    """Attention probabilities of per-head queries ``[b, n, H, w]`` against keys laid out
    ``[b, G, k, w]`` (heads before positions): ``(probs [b, g, r * n, k], used)`` with
    ``g * r = H`` and the rows of a group ordered ``(r, n)``; ``used`` is ``None`` when the
    query heads come in equal consecutive runs per key-value head (then ``g = G``), else the
    per-query-head gather applied to the keys (``g = H``, ``r = 1``), to be applied to the
    values too.

    Both products are batched matrix products over ``(b, g)`` with contiguous operands in this
    layout, so the cache is read as it is stored (no per-step copy); only the queries and the
    output are transposed, never the logits."""
    b, n, h, w = q.shape
    g = keys.shape[1]
    r = _regular(idx, g)
    used = None
    if r is None:  # irregular groups (some query heads removed): gather the keys per head
        keys, used, g, r = keys[:, idx], idx, h, 1
    k_len = keys.shape[2]
    qg = jnp.transpose(q.reshape(b, n, g, r, w), (0, 2, 3, 1, 4)).reshape(b, g, r * n, w)
    logits = jnp.einsum("bgmw,bgkw->bgmk", qg, keys)  # [b, g, r * n, k] = [b, h, n, k]
    probs = probabilities(logits.reshape(b, h, n, k_len), heads, bias=None, mask=mask)
    return probs.reshape(b, g, r * n, k_len), used


def _ungroup(out: Array, n: int) -> Array:
    """Grouped rows ``[b, g, r * n, w]`` (ordered ``(r, n)``) to ``[b, n, g * r * w]``."""
    b, g, m, w = out.shape
    r = m // n
    return jnp.transpose(out.reshape(b, g, r, n, w), (0, 3, 1, 2, 4)).reshape(b, n, g * r * w)


def _attend(q: Array, keys: Array, vals: Array, idx: np.ndarray, heads: HeadLayout,
            mask: Array | None) -> Array:
    """Per-head queries ``[b, n, H, w]`` against keys and values ``[b, G, k, w]``: the
    weighted values ``[b, n, H * w]``."""
    probs, used = _grouped_probs(q, keys, idx, heads, mask)
    if used is not None:
        vals = vals[:, used]
    out = jnp.einsum("bgmk,bgkw->bgmw", probs.astype(vals.dtype), vals)  # [b, g, r * n, w]
    return _ungroup(out, q.shape[1])


def _project(params: dict, cfg: GroupedAttentionConfig, x: Array, positions: Array):
    q, k, v, _, qh, kvh, w = grouped_params(params)
    qs = split_heads(linear(q, x), qh.v)  # [b, n, H, w]
    ks = split_heads(linear(k, x), kvh.v)  # [b, n, G, w]
    vs = split_heads(linear(v, x), kvh.v)  # [b, n, G, w]
    if cfg.rope is not None and w:
        cos, sin = rotary_angles(positions, inv_frequencies(cfg.rope, w))
        qs, ks = apply_rotary(qs, cos, sin), apply_rotary(ks, cos, sin)
    return qs, ks, vs


def _check_x(params: dict, x, owner: str) -> Array:
    x = jnp.asarray(x)
    d = weight_shape(params["qk"]["q"])[0]
    if x.ndim != 3 or x.shape[-1] != d:
        raise ShapeError(f"{owner}: x must be [batch, seq, d_model={d}], got shape "
                         f"{tuple(x.shape)}", where="x", expected=d, actual=tuple(x.shape))
    return x


def apply_grouped_attention(params: dict, x: Array, cfg: GroupedAttentionConfig, *,
                            positions: Array, mask: Array | None = None) -> Array:
    """Grouped-query self-attention of a whole sequence.

    Args:
      params: from :func:`init_grouped_attention` (any leaf types; heads may have been
        removed).
      x: ``[batch, seq, d_model]``.
      cfg: block configuration.
      positions: ``int[batch, seq]`` position of every token (rotary angles).
      mask: boolean, ``True`` = may attend, broadcastable to ``[batch, 1, seq, seq]`` (the
        causal mask combined with padding: the caller builds it).

    Returns:
      ``[batch, seq, d_model]``.
    """
    x = _check_x(params, x, "apply_grouped_attention")
    _, _, _, o, qh, kvh, _ = grouped_params(params)
    idx = kv_index(qh, kvh, cfg.group)
    qs, ks, vs = _project(params, cfg, x, positions)
    return linear(o, _attend(qs, heads_major(ks), heads_major(vs), idx, qh, mask))


def init_grouped_cache(params: dict, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty cache ``{'k', 'v': zeros [batch, G, max_len, w]}`` (one entry per key-value
    head, heads before positions: the layout the attention products read as stored)."""
    _, _, _, _, _, kvh, w = grouped_params(params, "init_grouped_cache")
    positive("init_grouped_cache", "batch", batch)
    positive("init_grouped_cache", "max_len", max_len)
    shape = (int(batch), kvh.num_heads, int(max_len), w)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def apply_grouped_attention_cached(params: dict, x: Array, cfg: GroupedAttentionConfig,
                                   cache: dict, *, index, positions: Array,
                                   mask: Array | None = None) -> tuple[Array, dict]:
    """Grouped-query attention of ``n`` new tokens against the cache.

    The new tokens' rotated keys and values are written at buffer slots ``index .. index + n
    - 1``; query ``i`` attends to slots ``<= index + i`` that ``mask`` allows. Equals the last
    ``n`` positions of :func:`apply_grouped_attention` on the whole sequence (to float32
    round-off).

    Args:
      params: the block.
      x: ``[batch, n, d_model]``.
      cfg: block configuration.
      cache: ``{'k', 'v'}`` of :func:`init_grouped_cache`.
      index: buffer slot of the first new token (int or traced int32).
      positions: ``int[batch, n]`` the new tokens' positions (rotary angles; with left padding
        they differ from the buffer slots).
      mask: boolean key mask broadcastable to ``[batch, 1, n, max_len]`` (padding slots
        ``False``), combined with the causal limit here.

    Returns:
      ``(out [batch, n, d_model], cache)``.
    """
    x = _check_x(params, x, "apply_grouped_attention_cached")
    _, _, _, o, qh, kvh, _ = grouped_params(params)
    idx = kv_index(qh, kvh, cfg.group)
    qs, ks, vs = _project(params, cfg, x, positions)
    n, k_len = x.shape[1], cache["k"].shape[2]
    cache = {"k": write_positions(cache["k"], heads_major(ks), index, 2),
             "v": write_positions(cache["v"], heads_major(vs), index, 2)}
    mask = causal_key_mask(index, n, k_len, mask)
    out = _attend(qs, cache["k"], cache["v"], idx, qh, mask)
    return linear(o, out), cache


def keep_query_heads(params: dict, idx) -> dict:
    """The block restricted to the query heads at positions ``idx`` (sorted, distinct): ``q``
    keeps their columns, ``o`` their rows. Exactly the block with the other heads' output rows
    zeroed."""
    q, _, _, o, qh, _, w = grouped_params(params, "keep_query_heads")
    idx = np.asarray(idx, np.int64)
    cols = np.concatenate([np.arange(h * w, (h + 1) * w) for h in idx] or
                          [np.zeros(0, np.int64)]).astype(np.int64)
    return {**params, "qk": {**params["qk"], "q": keep_outputs(q, cols)},
            "o": keep_inputs(o, cols), "q_heads": qh.keep(idx)}


def keep_kv_groups(params: dict, idx, group: int) -> dict:
    """The block restricted to the key-value heads at positions ``idx`` and the query heads
    that read them (a whole group goes at once)."""
    _, k, v, _, qh, kvh, w = grouped_params(params, "keep_kv_groups")
    idx = np.asarray(idx, np.int64)
    kept_ids = {kvh.ids[i] for i in idx}
    q_keep = [n for n, i in enumerate(qh.ids) if i // group in kept_ids]
    out = keep_query_heads(params, q_keep)
    cols = np.concatenate([np.arange(h * w, (h + 1) * w) for h in idx] or
                          [np.zeros(0, np.int64)]).astype(np.int64)
    return {**out, "qk": {**out["qk"], "k": keep_outputs(k, cols)},
            "v": keep_outputs(v, cols), "kv_heads": kvh.keep(idx)}


def grouped_head_widths(block: dict, tail: tuple[str, ...]) -> tuple[int, ...] | None:
    """How the weight ``tail`` (``('qk', 'q')``, ``('qk', 'k')``, ``('v',)`` or ``('o',)``) of
    a grouped block splits into heads: q and o by query heads, k and v by key-value heads
    (so per-head compression treats a shared key-value head once)."""
    qh, kvh = block["q_heads"], block["kv_heads"]
    if tail in (("qk", "q"), ("o",)):
        return tuple(qh.v)
    if tail in (("qk", "k"), ("v",)):
        return tuple(kvh.v)
    return None


def is_grouped_block(node) -> bool:
    """Whether ``node`` is a grouped-query attention block (module docstring)."""
    return (isinstance(node, dict) and isinstance(node.get("q_heads"), HeadLayout)
            and isinstance(node.get("kv_heads"), HeadLayout) and isinstance(node.get("qk"), dict))


__all__ = ["GroupedAttentionConfig", "apply_grouped_attention", "apply_grouped_attention_cached",
           "grouped_head_widths", "grouped_params", "heads_major",
           "init_grouped_attention", "init_grouped_cache", "is_grouped_block", "keep_kv_groups",
           "keep_query_heads", "kv_index"]
