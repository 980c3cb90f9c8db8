"""Partitioning over machines with low intercommunication.

M. Thill, D. Divsalar, "Partitioning Transformer Networks with Low Intercommunication": a dense
layer is split over ``M`` machines that each own ``1/M`` of its inputs and compute ``1/M`` of
its outputs; the diagonal blocks stay exact and every machine broadcasts ``r`` numbers per token
per layer, from which the others rebuild its off-diagonal contribution (rank-``r`` SVD). The
leaf is :class:`~lowrank_jax.leaves.partitioned.Partitioned` (it runs under ``jax.shard_map``
on a mesh); this package decides and measures it:

* :mod:`.assign` -- Algorithm 1 (the box's global argmax, the default, and the prose's row
  order), its literal transcription, the LP relaxation (scipy), ``Tr M0`` / ``Tr M1``;
* :mod:`.factor` -- the off-diagonal SVDs (:func:`decompose`), the rank rule (eqs. 100-101),
  the baselines (SVD method with a central node, full rank-``M r`` SVD);
* :mod:`.counts` -- communication, storage and FLOPs, eqs. 23-62, and what is executed;
* :mod:`.bounds` -- the error and its bounds per sample, eqs. 80-94;
* :mod:`.keys` -- key compression for token-partitioned attention (sec. III.A: ``C_qk`` vs
  PCA, eqs. 123-136);
* :mod:`.hlo` -- :func:`collective_bytes`: every collective of a compiled program with its
  bytes;
* :mod:`.method` -- the ``partition`` plan method; :mod:`.keys_method` -- the
  ``compress_keys`` plan method (:class:`~lowrank_jax.leaves.partitioned.CompressedKeys`).
"""

from lowrank_jax.compress.partitioning import counts
from lowrank_jax.compress.partitioning.assign import (
    ASSIGNMENTS,
    algorithm1,
    algorithm1_literal,
    assign,
    assignment_objective,
    block_energy,
    contiguous_assignment,
    lp_assignment,
    machine_order,
    machine_traces,
)
from lowrank_jax.compress.partitioning.bounds import error_terms
from lowrank_jax.compress.partitioning.factor import (
    Decomposition,
    decompose,
    full_svd_matrix,
    rank_for_eps,
    relative_output_errors,
    svd_method_matrix,
)
from lowrank_jax.compress.partitioning.hlo import Collective, collective_bytes, format_collectives
from lowrank_jax.compress.partitioning.keys import (
    KeyBasis,
    c_k,
    c_qk,
    key_basis,
    relative_logit_errors,
)
from lowrank_jax.compress.partitioning.keys_method import compress_keys
from lowrank_jax.compress.partitioning.method import partition, partition_weights

__all__ = [
    "ASSIGNMENTS", "Collective", "Decomposition", "KeyBasis", "algorithm1", "algorithm1_literal",
    "assign", "assignment_objective", "block_energy", "c_k", "c_qk", "collective_bytes",
    "compress_keys",
    "contiguous_assignment", "counts", "decompose", "error_terms", "format_collectives",
    "full_svd_matrix", "key_basis", "lp_assignment", "machine_order", "machine_traces",
    "partition", "partition_weights", "rank_for_eps", "relative_logit_errors", "relative_output_errors",
    "svd_method_matrix",
]
