"""Which machine computes which output: Algorithm 1 and its LP relaxation.

"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar), sec. II.F.
Machine ``m'`` owns the input block ``J_m'``; the outputs are split into equal sets ``I_m'`` so
that the diagonal blocks keep as much of ``W`` as possible: maximize
``sum_m' Tr(W_m'm'^T W_m'm') = sum_m' d_m'^T z_m'`` (eq. 108) with
``D[i, m'] = sum_{j in J_m'} W_ij^2`` (eq. 107; in the library's orientation ``w = W^T``,
``D[i, m'] = sum_{j in J_m'} w[j, i]^2``). Then ``Tr M1`` (eq. 110), the energy left for the
low-rank off-diagonal factors, is as small as an equal split allows (eq. 103).

An assignment is an int array ``[d_out]``: the machine of every output.

* :func:`algorithm1` -- the paper's Algorithm 1 as its box states it (``variant='global'``, the
  default: repeatedly take the largest remaining entry of ``D`` over all rows and machines) or
  as its prose describes it (``variant='rows'``: for ``i = 1..d_out`` in order, the best machine
  with room). The two differ (on a Gaussian ``D`` the box's version keeps more energy). Ties
  go to the smallest output index, then the smallest machine (the paper leaves them open).
  The global variant runs as one stable sort of ``D`` and one pass over it, which
  :func:`algorithm1_literal` (the box transcribed step by step, ``O(d_out^2 M)``) checks.
* :func:`lp_assignment` -- the LP relaxation (after eq. 108), solved with scipy's HiGHS
  (:func:`scipy.optimize.linprog`). Its constraint matrix is that of a transportation
  problem, totally unimodular, so a vertex optimum is integral; the result reports whether the
  solution scipy returned is (``lp_solution``), and the assignment it reads off.
* :func:`assignment_objective` (eq. 108), :func:`machine_traces` (``Tr M0``, ``Tr M1``, eqs.
  109-110), :func:`machine_order` (the permutation that makes every machine's outputs
  contiguous, as :class:`~lowrank_jax.leaves.partitioned.Partitioned` stores them).
"""

from __future__ import annotations

import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError

VARIANTS = ("global", "rows")


def _check_machines(machines, d: int, what: str) -> int:
    if isinstance(machines, bool) or not isinstance(machines, (int, np.integer)) or machines < 1:
        raise ConfigError(f"partition: machines must be an int >= 1, got {machines!r}",
                          where="machines", expected="int >= 1", actual=machines)
    if d % int(machines):
        raise ShapeError(f"partition: {what} = {d} is not divisible by machines = {machines}; "
                         "every machine gets an equal block", where=what,
                         expected=f"a multiple of {machines}", actual=d)
    return int(machines)


def _check_energy(energy) -> np.ndarray:
    d = np.asarray(energy, np.float64)
    if d.ndim != 2 or d.shape[1] < 1:
        raise ShapeError(f"partition: D must be [d_out, machines], got shape {d.shape}",
                         where="D", expected="[d_out, machines]", actual=d.shape)
    _check_machines(d.shape[1], d.shape[0], "d_out")
    if not np.all(np.isfinite(d)):
        raise ShapeError("partition: D must be finite", where="D", expected="finite values",
                         actual=f"{int(np.sum(~np.isfinite(d)))} non-finite")
    return d


def block_energy(w, machines: int) -> np.ndarray:
    """``D[i, m'] = sum_{j in J_m'} W_ij^2`` (eq. 107) for contiguous input blocks.

    Args:
      w: ``[d_in, d_out]`` (library orientation); machine ``m'`` owns inputs
        ``m' a .. (m' + 1) a - 1`` with ``a = d_in / machines``.
      machines: ``M``.

    Returns:
      ``[d_out, M]`` float64.
    """
    w = np.asarray(w, np.float64)
    if w.ndim != 2:
        raise ShapeError(f"block_energy: w must be 2-D [d_in, d_out], got shape {w.shape}",
                         where="w", expected="[d_in, d_out]", actual=w.shape)
    m = _check_machines(machines, w.shape[0], "d_in")
    return np.square(w).reshape(m, w.shape[0] // m, w.shape[1]).sum(axis=1).T


def algorithm1_literal(energy, variant: str = "global") -> np.ndarray:
    """Algorithm 1, transcribed step by step (the reference the fast version is tested
    against; ``O(d_out^2 M)``).

    ``variant='global'`` is the box: ``d_out`` times, ``(i, m) = argmax D`` over all entries,
    add ``i`` to ``I_m``, set row ``i`` to ``-inf`` and, once ``|I_m| = d_out / M``, column
    ``m``. ``variant='rows'`` is the prose: for ``i = 1..d_out``, ``m = argmax_m D[i, m]``,
    same bookkeeping. ``np.argmax`` breaks ties by the first position (row-major).

    Args:
      energy: ``D [d_out, M]`` (:func:`block_energy`).
      variant: ``'global'`` or ``'rows'``.

    Returns:
      ``[d_out]`` machine of each output.
    """
    d = _check_energy(energy).copy()
    if variant not in VARIANTS:
        raise ConfigError(f"algorithm1: variant must be one of {VARIANTS}, got {variant!r}",
                          where="variant", expected=VARIANTS, actual=variant)
    n, m = d.shape
    cap = n // m
    sizes = np.zeros(m, np.int64)
    out = np.full(n, -1, np.int64)
    for step in range(n):
        if variant == "global":
            i, k = divmod(int(np.argmax(d)), m)
        else:
            i, k = step, int(np.argmax(d[step]))
        out[i] = k
        sizes[k] += 1
        d[i, :] = -np.inf
        if sizes[k] == cap:
            d[:, k] = -np.inf
    return out


def algorithm1(energy, variant: str = "global") -> np.ndarray:
    """Algorithm 1 of the paper (sec. II.F): greedy assignment of outputs to machines.

    ``'global'`` (the algorithm box, default) visits the entries of ``D`` once, in decreasing
    order (a stable sort, so ties go to the first position in row-major order, as
    ``argmax`` in :func:`algorithm1_literal`), assigning an entry whose output is free and
    whose machine has room: that entry is the maximum of what the box's ``-inf`` bookkeeping
    leaves, so the result equals the literal transcription. ``'rows'`` (the prose) takes the
    outputs in order. ``O(d_out M log(d_out M))``.

    Args:
      energy: ``D [d_out, M]`` (:func:`block_energy`).
      variant: ``'global'`` or ``'rows'``.

    Returns:
      ``[d_out]`` machine of each output.
    """
    d = _check_energy(energy)
    if variant not in VARIANTS:
        raise ConfigError(f"algorithm1: variant must be one of {VARIANTS}, got {variant!r}",
                          where="variant", expected=VARIANTS, actual=variant)
    n, m = d.shape
    cap = n // m
    sizes = np.zeros(m, np.int64)
    out = np.full(n, -1, np.int64)
    if variant == "rows":
        for i in range(n):
            row = np.where(sizes < cap, d[i], -np.inf)
            k = int(np.argmax(row))
            out[i] = k
            sizes[k] += 1
        return out
    order = np.argsort(-d.ravel(), kind="stable")
    left = n
    for flat in order:
        i, k = divmod(int(flat), m)
        if out[i] >= 0 or sizes[k] == cap:
            continue
        out[i] = k
        sizes[k] += 1
        left -= 1
        if not left:
            break
    return out


def lp_assignment(energy, *, return_solution: bool = False):
    """The LP relaxation of the assignment (the paper's linear program after eq. 108).

    ``maximize sum_{i, m} D[i, m] z[i, m]`` subject to ``0 <= z <= 1``,
    ``sum_m z[i, m] = 1`` (every output on one machine) and ``sum_i z[i, m] = d_out / M``
    (equal blocks), solved by :func:`scipy.optimize.linprog` (HiGHS). The constraints form a
    transportation polytope (totally unimodular), so the optimal vertex HiGHS returns is
    integral; the assignment is read off as ``argmax_m z[i, m]``.

    Args:
      energy: ``D [d_out, M]`` (:func:`block_energy`).
      return_solution: also return the LP solution ``z [d_out, M]`` as scipy gave it.

    Returns:
      ``[d_out]`` machine of each output, or ``(assignment, z)``.
    """
    from scipy import sparse
    from scipy.optimize import linprog

    d = _check_energy(energy)
    n, m = d.shape
    rows = sparse.kron(sparse.eye(n), np.ones((1, m)))  # sum over machines, per output
    cols = sparse.kron(np.ones((1, n)), sparse.eye(m))  # sum over outputs, per machine
    a_eq = sparse.vstack([rows, cols]).tocsr()
    b_eq = np.concatenate([np.ones(n), np.full(m, n // m)])
    res = linprog(-d.ravel(), A_eq=a_eq, b_eq=b_eq, bounds=(0.0, 1.0), method="highs")
    if res.status != 0:
        raise ShapeError(f"lp_assignment: scipy linprog failed: {res.message}", where="D",
                         expected="an optimal LP solution", actual=res.message)
    z = res.x.reshape(n, m)
    out = np.argmax(z, axis=1).astype(np.int64)
    return (out, z) if return_solution else out


def check_assignment(assignment, d_out: int, machines: int) -> np.ndarray:
    """``assignment`` as an int array ``[d_out]`` with ``d_out / machines`` outputs per
    machine, or a ShapeError saying what is wrong."""
    a = np.asarray(assignment)
    if a.shape != (d_out,) or not np.issubdtype(a.dtype, np.integer):
        raise ShapeError(f"partition: an assignment must be an int array [{d_out}], got "
                         f"{a.dtype}{list(a.shape)}", where="assignment", expected=[d_out],
                         actual=list(a.shape))
    counts = np.bincount(a, minlength=machines) if a.size and a.min() >= 0 else None
    if counts is None or len(counts) != machines or np.any(counts != d_out // machines):
        raise ShapeError(f"partition: an assignment must give every machine {d_out // machines}"
                         f" outputs, got {None if counts is None else counts.tolist()}",
                         where="assignment", expected=d_out // machines,
                         actual=None if counts is None else counts.tolist())
    return a.astype(np.int64)


def assignment_objective(energy, assignment) -> float:
    """``sum_m' Tr(W_m'm'^T W_m'm') = sum_i D[i, a_i]`` (eq. 108)."""
    d = _check_energy(energy)
    a = check_assignment(assignment, d.shape[0], d.shape[1])
    return float(d[np.arange(d.shape[0]), a].sum())


def machine_traces(energy, assignment) -> tuple[np.ndarray, np.ndarray]:
    """``Tr M0`` and ``Tr M1`` of every machine (eqs. 109-110; the paper's Fig. 5).

    ``Tr M0^(m') = ||W_m'||_F^2 = sum_i D[i, m']`` (what a rank-``r`` SVD of the machine's whole
    column block must capture, the SVD method); ``Tr M1^(m') = Tr M0^(m') - Tr(W_m'm'^T
    W_m'm')`` (eq. 103: what the new method's off-diagonal factors must capture).

    Returns:
      ``(tr_m0 [M], tr_m1 [M])``.
    """
    d = _check_energy(energy)
    a = check_assignment(assignment, d.shape[0], d.shape[1])
    m0 = d.sum(axis=0)
    own = np.zeros(d.shape[1])
    np.add.at(own, a, d[np.arange(d.shape[0]), a])
    return m0, m0 - own


def contiguous_assignment(d_out: int, machines: int) -> np.ndarray:
    """Output ``i`` on machine ``i // (d_out / M)``: the order kept (a residual block's output,
    sec. II.F, or a layer whose consumer cannot be permuted)."""
    m = _check_machines(machines, d_out, "d_out")
    return np.repeat(np.arange(m, dtype=np.int64), d_out // m)


def machine_order(assignment) -> np.ndarray:
    """The permutation ``perm`` with ``perm[k]`` the original output at machine-order position
    ``k``: machine 0's outputs first (in increasing original index), then machine 1's, ..."""
    return np.argsort(np.asarray(assignment), kind="stable").astype(np.int64)


def assign(energy, method: str = "greedy") -> np.ndarray:
    """An assignment by name: ``'greedy'`` (:func:`algorithm1`, global), ``'greedy-rows'``
    (:func:`algorithm1`, rows), ``'lp'`` (:func:`lp_assignment`) or ``'contiguous'``.

    Args:
      energy: ``D [d_out, M]``.
      method: the name.

    Returns:
      ``[d_out]`` machine of each output.
    """
    if method == "greedy":
        return algorithm1(energy, "global")
    if method == "greedy-rows":
        return algorithm1(energy, "rows")
    if method == "lp":
        return lp_assignment(energy)
    if method == "contiguous":
        d = _check_energy(energy)
        return contiguous_assignment(d.shape[0], d.shape[1])
    raise ConfigError(f"partition: assignment must be one of {ASSIGNMENTS}, got {method!r}",
                      where="assignment", expected=ASSIGNMENTS, actual=method)


ASSIGNMENTS = ("greedy", "greedy-rows", "lp", "contiguous")

__all__ = [
    "ASSIGNMENTS", "VARIANTS", "algorithm1", "algorithm1_literal", "assign",
    "assignment_objective", "block_energy", "check_assignment", "contiguous_assignment",
    "lp_assignment", "machine_order", "machine_traces",
]
