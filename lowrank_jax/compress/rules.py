"""Path rules: which weights a compression touches, with per-rule settings.

A parameter path is the ``'/'``-joined key path of a leaf (:func:`lowrank_jax.leaves.named_leaves`),
for example ``'layers/3/attn/q'`` or ``'decoder/layers/0/cross_attn/k'``.

A *rule* is ``(regex, action)``:

* ``regex`` is matched with :func:`re.search` (so it may match anywhere; anchor with ``^``/``$``);
* ``action`` is ``None`` (skip the weights this rule catches) or a dict of per-rule overrides
  with keys among ``eps``, ``rank``, ``per_head``, ``num_heads`` (``{}``: use the global
  settings).

A plain string rule means ``(regex, {})``. For each weight the *first* rule whose regex matches
wins (big_vision-style); the rule that fired is logged. Weights no rule matches are left alone.

Example -- all attention projections except the first layer's, values at a fixed rank::

    rules = (
        (r"^layers/0/", None),
        (r"attn/v$", {"rank": 8}),
        r"attn/(q|k|o)$",
    )
"""

from __future__ import annotations

import logging
import re
from typing import Any, NamedTuple, Sequence

from lowrank_jax.leaves import Dense, LowRank, named_leaves

logger = logging.getLogger(__name__)

#: Attention q/k/v/o projections (the matrices seed 000 Table 2 compresses). Because rules use
#: ``re.search``, this also matches ``self_attn/q`` and ``cross_attn/q``.
ATTENTION_QKVO = (r"attn/(q|k|v|o)$",)

#: For per-head compression (seed 000 eq. 20): heads split the *outputs* of q/k/v; the output
#: projection consumes heads, so it keeps one shared factorization (eq. 19).
ATTENTION_QKV_PER_HEAD = ((r"attn/o$", {"per_head": False}), r"attn/(q|k|v)$")

OVERRIDE_KEYS = frozenset({"eps", "rank", "per_head", "num_heads"})

#: Leaf types a compression may select.
WEIGHT_TYPES = (Dense, LowRank)


class Rule(NamedTuple):
    """A normalized rule: the pattern text, its compiled form and the action."""

    pattern: str
    regex: re.Pattern
    action: dict | None


class Selection(NamedTuple):
    """A selected weight: its path, its leaf, the overrides of the rule that fired, that rule."""

    path: str
    leaf: Any
    overrides: dict
    rule: str


def normalize_rules(rules) -> list[Rule]:
    """Check and compile rules (see the module docstring for the accepted forms).

    A single string or a single ``(regex, action)`` tuple is accepted as one rule.

    Raises:
      ValueError: a malformed rule, an invalid regex, or unknown override keys.
    """
    if isinstance(rules, str) or (
        isinstance(rules, tuple) and len(rules) == 2 and isinstance(rules[0], str)
        and (rules[1] is None or isinstance(rules[1], dict))
    ):
        rules = (rules,)
    out = []
    for rule in rules:
        if isinstance(rule, str):
            pattern, action = rule, {}
        elif isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str):
            pattern, action = rule
        else:
            raise ValueError(
                f"rules: each rule must be a regex string or a (regex, action) pair, got {rule!r}"
            )
        if action is not None:
            if not isinstance(action, dict):
                raise ValueError(
                    f"rules: rule {pattern!r}: action must be None (skip) or a dict of "
                    f"overrides, got {action!r}"
                )
            unknown = set(action) - OVERRIDE_KEYS
            if unknown:
                raise ValueError(
                    f"rules: rule {pattern!r}: unknown override keys {sorted(unknown)}; "
                    f"allowed: {sorted(OVERRIDE_KEYS)}"
                )
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"rules: rule {pattern!r} is not a valid regex: {e}") from None
        out.append(Rule(pattern, regex, None if action is None else dict(action)))
    return out


def weight_paths(params) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of every selectable weight leaf (Dense / LowRank) of ``params``."""
    return [(p, n) for p, n in named_leaves(params) if isinstance(n, WEIGHT_TYPES)]


def select(params, rules: Sequence = ATTENTION_QKVO) -> list[Selection]:
    """Apply path rules to the Dense / LowRank leaves of a parameter tree.

    Args:
      params: a parameter tree.
      rules: rules as described in the module docstring, first match wins.

    Returns:
      ``[(path, leaf, overrides, rule), ...]`` (:class:`Selection` tuples) in tree order, for
      the weights whose winning rule has a dict action.

    Raises:
      ValueError: a rule whose regex matches no weight leaf at all (the message names the rule
        and lists some available paths), or a malformed rule.
    """
    compiled = normalize_rules(rules)
    weights = weight_paths(params)
    matched = [False] * len(compiled)
    out = []
    for path, leaf in weights:
        winner = None
        for i, rule in enumerate(compiled):
            if rule.regex.search(path):
                matched[i] = True
                if winner is None:
                    winner = rule
        if winner is None:
            logger.debug("compress rules: %s: no rule matches; left alone", path)
        elif winner.action is None:
            logger.info("compress rules: %s: rule %r fired: skip", path, winner.pattern)
        else:
            logger.info("compress rules: %s: rule %r fired: %s", path, winner.pattern,
                        winner.action or "global settings")
            out.append(Selection(path, leaf, dict(winner.action), winner.pattern))
    for rule, hit in zip(compiled, matched, strict=True):
        if not hit:
            names = [p for p, _ in weights]
            shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12
                                              else "")
            raise ValueError(
                f"rules: rule {rule.pattern!r} matches no Dense/LowRank weight; "
                f"available paths: {shown or '(none)'}"
            )
    return out
