"""Selected nodes with nothing to compress: the weights and query-key objects of emptied blocks.

Structured pruning may remove every head of an attention block or every hidden channel of an
MLP (:func:`lowrank_jax.nn.keep_heads`, :func:`lowrank_jax.nn.keep_hidden`, the ``prune``
method). What is left is valid: the block's weights have no outputs (``q``, ``k``, ``v``,
``wi``) or no inputs (``o``, ``wo``) and its query-key object has no heads; the block adds its
output bias and nothing else. A compression method has nothing to compress there. Every
built-in method passes such a node through unchanged (``prune`` drops its channel masks, as
it does everywhere) and reports it with one row of kind :data:`EMPTY` (``details['reason']`` is
:data:`EMPTY_REASON`; counts before and after equal, ``error`` 0.0), and compresses the other
nodes of the step as it would without it; each method's docstring says what that means for it
(a parameter budget, calibration inputs, random keys).
"""

from __future__ import annotations

from typing import Any, Mapping

from lowrank_jax.compress.report import Row
from lowrank_jax.compress.rules import Selection
from lowrank_jax.leaves import is_query_key, weight_shape
from lowrank_jax.leaves.channel_masked import pruned_base

EMPTY = "empty"
EMPTY_REASON = "empty: nothing to compress"


def is_empty(node: Any) -> bool:
    """Whether a selected node has nothing to compress: a query-key object without heads, or a
    weight without inputs or outputs (for a weight whose channels a ``prune`` step removed, on
    its kept channels: :func:`~lowrank_jax.leaves.channel_masked.pruned_base`)."""
    if is_query_key(node):
        return node.num_heads == 0
    return 0 in weight_shape(pruned_base(node)[0])


def empty_row(sel: Selection, *, path: str | None = None, node: Any = None, after: Any = None,
              details: Mapping | None = None) -> Row:
    """The row of a node passed through because it is empty (module docstring).

    Args:
      sel: the selection (its path, node and rule).
      path, node: another node the method reports with ``sel`` (``truncatt_vo`` reports the
        output projection of the value projection it selected); default ``sel``'s.
      after: the node in the tree the method returns, when it is not ``node`` itself (a
        ``prune`` step drops the channel masks of every weight); default ``node``.
      details: more details (the method's own fields); ``reason`` is always
        :data:`EMPTY_REASON`.
    """
    path = sel.path if path is None else path
    node = sel.node if node is None else node
    after = node if after is None else after
    if is_query_key(node):
        out = {"heads": 0}
    else:
        out = {"shape": [int(d) for d in weight_shape(pruned_base(node)[0])]}
    out.update(details or {})
    out["reason"] = EMPTY_REASON
    return Row.compare(path, node, after, rule=sel.rule, kind=EMPTY, error=0.0, details=out)


__all__ = ["EMPTY", "EMPTY_REASON", "empty_row", "is_empty"]
