"""Trees <-> JSON skeletons plus flat dicts of arrays, with one checksum per stored array.

The skeleton records everything that is not array data (see the format in
:mod:`lowrank_jax.io`): containers, ``None``, every registered node (leaf types, query-key
objects, head layouts, node types defined outside lowrank_jax) with its static fields, and for
every array its shape, dtype, kind, storage key and sha256 checksum. Nodes are serialized
generically through the field lists that :func:`lowrank_jax.leaves.leaf_dataclass` registers
(:func:`~lowrank_jax.leaves.data_fields`, :func:`~lowrank_jax.leaves.meta_fields`) and rebuilt
from the registry :func:`~lowrank_jax.leaves.node_types`; nothing is imported by a name read
from a file.

This module does no file I/O: :mod:`lowrank_jax.io.params` stores the arrays with orbax.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import CheckpointError, LeafTypeError
from lowrank_jax.leaves import data_fields, meta_fields, node_fields, node_types, qualified_name

#: Array kinds: restored as ``jax.Array``, ``numpy.ndarray`` or a NumPy scalar.
KINDS = ("jax", "numpy", "numpy_scalar")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def where(path: str) -> str:
    """A path for messages.

    Args:
      path: a parameter path.

    Returns:
      ``"at 'a/b'"`` (``"at the root"`` for the empty path).
    """
    return f"at '{path}'" if path else "at the root"


def join(path: str, key: Any) -> str:
    """One step down a parameter path.

    Args:
      path: the parent's path.
      key: a dict key, list index or field name.

    Returns:
      ``path/key`` (``key`` alone at the root).
    """
    return f"{path}/{key}" if path else str(key)


def array_checksum(x: Any) -> str:
    """The sha256 checksum that format version 2 stores for an array.

    The digest covers ``"<dtype name>:<d0>,<d1>,...:"`` (UTF-8) followed by the array's bytes
    in C order, so a change of dtype or shape changes it as well as a change of any byte.

    Args:
      x: a ``jax.Array``, NumPy array or NumPy scalar (fully addressable).

    Returns:
      The hex digest (64 characters).
    """
    a = np.asarray(x)
    h = hashlib.sha256(f"{jnp.dtype(a.dtype).name}:{','.join(str(d) for d in a.shape)}:".encode())
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # (ascontiguousarray is >= 1-D)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Static (non-array) fields of nodes.

def encode_static(value: Any, path: str, who: str = "save_params") -> Any:
    """A static field as JSON; tuples and lists are tagged (``{'tuple': [...]}``) so that they
    come back as the same type (treedefs compare static fields by equality and type).

    Args:
      value: the field's value.
      path: the field's parameter path, for messages.
      who: the caller's name, for messages.

    Returns:
      A JSON-able value.

    Raises:
      LeafTypeError: the value is not None, bool, int, float, str or a tuple/list of them.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if type(value) is tuple:
        return {"tuple": [encode_static(v, path, who) for v in value]}
    if type(value) is list:
        return {"list": [encode_static(v, path, who) for v in value]}
    raise LeafTypeError(
        f"{who}: static field '{path}' has a value of type {type(value).__name__}; only None, "
        "bool, int, float, str and tuples/lists of them can be saved", where=path,
        expected="None, bool, int, float, str, tuple or list", actual=type(value).__name__)


def decode_static(value: Any, path: str, source: str) -> Any:
    """Inverse of :func:`encode_static`.

    Args:
      value: the stored JSON value.
      path: the field's parameter path, for messages.
      source: the file it was read from, for messages.

    Returns:
      The static value (tuples and lists restored).

    Raises:
      CheckpointError: the value is not an encoded static value.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, items), = value.items()
        if tag in ("tuple", "list") and isinstance(items, list):
            items = [decode_static(v, path, source) for v in items]
            return tuple(items) if tag == "tuple" else items
    raise corrupt(source, path, "a static value (JSON scalar, {'tuple': [...]} or "
                  "{'list': [...]})", repr(value)[:200])


def corrupt(source: str, path: str, expected: str, found: str) -> CheckpointError:
    """The error for a skeleton that does not follow the format.

    Args:
      source: the file, path: the parameter path, expected / found: descriptions.

    Returns:
      A :class:`~lowrank_jax.errors.CheckpointError` to raise.
    """
    e = CheckpointError(source, message=f"load_params: corrupt skeleton in {source} "
                        f"{where(path)}: expected {expected}, found {found}")
    e.expected, e.actual = expected, found
    return e


# ---------------------------------------------------------------------------------------------
# Node classes.

def _registered(cls: type) -> str | None:
    name = qualified_name(cls)
    return name if node_types().get(name) is cls else None


def find_node_class(name: str, path: str, source: str) -> type:
    """The registered node class stored as ``name``.

    ``name`` is a qualified name (``'lowrank_jax.leaves.dense.LowRank'``); when no class is
    registered under it, a unique registered class whose ``__name__`` is its last component
    is used (a class whose module moved, or the short names of format version 1).

    Args:
      name: the stored class name.
      path: the node's parameter path, for messages.
      source: the file it was read from, for messages.

    Returns:
      The class.

    Raises:
      CheckpointError: no registered class, or several, match.
    """
    types = node_types()
    if name in types:
        return types[name]
    short = name.rsplit(".", 1)[-1]
    matches = sorted({c for c in types.values() if c.__name__ == short}, key=qualified_name)
    if len(matches) == 1:
        return matches[0]
    if matches:
        msg = (f"load_params: leaf type '{short}' ({name}) {where(path)} in {source} is "
               f"ambiguous: registered as {[qualified_name(c) for c in matches]}")
    else:
        known = sorted({c.__name__ for c in types.values()})
        msg = (f"load_params: unknown leaf type '{short}' ({name}) {where(path)} in {source}; "
               f"known node types: {known}. Import the module that defines it before loading")
    e = CheckpointError(source, message=msg)
    e.expected, e.actual = "a registered node type", name
    raise e


# ---------------------------------------------------------------------------------------------
# Encoding: tree -> (skeleton, {key: array}).

class TreeEncoder:
    """Encodes trees into skeletons, collecting their non-empty arrays in :attr:`arrays`.

    Several trees (parameters and model state) may be encoded by one encoder: their arrays
    share one key space (``arr_000000``, ``arr_000001``, ...).

    Args:
      who: the caller's name, for messages.
    """

    def __init__(self, who: str = "save_params"):
        self.who = who
        self.arrays: dict[str, Any] = {}

    def encode(self, tree: Any, root: str = "") -> dict:
        """The skeleton of ``tree``; ``root`` prefixes paths in messages."""
        return self._node(tree, root)

    def _node(self, x: Any, path: str) -> dict:
        if x is None:
            return {"type": "none"}
        name = _registered(type(x))
        if name is not None:
            return self._registered_node(x, name, path)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return self._array(x, path)
        if type(x) is dict:
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise LeafTypeError(
                        f"{self.who}: dict {where(path)} has a key {k!r} of type "
                        f"{type(k).__name__}; only str and int keys can be saved", where=path,
                        expected="str or int", actual=type(k).__name__)
                items.append([k, self._node(v, join(path, k))])
            return {"type": "dict", "items": items}
        if type(x) in (list, tuple):
            items = [self._node(v, join(path, i)) for i, v in enumerate(x)]
            return {"type": type(x).__name__, "items": items}
        raise LeafTypeError(
            f"{self.who}: unsupported node {where(path)} of type {type(x).__name__}; a "
            "parameter tree holds dicts, lists, tuples, None, arrays and registered nodes "
            "(leaf types, query-key objects, head layouts: see lowrank_jax.leaves.leaf_dataclass)",
            where=path, expected="a tree of dicts, lists, tuples, None, arrays and nodes",
            actual=type(x).__name__)

    def _registered_node(self, x: Any, name: str, path: str) -> dict:
        children, fixed = node_fields(x)
        data = {f: self._node(v, join(path, f)) for f, v in children.items()}
        static = {f: encode_static(v, join(path, f), self.who) for f, v in fixed.items()}
        return {"type": "node", "class": name, "data": data, "static": static}

    def _array(self, x: Any, path: str) -> dict:
        if isinstance(x, jax.Array):
            kind = "jax"
        elif isinstance(x, np.ndarray):
            kind = "numpy"
        else:
            kind, x = "numpy_scalar", np.asarray(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise LeafTypeError(
                f"{self.who}: array {where(path)} holds PRNG keys; save "
                "jax.random.key_data(key) instead", where=path, expected="a numeric array",
                actual=str(x.dtype))
        spec = {"type": "array", "shape": [int(d) for d in x.shape],
                "dtype": jnp.dtype(x.dtype).name, "kind": kind}
        if x.size:  # orbax cannot store zero-size arrays; the skeleton alone describes them
            key = f"arr_{len(self.arrays):06d}"
            self.arrays[key] = x
            spec["key"] = key
            # Arrays split over several processes have no single host copy to hash.
            addressable = not isinstance(x, jax.Array) or x.is_fully_addressable
            spec["sha256"] = array_checksum(x) if addressable else None
        return spec


# ---------------------------------------------------------------------------------------------
# Decoding: skeleton + arrays -> tree.

def collect_arrays(spec: Any, source: str, *, root: str = "", checksums: bool = True,
                   out: dict | None = None) -> dict[str, tuple[str, dict]]:
    """Validate a skeleton and collect ``{array key: (path, array spec)}`` of stored arrays.

    Args:
      spec: the skeleton (parsed JSON).
      source: the file it was read from, for messages.
      root: path prefix of this tree in messages.
      checksums: stored arrays must carry a ``'sha256'`` digest (format version 2).
      out: a dict to add to (keys must be unique across the trees of one checkpoint).

    Returns:
      ``out``, with this skeleton's stored arrays added.

    Raises:
      CheckpointError: the skeleton does not follow the format.
    """
    out = {} if out is None else out
    _collect(spec, root, source, checksums, out)
    return out


def _collect(spec: Any, path: str, source: str, checksums: bool, out: dict) -> None:
    if not isinstance(spec, dict) or "type" not in spec:
        raise corrupt(source, path, "a node object with a 'type' field", repr(spec)[:200])
    t = spec["type"]
    if t == "none":
        return
    if t in ("dict", "list", "tuple"):
        items = spec.get("items")
        if not isinstance(items, list):
            raise corrupt(source, path, f"an 'items' list for a {t}", repr(items)[:200])
        for i, item in enumerate(items):
            if t == "dict":
                if (not isinstance(item, list) or len(item) != 2
                        or isinstance(item[0], bool) or not isinstance(item[0], (str, int))):
                    raise corrupt(source, path, "a [key, node] pair with a str or int key",
                                  repr(item)[:200])
                _collect(item[1], join(path, item[0]), source, checksums, out)
            else:
                _collect(item, join(path, i), source, checksums, out)
    elif t == "node":
        if not isinstance(spec.get("class"), str):
            raise corrupt(source, path, "a 'class' name for a node", repr(spec.get("class")))
        if not isinstance(spec.get("data"), dict) or not isinstance(spec.get("static"), dict):
            raise corrupt(source, path, "'data' and 'static' objects for a node",
                          f"data={spec.get('data')!r:.100} static={spec.get('static')!r:.100}")
        for name, child in spec["data"].items():
            _collect(child, join(path, name), source, checksums, out)
    elif t == "array":
        _collect_array(spec, path, source, checksums, out)
    else:
        raise corrupt(source, path, "a node type in none/dict/list/tuple/node/array", repr(t))


def _collect_array(spec: dict, path: str, source: str, checksums: bool, out: dict) -> None:
    shape, dtype, kind = spec.get("shape"), spec.get("dtype"), spec.get("kind")
    if not (isinstance(shape, list) and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise corrupt(source, path, "an array 'shape' list of non-negative ints", repr(shape))
    try:
        jnp.dtype(dtype)
    except TypeError:
        raise corrupt(source, path, "a dtype name", repr(dtype)) from None
    if kind not in KINDS:
        raise corrupt(source, path, f"an array 'kind' in {KINDS}", repr(kind))
    if not int(np.prod(shape)):
        return
    key = spec.get("key")
    if not isinstance(key, str):
        raise corrupt(source, path, "an array 'key' for a non-empty array", repr(key))
    if checksums:
        digest = spec.get("sha256", "missing")
        if digest is not None and not (isinstance(digest, str) and _HEX64.match(digest)):
            raise corrupt(source, path, "a 'sha256' checksum (64 lowercase hex digits) for a "
                          "stored array", repr(digest)[:100])
    if key in out:
        raise corrupt(source, path, f"a unique array key ('{key}' is also used at "
                      f"'{out[key][0]}')", "a duplicate")
    out[key] = (path, spec)


def build_tree(spec: dict, arrays: dict[str, Any], source: str, root: str = "") -> Any:
    """Rebuild the tree of a skeleton validated by :func:`collect_arrays`.

    Args:
      spec: the skeleton.
      arrays: ``{key: array}`` of its stored arrays (restored with the right kind and dtype).
      source: the file the skeleton was read from, for messages.
      root: path prefix of this tree in messages.

    Returns:
      The tree.

    Raises:
      CheckpointError: a node class is unknown, or a node cannot be rebuilt from its fields.
    """
    t = spec["type"]
    if t == "none":
        return None
    if t == "dict":
        return {k: build_tree(v, arrays, source, join(root, k)) for k, v in spec["items"]}
    if t in ("list", "tuple"):
        items = [build_tree(v, arrays, source, join(root, i)) for i, v in enumerate(spec["items"])]
        return items if t == "list" else tuple(items)
    if t == "node":
        return _build_node(spec, arrays, source, root)
    shape, dtype, kind = tuple(spec["shape"]), jnp.dtype(spec["dtype"]), spec["kind"]
    x = arrays[spec["key"]] if int(np.prod(shape)) else np.zeros(shape, dtype)
    if kind == "jax":
        return x if isinstance(x, jax.Array) else jax.device_put(x)
    x = np.asarray(x)
    return x[()] if kind == "numpy_scalar" else x


def _build_node(spec: dict, arrays: dict, source: str, path: str) -> Any:
    cls = find_node_class(spec["class"], path, source)
    fields = set(data_fields(cls)) | set(meta_fields(cls))
    given = set(spec["data"]) | set(spec["static"])
    if given != fields or set(spec["data"]) != set(data_fields(cls)):
        e = CheckpointError(source, message=(
            f"load_params: node {cls.__name__} {where(path)} in {source} has data fields "
            f"{sorted(spec['data'])} and static fields {sorted(spec['static'])}, but "
            f"{cls.__name__} has data fields {sorted(data_fields(cls))} and static fields "
            f"{sorted(meta_fields(cls))}"))
        e.expected, e.actual = sorted(fields), sorted(given)
        raise e
    kwargs = {n: build_tree(c, arrays, source, join(path, n)) for n, c in spec["data"].items()}
    for name, value in spec["static"].items():
        kwargs[name] = decode_static(value, join(path, name), source)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(source, message=(
            f"load_params: cannot rebuild {cls.__name__} {where(path)} from {source}: {e}")) from e


__all__ = ["KINDS", "TreeEncoder", "array_checksum", "build_tree", "collect_arrays", "corrupt",
           "decode_static", "encode_static", "find_node_class", "join", "where"]
