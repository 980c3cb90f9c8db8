"""Multi-head attention with T5 relative position bias and fixed Q/K/V activation masks.

An attention block's parameters are ``{'qk', 'v', 'o', 'heads'}``:

* ``qk``: a query-key object (:class:`~lowrank_jax.QueryKey` by default: weight leaves ``q``,
  ``k`` and per-head widths); the logits come from :func:`~lowrank_jax.attention_logits`, so a
  factorization of the joint query-key tensor plugs in without a branch here;
* ``v``, ``o``: ordinary weight leaves (any type), applied with :func:`~lowrank_jax.linear`;
* ``heads``: the static :class:`~lowrank_jax.HeadLayout` (kept head ids, value widths, scale).

Every size is read from these parameters, so each layer of a stack may have its own head count
and widths (structured pruning, per-head truncation). Heads are head-major in the projection
outputs.

The package, by job:

* :mod:`~lowrank_jax.nn.attention.block`: what the block computes (config, init,
  :func:`apply_attention`, head surgery, counts);
* :mod:`~lowrank_jax.nn.attention.core`: what every execution shares (parameter checks, masks
  and biases, the softmax, the weighted sum);
* :mod:`~lowrank_jax.nn.attention.strategies`: other executions of the same block (keys folded
  into the queries, a CPU batch in chunks), chosen by :mod:`lowrank_jax.nn.execution`;
* :mod:`~lowrank_jax.nn.attention.cache`: cached decoding;
* :mod:`~lowrank_jax.nn.attention.relative_bias`: T5's relative position bias.
"""

from lowrank_jax.nn.attention.block import (
    AttentionConfig,
    apply_attention,
    attention_score_flops,
    fold_keys,
    head_widths,
    init_attention,
    keep_heads,
)
from lowrank_jax.nn.attention.cache import (
    apply_attention_cached,
    attention_cache,
    init_attention_cache,
)
from lowrank_jax.nn.attention.core import attention_params
from lowrank_jax.nn.attention.relative_bias import (
    RelativeBiasConfig,
    init_relative_bias,
    relative_bias,
    relative_position_bucket,
)

__all__ = [
    "AttentionConfig", "RelativeBiasConfig", "apply_attention", "apply_attention_cached",
    "attention_cache", "attention_params", "attention_score_flops", "fold_keys", "head_widths",
    "init_attention", "init_attention_cache", "init_relative_bias", "keep_heads",
    "relative_bias", "relative_position_bucket",
]
