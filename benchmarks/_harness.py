"""What every benchmark shares: the command line, the setup record, timing with checked
outputs, the printed table, goals named by what they measure, and one JSON schema.

A benchmark is a module ``benchmarks/<topic>/<name>.py`` with a ``main(argv)``, run as
``python -m benchmarks.<topic> <name> [options]`` from the repository root (so the checkout's
``lowrank_jax`` is the one imported; :func:`topic_main` dispatches). Nothing here imports JAX
when this module is imported: some benchmarks pin their threads or set ``XLA_FLAGS`` first.

The JSON a benchmark writes (``--json PATH``) always has::

    {"setup": {"date", "command", "machine", "cpu_count", "python", "jax", "backend",
               "devices", "malloc", "keep_freed_memory", "xla_flags", "seconds",
               "other_load", ...the benchmark's own settings},
     "rows": [...],                      # one dict per printed line
     "goals": {what: {"value", "target", "holds", "measured", ...}},
     ...}                                # anything else the benchmark records

A goal is named by what it measures ("LowRank leaf time/FLOP at FLOP ratio ~0.1"); ``target``
is the threshold it is judged against (``"<= 1.15"``) or ``"reported"`` (``holds`` is then
``None``); ``measured`` is the sentence ``run_all`` prints for it. Timing goes through
:func:`lowrank_jax.timing.time_interleaved` (interleaved rounds, order reversed every other
round, wall and CPU seconds, the machine's load meanwhile).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: The topics, in the order ``run_all`` and the benchmarks page list them.
TOPICS = ("layers", "models", "methods", "machine")


# -- command line ----------------------------------------------------------------------------

def parser(doc: str, *, quick: str = "a smoke test: fewer sizes and runs",
           json_required: bool = False) -> argparse.ArgumentParser:
    """An argument parser whose description is ``doc``'s first paragraph, with ``--json PATH``
    and ``--quick`` (its help: ``quick``)."""
    p = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", required=json_required,
                   help="write the setup, rows and goals as JSON")
    p.add_argument("--quick", action="store_true", help=quick)
    return p


def benchmark_names(topic: str) -> list[str]:
    """The benchmark modules of ``topic`` (files of ``benchmarks/<topic>/`` not starting with
    an underscore), sorted."""
    folder = os.path.join(HERE, topic)
    return sorted(f[:-3] for f in os.listdir(folder)
                  if f.endswith(".py") and not f.startswith("_"))


def summary_line(topic: str, name: str) -> str:
    """The first sentence of a benchmark module's docstring, read without importing it."""
    with open(os.path.join(HERE, topic, f"{name}.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def topic_main(topic: str, argv: list[str] | None = None) -> int:
    """``python -m benchmarks.<topic> NAME [options]``: run benchmark ``NAME`` of ``topic``
    (its ``main`` gets the options); without a name or with ``--help``, list the topic's
    benchmarks."""
    argv = sys.argv[1:] if argv is None else argv
    names = benchmark_names(topic)
    doc = importlib.import_module(f"benchmarks.{topic}").__doc__ or ""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m benchmarks.{topic} NAME [options]   (NAME --help: its options)"
              f"\n\n{doc.strip()}\n\nbenchmarks:")
        for n in names:
            print(f"  {n:<22} {summary_line(topic, n)}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"python -m benchmarks.{topic}: unknown benchmark {name!r}; expected one of "
              f"{names}", file=sys.stderr)
        return 2
    # The benchmarks run as the lowrank-jax command does: glibc malloc keeps freed memory for
    # reuse (lowrank_jax.runtime.keep_freed_memory, applied when lowrank_jax is imported), so
    # large XLA buffers are not page-faulted in again on every call.
    # LOWRANK_JAX_KEEP_FREED_MEMORY=0 measures glibc's default; machine/allocator.py compares.
    os.environ.setdefault("LOWRANK_JAX_KEEP_FREED_MEMORY", "1")
    module = importlib.import_module(f"benchmarks.{topic}.{name}")
    out = module.main(rest)
    return out if isinstance(out, int) else 0


def run_as_main(spec) -> None:
    """``python -m benchmarks.<topic>.<name> [options]``: the same as ``python -m
    benchmarks.<topic> <name> [options]`` (call with the module's ``__spec__``)."""
    _, topic, name = spec.name.split(".")
    raise SystemExit(topic_main(topic, [name, *sys.argv[1:]]))


def command(module: str, argv: list[str] | None) -> str:
    """The command that runs benchmark ``module`` with ``argv``: ``python -m benchmarks.<topic>
    <name> ...`` for a topic's ``benchmarks.<topic>.<name>``, ``python -m benchmarks.<name>
    ...`` for a module of its own (``benchmarks.<name>``, such as an accelerator's)."""
    parts = module.split(".")
    args = sys.argv[1:] if argv is None else argv
    head = ["python -m", ".".join(parts[:2])] + parts[2:]
    return " ".join(head + list(args))


# -- setup -----------------------------------------------------------------------------------

def malloc_setting() -> str:
    """How ``malloc`` runs in this process: a preloaded allocator's file name, or glibc's with
    what :mod:`lowrank_jax.runtime` set."""
    from lowrank_jax import runtime

    lib = runtime.preloaded_malloc()
    if lib is not None:
        return f"{os.path.basename(lib)} (preloaded)"
    kept = runtime.freed_memory_kept()
    return {True: "glibc, freed memory kept", "one_arena": "glibc, freed memory kept, one arena",
            False: "glibc defaults", None: "glibc defaults"}[kept]


class Run:
    """One run of a benchmark: its setup record (made when the run starts, so after any thread
    pinning) and, at :meth:`finish`, its result.

    Args:
      module: the benchmark module's ``__name__``.
      argv: the options ``main`` was given (``None``: ``sys.argv[1:]``).
      **settings: the benchmark's own settings, recorded in the setup.
    """

    def __init__(self, module: str, argv: list[str] | None = None, **settings):
        import jax

        from lowrank_jax import runtime, timing

        self.t0 = time.perf_counter()
        self.snapshot = timing.cpu_snapshot()
        self.setup = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command(module, argv),
            "machine": platform.processor() or platform.machine(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": jax.device_count(),
            "malloc": malloc_setting(), "keep_freed_memory": runtime.freed_memory_kept(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            **settings,
        }

    def describe(self) -> str:
        """One line for the top of the printed table: versions, CPUs, malloc."""
        s = self.setup
        return (f"jax {s['jax']} on {s['backend']} ({s['cpu_count']} CPUs, {s['devices']} "
                f"devices), {s['machine']}; malloc: {s['malloc']}")

    def finish(self, json_path: str | None, /, *, rows: list, goals: Mapping | None = None,
               **extra) -> dict:
        """The result ``{"setup", "rows", "goals", **extra}``: the run's seconds and the share of
        the machine's CPU other processes used since it started go into the setup; the goals
        are printed; with ``json_path`` the result is written there as JSON."""
        from lowrank_jax import timing

        self.setup["seconds"] = time.perf_counter() - self.t0
        self.setup["other_load"] = timing.other_load(self.snapshot, timing.cpu_snapshot())
        goals = dict(goals or {})
        for what, g in goals.items():
            state = ("reported" if g["holds"] is None
                     else f"target {g['target']}: {verdict(g['holds'])}")
            print(f"# {what}: {g.get('measured') or fmt_value(g['value'])} ({state})")
        print(f"# {self.setup['seconds']:.0f} s; other processes used "
              f"{percent(self.setup['other_load'])} of the machine's CPU meanwhile", flush=True)
        result = {"setup": self.setup, "rows": rows, "goals": goals, **extra}
        if json_path:
            write_json(json_path, result)
        return result


# -- goals -----------------------------------------------------------------------------------

def goal(what: str, value, *, target: str = "reported", holds: bool | None = None,
         measured: str | None = None, **detail) -> dict:
    """``{what: entry}``: a goal named by what it measures, its value, the target it is judged
    against (``"reported"``: none, ``holds`` is ``None``), the sentence that says what was
    measured, and any detail."""
    return {what: {"value": value, "target": target, "holds": holds,
                   "measured": measured, **detail}}


def verdict(holds: bool | None) -> str:
    return "reported" if holds is None else ("met" if holds else "NOT met")


# -- timing with checked outputs -------------------------------------------------------------

@dataclasses.dataclass
class Measured:
    """Timings of several calls in one loop, with each call's output checked against its
    reference's.

    Attributes:
      timings: :class:`lowrank_jax.timing.Timings` of the calls.
      max_abs_error: ``{name: max |output - reference's output|}`` for the checked calls.
      rel_error: the same over the largest absolute value of the reference's array (the
        largest such ratio over the output's arrays).
      flops: ``{name: multiply-adds of one call}`` where given.
    """

    timings: Any
    max_abs_error: dict[str, float]
    rel_error: dict[str, float]
    flops: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def load(self) -> float | None:
        """The share of the machine's CPU other processes used while the loop ran."""
        return self.timings.other_load

    def ms(self, name: str) -> float:
        """Median milliseconds of call ``name``."""
        return 1e3 * self.timings.median(name)

    def ratio(self, num: str, den: str) -> float:
        """Median time of ``num`` over median time of ``den``."""
        return self.timings.ratio(num, den).value

    def flop_ratio(self, num: str, den: str) -> float:
        """FLOPs of ``num`` over FLOPs of ``den``."""
        return self.flops[num] / self.flops[den]

    def time_per_flop(self, num: str, den: str) -> float:
        """Time ratio over FLOP ratio of ``num`` against ``den``: 1.0 when ``num`` runs at
        ``den``'s rate per multiply-add."""
        return self.ratio(num, den) / self.flop_ratio(num, den)


def _max_abs(a, b) -> tuple[float, float]:
    """(max |a - b|, and per array max |a - b| / max |b|, the largest) over the arrays of two
    pytrees of the same structure."""
    import jax
    import numpy as np

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        raise ValueError(f"outputs of different structure: {len(la)} and {len(lb)} arrays")
    diff = rel = 0.0
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.size:
            d = float(np.max(np.abs(x - y)))
            diff, rel = max(diff, d), max(rel, d / max(float(np.max(np.abs(y))), 1e-30))
    return diff, rel


def measure(calls: Mapping[str, Callable[[], Any]], *, runs: int, warmup: int = 1,
            check: Mapping[str, str] | None = None,
            flops: Mapping[str, float] | None = None) -> Measured:
    """Time zero-argument ``calls`` (each returning its output) against each other: one row's
    contenders, the outputs each is checked against, and their FLOP counts.

    Every output is waited for (``jax.block_until_ready``) inside the timed call. With
    ``check`` (``{name: reference name}``), each call's output is first computed once and
    compared with its reference's (max absolute and relative difference); those calls come
    before the warm-up. ``flops`` (``{name: multiply-adds}``) gives
    :meth:`Measured.time_per_flop`.
    """
    import jax

    from lowrank_jax import timing

    abs_err, rel_err = {}, {}
    if check:
        outs = {n: jax.block_until_ready(calls[n]()) for n in {*check, *check.values()}}
        for n, ref in check.items():
            abs_err[n], rel_err[n] = _max_abs(outs[n], outs[ref])
        del outs
    timed = {n: (lambda c=c: jax.block_until_ready(c())) for n, c in calls.items()}
    t = timing.time_interleaved(timed, runs=runs, warmup=warmup)
    return Measured(t, abs_err, rel_err, dict(flops or {}))


def time_calls(calls: Mapping[str, Callable[[], Any]], *, runs: int, warmup: int = 1):
    """:func:`lowrank_jax.timing.time_interleaved` of calls that wait for their own results
    (host work, or JAX calls that end in ``block_until_ready``)."""
    from lowrank_jax import timing

    return timing.time_interleaved(calls, runs=runs, warmup=warmup)


# -- printing --------------------------------------------------------------------------------

def percent(x: float | None) -> str:
    """A share as a whole percentage, ``n/a`` for None."""
    return "n/a" if x is None else f"{100 * x:.0f}%"


def fmt_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


@dataclasses.dataclass(frozen=True)
class Col:
    """A column of a printed table: its header, the row key or a function of the row, and the
    format of the value (``None`` prints as ``-``; ``"%"`` a share as a percentage, ``n/a`` for
    ``None``)."""

    header: str
    value: str | Callable[[dict], Any]
    fmt: str = ""
    width: int = 0

    def get(self, row: dict):
        return self.value(row) if callable(self.value) else row.get(self.value)

    def cell(self, row: dict) -> str:
        v = self.get(row)
        if self.fmt == "%":
            return percent(v)
        if v is None:
            return "-"
        return format(v, self.fmt)


class Table:
    """A table printed line by line as the rows come: strings left-aligned, numbers right."""

    def __init__(self, *columns: Col):
        self.columns = columns

    def _width(self, c: Col) -> int:
        return max(len(c.header), c.width)

    def header(self) -> str:
        first, *rest = self.columns
        return " ".join([f"{first.header:<{self._width(first)}}"]
                        + [f"{c.header:>{self._width(c)}}" for c in rest]).rstrip()

    def line(self, row: dict) -> str:
        cells = []
        for i, c in enumerate(self.columns):
            text = c.cell(row)
            left = i == 0 and isinstance(c.get(row), str)
            cells.append(f"{text:<{self._width(c)}}" if left else f"{text:>{self._width(c)}}")
        return " ".join(cells).rstrip()


# -- JSON ------------------------------------------------------------------------------------

def _plain(obj):
    """JSON for what ``json`` does not know: NumPy/JAX scalars and arrays, dataclasses, anything
    else by ``str``."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return str(obj)


def write_json(path: str, obj, *, indent: int = 1, allow_nan: bool = True) -> None:
    """Write ``obj`` to ``path`` as JSON whole or not at all: written to a temporary file in the
    same folder and renamed over ``path``, so an interrupted or failing run leaves the previous
    file as it was."""
    path = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, allow_nan=allow_nan, default=_plain)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"wrote {path}")


# -- execution settings ----------------------------------------------------------------------

def compile_with(fn, args, **settings):
    """``fn`` compiled for ``args`` under the execution settings ``settings``
    (:func:`lowrank_jax.execution.settings`, for example ``fold_keys=False`` or
    ``attention_chunk_above_bytes=None``): one program per setting, timed in one loop. The
    settings are part of ``jax.jit``'s cache key, so one jitted function serves every
    setting."""
    import jax

    from lowrank_jax import execution

    with execution.settings(**settings):
        return jax.jit(fn).lower(*args).compile()


def chunked_speedup_goal(what: str, rows: list[dict], chunk_key: str) -> dict:
    """The goal of a chunked-against-whole benchmark (reported, no target): the median
    ``speedup`` over the rows whose ``chunk_key`` is not ``None``."""
    import statistics

    sel = [r for r in rows if r[chunk_key] is not None]
    value = statistics.median(r["speedup"] for r in sel) if sel else None
    measured = (f"median {value:.2f} over {len(sel)} chunked rows "
                f"({min(r['speedup'] for r in sel):.2f}-{max(r['speedup'] for r in sel):.2f})"
                if sel else "no row large enough to be chunked")
    return goal(what, value, measured=measured,
                detail={f"{r['what']}, {r['tokens']} tokens": r["speedup"] for r in sel})
