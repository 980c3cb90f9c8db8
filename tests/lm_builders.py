"""Tiny random decoder-only language models built with transformers, for the tests of the GPT-2
and Llama-style families (GPT-2, Llama, Qwen2, Mistral).

The tests run with ``--import-mode=importlib``, so test modules cannot import each other: this
module comes to them as the ``lm`` fixture of ``tests/conftest.py``. It needs torch and
transformers; the test modules that use it skip without them (``pytest.importorskip``) before
asking for the fixture.
"""

import functools
import os

#: ``kind: (config class, model class)`` names in transformers.
CLASSES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def vary_biases_and_norms(model, scale: float = 0.1) -> None:
    """Add ``scale * N(0, 1)`` noise (torch's global generator) to every bias and every norm
    weight of ``model``, in ``named_parameters`` order: transformers initializes biases to zero
    and norm scales to one, which would hide a bias or a norm read wrongly."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name or "norm" in name:
                p.add_(scale * torch.randn_like(p))


def hf_lm(kind: str, *, seed: int = 0, vary: bool = False, **config):
    """A random transformers causal language model in eval mode.

    Args:
      kind: ``'gpt2'``, ``'llama'``, ``'qwen2'`` or ``'mistral'``.
      seed: ``torch.manual_seed`` before the model is built.
      vary: give the biases and norm weights values (:func:`vary_biases_and_norms`).
      **config: the transformers config's fields.
    """
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[kind])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config)).eval()
    if vary:
        vary_biases_and_norms(model)
    return model


def saved_lm(directory, kind: str, *, seed: int = 0, vary: bool = False, tokenizer=None,
             **config):
    """:func:`hf_lm` saved with its own ``save_pretrained`` in ``directory`` (with
    ``tokenizer.json`` when ``tokenizer``, a ``tokenizers.Tokenizer``, is given); returns
    ``directory``."""
    hf_lm(kind, seed=seed, vary=vary, **config).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save(os.path.join(str(directory), "tokenizer.json"))
    return directory


@functools.lru_cache(maxsize=None)
def stdlib_bpe(vocab: int = 300):
    """A byte-level BPE of ``vocab`` tokens trained on the first 100 kB of the standard-library
    corpus's training files (trained once per process; tests only encode and decode with it)."""
    from lowrank_jax.text import stdlib_corpus, train_bpe

    return train_bpe(stdlib_corpus().read("train", max_bytes=100_000), vocab)
