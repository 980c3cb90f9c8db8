"""The pretraining part of ``lowrank-jax demo`` ("Understanding Transformers for Time
Series", sec. 5, Fig. 7, App. K Tables 3-4).

On the real series that ship with aeon: pretrain a small dense Chronos-Bolt; compress it by
truncated SVD at several eps (no fine-tuning); pretrain compressed-by-design models at the
same budget with the flow-of-ranks schedule and with a uniform rank; compare size, measured
inference time, WQL and MASE relative to the dense model.

Where the time goes (2 CPU cores): compiling the three train steps and the forward of every
distinct model shape dominates, not the arithmetic. So every model is evaluated and timed
through one jitted forward (one compile per distinct tree of shapes: SVD variants that keep
every matrix dense reuse the dense model's), on one fixed-size batch shape, over the test
windows of all datasets at once; per-dataset scores are slices of that one pass.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax import timing
from lowrank_jax.analysis import eps_rank_from_sv, singular_values
from lowrank_jax.compress import ATTENTION_QKVO, compress, factorize_init, power_schedule
from lowrank_jax.datasets import builtin_datasets
from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import bias_of, is_leaf, layer_index, named_leaves, param_count
from lowrank_jax.losses import geometric_mean_relative, mase, wql
from lowrank_jax.models import chronos_bolt
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.recipes import outputs
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines
from lowrank_jax.train import fit, full_params
from lowrank_jax.train.data import WindowConfig, WindowSampler

QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
SVD_EPS = {False: (0.1, 0.3, 0.5, 0.7), True: (0.3, 0.7)}  # by quick: one compile per size
EVAL_BATCH = 256  # windows per forward call: one compiled shape for evaluation and timing
DEFAULT_STEPS = {False: 600, True: 40}  # by quick


def demo_config(quick: bool = False) -> ChronosBoltConfig:
    """A small Chronos-Bolt: d_model 64, 4 heads, patch 8, context 64, horizon 16; 4 encoder +
    2 decoder layers (``quick``: 2 + 1, which halves the train-step compile time)."""
    t5 = T5Config(
        vocab_size=2,
        d_model=64,
        d_kv=16,
        d_ff=256,
        num_layers=2 if quick else 4,
        num_decoder_layers=1 if quick else 2,
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


def check_steps(steps, name: str = "steps") -> int | None:
    """``None`` (the default number of steps) or an int >= 1.

    Raises:
      ConfigError: anything else (``0`` included: it is not silently replaced by a default).
    """
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        who = "" if name.startswith("--") else "demo: "  # an option: the command names itself
        raise ConfigError(f"{who}{name} must be an int >= 1 (training steps per model), got "
                          f"{steps!r}", where=name, expected="int >= 1", actual=steps)
    return int(steps)


def check_seed(seed, name: str = "seed") -> int:
    """An int >= 0.

    Raises:
      ConfigError: anything else.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        who = "" if name.startswith("--") else "demo: "
        raise ConfigError(f"{who}{name} must be an int >= 0, got {seed!r}", where=name,
                          expected="int >= 0", actual=seed)
    return int(seed)


def _is_attention(path: str) -> bool:
    return re.search(ATTENTION_QKVO[0], path) is not None


def _attention_params(params) -> int:
    return sum(
        param_count(leaf) - (0 if bias_of(leaf) is None else int(np.size(bias_of(leaf))))
        for path, leaf in named_leaves(params)
        if is_leaf(leaf) and _is_attention(path)
    )


def _uniform_rank_for_budget(schedule_report) -> int:
    """The uniform rank whose factorized size is closest to the schedule's."""
    dims = [r.details["shape"] for r in schedule_report.rows]
    target = schedule_report.params_after
    return min(range(1, 65), key=lambda r: abs(sum(r * (a + b) for a, b in dims) - target))


# ---------------------------------------------------------------------------------------------
# Evaluation: every test window of every dataset, one forward pass per model.

@dataclasses.dataclass(frozen=True)
class EvalWindows:
    """All test windows, dataset after dataset, scaled as :class:`WindowSampler` scales them.

    ``spans[name] = (start, stop)``: the rows of dataset ``name``. The windows are exactly
    those of ``WindowSampler(group, cfg, split='test', skip_short=True)`` per dataset, so the
    scores equal :func:`lowrank_jax.train.evaluate_forecaster` on each dataset's sampler.
    """

    context: np.ndarray  # [n, context_length] float32
    target: np.ndarray  # [n, horizon] float32
    spans: dict[str, tuple[int, int]]


def eval_windows(groups: dict, wcfg: WindowConfig) -> EvalWindows:
    """The test windows of every dataset in ``groups`` that has room for one."""
    ctx, tgt, spans, n = [], [], {}, 0
    for name, group in groups.items():
        try:
            count = WindowSampler(group, wcfg, split="test", batch_size=1, skip_short=True)
        except ValueError:  # the dataset's test split is shorter than one window
            continue
        k = count.num_windows
        b = WindowSampler(group, wcfg, split="test", batch_size=k, skip_short=True).batch(0)
        ctx.append(b["context"])
        tgt.append(b["target"])
        spans[name] = (n, n + k)
        n += k
    if not spans:
        raise ConfigError("demo: no dataset has room for one test window", where="datasets",
                          expected="a test split of at least one window", actual=list(groups))
    return EvalWindows(np.concatenate(ctx), np.concatenate(tgt), spans)


@functools.lru_cache(maxsize=4)
def make_forward(cfg: ChronosBoltConfig):
    """One jitted forecast per config; it compiles once per distinct tree of shapes, and runs
    of the same config in one process (several seeds) reuse its compilations."""
    return jax.jit(lambda p, c: chronos_bolt.forecast(p, c, cfg))


def _predict(fwd, params, context: np.ndarray, batch: int = EVAL_BATCH) -> np.ndarray:
    """``fwd`` over ``context`` in fixed-size batches (the last one zero-padded)."""
    out = []
    for start in range(0, len(context), batch):
        chunk = context[start:start + batch]
        pad = batch - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.zeros((pad, chunk.shape[1]), chunk.dtype)])
        out.append(np.asarray(fwd(params, chunk))[:batch - pad])
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _metrics(pred, target, context, spans: tuple, levels: tuple):
    """``[(wql, mase)]`` for the rows ``a:b`` of each span: one compiled program for every
    dataset (instead of one compile per operation and dataset size)."""
    median = pred[:, levels.index(0.5)] if 0.5 in levels else jnp.median(pred, 1)
    return [(wql(pred[a:b], target[a:b], levels), mase(median[a:b], target[a:b], context[a:b]))
            for a, b in spans]


def forecast_scores(fwd, params, windows: EvalWindows, levels=QUANTILES) -> dict:
    """WQL and MASE (Chronos' metrics, :mod:`lowrank_jax.losses`) of one model.

    Returns:
      ``{'pooled': {'wql', 'mase', 'n_windows'}, 'per_dataset': {name: {...}}}``.
    """
    pred = _predict(fwd, params, windows.context)
    pred = pred[:, :, :windows.target.shape[1]]  # [n, levels, horizon]
    levels = tuple(float(q) for q in levels)
    spans = ((0, len(pred)), *windows.spans.values())
    values = _metrics(pred, windows.target, windows.context, spans, levels)
    scores = [{"wql": float(w), "mase": float(m), "n_windows": b - a}
              for (w, m), (a, b) in zip(values, spans, strict=True)]
    return {"pooled": scores[0], "per_dataset": dict(zip(windows.spans, scores[1:], strict=True))}


def _time_ratios(fwd, variants: dict, context, runs: int) -> dict:
    """Median forward time of each variant over the dense one, measured interleaved
    (:func:`lowrank_jax.timing.time_interleaved`; compiled already by the evaluation)."""
    t = timing.time_interleaved(
        {name: (lambda p=p: jax.block_until_ready(fwd(p, context))) for name, p in variants.items()},
        runs=runs, warmup=1)
    return {name: t.ratio(name, "dense").value for name in variants}


# ---------------------------------------------------------------------------------------------
# The comparison.

def run_pretraining_demo(
    *,
    quick: bool = False,
    steps: int | None = None,
    seed: int = 0,
    plots_dir: str | None = None,
    progress: bool = True,
    datasets: tuple[dict, str] | None = None,
    status: Progress | None = None,
    overwrite: bool = False,
    plots_into: str | None = None,
) -> Outcome:
    """Run the comparison; return its rows and details, and its table as lines.

    Args:
      quick: the 2 + 1 layer model, 40 steps by default, fewer timing runs.
      steps: training steps per pretrained model (an int >= 1; default 600, quick 40).
      seed: seeds the initializations, the training batches' order and the factor draws.
      plots_dir: also save plots there, as :func:`lowrank_jax.recipes.run_demo` does
        (checked first, written whole at the end, never over what lowrank-jax did not write).
      progress: tqdm bars for training.
      datasets: ``builtin_datasets()``'s result, if already loaded.
      status: progress reporting (default: status lines on stderr, bars as ``progress``
        says).
      overwrite: replace ``plots_dir`` if it is a previous lowrank-jax plots directory.
      plots_into: instead of ``plots_dir``, an existing directory the plots are simply written
        into (the demo's own temporary plots directory).

    Returns:
      ``{'rows': [{'method', 'size_ratio', 'time_ratio', 'wql', 'mase', ...}], ...}`` with
      ``wql`` / ``mase`` the geometric means over datasets relative to the dense model; the
      training lines and the table as :attr:`~lowrank_jax.recipes.Outcome.lines`.

    Raises:
      ConfigError: ``steps`` or ``seed`` out of range, ``plots_dir`` not writable.
      OutputExistsError: ``plots_dir`` holds something that may not be replaced.
    """
    steps = check_steps(steps)
    seed = check_seed(seed)
    if plots_dir and plots_into:
        raise ConfigError("run_pretraining_demo: give plots_dir or plots_into, not both",
                          where="plots_into", expected="one of them", actual="both")
    if plots_dir:
        outputs.check_plots_out(plots_dir, {}, overwrite=overwrite)
    status = lines(status, "demo", bars=progress)
    text: list[str] = []
    t_start = time.perf_counter()
    cfg = demo_config(quick)
    steps = steps if steps is not None else DEFAULT_STEPS[bool(quick)]
    if datasets is None:
        with status.phase("loading the built-in series"):
            datasets = builtin_datasets()
    groups, source = datasets
    series = [s for g in groups.values() for s in g]
    wcfg = WindowConfig(
        context_length=cfg.context_length,
        horizon=cfg.prediction_length,
        stride=cfg.prediction_length,
    )
    train = WindowSampler(series, wcfg, split="train", batch_size=64, seed=seed, skip_short=True)
    windows = eval_windows(groups, wcfg)  # Chronos-style: scores per dataset
    n_test = len(windows.context)
    t5 = cfg.t5
    text.append("\n== Pretraining compressed Chronos-Bolt models (Understanding Transformers for "
                "Time Series, sec. 5) ==")
    text.append(f"model: Chronos-Bolt, {t5.num_layers}+{t5.num_decoder_layers} layers, d_model "
                f"{t5.d_model}, {t5.num_heads} heads; seed {seed}")
    text.append(
        f"data: {source}; {train.num_windows} train / {n_test} test windows of "
        f"{cfg.context_length} -> {cfg.prediction_length}; {steps} steps of batch 64 each"
    )
    loss_fn = chronos_bolt.loss(cfg)
    key = jax.random.PRNGKey(seed)
    training: dict = {}

    def train_model(params, name):
        status.say(f"training {name}: compiling its train step, then {steps} steps")
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
        seconds = time.perf_counter() - t0
        training[name] = {"steps_run": len(hist), "final_loss": hist[-1]["loss"],
                          "seconds": seconds}
        text.append(f"  trained {name:<26} final loss {hist[-1]['loss']:.4f} ({seconds:.0f} s)")
        return full_params(state)

    # compressed-by-design models at the same budget: flow-of-ranks vs uniform
    sched = power_schedule(4, 0.7, t5.num_layers, max_rank=t5.d_model)
    with status.phase("initializing the dense and the factorized models"):
        init = chronos_bolt.init(key, cfg)
        fact, frep = factorize_init(init, key=jax.random.fold_in(key, 2), schedule=sched)
        r_uni = _uniform_rank_for_budget(frep)
        uni, urep = factorize_init(init, key=jax.random.fold_in(key, 2), rank=r_uni)
    name_flow = f"pretrained flow-of-ranks {sched}"
    name_uni = f"pretrained uniform rank {r_uni}"

    dense = train_model(init, "dense")
    variants = {"dense": dense}
    sizes = {"dense": 1.0}
    same_as_dense = set()
    full_attn = _attention_params(dense)

    # 1. compress the pretrained dense model by truncated SVD (no fine-tuning), Table 2 of [1]
    svd_eps = SVD_EPS[bool(quick)]
    with status.phase(f"truncated SVD of the dense model at eps {', '.join(map(str, svd_eps))}"):
        for eps in svd_eps:
            small, rep = compress(dense, eps=eps, progress=False)
            name = f"svd eps={eps:g}"
            variants[name] = small
            sizes[name] = _attention_params(small) / full_attn
            if not any(r.changed for r in rep.rows):
                same_as_dense.add(name)

    # 2. pretrain the compressed-by-design models
    variants[name_flow] = train_model(fact, "flow-of-ranks")
    sizes[name_flow] = frep.ratio
    variants[name_uni] = train_model(uni, "uniform")
    sizes[name_uni] = urep.ratio

    # evaluate: WQL / MASE on every test window, and measured inference time, relative to dense
    fwd = make_forward(cfg)
    scores = {}
    status.say(f"evaluating {len(variants)} models on {n_test} test windows (one compile per "
               "distinct model shape)")
    for name in status.bar(list(variants), desc="evaluate", unit="model"):
        scores[name] = forecast_scores(fwd, variants[name], windows)
    runs = 5 if quick else 15
    with status.phase(f"timing the forward of every model ({runs} interleaved rounds)"):
        tratio = _time_ratios(fwd, variants, windows.context[:EVAL_BATCH], runs=runs)

    datasets_used = sorted(windows.spans)
    text.append(f"\n  {'method':<38} {'size':>6} {'time':>6} {'WQL':>7} {'MASE':>7}   (relative "
                f"to dense; WQL, MASE: geometric mean over {len(datasets_used)} datasets)")

    def rel(name, metric):
        return geometric_mean_relative(
            {d: m[metric] for d, m in scores[name]["per_dataset"].items()},
            {d: m[metric] for d, m in scores["dense"]["per_dataset"].items()})

    rows = []
    for name in variants:
        pooled = scores[name]["pooled"]
        row = {
            "method": name,
            "size_ratio": float(sizes[name]),
            "time_ratio": tratio[name],
            "wql": rel(name, "wql"),
            "mase": rel(name, "mase"),
            "wql_pooled_abs": pooled["wql"],
            "mase_pooled_abs": pooled["mase"],
            "per_dataset": scores[name]["per_dataset"],
            "params": param_count(variants[name]),
            "kept_dense": name in same_as_dense,
        }
        rows.append(row)
        note = "  (every matrix kept dense: factors would be larger)" if name in same_as_dense else ""
        text.append(
            f"  {name:<38} {row['size_ratio']:>6.3f} {row['time_ratio']:>6.3f} "
            f"{row['wql']:>7.3f} {row['mase']:>7.3f}{note}"
        )
    base = scores["dense"]["pooled"]
    text.append(f"  dense, all {base['n_windows']} test windows pooled: WQL {base['wql']:.4f}, "
                f"MASE {base['mase']:.4f}; size = parameters of the attention matrices; time = "
                f"median of interleaved forward calls on {EVAL_BATCH} windows")
    text.append("  One seed: differences of a few percent between the pretrained rows are within "
                "the seed-to-seed spread (the docs report mean and spread over 3 seeds).")

    ranks = _layer_ranks(dense)
    out = Outcome({
        "rows": rows,
        "config": {"encoder_layers": t5.num_layers, "decoder_layers": t5.num_decoder_layers,
                   "d_model": t5.d_model, "num_heads": t5.num_heads, "d_ff": t5.d_ff,
                   "context_length": cfg.context_length,
                   "prediction_length": cfg.prediction_length},
        "data": source,
        "datasets": datasets_used,
        "steps": steps,
        "training": training,
        "seed": seed,
        "schedule": sched,
        "uniform_rank": r_uni,
        "dense_layer_eps_rank": ranks["eps_rank"],
        "seconds": time.perf_counter() - t_start,
    }, lines=text)
    text = out.lines
    if plots_into:
        out["plots"] = _plots(plots_into, ranks, rows)
    elif plots_dir:
        with outputs.marked_directory(plots_dir, kind="plots", overwrite=overwrite,
                                      who="demo") as tmp:
            names = [os.path.basename(p) for p in _plots(tmp, ranks, rows)]
        out["plots"] = [os.path.join(plots_dir, n) for n in names]
        text.append(f"wrote {len(names)} plots to {plots_dir}: {', '.join(names)}")
    return out


def _layer_ranks(params) -> dict:
    """Spectra of the trained dense encoder's attention weights, and eps-rank per layer."""
    spectra: dict[int, list] = {}
    for path, leaf in named_leaves(params):
        if is_leaf(leaf) and path.startswith("encoder/") and _is_attention(path):
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
    return paths


__all__ = ["DEFAULT_STEPS", "EVAL_BATCH", "QUANTILES", "SVD_EPS", "EvalWindows", "check_seed",
           "check_steps", "demo_config", "eval_windows", "forecast_scores", "make_forward",
           "run_pretraining_demo"]
