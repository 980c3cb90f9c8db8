# ruff: noqa: E402  (a notebook: imports follow the install cell; see colab/_build.py)
# %% [markdown]
# # Partitioning a layer over machines with low intercommunication
#
# Paper: *Partitioning Transformer Networks with Low Intercommunication* (M. Thill,
# D. Divsalar; no arXiv version).
#
# A dense layer `y = x W` is split over `M` machines: machine `m` owns `1/M` of the inputs and
# computes `1/M` of the outputs. It keeps its diagonal block `W_mm` exactly and broadcasts `r`
# numbers per token, from which every other machine rebuilds its off-diagonal contribution (a
# rank-`r` SVD of the machine's off-diagonal column block). Which outputs a machine computes is
# chosen to put as much of the weight's energy as possible on the diagonal (Algorithm 1): what
# is left off the diagonal, `Tr M1`, is what must be approximated, against `Tr M0` for the
# "SVD method" baseline, which compresses whole column blocks and sends them to a central node.
#
# This notebook, at CPU scale with 8 *simulated* devices:
#
# 1. trains a small MLP on scikit-learn's digits and partitions its hidden layer over 8
#    machines, machine `m` owning pixel row `m` of the 8x8 image;
# 2. plots `Tr M0` vs `Tr M1` per machine (the paper's Fig. 5), for Algorithm 1, the LP
#    relaxation and the contiguous split;
# 3. plots the relative error and the test accuracy against `r`, new method vs SVD method;
# 4. runs the partitioned layer under `jax.shard_map` over 8 devices and reads the bytes each
#    device sends per token from the compiled program: `4 r` (r float32 numbers).
#
# `FULL = False` trains 150 steps and compiles the sharded layer at 3 ranks (under a minute on
# a CPU); `FULL = True` trains 600 steps and measures every rank. On a Colab TPU with 8 cores
# the devices are real. `benchmarks/methods/partition.py` also measures key compression and timings.

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
# 8 simulated CPU devices; must be set before JAX starts (restart the runtime if JAX was
# already imported). On a TPU with 8 cores, the real devices are used instead.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# %%
import io

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from IPython.display import Image, display
from jax.sharding import Mesh
from sklearn.datasets import load_digits
from threadpoolctl import threadpool_limits

import lowrank_jax as lj
from lowrank_jax import nn
from lowrank_jax.compress import partitioning as pt

M = 8
devices = jax.devices() if len(jax.devices()) >= M else jax.devices("cpu")
print(f"{len(devices)} devices: {devices[0].platform}")

_ = threadpool_limits(1, user_api="blas")   # small host SVDs: one BLAS thread, no fight with XLA


def show(fig):
    """Show a matplotlib figure inline as a PNG and close it. (lowrank_jax's plot helpers select
    matplotlib's file backend, Agg, which turns off Jupyter's inline figures.)"""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    display(Image(buf.getvalue()))

# %% [markdown]
# ## A small MLP on digits
#
# 64 pixels -> 64 hidden units (ReLU) -> 10 classes, trained full-batch with Adam. The hidden
# layer `wi: [64, 64]` is what we partition: its 64 inputs are the 8 pixel rows, one per
# machine.

# %%
digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)          # [1797, 64]
y = digits.target.astype(np.int32)
order = np.random.default_rng(0).permutation(len(x))
cut = int(0.8 * len(x))
x_train, y_train, x_test, y_test = x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]
MLP = nn.MLPConfig(activation="relu", use_bias=True)
params = {"mlp": nn.init_mlp(jax.random.PRNGKey(0), MLP, d_model=64, d_ff=64, d_out=10)}
opt = optax.adam(3e-3)


@jax.jit
def step(p, s):
    def loss(p):
        logits = nn.apply_mlp(p["mlp"], x_train, MLP)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y_train).mean()

    u, s = opt.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, u), s


state = opt.init(params)
for _ in range(600 if FULL else 150):
    params, state = step(params, state)


@jax.jit
def logits_with(wi_matrix, wi_bias, p):
    """The MLP with its hidden layer replaced by a dense matrix (one compile for every variant)."""
    return nn.apply_mlp({"wi": lj.Dense(wi_matrix, wi_bias), "wo": p["mlp"]["wo"]}, x_test, MLP)


w = lj.materialize_host(params["mlp"]["wi"])                  # [64, 64], float64
b = np.asarray(lj.leaves.bias_of(params["mlp"]["wi"]))


def accuracy(matrix, bias=b):
    out = logits_with(jnp.asarray(matrix, jnp.float32), jnp.asarray(bias), params)
    return float(np.mean(np.asarray(out).argmax(-1) == y_test))


acc_dense = accuracy(w)
print(f"dense test accuracy {acc_dense:.3f}")

# %% [markdown]
# ## `Tr M0` and `Tr M1` per machine (Fig. 5)
#
# `block_energy` is the energy of every output unit's weights coming from each machine's
# inputs. `Tr M0` (per machine: the energy of its whole column block) is what the SVD method
# has to approximate; `Tr M1` (the energy of its off-diagonal part, under an assignment of
# outputs to machines) is what the new method has to approximate.

# %%
energy = pt.block_energy(w, M)
traces = {name: pt.machine_traces(energy, pt.assign(energy, name)) for name in pt.ASSIGNMENTS}
fig, ax = plt.subplots(figsize=(7, 3.5))
machines = np.arange(M)
tr_m0 = traces["greedy"][0]
ax.bar(machines - 0.3, tr_m0, 0.2, label=f"Tr M0, SVD method (sum {tr_m0.sum():.1f})")
for i, name in enumerate(("greedy", "lp", "contiguous")):
    tr_m1 = traces[name][1]
    ax.bar(machines - 0.1 + 0.2 * i, tr_m1, 0.2, label=f"Tr M1, {name} (sum {tr_m1.sum():.1f})")
ax.set(xlabel="machine (pixel row)", ylabel="energy", title="what each machine must approximate")
ax.legend(fontsize=7)
show(fig)
sum_m1 = {name: float(t[1].sum()) for name, t in traces.items()}
print("sum Tr M1:", {k: round(v, 2) for k, v in sum_m1.items()}, "| sum Tr M0:", round(float(tr_m0.sum()), 2))
assert sum_m1["greedy"] < sum_m1["contiguous"] < float(tr_m0.sum())
assert sum_m1["lp"] <= sum_m1["greedy"] + 1e-9   # the LP is the optimum

# %% [markdown]
# ## Error and accuracy against `r`
#
# The `partition` plan method turns the weight into a `Partitioned` leaf (Algorithm 1, rank
# `r`). Its output error `||x W - x W~|| / ||x W||` on the test images, and the test accuracy
# of the MLP with it, against the SVD method at the same `r` (rank `r` per machine, central
# node) and its error bound (eq. 94).

# %%
dec = pt.decompose(w, M, assignment="greedy", bias=b)
rows = []
for r in range(dec.max_rank + 1):
    plan = lj.Plan((lj.Step("partition", (r"mlp/wi$",), {"machines": M, "rank": r}),))
    split, _ = lj.apply_plan(params, plan)     # wi -> Partitioned; wo follows its output order
    leaf = split["mlp"]["wi"]
    # the partitioned MLP's logits, as one dense program: materialize puts wi's outputs in the
    # machines' order and the plan permuted wo's inputs to match
    out = nn.apply_mlp({"wi": lj.Dense(jnp.asarray(lj.materialize(leaf)), leaf.bias),
                        "wo": split["mlp"]["wo"]}, x_test, MLP)
    if r == 2:   # the dense program equals the partitioned leaf run as it is
        direct = nn.apply_mlp(split["mlp"], x_test, MLP)
        assert np.abs(np.asarray(direct) - np.asarray(out)).max() < 1e-5
    svd = pt.svd_method_matrix(w, M, r)
    terms = pt.error_terms(dec, r, x_test)
    rows.append({"r": r, "err_new": float(np.mean(terms["rel"])), "bound": float(np.mean(terms["eq94"])),
                 "err_svd": float(np.mean(pt.relative_output_errors(w, svd, x_test))),
                 "acc_new": float(np.mean(np.asarray(out).argmax(-1) == y_test)),
                 "acc_svd": accuracy(svd)})
print(f"{'r':>2} {'err new':>8} {'err SVD':>8} {'bound':>7} {'acc new':>8} {'acc SVD':>8}")
for row in rows:
    print(f"{row['r']:>2} {row['err_new']:>8.3f} {row['err_svd']:>8.3f} {row['bound']:>7.3f} "
          f"{row['acc_new']:>8.3f} {row['acc_svd']:>8.3f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
rs = [row["r"] for row in rows]
ax1.plot(rs, [row["err_new"] for row in rows], "o-", label="partition (new)")
ax1.plot(rs, [row["err_svd"] for row in rows], "s-", label="SVD method")
ax1.plot(rs, [row["bound"] for row in rows], ":", label="bound of the new method (eq. 94)")
ax1.set(xlabel="r (numbers each machine sends per token)", ylabel="relative output error",
        ylim=(0, 1.5))
ax1.legend(fontsize=8)
ax2.plot(rs, [row["acc_new"] for row in rows], "o-", label="partition (new)")
ax2.plot(rs, [row["acc_svd"] for row in rows], "s-", label="SVD method")
ax2.axhline(acc_dense, color="gray", ls=":", label="dense")
ax2.set(xlabel="r", ylabel="test accuracy")
ax2.legend(fontsize=8)
fig.tight_layout()
show(fig)
for row in rows[1:-1]:
    assert row["err_new"] < row["err_svd"] and row["err_new"] <= row["bound"], row
assert rows[-1]["err_new"] < 1e-5 and abs(rows[-1]["acc_new"] - acc_dense) < 1e-9   # full rank: exact

# %% [markdown]
# ## Bytes per token, read from the compiled program
#
# Under a mesh with a `model` axis, `linear` on a `Partitioned` leaf runs under `jax.shard_map`:
# each device computes its outputs from its own inputs and one all-gather of `r` numbers per
# token. `collective_bytes` lists every collective of the compiled program with its bytes.

# %%
mesh = Mesh(np.array(devices[:M]), ("model",))
tokens = jnp.asarray(x_test[:64])
measured = {}
for r in (range(dec.max_rank + 1) if FULL else (1, 2, 4)):
    leaf = dec.leaf(r)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lj.linear).lower(leaf, tokens).compile()
        y_sharded = jax.jit(lj.linear)(leaf, tokens)
    cols = pt.collective_bytes(compiled)
    measured[r] = sum(c.bytes for c in cols) / tokens.shape[0]
    print(f"r = {r}: {[c.kind for c in cols]}, {measured[r]:g} bytes per token per device "
          f"(formula 4 r = {4 * r})")
    y_single = np.asarray(lj.linear(leaf, tokens))   # the same leaf on one device
    assert np.abs(np.asarray(y_sharded) - y_single).max() < 1e-5
    assert measured[r] == 4 * r, measured

# %% [markdown]
# An all-gather of `r` float32 numbers per token and machine is all the layer communicates,
# against `4 x 64 / 8 = 32` bytes per token for gathering the full activations; with `r = 4`
# the partitioned layer is within a few points of the dense accuracy.
