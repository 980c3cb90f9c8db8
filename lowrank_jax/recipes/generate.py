"""The ``generate`` workflow: continue text prompts with a decoder-only language model
(GPT-2, Llama-style) from a Hugging Face directory or a lowrank_jax checkpoint, its tokenizer
read from ``tokenizer.json`` with the ``tokenizers`` package."""

from __future__ import annotations

import os

import numpy as np

from lowrank_jax.errors import ConfigError, MissingDependencyError, MissingFileError
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines

TOKENIZER_NAME = "tokenizer.json"


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a directory holding one."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is installed with transformers
        raise MissingDependencyError("generate: the tokenizers package is needed to read "
                                     "tokenizer.json (pip install tokenizers)") from None
    file = os.path.join(path, TOKENIZER_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise MissingFileError(f"generate: no tokenizer at {file}; pass --tokenizer with a "
                               "tokenizer.json (or a directory holding one)", where=file)
    return Tokenizer.from_file(file)


def _generation_defaults(config) -> dict:
    from lowrank_jax.models.hf import hf_files_of

    files = hf_files_of(config)
    gen = (files.generation_config or {}) if files is not None else {}
    base = files.config if files is not None else {}
    eos = gen.get("eos_token_id", base.get("eos_token_id"))
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = gen.get("pad_token_id", base.get("pad_token_id"))
    return {"eos": [int(e) for e in eos], "pad": None if pad is None else int(pad)}


def run_generate(model: str, prompts: list[str], *, tokenizer: str | None = None,
                 max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_tokens: list[int] | None = None,
                 status: Progress | None = None) -> Outcome:
    """Continue every prompt (batched, left-padded) with cached decoding.

    Args:
      model: a Hugging Face directory or a lowrank_jax model checkpoint of a decoder-only
        family.
      prompts: the texts to continue.
      tokenizer: a ``tokenizer.json`` (or a directory with one); default the model directory's.
      max_new_tokens: tokens generated per prompt.
      temperature, top_k, top_p: :class:`~lowrank_jax.models.Sampling` (temperature 0:
        greedy).
      seed: random seed of the sampling.
      stop_tokens: token ids that end a continuation; default the model's ``eos_token_id``
        (from its ``generation_config.json`` / ``config.json``).
      status: progress reporting.

    Returns:
      ``{'model', 'family', 'continuations': [{'prompt', 'text', 'tokens'}, ...]}``.
    """
    from lowrank_jax.models import Sampling, family_of, generate
    from lowrank_jax.recipes import sources

    status = lines(status, "generate")
    if not prompts:
        raise ConfigError("generate: give at least one --prompt", where="--prompt",
                          expected="a text", actual=None)
    source = sources.load_source(model, status=status)
    if source.config is None or family_of(source.config).apply_cached is None:
        name = "no config" if source.config is None else family_of(source.config).name
        raise ConfigError(f"generate: MODEL {model} is not a decoder-only language model "
                          f"({name}); generate needs a gpt2 or llama family model",
                          where="MODEL", expected="gpt2 or llama", actual=name)
    tok = load_tokenizer(tokenizer if tokenizer is not None else model)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    defaults = _generation_defaults(source.config)
    stops = defaults["eos"] if stop_tokens is None else [int(s) for s in stop_tokens]
    pad = defaults["pad"] if defaults["pad"] is not None else (stops[0] if stops else 0)
    encoded = [tok.encode(p).ids for p in prompts]
    if any(not e for e in encoded):
        raise ConfigError("generate: a prompt encodes to no token", where="--prompt")
    longest = max(len(e) for e in encoded)
    ids = np.full((len(prompts), longest), pad, np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(encoded):
        ids[i, longest - len(e):] = e
        mask[i, longest - len(e):] = 1
    with status.phase(f"generating {max_new_tokens} tokens for {len(prompts)} prompt(s)"):
        tokens = generate(source.params, source.config, ids, mask, max_new_tokens=max_new_tokens,
                          sampling=sampling, stop_tokens=stops, pad_token_id=pad, seed=seed)
    rows, out_lines = [], []
    for prompt, row in zip(prompts, tokens.tolist(), strict=True):
        kept = []
        for t in row:
            if t in stops:
                break
            kept.append(t)
        text = tok.decode(kept)
        rows.append({"prompt": prompt, "text": text, "tokens": kept})
        out_lines.append(f"{prompt}{text}")
    fam = family_of(source.config).name
    return Outcome({"model": model, "family": fam, "sampling": {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed},
        "max_new_tokens": max_new_tokens, "continuations": rows}, lines=out_lines)


__all__ = ["TOKENIZER_NAME", "load_tokenizer", "run_generate"]
