"""Every compression method on the decoder-only families, and exports of compressed models that
transformers reloads with the logits of the JAX compressed model."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax.compress import Plan, Step, apply_plan  # noqa: E402
from lowrank_jax.compress.prune import register_batches  # noqa: E402
from lowrank_jax.convert import load_pretrained, save_pretrained  # noqa: E402
from lowrank_jax.errors import PlanError  # noqa: E402
from lowrank_jax.leaves import materialize  # noqa: E402
from lowrank_jax.models import apply  # noqa: E402
from lowrank_jax.models.causal import positions_from_mask  # noqa: E402


def _tokens(config, *, batch_size, seed):
    def batches(j):
        rng = np.random.default_rng([seed, j])
        return {"input_ids": rng.integers(0, config.vocab_size, (batch_size, 8))}

    return batches


register_batches("lm_test_tokens", _tokens)
DATA = {"data": "lm_test_tokens", "batch_size": 4, "steps": 2}


@pytest.fixture(scope="module")
def llama(tmp_path_factory, lm):
    return lm.saved_lm(tmp_path_factory.mktemp("llama"), "llama", seed=0, vocab_size=41,
                       hidden_size=24, intermediate_size=20, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=6,
                       attention_bias=True)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, lm):
    return lm.saved_lm(tmp_path_factory.mktemp("gpt2"), "gpt2", seed=0, vocab_size=41,
                       n_positions=16, n_embd=24, n_layer=2, n_head=4)


def _inputs(vocab):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, vocab, (2, 9))
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask, np.asarray(positions_from_mask(mask))


def _exported_matches(cfg, params, out, cls):
    """Export, reload in transformers, compare logits with the JAX model's; the summary."""
    summary = save_pretrained(cfg, params, out)
    model = cls.from_pretrained(out).eval()
    ids, mask, pos = _inputs(cfg.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos)).logits.numpy()
    got = np.asarray(apply(params, {"input_ids": ids, "attention_mask": mask,
                                    "position_ids": pos}, cfg)["logits"])
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], ref[real], atol=1e-4, rtol=0)
    return summary, model


def test_per_head_svd_treats_each_shared_kv_head_once(llama):
    cfg, params = load_pretrained(llama)
    small, report = apply_plan(params, Step("svd", [r"attn/(qk/q|qk/k|v)$"],
                                            {"rank": 2, "per_head": True}), config=cfg)
    for path in ("layers/0/attn/qk/q", "layers/0/attn/qk/k"):
        w = np.asarray(materialize(_get(params, path)), np.float64)
        heads = w.shape[1] // 6
        want = []
        for h in range(heads):  # NumPy reference: rank-2 truncation of every head's slice
            u, sv, vt = np.linalg.svd(w[:, h * 6:(h + 1) * 6], full_matrices=False)
            want.append((u[:, :2] * sv[:2]) @ vt[:2])
        np.testing.assert_allclose(np.asarray(materialize(_get(small, path))),
                                   np.concatenate(want, axis=1), atol=1e-5)
    kinds = {r.path: r.kind for r in report.rows}
    assert kinds["layers/0/attn/qk/k"] == "svd-per-head"
    _exported_matches(cfg, small, llama.parent / "svd_out", transformers.LlamaForCausalLM)


def _get(tree, path):
    from lowrank_jax.leaves import get_path

    return get_path(tree, path)


@pytest.mark.parametrize("unit,rule", [("query", r"attn/o$"), ("group", r"attn/o$"),
                                       ("query", r"layers/0/attn/o$")])
def test_head_pruning_exports_smaller_when_equal_else_padded(llama, tmp_path, unit, rule):
    cfg, params = load_pretrained(llama)
    small, report = apply_plan(params, Step("prune_heads", [rule],
                                            {"target": 0.5, "unit": unit, **DATA}), config=cfg)
    counts = [(lp["attn"]["q_heads"].num_heads, lp["attn"]["kv_heads"].num_heads)
              for lp in small["layers"]]
    want = {("group", r"attn/o$"): [(3, 1), (3, 1)],
            ("query", r"attn/o$"): [(4, 2), (4, 2)],  # floor(0.5 * 3) of every group of 3
            ("query", r"layers/0/attn/o$"): [(4, 2), (6, 2)]}[unit, rule]
    assert counts == want
    summary, model = _exported_matches(cfg, small, tmp_path / "out",
                                       transformers.LlamaForCausalLM)
    if len(set(counts)) == 1:  # physically smaller: the config has the kept counts
        assert summary["widened"] == []
        assert (model.config.num_attention_heads, model.config.num_key_value_heads) == counts[0]
    else:  # zero-padded to the config, and said so
        assert summary["widened"] == ["layers/0/attn"]
        assert model.config.num_attention_heads == 6
    assert all(r.params_after < r.params_before for r in report.rows)


def test_head_pruning_across_layers_keeps_a_head_everywhere(llama):
    cfg, params = load_pretrained(llama)
    small, _ = apply_plan(params, Step("prune_heads", [r"attn/o$"],
                                       {"target": 0.9, "equal": False, **DATA}), config=cfg)
    kept = [lp["attn"]["q_heads"].num_heads for lp in small["layers"]]
    assert sum(kept) == 12 - 10 and min(kept) >= 1


def test_mlp_pruning_binarization_partitioning_compose_and_export(llama, tmp_path):
    cfg, params = load_pretrained(llama)
    plan = Plan((Step("prune", [r"layers/0/mlp/(wi_0|wi_1|wo)$"], {"target": 0.3, "steps": 2,
                                                          "batch_size": 4,
                                                          "data": "lm_test_tokens"}),
                 Step("svd", [r"layers/0/attn/(qk/q|v|o)$"], {"rank": 3}),
                 Step("prune_heads", [r"attn/o$"], {"target": 0.5, "unit": "group", **DATA}),
                 Step("binarize", [r"layers/1/mlp/wi_1$"], {"keep": 0.5}),
                 Step("partition", [r"layers/1/mlp/wo$"], {"machines": 2, "rank": 2})))
    small, _ = apply_plan(params, plan, config=cfg, key=jax.random.PRNGKey(0))
    summary, _ = _exported_matches(cfg, small, tmp_path / "out", transformers.LlamaForCausalLM)
    assert summary["materialized"]


def test_gpt2_irregular_attention_and_head_pruning_export(gpt2_dir, tmp_path):
    cfg, params = load_pretrained(gpt2_dir)
    plan = Plan((Step("truncatt", [r"attn/qk$"], {"rank": 3}),
                 Step("prune_heads", [r"attn/o$"], {"target": 0.5, **DATA}),
                 Step("prune", [r"mlp/(wi|wo)$"], {"target": 0.3, "steps": 2, "batch_size": 4,
                                                   "data": "lm_test_tokens"})))
    small, _ = apply_plan(params, plan, config=cfg)
    assert [lp["attn"]["heads"].num_heads for lp in small["layers"]] == [2, 2]
    summary, _ = _exported_matches(cfg, small, tmp_path / "out", transformers.GPT2LMHeadModel)
    assert summary["widened"]  # GPT-2's head width is n_embd / n_head: heads are zero-padded


@pytest.mark.parametrize("layers", [[0], [0, 1]])
def test_gpt2_mlp_pruning_exports_smaller_when_equal_else_padded(gpt2_dir, tmp_path, layers):
    """A quarter of the MLP channels of each of ``layers`` removed: equal widths are written
    smaller (``n_inner``), unequal ones zero-padded."""
    from lowrank_jax.compress.prune import add_channel_masks, remove_masked
    from lowrank_jax.leaves import with_channel_masks

    cfg, params = load_pretrained(gpt2_dir)
    rng, masks = np.random.default_rng(3), {}
    for i in layers:  # 24 random hidden channels of 96 switched off, then removed
        hid = np.ones(96, np.float32)
        hid[rng.choice(96, 24, replace=False)] = 0.0
        masks[f"layers/{i}/mlp/wi"] = (np.ones(24, np.float32), hid)
        masks[f"layers/{i}/mlp/wo"] = (hid, np.ones(24, np.float32))
    masked = with_channel_masks(add_channel_masks(params, [r"mlp/(wi|wo)$"]), masks)
    small = remove_masked(masked, config=cfg)
    widths = [int(materialize(lp["mlp"]["wo"]).shape[0]) for lp in small["layers"]]
    summary, model = _exported_matches(cfg, small, tmp_path / "out",
                                       transformers.GPT2LMHeadModel)
    if layers == [0, 1]:  # the config's n_inner is the kept width
        assert widths == [72, 72] and summary["widened"] == []
        assert model.config.n_inner == widths[0]
        assert tuple(model.transformer.h[1].mlp.c_proj.weight.shape) == (widths[0], 24)
    else:  # one n_inner for all layers: the narrower MLP is zero-padded, and said so
        assert widths == [72, 96] and model.config.n_inner is None
        assert summary["widened"] == ["layers/0/mlp"]


def test_query_key_methods_refuse_rotary_blocks(llama):
    cfg, params = load_pretrained(llama)
    with pytest.raises(PlanError, match="matches no"):
        apply_plan(params, Step("truncatt", [r"attn/qk$"], {"rank": 2}), config=cfg)


def test_frontier_candidates_of_head_pruning(llama):
    from lowrank_jax.compress.frontier import default_candidates

    cfg, params = load_pretrained(llama)
    cands, skipped = default_candidates(params, cfg, methods=["prune_heads", "truncatt"],
                                        strengths=[0.5], prune_data="lm_test_tokens",
                                        prune_steps=2, combinations=False)
    assert [c.name for c in cands] == ["prune_heads target=0.5"]
    assert "matches" in skipped["truncatt"]  # nothing to select in a rotary model
    small, _ = apply_plan(params, cands[0].plan, config=cfg)
    assert [lp["attn"]["q_heads"].num_heads for lp in small["layers"]] == [4, 4]
    _, skipped = default_candidates(params, cfg, methods=["prune_heads"], strengths=[0.5])
    assert "batches" in skipped["prune_heads"]  # no built-in text for a language model
