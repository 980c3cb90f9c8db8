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

# JAX's persistent compilation cache, shared by the pytest-xdist workers and by the processes
# the tests start (set through the environment, which subprocesses inherit): many tests compile
# the same programs (the same small models under fresh `jax.jit` objects, the same train step in
# every process of a kill-and-resume run); a cache hit loads the executable XLA built before, so
# no result changes (programs over several devices excepted: see below). LOWRANK_JAX_TEST_CACHE
# overrides the directory; set it to an empty string to turn the cache off.
#
# Every program is cached, however fast it compiled: the suite compiles thousands of small ones
# (a warm run took 7.6 minutes with every program cached against 12.5 with only those over
# 0.2 s). JAX's own size limit (jax_compilation_cache_max_size) scans the whole directory on
# every write, so the directory is emptied instead when it passes _CACHE_LIMIT, before the
# workers start.
_CACHE_LIMIT = 2 * 2**30
_cache = os.environ.get("LOWRANK_JAX_TEST_CACHE")
if _cache is None:
    import tempfile

    _cache = os.path.join(tempfile.gettempdir(), f"lowrank_jax_test_xla_cache_{os.getuid()}")
if _cache:
    if "PYTEST_XDIST_WORKER" not in os.environ and os.path.isdir(_cache):
        _entries = list(os.scandir(_cache))
        if sum(e.stat().st_size for e in _entries if e.is_file()) > _CACHE_LIMIT:
            for _entry in _entries:
                if _entry.is_file():
                    os.remove(_entry.path)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Property tests (hypothesis) draw the same examples in every run, so that a run of the README's
# test command, which stops at the first failure, never fails on an example no earlier run drew.
# `--hypothesis-profile=explore` draws new ones (and keeps failing examples in .hypothesis/).
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("deterministic", derandomize=True, database=None)
_hypothesis_settings.register_profile("explore")
_hypothesis_settings.load_profile("deterministic")


def _no_cache_for_multi_device_programs() -> None:
    """Keep programs over several devices out of the persistent cache.

    An executable loaded from the cache that runs collectives over the 8 simulated devices can
    deadlock in XLA:CPU's rendezvous when another process competes for the 2 cores (seen in
    tests/train/test_step.py's FSDP step: device 0 waiting in an all-gather while the other
    seven wait in an all-reduce, then an abort after 40 s; four of five concurrent pairs of
    processes with the cache, none of three without). Freshly compiled ones never did, so
    multi-device programs are compiled every time; single-device programs (most of the suite)
    keep the cache. JAX has no public switch for this: the hook is its private cache-key
    function; if a JAX release renames it, the cache is turned off altogether instead.
    """
    try:
        from jax._src import compiler
        original = compiler._get_cache_key
    except (ImportError, AttributeError):
        jax.config.update("jax_enable_compilation_cache", False)
        return

    def _get_cache_key(options, backend, computation, devices, *args, **kwargs):
        if getattr(devices, "size", 1) > 1:
            return None
        return original(options, backend, computation, devices, *args, **kwargs)

    compiler._get_cache_key = _get_cache_key


_no_cache_for_multi_device_programs()



# ---------------------------------------------------------------------------------------------
# Shared test types.

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from lowrank_jax.leaves import QK, leaf_dataclass  # noqa: E402


@leaf_dataclass(meta=("heads",))
class JointQK(QK):
    """A query-key type holding only the joint tensor ``y: [d_q, d_k, heads]``: logits, no
    q/k weights and no ``queries`` / ``keys`` (the exporter and chunked attention must handle
    query-key types they have never seen)."""

    y: jax.Array
    heads: int = 1

    @property
    def num_heads(self):
        return self.heads

    @property
    def d_q_in(self):
        return self.y.shape[0]

    @property
    def d_k_in(self):
        return self.y.shape[1]

    def logits(self, xq, xkv, *, q_mask=None, k_mask=None):
        return jnp.einsum("bqd,deh,bke->bhqk", xq, self.y, xkv)

    def score_flops(self, q_len, k_len):
        return q_len * k_len * self.heads

    def joint(self):
        return self.y

    def keep_heads(self, idx):
        return JointQK(self.y[..., np.asarray(idx)], len(idx))

    def keep_inputs(self, idx, side):
        return self


class _CompileCounter:
    """Counts XLA compilations of one jitted function while a ``with`` block runs.

    Each program XLA builds for the function, or loads from the persistent compilation cache,
    counts once; a call served by jit's own dispatch cache counts nothing. Counted through
    ``jax.monitoring`` (JAX's backend-compile event, recorded with the function's name), not
    through the jitted function's private dispatch-cache size: that size read 0 right after
    calls in a full suite run (cause not found), so a test on it failed at random.
    """

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self, jitted):
        self.name = f"jit({jitted.__name__})"
        self.count = 0

    def _listener(self, event, duration, **kwargs):
        del duration
        if event == self.EVENT and kwargs.get("fun_name") == self.name:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)
        return False


@pytest.fixture(scope="session")
def count_compiles():
    """``with count_compiles(jitted) as c: ...`` then ``c.count``: the compilations of
    ``jitted`` in the block (see :class:`_CompileCounter`)."""
    return _CompileCounter


@pytest.fixture
def joint_qk():
    """The :class:`JointQK` type (test modules are imported apart, so it comes as a fixture)."""
    return JointQK


@pytest.fixture(scope="session")
def lm():
    """``tests/lm_builders.py``: tiny random GPT-2 / Llama-style models built with transformers
    (test modules are imported apart, so it comes as a fixture)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_builders.py")
    spec = importlib.util.spec_from_file_location("lowrank_jax_tests_lm_builders", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# The leaf rule, checked in every test.
#
# The leaf rule, checked while the suite runs: no module of lowrank_jax outside ``leaves/``
# reads a field of a leaf or of a query-key object.
#
# Blocks, compressors and converters must ask a leaf what it can do (``linear``, ``factors``,
# ``keep_inputs``, ``bias_of``, ...), never read its arrays by name: then a user's leaf type takes
# every path a built-in one takes. A static scan cannot tell ``leaf.v`` from ``heads.v``, so the
# check is dynamic: :func:`install` gives every registered lowrank_jax node class (weight leaves
# and query-key objects) a ``__getattribute__`` that, for the names of the class's dataclass
# fields, looks at the calling frame's module and records the read when that module is part of
# lowrank_jax but not of ``lowrank_jax.leaves``. ``tests/conftest.py`` installs it for the whole
# suite and fails the test during which a read is recorded, so every test is also a workload
# for the rule.
#
# Exempt: :class:`~lowrank_jax.HeadLayout` (a static layout record, not a weight: its fields are
# its API), reads from ``lowrank_jax.leaves`` (the leaf kit), and reads by code that is not
# lowrank_jax (tests, JAX's own tree utilities through the flatten functions in ``leaves``).

import sys  # noqa: E402
import threading  # noqa: E402

_LOCK = threading.Lock()
VIOLATIONS: list[tuple[str, str, str]] = []  # (caller "module:line", class, field)
_INSTALLED: dict[type, object] = {}


def _checked_classes():
    """``{class: field names}`` of every leaf and query-key class of ``lowrank_jax.leaves``,
    less the names of the protocol itself (``shape``, ``d_in``, ``bias``, ``num_heads``, ...:
    a field that is also a protocol member, such as ``PackedBinary.d_in``, may be read)."""
    from lowrank_jax.leaves import QK, HeadLayout, Leaf
    from lowrank_jax.leaves.base import data_fields, meta_fields, node_types

    protocol = set(dir(Leaf)) | set(dir(QK))
    out = {}
    for name, cls in node_types().items():
        if not name.startswith("lowrank_jax.leaves.") or cls is HeadLayout:
            continue
        out[cls] = frozenset(data_fields(cls)) | frozenset(meta_fields(cls)) - protocol
    return out


def _allowed(module: str) -> bool:
    return not module.startswith("lowrank_jax") or module.startswith("lowrank_jax.leaves")


def install() -> None:
    """Give every lowrank_jax node class the recording ``__getattribute__`` (idempotent)."""
    for cls, fields in _checked_classes().items():
        if cls in _INSTALLED:
            continue
        original = cls.__getattribute__

        def getattribute(self, name, _fields=fields, _original=original, _cls=cls):
            if name in _fields:
                frame = sys._getframe(1)
                module = frame.f_globals.get("__name__", "")
                if not _allowed(module):
                    with _LOCK:
                        VIOLATIONS.append((f"{module}:{frame.f_lineno}", _cls.__name__, name))
            return _original(self, name)

        _INSTALLED[cls] = original
        cls.__getattribute__ = getattribute


def take() -> list[tuple[str, str, str]]:
    """The reads recorded since the last call (and forget them)."""
    with _LOCK:
        out = sorted(set(VIOLATIONS))
        VIOLATIONS.clear()
    return out


_LEAF_RULE = os.environ.get("LOWRANK_JAX_LEAF_RULE", "fail")  # fail | report:PATH | off


@pytest.fixture(autouse=True)
def _leaf_rule(request):
    """Fail a test during which lowrank_jax read a leaf's field outside ``leaves/``
    (``LOWRANK_JAX_LEAF_RULE=report:PATH`` appends them to PATH instead; ``off``: no check)."""
    if _LEAF_RULE == "off":
        yield
        return
    install()
    take()
    yield
    found = take()
    if not found:
        return
    if _LEAF_RULE.startswith("report:"):
        with open(_LEAF_RULE[len("report:"):], "a") as f:
            for where, cls, field in found:
                f.write(f"{where}\t{cls}.{field}\t{request.node.nodeid}\n")
        return
    lines = "\n".join(f"  {where} read {cls}.{field}" for where, cls, field in found)
    pytest.fail("lowrank_jax read leaf fields outside lowrank_jax/leaves (ask the leaf for a "
                f"capability instead):\n{lines}", pytrace=False)


# ---------------------------------------------------------------------------------------------
# Tests marked `accelerator` mean something only on a GPU or TPU (a Pallas kernel run natively,
# TF32 against `highest`, bf16 error on the device): skipped, with the reason, on a CPU backend.
# On a GPU machine: JAX_PLATFORMS=cuda python -m pytest -m accelerator tests


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if "accelerator" in item.keywords]
    if not marked:
        return
    backend = jax.default_backend()
    if backend != "cpu":
        return
    skip = pytest.mark.skip(reason=f"accelerator test: JAX's default backend is {backend!r}; run "
                                   "on a GPU/TPU machine with JAX_PLATFORMS=cuda (or tpu) "
                                   "python -m pytest -m accelerator tests")
    for item in marked:
        item.add_marker(skip)


def pytest_unconfigure(config):
    """One garbage collection, then ``gc.freeze()``, before pytest's own end-of-run passes.

    After this hook pytest runs ``gc.collect()`` five times to surface exceptions raised in
    finalizers. A worker ends with over a million live objects (compiled programs, traces), and
    every pass also runs JAX's collection callback. The last worker took 7.6 s in those passes
    (py-spy, 2026-11-29). That is past execnet's 5 s shutdown grace, so execnet sent the worker a
    SIGINT and the run ended with a ``KeyboardInterrupt`` warning; the worker that finished first
    spent its passes competing with the other's last tests. One pass here still reports
    exceptions raised in finalizers (pytest's hook is still installed), and the frozen objects
    make pytest's five passes cheap.
    """
    del config
    import gc

    gc.collect()
    gc.freeze()
