"""Hugging Face ViT / DeiT checkpoints -> :mod:`lowrank_jax.models.vit` parameters.

Handles the checkpoints of ``ViTModel``, ``ViTForImageClassification``, ``DeiTModel``,
``DeiTForImageClassification`` and ``DeiTForImageClassificationWithTeacher``, with or without
the ``vit.``/``deit.`` prefix of the base model, in the key names ``save_pretrained`` writes
(``encoder.layer.0.attention.attention.query.weight``) and in those of the in-memory modules of
transformers 5.x (``layers.0.attention.q_proj.weight``). Checking is strict: every missing,
unexpected or mis-shaped key is reported at once in a :class:`CheckpointError`.

PyTorch ``Linear`` weights ``[out, in]`` are transposed to ``[in, out]`` once, here; the patch
convolution ``[d, C, p, p]`` becomes a ``[C*p*p, d]`` leaf (see
:func:`lowrank_jax.models.vit.patchify`).

This module also holds the small key-mapping machinery shared with :mod:`.bert`
(:class:`TensorSpec`, :func:`params_from_specs`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping

import numpy as np

from lowrank_jax.convert.errors import CheckpointError
from lowrank_jax.convert.hf import register_family
from lowrank_jax.leaves import Dense
from lowrank_jax.models.vit import ViTConfig

# ---------------------------------------------------------------------------------------------
# Shared machinery: a checkpoint is described by a list of TensorSpecs.


def _identity(a: np.ndarray) -> np.ndarray:
    return a


def _transpose(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint and where it goes in the parameter tree.

    Attributes:
      key: full checkpoint key (prefix included).
      shape: expected shape in the checkpoint (PyTorch orientation).
      path: position in the params tree; ints index lists (``('encoder', 'layers', 0, ...)``).
      field: ``'w'`` or ``'b'`` of a :class:`~lowrank_jax.Dense` leaf at ``path``, or ``None``
        for a raw array stored at ``path``.
      transform: checkpoint array -> stored array (e.g. transpose).
    """

    key: str
    shape: tuple[int, ...]
    path: tuple
    field: str | None = None
    transform: Callable[[np.ndarray], np.ndarray] = _identity


def linear_specs(key: str, d_in: int, d_out: int, path: tuple, *,
                 bias: bool = True) -> list[TensorSpec]:
    """Specs of a PyTorch ``nn.Linear(d_in, d_out)`` at ``key``: a Dense leaf ``[d_in, d_out]``."""
    out = [TensorSpec(f"{key}.weight", (d_out, d_in), path, "w", _transpose)]
    if bias:
        out.append(TensorSpec(f"{key}.bias", (d_out,), path, "b"))
    return out


def layer_norm_specs(key: str, d: int, path: tuple) -> list[TensorSpec]:
    """Specs of a PyTorch ``nn.LayerNorm(d)`` -> ``{'scale', 'bias'}`` at ``path``."""
    return [TensorSpec(f"{key}.weight", (d,), path + ("scale",)),
            TensorSpec(f"{key}.bias", (d,), path + ("bias",))]


def _to_numpy(v) -> np.ndarray:
    # Arrays from safetensors (numpy) pass through; torch tensors (pytorch_model.bin) are
    # converted without importing torch here.
    if type(v).__module__.startswith("torch"):
        v = v.detach().cpu().float().numpy()
    return np.asarray(v, dtype=np.float32)


def _listify(tree):
    if isinstance(tree, dict):
        tree = {k: _listify(v) for k, v in tree.items()}
        if tree and all(isinstance(k, int) for k in tree):
            return [tree[i] for i in range(len(tree))]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def params_from_specs(specs: list[TensorSpec], state_dict: Mapping[str, object], *,
                      source: str = "<state dict>", aliases: Mapping[str, str] | None = None,
                      ignore: Callable[[str], bool] | None = None,
                      zero_bias: tuple[tuple, ...] = ()) -> dict:
    """Check a state dict against ``specs`` and build the parameter tree.

    Args:
      specs: every tensor the model needs.
      state_dict: checkpoint key -> array (NumPy or torch).
      source: named in the error message (a file path, ...).
      aliases: checkpoint key -> spec key, for keys stored under another name; errors still
        name the key as it appears in the checkpoint.
      ignore: keys for which this is true are dropped (non-persistent buffers of old files).
      zero_bias: paths of Dense leaves whose bias is absent in the checkpoint and is zero.

    Returns:
      The parameter tree (lists where paths hold ints).

    Raises:
      CheckpointError: naming every missing, unexpected and mis-shaped key.
    """
    aliases = aliases or {}
    by_key = {s.key: s for s in specs}
    found: dict[str, tuple[str, object]] = {}  # spec key -> (checkpoint key, value)
    unexpected, mismatched = {}, {}
    for ck, v in state_dict.items():
        if ignore is not None and ignore(ck):
            continue
        key = aliases.get(ck, ck)
        shape = tuple(int(d) for d in np.shape(v))
        if key not in by_key or key in found:
            unexpected[ck] = shape
            continue
        found[key] = (ck, v)
        if shape != by_key[key].shape:
            mismatched[ck] = (by_key[key].shape, shape)
    missing = {s.key: s.shape for s in specs if s.key not in found}
    if missing or unexpected or mismatched:
        raise CheckpointError(source, missing=missing, unexpected=unexpected,
                              mismatched=mismatched)

    tree: dict = {}
    leaves: dict[tuple, dict] = {}
    for s in specs:
        arr = s.transform(_to_numpy(found[s.key][1]))
        if s.field is None:
            _set(tree, s.path, arr)
        else:
            leaves.setdefault(s.path, {})[s.field] = arr
    for path in zero_bias:
        w = leaves[path]["w"]
        leaves[path]["b"] = np.zeros((w.shape[1],), np.float32)
    for path, fields in leaves.items():
        _set(tree, path, Dense(w=fields["w"], b=fields.get("b")))
    return _listify(tree)


# ---------------------------------------------------------------------------------------------
# ViT / DeiT.

# transformers 5.x module names -> the names save_pretrained writes.
_NEW_STYLE = (
    (re.compile(r"(^|\.)layers\.(\d+)\."), r"\1encoder.layer.\2."),
    (re.compile(r"\.attention\.q_proj\."), ".attention.attention.query."),
    (re.compile(r"\.attention\.k_proj\."), ".attention.attention.key."),
    (re.compile(r"\.attention\.v_proj\."), ".attention.attention.value."),
    (re.compile(r"\.attention\.o_proj\."), ".attention.output.dense."),
    (re.compile(r"\.mlp\.fc1\."), ".intermediate.dense."),
    (re.compile(r"\.mlp\.fc2\."), ".output.dense."),
)


def _canonical_key(key: str) -> str:
    for pat, rep in _NEW_STYLE:
        key = pat.sub(rep, key)
    return key


def detect(hf_config: Mapping) -> bool:
    """Whether a ``config.json`` dict describes a ViT or DeiT model."""
    return hf_config.get("model_type") in ("vit", "deit")


def _base_prefix(cfg: ViTConfig) -> str:
    return "deit" if cfg.distillation else "vit"


def _has_prefix(keys, prefix: str) -> bool:
    return any(k.startswith(prefix + ".") for k in keys)


def encoder_specs(cfg, base: str, *, prenorm: bool, qkv_bias: bool = True) -> list[TensorSpec]:
    """Specs of the HF ``encoder.layer.N`` stack (ViT pre-norm or BERT post-norm names)."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    specs = []
    for i in range(cfg.num_hidden_layers):
        k = f"{base}encoder.layer.{i}."
        p = ("encoder", "layers", i)
        for hf, ours in (("query", "q"), ("key", "k"), ("value", "v")):
            specs += linear_specs(f"{k}attention.self.{hf}" if not prenorm
                                  else f"{k}attention.attention.{hf}", d, d,
                                  p + ("attn", ours), bias=qkv_bias)
        specs += linear_specs(f"{k}attention.output.dense", d, d, p + ("attn", "o"))
        specs += linear_specs(f"{k}intermediate.dense", d, ff, p + ("mlp", "wi"))
        specs += linear_specs(f"{k}output.dense", ff, d, p + ("mlp", "wo"))
        if prenorm:
            specs += layer_norm_specs(f"{k}layernorm_before", d, p + ("attn_norm",))
            specs += layer_norm_specs(f"{k}layernorm_after", d, p + ("mlp_norm",))
        else:
            specs += layer_norm_specs(f"{k}attention.output.LayerNorm", d, p + ("attn_norm",))
            specs += layer_norm_specs(f"{k}output.LayerNorm", d, p + ("mlp_norm",))
    return specs


def checkpoint_specs(cfg: ViTConfig, *, prefixed: bool = True) -> list[TensorSpec]:
    """Every tensor of the HF checkpoint of ``cfg``.

    Args:
      cfg: model configuration.
      prefixed: base-model keys start with ``vit.``/``deit.`` (always, for a model with a
        classification head).

    Returns:
      The specs, keys in the names ``save_pretrained`` writes.
    """
    base = _base_prefix(cfg) + "." if (prefixed or cfg.num_labels > 0) else ""
    d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
    e = f"{base}embeddings."

    def conv_to_leaf(a):  # [d, C, p, p] -> [C*p*p, d], rows in (c, i, j) order
        return np.ascontiguousarray(a.reshape(a.shape[0], -1).T)

    specs = [
        TensorSpec(f"{e}patch_embeddings.projection.weight", (d, c, p, p),
                   ("embeddings", "patch"), "w", conv_to_leaf),
        TensorSpec(f"{e}patch_embeddings.projection.bias", (d,), ("embeddings", "patch"), "b"),
        TensorSpec(f"{e}cls_token", (1, 1, d), ("embeddings", "cls_token"),
                   transform=lambda a: a.reshape(-1)),
        TensorSpec(f"{e}position_embeddings", (1, cfg.num_tokens, d), ("embeddings", "position"),
                   transform=lambda a: a[0]),
    ]
    if cfg.distillation:
        specs.append(TensorSpec(f"{e}distillation_token", (1, 1, d), ("embeddings", "dist_token"),
                                transform=lambda a: a.reshape(-1)))
    specs += encoder_specs(cfg, base, prenorm=True, qkv_bias=cfg.qkv_bias)
    specs += layer_norm_specs(f"{base}layernorm", d, ("encoder", "final_norm"))
    if cfg.pooler:
        specs += linear_specs(f"{base}pooler.dense", d, cfg.pooler_width, ("pooler",))
    if cfg.num_labels > 0:
        if cfg.teacher_head:
            specs += linear_specs("cls_classifier", d, cfg.num_labels, ("classifier",))
            specs += linear_specs("distillation_classifier", d, cfg.num_labels,
                                  ("distillation_classifier",))
        else:
            specs += linear_specs("classifier", d, cfg.num_labels, ("classifier",))
    return specs


def load(hf_config: Mapping, state_dict: Mapping[str, object],
         source: str = "<state dict>") -> tuple[ViTConfig, dict]:
    """ViT / DeiT config and parameters from a ``config.json`` dict and a state dict.

    The head follows ``architectures`` (see :meth:`ViTConfig.from_hf_dict`); for a base model
    the pooler is loaded iff the checkpoint has ``pooler.dense`` keys (``add_pooling_layer`` is
    not in ``config.json``).

    Args:
      hf_config: parsed ``config.json``.
      state_dict: checkpoint key -> array.
      source: named in errors.

    Returns:
      ``(ViTConfig, params)``.

    Raises:
      CheckpointError: on missing, unexpected or mis-shaped keys (all listed).
    """
    aliases = {k: _canonical_key(k) for k in state_dict}
    canon = set(aliases.values())
    cfg = ViTConfig.from_hf_dict(dict(hf_config))
    if cfg.pooler and not any(k.endswith("pooler.dense.weight") for k in canon):
        cfg = dataclasses.replace(cfg, pooler=False)
    prefixed = _has_prefix(canon, _base_prefix(cfg))
    specs = checkpoint_specs(cfg, prefixed=prefixed)
    zero_bias = () if cfg.qkv_bias else tuple(
        ("encoder", "layers", i, "attn", n)
        for i in range(cfg.num_hidden_layers) for n in ("q", "k", "v"))
    params = params_from_specs(specs, state_dict, source=source, aliases=aliases,
                               zero_bias=zero_bias)
    return cfg, params


register_family("vit", detect, load)
