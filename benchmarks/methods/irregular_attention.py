"""TruncAtt, CP-SlimAtt and IrrAtt at the same FLOPs target on a small ViT trained on digits.

"Vision Transformer with Irregular Attention" at CPU scale: a 4-layer ViT (8 x 8 images, patch
2, 17 tokens, d_model 64, 4 heads of 16, MLP 128) is trained on scikit-learn's digits (1797
images shipped with scikit-learn; 1437 for training, 360 held out, stratified) with the
library's train step (``lowrank_jax.train.make_train_step``, AdamW). Its query-key tensors are
then compressed by the ``truncatt``, ``cp`` and ``btd`` plan methods at the same target: the
largest rank whose attention-block multiply-adds (the paper's formulas, ``N = 17`` tokens,
value-output side unchanged) stay within ``--flops-ratio`` of the dense block. Each compressed
model is evaluated on the held-out images before and after a short fine-tune with the same
train step (the factors and fusion matrices train). Everything is repeated for ``--seeds``
seeds (initialisation, data order, split).

Reported per seed and method: the ranks chosen (per layer and head), the paper's MHSA FLOPs
ratio, the executed MACs ratio of the attention blocks (zero-padded irregular ranks and the
fusion counted as executed), the query-key parameter ratio, the relative error of the
decomposed query-key tensors (mean over layers), and the test accuracy of the dense model, of
the compressed model before and after fine-tuning. At this scale the differences between the
methods are of the order of the seed-to-seed spread: treat the accuracies as a smoke test of the
pipeline, not a reproduction of the paper's ImageNet numbers.

Usage::

    python -m benchmarks.methods irregular_attention --json out.json   # 3 seeds
    python -m benchmarks.methods irregular_attention --quick           # 1 seed, short training
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowrank_jax as lj
from benchmarks import _harness as H
from lowrank_jax import nn, train
from lowrank_jax.compress import ATTENTION_QK
from lowrank_jax.models import ViTConfig, vit

METHODS = ("truncatt", "cp", "btd")
N_TOKENS = 17


def digits(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.images.astype(np.float32) / 16.0 - 0.3) / 0.4  # [n, 8, 8], roughly standardized
    x_tr, x_te, y_tr, y_te = train_test_split(x[:, None], data.target, test_size=360,
                                              stratify=data.target, random_state=seed)
    return (x_tr, y_tr.astype(np.int32)), (x_te, y_te.astype(np.int32))


CFG = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, intermediate_size=128, num_labels=10)


def fit(params, data, *, epochs: int, lr: float, seed: int, batch: int = 64):
    """``epochs`` passes of AdamW (cosine decay) with the library's jitted train step."""
    x, y = data
    steps_per_epoch = len(x) // batch
    total = max(1, epochs * steps_per_epoch)
    opt = optax.adamw(optax.cosine_decay_schedule(lr, total), weight_decay=1e-4)
    step = train.make_train_step(vit.loss(CFG), opt)
    state = train.init_train_state(params, opt, key=jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for i in range(steps_per_epoch):
            idx = order[i * batch:(i + 1) * batch]
            state, _ = step(state, {"pixel_values": jnp.asarray(x[idx]),
                                    "labels": jnp.asarray(y[idx])})
    return train.full_params(state)


def accuracy(params, data) -> float:
    x, y = data
    logits = jax.jit(lambda p, xx: vit.apply(p, {"pixel_values": xx}, CFG)["logits"])(
        params, jnp.asarray(x))
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


def attention_macs_executed(params) -> int:
    """Executed multiply-adds of every attention block on N_TOKENS tokens."""
    total = 0
    for layer in params["encoder"]["layers"]:
        block = layer["attn"]
        total += lj.flops(block, N_TOKENS) + nn.attention_score_flops(block, N_TOKENS, N_TOKENS)
    return int(total)


def qk_params(params) -> int:
    return sum(lj.param_count(layer["attn"]["qk"]) for layer in params["encoder"]["layers"])


def run_seeds(seeds, *, flops_ratio: float, epochs: int, ft_epochs: int, lr: float, ft_lr: float):
    rows = []
    for seed in seeds:
        tr, te = digits(seed)
        t0 = time.perf_counter()
        dense = fit(vit.init(jax.random.PRNGKey(seed), CFG), tr, epochs=epochs, lr=lr, seed=seed)
        t_train = time.perf_counter() - t0
        acc_dense = accuracy(dense, te)
        base_macs, base_qk = attention_macs_executed(dense), qk_params(dense)
        print(f"seed {seed}: dense accuracy {acc_dense:.4f} ({t_train:.0f} s training)",
              flush=True)
        for method in METHODS:
            t0 = time.perf_counter()
            plan = lj.Plan((lj.Step(method, ATTENTION_QK, {"flops_ratio": flops_ratio,
                                                           "n_tokens": N_TOKENS}),))
            small, report = lj.apply_plan(dense, plan, key=jax.random.PRNGKey(seed))
            t_compress = time.perf_counter() - t0
            acc0 = accuracy(small, te)
            tuned = fit(small, tr, epochs=ft_epochs, lr=ft_lr, seed=seed + 1000)
            acc1 = accuracy(tuned, te)
            qk_rows = list(report.rows)
            rows.append({
                "seed": seed, "method": method, "target_flops_ratio": flops_ratio,
                "ranks": {r.path: r.details["head_ranks"] for r in qk_rows},
                "total_rank": [int(sum(r.details["head_ranks"])) if method != "cp"
                               else int(r.details["rank"]) for r in qk_rows],
                "mhsa_flops_ratio": float(np.mean([r.details["mhsa_flops_ratio"]
                                                   for r in qk_rows])),
                "executed_flops_ratio": attention_macs_executed(small) / base_macs,
                "qk_params_ratio": qk_params(small) / base_qk,
                "tensor_error": float(np.mean([r.error for r in qk_rows])),
                "acc_dense": acc_dense, "acc_before_ft": acc0, "acc_after_ft": acc1,
                "seconds_compress": t_compress, "seconds_train_dense": t_train,
            })
            r = rows[-1]
            print(f"  {method:8} ranks {r['total_rank']} MHSA {r['mhsa_flops_ratio']:.3f} "
                  f"executed {r['executed_flops_ratio']:.3f} err {r['tensor_error']:.3f} "
                  f"acc {acc0:.4f} -> {acc1:.4f} (dense {acc_dense:.4f})", flush=True)
    return rows


def summarize(rows):
    out = {}
    for method in METHODS:
        rs = [r for r in rows if r["method"] == method]
        if not rs:
            continue
        s = {}
        for key in ("mhsa_flops_ratio", "executed_flops_ratio", "qk_params_ratio", "tensor_error",
                    "acc_dense", "acc_before_ft", "acc_after_ft"):
            vals = [r[key] for r in rs]
            s[key] = statistics.mean(vals)
            s[key + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        out[method] = s
    return out


TABLE = H.Table(
    H.Col("method", "method", width=9), H.Col("MHSA", "mhsa_flops_ratio", ".3f", 6),
    H.Col("exec", "executed_flops_ratio", ".3f", 6), H.Col("QK par", "qk_params_ratio", ".3f"),
    H.Col("err", "tensor_error", ".3f", 6), H.Col("dense", "acc_dense", ".4f", 7),
    H.Col("before", "acc_before_ft", ".4f", 7), H.Col("after", "acc_after_ft", ".4f", 7),
    H.Col("+- before/after", lambda s: f"{s['acc_before_ft_std']:.4f} / "
          f"{s['acc_after_ft_std']:.4f}"))


def main(argv=None) -> dict:
    ap = H.parser(__doc__, quick="1 seed, 6 + 1 epochs")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--flops-ratio", type=float, default=0.6,
                    help="target attention-block MACs ratio (paper's formulas, N = 17)")
    ap.add_argument("--epochs", type=int, default=15,
                    help="dense training epochs (15: the 3 seeds fit in about 12 minutes on a busy "
                    "2-core machine; 30 gives about 1 point more dense accuracy)")
    ap.add_argument("--ft-epochs", type=int, default=3, help="fine-tuning epochs")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ft-lr", type=float, default=5e-4)
    args = ap.parse_args(argv)
    seeds, epochs, ft = (([0], 6, 1) if args.quick else (args.seeds, args.epochs, args.ft_epochs))
    run = H.Run(__name__, argv, seeds=seeds, epochs=epochs, ft_epochs=ft,
                flops_ratio=args.flops_ratio, n_tokens=N_TOKENS,
                config=dataclasses.asdict(CFG))
    t0 = time.perf_counter()
    rows = run_seeds(seeds, flops_ratio=args.flops_ratio, epochs=epochs, ft_epochs=ft,
                     lr=args.lr, ft_lr=args.ft_lr)
    wall = time.perf_counter() - t0
    summary = summarize(rows)
    print(f"\n# means over {len(seeds)} seeds, +- std of the accuracies before / after")
    print(TABLE.header())
    for m, s in summary.items():
        print(TABLE.line({"method": m, **s}))
    goals = {}
    for m, s in summary.items():
        goals.update(H.goal(
            f"{m} at attention FLOPs ratio {args.flops_ratio:g} on a digits ViT: test accuracy "
            "after fine-tuning minus dense (mean over seeds)", s["acc_after_ft"] - s["acc_dense"],
            measured=f"{s['acc_after_ft']:.4f} vs dense {s['acc_dense']:.4f} (before "
                     f"fine-tuning {s['acc_before_ft']:.4f}; executed FLOPs ratio "
                     f"{s['executed_flops_ratio']:.3f})"))
    return run.finish(args.json, rows=rows, goals=goals, summary=summary, wall_seconds=wall)


if __name__ == "__main__":
    H.run_as_main(__spec__)
