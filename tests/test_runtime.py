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


# ---------------------------------------------------------------------------------------------
# Host BLAS threads: the thread counts read back with threadpoolctl's own threadpool_info.

def _blas_counts() -> list[int]:
    """The thread counts of the loaded BLAS libraries (NumPy's and SciPy's OpenBLAS ...)."""
    from threadpoolctl import threadpool_info

    return sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})


@pytest.fixture
def two_threads():
    """BLAS at 2 threads around the test (so that a limit of 1 shows, whatever the cores)."""
    import scipy.linalg  # noqa: F401 (SciPy's BLAS loaded too)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=2, user_api="blas"):
        assert _blas_counts() == [2]
        yield


def test_blas_threads_limits_inside_the_block_and_restores(two_threads):
    with runtime.blas_threads(1):
        assert _blas_counts() == [1]
    assert _blas_counts() == [2]
    with runtime.one_blas_thread():
        assert _blas_counts() == [1]
        with runtime.blas_threads(3):
            assert _blas_counts() == [3]
        assert _blas_counts() == [1]
    with runtime.blas_threads(None):  # None: nothing changes
        assert _blas_counts() == [2]
    assert _blas_counts() == [2]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_blas_threads_refuses_bad_limits(bad, two_threads):
    from lowrank_jax.errors import ConfigError

    with pytest.raises(ConfigError, match="blas_threads"):
        with runtime.blas_threads(bad):
            pass
    assert _blas_counts() == [2]


def test_blas_threads_reaches_scipy_loaded_later():
    # NumPy's BLAS only, then the block: SciPy's copy is loaded first and limited too
    code = ("import sys; from lowrank_jax import runtime; "
            "from threadpoolctl import threadpool_info, threadpool_limits\n"
            "assert 'scipy.linalg' not in sys.modules\n"
            "with threadpool_limits(limits=2, user_api='blas'), runtime.blas_threads(1):\n"
            "    print(sorted((i['filepath'].rsplit('/', 1)[-1], i['num_threads']) "
            "for i in threadpool_info() if i['user_api'] == 'blas'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, runtime.ENV: "0"})
    libs = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (our own print)
    assert len(libs) >= 2 and any("scipy" in name for name, _ in libs), libs
    assert all(n == 1 for _, n in libs), libs


def test_compress_decompositions_run_on_one_blas_thread(monkeypatch, two_threads):
    import numpy as np

    import lowrank_jax as lj
    from lowrank_jax.compress import Step, apply_plan, compress

    seen = []
    real = np.linalg.svd

    def svd(*a, **k):
        seen.append(_blas_counts())
        return real(*a, **k)

    monkeypatch.setattr(np.linalg, "svd", svd)
    w = np.random.default_rng(0).normal(size=(16, 12)).astype(np.float32)
    params = {"layer": {"w": lj.Dense(w)}}
    for run in (lambda **k: apply_plan(params, Step("svd", (r"w$",), {"rank": 2}), **k),
                lambda **k: compress(params, rules=(r"w$",), rank=2, **k)):
        for kw, expected in (({}, [1]), ({"blas_threads": None}, [2]),
                             ({"blas_threads": 3}, [3])):
            seen.clear()
            new, _ = run(**kw)
            assert seen and all(s == expected for s in seen), (kw, seen)
            assert lj.param_count(new) < lj.param_count(params)
        assert _blas_counts() == [2]


def test_frontier_and_prune_run_on_one_blas_thread(monkeypatch, two_threads):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lowrank_jax import nn
    from lowrank_jax.compress.frontier import run as frontier_mod
    from lowrank_jax.compress.prune import add_channel_masks, progressive_prune

    # frontier: its whole run (candidates' decompositions included) under the limit
    monkeypatch.setattr(frontier_mod, "_frontier", lambda *a: _blas_counts())
    assert frontier_mod.frontier(None, None, None) == [1]
    assert frontier_mod.frontier(None, None, None, blas_threads=None) == [2]

    cfg = nn.EncoderLayerConfig(attention=nn.AttentionConfig(), mlp=nn.MLPConfig("gelu"),
                                norm=nn.NormConfig())
    params = nn.init_encoder_layer(jax.random.PRNGKey(0), cfg, d_model=16,
                                   sizes=nn.LayerSizes(4, 4, 32))
    g = np.random.default_rng(0)
    batch = {"x": jnp.asarray(g.normal(size=(4, 5, 16)), jnp.float32),
             "y": jnp.asarray(g.normal(size=(4, 5, 16)), jnp.float32)}

    def loss_fn(p, b, key):
        return jnp.mean((nn.apply_encoder_layer(p, b["x"], cfg) - b["y"]) ** 2), {}

    masked = add_channel_masks(params, (r"mlp/(wi|wo)$",))
    seen = []
    for kw, expected in (({}, [1]), ({"blas_threads": None}, [2])):
        seen.clear()
        progressive_prune(masked, loss_fn, [batch] * 2, target=0.3, steps=2,
                          callback=lambda e: seen.append(_blas_counts()), **kw)
        assert seen == [expected] * 2, (kw, seen)
        assert _blas_counts() == [2]


def test_every_command_runs_on_one_blas_thread(monkeypatch, two_threads, tmp_path):
    # `analyze` calls no library function with blas_threads=: only the command's limit applies
    import numpy as np

    import lowrank_jax as lj
    from lowrank_jax.cli.main import main
    from lowrank_jax.io import save_params

    w = np.random.default_rng(0).normal(size=(16, 12)).astype(np.float32)
    save_params(tmp_path / "p", {"layer": {"w": lj.Dense(w)}})
    seen = []
    real = np.linalg.svd

    def svd(*a, **k):
        seen.append(_blas_counts())
        return real(*a, **k)

    monkeypatch.setattr(np.linalg, "svd", svd)
    assert main(["analyze", str(tmp_path / "p"), "--no-progress"]) == 0
    assert seen and all(s == [1] for s in seen), seen
    assert _blas_counts() == [2]
