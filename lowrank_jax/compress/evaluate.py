"""How much a compression changed a model: output error, top-10 overlap, measured time.

:func:`compare_models` runs the original and the compressed parameters of one model on the same
inputs (the family's representative inputs, :func:`sample_inputs`, unless given) and reports,
next to the parameter and FLOP ratios:

* ``max_abs_error`` and ``rel_error`` (Frobenius) of the family's primary output
  (:attr:`lowrank_jax.models.ModelFamily.primary_outputs`), both forwards run under
  :func:`lowrank_jax.execution.reference_precision` (full float32 products on every backend;
  a GPU's default TF32 alone would put about 1e-3 into them);
* ``top10_jaccard`` for families whose primary output is a distribution over tokens (T5,
  Chronos): per position, the Jaccard overlap of the top-10 tokens of the two models, averaged
  ("Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
  Compressibility", Table 2, "Overlap");
* ``time_ratio``: median compressed / median original forward time, both jitted, measured
  interleaved in one run (:func:`lowrank_jax.timing.time_interleaved`: the order alternates
  every round) so machine noise hits both alike, at the precision active where
  :func:`compare_models` is called (the backend's default unless set);
  ``time_ratio_quartiles``, the 25th and 75th percentiles of the per-run ratios (compressed /
  original call of the same round), show how far apart single measurements fall: a range that
  holds 1 means no measurable difference.

Everything family-specific comes from the family record (:func:`lowrank_jax.models.family_of`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from lowrank_jax.execution import reference_precision
from lowrank_jax.leaves import flops, param_count
from lowrank_jax.models import apply as model_apply
from lowrank_jax.models import family_of, primary_output
from lowrank_jax.timing import time_interleaved

#: ``models.apply`` jitted once per (config, tree structure): repeated comparisons of one model
#: reuse the compiled forward.
_forward = jax.jit(model_apply, static_argnums=(2,))


def sample_inputs(config: Any, *, batch: int = 8, seed: int = 0) -> dict:
    """Representative inputs for ``config``'s model family (its ``sample_inputs``; real series
    for forecasters).

    Args:
      config: a model config of a registered family.
      batch: batch size.
      seed: NumPy seed.

    Returns:
      The inputs dict ``models.apply`` takes.
    """
    return family_of(config).sample_inputs(config, np.random.default_rng(seed), batch)


def top_k_jaccard(a, b, k: int = 10) -> float:
    """Mean over positions of ``|top_k(a) & top_k(b)| / |top_k(a) | top_k(b)|`` (last axis)."""
    a = np.asarray(a).reshape(-1, np.shape(a)[-1])
    b = np.asarray(b).reshape(-1, np.shape(b)[-1])
    ta = np.argpartition(-a, k - 1, axis=-1)[:, :k]
    tb = np.argpartition(-b, k - 1, axis=-1)[:, :k]
    scores = []
    for x, y in zip(ta, tb, strict=True):
        sx, sy = set(x.tolist()), set(y.tolist())
        scores.append(len(sx & sy) / len(sx | sy))
    return float(np.mean(scores))


def token_count(inputs: dict) -> int:
    """Tokens in a batch of inputs: batch times length of the first input (for FLOP ratios)."""
    for v in inputs.values():
        return int(np.prod(np.shape(v)[:2]))
    return 0


def compare_models(config: Any, params: Any, new_params: Any, *, inputs: dict | None = None,
                   time_runs: int = 20, measure_time: bool = True) -> dict:
    """Compare a compressed model with the original on the same inputs.

    Args:
      config: the model config (any registered family).
      params: original parameters.
      new_params: compressed parameters of the same model.
      inputs: model inputs (default :func:`sample_inputs`).
      time_runs: timed forward calls of each model (median reported), at least 1.
      measure_time: set ``False`` to skip timing (tests).

    Returns:
      A dict: ``output`` (the primary output's name), ``max_abs_error``, ``rel_error``,
      ``top10_jaccard`` (token families), ``param_ratio``, ``flop_ratio`` (weight leaves, for
      the batch's tokens); when timed also ``time_ratio``, ``time_ratio_quartiles`` (module
      docstring), ``time_runs`` and ``time_ms``.
    """
    family = family_of(config)
    inputs = sample_inputs(config) if inputs is None else inputs
    def fwd(p, inp):
        return _forward(p, inp, config)

    with reference_precision():  # the error in full float32 on any backend (not TF32's)
        ref = fwd(params, inputs)
        new = fwd(new_params, inputs)
    key = primary_output(family, ref)
    a, b = np.asarray(ref[key], np.float64), np.asarray(new[key], np.float64)
    n_tok = token_count(inputs)
    out = {
        "output": key,
        "max_abs_error": float(np.max(np.abs(a - b))),
        "rel_error": float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)),
        "param_ratio": param_count(new_params) / param_count(params),
        "flop_ratio": flops(new_params, n_tok) / max(flops(params, n_tok), 1),
    }
    if family.token_outputs:
        out["top10_jaccard"] = top_k_jaccard(a, b, 10)
    if measure_time:  # interleaved (lowrank_jax.timing): noise hits both; compiled above
        t = time_interleaved({"original": lambda: jax.block_until_ready(fwd(params, inputs)),
                              "compressed": lambda: jax.block_until_ready(fwd(new_params, inputs))},
                             runs=time_runs, warmup=0)
        ratio = t.ratio("compressed", "original")
        out["time_ratio"] = ratio.value
        out["time_ratio_quartiles"] = [ratio.paired.q25, ratio.paired.q75]
        out["time_runs"] = int(time_runs)
        out["time_ms"] = {
            "original": 1e3 * t.median("original"),
            "compressed": 1e3 * t.median("compressed"),
        }
    return out


__all__ = ["compare_models", "sample_inputs", "token_count", "top_k_jaccard"]
