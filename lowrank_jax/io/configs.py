"""Model configs <-> JSON, rebuilt from a registry of config classes (never imported by name).

The registry (:func:`config_classes`) holds

1. the config class of every registered model family (:func:`lowrank_jax.models.families`),
   so a family defined outside lowrank_jax is known once it is registered;
2. every class passed to :func:`register_config` (configs that belong to no family);
3. every dataclass reachable from those through the type annotations of their fields
   (``ChronosConfig.t5: T5Config``, ``Optional[...]``, ``tuple[...]``) or the dataclass
   instances they hold as defaults,

keyed by qualified name (``'lowrank_jax.models.t5.T5Config'``). A serialized config is
``{"__config__": qualified name, "fields": {...}}``; nested configs are serialized the same way
inside ``fields``. Files written by lowrank_jax 0.1 name the class ``'module:QualName'``; both
spellings are read. A class outside the registry is refused, so loading a file never imports or
runs code named in it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import numpy as np

from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import qualified_name
from lowrank_jax.models import families

_EXTRA: list[type] = []


def register_config(cls: type) -> type:
    """Add a config dataclass that belongs to no model family to the registry.

    Usable as a decorator. Model families need no registration: their config classes (and the
    configs nested in them) are found through :func:`lowrank_jax.models.families`.

    Args:
      cls: a dataclass.

    Returns:
      ``cls``.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"register_config: expected a dataclass, got {cls!r}",
                          expected="a dataclass", actual=repr(cls))
    if cls not in _EXTRA:
        _EXTRA.append(cls)
    return cls


def _hint_classes(hint: Any) -> list[type]:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint]
    out = []
    for arg in typing.get_args(hint):
        out.extend(_hint_classes(arg))
    return out


def _field_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: use the defaults only
        return {}


def config_classes() -> dict[str, type]:
    """Every config class that :func:`config_from_dict` rebuilds, by qualified name.

    Computed from the families and classes registered at the time of the call.

    Returns:
      ``{'lowrank_jax.models.t5.T5Config': T5Config, ...}``.
    """
    todo = [fam.config_cls for fam in families().values()] + list(_EXTRA)
    found: dict[str, type] = {}
    while todo:
        cls = todo.pop()
        name = qualified_name(cls)
        if found.get(name) is cls or not dataclasses.is_dataclass(cls):
            continue
        found[name] = cls
        hints = _field_hints(cls)
        for f in dataclasses.fields(cls):
            todo.extend(_hint_classes(hints.get(f.name)))
            if dataclasses.is_dataclass(f.default) and not isinstance(f.default, type):
                todo.append(type(f.default))
    return found


def _find(stored: Any, source: str) -> type:
    classes = config_classes()
    name = stored.replace(":", ".") if isinstance(stored, str) else None
    if name in classes:
        return classes[name]
    short = name.rsplit(".", 1)[-1] if name else None
    matches = sorted({c for c in classes.values() if c.__qualname__ == short}, key=qualified_name)
    if name and len(matches) == 1:
        return matches[0]
    raise ConfigError(
        f"{source}: config class {stored!r} is not a registered lowrank_jax config; known: "
        f"{sorted(classes)}. Register its model family (lowrank_jax.models.register_family) or "
        "the class (lowrank_jax.io.register_config) before loading", where=source,
        expected="a registered config class", actual=stored)


def config_to_dict(config: Any) -> dict:
    """A config dataclass (possibly nested) as a JSON-able dict with its class name.

    Args:
      config: an instance of a class in :func:`config_classes`.

    Returns:
      ``{"__config__": qualified class name, "fields": {name: value}}``; nested configs are
      encoded the same way, tuples as lists.

    Raises:
      ConfigError: ``config`` is not an instance of a registered config class (it could not
        be loaded back).
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise ConfigError(f"config_to_dict: expected a config dataclass instance, got "
                          f"{type(config).__name__}", expected="a config dataclass",
                          actual=type(config).__name__)
    cls = type(config)
    name = qualified_name(cls)
    if config_classes().get(name) is not cls:
        raise ConfigError(
            f"config_to_dict: {name} is not a registered config class (the config class of a "
            "model family, a config nested in one, or one given to register_config), so it "
            "could not be loaded back", where=name, expected="a registered config class",
            actual=name)

    def enc(v):
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return config_to_dict(v)
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {str(k): enc(x) for k, x in v.items()}
        if isinstance(v, (np.bool_, np.integer, np.floating)):
            return v.item()
        return v

    fields = {f.name: enc(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    return {"__config__": name, "fields": fields}


def _tuple_args(hint: Any) -> tuple | None:
    """The element hints if ``hint`` (or a member of a union) is a tuple type, else ``None``."""
    if hint is tuple:
        return (Any, ...)
    origin = typing.get_origin(hint)
    if origin is tuple:
        return typing.get_args(hint) or (Any, ...)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            found = _tuple_args(arg)
            if found is not None:
                return found
    return None


def _decode(v: Any, hint: Any, source: str) -> Any:
    if isinstance(v, dict) and "__config__" in v:
        return config_from_dict(v, source=source)
    if isinstance(v, list):
        args = _tuple_args(hint)
        if args is None:
            return [_decode(x, None, source) for x in v]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(x, args[0], source) for x in v)
        return tuple(_decode(x, args[i] if i < len(args) else None, source)
                     for i, x in enumerate(v))
    return v


def config_from_dict(d: dict, *, source: str = "config") -> Any:
    """Inverse of :func:`config_to_dict`; also reads lowrank_jax 0.1's ``'module:QualName'``.

    Lists become tuples where the field's annotation is a tuple.

    Args:
      d: the serialized config.
      source: where ``d`` came from (a file), for messages.

    Returns:
      The config instance.

    Raises:
      ConfigError: ``d`` is not a serialized config, names a class outside
        :func:`config_classes`, or its fields do not build that class.
    """
    if not isinstance(d, dict) or "__config__" not in d or not isinstance(d.get("fields"), dict):
        raise ConfigError(f"{source}: not a serialized lowrank_jax config: {str(d)[:200]}",
                          where=source, expected="{'__config__': ..., 'fields': {...}}",
                          actual=str(d)[:200])
    cls = _find(d["__config__"], source)
    hints = _field_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(d["fields"]) - names)
    if unknown:
        raise ConfigError(f"{source}: {cls.__name__} has no fields {unknown}; its fields are "
                          f"{sorted(names)}", where=source, expected=sorted(names),
                          actual=unknown)
    kwargs = {k: _decode(v, hints.get(k), source) for k, v in d["fields"].items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: cannot build {cls.__name__} from the stored fields: {e}",
                          where=source) from e


__all__ = ["config_classes", "config_from_dict", "config_to_dict", "register_config"]
