"""A frontier run: compress one model with every candidate plan, and measure each against
the dense model (:func:`frontier`)."""

from __future__ import annotations

import numbers
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from lowrank_jax import runtime
from lowrank_jax._progress import progress_bar
from lowrank_jax.compress.frontier.data import ForecastData
from lowrank_jax.compress.frontier.measure import (
    leaf_rows,
    model_flops,
    time_interleaved,
    xla_flops,
)
from lowrank_jax.compress.frontier.pareto import FrontierResult, check_budget
from lowrank_jax.compress.frontier.plans import default_candidates
from lowrank_jax.compress.plan import apply_plan
from lowrank_jax.compress.registry import Candidate
from lowrank_jax.errors import ConfigError, LowrankJaxError
from lowrank_jax.leaves import param_count, storage_bits
from lowrank_jax.models import family_of

#: Errors a candidate may raise that skip it (recorded in its row) instead of ending the run.
CANDIDATE_ERRORS = (LowrankJaxError, ValueError, TypeError, ArithmeticError,
                    np.linalg.LinAlgError)


def frontier(config: Any, params: Any, data: Any, *, candidates: Sequence[Candidate] | None = None,
             budget: float = 0.5, quick: bool = False, time_runs: int | None = None, key=None,
             progress: bool = False, methods: Sequence[str] | None = None,
             prune_data: str = "builtin", on_row: Callable[[dict], None] | None = None,
             blas_threads: int | None = 1) -> FrontierResult:
    """Compress one model every applicable way and measure size, FLOPs, time and quality
    (module docstring). Zero-shot: nothing is fine-tuned.

    Args:
      config: the model config (a registered family).
      params: the dense (uncompressed) parameters.
      data: held-out data: :class:`ForecastData`, :class:`ClassificationData` or
        :class:`OutputData`.
      candidates: the candidates (default :func:`default_candidates`).
      budget: ratio in ``(0, 1]`` for the recommendations.
      quick: default candidates at one strength; 3 timing rounds.
      time_runs: interleaved timing rounds per candidate (default 9; quick 3).
      key: PRNG key of the plans (candidate ``i`` gets ``fold_in(key, i)``; default key 0).
      progress: a bar over the candidates (on a terminal; plain lines elsewhere:
        :func:`lowrank_jax._progress.progress_bar`).
      methods: only these registered methods (default candidates only).
      prune_data: the batch source of ``prune`` candidates (default candidates only).
      on_row: called with every finished row (for logging).
      blas_threads: the most threads of the host BLAS / LAPACK during the run (the candidates'
        decompositions; :func:`lowrank_jax.runtime.blas_threads`, ``None``: leave them as they
        are). One by default, as in :func:`~lowrank_jax.compress.apply_plan`.

    Returns:
      A :class:`FrontierResult`; a candidate that failed to apply or to run has a row with
      ``error`` and no measurements.

    Raises:
      ConfigError: ``budget`` outside ``(0, 1]``, ``time_runs < 1``, ``blas_threads`` not an
        int >= 1 or None.
    """
    budget = check_budget(budget)
    runs = time_runs if time_runs is not None else (3 if quick else 9)
    if isinstance(runs, bool) or not isinstance(runs, numbers.Integral) or runs < 1:
        raise ConfigError(f"frontier: time_runs must be an int >= 1, got {runs!r}",
                          where="time_runs", expected=">= 1", actual=runs)
    runtime.check_blas_threads(blas_threads)
    with runtime.blas_threads(blas_threads):
        return _frontier(config, params, data, candidates, budget, quick, runs, key, progress,
                         methods, prune_data, on_row)


def _frontier(config, params, data, candidates, budget, quick, runs, key, progress, methods,
              prune_data, on_row) -> FrontierResult:
    """:func:`frontier` after its checks, under its BLAS thread limit."""
    skipped: dict = {}
    if candidates is None:
        candidates, skipped = default_candidates(params, config, quick=quick, methods=methods,
                                                 prune_data=prune_data)
    names = [c.name for c in candidates]
    if len(set(names)) != len(names) or "dense" in names:
        raise ConfigError("frontier: candidate names must be unique and not 'dense'",
                          where="candidates", expected="unique names", actual=names)
    key = jax.random.PRNGKey(0) if key is None else key
    fwd = data.forward(config, params)
    x = data.timing_input()
    sample = None if isinstance(data, ForecastData) else data.timing_input()
    t0 = time.perf_counter()
    dense_fn = fwd.lower(params, x).compile()
    dense_pred = data.predict(dense_fn, params)
    dense_scores = data.scores(dense_pred, config)
    rows_dense = leaf_rows(config, params, sample)
    base = {"params": param_count(params), "storage_bits": storage_bits(params),
            "flops": model_flops(config, params, rows=rows_dense),
            "xla_flops": xla_flops(dense_fn)}
    dense_row = {"name": "dense", "group": "dense", "keep": 1.0, "plan": None, **base,
                 "size_ratio": 1.0, "param_ratio": 1.0, "flop_ratio": 1.0,
                 "xla_flop_ratio": 1.0 if base["xla_flops"] else None, "time_ratio": 1.0,
                 **data.score(dense_pred, dense_scores, config), "apply_seconds": 0.0,
                 "seconds": time.perf_counter() - t0, "error": None}
    dense_ms = 1e3 * time_interleaved([lambda: dense_fn(params, x)], runs)[0]
    dense_row["time_ms"] = dense_ms
    rows = [dense_row]
    if on_row is not None:
        on_row(dense_row)
    bar = progress_bar(list(enumerate(candidates)), desc="frontier", unit="candidate",
                       enabled=progress)
    for i, cand in bar:
        bar.set_postfix_str(cand.name, refresh=True)
        t0 = time.perf_counter()
        row = {"name": cand.name, "group": cand.group, "keep": cand.keep,
               "plan": cand.plan.to_dict(), "error": None}
        try:
            new, _ = apply_plan(params, cand.plan, key=jax.random.fold_in(key, i), config=config,
                                blas_threads=None)  # frontier's own setting holds
            row["apply_seconds"] = time.perf_counter() - t0
            fn = fwd.lower(new, x).compile()
            pred = data.predict(fn, new)
            counts = {"params": param_count(new), "storage_bits": storage_bits(new),
                      "flops": model_flops(config, new, sample, rows=rows_dense),
                      "xla_flops": xla_flops(fn)}
            t_dense, t_new = time_interleaved([lambda: dense_fn(params, x),
                                               lambda fn=fn, new=new: fn(new, x)], runs)
            row.update(counts)
            row.update({
                "size_ratio": counts["storage_bits"] / base["storage_bits"],
                "param_ratio": counts["params"] / base["params"],
                "flop_ratio": counts["flops"] / max(base["flops"], 1),
                "xla_flop_ratio": (counts["xla_flops"] / base["xla_flops"]
                                   if counts["xla_flops"] and base["xla_flops"] else None),
                "time_ratio": t_new / t_dense, "time_ms": 1e3 * t_new,
                "dense_time_ms": 1e3 * t_dense,
                **data.score(pred, dense_scores, config)})
        except CANDIDATE_ERRORS as e:
            row["error"] = f"{type(e).__name__}: {e}"
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        if on_row is not None:
            on_row(row)
    bar.close()
    info = {"family": family_of(config).name, "data": getattr(data, "description", ""),
            "timing": {"runs": runs, "interleaved_with_dense": True, "statistic": "median"},
            "n_candidates": len(candidates)}
    return FrontierResult(rows, data.metric, data.higher_is_better, budget, skipped, info)


__all__ = ["CANDIDATE_ERRORS", "frontier"]
