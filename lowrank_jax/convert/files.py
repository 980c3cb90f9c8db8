"""Reading Hugging Face checkpoints: directories, state dicts and live PyTorch modules.

``*.safetensors`` files (single or sharded) are read with ``safetensors.numpy``, without torch;
torch is imported only for ``pytorch_model.bin`` files. Tensors of a live module or a state
dict of torch tensors are converted with the torch that their owner already imported (looked up
in ``sys.modules``, never imported here), and so are ``transformers`` models and Chronos
pipelines: an object can only be one of those if its library is loaded.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from lowrank_jax.errors import CheckpointError, ConfigError, DataError, MissingFileError

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"


def to_numpy(t: Any) -> np.ndarray:
    """A tensor or array-like as a NumPy array; torch bfloat16/float16 become float32.

    Args:
      t: a NumPy array, a torch tensor (of an already imported torch) or an array-like.

    Returns:
      The array (NumPy arrays are returned as they are).
    """
    if isinstance(t, np.ndarray):
        return t
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.numpy()
    return np.asarray(t)


# safetensors dtype names -> little-endian NumPy dtypes (BF16 is widened to float32 by hand).
_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
                       "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def _read_bfloat16_file(path: str) -> dict[str, np.ndarray]:
    """Read a ``.safetensors`` file that NumPy's dtypes cannot hold (bfloat16 tensors, which
    ``safetensors.numpy`` rejects): the format is an 8-byte header length, a JSON header of
    ``{name: {dtype, shape, data_offsets}}`` and the raw little-endian data. A bfloat16 value
    is the upper half of a float32, so widening it is exact."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        buf, dtype = data[start:end], info["dtype"]
        if end > len(data):
            raise CheckpointError(path, message=f"{path}: tensor {name!r} ends at byte {end}, "
                                  f"the data has {len(data)} (the file is cut short)")
        if dtype == "BF16":
            a = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(buf, _SAFETENSORS_DTYPES[dtype])
        out[name] = a.reshape(info["shape"]).copy()
    return out


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file, as NumPy arrays (torch is not needed;
    bfloat16 tensors are widened to float32, exactly).

    Raises:
      MissingFileError: no file at ``path``.
      CheckpointError: the file is truncated or corrupt (naming the file).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not os.path.exists(path):
        raise MissingFileError(f"load_pretrained: missing weights file {path}", where=path)
    try:
        try:
            return load_file(path)
        except TypeError as e:  # a dtype NumPy does not have (bfloat16)
            if "bfloat16" not in str(e):
                raise
            return _read_bfloat16_file(path)
    except (SafetensorError, OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(
            path, message=f"cannot read safetensors file {path}: {type(e).__name__}: {e} "
                          "(truncated or corrupt download? re-fetch the file)") from e


def read_torch_bin(path: str) -> dict[str, np.ndarray]:
    """All tensors of a ``pytorch_model.bin`` (imports torch; ``weights_only`` unpickling).

    Raises:
      CheckpointError: the file cannot be read.
    """
    import torch  # lazily: only pytorch_model.bin files get here

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for corrupt pickles/zips
        raise CheckpointError(
            path, message=f"cannot read PyTorch file {path}: {type(e).__name__}: {e}") from e
    return {k: to_numpy(v) for k, v in state.items()}


def read_weights(directory: str) -> tuple[dict[str, np.ndarray], str]:
    """The tensors of a Hugging Face directory and the file they came from.

    Looks for ``model.safetensors``, then a sharded ``model.safetensors.index.json``, then
    ``pytorch_model.bin``.

    Args:
      directory: the checkpoint directory.

    Returns:
      ``({key: array}, source)`` where ``source`` names the file (for error messages).

    Raises:
      MissingFileError: none of the three exists (or a shard named by the index is missing).
      CheckpointError: a file is unreadable, or the index is malformed.
    """
    single = os.path.join(directory, WEIGHTS_NAME)
    index = os.path.join(directory, INDEX_NAME)
    binary = os.path.join(directory, TORCH_NAME)
    if os.path.exists(single):
        return read_safetensors(single), single
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(index, message=f"cannot read the shard index {index}: "
                                                 f"{type(e).__name__}: {e}") from e
        state: dict[str, np.ndarray] = {}
        for s in shards:
            state.update(read_safetensors(os.path.join(directory, s)))
        return state, index
    if os.path.exists(binary):
        return read_torch_bin(binary), binary
    raise MissingFileError(
        f"load_pretrained: no weights in {directory}: expected {WEIGHTS_NAME}, {INDEX_NAME} or "
        f"{TORCH_NAME}", where=directory, expected=[WEIGHTS_NAME, INDEX_NAME, TORCH_NAME])


def read_config(path: str) -> dict:
    """A parsed ``config.json``.

    Raises:
      MissingFileError: no file at ``path``.
      ConfigError: not valid JSON, or not a JSON object.
    """
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise MissingFileError(f"load_pretrained: no config.json at {path}", where=path) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"load_pretrained: {path} is not valid JSON: {e}", where=path) from e
    if not isinstance(config, dict):
        raise ConfigError(f"load_pretrained: {path} must hold a JSON object, got "
                          f"{type(config).__name__}", where=path, expected="object",
                          actual=type(config).__name__)
    return config


def read_generation_config(directory: str) -> dict | None:
    """The parsed ``generation_config.json`` of a checkpoint directory, or ``None`` if it has
    none.

    Raises:
      ConfigError: the file is not valid JSON, or not a JSON object.
    """
    path = os.path.join(directory, GENERATION_CONFIG_NAME)
    if not os.path.exists(path):
        return None
    return read_config(path)


def _json_value(v: Any) -> Any:
    """``json.dumps``' fallback for the values a config dict may hold besides JSON ones: NumPy
    scalars and arrays as numbers and lists, anything else (a ``torch.dtype``) as its string,
    as ``transformers`` writes it."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return str(v)


def file_dict(config: Any) -> dict | None:
    """A Hugging Face config as the JSON object its file holds: what
    :func:`~lowrank_jax.convert.load_pretrained` keeps to write back on export.

    Args:
      config: ``None``, a dict (copied through JSON), or a ``transformers`` ``PretrainedConfig``
        or ``GenerationConfig`` (what its ``save_pretrained`` writes: the fields that differ
        from the class defaults).

    Returns:
      A JSON-able dict (``None`` for ``None``).
    """
    if config is None:
        return None
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(config, (transformers.PretrainedConfig,
                                                        transformers.GenerationConfig)):
        return json.loads(config.to_json_string(use_diff=True))
    return json.loads(json.dumps(dict(config), default=_json_value))


def config_dict(config: Any) -> dict | None:
    """A Hugging Face config as a dict.

    Args:
      config: ``None``, a dict, a path to a ``config.json`` or to its directory, or a
        ``transformers`` ``PretrainedConfig``.

    Returns:
      The dict (``None`` for ``None``).
    """
    if config is None:
        return None
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        p = os.fspath(config)
        return read_config(os.path.join(p, CONFIG_NAME) if os.path.isdir(p) else p)
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(config, transformers.PretrainedConfig):
        return config.to_dict()
    raise ConfigError(f"load_pretrained: config must be a dict, a path or a transformers "
                      f"PretrainedConfig, got {type(config).__name__}", where="config",
                      expected="dict, path or PretrainedConfig", actual=type(config).__name__)


def hf_model(source: Any):
    """The ``transformers`` model inside ``source``: the model itself, a chronos-forecasting
    pipeline (its ``inner_model``) or a ``ChronosModel`` wrapper (its ``model``).

    Raises:
      DataError: ``source`` is none of these.
    """
    chronos = sys.modules.get("chronos")
    if chronos is not None:
        if isinstance(source, chronos.BaseChronosPipeline):
            source = source.inner_model
        elif isinstance(source, chronos.ChronosModel):
            source = source.model
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(source, transformers.PreTrainedModel):
        raise DataError(
            "load_pretrained: source must be a checkpoint directory, a state dict {key: tensor} "
            f"or a transformers model (or Chronos pipeline), got {type(source).__name__}",
            where="source", expected="directory, state dict or PreTrainedModel",
            actual=type(source).__name__)
    return source


__all__ = ["CONFIG_NAME", "GENERATION_CONFIG_NAME", "INDEX_NAME", "TORCH_NAME", "WEIGHTS_NAME",
           "config_dict", "file_dict", "hf_model", "read_config", "read_generation_config",
           "read_safetensors", "read_torch_bin", "read_weights", "to_numpy"]
