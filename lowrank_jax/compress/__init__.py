"""Surgery on parameter trees: one plan, applied in order, one report.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility" (sec. 5) and the methods to come plug into one entry point:

* :class:`Plan` / :class:`Step` -- a plan is data: steps of (method, path rules, settings),
  printable, comparable, saved as JSON (:meth:`Plan.to_json`, :meth:`Plan.from_file`).
* :func:`apply_plan` -- applies the steps in order to one tree (never mutating it) and returns
  the new tree and a :class:`Report` whose :class:`Row` s share one schema (path, method, rule,
  step, parameters / bits / FLOPs before and after, relative error, details).
* :func:`register_method` -- every method is a module with one function
  ``fn(params, selection, settings, ctx) -> (new_params, rows)`` and one registration.
  Built in: ``svd`` (:mod:`~lowrank_jax.compress.svd_method`: truncated SVD by eps / rank /
  ratio / schedule, per head, data-aware), ``factorize`` (:mod:`~lowrank_jax.compress.factorize`:
  compressed-by-design factors), ``binarize`` (:mod:`~lowrank_jax.compress.binarize`: Biprop
  masked-binary weights from trained ones) and the methods of the other papers; several
  methods compose in one plan (:mod:`~lowrank_jax.compress.compose`: what their order means).
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
  compiled once.

Adding a method (say ``prune``) is a new module ``lowrank_jax/compress/prune.py``::

    from lowrank_jax.compress.registry import register_method
    from lowrank_jax.compress.report import Row
    from lowrank_jax.leaves import keep_outputs, replace_paths

    def prune(params, selection, settings, ctx):
        new, rows = {}, []
        for sel in selection:                        # sel: path, node, overrides, rule
            s = {**settings, **sel.overrides}
            leaf = keep_outputs(sel.node, choose_channels(sel.node, s["keep"]))
            new[sel.path] = leaf
            rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule, kind="pruned"))
        return replace_paths(params, new), rows

    register_method("prune", prune, settings=("keep",))

plus its import in this file (importing a method module registers it). A method on
query-key objects registers with ``selects="qk"`` and its rules match paths like
``'.../attn/qk'``. A method defined outside the package registers the same way and works in
plans with no library change.
"""

from lowrank_jax.compress import partition  # the partition method (registers it)
from lowrank_jax.compress import prune as prune  # the prune and lora methods (registers them)
from lowrank_jax.compress.binarize import binarize_leaf  # the binarize method (registers it)
from lowrank_jax.compress.compose import materialize_leaves
from lowrank_jax.compress.evaluate import compare_models, sample_inputs, top_k_jaccard
from lowrank_jax.compress.factorize import factorize_init, reuse_weights
from lowrank_jax.compress.irregular import (  # truncatt, cp, btd, truncatt_vo (registers them)
    attention_macs,
    head_ranks,
    select_rank,
    to_query_key,
)
from lowrank_jax.compress.plan import Plan, Step, apply_plan, as_plan, validate_plan
from lowrank_jax.compress.registry import (
    Context,
    Method,
    get_method,
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
    "ATTENTION_QK", "ATTENTION_QKVO", "ATTENTION_QKV_PER_HEAD", "Context", "Method", "Plan",
    "Report", "Row", "Selection", "Step", "StepSummary", "apply_plan", "as_plan",
    "attention_blocks", "binarize_leaf", "compare_models", "compare_truncations", "compress",
    "eps_sweep", "factorize_init", "get_method", "head_rank_sweep", "head_truncated_svd",
    "interpolation_schedule", "materialize_leaves", "normalize_rules", "partition",
    "power_schedule", "project_inputs",
    "prune", "register_method", "registered_methods", "reuse_weights", "sample_inputs", "select",
    "top_k_jaccard", "truncated_svd", "uniform_schedule", "validate_plan",
]
