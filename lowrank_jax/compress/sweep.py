"""Rank sweeps compiled once: per-head rank curves and the model-level ratio -> loss curve.

Truncating a weight at every rank (or eps) of interest and re-running the model is the naive
way to draw seed 000's curves; each rank is a new parameter tree with new static shapes, so each
costs a trace and an XLA compilation. Here the singular values are *masked* instead: every
candidate keeps the full SVD factors (static shapes) and a 0/1 mask over its singular values
selects the rank, so one compiled program evaluates all of them under ``jax.vmap``.

* :func:`head_rank_sweep` -- one attention layer: the relative output error when head ``h``'s
  q/k/v columns are truncated to rank ``r`` (head-dependent sketching, seed 000 eq. 20 and
  App. E), for every ``(h, r)`` pair, as a ``[heads, ranks]`` array.
* :func:`eps_sweep` -- a whole model: the compression ratio of the selected weights and the
  output error (or a loss) for every ``eps`` of a list, exactly as :func:`compress` at that eps
  would give (seed 000 sec. 5, Table 2).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.compress import _check_global, _decide, _make_plan
from lowrank_jax.compress.evaluate import _primary
from lowrank_jax.compress.rules import ATTENTION_QKVO, select
from lowrank_jax.compress.svd import _check_eps, _is_int
from lowrank_jax.leaves import (
    Dense,
    HeadLowRank,
    Leaf,
    LowRank,
    leaf_dataclass,
    linear,
    map_with_path,
    materialize,
)
from lowrank_jax.models import apply as model_apply
from lowrank_jax.nn.attention import AttentionConfig, apply_attention

Array = jax.Array

_PROJ = ("q", "k", "v")


# ---------------------------------------------------------------------------------------------
# Per-head rank sweep of one attention layer.

def _bias(name: str, leaf) -> Array | None:
    if isinstance(leaf, (Dense, LowRank, HeadLowRank)):
        return leaf.b
    if isinstance(leaf, Leaf):
        raise TypeError(
            f"head_rank_sweep: projection '{name}' is a {type(leaf).__name__} leaf; expected "
            "Dense, LowRank, HeadLowRank or a 2-D array"
        )
    return None


def _per_head_mask(arr: Array | None, name: str, num_heads: int):
    """``(per_head [h, b, 1, q, k] or None, shared [b, 1, q, k] or None)`` of a 4-D mask/bias."""
    if arr is None:
        return None, None
    arr = jnp.asarray(arr)
    if arr.ndim != 4:
        raise ValueError(
            f"head_rank_sweep: {name} must be 4-D [batch, heads, q_len, k_len] (broadcastable), "
            f"got shape {tuple(arr.shape)}"
        )
    if arr.shape[1] == 1:
        return None, arr
    if arr.shape[1] != num_heads:
        raise ValueError(
            f"head_rank_sweep: {name} has {arr.shape[1]} heads on axis 1, expected 1 or "
            f"num_heads={num_heads}"
        )
    return jnp.moveaxis(arr, 1, 0)[:, :, None], None


_full_norm = jax.jit(
    lambda attn_params, x, kv, mask, bias, *, cfg, layer: jnp.sqrt(jnp.sum(jnp.square(
        apply_attention(attn_params, x, cfg, kv=kv, mask=mask, bias=bias,
                        layer_index=layer).astype(jnp.float32)))),
    static_argnames=("cfg", "layer"),
)


def _head_sweep_impl(heads: dict, keeps: dict, x, kv, shared_mask, shared_bias, *,
                     cfg1: AttentionConfig, which: tuple[str, ...], layer: int) -> Array:
    """Output error norms ``[heads, ranks]`` (before dividing by ``||y||``).

    ``heads`` holds per-head arrays stacked on axis 0 (mapped with ``lax.map``); ``keeps`` the
    ``[ranks, k]`` 0/1 masks over singular values (vmapped).
    """

    def one_head(hp):
        mask = hp.get("mask", shared_mask)
        bias = hp.get("bias", shared_bias)

        def run(proj: dict) -> Array:
            params = dict(proj, o=Dense(hp["o"]))
            return apply_attention(params, x, cfg1, kv=kv, mask=mask, bias=bias,
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


_head_sweep_jit = jax.jit(_head_sweep_impl, static_argnames=("cfg1", "which", "layer"))


def head_rank_sweep(attn_params: dict, x: Array, cfg: AttentionConfig, ranks: Sequence[int], *,
                    which: Sequence[str] = _PROJ, kv: Array | None = None,
                    mask: Array | None = None, bias: Array | None = None,
                    layer_index: int = 0) -> Array:
    """Output error of one attention layer for every (head, rank) truncation, in one compile.

    For head ``h`` and rank ``r``, the projections named in ``which`` keep head ``h``'s columns
    ``W[:, h*d_head:(h+1)*d_head]`` only up to their best rank-``r`` approximation (the per-head
    truncation of :func:`~lowrank_jax.compress.head_truncated_svd`, seed 000 eq. 20 and App. E);
    every other head and the output projection stay intact. The entry is
    ``||y_{h,r} - y||_F / ||y||_F`` with ``y = apply_attention(attn_params, x, cfg, ...)``.

    How: per-head SVDs ``W_h = U_h diag(s_h) V_h^T`` run once on the host in float64; the
    rank-``r`` weight is ``U_h diag(s_h * mask_r) V_h^T`` with ``mask_r = arange(k) < r``, so all
    ranks share static shapes and are evaluated under ``jax.vmap`` (heads under ``lax.map``,
    which bounds memory to one head's ranks at a time). Since only head ``h`` changes,
    ``y_{h,r} - y = (A_{h,r} - A_h) W_o^{(h)}`` with ``A_h`` head ``h``'s attention output and
    ``W_o^{(h)}`` its rows of the output projection, and the Frobenius norm of that difference is
    computed as ``||(A_{h,r} - A_h) U_o S_o||_F`` (``W_o^{(h)} = U_o S_o V_o^T``, ``V_o``
    orthonormal): a single-head attention per pair instead of the full layer.

    Args:
      attn_params: ``{'q', 'k', 'v', 'o'}`` leaves (Dense / LowRank / HeadLowRank or 2-D
        arrays; they are materialized once for the SVDs).
      x: queries' input ``[batch, q_len, d_model]``.
      cfg: the layer's attention configuration.
      ranks: ranks to evaluate, ints in ``[0, k]`` with ``k = min(d_in, d_head)`` of the
        truncated projections (0 removes the head's projection).
      which: projections truncated together, a subset of ``('q', 'k', 'v')``.
      kv, mask, bias, layer_index: as in :func:`~lowrank_jax.nn.apply_attention`.

    Returns:
      ``float32[num_heads, len(ranks)]``.
    """
    which = tuple(which)
    if not which or any(n not in _PROJ for n in which) or len(set(which)) != len(which):
        raise ValueError(
            f"head_rank_sweep: which must be a non-empty subset of ('q', 'k', 'v') without "
            f"repeats, got {which!r}"
        )
    missing = [n for n in (*_PROJ, "o") if n not in attn_params]
    if missing:
        raise ValueError(
            f"head_rank_sweep: attn_params must have keys q, k, v, o; missing {missing} "
            f"(got {sorted(attn_params)})"
        )
    x = jnp.asarray(x)
    h_num, dh = cfg.num_heads, cfg.head_dim
    cfg1 = dataclasses.replace(cfg, num_heads=1, d_head=dh)

    heads: dict[str, Any] = {}
    ks = {}
    for n in _PROJ:
        w = np.asarray(materialize(attn_params[n]), np.float64)
        d_in_expected = cfg.d_model if n == "q" else cfg.kv_dim
        if w.shape != (d_in_expected, cfg.inner_dim):
            raise ValueError(
                f"head_rank_sweep: projection '{n}' has shape {w.shape}, expected "
                f"({d_in_expected}, num_heads * d_head = {cfg.inner_dim})"
            )
        dtype = np.float32
        b = _bias(n, attn_params[n])
        blocks = [w[:, i * dh:(i + 1) * dh] for i in range(h_num)]
        entry = {"w": jnp.asarray(np.stack(blocks), dtype),
                 "b": None if b is None else jnp.asarray(b).reshape(h_num, dh)}
        if n in which:
            svds = [np.linalg.svd(blk, full_matrices=False) for blk in blocks]
            entry["u"] = jnp.asarray(np.stack([u for u, _, _ in svds]), dtype)   # [h, d_in, k]
            entry["s"] = jnp.asarray(np.stack([s for _, s, _ in svds]), dtype)   # [h, k]
            entry["vt"] = jnp.asarray(np.stack([v for _, _, v in svds]), dtype)  # [h, k, d_h]
            ks[n] = int(min(w.shape[0], dh))
        heads[n] = entry
    wo = np.asarray(materialize(attn_params["o"]), np.float64)
    if wo.shape != (cfg.inner_dim, cfg.d_model):
        raise ValueError(
            f"head_rank_sweep: projection 'o' has shape {wo.shape}, expected "
            f"(num_heads * d_head = {cfg.inner_dim}, d_model = {cfg.d_model})"
        )
    cs = []
    for i in range(h_num):
        u, s, _ = np.linalg.svd(wo[i * dh:(i + 1) * dh], full_matrices=False)
        cs.append(u * s[None, :])  # [d_h, m]: same Frobenius norms as W_o^(h) on the left
    heads["o"] = jnp.asarray(np.stack(cs), np.float32)

    k_max = min(ks.values())
    ranks = list(ranks)
    if not ranks or any(not _is_int(r) or not 0 <= r <= k_max for r in ranks):
        raise ValueError(
            f"head_rank_sweep: ranks must be a non-empty list of ints in [0, {k_max}] "
            f"(min(d_in, d_head) of the truncated projections), got {ranks!r}"
        )
    r_arr = np.asarray(ranks)[:, None]
    keeps = {n: jnp.asarray(np.arange(k)[None, :] < r_arr, np.float32) for n, k in ks.items()}

    if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
        raise ValueError(
            f"head_rank_sweep: mask must be boolean (True = attend), got dtype "
            f"{jnp.asarray(mask).dtype}; pass additive masks as bias="
        )
    pm, shared_mask = _per_head_mask(mask, "mask", h_num)
    pb, shared_bias = _per_head_mask(bias, "bias", h_num)
    if pm is not None:
        heads["mask"] = pm
    if pb is not None:
        heads["bias"] = pb

    errs = _head_sweep_jit(heads, keeps, x, kv, shared_mask, shared_bias, cfg1=cfg1,
                           which=which, layer=int(layer_index))
    norm = _full_norm(attn_params, x, kv, mask, bias, cfg=cfg, layer=int(layer_index))
    return errs / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)


# ---------------------------------------------------------------------------------------------
# Model-level eps sweep.

class _TailRemoved(Leaf):
    """``W`` minus a masked tail of its SVD, for sweeps: ``x @ W - linear(tail, x)``.

    ``tail`` is a LowRank (or HeadLowRank, per head) ``U diag(s * (1 - mask)) V^T`` over the
    full SVD factors. Writing the truncation as "the weight minus what is dropped" keeps a
    weight that :func:`compress` would keep dense *exactly* the original (its tail is zero), and
    ``x @ U`` does not depend on the mask, so under ``vmap`` over masks it is computed once.
    Private to sweeps: counts report the original weight's.
    """

    w: Any
    tail: Any

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    def apply(self, x: Array) -> Array:
        return linear(self.w, x) - linear(self.tail, x)

    def to_dense(self) -> Array:
        return materialize(self.w) - materialize(self.tail)

    def param_count(self) -> int:
        return self.w.param_count()

    def storage_bits(self) -> int:
        return self.w.storage_bits()

    def flops(self, n_tokens: int) -> int:
        return self.w.flops(n_tokens)


_TailRemoved = leaf_dataclass(_TailRemoved)


def _plans(params, rules, per_head, num_heads):
    _check_global(None, None, None, None, "eps", per_head, num_heads)
    return [_make_plan(sel, per_head, num_heads, {}) for sel in select(params, rules)]


def _tail_scales(p, ranks, kept: bool) -> np.ndarray:
    """``s * (1 - mask)`` per group, ``[groups, k]``: zero where kept."""
    out = []
    for (_, s, _), r in zip(p.groups, ranks, strict=True):
        keep = np.ones_like(s) if kept else (np.arange(s.size) < r)
        out.append(s * (1.0 - keep))
    return np.stack(out)


def _weight_error(p, ranks, kept: bool) -> float:
    """``||W - W_r||_2 / ||W||_2`` as :func:`compress` reports it."""
    if kept:
        return 0.0
    if p.kind == "svd":
        (_, s, _), r = p.groups[0], ranks[0]
        return float(s[r] / s[0]) if r < s.size and s[0] > 0 else 0.0
    resid = np.concatenate([(u[:, r:] * s[r:]) @ vt[r:]
                            for (u, s, vt), r in zip(p.groups, ranks, strict=True)], axis=1)
    w_norm = float(np.linalg.norm(p.mat, 2))
    return float(np.linalg.norm(resid, 2)) / w_norm if w_norm > 0 else 0.0


def eps_sweep(config: Any, params: Any, inputs: dict | None, eps_values: Sequence[float], *,
              rules=ATTENTION_QKVO, loss_fn: Callable[[dict], Array] | None = None,
              per_head: bool = False, num_heads: int | None = None,
              batch_size: int | None = None) -> list[dict]:
    """Compression ratio -> output error (or loss) of a model, for every eps, in one compile.

    Seed 000 sec. 5, Table 2: truncate the selected weights at ``eps`` (each keeps its eps-rank,
    eq. 1) and compare the compressed model with the original. Each row equals what
    ``compress(params, eps=e, rules=rules, per_head=..., num_heads=...)`` followed by
    ``models.apply`` gives (same ranks, same kept-dense decisions, same report ratio), but all
    eps values run in one compiled program: every selected weight is written as the original
    minus a masked tail of its full SVD (static shapes), and the masks are vmapped over the eps
    axis (``lax.map`` in chunks of ``batch_size`` if given). The uncompressed model is the
    all-kept row of the same program, so it is computed by exactly the same code.

    Args:
      config: a registered model config, or ``None`` for a bare parameter tree (then only the
        sizes and weight-space errors are computed; nothing is run).
      params: the model's parameter tree (not modified).
      inputs: model inputs, a dict of arrays (default for a model:
        :func:`~lowrank_jax.compress.sample_inputs`).
      eps_values: tolerances in (0, 1).
      rules: path rules selecting the weights (default: attention q/k/v/o); per-rule eps/rank/
        per_head overrides are honoured as :func:`compress` honours them.
      loss_fn: optional ``loss_fn(outputs) -> scalar``, evaluated for the original and each
        compressed model.
      per_head, num_heads: per-head truncation (seed 000 eq. 20), as in :func:`compress`.
      batch_size: eps values evaluated at once (default: all, one ``vmap``).

    Returns:
      One dict per eps, in the given order: ``eps``, ``size_ratio`` (``params_after /
      params_before`` of the selected weights, equal to ``compress``'s ``report.ratio``),
      ``params_before``, ``params_after``, ``max_weight_error`` (largest
      ``||W - W_r||_2 / ||W||_2`` over the selected weights); with a model also ``output``
      (the primary output's name), ``rel_error`` (``||y_eps - y||_F / ||y||_F``) and
      ``max_abs_error``; with ``loss_fn`` also ``loss`` and ``base_loss``.
    """
    eps_values = [_check_eps("eps_sweep", "(all selected weights)", e) for e in eps_values]
    if not eps_values:
        raise ValueError("eps_sweep: eps_values is empty; give at least one eps in (0, 1)")
    plans = _plans(params, rules, per_head, num_heads)
    before = sum(p.before for p in plans)

    rows, tails = [], {p.path: [] for p in plans}
    for e in eps_values:
        after, werr = 0, 0.0
        for p in plans:
            ranks = _decide(p, "eps", e, None, None)
            kept = p.factored(ranks) >= p.before  # compress's keep_dense_if_larger=True
            after += p.after(ranks, True)
            werr = max(werr, _weight_error(p, ranks, kept))
            tails[p.path].append(_tail_scales(p, ranks, kept))
        rows.append({"eps": e, "size_ratio": after / before if before else 1.0,
                     "params_before": before, "params_after": after,
                     "max_weight_error": werr})
    if config is None:
        return rows

    inputs = _default_inputs(config) if inputs is None else inputs
    factors, scales = {}, {}
    for p in plans:
        dtype = p.dtype
        if p.kind == "svd":
            (u, _, vt), = p.groups
            factors[p.path] = (jnp.asarray(u, dtype), jnp.asarray(vt, dtype))
            t = np.stack([t[0] for t in tails[p.path]])  # [eps, k]
        else:  # svd-per-head
            factors[p.path] = (jnp.asarray(np.stack([g[0] for g in p.groups], 1), dtype),
                               jnp.asarray(np.stack([g[2] for g in p.groups]), dtype))
            t = np.stack(tails[p.path])  # [eps, h, k]
        # Row 0 keeps everything: the uncompressed model, computed by the same program.
        scales[p.path] = jnp.asarray(np.concatenate([np.zeros_like(t[:1]), t]), dtype)

    out = _eps_sweep_run(config, params, factors, scales, inputs, loss_fn, batch_size)
    for i, row in enumerate(rows):
        row["output"] = out["output"]
        row["rel_error"] = float(out["rel_error"][i])
        row["max_abs_error"] = float(out["max_abs_error"][i])
        if loss_fn is not None:
            row["loss"] = float(out["loss"][i + 1])
            row["base_loss"] = float(out["loss"][0])
    return rows


def _default_inputs(config):
    from lowrank_jax.compress.evaluate import sample_inputs

    return sample_inputs(config)


def _eps_sweep_run(config, params, factors, scales, inputs, loss_fn, batch_size) -> dict:
    key_box: list[str] = []

    def one(params, factors, row_scales, inputs):
        def sub(path, node):
            if path not in factors:
                return node
            u, vt = factors[path]
            t = row_scales[path]
            if u.ndim == 2:
                tail = LowRank(u=u, v=t[:, None] * vt)
            else:  # [d_in, h, k], [h, k, d_h]
                tail = HeadLowRank(u=u, v=t[..., None] * vt)
            return _TailRemoved(w=node, tail=tail)

        tree = map_with_path(sub, params)
        outputs = model_apply(config, tree, **inputs)
        key = _primary(outputs)
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
