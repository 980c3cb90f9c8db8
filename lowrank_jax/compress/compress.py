"""Compress a parameter tree: rules pick the weights, truncated SVD replaces them (seed 000 sec. 5).

:func:`compress` is a tree rewrite (penzai-style model surgery): it returns a new tree in which
the selected :class:`~lowrank_jax.Dense` / :class:`~lowrank_jax.LowRank` leaves are replaced by
:class:`~lowrank_jax.LowRank` (shared sketch, seed 000 eq. 19) or
:class:`~lowrank_jax.HeadLowRank` (per-head sketches, eq. 20) leaves, and a
:class:`CompressionReport` with one row per selected matrix. The input tree is never mutated.

How much to keep is set by exactly one of

* ``eps``: every matrix keeps its eps-rank (eq. 1), so ``||W - W_r||_2 <= eps ||W||_2``;
* ``rank``: one rank for every matrix;
* ``schedule``: a rank per layer index (:mod:`lowrank_jax.compress.schedules`, sec. 5 / App. K);
* ``ratio``: a parameter budget, ``params_after / params_before <= ratio`` over the selected
  weights, met either by one global ``eps`` (``allocation="eps"``) or by a global greedy
  allocation of singular values by energy per parameter (``allocation="energy"``).

Per-rule overrides (``{"eps": ..}``, ``{"rank": ..}``, ``{"per_head": .., "num_heads": ..}``, see
:mod:`lowrank_jax.compress.rules`) take precedence over the global setting for the weights their
rule catches; under ``ratio`` such weights are fixed and the rest share what is left of the
budget. If no global setting is given, every selected weight needs an ``eps`` or ``rank``
override.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import numbers
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lowrank_jax.compress.rules import ATTENTION_QKVO, Selection, select
from lowrank_jax.compress.svd import (
    _balanced,
    _check_eps,
    _head_factors,
    _input_basis,
    _inputs_matrix,
    _is_int,
    _normalized,
    _svd,
    _weight,
)
from lowrank_jax.leaves import Dense, LowRank, layer_index, map_with_path

logger = logging.getLogger(__name__)

METHODS = ("svd", "svd-per-head", "inputs", "kept-dense", "kept")


# ---------------------------------------------------------------------------------------------
# Report.

@dataclasses.dataclass(frozen=True)
class CompressionRow:
    """One selected matrix.

    Fields:
      path: parameter path.
      shape: ``(d_in, d_out)``.
      rank: the truncation rank chosen (a tuple of per-head ranks for ``svd-per-head``). For
        ``kept-dense`` / ``kept`` rows it is the rank that was chosen and *not* applied.
      rel_spectral_error: ``||W - W_r||_2 / ||W||_2`` of the leaf now in the tree, in float64
        from the decomposition (``sigma_{r+1} / sigma_1`` for ``svd``; the spectral norm of the
        residual for per-head and input projection; 0.0 for kept weights and a zero matrix).
      params_before, params_after: parameter counts of the old and new leaf (bias included).
      method: ``'svd'`` (:func:`~lowrank_jax.compress.truncated_svd`), ``'svd-per-head'``
        (:func:`~lowrank_jax.compress.head_truncated_svd`), ``'inputs'``
        (:func:`~lowrank_jax.compress.project_inputs`), ``'kept-dense'`` (a Dense leaf kept
        because the factorization would not have fewer parameters) or ``'kept'`` (the same for
        an input LowRank leaf).
      rule: the regex of the rule that selected the weight.
    """

    path: str
    shape: tuple[int, int]
    rank: int | tuple[int, ...]
    rel_spectral_error: float
    params_before: int
    params_after: int
    method: str
    rule: str = ""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["rank"] = list(self.rank) if isinstance(self.rank, tuple) else int(self.rank)
        return d


@dataclasses.dataclass(frozen=True)
class CompressionReport:
    """What :func:`compress` did: one :class:`CompressionRow` per selected matrix, and totals.

    ``totals`` (and ``ratio``) count the selected weights only, not the whole tree.
    ``settings`` records the request and what was solved for (``chosen_eps`` under
    ``ratio`` with ``allocation="eps"``).
    """

    rows: tuple[CompressionRow, ...]
    settings: dict = dataclasses.field(default_factory=dict)

    @property
    def params_before(self) -> int:
        return sum(r.params_before for r in self.rows)

    @property
    def params_after(self) -> int:
        return sum(r.params_after for r in self.rows)

    @property
    def ratio(self) -> float:
        before = self.params_before
        return self.params_after / before if before else 1.0

    @property
    def totals(self) -> dict:
        return {"params_before": self.params_before, "params_after": self.params_after,
                "ratio": self.ratio}

    def row(self, path: str) -> CompressionRow:
        """The row of ``path`` (KeyError if that path was not selected)."""
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(f"CompressionReport: no row for path {path!r}")

    def to_dict(self) -> dict:
        """JSON-able dict: ``rows`` (list of dicts), ``totals``, ``settings``."""
        return {"rows": [r.to_dict() for r in self.rows], "totals": self.totals,
                "settings": _jsonable(self.settings)}

    def format_table(self) -> str:
        """A plain-text table, one line per matrix, totals last."""
        head = ("path", "shape", "method", "rank", "rel err", "before", "after")
        lines = []
        for r in self.rows:
            rank = ",".join(map(str, r.rank)) if isinstance(r.rank, tuple) else str(r.rank)
            lines.append((r.path, f"{r.shape[0]}x{r.shape[1]}", r.method, rank,
                          f"{r.rel_spectral_error:.3e}", str(r.params_before),
                          str(r.params_after)))
        total = ("total", "", "", "", f"ratio {self.ratio:.4f}", str(self.params_before),
                 str(self.params_after))
        widths = [max(len(x[i]) for x in [head, total, *lines]) for i in range(len(head))]

        def fmt(cells):
            return "  ".join(c.ljust(w) if i < 4 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

        sep = "-" * len(fmt(head))
        return "\n".join([fmt(head), sep, *map(fmt, lines), sep, fmt(total)])


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    return x


# ---------------------------------------------------------------------------------------------
# Per-weight plan.

@dataclasses.dataclass
class _Plan:
    sel: Selection
    kind: str                      # 'svd' | 'svd-per-head' | 'inputs'
    mat: np.ndarray                # float64 [d_in, d_out]
    bias: Any
    dtype: Any
    groups: list                   # svd/heads: [(U, s, Vt)]; inputs: [(s_x, B)]
    spectra: list                  # singular values deciding ranks, one array per group
    max_ranks: tuple               # per group
    unit_cost: int                 # parameters per unit of rank in a group
    energy_norm: float             # ||T||_F^2 of what is truncated (W, or x for 'inputs')
    num_heads: int | None
    before: int
    bias_size: int
    eps: float | None = None       # override
    rank: int | None = None        # override
    ranks: tuple | None = None     # decided

    @property
    def path(self) -> str:
        return self.sel.path

    def factored(self, ranks) -> int:
        return int(sum(ranks)) * self.unit_cost + self.bias_size

    def after(self, ranks, keep_dense: bool) -> int:
        f = self.factored(ranks)
        return self.before if keep_dense and f >= self.before else f

    def eps_ranks(self, eps: float) -> tuple:
        return tuple(min(m, max(1, int(np.sum(_normalized(s) > eps))))
                     for s, m in zip(self.spectra, self.max_ranks, strict=True))


def _check_global(eps, rank, ratio, schedule, allocation, per_head, num_heads):
    given = [n for n, v in (("eps", eps), ("rank", rank), ("ratio", ratio),
                            ("schedule", schedule)) if v is not None]
    if len(given) > 1:
        raise ValueError(
            f"compress: give exactly one of eps=, rank=, ratio=, schedule=; got {given}"
        )
    if eps is not None:
        _check_eps("compress", "(all selected weights)", eps)
    if rank is not None and (not _is_int(rank) or rank < 1):
        raise ValueError(f"compress: rank must be an int >= 1, got {rank!r}")
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, numbers.Real)
        or not 0.0 < float(ratio) <= 1.0
    ):
        raise ValueError(f"compress: ratio must be a number in (0, 1], got {ratio!r}")
    if schedule is not None:
        if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence) or not all(
            _is_int(r) and r >= 1 for r in schedule
        ):
            raise ValueError(
                f"compress: schedule must be a list of ints >= 1 (one rank per layer), "
                f"got {schedule!r}"
            )
    if allocation not in ("eps", "energy"):
        raise ValueError(f"compress: allocation must be 'eps' or 'energy', got {allocation!r}")
    if not isinstance(per_head, bool):
        raise ValueError(f"compress: per_head must be a bool, got {per_head!r}")
    if num_heads is not None and (not _is_int(num_heads) or num_heads < 1):
        raise ValueError(f"compress: num_heads must be a positive int, got {num_heads!r}")
    return given[0] if given else "overrides"


def _make_plan(sel: Selection, per_head: bool, num_heads, inputs: dict) -> _Plan:
    path, ov = sel.path, sel.overrides
    if "eps" in ov and "rank" in ov:
        raise ValueError(
            f"compress: {path}: rule {sel.rule!r} overrides both eps={ov['eps']!r} and "
            f"rank={ov['rank']!r}; give one"
        )
    ph = ov.get("per_head", per_head)
    nh = ov.get("num_heads", num_heads)
    if not isinstance(ph, bool):
        raise ValueError(f"compress: {path}: per_head must be a bool, got {ph!r}")
    eps_o = _check_eps("compress", path, ov["eps"]) if "eps" in ov else None
    rank_o = ov.get("rank")
    mat, bias, dtype = _weight("compress", sel.leaf, path)
    d_in, d_out = mat.shape
    before = sel.leaf.param_count()
    bias_size = 0 if bias is None else int(np.size(bias))
    common = dict(sel=sel, mat=mat, bias=bias, dtype=dtype, before=before, bias_size=bias_size,
                  eps=eps_o, rank=rank_o)
    if path in inputs:
        if ph:
            raise ValueError(
                f"compress: {path}: per_head=True and inputs given; the input projection "
                "(seed 000 App. D) is one shared sketch: drop one of the two for this path"
            )
        x2 = _inputs_matrix("compress", path, inputs[path], d_in)
        s_x, B = _input_basis(x2)
        m = min(d_in, d_out, x2.shape[0])
        return _Plan(kind="inputs", groups=[(s_x, B)], spectra=[s_x[:m]], max_ranks=(m,),
                     unit_cost=d_in + d_out, energy_norm=float(np.sum(s_x ** 2)),
                     num_heads=None, **common)
    if ph:
        if nh is None:
            raise ValueError(
                f"compress: {path}: per_head=True needs num_heads (globally or in the rule "
                f"{sel.rule!r}), got num_heads=None"
            )
        if not _is_int(nh) or nh < 1 or d_out % nh:
            raise ValueError(
                f"compress: {path}: num_heads must be a positive int dividing d_out={d_out} "
                f"(weight shape {mat.shape}), got {nh!r}"
            )
        d_h = d_out // nh
        svds = [_svd(mat[:, i * d_h:(i + 1) * d_h]) for i in range(nh)]
        return _Plan(kind="svd-per-head", groups=svds, spectra=[s for _, s, _ in svds],
                     max_ranks=(min(d_in, d_h),) * nh, unit_cost=d_in + d_h,
                     energy_norm=float(np.sum(mat ** 2)), num_heads=int(nh), **common)
    U, s, Vt = _svd(mat)
    return _Plan(kind="svd", groups=[(U, s, Vt)], spectra=[s], max_ranks=(min(d_in, d_out),),
                 unit_cost=d_in + d_out, energy_norm=float(np.sum(s ** 2)), num_heads=None,
                 **common)


def _fixed_rank(plan: _Plan, rank, what: str) -> tuple:
    m = plan.max_ranks[0]
    if not _is_int(rank) or not 1 <= rank <= m:
        limit = {"svd": "min(d_in, d_out)", "svd-per-head": "min(d_in, d_head)",
                 "inputs": "min(d_in, d_out, number of input rows)"}[plan.kind]
        raise ValueError(
            f"compress: {plan.path}: {what} must be an int in [1, {m}] ({limit} for weight "
            f"shape {plan.mat.shape}, method {plan.kind!r}), got {rank!r}"
        )
    return (int(rank),) * len(plan.max_ranks)


# ---------------------------------------------------------------------------------------------
# Budget allocation under ``ratio``.

def _allocate_eps(plans: list[_Plan], budget: float, fixed_after: int, keep_dense: bool,
                  total_before: int, ratio: float) -> float:
    """Smallest eps (largest ratio) with ``params_after <= budget``; sets ``plan.ranks``.

    ``params_after(eps)`` is a non-increasing step function of eps that changes only at the
    normalized singular values ``sigma_j / sigma_1`` of the selected matrices, so the search is
    exact: a bisection over those candidates (each evaluated as ``rank_eps``, i.e. values
    strictly above eps are kept). Below the smallest candidate everything is kept; that
    configuration is represented by half the smallest candidate.
    """
    norms = [[np.sort(_normalized(s)) for s in p.spectra] for p in plans]
    cand = np.unique(np.concatenate([np.ravel(a) for n in norms for a in n] or [np.zeros(0)]))
    cand = cand[(cand > 0) & (cand < 1)]
    eps_list = [float(cand[0]) / 2 if cand.size else 0.5] + [float(c) for c in cand]

    def ranks_at(eps):
        out = []
        for p, n in zip(plans, norms, strict=True):
            out.append(tuple(min(m, max(1, int(a.size - np.searchsorted(a, eps, side="right"))))
                             for a, m in zip(n, p.max_ranks, strict=True)))
        return out

    def total(eps):
        rs = ranks_at(eps)
        return fixed_after + sum(p.after(r, keep_dense) for p, r in zip(plans, rs, strict=True))

    lo, hi = 0, len(eps_list) - 1
    if total(eps_list[hi]) > budget:
        raise ValueError(
            f"compress: ratio={ratio!r} is not reachable: the smallest achievable ratio over the "
            f"selected weights is {total(eps_list[hi]) / total_before:.6g} (every matrix at its "
            "minimum rank); raise ratio or select fewer weights"
        )
    while lo < hi:  # first index whose total fits; totals are non-increasing in the index
        mid = (lo + hi) // 2
        if total(eps_list[mid]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    chosen = eps_list[lo]
    for p, r in zip(plans, ranks_at(chosen), strict=True):
        p.ranks = r
    return chosen


def _allocate_energy(plans: list[_Plan], budget: float, fixed_after: int, keep_dense: bool,
                     total_before: int, ratio: float) -> None:
    """Global greedy allocation of singular values by energy per parameter; sets ``plan.ranks``.

    Every group (a matrix, or a head) starts at rank 1. Then singular values are taken in
    decreasing order of ``sigma_j^2 / ||W||_F^2 / (d_in + d_out)`` (``d_in + d_head`` per
    head; for input projection the spectrum of ``x`` normalized by ``||x||_F^2``) while they
    fit in the budget; one that does not fit closes its matrix (the matrix's later values cost
    the same and are worth less). Zero singular values are never taken. With
    ``keep_dense_if_larger`` a matrix whose factorization would reach its dense size offers, in
    place of its next value, the step "keep it dense": the rest of its energy for the rest of
    its dense size.
    """
    offers: list[list[tuple[float, int, int | None]]] = []  # per plan: (energy, cost, group)
    base_after = 0
    for p in plans:
        mand = (1,) * len(p.max_ranks)
        base_after += p.after(mand, keep_dense)
        items = []
        for g, (s, m) in enumerate(zip(p.spectra, p.max_ranks, strict=True)):
            for j in range(1, m):
                if s[j] > 0:
                    items.append((float(s[j] ** 2) / p.energy_norm, p.unit_cost, g))
        items.sort(key=lambda t: -t[0])  # stable: a group's values stay in order
        if keep_dense:
            base = p.factored(mand)
            if base >= p.before:
                items = []  # kept dense whatever its rank
            else:
                k_save = min(len(items), (p.before - base - 1) // p.unit_cost)
                if len(items) > k_save:
                    rest = sum(e for e, _, _ in items[k_save:])
                    jump = (rest, p.before - (base + k_save * p.unit_cost), None)
                    items = items[:k_save] + [jump]
        offers.append(items)
    left = budget - fixed_after - base_after
    if left < 0:
        raise ValueError(
            f"compress: ratio={ratio!r} is not reachable: the smallest achievable ratio over the "
            f"selected weights is {(fixed_after + base_after) / total_before:.6g} (every matrix "
            "at rank 1); raise ratio or select fewer weights"
        )
    taken = [0] * len(plans)
    heap = [(-items[0][0] / items[0][1], i, 0) for i, items in enumerate(offers) if items]
    heapq.heapify(heap)
    while heap:
        _, i, k = heapq.heappop(heap)
        energy, cost, _ = offers[i][k]
        if cost > left:
            continue  # this matrix is closed
        left -= cost
        taken[i] = k + 1
        if k + 1 < len(offers[i]):
            e, c, _ = offers[i][k + 1]
            heapq.heappush(heap, (-e / c, i, k + 1))
    for p, items, k in zip(plans, offers, taken, strict=True):
        ranks = [1] * len(p.max_ranks)
        if k and items[k - 1][2] is None:  # the "keep dense" step was taken: all values
            ranks = [1 + int(np.sum(s[1:m] > 0))
                     for s, m in zip(p.spectra, p.max_ranks, strict=True)]
        else:
            for _, _, g in items[:k]:
                ranks[g] += 1
        p.ranks = tuple(ranks)


# ---------------------------------------------------------------------------------------------
# Building the new leaves.

def _build(p: _Plan, keep_dense: bool) -> tuple[Any, CompressionRow]:
    ranks = p.ranks
    d_in, d_out = p.mat.shape
    rank_field = ranks if p.kind == "svd-per-head" else ranks[0]
    if keep_dense and p.factored(ranks) >= p.before:
        method = "kept-dense" if isinstance(p.sel.leaf, Dense) else "kept"
        row = CompressionRow(p.path, (d_in, d_out), rank_field, 0.0, p.before, p.before,
                             method, p.sel.rule)
        return p.sel.leaf, row
    w_norm = float(np.linalg.norm(p.mat, 2)) if p.kind != "svd" else float(p.groups[0][1][0])
    if p.kind == "svd":
        (U, s, Vt), r = p.groups[0], ranks[0]
        u, v = _balanced(U, s, Vt, r)
        leaf = LowRank(u=jnp.asarray(u, p.dtype), v=jnp.asarray(v, p.dtype), b=p.bias)
        err = float(s[r]) if r < s.size else 0.0
    elif p.kind == "svd-per-head":
        leaf = _head_factors(p.mat, p.num_heads, ranks, p.groups, p.dtype, p.bias)
        resid = np.concatenate([(U[:, r:] * s[r:]) @ Vt[r:]
                                for (U, s, Vt), r in zip(p.groups, ranks, strict=True)], axis=1)
        err = float(np.linalg.norm(resid, 2))
    else:
        (_, B), r = p.groups[0], ranks[0]
        u = B[:, :r]
        v = u.T @ p.mat
        leaf = LowRank(u=jnp.asarray(u, p.dtype), v=jnp.asarray(v, p.dtype), b=p.bias)
        err = float(np.linalg.norm(p.mat - u @ v, 2))
    rel = err / w_norm if w_norm > 0 else 0.0
    row = CompressionRow(p.path, (d_in, d_out), rank_field, rel, p.before, leaf.param_count(),
                         p.kind, p.sel.rule)
    return leaf, row


def _decide(p: _Plan, mode: str, eps, rank, schedule) -> tuple | None:
    """Ranks of one weight from its rule override or the global setting (None: under ratio)."""
    if p.rank is not None:
        return _fixed_rank(p, p.rank, "rank (rule override)")
    if p.eps is not None:
        return p.eps_ranks(p.eps)
    if mode == "eps":
        return p.eps_ranks(float(eps))
    if mode == "rank":
        return _fixed_rank(p, rank, "rank")
    if mode == "schedule":
        i = layer_index(p.path)
        if i is None:
            raise ValueError(
                f"compress: schedule given but {p.path!r} has no layer index (no "
                "'layers/<i>/' in its path); skip it with a rule or give it a rank override"
            )
        if i >= len(schedule):
            raise ValueError(
                f"compress: schedule has {len(schedule)} ranks but {p.path!r} is in layer "
                f"{i}; give one rank per layer"
            )
        return _fixed_rank(p, schedule[i], f"schedule[{i}]")
    if mode == "ratio":
        return None
    raise ValueError(
        f"compress: {p.path!r} has no setting: give eps=, rank=, ratio= or schedule=, "
        f"or an eps/rank override in its rule {p.sel.rule!r}"
    )


# ---------------------------------------------------------------------------------------------
# Public entry point.

def compress(params, *, rules=ATTENTION_QKVO, eps: float | None = None, rank: int | None = None,
             ratio: float | None = None, schedule: Sequence[int] | None = None,
             per_head: bool = False, num_heads: int | None = None, allocation: str = "eps",
             inputs: dict | None = None, keep_dense_if_larger: bool = True,
             progress: bool = False):
    """Replace the weights chosen by ``rules`` with truncated factorizations (seed 000 sec. 5).

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
      per_head: use :func:`~lowrank_jax.compress.head_truncated_svd` (seed 000 eq. 20);
        needs ``num_heads``. The output projection consumes heads rather than producing them;
        use :data:`~lowrank_jax.compress.ATTENTION_QKV_PER_HEAD` to keep it shared.
      num_heads: number of heads for ``per_head``.
      allocation: under ``ratio``: ``"eps"`` solves for one global eps (exact search over the
        normalized singular values); ``"energy"`` allocates singular values greedily by
        ``sigma_j^2 / ||W||_F^2`` per parameter cost ``d_in + d_out``.
      inputs: optional ``{path: x [..., d_in]}``; those weights use
        :func:`~lowrank_jax.compress.project_inputs` (seed 000 App. D), their rank decided
        on the spectrum of ``x`` (eps / ratio) or as given (rank / schedule).
      keep_dense_if_larger: keep the original leaf when the factorization would not have fewer
        parameters (row method ``'kept-dense'``). Counted this way in the ``ratio`` search too.
      progress: show a tqdm progress bar over the decompositions.

    Returns:
      ``(new_params, CompressionReport)``.

    Raises:
      ValueError: more than one of eps/rank/ratio/schedule; eps outside (0, 1); ratio outside
        (0, 1] or unreachable; a rank larger than a selected matrix allows (the message names
        the path); a schedule shorter than the layers of the selected weights, or a selected
        weight without a layer index under ``schedule``; a rule that matches nothing; an
        ``inputs`` path that is not selected.
    """
    mode = _check_global(eps, rank, ratio, schedule, allocation, per_head, num_heads)
    inputs = dict(inputs or {})
    selected = select(params, rules)
    paths = [s.path for s in selected]
    for k in inputs:
        if k not in paths:
            raise ValueError(
                f"compress: inputs given for {k!r}, which the rules do not select; "
                f"selected: {paths[:12]}"
            )

    settings: dict = {"mode": mode, "eps": eps, "rank": rank, "ratio": ratio,
                      "schedule": list(schedule) if schedule is not None else None,
                      "per_head": per_head, "num_heads": num_heads,
                      "keep_dense_if_larger": keep_dense_if_larger,
                      "inputs": sorted(inputs)}
    rows: list = [None] * len(selected)
    new_leaves: dict = {}

    def build(i: int, p: _Plan) -> None:
        leaf, row = _build(p, keep_dense_if_larger)
        new_leaves[p.path], rows[i] = leaf, row
        p.groups = p.mat = None  # free the decomposition: only counts are needed from here
        logger.info("compress: %s: %s rank %s, rel. error %.3e, params %d -> %d", row.path,
                    row.method, row.rank, row.rel_spectral_error, row.params_before,
                    row.params_after)

    plans, free = [], []
    for i, sel in enumerate(tqdm(selected, desc="compress", disable=not progress)):
        p = _make_plan(sel, per_head, num_heads, inputs)
        p.ranks = _decide(p, mode, eps, rank, schedule)
        plans.append(p)
        if p.ranks is None:
            free.append((i, p))  # under ratio: allocated below, from the spectra
        else:
            build(i, p)

    if mode == "ratio":
        settings["allocation"] = allocation
    if free:
        total_before = sum(p.before for p in plans)
        fixed_after = sum(r.params_after for r in rows if r is not None)
        budget = float(ratio) * total_before
        alloc = _allocate_eps if allocation == "eps" else _allocate_energy
        chosen = alloc([p for _, p in free], budget, fixed_after, keep_dense_if_larger,
                       total_before, ratio)
        if allocation == "eps":
            settings["chosen_eps"] = chosen
        for i, p in free:
            build(i, p)
    new_params = map_with_path(lambda path, node: new_leaves.get(path, node), params)
    return new_params, CompressionReport(tuple(rows), settings)
