"""Structured pruning of a model: masks, Algorithm 1, physical removal, per-layer summaries.

"Less is More: Unlocking Specialization of Time Series Foundation Models via Structured
Pruning" (arXiv:2505.23195). The pipeline, each step usable on its own::

    masked = add_channel_masks(params, rules)                 # eq. 4 on the selected weights
    result = progressive_prune(masked, loss_fn, batches,      # eqs. 5-6 + EMA, Algorithm 1
                               target=0.5, steps=20)
    pruned = remove_masked(result.params)                     # physically smaller, same outputs

or in one call :func:`prune_model`. Fine-tuning the pruned model is an ordinary training run
(:func:`lowrank_jax.train.fit`), fully or with LoRA leaves (:func:`add_lora_to`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np

from lowrank_jax.compress.prune.algorithm import PruneResult, progressive_prune
from lowrank_jax.compress.prune.structure import Removal, Structure, check_removal
from lowrank_jax.compress.rules import select
from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import named_leaves, replace_paths
from lowrank_jax.leaves.channel_masked import count_rows, mask_leaf
from lowrank_jax.leaves.lora import add_lora

#: Every linear of the transformer blocks: attention q/k/v/o (self- and cross-attention) and the
#: MLP projections (the paper's pruning units cover "self-attention modules and FFNs").
DEFAULT_RULES = (r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wi_0|wi_1|wo)$")


def add_channel_masks(params: Any, rules: Sequence = DEFAULT_RULES) -> Any:
    """Wrap the weights that ``rules`` select in :class:`~lowrank_jax.leaves.ChannelMasked`
    leaves with all-one masks ("Less is More", eq. 4). The outputs do not change.

    Args:
      params: a parameter tree.
      rules: path rules (first match wins; :mod:`lowrank_jax.compress.rules`).

    Returns:
      The masked tree.
    """
    selection = select(params, rules, where="prune rules")
    return replace_paths(params, {s.path: mask_leaf(s.node) for s in selection})


def token_counts(config: Any, params: Any, *, seed: int = 0) -> dict[str, int]:
    """Rows each weight sees in one forward pass of one sample of the family's representative
    inputs (:func:`~lowrank_jax.leaves.count_rows`; nothing is computed), for FLOP counts.

    Args:
      config: the model config (of a registered family).
      params: the parameter tree.
      seed: of the representative inputs.
    """
    from lowrank_jax.models import family_of

    fam = family_of(config)
    inputs = fam.sample_inputs(config, np.random.default_rng(seed), 1)
    state = None if fam.init_state is None else fam.init_state(params, config)
    kwargs = {} if state is None else {"state": state}  # a stateful family (BatchNorm)
    return count_rows(lambda p: fam.apply(p, inputs, config, **kwargs), params)


def remove_masked(params: Any, *, config: Any = None, tokens: dict | None = None,
                  return_structure: bool = False):
    """Physically remove the channels whose masks are 0 (module docstring of
    :mod:`~lowrank_jax.compress.prune.structure`): fewer heads, narrower MLPs, narrower
    query/key and value widths, and residual-width channels as row/column slices.

    Args:
      params: a tree with :class:`~lowrank_jax.leaves.ChannelMasked` weights.
      config: the model config (refuses fixed Q/K/V activation masks on attention).
      tokens: rows per weight for FLOP counts (only used in the returned structure).
      return_structure: also return ``(structure, removal)``.

    Returns:
      The pruned tree (no masks left), or ``(pruned, structure, removal)``.
    """
    struct = Structure(params, tokens=tokens, config=config)
    removal = struct.removal_from_tree(params)
    pruned = struct.remove(removal)
    check_removal(struct, removal, pruned)
    return (pruned, struct, removal) if return_structure else pruned


def prune_model(params: Any, loss_fn: Callable, batches: Callable[[int], dict] | Iterable, *,
                target: float, steps: int, rules: Sequence = DEFAULT_RULES, by: str = "params",
                alpha: float = 0.5, schedule: str = "cubic", config: Any = None,
                tokens: dict | None = None, key=None, progress: bool = False,
                blas_threads: int | None = 1) -> tuple[Any, PruneResult]:
    """Masks, progressive global pruning and physical removal in one call ("Less is More",
    Algorithm 1 without the fine-tuning).

    Args:
      params: the model's parameters.
      loss_fn: ``loss_fn(params, batch, key) -> (loss, aux)`` (mean of per-sample losses).
      batches: ``batches(j) -> batch`` or an iterable of batches.
      target, steps, by, alpha, schedule, key, progress, blas_threads: see
        :func:`~lowrank_jax.compress.prune.progressive_prune`.
      rules: which weights get masks (default: every attention and MLP projection).
      config: the model config; with it and ``by='flops'`` the token counts are taken from
        the family's representative inputs.
      tokens: rows per weight per sample (overrides the above).

    Returns:
      ``(pruned params, PruneResult)``.
    """
    masked = add_channel_masks(params, rules)
    if tokens is None and config is not None:
        tokens = token_counts(config, params)
    if by == "flops" and tokens is None:
        raise ConfigError("prune_model: by='flops' needs config= (or tokens=)", where="by",
                          expected="config or tokens", actual=None)
    result = progressive_prune(masked, loss_fn, batches, target=target, steps=steps, by=by,
                               alpha=alpha, schedule=schedule, tokens=tokens, config=config,
                               key=key, progress=progress, blas_threads=blas_threads)
    pruned = result.structure.remove(result.removal)
    check_removal(result.structure, result.removal, pruned)
    return pruned, result


def add_lora_to(params: Any, rules: Sequence, *, rank: int, key, alpha: float | None = None
                ) -> Any:
    """Put a LoRA update (:func:`~lowrank_jax.leaves.add_lora`) on the weights ``rules``
    select: the base weights are frozen, only the updates train (the tuning of "Less is
    More", App. C.2, Table 7: the update's shape is the pruned weight's remaining shape).

    Args:
      params: a parameter tree (pruned or not).
      rules: path rules.
      rank: the updates' rank.
      key: PRNG key.
      alpha: LoRA's ``alpha`` (default: the rank, scale 1).
    """
    selection = select(params, rules, where="lora rules")
    keys = jax.random.split(key, max(len(selection), 1))
    return replace_paths(params, {s.path: add_lora(k, s.node, rank, alpha=alpha)
                                  for s, k in zip(selection, keys, strict=False)})


def layer_table(struct: Structure, removal: Removal) -> list[dict]:
    """Per-block and per-weight summary of a removal (the CLI's table, the JSON report and
    the paper's Fig. 6).

    Returns:
      One dict per attention block (``kind='attention'``: ``heads`` kept / total, kept head
      ``ids``, ``qk`` and ``v`` channels kept / total, per kept head ``qk_widths`` and
      ``v_widths``), per MLP block (``kind='mlp'``: ``hidden`` kept / total) and per weight
      (``kind='weight'``: ``in_kept``, ``d_in``, ``out_kept``, ``d_out``,
      ``in_pruned_fraction``, ``out_pruned_fraction``).
    """
    rows = []
    for a in struct.attention:
        hk = removal.heads[a.path]
        ids = [a.heads.ids[h] for h in np.flatnonzero(hk)]
        entry = {"kind": "attention", "path": a.path, "heads": int(hk.sum()),
                 "heads_total": int(hk.size), "ids": ids,
                 "v": int(removal.vo[a.path].sum()), "v_total": int(removal.vo[a.path].size)}
        off = np.concatenate([[0], np.cumsum(a.heads.v)])
        entry["v_widths"] = [int(removal.vo[a.path][off[h]:off[h + 1]].sum())
                             for h in np.flatnonzero(hk)]
        if a.query_key:
            qo = np.concatenate([[0], np.cumsum(a.qk_widths)])
            entry["qk"] = int(removal.qk[a.path].sum())
            entry["qk_total"] = int(removal.qk[a.path].size)
            entry["qk_widths"] = [int(removal.qk[a.path][qo[h]:qo[h + 1]].sum())
                                  for h in np.flatnonzero(hk)]
        rows.append(entry)
    for b in struct.mlp:
        h = removal.hidden[b.path]
        rows.append({"kind": "mlp", "path": b.path, "hidden": int(h.sum()),
                     "hidden_total": int(h.size)})
    for p, m in struct.members.items():
        r, c = removal.rows[p], removal.cols[p]
        rows.append({"kind": "weight", "path": p, "masked": m.masked, "in_kept": int(r.sum()),
                     "d_in": int(r.size), "out_kept": int(c.sum()), "d_out": int(c.size),
                     "in_pruned_fraction": 1.0 - float(r.mean()) if r.size else 0.0,
                     "out_pruned_fraction": 1.0 - float(c.mean()) if c.size else 0.0})
    return rows


def masked_weights(params: Any) -> list[str]:
    """Paths of the :class:`~lowrank_jax.leaves.ChannelMasked` weights of a tree."""
    from lowrank_jax.leaves.channel_masked import is_channel_masked

    return [p for p, n in named_leaves(params) if is_channel_masked(n)]


__all__ = ["DEFAULT_RULES", "add_channel_masks", "add_lora_to", "layer_table", "masked_weights",
           "prune_model", "remove_masked", "token_counts"]
