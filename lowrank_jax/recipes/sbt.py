"""The ``sbt`` workflow: train a sparse binary transformer ("Sparse Binary Transformers for
Multivariate Time Series Modeling", Gorbett et al., KDD 2023, arXiv:2308.04637), or its dense
twin, on a dataset shipped with aeon, evaluate it (:mod:`lowrank_jax.recipes.sbt_tasks`), count
its bits and FLOPs (the paper's Table 5 convention and as executed), and plot or save it.

* ``classify``: JapaneseVowels (padded to 29 steps) or BasicMotions; test accuracy;
* ``anomaly``: ``kdd135`` (UCR/KDD-cup series 135) or ``ecg``; score = MSE of the last step of
  each window (step-T mask), thresholds by the ``1 - r`` quantile of validation scores and by
  POT (scipy's generalized Pareto fit), point-adjusted precision / recall / F1;
* ``forecast``: ``daphnet`` (9 channels, split by time); single-step MSE / MAE.

``out`` saves the trained model with its binary weights packed into bits
(:class:`~lowrank_jax.leaves.PackedBinary`); ``plots`` draws the training curves and, for
anomalies, the score series with both thresholds and the labelled and detected segments.
"""

from __future__ import annotations

import time

import numpy as np

from lowrank_jax.errors import ConfigError
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines

TASKS = ("classify", "anomaly", "forecast")
DEFAULT_DATASET = {"classify": "JapaneseVowels", "anomaly": "kdd135", "forecast": "daphnet"}
DEFAULT_PRUNE = {"classify": 0.5, "anomaly": 0.75, "forecast": 0.5}


def plot(result, directory: str) -> list[str]:
    """Training curves, and for anomaly detection the score series with both thresholds and the
    labelled / detected segments. Returns the file names written."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lowrank_jax.analysis.anomaly import segments

    files = []
    hist = result.history
    ep = [h["epoch"] for h in hist]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(ep, [h["train_loss"] for h in hist], label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    for key in ("test_accuracy", "train_accuracy", "val_mse"):
        if key in hist[0]:
            ax2.plot(ep, [h[key] for h in hist], "--", label=key.replace("_", " "))
    ax2.set_ylabel("accuracy" if "test_accuracy" in hist[0] else "validation MSE")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)
    kind = "dense" if not result.config.binary else f"SBT p={1 - result.config.keep:g}"
    ax.set_title(f"{result.dataset} ({kind}): training")
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "training.png"), dpi=120)
    plt.close(fig)
    files.append("training.png")
    if result.task == "anomaly":
        s, y = result.extra["scores"], result.extra["labels"]
        thr = result.extra["thresholds"]
        fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
        axes[0].plot(result.extra["test"][:, 0], lw=0.6, color="k")
        axes[0].set_ylabel("series (z)")
        axes[1].semilogy(np.maximum(s, 1e-12), lw=0.6, label="score (last-step MSE)")
        for name, c in (("quantile", "tab:orange"), ("pot", "tab:red")):
            axes[1].axhline(thr[name], color=c, ls="--", label=f"{name} threshold")
        for a, b in segments(y):
            for axx in axes:
                axx.axvspan(a, b, color="tab:green", alpha=0.3)
        for a, b in segments(s > thr["pot"]):
            axes[1].axvspan(a, max(b, a + 1), ymin=0.0, ymax=0.06, color="tab:red")
        axes[1].legend(fontsize=8, loc="upper left")
        axes[1].set_xlabel("test step (green: labelled anomalies; red ticks: flagged by POT)")
        fig.tight_layout()
        fig.savefig(os.path.join(directory, "anomaly_scores.png"), dpi=120)
        plt.close(fig)
        files.append("anomaly_scores.png")
    if result.task == "forecast":
        pred, tgt = result.extra["prediction"], result.extra["target"]
        n = min(600, len(pred))
        fig, ax = plt.subplots(figsize=(10, 3.2))
        ax.plot(tgt[:n, 0], lw=0.8, label="actual (channel 0)")
        ax.plot(pred[:n, 0], lw=0.8, label="forecast")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(directory, "forecast.png"), dpi=120)
        plt.close(fig)
        files.append("forecast.png")
    return files


def run_sbt(task: str, *, dataset: str | None = None, prune: float | None = None,
            dense: bool = False, epochs: int | None = None, batch_size: int | None = None,
            lr: float = 1e-3, d_model: int = 32, heads: int = 2, layers: int = 2,
            d_ff: int = 256, window: int = 50, seed: int = 0, out: str | None = None,
            plots: str | None = None, overwrite: bool = False,
            status: Progress | None = None) -> Outcome:
    """Train and evaluate a sparse binary transformer (or with ``dense`` its dense twin) on one
    of the paper's tasks (module docstring).

    Args:
      task: ``'classify'``, ``'anomaly'`` or ``'forecast'``.
      dataset: one of :data:`lowrank_jax.recipes.sbt_tasks.DATASETS` of the task (default:
        :data:`DEFAULT_DATASET`).
      prune: pruning rate p of the binary weights, in [0, 1) (keep = 1 - p; default
        :data:`DEFAULT_PRUNE`).
      dense: the dense transformer instead.
      epochs, batch_size: training epochs and batch (default: the task runner's).
      lr: Adam learning rate.
      d_model, heads, layers, d_ff: the model's sizes.
      window: the window of ``anomaly`` / ``forecast``.
      seed: initialization and batch order.
      out: save the trained model (binary weights packed) there.
      plots: draw the plots into this directory.
      overwrite: replace ``out`` / ``plots`` if lowrank-jax wrote them.
      status: progress reporting (default: status lines on stderr; one line per epoch).

    Returns:
      The report (``task``, ``dataset``, ``settings``, ``metrics``, ``history``, ``seconds``,
      ``paper_counts``, ``model_counts``, ``plots``), the metrics and counts as lines;
      ``values``: ``result`` (the task runner's :class:`~lowrank_jax.recipes.sbt_tasks.RunResult`).

    Raises:
      ConfigError: an unknown task or dataset, a pruning rate outside [0, 1).
    """
    from lowrank_jax.analysis import sbt_accounting as acc
    from lowrank_jax.recipes import outputs
    from lowrank_jax.recipes import sbt_tasks as tasks

    if task not in TASKS:
        raise ConfigError(f"sbt: unknown task {task!r}; choose one of {list(TASKS)}",
                          where="task", expected=list(TASKS), actual=task)
    dataset = dataset or DEFAULT_DATASET[task]
    if dataset not in tasks.DATASETS[task]:
        raise ConfigError(f"--dataset {dataset!r} is not available for '{task}'; choose "
                          f"one of {list(tasks.DATASETS[task])} (shipped with aeon)",
                          where="--dataset", expected=list(tasks.DATASETS[task]), actual=dataset)
    prune = DEFAULT_PRUNE[task] if prune is None else prune
    if not 0.0 <= prune < 1.0:
        raise ConfigError(f"--prune must be in [0, 1), got {prune}", where="--prune",
                          expected="[0, 1)", actual=prune)
    status = lines(status, "sbt")
    keep = 1.0 - prune
    kind = "dense" if dense else f"SBT (p = {prune:g}, keep {keep:g})"
    loaders = {"classify": tasks.load_classification_data, "anomaly": tasks.load_anomaly_data,
               "forecast": tasks.load_forecast_data}
    with status.phase(f"loading {dataset} (shipped with aeon)"):
        data = loaders[task](dataset)
    kw = dict(binary=not dense, keep=1.0 if dense else keep, seed=seed, lr=lr,
              d_model=d_model, num_heads=heads, d_ff=d_ff, num_layers=layers, data=data)
    if epochs is not None:
        kw["epochs"] = epochs
    if batch_size is not None:
        kw["batch"] = batch_size
    if task != "classify":
        kw["window"] = window

    def progress(rec):
        extra = "  ".join(f"{k} {v:.4f}" for k, v in rec.items()
                          if k not in ("epoch", "epochs", "seconds", "train_loss"))
        status.say(f"epoch {rec['epoch']}/{rec['epochs']}  train loss {rec['train_loss']:.4f}  "
                   f"{extra}  ({rec['seconds']:.0f} s)")

    status.say(f"training the {kind} on {dataset} ({task}); the first epoch "
               "includes compilation")
    t0 = time.perf_counter()
    result = tasks.RUNNERS[task](dataset, progress=progress, **kw)
    seconds = time.perf_counter() - t0
    cfg = result.config
    m = result.metrics
    text = []
    if task == "classify":
        text.append(f"{dataset} {kind}: test accuracy {100 * m['accuracy']:.2f}%")
    elif task == "anomaly":
        for name in ("quantile", "pot"):
            e = m[name]
            text.append(f"{dataset} {kind}: {name:>8} threshold {e['threshold']:.4g}  P "
                        f"{e['precision']:.3f} R {e['recall']:.3f} F1 {e['f1']:.3f} "
                        "(point-adjusted)")
    else:
        text.append(f"{dataset} {kind}: test MSE {m['mse']:.4f} MAE {m['mae']:.4f} "
                    f"(last-value baseline MSE {m['naive_mse']:.4f})")
    paper = acc.paper_counts(acc.PaperConfig(
        name=dataset, task={"classify": "classification"}.get(task, task), m=cfg.n_features,
        w=cfg.window, d=cfg.d_model, keep=keep if keep > 0 else 1.0, n_out=cfg.n_out,
        heads=cfg.num_heads, layers=cfg.num_layers, d_ff=cfg.d_ff))
    honest = acc.model_counts(result.params, cfg)
    text.append(f"paper convention (Table 5): dense {paper['dense_bits']:,} bits, "
                f"{paper['dense_flops']:,} FLOPs; SBT {paper['sbt_bits']:,} bits, "
                f"{paper['sbt_flops']:,} FLOPs (x{paper['size_ratio']:.1f} size, "
                f"x{paper['flops_ratio']:.1f} FLOPs)")
    text.append(f"this model as executed: {honest['flops_per_token']:,.0f} multiply-adds per "
                f"step; stored {honest['packed_bits']:,} bits packed")
    report = Outcome({"task": task, "dataset": dataset, "settings": {
        "dense": dense, "prune": prune, "seed": seed, "d_model": d_model,
        "heads": heads, "layers": layers, "d_ff": d_ff,
        "window": cfg.window, "epochs": len(result.history)},
        "metrics": m, "history": result.history, "seconds": round(seconds, 1),
        "paper_counts": paper, "model_counts": honest}, lines=text, values={"result": result})
    text = report.lines
    if plots:
        with status.phase(f"plotting to {plots}"), outputs.marked_directory(
                plots, kind="plots", overwrite=overwrite, who="sbt") as tmp:
            report["plots"] = plot(result, tmp)
        text.append(f"wrote plots to {plots}")
    if out:
        from lowrank_jax.io import save_model
        from lowrank_jax.leaves import pack_binary_tree

        with status.phase(f"saving to {out} (binary weights packed)"), \
                outputs.writing_checkpoint(out, overwrite=overwrite):
            save_model(out, cfg, pack_binary_tree(result.params), state=result.state,
                       metadata={"sbt": report["settings"]}, overwrite=overwrite)
        text.append(f"saved the model to {out}")
    return report


__all__ = ["DEFAULT_DATASET", "DEFAULT_PRUNE", "TASKS", "plot", "run_sbt"]
