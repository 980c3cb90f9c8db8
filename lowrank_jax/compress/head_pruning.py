"""The ``prune_heads`` plan method: whole attention heads removed by their importance on data.

``Step("prune_heads", [r"attn/o$"], {"target": 0.5, "unit": "query", "data": "mytext"})``
scores every head of the selected attention blocks (the rules select their output projections
``.../attn/o``) and removes the least important ones physically:

* ``unit='query'``: query heads. In a grouped-query block (Llama-style,
  :mod:`lowrank_jax.nn.attention.grouped`) the same number goes from every key-value group, so
  each key-value head keeps the same number of query heads; in an ordinary block (GPT-2, BERT,
  ViT) the heads go with their query, key and value channels (:func:`lowrank_jax.nn.keep_heads`).
* ``unit='group'``: whole key-value groups of a grouped-query block (a key-value head with
  every query head that reads it), which shrinks the key-value cache too.

A head's importance is the magnitude of the first-order change of the loss when its output is
switched off ("Are Sixteen Heads Really Better than One?", arXiv:1905.10650, sec. 4.1):
``|sum over the head's rows r of W^O[r] . dL/dW^O[r]|``, the derivative with respect to a gate
on the head's output, averaged over ``steps`` batches of the named data source (as ``prune``'s
``data``) under the family's default loss. A group's importance is that of a gate on all its
query heads. With ``equal=True`` (default) every selected block loses the same number of units
(a Hugging Face config has one head count for all layers, so the export is then physically
smaller); with ``equal=False`` the units are ranked across blocks and every block keeps at
least one.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.prune.method import check_prunable
from lowrank_jax.compress.registry import Candidates, CandidateSetting, register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.errors import NotApplicableError, PlanError
from lowrank_jax.leaves import Dense, HeadLayout, bias_of, get_path, materialize, replace_paths

SETTINGS = ("target", "unit", "equal", "data", "batch_size", "steps", "seed")
DEFAULTS = {"unit": "query", "equal": True, "data": "builtin", "batch_size": 8, "steps": 4,
            "seed": 0}
UNITS = ("query", "group")


def _validate(s: dict) -> None:
    t = s.get("target")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t < 1.0:
        raise PlanError(f"prune_heads: target must be a fraction in [0, 1), got {t!r}",
                        where="target", expected="[0, 1)", actual=t)
    if s.get("unit", "query") not in UNITS:
        raise PlanError(f"prune_heads: unit must be one of {UNITS}, got {s.get('unit')!r}",
                        where="unit", expected=UNITS, actual=s.get("unit"))
    for name in ("batch_size", "steps"):
        v = s.get(name, DEFAULTS[name])
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"prune_heads: {name} must be an int >= 1, got {v!r}", where=name,
                            expected=">= 1", actual=v)


def _block_info(tree, path: str):
    """``(block path, block, query-head layout, kv layout or None)`` of the block whose output
    projection is at ``path``."""
    from lowrank_jax.nn.attention.grouped import is_grouped_block

    if not path.endswith("/o"):
        raise PlanError(f"prune_heads: rules must select attention output projections "
                        f"('.../attn/o'), got {path}", where=path, expected=".../attn/o")
    bpath = path[:-2]
    block = get_path(tree, bpath)
    if is_grouped_block(block):
        return bpath, block, block["q_heads"], block["kv_heads"]
    if isinstance(block, dict) and isinstance(block.get("heads"), HeadLayout):
        return bpath, block, block["heads"], None
    raise PlanError(f"prune_heads: {bpath} is not an attention block", where=bpath)


def _gate_derivatives(tree, blocks, config, s) -> list[np.ndarray]:
    """Per block, the loss derivative with respect to a gate on every query head's output,
    averaged over the batches."""
    from lowrank_jax.compress.prune.method import batch_source
    from lowrank_jax.models import family_of

    fam = family_of(config)
    if fam.loss is None:
        raise NotApplicableError(f"prune_heads: family {fam.name!r} has no default loss to score "
                                 "heads with", where="config")
    loss_fn = fam.loss(config)
    batches = batch_source(s["data"], "prune_heads")(config, batch_size=int(s["batch_size"]),
                                      seed=int(s["seed"]))
    o_paths = [f"{b[0]}/o" for b in blocks]
    dense = [jnp.asarray(materialize(get_path(tree, p))) for p in o_paths]
    biases = [bias_of(get_path(tree, p)) for p in o_paths]

    def loss(ws, batch):
        new = {p: Dense(w=w, b=b) for p, w, b in zip(o_paths, ws, biases, strict=True)}
        return loss_fn(replace_paths(tree, new), batch, None)[0]

    grad = jax.jit(jax.grad(loss))
    total = [np.zeros(w.shape, np.float64) for w in dense]
    for j in range(int(s["steps"])):
        for acc, g in zip(total, grad(dense, batches(j)), strict=True):
            acc += np.asarray(g, np.float64)
    out = []
    for (_, _, qh, _), w, g in zip(blocks, dense, total, strict=True):
        prod = np.sum(np.asarray(w, np.float64) * g / int(s["steps"]), axis=1)  # per input row
        off = np.concatenate([[0], np.cumsum(qh.v)])
        out.append(np.array([prod[off[h]:off[h + 1]].sum() for h in range(qh.num_heads)]))
    return out


def _units(info, gates: np.ndarray, unit: str, group: int):
    """``(unit ids, importance per unit)``: query heads (grouped by their kv head where the
    block has one) or key-value groups."""
    _, _, qh, kvh = info
    if unit == "group":
        owner = np.array([i // group for i in qh.ids])
        return [np.flatnonzero(owner == k) for k in kvh.ids], np.array(
            [abs(gates[owner == k].sum()) for k in kvh.ids])
    return [np.array([h]) for h in range(qh.num_heads)], np.abs(gates)


def prune_heads(params: Any, selection, settings: dict, ctx) -> tuple[Any, list[Row]]:
    """The ``prune_heads`` plan method (module docstring)."""
    from lowrank_jax.nn import keep_heads
    from lowrank_jax.nn.attention.grouped import keep_kv_groups, keep_query_heads

    s = {**DEFAULTS, **settings}
    if ctx.config is None:
        raise NotApplicableError("prune_heads: needs the model config (apply_plan(..., "
                                 "config=...)) for its loss", where="config")
    unit = s["unit"]
    blocks = [_block_info(params, sel.path) for sel in selection]
    if unit == "group" and any(b[3] is None for b in blocks):
        bad = [b[0] for b in blocks if b[3] is None]
        raise PlanError(f"prune_heads: unit='group' needs grouped-query blocks; {bad[0]} has "
                        "no key-value groups", where=bad[0], expected="a grouped-query block")
    cfg = ctx.config
    group = (cfg.num_attention_heads // cfg.num_key_value_heads
             if hasattr(cfg, "num_key_value_heads") else 1)
    gates = _gate_derivatives(params, blocks, cfg, s)
    target = float(s["target"])
    units = [_units(b, g, unit, group) for b, g in zip(blocks, gates, strict=True)]
    drop: list[set] = [set() for _ in blocks]
    if s["equal"]:
        for n, (b, (ids, imp)) in enumerate(zip(blocks, units, strict=True)):
            if unit == "query" and b[3] is not None:  # the same number from every kv group
                owner = np.array([i // group for i in b[2].ids])
                for k in b[3].ids:
                    members = np.flatnonzero(owner == k)
                    m = int(math.floor(target * len(members) + 1e-9))
                    m = min(m, len(members) - 1)
                    drop[n] |= set(members[np.argsort(imp[members], kind="stable")[:m]].tolist())
            else:
                m = min(int(math.floor(target * len(ids) + 1e-9)), len(ids) - 1)
                drop[n] |= set(np.argsort(imp, kind="stable")[:m].tolist())
    else:
        pool = sorted((float(imp[u]), n, u) for n, (_, imp) in enumerate(units)
                      for u in range(len(imp)))
        m = int(math.floor(target * len(pool) + 1e-9))
        for _, n, u in pool:
            if m == 0:
                break
            if len(drop[n]) < len(units[n][0]) - 1:
                drop[n].add(u)
                m -= 1
    new, rows = {}, []
    for sel, b, (ids, imp), d in zip(selection, blocks, units, drop, strict=True):
        bpath, block, qh, kvh = b
        keep_units = [u for u in range(len(ids)) if u not in d]
        if unit == "group":
            after = keep_kv_groups(block, keep_units, group)
        else:
            keep = sorted(int(h) for u in keep_units for h in ids[u])
            after = (keep_query_heads(block, keep) if kvh is not None
                     else keep_heads(block, keep))
        new[bpath] = after
        rows.append(Row.compare(sel.path, block, after, rule=sel.rule, kind=f"heads-{unit}",
                                details={"kept": len(keep_units), "of": len(ids),
                                         "importance": [float(x) for x in imp]}))
    return replace_paths(params, new), rows


def _check_candidates(setting: CandidateSetting) -> None:
    """Candidates for the decoder-only language models (other families' heads go with their
    channels under ``prune``), with ``prune``'s requirements (a loss, a batch source)."""
    from lowrank_jax.models import family_of

    if setting.config is None or family_of(setting.config).apply_cached is None:
        raise NotApplicableError("its frontier candidates are for decoder-only language models "
                                 "(prune removes other models' heads with their channels)",
                                 where="config")
    check_prunable(setting)


def _candidate_settings(setting: CandidateSetting, keep: float) -> dict:
    return {"target": round(1.0 - keep, 6), "steps": max(1, setting.prune_steps // 2),
            "data": setting.prune_data}


#: Frontier candidates: ``1 - keep`` of every block's query heads removed (the same share of
#: every key-value group), scored on the setting's batch source, as ``prune``'s.
CANDIDATES = Candidates(groups=(("prune_heads", (r"attn/o$",)),), settings=_candidate_settings,
                        label="target={removed:g}", check=_check_candidates)

register_method("prune_heads", prune_heads, settings=SETTINGS, overrides=(),
                validate=_validate, candidates=CANDIDATES)


__all__ = ["CANDIDATES", "DEFAULTS", "SETTINGS", "UNITS", "prune_heads"]
