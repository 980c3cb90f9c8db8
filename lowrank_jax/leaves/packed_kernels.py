"""A Pallas kernel for the packed-binary matmul: ``x @ (alpha * sign * mask)`` with the weight
read as bits and unpacked inside the kernel, one block at a time.

:class:`~lowrank_jax.leaves.PackedBinary` stores a binary weight as two ``uint32`` bit planes
(bit ``k`` of word ``q`` of output row ``j`` is input ``32 q + k``). On CPU its ``linear``
unpacks the whole weight once per call and calls XLA's dot (the fastest path there,
``benchmarks/layers/binary.py``). On GPU and TPU :func:`packed_matmul` is used instead: the weight
never exists in float in device memory; every program of the grid loads ``bw`` words per output
of its block (``32 bw`` inputs, 2 bits per weight) and multiplies them in registers.

Layout inside the kernel. A word holds 32 consecutive inputs; splitting it into 32 lane-sized
planes needs a reshape that Pallas backends do not all lower. Instead the *activations* are
permuted once, outside the kernel (an XLA transpose of ``x``, ``M d_in`` elements against the
``M d_in d_out`` multiply-adds): within every block of ``32 bw`` inputs, column ``k bw + q``
of the permuted ``x`` is input ``32 q + k``. Bit plane ``k`` of the block's words,
``(words >> k) & 1``, is then a ``[bw, bn]`` matrix that multiplies the static slice
``x[:, k bw:(k + 1) bw]``: 32 products per block, each with only shifts, masks and a dot, all
of which every Pallas backend lowers. The gain ``alpha`` multiplies the output once, outside
(the float leaf folds it into the weight; the results agree to float32 round-off, not bit for
bit). The words are transposed to ``[words, d_out]`` so that outputs lie along the lanes.

Selection: under ``auto`` (the default) :func:`use_kernel` is true only for a backend listed in
:data:`VERIFIED`, the backends on which this kernel has been run against a NumPy reference
(multi-block grids, odd sizes, float32 and bf16). The table is empty: every backend takes the
XLA path (unpack, then XLA's dot). The execution setting ``packed_kernel``
(:func:`lowrank_jax.execution.settings`; its default from the environment variable
``LOWRANK_JAX_PACKED_KERNEL``, read at import) overrides it: ``'off'`` never uses the kernel,
``'on'`` always does (interpreted on CPU). It is part of the traced function's cache key:
changing it re-traces.

Status: correct in interpret mode against a NumPy reference
(``tests/leaves/test_packed_kernels.py``), where the grid runs sequentially. **Wrong on GPU**: on
an NVIDIA H200 a multi-block case ``[64, 1000] @ [1000, 300]`` gave relative error 0.67
(float32) against NumPy, because the kernel adds into its output block across the reduction
grid axis, which races where grid programs run in parallel (a single-block case was right).
Until a version has been checked on a GPU, ``on`` is for experiments only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowrank_jax import execution
from lowrank_jax.errors import ShapeError

WORD = 32
ENV = execution.PACKED_KERNEL_ENV
#: Backends on which ``auto`` uses the kernel: only those where it has run against a NumPy
#: reference on that hardware (multi-block grids, odd sizes, both dtypes). A backend is added
#: only in the commit that records such a run. Empty: the kernel races on GPU (see above) and
#: has never run on a TPU.
VERIFIED: tuple[str, ...] = ()


def use_kernel(backend: str | None = None) -> bool:
    """Whether :class:`~lowrank_jax.leaves.PackedBinary` runs :func:`packed_matmul`.

    Args:
      backend: a JAX platform name; default ``jax.default_backend()``.

    Returns:
      By the active :func:`lowrank_jax.execution.current` setting ``packed_kernel``: ``'on'``
      always, ``'off'`` never, ``'auto'`` only on a backend in :data:`VERIFIED` (none yet).
    """
    mode = execution.current().packed_kernel
    if mode != "auto":
        return mode == "on"
    return (backend or jax.default_backend()) in VERIFIED


def _round_up(n: int, m: int) -> int:
    return -(-int(n) // int(m)) * int(m)


def _clip_block(block: int, size: int) -> int:
    """``min(block, max(16, next power of two >= size))``, at least 1."""
    return max(1, min(int(block), max(16, 1 << max(0, int(size) - 1).bit_length())))


def _kernel(x_ref, s_ref, m_ref, o_ref, *, bw: int, precision):
    """One ``(i, j, t)`` program: ``o[i, j] += x[i, t] @ W[t, j]`` with ``W`` unpacked here.

    ``x_ref``: ``[bm, 32 bw]`` permuted activations; ``s_ref``, ``m_ref``: ``uint32 [bw, bn]``
    sign and mask words; ``o_ref``: ``float32 [bm, bn]``, accumulated over ``t``.
    """
    from jax.experimental import pallas as pl

    @pl.when(pl.program_id(2) == 0)
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    s = s_ref[...]
    m = m_ref[...]
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for k in range(WORD):  # static: 32 planes of the block's words
        keep = ((m >> k) & 1).astype(jnp.float32)
        neg = ((s >> k) & 1).astype(jnp.float32)
        w = keep - 2.0 * neg * keep  # {-1, 0, +1}, [bw, bn]
        xk = x_ref[:, k * bw:(k + 1) * bw]  # inputs 32 q + k of the block, [bm, bw]
        acc = acc + jnp.dot(xk, w.astype(xk.dtype), preferred_element_type=jnp.float32,
                            precision=precision)
    o_ref[...] += acc


def permute_inputs(x: jax.Array, words_per_block: int) -> jax.Array:
    """Column order the kernel reads: within every block of ``32 bw`` inputs, column
    ``k bw + q`` holds input ``32 q + k``.

    Args:
      x: ``[M, 32 W]`` with ``W`` a multiple of ``words_per_block``.
      words_per_block: ``bw``.
    """
    m, n = x.shape
    bw = int(words_per_block)
    if n % (WORD * bw):
        raise ShapeError(f"permute_inputs: width {n} is not a multiple of 32 * {bw}",
                         where="x", expected=f"multiple of {WORD * bw}", actual=n)
    return x.reshape(m, n // (WORD * bw), bw, WORD).transpose(0, 1, 3, 2).reshape(m, n)


@functools.partial(jax.jit, static_argnames=("d_in", "block_m", "block_n", "block_words",
                                             "interpret"))
def packed_matmul(x: jax.Array, sign_bits: jax.Array, mask_bits: jax.Array, alpha: jax.Array,
                  d_in: int, *, block_m: int = 128, block_n: int = 128, block_words: int = 16,
                  interpret: bool | None = None) -> jax.Array:
    """``x @ (alpha * sign * mask)`` for a packed binary weight, by a Pallas kernel that unpacks
    the bits block by block.

    Args:
      x: inputs ``[..., d_in]`` (float).
      sign_bits, mask_bits: ``uint32 [d_out, ceil(d_in / 32)]``
        (:func:`~lowrank_jax.leaves.pack_bits` layout: 1 = negative, 1 = kept).
      alpha: scalar gain.
      d_in: number of inputs.
      block_m, block_n: rows and outputs per program; clipped to the problem's size rounded
        up to a power of two, not below 16.
      block_words: words per reduction step (``32 block_words`` inputs), clipped the same way;
        16 or more keeps every product's contraction long enough for GPU matrix units.
      interpret: run the kernel in Pallas' interpreter; default: on CPU only.

    Returns:
      ``[..., d_out]`` in ``result_type(x, float32)``, the product accumulated in float32.
    """
    from jax.experimental import pallas as pl

    x = jnp.asarray(x)
    if x.shape[-1] != d_in:
        raise ShapeError(f"packed_matmul: x must end in d_in={d_in}, got shape {x.shape}",
                         where="x", expected=d_in, actual=x.shape[-1])
    d_out, n_w = sign_bits.shape
    if n_w != -(-d_in // WORD) or mask_bits.shape != sign_bits.shape:
        raise ShapeError(f"packed_matmul: sign_bits and mask_bits must be uint32 "
                         f"[d_out, {-(-d_in // WORD)}], got {sign_bits.shape} and "
                         f"{mask_bits.shape}", where="sign_bits",
                         expected=(d_out, -(-d_in // WORD)), actual=tuple(sign_bits.shape))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    out_dtype = jnp.result_type(x.dtype, jnp.float32)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in)
    if not jnp.issubdtype(x2.dtype, jnp.floating):
        x2 = x2.astype(jnp.float32)
    m = x2.shape[0]

    # Blocks: the requested size, clipped to the problem rounded up to a power of two but not
    # below 16 (GPU matrix units multiply at least 16 x 16 x 16; TPU blocks then divide the
    # padded arrays); zero padding fills the rest.
    bw = _clip_block(block_words, n_w)
    bm = _clip_block(block_m, m)
    bn = _clip_block(block_n, d_out)
    wp, mp, np_ = _round_up(n_w, bw), _round_up(max(m, 1), bm), _round_up(d_out, bn)

    # Zero padding: padded inputs are 0 and padded words have mask bits 0, so they add nothing.
    xp = jnp.pad(x2, ((0, mp - m), (0, wp * WORD - d_in)))
    xp = permute_inputs(xp, bw)
    s_t = jnp.pad(jnp.asarray(sign_bits, jnp.uint32), ((0, np_ - d_out), (0, wp - n_w))).T
    m_t = jnp.pad(jnp.asarray(mask_bits, jnp.uint32), ((0, np_ - d_out), (0, wp - n_w))).T

    precision = jax.lax.Precision.HIGHEST if xp.dtype == jnp.float32 else None
    out = pl.pallas_call(
        functools.partial(_kernel, bw=bw, precision=precision),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // bm, np_ // bn, wp // bw),
        in_specs=[pl.BlockSpec((bm, WORD * bw), lambda i, j, t: (i, t)),
                  pl.BlockSpec((bw, bn), lambda i, j, t: (t, j)),
                  pl.BlockSpec((bw, bn), lambda i, j, t: (t, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, t: (i, j)),
        interpret=interpret,
        name="packed_binary_matmul",
    )(xp, s_t, m_t)
    y = out[:m, :d_out] * jnp.asarray(alpha, jnp.float32)
    return y.astype(out_dtype).reshape(lead + (d_out,))


__all__ = ["ENV", "VERIFIED", "packed_matmul", "permute_inputs", "use_kernel"]
