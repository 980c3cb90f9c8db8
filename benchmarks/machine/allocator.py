"""``malloc`` settings for XLA:CPU: glibc's default, :func:`lowrank_jax.runtime.keep_freed_memory`
(with and without one arena), and tcmalloc or jemalloc preloaded.

XLA:CPU allocates each call's outputs and temporaries with ``malloc``; glibc gives blocks of
32 MB and more back to the system when they are freed, so every call faults their pages in
again. ``keep_freed_memory`` (what ``lowrank-jax`` commands and ``LOWRANK_JAX_KEEP_FREED_MEMORY=1``
set) keeps them for reuse, except blocks larger than a thread arena's 64 MB heap, which glibc
maps afresh anyway unless all threads share one arena (``one_arena=True``). tcmalloc and jemalloc
are the usual replacements (Debian: ``apt install libtcmalloc-minimal4 libjemalloc2``); each
runs where its library is found (``--no-preload``: glibc only), preloaded with ``LD_PRELOAD``
into its child. ``malloc``'s settings are process-wide and glibc's defaults cannot be restored
exactly once changed, so each setting runs in its own child process: the children alternate
(default, kept, one arena, tcmalloc, jemalloc, then the reverse, ...), each times the same
programs (median of ``--runs`` calls interleaved among the programs) and counts their minor
page faults per call and the process's peak resident memory. The table gives, per program and
setting, the median over the rounds of ``default ms / ms``.

Programs: an Adam train step of a small Chronos-Bolt (d_model 64, 2 + 2 layers, batch 16: many
small operations, like the demo's pretraining); ``linear`` of a ``LowRank`` leaf (FLOP ratio
0.1) and of the dense leaf at d 1024 (a 32 MB output) and d 768 (24 MB) with 8192 tokens; a
4-layer ViT-Base-width encoder on 32 images; the full run adds a Chronos-Bolt-base forward
(batch 32, context 512) and the gradient of its loss (batch 8).

Usage::

    python -m benchmarks.machine allocator --json allocator.json   # about 13 min, 2 rounds
    python -m benchmarks.machine allocator --quick                 # no Chronos-Bolt-base, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import _harness as H


def build(quick: bool) -> dict:
    """``{name: zero-argument call}`` of the programs, compiled and warmed up."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import lowrank_jax as lj
    from benchmarks.models.train import config as train_config  # its small config
    from lowrank_jax.models import chronos_bolt, t5, vit

    progs = {}
    sc = train_config(quick=True)  # d_model 64, 2 + 2 layers, context 64, horizon 16
    sp = chronos_bolt.init(jax.random.key(6), sc)
    sloss = chronos_bolt.loss(sc)
    walk = jnp.asarray(np.cumsum(np.random.default_rng(1).normal(size=(16, 80)), axis=1),
                       jnp.float32)
    sbatch = {"context": walk[:, :64], "target": walk[:, 64:]}
    opt = optax.adam(1e-3)
    sst = opt.init(sp)

    @jax.jit
    def small_step(p, st, batch):
        g = jax.grad(lambda p: sloss(p, batch, None)[0])(p)
        u, st = opt.update(g, st, p)
        return optax.apply_updates(p, u), st

    progs["small Chronos-Bolt train step (d 64)"] = lambda: small_step(sp, sst, sbatch)
    lin = jax.jit(lambda leaf, x: lj.linear(leaf, x))
    for d in (1024, 768):
        x = jax.random.normal(jax.random.key(d), (8192, d), jnp.float32)
        r = round(0.1 * d / 2)
        for name, leaf in ((f"LowRank d {d} rank {r}, 8192 tokens",
                            lj.init_lowrank(jax.random.key(1), d, d, r)),
                           (f"Dense d {d}, 8192 tokens", lj.init_dense(jax.random.key(2), d, d))):
            progs[name] = (lambda f=lin, lf=leaf, x=x: f(lf, x))
    cfg = vit.ViTConfig(num_hidden_layers=4)
    vp = vit.init(jax.random.key(3), cfg)
    px = jax.random.normal(jax.random.key(4), (32, 3, 224, 224), jnp.float32)
    vf = jax.jit(lambda p, px: vit.apply(p, {"pixel_values": px}, cfg)["last_hidden_state"])
    progs["ViT-Base width, 4 layers, 32 images"] = lambda: vf(vp, px)
    if not quick:
        t5c = t5.T5Config(vocab_size=2, d_model=768, d_kv=64, d_ff=3072, num_layers=12,
                          num_decoder_layers=12, num_heads=12, feed_forward_proj="relu")
        bc = chronos_bolt.ChronosBoltConfig(t5=t5c, context_length=512, prediction_length=64,
                                            input_patch_size=16, input_patch_stride=16,
                                            use_reg_token=True)
        bp = chronos_bolt.init(jax.random.key(5), bc)
        rng = np.random.default_rng(0)
        ctx = jnp.asarray(np.cumsum(rng.normal(size=(32, 512)), axis=1), jnp.float32)
        bf = jax.jit(lambda p, c: chronos_bolt.forecast(p, c, bc))
        progs["Chronos-Bolt-base forward, 32 x 512"] = lambda: bf(bp, ctx)
        loss = chronos_bolt.loss(bc)
        batch = {"context": ctx[:8], "target": ctx[:8, -64:]}
        g = jax.jit(jax.grad(lambda p, b: loss(p, b, None)[0]))
        progs["Chronos-Bolt-base loss gradient, batch 8"] = lambda: g(bp, batch)
    for fn in progs.values():
        jax.block_until_ready(fn())
    return progs


GLIBC_MODES = ("default", "kept", "one_arena")
#: Allocators preloaded into a child with ``LD_PRELOAD`` (Debian: ``apt install
#: libtcmalloc-minimal4 libjemalloc2``); a mode runs only where its library is found.
PRELOADS = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
}
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib")


def find_preload(mode: str) -> str | None:
    """Path of ``mode``'s shared library (``PRELOADS``), or None where it is not installed."""
    for d in LIB_DIRS:
        for name in PRELOADS[mode]:
            path = os.path.join(d, name)
            if os.path.exists(path):
                return path
    return None


MODES = GLIBC_MODES + tuple(PRELOADS)


def child(mode: str, quick: bool, runs: int) -> dict:
    """One process: set ``malloc`` (``mode``), time the programs, count faults and memory."""
    import resource

    os.environ["LOWRANK_JAX_KEEP_FREED_MEMORY"] = "0"  # the import must not decide
    from lowrank_jax import runtime

    if mode in ("kept", "one_arena") and not runtime.keep_freed_memory(
            one_arena=mode == "one_arena"):
        raise SystemExit("keep_freed_memory() did nothing here (not glibc on Linux)")
    import jax

    progs = build(quick)
    names = list(progs)
    m = H.measure(progs, runs=runs, warmup=1)
    calls = [lambda f=progs[n]: jax.block_until_ready(f()) for n in names]
    faults = {}
    for n, c in zip(names, calls, strict=True):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            c()
        faults[n] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 3
    return {"mode": mode, "malloc": H.malloc_setting(), "ms": {n: m.ms(n) for n in names},
            "faults_per_call": faults,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "other_load": m.load}


def main(argv=None) -> int:
    p = H.parser(__doc__, quick="no Chronos-Bolt-base, 1 round")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of one child per setting (default 2; quick 1)")
    p.add_argument("--runs", type=int, default=None, help="timed calls (default 7; quick 5)")
    p.add_argument("--no-preload", action="store_true",
                   help="glibc's settings only, even where tcmalloc or jemalloc is installed")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    runs = args.runs or (5 if args.quick else 7)
    if args.child:
        res = child(args.child, args.quick, runs)
        with open(args.out, "w") as f:  # a temporary file the parent reads back
            json.dump(res, f)
        return 0

    rounds = args.rounds or (1 if args.quick else 2)
    run = H.Run(__name__, argv, runs=runs, rounds=rounds)
    preload = {m: find_preload(m) for m in PRELOADS}
    modes = [m for m in MODES if m in GLIBC_MODES or (preload[m] and not args.no_preload)]
    for m, path in preload.items():
        if path is None:
            print(f"# {m}: not found ({', '.join(PRELOADS[m])} in {', '.join(LIB_DIRS)}); "
                  "skipped", flush=True)
    order = []
    for i in range(rounds):
        order += modes if i % 2 == 0 else modes[::-1]
    results = []
    t0 = time.perf_counter()
    for i, mode in enumerate(order):
        out = os.path.join(os.path.dirname(os.path.abspath(args.json or "allocator.json")),
                           f".allocator_child_{os.getpid()}_{i}.json")
        cmd = [sys.executable, "-m", "benchmarks.machine", "allocator", "--child", mode,
               "--out", out, "--runs", str(runs)] + (["--quick"] if args.quick else [])
        env = dict(os.environ)
        if mode in PRELOADS:  # the allocator replaces malloc from the child's first instruction
            env["LD_PRELOAD"] = preload[mode]
        else:  # glibc's malloc, even when this script itself runs under a preloaded allocator
            env.pop("LD_PRELOAD", None)
        subprocess.run(cmd, check=True, env=env, cwd=H.ROOT)
        with open(out) as f:
            results.append(json.load(f))
        os.remove(out)
        load = results[-1]["other_load"]
        print(f"# child {i + 1}/{len(order)} ({mode}: {results[-1]['malloc']}) done at "
              f"{time.perf_counter() - t0:.0f} s, other load "
              f"{'n/a' if load is None else f'{load:.0%}'}", flush=True)
    by = {m: [r for r in results if r["mode"] == m] for m in modes}
    names = list(results[0]["ms"])
    rows = []
    print(f"# {run.describe()}; median of {runs} calls per child, {rounds} rounds of "
          "children; speed-up = default ms / ms (median over rounds); faults per call")
    print(f"{'program':40s} {'default ms':>10} "
          + " ".join(f"{m + ' x':>12}" for m in modes[1:]) + "   faults " + " / ".join(modes))
    for n in names:
        row = {"program": n}
        for m in modes:
            row[f"{m}_ms"] = statistics.median(r["ms"][n] for r in by[m])
            row[f"{m}_faults"] = statistics.median(r["faults_per_call"][n] for r in by[m])
        for m in modes[1:]:
            sp = [a["ms"][n] / b["ms"][n] for a, b in zip(by["default"], by[m], strict=True)]
            row[f"{m}_speedup"] = statistics.median(sp)
            row[f"{m}_speedup_range"] = [min(sp), max(sp)]
        rows.append(row)
        print(f"{n:40s} {row['default_ms']:10.2f} "
              + " ".join(f"{row[m + '_speedup']:12.2f}" for m in modes[1:]) + "   "
              + " / ".join(f"{row[m + '_faults']:.0f}" for m in modes))
    rss = {m: max(r["max_rss_mb"] for r in by[m]) for m in modes}
    print("# peak resident memory of a child (MB): "
          + ", ".join(f"{m} {v:.0f}" for m, v in rss.items()))
    labels = {"kept": "keep_freed_memory()", "one_arena": "keep_freed_memory(one_arena=True)",
              "tcmalloc": "LD_PRELOAD tcmalloc", "jemalloc": "LD_PRELOAD jemalloc"}
    goals = {}
    for m in modes[1:]:
        sp = [r[f"{m}_speedup"] for r in rows]
        goals.update(H.goal(
            f"{labels[m]} speed-up (median over programs, default ms / ms with it)",
            statistics.median(sp), range=[min(sp), max(sp)],
            measured=f"{statistics.median(sp):.4g} ({min(sp):.2f}-{max(sp):.2f})"))
    run.finish(args.json, rows=rows, goals=goals, modes=modes, preload=preload,
               max_rss_mb=rss, children=results)
    return 0


if __name__ == "__main__":
    H.run_as_main(__spec__)
