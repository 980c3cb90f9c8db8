"""Rank sweeps compiled once: per-head rank curves and the model-level ratio -> error curve.

Truncating a weight at every rank (or eps) of interest and re-running the model is the naive
way to draw the curves of "Understanding Transformers for Time Series: Rank Structure,
Flow-of-Ranks, and Compressibility"; each rank is a new parameter tree with new static shapes,
so each costs a trace and an XLA compilation. Here the singular values are *masked* instead:
every candidate keeps the full SVD factors (static shapes) and a 0/1 mask over its singular
values selects the rank, so one compiled program evaluates all of them under ``jax.vmap``.

* :func:`head_rank_sweep` -- one attention block: the relative output error when head ``h``'s
  q/k/v columns are truncated to rank ``r`` (head-dependent sketching, eq. 20 and App. E), for
  every ``(h, r)`` pair, as a ``[heads, ranks]`` array.
* :func:`eps_sweep` -- a whole model: the compression ratio of the selected weights and the
  output error (or a loss) for every ``eps`` of a list, exactly as the ``svd`` method at that
  eps would give (sec. 5, Table 2).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.evaluate import sample_inputs
from lowrank_jax.compress.rules import ATTENTION_QKVO, select
from lowrank_jax.compress.svd import check_eps, is_int, split_columns, svd64, truncatable
from lowrank_jax.compress.svd_method import OVERRIDES, decide_ranks, prepare_truncation
from lowrank_jax.errors import ConfigError, LeafTypeError, ShapeError
from lowrank_jax.execution import at_reference_precision
from lowrank_jax.leaves import (
    Dense,
    HeadLayout,
    LowRank,
    QueryKey,
    bias_of,
    get_path,
    head_offsets,
    map_with_path,
    materialize,
    materialize_host,
)
from lowrank_jax.models import apply as model_apply
from lowrank_jax.models import family_of, primary_output
from lowrank_jax.nn import AttentionConfig, apply_attention, attention_params, head_widths

Array = jax.Array

_PROJ = ("q", "k", "v")
_PATHS = {"q": "qk/q", "k": "qk/k", "v": "v"}


# ---------------------------------------------------------------------------------------------
# Per-head rank sweep of one attention block.

def _per_head(arr: Array | None, name: str, ids: tuple[int, ...]):
    """``(per_head [h, b, 1, q, k] or None, shared [b, 1, q, k] or None)`` of a 4-D mask/bias.

    A head axis of size > 1 indexes the model's *original* heads (as in
    :func:`~lowrank_jax.nn.apply_attention`): the block's heads ``ids`` are taken from it.
    """
    if arr is None:
        return None, None
    arr = jnp.asarray(arr)
    if arr.ndim != 4:
        raise ShapeError(
            f"head_rank_sweep: {name} must be 4-D [batch, heads, q_len, k_len] (broadcastable), "
            f"got shape {tuple(arr.shape)}", where=name, expected="4-D", actual=tuple(arr.shape))
    if arr.shape[1] == 1:
        return None, arr
    if max(ids, default=-1) >= arr.shape[1]:
        raise ShapeError(
            f"head_rank_sweep: {name} has {arr.shape[1]} heads on axis 1, but the block keeps "
            f"original heads {ids}; pass one column per original head (or one shared)",
            where=name, expected=f"> {max(ids)}", actual=arr.shape[1])
    arr = arr[:, np.asarray(ids, np.int64)]
    return jnp.moveaxis(arr, 1, 0)[:, :, None], None


_full_norm = jax.jit(
    lambda attn_params, x, kv, mask, bias, *, cfg, layer: jnp.sqrt(jnp.sum(jnp.square(
        apply_attention(attn_params, x, cfg, kv=kv, mask=mask, bias=bias,
                        layer_index=layer).astype(jnp.float32)))),
    static_argnames=("cfg", "layer"),
)


def _head_sweep_impl(heads: dict, keeps: dict, x, kv, shared_mask, shared_bias, *,
                     cfg: AttentionConfig, scale: float, which: tuple[str, ...],
                     layer: int) -> Array:
    """Output error norms ``[heads, ranks]`` (before dividing by ``||y||``).

    ``heads`` holds per-head arrays (zero-padded to the widest head) stacked on axis 0 (mapped
    with ``lax.map``); ``keeps`` the ``[ranks, k]`` 0/1 masks over singular values (vmapped).
    ``scale`` is the block's logit scale (static: a one-head layout is built from it).
    """
    width = heads["q"]["w"].shape[-1]
    layout = HeadLayout(ids=(0,), v=(heads["v"]["w"].shape[-1],), scale=scale)

    def one_head(hp):
        mask = hp.get("mask", shared_mask)
        bias = hp.get("bias", shared_bias)

        def run(proj: dict) -> Array:
            params = {"qk": QueryKey(q=proj["q"], k=proj["k"], widths=(width,)),
                      "v": proj["v"], "o": Dense(hp["o"]), "heads": layout}
            return apply_attention(params, x, cfg, kv=kv, mask=mask, bias=bias,
                                   layer_index=layer)  # [b, q, m]

        dense = {n: Dense(hp[n]["w"], hp[n]["b"]) for n in _PROJ}
        ref = run(dense)

        def truncated(keep: dict) -> Array:
            proj = dict(dense)
            for n in which:
                f = hp[n]
                # Only ``v`` depends on the rank: ``x @ u`` is computed once for all ranks.
                proj[n] = LowRank(u=f["u"], v=(f["s"] * keep[n])[:, None] * f["vt"], b=f["b"])
            d = (run(proj) - ref).astype(jnp.float32)
            return jnp.sqrt(jnp.sum(jnp.square(d)))

        return jax.vmap(truncated)(keeps)  # [ranks]

    return jax.lax.map(one_head, heads)  # [heads, ranks]


_head_sweep_jit = jax.jit(_head_sweep_impl, static_argnames=("cfg", "scale", "which", "layer"))


def _padded_blocks(mat: np.ndarray, widths: tuple[int, ...], pad: int) -> list[np.ndarray]:
    """Column blocks of the heads, each zero-padded on the right to ``pad`` columns."""
    return [np.pad(b, ((0, 0), (0, pad - b.shape[1]))) for b in split_columns(mat, widths)]


@at_reference_precision
def head_rank_sweep(attn_params: dict, x: Array, cfg: AttentionConfig | None,
                    ranks: Sequence[int], *, which: Sequence[str] = _PROJ,
                    kv: Array | None = None, mask: Array | None = None,
                    bias: Array | None = None, layer_index: int = 0) -> Array:
    """Output error of one attention block for every (head, rank) truncation, in one compile.

    For head ``h`` and rank ``r``, the projections named in ``which`` keep head ``h``'s columns
    only up to their best rank-``r`` approximation (the per-head truncation of
    :func:`~lowrank_jax.compress.head_truncated_svd`, "Understanding Transformers for Time
    Series" eq. 20 and App. E); every other head and the output projection stay intact. The
    entry is ``||y_{h,r} - y||_F / ||y||_F`` with ``y = apply_attention(attn_params, x, cfg,
    ...)``.

    Head widths come from the parameters (the query-key object's widths for q/k, the head
    layout's value widths for v and o), so a pruned block with heads of different widths works:
    every head is zero-padded to the widest (as the block itself computes it), and a head
    narrower than ``r`` keeps its columns exactly.

    How: per-head SVDs ``W_h = U_h diag(s_h) V_h^T`` run once on the host in float64; the
    rank-``r`` weight is ``U_h diag(s_h * mask_r) V_h^T`` with ``mask_r = arange(k) < r``, so all
    ranks share static shapes and are evaluated under ``jax.vmap`` (heads under ``lax.map``,
    which bounds memory to one head's ranks at a time). Since only head ``h`` changes,
    ``y_{h,r} - y = (A_{h,r} - A_h) W_o^{(h)}`` with ``A_h`` head ``h``'s attention output and
    ``W_o^{(h)}`` its rows of the output projection, and the Frobenius norm of that difference is
    computed as ``||(A_{h,r} - A_h) U_o S_o||_F`` (``W_o^{(h)} = U_o S_o V_o^T``, ``V_o``
    orthonormal): a single-head attention per pair instead of the full block.

    Args:
      attn_params: an attention block ``{'qk', 'v', 'o', 'heads'}`` whose query-key object is a
        :class:`~lowrank_jax.QueryKey` (any weight leaf types: they are materialized once for
        the SVDs).
      x: queries' input ``[batch, q_len, d_q_in]``.
      cfg: the block's attention config (its meaning: fixed activation masks); ``None`` for
        the default.
      ranks: ranks to evaluate, ints in ``[0, k]`` with ``k = min(d_in, widest head)`` of the
        truncated projections (0 removes the head's projection).
      which: projections truncated together, a subset of ``('q', 'k', 'v')``.
      kv, mask, bias, layer_index: as in :func:`~lowrank_jax.nn.apply_attention`.

    Returns:
      ``float32[num_heads, len(ranks)]`` (no rows for a block whose heads were all pruned).

    Raises:
      ConfigError: bad ``which`` or ``ranks``. ShapeError: a block without the four entries, a
        bad mask or bias. LeafTypeError: a query-key object that is not a ``QueryKey``.
    """
    which = tuple(which)
    if not which or any(n not in _PROJ for n in which) or len(set(which)) != len(which):
        raise ConfigError(
            f"head_rank_sweep: which must be a non-empty subset of ('q', 'k', 'v') without "
            f"repeats, got {which!r}", where="which", expected=_PROJ, actual=which)
    missing = [n for n in ("qk", "v", "o", "heads") if not isinstance(attn_params, dict)
               or n not in attn_params]
    if missing:
        got = sorted(attn_params) if isinstance(attn_params, dict) else type(attn_params).__name__
        raise ShapeError(
            f"head_rank_sweep: attn_params must be an attention block with keys qk, v, o, heads; "
            f"missing {missing} (got {got})", where="attn_params", expected=["qk", "v", "o",
                                                                            "heads"], actual=got)
    cfg = AttentionConfig() if cfg is None else cfg
    _, _, _, layout = attention_params(attn_params, "head_rank_sweep")
    block = {"attn": attn_params}
    w_qk = head_widths(block, "attn/qk/q")
    if w_qk is None:
        raise LeafTypeError(
            f"head_rank_sweep: needs per-head query and key projections (a QueryKey); this "
            f"block's query-key object is a {type(attn_params['qk']).__name__}", where="qk",
            expected="QueryKey", actual=type(attn_params["qk"]).__name__)
    widths = {"q": tuple(w_qk), "k": tuple(w_qk), "v": tuple(layout.v)}
    pads = {n: max(w, default=0) for n, w in widths.items()}
    x = jnp.asarray(x)
    h_num = layout.num_heads
    if not h_num:  # every head pruned: nothing to truncate, no rows
        ranks = list(ranks)
        if not ranks or any(not is_int(r) or r < 0 for r in ranks):
            raise ConfigError(f"head_rank_sweep: ranks must be a non-empty list of ints >= 0, "
                              f"got {ranks!r}", where="ranks", expected="ints >= 0", actual=ranks)
        return jnp.zeros((0, len(ranks)), jnp.float32)

    heads: dict[str, Any] = {}
    ks = {}
    for n in _PROJ:
        leaf = get_path(attn_params, _PATHS[n])
        w = materialize_host(leaf)
        blocks = _padded_blocks(w, widths[n], pads[n])
        b = bias_of(leaf)
        b_blocks = None if b is None else _padded_blocks(np.asarray(b, np.float64)[None],
                                                         widths[n], pads[n])
        entry = {"w": jnp.asarray(np.stack(blocks), np.float32),
                 "b": None if b is None else jnp.asarray(np.concatenate(b_blocks), np.float32)}
        if n in which:
            svds = [svd64(blk) for blk in blocks]
            entry["u"] = jnp.asarray(np.stack([u for u, _, _ in svds]), np.float32)   # [h, d_in, k]
            entry["s"] = jnp.asarray(np.stack([s for _, s, _ in svds]), np.float32)   # [h, k]
            entry["vt"] = jnp.asarray(np.stack([v for _, _, v in svds]), np.float32)  # [h, k, w]
            ks[n] = int(min(w.shape[0], pads[n]))
        heads[n] = entry
    wo = materialize_host(attn_params["o"])
    off = head_offsets(widths["v"])
    cs = []
    for i in range(h_num):
        rows = np.pad(wo[off[i]:off[i + 1]], ((0, pads["v"] - widths["v"][i]), (0, 0)))
        u, s, _ = np.linalg.svd(rows, full_matrices=False)
        cs.append(u * s[None, :])  # [w_v, m]: same Frobenius norms as W_o^(h) on the left
    heads["o"] = jnp.asarray(np.stack(cs), np.float32)

    k_max = min(ks.values())
    ranks = list(ranks)
    if not ranks or any(not is_int(r) or not 0 <= r <= k_max for r in ranks):
        raise ConfigError(
            f"head_rank_sweep: ranks must be a non-empty list of ints in [0, {k_max}] "
            f"(min(d_in, widest head) of the truncated projections), got {ranks!r}",
            where="ranks", expected=f"[0, {k_max}]", actual=ranks)
    r_arr = np.asarray(ranks)[:, None]
    keeps = {n: jnp.asarray(np.arange(k)[None, :] < r_arr, np.float32) for n, k in ks.items()}

    if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
        raise ShapeError(
            f"head_rank_sweep: mask must be boolean (True = attend), got dtype "
            f"{jnp.asarray(mask).dtype}; pass additive masks as bias=", where="mask",
            expected="bool", actual=str(jnp.asarray(mask).dtype))
    pm, shared_mask = _per_head(mask, "mask", layout.ids)
    pb, shared_bias = _per_head(bias, "bias", layout.ids)
    if pm is not None:
        heads["mask"] = pm
    if pb is not None:
        heads["bias"] = pb

    errs = _head_sweep_jit(heads, keeps, x, kv, shared_mask, shared_bias, cfg=cfg,
                           scale=float(layout.scale), which=which, layer=int(layer_index))
    norm = _full_norm(attn_params, x, kv, mask, bias, cfg=cfg, layer=int(layer_index))
    return errs / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)


def attention_blocks(params: Any) -> list[tuple[str, dict]]:
    """``(path, block)`` of every attention block (a dict with ``'qk'``, ``'v'``, ``'o'`` and a
    :class:`~lowrank_jax.HeadLayout` ``'heads'``) of a tree, in tree order: the blocks
    :func:`head_rank_sweep` takes."""
    out = []

    def walk(node, prefix):
        if isinstance(node, dict):
            if {"qk", "v", "o"} <= set(node) and isinstance(node.get("heads"), HeadLayout):
                out.append((prefix, node))
                return
            for k in sorted(node, key=str):
                walk(node[k], f"{prefix}/{k}" if prefix else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{prefix}/{i}" if prefix else str(i))

    walk(params, "")
    return out


# ---------------------------------------------------------------------------------------------
# Model-level eps sweep.

def _tail_scales(t, ranks, kept: bool) -> np.ndarray:
    """``s * (1 - mask)`` per group, ``[groups, k]``: zero where kept."""
    out = []
    for (_, s, _), r in zip(t.groups, ranks, strict=True):
        keep = np.ones_like(s) if kept else (np.arange(s.size) < r)
        out.append(s * (1.0 - keep))
    return np.stack(out)


@at_reference_precision
def eps_sweep(config: Any, params: Any, inputs: dict | None, eps_values: Sequence[float], *,
              rules=ATTENTION_QKVO, loss_fn: Callable[[dict], Array] | None = None,
              per_head: bool = False, batch_size: int | None = None) -> list[dict]:
    """Compression ratio -> output error (or loss) of a model, for every eps, in one compile.

    "Understanding Transformers for Time Series", sec. 5, Table 2: truncate the selected
    weights at ``eps`` (each keeps its eps-rank, eq. 1) and compare the compressed model with
    the original. Each row equals what ``compress(params, eps=e, rules=rules,
    per_head=per_head)`` followed by ``models.apply`` gives (same ranks, same kept-dense
    decisions, same report ratio), but all eps values run in one compiled program: every
    selected weight is written as ``Dense(W - U diag(t) V^T, b)``, the weight minus a masked
    tail of its full SVD (static shapes; ``t = s * (1 - mask)``), and the tails are vmapped over
    the eps axis (``lax.map`` in chunks of ``batch_size`` if given). A weight the ``svd``
    method would keep has a zero tail, so it is exactly the original weight (``W - 0 = W``);
    the uncompressed model is the all-kept row of the same program, so it is computed by
    exactly the same code. Memory grows with the number of eps values times the selected
    weights' sizes; ``batch_size`` bounds it.

    Args:
      config: a registered model config, or ``None`` for a bare parameter tree (then only the
        sizes and weight-space errors are computed; nothing is run).
      params: the model's parameter tree (not modified).
      inputs: model inputs, a dict of arrays (default for a model:
        :func:`~lowrank_jax.compress.sample_inputs`).
      eps_values: tolerances in (0, 1).
      rules: path rules selecting the weights (default: the attention projections); per-rule
        eps/rank/per_head overrides are honoured as the ``svd`` method honours them.
      loss_fn: optional ``loss_fn(outputs) -> scalar``, evaluated for the original and each
        compressed model.
      per_head: per-head truncation (eq. 20), as in the ``svd`` method.
      batch_size: eps values evaluated at once (default: all, one ``vmap``).

    Returns:
      One dict per eps, in the given order: ``eps``, ``size_ratio`` (``params_after /
      params_before`` of the selected weights, equal to the report's ``ratio``),
      ``params_before``, ``params_after``, ``max_weight_error`` (largest
      ``||W - W_r||_2 / ||W||_2`` over the selected weights); with a model also ``output``
      (the primary output's name), ``rel_error`` (``||y_eps - y||_F / ||y||_F``) and
      ``max_abs_error``; with ``loss_fn`` also ``loss`` and ``base_loss``.
    """
    eps_values = [check_eps("eps_sweep", "(all selected weights)", e) for e in eps_values]
    if not eps_values:
        raise ConfigError("eps_sweep: eps_values is empty; give at least one eps in (0, 1)",
                          where="eps_values", expected="a non-empty list", actual=[])
    if not isinstance(per_head, bool):
        raise ConfigError(f"eps_sweep: per_head must be a bool, got {per_head!r}",
                          where="per_head", expected="bool", actual=per_head)
    selection = select(params, rules, kind="weights", accepts=truncatable, allowed=OVERRIDES,
                       where="eps_sweep")
    truncs = [prepare_truncation(params, sel, per_head=per_head) for sel in selection]
    before = sum(t.before for t in truncs)

    rows, tails = [], {t.path: [] for t in truncs}
    for e in eps_values:
        after, werr = 0, 0.0
        for t in truncs:
            ranks = decide_ranks(t, "eps", {"eps": e})
            kept = t.keeps(ranks, True)  # the svd method's keep_dense_if_larger=True
            after += t.after(ranks, True)
            werr = max(werr, t.error(ranks, kept))
            tails[t.path].append(_tail_scales(t, ranks, kept))
        rows.append({"eps": e, "size_ratio": after / before if before else 1.0,
                     "params_before": before, "params_after": after,
                     "max_weight_error": werr})
    if config is None:
        return rows

    inputs = sample_inputs(config) if inputs is None else inputs
    factors, scales = {}, {}
    for t in truncs:
        dtype = t.dtype
        if t.kind == "svd":
            (u, _, vt), = t.groups
            factors[t.path] = (jnp.asarray(u, dtype), jnp.asarray(vt, dtype))
            tt = np.stack([x[0] for x in tails[t.path]])  # [eps, k]
        else:  # svd-per-head
            factors[t.path] = (jnp.asarray(np.stack([g[0] for g in t.groups], 1), dtype),
                               jnp.asarray(np.stack([g[2] for g in t.groups]), dtype))
            tt = np.stack(tails[t.path])  # [eps, h, k]
        # Row 0 keeps everything: the uncompressed model, computed by the same program.
        scales[t.path] = jnp.asarray(np.concatenate([np.zeros_like(tt[:1]), tt]), dtype)

    out = _eps_sweep_run(config, params, factors, scales, inputs, loss_fn, batch_size)
    for i, row in enumerate(rows):
        row["output"] = out["output"]
        row["rel_error"] = float(out["rel_error"][i])
        row["max_abs_error"] = float(out["max_abs_error"][i])
        if loss_fn is not None:
            row["loss"] = float(out["loss"][i + 1])
            row["base_loss"] = float(out["loss"][0])
    return rows


def _eps_sweep_run(config, params, factors, scales, inputs, loss_fn, batch_size) -> dict:
    family = family_of(config)
    key_box: list[str] = []

    def one(params, factors, row_scales, inputs):
        def sub(path, node):
            if path not in factors:
                return node
            u, vt = factors[path]
            t = row_scales[path]
            if u.ndim == 2:  # [d_in, k], [k, d_out]
                tail = (u * t[None, :]) @ vt
            else:  # [d_in, h, k], [h, k, d_h]
                tail = jnp.einsum("ihk,hkd->ihd", u * t[None], vt).reshape(u.shape[0], -1)
            return Dense(w=materialize(node) - tail.astype(u.dtype), b=bias_of(node))

        tree = map_with_path(sub, params)
        outputs = model_apply(tree, inputs, config)
        key = primary_output(family, outputs)
        if not key_box:
            key_box.append(key)
        res = {"y": outputs[key]}
        if loss_fn is not None:
            res["loss"] = jnp.asarray(loss_fn(outputs), jnp.float32)
        return res

    @jax.jit
    def run(params, factors, scales, inputs):
        fn = lambda s: one(params, factors, s, inputs)  # noqa: E731
        if batch_size is None:
            res = jax.vmap(fn)(scales)
        else:
            res = jax.lax.map(fn, scales, batch_size=batch_size)
        y = res["y"].astype(jnp.float32)
        d = y[1:] - y[:1]
        axes = tuple(range(1, y.ndim))
        ref_norm = jnp.sqrt(jnp.sum(jnp.square(y[0])))
        out = {"rel_error": jnp.sqrt(jnp.sum(jnp.square(d), axis=axes))
               / jnp.maximum(ref_norm, jnp.finfo(jnp.float32).tiny),
               "max_abs_error": jnp.max(jnp.abs(d), axis=axes)}
        if loss_fn is not None:
            out["loss"] = res["loss"]
        return out

    out = jax.device_get(run(params, factors, scales, inputs))
    out["output"] = key_box[0]
    return out


__all__ = ["attention_blocks", "eps_sweep", "head_rank_sweep"]
