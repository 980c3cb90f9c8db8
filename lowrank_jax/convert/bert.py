"""Hugging Face BERT checkpoints -> :mod:`lowrank_jax.models.bert` parameters.

Handles ``BertModel`` (with or without pooler; keys with or without the ``bert.`` prefix) and
``BertForSequenceClassification``. Checking is strict: every missing, unexpected or mis-shaped key
is reported at once in a :class:`CheckpointError` (so the heads of ``BertForMaskedLM`` or
``BertForPreTraining`` are reported as unexpected rather than silently dropped). The
``embeddings.position_ids`` buffer that old files store is ignored: it is ``arange``, not a
parameter. PyTorch ``Linear`` weights are transposed to ``[in, out]`` here.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from lowrank_jax.convert.hf import register_family
from lowrank_jax.convert.vit import (
    TensorSpec,
    encoder_specs,
    layer_norm_specs,
    linear_specs,
    params_from_specs,
)
from lowrank_jax.models.bert import BertConfig

_IGNORED_SUFFIXES = ("embeddings.position_ids",)


def detect(hf_config: Mapping) -> bool:
    """Whether a ``config.json`` dict describes a BERT model."""
    return hf_config.get("model_type") == "bert"


def checkpoint_specs(cfg: BertConfig, *, prefixed: bool = True) -> list[TensorSpec]:
    """Every tensor of the HF checkpoint of ``cfg``.

    Args:
      cfg: model configuration.
      prefixed: base-model keys start with ``bert.`` (always, with a classification head).

    Returns:
      The specs, keys as ``save_pretrained`` writes them.
    """
    base = "bert." if (prefixed or cfg.num_labels > 0) else ""
    d = cfg.hidden_size
    e = f"{base}embeddings."
    specs = [
        TensorSpec(f"{e}word_embeddings.weight", (cfg.vocab_size, d), ("embeddings", "word")),
        TensorSpec(f"{e}position_embeddings.weight", (cfg.max_position_embeddings, d),
                   ("embeddings", "position")),
        TensorSpec(f"{e}token_type_embeddings.weight", (cfg.type_vocab_size, d),
                   ("embeddings", "token_type")),
    ]
    specs += layer_norm_specs(f"{e}LayerNorm", d, ("embeddings", "norm"))
    specs += encoder_specs(cfg, base, prenorm=False)
    if cfg.pooler:
        specs += linear_specs(f"{base}pooler.dense", d, d, ("pooler",))
    if cfg.num_labels > 0:
        specs += linear_specs("classifier", d, cfg.num_labels, ("classifier",))
    return specs


def load(hf_config: Mapping, state_dict: Mapping[str, object],
         source: str = "<state dict>") -> tuple[BertConfig, dict]:
    """BERT config and parameters from a ``config.json`` dict and a state dict.

    For a base model the pooler is loaded iff the checkpoint has ``pooler.dense`` keys
    (``add_pooling_layer`` is not in ``config.json``).

    Args:
      hf_config: parsed ``config.json``.
      state_dict: checkpoint key -> array.
      source: named in errors.

    Returns:
      ``(BertConfig, params)``.

    Raises:
      CheckpointError: on missing, unexpected or mis-shaped keys (all listed).
    """
    cfg = BertConfig.from_hf_dict(dict(hf_config))
    keys = list(state_dict)
    if cfg.num_labels == 0 and not any(k.endswith("pooler.dense.weight") for k in keys):
        cfg = dataclasses.replace(cfg, pooler=False)
    prefixed = any(k.startswith("bert.") for k in keys)
    specs = checkpoint_specs(cfg, prefixed=prefixed)
    params = params_from_specs(specs, state_dict, source=source,
                               ignore=lambda k: k.endswith(_IGNORED_SUFFIXES))
    return cfg, params


register_family("bert", detect, load)
