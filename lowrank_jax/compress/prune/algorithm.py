"""Progressive global pruning ("Less is More", Algorithm 1).

"Less is More: Unlocking Specialization of Time Series Foundation Models via Structured
Pruning" (arXiv:2505.23195), sec. 4.3 and Algorithm 1: for each batch ``j = 1..B``, forecast
with the current masks, compute the importance of every channel (eq. 6, per-sample gradients
averaged over the batch), update its EMA, and remove the ``K`` channels with the lowest EMA
among those still alive, ranked *globally* across all layers. The input and the output
channels of every weight are pruning units of their own (sec. 4.1).

**Schedule for K.** The paper removes a fixed "pruning ratio per epoch" (App. A.2, Table 6)
and states the target only as the fraction of parameters left. Here the target is a fraction of
the prunable parameters (or of their FLOPs) to remove, and batch ``j`` removes as many of the
lowest-EMA units as it takes for the *measured* removed fraction (of the physically pruned
model: dependency groups included, :class:`~lowrank_jax.compress.prune.structure.Structure`)
to reach the scheduled fraction

* ``'cubic'`` (default): ``f_j = target (1 - (1 - j/B)^3)`` (the gradual schedule of Zhu &
  Gupta, "To prune, or not to prune", 2017): ``K`` is large on the first batches and shrinks
  as the model gets smaller, so the last removals are made with the best EMA estimates;
* ``'linear'``: ``f_j = target j / B`` (about the same number of parameters per batch, the
  paper's fixed ratio per epoch).

``K_j`` is the smallest number of units that reaches ``f_j`` (found by bisection, since the
measured fraction only grows with the units removed; the ranking is
:func:`~lowrank_jax.compress.prune.select_removed`, shared with the Flax interop); it is
recorded in the history. After
batch ``B`` the target is reached exactly up to one unit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterable

import jax
import numpy as np

from lowrank_jax import runtime
from lowrank_jax._progress import progress_bar
from lowrank_jax.compress.prune.groups import UnitTable, check_target, select_removed
from lowrank_jax.compress.prune.importance import ema, make_scorer, mask_paths
from lowrank_jax.compress.prune.structure import Removal, Structure
from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves.channel_masked import mask_partition, with_channel_masks

SCHEDULES = ("cubic", "linear")
MEASURES = ("params", "flops")


def scheduled_fraction(step: int, steps: int, target: float, schedule: str = "cubic") -> float:
    """The removed fraction to reach after batch ``step`` of ``steps`` (module docstring).

    Args:
      step: batch number, ``1..steps``.
      steps: number of pruning batches ``B``.
      target: the final fraction to remove.
      schedule: ``'cubic'`` or ``'linear'``.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"prune: schedule must be one of {SCHEDULES}, got {schedule!r}",
                          where="schedule", expected=SCHEDULES, actual=schedule)
    t = min(max(step / steps, 0.0), 1.0)
    if schedule == "linear":
        return target * t
    return target * (1.0 - (1.0 - t) ** 3)


@dataclasses.dataclass
class PruneResult:
    """What :func:`progressive_prune` did.

    Fields:
      params: the tree with its final masks (still masked: :func:`remove_masked` makes it
        smaller).
      structure: the dependency structure of the masked weights.
      removal: what physical removal keeps under the final masks.
      params_fraction, flops_fraction: removed fractions of the prunable parameters and of
        their FLOPs per sample (FLOPs only with token counts).
      history: one dict per batch: ``step``, ``loss`` (mean per-sample loss with the masks the
        batch was scored with), ``k`` (units removed), ``scheduled``, ``params_fraction``,
        ``flops_fraction``, ``removed`` (``[mask path, unit]`` of every unit removed, lowest
        EMA first).
      ema: ``{mask path: EMA of the unit scores}``.
      alive: ``{mask path: bool per unit}``.
    """

    params: Any
    structure: Structure
    removal: Removal
    params_fraction: float
    flops_fraction: float
    history: list
    ema: dict
    alive: dict


def _check(target, steps, alpha, by) -> None:
    check_target(target)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ConfigError(f"prune: steps (pruning batches) must be an int >= 1, got {steps!r}",
                          where="steps", expected="int >= 1", actual=steps)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        raise ConfigError(f"prune: alpha (EMA coefficient) must be in (0, 1], got {alpha!r}",
                          where="alpha", expected="(0, 1]", actual=alpha)
    if by not in MEASURES:
        raise ConfigError(f"prune: by must be one of {MEASURES}, got {by!r}", where="by",
                          expected=MEASURES, actual=by)


def progressive_prune(params: Any, loss_fn: Callable, batches: Callable[[int], dict] | Iterable,
                      *, target: float, steps: int, by: str = "params", alpha: float = 0.5,
                      schedule: str = "cubic", tokens: dict | None = None, config: Any = None,
                      key=None, progress: bool = False,
                      callback: Callable[[dict], None] | None = None,
                      blas_threads: int | None = 1) -> PruneResult:
    """"Less is More", Algorithm 1 (pruning part): progressive global pruning of masked weights.

    Args:
      params: a tree whose weights to prune are :class:`~lowrank_jax.leaves.ChannelMasked`
        (:func:`~lowrank_jax.compress.prune.add_channel_masks`); masks already at 0 stay
        removed.
      loss_fn: ``loss_fn(params, batch, key) -> (loss, aux)``, the mean of per-sample losses
        (a family's default loss).
      batches: ``batches(j) -> batch`` for ``j = 0..steps-1``, or an iterable of batches
        (dicts of ``[N, ...]`` arrays; fixed shapes compile once).
      target: fraction of the prunable parameters (``by='params'``) or FLOPs (``by='flops'``)
        to remove, in ``[0, 1)``. The prunable weights are the masked ones and their
        partners in attention and MLP blocks.
      steps: number of pruning batches ``B``.
      by: ``'params'`` or ``'flops'`` (needs ``tokens``).
      alpha: EMA coefficient (the paper tunes it in ``{0.1, ..., 0.8}``, Table 6).
      schedule: ``'cubic'`` or ``'linear'`` (module docstring).
      tokens: ``{path: rows per sample}`` (:func:`~lowrank_jax.leaves.count_rows` on one
        sample) for FLOP counts.
      config: the model config (refuses fixed Q/K/V activation masks on attention).
      key: PRNG key passed to the loss (default ``PRNGKey(0)``).
      progress: show progress (a bar on a terminal, plain lines elsewhere).
      callback: called with each history entry.
      blas_threads: the most threads of the host BLAS / LAPACK during the run
        (:func:`lowrank_jax.runtime.blas_threads`; ``None``: leave them as they are). One by
        default, as in :func:`~lowrank_jax.compress.apply_plan`.

    Returns:
      A :class:`PruneResult`.

    Raises:
      ConfigError: a bad ``target``, ``steps``, ``alpha``, ``by`` or ``blas_threads``;
        ``by='flops'`` without ``tokens``; a non-finite loss.
    """
    _check(target, steps, alpha, by)
    runtime.check_blas_threads(blas_threads)
    if by == "flops" and tokens is None:
        raise ConfigError("prune: by='flops' needs token counts (tokens=count_rows(...))",
                          where="tokens", expected="{path: rows}", actual=None)
    struct = Structure(params, tokens=tokens, config=config)
    masks, rest = mask_partition(params)
    paths = mask_paths(masks)
    units = UnitTable.of_masks(struct.groups, paths)
    scorer = make_scorer(loss_fn, units.sizes)
    key = jax.random.PRNGKey(0) if key is None else key
    # masks already at zero (a model pruned before) stay removed
    start = [np.asarray(m).reshape(-1, g).any(1)
             for m, g in zip(jax.tree_util.tree_leaves(masks), units.sizes, strict=True)]
    alive = np.concatenate(start) if start else np.zeros(0, bool)
    ema_flat = np.zeros(units.total, np.float64)
    measure = 0 if by == "params" else 1

    def fractions(alive_now: np.ndarray) -> tuple[Removal, float, float]:
        removal = struct.removal(units.channel_keep(alive_now))
        fp, ff = struct.fractions(removal)
        return removal, fp, ff

    it = None if callable(batches) else iter(batches)
    history = []
    bar = progress_bar(total=steps, desc="prune", unit="batch", enabled=progress)
    limit = contextlib.ExitStack()  # the BLAS thread limit, lifted in `finally`
    limit.enter_context(runtime.blas_threads(blas_threads))
    try:
        for j in range(1, steps + 1):
            batch = batches(j - 1) if it is None else next(it)
            scores, loss = scorer(masks, rest, batch, key)
            if not math.isfinite(float(loss)):
                raise ConfigError(f"prune: the loss of pruning batch {j} is {float(loss)}; check "
                                  "the data and the model", where=f"batch {j}",
                                  expected="a finite loss", actual=float(loss))
            s = np.concatenate([np.asarray(x, np.float64) for x in scores])
            ema_flat = ema(ema_flat, s, alpha)
            goal = scheduled_fraction(j, steps, float(target), schedule)
            gone = select_removed(ema_flat, alive, goal=goal,
                                  fraction=lambda a: fractions(a)[1 + measure])
            k = gone.size
            alive[gone] = False
            removal, fp, ff = fractions(alive)
            keep = units.channel_keep(alive)
            params = with_channel_masks(params, {p: (a, b) for p, (a, b) in keep.items()})
            masks, rest = mask_partition(params)
            entry = {"step": j, "loss": float(loss), "k": int(k), "scheduled": goal,
                     "params_fraction": fp, "flops_fraction": ff,
                     "removed": [units.label(u) for u in gone]}
            history.append(entry)
            if callback is not None:
                callback(entry)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss):.4f}", removed=f"{fp if not measure else ff:.3f}")
    finally:
        if bar is not None:
            bar.close()
        limit.close()
    removal, fp, ff = fractions(alive)
    return PruneResult(params=params, structure=struct, removal=removal, params_fraction=fp,
                       flops_fraction=ff, history=history,
                       ema=dict(zip(paths, units.split(ema_flat), strict=True)),
                       alive=dict(zip(paths, units.split(alive), strict=True)))


__all__ = ["MEASURES", "PruneResult", "SCHEDULES", "progressive_prune", "scheduled_fraction"]
