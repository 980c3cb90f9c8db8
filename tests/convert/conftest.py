"""Helpers shared by the converter tests, as fixtures (the tests run with
``--import-mode=importlib``, so test modules cannot import each other)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.leaves import (
    HeadLowRank,
    Leaf,
    LowRank,
    bias_of,
    materialize_host,
    named_leaves,
    replace_paths,
)


def _truncated(w: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(u, v)`` with ``u @ v`` the best rank-``rank`` approximation of ``w`` (NumPy SVD)."""
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    return (u[:, :rank] * s[:rank]).astype(np.float32), vt[:rank].astype(np.float32)


def lowrank_leaves(params, pattern: str, rank: int):
    """``params`` with every weight leaf whose path matches ``pattern`` replaced by its
    rank-``rank`` truncated SVD (a :class:`LowRank` keeping the leaf's bias)."""
    new = {}
    for path, node in named_leaves(params):
        if isinstance(node, Leaf) and re.search(pattern, path):
            u, v = _truncated(materialize_host(node), rank)
            new[path] = LowRank(u=jnp.asarray(u), v=jnp.asarray(v), b=bias_of(node))
    assert new, f"no weight leaf matches {pattern!r}"
    return replace_paths(params, new)


def head_lowrank_leaves(params, pattern: str, rank: int, num_heads: int):
    """``params`` with every matching leaf replaced by per-head truncated SVDs
    (:class:`HeadLowRank`: one ``[d_in, rank]`` sketch per head of the leaf's outputs)."""
    new = {}
    for path, node in named_leaves(params):
        if isinstance(node, Leaf) and re.search(pattern, path):
            w = materialize_host(node)
            d_head = w.shape[1] // num_heads
            us, vs = zip(*(_truncated(w[:, h * d_head:(h + 1) * d_head], rank)
                           for h in range(num_heads)), strict=True)
            new[path] = HeadLowRank(u=jnp.asarray(np.stack(us, axis=1)),
                                    v=jnp.asarray(np.stack(vs)), b=bias_of(node))
    assert new, f"no weight leaf matches {pattern!r}"
    return replace_paths(params, new)


def randomize_torch(model, seed: int):
    """O(1) weights so that a transposed, misplaced or dropped tensor shows in the outputs:
    N(0, 0.15^2), norm scales 1 + N(0, 0.15^2)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.15 * torch.randn(p.shape, generator=g)
            is_norm_scale = "norm" in name.lower() and name.endswith("weight") and p.ndim == 1
            p.copy_(1.0 + noise if is_norm_scale else noise)
    return model.eval()


@pytest.fixture(scope="session")
def lowrank():
    return lowrank_leaves


@pytest.fixture(scope="session")
def head_lowrank():
    return head_lowrank_leaves


@pytest.fixture(scope="session")
def randomize():
    return randomize_torch
