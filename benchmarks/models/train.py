"""Train-step time of dense against low-rank Chronos-Bolt models at the same config.

One Chronos-Bolt configuration; its attention weights (and, with ``--mlp``, its MLP weights)
are factorized from initialization (:func:`lowrank_jax.train.pretrain.factorize_init`) at a few
ranks and by the flow-of-ranks schedule. Every model's jitted train step (AdamW, quantile loss,
donated state) is timed in the same loop, interleaved, median of ``--runs`` steps after
warm-up. Printed next to each time ratio: the FLOP ratio of the weight matmuls
(:func:`lowrank_jax.flops` on the forward; the backward pass has the same ratio) and the
parameter ratio.

Usage::

    python benchmarks/train.py                  # d_model 256, 4+4 layers, context 256, batch 32
    python benchmarks/train.py --quick          # smaller, for a smoke test
    python benchmarks/train.py --mlp --json train.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

try:
    import lowrank_jax as lj
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lowrank_jax as lj


from lowrank_jax.compress import factorize_init, power_schedule
from lowrank_jax.models import chronos_bolt
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.train import default_optimizer, init_train_state, make_train_step


def config(quick: bool) -> ChronosBoltConfig:
    d, layers, ctx = (64, 2, 64) if quick else (256, 4, 256)
    t5 = T5Config(vocab_size=2, d_model=d, d_kv=d // 4, d_ff=4 * d, num_layers=layers,
                  num_decoder_layers=layers, num_heads=4, feed_forward_proj="relu")
    return ChronosBoltConfig(t5=t5, context_length=ctx, prediction_length=16, input_patch_size=16,
                             input_patch_stride=16, use_reg_token=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mlp", action="store_true", help="factorize the MLP weights too")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    runs = args.runs or (5 if args.quick else 20)
    cfg = config(args.quick)
    d = cfg.t5.d_model
    key = jax.random.PRNGKey(0)
    dense = chronos_bolt.init(key, cfg)
    rules = ("attn/(qk/q|qk/k|v|o)$",) + ((r"mlp/(wi|wo)$",) if args.mlp else ())
    n_layers = cfg.t5.num_layers
    variants = {"dense": dense}
    for r in (d // 16, d // 8, d // 4):
        variants[f"rank {r}"], _ = factorize_init(dense, key=key, rules=rules, rank=r)
    sched = power_schedule(max(1, d // 32), 0.7, n_layers, max_rank=d // 2)
    variants[f"flow-of-ranks {sched}"], _ = factorize_init(dense, key=key, rules=rules, schedule=sched)

    rng = np.random.default_rng(0)
    ctx = rng.normal(size=(args.batch, cfg.context_length)).cumsum(axis=1)
    tgt = ctx[:, -1:] + rng.normal(size=(args.batch, cfg.prediction_length)).cumsum(axis=1)
    batch = {"context": jnp.asarray(ctx, jnp.float32), "target": jnp.asarray(tgt, jnp.float32)}
    n_tokens = args.batch * (cfg.context_length // cfg.input_patch_size + 2)  # encoder + 1 decoder step
    opt = default_optimizer(learning_rate=1e-4, total_steps=10_000, warmup_steps=10)
    loss_fn = chronos_bolt.loss(cfg)
    steps, states = {}, {}
    for name, p in variants.items():
        steps[name] = make_train_step(loss_fn, opt)
        states[name] = init_train_state(p, opt, key=key)
        for _ in range(2):  # compile + warm-up
            states[name], m = steps[name](states[name], batch, None)
            jax.block_until_ready(m["loss"])
    times = {name: [] for name in variants}
    for i in range(runs):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            t0 = time.perf_counter()
            states[name], m = steps[name](states[name], batch, None)
            jax.block_until_ready(m["loss"])
            times[name].append(time.perf_counter() - t0)
    base_t = statistics.median(times["dense"])
    base_f = lj.flops(dense, n_tokens)
    base_p = lj.param_count(dense)
    rows = []
    print(f"# jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} CPUs); d_model {d}, "
          f"{n_layers}+{n_layers} layers, context {cfg.context_length}, batch {args.batch}; "
          f"factorized: {', '.join(rules)}; median of {runs} interleaved steps")
    print(f"{'model':<28} {'step ms':>9} {'time ratio':>10} {'flop ratio':>10} {'time/flop':>9} "
          f"{'param ratio':>11}")
    for name, p in variants.items():
        t = statistics.median(times[name])
        row = {"model": name, "step_ms": 1e3 * t, "time_ratio": t / base_t,
               "flop_ratio": lj.flops(p, n_tokens) / base_f, "param_ratio": lj.param_count(p) / base_p}
        row["time_per_flop"] = row["time_ratio"] / row["flop_ratio"]
        rows.append(row)
        print(f"{name:<28} {row['step_ms']:>9.1f} {row['time_ratio']:>10.3f} {row['flop_ratio']:>10.3f} "
              f"{row['time_per_flop']:>9.2f} {row['param_ratio']:>11.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
