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

    python -m benchmarks.layers mlp --json mlp.json     # about 2 minutes
    python -m benchmarks.layers mlp --quick             # three sizes, no gradient, no ViT
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import _harness as H
from lowrank_jax import execution, nn
from lowrank_jax.models import vit
from lowrank_jax.nn import execution as strategy

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
    return {"chunked": H.compile_with(fn, args),
            "whole": H.compile_with(fn, args, mlp_chunk_above_bytes=None)}


def timed_row(what: str, comp: dict, args, *, tokens: int, d_ff: int, runs: int) -> dict:
    m = H.measure({k: (lambda c=c: c(*args)) for k, c in comp.items()}, runs=runs, warmup=1,
                  check={"chunked": "whole"})
    return {"what": what, "tokens": tokens, "d_ff": d_ff,
            "chunks": strategy.token_chunks(tokens, d_ff),
            "hidden_mb": 4 * tokens * d_ff / 2**20, "whole_ms": m.ms("whole"),
            "chunked_ms": m.ms("chunked"), "speedup": m.ratio("whole", "chunked"),
            "rel_diff": m.rel_error["chunked"], "other_load": m.load}


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


TABLE = H.Table(
    H.Col("what", "what", width=34), H.Col("tokens", "tokens"),
    H.Col("hidden MB", "hidden_mb", ".1f"), H.Col("chunks", lambda r: str(r["chunks"])),
    H.Col("whole ms", "whole_ms", ".2f", 9), H.Col("chunked ms", "chunked_ms", ".2f"),
    H.Col("speed-up", "speedup", ".2f"), H.Col("rel diff", "rel_diff", ".1e"),
    H.Col("load", "other_load", "%", 5))


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="three sizes, no gradient, no ViT")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 9; quick 5)")
    p.add_argument("--no-vit", action="store_true", help="skip the ViT row")
    args = p.parse_args(argv)
    runs = args.runs if args.runs is not None else (5 if args.quick else 9)
    ex = execution.current()
    run = H.Run(__name__, argv, runs=runs, chunk_above_bytes=ex.mlp_chunk_above_bytes,
                chunk_bytes=ex.mlp_chunk_bytes)
    print(f"# {run.describe()}; median of {runs} interleaved runs; chunks when the hidden "
          f"activations exceed {ex.mlp_chunk_above_bytes} bytes, of at most "
          f"{ex.mlp_chunk_bytes} bytes")
    print(TABLE.header())
    rows = []
    for size in (QUICK_SIZES if args.quick else SIZES):
        rows.append(bench_mlp(*size, runs))
        print(TABLE.line(rows[-1]), flush=True)
    if not args.quick:
        rows.append(bench_mlp(*SIZES[1], runs, grad=True))
        print(TABLE.line(rows[-1]), flush=True)
    if not (args.quick or args.no_vit):
        rows.append(bench_vit(runs))
        print(TABLE.line(rows[-1]), flush=True)
    goals = H.chunked_speedup_goal("MLP on CPU in token chunks against all tokens at once: "
                                   "speed-up", rows, "chunks")
    return run.finish(args.json, rows=rows, goals=goals)


if __name__ == "__main__":
    H.run_as_main(__spec__)
