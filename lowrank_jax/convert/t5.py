"""Hugging Face T5 state dict <-> lowrank_jax T5 parameter tree.

One table (:func:`key_table`) lists every Hugging Face key, where it lives in the lowrank_jax
tree, and its PyTorch shape; loading and saving both read it. Linear weights are transposed
once, PyTorch ``[out, in]`` -> Flax ``[in, out]``, and wrapped in ``Dense`` leaves.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from lowrank_jax.convert._paths import get_path, set_path
from lowrank_jax.convert.errors import CheckpointError
from lowrank_jax.convert.hf import register_family
from lowrank_jax.leaves import Dense, materialize
from lowrank_jax.models.chronos import ChronosConfig
from lowrank_jax.models.t5 import T5Config

# Keys Hugging Face may write that carry no extra information: tied copies of ``shared`` and a
# never-used cross-attention bias (HF's ``_keys_to_ignore_on_load_unexpected``).
_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


def key_table(cfg: T5Config, *, untied_head: bool | None = None) -> list[tuple]:
    """``[(hf_key, tree_path, kind, hf_shape)]`` for a T5 model.

    ``kind`` is ``'linear'`` (a ``Dense`` leaf, stored transposed in HF) or ``'array'`` (copied
    as is: embeddings, relative-bias tables ``[buckets, heads]``, norm scales).
    """
    untied = (not cfg.tie_word_embeddings) if untied_head is None else untied_head
    d, inner, ff, v = cfg.d_model, cfg.num_heads * cfg.d_kv, cfg.d_ff, cfg.vocab_size
    rel = (cfg.relative_attention_num_buckets, cfg.num_heads)
    mlp_names = ("wi_0", "wi_1", "wo") if cfg.is_gated else ("wi", "wo")
    rows: list[tuple] = [("shared.weight", ("shared",), "array", (v, d))]

    def attn(prefix, path):
        for n in ("q", "k", "v"):
            rows.append((f"{prefix}.{n}.weight", path + (n,), "linear", (inner, d)))
        rows.append((f"{prefix}.o.weight", path + ("o",), "linear", (d, inner)))

    def mlp(prefix, path):
        for n in mlp_names:
            shape = (d, ff) if n == "wo" else (ff, d)
            rows.append((f"{prefix}.DenseReluDense.{n}.weight", path + (n,), "linear", shape))

    def norm(key, path):
        rows.append((key, path + ("scale",), "array", (d,)))

    for i in range(cfg.num_layers):
        b, p = f"encoder.block.{i}", ("encoder", "layers", i)
        attn(f"{b}.layer.0.SelfAttention", p + ("attn",))
        norm(f"{b}.layer.0.layer_norm.weight", p + ("attn_norm",))
        mlp(f"{b}.layer.1", p + ("mlp",))
        norm(f"{b}.layer.1.layer_norm.weight", p + ("mlp_norm",))
    rows.append(("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 ("encoder", "rel_bias"), "array", rel))
    norm("encoder.final_layer_norm.weight", ("encoder", "final_norm"))

    for i in range(cfg.decoder_layers):
        b, p = f"decoder.block.{i}", ("decoder", "layers", i)
        attn(f"{b}.layer.0.SelfAttention", p + ("self_attn",))
        norm(f"{b}.layer.0.layer_norm.weight", p + ("self_attn_norm",))
        attn(f"{b}.layer.1.EncDecAttention", p + ("cross_attn",))
        norm(f"{b}.layer.1.layer_norm.weight", p + ("cross_attn_norm",))
        mlp(f"{b}.layer.2", p + ("mlp",))
        norm(f"{b}.layer.2.layer_norm.weight", p + ("mlp_norm",))
    rows.append(("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 ("decoder", "rel_bias"), "array", rel))
    norm("decoder.final_layer_norm.weight", ("decoder", "final_norm"))
    if untied:
        rows.append(("lm_head.weight", ("lm_head",), "linear", (v, d)))
    return rows


def resolve_head(cfg: T5Config, state: dict) -> T5Config:
    """Decide tied vs untied head from the weights as well as the config.

    transformers >= 5 always writes ``tie_word_embeddings: true`` (and a separate
    ``scale_decoder_outputs``), while older T5 v1.1 checkpoints store ``tie_word_embeddings:
    false`` and a distinct ``lm_head.weight``. A state dict from an in-memory tied module also
    carries ``lm_head.weight``, equal to ``shared.weight``. So: an ``lm_head.weight`` that
    differs from ``shared.weight`` means an untied head, whatever the config says (the decoder
    scaling is unaffected: it is ``scale_decoder_outputs``).
    """
    head, shared = state.get("lm_head.weight"), state.get("shared.weight")
    if cfg.tie_word_embeddings and head is not None and shared is not None:
        if head.shape != shared.shape or not np.array_equal(head, shared):
            return dataclasses.replace(cfg, tie_word_embeddings=False,
                                       scale_decoder_outputs=cfg.scales_decoder_outputs)
    return cfg


def params_from_state_dict(cfg: T5Config, state: dict, *, source: str = "<state dict>",
                           dtype=np.float32) -> dict:
    """Build the lowrank_jax T5 tree from a Hugging Face state dict of NumPy arrays.

    Args:
      cfg: model configuration (after :func:`resolve_head`).
      state: ``{hf_key: np.ndarray}``.
      source: named in errors.
      dtype: dtype of the returned arrays.

    Returns:
      The parameter tree (``Dense`` leaves, ``[d_in, d_out]``).

    Raises:
      CheckpointError: listing every missing, unexpected and mis-shaped key.
    """
    rows = key_table(cfg)
    expected = {k: shape for k, _, _, shape in rows}
    optional = {k: (cfg.vocab_size, cfg.d_model) for k in _TIED_COPIES}
    if cfg.tie_word_embeddings:
        optional["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    missing = {k: s for k, s in expected.items() if k not in state}
    unexpected = {k: tuple(a.shape) for k, a in state.items()
                  if k not in expected and k not in optional and k not in _IGNORED}
    mismatched = {}
    for k, a in state.items():
        want = expected.get(k, optional.get(k))
        if want is not None and tuple(a.shape) != tuple(want):
            mismatched[k] = (want, tuple(a.shape))
    if missing or unexpected or mismatched:
        raise CheckpointError(source, missing=missing, unexpected=unexpected,
                              mismatched=mismatched,
                              note=f"(T5 config: d_model={cfg.d_model}, d_kv={cfg.d_kv}, "
                                   f"num_heads={cfg.num_heads}, d_ff={cfg.d_ff}, "
                                   f"layers={cfg.num_layers}/{cfg.decoder_layers}, "
                                   f"feed_forward_proj={cfg.feed_forward_proj!r})")
    params: dict = {}
    for key, path, kind, _ in rows:
        a = np.asarray(state[key], dtype=dtype)
        if kind == "linear":
            set_path(params, path, Dense(w=jnp.asarray(a.T)))  # [out, in] -> [in, out], once
        else:
            set_path(params, path, jnp.asarray(a))
    return params


def state_dict_from_params(cfg: T5Config, params: dict) -> dict:
    """Inverse of :func:`params_from_state_dict`: a Hugging Face state dict of NumPy arrays.

    Compressed leaves are materialized (explicitly, with :func:`~lowrank_jax.materialize`),
    since Hugging Face T5 stores dense matrices. Only canonical keys are written (no tied
    copies), as ``save_pretrained`` does.
    """
    out = {}
    for key, path, kind, _ in key_table(cfg):
        node = get_path(params, path)
        if kind == "linear":
            out[key] = np.asarray(materialize(node)).T.copy()  # [in, out] -> [out, in]
        else:
            out[key] = np.asarray(node)
    return out


# -- family hooks for lowrank_jax.convert.hf -----------------------------------------------

def detect(hf_config: dict) -> bool:
    """A plain T5 checkpoint (Chronos checkpoints are T5 too but have ``chronos_config``)."""
    archs = hf_config.get("architectures") or []
    is_t5 = hf_config.get("model_type") == "t5" or any(a.startswith("T5") for a in archs)
    return is_t5 and "chronos_config" not in hf_config


def load(hf_config: dict, state: dict, source: str):
    """``(T5Config, params)`` from a config dict and a state dict of NumPy arrays."""
    cfg = resolve_head(T5Config.from_hf_dict(hf_config), state)
    return cfg, params_from_state_dict(cfg, state, source=source)


def detect_chronos(hf_config: dict) -> bool:
    """A Chronos (T5) checkpoint: a T5 config with a ``chronos_config`` entry (not Bolt's)."""
    chronos_cfg = hf_config.get("chronos_config") or {}
    return (
        "chronos_config" in hf_config and hf_config.get("model_type", "t5") == "t5"
        and "input_patch_size" not in chronos_cfg
        and "ChronosBoltModelForForecasting" not in (hf_config.get("architectures") or [])
    )


def load_chronos(hf_config: dict, state: dict, source: str):
    """``(ChronosConfig, params)``: the T5 weights plus the tokenizer settings."""
    t5_cfg, params = load(hf_config, state, source)
    return ChronosConfig.from_hf_dict(hf_config, t5=t5_cfg), params


register_family("t5", detect, load)
register_family("chronos", detect_chronos, load_chronos)
