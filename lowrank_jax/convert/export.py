"""lowrank_jax parameter trees -> Hugging Face directories the PyTorch classes load.

``save_pretrained(config, params, path)`` writes ``config.json`` and ``model.safetensors`` in
the layout that the family's ``transformers`` class writes itself, so that
``T5ForConditionalGeneration.from_pretrained(path)`` (or ``ChronosPipeline``,
``ViTForImageClassification``, ``DeiTForImageClassificationWithTeacher``, ``BertModel``, ...)
loads it. It is the inverse of :func:`lowrank_jax.convert.load_pretrained` and reads the same key
tables (:func:`lowrank_jax.convert.t5.key_table`, the ``checkpoint_specs`` of
:mod:`~lowrank_jax.convert.vit` and :mod:`~lowrank_jax.convert.bert`).

Hugging Face stores dense matrices, so every compressed leaf (``LowRank``, ``HeadLowRank``,
``MaskedBinary``, ...) is densified with :func:`~lowrank_jax.materialize` for the export. That is
never silent: the paths are logged, returned in the summary and recorded in the safetensors
metadata (``lowrank_jax_materialized``). A leaf's bias is not part of ``materialize`` and is
exported from the leaf's ``b``.

Families register an exporter per config type with :func:`register_exporter`. An exporter is
``fn(config, params) -> HFExport``; :func:`state_from_rows` turns a key table of rows
``(hf_key, tree_path, kind, hf_shape)`` (``kind`` in ``'linear'``, ``'bias'``, ``'array'``, as
:func:`lowrank_jax.convert.t5.key_table` and the Chronos-Bolt table) into a checked state dict.
Chronos-Bolt registers its own exporter from :mod:`lowrank_jax.convert.chronos_bolt` (imported
lazily here, on first use of an unregistered config type).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Callable, NamedTuple

import numpy as np

from lowrank_jax.convert import bert as convert_bert
from lowrank_jax.convert import vit as convert_vit
from lowrank_jax.convert.errors import CheckpointError
from lowrank_jax.convert.t5 import key_table as t5_key_table
from lowrank_jax.leaves import Dense, Leaf, materialize, named_leaves
from lowrank_jax.models.bert import BertConfig
from lowrank_jax.models.chronos import ChronosConfig
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.models.vit import ViTConfig

logger = logging.getLogger("lowrank_jax.convert")

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# lowrank_jax activation names -> Hugging Face ``hidden_act`` (inverse of
# lowrank_jax.models.vit.HF_ACTIVATIONS; 'gelu_new' is HF's tanh approximation).
_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}

# Modules that may register exporters when imported (families written elsewhere).
_LAZY_EXPORTER_MODULES = ("lowrank_jax.convert.chronos_bolt",)


class HFExport(NamedTuple):
    """What an exporter returns.

    Attributes:
      family: family name (as in :func:`lowrank_jax.convert.families`).
      hf_config: the ``config.json`` dict (with ``model_type`` and ``architectures``).
      state: ``{hf_key: float32 np.ndarray}`` in PyTorch orientation.
      materialized: tree paths of compressed leaves that were densified.
      load_kwargs: keyword arguments the PyTorch class needs beyond the directory (e.g.
        ``{'add_pooling_layer': False}``; not recordable in ``config.json``).
    """

    family: str
    hf_config: dict
    state: dict
    materialized: list
    load_kwargs: dict | None = None


Exporter = Callable[[Any, Any], HFExport]
_EXPORTERS: dict[type, Exporter] = {}


def register_exporter(config_cls: type, fn: Exporter) -> None:
    """Register (or replace) the exporter for configs of type ``config_cls``.

    Args:
      config_cls: a config dataclass (``T5Config``, ``ViTConfig``, ...); subclasses match too.
      fn: ``fn(config, params) -> HFExport``; raises :class:`CheckpointError` when ``params``
        does not match ``config``.
    """
    if not isinstance(config_cls, type):
        raise TypeError(f"register_exporter: config_cls must be a class, got {config_cls!r}")
    _EXPORTERS[config_cls] = fn


def exporters() -> tuple[str, ...]:
    """Names of the config types that have an exporter."""
    return tuple(c.__name__ for c in _EXPORTERS)


def _lookup(config) -> Exporter | None:
    for cls in type(config).__mro__:
        if cls in _EXPORTERS:
            return _EXPORTERS[cls]
    return None


def _exporter_for(config) -> Exporter:
    fn = _lookup(config)
    if fn is None:
        for name in _LAZY_EXPORTER_MODULES:  # families that register themselves on import
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name != name:
                    raise
        fn = _lookup(config)
    if fn is None:
        raise TypeError(
            f"save_pretrained: no exporter for config type {type(config).__name__}; "
            f"registered: {sorted(exporters())}. Pass the config returned by load_pretrained "
            "(or register one with lowrank_jax.convert.export.register_exporter)."
        )
    return fn


# ---------------------------------------------------------------------------------------------
# Key tables -> checked state dicts.

def _path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path)


_ABSENT = object()


def _get(tree, path: tuple):
    node = tree
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return _ABSENT
    return node


def _leaf_bias(node):
    """The bias of a weight leaf (every leaf type stores it as field ``b``) or of a raw array."""
    if isinstance(node, Leaf):
        names = {f.name for f in dataclasses.fields(node)}
        return node.b if "b" in names else None
    return None


def _node_shape(node) -> tuple:
    return tuple(int(d) for d in (node.shape if isinstance(node, Leaf) else np.shape(node)))


def _linear_tree_shape(hf_shape: tuple) -> tuple:
    """``[out, in...]`` in PyTorch -> ``[prod(in...), out]`` as a leaf (Linear or patch conv)."""
    return (int(np.prod(hf_shape[1:])), int(hf_shape[0]))


def state_from_rows(rows: list[tuple], params, *, source: str = "<params>"
                    ) -> tuple[dict, list[str]]:
    """A Hugging Face state dict from a parameter tree, following a key table.

    Args:
      rows: ``[(hf_key, tree_path, kind, hf_shape)]``. ``kind``: ``'linear'``, the dense matrix
        of the leaf at ``tree_path`` (``[d_in, d_out]`` -> transposed, then reshaped to
        ``hf_shape``: a ``Linear`` ``[out, in]`` or the patch convolution ``[d, C, p, p]``);
        ``'bias'``, that leaf's ``b``; ``'array'``, a raw array reshaped to ``hf_shape``.
      params: the parameter tree.
      source: named in errors.

    Returns:
      ``(state, materialized)``: ``{hf_key: float32 array}`` and the tree paths of non-Dense
      leaves that were densified with :func:`~lowrank_jax.materialize`.

    Raises:
      CheckpointError: naming every tree path that is missing, mis-shaped, of the wrong kind
        or has no place in the checkpoint (a non-zero bias where Hugging Face has none
        included; a zero one is dropped). Nothing is materialized before the whole tree has
        been checked.
    """
    missing, mismatched, unexpected, wrong_kind = {}, {}, {}, []
    has_bias = {tuple(path) for _, path, kind, _ in rows if kind == "bias"}
    covered = set()
    for key, path, kind, hf_shape in rows:
        path, p = tuple(path), _path_str(path)
        hf_shape = tuple(int(d) for d in hf_shape)
        node = _get(params, path)
        if kind == "linear":
            want = _linear_tree_shape(hf_shape)
        elif kind == "bias":
            want = hf_shape
            p = p + "/b"
        elif kind == "array":
            want = hf_shape
        else:
            raise ValueError(f"state_from_rows: unknown kind {kind!r} for {key!r}")
        covered.add(_path_str(path))
        if node is _ABSENT or node is None:
            missing[p] = want
            continue
        if kind == "linear":
            if not isinstance(node, Leaf) and np.ndim(node) != 2:
                wrong_kind.append(f"{p} (for {key}) must be a weight leaf, got "
                                  f"{type(node).__name__}")
                continue
            if _node_shape(node) != want:
                mismatched[p] = (want, _node_shape(node))
            b = _leaf_bias(node)
            # A zero bias where Hugging Face has none is what the loaders fill in (ViT with
            # qkv_bias=False); dropping it loses nothing. Any other bias cannot be stored.
            if b is not None and path not in has_bias and np.any(np.asarray(b) != 0):
                unexpected[p + "/b"] = tuple(np.shape(b))
        elif kind == "bias":
            b = _leaf_bias(node)
            if b is None:
                missing[p] = want
            elif tuple(np.shape(b)) != want:
                mismatched[p] = (want, tuple(np.shape(b)))
        else:
            if isinstance(node, Leaf):
                wrong_kind.append(f"{p} (for {key}) must be a plain array, got a "
                                  f"{type(node).__name__} leaf")
                continue
            if int(np.prod(np.shape(node))) != int(np.prod(hf_shape)):
                mismatched[p] = (hf_shape, tuple(np.shape(node)))
    for p, node in named_leaves(params):
        if p not in covered:
            unexpected[p] = _node_shape(node)
    if missing or mismatched or unexpected or wrong_kind:
        note = ["(tree paths of the params; shapes in the lowrank_jax [d_in, d_out] layout)"]
        note += [f"  {w}" for w in wrong_kind]
        raise CheckpointError(source, missing=missing, unexpected=unexpected,
                              mismatched=mismatched, note="\n".join(note))

    state, materialized = {}, []
    for key, path, kind, hf_shape in rows:
        node = _get(params, tuple(path))
        if kind == "linear":
            if isinstance(node, Leaf) and not isinstance(node, Dense):
                materialized.append(_path_str(path))
            dense = np.asarray(materialize(node), dtype=np.float32)  # [d_in, d_out]
            arr = dense.T.reshape(hf_shape)  # -> [out, in] (or [d, C, p, p])
        elif kind == "bias":
            arr = np.asarray(_leaf_bias(node), dtype=np.float32).reshape(hf_shape)
        else:
            arr = np.asarray(node, dtype=np.float32).reshape(hf_shape)
        state[key] = np.ascontiguousarray(arr)
    return state, sorted(set(materialized), key=materialized.index)


def rows_from_specs(specs: list) -> list[tuple]:
    """Key-table rows from :class:`lowrank_jax.convert.vit.TensorSpec` lists (ViT, BERT).

    Every spec's transform is "transpose and flatten" (``'w'`` fields) or "drop leading unit
    dimensions" (raw arrays), so the inverse is a transpose and/or a reshape to ``spec.shape``.
    """
    kinds = {"w": "linear", "b": "bias", None: "array"}
    return [(s.key, tuple(s.path), kinds[s.field], tuple(s.shape)) for s in specs]


# ---------------------------------------------------------------------------------------------
# Families.

def _hf_activation(name: str, owner: str) -> str:
    if name not in _HF_ACTIVATION:
        raise ValueError(f"save_pretrained: {owner} activation {name!r} has no Hugging Face "
                         f"name; supported: {tuple(_HF_ACTIVATION)}")
    return _HF_ACTIVATION[name]


def _labels(n: int) -> dict:
    id2label = {str(i): f"LABEL_{i}" for i in range(n)}
    return {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}


def _source(config) -> str:
    return f"<params for {type(config).__name__}>"


def export_t5(config: T5Config, params) -> HFExport:
    """``T5ForConditionalGeneration``: canonical keys only, as its ``save_pretrained`` writes.

    The embedding copies ``encoder/decoder.embed_tokens.weight`` are tied to ``shared.weight``
    on load and not written; a tied head writes no ``lm_head.weight``. An untied head (T5 v1.1)
    writes ``lm_head.weight``, which transformers >= 5 keeps untied because it differs from
    ``shared.weight``; ``scale_decoder_outputs`` is written explicitly.
    """
    state, mat = state_from_rows(t5_key_table(config), params, source=_source(config))
    return HFExport("t5", config.to_hf_dict(), state, mat)


def export_chronos(config: ChronosConfig, params) -> HFExport:
    """A Chronos (T5) checkpoint: the T5 export plus ``chronos_config`` for ``ChronosPipeline``."""
    state, mat = state_from_rows(t5_key_table(config.t5), params, source=_source(config))
    hf = dict(config.t5.to_hf_dict(), chronos_config=config.to_hf_chronos_dict())
    return HFExport("chronos", hf, state, mat)


def _vit_architecture(cfg: ViTConfig) -> str:
    base = "DeiT" if cfg.distillation else "ViT"
    if cfg.num_labels == 0:
        return f"{base}Model"
    if cfg.teacher_head:
        return "DeiTForImageClassificationWithTeacher"
    return f"{base}ForImageClassification"


def export_vit(config: ViTConfig, params) -> HFExport:
    """ViT / DeiT: ``ViTModel``, ``ViTForImageClassification``, ``DeiTModel``,
    ``DeiTForImageClassification``, ``DeiTForImageClassificationWithTeacher``.

    A base model is written unprefixed, as its ``save_pretrained`` does; without a pooler it
    must be loaded with ``add_pooling_layer=False`` (returned in ``load_kwargs``).
    """
    arch = _vit_architecture(config)
    specs = convert_vit.checkpoint_specs(config, prefixed=config.num_labels > 0)
    state, mat = state_from_rows(rows_from_specs(specs), params, source=_source(config))
    hf = {
        "model_type": "deit" if config.distillation else "vit",
        "architectures": [arch],
        "image_size": config.image_size, "patch_size": config.patch_size,
        "num_channels": config.num_channels, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": _hf_activation(config.hidden_act, "ViTConfig"),
        "layer_norm_eps": config.layer_norm_eps, "qkv_bias": config.qkv_bias,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "pooler_output_size": config.pooler_width, "pooler_act": "tanh",
    }
    if config.num_labels > 0:
        hf.update(_labels(config.num_labels))
    load_kwargs = {} if (config.pooler or config.num_labels > 0) else {"add_pooling_layer": False}
    return HFExport("vit", hf, state, mat, load_kwargs)


def export_bert(config: BertConfig, params) -> HFExport:
    """BERT: ``BertModel`` (unprefixed keys, as its ``save_pretrained`` writes) or
    ``BertForSequenceClassification``. Without a pooler, load with ``add_pooling_layer=False``
    (returned in ``load_kwargs``)."""
    arch = "BertForSequenceClassification" if config.num_labels > 0 else "BertModel"
    specs = convert_bert.checkpoint_specs(config, prefixed=config.num_labels > 0)
    state, mat = state_from_rows(rows_from_specs(specs), params, source=_source(config))
    hf = {
        "model_type": "bert", "architectures": [arch],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": _hf_activation(config.hidden_act, "BertConfig"),
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size, "layer_norm_eps": config.layer_norm_eps,
        "position_embedding_type": "absolute", "is_decoder": False,
        "add_cross_attention": False,
    }
    if config.num_labels > 0:
        hf.update(_labels(config.num_labels))
    load_kwargs = {} if config.pooler else {"add_pooling_layer": False}
    return HFExport("bert", hf, state, mat, load_kwargs)


register_exporter(T5Config, export_t5)
register_exporter(ChronosConfig, export_chronos)
register_exporter(ViTConfig, export_vit)
register_exporter(BertConfig, export_bert)


# ---------------------------------------------------------------------------------------------
# Writing.

def _check_target(path: str, overwrite: bool) -> None:
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(f"save_pretrained: {path} exists and is not a directory; "
                                  "choose another path")
        if os.listdir(path) and not overwrite:
            raise FileExistsError(f"save_pretrained: {path} is not empty; pass overwrite=True "
                                  "to replace it, or choose another path")


def _write_dir(directory: str, export: HFExport, materialized: list[str]) -> None:
    from safetensors.numpy import save_file

    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(export.hf_config, f, indent=2, sort_keys=True)
        f.write("\n")
    metadata = {"format": "pt", "lowrank_jax_family": export.family,
                "lowrank_jax_materialized": ",".join(materialized)}
    save_file(export.state, os.path.join(directory, WEIGHTS_NAME), metadata=metadata)


def _move_into_place(tmp: str, path: str) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is set aside first and restored if the
    rename fails, removed after it succeeds."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
        return
    parent, name = os.path.split(path)
    backup = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
    os.rmdir(backup)  # only the unique name is wanted
    os.rename(path, backup)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(backup, path)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def save_pretrained(config, params, path, *, overwrite: bool = False) -> dict:
    """Write a Hugging Face directory that the original PyTorch class loads.

    ``load_pretrained(path) -> save_pretrained(...) -> Class.from_pretrained(path)`` gives the
    same outputs. Compressed leaves are densified with :func:`~lowrank_jax.materialize` (logged
    on the ``lowrank_jax.convert`` logger, listed in the summary and in the safetensors metadata),
    so the exported file is as large as the uncompressed model.

    Args:
      config: the model's config dataclass (``T5Config``, ``ChronosConfig``, ``ViTConfig``,
        ``BertConfig``, or any type given to :func:`register_exporter`).
      params: its parameter tree (any leaf types).
      path: output directory. Written atomically: files go to a temporary directory beside
        ``path`` that is renamed at the end; on any error nothing is left at ``path``.
      overwrite: replace a non-empty existing directory.

    Returns:
      A summary: ``{'family', 'architecture', 'path', 'files', 'n_tensors', 'n_parameters',
      'materialized' (tree paths of densified leaves), 'load_kwargs'}``.

    Raises:
      FileExistsError: ``path`` is a non-empty directory (without ``overwrite``) or a file.
      TypeError: no exporter for ``type(config)``.
      CheckpointError: ``params`` does not match ``config`` (every missing, unexpected or
        mis-shaped tree path is listed).
    """
    path = os.path.abspath(os.fspath(path))
    _check_target(path, overwrite)
    export = _exporter_for(config)(config, params)
    materialized = list(export.materialized)
    if materialized:
        logger.warning("export materialized %d compressed leaves: %s", len(materialized),
                       ", ".join(materialized))

    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        _write_dir(tmp, export, materialized)
        _check_target(path, overwrite)  # again: something may have appeared meanwhile
        _move_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "family": export.family,
        "architecture": export.hf_config["architectures"][0],
        "path": path,
        "files": [CONFIG_NAME, WEIGHTS_NAME],
        "n_tensors": len(export.state),
        "n_parameters": int(sum(a.size for a in export.state.values())),
        "materialized": materialized,
        "load_kwargs": dict(export.load_kwargs or {}),
    }
