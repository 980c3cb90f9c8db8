"""The Hugging Face side of a model family: one key table and the config translation.

A family's :class:`~lowrank_jax.models.ModelFamily` holds an :class:`HFSpec` in its ``hf``
field. The spec is data and small pure functions (no torch, no file access): how to recognise
the family's ``config.json``, how to translate configs both ways, and one key table
(:class:`HFRow` s) that lists every tensor of the checkpoint, where it lives in the lowrank_jax
parameter tree and its PyTorch shape. :mod:`lowrank_jax.convert` reads the *same* table to
import (``load_pretrained``) and to export (``save_pretrained``), so the two directions cannot
drift apart, and it contains no family-specific code.

Conventions of the table:

* keys are the names ``save_pretrained`` of the ``transformers`` class writes (the checkpoint
  of the config's architecture); other spellings of the same tensor (the in-memory module names
  of transformers 5, a base model's prefix) are mapped onto them by :attr:`HFSpec.rename` and
  :attr:`HFSpec.base_prefixes`;
* paths are ``'/'``-joined parameter paths, as :func:`lowrank_jax.leaves.named_leaves` prints
  them (``'encoder/layers/0/attn/qk/q'``);
* a ``'linear'`` row is the dense matrix of the weight leaf at its path; PyTorch stores
  ``[out, in...]`` (a ``Linear`` or a patch convolution), the tree ``[prod(in...), out]``.

Export of layers narrower than the config: since transformers no longer prunes heads, a layer
with fewer heads or a narrower MLP (per-layer ``LayerSizes`` at init, or physical removal with
:func:`lowrank_jax.nn.keep_heads` / :func:`lowrank_jax.nn.keep_hidden`) is written zero-padded
to the config's widths. :class:`Widen` on a row says how: a kept head goes to its original
position (``HeadLayout.ids``), its channels to the first of the head's width, the rest is zero.
That is exact: a zero head's values (or outputs) are zero, so it adds nothing, and a zero hidden
channel adds nothing.

The source's configuration files: a family config records only what lowrank_jax computes with,
while a ``config.json`` also holds training settings (``dropout_rate``, ``initializer_factor``,
``use_cache``, labels, ...) and a ``generation_config.json`` the decoding defaults. A config
class with a field ``hf_files: HFConfigFiles | None = hf_files_field()`` (every built-in
family's) carries both files verbatim from ``load_pretrained`` through ``save_model`` /
``load_model`` to ``save_pretrained``, which writes them back with only the fields changed that
the config changed (:class:`HFConfigFiles`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from lowrank_jax.errors import ConfigError

KINDS = ("linear", "bias", "array", "zero")
WIDEN_BY = ("qk", "v", "hidden", "head_table")


@dataclasses.dataclass(frozen=True)
class Widen:
    """How a tensor of a layer narrower than the config is zero-padded to the Hugging Face
    shape on export (import always reads full-width checkpoints).

    Attributes:
      by: what the narrower axis is made of:
        ``'qk'``: the query/key heads of the attention block at ``block`` (per-head widths of its
        :class:`~lowrank_jax.QueryKey`); ``'v'``: that block's value heads (widths
        ``HeadLayout.v``). Kept head ``i`` goes to original position ``heads.ids[i]``, its
        channels to the first of ``width``.
        ``'hidden'``: MLP hidden channels, written to the first of ``width``.
        ``'head_table'``: columns indexed by original head id (a relative-bias table), written
        to the first of ``num_heads``.
      axis: the narrower axis in tree orientation (``[d_in, d_out]`` for a weight, ``0`` for a
        bias vector, the array's own axes for an ``'array'`` row).
      width: per-head width (``'qk'``, ``'v'``: the config's ``d_kv``) or the whole width
        (``'hidden'``: ``d_ff``).
      num_heads: the config's head count (``'qk'``, ``'v'``, ``'head_table'``).
      block: path of the attention block (``'qk'``, ``'v'``).
      scale: ``'qk'`` only: the logit scale Hugging Face applies (``1/sqrt(head width)`` for
        scaled attention, ``1`` for T5); a block with another scale cannot be exported exactly.
    """

    by: str
    axis: int
    width: int = 0
    num_heads: int = 0
    block: str = ""
    scale: float | None = None

    def __post_init__(self):
        if self.by not in WIDEN_BY:
            raise ConfigError(f"Widen: by must be one of {WIDEN_BY}, got {self.by!r}",
                              where="by", expected=WIDEN_BY, actual=self.by)


@dataclasses.dataclass(frozen=True)
class HFRow:
    """One tensor of a Hugging Face checkpoint and its place in the parameter tree.

    Attributes:
      key: the checkpoint key (``None`` for ``'zero'`` rows).
      path: the tree path of the weight leaf or array.
      kind: ``'linear'``: the dense matrix of the weight leaf at ``path`` (transposed, then
        reshaped to ``shape``); ``'bias'``: that leaf's bias; ``'array'``: a plain array,
        reshaped to ``shape``; ``'zero'``: the leaf's bias that the checkpoint does not store
        because it is zero (ViT without ``qkv_bias``): zeros on import, and it must be zero (or
        absent) on export.
      shape: the tensor's shape in the checkpoint (PyTorch orientation); for ``'zero'`` rows the
        bias shape.
      widen: how export zero-pads a narrower layer (``None``: the tensor must have ``shape``).
    """

    key: str | None
    path: str
    kind: str
    shape: tuple[int, ...]
    widen: Widen | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"HFRow: kind must be one of {KINDS}, got {self.kind!r}",
                              where=str(self.key), expected=KINDS, actual=self.kind)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if (self.key is None) != (self.kind == "zero"):
            raise ConfigError(f"HFRow: exactly the 'zero' rows have no key (row {self.path!r}, "
                              f"kind {self.kind!r}, key {self.key!r})", where=self.path)


def _identity(key: str) -> str:
    return key


def _no_optional(cfg: Any) -> dict:
    del cfg
    return {}


def _no_load_kwargs(cfg: Any) -> dict:
    del cfg
    return {}


def _same_state(state: Mapping) -> dict:
    return dict(state)


def _same_export(cfg: Any, state: dict) -> dict:
    del cfg
    return state


def _as_is(cfg: Any, params: Any) -> tuple[Any, Any, list]:
    return cfg, params, []


@dataclasses.dataclass(frozen=True)
class HFSpec:
    """How a model family maps to Hugging Face checkpoints (held in ``ModelFamily.hf``).

    Attributes:
      detect: ``detect(hf_config: dict) -> bool``: whether a ``config.json`` dict is this
        family's. Exactly one registered family may accept a given config.
      config_from_hf: ``config_from_hf(hf_config: dict, state: Mapping[str, np.ndarray]) ->
        cfg``. ``state`` holds the checkpoint's tensors under their :attr:`rename` d keys;
        families read what ``config.json`` does not record from it (a base model's pooler
        from the key set; T5 a tied or untied LM head from ``lm_head.weight`` vs
        ``shared.weight``).
      config_to_hf: ``config_to_hf(cfg) -> dict``: the ``config.json`` of an export (with
        ``model_type`` and ``architectures``).
      key_table: ``key_table(cfg) -> list[HFRow]``: every tensor of the checkpoint of ``cfg``.
      optional: ``optional(cfg) -> {key: shape or None}``: keys a checkpoint may carry that
        hold nothing the model needs (tied copies, buffers of old files); accepted and dropped
        on import if their shape matches (``None``: any shape), never written on export.
      rename: ``rename(key) -> key``: other spellings of a key (the in-memory module names of
        transformers 5) to the table's.
      base_prefixes: prefixes of a base model's keys (``'vit.'``): a key that is not in the
        table but is with one of them removed is read as that table key (a base model saved
        inside a model with a head).
      load_kwargs: ``load_kwargs(cfg) -> dict``: keyword arguments the PyTorch class needs to
        load an export, beyond its directory (``{'add_pooling_layer': False}``: not recordable
        in ``config.json``).
      from_checkpoint: ``from_checkpoint(state) -> state``: the checkpoint's tensors in the
        table's form, applied before the table is read (GPT-2 splits its fused ``c_attn`` into
        q, k and v rows and turns its ``Conv1D`` ``[in, out]`` weights into ``[out, in]``).
      to_checkpoint: ``to_checkpoint(cfg, state) -> state``: the inverse, applied to an
        export's tensors.
      prepare_export: ``prepare_export(cfg, params) -> (cfg, params, padded_paths)``, run by
        :func:`~lowrank_jax.convert.save_pretrained` first: a family whose config can describe
        a smaller model (Llama's explicit ``head_dim``) returns the config of the params' head
        counts and widths when every layer agrees, and params zero-padded to the config (the
        paths it padded listed) otherwise.
    """

    detect: Callable[[dict], bool]
    config_from_hf: Callable[[dict, Mapping[str, np.ndarray]], Any]
    config_to_hf: Callable[[Any], dict]
    key_table: Callable[[Any], list]
    optional: Callable[[Any], dict] = _no_optional
    rename: Callable[[str], str] = _identity
    base_prefixes: tuple[str, ...] = ()
    load_kwargs: Callable[[Any], dict] = _no_load_kwargs
    from_checkpoint: Callable[[Mapping], dict] = _same_state
    to_checkpoint: Callable[[Any, dict], dict] = _same_export
    prepare_export: Callable[[Any, Any], tuple] = _as_is


# ---------------------------------------------------------------------------------------------
# The source's configuration files, carried by a config.

#: The name of the config field that holds an :class:`HFConfigFiles`.
HF_FILES_FIELD = "hf_files"


@dataclasses.dataclass(frozen=True)
class HFConfigFiles:
    """The configuration files of the Hugging Face checkpoint a model was loaded from.

    :func:`lowrank_jax.convert.load_pretrained` stores one in the config's ``hf_files`` field;
    it travels with the config (``dataclasses.replace``, ``save_model`` / ``load_model``, whose
    checkpoints hold it in their metadata) and :func:`lowrank_jax.convert.save_pretrained`
    writes the files back: ``generation_config.json`` verbatim, ``config.json`` verbatim except
    the fields in which ``config_to_hf`` of the exported config differs from ``config_to_hf``
    of :attr:`loaded` (widths the user changed, ...), and ``dtype`` / ``torch_dtype``, set to
    the exported tensors' ``float32``. Treat the dicts as read-only.

    Attributes:
      config: the parsed ``config.json``.
      generation_config: the parsed ``generation_config.json``, or ``None`` (the checkpoint
        has none).
      loaded: the family config that ``config`` was translated to (its own ``hf_files`` is
        ``None``): the reference for which fields an export changes.
    """

    config: dict
    generation_config: dict | None = None
    loaded: Any = None


def hf_files_field() -> Any:
    """The ``dataclasses.field`` of a config's ``hf_files``: default ``None``, left out of
    ``==``, ``hash`` and ``repr`` (two configs that compute the same are equal whatever file
    they came from, and a config stays a valid static argument of ``jax.jit``)."""
    return dataclasses.field(default=None, compare=False, repr=False)


def has_hf_files_field(cfg: Any) -> bool:
    """Whether ``cfg`` is a dataclass instance with an ``hf_files`` field."""
    return (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)
            and any(f.name == HF_FILES_FIELD for f in dataclasses.fields(cfg)))


def hf_files_of(cfg: Any) -> HFConfigFiles | None:
    """The :class:`HFConfigFiles` a config carries, or ``None`` (none recorded, or a config
    class without the field)."""
    if not has_hf_files_field(cfg):
        return None
    files = getattr(cfg, HF_FILES_FIELD)
    return files if isinstance(files, HFConfigFiles) else None


def with_hf_files(cfg: Any, files: HFConfigFiles | None) -> Any:
    """``cfg`` carrying ``files`` (a copy; ``cfg`` itself if its class has no ``hf_files``
    field, since such a config cannot carry them)."""
    if not has_hf_files_field(cfg):
        return cfg
    if files is not None:
        files = HFConfigFiles(config=copy.deepcopy(files.config),
                              generation_config=copy.deepcopy(files.generation_config),
                              loaded=with_hf_files(files.loaded, None))
    return dataclasses.replace(cfg, **{HF_FILES_FIELD: files})


# ---------------------------------------------------------------------------------------------
# Row builders shared by the families' tables.

def linear_rows(key: str, path: str, d_in: int, d_out: int, *, bias: bool,
                widen_out: Widen | None = None, widen_in: Widen | None = None) -> list[HFRow]:
    """Rows of a PyTorch ``nn.Linear(d_in, d_out)`` at ``key`` (``key.weight [d_out, d_in]``,
    ``key.bias [d_out]``) that is the weight leaf at ``path`` (``[d_in, d_out]``).

    Args:
      key: module name in the checkpoint (without ``.weight``).
      path: tree path of the weight leaf.
      d_in, d_out: the config's widths.
      bias: the checkpoint stores a bias.
      widen_out: how a narrower output axis is padded on export (its ``axis`` is set here: 1
        for the weight, 0 for the bias).
      widen_in: how a narrower input axis is padded (the bias is not affected).

    Returns:
      The weight row, then the bias row if ``bias``.
    """
    if widen_out is not None and widen_in is not None:
        raise ConfigError(f"linear_rows: {key}: only one axis of a weight can be widened")
    w = None
    if widen_out is not None:
        w = dataclasses.replace(widen_out, axis=1)
    elif widen_in is not None:
        w = dataclasses.replace(widen_in, axis=0)
    rows = [HFRow(f"{key}.weight", path, "linear", (d_out, d_in), w)]
    if bias:
        b = None if widen_out is None else dataclasses.replace(widen_out, axis=0)
        rows.append(HFRow(f"{key}.bias", path, "bias", (d_out,), b))
    return rows


def norm_rows(key: str, path: str, d: int, *, bias: bool = True) -> list[HFRow]:
    """Rows of a norm module at ``key`` -> ``{'scale', 'bias'}`` at ``path``: a PyTorch
    ``nn.LayerNorm(d)`` (``bias=True``) or T5's RMS norm (``weight`` only)."""
    rows = [HFRow(f"{key}.weight", f"{path}/scale", "array", (d,))]
    if bias:
        rows.append(HFRow(f"{key}.bias", f"{path}/bias", "array", (d,)))
    return rows


def attention_rows(names: dict[str, str], path: str, *, d_q: int, d_kv_in: int, d_out: int,
                   num_heads: int, d_head: int, scale: float, bias: bool,
                   qkv_bias: bool | None = None) -> list[HFRow]:
    """Rows of one attention block (``{'qk': QueryKey(q, k), 'v', 'o', 'heads'}`` at
    ``path``), with the head structure export needs to zero-pad removed heads.

    Args:
      names: checkpoint module names of ``'q'``, ``'k'``, ``'v'``, ``'o'`` (without
        ``.weight``).
      path: tree path of the block.
      d_q, d_kv_in, d_out: widths of the queries' input, the keys'/values' input, the output.
      num_heads, d_head: the config's heads and per-head width (of queries, keys and values).
      scale: the logit scale the PyTorch class applies.
      bias: biases on the four projections.
      qkv_bias: whether the checkpoint stores the q/k/v biases (default ``bias``); when
        ``bias`` but not ``qkv_bias``, the tree's q/k/v biases are ``'zero'`` rows.

    Returns:
      The rows, q, k, v, o in order.
    """
    qkv_bias = bias if qkv_bias is None else qkv_bias
    inner = num_heads * d_head
    qk = Widen("qk", 1, d_head, num_heads, path, scale)
    v = Widen("v", 1, d_head, num_heads, path)
    rows = []
    for name, d_in, sub, widen in (("q", d_q, "qk/q", qk), ("k", d_kv_in, "qk/k", qk),
                                   ("v", d_kv_in, "v", v)):
        rows += linear_rows(names[name], f"{path}/{sub}", d_in, inner, bias=qkv_bias,
                            widen_out=widen)
        if bias and not qkv_bias:
            rows.append(HFRow(None, f"{path}/{sub}", "zero", (inner,)))
    rows += linear_rows(names["o"], f"{path}/o", inner, d_out, bias=bias, widen_in=v)
    return rows


def mlp_rows(names: dict[str, str], path: str, *, d_model: int, d_ff: int,
             bias: bool) -> list[HFRow]:
    """Rows of an MLP block at ``path`` (``'wi'`` or ``'wi_0'``/``'wi_1'``, and ``'wo'``).

    Args:
      names: checkpoint module name of each of the block's projections (its keys are the
        block's: ``{'wi': ..., 'wo': ...}`` or ``{'wi_0', 'wi_1', 'wo'}``).
      path: tree path of the block.
      d_model, d_ff: the config's widths.
      bias: biases on the projections.
    """
    hidden = Widen("hidden", 1, d_ff)
    rows = []
    for name, key in names.items():
        if name == "wo":
            rows += linear_rows(key, f"{path}/wo", d_ff, d_model, bias=bias, widen_in=hidden)
        else:
            rows += linear_rows(key, f"{path}/{name}", d_model, d_ff, bias=bias,
                                widen_out=hidden)
    return rows


__all__ = ["HF_FILES_FIELD", "HFConfigFiles", "HFRow", "HFSpec", "KINDS", "WIDEN_BY", "Widen",
           "attention_rows", "has_hf_files_field", "hf_files_field", "hf_files_of", "linear_rows",
           "mlp_rows", "norm_rows", "with_hf_files"]
