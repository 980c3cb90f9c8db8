"""The approximation error of a partition and the paper's bounds on it, per sample.

"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar), sec. II.E:
with ``Delta_m' = w^_m' - w^_m'^(r)`` the error machine ``m'``'s truncated factors cause
(eq. 73) and ``Delta = sum_m' Delta_m'`` (eq. 72),

* eq. 80: ``||Delta_m'||^2 = x_m'^T V~_{>r} Sigma~_{>r}^2 V~_{>r}^T x_m'`` (exact);
* eq. 83: ``||Delta_m'|| <= sigma_{m', r+1} ||x_m'||``;
* eq. 85: ``||Delta|| <= sum_m' sigma_{m', r+1} ||x_m'||`` (triangle inequality, eq. 84);
* eq. 86: ``<= (sum_m' sigma_{m', r+1}) ||x||``;
* eq. 90: ``||Delta|| <= sqrt(sigma_max sum_m' sigma_{m', r+1}) ||x||`` (Jensen, eqs. 87-89);
* eq. 92: ``<= sqrt(M) sigma_max ||x||``;
* eqs. 93-94: ``delta = ||Delta|| / ||W x|| <= sqrt(M) sigma_max ||x|| / ||W x||``.

Vectors here are rows (the library's ``x @ W``); inputs must be in the decomposition's machine
order (inputs are never permuted, so that is the layer's own input order).
"""

from __future__ import annotations

import numpy as np

from lowrank_jax.compress.partitioning.factor import Decomposition
from lowrank_jax.errors import ShapeError


def error_terms(dec: Decomposition, rank: int, x) -> dict[str, np.ndarray]:
    """Every quantity of eqs. 80-94 for each input sample.

    Args:
      dec: the weight's :class:`~lowrank_jax.compress.partitioning.factor.Decomposition`.
      rank: ``r``.
      x: ``[n, d_in]`` inputs.

    Returns:
      A dict of float64 arrays: ``delta_m [n, M]`` (``||Delta_m'||``, eq. 80 evaluated),
      ``eq83 [n, M]``, ``delta [n]`` (``||Delta||``, from the dense matrices), ``eq85``,
      ``eq86``, ``eq90``, ``eq92`` ``[n]``, ``rel [n]`` (eq. 93) and ``eq94 [n]``.
    """
    x = np.asarray(x, np.float64)
    d_in = dec.w.shape[0]
    if x.ndim != 2 or x.shape[1] != d_in:
        raise ShapeError(f"error_terms: x must be [n, {d_in}], got shape {x.shape}", where="x",
                         expected=[None, d_in], actual=list(x.shape))
    m = dec.machines
    a, _ = dec.block_shape
    r = min(int(rank), dec.max_rank)
    xm = x.reshape(x.shape[0], m, a)  # [n, M, a]
    proj = np.einsum("mka,nma->nmk", dec.vt[:, r:], xm)  # V~_{>r}^T x_m'
    delta_m = np.sqrt(np.einsum("nmk,mk->nm", proj**2, dec.sigma[:, r:] ** 2))  # eq. 80
    s_next = dec.sigma_next(r)  # [M]
    norm_m = np.linalg.norm(xm, axis=-1)  # [n, M]
    norm = np.linalg.norm(x, axis=-1)
    delta = np.linalg.norm(x @ (dec.w - dec.approx(r)), axis=-1)
    wx = np.linalg.norm(x @ dec.w, axis=-1)
    s_max, s_sum = float(s_next.max()), float(s_next.sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(wx > 0, delta / wx, np.nan)
        eq94 = np.where(wx > 0, np.sqrt(m) * s_max * norm / wx, np.nan)
    return {
        "delta_m": delta_m,
        "eq83": s_next[None, :] * norm_m,
        "delta": delta,
        "eq85": norm_m @ s_next,
        "eq86": s_sum * norm,
        "eq90": np.sqrt(s_max * s_sum) * norm,
        "eq92": np.sqrt(m) * s_max * norm,
        "rel": rel,
        "eq94": eq94,
    }


__all__ = ["error_terms"]
