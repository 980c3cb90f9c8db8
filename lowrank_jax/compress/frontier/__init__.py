"""Which compression should I use? Every applicable method at several strengths, measured.

:func:`frontier` compresses one model with every applicable plan method and a few
combinations of them, each at several strengths (:func:`default_candidates`; every candidate is
an ordinary :class:`~lowrank_jax.compress.Plan`), and measures for each

* its **size**: parameters (:func:`lowrank_jax.param_count`) and storage bits
  (:func:`lowrank_jax.storage_bits`; the size ratio is the ratio of storage bits, so a 1-bit
  weight counts as one bit);
* its **FLOPs**: multiply-adds of the weight leaves for one sample (each leaf's
  ``flops(rows)`` with the rows it sees, :func:`model_flops`), and XLA's count of the whole
  compiled forward (attention scores, norms and softmax included; 2 per multiply-add);
* its **time**: the jitted forward on one batch, timed interleaved with the dense model (one
  call of each per round, the order alternating), median over the rounds, as a ratio to the
  dense median; on a shared machine these ratios are noisy;
* its **quality** on held-out data: WQL and MASE of the forecast for forecasters
  (:class:`ForecastData`; geometric means over datasets relative to the dense model, as
  Chronos reports them), top-1 accuracy for classifiers (:class:`ClassificationData`; against
  the dense model's predictions when no labels are given), otherwise the relative error of the
  primary output against the dense model (:class:`OutputData`).

Results are **zero-shot**: no candidate is fine-tuned after compression (the frontier shows
what each method costs before any recovery training; fine-tuning is a separate step, see
:func:`lowrank_jax.train.fit`).

The exact Pareto frontiers (:func:`pareto_front`) of quality against the size ratio and against
the time ratio are computed, and for a budget ``B`` the best candidate whose ratio is at most
``B`` is recommended on each axis (:func:`recommend`). :func:`plot_frontier` draws them.

Each method declares its candidates in its record, beside the method
(``register_method(..., candidates=...)``, :mod:`lowrank_jax.compress.candidates`); the
combinations of methods are the table :data:`COMBINATIONS`. Which methods apply is decided by
the model's leaves: a method's candidates are made only when its rules select a node the
registered method accepts (its ``accepts`` predicate); methods that do not make one device's
model smaller (``lora``, ``factorize`` from scratch, the multi-machine ``partition`` and
``compress_keys``) are listed with the reason they were left out (their record's
``no_candidates``), and so is any registered method without candidates
(:func:`register_candidates` adds them)::

    from lowrank_jax.compress.frontier import ForecastData, frontier
    result = frontier(cfg, params, ForecastData(context, target), budget=0.5, progress=True)
    print(result.format_table())
    result.recommended("size")          # the best candidate at <= half the storage

The package by job: :mod:`.plans` (which candidates), :mod:`.data` (held-out data and
quality), :mod:`.measure` (counts and time), :mod:`.run` (:func:`frontier`), :mod:`.pareto`
(frontiers, recommendations, :class:`FrontierResult`) and :mod:`.plots`.
"""

import warnings

from lowrank_jax.compress.candidates import ATTENTION, MLP, QUICK_STRENGTHS, STRENGTHS, VALUES
from lowrank_jax.compress.frontier.data import (
    ClassificationData,
    ForecastData,
    OutputData,
    is_classifier,
)
from lowrank_jax.compress.frontier.measure import leaf_rows, model_flops, time_interleaved
from lowrank_jax.compress.frontier.pareto import (
    AXES,
    FrontierResult,
    check_budget,
    pareto_front,
    recommend,
)
from lowrank_jax.compress.frontier.plans import COMBINATIONS, Combination, default_candidates
from lowrank_jax.compress.frontier.plots import plot_frontier
from lowrank_jax.compress.frontier.run import CANDIDATE_ERRORS, frontier
from lowrank_jax.compress.registry import (
    Candidate,
    Candidates,
    CandidateSetting,
    register_candidates,
    registered_methods,
)
from lowrank_jax.errors import NotApplicableError

__all__ = [
    "AXES", "ATTENTION", "CANDIDATE_ERRORS", "COMBINATIONS", "Candidate", "CandidateSetting",
    "Candidates", "ClassificationData", "Combination", "ForecastData", "FrontierResult", "MLP",
    "NotApplicableError", "OutputData", "QUICK_STRENGTHS", "STRENGTHS", "VALUES", "check_budget",
    "default_candidates", "frontier", "is_classifier", "leaf_rows", "model_flops",
    "pareto_front", "plot_frontier", "recommend", "register_candidates", "time_interleaved",
]


def __getattr__(name: str):
    if name == "NotApplicable":  # the old private exception
        warnings.warn("lowrank_jax.compress.frontier.NotApplicable is now "
                      "lowrank_jax.errors.NotApplicableError", DeprecationWarning, stacklevel=2)
        return NotApplicableError
    if name == "NOT_CANDIDATES":  # now each method record's no_candidates
        warnings.warn("lowrank_jax.compress.frontier.NOT_CANDIDATES is now the no_candidates "
                      "of each method's record (registered_methods())", DeprecationWarning,
                      stacklevel=2)
        return {m: r.no_candidates for m, r in registered_methods().items() if r.no_candidates}
    raise AttributeError(f"module 'lowrank_jax.compress.frontier' has no attribute {name!r}")
