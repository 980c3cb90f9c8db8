"""One functional entry point for every model: ``apply(config, params, **inputs) -> dict``.

Each model module registers ``fn(config, params, **inputs) -> dict`` for its config class with
:func:`register`; :func:`apply` dispatches on the config's type (walking its MRO). Inputs are
named as in the PyTorch forward (``input_ids``, ``attention_mask``, ``decoder_input_ids``,
``pixel_values``, ...) and outputs keyed like the PyTorch outputs (``last_hidden_state``,
``encoder_last_hidden_state``, ``logits``, ...).
"""

from __future__ import annotations

from typing import Any, Callable

from lowrank_jax.models import bert as _bert
from lowrank_jax.models import chronos as _chronos
from lowrank_jax.models import chronos_bolt as _chronos_bolt
from lowrank_jax.models import t5 as _t5
from lowrank_jax.models import vit as _vit

_APPLY: dict[type, Callable[..., dict]] = {}


def register(config_cls: type, fn: Callable[..., dict]) -> None:
    """Make :func:`apply` call ``fn(config, params, **inputs)`` for ``config_cls`` configs."""
    if not isinstance(config_cls, type):
        raise TypeError(f"register: config_cls must be a class, got {config_cls!r}")
    _APPLY[config_cls] = fn


def registered() -> tuple[type, ...]:
    """The config classes :func:`apply` knows."""
    return tuple(_APPLY)


def apply(config: Any, params: Any, **inputs) -> dict:
    """Run the model that ``config`` describes.

    Args:
      config: a model config dataclass (``T5Config``, ``ChronosConfig``, ...).
      params: its parameter tree.
      **inputs: keyword inputs named as in the PyTorch forward.

    Returns:
      A dict of outputs keyed like the PyTorch model's output.
    """
    for cls in type(config).__mro__:
        fn = _APPLY.get(cls)
        if fn is not None:
            return fn(config, params, **inputs)
    raise TypeError(
        f"models.apply: no model registered for config type {type(config).__name__}; "
        f"known: {[c.__name__ for c in _APPLY]}"
    )


register(_t5.T5Config, lambda cfg, params, **inputs: _t5.apply(params, cfg, **inputs))
register(_chronos.ChronosConfig,
         lambda cfg, params, **inputs: _chronos.apply(params, cfg, **inputs))
register(_vit.ViTConfig, lambda cfg, params, **inputs: _vit.apply(params, cfg, **inputs))
register(_bert.BertConfig, lambda cfg, params, **inputs: _bert.apply(params, cfg, **inputs))
register(_chronos_bolt.ChronosBoltConfig, _chronos_bolt.registry_apply)
