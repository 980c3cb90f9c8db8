"""The README's Python examples run as written (in order, in one namespace), and import only
public names."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_import_only_public_names():
    for block in python_blocks():
        for line in block.splitlines():
            m = re.match(r"\s*from (\S+) import (.+)", line)
            if m:
                assert not any(p.startswith("_") for p in m.group(1).split(".")), line
                assert "cli" not in m.group(1).split("."), line
                names = [n.strip(" ()").split(" as ")[0] for n in m.group(2).split(",")]
                assert not any(n.startswith("_") for n in names if n), line


def sections() -> dict[str, list[str]]:
    """The README's python blocks grouped by the ``## `` section they are in (in order)."""
    out: dict[str, list[str]] = {}
    title = "(top)"
    for part in re.split(r"(?m)^(## .*)$", README.read_text()):
        if part.startswith("## "):
            title = part[3:].strip()
            continue
        blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
        if blocks:
            out.setdefault(title, []).extend(blocks)
    return out


def test_readme_has_examples_in_every_method_section():
    got = sections()
    assert sum(len(b) for b in got.values()) == len(python_blocks()) >= 8
    for word in ("Irregular attention", "Structured pruning", "Sparse binary", "Partitioning",
                 "Flax", "Architecture"):
        assert any(word in t for t in got), word


@pytest.mark.parametrize("section", list(sections()))
def test_readme_examples_run(section, capsys):
    """Each section's examples run as written, in order, in one namespace of their own (a
    section never relies on another's names)."""
    ns: dict = {}
    for i, block in enumerate(sections()[section]):
        try:
            exec(compile(block, f"README.md '{section}' python block {i}", "exec"), ns)  # noqa: S102
        except Exception as e:  # pragma: no cover - the message names the block
            pytest.fail(f"README '{section}' python block {i} failed: {type(e).__name__}: {e}\n"
                        f"{block}")
    out = capsys.readouterr().out
    if section == "Architecture":
        assert "scale_columns" in out or "scaled" in out
