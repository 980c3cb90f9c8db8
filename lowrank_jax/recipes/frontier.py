"""The ``frontier`` workflow: which compression should I use?

Compresses one model with every applicable method and a few combinations, each at several
strengths (:func:`lowrank_jax.compress.frontier.default_candidates`), and measures each
candidate's size (storage bits, parameters), FLOPs, measured forward time (median of calls
interleaved with the dense model, as a ratio; noisy on a shared machine) and quality on
held-out data (:func:`lowrank_jax.compress.frontier.frontier`):

* forecasters (Chronos-Bolt, Chronos): WQL and MASE of the forecast on the test windows (the
  last 20 % in time of every series; ``data='builtin'``: the real series shipped with aeon,
  or an ETT-style CSV file), geometric means over datasets relative to the dense model;
* classifiers (logits ``[batch, classes]``): top-1 agreement with the dense model on the
  family's representative inputs (no labelled data is built in);
* other models: relative error of the primary output against the dense model; a decoder-only
  language model (GPT-2, Llama-style) with a ``tokenizer.json`` in its directory (or given as
  ``tokenizer``) is evaluated on held-out windows of real text (the standard library's source,
  or ``text``), and its pruning candidates (``prune``, ``prune_heads``) are scored on the
  training windows of the same text (:func:`lowrank_jax.recipes.prune_lm.model_text`). Without
  a tokenizer it has no text: it is evaluated on its representative inputs (random token ids)
  and its pruning candidates are skipped, saying how to give text.

Results are zero-shot: no candidate is fine-tuned. The result has a markdown table (``S`` /
``T``: on the size / time Pareto frontier; ``best``: the recommendation, the best candidate
whose size ratio, and separately whose time ratio, is at most ``budget``); ``plots`` draws
``frontier.png`` (both panels), ``frontier_size.png`` and ``frontier_time.png``.

The model is a lowrank_jax model checkpoint, a Hugging Face directory, or ``demo``: the dense
Chronos-Bolt of ``lowrank-jax demo`` (4+2 layers, d_model 64; ``quick``: 2+1 layers),
pretrained on the built-in series exactly as the demo pretrains it (same seed, steps, data),
the first time only: it is cached as a lowrank_jax checkpoint under ``cache`` (default
``$LOWRANK_JAX_CACHE``, else ``~/.cache/lowrank_jax``).
"""

from __future__ import annotations

import os
import time

import numpy as np

from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.recipes import outputs
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines

DEMO = "demo"
SPLITS = (0.7, 0.1, 0.2)
PLOTS = ("frontier.png", "frontier_size.png", "frontier_time.png")


# ---------------------------------------------------------------------------------------------
# MODEL=demo: the demo's dense Chronos-Bolt, pretrained once and cached.

def cache_dir(given: str | None = None) -> str:
    """Where ``MODEL=demo`` keeps its pretrained model: ``given``, ``$LOWRANK_JAX_CACHE``, or
    ``$XDG_CACHE_HOME/lowrank_jax`` (``~/.cache/lowrank_jax``)."""
    if given:
        return given
    if os.environ.get("LOWRANK_JAX_CACHE"):
        return os.environ["LOWRANK_JAX_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lowrank_jax")


def cached_model_path(cache: str | None, *, quick: bool, steps: int | None = None,
                      seed: int = 0) -> str:
    """Where :func:`demo_model` caches the demo's pretrained model (``steps``: ``None`` for the
    demo's default)."""
    from lowrank_jax.recipes.pretrain_demo import DEFAULT_STEPS

    steps = DEFAULT_STEPS[bool(quick)] if steps is None else int(steps)
    return os.path.join(cache_dir(cache), f"demo_chronos_bolt_{'quick' if quick else 'full'}"
                                          f"_steps{steps}_seed{seed}")


def demo_model(*, quick: bool, cache: str | None, status: Progress, seed: int = 0,
               steps: int | None = None):
    """``(config, params, path)``: the dense Chronos-Bolt of ``lowrank-jax demo``
    (:func:`lowrank_jax.recipes.run_pretraining_demo`'s ``dense`` model: same config,
    initialization, batches and steps), loaded from the cache or pretrained and cached.

    A cached checkpoint is used only when its metadata records the same pretraining
    (``demo_pretraining``: quick, steps, seed, data); otherwise it is trained again and the
    cached checkpoint replaced.
    """
    import jax

    from lowrank_jax.datasets import builtin_datasets
    from lowrank_jax.io import is_checkpoint, load_metadata, load_model, save_model
    from lowrank_jax.recipes.pretrain_demo import DEFAULT_STEPS, demo_config

    cfg = demo_config(quick)
    steps = DEFAULT_STEPS[bool(quick)] if steps is None else int(steps)
    with status.phase("loading the built-in series"):
        groups, source = builtin_datasets()
    recipe = {"quick": bool(quick), "steps": steps, "seed": int(seed), "data": source,
              "version": 1}
    path = cached_model_path(cache, quick=quick, steps=steps, seed=seed)
    if is_checkpoint(path) and load_metadata(path).get("demo_pretraining") == recipe:
        with status.phase(f"loading the demo's pretrained Chronos-Bolt from {path}"):
            config, params = load_model(path)
        return config, params, path
    from lowrank_jax.models import chronos_bolt
    from lowrank_jax.train import WindowConfig, WindowSampler, fit, full_params

    series = [s for g in groups.values() for s in g]
    wcfg = WindowConfig(context_length=cfg.context_length, horizon=cfg.prediction_length,
                        stride=cfg.prediction_length)
    train = WindowSampler(series, wcfg, split="train", batch_size=64, seed=seed,
                          skip_short=True)
    key = jax.random.PRNGKey(seed)
    init = chronos_bolt.init(key, cfg)
    status.say(f"pretraining the demo's dense Chronos-Bolt once ({steps} steps; cached in "
               f"{path})")
    state, _ = fit(chronos_bolt.loss(cfg), init, train, steps=steps,
                   key=jax.random.fold_in(key, 1), progress=status.bars, desc="dense")
    params = full_params(state)
    with status.phase(f"caching it in {path}"), outputs.writing_checkpoint(
            path, overwrite=True, flag="--cache"):
        save_model(path, cfg, params, metadata={"demo_pretraining": recipe}, overwrite=True)
    return cfg, params, path


# ---------------------------------------------------------------------------------------------
# Held-out data.

def _series_groups(data: str) -> tuple[dict, str]:
    """``({dataset: [series]}, description)`` of ``--data``."""
    if data == "builtin":
        from lowrank_jax.datasets import builtin_datasets

        return builtin_datasets()
    from lowrank_jax.train import load_ett_csv

    names, values = load_ett_csv(data)
    return {str(n): [values[:, j]] for j, n in enumerate(names)}, f"{data} ({len(names)} columns)"


def forecast_data(cfg, data: str, *, max_windows: int, status: Progress):
    """The test windows (last 20 % in time) of every dataset of ``--data``, at most
    ``max_windows`` in all (evenly spaced within each dataset), as
    :class:`~lowrank_jax.compress.frontier.ForecastData`; and the window config."""
    from lowrank_jax.compress.frontier import ForecastData
    from lowrank_jax.train import WindowConfig, WindowSampler

    ctx = int(min(cfg.context_length, 512))
    horizon = int(cfg.prediction_length)
    wcfg = WindowConfig(context_length=ctx, horizon=horizon, stride=horizon, splits=SPLITS)
    with status.phase("loading the series and cutting the test windows"):
        groups, source = _series_groups(data)
        per = {}
        for name, group in groups.items():
            try:
                s = WindowSampler(group, wcfg, split="test", batch_size=1, skip_short=True)
            except (DataError, ValueError):  # no series of the dataset holds one test window
                continue
            per[name] = WindowSampler(group, wcfg, split="test", batch_size=s.num_windows,
                                      skip_short=True).batch(0)
    if not per:
        raise DataError(f"--data {data}: no series has a test split (the last 20 %) of "
                        f"{ctx + horizon} values ({ctx} context + {horizon} horizon)",
                        where="--data", expected=f">= {ctx + horizon} values", actual=0)
    cap = max(1, max_windows // len(per))
    context, target, spans, n = [], [], {}, 0
    for name, b in per.items():
        k = len(b["context"])
        idx = np.unique(np.linspace(0, k - 1, min(k, cap)).round().astype(int))
        context.append(np.asarray(b["context"])[idx])
        target.append(np.asarray(b["target"])[idx])
        spans[name] = (n, n + len(idx))
        n += len(idx)
    desc = (f"{source}: {n} test windows (last {SPLITS[2]:.0%} of every series) of {ctx} + "
            f"{horizon} values")
    return ForecastData(np.concatenate(context), np.concatenate(target), spans, desc), wcfg


def register_csv_batches(cfg, data: str, wcfg, seed: int) -> str:
    """A batch source for ``prune`` candidates from the train split (first 70 %) of a CSV
    file's series (:func:`lowrank_jax.compress.prune.register_batches`); returns its name."""
    from lowrank_jax.compress.prune import register_batches
    from lowrank_jax.models import family_of
    from lowrank_jax.train import WindowSampler

    fam = family_of(cfg)
    groups, _ = _series_groups(data)
    series = [s for g in groups.values() for s in g]
    name = f"frontier-csv:{os.path.abspath(data)}"

    def make(config, *, batch_size, seed=seed):
        sampler = WindowSampler(series, wcfg, split="train", batch_size=batch_size, seed=seed,
                                skip_short=True)

        def batches(j):
            b = sampler.batch(j)
            return fam.batch_from_windows(config, np.asarray(b["context"]),
                                          np.asarray(b["target"]))

        return batches

    register_batches(name, make)
    return name


def other_data(cfg, params, *, seed: int, batch: int = 32):
    """Classifiers: :class:`~lowrank_jax.compress.frontier.ClassificationData` (top-1
    agreement with the dense model); other models: :class:`~lowrank_jax.compress.frontier.
    OutputData`; on ``batch`` of the family's representative inputs."""
    from lowrank_jax.compress.frontier import ClassificationData, OutputData, is_classifier
    from lowrank_jax.models import family_of

    fam = family_of(cfg)
    inputs = fam.sample_inputs(cfg, np.random.default_rng(seed + 1), batch)
    desc = f"{batch} representative inputs of the {fam.name} family (sample_inputs, seed {seed + 1})"
    if is_classifier(cfg, params, inputs):
        return ClassificationData(inputs, None, desc + "; labels: the dense model's top-1")
    return OutputData(inputs, desc)


#: The batch source of a language model's training text (its pruning candidates).
TEXT_BATCHES = "lowrank-jax frontier: text"
#: Held-out text windows a language model is evaluated on.
TEXT_WINDOWS = 32


def language_model_data(cfg, params, model: str | None, *, text: str | None,
                        tokenizer: str | None, seed: int, status: Progress):
    """``(held-out data, prune_data)`` of a decoder-only language model.

    With a tokenizer (``tokenizer``, or ``tokenizer.json`` in the directory ``model``): an
    :class:`~lowrank_jax.compress.frontier.OutputData` of :data:`TEXT_WINDOWS` held-out windows
    of the text (the standard library's held-out files, or the last tenth of ``text``) and the
    name of a batch source of its training windows (:data:`TEXT_BATCHES`), as ``lowrank-jax
    prune`` reads them (:func:`lowrank_jax.recipes.prune_lm.model_text`). Without one (and
    without ``text``): :func:`other_data` and ``'builtin'`` (the pruning candidates are then
    skipped, and the frontier's report says why), after a one-line message saying how to pass
    text.

    Raises:
      MissingFileError: ``tokenizer`` or ``text`` given, but no tokenizer found.
    """
    from lowrank_jax.compress.frontier import OutputData
    from lowrank_jax.compress.prune import register_batches
    from lowrank_jax.recipes import prune_lm

    if tokenizer is None and text is None and prune_lm.tokenizer_file(None, model) is None:
        status.say(f"no tokenizer.json in {model}: evaluating on random token ids and skipping "
                   "the pruning candidates; pass --tokenizer tokenizer.json (and --text FILE|DIR, "
                   "default the standard library's source) to use real text")
        return other_data(cfg, params, seed=seed), "builtin"
    with status.phase("reading and tokenizing the text"):
        train, held, info = prune_lm.model_text(cfg, model, text=text, tokenizer=tokenizer,
                                                command="frontier")
    register_batches(TEXT_BATCHES, prune_lm.text_batches(train))
    held = held[:TEXT_WINDOWS]
    desc = (f"{len(held)} held-out windows of {held.shape[1]} tokens of {info['source']} "
            f"(tokenizer {info['tokenizer']}); pruning scored on {len(train)} training windows")
    return OutputData({"input_ids": held}, desc), TEXT_BATCHES


# ---------------------------------------------------------------------------------------------
# The workflow.

def _fmt(row: dict, metric: str) -> str:
    if row.get("error"):
        return f"{row['name']}: failed ({row['error'][:160]})"
    return (f"{row['name']}: size {row['size_ratio']:.3f}, time {row['time_ratio']:.3f}, "
            f"{metric} {row.get(metric, float('nan')):.4f} ({row['seconds']:.1f} s)")


def run_frontier(model: str, *, data: str = "builtin", budget: float = 0.5, quick: bool = False,
                 methods: list[str] | None = None, time_runs: int | None = None,
                 max_windows: int = 1024, seed: int = 0, family: str | None = None,
                 cache: str | None = None, plots: str | None = None, overwrite: bool = False,
                 text: str | None = None, tokenizer: str | None = None,
                 status: Progress | None = None) -> Outcome:
    """Measure every applicable compression of a model (module docstring).

    Args:
      model: a lowrank_jax model checkpoint, a Hugging Face directory, or :data:`DEMO` (the
        demo's pretrained Chronos-Bolt, trained once and cached: :func:`demo_model`).
      data: held-out data: ``'builtin'`` (forecasters: the real series shipped with aeon;
        other models: the family's representative inputs) or, for forecasters, an ETT-style
        CSV file.
      budget: ratio to the dense model in (0, 1]: the best candidate whose size ratio (and
        separately whose time ratio) is at most this is recommended.
      quick: one strength per method, fewer pruning batches and timing rounds; with
        ``model='demo'`` the demo's quick model.
      methods: only these registered methods (default: every applicable one).
      time_runs: interleaved timing rounds per candidate (default 9; quick 3).
      max_windows: forecasters: at most this many test windows, spread evenly over the
        datasets.
      seed: seed of the plans' random draws and of the inputs.
      family: force the model family of a Hugging Face directory.
      cache: ``model='demo'``: directory of the cached pretrained model (:func:`cache_dir`).
      plots: draw the frontier plots (:data:`PLOTS`) into this directory.
      overwrite: replace ``plots`` if lowrank-jax wrote it.
      text: language models: a text file or a directory of text files (default: the standard
        library's source) for the held-out windows and the pruning candidates' batches.
      tokenizer: language models: a ``tokenizer.json`` or a directory holding one (default:
        the model directory's, when it has one; without one the model is evaluated on random
        token ids and its pruning candidates are skipped: :func:`language_model_data`).
      status: progress reporting (default: status lines on stderr; one line per candidate).

    Returns:
      The report (``model``, the :class:`~lowrank_jax.compress.frontier.FrontierResult` as a
      dict, ``seconds``, ``plots``), the table and recommendations as lines; ``values``:
      ``result`` (the ``FrontierResult``).
    """
    import jax

    from lowrank_jax.compress.frontier import frontier, plot_frontier
    from lowrank_jax.models import family_of

    status = lines(status, "frontier")
    t_start = time.perf_counter()
    if model == DEMO:
        cfg, params, source_path = demo_model(quick=quick, cache=cache, status=status)
        name = f"{DEMO} (the demo's pretrained dense Chronos-Bolt, {source_path})"
    else:
        from lowrank_jax.recipes import sources

        src = sources.load_source(model, status=status, family=family)
        cfg, params, name = src.config, src.params, model
        if cfg is None:
            raise ConfigError(f"{model} holds bare parameters without a model config; the "
                              "frontier runs the model (a model checkpoint or a Hugging Face "
                              "directory)", where="MODEL", expected="a model checkpoint",
                              actual="parameters only")
    from lowrank_jax.recipes.prune_lm import is_language_model

    fam = family_of(cfg)
    prune_data = "builtin"
    language = fam.forecast is None and is_language_model(cfg)
    if (text is not None or tokenizer is not None) and not language:
        flag = "--text" if text is not None else "--tokenizer"
        raise ConfigError(f"{flag} is for decoder-only language models; {fam.name!r} is not one",
                          where=flag, expected="a language model", actual=fam.name)
    if fam.forecast is not None:
        held, wcfg = forecast_data(cfg, data, max_windows=max_windows, status=status)
        if data != "builtin" and fam.batch_from_windows is not None:
            prune_data = register_csv_batches(cfg, data, wcfg, seed)
    else:
        if data != "builtin":
            raise ConfigError(f"--data {data}: a CSV of series is for forecasters; "
                              f"{fam.name!r} is evaluated on its representative inputs "
                              "(--data builtin)", where="--data", expected="builtin",
                              actual=data)
        if language:
            held, prune_data = language_model_data(
                cfg, params, None if model == DEMO else model, text=text, tokenizer=tokenizer,
                seed=seed, status=status)
        else:
            held = other_data(cfg, params, seed=seed)
    status.say(f"measuring every candidate on {held.description} (compile, evaluate, time "
               "against the dense model)")
    result = frontier(cfg, params, held, budget=budget, quick=quick,
                      time_runs=time_runs, key=jax.random.PRNGKey(seed),
                      progress=status.bars, methods=methods, prune_data=prune_data,
                      on_row=lambda r: status.say(_fmt(r, held.metric)))
    seconds = time.perf_counter() - t_start
    text = [f"\n## Which compression? {fam.name} ({name}), zero-shot (no fine-tuning)\n"]
    text.append(f"data: {held.description}; quality: {held.metric} "
                f"({'higher' if result.higher_is_better else 'lower'} is better"
                f"{', relative to dense' if held.metric in ('wql', 'mase') else ''}); size = "
                f"storage bits, FLOPs = weight multiply-adds per sample, XLA FLOPs = the compiled "
                f"forward, time = median of {result.info['timing']['runs']} calls interleaved "
                "with the dense model; all relative to dense\n")
    text.append(result.format_table())
    text.append("")
    for axis in ("size", "time"):
        best = result.recommended(axis)
        if best is None:
            text.append(f"no candidate has a {axis} ratio <= {budget:g}")
        else:
            text.append(f"best with {axis} ratio <= {budget:g}: {best['name']} ({axis} "
                        f"{best[axis + '_ratio']:.3f}, {held.metric} {best[held.metric]:.4f})")
    for method, why in result.skipped.items():
        text.append(f"not a candidate: {method}: {why}")
    failed = [r for r in result.rows if r.get("error")]
    if failed:
        text.append(f"{len(failed)} candidate(s) failed: " + "; ".join(
            f"{r['name']}: {r['error'][:120]}" for r in failed))
    text.append(f"frontier finished in {seconds:.1f} s")
    report = Outcome({"model": name, **result.to_dict(), "seconds": seconds}, lines=text,
                     values={"result": result})
    text = report.lines
    if plots:
        title = f"{fam.name}: zero-shot compression frontier ({held.metric}; budget {budget:g})"
        with status.phase(f"plotting to {plots}"), outputs.marked_directory(
                plots, kind="plots", overwrite=overwrite, who="frontier") as tmp:
            plot_frontier(result, os.path.join(tmp, PLOTS[0]), title=title)
            plot_frontier(result, os.path.join(tmp, PLOTS[1]), axes=("size",), title=title)
            plot_frontier(result, os.path.join(tmp, PLOTS[2]), axes=("time",), title=title)
        report["plots"] = [os.path.join(plots, p) for p in PLOTS]
        text.append(f"wrote plots to {plots}")
    return report


__all__ = ["DEMO", "PLOTS", "SPLITS", "TEXT_BATCHES", "TEXT_WINDOWS", "cache_dir",
           "cached_model_path", "demo_model", "forecast_data", "language_model_data",
           "other_data", "register_csv_batches", "run_frontier"]
