"""The Colab notebooks in ``colab/`` run top to bottom and are what ``colab/_build.py`` makes.

Every notebook is executed in a fresh ``python3`` kernel (nbclient, ipykernel) with its small
CPU settings (``LOWRANK_JAX_FULL`` unset), in a temporary working directory, with
``MPLBACKEND=Agg``; a cell that raises fails the test, and so does a notebook that runs past
its time limit. The notebooks assert their own headline results in their cells (for example
``assert err_export < 1e-4``), so a wrong number fails here, not only an exception. One test
per notebook, so that pytest-xdist spreads them over workers.

The kernels share the test suite's persistent XLA compilation cache (``conftest.py``;
``LOWRANK_JAX_TEST_CACHE`` overrides the directory, an empty string turns it off): a cache hit
loads the program XLA compiled before, so results do not change, only compile time.
``LOWRANK_JAX_NOTEBOOK_TIMEOUT`` (seconds, default 300) is the limit per notebook.

A notebook that ran saves its executed copy to ``docs/_build/notebooks/`` (ignored by git;
``LOWRANK_JAX_EXECUTED_NOTEBOOKS`` names another folder, an empty string saves nothing): the
documentation renders those copies without executing anything, so each notebook runs once per
CI run.

The static checks (committed notebooks equal the builder's output, no outputs committed, the
install cell, the ``FULL`` flag, the README's badges) need no kernel and run first.
"""

import importlib.util
import json
import os
import pathlib
import re
import tempfile
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(COLAB.glob("[0-9][0-9]_*.ipynb"))
TIMEOUT = float(os.environ.get("LOWRANK_JAX_NOTEBOOK_TIMEOUT", "300"))
EXECUTED = os.environ.get("LOWRANK_JAX_EXECUTED_NOTEBOOKS",
                          str(ROOT / "docs" / "_build" / "notebooks"))
REPO_URL = "https://github.com/lowrank-jax/lowrank_jax"


def _builder():
    spec = importlib.util.spec_from_file_location("colab_build", COLAB / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_source_has_a_notebook_and_back():
    build = _builder()
    assert [s.stem for s in build.sources()] == [n.stem for n in NOTEBOOKS]
    assert len(NOTEBOOKS) == 7 and NOTEBOOKS[0].name == "00_quickstart.ipynb"


@pytest.mark.parametrize("source", _builder().sources(), ids=lambda p: p.stem)
def test_committed_notebook_equals_the_builders_output(source):
    """Edit ``colab/src/NAME.py`` and run ``python colab/_build.py``; never the ``.ipynb``."""
    build = _builder()
    assert build.target(source).read_text() == build.render(source), (
        f"{build.target(source).name} is out of date: run python colab/_build.py")


def test_builder_parses_percent_cells_and_rejects_bad_markdown():
    build = _builder()
    cells = build.parse("# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\n\n# %%\ny = 2\n")
    assert cells == [("markdown", "# Title\n\ntext"), ("code", "x = 1"), ("code", "y = 2")]
    with pytest.raises(ValueError, match="comments"):
        build.parse("# %% [markdown]\nnot a comment\n")
    with pytest.raises(ValueError, match="before the first"):
        build.parse("x = 1\n# %%\ny = 2\n")
    assert build.parse("# ruff: noqa: E402\n\n# %%\ny = 2\n") == [("code", "y = 2")]
    with pytest.raises(ValueError, match="empty code cell"):
        build.parse("# %%\n\n# %%\ny = 2\n")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_layout(path):
    """Title and paper first, an install cell that runs only in Colab with the repository URL
    in one place, the FULL flag (settable by LOWRANK_JAX_FULL=1), no committed outputs."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert re.search(r"Paper: \*[^*]+\*", first.source), "the first cell names the paper"
    assert re.search(r"arXiv:\d{4}\.\d{4,5}|no arXiv version", first.source)
    assert "FULL = True" in first.source and "FULL = False" in first.source
    code = [c for c in nb.cells if c.cell_type == "code"]
    install = code[0].source
    assert 'if "google.colab" in sys.modules:' in install
    assert f'REPO = "{REPO_URL}"' in install and install.count(REPO_URL) == 1
    assert "lowrank-jax[plot,data" in install and "@ git+{REPO}" in install
    assert sum(REPO_URL in c.source for c in nb.cells) == 1, "the repository URL in one place"
    assert "FULL = False" in code[1].source
    assert 'os.environ.get("LOWRANK_JAX_FULL") == "1"' in code[1].source
    for c in code:
        assert c.outputs == [] and c.execution_count is None, "outputs are not committed"
    assert any(c.cell_type == "code" and "assert " in c.source for c in nb.cells[2:]), (
        "a notebook asserts its headline result")
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= 4, "prose between the cells"


def test_readme_lists_every_notebook_with_its_colab_badge():
    text = (COLAB / "README.md").read_text()
    for path in NOTEBOOKS:
        url = ("https://colab.research.google.com/github/lowrank-jax/lowrank_jax/blob/main/colab/"
               f"{path.name}")
        assert url in text, f"colab/README.md has no badge for {path.name}"


def _kernel_env(workdir: str) -> dict:
    env = dict(os.environ)
    env.pop("LOWRANK_JAX_FULL", None)  # the small settings
    # conftest.py's 8 simulated devices are the test process's; a notebook sets what it needs
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env["XLA_FLAGS"] = flags.strip()
    if not env["XLA_FLAGS"]:
        env.pop("XLA_FLAGS")
    env["MPLBACKEND"] = "Agg"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ in the checkout
    cache = os.environ.get("LOWRANK_JAX_TEST_CACHE")
    if cache is None:
        cache = os.path.join(tempfile.gettempdir(), f"lowrank_jax_test_xla_cache_{os.getuid()}")
    if cache:
        env.update({"JAX_COMPILATION_CACHE_DIR": cache,
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
    env["HOME"] = os.environ.get("HOME", workdir)
    return env


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT,
                                     resources={"metadata": {"path": str(tmp_path)}})
    deadline = time.monotonic() + TIMEOUT
    before = sorted(p.name for p in COLAB.iterdir())
    with client.setup_kernel(env=_kernel_env(str(tmp_path)), cwd=str(tmp_path)):
        for index, cell in enumerate(nb.cells):
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"{path.name}: over the {TIMEOUT:.0f} s limit before cell {index}")
            client.timeout = max(1, int(left))  # what is left of the notebook's limit
            try:
                client.execute_cell(cell, index)
            except nbclient.exceptions.CellTimeoutError:
                pytest.fail(f"{path.name}: over the {TIMEOUT:.0f} s limit in cell {index}:\n"
                            f"{cell.source[:300]}")
            except nbclient.exceptions.CellExecutionError as e:
                pytest.fail(f"{path.name}: cell {index} failed:\n{e}")
    assert sorted(p.name for p in COLAB.iterdir()) == before, "the notebook wrote into colab/"
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert images, "the notebook shows its plots"
    json.dumps(nb)  # the executed notebook is still valid JSON (no stray objects)
    if EXECUTED:  # for the docs (docs/_ext/notebooks.py); written whole, then renamed
        folder = pathlib.Path(EXECUTED)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{path.name}.{os.getpid()}.tmp"
        nbformat.write(nb, tmp)
        os.replace(tmp, folder / path.name)
