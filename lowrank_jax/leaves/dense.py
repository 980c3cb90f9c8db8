"""Dense and low-rank weight leaves.

``LowRank`` is the shared-sketch factorization ``W ~ W_1 W_2`` of "Understanding Transformers
for Time Series: Rank Structure, Flow-of-Ranks, and Compressibility" (eq. 19), kept factorized
at inference.
"""

from __future__ import annotations

from lowrank_jax.errors import ShapeError
from lowrank_jax.leaves.base import (
    CONCRETE,
    Array,
    Factors,
    Leaf,
    _StoredBias,
    array_bits,
    array_size,
    check_bias,
    leaf_dataclass,
    slice_bias,
)


class Dense(_StoredBias, Leaf):
    """A dense weight ``w: [d_in, d_out]`` with optional bias ``b: [d_out]``.

    ``linear(Dense(w, b), x) = x @ w + b``.
    """

    w: Array
    b: Array | None = None

    def __post_init__(self):
        if isinstance(self.w, CONCRETE):
            if self.w.ndim != 2:
                raise ShapeError(
                    f"Dense: w must be 2-D [d_in, d_out], got shape {tuple(self.w.shape)}",
                    expected="[d_in, d_out]", actual=tuple(self.w.shape))
            check_bias("Dense", self.b, self.w.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    def apply(self, x: Array) -> Array:
        y = x @ self.w
        return y if self.b is None else y + self.b

    def to_dense(self) -> Array:
        return self.w

    def factors(self) -> Factors:
        return Factors(None, self.w, None, self.b)

    def param_count(self) -> int:
        return array_size(self.w) + array_size(self.b)

    def storage_bits(self) -> int:
        return array_bits(self.w) + array_bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return n_tokens * self.d_in * self.d_out

    def keep_inputs(self, idx):
        return Dense(w=self.w[idx], b=self.b)

    def keep_outputs(self, idx):
        return Dense(w=self.w[:, idx], b=slice_bias(self.b, idx))

    def logical_axes(self):
        return {"w": ("in", "out"), "b": ("out",)}


Dense = leaf_dataclass(Dense)


class LowRank(_StoredBias, Leaf):
    """A rank-``r`` factorization ``W = u @ v`` kept factorized.

    "Understanding Transformers for Time Series" eq. 19 (shared sketch). ``u: [d_in, r]``,
    ``v: [r, d_out]``, optional bias ``b: [d_out]``. The product is computed as
    ``(x @ u) @ v``: ``r (d_in + d_out)`` multiply-adds per token instead of ``d_in d_out``. In
    the paper's column orientation ``W_Q ~ W_1 W_2`` with ``W_2`` the sketch; here
    ``u = W_2^T`` sketches the input and ``v = W_1^T`` lifts it. Surgery that keeps no input
    or no output channel leaves rank 0 (the factors could only multiply zeros).
    """

    u: Array
    v: Array
    b: Array | None = None

    def __post_init__(self):
        if isinstance(self.u, CONCRETE) and isinstance(self.v, CONCRETE):
            if self.u.ndim != 2 or self.v.ndim != 2 or self.u.shape[1] != self.v.shape[0]:
                raise ShapeError(
                    "LowRank: expected u [d_in, r] and v [r, d_out] with the same r, got "
                    f"u {tuple(self.u.shape)} and v {tuple(self.v.shape)}",
                    expected="u [d_in, r], v [r, d_out]",
                    actual=(tuple(self.u.shape), tuple(self.v.shape)))
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

    def factors(self) -> Factors:
        return Factors(self.u, self.v, None, self.b)

    def param_count(self) -> int:
        return array_size(self.u) + array_size(self.v) + array_size(self.b)

    def storage_bits(self) -> int:
        return array_bits(self.u) + array_bits(self.v) + array_bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return n_tokens * self.rank * (self.d_in + self.d_out)

    def keep_inputs(self, idx):
        if not len(idx):  # (x @ u) would be zeros: rank 0, the bias alone
            return LowRank(u=self.u[:0, :0], v=self.v[:0], b=self.b)
        return LowRank(u=self.u[idx], v=self.v, b=self.b)

    def keep_outputs(self, idx):
        if not len(idx):  # nothing to lift into: rank 0
            return LowRank(u=self.u[:, :0], v=self.v[:0, :0], b=slice_bias(self.b, idx))
        return LowRank(u=self.u, v=self.v[:, idx], b=slice_bias(self.b, idx))

    def logical_axes(self):
        return {"u": ("in", "rank"), "v": ("rank", "out"), "b": ("out",)}


LowRank = leaf_dataclass(LowRank)

def is_dense(x) -> bool:
    """Whether ``x`` is a plain dense weight (a :class:`Dense` leaf): what
    :func:`~lowrank_jax.materialize` returns unchanged. Used to report which leaves an export
    densified."""
    return isinstance(x, Dense)


__all__ = ["Dense", "LowRank", "is_dense"]
