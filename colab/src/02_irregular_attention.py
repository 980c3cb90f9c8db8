# ruff: noqa: E402  (a notebook: imports follow the install cell; see colab/_build.py)
# %% [markdown]
# # Irregular attention: TruncAtt, CP-SlimAtt and IrrAtt (BTD) at the same FLOPs
#
# Paper: *Vision Transformer with Irregular Attention* (anonymous ICLR 2024 submission,
# OpenReview xVoj8AtyQ1; no arXiv version).
#
# Head `h` of an attention block scores tokens with `X Y_h X^T`, where `Y_h = W^Q_h (W^K_h)^T`
# is one slice of the *query-key tensor* `Y: [F, F, H]`. The paper compresses that tensor as a
# whole, three ways, and picks each method's rank so that the block's multiply-adds stay within
# a target fraction of the dense block's (sec. 3.4):
#
# * **TruncAtt**: a truncated SVD of every slice, the same rank for every head;
# * **CP-SlimAtt**: a rank-`R` CP decomposition shared by all heads (eqs. 3-4);
# * **IrrAtt**: a BTD-(L,L,1) with one term per head, so that heads get *different* ranks
#   (eqs. 5-6, Algorithms 1-3).
#
# This notebook trains a small ViT on scikit-learn's 8x8 digits, compresses its query-key
# tensors with the three plan methods (`truncatt`, `cp`, `btd`), draws the ranks chosen per
# head as a heat map and accuracy against FLOPs, and fine-tunes the compressed models a little.
#
# `FULL = False`: a 2-layer ViT (`d_model` 64, 4 heads), 8 epochs, one FLOPs target for CP and
# IrrAtt, one fine-tuning epoch of IrrAtt (under a minute on a CPU). `FULL = True`: 4 layers,
# 30 epochs, every method at every target and 3 fine-tuning epochs of each
# (`benchmarks/methods/irregular_attention.py` runs it over 3 seeds). This is the pipeline at toy
# scale, not the paper's ImageNet DeiT results: at this size the methods differ by about the
# seed-to-seed spread.

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
from lowrank_jax import train
from lowrank_jax.analysis.plots_heads import plot_head_ranks
from lowrank_jax.compress import ATTENTION_QK, head_ranks
from lowrank_jax.models import ViTConfig, vit

_ = threadpool_limits(1, user_api="blas")   # small host SVDs: one BLAS thread, no fight with XLA


def show(fig):
    """Show a matplotlib figure inline as a PNG and close it. (lowrank_jax's plot helpers select
    matplotlib's file backend, Agg, which turns off Jupyter's inline figures.)"""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    display(Image(buf.getvalue()))

# %% [markdown]
# ## A ViT trained on digits
#
# The library's ViT (`lowrank_jax.models.vit`, the Hugging Face ViT's layout) on 8x8 images cut
# into 2x2 patches: 16 patch tokens plus the class token, `N = 17`. 1437 images train, 360 are
# held out. Training uses the library's jitted train step.

# %%
digits = load_digits()
images = (digits.images.astype(np.float32) / 16.0 - 0.3) / 0.4      # [1797, 8, 8]
x_train, x_test, y_train, y_test = train_test_split(
    images[:, None], digits.target.astype(np.int32), test_size=360, stratify=digits.target,
    random_state=0)
N_TOKENS = 17
cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64,
                num_hidden_layers=4 if FULL else 2, num_attention_heads=4, intermediate_size=128,
                num_labels=10)


def fit(params, *, epochs, lr, seed=0, batch=64):
    """AdamW with cosine decay, the library's train step (trains whatever leaves it is given)."""
    steps_per_epoch = len(x_train) // batch
    opt = optax.adamw(optax.cosine_decay_schedule(lr, epochs * steps_per_epoch), weight_decay=1e-4)
    step = train.make_train_step(vit.loss(cfg), opt)
    state = train.init_train_state(params, opt, key=jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for i in range(steps_per_epoch):
            idx = order[i * batch:(i + 1) * batch]
            state, _ = step(state, {"pixel_values": jnp.asarray(x_train[idx]),
                                    "labels": jnp.asarray(y_train[idx])})
    return train.full_params(state)


logits_of = jax.jit(lambda p, x: vit.apply(p, {"pixel_values": x}, cfg)["logits"])


def accuracy(params):
    return float(np.mean(np.asarray(logits_of(params, jnp.asarray(x_test))).argmax(-1) == y_test))


dense = fit(vit.init(jax.random.PRNGKey(0), cfg), epochs=30 if FULL else 8, lr=3e-3)
acc_dense = accuracy(dense)
print(f"dense ViT: {lj.param_count(dense)} parameters, test accuracy {acc_dense:.3f}")

# %% [markdown]
# ## Compress the query-key tensors at the same FLOPs
#
# One plan step per method; `flops_ratio` with `n_tokens` picks the largest rank whose block
# multiply-adds, counted with the paper's formulas (`N^2` terms and IrrAtt's head fusion
# included), stay within the target. The value-output side is left dense, so even rank 0
# costs about half the block: targets below ~0.55 are out of reach at this width.

# %%
targets = (0.6, 0.7, 0.8, 0.9) if FULL else (0.6, 0.75, 0.9)
results = {}   # (method, target) -> compressed params, report
for method in ("truncatt", "cp", "btd"):
    for target in (targets if FULL or method == "truncatt" else targets[:1]):
        plan = lj.Plan((lj.Step(method, ATTENTION_QK, {"flops_ratio": target, "n_tokens": N_TOKENS}),))
        results[method, target] = lj.apply_plan(dense, plan, key=jax.random.PRNGKey(0))

rows = []
for (method, target), (small, report) in results.items():
    qk_rows = [r for r in report.rows if r.kind == method]
    rows.append({"method": method, "target": target, "accuracy": accuracy(small),
                 "mhsa_flops": float(np.mean([r.details["mhsa_flops_ratio"] for r in qk_rows])),
                 "qk_params": sum(r.params_after for r in qk_rows) / sum(r.params_before for r in qk_rows),
                 "tensor_error": float(np.mean([r.error for r in qk_rows])),
                 "ranks": head_ranks(report)})
print(f"{'method':<9} {'target':>6} {'MHSA FLOPs':>10} {'QK params':>9} {'tensor err':>10} {'accuracy':>8}")
for r in rows:
    print(f"{r['method']:<9} {r['target']:>6.2f} {r['mhsa_flops']:>10.3f} {r['qk_params']:>9.3f} "
          f"{r['tensor_error']:>10.3f} {r['accuracy']:>8.3f}")
for r in rows:
    assert r["mhsa_flops"] <= r["target"] + 1e-9, r   # every method stays within its target
trunc = [r["accuracy"] for r in rows if r["method"] == "truncatt"]
assert trunc[-1] > trunc[0], trunc   # more FLOPs, more accuracy

# %% [markdown]
# ## Ranks per head
#
# TruncAtt gives every head the same rank. CP-SlimAtt shares its rank-1 terms between heads
# (a term is counted for the head where its fusion weight is largest), and IrrAtt lets the BTD
# decide how much of the total rank each head gets: the "irregular" ranks, one row per block.

# %%
heat = {f"{method} {path.removesuffix('/attn/qk')}": ranks
        for (method, target), (_, report) in results.items() if target == 0.6
        for path, ranks in head_ranks(report).items()}
fig = plot_head_ranks(heat, title="query-key rank per head at 0.6 of the FLOPs")
show(fig)
for (method, _target), (_, report) in results.items():
    if method == "btd":   # IrrAtt's ranks add up to the total rank its FLOPs budget allows
        for r in report.rows:
            assert sum(r.details["head_ranks"]) == r.details["rank_total"]

# %% [markdown]
# ## Accuracy against FLOPs, and a short fine-tune
#
# Without fine-tuning every method loses accuracy at 0.6 of the FLOPs; a short fine-tune of the
# factors (the same train step: CP/BTD factors and fusion matrices are ordinary leaves) brings
# most of it back. With the small settings only IrrAtt is fine-tuned (each method's factors are
# a new program to compile); `FULL = True` fine-tunes all three for 3 epochs.

# %%
tuned = {}
for method in ("truncatt", "cp", "btd") if FULL else ("btd",):   # small: IrrAtt only
    small, _ = results[method, 0.6]
    tuned[method] = accuracy(fit(small, epochs=3 if FULL else 1, lr=5e-4, seed=1))
    print(f"{method:<9} at 0.6 of the FLOPs: accuracy {accuracy(small):.3f} -> {tuned[method]:.3f} "
          f"after fine-tuning (dense {acc_dense:.3f})")

fig, ax = plt.subplots(figsize=(6, 4))
for method, marker in (("truncatt", "o-"), ("cp", "s-"), ("btd", "^-")):
    rs = [r for r in rows if r["method"] == method]
    ax.plot([r["mhsa_flops"] for r in rs], [r["accuracy"] for r in rs], marker, label=method)
    if method in tuned:
        ax.scatter([rs[0]["mhsa_flops"]], [tuned[method]], marker=marker[0], s=90,
                   facecolors="none", edgecolors="k")
ax.axhline(acc_dense, color="gray", ls=":", label="dense")
ax.set(xlabel="attention FLOPs relative to dense (paper's formulas)", ylabel="test accuracy",
       title="accuracy vs FLOPs (open markers: after fine-tuning)")
ax.legend(fontsize=8)
show(fig)
for method, acc in tuned.items():
    before = results[method, 0.6]
    assert acc > accuracy(before[0]) and acc > acc_dense - 0.05, (method, acc)
