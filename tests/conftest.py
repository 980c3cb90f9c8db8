"""Test configuration: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# JAX's persistent compilation cache, shared by the pytest-xdist workers: many tests compile
# the same programs (the same small models under fresh `jax.jit` objects); a cache hit loads
# the executable XLA built before, so no result changes. LOWRANK_JAX_TEST_CACHE overrides the
# directory; set it to an empty string to turn the cache off.
_cache = os.environ.get("LOWRANK_JAX_TEST_CACHE")
if _cache is None:
    import tempfile

    _cache = os.path.join(tempfile.gettempdir(), f"lowrank_jax_test_xla_cache_{os.getuid()}")
if _cache:
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
