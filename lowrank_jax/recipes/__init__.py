"""The library's experiments and workflows, as functions that the ``lowrank-jax`` command, the
notebooks and the benchmarks call.

One function per workflow, taking plain arguments (paths, numbers, strings; never an
``argparse`` namespace). It does the whole job (reads the model, runs the methods, writes the
outputs it is given, following the output rules of :mod:`lowrank_jax.recipes.outputs`) and
returns an :class:`Outcome`: the JSON-able report, with the summary for a reader as lines and
Python results (the new tree) beside it. It never prints: stages are reported through the
:class:`Progress` passed in as ``status`` (the command passes its
:class:`lowrank_jax.cli.status.Status`; the default writes status lines to stderr).

========================  =====================================================================
:func:`run_analyze`       eps-ranks and spectra of every weight; eps and per-head sweeps
:func:`run_compress`      a compression plan (or one truncated-SVD step) applied to a model
:func:`run_convert`       Hugging Face directory -> lowrank_jax model checkpoint
:func:`run_export`        lowrank_jax model checkpoint -> Hugging Face directory
:func:`run_prune`         structured pruning then fine-tuning of a forecaster or a language model
:func:`run_partition`     a model split over machines with low intercommunication
:func:`run_frontier`      every applicable compression of a model: size, time, accuracy
:func:`run_generate`      text continued by a decoder-only language model (cached decoding)
:func:`run_train`         compressed pretraining of a forecaster from a JSON config
:func:`run_sbt`           a sparse binary transformer on a time-series task
:func:`run_demo`          the App. J experiments, the built-in model, the pretraining demo
========================  =====================================================================

Also here: the pretraining demo (:mod:`~lowrank_jax.recipes.pretrain_demo`), the SBT tasks
(:mod:`~lowrank_jax.recipes.sbt_tasks`), compression suggestions
(:mod:`~lowrank_jax.recipes.suggest`), the train-config schema
(:mod:`~lowrank_jax.recipes.train_config`), what the workflows read
(:mod:`~lowrank_jax.recipes.sources`) and may write (:mod:`~lowrank_jax.recipes.outputs`).

The package sits above every other layer of the library and below the command: it may import
anything in ``lowrank_jax`` but :mod:`lowrank_jax.cli`, and nothing in ``lowrank_jax`` imports
it but the command. Its names are loaded on first use, so importing the package is cheap.
"""

from __future__ import annotations

import importlib

#: Public name -> the module (under this package) that defines it.
_NAMES = {
    "Outcome": "outcome",
    "Progress": "progress", "Lines": "progress",
    "Source": "sources", "load_source": "sources",
    "run_analyze": "analyze",
    "run_compress": "compress", "load_plan": "compress",
    "run_convert": "convert", "run_export": "convert",
    "run_prune": "prune",
    "run_partition": "partition",
    "run_frontier": "frontier",
    "run_generate": "generate",
    "run_train": "train",
    "build_model_config": "train_config", "load_train_config": "train_config",
    "validate_train_config": "train_config",
    "run_sbt": "sbt",
    "run_demo": "demo",
    "run_pretraining_demo": "pretrain_demo", "demo_config": "pretrain_demo",
    "eval_windows": "pretrain_demo", "forecast_scores": "pretrain_demo",
    "make_forward": "pretrain_demo",
    "check_change": "suggest", "suggestions": "suggest",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
