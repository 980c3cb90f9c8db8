"""The example notebooks as pages, rendered from the copies the test suite executed.

``tests/test_notebooks.py`` runs every notebook of ``colab/`` once per CI run and saves the
executed copy to ``docs/_build/notebooks/`` (ignored by git; ``LOWRANK_JAX_EXECUTED_NOTEBOOKS``
names another folder). When the build starts, each notebook is copied to
``docs/notebooks/<name>.ipynb`` (also ignored): the executed copy where there is one, otherwise
the committed source without outputs, with a note at the top saying so. The pages are never
executed by Sphinx (``nb_execution_mode = "off"``), so each notebook runs once per CI.
"""

from __future__ import annotations

import json
import os
import pathlib

NOTE = ("```{note}\nThis page shows the notebook without its outputs: the executed copy was not "
        "found. Run `python -m pytest tests/test_notebooks.py` before building the docs to "
        "render the outputs, or open the notebook in Colab.\n```")


def executed_dir(root: pathlib.Path) -> pathlib.Path:
    """Where the test suite saves executed notebooks."""
    return pathlib.Path(os.environ.get("LOWRANK_JAX_EXECUTED_NOTEBOOKS",
                                       root / "docs" / "_build" / "notebooks"))


def sources(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((root / "colab").glob("[0-9][0-9]_*.ipynb"))


def copy_notebooks(root: pathlib.Path, out: pathlib.Path) -> dict[str, bool]:
    """Copy each notebook to ``out``; returns ``{name: executed}``."""
    out.mkdir(parents=True, exist_ok=True)
    done = {}
    for source in sources(root):
        executed = executed_dir(root) / source.name
        use = executed if executed.exists() else source
        nb = json.loads(use.read_text())
        if use is source:
            nb["cells"].insert(1, {"cell_type": "markdown", "id": "unexecuted-note", "metadata": {},
                                  "source": NOTE})
        text = json.dumps(nb, indent=1) + "\n"
        target = out / source.name
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
        done[source.stem] = use is executed
    names = {s.name for s in sources(root)}
    for stale in out.glob("*.ipynb"):
        if stale.name not in names:
            stale.unlink()
    return done


def _on_builder_inited(app) -> None:
    src = pathlib.Path(app.srcdir)
    copy_notebooks(src.parent, src / "notebooks")


def setup(app):
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
