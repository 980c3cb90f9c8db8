"""The command sits on top: nothing but the command imports :mod:`lowrank_jax.cli`, and nothing
in the library below the recipes layer imports :mod:`lowrank_jax.recipes`.

An AST scan of every Python file of ``lowrank_jax/``, ``benchmarks/`` and ``colab/src/`` (the
notebooks' sources): ``import lowrank_jax.cli...``, ``from lowrank_jax.cli... import ...``,
``from lowrank_jax import cli`` and ``importlib.import_module("lowrank_jax.cli...")`` count.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lowrank_jax"

#: Files outside the command that may import it, and why.
ALLOWED_CLI = {
    "benchmarks/machine/call_path.py": "measures the path of a `lowrank-jax compress` call "
                                       "through the code: it runs the command itself",
}


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of every module an AST imports (``from a import b`` gives ``a`` and
    ``a.b``: ``b`` may be a module)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def imports_of(source: str, package: str) -> list[int]:
    """Lines of ``source`` that import ``package`` or a module inside it."""
    return sorted({line for line, name in _imports(ast.parse(source))
                   if name == package or name.startswith(package + ".")})


def _files(*roots: pathlib.Path, skip: tuple[pathlib.Path, ...] = ()) -> list[pathlib.Path]:
    files = []
    for root in roots:
        files += [p for p in sorted(root.rglob("*.py"))
                  if not any(p.is_relative_to(s) for s in skip)]
    return files


def _offenders(files: list[pathlib.Path], package: str, allowed=()) -> list[str]:
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        lines = imports_of(path.read_text(encoding="utf-8"), package)
        if lines and rel not in allowed:
            found += [f"{rel}:{line}" for line in lines]
    return found


@pytest.mark.parametrize("source, lines", [
    ("import lowrank_jax.cli.main\n", [1]),
    ("x = 1\nfrom lowrank_jax.cli.outputs import json_safe\n", [2]),
    ("from lowrank_jax import cli\n", [1]),
    ("from lowrank_jax import cli as c, leaves\n", [1]),
    ("import importlib\nm = importlib.import_module('lowrank_jax.cli.main')\n", [2]),
    ("def f():\n    from lowrank_jax.cli import main\n", [2]),
    ("import lowrank_jax\nfrom lowrank_jax import client\nimport lowrank_jax.clip\n", []),
    ("from . import cli\n", []),  # relative: inside a package of its own
])
def test_the_scan_finds_every_form_of_import(source, lines):
    assert imports_of(source, "lowrank_jax.cli") == lines


def test_nothing_outside_the_command_imports_it():
    files = _files(PACKAGE, ROOT / "benchmarks", ROOT / "colab" / "src",
                   skip=(PACKAGE / "cli",))
    assert len(files) > 100  # the scan sees the package, the benchmarks and the notebooks
    assert any(p.parent.name == "src" for p in files)
    assert _offenders(files, "lowrank_jax.cli", ALLOWED_CLI) == []
    for rel in ALLOWED_CLI:  # an exception that no longer imports the command is dropped
        assert imports_of((ROOT / rel).read_text(encoding="utf-8"), "lowrank_jax.cli"), rel


def test_only_the_command_imports_the_recipes():
    files = _files(PACKAGE, skip=(PACKAGE / "cli", PACKAGE / "recipes"))
    assert _offenders(files, "lowrank_jax.recipes") == []


def test_the_commands_are_thin():
    """Every command module calls exactly one workflow of the recipes layer (its ``run_*``)."""
    from lowrank_jax.cli.main import COMMANDS

    for module in COMMANDS:
        tree = ast.parse(pathlib.Path(module.__file__).read_text(encoding="utf-8"))
        run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
                 for n in ast.walk(run) if isinstance(n, ast.Call)
                 and isinstance(n.func, (ast.Attribute, ast.Name))}
        workflows = sorted(c for c in calls if c.startswith("run_"))
        assert len(workflows) == 1, (module.__name__, workflows)
        assert not any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"
                       for n in ast.walk(run)), module.__name__  # printing: common.finish
