"""The ``svd`` method: replace selected weights by truncated factorizations.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility", sec. 5: every selected weight becomes a :class:`~lowrank_jax.LowRank` (shared
sketch, eq. 19), a :class:`~lowrank_jax.HeadLowRank` (per-head sketches, eq. 20) or, when
activations are given for it, the input projection of App. D. How much to keep is set by
exactly one of the settings

* ``eps``: every matrix (or head) keeps its eps-rank (eq. 1), so ``||W - W_r||_2 <= eps
  ||W||_2``;
* ``rank``: one rank for every matrix (per head with ``per_head``);
* ``schedule``: a rank per layer index (:mod:`lowrank_jax.compress.schedules`, sec. 5 /
  App. K);
* ``ratio``: a parameter budget, ``params_after / params_before <= ratio`` over the selected
  weights, met by one global eps (``allocation="eps"``) or by a global greedy allocation of
  singular values by energy per parameter (``allocation="energy"``,
  :mod:`lowrank_jax.compress.budget`).

Other settings: ``per_head`` (bool, default ``False``): per-head truncation of weights whose
*outputs* are heads (``attn/qk/q``, ``attn/qk/k``, ``attn/v``; widths read from the enclosing
attention block with :func:`lowrank_jax.nn.head_widths`). The output projection consumes heads
(its inputs split into heads), which a ``HeadLowRank`` cannot express, and weights outside
attention have no heads: under ``per_head`` they get the shared factorization, and their row
says ``kind='svd'``. Heads of unequal widths (pruned channels) raise a
:class:`~lowrank_jax.errors.PlanError`: a ``HeadLowRank`` holds equal-width heads.
``keep_dense_if_larger`` (default ``True``): keep the weight when the factorization would not
have fewer parameters (row kind ``'kept-dense'`` when the weight stores a full ``d_in x d_out``
matrix, ``'kept'`` otherwise; counted this way in the ``ratio`` search too).
``rank_multiple`` (int or ``'backend'``, default ``None``, i.e. 1): every rank the step
decides (per matrix, or per head) is rounded *up* to a multiple of it, capped at the largest
rank the matrix has. Not from the paper: matrix kernels tile the rank dimension, and rounding
up only keeps more singular values, so an ``eps`` bound still holds, with a smaller error.
What it buys depends on the hardware. On a 2-core AVX-512 CPU (XLA:CPU, float32,
``benchmarks/layers/rank_multiple.py``) a ``[d, d]`` ``LowRank`` leaf of rank 26-30 ran
1.06-1.22x faster at rank 32 (d 512-1024, 2048 and 8192 tokens); other ranks rounded up to a
multiple of 8 ran 0.86-1.10x as fast as before (median 1.02 over all rounded ranks), and to 16
often slower (36 -> 48: 0.78-0.96x). In bf16 on a 2-core Xeon with AMX matrix units (tiles of
32 bf16 deep) rounding to 8, 16 or 32 changed nothing measurable (median 1.00-1.01 over ranks
20-58, d 512 and 768, 2048 tokens): the leaf's time barely grows with its rank there.
``'backend'`` takes the multiple of JAX's default backend from
:data:`lowrank_jax.nn.execution.RANK_MULTIPLE_BY_BACKEND`: 1 on CPU (measured, as above), 16 on
GPU and 128 on TPU (design values from their matrix units' tiles, not measured). The default
stays 1 on every backend, so that a compressed model does not depend on the machine it was
compressed on. Under ``ratio`` the rounded ranks are what the budget counts: the eps search
runs over rounded ranks, and the energy allocation takes singular values in blocks of
``rank_multiple``.

Per-rule overrides ``eps``, ``rank``, ``per_head`` and ``rank_multiple`` take precedence over
the step's settings for the weights their rule catches; under ``ratio`` such weights are fixed
and the rest share what is left of the budget. Without any of eps/rank/ratio/schedule every
selected weight needs an ``eps`` or ``rank`` override.

Weights with no inputs or no outputs (the weights of an emptied attention block or MLP,
:mod:`lowrank_jax.compress.empty`) have nothing to truncate: they are passed through unchanged
with a row of kind ``'empty'`` and never checked against ``rank`` or ``schedule`` (a rank
limit of 0 would refuse every rank). Under ``ratio`` they count as fixed weights (their biases
stay), so the ratio still holds over every selected weight; activations given for them count as
used.

Row ``error``: ``||W - W_r||_2 / ||W||_2`` of the leaf now in the tree, in float64 from the
decomposition (``sigma_{r+1} / sigma_1`` for ``'svd'``; the spectral norm of the residual for
per-head and input projection; 0.0 for kept weights and a zero matrix). ``details``:
``shape``, ``rank`` (a list of per-head ranks for ``'svd-per-head'``; for kept rows the rank
that was chosen and not applied), ``rank_multiple`` when it is above 1 and, for kept rows,
``reason``.

:class:`Truncation` (one selected weight, decomposed, ready for rank decisions) and
:func:`prepare_truncation` / :func:`decide_ranks` are public: the sweeps evaluate many rank
choices on the same decompositions.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from lowrank_jax._progress import progress_bar
from lowrank_jax.analysis import output_head_widths
from lowrank_jax.compress.budget import allocate_energy, allocate_eps
from lowrank_jax.compress.candidates import ATTENTION, MLP
from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.plan import Plan, Step, apply_plan
from lowrank_jax.compress.registry import Candidates, Context, register_method
from lowrank_jax.compress.report import Report, Row
from lowrank_jax.compress.rules import ATTENTION_QKVO, Selection
from lowrank_jax.compress.svd import (
    balanced_factors,
    check_eps,
    eps_keep,
    head_factors,
    input_basis,
    inputs_matrix,
    is_int,
    split_columns,
    svd64,
    truncatable,
    uniform_head_widths,
    weight_matrix,
)
from lowrank_jax.errors import ConfigError, PlanError
from lowrank_jax.leaves import LowRank, layer_index, param_count, replace_paths
from lowrank_jax.leaves.channel_masked import pruned_base

logger = logging.getLogger(__name__)

SETTINGS = ("eps", "rank", "ratio", "schedule", "per_head", "allocation", "keep_dense_if_larger",
            "rank_multiple")
OVERRIDES = ("eps", "rank", "per_head", "rank_multiple")
KINDS = ("svd", "svd-per-head", "inputs", "kept-dense", "kept", "empty")


# ---------------------------------------------------------------------------------------------
# Settings.

def check_settings(settings: Mapping) -> str:
    """Validate the step's settings; return the mode: ``'eps'``, ``'rank'``, ``'ratio'``,
    ``'schedule'`` or ``'overrides'`` (none given: every weight needs a rule override).

    Raises:
      PlanError: more than one of eps/rank/ratio/schedule, or a value out of range.
    """
    eps, rank, ratio, schedule = (settings.get(k) for k in ("eps", "rank", "ratio", "schedule"))
    given = [n for n, v in (("eps", eps), ("rank", rank), ("ratio", ratio),
                            ("schedule", schedule)) if v is not None]
    if len(given) > 1:
        raise PlanError(f"svd: give exactly one of eps=, rank=, ratio=, schedule=; got {given}",
                        where="settings", expected="one of eps, rank, ratio, schedule",
                        actual=given)
    if eps is not None:
        try:
            check_eps("svd", "(all selected weights)", eps)
        except ConfigError as e:
            raise PlanError(str(e), where="eps", expected="(0, 1)", actual=eps) from None
    if rank is not None and (not is_int(rank) or rank < 1):
        raise PlanError(f"svd: rank must be an int >= 1, got {rank!r}", where="rank",
                        expected="int >= 1", actual=rank)
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, numbers.Real)
                              or not 0.0 < float(ratio) <= 1.0):
        raise PlanError(f"svd: ratio must be a number in (0, 1], got {ratio!r}", where="ratio",
                        expected="(0, 1]", actual=ratio)
    if schedule is not None and (isinstance(schedule, (str, bytes))
                                 or not isinstance(schedule, Sequence)
                                 or not all(is_int(r) and r >= 1 for r in schedule)):
        raise PlanError(f"svd: schedule must be a list of ints >= 1 (one rank per layer), got "
                        f"{schedule!r}", where="schedule", expected="list of ints >= 1",
                        actual=schedule)
    allocation = settings.get("allocation", "eps")
    if allocation not in ("eps", "energy"):
        raise PlanError(f"svd: allocation must be 'eps' or 'energy', got {allocation!r}",
                        where="allocation", expected=["eps", "energy"], actual=allocation)
    for name in ("per_head", "keep_dense_if_larger"):
        if name in settings and not isinstance(settings[name], bool):
            raise PlanError(f"svd: {name} must be a bool, got {settings[name]!r}", where=name,
                            expected="bool", actual=settings[name])
    check_rank_multiple(settings.get("rank_multiple"), "rank_multiple")
    return given[0] if given else "overrides"


def check_rank_multiple(value, where: str) -> int:
    """``rank_multiple`` as an int >= 1 (``None`` is 1; ``'backend'`` is the multiple of JAX's
    default backend, :func:`lowrank_jax.nn.execution.rank_multiple`).

    Raises:
      PlanError: not ``None``, ``'backend'`` or an int >= 1.
    """
    if value is None:
        return 1
    if value == "backend":
        from lowrank_jax.nn.execution import rank_multiple

        return rank_multiple()
    if not is_int(value) or value < 1:
        raise PlanError(f"svd: {where}: rank_multiple must be an int >= 1, 'backend' or None, "
                        f"got {value!r}", where=where, expected="int >= 1 | 'backend'",
                        actual=value)
    return int(value)


def round_up(rank: int, multiple: int, limit: int) -> int:
    """``rank`` rounded up to a multiple of ``multiple``, at most ``limit``."""
    return min(int(limit), -(-int(rank) // int(multiple)) * int(multiple))


# ---------------------------------------------------------------------------------------------
# One selected weight, decomposed.

@dataclasses.dataclass
class Truncation:
    """One selected weight, decomposed once, ready for rank decisions.

    Fields:
      path, rule: where it is and which rule selected it.
      node: the leaf in the tree.
      kind: ``'svd'`` (one SVD), ``'svd-per-head'`` (one SVD per head) or ``'inputs'`` (the
        SVD of the activations, App. D).
      mat: the weight, float64 ``[d_in, d_out]``; bias, dtype: kept for the new leaf.
      groups: ``[(U, s, Vt)]`` per matrix or head; for ``'inputs'``: ``[(s_x, B)]``.
      spectra: the singular values ranks are decided on, one array per group.
      max_ranks: largest rank per group.
      unit_cost: parameters per unit of rank in a group.
      energy_norm: ``||T||_F^2`` of what is truncated (``W``, or ``x`` for ``'inputs'``).
      before: parameters of ``node`` (its own count); bias_size: entries of its bias.
      eps, rank: the rule's overrides (``None`` if not given).
      rank_multiple: every decided rank is rounded up to a multiple of this (capped at the
        group's largest rank): :meth:`rounded`.
    """

    path: str
    rule: str
    node: Any
    kind: str
    mat: np.ndarray
    bias: Any
    dtype: Any
    groups: list
    spectra: list
    max_ranks: tuple
    unit_cost: int
    energy_norm: float
    before: int
    bias_size: int
    eps: float | None = None
    rank: int | None = None
    rank_multiple: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(d) for d in self.mat.shape)

    def factored(self, ranks) -> int:
        """Parameters of the factorization at ``ranks`` (bias included)."""
        return int(sum(ranks)) * self.unit_cost + self.bias_size

    def keeps(self, ranks, keep_dense: bool) -> bool:
        """Whether the weight is kept (the factorization at ``ranks`` is not smaller)."""
        return keep_dense and self.factored(ranks) >= self.before

    def after(self, ranks, keep_dense: bool) -> int:
        """Parameters after the step at ``ranks``."""
        return self.before if self.keeps(ranks, keep_dense) else self.factored(ranks)

    def rounded(self, ranks) -> tuple:
        """``ranks`` rounded up to multiples of :attr:`rank_multiple`, each at most its group's
        largest rank."""
        return tuple(round_up(r, self.rank_multiple, m)
                     for r, m in zip(ranks, self.max_ranks, strict=True))

    def eps_ranks(self, eps: float) -> tuple:
        """Group ranks at tolerance ``eps`` (eq. 1, at least 1, at most the group's limit),
        rounded up to multiples of :attr:`rank_multiple`."""
        return self.rounded([min(m, eps_keep(s, eps))
                             for s, m in zip(self.spectra, self.max_ranks, strict=True)])

    def fixed_rank(self, rank, what: str) -> tuple:
        """One rank for every group, checked against the groups' limit."""
        m = self.max_ranks[0]
        if not is_int(rank) or not 1 <= rank <= m:
            limit = {"svd": "min(d_in, d_out)", "svd-per-head": "min(d_in, d_head)",
                     "inputs": "min(d_in, d_out, number of input rows)"}[self.kind]
            raise PlanError(
                f"svd: {self.path}: {what} must be an int in [1, {m}] ({limit} for weight "
                f"shape {self.shape}, kind {self.kind!r}), got {rank!r}", where=self.path,
                expected=f"[1, {m}]", actual=rank)
        return self.rounded((int(rank),) * len(self.max_ranks))

    def rank_field(self, ranks):
        """The ``rank`` detail: an int, or a list of per-head ranks."""
        return [int(r) for r in ranks] if self.kind == "svd-per-head" else int(ranks[0])

    def error(self, ranks, kept: bool = False) -> float:
        """``||W - W_r||_2 / ||W||_2`` at ``ranks`` (0.0 if kept or ``W = 0``)."""
        if kept:
            return 0.0
        if self.kind == "svd":
            (_, s, _), r = self.groups[0], ranks[0]
            return float(s[r] / s[0]) if r < s.size and s[0] > 0 else 0.0
        w_norm = float(np.linalg.norm(self.mat, 2))
        if w_norm == 0:
            return 0.0
        if self.kind == "svd-per-head":
            resid = np.concatenate([(U[:, r:] * s[r:]) @ Vt[r:]
                                    for (U, s, Vt), r in zip(self.groups, ranks, strict=True)],
                                   axis=1)
        else:
            u = self.groups[0][1][:, :ranks[0]]
            resid = self.mat - u @ (u.T @ self.mat)
        return float(np.linalg.norm(resid, 2)) / w_norm

    def build(self, ranks) -> Any:
        """The new leaf at ``ranks``."""
        if self.kind == "svd":
            (U, s, Vt), r = self.groups[0], ranks[0]
            u, v = balanced_factors(U, s, Vt, r)
        elif self.kind == "svd-per-head":
            return head_factors(self.shape[0], self.groups, ranks, self.dtype, self.bias)
        else:
            u = self.groups[0][1][:, :ranks[0]]
            v = u.T @ self.mat
        return LowRank(u=jnp.asarray(u, self.dtype), v=jnp.asarray(v, self.dtype), b=self.bias)

    def row(self, ranks, keep_dense: bool) -> tuple[Any, Row]:
        """``(new node, row)`` at ``ranks``."""
        d_in, d_out = self.shape
        details = {"shape": [d_in, d_out], "rank": self.rank_field(ranks)}
        if self.rank_multiple > 1:
            details["rank_multiple"] = self.rank_multiple
        if self.keeps(ranks, keep_dense):
            # "kept-dense": the weight stores a full matrix's parameters (a dense leaf).
            dense = self.before >= d_in * d_out + self.bias_size
            details["reason"] = (f"a factorization at rank {details['rank']} has "
                                 f"{self.factored(ranks)} parameters >= {self.before}")
            return self.node, Row.compare(self.path, self.node, self.node, rule=self.rule,
                                          kind="kept-dense" if dense else "kept", error=0.0,
                                          details=details)
        leaf = self.build(ranks)
        return leaf, Row.compare(self.path, self.node, leaf, rule=self.rule, kind=self.kind,
                                 error=self.error(ranks), details=details)


def prepare_truncation(tree: Any, sel: Selection, *, per_head: bool = False,
                       inputs=None, head_widths=None, rank_multiple: int | None = None
                       ) -> Truncation:
    """Decompose one selected weight.

    Args:
      tree: the tree the weight is in (head widths come from its attention block).
      sel: the selection (path, leaf, overrides, rule); the overrides ``eps``, ``rank``,
        ``per_head`` are read from it.
      per_head: the step's ``per_head`` setting (an override wins).
      inputs: activations entering the weight (input projection, App. D), or ``None``.
      head_widths: ``head_widths(tree, path) -> widths | None``, asked before the attention
        block under ``per_head`` (:class:`~lowrank_jax.compress.Context`).
      rank_multiple: the step's ``rank_multiple`` setting (an override wins; ``None``: 1).

    Raises:
      PlanError: eps and rank both overridden, a bad override value, ``per_head`` together with
        inputs, heads of unequal widths under ``per_head``, non-finite weights.
    """
    path, ov = sel.path, sel.overrides
    if "eps" in ov and "rank" in ov:
        raise PlanError(f"svd: {path}: rule {sel.rule!r} overrides both eps={ov['eps']!r} and "
                        f"rank={ov['rank']!r}; give one", where=path,
                        expected="eps or rank", actual=dict(ov))
    ph = ov.get("per_head", per_head)
    if not isinstance(ph, bool):
        raise PlanError(f"svd: {path}: per_head must be a bool, got {ph!r}", where=path,
                        expected="bool", actual=ph)
    eps_o = None
    if "eps" in ov:
        try:
            eps_o = check_eps("svd", path, ov["eps"])
        except ConfigError as e:
            raise PlanError(str(e), where=path, expected="(0, 1)", actual=ov["eps"]) from None
    multiple = check_rank_multiple(ov["rank_multiple"], path) if "rank_multiple" in ov else \
        check_rank_multiple(rank_multiple, "rank_multiple")
    mat, bias, dtype = weight_matrix("svd", sel.node, path)
    d_in, d_out = mat.shape
    before = param_count(sel.node)
    bias_size = 0 if bias is None else int(np.size(bias))
    common = dict(path=path, rule=sel.rule, node=sel.node, mat=mat, bias=bias, dtype=dtype,
                  before=before, bias_size=bias_size, eps=eps_o, rank=ov.get("rank"),
                  rank_multiple=multiple)
    widths = None
    if ph:
        widths = head_widths(tree, path) if head_widths is not None else None
        widths = output_head_widths(tree, path) if widths is None else widths
        if widths is not None and sum(widths) == 0:
            widths = None  # no heads (or only empty ones): the weight is one empty matrix
    if inputs is not None:
        if widths is not None:
            raise PlanError(
                f"svd: {path}: per_head=True and inputs given; the input projection (App. D) is "
                "one shared sketch: drop one of the two for this path", where=path,
                expected="per_head or inputs", actual="both")
        x2 = inputs_matrix("svd", path, inputs, d_in)
        s_x, B = input_basis(x2)
        m = min(d_in, d_out, x2.shape[0])
        return Truncation(kind="inputs", groups=[(s_x, B)], spectra=[s_x[:m]], max_ranks=(m,),
                          unit_cost=d_in + d_out, energy_norm=float(np.sum(s_x ** 2)), **common)
    if widths is not None:
        widths = uniform_head_widths("svd", path, d_out, widths)
        d_h = widths[0]
        svds = [svd64(b) for b in split_columns(mat, widths)]
        return Truncation(kind="svd-per-head", groups=svds, spectra=[s for _, s, _ in svds],
                          max_ranks=(min(d_in, d_h),) * len(widths), unit_cost=d_in + d_h,
                          energy_norm=float(np.sum(mat ** 2)), **common)
    U, s, Vt = svd64(mat)
    return Truncation(kind="svd", groups=[(U, s, Vt)], spectra=[s], max_ranks=(min(d_in, d_out),),
                      unit_cost=d_in + d_out, energy_norm=float(np.sum(s ** 2)), **common)


def decide_ranks(t: Truncation, mode: str, settings: Mapping) -> tuple | None:
    """Ranks of one weight from its rule override or the step's settings (``None``: decided
    later, under ``ratio``).

    Raises:
      PlanError: a rank out of range, a schedule too short or a weight without a layer index
        under ``schedule``, no setting at all.
    """
    if t.rank is not None:
        return t.fixed_rank(t.rank, "rank (rule override)")
    if t.eps is not None:
        return t.eps_ranks(t.eps)
    if mode == "eps":
        return t.eps_ranks(float(settings["eps"]))
    if mode == "rank":
        return t.fixed_rank(settings["rank"], "rank")
    if mode == "schedule":
        schedule = settings["schedule"]
        i = layer_index(t.path)
        if i is None:
            raise PlanError(
                f"svd: schedule given but {t.path!r} has no layer index (no 'layers/<i>/' in its "
                "path); skip it with a rule or give it a rank override", where=t.path,
                expected="a path with layers/<i>/", actual=t.path)
        if i >= len(schedule):
            raise PlanError(
                f"svd: schedule has {len(schedule)} ranks but {t.path!r} is in layer {i}; give "
                "one rank per layer", where=t.path, expected=f"> {i} ranks",
                actual=len(schedule))
        return t.fixed_rank(schedule[i], f"schedule[{i}]")
    if mode == "ratio":
        return None
    raise PlanError(
        f"svd: {t.path!r} has no setting: give eps=, rank=, ratio= or schedule=, or an eps/rank "
        f"override in its rule {t.rule!r}", where=t.path, expected="eps, rank, ratio or schedule",
        actual=None)


# ---------------------------------------------------------------------------------------------
# The method.

def svd(params: Any, selection: list[Selection], settings: dict, ctx: Context):
    """The ``svd`` method (module docstring): ``(new_params, rows)``."""
    mode = check_settings(settings)
    keep_dense = settings.get("keep_dense_if_larger", True)
    per_head = settings.get("per_head", False)
    rows: list = [None] * len(selection)
    new: dict = {}
    put_back: list = [None] * len(selection)

    def build(i: int, t: Truncation, ranks) -> None:
        leaf, row = t.row(ranks, keep_dense)
        if row.changed:
            new[t.path] = put_back[i](leaf)
        rows[i] = row
        t.groups = t.mat = None  # free the decomposition: only counts are needed from here
        logger.info("svd: %s: %s rank %s, rel. error %.3e, params %d -> %d", row.path, row.kind,
                    row.details["rank"], row.error, row.params_before, row.params_after)

    cands, free = [], []
    empty_before = 0
    for i, sel in enumerate(progress_bar(selection, desc=f"step {ctx.step} svd", unit="matrix",
                                         enabled=ctx.progress, leave=True)):
        # a pruned weight is factorized on its kept channels; its gather/scatter stays
        base, put_back[i], base_inputs = pruned_base(sel.node)
        x = ctx.input_for(sel.path)
        empty = is_empty(base)  # a weight of an emptied block: its inputs count as used
        t = prepare_truncation(params, sel._replace(node=base), per_head=per_head,
                               inputs=None if x is None or empty else base_inputs(x),
                               head_widths=ctx.head_widths,
                               rank_multiple=settings.get("rank_multiple"))
        if empty:  # overrides checked above; no rank applies to it: passed through
            rows[i] = empty_row(sel)
            empty_before += rows[i].params_before
            continue
        ranks = decide_ranks(t, mode, settings)
        cands.append(t)
        if ranks is None:
            free.append((i, t))  # under ratio: allocated below, from the spectra
        else:
            build(i, t, ranks)

    ctx.info["mode"] = mode
    if free:
        total_before = sum(t.before for t in cands) + empty_before
        fixed_after = sum(r.params_after for r in rows if r is not None)
        budget = float(settings["ratio"]) * total_before
        allocation = settings.get("allocation", "eps")
        ctx.info["allocation"] = allocation
        args = ([t for _, t in free], budget, fixed_after, keep_dense, total_before,
                settings["ratio"])
        if allocation == "eps":
            chosen, ranks = allocate_eps(*args)
            ctx.info["chosen_eps"] = chosen
        else:
            ranks = allocate_energy(*args)
        for (i, t), r in zip(free, ranks, strict=True):
            build(i, t, r)
    return replace_paths(params, new), rows


#: Frontier candidates: attention, MLP, and both, each at ``ratio = keep``.
CANDIDATES = Candidates(
    groups=(("svd attn", ATTENTION), ("svd mlp", MLP), ("svd attn+mlp", ATTENTION + MLP)),
    settings=lambda s, keep: {"ratio": keep}, label="ratio={ratio:g}",
    none="no attention or MLP projection it can truncate")

register_method("svd", svd, settings=SETTINGS, overrides=OVERRIDES, accepts=truncatable,
                validate=check_settings, candidates=CANDIDATES)



def compress(params: Any, *, rules=ATTENTION_QKVO, eps: float | None = None,
             rank: int | None = None, ratio: float | None = None,
             schedule: Sequence[int] | None = None, per_head: bool = False,
             allocation: str = "eps", inputs: Mapping | None = None,
             keep_dense_if_larger: bool = True, rank_multiple: int | str | None = None,
             progress: bool = False, blas_threads: int | None = 1) -> tuple[Any, Report]:
    """Replace the weights chosen by ``rules`` with truncated factorizations: a one-step plan
    ``Step("svd", rules, settings)`` applied with :func:`~lowrank_jax.compress.apply_plan`.

    "Understanding Transformers for Time Series", sec. 5; the settings are those of the
    ``svd`` method (module docstring).

    Args:
      params: a parameter tree (not modified).
      rules: path rules, first match wins (:mod:`lowrank_jax.compress.rules`); default
        :data:`~lowrank_jax.compress.ATTENTION_QKVO`, the attention projections.
      eps: tolerance in (0, 1): each matrix (or head) keeps its eps-rank, at least 1
        (``||W - W_r||_2 <= eps ||W||_2``).
      rank: one rank for every selected matrix (per head with ``per_head``); must not exceed
        ``min(d_in, d_out)`` (``min(d_in, d_head)`` per head) of any selected matrix.
      ratio: target ``params_after / params_before`` in (0, 1] over the selected weights; the
        result is the largest achievable ratio ``<= ratio`` (see ``allocation``).
      schedule: ranks per layer index (``schedule[i]`` for paths containing ``layers/i/``;
        :mod:`~lowrank_jax.compress.schedules`). Give at most one of eps/rank/ratio/schedule;
        none only if every selected weight has an eps or rank override.
      per_head: per-head truncation (eq. 20) of the weights whose outputs are heads, with the
        head widths read from the attention blocks; the others keep one shared sketch.
      allocation: under ``ratio``: ``"eps"`` solves for one global eps (exact search over the
        normalized singular values); ``"energy"`` allocates singular values greedily by
        ``sigma_j^2 / ||W||_F^2`` per parameter cost.
      inputs: optional ``{path: x [..., d_in]}``; those weights use
        :func:`~lowrank_jax.compress.project_inputs` (App. D), their rank decided on the
        spectrum of ``x`` (eps / ratio) or as given (rank / schedule).
      keep_dense_if_larger: keep the original leaf when the factorization would not have fewer
        parameters (row kind ``'kept-dense'`` / ``'kept'``).
      rank_multiple: round every decided rank up to a multiple of this (capped at the matrix's
        largest rank; module docstring): faster kernels, never a larger error. ``'backend'``:
        the multiple of JAX's default backend
        (:func:`lowrank_jax.nn.execution.rank_multiple`).
      progress: show a progress bar over the decompositions.
      blas_threads: the most threads of the host LAPACK during the decompositions (one by
        default; ``None``: leave them as they are): see
        :func:`~lowrank_jax.compress.apply_plan`.

    Returns:
      ``(new_params, Report)``; ``report.info()`` holds ``chosen_eps`` under ``ratio`` with
      ``allocation="eps"``.

    Raises:
      PlanError: more than one of eps/rank/ratio/schedule; a value out of range; ratio
        unreachable; a rank larger than a selected matrix allows (naming the path); a schedule
        too short, or a selected weight without a layer index under ``schedule``; a rule that
        matches nothing; an ``inputs`` path that is not selected; heads of unequal widths
        under ``per_head``.
      ConfigError: ``blas_threads`` not an int >= 1 or None.
    """
    settings = {"eps": eps, "rank": rank, "ratio": ratio,
                "schedule": None if schedule is None else list(schedule)}
    settings = {k: v for k, v in settings.items() if v is not None}
    settings.update(per_head=per_head, allocation=allocation,
                    keep_dense_if_larger=keep_dense_if_larger)
    if rank_multiple is not None:
        settings["rank_multiple"] = rank_multiple
    rules = rules if isinstance(rules, str) else tuple(rules)
    return apply_plan(params, Plan((Step("svd", rules, settings),)), inputs=inputs,
                      progress=progress, blas_threads=blas_threads)


__all__ = ["KINDS", "OVERRIDES", "SETTINGS", "Truncation", "check_rank_multiple",
           "check_settings", "compress", "decide_ranks", "prepare_truncation", "round_up", "svd"]
