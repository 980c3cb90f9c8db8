# ruff: noqa: E402  (a notebook: imports follow the install cell; see colab/_build.py)
# %% [markdown]
# # Compress your own Flax model without rewriting it
#
# Paper: *Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
# Compressibility* (Yu et al., ICLR 2026, arXiv:2510.03358): truncated SVD of the weights, kept
# as factors (eq. 19), applied here to a model that knows nothing of lowrank_jax.
#
# Many models are already written in Flax. `lowrank_jax.interop` applies a compression plan to
# a linen model's own parameter tree, by rules over Flax's own parameter paths, and runs the
# **unchanged** model code on the compressed leaves: through `nn.intercept_methods`, every
# `nn.Dense` / `nn.DenseGeneral` (so also the projections inside
# `nn.MultiHeadDotProductAttention`) whose kernel became a leaf calls lowrank_jax's `linear`.
#
# The worked example: a small ViT written the way big_vision writes one, trained on
# scikit-learn's 8x8 digits, every kernel of its encoder blocks truncated by SVD at several
# ranks. For each rank: test accuracy, kernel parameters and FLOPs, and the measured forward
# time against the dense model.
#
# `FULL = False`: 2 encoder blocks, 6 epochs, ranks 4, 16 and 64 (under a minute on a CPU);
# `FULL = True`: 4 blocks, 30 epochs, ranks 4-64 and a 3-epoch fine-tune of the factors
# (`benchmarks/methods/flax_vit_digits.py`).

# %%
# Colab only: install lowrank_jax (with matplotlib and aeon's data sets).
import subprocess
import sys

REPO = "https://github.com/lowrank-jax/lowrank_jax"  # the project's repository
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    f"lowrank-jax[plot,data] @ git+{REPO}"], check=True)

# %%
import os

# False: small CPU settings (under a minute); True: full size (use a Colab GPU/TPU).
FULL = False
FULL = FULL or os.environ.get("LOWRANK_JAX_FULL") == "1"

# %%
import io
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from IPython.display import Image, display
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from threadpoolctl import threadpool_limits

import lowrank_jax as lj
from lowrank_jax.interop import leaf_mask
from lowrank_jax.interop import linen as ljl
from lowrank_jax.train import TrainState, make_train_step

_ = threadpool_limits(1, user_api="blas")   # small host SVDs: one BLAS thread, no fight with XLA


def show(fig):
    """Show a matplotlib figure inline as a PNG and close it. (lowrank_jax's plot helpers select
    matplotlib's file backend, Agg, which turns off Jupyter's inline figures.)"""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    display(Image(buf.getvalue()))

# %% [markdown]
# ## The user's model
#
# Plain Flax, in big_vision's style: patch embedding by `nn.Conv`, a learned position
# embedding, pre-LayerNorm encoder blocks of `nn.MultiHeadDotProductAttention` and an MLP,
# global average pooling, a linear head. Nothing here refers to lowrank_jax.

# %%
class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        return nn.Dense(d)(nn.gelu(nn.Dense(self.mlp_dim)(x)))


class Encoder1DBlock(nn.Module):
    mlp_dim: int
    num_heads: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(y, y)
        return x + MlpBlock(self.mlp_dim)(nn.LayerNorm()(x))


class ViT(nn.Module):
    num_classes: int = 10
    width: int = 64
    depth: int = 4
    mlp_dim: int = 256
    num_heads: int = 4

    @nn.compact
    def __call__(self, image):                      # [batch, 8, 8, 1]
        x = nn.Conv(self.width, (2, 2), strides=(2, 2), padding="VALID", name="embedding")(image)
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        x = x + self.param("pos_embedding", nn.initializers.normal(stddev=c ** -0.5), (1, h * w, c))
        for i in range(self.depth):
            x = Encoder1DBlock(self.mlp_dim, self.num_heads, name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(self.num_classes, name="head")(x.mean(axis=1))


model = ViT(depth=4 if FULL else 2)

# %% [markdown]
# ## Train it, the Flax way

# %%
digits = load_digits()
images = (digits.images / 16.0).astype(np.float32)[..., None]      # [1797, 8, 8, 1]
x_train, x_test, y_train, y_test = train_test_split(
    images, digits.target.astype(np.int32), test_size=0.2, random_state=0, stratify=digits.target)
epochs, batch = (30 if FULL else 6), 64
steps = epochs * (len(x_train) // batch)
variables = model.init(jax.random.PRNGKey(0), x_train[:2])
opt = optax.adamw(optax.cosine_decay_schedule(2e-3, steps), weight_decay=1e-4)
opt_state = opt.init(variables)


@jax.jit
def train_step(variables, opt_state, xb, yb):
    def loss(v):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, xb), yb).mean()

    grads = jax.grad(loss)(variables)
    updates, opt_state = opt.update(grads, opt_state, variables)
    return optax.apply_updates(variables, updates), opt_state


rng = np.random.default_rng(0)
for _ in range(epochs):
    perm = rng.permutation(len(x_train))
    for i in range(len(x_train) // batch):
        idx = perm[i * batch:(i + 1) * batch]
        variables, opt_state = train_step(variables, opt_state, x_train[idx], y_train[idx])
dense_forward = jax.jit(model.apply)
print(f"{lj.param_count(variables)} parameters; test accuracy "
      f"{np.mean(np.asarray(dense_forward(variables, x_test)).argmax(-1) == y_test):.3f}")

# %% [markdown]
# ## Compress it with a plan over Flax's own paths
#
# One `svd` step whose rule matches every kernel of the encoder blocks
# (`params/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel`, ...,
# `.../MlpBlock_0/Dense_1/kernel`). Attention kernels over heads, `[64, 4, 16]`, are treated as
# `[64, 64]` matrices. `keep_dense_if_larger=False` keeps the factors even at full rank 64,
# where they outnumber the dense kernel (same accuracy, more work: a useful reference point).

# %%
RULES = (r"encoderblock_\d+/.*kernel$",)
ranks = (4, 8, 16, 32, 64) if FULL else (4, 16, 64)
small = {}
for r in ranks:
    plan = lj.Plan((lj.Step("svd", RULES, {"rank": r, "keep_dense_if_larger": False}),))
    small[r] = ljl.compress(variables, plan)            # (tree, report)
tree, report = small[ranks[0]]
print(report.format_table().splitlines()[0])
print("\n".join(report.format_table().splitlines()[2:5]), "\n...")

leaf_forward = jax.jit(lambda v, x: ljl.apply(model, v, x))   # the unchanged model on the leaves
# independent check: the same model run by Flax on the materialized (multiplied-out) weights
y_leaves = np.asarray(leaf_forward(tree, x_test))
y_flax = np.asarray(dense_forward(ljl.materialize(tree), x_test))
print(f"max |leaves - materialized|: {np.abs(y_leaves - y_flax).max():.2e}")
assert np.abs(y_leaves - y_flax).max() < 1e-4

# %% [markdown]
# ## Accuracy and measured speed against the dense model
#
# Forward time on the test images: one jit per variant, interleaved runs, median. At this width
# the projections are a small part of the forward (LayerNorm, softmax, GELU and dispatch are
# not compressed), so time falls much less than FLOPs.

# %%
variants = {"dense": (dense_forward, variables)}
variants.update({f"rank {r}": (leaf_forward, small[r][0]) for r in ranks})
xb = jnp.asarray(x_test)
times = {name: [] for name in variants}
for fn, v in variants.values():
    fn(v, xb).block_until_ready()                       # compile
for _ in range(21 if FULL else 7):
    for name, (fn, v) in variants.items():              # interleaved: noise hits all alike
        t0 = time.perf_counter()
        fn(v, xb).block_until_ready()
        times[name].append(time.perf_counter() - t0)
rows = []
for name, (fn, v) in variants.items():
    rep = small[int(name.split()[1])][1] if name != "dense" else None
    rows.append({"variant": name,
                 "accuracy": float(np.mean(np.asarray(fn(v, xb)).argmax(-1) == y_test)),
                 "params": rep.selected["params_ratio"] if rep else 1.0,
                 "flops": rep.selected["flops_ratio"] if rep else 1.0,
                 "time": np.median(times[name]) / np.median(times["dense"]),
                 "ms": 1e3 * np.median(times[name])})
print(f"{'variant':>8} {'accuracy':>8} {'kernel params':>13} {'kernel FLOPs':>12} {'time':>6} {'ms':>7}")
for r in rows:
    print(f"{r['variant']:>8} {r['accuracy']:>8.3f} {r['params']:>13.3f} {r['flops']:>12.3f} "
          f"{r['time']:>6.2f} {r['ms']:>7.2f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
lowrank = rows[1:]
ax1.plot([r["flops"] for r in lowrank], [r["accuracy"] for r in lowrank], "o-", label="SVD rank r")
for r in lowrank:
    ax1.annotate(r["variant"], (r["flops"], r["accuracy"]), fontsize=7, xytext=(3, -10),
                 textcoords="offset points")
ax1.axhline(rows[0]["accuracy"], color="gray", ls=":", label="dense")
ax1.set(xlabel="kernel FLOPs relative to dense", ylabel="test accuracy")
ax1.legend(fontsize=8)
ax2.bar([r["variant"] for r in rows], [r["time"] for r in rows], color="tab:blue")
ax2.axhline(1.0, color="gray", ls=":")
ax2.set(ylabel="forward time relative to dense", title="measured (median)")
fig.tight_layout()
show(fig)
acc = {r["variant"]: r["accuracy"] for r in rows}
assert acc["rank 64"] == acc["dense"]                 # full rank: the same model
assert acc[f"rank {ranks[0]}"] < acc[f"rank {ranks[-2]}"] <= acc["rank 64"] + 0.02

# %% [markdown]
# ## Prune heads and MLP channels
#
# A Flax model does not say which kernels share channels; `infer_groups` reads the common
# patterns from the parameter tree (the heads of every `MultiHeadDotProductAttention`, the
# hidden channels of every `MlpBlock`, its first layer the one the model calls first; print
# them to check). The scores are "Less is More"
# eq. 6 (per-sample mask gradients through our own loss, on four training batches); one global
# ranking removes a quarter of the grouped parameters, and the unchanged model runs on the
# kept channels.

# %%
groups = ljl.infer_groups(variables, model, x_test[:1])  # call order from an abstract run
for g in groups[:2]:
    print(f"{g.name} ({g.unit}): outputs of {len(g.outputs)} kernel(s), inputs of {len(g.inputs)}")
print(f"... {len(groups)} groups")


def xent(v, b):                                          # the user's loss, plain Flax arrays
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, b["x"]), b["y"]).mean()


batches = [{"x": x_train[i:i + 64], "y": y_train[i:i + 64]} for i in range(0, 256, 64)]
scores = ljl.gradient_scores(xent, variables, groups, batches)
pruned, prune_report = ljl.prune(variables, groups, target=0.25, scores=scores, scope="global")
kept = {g: v["kept"] for g, v in prune_report.steps[0].info["groups"].items()}
y_pruned = np.asarray(leaf_forward(pruned, xb))
print(f"removed {1 - prune_report.selected['params_ratio']:.0%} of the grouped kernels' "
      f"parameters; kept units per group: {list(kept.values())}")
print(f"test accuracy {np.mean(y_pruned.argmax(-1) == y_test):.3f} (dense {acc['dense']:.3f})")
assert np.abs(y_pruned - np.asarray(dense_forward(ljl.materialize(pruned), xb))).max() < 1e-4

# %% [markdown]
# ## Fine-tune the factors (`FULL = True`)
#
# The compressed tree goes to lowrank_jax's train step as it is; `leaf_mask` trains only the
# factors, and everything else (norms, embeddings, the head) comes out bit-identical. With the
# full settings a 3-epoch fine-tune brings rank 16 from 0.59 back to 0.93 (dense 0.956).

# %%
if FULL:
    def loss_fn(params, batch, key):
        logits = ljl.apply(model, params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

    for r in ranks:
        trainable, frozen = lj.partition(small[r][0], leaf_mask(small[r][0]))
        ft_opt = optax.adam(1e-3)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=trainable, frozen=frozen,
                           opt_state=ft_opt.init(trainable), rng=jax.random.PRNGKey(1),
                           data_position=jnp.zeros((), jnp.int32), model_state=None)
        ft_step = make_train_step(loss_fn, ft_opt, donate=False)
        for _ in range(3):
            perm = rng.permutation(len(x_train))
            for i in range(len(x_train) // batch):
                idx = perm[i * batch:(i + 1) * batch]
                state, _ = ft_step(state, {"x": x_train[idx], "y": y_train[idx]})
        tuned = lj.combine(state.params, state.frozen)
        print(f"rank {r}: accuracy {acc[f'rank {r}']:.3f} -> "
              f"{np.mean(np.asarray(leaf_forward(tuned, xb)).argmax(-1) == y_test):.3f} after fine-tuning")
else:
    print("set FULL = True to fine-tune the factors")
