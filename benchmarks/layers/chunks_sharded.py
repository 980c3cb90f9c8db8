"""Why the CPU chunking of attention and MLPs is off with several devices.

:func:`lowrank_jax.nn.execution.cpu_chunks` allows the batch chunks of
:func:`~lowrank_jax.nn.apply_attention` and the token chunks of :func:`~lowrank_jax.nn.apply_mlp`
only on a CPU backend with one device. This script shows what happens otherwise: on 8 simulated
CPU devices (``--xla_force_host_platform_device_count=8``, set before JAX is imported) with the
batch sharded over them, it compiles each block whole (the library's choice there) and chunked
(``cpu_chunks`` forced on while tracing), and times both (median of ``--runs`` calls each, after
two warm-up calls). The chunked program gathers the input onto every device: slower, and its
output is replicated instead of sharded.

Usage::

    python -m benchmarks.layers chunks_sharded --json chunks_sharded.json    # about 30 s
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from benchmarks import _harness as H  # noqa: E402
from lowrank_jax import nn  # noqa: E402


def row(what: str, fn, args, runs: int) -> dict:
    """Whole and chunked, each timed on its own (median of ``runs`` after two warm-up calls):
    the two programs hold every device, so they run one after the other, not interleaved."""
    out = {"what": what}
    ys = {}
    for mode in ("whole", "chunked"):
        # chunked: forced on, at any size (the attention row's 34 MB of logits is below the
        # default threshold, so cpu_chunks alone would leave it whole)
        forced = {"cpu_chunks": True, "attention_chunk_above_bytes": 0, "mlp_chunk_above_bytes": 0}
        c = H.compile_with(fn, args, **(forced if mode == "chunked" else {}))
        t = H.time_calls({mode: lambda c=c: jax.block_until_ready(c(*args))}, runs=runs,
                         warmup=2)
        ys[mode] = c(*args)
        out[f"{mode}_ms"] = 1e3 * t.median(mode)
        out[f"{mode}_output_spec"] = str(ys[mode].sharding.spec)
    out["slowdown"] = out["chunked_ms"] / out["whole_ms"]
    out["max_abs_diff"] = float(np.max(np.abs(np.asarray(ys["whole"]) - np.asarray(ys["chunked"]))))
    return out


TABLE = H.Table(
    H.Col("what", "what", width=42), H.Col("whole ms", "whole_ms", ".1f", 9),
    H.Col("chunked ms", "chunked_ms", ".1f"), H.Col("slower", "slowdown", ".1f"),
    H.Col("whole out", "whole_output_spec", width=10),
    H.Col("chunked out", "chunked_output_spec"))


def main(argv=None) -> dict:
    p = H.parser(__doc__, quick="the same (it is short)")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    run = H.Run(__name__, argv, runs=args.runs)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    shard = NamedSharding(mesh, PartitionSpec("data"))
    rows = []
    cfg = nn.AttentionConfig()
    pa = nn.init_attention(jax.random.key(1), cfg, d_model=256, num_heads=4)
    xa = jax.device_put(jax.random.normal(jax.random.key(2), (32, 256, 256)), shard)
    rows.append(row("attention d 256, 4 heads, 32 x 256 tokens",
                    lambda p, x: nn.apply_attention(p, x, cfg), (pa, xa), args.runs))
    mcfg = nn.MLPConfig()
    pm = nn.init_mlp(jax.random.key(3), mcfg, d_model=512, d_ff=2048)
    xm = jax.device_put(jax.random.normal(jax.random.key(4), (32, 200, 512)), shard)
    rows.append(row("MLP 512 / 2048, 32 x 200 tokens", lambda p, x: nn.apply_mlp(p, x, mcfg),
                    (pm, xm), args.runs))
    print(f"# {run.describe()}; batch sharded over the devices; median of {args.runs}")
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    goals = {}
    for r in rows:
        goals.update(H.goal(f"{r['what']} on {jax.device_count()} CPU devices: chunked time / "
                            "whole time", r["slowdown"],
                            measured=f"{r['slowdown']:.1f}x slower chunked, output "
                                     f"{r['chunked_output_spec']} instead of "
                                     f"{r['whole_output_spec']}"))
    return run.finish(args.json, rows=rows, goals=goals)


if __name__ == "__main__":
    H.run_as_main(__spec__)
