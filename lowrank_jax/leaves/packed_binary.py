"""Binary weights stored as bits: signs and mask packed into ``uint32`` words, one float32
gain per layer.

"Sparse Binary Transformers for Multivariate Time Series Modeling" (arXiv:2308.04637, sec. 5.1)
counts 1 bit per weight but, as it says, PyTorch has no binary type, so its models are stored
in float32. :class:`PackedBinary` stores what a trained :class:`~lowrank_jax.MaskedBinary`
needs to run, as bits:

* ``sign_bits``: ``uint32 [d_out, ceil(d_in / 32)]``; bit ``k`` of word ``q`` of row ``j`` is
  1 when weight ``(32 q + k, j)`` is negative (larq's convention; ``sign(0) = +1``); tail bits
  are 0. Words run along ``d_in``, the reduction axis, so that the XNOR / popcount product
  (:func:`xnor_dot`) reads them directly.
* ``mask_bits``: same layout, 1 where the weight is kept.
* ``alpha``: the float32 gain.

2 bits per weight: against float32 weights that is a 16x reduction at most (a bias, the gain
and the file's own structure take a little more). Storing only the signs of kept weights
(mask + ``n_keep`` sign bits, 1.5 bits per weight at p = 0.5, 21x) would need a prefix sum to
unpack; the fixed two-plane layout keeps unpacking a shift and a mask.

``linear`` unpacks inside the jitted computation to ``alpha * sign * mask`` in float, the very
matrix the float leaf builds, and multiplies: outputs equal the float masked-binary leaf's
exactly (same values, same matmul). The unpacking writes the float32 bit patterns directly
(:func:`unpacked_weight`: the gain's bits with the sign bit flipped where the weight is negative,
zeroed where it is pruned: a few shifts and bitwise operations per weight), so a packed
``linear`` costs what the frozen float leaf (:class:`~lowrank_jax.FrozenBinary`) costs, whose
``int8`` signs are converted and scaled on every call (``benchmarks/layers/binary.py``). A Pallas
kernel that unpacks the bits inside the matmul (:mod:`lowrank_jax.leaves.packed_kernels`; its
outputs equal this one's to float32 round-off, not bit for bit) runs instead where the
execution setting ``packed_kernel`` asks for it: ``'on'``, or ``'auto'`` (the default) on a
backend, Pallas backend and JAX version on which it has been checked against NumPy (none yet).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import LeafTypeError, ShapeError
from lowrank_jax.leaves import packed_kernels
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
from lowrank_jax.leaves.masked_binary import FrozenBinary, MaskedBinary

WORD = 32


def n_words(n: int) -> int:
    """``ceil(n / 32)``."""
    return -(-int(n) // WORD)


def pack_bits(bits) -> np.ndarray:
    """Pack a boolean ``[..., n]`` array into ``uint32 [..., ceil(n / 32)]`` words along the
    last axis: element ``32 q + k`` is bit ``k`` (least significant first) of word ``q``; tail
    bits are 0."""
    b = np.asarray(bits, bool)
    n = b.shape[-1]
    pad = n_words(n) * WORD - n
    if pad:
        b = np.concatenate([b, np.zeros(b.shape[:-1] + (pad,), bool)], axis=-1)
    b = b.reshape(b.shape[:-1] + (n_words(n), WORD)).astype(np.uint64)  # also when empty
    words = np.sum(b << np.arange(WORD, dtype=np.uint64), axis=-1)
    return words.astype(np.uint32)


def unpack_bits(words: Array, n: int) -> Array:
    """Inverse of :func:`pack_bits` (jit-friendly): ``uint32 [..., W] -> uint32 [..., n]`` of
    0/1."""
    w = jnp.asarray(words, jnp.uint32)
    shifts = jnp.arange(WORD, dtype=jnp.uint32)
    bits = (w[..., None] >> shifts) & jnp.uint32(1)  # [..., W, 32]
    return bits.reshape(w.shape[:-1] + (w.shape[-1] * WORD,))[..., :n]


def _in_memory(a: Array) -> Array:
    """``a``, as an array XLA keeps in memory instead of fusing it into its consumer.

    A maximum over ``a`` stacked with zeros is a reduction, which XLA:CPU does not duplicate
    into an elementwise consumer (an ``optimization_barrier`` does not stop that fusion). Used
    for the transposed words (``1/32`` of the weight's elements): fused, the unpacking would read
    them with a stride of a row per element, which made it 4x slower at ``d = 1024``.
    """
    return jnp.max(jnp.stack([a, jnp.zeros_like(a)]), axis=0)


def unpacked_weight(sign_bits: Array, mask_bits: Array, alpha: Array, d_in: int) -> Array:
    """``alpha * sign * mask`` as float32 ``[d_in, d_out]``, jit-friendly.

    Built from bit patterns rather than products: a kept weight is ``alpha``'s float32 bits with
    the sign bit flipped where its sign bit is 1 (exactly ``-alpha``), a pruned one is all zero
    bits (``+0.0``). The values equal the float leaf's ``sign * (alpha * mask)`` (up to the sign
    of zeros). The words are transposed first (``[words, d_out]``, kept in memory), so that one
    elementwise pass writes the weight row by row while reading the words contiguously: about
    the cost of converting a :class:`~lowrank_jax.FrozenBinary`'s ``int8`` signs.

    Args:
      sign_bits, mask_bits: ``uint32 [d_out, ceil(d_in / 32)]`` (:func:`pack_bits` layout).
      alpha: scalar gain (cast to float32).
      d_in: number of inputs (the words hold ``32 ceil(d_in / 32)`` bits; the tail is dropped).
    """
    shifts = jnp.arange(WORD, dtype=jnp.uint32)[:, None]  # [32, 1]
    planes = jnp.stack([jnp.asarray(sign_bits, jnp.uint32), jnp.asarray(mask_bits, jnp.uint32)])
    planes_t = _in_memory(planes.transpose(0, 2, 1))  # [2, W, d_out], one pass for both
    neg_t, keep_t = planes_t[0][:, None, :], planes_t[1][:, None, :]  # [W, 1, d_out]
    neg = (neg_t >> shifts) & jnp.uint32(1)  # [W, 32, d_out]: input 32 q + k, output j
    keep = (keep_t >> shifts) & jnp.uint32(1)
    a = jax.lax.bitcast_convert_type(jnp.asarray(alpha, jnp.float32), jnp.uint32)
    # (0 - keep) is all ones where kept, all zeros where pruned.
    bits = (a ^ (neg << jnp.uint32(31))) & (jnp.uint32(0) - keep)
    w = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return w.reshape(w.shape[0] * WORD, w.shape[-1])[:d_in]


class PackedBinary(_StoredBias, Leaf):
    """A binary weight ``W = alpha * sign * mask`` stored as sign and mask bit planes.

    Fields:
      sign_bits: ``uint32 [d_out, ceil(d_in / 32)]`` (1 = negative).
      mask_bits: ``uint32 [d_out, ceil(d_in / 32)]`` (1 = kept).
      alpha: float32 scalar gain.
      b: optional float bias ``[d_out]``.
      d_in: static input width (the words hold ``ceil(d_in / 32) * 32`` bits).
      n_keep: static number of kept weights.

    Build one with :meth:`from_leaf` (a trained :class:`~lowrank_jax.MaskedBinary` or a
    :class:`~lowrank_jax.FrozenBinary`) or :func:`pack_binary_tree`. Inference only: the bit
    planes and ``alpha`` are frozen (:meth:`trainable`), the bias may be trained.

    Counts: ``storage_bits`` is what is stored: both bit planes with their padding, the
    float32 gain and the bias; ``param_count = n_keep + 1`` (+ bias) as for the float leaf;
    ``flops`` counts the multiply-adds executed by :meth:`apply`, which runs the unpacked
    matrix densely: ``n_tokens * d_in * d_out`` (the paper's non-zero count is
    ``n_tokens * n_keep``).
    """

    sign_bits: Array
    mask_bits: Array
    alpha: Array
    b: Array | None = None
    d_in: int = 0
    n_keep: int | None = None

    def __post_init__(self):
        if not isinstance(self.d_in, (int, np.integer)) or self.d_in < 0:
            raise ShapeError(f"PackedBinary: d_in must be an int >= 0, got {self.d_in!r}",
                             where="d_in", expected=">= 0", actual=self.d_in)
        for name in ("sign_bits", "mask_bits"):
            a = getattr(self, name)
            if isinstance(a, CONCRETE):
                if a.dtype != np.uint32 or a.ndim != 2 or a.shape[1] != n_words(self.d_in):
                    raise ShapeError(
                        f"PackedBinary: {name} must be uint32 [d_out, {n_words(self.d_in)}] for "
                        f"d_in={self.d_in}, got {a.dtype}{list(a.shape)}", where=name,
                        expected=("uint32", n_words(self.d_in)),
                        actual=(str(a.dtype), tuple(a.shape)))
        if isinstance(self.sign_bits, CONCRETE) and isinstance(self.mask_bits, CONCRETE):
            if self.sign_bits.shape != self.mask_bits.shape:
                raise ShapeError("PackedBinary: sign_bits and mask_bits differ in shape: "
                                 f"{self.sign_bits.shape} vs {self.mask_bits.shape}",
                                 where="mask_bits", expected=tuple(self.sign_bits.shape),
                                 actual=tuple(self.mask_bits.shape))
            check_bias("PackedBinary", self.b, self.sign_bits.shape[0])
            if self.n_keep is None:
                mb = np.asarray(self.mask_bits)
                object.__setattr__(self, "n_keep", int(np.unpackbits(
                    mb.view(np.uint8)).sum()))
        if self.n_keep is None:
            raise ShapeError("PackedBinary: n_keep must be given when mask_bits is not a "
                             "concrete array", where="n_keep")

    @classmethod
    def from_leaf(cls, leaf: Any) -> "PackedBinary":
        """Pack a :class:`~lowrank_jax.MaskedBinary` (its current mask, signs and gain) or a
        :class:`~lowrank_jax.FrozenBinary`."""
        if isinstance(leaf, MaskedBinary):
            leaf = leaf.freeze()
        if not isinstance(leaf, FrozenBinary):
            raise LeafTypeError(f"PackedBinary.from_leaf: expected a MaskedBinary or "
                                f"FrozenBinary leaf, got {type(leaf).__name__}", where="leaf",
                                expected="MaskedBinary | FrozenBinary",
                                actual=type(leaf).__name__)
        signs = np.asarray(leaf.signs).T  # [d_out, d_in] in {-1, 0, 1}
        return cls(sign_bits=jnp.asarray(pack_bits(signs < 0)),
                   mask_bits=jnp.asarray(pack_bits(signs != 0)),
                   alpha=jnp.asarray(leaf.alpha, jnp.float32), b=leaf.b,
                   d_in=int(signs.shape[1]), n_keep=int(np.count_nonzero(signs)))

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.d_in), int(self.sign_bits.shape[0]))

    def planes(self) -> tuple[Array, Array]:
        """``(sign, mask)`` as float32 ``[d_in, d_out]``: ``sign`` in ``{-1, +1}``, ``mask`` in
        ``{0, 1}`` (unpacked inside the traced computation)."""
        neg = unpack_bits(self.sign_bits, self.d_in).T
        keep = unpack_bits(self.mask_bits, self.d_in).T
        sign = 1.0 - 2.0 * neg.astype(jnp.float32)
        return sign, keep.astype(jnp.float32)

    def to_dense(self) -> Array:
        # the float leaf's values: sign(w) * (alpha * M)
        return unpacked_weight(self.sign_bits, self.mask_bits, self.alpha, self.d_in)

    def apply(self, x: Array) -> Array:
        if packed_kernels.use_kernel() and self.d_in and self.d_out:  # no grid over nothing
            y = packed_kernels.packed_matmul(x, self.sign_bits, self.mask_bits, self.alpha,
                                             self.d_in)
        else:
            # The float leaf's [d_in, d_out] matrix and dot. The barrier keeps XLA from fusing
            # the unpacking into a small dot (a fused producer changes the CPU dot's summation
            # order): the product is the float leaf's, bit for bit.
            y = x @ jax.lax.optimization_barrier(self.to_dense())
        return y if self.b is None else y + self.b

    def signs_int8(self) -> np.ndarray:
        """Host copy of the ternary signs ``int8 [d_in, d_out]`` in ``{-1, 0, +1}``."""
        sign, mask = self.planes()
        return (np.asarray(sign) * np.asarray(mask)).astype(np.int8)

    def param_count(self) -> int:
        return self.n_keep + 1 + array_size(self.b)

    def storage_bits(self) -> int:
        return (array_bits(self.sign_bits) + array_bits(self.mask_bits) + 32
                + array_bits(self.b))

    def flops(self, n_tokens: int) -> int:
        return int(n_tokens) * self.d_in * self.d_out

    def trainable(self) -> "PackedBinary":
        return dataclasses.replace(jax.tree_util.tree_map(lambda _: True, self),
                                   sign_bits=False, mask_bits=False, alpha=False)

    def _frozen(self) -> FrozenBinary:
        return FrozenBinary(signs=jnp.asarray(self.signs_int8()), alpha=self.alpha, b=self.b)

    def keep_inputs(self, idx):
        return PackedBinary.from_leaf(self._frozen().keep_inputs(idx))

    def keep_outputs(self, idx):
        out = PackedBinary.from_leaf(self._frozen().keep_outputs(idx))
        return dataclasses.replace(out, b=slice_bias(self.b, idx))

    def logical_axes(self):
        return {"sign_bits": ("out", None), "mask_bits": ("out", None), "alpha": (),
                "b": ("out",)}


PackedBinary = leaf_dataclass(PackedBinary, meta=("d_in", "n_keep"))


def _is_binary(x) -> bool:
    return isinstance(x, (MaskedBinary, FrozenBinary))


@jax.jit
def _freeze_all(leaves: list) -> list:
    """Every :class:`MaskedBinary` of ``leaves`` frozen, in one compiled program: frozen one by
    one, each leaf's mask selection (a loop and a branch) is compiled anew on every call."""
    return [x.freeze() if isinstance(x, MaskedBinary) else x for x in leaves]


def pack_binary_tree(params: Any) -> Any:
    """``params`` with every :class:`~lowrank_jax.MaskedBinary` and
    :class:`~lowrank_jax.FrozenBinary` replaced by its :class:`PackedBinary` (wrappers such
    as :class:`~lowrank_jax.leaves.FixedBias` are kept around the packed leaf).

    The masked leaves are frozen together in one jitted program (their masks and gains are
    bit-identical to the eager ones: the gain is a fixed-order sum, see
    :func:`~lowrank_jax.leaves.masked_binary.pairwise_sum`), then packed on the host.
    """
    flat, treedef = jax.tree_util.tree_flatten(params, is_leaf=_is_binary)
    idx = [i for i, x in enumerate(flat) if _is_binary(x)]
    if idx:
        frozen = _freeze_all([flat[i] for i in idx])
        for i, f in zip(idx, frozen, strict=True):
            flat[i] = PackedBinary.from_leaf(f)
    return jax.tree_util.tree_unflatten(treedef, flat)


def pack_pm1(x) -> Array:
    """Pack inputs in ``{-1, +1}`` ``[..., d_in]`` into sign words ``uint32 [..., W]``
    (1 = negative), jit-friendly."""
    x = jnp.asarray(x)
    d = x.shape[-1]
    pad = n_words(d) * WORD - d
    bits = (x < 0).astype(jnp.uint32)
    if pad:
        bits = jnp.concatenate([bits, jnp.zeros(x.shape[:-1] + (pad,), jnp.uint32)], axis=-1)
    bits = bits.reshape(x.shape[:-1] + (-1, WORD))
    return jnp.sum(bits << jnp.arange(WORD, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def xnor_dot(leaf: PackedBinary, x_bits: Array) -> Array:
    """Integer ``x @ (sign * mask)`` for inputs in ``{-1, +1}`` given as sign words
    (:func:`pack_pm1`), by XNOR and popcount: for output ``j``,
    ``popcount(m_j) - 2 popcount((x XOR s_j) AND m_j)`` (larq compute-engine's bgemm identity,
    restricted to kept weights). Multiply by ``leaf.alpha`` for the layer's output.

    Args:
      leaf: a packed binary weight.
      x_bits: ``uint32 [..., ceil(d_in / 32)]``.

    Returns:
      ``int32 [..., d_out]``.
    """
    x_bits = jnp.asarray(x_bits, jnp.uint32)
    if x_bits.shape[-1] != leaf.sign_bits.shape[1]:
        raise ShapeError(f"xnor_dot: x_bits must have {leaf.sign_bits.shape[1]} words per row "
                         f"(d_in={leaf.d_in}), got {x_bits.shape[-1]}", where="x_bits",
                         expected=leaf.sign_bits.shape[1], actual=x_bits.shape[-1])
    m = leaf.mask_bits  # [d_out, W]
    diff = (x_bits[..., None, :] ^ leaf.sign_bits) & m  # [..., d_out, W]
    kept = jnp.sum(jax.lax.population_count(m).astype(jnp.int32), axis=-1)
    wrong = jnp.sum(jax.lax.population_count(diff).astype(jnp.int32), axis=-1)
    return kept - 2 * wrong


__all__ = ["PackedBinary", "n_words", "pack_binary_tree", "pack_bits", "pack_pm1",
           "unpack_bits", "unpacked_weight", "xnor_dot"]
