"""Path rules: first match wins, None skips, unmatched rules and bad regexes raise PlanError."""

import logging

import jax
import pytest

from lowrank_jax.compress import ATTENTION_QK, ATTENTION_QKVO, select
from lowrank_jax.compress.rules import normalize_rules
from lowrank_jax.compress.svd import truncatable
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import QueryKey, init_dense, init_head_lowrank, init_lowrank, init_masked_binary
from lowrank_jax.nn import AttentionConfig, init_attention


def tree():
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    layers = []
    for _ in range(3):
        layers.append({
            "attn": init_attention(next(keys), AttentionConfig(), d_model=8, num_heads=2),
            "attn_norm": {"scale": jax.numpy.ones(8)},
            "mlp": {"wi": init_dense(next(keys), 8, 16), "wo": init_lowrank(next(keys), 16, 8, 2)},
        })
    return {
        "layers": layers,
        "embed": jax.numpy.zeros((10, 8)),  # a plain array: never selected
        "head": init_masked_binary(next(keys), 8, 4, 0.5),
        "dec": {"layers": [{
            "self_attn": init_attention(next(keys), AttentionConfig(), d_model=8, num_heads=2),
            "cross_attn": init_attention(next(keys), AttentionConfig(), d_model=8, num_heads=2),
            "hl": init_head_lowrank(next(keys), 8, 2, 4, 2)}]},
    }


def paths(sel):
    return [s.path for s in sel]


ATTN = ["qk/q", "qk/k", "v", "o"]


def test_default_rules_attention_only():
    sel = select(tree(), ATTENTION_QKVO)
    expected = [f"layers/{i}/attn/{n}" for i in range(3) for n in ATTN]
    expected += [f"dec/layers/0/{b}/{n}" for b in ("self_attn", "cross_attn") for n in ATTN]
    assert sorted(paths(sel)) == sorted(expected)
    assert all(s.overrides == {} for s in sel)
    assert all(s.rule == ATTENTION_QKVO[0] for s in sel)


def test_qk_objects_are_selectable():
    t = tree()
    sel = select(t, ATTENTION_QK, kind="qk")
    assert paths(sel) == ["dec/layers/0/cross_attn/qk", "dec/layers/0/self_attn/qk"] + [
        f"layers/{i}/attn/qk" for i in range(3)]
    assert all(isinstance(s.node, QueryKey) for s in sel)
    assert sel[2].node is t["layers"][0]["attn"]["qk"]
    # weight rules see no query-key objects, and qk rules no weights
    with pytest.raises(PlanError, match="matches no query-key object"):
        select(t, [r"attn/v$"], kind="qk")
    with pytest.raises(PlanError, match="matches no weight leaf"):
        select(t, [r"attn/qk$"])


def test_first_match_wins_and_none_skips():
    t = tree()
    rules = [
        (r"^layers/0/", None),
        (r"^layers/1/attn/qk/q$", {"rank": 2}),
        (r"attn/qk/q$", {"rank": 5}),
        (r"mlp/w", {"eps": 0.1}),
    ]
    sel = {s.path: s for s in select(t, rules)}
    assert not any(p.startswith("layers/0/") for p in sel)
    assert sel["layers/1/attn/qk/q"].overrides == {"rank": 2}
    assert sel["layers/2/attn/qk/q"].overrides == {"rank": 5}
    assert sel["dec/layers/0/self_attn/qk/q"].overrides == {"rank": 5}
    assert sel["layers/1/mlp/wo"].overrides == {"eps": 0.1}  # LowRank leaves are selectable
    assert sel["layers/1/mlp/wo"].node is t["layers"][1]["mlp"]["wo"]
    assert "layers/1/attn/qk/k" not in sel  # no rule matched it
    # overrides are copies: editing one does not change the rule
    sel["layers/2/attn/qk/q"].overrides["rank"] = 99
    assert rules[2][1] == {"rank": 5}


def test_plain_string_rule_and_single_rule_forms():
    t = tree()
    assert paths(select(t, r"mlp/wi$")) == [f"layers/{i}/mlp/wi" for i in range(3)]
    assert paths(select(t, (r"mlp/wi$", {"rank": 1}))) == [f"layers/{i}/mlp/wi"
                                                           for i in range(3)]


def test_rule_matching_nothing_raises():
    with pytest.raises(PlanError) as e:
        select(tree(), [r"attn/qk/q$", r"ffn/dense$"])
    msg = str(e.value)
    assert "ffn/dense$" in msg and "layers/0/attn/qk/q" in msg
    assert e.value.where == "ffn/dense$"
    # paths of non-selectable nodes do not count as matches: plain arrays, and leaves the
    # method does not accept (svd: binary leaves, whose signs are frozen)
    for rule in (r"embed", r"attn_norm"):
        with pytest.raises(PlanError, match="matches no"):
            select(tree(), [rule])
    with pytest.raises(PlanError, match="matches no"):
        select(tree(), [r"^head$"], accepts=truncatable)
    # a per-head factorized leaf is a weight like any other (re-truncation)
    assert paths(select(tree(), [r"hl$"], accepts=truncatable)) == ["dec/layers/0/hl"]


def test_shadowed_rule_is_not_an_error():
    sel = select(tree(), [r"attn/qk/q$", r"^layers/0/attn/qk/q$"])
    assert all(s.rule == r"attn/qk/q$" for s in sel)


def test_logging_names_rule(caplog):
    with caplog.at_level(logging.INFO, logger="lowrank_jax.compress.rules"):
        select(tree(), [(r"^layers/0/", None), r"attn/qk/q$"])
    text = caplog.text
    assert "layers/1/attn/qk/q" in text and "'attn/qk/q$'" in text
    assert "layers/0/attn/qk/q" in text and "skip" in text


@pytest.mark.parametrize("rules, bad", [
    ([(r"attn/v$", {"ranks": 3})], "ranks"),
    ([(r"attn/v$", 3)], "3"),
    ([42], "42"),
    ([r"attn/(q$"], "attn/(q$"),
])
def test_malformed_rules(rules, bad):
    with pytest.raises(PlanError) as e:
        normalize_rules(rules, allowed=("rank", "eps"))
    assert bad in str(e.value)


def test_bad_regex_names_the_rule():
    with pytest.raises(PlanError, match=r"rule 'attn/\(q\$' is not a valid regular expression"):
        select(tree(), [r"attn/v$", r"attn/(q$"])
