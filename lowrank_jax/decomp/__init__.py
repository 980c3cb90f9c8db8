"""Tensor decompositions as general tools: CP-ALS and BTD-(L,L,1).

Jit-compiled, ``jax.vmap``-able over a batch of tensors, with tensorly-like signatures and the
convergence history returned:

* :func:`cp_als` (tensorly's ``parafac``: normal-equation ALS with MTTKRP, SVD or random
  initialisation, tolerance and iteration limits, line search, Tikhonov regularisation),
  :func:`cp_epc` (error-preserving correction: the smallest factors at a given error, what
  replaces the CPD-EPC of "Vision Transformer with Irregular Attention"), :func:`init_cp`,
  :func:`cp_to_tensor`, :func:`mttkrp`, :func:`unfold`;
* :func:`btd_ll1` (Algorithm 3 of that paper, initialised by its Algorithm 1,
  :func:`btd_from_cp`, or from the slices), :func:`fit_term` (its Algorithm 2),
  :func:`btd_to_tensor`.
"""

from lowrank_jax.decomp.btd import BTDResult, btd_from_cp, btd_ll1, btd_to_tensor, fit_term
from lowrank_jax.decomp.cp import CPResult, cp_als, cp_epc, cp_to_tensor, init_cp, mttkrp, unfold

__all__ = [
    "BTDResult", "CPResult", "btd_from_cp", "btd_ll1", "btd_to_tensor", "cp_als", "cp_epc",
    "cp_to_tensor", "fit_term", "init_cp", "mttkrp", "unfold",
]
