"""Compression of parameter trees: truncated SVD, rank schedules, path rules (seed 000 sec. 5).

Public API:

* :func:`truncated_svd` -- one matrix to a :class:`~lowrank_jax.LowRank` at ``eps`` or ``rank``
  (eq. 1: ``||W - W_r||_2 <= eps ||W||_2``).
* :func:`head_truncated_svd` -- per-head sketches, a :class:`~lowrank_jax.HeadLowRank` (eq. 20).
* :func:`project_inputs` -- data-aware ``W~ = B_r B_r^T W`` (App. D);
  :func:`compare_truncations` -- its errors next to plain SVD.
* :func:`power_schedule` (sec. 5), :func:`interpolation_schedule` (App. K),
  :func:`uniform_schedule` -- per-layer ranks.
* :func:`select`, :data:`ATTENTION_QKVO`, :data:`ATTENTION_QKV_PER_HEAD` -- path rules.
* :func:`compress` -- the tree rewrite, returning ``(new_params, CompressionReport)``.
* :func:`compare_models` -- output error, top-10 overlap and measured time of a compressed model.
"""

from lowrank_jax.compress.compress import CompressionReport, CompressionRow, compress
from lowrank_jax.compress.evaluate import compare_models, sample_inputs, top_k_jaccard
from lowrank_jax.compress.rules import (
    ATTENTION_QKV_PER_HEAD,
    ATTENTION_QKVO,
    Selection,
    normalize_rules,
    select,
)
from lowrank_jax.compress.schedules import (
    interpolation_schedule,
    power_schedule,
    uniform_schedule,
)
from lowrank_jax.compress.svd import (
    compare_truncations,
    head_truncated_svd,
    project_inputs,
    truncated_svd,
)
from lowrank_jax.compress.sweep import eps_sweep, head_rank_sweep

__all__ = [
    "compare_models", "sample_inputs", "top_k_jaccard",
    "ATTENTION_QKVO", "ATTENTION_QKV_PER_HEAD", "CompressionReport", "CompressionRow",
    "Selection", "compare_truncations", "compress", "eps_sweep", "head_rank_sweep",
    "head_truncated_svd",
    "interpolation_schedule", "normalize_rules", "power_schedule", "project_inputs", "select",
    "truncated_svd", "uniform_schedule",
]
