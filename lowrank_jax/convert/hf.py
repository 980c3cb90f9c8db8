"""Load Hugging Face-format checkpoints (local directory, torch module or state dict).

Families register themselves with :func:`register_family`; :func:`load_pretrained` reads the
config and the weights, picks the family whose ``detect`` accepts the config (exactly one must)
and hands both to its ``load``. Torch is imported lazily and only for ``pytorch_model.bin``
files and torch inputs; ``*.safetensors`` files are read with ``safetensors.numpy``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import numpy as np

from lowrank_jax.convert.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: ``detect(hf_config) -> bool``; ``load(hf_config, state, source) ->
    (config, params)`` with ``state`` a ``{key: np.ndarray}`` dict in PyTorch orientation."""

    name: str
    detect: Callable[[dict], bool]
    load: Callable[[dict, dict, str], tuple[Any, Any]]


_FAMILIES: dict[str, Family] = {}


def register_family(name: str, detect: Callable[[dict], bool],
                    load: Callable[[dict, dict, str], tuple[Any, Any]]) -> None:
    """Register (or replace) a family. ``detect`` functions must not overlap."""
    _FAMILIES[name] = Family(name, detect, load)


def families() -> tuple[str, ...]:
    """Names of the registered families."""
    return tuple(_FAMILIES)


def detect_family(hf_config: dict) -> str:
    """The one registered family whose ``detect`` accepts ``hf_config``.

    Raises:
      ValueError: no family or several families match.
    """
    hits = [f.name for f in _FAMILIES.values() if f.detect(hf_config)]
    if len(hits) == 1:
        return hits[0]
    what = (f"model_type={hf_config.get('model_type')!r}, "
            f"architectures={hf_config.get('architectures')!r}")
    if not hits:
        raise ValueError(
            f"load_pretrained: unknown model family ({what}); registered families: "
            f"{sorted(_FAMILIES)}. Pass family=... if the config is unusual."
        )
    raise ValueError(f"load_pretrained: several families match ({what}): {hits}; pass family=")


# -- reading -----------------------------------------------------------------------------

def _to_numpy(t) -> np.ndarray:
    """A torch tensor (or array-like) as a NumPy array; bfloat16/float16 become float32."""
    if isinstance(t, np.ndarray):
        return t
    import torch  # lazily: only torch inputs get here

    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.numpy()
    return np.asarray(t)


def _read_safetensors(path: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise CheckpointError(
            path, note=f"cannot read safetensors file {path}: {type(e).__name__}: {e} "
                       "(truncated or corrupt download? re-fetch the file)"
        ) from e


def _read_torch_bin(path: str) -> dict:
    import torch  # lazily: only for pytorch_model.bin

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for corrupt pickles/zips
        raise CheckpointError(
            path, note=f"cannot read PyTorch file {path}: {type(e).__name__}: {e}"
        ) from e
    return {k: _to_numpy(v) for k, v in state.items()}


def _read_weights(directory: str) -> tuple[dict, str]:
    """``({key: np.ndarray}, source)`` from a Hugging Face directory."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    binary = os.path.join(directory, "pytorch_model.bin")
    if os.path.exists(single):
        return _read_safetensors(single), single
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for s in shards:
            state.update(_read_safetensors(os.path.join(directory, s)))
        return state, index
    if os.path.exists(binary):
        return _read_torch_bin(binary), binary
    raise FileNotFoundError(
        f"load_pretrained: no weights in {directory}: expected model.safetensors, "
        "model.safetensors.index.json or pytorch_model.bin"
    )


def _read_config(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"load_pretrained: no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"load_pretrained: {path} is not valid JSON: {e}") from e


def _config_dict(config) -> dict | None:
    if config is None:
        return None
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        p = os.fspath(config)
        return _read_config(os.path.join(p, "config.json") if os.path.isdir(p) else p)
    to_dict = getattr(config, "to_dict", None)  # a transformers PretrainedConfig
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"load_pretrained: config must be a dict, a path or a PretrainedConfig, "
                    f"got {type(config).__name__}")


def _unwrap_module(obj):
    """A ``transformers`` model from a torch module or a Chronos pipeline/model wrapper."""
    # ChronosPipeline (not a torch module) keeps the HF model as ``inner_model``; ChronosModel
    # (a torch module) keeps it as ``model``. Their own ``config`` is not the HF config.
    inner = getattr(obj, "inner_model", None)
    if inner is not None:
        return inner
    cfg = getattr(obj, "config", None)
    if cfg is not None and not callable(getattr(cfg, "to_dict", None)):
        inner = getattr(obj, "model", None)
        if inner is not None:
            return inner
    return obj


def load_pretrained(source, *, family: str | None = None, config=None):
    """``(config, params)`` from a Hugging Face checkpoint, without network access.

    Args:
      source: a local directory (``config.json`` plus ``model.safetensors``, a sharded
        ``model.safetensors.index.json`` or ``pytorch_model.bin``); a ``transformers`` model
        (``torch.nn.Module`` with ``.config``) or a Chronos pipeline; or a state dict
        ``{key: tensor or array}`` (then ``config`` is required).
      family: force a registered family (``'t5'``, ``'chronos'``, ...) instead of detecting it
        from ``model_type`` / ``architectures`` / ``chronos_config``.
      config: the Hugging Face config (dict, path, or ``PretrainedConfig``) for a state dict
        source; overrides the module's or directory's config otherwise.

    Returns:
      The family's config dataclass and parameter tree (``Dense`` leaves, ``[d_in, d_out]``).

    Raises:
      CheckpointError: weights do not match the config (every offending key is listed) or a
        weights file cannot be read.
      ValueError: unknown or ambiguous family.
    """
    if isinstance(source, (str, os.PathLike)):
        directory = os.fspath(source)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"load_pretrained: {directory} is not a directory")
        hf_config = _config_dict(config) or _read_config(os.path.join(directory, "config.json"))
        state, where = _read_weights(directory)
    elif isinstance(source, dict):
        hf_config = _config_dict(config)
        if hf_config is None:
            raise ValueError("load_pretrained: a state dict needs config= (the HF config)")
        state, where = {k: _to_numpy(v) for k, v in source.items()}, "<state dict>"
    else:
        module = _unwrap_module(source)
        state_dict = getattr(module, "state_dict", None)
        if not callable(state_dict):
            raise TypeError(
                "load_pretrained: source must be a directory, a state dict or a torch module, "
                f"got {type(source).__name__}"
            )
        hf_config = _config_dict(config if config is not None else module.config)
        state = {k: _to_numpy(v) for k, v in state_dict().items()}
        where = f"<{type(module).__name__}>"
    name = family if family is not None else detect_family(hf_config)
    if name not in _FAMILIES:
        raise ValueError(f"load_pretrained: unknown family {name!r}; registered: "
                         f"{sorted(_FAMILIES)}")
    return _FAMILIES[name].load(hf_config, state, where)
