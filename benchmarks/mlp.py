"""MLPs on CPU a chunk of the tokens at a time against all tokens at once.

:func:`lowrank_jax.nn.apply_mlp` runs a large input a chunk of tokens at a time on CPU
(:func:`lowrank_jax.nn.mlp.token_chunks`: when the hidden activations ``[tokens, d_ff]`` would
exceed 16 MB, in chunks of at most 8 MB of them), so that the hidden activations stay in cache
between the two products instead of going to memory and back. This script times both
executions in one interleaved loop:

* **MLP**: one block (dense leaves, ReLU, or gated GELU as T5 v1.1) at several widths and
  token counts, including the Chronos-Bolt-base batch (1056 tokens: below the threshold, so
  both columns run the same program);
* **gradient**: ``value_and_grad`` of the block's summed squares (weights and input);
* **ViT**: a 4-layer ViT-Base-width encoder (``models.vit``, random weights, 224 x 224 images,
  197 tokens) on a batch of 32 images, MLP chunks on and off (attention chunked in both, the
  library's default).

The all-at-once execution is obtained by tracing with the execution setting
``mlp_chunk_above_bytes=None``. Each
figure is the median of ``--runs`` interleaved calls (order reversed every other run);
``speed-up = whole ms / chunked ms``; ``rel diff`` = max |difference of the two outputs| /
max |output|.

Usage::

    python benchmarks/mlp.py --json mlp.json     # about 2 minutes
    python benchmarks/mlp.py --quick             # three sizes, no gradient, no ViT
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _machine import (  # benchmarks/_machine.py
    chunked_speedup_goal,
    compile_with,
    cpu_snapshot,
    malloc_setting,
    other_load,
    time_interleaved,
    write_json,
)  # benchmarks/_machine.py

try:
    import lowrank_jax as lj
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lowrank_jax as lj
from lowrank_jax import (
    execution,  # noqa: E402
    nn,  # noqa: E402
)
from lowrank_jax.models import vit  # noqa: E402
from lowrank_jax.nn import execution as strategy  # noqa: E402

# (d_model, d_ff, tokens, activation, gated)
SIZES = [
    (768, 3072, 1056, "relu", False),   # Chronos-Bolt-base: 32 series of 33 patches
    (768, 3072, 6304, "gelu", False),   # ViT-Base: 32 images of 197 tokens
    (768, 3072, 16384, "relu", False),  # 32 sequences of 512 tokens
    (768, 2048, 16384, "gelu_tanh", True),  # T5 v1.1 base, gated
    (1024, 4096, 8192, "gelu", False),
    (512, 2048, 16384, "relu", False),
    (256, 1024, 4096, "relu", False),
]
QUICK_SIZES = [SIZES[1], (512, 2048, 4096, "relu", False), SIZES[-1]]


def compile_both(fn, args):
    """``fn`` compiled for ``args`` with token chunks on (the default) and off."""
    return {"chunked": compile_with(fn, args),
            "whole": compile_with(fn, args, mlp_chunk_above_bytes=None)}


def rel_diff(a, b) -> float:
    a, b = (np.asarray(t, np.float64) for t in (a, b))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def timed_row(what: str, comp: dict, args, *, tokens: int, d_ff: int, runs: int) -> dict:
    calls = [lambda c=c: jax.block_until_ready(c(*args)) for c in comp.values()]
    before = cpu_snapshot()
    times = time_interleaved(calls, runs, 1)
    load = other_load(before, cpu_snapshot())
    med = dict(zip(comp, (statistics.median(t) for t in times), strict=True))
    diff = max(rel_diff(a, b) for a, b in zip(jax.tree_util.tree_leaves(comp["chunked"](*args)),
                                             jax.tree_util.tree_leaves(comp["whole"](*args)),
                                             strict=True))
    return {"what": what, "tokens": tokens, "d_ff": d_ff,
            "chunks": strategy.token_chunks(tokens, d_ff),
            "hidden_mb": 4 * tokens * d_ff / 2**20, "whole_ms": med["whole"] * 1e3,
            "chunked_ms": med["chunked"] * 1e3, "speedup": med["whole"] / med["chunked"],
            "rel_diff": diff, "other_load": load}


def bench_mlp(d: int, d_ff: int, tokens: int, activation: str, gated: bool, runs: int,
              grad: bool = False) -> dict:
    cfg = nn.MLPConfig(activation=activation, gated=gated)
    params = nn.init_mlp(jax.random.key(1), cfg, d_model=d, d_ff=d_ff)
    x = jax.random.normal(jax.random.key(2), (tokens, d), jnp.float32)
    what = f"MLP {d}/{d_ff} {activation}{' gated' if gated else ''}"
    if grad:
        fn = jax.value_and_grad(lambda p, x: jnp.sum(nn.apply_mlp(p, x, cfg) ** 2), argnums=(0, 1))
        return timed_row(what + ", gradient", compile_both(fn, (params, x)), (params, x),
                         tokens=tokens, d_ff=d_ff, runs=runs)
    return timed_row(what, compile_both(lambda p, x: nn.apply_mlp(p, x, cfg), (params, x)),
                     (params, x), tokens=tokens, d_ff=d_ff, runs=runs)


def bench_vit(runs: int, batch: int = 32, layers: int = 4) -> dict:
    cfg = vit.ViTConfig(num_hidden_layers=layers)
    params = vit.init(jax.random.key(3), cfg)
    px = jax.random.normal(jax.random.key(4), (batch, 3, 224, 224), jnp.float32)
    comp = compile_both(lambda p, px: vit.apply(p, {"pixel_values": px}, cfg)
                        ["last_hidden_state"], (params, px))
    n = (224 // 16) ** 2 + 1
    return timed_row(f"ViT-Base width, {layers} layers", comp, (params, px), tokens=batch * n,
                     d_ff=cfg.intermediate_size, runs=runs)


HEADER = (f"{'what':<34} {'tokens':>6} {'hidden MB':>9} {'chunks':>6} {'whole ms':>9} "
          f"{'chunked ms':>10} {'speed-up':>8} {'rel diff':>8} {'load':>5}")


def format_row(r: dict) -> str:
    load = "n/a" if r["other_load"] is None else f"{100 * r['other_load']:.0f}%"
    return (f"{r['what']:<34} {r['tokens']:>6} {r['hidden_mb']:>9.1f} {str(r['chunks']):>6} "
            f"{r['whole_ms']:>9.2f} {r['chunked_ms']:>10.2f} {r['speedup']:>8.2f} "
            f"{r['rel_diff']:>8.1e} {load:>5}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 9; quick 5)")
    p.add_argument("--no-vit", action="store_true", help="skip the ViT row")
    p.add_argument("--quick", action="store_true", help="three sizes, no gradient, no ViT")
    p.add_argument("--json", metavar="PATH", help="write the setup and rows as JSON")
    args = p.parse_args(argv)
    runs = args.runs if args.runs is not None else (5 if args.quick else 9)
    setup = {"jax": jax.__version__, "backend": jax.default_backend(),
             "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
             "runs": runs, "chunk_above_bytes": execution.current().mlp_chunk_above_bytes,
             "chunk_bytes": execution.current().mlp_chunk_bytes,
             "keep_freed_memory": lj.runtime.freed_memory_kept(), "malloc": malloc_setting(),
             "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(f"# jax {setup['jax']} on {setup['backend']} ({setup['cpu_count']} CPUs); median of "
          f"{runs} interleaved runs; chunks when the hidden activations exceed "
          f"{execution.current().mlp_chunk_above_bytes} bytes, of at most "
          f"{execution.current().mlp_chunk_bytes} bytes; malloc: "
          f"{setup['malloc']}")
    print(HEADER)
    rows = []
    for size in (QUICK_SIZES if args.quick else SIZES):
        rows.append(bench_mlp(*size, runs))
        print(format_row(rows[-1]), flush=True)
    if not args.quick:
        rows.append(bench_mlp(*SIZES[1], runs, grad=True))
        print(format_row(rows[-1]), flush=True)
    if not (args.quick or args.no_vit):
        rows.append(bench_vit(runs))
        print(format_row(rows[-1]), flush=True)
    goals = chunked_speedup_goal("mlp_chunked_vs_whole_speedup", rows, "chunks")
    result = {"setup": setup, "rows": rows, "goals": goals}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
