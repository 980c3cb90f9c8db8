"""Pareto frontiers of quality against cost, the recommendation at a budget, and the result of
a frontier run (its rows, frontiers and table)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError

#: The axes of the frontier: name -> row key of the cost.
AXES = {"size": "size_ratio", "time": "time_ratio"}


def check_budget(budget: Any, where: str = "budget") -> float:
    """``budget`` as a float in ``(0, 1]``.

    Raises:
      ConfigError: anything else (naming ``where``).
    """
    if (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
            or not math.isfinite(float(budget)) or not 0.0 < budget <= 1.0):
        raise ConfigError(f"{where} must be a ratio to the dense model in (0, 1] (0.5: at most "
                          f"half its size or time), got {budget!r}", where=where,
                          expected="(0, 1]", actual=budget)
    return float(budget)


def pareto_front(cost: Sequence[float], loss: Sequence[float]) -> np.ndarray:
    """Indices of the points no other point dominates, both coordinates minimized.

    Point ``j`` dominates ``i`` when ``cost_j <= cost_i`` and ``loss_j <= loss_i`` with one of
    them strict; equal points do not dominate each other (both are kept). Points with a
    non-finite coordinate are left out. Sorted by cost, then loss, then index.

    Raises:
      ShapeError: ``cost`` and ``loss`` are not 1-D arrays of one length.
    """
    c, q = np.asarray(cost, np.float64), np.asarray(loss, np.float64)
    if c.shape != q.shape or c.ndim != 1:
        raise ShapeError(f"pareto_front: cost and loss must be 1-D of one length, got {c.shape} "
                         f"and {q.shape}", where="cost, loss", expected="[n], [n]",
                         actual=(c.shape, q.shape))
    idx = np.flatnonzero(np.isfinite(c) & np.isfinite(q))
    order = idx[np.lexsort((idx, q[idx], c[idx]))]
    out, best, i = [], math.inf, 0
    while i < len(order):
        j = i
        while j < len(order) and c[order[j]] == c[order[i]]:
            j += 1
        low = q[order[i]]  # the lowest loss at this cost
        if low < best:
            out += [int(k) for k in order[i:j] if q[k] == low]
            best = low
        i = j
    return np.asarray(out, np.int64)


def recommend(cost: Sequence[float], loss: Sequence[float], budget: float) -> int | None:
    """Index of the lowest-loss point with ``cost <= budget`` (ties: the lower cost, then the
    lower index), or ``None`` when none fits. The point is on :func:`pareto_front`."""
    budget = check_budget(budget)
    c, q = np.asarray(cost, np.float64), np.asarray(loss, np.float64)
    ok = np.flatnonzero(np.isfinite(c) & np.isfinite(q) & (c <= budget))
    if ok.size == 0:
        return None
    return int(ok[np.lexsort((ok, c[ok], q[ok]))[0]])


@dataclasses.dataclass
class FrontierResult:
    """The measured candidates and their frontiers.

    Fields:
      rows: one dict per candidate, the dense model first (``name``, ``group``, ``keep``,
        ``plan``, ``params``, ``storage_bits``, ``flops``, ``xla_flops``, ``size_ratio``,
        ``param_ratio``, ``flop_ratio``, ``xla_flop_ratio``, ``time_ratio``, ``time_ms``,
        the metrics, ``apply_seconds``, ``error`` (a message when the candidate failed));
      metric: the quality metric the frontier uses (``'wql'``, ``'accuracy'``, ``'agreement'``
        or ``'rel_error'``); ``higher_is_better`` its direction.
      budget: the budget of :meth:`recommended`.
      skipped: ``{method: why it has no candidate}``.
      info: data, timing settings, family.
    """

    rows: list[dict]
    metric: str
    higher_is_better: bool
    budget: float
    skipped: dict
    info: dict = dataclasses.field(default_factory=dict)

    def _loss(self) -> np.ndarray:
        q = np.asarray([np.nan if r.get(self.metric) is None else r[self.metric]
                        for r in self.rows], np.float64)
        return -q if self.higher_is_better else q

    def _cost(self, axis: str) -> np.ndarray:
        if axis not in AXES:
            raise ConfigError(f"frontier: axis must be one of {sorted(AXES)}, got {axis!r}",
                              where="axis", expected=sorted(AXES), actual=axis)
        return np.asarray([np.nan if r.get(AXES[axis]) is None else r[AXES[axis]]
                           for r in self.rows], np.float64)

    def frontier(self, axis: str) -> list[dict]:
        """The rows on the Pareto frontier of quality against ``axis`` (``'size'`` or
        ``'time'``), by increasing cost."""
        return [self.rows[i] for i in pareto_front(self._cost(axis), self._loss())]

    def recommended(self, axis: str, budget: float | None = None) -> dict | None:
        """The best row whose ``axis`` ratio is at most ``budget`` (default :attr:`budget`),
        or ``None``."""
        i = recommend(self._cost(axis), self._loss(), self.budget if budget is None else budget)
        return None if i is None else self.rows[i]

    def to_dict(self) -> dict:
        """JSON-able: rows (with ``on_size_frontier`` / ``on_time_frontier``), frontiers and
        recommendations by name."""
        front = {a: {r["name"] for r in self.frontier(a)} for a in AXES}
        rows = [{**r, **{f"on_{a}_frontier": r["name"] in front[a] for a in AXES}}
                for r in self.rows]
        rec = {a: (None if (r := self.recommended(a)) is None else r["name"]) for a in AXES}
        return {"metric": self.metric, "higher_is_better": self.higher_is_better,
                "budget": self.budget, "zero_shot": True, "rows": rows,
                "frontier": {a: [r["name"] for r in self.frontier(a)] for a in AXES},
                "recommended": rec, "skipped": dict(self.skipped), **self.info}

    def format_table(self) -> str:
        """A markdown table: one line per candidate; ``S`` / ``T`` mark the size and time
        frontiers, ``best`` the recommendation at the budget."""
        metrics = [m for m in ("wql", "mase", "accuracy", "agreement", "rel_error")
                   if any(r.get(m) is not None for r in self.rows)]
        rec = {a: (r["name"] if (r := self.recommended(a)) else None) for a in AXES}
        front = {a: {r["name"] for r in self.frontier(a)} for a in AXES}
        head = ["candidate", "size", "params", "FLOPs", "XLA FLOPs", "time"] + [
            m.upper() if m in ("wql", "mase") else m for m in metrics] + ["frontier"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

        def f(v, fmt=".3f"):
            return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else \
                format(v, fmt)

        for r in self.rows:
            marks = [a[0].upper() for a in AXES if r["name"] in front[a]]
            marks += [f"**best {a} <= {self.budget:g}**" for a in AXES if rec[a] == r["name"]]
            if r.get("error"):
                marks = [f"failed: {r['error'][:80]}"]
            cells = [r["name"], f(r.get("size_ratio")), f(r.get("param_ratio")),
                     f(r.get("flop_ratio")), f(r.get("xla_flop_ratio")), f(r.get("time_ratio"))]
            cells += [f(r.get(m), ".4f") for m in metrics] + [" ".join(marks)]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


__all__ = ["AXES", "FrontierResult", "check_budget", "pareto_front", "recommend"]
