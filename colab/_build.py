"""Build the Colab notebooks in ``colab/`` from their sources in ``colab/src/``.

Each notebook is written as a Python file in the "percent" format that jupytext and VS Code
read (``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose lines are
comments), so it can be edited, diffed and linted as code; this script turns every
``colab/src/NN_name.py`` into ``colab/NN_name.ipynb`` with nbformat, outputs cleared and
``execution_count`` null. ``tests/test_notebooks.py`` checks that the committed notebooks equal
this script's output, so edit the source and run::

    python colab/_build.py            # rewrite every notebook
    python colab/_build.py --check    # exit 1 if a committed notebook is out of date
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE / "src"
MARKDOWN = "# %% [markdown]"
CODE = "# %%"

METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
    "colab": {"provenance": []},
}


def parse(text: str, name: str = "<source>") -> list[tuple[str, str]]:
    """``[(kind, source)]`` of a percent-format file: kind is ``'markdown'`` or ``'code'``.

    Markdown lines are comments: ``# text`` becomes ``text``, a bare ``#`` an empty line.
    Leading and trailing blank lines of a cell are dropped. Comments before the first cell
    marker are the file's header (a ruff directive), not part of the notebook.

    Raises:
      ValueError: code before the first marker, a markdown line that is not a comment, or an
        empty cell (naming the file and line).
    """
    cells: list[tuple[str, list[str], int]] = []
    for i, line in enumerate(text.splitlines(), 1):
        stripped = line.rstrip()
        if stripped == MARKDOWN:
            cells.append(("markdown", [], i))
        elif stripped == CODE:
            cells.append(("code", [], i))
        elif not cells:
            if stripped and not stripped.startswith("#"):
                raise ValueError(f"{name}:{i}: code before the first '# %%' marker")
        else:
            kind, lines, _ = cells[-1]
            if kind == "markdown" and stripped:
                if not (stripped == "#" or stripped.startswith("# ")):
                    raise ValueError(f"{name}:{i}: a markdown cell's lines must be comments "
                                     f"('# text'), got {line!r}")
                stripped = stripped[2:]
            elif kind == "markdown":
                stripped = ""
            lines.append(stripped)
    out = []
    for kind, lines, start in cells:
        while lines and not lines[0].strip():
            lines.pop(0)
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            raise ValueError(f"{name}:{start}: empty {kind} cell")
        out.append((kind, "\n".join(lines)))
    return out


def build(source: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook of one source file (outputs empty, execution counts null)."""
    nb = nbformat.v4.new_notebook(metadata=METADATA)
    for kind, text in parse(source.read_text(), source.name):
        cell = (nbformat.v4.new_markdown_cell(text) if kind == "markdown"
                else nbformat.v4.new_code_cell(text))
        nb.cells.append(cell)
    # stable cell ids (nbformat >= 4.5 needs ids; random ones would change on every build)
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{source.stem[:2]}-{i:02d}"
    nbformat.validate(nb)
    return nb


def render(source: pathlib.Path) -> str:
    """The ``.ipynb`` text of one source file, as this script writes it."""
    return nbformat.writes(build(source)) + "\n"


def sources() -> list[pathlib.Path]:
    """Every notebook source, in order."""
    return sorted(SRC.glob("[0-9][0-9]_*.py"))


def target(source: pathlib.Path) -> pathlib.Path:
    return HERE / f"{source.stem}.ipynb"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="only check that the committed notebooks are up to date")
    args = ap.parse_args(argv)
    stale = []
    for src in sources():
        text, path = render(src), target(src)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent)}")
    if stale:
        print("out of date (run python colab/_build.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
