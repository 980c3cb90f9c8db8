"""LoRA: a frozen weight leaf of any type plus a trainable low-rank update.

"LoRA: Low-Rank Adaptation of Large Language Models" (Hu et al., arXiv:2106.09685), as the
appendix of "Less is More: Unlocking Specialization of Time Series Foundation Models via
Structured Pruning" (arXiv:2505.23195, App. C.2, Table 7) fine-tunes pruned models: the update's
dimensions are the *remaining* input and output widths of each pruned weight, so
:func:`add_lora` puts the update inside a :class:`~lowrank_jax.leaves.ChannelPruned` leaf (on
its kept channels) rather than around it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, LeafTypeError, ShapeError
from lowrank_jax.leaves.base import (
    CONCRETE,
    Array,
    Leaf,
    array_bits,
    array_size,
    bias_of,
    keep_inputs,
    keep_outputs,
    leaf_dataclass,
    leaf_dtype,
    linear,
    materialize,
)
from lowrank_jax.leaves.channel_masked import ChannelMasked, ChannelPruned, rebuild
from lowrank_jax.leaves.dense import Dense


class LoRA(Leaf):
    """``W = W_base + scale * a @ b`` with ``W_base`` frozen and ``a``, ``b`` trained.

    ``linear(LoRA(base, a, b, scale), x) = linear(base, x) + scale * (x @ a) @ b`` (LoRA,
    eq. 3: ``h = W_0 x + B A x`` with ``scale = alpha / r``).

    Fields:
      base: any weight leaf ``[d_in, d_out]``, bias included; frozen (:meth:`trainable`
        marks all of it ``False``).
      a: ``[d_in, r]`` (LoRA's ``A^T``; random at initialization).
      b: ``[r, d_out]`` (LoRA's ``B^T``; zero at initialization, so the leaf starts equal to
        its base).
      scale: static ``alpha / r``.

    Counts: the base's plus ``r (d_in + d_out)`` parameters and multiply-adds per token.
    :meth:`to_dense` (:func:`~lowrank_jax.materialize`) is ``W_base + scale * a @ b``.
    Surgery slices the base and the update together.
    """

    base: Any
    a: Array
    b: Array
    scale: float = 1.0

    def __post_init__(self):
        if not isinstance(self.base, Leaf):
            raise LeafTypeError(f"LoRA: base must be a weight leaf, got "
                                f"{type(self.base).__name__}", where="base", expected="Leaf",
                                actual=type(self.base).__name__)
        if isinstance(self.a, CONCRETE) and isinstance(self.b, CONCRETE):
            d_in, d_out = self.base.shape
            if (self.a.ndim != 2 or self.b.ndim != 2 or self.a.shape[0] != d_in
                    or self.b.shape[1] != d_out or self.a.shape[1] != self.b.shape[0]):
                raise ShapeError(
                    f"LoRA: expected a [{d_in}, r] and b [r, {d_out}] for a base of shape "
                    f"{self.base.shape}, got a {tuple(self.a.shape)} and b {tuple(self.b.shape)}",
                    where="a", expected=f"a [{d_in}, r], b [r, {d_out}]",
                    actual=(tuple(self.a.shape), tuple(self.b.shape)))
        object.__setattr__(self, "scale", float(self.scale))

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    def apply(self, x: Array) -> Array:
        return linear(self.base, x) + self.scale * ((x @ self.a) @ self.b)

    def to_dense(self) -> Array:
        w = materialize(self.base)
        return w + (self.scale * (self.a @ self.b)).astype(w.dtype)

    def param_count(self) -> int:
        return self.base.param_count() + array_size(self.a) + array_size(self.b)

    def storage_bits(self) -> int:
        return self.base.storage_bits() + array_bits(self.a) + array_bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return self.base.flops(n_tokens) + n_tokens * self.rank * (self.d_in + self.d_out)

    def trainable(self) -> "LoRA":
        frozen = jax.tree_util.tree_map(lambda _: False, self.base)
        return rebuild(self, base=frozen, a=True, b=True)

    @property
    def bias(self):
        return bias_of(self.base)

    def with_bias(self, b):
        return dataclasses.replace(self, base=self.base.with_bias(b))

    def keep_inputs(self, idx):
        if not len(idx):  # the update would multiply zeros: rank 0
            return LoRA(base=keep_inputs(self.base, idx), a=self.a[:0, :0], b=self.b[:0],
                        scale=self.scale)
        return LoRA(base=keep_inputs(self.base, idx), a=self.a[idx], b=self.b, scale=self.scale)

    def keep_outputs(self, idx):
        if not len(idx):
            return LoRA(base=keep_outputs(self.base, idx), a=self.a[:, :0], b=self.b[:0, :0],
                        scale=self.scale)
        return LoRA(base=keep_outputs(self.base, idx), a=self.a, b=self.b[:, idx],
                    scale=self.scale)

    def logical_axes(self):
        return {"a": ("in", "rank"), "b": ("rank", "out")}


LoRA = leaf_dataclass(LoRA, meta=("scale",))


def init_lora(key: Array, base: Leaf, rank: int, *, alpha: float | None = None) -> LoRA:
    """A LoRA leaf on ``base`` that computes exactly what ``base`` computes.

    As in LoRA (sec. 4.1): ``a`` (``A^T``) is drawn from ``N(0, 1/d_in)``, ``b`` (``B^T``) is
    zero, and the update is scaled by ``alpha / rank`` (default ``alpha = rank``: scale 1).

    Args:
      key: PRNG key.
      base: the weight leaf to adapt (frozen).
      rank: the update's rank ``r >= 1``.
      alpha: LoRA's ``alpha``.

    Returns:
      The :class:`LoRA` leaf.
    """
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ConfigError(f"init_lora: rank must be an int >= 1, got {rank!r}", where="rank",
                          expected="int >= 1", actual=rank)
    dt = leaf_dtype(base)
    d_in, d_out = base.shape
    a = jax.random.normal(key, (d_in, int(rank)), dt) / np.sqrt(max(d_in, 1))
    b = jnp.zeros((int(rank), d_out), dt)
    alpha = float(rank) if alpha is None else float(alpha)
    return LoRA(base=base, a=a, b=b, scale=alpha / float(rank))


def add_lora(key: Array, leaf: Leaf, rank: int, *, alpha: float | None = None) -> Leaf:
    """``leaf`` with a LoRA update on the channels it actually has.

    A :class:`~lowrank_jax.leaves.ChannelPruned` leaf gets the update on its kept channels
    (the paper's "dimensions of LoRA matrices depend on the remaining input/output
    dimensions"), a :class:`~lowrank_jax.leaves.ChannelMasked` leaf inside its masks; any other
    leaf is wrapped (:func:`init_lora`). The rank is capped at ``min(d_in, d_out)`` of the
    adapted leaf (at least 1).

    Args:
      key: PRNG key.
      leaf: a weight leaf.
      rank: the update's rank.
      alpha: LoRA's ``alpha`` (default: the rank used).
    """
    if isinstance(leaf, ChannelPruned):
        return dataclasses.replace(leaf, base=add_lora(key, leaf.base, rank, alpha=alpha))
    if isinstance(leaf, ChannelMasked):
        return dataclasses.replace(leaf, base=add_lora(key, leaf.base, rank, alpha=alpha))
    if isinstance(leaf, LoRA):
        raise LeafTypeError("add_lora: the leaf already has a LoRA update; merge_lora it first",
                            expected="a leaf without LoRA", actual="LoRA")
    r = max(1, min(int(rank), *leaf.shape)) if min(leaf.shape) > 0 else int(rank)
    return init_lora(key, leaf, r, alpha=None if alpha is None else alpha * r / int(rank))


def merge_lora(leaf: Leaf) -> Leaf:
    """A LoRA leaf on a :class:`~lowrank_jax.Dense` base as one dense leaf (``w + scale a b``,
    the base's bias); LoRA leaves inside :class:`~lowrank_jax.leaves.ChannelPruned` leaves are
    merged in place. Other leaves are returned unchanged, and so is a LoRA on any other base
    (merging would change its type and size: :func:`~lowrank_jax.materialize` gives the dense
    matrix)."""
    if isinstance(leaf, ChannelPruned):
        return dataclasses.replace(leaf, base=merge_lora(leaf.base))
    if isinstance(leaf, LoRA) and isinstance(leaf.base, Dense):
        return Dense(w=leaf.to_dense(), b=leaf.base.b)
    return leaf


def is_lora(x: Any) -> bool:
    """Whether ``x`` is a :class:`LoRA` leaf."""
    return isinstance(x, LoRA)


__all__ = ["LoRA", "add_lora", "init_lora", "is_lora", "merge_lora"]
