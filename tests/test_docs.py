"""The documentation site: every public name has an API entry, the pages read as
documentation (no development-log talk), the README is a front door, links resolve.

The site itself is built by ``.ci/run`` (``python -m sphinx -n -W --keep-going``); these checks
need no Sphinx build and run in the test suite.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import pathlib
import re
import sys
import tomllib
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import apigen  # noqa: E402  (docs/_ext: the API page generator)

sys.path.remove(str(DOCS / "_ext"))


def _public() -> tuple[str, ...]:
    """``PUBLIC`` of tests/test_public_api.py: the modules whose ``__all__`` is the API."""
    spec = importlib.util.spec_from_file_location("public_api", ROOT / "tests" / "test_public_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PUBLIC


PUBLIC = _public()


def pages() -> list[pathlib.Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)


def test_every_public_module_has_a_page():
    modules = apigen.public_modules()
    missing = [f"lowrank_jax.{m}" for m in PUBLIC if f"lowrank_jax.{m}" not in modules]
    assert not missing, f"public modules without an API page: {missing}"
    assert not any(m.startswith("lowrank_jax.cli") for m in modules)


def test_every_public_name_has_an_api_entry():
    """Each name of each public ``__all__`` is documented on its module's page: a class,
    function or constant entry, or a link to the page of a public submodule."""
    missing = []
    for module_name in apigen.public_modules():
        page = apigen.module_page(module_name)
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            canonical = apigen.object_index().get(id(obj))
            if isinstance(obj, types.ModuleType):
                entry = f":mod:`{obj.__name__}`"
            elif canonical and canonical != f"{module_name}.{name}":
                entry = f":obj:`{name} <{canonical}>`"  # documented on its package's page
            else:
                entry = next((f".. {d}:: {name}\n" for d in ("autoclass", "autoexception",
                                                             "autofunction", "py:data")
                              if f".. {d}:: {name}\n" in page), None)
            if entry is None or entry not in page:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names without an API entry: {missing}"


def test_each_public_name_is_documented_once_and_the_package_links_to_it():
    index = apigen.object_index()
    seen: dict[int, str] = {}
    twice = []
    for module_name in apigen.public_modules():
        module = importlib.import_module(module_name)
        page = apigen.module_page(module_name)
        for name, kind in apigen.entries(module_name):
            if kind in ("class", "exception", "function") and f":: {name}\n" in page:
                key = id(getattr(module, name))
                if key in seen:
                    twice.append((seen[key], f"{module_name}.{name}"))
                seen[key] = f"{module_name}.{name}"
    assert not twice, f"documented twice: {twice}"
    import lowrank_jax

    top = apigen.top_page()
    for name in lowrank_jax.__all__:
        full = index.get(id(getattr(lowrank_jax, name)))
        assert full and f":obj:`{full}`" in top, name


def test_the_generated_page_of_a_module():
    """A page names its module, has a summary and one entry per name, and a constant's
    ``#:`` comment is found in the module that defines it."""
    page = apigen.module_page("lowrank_jax.errors")
    assert page.count(".. autoexception:: ") == len(importlib.import_module(
        "lowrank_jax.errors").__all__)
    assert ".. automodule:: lowrank_jax.errors" in page and ".. autosummary::" in page
    pytest.importorskip("sphinx")  # the docs extra reads the comments
    assert apigen.data_doc("lowrank_jax.compress", "ATTENTION_QKVO")


DEVLOG = re.compile(r"issue[ -]?#?\s?\d|\bissues? \d|docs/notes|\bsessions?\b|\bwork period|"
                    r"development log|\bthis PR\b|CONTRACTS\.md", re.I)


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "CHANGELOG.md", *pages()],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_log_talk(path):
    """The README, the CHANGELOG (the site includes it) and every page."""
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for i, line in enumerate(path.read_text().splitlines(), 1) if DEVLOG.search(line)]
    assert not found, "issue numbers or development-log talk:\n" + "\n".join(found)


def test_the_devlog_check_can_fail():
    for text in ("see issue 12", "Issue #3", "docs/notes/issue-10.md", "an earlier session"):
        assert DEVLOG.search(text), text
    assert not DEVLOG.search("12 issues of the paper were resolved; see the design notes")


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15_500, f"README.md is {len(text.encode())} bytes"
    lines = text.splitlines()
    assert lines[0] == "# lowrank_jax" and lines[2] == "```bash"
    assert lines[4].startswith("python3 -m pip install -e \".[plot,data]\" && lowrank-jax demo")
    test_command = "python3 -m pytest tests -x -q -p no:cacheprovider -n 2"
    assert lines[7].endswith(test_command)
    assert test_command in (ROOT / ".ci" / "run").read_text(), "CI runs the README's command"
    for paper in ("arXiv:2510.03358", "xVoj8AtyQ1", "arXiv:2505.23195", "arXiv:2308.04637",
                  "Partitioning Transformer Networks with Low Intercommunication"):
        assert paper in text, paper
    assert "sphinx" in text and "docs/_build/html" in text, "how to build the docs"
    assert "@software" in text, "how to cite"


def _links(path: pathlib.Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
            if "://" not in t]


@pytest.mark.parametrize("path", [ROOT / "README.md", *pages()],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = [t for t in _links(path) if not (path.parent / t).exists()]
    assert not broken, f"{path.relative_to(ROOT)}: links to nothing: {broken}"


@pytest.mark.parametrize("path", sorted((DOCS / "methods").glob("*.md")),
                         ids=lambda p: p.stem)
def test_every_method_guide_cites_its_paper_and_says_what_it_does_not_do(path):
    if path.name == "index.md":
        return
    text = path.read_text()
    assert re.search(r"arXiv:\d{4}\.\d{4,5}|OpenReview \w+|no arXiv version", text), path.name
    assert re.search(r"^Paper: \*[^*]+\*", text, re.M), f"{path.name}: 'Paper: *title*' first"
    assert "\n## Limitations\n" in text, f"{path.name} has no Limitations section"
    assert "```python\n" in text, f"{path.name} has no runnable example"


def test_guides_and_design_notes_appear_without_editing_an_index():
    for folder in ("guides", "design"):
        index = (DOCS / folder / "index.md").read_text()
        assert ":glob:" in index and "\n*\n" in index, folder


def test_benchmark_tables_come_from_json_with_their_setup():
    text = (DOCS / "benchmarks.md").read_text()
    names = re.findall(r"\{benchmark-results\} (\S+\.json)", text)
    assert names
    for name in names:
        setup = json.loads((DOCS / "benchmarks" / name).read_text())["setup"]
        assert setup["command"].startswith("python -m benchmarks.") and setup["date"]


def test_one_version():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["version"] == "0.2.0"
    assert "## 0.2.0" in (ROOT / "CHANGELOG.md").read_text()
    import lowrank_jax

    assert lowrank_jax.__version__ == importlib.metadata.version("lowrank-jax")
    assert "docs" in meta["optional-dependencies"]


def test_notebook_pages_fall_back_to_the_sources_with_a_note(tmp_path, monkeypatch):
    """Without executed copies the pages are the committed notebooks plus a note (valid
    notebooks, so the build does not warn); with one, the executed copy is used as it is."""
    nbformat = pytest.importorskip("nbformat")
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import notebooks
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    monkeypatch.setenv("LOWRANK_JAX_EXECUTED_NOTEBOOKS", str(tmp_path / "none"))
    done = notebooks.copy_notebooks(ROOT, tmp_path / "pages")
    assert done and not any(done.values())
    for path in (tmp_path / "pages").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert "without its outputs" in nb.cells[1].source
    executed = tmp_path / "executed"
    executed.mkdir()
    source = notebooks.sources(ROOT)[0]
    (executed / source.name).write_text(source.read_text())
    monkeypatch.setenv("LOWRANK_JAX_EXECUTED_NOTEBOOKS", str(executed))
    done = notebooks.copy_notebooks(ROOT, tmp_path / "pages")
    assert done[source.stem] and sum(done.values()) == 1
    first = nbformat.read(tmp_path / "pages" / source.name, as_version=4)
    assert "without its outputs" not in first.cells[1].source
