"""TruncAtt, CP-SlimAtt and IrrAtt plan methods ("Vision Transformer with Irregular Attention")
against NumPy, the paper's Table 1, converted Hugging Face models and the train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import models, nn
from lowrank_jax.compress import attention_macs, head_ranks, select_rank
from lowrank_jax.compress.irregular import attention_param_count
from lowrank_jax.errors import PlanError, ShapeError
from lowrank_jax.leaves import BTDQueryKey, CPQueryKey, Dense, QueryKey, augmented_joint, get_path

QK = (r"attn/qk$",)


def step(method, **settings):
    return lj.Plan((lj.Step(method, QK if method != "truncatt_vo" else (r"attn/v$",),
                            settings),))


# ---------------------------------------------------------------------------------------------
# The paper's counts: Table 1.

# (model, qk method, qk rank, vo rank, mlp rank) -> (MHSA FLOPs CR, FLOPs CR, params CR), in %
TABLE1 = [
    ("S", "truncatt", 16, 32, None, (37.5, 76.2, 79.9)),
    ("S", "truncatt", 22, 32, None, (42.2, 78.0, 81.4)),
    ("S", "truncatt", 32, 32, None, (50.0, 81.0, 83.9)),
    ("S", "cp", 96, 32, None, (50.3, 81.1, 79.9)),
    ("S", "cp", 132, 32, None, (59.7, 84.7, 81.4)),
    ("S", "cp", 192, 32, None, (75.5, 90.7, 84.0)),
    ("S", "btd", 96, 32, None, (38.5, 76.6, 79.9)),
    ("S", "btd", 132, 32, None, (43.1, 78.4, 81.4)),
    ("S", "btd", 192, 32, None, (51.0, 81.4, 83.9)),
    ("S", "dense", None, None, 152, (100.0, 69.4, 67.6)),
    ("S", "truncatt", 32, 32, 152, (50.0, 50.4, 51.5)),
    ("S", "cp", 192, 32, 152, (75.5, 60.1, 51.5)),
    ("S", "btd", 192, 32, 152, (51.0, 50.8, 51.5)),
    ("B", "truncatt", 13, 32, 304, (35.2, 44.7, 45.7)),
    ("B", "cp", 168, 32, 304, (49.7, 49.9, 46.0)),
    ("B", "btd", 168, 32, 304, (37.0, 45.4, 46.0)),
]


def deit_ratios(size, qk, rank, vo, mlp):
    """Whole-DeiT ratios as Table 1 counts them: 12 layers, N = 197 tokens, patch embedding
    196 x 768 x F and a 1000-class head; MLP ranks as two-factor SVD; biases, norms, tokens
    and positions in the parameter count."""
    f, h, d, n, layers = (384, 6, 64, 197, 12) if size == "S" else (768, 12, 64, 197, 12)
    kw = dict(d_model=f, num_heads=h, d_head=d)
    dense = attention_macs("dense", n_tokens=n, **kw)["total"]
    att = attention_macs(qk, rank, n_tokens=n, vo_rank=vo, **kw)["total"]
    mlp_d = 2 * n * f * 4 * f
    mlp_c = mlp_d if mlp is None else 2 * n * mlp * (f + 4 * f)
    other = 196 * 768 * f + f * 1000
    flops_cr = (layers * (att + mlp_c) + other) / (layers * (dense + mlp_d) + other)
    p_att_d = attention_param_count("dense", **kw)["total"] + 4 * d * h + f  # + q/k/v/o biases
    p_att = attention_param_count(qk, rank, vo_rank=vo, **kw)["total"] + f  # + output bias
    p_mlp_d = 2 * f * 4 * f + 5 * f
    p_mlp = p_mlp_d if mlp is None else 2 * mlp * 5 * f + 5 * f
    p_other = 768 * f + f + f + 197 * f + 2 * f + 1000 * f + 1000
    params_cr = (layers * (p_att + p_mlp + 4 * f) + p_other) / (
        layers * (p_att_d + p_mlp_d + 4 * f) + p_other)
    return 100 * att / dense, 100 * flops_cr, 100 * params_cr


@pytest.mark.parametrize("row", TABLE1, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}-{r[4]}")
def test_flops_formulas_reproduce_table1(row):
    size, qk, rank, vo, mlp, want = row
    got = deit_ratios(size, qk, rank, vo, mlp)
    np.testing.assert_allclose(got, want, atol=0.15)


def test_rank_selection_is_the_largest_rank_within_the_target():
    s = dict(n_tokens=197, d_model=384, num_heads=6, d_head=64, vo_rank=32)
    b = dict(n_tokens=197, d_model=768, num_heads=12, d_head=64, vo_rank=32)
    assert select_rank("truncatt", 0.375, **s) == 16  # the example
    # every row of Table 1: its rank is the largest within its MHSA FLOPs CR (as printed, to
    # the 0.05 point of rounding)
    for size, qk, rank, _vo, _, (mhsa, _, _) in TABLE1:
        if qk != "dense":
            assert select_rank(qk, (mhsa + 0.05) / 100, **(s if size == "S" else b)) == rank
    for qk, cr in (("truncatt", 0.42), ("cp", 0.6), ("btd", 0.45)):
        r = select_rank(qk, cr, **s)
        dense = attention_macs("dense", **{**s, "vo_rank": None})["total"]
        assert attention_macs(qk, r, **s)["total"] <= cr * dense
        assert attention_macs(qk, r + 1, **s)["total"] > cr * dense
    with pytest.raises(PlanError, match="flops_ratio=0.1"):
        select_rank("btd", 0.1, **s)


def test_truncatt_method_selects_the_paper_rank_on_a_deit_s_block():
    cfg = nn.AttentionConfig(use_bias=True)
    params = {"attn": nn.init_attention(jax.random.PRNGKey(0), cfg, d_model=384, num_heads=6)}
    new, rep = lj.apply_plan(params, step("truncatt", flops_ratio=0.375, n_tokens=197,
                                          vo_rank=32))
    row = rep.row("attn/qk")
    assert row.details["head_ranks"] == [16] * 6
    assert row.details["mhsa_flops_ratio"] == pytest.approx(0.375)
    assert isinstance(new["attn"]["qk"], QueryKey) and new["attn"]["qk"].widths == (16,) * 6


# ---------------------------------------------------------------------------------------------
# Small blocks against NumPy.

D_MODEL, HEADS = 16, 2


def biased_block(seed: int, d_model=D_MODEL, heads=HEADS):
    """An attention block with O(1) random weights and biases on all four projections."""
    r = np.random.default_rng(seed)

    def leaf(d_in, d_out):
        return Dense(w=jnp.asarray(r.normal(size=(d_in, d_out)) / np.sqrt(d_in), jnp.float32),
                     b=jnp.asarray(0.5 * r.normal(size=d_out), jnp.float32))

    dh = d_model // heads
    return {"qk": QueryKey(q=leaf(d_model, d_model), k=leaf(d_model, d_model),
                           widths=(dh,) * heads),
            "v": leaf(d_model, d_model), "o": leaf(d_model, d_model),
            "heads": lj.HeadLayout.uniform(heads, dh, 1 / np.sqrt(dh))}


def aug_slices(qk: QueryKey) -> np.ndarray:
    """``[W^Q_h; b^Q_h][W^K_h; b^K_h]^T`` per head, in NumPy."""
    def a(leaf):
        return np.concatenate([np.asarray(leaf.w, np.float64), np.asarray(leaf.b, np.float64)[None]])
    q, k = a(qk.q), a(qk.k)
    off = np.concatenate([[0], np.cumsum(qk.widths)])
    return np.stack([q[:, off[h]:off[h + 1]] @ k[:, off[h]:off[h + 1]].T
                     for h in range(len(qk.widths))], -1)


CFG = nn.AttentionConfig(use_bias=True)
X = jnp.asarray(np.random.default_rng(42).normal(size=(2, 6, D_MODEL)), jnp.float32)
attn_fn = jax.jit(lambda p, x: nn.apply_attention(p, x, CFG))


def test_truncatt_error_is_the_root_sum_of_discarded_singular_values():
    block = biased_block(1)
    y = aug_slices(block["qk"])
    new, rep = lj.apply_plan({"attn": block}, step("truncatt", rank=[3, 5]))
    sv = [np.linalg.svd(y[:, :, h], compute_uv=False) for h in range(HEADS)]
    want = np.sqrt(np.sum(sv[0][3:] ** 2) + np.sum(sv[1][5:] ** 2)) / np.linalg.norm(y)
    assert rep.row("attn/qk").error == pytest.approx(want, rel=1e-9)
    got = augmented_joint(new["attn"]["qk"])  # the factors really are that truncation
    assert np.linalg.norm(got - y) / np.linalg.norm(y) == pytest.approx(want, rel=1e-4)
    assert new["attn"]["qk"].widths == (3, 5)
    # full rank: the same logits (the original scale stays in the head layout)
    full, rep = lj.apply_plan({"attn": block}, step("truncatt", rank=8))
    assert rep.row("attn/qk").error < 1e-12
    np.testing.assert_allclose(np.asarray(lj.attention_logits(full["attn"]["qk"], X, X)),
                               np.asarray(lj.attention_logits(block["qk"], X, X)), atol=1e-5)
    assert full["attn"]["heads"] == block["heads"]


def test_drop_key_bias_keeps_attention_outputs():
    block = biased_block(2)
    full, _ = lj.apply_plan({"attn": block}, step("truncatt", rank=8, drop_key_bias=True))
    np.testing.assert_allclose(np.asarray(attn_fn(full["attn"], X)),
                               np.asarray(attn_fn(block, X)), atol=1e-5)
    assert full["attn"]["qk"].k.b is None  # nothing left of the key bias
    diff = np.asarray(lj.attention_logits(full["attn"]["qk"], X, X) -
                      lj.attention_logits(block["qk"], X, X))
    np.testing.assert_allclose(diff, np.broadcast_to(diff[..., :1], diff.shape), atol=1e-4)
    assert np.abs(diff).max() > 1e-2


def test_irratt_full_rank_and_cp_against_numpy():
    block = biased_block(3)
    y = aug_slices(block["qk"])
    new, rep = lj.apply_plan({"attn": block}, step("btd", ranks=[8, 8]))
    qk = new["attn"]["qk"]
    assert isinstance(qk, BTDQueryKey) and qk.ranks == (8, 8)
    np.testing.assert_allclose(np.asarray(qk.mix), np.eye(2), atol=1e-6)  # C = I stays
    np.testing.assert_allclose(np.asarray(attn_fn(new["attn"], X)), np.asarray(attn_fn(block, X)),
                               atol=1e-5)
    assert rep.row("attn/qk").error < 1e-10
    # CP at a lower rank: the row's error is the error of the factors in the tree
    new, rep = lj.apply_plan({"attn": block}, step("cp", rank=10))
    qk = new["attn"]["qk"]
    assert isinstance(qk, CPQueryKey) and qk.rank == 10
    err = np.linalg.norm(augmented_joint(qk) - y) / np.linalg.norm(y)
    assert rep.row("attn/qk").error == pytest.approx(err, rel=1e-4)
    assert sum(rep.row("attn/qk").details["head_ranks"]) == 10


def np_btd_logits(qk: BTDQueryKey, xq: np.ndarray, xk: np.ndarray) -> np.ndarray:
    """``sum_t C(h, t) (x_q A_t + a_t)(x_k B_t + b_t)^T`` from the factors, in NumPy:
    ``[batch, heads, q_len, k_len]``."""
    def coords(leaf, x):
        out = x @ np.asarray(leaf.w, np.float64)
        return out if leaf.b is None else out + np.asarray(leaf.b, np.float64)
    q, k = coords(qk.q, xq), coords(qk.k, xk)
    off = np.concatenate([[0], np.cumsum(qk.ranks)])
    terms = np.stack([q[..., off[t]:off[t + 1]] @ np.swapaxes(k[..., off[t]:off[t + 1]], -1, -2)
                      for t in range(len(qk.ranks))], 1)  # [b, T, q, k]
    return np.einsum("ht,btqk->bhqk", np.asarray(qk.mix, np.float64), terms)


@pytest.mark.parametrize("settings", [{"ranks": [0, 3, 6, 2]}, {"rank": 2}],
                         ids=["ranks", "algorithm1"])
def test_rank_zero_heads_attend_exactly_uniformly(settings):
    """A head of rank 0 (asked for, or left empty by Algorithm 1) gets constant logits: softmax
    is exactly uniform. ``rank0_uniform=False`` (Algorithm 3 as printed) lets the other terms
    reach it, and the row then claims no uniform head."""
    block = biased_block(6, d_model=32, heads=4)
    x = np.random.default_rng(9).normal(size=(2, 7, 32))
    new, rep = lj.apply_plan({"attn": block}, step("btd", **settings))
    qk = new["attn"]["qk"]
    uniform = rep.row("attn/qk").details["uniform_heads"]
    assert uniform == [h for h, r in enumerate(qk.ranks) if r == 0] and uniform
    want = np_btd_logits(qk, x, x)
    got = np.asarray(lj.attention_logits(qk, jnp.asarray(x, jnp.float32),
                                         jnp.asarray(x, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
    for h in uniform:
        lg = want[:, h]
        assert np.all(lg == lg[..., :1])  # constant along the keys for every query
        p = np.exp(lg - lg.max(-1, keepdims=True))
        np.testing.assert_array_equal(p / p.sum(-1, keepdims=True), np.full(lg.shape, 1 / 7))
        assert np.all(got[:, h] == got[:, h, :, :1])  # and so are the library's
    assert any(np.ptp(want[:, h], -1).max() > 0.1 for h in range(4) if h not in uniform)
    # Algorithm 3 as printed: the rank-0 heads get logits; the report says so
    free, rep = lj.apply_plan({"attn": block}, step("btd", rank0_uniform=False, **settings))
    fqk = free["attn"]["qk"]
    assert fqk.ranks == qk.ranks
    assert rep.row("attn/qk").details["uniform_heads"] == []
    spread = np_btd_logits(fqk, x, x)[:, uniform]
    assert np.ptp(spread, -1).max() > 1e-2


def test_truncatt_vo_against_numpy():
    block = biased_block(4)
    wv, wo = np.asarray(block["v"].w, np.float64), np.asarray(block["o"].w, np.float64)
    prods = [wv[:, 8 * h:8 * (h + 1)] @ wo[8 * h:8 * (h + 1)] for h in range(HEADS)]
    new, rep = lj.apply_plan({"attn": block}, step("truncatt_vo", rank=[2, 6]))
    sv = [np.linalg.svd(p, compute_uv=False) for p in prods]
    tail = np.sum(sv[0][2:] ** 2) + np.sum(sv[1][6:] ** 2)
    want = np.sqrt(tail / sum(np.sum(s ** 2) for s in sv))
    assert rep.row("attn/v").error == pytest.approx(want, rel=1e-9)
    assert rep.row("attn/o").error == pytest.approx(want, rel=1e-9)
    assert new["attn"]["heads"].v == (2, 6) and new["attn"]["heads"].scale == block["heads"].scale
    nv, no = np.asarray(new["attn"]["v"].w, np.float64), np.asarray(new["attn"]["o"].w, np.float64)
    np.testing.assert_allclose(nv[:, :2] @ no[:2], np.linalg.svd(prods[0])[0][:, :2] * sv[0][:2]
                               @ np.linalg.svd(prods[0])[2][:2], atol=1e-5)
    # full rank, value bias folded into the output bias: the same outputs
    full, _ = lj.apply_plan({"attn": block}, step("truncatt_vo", rank=8))
    assert float(jnp.abs(full["attn"]["v"].b).max()) == 0.0  # folded into the output bias
    np.testing.assert_allclose(np.asarray(attn_fn(full["attn"], X)), np.asarray(attn_fn(block, X)),
                               atol=1e-5)


def test_plan_errors_name_the_setting():
    params = {"attn": biased_block(5)}
    with pytest.raises(PlanError, match="exactly one of rank=, flops_ratio="):
        lj.apply_plan(params, step("cp", rank=4, flops_ratio=0.5, n_tokens=6))
    with pytest.raises(PlanError, match="flops_ratio needs n_tokens"):
        lj.apply_plan(params, step("truncatt", flops_ratio=0.5))
    with pytest.raises(PlanError, match="not the value projection"):
        lj.apply_plan(params, lj.Plan((lj.Step("truncatt_vo", ("attn/o$",), {"rank": 2}),)))
    with pytest.raises(PlanError, match="rank .the total rank R. must be an int >= 1"):
        lj.apply_plan(params, step("btd", rank=0))
    with pytest.raises(PlanError, match="rank0_uniform must be a bool"):
        lj.apply_plan(params, step("btd", rank=2, rank0_uniform="yes"))


# ---------------------------------------------------------------------------------------------
# Models: converted DeiT with biases (PyTorch reference), the other families, export.

def deit_hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeiTConfig(image_size=16, patch_size=8, num_channels=1, hidden_size=D_MODEL,
                                  num_hidden_layers=2, num_attention_heads=HEADS,
                                  intermediate_size=32, num_labels=3)
    model = transformers.DeiTForImageClassificationWithTeacher(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():  # O(1) weights and non-zero biases
            is_scale = p.ndim == 1 and "norm" in name.lower() and name.endswith("weight")
            p.copy_(1.0 + 0.15 * torch.randn(p.shape, generator=g) if is_scale
                    else 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def deit(tmp_path_factory):
    from lowrank_jax.convert import load_pretrained

    model = deit_hf()
    path = tmp_path_factory.mktemp("deit")
    model.save_pretrained(str(path))  # records the architecture (the head) in config.json
    cfg, params = load_pretrained(str(path))
    assert cfg.teacher_head and cfg.num_labels == 3
    return model, cfg, params


PIX = np.random.default_rng(7).normal(size=(2, 1, 16, 16)).astype(np.float32)
vit_apply = jax.jit(models.vit.apply, static_argnums=2)


def test_irratt_full_rank_in_a_converted_deit_gives_the_dense_logits(deit):
    import torch

    model, cfg, params = deit
    new, rep = lj.apply_plan(params, step("btd", ranks=[8, 8]))
    assert [r.kind for r in rep.rows] == ["btd", "btd"]
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(PIX)).logits.numpy()
    dense = np.asarray(vit_apply(params, {"pixel_values": PIX}, cfg)["logits"])
    got = np.asarray(vit_apply(new, {"pixel_values": PIX}, cfg)["logits"])
    np.testing.assert_allclose(dense, ref, atol=1e-4)
    np.testing.assert_allclose(got, dense, atol=1e-4)
    # block level, on the hidden states entering layer 1 (with q/k biases)
    h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, D_MODEL)), jnp.float32)
    for path in ("encoder/layers/0/attn/qk", "encoder/layers/1/attn/qk"):
        np.testing.assert_allclose(np.asarray(lj.attention_logits(get_path(new, path), h, h)),
                                   np.asarray(lj.attention_logits(get_path(params, path), h, h)),
                                   atol=1e-4)


def test_export_of_factorized_attention_is_exact_or_refused(deit, tmp_path):
    import torch
    import transformers

    from lowrank_jax.convert import save_pretrained

    _, cfg, params = deit
    plan = lj.Plan((lj.Step("btd", QK, {"ranks": [3, 8]}),
                    lj.Step("truncatt_vo", (r"attn/v$",), {"rank": [4, 2]})))
    small, _ = lj.apply_plan(params, plan)
    # after the sweeps the fusion matrix mixes the terms: a slice has rank 3 + 8 > d_head = 8,
    # which separate q/k weights cannot hold
    with pytest.raises(ShapeError, match="attn/qk.*BTDQueryKey.*ranks \\[11"):
        save_pretrained(cfg, small, tmp_path / "mixed")
    # with C = I (TruncAtt with irregular ranks) the export is exact
    diag = lj.leaves.replace_paths(small, {
        p: BTDQueryKey(q=n.q, k=n.k, mix=jnp.eye(2), ranks=n.ranks)
        for p, n in lj.compress.rules.candidates(small, "qk")})
    summary = save_pretrained(cfg, diag, tmp_path / "hf")
    assert "encoder/layers/0/attn/qk/q" in summary["materialized"]
    back = transformers.DeiTForImageClassificationWithTeacher.from_pretrained(
        tmp_path / "hf", **summary["load_kwargs"]).eval()
    with torch.no_grad():
        ref = back(pixel_values=torch.from_numpy(PIX)).logits.numpy()
    got = np.asarray(vit_apply(diag, {"pixel_values": PIX}, cfg)["logits"])
    np.testing.assert_allclose(got, ref, atol=1e-4)
    cp_model, _ = lj.apply_plan(params, step("cp", rank=10))
    with pytest.raises(ShapeError, match=r"encoder/layers/0/attn/qk.*CPQueryKey.*8 columns per "
                                         r"head.*ranks"):
        save_pretrained(cfg, cp_model, tmp_path / "cp")
    assert not (tmp_path / "cp").exists()


def tiny_models():
    from lowrank_jax.models import BertConfig, ChronosBoltConfig, T5Config

    t5 = dict(d_model=D_MODEL, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
              num_heads=HEADS, relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return [
        BertConfig(vocab_size=30, hidden_size=D_MODEL, num_hidden_layers=1,
                   num_attention_heads=HEADS, intermediate_size=32, max_position_embeddings=32),
        T5Config(vocab_size=24, **t5),
        ChronosBoltConfig(t5=T5Config(vocab_size=1, **t5), context_length=16, prediction_length=4,
                          input_patch_size=4, input_patch_stride=4),
    ]


def with_random_biases(params, seed: int = 0):
    """Non-zero biases on every projection that has one (BERT initialises them to zero); the
    augmented query-key tensors then have the same shape as those of :func:`biased_block`."""
    r = np.random.default_rng(seed)
    new = {p: Dense(w=leaf.w, b=jnp.asarray(0.5 * r.normal(size=leaf.b.shape), leaf.b.dtype))
           for p, leaf in lj.named_leaves(params)
           if isinstance(leaf, Dense) and leaf.b is not None}
    return lj.leaves.replace_paths(params, new)


@pytest.mark.parametrize("cfg", tiny_models(), ids=lambda c: type(c).__name__)
def test_other_families_full_rank_is_exact_and_cp_runs(cfg):
    """Every attention block (self- and cross-attention, with or without biases, scaled or
    not) is selected; at full rank the blocks compute what they computed; CP runs."""
    fam = models.family_of(cfg)
    params = with_random_biases(fam.init(jax.random.PRNGKey(0), cfg))
    plan = lj.Plan((lj.Step("btd", QK, {"ranks": [8, 8]}),
                    lj.Step("truncatt_vo", (r"attn/v$",), {"rank": 8})))
    new, rep = lj.apply_plan(params, plan)
    blocks = sorted(p.rsplit("/", 1)[0] for p, _ in lj.compress.rules.candidates(params, "qk"))
    assert sorted(r.path.rsplit("/", 1)[0] for r in rep.rows if r.kind == "btd") == blocks
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, D_MODEL)), jnp.float32)
    for b in blocks:  # (attn_fn: jitted; use_bias only matters at initialisation)
        want, got = attn_fn(get_path(params, b), x), attn_fn(get_path(new, b), x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    small, rep = lj.apply_plan(params, step("cp", rank=10))
    inputs = fam.sample_inputs(cfg, np.random.default_rng(0), 2)
    out = jax.jit(lambda p: models.apply(p, inputs, cfg))(small)
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree_util.tree_leaves(out))
    assert all(0 < r.error < 1 for r in rep.rows)


# ---------------------------------------------------------------------------------------------
# Fine-tuning the decomposed model, and the heat map.

def tiny_vit():
    from lowrank_jax.models import ViTConfig

    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=D_MODEL,
                    num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=32,
                    num_labels=3)
    return cfg, models.vit.init(jax.random.PRNGKey(3), cfg)


@pytest.fixture(scope="module")
def irregular_vit():
    cfg, params = tiny_vit()
    plan = lj.Plan((lj.Step("btd", QK, {"rank": 10}),
                    lj.Step("truncatt_vo", (r"attn/v$",), {"rank": 4})))
    new, rep = lj.apply_plan(params, plan, key=jax.random.PRNGKey(0))
    return cfg, new, rep


def btd_numpy_logits(qk, x):
    """Term by term from the unpadded factors (no padding anywhere)."""
    qw = np.asarray(lj.materialize(qk.q), np.float64)
    kw = np.asarray(lj.materialize(qk.k), np.float64)
    qb = np.zeros(qw.shape[1]) if lj.leaves.bias_of(qk.q) is None else np.asarray(lj.leaves.bias_of(qk.q))
    kb = np.zeros(kw.shape[1]) if lj.leaves.bias_of(qk.k) is None else np.asarray(lj.leaves.bias_of(qk.k))
    xs = np.asarray(x, np.float64)
    q, k = xs @ qw + qb, xs @ kw + kb
    off = np.concatenate([[0], np.cumsum(qk.ranks)])
    terms = np.stack([q[..., off[t]:off[t + 1]] @ np.swapaxes(k[..., off[t]:off[t + 1]], -1, -2)
                      for t in range(len(qk.ranks))], 1)  # [b, T, q, k]
    return np.einsum("ht,btqk->bhqk", np.asarray(qk.mix, np.float64), terms)


def test_fine_tuning_the_decomposed_vit_trains_the_factors_sharded_or_not(irregular_vit):
    """The existing train step trains the factors and the fusion matrices; padding never enters;
    a data/model-parallel step (placement from the leaves' logical axes, FSDP) equals the
    single-device one."""
    import optax
    from jax.sharding import Mesh

    from lowrank_jax import train

    cfg, params, rep = irregular_vit
    ranks = [r.details["head_ranks"] for r in rep.rows if r.kind == "btd"]
    assert all(sum(r) == 10 and max(r) <= 8 for r in ranks)  # capped at d_head
    rng = np.random.default_rng(0)
    batch = {"pixel_values": jnp.asarray(rng.normal(size=(8, 1, 8, 8)), jnp.float32),
             "labels": jnp.asarray(rng.integers(0, 3, size=8))}
    opt = optax.adam(1e-2)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    single = train.make_train_step(models.vit.loss(cfg), opt)
    sharded = train.make_train_step(models.vit.loss(cfg), opt, mesh=mesh,
                                    axis_rules={"out": "model"}, fsdp=True, fsdp_min_size=16)
    s1 = train.init_train_state(params, opt, key=jax.random.PRNGKey(0))
    s2 = train.init_train_state(params, opt, key=jax.random.PRNGKey(0))
    losses = []
    for _ in range(4):
        s1, m1 = single(s1, batch)
        s2, m2 = sharded(s2, batch)
        losses.append(float(m1["loss"]))
        np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(train.full_params(s1)),
                    jax.tree_util.tree_leaves(train.full_params(s2)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert losses[-1] < losses[0] and all(np.isfinite(losses))
    trained = train.full_params(s1)
    path = "encoder/layers/0/attn/qk"
    before, after = get_path(params, path), get_path(trained, path)
    assert isinstance(after, BTDQueryKey) and after.ranks == before.ranks
    for field in ("q", "k"):  # the factors and the fusion matrix all moved
        assert float(jnp.abs(lj.materialize(getattr(after, field)) -
                             lj.materialize(getattr(before, field))).max()) > 1e-4
    assert float(jnp.abs(after.mix - before.mix).max()) > 1e-4
    # the trained scores are those of the unpadded factors: padding never entered
    h = jnp.asarray(rng.normal(size=(2, 5, D_MODEL)), jnp.float32)
    np.testing.assert_allclose(np.asarray(lj.attention_logits(after, h, h)),
                               btd_numpy_logits(after, h), rtol=1e-4, atol=1e-4)


def test_heat_map_of_the_chosen_ranks(irregular_vit, tmp_path):
    pytest.importorskip("matplotlib")
    from lowrank_jax.analysis.plots_heads import head_rank_grid, plot_head_ranks

    _, _, rep = irregular_vit
    ranks = head_ranks(rep)
    assert list(ranks) == ["encoder/layers/0/attn/qk", "encoder/layers/1/attn/qk"]
    labels, grid = head_rank_grid(ranks)
    np.testing.assert_array_equal(grid, np.array([ranks[p] for p in labels], float))
    out = plot_head_ranks(ranks, str(tmp_path / "ranks.png"))
    assert (tmp_path / "ranks.png").stat().st_size > 1000 and out.endswith("ranks.png")
    from lowrank_jax.compress.irregular import save_head_rank_plot

    assert save_head_rank_plot(rep, str(tmp_path / "r2.png")) == str(tmp_path / "r2.png")
    svd_only, rep2 = lj.apply_plan(tiny_vit()[1], lj.Plan((lj.Step("svd", (r"mlp/",),
                                                                   {"rank": 2}),)))
    assert save_head_rank_plot(rep2, str(tmp_path / "none.png")) is None
