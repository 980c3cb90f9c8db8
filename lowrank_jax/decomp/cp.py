"""CP decomposition by alternating least squares, with line search, Tikhonov regularisation and
an error-preserving correction.

The canonical polyadic (CP) model of an order-``N`` tensor is a sum of ``R`` rank-1 terms
("Vision Transformer with Irregular Attention", App. A.2.1):
``T ~ sum_r weights[r] * f_0[:, r] o f_1[:, r] o ... o f_{N-1}[:, r]``.

:func:`cp_als` follows tensorly's ``parafac`` (normal-equation ALS: for every mode, the
Hadamard product of the other factors' Gram matrices and the MTTKRP, then a linear solve) with
the same defaults (``n_iter_max=100``, ``tol=1e-8`` on the change of the relative error, SVD
initialisation padded with uniform random columns where a mode is shorter than the rank), so
users recognise it, but it is one jit-compiled ``lax.while_loop`` that ``jax.vmap`` maps over a
batch of tensors. Differences from tensorly, on purpose:

* For order 3 the MTTKRPs of modes 1 and 2 share the contraction of the tensor with the first
  factor, so a sweep costs two ``I J K R`` contractions instead of three.
* Every iteration the columns of the factors are rescaled to equal norms (the model is
  unchanged; unregularised ALS is invariant to it, and it keeps diverging components from
  overflowing).
* The relative error is computed with tensorly's identity
  ``||T - T^||^2 = ||T||^2 - 2 <T, T^> + ||T^||^2`` while it is above 3 %, and from the
  explicit residual below that, where the identity cancels catastrophically in float32.
* Line search (``linesearch=True``) extrapolates as tensorly does (Bro's jump of
  ``iteration ** (1 / acc_pow)`` every other iteration after the fifth) but keeps the better of
  the extrapolated and the plain ALS factors and always records the error.
* The error history is an array of ``n_iter_max`` entries, ``NaN`` after the last iteration.

:func:`cp_epc` is what replaces the CPD-EPC of the paper (sec. 3.2; Phan et al., "Stable
low-rank tensor decomposition for compression of convolutional neural network", ECCV 2020,
built on the error-preserving correction of Phan, Tichavsky and Cichocki, arXiv:1709.08349):
given a CP approximation with error ``delta``, it minimises the sum of squared factor norms
subject to ``||T - T^||_F <= delta``, one factor at a time. Each factor update is a
quadratically constrained least-norm problem solved exactly (eigendecomposition of the Gram
Hadamard product and a bisection on the Lagrange multiplier), so the objective never increases
and the error never exceeds ``delta``; after each sweep the rank-1 terms are rebalanced. This is
our formulation of "keep the error, shrink diverging and cancelling terms"; it is not a port of
the authors' code (which is not public).

All functions work in the dtype of the tensor (float32 by default; float64 under
``jax.enable_x64``). :func:`init_cp`, :func:`cp_als` and :func:`cp_epc` run under
:func:`lowrank_jax.execution.reference_precision`: their products are full float32 on every
backend (a GPU's default TF32 would stall the fit near 1e-3).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.execution import at_reference_precision

Array = jax.Array

_LETTERS = "abcdefghijklmnopqrstuvwxy"  # 'z' is the rank index


class CPResult(NamedTuple):
    """Result of :func:`cp_als` and :func:`cp_epc` (a pytree; batched under ``jax.vmap``).

    Fields:
      weights: ``[R]`` (ones unless ``normalize_factors``).
      factors: one ``[I_n, R]`` matrix per mode.
      errors: ``[n_iter_max]`` relative errors ``||T - T^||_F / ||T||_F`` after each
        iteration, ``NaN`` after the last one.
      n_iter: number of iterations run.
    """

    weights: Array
    factors: tuple
    errors: Array
    n_iter: Array


def _check_tensor(tensor, who: str) -> Array:
    tensor = jnp.asarray(tensor)
    if tensor.ndim < 2:
        raise ShapeError(f"{who}: tensor must have at least 2 modes, got shape {tuple(tensor.shape)}",
                         where="tensor", expected="ndim >= 2", actual=tuple(tensor.shape))
    if not jnp.issubdtype(tensor.dtype, jnp.floating):
        tensor = tensor.astype(jnp.float32)
    return tensor


def _check_rank(rank, who: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ConfigError(f"{who}: rank must be an int >= 1, got {rank!r}", where="rank",
                          expected="int >= 1", actual=rank)
    return int(rank)


def _check_factors(factors, shape, rank: int | None, who: str) -> list[Array]:
    factors = [jnp.asarray(f) for f in factors]
    if len(factors) != len(shape):
        raise ShapeError(f"{who}: expected {len(shape)} factors (one per mode), got {len(factors)}",
                         where="factors", expected=len(shape), actual=len(factors))
    r = rank if rank is not None else factors[0].shape[-1]
    for n, (f, dim) in enumerate(zip(factors, shape, strict=True)):
        if f.ndim != 2 or f.shape != (dim, r):
            raise ShapeError(f"{who}: factor {n} must have shape ({dim}, {r}), got "
                             f"{tuple(f.shape)}", where=f"factors[{n}]", expected=(dim, r),
                             actual=tuple(f.shape))
    return factors


def cp_to_tensor(weights: Array | None, factors: Sequence[Array]) -> Array:
    """The full tensor of a CP model (tensorly's ``cp_to_tensor``).

    Args:
      weights: ``[R]`` or ``None`` (ones).
      factors: ``[I_n, R]`` per mode.

    Returns:
      ``[I_0, ..., I_{N-1}]``: ``sum_r weights[r] f_0[:, r] o ... o f_{N-1}[:, r]``.
    """
    n = len(factors)
    ops = list(factors)
    spec = ",".join(f"{_LETTERS[i]}z" for i in range(n))
    if weights is not None:
        ops.append(jnp.asarray(weights))
        spec += ",z"
    return jnp.einsum(f"{spec}->{_LETTERS[:n]}", *ops)


def unfold(tensor: Array, mode: int) -> Array:
    """Mode-``mode`` unfolding ``[I_mode, prod(other dims)]`` (tensorly's ordering)."""
    return jnp.moveaxis(tensor, mode, 0).reshape(tensor.shape[mode], -1)


def mttkrp(tensor: Array, factors: Sequence[Array], mode: int) -> Array:
    """Matricized tensor times Khatri-Rao product: ``unfold(T, mode) @ KR(other factors)``.

    The contraction runs with the largest remaining mode first, so no Khatri-Rao product and
    no intermediate larger than the tensor is formed.

    Args:
      tensor: ``[I_0, ..., I_{N-1}]``.
      factors: ``[I_n, R]`` per mode (``factors[mode]`` is not used).
      mode: the mode left free.

    Returns:
      ``[I_mode, R]``: ``M[i, r] = sum T[..., i, ...] prod_{n != mode} f_n[i_n, r]``.
    """
    n = tensor.ndim
    idx = list(_LETTERS[:n])
    others = sorted((m for m in range(n) if m != mode), key=lambda m: -tensor.shape[m])
    # first contraction: the tensor with the largest other mode's factor
    m0 = others[0]
    out_idx = [c for c in idx if c != idx[m0]] + ["z"]
    acc = jnp.einsum(f"{''.join(idx)},{idx[m0]}z->{''.join(out_idx)}", tensor, factors[m0])
    cur = out_idx
    for m in others[1:]:
        nxt = [c for c in cur if c != idx[m]]
        acc = jnp.einsum(f"{''.join(cur)},{idx[m]}z->{''.join(nxt)}", acc, factors[m])
        cur = nxt
    return acc  # [I_mode, R]


def _gram_hadamard(factors, skip: int, rank: int, dtype) -> Array:
    v = jnp.ones((rank, rank), dtype)
    for i, f in enumerate(factors):
        if i != skip:
            v = v * (f.T @ f)
    return v


def _balance(factors: list[Array]) -> list[Array]:
    """Rescale columns so every factor's column ``r`` has the same norm (model unchanged)."""
    norms = [jnp.linalg.norm(f, axis=0) for f in factors]
    ok = jnp.all(jnp.stack([nm > 0 for nm in norms]), axis=0)
    logs = jnp.stack([jnp.log(jnp.where(ok, nm, 1.0)) for nm in norms])  # [N, R]
    target = jnp.mean(logs, axis=0)
    return [f * jnp.where(ok, jnp.exp(target - lg), 1.0)[None, :] for f, lg in zip(factors, logs,
                                                                                    strict=True)]


def _explicit_error(tensor, factors, norm) -> Array:
    return jnp.linalg.norm((tensor - cp_to_tensor(None, factors)).ravel()) / norm


def _rel_error(tensor, norm2, factors, m_last, rank) -> Array:
    """Relative error from the identity when it is safe, from the residual otherwise."""
    n = len(factors)
    v = _gram_hadamard(factors, n - 1, rank, tensor.dtype)
    rec2 = jnp.sum(v * (factors[-1].T @ factors[-1]))
    iprod = jnp.sum(m_last * factors[-1])
    res2 = jnp.abs(norm2 + rec2 - 2.0 * iprod)
    norm = jnp.sqrt(norm2)
    return jax.lax.cond(res2 > 9e-4 * norm2, lambda: jnp.sqrt(res2) / norm,
                        lambda: _explicit_error(tensor, factors, norm))


def _als_sweep(tensor, factors: list[Array], l2_reg, rank: int):
    """One ALS sweep over all modes; returns the factors and the last mode's MTTKRP."""
    n = tensor.ndim
    eye = jnp.eye(rank, dtype=tensor.dtype)
    factors = list(factors)
    shared = None
    for mode in range(n):
        v = _gram_hadamard(factors, mode, rank, tensor.dtype) + l2_reg * eye
        if n == 3 and mode >= 1:
            if shared is None:  # T x_0 A with the updated A, shared by modes 1 and 2
                shared = jnp.einsum("ijk,iz->jkz", tensor, factors[0])
            m = (jnp.einsum("jkz,kz->jz", shared, factors[2]) if mode == 1
                 else jnp.einsum("jkz,jz->kz", shared, factors[1]))
        else:
            m = mttkrp(tensor, factors, mode)
        factors[mode] = jnp.linalg.solve(v.T, m.T).T
    return factors, m


@functools.partial(jax.jit, static_argnames=("rank", "n_iter_max", "linesearch",
                                             "normalize_factors"))
def _cp_als(tensor, factors, tol, l2_reg, *, rank, n_iter_max, linesearch, normalize_factors):
    dtype = tensor.dtype
    norm2 = jnp.sum(tensor * tensor)
    norm = jnp.sqrt(norm2)
    factors = _balance(list(factors))
    errors0 = jnp.full((n_iter_max,), jnp.nan, dtype)

    def cond(c):
        it, _, _, done, _, _ = c
        return jnp.logical_and(it < n_iter_max, jnp.logical_not(done))

    def body(c):
        it, facs, errors, _, acc_pow, acc_fail = c
        facs = list(facs)
        new, m_last = _als_sweep(tensor, facs, l2_reg, rank)
        err = _rel_error(tensor, norm2, new, m_last, rank)
        if linesearch:
            active = jnp.logical_and(it % 2 == 0, it > 5)

            def try_jump(args):
                new, err = args
                jump = jnp.power(it.astype(dtype), 1.0 / acc_pow)
                ls = [f0 + (f1 - f0) * jump for f0, f1 in zip(facs, new, strict=True)]
                err_ls = _rel_error(tensor, norm2, ls, mttkrp(tensor, ls, tensor.ndim - 1), rank)
                take = err_ls < err
                return ([jnp.where(take, a, b) for a, b in zip(ls, new, strict=True)],
                        jnp.where(take, err_ls, err), take)

            new, err, take = jax.lax.cond(active, try_jump,
                                          lambda a: (list(a[0]), a[1], jnp.asarray(False)),
                                          (new, err))
            failed = jnp.logical_and(active, jnp.logical_not(take))
            acc_fail = jnp.where(take, 0, acc_fail + failed.astype(jnp.int32))
            slow = acc_fail >= 4
            acc_pow = jnp.where(slow, acc_pow + 1.0, acc_pow)
            acc_fail = jnp.where(slow, 0, acc_fail)
        new = _balance(new)
        errors = errors.at[it].set(err)
        prev = errors[jnp.maximum(it - 1, 0)]
        done = jnp.logical_or(jnp.logical_and(it >= 1, jnp.abs(prev - err) < tol),
                              jnp.logical_not(jnp.isfinite(err)))
        return it + 1, tuple(new), errors, done, acc_pow, acc_fail

    init = (jnp.asarray(0, jnp.int32), tuple(factors), errors0, jnp.asarray(False),
            jnp.asarray(2.0, dtype), jnp.asarray(0, jnp.int32))
    it, factors, errors, _, _, _ = jax.lax.while_loop(cond, body, init)
    factors = list(factors)
    weights = jnp.ones((rank,), dtype)
    if normalize_factors:
        norms = [jnp.linalg.norm(f, axis=0) for f in factors]
        weights = functools.reduce(jnp.multiply, norms)
        factors = [f / jnp.where(nm > 0, nm, 1.0)[None, :] for f, nm in zip(factors, norms,
                                                                            strict=True)]
    del norm
    return CPResult(weights, tuple(factors), errors, it)


@functools.partial(jax.jit, static_argnames=("rank", "init"))
def _init_cp(tensor, key, *, rank, init):
    factors = []
    for mode in range(tensor.ndim):
        key, sub = jax.random.split(key)
        dim = tensor.shape[mode]
        if init == "random":
            factors.append(jax.random.uniform(sub, (dim, rank), tensor.dtype))
            continue
        u, s, _ = jnp.linalg.svd(unfold(tensor, mode), full_matrices=False)
        k = min(rank, u.shape[1])
        u = u[:, :k]
        if mode == 0:  # on the tensor's scale, as tensorly does
            u = u * s[:k][None, :]
        if k < rank:
            u = jnp.concatenate([u, jax.random.uniform(sub, (dim, rank - k), tensor.dtype)], axis=1)
        factors.append(u)
    return tuple(factors)


@at_reference_precision
def init_cp(tensor: Array, rank: int, *, init: str = "svd", key: Array | None = None
            ) -> tuple[Array, tuple]:
    """Initial CP factors as tensorly's ``initialize_cp`` makes them.

    Args:
      tensor: ``[I_0, ..., I_{N-1}]``.
      rank: number of rank-1 terms ``R``.
      init: ``'svd'`` (the leading ``R`` left singular vectors of every unfolding, the first
        scaled by its singular values; modes shorter than ``R`` padded with uniform ``[0, 1)``
        random columns) or ``'random'`` (uniform ``[0, 1)`` entries).
      key: PRNG key for the random parts (default ``PRNGKey(0)``).

    Returns:
      ``(weights, factors)`` with ``weights`` all ones.
    """
    tensor = _check_tensor(tensor, "init_cp")
    rank = _check_rank(rank, "init_cp")
    if init not in ("svd", "random"):
        raise ConfigError(f"init_cp: init must be 'svd' or 'random', got {init!r}", where="init",
                          expected=("svd", "random"), actual=init)
    key = jax.random.PRNGKey(0) if key is None else key
    factors = _init_cp(tensor, key, rank=rank, init=init)
    return jnp.ones((rank,), tensor.dtype), factors


def _as_init(tensor, rank, init, key, who):
    if isinstance(init, str):
        _, factors = init_cp(tensor, rank, init=init, key=key)
        return list(factors)
    if not isinstance(init, (tuple, list)) or len(init) != 2:
        raise ConfigError(f"{who}: init must be 'svd', 'random' or (weights, factors), got "
                          f"{type(init).__name__}", where="init",
                          expected="'svd' | 'random' | (weights, factors)", actual=init)
    weights, factors = init
    factors = _check_factors(factors, tensor.shape, rank, who)
    factors = [f.astype(tensor.dtype) for f in factors]
    if weights is not None:  # pulled into the last factor, as tensorly does
        factors[-1] = factors[-1] * jnp.asarray(weights, tensor.dtype)[None, :]
    return factors


@at_reference_precision
def cp_als(tensor: Array, rank: int, *, init="svd", n_iter_max: int = 100, tol: float = 1e-8,
           l2_reg: float = 0.0, linesearch: bool = False, normalize_factors: bool = False,
           key: Array | None = None) -> CPResult:
    """CP decomposition by alternating least squares (tensorly's ``parafac``, jit-compiled).

    Harshman's CP model ("Vision Transformer with Irregular Attention", App. A.2.1, the
    decomposition behind CP-SlimAtt, eq. 3). Jit-compiled; ``jax.vmap(lambda t: cp_als(t, R))``
    decomposes a batch of tensors (each stops on its own criterion; the batch runs until all
    have stopped).

    Args:
      tensor: ``[I_0, ..., I_{N-1}]``, ``N >= 2``.
      rank: number of rank-1 terms ``R``.
      init: ``'svd'``, ``'random'`` (see :func:`init_cp`) or ``(weights, factors)`` to start
        from (weights, if not ``None``, are pulled into the last factor as tensorly does).
      n_iter_max: maximum number of ALS sweeps.
      tol: stop when ``|e_{k-1} - e_k| < tol`` for the relative errors ``e`` of two consecutive
        sweeps (tensorly's ``'abs_rec_error'``). In float32 the error is resolved to about
        ``1e-7``: a smaller ``tol`` runs ``n_iter_max`` sweeps.
      l2_reg: Tikhonov regularisation added to the normal equations (``(V + l2_reg I)``), against
        ill-conditioned Gram products and swamps.
      linesearch: Bro's line search (see the module docstring).
      normalize_factors: return unit-norm factor columns with the norms in ``weights``.
      key: PRNG key for random initial columns (default ``PRNGKey(0)``).

    Returns:
      A :class:`CPResult` (``weights``, ``factors``, ``errors`` history, ``n_iter``).
    """
    tensor = _check_tensor(tensor, "cp_als")
    rank = _check_rank(rank, "cp_als")
    if not isinstance(n_iter_max, (int, np.integer)) or n_iter_max < 1:
        raise ConfigError(f"cp_als: n_iter_max must be an int >= 1, got {n_iter_max!r}",
                          where="n_iter_max", expected="int >= 1", actual=n_iter_max)
    factors = _as_init(tensor, rank, init, key, "cp_als")
    return _cp_als(tensor, tuple(factors), jnp.asarray(tol, tensor.dtype),
                   jnp.asarray(l2_reg, tensor.dtype), rank=rank, n_iter_max=int(n_iter_max),
                   linesearch=bool(linesearch), normalize_factors=bool(normalize_factors))


# ---------------------------------------------------------------------------------------------
# Error-preserving correction.

def _min_norm_update(m, v, norm2, delta2, n_bisect: int = 80):
    """``argmin ||A||^2 s.t. ||T||^2 - 2 <A, M> + tr(A V A^T) <= delta^2`` (exact)."""
    s, u = jnp.linalg.eigh(v)
    s = jnp.maximum(s, 0.0)
    mt = m @ u
    mm = jnp.sum(mt * mt, axis=0)  # [R]
    smax = jnp.maximum(jnp.max(s), jnp.finfo(m.dtype).tiny)

    def resid(t):
        lam = jnp.exp(t)
        w = lam / (1.0 + lam * s)
        return norm2 - 2.0 * jnp.sum(w * mm) + jnp.sum(w * w * s * mm), w

    lo, hi = jnp.log(1e-12 / smax), jnp.log(1e14 / smax)

    def step(_, b):
        lo, hi = b
        mid = 0.5 * (lo + hi)
        ok = resid(mid)[0] <= delta2
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, n_bisect, step, (lo, hi))
    # ``hi`` is feasible whenever anything in the bracket is (it then lies on the boundary).
    _, w = resid(hi)
    return (mt * w[None, :]) @ u.T


@functools.partial(jax.jit, static_argnames=("n_iter_max",))
def _cp_epc(tensor, factors, delta, tol, *, n_iter_max):
    dtype = tensor.dtype
    rank = factors[0].shape[1]
    norm2 = jnp.sum(tensor * tensor)
    norm = jnp.sqrt(norm2)
    delta2 = delta * delta
    factors = _balance(list(factors))
    errors0 = jnp.full((n_iter_max,), jnp.nan, dtype)

    def objective(facs):
        return sum(jnp.sum(f * f) for f in facs)

    def cond(c):
        it, _, _, done, _ = c
        return jnp.logical_and(it < n_iter_max, jnp.logical_not(done))

    def body(c):
        it, facs, errors, _, prev_obj = c
        facs = list(facs)
        for mode in range(tensor.ndim):
            v = _gram_hadamard(facs, mode, rank, dtype)
            m = mttkrp(tensor, facs, mode)
            facs[mode] = _min_norm_update(m, v, norm2, delta2)
        facs = _balance(facs)
        err = _explicit_error(tensor, facs, norm)
        obj = objective(facs)
        errors = errors.at[it].set(err)
        done = jnp.logical_or(prev_obj - obj < tol * prev_obj, jnp.logical_not(jnp.isfinite(obj)))
        return it + 1, tuple(facs), errors, done, obj

    init = (jnp.asarray(0, jnp.int32), tuple(factors), errors0, jnp.asarray(False),
            objective(factors))
    it, factors, errors, _, _ = jax.lax.while_loop(cond, body, init)
    return CPResult(jnp.ones((rank,), dtype), tuple(factors), errors, it)


@at_reference_precision
def cp_epc(tensor: Array, weights: Array | None, factors: Sequence[Array], *,
           delta: float | Array | None = None, n_iter_max: int = 50, tol: float = 1e-6
           ) -> CPResult:
    """Error-preserving correction of a CP model: the smallest factors at a given error.

    What replaces the CPD-EPC of "Vision Transformer with Irregular Attention" (sec. 3.2, the
    initialisation of CP-SlimAtt and of Algorithm 1): ALS can end with diverging rank-1 terms
    that cancel each other, which makes a compressed layer unstable. Starting from a CP model
    with residual ``||T - T^||_F = delta``, this minimises ``sum_n ||F_n||_F^2`` subject to
    ``||T - T^||_F <= delta``, one factor at a time, exactly (see the module docstring), and
    rebalances the rank-1 terms after each sweep: the residual stays within ``delta`` and the
    factor norms never increase. Jit-compiled and vmap-able.

    Args:
      tensor: ``[I_0, ..., I_{N-1}]``.
      weights: ``[R]`` or ``None``; pulled into the factors.
      factors: ``[I_n, R]`` per mode (a :func:`cp_als` result's ``factors``).
      delta: the error bound (absolute Frobenius norm); default the model's own error. In
        float32 the constraint is resolved to about ``1e-7 ||T||^2`` in squared error, so
        ``delta / ||T||`` should be at least ``1e-3``.
      n_iter_max: maximum number of sweeps.
      tol: stop when the objective decreases by less than ``tol`` relatively in a sweep.

    Returns:
      A :class:`CPResult`; ``errors`` are the relative errors after each sweep.
    """
    tensor = _check_tensor(tensor, "cp_epc")
    factors = _check_factors(factors, tensor.shape, None, "cp_epc")
    factors = [f.astype(tensor.dtype) for f in factors]
    if weights is not None:
        factors[-1] = factors[-1] * jnp.asarray(weights, tensor.dtype)[None, :]
    if delta is None:
        delta = jnp.linalg.norm((tensor - cp_to_tensor(None, factors)).ravel())
    if not isinstance(n_iter_max, (int, np.integer)) or n_iter_max < 1:
        raise ConfigError(f"cp_epc: n_iter_max must be an int >= 1, got {n_iter_max!r}",
                          where="n_iter_max", expected="int >= 1", actual=n_iter_max)
    return _cp_epc(tensor, tuple(factors), jnp.asarray(delta, tensor.dtype),
                   jnp.asarray(tol, tensor.dtype), n_iter_max=int(n_iter_max))


__all__ = ["CPResult", "cp_als", "cp_epc", "cp_to_tensor", "init_cp", "mttkrp", "unfold"]
