"""eps-rank and spectra (eq. 1 of "Understanding Transformers for Time Series: Rank Structure,
Flow-of-Ranks, and Compressibility").

Singular values are computed in float64 with NumPy on the host; a leaf is materialized in
float64 under :func:`lowrank_jax.execution.reference_precision`, so no accelerator's reduced
float32 product (TF32) enters a spectrum."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lowrank_jax.errors import ConfigError, DataError, ShapeError
from lowrank_jax.execution import reference_precision
from lowrank_jax.leaves import materialize_host


def _as_matrix(w, name: str = "w") -> np.ndarray:
    with reference_precision():  # a factored leaf's product in full precision on any backend
        a = materialize_host(w)
    if a.ndim != 2:
        raise ShapeError(f"{name}: expected a 2-D matrix, got shape {a.shape}", where=name,
                         expected="2-D", actual=a.shape)
    if not np.all(np.isfinite(a)):
        raise DataError(f"{name}: matrix has non-finite entries", where=name,
                        expected="finite values", actual="non-finite")
    return a


def singular_values(w, *, name: str = "w") -> np.ndarray:
    """Singular values of a matrix or leaf, descending, computed in float64 on the host.

    Args:
      w: a 2-D array or a :class:`~lowrank_jax.Leaf` (materialized in float64,
        :func:`lowrank_jax.materialize_host`).
      name: used in error messages (a parameter path).
    """
    return np.linalg.svd(_as_matrix(w, name), compute_uv=False)


def eps_rank_from_sv(sv: np.ndarray, eps: float) -> int:
    """Eq. 1 on given singular values: ``#{j : sigma_j / sigma_1 > eps}``."""
    _check_eps(eps)
    sv = np.asarray(sv, dtype=np.float64)
    if sv.size == 0 or sv[0] <= 0:
        return 0
    return int(np.sum(sv / sv[0] > eps))


def _check_eps(eps) -> None:
    if not (isinstance(eps, (int, float, np.floating)) and 0.0 < float(eps) < 1.0):
        raise ConfigError(f"eps must be a number in (0, 1), got {eps!r}", where="eps",
                          expected="(0, 1)", actual=eps)


def eps_rank(w, eps: float | Sequence[float], *, name: str = "w") -> int | list[int]:
    """Numerical rank ``rank_eps(W) = #{j : sigma_j(W) / sigma_1(W) > eps}`` (eq. 1).

    Truncating ``W`` to its eps-rank guarantees ``||W - W_r||_2 <= eps ||W||_2``.

    Args:
      w: a 2-D array or a leaf.
      eps: a tolerance in (0, 1), or a sequence of them.
      name: used in error messages.

    Returns:
      The eps-rank, or a list of them when ``eps`` is a sequence.
    """
    sv = singular_values(w, name=name)
    if isinstance(eps, (list, tuple, np.ndarray)):
        return [eps_rank_from_sv(sv, float(e)) for e in eps]
    return eps_rank_from_sv(sv, eps)


def normalized_spectrum(w, *, name: str = "w") -> np.ndarray:
    """``sigma_j / sigma_1`` (the curves of Figs. 2, 3, 5c)."""
    sv = singular_values(w, name=name)
    return sv / sv[0] if sv.size and sv[0] > 0 else sv


def tokens_matrix(h) -> np.ndarray:
    """Hidden states ``[..., d]`` as a ``[N, d]`` matrix of tokens (rows)."""
    a = np.asarray(h, dtype=np.float64)
    return a.reshape(-1, a.shape[-1])


__all__ = [
    "eps_rank", "eps_rank_from_sv", "normalized_spectrum", "singular_values", "tokens_matrix",
]
