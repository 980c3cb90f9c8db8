"""NumPy references shared by the Flax interop tests, as the fixture ``ref`` (the tests import
in importlib mode, so a test module cannot import a sibling)."""

import types

import numpy as np
import pytest


def rank(w, r):
    """Rank-``r`` truncation of ``w`` by NumPy's SVD in float64."""
    u, s, vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
    return (u[:, :r] * s[:r]) @ vt[:r]


def per_head(w, heads, r):
    """Rank-``r`` truncation of every head's column block of ``w [d_in, heads * head_dim]``."""
    return np.concatenate([rank(b, r) for b in np.split(np.asarray(w, np.float64), heads, 1)],
                          axis=1)


def binarize(w, keep):
    """Biprop from the weights: the top ``n - floor((1 - keep) n)`` magnitudes kept,
    ``alpha = sum of kept |w| / floor(keep n)``, ``alpha sign(w) M`` (sign(0) = +1).

    Returns ``(weight, n_keep)``."""
    w = np.asarray(w, np.float64)
    n = w.size
    n_keep = n - int(np.floor((1 - keep) * n))
    m = np.zeros(n, bool)
    m[np.argsort(-np.abs(w).ravel(), kind="stable")[:n_keep]] = True
    m = m.reshape(w.shape)
    alpha = np.abs(w[m]).sum() / np.floor(keep * n)
    return alpha * np.where(w >= 0, 1.0, -1.0) * m, n_keep


@pytest.fixture(scope="session")
def ref():
    return types.SimpleNamespace(rank=rank, per_head=per_head, binarize=binarize)
