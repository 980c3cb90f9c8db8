"""Block-term decomposition in rank-(L, L, 1) terms (BTD-(L,L,1)), by the Algorithms 1-3 of
"Vision Transformer with Irregular Attention".

A third-order tensor ``T: [I, J, K]`` is approximated by ``T`` terms, term ``t`` being a
rank-``L_t`` matrix times a vector (eqs. 5-6; De Lathauwer, "Decompositions of a higher-order
tensor in block terms", 2008)::

    T ~ sum_t (A_t B_t^T) o c_t,      A_t: [I, L_t],  B_t: [J, L_t],  c_t: [K]

In IrrAtt, ``T`` is the joint query-key tensor, ``K`` the heads, one term per head, and
``sum_t L_t = R`` is the total rank fixed by a FLOPs budget.

* :func:`btd_from_cp` is Algorithm 1: the columns of a CP model are assigned to the term of the
  largest entry of their (max-normalised) third-mode column, ``C`` is reset to the identity.
* :func:`fit_term` is Algorithm 2: one term fitted to a tensor by alternating a rank-``L``
  truncated SVD of ``T x_3 c`` with the best rank-1 approximation of
  ``T_(3) khatri-rao(A, B)``.
* :func:`btd_ll1` is Algorithm 3: sweeps over the terms, each refitted to the residual of the
  others with Algorithm 2.

What the paper leaves open, and what is done here:

* **Warm start.** Algorithm 2 as printed re-initialises ``c`` from the leading eigenvector of
  ``T_(3) T_(3)^T`` at every call; inside the sweeps of Algorithm 3 it starts from the term's
  current ``c`` instead. Each of its steps is then an exact least-squares minimiser over a set
  that contains the current term (the SVD step over all rank-``L`` matrices for fixed ``c``; the
  rank-1 step over ``c`` and the coefficients in the current singular bases), so the residual
  never increases from sweep to sweep (tested).
* **Stopping rule.** Sweeps stop when the relative error changes by less than ``tol`` between
  two sweeps (as ``cp_als``) or after ``n_iter_max`` sweeps; Algorithm 2 inside a sweep runs
  ``n_iter_term`` iterations (default 1: plain block-coordinate ALS).
* **Rank 0.** A term that receives no columns is exactly zero; nothing is divided by its norm,
  so no NaN appears. One term per frontal index means term ``t`` is the term of slice ``t``
  (Algorithm 1 assigns columns to the slice of their largest ``C`` entry, and ``C`` starts as
  the identity), and a rank-0 term is then a request that slice ``t`` be left out. Algorithm 3
  as printed does not keep it out: every sweep refits every term's ``c`` over all slices, so
  the other terms leak into slice ``t`` (in IrrAtt: the head of a rank-0 term, meant to attend
  uniformly, gets logits again). By default (``zero_empty=True``) row ``t`` of ``C`` is held
  at exactly zero for every term during the sweeps: the rank-1 step of Algorithm 2 becomes the
  least-squares fit of ``c`` with those entries zero (the best rank-1 approximation of
  ``T_(3) khatri-rao(A, B)`` with the held rows zeroed, still an exact minimiser, so the
  residual still never increases), and the rank-0 term's own ``c`` is zero. Slice ``t`` of the
  model is then exactly zero; in IrrAtt the head's logits are exactly zero and it attends
  exactly uniformly, as its rank says. ``zero_empty=False`` runs Algorithm 3 as printed.
* **More rank than fits.** Algorithm 1 can give a term more columns than a matrix of its size
  can use, or than the caller wants (IrrAtt: more than ``d_head``, while every slice of the
  query-key tensor has rank at most ``d_head``). With ``max_rank`` set, columns are assigned in
  order of decreasing norm ``||a_r|| ||b_r||`` to the largest entry of their column of ``C``
  among the terms that still have room; without a binding cap this is exactly Algorithm 1's
  assignment. A term never gets more than ``min(I, J)``.
* **CPD-EPC.** Algorithm 1 starts from CPD-EPC; here from :func:`~lowrank_jax.decomp.cp_als`
  followed by :func:`~lowrank_jax.decomp.cp_epc` (see its docstring for what it does and does
  not reproduce).

Ranks are arrays, so the whole pipeline (CP-ALS, Algorithm 1, Algorithm 3) is jit-compiled and
``jax.vmap`` maps it over a batch of tensors; the term factors are stored zero-padded to a
static ``max_rank`` (``a: [T, I, L]``, columns ``>= ranks[t]`` exactly zero). :func:`fit_term`,
:func:`btd_from_cp` and :func:`btd_ll1` run under
:func:`lowrank_jax.execution.reference_precision` (full float32 products on every backend).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.decomp.cp import cp_als, cp_epc, unfold
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.execution import at_reference_precision

Array = jax.Array


class BTDResult(NamedTuple):
    """A BTD-(L,L,1) model and how it was fitted (a pytree; batched under ``jax.vmap``).

    Fields:
      a: ``[T, I, L]`` term factors ``A_t``, zero beyond column ``ranks[t]``.
      b: ``[T, J, L]`` term factors ``B_t``, zero beyond column ``ranks[t]``.
      c: ``[K, T]`` third-mode vectors ``c_t`` (unit norm after a fit, zero for a rank-0 term
        under ``zero_empty``; the identity after :func:`btd_from_cp`).
      ranks: ``[T]`` int32 ranks ``L_t``.
      errors: ``[n_iter_max]`` relative errors after each sweep, ``NaN`` after the last
        (empty for an initialisation).
      n_iter: number of sweeps run.
    """

    a: Array
    b: Array
    c: Array
    ranks: Array
    errors: Array
    n_iter: Array


def btd_to_tensor(a: Array, b: Array, c: Array) -> Array:
    """The full tensor ``sum_t (A_t B_t^T) o c_t`` (eq. 6 with a general ``C``).

    Args:
      a: ``[T, I, L]``; b: ``[T, J, L]`` (zero-padded columns contribute nothing); c: ``[K, T]``.

    Returns:
      ``[I, J, K]``.
    """
    return jnp.einsum("til,tjl,kt->ijk", a, b, c)


def _rank_mask(rank, lmax: int, dtype):
    return (jnp.arange(lmax) < rank).astype(dtype)


def _leading_eigvec(x):
    x3 = unfold(x, 2)  # [K, I*J]
    _, vecs = jnp.linalg.eigh(x3 @ x3.T)
    return vecs[:, -1]


def _fix_sign(c, w):
    s = jnp.sign(c[jnp.argmax(jnp.abs(c))])
    s = jnp.where(s == 0, 1.0, s).astype(c.dtype)
    return c * s, w * s


def _term_step(x, rank, c, lmax: int, rows=None):
    """One iteration of Algorithm 2 on ``x`` from ``c`` (unit). Returns ``(u, v, c, w)``: the
    term is ``(u diag(w) v^T) o c`` with orthonormal ``u``, ``v`` (masked beyond ``rank``).

    ``rows`` (``[K]`` of 0/1, or ``None``): entries of ``c`` held at zero where it is 0 (``c``
    must already be zero there). The rank-1 step is then the exact least-squares minimiser over
    the ``c`` with those zeros: ``||T - c w^T||^2`` splits into the held rows of ``T``, which no
    ``c`` changes, and the free ones, whose best rank-1 approximation is taken."""
    mask = _rank_mask(rank, lmax, x.dtype)
    m = jnp.einsum("ijk,k->ij", x, c)
    u, _, vt = jnp.linalg.svd(m, full_matrices=False)
    u = u[:, :lmax] * mask[None, :]
    v = vt[:lmax].T * mask[None, :]
    z = jnp.einsum("ijk,il->jkl", x, u)
    t = jnp.einsum("jkl,jl->kl", z, v)  # [K, L]: T = X_(3) khatri-rao(A, B)
    if rows is not None:
        t = t * rows[:, None]
    uu, ss, vvt = jnp.linalg.svd(t, full_matrices=False)
    live = ss[0] > 0
    c1 = uu[:, 0]
    if rows is not None:  # exact zeros where held (the SVD may leave rounding there)
        c1 = c1 * rows
        c1 = c1 / jnp.where(live, jnp.linalg.norm(c1), 1.0)
    c_new = jnp.where(live, c1, c)
    w = jnp.where(live, ss[0] * vvt[0], jnp.zeros_like(vvt[0]))
    c_new, w = _fix_sign(c_new, w)
    return u, v, c_new, w * mask


def _fit_term_loop(x, rank, c, lmax: int, n_iter: int, tol, rows=None):
    norm2 = jnp.sum(x * x)
    errors0 = jnp.full((n_iter,), jnp.nan, x.dtype)
    u0 = jnp.zeros((x.shape[0], lmax), x.dtype)
    v0 = jnp.zeros((x.shape[1], lmax), x.dtype)
    w0 = jnp.zeros((lmax,), x.dtype)

    def cond(s):
        it, _, _, _, _, _, done = s
        return jnp.logical_and(it < n_iter, jnp.logical_not(done))

    def body(s):
        it, _, _, c, _, errors, _ = s
        u, v, c, w = _term_step(x, rank, c, lmax, rows)
        # the explicit residual (||X||^2 - ||w||^2 would cancel at small errors)
        fit = jnp.einsum("il,jl,k->ijk", u * w[None, :], v, c)
        err = jnp.linalg.norm((x - fit).ravel()) / jnp.sqrt(jnp.maximum(norm2, 1e-300))
        errors = errors.at[it].set(err)
        prev = errors[jnp.maximum(it - 1, 0)]
        done = jnp.logical_and(it >= 1, jnp.abs(prev - err) < tol)
        return it + 1, u, v, c, w, errors, done

    it, u, v, c, w, errors, _ = jax.lax.while_loop(
        cond, body, (jnp.asarray(0, jnp.int32), u0, v0, c, w0, errors0, jnp.asarray(False)))
    return u * w[None, :], v, c, errors, it


@functools.partial(jax.jit, static_argnames=("lmax", "n_iter_max"))
def _fit_term(x, rank, c, tol, *, lmax, n_iter_max):
    c = _leading_eigvec(x) if c is None else c / jnp.linalg.norm(c)
    return _fit_term_loop(x, rank, c, lmax, n_iter_max, tol)


@at_reference_precision
def fit_term(tensor: Array, rank: int, *, c: Array | None = None, n_iter_max: int = 10,
             tol: float = 1e-8) -> BTDResult:
    """Algorithm 2 of "Vision Transformer with Irregular Attention": fit one rank-(L, L, 1)
    term ``(A B^T) o c`` to a tensor.

    ``c`` starts as the leading eigenvector of ``T_(3) T_(3)^T`` (as printed) or from the given
    vector; then each iteration takes the rank-``L`` truncated SVD ``T x_3 c ~ U S V^T`` and the
    best rank-1 approximation ``s c d^T`` of ``T_(3) khatri-rao(U, V)``, and the term is
    ``(U diag(s d) V^T) o c``. A tensor that is exactly one such term is fitted in one
    iteration. Iterations stop when the relative error changes by less than ``tol``.

    Args:
      tensor: ``[I, J, K]``.
      rank: ``L`` (an int ``>= 0``).
      c: optional starting ``c`` ``[K]`` (normalised).
      n_iter_max: maximum number of iterations.
      tol: stopping tolerance on the change of the relative error.

    Returns:
      A :class:`BTDResult` with one term (``a: [1, I, L]``, ``c: [K, 1]``) and the error of
      every iteration.
    """
    tensor = _check3(tensor, "fit_term")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
        raise ConfigError(f"fit_term: rank must be an int >= 0, got {rank!r}", where="rank",
                          expected="int >= 0", actual=rank)
    lmax = max(1, min(int(rank), tensor.shape[0], tensor.shape[1]))
    c = None if c is None else jnp.asarray(c, tensor.dtype)
    a, b, c, errors, it = _fit_term(tensor, jnp.asarray(rank, jnp.int32), c,
                                    jnp.asarray(tol, tensor.dtype), lmax=lmax,
                                    n_iter_max=int(n_iter_max))
    return BTDResult(a[None], b[None], c[:, None], jnp.asarray([min(rank, lmax)], jnp.int32),
                     errors, it)


def _check3(tensor, who: str) -> Array:
    tensor = jnp.asarray(tensor)
    if tensor.ndim != 3:
        raise ShapeError(f"{who}: expected a third-order tensor [I, J, K], got shape "
                         f"{tuple(tensor.shape)}", where="tensor", expected="[I, J, K]",
                         actual=tuple(tensor.shape))
    if not jnp.issubdtype(tensor.dtype, jnp.floating):
        tensor = tensor.astype(jnp.float32)
    return tensor


# ---------------------------------------------------------------------------------------------
# Algorithm 1.

@functools.partial(jax.jit, static_argnames=("n_terms", "lmax"))
def _btd_from_cp(weights, fa, fb, fc, *, n_terms, lmax):
    dtype = fa.dtype
    fa = fa * weights[None, :]
    head = jnp.argmax(jnp.abs(fc), axis=0)  # [R]
    cmax = fc[head, jnp.arange(fc.shape[1])]  # signed largest entry of every column
    safe = jnp.where(cmax == 0, 1.0, cmax)
    fa = fa * safe[None, :]
    cn = jnp.abs(fc / safe[None, :])  # [K, R], max 1 per column
    strength = jnp.linalg.norm(fa, axis=0) * jnp.linalg.norm(fb, axis=0)
    order = jnp.argsort(-strength)
    a0 = jnp.zeros((n_terms, fa.shape[0], lmax), dtype)
    b0 = jnp.zeros((n_terms, fb.shape[0], lmax), dtype)

    def place(i, s):
        a, b, counts = s
        r = order[i]
        room = counts < lmax
        score = jnp.where(room, cn[:, r], -1.0)
        t = jnp.argmax(score)
        pos = counts[t]
        a = a.at[t, :, pos].set(fa[:, r])
        b = b.at[t, :, pos].set(fb[:, r])
        return a, b, counts.at[t].add(1)

    a, b, counts = jax.lax.fori_loop(0, fa.shape[1], place,
                                     (a0, b0, jnp.zeros((n_terms,), jnp.int32)))
    return a, b, jnp.eye(fc.shape[0], n_terms, dtype=dtype), counts


@at_reference_precision
def btd_from_cp(weights: Array | None, factors: Sequence[Array], *,
                max_rank: int | None = None) -> BTDResult:
    """Algorithm 1 of "Vision Transformer with Irregular Attention": BTD-(L,L,1) terms and
    ranks from a CP model.

    Every column ``r`` of the third factor ``C`` is divided by its signed largest entry (the
    scale goes into ``A``), the column is assigned to the term (head) ``argmax_h |C(h, r)|``,
    ``A_t``/``B_t`` are the columns assigned to term ``t`` (``L_t`` of them), and ``C`` is reset
    to the identity: the off-block entries of the fusion matrix are dropped (eq. 5). One term
    per index of the third mode.

    Args:
      weights: ``[R]`` or ``None``.
      factors: ``(A [I, R], B [J, R], C [K, R])``.
      max_rank: optional cap on any term's rank (see the module docstring for how columns are
        then assigned); a term never gets more than ``min(I, J)``.

    Returns:
      A :class:`BTDResult` with ``c`` the identity and empty ``errors``.

    Raises:
      ConfigError: ``R`` columns do not fit in ``K`` terms of at most ``max_rank`` each.
    """
    if len(factors) != 3:
        raise ShapeError(f"btd_from_cp: expected 3 factors (A, B, C), got {len(factors)}",
                         where="factors", expected=3, actual=len(factors))
    fa, fb, fc = (jnp.asarray(f) for f in factors)
    rank, k = fa.shape[1], fc.shape[0]
    lmax = _lmax(rank, fa.shape[0], fb.shape[0], max_rank)
    if rank > k * lmax:
        raise ConfigError(f"btd_from_cp: {rank} columns do not fit in {k} terms of rank at most "
                          f"{lmax}", where="max_rank", expected=f">= {-(-rank // k)}",
                          actual=max_rank)
    weights = jnp.ones((rank,), fa.dtype) if weights is None else jnp.asarray(weights, fa.dtype)
    a, b, c, ranks = _btd_from_cp(weights, fa, fb.astype(fa.dtype), fc.astype(fa.dtype),
                                  n_terms=k, lmax=lmax)
    return BTDResult(a, b, c, ranks, jnp.zeros((0,), fa.dtype), jnp.asarray(0, jnp.int32))


def _lmax(rank: int, i: int, j: int, max_rank: int | None) -> int:
    cap = min(rank, i, j)
    if max_rank is not None:
        if isinstance(max_rank, bool) or not isinstance(max_rank, (int, np.integer)) or max_rank < 1:
            raise ConfigError(f"max_rank must be an int >= 1, got {max_rank!r}", where="max_rank",
                              expected="int >= 1", actual=max_rank)
        cap = min(cap, int(max_rank))
    return max(cap, 1)


# ---------------------------------------------------------------------------------------------
# Algorithm 3.

@functools.partial(jax.jit, static_argnames=("n_iter_max", "n_iter_term", "zero_empty"))
def _btd_als(x, a, b, c, ranks, tol, *, n_iter_max, n_iter_term, zero_empty):
    dtype = x.dtype
    n_terms, _, lmax = a.shape
    norm = jnp.sqrt(jnp.sum(x * x))
    rows = None
    if zero_empty:
        # frontal index t belongs to term t: where that term is empty, row t of C stays zero
        rows = (ranks > 0).astype(dtype)
        c = c * rows[:, None]
        # a term whose start lies wholly in held rows restarts from its own index
        dead = jnp.linalg.norm(c, axis=0) == 0
        c = jnp.where(dead[None, :], jnp.eye(c.shape[0], n_terms, dtype=dtype) * rows[:, None], c)
    cn = jnp.linalg.norm(c, axis=0)
    cn = jnp.where(cn > 0, cn, 1.0)
    c = c / cn[None, :]
    a = a * cn[:, None, None]  # the same model, with unit c
    errors0 = jnp.full((n_iter_max,), jnp.nan, dtype)

    def term(t, s):
        a, b, c, rec = s
        old = jnp.einsum("il,jl,k->ijk", a[t], b[t], c[:, t])
        resid = x - rec + old
        at, bt, ct, _, _ = _fit_term_loop(resid, ranks[t], c[:, t], lmax, n_iter_term,
                                          jnp.asarray(0.0, dtype), rows)
        new = jnp.einsum("il,jl,k->ijk", at, bt, ct)
        return a.at[t].set(at), b.at[t].set(bt), c.at[:, t].set(ct), rec - old + new

    def cond(s):
        it, _, _, _, _, done = s
        return jnp.logical_and(it < n_iter_max, jnp.logical_not(done))

    def body(s):
        it, a, b, c, errors, _ = s
        rec = btd_to_tensor(a, b, c)
        a, b, c, _ = jax.lax.fori_loop(0, n_terms, term, (a, b, c, rec))
        err = jnp.linalg.norm((x - btd_to_tensor(a, b, c)).ravel()) / norm
        errors = errors.at[it].set(err)
        prev = errors[jnp.maximum(it - 1, 0)]
        done = jnp.logical_or(jnp.logical_and(it >= 1, jnp.abs(prev - err) < tol),
                              jnp.logical_not(jnp.isfinite(err)))
        return it + 1, a, b, c, errors, done

    it, a, b, c, errors, _ = jax.lax.while_loop(
        cond, body, (jnp.asarray(0, jnp.int32), a, b, c, errors0, jnp.asarray(False)))
    return BTDResult(a, b, c, ranks, errors, it)


@functools.partial(jax.jit, static_argnames=("lmax",))
def _btd_from_slices(x, ranks, *, lmax):
    def one(t):
        u, s, vt = jnp.linalg.svd(x[:, :, t], full_matrices=False)
        mask = _rank_mask(ranks[t], lmax, x.dtype)
        return (u[:, :lmax] * (s[:lmax] * mask)[None, :], vt[:lmax].T * mask[None, :])

    a, b = jax.vmap(one)(jnp.arange(x.shape[2]))
    return a, b, jnp.eye(x.shape[2], dtype=x.dtype)


@at_reference_precision
def btd_ll1(tensor: Array, rank: int | None = None, *, init="cp", ranks=None,
            max_rank: int | None = None, n_iter_max: int = 100, tol: float = 1e-8,
            n_iter_term: int = 1, cp_n_iter_max: int = 100, cp_tol: float = 1e-8,
            epc: bool = True, key: Array | None = None, zero_empty: bool = True) -> BTDResult:
    """BTD-(L,L,1) decomposition with one term per frontal index (Algorithm 3 of "Vision
    Transformer with Irregular Attention", initialised by Algorithm 1 or from the slices).

    Args:
      tensor: ``[I, J, K]``.
      rank: total rank ``R = sum_t L_t`` (``init='cp'``).
      init: ``'cp'`` (Algorithm 1 on :func:`~lowrank_jax.decomp.cp_als` at rank ``R`` with SVD
        initialisation, followed by :func:`~lowrank_jax.decomp.cp_epc` if ``epc``);
        ``'slices'`` (term ``t`` = rank-``ranks[t]`` truncated SVD of slice ``T[:, :, t]``,
        ``C = I``: TruncAtt with irregular ranks, the fixed point of the sweeps when the tensor's
        slices share nothing); or a :class:`BTDResult` to continue from.
      ranks: per-term ranks for ``init='slices'`` (``K`` ints).
      max_rank: cap on any term's rank (``init='cp'``; module docstring). Also the width the
        factors are padded to.
      n_iter_max: maximum number of sweeps of Algorithm 3.
      tol: stop when the relative error changes by less than ``tol`` between sweeps.
      n_iter_term: iterations of Algorithm 2 per term and sweep (warm-started).
      cp_n_iter_max, cp_tol: CP-ALS limits for ``init='cp'``.
      epc: run the error-preserving correction after CP-ALS.
      key: PRNG key for CP-ALS's random initial columns (the third mode is shorter than ``R``).
      zero_empty: hold frontal slice ``t`` at zero when term ``t`` has rank 0: row ``t`` of
        ``C`` stays exactly zero in every term during the sweeps (module docstring, "Rank 0").
        ``False``: Algorithm 3 as printed, where the other terms may fit that slice.

    Returns:
      A :class:`BTDResult` (errors of the sweeps).
    """
    x = _check3(tensor, "btd_ll1")
    i, j, k = x.shape
    if isinstance(init, BTDResult):
        start = init
    elif init == "cp":
        if rank is None or isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
                or rank < 1:
            raise ConfigError(f"btd_ll1: init='cp' needs the total rank (an int >= 1), got "
                              f"{rank!r}", where="rank", expected="int >= 1", actual=rank)
        cp = cp_als(x, int(rank), init="svd", n_iter_max=cp_n_iter_max, tol=cp_tol, key=key)
        weights, factors = cp.weights, cp.factors
        if epc:
            e = cp_epc(x, weights, factors)
            weights, factors = e.weights, e.factors
        start = btd_from_cp(weights, factors, max_rank=max_rank)
    elif init == "slices":
        if ranks is None or len(ranks) != k:
            raise ConfigError(f"btd_ll1: init='slices' needs ranks, one per slice ({k}), got "
                              f"{ranks!r}", where="ranks", expected=f"{k} ints", actual=ranks)
        r = [int(v) for v in ranks]
        if any(v < 0 for v in r):
            raise ConfigError(f"btd_ll1: ranks must be >= 0, got {r}", where="ranks",
                              expected=">= 0", actual=r)
        lmax = max(1, min(max(r), i, j))
        rk = jnp.minimum(jnp.asarray(r, jnp.int32), lmax)
        a, b, c = _btd_from_slices(x, rk, lmax=lmax)
        start = BTDResult(a, b, c, rk, jnp.zeros((0,), x.dtype), jnp.asarray(0, jnp.int32))
    else:
        raise ConfigError(f"btd_ll1: init must be 'cp', 'slices' or a BTDResult, got {init!r}",
                          where="init", expected=("cp", "slices", "BTDResult"), actual=init)
    if not isinstance(zero_empty, bool):
        raise ConfigError(f"btd_ll1: zero_empty must be a bool, got {zero_empty!r}",
                          where="zero_empty", expected="bool", actual=zero_empty)
    n_terms = start.a.shape[-3]
    if zero_empty and n_terms != k:
        raise ConfigError(f"btd_ll1: zero_empty pairs term t with frontal slice t, but the start "
                          f"has {n_terms} terms for {k} slices; pass zero_empty=False",
                          where="zero_empty", expected=f"{k} terms", actual=n_terms)
    return _btd_als(x, start.a.astype(x.dtype), start.b.astype(x.dtype), start.c.astype(x.dtype),
                    jnp.asarray(start.ranks, jnp.int32), jnp.asarray(tol, x.dtype),
                    n_iter_max=int(n_iter_max), n_iter_term=int(n_iter_term),
                    zero_empty=zero_empty)


__all__ = ["BTDResult", "btd_from_cp", "btd_ll1", "btd_to_tensor", "fit_term"]
