"""Attention on CPU a chunk of the batch at a time against the whole batch at once.

:func:`lowrank_jax.nn.apply_attention` computes the logits, the softmax and the weighted values
of a large batch chunk by chunk on CPU (:func:`lowrank_jax.nn.attention.batch_chunk`), so that
the ``[batch, H, q, k]`` logits stay in cache instead of going to memory and back. This script
times both executions in one interleaved loop:

* **blocks**: one self-attention block (d 768, 12 heads of 64, with biases; ``N`` tokens per
  sequence, ``batch`` sequences) with a dense query-key object and with two compressed ones
  (TruncAtt with heads of width 16, CP-SlimAtt of rank 74: FLOP ratios of about 0.25 of the
  dense query-key), each chunked (the library's default) and whole;
* **ViT**: a 4-layer ViT-Base-width encoder (``models.vit``, random weights, 224 x 224 images,
  197 tokens) on a batch of 32 images, chunked and whole.

The whole-batch execution is obtained by tracing with the execution setting
``attention_chunk_above_bytes=None``.
Each figure is the median of ``--runs`` interleaved calls (order reversed every other run);
``speed-up = whole ms / chunked ms``; ``max |diff|`` compares the two outputs.

Usage::

    python benchmarks/attention.py --json attention.json    # about 2 minutes
    python benchmarks/attention.py --quick                  # 512 and 2048 tokens, no ViT
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
    other_load,
    time_interleaved,
    write_json,
)

try:
    import lowrank_jax as lj
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lowrank_jax as lj
from lowrank_jax import execution, nn
from lowrank_jax.leaves.qk_factorized import CPQueryKey
from lowrank_jax.models import vit
from lowrank_jax.nn import execution as strategy

D, HEADS = 768, 12


def block_params(kind: str, key) -> dict:
    """A self-attention block, its query-key object dense or compressed."""
    cfg = nn.AttentionConfig(use_bias=True)
    p = nn.init_attention(key, cfg, d_model=D, num_heads=HEADS)
    kq, kk, km = jax.random.split(jax.random.fold_in(key, 1), 3)
    if kind == "truncatt r16":
        p["qk"] = lj.QueryKey(q=lj.init_dense(kq, D, HEADS * 16), k=lj.init_dense(kk, D, HEADS * 16),
                              widths=(16,) * HEADS)
    elif kind == "cp R74":
        p["qk"] = CPQueryKey(q=lj.init_dense(kq, D, 74), k=lj.init_dense(kk, D, 74),
                             mix=jax.random.normal(km, (HEADS, 74), jnp.float32))
    return p


def compile_both(fn, args):
    """``fn`` compiled for ``args`` with batch chunking on (the default) and off."""
    return {"chunked": compile_with(fn, args),
            "whole": compile_with(fn, args, attention_chunk_above_bytes=None)}


def bench_blocks(seq: int, tokens: int, runs: int) -> list[dict]:
    batch = max(1, tokens // seq)
    x = jax.random.normal(jax.random.key(1), (batch, seq, D), jnp.float32)
    cfg = nn.AttentionConfig(use_bias=True)
    rows, calls, names, outs, chunks = [], [], [], {}, {}
    for kind in ("dense", "truncatt r16", "cp R74"):
        p = block_params(kind, jax.random.key(2))
        chunks[kind] = strategy.batch_chunk(batch, HEADS, seq, seq,
                                            factored=p["qk"].projections() is None)
        comp = compile_both(lambda p, x: nn.apply_attention(p, x, cfg), (p, x))
        for mode, c in comp.items():
            names.append((kind, mode))
            calls.append(lambda c=c, p=p: jax.block_until_ready(c(p, x)))
            outs[(kind, mode)] = np.asarray(c(p, x))
    before = cpu_snapshot()
    times = time_interleaved(calls, runs, 1)
    load = other_load(before, cpu_snapshot())
    med = {n: statistics.median(t) for n, t in zip(names, times, strict=True)}
    for kind in ("dense", "truncatt r16", "cp R74"):
        w, c = med[(kind, "whole")], med[(kind, "chunked")]
        rows.append({"what": f"block {kind}", "seq": seq, "batch": batch, "tokens": batch * seq,
                     "chunk": chunks[kind],
                     "logits_mb": 4 * batch * HEADS * seq * seq / 1e6,
                     "whole_ms": w * 1e3, "chunked_ms": c * 1e3, "speedup": w / c,
                     "max_abs_diff": float(np.max(np.abs(outs[(kind, "whole")]
                                                         - outs[(kind, "chunked")]))),
                     "other_load": load})
    return rows


def bench_vit(runs: int, batch: int = 32, layers: int = 4) -> dict:
    cfg = vit.ViTConfig(num_hidden_layers=layers)
    params = vit.init(jax.random.key(3), cfg)
    px = jax.random.normal(jax.random.key(4), (batch, 3, 224, 224), jnp.float32)
    comp = compile_both(lambda p, px: vit.apply(p, {"pixel_values": px}, cfg)
                        ["last_hidden_state"], (params, px))
    calls = [lambda c=c: jax.block_until_ready(c(params, px)) for c in comp.values()]
    before = cpu_snapshot()
    times = time_interleaved(calls, runs, 1)
    load = other_load(before, cpu_snapshot())
    med = dict(zip(comp, (statistics.median(t) for t in times), strict=True))
    diff = float(np.max(np.abs(np.asarray(comp["whole"](params, px))
                               - np.asarray(comp["chunked"](params, px)))))
    n = (224 // 16) ** 2 + 1
    return {"what": f"ViT-Base width, {layers} layers", "seq": n, "batch": batch,
            "tokens": batch * n, "chunk": strategy.batch_chunk(batch, HEADS, n, n),
            "logits_mb": 4 * batch * HEADS * n * n / 1e6, "whole_ms": med["whole"] * 1e3,
            "chunked_ms": med["chunked"] * 1e3, "speedup": med["whole"] / med["chunked"],
            "max_abs_diff": diff, "other_load": load}


HEADER = (f"{'what':<28} {'N':>4} {'batch':>5} {'chunk':>5} {'logits MB':>9} {'whole ms':>9} "
          f"{'chunked ms':>10} {'speed-up':>8} {'max|diff|':>9} {'load':>5}")


def format_row(r: dict) -> str:
    load = "n/a" if r["other_load"] is None else f"{100 * r['other_load']:.0f}%"
    return (f"{r['what']:<28} {r['seq']:>4} {r['batch']:>5} {str(r['chunk']):>5} "
            f"{r['logits_mb']:>9.1f} {r['whole_ms']:>9.2f} {r['chunked_ms']:>10.2f} "
            f"{r['speedup']:>8.2f} {r['max_abs_diff']:>9.1e} {load:>5}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[256], help="tokens per sequence")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per call (default 512 2048 8192; quick 512 2048)")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 15; quick 5)")
    p.add_argument("--no-vit", action="store_true", help="skip the ViT rows")
    p.add_argument("--quick", action="store_true", help="fewer sizes and runs, no ViT")
    p.add_argument("--json", metavar="PATH", help="write the setup and rows as JSON")
    args = p.parse_args(argv)
    tokens = args.tokens or ([512, 2048] if args.quick else [512, 2048, 8192])
    runs = args.runs if args.runs is not None else (5 if args.quick else 15)
    setup = {"jax": jax.__version__, "backend": jax.default_backend(),
             "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
             "runs": runs, "chunk_above_bytes": execution.current().attention_chunk_above_bytes,
             "chunk_bytes": execution.current().attention_chunk_bytes,
             "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(f"# jax {setup['jax']} on {setup['backend']} ({setup['cpu_count']} CPUs); median of "
          f"{runs} interleaved runs; chunks when the logits exceed "
          f"{execution.current().attention_chunk_above_bytes} bytes, of at most "
          f"{execution.current().attention_chunk_bytes} bytes")
    print(HEADER)
    rows = []
    for seq in args.seq:
        for n in tokens:
            for r in bench_blocks(seq, n, runs):
                print(format_row(r), flush=True)
                rows.append(r)
    if not (args.quick or args.no_vit):
        r = bench_vit(runs)
        print(format_row(r), flush=True)
        rows.append(r)
    goals = chunked_speedup_goal("attention_chunked_vs_whole_speedup", rows, "chunk")
    result = {"setup": setup, "rows": rows, "goals": goals}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
