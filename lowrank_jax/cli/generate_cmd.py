"""``lowrank-jax generate MODEL --prompt TEXT``: continue prompts with a decoder-only language
model (:func:`lowrank_jax.recipes.run_generate`)."""

from __future__ import annotations

import argparse

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to ``subparsers``."""
    g = subparsers.add_parser("generate", help="continue text prompts with a GPT-2 or "
                                               "Llama-style model (cached decoding)")
    g.add_argument("model", help="Hugging Face directory or lowrank_jax checkpoint")
    g.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch)")
    g.add_argument("--tokenizer", help="tokenizer.json (default: MODEL/tokenizer.json)")
    g.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens to generate after each prompt, at most (default 32)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="softmax temperature of the sampling; 0 picks the most likely "
                        "token each step (greedy, the default)")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample only among the K most likely tokens; 0 (default) "
                        "keeps all")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample only among the most likely tokens whose probabilities "
                        "add up to this mass, between 0 and 1 (default 1: all tokens)")
    g.add_argument("--seed", type=int, default=0,
                   help="random seed of the sampling (default 0; unused when greedy)")
    g.add_argument("--stop-token", type=int, action="append",
                   help="token id that ends a continuation (default: the model's eos)")
    g.add_argument("--json", help="write the report (continuations) to this file")
    g.set_defaults(func=run)
    return g


def run(args) -> int:
    """Run ``lowrank-jax generate``. Returns the exit status."""
    from lowrank_jax.recipes.generate import run_generate

    outcome = run_generate(args.model, args.prompt, tokenizer=args.tokenizer,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           stop_tokens=args.stop_token, status=Status("generate"))
    return common.finish(outcome, args.json, command="generate")


__all__ = ["add_parser", "run"]
