"""lowrank_jax: a functional JAX library for compressed transformers.

Parameter trees hold *leaves* (:class:`Dense`, :class:`LowRank`, :class:`HeadLowRank`,
:class:`MaskedBinary`, ...); every block computes ``x @ W`` through :func:`linear` and attention
logits through :func:`attention_logits` on a query-key object (:class:`QueryKey`, ...).
Surgery is a :class:`Plan` applied with :func:`apply_plan` (the ``lowrank_jax.compress``
package holds the methods and the convenience ``compress.compress`` for truncated SVD). The
documentation's design notes describe the layers of the package: ``errors``, ``leaves``,
``nn``, ``models``, ``analysis``, ``compress``, ``io``, ``train``, ``convert``, ``cli``.

``__version__`` is the installed distribution's version (``lowrank-jax`` in the package
metadata), so it cannot disagree with ``pyproject.toml``; ``"unknown"`` when the package runs
from a checkout that was never installed.
"""

import importlib.metadata as _metadata

from lowrank_jax import runtime as _runtime
from lowrank_jax.analysis import analyze, eps_rank
from lowrank_jax.compress import (
    Plan,
    Step,
    apply_plan,
    factorize_init,
    head_truncated_svd,
    project_inputs,
    truncated_svd,
)
from lowrank_jax.leaves import (
    QK,
    BTDQueryKey,
    CPQueryKey,
    Dense,
    FrozenBinary,
    HeadLayout,
    HeadLowRank,
    Leaf,
    LowRank,
    MaskedBinary,
    QueryKey,
    attention_logits,
    combine,
    flops,
    init_dense,
    init_head_lowrank,
    init_lowrank,
    init_masked_binary,
    is_leaf,
    keep_inputs,
    keep_outputs,
    leaf_dataclass,
    linear,
    map_with_path,
    materialize,
    materialize_host,
    named_leaves,
    param_count,
    partition,
    partition_specs,
    storage_bits,
    trainable_mask,
)

_runtime.apply_env()  # LOWRANK_JAX_KEEP_FREED_MEMORY=1: keep freed memory (lowrank_jax.runtime)

try:
    __version__ = _metadata.version("lowrank-jax")
except _metadata.PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "unknown"

__all__ = [
    "BTDQueryKey", "CPQueryKey",
    "QK", "Dense", "FrozenBinary", "HeadLayout", "HeadLowRank", "Leaf", "LowRank",
    "MaskedBinary", "Plan", "QueryKey", "Step", "analyze", "apply_plan", "attention_logits",
    "combine", "eps_rank", "factorize_init",
    "flops", "head_truncated_svd", "init_dense", "init_head_lowrank", "init_lowrank",
    "init_masked_binary", "is_leaf", "keep_inputs", "keep_outputs", "leaf_dataclass", "linear",
    "map_with_path", "materialize", "materialize_host", "named_leaves", "param_count",
    "partition", "partition_specs", "project_inputs", "storage_bits", "trainable_mask",
    "truncated_svd",
]
