"""One report schema for every compression method.

Every method returns one :class:`Row` per node it was given (changed or not), with the same
fields whatever the method: the path, the rule that selected it, what was done (``kind``), the
parameter, storage-bit and FLOP counts before and after (from the leaves' own counts:
:func:`lowrank_jax.param_count`, :func:`lowrank_jax.storage_bits`, :func:`lowrank_jax.flops`
for one token), a relative error whose meaning each method documents, and method-specific
``details`` (rank, shape, why a weight was kept, ...). :func:`lowrank_jax.compress.apply_plan`
stamps each row with the step index and the method name and gathers them into a
:class:`Report` with totals over the selected weights and over the whole tree.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

import numpy as np

from lowrank_jax.errors import PathError
from lowrank_jax.leaves import flops, get_path, param_count, storage_bits


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    if x is None or isinstance(x, str):
        return x
    return repr(x)


def counts(node: Any) -> dict:
    """``{'params', 'bits', 'flops'}`` of a node (a leaf, a query-key object or any subtree):
    the sums of its leaves' own counts, FLOPs for one token."""
    return {"params": param_count(node), "bits": storage_bits(node), "flops": flops(node, 1)}


@dataclasses.dataclass(frozen=True)
class Row:
    """What one step did to one selected node.

    Fields:
      path: parameter path of the node.
      method: the step's method name (``'svd'``, ``'factorize'``, ...).
      rule: the pattern of the rule that selected the node.
      step: index of the step in the plan.
      kind: what was done, method-specific (``svd``: ``'svd'``, ``'svd-per-head'``,
        ``'inputs'``, ``'kept-dense'``, ``'kept'``; ``factorize``: ``'lowrank'``,
        ``'head-lowrank'``).
      changed: whether the node was replaced.
      params_before, params_after: stored parameters of the node (biases included).
      bits_before, bits_after: storage in bits.
      flops_before, flops_after: multiply-adds for one token.
      error: a relative error defined by the method (``svd``: ``||W - W_r||_2 / ||W||_2``;
        ``None`` where there is nothing to compare, as for fresh factors).
      details: method-specific, JSON-able (``rank``, ``shape``, ``reason``, ...).
    """

    path: str
    method: str
    rule: str
    step: int
    kind: str
    changed: bool
    params_before: int
    params_after: int
    bits_before: int
    bits_after: int
    flops_before: int
    flops_after: int
    error: float | None = None
    details: Mapping = dataclasses.field(default_factory=dict)

    @classmethod
    def compare(cls, path: str, before: Any, after: Any, *, rule: str, kind: str,
                error: float | None = None, details: Mapping | None = None,
                method: str = "", step: int = -1) -> "Row":
        """A row whose counts are the leaves' own counts of ``before`` and ``after``.

        Args:
          path: parameter path.
          before: the node in the tree the step was given.
          after: the node in the tree it returns (``before`` itself if unchanged).
          rule: the rule pattern that selected the node.
          kind: what was done.
          error: relative error (method-defined), or ``None``.
          details: method-specific JSON-able details.
          method, step: set by :func:`~lowrank_jax.compress.apply_plan`.
        """
        b, a = counts(before), counts(after)
        return cls(path=path, method=method, rule=rule, step=step, kind=kind,
                   changed=after is not before, params_before=b["params"],
                   params_after=a["params"], bits_before=b["bits"], bits_after=a["bits"],
                   flops_before=b["flops"], flops_after=a["flops"],
                   error=None if error is None else float(error), details=dict(details or {}))

    def to_dict(self) -> dict:
        """JSON-able dict of every field."""
        return _jsonable(dataclasses.asdict(self))


def _ratio(after: int, before: int) -> float:
    return after / before if before else 1.0


def count_totals(before: Mapping, after: Mapping) -> dict:
    """``{'params_before', 'params_after', 'params_ratio', ...}`` for ``params``, ``bits`` and
    ``flops`` from two :func:`counts` dicts (a ratio is 1.0 where the count before is 0)."""
    out = {}
    for k in ("params", "bits", "flops"):
        out[f"{k}_before"] = before[k]
        out[f"{k}_after"] = after[k]
        out[f"{k}_ratio"] = _ratio(after[k], before[k])
    return out


_totals = count_totals


@dataclasses.dataclass(frozen=True)
class StepSummary:
    """One step of an applied plan: its index, method, rules, settings, the step-level
    information the method recorded (``svd`` under ``ratio``: ``chosen_eps``) and what the
    step changed in the whole tree.

    Fields:
      index, method, rules, settings: the step as the plan states it.
      info: step-level notes of the method.
      tree: the counts of the whole tree as the step received it and as it left it
        (:func:`count_totals`: ``params_before``, ``params_after``, ``params_ratio`` and the
        same for ``bits`` and ``flops`` per token). Unlike the step's rows, which cover the
        nodes its rules selected, these include every node the step changed (the partner
        weights a ``prune`` step slices, the consumer a ``partition`` step permutes); empty
        for a summary built by hand.
    """

    index: int
    method: str
    rules: tuple
    settings: Mapping
    info: Mapping = dataclasses.field(default_factory=dict)
    tree: Mapping = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        rules = [r[0] if r[1] == {} else [r[0], r[1]] for r in self.rules]
        return _jsonable({"index": self.index, "method": self.method, "rules": rules,
                          "settings": dict(self.settings), "info": dict(self.info),
                          "tree": dict(self.tree)})


def _outermost(paths) -> list[str]:
    """Paths that are not inside another path of the list (``a/qk`` covers ``a/qk/q``)."""
    ps = sorted(set(paths))
    return [p for p in ps if not any(p.startswith(q + "/") for q in ps if q != p)]


@dataclasses.dataclass(frozen=True)
class Report:
    """What a plan did: the rows of every step, the steps, and totals.

    Fields:
      rows: every :class:`Row`, in step order (within a step, in tree order).
      steps: one :class:`StepSummary` per step.
      selected: totals over the selected weights: every node some step selected, counted in
        the input tree (``*_before``) and in the output tree (``*_after``), with ratios
        (``params_ratio``, ``bits_ratio``, ``flops_ratio``; FLOPs per token).
      tree: the same totals over the whole tree (plain arrays such as embeddings and norms
        count their size for parameters and bits, nothing for FLOPs).
    """

    rows: tuple[Row, ...]
    steps: tuple[StepSummary, ...] = ()
    selected: Mapping = dataclasses.field(default_factory=dict)
    tree: Mapping = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, params_before: Any, params_after: Any, rows, steps=()) -> "Report":
        """The report of a plan that turned ``params_before`` into ``params_after``."""
        paths = _outermost(r.path for r in rows)
        sel_b = {"params": 0, "bits": 0, "flops": 0}
        sel_a = dict(sel_b)
        for p in paths:
            for acc, tree in ((sel_b, params_before), (sel_a, params_after)):
                try:
                    c = counts(get_path(tree, p))
                except (KeyError, IndexError, AttributeError, ValueError):
                    continue  # the node is gone (a later step removed it): counts nothing
                for k in acc:
                    acc[k] += c[k]
        return cls(rows=tuple(rows), steps=tuple(steps), selected=_totals(sel_b, sel_a),
                   tree=_totals(counts(params_before), counts(params_after)))

    # -- totals over the selected weights ---------------------------------------------------

    @property
    def params_before(self) -> int:
        """Parameters of the selected weights before the plan."""
        return int(self.selected.get("params_before", 0))

    @property
    def params_after(self) -> int:
        """Parameters of the selected weights after the plan."""
        return int(self.selected.get("params_after", 0))

    @property
    def ratio(self) -> float:
        """``params_after / params_before`` over the selected weights (1.0 if none)."""
        return _ratio(self.params_after, self.params_before)

    @property
    def totals(self) -> dict:
        """``{'selected': {...}, 'tree': {...}}``: see the class docstring."""
        return {"selected": dict(self.selected), "tree": dict(self.tree)}

    @property
    def changed(self) -> int:
        """How many rows replaced their node."""
        return sum(1 for r in self.rows if r.changed)

    def info(self, step: int = 0) -> dict:
        """The step-level information the method of step ``step`` recorded."""
        return dict(self.steps[step].info)

    def row(self, path: str, step: int | None = None) -> Row:
        """The row of ``path`` (of step ``step``, or the last step that selected it).

        Raises:
          KeyError: no step (or not that step) selected the path.
        """
        found = [r for r in self.rows if r.path == path and (step is None or r.step == step)]
        if not found:
            raise PathError(f"Report: no row for path {path!r}" +
                           (f" in step {step}" if step is not None else ""))
        return found[-1]

    def step_rows(self, step: int) -> tuple[Row, ...]:
        """The rows of step ``step``."""
        return tuple(r for r in self.rows if r.step == step)

    def to_dict(self) -> dict:
        """JSON-able dict: ``rows``, ``steps``, ``totals`` and ``changed``."""
        return {"rows": [r.to_dict() for r in self.rows],
                "steps": [s.to_dict() for s in self.steps],
                "totals": _jsonable(self.totals), "changed": self.changed}

    def format_table(self) -> str:
        """A plain-text table, one line per row, the totals last."""
        head = ("step", "path", "method", "kind", "rank", "error", "params", "bits",
                "flops/token")

        def arrow(a, b):
            return f"{a} -> {b}" if a != b else str(a)

        lines = []
        for r in self.rows:
            rank = r.details.get("rank", "")
            rank = ",".join(map(str, rank)) if isinstance(rank, (list, tuple)) else str(rank)
            err = "" if r.error is None else f"{r.error:.3e}"
            lines.append((str(r.step), r.path, r.method, r.kind, rank, err,
                          arrow(r.params_before, r.params_after),
                          arrow(r.bits_before, r.bits_after),
                          arrow(r.flops_before, r.flops_after)))
        totals = []
        for name, t in (("selected", self.selected), ("tree", self.tree)):
            if t:
                totals.append(("", f"total ({name})", "", "", "",
                               f"ratio {t['params_ratio']:.4f}",
                               arrow(t["params_before"], t["params_after"]),
                               arrow(t["bits_before"], t["bits_after"]),
                               arrow(t["flops_before"], t["flops_after"])))
        widths = [max(len(x[i]) for x in [head, *totals, *lines]) for i in range(len(head))]

        def fmt(cells):
            return "  ".join(c.ljust(w) if i < 5 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

        sep = "-" * len(fmt(head))
        out = [fmt(head), sep, *map(fmt, lines), sep, *map(fmt, totals)]
        out.append(f"{self.changed} of {len(self.rows)} rows changed their node")
        if len(self.steps) > 1:
            out += ["", self.format_steps()]
        return "\n".join(out)

    def format_steps(self) -> str:
        """A plain-text table, one line per step in plan order: its method, how many nodes it
        selected and changed, and the counts of the whole tree before and after it (what the
        step changed, :attr:`StepSummary.tree`)."""
        head = ("step", "method", "selected", "changed", "params", "bits", "flops/token")

        def arrow(t, k):
            return f"{t[k + '_before']} -> {t[k + '_after']}" if t else ""

        lines = []
        for st in self.steps:
            rows = self.step_rows(st.index)
            lines.append((str(st.index), st.method, str(len(rows)),
                          str(sum(r.changed for r in rows)), arrow(st.tree, "params"),
                          arrow(st.tree, "bits"), arrow(st.tree, "flops")))
        widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]

        def fmt(cells):
            return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

        return "\n".join([fmt(head), "-" * len(fmt(head)), *map(fmt, lines)])


__all__ = ["Report", "Row", "StepSummary", "count_totals", "counts"]
