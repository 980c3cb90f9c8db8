"""Save and load parameter trees: orbax stores the arrays, ``tree.json`` the skeleton.

A checkpoint written by :func:`save_params` is a directory::

    path/
      tree.json   # format tag, skeleton (containers, leaf classes, static fields), metadata
      arrays/     # an orbax PyTree checkpoint: one entry per non-empty array, keyed arr_000000...

The skeleton records everything that is not array data: dict keys (in insertion order), list
versus tuple, ``None``, the class of every :class:`~lowrank_jax.Leaf` and its static fields
(``HeadLowRank.ranks``, ``MaskedBinary.keep``, ...), and the shape, dtype and kind (``jax.Array``
or ``numpy.ndarray``) of every array. :func:`load_params` therefore rebuilds the same tree (same
treedef, same dtypes, bit-identical arrays) without being given a target.

Leaf classes are looked up by name among the loaded subclasses of :class:`~lowrank_jax.Leaf`
(type dispatch; nothing is imported by name from the file). A checkpoint that uses a leaf type
defined outside lowrank_jax loads once the module defining it has been imported.

Zero-size arrays (orbax refuses them) are recorded in the skeleton only. ``jax.Array`` values
are restored on the default device (one device, unsharded) so that a checkpoint loads on any
topology; place them with ``jax.device_put`` afterwards.

Writes are atomic on a local filesystem: everything goes to a temporary directory next to the
target, which is renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.leaves.base import Leaf

FORMAT = "lowrank_jax.params"
VERSION = 1
TREE_FILE = "tree.json"
ARRAYS_DIR = "arrays"

_KINDS = ("jax", "numpy", "numpy_scalar")


# ---------------------------------------------------------------------------------------------
# Leaf registry.

def _leaf_classes() -> list[type]:
    """Every loaded subclass of :class:`Leaf`, found recursively (type dispatch)."""
    out, stack = [], list(Leaf.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls not in out:
            out.append(cls)
            stack.extend(cls.__subclasses__())
    return out


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _find_leaf_class(name: str, qualname: str | None) -> type | None:
    classes = _leaf_classes()
    if qualname is not None:
        for cls in classes:
            if _qualified(cls) == qualname:
                return cls
    by_name = [cls for cls in classes if cls.__name__ == name]
    return by_name[0] if len(by_name) == 1 else None


# ---------------------------------------------------------------------------------------------
# Encoding: tree -> (skeleton, {key: array}).

def _where(path: str) -> str:
    return f"at '{path}'" if path else "at the root"


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _encode_static(value: Any, where: str) -> Any:
    """A static (non-array) leaf field as JSON; tuples and lists are tagged to stay distinct."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if type(value) is tuple:
        return {"tuple": [_encode_static(v, where) for v in value]}
    if type(value) is list:
        return {"list": [_encode_static(v, where) for v in value]}
    raise TypeError(
        f"save_params: static field {where} has a value of type {type(value).__name__}; only "
        "None, bool, int, float, str and tuples/lists of them can be saved"
    )


def _decode_static(value: Any, err) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, items), = value.items()
        if tag in ("tuple", "list") and isinstance(items, list):
            items = [_decode_static(v, err) for v in items]
            return tuple(items) if tag == "tuple" else items
    raise err("a static value (JSON scalar, {'tuple': [...]} or {'list': [...]})",
              repr(value))


class _Encoder:
    def __init__(self):
        self.arrays: dict[str, Any] = {}

    def node(self, x: Any, path: str) -> dict:
        if x is None:
            return {"type": "none"}
        if isinstance(x, Leaf):
            return self.leaf(x, path)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return self.array(x, path)
        if type(x) is dict:
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(
                        f"save_params: dict {_where(path)} has a key {k!r} of type "
                        f"{type(k).__name__}; only str and int keys can be saved"
                    )
                items.append([k, self.node(v, _join(path, k))])
            return {"type": "dict", "items": items}
        if type(x) in (list, tuple):
            items = [self.node(v, _join(path, i)) for i, v in enumerate(x)]
            return {"type": type(x).__name__, "items": items}
        raise TypeError(
            f"save_params: unsupported node {_where(path)} of type {type(x).__name__}; a "
            "parameter tree holds dicts, lists, tuples, None, Leaf instances and arrays"
        )

    def leaf(self, x: Leaf, path: str) -> dict:
        cls = type(x)
        if not dataclasses.is_dataclass(x):
            raise TypeError(f"save_params: leaf {_where(path)} ({cls.__name__}) is not a dataclass")
        children, _ = jax.tree_util.flatten_one_level_with_keys(x)
        data = {}
        for key, child in children:
            name = key.name
            data[name] = self.node(child, _join(path, name))
        static = {}
        for f in dataclasses.fields(x):
            if f.name not in data:
                static[f.name] = _encode_static(getattr(x, f.name), f"'{_join(path, f.name)}'")
        return {"type": "leaf", "class": cls.__name__, "qualname": _qualified(cls),
                "data": data, "static": static}

    def array(self, x: Any, path: str) -> dict:
        if isinstance(x, jax.Array):
            kind = "jax"
        elif isinstance(x, np.ndarray):
            kind = "numpy"
        else:
            kind, x = "numpy_scalar", np.asarray(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"save_params: array {_where(path)} holds PRNG keys; save "
                "jax.random.key_data(key) instead"
            )
        spec = {"type": "array", "shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name,
                "kind": kind}
        if x.size:  # orbax cannot store zero-size arrays; the skeleton alone describes them
            key = f"arr_{len(self.arrays):06d}"
            self.arrays[key] = x
            spec["key"] = key
        return spec


# ---------------------------------------------------------------------------------------------
# Decoding: skeleton + arrays -> tree.

class _Decoder:
    def __init__(self, tree_file: str):
        self.tree_file = tree_file
        self.arrays: dict[str, Any] = {}

    def err(self, path: str):
        def make(expected: str, found: str) -> ValueError:
            return ValueError(
                f"load_params: corrupt skeleton in {self.tree_file} {_where(path)}: expected "
                f"{expected}, found {found}"
            )
        return make

    def specs(self, spec: Any, path: str = "", out: dict | None = None) -> dict[str, tuple]:
        """Validate the skeleton and collect ``{array key: (path, spec)}`` of stored arrays."""
        out = {} if out is None else out
        err = self.err(path)
        if not isinstance(spec, dict) or "type" not in spec:
            raise err("a node object with a 'type' field", repr(spec)[:200])
        t = spec["type"]
        if t == "none":
            pass
        elif t in ("dict", "list", "tuple"):
            items = spec.get("items")
            if not isinstance(items, list):
                raise err(f"an 'items' list for a {t}", repr(items)[:200])
            for i, item in enumerate(items):
                if t == "dict":
                    if (not isinstance(item, list) or len(item) != 2
                            or isinstance(item[0], bool) or not isinstance(item[0], (str, int))):
                        raise err("a [key, node] pair with a str or int key", repr(item)[:200])
                    self.specs(item[1], _join(path, item[0]), out)
                else:
                    self.specs(item, _join(path, i), out)
        elif t == "leaf":
            if not isinstance(spec.get("class"), str):
                raise err("a 'class' name for a leaf", repr(spec.get("class")))
            if not isinstance(spec.get("data"), dict) or not isinstance(spec.get("static"), dict):
                raise err("'data' and 'static' objects for a leaf",
                          f"data={spec.get('data')!r:.100} static={spec.get('static')!r:.100}")
            for name, child in spec["data"].items():
                self.specs(child, _join(path, name), out)
        elif t == "array":
            shape, dtype, kind = spec.get("shape"), spec.get("dtype"), spec.get("kind")
            if not (isinstance(shape, list) and all(
                    isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
                raise err("an array 'shape' list of non-negative ints", repr(shape))
            try:
                jnp.dtype(dtype)
            except TypeError:
                raise err("a dtype name", repr(dtype)) from None
            if kind not in _KINDS:
                raise err(f"an array 'kind' in {_KINDS}", repr(kind))
            size = int(np.prod(shape))
            key = spec.get("key")
            if size and not isinstance(key, str):
                raise err("an array 'key' for a non-empty array", repr(key))
            if size:
                if key in out:
                    raise err(f"a unique array key ('{key}' is also used at '{out[key][0]}')",
                              "a duplicate")
                out[key] = (path, spec)
        else:
            raise err("a node type in none/dict/list/tuple/leaf/array", repr(t))
        return out

    def node(self, spec: dict, path: str) -> Any:
        t = spec["type"]
        if t == "none":
            return None
        if t == "dict":
            return {k: self.node(v, _join(path, k)) for k, v in spec["items"]}
        if t in ("list", "tuple"):
            items = [self.node(v, _join(path, i)) for i, v in enumerate(spec["items"])]
            return items if t == "list" else tuple(items)
        if t == "leaf":
            return self.leaf(spec, path)
        return self.array(spec)

    def leaf(self, spec: dict, path: str) -> Leaf:
        cls = _find_leaf_class(spec["class"], spec.get("qualname"))
        if cls is None:
            known = sorted(c.__name__ for c in _leaf_classes())
            raise ValueError(
                f"load_params: unknown leaf type '{spec['class']}' ({spec.get('qualname')}) "
                f"{_where(path)} in {self.tree_file}; known leaf types: {known}. Import the "
                "module that defines it before loading"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        given = set(spec["data"]) | set(spec["static"])
        if given != fields:
            raise ValueError(
                f"load_params: leaf {cls.__name__} {_where(path)} in {self.tree_file} has fields "
                f"{sorted(given)}, but {cls.__name__} has fields {sorted(fields)}"
            )
        kwargs = {name: self.node(child, _join(path, name)) for name, child in spec["data"].items()}
        for name, value in spec["static"].items():
            kwargs[name] = _decode_static(value, self.err(_join(path, name)))
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"load_params: cannot rebuild {cls.__name__} {_where(path)} from "
                f"{self.tree_file}: {e}"
            ) from e

    def array(self, spec: dict) -> Any:
        shape, dtype, kind = tuple(spec["shape"]), jnp.dtype(spec["dtype"]), spec["kind"]
        if int(np.prod(shape)) == 0:
            x = np.zeros(shape, dtype)
        else:
            x = self.arrays[spec["key"]]
        if kind == "jax":
            return jax.device_put(x) if not isinstance(x, jax.Array) else x
        x = np.asarray(x)
        return x[()] if kind == "numpy_scalar" else x


# ---------------------------------------------------------------------------------------------
# Public API.

def _is_nonempty(path: str) -> bool:
    if os.path.isdir(path):
        return bool(os.listdir(path))
    return os.path.lexists(path)


def save_params(path: str | os.PathLike, params: Any, *, metadata: dict | None = None,
                overwrite: bool = False) -> None:
    """Save a parameter tree to the directory ``path`` (atomically).

    Args:
      path: target directory (local filesystem). It must not exist, or be an empty directory,
        unless ``overwrite=True``.
      params: nested dicts (str or int keys), lists and tuples whose nodes are
        :class:`~lowrank_jax.Leaf` instances, ``jax.Array`` / ``numpy`` arrays, or ``None``.
      metadata: optional JSON-serializable dict stored in ``tree.json``
        (read back with :func:`load_metadata`).
      overwrite: replace an existing non-empty ``path``.

    Raises:
      FileExistsError: ``path`` exists and is not empty, and ``overwrite`` is false.
      TypeError: a node, dict key, static leaf field or ``metadata`` cannot be saved. Nothing
        is written in that case.
    """
    import orbax.checkpoint as ocp  # slow import, only needed here

    path = os.path.abspath(os.fspath(path))
    if not overwrite and _is_nonempty(path):
        raise FileExistsError(
            f"save_params: {path} exists and is not empty; pass overwrite=True to replace it"
        )
    if metadata is not None and not isinstance(metadata, dict):
        raise TypeError(f"save_params: metadata must be a dict, got {type(metadata).__name__}")
    enc = _Encoder()
    doc = {"format": FORMAT, "version": VERSION, "tree": enc.node(params, ""),
           "metadata": {} if metadata is None else metadata}
    try:
        text = json.dumps(doc, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_params: metadata is not JSON-serializable: {e}") from e

    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        os.makedirs(tmp)
        if enc.arrays:
            ckptr = ocp.PyTreeCheckpointer()
            ckptr.save(os.path.join(tmp, ARRAYS_DIR), enc.arrays)
        _write_text(os.path.join(tmp, TREE_FILE), text)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_text(file: str, text: str) -> None:
    with open(file, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(src: str, dst: str) -> None:
    """Move the finished directory ``src`` to ``dst``, replacing whatever is there."""
    if not os.path.lexists(dst):
        os.rename(src, dst)
        return
    parent, name = os.path.split(dst)
    old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
    os.rename(dst, old)
    try:
        os.rename(src, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.remove(old)


def _read_doc(path: str | os.PathLike) -> tuple[str, str, dict]:
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_params: no checkpoint at {path} (the path does not exist)")
    if not os.path.isdir(path):
        raise ValueError(
            f"load_params: {path} is a file; expected a directory written by save_params"
        )
    tree_file = os.path.join(path, TREE_FILE)
    if not os.path.isfile(tree_file):
        raise FileNotFoundError(
            f"load_params: {tree_file} not found; expected a directory written by save_params "
            f"(containing {TREE_FILE} and {ARRAYS_DIR}/), found {sorted(os.listdir(path))}"
        )
    try:
        with open(tree_file, encoding="utf-8") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"load_params: {tree_file} is not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"load_params: {tree_file} is not a lowrank_jax skeleton: expected format "
            f"'{FORMAT}', found {found!r}"
        )
    if doc.get("version") != VERSION:
        raise ValueError(
            f"load_params: {tree_file} has format version {doc.get('version')!r}; this "
            f"lowrank_jax reads version {VERSION}"
        )
    for field, typ in (("tree", dict), ("metadata", dict)):
        if not isinstance(doc.get(field), typ):
            raise ValueError(
                f"load_params: {tree_file} is missing its '{field}' object (found "
                f"{type(doc.get(field)).__name__})"
            )
    return path, tree_file, doc


def load_metadata(path: str | os.PathLike) -> dict:
    """The ``metadata`` dict given to :func:`save_params` (``{}`` if none); no arrays are read."""
    return _read_doc(path)[2]["metadata"]


def load_params(path: str | os.PathLike) -> Any:
    """Load a tree written by :func:`save_params`: same treedef, dtypes and bits.

    Args:
      path: the checkpoint directory.

    Returns:
      The parameter tree. ``jax.Array`` values are placed on the default device.

    Raises:
      FileNotFoundError: ``path`` or its ``tree.json`` does not exist.
      ValueError: ``tree.json`` is corrupt, names an unknown leaf type, or the stored arrays do
        not match it (missing, extra, or of another shape or dtype).
    """
    path, tree_file, doc = _read_doc(path)
    dec = _Decoder(tree_file)
    specs = dec.specs(doc["tree"])
    if specs:
        dec.arrays = _restore_arrays(os.path.join(path, ARRAYS_DIR), specs, tree_file)
    return dec.node(doc["tree"], "")


def _restore_arrays(arrays_dir: str, specs: dict[str, tuple], tree_file: str) -> dict:
    import orbax.checkpoint as ocp

    if not os.path.isdir(arrays_dir):
        raise ValueError(
            f"load_params: {tree_file} lists {len(specs)} stored arrays but {arrays_dir} "
            "does not exist"
        )
    ckptr = ocp.PyTreeCheckpointer()
    try:
        stored = ckptr.metadata(arrays_dir).item_metadata.tree
    except Exception as e:  # orbax raises several types for an unreadable checkpoint
        raise ValueError(f"load_params: cannot read the orbax checkpoint {arrays_dir}: {e}") from e
    if not isinstance(stored, dict):
        raise ValueError(
            f"load_params: {arrays_dir} should hold a flat dict of arrays, found "
            f"{type(stored).__name__}"
        )
    missing = sorted(set(specs) - set(stored))
    extra = sorted(set(stored) - set(specs))
    if missing or extra:
        where = [f"{k} ({specs[k][0] or 'root'})" for k in missing[:5]]
        raise ValueError(
            f"load_params: arrays in {arrays_dir} do not match {tree_file}: missing "
            f"{where}{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''}"
        )
    device = jax.devices()[0]
    restore_args = {}
    for key, (tree_path, spec) in specs.items():
        shape, dtype = tuple(spec["shape"]), jnp.dtype(spec["dtype"])
        meta = stored[key]
        found_shape = tuple(getattr(meta, "shape", ()) or ())
        found_dtype = getattr(meta, "dtype", None)
        if found_shape != shape or (found_dtype is not None and jnp.dtype(found_dtype) != dtype):
            raise ValueError(
                f"load_params: array '{tree_path}' ({key} in {arrays_dir}) does not match "
                f"{tree_file}: expected {dtype.name}{list(shape)}, found "
                f"{getattr(found_dtype, 'name', found_dtype)}{list(found_shape)}"
            )
        if spec["kind"] == "jax":
            restore_args[key] = ocp.ArrayRestoreArgs(
                sharding=jax.sharding.SingleDeviceSharding(device), global_shape=shape,
                dtype=dtype)
        else:
            restore_args[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
    try:
        return ckptr.restore(arrays_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except Exception as e:
        raise ValueError(f"load_params: cannot restore the arrays in {arrays_dir}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Model checkpoints: parameters plus the model's config dataclass.

def config_to_dict(config: Any) -> dict:
    """A frozen config dataclass (possibly nested) as a JSON-able dict with its class name.

    Only classes defined inside ``lowrank_jax`` are accepted, so :func:`config_from_dict` never
    imports arbitrary code named in a file.
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"config_to_dict: expected a config dataclass instance, got {config!r}")
    cls = type(config)
    if not cls.__module__.startswith("lowrank_jax."):
        raise TypeError(
            f"config_to_dict: {cls.__module__}.{cls.__qualname__} is not a lowrank_jax config"
        )

    def enc(v):
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return config_to_dict(v)
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {str(k): enc(x) for k, x in v.items()}
        if isinstance(v, (np.integer, np.floating)):
            return v.item()
        return v

    fields = {f.name: enc(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    return {"__config__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}


def config_from_dict(d: dict, *, source: str = "config") -> Any:
    """Inverse of :func:`config_to_dict` (lists become tuples where the field is a tuple)."""
    import importlib
    import typing

    if not isinstance(d, dict) or "__config__" not in d or not isinstance(d.get("fields"), dict):
        raise ValueError(f"{source}: not a serialized lowrank_jax config: {str(d)[:200]}")
    module, _, qual = d["__config__"].partition(":")
    if not module.startswith("lowrank_jax."):
        raise ValueError(f"{source}: refusing to load config class from {module!r}")
    try:
        cls = importlib.import_module(module)
        for part in qual.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{source}: unknown config class {d['__config__']!r}: {e}") from e
    hints = typing.get_type_hints(cls)

    def dec(v, hint):
        if isinstance(v, dict) and "__config__" in v:
            return config_from_dict(v, source=source)
        if isinstance(v, list):
            items = [dec(x, None) for x in v]
            return tuple(items) if "tuple" in str(hint) or "Sequence" in str(hint) else items
        return v

    kwargs = {k: dec(v, hints.get(k)) for k, v in d["fields"].items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{source}: cannot build {qual} from the stored fields: {e}") from e


def save_model(path: str | os.PathLike, config: Any, params: Any, *, metadata: dict | None = None,
               overwrite: bool = False) -> None:
    """Save a model: :func:`save_params` with the config stored in the metadata.

    Compressed leaves are saved as they are (factors, masks, scores); nothing is densified.
    """
    meta = dict(metadata or {})
    meta["config"] = config_to_dict(config)
    save_params(path, params, metadata=meta, overwrite=overwrite)


def load_model(path: str | os.PathLike) -> tuple[Any, Any]:
    """``(config, params)`` of a checkpoint written by :func:`save_model`."""
    meta = load_metadata(path)
    if "config" not in meta:
        raise ValueError(
            f"load_model: {os.fspath(path)} holds a parameter tree without a model config "
            "(written by save_params, not save_model); use load_params"
        )
    config = config_from_dict(meta["config"], source=os.path.join(os.fspath(path), TREE_FILE))
    return config, load_params(path)
