"""Prune-then-finetune vs fine-tune at CPU scale ("Less is More: Unlocking Specialization of Time
Series Foundation Models via Structured Pruning", arXiv:2505.23195, the headline comparison).

1. **Pretraining**: a small Chronos-Bolt (the demo's model: d_model 64, 4 heads of 16, d_ff 256,
   ReLU, 4 encoder + 2 decoder layers, context 64, horizon 16; ``--quick``: 2 + 1 layers) is
   trained from scratch on the training part (first 70 % in time) of every built-in aeon series
   *except* the held-out dataset (default: household electric devices, one series of 11532
   values), with the library's training loop (``lowrank_jax.train.fit``, AdamW warmup-cosine).
2. **Adaptation** to the held-out series, on windows of its first 70 % in time, at the same
   budget of ``S`` batches of 32 windows:

   * (a) **fine-tune**: ``S`` fine-tuning steps of every weight;
   * (b) **prune-then-finetune**: the ``prune`` plan method (``apply_plan`` with
     ``Step('prune', DEFAULT_RULES, {'target': t, 'steps': P, 'data': <held-out source>})``:
     channel masks on every attention and MLP projection, eq. 6 importance averaged over the
     batch, EMA, Algorithm 1 with the cubic schedule, physical removal), on the first ``P``
     batches, then ``S - P`` fine-tuning steps on the next ones. Both arms see exactly the same
     ``S`` batches in the same order; a pruning batch (one forward and per-sample mask
     gradients) counts as one step.

   Fine-tuning uses the same optimizer in both arms (AdamW, peak ``--lr``, 5 % warmup, cosine
   decay to 0 over its steps).
3. **Test**: every window of the last 20 % of the held-out series (stride = horizon), mean-scaled
   by its context as the training windows are: MSE of the median forecast, WQL (Chronos'
   metric), MASE. Rows: zero-shot (the pretrained model), pruned before fine-tuning, fine-tune,
   prune-then-finetune; mean and standard deviation over ``--seeds`` adaptation seeds (the
   seed sets the batch order of the held-out windows, hence also the pruning batches); the
   pretrained model is the same for every seed. ``ptf_wins`` counts the seeds where
   prune-then-finetune has the lower test MSE (WQL) than fine-tuning with the same seed.

Usage::

    python -m benchmarks.methods prune_then_finetune --json ptf.json
    python -m benchmarks.methods prune_then_finetune --quick
"""

from __future__ import annotations

import time

import jax
import numpy as np

import lowrank_jax as lj
from benchmarks import _harness as H
from lowrank_jax.compress.prune import DEFAULT_RULES, register_batches
from lowrank_jax.datasets import builtin_datasets
from lowrank_jax.losses import mase, mse, wql
from lowrank_jax.models import chronos_bolt
from lowrank_jax.recipes.pretrain_demo import demo_config
from lowrank_jax.train import (
    WindowConfig,
    WindowSampler,
    default_optimizer,
    fit,
    full_params,
)

HELDOUT = "electric_devices_segmentation"
BATCH = 32
SOURCE = "prune_then_finetune:heldout"


def optimizer(lr: float, steps: int):
    return default_optimizer(learning_rate=lr, total_steps=steps, warmup_steps=max(steps // 20, 0))


def train(cfg, params, sampler, steps: int, lr: float, seed: int, desc: str) -> tuple:
    """``steps`` steps of the library's training loop on ``sampler``'s batches."""
    def batch_of(w):
        return {"context": np.asarray(w["context"]), "target": np.asarray(w["target"])}

    state, hist = fit(chronos_bolt.loss(cfg), params, sampler, steps=steps,
                      key=jax.random.PRNGKey(seed), batch_fn=batch_of,
                      optimizer=optimizer(lr, steps), progress=False, desc=desc)
    return full_params(state), [h["loss"] for h in hist]


def test_scores(cfg, fwd, params, test: dict) -> dict:
    """MSE of the median, WQL and MASE on the test windows (mean-scaled)."""
    pred = np.asarray(fwd(params, test["context"]))[:, :, :cfg.prediction_length]
    levels = tuple(float(q) for q in cfg.quantiles)
    median = pred[:, levels.index(0.5)]
    return {"mse": float(mse(median, test["target"])),
            "wql": float(wql(pred, test["target"], levels)),
            "mase": float(mase(median, test["target"], test["context"]))}


def summary(values: list[dict]) -> dict:
    out = {}
    for k in values[0]:
        v = np.asarray([x[k] for x in values], np.float64)
        out[k] = {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
                  "min": float(v.min()), "max": float(v.max())}
    return out


def main(argv=None) -> dict:
    p = H.parser(__doc__, quick="2 + 1 layers, fewer pretraining and adaptation steps, 3 seeds")
    p.add_argument("--heldout", default=HELDOUT, help=f"held-out aeon dataset (default {HELDOUT})")
    p.add_argument("--seeds", type=int, default=3, help="adaptation seeds (default 3)")
    p.add_argument("--pretrain-steps", type=int, default=None, help="default 400, quick 150")
    p.add_argument("--steps", type=int, default=None,
                   help="adaptation budget S in batches (default 120, quick 60)")
    p.add_argument("--prune-steps", type=int, default=None,
                   help="pruning batches P within the budget (default S / 10)")
    p.add_argument("--target", type=float, default=0.5,
                   help="fraction of the prunable parameters removed (default 0.5)")
    p.add_argument("--lr", type=float, default=3e-4, help="fine-tuning peak learning rate")
    args = p.parse_args(argv)
    bench = H.Run(__name__, argv, quick=args.quick, heldout=args.heldout)
    cfg = demo_config(args.quick)
    pre_steps = args.pretrain_steps or (150 if args.quick else 400)
    budget = args.steps or (60 if args.quick else 120)
    prune_steps = args.prune_steps or max(budget // 10, 1)
    if not 1 <= prune_steps < budget:
        raise SystemExit(f"--prune-steps must be in [1, {budget})")
    groups, source = builtin_datasets()
    if args.heldout not in groups:
        raise SystemExit(f"--heldout must be one of {sorted(groups)}")
    pre_series = [s for name, g in groups.items() if name != args.heldout for s in g]
    held = groups[args.heldout]
    h = cfg.prediction_length
    wcfg = WindowConfig(context_length=cfg.context_length, horizon=h, stride=h)
    t5 = cfg.t5
    print(f"# Chronos-Bolt {t5.num_layers}+{t5.num_decoder_layers} layers, d_model {t5.d_model}, "
          f"{t5.num_heads} heads, d_ff {t5.d_ff}; context {cfg.context_length}, horizon {h}")
    print(f"# data: {source}; held out: {args.heldout}; adaptation budget {budget} batches of "
          f"{BATCH} ({prune_steps} pruning + {budget - prune_steps} fine-tuning for PTF), "
          f"target {args.target:.0%} of the prunable parameters, lr {args.lr:g}, "
          f"{args.seeds} seeds", flush=True)

    # 1. pretraining on the other datasets
    pre = WindowSampler(pre_series, wcfg, "train", batch_size=64, seed=0, skip_short=True)
    t0 = time.time()
    init = chronos_bolt.init(jax.random.PRNGKey(0), cfg)
    pretrained, pre_loss = train(cfg, init, pre, pre_steps, 1e-3, 0, "pretrain")
    pre_s = time.time() - t0
    print(f"  pretrained {pre_steps} steps of 64 windows ({pre.num_windows} windows) in "
          f"{pre_s:.0f} s, final loss {pre_loss[-1]:.4f}", flush=True)

    # 2. adaptation
    test_s = WindowSampler(held, wcfg, "test", batch_size=1, skip_short=True)
    test = WindowSampler(held, wcfg, "test", batch_size=test_s.num_windows,
                         skip_short=True).batch(0)
    fwd = jax.jit(lambda p, c: chronos_bolt.forecast(p, c, cfg))

    def sampler(seed, position=0):
        return WindowSampler(held, wcfg, "train", batch_size=BATCH, seed=seed, position=position,
                             skip_short=True)

    def heldout_batches(config, *, batch_size, seed):
        s = sampler(seed)

        def batches(j):
            w = s.batch(j)
            return {"context": np.asarray(w["context"]), "target": np.asarray(w["target"])}

        return batches

    register_batches(SOURCE, heldout_batches)
    zero = test_scores(cfg, fwd, pretrained, test)
    print(f"  zero-shot: test MSE {zero['mse']:.4f} WQL {zero['wql']:.4f} MASE "
          f"{zero['mase']:.4f} ({test['context'].shape[0]} test windows, "
          f"{sampler(0).num_windows} training windows)", flush=True)
    per_seed = []
    for seed in range(args.seeds):
        t0 = time.time()
        ft, ft_loss = train(cfg, pretrained, sampler(seed), budget, args.lr, seed, "fine-tune")
        ft_s = time.time() - t0
        t0 = time.time()
        step = lj.Step("prune", DEFAULT_RULES, {"target": args.target, "steps": prune_steps,
                                                "batch_size": BATCH, "data": SOURCE,
                                                "seed": seed})
        pruned, report = lj.apply_plan(pretrained, lj.Plan((step,)), config=cfg)
        info = report.steps[0].info
        prune_s = time.time() - t0
        t0 = time.time()
        ptf, ptf_loss = train(cfg, pruned, sampler(seed, position=prune_steps),
                              budget - prune_steps, args.lr, seed, "prune-then-finetune")
        ptf_s = time.time() - t0
        rec = {"seed": seed, "finetune": test_scores(cfg, fwd, ft, test),
               "pruned": test_scores(cfg, fwd, pruned, test),
               "prune_then_finetune": test_scores(cfg, fwd, ptf, test),
               "params_pretrained": lj.param_count(pretrained),
               "params_pruned": lj.param_count(pruned),
               "pruned_fraction": info.get("params_fraction"),
               "finetune_final_loss": ft_loss[-1], "ptf_final_loss": ptf_loss[-1],
               "seconds": {"finetune": ft_s, "prune": prune_s, "ptf_finetune": ptf_s}}
        per_seed.append(rec)
        print(f"  seed {seed}: fine-tune MSE {rec['finetune']['mse']:.4f} WQL "
              f"{rec['finetune']['wql']:.4f} | pruned {rec['pruned']['mse']:.4f} "
              f"{rec['pruned']['wql']:.4f} | prune-then-finetune "
              f"{rec['prune_then_finetune']['mse']:.4f} {rec['prune_then_finetune']['wql']:.4f} "
              f"(params {rec['params_pruned']}/{rec['params_pretrained']}; {ft_s:.0f} + "
              f"{prune_s:.0f} + {ptf_s:.0f} s)", flush=True)

    rows = [{"method": "zero-shot (pretrained)", "params_ratio": 1.0, "test": summary([zero])}]
    for key, name in (("finetune", "fine-tune"), ("pruned", "pruned, not fine-tuned"),
                      ("prune_then_finetune", "prune-then-finetune")):
        ratio = 1.0 if key == "finetune" else float(np.mean(
            [r["params_pruned"] / r["params_pretrained"] for r in per_seed]))
        rows.append({"method": name, "params_ratio": ratio,
                     "test": summary([r[key] for r in per_seed])})
    wins = {m: int(sum(r["prune_then_finetune"][m] < r["finetune"][m] for r in per_seed))
            for m in ("mse", "wql", "mase")}
    print(f"\n{'method':<26} {'params':>7} {'test MSE':>17} {'test WQL':>17} {'test MASE':>17}"
          f"   (mean +- std over {args.seeds} seeds)")
    for r in rows:
        t = r["test"]
        print(f"{r['method']:<26} {r['params_ratio']:>7.3f} "
              + " ".join(f"{t[m]['mean']:>9.4f} +-{t[m]['std']:.4f}" for m in ("mse", "wql", "mase")))
    print(f"# prune-then-finetune better than fine-tune (same seed): MSE {wins['mse']}/"
          f"{args.seeds}, WQL {wins['wql']}/{args.seeds}, MASE {wins['mase']}/{args.seeds}")
    bench.setup.update({
        "data": source, "pretrain_datasets": [n for n in groups if n != args.heldout],
        "model": {"encoder_layers": t5.num_layers, "decoder_layers": t5.num_decoder_layers,
                  "d_model": t5.d_model, "num_heads": t5.num_heads, "d_ff": t5.d_ff,
                  "context_length": cfg.context_length, "prediction_length": h},
        "pretrain_steps": pre_steps, "pretrain_batch": 64, "pretrain_seconds": pre_s,
        "pretrain_final_loss": pre_loss[-1], "budget": budget,
        "prune_steps": prune_steps, "batch": BATCH, "target": args.target, "lr": args.lr,
        "seeds": args.seeds, "test_windows": int(test["context"].shape[0]),
        "train_windows": sampler(0).num_windows})
    goals = {}
    for m in ("mse", "wql"):
        goals.update(H.goal(
            f"prune-then-finetune against fine-tune at the same budget: seeds with the lower "
            f"test {m.upper()}", wins[m], measured=f"{wins[m]} of {args.seeds}"))
    return bench.finish(args.json, rows=rows, goals=goals, ptf_wins=wins, per_seed=per_seed,
                        zero_shot=zero)


if __name__ == "__main__":
    H.run_as_main(__spec__)
