"""The query-key plan methods of "Vision Transformer with Irregular Attention": ``truncatt``
(sec. 2.3), ``cp`` (CP-SlimAtt, eqs. 3-4) and ``btd`` (IrrAtt, eqs. 5-6, Algorithms 1-3), their
settings, and their frontier candidates (:mod:`lowrank_jax.compress.irregular` describes
them)."""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.candidates import require
from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.irregular.conversions import (
    bias_rows,
    core_of,
    factor_leaf,
    numerical_ranks,
    query_key_from_slices,
    slice_svds,
)
from lowrank_jax.compress.irregular.counts import attention_macs, executed_macs, is_int, per_head
from lowrank_jax.compress.registry import Candidates, register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.compress.rules import ATTENTION_QK
from lowrank_jax.decomp import btd_ll1, cp_als, cp_epc, cp_to_tensor
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import (
    HeadLayout,
    flops,
    get_path,
    head_offsets,
    is_query_key,
    leaf_dtype,
    replace_paths,
)
from lowrank_jax.leaves.qk_factorized import BTDQueryKey, CPQueryKey, augmented_joint
from lowrank_jax.nn import attention_params

# ---------------------------------------------------------------------------------------------
# Settings.

SETTINGS = ("rank", "flops_ratio", "n_tokens", "vo_rank", "drop_key_bias", "n_iter_max", "tol",
            "epc", "ranks", "n_iter_term", "cp_n_iter_max", "float64", "rank0_uniform")
OVERRIDES = ("rank", "flops_ratio", "vo_rank", "ranks")


def check_settings(method: str, s: Mapping, *, complete: bool = True) -> None:
    """Check the setting values of ``truncatt``, ``cp``, ``btd`` or ``truncatt_vo``; with
    ``complete`` also that exactly one way of choosing the rank is given (a step may leave it
    to per-rule overrides)."""
    given = [k for k in ("rank", "flops_ratio", "ranks") if s.get(k) is not None]
    if (complete and len(given) != 1) or len(given) > 1:
        raise PlanError(f"{method}: give exactly one of rank=, flops_ratio=" +
                        (", ranks=" if method == "btd" else "") + f"; got {given or 'none'}",
                        where="settings", expected="one of rank, flops_ratio", actual=given)
    fr = s.get("flops_ratio")
    if fr is not None:
        if isinstance(fr, bool) or not isinstance(fr, numbers.Real) or not 0 < fr <= 1:
            raise PlanError(f"{method}: flops_ratio must be in (0, 1], got {fr!r}",
                            where="flops_ratio", expected="(0, 1]", actual=fr)
        if not is_int(s.get("n_tokens")) or s["n_tokens"] < 1:
            raise PlanError(f"{method}: flops_ratio needs n_tokens (the sequence length N of the "
                            f"paper's MAC formulas, an int >= 1), got {s.get('n_tokens')!r}",
                            where="n_tokens", expected="int >= 1", actual=s.get("n_tokens"))
    if s.get("n_tokens") is not None and (not is_int(s["n_tokens"]) or s["n_tokens"] < 1):
        raise PlanError(f"{method}: n_tokens must be an int >= 1, got {s['n_tokens']!r}",
                        where="n_tokens", expected="int >= 1", actual=s["n_tokens"])
    rank = s.get("rank")
    if rank is not None and method in ("cp", "btd") and (not is_int(rank) or rank < 1):
        raise PlanError(f"{method}: rank (the total rank R) must be an int >= 1, got {rank!r}",
                        where="rank", expected="int >= 1", actual=rank)
    if rank is not None and method in ("truncatt", "truncatt_vo") and not (
            (is_int(rank) and rank >= 0) or (isinstance(rank, Sequence) and not isinstance(
                rank, str) and all(is_int(r) and r >= 0 for r in rank))):
        raise PlanError(f"{method}: rank must be an int >= 0 or a list of them (one per head), "
                        f"got {rank!r}", where="rank", expected="int or list of ints",
                        actual=rank)
    for name in ("drop_key_bias", "epc", "float64", "rank0_uniform"):
        if name in s and not isinstance(s[name], bool):
            raise PlanError(f"{method}: {name} must be a bool, got {s[name]!r}", where=name,
                            expected="bool", actual=s[name])
    for name in ("n_iter_max", "n_iter_term", "cp_n_iter_max"):
        if name in s and (not is_int(s[name]) or s[name] < 1):
            raise PlanError(f"{method}: {name} must be an int >= 1, got {s[name]!r}", where=name,
                            expected="int >= 1", actual=s[name])


def validator(method):
    """The ``validate`` of a method's record: its settings checked before any step runs."""
    def validate(settings):
        check_settings(method, settings, complete=False)
    return validate


# ---------------------------------------------------------------------------------------------
# Shared by the query-key methods.

def block_of(params, path: str, method: str):
    """``(parent path, attention block)`` of the node at ``path``; the block is ``None`` when
    the parent is not an attention block (``{'qk', 'v', 'o', 'heads'}``)."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    block = get_path(params, parent) if parent else params
    if not isinstance(block, dict) or not isinstance(block.get("heads"), HeadLayout):
        return parent, None
    return parent, block


def _target(method: str, sel, params, s, dims) -> tuple[Any, dict]:
    """The rank setting of a query-key step for one selection, and MAC bookkeeping."""
    qk = sel.node
    _, block = block_of(params, sel.path, method)
    n = s.get("n_tokens")
    info = {}
    vo_after = None
    if n is not None and block is not None:
        _, v, o, heads = attention_params(block, sel.path)
        before = executed_macs(block, n)
        if s.get("vo_rank") is not None:
            vr = per_head(s["vo_rank"], heads.num_heads, "vo_rank")
            vo_after = attention_macs("dense", None, n_tokens=n, d_model=qk.d_q_in,
                                      num_heads=heads.num_heads, d_head=1, vo_rank=vr,
                                      d_kv_in=v.shape[0], d_out=o.shape[1])["vo"]
        else:
            vo_after = int(flops({"v": v, "o": o}, n)) + n * n * heads.num_heads * max(
                heads.v, default=0)
        info = {"n_tokens": n, "macs_before": before, "vo_macs_after": vo_after}
    if s.get("flops_ratio") is None:
        return (s.get("ranks") if method == "btd" and s.get("ranks") is not None
                else s["rank"]), info
    if block is None:
        raise PlanError(f"{method}: {sel.path}: flops_ratio needs the query-key object inside an "
                        "attention block ({'qk', 'v', 'o', 'heads'})", where=sel.path,
                        expected="an attention block", actual=sel.path)
    h = qk.num_heads
    before = info["macs_before"]

    def ratio(r):
        q = attention_macs(method, r, n_tokens=n, d_model=qk.d_q_in, num_heads=h, d_head=1,
                           d_kv_in=qk.d_k_in)["qk"]
        return (q + vo_after) / before

    lo = 1 if method == "cp" else 0
    hi = dims if method == "truncatt" else dims * h
    if ratio(lo) > s["flops_ratio"]:
        raise PlanError(f"{method}: {sel.path}: flops_ratio={s['flops_ratio']} is below what rank "
                        f"{lo} costs ({ratio(lo):.4f} of the block with the value-output side "
                        "as set)", where=sel.path, expected=f">= {ratio(lo):.4f}",
                        actual=s["flops_ratio"])
    r = lo
    while r < hi and ratio(r + 1) <= s["flops_ratio"]:
        r += 1
    return r, info


def _augmented(qk, s) -> np.ndarray:
    y = augmented_joint(qk)
    if s.get("drop_key_bias", False):
        y = y.copy()
        y[:, -1] = 0.0
    return y


def _decomposed(method: str, selection, settings: Mapping, rows: list):
    """The selected query-key objects a method decomposes: ``(selection, its settings,
    augmented tensor, query-bias row used, key-bias column used, the tensor without the unused
    ones)``. A query-key object of a block without heads gets its ``'empty'`` row in ``rows``
    and is skipped."""
    for sel in selection:
        s = {**settings, **sel.overrides}
        check_settings(method, s)
        if is_empty(sel.node):  # the query-key object of a block without heads
            rows.append(empty_row(sel))
            continue
        y = _augmented(sel.node, s)
        qb, kb = bias_rows(y)
        yield sel, s, y, qb, kb, core_of(y, qb, kb)


def _finish_info(info: dict, method: str, rank, qk_before, qk_after, block, sel_path,
                 heads_n: int) -> dict:
    n = info.get("n_tokens")
    if n is None or block is None:
        return {}
    q = attention_macs(method, rank, n_tokens=n, d_model=qk_after.d_q_in, num_heads=heads_n,
                       d_head=1, d_kv_in=qk_after.d_k_in)["qk"]
    after = q + info["vo_macs_after"]
    new_block = {**block, "qk": qk_after}
    return {"n_tokens": n, "macs_before": info["macs_before"], "macs_after": int(after),
            "mhsa_flops_ratio": after / info["macs_before"],
            "executed_macs_after": executed_macs(new_block, n)}


# ---------------------------------------------------------------------------------------------
# The methods.

def truncatt(params, selection, settings, ctx):
    """The ``truncatt`` plan method (module docstring): per-head truncated SVD of the joint
    query-key slices ("Vision Transformer with Irregular Attention", sec. 2.3).

    Args:
      params, selection, settings, ctx: the method signature of
        :func:`~lowrank_jax.compress.register_method`. Settings: ``rank`` (per head: an int or
        one per head) or ``flops_ratio`` with ``n_tokens``; ``vo_rank``; ``drop_key_bias``.

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel, s, y, _, _, core in _decomposed("truncatt", selection, settings, rows):
        qk = sel.node
        svds = slice_svds(core)
        caps = numerical_ranks(core, svds=svds)
        rank, info = _target("truncatt", sel, params, s, max(caps, default=0))
        # a slice has no more than its numerical rank (at most d_head) to keep
        ranks = [min(r, c) for r, c in zip(per_head(rank, qk.num_heads, f"{sel.path}: rank"),
                                           caps, strict=True)]
        out, err = query_key_from_slices(y, ranks, dtype=leaf_dtype(qk), svds=svds)
        new[sel.path] = out
        _, block = block_of(params, sel.path, "truncatt")
        kept = list(out.projections().widths)
        details = {"head_ranks": kept, "rank": kept,
                   "uniform_heads": [h for h, r in enumerate(kept) if r == 0],
                   **_finish_info(info, "truncatt", kept, qk, out, block, sel.path,
                                  qk.num_heads)}
        rows.append(Row.compare(sel.path, qk, out, rule=sel.rule, kind="truncatt", error=err,
                                details=details))
    return replace_paths(params, new), rows


def _x64(s) -> bool:
    return bool(s.get("float64", True))


def cp(params, selection, settings, ctx):
    """The ``cp`` plan method: CP-SlimAtt ("Vision Transformer with Irregular Attention",
    eqs. 3-4) from CP-ALS (SVD initialisation) and the error-preserving correction.

    Args:
      params, selection, settings, ctx: the method signature. Settings: ``rank`` (``R``) or
        ``flops_ratio`` with ``n_tokens``; ``vo_rank``; ``drop_key_bias``; ``n_iter_max``
        (ALS sweeps, default 100), ``tol`` (default 1e-8), ``epc`` (default ``True``),
        ``float64`` (decompose in float64, default ``True``).

    Row ``details['head_ranks']`` counts, per head, the rank-1 terms whose largest fusion weight
    lies in that head. A head that counts 0 still receives every term through its row of
    ``S^H`` (CP-ALS leaves no exact zeros there), so it does not attend uniformly and the row
    claims no uniform heads.

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel, s, _, qb, kb, core in _decomposed("cp", selection, settings, rows):
        qk = sel.node
        rank, info = _target("cp", sel, params, s, min(core.shape[:2]))
        with jax.enable_x64(_x64(s)):
            t = jnp.asarray(core, jnp.float64 if _x64(s) else jnp.float32)
            res = cp_als(t, int(rank), init="svd", n_iter_max=int(s.get("n_iter_max", 100)),
                         tol=float(s.get("tol", 1e-8)), key=ctx.key)
            factors, als_err = res.factors, float(res.errors[int(res.n_iter) - 1])
            if s.get("epc", True):
                factors = cp_epc(t, None, factors).factors
            fa, fb, fc = (np.asarray(f, np.float64) for f in factors)
            err = float(np.linalg.norm(core - np.asarray(cp_to_tensor(None, factors),
                                                         np.float64)) / np.linalg.norm(core))
        dtype = leaf_dtype(qk)
        out = CPQueryKey(q=factor_leaf(fa, qk.d_q_in, qb, dtype), k=factor_leaf(fb, qk.d_k_in, kb, dtype),
                         mix=jnp.asarray(fc, dtype))
        new[sel.path] = out
        _, block = block_of(params, sel.path, "cp")
        assign = np.argmax(np.abs(fc), axis=0)
        head_r = [int(np.sum(assign == h)) for h in range(qk.num_heads)]
        details = {"rank": int(rank), "head_ranks": head_r, "als_error": als_err,
                   "als_iterations": int(res.n_iter),
                   **_finish_info(info, "cp", int(rank), qk, out, block, sel.path, qk.num_heads)}
        rows.append(Row.compare(sel.path, qk, out, rule=sel.rule, kind="cp", error=err,
                                details=details))
    return replace_paths(params, new), rows


def _pack_terms(a: np.ndarray, b: np.ndarray, ranks: Sequence[int]):
    """Padded term factors ``[T, d, L]`` -> side-by-side ``[d, sum(ranks)]``, each column pair
    rescaled to equal norms (the model is unchanged)."""
    qa, kb = [], []
    for t, r in enumerate(ranks):
        at, bt = a[t][:, :r], b[t][:, :r]
        na, nb = np.linalg.norm(at, axis=0), np.linalg.norm(bt, axis=0)
        ok = (na > 0) & (nb > 0)
        g = np.sqrt(np.where(ok, nb, 1.0) / np.where(ok, na, 1.0))
        qa.append(at * g)
        kb.append(bt / g)
    cat = (lambda xs, d: np.concatenate(xs, axis=1) if xs else np.zeros((d, 0)))
    return cat(qa, a.shape[1]), cat(kb, b.shape[1])


def _uniform_heads(c: np.ndarray, ranks: Sequence[int]) -> list[int]:
    """Heads whose logits are exactly zero: no term of rank > 0 has weight in their row of C."""
    live = np.asarray(ranks) > 0
    return [h for h in range(c.shape[0]) if not np.any(c[h, live] != 0)]


def btd(params, selection, settings, ctx):
    """The ``btd`` plan method: IrrAtt ("Vision Transformer with Irregular Attention",
    eqs. 5-6, Algorithms 1-3).

    Args:
      params, selection, settings, ctx: the method signature. Settings: ``rank`` (total ``R``,
        per-head ranks from Algorithm 1) or ``flops_ratio`` with ``n_tokens``, or ``ranks``
        (one per head: the sweeps start from the slices' truncated SVDs at these ranks);
        ``vo_rank``; ``drop_key_bias``; ``n_iter_max`` (sweeps, default 50), ``tol`` (default
        1e-8), ``n_iter_term`` (Algorithm 2 iterations per term and sweep, default 1),
        ``cp_n_iter_max`` (default 100), ``epc`` (default ``True``), ``float64`` (default
        ``True``), ``rank0_uniform`` (default ``True``, below).

    A head of rank 0 (asked for with ``ranks``, or given none of the ``R`` columns by
    Algorithm 1) attends exactly uniformly by default: the sweeps hold its row of the fusion
    matrix ``C`` at zero (``zero_empty`` of :func:`~lowrank_jax.decomp.btd_ll1`), so no other
    term reaches it and its logits are exactly zero. Algorithm 3 as printed refits every term's
    fusion weights over all heads, and the other terms would give the head logits again; a head
    the user (or Algorithm 1) gave nothing should get nothing, and the ranks in the report
    should describe the model. ``rank0_uniform=False`` runs Algorithm 3 as printed (lower error
    where a head would profit from the others' terms). Row ``details['uniform_heads']`` is read
    off the fitted ``C``, not the ranks: the heads no term of rank > 0 reaches. Fine-tuning the
    fusion matrix afterwards can give those heads weights again.

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel, s, _, qb, kb, core in _decomposed("btd", selection, settings, rows):
        qk = sel.node
        h = qk.num_heads
        rank, info = _target("btd", sel, params, s, min(core.shape[:2]))
        caps = numerical_ranks(core)
        with jax.enable_x64(_x64(s)):
            t = jnp.asarray(core, jnp.float64 if _x64(s) else jnp.float32)
            kw = dict(n_iter_max=int(s.get("n_iter_max", 50)), tol=float(s.get("tol", 1e-8)),
                      n_iter_term=int(s.get("n_iter_term", 1)),
                      zero_empty=bool(s.get("rank0_uniform", True)))
            if s.get("ranks") is not None:
                ranks_in = per_head(s["ranks"], h, f"{sel.path}: ranks")
                res = btd_ll1(t, init="slices", ranks=ranks_in, **kw)
            else:
                total = int(rank)
                cap = max(caps) if total <= sum(caps) else None
                res = btd_ll1(t, total, init="cp", max_rank=cap, epc=bool(s.get("epc", True)),
                              cp_n_iter_max=int(s.get("cp_n_iter_max", 100)), key=ctx.key, **kw)
            a, b, c = (np.asarray(x, np.float64) for x in (res.a, res.b, res.c))
            ranks = [int(r) for r in np.asarray(res.ranks)]
            n_sweeps = int(res.n_iter)
            history = [float(e) for e in np.asarray(res.errors)[:n_sweeps]]
        fa, fb = _pack_terms(a, b, ranks)
        rec = np.einsum("il,jl->ijl", fa, fb)
        off = head_offsets(tuple(ranks))
        terms = np.stack([rec[:, :, off[t]:off[t + 1]].sum(-1) for t in range(len(ranks))], -1)
        err = float(np.linalg.norm(core - terms @ c.T) / np.linalg.norm(core))
        dtype = leaf_dtype(qk)
        out = BTDQueryKey(q=factor_leaf(fa, qk.d_q_in, qb, dtype), k=factor_leaf(fb, qk.d_k_in, kb, dtype),
                          mix=jnp.asarray(c, dtype), ranks=tuple(ranks))
        new[sel.path] = out
        _, block = block_of(params, sel.path, "btd")
        details = {"rank": ranks, "head_ranks": ranks, "rank_total": int(sum(ranks)),
                   "slice_ranks": caps, "sweeps": n_sweeps, "errors": history,
                   "uniform_heads": _uniform_heads(c, ranks),
                   **_finish_info(info, "btd", int(sum(ranks)), qk, out, block, sel.path, h)}
        rows.append(Row.compare(sel.path, qk, out, rule=sel.rule, kind="btd", error=err,
                                details=details))
    return replace_paths(params, new), rows


# ---------------------------------------------------------------------------------------------
# Frontier candidates.

def head_width(params: Any) -> tuple[int, int]:
    """``(heads, widest head)`` over the model's query-key objects, for per-head ranks.

    Raises:
      NotApplicableError: the model has no query-key object ``truncatt`` accepts.
    """
    sel = require(params, "truncatt", ATTENTION_QK)
    # a block without heads has no widths; a factored query-key object no per-head projections
    widths = [w for s in sel if (p := s.node.projections()) is not None for w in p.widths]
    return max(s.node.num_heads for s in sel), max(widths, default=0)


def per_head_rank(setting, keep: float) -> dict:
    """``rank`` per head: ``keep`` of the widest head (at least 1)."""
    return {"rank": max(1, round(keep * head_width(setting.params)[1]))}


def _total_rank(setting, keep: float) -> dict:
    h, w = head_width(setting.params)
    return {"rank": max(1, round(keep * h * w))}


def _tensor_candidates(method: str) -> Candidates:
    return Candidates(groups=((method, ATTENTION_QK),), settings=_total_rank, label="R={rank}")


register_method("truncatt", truncatt, selects="qk", settings=SETTINGS, overrides=OVERRIDES,
                accepts=is_query_key, validate=validator("truncatt"),
                candidates=Candidates(groups=(("truncatt", ATTENTION_QK),),
                                      settings=per_head_rank, label="rank={rank}/head"))
register_method("cp", cp, selects="qk", settings=SETTINGS, overrides=OVERRIDES,
                accepts=is_query_key, validate=validator("cp"), candidates=_tensor_candidates("cp"))
register_method("btd", btd, selects="qk", settings=SETTINGS, overrides=OVERRIDES,
                accepts=is_query_key, validate=validator("btd"),
                candidates=_tensor_candidates("btd"))

__all__ = ["OVERRIDES", "SETTINGS", "btd", "check_settings", "cp", "head_width", "truncatt"]
