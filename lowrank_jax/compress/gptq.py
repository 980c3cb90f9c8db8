"""GPTQ: one weight's integer codes from the Gram matrix of its inputs.

"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers" (Frantar
et al., arXiv:2210.17323), Algorithm 1 with the reference code's grouping. In the paper's
orientation the weight is ``W^T [d_out, d_in]`` (rows are output channels, quantized
independently; columns are inputs, quantized one after another) and ``H = X X^T`` over the
calibration inputs (the paper's ``2 X X^T``; a constant factor changes nothing below).

* Dead inputs (``H_ii = 0``): ``H_ii = 1`` and the column of ``W`` set to 0.
* Damping: ``H + damp * mean(diag H) I`` (``damp = 0.01``, the paper's lambda).
* ``U = chol(H^-1)^T`` (upper triangular; the reference's ``cholesky(cholesky_inverse(
  cholesky(H)), upper=True)``, here ``cholesky(inv(H))^T``).
* Columns in their natural order (no act-order), in blocks of ``block`` columns (128): inside a
  block, column ``j`` is quantized to ``q``, its error ``e = (w_j - q) / U_jj`` is spread over
  the block's later columns (``W_{:, k} -= e U_jk``); after the block, its errors update all
  later columns at once (the "lazy batch" update, ``W_{:, later} -= E U_{block, later}``).
* Groups (``group`` inputs share a scale per output): a group's scale and zero point are
  computed when its first column is reached, from the group's columns *as updated so far*
  (the reference computes them from the columns as they were at the start of the block,
  which is the same thing when groups start blocks; here the block is rounded up to a multiple
  of the group, so every group lies in one block and sees every update before it). Without
  groups (``group=None``, one scale per output channel) the scales come from the weight before
  any update, as in the reference.

The grid and the code of a value are those of the integer leaves
(:func:`lowrank_jax.leaves.quantized.grid`, :func:`~lowrank_jax.leaves.quantized.codes`), so
the codes found here are stored as they are in an :class:`~lowrank_jax.leaves.Int4` /
:class:`~lowrank_jax.leaves.Int8`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ShapeError
from lowrank_jax.leaves.quantized import codes as grid_codes
from lowrank_jax.leaves.quantized import grid, group_sizes_for


def effective_block(block: int, group: int | None) -> int:
    """``block`` rounded up to a multiple of ``group`` (every group inside one block)."""
    if group is None:
        return int(block)
    return -(-int(block) // int(group)) * int(group)


@functools.partial(jax.jit, static_argnames=("bits", "zero_point", "scale_dtype", "sizes",
                                             "block", "damp"))
def _gptq(w, h, *, bits, zero_point, scale_dtype, sizes, block, damp):
    wt = w.T  # [d_out, d_in]: the paper's W
    n = wt.shape[1]
    diag = jnp.diagonal(h)
    dead = diag == 0
    h = h + jnp.diag(dead.astype(h.dtype))
    wt = jnp.where(dead[None, :], 0, wt)
    h = h + damp * jnp.mean(jnp.diagonal(h)) * jnp.eye(n, dtype=h.dtype)
    u = jnp.linalg.cholesky(jnp.linalg.inv(h)).T
    per_channel = len(sizes) == 1 and sizes[0] == n
    if per_channel:
        s0, z0 = grid(wt, bits=bits, zero_point=zero_point, scale_dtype=scale_dtype, axis=1)
    q_all = jnp.zeros_like(wt)
    scales, zeros = [], []
    starts = np.cumsum((0,) + tuple(sizes))
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        w1, u1 = wt[:, i1:i2], u[i1:i2, i1:i2]
        q1 = jnp.zeros_like(w1)
        err1 = jnp.zeros_like(w1)
        segments = [(i1, i2)] if per_channel else [
            (a, b) for a, b in zip(starts[:-1], starts[1:], strict=True) if i1 <= a < i2]
        for a, b in segments:
            if per_channel:
                s, z = s0, z0
            else:  # the group's columns as updated by every column before it
                s, z = grid(w1[:, a - i1:b - i1], bits=bits, zero_point=zero_point,
                            scale_dtype=scale_dtype, axis=1)
                scales.append(s)
                zeros.append(z)

            def column(j, carry, s=s, z=z, u1=u1):
                w1, q1, err1 = carry
                col = jax.lax.dynamic_index_in_dim(w1, j, axis=1, keepdims=False)
                d = u1[j, j]
                q = grid_codes(col, s, z, bits=bits, zero_point=zero_point)
                e = (col - s * (q - z)) / d
                w1 = w1 - e[:, None] * jax.lax.dynamic_index_in_dim(u1, j, axis=0)
                q1 = jax.lax.dynamic_update_index_in_dim(q1, q, j, axis=1)
                err1 = jax.lax.dynamic_update_index_in_dim(err1, e, j, axis=1)
                return w1, q1, err1

            w1, q1, err1 = jax.lax.fori_loop(int(a - i1), int(min(b, i2) - i1), column,
                                             (w1, q1, err1))
        q_all = q_all.at[:, i1:i2].set(q1)
        if i2 < n:
            wt = wt.at[:, i2:].add(-(err1 @ u[i1:i2, i2:]))
    if per_channel:
        scales, zeros = [s0], [z0]
    return q_all.T, jnp.stack(scales), jnp.stack(zeros)


def gptq(w: Any, h: Any, *, bits: int, group: int | None = None, zero_point: bool = False,
         scale_dtype: Any = "float32", block: int = 128,
         damp: float = 0.01) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
    """GPTQ codes of one weight (module docstring).

    Args:
      w: the weight ``[d_in, d_out]`` (this library's orientation, ``y = x @ w``).
      h: ``X^T X`` over the calibration inputs ``X [n, d_in]`` (``[d_in, d_in]``).
      bits: 4 or 8.
      group: inputs per scale (``None``: one scale per output channel).
      zero_point: asymmetric grid with zero points.
      scale_dtype: the scales' stored dtype (``None``: not rounded, for float64 tests).
      block: columns per lazy-update block (rounded up to a multiple of ``group``).
      damp: the damping fraction of the mean diagonal.

    Returns:
      ``(codes [d_in, d_out], scales [G, d_out], zeros [G, d_out], group_sizes)`` as NumPy
      arrays in the computation's dtype (the dtype of ``w``: float32, or float64 with 64-bit
      types enabled); ``codes`` integral.

    Raises:
      ShapeError: ``h`` not ``[d_in, d_in]``.
    """
    w = jnp.asarray(w)
    h = jnp.asarray(h, w.dtype)
    d_in = int(w.shape[0])
    if tuple(h.shape) != (d_in, d_in):
        raise ShapeError(f"gptq: h must be [{d_in}, {d_in}] (the Gram matrix of the inputs), "
                         f"got {tuple(h.shape)}", where="h", expected=(d_in, d_in),
                         actual=tuple(h.shape))
    sizes = group_sizes_for(d_in, group)
    sdt = None if scale_dtype is None else jnp.dtype(scale_dtype).name
    c, s, z = _gptq(w, h, bits=int(bits), zero_point=bool(zero_point), scale_dtype=sdt,
                    sizes=sizes, block=effective_block(block, group), damp=float(damp))
    return np.asarray(c), np.asarray(s), np.asarray(z), sizes


__all__ = ["effective_block", "gptq"]
