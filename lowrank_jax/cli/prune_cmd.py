"""``lowrank-jax prune MODEL --target 0.5 [--flops-target] [--data builtin|CSV]
--finetune-steps N --out DIR --json report.json --plots DIR``: prune-then-finetune of "Less is
More: Unlocking Specialization of Time Series Foundation Models via Structured Pruning"
(arXiv:2505.23195) on a forecasting model (:func:`lowrank_jax.recipes.run_prune`).

It prints a per-layer table of the kept heads and channels and the validation and test WQL /
MASE before pruning, after pruning and after fine-tuning; ``--plots`` draws the pruned fraction
of the input and the output channels per layer and weight (the paper's Fig. 6) and the pruning
history; ``--out`` saves the pruned (and fine-tuned) model, ``--json`` the report. Outputs
follow :mod:`lowrank_jax.recipes.outputs` (nothing the tool did not write is replaced).

On a decoder-only language model (GPT-2, Llama-style): ``lowrank-jax prune MODEL --heads 0.5
--kv-groups 0.5 --mlp 0.3 [--text FILE|DIR] [--tokenizer tokenizer.json] --finetune-steps N
--out DIR`` (:mod:`lowrank_jax.recipes.prune_lm`): query heads, key-value groups and MLP
channels scored and fine-tuned on text with the next-token loss, held-out perplexity, and
whether the export will be physically smaller or zero-padded.
"""

from __future__ import annotations

import argparse
import os

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``prune`` subcommand to ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    p = subparsers.add_parser(
        "prune", help="structured pruning then fine-tuning of a forecaster (Less is More: "
                      "per-layer kept heads and channels, WQL/MASE) or of a GPT-2 / Llama-style "
                      "language model (query heads, key-value groups, MLP channels, perplexity)")
    p.add_argument("params", metavar="MODEL",
                   help="a lowrank_jax model checkpoint or a Hugging Face directory")
    p.add_argument("--target", type=float,
                   help="forecasters: fraction of the prunable parameters to remove (default "
                        "0.5)")
    p.add_argument("--flops-target", action="store_true",
                   help="forecasters: --target is a fraction of the prunable FLOPs instead")
    p.add_argument("--data",
                   help="forecasters: 'builtin' (the real series shipped with aeon, the "
                        "default) or an ETT-style CSV file (date column, then one column per "
                        "series)")
    p.add_argument("--context-length", type=int,
                   help="forecasters: time steps of context per window (default: the model's, "
                        "at most 512)")
    p.add_argument("--heads", type=float,
                   help="language models: fraction of the query heads of every key-value "
                        "group (GPT-2: of every layer) to remove, in [0, 1)")
    p.add_argument("--kv-groups", type=float,
                   help="language models with grouped-query attention: fraction of every "
                        "layer's key-value groups (a key-value head and the query heads "
                        "reading it) to remove, in [0, 1)")
    p.add_argument("--mlp", type=float,
                   help="language models: fraction of all MLP hidden channels to remove, in "
                        "[0, 1), ranked across layers")
    p.add_argument("--mlp-equal", action="store_true",
                   help="language models: remove the same share of the MLP channels from every "
                        "layer, so that a Llama-style export is physically smaller")
    p.add_argument("--text",
                   help="language models: a text file or a directory of text files to score, "
                        "fine-tune and measure perplexity on (default: the Python standard "
                        "library's source)")
    p.add_argument("--tokenizer",
                   help="language models: a tokenizer.json, or a directory holding one "
                        "(default: MODEL/tokenizer.json)")
    p.add_argument("--seq-len", type=int,
                   help="language models: tokens per text window (default 128, at most the "
                        "model's longest sequence)")
    p.add_argument("--prune-steps", type=int, default=20,
                   help="pruning batches B of Algorithm 1 (language models: batches the head "
                        "and MLP-channel importance is averaged over; default 20)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="windows per pruning and fine-tuning batch (default 32; for a language "
                        "model also per perplexity batch)")
    p.add_argument("--alpha", type=float,
                   help="forecasters: weight of the newest batch in the moving average of the "
                        "importance scores, in (0, 1] (default 0.5)")
    p.add_argument("--schedule", choices=("cubic", "linear"),
                   help="forecasters: how the removed fraction grows over the pruning batches "
                        "(default cubic)")
    p.add_argument("--finetune-steps", type=int, default=0,
                   help="fine-tuning steps after pruning (default 0)")
    p.add_argument("--lr", type=float, default=1e-4,
                   help="peak learning rate of the fine-tuning (AdamW, warmup over 5%% of the "
                        "steps, cosine decay; default 1e-4)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="fine-tune LoRA updates of this rank instead of all weights")
    p.add_argument("--rule", action="append",
                   help="forecasters: path regex of the weights to prune (first match wins; "
                        "'!regex' skips); default: every attention and MLP projection")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="at most this many batches of 64 windows (language models: of "
                        "--batch-size held-out text windows) per evaluation (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batches (default 0)")
    p.add_argument("--family", help="force the model family of a Hugging Face directory")
    p.add_argument("--json", help="write the report as JSON to this file")
    p.add_argument("--plots", help="forecasters: write the pruned-fraction plots to this "
                                   "directory")
    p.add_argument("--out", help="save the pruned (and fine-tuned) model to this directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out / --plots if lowrank-jax wrote them")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def _check(args) -> None:
    from lowrank_jax.recipes import outputs

    for flag, value in (("--target", args.target), ("--heads", args.heads),
                        ("--kv-groups", args.kv_groups), ("--mlp", args.mlp)):
        if value is not None and not 0.0 <= value < 1.0:
            raise ConfigError(f"{flag} must be a fraction in [0, 1), got {value}", where=flag,
                              expected="[0, 1)", actual=value)
    if args.seq_len is not None and args.seq_len < 2:
        raise ConfigError(f"--seq-len must be >= 2 (a next token to predict), got "
                          f"{args.seq_len}", where="--seq-len", expected=">= 2",
                          actual=args.seq_len)
    for flag, path in (("--text", args.text), ("--tokenizer", args.tokenizer)):
        if path is not None and not os.path.exists(path):
            from lowrank_jax.errors import MissingFileError

            raise MissingFileError(f"{flag} {path}: no such file or directory", where=flag)
    for flag, value, low in (("--prune-steps", args.prune_steps, 1),
                             ("--batch-size", args.batch_size, 1),
                             ("--finetune-steps", args.finetune_steps, 0),
                             ("--lora", args.lora, 0), ("--eval-batches", args.eval_batches, 1)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}", where=flag,
                              expected=f">= {low}", actual=value)
    if args.alpha is not None and not 0.0 < args.alpha <= 1.0:
        raise ConfigError(f"--alpha must be in (0, 1], got {args.alpha}", where="--alpha",
                          expected="(0, 1]", actual=args.alpha)
    if args.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}", where="--lr", expected="> 0",
                          actual=args.lr)
    if args.context_length is not None and args.context_length < 1:
        raise ConfigError(f"--context-length must be >= 1, got {args.context_length}",
                          where="--context-length", expected=">= 1", actual=args.context_length)
    if args.data not in (None, "builtin") and not os.path.isfile(args.data):
        from lowrank_jax.errors import MissingFileError

        raise MissingFileError(f"--data {args.data}: no such CSV file (or 'builtin' for the "
                               "series shipped with aeon)", where="--data")
    inputs = {"MODEL": args.params}
    for flag, path in (("--data", args.data), ("--text", args.text),
                       ("--tokenizer", args.tokenizer)):
        if path not in (None, "builtin"):
            inputs[flag] = path
    outputs.check_outputs(inputs, out=args.out, plots=args.plots, json_path=args.json,
                          overwrite=args.overwrite)


def run(args) -> int:
    """Run ``lowrank-jax prune`` (module docstring). Returns the exit status."""
    from lowrank_jax.recipes.prune import run_prune

    _check(args)
    outcome = run_prune(
        args.params, target=args.target, flops_target=args.flops_target, data=args.data,
        context_length=args.context_length, prune_steps=args.prune_steps,
        batch_size=args.batch_size, alpha=args.alpha, schedule=args.schedule,
        finetune_steps=args.finetune_steps, lr=args.lr, lora=args.lora, rules=args.rule,
        eval_batches=args.eval_batches, seed=args.seed, family=args.family, out=args.out,
        plots=args.plots, overwrite=args.overwrite, heads=args.heads, kv_groups=args.kv_groups,
        mlp=args.mlp, mlp_equal=args.mlp_equal, text=args.text, tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        status=Status("prune", bars=not args.no_progress))
    return common.finish(outcome, args.json, command="prune", inputs={"MODEL": args.params},
                         outputs_=(args.out, args.plots))


__all__ = ["add_parser", "run"]
