"""Truncated SVD of weight leaves: per matrix, per head, and data-aware (seed 000).

All decompositions run offline, on the host, in float64 NumPy (accurate and deterministic), and
the factors are cast back to the weight's dtype at the end.

* :func:`truncated_svd` -- ``W ~ W_r``, the best rank-``r`` approximation (Eckart-Young); at
  tolerance ``eps`` it keeps ``rank_eps(W)`` singular values (seed 000 eq. 1) and so guarantees
  ``||W - W_r||_2 <= eps ||W||_2`` (seed 000 sec. 5, "Compressing a Pretrained Model").
* :func:`head_truncated_svd` -- head-dependent sketching, one truncation per head (seed 000
  eq. 20).
* :func:`project_inputs` -- the construction in the proof of Theorem 3/5 (seed 000 App. D):
  project the weight onto the leading singular subspace of its *inputs*, ``W~ = B_r B_r^T W``.
* :func:`compare_truncations` -- weight and output errors of both truncations side by side.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.leaves import Dense, HeadLowRank, Leaf, LowRank

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Small shared helpers (also used by compress.py).

def _eps_rank(sv: np.ndarray, eps: float) -> int:
    """Seed 000 eq. 1 on descending singular values: ``#{j : sigma_j / sigma_1 > eps}``.

    A zero matrix (``sigma_1 = 0``) has eps-rank 0. (Same formula as
    ``lowrank_jax.analysis.rank.eps_rank_from_sv``; duplicated so this module does not depend on
    that one's validation.)
    """
    sv = np.asarray(sv, dtype=np.float64)
    if sv.size == 0 or sv[0] <= 0:
        return 0
    return int(np.sum(sv / sv[0] > eps))


def _normalized(sv: np.ndarray) -> np.ndarray:
    """``sigma_j / sigma_1`` (all zeros for a zero matrix)."""
    sv = np.asarray(sv, dtype=np.float64)
    if sv.size == 0 or sv[0] <= 0:
        return np.zeros_like(sv)
    return sv / sv[0]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_eps(fn: str, path: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 < float(eps) < 1.0:
        raise ValueError(f"{fn}: {path}: eps must be a number in (0, 1), got {eps!r}")
    return float(eps)


def _check_rank(fn: str, path: str, rank, max_rank: int, what: str) -> int:
    if not _is_int(rank) or not 1 <= int(rank) <= max_rank:
        raise ValueError(
            f"{fn}: {path}: rank must be an int in [1, {max_rank}] ({what}), got {rank!r}"
        )
    return int(rank)


def _check_one_of(fn: str, path: str, eps, rank) -> None:
    if (eps is None) == (rank is None):
        raise ValueError(
            f"{fn}: {path}: give exactly one of eps= or rank=, got eps={eps!r}, rank={rank!r}"
        )


def _out_dtype(dtype) -> np.dtype:
    """The dtype the factors are returned in (float64 becomes float32 unless x64 is enabled)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _weight(fn: str, w, path: str, *, allow_head: bool = False):
    """``(matrix float64 [d_in, d_out], bias or None, dtype)`` of a weight, validated."""
    if isinstance(w, Dense):
        mat, bias, dtype = np.asarray(w.w, np.float64), w.b, w.w.dtype
    elif isinstance(w, LowRank):
        # Re-truncation: the product in float64, not through a float32 matmul.
        mat = np.asarray(w.u, np.float64) @ np.asarray(w.v, np.float64)
        bias, dtype = w.b, w.u.dtype
    elif isinstance(w, HeadLowRank) and allow_head:
        u = np.asarray(w.u, np.float64)  # [d_in, h, r]
        mask = np.arange(w.max_rank)[None, :] < np.asarray(w.head_ranks)[:, None]  # [h, r]
        mat = np.einsum("ihr,hrd->ihd", u * mask[None], np.asarray(w.v, np.float64))
        mat = mat.reshape(w.d_in, -1)
        bias, dtype = w.b, w.u.dtype
    elif isinstance(w, Leaf):
        kinds = "Dense, LowRank, HeadLowRank" if allow_head else "Dense, LowRank"
        raise TypeError(
            f"{fn}: {path}: cannot truncate a {type(w).__name__} leaf; expected {kinds} "
            "or a 2-D array"
        )
    else:
        raw = np.asarray(w)
        if raw.ndim != 2:
            raise ValueError(
                f"{fn}: {path}: weight must be 2-D [d_in, d_out], got shape {tuple(raw.shape)}"
            )
        dtype = raw.dtype if jnp.issubdtype(raw.dtype, jnp.floating) else np.float32
        mat, bias = raw.astype(np.float64), None
    if mat.ndim != 2:
        raise ValueError(
            f"{fn}: {path}: weight must be 2-D [d_in, d_out], got shape {tuple(mat.shape)}"
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{fn}: {path}: weight must be floating point, got dtype {dtype}")
    bad = int(np.size(mat) - np.count_nonzero(np.isfinite(mat)))
    if bad:
        raise ValueError(
            f"{fn}: {path}: weight has {bad} non-finite entries (NaN or inf) out of "
            f"{mat.size}; fix the checkpoint before compressing"
        )
    return mat, bias, _out_dtype(dtype)


def _svd(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thin SVD in float64: ``mat = U diag(s) Vt``, ``s`` descending."""
    return np.linalg.svd(mat, full_matrices=False)


def _balanced(U: np.ndarray, s: np.ndarray, Vt: np.ndarray,
              r: int) -> tuple[np.ndarray, np.ndarray]:
    """``u = U_r sqrt(S_r)``, ``v = sqrt(S_r) V_r^T`` in float64.

    Why balanced: both factors then carry the same scale (``||u||_2 = ||v||_2 =
    sqrt(sigma_1)``), so after compression they receive gradients of comparable size and one
    learning rate suits both when the compressed model is fine-tuned or trained further.
    Putting all of ``S`` on one side would make that factor ``sigma_1`` times larger than the
    orthonormal one.
    """
    root = np.sqrt(s[:r])
    return U[:, :r] * root[None, :], root[:, None] * Vt[:r]


def _eps_keep(sv: np.ndarray, eps: float) -> int:
    """Rank kept at tolerance ``eps``: the eps-rank, at least 1 (a factor needs a column)."""
    return max(1, _eps_rank(sv, eps))


# ---------------------------------------------------------------------------------------------
# Public API.

def truncated_svd(w, *, eps: float | None = None, rank: int | None = None,
                  path: str = "w") -> LowRank:
    """Best low-rank approximation of a weight as a :class:`~lowrank_jax.LowRank` leaf.

    Seed 000 sec. 5 ("Compressing a Pretrained Model"): with ``W = sum_j sigma_j u_j v_j^T``,
    keeping ``r = rank_eps(W)`` terms (eq. 1) guarantees ``||W - W_r||_2 <= eps ||W||_2``; in
    general ``||W - W_r||_2 = sigma_{r+1}``.

    The SVD runs on the host in float64; the factors are split in a balanced way,
    ``u = U_r sqrt(S_r)`` and ``v = sqrt(S_r) V_r^T`` (equal scales, see ``_balanced``), and cast
    back to the weight's dtype.

    Args:
      w: a :class:`~lowrank_jax.Dense` leaf (its bias is kept), a
        :class:`~lowrank_jax.LowRank` leaf (re-truncated; bias kept) or a 2-D array
        ``[d_in, d_out]``.
      eps: tolerance in (0, 1): keep ``rank_eps(W)`` singular values (at least 1).
      rank: keep exactly ``rank`` singular values, an int in ``[1, min(d_in, d_out)]``.
        Give exactly one of ``eps`` and ``rank``.
      path: the parameter path, used in error messages.

    Returns:
      ``LowRank(u [d_in, r], v [r, d_out], b)``.

    Raises:
      ValueError: both or neither of eps/rank; eps outside (0, 1); rank out of range; weight not
        2-D; non-finite weights.
    """
    fn = "truncated_svd"
    _check_one_of(fn, path, eps, rank)
    mat, bias, dtype = _weight(fn, w, path)
    d_in, d_out = mat.shape
    if eps is not None:
        eps = _check_eps(fn, path, eps)
    else:
        rank = _check_rank(fn, path, rank, min(d_in, d_out), f"weight shape {mat.shape}")
    U, s, Vt = _svd(mat)
    r = _eps_keep(s, eps) if eps is not None else rank
    u, v = _balanced(U, s, Vt, r)
    return LowRank(u=jnp.asarray(u, dtype), v=jnp.asarray(v, dtype), b=bias)


def _head_factors(mat: np.ndarray, num_heads: int, head_ranks, svds, dtype, bias) -> HeadLowRank:
    d_in = mat.shape[0]
    d_h = mat.shape[1] // num_heads
    r_max = max(head_ranks)
    u = np.zeros((d_in, num_heads, r_max))
    v = np.zeros((num_heads, r_max, d_h))
    for i, ((U, s, Vt), r) in enumerate(zip(svds, head_ranks, strict=True)):
        u[:, i, :r], v[i, :r, :] = _balanced(U, s, Vt, r)
    ranks = None if all(r == r_max for r in head_ranks) else tuple(int(r) for r in head_ranks)
    return HeadLowRank(u=jnp.asarray(u, dtype), v=jnp.asarray(v, dtype), b=bias, ranks=ranks)


def _split_heads(fn: str, path: str, mat: np.ndarray, num_heads) -> list[np.ndarray]:
    d_out = mat.shape[1]
    if not _is_int(num_heads) or num_heads < 1 or d_out % num_heads:
        raise ValueError(
            f"{fn}: {path}: num_heads must be a positive int that divides d_out={d_out} "
            f"(weight shape {mat.shape}), got {num_heads!r}"
        )
    d_h = d_out // num_heads
    return [mat[:, i * d_h:(i + 1) * d_h] for i in range(num_heads)]


def head_truncated_svd(w, num_heads: int, *, eps: float | None = None, rank: int | None = None,
                       path: str = "w") -> HeadLowRank:
    """Per-head truncated SVD with head-dependent sketches (seed 000 eq. 20).

    The output columns are split into heads, head-major: head ``i`` is
    ``W[:, i*d_h:(i+1)*d_h]`` (the layout of every attention projection in lowrank_jax). Each
    head is truncated on its own, so each gets its own input sketch ``u[:, i]`` (eq. 20), unlike
    a shared :func:`truncated_svd` of the whole matrix (eq. 19).

    With ``eps`` each head keeps its own eps-rank (relative to that head's ``sigma_1``), so
    ``||W_i - W_{i,r}||_2 <= eps ||W_i||_2`` for every head. Ranks then differ between heads:
    the factors are zero-padded to the largest and ``ranks=`` is set; the leaf masks the padding.

    Args:
      w: a Dense, LowRank or HeadLowRank leaf (bias kept) or a 2-D array ``[d_in, h * d_h]``.
      num_heads: number of heads ``h``; must divide ``d_out``.
      eps: tolerance in (0, 1), per head; or
      rank: one rank for every head, an int in ``[1, min(d_in, d_h)]``.
      path: the parameter path, used in error messages.

    Returns:
      ``HeadLowRank(u [d_in, h, r_max], v [h, r_max, d_h], b, ranks)`` with balanced factors.
    """
    fn = "head_truncated_svd"
    _check_one_of(fn, path, eps, rank)
    mat, bias, dtype = _weight(fn, w, path, allow_head=True)
    heads = _split_heads(fn, path, mat, num_heads)
    d_in, d_h = heads[0].shape
    if eps is not None:
        eps = _check_eps(fn, path, eps)
    else:
        rank = _check_rank(fn, path, rank, min(d_in, d_h),
                           f"per head: d_in={d_in}, d_head={d_h}")
    svds = [_svd(h) for h in heads]
    if eps is not None:
        head_ranks = [_eps_keep(s, eps) for _, s, _ in svds]
    else:
        head_ranks = [rank] * num_heads
    return _head_factors(mat, num_heads, head_ranks, svds, dtype, bias)


def _inputs_matrix(fn: str, path: str, x, d_in: int) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim < 1 or a.shape[-1] != d_in:
        raise ValueError(
            f"{fn}: {path}: inputs must have shape [..., d_in={d_in}], got {tuple(a.shape)}"
        )
    a = a.reshape(-1, d_in)
    if a.shape[0] == 0:
        raise ValueError(f"{fn}: {path}: inputs are empty (shape {tuple(np.shape(x))})")
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        raise ValueError(f"{fn}: {path}: inputs have {bad} non-finite entries (NaN or inf)")
    return a


def _input_basis(x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(s, B)``: singular values of ``x [N, d_in]`` and its right singular vectors as columns."""
    _, s, Vt = np.linalg.svd(x2, full_matrices=False)
    return s, Vt.T


def project_inputs(w, x, *, rank: int | None = None, eps: float | None = None,
                   path: str = "w") -> LowRank:
    """Data-aware truncation: project ``W`` onto the leading subspace of its inputs.

    The construction in the proof of Theorem 3/5 (seed 000 App. D): with the inputs' SVD
    ``Xi = U_d S_d V_d^T`` the paper takes ``W~ = W U_d U_d^T``. In the Flax row orientation
    (``x: [N, d_in]``, ``y = x @ W``, ``W: [d_in, d_out]``) this is ``W~ = B_r B_r^T W`` with
    ``B_r [d_in, r]`` the leading right singular vectors of ``x``. If ``x`` has rank ``<= r``
    then ``x W~ = x W`` exactly, whatever the spectrum of ``W`` (the rows of ``x`` lie in the
    span of ``B_r``), which plain :func:`truncated_svd` cannot promise.

    Args:
      w: Dense / LowRank leaf (bias kept) or 2-D array ``[d_in, d_out]``.
      x: activations entering this weight, ``[..., d_in]`` (reshaped to ``[N, d_in]``).
      rank: number of input directions kept, an int in ``[1, min(d_in, d_out, N)]``; or
      eps: tolerance in (0, 1): keep ``rank_eps(x)`` directions (at least 1, at most
        ``min(d_in, d_out, N)``).
      path: the parameter path, used in error messages.

    Returns:
      ``LowRank(u=B_r, v=B_r^T W, b)``: ``u`` has orthonormal columns (it is the projection's
      basis, not a balanced split), cast to the weight's dtype.
    """
    fn = "project_inputs"
    _check_one_of(fn, path, eps, rank)
    mat, bias, dtype = _weight(fn, w, path)
    d_in, d_out = mat.shape
    x2 = _inputs_matrix(fn, path, x, d_in)
    max_rank = min(d_in, d_out, x2.shape[0])
    if eps is not None:
        eps = _check_eps(fn, path, eps)
    else:
        rank = _check_rank(fn, path, rank, max_rank,
                           f"weight shape {mat.shape}, {x2.shape[0]} input rows")
    s_x, B = _input_basis(x2)
    r = min(_eps_keep(s_x, eps), max_rank) if eps is not None else rank
    u = B[:, :r]
    return LowRank(u=jnp.asarray(u, dtype), v=jnp.asarray(u.T @ mat, dtype), b=bias)


def compare_truncations(w, x, ranks, *, path: str = "w") -> list[dict]:
    """Weight-space and output-space errors of SVD truncation vs. input projection, per rank.

    Everything is computed in float64 on the host from the exact factors (no cast to the weight
    dtype), and on the weight alone: a bias is the same on both sides and cancels.

    Args:
      w: Dense / LowRank leaf or 2-D array ``[d_in, d_out]``.
      x: inputs ``[..., d_in]``.
      ranks: iterable of ranks, each in ``[1, min(d_in, d_out, N)]``.
      path: the parameter path, used in error messages.

    Returns:
      One dict per rank with keys ``rank``; ``svd_weight_error`` and ``proj_weight_error``
      (``||W - W_r||_2 / ||W||_2``); ``svd_output_error`` and ``proj_output_error``
      (``||x W - x W_r||_F / ||x W||_F``). ``W_r`` is :func:`truncated_svd`'s product for
      ``svd_*`` and :func:`project_inputs`'s ``B_r B_r^T W`` for ``proj_*``. A zero denominator
      gives 0.0.
    """
    fn = "compare_truncations"
    mat, _, _ = _weight(fn, w, path)
    d_in, d_out = mat.shape
    x2 = _inputs_matrix(fn, path, x, d_in)
    max_rank = min(d_in, d_out, x2.shape[0])
    U, s, Vt = _svd(mat)
    _, B = _input_basis(x2)
    w_norm = s[0] if s.size else 0.0
    y = x2 @ mat
    y_norm = np.linalg.norm(y)

    def rel(num, den):
        return float(num / den) if den > 0 else 0.0

    rows = []
    for r in ranks:
        r = _check_rank(fn, path, r, max_rank, f"weight shape {mat.shape}, {x2.shape[0]} rows")
        w_svd = (U[:, :r] * s[:r]) @ Vt[:r]
        w_proj = B[:, :r] @ (B[:, :r].T @ mat)
        rows.append({
            "rank": r,
            "svd_weight_error": rel(np.linalg.norm(mat - w_svd, 2), w_norm),
            "proj_weight_error": rel(np.linalg.norm(mat - w_proj, 2), w_norm),
            "svd_output_error": rel(np.linalg.norm(y - x2 @ w_svd), y_norm),
            "proj_output_error": rel(np.linalg.norm(y - x2 @ w_proj), y_norm),
        })
    return rows
