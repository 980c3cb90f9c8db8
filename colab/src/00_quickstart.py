# ruff: noqa: E402  (a notebook: imports follow the install cell; see colab/_build.py)
# %% [markdown]
# # lowrank_jax quickstart: a Hugging Face checkpoint in, compressed, and back to PyTorch
#
# This notebook walks through the whole round trip on a small T5 checkpoint:
#
# 1. build a T5 with `transformers` and `save_pretrained` it (nothing is downloaded),
# 2. convert it to a lowrank_jax parameter tree and check it against PyTorch,
# 3. analyze the ranks of its attention weights,
# 4. compress them with a *plan* (truncated SVD, factors kept as `LowRank` leaves),
# 5. compare the compressed model's outputs, size, FLOPs and speed with the original,
# 6. save and reload it with `lowrank_jax.io`, and
# 7. export it back to a Hugging Face directory and check PyTorch's output.
#
# Paper: *Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
# Compressibility* (Yu et al., ICLR 2026, arXiv:2510.03358): eps-rank (eq. 1) and truncated SVD
# of attention weights kept factorized (eq. 19).
#
# With `FULL = False` (the default) the model is tiny and the notebook runs in well under a
# minute on a laptop CPU; `FULL = True` builds a T5 of t5-small's size (60M parameters; use a
# Colab GPU or TPU). Both build *randomly initialized* weights, since nothing can be downloaded
# where the notebook is tested; in Colab you can point `CHECKPOINT` at a real directory, for
# example one from `huggingface_hub.snapshot_download("google-t5/t5-small")`.

# %%
# Colab only: install lowrank_jax. Colab already has torch and transformers; locally, install
# the package with `pip install -e ".[plot,data,torch]"` instead.
import subprocess
import sys

REPO = "https://github.com/lowrank-jax/lowrank_jax"  # the project's repository
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    f"lowrank-jax[plot,data,torch] @ git+{REPO}"], check=True)

# %%
import os

# False: small CPU settings (under a minute); True: full size (use a Colab GPU/TPU).
FULL = False
FULL = FULL or os.environ.get("LOWRANK_JAX_FULL") == "1"

# %%
import io
import tempfile

import jax
import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers
from IPython.display import Image, display
from threadpoolctl import threadpool_limits

import lowrank_jax as lj
from lowrank_jax import models
from lowrank_jax.analysis import ATTENTION_PATTERN
from lowrank_jax.compress import compare_models, eps_sweep, sample_inputs
from lowrank_jax.convert import load_pretrained, save_pretrained
from lowrank_jax.io import load_model, save_model

torch.manual_seed(0)
WORK = tempfile.mkdtemp(prefix="lowrank_jax_quickstart_")  # every file goes here
print("jax", jax.__version__, "on", jax.devices()[0].platform, "| files in", WORK)

_ = threadpool_limits(1, user_api="blas")   # small host SVDs: one BLAS thread, no fight with XLA


def show(fig):
    """Show a matplotlib figure inline as a PNG and close it. (lowrank_jax's plot helpers select
    matplotlib's file backend, Agg, which turns off Jupyter's inline figures.)"""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    display(Image(buf.getvalue()))

# %% [markdown]
# ## 1. A checkpoint built locally
#
# `T5ForConditionalGeneration` with a small random config, saved exactly as a checkpoint from
# the Hub is saved (`config.json` + `model.safetensors`).

# %%
if FULL:   # t5-small's sizes
    sizes = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8)
else:
    sizes = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
hf_config = transformers.T5Config(**sizes, decoder_start_token_id=0, dropout_rate=0.0)
hf_model = transformers.T5ForConditionalGeneration(hf_config).eval()
CHECKPOINT = os.path.join(WORK, "t5_hf")
hf_model.save_pretrained(CHECKPOINT)
print(sorted(os.listdir(CHECKPOINT)), f"{hf_model.num_parameters():,} parameters")

# %% [markdown]
# ## 2. Convert it
#
# `load_pretrained` reads the directory (safetensors without torch), detects the family from
# `config.json` and returns a config dataclass and a parameter tree. Every weight matrix in the
# tree is a *leaf* (`Dense` here); the attention blocks hold a query-key object.

# %%
cfg, params = load_pretrained(CHECKPOINT)
print(type(cfg).__name__, "|", lj.param_count(params), "parameters")
for path, leaf in list(lj.named_leaves(params))[:6]:
    print(f"  {path:<40} {type(leaf).__name__:<8} {getattr(leaf, 'shape', np.shape(leaf))}")

# the same inputs (random token ids, some padding) through PyTorch and through the JAX model
inputs = sample_inputs(cfg, batch=4)
forward = jax.jit(models.apply, static_argnums=2)   # any family: apply(params, inputs, config)


def torch_logits_of(model):
    with torch.no_grad():
        return model(**{k: torch.from_numpy(np.asarray(v, np.int64))
                        for k, v in inputs.items()}).logits.numpy()


torch_logits = torch_logits_of(hf_model)
jax_logits = np.asarray(forward(params, inputs, cfg)["logits"])
err = np.abs(jax_logits - torch_logits).max()
print(f"max |JAX - PyTorch| logits: {err:.2e}")
assert err < 1e-4, err   # float32 parity of a whole model

# %% [markdown]
# ## 3. Ranks of the attention weights
#
# The eps-rank of a matrix ([1] eq. 1) is the number of singular values above `eps` times the
# largest. `lj.analyze` reports it for every weight (and per head for q/k/v). The weights here
# are *random*, so their spectra are flat (Marchenko-Pastur): nearly full rank. Trained
# transformers' attention weights are much lower rank, which is what makes them compressible;
# notebook `01_flow_of_ranks` shows it on a trained model.

# %%
report = lj.analyze(params, eps=(0.1, 0.3, 0.5), pattern=ATTENTION_PATTERN)
print(report.format_table().split("\n\n")[-1])   # the per-layer summary
fig, ax = plt.subplots(figsize=(6, 3.5))
for w in report.weights[:8]:
    s = np.asarray(w.singular_values)
    ax.semilogy(np.arange(1, len(s) + 1), s / s[0], label=w.path.replace("/layers/", "/"))
ax.axhline(0.3, color="gray", ls=":", label="eps = 0.3")
ax.set(xlabel="index j", ylabel="sigma_j / sigma_1", title="spectra of attention weights")
ax.legend(fontsize=6, ncol=2)
show(fig)

# %% [markdown]
# ## 4. Compress with a plan
#
# A plan is data: steps of (method, path rules, settings), printable and saved as JSON. Here
# one `svd` step replaces every attention projection (q, k, v, o of the encoder, decoder and
# cross attention) by its rank-`r` truncated SVD `U V` (a `LowRank` leaf). The report has one
# row per weight: parameters before and after, the relative error `||W - U V|| / ||W||`.

# %%
rank = 64 if FULL else 4
plan = lj.Plan((lj.Step("svd", (r"attn/(qk/q|qk/k|v|o)$",), {"rank": rank}),))
print(plan.to_json())
small, rep = lj.apply_plan(params, plan)
print(rep.format_table())
leaf = small["encoder"]["layers"][0]["attn"]["v"]
print("\nencoder layer 0 value projection is now", type(leaf).__name__,
      {k: tuple(v.shape) for k, v in (("u", leaf.u), ("v", leaf.v))})
assert isinstance(leaf, lj.LowRank) and rep.ratio < 1

# %% [markdown]
# ## 5. Compare outputs and speed
#
# `compare_models` runs both models on the same inputs and reports the relative
# error of the logits, the top-10 token overlap ([1] Table 2's "Overlap"), the parameter and
# FLOP ratios and the measured forward-time ratio (jitted, interleaved runs). On the tiny model
# the forward is dominated by dispatch, so the time ratio says little; with `FULL = True` the
# projections dominate and the factorized model is faster.

# %%
cmp = compare_models(cfg, params, small, inputs=inputs, time_runs=20 if FULL else 5)
for k in ("rel_error", "top10_jaccard", "param_ratio", "flop_ratio", "time_ratio"):
    print(f"{k:>14}: {cmp[k]:.3f}")
print(f"{'forward ms':>14}: {cmp['time_ms']['original']:.2f} -> {cmp['time_ms']['compressed']:.2f}")
assert cmp["param_ratio"] < 1 and cmp["flop_ratio"] < 1

# %% [markdown]
# How much does each rank cost in accuracy? `eps_sweep` truncates every attention weight at
# several eps (each keeps its own eps-rank) and runs all of them in **one** compiled program.
# With random weights the error grows steadily as the size falls; a trained model's curve stays
# flat much longer.

# %%
sweep = eps_sweep(cfg, params, inputs, [0.05, 0.2, 0.4, 0.6, 0.8])
fig, ax = plt.subplots(figsize=(5, 3.5))
ax.plot([r["size_ratio"] for r in sweep], [r["rel_error"] for r in sweep], "o-")
for r in sweep:
    ax.annotate(f"eps {r['eps']:g}", (r["size_ratio"], r["rel_error"]), fontsize=7)
ax.set(xlabel="attention size ratio", ylabel="relative error of the logits",
       title="error vs size (truncated SVD at eps)")
show(fig)
errors = [r["rel_error"] for r in sweep]
assert errors == sorted(errors), errors   # a smaller model is never more accurate here

# %% [markdown]
# ## 6. Save and load
#
# `save_model` writes the factors as they are (orbax arrays, a JSON skeleton of the leaf types
# and a sha256 per array, written atomically); `load_model` gives back the config and the tree.

# %%
saved = os.path.join(WORK, "t5_small_lj")
save_model(saved, cfg, small)
cfg2, small2 = load_model(saved)
out1 = np.asarray(forward(small, inputs, cfg)["logits"])
out2 = np.asarray(forward(small2, inputs, cfg2)["logits"])
print("reloaded:", type(small2["encoder"]["layers"][0]["attn"]["v"]).__name__,
      "| identical outputs:", np.array_equal(out1, out2))
assert cfg2 == cfg and np.array_equal(out1, out2)

# %% [markdown]
# ## 7. Export back to PyTorch
#
# `save_pretrained` writes a directory the original PyTorch class loads. PyTorch's T5 has no
# low-rank layers, so the factors are multiplied out (`materialize`) and listed in the summary;
# the exported model computes exactly what the compressed JAX model computes.

# %%
exported = os.path.join(WORK, "t5_small_hf")
summary = save_pretrained(cfg, small, exported)
print(len(summary["materialized"]), "leaves materialized, e.g.", summary["materialized"][:2])
hf_small = transformers.T5ForConditionalGeneration.from_pretrained(exported).eval()
torch_small = torch_logits_of(hf_small)
err_export = np.abs(torch_small - out1).max()
print(f"max |PyTorch(exported) - JAX(compressed)|: {err_export:.2e}")
print(f"max |PyTorch(exported) - PyTorch(original)|: {np.abs(torch_small - torch_logits).max():.2e}"
      "  (the compression's own change)")
assert err_export < 1e-4, err_export

# %% [markdown]
# ## Where next
#
# * `01_flow_of_ranks`: ranks of a *trained* model, flow-of-ranks and compressed pretraining.
# * `02`-`05`: the other papers' methods (irregular attention, pruning, sparse binary
#   transformers, partitioning), each a plan method like `svd` above.
# * `06_flax_interop`: the same plans on your own Flax model, without rewriting it.
# * The command line does all of the above on a checkpoint directory:
#   `lowrank-jax convert DIR --out m && lowrank-jax compress m --eps 0.3 --out m_small`.
