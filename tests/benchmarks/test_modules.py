"""Every benchmark module imports and answers ``--help`` (nothing runs); the commands of the
READMEs and the documentation pages name benchmarks that exist; the dispatcher and run_all
start as commands."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import sys

import pytest

from benchmarks import _harness as H

ROOT = H.ROOT
MODULES = [(t, n) for t in H.TOPICS for n in H.benchmark_names(t)]


@contextlib.contextmanager
def same_environment():
    """Some modules set variables (``XLA_FLAGS``, ``OMP_WAIT_POLICY``) when imported."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


EXPECTED = {
    "layers": {"linear", "mlp", "attention", "query_key", "head_lowrank", "binary", "libraries",
               "rank_multiple", "chunks_sharded", "quantize"},
    "models": {"forward", "peak", "decode", "train", "sbt"},
    "methods": {"sweep", "pruning", "partition", "irregular_attention", "cp_als",
                "pretrain_seeds", "prune_then_finetune", "recipe_quality", "flax_vit_digits"},
    "machine": {"allocator", "blas_threads", "checkpoints", "call_path"},
}


def test_every_benchmark_is_found_in_its_topic():
    assert set(H.TOPICS) == set(EXPECTED)
    for topic, names in EXPECTED.items():
        assert names <= set(H.benchmark_names(topic)), topic


@pytest.mark.parametrize("topic, name", MODULES)
def test_module_imports_and_answers_help(topic, name, capsys):
    with same_environment():
        mod = importlib.import_module(f"benchmarks.{topic}.{name}")
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--json" in out and "--quick" in out
    first = " ".join(mod.__doc__.strip().split("\n\n")[0].split())
    assert " ".join(out.split()).find(first[:40]) >= 0  # the description is the docstring's
    assert H.summary_line(topic, name) and "python -m benchmarks." in mod.__doc__


COMMAND = re.compile(r"python -m benchmarks\.(\w+)(?: +([a-z_]+))?")


def _readme_commands():
    docs = [os.path.relpath(os.path.join(d, f), ROOT)
            for d, _, files in os.walk(os.path.join(ROOT, "docs")) if "_build" not in d
            for f in files if f.endswith(".md")]
    for path in ("README.md", "benchmarks/README.md", *sorted(docs)):
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        yield path, text, COMMAND.findall(text)


def test_readme_commands_name_existing_benchmarks():
    found = 0
    for path, text, commands in _readme_commands():
        for topic, name in commands:
            found += 1
            if topic in ("run_all", "gpu"):  # the two top-level scripts
                continue
            assert topic in H.TOPICS, f"{path}: python -m benchmarks.{topic}"
            assert not name or name in H.benchmark_names(topic), f"{path}: {topic} {name}"
        old = re.findall(r"python benchmarks/(?!(?:run_all|gpu)\.py)\w+\.py", text)
        assert not old, f"{path}: commands of the old layout {sorted(set(old))}"
    assert found > 30


@pytest.mark.parametrize("argv", [["-m", "benchmarks.machine", "call_path", "--help"],
                                  ["benchmarks/run_all.py", "--help"],
                                  ["-m", "benchmarks"]])
def test_commands_start(argv):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "usage" in p.stdout or "layers" in p.stdout
