"""Train-state checkpoints in the format of :mod:`lowrank_jax.io`: keep-N, exact resume, resharding.

A :class:`Checkpointer` saves a whole train state (any pytree: a
:class:`~lowrank_jax.train.state.TrainState` with parameters of any leaf type, optimizer state,
model state, step, RNG key and data position) as one step directory, which is a parameter
checkpoint of :mod:`lowrank_jax.io` (the format is documented there)::

    directory/
      <step>/
        tree.json   # skeleton: node types, static fields, shapes, dtypes, a sha256 per array
        arrays/     # orbax: every non-empty array

For a ``TrainState``, ``tree.json`` holds:

* ``"tree"``: the full parameter tree (``params`` and ``frozen`` rejoined,
  :func:`~lowrank_jax.train.full_params`), so ``lowrank_jax.io.load_params(step_dir)`` gives
  the trained parameters and ``lowrank_jax.io.load_state(step_dir)`` the model state;
* ``"state"``: the model state (``TrainState.model_state``), when there is one;
* ``"train"``: what else the trainer needs::

      {"layout": "train_state", "step": 7, "data_position": 42, "config": {...} or null,
       "frozen": ["bin/w", ...],       # the arrays of "tree" that TrainState.frozen holds
       "trees": {"step": NODE, "opt_state": NODE, "rng": NODE, "data_position": NODE}}

  Optimizer states are ``NamedTuple`` nodes, typed PRNG keys ``"kind": "key"`` arrays;
* ``"metadata"``: the caller's metadata.

Any other pytree (and a ``TrainState`` whose ``params`` and ``frozen`` are not the two sides of
one split, as :func:`~lowrank_jax.train.init_train_state` makes them) is saved whole as
``"tree"`` (``"layout": "tree"``, no ``"trees"``).
:func:`load_train_state` reads a step without ``like`` (optimizer states come back as
namedtuples of the same names and fields).

Restoring into the exact classes and placement needs ``like=``: a state, or an abstract one
with the same structure, typically::

    like = jax.eval_shape(lambda: init_train_state(params, optimizer, key=key))

The stored skeleton is compared with ``like`` before any array is read, so an incompatible
checkpoint fails with the paths, shapes or node fields that differ.

Placement on restore (this is how a checkpoint moves between device counts): each array goes to
the sharding of its ``like`` leaf (``jax.Array.sharding`` or ``jax.ShapeDtypeStruct(...,
sharding=...)``); with ``mesh=`` every array is replicated over ``mesh`` unless its ``like``
leaf already carries a ``NamedSharding`` on that mesh; otherwise it goes to the default device.
NumPy leaves come back as NumPy arrays, Python scalars as Python scalars.

Integrity: a step is written into a temporary sibling directory and renamed into place when
complete (:func:`lowrank_jax.io.atomic_directory`), so an interrupted save never shows up as a
step, and the next :class:`Checkpointer` on the directory removes what killed saves left
behind. Ctrl-C during a save takes effect when the save is done. On restore every array is
checked against its sha256 checksum (``verify=True``), so a truncated, deleted or altered file
gives :class:`CorruptCheckpointError` (from :mod:`lowrank_jax.errors`): one line naming the
step directory, every array path that cannot be read or fails its checksum, and what is wrong,
with nothing else printed. Older steps remain restorable (``restore(step=...)``, or
``restore(fallback=True)`` to take the newest good step with a warning).

Older formats: step directories written by earlier versions (an orbax ``CheckpointManager``
step with ``state/`` and ``meta/`` items, CRC32 checksums and a treedef string, format
``lowrank_jax.train_state`` version 2, and version 1 of lowrank_jax 0.1, whose ``TrainState``
had no ``model_state``) are still restored, bit for bit, into the same ``like``; a directory
may hold steps of both formats (a run resumed after an upgrade), and keep-N removes the old
ones in turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import threading
import uuid
import warnings
import zlib
from typing import Any, Iterator

import jax
import numpy as np

from lowrank_jax.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    MissingFileError,
    OutputExistsError,
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
from lowrank_jax.io.params import (
    ARRAYS_DIR,
    FORMAT,
    READABLE_VERSIONS,
    TRAIN_KEY,
    TREE_FILE,
    VERSION,
    read_document,
    restore_arrays,
    write_contents,
)
from lowrank_jax.io.skeleton import (
    TreeEncoder,
    array_value,
    build_tree,
    collect_arrays,
    flat_arrays,
    join,
    structure_diff,
    treedef_str,
)
from lowrank_jax.leaves import combine, path_str, qualified_name, with_kept_divisor
from lowrank_jax.train.state import TrainState

#: ``"layout"`` of a ``TrainState`` step and of any other tree.
TRAIN_STATE, TREE = "train_state", "tree"
#: The fields of a ``TrainState`` stored in ``train.trees`` (parameters and model state are the
#: checkpoint's ``tree`` and ``state``).
TRAIN_TREES = ("step", "opt_state", "rng", "data_position")
#: The format written by earlier versions (orbax ``CheckpointManager`` steps, CRC32); read only.
LEGACY_FORMAT = "lowrank_jax.train_state"
#: Versions of :data:`LEGACY_FORMAT` read: 1 (lowrank_jax 0.1, a ``TrainState`` without
#: ``model_state``) and 2.
LEGACY_VERSIONS = (1, 2)
_STATE, _META = "state", "meta"
_TRAIN_STATE_CLASS = qualified_name(TrainState)
_EARLIER = "restore an earlier step (restore(step=...) or restore(fallback=True))"


def _ocp():
    import orbax.checkpoint as ocp  # slow import, only needed here

    return ocp


def _config_json(config: Any) -> Any:
    if config is None or isinstance(config, dict):
        return config
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        from lowrank_jax.io import config_to_dict

        try:
            return config_to_dict(config)
        except (TypeError, ConfigError):  # a config class io cannot rebuild: store its fields
            return dataclasses.asdict(config)
    raise ConfigError(f"Checkpointer.save: config must be a dict or a config dataclass, got "
                      f"{type(config).__name__}", where="config",
                      expected="dict or config dataclass", actual=type(config).__name__)


_STEP_NAME = re.compile(r"[0-9]+")


class Checkpointer:
    """Save and restore train states in ``directory``, keeping the newest ``max_to_keep``.

    Args:
      directory: checkpoint root (created if missing); one sub-directory per step.
      max_to_keep: number of newest steps kept (``None``: all).
      verify: check every array against its sha256 checksum on restore (costs one host copy
        of the state). Checksums are always written.
      async_save: return from :meth:`save` once the state is copied to host memory and write
        it in a background thread (call :meth:`wait_until_finished` before relying on the
        files; the next save, :meth:`close` and leaving a ``with`` block wait too). With
        several processes saves are synchronous.
      clean: remove what interrupted saves left behind: the temporary directories of killed
        saves (this format's hidden ``.<step>.tmp-*`` siblings of processes no longer running
        on this host, and the ``<step>.orbax-checkpoint-tmp-*`` directories of the earlier
        format). Done once, here, by process 0. Pass ``False`` when another live process may
        be saving into ``directory`` with the earlier format.

    Multi-process (``jax.distributed``): every process creates the checkpointer on the same
    (shared) directory and calls :meth:`save` and :meth:`restore` with its part of the global
    arrays; orbax writes each shard once and process 0 writes ``tree.json``.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                 verify: bool = True, async_save: bool = False, clean: bool = True):
        if max_to_keep is not None and (isinstance(max_to_keep, bool)
                                        or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ConfigError(f"Checkpointer: max_to_keep must be an int >= 1 or None, got "
                              f"{max_to_keep!r}", where="max_to_keep", expected="int >= 1 or None",
                              actual=max_to_keep)
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep = max_to_keep
        self.verify = verify
        self.async_save = async_save
        self._pending: tuple[threading.Thread, list] | None = None  # an asynchronous save
        if clean and jax.process_index() == 0:
            self.removed_temporaries = _remove_temporaries(self.directory)
        else:
            self.removed_temporaries = []
        os.makedirs(self.directory, exist_ok=True)

    # -----------------------------------------------------------------------------------------
    # Steps.

    def all_steps(self) -> list[int]:
        """Finalized steps on disk, oldest first (an interrupted save is never listed)."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(n) for n in os.listdir(self.directory)
                      if _STEP_NAME.fullmatch(n) and os.path.isdir(self.step_dir(int(n))))

    def latest_step(self) -> int | None:
        """The newest finalized step, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> str:
        """The directory of a step: a :mod:`lowrank_jax.io` checkpoint
        (``lowrank_jax.io.load_params(step_dir)`` gives its parameters).

        Args:
          step: the step number.

        Returns:
          ``directory/<step>`` (whether or not it exists).
        """
        return os.path.join(self.directory, str(int(step)))

    def wait_until_finished(self) -> None:
        """Block until an asynchronous save has been written (and raise what it raised)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        thread, failure = pending
        thread.join()
        if failure:
            raise failure[0]

    def close(self) -> None:
        """Finish a pending asynchronous save."""
        self.wait_until_finished()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # Save.

    def save(self, state: Any, *, metadata: dict | None = None, config: Any = None,
             step: int | None = None) -> int:
        """Save ``state`` as step ``step`` (default ``int(state.step)``).

        Args:
          state: any pytree of arrays (``jax.Array`` sharded or not, NumPy, typed PRNG keys,
            Python scalars) and ``None``; typically a ``TrainState``.
          metadata: JSON-serializable dict stored alongside (``tree.json``'s ``metadata``:
            :meth:`metadata`, :func:`lowrank_jax.io.load_metadata`).
          config: a config dataclass or dict stored alongside.
          step: the step number; required when ``state`` has no ``step`` field.

        Returns:
          The step saved.

        Raises:
          OutputExistsError: the step already exists (nothing is written).
          ConfigError: no step was given for a state without a ``step`` field, or ``metadata``
            or ``config`` cannot be stored.
          LeafTypeError: a node of ``state`` cannot be saved (nothing is written).
        """
        is_train_state = isinstance(state, TrainState)
        if step is None:
            if not is_train_state:
                raise ConfigError("Checkpointer.save: state has no 'step' field; pass step=",
                                  where="step", expected="an int", actual=None)
            step = int(np.asarray(state.step))
        step = int(step)
        if step < 0:
            raise ConfigError(f"Checkpointer.save: step must be >= 0, got {step}", where="step",
                              expected=">= 0", actual=step)
        if metadata is not None and not isinstance(metadata, dict):
            raise ConfigError(f"Checkpointer.save: metadata must be a dict, got "
                              f"{type(metadata).__name__}", where="metadata", expected="dict",
                              actual=type(metadata).__name__)
        self.wait_until_finished()
        if step in self.all_steps():
            raise OutputExistsError(
                f"Checkpointer.save: step {step} already exists at {self.step_dir(step)}; delete "
                "it or save under another step", where=self.step_dir(step))
        text, arrays = _document(state, step, metadata, config)
        if self.async_save and jax.process_count() == 1:
            # the caller may donate the state's buffers to the next step: copy them first
            arrays = {k: np.array(v, copy=True) for k, v in arrays.items()}
            failure: list = []

            def write() -> None:
                try:
                    self._write_step(step, text, arrays)
                except BaseException as e:  # raised by wait_until_finished
                    failure.append(e)

            thread = threading.Thread(target=write, name=f"Checkpointer.save({step})")
            self._pending = (thread, failure)
            thread.start()
            return step
        with _interrupts_deferred():
            self._write_step(step, text, arrays)
        return step

    def _write_step(self, step: int, text: str, arrays: dict) -> None:
        """Write one step atomically, then remove the steps beyond ``max_to_keep``."""
        target = self.step_dir(step)
        if jax.process_count() == 1:
            with files.atomic_directory(target, who="Checkpointer.save") as tmp:
                write_contents(tmp, text, arrays)
        else:
            _write_step_together(target, text, arrays)
        if jax.process_index() == 0:
            self._remove_old_steps()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"lowrank_jax Checkpointer kept {target}")

    def _remove_old_steps(self) -> None:
        if self.max_to_keep is None:
            return
        for s in self.all_steps()[:-self.max_to_keep]:
            # out of the way first: a kill in the middle never leaves half a step listed
            trash = os.path.join(self.directory, f".{s}.removed-{uuid.uuid4().hex[:12]}")
            try:
                os.rename(self.step_dir(s), trash)
            except FileNotFoundError:
                continue
            shutil.rmtree(trash, ignore_errors=True)

    # -----------------------------------------------------------------------------------------
    # Restore.

    def metadata(self, step: int | None = None) -> dict:
        """What was saved besides the arrays (no array is read).

        Args:
          step: the step (default: the newest).

        Returns:
          ``{"format", "version", "layout", "step", "data_position", "metadata", "config",
          "leaves"}``; ``"leaves"`` lists the path, shape, dtype, kind and checksum of each
          array. A step of the earlier format gives the dict it stored (``"format":
          "lowrank_jax.train_state"``, a ``"treedef"`` and CRC32 checksums).
        """
        step = self._resolve(step)
        if _is_legacy(self.step_dir(step)):
            return _legacy_meta(self.step_dir(step))
        doc, tree_file = self._document(step)
        saved = _saved_skeleton(doc, tree_file, self.step_dir(step))
        train = doc.get(TRAIN_KEY) or {}
        leaves = [{"path": p or "<root>", **{k: v for k, v in spec.items() if k != "type"}}
                  for p, spec in flat_arrays(saved)]
        return {"format": doc["format"], "version": doc["version"],
                "layout": train.get("layout", TREE), "step": train.get("step", step),
                "data_position": train.get("data_position"), "metadata": doc["metadata"],
                "config": train.get("config"), "leaves": leaves}

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise MissingFileError(f"Checkpointer: no checkpoint in {self.directory}",
                                   where=self.directory)
        if step is None:
            return steps[-1]
        if int(step) not in steps:
            raise MissingFileError(
                f"Checkpointer: no step {step} in {self.directory}; available steps: {steps}",
                where=self.step_dir(step), expected=steps, actual=step)
        return int(step)

    def _document(self, step: int) -> tuple[dict, str]:
        """The validated ``tree.json`` of a step; a missing or unreadable one is damage."""
        return _read_step_document(self.step_dir(step), "Checkpointer")

    def restore(self, step: int | None = None, *, like: Any, mesh: Any = None,
                fallback: bool = False) -> Any:
        """Restore a saved state onto the shardings given by ``like`` / ``mesh``.

        Args:
          step: the step (default: the newest).
          like: a state or abstract state (``jax.eval_shape`` of the init) with the same
            structure as the saved one; its leaves' shardings say where arrays go.
          mesh: a ``jax.sharding.Mesh``: replicate every array over it (unless the ``like``
            leaf already has a ``NamedSharding`` on this mesh).
          fallback: with ``step=None``, if the newest step is corrupt, warn and try the older
            ones, newest first.

        Returns:
          The state, with ``like``'s structure.

        Raises:
          MissingFileError: no checkpoint, or no such step (a ``FileNotFoundError``).
          IncompatibleCheckpointError: paths, shapes, dtypes or structure differ from ``like``.
          CorruptCheckpointError: files of the step are unreadable or fail their checksums.
        """
        self.wait_until_finished()
        if step is not None or not fallback:
            return self._restore(self._resolve(step), like, mesh)
        steps = self.all_steps()
        if not steps:
            raise MissingFileError(f"Checkpointer: no checkpoint in {self.directory}",
                                   where=self.directory)
        errors = []
        for s in reversed(steps):
            try:
                out = self._restore(s, like, mesh)
            except CorruptCheckpointError as e:
                errors.append(str(e))
                warnings.warn(f"{e}; falling back to an earlier step", stacklevel=2)
                continue
            if errors:
                warnings.warn(f"Checkpointer: restored step {s}, the newest good checkpoint in "
                              f"{self.directory}", stacklevel=2)
            return out
        raise CorruptCheckpointError(
            f"Checkpointer: every checkpoint in {self.directory} is corrupt:\n  "
            + "\n  ".join(errors), where=self.directory)

    def _restore(self, step: int, like: Any, mesh: Any) -> Any:
        where = self.step_dir(step)
        if _is_legacy(where):
            return _restore_legacy(where, like, mesh, self.verify)
        doc, tree_file = self._document(step)
        saved = _saved_skeleton(doc, tree_file, where)
        specs = collect_arrays(saved, tree_file)
        stored = dict(flat_arrays(saved))
        like_skeleton = TreeEncoder("Checkpointer.restore", extended=True,
                                    abstract=True).encode(like)
        wanted = dict(flat_arrays(like_skeleton))
        _check_paths(where, list(stored), list(wanted))
        diff = structure_diff(saved, like_skeleton)
        if diff is not None:
            raise IncompatibleCheckpointError(
                f"Checkpointer: checkpoint {where} has the same array paths as `like` but "
                "another tree structure (container types or static leaf fields such as ranks "
                f"or keep differ): saved vs like {diff}", where=where)
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        shardings, targets = {}, []
        for kp, x in flat:
            path = path_str(kp)
            spec = stored[path]
            _check_leaf(where, path or "<root>", spec, wanted[path])
            sharding = None
            if spec["kind"] in ("jax", "key"):
                sharding = _target_sharding(x, mesh, len(spec["shape"]), spec["kind"] == "key")
                if "key" in spec:
                    shardings[spec["key"]] = sharding
            targets.append((path, spec, sharding))
        # with checksums verified, orbax's metadata need not be read first: a checksum covers
        # an array's dtype, shape and bytes
        arrays = restore_arrays(os.path.join(where, ARRAYS_DIR), specs, set(specs), tree_file,
                                self.verify, "Checkpointer", shardings=shardings,
                                hint=_EARLIER, check_stored=not self.verify) if specs else {}
        leaves = [array_value(spec, arrays, sharding, source=tree_file, path=path)
                  for path, spec, sharding in targets]
        return jax.tree_util.tree_unflatten(treedef, leaves)


def load_train_state(path: str | os.PathLike, *, verify: bool = True) -> Any:
    """The whole state saved in one step directory of a :class:`Checkpointer`, without ``like``.

    Use :meth:`Checkpointer.restore` with ``like=`` to resume training: it restores the exact
    optimizer-state classes and placement. This function is for reading a checkpoint without
    the code that built the state.

    Args:
      path: a step directory (``Checkpointer(directory).step_dir(step)``).
      verify: check every array against its sha256 checksum.

    Returns:
      A :class:`~lowrank_jax.train.TrainState` (``params`` / ``frozen`` split as saved; the
      optimizer state's NamedTuples as namedtuples of the same names and fields, see
      :func:`lowrank_jax.io.skeleton.generic_namedtuple`; arrays on the default device), or,
      for a step that saved another tree, that tree.

    Raises:
      MissingFileError: ``path`` does not exist.
      CheckpointError: ``path`` is a parameter checkpoint without a train state, or a step of
        the earlier format (which needs ``like``); CorruptCheckpointError for damaged files.
    """
    where = os.path.abspath(os.fspath(path))
    if not os.path.exists(where):
        raise MissingFileError(f"load_train_state: no checkpoint at {where} (the path does not "
                               "exist)", where=where, expected="a step directory",
                               actual="nothing")
    if _is_legacy(where):
        raise CheckpointError(where, message=(
            f"load_train_state: {where} is a step of the earlier train-state format (orbax "
            "state/ and meta/); restore it with Checkpointer(directory).restore(like=...)"))
    doc, tree_file = _read_step_document(where, "load_train_state")
    if doc.get(TRAIN_KEY) is None:
        raise CheckpointError(tree_file, message=(
            f"load_train_state: {where} holds parameters, not a train state (its {TREE_FILE} "
            f"has no '{TRAIN_KEY}' section); use lowrank_jax.io.load_params"))
    saved = _saved_skeleton(doc, tree_file, where)
    specs = collect_arrays(saved, tree_file)
    arrays = restore_arrays(os.path.join(where, ARRAYS_DIR), specs, set(specs), tree_file,
                            verify, "load_train_state", check_stored=not verify) if specs else {}
    tree = build_tree(saved, arrays, tree_file)
    return TrainState(*tree) if saved["type"] == "namedtuple" and saved["class"] == \
        _TRAIN_STATE_CLASS else tree


# ---------------------------------------------------------------------------------------------
# The document of a step.

def _split(state: TrainState) -> tuple[Any, list[str]] | None:
    """``(full parameters, paths of the arrays frozen holds)`` when ``state.params`` and
    ``state.frozen`` are the two sides of :func:`~lowrank_jax.leaves.partition` of one tree (as
    :func:`~lowrank_jax.train.init_train_state` makes them), else ``None``."""
    try:
        full = combine(state.params, state.frozen)
    except (ValueError, TypeError):
        return None
    frozen = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(state.frozen)[0]]
    held = set(frozen)
    if len(held) != len(frozen):
        return None
    side = lambda keep: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda kp, x: x if (path_str(kp) in held) == keep else None, full)
    if (jax.tree_util.tree_structure(side(False)) != jax.tree_util.tree_structure(state.params)
            or jax.tree_util.tree_structure(side(True))
            != jax.tree_util.tree_structure(state.frozen)):
        return None
    return full, frozen


def _document(state: Any, step: int, metadata: dict | None,
              config: Any) -> tuple[str, dict[str, Any]]:
    """The text of a step's ``tree.json`` and its arrays (``{key: array}``)."""
    enc = TreeEncoder("Checkpointer.save", extended=True)
    train = {"layout": TREE, "step": step, "data_position": None,
             "config": _config_json(config)}
    split = _split(state) if isinstance(state, TrainState) else None
    doc = {"format": FORMAT, "version": VERSION}
    if split is not None:
        full, frozen = split
        doc["tree"] = enc.encode(full)
        if state.model_state is not None:
            doc["state"] = enc.encode(state.model_state, "model_state")
        train.update(layout=TRAIN_STATE, data_position=int(np.asarray(state.data_position)),
                     frozen=frozen,
                     trees={n: enc.encode(getattr(state, n), n) for n in TRAIN_TREES})
    else:
        doc["tree"] = enc.encode(state)
        if isinstance(state, TrainState):
            train["data_position"] = int(np.asarray(state.data_position))
    doc[TRAIN_KEY] = train
    doc["metadata"] = metadata or {}
    try:
        json.dumps([doc["metadata"], train["config"]], allow_nan=False)  # NaN is not JSON
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Checkpointer.save: metadata or config is not JSON-serializable: "
                          f"{e}", where="metadata") from e
    return json.dumps(doc, allow_nan=True), enc.arrays  # (static fields as save_params)


def _read_step_document(where: str, who: str) -> tuple[dict, str]:
    """``(document, tree_file)`` of a step; damage is a :class:`CorruptCheckpointError`."""
    tree_file = os.path.join(where, TREE_FILE)
    if not os.path.isfile(tree_file):
        raise CorruptCheckpointError(
            f"{who}: checkpoint {where} is damaged: its skeleton {tree_file} is missing; "
            f"{_EARLIER}", where=where)
    try:
        _, tree_file, doc = read_document(where, who)
    except CheckpointError as e:
        if e.expected == list(READABLE_VERSIONS):  # a format version this release cannot read
            raise IncompatibleCheckpointError(str(e), where=where, expected=e.expected,
                                              actual=e.actual) from None
        raise CorruptCheckpointError(
            f"{who}: checkpoint {where} is damaged: its skeleton {tree_file} cannot be read "
            f"({_without_who(e, who)}); {_EARLIER}", where=where) from None
    return doc, tree_file


def _without_who(error: BaseException, who: str) -> str:
    text = " ".join(str(error).split())
    return text[len(who) + 2:] if text.startswith(f"{who}: ") else text


def _prune(spec: Any, path: str, keep: Any) -> Any:
    """A validated skeleton with the arrays whose path ``keep`` rejects set to ``none``."""
    t = spec["type"]
    if t == "array":
        return spec if keep(path) else {"type": "none"}
    if t == "dict" or t in ("namedtuple", "pytree"):
        return dict(spec, items=[[k, _prune(v, join(path, k), keep)] for k, v in spec["items"]])
    if t in ("list", "tuple"):
        return dict(spec, items=[_prune(v, join(path, i), keep)
                                 for i, v in enumerate(spec["items"])])
    if t == "node":
        return dict(spec, data={n: _prune(v, join(path, n), keep) for n, v in spec["data"].items()})
    return spec


def _saved_skeleton(doc: dict, tree_file: str, where: str) -> dict:
    """The skeleton of the object a step saved: a ``TrainState`` put together from the
    checkpoint's sections, or the tree itself."""
    train = doc.get(TRAIN_KEY) or {"layout": TREE}
    sections = {"": doc["tree"]}
    if doc.get("state") is not None:
        sections["model_state"] = doc["state"]
    for name, spec in train.get("trees", {}).items():
        sections[name] = spec
    seen: dict = {}
    try:
        for root, spec in sections.items():
            collect_arrays(spec, tree_file, root=root, out=seen)
    except CheckpointError as e:
        raise CorruptCheckpointError(
            f"Checkpointer: checkpoint {where} is damaged: {_without_who(e, 'load_params')}; "
            f"{_EARLIER}", where=where) from None
    layout = train.get("layout")
    if layout == TREE:
        return doc["tree"]
    frozen, trees = train.get("frozen"), train.get("trees")
    if (layout != TRAIN_STATE or not isinstance(frozen, list)
            or not all(isinstance(p, str) for p in frozen) or set(trees) != set(TRAIN_TREES)):
        raise CorruptCheckpointError(
            f"Checkpointer: checkpoint {where} is damaged: the '{TRAIN_KEY}' section of "
            f"{tree_file} is not a train state (layout {layout!r}, 'frozen' a list of paths, "
            f"'trees' {list(TRAIN_TREES)}); {_EARLIER}", where=where)
    held = set(frozen)
    parts = {n: trees[n] for n in TRAIN_TREES}
    parts["params"] = _prune(doc["tree"], "", lambda p: p not in held)
    parts["frozen"] = _prune(doc["tree"], "", lambda p: p in held)
    parts["model_state"] = doc["state"] if doc.get("state") is not None else {"type": "none"}
    return {"type": "namedtuple", "class": _TRAIN_STATE_CLASS,
            "items": [[f, parts[f]] for f in TrainState._fields]}


def _check_paths(where: str, stored: list[str], wanted: list[str]) -> None:
    have, want = set(stored), set(wanted)
    missing = [p or "<root>" for p in wanted if p not in have]
    extra = [p or "<root>" for p in stored if p not in want]
    if missing or extra:
        raise IncompatibleCheckpointError(
            f"Checkpointer: checkpoint {where} does not match `like`: it holds "
            f"{len(stored)} arrays, `like` {len(wanted)}; in `like` but not saved: "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; saved but not in `like`: "
            f"{extra[:5]}{' ...' if len(extra) > 5 else ''}", where=where)


#: NumPy dtype kinds a ``like`` leaf may have where a Python scalar was saved.
_PYTHON_SCALAR_KINDS = {"bool": "b", "int": "iu", "float": "f"}


def _check_leaf(where: str, path: str, spec: dict, want: dict) -> None:
    """A stored array against the ``like`` leaf at the same path (kind, dtype, shape)."""
    shape, like_shape = list(spec["shape"]), list(want["shape"])
    if spec["kind"] == "key" and want["kind"] != "key":
        raise IncompatibleCheckpointError(
            f"Checkpointer: checkpoint {where}: '{path}' is a PRNG key ({spec['impl']}) but "
            f"`like` has {want['dtype']}{like_shape}", where=where)
    same = spec["dtype"] == want["dtype"]
    if spec["kind"] in _PYTHON_SCALAR_KINDS and want["kind"] != "key":  # as jax.eval_shape
        same = np.dtype(want["dtype"]).kind in _PYTHON_SCALAR_KINDS[spec["kind"]]  # gives them
    if (spec["kind"] == "key") != (want["kind"] == "key") or not same:
        raise IncompatibleCheckpointError(
            f"Checkpointer: checkpoint {where}: '{path}' is {spec['dtype']}{shape} but `like` "
            f"has {'a PRNG key of ' if want['kind'] == 'key' else ''}{want['dtype']}{like_shape}",
            where=where, expected=f"{want['dtype']}{like_shape}", actual=f"{spec['dtype']}{shape}")
    if shape != like_shape:
        raise IncompatibleCheckpointError(
            f"Checkpointer: checkpoint {where}: '{path}' has shape {shape} but `like` has "
            f"{like_shape}", where=where, expected=like_shape, actual=shape)


def _write_step_together(target: str, text: str, arrays: dict) -> None:
    """Write a step from several processes: process 0 names the temporary directory, every
    process writes its shards into it, process 0 writes ``tree.json`` and renames it."""
    from jax.experimental import multihost_utils

    primary = jax.process_index() == 0
    name = files.temp_path(target).encode() if primary else b""
    if len(name) > 4096:
        raise ConfigError(f"Checkpointer.save: the path {target} is too long", where=target)
    buf = np.zeros(4096, np.uint8)
    buf[:len(name)] = np.frombuffer(name, np.uint8)
    tmp = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).rstrip(b"\0").decode()
    if primary:
        files.clean_stale(target)
        os.makedirs(tmp)
    multihost_utils.sync_global_devices(f"lowrank_jax Checkpointer start {target}")
    write_contents(tmp, text, arrays, write_document=primary)
    multihost_utils.sync_global_devices(f"lowrank_jax Checkpointer written {target}")
    if primary:
        try:
            files.rename_noreplace(tmp, target)
        except FileExistsError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise OutputExistsError(f"Checkpointer.save: step {target} appeared while it was "
                                    "being written (another writer?)", where=target) from None
    multihost_utils.sync_global_devices(f"lowrank_jax Checkpointer renamed {target}")


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the block is done, then raise ``KeyboardInterrupt``.

    An interrupt in the middle of an orbax save leaves its writer threads running into
    interpreter shutdown (each prints a traceback) and the step unfinished; a save takes a
    fraction of a second, so it is allowed to finish. Only the main thread can install signal
    handlers; elsewhere, or when SIGINT is not Python's default handler, nothing changes.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


_TMP_MARK = ".orbax-checkpoint-tmp"
_OURS = re.compile(r"^\.([0-9]+)\.(?:(tmp|old)-|removed-)")


def _remove_temporaries(directory: str) -> list[str]:
    """Delete what interrupted saves and removals left in ``directory`` (see ``clean``)."""
    if not os.path.isdir(directory):
        return []
    removed, steps = [], set()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        m = _OURS.match(name)
        if m is not None and m.group(2):  # a save's temporary: only a dead process's
            steps.add(m.group(1))
        elif _TMP_MARK in name or m is not None:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            removed.append(path)
    for step in sorted(steps, key=int):
        removed += files.clean_stale(os.path.join(directory, step))
    return sorted(removed)


def _target_sharding(x: Any, mesh: Any, ndim: int, is_key: bool):
    """Where a restored array goes: see the module docstring."""
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    s = x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
    if mesh is not None:
        if isinstance(s, NamedSharding) and s.mesh == mesh:
            pass
        else:
            return NamedSharding(mesh, PartitionSpec())
    if s is None:
        return SingleDeviceSharding(jax.devices()[0])
    if is_key:  # key data has trailing dims the key array does not: extend the spec
        if isinstance(s, NamedSharding):
            spec = tuple(s.spec) + (None,) * (ndim - len(tuple(s.spec)))
            return NamedSharding(s.mesh, PartitionSpec(*spec))
        if isinstance(s, SingleDeviceSharding):
            return s
        if s.is_fully_replicated:
            devices = np.array(sorted(s.device_set, key=lambda d: d.id))
            return NamedSharding(jax.sharding.Mesh(devices, ("r",)), PartitionSpec())
        raise IncompatibleCheckpointError(
            f"Checkpointer: cannot place a PRNG key with sharding {s}; give `like` a "
            "NamedSharding for it", where="like")
    return s


# ---------------------------------------------------------------------------------------------
# Steps of the earlier format (read only): orbax CheckpointManager items state/ (the flattened
# arrays, arr_000000, ...) and meta/ (JSON: paths, shapes, dtypes, CRC32s, treedef string).

_ARRAYS = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)


def _is_legacy(where: str) -> bool:
    """Whether a step directory was written in the earlier format."""
    return (os.path.isdir(os.path.join(where, _META))
            and not os.path.exists(os.path.join(where, TREE_FILE)))


def _dtype(x: Any) -> Any:
    """The dtype of an array, abstract array or Python scalar (``None`` for other objects)."""
    if isinstance(x, _ARRAYS):
        return x.dtype
    if isinstance(x, (bool, int, float)):
        return np.asarray(x).dtype
    return None


def _is_key(x: Any) -> bool:
    dt = _dtype(x)
    return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)


def _crc(x: Any) -> int | None:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            return None  # multi-process: no process sees every shard
        x = x.addressable_data(0)  # a whole copy lives in every process
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    return zlib.crc32(a.view(np.uint8))


def _first_diff(a: str, b: str, width: int = 60) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    lo = max(0, i - width)
    return f"...{a[lo:i + width]}... vs ...{b[lo:i + width]}..."


def _legacy_meta(where: str) -> dict:
    file = os.path.join(where, _META, "metadata")
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            f"Checkpointer: checkpoint {where} is damaged: its metadata {where}/{_META} "
            f"cannot be read ({describe(e, root=where)}); {_EARLIER}", where=where) from None
    if not isinstance(meta, dict) or meta.get("format") != LEGACY_FORMAT:
        raise CorruptCheckpointError(
            f"Checkpointer: {where}/{_META} is not a lowrank_jax train-state checkpoint "
            f"(format {meta.get('format') if isinstance(meta, dict) else None!r})",
            where=where)
    if meta.get("version") not in LEGACY_VERSIONS:
        raise IncompatibleCheckpointError(
            f"Checkpointer: {where} has format version {meta.get('version')!r}; this "
            f"lowrank_jax reads versions {LEGACY_VERSIONS}", where=where)
    if not isinstance(meta.get("leaves"), list):
        raise CorruptCheckpointError(f"Checkpointer: {where}/{_META} has no 'leaves' list",
                                     where=where)
    return meta


def _restore_legacy(where: str, like: Any, mesh: Any, verify: bool) -> Any:
    """Restore a step of the earlier format into ``like`` (see the module docstring)."""
    ocp = _ocp()
    meta = _legacy_meta(where)
    entries = meta["leaves"]
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    paths = [path_str(kp) or "<root>" for kp, _ in flat]
    stored_paths = [e.get("path") for e in entries]
    if paths != stored_paths:
        missing = [p for p in paths if p not in stored_paths]
        extra = [p for p in stored_paths if p not in paths]
        raise IncompatibleCheckpointError(
            f"Checkpointer: checkpoint {where} does not match `like`: it holds "
            f"{len(stored_paths)} arrays, `like` {len(paths)}; in `like` but not saved: "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; saved but not in `like`: "
            f"{extra[:5]}{' ...' if len(extra) > 5 else ''}"
            + ("" if missing or extra else " (same paths in another order)"), where=where)
    mine = treedef_str(treedef)
    if meta["version"] == 1:
        mine = _as_version_1(like, mine)
        treedef = _kept_divisor_v1(like, treedef)
    if meta.get("treedef") != mine:
        raise IncompatibleCheckpointError(
            f"Checkpointer: checkpoint {where} has the same array paths as `like` but "
            "another tree structure (container types or static leaf fields such as ranks "
            f"or keep differ): saved vs like: {_first_diff(meta.get('treedef', ''), mine)}",
            where=where)

    targets, args = [], {}
    for (_, x), e, path in zip(flat, entries, paths, strict=True):
        shape, dtype = tuple(e["shape"]), np.dtype(e["dtype"])
        like_shape = tuple(np.shape(x))
        like_dtype = _dtype(x)
        if e["kind"] == "key":
            if not _is_key(x):
                raise IncompatibleCheckpointError(
                    f"Checkpointer: checkpoint {where}: '{path}' is a PRNG key "
                    f"({e['impl']}) but `like` has {like_dtype}", where=where)
            want = shape[:len(like_shape)]
        else:
            want = shape
            if like_dtype is None or _is_key(x) or np.dtype(like_dtype) != dtype:
                raise IncompatibleCheckpointError(
                    f"Checkpointer: checkpoint {where}: '{path}' is "
                    f"{dtype.name}{list(shape)} but `like` has {like_dtype}{list(like_shape)}",
                    where=where, expected=f"{like_dtype}{list(like_shape)}",
                    actual=f"{dtype.name}{list(shape)}")
        if tuple(want) != like_shape:
            raise IncompatibleCheckpointError(
                f"Checkpointer: checkpoint {where}: '{path}' has shape {list(want)} but "
                f"`like` has {list(like_shape)}", where=where, expected=list(like_shape),
                actual=list(want))
        sharding = None
        if e["kind"] in ("jax", "key"):
            sharding = _target_sharding(x, mesh, len(shape), e["kind"] == "key")
        targets.append(sharding)
        if e["key"] is not None:
            if sharding is None:
                args[e["key"]] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
            else:
                args[e["key"]] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape,
                                                      dtype=dtype)

    state_dir = os.path.join(where, _STATE)
    arrays, problems = {}, {}
    if args:
        try:
            with quiet_reads():
                arrays = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
                    item={k: 0 for k in args}, restore_args=args))
        except Exception as e:  # orbax/tensorstore raise many types for bad files
            arrays, problems = _read_each_legacy(where, entries, args, e)
    if not isinstance(arrays, dict):
        arrays = {}
    if verify:
        for e in entries:
            a = arrays.get(e["key"]) if e["key"] is not None else None
            if a is None or e.get("crc32") is None:
                continue
            crc = _crc(a)
            if crc is not None and crc != e["crc32"]:
                problems[e["key"]] = (f"fails its checksum (crc32 {crc:#010x}, saved "
                                      f"{e['crc32']:#010x})")
    if problems:
        named = {e["key"]: e["path"] for e in entries if e["key"] is not None}
        body = list_damage({(named[k], k): p for k, p in problems.items()}, state_dir)
        raise CorruptCheckpointError(
            f"Checkpointer: checkpoint {where} is damaged: {body}; {_EARLIER}", where=where,
            arrays={named[k]: p for k, p in problems.items()})
    leaves = []
    for e, sharding in zip(entries, targets, strict=True):
        shape, dtype = tuple(e["shape"]), np.dtype(e["dtype"])
        if e["key"] is None:
            a = np.zeros(shape, dtype)
            a = a if sharding is None else jax.device_put(a, sharding)
        else:
            a = arrays.get(e["key"])
            if a is None:
                raise CorruptCheckpointError(
                    f"Checkpointer: checkpoint {where}: array '{e['path']}' ({e['key']}) is "
                    f"missing from {_STATE}/", where=where)
        kind = e["kind"]
        if kind == "key":
            a = jax.random.wrap_key_data(a, impl=e["impl"])
        elif kind == "numpy":
            a = np.asarray(a)
        elif kind == "numpy_scalar":
            a = np.asarray(a)[()]
        elif kind in ("bool", "int", "float"):
            a = {"bool": bool, "int": int, "float": float}[kind](np.asarray(a).item())
        leaves.append(a)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _read_each_legacy(where: str, entries: list[dict], args: dict,
                      error: BaseException) -> tuple[dict, dict]:
    """After reading a step's arrays together failed: the arrays that can be read and, for
    each other one, what is wrong (``{key: text}``), or :class:`CorruptCheckpointError` when
    the files indexing them are damaged (then none can be read)."""
    state_dir = os.path.join(where, _STATE)
    why = index_damage(state_dir)
    if why is not None:
        paths = [e["path"] for e in entries if e["key"] is not None]
        raise CorruptCheckpointError(
            f"Checkpointer: checkpoint {where} is damaged: none of its {len(paths)} arrays "
            f"({list_names(paths)}) can be read, because {why} (in {state_dir}); {_EARLIER}",
            where=where, arrays={p: f"cannot be read: {why}" for p in paths})
    arrays, problems = read_each(state_dir, args, partial=len(args) > 1)
    if not problems:  # each array reads alone: say what the whole read said
        raise CorruptCheckpointError(
            f"Checkpointer: checkpoint {where} is damaged: its arrays cannot be read together "
            f"({describe(error, root=state_dir)}); {_EARLIER}", where=where)
    return arrays, {k: f"cannot be read: {p}" for k, p in problems.items()}


_V2_TAIL = ", None]))"


def _as_version_1(like: Any, treedef: str) -> str:
    """The treedef string a version-1 checkpoint holds for ``like``.

    Version 1 wrote ``TrainState`` without its last field, ``model_state``; a ``like`` whose
    ``model_state`` is ``None`` (an empty subtree, the last child of the node) has the same
    arrays, and its treedef string without that child is what version 1 wrote.
    """
    if isinstance(like, TrainState) and like.model_state is None and treedef.endswith(_V2_TAIL):
        treedef = treedef[: -len(_V2_TAIL)] + "]))"
    # version 1 had no MaskedBinary.divisor (its alpha divided by the kept count)
    return re.sub(r"MaskedBinary\[\(([^()]*?), '(?:reference|kept)'\)\]", r"MaskedBinary[(\1,)]",
                  treedef)


def _kept_divisor_v1(like: Any, treedef: Any) -> Any:
    """``like`` 's structure with every :class:`~lowrank_jax.MaskedBinary` set to
    ``divisor='kept'``: lowrank_jax 0.1 divided Biprop's gain by the kept count, so a state it
    saved keeps computing what it was trained to compute."""

    return jax.tree_util.tree_structure(with_kept_divisor(like))


__all__ = ["Checkpointer", "load_train_state"]
