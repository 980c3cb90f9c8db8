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

    python benchmarks/chunks_sharded.py --json chunks_sharded.json    # about 30 s
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _machine import compile_with, write_json  # noqa: E402  (benchmarks/_machine.py)
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

try:
    import lowrank_jax  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lowrank_jax import nn  # noqa: E402


def row(what: str, fn, args, runs: int) -> dict:
    out = {"what": what}
    ys = {}
    for mode in ("whole", "chunked"):
        c = compile_with(fn, args, cpu_chunks=True if mode == "chunked" else None)
        for _ in range(2):
            jax.block_until_ready(c(*args))
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            ys[mode] = jax.block_until_ready(c(*args))
            ts.append(time.perf_counter() - t0)
        out[f"{mode}_ms"] = statistics.median(ts) * 1e3
        out[f"{mode}_output_spec"] = str(ys[mode].sharding.spec)
    out["slowdown"] = out["chunked_ms"] / out["whole_ms"]
    out["max_abs_diff"] = float(np.max(np.abs(np.asarray(ys["whole"]) - np.asarray(ys["chunked"]))))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
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
    print(f"# {jax.device_count()} CPU devices, batch sharded over them; median of {args.runs}")
    print(f"{'what':<42} {'whole ms':>9} {'chunked ms':>10} {'slower':>6} {'whole out':>10} "
          f"{'chunked out':>11}")
    for r in rows:
        print(f"{r['what']:<42} {r['whole_ms']:>9.1f} {r['chunked_ms']:>10.1f} "
              f"{r['slowdown']:>6.1f} {r['whole_output_spec']:>10} {r['chunked_output_spec']:>11}")
    result = {"devices": jax.device_count(), "runs": args.runs, "rows": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
