"""Biprop masked-binary weights ("Sparse Binary Transformers for Multivariate Time Series
Modeling", sec. 3.2, eqs. 1-2) and their frozen form."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves.base import (
    CONCRETE,
    Array,
    Leaf,
    array_bits,
    array_size,
    check_bias,
    leaf_dataclass,
    slice_bias,
)

ALPHA_BITS = 32  # one float32 gain per layer ("Sparse Binary Transformers", sec. 5.1)


def keep_count(n: int, keep: float) -> int:
    """Number of weights kept out of ``n`` at keep fraction ``keep``.

    Rounded as in the reference Biprop code (``GetSubnet``: the lowest ``int((1 - k) * n)``
    scores are dropped, the rest kept), so ``n_keep = n - floor((1 - keep) * n)``.
    """
    return n - int((1.0 - keep) * n)


def top_mask(scores: Array, keep: float) -> Array:
    """"Sparse Binary Transformers" eq. 1: 1 for the ``keep_count`` largest ``|scores|`` of the
    layer, else 0."""
    n = int(np.prod(scores.shape))
    k = keep_count(n, keep)
    flat = jnp.abs(scores).reshape(-1)
    _, idx = jax.lax.top_k(flat, k)
    return jnp.zeros((n,), scores.dtype).at[idx].set(1).reshape(scores.shape)


class MaskedBinary(Leaf):
    """Biprop weight: ``W_eff = alpha * sign(w) * M`` with ``M`` chosen by scores.

    Fields:
      w: float weights ``[d_in, d_out]`` (random, frozen in Biprop: :meth:`trainable` marks them
        ``False``, so :func:`~lowrank_jax.partition` keeps them out of ``jax.grad``).
      s: scores ``[d_in, d_out]`` (trained).
      b: optional bias ``[d_out]`` (trained, kept in float).
      keep: static fraction of weights kept; the count is :func:`keep_count`.

    Forward (eqs. 1-2): ``M`` is 1 on the top-|s| entries of the layer,
    ``alpha = ||M * w||_1 / ||M||_1``. ``sign(0)`` is taken as ``+1`` so every kept weight is
    exactly ``+-alpha`` (one bit). Backward: straight-through estimator: the gradient of ``M``
    passes unchanged to ``|s|`` (hence ``sign(s)`` to ``s``), and ``alpha`` is computed from the
    straight-through ``M``.

    Counts: ``param_count = n_keep + 1`` (alpha) plus bias; ``storage_bits = n_keep`` bits + one
    float32 alpha + bias, the accounting of sec. 5.1 (mask positions are not counted, as in the
    paper); ``flops = n_tokens * n_keep`` non-zero multiply-adds (Table 5).

    Surgery: removing channels would change which scores are in the top fraction and the
    gain; :meth:`keep_inputs` / :meth:`keep_outputs` therefore first :meth:`freeze` the leaf
    (mask and ``alpha`` fixed at their current values) and slice the frozen form, which
    computes exactly what this leaf computed on the kept channels.
    """

    w: Array
    s: Array
    b: Array | None = None
    keep: float = 0.5

    def __post_init__(self):
        if not (isinstance(self.keep, (int, float)) and 0.0 < self.keep <= 1.0):
            raise ConfigError(f"MaskedBinary: keep fraction must be in (0, 1], got {self.keep!r}",
                              where="keep", expected="(0, 1]", actual=self.keep)
        if isinstance(self.w, CONCRETE) and isinstance(self.s, CONCRETE):
            if self.w.ndim != 2 or self.w.shape != self.s.shape:
                raise ShapeError(
                    "MaskedBinary: w and s must be 2-D of the same shape [d_in, d_out], got "
                    f"w {tuple(self.w.shape)} and s {tuple(self.s.shape)}")
            check_bias("MaskedBinary", self.b, self.w.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    @property
    def n_keep(self) -> int:
        return keep_count(self.d_in * self.d_out, self.keep)

    def mask(self) -> Array:
        """The hard 0/1 mask ``M`` (no gradient path)."""
        return top_mask(jax.lax.stop_gradient(self.s), self.keep)

    def effective_weight(self) -> Array:
        a = jnp.abs(self.s)
        m = top_mask(jax.lax.stop_gradient(self.s), self.keep)
        m = m + (a - jax.lax.stop_gradient(a))  # straight-through: value M, gradient to |s|
        w = jax.lax.stop_gradient(self.w)
        alpha = jnp.sum(jnp.abs(w) * m) / jnp.sum(m)
        sign = jnp.where(w >= 0, 1.0, -1.0).astype(w.dtype)
        return alpha * sign * m

    def alpha(self) -> Array:
        m = self.mask()
        return jnp.sum(jnp.abs(self.w) * m) / jnp.sum(m)

    def apply(self, x: Array) -> Array:
        y = x @ self.effective_weight()
        return y if self.b is None else y + self.b

    def to_dense(self) -> Array:
        return self.effective_weight()

    def param_count(self) -> int:
        return self.n_keep + 1 + array_size(self.b)

    def storage_bits(self) -> int:
        return self.n_keep + ALPHA_BITS + array_bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return n_tokens * self.n_keep

    def trainable(self) -> "MaskedBinary":
        return dataclasses.replace(jax.tree_util.tree_map(lambda _: True, self), w=False)

    @property
    def bias(self):
        return self.b

    def with_bias(self, b):
        return dataclasses.replace(self, b=b)

    def freeze(self) -> "FrozenBinary":
        """The current weight as a :class:`FrozenBinary`: signs of the kept entries and
        ``alpha``, fixed. ``linear`` gives bit-identical outputs."""
        m = self.mask()
        sign = jnp.where(self.w >= 0, 1, -1).astype(jnp.int8)
        signs = (sign * m.astype(jnp.int8)).astype(jnp.int8)
        return FrozenBinary(signs=signs, alpha=jnp.asarray(self.alpha(), self.w.dtype), b=self.b,
                            n_keep=self.n_keep)

    def keep_inputs(self, idx):
        return self.freeze().keep_inputs(idx)

    def keep_outputs(self, idx):
        return self.freeze().keep_outputs(idx)

    def logical_axes(self):
        return {"w": ("in", "out"), "s": ("in", "out"), "b": ("out",)}


MaskedBinary = leaf_dataclass(MaskedBinary, meta=("keep",))


class FrozenBinary(Leaf):
    """A binary weight with its mask and gain fixed: ``W = alpha * signs``.

    Fields:
      signs: ``int8 [d_in, d_out]`` in ``{-1, 0, +1}`` (0 = pruned by the mask).
      alpha: float scalar gain (frozen).
      b: optional float bias ``[d_out]`` (trainable).
      n_keep: static number of non-zero signs (computed from ``signs`` when they are concrete).

    What a trained :class:`MaskedBinary` becomes for inference or surgery
    (:meth:`MaskedBinary.freeze`). Counts follow the same accounting: one bit per non-zero
    sign, one float32 ``alpha``, the bias in float.
    """

    signs: Array
    alpha: Array
    b: Array | None = None
    n_keep: int | None = None

    def __post_init__(self):
        if isinstance(self.signs, CONCRETE):
            if self.signs.ndim != 2:
                raise ShapeError(f"FrozenBinary: signs must be 2-D, got "
                                 f"{tuple(self.signs.shape)}")
            check_bias("FrozenBinary", self.b, self.signs.shape[1])
            if self.n_keep is None:  # static, so counts work on abstract and traced trees too
                object.__setattr__(self, "n_keep", int(np.count_nonzero(np.asarray(self.signs))))
        if self.n_keep is None:
            raise ShapeError("FrozenBinary: n_keep (the number of non-zero signs) must be given "
                             "when signs is not a concrete array", where="n_keep")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.signs.shape)

    def to_dense(self) -> Array:
        return self.alpha * self.signs.astype(jnp.asarray(self.alpha).dtype)

    def apply(self, x: Array) -> Array:
        y = x @ (self.alpha * self.signs.astype(x.dtype))
        return y if self.b is None else y + self.b

    def param_count(self) -> int:
        return self.n_keep + 1 + array_size(self.b)

    def storage_bits(self) -> int:
        return self.n_keep + ALPHA_BITS + array_bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return n_tokens * self.n_keep

    def trainable(self) -> "FrozenBinary":
        return dataclasses.replace(jax.tree_util.tree_map(lambda _: True, self), signs=False,
                                   alpha=False)

    @property
    def bias(self):
        return self.b

    def with_bias(self, b):
        return dataclasses.replace(self, b=b)

    def keep_inputs(self, idx):
        return FrozenBinary(signs=self.signs[idx], alpha=self.alpha, b=self.b)

    def keep_outputs(self, idx):
        return FrozenBinary(signs=self.signs[:, idx], alpha=self.alpha, b=slice_bias(self.b, idx))

    def logical_axes(self):
        return {"signs": ("in", "out"), "alpha": (), "b": ("out",)}


FrozenBinary = leaf_dataclass(FrozenBinary, meta=("n_keep",))


def init_masked_binary(key: Array, d_in: int, d_out: int, keep: float, *, bias: bool = False,
                       dtype=jnp.float32) -> MaskedBinary:
    """A fresh Biprop leaf: Kaiming-normal weights and scores ("Sparse Binary Transformers",
    sec. 3.2).

    Args:
      key: PRNG key.
      d_in, d_out: matrix shape.
      keep: fraction of weights kept.
      bias: whether to add a zero bias.
    """
    kw, ks = jax.random.split(key)
    std = np.sqrt(2.0 / d_in)
    w = std * jax.random.normal(kw, (d_in, d_out), dtype)
    s = std * jax.random.normal(ks, (d_in, d_out), dtype)
    b = jnp.zeros((d_out,), dtype) if bias else None
    return MaskedBinary(w=w, s=s, b=b, keep=keep)


__all__ = ["ALPHA_BITS", "FrozenBinary", "MaskedBinary", "init_masked_binary", "keep_count",
           "top_mask"]
