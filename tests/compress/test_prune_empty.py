"""Layers with no attention heads, no MLP channels, or neither (only the residual left).

Structured pruning may remove every head of an attention block or every hidden channel of an
MLP. Those are valid states: a block with no heads adds its output projection's bias (if any),
an MLP with no hidden channels adds its output bias, and a layer with neither leaves the
residual stream to its norms. Checked here:

* every leaf type keeps no input or no output channel (``keep_inputs`` / ``keep_outputs`` of an
  empty list): NumPy outputs, and counts that hold only what can still matter;
* attention without heads (``nn.keep_heads(block, [])``: plain, relative bias and per-head
  masks over the original heads, cross-attention, cached decoding) and an MLP without hidden
  channels (``nn.keep_hidden``) for every leaf type, against the output bias in NumPy;
* every family (T5 v1.0 / v1.1, Chronos, Chronos-Bolt, ViT, DeiT, BERT, the SBT in two tasks,
  the patch encoder): one layer per stack loses every head and MLP channel, one every head,
  one every MLP channel, pruned physically (``remove_masked``) and by surgery
  (``nn.keep_heads`` / ``nn.keep_hidden``); both equal the masked model, the emptied layer of
  every stack leaves the residual (NumPy), counts are what the removal plan counted;
* the same on BERT for every prunable leaf type; export to the PyTorch classes, greedy
  decoding, pruning again, and the ``analyze --sweep-heads`` command on an emptied model;
* every compression method of a plan on an emptied T5 and BERT (and the leaf types each
  takes): the emptied blocks' nodes pass unchanged with a row of kind ``'empty'``, the others
  equal what the same step makes of the model before pruning (and NumPy's truncated SVD for
  ``svd``), the model runs, equal to the emptied model where the method is exact; ``svd``'s
  ratio holds with the emptied weights counted as fixed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import leaves as lv
from lowrank_jax import models, nn
from lowrank_jax.compress import attention_blocks, head_rank_sweep, select
from lowrank_jax.compress.prune import (
    add_channel_masks,
    find_blocks,
    remove_masked,
    token_counts,
)
from lowrank_jax.leaves import channel_masks, get_path, replace_paths, with_channel_masks
from lowrank_jax.leaves.channel_masked import kept_counts, surgery_form
from lowrank_jax.models import (
    BertConfig,
    ChronosBoltConfig,
    ChronosConfig,
    PatchEncoderConfig,
    SBTConfig,
    T5Config,
    ViTConfig,
)

jax.config.update("jax_default_matmul_precision", "highest")

BLOCK_TOL, MODEL_TOL = 1e-5, 1e-4
D_IN, D_OUT, HEADS = 8, 6, 3  # a HeadLowRank leaf [8, 6]: 3 heads of 2 outputs


def f32(seed, *shape):
    return (0.5 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Leaves.

LEAF_KINDS = ["dense", "lowrank", "head_lowrank", "masked_binary", "frozen_binary",
              "packed_binary", "channel_masked", "channel_pruned", "fixed_bias", "lora"]
BINARY = {"masked_binary", "frozen_binary", "packed_binary", "fixed_bias"}  # they keep a gain


def make_leaf(kind: str, d_in: int = D_IN, d_out: int = D_OUT, *, seed: int = 0,
              bias: bool = True, heads: int = HEADS):
    """``(leaf, b)``: a leaf of ``kind`` of shape ``[d_in, d_out]`` drawn with NumPy and its
    bias as NumPy ``[d_out]`` (zeros without one)."""
    b = f32(seed + 1, d_out) if bias else None
    bj = None if b is None else jnp.asarray(b)
    w = f32(seed, d_in, d_out)
    if kind == "dense":
        leaf = lv.Dense(jnp.asarray(w), bj)
    elif kind == "lowrank":
        leaf = lv.LowRank(jnp.asarray(f32(seed, d_in, 3)), jnp.asarray(f32(seed + 2, 3, d_out)), bj)
    elif kind == "head_lowrank":
        leaf = lv.HeadLowRank(jnp.asarray(f32(seed, d_in, heads, 2)),
                              jnp.asarray(f32(seed + 2, heads, 2, d_out // heads)), bj,
                              ranks=(2, 1) + (2,) * (heads - 2))
    elif kind in ("masked_binary", "frozen_binary", "packed_binary"):
        leaf = lv.MaskedBinary(jnp.asarray(w), jnp.asarray(f32(seed + 3, d_in, d_out)), bj,
                               keep=0.5)
        if kind == "frozen_binary":
            leaf = leaf.freeze()
        elif kind == "packed_binary":
            leaf = lv.PackedBinary.from_leaf(leaf)
    elif kind == "channel_masked":
        leaf = lv.mask_leaf(lv.Dense(jnp.asarray(w), bj))
    elif kind == "channel_pruned":  # a residual-width weight that lost its first input/output
        base = lv.Dense(jnp.asarray(w[1:, 1:]), None if b is None else jnp.asarray(b[1:]))
        leaf = lv.pruned_leaf(base, tuple(range(1, d_in)), tuple(range(1, d_out)), d_in, d_out)
        b = None if b is None else np.concatenate([[0.0], b[1:]]).astype(np.float32)
    elif kind == "fixed_bias":  # the SBT's attention projections
        inner = lv.MaskedBinary(jnp.asarray(w), jnp.asarray(f32(seed + 3, d_in, d_out)), None,
                                keep=0.5)
        leaf = lv.FixedBias(inner, bj if bj is not None else jnp.zeros((d_out,)))
    elif kind == "lora":
        leaf = lv.LoRA(base=lv.Dense(jnp.asarray(w), bj), a=jnp.asarray(f32(seed + 4, d_in, 2)),
                       b=jnp.asarray(f32(seed + 5, 2, d_out)), scale=0.5)
    else:
        raise AssertionError(kind)
    return leaf, (np.zeros(d_out, np.float32) if b is None else b)


def stored_bias(kind: str, b: np.ndarray) -> int:
    """Parameters a leaf stores for its bias (a ChannelPruned leaf stores its kept outputs')."""
    return b.size - 1 if kind == "channel_pruned" else b.size


lin = jax.jit(lv.linear)


@pytest.mark.parametrize("side", ["inputs", "outputs"])
@pytest.mark.parametrize("kind", LEAF_KINDS)
def test_leaf_keeps_no_channels(kind, side):
    leaf, b = make_leaf(kind)
    x = f32(9, 5, D_IN)
    none = []  # a plain empty list: float64 to NumPy, still a valid selection
    if side == "inputs":
        kept = lv.keep_inputs(leaf, none)
        y = np.asarray(lin(kept, jnp.asarray(x[:, :0])))
        want = np.broadcast_to(b, (5, D_OUT))  # no inputs: the bias alone
        params = stored_bias(kind, b)
        rows, cols = np.zeros(D_IN, bool), np.ones(D_OUT, bool)
    else:
        kept = lv.keep_outputs(leaf, none)
        y = np.asarray(lin(kept, jnp.asarray(x)))
        want = np.zeros((5, 0), np.float32)
        params = 0
        rows, cols = np.ones(D_IN, bool), np.zeros(D_OUT, bool)
    assert kept.shape == ((0, D_OUT) if side == "inputs" else (D_IN, 0))
    np.testing.assert_allclose(y, want, atol=BLOCK_TOL)
    assert np.asarray(lv.materialize(kept)).shape == kept.shape
    # Only what can still matter is stored: the bias, and a binary leaf's gain (factors that
    # could only multiply zeros are gone); nothing is multiplied.
    assert kept.param_count() == params + (kind in BINARY)
    assert kept.flops(5) == 0
    # The pruning schedule's counts without slicing agree with the sliced leaf.
    assert kept_counts(surgery_form(leaf), rows, cols, 5) == (kept.param_count(), 0)


# ---------------------------------------------------------------------------------------------
# Blocks.

BLOCK_KINDS = ["dense", "lowrank", "head_lowrank", "masked_binary", "packed_binary",
               "channel_masked", "fixed_bias", "lora"]
D, DH = 12, 4  # 3 heads of 4


def attention_block(kind: str, d_kv: int = D) -> dict:
    """An attention block whose q, k, v and o are ``kind`` leaves with biases (o is Dense for
    a HeadLowRank block: its outputs are not heads)."""
    def leaf(seed, d_in, d_out, k=kind):
        return make_leaf(k, d_in, d_out, seed=seed, heads=HEADS)[0]

    o_kind = "dense" if kind == "head_lowrank" else kind
    return {"qk": lv.QueryKey(q=leaf(10, D, HEADS * DH), k=leaf(20, d_kv, HEADS * DH),
                              widths=(DH,) * HEADS),
            "v": leaf(30, d_kv, HEADS * DH), "o": leaf(40, HEADS * DH, D, o_kind),
            "heads": lv.HeadLayout.uniform(HEADS, DH, 0.5)}


def o_bias(kind: str) -> np.ndarray:
    return make_leaf("dense" if kind == "head_lowrank" else kind, HEADS * DH, D, seed=40)[1]


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_attention_without_heads_adds_its_output_bias(kind):
    cfg = nn.AttentionConfig(use_bias=True)
    block = attention_block(kind)
    empty = nn.keep_heads(block, [])
    assert empty["heads"].num_heads == 0 and empty["heads"].scale == 0.5
    want = o_bias(kind)
    x, kv = jnp.asarray(f32(1, 2, 5, D)), jnp.asarray(f32(2, 2, 7, D))
    rb = nn.RelativeBiasConfig(num_buckets=8, max_distance=20)
    table = jnp.asarray(f32(3, 8, HEADS))  # over the model's original heads
    bias = nn.relative_bias(table, 5, 5, rb)  # [1, 3, 5, 5]
    mask = jnp.asarray(np.random.default_rng(4).random((2, HEADS, 5, 5)) > 0.3)
    run = jax.jit(lambda p, x, kv, bias, mask: nn.apply_attention(p, x, cfg, kv=kv, bias=bias,
                                                                  mask=mask))
    outs = {
        "self": run(empty, x, None, bias, mask),
        "plain": run(empty, x, None, None, None),
        "cross, one query": run(empty, x[:, :1], kv, None, None),
    }
    cache = nn.init_attention_cache(empty, 2, 6)
    outs["cached self"], _ = nn.apply_attention_cached(empty, x[:, :2], cfg, cache, index=0)
    outs["cached cross"], _ = nn.apply_attention_cached(empty, x[:, :1], cfg,
                                                        nn.attention_cache(empty, kv))
    for what, y in outs.items():
        np.testing.assert_allclose(np.asarray(y), np.broadcast_to(want, y.shape),
                                   atol=BLOCK_TOL, err_msg=what)
    # counts: no score products, no multiply-adds; the output bias (and binary gains) stays
    assert nn.attention_score_flops(empty, 5, 7) == 0
    assert lj.flops(empty, 5) == 0
    gains = 4 if kind in BINARY else 0
    assert lj.param_count(empty) == want.size + gains


@pytest.mark.parametrize("qk_kind", ["cp", "btd"])
def test_factored_query_key_without_heads(qk_kind):
    """A CP / BTD query-key object keeps no head: the block adds its output bias, and the
    factors only heads would read are gone."""
    rank = 4
    q, k = lv.Dense(jnp.asarray(f32(1, D, rank))), lv.Dense(jnp.asarray(f32(2, D, rank)))
    if qk_kind == "cp":
        qk = lv.CPQueryKey(q=q, k=k, mix=jnp.asarray(f32(3, HEADS, rank)))
    else:
        qk = lv.BTDQueryKey(q=q, k=k, mix=jnp.asarray(f32(3, HEADS, 2)), ranks=(2, 2))
    block = {"qk": qk, "v": make_leaf("dense", D, HEADS * DH, seed=4)[0],
             "o": make_leaf("dense", HEADS * DH, D, seed=5)[0],
             "heads": lv.HeadLayout.uniform(HEADS, DH, 0.5)}
    empty = nn.keep_heads(block, [])
    x = jnp.asarray(f32(6, 2, 5, D))
    y = np.asarray(nn.apply_attention(empty, x, nn.AttentionConfig()))
    np.testing.assert_allclose(y, np.broadcast_to(make_leaf("dense", HEADS * DH, D, seed=5)[1],
                                                  y.shape), atol=BLOCK_TOL)
    assert nn.attention_score_flops(empty, 5, 5) == 0
    assert lj.flops(empty, 5) == 0 and lj.param_count(empty) == D  # the output bias


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_mlp_without_hidden_channels_adds_its_output_bias(kind, gated):
    d_ff = 9  # three "heads" of 3 for a HeadLowRank input projection
    names = ("wi_0", "wi_1") if gated else ("wi",)
    mlp = {n: make_leaf(kind, D, d_ff, seed=10 + i)[0] for i, n in enumerate(names)}
    wo, want = make_leaf("dense" if kind == "head_lowrank" else kind, d_ff, D, seed=20)
    mlp["wo"] = wo
    empty = nn.keep_hidden(mlp, [])
    x = jnp.asarray(f32(1, 2, 5, D))
    for act in ("relu", "gelu", "silu"):
        cfg = nn.MLPConfig(activation=act, gated=gated)
        y = np.asarray(jax.jit(lambda p, x, cfg=cfg: nn.apply_mlp(p, x, cfg))(empty, x))
        np.testing.assert_allclose(y, np.broadcast_to(want, y.shape), atol=BLOCK_TOL)
    assert lj.flops(empty, 5) == 0
    gains = (len(names) + 1) * (kind in BINARY)
    assert lj.param_count(empty) == want.size + gains


def test_head_rank_sweep_of_a_block_without_heads():
    empty = nn.keep_heads(attention_block("dense"), [])
    err = head_rank_sweep(empty, jnp.asarray(f32(1, 2, 5, D)), None, [0, 1, 2])
    assert err.shape == (0, 3)


# ---------------------------------------------------------------------------------------------
# Every family.

_T5 = dict(vocab_size=40, d_model=16, d_kv=4, d_ff=12, num_layers=3, num_decoder_layers=2,
           num_heads=3, relative_attention_num_buckets=8, relative_attention_max_distance=20)
_SBT = dict(n_features=3, window=8, d_model=12, num_heads=3, d_ff=12, num_layers=3)
FAMILIES = {
    "t5_v1.0": T5Config(**_T5, feed_forward_proj="relu"),
    "t5_v1.1": T5Config(**_T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "chronos": ChronosConfig(t5=T5Config(**{**_T5, "vocab_size": 50}), n_tokens=50,
                             context_length=16, prediction_length=4),
    "chronos_bolt": ChronosBoltConfig(t5=T5Config(**{**_T5, "vocab_size": 2}), context_length=32,
                                      prediction_length=8, input_patch_size=8,
                                      input_patch_stride=8, use_reg_token=True),
    "vit": ViTConfig(image_size=8, patch_size=4, hidden_size=12, num_hidden_layers=3,
                     num_attention_heads=3, intermediate_size=12, num_labels=3),
    "deit": ViTConfig(image_size=8, patch_size=4, hidden_size=12, num_hidden_layers=3,
                      num_attention_heads=3, intermediate_size=12, num_labels=3,
                      distillation=True, pooler=False),
    "bert": BertConfig(vocab_size=40, hidden_size=12, num_hidden_layers=3, num_attention_heads=3,
                       intermediate_size=12, max_position_embeddings=40, num_labels=2),
    "sbt_binary_anomaly": SBTConfig(**_SBT, task="anomaly", binary=True),
    "sbt_dense_classification": SBTConfig(**_SBT, task="classification", n_classes=3,
                                          binary=False),
    "patch_encoder": PatchEncoderConfig(patch=4, d_model=12, num_heads=3, d_ff=12, num_layers=3,
                                        embed_hidden=8),
}
#: layer ``i`` of every stack loses: 0 everything, 1 every head, 2 every MLP channel
EMPTIED = ("both", "heads", "mlp")


def fast_init(fam, cfg, seed: int = 0):
    """Random parameters of the family's structure drawn with NumPy (fast; norm scales random
    too, so every parameter matters)."""
    shapes = jax.eval_shape(lambda: fam.init(jax.random.PRNGKey(0), cfg))
    g = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(0.5 * g.normal(size=s.shape), s.dtype), shapes)


def layer_of(path: str) -> tuple[str, int]:
    """``('encoder/layers', 2)`` for ``'encoder/layers/2/attn'``."""
    parts = path.split("/")
    i = parts.index("layers")
    return "/".join(parts[:i + 1]), int(parts[i + 1])


def emptied_blocks(tree) -> dict[str, str]:
    """``{block path: 'attention' | 'mlp'}`` of the blocks the layers of :data:`EMPTIED` lose."""
    attn, mlp = find_blocks(lv.unmask(tree))
    out = {}
    for kind, blocks in (("attention", attn), ("mlp", mlp)):
        for path, _ in blocks:
            what = EMPTIED[layer_of(path)[1] % 3]
            if what == "both" or (what == "heads") == (kind == "attention"):
                out[path] = kind
    return out


def empty_masks(masked) -> dict:
    """Masks that remove every value channel of the emptied attention blocks (so every head)
    and every hidden channel of the emptied MLPs; all others keep everything."""
    masks = {p: (np.ones(a.size, np.float32), np.ones(b.size, np.float32))
             for p, (a, b) in channel_masks(masked).items()}
    for path, kind in emptied_blocks(masked).items():
        if kind == "attention":
            masks[f"{path}/v"][1][:] = 0
        else:
            masks[f"{path}/wo"][0][:] = 0
    return masks


def surgery(params, blocks: dict) -> dict:
    """The blocks emptied with ``nn.keep_heads`` / ``nn.keep_hidden``."""
    return replace_paths(params, {
        p: (nn.keep_heads if kind == "attention" else nn.keep_hidden)(get_path(params, p), [])
        for p, kind in blocks.items()})


def model_output(fam, cfg, params, inputs, state):
    """The family's primary output on the model's own scale (a forecaster's quantiles before
    the un-normalization by the series' scale)."""
    out = fam.apply(params, inputs, cfg) if state is None else fam.apply(
        params, inputs, cfg, state=state)
    y = out[models.primary_output(fam, out)]
    if "loc_scale" in out:
        loc, scale = out["loc_scale"]
        y = (y - loc[:, :, None]) / scale[:, :, None]
    return y


def check_emptied(fam, cfg, params, *, gains: int = 0):
    """Prune the layers of :data:`EMPTIED` physically and by surgery; both equal the masked
    model; the emptied blocks keep only their output biases (and ``gains`` parameters per
    weight: a binary leaf's gain); counts are the plan's. Returns ``(pruned, blocks)``."""
    m0 = add_channel_masks(params)
    blocks = emptied_blocks(m0)
    assert {layer_of(p)[1] for p in blocks} == {0, 1, 2}
    masked = with_channel_masks(m0, empty_masks(m0))
    tokens = token_counts(cfg, params)
    pruned, struct, removal = remove_masked(masked, config=cfg, tokens=tokens,
                                            return_structure=True)
    cut = surgery(params, blocks)
    state = fam.init_state(params, cfg) if fam.init_state is not None else None
    inputs = fam.sample_inputs(cfg, np.random.default_rng(0), 2)
    run = jax.jit(lambda p: model_output(fam, cfg, p, inputs, state))
    want = np.asarray(run(masked))
    assert np.all(np.isfinite(want))
    for name, tree in (("pruned", pruned), ("surgery", cut)):
        err = float(np.max(np.abs(np.asarray(run(tree)) - want)))
        assert err <= MODEL_TOL, (name, err)
    for path, kind in blocks.items():
        block, orig = get_path(pruned, path), get_path(params, path)
        out = orig["o" if kind == "attention" else "wo"]
        kept = 0 if lv.bias_of(out) is None else int(np.size(lv.bias_of(out)))
        if kind == "attention":
            assert block["heads"].num_heads == 0 and block["heads"].scale == orig["heads"].scale
            assert nn.attention_score_flops(block, 5, 5) == 0
        else:
            assert block["wo"].d_in == 0
        n_weights = 4 if kind == "attention" else 2
        assert lj.param_count(block) == kept + gains * n_weights, path
        assert lj.flops(block, 5) == 0
    saved = struct.total_params - struct.counts(removal)[0]
    assert lj.param_count(pruned) == lj.param_count(params) - saved
    assert lj.param_count(cut) == lj.param_count(pruned)
    flops = sum(get_path(pruned, p).flops(tokens[p]) for p in struct.members)
    flops += sum(nn.attention_score_flops(get_path(pruned, a.path), tokens[a.q], tokens[a.k])
                 for a in struct.attention)
    assert flops == struct.counts(removal)[1]
    return pruned, blocks


@pytest.mark.parametrize("name", list(FAMILIES))
def test_emptied_layers_pruned_equal_masked(name):
    cfg = FAMILIES[name]
    fam = models.family_of(cfg)
    check_emptied(fam, cfg, fast_init(fam, cfg), gains=int("binary" in name))


def _stacks(cfg):
    """``[(params key, stack config)]`` of a family's nn encoder/decoder stacks."""
    inner = getattr(cfg, "t5", cfg)
    out = [("encoder", inner.encoder)]
    if hasattr(inner, "decoder"):
        out.append(("decoder", inner.decoder))
    return out


def _layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(p["scale"], np.float64) + np.asarray(
        p["bias"], np.float64)


@pytest.mark.parametrize("name", [n for n in FAMILIES if not n.startswith("sbt")])
def test_emptied_layer_leaves_the_residual(name):
    """Layer 0 of every stack lost every head and MLP channel: its output is its input plus the
    output biases (pre-norm), or the norms of that (post-norm BERT), in NumPy."""
    cfg = FAMILIES[name]
    fam = models.family_of(cfg)
    params = fast_init(fam, cfg, seed=1)
    m0 = add_channel_masks(params)
    pruned = remove_masked(with_channel_masks(m0, empty_masks(m0)))
    for key, scfg in _stacks(cfg):
        stack = pruned[key]
        layer = stack["layers"][0]
        d = layer["mlp_norm"]["scale"].shape[0]
        x = jnp.asarray(f32(2, 2, 5, d))
        if key == "encoder":
            _, hidden = nn.apply_encoder(stack, x, scfg, return_hidden=True)
            attns = ["attn"]
        else:
            enc = jnp.asarray(f32(3, 2, 7, layer["cross_attn"]["qk"].d_k_in))
            _, hidden = nn.apply_decoder(stack, x, scfg, enc=enc, return_hidden=True)
            attns = ["self_attn", "cross_attn"]
        got, h = np.asarray(hidden[1], np.float64), np.asarray(hidden[0], np.float64)
        biases = [lv.bias_of(layer[a]["o"]) for a in attns] + [lv.bias_of(layer["mlp"]["wo"])]
        biases = [np.zeros(d) if b is None else np.asarray(b, np.float64) for b in biases]
        if scfg.layer.prenorm:
            want = h + sum(biases)
        else:
            eps = scfg.layer.norm.eps
            want = _layer_norm(_layer_norm(h + biases[0], layer["attn_norm"], eps) + biases[1],
                               layer["mlp_norm"], eps)
        np.testing.assert_allclose(got, want, atol=BLOCK_TOL, err_msg=key)


# ---------------------------------------------------------------------------------------------
# Every leaf type in a model.

_ATTN = r"attn/(qk/q|qk/k|v|o)$"
_MLP = r"mlp/(wi|wo)$"


def with_leaf_kind(params, kind: str):
    """BERT's attention and MLP weights as ``kind`` leaves (NumPy draws; a HeadLowRank on the
    q/k/v projections only, whose outputs are heads)."""
    import re

    new = {}
    for i, (path, leaf) in enumerate(lj.named_leaves(params)):
        if not (re.search(_ATTN, path) or re.search(_MLP, path)):
            continue
        k = kind
        if kind == "head_lowrank" and not re.search(r"(qk/q|qk/k|/v)$", path):
            k = "dense"
        new[path] = make_leaf(k, *leaf.shape, seed=100 + 7 * i, heads=HEADS)[0]
    return replace_paths(params, new)


@pytest.mark.parametrize("kind", [k for k in LEAF_KINDS if k not in ("channel_masked",
                                                                     "channel_pruned",
                                                                     "fixed_bias")])
def test_emptied_layers_of_every_leaf_type(kind):
    """BERT (biases everywhere, post-norm) with ``kind`` weights. ChannelMasked and
    ChannelPruned leaves are what pruning itself produces (every family test), the binary SBT
    has FixedBias leaves."""
    cfg = FAMILIES["bert"]
    fam = models.family_of(cfg)
    params = with_leaf_kind(fast_init(fam, cfg, seed=2), kind)
    check_emptied(fam, cfg, params, gains=int(kind in BINARY))


# ---------------------------------------------------------------------------------------------
# What comes after pruning.

def _emptied(name, seed=3):
    cfg = FAMILIES[name]
    fam = models.family_of(cfg)
    params = fast_init(fam, cfg, seed=seed)
    m0 = add_channel_masks(params)
    masked = with_channel_masks(m0, empty_masks(m0))
    return cfg, fam, masked, remove_masked(masked)


def test_pruning_an_emptied_model_again_changes_nothing():
    cfg, fam, masked, pruned = _emptied("t5_v1.1")
    again = remove_masked(add_channel_masks(pruned))
    inputs = fam.sample_inputs(cfg, np.random.default_rng(0), 2)
    run = jax.jit(lambda p: model_output(fam, cfg, p, inputs, None))
    np.testing.assert_allclose(np.asarray(run(again)), np.asarray(run(pruned)), atol=MODEL_TOL)
    assert lj.param_count(again) == lj.param_count(pruned)


def test_emptied_t5_decodes_greedily_as_the_masked_model():
    cfg, fam, masked, pruned = _emptied("t5_v1.0")
    ids = fam.sample_inputs(cfg, np.random.default_rng(0), 2)["input_ids"]
    a = models.t5.generate(pruned, ids, cfg, max_new_tokens=4)
    b = models.t5.generate(masked, ids, cfg, max_new_tokens=4)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["t5_v1.1", "bert"])
def test_emptied_model_exports_to_the_pytorch_class(name, tmp_path):
    """The emptied blocks are written as zeros at the config's widths (their output biases
    kept); the PyTorch class computes what the pruned JAX model computes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from lowrank_jax.convert import save_pretrained

    cfg, fam, _, pruned = _emptied(name)
    summary = save_pretrained(cfg, pruned, tmp_path / "hf")
    blocks = emptied_blocks(add_channel_masks(pruned))
    assert set(blocks) <= set(summary["widened"])
    inputs = fam.sample_inputs(cfg, np.random.default_rng(0), 2)
    ours = np.asarray(model_output(fam, cfg, pruned, inputs, None))
    torch_in = {k: torch.from_numpy(np.asarray(v).astype(np.int64)) for k, v in inputs.items()}
    if name == "bert":
        hf = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    else:
        hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ref = hf(**torch_in).logits.numpy()
    assert np.abs(ref - ours).max() <= MODEL_TOL


def test_analyze_sweeps_heads_of_an_emptied_model(tmp_path, capsys):
    from lowrank_jax.cli.main import main
    from lowrank_jax.io import save_model

    cfg, _, _, pruned = _emptied("bert")
    save_model(tmp_path / "m", cfg, pruned)
    assert main(["analyze", str(tmp_path / "m"), "--sweep-heads", "--no-progress"]) == 0
    out = capsys.readouterr().out
    blocks = [p for p, b in attention_blocks(pruned) if b["heads"].num_heads == 0]
    assert blocks
    for p in blocks:
        assert f"{p}  no query/key channels left (pruned)" in out


# ---------------------------------------------------------------------------------------------
# Compression methods on an emptied model.
#
# Every plan method runs on a model with emptied blocks: the weights and query-key objects of
# those blocks come back unchanged with a row of kind 'empty', the others are what the same
# step makes of the same weights in the model before pruning (where nothing is empty), and the
# compressed model runs (equal to the emptied model where the method is exact).

WEIGHTS = r"(attn/(qk/q|qk/k|v|o)|mlp/(wi|wi_0|wi_1|wo))$"
QKVO = r"attn/(qk/q|qk/k|v|o)$"
MLP_W = r"mlp/(wi|wi_0|wi_1|wo)$"
QK = r"attn/qk$"

#: name -> (step, exact: the compressed model computes what the emptied model computes)
METHOD_STEPS = {
    "svd eps": (lj.Step("svd", (WEIGHTS,), {"eps": 0.3}), False),
    "svd rank": (lj.Step("svd", (WEIGHTS,), {"rank": 2}), False),
    "svd schedule": (lj.Step("svd", (WEIGHTS,), {"schedule": [2, 1, 2]}), False),
    "svd full rank": (lj.Step("svd", (WEIGHTS,), {"eps": 1e-6, "keep_dense_if_larger": False}),
                      True),
    "svd per head": (lj.Step("svd", (QKVO,), {"rank": 1, "per_head": True}), False),
    "svd per head eps": (lj.Step("svd", (QKVO,), {"eps": 0.4, "per_head": True}), False),
    "factorize": (lj.Step("factorize", (WEIGHTS,), {"rank": 2}), False),
    "factorize per head": (lj.Step("factorize", (QKVO,), {"rank": 1, "per_head": True}), False),
    "lora": (lj.Step("lora", (WEIGHTS,), {"rank": 2}), True),
    "truncatt": (lj.Step("truncatt", (QK,), {"rank": 1}), False),
    "truncatt full rank": (lj.Step("truncatt", (QK,), {"rank": 4}), True),
    "truncatt per-head ranks": (lj.Step("truncatt", (QK,), {"rank": [1, 2, 1]}), False),
    "cp": (lj.Step("cp", (QK,), {"rank": 3, "n_iter_max": 5}), False),
    "btd": (lj.Step("btd", (QK,), {"rank": 4, "n_iter_max": 3, "cp_n_iter_max": 5}), False),
    "truncatt_vo": (lj.Step("truncatt_vo", (r"attn/v$",), {"rank": [1, 2, 1]}), False),
    "truncatt_vo full rank": (lj.Step("truncatt_vo", (r"attn/v$",), {"rank": 4}), True),
    "partition": (lj.Step("partition", (MLP_W,), {"machines": 2, "rank": 1}), False),
    "partition full rank": (lj.Step("partition", (MLP_W,), {"machines": 2, "rank": 100}), True),
    "binarize": (lj.Step("binarize", (WEIGHTS,), {"keep": 0.5}), False),
    "binarize uniform": (lj.Step("binarize", (WEIGHTS,), {"keep": 0.5, "scores": "uniform"}),
                         False),
    "quantize": (lj.Step("quantize", (WEIGHTS,), {"bits": 4, "group": 8}), False),
    "quantize lowrank residual": (lj.Step("quantize", (WEIGHTS,), {"bits": 4, "group": 8,
                                                                   "rank": 1, "factor_bits": 8}),
                                  False),
}


def same_node(a, b, what):
    """Equal pytrees: the same structure (leaf types and static fields) and equal arrays."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, what
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def in_blocks(path: str, blocks) -> bool:
    return any(path == b or path.startswith(b + "/") for b in blocks)


@functools.lru_cache(maxsize=None)
def runner(cfg):
    """The family's primary output on two sample inputs, compiled once per config (and tree
    structure; a family with state gets the state of the tree it runs)."""
    fam = models.family_of(cfg)
    inputs = fam.sample_inputs(cfg, np.random.default_rng(0), 2)
    if fam.init_state is None:
        return jax.jit(lambda p: model_output(fam, cfg, p, inputs, None))
    run = jax.jit(lambda p, state: model_output(fam, cfg, p, inputs, state))
    return lambda p: run(p, fam.init_state(p, cfg))


def check_method_on_emptied(name, step, *, exact, original, emptied, inputs=None, key_seed=0):
    """Apply ``step`` (or a plan) to the emptied model and to ``original`` (the same weights
    before pruning) and check what this section's comment says. Returns ``(new, report)``."""
    cfg, fam, pruned = emptied
    blocks = emptied_blocks(add_channel_masks(pruned))
    kw = dict(key=jax.random.PRNGKey(key_seed), config=cfg)
    new, report = lj.apply_plan(pruned, step, inputs=inputs, **kw)
    ref, _ = lj.apply_plan(original, step, inputs=inputs, **kw)
    empty = [r for r in report.rows if r.kind == "empty"]
    assert empty and {r.path for r in empty} == {r.path for r in report.rows
                                                 if in_blocks(r.path, blocks)}, name
    for r in report.rows:
        if r.kind == "empty":
            assert r.details["reason"] == "empty: nothing to compress"
            assert not r.changed and r.error == 0.0
            assert (r.params_before, r.bits_before, r.flops_before) == (
                r.params_after, r.bits_after, r.flops_after)
            assert get_path(new, r.path) is get_path(pruned, r.path)
        else:
            same_node(get_path(new, r.path), get_path(ref, r.path), f"{name}: {r.path}")
    run = runner(cfg)
    y = np.asarray(run(new))
    assert np.all(np.isfinite(y)), name
    if exact:
        np.testing.assert_allclose(y, np.asarray(run(pruned)), atol=MODEL_TOL, err_msg=name)
    return new, report


@pytest.fixture(scope="module")
def emptied_models():
    """``{family: ((cfg, fam, emptied), original)}`` for T5 v1.1 and BERT."""
    out = {}
    for name in ("t5_v1.1", "bert"):
        cfg, fam, _, pruned = _emptied(name)
        out[name] = ((cfg, fam, pruned), fast_init(fam, cfg, seed=3))
    return out


@pytest.mark.parametrize("method", list(METHOD_STEPS))
@pytest.mark.parametrize("family", ["t5_v1.1", "bert"])
def test_method_on_an_emptied_model(emptied_models, family, method):
    step, exact = METHOD_STEPS[method]
    emptied, original = emptied_models[family]
    check_method_on_emptied(method, step, exact=exact, original=original, emptied=emptied)


#: families with other blocks than T5's and BERT's (Chronos-Bolt is T5's, and ``prune`` runs
#: on it below): one plan over several methods, attention truncated, then its value-output
#: side per head, the MLP binarized
_OTHER_FAMILIES = ["vit", "patch_encoder", "sbt_dense_classification"]


@pytest.mark.parametrize("family", _OTHER_FAMILIES)
def test_a_plan_on_emptied_models_of_other_families(family):
    cfg, fam, _, pruned = _emptied(family)
    plan = lj.Plan((lj.Step("svd", (QKVO,), {"rank": 1}),
                    lj.Step("truncatt_vo", (r"attn/v$",), {"rank": 1}),
                    lj.Step("binarize", (MLP_W,), {"keep": 0.5})))
    new, report = check_method_on_emptied(family, plan, exact=False,
                                          original=fast_init(fam, cfg, seed=3),
                                          emptied=(cfg, fam, pruned))
    assert {r.method for r in report.rows if r.kind == "empty"} == {
        "svd", "truncatt_vo", "binarize"}


def test_svd_rank_on_an_emptied_model_is_the_truncated_svd(emptied_models):
    """Against NumPy: every non-empty weight is its best rank-2 approximation."""
    (cfg, fam, pruned), original = emptied_models["bert"]
    new, report = check_method_on_emptied("svd rank", METHOD_STEPS["svd rank"][0], exact=False,
                                          original=original, emptied=(cfg, fam, pruned))
    done = [r for r in report.rows if r.kind == "svd"]
    assert len(done) == 6  # layer 1's MLP and layer 2's attention
    for r in done:
        w = np.asarray(lv.materialize(get_path(pruned, r.path)), np.float64)
        u, s, vt = np.linalg.svd(w, full_matrices=False)
        want = (u[:, :2] * s[:2]) @ vt[:2]
        np.testing.assert_allclose(np.asarray(lv.materialize(get_path(new, r.path))), want,
                                   atol=BLOCK_TOL, err_msg=r.path)
        assert r.error == pytest.approx(s[2] / s[0])


@pytest.mark.parametrize("allocation", ["eps", "energy"])
@pytest.mark.parametrize("family", ["t5_v1.1", "bert"])
def test_svd_ratio_counts_emptied_weights_as_fixed(emptied_models, family, allocation):
    """Under ``ratio`` an emptied weight is a fixed one: the ratio holds over every selected
    weight (BERT's emptied output projections keep their biases). Without biases (T5) the
    others get what they get when the rules skip the emptied blocks."""
    (cfg, fam, pruned), _ = emptied_models[family]
    step = lj.Step("svd", (WEIGHTS,), {"ratio": 0.5, "allocation": allocation})
    new, report = lj.apply_plan(pruned, step)
    assert report.ratio <= 0.5
    blocks = emptied_blocks(add_channel_masks(pruned))
    empty = {r.path for r in report.rows if r.kind == "empty"}
    assert empty == {r.path for r in report.rows if in_blocks(r.path, blocks)}
    fixed = sum(r.params_before for r in report.rows if r.kind == "empty")
    assert (fixed > 0) == (family == "bert")
    if family == "t5_v1.1":
        skip = [(f"^{b}/", None) for b in blocks]
        ref, ref_report = lj.apply_plan(pruned, lj.Step("svd", (*skip, WEIGHTS),
                                                        dict(step.settings)))
        assert ref_report.info() == report.info()
        for r in report.rows:
            same_node(get_path(new, r.path), get_path(ref, r.path), r.path)
    if allocation == "eps":  # every other weight keeps its eps-rank at the chosen eps (NumPy)
        eps = report.info()["chosen_eps"]
        for r in report.rows:
            if r.kind == "svd":
                s = np.linalg.svd(np.asarray(lv.materialize(get_path(pruned, r.path)),
                                             np.float64), compute_uv=False)
                s, k = s / s[0], r.details["rank"]
                # the smallest rank within eps (eps is one of the normalized singular values,
                # so compare with a margin for the two float64 SVDs' rounding)
                assert k == s.size or s[k] <= eps + 1e-9, r.path
                assert k == 1 or s[k - 1] > eps - 1e-9, r.path


def test_svd_inputs_given_for_emptied_weights_count_as_used(emptied_models):
    """Data-aware ``svd``: activations collected for every weight (an emptied output
    projection's are ``[n, 0]``) are accepted; the other weights are projected as in the
    model before pruning."""
    (cfg, fam, pruned), original = emptied_models["bert"]
    rng = np.random.default_rng(5)
    inputs = {p: jnp.asarray(f32(int(rng.integers(1 << 30)), 20, leaf.shape[0]))
              for p, leaf in lj.named_leaves(pruned) if re_search(QKVO, p)}
    assert any(x.shape[1] == 0 for x in inputs.values())
    orig_inputs = {p: jnp.asarray(f32(int(rng.integers(1 << 30)), 20, leaf.shape[0]))
                   for p, leaf in lj.named_leaves(original) if re_search(QKVO, p)}
    step = lj.Step("svd", (QKVO,), {"rank": 2})
    new, report = lj.apply_plan(pruned, step, inputs=inputs)
    kinds = {r.path: r.kind for r in report.rows}
    live = [p for p, k in kinds.items() if k != "empty"]
    assert live and all(kinds[p] == "inputs" for p in live)
    ref, _ = lj.apply_plan(original, step, inputs={**orig_inputs,
                                                   **{p: inputs[p] for p in live}})
    for p in live:
        same_node(get_path(new, p), get_path(ref, p), p)


def re_search(pattern, path):
    import re

    return re.search(pattern, path) is not None


@pytest.mark.parametrize("family", ["t5_v1.1", "bert"])
def test_compress_keys_on_an_emptied_model(emptied_models, family):
    """``compress_keys`` with calibration inputs for every query-key object (the emptied ones'
    count as used); all keys kept is exact."""
    (cfg, fam, pruned), original = emptied_models[family]
    rng = np.random.default_rng(6)
    inputs = {f"{sel.path}/q": jnp.asarray(f32(int(rng.integers(1 << 30)), 24,
                                               sel.node.d_q_in))
              for sel in select(pruned, (QK,), kind="qk", where="test")}
    for keys, exact in ((2, False), (4, True)):
        check_method_on_emptied(f"compress_keys {keys}", lj.Step("compress_keys", (QK,),
                                                                 {"keys": keys}),
                                exact=exact, original=original, emptied=(cfg, fam, pruned),
                                inputs=inputs)


def test_partition_of_attention_on_an_emptied_bert(emptied_models):
    """BERT's 3 heads over 3 machines: the emptied blocks' value and output projections pass
    (their head checks do not apply), the others are split as before pruning."""
    (cfg, fam, pruned), original = emptied_models["bert"]
    for rank, exact in ((1, False), (100, True)):
        check_method_on_emptied(f"partition attention rank {rank}",
                                lj.Step("partition", (r"attn/(v|o)$",),
                                        {"machines": 3, "rank": rank}),
                                exact=exact, original=original, emptied=(cfg, fam, pruned))


@pytest.mark.parametrize("family", ["t5_v1.1", "bert"])
def test_prune_masks_of_an_emptied_model(emptied_models, family):
    """``prune`` without a target on the emptied model with every channel masked-in: the
    emptied weights' rows say so (nothing to remove, their counts unchanged), the others are
    what pruning the model before pruning gives, and the model computes the same."""
    (cfg, fam, pruned), original = emptied_models[family]
    step = lj.Step("prune", (WEIGHTS,), {})
    new, report = lj.apply_plan(add_channel_masks(pruned), step, config=cfg)
    ref, _ = lj.apply_plan(add_channel_masks(original), step, config=cfg)
    blocks = emptied_blocks(add_channel_masks(pruned))
    for r in report.rows:
        if in_blocks(r.path, blocks):
            assert r.kind == "empty" and r.details["reason"] == "empty: nothing to compress"
            assert (r.params_before, r.bits_before, r.flops_before) == (
                r.params_after, r.bits_after, r.flops_after)
            assert lv.weight_shape(get_path(new, r.path)) == lv.weight_shape(
                get_path(pruned, r.path))
        else:
            assert r.kind == "pruned"
            same_node(get_path(new, r.path), get_path(ref, r.path), r.path)
    run = runner(cfg)
    np.testing.assert_allclose(np.asarray(run(new)), np.asarray(run(pruned)), atol=MODEL_TOL)


def test_prune_to_a_target_on_an_emptied_forecaster():
    """Algorithm 1 on Chronos-Bolt with emptied layers: it runs, the emptied weights' rows say
    so, and the pruned model runs."""
    cfg, fam, _, pruned = _emptied("chronos_bolt")
    step = lj.Step("prune", (WEIGHTS,), {"target": 0.3, "steps": 1, "batch_size": 2})
    new, report = lj.apply_plan(pruned, step, config=cfg)
    blocks = emptied_blocks(add_channel_masks(pruned))
    assert {r.path for r in report.rows if r.kind == "empty"} == {
        r.path for r in report.rows if in_blocks(r.path, blocks)}
    assert lj.param_count(new) < lj.param_count(pruned)
    inputs = fam.sample_inputs(cfg, np.random.default_rng(0), 2)
    assert np.all(np.isfinite(np.asarray(model_output(fam, cfg, new, inputs, None))))


#: the methods run on each leaf kind (Dense: every method, above): what reads the weights
#: (svd, binarize: the float kinds only; binary leaves and LoRA leaves are the product of
#: another method, which they do not select) and the query-key methods, which take any leaf
_KIND_METHODS = {
    "float": ["svd rank", "svd per head", "binarize", "truncatt_vo"],
    "other": ["truncatt_vo"],
}


@pytest.mark.parametrize("kind", [k for k in LEAF_KINDS if k not in ("dense", "channel_masked",
                                                                     "channel_pruned",
                                                                     "fixed_bias")])
def test_methods_on_an_emptied_model_of_every_leaf_type(kind):
    """BERT with ``kind`` weights, emptied (as pruning leaves them: ChannelPruned wrappers
    around ``kind`` leaves): the methods that take that leaf type."""
    cfg = FAMILIES["bert"]
    fam = models.family_of(cfg)
    original = with_leaf_kind(fast_init(fam, cfg, seed=2), kind)
    m0 = add_channel_masks(original)
    pruned = remove_masked(with_channel_masks(m0, empty_masks(m0)))
    for method in _KIND_METHODS["float" if kind in ("lowrank", "head_lowrank") else "other"]:
        step, exact = METHOD_STEPS[method]
        check_method_on_emptied(f"{kind}: {method}", step, exact=exact, original=original,
                                emptied=(cfg, fam, pruned))


@pytest.mark.parametrize("side", ["inputs", "outputs"])
def test_methods_pass_a_pruned_leaf_with_no_kept_channels(side):
    """A residual-width weight whose kept channels (after ``prune``) are none on one side is
    empty on its kept channels: every weight method passes it through."""
    base = lv.Dense(jnp.asarray(f32(0, 0, 5) if side == "inputs" else f32(0, 7, 0)),
                    None if side == "inputs" else None)
    rows, cols = ((), tuple(range(1, 6))) if side == "inputs" else (tuple(range(7)), ())
    leaf = lv.pruned_leaf(base, rows, cols, 8, 6)
    other, _ = make_leaf("dense", 8, 6, seed=3)
    tree = {"a": {"w": leaf}, "b": {"w": other}}
    for step in (lj.Step("svd", ("w$",), {"rank": 2}), lj.Step("binarize", ("w$",), {}),
                 lj.Step("factorize", ("w$",), {"rank": 2}), lj.Step("lora", ("w$",), {"rank": 2}),
                 lj.Step("partition", ("w$",), {"machines": 2, "rank": 1})):
        new, report = lj.apply_plan(tree, step, key=jax.random.PRNGKey(0))
        row = report.row("a/w")
        assert row.kind == "empty" and not row.changed, step.method
        assert new["a"]["w"] is leaf
        assert report.row("b/w").kind != "empty" and report.row("b/w").changed, step.method


@pytest.mark.parametrize("per_head", [False, True])
def test_eps_sweep_of_an_emptied_model_is_what_svd_gives(emptied_models, per_head):
    """The one-compile eps sweep takes an emptied model (per head too: a block without heads
    is one empty matrix) and counts what the ``svd`` method does."""
    from lowrank_jax.compress import eps_sweep

    (cfg, fam, pruned), _ = emptied_models["bert"]
    rows = eps_sweep(cfg, pruned, None, [0.3, 0.7], per_head=per_head)
    for r in rows:
        _, report = lj.compress.compress(pruned, eps=r["eps"], per_head=per_head)
        assert r["size_ratio"] == pytest.approx(report.ratio, abs=1e-12)
        assert r["params_after"] == report.params_after
    assert rows[1]["size_ratio"] < 1.0


def test_frontier_candidates_of_an_emptied_model(emptied_models):
    """The frontier's candidates for the query-key methods read the widest head over the
    model's blocks; blocks without heads do not stop them."""
    from lowrank_jax.compress.frontier import default_candidates

    (cfg, _, pruned), _ = emptied_models["bert"]
    cands, skipped = default_candidates(pruned, cfg, quick=True, combinations=False,
                                        methods=["truncatt", "cp", "btd", "truncatt_vo"])
    assert not skipped
    assert {c.plan.steps[0].method for c in cands} == {"truncatt", "cp", "btd", "truncatt_vo"}
    assert "truncatt rank=2/head" in {c.name for c in cands}  # 0.5 of the widest head, 4
