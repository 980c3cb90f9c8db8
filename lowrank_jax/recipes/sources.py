"""What the workflows (and the ``lowrank-jax`` commands) read: lowrank_jax checkpoints and
Hugging Face directories (and the ``--rule`` path rules that select weights in them).

``analyze``, ``compress``, ``export``, ``prune``, ``partition`` and ``frontier`` take either

* a lowrank_jax checkpoint (``tree.json`` + ``arrays/``, :func:`lowrank_jax.io.save_params` or
  :func:`lowrank_jax.io.save_model`; 0.1 model checkpoints are upgraded on load), or
* a Hugging Face directory (``config.json`` plus ``model.safetensors``, a sharded
  ``model.safetensors.index.json`` or ``pytorch_model.bin``), converted in memory with
  :func:`lowrank_jax.convert.load_pretrained` (the family is detected from ``config.json``;
  ``--family`` forces it).

A directory is read as a Hugging Face directory when it holds ``config.json`` and no
``tree.json``.

A language model's tokenizer files (:data:`TOKENIZER_FILES`) travel with it: the commands that
write a model (``convert``, ``compress``, ``prune``, ``partition``, ``export``) copy the ones
in the input directory into their output (:meth:`Source.extra_files`), so ``generate``,
``prune`` and ``frontier`` find ``tokenizer.json`` in a converted or compressed model, and
``AutoTokenizer.from_pretrained`` loads from an export.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from lowrank_jax.convert.files import CONFIG_NAME, INDEX_NAME, TORCH_NAME, WEIGHTS_NAME
from lowrank_jax.errors import ConfigError, LowrankJaxError
from lowrank_jax.io import TREE_FILE
from lowrank_jax.recipes.progress import Progress

WEIGHT_FILES = (WEIGHTS_NAME, INDEX_NAME, TORCH_NAME)

#: Hugging Face tokenizer files copied from a model's directory into what a command writes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja")


@dataclasses.dataclass
class Source:
    """A loaded model or parameter tree.

    Fields:
      path: what was given on the command line.
      kind: ``'checkpoint'`` or ``'huggingface'``.
      config: the model config, or ``None`` for a bare parameter checkpoint.
      params: the parameter tree.
      metadata: the checkpoint's metadata (``{'source': DIR}`` for a Hugging Face directory),
        without the serialized config.
    """

    path: str
    kind: str
    config: Any
    params: Any
    metadata: dict

    def extra_files(self) -> dict[str, str]:
        """``{name: path}`` of the tokenizer files (:data:`TOKENIZER_FILES`) in the model's
        directory, for ``save_model`` / ``save_pretrained``'s ``extra_files``."""
        found = {n: os.path.join(self.path, n) for n in TOKENIZER_FILES}
        return {n: p for n, p in found.items() if os.path.isfile(p)}


def parse_rules(flags: list[str] | None, default: tuple) -> tuple:
    """The path rules of repeated ``--rule REGEX`` options (first match wins; ``'!REGEX'``
    skips the weights it matches); ``default`` when none is given."""
    if not flags:
        return default
    return tuple((r[1:], None) if r.startswith("!") else r for r in flags)


def is_hf_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is read as a Hugging Face directory (``config.json``, no ``tree.json``)."""
    path = os.fspath(path)
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_NAME))
            and not os.path.exists(os.path.join(path, TREE_FILE)))


def _size(path: str) -> str:
    """The size of the weight files of a Hugging Face directory, in words."""
    n = 0
    try:
        entries = os.listdir(path)
    except OSError:
        return "size unknown"
    for entry in entries:
        if entry in WEIGHT_FILES or entry.endswith(".safetensors"):
            try:
                n += os.path.getsize(os.path.join(path, entry))
            except OSError:
                pass
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


#: Library readers whose names start their messages (``load_metadata: ...``); the command
#: names its argument instead (:func:`load_source`).
_READERS = ("load_metadata", "load_params", "load_state", "load_model", "load_model_state",
            "load_pretrained", "read_checkpoint", "read_document")


def _name_argument(e: LowrankJaxError, label: str, path: str) -> None:
    """Start the message of a reader's error ``e`` with the command's argument (``MODEL
    DIR: ...``) instead of the library function that raised it (changed in place; other
    messages are left as they are)."""
    head, sep, text = str(e).partition(": ")
    if not sep or head not in _READERS:
        return
    prefix = f"{label}: " if path in text.split("\n", 1)[0] else f"{label} {path}: "
    e.args = (prefix + text,)


def load_source(path: str | os.PathLike, *, status: Progress, family: str | None = None,
                huggingface: bool = False, label: str = "MODEL") -> Source:
    """Load a lowrank_jax checkpoint or a Hugging Face directory (module docstring).

    Args:
      path: the directory.
      status: for the status line of the (possibly long) read.
      family: force this model family for a Hugging Face directory.
      huggingface: read ``path`` as a Hugging Face directory whatever it holds (``convert``:
        the reader's errors name the missing or unreadable file).
      label: the command's name for ``path`` (``MODEL``, ``SRC``): the readers' errors start
        with it (and the path), not with the library function that raised them.

    Returns:
      The :class:`Source`.

    Raises:
      ConfigError: ``family`` given for a lowrank_jax checkpoint.
      MissingFileError, CheckpointError, ConfigError: from the readers, naming the file.
    """
    path = os.fspath(path)
    try:
        return _load(path, status=status, family=family, huggingface=huggingface)
    except LowrankJaxError as e:
        _name_argument(e, label, path)
        raise


def _load(path: str, *, status: Progress, family: str | None, huggingface: bool) -> Source:
    if huggingface or is_hf_directory(path):
        from lowrank_jax.convert import load_pretrained

        with status.phase(f"reading the Hugging Face directory {path} ({_size(path)}) and "
                          "converting it in memory"):
            config, params = load_pretrained(path, family=family)
        return Source(path, "huggingface", config, params, {"source": os.path.abspath(path)})
    if family is not None:
        raise ConfigError(f"--family {family}: only for a Hugging Face directory (config.json + "
                          f"weights); {path} is read as a lowrank_jax checkpoint", where="--family",
                          expected="a Hugging Face directory", actual=path)
    from lowrank_jax.io import load_metadata, load_model, load_params

    meta = load_metadata(path)
    with status.phase(f"loading {path}"):
        config, params = load_model(path) if "config" in meta else (None, load_params(path))
    meta = {k: v for k, v in meta.items() if v is not None and k != "config"}
    return Source(path, "checkpoint", config, params, meta)


__all__ = ["Source", "TOKENIZER_FILES", "WEIGHT_FILES", "is_hf_directory", "load_source", "parse_rules"]
