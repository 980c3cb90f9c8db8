"""Rank analysis: eps-rank, spectra, per-layer reports, flow-of-ranks, embeddings, App. J.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility". This layer sits below :mod:`lowrank_jax.compress` (which uses its eps-rank
and head splits) and above :mod:`lowrank_jax.models`.
"""

from lowrank_jax.analysis.embedding import (
    chebyshev_embedding,
    embedding_matrix,
    embedding_rank,
    sample_patches,
)
from lowrank_jax.analysis.experiments import (
    run_appendix_j,
    spectrum_matrix,
    theorem3_experiment,
    theorem3_width_experiment,
    theorem4_experiment,
)
from lowrank_jax.analysis.rank import (
    eps_rank,
    eps_rank_from_sv,
    normalized_spectrum,
    singular_values,
)
from lowrank_jax.analysis.report import (
    ATTENTION_PATTERN,
    AnalysisReport,
    analyze,
    hidden_state_ranks,
    output_head_widths,
    weight_ranks,
)

__all__ = [
    "ATTENTION_PATTERN", "AnalysisReport", "analyze", "chebyshev_embedding", "embedding_matrix",
    "embedding_rank",
    "eps_rank", "eps_rank_from_sv", "hidden_state_ranks", "normalized_spectrum",
    "output_head_widths", "run_appendix_j", "sample_patches", "singular_values", "spectrum_matrix",
    "theorem3_experiment", "theorem3_width_experiment", "theorem4_experiment", "weight_ranks",
]
