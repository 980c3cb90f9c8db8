"""One record per model family, registered once.

A :class:`ModelFamily` gathers everything the rest of the library needs to know about an
architecture: its config class, ``init`` and ``apply``, its default training loss, its
representative inputs (for compression reports and sweeps), its primary output, how it maps to
Hugging Face checkpoints (:class:`lowrank_jax.models.hf.HFSpec`: a key table and config
translation, torch-free), and, for forecasters, a quantile forecast. The train loop, the CLI,
the converters and the evaluation look a family up with :func:`family_of` and contain no
family-specific code paths.

Every model module registers its family at import (``register_family(ModelFamily(...))``), so
``import lowrank_jax.models`` makes all built-in families known. A family defined outside the
package registers the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from lowrank_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """Everything lowrank_jax knows about one architecture.

    Attributes:
      name: short name (``'t5'``, ``'chronos'``, ``'chronos_bolt'``, ``'vit'``, ``'bert'``).
      config_cls: the frozen config dataclass; :func:`family_of` dispatches on its type.
      init: ``init(key, cfg, **layer_sizes) -> params``.
      apply: ``apply(params, inputs: dict, cfg) -> outputs: dict`` (inputs and outputs named as
        in the PyTorch forward). Stateful families also take ``state=`` and ``train=``.
      sample_inputs: ``sample_inputs(cfg, rng: np.random.Generator, batch: int) -> inputs``,
        representative inputs (real series for forecasters).
      primary_outputs: output keys compared by compression reports, in order of preference
        (the first one the model returns is used: ``'logits'`` of a classifier, else its
        ``'last_hidden_state'``).
      token_outputs: the primary output is a distribution over tokens (top-k overlap is
        meaningful).
      loss: ``loss(cfg) -> loss_fn(params, batch, key) -> (loss, aux)``, the family's default
        training objective on batches of its inputs (``None``: no default).
      forecast: for forecasters, ``forecast(params, context [batch, length], cfg) ->
        quantiles [batch, n_quantiles, prediction_length]`` and ``quantiles`` levels via
        ``forecast_levels(cfg)``; ``None`` otherwise.
      forecast_levels: ``forecast_levels(cfg) -> tuple of quantile levels`` of ``forecast``.
      batch_from_windows: for forecasters trained on series windows, ``fn(cfg, context
        [batch, ctx], target [batch, horizon]) -> batch`` in the form ``loss`` expects.
      hf: the Hugging Face mapping (:class:`lowrank_jax.models.hf.HFSpec`) or ``None``.
      init_state: stateful families: ``init_state(params, cfg) -> state`` (BatchNorm running
        statistics, ...); ``None`` for stateless ones.
      batches: the family's own training batches, ``batches(cfg, *, batch_size, seed) ->
        batches(j) -> batch`` (the ``j``-th batch, in the form ``loss`` expects): what the
        ``prune`` method scores channels on with ``data='builtin'``. ``None``: a forecaster
        (``batch_from_windows``) gets windows of the built-in series
        (:func:`lowrank_jax.compress.prune.builtin_batches`), other families have none.
      init_cache: decoder-only language models: ``init_cache(params, cfg, *, batch, max_len,
        dtype) -> cache``, an empty key-value cache (:mod:`lowrank_jax.models.generation`).
      apply_cached: ``apply_cached(params, input_ids [batch, n], cfg, cache, *, positions
        [batch, n], key_mask [batch, max_len], last_only=False) -> (logits [batch, n, vocab],
        cache)``: the next ``n`` tokens against the cache, whose ``'index'`` advances by
        ``n``; with ``last_only`` the logits of the last token alone (``[batch, 1, vocab]``,
        what a prompt's prefill needs).
    """

    name: str
    config_cls: type
    init: Callable[..., Any]
    apply: Callable[..., dict]
    sample_inputs: Callable[..., dict]
    primary_outputs: tuple[str, ...]
    token_outputs: bool = False
    loss: Callable[[Any], Callable] | None = None
    forecast: Callable[..., Any] | None = None
    forecast_levels: Callable[[Any], tuple] | None = None
    batch_from_windows: Callable[..., dict] | None = None
    hf: Any = None
    init_state: Callable[..., Any] | None = None
    batches: Callable[..., Callable[[int], dict]] | None = None
    init_cache: Callable[..., Any] | None = None
    apply_cached: Callable[..., Any] | None = None

    @property
    def is_language_model(self) -> bool:
        """Whether this is a decoder-only language model, which has cached decoding
        (``apply_cached``) and a next-token loss."""
        return self.apply_cached is not None and self.loss is not None


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Register (or replace) a family; its name and config class must not clash with another
    family's."""
    if not isinstance(family, ModelFamily):
        raise ConfigError(f"register_family: expected a ModelFamily, got {type(family).__name__}")
    for other in _FAMILIES.values():
        if other.name != family.name and other.config_cls is family.config_cls:
            raise ConfigError(f"register_family: {family.config_cls.__name__} is already the "
                              f"config class of family {other.name!r}")
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, ModelFamily]:
    """The registered families by name."""
    return dict(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family called ``name`` (a :class:`~lowrank_jax.errors.ConfigError` naming the known
    ones otherwise)."""
    if name not in _FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(_FAMILIES)}",
                          where="family", expected=sorted(_FAMILIES), actual=name)
    return _FAMILIES[name]


def family_of(config: Any) -> ModelFamily:
    """The family whose config class is ``type(config)`` (or a base class of it)."""
    cls = config if isinstance(config, type) else type(config)
    for base in cls.__mro__:
        for fam in _FAMILIES.values():
            if fam.config_cls is base:
                return fam
    raise ConfigError(f"no model family is registered for config type {cls.__name__}; known: "
                      f"{sorted(f.config_cls.__name__ for f in _FAMILIES.values())}",
                      where="config", actual=cls.__name__)


def apply(params: Any, inputs: dict, config: Any, **kwargs) -> dict:
    """Run the model that ``config`` describes: ``family_of(config).apply(params, inputs,
    config)``.

    Args:
      params: the parameter tree.
      inputs: a dict of inputs named as in the PyTorch forward (``input_ids``, ``context``,
        ``pixel_values``, ...).
      config: the model config dataclass.
      **kwargs: passed on (``state=``, ``train=`` for stateful families).

    Returns:
      A dict of outputs keyed like the PyTorch model's output.
    """
    return family_of(config).apply(params, inputs, config, **kwargs)


def primary_output(family: ModelFamily, outputs: dict) -> str:
    """The first of ``family.primary_outputs`` present in ``outputs``."""
    for key in family.primary_outputs:
        if key in outputs:
            return key
    raise ConfigError(f"family {family.name!r}: none of its primary outputs "
                      f"{family.primary_outputs} is among the model outputs {sorted(outputs)}")


__all__ = ["ModelFamily", "apply", "families", "family_of", "get_family", "primary_output",
           "register_family"]
