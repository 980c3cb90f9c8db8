"""Reading and writing nested parameter trees by key path (shared by the converters)."""

from __future__ import annotations


def set_path(tree: dict, path: tuple, value) -> None:
    """Set ``tree[p0][p1]...[pn] = value``, creating dicts (str keys) and lists (int keys)."""
    node = tree
    for p, nxt in zip(path[:-1], path[1:], strict=True):
        if isinstance(p, int):
            while len(node) <= p:
                node.append([] if isinstance(nxt, int) else {})
            node = node[p]
        else:
            node = node.setdefault(p, [] if isinstance(nxt, int) else {})
    node[path[-1]] = value


def get_path(tree, path: tuple):
    """``tree[p0][p1]...[pn]``."""
    for p in path:
        tree = tree[p]
    return tree
