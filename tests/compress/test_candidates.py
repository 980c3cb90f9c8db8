"""Candidates in the method records (lowrank_jax.compress.candidates, registry): declared and
function candidates, the combinations table, the order of the built-in methods, the family's own
batches, and the renamed and deprecated names."""

import dataclasses
import importlib
import sys

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.compress import (
    Candidate,
    Candidates,
    Combination,
    Plan,
    Step,
    apply_plan,
    get_method,
    register_candidates,
    register_method,
    registry,
)
from lowrank_jax.compress.candidates import MLP, method_candidates
from lowrank_jax.compress.frontier import COMBINATIONS, default_candidates, pareto_front
from lowrank_jax.compress.prune import register_batches
from lowrank_jax.errors import NotApplicableError, PlanError, ShapeError
from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt, family, vit


@pytest.fixture
def own_registry(monkeypatch):
    """Methods registered in a test are gone after it."""
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))


def mlp_tree():
    key = jax.random.PRNGKey(0)
    return {"mlp": {"wi": lj.init_dense(key, 8, 16), "wo": lj.init_dense(key, 16, 8)}}


def tiny_bolt():
    t5 = T5Config(vocab_size=2, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                  num_heads=2)
    cfg = ChronosBoltConfig(t5=t5, context_length=32, prediction_length=8, input_patch_size=8,
                            input_patch_stride=8, use_reg_token=True)
    return cfg, chronos_bolt.init(jax.random.PRNGKey(0), cfg)


def _identity(params, selection, settings, ctx):
    return params, []


def test_declared_candidates_one_per_group_and_strength(own_registry):
    seen = []

    def settings(setting, keep):
        seen.append(keep)
        return {"level": round(2 * keep, 3)}

    register_method("toy", _identity, settings=("level",), candidates=Candidates(
        groups=(("toy mlp", MLP), ("toy attn", (r"attn/",))), settings=settings,
        label="level={level:g} removed={removed:g}"))
    cands, skipped = default_candidates(mlp_tree(), None, methods=["toy"], strengths=[0.3, 0.6])
    # the attention group selects nothing in this tree: only the MLP group gives candidates
    assert [c.name for c in cands] == ["toy mlp level=0.6 removed=0.7",
                                       "toy mlp level=1.2 removed=0.4"]
    assert [c.keep for c in cands] == [0.3, 0.6] and {c.group for c in cands} == {"toy mlp"}
    assert [c.plan for c in cands] == [Plan((Step("toy", MLP, {"level": 0.6}),)),
                                       Plan((Step("toy", MLP, {"level": 1.2}),))]
    assert seen == [0.3, 0.6] and skipped == {}


def test_declared_candidates_not_applicable(own_registry):
    def check(setting):
        if setting.config is None:
            raise NotApplicableError("needs a config")

    register_method("one", _identity, candidates=Candidates(
        groups=(("one", (r"attn/",)),), settings=lambda s, k: {}, label="k={strength:g}"))
    register_method("two", _identity, candidates=Candidates(
        groups=(("a", (r"attn/",)), ("b", (r"emb/",))), settings=lambda s, k: {}, label="",
        none="nothing to do here"))
    register_method("three", _identity, candidates=Candidates(
        groups=(("c", MLP),), settings=lambda s, k: {}, label="", check=check))
    cands, skipped = default_candidates(mlp_tree(), None, methods=["one", "two", "three"])
    assert cands == []
    # one group: the rules' own reason; several: the declared one; a failed check: its message
    assert skipped == {"one": "not applicable: no node this method accepts matches ['attn/']",
                       "two": "not applicable: nothing to do here",
                       "three": "not applicable: needs a config"}


def test_function_candidates_and_register_candidates(own_registry):
    def make(setting):
        if "mlp" not in setting.params:
            raise NotApplicableError("no MLP")
        return [Candidate(f"fn {k:g}", "fn", k, Plan((Step("fn", MLP, {}),)))
                for k in setting.strengths]

    register_method("fn", _identity)
    _, skipped = default_candidates(mlp_tree(), None, methods=["fn"])
    assert skipped == {"fn": "no candidate generator for this method (register_candidates)"}
    m = register_candidates("fn", make)
    assert get_method("fn") is m and m.candidates is make and m.fn is _identity
    cands, skipped = default_candidates(mlp_tree(), None, methods=["fn"], strengths=[0.5])
    assert [c.name for c in cands] == ["fn 0.5"] and skipped == {}
    _, skipped = default_candidates({"emb": mlp_tree()["mlp"]["wi"]}, None, methods=["fn"])
    assert skipped == {"fn": "not applicable: no MLP"}
    # a reason given at registration is replaced by the candidates
    register_method("why", _identity, no_candidates="it only adds parameters")
    assert default_candidates(mlp_tree(), None, methods=["why"])[1] == {
        "why": "it only adds parameters"}
    register_candidates("why", make)
    assert get_method("why").no_candidates is None


def test_register_candidates_errors(own_registry):
    with pytest.raises(PlanError, match="unknown compression method 'nope'"):
        register_candidates("nope", lambda s: [])
    register_method("x", _identity)
    with pytest.raises(PlanError, match="register_candidates: x: candidates must be"):
        register_candidates("x", 3)
    with pytest.raises(PlanError, match="register_candidates: x: fn must be"):
        register_candidates("x", None)
    with pytest.raises(PlanError, match="register_method: y: candidates must be"):
        register_method("y", _identity, candidates="svd")


def test_combinations_are_data(own_registry):
    cfg, params = tiny_bolt()
    combo = Combination("binarize mlp + svd mlp", (("binarize", MLP), ("svd", MLP)),
                        name="b {binarize[keep]:g} then s {svd[ratio]:g} of {strength:g}",
                        strengths=(0.4,))
    cands, _ = default_candidates(params, cfg, methods=["svd", "binarize"], strengths=[0.5],
                                  combinations=[combo])
    made = [c for c in cands if c.group == combo.group]
    assert [c.name for c in made] == ["b 0.4 then s 0.4 of 0.4"]
    assert made[0].plan == Plan((Step("binarize", MLP, {"keep": 0.4}),
                                 Step("svd", MLP, {"ratio": 0.4})))
    # the declared table: with every part available, each combination at each strength
    cands, _ = default_candidates(params, cfg, strengths=[0.5])
    for entry in COMBINATIONS:
        got = [c for c in cands if c.group == entry.group]
        assert len(got) == 1, entry.group
        assert [s.method for s in got[0].plan.steps] == [m for m, _ in entry.parts]
    # no combination without its parts, or with a part whose candidates are a function
    cands, _ = default_candidates(params, cfg, methods=["svd"], strengths=[0.5])
    assert not {c.group for c in cands} & {e.group for e in COMBINATIONS}
    register_candidates("binarize", lambda s: [])
    cands, _ = default_candidates(params, cfg, methods=["svd", "binarize"], strengths=[0.5],
                                  combinations=[combo])
    assert not [c for c in cands if c.group == combo.group]
    assert default_candidates(params, cfg, methods=["svd"], combinations=False)[0] == \
        default_candidates(params, cfg, methods=["svd"], combinations=())[0]


def test_built_in_candidates_in_registration_order():
    cfg, params = tiny_bolt()
    cands, _ = default_candidates(params, cfg, strengths=[0.5])
    groups = list(dict.fromkeys(c.group for c in cands))
    methods = list(dict.fromkeys(c.plan.steps[0].method for c in cands
                                 if len(c.plan.steps) == 1))
    assert methods == [m for m in registry.registered_methods()
                       if m in {"svd", "prune", "truncatt", "cp", "btd", "truncatt_vo",
                                "binarize", "quantize"}]
    assert methods == ["svd", "prune", "truncatt", "cp", "btd", "truncatt_vo", "binarize",
                       "quantize"]
    assert groups[-len(COMBINATIONS):] == [e.group for e in COMBINATIONS]


def test_method_candidates_of_a_record():
    cfg, params = tiny_bolt()
    from lowrank_jax.compress.candidates import CandidateSetting

    got = method_candidates(get_method("cp"), CandidateSetting(params, cfg, (0.5,)))
    # 2 heads of width 8: the total rank is round(0.5 * 2 * 8)
    assert [(c.name, c.plan.steps[0].settings) for c in got] == [("cp R=8", {"rank": 8})]


def test_family_batches_feed_prune(monkeypatch):
    """A family's own batches (its record's ``batches``) are what data='builtin' means."""
    cfg = vit.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                        num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                        num_labels=3)
    params = vit.init(jax.random.PRNGKey(0), cfg)
    _, skipped = default_candidates(params, cfg, methods=["prune"])
    assert "is not a forecaster" in skipped["prune"]

    calls = []

    def batches(config, *, batch_size, seed):
        assert config is cfg
        calls.append(("make", batch_size, seed))

        def batch(j):
            calls.append(j)
            rng = np.random.default_rng((seed, j))
            x = vit.sample_inputs(config, rng, batch_size)
            return {**x, "labels": rng.integers(0, 3, batch_size)}

        return batch

    monkeypatch.setattr(family, "_FAMILIES", dict(family._FAMILIES))
    family.register_family(dataclasses.replace(vit.FAMILY, batches=batches))
    cands, skipped = default_candidates(params, cfg, methods=["prune"], strengths=[0.5])
    assert [c.name for c in cands] == ["prune target=0.5"] and skipped == {}
    step = Step("prune", (r"mlp/(wi|wo)$",), {"target": 0.25, "steps": 3, "batch_size": 4,
                                              "seed": 5})
    new, rep = apply_plan(params, Plan((step,)), config=cfg)
    assert calls[0] == ("make", 4, 5) and calls[1:] == [0, 1, 2]
    assert lj.param_count(new) < lj.param_count(params)
    with pytest.raises(PlanError, match="'builtin' names the family's own batches"):
        register_batches("builtin", batches)


def test_not_applicable_is_a_plan_error_and_old_names_warn():
    assert issubclass(NotApplicableError, PlanError)
    import lowrank_jax.compress.frontier as fr

    with pytest.warns(DeprecationWarning, match="NotApplicableError"):
        assert fr.NotApplicable is NotApplicableError
    with pytest.warns(DeprecationWarning, match="no_candidates"):
        old = fr.NOT_CANDIDATES
    assert set(old) == {"lora", "factorize", "partition", "compress_keys"}
    assert old["lora"] == get_method("lora").no_candidates
    with pytest.raises(ShapeError, match="cost and loss must be 1-D of one length"):
        pareto_front([1.0, 2.0], [1.0])


def test_old_partition_path_warns_and_is_the_partitioning_package():
    from lowrank_jax.compress import partitioning
    from lowrank_jax.compress.partitioning import counts

    sys.modules.pop("lowrank_jax.compress.partition", None)
    with pytest.warns(DeprecationWarning, match="compress.partition is now "
                                                "lowrank_jax.compress.partitioning"):
        old = importlib.import_module("lowrank_jax.compress.partition")
    assert old.collective_bytes is partitioning.collective_bytes and old.counts is counts
    assert old.partition is partitioning.partition  # the method function
    from lowrank_jax.compress.partition.counts import executed

    assert executed is counts.executed
    assert lj.partition is not old.partition  # the tree function keeps its name
