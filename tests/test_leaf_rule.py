"""The leaf rule, statically: no module of lowrank_jax outside ``leaves/`` checks a value's
class against a leaf or query-key class (``isinstance``, ``issubclass``, ``type(x) is``).

Blocks ask a leaf what it can do through the dispatch functions of :mod:`lowrank_jax.leaves`
(``is_leaf``, ``is_query_key``, ``factors``, ``keep_inputs``, ...). Field reads are checked
while the whole suite runs (``tests/conftest.py``); this scan covers the type checks, which
would let a user's leaf type silently miss a path.
"""

from __future__ import annotations

import ast
import pathlib

import lowrank_jax
from lowrank_jax.leaves import HeadLayout
from lowrank_jax.leaves.base import node_types

PACKAGE = pathlib.Path(lowrank_jax.__file__).parent


def leaf_class_names() -> set[str]:
    """Names of every lowrank_jax leaf and query-key class (and their bases ``Leaf``, ``QK``);
    :class:`HeadLayout` is a layout record, not a weight, and is exempt."""
    names = {"Leaf", "QK"}
    for qual, cls in node_types().items():
        if qual.startswith("lowrank_jax.leaves.") and cls is not HeadLayout:
            names.add(cls.__name__)
    return names


def lowrank_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """``(names, modules)`` a module binds from lowrank_jax: names imported from it
    (``from lowrank_jax.leaves import Dense``) and aliases of its modules
    (``import lowrank_jax as lj``, ``from lowrank_jax import leaves as L``)."""
    names, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowrank_jax"):
            for a in node.names:
                names.add(a.asname or a.name)
                modules.add(a.asname or a.name)  # may be a module (`from lowrank_jax import nn`)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("lowrank_jax"):
                    modules.add(a.asname or a.name.split(".")[0])
    return names, modules


def _class_name(node: ast.AST, bound: tuple[set[str], set[str]]) -> str | None:
    """``X`` for ``X`` imported from lowrank_jax, or ``mod.X`` with ``mod`` a lowrank_jax
    module; ``None`` for anything else (``flax.linen.Dense`` is not a leaf)."""
    names, modules = bound
    if isinstance(node, ast.Name) and node.id in names:
        return node.id
    if isinstance(node, ast.Attribute):
        base = node.value
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in modules:
            return node.attr
    return None


def _checked(node: ast.AST, bound) -> list[str]:
    """Class names a ``isinstance``/``issubclass`` call or ``type(x) is/==/!= C`` compares to."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
            "isinstance", "issubclass") and len(node.args) == 2:
        spec = node.args[1]
        items = spec.elts if isinstance(spec, ast.Tuple) else [spec]
        return [n for n in (_class_name(i, bound) for i in items) if n]
    if isinstance(node, ast.Compare):
        parts = [node.left, *node.comparators]
        if any(isinstance(p, ast.Call) and isinstance(p.func, ast.Name) and p.func.id == "type"
               for p in parts):
            return [n for p in parts if not isinstance(p, ast.Call)
                    for n in [_class_name(p, bound)] if n]
    return []


def violations(root: pathlib.Path, names: set[str]) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if rel.parts[1] == "leaves":
            continue
        tree = ast.parse(path.read_text())
        bound = lowrank_names(tree)
        for node in ast.walk(tree):
            for name in _checked(node, bound):
                if name in names:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:90]}")
    return found


def test_no_type_checks_on_leaf_classes():
    found = violations(PACKAGE, leaf_class_names())
    assert not found, "type checks on leaf classes outside lowrank_jax/leaves:\n" + "\n".join(found)


def test_the_scan_finds_type_checks(tmp_path):
    """The scan sees each form it forbids (and nothing else)."""
    pkg = tmp_path / "lowrank_jax"
    (pkg / "nn").mkdir(parents=True)
    (pkg / "leaves").mkdir()
    (pkg / "nn" / "bad.py").write_text(
        "import lowrank_jax as lj\n"
        "from flax import linen as nn\n"
        "from lowrank_jax import leaves as L\n"
        "from lowrank_jax.leaves import ChannelPruned, Dense, HeadLayout, Leaf\n"
        "a = isinstance(w, Dense)\n"
        "b = isinstance(w, (L.LowRank, int))\n"
        "c = type(w) is ChannelPruned\n"
        "d = type(w) == lj.QueryKey\n"
        "e = issubclass(t, Leaf)\n"
        "f = isinstance(w, HeadLayout) or isinstance(w, dict) or type(w) is dict\n"
        "g = isinstance(m, nn.Dense)\n")
    (pkg / "leaves" / "ok.py").write_text("a = isinstance(w, Dense)\n")
    found = violations(pkg, leaf_class_names())
    assert [f.split(":")[1] for f in found] == ["5", "6", "7", "8", "9"], found
