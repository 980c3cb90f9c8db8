"""lowrank_jax.runtime: keep_freed_memory, checked with the kernel's page-fault counter in fresh
processes (malloc settings are process-wide, so the test process is never changed)."""

import os
import subprocess
import sys

import pytest

from lowrank_jax import runtime

# Allocate, touch and free a 48 MB block five times; print the minor page faults of the last
# four rounds (each round faults in the whole block again if it was given back to the system).
PROBE = r"""
import resource, sys
import numpy as np
from lowrank_jax import runtime
if sys.argv[1] == "keep":
    assert runtime.keep_freed_memory() is True
n = 12 << 20  # float32: 48 MB, above glibc's largest mmap threshold (32 MB)
for i in range(5):
    if i == 1:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(n, np.float32)
    a.fill(1.0)
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""

glibc_only = pytest.mark.skipif(runtime._glibc() is None, reason="needs glibc on Linux")


def _faults(mode):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, runtime.ENV: "0"})
    return int(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_keep_freed_memory_stops_refaulting_large_blocks():
    default, keep = _faults("default"), _faults("keep")
    pages = 4 * (48 << 20) // 4096  # four rounds of a 48 MB block in 4 KB pages
    # glibc's default: the block is mmapped and unmapped every round (with transparent huge
    # pages, fewer faults of 2 MB); kept: the heap block is reused, nothing is faulted again
    assert default > 4 * 20, default
    assert keep <= max(8, default // 100), (keep, default, pages)


@glibc_only
@pytest.mark.parametrize("value, expected", [("1", "True"), ("0", "None"), ("yes", "None")])
def test_env_variable_at_import(value, expected):
    code = "import lowrank_jax as lj; print(lj.runtime.freed_memory_kept())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, runtime.ENV: value})
    assert out.stdout.strip().splitlines()[-1] == expected
    assert ("ignoring" in out.stderr) == (value == "yes")


@glibc_only
def test_restore_defaults_in_a_fresh_process():
    code = ("from lowrank_jax import runtime as r; assert r.keep_freed_memory(); "
            "assert r.keep_freed_memory(False); print(r.freed_memory_kept())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, runtime.ENV: "0"})
    assert out.stdout.strip() == "False"


def test_not_glibc_changes_nothing(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    before = runtime.freed_memory_kept()
    assert runtime._glibc() is None
    assert runtime.keep_freed_memory() is False
    assert runtime.freed_memory_kept() == before


@glibc_only
@pytest.mark.parametrize("value, expected", [(None, "True"), ("0", "None")])
def test_the_command_keeps_freed_memory_unless_told_not_to(value, expected, tmp_path):
    # the command line (main() with argv from sys.argv) sets it; main([...]) from Python does not
    code = ("import sys; from lowrank_jax.cli.main import main; "
            f"sys.argv = ['lowrank-jax', 'compress', {str(tmp_path / 'missing')!r}, '--eps', '0.1', "
            "'--no-progress']; rc = main(); from lowrank_jax import runtime; "
            "print(rc, runtime.freed_memory_kept())")
    env = {k: v for k, v in os.environ.items() if k != runtime.ENV}
    if value is not None:
        env[runtime.ENV] = value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == f"2 {expected}"
    assert "missing" in out.stderr
