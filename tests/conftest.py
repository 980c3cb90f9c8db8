"""Test configuration: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

# --xla_backend_optimization_level=0: the tests compile hundreds of small programs and run each
# a few times, so LLVM's optimization passes cost far more than they save (a tiny T5 train step
# compiles in 4 s instead of 13 s of CPU). It changes how fast the generated code runs, not what
# it computes; the tolerances are unchanged. Benchmarks never run under this file.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# JAX's persistent compilation cache for the processes the tests start (set through the
# environment, which subprocesses inherit): many of them compile the same programs (the same
# train step in every process of a kill-and-resume run); a cache hit loads the executable XLA
# built before, so no result changes. LOWRANK_JAX_TEST_CACHE overrides the directory; set it to
# an empty string to turn the cache off.
_cache = os.environ.get("LOWRANK_JAX_TEST_CACHE")
if _cache is None:
    import tempfile

    _cache = os.path.join(tempfile.gettempdir(), f"lowrank_jax_test_xla_cache_{os.getuid()}")
if _cache:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# ... but not inside the pytest processes themselves: an executable loaded from the cache that
# runs collectives over the 8 simulated devices can deadlock in XLA:CPU's rendezvous when another
# process competes for the 2 cores (seen in tests/train/test_step.py's FSDP step: device 0 waiting
# in an all-gather while the other seven wait in an all-reduce, then an abort after 40 s; four of
# five concurrent pairs with the cache, none of three without). Freshly compiled executables never
# did. The subprocesses the tests start (kill-and-resume runs, CLI runs) keep the cache.
jax.config.update("jax_enable_compilation_cache", False)

