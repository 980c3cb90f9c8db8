"""Path rules: first match wins, None skips, unmatched rules raise."""

import logging

import jax
import pytest

from lowrank_jax.compress import ATTENTION_QKVO, select
from lowrank_jax.compress.rules import normalize_rules
from lowrank_jax.leaves import init_dense, init_head_lowrank, init_lowrank, init_masked_binary


def tree():
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    layers = []
    for _ in range(3):
        layers.append({
            "attn": {n: init_dense(next(keys), 8, 8) for n in "qkvo"},
            "attn_norm": {"scale": jax.numpy.ones(8)},
            "mlp": {"wi": init_dense(next(keys), 8, 16), "wo": init_lowrank(next(keys), 16, 8, 2)},
        })
    return {
        "layers": layers,
        "embed": jax.numpy.zeros((10, 8)),  # a plain array: never selected
        "head": init_masked_binary(next(keys), 8, 4, 0.5),
        "dec": {"layers": [{"self_attn": {"q": init_dense(next(keys), 8, 8)},
                            "cross_attn": {"k": init_dense(next(keys), 8, 8)},
                            "hl": init_head_lowrank(next(keys), 8, 2, 4, 2)}]},
    }


def paths(sel):
    return [s.path for s in sel]


def test_default_rules_attention_only():
    sel = select(tree(), ATTENTION_QKVO)
    expected = [f"layers/{i}/attn/{n}" for i in range(3) for n in "kovq"]
    assert sorted(paths(sel)) == sorted(expected + ["dec/layers/0/self_attn/q",
                                                     "dec/layers/0/cross_attn/k"])
    assert all(s.overrides == {} for s in sel)
    assert all(s.rule == ATTENTION_QKVO[0] for s in sel)


def test_first_match_wins_and_none_skips():
    t = tree()
    rules = [
        (r"^layers/0/", None),
        (r"^layers/1/attn/q$", {"rank": 2}),
        (r"attn/q$", {"rank": 5}),
        (r"mlp/w", {"eps": 0.1}),
    ]
    sel = {s.path: s for s in select(t, rules)}
    assert not any(p.startswith("layers/0/") for p in sel)
    assert sel["layers/1/attn/q"].overrides == {"rank": 2}
    assert sel["layers/2/attn/q"].overrides == {"rank": 5}
    assert sel["dec/layers/0/self_attn/q"].overrides == {"rank": 5}
    assert sel["layers/1/mlp/wo"].overrides == {"eps": 0.1}  # LowRank leaves are selectable
    assert sel["layers/1/mlp/wo"].leaf is t["layers"][1]["mlp"]["wo"]
    assert "layers/1/attn/k" not in sel  # no rule matched it
    # overrides are copies: editing one does not change the rule
    sel["layers/2/attn/q"].overrides["rank"] = 99
    assert rules[2][1] == {"rank": 5}


def test_plain_string_rule_and_single_rule_forms():
    t = tree()
    assert paths(select(t, r"mlp/wi$")) == [f"layers/{i}/mlp/wi" for i in range(3)]
    assert paths(select(t, (r"mlp/wi$", {"rank": 1}))) == [f"layers/{i}/mlp/wi"
                                                           for i in range(3)]


def test_rule_matching_nothing_raises():
    with pytest.raises(ValueError) as e:
        select(tree(), [r"attn/q$", r"ffn/dense$"])
    msg = str(e.value)
    assert "ffn/dense$" in msg and "layers/0/attn/q" in msg
    # paths of non-selectable nodes do not count as matches
    for rule in (r"embed", r"^head$", r"hl$", r"attn_norm"):
        with pytest.raises(ValueError, match="matches no"):
            select(tree(), [rule])


def test_shadowed_rule_is_not_an_error():
    sel = select(tree(), [r"attn/q$", r"^layers/0/attn/q$"])
    assert all(s.rule == r"attn/q$" for s in sel)


def test_logging_names_rule(caplog):
    with caplog.at_level(logging.INFO, logger="lowrank_jax.compress.rules"):
        select(tree(), [(r"^layers/0/", None), r"attn/q$"])
    text = caplog.text
    assert "layers/1/attn/q" in text and "'attn/q$'" in text
    assert "layers/0/attn/q" in text and "skip" in text


@pytest.mark.parametrize("rules, bad", [
    ([(r"attn/q$", {"ranks": 3})], "ranks"),
    ([(r"attn/q$", 3)], "3"),
    ([42], "42"),
    ([r"attn/(q$"], "attn/(q$"),
])
def test_malformed_rules(rules, bad):
    with pytest.raises(ValueError) as e:
        normalize_rules(rules)
    assert bad in str(e.value)
