"""What structured pruning removes together, and how the units to remove are chosen.

"Less is More: Unlocking Specialization of Time Series Foundation Models via Structured
Pruning" (arXiv:2505.23195) scores pruning units by the loss change when their mask goes from 1
to 0 (eq. 6, :mod:`~lowrank_jax.compress.prune.importance`) and removes the lowest-scored
ones, ranked globally across layers (Algorithm 1). Both pruning front ends, the ``prune`` plan
method on lowrank_jax trees and the Flax interop on kernel paths, describe the model with the
data of this module and choose with its one function:

* :class:`PruneGroup`: channels that are removed together across the weights they span. Unit
  ``u`` of a group is channels ``u * size .. (u + 1) * size - 1`` of every :class:`Span` (one
  weight's input or output side, ``size`` channels per unit). The plan method's
  :class:`~lowrank_jax.compress.prune.structure.Structure` builds ``'qk'`` (the query/key
  channel pairs of an attention block), ``'vo'`` (its value/output channel pairs),
  ``'hidden'`` (an MLP's hidden channels over ``wi``, or both gates, and ``wo``) and
  ``'residual'`` groups (one weight's own channels whose width stays: the residual stream, or
  a weight outside a block); the Flax interop builds one group per declared channel group
  (``'heads'`` over query/key/value/out kernels, ``'channels'`` over an MLP's two kernels or
  any other declared sharing), each keeping at least one unit.
* :class:`UnitTable`: the scored units, one array of scores per mask. The plan method scores
  every weight's input and output masks on their own (the paper's units, sec. 4.1; a channel
  of a group goes when any of its masks removes it: :meth:`UnitTable.of_masks`); the Flax
  interop shares one mask between all the kernels of a group (:meth:`UnitTable.of_groups`).
* :func:`select_removed`: one ranking for both: the lowest-scored alive units (ties by unit
  index), the fewest that remove a ``goal`` fraction of a budget (parameters or FLOPs, measured
  by a function of the alive units, e.g. :func:`additive_fraction`), every group keeping its
  ``min_keep`` best units; or ``scope='group'``: every group loses the same fraction of its
  units.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError

SIDES = ("in", "out")
SCOPES = ("group", "global")
#: ``select_removed`` stops at the first count of units whose measured removed fraction is at
#: least ``goal - TOLERANCE`` (fractions are sums of integers divided by a total).
TOLERANCE = 1e-12


@dataclasses.dataclass(frozen=True)
class Span:
    """One weight's part of a :class:`PruneGroup`.

    Fields:
      path: the weight's path (a lowrank_jax parameter path or a Flax kernel path).
      side: ``'in'`` (the group's channels are the weight's inputs, its rows) or ``'out'``
        (its outputs, its columns).
      size: the weight's channels per unit of the group (1; a head's width for whole heads).
      cost: parameters one unit removes from this weight, for additive budgets
        (:func:`additive_fraction`); 0 where the budget is measured otherwise.
    """

    path: str
    side: str
    size: int = 1
    cost: int = 0

    def __post_init__(self):
        if self.side not in SIDES:
            raise ConfigError(f"Span {self.path!r}: side must be one of {SIDES}, got "
                              f"{self.side!r}", where=self.path, expected=SIDES, actual=self.side)
        if isinstance(self.size, bool) or not isinstance(self.size, (int, np.integer)) \
                or self.size < 1:
            raise ConfigError(f"Span {self.path!r}: size must be an int >= 1, got {self.size!r}",
                              where=self.path, expected="int >= 1", actual=self.size)


@dataclasses.dataclass(frozen=True)
class PruneGroup:
    """Channels removed together across the weights they span (module docstring).

    Fields:
      name: the group's name (a block path with ``'/qk'``, ``'/vo'``, ``'/hidden'``; a weight
        path with ``'/in'`` or ``'/out'``; a declared Flax group's name).
      spans: the weights' sides the group's channels are.
      units: number of units; span ``s`` holds ``units * s.size`` of the group's channels.
      kind: ``'qk'``, ``'vo'``, ``'hidden'``, ``'residual'`` (plan method), ``'heads'``,
        ``'channels'`` (Flax groups).
      min_keep: units the group keeps at least when units are chosen by
        :func:`select_removed`.
    """

    name: str
    spans: tuple[Span, ...]
    units: int
    kind: str = "channels"
    min_keep: int = 0

    def __post_init__(self):
        object.__setattr__(self, "spans", tuple(self.spans))
        if not self.spans:
            raise ConfigError(f"PruneGroup {self.name!r}: no spans", where=self.name,
                              expected="at least one Span", actual=())

    @property
    def cost(self) -> int:
        """Parameters one unit removes over all spans (:attr:`Span.cost`)."""
        return sum(s.cost for s in self.spans)

    def span(self, path: str, side: str) -> Span | None:
        """The span of ``path``'s ``side``, or ``None``."""
        return next((s for s in self.spans if (s.path, s.side) == (path, side)), None)


@dataclasses.dataclass(frozen=True)
class UnitTable:
    """The scored units of a pruning run: one array of unit scores per mask, flattened.

    Fields:
      labels: one per mask array (a mask path ``'<weight>/m_in'`` / ``'<weight>/m_out'``, or a
        group's name).
      spans: the spans each mask array multiplies.
      counts: units per mask array.
      sizes: mask entries per unit of each mask array (a per-channel mask over units of
        ``size`` channels; 1 where the mask holds one entry per unit): the ``units`` of
        :func:`~lowrank_jax.compress.prune.make_scorer`.
      groups: the index of the :class:`PruneGroup` each mask array belongs to.
    """

    labels: tuple[str, ...]
    spans: tuple[tuple[Span, ...], ...]
    counts: tuple[int, ...]
    sizes: tuple[int, ...]
    groups: tuple[int, ...]

    @classmethod
    def of_masks(cls, groups: Sequence[PruneGroup], paths: Sequence[str]) -> UnitTable:
        """One mask per weight side (the plan method): ``paths`` are ``'<weight>/m_in'`` /
        ``'<weight>/m_out'`` in the order of the mask tree; each masks the span of that side,
        in units of the span's size.

        Raises:
          ShapeError: a mask path whose side no group spans.
        """
        where = {(s.path, s.side): (i, s) for i, g in enumerate(groups) for s in g.spans}
        labels, spans, counts, sizes, owners = [], [], [], [], []
        for p in paths:
            weight, mask = p.rsplit("/", 1)
            found = where.get((weight, "in" if mask == "m_in" else "out"))
            if mask not in ("m_in", "m_out") or found is None:
                raise ShapeError(f"prune: mask {p!r} is on no weight side of the structure",
                                 where=p, expected="'<weight>/m_in' or '<weight>/m_out'",
                                 actual=p)
            i, s = found
            labels.append(p)
            spans.append((s,))
            counts.append(int(groups[i].units))
            sizes.append(int(s.size))
            owners.append(i)
        return cls(tuple(labels), tuple(spans), tuple(counts), tuple(sizes), tuple(owners))

    @classmethod
    def of_groups(cls, groups: Sequence[PruneGroup]) -> UnitTable:
        """One mask per group, shared by all its spans (the Flax interop), one entry per
        unit."""
        return cls(tuple(g.name for g in groups), tuple(g.spans for g in groups),
                   tuple(int(g.units) for g in groups), (1,) * len(groups),
                   tuple(range(len(groups))))

    @property
    def offsets(self) -> np.ndarray:
        """Start of every mask array's units in the flat vector (and the total at the end)."""
        return np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    @property
    def total(self) -> int:
        """Number of units."""
        return int(sum(self.counts))

    @property
    def unit_group(self) -> np.ndarray:
        """``[total]`` group index of every unit."""
        return np.repeat(np.asarray(self.groups, np.int64), self.counts)

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """``flat [total]`` as one array per mask array."""
        off = self.offsets
        return [flat[off[i]:off[i + 1]] for i in range(len(self.labels))]

    def label(self, u: int) -> list:
        """``[mask label, unit index in it]`` of flat unit ``u``."""
        off = self.offsets
        i = int(np.searchsorted(off, u, side="right") - 1)
        return [self.labels[i], int(u - off[i])]

    def channel_keep(self, alive: np.ndarray) -> dict[str, list]:
        """Kept channels of every masked weight: ``{path: [bool [d_in] or None, bool [d_out]
        or None]}`` (``None``: the side has no mask), every unit repeated over its span's
        channels."""
        out: dict[str, list] = {}
        for spans, a in zip(self.spans, self.split(np.asarray(alive, bool)), strict=True):
            for s in spans:
                pair = out.setdefault(s.path, [None, None])
                pair[SIDES.index(s.side)] = np.repeat(a, s.size)
        return out


def additive_fraction(costs: np.ndarray) -> Callable[[np.ndarray], float]:
    """A budget where every unit removes a fixed number of parameters.

    Args:
      costs: ``[units]`` parameters each unit removes.

    Returns:
      ``fraction(alive) -> removed cost / total cost`` (0 when the total is 0).
    """
    costs = np.asarray(costs, np.int64)
    total = int(costs.sum())

    def fraction(alive: np.ndarray) -> float:
        return int(costs[~np.asarray(alive, bool)].sum()) / total if total else 0.0

    return fraction


def check_target(target) -> None:
    """Refuse a removed fraction outside ``[0, 1)`` (``ConfigError`` naming ``target``)."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 <= target < 1:
        raise ConfigError(f"prune: target must be a fraction in [0, 1), got {target!r}",
                          where="target", expected="[0, 1)", actual=target)


def check_scope(scope) -> None:
    """Refuse a ranking scope other than :data:`SCOPES` (``ConfigError`` naming ``scope``)."""
    if scope not in SCOPES:
        raise ConfigError(f"prune: scope must be one of {SCOPES}, got {scope!r}", where="scope",
                          expected=SCOPES, actual=scope)


def _protected(order: np.ndarray, unit_group: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``bool [len(order)]``: the last ``keep[g]`` units of every group ``g`` in ``order`` (its
    best-ranked alive units, which stay)."""
    left = keep.copy()
    out = np.zeros(order.size, bool)
    for pos in range(order.size - 1, -1, -1):
        g = unit_group[order[pos]]
        if left[g] > 0:
            out[pos] = True
            left[g] -= 1
    return out


def select_removed(scores: np.ndarray, alive: np.ndarray, *, goal: float,
                   fraction: Callable[[np.ndarray], float] | None = None,
                   unit_group: np.ndarray | None = None, min_keep: int | Sequence[int] = 0,
                   scope: str = "global") -> np.ndarray:
    """The units to remove next: the lowest-scored alive ones.

    Args:
      scores: ``[U]`` one score per unit (eq. 6 or its EMA, weight magnitudes, ...).
      alive: ``[U]`` bool, units not removed yet.
      goal: the removed fraction of the budget to reach, in ``[0, 1)``.
      fraction: ``fraction(alive) -> removed fraction`` of the budget (parameters or FLOPs;
        it must not decrease as units go); needed with ``scope='global'``.
      unit_group: ``[U]`` group index of every unit (default: one group).
      min_keep: units every group keeps at least (its best-ranked alive ones): one number, or
        one per group.
      scope: ``'global'``: one ranking of all alive units by score (ties by unit index),
        the fewest lowest-ranked that bring ``fraction`` to ``goal`` (to ``TOLERANCE``), or
        all of them when it cannot be reached; ``'group'``: every group ends with
        ``floor(goal * units)`` of its units removed, its lowest-ranked.

    Returns:
      ``int [K]`` indices of the units to remove, lowest score first.
    """
    check_scope(scope)
    scores = np.asarray(scores, np.float64)
    alive = np.asarray(alive, bool)
    if scores.shape != alive.shape or scores.ndim != 1:
        raise ShapeError(f"select_removed: scores {scores.shape} and alive {alive.shape} must be "
                         "one vector of the same length", where="scores", expected=alive.shape,
                         actual=scores.shape)
    unit_group = (np.zeros(scores.size, np.int64) if unit_group is None
                  else np.asarray(unit_group, np.int64))
    n_groups = int(unit_group.max()) + 1 if unit_group.size else 0
    keep = np.broadcast_to(np.asarray(min_keep, np.int64), (n_groups,)).copy()
    idx = np.flatnonzero(alive)
    order = idx[np.argsort(scores[idx], kind="stable")]
    if keep.any():
        order = order[~_protected(order, unit_group, keep)]
    if scope == "group":
        units = np.bincount(unit_group, minlength=n_groups)
        dead = np.bincount(unit_group[~alive], minlength=n_groups)
        allowed = {g: max(int(math.floor(goal * units[g] + 1e-9)) - int(dead[g]), 0)
                   for g in range(n_groups)}
        chosen = np.zeros(order.size, bool)
        for pos, u in enumerate(order):
            g = unit_group[u]
            if allowed[g] > 0:
                chosen[pos] = True
                allowed[g] -= 1
        return order[chosen]
    if fraction is None:
        raise ConfigError("select_removed: scope='global' needs a fraction(alive) budget",
                          where="fraction", expected="a callable", actual=None)

    def reached(k: int) -> bool:
        trial = alive.copy()
        trial[order[:k]] = False
        return fraction(trial) >= goal - TOLERANCE

    lo, hi = 0, order.size
    if not reached(hi):
        lo = hi  # the goal cannot be reached: remove every candidate
    while lo < hi:  # the smallest count that reaches the goal (the fraction only grows with it)
        mid = (lo + hi) // 2
        if reached(mid):
            hi = mid
        else:
            lo = mid + 1
    return order[:lo]


__all__ = ["PruneGroup", "SCOPES", "SIDES", "Span", "TOLERANCE", "UnitTable",
           "additive_fraction", "check_scope", "check_target", "select_removed"]
