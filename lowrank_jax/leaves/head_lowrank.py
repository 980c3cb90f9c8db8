"""Head-dependent low-rank sketching (seed 000 eq. 20; seed 001 TruncAtt per head)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.leaves.base import Array, Leaf, leaf_dataclass
from lowrank_jax.leaves.dense import _bits, _size, check_bias

_ARRAY = (jax.Array, np.ndarray)


class HeadLowRank(Leaf):
    """Per-head factors for a projection that produces ``h`` heads of size ``d_h``.

    Seed 000 eq. 20: ``W^(i) ~ W_1^(i) W_2^(i)`` with a head-dependent sketch ``W_2^(i)``. In the
    Flax orientation head ``i`` computes ``y_i = (x @ u[:, i]) @ v[i]`` and the heads are
    concatenated: ``y = [y_1, ..., y_h]`` of size ``h * d_h`` (head-major, the layout of
    every attention projection in :mod:`lowrank_jax.nn`). Shared sketching (eq. 19) is a plain
    :class:`~lowrank_jax.LowRank`.

    Fields:
      u: ``[d_in, h, r]`` input sketches, one ``[d_in, r]`` per head. Stored head-second so the
        first product is a single ``[d_in, h * r]`` matmul.
      v: ``[h, r, d_h]`` per-head lifts.
      b: optional bias ``[h * d_h]``.
      ranks: static per-head ranks when heads differ (irregular ranks from per-head eps
        truncation). Factors are zero-padded to ``r = max(ranks)``; the padded columns are masked
        in :meth:`apply`, so they stay exactly zero in the output and get zero gradients.
        ``None`` means every head has rank ``r``.

    Counts: :meth:`param_count` and :meth:`storage_bits` use the true per-head ranks (the
    padding carries no information and a ragged store drops it); :meth:`flops` counts what is
    executed, padding included, so irregular ranks are never reported as cheaper than they run.

    This leaf splits the *output* dimension into heads (query/key/value projections). The output
    projection, which consumes heads, is compressed with a shared :class:`LowRank`.
    """

    u: Array
    v: Array
    b: Array | None = None
    ranks: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.u, _ARRAY) and isinstance(self.v, _ARRAY):
            u, v = self.u, self.v
            if u.ndim != 3 or v.ndim != 3 or u.shape[1:] != v.shape[:2]:
                raise ValueError(
                    "HeadLowRank: expected u [d_in, heads, r] and v [heads, r, d_head], got "
                    f"u {tuple(u.shape)} and v {tuple(v.shape)}"
                )
            check_bias("HeadLowRank", self.b, v.shape[0] * v.shape[2])
        if self.ranks is not None:
            h, r = (
                (self.u.shape[1], self.u.shape[2]) if isinstance(self.u, _ARRAY) else (None, None)
            )
            if h is not None and (
                len(self.ranks) != h or max(self.ranks) > r or min(self.ranks) < 0
            ):
                raise ValueError(
                    f"HeadLowRank: ranks must give one rank in [0, {r}] per head ({h} heads), "
                    f"got {self.ranks}"
                )

    @property
    def num_heads(self) -> int:
        return self.u.shape[1]

    @property
    def d_head(self) -> int:
        return self.v.shape[2]

    @property
    def max_rank(self) -> int:
        return self.u.shape[2]

    @property
    def head_ranks(self) -> tuple[int, ...]:
        return self.ranks if self.ranks is not None else (self.max_rank,) * self.num_heads

    @property
    def shape(self) -> tuple[int, int]:
        return (self.u.shape[0], self.num_heads * self.d_head)

    def _rank_mask(self) -> np.ndarray | None:
        if self.ranks is None or all(r == self.max_rank for r in self.ranks):
            return None
        return (np.arange(self.max_rank)[None, :] < np.asarray(self.ranks)[:, None]).astype(
            np.float32
        )

    def apply(self, x: Array) -> Array:
        d_in, h, r = self.u.shape
        t = (x @ self.u.reshape(d_in, h * r)).reshape(*x.shape[:-1], h, r)  # [..., h, r]
        mask = self._rank_mask()
        if mask is not None:
            t = t * mask.astype(t.dtype)
        y = jnp.einsum("...hr,hrd->...hd", t, self.v).reshape(*x.shape[:-1], h * self.d_head)
        return y if self.b is None else y + self.b

    def to_dense(self) -> Array:
        mask = self._rank_mask()
        u = self.u if mask is None else self.u * mask.astype(self.u.dtype)[None]
        w = jnp.einsum("ihr,hrd->ihd", u, self.v)
        return w.reshape(self.u.shape[0], self.num_heads * self.d_head)

    def param_count(self) -> int:
        return sum(r * (self.d_in + self.d_head) for r in self.head_ranks) + _size(self.b)

    def storage_bits(self) -> int:
        bits_per = jnp.dtype(self.u.dtype).itemsize * 8
        return sum(r * (self.d_in + self.d_head) for r in self.head_ranks) * bits_per + _bits(
            self.b
        )

    def flops(self, n_tokens: int) -> int:
        return n_tokens * self.num_heads * self.max_rank * (self.d_in + self.d_head)


HeadLowRank = leaf_dataclass(HeadLowRank, meta=("ranks",))
