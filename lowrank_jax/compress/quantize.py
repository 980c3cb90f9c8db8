"""The ``quantize`` plan method: weights become integer leaves (round to nearest or GPTQ),
alone or composed with low-rank factors and structured pruning.

::

    Step("quantize", [r"mlp/", [r"attn/", {"bits": 8}]], {"bits": 4, "group": 32,
                                                          "algorithm": "gptq"})

Every selected weight (any float leaf; see below for factorized and pruned ones) becomes an
:class:`~lowrank_jax.leaves.Int8` (``bits=8``: symmetric, one scale per output channel) or an
:class:`~lowrank_jax.leaves.Int4` (``bits=4``: a scale per ``group`` inputs and output, zero
points with ``zero_point=True``). Rules may override ``bits``, ``group``, ``zero_point``,
``scale_dtype``, ``rank`` and ``factor_bits``: bit widths per leaf or per layer.

Algorithms (``algorithm``):

* ``'rtn'`` (default): round to nearest on the grid (:mod:`lowrank_jax.leaves.quantized`).
* ``'gptq'``: GPTQ ("GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
  Transformers", arXiv:2210.17323; :mod:`lowrank_jax.compress.gptq`) from ``X^T X`` of each
  weight's calibration inputs. With ``config=`` in :func:`~lowrank_jax.compress.apply_plan`,
  the inputs are captured through the model's own forward on ``samples`` of the family's
  representative inputs (``data='sample'``, the default: ``sample_inputs``, seeded by
  ``seed``; or the first batch of ``samples`` rows of a named batch source,
  :func:`lowrank_jax.compress.prune.batch_source`: ``'builtin'`` gives a forecaster windows
  from the first 70 % of the built-in series, held apart from later data; a language model
  takes a source registered with :func:`~lowrank_jax.compress.prune.register_batches` whose
  batches hold ``input_ids`` of real text (the batch's keys the forward takes are used, so a
  batch without ``attention_mask`` has no padding); its ``sample_inputs`` are random token
  ids), layer by layer in the order the forward reaches them: the weights of layer ``l`` are
  quantized from inputs computed with layers ``< l`` already quantized, as in the paper
  (weights of one layer, ``.../layers/<l>/``, share one pass; a weight outside ``layers/`` is
  its own stage). Activations given in ``inputs=`` for a path are used instead (and that
  weight is not captured).

Embeddings: a tied output embedding (GPT-2's ``wte``, a tied Llama's ``embed``) is the
embedding table, an array the forward gathers from and multiplies by, not a weight leaf: it
stays float32 and no rule can select it. An untied output projection (``lm_head``) is a weight
leaf: it stays float unless a rule selects it.

Composition:

* A factorized weight (a leaf with stored factors ``W = U V``, such as
  :class:`~lowrank_jax.LowRank` from an ``svd`` step) keeps its rank: ``U`` and ``V`` are
  quantized (``U`` with the weight's settings along ``d_in``; ``V`` along the rank, its group
  capped at the rank) into a :class:`~lowrank_jax.leaves.ProductLeaf`. With GPTQ, ``V`` is
  quantized from the inputs it really sees, ``x Q(U)``: ``Q(U)^T H Q(U)``.
  ``factors=False`` quantizes the product instead.
* ``rank=r > 0``: low rank plus quantized residual, ``W ~ Q(W - U V) + U V`` with ``U V`` the
  rank-``r`` truncated SVD (``U = U_r S_r^{1/2}``, ``V = S_r^{1/2} V_r^T``), kept in float32
  (``factor_bits=None``) or quantized (``factor_bits`` 8 or 4, CALDERA's low-precision
  factors, "Compressing Large Language Models using Low Rank and Low Precision
  Decomposition", arXiv:2405.18886, one pass of its alternation: factors first, then the
  residual of the quantized factors). A :class:`~lowrank_jax.leaves.SumLeaf`.
* A weight whose channels a ``prune`` step removed is quantized on its kept channels only
  (:func:`~lowrank_jax.leaves.channel_masked.pruned_base`; GPTQ uses the kept inputs' Gram
  matrix): quantization after structured pruning.

Activations (``activations``): ``None`` (the default) keeps them float (weight-only);
``'int8'`` (8-bit weights only) makes each weight an :class:`~lowrank_jax.leaves.Int8A8`, whose
product also rounds every input row to int8 (dynamic per-token scales) and multiplies the codes
in int32 (W8A8). It changes the model's numbers, so it is part of the stored leaf, and a rule
may set it per weight. It is refused with 4-bit weights, with ``rank > 0`` and for a factorized
weight (unless ``factors=False``). The rows' ``error`` and ``output_error`` measure the weight's
rounding only (``materialize`` of the leaf), not the activations'.

A weight of an emptied block (no inputs or outputs) is passed through with a row of kind
``'empty'``. Row: ``kind='quantized'`` (``'quantized-factors'``, ``'lowrank+quantized'``);
``error`` ``||W - W_q||_F / ||W||_F`` in float64; ``details``: ``bits``, ``group``,
``zero_point``, ``scale_dtype``, ``algorithm``, ``activations``, ``bits_per_weight`` (the new
leaf's storage per weight of ``W``), and with calibration inputs ``output_error``,
``||X (W - W_q)||_F / ||X W||_F``.
"""

from __future__ import annotations

import numbers
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.candidates import ATTENTION, MLP
from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.gptq import gptq
from lowrank_jax.compress.plan import Plan, Step
from lowrank_jax.compress.registry import Candidate, CandidateSetting, Context, register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.compress.rules import Selection
from lowrank_jax.compress.svd import truncatable
from lowrank_jax.errors import ConfigError, NotApplicableError, PlanError
from lowrank_jax.leaves import bias_of, factors, get_path, materialize_host, replace_paths
from lowrank_jax.leaves.channel_masked import pruned_base
from lowrank_jax.leaves.quantized import (
    ACTIVATIONS,
    SCALE_DTYPES,
    Int4,
    Int8,
    Int8A8,
    ProductLeaf,
    SumLeaf,
    Tap,
    check_group,
    check_scale_dtype,
    quantize_weight,
    tap_sinks,
)

SETTINGS = ("bits", "group", "zero_point", "scale_dtype", "algorithm", "damp", "block",
            "samples", "seed", "data", "rank", "factor_bits", "factors", "activations")
OVERRIDES = ("bits", "group", "zero_point", "scale_dtype", "rank", "factor_bits", "activations")
DEFAULTS = {"bits": 8, "group": 128, "zero_point": False, "scale_dtype": "float32",
            "algorithm": "rtn", "damp": 0.01, "block": 128, "samples": 16, "seed": 0,
            "data": "sample", "rank": 0, "factor_bits": None, "factors": True,
            "activations": None}
ALGORITHMS = ("rtn", "gptq")


def _int(v: Any, name: str, lo: int, where: str | None = None, none: bool = False) -> None:
    if none and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise PlanError(f"quantize: {where or name}: {name} must be an int >= {lo}"
                        f"{' or null' if none else ''}, got {v!r}", where=where or name,
                        expected=f"int >= {lo}", actual=v)


def check_settings(settings: Mapping, where: str | None = None) -> dict:
    """The effective settings (defaults filled in), validated.

    Raises:
      PlanError: a bad value, naming the setting (and ``where``: a path, for a rule's
        overrides).
    """
    s = {**DEFAULTS, **settings}
    at = f"{where}: " if where else ""
    if s["bits"] not in (4, 8) or isinstance(s["bits"], bool):
        raise PlanError(f"quantize: {at}bits must be 4 or 8, got {s['bits']!r}",
                        where=where or "bits", expected=(4, 8), actual=s["bits"])
    if s["factor_bits"] is not None and (s["factor_bits"] not in (4, 8)
                                         or isinstance(s["factor_bits"], bool)):
        raise PlanError(f"quantize: {at}factor_bits must be 4, 8 or null (float32 factors), got "
                        f"{s['factor_bits']!r}", where=where or "factor_bits",
                        expected=(4, 8, None), actual=s["factor_bits"])
    try:
        check_group(s["group"], "group")
        check_scale_dtype(s["scale_dtype"], "scale_dtype")
    except ConfigError as e:
        raise PlanError(f"quantize: {at}{e}", where=where or e.where, expected=e.expected,
                        actual=e.actual) from None
    for name in ("zero_point", "factors"):
        if not isinstance(s[name], bool):
            raise PlanError(f"quantize: {at}{name} must be true or false, got {s[name]!r}",
                            where=where or name, expected="bool", actual=s[name])
    if s["activations"] not in ACTIVATIONS:
        raise PlanError(f"quantize: {at}activations must be null (weight-only) or 'int8', got "
                        f"{s['activations']!r}", where=where or "activations",
                        expected=ACTIVATIONS, actual=s["activations"])
    if s["activations"] == "int8" and s["bits"] != 8:
        raise PlanError(f"quantize: {at}activations='int8' needs bits=8 (an int8 x int8 "
                        f"product), got bits={s['bits']}", where=where or "activations",
                        expected="bits=8", actual=s["bits"])
    if s["activations"] == "int8" and s["rank"]:
        raise PlanError(f"quantize: {at}activations='int8' applies to a plain int8 weight, not "
                        f"to low rank plus a quantized residual (rank={s['rank']}); give rank=0",
                        where=where or "activations", expected="rank=0", actual=s["rank"])
    if s["zero_point"] and s["bits"] == 8:
        raise PlanError(f"quantize: {at}8-bit weights are symmetric; zero_point needs bits=4",
                        where=where or "zero_point", expected=False, actual=True)
    if s["algorithm"] not in ALGORITHMS:
        raise PlanError(f"quantize: algorithm must be one of {ALGORITHMS}, got "
                        f"{s['algorithm']!r}", where="algorithm", expected=ALGORITHMS,
                        actual=s["algorithm"])
    d = s["damp"]
    if isinstance(d, bool) or not isinstance(d, numbers.Real) or not 0 < d < 1:
        raise PlanError(f"quantize: damp must be in (0, 1), got {d!r}", where="damp",
                        expected="(0, 1)", actual=d)
    if not isinstance(s["data"], str) or not s["data"]:
        raise PlanError(f"quantize: data must be 'sample' (the family's sample_inputs) or the "
                        f"name of a batch source, got {s['data']!r}", where="data",
                        expected="a name", actual=s["data"])
    _int(s["block"], "block", 1)
    _int(s["samples"], "samples", 1)
    _int(s["seed"], "seed", 0)
    _int(s["rank"], "rank", 0, where)
    return s


# ---------------------------------------------------------------------------------------------
# One weight.

def _quant(w: np.ndarray, h: np.ndarray | None, b, *, bits: int, group, zero_point: bool,
           scale_dtype: str, algorithm: str, damp: float, block: int,
           activations: str | None = None):
    """``w [d_in, d_out]`` (float64 host array) as an integer leaf."""
    group = None if bits == 8 else group
    w32 = jnp.asarray(w, jnp.float32)
    if algorithm == "rtn" or h is None:
        return quantize_weight(w32, b, bits=bits, group=group, zero_point=zero_point,
                               scale_dtype=scale_dtype, activations=activations)
    c, s, z, sizes = gptq(w32, jnp.asarray(h, jnp.float32), bits=bits, group=group,
                          zero_point=zero_point, scale_dtype=scale_dtype, block=block, damp=damp)
    if bits == 8:
        return (Int8A8 if activations == "int8" else Int8)(
            q=jnp.asarray(c.astype(np.int8)),
            scale=jnp.asarray(s[0]).astype(jnp.dtype(scale_dtype)), b=b)
    return Int4.from_codes(c.astype(np.int64), s, z if zero_point else None, b,
                           group_sizes=sizes, scale_dtype=scale_dtype)


def _host(leaf) -> np.ndarray:
    return materialize_host(leaf)


def quantize_node(node: Any, s: Mapping, h: np.ndarray | None = None) -> tuple[Any, str, dict]:
    """One weight quantized with the effective settings ``s`` (module docstring).

    Args:
      node: a float weight leaf (a :class:`~lowrank_jax.leaves.ChannelPruned` one is quantized
        on its kept channels).
      s: effective settings (:func:`check_settings`).
      h: ``X^T X`` of the weight's inputs ``[d_in, d_in]`` (full width) for GPTQ, or ``None``.

    Returns:
      ``(new_leaf, kind, details)``.
    """
    base, put_back, base_inputs = pruned_base(node)
    d_in_full = int(node.shape[0])
    if h is not None:
        sel = np.asarray(base_inputs(np.eye(d_in_full)), np.float64)  # [d_in_full, d_in_base]
        h = sel.T @ h @ sel
    q = dict(bits=int(s["bits"]), group=s["group"], zero_point=bool(s["zero_point"]),
             scale_dtype=s["scale_dtype"], algorithm=s["algorithm"], damp=float(s["damp"]),
             block=int(s["block"]))
    b = bias_of(base)
    fac = factors(base)
    w = _host(base)
    rank = int(s["rank"])
    if rank > 0:
        u_, sv, vt = np.linalg.svd(w, full_matrices=False)
        r = min(rank, sv.size)
        root = np.sqrt(sv[:r])
        u, v = u_[:, :r] * root, root[:, None] * vt[:r]
        if s["factor_bits"] is None:
            lowrank = ProductLeaf(jnp.asarray(u, jnp.float32), jnp.asarray(v, jnp.float32))
        else:
            fq = {**q, "bits": int(s["factor_bits"]), "zero_point": False}
            qu = _quant(u, h, None, **fq)
            hv = None if h is None else _host(qu).T @ h @ _host(qu)
            lowrank = ProductLeaf(qu, _quant(v, hv, None, **{**fq, "group": _cap(fq, r)}))
        new = SumLeaf(_quant(w - _host(lowrank), h, None, **q), lowrank, b=b)
        kind = "lowrank+quantized"
    elif s["factors"] and _factorized(fac):
        _refuse_factored(s, "activations")
        u, v = np.asarray(fac.first, np.float64), np.asarray(fac.second, np.float64)
        qu = _quant(u, h, None, **q)
        hv = None if h is None else _host(qu).T @ h @ _host(qu)
        new = ProductLeaf(qu, _quant(v, hv, None, **{**q, "group": _cap(q, u.shape[1])}),
                          b=fac.bias)
        kind = "quantized-factors"
    else:
        new = _quant(w, h, b, **q, activations=s["activations"])
        kind = "quantized"
    after = _host(new)
    norm = float(np.linalg.norm(w))
    details = {"shape": [int(d) for d in base.shape], "bits": q["bits"],
               "group": None if q["bits"] == 8 else q["group"], "zero_point": q["zero_point"],
               "scale_dtype": q["scale_dtype"], "algorithm": q["algorithm"],
               "activations": s["activations"],
               "bits_per_weight": new.storage_bits() / max(1, int(np.prod(base.shape))),
               "error": float(np.linalg.norm(w - after)) / norm if norm > 0 else 0.0}
    if rank > 0:
        details.update(rank=int(min(rank, min(w.shape))), factor_bits=s["factor_bits"])
    if h is not None:
        den = float(np.trace(w.T @ h @ w))
        d = w - after
        details["output_error"] = float(np.sqrt(max(np.trace(d.T @ h @ d), 0.0) / den)) \
            if den > 0 else 0.0
    return put_back(new), kind, details


def _factorized(fac) -> bool:
    """Whether a weight's :func:`~lowrank_jax.leaves.factors` are stored ``U V`` factors the
    method quantizes one by one."""
    return fac is not None and fac.first is not None and fac.rows is None


def _refuse_factored(s: Mapping, where: str) -> None:
    if s["activations"] is not None and s["factors"] and not s["rank"]:
        raise PlanError(f"quantize: {where}: activations='int8' applies to a plain int8 weight; "
                        "this one is factorized (W = U V): give factors=false to quantize the "
                        "product, or leave activations null", where=where,
                        expected="a weight without stored factors", actual="factors")


def _cap(q: Mapping, r: int):
    """The group of a factor ``V [r, d_out]`` (its inputs are the rank): capped at ``r``."""
    return None if q["group"] is None else min(int(q["group"]), max(int(r), 1))


# ---------------------------------------------------------------------------------------------
# Calibration through the model's forward.

_STAGE = re.compile(r"^(.*?(?:^|/)layers/\d+)(?:/|$)")


def stage_of(path: str) -> str:
    """The stage a weight is quantized in: its path up to ``layers/<l>`` (the weight itself
    outside ``layers/``)."""
    m = _STAGE.match(path)
    return m.group(1) if m else path


def capture_grams(forward, tree: Any, paths: list[str]) -> tuple[list[str], dict]:
    """``X^T X`` (float64) of the inputs of the weights at ``paths`` in one run of
    ``forward(tree)``, and the order in which the forward first reached them.

    Raises:
      PlanError: a weight the forward never multiplied through ``linear`` (a block that
        densifies it instead), naming it.
    """
    order, grams = [], {}

    def sink(p):
        def add(x):
            x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
            x = x[np.all(np.isfinite(x), axis=1)]
            grams[p] = grams.get(p, 0.0) + x.T @ x
            if p not in order:
                order.append(p)
        return add

    tags = {f"quantize:{id(grams)}:{p}": p for p in paths}
    tapped = replace_paths(tree, {p: Tap(get_path(tree, p), tag=t) for t, p in tags.items()})
    with tap_sinks({t: sink(p) for t, p in tags.items()}):
        jax.block_until_ready(forward(tapped))
    missing = [p for p in paths if p not in grams]
    if missing:
        raise PlanError(f"quantize: gptq: the model's forward never multiplied {missing[:4]} "
                        "through linear(), so no calibration inputs were captured; give them "
                        "in inputs= or use algorithm='rtn' for those weights", where=missing[0],
                        expected="weights applied through linear()", actual=missing)
    return order, grams


def _forward(config: Any, samples: int, seed: int, data: str = "sample"):
    from lowrank_jax.models import family_of

    fam = family_of(config)
    inputs = fam.sample_inputs(config, np.random.default_rng(seed), samples)
    if data != "sample":  # a batch source's first batch, the keys the forward takes
        from lowrank_jax.compress.prune.method import batch_source

        batch = batch_source(data, "quantize")(config, batch_size=samples, seed=seed)(0)
        keys = [k for k in inputs if k in batch]  # optional ones (a mask) may be absent
        if not keys:
            raise PlanError(f"quantize: the first batch of data={data!r} has none of the inputs "
                            f"the model's forward takes ({sorted(inputs)}); got "
                            f"{sorted(batch)}", where="data", expected=sorted(inputs),
                            actual=sorted(batch))
        inputs = {k: jnp.asarray(batch[k]) for k in keys}
    if fam.init_state is not None:
        return lambda tree: fam.apply(tree, inputs, config, state=fam.init_state(tree, config),
                                      train=False)
    return lambda tree: fam.apply(tree, inputs, config)


# ---------------------------------------------------------------------------------------------
# The method.

def quantize(params: Any, selection: list[Selection], settings: dict,
             ctx: Context) -> tuple[Any, list[Row]]:
    """The ``quantize`` plan method: ``fn(params, selection, settings, ctx) -> (params, rows)``
    (module docstring).

    Raises:
      PlanError: bad settings or overrides (naming the path); ``algorithm='gptq'`` for weights
        with neither ``config=`` nor ``inputs=`` in :func:`~lowrank_jax.compress.apply_plan`.
    """
    base_s = check_settings(settings)
    eff = {sel.path: check_settings({**settings, **sel.overrides}, sel.path) for sel in selection}
    live = [sel for sel in selection if not is_empty(pruned_base(sel.node)[0])]
    for sel in live:  # refused before anything is quantized
        if _factorized(factors(pruned_base(sel.node)[0])):
            _refuse_factored(eff[sel.path], sel.path)
    grams: dict[str, np.ndarray] = {}
    tree = params
    done: dict[str, tuple] = {}
    if base_s["algorithm"] == "gptq":
        for sel in live:
            x = ctx.input_for(sel.path)
            if x is not None:
                x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
                grams[sel.path] = x.T @ x
        rest = [sel.path for sel in live if sel.path not in grams]
        if rest:
            if ctx.config is None:
                raise PlanError(f"quantize: algorithm='gptq' needs calibration inputs: pass "
                                f"config= to apply_plan (inputs are captured through the "
                                f"model's forward) or inputs= for {rest[:3]}", where=rest[0],
                                expected="config= or inputs=", actual=None)
            forward = _forward(ctx.config, int(base_s["samples"]), int(base_s["seed"]),
                               base_s["data"])
            order, first = capture_grams(forward, params, rest)
            stages: dict[str, list[str]] = {}
            for p in order:
                stages.setdefault(stage_of(p), []).append(p)
            ctx.info["stages"] = list(stages)
            for k, (_, paths) in enumerate(stages.items()):
                g = first if k == 0 else capture_grams(forward, tree, paths)[1]
                new = {}
                for p in paths:
                    node = get_path(params, p)
                    done[p] = quantize_node(node, eff[p], g[p])
                    new[p] = done[p][0]
                tree = replace_paths(tree, new)
    rows, new = [], {}
    live_paths = {sel.path for sel in live}
    for sel in selection:
        if sel.path not in live_paths:
            rows.append(empty_row(sel))
            continue
        if sel.path not in done:
            done[sel.path] = quantize_node(sel.node, eff[sel.path], grams.get(sel.path))
        leaf, kind, details = done[sel.path]
        new[sel.path] = leaf
        rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule, kind=kind,
                                error=details.pop("error"), details=details))
    return replace_paths(params, new), rows


def _validate(settings: Mapping) -> None:
    check_settings(settings)


# ---------------------------------------------------------------------------------------------
# Frontier candidates.

#: ``(least strength, label, settings)``: the variant a frontier strength ``keep`` gets (the
#: first whose least strength ``keep`` reaches): int8 for ``keep > 0.6``, int4 with groups of 32
#: for ``keep > 0.35``, int4 with groups of 128 below (about 8, 5 and 4.25 bits per weight).
VARIANTS = (
    (0.6, "int8", {"bits": 8}),
    (0.35, "int4 g32", {"bits": 4, "group": 32}),
    (0.0, "int4 g128", {"bits": 4, "group": 128}),
)


def variant(keep: float) -> tuple[str, dict]:
    """``(label, settings)`` of the quantized candidate at frontier strength ``keep``
    (:data:`VARIANTS`)."""
    for least, label, st in VARIANTS:
        if keep > least:
            return label, dict(st)
    return VARIANTS[-1][1], dict(VARIANTS[-1][2])


def candidates(setting: CandidateSetting) -> list[Candidate]:
    """The ``quantize`` method's frontier candidates, on the attention and MLP projections:
    at every strength ``keep`` the variant of :func:`variant` (int8, int4 g32, int4 g128:
    stronger compression at smaller ``keep``; ``keep`` is the candidate's nominal strength, its
    measured size is the frontier's), by round to nearest and, for a model with a config
    (calibration through its forward, on the setting's ``prune_data`` batch source when it is
    not ``'builtin'``: a language model's text), by GPTQ; composed, at the smallest strength ``k``:
    ``svd`` of attention at ratio ``k`` with int8 factors, ``prune`` removing ``1 - k`` (where
    it applies) then int8, and low rank (rank 8) plus an int4 g32 residual.

    Raises:
      NotApplicableError: no attention or MLP projection to quantize.
    """
    from lowrank_jax.compress.candidates import require

    rules = ()
    for part in (ATTENTION, MLP):  # a rule that selects nothing is a plan error
        try:
            require(setting.params, "quantize", part)
            rules += tuple(part)
        except NotApplicableError:
            pass
    if not rules:
        raise NotApplicableError("no attention or MLP projection it can quantize",
                                 where="quantize")
    algos = ["rtn"] + (["gptq"] if setting.config is not None else [])
    # GPTQ calibrates on the frontier's batch source when it has one (a language model's text,
    # a forecaster's CSV series), else on the family's representative inputs
    calibration = {} if setting.prune_data == "builtin" else {"data": setting.prune_data}
    out, seen = [], set()
    for algo in algos:
        for k in setting.strengths:
            label, st = variant(k)
            name = f"quantize {algo} {label}"
            if name in seen:
                continue
            seen.add(name)
            extra = calibration if algo == "gptq" else {}
            out.append(Candidate(name=name, group=f"quantize {algo}", keep=float(k),
                                 plan=Plan((Step("quantize", rules,
                                                 {**st, "algorithm": algo, **extra}),))))
    k = min(setting.strengths)
    try:
        require(setting.params, "svd", ATTENTION)
        out.append(Candidate(
            name=f"svd attn {k:g} + int8 factors", group="svd + quantize", keep=float(k),
            plan=Plan((Step("svd", ATTENTION, {"ratio": k}),
                       Step("quantize", ATTENTION, {"bits": 8})))))
    except NotApplicableError:
        pass
    try:  # structured pruning first, then int8 of what is left
        from lowrank_jax.compress.prune.api import DEFAULT_RULES
        from lowrank_jax.compress.prune.method import CANDIDATES as PRUNE

        PRUNE.check(setting)
        out.append(Candidate(
            name=f"prune {1 - k:g} + int8", group="prune + quantize", keep=float(k),
            plan=Plan((Step("prune", DEFAULT_RULES, PRUNE.settings(setting, k)),
                       Step("quantize", rules, {"bits": 8})))))
    except NotApplicableError:
        pass
    out.append(Candidate(
        name="lowrank 8 + int4 g32 residual", group="lowrank + quantize", keep=float(k),
        plan=Plan((Step("quantize", rules, {"bits": 4, "group": 32, "rank": 8}),))))
    return out


register_method("quantize", quantize, settings=SETTINGS, overrides=OVERRIDES,
                accepts=truncatable, validate=_validate, candidates=candidates)

__all__ = ["ALGORITHMS", "DEFAULTS", "OVERRIDES", "SCALE_DTYPES", "SETTINGS", "VARIANTS",
           "candidates", "capture_grams", "check_settings", "quantize", "quantize_node",
           "stage_of", "variant"]
