"""Key compression for attention partitioned by tokens (sec. III).

"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar), sec. III.A:
machine ``m'`` holds the keys of its tokens and sends, for each key ``k``, only the ``K``
coefficients ``f(k) = (u_i^T k)_{i <= K}`` in an orthonormal basis ``U`` (eq. 123); machine
``m`` estimates ``q^T k`` by

    ``g(q, f(k)) = sum_{i <= K} (q^T u_i)(u_i^T k) + E[sum_{i > K} q^T u_i u_i^T k]``  (eq. 124)

whose second term is a constant, ``sum_{i > K} u_i^T E[k q^T] u_i``. The expected error is
bounded by ``sum_{i > K} sqrt(u_i^T C_qk u_i)`` (eq. 134) with

    ``C_qk = E[(q k^T - E q k^T)(k q^T - E k q^T)]``  (eq. 135),

minimal when ``u_1..u_K`` are its top eigenvectors; the PCA alternative uses those of
``C_k = Cov(k)`` (eq. 136). With ``K = d_k`` the estimate is exact.

The expectations are over query-key pairs. ``pairs='all'`` pairs every query with every key
given (as attention does within a sequence; then ``E[q k^T] = E[q] E[k]^T`` and
``C_qk = E||k||^2 E[q q^T] - E[q k^T] E[k q^T]``); ``pairs='matched'`` pairs ``q[n]`` with
``k[n]``. The paper does not say which it used (its Fig. 8 samples BERT tokens at random).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError

PAIRS = ("all", "matched")
METHODS = ("cqk", "pca")


def _qk(q, k, pairs: str) -> tuple[np.ndarray, np.ndarray]:
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    if q.ndim != 2 or k.ndim != 2 or q.shape[1] != k.shape[1]:
        raise ShapeError(f"key compression: q and k must be [n, d_k] with the same d_k, got "
                         f"{q.shape} and {k.shape}", where="q, k", expected="[n, d_k]",
                         actual=(q.shape, k.shape))
    if pairs not in PAIRS:
        raise ConfigError(f"key compression: pairs must be one of {PAIRS}, got {pairs!r}",
                          where="pairs", expected=PAIRS, actual=pairs)
    if pairs == "matched" and q.shape[0] != k.shape[0]:
        raise ShapeError(f"key compression: pairs='matched' needs as many queries as keys, got "
                         f"{q.shape[0]} and {k.shape[0]}", where="q, k",
                         expected=q.shape[0], actual=k.shape[0])
    return q, k


def mean_qk(q, k, *, pairs: str = "all") -> np.ndarray:
    """``E[q k^T]`` over the pairs (``[d_k, d_k]``)."""
    q, k = _qk(q, k, pairs)
    if pairs == "all":
        return np.outer(q.mean(0), k.mean(0))
    return q.T @ k / q.shape[0]


def c_qk(q, k, *, pairs: str = "all") -> np.ndarray:
    """``C_qk = E[(q k^T - E q k^T)(k q^T - E k q^T)]`` (eq. 135), ``[d_k, d_k]``, symmetric
    positive semidefinite."""
    q, k = _qk(q, k, pairs)
    mu = mean_qk(q, k, pairs=pairs)
    if pairs == "all":
        second = np.mean(np.sum(k * k, axis=1)) * (q.T @ q) / q.shape[0]
    else:
        second = (q * np.sum(k * k, axis=1, keepdims=True)).T @ q / q.shape[0]
    c = second - mu @ mu.T
    return (c + c.T) / 2


def c_k(k) -> np.ndarray:
    """``C_k = Cov(k)`` (eq. 136), the PCA baseline; ``[d_k, d_k]``."""
    k = np.asarray(k, np.float64)
    kc = k - k.mean(0)
    return kc.T @ kc / k.shape[0]


@dataclasses.dataclass(frozen=True)
class KeyBasis:
    """An orthonormal basis for key compression and the constant of eq. 124 per ``K``.

    Fields:
      u: ``[d_k, d_k]`` orthonormal, columns ordered by decreasing eigenvalue of the matrix it
        was built from.
      eigenvalues: ``[d_k]`` of that matrix (descending).
      tail: ``[d_k + 1]`` with ``tail[K] = sum_{i > K} u_i^T E[k q^T] u_i``, the constant term of
        eq. 124 when ``K`` coefficients are sent.
      bound: ``[d_k + 1]`` with ``bound[K] = sum_{i > K} sqrt(u_i^T C_qk u_i)`` (eq. 134), the
        bound on ``E|q^T k - g|``.
      method: ``'cqk'`` (eq. 135) or ``'pca'`` (eq. 136).
    """

    u: np.ndarray
    eigenvalues: np.ndarray
    tail: np.ndarray
    bound: np.ndarray
    method: str

    def compress(self, k, num: int) -> np.ndarray:
        """``f(k) = (u_i^T k)_{i <= K}`` (eq. 123): ``[n, d_k] -> [n, K]``, what is sent."""
        return np.asarray(k, np.float64) @ self.u[:, :num]

    def estimate(self, q, fk, num: int) -> np.ndarray:
        """``g(q, f(k))`` (eq. 124) for every query with every compressed key:
        ``[n_q, d_k], [n_k, K] -> [n_q, n_k]``."""
        fk = np.asarray(fk, np.float64)
        if fk.ndim != 2 or fk.shape[1] != num:
            raise ShapeError(f"KeyBasis.estimate: f(k) must be [n, {num}], got {fk.shape}",
                             where="fk", expected=[None, num], actual=fk.shape)
        return (np.asarray(q, np.float64) @ self.u[:, :num]) @ fk.T + self.tail[num]


def key_basis(q, k, *, method: str = "cqk", pairs: str = "all") -> KeyBasis:
    """The basis of sec. III.A from samples of queries and keys.

    Args:
      q: ``[n_q, d_k]`` queries.
      k: ``[n_k, d_k]`` keys.
      method: ``'cqk'`` (top eigenvectors of ``C_qk``, eq. 135: minimizes the bound of
        eq. 134) or ``'pca'`` (of ``C_k``, eq. 136).
      pairs: ``'all'`` or ``'matched'`` (module docstring).

    Returns:
      A :class:`KeyBasis`.
    """
    q, k = _qk(q, k, pairs)
    if method not in METHODS:
        raise ConfigError(f"key_basis: method must be one of {METHODS}, got {method!r}",
                          where="method", expected=METHODS, actual=method)
    cqk = c_qk(q, k, pairs=pairs)
    mat = cqk if method == "cqk" else c_k(k)
    vals, vecs = np.linalg.eigh(mat)
    order = np.argsort(vals)[::-1]
    vals, u = vals[order], vecs[:, order]
    e_kq = mean_qk(q, k, pairs=pairs).T  # E[k q^T]
    per = np.einsum("di,de,ei->i", u, e_kq, u)  # u_i^T E[k q^T] u_i
    spread = np.sqrt(np.maximum(np.einsum("di,de,ei->i", u, cqk, u), 0.0))
    rev = np.concatenate([np.cumsum(per[::-1])[::-1], [0.0]])
    rev_b = np.concatenate([np.cumsum(spread[::-1])[::-1], [0.0]])
    return KeyBasis(u=u, eigenvalues=vals, tail=rev, bound=rev_b, method=method)


def relative_logit_errors(q, k, basis: KeyBasis, num: int) -> np.ndarray:
    """``|q^T k - g(q, f(k))| / |q^T k|`` for every query-key pair (the paper's Fig. 8 plots
    the mean), ``[n_q, n_k]`` (``nan`` where ``q^T k = 0``)."""
    exact = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T
    est = basis.estimate(q, basis.compress(k, num), num)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(exact != 0, np.abs(exact - est) / np.abs(exact), np.nan)


__all__ = ["KeyBasis", "METHODS", "PAIRS", "c_k", "c_qk", "key_basis", "mean_qk",
           "relative_logit_errors"]
