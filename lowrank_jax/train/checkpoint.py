"""Train-state checkpoints with orbax ``CheckpointManager``: keep-N, exact resume, resharding.

A :class:`Checkpointer` saves a whole train state (any pytree: a
:class:`~lowrank_jax.train.state.TrainState` with parameters of any leaf type, optimizer state,
model state, step, RNG key and data position) as one orbax step directory with two items::

    directory/
      <step>/
        state/   # orbax StandardSave of the flattened state: {"arr_000000": array, ...}
        meta/    # JSON: format, step, data_position, the tree's paths, shapes, dtypes and
                 #   CRC32 checksums, its treedef, the caller's metadata and config

Why flattened: the tree's *structure* (leaf dataclasses, their static fields such as
``HeadLowRank.ranks`` or ``MaskedBinary.keep``, ``None`` entries, NamedTuples of optax states)
is not data; it comes from ``like`` on restore. Restoring therefore needs ``like=``: a state, or
an abstract one with the same treedef, typically::

    like = jax.eval_shape(lambda: init_train_state(params, optimizer, key=key))

The stored paths, shapes, dtypes and treedef are compared with ``like`` before any array is read,
so an incompatible checkpoint fails with the paths that differ.

Placement on restore (this is how a checkpoint moves between device counts): each array goes to
the sharding of its ``like`` leaf (``jax.Array.sharding`` or ``jax.ShapeDtypeStruct(...,
sharding=...)``); with ``mesh=`` every array is replicated over ``mesh`` unless its ``like``
leaf already carries a ``NamedSharding`` on that mesh; otherwise it goes to the default device.
NumPy leaves come back as NumPy arrays. Typed PRNG keys (``jax.random.key``) are stored as
their key data and rewrapped.

Integrity: orbax writes a step into a temporary directory and renames it when complete, so an
interrupted save never shows up as a step (``latest_step()`` ignores it), and the next
:class:`Checkpointer` on the directory removes its temporary directory. On restore the CRC32
of every array is checked against the one recorded at save time (``verify=True``), so a
truncated, deleted or bit-flipped file gives :class:`CorruptCheckpointError` (from
:mod:`lowrank_jax.errors`): one line naming the step directory, every array path that cannot be
read or fails its checksum, and what is wrong, with nothing else printed. Older steps remain
restorable (``restore(step=...)``, or ``restore(fallback=True)`` to take the newest good step
with a warning).

Versions: this module writes format version 2 (``TrainState`` has a ``model_state`` field) and
reads version 1 (the first release, whose ``TrainState`` had no ``model_state``) into a
``like`` whose ``model_state`` is ``None``.
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
import warnings
import zlib
from typing import Any, Iterator

import jax
import numpy as np

from lowrank_jax.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    LeafTypeError,
    MissingFileError,
    OutputExistsError,
)
from lowrank_jax.io._reads import (
    describe,
    index_damage,
    list_damage,
    list_names,
    quiet_reads,
    read_each,
)
from lowrank_jax.leaves import path_str, with_kept_divisor
from lowrank_jax.train.state import TrainState

FORMAT = "lowrank_jax.train_state"
#: Format version written. Version 1 (lowrank_jax 0.1: a ``TrainState`` without
#: ``model_state``) is still read.
VERSION = 2
READABLE_VERSIONS = (1, 2)
_STATE, _META = "state", "meta"


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint is intact but does not match ``like`` (paths, shapes, dtypes, structure).

    Args:
      message: the full message (it names the step directory).
      where: the step directory.
      expected, actual: what ``like`` has and what the checkpoint holds, where one value
        differs.
    """

    def __init__(self, message: str, *, where: str, expected: Any = None, actual: Any = None):
        super().__init__(where, message=message, expected=expected, actual=actual)


def _ocp():
    import orbax.checkpoint as ocp  # slow import, only needed here

    return ocp


def _treedef_str(treedef) -> str:
    # Object addresses (reprs of static callables) differ between processes: drop them.
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(treedef))


_ARRAYS = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)


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


class Checkpointer:
    """Save and restore train states in ``directory``, keeping the newest ``max_to_keep``.

    Args:
      directory: checkpoint root (created if missing); one sub-directory per step.
      max_to_keep: number of newest steps kept (``None``: all).
      verify: check array checksums on restore (costs one host copy of the state).
      async_save: let orbax write in the background (call :meth:`wait_until_finished`
        before relying on the files); synchronous by default.
      clean: remove the temporary directories of saves that were interrupted (a killed
        process leaves ``<step>.orbax-checkpoint-tmp-*`` behind; such a step was never
        finalized and is not restorable). Done once, here, by process 0. Pass ``False`` when
        another live process may be saving into ``directory``.

    Multi-process (``jax.distributed``): every process creates the checkpointer on the same
    (shared) directory and calls :meth:`save` and :meth:`restore` with its part of the global
    arrays; orbax writes each shard once.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                 verify: bool = True, async_save: bool = False, clean: bool = True):
        ocp = _ocp()
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ConfigError(f"Checkpointer: max_to_keep must be an int >= 1 or None, got "
                              f"{max_to_keep!r}", where="max_to_keep", expected="int >= 1 or None",
                              actual=max_to_keep)
        self.directory = os.path.abspath(os.fspath(directory))
        self.verify = verify
        if clean and jax.process_index() == 0:
            self.removed_temporaries = _remove_temporaries(self.directory)
        else:
            self.removed_temporaries = []
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save),
        )

    # -----------------------------------------------------------------------------------------
    # Steps.

    def all_steps(self) -> list[int]:
        """Finalized steps on disk, oldest first (an interrupted save is never listed)."""
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finalized step, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> str:
        """The directory of a step.

        Args:
          step: the step number.

        Returns:
          ``directory/<step>`` (whether or not it exists).
        """
        return os.path.join(self.directory, str(int(step)))

    def wait_until_finished(self) -> None:
        """Block until an asynchronous save has been written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release orbax's resources."""
        self._manager.close()

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
          metadata: JSON-serializable dict stored alongside (see :meth:`metadata`).
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
        ocp = _ocp()
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
        if step in self.all_steps():
            raise OutputExistsError(
                f"Checkpointer.save: step {step} already exists at {self.step_dir(step)}; delete "
                "it or save under another step", where=self.step_dir(step))

        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        arrays, entries = {}, []
        for i, (kp, x) in enumerate(flat):
            path = path_str(kp) or "<root>"
            impl = None
            if isinstance(x, jax.Array):
                kind = "jax"
                if _is_key(x):
                    kind, impl = "key", str(jax.random.key_impl(x))
                    x = jax.random.key_data(x)
            elif isinstance(x, np.ndarray):
                kind = "numpy"
            elif isinstance(x, np.generic):
                kind, x = "numpy_scalar", np.asarray(x)
            elif isinstance(x, (bool, int, float)):
                kind, x = type(x).__name__, np.asarray(x)
            else:
                raise LeafTypeError(
                    f"Checkpointer.save: state node '{path}' has type {type(x).__name__}; a "
                    "state holds arrays, Python scalars and None in pytree containers",
                    where=path, expected="array, Python scalar or None",
                    actual=type(x).__name__)
            key = f"arr_{i:06d}"
            entry = {"path": path, "kind": kind, "shape": list(x.shape),
                     "dtype": np.dtype(x.dtype).name, "impl": impl, "key": None, "crc32": None}
            if x.size:  # orbax refuses zero-size arrays; the entry alone describes them
                entry["key"] = key
                entry["crc32"] = _crc(x) if self.verify else None
                arrays[key] = x
            entries.append(entry)

        position = int(np.asarray(state.data_position)) if is_train_state else None
        meta = {"format": FORMAT, "version": VERSION, "step": step,
                "data_position": position, "treedef": _treedef_str(treedef),
                "leaves": entries, "metadata": metadata or {}, "config": _config_json(config)}
        try:
            json.dumps(meta, allow_nan=False)  # orbax would write NaN, which is not JSON
        except (TypeError, ValueError) as e:
            raise ConfigError(f"Checkpointer.save: metadata or config is not JSON-serializable: "
                              f"{e}", where="metadata") from e
        with _interrupts_deferred():
            self._manager.save(step, args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(arrays), _META: ocp.args.JsonSave(meta)}),
                force=True)
        return step

    # -----------------------------------------------------------------------------------------
    # Restore.

    def metadata(self, step: int | None = None) -> dict:
        """What was saved besides the arrays (no array is read).

        Args:
          step: the step (default: the newest).

        Returns:
          ``{"format", "version", "step", "data_position", "metadata", "config", "treedef",
          "leaves"}``; ``"leaves"`` lists the path, shape, dtype and checksum of each array.
        """
        step = self._resolve(step)
        return self._read_meta(step)

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

    def _read_meta(self, step: int) -> dict:
        ocp = _ocp()
        where = self.step_dir(step)
        try:
            with quiet_reads():
                out = self._manager.restore(step, args=ocp.args.Composite(
                    **{_META: ocp.args.JsonRestore()}))
            meta = out[_META]
        except Exception as e:  # orbax raises many types for unreadable files
            raise CorruptCheckpointError(
                f"Checkpointer: checkpoint {where} is damaged: its metadata {where}/{_META} "
                f"cannot be read ({describe(e, root=where)}); {_EARLIER}", where=where) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptCheckpointError(
                f"Checkpointer: {where}/{_META} is not a lowrank_jax train-state checkpoint "
                f"(format {meta.get('format') if isinstance(meta, dict) else None!r})",
                where=where)
        if meta.get("version") not in READABLE_VERSIONS:
            raise IncompatibleCheckpointError(
                f"Checkpointer: {where} has format version {meta.get('version')!r}; this "
                f"lowrank_jax reads versions {READABLE_VERSIONS}", where=where)
        if not isinstance(meta.get("leaves"), list):
            raise CorruptCheckpointError(f"Checkpointer: {where}/{_META} has no 'leaves' list",
                                         where=where)
        return meta

    def restore(self, step: int | None = None, *, like: Any, mesh: Any = None,
                fallback: bool = False) -> Any:
        """Restore a saved state onto the shardings given by ``like`` / ``mesh``.

        Args:
          step: the step (default: the newest).
          like: a state or abstract state (``jax.eval_shape`` of the init) with the same
            treedef as the saved one; its leaves' shardings say where arrays go.
          mesh: a ``jax.sharding.Mesh``: replicate every array over it (unless the ``like``
            leaf already has a ``NamedSharding`` on this mesh).
          fallback: with ``step=None``, if the newest step is corrupt, warn and try the older
            ones, newest first.

        Returns:
          The state, with ``like``'s treedef.

        Raises:
          MissingFileError: no checkpoint, or no such step (a ``FileNotFoundError``).
          IncompatibleCheckpointError: paths, shapes, dtypes or structure differ from ``like``.
          CorruptCheckpointError: files of the step are unreadable or fail their checksums.
        """
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
        ocp = _ocp()
        where = self.step_dir(step)
        meta = self._read_meta(step)
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
        mine = _treedef_str(treedef)
        if meta["version"] == 1:
            mine = _as_version_1(like, mine)
            treedef = _kept_divisor_v1(like, treedef)
        if meta.get("treedef") != mine:
            raise IncompatibleCheckpointError(
                f"Checkpointer: checkpoint {where} has the same array paths as `like` but "
                "another tree structure (container types or static leaf fields such as ranks "
                f"or keep differ): saved vs like: {_first_diff(meta.get('treedef', ''), mine)}",
                where=where)

        targets, abstract = [], {}
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
                    abstract[e["key"]] = np.zeros(shape, dtype)
                else:
                    abstract[e["key"]] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        arrays, problems = {}, {}
        if abstract:
            try:
                with quiet_reads():
                    out = self._manager.restore(step, args=ocp.args.Composite(
                        **{_STATE: ocp.args.StandardRestore(abstract)}))
                arrays = out[_STATE]
            except Exception as e:  # orbax/tensorstore raise many types for bad files
                arrays, problems = _read_each(where, entries, abstract, e)
        if not isinstance(arrays, dict):
            arrays = {}
        if self.verify:
            for e in entries:
                a = arrays.get(e["key"]) if e["key"] is not None else None
                if a is None or e.get("crc32") is None:
                    continue
                crc = _crc(a)
                if crc is not None and crc != e["crc32"]:
                    problems[e["key"]] = (f"fails its checksum (crc32 {crc:#010x}, saved "
                                          f"{e['crc32']:#010x})")
        if problems:
            paths = {e["key"]: e["path"] for e in entries if e["key"] is not None}
            body = list_damage({(paths[k], k): p for k, p in problems.items()},
                               os.path.join(where, _STATE))
            raise CorruptCheckpointError(
                f"Checkpointer: checkpoint {where} is damaged: {body}; {_EARLIER}", where=where,
                arrays={paths[k]: p for k, p in problems.items()})
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


def _remove_temporaries(directory: str) -> list[str]:
    """Delete the unfinished step directories of interrupted saves in ``directory``."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        if _TMP_MARK in name:
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            removed.append(path)
    return removed


_EARLIER = "restore an earlier step (restore(step=...) or restore(fallback=True))"


def _read_each(where: str, entries: list[dict], abstract: dict,
               error: BaseException) -> tuple[dict, dict]:
    """After reading a step's arrays together failed: the arrays that can be read and, for
    each other one, what is wrong (``{key: text}``), or :class:`CorruptCheckpointError` when
    the files indexing them are damaged (then none can be read)."""
    ocp = _ocp()
    state_dir = os.path.join(where, _STATE)
    why = index_damage(state_dir)
    if why is not None:
        paths = [e["path"] for e in entries if e["key"] is not None]
        raise CorruptCheckpointError(
            f"Checkpointer: checkpoint {where} is damaged: none of its {len(paths)} arrays "
            f"({list_names(paths)}) can be read, because {why} (in {state_dir}); {_EARLIER}",
            where=where, arrays={p: f"cannot be read: {why}" for p in paths})
    args = {}
    for key, x in abstract.items():
        if isinstance(x, jax.ShapeDtypeStruct):
            args[key] = ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                             dtype=x.dtype)
        else:
            args[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
    arrays, problems = read_each(state_dir, args, partial=len(args) > 1)
    if not problems:  # each array reads alone: say what the whole read said
        raise CorruptCheckpointError(
            f"Checkpointer: checkpoint {where} is damaged: its arrays cannot be read together "
            f"({describe(error, root=state_dir)}); {_EARLIER}", where=where)
    return arrays, {k: f"cannot be read: {p}" for k, p in problems.items()}


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


__all__ = ["CheckpointError", "Checkpointer", "CorruptCheckpointError",
           "IncompatibleCheckpointError"]
