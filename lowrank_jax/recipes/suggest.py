"""When a compression plan changes nothing or little, say so, and say what would reach a size.

A plan "changes little" when the selected weights keep more than :data:`LITTLE` of their
parameters (``--eps 0.1`` on a model whose matrices all have a high eps-rank keeps every one of
them dense: a factorization at that rank would have more parameters than the matrix).
Suggestions come from the singular values of the weights the plan's ``svd`` steps select
(:func:`lowrank_jax.compress.svd_method.prepare_truncation`, with the steps' ``per_head``
setting; per-rule eps/rank overrides are ignored: every weight is truncated the same way), for
each target fraction of the selected parameters (:data:`TARGETS`):

* the smallest eps (the largest model) whose eps-ranks ("Understanding Transformers for Time
  Series: Rank Structure, Flow-of-Ranks, and Compressibility", eq. 1) reach the target, found
  exactly over the normalized singular values
  (:func:`lowrank_jax.compress.budget.allocate_eps`) and rounded up to a short decimal that
  keeps the same ranks;
* the largest uniform rank (per head under ``per_head``) that reaches it.

Counts follow the ``svd`` method: a weight whose factorization would not be smaller stays
dense and counts at its full size.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lowrank_jax.errors import PlanError
from lowrank_jax.recipes.progress import Progress

#: A plan whose selected weights keep more than this fraction of their parameters changed little.
LITTLE = 0.95
#: Target fractions of the selected parameters the suggestions aim at.
TARGETS = (0.5, 0.25)


def svd_truncations(params: Any, plan: Any, status: Progress) -> list:
    """The decomposed weights that the plan's ``svd`` steps select in ``params`` (first step
    wins for a weight selected twice), without the rules' eps/rank overrides.

    Returns:
      :class:`~lowrank_jax.compress.svd_method.Truncation` objects (decompositions dropped,
      spectra kept).
    """
    from lowrank_jax.compress import Selection, get_method, select
    from lowrank_jax.compress.svd_method import prepare_truncation

    method = get_method("svd")
    chosen, seen = [], set()
    for i, step in enumerate(plan.steps):
        if step.method != "svd":
            continue
        per_head = bool(step.settings.get("per_head", False))
        for sel in select(params, step.rules, kind=method.selects, accepts=method.accepts,
                          allowed=method.overrides, where=f"step {i} (svd)"):
            if sel.path not in seen:
                seen.add(sel.path)
                ov = {k: v for k, v in sel.overrides.items() if k == "per_head"}
                chosen.append((Selection(sel.path, sel.node, ov, sel.rule), per_head))
    out = []
    for sel, per_head in status.bar(chosen, desc="spectra for suggestions", unit="matrix"):
        t = prepare_truncation(params, sel, per_head=per_head)
        t.groups = t.mat = None  # only the spectra and counts are needed
        out.append(t)
    return out


def _total(cands: Sequence, ranks: Sequence[tuple]) -> int:
    return sum(c.after(r, True) for c, r in zip(cands, ranks, strict=True))


def _short_eps(eps: float, cands: Sequence) -> float:
    """A short decimal >= ``eps`` with the same ranks (``eps`` itself if none is found)."""
    want = [c.eps_ranks(eps) for c in cands]
    for digits in range(2, 10):
        scale = 10.0 ** (digits - 1 - math.floor(math.log10(eps)))
        short = math.ceil(eps * scale) / scale
        if short < 1 and [c.eps_ranks(short) for c in cands] == want:
            return short
    return eps


def suggestions(cands: Sequence, targets: Sequence[float] = TARGETS) -> list[dict]:
    """For each target fraction of the selected parameters: an eps and a uniform rank that
    reach it (module docstring).

    Returns:
      One dict per target: ``target``; ``eps`` and ``eps_ratio`` (the fraction it gives), or
      ``eps: None`` and ``eps_note`` when no eps reaches it; ``rank`` and ``rank_ratio``, or
      ``rank: None`` and ``rank_note``.
    """
    from lowrank_jax.compress.budget import allocate_eps

    total = sum(c.before for c in cands)
    out = []
    for target in targets:
        budget = target * total
        row: dict = {"target": float(target)}
        try:
            eps, _ = allocate_eps(list(cands), budget, 0, True, total, target)
        except PlanError as e:
            row.update(eps=None, eps_note=str(e))
        else:
            eps = _short_eps(eps, cands)
            row.update(eps=eps, eps_ratio=_total(cands, [c.eps_ranks(eps) for c in cands]) / total)
        best = None
        for r in range(1, min(min(c.max_ranks) for c in cands) + 1):
            after = _total(cands, [(r,) * len(c.max_ranks) for c in cands])
            if after > budget:
                break  # parameters never fall as the rank grows
            best = (r, after)
        if best is None:
            row.update(rank=None, rank_note="even rank 1 does not reach it")
        else:
            row.update(rank=best[0], rank_ratio=best[1] / total)
        out.append(row)
    return out


def check_change(report: Any, params: Any, plan: Any, status: Progress) -> dict | None:
    """``None`` when the plan changed enough; otherwise a dict with the ``message`` lines for
    the user and the ``suggestions`` (for the JSON report)."""
    ratio = report.ratio
    if report.params_before == 0 or ratio <= LITTLE:
        return None
    n_rows = len(report.rows)
    if report.changed == 0:
        kept = sum(1 for r in report.rows if str(r.kind).startswith("kept"))
        lines = [f"note: this plan changed nothing: none of the {n_rows} selected weights was "
                 "replaced"
                 + (f" ({kept} kept dense: a factorization at the requested eps/rank would not "
                    "have fewer parameters than the weight)" if kept else "") + "."]
    else:
        lines = [f"note: this plan changed little: the selected weights keep {100 * ratio:.1f}% "
                 f"of their parameters ({report.changed} of {n_rows} replaced)."]
    result: dict = {"changed": report.changed, "selected_ratio": ratio, "little": LITTLE}
    if not any(s.method == "svd" for s in plan.steps):
        result["message"] = lines
        return result
    status.say("computing the singular values of the selected weights for suggestions")
    try:
        cands = svd_truncations(params, plan, status)
        rows = suggestions(cands) if cands else []
    except PlanError as e:  # a later step's rules may not apply to the original tree
        lines.append(f"(no suggestions: {e})")
        result["message"] = lines
        return result
    per_head = any(c.kind == "svd-per-head" for c in cands)
    lines.append(f"To reach a size, truncate every selected weight the same way (from the "
                 f"singular values of the {len(cands)} weights the svd steps select; "
                 "--plan: the settings 'eps' or 'rank'):")
    for row in rows:
        parts = []
        if row["eps"] is not None:
            parts.append(f"--eps {row['eps']:g} (gives {100 * row['eps_ratio']:.1f}%)")
        if row["rank"] is not None:
            parts.append(f"--rank {row['rank']}{' per head' if per_head else ''} "
                         f"(gives {100 * row['rank_ratio']:.1f}%)")
        what = " or ".join(parts) if parts else "not reachable by one eps or rank"
        lines.append(f"  {100 * row['target']:.0f}% of the selected parameters: {what}")
    result.update(message=lines, targets=rows)
    return result


__all__ = ["LITTLE", "TARGETS", "check_change", "suggestions", "svd_truncations"]
