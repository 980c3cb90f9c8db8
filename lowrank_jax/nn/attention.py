"""Multi-head attention with T5 relative position bias and fixed Q/K/V activation masks.

Every projection goes through :func:`lowrank_jax.leaves.linear`, so any projection may be a
``Dense``, ``LowRank``, ``HeadLowRank`` or ``MaskedBinary`` leaf. Heads are head-major in the
projection outputs: ``[..., h * d_head]`` is read as ``[..., h, d_head]``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.leaves import init_dense, linear
from lowrank_jax.nn.masks import qkv_activation_masks

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
            raise ValueError(
                f"RelativeBiasConfig: num_buckets must be an int >= 4, got {self.num_buckets!r}"
            )
        if not isinstance(self.max_distance, int) or self.max_distance <= self.num_buckets // 2:
            raise ValueError(
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


def relative_bias(table: Array, q_len: int, k_len: int, cfg: RelativeBiasConfig) -> Array:
    """Additive attention bias from a relative-bias table (HF T5 ``compute_bias``).

    The relative position is ``memory_position - query_position`` with positions
    ``arange(k_len)`` and ``arange(q_len)``.

    Args:
      table: ``[num_buckets, heads]``.
      q_len: number of queries.
      k_len: number of keys.
      cfg: bucket configuration (its ``bidirectional`` is used as given).

    Returns:
      ``float[1, heads, q_len, k_len]``.
    """
    table = jnp.asarray(table)
    if table.ndim != 2 or table.shape[0] != cfg.num_buckets:
        raise ValueError(
            f"relative_bias: table must be [num_buckets={cfg.num_buckets}, heads], "
            f"got shape {tuple(table.shape)}"
        )
    rel = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]  # [q_len, k_len]
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
    """Multi-head attention.

    Attributes:
      d_model: input and output width.
      num_heads: number of heads.
      d_head: per-head width; ``None`` means ``d_model // num_heads`` (which must then divide).
        ``d_head * num_heads != d_model`` is allowed (T5).
      use_bias: biases on the four projections (BERT/ViT: ``True``; T5: ``False``).
      scaled: divide logits by ``sqrt(d_head)``; T5 folds the scale into its init (``False``).
      d_kv_in: width of the ``kv`` input of cross-attention; ``None`` means ``d_model``.
      qkv_keep: keep fraction of the fixed Q/K/V activation masks (seed 003 sec. 3.3.1);
        ``None`` disables them.
      qkv_mask_seed: base seed of those masks; layer ``l`` uses ``qkv_mask_seed + l``.
    """

    d_model: int
    num_heads: int
    d_head: int | None = None
    use_bias: bool = False
    scaled: bool = True
    d_kv_in: int | None = None
    qkv_keep: float | None = None
    qkv_mask_seed: int = 0

    def __post_init__(self):
        for name in ("d_model", "num_heads"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"AttentionConfig: {name} must be a positive int, got {val!r}")
        for name in ("d_head", "d_kv_in"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or val < 1):
                raise ValueError(
                    f"AttentionConfig: {name} must be None or a positive int, got {val!r}"
                )
        if self.d_head is None and self.d_model % self.num_heads != 0:
            raise ValueError(
                f"AttentionConfig: num_heads={self.num_heads} does not divide "
                f"d_model={self.d_model}; expected d_model % num_heads == 0, got remainder "
                f"{self.d_model % self.num_heads}. Pass d_head explicitly for "
                "d_head * num_heads != d_model."
            )
        if self.qkv_keep is not None and not (
            isinstance(self.qkv_keep, (int, float)) and 0.0 < self.qkv_keep <= 1.0
        ):
            raise ValueError(
                f"AttentionConfig: qkv_keep must be None or in (0, 1], got {self.qkv_keep!r}"
            )
        if not isinstance(self.qkv_mask_seed, int):
            raise ValueError(
                f"AttentionConfig: qkv_mask_seed must be an int, got {self.qkv_mask_seed!r}"
            )

    @property
    def head_dim(self) -> int:
        """Resolved per-head width (``d_head`` or ``d_model // num_heads``)."""
        return self.d_head if self.d_head is not None else self.d_model // self.num_heads

    @property
    def inner_dim(self) -> int:
        """``num_heads * head_dim``: width of the q/k/v outputs and of the o input."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Resolved width of the ``kv`` input (``d_kv_in`` or ``d_model``)."""
        return self.d_kv_in if self.d_kv_in is not None else self.d_model


def init_attention(key: Array, cfg: AttentionConfig) -> dict:
    """Dense projections ``{'q', 'k', 'v', 'o'}``.

    Args:
      key: PRNG key.
      cfg: attention configuration.

    Returns:
      ``q: [d_model, h*d_head]``, ``k, v: [d_kv_in, h*d_head]``, ``o: [h*d_head, d_model]``,
      all :class:`~lowrank_jax.Dense` (with zero biases if ``cfg.use_bias``).
    """
    kq, kk, kv, ko = jax.random.split(key, 4)
    inner, b = cfg.inner_dim, cfg.use_bias
    return {
        "q": init_dense(kq, cfg.d_model, inner, bias=b),
        "k": init_dense(kk, cfg.kv_dim, inner, bias=b),
        "v": init_dense(kv, cfg.kv_dim, inner, bias=b),
        "o": init_dense(ko, inner, cfg.d_model, bias=b),
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
        raise ValueError(
            f"apply_attention: {name} must be 4-D and broadcastable to "
            f"[batch, heads, q_len, k_len] = {list(target)}, got shape {list(shape)}. {hint}"
        )


def _split_heads(y: Array, cfg: AttentionConfig, name: str) -> Array:
    if y.shape[-1] != cfg.inner_dim:
        raise ValueError(
            f"apply_attention: projection '{name}' must output num_heads * d_head = "
            f"{cfg.num_heads} * {cfg.head_dim} = {cfg.inner_dim} features, got {y.shape[-1]}"
        )
    return y.reshape(*y.shape[:-1], cfg.num_heads, cfg.head_dim)  # [b, s, h, d_head]


def apply_attention(params: dict, x: Array, cfg: AttentionConfig, *, kv: Array | None = None,
                    mask: Array | None = None, bias: Array | None = None,
                    layer_index: int = 0) -> Array:
    """Multi-head (self- or cross-) attention.

    ``softmax(q k^T / sqrt(d_head) + bias) v`` per head (without the scale if
    ``cfg.scaled=False``, as T5). Masked logits are set to ``finfo(float32).min`` (as Hugging
    Face T5 does) and the softmax runs in float32. With ``cfg.qkv_keep`` set, q, k and v of
    every head are multiplied by the fixed activation masks of
    :func:`~lowrank_jax.nn.qkv_activation_masks` with seed ``cfg.qkv_mask_seed + layer_index``
    (seed 003 sec. 3.3.1); the q mask is drawn over ``q_len`` and the k/v masks over ``k_len``.

    Args:
      params: ``{'q', 'k', 'v', 'o'}`` weight leaves.
      x: queries' input ``[batch, q_len, d_model]``.
      cfg: attention configuration.
      kv: keys'/values' input ``[batch, k_len, d_kv_in]`` (cross-attention); default ``x``.
      mask: boolean, ``True`` = may attend, broadcastable to ``[batch, heads, q_len, k_len]``.
      bias: additive logit bias broadcastable to ``[batch, heads, q_len, k_len]`` (for example
        :func:`relative_bias`).
      layer_index: static layer number (selects the activation-mask seed).

    Returns:
      ``[batch, q_len, d_model]``.
    """
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != cfg.d_model:
        raise ValueError(
            f"apply_attention: x must be [batch, q_len, d_model={cfg.d_model}], "
            f"got shape {tuple(x.shape)}"
        )
    kv = x if kv is None else jnp.asarray(kv)
    if kv.ndim != 3 or kv.shape[-1] != cfg.kv_dim or kv.shape[0] != x.shape[0]:
        raise ValueError(
            f"apply_attention: kv must be [batch={x.shape[0]}, k_len, d_kv_in={cfg.kv_dim}], "
            f"got shape {tuple(kv.shape)}"
        )
    batch, q_len, _ = x.shape
    k_len = kv.shape[1]
    target = (batch, cfg.num_heads, q_len, k_len)
    if bias is not None:
        bias = jnp.asarray(bias)
        _check_broadcast("bias", bias, target, "Use relative_bias(...) or a [1, h, q, k] array.")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(
                f"apply_attention: mask must be boolean (True = attend), got dtype {mask.dtype}; "
                "pass additive masks as bias="
            )
        _check_broadcast("mask", mask, target, "Build masks with padding_mask / causal_mask.")

    q = _split_heads(linear(params["q"], x), cfg, "q")  # [batch, q_len, h, d_head]
    k = _split_heads(linear(params["k"], kv), cfg, "k")  # [batch, k_len, h, d_head]
    v = _split_heads(linear(params["v"], kv), cfg, "v")  # [batch, k_len, h, d_head]

    if cfg.qkv_keep is not None:
        seed = cfg.qkv_mask_seed + layer_index
        mq = qkv_activation_masks(seed, q_len, cfg.head_dim, cfg.qkv_keep)["q"]
        mkv = qkv_activation_masks(seed, k_len, cfg.head_dim, cfg.qkv_keep)
        # [s, d_head] -> [s, 1, d_head]: the same mask for every head of the module.
        q = q * mq[:, None, :].astype(q.dtype)
        k = k * mkv["k"][:, None, :].astype(k.dtype)
        v = v * mkv["v"][:, None, :].astype(v.dtype)

    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # [batch, h, q_len, k_len]
    logits = logits.astype(jnp.float32)
    if cfg.scaled:
        logits = logits / np.sqrt(cfg.head_dim).astype(np.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [batch, h, q_len, k_len]

    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)  # [batch, q_len, h, d_head]
    out = out.reshape(batch, q_len, cfg.inner_dim)  # [batch, q_len, h*d_head]
    return linear(params["o"], out)  # [batch, q_len, d_model]
