"""Rank allocation under a parameter budget (``ratio``) for truncations.

Both allocators work on *candidates*: any objects with

* ``spectra``: one descending array of singular values per group (a matrix, or a head), the
  values the ranks are decided on;
* ``max_ranks``: the largest rank of each group;
* ``unit_cost``: parameters per unit of rank in a group (``d_in + d_out``; ``d_in + d_head``
  per head);
* ``energy_norm``: ``||T||_F^2`` of what is truncated;
* ``before``: parameters of the weight now;
* ``factored(ranks)`` and ``after(ranks, keep_dense)``: parameters at given ranks, without and
  with the "keep it if the factorization is not smaller" rule;
* optionally ``rank_multiple`` (default 1): ranks are multiples of it (capped at the group's
  largest rank), and ``rounded(ranks)`` rounds ranks up to them.

(:class:`lowrank_jax.compress.svd_method.Truncation` is one.) They return the ranks, one tuple
per candidate, and raise :class:`~lowrank_jax.errors.PlanError` when the budget cannot be met.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from lowrank_jax.compress.svd import normalized
from lowrank_jax.errors import PlanError


def allocate_eps(cands: Sequence, budget: float, fixed_after: int, keep_dense: bool,
                 total_before: int, ratio: float) -> tuple[float, list[tuple]]:
    """Smallest eps (largest ratio) with ``params_after <= budget``.

    With a candidate's ``rank_multiple`` > 1 its eps-ranks are rounded up before they are
    counted; rounding up is monotone, so the search stays exact.

    ``params_after(eps)`` is a non-increasing step function of eps that changes only at the
    normalized singular values ``sigma_j / sigma_1`` of the candidates, so the search is exact:
    a bisection over those candidate values (each evaluated as ``rank_eps``, i.e. values
    strictly above eps are kept; "Understanding Transformers for Time Series", eq. 1). Below the
    smallest candidate everything is kept; that configuration is represented by half the
    smallest candidate.

    Args:
      cands: the candidates (module docstring).
      budget: the largest allowed total of parameters (fixed weights included).
      fixed_after: parameters of the selected weights whose ranks are fixed already.
      keep_dense: count a weight whose factorization is not smaller at its current size.
      total_before: parameters of all selected weights before, for messages.
      ratio: the requested ratio, for messages.

    Returns:
      ``(eps, ranks)``: the chosen eps and one tuple of group ranks per candidate.
    """
    norms = [[np.sort(normalized(s)) for s in c.spectra] for c in cands]
    vals = np.unique(np.concatenate([np.ravel(a) for n in norms for a in n] or [np.zeros(0)]))
    vals = vals[(vals > 0) & (vals < 1)]
    eps_list = [float(vals[0]) / 2 if vals.size else 0.5] + [float(c) for c in vals]

    def ranks_at(eps):
        out = []
        for c, n in zip(cands, norms, strict=True):
            r = tuple(min(m, max(1, int(a.size - np.searchsorted(a, eps, side="right"))))
                      for a, m in zip(n, c.max_ranks, strict=True))
            out.append(c.rounded(r) if _multiple(c) > 1 else r)
        return out

    def total(eps):
        rs = ranks_at(eps)
        return fixed_after + sum(c.after(r, keep_dense) for c, r in zip(cands, rs, strict=True))

    lo, hi = 0, len(eps_list) - 1
    if total(eps_list[hi]) > budget:
        raise PlanError(
            f"svd: ratio={ratio!r} is not reachable: the smallest achievable ratio over the "
            f"selected weights is {total(eps_list[hi]) / total_before:.6g} (every matrix at its "
            f"minimum rank{_min_rank_note(cands)}); raise ratio or select fewer weights",
            where="ratio",
            expected=f">= {total(eps_list[hi]) / total_before:.6g}", actual=ratio)
    while lo < hi:  # first index whose total fits; totals are non-increasing in the index
        mid = (lo + hi) // 2
        if total(eps_list[mid]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    chosen = eps_list[lo]
    return chosen, ranks_at(chosen)


def allocate_energy(cands: Sequence, budget: float, fixed_after: int, keep_dense: bool,
                    total_before: int, ratio: float) -> list[tuple]:
    """Global greedy allocation of singular values by energy per parameter.

    Every group (a matrix, or a head) starts at rank 1. Then singular values are taken in
    decreasing order of ``sigma_j^2 / ||W||_F^2 / unit_cost`` (for input projection the spectrum
    of ``x`` normalized by ``||x||_F^2``) while they fit in the budget; one that does not fit
    closes its matrix (the matrix's later values cost the same and are worth less). Zero
    singular values are never taken. With ``keep_dense`` a matrix whose factorization would
    reach its current size offers, in place of its next value, the step "keep it": the rest of
    its energy for the rest of its size.

    With a candidate's ``rank_multiple`` ``k > 1`` its groups start at rank ``min(k, max)``
    and take singular values in blocks of ``k`` (the last block of a group up to its largest
    rank), ordered by the block's energy per parameter; a block of zero singular values is
    never taken. With ``k = 1`` this is the allocation above, value by value.

    Args and raises: as :func:`allocate_eps`.

    Returns:
      One tuple of group ranks per candidate.
    """
    # per candidate: offers (energy, cost, group, size); group None is the "keep it" step
    offers: list[list[tuple[float, int, int | None, int]]] = []
    starts: list[tuple] = []
    base_after = 0
    for c in cands:
        k = _multiple(c)
        mand = tuple(min(k, m) for m in c.max_ranks)  # rank 1, rounded up
        starts.append(mand)
        base_after += c.after(mand, keep_dense)
        items = []
        for g, (s, m, r0) in enumerate(zip(c.spectra, c.max_ranks, mand, strict=True)):
            for j in range(r0, m, k):
                size = min(k, m - j)
                e = float(np.sum(np.asarray(s[j:j + size], np.float64) ** 2))
                if e > 0:
                    items.append((e / c.energy_norm, size * c.unit_cost, g, size))
        items.sort(key=lambda t: -t[0] / t[1])  # stable: a group's blocks stay in order
        if keep_dense:
            base = c.factored(mand)
            if base >= c.before:
                items = []  # kept whatever its rank
            else:
                costs = np.cumsum([0] + [cost for _, cost, _, _ in items])
                k_save = int(np.sum(base + costs[1:] < c.before))  # prefix still smaller
                if len(items) > k_save:
                    rest = sum(e for e, _, _, _ in items[k_save:])
                    jump = (rest, c.before - (base + int(costs[k_save])), None, 0)
                    items = items[:k_save] + [jump]
        offers.append(items)
    left = budget - fixed_after - base_after
    if left < 0:
        smallest = (fixed_after + base_after) / total_before
        raise PlanError(
            f"svd: ratio={ratio!r} is not reachable: the smallest achievable ratio over the "
            f"selected weights is {smallest:.6g} (every matrix at rank 1"
            f"{_min_rank_note(cands)}); raise ratio or select fewer weights", where="ratio",
            expected=f">= {smallest:.6g}", actual=ratio)
    taken = [0] * len(cands)
    heap = [(-items[0][0] / items[0][1], i, 0) for i, items in enumerate(offers) if items]
    heapq.heapify(heap)
    while heap:
        _, i, k = heapq.heappop(heap)
        cost = offers[i][k][1]
        if cost > left:
            continue  # this matrix is closed
        left -= cost
        taken[i] = k + 1
        if k + 1 < len(offers[i]):
            e, c, _, _ = offers[i][k + 1]
            heapq.heappush(heap, (-e / c, i, k + 1))
    out = []
    for c, items, k, start in zip(cands, offers, taken, starts, strict=True):
        ranks = list(start)
        if k and items[k - 1][2] is None:  # the "keep it" step was taken: all values
            ranks = [1 + int(np.sum(s[1:m] > 0))
                     for s, m in zip(c.spectra, c.max_ranks, strict=True)]
            if _multiple(c) > 1:
                ranks = list(c.rounded(ranks))
        else:
            for _, _, g, size in items[:k]:
                ranks[g] += size
        out.append(tuple(ranks))
    return out


def _multiple(c) -> int:
    return int(getattr(c, "rank_multiple", 1) or 1)


def _min_rank_note(cands) -> str:
    ks = sorted({_multiple(c) for c in cands} - {1})
    return f", rounded up to rank_multiple={ks[0] if len(ks) == 1 else ks}" if ks else ""


__all__ = ["allocate_eps", "allocate_energy"]
