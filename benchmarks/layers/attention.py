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

    python -m benchmarks.layers attention --json attention.json    # about 2 minutes
    python -m benchmarks.layers attention --quick                  # 512 and 2048 tokens, no ViT
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import lowrank_jax as lj
from benchmarks import _harness as H
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
    return {"chunked": H.compile_with(fn, args),
            "whole": H.compile_with(fn, args, attention_chunk_above_bytes=None)}


def bench_blocks(seq: int, tokens: int, runs: int) -> list[dict]:
    batch = max(1, tokens // seq)
    x = jax.random.normal(jax.random.key(1), (batch, seq, D), jnp.float32)
    cfg = nn.AttentionConfig(use_bias=True)
    kinds = ("dense", "truncatt r16", "cp R74")
    calls, chunks = {}, {}
    for kind in kinds:
        p = block_params(kind, jax.random.key(2))
        chunks[kind] = strategy.batch_chunk(batch, HEADS, seq, seq,
                                            factored=p["qk"].projections() is None)
        comp = compile_both(lambda p, x: nn.apply_attention(p, x, cfg), (p, x))
        for mode, c in comp.items():
            calls[f"{kind}, {mode}"] = lambda c=c, p=p: c(p, x)
    m = H.measure(calls, runs=runs, warmup=1,
                  check={f"{k}, chunked": f"{k}, whole" for k in kinds})
    rows = []
    for kind in kinds:
        w, c = f"{kind}, whole", f"{kind}, chunked"
        rows.append({"what": f"block {kind}", "seq": seq, "batch": batch, "tokens": batch * seq,
                     "chunk": chunks[kind],
                     "logits_mb": 4 * batch * HEADS * seq * seq / 1e6,
                     "whole_ms": m.ms(w), "chunked_ms": m.ms(c), "speedup": m.ratio(w, c),
                     "max_abs_diff": m.max_abs_error[c], "other_load": m.load})
    return rows


def bench_vit(runs: int, batch: int = 32, layers: int = 4) -> dict:
    cfg = vit.ViTConfig(num_hidden_layers=layers)
    params = vit.init(jax.random.key(3), cfg)
    px = jax.random.normal(jax.random.key(4), (batch, 3, 224, 224), jnp.float32)
    comp = compile_both(lambda p, px: vit.apply(p, {"pixel_values": px}, cfg)
                        ["last_hidden_state"], (params, px))
    m = H.measure({k: (lambda c=c: c(params, px)) for k, c in comp.items()}, runs=runs,
                  warmup=1, check={"chunked": "whole"})
    n = (224 // 16) ** 2 + 1
    return {"what": f"ViT-Base width, {layers} layers", "seq": n, "batch": batch,
            "tokens": batch * n, "chunk": strategy.batch_chunk(batch, HEADS, n, n),
            "logits_mb": 4 * batch * HEADS * n * n / 1e6, "whole_ms": m.ms("whole"),
            "chunked_ms": m.ms("chunked"), "speedup": m.ratio("whole", "chunked"),
            "max_abs_diff": m.max_abs_error["chunked"], "other_load": m.load}


TABLE = H.Table(
    H.Col("what", "what", width=28), H.Col("N", "seq", width=4), H.Col("batch", "batch"),
    H.Col("chunk", lambda r: str(r["chunk"])), H.Col("logits MB", "logits_mb", ".1f"),
    H.Col("whole ms", "whole_ms", ".2f", 9), H.Col("chunked ms", "chunked_ms", ".2f"),
    H.Col("speed-up", "speedup", ".2f"), H.Col("max|diff|", "max_abs_diff", ".1e"),
    H.Col("load", "other_load", "%", 5))


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="fewer sizes and runs, no ViT")
    p.add_argument("--seq", type=int, nargs="+", default=[256], help="tokens per sequence")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per call (default 512 2048 8192; quick 512 2048)")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 15; quick 5)")
    p.add_argument("--no-vit", action="store_true", help="skip the ViT rows")
    args = p.parse_args(argv)
    tokens = args.tokens or ([512, 2048] if args.quick else [512, 2048, 8192])
    runs = args.runs if args.runs is not None else (5 if args.quick else 15)
    ex = execution.current()
    run = H.Run(__name__, argv, runs=runs, chunk_above_bytes=ex.attention_chunk_above_bytes,
                chunk_bytes=ex.attention_chunk_bytes)
    print(f"# {run.describe()}; median of {runs} interleaved runs; chunks when the logits "
          f"exceed {ex.attention_chunk_above_bytes} bytes, of at most "
          f"{ex.attention_chunk_bytes} bytes")
    print(TABLE.header())
    rows = []
    for seq in args.seq:
        for n in tokens:
            for r in bench_blocks(seq, n, runs):
                print(TABLE.line(r), flush=True)
                rows.append(r)
    if not (args.quick or args.no_vit):
        rows.append(bench_vit(runs))
        print(TABLE.line(rows[-1]), flush=True)
    goals = H.chunked_speedup_goal("attention on CPU in batch chunks against the whole batch: "
                                   "speed-up", rows, "chunk")
    return run.finish(args.json, rows=rows, goals=goals)


if __name__ == "__main__":
    H.run_as_main(__spec__)
