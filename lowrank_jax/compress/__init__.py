"""Surgery on parameter trees: one plan, applied in order, one report.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility" (sec. 5) and the methods to come plug into one entry point:

* :class:`Plan` / :class:`Step` -- a plan is data: steps of (method, path rules, settings),
  printable, comparable, saved as JSON (:meth:`Plan.to_json`, :meth:`Plan.from_file`).
* :func:`apply_plan` -- applies the steps in order to one tree (never mutating it) and returns
  the new tree and a :class:`Report` whose :class:`Row` s share one schema (path, method, rule,
  step, parameters / bits / FLOPs before and after, relative error, details).
* :func:`register_method` -- every method is a module with one function
  ``fn(params, selection, settings, ctx) -> (new_params, rows)`` and one registration, which
  also declares the method's frontier candidates (:class:`Candidates`,
  :mod:`~lowrank_jax.compress.candidates`). Built in: ``svd``
  (:mod:`~lowrank_jax.compress.svd_method`: truncated SVD by eps / rank / ratio / schedule, per
  head, data-aware), ``factorize`` (:mod:`~lowrank_jax.compress.factorize`: compressed-by-design
  factors), ``binarize`` (:mod:`~lowrank_jax.compress.binarize`: Biprop masked-binary weights
  from trained ones), ``prune`` and ``lora`` (:mod:`~lowrank_jax.compress.prune`), ``truncatt``,
  ``cp``, ``btd`` and ``truncatt_vo`` (:mod:`~lowrank_jax.compress.irregular`), ``partition``
  and ``compress_keys`` (:mod:`~lowrank_jax.compress.partitioning`); several methods compose in
  one plan (:mod:`~lowrank_jax.compress.compose`: what their order means).
* :func:`compress` (a one-step ``svd`` plan) and :func:`factorize_init` (a one-step
  ``factorize`` plan), :func:`reuse_weights`.
* Matrix-level tools: :func:`truncated_svd`, :func:`head_truncated_svd`,
  :func:`project_inputs`, :func:`compare_truncations`.
* :func:`power_schedule` (sec. 5), :func:`interpolation_schedule` (App. K),
  :func:`uniform_schedule` -- per-layer ranks.
* :func:`select`, :data:`ATTENTION_QKVO`, :data:`ATTENTION_QKV_PER_HEAD`,
  :data:`ATTENTION_QK` -- path rules.
* :func:`compare_models`, :func:`sample_inputs` -- output error, top-10 overlap and measured
  time of a compressed model; :func:`eps_sweep`, :func:`head_rank_sweep` -- rank sweeps
  compiled once; :mod:`~lowrank_jax.compress.frontier` -- every method at several strengths,
  measured, and the Pareto frontiers.

Adding a method is one module: the function, and one :func:`register_method` call that
declares its settings and its frontier candidates. Here a randomized range finder keeps about
``keep`` of each selected weight's parameters as low-rank factors ``W ~ Q (Q^T W)``, ``Q`` an
orthonormal basis of ``W @ Omega`` for a random ``Omega``::

    import jax
    import jax.numpy as jnp

    from lowrank_jax import LowRank, materialize
    from lowrank_jax.compress import Candidates, Row, register_method
    from lowrank_jax.compress.candidates import MLP
    from lowrank_jax.leaves import bias_of, replace_paths

    def sketch(params, selection, settings, ctx):
        new, rows = {}, []
        for i, sel in enumerate(selection):          # sel: path, node, overrides, rule
            s = {**settings, **sel.overrides}
            w = materialize(sel.node)                # [d_in, d_out]
            d_in, d_out = w.shape
            r = max(1, int(s["keep"] * d_in * d_out / (d_in + d_out)))
            omega = jax.random.normal(jax.random.fold_in(ctx.require_key(), i), (d_out, r))
            q, _ = jnp.linalg.qr(w @ omega)          # [d_in, r], orthonormal columns
            leaf = LowRank(u=q, v=q.T @ w, b=bias_of(sel.node))
            new[sel.path] = leaf
            rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule, kind="sketch"))
        return replace_paths(params, new), rows

    register_method("sketch", sketch, settings=("keep",), candidates=Candidates(
        groups=(("sketch mlp", MLP),),              # a candidate per group and strength
        settings=lambda setting, keep: {"keep": keep},
        label="keep={keep:g}"))

after which ``Step("sketch", ["mlp/"], {"keep": 0.5})`` works in any plan (``apply_plan(...,
key=key)``) and in JSON, and :func:`~lowrank_jax.compress.frontier.frontier` measures ``sketch
mlp keep=0.75``, ``keep=0.5`` and ``keep=0.25`` beside the built-in methods. A method on
query-key objects registers with ``selects="qk"`` and its rules match paths like
``'.../attn/qk'``. A method inside the package is imported by this file (importing its module
registers it); one defined elsewhere works in plans with no library change.
"""

# Importing a method's module registers the method; the frontier lists the methods' candidates
# in the order they are registered here.
# isort: off
from lowrank_jax.compress import svd_method as svd_method  # svd
from lowrank_jax.compress import prune as prune  # prune, lora
from lowrank_jax.compress import irregular as irregular  # truncatt, cp, btd, truncatt_vo
from lowrank_jax.compress.binarize import binarize_leaf  # binarize
from lowrank_jax.compress.factorize import factorize_init, reuse_weights  # factorize
from lowrank_jax.compress import partitioning  # partition, compress_keys
from lowrank_jax.compress import head_pruning  # prune_heads
from lowrank_jax.compress import quantize as quantize  # quantize
# isort: on
from lowrank_jax.compress.candidates import Combination
from lowrank_jax.compress.compose import materialize_leaves
from lowrank_jax.compress.evaluate import compare_models, sample_inputs, top_k_jaccard
from lowrank_jax.compress.irregular import (
    attention_macs,
    head_ranks,
    select_rank,
    to_query_key,
)
from lowrank_jax.compress.plan import Plan, Step, apply_plan, as_plan, validate_plan
from lowrank_jax.compress.registry import (
    Candidate,
    Candidates,
    CandidateSetting,
    Context,
    Method,
    get_method,
    register_candidates,
    register_method,
    registered_methods,
)
from lowrank_jax.compress.report import Report, Row, StepSummary
from lowrank_jax.compress.rules import (
    ATTENTION_QK,
    ATTENTION_QKV_PER_HEAD,
    ATTENTION_QKVO,
    Selection,
    normalize_rules,
    select,
)
from lowrank_jax.compress.schedules import (
    interpolation_schedule,
    power_schedule,
    uniform_schedule,
)
from lowrank_jax.compress.svd import (
    compare_truncations,
    head_truncated_svd,
    project_inputs,
    truncated_svd,
)
from lowrank_jax.compress.svd_method import compress
from lowrank_jax.compress.sweep import attention_blocks, eps_sweep, head_rank_sweep

__all__ = [
    "attention_macs", "head_ranks", "select_rank", "to_query_key",
    "ATTENTION_QK", "ATTENTION_QKVO", "ATTENTION_QKV_PER_HEAD", "Candidate", "CandidateSetting",
    "Candidates", "Combination", "Context", "Method", "Plan",
    "Report", "Row", "Selection", "Step", "StepSummary", "apply_plan", "as_plan",
    "attention_blocks", "binarize_leaf", "compare_models", "compare_truncations", "compress",
    "eps_sweep", "factorize_init", "get_method", "head_rank_sweep", "head_truncated_svd",
    "interpolation_schedule", "materialize_leaves", "normalize_rules",
    "head_pruning", "partitioning", "power_schedule", "project_inputs",
    "prune", "register_candidates", "register_method", "registered_methods", "reuse_weights",
    "sample_inputs", "select", "top_k_jaccard", "truncated_svd", "uniform_schedule",
    "validate_plan",
]


def __getattr__(name: str):
    if name == "partition":  # the partition method's package, renamed
        import importlib

        return importlib.import_module("lowrank_jax.compress.partition")  # warns
    raise AttributeError(f"module 'lowrank_jax.compress' has no attribute {name!r}")
