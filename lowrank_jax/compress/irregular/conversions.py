"""Query-key conversions: from an augmented query-key tensor
(:func:`~lowrank_jax.leaves.qk_factorized.augmented_joint`) to a
:class:`~lowrank_jax.QueryKey` with per-head widths (TruncAtt, "Vision Transformer with
Irregular Attention", sec. 2.3), and any query-key object back to separate q and k weights
(:func:`to_query_key`, what the Hugging Face exporter uses)."""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ShapeError
from lowrank_jax.leaves import QK, Dense, QueryKey, as_query_key, leaf_dtype
from lowrank_jax.leaves.qk_factorized import augmented_joint


def bias_rows(y: np.ndarray) -> tuple[bool, bool]:
    """Whether the query-bias row / key-bias column of an augmented tensor are used."""
    return bool(np.any(y[-1] != 0)), bool(np.any(y[:, -1] != 0))


def core_of(y: np.ndarray, qb: bool, kb: bool) -> np.ndarray:
    """The augmented tensor without its unused bias row / column."""
    return y[: y.shape[0] - (0 if qb else 1), : y.shape[1] - (0 if kb else 1)]


def factor_leaf(factor: np.ndarray, d_in: int, with_bias: bool, dtype) -> Dense:
    """A ``Dense`` from the rows of an augmented factor (the last one the bias, if used)."""
    w = jnp.asarray(factor[:d_in], dtype)
    b = jnp.asarray(factor[d_in], dtype) if with_bias else None
    return Dense(w=w, b=b)


def slice_svds(y: np.ndarray):
    """The SVD of every slice ``y[:, :, h]``."""
    return [np.linalg.svd(y[:, :, h], full_matrices=False) for h in range(y.shape[2])]


def query_key_from_slices(y_aug: np.ndarray, ranks: Sequence[int], *, dtype=jnp.float32,
                          svds=None) -> tuple[QueryKey, float]:
    """TruncAtt: a :class:`~lowrank_jax.QueryKey` from per-head truncated SVDs of the slices of
    an augmented query-key tensor ("Vision Transformer with Irregular Attention", sec. 2.3).

    Head ``h`` keeps ``ranks[h]`` singular triplets of ``Y~_h``, split evenly
    (``U sqrt(S)`` for the queries, ``V sqrt(S)`` for the keys); the factors' last rows are the
    biases (left out where the tensor's bias row or column is zero).

    Args:
      y_aug: ``[d_q + 1, d_k + 1, H]`` (:func:`~lowrank_jax.leaves.qk_factorized.augmented_joint`).
      ranks: per-head ranks (clipped to the slice's size).
      dtype: dtype of the new leaves.
      svds: the slices' SVDs if already computed.

    Returns:
      ``(qk, error)``: ``error = sqrt(sum of the discarded squared singular values) /
      ||Y~||_F`` over the decomposed tensor.
    """
    y_aug = np.asarray(y_aug, np.float64)
    dq, dk = y_aug.shape[0] - 1, y_aug.shape[1] - 1
    qb, kb = bias_rows(y_aug)
    y = core_of(y_aug, qb, kb)
    svds = slice_svds(y) if svds is None else svds
    qs, ks, widths, tail = [], [], [], 0.0
    for h, (u, s, vt) in enumerate(svds):
        r = int(min(max(int(ranks[h]), 0), s.size))
        root = np.sqrt(s[:r])
        qs.append(u[:, :r] * root)
        ks.append(vt[:r].T * root)
        widths.append(r)
        tail += float(np.sum(s[r:] ** 2))
    qf = np.concatenate(qs, axis=1) if qs else np.zeros((y.shape[0], 0))
    kf = np.concatenate(ks, axis=1) if ks else np.zeros((y.shape[1], 0))
    norm = float(np.linalg.norm(y))
    qk = QueryKey(q=factor_leaf(qf, dq, qb, dtype), k=factor_leaf(kf, dk, kb, dtype), widths=tuple(widths))
    return qk, (math.sqrt(tail) / norm if norm > 0 else 0.0)


def numerical_ranks(y_aug: np.ndarray, *, rtol: float = 1e-10, svds=None) -> list[int]:
    """Rank of every slice of a float64 tensor: singular values above ``rtol`` times the
    largest of the whole tensor (``svds``: the slices' SVDs if already computed)."""
    svs = ([np.linalg.svd(y_aug[:, :, h], compute_uv=False) for h in range(y_aug.shape[2])]
           if svds is None else [s for _, s, _ in svds])
    top = max((float(s[0]) for s in svs if s.size), default=0.0)
    return [int(np.sum(s > rtol * top)) if top > 0 else 0 for s in svs]


def to_query_key(qk: QK, *, max_width: int | None = None, rtol: float = 1e-10,
                 where: str = "qk") -> QueryKey:
    """Any query-key object as an equivalent :class:`~lowrank_jax.QueryKey` (separate q and k
    weights per head), exactly: a float64 SVD of every slice of its augmented query-key tensor,
    kept at the slice's numerical rank (relative ``rtol``).

    This is what the Hugging Face exporter uses for CP-SlimAtt and IrrAtt blocks. A slice of a
    CP model or of a block-term model with a general fusion matrix has rank up to ``R``, more
    than a head of ``d_head`` columns can hold.

    Args:
      qk: the query-key object.
      max_width: the widest head allowed (``d_head`` of the checkpoint); ``None``: no limit.
      rtol: relative threshold of the numerical rank.
      where: parameter path, for messages.

    Raises:
      ShapeError: a slice has rank above ``max_width`` (naming the path, the heads, their ranks
        and the limit).
    """
    separate = as_query_key(qk)
    if separate is not None:
        return separate
    y = augmented_joint(qk)
    qb, kb = bias_rows(y)
    core = core_of(y, qb, kb)
    ranks = numerical_ranks(core, rtol=rtol)
    if max_width is not None and max(ranks, default=0) > max_width:
        bad = {h: r for h, r in enumerate(ranks) if r > max_width}
        raise ShapeError(
            f"{where}: a {type(qk).__name__} cannot be written as separate q/k weights of "
            f"{max_width} columns per head exactly: the query-key slices of heads "
            f"{sorted(bad)} have ranks {[bad[h] for h in sorted(bad)]} > {max_width} (a CP "
            "model or a block-term model whose fusion matrix mixes terms has slices of rank up "
            "to R). Compress with truncatt, or with btd at ranks <= d_head and the fusion "
            "matrix kept diagonal, to export.", where=where, expected=f"ranks <= {max_width}",
            actual=ranks)
    new, _ = query_key_from_slices(y, ranks, dtype=leaf_dtype(qk))
    return new

__all__ = ["bias_rows", "core_of", "factor_leaf", "numerical_ranks", "query_key_from_slices",
           "slice_svds", "to_query_key"]
