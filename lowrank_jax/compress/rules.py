"""Path rules: which nodes a compression step touches, with per-rule settings.

A parameter path is the ``'/'``-joined key path of a node (:func:`lowrank_jax.named_leaves`),
for example ``'encoder/layers/3/attn/qk/q'``, ``'encoder/layers/3/attn/v'`` or
``'decoder/layers/0/cross_attn/o'``. Query-key objects sit at ``'.../attn/qk'``.

A *rule* is ``(regex, action)``:

* ``regex`` is matched with :func:`re.search` (so it may match anywhere; anchor with ``^``/``$``);
* ``action`` is ``None`` (skip the nodes this rule catches) or a dict of per-rule overrides of
  the step's settings (``{}``: use the step's settings). Which override keys are allowed is
  up to the method (:func:`lowrank_jax.compress.register_method`).

A plain string rule means ``(regex, {})``. For each node the *first* rule whose regex matches
wins (big_vision-style); the rule that fired is logged. Nodes no rule matches are left alone. A
rule that matches no selectable node at all is an error (it is almost always a typo).

What is selectable depends on the method: ``'weights'`` methods (``svd``, ``factorize``) see
the weight leaves (:class:`~lowrank_jax.Leaf`) they accept; ``'qk'`` methods see the query-key
objects (:class:`~lowrank_jax.QK`) at ``'.../attn/qk'``.

Example -- all attention projections except the first layer's, values at a fixed rank::

    rules = (
        (r"^encoder/layers/0/", None),
        (r"attn/v$", {"rank": 8}),
        r"attn/(qk/q|qk/k|o)$",
    )
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import jax

from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import QK, Leaf, is_leaf, is_query_key, path_str

logger = logging.getLogger(__name__)

#: The attention projections (the matrices of Table 2 of "Understanding Transformers for Time
#: Series: Rank Structure, Flow-of-Ranks, and Compressibility"): the query and key weights
#: inside the query-key object, the value and the output projection. Because rules use
#: ``re.search``, this also matches ``self_attn/...`` and ``cross_attn/...``.
ATTENTION_QKVO = (r"attn/(qk/q|qk/k|v|o)$",)

#: For per-head compression (eq. 20 of the same paper): heads split the *outputs* of q, k and
#: v. The output projection consumes heads (its *inputs* split into heads), which a
#: :class:`~lowrank_jax.HeadLowRank` cannot express, so it keeps one shared factorization
#: (eq. 19). (Under ``per_head=True`` such weights get the shared factorization anyway; this
#: rule set says so explicitly.)
ATTENTION_QKV_PER_HEAD = ((r"attn/o$", {"per_head": False}), r"attn/(qk/q|qk/k|v)$")

#: The query-key objects of every attention block, for methods that select ``'qk'``.
ATTENTION_QK = (r"attn/qk$",)

#: What a method may select.
KINDS = ("weights", "qk")


class Rule(NamedTuple):
    """A normalized rule: the pattern text, its compiled form and the action."""

    pattern: str
    regex: re.Pattern
    action: dict | None


class Selection(NamedTuple):
    """A selected node: its path, the node (a weight leaf or a query-key object), the overrides
    of the rule that fired (a fresh copy) and that rule's pattern."""

    path: str
    node: Any
    overrides: dict
    rule: str


def _is_single_rule(rules) -> bool:
    return isinstance(rules, str) or (
        isinstance(rules, (tuple, list)) and len(rules) == 2 and isinstance(rules[0], str)
        and (rules[1] is None or isinstance(rules[1], dict)))


def normalize_rules(rules, *, allowed: Iterable[str] | None = None,
                    where: str = "rules") -> list[Rule]:
    """Check and compile rules (see the module docstring for the accepted forms).

    A single string or a single ``(regex, action)`` pair is accepted as one rule.

    Args:
      rules: the rules.
      allowed: override keys an action may hold (``None``: any).
      where: what the rules belong to, for messages (``'step 1 (svd)'``).

    Returns:
      A list of :class:`Rule`.

    Raises:
      PlanError: a malformed rule, an invalid regular expression (naming the rule), or an
        override key that is not allowed.
    """
    if _is_single_rule(rules):
        rules = (rules,)
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise PlanError(f"{where}: rules must be a list of rules, got {rules!r}", where=where,
                        expected="list of rules", actual=rules)
    allowed = None if allowed is None else frozenset(allowed)
    out = []
    for rule in rules:
        if isinstance(rule, str):
            pattern, action = rule, {}
        elif isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str):
            pattern, action = rule
        else:
            raise PlanError(
                f"{where}: each rule must be a regex string or a (regex, action) pair, got "
                f"{rule!r}", where=where, expected="regex or (regex, action)", actual=rule)
        if action is not None:
            if not isinstance(action, dict):
                raise PlanError(
                    f"{where}: rule {pattern!r}: action must be None (skip) or a dict of "
                    f"overrides, got {action!r}", where=pattern, expected="None or dict",
                    actual=action)
            unknown = set(action) - allowed if allowed is not None else set()
            if unknown:
                raise PlanError(
                    f"{where}: rule {pattern!r}: unknown override keys {sorted(unknown)}; "
                    f"allowed: {sorted(allowed)}", where=pattern, expected=sorted(allowed),
                    actual=sorted(unknown))
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise PlanError(f"{where}: rule {pattern!r} is not a valid regular expression: {e}",
                            where=pattern, expected="a regular expression",
                            actual=pattern) from None
        out.append(Rule(pattern, regex, None if action is None else dict(action)))
    return out


def candidates(params: Any, kind: str = "weights") -> list[tuple[str, Any]]:
    """``(path, node)`` of every node of ``kind`` in tree order.

    ``'weights'``: every weight leaf (including those inside query-key objects);
    ``'qk'``: every query-key object.
    """
    if kind not in KINDS:
        raise PlanError(f"rules: kind must be one of {KINDS}, got {kind!r}", where="kind",
                        expected=KINDS, actual=kind)
    typ = Leaf if kind == "weights" else QK
    stop = (lambda x: is_leaf(x)) if kind == "weights" else (
        lambda x: (is_query_key(x) or is_leaf(x)))
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=stop)
    return [(path_str(p), n) for p, n in flat if isinstance(n, typ)]


def select(params: Any, rules: Sequence = ATTENTION_QKVO, *, kind: str = "weights",
           accepts: Callable[[Any], bool] | None = None, allowed: Iterable[str] | None = None,
           where: str = "rules") -> list[Selection]:
    """Apply path rules to the selectable nodes of a parameter tree.

    Args:
      params: a parameter tree.
      rules: rules as described in the module docstring, first match wins.
      kind: ``'weights'`` (weight leaves) or ``'qk'`` (query-key objects).
      accepts: optional predicate on a node: only nodes it accepts are selectable (a method
        that cannot truncate binary leaves, say). Rules are matched against these only.
      allowed: override keys a rule's action may hold (``None``: any).
      where: what the rules belong to, for messages.

    Returns:
      :class:`Selection` tuples in tree order, for the nodes whose winning rule has a dict
      action.

    Raises:
      PlanError: a malformed rule or bad regular expression (naming the rule), or a rule
        whose regex matches no selectable node (the message names the rule and lists the
        available paths).
    """
    compiled = normalize_rules(rules, allowed=allowed, where=where)
    nodes = [(p, n) for p, n in candidates(params, kind) if accepts is None or accepts(n)]
    matched = [False] * len(compiled)
    out = []
    for path, node in nodes:
        winner = None
        for i, rule in enumerate(compiled):
            if rule.regex.search(path):
                matched[i] = True
                if winner is None:
                    winner = rule
        if winner is None:
            logger.debug("%s: %s: no rule matches; left alone", where, path)
        elif winner.action is None:
            logger.info("%s: %s: rule %r fired: skip", where, path, winner.pattern)
        else:
            logger.info("%s: %s: rule %r fired: %s", where, path, winner.pattern,
                        winner.action or "step settings")
            out.append(Selection(path, node, dict(winner.action), winner.pattern))
    for rule, hit in zip(compiled, matched, strict=True):
        if not hit:
            names = [p for p, _ in nodes]
            shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12
                                              else "")
            what = "weight leaf" if kind == "weights" else "query-key object"
            raise PlanError(
                f"{where}: rule {rule.pattern!r} matches no {what} this method accepts; "
                f"available paths: {shown or '(none)'}", where=rule.pattern,
                expected="a rule matching a path", actual=rule.pattern)
    return out


__all__ = [
    "ATTENTION_QK", "ATTENTION_QKVO", "ATTENTION_QKV_PER_HEAD", "KINDS", "Rule", "Selection",
    "candidates", "normalize_rules", "select",
]
