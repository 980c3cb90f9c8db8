"""Embedding rank over a corpus of patches; the Chebyshev embedding.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and Compressibility",
sec. 2 and App. I.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from lowrank_jax.analysis.rank import eps_rank_from_sv, singular_values
from lowrank_jax.errors import ConfigError, DataError


def chebyshev_embedding(x, rank: int, d: int, *, key, x_max: float = 15.0) -> np.ndarray:
    """The fixed rank-``k`` Chebyshev embedding of App. I.

    ``Phi_k(x) = sum_{j=1..k} T_j(x / x_max) u_j`` with orthonormal random ``u_j in R^d``
    (steps 1-3 of App. I; ``x_max = 15`` is Chronos' quantization range). The paper indexes
    the basis from ``T_1``; ``T_0`` (a constant) is not used, so a rank-1 embedding is
    ``(x / x_max) u_1``, the linear map the appendix starts from.

    Args:
      x: points to embed, shape ``[L]`` (or any shape, flattened).
      rank: ``k``, the algebraic rank of the embedding (``1 <= k <= d``).
      d: hidden dimension.
      key: PRNG key for the orthonormal directions.
      x_max: scale mapping inputs to ``[-1, 1]``.

    Returns:
      ``[L, d]`` embedded points (rows are tokens; the paper's ``X`` is its transpose).
    """
    if not 1 <= rank <= d:
        raise ConfigError(f"chebyshev_embedding: rank must be in [1, d={d}], got {rank}",
                          where="rank", expected=f"[1, {d}]", actual=rank)
    t = np.asarray(x, dtype=np.float64).reshape(-1) / x_max
    g = np.asarray(jax.random.normal(key, (d, rank)), dtype=np.float64)
    u, _ = np.linalg.qr(g)  # [d, k], orthonormal columns
    f = np.polynomial.chebyshev.chebvander(t, rank)[:, 1:]  # [L, k]: T_1 .. T_k
    return (f @ u.T).astype(np.float32)


def embedding_matrix(embed: Callable, patches) -> np.ndarray:
    """Stack ``embed(patches)`` into an ``[N, d]`` matrix (``patches: [N, k]``)."""
    out = np.asarray(embed(patches), dtype=np.float64)
    return out.reshape(-1, out.shape[-1])


def embedding_rank(embedded, eps: float | Sequence[float] = (1e-2, 1e-3)) -> dict:
    """Singular-value decay and eps-ranks of an embedded corpus (Figs. 2a, 3a).

    Args:
      embedded: ``[N, d]`` embedded patches (use :func:`embedding_matrix` to build it from an
        embedding function and a corpus of patches).
      eps: tolerance(s) for the eps-rank.

    Returns:
      ``{"singular_values": [...], "normalized": [...], "eps_rank": {eps: rank}}``.
    """
    a = np.asarray(embedded, dtype=np.float64)
    a = a.reshape(-1, a.shape[-1])
    sv = singular_values(a, name="embedding")
    eps_list = [eps] if isinstance(eps, (int, float)) else list(eps)
    return {
        "singular_values": sv.tolist(),
        "normalized": (sv / sv[0]).tolist() if sv[0] > 0 else sv.tolist(),
        "eps_rank": {float(e): eps_rank_from_sv(sv, float(e)) for e in eps_list},
    }


def sample_patches(series, patch: int, n: int | None = None, *, seed: int = 0) -> np.ndarray:
    """Disjoint patches of length ``patch`` from 1-D series (a list of arrays).

    Each series is standardized (mean 0, std 1 over its finite values) so the corpus mixes
    shapes, not scales; ``n`` patches are drawn at random without replacement if given.
    """
    out = []
    for s in series:
        s = np.asarray(s, dtype=np.float64).reshape(-1)
        s = s[np.isfinite(s)]
        if s.size < patch:
            continue
        s = (s - s.mean()) / (s.std() + 1e-12)
        m = s.size // patch
        out.append(s[: m * patch].reshape(m, patch))
    if not out:
        raise DataError(f"sample_patches: no series is at least patch={patch} long",
                        where="series", expected=f">= {patch} values", actual=None)
    p = np.concatenate(out)
    if n is not None and n < len(p):
        p = p[np.random.default_rng(seed).choice(len(p), n, replace=False)]
    return p


__all__ = ["chebyshev_embedding", "embedding_matrix", "embedding_rank", "sample_patches"]
