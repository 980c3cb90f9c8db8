"""Partitioning over machines ("Partitioning Transformer Networks with Low Intercommunication",
Thill & Divsalar) at CPU scale, on 8 simulated devices.

1. **Dense layer** (the paper's sec. II.H, Figs. 5-7, with scikit-learn's digits instead of
   CIFAR-10, which is not available offline): an MLP 64 -> 64 (ReLU) -> 10 trained on digits;
   its hidden layer is partitioned over 8 machines, machine ``m`` owning pixel row ``m`` of the
   8x8 image. For every ``r`` (numbers each machine sends): relative error
   ``||Delta|| / ||W x||`` on the test images and its bound (eq. 94), and test accuracy, for the
   new method (Algorithm 1) and the SVD method (rank ``r`` per machine, central node), plus the
   full rank-``8 r`` SVD; ``Tr M0`` / ``Tr M1`` per machine (Fig. 5) for Algorithm 1, its row
   variant, the LP and the contiguous split.
2. **Key compression** (sec. III.A, Fig. 8): a one-layer attention classifier trained on digits
   (tokens = the 8 pixel rows); per head, the queries and keys of the test images; mean
   relative error of ``q^T k`` estimated from ``K`` coefficients with the ``C_qk`` basis
   (eq. 135) against PCA (eq. 136), over the query-key pairs of the same image.
3. **Bytes per token** read from the compiled HLO (``collective_bytes``) next to the formula
   ``r`` float32 numbers per machine per token per layer (eq. 34), for the digits layer at every
   ``r`` and for every collective of a partitioned encoder layer.
4. **Time** of the partitioned digits layer (64 x 64, r = 2) and of a random 768 x 768 layer
   (r = 16) on 8 simulated devices (``shard_map``) against the same leaf on one device and the
   dense layer, interleaved, median of ``--runs``. Simulated devices share the same CPU cores,
   so this measures the overhead of the exchange, not a speed-up.

Usage::

    python -m benchmarks.methods partition --json partition.json
    python -m benchmarks.methods partition --quick          # fewer training steps and runs
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import lowrank_jax as lj  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from lowrank_jax import nn  # noqa: E402
from lowrank_jax.compress import partitioning as pt  # noqa: E402

M = 8


def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)  # [1797, 64]: 8 rows of 8 pixels
    y = d.target.astype(np.int32)
    idx = np.random.default_rng(0).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[idx[:cut]], y[idx[:cut]], x[idx[cut:]], y[idx[cut:]]


def train(loss, params, steps: int, lr: float = 3e-3):
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    for _ in range(steps):
        params, state = step(params, state)
    return params


# ---------------------------------------------------------------------------------------------
# 1. The dense layer.

MLP = nn.MLPConfig(activation="relu", use_bias=True)


def train_mlp(xtr, ytr, steps):
    params = {"mlp": nn.init_mlp(jax.random.PRNGKey(0), MLP, d_model=64, d_ff=64, d_out=10)}

    def loss(p):
        logits = nn.apply_mlp(p["mlp"], xtr, MLP)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ytr).mean()

    return train(loss, params, steps)


def accuracy(mlp, x, y) -> float:
    return float(np.mean(np.argmax(np.asarray(nn.apply_mlp(mlp, x, MLP)), -1) == y))


def dense_layer(params, xtr, ytr, xte, yte) -> dict:
    w = lj.materialize_host(params["mlp"]["wi"])
    b = np.asarray(lj.leaves.bias_of(params["mlp"]["wi"]))
    energy = pt.block_energy(w, M)
    traces = {}
    for name in pt.ASSIGNMENTS:
        a = pt.assign(energy, name)
        tr0, tr1 = pt.machine_traces(energy, a)
        traces[name] = {"tr_m0": tr0.tolist(), "tr_m1": tr1.tolist(),
                        "sum_tr_m1": float(tr1.sum())}
    traces["sum_tr_m0"] = float(energy.sum())
    dec = pt.decompose(w, M, assignment="greedy", bias=b)
    out = {"accuracy_dense": accuracy(params["mlp"], xte, yte), "ranks": [],
           "rel_error_new": [], "rel_error_svd": [], "rel_error_full_svd": [],
           "bound_new": [], "bound_svd": [], "accuracy_new": [], "accuracy_svd": [],
           "accuracy_full_svd": [], "traces": traces, "max_rank": dec.max_rank}
    wo = params["mlp"]["wo"]
    ratio = np.linalg.norm(xte, axis=1) / np.linalg.norm(xte @ w, axis=1)
    for r in range(dec.max_rank + 1):
        plan = lj.Plan((lj.Step("partition", (r"mlp/wi$",), {"machines": M, "rank": r}),))
        new, _ = lj.apply_plan(params, plan)  # wo (a Dense classifier) follows the hidden order
        t = pt.error_terms(dec, r, xte)
        svd = pt.svd_method_matrix(w, M, r)
        full = pt.full_svd_matrix(w, M * r)
        s0 = dec.sigma0[:, r].max() if r < dec.sigma0.shape[1] else 0.0
        out["ranks"].append(r)
        out["rel_error_new"].append(float(np.mean(t["rel"])))
        out["rel_error_svd"].append(float(np.mean(pt.relative_output_errors(w, svd, xte))))
        out["rel_error_full_svd"].append(float(np.mean(pt.relative_output_errors(w, full, xte))))
        out["bound_new"].append(float(np.mean(t["eq94"])))
        out["bound_svd"].append(float(np.sqrt(M) * s0 * np.mean(ratio)))  # as the paper's 6a
        out["accuracy_new"].append(accuracy(new["mlp"], xte, yte))
        for key, mat in (("accuracy_svd", svd), ("accuracy_full_svd", full)):
            mlp = {"wi": lj.Dense(jnp.asarray(mat, jnp.float32), jnp.asarray(b)), "wo": wo}
            out[key].append(accuracy(mlp, xte, yte))
    return out


# ---------------------------------------------------------------------------------------------
# 2. Key compression.

ATTN = nn.AttentionConfig(use_bias=True)
NORM = nn.NormConfig()


def train_attention(xtr, ytr, steps):
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    params = {"embed": lj.init_dense(k[0], 8, 32, bias=True),
              "attn": nn.init_attention(k[1], ATTN, d_model=32, num_heads=4),
              "norm": nn.init_norm(32, NORM), "head": lj.init_dense(k[2], 32, 10, bias=True)}
    pos = 0.1 * jax.random.normal(jax.random.PRNGKey(2), (8, 32))

    def embed(p, x):
        return lj.linear(p["embed"], x.reshape(-1, 8, 8)) + pos  # tokens = pixel rows

    def logits(p, x):
        h = embed(p, x)
        h = h + nn.apply_attention(p["attn"], nn.apply_norm(p["norm"], h, NORM), ATTN)
        return lj.linear(p["head"], h.mean(1))

    def loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, xtr), ytr).mean()

    params = train(loss, params, steps)
    return params, embed, logits


def key_compression(params, embed, logits, xte, yte) -> dict:
    acc = float(np.mean(np.argmax(np.asarray(logits(params, xte)), -1) == yte))
    h = nn.apply_norm(params["norm"], embed(params, xte), NORM)  # [n, 8, 32]
    q = np.asarray(lj.linear(params["attn"]["qk"].q, h)).reshape(len(xte), 8, 4, 8)
    k = np.asarray(lj.linear(params["attn"]["qk"].k, h)).reshape(len(xte), 8, 4, 8)
    out = {"accuracy": acc, "K": list(range(9))}
    for method in ("cqk", "pca"):
        mean_rel, median_rel, bound = [], [], []
        for num in range(9):
            rels, bounds = [], []
            for head in range(4):
                qh, kh = q[:, :, head].reshape(-1, 8), k[:, :, head].reshape(-1, 8)
                basis = pt.key_basis(qh, kh, method=method)
                exact = np.einsum("nid,njd->nij", q[:, :, head], k[:, :, head])  # same image
                fk = basis.compress(kh, num).reshape(len(xte), 8, num)
                qu = (qh @ basis.u[:, :num]).reshape(len(xte), 8, num)
                est = np.einsum("nik,njk->nij", qu, fk) + basis.tail[num]  # eq. 124
                rels.append(np.abs(exact - est) / np.maximum(np.abs(exact), 1e-12))
                bounds.append(basis.bound[num])
            rels = np.concatenate([r.ravel() for r in rels])
            mean_rel.append(float(rels.mean()))
            median_rel.append(float(np.median(rels)))
            bound.append(float(np.mean(bounds)))
        out[method] = {"mean_rel_error": mean_rel, "median_rel_error": median_rel,
                       "bound_eq134": bound}
    return out


# ---------------------------------------------------------------------------------------------
# 3. Bytes per token from the HLO; 4. time.

def hlo_bytes(params, x) -> list[dict]:
    mesh = Mesh(np.array(jax.devices()[:M]), ("model",))
    w = lj.materialize_host(params["mlp"]["wi"])
    dec = pt.decompose(w, M)
    rows = []
    for r in range(dec.max_rank + 1):
        leaf = dec.leaf(r)
        with jax.set_mesh(mesh):
            cols = pt.collective_bytes(jax.jit(lj.linear).lower(leaf, x).compile())
        rows.append({"r": r, "collectives": [c.kind for c in cols],
                     "measured_bytes_per_token": sum(c.bytes for c in cols) / x.shape[0],
                     "formula_bytes_per_token": 4 * r})
    return rows


def encoder_collectives(rank: int) -> dict:
    cfg = nn.EncoderLayerConfig(attention=ATTN, mlp=nn.MLPConfig(activation="gelu"),
                                norm=nn.NormConfig())
    params = nn.init_encoder_layer(jax.random.PRNGKey(3), cfg, d_model=64,
                                   sizes=nn.LayerSizes(8, 8, 256))
    plan = lj.Plan((lj.Step("partition", (r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wo)$"),
                            {"machines": M, "rank": rank}),))
    new, report = lj.apply_plan(params, plan)
    x = np.random.default_rng(0).normal(size=(4, 16, 64)).astype(np.float32)
    tokens = 4 * 16
    mesh = Mesh(np.array(jax.devices()[:M]), ("model",))
    fn = jax.jit(lambda p, x: nn.apply_encoder_layer(p, x, cfg))
    with jax.set_mesh(mesh):
        cols = pt.collective_bytes(fn.lower(new, x).compile())
    listing = [{"kind": c.kind, "result": [list(s) for s in c.result_shapes],
                "group": c.group_size, "bytes_per_token": c.bytes / tokens,
                "formula": ("r = %d float32 numbers (eq. 34)" % rank if c.kind == "all-gather"
                            else "1 float32 partial sum of a LayerNorm statistic")}
               for c in cols]
    return {"rank": rank, "machines": M, "collectives": listing,
            "measured_bytes_per_token": sum(c.bytes for c in cols) / tokens,
            "formula_bytes_per_token": 6 * 4 * rank + 2 * 2 * 4,
            "formula": "6 partitioned projections x r x 4 bytes + 2 LayerNorms x 2 statistics "
                       "x 4 bytes"}


def timing(w: np.ndarray, rank: int, tokens: int, runs: int) -> dict:
    """Median ms of the dense layer, the partitioned leaf on one device and on 8 simulated
    devices, interleaved."""
    leaf = pt.decompose(w, M).leaf(rank)
    dense = lj.Dense(jnp.asarray(w, jnp.float32))
    d = w.shape[0]
    x = jnp.asarray(np.random.default_rng(0).random((tokens, d)), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:M]), ("model",))
    single = jax.jit(lj.linear)
    with jax.set_mesh(mesh):
        sharded = jax.jit(lj.linear)
        jax.block_until_ready(sharded(leaf, x))
    calls = {"dense": lambda: single(dense, x), "partitioned_1_device": lambda: single(leaf, x),
             "partitioned_8_devices": lambda: sharded(leaf, x)}
    m = H.measure(calls, runs=runs, warmup=1,
                  check={"partitioned_8_devices": "partitioned_1_device"})
    load = m.load
    med = {k: m.ms(k) for k in calls}
    return {"d": d, "rank": rank, "tokens": tokens, "runs": runs, "median_ms": med,
            "ratio_8_devices_to_1": med["partitioned_8_devices"] / med["partitioned_1_device"],
            "ratio_1_device_to_dense": med["partitioned_1_device"] / med["dense"],
            "flop_ratio_to_dense": leaf.flops(1) / dense.flops(1), "other_load": load,
            "max_abs_diff_8_devices_to_1": m.max_abs_error["partitioned_8_devices"]}


def main(argv=None) -> dict:
    p = H.parser(__doc__, quick="fewer training steps and timed runs")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 30, quick 5)")
    args = p.parse_args(argv)
    steps = 150 if args.quick else 600
    runs = args.runs or (5 if args.quick else 30)
    run = H.Run(__name__, argv, quick=args.quick, train_steps=steps, runs=runs)
    xtr, ytr, xte, yte = digits()
    params = train_mlp(xtr, ytr, steps)
    mlp = dense_layer(params, xtr, ytr, xte, yte)
    print(f"# digits MLP 64-64-10, hidden layer over {M} machines (one pixel row each); dense "
          f"test accuracy {mlp['accuracy_dense']:.3f}")
    tr = mlp["traces"]
    print(f"# sum Tr M0 = {tr['sum_tr_m0']:.1f}; sum Tr M1: " + ", ".join(
        f"{k} {tr[k]['sum_tr_m1']:.1f}" for k in pt.ASSIGNMENTS))
    print(f"{'r':>3} {'err new':>8} {'err svd':>8} {'err full':>8} {'bound new':>9} "
          f"{'bound svd':>9} {'acc new':>7} {'acc svd':>7} {'acc full':>8}")
    for i, r in enumerate(mlp["ranks"]):
        print(f"{r:>3} {mlp['rel_error_new'][i]:>8.3f} {mlp['rel_error_svd'][i]:>8.3f} "
              f"{mlp['rel_error_full_svd'][i]:>8.3f} {mlp['bound_new'][i]:>9.3f} "
              f"{mlp['bound_svd'][i]:>9.3f} {mlp['accuracy_new'][i]:>7.3f} "
              f"{mlp['accuracy_svd'][i]:>7.3f} {mlp['accuracy_full_svd'][i]:>8.3f}")
    attn, embed, logits = train_attention(xtr, ytr, steps)
    keys = key_compression(attn, embed, logits, xte, yte)
    print(f"\n# key compression, 4 heads of width 8 (attention classifier, test accuracy "
          f"{keys['accuracy']:.3f}): mean / median |q.k - g| / |q.k| over same-image pairs")
    print(f"{'K':>3} {'C_qk mean':>10} {'PCA mean':>10} {'C_qk median':>12} {'PCA median':>11}")
    for i, num in enumerate(keys["K"]):
        print(f"{num:>3} {keys['cqk']['mean_rel_error'][i]:>10.3f} "
              f"{keys['pca']['mean_rel_error'][i]:>10.3f} "
              f"{keys['cqk']['median_rel_error'][i]:>12.3f} "
              f"{keys['pca']['median_rel_error'][i]:>11.3f}")
    bytes_rows = hlo_bytes(params, xte[:64])
    print("\n# bytes each device sends per token (HLO all-gather operand) vs the formula 4 r")
    print(" ".join(f"r={b['r']}:{b['measured_bytes_per_token']:g}/{b['formula_bytes_per_token']}"
                   for b in bytes_rows))
    enc = encoder_collectives(rank=4)
    print(f"\n# encoder layer (d_model 64, 8 heads, d_ff 256) over {M} machines, r = 4: "
          f"{enc['measured_bytes_per_token']:g} bytes/token measured, "
          f"{enc['formula_bytes_per_token']} by the formula ({enc['formula']})")
    for c in enc["collectives"]:
        print(f"  {c['kind']:<11} {str(c['result']):<18} group {c['group']}  "
              f"{c['bytes_per_token']:g} B/token  ({c['formula']})")
    w768 = np.random.default_rng(1).normal(size=(768, 768)) / np.sqrt(768)
    tms = [timing(lj.materialize_host(params["mlp"]["wi"]), 2, 4096, runs),
           timing(w768, 16, 512 if args.quick else 2048, runs)]
    print(f"\n# time, median of {runs} interleaved runs (8 simulated devices share the CPU cores)")
    for tm in tms:
        load = "n/a" if tm["other_load"] is None else f"{100 * tm['other_load']:.0f}%"
        print(f"  d {tm['d']}, r {tm['rank']}, {tm['tokens']} tokens (other load {load}): "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in tm["median_ms"].items())
              + f"; 8 devices / 1 device {tm['ratio_8_devices_to_1']:.2f}, 1 device / dense "
              f"{tm['ratio_1_device_to_dense']:.2f} (FLOP ratio {tm['flop_ratio_to_dense']:.3f})")
    goals = {}
    for tm in tms:
        goals.update(H.goal(
            f"partitioned layer d {tm['d']}, r {tm['rank']}, {tm['tokens']} tokens on {M} "
            "simulated devices: time / on one device", tm["ratio_8_devices_to_1"],
            measured=f"{tm['ratio_8_devices_to_1']:.2f} (1 device / dense "
                     f"{tm['ratio_1_device_to_dense']:.2f}, FLOP ratio "
                     f"{tm['flop_ratio_to_dense']:.3f})"))
    goals.update(H.goal(
        f"partitioned encoder layer, r = {enc['rank']}: bytes per token sent, measured / formula",
        enc["measured_bytes_per_token"] / enc["formula_bytes_per_token"],
        measured=f"{enc['measured_bytes_per_token']:g} / {enc['formula_bytes_per_token']}"))
    return run.finish(args.json, rows=tms, goals=goals, mlp=mlp, keys=keys, bytes=bytes_rows,
                      encoder=enc, time=tms)


if __name__ == "__main__":
    H.run_as_main(__spec__)
