"""The declared public surface: every module says what it exports, each public name is
documented once, every error the library raises is in its hierarchy.

Users import from the subpackages (``lowrank_jax.leaves``, ``lowrank_jax.nn``, ...); each one's
``__all__`` is its page of public names. A name exported by two subpackages would appear twice
in the API reference, so it is exported by one (the other may still import it for
compatibility, outside ``__all__``). ``lowrank_jax`` itself re-exports a few common names for
convenience and is exempt.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import pkgutil

import pytest

import lowrank_jax

PACKAGE = pathlib.Path(lowrank_jax.__file__).parent
#: The subpackages and top-level modules whose ``__all__`` is the public API.
PUBLIC = ("analysis", "compress", "convert", "datasets", "decomp", "errors", "execution",
          "interop", "io", "leaves", "leaves.kit", "losses", "models", "nn", "recipes", "runtime",
          "timing", "train")


def library_modules() -> list[str]:
    """Every module of the package except the command line (``cli``: not an import API) and
    private modules (a component starting with ``_``)."""
    names = []
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="lowrank_jax."):
        parts = info.name.split(".")
        if parts[1] == "cli" or any(p.startswith("_") for p in parts[1:]):
            continue
        names.append(info.name)
    return sorted(names)


def test_every_module_declares_its_exports():
    missing, unknown = [], []
    for name in library_modules():
        mod = importlib.import_module(name)
        exported = getattr(mod, "__all__", None)
        if exported is None:
            missing.append(name)
            continue
        unknown += [f"{name}.{n}" for n in exported if not hasattr(mod, n)]
    assert not missing, f"modules without __all__: {missing}"
    assert not unknown, f"__all__ names that do not exist: {unknown}"


def _public_objects():
    for sub in PUBLIC:
        mod = importlib.import_module(f"lowrank_jax.{sub}")
        for n in mod.__all__:
            yield sub, n, getattr(mod, n)


def test_public_names_are_documented():
    undocumented = [f"{sub}.{n}" for sub, n, obj in _public_objects()
                    if (inspect.isfunction(obj) or inspect.isclass(obj))
                    and not (inspect.getdoc(obj) or "").strip()]
    assert not undocumented, f"public names without a docstring: {undocumented}"


def test_each_public_name_is_exported_once():
    """A function or class is in the ``__all__`` of one public subpackage only (submodules of a
    subpackage re-exported by its ``__init__`` count as that subpackage)."""
    owners: dict[int, list[str]] = {}
    objects = {}
    for sub, n, obj in _public_objects():
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        owners.setdefault(id(obj), []).append(f"{sub}.{n}")
        objects[id(obj)] = obj
    twice = sorted(v for v in owners.values() if len(v) > 1)
    assert not twice, f"names exported by several subpackages: {twice}"


BUILTIN_ERRORS = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
                  and issubclass(getattr(builtins, n), BaseException)}
#: Raised on purpose as what they are: OS errors of a system call (``io.files`` mirrors
#: ``rename(2)``), ``KeyboardInterrupt`` re-raised after a deferred save, ``SystemExit``, and
#: protocol signals (``StopIteration``, ``NotImplementedError``, a module ``__getattr__``'s
#: ``AttributeError``). Raises inside dunder methods follow Python's protocols too
#: (``__len__`` raises ``TypeError``).
ALLOWED = {"OSError", "FileExistsError", "KeyboardInterrupt", "SystemExit", "StopIteration",
           "NotImplementedError", "AttributeError"}


def _dunder_bodies(tree: ast.AST) -> set[int]:
    """ids of the raise nodes inside ``__x__`` methods."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("__") and fn.name.endswith("__"):
            inside |= {id(n) for n in ast.walk(fn) if isinstance(n, ast.Raise)}
    return inside


def raises_outside_hierarchy(root: pathlib.Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        protocol = _dunder_bodies(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None or id(node) in protocol:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS - ALLOWED:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: raise {exc.id}")
    return found


def test_every_raise_is_in_the_hierarchy():
    found = raises_outside_hierarchy(PACKAGE)
    assert not found, "built-in exceptions raised (use lowrank_jax.errors):\n" + "\n".join(found)


def test_error_classes_live_in_errors():
    """Every exception class of the library is defined in ``lowrank_jax.errors``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith("Error") or b.id == "Exception")
                    for b in node.bases):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.name}")
    assert not found, f"exception classes outside lowrank_jax/errors.py: {found}"


@pytest.mark.parametrize("code, bad", [("raise ValueError('x')", True),
                                       ("raise TypeError", True),
                                       ("def __len__(self):\n    raise TypeError('x')", False),
                                       ("raise ShapeError('x')", False),
                                       ("raise OSError(2, 'x')", False)])
def test_the_raise_scan_sees_builtins(tmp_path, code, bad):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(code + "\n")
    assert bool(raises_outside_hierarchy(pkg)) == bad


def test_leaf_kit_is_apart_from_the_user_api():
    """Leaf authors' names live in ``leaves.kit``; the user API of ``leaves`` does not repeat
    them (they stay importable from ``leaves``)."""
    from lowrank_jax import leaves
    from lowrank_jax.leaves import kit

    for name in ("leaf_dataclass", "Factors", "array_bits", "node_fields", "check_bias"):
        assert name in kit.__all__ and name not in leaves.__all__
        assert getattr(leaves, name) is getattr(kit, name)
    for name in ("linear", "materialize", "factors", "keep_inputs", "Dense", "LowRank"):
        assert name in leaves.__all__
