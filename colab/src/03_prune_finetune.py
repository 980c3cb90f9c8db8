# ruff: noqa: E402  (a notebook: imports follow the install cell; see colab/_build.py)
# %% [markdown]
# # Structured pruning, then fine-tuning, of a time-series forecaster
#
# Paper: *Less is More: Unlocking Specialization of Time Series Foundation Models via
# Structured Pruning* (Zhao et al., NeurIPS 2025, arXiv:2505.23195).
#
# The paper adapts a pretrained forecaster to a new dataset by first *pruning* it on that data
# and then fine-tuning what is left, instead of fine-tuning everything. Every attention and MLP
# projection gets input and output channel masks (eq. 4); a channel's importance is a
# second-order Taylor estimate with the Fisher information (eqs. 5-6), smoothed over batches;
# Algorithm 1 removes the least important channels globally, across layers, until a target
# fraction of the parameters is gone. lowrank_jax then removes them **physically** (fewer
# heads, narrower projections and MLPs), so the pruned model is smaller and faster.
#
# Here: a small Chronos-Bolt is pretrained on the real series shipped with `aeon` except one
# held-out dataset (household electric devices), then adapted to it with the same budget of
# batches two ways, fine-tune only vs prune-then-fine-tune, and both are tested on the held-out
# series' last 20 %. We plot the pruned fraction of every weight's input and output channels per
# layer (the paper's Fig. 6) and the test accuracy of both arms.
#
# `FULL = False`: 2 + 1 layers, 100 pretraining steps, an adaptation budget of 30 batches
# (well under a minute on a CPU). `FULL = True`: 4 + 2 layers, 400 steps, 120 batches, as
# `benchmarks/methods/prune_then_finetune.py` (which repeats it over 3 seeds). At this scale the two
# arms end up tied: the paper's gain over fine-tuning is not reproduced, but pruning half of
# the prunable weights costs no accuracy.

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
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from IPython.display import Image, display

import lowrank_jax as lj
from lowrank_jax import train
from lowrank_jax.compress.prune import DEFAULT_RULES, register_batches
from lowrank_jax.datasets import builtin_datasets
from lowrank_jax.losses import mase, wql
from lowrank_jax.models import chronos_bolt
from lowrank_jax.recipes.pretrain_demo import demo_config
from lowrank_jax.recipes.prune import format_table
from lowrank_jax.recipes.prune import plot as plot_pruning

PLOTS = tempfile.mkdtemp(prefix="lowrank_jax_03_")


def show(fig):
    """Show a matplotlib figure inline as a PNG and close it. (lowrank_jax's plot helpers select
    matplotlib's file backend, Agg, which turns off Jupyter's inline figures.)"""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    display(Image(buf.getvalue()))

# %% [markdown]
# ## Pretraining on every dataset but one

# %%
cfg = demo_config(quick=not FULL)     # Chronos-Bolt, d_model 64, 4 heads, context 64, horizon 16
HELDOUT = "electric_devices_segmentation"
groups, source = builtin_datasets()
others = [s for name, g in groups.items() if name != HELDOUT for s in g]
held = groups[HELDOUT]
wcfg = train.WindowConfig(cfg.context_length, cfg.prediction_length, stride=cfg.prediction_length)
PRETRAIN, BUDGET, PRUNE_BATCHES = (400, 120, 12) if FULL else (100, 30, 3)

# One jitted train step per model structure. The learning rate is part of the optimizer state
# (optax.inject_hyperparams) and every batch has 32 windows, so pretraining and fine-tuning
# share one compiled step.
opt = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=1e-4)
loss_fn = chronos_bolt.loss(cfg)


def run(step, params, sampler, steps, lr, seed=0):
    """``steps`` steps of ``step`` on ``sampler``'s batches at a constant learning rate."""
    state = train.init_train_state(params, opt, key=jax.random.PRNGKey(seed))
    state.opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    losses = []
    for j in range(steps):
        w = sampler.batch(j)
        state, m = step(state, {"context": w["context"], "target": w["target"]})
        losses.append(float(m["loss"]))
    return train.full_params(state), losses


dense_step = train.make_train_step(loss_fn, opt)
pre = train.WindowSampler(others, wcfg, "train", batch_size=32, seed=0, skip_short=True)
pretrained, pre_loss = run(dense_step, chronos_bolt.init(jax.random.PRNGKey(0), cfg), pre,
                           PRETRAIN, 1e-3)
print(f"pretrained {PRETRAIN} steps on {pre.num_windows} windows of {len(groups) - 1} datasets; "
      f"loss {pre_loss[0]:.3f} -> {pre_loss[-1]:.3f}")

# %% [markdown]
# ## Test windows of the held-out dataset

# %%
test = train.WindowSampler(held, wcfg, "test", batch_size=1, skip_short=True)
test = train.WindowSampler(held, wcfg, "test", batch_size=test.num_windows, skip_short=True).batch(0)
forecast = jax.jit(lambda p, c: chronos_bolt.forecast(p, c, cfg))
levels = tuple(float(q) for q in cfg.quantiles)


def scores(params):
    pred = np.asarray(forecast(params, test["context"]))[:, :, :cfg.prediction_length]
    median = pred[:, levels.index(0.5)]
    return {"wql": float(wql(pred, test["target"], levels)),
            "mase": float(mase(median, test["target"], test["context"]))}


zero_shot = scores(pretrained)
print(f"{len(test['context'])} test windows of {HELDOUT}; zero-shot WQL {zero_shot['wql']:.4f}")

# %% [markdown]
# ## Two ways to spend the same adaptation budget
#
# Both arms see the same batches of 32 held-out training windows, in the same order:
#
# * **fine-tune**: `BUDGET` steps on all weights;
# * **prune-then-fine-tune**: the `prune` plan method scores and removes channels on the first
#   `PRUNE_BATCHES` batches (target: half of the prunable parameters), then the pruned model is
#   fine-tuned on the remaining ones. The plan method takes its batches from a named source;
#   we register one for the held-out windows.

# %%
adapt = train.WindowSampler(held, wcfg, "train", batch_size=32, seed=0, skip_short=True)
finetuned, ft_loss = run(dense_step, pretrained, adapt, BUDGET, 3e-4)


def heldout_batches(config, *, batch_size, seed):
    s = train.WindowSampler(held, wcfg, "train", batch_size=batch_size, seed=seed, skip_short=True)
    return lambda j: {k: np.asarray(s.batch(j)[k]) for k in ("context", "target")}


register_batches("heldout", heldout_batches)
plan = lj.Plan((lj.Step("prune", DEFAULT_RULES, {"target": 0.5, "steps": PRUNE_BATCHES,
                                                 "batch_size": 32, "data": "heldout"}),))
pruned, report = lj.apply_plan(pretrained, plan, config=cfg)
info = report.steps[0].info
print(f"pruned {info['params_fraction']:.1%} of the prunable parameters "
      f"({info['flops_fraction']:.1%} of their FLOPs): {lj.param_count(pretrained)} -> "
      f"{lj.param_count(pruned)} parameters")
print(format_table(info["layers"]))

rest = train.WindowSampler(held, wcfg, "train", batch_size=32, seed=0, position=PRUNE_BATCHES,
                           skip_short=True)
pruned_step = train.make_train_step(loss_fn, opt)   # the pruned tree has other shapes
ptf, ptf_loss = run(pruned_step, pruned, rest, BUDGET - PRUNE_BATCHES, 3e-4)
ratio = lj.param_count(pruned) / lj.param_count(pretrained)
assert 0.45 <= info["params_fraction"] <= 0.6 and ratio < 0.8, (info["params_fraction"], ratio)

# %% [markdown]
# ## Which channels went (the paper's Fig. 6)
#
# For every weight, the fraction of its input channels (top) and output channels (bottom)
# removed, per layer; below it the pruning history (removed fraction per batch against the
# cubic schedule). The same plots come from `lowrank-jax prune MODEL --plots DIR`.

# %%
weights = []
for r in report.rows:
    d = r.details
    weights.append({"path": r.path, "in_pruned_fraction": 1 - d["in_kept"] / d["d_in"],
                    "out_pruned_fraction": 1 - d["out_kept"] / d["d_out"]})
for name in plot_pruning(weights, info["history"], PLOTS):
    display(Image(os.path.join(PLOTS, name)))

# %% [markdown]
# ## Test accuracy

# %%
results = {"zero-shot (pretrained)": (zero_shot, 1.0), "fine-tune": (scores(finetuned), 1.0),
           "pruned, not fine-tuned": (scores(pruned), ratio), "prune-then-fine-tune": (scores(ptf), ratio)}
print(f"{'':<24} {'params':>7} {'test WQL':>9} {'test MASE':>9}")
for name, (s, p) in results.items():
    print(f"{name:<24} {p:>7.3f} {s['wql']:>9.4f} {s['mase']:>9.4f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(ft_loss, label="fine-tune")
ax1.plot(range(PRUNE_BATCHES, BUDGET), ptf_loss, label="prune-then-fine-tune")
ax1.axvline(PRUNE_BATCHES, color="gray", ls=":")
ax1.set(xlabel="adaptation batch", ylabel="training loss", title="adaptation")
ax1.legend(fontsize=8)
names = list(results)
values = [results[n][0]["wql"] for n in names]
ax2.bar(range(len(names)), values, color=["gray", "tab:blue", "tab:orange", "tab:green"])
for i, v in enumerate(values):
    ax2.annotate(f"{v:.4f}", (i, v), ha="center", va="bottom", fontsize=8)
ax2.set_ylim(0.97 * min(values), 1.01 * max(values))
ax2.set_xticks(range(len(names)), [n.replace(" (", "\n(").replace(", ", ",\n") for n in names],
               fontsize=7)
ax2.set(ylabel="test WQL (lower is better)", title=f"held out: {HELDOUT}")
fig.tight_layout()
show(fig)
w = {n: s["wql"] for n, (s, _) in results.items()}
assert w["fine-tune"] < w["zero-shot (pretrained)"]
assert w["prune-then-fine-tune"] < w["zero-shot (pretrained)"]
assert w["prune-then-fine-tune"] <= 1.05 * w["fine-tune"], w   # tied, with a third fewer parameters

# %% [markdown]
# Both arms improve on the zero-shot model; prune-then-fine-tune ends where fine-tuning ends
# with about two thirds of the parameters (and a proportionally faster forward, see
# `benchmarks/methods/pruning.py`). The paper reports prune-then-fine-tune *beating* fine-tuning on
# large pretrained foundation models; a model this small and briefly pretrained has little
# redundancy to specialize away, so we do not see that gain here.
