"""Trees <-> JSON skeletons plus flat dicts of arrays, with one checksum per stored array.

The skeleton records everything that is not array data (see the format in
:mod:`lowrank_jax.io`): containers, ``None``, every registered node (leaf types, query-key
objects, head layouts, node types defined outside lowrank_jax) with its static fields, and for
every array its shape, dtype, kind, storage key and sha256 checksum. Nodes are serialized
generically through the field lists that :func:`lowrank_jax.leaves.leaf_dataclass` registers
(:func:`~lowrank_jax.leaves.data_fields`, :func:`~lowrank_jax.leaves.meta_fields`) and rebuilt
from the registry :func:`~lowrank_jax.leaves.node_types`; nothing is imported by a name read
from a file.

Trees saved by :class:`lowrank_jax.train.Checkpointer` hold more than parameters (a whole train
state): an encoder made with ``extended=True`` also writes PRNG key arrays (``"kind": "key"``
with the key implementation), Python scalars (``"kind": "int"`` / ``"float"`` / ``"bool"``),
``NamedTuple`` nodes (optax states) and any other pytree node type (``"type": "pytree"``, the
node's class and structure; it is rebuilt only from a ``like`` tree that has the same node).

This module does no file I/O: :mod:`lowrank_jax.io.params` stores the arrays with orbax.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import keyword
import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import CheckpointError, LeafTypeError
from lowrank_jax.leaves import (
    data_fields,
    meta_fields,
    node_fields,
    node_types,
    path_str,
    qualified_name,
)

#: Array kinds: restored as ``jax.Array``, ``numpy.ndarray``, a NumPy scalar, a typed PRNG key
#: array (stored as its key data), or a Python ``bool`` / ``int`` / ``float``.
KINDS = ("jax", "numpy", "numpy_scalar", "key", "bool", "int", "float")
_PY_SCALARS = {"bool": bool, "int": int, "float": float}
#: Node types of a skeleton (``"array"`` included).
NODE_TYPES = ("none", "dict", "list", "tuple", "namedtuple", "pytree", "node", "array")

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


def checksum_if_readable(x: Any) -> str | None:
    """:func:`array_checksum` of an array this process can read whole, else ``None``.

    A ``jax.Array`` spread over several processes is readable whole when it is fully
    replicated (every process holds a copy); one split over processes has no single copy.

    Args:
      x: a ``jax.Array``, NumPy array or NumPy scalar.

    Returns:
      The hex digest, or ``None``.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            return None
        x = x.addressable_data(0)
    return array_checksum(x)


def treedef_str(treedef: Any) -> str:
    """``str(treedef)`` without object addresses (reprs of static callables differ between
    processes)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(treedef))


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
      extended: also accept what a train state holds besides parameters: typed PRNG key
        arrays, Python scalars, ``NamedTuple`` nodes and other pytree nodes (see the module
        docstring). Without it those are refused, as by :func:`lowrank_jax.io.save_params`.
      abstract: describe the tree only: leaves may be ``jax.ShapeDtypeStruct``; no array is
        collected and no checksum computed (array specs carry no ``key``). For comparing a
        tree's structure with a stored skeleton.
    """

    def __init__(self, who: str = "save_params", *, extended: bool = False,
                 abstract: bool = False):
        self.who = who
        self.extended = extended
        self.abstract = abstract
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
        if isinstance(x, (jax.Array, np.ndarray, np.generic)) or (
                self.abstract and isinstance(x, jax.ShapeDtypeStruct)):
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
        if self.extended:
            if type(x) in (bool, int, float):
                return self._array(np.asarray(x), path, kind=type(x).__name__)
            if isinstance(x, tuple) and is_namedtuple_class(type(x)):
                return {"type": "namedtuple", "class": qualified_name(type(x)),
                        "items": [[f, self._node(v, join(path, f))]
                                  for f, v in zip(type(x)._fields, x, strict=True)]}
            out = self._pytree_node(x, path)
            if out is not None:
                return out
            raise LeafTypeError(
                f"{self.who}: state node '{path or '<root>'}' has type {type(x).__name__}; a "
                "state holds arrays, Python scalars and None in pytree containers",
                where=path or "<root>", expected="array, Python scalar or None",
                actual=type(x).__name__)
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

    def _pytree_node(self, x: Any, path: str) -> dict | None:
        """A pytree node of a type registered with JAX (not a leaf dataclass, dict, list,
        tuple or NamedTuple), or ``None`` when JAX treats ``x`` as a leaf."""
        flat, node = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        if jax.tree_util.treedef_is_leaf(node):
            return None
        items = []
        for kp, child in flat:
            key = path_str(kp)
            items.append([key, self._node(child, join(path, key))])
        return {"type": "pytree", "class": qualified_name(type(x)), "treedef": treedef_str(node),
                "items": items}

    def _array(self, x: Any, path: str, kind: str | None = None) -> dict:
        if kind is None:
            if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
                kind = "jax"
            elif isinstance(x, np.ndarray):
                kind = "numpy"
            else:
                kind, x = "numpy_scalar", np.asarray(x)
        impl = None
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            if not self.extended:
                raise LeafTypeError(
                    f"{self.who}: array {where(path)} holds PRNG keys; save "
                    "jax.random.key_data(key) instead", where=path, expected="a numeric array",
                    actual=str(x.dtype))
            kind = "key"
            if isinstance(x, jax.ShapeDtypeStruct):
                impl, x = None, jax.eval_shape(jax.random.key_data, x)
            else:
                impl, x = str(jax.random.key_impl(x)), jax.random.key_data(x)
        spec = {"type": "array", "shape": [int(d) for d in x.shape],
                "dtype": jnp.dtype(x.dtype).name, "kind": kind}
        if kind == "key":
            spec["impl"] = impl
        if self.abstract:
            return spec
        if int(np.prod(x.shape)):  # orbax cannot store zero-size arrays: the skeleton alone
            key = f"arr_{len(self.arrays):06d}"  # describes them
            self.arrays[key] = x
            spec["key"] = key
            # Arrays split over several processes have no single host copy to hash.
            spec["sha256"] = checksum_if_readable(x)
        return spec


def is_namedtuple_class(cls: type) -> bool:
    """Whether ``cls`` is a ``NamedTuple`` / ``collections.namedtuple`` class."""
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


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
    elif t in ("namedtuple", "pytree"):
        if not isinstance(spec.get("class"), str):
            raise corrupt(source, path, f"a 'class' name for a {t}", repr(spec.get("class")))
        if t == "pytree" and not isinstance(spec.get("treedef"), str):
            raise corrupt(source, path, "a 'treedef' string for a pytree node",
                          repr(spec.get("treedef"))[:200])
        items = spec.get("items")
        if not isinstance(items, list) or not all(
                isinstance(it, list) and len(it) == 2 and isinstance(it[0], str) for it in items):
            raise corrupt(source, path, f"an 'items' list of [name, node] pairs for a {t}",
                          repr(items)[:200])
        if t == "namedtuple" and not all(it[0].isidentifier() for it in items):
            raise corrupt(source, path, "identifiers as the field names of a namedtuple",
                          repr([it[0] for it in items])[:200])
        for name, child in items:
            _collect(child, join(path, name), source, checksums, out)
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
        raise corrupt(source, path, f"a node type in {'/'.join(NODE_TYPES)}", repr(t))


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
    if kind == "key" and not isinstance(spec.get("impl"), str):
        raise corrupt(source, path, "an 'impl' name for a PRNG key array", repr(spec.get("impl")))
    if kind in _PY_SCALARS and shape:
        raise corrupt(source, path, f"the shape [] of a Python {kind}", repr(shape))
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

    NamedTuples come back as :func:`generic_namedtuple` classes (same name and fields); a
    ``"pytree"`` node (a pytree node type that is not a leaf type) cannot be rebuilt without a
    ``like`` tree and raises.

    Args:
      spec: the skeleton.
      arrays: ``{key: array}`` of its stored arrays (restored with the right kind and dtype).
      source: the file the skeleton was read from, for messages.
      root: path prefix of this tree in messages.

    Returns:
      The tree.

    Raises:
      CheckpointError: a node class is unknown, a node cannot be rebuilt from its fields, or
        the tree holds a ``"pytree"`` node.
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
    if t == "namedtuple":
        cls = generic_namedtuple(spec["class"], tuple(n for n, _ in spec["items"]))
        return cls(*(build_tree(v, arrays, source, join(root, n)) for n, v in spec["items"]))
    if t == "pytree":
        e = CheckpointError(source, message=(
            f"load_params: {source} holds a {spec['class']} node {where(root)} (a pytree node "
            "type that is not a leaf type; its structure cannot be rebuilt from the file alone): "
            "restore it with lowrank_jax.train.Checkpointer.restore(like=...)"))
        e.expected, e.actual = "a tree of dicts, lists, tuples, NamedTuples and nodes", spec["class"]
        raise e
    return array_value(spec, arrays, source=source, path=root)


def array_value(spec: dict, arrays: dict[str, Any], sharding: Any = None, *,
                source: str = "", path: str = "") -> Any:
    """The value of a stored array: its kind (``jax.Array``, NumPy array or scalar, PRNG key
    array, Python scalar) rebuilt from the restored data.

    Args:
      spec: the array's validated skeleton entry.
      arrays: ``{key: array}`` of the restored arrays.
      sharding: where a zero-size ``jax.Array`` (not stored) is put (default: the default
        device); stored arrays are restored in place by the caller.
      source, path: the file and the array's path, for messages.

    Returns:
      The value.

    Raises:
      CheckpointError: a PRNG key array names a key implementation this JAX does not have.
    """
    shape, dtype, kind = tuple(spec["shape"]), jnp.dtype(spec["dtype"]), spec["kind"]
    x = arrays[spec["key"]] if int(np.prod(shape)) else np.zeros(shape, dtype)
    if kind in ("jax", "key"):
        if not isinstance(x, jax.Array):
            x = jax.device_put(x, sharding)
        if kind == "jax":
            return x
        try:
            return jax.random.wrap_key_data(x, impl=spec["impl"])
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(source, message=(
                f"load_params: the PRNG key array {where(path)} in {source} cannot be rebuilt "
                f"with key implementation {spec['impl']!r}: {e}")) from e
    x = np.asarray(x)
    if kind == "numpy_scalar":
        return x[()]
    if kind in _PY_SCALARS:
        return _PY_SCALARS[kind](x.item())
    return x


@functools.lru_cache(maxsize=None)
def generic_namedtuple(name: str, fields: tuple[str, ...]) -> type:
    """A ``collections.namedtuple`` class standing for the stored NamedTuple class ``name``.

    Nothing named in a file is imported: a NamedTuple (an optax state) is read back as a
    namedtuple with the last component of the stored class name and the same fields. The same
    ``(name, fields)`` give the same class, so trees read twice have equal structures.

    Args:
      name: the stored qualified class name.
      fields: its field names.

    Returns:
      The class.
    """
    short = name.rsplit(".", 1)[-1]
    if not short.isidentifier() or keyword.iskeyword(short):
        short = "StoredNamedTuple"
    return collections.namedtuple(short, fields)


def flat_arrays(spec: dict, root: str = "") -> Iterator[tuple[str, dict]]:
    """``(path, array spec)`` of every array of a validated (or generated) skeleton, zero-size
    ones included, in skeleton order.

    Args:
      spec: the skeleton.
      root: the path of its root.

    Yields:
      The arrays' paths and skeleton entries.
    """
    t = spec["type"]
    if t == "array":
        yield root, spec
    elif t == "dict" or t in ("namedtuple", "pytree"):
        for k, v in spec["items"]:
            yield from flat_arrays(v, join(root, k))
    elif t in ("list", "tuple"):
        for i, v in enumerate(spec["items"]):
            yield from flat_arrays(v, join(root, i))
    elif t == "node":
        for n, v in spec["data"].items():
            yield from flat_arrays(v, join(root, n))


_CLASS_NODES = {"namedtuple": "NamedTuple", "pytree": "pytree node", "node": "node"}


def _kind_of(spec: dict) -> str:
    t = spec["type"]
    if t in _CLASS_NODES:
        return f"{_CLASS_NODES[t]} {spec['class']}"
    return "an array" if t == "array" else t


def structure_diff(a: dict, b: dict, path: str = "") -> str | None:
    """The first difference of structure between two skeletons, arrays aside.

    Containers, their keys and lengths, node classes and static fields, NamedTuple fields and
    pytree nodes are compared; arrays are not (their paths, shapes and dtypes are the caller's
    to compare).

    Args:
      a, b: two skeletons (validated, or generated by :class:`TreeEncoder`).
      path: the path of their roots, for the text.

    Returns:
      ``None`` when they have the same structure, else a short description such as
      ``"at 'params/heads': ranks (2, 2) vs (2, 1)"``.
    """
    at = f"at '{path}'" if path else "at the root"
    ta, tb = a["type"], b["type"]
    if ta != tb or (ta in ("node", "namedtuple", "pytree") and a["class"] != b["class"]):
        return f"{at}: {_kind_of(a)} vs {_kind_of(b)}"
    if ta == "array" or ta == "none":
        return None
    if ta in ("list", "tuple"):
        if len(a["items"]) != len(b["items"]):
            return f"{at}: a {ta} of {len(a['items'])} vs {len(b['items'])} items"
        pairs = [(str(i), x, y) for i, (x, y) in enumerate(zip(a["items"], b["items"], strict=True))]
    elif ta == "node":
        if sorted(a["data"]) != sorted(b["data"]) or sorted(a["static"]) != sorted(b["static"]):
            return (f"{at}: {a['class']} fields {sorted(a['data'])}/{sorted(a['static'])} vs "
                    f"{sorted(b['data'])}/{sorted(b['static'])}")
        for f in sorted(a["static"]):
            if a["static"][f] != b["static"][f]:
                return (f"{at}: {a['class'].rsplit('.', 1)[-1]} static field {f} "
                        f"{decode_static(a['static'][f], path, '')!r} vs "
                        f"{decode_static(b['static'][f], path, '')!r}")
        pairs = [(f, a["data"][f], b["data"][f]) for f in sorted(a["data"])]
    else:  # dict, namedtuple, pytree
        ka, kb = [k for k, _ in a["items"]], [k for k, _ in b["items"]]
        same = (sorted(map(repr, ka)) == sorted(map(repr, kb)) if ta == "dict" else ka == kb)
        if not same:
            return f"{at}: {_kind_of(a)} with keys {ka} vs {kb}"
        if ta == "pytree" and a["treedef"] != b["treedef"]:
            return f"{at}: pytree node {a['treedef']} vs {b['treedef']}"
        db = {repr(k): v for k, v in b["items"]}
        pairs = [(k, v, db[repr(k)]) for k, v in a["items"]]
    for k, x, y in pairs:
        diff = structure_diff(x, y, join(path, k))
        if diff is not None:
            return diff
    return None


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


__all__ = ["KINDS", "NODE_TYPES", "TreeEncoder", "array_checksum", "array_value", "build_tree",
           "checksum_if_readable", "collect_arrays", "corrupt", "decode_static", "encode_static",
           "find_node_class", "flat_arrays", "generic_namedtuple", "is_namedtuple_class", "join",
           "structure_diff", "treedef_str", "where"]
