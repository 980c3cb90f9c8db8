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


def test_readme_examples_run(capsys):
    blocks = python_blocks()
    assert len(blocks) >= 4
    ns: dict = {}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), ns)  # noqa: S102
        except Exception as e:  # pragma: no cover - the message names the block
            pytest.fail(f"README python block {i} failed: {type(e).__name__}: {e}\n{block}")
    out = capsys.readouterr().out
    assert "scale_columns" in out or "scaled" in out
