"""Initializers for fresh leaves (used by the ``init_x`` functions of :mod:`lowrank_jax.nn`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves.dense import Dense, LowRank
from lowrank_jax.leaves.head_lowrank import HeadLowRank


def init_dense(key, d_in: int, d_out: int, *, bias: bool = False, std: float | None = None,
               dtype=jnp.float32) -> Dense:
    """``Dense`` with ``w ~ N(0, std^2)``, ``std = 1/sqrt(d_in)`` by default; zero bias."""
    std = 1.0 / np.sqrt(d_in) if std is None else std
    w = std * jax.random.normal(key, (d_in, d_out), dtype)
    return Dense(w=w, b=jnp.zeros((d_out,), dtype) if bias else None)


def init_lowrank(key, d_in: int, d_out: int, rank: int, *, bias: bool = False,
                 dtype=jnp.float32) -> LowRank:
    """``LowRank`` whose product has the variance of :func:`init_dense` (``1/d_in`` per entry).

    ``u ~ N(0, 1/d_in)``, ``v ~ N(0, 1/rank)``: each entry of ``u @ v`` then has variance
    ``1/d_in``, so a low-rank-by-design model starts at the dense model's scale.
    """
    if not 1 <= rank <= min(d_in, d_out):
        raise ConfigError(f"init_lowrank: rank must be in [1, {min(d_in, d_out)}], got {rank}")
    ku, kv = jax.random.split(key)
    u = jax.random.normal(ku, (d_in, rank), dtype) / np.sqrt(d_in)
    v = jax.random.normal(kv, (rank, d_out), dtype) / np.sqrt(rank)
    return LowRank(u=u, v=v, b=jnp.zeros((d_out,), dtype) if bias else None)


def init_head_lowrank(key, d_in: int, num_heads: int, d_head: int, rank: int, *,
                      bias: bool = False, dtype=jnp.float32) -> HeadLowRank:
    """``HeadLowRank`` ("Understanding Transformers for Time Series", eq. 20) with per-entry
    product variance ``1/d_in``."""
    if not 1 <= rank <= min(d_in, d_head):
        raise ConfigError(f"init_head_lowrank: rank must be in [1, {min(d_in, d_head)}], got {rank}")
    ku, kv = jax.random.split(key)
    u = jax.random.normal(ku, (d_in, num_heads, rank), dtype) / np.sqrt(d_in)
    v = jax.random.normal(kv, (num_heads, rank, d_head), dtype) / np.sqrt(rank)
    b = jnp.zeros((num_heads * d_head,), dtype) if bias else None
    return HeadLowRank(u=u, v=v, b=b)


__all__ = ["init_dense", "init_head_lowrank", "init_lowrank"]
