"""Truncated SVD of one weight: per matrix, per head, and data-aware.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility" (sec. 5, eqs. 1, 19, 20, App. D). All decompositions run offline, on the host,
in float64 NumPy (accurate and deterministic) on :func:`lowrank_jax.materialize_host` of the
weight, so any leaf type whose arrays are all trainable can be truncated (a
:class:`~lowrank_jax.LowRank` or :class:`~lowrank_jax.HeadLowRank` is re-truncated from its
product); the factors are cast back to the weight's dtype at the end.

* :func:`truncated_svd` -- ``W ~ W_r``, the best rank-``r`` approximation (Eckart-Young); at
  tolerance ``eps`` it keeps ``rank_eps(W)`` singular values (eq. 1) and so guarantees
  ``||W - W_r||_2 <= eps ||W||_2``.
* :func:`head_truncated_svd` -- head-dependent sketching, one truncation per head (eq. 20).
* :func:`project_inputs` -- the construction in the proof of Theorem 3/5 (App. D): project the
  weight onto the leading singular subspace of its *inputs*, ``W~ = B_r B_r^T W``.
* :func:`compare_truncations` -- weight and output errors of both truncations side by side.

The small helpers below (:func:`weight_matrix`, :func:`svd64`, :func:`balanced_factors`, ...)
are public: the ``svd`` method and the sweeps build on them.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.analysis import eps_rank_from_sv
from lowrank_jax.errors import ConfigError, LeafTypeError, PlanError, ShapeError
from lowrank_jax.execution import reference_precision
from lowrank_jax.leaves import (
    HeadLowRank,
    LowRank,
    bias_of,
    head_offsets,
    is_leaf,
    is_uniform,
    leaf_dtype,
    materialize_host,
)

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Shared helpers.

def is_int(x) -> bool:
    """A Python or NumPy integer that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_eps(fn: str, path: str, eps) -> float:
    """``eps`` as a float in (0, 1), or a :class:`~lowrank_jax.errors.ConfigError` naming
    ``path``."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 < float(eps) < 1.0:
        raise ConfigError(f"{fn}: {path}: eps must be a number in (0, 1), got {eps!r}",
                          where=path, expected="(0, 1)", actual=eps)
    return float(eps)


def check_rank(fn: str, path: str, rank, max_rank: int, what: str) -> int:
    """``rank`` as an int in ``[1, max_rank]``, or a ConfigError naming ``path`` and ``what``
    limits it."""
    if not is_int(rank) or not 1 <= int(rank) <= max_rank:
        raise ConfigError(
            f"{fn}: {path}: rank must be an int in [1, {max_rank}] ({what}), got {rank!r}",
            where=path, expected=f"[1, {max_rank}]", actual=rank)
    return int(rank)


def _check_one_of(fn: str, path: str, eps, rank) -> None:
    if (eps is None) == (rank is None):
        raise ConfigError(
            f"{fn}: {path}: give exactly one of eps= or rank=, got eps={eps!r}, rank={rank!r}",
            where=path, expected="eps or rank", actual={"eps": eps, "rank": rank})


def normalized(sv: np.ndarray) -> np.ndarray:
    """``sigma_j / sigma_1`` (all zeros for a zero matrix)."""
    sv = np.asarray(sv, dtype=np.float64)
    if sv.size == 0 or sv[0] <= 0:
        return np.zeros_like(sv)
    return sv / sv[0]


def eps_keep(sv: np.ndarray, eps: float) -> int:
    """Rank kept at tolerance ``eps``: the eps-rank (eq. 1), at least 1 (a factor needs a
    column)."""
    return max(1, eps_rank_from_sv(sv, eps))


def truncatable(node: Any) -> bool:
    """Whether a node can be replaced by a truncated factorization: a weight leaf whose arrays
    are all trainable. Leaves with frozen parts (the binary signs and masks of
    :class:`~lowrank_jax.MaskedBinary` / :class:`~lowrank_jax.FrozenBinary`) are the product
    of another method; replacing them by float factors would silently discard it."""
    return is_leaf(node) and all(jax.tree_util.tree_leaves(node.trainable()))


def out_dtype(dtype) -> np.dtype:
    """The dtype factors are returned in (float64 becomes float32 unless x64 is enabled)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def weight_matrix(fn: str, w: Any, path: str) -> tuple[np.ndarray, Any, np.dtype]:
    """``(matrix float64 [d_in, d_out], bias or None, dtype)`` of a weight, validated.

    Args:
      fn: the calling function, for messages.
      w: a weight leaf (see :func:`truncatable`) or a 2-D array.
      path: parameter path, for messages.

    Raises:
      LeafTypeError: a leaf with frozen parts (binary leaves).
      ShapeError: an array that is not 2-D.
      PlanError: non-floating or non-finite weights.
    """
    if is_leaf(w):
        if not truncatable(w):
            raise LeafTypeError(
                f"{fn}: {path}: cannot truncate a {type(w).__name__} leaf: it has frozen "
                "arrays (binary signs or masks) that a float factorization would discard; "
                "materialize it first if that is what you want", where=path,
                expected="a leaf whose arrays are all trainable", actual=type(w).__name__)
        with reference_precision():  # float64 on the host; full precision on any backend
            mat = materialize_host(w)
        bias, dtype = bias_of(w), leaf_dtype(w)
    else:
        raw = np.asarray(w)
        if raw.ndim != 2:
            raise ShapeError(
                f"{fn}: {path}: weight must be 2-D [d_in, d_out], got shape {tuple(raw.shape)}",
                where=path, expected="[d_in, d_out]", actual=tuple(raw.shape))
        dtype = raw.dtype if jnp.issubdtype(raw.dtype, jnp.floating) else np.dtype(np.float32)
        mat, bias = raw.astype(np.float64), None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise PlanError(f"{fn}: {path}: weight must be floating point, got dtype {dtype}",
                        where=path, expected="floating point", actual=str(dtype))
    bad = int(np.size(mat) - np.count_nonzero(np.isfinite(mat)))
    if bad:
        raise PlanError(
            f"{fn}: {path}: weight has {bad} non-finite entries (NaN or inf) out of "
            f"{mat.size}; fix the checkpoint before compressing", where=path,
            expected="finite values", actual=f"{bad} non-finite")
    return mat, bias, out_dtype(dtype)


def svd64(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thin SVD in float64: ``mat = U diag(s) Vt``, ``s`` descending."""
    return np.linalg.svd(np.asarray(mat, np.float64), full_matrices=False)


def balanced_factors(U: np.ndarray, s: np.ndarray, Vt: np.ndarray,
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


def split_columns(mat: np.ndarray, widths: Sequence[int]) -> list[np.ndarray]:
    """The column blocks of ``mat`` of the given widths, head-major (any widths)."""
    off = head_offsets(tuple(int(w) for w in widths))
    if off[-1] != mat.shape[1]:
        raise ShapeError(f"split_columns: head widths {tuple(widths)} sum to {off[-1]}, but the "
                         f"matrix has {mat.shape[1]} columns", expected=mat.shape[1],
                         actual=int(off[-1]))
    return [mat[:, off[h]:off[h + 1]] for h in range(len(widths))]


def head_factors(d_in: int, svds: Sequence, head_ranks: Sequence[int], dtype,
                 bias) -> HeadLowRank:
    """A :class:`~lowrank_jax.HeadLowRank` from per-head SVDs ``(U, s, Vt)`` of equal-width
    heads, each truncated to its rank with balanced factors (zero-padded to the largest)."""
    d_h = svds[0][2].shape[1]
    h, r_max = len(svds), max(head_ranks)
    u = np.zeros((d_in, h, r_max))
    v = np.zeros((h, r_max, d_h))
    for i, ((U, s, Vt), r) in enumerate(zip(svds, head_ranks, strict=True)):
        u[:, i, :r], v[i, :r, :] = balanced_factors(U, s, Vt, r)
    ranks = None if all(r == r_max for r in head_ranks) else tuple(int(r) for r in head_ranks)
    return HeadLowRank(u=jnp.asarray(u, dtype), v=jnp.asarray(v, dtype), b=bias, ranks=ranks)


def uniform_head_widths(fn: str, path: str, d_out: int, heads) -> tuple[int, ...]:
    """Per-head widths from ``heads``: a number of heads (which must divide ``d_out``) or a
    sequence of widths, which must be equal (a :class:`~lowrank_jax.HeadLowRank` holds
    equal-width heads)."""
    if is_int(heads):
        if heads < 1 or d_out % heads:
            raise ShapeError(
                f"{fn}: {path}: num_heads must be a positive int that divides d_out={d_out}, "
                f"got {heads!r}", where=path, expected=f"a divisor of {d_out}", actual=heads)
        return (d_out // int(heads),) * int(heads)
    widths = tuple(int(w) for w in heads)
    if sum(widths) != d_out:
        raise ShapeError(f"{fn}: {path}: head widths {widths} sum to {sum(widths)}, but the "
                         f"weight has d_out={d_out}", where=path, expected=d_out,
                         actual=sum(widths))
    if not widths or not is_uniform(widths) or widths[0] < 1:
        raise PlanError(
            f"{fn}: {path}: per-head truncation needs heads of equal width (a HeadLowRank holds "
            f"[heads, rank, d_head] factors), got head widths {widths} (a pruned block). "
            "Truncate this weight with one shared sketch (per_head=False for it), or "
            "truncate before pruning channels.", where=path, expected="equal widths",
            actual=widths)
    return widths


def inputs_matrix(fn: str, path: str, x, d_in: int) -> np.ndarray:
    """Activations ``[..., d_in]`` as a validated float64 ``[N, d_in]`` matrix."""
    a = np.asarray(x, dtype=np.float64)
    if a.ndim < 1 or a.shape[-1] != d_in:
        raise ShapeError(
            f"{fn}: {path}: inputs must have shape [..., d_in={d_in}], got {tuple(a.shape)}",
            where=path, expected=f"[..., {d_in}]", actual=tuple(a.shape))
    a = a.reshape(-1, d_in)
    if a.shape[0] == 0:
        raise ShapeError(f"{fn}: {path}: inputs are empty (shape {tuple(np.shape(x))})",
                         where=path, expected="at least one row", actual=tuple(np.shape(x)))
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        raise PlanError(f"{fn}: {path}: inputs have {bad} non-finite entries (NaN or inf)",
                        where=path, expected="finite values", actual=f"{bad} non-finite")
    return a


def input_basis(x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(s, B)``: singular values of ``x [N, d_in]`` and its right singular vectors as
    columns."""
    _, s, Vt = np.linalg.svd(x2, full_matrices=False)
    return s, Vt.T


# ---------------------------------------------------------------------------------------------
# Public API.

def truncated_svd(w, *, eps: float | None = None, rank: int | None = None,
                  path: str = "w") -> LowRank:
    """Best low-rank approximation of a weight as a :class:`~lowrank_jax.LowRank` leaf.

    "Understanding Transformers for Time Series", sec. 5: with ``W = sum_j sigma_j u_j v_j^T``,
    keeping ``r = rank_eps(W)`` terms (eq. 1) guarantees ``||W - W_r||_2 <= eps ||W||_2``; in
    general ``||W - W_r||_2 = sigma_{r+1}``.

    The SVD runs on the host in float64; the factors are split in a balanced way,
    ``u = U_r sqrt(S_r)`` and ``v = sqrt(S_r) V_r^T`` (:func:`balanced_factors`), and cast back
    to the weight's dtype.

    Args:
      w: a weight leaf (its bias is kept; factorized leaves are re-truncated from their
        product) or a 2-D array ``[d_in, d_out]``.
      eps: tolerance in (0, 1): keep ``rank_eps(W)`` singular values (at least 1).
      rank: keep exactly ``rank`` singular values, an int in ``[1, min(d_in, d_out)]``.
        Give exactly one of ``eps`` and ``rank``.
      path: the parameter path, used in error messages.

    Returns:
      ``LowRank(u [d_in, r], v [r, d_out], b)``.

    Raises:
      ConfigError: both or neither of eps/rank; eps outside (0, 1); rank out of range.
      ShapeError: a weight that is not 2-D. PlanError: non-finite weights.
      LeafTypeError: a leaf with frozen parts (binary).
    """
    fn = "truncated_svd"
    _check_one_of(fn, path, eps, rank)
    mat, bias, dtype = weight_matrix(fn, w, path)
    d_in, d_out = mat.shape
    if eps is not None:
        eps = check_eps(fn, path, eps)
    else:
        rank = check_rank(fn, path, rank, min(d_in, d_out), f"weight shape {mat.shape}")
    U, s, Vt = svd64(mat)
    r = eps_keep(s, eps) if eps is not None else rank
    u, v = balanced_factors(U, s, Vt, r)
    return LowRank(u=jnp.asarray(u, dtype), v=jnp.asarray(v, dtype), b=bias)


def head_truncated_svd(w, heads, *, eps: float | None = None, rank: int | None = None,
                       path: str = "w") -> HeadLowRank:
    """Per-head truncated SVD with head-dependent sketches ("Understanding Transformers for
    Time Series", eq. 20).

    The output columns are split into heads, head-major (the layout of every attention
    projection in lowrank_jax). Each head is truncated on its own, so each gets its own input
    sketch ``u[:, i]`` (eq. 20), unlike a shared :func:`truncated_svd` of the whole matrix
    (eq. 19).

    With ``eps`` each head keeps its own eps-rank (relative to that head's ``sigma_1``), so
    ``||W_i - W_{i,r}||_2 <= eps ||W_i||_2`` for every head. Ranks then differ between heads:
    the factors are zero-padded to the largest and ``ranks=`` is set; the leaf masks the padding.

    Args:
      w: a weight leaf (bias kept) or a 2-D array ``[d_in, h * d_h]``.
      heads: the number of heads ``h`` (must divide ``d_out``), or the per-head widths (as
        :func:`lowrank_jax.nn.head_widths` returns them), which must be equal.
      eps: tolerance in (0, 1), per head; or
      rank: one rank for every head, an int in ``[1, min(d_in, d_h)]``.
      path: the parameter path, used in error messages.

    Returns:
      ``HeadLowRank(u [d_in, h, r_max], v [h, r_max, d_h], b, ranks)`` with balanced factors.

    Raises:
      PlanError: irregular head widths (a pruned block). ShapeError / ConfigError as
        :func:`truncated_svd`, and a head count that does not divide ``d_out``.
    """
    fn = "head_truncated_svd"
    _check_one_of(fn, path, eps, rank)
    mat, bias, dtype = weight_matrix(fn, w, path)
    widths = uniform_head_widths(fn, path, mat.shape[1], heads)
    blocks = split_columns(mat, widths)
    d_in, d_h = blocks[0].shape
    if eps is not None:
        eps = check_eps(fn, path, eps)
    else:
        rank = check_rank(fn, path, rank, min(d_in, d_h), f"per head: d_in={d_in}, d_head={d_h}")
    svds = [svd64(b) for b in blocks]
    if eps is not None:
        head_ranks = [eps_keep(s, eps) for _, s, _ in svds]
    else:
        head_ranks = [rank] * len(blocks)
    return head_factors(d_in, svds, head_ranks, dtype, bias)


def project_inputs(w, x, *, rank: int | None = None, eps: float | None = None,
                   path: str = "w") -> LowRank:
    """Data-aware truncation: project ``W`` onto the leading subspace of its inputs.

    The construction in the proof of Theorem 3/5 of "Understanding Transformers for Time
    Series" (App. D): with the inputs' SVD ``Xi = U_d S_d V_d^T`` the paper takes
    ``W~ = W U_d U_d^T``. In the Flax row orientation (``x: [N, d_in]``, ``y = x @ W``,
    ``W: [d_in, d_out]``) this is ``W~ = B_r B_r^T W`` with ``B_r [d_in, r]`` the leading right
    singular vectors of ``x``. If ``x`` has rank ``<= r`` then ``x W~ = x W`` exactly, whatever
    the spectrum of ``W`` (the rows of ``x`` lie in the span of ``B_r``), which plain
    :func:`truncated_svd` cannot promise.

    Args:
      w: a weight leaf (bias kept) or 2-D array ``[d_in, d_out]``.
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
    mat, bias, dtype = weight_matrix(fn, w, path)
    d_in, d_out = mat.shape
    x2 = inputs_matrix(fn, path, x, d_in)
    max_rank = min(d_in, d_out, x2.shape[0])
    if eps is not None:
        eps = check_eps(fn, path, eps)
    else:
        rank = check_rank(fn, path, rank, max_rank,
                          f"weight shape {mat.shape}, {x2.shape[0]} input rows")
    s_x, B = input_basis(x2)
    r = min(eps_keep(s_x, eps), max_rank) if eps is not None else rank
    u = B[:, :r]
    return LowRank(u=jnp.asarray(u, dtype), v=jnp.asarray(u.T @ mat, dtype), b=bias)


def compare_truncations(w, x, ranks, *, path: str = "w") -> list[dict]:
    """Weight-space and output-space errors of SVD truncation vs. input projection, per rank.

    Everything is computed in float64 on the host from the exact factors (no cast to the weight
    dtype), and on the weight alone: a bias is the same on both sides and cancels.

    Args:
      w: a weight leaf or 2-D array ``[d_in, d_out]``.
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
    mat, _, _ = weight_matrix(fn, w, path)
    d_in, d_out = mat.shape
    x2 = inputs_matrix(fn, path, x, d_in)
    max_rank = min(d_in, d_out, x2.shape[0])
    U, s, Vt = svd64(mat)
    _, B = input_basis(x2)
    w_norm = s[0] if s.size else 0.0
    y = x2 @ mat
    y_norm = np.linalg.norm(y)

    def rel(num, den):
        return float(num / den) if den > 0 else 0.0

    rows = []
    for r in ranks:
        r = check_rank(fn, path, r, max_rank, f"weight shape {mat.shape}, {x2.shape[0]} rows")
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


__all__ = [
    "balanced_factors", "check_eps", "check_rank", "compare_truncations", "eps_keep",
    "head_factors", "head_truncated_svd", "input_basis", "inputs_matrix", "is_int",
    "normalized", "out_dtype", "project_inputs", "split_columns", "svd64", "truncatable",
    "truncated_svd", "uniform_head_widths", "weight_matrix",
]
