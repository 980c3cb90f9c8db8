"""``lowrank-jax frontier MODEL --data builtin --budget 0.5 --json out.json --plots DIR
[--quick]``: which compression should I use? (:func:`lowrank_jax.recipes.run_frontier`)

Every applicable method and a few combinations, each at several strengths: size, FLOPs,
measured time and zero-shot accuracy on held-out data, relative to the dense model. It prints a
markdown table (``S`` / ``T``: on the size / time Pareto frontier; ``best``: the
recommendation within ``--budget``), writes ``--json`` and draws ``--plots``. ``MODEL`` is a
lowrank_jax model checkpoint, a Hugging Face directory, or ``demo``: the demo's dense
Chronos-Bolt, pretrained once and cached under ``--cache``. A GPT-2 or Llama-style ``MODEL`` is
evaluated on held-out windows of text (``--text``, default the standard library's source)
tokenized with ``--tokenizer`` (default ``MODEL/tokenizer.json``), and its pruning candidates
are scored on training windows of the same text; without a tokenizer they are skipped.
"""

from __future__ import annotations

import argparse
import os

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError, MissingFileError


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``frontier`` subcommand to ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    p = subparsers.add_parser(
        "frontier", help="which compression should I use? every applicable method at several "
                         "strengths: size, FLOPs, measured time and accuracy, Pareto frontiers")
    p.add_argument("params", metavar="MODEL",
                   help="a lowrank_jax model checkpoint, a Hugging Face directory, or 'demo' (the "
                        "demo's pretrained Chronos-Bolt, trained once and cached)")
    p.add_argument("--data", default="builtin",
                   help="held-out data: 'builtin' (forecasters: the real series shipped with "
                        "aeon; other models: the family's representative inputs) or, for "
                        "forecasters, an ETT-style CSV file (date column, one column per series)")
    p.add_argument("--text",
                   help="language models: a text file or a directory of text files for the "
                        "held-out windows and the pruning candidates' batches (default: the "
                        "Python standard library's source)")
    p.add_argument("--tokenizer",
                   help="language models: a tokenizer.json, or a directory holding one (default: "
                        "MODEL/tokenizer.json; without one the pruning candidates are skipped)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="ratio to the dense model in (0, 1]: the best candidate whose size ratio "
                        "(and separately whose time ratio) is at most this is recommended "
                        "(default 0.5)")
    p.add_argument("--quick", action="store_true",
                   help="one strength per method (keep 0.5), 4 pruning batches, 3 timing rounds"
                        "; with MODEL=demo the demo's --quick model")
    p.add_argument("--methods", nargs="+", metavar="METHOD",
                   help="only these registered methods (default: every applicable one); "
                        "combinations need both of their methods")
    p.add_argument("--time-runs", type=int,
                   help="interleaved timing rounds per candidate (default 9; --quick 3)")
    p.add_argument("--max-windows", type=int, default=1024,
                   help="forecasters: at most this many test windows, spread evenly over the "
                        "datasets (default 1024)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the plans' random draws and of the inputs (default 0)")
    p.add_argument("--family", help="force the model family of a Hugging Face directory")
    p.add_argument("--cache", help="MODEL=demo: directory of the cached pretrained model "
                                   "(default $LOWRANK_JAX_CACHE or ~/.cache/lowrank_jax)")
    p.add_argument("--json", help="write the report as JSON to this file")
    p.add_argument("--plots", help="write frontier.png, frontier_size.png and frontier_time.png "
                                   "to this directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --plots if lowrank-jax wrote it")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def _inputs(args) -> dict:
    from lowrank_jax.recipes.frontier import DEMO

    inputs = {} if args.params == DEMO else {"MODEL": args.params}
    if args.data != "builtin":
        inputs["--data"] = args.data
    for flag, path in (("--text", args.text), ("--tokenizer", args.tokenizer)):
        if path is not None:
            inputs[flag] = path
    return inputs


def _check(args) -> None:
    """Every argument and output, before anything is loaded or computed."""
    from lowrank_jax.compress import registered_methods
    from lowrank_jax.compress.frontier import check_budget
    from lowrank_jax.recipes import outputs
    from lowrank_jax.recipes.frontier import DEMO, cached_model_path

    check_budget(args.budget, "--budget")
    for flag, value in (("--time-runs", args.time_runs), ("--max-windows", args.max_windows)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}", where=flag, expected=">= 1",
                              actual=value)
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}", where="--seed",
                          expected=">= 0", actual=args.seed)
    if args.methods:
        known = registered_methods()
        unknown = [m for m in args.methods if m not in known]
        if unknown:
            raise ConfigError(f"--methods: unknown methods {unknown}; registered: {sorted(known)}",
                              where="--methods", expected=sorted(known), actual=unknown)
    if args.params != DEMO and not os.path.exists(args.params):
        raise MissingFileError(f"MODEL {args.params}: no such checkpoint or Hugging Face "
                               f"directory (or '{DEMO}' for the demo's pretrained Chronos-Bolt)",
                               where=args.params, expected="a directory", actual="nothing")
    if args.params == DEMO and args.family:
        raise ConfigError(f"--family is for a Hugging Face directory, not MODEL={DEMO}",
                          where="--family", expected="a Hugging Face MODEL", actual=DEMO)
    if args.cache and args.params != DEMO:
        raise ConfigError(f"--cache is where MODEL={DEMO} keeps its pretrained model; MODEL is "
                          f"{args.params}", where="--cache", expected=f"MODEL={DEMO}",
                          actual=args.params)
    if args.data != "builtin" and not os.path.isfile(args.data):
        raise MissingFileError(f"--data {args.data}: no such CSV file (or 'builtin' for the "
                               "series shipped with aeon)", where="--data")
    for flag, path in (("--text", args.text), ("--tokenizer", args.tokenizer)):
        if path is not None and not os.path.exists(path):
            raise MissingFileError(f"{flag} {path}: no such file or directory", where=flag)
    inputs = _inputs(args)
    if args.params == DEMO:  # the model is pretrained, then cached: the cache must be writable
        from lowrank_jax.io import is_checkpoint

        cached = cached_model_path(args.cache, quick=args.quick)
        if not is_checkpoint(cached):
            outputs.check_writable(cached, flag="--cache")
    if args.plots:
        outputs.check_plots_out(args.plots, inputs, overwrite=args.overwrite)
    if args.json:
        outputs.check_report_path(args.json, inputs, (args.plots,))


def run(args) -> int:
    """Run ``lowrank-jax frontier`` (module docstring). Returns the exit status."""
    from lowrank_jax.recipes.frontier import run_frontier

    _check(args)
    outcome = run_frontier(
        args.params, data=args.data, budget=args.budget, quick=args.quick,
        methods=args.methods, time_runs=args.time_runs, max_windows=args.max_windows,
        seed=args.seed, family=args.family, cache=args.cache, plots=args.plots,
        overwrite=args.overwrite, text=args.text, tokenizer=args.tokenizer,
        status=Status("frontier", bars=not args.no_progress))
    outcome["command_args"] = {k: v for k, v in vars(args).items() if k != "func"}
    return common.finish(outcome, args.json, command="frontier", inputs=_inputs(args),
                         outputs_=(args.plots,))


__all__ = ["add_parser", "run"]
