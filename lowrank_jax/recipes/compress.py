"""The ``compress`` workflow: a plan (or one truncated-SVD step) applied to a model, with its
report, the query-key tables, suggestions when it changed little, the model's error and time
ratio, plots and the compressed checkpoint."""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

from lowrank_jax.errors import ConfigError
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines

#: Plan methods whose query-key ranks per head ``plots`` draws.
QK_METHODS = ("truncatt", "cp", "btd")


def parse_schedule(text: str) -> tuple[str, list[float]]:
    """``('power', [D0, ALPHA])`` or ``('interp', [R1, RD, ALPHA])`` from a schedule string
    (``'power:D0:ALPHA'`` / ``'interp:R1:RD:ALPHA'``), each value checked (``D0 > 0``,
    ``ALPHA >= 0``, ``R1``/``RD`` whole numbers >= 1).

    Raises:
      ConfigError: naming ``--schedule``, what was expected and what was given.
    """
    from lowrank_jax.compress import interpolation_schedule, power_schedule

    expected = "'power:D0:ALPHA' or 'interp:R1:RD:ALPHA' (numbers)"
    kind, *vals = text.split(":")
    try:
        nums = [float(v) for v in vals]
    except ValueError:
        nums = []
    if (kind, len(nums)) not in (("power", 2), ("interp", 3)):
        raise ConfigError(f"--schedule: expected {expected}, got {text!r}", where="--schedule",
                          expected=expected, actual=text)
    try:
        if kind == "power":
            power_schedule(nums[0], nums[1], 1)
        else:
            for name, r, given in (("R1", nums[0], vals[0]), ("RD", nums[1], vals[1])):
                if not (math.isfinite(r) and r == int(r) and r >= 1):
                    raise ConfigError(f"{name} must be a whole number >= 1, got {given}")
            interpolation_schedule(int(nums[0]), int(nums[1]), nums[2], 1)
    except ConfigError as e:
        detail = str(e).split(": ", 1)[-1]  # drop the function's name
        raise ConfigError(f"--schedule {text}: {detail}", where="--schedule",
                          expected=expected, actual=text) from None
    return kind, nums


def load_plan(path: str):
    """A plan file as a :class:`~lowrank_jax.compress.Plan`, every step checked (methods,
    setting names and values) before any model is read; a plan without steps is refused.

    Raises:
      ConfigError: no steps. PlanError: a step is not valid (the message names the file).
    """
    from lowrank_jax.compress import Plan
    from lowrank_jax.compress.plan import validate_plan
    from lowrank_jax.errors import PlanError

    plan = Plan.from_file(path)
    if not plan.steps:
        raise ConfigError(f"--plan {path} has no steps (\"steps\": []): it would change nothing; "
                          "give at least one step", where="--plan", expected="at least one step",
                          actual="no steps")
    try:
        validate_plan(plan)
    except PlanError as e:
        raise PlanError(f"--plan {path}: {e}", where=e.where, expected=e.expected,
                        actual=e.actual) from None
    return plan


def _num_layers(params) -> int | None:
    """The deepest stack's layer count (for a schedule), read from the parameters."""
    from lowrank_jax.leaves import layer_index, named_leaves

    idx = [layer_index(p) for p, _ in named_leaves(params)]
    idx = [i for i in idx if i is not None]
    return max(idx) + 1 if idx else None


def svd_plan(params, model: str, *, rules: Sequence[str] | None, eps: float | None,
             rank: int | None, ratio: float | None, schedule: str | None, per_head: bool,
             allocation: str, rank_multiple: int | None, num_layers: int | None):
    """The one-step ``svd`` plan of eps / rank / ratio / schedule (the first given, in that
    order after ``schedule``), on ``rules`` (default: attention q/k/v/o)."""
    from lowrank_jax.compress import (
        ATTENTION_QKVO,
        Plan,
        Step,
        interpolation_schedule,
        power_schedule,
    )
    from lowrank_jax.recipes.sources import parse_rules

    settings: dict = {"per_head": per_head, "allocation": allocation}
    if rank_multiple is not None:
        settings["rank_multiple"] = rank_multiple
    if schedule:
        kind, nums = parse_schedule(schedule)
        n_layers = num_layers or _num_layers(params)
        if not n_layers:
            raise ConfigError("--schedule needs --num-layers: no 'layers/<i>/' in the parameter "
                              f"paths of {model}", where="--num-layers",
                              expected="a layer count", actual=None)
        if kind == "power":
            settings["schedule"] = power_schedule(nums[0], nums[1], int(n_layers))
        else:
            settings["schedule"] = interpolation_schedule(int(nums[0]), int(nums[1]), nums[2],
                                                          int(n_layers))
    elif eps is not None:
        settings["eps"] = eps
    elif rank is not None:
        settings["rank"] = rank
    else:
        settings["ratio"] = ratio
    return Plan((Step("svd", parse_rules(rules, ATTENTION_QKVO), settings),))


def _time_line(ev: dict) -> str:
    """The measured time ratio with its spread (``compare_models``' paired runs)."""
    lo, hi = ev["time_ratio_quartiles"]
    text = (f"measured time ratio {ev['time_ratio']:.3f} (middle half of {ev['time_runs']} paired "
            f"runs: {lo:.3f}-{hi:.3f}")
    return text + ("; no measurable difference)" if lo <= 1.0 <= hi else ")")


def _model_line(ev: dict, timed: bool) -> str:
    return (
        f"\nmodel: parameter ratio {ev['param_ratio']:.4f}, FLOP ratio {ev['flop_ratio']:.4f}, "
        f"{ev['output']} max abs error {ev['max_abs_error']:.3e}, "
        f"rel. error {ev['rel_error']:.3e}"
        + (f", top-10 Jaccard {ev['top10_jaccard']:.3f}" if "top10_jaccard" in ev else "")
        + (f", {_time_line(ev)}" if timed else
           ", time not measured (no weight changed: the models are the same)")
    )


def run_compress(model: str, *, plan: Any = None, eps: float | None = None,
                 rank: int | None = None, ratio: float | None = None,
                 schedule: str | None = None, rules: Sequence[str] | None = None,
                 per_head: bool = False, allocation: str = "eps",
                 rank_multiple: int | None = None, num_layers: int | None = None,
                 seed: int = 0, family: str | None = None, out: str | None = None,
                 plots: str | None = None, overwrite: bool = False, evaluate: bool = True,
                 time_runs: int = 20, status: Progress | None = None) -> Outcome:
    """Compress a lowrank_jax checkpoint or a Hugging Face directory.

    Args:
      model: the checkpoint or Hugging Face directory
        (:func:`lowrank_jax.recipes.sources.load_source`).
      plan: a :class:`~lowrank_jax.compress.Plan` or a JSON plan file (checked before the
        model is read); or ``None`` for one ``svd`` step from the arguments below.
      eps, rank, ratio, schedule: the ``svd`` step's truncation without a plan (``schedule``:
        ``'power:D0:ALPHA'`` or ``'interp:R1:RD:ALPHA'``; the first of schedule, eps, rank,
        ratio that is given). Give a plan or at least one of them, not both.
      rules: path regexes of the ``svd`` step (first match wins; ``'!regex'`` skips); default:
        attention q/k/v/o.
      per_head, allocation, rank_multiple: the ``svd`` step's settings.
      num_layers: the layer count of ``schedule`` (default: read from the parameter paths).
      seed: PRNG seed of methods that draw numbers.
      family: force the model family of a Hugging Face directory.
      out: save the compressed tree there (a lowrank_jax checkpoint; replaces only a
        checkpoint, and only with ``overwrite``).
      plots: with a plan of truncatt/cp/btd steps, draw the query-key ranks per head
        (``head_ranks.png``) into this directory.
      overwrite: replace ``out`` / ``plots`` if lowrank-jax wrote them.
      evaluate: run the original and the compressed model (model checkpoints only): errors,
        overlap, measured time ratio.
      time_runs: timed forward calls per model.
      status: progress reporting (default: status lines on stderr).

    Returns:
      The report (:meth:`~lowrank_jax.compress.Report.to_dict`, with ``plan``, and
      ``attention_blocks``, ``suggestions``, ``model``, ``plots`` when they apply), its tables
      as lines, and ``values``: ``params`` (the compressed tree), ``config``, ``plan`` and
      ``report`` (the :class:`~lowrank_jax.compress.Report`).

    Raises:
      ConfigError, PlanError: a bad plan or setting.
      MissingFileError, CheckpointError: an unreadable model.
      OutputExistsError: ``out`` / ``plots`` may not be written.
    """
    import jax

    from lowrank_jax.compress import apply_plan, compare_models
    from lowrank_jax.compress.irregular import format_layer_table, head_ranks, layer_table
    from lowrank_jax.recipes import sources
    from lowrank_jax.recipes.suggest import check_change

    given = [n for n, v in (("eps", eps), ("rank", rank), ("ratio", ratio),
                            ("schedule", schedule)) if v is not None]
    if (plan is None) == (not given):
        raise ConfigError(f"run_compress: give a plan or one of eps, rank, ratio, schedule (got "
                          f"{'a plan and ' if plan is not None else ''}"
                          f"{', '.join(given) or 'none of them'})", where="plan",
                          expected="a plan or one of eps/rank/ratio/schedule",
                          actual=given or None)
    status = lines(status, "compress")
    plan_file = os.fspath(plan) if isinstance(plan, (str, os.PathLike)) else None
    if plan_file is not None:
        plan = load_plan(plan_file)
    if plots:
        _check_plots_plan(plan, plan_file)
    src = sources.load_source(model, status=status, family=family)
    config, params = src.config, src.params
    if plan is None:
        plan = svd_plan(params, model, rules=rules, eps=eps, rank=rank, ratio=ratio,
                        schedule=schedule, per_head=per_head, allocation=allocation,
                        rank_multiple=rank_multiple, num_layers=num_layers)
    status.say(f"applying the plan ({len(plan.steps)} step{'s' * (len(plan.steps) != 1)}: "
               f"{', '.join(s.method for s in plan.steps)})")
    new_params, report = apply_plan(params, plan, key=jax.random.PRNGKey(seed), config=config,
                                    progress=status.bars)
    plan_dict = plan.to_dict()
    result = Outcome(report.to_dict(), lines=[report.format_table()],
                     values={"params": new_params, "config": config, "plan": plan,
                             "report": report})
    result["plan"] = plan_dict
    if head_ranks(report):  # query-key methods: ranks per head, block ratios and errors
        result["attention_blocks"] = layer_table(report, params, new_params, seed=seed)
        result.lines.append("\n" + format_layer_table(result["attention_blocks"]))
    note = check_change(report, params, plan, status)
    if note is not None:
        result.lines.append("\n" + "\n".join(note["message"]))
        result["suggestions"] = note
    if config is not None and evaluate:
        timed = report.changed > 0  # an unchanged model: a time ratio would be noise
        with status.phase("evaluating the model (compile and run the original and the "
                          "compressed model on sample inputs"
                          + (f", time {time_runs} forward calls of each)" if timed else ")")):
            ev = compare_models(config, params, new_params, time_runs=time_runs,
                                measure_time=timed)
        result["model"] = ev
        result.lines.append(_model_line(ev, timed))
    if plots:
        _plot_head_ranks(result, report, plots, overwrite=overwrite, status=status)
    if out:
        _save(result, src, out, overwrite=overwrite, status=status)
    return result


def _check_plots_plan(plan, plan_file: str | None) -> None:
    """``plots`` needs a plan with a query-key step (:data:`QK_METHODS`)."""
    if plan is None:
        raise ConfigError("--plots draws the query-key ranks per head of a plan's truncatt, "
                          "cp or btd steps; give --plan", where="--plots",
                          expected="--plan with such a step", actual=None)
    methods = [s.method for s in plan.steps]
    if not any(m in QK_METHODS for m in methods):
        raise ConfigError(f"--plots draws the query-key ranks per head of truncatt, cp or btd "
                          f"steps; the plan {plan_file or '(given)'} has none (its methods: "
                          f"{', '.join(methods) or 'none'})", where="--plots",
                          expected="a truncatt, cp or btd step", actual=methods)


def _plot_head_ranks(result: Outcome, report, plots: str, *, overwrite: bool,
                     status: Progress) -> None:
    from lowrank_jax.compress.irregular import save_head_rank_plot
    from lowrank_jax.recipes import outputs

    with status.phase(f"plotting to {plots}"), outputs.marked_directory(
            plots, kind="plots", overwrite=overwrite, who="compress") as tmp:
        written = save_head_rank_plot(report, os.path.join(tmp, "head_ranks.png"))
    result["plots"] = [os.path.join(plots, os.path.basename(written))] if written else []
    result.lines.append(f"wrote plots to {plots}" if written else
                        f"no query-key ranks per head to plot (nothing matched); {plots} is empty")


def _save(result: Outcome, src, out: str, *, overwrite: bool, status: Progress) -> None:
    from lowrank_jax.io import save_model, save_params
    from lowrank_jax.recipes import outputs

    config, new_params = src.config, result.values["params"]
    meta_out = dict(src.metadata)
    meta_out["compression"] = result["totals"]
    meta_out["plan"] = result["plan"]
    with status.phase(f"saving to {out}"), outputs.writing_checkpoint(out, overwrite=overwrite):
        if config is not None:
            save_model(out, config, new_params, metadata=meta_out, overwrite=overwrite,
                       extra_files=src.extra_files())
        else:
            save_params(out, new_params, metadata=meta_out, overwrite=overwrite)
    result.lines.append(f"saved compressed parameters to {out} (factors kept, nothing densified)")


__all__ = ["QK_METHODS", "load_plan", "parse_schedule", "run_compress", "svd_plan"]
