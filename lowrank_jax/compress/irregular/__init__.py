"""Irregular attention: TruncAtt, CP-SlimAtt and IrrAtt on the joint query-key tensor, and
TruncAtt of the value-output side.

"Vision Transformer with Irregular Attention" (sec. 2-3) compresses the query-key tensor
``Y: [F, F, H]`` (``Y_h = W^Q_h (W^K_h)^T``) of every attention block as a whole. Four plan
methods (``selects='qk'`` for the first three: their rules match ``'.../attn/qk'``):

* ``truncatt`` -- per-head truncated SVD of every slice ``Y_h`` (sec. 2.3; note that it
  factorizes the *product* of a head's query and key weights, not each of them) into a
  :class:`~lowrank_jax.QueryKey` whose per-head widths are the ranks (irregular ranks allowed).
  Row ``error``: ``||Y - Y_r||_F / ||Y||_F``, the root sum of squares of the discarded singular
  values over the norm.
* ``cp`` -- CP-SlimAtt (eqs. 3-4): a rank-``R`` CP of ``Y`` (:func:`~lowrank_jax.decomp.cp_als`
  from an SVD initialisation, then :func:`~lowrank_jax.decomp.cp_epc`) into a
  :class:`~lowrank_jax.leaves.qk_factorized.CPQueryKey`.
* ``btd`` -- IrrAtt (eqs. 5-6, Algorithms 1-3): a BTD-(L,L,1) of ``Y`` with one term per head
  and total rank ``R`` (:func:`~lowrank_jax.decomp.btd_ll1`) into a
  :class:`~lowrank_jax.leaves.qk_factorized.BTDQueryKey`; or, with ``ranks`` given, the sweeps
  from the slices' truncated SVDs at those ranks.
* ``truncatt_vo`` (``selects='weights'``, rules match ``'.../attn/v'``) -- per-head truncated SVD
  of ``W^V_h (W^O_h)^T`` (the paper's VO compression in every experiment): the value and output
  projections of the block get per-head widths equal to the ranks (its
  :class:`~lowrank_jax.HeadLayout` value widths change; the query-key side is untouched).

Biases are exact: the tensor is taken over the inputs augmented with a constant feature
(:func:`~lowrank_jax.leaves.qk_factorized.augmented_joint`; a bias row or column that is zero
everywhere, as in T5, is left out). ``drop_key_bias=True`` zeroes the key-bias column first:
its entries (``x_q W^Q_h b_k + b_q . b_k``) are constant along each row of logits and cancel in
the softmax, so attention outputs are unchanged while less has to be approximated (logits then
differ from the original by a per-query constant). The value bias is folded into the output
bias (``sum_h P_h 1 b_v^T W^O_h = 1 b_v^T W^O`` because softmax rows sum to one; this is not
exact together with fixed value activation masks, ``qkv_keep``). The original logit scale stays
in the block's head layout.

How much to keep is set by ``rank`` (``truncatt``: per head, an int or one int per head;
``cp``/``btd``: the total rank ``R``) or by ``flops_ratio`` with ``n_tokens`` (sec. 3.4, the
"local" rule: every selected block gets the same target): the largest rank whose multiply-adds
stay within ``flops_ratio`` of the block's as given, counted with the paper's formulas
(:func:`attention_macs`, including the ``N^2`` terms and IrrAtt's head fusion, which leaf-level
counts omit), the value-output side at ``vo_rank`` per head if given (the rank a later
``truncatt_vo`` step will apply) or as it is. With these formulas the ratios of Table 1 for
DeiT-S and DeiT-B are reproduced to 0.12 points (tested), and
``select_rank('truncatt', 0.375, n_tokens=197, d_model=384, num_heads=6, d_head=64, vo_rank=32)``
is 16.

Row ``details``: ``head_ranks`` (per head; for ``cp`` the number of rank-1 terms whose largest
fusion weight is in that head, Algorithm 1's assignment), ``rank``, the paper's MACs before and
after and their ratio (with ``n_tokens``), the executed MACs after (zero-padded irregular terms
count as executed), and for ``btd`` the fitting history. :func:`head_ranks` collects them from a
report (for the layer x head heat map, :func:`lowrank_jax.analysis.plots_heads.plot_head_ranks`).

A block without heads (every head pruned, :mod:`lowrank_jax.compress.empty`) has no slice to
factorize: its query-key object (and, for ``truncatt_vo``, its value and output projections) is
passed through unchanged with a row of kind ``'empty'``, before any per-head setting is read
(a list of ranks has one entry per head of the blocks that have heads). The other blocks are
compressed as without it.

What the paper leaves open is decided in :mod:`lowrank_jax.decomp.btd` (rank-0 terms, warm
starts, stopping rule, CPD-EPC) and here: ``btd`` caps each head's rank at the numerical rank
of its slice (at most ``d_head``; Algorithm 1 may give more, which a slice cannot use) and gives
the surplus columns to the heads with the next largest fusion weight; a head with rank 0 attends
exactly uniformly (its row of the fusion matrix is held at zero during the sweeps; see
:func:`btd`, setting ``rank0_uniform``), and ``details['uniform_heads']`` lists the heads whose
row of the fitted fusion matrix is zero. For ``cp``, a head whose ``head_ranks`` is 0 is not
uniform: every rank-1 term still reaches it through its row of ``S^H``.

The package by job: :mod:`.methods` (``truncatt``, ``cp``, ``btd``, their settings and
frontier candidates), :mod:`.value_output` (``truncatt_vo``), :mod:`.counts` (the paper's
counts and :func:`select_rank`), :mod:`.conversions` (augmented tensor <-> query-key objects:
:func:`query_key_from_slices`, :func:`to_query_key`) and :mod:`.tables` (:func:`head_ranks`,
:func:`layer_table`, the heat map).
"""

from lowrank_jax.compress.irregular.conversions import (
    numerical_ranks,
    query_key_from_slices,
    to_query_key,
)
from lowrank_jax.compress.irregular.counts import (
    QK_KINDS,
    attention_macs,
    attention_param_count,
    select_rank,
)
from lowrank_jax.compress.irregular.methods import (  # registers truncatt, cp, btd
    OVERRIDES,
    SETTINGS,
    btd,
    cp,
    truncatt,
)
from lowrank_jax.compress.irregular.tables import (
    format_layer_table,
    head_ranks,
    layer_table,
    save_head_rank_plot,
)
from lowrank_jax.compress.irregular.value_output import truncatt_vo  # registers truncatt_vo

__all__ = [
    "OVERRIDES", "QK_KINDS", "SETTINGS", "attention_macs", "attention_param_count", "btd", "cp",
    "format_layer_table", "head_ranks", "layer_table", "numerical_ranks", "query_key_from_slices",
    "save_head_rank_plot", "select_rank", "to_query_key", "truncatt", "truncatt_vo",
]
