"""The ``prune`` workflow: prune-then-finetune of "Less is More: Unlocking Specialization of
Time Series Foundation Models via Structured Pruning" (arXiv:2505.23195) on a forecasting model
(Chronos-Bolt, Chronos).

1. the series (``builtin``: the real series shipped with aeon; or an ETT-style CSV file,
   one series per column) are split by time into train / validation / test (70 / 10 / 20 %);
2. every attention and MLP projection gets input and output channel masks (eq. 4), and
   ``prune_steps`` training batches prune them progressively and globally (importance of
   eqs. 5-6 averaged over each batch, EMA, Algorithm 1) until ``target`` of the prunable
   parameters (``flops_target``: of their FLOPs) is removed;
3. the masked channels are removed physically (fewer heads, narrower query/key, value and MLP
   widths, row/column slices of residual-width channels); the largest difference between the
   masked and the pruned model on a validation batch is reported;
4. ``finetune_steps`` steps of fine-tuning of the pruned model (all its weights, or LoRA
   updates with ``lora=RANK``) with the family's loss;
5. validation and test WQL / MASE before pruning, after pruning and after fine-tuning.

A decoder-only language model (GPT-2, Llama-style) takes the workflow of
:mod:`lowrank_jax.recipes.prune_lm` instead: query heads, whole key-value groups and MLP
channels, scored and fine-tuned on text with the next-token loss, held-out perplexity.

The result has a per-layer table of the kept heads and channels (:func:`format_table`);
``plots`` draws the pruned fraction of the input and the output channels per layer and weight
(the paper's Fig. 6) and the pruning history (:func:`plot`); ``out`` saves the pruned (and
fine-tuned) model.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np

from lowrank_jax.errors import ConfigError
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines

SPLITS = (0.7, 0.1, 0.2)
#: Weight names in the plots and table, from the end of their paths.
SHORT = (("self_attn/qk/q", "self q"), ("self_attn/qk/k", "self k"), ("self_attn/v", "self v"),
         ("self_attn/o", "self o"), ("cross_attn/qk/q", "cross q"),
         ("cross_attn/qk/k", "cross k"), ("cross_attn/v", "cross v"), ("cross_attn/o", "cross o"),
         ("attn/qk/q", "q"), ("attn/qk/k", "k"), ("attn/v", "v"), ("attn/o", "o"),
         ("mlp/wi_0", "wi_0"), ("mlp/wi_1", "wi_1"), ("mlp/wi", "wi"), ("mlp/wo", "wo"))


def load_series(data: str) -> tuple[list, list[str], str]:
    """``(series, names, description)``: the built-in aeon series, or the columns of an
    ETT-style CSV file."""
    if data == "builtin":
        from lowrank_jax.train import default_series

        series, source = default_series()
        return list(series), [f"builtin {i}" for i in range(len(series))], source
    from lowrank_jax.train import load_ett_csv

    names, values = load_ett_csv(data)
    return [values[:, j] for j in range(values.shape[1])], list(names), f"{data} ({len(names)} " \
        "columns)"


def short_name(path: str) -> str:
    """``'encoder/layers/3/attn/qk/q'`` -> ``'q'`` (see :data:`SHORT`)."""
    for tail, name in SHORT:
        if path.endswith(tail):
            return name
    return path.rsplit("/", 1)[-1]


def layer_key(path: str) -> tuple[int, int, str]:
    """Sort key and label of a path's layer: encoder layers first, then decoder layers."""
    m = re.search(r"(?:^|/)(encoder|decoder)?/?layers/(\d+)/", path)
    if not m:
        return (2, 0, path.rsplit("/", 2)[0])
    stack = m.group(1) or ""
    i = int(m.group(2))
    order = 1 if stack == "decoder" else 0
    return (order, i, f"{stack[:3]}{i}" if stack else f"layer{i}")


def format_table(rows: list[dict]) -> str:
    """The per-layer table: kept heads (and their original ids), query/key and value channels
    of every attention block, hidden channels of every MLP."""
    lines = [f"{'block':<36}{'heads':>8}{'q/k ch':>10}{'v ch':>10}{'hidden':>10}  kept head ids"]
    for r in rows:
        if r["kind"] == "attention":
            qk = f"{r['qk']}/{r['qk_total']}" if "qk" in r else "-"
            lines.append(f"{r['path']:<36}{r['heads']:>4}/{r['heads_total']:<3}{qk:>10}"
                         f"{r['v']:>6}/{r['v_total']:<3}{'':>10}  {r['ids']}")
        elif r["kind"] == "mlp":
            lines.append(f"{r['path']:<36}{'':>8}{'':>10}{'':>10}"
                         f"{r['hidden']:>6}/{r['hidden_total']:<3}")
    return "\n".join(lines)


def plot(weights: list[dict], history: list[dict], directory: str) -> list[str]:
    """The paper's Fig. 6 (pruned fraction of the input and of the output channels of every
    weight, per layer) and the pruning history (removed fraction and loss per batch).

    Returns:
      The file names written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({layer_key(w["path"]) for w in weights})
    pos = {k: i for i, k in enumerate(layers)}
    present = {short_name(w["path"]) for w in weights}
    order = [n for _, n in SHORT]
    names = sorted(present, key=lambda n: (order.index(n) if n in order else len(order), n))
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.45 * len(layers) + 2), 6.5), sharex=True)
    for ax, side, title in ((axes[0], "in", "input channels"),
                            (axes[1], "out", "output channels")):
        grid = np.full((len(names), len(layers)), np.nan)
        for w in weights:
            grid[names.index(short_name(w["path"])), pos[layer_key(w["path"])]] = \
                w[f"{side}_pruned_fraction"]
        im = ax.imshow(grid, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"pruned fraction of {title}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.03)
    axes[1].set_xticks(range(len(layers)), [k[2] for k in layers], rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "fig6_pruned_fraction.png"), dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["params_fraction"] for h in history], "o-", label="parameters removed")
    ax.plot(steps, [h["flops_fraction"] for h in history], "s-", label="FLOPs removed")
    ax.plot(steps, [h["scheduled"] for h in history], ":", label="schedule")
    ax.set_xlabel("pruning batch")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.plot(steps, [h["loss"] for h in history], "k--", alpha=0.5, label="loss (masked)")
    ax2.set_ylabel("loss")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "pruning_history.png"), dpi=110)
    plt.close(fig)
    return ["fig6_pruned_fraction.png", "pruning_history.png"]


def evaluate_windows(forecast, sampler, levels: tuple, max_batches: int) -> dict:
    """WQL and MASE (``lowrank_jax.losses``) of ``forecast(context) -> [batch, levels,
    prediction_length]`` over the windows of ``sampler``, as
    :func:`lowrank_jax.train.evaluate_forecaster` computes them, with one compiled forecast
    reused for every model of the same structure."""
    from lowrank_jax.losses import mase, wql

    n = min(max_batches, sampler.batches_per_epoch)
    preds, targets, contexts = [], [], []
    for pos in range(n):
        b = sampler.batch(pos)
        h = b["target"].shape[1]
        preds.append(np.asarray(forecast(b["context"]))[:, :, :h])
        targets.append(b["target"])
        contexts.append(b["context"])
    keep = min(sampler.num_windows, n * sampler.batch_size)
    pred, target, context = (np.concatenate(a)[:keep] for a in (preds, targets, contexts))
    median = pred[:, levels.index(0.5)] if 0.5 in levels else np.median(pred, 1)
    return {"wql": float(wql(pred, target, levels)),
            "mase": float(mase(median, target, context)), "n_windows": int(keep)}


def run_prune(model: str, *, target: float | None = None, flops_target: bool = False,
              data: str | None = None, context_length: int | None = None,
              prune_steps: int = 20, batch_size: int = 32, alpha: float | None = None,
              schedule: str | None = None, finetune_steps: int = 0, lr: float = 1e-4, lora: int = 0,
              rules: list[str] | None = None, eval_batches: int = 8, seed: int = 0,
              family: str | None = None, out: str | None = None, plots: str | None = None,
              overwrite: bool = False, heads: float | None = None,
              kv_groups: float | None = None, mlp: float | None = None,
              mlp_equal: bool = False,
              text: str | None = None, tokenizer: str | None = None,
              seq_len: int | None = None, status: Progress | None = None) -> Outcome:
    """Prune then fine-tune a forecaster (module docstring), or a decoder-only language model
    (GPT-2, Llama-style: :func:`lowrank_jax.recipes.prune_lm.prune_language_model`, with
    ``heads``, ``kv_groups``, ``mlp``, ``mlp_equal``, ``text``, ``tokenizer`` and ``seq_len``).

    The options of one kind of model are refused for the other (a one-line
    :class:`~lowrank_jax.errors.ConfigError` naming the option): ``target``, ``flops_target``,
    ``data``, ``context_length``, ``rules``, ``plots``, ``alpha`` and ``schedule`` are the
    forecaster's; ``heads``, ``kv_groups``, ``mlp``, ``mlp_equal``, ``text``, ``tokenizer`` and
    ``seq_len`` the language model's.

    Args:
      model: a lowrank_jax model checkpoint or a Hugging Face directory of a forecasting family
        or of a decoder-only language model.
      target: fraction of the prunable parameters (``flops_target``: FLOPs) to remove, in
        [0, 1) (default 0.5).
      flops_target: ``target`` is a fraction of the prunable FLOPs.
      data: ``'builtin'`` (default) or an ETT-style CSV file (:func:`load_series`).
      context_length: context of the windows (default: the model's, at most 512).
      prune_steps: pruning batches B of Algorithm 1.
      batch_size: windows per pruning and fine-tuning batch.
      alpha: EMA coefficient of the importance (default 0.5).
      schedule: how the removed fraction grows over the pruning batches (``'cubic'``, the
        default, or ``'linear'``).
      finetune_steps: fine-tuning steps after pruning (AdamW, warmup over 5 % of the steps,
        cosine decay from ``lr``).
      lr: peak learning rate of the fine-tuning.
      lora: fine-tune LoRA updates of this rank instead of all weights (0: all weights).
      rules: path regexes of the weights to prune (first match wins; ``'!regex'`` skips);
        default: every attention and MLP projection.
      eval_batches: at most this many batches of 64 windows per evaluation.
      seed: seed of the batches.
      family: force the model family of a Hugging Face directory.
      out: save the pruned (and fine-tuned) model there.
      plots: draw the pruned-fraction plots into this directory.
      overwrite: replace ``out`` / ``plots`` if lowrank-jax wrote them.
      heads, kv_groups, mlp, mlp_equal, text, tokenizer, seq_len: a language model's (see
        :func:`~lowrank_jax.recipes.prune_lm.prune_language_model`).
      status: progress reporting (default: status lines on stderr).

    Returns:
      For a language model, :func:`~lowrank_jax.recipes.prune_lm.prune_language_model`'s
      report. For a forecaster, the report (windows, settings, fractions removed, parameters
      before and after, the per-layer table, the pruning history, ``before`` / ``pruned`` / ``finetuned``
      evaluations), the table and scores as lines; ``values``: ``params`` (the final tree) and
      ``config``.

    Raises:
      ConfigError: ``model`` has no model config, is neither a forecaster nor a language
        model, or an option of the other kind of model is given.
    """
    import jax

    from lowrank_jax import execution, param_count
    from lowrank_jax.compress.prune import (
        DEFAULT_RULES,
        add_channel_masks,
        add_lora_to,
        check_removal,
        layer_table,
        progressive_prune,
        token_counts,
    )
    from lowrank_jax.models import family_of
    from lowrank_jax.recipes import outputs, sources
    from lowrank_jax.train import (
        WindowConfig,
        WindowSampler,
        default_optimizer,
        fit,
        full_params,
    )

    status = lines(status, "prune")
    src = sources.load_source(model, status=status, family=family)
    cfg, params = src.config, src.params
    if cfg is None:
        raise ConfigError(f"{model} holds bare parameters without a model config; prune "
                          "needs a model checkpoint (save_model) or a Hugging Face directory",
                          where="MODEL", expected="a model checkpoint", actual="parameters only")
    fam = family_of(cfg)
    from lowrank_jax.recipes import prune_lm

    lm_options = {"--heads": heads, "--kv-groups": kv_groups, "--mlp": mlp,
                  "--mlp-equal": mlp_equal or None, "--text": text, "--tokenizer": tokenizer,
                  "--seq-len": seq_len}
    if prune_lm.is_language_model(cfg):
        forecaster_options = {"--target": target, "--flops-target": flops_target or None,
                              "--data": data, "--context-length": context_length,
                              "--rule": rules, "--plots": plots, "--alpha": alpha,
                              "--schedule": schedule}
        for flag, value in forecaster_options.items():
            if value is not None:
                raise ConfigError(
                    f"prune: {flag} is for forecasters; {fam.name!r} is a language model "
                    "(prune it with --heads, --kv-groups and --mlp on --text)", where=flag,
                    expected="not given for a language model", actual=value)
        return prune_lm.prune_language_model(
            src, heads=heads or 0.0, kv_groups=kv_groups or 0.0, mlp=mlp or 0.0,
            mlp_equal=mlp_equal, text=text,
            tokenizer=tokenizer, seq_len=seq_len, prune_steps=prune_steps,
            batch_size=batch_size, finetune_steps=finetune_steps, lr=lr, lora=lora, eval_batches=eval_batches,
            seed=seed, out=out, overwrite=overwrite, status=status)
    for flag, value in lm_options.items():
        if value is not None:
            raise ConfigError(f"prune: {flag} is for decoder-only language models; "
                              f"{fam.name!r} is not one", where=flag,
                              expected="not given for this model", actual=value)
    target = 0.5 if target is None else target
    data = "builtin" if data is None else data
    alpha = 0.5 if alpha is None else alpha
    schedule = "cubic" if schedule is None else schedule
    if fam.forecast is None or fam.batch_from_windows is None or fam.loss is None:
        raise ConfigError(f"prune: the command prunes forecasters on series windows; family "
                          f"{fam.name!r} is neither one nor a decoder-only language model (use "
                          "lowrank_jax.compress.prune.prune_model with batches of your own)", where="MODEL",
                          expected="a forecasting family", actual=fam.name)
    series, names, source = load_series(data)
    ctx = context_length or min(int(cfg.context_length), 512)
    horizon = int(cfg.prediction_length)
    wcfg = WindowConfig(context_length=ctx, horizon=horizon, stride=horizon, splits=SPLITS)
    with status.phase(f"cutting windows of {ctx} + {horizon} values from {source}"):
        train_s = WindowSampler(series, wcfg, "train", batch_size=batch_size,
                                seed=seed, names=names, skip_short=True)
        val_s = WindowSampler(series, wcfg, "val", batch_size=64, seed=seed, names=names,
                              skip_short=True)
        test_s = WindowSampler(series, wcfg, "test", batch_size=64, seed=seed, names=names,
                               skip_short=True)

    def batch_of(w):
        return fam.batch_from_windows(cfg, np.asarray(w["context"]), np.asarray(w["target"]))

    fwd = jax.jit(lambda p, c: fam.forecast(p, c, cfg))  # compiled once per tree structure
    levels = tuple(float(q) for q in fam.forecast_levels(cfg))

    def evaluate(p, what):
        with status.phase(f"evaluating {what} on the validation and test windows"):
            return {split: evaluate_windows(lambda c: fwd(p, c), s, levels, eval_batches)
                    for split, s in (("val", val_s), ("test", test_s))}

    report = Outcome({
        "model": model, "family": fam.name, "data": source,
        "windows": {"context_length": ctx, "horizon": horizon, "splits": list(SPLITS),
                    "train": train_s.num_windows, "val": val_s.num_windows,
                    "test": test_s.num_windows},
        "settings": {"target": target, "by": "flops" if flops_target else "params",
                     "prune_steps": prune_steps, "batch_size": batch_size, "alpha": alpha,
                     "schedule": schedule, "finetune_steps": finetune_steps, "lr": lr,
                     "lora": lora, "seed": seed}})
    text = report.lines
    report["before"] = evaluate(params, "the original model")
    rules = sources.parse_rules(rules, DEFAULT_RULES)
    masked = add_channel_masks(params, rules)
    with status.phase("counting the rows every weight sees (abstract trace)"):
        tokens = token_counts(cfg, params)
    status.say(f"pruning: {prune_steps} batches of {batch_size} windows, target "
               f"{target:.0%} of the {'FLOPs' if flops_target else 'parameters'}")
    t0 = time.perf_counter()
    res = progressive_prune(masked, fam.loss(cfg), lambda j: batch_of(train_s.batch(j)),
                            target=target, steps=prune_steps,
                            by="flops" if flops_target else "params", alpha=alpha,
                            schedule=schedule, tokens=tokens, config=cfg,
                            progress=status.bars)
    prune_s = time.perf_counter() - t0
    with status.phase("removing the pruned channels"):
        pruned = res.structure.remove(res.removal)
        check_removal(res.structure, res.removal, pruned)
    with status.phase("comparing the masked and the pruned model on a validation batch"), \
            execution.reference_precision():  # a parity check: full float32 on any backend
        c = np.asarray(val_s.batch(0)["context"])
        diff = float(np.max(np.abs(np.asarray(fwd(res.params, c)) - np.asarray(fwd(pruned, c)))))
    table = layer_table(res.structure, res.removal)
    text.append(format_table(table))
    p0, p1 = param_count(params), param_count(pruned)
    text.append(f"\nprunable weights: {res.params_fraction:.1%} of the parameters and "
                f"{res.flops_fraction:.1%} of the FLOPs removed; model parameters {p0} -> {p1} "
                f"({p1 / p0:.3f}); max |masked - pruned| = {diff:.2e}")
    report.update({"params_fraction": res.params_fraction, "flops_fraction": res.flops_fraction,
                   "params_before": p0, "params_after": p1, "max_abs_diff_masked": diff,
                   "prune_seconds": prune_s, "layers": table,
                   "history": [{k: v for k, v in h.items() if k != "removed"}
                               for h in res.history]})
    report["pruned"] = evaluate(pruned, "the pruned model")
    final = pruned
    if finetune_steps:
        tuned = pruned
        if lora:
            tuned = add_lora_to(pruned, rules, rank=lora,
                                key=jax.random.PRNGKey(seed + 1))
        status.say(f"fine-tuning {'LoRA updates of rank ' + str(lora) if lora else 'all'}"
                   f" weights: {finetune_steps} steps")
        opt = default_optimizer(learning_rate=lr, total_steps=finetune_steps,
                                warmup_steps=finetune_steps // 20)
        state, hist = fit(fam.loss(cfg), tuned, train_s, steps=finetune_steps,
                          key=jax.random.PRNGKey(seed), batch_fn=batch_of, optimizer=opt,
                          progress=status.bars, desc="fine-tune")
        final = full_params(state)
        report["finetune_loss"] = [h["loss"] for h in hist]
        report["finetuned"] = evaluate(final, "the fine-tuned model")
    for stage in ("before", "pruned", "finetuned"):
        if stage in report:
            e = report[stage]
            text.append(f"{stage:<10} val WQL {e['val']['wql']:.4f} MASE "
                        f"{e['val']['mase']:.4f}   test WQL {e['test']['wql']:.4f} MASE "
                        f"{e['test']['mase']:.4f}")
    if plots:
        weights = [r for r in table if r["kind"] == "weight"]
        with status.phase(f"plotting to {plots}"), outputs.marked_directory(
                plots, kind="plots", overwrite=overwrite, who="prune") as tmp:
            report["plots"] = plot(weights, report["history"], tmp)
        text.append(f"wrote plots to {plots}")
    if out:
        from lowrank_jax.io import save_model

        meta = {**src.metadata, "prune": report["settings"]}
        with status.phase(f"saving to {out}"), outputs.writing_checkpoint(
                out, overwrite=overwrite):
            save_model(out, cfg, final, metadata=meta, overwrite=overwrite,
                       extra_files=src.extra_files())
        text.append(f"saved the pruned model to {out}")
    report.values.update(params=final, config=cfg)
    return report


__all__ = ["SHORT", "SPLITS", "evaluate_windows", "format_table", "layer_key", "load_series",
           "plot", "run_prune", "short_name"]
