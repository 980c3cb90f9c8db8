"""Integer weights: ``Int8`` (per output channel) and ``Int4`` (per group of inputs), weight only.

A quantized weight stores integer codes and float scales; :func:`~lowrank_jax.linear`
dequantizes inside the compiled program (``W = scale * (code - zero)`` in float32) and
multiplies in the input's float dtype. Activations stay in float (weight-only quantization, as
GPTQ, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
arXiv:2210.17323, and bitsandbytes' 8-bit weights).

Storage (exactly what :meth:`storage_bits` counts: the arrays' bytes times 8):

=========  ==========================================  ===================================
leaf       arrays                                      bits per weight
=========  ==========================================  ===================================
``Int8``   ``q: int8 [d_in, d_out]``,                  ``8 + s / d_in``
           ``scale: [d_out]`` (float32 or bfloat16)
``Int4``   ``packed: uint8 [ceil(d_in / 2), d_out]``   ``4 + s / g`` (+ ``8 / g`` with zero
           (two codes per byte), ``scale: [G, d_out]``  points): g128 float32 scales 4.25,
           (float32 or bfloat16), optional ``zero:      bfloat16 4.125
           uint8 [G, d_out]``
=========  ==========================================  ===================================

(``s`` the scale's bits, ``g`` the group size, ``G`` the number of groups; a bias, if any, is
stored at its own dtype.)

Grids. Symmetric (the default): ``scale = max |w| / qmax`` over the group (``qmax`` 127 for 8
bits, 7 for 4 bits), ``code = clip(round(w / scale), -qmax, qmax)``, no zero point (an Int4
stores ``code + 8`` in its nibble, ``1 .. 15``). With zero points (Int4 only, ``zero_point=
True``): the range ``[min(w_min, 0), max(w_max, 0)]`` over the group, ``scale = range / 15``,
``zero = round(-min / scale)`` (a ``uint8`` in ``0 .. 15``), ``code = clip(round(w / scale) +
zero, 0, 15)``: GPTQ's reference quantizer. A group of zeros gets scale 1 (symmetric) or the
range ``[-1, 1]`` (zero points), as in that quantizer. Codes are chosen for the scale *as
stored*: a bfloat16 scale is rounded first, then the codes are computed from it.

Groups run along ``d_in`` (the reduction axis): rows ``[k g, (k + 1) g)`` share a scale per
output. When ``d_in`` is not a multiple of ``g`` the last group is shorter (its scale is the one
of its own rows); an odd ``d_in`` pads the last byte's high nibble with 0, which is counted
(it is stored). Removing input channels (:meth:`Int4.keep_inputs`) keeps every code and scale
exactly: the groups become the kept rows of each old group (their sizes, recorded in
``group_sizes``, may then differ; a group left with no row is dropped with its scale).

:class:`FakeQuant` is the training-time counterpart: float master weights, quantized and
dequantized in the forward, the gradient passed straight through to the master weights (the
straight-through estimator of :class:`~lowrank_jax.MaskedBinary`); :meth:`FakeQuant.freeze`
gives the integer leaf. :class:`ProductLeaf` and :class:`SumLeaf` compose leaves: a low-rank
weight whose factors are quantized leaves (``W = U V``), and a low-rank part plus a quantized
residual (``W = Q(W - U V) + U V``, "Compressing Large Language Models using Low Rank and Low
Precision Decomposition", arXiv:2405.18886).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, LeafTypeError, ShapeError
from lowrank_jax.leaves.base import (
    CONCRETE,
    Array,
    Leaf,
    _StoredBias,
    array_bits,
    array_size,
    bias_of,
    check_bias,
    keep_inputs,
    keep_outputs,
    leaf_dataclass,
    linear,
    materialize,
    slice_bias,
)

#: The dtypes a scale may be stored in.
SCALE_DTYPES = ("float32", "bfloat16")
#: Bit widths of the integer leaves.
BITS = (4, 8)


# ---------------------------------------------------------------------------------------------
# The grid: shared by round-to-nearest, GPTQ and fake quantization.

def qrange(bits: int, zero_point: bool) -> tuple[int, int]:
    """``(lo, hi)`` of the integer codes: ``(-qmax, qmax)`` symmetric, ``(0, 2^bits - 1)`` with
    zero points."""
    return (0, 2 ** bits - 1) if zero_point else (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1)


def check_scale_dtype(scale_dtype: Any, where: str = "scale_dtype"):
    """``scale_dtype`` as a JAX dtype (one of :data:`SCALE_DTYPES`; ``None`` passes through:
    scales kept in the computation's dtype, for tests in float64).

    Raises:
      ConfigError: another dtype.
    """
    if scale_dtype is None:
        return None
    name = jnp.dtype(scale_dtype).name if not isinstance(scale_dtype, str) else scale_dtype
    if name not in SCALE_DTYPES:
        raise ConfigError(f"{where}: the scale dtype must be one of {SCALE_DTYPES}, got "
                          f"{scale_dtype!r}", where=where, expected=SCALE_DTYPES, actual=name)
    return jnp.dtype(name)


def grid(w: Array, *, bits: int, zero_point: bool = False, scale_dtype: Any = "float32",
         axis: int = 0) -> tuple[Array, Array]:
    """Scale and zero point of the values of ``w`` reduced over ``axis`` (module docstring).

    Args:
      w: float values (a group of rows ``[n, d_out]`` with ``axis=0``).
      bits: 4 or 8 (any width >= 2 works for the arithmetic).
      zero_point: asymmetric grid with a zero point (else symmetric, zero 0).
      scale_dtype: the dtype the scale is stored in; the returned scale is rounded to it and
        given back in ``w``'s dtype (``None``: not rounded).
      axis: the reduced axis.

    Returns:
      ``(scale, zero)`` in ``w``'s dtype, ``zero`` integral (0 when symmetric).
    """
    w = jnp.asarray(w)
    sdt = check_scale_dtype(scale_dtype)
    lo, hi = qrange(bits, zero_point)
    if zero_point:
        xmin = jnp.minimum(jnp.min(w, axis=axis), 0)
        xmax = jnp.maximum(jnp.max(w, axis=axis), 0)
        flat = (xmin == 0) & (xmax == 0)
        xmin, xmax = jnp.where(flat, -1, xmin), jnp.where(flat, 1, xmax)
        scale = (xmax - xmin) / hi
    else:
        amax = jnp.max(jnp.abs(w), axis=axis)
        scale = jnp.where(amax == 0, 1, amax / hi)
    if sdt is not None:
        scale = scale.astype(sdt).astype(w.dtype)
    zero = jnp.clip(jnp.round(-xmin / scale), lo, hi) if zero_point else jnp.zeros_like(scale)
    return scale, zero


def codes(w: Array, scale: Array, zero: Array, *, bits: int, zero_point: bool = False) -> Array:
    """``clip(round(w / scale) + zero, lo, hi)`` (float, integral values): the codes of ``w`` on
    the grid (``scale`` and ``zero`` broadcast against ``w``)."""
    lo, hi = qrange(bits, zero_point)
    return jnp.clip(jnp.round(w / scale) + zero, lo, hi)


def _check_bits(bits: Any, where: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in BITS:
        raise ConfigError(f"{where}: bits must be one of {BITS}, got {bits!r}", where=where,
                          expected=BITS, actual=bits)
    return int(bits)


def check_group(group: Any, where: str = "group") -> int | None:
    """``group`` as an int >= 1, or ``None`` (one group: every input of an output channel).

    Raises:
      ConfigError: anything else.
    """
    if group is None:
        return None
    if isinstance(group, bool) or not isinstance(group, numbers.Integral) or group < 1:
        raise ConfigError(f"{where}: group must be an int >= 1 (32, 64 or 128 are usual) or "
                          f"None (per output channel), got {group!r}", where=where,
                          expected="int >= 1 or None", actual=group)
    return int(group)


def group_sizes_for(d_in: int, group: int | None) -> tuple[int, ...]:
    """The sizes of consecutive groups of ``d_in`` rows: ``group`` each, the last one shorter
    when ``group`` does not divide ``d_in`` (one group of ``d_in`` for ``None``; none for 0)."""
    if d_in == 0:
        return ()
    g = d_in if group is None else min(int(group), d_in)
    full, rest = divmod(d_in, g)
    return (g,) * full + ((rest,) if rest else ())


def _uniform(sizes: tuple[int, ...]) -> bool:
    return len(sizes) <= 1 or (all(s == sizes[0] for s in sizes[:-1]) and sizes[-1] <= sizes[0])


def expand_groups(a: Array, sizes: tuple[int, ...], d_in: int) -> Array:
    """``a [G, d_out]`` repeated to ``[d_in, d_out]``: row ``i`` gets its group's values."""
    if not sizes:
        return jnp.zeros((0,) + tuple(a.shape[1:]), a.dtype)
    if _uniform(sizes):
        g = sizes[0]
        full = jnp.broadcast_to(a[:, None], (a.shape[0], g) + tuple(a.shape[1:]))
        return full.reshape((a.shape[0] * g,) + tuple(a.shape[1:]))[:d_in]
    return jnp.repeat(a, np.asarray(sizes), axis=0, total_repeat_length=d_in)


def grouped_grid(w: Array, sizes: tuple[int, ...], *, bits: int, zero_point: bool,
                 scale_dtype: Any) -> tuple[Array, Array]:
    """:func:`grid` of every group of rows of ``w [d_in, d_out]``: ``(scale, zero)`` ``[G,
    d_out]``."""
    w = jnp.asarray(w)
    if not sizes:
        z = jnp.zeros((0, w.shape[1]), w.dtype)
        return z, z
    if _uniform(sizes):
        g, n = sizes[0], len(sizes)
        pad = n * g - w.shape[0]
        # padding rows repeat the group's first row: they change neither its extremes nor the
        # zero-included range
        if pad:
            w = jnp.concatenate([w, jnp.broadcast_to(w[(n - 1) * g][None], (pad, w.shape[1]))])
        return grid(w.reshape(n, g, -1), bits=bits, zero_point=zero_point,
                    scale_dtype=scale_dtype, axis=1)
    starts = np.cumsum((0,) + sizes[:-1])
    parts = [grid(w[s:s + n], bits=bits, zero_point=zero_point, scale_dtype=scale_dtype)
             for s, n in zip(starts, sizes, strict=True)]
    return jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts])


def fake_quantize(w: Array, *, bits: int, group: int | None, zero_point: bool = False,
                  scale_dtype: Any = "float32") -> Array:
    """``w`` rounded to its grid and back (:func:`grid`, :func:`codes`): the values the integer
    leaf of the same settings stores, in ``w``'s dtype."""
    w = jnp.asarray(w)
    sizes = group_sizes_for(int(w.shape[0]), group)
    scale, zero = grouped_grid(w, sizes, bits=bits, zero_point=zero_point,
                               scale_dtype=scale_dtype)
    s, z = expand_groups(scale, sizes, w.shape[0]), expand_groups(zero, sizes, w.shape[0])
    return (codes(w, s, z, bits=bits, zero_point=zero_point) - z) * s


# ---------------------------------------------------------------------------------------------
# Nibble packing (two 4-bit codes per byte, along d_in).

def pack_nibbles(c) -> np.ndarray:
    """Pack codes ``[d_in, d_out]`` in ``0 .. 15`` into ``uint8 [ceil(d_in / 2), d_out]``: row
    ``2 k`` in the low nibble of byte row ``k``, row ``2 k + 1`` in the high nibble (0 when
    ``d_in`` is odd)."""
    c = np.asarray(c)
    if c.size and (c.min() < 0 or c.max() > 15):
        raise ShapeError(f"pack_nibbles: codes must lie in [0, 15], got [{c.min()}, {c.max()}]",
                         expected="[0, 15]", actual=(int(c.min()), int(c.max())))
    c = c.astype(np.uint8)
    if c.shape[0] % 2:
        c = np.concatenate([c, np.zeros((1,) + c.shape[1:], np.uint8)])
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def unpack_nibbles(p: Array, d_in: int) -> Array:
    """Inverse of :func:`pack_nibbles` (jit-friendly): ``uint8 [ceil(d_in / 2), d_out] ->
    uint8 [d_in, d_out]``."""
    p = jnp.asarray(p, jnp.uint8)
    both = jnp.stack([p & jnp.uint8(15), p >> jnp.uint8(4)], axis=1)  # [h, 2, d_out]
    return both.reshape((2 * p.shape[0],) + tuple(p.shape[1:]))[:d_in]


def _float_of(scale: Array):
    """The dequantization's dtype: float32, or the scale's when wider (float64 host copies)."""
    dt = scale if isinstance(scale, np.dtype) else jnp.asarray(scale).dtype
    return jnp.promote_types(dt, jnp.float32)


def _product(x: Array, w: Array) -> Array:
    """``x @ w`` in ``x``'s float dtype (the dequantized weight cast to it)."""
    x = jnp.asarray(x)
    return x @ w.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x @ w


# ---------------------------------------------------------------------------------------------
# Int8.

class Int8(_StoredBias, Leaf):
    """An 8-bit weight with one scale per output channel: ``W[i, j] = scale[j] * q[i, j]``.

    Fields:
      q: ``int8 [d_in, d_out]`` codes in ``[-127, 127]``.
      scale: ``[d_out]`` float32 or bfloat16.
      b: optional float bias ``[d_out]``.

    Build one with :meth:`quantize` (round to nearest) or from codes. ``linear`` dequantizes to
    float32 inside the program and multiplies in the input's dtype. Counts: ``storage_bits``
    the arrays' bytes times 8 (``8 + s / d_in`` bits per weight); ``param_count`` the codes,
    the scales and the bias; ``flops`` the dense product, ``n_tokens d_in d_out``. Inference
    only: the codes and scales are frozen (:meth:`trainable`), the bias may be trained.
    """

    q: Array
    scale: Array
    b: Array | None = None

    def __post_init__(self):
        if isinstance(self.q, CONCRETE):
            if self.q.dtype != np.int8 or self.q.ndim != 2:
                raise ShapeError(f"Int8: q must be int8 [d_in, d_out], got "
                                 f"{self.q.dtype}{list(self.q.shape)}", where="q",
                                 expected="int8 [d_in, d_out]",
                                 actual=(str(self.q.dtype), tuple(self.q.shape)))
            if isinstance(self.scale, CONCRETE) and tuple(self.scale.shape) != (self.q.shape[1],):
                raise ShapeError(f"Int8: scale must have shape ({self.q.shape[1]},), got "
                                 f"{tuple(self.scale.shape)}", where="scale",
                                 expected=(self.q.shape[1],), actual=tuple(self.scale.shape))
            check_bias("Int8", self.b, self.q.shape[1])

    @classmethod
    def quantize(cls, w: Any, b: Array | None = None, *, scale_dtype: Any = "float32") -> "Int8":
        """Round-to-nearest symmetric 8-bit codes of ``w [d_in, d_out]`` (module docstring)."""
        w = jnp.asarray(w, _float_of(jnp.asarray(w).dtype))
        if w.ndim != 2:
            raise ShapeError(f"Int8.quantize: w must be 2-D [d_in, d_out], got {w.shape}",
                             expected="[d_in, d_out]", actual=tuple(w.shape))
        sdt = check_scale_dtype(scale_dtype)
        scale, zero = grid(w, bits=8, scale_dtype=sdt)
        q = codes(w, scale, zero, bits=8)
        return cls(q=q.astype(jnp.int8), scale=scale if sdt is None else scale.astype(sdt), b=b)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(d) for d in self.q.shape)

    def to_dense(self) -> Array:
        f = _float_of(self.scale)
        return self.q.astype(f) * self.scale.astype(f)

    def apply(self, x: Array) -> Array:
        y = _product(x, self.to_dense())
        return y if self.b is None else y + self.b

    def param_count(self) -> int:
        return array_size(self.q) + array_size(self.scale) + array_size(self.b)

    def storage_bits(self) -> int:
        return array_bits(self.q) + array_bits(self.scale) + array_bits(self.b)

    def flops(self, n_tokens: int) -> int:
        return int(n_tokens) * self.d_in * self.d_out

    def trainable(self) -> "Int8":
        return dataclasses.replace(jax.tree_util.tree_map(lambda _: True, self), q=False,
                                   scale=False)

    def keep_inputs(self, idx):
        return dataclasses.replace(self, q=self.q[idx])

    def keep_outputs(self, idx):
        return dataclasses.replace(self, q=self.q[:, idx], scale=self.scale[idx],
                                   b=slice_bias(self.b, idx))

    def logical_axes(self):
        return {"q": ("in", "out"), "scale": ("out",), "b": ("out",)}


Int8 = leaf_dataclass(Int8)


# ---------------------------------------------------------------------------------------------
# Int8 weights with int8 activations.

#: The largest ``d_in`` whose int8 x int8 products always fit an int32 accumulator
#: (``127 * 127 * d_in < 2^31``).
INT32_SAFE_D_IN = (2 ** 31 - 1) // (127 * 127)


def quantize_rows(x: Array) -> tuple[Array, Array]:
    """Dynamic symmetric int8 codes of activations, one scale per row (per token).

    ``scale = max_j |x[..., j]| * float32(1 / 127)`` (1 for a row of zeros), ``codes =
    clip(round(x * (1 / scale)), -127, 127)`` (half to even). Both divisions are written as
    products by a float32 reciprocal: XLA compiles a division by a constant or by a value
    broadcast along the row that way anyway (within an ulp of the quotient, which can move a
    value at a rounding midpoint to the next code), and written out, the codes are reproducible
    bit for bit (in NumPy: the same float32 operations). A row holding a NaN gets a NaN scale
    (its output is NaN, as a float product's would be).

    Args:
      x: ``[..., d]`` activations (any float dtype; computed in float32).

    Returns:
      ``(codes int8 [..., d], scale float32 [..., 1])``.
    """
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax == 0, jnp.float32(1), amax * jnp.float32(1 / 127))
    inv = jnp.float32(1) / scale
    return jnp.clip(jnp.round(x * inv), -127, 127).astype(jnp.int8), scale


class Int8A8(Int8):
    """An :class:`Int8` weight whose product also quantizes the activations to int8 (W8A8).

    ``linear(leaf, x)``: every row (token) of ``x`` is quantized inside the compiled program
    (:func:`quantize_rows`: symmetric, ``max |x_row| / 127``), the product of the int8 codes is
    accumulated in int32 (``lax.dot_general(..., preferred_element_type=int32)``: exact up to
    ``d_in`` = :data:`INT32_SAFE_D_IN`), then rescaled by ``row scale * column scale`` in
    float32, the bias added in float; the result has the input's float dtype. This is the
    dynamic per-token scheme of "LLM.int8(): 8-bit Matrix Multiplication for Transformers at
    Scale" (arXiv:2208.07339) without its float outlier path, and of SmoothQuant's W8A8
    (arXiv:2211.10438) without smoothing: a token with one large feature gets a coarse grid for
    all the others.

    Rounding the activations changes the numbers, so it is a property of the weight, not an
    execution setting: build one with :meth:`quantize`, :func:`quantize_weight` with
    ``activations='int8'``, :meth:`from_int8`, or the ``quantize`` plan method's
    ``activations='int8'``. Fields, storage, ``param_count``, surgery, placement and save/load
    are those of :class:`Int8`; ``flops`` counts the integer product, ``n_tokens d_in d_out``
    multiply-adds (the activations' rounding is not counted, as no activation work is).
    :meth:`to_dense` (``materialize``) gives the dequantized weight ``q * scale``: the
    activations' rounding is not part of it, so ``x @ materialize(leaf)`` differs from
    ``linear(leaf, x)`` by that rounding.
    """

    @classmethod
    def from_int8(cls, leaf: Int8) -> "Int8A8":
        """The same codes, scales and bias, with int8 activations."""
        return cls(q=leaf.q, scale=leaf.scale, b=leaf.b)

    def apply(self, x: Array) -> Array:
        x = jnp.asarray(x)
        out_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
        xq, sx = quantize_rows(x)
        acc = jax.lax.dot_general(xq, self.q, (((xq.ndim - 1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * sx * self.scale.astype(jnp.float32)
        y = y.astype(out_dtype)
        return y if self.b is None else y + self.b


Int8A8 = leaf_dataclass(Int8A8)

#: What the ``activations`` option of :func:`quantize_weight` accepts.
ACTIVATIONS = (None, "int8")


def check_activations(activations: Any, bits: int, where: str = "activations") -> str | None:
    """``activations`` validated: ``None`` (weight-only) or ``'int8'`` (only with 8-bit
    weights).

    Raises:
      ConfigError: another value, or ``'int8'`` with 4-bit weights.
    """
    if activations not in ACTIVATIONS:
        raise ConfigError(f"{where}: activations must be None (weight-only) or 'int8', got "
                          f"{activations!r}", where=where, expected=ACTIVATIONS,
                          actual=activations)
    if activations == "int8" and bits != 8:
        raise ConfigError(f"{where}: int8 activations need 8-bit weights (an int8 x int8 "
                          f"product), got bits={bits}", where=where, expected="bits=8",
                          actual=bits)
    return activations


# ---------------------------------------------------------------------------------------------
# Int4.

class Int4(_StoredBias, Leaf):
    """A 4-bit weight with one scale (and optionally one zero point) per group of inputs and
    output channel: ``W[i, j] = scale[g(i), j] * (code[i, j] - zero[g(i), j])``.

    Fields:
      packed: ``uint8 [ceil(d_in / 2), d_out]``, two codes per byte (:func:`pack_nibbles`).
      scale: ``[G, d_out]`` float32 or bfloat16, one row per group.
      zero: ``uint8 [G, d_out]`` zero points in ``0 .. 15``, or ``None``: symmetric codes,
        stored as ``code + 8`` (the zero point is 8 for every group, not stored).
      b: optional float bias ``[d_out]``.
      d_in: static input width.
      group_sizes: static sizes of the consecutive groups of rows (they sum to ``d_in``):
        ``(g, ..., g, rest)`` as :meth:`quantize` makes them, any sizes after surgery.

    Bits per weight: ``4 + s / g`` (+ ``8 / g`` with zero points): 4.25 for group 128 with
    float32 scales, 4.125 with bfloat16 scales. ``param_count`` counts the codes, scales, zero
    points and bias; ``flops`` the dense product. Inference only (:meth:`trainable`: the bias
    may be trained).
    """

    packed: Array
    scale: Array
    zero: Array | None = None
    b: Array | None = None
    d_in: int = 0
    group_sizes: tuple = ()

    def __post_init__(self):
        if not isinstance(self.d_in, (int, np.integer)) or self.d_in < 0:
            raise ShapeError(f"Int4: d_in must be an int >= 0, got {self.d_in!r}", where="d_in",
                             expected=">= 0", actual=self.d_in)
        sizes = tuple(int(s) for s in self.group_sizes)
        object.__setattr__(self, "group_sizes", sizes)
        if sum(sizes) != self.d_in or any(s < 1 for s in sizes):
            raise ShapeError(f"Int4: group_sizes must be positive and sum to d_in={self.d_in}, "
                             f"got {sizes}", where="group_sizes", expected=self.d_in,
                             actual=sizes)
        if isinstance(self.packed, CONCRETE):
            rows = -(-self.d_in // 2)
            if self.packed.dtype != np.uint8 or self.packed.ndim != 2 or \
                    self.packed.shape[0] != rows:
                raise ShapeError(f"Int4: packed must be uint8 [{rows}, d_out] for d_in="
                                 f"{self.d_in}, got {self.packed.dtype}{list(self.packed.shape)}",
                                 where="packed", expected=("uint8", rows),
                                 actual=(str(self.packed.dtype), tuple(self.packed.shape)))
            want = (len(sizes), int(self.packed.shape[1]))
            for name in ("scale", "zero"):
                a = getattr(self, name)
                if isinstance(a, CONCRETE) and tuple(a.shape) != want:
                    raise ShapeError(f"Int4: {name} must have shape {want} (groups, d_out), got "
                                     f"{tuple(a.shape)}", where=name, expected=want,
                                     actual=tuple(a.shape))
            if isinstance(self.zero, CONCRETE) and self.zero.dtype != np.uint8:
                raise ShapeError(f"Int4: zero must be uint8, got {self.zero.dtype}",
                                 where="zero", expected="uint8", actual=str(self.zero.dtype))
            check_bias("Int4", self.b, self.packed.shape[1])

    @classmethod
    def from_codes(cls, c: Any, scale: Any, zero: Any = None, b: Array | None = None, *,
                   group_sizes: tuple[int, ...], scale_dtype: Any = "float32") -> "Int4":
        """An Int4 from integer codes ``c [d_in, d_out]`` (``-7 .. 7`` without zero points,
        ``0 .. 15`` with), scales and zero points ``[G, d_out]`` (:func:`grid`, GPTQ)."""
        c = np.asarray(c)
        sdt = check_scale_dtype(scale_dtype)
        sdt = jnp.asarray(scale).dtype if sdt is None else sdt
        lo, hi = qrange(4, zero is not None)
        if c.size and (c.min() < lo or c.max() > hi):
            raise ShapeError(f"Int4.from_codes: codes must lie in [{lo}, {hi}], got "
                             f"[{c.min()}, {c.max()}]", where="c", expected=(lo, hi),
                             actual=(int(c.min()), int(c.max())))
        nib = c.astype(np.int64) + (0 if zero is not None else 8)
        zero = None if zero is None else jnp.asarray(np.asarray(zero).astype(np.uint8))
        return cls(packed=jnp.asarray(pack_nibbles(nib)), scale=jnp.asarray(scale).astype(sdt),
                   zero=zero, b=b, d_in=int(c.shape[0]), group_sizes=tuple(group_sizes))

    @classmethod
    def quantize(cls, w: Any, b: Array | None = None, *, group: int | None = 128,
                 zero_point: bool = False, scale_dtype: Any = "float32") -> "Int4":
        """Round-to-nearest 4-bit codes of ``w [d_in, d_out]`` with groups of ``group`` inputs
        (``None``: one group per output channel; a shorter last group when ``group`` does not
        divide ``d_in``) and optional zero points (module docstring)."""
        w = jnp.asarray(w, _float_of(jnp.asarray(w).dtype))
        if w.ndim != 2:
            raise ShapeError(f"Int4.quantize: w must be 2-D [d_in, d_out], got {w.shape}",
                             expected="[d_in, d_out]", actual=tuple(w.shape))
        sdt = check_scale_dtype(scale_dtype)
        sizes = group_sizes_for(int(w.shape[0]), check_group(group))
        scale, zero = grouped_grid(w, sizes, bits=4, zero_point=zero_point, scale_dtype=sdt)
        c = codes(w, expand_groups(scale, sizes, w.shape[0]), expand_groups(zero, sizes, w.shape[0]),
                  bits=4, zero_point=zero_point)
        return cls.from_codes(np.asarray(c).astype(np.int64), scale,
                              np.asarray(zero) if zero_point else None, b,
                              group_sizes=sizes, scale_dtype=sdt)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.d_in), int(self.packed.shape[1]))

    @property
    def group(self) -> int | None:
        """The group size (the first group's; ``None`` for no rows)."""
        return self.group_sizes[0] if self.group_sizes else None

    def nibbles(self) -> Array:
        """The stored codes ``uint8 [d_in, d_out]`` (``code + 8`` without zero points)."""
        return unpack_nibbles(self.packed, self.d_in)

    def to_dense(self) -> Array:
        f = _float_of(self.scale)
        d = self.d_in
        zero = 8.0 if self.zero is None else expand_groups(self.zero.astype(f), self.group_sizes, d)
        scale = expand_groups(self.scale.astype(f), self.group_sizes, d)
        return (self.nibbles().astype(f) - zero) * scale

    def apply(self, x: Array) -> Array:
        y = _product(x, self.to_dense())
        return y if self.b is None else y + self.b

    def param_count(self) -> int:
        return (self.d_in * self.d_out + array_size(self.scale) + array_size(self.zero)
                + array_size(self.b))

    def storage_bits(self) -> int:
        return (array_bits(self.packed) + array_bits(self.scale) + array_bits(self.zero)
                + array_bits(self.b))

    def flops(self, n_tokens: int) -> int:
        return int(n_tokens) * self.d_in * self.d_out

    def trainable(self) -> "Int4":
        return dataclasses.replace(jax.tree_util.tree_map(lambda _: True, self), packed=False,
                                   scale=False, zero=None if self.zero is None else False)

    def keep_inputs(self, idx):
        nib = np.asarray(self.nibbles())[idx]
        gid = np.repeat(np.arange(len(self.group_sizes)), self.group_sizes)[idx]
        counts = np.bincount(gid, minlength=len(self.group_sizes))
        live = np.flatnonzero(counts)
        return Int4(packed=jnp.asarray(pack_nibbles(nib)), scale=self.scale[live],
                    zero=None if self.zero is None else self.zero[live], b=self.b,
                    d_in=int(len(idx)), group_sizes=tuple(int(c) for c in counts[live]))

    def keep_outputs(self, idx):
        return Int4(packed=self.packed[:, idx], scale=self.scale[:, idx],
                    zero=None if self.zero is None else self.zero[:, idx],
                    b=slice_bias(self.b, idx), d_in=self.d_in, group_sizes=self.group_sizes)

    def logical_axes(self):
        return {"packed": ("in", "out"), "scale": (None, "out"), "zero": (None, "out"),
                "b": ("out",)}


Int4 = leaf_dataclass(Int4, meta=("d_in", "group_sizes"))


def quantize_weight(w: Any, b: Array | None = None, *, bits: int, group: int | None = 128,
                    zero_point: bool = False, scale_dtype: Any = "float32",
                    activations: str | None = None) -> Leaf:
    """Round-to-nearest :class:`Int8` (``bits=8``: per output channel, symmetric; ``group`` is
    ignored and ``zero_point`` must be ``False``) or :class:`Int4` (``bits=4``) of a float
    matrix ``w [d_in, d_out]``; ``activations='int8'`` (8 bits only) gives an :class:`Int8A8`,
    whose product also rounds the activations to int8.

    Raises:
      ConfigError: bits other than 4 or 8; zero points asked of 8 bits; int8 activations with
        4-bit weights.
    """
    bits = _check_bits(bits)
    check_activations(activations, bits, "quantize: activations")
    if bits == 8:
        if zero_point:
            raise ConfigError("quantize: 8-bit weights are symmetric (no zero points); got "
                              "zero_point=True", where="zero_point", expected=False, actual=True)
        return (Int8A8 if activations == "int8" else Int8).quantize(w, b, scale_dtype=scale_dtype)
    return Int4.quantize(w, b, group=group, zero_point=zero_point, scale_dtype=scale_dtype)


# ---------------------------------------------------------------------------------------------
# Training: fake quantization with a straight-through estimator.

class FakeQuant(_StoredBias, Leaf):
    """A float master weight quantized in the forward, for quantization-aware training.

    ``linear(FakeQuant(w), x) = x @ Q(w) (+ b)`` with ``Q`` the grid of the integer leaf of the
    same settings (:func:`fake_quantize`); the backward passes the gradient straight through
    ``Q`` to ``w`` (``Q(w) = w + stop_gradient(Q(w) - w)``, the estimator
    :class:`~lowrank_jax.MaskedBinary` uses for its scores). Scales are recomputed from ``w``
    every step (no gradient flows into them). :meth:`freeze` gives the :class:`Int8` /
    :class:`Int4` leaf whose values :meth:`to_dense` returns.

    Fields: ``w [d_in, d_out]`` (trained), ``b`` (optional bias, trained), static ``bits``,
    ``group``, ``zero_point``, ``scale_dtype``. Counts are those of the frozen leaf (what is
    stored at inference): ``storage_bits`` computed from the shape without freezing.
    """

    w: Array
    b: Array | None = None
    bits: int = 4
    group: int | None = 128
    zero_point: bool = False
    scale_dtype: str = "float32"

    def __post_init__(self):
        _check_bits(self.bits, "FakeQuant: bits")
        check_group(self.group, "FakeQuant: group")
        check_scale_dtype(self.scale_dtype, "FakeQuant: scale_dtype")
        if self.bits == 8 and (self.group is not None or self.zero_point):
            raise ConfigError("FakeQuant: 8-bit weights have one scale per output channel and "
                              "no zero point: give group=None, zero_point=False",
                              where="group", expected=None, actual=self.group)
        if isinstance(self.w, CONCRETE):
            if self.w.ndim != 2:
                raise ShapeError(f"FakeQuant: w must be 2-D [d_in, d_out], got "
                                 f"{tuple(self.w.shape)}", where="w", expected="[d_in, d_out]",
                                 actual=tuple(self.w.shape))
            check_bias("FakeQuant", self.b, self.w.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(d) for d in self.w.shape)

    def _q(self) -> Array:
        w = self.w
        wq = fake_quantize(jax.lax.stop_gradient(w), bits=self.bits, group=self.group,
                           zero_point=self.zero_point, scale_dtype=self.scale_dtype)
        return w + jax.lax.stop_gradient(wq.astype(w.dtype) - w)

    def apply(self, x: Array) -> Array:
        y = x @ self._q()
        return y if self.b is None else y + self.b

    def to_dense(self) -> Array:
        return jax.lax.stop_gradient(self._q())

    def freeze(self) -> Leaf:
        """The integer leaf of the same settings (its :meth:`to_dense` equals this leaf's)."""
        return quantize_weight(self.w, self.b, bits=self.bits,
                               group=self.group if self.bits == 4 else None,
                               zero_point=self.zero_point, scale_dtype=self.scale_dtype)

    def _groups(self) -> int:
        return len(group_sizes_for(self.d_in, self.group if self.bits == 4 else None))

    def param_count(self) -> int:
        g = self._groups()
        return (self.d_in * self.d_out + g * self.d_out * (2 if self.zero_point else 1)
                + array_size(self.b))

    def storage_bits(self) -> int:
        sbits = jnp.dtype(self.scale_dtype).itemsize * 8
        values = (-(-self.d_in // 2) * 8 if self.bits == 4 else self.d_in * 8) * self.d_out
        return (values + self._groups() * self.d_out * (sbits + (8 if self.zero_point else 0))
                + array_bits(self.b))

    def flops(self, n_tokens: int) -> int:
        return int(n_tokens) * self.d_in * self.d_out

    def keep_inputs(self, idx):
        return dataclasses.replace(self, w=self.w[idx])

    def keep_outputs(self, idx):
        return dataclasses.replace(self, w=self.w[:, idx], b=slice_bias(self.b, idx))

    def logical_axes(self):
        return {"w": ("in", "out"), "b": ("out",)}


FakeQuant = leaf_dataclass(FakeQuant, meta=("bits", "group", "zero_point", "scale_dtype"))


def as_fake_quant(leaf: Any, *, bits: int = 4, group: int | None = 128,
                  zero_point: bool = False, scale_dtype: str = "float32") -> Leaf:
    """A weight made ready for quantization-aware training: a leaf with stored factors
    (``W = U V``, :class:`~lowrank_jax.LowRank`) becomes a :class:`ProductLeaf` of two
    :class:`FakeQuant` factors (low rank and ``bits``-bit by design; the group of ``V``, whose
    inputs are the rank, is capped at the rank), any other weight one :class:`FakeQuant` of its
    dense matrix. The bias stays in float. :func:`freeze_fake_quant` turns the trained tree
    into integer leaves."""
    from lowrank_jax.leaves.base import factors

    kw = dict(bits=bits, zero_point=zero_point, scale_dtype=scale_dtype)
    g = group if bits == 4 else None
    f = factors(leaf) if isinstance(leaf, Leaf) else None
    if f is not None and f.first is not None and f.rows is None:
        r = int(f.first.shape[1])
        gv = None if g is None else min(int(g), max(r, 1))
        return ProductLeaf(FakeQuant(jnp.asarray(f.first), group=g, **kw),
                           FakeQuant(jnp.asarray(f.second), group=gv, **kw), b=f.bias)
    return FakeQuant(jnp.asarray(materialize(leaf)), bias_of(leaf) if isinstance(leaf, Leaf)
                     else None, group=g, **kw)


def freeze_fake_quant(tree: Any) -> Any:
    """``tree`` with every :class:`FakeQuant` replaced by its integer leaf
    (:meth:`FakeQuant.freeze`): after quantization-aware training, the weights as stored."""
    from lowrank_jax.leaves.base import is_leaf

    def one(x):
        if isinstance(x, FakeQuant):
            return x.freeze()
        if isinstance(x, (ProductLeaf, SumLeaf)):
            return dataclasses.replace(x, first=one(x.first), second=one(x.second))
        return x

    return jax.tree_util.tree_map(one, tree, is_leaf=is_leaf)


# ---------------------------------------------------------------------------------------------
# Composition.

def _require(x: Any, who: str, name: str) -> None:
    if not isinstance(x, (Leaf, *CONCRETE)):
        raise LeafTypeError(f"{who}: {name} must be a weight leaf or a 2-D array, got "
                            f"{type(x).__name__}", where=name, expected="Leaf",
                            actual=type(x).__name__)


def _shape(x: Any) -> tuple[int, int]:
    return tuple(int(d) for d in x.shape)


def _count(x: Any, what: str, *args) -> int:
    if isinstance(x, Leaf):
        return int(getattr(x, what)(*args))
    if what == "param_count":
        return array_size(x)
    if what == "storage_bits":
        return array_bits(x)
    n, = args
    return int(n) * int(np.prod(np.shape(x)))


def _trainable(x: Any) -> Any:
    return x.trainable() if isinstance(x, Leaf) else True


class _TwoParts(_StoredBias, Leaf):
    """What :class:`ProductLeaf` and :class:`SumLeaf` share: two parts ``first`` and
    ``second`` (weight leaves or arrays) and an optional bias ``b``. Counts are the sums of the
    parts' plus the bias; training trains both parts and the bias."""

    def param_count(self) -> int:
        return (_count(self.first, "param_count") + _count(self.second, "param_count")
                + array_size(self.b))

    def storage_bits(self) -> int:
        return (_count(self.first, "storage_bits") + _count(self.second, "storage_bits")
                + array_bits(self.b))

    def flops(self, n_tokens: int) -> int:
        return _count(self.first, "flops", n_tokens) + _count(self.second, "flops", n_tokens)

    def trainable(self):
        from lowrank_jax.leaves.channel_masked import rebuild

        return rebuild(self, first=_trainable(self.first), second=_trainable(self.second),
                       b=None if self.b is None else True)


class ProductLeaf(_TwoParts):
    """``W = first @ second`` with both factors weight leaves (or arrays): a low-rank weight
    whose factors are quantized (:class:`Int8`, :class:`Int4`, :class:`FakeQuant`).

    ``linear(P, x) = linear(second, linear(first, x)) (+ b)``: ``r (d_in + d_out)`` multiply-
    adds per token (each factor's own count). Fields: ``first [d_in, r]``, ``second [r, d_out]``
    (their biases, if any, are part of the product), ``b`` optional bias ``[d_out]``. Counts
    are the sums of the factors' plus the bias. Surgery removes the factors' outer channels
    (rank 0 when none is kept).
    """

    first: Any
    second: Any
    b: Array | None = None

    def __post_init__(self):
        _require(self.first, "ProductLeaf", "first")
        _require(self.second, "ProductLeaf", "second")
        (_, r1), (r2, d_out) = _shape(self.first), _shape(self.second)
        if r1 != r2:
            raise ShapeError(f"ProductLeaf: first [d_in, r] and second [r, d_out] must share "
                             f"r, got {r1} and {r2}", where="second", expected=r1, actual=r2)
        check_bias("ProductLeaf", self.b, d_out)

    @property
    def shape(self) -> tuple[int, int]:
        return (_shape(self.first)[0], _shape(self.second)[1])

    @property
    def rank(self) -> int:
        return _shape(self.first)[1]

    def apply(self, x: Array) -> Array:
        y = linear(self.second, linear(self.first, x))
        return y if self.b is None else y + self.b

    def to_dense(self) -> Array:
        return materialize(self.first) @ materialize(self.second)

    def keep_inputs(self, idx):
        first = keep_inputs(self.first, idx)
        second = self.second
        if not len(idx):  # the factors would multiply zeros: rank 0
            first, second = keep_outputs(first, idx), keep_inputs(second, idx)
        return ProductLeaf(first=first, second=second, b=self.b)

    def keep_outputs(self, idx):
        first, second = self.first, keep_outputs(self.second, idx)
        if not len(idx):
            first, second = keep_outputs(first, idx), keep_inputs(second, idx)
        return ProductLeaf(first=first, second=second, b=slice_bias(self.b, idx))

    def logical_axes(self):
        out = {"b": ("out",)}
        if not isinstance(self.first, Leaf):
            out["first"] = ("in", "rank")
        if not isinstance(self.second, Leaf):
            out["second"] = ("rank", "out")
        return out


ProductLeaf = leaf_dataclass(ProductLeaf)


class SumLeaf(_TwoParts):
    """``W = first + second`` with both parts weight leaves of the same shape: a quantized
    residual plus a low-rank part (``W ~ Q(W - U V) + U V``, CALDERA, arXiv:2405.18886).

    ``linear(S, x) = linear(first, x) + linear(second, x) (+ b)`` (the parts' biases, if any,
    are included). Counts are the sums of the parts' plus the bias; surgery slices both parts.
    """

    first: Any
    second: Any
    b: Array | None = None

    def __post_init__(self):
        _require(self.first, "SumLeaf", "first")
        _require(self.second, "SumLeaf", "second")
        if _shape(self.first) != _shape(self.second):
            raise ShapeError(f"SumLeaf: the parts must have the same shape, got "
                             f"{_shape(self.first)} and {_shape(self.second)}",
                             where="second", expected=_shape(self.first),
                             actual=_shape(self.second))
        check_bias("SumLeaf", self.b, _shape(self.first)[1])

    @property
    def shape(self) -> tuple[int, int]:
        return _shape(self.first)

    def apply(self, x: Array) -> Array:
        y = linear(self.first, x) + linear(self.second, x)
        return y if self.b is None else y + self.b

    def to_dense(self) -> Array:
        return materialize(self.first) + materialize(self.second)

    def keep_inputs(self, idx):
        return SumLeaf(first=keep_inputs(self.first, idx), second=keep_inputs(self.second, idx),
                       b=self.b)

    def keep_outputs(self, idx):
        return SumLeaf(first=keep_outputs(self.first, idx), second=keep_outputs(self.second, idx),
                       b=slice_bias(self.b, idx))

    def logical_axes(self):
        return {"b": ("out",)}


SumLeaf = leaf_dataclass(SumLeaf)



# ---------------------------------------------------------------------------------------------
# Calibration: the inputs a weight sees in a model's own forward.

_SINKS: dict[str, Any] = {}


def _sink(tag: str, x) -> None:
    fn = _SINKS.get(tag)
    if fn is not None:
        fn(np.asarray(x))


class Tap(Leaf):
    """A weight leaf that also hands its inputs to the host: ``linear(Tap(w, tag), x)`` is
    ``linear(w, x)``, and ``x`` is passed (through an ordered ``jax.debug.callback``, so also
    under ``jit``) to the function registered for ``tag`` with :func:`tap_sinks`. Used to
    capture calibration statistics through a model's own forward (GPTQ's ``X^T X``); every
    count and capability is the wrapped leaf's. Not meant to be stored.

    Fields: ``inner`` (the wrapped leaf), static ``tag``.
    """

    inner: Any
    tag: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return _shape(self.inner)

    def apply(self, x: Array) -> Array:
        jax.debug.callback(functools.partial(_sink, self.tag), x, ordered=True)
        return linear(self.inner, x)

    def to_dense(self) -> Array:
        return materialize(self.inner)

    def param_count(self) -> int:
        return _count(self.inner, "param_count")

    def storage_bits(self) -> int:
        return _count(self.inner, "storage_bits")

    def flops(self, n_tokens: int) -> int:
        return _count(self.inner, "flops", n_tokens)

    @property
    def bias(self):
        return bias_of(self.inner)


Tap = leaf_dataclass(Tap, meta=("tag",))


class tap_sinks:
    """Context manager: ``with tap_sinks({tag: fn}): ...`` sends the inputs of every
    :class:`Tap` with one of these tags to ``fn(x: np.ndarray)`` while the block runs (the
    callbacks are flushed on exit)."""

    def __init__(self, sinks: dict):
        self.sinks = dict(sinks)

    def __enter__(self):
        _SINKS.update(self.sinks)
        return self

    def __exit__(self, *exc):
        try:
            jax.effects_barrier()
        finally:
            for k in self.sinks:
                _SINKS.pop(k, None)
        return False


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is or holds an integer weight leaf (:class:`Int8` / :class:`Int4`): one
    itself, a :class:`ProductLeaf` / :class:`SumLeaf` with a quantized part, or any wrapper
    around one (a pruned weight's :class:`~lowrank_jax.leaves.ChannelPruned`)."""
    def integer(n):
        return isinstance(n, (Int8, Int4))

    return any(integer(n) for n in jax.tree_util.tree_leaves(x, is_leaf=integer))


def dequantize_tree(tree: Any) -> Any:
    """``tree`` with every quantized leaf (:func:`is_quantized`) and :class:`FakeQuant` replaced
    by a float leaf of its values (a :class:`~lowrank_jax.Dense` with its bias): the float
    checkpoint an export writes."""
    from lowrank_jax.leaves.dense import Dense

    def one(x):
        if is_quantized(x) or isinstance(x, FakeQuant):
            return Dense(w=jnp.asarray(materialize(x), jnp.float32), b=bias_of(x))
        return x

    from lowrank_jax.leaves.base import is_leaf

    return jax.tree_util.tree_map(one, tree, is_leaf=is_leaf)


__all__ = [
    "ACTIVATIONS", "BITS", "FakeQuant", "INT32_SAFE_D_IN", "Int4", "Int8", "Int8A8",
    "ProductLeaf", "SCALE_DTYPES", "SumLeaf", "Tap", "as_fake_quant", "check_activations",
    "check_group", "check_scale_dtype", "codes", "dequantize_tree", "expand_groups",
    "fake_quantize", "freeze_fake_quant", "grid", "group_sizes_for", "grouped_grid", "is_quantized",
    "pack_nibbles", "qrange", "quantize_rows", "quantize_weight", "tap_sinks", "unpack_nibbles",
]
