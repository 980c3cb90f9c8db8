"""Trees of leaves: paths, traversal, counts summed over a tree, trainable/frozen split.

A parameter path is the ``'/'``-joined key path of a node: dict keys, list indices and the
field names of registered nodes, for example ``'encoder/layers/3/attn/qk/q'``. Query-key
objects and head layouts are containers: traversal walks into them and yields their weight
leaves and arrays.
"""

from __future__ import annotations

import numbers
import re
from typing import Any, Callable, Iterator

import jax
import numpy as np

from lowrank_jax.errors import ConfigError, PathError
from lowrank_jax.leaves.base import Leaf, array_bits, is_leaf


def path_str(path: tuple) -> str:
    """``('layers', 0, 'attn', 'qk', 'q')``-style key path -> ``'layers/0/attn/qk/q'``."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        else:  # FlattenedIndexKey and anything else
            parts.append(str(getattr(k, "key", k)))
    return "/".join(parts)


def named_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, node)`` for every weight leaf and every plain array of ``tree``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    for path, node in flat:
        yield path_str(path), node


def map_with_path(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """Like ``tree_map`` but ``fn(path, node)`` sees whole leaves; returns a new tree."""
    return jax.tree_util.tree_map_with_path(lambda p, n: fn(path_str(p), n), tree, is_leaf=is_leaf)


def get_path(tree: Any, path: str) -> Any:
    """The node at ``path`` (``'a/0/b'``): dict keys, list indices and node fields."""
    node = tree
    for part in path.split("/") if path else []:
        if isinstance(node, dict):
            node = node[part] if part in node else node[int(part)]
        elif isinstance(node, (list, tuple)):
            node = node[int(part)]
        else:
            node = getattr(node, part)
    return node


def replace_paths(tree: Any, new: dict[str, Any]) -> Any:
    """A new tree in which the nodes at the paths of ``new`` are replaced (paths may name
    whole subtrees, such as an attention block's ``'.../attn'``). The input is not modified.
    """
    if not new:
        return tree
    todo = dict(new)

    def rebuild(node, prefix):
        if prefix in todo:
            return todo.pop(prefix)
        if not any(p.startswith(prefix + "/") or prefix == "" for p in todo):
            return node
        if isinstance(node, dict):
            return {k: rebuild(v, f"{prefix}/{k}" if prefix else str(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            items = [rebuild(v, f"{prefix}/{i}" if prefix else str(i)) for i, v in enumerate(node)]
            return type(node)(items) if isinstance(node, tuple) else items
        fields = getattr(type(node), "__lowrank_jax_data__", None)
        if fields is not None:
            import dataclasses

            kw = {f: rebuild(getattr(node, f), f"{prefix}/{f}" if prefix else f) for f in fields}
            return dataclasses.replace(node, **kw)
        return node

    out = rebuild(tree, "")
    if todo:
        raise PathError(f"replace_paths: no node at {sorted(todo)}")
    return out


_LAYER_RE = re.compile(r"(?:^|/)layers/(\d+)(?:/|$)")


def layer_index(path: str) -> int | None:
    """The layer index in a path such as ``encoder/layers/3/attn/qk/q`` (``None`` if absent)."""
    m = _LAYER_RE.search(path)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# Counts summed over a tree: the papers' model-level counts are sums over leaves.

def param_count(tree: Any) -> int:
    """Total stored parameters: leaves report their own count, plain arrays their size."""
    total = 0
    for _, node in named_leaves(tree):
        total += node.param_count() if isinstance(node, Leaf) else int(np.prod(np.shape(node)))
    return total


def storage_bits(tree: Any) -> int:
    """Total storage in bits: leaves report their own, plain arrays ``size * dtype bits``."""
    total = 0
    for _, node in named_leaves(tree):
        total += node.storage_bits() if isinstance(node, Leaf) else array_bits(node)
    return total


def check_tokens(n_tokens: Any, who: str) -> int:
    """``n_tokens`` as an int ``>= 0``, or a :class:`~lowrank_jax.errors.ConfigError`."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral) or n_tokens < 0:
        raise ConfigError(f"{who}: n_tokens must be an int >= 0, got {n_tokens!r}",
                          where="n_tokens", expected="int >= 0", actual=n_tokens)
    return int(n_tokens)


def flops(tree: Any, n_tokens: int) -> int:
    """Multiply-adds of every weight leaf applied to ``n_tokens`` rows (plain arrays: 0).

    These are the projections' counts. Attention score products (``q k^T`` and the weighted
    sum of values, which grow with the square of the sequence length) are counted by
    :func:`lowrank_jax.nn.attention_score_flops`. Every leaf of the tree counts once: a weight
    the model applies more than once (a tied or reused layer, stored once) counts once, as in
    :func:`param_count`; the tree does not say how often the model's code calls it.
    """
    n = check_tokens(n_tokens, "flops")
    return sum(node.flops(n) for _, node in named_leaves(tree) if isinstance(node, Leaf))


# ---------------------------------------------------------------------------------------------
# Trainable / frozen split (equinox-style partition and combine).

def trainable_mask(tree: Any) -> Any:
    """Tree of bools with ``tree``'s structure: ``True`` where ``jax.grad`` should look."""
    return jax.tree_util.tree_map(
        lambda n: n.trainable() if isinstance(n, Leaf) else True, tree, is_leaf=is_leaf
    )


def partition(tree: Any, mask: Any | None = None) -> tuple[Any, Any]:
    """Split ``tree`` into ``(trainable, frozen)``; the other side holds ``None``.

    Args:
      tree: a parameter tree.
      mask: a bool tree of the same structure (default :func:`trainable_mask`).

    Returns:
      Two trees with ``tree``'s structure; pass the first to ``jax.grad`` and rejoin with
      :func:`combine`.
    """
    mask = trainable_mask(tree) if mask is None else mask
    train = jax.tree_util.tree_map(lambda x, m: x if m else None, tree, mask)
    frozen = jax.tree_util.tree_map(lambda x, m: None if m else x, tree, mask)
    return train, frozen


def combine(*trees: Any) -> Any:
    """Inverse of :func:`partition`: take the first non-``None`` value at each position."""

    def pick(*xs):
        for x in xs:
            if x is not None:
                return x
        return None

    return jax.tree_util.tree_map(pick, *trees, is_leaf=lambda x: x is None)


__all__ = [
    "check_tokens", "combine", "flops", "get_path", "layer_index", "map_with_path",
    "named_leaves", "param_count", "partition", "path_str", "replace_paths", "storage_bits",
    "trainable_mask",
]
