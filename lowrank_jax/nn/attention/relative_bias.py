"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning
with a Unified Text-to-Text Transformer", arXiv:1910.10683, sec. 2.1), bucketed exactly as
Hugging Face's ``T5Attention``."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError

Array = jax.Array


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


__all__ = ["RelativeBiasConfig", "init_relative_bias", "relative_bias", "relative_position_bucket"]
