"""The Python examples of the README and of the documentation pages run as written, and import
only public names.

The README's blocks run per ``## `` section, in order, in one namespace of their own; each page
under ``docs/`` runs its blocks in order in one namespace of its own (a page never relies on
another's names). A block that is not meant to run is written as ```` ```text ```` or preceded
by the line ``<!-- no-run -->``. Methods or leaf types a page registers are unregistered after
it, so examples cannot change what other tests see.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- no-run -->\s*\n)?```python\n(.*?)```", flags=re.S)


def doc_pages() -> list[pathlib.Path]:
    """Every Markdown page of the site (not the build output)."""
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)


def blocks_of(text: str) -> list[str]:
    """The python blocks of a Markdown text that are meant to run, in order."""
    return [code for skip, code in BLOCK.findall(text) if not skip]


def readme_sections() -> dict[str, list[str]]:
    """The README's python blocks grouped by the ``## `` section they are in (in order)."""
    out: dict[str, list[str]] = {}
    title = "(top)"
    for part in re.split(r"(?m)^(## .*)$", README.read_text()):
        if part.startswith("## "):
            title = part[3:].strip()
            continue
        blocks = blocks_of(part)
        if blocks:
            out.setdefault(title, []).extend(blocks)
    return out


def examples() -> dict[str, list[str]]:
    """``{name: blocks}``: each README section and each docs page with python blocks."""
    out = {f"README.md '{t}'": b for t, b in readme_sections().items()}
    for page in doc_pages():
        blocks = blocks_of(page.read_text())
        if blocks:
            out[str(page.relative_to(ROOT))] = blocks
    return out


def test_examples_import_only_public_names():
    for name, blocks in examples().items():
        for block in blocks:
            for line in block.splitlines():
                m = re.match(r"\s*from (\S+) import (.+)", line)
                if m:
                    assert not any(p.startswith("_") for p in m.group(1).split(".")), (name, line)
                    assert "cli" not in m.group(1).split("."), (name, line)
                    names = [n.strip(" ()").split(" as ")[0] for n in m.group(2).split(",")]
                    assert not any(n.startswith("_") for n in names if n), (name, line)


def test_the_readme_has_one_short_example_and_the_pages_the_rest():
    got = examples()
    assert sum(len(b) for n, b in got.items() if n.startswith("README")) >= 1
    pages = {n for n in got if not n.startswith("README")}
    for page in ("getting_started", "concepts", "methods/rank_and_svd",
                 "methods/compressed_pretraining", "methods/irregular_attention",
                 "methods/structured_pruning", "methods/sparse_binary", "methods/partitioning",
                 "guides/flax_models", "guides/composing", "guides/training",
                 "guides/custom_leaf", "guides/custom_method", "guides/convert_hf"):
        assert f"docs/{page}.md" in pages, f"docs/{page}.md has no runnable python block"


def test_a_block_marked_no_run_is_skipped():
    text = "```python\nx = 1\n```\n<!-- no-run -->\n```python\nraise SystemExit\n```\n"
    assert blocks_of(text) == ["x = 1\n"]


@pytest.fixture
def registries():
    """Restore the method and node-type registries after a page's examples."""
    from lowrank_jax.compress import registry
    from lowrank_jax.leaves import base

    methods, nodes = dict(registry._METHODS), dict(base._NODE_TYPES)  # noqa: SLF001
    yield
    registry._METHODS.clear()  # noqa: SLF001
    registry._METHODS.update(methods)  # noqa: SLF001
    base._NODE_TYPES.clear()  # noqa: SLF001
    base._NODE_TYPES.update(nodes)  # noqa: SLF001


@pytest.mark.parametrize("name", list(examples()))
def test_examples_run(name, capsys, registries):
    """Each README section's and each page's examples run as written, in order, in one
    namespace of their own."""
    ns: dict = {"__name__": "docs_example"}
    for i, block in enumerate(examples()[name]):
        try:
            exec(compile(block, f"{name} python block {i}", "exec"), ns)  # noqa: S102
        except Exception as e:  # pragma: no cover - the message names the block
            pytest.fail(f"{name} python block {i} failed: {type(e).__name__}: {e}\n{block}")
    out = capsys.readouterr().out
    if name == "docs/guides/custom_method.md":
        assert "scale_columns" in out and "sketch" in out
