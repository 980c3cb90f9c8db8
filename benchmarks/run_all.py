"""Run the performance benchmarks and write one table of issue 15's goals: each row names its
goal, the target, what was measured and whether it holds.

Every script runs in its own process (``python benchmarks/<script>.py [--quick] --json ...``:
some pin their threads before importing jax), one after the other, and writes its own JSON;
this script reads them back. The table is printed as markdown and saved next to ``--json``
(same name, ``.md``); each script's JSON and log go to ``--logs`` (default: the JSON's name
with ``_logs``).

Scripts and the goals they answer (issue 15, "Goals"):

======================  =======================================================================
``linear.py``           1: a ``LowRank`` leaf's time ratio <= 1.15 x its FLOP ratio (0.1-0.5)
``libraries.py``        1 (reported): the same ``LowRank`` products in PyTorch and NumPy: each
                        library's time / FLOP, and JAX's time over the fastest other's
``head_lowrank.py``     1: a ``HeadLowRank`` leaf with irregular ranks: time / FLOP, and its
                        execution on the true ranks against the padded one
``rank_multiple.py``    1 (reported): ``LowRank`` leaves with their rank rounded up to a
                        multiple of 8 or 16 (``compress(..., rank_multiple=k)``): speed-up
``allocator.py``        1, 2 (reported): glibc ``malloc`` with and without
                        ``lowrank_jax.runtime.keep_freed_memory`` (page faults of large XLA
                        buffers), in child processes
``query_key.py``        1: the query-key objects of irregular attention (TruncAtt, CP-SlimAtt,
                        BTD) against the dense one: time ratio <= 1.15 x FLOP ratio
``attention.py``        2 (reported): attention on CPU in batch chunks against the whole batch
``mlp.py``              2 (reported): MLPs on CPU in token chunks against all tokens at once
``pruning.py``          1: a physically pruned Chronos-Bolt's time ratio <= 1.2 x its FLOP ratio
``models.py``           1: an SVD-compressed Chronos-Bolt's time ratio <= 1.2 x its FLOP ratio
``binary.py``           1: binary leaves' time / FLOP; 5: packed binary >= frozen binary speed,
                        leaf bytes
``peak.py``             2: dense Chronos-Bolt forward >= 90% of the GEMM rate and >= 1.3x PyTorch
                        eager, torch.compile; 3: compressed >= 2x dense PyTorch eager; 6: bf16
                        error; 7: XLA memory next to parameter bytes
``recipe_quality.py``   3: goal 3's recipe (SVD attention + MLPs cut to 30 %) on the demo's
                        pretrained model, WQL after a short fine-tune within 1 % of dense
``decode.py``           4: decoding tokens/s with the key-value cache against PyTorch
                        ``generate`` and against decoding without the cache (its JSON's
                        ``goals`` entries become rows)
======================  =======================================================================

``--all`` also runs the other benchmark scripts' quick modes (sweep, CP-ALS, irregular
attention, partition, SBT, Flax ViT, train step, prune-then-finetune, pretraining seeds) as
smoke runs: their rows say whether they ran and how long they took, their figures are in their
own JSON. ``--quick`` passes ``--quick`` to every script (about 6 minutes on 2 shared cores
without ``--all``).

Timings on a shared machine are noisy: each script measures ratios within one interleaved
loop and prints the share of the CPUs other processes used meanwhile (in its JSON and log).

Usage::

    python benchmarks/run_all.py --json all.json --quick
    python benchmarks/run_all.py --json all.json                 # full runs (an hour or more)
    python benchmarks/run_all.py --json all.json --quick --only binary peak
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
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclasses.dataclass
class Row:
    """One line of the table."""

    goal: str  # issue 15's goal number ("1" .. "7"), or "-" for smoke runs
    what: str
    target: str
    measured: str
    holds: bool | None  # None: reported, no threshold (or not run)
    source: str
    value: Any = None


def _fmt_load(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


# -- rows from each script's JSON ------------------------------------------------------------

def rows_linear(d: dict) -> list[Row]:
    rows = d["rows"]
    # Judged per product inside a program of several products (a leaf in a model), when the
    # script measured it; the single-call figure (which also pays JAX's dispatch) is shown too.
    key = ("program_time_per_flop_ratio" if all("program_time_per_flop_ratio" in r for r in rows)
           else "time_per_flop_ratio")
    out = []
    for q in sorted({r["target_ratio"] for r in rows}):
        sel = [r for r in rows if r["target_ratio"] == q]
        worst = max(sel, key=lambda r: r[key])
        ok = sum(r[key] <= 1.15 for r in sel)
        single = max(r["time_per_flop_ratio"] for r in sel)
        where = "in a program" if key != "time_per_flop_ratio" else "single calls"
        extra = (f"; single calls: worst {single:.2f}, "
                 f"{sum(r['time_per_flop_ratio'] <= 1.15 for r in sel)}/{len(sel)}"
                 if key != "time_per_flop_ratio" else "")
        out.append(Row("1", f"LowRank leaf time/FLOP, FLOP ratio ~{q:g}", "<= 1.15",
                       f"{where}: worst {worst[key]:.2f} (d {worst['d']}, {worst['tokens']} "
                       f"tokens); {ok}/{len(sel)} sizes meet it{extra}",
                       ok == len(sel), "linear.py", worst[key]))
    return out


def rows_libraries(d: dict) -> list[Row]:
    """Goal 1's LowRank products in PyTorch and NumPy: is the miss the shapes or XLA?"""
    rows, summ = d["rows"], d["summary"]
    low = min(summ, key=lambda s: s["target_ratio"])
    libs = ", ".join(f"{lib} {low[lib][0]:.2f}-{low[lib][1]:.2f}" for lib in ("torch", "numpy",
                                                                               "jax"))
    ratio = sorted(r["jax_over_best_lowrank"] for r in rows)
    med = ratio[len(ratio) // 2]
    out = [
        Row("1", f"LowRank products at FLOP ratio ~{low['target_ratio']:g} in other libraries: "
            "time/FLOP against each library's dense product", "reported",
            f"{libs} over {low['rows']} sizes (none meets 1.15 in any library)"
            if all(low[lib][0] > 1.15 for lib in ("torch", "numpy")) else
            f"{libs} over {low['rows']} sizes", None, "libraries.py", low["torch"][0]),
        Row("1", "LowRank leaf: JAX time / fastest of PyTorch and NumPy, same products",
            "reported", f"median {med:.2f} ({ratio[0]:.2f}-{ratio[-1]:.2f}) over {len(ratio)} "
            "rows", None, "libraries.py", med),
    ]
    head = d.get("head_rows") or []
    if head:
        rng = {lib: (min(r[f"{lib}_time_per_flop_ratio"] for r in head),
                     max(r[f"{lib}_time_per_flop_ratio"] for r in head))
               for lib in ("torch", "numpy", "jax")}
        out.append(Row("1", "HeadLowRank, irregular ranks, in other libraries: time/FLOP against "
                       "each library's dense product", "reported",
                       ", ".join(f"{lib} {lo:.2f}-{hi:.2f}" for lib, (lo, hi) in rng.items())
                       + f" over {len(head)} rows", None, "libraries.py", rng["torch"][0]))
    return out


def rows_pruning(d: dict) -> list[Row]:
    rows = d["rows"]
    worst = max(rows, key=lambda r: r["time_over_flop"])
    ok = sum(r["time_over_flop"] <= 1.2 for r in rows)
    detail = ", ".join(f"{r['target']:g}: {r['time_over_flop']:.2f}" for r in rows)
    return [Row("1", "physically pruned Chronos-Bolt time/FLOP", "<= 1.2",
                f"worst {worst['time_over_flop']:.2f} (pruned {detail}); {ok}/{len(rows)} meet "
                f"it; load {_fmt_load(d['setup'].get('other_load'))}", ok == len(rows),
                "pruning.py", worst["time_over_flop"])]


def rows_models(d: dict) -> list[Row]:
    comp = [r for r in d["rows"][2:] if r.get("factorized")]
    if not comp:
        return [Row("1", "SVD-compressed Chronos-Bolt time/FLOP", "<= 1.2",
                    "no matrix factorized at these eps", None, "models.py")]
    worst = max(comp, key=lambda r: r["time_per_flop"])
    detail = ", ".join(f"{r['model']}: {r['time_per_flop']:.2f}" for r in comp)
    return [Row("1", "SVD-compressed Chronos-Bolt time/FLOP (attention)", "<= 1.2",
                f"worst {worst['time_per_flop']:.2f} ({detail}); load "
                f"{_fmt_load(d['setup'].get('other_load'))}", worst["time_per_flop"] <= 1.2,
                "models.py", worst["time_per_flop"])]


def rows_binary(d: dict) -> list[Row]:
    g = d["goals"]
    rows = d["rows"]
    load = _fmt_load(max((r["other_load"] or 0) for r in rows))
    sizes = ", ".join(f"d {r['d']}/{r['tokens']}: {r['packed_over_frozen']:.2f}" for r in rows)
    b = g["leaf_bytes"]["value"]
    return [
        Row("1", "binary leaf (frozen) time/FLOP, FLOPs = non-zeros", g["binary_time_per_flop"]
            ["goal"], f"worst {g['binary_time_per_flop']['value']:.2f} (the product runs "
            f"densely: ~1/keep)", g["binary_time_per_flop"]["holds"], "binary.py",
            g["binary_time_per_flop"]["value"]),
        Row("5", "PackedBinary linear time / FrozenBinary", g["packed_vs_frozen"]["goal"],
            f"median {g['packed_vs_frozen']['value']:.3f}, worst "
            f"{g['packed_vs_frozen']['worst']:.3f} ({sizes}); in CPU time median "
            f"{g['packed_vs_frozen'].get('cpu_time_median', float('nan')):.3f}; load up to {load}",
            g["packed_vs_frozen"]["holds"], "binary.py", g["packed_vs_frozen"]["value"]),
        Row("5", f"binary leaf memory, d = {g['leaf_bytes']['d']} (bytes of the arrays)",
            "reported", f"dense {b['dense'] / 1e6:.2f} MB, masked {b['masked'] / 1e6:.2f}, "
            f"frozen {b['frozen'] / 1e6:.2f}, packed {b['packed'] / 1e6:.3f} "
            f"({b['dense'] / b['packed']:.1f}x smaller than dense)", None, "binary.py", b),
    ]


def rows_peak(d: dict) -> list[Row]:
    g = d["goals"]
    by = {r["model"]: r for r in d["rows"]}
    s = d["setup"]
    cfg = f"d_model {s['config']['d_model']}, batch {s['config']['batch']}"
    dense = by["jax dense"]
    proj = by.get("jax dense projected", dense)  # absent from JSON files before fold_keys
    out = [
        Row("2", f"dense Chronos-Bolt forward, keys and values projected (the standard "
            f"algorithm) / GEMM rate ({cfg})", g["dense_fraction_of_gemm"]["goal"],
            f"{proj['fraction_of_gemm']:.2f} ({proj['gflops']:.0f} of "
            f"{s['gemm_gflops']:.0f} GFLOP/s, GEMM n={s['gemm_n']}); load "
            f"{_fmt_load(s.get('other_load'))}", g["dense_fraction_of_gemm"]["holds"], "peak.py",
            proj["fraction_of_gemm"]),
    ]
    if "dense_default_fraction_of_gemm" in g:
        eff = g["dense_default_effective_fraction_of_gemm"]["value"]
        out.append(Row(
            "2", "dense forward as run by default (decoder's cross-attention keys folded into "
            "its query): executed FLOPs / GEMM rate; effective (the projected program's FLOPs "
            "/ this time)", "reported", f"{dense['fraction_of_gemm']:.2f} ({dense['gflop']:.1f} "
            f"GFLOP executed, {dense['median_ms']:.0f} ms vs {proj['median_ms']:.0f} ms "
            f"projected); effective {eff:.2f}", None, "peak.py", dense["fraction_of_gemm"]))
    out += [
        Row("2", "JAX dense forward (default) vs PyTorch eager, same threads",
            g["jax_dense_vs_torch_eager"]["goal"],
            f"{dense['speedup_vs_eager']:.2f}x ({by['torch eager']['median_ms']:.0f} ms vs "
            f"{dense['median_ms']:.0f} ms)", g["jax_dense_vs_torch_eager"]["holds"], "peak.py",
            dense["speedup_vs_eager"]),
    ]
    if "torch.compile" in by:
        tc = by["torch.compile"]
        out.append(Row("2", "JAX dense forward vs torch.compile", "reported",
                       f"{tc['median_ms'] / dense['median_ms']:.2f}x ({tc['median_ms']:.0f} ms "
                       f"vs {dense['median_ms']:.0f} ms)", None, "peak.py",
                       tc["median_ms"] / dense["median_ms"]))
    else:
        out.append(Row("2", "JAX dense forward vs torch.compile", "reported",
                       f"not run: {s.get('torch_compile')}", None, "peak.py"))
    sp = by["jax svd+pruned"]
    keep = s.get("mlp_keep")
    mlp = "MLP halved" if keep == 0.5 else f"MLP hidden units kept {keep:g}"
    out.append(Row("3", f"compressed (SVD attention eps {s.get('eps', 0.1):g} + {mlp}) vs dense "
                   "PyTorch eager",
                   g["compressed_vs_torch_eager"]["goal"],
                   f"{sp['speedup_vs_eager']:.2f}x ({sp['gflop']:.1f} of {proj['gflop']:.1f} "
                   f"GFLOP)", g["compressed_vs_torch_eager"]["holds"], "peak.py",
                   sp["speedup_vs_eager"]))
    b16 = [r for r in d["rows"] if "bf16" in r["model"]]
    out.append(Row("6", "bf16 forward (f32 accumulation): max error / largest forecast",
                   g["bf16_rel_err"]["goal"],
                   ", ".join(f"{r['model'][9:]}: {r['rel_err']:.1e} ({r['median_ms']:.0f} ms)"
                             for r in b16) + f"; float32 dense {dense['median_ms']:.0f} ms",
                   g["bf16_rel_err"]["holds"], "peak.py", g["bf16_rel_err"]["value"]))
    mem = "; ".join(f"{r['model'][4:]}: {r['param_mb']:.0f} / {r['xla_mb']:.0f}"
                    for r in d["rows"] if r.get("xla_mb"))
    out.append(Row("7", "memory: parameter MB / XLA arguments+outputs+temporaries MB", "reported",
                   mem, None, "peak.py"))
    return out


def rows_head_lowrank(d: dict) -> list[Row]:
    rows = d["rows"]
    exact = [r for r in rows if r["exact_path"]]
    worst = max(rows, key=lambda r: r["time_over_flop"])
    speed = sorted(r["speedup_vs_padded"] for r in exact)
    return [
        Row("1", "HeadLowRank, irregular ranks: time/FLOP (d 768, 12 heads)", "<= 1.15",
            f"worst {worst['time_over_flop']:.2f} ({worst['ranks']}, {worst['tokens']} tokens); "
            f"{sum(r['time_over_flop'] <= 1.15 for r in rows)}/{len(rows)} rows meet it",
            all(r["time_over_flop"] <= 1.15 for r in rows), "head_lowrank.py",
            worst["time_over_flop"]),
        Row("1", "HeadLowRank, irregular ranks: on the true ranks vs padded (speed-up)",
            "reported", f"{speed[0]:.2f}-{speed[-1]:.2f}x over {len(speed)} rows", None,
            "head_lowrank.py", speed[len(speed) // 2] if speed else None),
    ]


def rows_query_key(d: dict) -> list[Row]:
    g = d["goals"]["qk_time_per_flop"]
    rows = d["rows"]
    key = ("attention_time_per_flop_ratio" if all("attention_time_per_flop_ratio" in r
                                                  for r in rows) else "time_per_flop_ratio")
    worst = max(rows, key=lambda r: r[key])
    by_kind = ", ".join(f"{k}: {v:.2f}" for k, v in g["detail"].items())
    where = "as attention runs the logits" if key != "time_per_flop_ratio" else "whole logits"
    extra = ""
    if "whole_logits" in g:
        extra = (f"; whole-batch logits: worst {g['whole_logits']['value']:.2f}, "
                 f"{g['whole_logits']['rows_meeting']}/{g['rows']}")
    return [Row("1", "irregular-attention query-keys (TruncAtt, CP, BTD) time/FLOP, FLOP ratio "
                "0.1-0.5", g["goal"],
                f"{where}: worst {g['value']:.2f} ({worst['kind']}, d {worst['d']}, "
                f"{worst['tokens']} tokens, flop ratio {worst['flop_ratio']:.2f}; worst per kind "
                f"{by_kind}); {g['rows_meeting']}/{g['rows']} rows meet it{extra}", g["holds"],
                "query_key.py", g["value"])]


def rows_goals(d: dict, source: str, goal: str) -> list[Row]:
    """Generic: a JSON with ``goals: {name: {value, goal, holds}}``."""
    g = d.get("goals") if isinstance(d, dict) else None
    if not isinstance(g, dict) or not g:
        return [Row(goal, "ran; no 'goals' entry in its JSON (see its output)", "-", "-", None,
                    source)]
    out = []
    for name, e in g.items():
        if isinstance(e, dict):
            v = e.get("value")
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            out.append(Row(goal, name, str(e.get("goal", "-")), f"{v:.4g}" if num else str(v),
                           e.get("holds"), source, v))
        else:
            out.append(Row(goal, name, "-", str(e), None, source, e))
    return out


@dataclasses.dataclass
class Script:
    name: str
    rows: Callable[[dict], list[Row]] | None  # None: a smoke run
    goal: str = "-"
    optional: bool = False


GOAL_SCRIPTS = [
    Script("linear", rows_linear, "1"),
    Script("libraries", rows_libraries, "1", optional=True),
    Script("head_lowrank", rows_head_lowrank, "1", optional=True),
    Script("query_key", rows_query_key, "1", optional=True),
    Script("rank_multiple", lambda d: rows_goals(d, "rank_multiple.py", "1"), "1",
           optional=True),
    Script("attention", lambda d: rows_goals(d, "attention.py", "2"), "2", optional=True),
    Script("mlp", lambda d: rows_goals(d, "mlp.py", "2"), "2", optional=True),
    Script("pruning", rows_pruning, "1"),
    Script("models", rows_models, "1"),
    Script("binary", rows_binary, "5"),
    Script("peak", rows_peak, "2"),
    Script("decode", lambda d: rows_goals(d, "decode.py", "4"), "4", optional=True),
    Script("recipe_quality", lambda d: rows_goals(d, "recipe_quality.py", "3"), "3",
           optional=True),
    # last: its child processes (five malloc settings, one faulting on every call) were
    # followed by 1.2-1.7x slower quick figures in the scripts after them in one run
    Script("allocator", lambda d: rows_goals(d, "allocator.py", "2"), "2", optional=True),
]
SMOKE_SCRIPTS = [Script(n, None) for n in (
    "sweep", "cp_als", "irregular_attention", "partition", "sbt", "flax_vit_digits", "train",
    "prune_then_finetune", "pretrain_seeds")]


def run_script(s: Script, *, quick: bool, logs: str, timeout: int, env=None) -> dict:
    path = os.path.join(HERE, f"{s.name}.py")
    out_json = os.path.join(logs, f"{s.name}.json")
    log = os.path.join(logs, f"{s.name}.log")
    rec = {"script": f"{s.name}.py", "json": out_json, "log": log}
    if not os.path.exists(path):
        rec.update(status="not run", note=f"benchmarks/{s.name}.py not present")
        return rec
    cmd = [sys.executable, path, "--json", out_json] + (["--quick"] if quick else [])
    rec["cmd"] = " ".join(["python", f"benchmarks/{s.name}.py", "--json", out_json]
                          + (["--quick"] if quick else []))
    if os.path.exists(out_json):
        os.remove(out_json)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout, env=env).returncode
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

    lines = ["| goal | what | target | measured | holds | source |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.goal} | {cell(r.what)} | {cell(r.target)} | {cell(r.measured)} | "
                     f"{holds(r.holds)} | `{r.source}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", required=True, help="the table as JSON")
    p.add_argument("--md", metavar="PATH", help="the markdown table (default: PATH.md)")
    p.add_argument("--logs", metavar="DIR", help="each script's JSON and log "
                   "(default: the --json name with _logs)")
    p.add_argument("--quick", action="store_true", help="every script's --quick mode")
    p.add_argument("--all", action="store_true",
                   help="also the other benchmark scripts, as smoke runs")
    p.add_argument("--only", nargs="+", metavar="SCRIPT", help="run only these scripts")
    p.add_argument("--timeout", type=int, default=None,
                   help="seconds per script (default 900 quick, 7200 full)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="run every script with LOWRANK_JAX_KEEP_FREED_MEMORY=1 (glibc malloc "
                   "keeps freed memory: lowrank_jax.runtime); default: the environment's")
    args = p.parse_args(argv)
    env = None
    if args.keep_freed_memory:
        env = {**os.environ, "LOWRANK_JAX_KEEP_FREED_MEMORY": "1"}

    stem = os.path.splitext(args.json)[0]
    md_path = args.md or stem + ".md"
    logs = args.logs or stem + "_logs"
    os.makedirs(logs, exist_ok=True)
    timeout = args.timeout or (900 if args.quick else 7200)
    scripts = GOAL_SCRIPTS + (SMOKE_SCRIPTS if args.all else [])
    if args.only:
        known = {s.name for s in GOAL_SCRIPTS + SMOKE_SCRIPTS}
        bad = [n for n in args.only if n not in known]
        if bad:
            p.error(f"--only: unknown scripts {bad}; known: {sorted(known)}")
        scripts = [s for s in GOAL_SCRIPTS + SMOKE_SCRIPTS if s.name in args.only]

    t_start = time.perf_counter()
    runs, rows = [], []
    for s in scripts:
        print(f"# running {s.name}.py{' --quick' if args.quick else ''} ...", flush=True)
        rec = run_script(s, quick=args.quick, logs=logs, timeout=timeout, env=env)
        runs.append(rec)
        secs = f" in {rec['seconds']:.0f} s" if "seconds" in rec else ""
        print(f"#   {rec['status']}{secs}{': ' + rec['note'] if rec.get('note') else ''}",
              flush=True)
        if s.rows is None:
            rows.append(Row("-", f"{s.name}.py (smoke run)", "runs",
                            f"{rec['status']}{secs}", rec["status"] == "ok", f"{s.name}.py"))
            continue
        if rec["status"] != "ok":
            rows.append(Row(s.goal, f"{s.name}.py", "-", f"{rec['status']}: "
                            f"{rec.get('note', '')}", None if rec["status"] == "not run"
                            else False, f"{s.name}.py"))
            continue
        with open(rec["json"]) as f:
            data = json.load(f)
        try:
            rows.extend(s.rows(data))
        except (KeyError, TypeError, ValueError) as e:  # a script's JSON changed shape
            rows.append(Row(s.goal, f"{s.name}.py", "-", f"could not read its JSON: "
                            f"{type(e).__name__}: {e}", False, f"{s.name}.py"))
    rows.sort(key=lambda r: (r.goal == "-", r.goal))
    total = time.perf_counter() - t_start

    cmd = "python benchmarks/run_all.py --json " + args.json + (" --quick" if args.quick else "") \
        + (" --all" if args.all else "") + (" --only " + " ".join(args.only) if args.only else "") \
        + (" --keep-freed-memory" if args.keep_freed_memory else "")
    preload = (env or os.environ).get("LD_PRELOAD")  # e.g. tcmalloc, inherited by each script
    head = (f"Command: `{cmd}` ({total / 60:.1f} min; {os.cpu_count()} CPUs, "
            f"{platform.processor() or platform.machine()}"
            f"{'; LD_PRELOAD=' + preload if preload else ''}). Per-script JSON and logs: "
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
