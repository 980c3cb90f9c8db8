"""The ``prune`` and ``lora`` plan methods, and where ``prune`` gets its batches.

``Step("prune", rules, {"target": 0.5, "steps": 20, "data": "builtin"})`` masks the selected
weights, runs progressive global pruning ("Less is More: Unlocking Specialization of Time
Series Foundation Models via Structured Pruning", arXiv:2505.23195, Algorithm 1) on batches of
the named data source with the family's default loss, and removes the pruned channels
physically, so that pruning composes with ``svd`` and binarization in one plan (every leaf type
loses channels through the leaf protocol). Without ``target`` the step only removes what the
masks of already masked weights (:class:`~lowrank_jax.leaves.ChannelMasked`) say.

Plans are JSON data, so batches come from a *named source*: ``'builtin'``, the family's own
(its record's :attr:`~lowrank_jax.models.ModelFamily.batches`; a forecasting family without
one gets windows of the real series shipped with aeon, taken from the first 70 % of each series
in time, so that later data stays unseen, :func:`builtin_batches`), or any name given to
:func:`register_batches` (data that is not a family's own: a held-out set, a CSV file).

``Step("lora", rules, {"rank": 8})`` puts a trainable low-rank update on the selected weights
(:func:`~lowrank_jax.leaves.add_lora`; the base weights are frozen).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Callable, Mapping

import numpy as np

from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.prune.algorithm import MEASURES, SCHEDULES, progressive_prune
from lowrank_jax.compress.prune.api import DEFAULT_RULES, layer_table, token_counts
from lowrank_jax.compress.prune.structure import Structure, check_removal
from lowrank_jax.compress.registry import Candidates, CandidateSetting, register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.errors import ConfigError, DataError, NotApplicableError, PlanError
from lowrank_jax.leaves import get_path, replace_paths
from lowrank_jax.leaves.channel_masked import is_channel_masked, mask_leaf
from lowrank_jax.leaves.lora import add_lora

SETTINGS = ("target", "by", "steps", "batch_size", "alpha", "schedule", "data", "seed")
DEFAULTS = {"by": "params", "steps": 20, "batch_size": 32, "alpha": 0.5, "schedule": "cubic",
            "data": "builtin", "seed": 0}

#: The batch source that is the family's own.
BUILTIN = "builtin"
_SOURCES: dict[str, Callable] = {}


def register_batches(name: str, make: Callable) -> None:
    """Register a named batch source for the ``prune`` method's ``data`` setting: data that is
    not a family's own (a family declares its own batches in its record,
    :attr:`~lowrank_jax.models.ModelFamily.batches`, used by ``data='builtin'``).

    Args:
      name: the name plans use (not ``'builtin'``).
      make: ``make(config, *, batch_size, seed) -> batches`` with ``batches(j)`` the ``j``-th
        batch (a dict of ``[batch_size, ...]`` arrays the family's loss takes).

    Raises:
      PlanError: an empty name, ``'builtin'``, or ``make`` not callable.
    """
    if not isinstance(name, str) or not name:
        raise PlanError(f"register_batches: name must be a non-empty string, got {name!r}")
    if name == BUILTIN:
        raise PlanError("register_batches: 'builtin' names the family's own batches; give them "
                        "in its record (ModelFamily(..., batches=make)) or pick another name",
                        where="name", expected="a name other than 'builtin'", actual=name)
    if not callable(make):
        raise PlanError(f"register_batches: {name}: make must be callable")
    _SOURCES[name] = make


def batch_sources() -> list[str]:
    """The names ``data`` may take: ``'builtin'`` and every registered source."""
    return [BUILTIN, *sorted(_SOURCES)]


def batch_source(name: str, caller: str = "prune") -> Callable:
    """The batch source ``name``: ``make(config, *, batch_size, seed) -> batches``.

    ``'builtin'`` is the family's own: :attr:`~lowrank_jax.models.ModelFamily.batches` when its
    record has them, else, for a forecaster, :func:`builtin_batches`.

    Args:
      name: the source's name (a method's ``data`` setting).
      caller: the method asking, named in the error (``'prune'``, ``'quantize'``, ...).

    Raises:
      PlanError: no such source (listing the known ones).
    """
    if name == BUILTIN:
        return _family_batches
    if name not in _SOURCES:
        raise PlanError(f"{caller}: unknown batch source {name!r}; known: {batch_sources()} "
                        "(register_batches adds one)", where="data", expected=batch_sources(),
                        actual=name)
    return _SOURCES[name]


def has_builtin_batches(config: Any) -> bool:
    """Whether the family of ``config`` has batches of its own (``data='builtin'``)."""
    from lowrank_jax.models import family_of

    fam = family_of(config)
    return fam.batches is not None or fam.batch_from_windows is not None


def _family_batches(config: Any, *, batch_size: int, seed: int = 0) -> Callable:
    from lowrank_jax.models import family_of

    fam = family_of(config)
    if fam.batches is not None:
        return fam.batches(config, batch_size=batch_size, seed=seed)
    return builtin_batches(config, batch_size=batch_size, seed=seed)


@functools.lru_cache(maxsize=1)
def _builtin_series() -> tuple:
    from lowrank_jax.datasets import builtin_series

    return tuple(builtin_series()[0])


def builtin_batches(config: Any, *, batch_size: int, seed: int = 0,
                    train_fraction: float = 0.7, max_context: int = 512) -> Callable:
    """Batches of windows of the built-in real series (:func:`lowrank_jax.datasets.builtin_datasets`)
    for a forecasting family: contexts of ``min(context_length, max_context)`` values and
    targets of ``prediction_length``, cut from the first ``train_fraction`` of every series (in
    time), batch ``j`` a deterministic function of ``(seed, j)``.

    Args:
      config: a config of a family with ``batch_from_windows`` (Chronos-Bolt, Chronos).
      batch_size: windows per batch.
      seed: seed of the window draws.
      train_fraction: the part of every series windows may come from.
      max_context: cap on the context length.

    Returns:
      ``batches(j) -> batch``.

    Raises:
      DataError: the family is not a forecaster, or no series is long enough.
    """
    from lowrank_jax.models import family_of

    fam = family_of(config)
    if fam.batch_from_windows is None:
        raise DataError(f"prune: data='builtin' holds time series, for forecasting families; "
                        f"{fam.name!r} needs its own batches (ModelFamily(..., batches=) or "
                        "register_batches)", where="data", expected="a forecasting family",
                        actual=fam.name)
    ctx = int(min(config.context_length, max_context))
    horizon = int(config.prediction_length)
    parts = [s[: int(round(s.size * train_fraction))] for s in _builtin_series()]
    parts = [s for s in parts if s.size >= ctx + horizon]
    if not parts:
        raise DataError(f"prune: no built-in series has {ctx + horizon} values in its first "
                        f"{train_fraction:.0%}", where="data", expected=ctx + horizon)

    def batches(j: int) -> dict:
        rng = np.random.default_rng((int(seed), int(j)))
        which = rng.integers(0, len(parts), size=batch_size)
        wins = []
        for i in which:
            s = parts[i]
            start = int(rng.integers(0, s.size - ctx - horizon + 1))
            w = s[start:start + ctx + horizon]
            scale = np.mean(np.abs(w[:ctx]))
            wins.append(w / (scale if scale > 0 else 1.0))
        w = np.stack(wins).astype(np.float32)
        return fam.batch_from_windows(config, w[:, :ctx], w[:, ctx:])

    return batches



def _check_settings(s: Mapping) -> None:
    if "target" in s:
        t = s["target"]
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < 1:
            raise PlanError(f"prune: target must be a fraction in [0, 1), got {t!r}",
                            where="target", expected="[0, 1)", actual=t)
    for name in ("steps", "batch_size"):
        v = s.get(name, DEFAULTS[name])
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise PlanError(f"prune: {name} must be an int >= 1, got {v!r}", where=name,
                            expected="int >= 1", actual=v)
    a = s.get("alpha", DEFAULTS["alpha"])
    if isinstance(a, bool) or not isinstance(a, numbers.Real) or not 0 < a <= 1:
        raise PlanError(f"prune: alpha must be in (0, 1], got {a!r}", where="alpha",
                        expected="(0, 1]", actual=a)
    if s.get("by", "params") not in MEASURES:
        raise PlanError(f"prune: by must be one of {MEASURES}, got {s.get('by')!r}", where="by",
                        expected=MEASURES, actual=s.get("by"))
    if s.get("schedule", "cubic") not in SCHEDULES:
        raise PlanError(f"prune: schedule must be one of {SCHEDULES}, got {s.get('schedule')!r}",
                        where="schedule", expected=SCHEDULES, actual=s.get("schedule"))
    if not isinstance(s.get("data", "builtin"), str):
        raise PlanError(f"prune: data must be the name of a batch source, got {s.get('data')!r}",
                        where="data", expected=batch_sources(), actual=s.get("data"))


def prune(params, selection, settings, ctx):
    """The ``prune`` plan method ("Less is More", Algorithm 1 and physical removal).

    Args:
      params, selection, settings, ctx: the method signature. Settings: ``target`` (fraction of
        the prunable parameters or FLOPs to remove; without it only existing masks are
        applied), ``by`` (``'params'`` / ``'flops'``), ``steps`` (pruning batches), ``batch_size``,
        ``alpha`` (EMA), ``schedule`` (``'cubic'`` / ``'linear'``), ``data`` (a batch source,
        default ``'builtin'``), ``seed``. Needs ``config=`` in ``apply_plan`` to run
        Algorithm 1 (the family's loss and inputs).

    Returns:
      ``(new_params, rows)``: one row per selected weight (``kind='pruned'``, details
      ``in_kept``, ``out_kept``, ``d_in``, ``d_out``; ``kind='empty'`` for a weight that had
      no inputs or outputs before the step, :mod:`lowrank_jax.compress.empty`: nothing left
      to remove, only its masks are dropped); the step info holds the removed fractions, the
      per-batch history (``k``, loss) and the per-block kept heads and channels.
    """
    s = {**DEFAULTS, **settings}
    _check_settings(s)
    config = ctx.config
    if "target" in settings:
        if config is None:
            raise PlanError("prune: a target needs the model config (apply_plan(..., config=cfg)):"
                            " the family's loss scores the channels", where="config",
                            expected="a model config", actual=None)
        from lowrank_jax.models import family_of

        fam = family_of(config)
        if fam.loss is None:
            raise PlanError(f"prune: family {fam.name!r} has no default loss to score channels",
                            where="config")
        batches = batch_source(s["data"])(config, batch_size=int(s["batch_size"]),
                                          seed=int(s["seed"]))
        masked = replace_paths(params, {sel.path: mask_leaf(sel.node) for sel in selection
                                        if not is_channel_masked(sel.node)})
        tokens = token_counts(config, params)
        result = progressive_prune(masked, fam.loss(config), batches,
                                   target=float(s["target"]), steps=int(s["steps"]),
                                   by=s["by"], alpha=float(s["alpha"]), schedule=s["schedule"],
                                   tokens=tokens, config=config, progress=ctx.progress,
                                   blas_threads=None)  # apply_plan's setting holds
        struct, removal = result.structure, result.removal
        ctx.info.update({"params_fraction": result.params_fraction,
                         "flops_fraction": result.flops_fraction,
                         "history": [{k: v for k, v in h.items() if k != "removed"}
                                     for h in result.history]})
    else:
        if not any(is_channel_masked(sel.node) for sel in selection):
            raise PlanError("prune: without a target the step removes the channels of masked "
                            "weights, and the rules select none (add_channel_masks first, or "
                            "give a target)", where="target", expected="target or masked weights")
        tokens = token_counts(config, params) if config is not None else None
        struct = Structure(params, tokens=tokens, config=config)
        removal = struct.removal_from_tree(params)
        fp, ff = struct.fractions(removal)
        ctx.info.update({"params_fraction": fp, "flops_fraction": ff})
    pruned = struct.remove(removal)
    check_removal(struct, removal, pruned)
    ctx.info["layers"] = [r for r in layer_table(struct, removal) if r["kind"] != "weight"]
    rows = []
    for sel in selection:
        after = get_path(pruned, sel.path)
        r, c = removal.rows.get(sel.path), removal.cols.get(sel.path)
        d_in, d_out = sel.node.shape
        details = {"d_in": int(d_in), "d_out": int(d_out),
                   "in_kept": int(d_in if r is None else r.sum()),
                   "out_kept": int(d_out if c is None else c.sum())}
        if is_empty(sel.node):  # emptied before this step: only its masks go
            rows.append(empty_row(sel, after=after, details=details))
            continue
        rows.append(Row.compare(sel.path, sel.node, after, rule=sel.rule, kind="pruned",
                                details=details))
    return pruned, rows


def _validate(settings):
    try:
        _check_settings({**DEFAULTS, **settings})
    except ConfigError as e:  # pragma: no cover - _check_settings raises PlanError
        raise PlanError(str(e)) from None


def lora(params, selection, settings, ctx):
    """The ``lora`` plan method: a LoRA update of rank ``rank`` (and ``alpha``) on every selected
    weight (:func:`~lowrank_jax.leaves.add_lora`; "Less is More", App. C.2).

    Args:
      params, selection, settings, ctx: the method signature (needs ``key=`` in
        ``apply_plan``).

    A weight with no inputs or no outputs (of an emptied block,
    :mod:`lowrank_jax.compress.empty`) gets no update (its product is zero whatever the
    factors): it is passed through with a row of kind ``'empty'``. The other weights draw the
    keys of their positions in the selection, as without it.

    Returns:
      ``(new_params, rows)`` with ``kind='lora'`` and the rank in the details.
    """
    import jax

    rank = settings.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise PlanError(f"lora: rank must be an int >= 1, got {rank!r}", where="rank",
                        expected="int >= 1", actual=rank)
    key = ctx.require_key()
    keys = jax.random.split(key, max(len(selection), 1))
    new, rows = {}, []
    for sel, k in zip(selection, keys, strict=False):
        if is_empty(sel.node):  # an emptied block's weight: an update would add only zeros
            rows.append(empty_row(sel))
            continue
        leaf = add_lora(k, sel.node, int(rank), alpha=settings.get("alpha"))
        new[sel.path] = leaf
        rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule, kind="lora",
                                details={"rank": int(rank)}))
    return replace_paths(params, new), rows


def _validate_lora(settings):
    rank = settings.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise PlanError(f"lora: rank must be an int >= 1, got {rank!r}", where="rank",
                        expected="int >= 1", actual=rank)
    a = settings.get("alpha")
    if a is not None and (isinstance(a, bool) or not isinstance(a, numbers.Real) or a <= 0):
        raise PlanError(f"lora: alpha must be a positive number, got {a!r}", where="alpha",
                        expected="> 0", actual=a)


def check_prunable(setting: CandidateSetting) -> None:
    """Whether a ``prune`` candidate can run on the model: a config whose family has a loss,
    and batches from the setting's source.

    Raises:
      NotApplicableError: saying which is missing.
    """
    if setting.config is None:
        raise NotApplicableError("needs a model config (its loss scores the channels)",
                                 where="config")
    from lowrank_jax.models import family_of

    fam = family_of(setting.config)
    if fam.loss is None:
        raise NotApplicableError(f"family {fam.name!r} has no default loss to score channels",
                                 where="config")
    if setting.prune_data == BUILTIN and not has_builtin_batches(setting.config):
        if fam.is_language_model:  # it needs text
            raise NotApplicableError(
                f"a {fam.name} language model has no built-in batches: give it text (lowrank-jax "
                "frontier --tokenizer tokenizer.json [--text FILE|DIR], or prune_data= a source "
                "from register_batches with text_batches of lowrank_jax.recipes.prune_lm)",
                where="data")
        raise NotApplicableError(f"its built-in batches are series windows; family {fam.name!r} "
                                 "is not a forecaster (ModelFamily(..., batches=) or "
                                 "register_batches gives it batches)", where="data")


def _candidate_settings(setting: CandidateSetting, keep: float) -> dict:
    return {"target": round(1.0 - keep, 6), "steps": setting.prune_steps, "batch_size": 16,
            "data": setting.prune_data}


#: Frontier candidates: attention and MLP channels, removing ``1 - keep`` of the prunable
#: parameters.
CANDIDATES = Candidates(groups=(("prune", DEFAULT_RULES),), settings=_candidate_settings,
                        label="target={removed:g}", check=check_prunable)

register_method("prune", prune, settings=SETTINGS, overrides=(), validate=_validate,
                candidates=CANDIDATES)
register_method("lora", lora, settings=("rank", "alpha"), overrides=("rank", "alpha"),
                validate=_validate_lora,
                no_candidates="adds trainable low-rank updates (for fine-tuning): a larger model, "
                              "not a smaller one")

__all__ = ["BUILTIN", "CANDIDATES", "DEFAULTS", "SETTINGS", "batch_source", "batch_sources",
           "builtin_batches", "check_prunable", "has_builtin_batches", "lora", "prune",
           "register_batches"]
