"""Structured pruning, then fine-tuning: "Less is More: Unlocking Specialization of Time Series
Foundation Models via Structured Pruning" (Zhao et al., NeurIPS 2025, arXiv:2505.23195).

* :func:`add_channel_masks` -- input/output channel masks on the selected weights (eq. 4,
  :class:`~lowrank_jax.leaves.ChannelMasked`), kept out of the optimizer;
* :class:`PruneGroup` / :class:`Span` -- channels removed together across the weights they
  span (attention query/key and value/output channel pairs, MLP hidden channels, residual
  channels; declared Flax channel groups): the one description of prunable structure, for the
  plan method and the Flax interop (:mod:`lowrank_jax.interop.channel_groups`);
* :func:`importance`, :func:`batch_importance`, :func:`mask_scorer`, :func:`make_scorer`,
  :func:`ema` -- per-sample mask gradients (``vmap``) and the Taylor/Fisher importance of
  eqs. 5-6, averaged over the batch, with its EMA over batches;
* :func:`select_removed` -- the one ranking: the lowest-scored alive units, globally across
  layers, the fewest that reach a removed fraction of a budget, with per-group minimums;
* :func:`progressive_prune` -- Algorithm 1: global ranking across layers, ``K`` units per batch
  on a documented schedule (:func:`scheduled_fraction`) until a target fraction of the
  parameters or FLOPs is removed;
* :func:`remove_masked` / :class:`Structure` -- physical removal by dependency groups (q/k and
  v/o channel pairs, heads, MLP hidden channels with both gates; residual-width channels as
  :class:`~lowrank_jax.leaves.ChannelPruned` slices), with the same outputs as the masked model;
* :func:`prune_model` -- the three in one call; :func:`add_lora_to` -- LoRA updates for
  fine-tuning (:class:`~lowrank_jax.leaves.LoRA`);
* the ``prune`` and ``lora`` plan methods (:mod:`~lowrank_jax.compress.prune.method`).
"""

from lowrank_jax.compress.prune.algorithm import (
    MEASURES,
    SCHEDULES,
    PruneResult,
    progressive_prune,
    scheduled_fraction,
)
from lowrank_jax.compress.prune.api import (
    DEFAULT_RULES,
    add_channel_masks,
    add_lora_to,
    layer_table,
    masked_weights,
    prune_model,
    remove_masked,
    token_counts,
)
from lowrank_jax.compress.prune.groups import (
    SCOPES,
    PruneGroup,
    Span,
    UnitTable,
    additive_fraction,
    select_removed,
)
from lowrank_jax.compress.prune.importance import (
    batch_importance,
    ema,
    importance,
    make_scorer,
    mask_paths,
    mask_scorer,
    unit_gradients,
)
from lowrank_jax.compress.prune.method import (  # registers the prune and lora plan methods
    builtin_batches,
    register_batches,
)
from lowrank_jax.compress.prune.structure import (
    Removal,
    Structure,
    attention_with_activation_masks,
    check_removal,
    find_blocks,
)

__all__ = [
    "DEFAULT_RULES", "MEASURES", "SCHEDULES", "SCOPES", "PruneGroup", "PruneResult", "Removal",
    "Span", "Structure", "UnitTable",
    "add_channel_masks", "add_lora_to", "additive_fraction", "attention_with_activation_masks",
    "batch_importance", "builtin_batches", "register_batches",
    "check_removal", "ema", "find_blocks", "importance", "layer_table", "make_scorer",
    "mask_paths", "mask_scorer", "masked_weights", "progressive_prune", "prune_model",
    "remove_masked", "scheduled_fraction", "select_removed", "token_counts", "unit_gradients",
]
