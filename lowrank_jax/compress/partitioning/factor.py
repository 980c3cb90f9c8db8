"""Low-rank off-diagonal blocks, the rank rule, and the paper's baselines.

"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar), sec. II.C-E.
With the outputs assigned to machines (:mod:`.assign`) and put in machine order, machine
``m'``'s column block ``W_m'`` (its inputs' weights to every output) splits into its diagonal
block ``W_m'm'`` and the rest ``W~_m'`` (eqs. 8-10), whose rank-``r`` SVD ``U~ Sigma~ V~^T``
(eq. 26) gives the ``r`` numbers ``y~_m' = Sigma~ V~^T x_m'`` it broadcasts (eq. 29) and, row
block by row block, the factors ``U~_{m,m'}`` machine ``m`` applies to them (eqs. 27-32).

* :class:`Decomposition` / :func:`decompose` -- one weight decomposed once in float64 (all
  singular values and vectors kept), then :meth:`Decomposition.leaf` for any rank.
* :func:`rank_for_eps` -- the paper's rank rule (eqs. 100-101): the smallest ``r`` with
  ``max_m' sigma_{m', r+1} <= eps / sqrt(M)``, where ``eps`` bounds ``||Delta|| / ||x||``.
* Baselines (sec. II.C.1 and II.D): :func:`svd_method_matrix` (a rank-``r`` SVD of every
  ``W_m'``, sent to a central node, eqs. 18-22) and :func:`full_svd_matrix` (rank ``M r`` of
  the whole ``W``, eq. 55).

All matrices here are in the library's orientation ``w = W^T`` (``[d_in, d_out]``).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.partitioning.assign import (
    assign,
    block_energy,
    check_assignment,
    machine_order,
    machine_traces,
)
from lowrank_jax.compress.svd import out_dtype, svd64
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves.partitioned import Partitioned, sender_index


def _check_rank(rank, max_rank: int, where: str = "rank") -> int:
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
        raise ConfigError(f"partition: {where} must be an int >= 0, got {rank!r}", where=where,
                          expected="int >= 0", actual=rank)
    return min(int(rank), max_rank)


def rank_for_eps(sigma: np.ndarray, eps: float, machines: int) -> int:
    """The paper's rank rule (eqs. 100-101): the smallest ``r`` such that
    ``max_m' sigma_{m', r+1} <= eps / sqrt(M)``.

    With it ``||Delta||_2 <= sqrt(M) sigma_max ||x||_2 <= eps ||x||_2`` for every input
    (eq. 92), i.e. ``eps`` is an absolute tolerance on ``||Delta|| / ||x||``.

    Args:
      sigma: ``[M, d*]`` singular values of every ``W~_m'``, descending (``sigma_{m', d*+1}``
        is taken as 0, so ``r = d*`` always satisfies the rule).
      eps: the tolerance, > 0.
      machines: ``M``.

    Returns:
      ``r`` in ``[0, d*]``.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not float(eps) > 0:
        raise ConfigError(f"rank_for_eps: eps must be a number > 0, got {eps!r}", where="eps",
                          expected="> 0", actual=eps)
    sigma = np.asarray(sigma, np.float64)
    tail = np.concatenate([sigma, np.zeros((sigma.shape[0], 1))], axis=1).max(axis=0)  # [d*+1]
    ok = np.nonzero(tail <= float(eps) / np.sqrt(machines))[0]
    return int(ok[0])


@dataclasses.dataclass(frozen=True)
class Decomposition:
    """One weight split over ``M`` machines, decomposed once (float64).

    Fields:
      w: ``[d_in, d_out]`` the weight in machine order (outputs permuted by ``perm``).
      machines: ``M``.
      assignment: ``[d_out]`` machine of every *original* output.
      perm: ``[d_out]`` machine order (:func:`~.assign.machine_order`): output ``perm[k]`` of
        the original weight is output ``k`` of the partitioned one.
      diag: ``[M, a, c]`` the diagonal blocks ``W_mm`` (library orientation).
      u: ``[M, (M - 1) c, d*]`` left singular vectors of every ``W~_m'`` (paper orientation:
        rows are the other machines' outputs in increasing machine order).
      sigma: ``[M, d*]`` singular values of every ``W~_m'``, descending.
      vt: ``[M, d*, a]`` right singular vectors (rows).
      sigma0: ``[M, min(d_out, a)]`` singular values of every whole column block ``W_m'`` (the
        SVD method's spectra, eigenvalues of ``M0``).
      bias: ``[d_out]`` in machine order, or ``None``.
      dtype: dtype of the leaves :meth:`leaf` builds.
      tr_m0, tr_m1: ``Tr M0``, ``Tr M1`` per machine (eqs. 109-110).
    """

    w: np.ndarray
    machines: int
    assignment: np.ndarray
    perm: np.ndarray
    diag: np.ndarray
    u: np.ndarray
    sigma: np.ndarray
    vt: np.ndarray
    sigma0: np.ndarray
    bias: np.ndarray | None
    dtype: np.dtype
    tr_m0: np.ndarray
    tr_m1: np.ndarray

    @property
    def block_shape(self) -> tuple[int, int]:
        """``(a, c) = (d_in / M, d_out / M)``."""
        return self.diag.shape[1], self.diag.shape[2]

    @property
    def max_rank(self) -> int:
        """``d* = min((M - 1) c, a)`` (eq. 75): the rank at which the partition is exact."""
        return self.sigma.shape[1]

    def sigma_next(self, rank: int) -> np.ndarray:
        """``sigma_{m', r+1}`` of every machine (0 beyond ``d*``): ``[M]``."""
        r = _check_rank(rank, self.max_rank)
        return self.sigma[:, r] if r < self.max_rank else np.zeros(self.machines)

    def rank_for_eps(self, eps: float, *, relative: bool = False) -> int:
        """:func:`rank_for_eps` on this weight; ``relative=True`` scales ``eps`` by
        ``||W||_2`` (so the guarantee reads ``||Delta|| <= eps ||W||_2 ||x||``)."""
        scale = np.linalg.norm(self.w, 2) if relative else 1.0
        return rank_for_eps(self.sigma, float(eps) * scale, self.machines)

    def factors(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``(send [M, a, r], recv [M, M - 1, r, c])`` in float64 (see
        :class:`~lowrank_jax.leaves.partitioned.Partitioned`)."""
        r = _check_rank(rank, self.max_rank)
        m = self.machines
        a, c = self.block_shape
        send = np.einsum("mra,mr->mar", self.vt[:, :r], self.sigma[:, :r])  # (Sigma V^T)^T
        recv = np.zeros((m, max(m - 1, 0), r, c))
        senders = sender_index(np.arange(m), m)  # [M, M - 1]
        for k in range(m):
            for j, p in enumerate(senders[k]):
                row = k if k < p else k - 1  # position of machine k among p's receivers
                recv[k, j] = self.u[p, row * c:(row + 1) * c, :r].T  # U~_{k,p}^T
        return send, recv

    def leaf(self, rank: int, *, mesh_axis: str = "model") -> Partitioned:
        """The :class:`~lowrank_jax.leaves.partitioned.Partitioned` leaf of rank ``r`` (``r``
        above ``d*`` is lowered to ``d*``), in :attr:`dtype`."""
        send, recv = self.factors(rank)
        dt = self.dtype
        b = None if self.bias is None else jnp.asarray(
            self.bias.reshape(self.machines, -1), dt)
        return Partitioned(diag=jnp.asarray(self.diag, dt), send=jnp.asarray(send, dt),
                           recv=jnp.asarray(recv, dt), b=b, mesh_axis=mesh_axis)

    def approx(self, rank: int) -> np.ndarray:
        """The dense ``[d_in, d_out]`` matrix the rank-``r`` leaf represents (float64, machine
        order)."""
        r = _check_rank(rank, self.max_rank)
        m = self.machines
        a, c = self.block_shape
        out = np.zeros_like(self.w)
        for p in range(m):
            low = (self.u[p, :, :r] * self.sigma[p, :r]) @ self.vt[p, :r]  # [(M-1)c, a]
            others = [k for k in range(m) if k != p]
            for row, k in enumerate(others):
                out[p * a:(p + 1) * a, k * c:(k + 1) * c] = low[row * c:(row + 1) * c].T
            out[p * a:(p + 1) * a, p * c:(p + 1) * c] = self.diag[p]
        return out

    def error(self, rank: int) -> float:
        """``||W - W_r||_2 / ||W||_2`` of the rank-``r`` partition (float64)."""
        norm = np.linalg.norm(self.w, 2)
        return float(np.linalg.norm(self.w - self.approx(rank), 2) / norm) if norm else 0.0


def _blocks(w: np.ndarray, m: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Diagonal blocks and, per machine, ``W~_m'`` and ``W_m'`` in the paper's orientation."""
    d_in, d_out = w.shape
    a, c = d_in // m, d_out // m
    wt = w.T  # paper orientation [d_out, d_in]
    diag = np.stack([w[p * a:(p + 1) * a, p * c:(p + 1) * c] for p in range(m)])
    tilde, whole = [], []
    for p in range(m):
        col = wt[:, p * a:(p + 1) * a]  # W_m' [d_out, a]
        whole.append(col)
        tilde.append(np.concatenate([col[k * c:(k + 1) * c] for k in range(m) if k != p], axis=0)
                     if m > 1 else np.zeros((0, a)))
    return diag, tilde, whole


def decompose(w, machines: int, *, assignment="greedy", bias=None, dtype=np.float32,
              energy=None) -> Decomposition:
    """Split a weight over ``machines`` machines and decompose its off-diagonal blocks.

    "Partitioning Transformer Networks with Low Intercommunication", eqs. 6-10, 25-28, 107-110.

    Args:
      w: ``[d_in, d_out]`` weight (library orientation); machine ``m'`` owns the inputs
        ``m' a .. (m' + 1) a - 1``.
      machines: ``M`` (divides ``d_in`` and ``d_out``).
      assignment: how the outputs are split: ``'greedy'`` (Algorithm 1, the box's global
        argmax), ``'greedy-rows'`` (the prose's row order), ``'lp'`` (the LP relaxation),
        ``'contiguous'`` (keep the order), or an int array ``[d_out]`` of machines.
      bias: ``[d_out]`` bias (original order) or ``None``.
      dtype: dtype of the leaves built from the decomposition.
      energy: ``D [d_out, M]`` to assign by instead of ``block_energy(w)`` (a gated MLP assigns
        its two input projections' hidden units together).

    Returns:
      A :class:`Decomposition`.
    """
    w = np.asarray(w, np.float64)
    if w.ndim != 2:
        raise ShapeError(f"decompose: w must be 2-D [d_in, d_out], got shape {w.shape}",
                         where="w", expected="[d_in, d_out]", actual=w.shape)
    d_energy = block_energy(w, machines) if energy is None else np.asarray(energy, np.float64)
    m = int(machines)
    if w.shape[1] % m:
        raise ShapeError(f"decompose: d_out = {w.shape[1]} is not divisible by machines = {m}",
                         where="d_out", expected=f"a multiple of {m}", actual=w.shape[1])
    if d_energy.shape != (w.shape[1], m):
        raise ShapeError(f"decompose: energy must be [d_out, M] = {(w.shape[1], m)}, got "
                         f"{d_energy.shape}", where="energy", expected=(w.shape[1], m),
                         actual=d_energy.shape)
    if isinstance(assignment, str):
        a_out = assign(d_energy, assignment)
    else:
        a_out = check_assignment(assignment, w.shape[1], m)
    perm = machine_order(a_out)
    tr_m0, tr_m1 = machine_traces(block_energy(w, m), a_out)
    wp = w[:, perm]
    diag, tilde, whole = _blocks(wp, m)
    us, ss, vts = zip(*(svd64(t) for t in tilde), strict=True)
    sigma0 = np.stack([np.linalg.svd(c, compute_uv=False) for c in whole])
    b = None if bias is None else np.asarray(bias, np.float64)[perm]
    return Decomposition(w=wp, machines=m, assignment=a_out, perm=perm, diag=diag,
                         u=np.stack(us), sigma=np.stack(ss), vt=np.stack(vts), sigma0=sigma0,
                         bias=b, dtype=out_dtype(dtype), tr_m0=tr_m0, tr_m1=tr_m1)


def svd_method_matrix(w, machines: int, rank: int) -> np.ndarray:
    """The baseline "SVD method" (sec. II.C.1, eqs. 18-22): each machine's whole column block
    ``W_m'`` truncated to rank ``r``; a central node holds every ``U_m'`` and sums
    ``U_m' y_m'``.

    Args:
      w: ``[d_in, d_out]`` (contiguous input blocks).
      machines: ``M``.
      rank: ``r`` per machine.

    Returns:
      The ``[d_in, d_out]`` matrix it computes (float64).
    """
    w = np.asarray(w, np.float64)
    m = int(machines)
    a = w.shape[0] // m
    out = np.zeros_like(w)
    for p in range(m):
        u, s, vt = svd64(w[p * a:(p + 1) * a])  # rows J_m' of w = columns of W_m'
        r = _check_rank(rank, len(s))
        out[p * a:(p + 1) * a] = (u[:, :r] * s[:r]) @ vt[:r]
    return out


def full_svd_matrix(w, rank: int) -> np.ndarray:
    """The rank-``R`` truncated SVD of the whole weight (eq. 55; the paper compares with
    ``R = M r``). Returns the ``[d_in, d_out]`` matrix (float64)."""
    u, s, vt = svd64(np.asarray(w, np.float64))
    r = _check_rank(rank, len(s))
    return (u[:, :r] * s[:r]) @ vt[:r]


def relative_output_errors(w, w_hat, x) -> np.ndarray:
    """``||x (W - W^) || / ||x W||`` per sample (eq. 93 when ``W^`` is the partition).

    Args:
      w, w_hat: ``[d_in, d_out]``.
      x: ``[n, d_in]`` inputs.

    Returns:
      ``[n]`` float64 (``nan`` where ``x W = 0``).
    """
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    num = np.linalg.norm(x @ (w - np.asarray(w_hat, np.float64)), axis=-1)
    den = np.linalg.norm(x @ w, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


__all__ = [
    "Decomposition", "decompose", "full_svd_matrix", "rank_for_eps", "relative_output_errors",
    "svd_method_matrix",
]
