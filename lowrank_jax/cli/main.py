"""The ``lowrank-jax`` command: ``analyze``, ``compress``, ``convert``, ``export``, ``train``,
``demo``, and the method commands ``prune`` (:mod:`~lowrank_jax.cli.prune_cmd`),
``partition`` (:mod:`~lowrank_jax.cli.partition_cmd`) and ``sbt``
(:mod:`~lowrank_jax.cli.sbt_cmd`).

User errors (bad arguments, missing, unreadable or malformed files, outputs that may not be
written) print one line (a list of keys may follow) naming the file, key or option, what was
expected and what was found, and exit with status 2; set ``LOWRANK_JAX_DEBUG=1`` to get the
traceback instead. Outputs are never an input, and only the tool's own outputs are replaced
(see :mod:`lowrank_jax.cli.outputs`). Long phases announce themselves on stderr
(:mod:`lowrank_jax.cli.status`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

from lowrank_jax import runtime
from lowrank_jax.cli import outputs
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError, LowrankJaxError

#: Arguments that name what a command reads (attribute -> name in messages): outputs may not
#: overlap them (:func:`_preflight`).
_INPUT_OPTIONS = {"params": "MODEL", "src": "SRC", "model": "MODEL", "plan": "--plan",
                  "config": "CONFIG"}


def _inputs(args) -> dict:
    return {name: getattr(args, attr) for attr, name in _INPUT_OPTIONS.items()
            if isinstance(getattr(args, attr, None), str)}


def _write_json(path: str | None, obj, *, command: str = "demo", inputs: dict | None = None,
                outputs_: tuple = ()) -> None:
    """Write a JSON report (temp file + rename; only over a previous report or an empty file:
    :func:`lowrank_jax.cli.outputs.write_report`)."""
    if not path:
        return
    written = outputs.write_report(path, obj, command=command, inputs=inputs, outputs=outputs_)
    print(f"wrote {written}")


def _num_layers(params) -> int | None:
    """The deepest stack's layer count (for --schedule), read from the parameters."""
    from lowrank_jax.leaves import layer_index, named_leaves

    idx = [layer_index(p) for p, _ in named_leaves(params)]
    idx = [i for i in idx if i is not None]
    return max(idx) + 1 if idx else None


def _check_eps_list(flag: str, values) -> None:
    """Every eps threshold in (0, 1), before the model is read."""
    import math

    bad = [v for v in values or () if not (math.isfinite(v) and 0 < v < 1)]
    if bad:
        raise ConfigError(f"{flag} values must be numbers in (0, 1), got {bad[0]}", where=flag,
                          expected="(0, 1)", actual=bad[0])


def cmd_analyze(args) -> int:
    from lowrank_jax.analysis import analyze
    from lowrank_jax.cli.sources import load_source

    _check_eps_list("--eps", args.eps)
    if args.sweep:
        _check_eps_list("--sweep-eps", args.sweep_eps)
    status = Status("analyze", bars=not args.no_progress)
    src = load_source(args.params, status=status, family=args.family)
    status.say(f"eps-ranks and spectra of every weight ({args.pattern or 'all weights'})")
    report = analyze(src.params, eps=args.eps, pattern=args.pattern, progress=status.bars)
    print(report.format_table())
    out = report.to_dict()
    if args.sweep or args.sweep_heads:
        out["sweep"] = _analyze_sweep(args, src.config, src.params, status)
    _write_json(args.json, out, command="analyze", inputs=_inputs(args))
    return 0


def _analyze_sweep(args, config, params, status: Status) -> dict:
    """``analyze --sweep``: the ratio -> error curve (Table 2 of "Understanding Transformers for
    Time Series") and per-head sweeps."""
    from lowrank_jax.compress import eps_sweep

    result: dict = {}
    if args.sweep:
        with status.phase(f"eps sweep over {len(args.sweep_eps)} values (decompositions, one "
                          "compile, one run per value)"):
            rows = eps_sweep(config, params, None, args.sweep_eps)
        result["eps"] = rows
        if config is None:
            print("\neps sweep (bare parameter tree, no model config: sizes and weight errors "
                  "only; save a model checkpoint to get the output error)")
        else:
            print(f"\neps sweep ({type(config).__name__}, attention q/k/v/o truncated at eps, "
                  f"one compiled run; error of '{rows[0]['output']}' on sample inputs)")
        head = f"{'eps':>8}  {'size ratio':>10}  {'max weight err':>14}"
        head += f"  {'rel output err':>14}" if config is not None else ""
        print(head)
        for r in rows:
            line = f"{r['eps']:>8.4g}  {r['size_ratio']:>10.4f}  {r['max_weight_error']:>14.3e}"
            line += f"  {r['rel_error']:>14.3e}" if config is not None else ""
            print(line)
    if args.sweep_heads:
        result["heads"] = _head_sweeps(args, params, status)
    return result


def _head_sweeps(args, params, status: Status) -> list[dict]:
    """head_rank_sweep on every attention block, on synthetic N(0, 1) inputs. Head counts,
    widths and the logit scale come from each block's parameters."""
    import numpy as np

    from lowrank_jax.compress import attention_blocks, head_rank_sweep

    rng = np.random.default_rng(0)
    out = []
    blocks = attention_blocks(params)
    status.say(f"per-head rank sweep of {len(blocks)} attention blocks")
    for prefix, block in status.bar(blocks, desc="head sweeps", unit="block"):
        qk = block["qk"]
        k = min(qk.d_q_in, max(qk.widths, default=0))
        if k == 0:  # every head (or every query/key channel) pruned: nothing to truncate
            out.append({"block": prefix, "ranks": [], "rel_error": []})
            continue
        ranks = sorted({r for r in (args.sweep_ranks or []) if 0 <= r <= k}) or sorted(
            {min(2 ** i, k) for i in range(int(np.log2(k)) + 1)} | {k})
        x = rng.normal(size=(2, 32, qk.d_q_in)).astype(np.float32)
        kv = None if qk.d_k_in == qk.d_q_in and "cross" not in prefix else rng.normal(
            size=(2, 32, qk.d_k_in)).astype(np.float32)
        err = np.asarray(head_rank_sweep(block, x, None, ranks, kv=kv))
        out.append({"block": prefix, "ranks": ranks, "rel_error": err.tolist()})
    print(f"\nper-head rank sweep (q/k/v of one head truncated, synthetic N(0, 1) inputs, "
          f"relative output error; {len(out)} attention blocks)")
    for b in out:
        if not b["ranks"]:
            print(f"{b['block']}  no query/key channels left (pruned): nothing to truncate")
            continue
        print(f"{b['block']}  ranks {b['ranks']}")
        for h, row in enumerate(b["rel_error"]):
            print(f"  head {h:>2}: " + " ".join(f"{e:.2e}" for e in row))
    return out


def _parse_schedule(text: str) -> tuple[str, list[float]]:
    """``('power', [D0, ALPHA])`` or ``('interp', [R1, RD, ALPHA])`` from --schedule, each value
    checked (``D0 > 0``, ``ALPHA >= 0``, ``R1``/``RD`` whole numbers >= 1)."""
    import math

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


def _svd_settings(args, params) -> dict:
    """The ``svd`` step's settings from --eps / --rank / --ratio / --schedule."""
    settings: dict = {"per_head": args.per_head, "allocation": args.allocation}
    if args.rank_multiple is not None:
        settings["rank_multiple"] = args.rank_multiple
    if args.schedule:
        from lowrank_jax.compress import interpolation_schedule, power_schedule

        kind, nums = _parse_schedule(args.schedule)
        n_layers = args.num_layers or _num_layers(params)
        if not n_layers:
            raise ConfigError("--schedule needs --num-layers: no 'layers/<i>/' in the parameter "
                              f"paths of {args.params}", where="--num-layers",
                              expected="a layer count", actual=None)
        if kind == "power":
            settings["schedule"] = power_schedule(nums[0], nums[1], int(n_layers))
        else:
            settings["schedule"] = interpolation_schedule(int(nums[0]), int(nums[1]), nums[2],
                                                          int(n_layers))
    elif args.eps is not None:
        settings["eps"] = args.eps
    elif args.rank is not None:
        settings["rank"] = args.rank
    else:
        settings["ratio"] = args.ratio
    return settings


def _check_compress_flags(args) -> None:
    """Flag errors before anything is read."""
    given = [f for f, v in (("--eps", args.eps), ("--rank", args.rank), ("--ratio", args.ratio),
                            ("--schedule", args.schedule)) if v is not None]
    if args.plan and given:
        raise ConfigError(f"--plan replaces --eps/--rank/--ratio/--schedule; give one or the "
                          f"other (got --plan and {', '.join(given)})", where="--plan",
                          expected="--plan alone", actual=given)
    if not args.plan and not given:
        raise ConfigError("give --plan FILE, or one of --eps/--rank/--ratio/--schedule",
                          where="--eps/--rank/--ratio/--schedule/--plan",
                          expected="one of them", actual=None)
    if args.plan and args.rank_multiple is not None:
        raise ConfigError("--rank-multiple sets the svd step of --eps/--rank/--ratio/--schedule; "
                          "with --plan put \"rank_multiple\" in the plan's svd step settings",
                          where="--rank-multiple", expected="no --plan", actual=args.rank_multiple)
    if args.plan and os.path.isdir(args.plan):
        raise ConfigError(f"--plan {args.plan} is a directory; expected a JSON plan file",
                          where="--plan", expected="a file", actual="a directory")
    if args.schedule:
        _parse_schedule(args.schedule)
    _check_svd_values(args)
    if args.rule:
        for r in args.rule:
            try:
                re.compile(r[1:] if r.startswith("!") else r)
            except re.error as e:
                raise ConfigError(f"--rule {r!r} is not a valid regular expression: {e}",
                                  where="--rule", expected="a regular expression",
                                  actual=r) from None
    if args.time_runs < 1:
        raise ConfigError(f"--time-runs must be >= 1, got {args.time_runs}", where="--time-runs",
                          expected=">= 1", actual=args.time_runs)
    if args.plots:
        if not args.plan:
            raise ConfigError("--plots draws the query-key ranks per head of a plan's truncatt, "
                              "cp or btd steps; give --plan", where="--plots",
                              expected="--plan with such a step", actual=None)
        outputs.check_plots_out(args.plots, {**_inputs(args), "--out": args.out},
                                overwrite=args.overwrite)
        if args.json:
            outputs.check_report_path(args.json, _inputs(args), (args.out, args.plots))


def _check_svd_values(args) -> None:
    """--eps / --rank / --ratio / --rank-multiple / --num-layers in range (before the model is
    read)."""
    import math

    def bad(flag, value, expected):
        raise ConfigError(f"{flag} must be {expected}, got {value}", where=flag,
                          expected=expected, actual=value)

    if args.eps is not None and not (math.isfinite(args.eps) and 0 < args.eps < 1):
        bad("--eps", args.eps, "a number in (0, 1)")
    if args.rank is not None and args.rank < 1:
        bad("--rank", args.rank, "an int >= 1")
    if args.ratio is not None and not (math.isfinite(args.ratio) and 0 < args.ratio <= 1):
        bad("--ratio", args.ratio, "a number in (0, 1]")
    if args.rank_multiple is not None and args.rank_multiple < 1:
        bad("--rank-multiple", args.rank_multiple, "an int >= 1")
    if args.num_layers is not None and args.num_layers < 1:
        bad("--num-layers", args.num_layers, "an int >= 1")


def _load_plan(path: str):
    """The --plan file as a :class:`~lowrank_jax.compress.Plan`, every step checked (methods,
    setting names and values) before the model is read; a plan without steps is refused."""
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


def _time_line(ev: dict) -> str:
    """The measured time ratio with its spread (``compare_models``' paired runs)."""
    lo, hi = ev["time_ratio_quartiles"]
    text = (f"measured time ratio {ev['time_ratio']:.3f} (middle half of {ev['time_runs']} paired "
            f"runs: {lo:.3f}-{hi:.3f}")
    return text + ("; no measurable difference)" if lo <= 1.0 <= hi else ")")


def cmd_compress(args) -> int:
    import jax

    from lowrank_jax.cli.sources import load_source, parse_rules
    from lowrank_jax.cli.suggest import check_change
    from lowrank_jax.compress import ATTENTION_QKVO, Plan, Step, apply_plan
    from lowrank_jax.io import save_model, save_params

    status = Status("compress", bars=not args.no_progress)
    _check_compress_flags(args)
    plan = _load_plan(args.plan) if args.plan else None
    if args.plots and not any(s.method in ("truncatt", "cp", "btd") for s in plan.steps):
        raise ConfigError(f"--plots draws the query-key ranks per head of truncatt, cp or btd "
                          f"steps; the plan {args.plan} has none (its methods: "
                          f"{', '.join(s.method for s in plan.steps) or 'none'})", where="--plots",
                          expected="a truncatt, cp or btd step",
                          actual=[s.method for s in plan.steps])
    src = load_source(args.params, status=status, family=args.family)
    config, params = src.config, src.params
    if plan is None:
        rules = parse_rules(args.rule, ATTENTION_QKVO)
        plan = Plan((Step("svd", rules, _svd_settings(args, params)),))
    status.say(f"applying the plan ({len(plan.steps)} step{'s' * (len(plan.steps) != 1)}: "
               f"{', '.join(s.method for s in plan.steps)})")
    new_params, report = apply_plan(params, plan, key=jax.random.PRNGKey(args.seed),
                                    config=config, progress=status.bars)
    print(report.format_table())
    out = report.to_dict()
    out["plan"] = plan.to_dict()
    from lowrank_jax.compress.irregular import format_layer_table, head_ranks, layer_table

    if head_ranks(report):  # query-key methods: ranks per head, block ratios and errors
        out["attention_blocks"] = layer_table(report, params, new_params, seed=args.seed)
        print("\n" + format_layer_table(out["attention_blocks"]))
    note = check_change(report, params, plan, status)
    if note is not None:
        print("\n" + "\n".join(note["message"]))
        out["suggestions"] = note
    if config is not None and not args.no_eval:
        from lowrank_jax.compress import compare_models

        timed = report.changed > 0  # an unchanged model: a time ratio would be noise
        with status.phase("evaluating the model (compile and run the original and the "
                          "compressed model on sample inputs"
                          + (f", time {args.time_runs} forward calls of each)" if timed else ")")):
            ev = compare_models(config, params, new_params, time_runs=args.time_runs,
                                measure_time=timed)
        out["model"] = ev
        print(
            f"\nmodel: parameter ratio {ev['param_ratio']:.4f}, FLOP ratio {ev['flop_ratio']:.4f}, "
            f"{ev['output']} max abs error {ev['max_abs_error']:.3e}, "
            f"rel. error {ev['rel_error']:.3e}"
            + (f", top-10 Jaccard {ev['top10_jaccard']:.3f}" if "top10_jaccard" in ev else "")
            + (f", {_time_line(ev)}" if timed else
               ", time not measured (no weight changed: the models are the same)")
        )
    if args.plots:
        from lowrank_jax.compress.irregular import save_head_rank_plot

        with status.phase(f"plotting to {args.plots}"), outputs.marked_directory(
                args.plots, kind="plots", overwrite=args.overwrite, who="compress") as tmp:
            written = save_head_rank_plot(report, os.path.join(tmp, "head_ranks.png"))
        out["plots"] = [os.path.join(args.plots, os.path.basename(written))] if written else []
        print(f"wrote plots to {args.plots}" if written else
              f"no query-key ranks per head to plot (nothing matched); {args.plots} is empty")
    if args.out:
        meta_out = dict(src.metadata)
        meta_out["compression"] = out["totals"]
        meta_out["plan"] = plan.to_dict()
        with status.phase(f"saving to {args.out}"), outputs.writing_checkpoint(
                args.out, overwrite=args.overwrite):
            if config is not None:
                save_model(args.out, config, new_params, metadata=meta_out,
                           overwrite=args.overwrite)
            else:
                save_params(args.out, new_params, metadata=meta_out, overwrite=args.overwrite)
        print(f"saved compressed parameters to {args.out} (factors kept, nothing densified)")
    _write_json(args.json, out, command="compress", inputs=_inputs(args),
                outputs_=(args.out, args.plots))
    return 0


def cmd_convert(args) -> int:
    from lowrank_jax.cli.sources import load_source
    from lowrank_jax.io import save_model
    from lowrank_jax.leaves import param_count

    status = Status("convert", bars=not args.no_progress)
    src = load_source(args.src, status=status, family=args.family, huggingface=True,
                      label="SRC")
    with status.phase(f"saving to {args.out}"), outputs.writing_checkpoint(
            args.out, overwrite=args.overwrite):
        save_model(args.out, src.config, src.params, metadata=src.metadata,
                   overwrite=args.overwrite)
    print(
        f"converted {args.src} ({type(src.config).__name__}, {param_count(src.params):,} "
        f"parameters) to {args.out}"
    )
    return 0


def _listing(paths: list[str], empty: str, limit: int = 12) -> str:
    """``'N: a, b, ... (M more, all in --json)'`` or ``empty``."""
    if not paths:
        return f"0: {empty}"
    more = f", ... ({len(paths) - limit} more, all in the --json report)" if len(paths) > limit else ""
    return f"{len(paths)}: " + ", ".join(paths[:limit]) + more


def cmd_export(args) -> int:
    from lowrank_jax.cli.sources import load_source
    from lowrank_jax.convert import save_pretrained

    status = Status("export", bars=not args.no_progress)
    src = load_source(args.model, status=status)
    if src.config is None:
        raise ConfigError(
            f"export: {args.model} is a bare parameter checkpoint (no model config in its "
            "tree.json metadata); export needs a model checkpoint, as written by "
            "`lowrank-jax convert` or `compress` of one (lowrank_jax.io.save_model)",
            where=args.model, expected="a model checkpoint", actual="a parameter checkpoint")
    with status.phase(f"writing the Hugging Face directory {args.out}"):
        with outputs.marked_directory(args.out, kind="export", overwrite=args.overwrite,
                                      who="export", flag="--out", info={
                                          "source": os.path.abspath(args.model)}) as tmp:
            inner = os.path.join(tmp, "hf")  # save_pretrained's own temporaries stay inside
            summary = save_pretrained(src.config, src.params, inner)
            for name in os.listdir(inner):
                os.replace(os.path.join(inner, name), os.path.join(tmp, name))
            os.rmdir(inner)
    summary["path"] = os.path.abspath(args.out)
    arch = summary["architecture"] or type(src.config).__name__
    print(f"exported {args.model} ({summary['family']}, {arch}) to {args.out}: "
          f"{summary['n_tensors']} tensors, {summary['n_parameters']:,} parameters")
    print("materialized (densified) "
          + _listing(summary["materialized"], "none: every weight was dense"))
    print(f"zero-padded to the config's widths {_listing(summary['widened'], 'none')}")
    kwargs = "".join(f", {k}={v!r}" for k, v in summary["load_kwargs"].items())
    print(f"load it with {arch}.from_pretrained({args.out!r}{kwargs})")
    _write_json(args.json, summary, command="export", inputs=_inputs(args),
                outputs_=(args.out,))
    return 0


@contextlib.contextmanager
def _quick_compile(quick: bool):
    """``--quick`` runs compile more than they compute: XLA's backend at optimization level 0.

    The quick demo spends most of its time compiling tiny models; LLVM's optimization passes
    cost more there than they save (on 2 CPU cores: about 30% less CPU time for
    ``demo --quick``, but 15% more for the full demo, which trains longer). Applied only when
    ``XLA_FLAGS`` chooses no level, and only if JAX has not started its backend yet (it reads
    the flags once); the variable is restored afterwards.
    """
    flags = os.environ.get("XLA_FLAGS")
    if not quick or "xla_backend_optimization_level" in (flags or ""):
        yield
        return
    os.environ["XLA_FLAGS"] = ((flags or "") + " --xla_backend_optimization_level=0").strip()
    try:
        yield
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags


def cmd_demo(args) -> int:
    from lowrank_jax.cli.demo import run_demo
    from lowrank_jax.cli.pretrain_demo import check_seed, check_steps

    # before minutes of work: 0 steps is an error, not "default"; outputs as every command's
    check_steps(args.steps, "--steps")
    check_seed(args.seed, "--seed")
    if args.plots:
        outputs.check_plots_out(args.plots, {}, overwrite=args.overwrite)
    if args.json:
        outputs.check_report_path(args.json, {}, (args.plots,))
    with _quick_compile(args.quick):
        result = run_demo(quick=args.quick, plots_dir=args.plots, progress=not args.no_progress,
                          steps=args.steps, seed=args.seed, overwrite=args.overwrite)
    # strict JSON: NaN or inf are written as null
    _write_json(args.json, result, outputs_=(args.plots,))
    return 0


def cmd_train(args) -> int:
    from lowrank_jax.cli.train_cmd import init_distributed, run_train

    if args.distributed:
        # Multi-process: the coordinator, process count and id given here, or for those left
        # out, the cluster's auto-detection (SLURM, TPU pods, ...).
        init_distributed(args.coordinator, args.num_processes, args.process_id)
    elif any(v is not None for v in (args.coordinator, args.num_processes, args.process_id)):
        raise ConfigError("train: --coordinator, --num-processes and --process-id need "
                          "--distributed", where="--distributed", expected="--distributed",
                          actual="not given")
    run_train(args.config, args.out, progress=not args.no_progress,
              resume_changed_config=args.resume_changed_config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowrank-jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    model_help = ("a lowrank_jax checkpoint (save_params / save_model, `convert`, `compress`) or "
                  "a Hugging Face directory (config.json + model.safetensors / "
                  "pytorch_model.bin), converted in memory")
    family_help = "force the model family of a Hugging Face directory instead of detecting it"
    a = sub.add_parser("analyze", help="eps-ranks of every weight of a checkpoint or Hugging "
                                       "Face directory")
    a.add_argument("params", metavar="MODEL", help=model_help)
    a.add_argument("--eps", type=float, nargs="+", default=[0.01, 0.05, 0.1])
    a.add_argument("--pattern", help="only weights whose path matches this regular expression")
    a.add_argument("--family", help=family_help)
    a.add_argument("--json", help="write the report as JSON to this file (replaces only a "
                                  "previous lowrank-jax report)")
    a.add_argument("--no-progress", action="store_true", help="no progress bars")
    a.add_argument(
        "--sweep",
        action="store_true",
        help="compression ratio -> output error curve over --sweep-eps, "
        "compiled once; model checkpoints only get the output error",
    )
    a.add_argument("--sweep-eps", type=float, nargs="+",
                   default=[0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01])
    a.add_argument(
        "--sweep-heads",
        action="store_true",
        help="per-head rank sweep of every attention block (synthetic N(0, 1) inputs; head "
        "counts and widths come from the parameters)",
    )
    a.add_argument("--sweep-ranks", type=int, nargs="+",
                   help="ranks for --sweep-heads (default: powers of 2 up to d_head)")
    a.set_defaults(func=cmd_analyze)

    c = sub.add_parser("compress", help="compress a checkpoint or Hugging Face directory "
                                        "(truncated SVD, or a plan)")
    c.add_argument("params", metavar="MODEL", help=model_help)
    g = c.add_mutually_exclusive_group()
    g.add_argument("--plan", help="a JSON compression plan: {'steps': [{'method', 'rules', "
                   "'settings'}]} with at least one step, checked before the model is read "
                   "(see lowrank_jax.compress.Plan)")
    g.add_argument("--eps", type=float, help="truncate every selected matrix at this eps")
    g.add_argument("--rank", type=int, help="truncate every selected matrix to this rank")
    g.add_argument("--ratio", type=float, help="target parameter ratio of the selected weights")
    g.add_argument("--schedule", help="layer rank schedule: power:D0:ALPHA or interp:R1:RD:ALPHA")
    c.add_argument(
        "--rule",
        action="append",
        help="path regex selecting weights (first match wins; '!regex' skips); "
        "default: attention q/k/v/o",
    )
    c.add_argument("--per-head", action="store_true",
                   help="per-head sketching of q/k/v (head widths come from the parameters)")
    c.add_argument("--seed", type=int, default=0, help="PRNG seed of methods that draw numbers")
    c.add_argument("--num-layers", type=int, help="number of layers (for --schedule)")
    c.add_argument(
        "--allocation",
        choices=["eps", "energy"],
        default="eps",
        help="with --ratio: one global eps, or ranks by singular-value energy",
    )
    c.add_argument("--rank-multiple", type=int, metavar="K",
                   help="round every chosen rank up to a multiple of K (never a larger error; "
                   "matrix kernels tile by 8-16 on GPUs, 128 on TPUs; on a 2-core AVX-512 CPU "
                   "ranks 26-30 ran 1.06-1.22x faster at 32)")
    c.add_argument("--family", help=family_help)
    c.add_argument("--out", help="save the compressed tree to this directory (a lowrank_jax "
                                 "checkpoint; never the input or inside it)")
    c.add_argument("--plots", help="with a plan of truncatt/cp/btd steps: write the layer x head "
                   "heat map of the query-key ranks (head_ranks.png) to this directory")
    c.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a lowrank_jax checkpoint, --plots if lowrank-jax "
                   "wrote it (nothing else)")
    c.add_argument("--json", help="write the report as JSON to this file (replaces only a "
                                  "previous lowrank-jax report)")
    c.add_argument(
        "--no-eval",
        action="store_true",
        help="skip running the model (error, overlap, time ratio) for model checkpoints",
    )
    c.add_argument("--time-runs", type=int, default=20, help="timed forward calls per model")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compress)

    v = sub.add_parser(
        "convert", help="Hugging Face checkpoint directory -> lowrank_jax checkpoint"
    )
    v.add_argument(
        "src", help="directory with config.json and model.safetensors / pytorch_model.bin"
    )
    v.add_argument("--out", required=True, help="output directory (a lowrank_jax model "
                                                "checkpoint; never the input or inside it)")
    v.add_argument("--family", help="force the model family instead of detecting it")
    v.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a lowrank_jax checkpoint (nothing else)")
    v.add_argument("--no-progress", action="store_true", help="no progress bars")
    v.set_defaults(func=cmd_convert)

    e = sub.add_parser(
        "export", help="lowrank_jax model checkpoint -> Hugging Face directory that the PyTorch "
                       "class loads (compressed leaves densified, narrower layers zero-padded)")
    e.add_argument("model", metavar="MODEL", help="a lowrank_jax model checkpoint (or a Hugging "
                                                  "Face directory, written again)")
    e.add_argument("--out", required=True, help="output directory (config.json, "
                                                "model.safetensors and a lowrank-jax marker file)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a previous export (nothing else)")
    e.add_argument("--json", help="write the export summary as JSON to this file")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_export)

    d = sub.add_parser(
        "demo", help="App. J experiments, rank analysis of a built-in model, and pretraining "
                     "compressed Chronos-Bolt models against compressing a dense one")
    d.add_argument("--quick", action="store_true",
                   help="smaller sizes, a 2+1 layer model, 40 training steps (about a minute)")
    d.add_argument("--steps", type=int,
                   help="training steps per pretrained model, >= 1 (default 600; --quick: 40)")
    d.add_argument("--seed", type=int, default=0,
                   help="seed of the pretraining part, >= 0 (initialization, batches, factors)")
    d.add_argument("--json", help="write the results as JSON to this path (replaces only a "
                                  "previous lowrank-jax report)")
    d.add_argument("--plots", help="directory for PNG plots (a new or empty directory; written "
                                   "whole when the demo ends)")
    d.add_argument("--overwrite", action="store_true",
                   help="replace --plots if lowrank-jax wrote it (nothing else)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="pretrain a (compressed-by-design) Chronos-Bolt from a "
                                     "JSON config; resumes from --out/checkpoints")
    t.add_argument("config", help="JSON config file (see lowrank_jax.cli.train_cmd)")
    t.add_argument("--out", required=True, help="run directory (run.json, checkpoints, "
                   "metrics.jsonl, model, summary.json); a rerun resumes it")
    t.add_argument("--resume-changed-config", action="store_true",
                   help="continue a run whose stored config differs from CONFIG (refused "
                   "otherwise); the change is recorded in run.json")
    t.add_argument("--distributed", action="store_true",
                   help="multi-process data parallel: call jax.distributed.initialize() first; "
                   "run the same command in every process")
    t.add_argument("--coordinator", help="with --distributed: HOST:PORT of process 0 (default: "
                   "detected from the cluster)")
    t.add_argument("--num-processes", type=int, help="with --distributed: number of processes")
    t.add_argument("--process-id", type=int, help="with --distributed: this process's index")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)

    # Method commands live in their own modules (each adds its parser and sets its func).
    from lowrank_jax.cli import frontier_cmd, partition_cmd, prune_cmd, sbt_cmd

    prune_cmd.add_parser(sub)
    frontier_cmd.add_parser(sub)
    partition_cmd.add_parser(sub)
    sbt_cmd.add_parser(sub).set_defaults(func=sbt_cmd.run)
    return p


def _preflight(args) -> None:
    """Check every output before any work: not an input, not inside one, replaceable only if
    the tool wrote it (:mod:`lowrank_jax.cli.outputs`)."""
    from lowrank_jax.io import is_checkpoint

    owners = {"compress": (is_checkpoint, "a lowrank_jax checkpoint"),
              "convert": (is_checkpoint, "a lowrank_jax checkpoint"),
              "export": (outputs.owned_by("export"), "a previous lowrank-jax export")}
    out = getattr(args, "out", None) if args.command in owners else None
    if out:
        outputs.check_separate(out, _inputs(args))
        owned, what = owners[args.command]
        outputs.check_output_dir(out, overwrite=args.overwrite, owned=owned, what=what)
    if getattr(args, "json", None):
        outputs.check_report_path(args.json, _inputs(args), (out,))


#: Failures a user can cause (bad input, unreadable or unwritable files); anything else is a
#: bug and keeps its traceback.
_EXPECTED = (LowrankJaxError, ValueError, TypeError, OSError, re.error)

_OS_HINTS = (
    (IsADirectoryError, "expected a file, found a directory"),
    (NotADirectoryError, "expected a directory, found a file in the path"),
    (PermissionError, "no permission: check the owner and mode of the path"),
    (FileNotFoundError, "expected an existing path, found nothing"),
    (FileExistsError, "expected nothing at the path, found something"),
)


def _message(e: BaseException) -> str:
    """The user-facing text of an expected failure."""
    if isinstance(e, LowrankJaxError) or not isinstance(e, OSError) or e.strerror is None:
        return str(e)  # a message written for the user (or not an OS error at all)
    names = " -> ".join(str(n) for n in (e.filename, e.filename2) if n is not None)
    hint = next((h for cls, h in _OS_HINTS if isinstance(e, cls)), None)
    text = f"{e.strerror or type(e).__name__}" + (f": {names}" if names else "")
    return text + (f" ({hint})" if hint else "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:
        # the command owns its process: freed memory is kept for reuse (no page faults on every
        # large XLA buffer; lowrank_jax.runtime). main([...]) from Python leaves malloc alone.
        runtime.apply_env(default=True)
    try:
        _preflight(args)
        with runtime.one_blas_thread():  # host LAPACK: faster on one thread (lowrank_jax.runtime)
            return args.func(args)
    except _EXPECTED as e:
        if os.environ.get("LOWRANK_JAX_DEBUG"):
            raise
        print(f"lowrank-jax {args.command}: error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.environ.get("LOWRANK_JAX_DEBUG"):
            raise
        print(f"lowrank-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
