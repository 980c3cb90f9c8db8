"""Process-wide settings for speed on CPU: keep freed memory for reuse; host BLAS threads.

XLA:CPU allocates every call's outputs and its temporaries afresh with ``malloc``. glibc's
``malloc`` serves blocks of 32 MB and more (and, before its threshold adapts, of 128 KB and
more) with ``mmap`` and returns them to the operating system on ``free``; the next call's block
of the same size then faults in every 4 KB page again, and the kernel zeroes each one. A
``[8192, 1024]`` float32 output is 32 MB: on a 2-core AVX-512 CPU the ``linear`` of a
``LowRank`` leaf of rank 51 into it took 23.3 ms per call with 9845 page faults in a fresh
process, 11.1 ms with them gone (``benchmarks/machine/allocator.py``).

:func:`keep_freed_memory` tells glibc to serve large blocks from its heap (``M_MMAP_MAX = 0``)
and not to give freed heap memory back to the system (``M_TRIM_THRESHOLD`` at its maximum), so
a block freed by one call is reused by the next with no page faults. The cost: the process
keeps its peak heap size until it exits (what it freed is reused by later allocations, not
returned). ``one_arena=True`` also keeps one ``malloc`` arena for all threads
(``M_ARENA_MAX = 1``): a block larger than a thread arena's 64 MB heap, which XLA's worker
threads request for large temporaries, is otherwise mapped and unmapped anyway (a 4-layer
ViT-Base forward on 32 images: 170 000 page faults per call without it, none with it; 1.09-1.14x
faster than glibc's default, against 1.05-1.06x without one arena). But then every thread
shares one ``malloc`` lock, and programs of many small operations slow down: the ``lowrank-jax
demo`` pretraining (a small Chronos-Bolt) took 89 s instead of 62-65 s, a small train step ran
0.72x as fast (1.17x without one arena). So it is not the default. Call it before the first
JAX computation: threads that already have an arena keep it.

It changes ``malloc`` for the whole process, PyTorch and NumPy included, so the library never
calls it on its own: the ``lowrank-jax`` command does (``LOWRANK_JAX_KEEP_FREED_MEMORY=0``
turns that off), and ``LOWRANK_JAX_KEEP_FREED_MEMORY=1`` makes ``import lowrank_jax`` call it
(``=one_arena``: with ``one_arena=True``).

A faster remedy where it can be installed: preload tcmalloc, which caches freed memory per
thread with no shared lock (Debian/Ubuntu ``apt install libtcmalloc-minimal4``, then
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 lowrank-jax ...``; the variable
must be set when the process starts). ``python -m benchmarks.machine allocator`` (2 rounds of fresh
processes, 2-core AVX-512 CPU), speed-up over glibc's default, kept / one arena / tcmalloc: small
train step 1.13x / 0.57x / 0.99x, ``LowRank`` d 768 and 1024 at 8192 tokens 1.13-1.18x /
1.01-1.11x / 1.18-1.20x, ViT-Base width on 32 images 1.06x / 0.99x / 1.06x, Chronos-Bolt-base
forward 1.06x / 1.03x / 1.07x and its gradient 1.07x / 1.04x / 1.11x; page faults per call of
the large programs 0-3 507 with tcmalloc against up to 69 416 kept, and a third less peak
memory (2.75 GB against 4.0 GB). In separate
processes, whole-batch attention blocks with 48-192 MB of logits ran 0.97-1.48x faster with it
than with freed memory kept (median 1.2x over 8 sizes), MLPs on 6304-16384 tokens
1.13-1.19x. jemalloc as Debian ships it returns freed memory after a delay and still faulted
every call (0.54-1.06x). With another allocator preloaded, :func:`keep_freed_memory` changes
nothing and returns ``False`` (:func:`malloc_library` names the allocator in use).

Not from any paper: an execution setting, like ``XLA_FLAGS``. On GPU and TPU the device
allocator already reuses memory; host ``malloc`` matters there only for host-side arrays.

Host BLAS threads
-----------------

The decompositions of ``compress`` (and the host-side linear algebra of ``prune`` and
``frontier``) run in NumPy's LAPACK, on OpenBLAS's thread pool: by default one thread per core,
which spin while they wait for work. The matrices are small (a model's weights, a few hundred
to a few thousand wide), so more threads buy little on an idle machine, and on a busy one the
spinning threads wait for cores that other processes hold. :func:`blas_threads` limits them for
the duration of a ``with`` block (with ``threadpoolctl``); ``apply_plan``, ``frontier`` and
``progressive_prune`` take ``blas_threads=`` (default 1) and apply it themselves, and every
``lowrank-jax`` command runs in :func:`one_blas_thread`. ``python -m benchmarks.machine blas_threads
--runs 3`` (2-core x86-64, OpenBLAS 0.3.30 from NumPy 2, 3 interleaved pairs per row, on a
machine shared with other jobs: load average 4-9, so no figure is from an idle machine),
default (2) threads s / one thread s, median and range: 48 truncated SVDs of 512 x 512 14.6
(10.8-15.6), and with one busy-looping process per core added 5.6 (5.5-8.5); ``apply_plan`` of
an ``svd`` step on a Chronos-Bolt of d_model 512 (24 matrices) 3.6 (0.9-8.9) and 3.6 (1.6-5.2);
2 SVDs of 2048 x 2048 3.0 (2.6-4.8) and 2.6 (2.5-3.6). One thread lost one pair of 18 (0.92,
while the machine was momentarily quiet), and the default threads used 3.9-12.1x its CPU time.
On an idle machine with many cores, large matrices may be faster on more threads: give
``blas_threads=None`` (OpenBLAS's own setting) or a larger limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import numbers
import os
import sys
from typing import Iterator

#: ``mallopt`` parameters (glibc ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
#: glibc's defaults, restored by ``keep_freed_memory(False)``.
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024
#: The environment variable read by ``import lowrank_jax`` ("1": call :func:`keep_freed_memory`,
#: "one_arena": with ``one_arena=True``) and by the ``lowrank-jax`` command ("0": do not).
ENV = "LOWRANK_JAX_KEEP_FREED_MEMORY"

_kept: bool | None = None  # None: never set by this module


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def malloc_library() -> str | None:
    """The file of the ``malloc`` this process calls: glibc's ``libc.so.6``, or an allocator
    preloaded in its place (``LD_PRELOAD=.../libtcmalloc_minimal.so.4``); ``None`` where it
    cannot be told (not Linux, or no ``dladdr``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        proc = ctypes.CDLL(None)  # the process's global symbols: a preloaded library wins
        addr = ctypes.cast(proc.malloc, ctypes.c_void_p).value
        info = _DlInfo()
        if not proc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.dli_fname:
            return None
    except (OSError, AttributeError):
        return None
    return os.fsdecode(info.dli_fname)


def preloaded_malloc() -> str | None:
    """The file of an allocator preloaded in place of glibc's ``malloc`` (tcmalloc, jemalloc),
    or ``None``: glibc's own, or where :func:`malloc_library` cannot tell."""
    lib = malloc_library()
    return None if lib is None or os.path.basename(lib).startswith("libc.") else lib


def _glibc():
    """The C library's handle if it is glibc on Linux and its ``malloc`` is the one in use
    (``mallopt`` does something), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it; musl's mallopt is a no-op)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    if preloaded_malloc() is not None:
        return None  # another allocator was preloaded: glibc's settings would not reach it
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory(enable: bool = True, *, one_arena: bool = False) -> bool:
    """Make glibc ``malloc`` keep freed memory for reuse (module docstring); process-wide.

    Args:
      enable: ``True``: serve large blocks from the heap and never trim it. ``False``: restore
        glibc's default limits (128 KB trim threshold, mmap allowed, and with ``one_arena`` 8
        arenas per core); glibc's dynamic adjustment of its mmap threshold, which any explicit
        setting switches off, stays off, and arenas created meanwhile stay.
      one_arena: also one arena for all threads (``M_ARENA_MAX = 1``; module docstring: faster
        for large activations, slower for many small operations).

    Returns:
      Whether the setting was applied: ``False`` where the C library is not glibc on Linux
      (macOS, Windows, musl) or another allocator replaced its ``malloc``
      (:func:`malloc_library`), and nothing changed.
    """
    global _kept
    libc = _glibc()
    if libc is None:
        return False
    if enable:
        opts = [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)]
        if one_arena:
            opts.append((M_ARENA_MAX, 1))
    else:  # glibc's arena limit: 8 per core on 64-bit systems
        opts = [(M_MMAP_MAX, DEFAULT_MMAP_MAX), (M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)]
        if one_arena:
            opts.append((M_ARENA_MAX, 8 * (os.cpu_count() or 1)))
    ok = all(libc.mallopt(p, v) == 1 for p, v in opts)
    if ok:
        _kept = ("one_arena" if one_arena else True) if enable else False
    return ok


def freed_memory_kept() -> bool | str | None:
    """What :func:`keep_freed_memory` last set: ``True``, ``"one_arena"`` (with
    ``one_arena=True``) or ``False``; ``None`` if it never ran (glibc's defaults, unless
    something else called ``mallopt``)."""
    return _kept


def apply_env(default: bool = False) -> bool:
    """Call :func:`keep_freed_memory` if :data:`ENV` says so (``"1"``; ``"one_arena"``: with
    ``one_arena=True``) or, unset, if ``default``; return whether it was applied. Any other
    value than ``"0"`` / ``"1"`` / ``"one_arena"`` / unset is ignored with a warning on
    stderr."""
    val = os.environ.get(ENV)
    if val not in (None, "", "0", "1", "one_arena"):
        print(f"lowrank_jax: ignoring {ENV}={val!r} (expected 0, 1 or one_arena)",
              file=sys.stderr)
        val = None
    if val in (None, ""):
        return keep_freed_memory(True) if default else False
    if val == "0":
        return False
    return keep_freed_memory(True, one_arena=val == "one_arena")


def check_blas_threads(limit) -> int | None:
    """``limit`` as an int, or ``None``; a ``ConfigError`` naming ``blas_threads`` if it is not
    an int >= 1 or None (for functions that take ``blas_threads=``, to check it before any
    work)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
        from lowrank_jax.errors import ConfigError

        raise ConfigError(f"blas_threads: the limit must be an int >= 1 or None, got {limit!r}",
                          where="blas_threads", expected="an int >= 1 or None", actual=limit)
    return int(limit)


@contextlib.contextmanager
def blas_threads(limit: int | None = 1) -> Iterator[None]:
    """Host BLAS and LAPACK (NumPy's and SciPy's OpenBLAS, MKL, BLIS) on at most ``limit``
    threads inside the ``with`` block; the previous counts come back at its end.

    Why and when (module docstring, "Host BLAS threads"): one thread is faster for the small
    matrices of a model's weights on a busy machine and costs little on an idle one; a
    decomposition of matrices of several thousand rows on an idle machine with many cores is
    faster on more threads (``limit=None`` or a larger limit). Process-wide while the block
    runs: other threads of the process that call BLAS meanwhile get the limit too. XLA's own
    CPU threads are not BLAS threads and are not affected.

    ``scipy.linalg`` is imported first, so that SciPy's copy of OpenBLAS is loaded and limited
    too (a BLAS library first loaded inside the block would keep its default).

    Args:
      limit: the most threads, an int >= 1; ``None``: change nothing.

    Raises:
      ConfigError: ``limit`` not an int >= 1 or None (before anything changes).
    """
    limit = check_blas_threads(limit)
    if limit is None:
        yield
        return
    with contextlib.suppress(ImportError):
        import scipy.linalg  # noqa: F401 (loads SciPy's BLAS, so that the limit reaches it)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=limit, user_api="blas"):
        yield


def one_blas_thread() -> contextlib.AbstractContextManager[None]:
    """``blas_threads(1)``: host BLAS and LAPACK on one thread inside the ``with`` block."""
    return blas_threads(1)


__all__ = ["ENV", "apply_env", "blas_threads", "check_blas_threads", "freed_memory_kept", "keep_freed_memory",
           "malloc_library", "one_blas_thread", "preloaded_malloc"]
