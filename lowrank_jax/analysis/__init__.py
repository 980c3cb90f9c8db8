"""Rank analysis: eps-rank, spectra, per-layer reports, flow-of-ranks, embeddings, App. J."""

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
    AnalysisReport,
    analyze,
    hidden_state_ranks,
    weight_ranks,
)

__all__ = [
    "AnalysisReport", "analyze", "chebyshev_embedding", "embedding_matrix", "embedding_rank",
    "eps_rank", "eps_rank_from_sv", "hidden_state_ranks", "normalized_spectrum",
    "run_appendix_j", "sample_patches", "singular_values", "spectrum_matrix",
    "theorem3_experiment", "theorem3_width_experiment", "theorem4_experiment", "weight_ranks",
]
