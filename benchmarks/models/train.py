"""Train-step time of dense against low-rank Chronos-Bolt models at the same config.

One Chronos-Bolt configuration; its attention weights (and, with ``--mlp``, its MLP weights)
are factorized from initialization (:func:`lowrank_jax.train.pretrain.factorize_init`) at a few
ranks and by the flow-of-ranks schedule. Every model's jitted train step (AdamW, quantile loss,
donated state) is timed in the same loop, interleaved, median of ``--runs`` steps after
warm-up. Printed next to each time ratio: the FLOP ratio of the weight matmuls
(:func:`lowrank_jax.flops` on the forward; the backward pass has the same ratio) and the
parameter ratio.

Usage::

    python -m benchmarks.models train            # d_model 256, 4+4 layers, context 256, batch 32
    python -m benchmarks.models train --quick    # smaller, for a smoke test
    python -m benchmarks.models train --mlp --json train.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import lowrank_jax as lj
from benchmarks import _harness as H
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


TABLE = H.Table(
    H.Col("model", "model", width=28), H.Col("step ms", "step_ms", ".1f", 9),
    H.Col("time ratio", "time_ratio", ".3f"), H.Col("flop ratio", "flop_ratio", ".3f"),
    H.Col("time/flop", "time_per_flop", ".2f"), H.Col("param ratio", "param_ratio", ".3f"))


def main(argv=None) -> dict:
    ap = H.parser(__doc__, quick="d_model 64, 2+2 layers, context 64, 5 runs")
    ap.add_argument("--mlp", action="store_true", help="factorize the MLP weights too")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=None)
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
    states = {}

    def step_of(name: str):
        step = make_train_step(loss_fn, opt)

        def call():  # one train step; the state carries over to the next call
            states[name], metrics = step(states[name], batch, None)
            return metrics["loss"]
        return call

    calls = {}
    for name, p in variants.items():
        states[name] = init_train_state(p, opt, key=key)
        calls[name] = step_of(name)
    run = H.Run(__name__, argv, runs=runs, batch=args.batch, mlp=args.mlp, d_model=d,
                layers=n_layers, context_length=cfg.context_length)
    m = H.measure(calls, runs=runs, warmup=2)  # warm-up: compile + one step
    base_t = m.timings.median("dense")
    base_f = lj.flops(dense, n_tokens)
    base_p = lj.param_count(dense)
    rows = []
    print(f"# {run.describe()}; d_model {d}, "
          f"{n_layers}+{n_layers} layers, context {cfg.context_length}, batch {args.batch}; "
          f"factorized: {', '.join(rules)}; median of {runs} interleaved steps")
    print(TABLE.header())
    for name, p in variants.items():
        t = m.timings.median(name)
        row = {"model": name, "step_ms": 1e3 * t, "time_ratio": t / base_t,
               "flop_ratio": lj.flops(p, n_tokens) / base_f, "param_ratio": lj.param_count(p) / base_p}
        row["time_per_flop"] = row["time_ratio"] / row["flop_ratio"]
        rows.append(row)
        print(TABLE.line(row))
    return run.finish(args.json, rows=rows)


if __name__ == "__main__":
    H.run_as_main(__spec__)
