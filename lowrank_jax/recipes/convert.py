"""The ``convert`` and ``export`` workflows: a Hugging Face directory to a lowrank_jax model
checkpoint, and back."""

from __future__ import annotations

import os

from lowrank_jax.errors import ConfigError
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines


def run_convert(src: str, out: str, *, family: str | None = None, overwrite: bool = False,
                status: Progress | None = None) -> Outcome:
    """Convert a Hugging Face checkpoint directory to a lowrank_jax model checkpoint.

    Args:
      src: a directory with ``config.json`` and ``model.safetensors`` / ``pytorch_model.bin``.
      out: the checkpoint directory to write (never the input or inside it).
      family: force the model family instead of detecting it.
      overwrite: replace ``out`` if it is a lowrank_jax checkpoint.
      status: progress reporting (default: status lines on stderr).

    Returns:
      ``{'src', 'out', 'config', 'parameters'}`` and a one-line summary; ``values``:
      ``config`` and ``params``.
    """
    from lowrank_jax.io import save_model
    from lowrank_jax.leaves import param_count
    from lowrank_jax.recipes import outputs, sources

    status = lines(status, "convert")
    source = sources.load_source(src, status=status, family=family, huggingface=True,
                                 label="SRC")
    with status.phase(f"saving to {out}"), outputs.writing_checkpoint(out, overwrite=overwrite):
        save_model(out, source.config, source.params, metadata=source.metadata,
                   overwrite=overwrite, extra_files=source.extra_files())
    n = param_count(source.params)
    name = type(source.config).__name__
    return Outcome({"src": src, "out": out, "config": name, "parameters": n},
                   lines=[f"converted {src} ({name}, {n:,} parameters) to {out}"],
                   values={"config": source.config, "params": source.params})


def _listing(paths: list[str], empty: str, limit: int = 12) -> str:
    """``'N: a, b, ... (M more, all in --json)'`` or ``empty``."""
    if not paths:
        return f"0: {empty}"
    more = f", ... ({len(paths) - limit} more, all in the --json report)" if len(paths) > limit else ""
    return f"{len(paths)}: " + ", ".join(paths[:limit]) + more


def run_export(model: str, out: str, *, overwrite: bool = False,
               status: Progress | None = None) -> Outcome:
    """Export a lowrank_jax model checkpoint as a Hugging Face directory that the PyTorch class
    loads (compressed leaves densified, narrower layers zero-padded).

    Args:
      model: a lowrank_jax model checkpoint (or a Hugging Face directory, written again).
      out: the directory to write (``config.json``, ``model.safetensors`` and a lowrank-jax
        marker file); replaces only a previous export, and only with ``overwrite``.
      overwrite: replace ``out`` if it is a previous export.
      status: progress reporting (default: status lines on stderr).

    Returns:
      The :func:`~lowrank_jax.convert.save_pretrained` summary (with ``path``) and what was
      densified, padded, and how to load it, as lines.

    Raises:
      ConfigError: ``model`` is a bare parameter checkpoint (no model config).
    """
    from lowrank_jax.convert import save_pretrained
    from lowrank_jax.recipes import outputs, sources

    status = lines(status, "export")
    src = sources.load_source(model, status=status)
    if src.config is None:
        raise ConfigError(
            f"export: {model} is a bare parameter checkpoint (no model config in its "
            "tree.json metadata); export needs a model checkpoint, as written by "
            "`lowrank-jax convert` or `compress` of one (lowrank_jax.io.save_model)",
            where=model, expected="a model checkpoint", actual="a parameter checkpoint")
    with status.phase(f"writing the Hugging Face directory {out}"):
        with outputs.marked_directory(out, kind="export", overwrite=overwrite, who="export",
                                      flag="--out", info={"source": os.path.abspath(model)}
                                      ) as tmp:
            inner = os.path.join(tmp, "hf")  # save_pretrained's own temporaries stay inside
            summary = save_pretrained(src.config, src.params, inner,
                                      extra_files=src.extra_files())
            for name in os.listdir(inner):
                os.replace(os.path.join(inner, name), os.path.join(tmp, name))
            os.rmdir(inner)
    summary["path"] = os.path.abspath(out)
    arch = summary["architecture"] or type(src.config).__name__
    kwargs = "".join(f", {k}={v!r}" for k, v in summary["load_kwargs"].items())
    return Outcome(summary, lines=[
        f"exported {model} ({summary['family']}, {arch}) to {out}: "
        f"{summary['n_tensors']} tensors, {summary['n_parameters']:,} parameters",
        "materialized (densified) " + _listing(summary["materialized"],
                                               "none: every weight was dense"),
        *(["dequantized (integer weights written as float32 values; the lowrank-jax "
           "checkpoint keeps the packed integers) " + _listing(summary["dequantized"], "none")]
          if summary.get("dequantized") else []),
        f"zero-padded to the config's widths {_listing(summary['widened'], 'none')}",
        f"load it with {arch}.from_pretrained({out!r}{kwargs})",
    ])


__all__ = ["run_convert", "run_export"]
