"""lowrank_jax.runtime: keep_freed_memory, checked with the kernel's page-fault counter in fresh
processes (malloc settings are process-wide, so the test process is never changed)."""

import os
import subprocess
import sys

import pytest

from lowrank_jax import runtime

# Allocate, touch and free a 48 MB block five times; print the minor page faults of the last
# four rounds (each round faults in the whole block again if it was given back to the system).
# The same from a second thread with an 80 MB block (more than a thread arena's 64 MB heap).
PROBE = r"""
import resource, sys, threading
import numpy as np
from lowrank_jax import runtime
mode, in_thread = sys.argv[1], sys.argv[2] == "thread"
if mode != "default":
    assert runtime.keep_freed_memory(one_arena=mode == "one_arena") is True
n = (20 if in_thread else 12) << 20  # float32: 80 or 48 MB, above the 32 MB mmap threshold
out = []

def rounds():
    for i in range(5):
        if i == 1:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a = np.empty(n, np.float32)
        a.fill(1.0)
        del a
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

if in_thread:
    t = threading.Thread(target=rounds)
    t.start()
    t.join()
else:
    rounds()
print(out[0])
"""

glibc_only = pytest.mark.skipif(runtime._glibc() is None, reason="needs glibc on Linux")


def _faults(mode, where="main"):
    out = subprocess.run([sys.executable, "-c", PROBE, mode, where], capture_output=True,
                         text=True, check=True, env={**os.environ, runtime.ENV: "0"})
    return int(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_keep_freed_memory_stops_refaulting_large_blocks():
    default, keep = _faults("default"), _faults("kept")
    # glibc's default: the block is mmapped and unmapped every round (numpy asks for huge
    # pages, so fewer faults than 4 KB pages); kept: the heap block is reused, no new faults
    assert default > 4 * 20, default
    assert keep <= max(8, default // 100), (keep, default)


@glibc_only
def test_one_arena_also_covers_large_blocks_of_other_threads():
    default, keep, one = (_faults(m, "thread") for m in ("default", "kept", "one_arena"))
    # a thread arena cannot hold 80 MB: without one arena the block is mapped every round
    assert default > 4 * 20 and keep > 4 * 20, (default, keep)
    assert one <= max(8, default // 100), (one, default)


@glibc_only
@pytest.mark.parametrize("value, expected", [("1", "True"), ("one_arena", "one_arena"),
                                             ("0", "None"), ("yes", "None")])
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


def _find_tcmalloc():
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


@glibc_only
def test_malloc_library_is_glibc_without_a_preload():
    lib = runtime.malloc_library()
    assert lib is not None and os.path.basename(lib).startswith("libc.so"), lib
    assert runtime.preloaded_malloc() is None


@glibc_only
@pytest.mark.skipif(_find_tcmalloc() is None,
                    reason="tcmalloc is not installed (Debian: libtcmalloc-minimal4)")
def test_a_preloaded_allocator_is_named_and_left_alone():
    # glibc's mallopt would not reach tcmalloc: keep_freed_memory must say it did nothing
    lib = _find_tcmalloc()
    code = ("from lowrank_jax import runtime as r; k = r.keep_freed_memory(); "
            "print(r.malloc_library()); print(r.preloaded_malloc()); "
            "print(k, r.freed_memory_kept())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, runtime.ENV: "0", "LD_PRELOAD": lib})
    lines = out.stdout.strip().splitlines()
    assert os.path.realpath(lines[-3]) == os.path.realpath(lib)
    assert lines[-2] == lines[-3]
    assert lines[-1] == "False None"
