"""The ``partition`` plan method: split selected weights over machines.

"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar), sec. II.
Every selected weight becomes a :class:`~lowrank_jax.leaves.partitioned.Partitioned` leaf over
``machines`` machines (the model's residual features are split in contiguous blocks, machine
``m`` owning features ``m d / M .. (m + 1) d / M - 1`` of every layer). What is chosen where:

* **MLP** (``wi`` / ``wi_0`` + ``wi_1`` and ``wo`` of a block): the hidden units are assigned to
  machines by Algorithm 1 (``assignment='greedy'``, the box's global argmax; ``'greedy-rows'``,
  the prose's row order; ``'lp'``, the LP relaxation; ``'contiguous'``), and put in machine
  order (the block's function is unchanged: ``wi``'s outputs and ``wo``'s inputs are permuted
  together). ``wo``'s outputs keep the block input's partition (sec. II.F: the residual sum
  stays on each machine). A gated MLP assigns by ``D(wi_0) + D(wi_1)`` (the paper has no gated
  MLPs; one assignment serves both). If ``wo`` is not selected but is a :class:`~lowrank_jax.Dense`
  weight (a classifier, say), its rows are permuted and it stays dense (row kind
  ``'permuted-inputs'``); otherwise the hidden units keep their order.
* **Attention** (``attn/qk/q``, ``qk/k``, ``v``, ``o``): the paper partitions attention by
  tokens (sec. III), which needs every machine to see all tokens' keys and values; here, to run
  a whole encoder layer over machines that hold features, a machine holds whole heads: heads
  ``m H / M .. (m + 1) H / M - 1`` (``H`` divisible by ``M``, head boundaries on machine
  boundaries), so the per-head logits, softmax and weighted values need no communication.
  ``q``, ``k``, ``v`` read the residual partition and write the machine's heads; ``o`` reads
  the heads and writes the residual partition. (Assigning heads by Algorithm 1 is not done.)
  The paper's own attention scheme, tokens split over machines with compressed keys, is the
  ``compress_keys`` method (:mod:`.keys_method`).
* **Any other weight**: both sides in contiguous blocks, the order kept (its consumer is not
  partitioned with it).

Settings: ``machines`` (int >= 2, required), exactly one of ``rank`` (numbers each machine
sends per token for this weight) or ``eps`` (the paper's rule, eqs. 100-101: the smallest ``r``
with ``max_m' sigma_{m', r+1} <= eps / sqrt(M)``, which guarantees ``||Delta|| <= eps ||x||``;
``relative=True`` scales ``eps`` by ``||W||_2``), ``assignment`` (default ``'greedy'``),
``mesh_axis`` (default ``'model'``). Rules may override ``rank``, ``eps`` and ``assignment``.

A weight with no inputs or no outputs (of an emptied attention block or MLP,
:mod:`lowrank_jax.compress.empty`) is passed through unchanged with a row of kind ``'empty'``
(nothing for a machine to hold or send; its head and divisibility checks do not apply). An
emptied MLP's weights are both empty, so its hidden units have no order to choose; the other
weights are partitioned as without it.

Row ``error``: ``||W - W^||_2 / ||W||_2`` in float64 (``W`` with its outputs in machine order).
``details``: ``machines``, ``rank``, ``max_rank`` (``d*``, eq. 75), ``assignment`` (the method),
``outputs_of_machine`` (original output indices per machine), ``objective`` (eq. 108),
``tr_m0``/``tr_m1`` per machine (eqs. 109-110), ``sigma_max`` (``max sigma_{m', r+1}``),
``bytes_per_token`` (each machine's broadcast, eq. 34), ``params_machine`` (eq. 42),
``macs_machine`` and ``flops_machine`` (executed; library and paper conventions), ``order``.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.partitioning.assign import ASSIGNMENTS, assign, block_energy, machine_order
from lowrank_jax.compress.partitioning.counts import executed
from lowrank_jax.compress.partitioning.factor import Decomposition, decompose
from lowrank_jax.compress.registry import Context, register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.compress.rules import Selection
from lowrank_jax.compress.svd import weight_matrix
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import Dense, get_path, head_offsets, is_dense, replace_paths
from lowrank_jax.nn import head_widths

SETTINGS = ("machines", "rank", "eps", "relative", "assignment", "mesh_axis")
OVERRIDES = ("rank", "eps", "assignment")
KINDS = ("partitioned", "permuted-inputs", "empty")
_MLP_IN = ("wi", "wi_0", "wi_1")


def _int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def validate(settings: dict) -> None:
    """Check the step's settings (module docstring); raises :class:`PlanError`."""
    m = settings.get("machines")
    if not _int(m) or m < 2:
        raise PlanError(f"partition: machines must be an int >= 2, got {m!r}", where="machines",
                        expected="int >= 2", actual=m)
    _check_budget(settings, "settings", required=False)
    a = settings.get("assignment", "greedy")
    if a not in ASSIGNMENTS:
        raise PlanError(f"partition: assignment must be one of {ASSIGNMENTS}, got {a!r}",
                        where="assignment", expected=ASSIGNMENTS, actual=a)
    if not isinstance(settings.get("relative", False), bool):
        raise PlanError(f"partition: relative must be a bool, got {settings['relative']!r}",
                        where="relative", expected="bool", actual=settings["relative"])
    axis = settings.get("mesh_axis", "model")
    if not isinstance(axis, str) or not axis:
        raise PlanError(f"partition: mesh_axis must be a mesh axis name, got {axis!r}",
                        where="mesh_axis", expected="str", actual=axis)


def _check_budget(s: dict, where: str, required: bool) -> None:
    rank, eps = s.get("rank"), s.get("eps")
    if rank is not None and eps is not None:
        raise PlanError(f"partition: {where}: give one of rank= or eps=, not both", where=where,
                        expected="rank or eps", actual={"rank": rank, "eps": eps})
    if required and rank is None and eps is None:
        raise PlanError(f"partition: {where}: no rank= or eps= (set one in the step's settings "
                        "or in the rule's overrides)", where=where, expected="rank or eps",
                        actual=None)
    if rank is not None and (not _int(rank) or rank < 0):
        raise PlanError(f"partition: rank must be an int >= 0, got {rank!r}", where="rank",
                        expected="int >= 0", actual=rank)
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)
                            or not float(eps) > 0):
        raise PlanError(f"partition: eps must be a number > 0, got {eps!r}", where="eps",
                        expected="> 0", actual=eps)


def _parent(path: str) -> tuple[str, str]:
    head, _, last = path.rpartition("/")
    return head, last


def _mlp_block(params: Any, path: str) -> str | None:
    """The MLP block holding ``path`` (``.../mlp`` with ``wo`` and ``wi`` or ``wi_0``/``wi_1``)."""
    parent, last = _parent(path)
    if last not in (*_MLP_IN, "wo"):
        return None
    node = get_path(params, parent) if parent else params
    if isinstance(node, dict) and "wo" in node and ("wi" in node or {"wi_0", "wi_1"} <= set(node)):
        return parent
    return None


def _check_heads(widths: tuple[int, ...], machines: int, path: str, side: str) -> None:
    """Heads must fall on machine boundaries (``H`` divisible by ``M``, equal widths per
    machine)."""
    h = len(widths)
    off = head_offsets(widths)
    total = int(off[-1])
    ok = h % machines == 0 and total % machines == 0 and all(
        int(off[j * h // machines]) == j * total // machines for j in range(machines + 1))
    if not ok:
        raise PlanError(
            f"partition: {path}: the {side} of this attention projection are {h} heads of widths "
            f"{widths}; a machine holds whole heads, so {machines} machines need a head count "
            f"divisible by {machines} with equal widths per machine", where=path,
            expected=f"heads divisible by {machines}", actual=widths)


class _Run:
    """One step's state: settings, new nodes and rows."""

    def __init__(self, params: Any, settings: dict, ctx: Context):
        self.params, self.settings, self.ctx = params, settings, ctx
        self.m = int(settings["machines"])
        self.axis = settings.get("mesh_axis", "model")
        self.new: dict[str, Any] = {}
        self.rows: list[Row] = []
        self.decompositions: dict[str, tuple[Decomposition, int]] = {}

    def opts(self, sel: Selection) -> dict:
        s = {**self.settings, **sel.overrides}
        _check_budget(s, sel.path, required=True)
        return s

    def matrix(self, sel: Selection):
        mat, bias, dtype = weight_matrix("partition", sel.node, sel.path)
        for side, d in (("inputs", mat.shape[0]), ("outputs", mat.shape[1])):
            if d % self.m:
                raise PlanError(f"partition: {sel.path}: {d} {side} are not divisible by "
                                f"machines = {self.m}", where=sel.path,
                                expected=f"a multiple of {self.m}", actual=d)
        return mat, bias, dtype

    def rank(self, dec: Decomposition, s: dict) -> int:
        if s.get("rank") is not None:
            return min(int(s["rank"]), dec.max_rank)
        return dec.rank_for_eps(float(s["eps"]), relative=bool(s.get("relative", False)))

    def emit(self, sel: Selection, dec: Decomposition, s: dict, method: str, order: str) -> None:
        r = self.rank(dec, s)
        leaf = dec.leaf(r, mesh_axis=self.axis)
        a, c = dec.block_shape
        cnt = executed(a * self.m, c * self.m, self.m, r, bias=dec.bias is not None)
        itemsize = np.dtype(dec.dtype).itemsize
        details = {
            "shape": [a * self.m, c * self.m], "machines": self.m, "rank": r,
            "max_rank": dec.max_rank, "assignment": method, "order": order,
            "outputs_of_machine": [dec.perm[k * c:(k + 1) * c].tolist() for k in range(self.m)],
            "objective": float(dec.tr_m0.sum() - dec.tr_m1.sum()),
            "tr_m0": dec.tr_m0.tolist(), "tr_m1": dec.tr_m1.tolist(),
            "sigma_max": float(dec.sigma_next(r).max()),
            "bytes_per_token": r * itemsize, "params_machine": cnt.params_machine,
            "macs_machine": cnt.macs_machine, "flops_machine": cnt.flops_machine,
        }
        self.new[sel.path] = leaf
        self.decompositions[sel.path] = (dec, r)
        self.rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule,
                                     kind="partitioned", error=dec.error(r), details=details))

    # -- units --------------------------------------------------------------------------------

    def single(self, sel: Selection) -> None:
        s = self.opts(sel)
        mat, bias, dtype = self.matrix(sel)
        widths = head_widths(self.params, sel.path)
        if widths is not None:
            side = "inputs" if sel.path.endswith("/o") else "outputs"
            _check_heads(widths, self.m, sel.path, side)
        dec = decompose(mat, self.m, assignment="contiguous", bias=bias, dtype=dtype)
        self.emit(sel, dec, s, "contiguous", "kept" if widths is None else "heads")

    def mlp(self, block: str, chosen: dict[str, Selection]) -> None:
        node = get_path(self.params, block)
        ins = [n for n in _MLP_IN if n in node]
        picked = [n for n in ins if n in chosen]
        if picked and len(picked) != len(ins):
            raise PlanError(f"partition: {block}: select every input projection of the MLP "
                            f"({ins}) or none; the rules selected {picked}", where=block,
                            expected=ins, actual=picked)
        mats = {n: self.matrix(chosen[n]) for n in picked}
        wo_sel = chosen.get("wo")
        perm = None
        if picked:
            s0 = self.opts(chosen[picked[0]])
            method = s0.get("assignment", "greedy")
            permutable = wo_sel is not None or is_dense(node["wo"])
            if not permutable:
                method = "contiguous"
            energy = sum(block_energy(mats[n][0], self.m) for n in picked)
            assignment = assign(energy, method)
            perm = machine_order(assignment)
            for n in picked:
                mat, bias, dtype = mats[n]
                dec = decompose(mat, self.m, assignment=assignment, bias=bias, dtype=dtype)
                self.emit(chosen[n], dec, self.opts(chosen[n]), method,
                          "hidden units permuted" if permutable else "kept (wo not selected)")
        if wo_sel is not None:
            s = self.opts(wo_sel)
            mat, bias, dtype = self.matrix(wo_sel)
            if perm is not None:
                mat = mat[perm]
            dec = decompose(mat, self.m, assignment="contiguous", bias=bias, dtype=dtype)
            self.emit(wo_sel, dec, s, "contiguous", "residual (sec. II.F)")
        elif perm is not None and not np.array_equal(perm, np.arange(len(perm))):
            path = f"{block}/wo"
            wo = node["wo"]
            mat, bias, dtype = weight_matrix("partition", wo, path)
            leaf = Dense(w=jnp.asarray(mat[perm], dtype), b=bias)
            self.new[path] = leaf
            self.rows.append(Row.compare(path, wo, leaf, rule="(consumer of a partitioned MLP)",
                                         kind="permuted-inputs", error=0.0,
                                         details={"reason": "inputs follow the hidden units' "
                                                            "machine order"}))


def partition_weights(params: Any, selection: list[Selection], settings: dict,
                      ctx: Context | None = None):
    """The ``partition`` method, also returning every weight's decomposition.

    "Partitioning Transformer Networks with Low Intercommunication", sec. II (Algorithm 1,
    eqs. 26-34, 100-101, II.F). What is partitioned how: the module docstring.

    Args:
      params: the tree (not modified).
      selection: the selected weight leaves (:func:`lowrank_jax.compress.select`).
      settings: ``machines``, ``rank`` or ``eps``, ``relative``, ``assignment``, ``mesh_axis``.
      ctx: the step's context (``None``: a fresh one).

    Returns:
      ``(new_params, rows, decompositions)`` with ``decompositions[path] = (Decomposition,
      rank)`` for every partitioned weight (the weight in machine order; for error-versus-rank
      curves and bounds).
    """
    ctx = Context(method="partition") if ctx is None else ctx
    validate(settings)
    run = _Run(params, settings, ctx)
    mlps: dict[str, dict[str, Selection]] = {}
    singles = []
    for sel in selection:
        if is_empty(sel.node):  # a weight of an emptied block: nothing to send or split
            run.opts(sel)
            run.rows.append(empty_row(sel))
            continue
        block = _mlp_block(params, sel.path)
        if block is None:
            singles.append(sel)
        else:
            mlps.setdefault(block, {})[_parent(sel.path)[1]] = sel
    for block, chosen in mlps.items():
        run.mlp(block, chosen)
    for sel in singles:
        run.single(sel)
    ctx.info.update({"machines": run.m, "mesh_axis": run.axis,
                     "bytes_per_token": sum(r.details.get("bytes_per_token", 0)
                                            for r in run.rows)})
    order = {sel.path: i for i, sel in enumerate(selection)}
    rows = sorted(run.rows, key=lambda r: order.get(r.path, len(order)))
    return replace_paths(params, run.new), rows, run.decompositions


def partition(params: Any, selection: list[Selection], settings: dict,
              ctx: Context) -> tuple[Any, list[Row]]:
    """The ``partition`` plan method: ``fn(params, selection, settings, ctx) -> (params, rows)``
    (:func:`partition_weights` without the decompositions).

    "Partitioning Transformer Networks with Low Intercommunication", sec. II.

    Args:
      params: the tree (not modified).
      selection: the selected weight leaves.
      settings: see the module docstring.
      ctx: the step's context.

    Returns:
      ``(new_params, rows)``.
    """
    new, rows, _ = partition_weights(params, selection, settings, ctx)
    return new, rows


register_method("partition", partition, settings=SETTINGS, overrides=OVERRIDES,
                validate=validate,
                no_candidates="splits layers over machines: it saves bytes sent between "
                              "machines (`lowrank-jax partition` measures them), not one "
                              "device's size or time")

__all__ = ["KINDS", "OVERRIDES", "SETTINGS", "partition", "partition_weights", "validate"]
