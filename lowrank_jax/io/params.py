"""Parameter checkpoints: :func:`save_params`, :func:`load_params`, :func:`load_metadata`.

A checkpoint is a directory holding ``tree.json`` (the skeleton, see
:mod:`lowrank_jax.io.skeleton`, and the metadata) and ``arrays/`` (an orbax PyTree checkpoint
of the non-empty arrays). Every stored array carries a sha256 checksum in the skeleton, verified
when it is read. Checkpoints of format version 1 (lowrank_jax 0.1) are read through
:mod:`lowrank_jax.io.legacy`. The step directories of :class:`lowrank_jax.train.Checkpointer`
are checkpoints of this format with a ``train`` section, which the parameter readers skip
(:func:`restore_arrays` and :func:`write_contents` are shared with it).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LeafTypeError,
    MissingFileError,
)
from lowrank_jax.io import files
from lowrank_jax.io._reads import (
    describe,
    index_damage,
    list_damage,
    list_names,
    quiet_reads,
    read_each,
)
from lowrank_jax.io.legacy import find_v1_attention, skeleton_from_v1
from lowrank_jax.io.skeleton import TreeEncoder, build_tree, checksum_if_readable, collect_arrays

FORMAT = "lowrank_jax.params"
VERSION = 2
#: Format versions this release reads (1: lowrank_jax 0.1, no checksums, 0.1 attention blocks).
READABLE_VERSIONS = (1, 2)
TREE_FILE = "tree.json"
ARRAYS_DIR = "arrays"
#: The ``tree.json`` key of the train-state section that :class:`lowrank_jax.train.Checkpointer`
#: writes (optimizer state, PRNG key, step, data position); parameter readers skip it.
TRAIN_KEY = "train"
#: Root label of the model-state tree in messages.
STATE_ROOT = "<state>"


def _ckpt_error(source: str, message: str, *, expected: Any = None,
                actual: Any = None) -> CheckpointError:
    e = CheckpointError(source, message=message)
    e.expected, e.actual = expected, actual
    return e


# ---------------------------------------------------------------------------------------------
# Writing.

def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory laid out as a lowrank_jax checkpoint.

    It must hold ``tree.json`` and nothing but ``tree.json`` and ``arrays/``; a ``tree.json``
    that parses as JSON must carry the format tag ``'lowrank_jax.params'`` (an unreadable one
    still counts, so a damaged checkpoint can be overwritten). This is the marker by which
    ``overwrite=True`` recognises what it may replace.

    Args:
      path: a filesystem path.

    Returns:
      ``True`` for a (possibly damaged) lowrank_jax checkpoint directory.
    """
    path = os.fspath(path)
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    entries = set(os.listdir(path))
    if TREE_FILE not in entries or not entries <= {TREE_FILE, ARRAYS_DIR}:
        return False
    try:
        with open(os.path.join(path, TREE_FILE), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return True
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def save_params(path: str | os.PathLike, params: Any, *, metadata: dict | None = None,
                overwrite: bool = False, state: Any = None,
                extra_files: dict | None = None) -> None:
    """Save a parameter tree to the directory ``path`` (atomically, with checksums).

    Args:
      path: target directory (local filesystem). It must not exist, or be an empty directory,
        unless ``overwrite=True``.
      params: nested dicts (str or int keys), lists and tuples whose nodes are registered nodes
        (leaf types, query-key objects, head layouts, including types defined outside
        lowrank_jax), ``jax.Array`` / NumPy arrays, NumPy scalars, or ``None``.
      metadata: optional JSON-serializable dict stored in ``tree.json`` (read back with
        :func:`load_metadata`).
      overwrite: replace an existing ``path`` that is a lowrank_jax checkpoint
        (:func:`is_checkpoint`). Anything else at ``path`` is never replaced.
      state: an optional second tree of the same kinds stored beside the parameters (model
        state such as BatchNorm running statistics); read back with :func:`load_state`.

    Raises:
      OutputExistsError: ``path`` exists and is not empty, and ``overwrite`` is false or
        ``path`` is not a lowrank_jax checkpoint.
      LeafTypeError: a node, dict key, static field or ``metadata`` cannot be saved (an
        unsupported type, PRNG key arrays). Nothing is written in that case.
    """
    if metadata is not None and not isinstance(metadata, dict):
        raise LeafTypeError(f"save_params: metadata must be a dict, got {type(metadata).__name__}",
                            where="metadata", expected="dict", actual=type(metadata).__name__)
    enc = TreeEncoder("save_params")
    doc = {"format": FORMAT, "version": VERSION, "tree": enc.encode(params)}
    if state is not None:
        doc["state"] = enc.encode(state, STATE_ROOT)
    doc["metadata"] = {} if metadata is None else metadata
    try:
        text = json.dumps(doc, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise LeafTypeError(f"save_params: metadata is not JSON-serializable: {e}",
                            where="metadata", expected="JSON-serializable values") from e
    with files.atomic_directory(path, overwrite=overwrite, owned=is_checkpoint,
                                who="save_params") as tmp:
        files.copy_files(tmp, extra_files or {}, reserved=(TREE_FILE, ARRAYS_DIR),
                                who="save_params")
        write_contents(tmp, text, enc.arrays)


def write_contents(directory: str, document: str, arrays: dict[str, Any], *,
                   write_document: bool = True) -> None:
    """Write a checkpoint's files into the (temporary) directory ``directory``.

    Args:
      directory: an existing directory, renamed into place by the caller.
      document: the text of ``tree.json``.
      arrays: ``{key: array}`` of the stored arrays (written to ``arrays/`` by orbax; with
        several processes writing one directory, every process calls this with its part of
        the global arrays).
      write_document: write ``tree.json`` (with several processes, only one of them does).
    """
    import orbax.checkpoint as ocp  # slow import, only needed here

    if arrays:
        ocp.PyTreeCheckpointer().save(os.path.join(directory, ARRAYS_DIR), arrays)
    if write_document:
        files.write_text(os.path.join(directory, TREE_FILE), document)


# ---------------------------------------------------------------------------------------------
# Reading.

class Stored(NamedTuple):
    """What :func:`read_checkpoint` read.

    Attributes:
      params: the parameter tree (``None`` when not requested). Format version 1 trees keep
        the 0.1 attention blocks (``{'q', 'k', 'v', 'o'}``); see
        :func:`lowrank_jax.io.upgrade_attention`.
      state: the model-state tree, or ``None`` (none stored, or not requested).
      metadata: the metadata dict.
      version: the format version of the file.
      tree_file: the path of its ``tree.json``.
    """

    params: Any
    state: Any
    metadata: dict
    version: int
    tree_file: str


def read_document(path: str | os.PathLike, who: str = "load_params") -> tuple[str, str, dict]:
    """``(directory, tree_file, document)`` of a checkpoint, validated at the top level.

    Format version 1 skeletons are converted to the version 2 form (no checksums).

    Args:
      path: the checkpoint directory.
      who: the caller's name, for messages.

    Returns:
      The absolute directory, the path of its ``tree.json`` and the parsed document.

    Raises:
      MissingFileError: ``path`` or its ``tree.json`` does not exist.
      CheckpointError: ``path`` is a file, ``tree.json`` is not valid JSON, not a lowrank_jax
        skeleton, of an unknown format version, or lacks its ``tree`` / ``metadata``.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise MissingFileError(f"{who}: no checkpoint at {path} (the path does not exist)",
                               where=path, expected="a checkpoint directory", actual="nothing")
    if not os.path.isdir(path):
        raise _ckpt_error(path, f"{who}: {path} is a file; expected a directory written by "
                          "save_params", expected="a directory", actual="a file")
    tree_file = os.path.join(path, TREE_FILE)
    if not os.path.isfile(tree_file):
        raise MissingFileError(
            f"{who}: {tree_file} not found; expected a directory written by save_params "
            f"(containing {TREE_FILE} and {ARRAYS_DIR}/), found {sorted(os.listdir(path))}",
            where=tree_file, expected=TREE_FILE, actual=sorted(os.listdir(path)))
    try:
        with open(tree_file, encoding="utf-8") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _ckpt_error(tree_file, f"{who}: {tree_file} is not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise _ckpt_error(tree_file, f"{who}: {tree_file} is not a lowrank_jax skeleton: "
                          f"expected format '{FORMAT}', found {found!r}", expected=FORMAT,
                          actual=found)
    version = doc.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > VERSION
        raise _ckpt_error(
            tree_file, f"{who}: {tree_file} has format version {version!r}; this lowrank_jax "
            f"reads versions {list(READABLE_VERSIONS)}"
            + ("; it was written by a newer lowrank_jax: upgrade to read it" if newer else ""),
            expected=list(READABLE_VERSIONS), actual=version)
    for field in ("tree", "metadata"):
        if not isinstance(doc.get(field), dict):
            raise _ckpt_error(tree_file, f"{who}: {tree_file} is missing its '{field}' object "
                              f"(found {type(doc.get(field)).__name__})", expected="an object",
                              actual=type(doc.get(field)).__name__)
    if version == 1:
        doc = dict(doc, tree=skeleton_from_v1(doc["tree"]), state=None)
    else:
        if doc.get("state") is not None and not isinstance(doc["state"], dict):
            raise _ckpt_error(tree_file, f"{who}: {tree_file} has a 'state' that is neither null "
                              f"nor a skeleton object (found {type(doc['state']).__name__})")
        train = doc.get(TRAIN_KEY)
        if train is not None and not (isinstance(train, dict)
                                      and isinstance(train.get("trees", {}), dict)
                                      and all(isinstance(t, dict)
                                              for t in train.get("trees", {}).values())):
            raise _ckpt_error(tree_file, f"{who}: {tree_file} has a '{TRAIN_KEY}' section that is "
                              "not an object with a 'trees' object of skeletons",
                              expected="an object", actual=type(train).__name__)
    return path, tree_file, doc


def load_metadata(path: str | os.PathLike) -> dict:
    """The ``metadata`` dict given to :func:`save_params` (``{}`` if none); no arrays are read.

    Args:
      path: the checkpoint directory.

    Returns:
      The metadata (for a model checkpoint it holds the serialized config under ``'config'``).
    """
    return read_document(path, "load_metadata")[2]["metadata"]


def read_checkpoint(path: str | os.PathLike, *, params: bool = True, state: bool = True,
                    verify: bool = True, who: str = "load_params") -> Stored:
    """Read a checkpoint of any readable format version, in one pass.

    Args:
      path: the checkpoint directory.
      params: restore the parameter tree.
      state: restore the model-state tree (when one is stored).
      verify: check every restored array against its stored sha256 checksum (format version 2;
        version 1 stores none).
      who: the caller's name, for messages.

    Returns:
      A :class:`Stored` record. No upgrade of version 1 trees is done here.

    Raises:
      MissingFileError, CheckpointError: as :func:`load_params`.
    """
    path, tree_file, doc = read_document(path, who)
    version = doc["version"]
    checksums = version >= 2
    trees = {"params": ("", doc["tree"])}
    if doc.get("state") is not None:
        trees["state"] = (STATE_ROOT, doc["state"])
    for name, spec in (doc.get(TRAIN_KEY) or {}).get("trees", {}).items():
        trees[f"{TRAIN_KEY}/{name}"] = (f"<{TRAIN_KEY}>/{name}", spec)  # arrays not read here
    specs: dict[str, tuple[str, dict]] = {}
    owner: dict[str, str] = {}
    for name, (root, spec) in trees.items():
        before = set(specs)
        collect_arrays(spec, tree_file, root=root, checksums=checksums, out=specs)
        owner.update({k: name for k in set(specs) - before})
    wanted = {n for n, flag in (("params", params), ("state", state)) if flag and n in trees}
    arrays = {}
    if specs:
        arrays = restore_arrays(os.path.join(path, ARRAYS_DIR), specs,
                                 {k for k in specs if owner[k] in wanted}, tree_file,
                                 verify and checksums, who)
    out = {n: build_tree(trees[n][1], arrays, tree_file, trees[n][0]) for n in sorted(wanted)}
    return Stored(out.get("params"), out.get("state"), doc["metadata"], version, tree_file)


def load_params(path: str | os.PathLike, *, verify: bool = True) -> Any:
    """Load the parameter tree written by :func:`save_params`: same treedef, dtypes and bits.

    A format version 1 checkpoint (lowrank_jax 0.1) loads too. Its attention blocks keep the
    0.1 layout ``{'q', 'k', 'v', 'o'}`` (a bare parameter tree does not say how many heads they
    have), with a warning: load a model checkpoint with :func:`lowrank_jax.io.load_model`,
    which upgrades them, or call :func:`lowrank_jax.io.upgrade_attention`.

    Args:
      path: the checkpoint directory.
      verify: check every array against its stored checksum.

    Returns:
      The parameter tree. ``jax.Array`` values are placed on the default device (one device,
      unsharded, so a checkpoint loads on any topology).

    Raises:
      MissingFileError: ``path`` or its ``tree.json`` does not exist.
      CheckpointError: ``tree.json`` is corrupt, names an unknown node type, or the stored
        arrays do not match it (missing, extra, or of another shape or dtype).
      CorruptCheckpointError: files under ``arrays/`` are damaged (a ``CheckpointError``): one
        line naming the checkpoint, every array that cannot be read or whose bytes do not match
        its checksum, and what is wrong with each. Nothing else is printed.
    """
    stored = read_checkpoint(path, state=False, verify=verify, who="load_params")
    if stored.version == 1:
        blocks = find_v1_attention(stored.params)
        if blocks:
            warnings.warn(
                f"load_params: {stored.tree_file} is a lowrank_jax 0.1 checkpoint (format "
                f"version 1); its {len(blocks)} attention blocks (first: '{blocks[0]}') keep the "
                "0.1 layout {'q', 'k', 'v', 'o'}, which the current blocks do not run. Use "
                "lowrank_jax.io.load_model(path) for a model checkpoint, or "
                "lowrank_jax.io.upgrade_attention(params, num_heads=...)", UserWarning,
                stacklevel=2)
    return stored.params


def load_state(path: str | os.PathLike, *, verify: bool = True) -> Any:
    """The model-state tree stored with ``save_params(..., state=...)``, or ``None``.

    Args:
      path: the checkpoint directory.
      verify: check every array against its stored checksum.

    Returns:
      The state tree, or ``None`` when the checkpoint holds none (format version 1 never does).
    """
    return read_checkpoint(path, params=False, verify=verify, who="load_state").state


def restore_arrays(arrays_dir: str, specs: dict[str, tuple[str, dict]], wanted: set[str],
                   tree_file: str, verify: bool, who: str, *, shardings: dict | None = None,
                   hint: str | None = None, check_stored: bool = True) -> dict:
    """Restore the arrays ``wanted`` of a checkpoint's ``arrays/`` and check their checksums.

    Args:
      arrays_dir: the checkpoint's ``arrays/`` directory.
      specs: ``{key: (path, array spec)}`` of every array the checkpoint stores (from
        :func:`lowrank_jax.io.skeleton.collect_arrays`).
      wanted: the keys to read.
      tree_file: the checkpoint's ``tree.json``, for messages.
      verify: compare each array read with its sha256 checksum.
      who: the caller's name, for messages.
      shardings: ``{key: jax.sharding.Sharding}`` for arrays restored as ``jax.Array`` (default:
        the default device).
      hint: what the user can do about a damaged checkpoint, ending its message.
      check_stored: before reading, compare the keys, shapes and dtypes orbax lists in
        ``arrays/`` with ``specs`` (a :class:`~lowrank_jax.errors.CheckpointError` naming the
        first difference). It costs a metadata read per array; without it a difference shows
        as an array that cannot be read (orbax checks shapes) or, with ``verify``, fails its
        checksum (which covers dtype, shape and bytes).

    Returns:
      ``{key: array}``.

    Raises:
      CorruptCheckpointError: files are missing, cut short or altered (one line naming every
        damaged array by path and key).
      CheckpointError: the stored arrays do not match ``specs``.
    """
    import orbax.checkpoint as ocp

    hint = _RESTORE_HINT if hint is None else hint
    shardings = shardings or {}

    if not os.path.isdir(arrays_dir):
        ckpt = os.path.dirname(arrays_dir)
        raise CorruptCheckpointError(
            f"{who}: checkpoint {ckpt} is damaged: {tree_file} lists {len(specs)} stored arrays "
            f"but {arrays_dir} does not exist. {hint}", where=ckpt, expected=ARRAYS_DIR,
            actual="missing", arrays={p or "<root>": "cannot be read: arrays/ is missing"
                                      for p, _ in specs.values()})
    ckptr = ocp.PyTreeCheckpointer()
    stored = None
    if check_stored:
        stored = _stored_metadata(ckptr, arrays_dir, specs, wanted, tree_file, who, hint)
    device = jax.devices()[0]
    restore_args = {}
    for key in sorted(wanted):
        spec = specs[key][1]
        shape, dtype = tuple(spec["shape"]), jnp.dtype(spec["dtype"])
        if spec["kind"] in ("jax", "key"):
            sharding = shardings.get(key) or jax.sharding.SingleDeviceSharding(device)
            restore_args[key] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape,
                                                     dtype=dtype)
        else:
            restore_args[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
    if not restore_args:
        return {}
    partial = len(restore_args) < (len(stored) if stored is not None else len(specs))
    problems: dict[str, str] = {}
    try:
        with quiet_reads():
            arrays = ckptr.restore(arrays_dir, args=ocp.args.PyTreeRestore(
                item={k: 0 for k in restore_args}, restore_args=restore_args,
                partial_restore=partial))
    except Exception as e:
        # Find every array that cannot be read: the index (all of them), or one at a time.
        why = index_damage(arrays_dir)
        if why is not None:
            raise _unreadable_index(who, arrays_dir, specs, sorted(restore_args), why,
                                    hint) from None
        arrays, problems = read_each(arrays_dir, restore_args,
                                     partial=stored is None or len(stored) > 1)
        problems = {k: f"cannot be read: {p}" for k, p in problems.items()}
        if not problems:  # each array reads alone: say what the whole read said
            ckpt = os.path.dirname(arrays_dir)
            raise CorruptCheckpointError(
                f"{who}: checkpoint {ckpt} is damaged: its arrays cannot be read together "
                f"({describe(e, root=arrays_dir)}; in {arrays_dir}). {hint}",
                where=ckpt) from None
    expected_sum = actual_sum = None
    if verify:
        for key, x in arrays.items():
            expected = specs[key][1].get("sha256")
            actual = checksum_if_readable(x) if expected is not None else None
            if actual is None:  # split over processes when saved, or now: no host digest
                continue
            if actual != expected:
                problems[key] = (f"is corrupt: it fails its checksum (its bytes do not match the "
                                 f"sha256 checksum recorded in {tree_file}: expected "
                                 f"{expected[:16]}..., got {actual[:16]}...)")
                expected_sum, actual_sum = expected, actual
    if problems:
        raise _damaged(who, arrays_dir, specs, problems,
                       *((expected_sum, actual_sum) if len(problems) == 1 else (None, None)),
                       hint=hint)
    return arrays


def _stored_metadata(ckptr: Any, arrays_dir: str, specs: dict[str, tuple[str, dict]],
                     wanted: set[str], tree_file: str, who: str, hint: str) -> dict:
    """What orbax lists in ``arrays_dir``, checked against ``specs`` (keys, and the shapes and
    dtypes of the arrays ``wanted``)."""
    try:
        with quiet_reads():
            stored = ckptr.metadata(arrays_dir).item_metadata.tree
    except Exception as e:  # orbax raises several types for an unreadable checkpoint
        why = index_damage(arrays_dir) or describe(e, root=arrays_dir)
        raise _unreadable_index(who, arrays_dir, specs, sorted(wanted) or sorted(specs),
                                why, hint) from None
    if not isinstance(stored, dict):
        raise _ckpt_error(arrays_dir, f"{who}: {arrays_dir} should hold a flat dict of arrays, "
                          f"found {type(stored).__name__}")
    missing = sorted(set(specs) - set(stored))
    extra = sorted(set(stored) - set(specs))
    if missing or extra:
        listed = [f"{k} ({specs[k][0] or 'root'})" for k in missing[:5]]
        raise _ckpt_error(
            arrays_dir, f"{who}: arrays in {arrays_dir} do not match {tree_file}: missing "
            f"{listed}{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''}", expected=sorted(specs), actual=sorted(stored))
    for key in sorted(wanted):
        tree_path, spec = specs[key]
        shape, dtype = tuple(spec["shape"]), jnp.dtype(spec["dtype"])
        meta = stored[key]
        found_shape = tuple(getattr(meta, "shape", ()) or ())
        found_dtype = getattr(meta, "dtype", None)
        if found_shape != shape or (found_dtype is not None and jnp.dtype(found_dtype) != dtype):
            found = f"{getattr(found_dtype, 'name', found_dtype)}{list(found_shape)}"
            raise _ckpt_error(
                arrays_dir, f"{who}: array '{tree_path}' ({key} in {arrays_dir}) does not match "
                f"{tree_file}: expected {dtype.name}{list(shape)}, found {found}",
                expected=f"{dtype.name}{list(shape)}", actual=found)
    return stored


_RESTORE_HINT = ("The files changed after they were written (truncated, deleted or altered); "
                 "restore the checkpoint from a copy")


def _damaged(who: str, arrays_dir: str, specs: dict, problems: dict[str, str],
             expected: Any = None, actual: Any = None, *,
             hint: str = _RESTORE_HINT) -> CorruptCheckpointError:
    """One line naming the checkpoint, each damaged array (tree path and orbax key) and what
    is wrong with it."""
    ckpt = os.path.dirname(arrays_dir)
    named = {k: specs[k][0] or "<root>" for k in problems}
    body = list_damage({(named[k], k): p for k, p in problems.items()}, arrays_dir)
    return CorruptCheckpointError(
        f"{who}: checkpoint {ckpt} is damaged: {body}. {hint}", where=ckpt,
        expected=expected, actual=actual, arrays={named[k]: p for k, p in problems.items()})


def _unreadable_index(who: str, arrays_dir: str, specs: dict, keys: list[str],
                      why: str, hint: str = _RESTORE_HINT) -> CorruptCheckpointError:
    """None of ``keys`` can be read because the files indexing them are damaged."""
    ckpt = os.path.dirname(arrays_dir)
    named = [specs[k][0] or "<root>" for k in keys]
    return CorruptCheckpointError(
        f"{who}: checkpoint {ckpt} is damaged: none of its {len(keys)} arrays "
        f"({list_names(named)}) can be read, because {why} (in {arrays_dir}). {hint}",
        where=ckpt, arrays={n: f"cannot be read: {why}" for n in named})


__all__ = ["ARRAYS_DIR", "FORMAT", "READABLE_VERSIONS", "STATE_ROOT", "TRAIN_KEY", "TREE_FILE",
           "VERSION", "Stored", "is_checkpoint", "load_metadata", "load_params", "load_state",
           "read_checkpoint", "read_document", "restore_arrays", "save_params", "write_contents"]
