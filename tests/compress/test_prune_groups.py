"""The shared description of prunable structure (PruneGroup, Span, UnitTable) and the one
selection (select_removed) of the plan method and the Flax interop. References: a plain
unit-by-unit loop over the ranking (what the Flax interop computed before it shared the path),
a linear scan for the smallest count of units, and per-group groups and channel keeps written
out by hand for an encoder layer."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import nn
from lowrank_jax.compress.prune import (
    PruneGroup,
    Span,
    Structure,
    UnitTable,
    add_channel_masks,
    additive_fraction,
    mask_paths,
    select_removed,
)
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import init_head_lowrank, mask_partition, replace_paths


def loop_reference(scores, alive, cost, group, min_keep, goal):
    """Units in order of (score, index), each removed unless its group is down to
    ``min_keep`` alive units, until the removed cost reaches ``goal`` of the total."""
    left = np.bincount(group[alive], minlength=group.max() + 1)
    removed = cost[~alive].sum()
    out = []
    for u in sorted(np.flatnonzero(alive), key=lambda u: (scores[u], u)):
        if removed >= goal * cost.sum() - 1e-9:
            break
        if left[group[u]] > min_keep:
            out.append(u)
            left[group[u]] -= 1
            removed += cost[u]
    return out


def group_reference(scores, alive, group, min_keep, goal):
    """Every group ends with ``floor(goal * units)`` units removed, its lowest first."""
    out = []
    for g in range(group.max() + 1):
        units = np.flatnonzero(group == g)
        live = sorted((u for u in units if alive[u]), key=lambda u: (scores[u], u))
        k = min(len(live) - min_keep, math.floor(goal * units.size + 1e-9) - (~alive[units]).sum())
        out += live[:max(k, 0)]
    return sorted(out, key=lambda u: (scores[u], u))


@pytest.mark.parametrize("seed", range(6))
def test_select_removed_equals_the_unit_by_unit_loop(seed):
    g = np.random.default_rng(seed)
    n = 40
    scores = g.integers(0, 12, n).astype(np.float64)  # many ties: broken by unit index
    cost = g.integers(1, 9, n)
    group = np.sort(g.integers(0, 5, n))
    alive = g.random(n) > 0.2
    for min_keep in (0, 1, 2):
        for goal in (0.0, 0.15, 0.4, 0.75, 0.99):
            got = select_removed(scores, alive, goal=goal, fraction=additive_fraction(cost),
                                 unit_group=group, min_keep=min_keep)
            assert list(got) == loop_reference(scores, alive, cost, group, min_keep, goal)
            got = select_removed(scores, alive, goal=goal, unit_group=group, min_keep=min_keep,
                                 scope="group")
            assert list(got) == group_reference(scores, alive, group, min_keep, goal)


def test_select_removed_takes_the_fewest_units_of_any_growing_budget():
    g = np.random.default_rng(3)
    scores = g.random(30)
    alive = np.ones(30, bool)
    alive[[4, 9]] = False

    def fraction(a):  # not additive: a unit counts double once its neighbour is gone too
        gone = ~a
        return (gone.sum() + (gone[1:] & gone[:-1]).sum()) / 59

    for goal in (0.1, 0.3, 0.6):
        got = select_removed(scores, alive, goal=goal, fraction=fraction)
        order = [u for u in np.argsort(scores, kind="stable") if alive[u]]
        for k in range(len(order) + 1):  # the smallest count that reaches the goal
            trial = alive.copy()
            trial[order[:k]] = False
            if fraction(trial) >= goal - 1e-12:
                break
        assert list(got) == order[:k]
    # out of reach: every alive unit goes
    assert sorted(select_removed(scores, alive, goal=0.99, fraction=lambda a: 0.0)) == \
        list(np.flatnonzero(alive))
    with pytest.raises(ConfigError, match="scope") as e:
        select_removed(scores, alive, goal=0.5, fraction=fraction, scope="layer")
    assert e.value.where == "scope"
    with pytest.raises(ConfigError, match="fraction"):
        select_removed(scores, alive, goal=0.5)
    with pytest.raises(ShapeError, match="scores"):
        select_removed(scores[:-1], alive, goal=0.5, fraction=fraction)


def encoder_layer():
    cfg = nn.EncoderLayerConfig(attention=nn.AttentionConfig(), mlp=nn.MLPConfig("gelu"),
                                norm=nn.NormConfig())
    shapes = jax.eval_shape(lambda: nn.init_encoder_layer(
        jax.random.PRNGKey(0), cfg, d_model=16, sizes=nn.LayerSizes(4, 4, 32)))
    g = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda s: jnp.asarray(g.normal(size=s.shape), s.dtype),
                                    shapes)
    qk = params["attn"]["qk"]  # whole heads of queries: the q/k pairs go 4 channels at a time
    return replace_paths(params, {"attn/qk": dataclasses.replace(
        qk, q=init_head_lowrank(jax.random.PRNGKey(1), 16, 4, 4, 2))})


def test_structure_describes_its_blocks_as_groups():
    masked = add_channel_masks(encoder_layer(), (r"attn/(qk/q|qk/k|v|o)$", r"mlp/wi$"))
    s = Structure(masked)
    got = {(grp.name, grp.kind, grp.units, tuple((sp.path, sp.side, sp.size) for sp in grp.spans))
           for grp in s.groups}
    assert got == {
        ("attn/qk", "qk", 4, (("attn/qk/q", "out", 4), ("attn/qk/k", "out", 4))),
        ("attn/vo", "vo", 16, (("attn/v", "out", 1), ("attn/o", "in", 1))),
        ("mlp/hidden", "hidden", 32, (("mlp/wi", "out", 1), ("mlp/wo", "in", 1))),
        # residual-width sides: every member's side no block group spans, alone
        *((f"{p}/in", "residual", 16, ((p, "in", 1),))
          for p in ("attn/qk/q", "attn/qk/k", "attn/v", "mlp/wi")),
        *((f"{p}/out", "residual", 16, ((p, "out", 1),)) for p in ("attn/o", "mlp/wo")),
    }
    assert s.granularity("attn/qk/k") == (1, 4) and s.granularity("mlp/wo") == (1, 1)

    # the plan method's units: one per mask side, in the mask tree's order, in the group's unit
    paths = mask_paths(mask_partition(masked)[0])
    table = UnitTable.of_masks(s.groups, paths)
    assert table.labels == tuple(paths)
    want = {"attn/qk/q/m_out": 4, "attn/qk/k/m_out": 4, "attn/v/m_out": 16, "attn/o/m_in": 16,
            "mlp/wi/m_out": 32}
    assert table.counts == tuple(want.get(p, 16) for p in paths)
    assert table.sizes == tuple(4 if p.startswith("attn/qk/") and p.endswith("m_out") else 1
                                for p in paths)
    alive = np.ones(table.total, bool)
    q_out = paths.index("attn/qk/q/m_out")
    alive[table.offsets[q_out] + 2] = False  # the third query head
    assert table.label(table.offsets[q_out] + 2) == ["attn/qk/q/m_out", 2]
    keep = table.channel_keep(alive)
    np.testing.assert_array_equal(keep["attn/qk/q"][1], np.repeat([1, 1, 0, 1], 4).astype(bool))
    assert keep["attn/qk/q"][0].all() and keep["attn/qk/k"][1].all()
    # removal: the query channels go from the keys too (the pair's channels are shared)
    removal = s.removal(keep)
    np.testing.assert_array_equal(removal.qk["attn"], keep["attn/qk/q"][1])
    np.testing.assert_array_equal(removal.cols["attn/qk/k"], keep["attn/qk/q"][1])
    with pytest.raises(ShapeError, match="mlp/wx/m_in"):
        UnitTable.of_masks(s.groups, ["mlp/wx/m_in"])


def test_flax_style_groups_share_one_mask_over_spans_of_different_sizes():
    heads = PruneGroup("attn", (Span("q", "out", 8, 8 * 17), Span("v", "out", 4, 4 * 17),
                                Span("o", "in", 4, 4 * 16)), 3, kind="heads", min_keep=1)
    mlp = PruneGroup("mlp", (Span("a", "out", 1, 17), Span("b", "in", 1, 16)), 5)
    table = UnitTable.of_groups([heads, mlp])
    assert (table.labels, table.counts, table.sizes) == (("attn", "mlp"), (3, 5), (1, 1))
    np.testing.assert_array_equal(table.unit_group, [0, 0, 0, 1, 1, 1, 1, 1])
    alive = np.array([1, 0, 1, 1, 1, 0, 1, 0], bool)
    keep = table.channel_keep(alive)
    np.testing.assert_array_equal(keep["q"][1], np.repeat([1, 0, 1], 8).astype(bool))
    np.testing.assert_array_equal(keep["o"][0], np.repeat([1, 0, 1], 4).astype(bool))
    assert keep["q"][0] is None and keep["o"][1] is None
    np.testing.assert_array_equal(keep["b"][0], [1, 1, 0, 1, 0])
    assert heads.cost == 8 * 17 + 4 * 17 + 4 * 16
    fraction = additive_fraction(np.repeat([heads.cost, mlp.cost], table.counts))
    assert fraction(alive) == pytest.approx((heads.cost + 2 * mlp.cost) / (3 * heads.cost +
                                                                          5 * mlp.cost))
    with pytest.raises(ConfigError, match="side"):
        Span("q", "rows")
    with pytest.raises(ConfigError, match="size"):
        Span("q", "in", 0)
