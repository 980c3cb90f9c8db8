"""Dense and low-rank weight leaves (seed 000 eq. 19, seed 004)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.leaves.base import Array, Leaf, leaf_dataclass

_ARRAY = (jax.Array, np.ndarray)


def _bits(a: Array | None) -> int:
    if a is None:
        return 0
    return int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize * 8


def _size(a: Array | None) -> int:
    return 0 if a is None else int(np.prod(a.shape))


def check_bias(name: str, b, d_out: int) -> None:
    """Shared shape check for optional biases (only on concrete arrays, not tree sentinels)."""
    if isinstance(b, _ARRAY) and tuple(b.shape) != (d_out,):
        raise ValueError(f"{name}: bias b must have shape ({d_out},), got {tuple(b.shape)}")


class Dense(Leaf):
    """A dense weight ``w: [d_in, d_out]`` with optional bias ``b: [d_out]``.

    ``linear(Dense(w, b), x) = x @ w + b``.
    """

    w: Array
    b: Array | None = None

    def __post_init__(self):
        if isinstance(self.w, _ARRAY):
            if self.w.ndim != 2:
                raise ValueError(
                    f"Dense: w must be 2-D [d_in, d_out], got shape {tuple(self.w.shape)}"
                )
            check_bias("Dense", self.b, self.w.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    def apply(self, x: Array) -> Array:
        y = x @ self.w
        return y if self.b is None else y + self.b

    def to_dense(self) -> Array:
        return self.w

    def param_count(self) -> int:
        return _size(self.w) + _size(self.b)

    def storage_bits(self) -> int:
        return _bits(self.w) + _bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return n_tokens * self.d_in * self.d_out


Dense = leaf_dataclass(Dense)


class LowRank(Leaf):
    """A rank-``r`` factorization ``W = u @ v`` kept factorized (seed 000 eq. 19).

    ``u: [d_in, r]``, ``v: [r, d_out]``, optional bias ``b: [d_out]``. The product is computed
    as ``(x @ u) @ v``: ``r (d_in + d_out)`` multiply-adds per token instead of ``d_in d_out``.
    In the paper's column orientation ``W_Q ~ W_1 W_2`` with ``W_2`` the sketch; here
    ``u = W_2^T`` sketches the input and ``v = W_1^T`` lifts it.
    """

    u: Array
    v: Array
    b: Array | None = None

    def __post_init__(self):
        if isinstance(self.u, _ARRAY) and isinstance(self.v, _ARRAY):
            if self.u.ndim != 2 or self.v.ndim != 2 or self.u.shape[1] != self.v.shape[0]:
                raise ValueError(
                    "LowRank: expected u [d_in, r] and v [r, d_out] with the same r, got "
                    f"u {tuple(self.u.shape)} and v {tuple(self.v.shape)}"
                )
            check_bias("LowRank", self.b, self.v.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.u.shape[0], self.v.shape[1])

    @property
    def rank(self) -> int:
        return self.u.shape[1]

    def apply(self, x: Array) -> Array:
        y = (x @ self.u) @ self.v
        return y if self.b is None else y + self.b

    def to_dense(self) -> Array:
        return self.u @ self.v

    def param_count(self) -> int:
        return _size(self.u) + _size(self.v) + _size(self.b)

    def storage_bits(self) -> int:
        return _bits(self.u) + _bits(self.v) + _bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return n_tokens * self.rank * (self.d_in + self.d_out)


LowRank = leaf_dataclass(LowRank)
