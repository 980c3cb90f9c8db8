"""Resolve the library's short cross-references to the one documented entry.

The docstrings are written for readers of the source: they name objects the way the module
they are in sees them (``:class:`LowRank``, ``:func:`apply_plan``, ``:class:`Execution``)
and type hints carry the defining module (``lowrank_jax.leaves.lowrank.LowRank``), while the
API reference documents every name once, under the public subpackage that exports it
(``lowrank_jax.leaves.LowRank``). When Sphinx's own lookup finds nothing, this resolves a
Python reference in this order:

1. the object a dotted ``lowrank_jax.…`` target names, found by identity among the documented
   entries (a private module's path, a re-export);
2. the one documented entry whose full name ends with the target (``LowRank``,
   ``compress.apply_plan``); where several do, the one in the referring page's package;
3. for ``lowrank_jax`` targets only: the nearest documented parent (an attribute or method
   that has no entry of its own links to its class; a private module to its package);
4. a name the library defines but does not document (a private helper, a module constant, a
   field of a record) is shown as code without a link.

Anything else (a misspelled or removed name) stays unresolved and fails the nitpicky build
(external types are listed in ``conf.py``'s ``nitpick_ignore_regex``).
"""

from __future__ import annotations

import importlib

from sphinx.util import logging

LOG = logging.getLogger(__name__)


def _import(path: str):
    """The object a dotted path names, or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - not a module: try a shorter prefix
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _defined_names() -> set[str]:
    """Every name a ``lowrank_jax`` module defines, and the attributes of its classes."""
    import inspect
    import pkgutil

    import lowrank_jax

    names: set[str] = set()
    for info in pkgutil.walk_packages(lowrank_jax.__path__, prefix="lowrank_jax."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - an optional dependency missing: skip the module
            continue
        names.add(info.name.rsplit(".", 1)[1])
        for n, obj in vars(module).items():
            names.add(n)
            if inspect.isclass(obj) and obj.__module__.startswith("lowrank_jax"):
                names.update(vars(obj))
                names.update(getattr(obj, "__dataclass_fields__", {}))
                names.update(getattr(obj, "__annotations__", {}))
    return names


class _Index:
    def __init__(self, env):
        py = env.get_domain("py")
        self.names = {name: entry for name, entry in py.objects.items()}
        self.by_id: dict[int, str] = {}
        for name, entry in sorted(self.names.items()):
            if entry.objtype in ("class", "exception", "function", "method", "data", "module",
                                 "property", "attribute"):
                obj = _import(name)
                if obj is not None and not isinstance(obj, (int, float, str, tuple, bool)):
                    self.by_id.setdefault(id(obj), name)
        self.defined = _defined_names()
        self.suffix: dict[str, list[str]] = {}
        for name in self.names:
            parts = name.split(".")
            for i in range(1, len(parts)):
                self.suffix.setdefault(".".join(parts[i:]), []).append(name)

    def find(self, target: str, context: str | None) -> str | None:
        target = target.lstrip(".~")
        if target in self.names:
            return target
        if target.startswith("lowrank_jax."):
            obj = _import(target)
            if obj is not None and id(obj) in self.by_id:
                return self.by_id[id(obj)]
        candidates = self.suffix.get(target, [])
        if len(candidates) > 1 and context:
            near = [c for c in candidates if c.startswith(context + ".")]
            while not near and "." in context:
                context = context.rsplit(".", 1)[0]
                near = [c for c in candidates if c.startswith(context + ".")]
            candidates = near or candidates
        if len(candidates) == 1:
            return candidates[0]
        if len(candidates) > 1:
            # one object under several names (a module and its parent package): fine if same
            ids = {id(_import(c)) for c in candidates}
            if len(ids) == 1:
                return sorted(candidates, key=len)[0]
            return None
        if target.startswith("lowrank_jax.") and "." in target:
            return self.find(target.rsplit(".", 1)[0], context)
        if context and "." in target:
            # Execution.cpu_chunks -> the class, when the attribute has no entry of its own
            head = target.rsplit(".", 1)[0]
            found = self.find(head, context)
            if found is not None and found.startswith("lowrank_jax"):
                return found
        return None


def _on_missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    index = getattr(env, "_lowrank_xref_index", None)
    if index is None:
        index = env._lowrank_xref_index = _Index(env)
    context = node.get("py:module")
    found = index.find(node["reftarget"], context)
    if found is None:
        import re

        words = re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", node["reftarget"])
        last = [w.rsplit(".", 1)[-1] for w in words]
        # also "ShapeError / ConfigError" (two exceptions on one line of a Raises section)
        if last and all(w in index.defined for w in last):
            return contnode  # defined by the library, not documented: code, no link
        return None
    py = env.get_domain("py")
    entry = py.objects[found]
    from sphinx.util.nodes import make_refnode

    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode,
                        found)


def _reset(app, env, *args):
    if hasattr(env, "_lowrank_xref_index"):
        del env._lowrank_xref_index


def setup(app):
    app.connect("missing-reference", _on_missing_reference)
    app.connect("env-updated", _reset)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
