"""Run the performance benchmarks one after the other and print one table of what they
measure: each row names what it measures, its target, what was measured and whether it holds.

Every benchmark runs in its own process (``python -m benchmarks.<topic> <name> [--quick]
--json ...``: some pin their threads before importing jax) and writes its own JSON (the
harness's schema: ``setup``, ``rows``, ``goals``); this script reads their ``goals`` back. The
table is printed as markdown and saved next to ``--json`` (same name, ``.md``); each
benchmark's JSON and log go to ``--logs`` (default: the JSON's name with ``_logs``).

The benchmarks whose goals make the table, in the order they run:

==========================  ===================================================================
``layers linear``           a ``LowRank`` leaf's time ratio <= 1.15 x its FLOP ratio (0.1-0.5)
``layers libraries``        (reported) the same ``LowRank`` products in PyTorch and NumPy: each
                            library's time / FLOP, and JAX's time over the fastest other's
``layers head_lowrank``     a ``HeadLowRank`` leaf with irregular ranks: time / FLOP, and its
                            execution on the true ranks against the padded one
``layers query_key``        the query-key objects of irregular attention (TruncAtt, CP-SlimAtt,
                            BTD) against the dense one: time ratio <= 1.15 x FLOP ratio
``layers rank_multiple``    (reported) ``LowRank`` leaves with their rank rounded up to a
                            multiple of 8 or 16 (``compress(..., rank_multiple=k)``): speed-up
``layers attention``        (reported) attention on CPU in batch chunks against the whole batch
``layers mlp``              (reported) MLPs on CPU in token chunks against all tokens at once
``methods pruning``         a physically pruned Chronos-Bolt's time ratio <= 1.2 x its FLOP ratio
``models forward``          an SVD-compressed Chronos-Bolt's time ratio <= 1.2 x its FLOP ratio
``layers binary``           binary leaves' time / FLOP; packed binary >= frozen binary speed;
                            leaf bytes
``models peak``             dense Chronos-Bolt forward >= 90% of the GEMM rate and >= 1.3x
                            PyTorch eager, torch.compile; compressed >= 2x dense PyTorch eager;
                            bf16 error; XLA memory next to parameter bytes
``methods recipe_quality``  the speed recipe (SVD attention + MLPs cut to 30 %) on the demo's
                            pretrained model: WQL after a short fine-tune within 1 % of dense
``models decode``           decoding tokens/s with the key-value cache against PyTorch
                            ``generate`` and against decoding without the cache
``machine allocator``       (reported) glibc ``malloc`` with and without
                            ``lowrank_jax.runtime.keep_freed_memory``, in child processes
==========================  ===================================================================

``--all`` also runs the other benchmarks' quick modes (sweep, CP-ALS, irregular attention,
partition, SBT, Flax ViT, train step, prune-then-finetune, pretraining seeds) as smoke runs:
their rows say whether they ran and how long they took, their figures are in their own JSON.
``--quick`` passes ``--quick`` to every benchmark (about 6 minutes on 2 idle cores without
``--all``).

Timings on a shared machine are noisy: each benchmark measures ratios within one interleaved
loop and records the share of the CPUs other processes used meanwhile (in its JSON and log).

Usage::

    python -m benchmarks.run_all --json all.json --quick
    python -m benchmarks.run_all --json all.json                 # full runs (an hour or more)
    python -m benchmarks.run_all --json all.json --quick --only binary peak
    python -m benchmarks.run_all --json all.json --quick --only layers   # one topic
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

if not __package__:  # run as a file (python benchmarks/run_all.py): the checkout's root first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _harness as H  # noqa: E402

ROOT = H.ROOT


@dataclasses.dataclass
class Row:
    """One line of the table."""

    topic: str
    what: str
    target: str
    measured: str
    holds: bool | None  # None: reported, no threshold (or not run)
    source: str  # "<topic> <name>": the benchmark that measured it
    value: Any = None


@dataclasses.dataclass(frozen=True)
class Bench:
    """A benchmark run by this script: ``python -m benchmarks.<topic> <name>``."""

    topic: str
    name: str
    smoke: bool = False  # a smoke run: its row says whether it ran, not what it measured

    @property
    def source(self) -> str:
        return f"{self.topic} {self.name}"


GOAL_BENCHES = [
    Bench("layers", "linear"), Bench("layers", "libraries"), Bench("layers", "head_lowrank"),
    Bench("layers", "query_key"), Bench("layers", "rank_multiple"),
    Bench("layers", "attention"), Bench("layers", "mlp"), Bench("methods", "pruning"),
    Bench("models", "forward"), Bench("layers", "binary"), Bench("layers", "quantize"),
    Bench("models", "peak"),
    Bench("models", "decode"), Bench("methods", "recipe_quality"),
    # last: its child processes (five malloc settings, one faulting on every call) were
    # followed by 1.2-1.7x slower quick figures in the benchmarks after them in one run
    Bench("machine", "allocator"),
]
SMOKE_BENCHES = [Bench(t, n, smoke=True) for t, n in (
    ("methods", "sweep"), ("methods", "cp_als"), ("methods", "irregular_attention"),
    ("methods", "partition"), ("models", "sbt"), ("methods", "flax_vit_digits"),
    ("models", "train"), ("methods", "prune_then_finetune"), ("methods", "pretrain_seeds"))]


def rows_of(b: Bench, data: dict) -> list[Row]:
    """The table's rows from a benchmark's JSON: one per entry of its ``goals``."""
    goals = data.get("goals") if isinstance(data, dict) else None
    if not isinstance(goals, dict) or not goals:
        return [Row(b.topic, f"{b.source}: ran; no goals in its JSON (see its output)", "-", "-",
                    None, b.source)]
    out = []
    for what, g in goals.items():
        v = g.get("value")
        measured = g.get("measured") or H.fmt_value(v)
        out.append(Row(b.topic, what, str(g.get("target", "-")), measured, g.get("holds"),
                       b.source, v))
    return out


def run_bench(b: Bench, *, quick: bool, logs: str, timeout: int, env=None) -> dict:
    out_json = os.path.join(logs, f"{b.name}.json")
    log = os.path.join(logs, f"{b.name}.log")
    rec = {"benchmark": b.source, "json": out_json, "log": log}
    if not os.path.exists(os.path.join(H.HERE, b.topic, f"{b.name}.py")):
        rec.update(status="not run", note=f"benchmarks/{b.topic}/{b.name}.py not present")
        return rec
    args = [f"benchmarks.{b.topic}", b.name, "--json", out_json] + (["--quick"] if quick else [])
    rec["cmd"] = " ".join(["python -m", *args])
    if os.path.exists(out_json):
        os.remove(out_json)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = None
    rec["seconds"] = time.perf_counter() - t0
    if rc is None:
        rec.update(status="timed out", note=f"after {timeout} s")
    elif rc != 0:
        with open(log) as f:
            tail = [ln for ln in f.read().splitlines() if ln.strip()][-1:]
        rec.update(status="failed", note=f"exit {rc}: {tail[0][:160] if tail else ''}")
    elif not os.path.exists(out_json):
        rec.update(status="failed", note="no JSON written")
    else:
        rec["status"] = "ok"
    return rec


def table(rows: list[Row]) -> str:
    def holds(h):
        return "reported" if h is None else ("**yes**" if h else "**no**")

    def cell(text) -> str:
        return str(text).replace("|", "/")

    lines = ["| topic | what | target | measured | holds | benchmark |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.topic} | {cell(r.what)} | {cell(r.target)} | {cell(r.measured)} | "
                     f"{holds(r.holds)} | `{r.source}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", required=True, help="the table as JSON")
    p.add_argument("--md", metavar="PATH", help="the markdown table (default: PATH.md)")
    p.add_argument("--logs", metavar="DIR", help="each benchmark's JSON and log "
                   "(default: the --json name with _logs)")
    p.add_argument("--quick", action="store_true", help="every benchmark's --quick mode")
    p.add_argument("--all", action="store_true",
                   help="also the other benchmarks, as smoke runs")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="run only these benchmarks (names, or topics: all of a topic's)")
    p.add_argument("--timeout", type=int, default=None,
                   help="seconds per benchmark (default 900 quick, 7200 full)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="run every benchmark with LOWRANK_JAX_KEEP_FREED_MEMORY=1 (glibc malloc "
                   "keeps freed memory: lowrank_jax.runtime); default: the environment's, and "
                   "the benchmarks set it to 1 when it is unset")
    args = p.parse_args(argv)
    env = None
    if args.keep_freed_memory:
        env = {**os.environ, "LOWRANK_JAX_KEEP_FREED_MEMORY": "1"}

    stem = os.path.splitext(args.json)[0]
    md_path = args.md or stem + ".md"
    logs = args.logs or stem + "_logs"
    os.makedirs(logs, exist_ok=True)
    timeout = args.timeout or (900 if args.quick else 7200)
    benches = GOAL_BENCHES + (SMOKE_BENCHES if args.all else [])
    if args.only:
        known = GOAL_BENCHES + SMOKE_BENCHES
        names = {b.name for b in known} | {b.topic for b in known}
        bad = [n for n in args.only if n not in names]
        if bad:
            p.error(f"--only: unknown benchmarks or topics {bad}; known: {sorted(names)}")
        benches = [b for b in known if b.name in args.only or b.topic in args.only]

    t_start = time.perf_counter()
    runs, rows = [], []
    for b in benches:
        print(f"# running {b.source}{' --quick' if args.quick else ''} ...", flush=True)
        rec = run_bench(b, quick=args.quick, logs=logs, timeout=timeout, env=env)
        runs.append(rec)
        secs = f" in {rec['seconds']:.0f} s" if "seconds" in rec else ""
        print(f"#   {rec['status']}{secs}{': ' + rec['note'] if rec.get('note') else ''}",
              flush=True)
        if b.smoke:
            rows.append(Row(b.topic, f"{b.source} (smoke run)", "runs",
                            f"{rec['status']}{secs}", rec["status"] == "ok", b.source))
            continue
        if rec["status"] != "ok":
            rows.append(Row(b.topic, b.source, "-", f"{rec['status']}: {rec.get('note', '')}",
                            None if rec["status"] == "not run" else False, b.source))
            continue
        with open(rec["json"]) as f:
            data = json.load(f)
        try:
            rows.extend(rows_of(b, data))
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # JSON of another shape
            rows.append(Row(b.topic, b.source, "-", f"could not read its JSON: "
                            f"{type(e).__name__}: {e}", False, b.source))
    order = {t: i for i, t in enumerate(H.TOPICS)}  # other topics (an accelerator's) after them
    rows.sort(key=lambda r: (r.what.endswith("(smoke run)"), order.get(r.topic, len(order))))
    total = time.perf_counter() - t_start

    cmd = "python -m benchmarks.run_all --json " + args.json + (" --quick" if args.quick else "") \
        + (" --all" if args.all else "") + (" --only " + " ".join(args.only) if args.only else "") \
        + (" --keep-freed-memory" if args.keep_freed_memory else "")
    preload = (env or os.environ).get("LD_PRELOAD")  # e.g. tcmalloc, inherited by each script
    head = (f"Command: `{cmd}` ({total / 60:.1f} min; {os.cpu_count()} CPUs, "
            f"{platform.processor() or platform.machine()}"
            f"{'; LD_PRELOAD=' + preload if preload else ''}). Each benchmark's JSON and log: "
            f"`{logs}`.")
    md = head + "\n\n" + table(rows) + "\n"
    print()
    print(md)
    with open(md_path, "w") as f:
        f.write(md)
    met = sum(r.holds is True for r in rows)
    missed = sum(r.holds is False for r in rows)
    print(f"# {met} rows hold, {missed} do not, {len(rows) - met - missed} reported or not run; "
          f"markdown: {md_path}")
    result = {"command": cmd, "seconds": total, "quick": args.quick,
              "keep_freed_memory_env": (env or os.environ).get("LOWRANK_JAX_KEEP_FREED_MEMORY"),
              "ld_preload": preload,
              "runs": runs,
              "rows": [dataclasses.asdict(r) for r in rows]}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
