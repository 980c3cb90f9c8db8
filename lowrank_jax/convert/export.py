"""lowrank_jax parameter trees -> Hugging Face directories that the PyTorch classes load.

``save_pretrained(config, params, path)`` writes ``config.json`` and ``model.safetensors`` in
the layout the family's ``transformers`` class writes itself, so that
``T5ForConditionalGeneration.from_pretrained(path)`` (or ``ChronosPipeline``,
``ChronosBoltModelForForecasting``, ``ViTForImageClassification``,
``DeiTForImageClassificationWithTeacher``, ``BertModel``, ...) loads it. It is the inverse of
:func:`lowrank_jax.convert.load_pretrained` and reads the same key table, the family's
:class:`~lowrank_jax.models.hf.HFSpec`: one exporter for every family.

Hugging Face stores dense matrices, so every compressed leaf (``LowRank``, ``HeadLowRank``,
``MaskedBinary``, ``Int8`` / ``Int4`` (dequantized to float32: the checkpoint
``transformers`` loads is a float one; the lowrank_jax checkpoint keeps the packed integers), a
leaf type defined outside lowrank_jax, ...) is densified with
:func:`~lowrank_jax.materialize` for the export. That is never silent: the paths are logged,
returned in the summary and recorded in the safetensors metadata
(``lowrank_jax_materialized``). A leaf's bias is read with :func:`~lowrank_jax.bias_of`.

Layers with fewer heads or a narrower MLP than the config (per-layer sizes at init, or physical
removal with :func:`lowrank_jax.nn.keep_heads` / :func:`lowrank_jax.nn.keep_hidden`) are
zero-padded to the config's widths, since current transformers releases no longer prune heads:
each kept head goes to its original position (``HeadLayout.ids``; a stack's relative-bias
table is indexed by original head), the q/k columns of a head of width ``w`` fill the first
``w`` of its ``d_head`` columns (``q_h k_h^T`` does not change when a head's channels are
permuted consistently), likewise its v columns and o rows; MLP hidden channels fill the first
channels of ``d_ff``; the rest is zero. That is exact: a zero head adds nothing (its values and
outputs are zero) and a zero hidden channel adds nothing (every activation maps 0 to 0). What
cannot be exported exactly is refused: more heads than the config, heads wider than its head
width, a logit scale other than the one the PyTorch class applies.

``config.json`` and ``generation_config.json``: a config that carries the files of the checkpoint
it was loaded from (``hf_files``, :class:`~lowrank_jax.models.hf.HFConfigFiles`, set by
:func:`~lowrank_jax.convert.load_pretrained` and kept by ``save_model`` / ``load_model``) gets
them back: ``generation_config.json`` verbatim, ``config.json`` verbatim except the fields that
the config changed since it was loaded (those in which the family's ``config_to_hf`` of the
exported config differs from that of the loaded one, nested dicts such as ``chronos_config``
entry by entry) and ``dtype`` / ``torch_dtype``, which name the exported tensors' ``float32``;
``transformers_version`` stays the source's (the file keeps that version's conventions). The
result must read back as the exported config (``config_from_hf``); if a changed field depends
on one the source left to its default, the fields the config determines that the source lacks
are written too, and failing that all of them. A config without recorded files (built in
lowrank_jax, or loaded from a checkpoint written before they were recorded) gets the
``config.json`` of ``config_to_hf`` alone and no ``generation_config.json``.

Query-key objects other than :class:`~lowrank_jax.QueryKey` (the CP-SlimAtt and IrrAtt factors
of "Vision Transformer with Irregular Attention") are rewritten as separate q/k weights per head
by a float64 SVD of every slice of their query-key tensor, biases included (an augmented constant
input feature), kept at its numerical rank: exact whenever every slice has rank at most the
checkpoint's head width (TruncAtt; IrrAtt with a diagonal fusion matrix and ranks <= d_head),
refused otherwise (a CP model's slices have rank up to R). Their paths are listed as
materialized.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import math
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np

from lowrank_jax.compress import to_query_key
from lowrank_jax.convert.files import CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME
from lowrank_jax.convert.load import hf_spec
from lowrank_jax.errors import CheckpointError, OutputExistsError, ShapeError
from lowrank_jax.io.files import copy_files
from lowrank_jax.leaves import (
    as_query_key,
    bias_of,
    get_path,
    is_dense,
    is_leaf,
    is_quantized,
    is_query_key,
    materialize,
    named_leaves,
    path_str,
    replace_paths,
)
from lowrank_jax.models import family_of
from lowrank_jax.models.hf import HFRow, HFSpec, Widen, hf_files_of
from lowrank_jax.nn import attention_params, head_widths

logger = logging.getLogger("lowrank_jax.convert")

_ABSENT = object()


def _get(tree, path: str):
    """The node at ``path`` (dict keys, list indices, node fields) or ``_ABSENT``."""
    try:
        node = get_path(tree, path)
    except (KeyError, IndexError, AttributeError, ValueError, TypeError):
        return _ABSENT
    return _ABSENT if node is None else node


def _shape(node) -> tuple[int, ...]:
    return tuple(int(d) for d in (node.shape if is_leaf(node) else np.shape(node)))


def _exact_query_keys(params, rows) -> Any:
    """Query-key objects other than :class:`QueryKey` (CP-SlimAtt, IrrAtt factors) replaced by
    equivalent ``QueryKey`` s, exactly: a float64 SVD of every slice of the block's augmented
    query-key tensor at its numerical rank (:func:`lowrank_jax.compress.to_query_key`). A slice
    of rank above the checkpoint's head width cannot be stored as separate q/k weights and is
    refused with a :class:`~lowrank_jax.errors.ShapeError` naming the path and the heads."""
    widths = {r.widen.block: r.widen.width for r in rows
              if r.widen is not None and r.widen.by == "qk"}
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda n: is_query_key(n))[0]
    new = {}
    for p, node in flat:
        if is_query_key(node) and as_query_key(node) is not node:
            where = path_str(p)
            block = where.rsplit("/", 1)[0] if "/" in where else ""
            new[where] = to_query_key(node, max_width=widths.get(block), where=where)
            logger.info("export: %s (%s) rewritten as a QueryKey with per-head widths %s",
                        where, type(node).__name__, new[where].projections().widths)
    return replace_paths(params, new), sorted(new)


class _Widener:
    """Index maps of narrower layers into the config's widths (one per block and side)."""

    def __init__(self, params):
        self.params = params
        self.cache: dict[tuple, np.ndarray] = {}
        self.problems: dict[str, list[str]] = {}
        self.widened: set[str] = set()

    def index(self, w: Widen, path: str, size: int) -> np.ndarray | None:
        """Positions in the config's width of the ``size`` channels along ``w.axis`` of the
        tensor at ``path``; ``None`` when it cannot be exported exactly (see ``problems``)."""
        if w.by == "hidden":
            block = path.rsplit("/", 1)[0]
            if size > w.width:
                self._problem(block, f"{size} hidden channels, more than the config's {w.width}")
                return None
            if size < w.width:
                self.widened.add(block)
            return np.arange(size)
        if w.by == "head_table":
            if size > w.num_heads:
                self._problem(path, f"a table over {size} heads, more than the config's "
                                    f"{w.num_heads}")
                return None
            if size < w.num_heads:
                self.widened.add(path)
            return np.arange(size)
        key = (w.block, w.by)
        if key not in self.cache:
            self.cache[key] = self._heads(w)
        return self.cache[key]

    def _problem(self, where: str, what: str) -> None:
        parts = self.problems.setdefault(where, [])
        if what not in parts:
            parts.append(what)

    def _heads(self, w: Widen) -> np.ndarray | None:
        block = _get(self.params, w.block)
        if block is _ABSENT:
            self._problem(w.block, "no attention block at this path")
            return None
        _, _, _, heads = attention_params(block, w.block)
        widths = (head_widths(self.params, f"{w.block}/qk/q") if w.by == "qk"
                  else tuple(heads.v))
        what = "query/key" if w.by == "qk" else "value"
        bad = []
        if heads.num_heads > w.num_heads:
            bad.append(f"{heads.num_heads} heads, more than the config's {w.num_heads}")
        if any(i >= w.num_heads for i in heads.ids):
            bad.append(f"original head ids {heads.ids} beyond the config's {w.num_heads} heads")
        if any(x > w.width for x in widths):
            bad.append(f"{what} head widths {widths} wider than the config's {w.width}")
        if w.by == "qk" and w.scale is not None and not math.isclose(heads.scale, w.scale,
                                                                      rel_tol=1e-6):
            bad.append(f"logit scale {heads.scale:.6g}, but the PyTorch class applies "
                       f"{w.scale:.6g} (set by the config's head width)")
        if bad:
            for b in bad:
                self._problem(w.block, b)
            return None
        if heads.ids != tuple(range(w.num_heads)) or any(x != w.width for x in widths):
            self.widened.add(w.block)
        parts = [h * w.width + np.arange(x) for h, x in zip(heads.ids, widths, strict=True)]
        return np.concatenate(parts or [np.zeros(0, np.int64)]).astype(np.int64)


def _scatter(a: np.ndarray, idx: np.ndarray, axis: int, full: int) -> np.ndarray:
    """``a`` zero-padded to ``full`` entries along ``axis``, entry ``j`` at ``idx[j]``."""
    shape = list(a.shape)
    shape[axis] = full
    out = np.zeros(shape, a.dtype)
    sl = [slice(None)] * a.ndim
    sl[axis] = idx
    out[tuple(sl)] = a
    return out


@jax.jit
def _materialize_all(nodes: list) -> list:
    return [materialize(n) for n in nodes]


def _tree_shape(r: HFRow) -> tuple[int, ...]:
    """The shape of a row's tensor in the tree at the config's widths."""
    if r.kind == "linear":  # [out, in...] -> [prod(in...), out]
        return (int(np.prod(r.shape[1:])), int(r.shape[0]))
    return r.shape


def state_dict_from_params(config: Any, params: Any) -> tuple[dict, list[str], list[str]]:
    """A Hugging Face state dict of ``params``, following the family's key table.

    Args:
      config: the model's config dataclass (of a family with a Hugging Face mapping).
      params: its parameter tree (any leaf types; layers may be narrower than ``config``).

    Returns:
      ``(state, materialized, widened)``: ``{key: float32 array}`` in PyTorch orientation
      (``'zero'`` rows and optional keys are not written, as ``save_pretrained`` of the
      PyTorch class does not); the tree paths of compressed leaves densified with
      :func:`~lowrank_jax.materialize`; the paths of blocks and tables zero-padded to the
      config's widths.

    Raises:
      CheckpointError: naming every tree path that is missing, mis-shaped, of the wrong kind
        or has no place in the checkpoint (a non-zero bias where Hugging Face has none
        included; a zero one is dropped). Nothing is materialized before the whole tree has
        been checked.
      ShapeError: a layer cannot be exported exactly (more heads than the config, wider heads,
        another logit scale).
      ShapeError: also a factorized query-key object whose slices have rank above the
        checkpoint's head width.
    """
    family = family_of(config)
    rows = hf_spec(family).key_table(config)
    source = f"<params for {type(config).__name__}>"
    params, rewritten = _exact_query_keys(params, rows)
    widener = _Widener(params)
    missing, mismatched, unexpected, wrong_kind = {}, {}, {}, []
    has_bias = {r.path for r in rows if r.kind in ("bias", "zero")}
    covered: set[str] = set()
    plan: list[tuple[HFRow, Any, np.ndarray | None]] = []
    for r in rows:
        node = _get(params, r.path)
        covered.add(r.path)
        want = _tree_shape(r)
        name = r.path if r.kind in ("linear", "array") else f"{r.path}/b"
        if node is _ABSENT:
            missing[name] = want
            continue
        if r.kind == "linear" and not is_leaf(node) and np.ndim(node) != 2:
            wrong_kind.append(f"{r.path} (for {r.key}) must be a weight leaf, got "
                              f"{type(node).__name__}")
            continue
        if r.kind == "array" and is_leaf(node):
            wrong_kind.append(f"{r.path} (for {r.key}) must be a plain array, got a "
                              f"{type(node).__name__} leaf")
            continue
        if r.kind in ("bias", "zero"):
            if not is_leaf(node):
                wrong_kind.append(f"{r.path} (bias {r.key}) must be a weight leaf, got "
                                  f"{type(node).__name__}")
                continue
            leaf, node = node, bias_of(node)
            if r.kind == "zero":
                if node is not None and np.any(np.asarray(node) != 0):
                    unexpected[name] = _shape(node)
                continue
            if node is None:  # a weight without a bias is one with a zero bias
                node = np.zeros((_shape(leaf)[-1],), np.float32)
        if r.kind == "linear" and r.path not in has_bias:
            # A zero bias where Hugging Face has none (what the importer fills in for ViT without
            # qkv_bias) loses nothing when dropped; any other bias cannot be stored.
            b = bias_of(node)
            if b is not None and np.any(np.asarray(b) != 0):
                unexpected[f"{r.path}/b"] = _shape(b)
        got = _shape(node)
        idx = None
        if r.kind == "array" and r.widen is None:
            if int(np.prod(got)) != int(np.prod(r.shape)):
                mismatched[name] = (r.shape, got)
                continue
        elif r.widen is None:
            if got != want:
                mismatched[name] = (want, got)
                continue
        else:
            ax = r.widen.axis
            other = [d for i, d in enumerate(got) if i != ax]
            if len(got) != len(want) or other != [d for i, d in enumerate(want) if i != ax]:
                mismatched[name] = (want, got)
                continue
            idx = widener.index(r.widen, r.path, got[ax])
            if idx is not None and len(idx) != got[ax]:
                mismatched[name] = (want, got)
                continue
            if idx is not None and len(idx) == want[ax] and np.array_equal(idx, np.arange(
                    want[ax])):
                idx = None  # already at the config's width and in place
        plan.append((r, node, idx))
    for p, node in named_leaves(params):
        if p not in covered:
            unexpected[p] = _shape(node)
    if missing or mismatched or unexpected or wrong_kind:
        note = ["(tree paths of the params; shapes in the lowrank_jax [d_in, d_out] layout)"]
        note += [f"  {w}" for w in wrong_kind]
        raise CheckpointError(source, missing=missing, unexpected=unexpected,
                              mismatched=mismatched, note="\n".join(note))
    if widener.problems:
        problems = [f"{where}: " + "; ".join(parts)
                    for where, parts in sorted(widener.problems.items())]
        raise ShapeError(
            "save_pretrained: these layers cannot be written exactly as a Hugging Face "
            f"{type(config).__name__} checkpoint (layers may have fewer or narrower heads and "
            "narrower MLPs than the config, which are zero-padded, but not more or wider, nor "
            "another attention scale):\n  " + "\n  ".join(problems),
            where=sorted(widener.problems)[0], actual=problems)

    state, materialized = {}, []
    # every weight densified by one compiled program: leaf by leaf, each small operation of
    # each distinct (pruned, irregular) shape would be compiled on its own
    dense = _materialize_all([node for r, node, _ in plan if r.kind == "linear"])
    dense = iter(dense)
    for r, node, idx in plan:
        want = _tree_shape(r)
        if r.kind == "linear":
            if (is_leaf(node) and not is_dense(node)) or any(
                    r.path.startswith(q + "/") for q in rewritten):  # reporting only
                materialized.append(r.path)
            arr = np.asarray(next(dense), dtype=np.float32)  # [d_in, d_out]
        else:
            arr = np.asarray(node, dtype=np.float32)
        if idx is not None:
            arr = _scatter(arr, idx, r.widen.axis, want[r.widen.axis])
        if r.kind == "linear":
            arr = arr.T  # -> [out, in] (reshaped to [d, C, p, p] for a patch convolution)
        state[r.key] = np.ascontiguousarray(arr.reshape(r.shape))
    state = {k: np.ascontiguousarray(v) for k, v in
             hf_spec(family).to_checkpoint(config, state).items()}
    return state, sorted(set(materialized), key=materialized.index), sorted(widener.widened)


# ---------------------------------------------------------------------------------------------
# config.json and generation_config.json.

#: ``config.json`` keys that name the dtype of the checkpoint's tensors (transformers 5, 4).
DTYPE_KEYS = ("dtype", "torch_dtype")


def _overlay(source: dict, base: dict, ours: dict) -> dict:
    """A copy of ``source`` with the entries in which ``ours`` differs from ``base`` set to
    ``ours``' (dicts present in all three entry by entry) and the entries of ``base`` that
    ``ours`` no longer has removed."""
    out = copy.deepcopy(source)
    for k, v in ours.items():
        b = base.get(k, _ABSENT)
        if b is not _ABSENT and type(b) is type(v) and b == v:
            continue
        if isinstance(v, dict) and isinstance(b, dict) and isinstance(out.get(k), dict):
            out[k] = _overlay(out[k], b, v)
        else:
            out[k] = copy.deepcopy(v)
    for k in base:
        if k not in ours:
            out.pop(k, None)
    return out


def _fill(out: dict, ours: dict) -> dict:
    """A copy of ``out`` with the entries of ``ours`` that it lacks added (nested dicts too)."""
    out = copy.deepcopy(out)
    for k, v in ours.items():
        if k not in out:
            out[k] = copy.deepcopy(v)
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = _fill(out[k], v)
    return out


def _reads_back(spec: HFSpec, hf_config: dict, state: dict, ours: dict) -> bool:
    """Whether ``hf_config`` (with the exported tensors) translates to a config whose
    ``config_to_hf`` is ``ours``."""
    try:
        return spec.config_to_hf(spec.config_from_hf(copy.deepcopy(hf_config), state)) == ours
    except (ValueError, KeyError, TypeError):  # ConfigError is a ValueError
        return False


def config_files(config: Any, state: dict) -> tuple[dict, dict | None, list[str] | None]:
    """The ``config.json`` and ``generation_config.json`` of an export (module docstring).

    Args:
      config: the exported model's config (of a family with a Hugging Face mapping).
      state: the exported tensors (:func:`state_dict_from_params`), which the family's
        ``config_from_hf`` may read (a tied or untied head, a pooler).

    Returns:
      ``(config_json, generation_json, changed)``: ``generation_json`` is ``None`` when the
      source had none; ``changed`` lists the top-level ``config.json`` keys that differ from
      the source's, ``None`` when no source files are recorded.
    """
    spec = hf_spec(family_of(config))
    ours = spec.config_to_hf(config)
    files = hf_files_of(config)
    if files is not None and not isinstance(files.loaded, type(config)):
        logger.warning("export: the recorded Hugging Face files belong to a %s, not to the "
                       "exported %s; writing config.json from the config alone",
                       type(files.loaded).__name__, type(config).__name__)
        files = None
    if files is None:
        return ours, None, None
    source = files.config
    out = _overlay(source, spec.config_to_hf(files.loaded), ours)
    if not _reads_back(spec, out, state, ours):
        out = _fill(out, ours)  # a changed field may depend on one the source left to default
        if not _reads_back(spec, out, state, ours):
            out = _overlay(out, {}, ours)
    for k in DTYPE_KEYS:
        if k in out:
            out[k] = "float32"
    changed = sorted(k for k in set(out) | set(source)
                     if out.get(k, _ABSENT) != source.get(k, _ABSENT))
    return out, copy.deepcopy(files.generation_config), changed


# ---------------------------------------------------------------------------------------------
# Writing.

def _check_target(path: str, overwrite: bool) -> None:
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise OutputExistsError(f"save_pretrained: {path} exists and is not a directory; "
                                    "choose another path", where=path)
        if os.listdir(path) and not overwrite:
            raise OutputExistsError(f"save_pretrained: {path} is not empty; pass "
                                    "overwrite=True to replace it, or choose another path",
                                    where=path)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_dir(directory: str, hf_config: dict, generation: dict | None, state: dict,
               metadata: dict) -> None:
    from safetensors.numpy import save_file

    _write_json(os.path.join(directory, CONFIG_NAME), hf_config)
    if generation is not None:
        _write_json(os.path.join(directory, GENERATION_CONFIG_NAME), generation)
    save_file(state, os.path.join(directory, WEIGHTS_NAME), metadata=metadata)


def _move_into_place(tmp: str, path: str, overwrite: bool = False) -> None:
    """Rename ``tmp`` to ``path`` without losing what another writer put there meanwhile.

    Without ``overwrite`` only an empty directory at ``path`` is replaced (removed just before
    the rename); anything else at ``path`` when the rename happens -- another export that
    finished first, someone's files -- is left as it is and refused
    (:func:`lowrank_jax.io.files.rename_noreplace`). With ``overwrite`` an existing directory is
    set aside first, restored if the rename fails, removed after it succeeds.

    Raises:
      OutputExistsError: something other than an empty directory (without ``overwrite``) or a
        directory (with it) took ``path`` while ``tmp`` was written.
    """
    from lowrank_jax.io.files import is_empty_dir, rename_noreplace

    backup = None
    try:
        if overwrite and os.path.isdir(path) and not os.path.islink(path):
            parent, name = os.path.split(path)
            backup = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rmdir(backup)  # only the unique name is wanted
            os.rename(path, backup)
        elif is_empty_dir(path):
            try:
                os.rmdir(path)  # fails if something was put into it meanwhile
            except FileNotFoundError:
                pass
        rename_noreplace(tmp, path)
    except BaseException as e:
        if backup is not None:
            try:
                rename_noreplace(backup, path)
            except OSError:  # another export took its place; it was being replaced anyway
                shutil.rmtree(backup, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise OutputExistsError(
                f"save_pretrained: {path} appeared while the export was being written (another "
                "writer?); nothing was written there. Pass overwrite=True to replace it, or "
                "choose another path", where=path) from None
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def save_pretrained(config: Any, params: Any, path, *, overwrite: bool = False,
                    extra_files: dict | None = None) -> dict:
    """Write a Hugging Face directory that the original PyTorch class loads.

    ``load_pretrained(path) -> save_pretrained(...) -> Class.from_pretrained(path)`` gives the
    same outputs. Compressed leaves are densified with :func:`~lowrank_jax.materialize` (logged
    on the ``lowrank_jax.convert`` logger, listed in the summary and in the safetensors
    metadata), so the exported file is as large as the uncompressed model; narrower layers are
    zero-padded to the config's widths (see the module docstring). A config loaded with
    ``load_pretrained`` (directly or through ``save_model`` / ``load_model``) gets its source's
    ``config.json`` and ``generation_config.json`` back, changed only where the config changed
    (module docstring), so training settings such as dropout survive the round trip.

    Args:
      config: the model's config dataclass (of any family with a Hugging Face mapping).
      params: its parameter tree (any leaf types).
      path: output directory. Written atomically: files go to a temporary directory beside
        ``path`` that is renamed at the end; on any error nothing is left at ``path``.
      overwrite: replace a non-empty existing directory.
      extra_files: ``{file name: path}`` of files copied verbatim into the directory in the
        same atomic write (a language model's tokenizer files, so that ``AutoTokenizer`` loads
        from the export); listed in the summary's ``files``.

    Returns:
      A summary: ``{'family', 'architecture', 'path', 'files', 'n_tensors', 'n_parameters',
      'materialized' (tree paths of densified leaves), 'dequantized' (those of them that
      are integer weights, :class:`~lowrank_jax.leaves.Int8` / ``Int4``, written as their
      float32 values), 'widened' (zero-padded blocks),
      'config_changed' (the ``config.json`` keys that differ from the source's; ``None`` when
      the config records no source files), 'load_kwargs' (what ``from_pretrained`` needs
      beyond the path)}``.

    Raises:
      OutputExistsError: ``path`` is a non-empty directory (without ``overwrite``) or a file.
      ConfigError: no family (or no Hugging Face mapping) for ``type(config)``.
      CheckpointError, ShapeError, LeafTypeError: see :func:`state_dict_from_params`.
      ConfigError, MissingFileError: a name in ``extra_files`` that is not a plain file name
        or is one of the files written here, or a source that is not a file.
    """
    path = os.path.abspath(os.fspath(path))
    _check_target(path, overwrite)
    family = family_of(config)
    spec = hf_spec(family)
    config, params, padded = spec.prepare_export(config, params)
    state, materialized, widened = state_dict_from_params(config, params)
    widened = sorted(set(widened) | set(padded))
    hf_config, generation, changed = config_files(config, state)
    if changed:
        logger.info("export config.json: the source's, with %s changed", ", ".join(changed))
    if materialized:
        logger.warning("export materialized %d compressed leaves: %s", len(materialized),
                       ", ".join(materialized))
    # integer weights (Int8 / Int4) are written as their float32 values
    dequantized = [p for p, node in named_leaves(params) if is_quantized(node)]
    if dequantized:
        logger.info("export dequantized %d integer weights to float32: %s", len(dequantized),
                    ", ".join(dequantized))
    if widened:
        logger.info("export zero-padded %d narrower blocks to the config's widths: %s",
                    len(widened), ", ".join(widened))
    metadata = {"format": "pt", "lowrank_jax_family": family.name,
                "lowrank_jax_materialized": ",".join(materialized),
                "lowrank_jax_widened": ",".join(widened),
                "lowrank_jax_dequantized": ",".join(dequantized)}

    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        extra = copy_files(tmp, extra_files or {}, who="save_pretrained",
                           reserved=(CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME))
        _write_dir(tmp, hf_config, generation, state, metadata)
        _check_target(path, overwrite)  # again: something may have appeared meanwhile
        _move_into_place(tmp, path, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "family": family.name,
        "architecture": (hf_config.get("architectures") or [""])[0],
        "path": path,
        "files": [CONFIG_NAME] + ([GENERATION_CONFIG_NAME] if generation is not None else [])
                 + [WEIGHTS_NAME] + extra,
        "n_tensors": len(state),
        "n_parameters": int(sum(a.size for a in state.values())),
        "materialized": materialized,
        "dequantized": dequantized,
        "widened": widened,
        "config_changed": changed,
        "load_kwargs": dict(spec.load_kwargs(config)),
    }


__all__ = ["DTYPE_KEYS", "config_files", "save_pretrained", "state_dict_from_params"]
