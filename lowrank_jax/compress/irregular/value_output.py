"""The ``truncatt_vo`` plan method: TruncAtt of the value-output side ("Vision Transformer
with Irregular Attention", sec. 4.2), and its frontier candidates."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.candidates import VALUES
from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.irregular.counts import per_head
from lowrank_jax.compress.irregular.methods import block_of, check_settings, per_head_rank, validator
from lowrank_jax.compress.registry import Candidates, register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import (
    Dense,
    HeadLayout,
    bias_of,
    head_offsets,
    leaf_dtype,
    materialize_host,
    replace_paths,
)
from lowrank_jax.nn import attention_params


def truncatt_vo(params, selection, settings, ctx):
    """The ``truncatt_vo`` plan method: per-head truncated SVD of ``W^V_h (W^O_h)^T``, the
    value-output compression of every experiment of "Vision Transformer with Irregular
    Attention" (sec. 4.2, VO rank 32).

    Rules select the value projections (``'.../attn/v'``); the block's output projection and
    head layout change with them. Head ``h`` keeps ``r_h`` singular triplets of the
    ``[d_kv_in, d_out]`` product (at most its value width: the product has no higher rank):
    ``v_h = U sqrt(S)``, ``o_h = sqrt(S) V^T``. The value bias is folded into the output bias
    (exact because softmax rows sum to one; the value leaf keeps a zero bias). Rows: one for
    ``v`` and one for ``o``; ``error`` is ``||Y - Y_r||_F / ||Y||_F`` over all heads' products.

    Args:
      params, selection, settings, ctx: the method signature. Settings: ``rank`` (an int, or
        one per head).

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel in selection:
        s = {**settings, **sel.overrides}
        check_settings("truncatt_vo", s)
        parent, block = block_of(params, sel.path, "truncatt_vo")
        if block is None or not sel.path.endswith("/v"):
            raise PlanError(f"truncatt_vo: {sel.path} is not the value projection of an attention "
                            "block; select '.../attn/v' paths (for example rules=['attn/v$'])",
                            where=sel.path, expected=".../attn/v", actual=sel.path)
        _, v, o, heads = attention_params(block, parent)
        if is_empty(v):  # a block without heads (or value channels): nothing to truncate
            rows += [empty_row(sel), empty_row(sel, path=f"{parent}/o", node=o)]
            continue
        wv, wo = materialize_host(v), materialize_host(o)
        bv, bo = bias_of(v), bias_of(o)
        ranks_in = per_head(s["rank"], heads.num_heads, f"{sel.path}: rank")
        off = head_offsets(heads.v)
        vs, os_, widths, tail, total = [], [], [], 0.0, 0.0
        for hh in range(heads.num_heads):
            prod = wv[:, off[hh]:off[hh + 1]] @ wo[off[hh]:off[hh + 1]]
            u, sv, vt = np.linalg.svd(prod, full_matrices=False)
            r = int(min(ranks_in[hh], heads.v[hh], sv.size))
            root = np.sqrt(sv[:r])
            vs.append(u[:, :r] * root)
            os_.append(root[:, None] * vt[:r])
            widths.append(r)
            tail += float(np.sum(sv[r:] ** 2))
            total += float(np.sum(sv ** 2))
        dtype = leaf_dtype(v)
        b_out = None
        if bo is not None or bv is not None:
            b_out = np.zeros(wo.shape[1]) if bo is None else np.asarray(bo, np.float64)
            if bv is not None:
                b_out = b_out + np.asarray(bv, np.float64) @ wo
        # the value bias now lives in the output bias; a zero one keeps the tree's structure
        # (checkpoints with value biases expect one)
        nv = Dense(w=jnp.asarray(np.concatenate(vs, axis=1), dtype),
                   b=None if bv is None else jnp.zeros((sum(widths),), dtype))
        no = Dense(w=jnp.asarray(np.concatenate(os_, axis=0), dtype),
                   b=None if b_out is None else jnp.asarray(b_out, dtype))
        layout = HeadLayout(ids=heads.ids, v=tuple(widths), scale=heads.scale)
        new[parent] = {**block, "v": nv, "o": no, "heads": layout}
        err = math.sqrt(tail / total) if total > 0 else 0.0
        details = {"head_ranks": widths, "rank": widths}
        rows.append(Row.compare(sel.path, v, nv, rule=sel.rule, kind="truncatt-vo", error=err,
                                details=details))
        rows.append(Row.compare(f"{parent}/o", o, no, rule=sel.rule, kind="truncatt-vo",
                                error=err, details=details))
    return replace_paths(params, new), rows


register_method("truncatt_vo", truncatt_vo, selects="weights", settings=("rank",),
                overrides=("rank",), validate=validator("truncatt_vo"),
                candidates=Candidates(groups=(("truncatt_vo", VALUES),), settings=per_head_rank,
                                      label="rank={rank}/head"))

__all__ = ["truncatt_vo"]
