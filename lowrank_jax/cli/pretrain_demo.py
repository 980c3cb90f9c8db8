"""The pretraining part of ``lowrank-jax demo`` ("Understanding Transformers for Time
Series", sec. 5, Fig. 7, App. K Tables 3-4).

On the real series that ship with aeon: pretrain a small dense Chronos-Bolt; compress it by
truncated SVD at several eps (no fine-tuning); pretrain compressed-by-design models at the
same budget with the flow-of-ranks schedule and with a uniform rank; compare size, measured
inference time, WQL and MASE relative to the dense model.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from lowrank_jax.analysis import eps_rank_from_sv, singular_values
from lowrank_jax.compress import ATTENTION_QKVO, compress, factorize_init, power_schedule
from lowrank_jax.datasets import builtin_datasets
from lowrank_jax.leaves import Leaf, bias_of, layer_index, named_leaves, param_count
from lowrank_jax.losses import geometric_mean_relative
from lowrank_jax.models import chronos_bolt
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.train import evaluate_forecaster, fit, full_params
from lowrank_jax.train.data import WindowConfig, WindowSampler

QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def demo_config() -> ChronosBoltConfig:
    """A small Chronos-Bolt: 4 encoder + 2 decoder layers, d_model 64, 4 heads, patch 8."""
    t5 = T5Config(
        vocab_size=2,
        d_model=64,
        d_kv=16,
        d_ff=256,
        num_layers=4,
        num_decoder_layers=2,
        num_heads=4,
        feed_forward_proj="relu",
    )
    return ChronosBoltConfig(
        t5=t5,
        context_length=64,
        prediction_length=16,
        input_patch_size=8,
        input_patch_stride=8,
        quantiles=QUANTILES,
        use_reg_token=True,
    )


def _attention_params(params) -> int:
    return sum(
        param_count(leaf) - (0 if bias_of(leaf) is None else int(np.size(bias_of(leaf))))
        for path, leaf in named_leaves(params)
        if isinstance(leaf, Leaf) and _is_attention(path)
    )


def _is_attention(path: str) -> bool:
    import re

    return re.search(ATTENTION_QKVO[0], path) is not None


def _time_ratios(cfg, variants: dict, context, runs: int) -> dict:
    fwd = jax.jit(lambda p, c: chronos_bolt.forecast(p, c, cfg))
    times = {name: [] for name in variants}
    for p in variants.values():
        jax.block_until_ready(fwd(p, context))  # compile
    for _ in range(runs):  # interleaved: machine noise hits every variant alike
        for name, p in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fwd(p, context))
            times[name].append(time.perf_counter() - t0)
    base = np.median(times["dense"])
    return {name: float(np.median(t) / base) for name, t in times.items()}


def _uniform_rank_for_budget(params, schedule_report) -> int:
    """The uniform rank whose factorized size is closest to the schedule's."""
    dims = [r.details["shape"] for r in schedule_report.rows]
    target = schedule_report.params_after
    best = min(range(1, 65), key=lambda r: abs(sum(r * (a + b) for a, b in dims) - target))
    return best


def run_pretraining_demo(
    *,
    quick: bool = False,
    steps: int | None = None,
    seed: int = 0,
    plots_dir: str | None = None,
    progress: bool = True,
) -> dict:
    """Run the comparison, print its table, return rows and details as a JSON-able dict."""
    t_start = time.perf_counter()
    cfg = demo_config()
    steps = steps or (40 if quick else 600)
    groups, source = builtin_datasets()
    series = [s for g in groups.values() for s in g]
    wcfg = WindowConfig(
        context_length=cfg.context_length,
        horizon=cfg.prediction_length,
        stride=cfg.prediction_length,
    )
    train = WindowSampler(series, wcfg, split="train", batch_size=64, seed=seed, skip_short=True)
    test = WindowSampler(series, wcfg, split="test", batch_size=256, seed=seed, skip_short=True)
    # Chronos-style scores: per dataset, aggregated by geometric mean relative to dense.
    test_sets = {}
    for name, group in groups.items():
        try:
            test_sets[name] = WindowSampler(group, wcfg, split="test", batch_size=256, seed=seed,
                                            skip_short=True)
        except ValueError:  # the dataset's test split is shorter than one window
            continue
    print("\n== Pretraining compressed Chronos-Bolt models (Understanding Transformers for Time "
          "Series, sec. 5) ==")
    print(
        f"data: {source}; {train.num_windows} train / {test.num_windows} test windows of "
        f"{cfg.context_length} -> {cfg.prediction_length}; {steps} steps of batch 64 each"
    )
    loss_fn = chronos_bolt.loss(cfg)
    key = jax.random.PRNGKey(seed)
    init = chronos_bolt.init(key, cfg)

    def train_model(params, name):
        t0 = time.perf_counter()
        state, hist = fit(
            loss_fn,
            params,
            train,
            steps=steps,
            key=jax.random.fold_in(key, 1),
            progress=progress,
            desc=name,
        )
        print(
            f"  trained {name:<26} final loss {hist[-1]['loss']:.4f} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        return full_params(state)

    dense = train_model(init, "dense")
    variants = {"dense": dense}
    sizes = {"dense": 1.0}
    full_attn = _attention_params(dense)

    # 1. compress the pretrained dense model by truncated SVD (no fine-tuning), Table 2 of [1]
    for eps in (0.1, 0.3, 0.5, 0.7):
        small, rep = compress(dense, eps=eps, progress=False)
        variants[f"svd eps={eps:g}"] = small
        sizes[f"svd eps={eps:g}"] = _attention_params(small) / full_attn

    # 2. pretrain compressed-by-design at the same budget: flow-of-ranks vs uniform
    sched = power_schedule(4, 0.7, cfg.t5.num_layers, max_rank=cfg.t5.d_model)
    fact, frep = factorize_init(init, key=jax.random.fold_in(key, 2), schedule=sched)
    r_uni = _uniform_rank_for_budget(init, frep)
    uni, urep = factorize_init(init, key=jax.random.fold_in(key, 2), rank=r_uni)
    name_flow = f"pretrained flow-of-ranks {sched}"
    name_uni = f"pretrained uniform rank {r_uni}"
    variants[name_flow] = train_model(fact, "flow-of-ranks")
    sizes[name_flow] = frep.ratio
    variants[name_uni] = train_model(uni, "uniform")
    sizes[name_uni] = urep.ratio

    # evaluate: WQL / MASE on the test split, and measured inference time, relative to dense
    scores = {name: evaluate_forecaster(cfg, p, test) for name, p in variants.items()}
    per_ds = {name: {ds: evaluate_forecaster(cfg, p, smp) for ds, smp in test_sets.items()}
              for name, p in variants.items()}
    ctx = np.asarray(test.batch(0)["context"])
    tratio = _time_ratios(cfg, variants, ctx, runs=5 if quick else 20)
    base = scores["dense"]
    rows = []
    print(f"\n  {'method':<38} {'size':>6} {'time':>6} {'WQL':>7} {'MASE':>7}   (relative to dense; "
          f"WQL, MASE: geometric mean over {len(test_sets)} datasets)")

    def rel(name, metric):
        return geometric_mean_relative({d: m[metric] for d, m in per_ds[name].items()},
                                       {d: m[metric] for d, m in per_ds["dense"].items()})

    for name in variants:
        row = {
            "method": name,
            "size_ratio": sizes[name],
            "time_ratio": tratio[name],
            "wql": rel(name, "wql"),
            "mase": rel(name, "mase"),
            "wql_pooled_abs": scores[name]["wql"],
            "mase_pooled_abs": scores[name]["mase"],
            "per_dataset": per_ds[name],
            "params": param_count(variants[name]),
        }
        rows.append(row)
        print(
            f"  {name:<38} {row['size_ratio']:>6.3f} {row['time_ratio']:>6.3f} "
            f"{row['wql']:>7.3f} {row['mase']:>7.3f}"
        )
    print(f"  dense, all {base['n_windows']} test windows pooled: WQL {base['wql']:.4f}, "
          f"MASE {base['mase']:.4f}; size = parameters of the attention matrices")

    ranks = _layer_ranks(dense)
    out = {
        "rows": rows,
        "data": source,
        "datasets": sorted(test_sets),
        "steps": steps,
        "schedule": sched,
        "uniform_rank": r_uni,
        "dense_layer_eps_rank": ranks["eps_rank"],
        "seconds": time.perf_counter() - t_start,
    }
    if plots_dir:
        out["plots"] = _plots(plots_dir, ranks, rows)
    return out


def _layer_ranks(params) -> dict:
    """Spectra of the trained dense encoder's attention weights, and eps-rank per layer."""
    spectra: dict[int, list] = {}
    for path, leaf in named_leaves(params):
        if isinstance(leaf, Leaf) and path.startswith("encoder/") and _is_attention(path):
            spectra.setdefault(layer_index(path), []).append(singular_values(leaf, name=path))
    eps_rank = {
        f"{e:g}": [
            float(np.mean([eps_rank_from_sv(s, e) for s in spectra[i]])) for i in sorted(spectra)
        ]
        for e in (0.01, 0.05, 0.1, 0.2)
    }
    q_spectra = {i: spectra[i][0] for i in sorted(spectra)}
    return {"eps_rank": eps_rank, "spectra": q_spectra}


def _plots(plots_dir: str, ranks: dict, rows: list[dict]) -> list[str]:
    from lowrank_jax.analysis.plots import plot_layer_ranks, plot_spectra, pyplot

    os.makedirs(plots_dir, exist_ok=True)
    paths = [
        plot_spectra(
            list(ranks["spectra"].values()),
            [f"encoder layer {i}" for i in ranks["spectra"]],
            os.path.join(plots_dir, "pretrained_singular_values.png"),
            title="trained dense Chronos-Bolt: singular values of one attention weight",
        ),
        plot_layer_ranks(
            list(ranks["spectra"]),
            {float(k): v for k, v in ranks["eps_rank"].items()},
            os.path.join(plots_dir, "pretrained_eps_rank_per_layer.png"),
            title="flow-of-ranks: mean eps-rank of attention weights per layer",
        ),
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "os^vD<>p*h"
    for i, r in enumerate(rows):
        ax.scatter(r["time_ratio"], r["wql"], s=30 + 150 * r["size_ratio"], marker=markers[i % 10],
                   alpha=0.8, label=f"{r['method'].replace('pretrained ', '')} (size {r['size_ratio']:.2f})")
    ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("inference time relative to dense")
    ax.set_ylabel("WQL relative to dense")
    ax.set_title("time-accuracy frontier (marker size ~ size ratio)")
    fig.tight_layout()
    path = os.path.join(plots_dir, "time_accuracy_frontier.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    for p in paths:
        print(f"wrote {p}")
    return paths
