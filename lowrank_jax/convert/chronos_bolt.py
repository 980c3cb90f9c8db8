"""Hugging Face Chronos-Bolt checkpoints -> :mod:`lowrank_jax.models.chronos_bolt` parameters.

A ``ChronosBoltModelForForecasting`` checkpoint is a T5 encoder-decoder without LM head (its
keys are those of :func:`lowrank_jax.convert.t5.key_table`, with a 1- or 2-row ``shared``)
plus two residual blocks, ``input_patch_embedding`` and ``output_patch_embedding``, each with
``hidden_layer``, ``output_layer`` and ``residual_layer`` ``nn.Linear`` weights and biases.
Linear weights are transposed once, ``[out, in]`` -> ``[in, out]``, into ``Dense`` leaves.

Checking is strict: every missing, unexpected or mis-shaped key is reported at once in a
:class:`CheckpointError`. Keys the reference itself ignores (tied ``embed_tokens`` copies,
``lm_head.weight``, the unused cross-attention relative bias) are accepted if well-shaped.
"""

from __future__ import annotations

import numpy as np

from lowrank_jax.convert._paths import get_path, set_path
from lowrank_jax.convert.errors import CheckpointError
from lowrank_jax.convert.hf import register_family
from lowrank_jax.convert.t5 import key_table as t5_key_table
from lowrank_jax.leaves import Dense, materialize
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig

ARCHITECTURE = "ChronosBoltModelForForecasting"
_BLOCKS = ("input_patch_embedding", "output_patch_embedding")
_LAYERS = ("hidden_layer", "output_layer", "residual_layer")


def key_table(cfg: ChronosBoltConfig) -> list[tuple]:
    """``[(hf_key, tree_path, kind, hf_shape)]`` for a Chronos-Bolt model.

    ``kind``: ``'linear'`` (the weight of a ``Dense`` leaf, transposed), ``'bias'`` (its
    bias) or ``'array'`` (copied as is).
    """
    rows = list(t5_key_table(cfg.t5, untied_head=False))
    d, ff, p = cfg.t5.d_model, cfg.t5.d_ff, cfg.input_patch_size
    dims = {"input_patch_embedding": (2 * p, ff, d),
            "output_patch_embedding": (d, ff, cfg.num_quantiles * cfg.prediction_length)}
    for block in _BLOCKS:
        d_in, d_hid, d_out = dims[block]
        io = {"hidden_layer": (d_in, d_hid), "output_layer": (d_hid, d_out),
              "residual_layer": (d_in, d_out)}
        for layer in _LAYERS:
            a, b = io[layer]
            rows.append((f"{block}.{layer}.weight", (block, layer), "linear", (b, a)))
            rows.append((f"{block}.{layer}.bias", (block, layer), "bias", (b,)))
    return rows


def _optional(cfg: ChronosBoltConfig) -> dict:
    """Keys a checkpoint may carry that hold nothing the model uses (key -> expected shape)."""
    t = cfg.t5
    emb = (t.vocab_size, t.d_model)
    return {"encoder.embed_tokens.weight": emb, "decoder.embed_tokens.weight": emb,
            "lm_head.weight": None,  # reference: _keys_to_ignore_on_load_unexpected
            "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight":
                (t.relative_attention_num_buckets, t.num_heads)}


def params_from_state_dict(cfg: ChronosBoltConfig, state: dict, *,
                           source: str = "<state dict>", dtype=np.float32) -> dict:
    """Build the lowrank_jax Chronos-Bolt tree from a state dict of NumPy arrays.

    Raises:
      CheckpointError: listing every missing, unexpected and mis-shaped key with expected and
        actual shapes.
    """
    import jax.numpy as jnp

    rows = key_table(cfg)
    expected = {k: s for k, _, _, s in rows}
    optional = _optional(cfg)
    missing = {k: s for k, s in expected.items() if k not in state}
    unexpected = {k: tuple(np.shape(a)) for k, a in state.items()
                  if k not in expected and k not in optional}
    mismatched = {}
    for k, a in state.items():
        want = expected.get(k, optional.get(k))
        if want is not None and tuple(np.shape(a)) != tuple(want):
            mismatched[k] = (want, tuple(np.shape(a)))
    if missing or unexpected or mismatched:
        t = cfg.t5
        raise CheckpointError(
            source, missing=missing, unexpected=unexpected, mismatched=mismatched,
            note=(f"(Chronos-Bolt config: d_model={t.d_model}, d_kv={t.d_kv}, "
                  f"num_heads={t.num_heads}, d_ff={t.d_ff}, layers={t.num_layers}/"
                  f"{t.decoder_layers}, input_patch_size={cfg.input_patch_size}, "
                  f"prediction_length={cfg.prediction_length}, "
                  f"quantiles={len(cfg.quantiles)}, use_reg_token={cfg.use_reg_token})"))
    params: dict = {}
    dense: dict = {}  # path -> {'w', 'b'?}
    for key, path, kind, _ in rows:
        a = np.asarray(state[key], dtype=dtype)
        if kind == "linear":
            dense.setdefault(path, {})["w"] = jnp.asarray(a.T)  # [out, in] -> [in, out], once
        elif kind == "bias":
            dense.setdefault(path, {})["b"] = jnp.asarray(a)
        else:
            set_path(params, path, jnp.asarray(a))
    for path, f in dense.items():  # T5 projections carry no bias
        set_path(params, path, Dense(w=f["w"], b=f.get("b")))
    return params


def state_dict_from_params(cfg: ChronosBoltConfig, params: dict) -> dict:
    """Inverse of :func:`params_from_state_dict` (compressed leaves are materialized)."""
    out = {}
    for key, path, kind, _ in key_table(cfg):
        node = get_path(params, path)
        if kind == "linear":
            out[key] = np.asarray(materialize(node)).T.copy()  # [in, out] -> [out, in]
        elif kind == "bias":
            out[key] = np.asarray(node.b)
        else:
            out[key] = np.asarray(node)
    return out


# -- family hooks for lowrank_jax.convert.hf -----------------------------------------------

def detect(hf_config: dict) -> bool:
    """A Chronos-Bolt checkpoint: ``ChronosBoltModelForForecasting`` in ``architectures``, or a
    ``chronos_config`` with the Bolt entries ``input_patch_size`` and ``quantiles``."""
    archs = hf_config.get("architectures") or []
    cc = hf_config.get("chronos_config")
    bolt_cc = isinstance(cc, dict) and "input_patch_size" in cc and "quantiles" in cc
    return ARCHITECTURE in archs or bolt_cc


def load(hf_config: dict, state: dict, source: str):
    """``(ChronosBoltConfig, params)`` from a config dict and a state dict of NumPy arrays."""
    cfg = ChronosBoltConfig.from_hf_dict(hf_config)
    return cfg, params_from_state_dict(cfg, state, source=source)


register_family("chronos_bolt", detect, load)


def export(config: ChronosBoltConfig, params):
    """``HFExport`` for :func:`lowrank_jax.convert.save_pretrained` (the reverse of :func:`load`).

    Compressed leaves are materialized by ``state_from_rows`` and listed in the export summary.
    """
    from lowrank_jax.convert.export import HFExport, state_from_rows

    state, materialized = state_from_rows(key_table(config), params, source=type(config).__name__)
    return HFExport("chronos_bolt", config.to_hf_dict(), state, materialized)


def _register_exporter() -> None:
    from lowrank_jax.convert.export import register_exporter

    register_exporter(ChronosBoltConfig, export)


_register_exporter()
