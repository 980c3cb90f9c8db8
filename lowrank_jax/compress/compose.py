"""Several compression methods in one model: what a plan's order means.

Every method is a step of one :class:`~lowrank_jax.compress.Plan`, and every step selects, by
its own rules, the nodes of the tree *as the previous steps left it*. A model can therefore be
low-rank in attention, pruned in its MLPs, binary in its input embedding and partitioned over
machines in another MLP at once, and its leaves of different types run side by side through the
one ``linear`` dispatch::

    plan = Plan((
        Step("svd", [r"attn/(qk/q|qk/k|v|o)$"], {"schedule": [4, 7]}),     # flow-of-ranks
        Step("prune", [r"encoder/layers/\\d+/mlp/(wi|wo)$"], {"target": 0.4}),
        Step("binarize", [r"input_patch_embedding/"], {"keep": 0.5}),     # Biprop
        Step("partition", [r"decoder/layers/0/mlp/(wi|wo)$"], {"machines": 2, "rank": 4}),
    ))
    small, report = apply_plan(params, plan, config=cfg, key=key)
    print(report.format_table())     # rows per step and node, then one line per step

The report's rows carry the step index; :attr:`Report.steps <lowrank_jax.compress.Report>`
holds, per step, the counts of the whole tree before and after it
(:attr:`~lowrank_jax.compress.StepSummary.tree`, :meth:`Report.format_steps
<lowrank_jax.compress.Report.format_steps>`), so what each step changed is read off directly.

**Order.** Where two steps select the same weights, their order is a modelling choice:

* ``svd`` then ``prune``: the SVD sees the whole trained matrix; pruning then removes
  channels from the factors (rows of ``U`` for inputs, columns of ``V`` for outputs) and the
  rank stays what the SVD chose. The channel importances are measured on the factorized
  model. After heavy pruning a factorization may hold more numbers than the pruned matrix
  would dense; the counts say so (nothing is silently re-densified).
* ``prune`` then ``svd``: the importances are measured on the dense model; the SVD
  approximates the *pruned* matrix on its kept channels (a
  :class:`~lowrank_jax.leaves.ChannelPruned` weight is factorized inside its gather and
  scatter, :func:`~lowrank_jax.leaves.channel_masked.pruned_base`), so a rank is bounded by
  the kept channels: a fixed rank above ``min(kept inputs, kept outputs)`` is a
  :class:`~lowrank_jax.errors.PlanError` naming the weight, while ``eps`` adapts.
* ``prune`` then ``binarize``: the binary weight is built on the kept channels and its scores
  stay trainable. ``binarize`` then ``prune``: pruning freezes the binary weights it slices
  (:class:`~lowrank_jax.FrozenBinary`, same outputs, mask and gain fixed), so their scores no
  longer train; prefer pruning first.
* ``svd`` after ``binarize``: binary weights are not float matrices to approximate; ``svd``'s
  rules do not see them (a rule that matches only binary weights is an error naming the rule).
  ``partition`` refuses them with an error naming the weight. ``binarize`` after ``svd``: the
  factors are multiplied out and the product is binarized.
* ``partition`` then ``prune``: refused (a partitioned weight keeps equal blocks per machine
  and cannot lose single channels; the error names the weight). ``prune`` then ``partition``:
  the pruned widths must be divisible by the machines (the error names the weight otherwise),
  and a weight whose residual-width channels were removed is partitioned as its full-width
  matrix, the removed channels coming back as stored zeros; partition the blocks you do not
  prune, or prune only hidden channels there.

:func:`materialize_leaves` gives the composed model with every weight densified (what an
export to PyTorch writes), the reference a composed model's outputs can be checked against.
"""

from __future__ import annotations

from typing import Any

import jax

from lowrank_jax.leaves import Dense, bias_of, is_leaf, materialize


def materialize_leaves(params: Any) -> Any:
    """``params`` with every weight leaf replaced by a :class:`~lowrank_jax.Dense` leaf of its
    :func:`~lowrank_jax.materialize` d matrix and its bias (:func:`~lowrank_jax.bias_of`).

    The same function as the composed model, in plain dense weights of the same shapes (a
    pruned weight's removed rows and columns as zeros, a partitioned weight in machine order, a
    binary weight as ``alpha sign(w) M``); what :func:`lowrank_jax.convert.save_pretrained`
    exports. Query-key objects stay as they are (their weight leaves are densified), as do
    plain arrays. Nothing is trainable or frozen as before: this is a reference, not a model
    to train.

    Runs as one compiled program (densifying leaf by leaf op by op would compile every small
    operation of every leaf shape on its own).

    Args:
      params: a parameter tree.

    Returns:
      A new tree (``params`` is not modified).
    """
    return _materialize_leaves(params)


@jax.jit
def _materialize_leaves(params: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda n: Dense(w=materialize(n), b=bias_of(n)) if is_leaf(n) else n, params,
        is_leaf=is_leaf)


__all__ = ["materialize_leaves"]
