"""A user's own linen ViT (big_vision style), trained on scikit-learn's digits, compressed by SVD
at several ranks without touching its model code.

The model below is written as big_vision writes ``vit.py`` (patch embedding by ``nn.Conv``,
learned position embedding, ``Encoder1DBlock`` = pre-LN ``nn.MultiHeadDotProductAttention`` +
``MlpBlock``, ``encoder_norm``, ``head``), and knows nothing of lowrank_jax. After training,
``lowrank_jax.interop.linen.compress`` applies one ``svd`` plan to every kernel of the encoder
blocks (query/key/value/out projections over heads and both MLP layers) by rules over Flax's own
paths; the unchanged model runs on the factors through ``nn.intercept_methods``
(``lowrank_jax.interop.linen.apply``). For every rank: test accuracy, parameters and FLOPs of
the compressed kernels, and the forward time relative to the dense model (one jit per variant,
interleaved runs, median).

    python -m benchmarks.methods flax_vit_digits --json out.json [--quick]
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import lowrank_jax as lj
from benchmarks import _harness as H
from lowrank_jax.interop import linen as ljl

# --------------------------------------------------------------------------------------------
# The user's model (big_vision style; nothing here knows lowrank_jax).


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        x = nn.Dense(self.mlp_dim)(x)
        x = nn.gelu(x)
        return nn.Dense(d)(x)


class Encoder1DBlock(nn.Module):
    mlp_dim: int
    num_heads: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(y, y)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(mlp_dim=self.mlp_dim)(y)


class Encoder(nn.Module):
    depth: int
    mlp_dim: int
    num_heads: int

    @nn.compact
    def __call__(self, x):
        for lyr in range(self.depth):
            x = Encoder1DBlock(self.mlp_dim, self.num_heads, name=f"encoderblock_{lyr}")(x)
        return nn.LayerNorm(name="encoder_norm")(x)


class ViT(nn.Module):
    num_classes: int = 10
    patch_size: tuple = (2, 2)
    width: int = 64
    depth: int = 4
    mlp_dim: int = 256
    num_heads: int = 4

    @nn.compact
    def __call__(self, image):  # [batch, 8, 8, 1]
        x = nn.Conv(self.width, self.patch_size, strides=self.patch_size, padding="VALID",
                    name="embedding")(image)
        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])
        x = x + self.param("pos_embedding", nn.initializers.normal(stddev=1 / np.sqrt(c)),
                           (1, h * w, c), x.dtype)
        x = Encoder(self.depth, self.mlp_dim, self.num_heads, name="Transformer")(x)
        x = jnp.mean(x, axis=1)  # gap
        return nn.Dense(self.num_classes, name="head")(x)


# --------------------------------------------------------------------------------------------

RULES = (r"Transformer/encoderblock_\d+/.*kernel$",)


def data(seed: int):
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]  # [n, 8, 8, 1]
    return train_test_split(x, d.target.astype(np.int32), test_size=0.2, random_state=seed,
                            stratify=d.target)


def train(model, x, y, *, epochs: int, seed: int):
    key = jax.random.PRNGKey(seed)
    params = model.init(key, x[:2])
    steps = epochs * (len(x) // 64)
    opt = optax.adamw(optax.cosine_decay_schedule(2e-3, steps), weight_decay=1e-4)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss(p):
            logits = model.apply(p, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        val, g = jax.value_and_grad(loss)(params)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, val

    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        perm = rng.permutation(len(x))
        for i in range(len(x) // 64):
            idx = perm[i * 64:(i + 1) * 64]
            params, opt_state, val = step(params, opt_state, x[idx], y[idx])
    return params, float(val)


def finetune(model, small, x, y, *, epochs: int, seed: int):
    """A few epochs of the compressed model's own factors (lowrank_jax's jitted train step on
    the unchanged linen model; norms, embeddings and the head stay frozen, bit-identical)."""
    from lowrank_jax.interop import leaf_mask
    from lowrank_jax.train import TrainState, make_train_step

    def loss_fn(params, batch, key):
        logits = ljl.apply(model, params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

    opt = optax.adam(1e-3)
    train_part, frozen = lj.partition(small, leaf_mask(small))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=train_part, frozen=frozen,
                       opt_state=opt.init(train_part), rng=jax.random.PRNGKey(seed),
                       data_position=jnp.zeros((), jnp.int32), model_state=None)
    step = make_train_step(loss_fn, opt, donate=False)  # small stays usable
    rng = np.random.default_rng(seed + 1)
    for _ in range(epochs):
        perm = rng.permutation(len(x))
        for i in range(len(x) // 64):
            idx = perm[i * 64:(i + 1) * 64]
            state, _ = step(state, {"x": x[idx], "y": y[idx]})
    return lj.combine(state.params, state.frozen)


def accuracy(fn, params, x, y) -> float:
    return float((np.asarray(fn(params, x)).argmax(-1) == y).mean())


TABLE = H.Table(
    H.Col("variant", "variant", width=9), H.Col("acc", "test_accuracy", ".3f", 6),
    H.Col("ft acc", lambda r: r.get("test_accuracy_finetuned", r["test_accuracy"]), ".3f"),
    H.Col("params", lambda r: r.get("params_ratio", 1), ".3f", 7),
    H.Col("flops", lambda r: r.get("flops_ratio", 1), ".3f", 7),
    H.Col("time", "time_ratio", ".3f", 6), H.Col("ms", "forward_ms", ".2f", 8))


def main(argv=None) -> dict:
    ap = H.parser(__doc__, quick="fewer epochs, ranks and timing reps", json_required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = ViT()
    epochs = 6 if args.quick else 30
    ranks = (8, 32) if args.quick else (4, 8, 16, 32, 64)
    reps = 7 if args.quick else 21
    ft_epochs = 1 if args.quick else 3
    run = H.Run(__name__, argv, epochs=epochs, ranks=list(ranks), timing_reps=reps,
                finetune_epochs=ft_epochs, seed=args.seed)
    xtr, xte, ytr, yte = data(args.seed)
    t0 = time.perf_counter()
    params, last_loss = train(model, xtr, ytr, epochs=epochs, seed=args.seed)
    train_s = time.perf_counter() - t0

    dense_fn = jax.jit(model.apply)
    leaf_fn = jax.jit(lambda v, x: ljl.apply(model, v, x))  # traced inside the interceptor
    xbig = jnp.asarray(xte)  # 360 images per timed call
    variants = {"dense": (dense_fn, params, None)}
    for r in ranks:
        plan = lj.Plan((lj.Step("svd", RULES, {"rank": r, "keep_dense_if_larger": False}),))
        small, report = ljl.compress(params, plan)
        variants[f"rank {r}"] = (leaf_fn, small, report)

    rows = []
    for name, (fn, p, report) in variants.items():
        fn(p, xbig).block_until_ready()  # compile
        row = {"variant": name, "test_accuracy": accuracy(fn, p, xte, yte)}
        if report is not None:
            row.update(rank=int(name.split()[1]), params_ratio=report.selected["params_ratio"],
                       flops_ratio=report.selected["flops_ratio"],
                       model_params_ratio=report.tree["params_ratio"],
                       svd_error_max=max(r.error for r in report.rows))
            # independent check: the unchanged model on the materialized weights agrees
            tuned = finetune(model, p, xtr, ytr, epochs=ft_epochs, seed=args.seed)
            row["test_accuracy_finetuned"] = accuracy(fn, tuned, xte, yte)
            row["max_abs_vs_materialized"] = float(np.abs(
                np.asarray(fn(p, xte)) - np.asarray(dense_fn(ljl.materialize(p), xte))).max())
        rows.append(row)

    m = H.measure({k: (lambda fn=fn, p=p: fn(p, xbig)) for k, (fn, p, _) in variants.items()},
                  runs=reps, warmup=0)  # every variant once per round; compiled above
    for row in rows:
        row["forward_ms"] = m.ms(row["variant"])
        row["time_ratio"] = m.ratio(row["variant"], "dense")

    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    goals = {}
    for r in rows[1:]:
        goals.update(H.goal(
            f"linen ViT on digits, encoder kernels SVD rank {r['rank']}: test accuracy after a "
            "short fine-tune minus dense", r["test_accuracy_finetuned"] - rows[0]["test_accuracy"],
            measured=f"{r['test_accuracy_finetuned']:.3f} vs dense {rows[0]['test_accuracy']:.3f}; "
                     f"time ratio {r['time_ratio']:.3f}, FLOP ratio {r['flops_ratio']:.3f}"))
    return run.finish(args.json, rows=rows, goals=goals, model={
        "width": model.width, "depth": model.depth, "mlp_dim": model.mlp_dim,
        "num_heads": model.num_heads, "patch": list(model.patch_size),
        "params": lj.param_count(params)}, rules=list(RULES), train_seconds=train_s,
        last_train_loss=last_loss, n_test=int(len(yte)), timed_batch=int(len(xbig)),
        loop_other_load=m.load)


if __name__ == "__main__":
    H.run_as_main(__spec__)
