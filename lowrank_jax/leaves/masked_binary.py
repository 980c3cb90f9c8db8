"""Biprop masked-binary weights ("Sparse Binary Transformers for Multivariate Time Series
Modeling", sec. 3.2, eqs. 1-2) and their frozen form."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves.base import (
    CONCRETE,
    Array,
    Leaf,
    _StoredBias,
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


def kth_largest_key(key: Array, k: int) -> Array:
    """The ``k``-th largest of unsigned integer keys along the last axis, row by row, by radix
    select: the answer's bits are decided from the top one down, each by counting the keys at
    least the candidate (one pass per bit of the key type). Float bit patterns mapped to keys
    that order as the floats do make this an exact k-th largest float without sorting.

    Args:
      key: ``uint[..., n]``.
      k: in ``[1, n]``.

    Returns:
      ``uint[...]``, same dtype as ``key``.
    """
    utype = key.dtype
    bits = jnp.dtype(utype).itemsize * 8

    def next_bit(i, prefix):
        cand = prefix | (jnp.asarray(1, utype) << (bits - 1 - i).astype(utype))
        count = jnp.sum(key >= cand[..., None], axis=-1, dtype=jnp.int32)
        return jnp.where(count >= k, cand, prefix)

    return jax.lax.fori_loop(0, bits, next_bit, jnp.zeros(key.shape[:-1], utype))


def top_mask(scores: Array, keep: float) -> Array:
    """"Sparse Binary Transformers" eq. 1: 1 for the ``keep_count`` largest ``|scores|`` of the
    layer, else 0; among equal scores at the threshold the lowest flat indices are kept (as
    ``lax.top_k`` orders them; NaN counts as the largest).

    Selected by radix select instead of ``lax.top_k`` (which sorts: at ``keep = 0.5`` that is
    a sort of the whole layer on every forward, 15-25x the cost of the layer's matmul at
    ``d = 1024`` on CPU). The bit patterns of non-negative floats order as the floats do, so the
    ``k``-th largest ``|s|`` is found one bit at a time from the top: ``b`` passes (the float
    width) that count how many patterns are at least the candidate. The mask is then
    ``|s| > v``, plus the first ``need`` entries equal to ``v`` (a running count, computed only
    when there are more of them than needed). Same mask as ``top_k``, element for element.
    """
    n = int(np.prod(scores.shape))
    k = keep_count(n, keep)
    a = jnp.abs(scores).reshape(-1)
    utype = jnp.dtype(f"uint{jnp.dtype(a.dtype).itemsize * 8}")
    key = jax.lax.bitcast_convert_type(a, utype)
    v = kth_largest_key(key[None], k)[0]  # the k-th largest key
    above, tied = key > v, key == v
    need = k - jnp.sum(above, dtype=jnp.int32)
    keep_mask = jax.lax.cond(
        jnp.sum(tied, dtype=jnp.int32) == need,
        lambda: above | tied,
        lambda: above | (tied & (jnp.cumsum(tied, dtype=jnp.int32) <= need)))
    return keep_mask.astype(scores.dtype).reshape(scores.shape)


def alpha_divisor(n: int, keep: float) -> int:
    """Divisor of the Biprop gain: ``floor(keep * n)`` (at least 1).

    The reference Biprop code (``GetQuantnet_binary``: ``num_unpruned = int(k * numel)``)
    divides ``||M * W||_1`` by ``floor(k n)``, not by the number of kept entries
    ``n - floor((1 - k) n)`` (:func:`keep_count`); the two differ by one when ``k n`` is not an
    integer (``n = 35, k = 0.3``: 10 vs 11). lowrank_jax follows the reference, so a trained
    model gives the reference's outputs. ``max(1, .)`` only guards ``k n < 1``, where the
    reference divides by zero.
    """
    return max(1, int(keep * n))


def pairwise_sum(a: Array) -> Array:
    """Sum of all entries in a fixed pairwise order (halving by elementwise adds).

    XLA may reduce in a different order when a sum is fused with its producers, so ``jnp.sum``
    can differ by an ulp between a jitted and an eager run. Elementwise adds have one order,
    so this sum is bit-identical in every context: the gain ``alpha`` of a jitted
    :class:`MaskedBinary` equals the one stored by :meth:`MaskedBinary.freeze` and by the
    packed leaf, and their outputs match exactly.
    """
    v = jnp.reshape(a, (-1,))
    n = v.shape[0]
    size = 1 << max(0, (n - 1).bit_length())
    if size != n:
        v = jnp.concatenate([v, jnp.zeros((size - n,), v.dtype)])
    while v.shape[0] > 1:
        half = v.shape[0] // 2
        v = v[:half] + v[half:]
    return v[0]


class MaskedBinary(_StoredBias, Leaf):
    """Biprop weight: ``W_eff = alpha * sign(w) * M`` with ``M`` chosen by scores
    ("Sparse Binary Transformers for Multivariate Time Series Modeling", Gorbett et al.,
    arXiv:2308.04637, sec. 3.2 eqs. 1-2; Biprop from "Multi-Prize Lottery Ticket Hypothesis",
    Diffenderfer & Kailkhura, arXiv:2103.09377).

    Fields:
      w: float weights ``[d_in, d_out]`` (random, frozen in Biprop: :meth:`trainable` marks them
        ``False``, so :func:`~lowrank_jax.partition` keeps them out of ``jax.grad``).
      s: scores ``[d_in, d_out]`` (trained).
      b: optional bias ``[d_out]`` (trained, kept in float). For a frozen bias (the SBT's
        attention projections) wrap the leaf in :class:`FixedBias`.
      keep: static fraction of weights kept (``1 - p`` in the paper's prune rate ``p``).
      divisor: static divisor of ``alpha``: ``'reference'`` (default, ``floor(keep n)`` as the
        reference code) or ``'kept'`` (the number of kept entries, ``||M||_1``, as the paper
        writes and lowrank_jax 0.1 computed; checkpoints written by 0.1 load with it, so they
        keep giving the outputs they were trained to give).

    Forward (eqs. 1-2, as the reference code computes them): ``M`` is 1 on the
    :func:`keep_count` ``= n - floor((1 - keep) n)`` largest ``|s|`` of the layer and
    ``alpha = ||M * w||_1 / floor(keep n)`` (:func:`alpha_divisor`; the paper writes
    ``||M||_1``, the code divides by ``floor(k n)``, which can be one less). ``sign(0)`` is
    taken as ``+1`` so every kept weight is exactly ``+-alpha`` (one bit).

    Backward: exactly the reference Biprop estimator (chrundle/biprop ``GetQuantnet_binary``,
    also used by the paper's code): with ``G = dL/dW_eff``, the scores receive
    ``dL/ds = (G * w) * sign(s)``; no gradient flows through ``alpha`` and none reaches ``w``.
    It is implemented as ``W_eff = sign(w) * q`` with
    ``q = sg(alpha) M + (|s| |w| - sg(|s| |w|))``, whose value is ``alpha M`` exactly and whose
    derivative in ``s`` is ``|w| sign(s)``. (lowrank_jax 0.1 instead passed ``alpha sign(w) G``
    to ``|s|`` plus a term through ``alpha``; no result depended on it, so it was dropped in
    favour of the estimator the paper's numbers were obtained with.)

    Counts: ``param_count = n_keep + 1`` (alpha) plus bias; ``storage_bits = n_keep`` bits + one
    float32 alpha + bias, the accounting of sec. 5.1 (mask positions are not counted here; the
    paper's own Table 6 counts every position, see
    :mod:`lowrank_jax.analysis.sbt_accounting`, and :class:`~lowrank_jax.leaves.PackedBinary`
    stores what it takes to run); ``flops = n_tokens * n_keep`` non-zero multiply-adds
    (Table 5).

    Surgery: removing channels would change which scores are in the top fraction and the
    gain; :meth:`keep_inputs` / :meth:`keep_outputs` therefore first :meth:`freeze` the leaf
    (mask and ``alpha`` fixed at their current values) and slice the frozen form, which
    computes exactly what this leaf computed on the kept channels.
    """

    w: Array
    s: Array
    b: Array | None = None
    keep: float = 0.5
    divisor: str = "reference"

    def __post_init__(self):
        if not (isinstance(self.keep, (int, float)) and 0.0 < self.keep <= 1.0):
            raise ConfigError(f"MaskedBinary: keep fraction must be in (0, 1], got {self.keep!r}",
                              where="keep", expected="(0, 1]", actual=self.keep)
        if self.divisor not in ("reference", "kept"):
            raise ConfigError(f"MaskedBinary: divisor must be 'reference' or 'kept', got "
                              f"{self.divisor!r}", where="divisor",
                              expected="'reference' or 'kept'", actual=self.divisor)
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

    def alpha(self) -> Array:
        """``||M * w||_1 / floor(keep n)`` (``/ n_keep`` with ``divisor='kept'``; no gradient
        path)."""
        w = jax.lax.stop_gradient(self.w)
        kept = jnp.abs(w) * self.mask()
        # A true division in every context: under jit XLA would turn division by a constant
        # into a multiplication by its reciprocal (an ulp away from the eager value).
        div = jax.lax.optimization_barrier(
            jnp.asarray(self.n_keep if self.divisor == "kept"
                        else alpha_divisor(self.d_in * self.d_out, self.keep), kept.dtype))
        return pairwise_sum(kept) / div

    def signs(self) -> Array:
        """``sign(w)`` with ``sign(0) = +1``, in ``w``'s dtype."""
        w = jax.lax.stop_gradient(self.w)
        return jnp.where(w >= 0, 1.0, -1.0).astype(w.dtype)

    def effective_weight(self) -> Array:
        w = jax.lax.stop_gradient(self.w)
        m = self.mask()
        a = jnp.abs(self.s) * jnp.abs(w)
        # value: alpha * M exactly (a - sg(a) == 0); gradient in s: |w| sign(s) (reference).
        q = self.alpha() * m + (a - jax.lax.stop_gradient(a))
        return self.signs() * q

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

    def freeze(self) -> "FrozenBinary":
        """The current weight as a :class:`FrozenBinary`: signs of the kept entries and
        ``alpha``, fixed. ``linear`` gives bit-identical outputs."""
        m = self.mask()
        sign = jnp.where(self.w >= 0, 1, -1).astype(jnp.int8)
        signs = (sign * m.astype(jnp.int8)).astype(jnp.int8)  # alpha: the reference divisor
        return FrozenBinary(signs=signs, alpha=jnp.asarray(self.alpha(), self.w.dtype), b=self.b,
                            n_keep=self.n_keep)

    def keep_inputs(self, idx):
        return self.freeze().keep_inputs(idx)

    def keep_outputs(self, idx):
        return self.freeze().keep_outputs(idx)

    def logical_axes(self):
        return {"w": ("in", "out"), "s": ("in", "out"), "b": ("out",)}


MaskedBinary = leaf_dataclass(MaskedBinary, meta=("keep", "divisor"))


class FrozenBinary(_StoredBias, Leaf):
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

    def keep_inputs(self, idx):
        return FrozenBinary(signs=self.signs[idx], alpha=self.alpha, b=self.b)

    def keep_outputs(self, idx):
        return FrozenBinary(signs=self.signs[:, idx], alpha=self.alpha, b=slice_bias(self.b, idx))

    def logical_axes(self):
        return {"signs": ("in", "out"), "alpha": (), "b": ("out",)}


FrozenBinary = leaf_dataclass(FrozenBinary, meta=("n_keep",))


def init_masked_binary(key: Array, d_in: int, d_out: int, keep: float, *, bias: bool = False,
                       dtype=jnp.float32) -> MaskedBinary:
    """A fresh Biprop leaf: weights and scores drawn independently from
    ``U(-1/sqrt(d_in), 1/sqrt(d_in))``.

    "Sparse Binary Transformers for Multivariate Time Series Modeling" (arXiv:2308.04637,
    sec. 3.2) says Kaiming normal, but its configurations leave the weight and score inits
    unset, so its code draws both from PyTorch's ``nn.Linear`` default ``U(+-1/sqrt(fan_in))``;
    we follow the code, whose numbers the paper reports. Every call draws its own weights and
    scores (the reference deep-copies one encoder layer, so its layers start identical; that
    is not reproduced: give every layer its own ``key``).

    Args:
      key: PRNG key.
      d_in, d_out: matrix shape (``fan_in = d_in``).
      keep: fraction of weights kept.
      bias: add a bias drawn from the same uniform (``nn.Linear``'s default), trainable.
    """
    for name, val in (("d_in", d_in), ("d_out", d_out)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ConfigError(f"init_masked_binary: {name} must be a positive int, got {val!r}",
                              where=name, expected="int >= 1", actual=val)
    kw, ks, kb = jax.random.split(key, 3)
    bound = 1.0 / np.sqrt(d_in)
    w = jax.random.uniform(kw, (d_in, d_out), dtype, -bound, bound)
    s = jax.random.uniform(ks, (d_in, d_out), dtype, -bound, bound)
    b = jax.random.uniform(kb, (d_out,), dtype, -bound, bound) if bias else None
    return MaskedBinary(w=w, s=s, b=b, keep=keep)


class FixedBias(Leaf):
    """Any weight leaf plus a *frozen* bias: ``linear(FixedBias(leaf, b), x) = linear(leaf, x)
    + b``.

    The sparse binary transformer's reference code keeps the random biases of the Q, K, V and
    output projections of every attention block and never trains them ("Sparse Binary
    Transformers for Multivariate Time Series Modeling", arXiv:2308.04637; the code's
    ``MultiheadAttention(bias=True)`` with only scores trainable). :meth:`trainable` marks
    ``b`` ``False`` and defers to the wrapped leaf for the rest.

    Counts: the wrapped leaf's plus ``d_out`` float parameters (``32 d_out`` bits for
    float32). Surgery slices the wrapped leaf and the bias together.
    """

    leaf: Any
    b: Array

    def __post_init__(self):
        if not isinstance(self.leaf, Leaf):
            raise ShapeError(f"FixedBias: leaf must be a weight leaf, got "
                             f"{type(self.leaf).__name__}", where="leaf")
        if self.leaf.bias is not None:
            raise ShapeError("FixedBias: the wrapped leaf already has a bias; pass it without one",
                             where="leaf/b")
        check_bias("FixedBias", self.b, self.leaf.d_out)

    @property
    def shape(self) -> tuple[int, int]:
        return self.leaf.shape

    def apply(self, x: Array) -> Array:
        return self.leaf.apply(x) + self.b

    def to_dense(self) -> Array:
        return self.leaf.to_dense()

    def param_count(self) -> int:
        return self.leaf.param_count() + array_size(self.b)

    def storage_bits(self) -> int:
        return self.leaf.storage_bits() + array_bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return self.leaf.flops(n_tokens)

    def trainable(self) -> "FixedBias":
        inner = self.leaf.trainable()
        obj = object.__new__(FixedBias)
        object.__setattr__(obj, "leaf", inner)
        object.__setattr__(obj, "b", False)
        return obj

    @property
    def bias(self):
        return self.b

    def with_bias(self, b):
        return self.leaf if b is None else FixedBias(self.leaf, b)

    def keep_inputs(self, idx):
        return FixedBias(self.leaf.keep_inputs(idx), self.b)

    def keep_outputs(self, idx):
        return FixedBias(self.leaf.keep_outputs(idx), slice_bias(self.b, idx))

    def logical_axes(self):
        return {"b": ("out",)}


FixedBias = leaf_dataclass(FixedBias)


def with_kept_divisor(tree: Any) -> Any:
    """``tree`` with every :class:`MaskedBinary` set to ``divisor='kept'``: lowrank_jax 0.1
    divided Biprop's gain by the kept count, so a tree it saved keeps computing what it was
    trained to compute (checkpoint readers upgrade such trees with this)."""
    def fix(x):
        return dataclasses.replace(x, divisor="kept") if isinstance(x, MaskedBinary) else x

    return jax.tree_util.tree_map(fix, tree, is_leaf=lambda x: isinstance(x, MaskedBinary))


__all__ = ["ALPHA_BITS", "FixedBias", "FrozenBinary", "MaskedBinary", "alpha_divisor",
           "kth_largest_key",
           "init_masked_binary", "keep_count", "pairwise_sum", "top_mask", "with_kept_divisor"]
