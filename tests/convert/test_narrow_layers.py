"""Per-layer head counts, head widths and MLP widths, against the PyTorch originals.

For every family (T5, Chronos, Chronos-Bolt, DeiT with teacher head, BERT):

(a) prune: a small PyTorch model in which some heads (q, k, v output rows, o input columns
    and their biases) and some MLP channels (input rows of wi / wi_0 and wi_1, output columns
    of wo, and their biases) are zeroed, differently in every layer, must give the outputs of
    our import of it with those heads and channels physically removed
    (``nn.keep_heads`` / ``nn.keep_hidden``; one layer keeps everything). Current transformers
    releases no longer prune heads, so zeroing is how the PyTorch side expresses removal.
    Exporting the pruned tree must reproduce the zeroed checkpoint exactly (zero-padding puts
    every kept head back at its original position).
(b) export: a model initialized with per-layer ``LayerSizes`` (fewer and narrower heads,
    narrower MLPs than the config, and a layer whose kept heads are not contiguous), saved with
    ``save_pretrained`` and loaded by the PyTorch class, must give our outputs.

T5-family stacks share one relative-bias table over the original heads; a layer keeping heads
(0, 2, 3) must read its columns 0, 2, 3. The tables here are non-uniform N(0, 1), and a test
checks that reading the wrong columns changes the outputs well beyond the tolerance.
"""

import dataclasses
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from lowrank_jax import nn  # noqa: E402
from lowrank_jax.convert import load_pretrained, save_pretrained, state_dict_from_params  # noqa: E402
from lowrank_jax.errors import ShapeError  # noqa: E402
from lowrank_jax.leaves import (  # noqa: E402
    HeadLayout,
    get_path,
    param_count,
    replace_paths,
)
from lowrank_jax.models import bert, chronos, chronos_bolt, family_of, t5, vit  # noqa: E402
from lowrank_jax.nn import LayerSizes  # noqa: E402

torch.set_num_threads(1)

TOL = 1e-4  # whole-model float32 parity (design.md)


# ---------------------------------------------------------------------------------------------
# Generic machinery: a family's block names, removal plans, zeroing in a state dict.

@dataclasses.dataclass
class Case:
    """One family: its PyTorch checkpoint names per tree block and how to run both sides."""

    hf_cls: type
    num_heads: int
    d_head: int
    d_ff: int
    attn: dict  # tree path of an attention block -> ({'q','k','v','o'} -> module name, bias)
    mlp: dict  # tree path of an MLP block -> ([wi module names], wo module name, bias)
    run_hf: Callable  # (torch model) -> {name: np.ndarray}
    run_ours: Callable  # (params, cfg) -> {name: np.ndarray}


def channels(heads, d_head) -> np.ndarray:
    return np.concatenate([np.arange(h * d_head, (h + 1) * d_head) for h in heads] or
                          [np.zeros(0, np.int64)]).astype(np.int64)


def zero_removed(state: dict, case: Case, heads: dict, hidden: dict, qk_channels: dict) -> dict:
    """A copy of a checkpoint (PyTorch orientation) with the heads and MLP channels that
    ``heads`` / ``hidden`` do not keep zeroed, and the q/k channels ``qk_channels`` removes."""
    state = {k: np.array(v) for k, v in state.items()}
    for block, keep in heads.items():
        names, bias = case.attn[block]
        ch = channels([h for h in range(case.num_heads) if h not in keep], case.d_head)
        for n in "qkv":
            state[f"{names[n]}.weight"][ch] = 0.0
            if bias:
                state[f"{names[n]}.bias"][ch] = 0.0
        state[f"{names['o']}.weight"][:, ch] = 0.0
    for block, removed in qk_channels.items():
        names, bias = case.attn[block]
        for n in "qk":
            state[f"{names[n]}.weight"][removed] = 0.0
            if bias:
                state[f"{names[n]}.bias"][removed] = 0.0
    for block, keep in hidden.items():
        wis, wo, bias = case.mlp[block]
        removed = [c for c in range(case.d_ff) if c not in keep]
        for wi in wis:
            state[f"{wi}.weight"][removed] = 0.0
            if bias:
                state[f"{wi}.bias"][removed] = 0.0
        state[f"{wo}.weight"][:, removed] = 0.0
    return state


def prune(params, heads: dict, hidden: dict, qk_channels: dict, num_heads: int, d_head: int):
    """Physical removal: keep_channels on query/key channels (positions in the full layout),
    then keep_heads and keep_hidden, each block its own choice."""
    new = {}
    for block, removed in qk_channels.items():
        attn = get_path(params, block)
        keep = np.setdiff1d(np.arange(num_heads * d_head), removed)
        new[block] = {**attn, "qk": attn["qk"].keep_channels(keep)}
    params = replace_paths(params, new)
    new = {block: nn.keep_heads(get_path(params, block), list(keep))
           for block, keep in heads.items()}
    new.update({block: nn.keep_hidden(get_path(params, block), list(keep))
                for block, keep in hidden.items()})
    return replace_paths(params, new)


def write_checkpoint(src, dst, state) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def hf_load(cls, path, **kw):
    """``cls.from_pretrained`` that insists on a complete, exactly matching checkpoint."""
    model, info = cls.from_pretrained(str(path), output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def randomize_torch(model, seed: int, rel_bias_std: float = 1.0):
    """O(1) weights: N(0, 0.15^2), norm scales 1 + N(0, 0.15^2), relative-bias tables
    N(0, rel_bias_std^2) (non-uniform, so a wrong column shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "relative_attention_bias" in name:
                p.copy_(rel_bias_std * noise)
            elif ("norm" in name.lower() and name.endswith("weight") and p.ndim == 1):
                p.copy_(1.0 + 0.15 * noise)
            else:
                p.copy_(0.15 * noise)
    return model.eval()


def randomize_tree(params, seed: int):
    """O(1) values for every array of a parameter tree: weights N(0, 1/d_in), norm scales
    1 + N(0, 0.1^2), everything else (biases, embeddings, tokens, relative-bias tables)
    N(0, 0.5^2)."""
    rng = np.random.default_rng(seed)

    def draw(path, a):
        name, shape = jax.tree_util.keystr(path), np.shape(a)
        if name.endswith("['scale']"):
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".w"):
            x = rng.standard_normal(shape) / np.sqrt(shape[0])
        else:
            x = 0.5 * rng.standard_normal(shape)
        return jnp.asarray(x, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, params)


def max_err(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    for k in a:
        assert np.shape(a[k]) == np.shape(b[k]), k
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in a)


def check_pruned(case: Case, src: str, tmp_path, heads: dict, hidden: dict,
                 qk_channels: dict | None = None):
    """(a): zeroed PyTorch model == our pruned import; the export of the pruned tree is the
    zeroed checkpoint. Returns ``(cfg, pruned params, zeroed torch model)``."""
    qk_channels = qk_channels or {}
    state = load_file(os.path.join(src, "model.safetensors"))
    zeroed = zero_removed(state, case, heads, hidden, qk_channels)
    zdir = write_checkpoint(src, tmp_path / "zeroed", zeroed)
    hf_full, hf_zero = hf_load(case.hf_cls, src), hf_load(case.hf_cls, zdir)
    ref = case.run_hf(hf_zero)
    assert max_err(ref, case.run_hf(hf_full)) > 1e-2  # the removal changes the model

    cfg, params = load_pretrained(zdir)
    pruned = prune(params, heads, hidden, qk_channels, case.num_heads, case.d_head)
    assert param_count(pruned) < param_count(params)
    for block, keep in heads.items():  # physically smaller, original ids kept
        layout = get_path(pruned, block)["heads"]
        assert layout.ids == tuple(keep) and layout.num_heads == len(keep)
    for block, keep in hidden.items():
        assert get_path(pruned, f"{block}/wo").shape[0] == len(keep)
    err = max_err(case.run_ours(pruned, cfg), ref)
    assert err <= TOL, err

    # Export zero-pads every kept head back to its original position, and the kept hidden
    # channels of an MLP (which has no record of original channels) to its first channels:
    # the zeroed checkpoint, up to that permutation of hidden channels.
    back, materialized, widened = state_dict_from_params(cfg, pruned)
    assert materialized == []
    narrowed = {b for b, k in heads.items() if len(k) < case.num_heads}
    narrowed |= {b for b, k in hidden.items() if len(k) < case.d_ff} | set(qk_channels)
    assert set(widened) == narrowed
    expected = dict(zeroed)
    for block, keep in hidden.items():
        wis, wo, bias = case.mlp[block]
        keep, n = np.asarray(keep), len(keep)
        for key in [f"{wi}.weight" for wi in wis] + [f"{wi}.bias" for wi in wis if bias]:
            expected[key] = np.zeros_like(zeroed[key])
            expected[key][:n] = zeroed[key][keep]
        key = f"{wo}.weight"
        expected[key] = np.zeros_like(zeroed[key])
        expected[key][:, :n] = zeroed[key][:, keep]
    assert set(back) <= set(zeroed)
    for key in back:
        np.testing.assert_array_equal(back[key], expected[key], err_msg=key)
    return cfg, pruned, hf_zero


def check_exported(case: Case, cfg, params, tmp_path, **load_kw):
    """(b): ``save_pretrained`` of a narrow model, loaded by the PyTorch class, gives our
    outputs; reading the export back gives the same model at full width."""
    ours = case.run_ours(params, cfg)
    summary = save_pretrained(cfg, params, tmp_path / "export")
    assert summary["widened"] and summary["materialized"] == []
    hf = hf_load(case.hf_cls, tmp_path / "export", **load_kw)
    err = max_err(case.run_hf(hf), ours)
    assert err <= TOL, err
    cfg_back, full = load_pretrained(tmp_path / "export")
    assert cfg_back == cfg and param_count(full) > param_count(params)
    assert max_err(case.run_ours(full, cfg_back), ours) <= TOL
    return hf


# ---------------------------------------------------------------------------------------------
# T5.

T5_KW = dict(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=3, num_decoder_layers=2,
             num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
             decoder_start_token_id=0, dropout_rate=0.0, feed_forward_proj="gated-gelu",
             tie_word_embeddings=False)


def t5_names(cfg_kw: dict, prefix: str = "") -> tuple[dict, dict]:
    gated = cfg_kw["feed_forward_proj"].startswith("gated")
    wis = ("wi_0", "wi_1") if gated else ("wi",)
    attn, mlp = {}, {}

    def qkvo(p):
        return {n: f"{p}.{n}" for n in "qkvo"}

    for i in range(cfg_kw["num_layers"]):
        b = f"{prefix}encoder.block.{i}"
        attn[f"encoder/layers/{i}/attn"] = (qkvo(f"{b}.layer.0.SelfAttention"), False)
        d = f"{b}.layer.1.DenseReluDense"
        mlp[f"encoder/layers/{i}/mlp"] = ([f"{d}.{w}" for w in wis], f"{d}.wo", False)
    for i in range(cfg_kw["num_decoder_layers"]):
        b = f"{prefix}decoder.block.{i}"
        attn[f"decoder/layers/{i}/self_attn"] = (qkvo(f"{b}.layer.0.SelfAttention"), False)
        attn[f"decoder/layers/{i}/cross_attn"] = (qkvo(f"{b}.layer.1.EncDecAttention"), False)
        d = f"{b}.layer.2.DenseReluDense"
        mlp[f"decoder/layers/{i}/mlp"] = ([f"{d}.{w}" for w in wis], f"{d}.wo", False)
    return attn, mlp


def _t5_inputs(vocab):
    rs = np.random.RandomState(0)
    ids, dec = rs.randint(2, vocab, (2, 9)), rs.randint(2, vocab, (2, 5))
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    return ids, mask, dec


def t5_case() -> Case:
    ids, mask, dec = _t5_inputs(T5_KW["vocab_size"])

    def run_hf(model):
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                        decoder_input_ids=torch.from_numpy(dec))
        return {"logits": out.logits.numpy(),
                "encoder_last_hidden_state": out.encoder_last_hidden_state.numpy()}

    def run_ours(params, cfg):
        out = jax.jit(lambda p: t5.apply(p, {"input_ids": ids, "attention_mask": mask,
                                             "decoder_input_ids": dec}, cfg))(params)
        return {k: np.asarray(out[k]) for k in ("logits", "encoder_last_hidden_state")}

    attn, mlp = t5_names(T5_KW)
    return Case(transformers.T5ForConditionalGeneration, 4, 4, 24, attn, mlp, run_hf, run_ours)


@pytest.fixture(scope="module")
def t5_src(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_KW))
    model.lm_head.weight = torch.nn.Parameter(torch.empty(40, 16))  # transformers 5 ties it
    randomize_torch(model, 1)
    path = tmp_path_factory.mktemp("t5_src")
    model.save_pretrained(path)
    return str(path)


T5_HEADS = {"encoder/layers/0/attn": (0, 2, 3), "encoder/layers/1/attn": (0, 1, 2, 3),
            "encoder/layers/2/attn": (1,), "decoder/layers/0/self_attn": (0, 3),
            "decoder/layers/0/cross_attn": (1, 2, 3), "decoder/layers/1/self_attn": (0, 1, 2, 3),
            "decoder/layers/1/cross_attn": (2,)}
_rs = np.random.RandomState(7)
T5_HIDDEN = {"encoder/layers/0/mlp": tuple(sorted(_rs.choice(24, 16, replace=False))),
             "encoder/layers/1/mlp": tuple(range(24)),
             "encoder/layers/2/mlp": tuple(sorted(_rs.choice(24, 5, replace=False))),
             "decoder/layers/0/mlp": tuple(sorted(_rs.choice(24, 10, replace=False))),
             "decoder/layers/1/mlp": tuple(range(24))}
# Encoder layer 1 keeps all heads but loses every query/key channel of head 1 (width 0: with
# only the relative bias left, it attends by position alone) and the last two of head 2.
T5_QK_CHANNELS = {"encoder/layers/1/attn": np.array([4, 5, 6, 7, 10, 11])}


def test_t5_pruned_matches_zeroed_pytorch(t5_src, tmp_path):
    case = t5_case()
    cfg, pruned, _ = check_pruned(case, t5_src, tmp_path, T5_HEADS, T5_HIDDEN, T5_QK_CHANNELS)
    assert pruned["encoder"]["layers"][1]["attn"]["qk"].widths == (4, 0, 2, 4)
    ref = case.run_ours(pruned, cfg)
    # The shared relative-bias table is read by original head: giving encoder layer 0's kept
    # heads (0, 2, 3) the columns (0, 1, 2) instead changes the outputs far beyond TOL.
    attn = pruned["encoder"]["layers"][0]["attn"]
    wrong = HeadLayout(ids=(0, 1, 2), v=attn["heads"].v, scale=attn["heads"].scale)
    mis = replace_paths(pruned, {"encoder/layers/0/attn": {**attn, "heads": wrong}})
    assert max_err(case.run_ours(mis, cfg), ref) > 1e-2


def test_t5_export_permutes_channels_within_a_head(t5_src, tmp_path):
    """Query/key channels removed from the middle of a head are exported to the head's first
    columns: the checkpoint differs from the zeroed one, the model it loads does not."""
    case = t5_case()
    qk = {"decoder/layers/0/self_attn": np.array([1, 8, 9])}  # one of head 0, two of head 2
    cfg, pruned, hf_zero = check_pruned_permuted(case, t5_src, tmp_path, qk)
    save_pretrained(cfg, pruned, tmp_path / "export")
    hf = hf_load(case.hf_cls, tmp_path / "export")
    assert max_err(case.run_hf(hf), case.run_hf(hf_zero)) <= TOL


def check_pruned_permuted(case, src, tmp_path, qk_channels):
    state = load_file(os.path.join(src, "model.safetensors"))
    zeroed = zero_removed(state, case, {}, {}, qk_channels)
    hf_zero = hf_load(case.hf_cls, write_checkpoint(src, tmp_path / "zeroed", zeroed))
    cfg, params = load_pretrained(src)
    pruned = prune(params, {}, {}, qk_channels, case.num_heads, case.d_head)
    assert pruned["decoder"]["layers"][0]["self_attn"]["qk"].widths == (3, 4, 2, 4)
    assert max_err(case.run_ours(pruned, cfg), case.run_hf(hf_zero)) <= TOL
    return cfg, pruned, hf_zero


def t5_narrow_params(cfg, seed: int):
    """Per-layer sizes below the config (d_kv 4, d_ff 24, 4 heads): fewer heads, narrower
    heads (T5 attention is unscaled, so any width exports exactly), narrower MLPs; the decoder's
    relative-bias table covers 3 heads only; encoder layer 1 then keeps heads (1, 3)."""
    enc = [LayerSizes(3, 4, 24), LayerSizes(4, 3, 16), LayerSizes(2, 4, 8)]
    dec = [LayerSizes(3, 4, 24), LayerSizes(1, 2, 12)]
    params = randomize_tree(jax.eval_shape(lambda: family_of(cfg).init(
        jax.random.PRNGKey(0), cfg, encoder_layers=enc, decoder_layers=dec)), seed)
    assert params["decoder"]["rel_bias"].shape == (8, 3)
    attn = nn.keep_heads(params["encoder"]["layers"][1]["attn"], [1, 3])
    return replace_paths(params, {"encoder/layers/1/attn": attn})


def test_t5_per_layer_sizes_export(t5_src, tmp_path):
    case = t5_case()
    cfg, _ = load_pretrained(t5_src)
    params = t5_narrow_params(cfg, 3)
    assert params["encoder"]["layers"][1]["attn"]["heads"].ids == (1, 3)
    hf = check_exported(case, cfg, params, tmp_path)
    # Kept heads sit at their original positions; removed ones are zero.
    q = hf.encoder.block[1].layer[0].SelfAttention.q.weight.detach().numpy()  # [16 = 4 x 4, d]
    assert not q[:4].any() and not q[8:12].any() and q[4:7].any() and not q[7:8].any()


def test_t5_exact_export_is_refused_when_impossible(t5_src):
    cfg, _ = load_pretrained(t5_src)
    init = family_of(cfg).init
    wide = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), cfg, encoder_layers=[
        LayerSizes(5, 4, 24), LayerSizes(4, 6, 24), LayerSizes(4, 4, 30)]))
    wide = randomize_tree(wide, 0)
    with pytest.raises(ShapeError) as e:
        state_dict_from_params(cfg, wide)
    msg = str(e.value)
    assert "encoder/layers/0/attn: 5 heads, more than the config's 4" in msg
    assert "encoder/layers/1/attn: query/key head widths (6, 6, 6, 6) wider than the config's 4" \
        in msg
    assert "encoder/layers/2/mlp: 30 hidden channels, more than the config's 24" in msg
    assert "encoder/rel_bias: a table over 5 heads, more than the config's 4" in msg


# ---------------------------------------------------------------------------------------------
# Chronos (a T5 whose config.json has a chronos_config; checked through ChronosPipeline).

CHRONOS_CONFIG = dict(
    tokenizer_class="MeanScaleUniformBins", tokenizer_kwargs={"low_limit": -15.0,
                                                              "high_limit": 15.0},
    context_length=16, prediction_length=4, n_tokens=40, n_special_tokens=2, pad_token_id=0,
    eos_token_id=1, use_eos_token=True, model_type="seq2seq", num_samples=3, temperature=1.0,
    top_k=50, top_p=1.0)
CHRONOS_KW = dict(T5_KW, num_layers=2, num_decoder_layers=2, feed_forward_proj="relu",
                  tie_word_embeddings=True, chronos_config=CHRONOS_CONFIG)


def chronos_case() -> Case:
    chronos_ref = pytest.importorskip("chronos")
    context = np.random.RandomState(0).rand(2, 12).astype(np.float32) * 5
    context[0, :3] = np.nan

    def run_hf(model):
        # The pipeline around the PyTorch model: its tokenizer, its encoder embedding and the
        # T5 logits on the tokenized context.
        cfg = chronos_ref.ChronosConfig(**CHRONOS_CONFIG)
        pipe = chronos_ref.ChronosPipeline(cfg.create_tokenizer(),
                                           chronos_ref.ChronosModel(cfg, model))
        ids, mask, _ = pipe.tokenizer.context_input_transform(torch.from_numpy(context))
        emb, _ = pipe.embed(torch.from_numpy(context))
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask.long(),
                           decoder_input_ids=torch.zeros((2, 3), dtype=torch.long)).logits
        return {"embed": emb.numpy(), "logits": logits.numpy()}

    def forward(params, cfg):
        emb, _ = chronos.embed(params, context, cfg)
        ids, mask, _ = chronos.context_input_transform(cfg, context)
        out = chronos.apply(params, {"input_ids": ids, "attention_mask": mask.astype(np.int32),
                                     "decoder_input_ids": np.zeros((2, 3), np.int32)}, cfg)
        return {"embed": emb, "logits": out["logits"]}

    def run_ours(params, cfg):
        out = jax.jit(lambda p: forward(p, cfg))(params)
        return {k: np.asarray(v) for k, v in out.items()}

    attn, mlp = t5_names(CHRONOS_KW)
    return Case(transformers.T5ForConditionalGeneration, 4, 4, 24, attn, mlp, run_hf, run_ours)


@pytest.fixture(scope="module")
def chronos_src(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**CHRONOS_KW))
    randomize_torch(model, 2)
    path = tmp_path_factory.mktemp("chronos_src")
    model.save_pretrained(path)
    return str(path)


def test_chronos_pruned_matches_zeroed_pytorch(chronos_src, tmp_path):
    heads = {"encoder/layers/0/attn": (1, 3), "encoder/layers/1/attn": (0, 1, 2, 3),
             "decoder/layers/0/self_attn": (0, 2, 3), "decoder/layers/0/cross_attn": (3,),
             "decoder/layers/1/self_attn": (2,), "decoder/layers/1/cross_attn": (0, 1)}
    hidden = {"encoder/layers/0/mlp": tuple(range(0, 24, 2)), "encoder/layers/1/mlp": (3, 4),
              "decoder/layers/0/mlp": tuple(range(24)), "decoder/layers/1/mlp": (0, 5, 17, 23)}
    cfg, _, _ = check_pruned(chronos_case(), chronos_src, tmp_path, heads, hidden)
    assert isinstance(cfg, chronos.ChronosConfig)


def test_chronos_per_layer_sizes_export(chronos_src, tmp_path):
    chronos_ref = pytest.importorskip("chronos")
    cfg, _ = load_pretrained(chronos_src)
    enc = [LayerSizes(2, 4, 12), LayerSizes(4, 3, 24)]
    dec = [LayerSizes(3, 2, 6), LayerSizes(4, 4, 20)]
    params = randomize_tree(jax.eval_shape(lambda: chronos.init(
        jax.random.PRNGKey(0), cfg, encoder_layers=enc, decoder_layers=dec)), 4)
    params = replace_paths(params, {"decoder/layers/1/cross_attn": nn.keep_heads(
        params["decoder"]["layers"][1]["cross_attn"], [0, 2])})
    check_exported(chronos_case(), cfg, params, tmp_path)
    pipe = chronos_ref.ChronosPipeline.from_pretrained(str(tmp_path / "export"))
    assert pipe.model.config.n_tokens == cfg.n_tokens  # the pipeline reads the export


# ---------------------------------------------------------------------------------------------
# Chronos-Bolt.

BOLT_KW = dict(d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=4,
               feed_forward_proj="relu", dropout_rate=0.0, decoder_start_token_id=0,
               pad_token_id=0, eos_token_id=1, relative_attention_num_buckets=8,
               relative_attention_max_distance=20,
               architectures=["ChronosBoltModelForForecasting"],
               chronos_config=dict(context_length=32, prediction_length=8, input_patch_size=4,
                                   input_patch_stride=4, quantiles=[0.1, 0.5, 0.9],
                                   use_reg_token=True))


def bolt_case() -> Case:
    bolt_ref = pytest.importorskip("chronos.chronos_bolt")
    rs = np.random.RandomState(0)
    context = (rs.standard_normal((3, 32)).cumsum(1) * 0.3).astype(np.float32)
    context[0, :9] = np.nan
    context[1, [5, 20]] = np.nan

    def run_hf(model):
        with torch.no_grad():
            return {"quantile_preds": model(context=torch.from_numpy(context))
                    .quantile_preds.numpy()}

    def run_ours(params, cfg):
        out = jax.jit(lambda p: chronos_bolt.apply(p, {"context": context}, cfg))(params)
        return {"quantile_preds": np.asarray(out["quantile_preds"])}

    attn, mlp = t5_names(dict(BOLT_KW, feed_forward_proj="relu"))
    return Case(bolt_ref.ChronosBoltModelForForecasting, 4, 4, 24, attn, mlp, run_hf, run_ours)


@pytest.fixture(scope="module")
def bolt_src(tmp_path_factory):
    bolt_ref = pytest.importorskip("chronos.chronos_bolt")
    torch.manual_seed(0)
    model = bolt_ref.ChronosBoltModelForForecasting(transformers.T5Config(**BOLT_KW))
    randomize_torch(model, 3)
    path = tmp_path_factory.mktemp("bolt_src")
    model.save_pretrained(path)
    return str(path)


def test_chronos_bolt_pruned_matches_zeroed_pytorch(bolt_src, tmp_path):
    heads = {"encoder/layers/0/attn": (0, 2, 3), "encoder/layers/1/attn": (1,),
             "decoder/layers/0/self_attn": (0, 1, 2, 3), "decoder/layers/0/cross_attn": (0, 3),
             "decoder/layers/1/self_attn": (1, 2), "decoder/layers/1/cross_attn": (0, 1, 2)}
    hidden = {"encoder/layers/0/mlp": tuple(range(24)), "encoder/layers/1/mlp": (1, 2, 9, 10),
              "decoder/layers/0/mlp": tuple(range(6, 24)), "decoder/layers/1/mlp": (11,)}
    cfg, _, _ = check_pruned(bolt_case(), bolt_src, tmp_path, heads, hidden)
    assert isinstance(cfg, chronos_bolt.ChronosBoltConfig)


def test_chronos_bolt_per_layer_sizes_export(bolt_src, tmp_path):
    cfg, _ = load_pretrained(bolt_src)
    enc = [LayerSizes(4, 4, 10), LayerSizes(2, 3, 24)]
    dec = [LayerSizes(3, 4, 24), LayerSizes(1, 4, 4)]
    params = randomize_tree(jax.eval_shape(lambda: chronos_bolt.init(
        jax.random.PRNGKey(0), cfg, encoder_layers=enc, decoder_layers=dec)), 5)
    params = replace_paths(params, {"encoder/layers/0/attn": nn.keep_heads(
        params["encoder"]["layers"][0]["attn"], [0, 3])})
    check_exported(bolt_case(), cfg, params, tmp_path)


# ---------------------------------------------------------------------------------------------
# DeiT with teacher head (the ViT code path plus the distillation token and second head).

DEIT_KW = dict(image_size=16, patch_size=8, num_channels=3, hidden_size=16,
               num_hidden_layers=3, num_attention_heads=4, intermediate_size=24, num_labels=3)


def deit_case() -> Case:
    x = np.random.RandomState(0).randn(2, 3, 16, 16).astype(np.float32)
    heads_out = ("logits", "cls_logits", "distillation_logits")

    def run_hf(model):
        with torch.no_grad():
            out = model(pixel_values=torch.from_numpy(x))
        return {k: out[k].numpy() for k in heads_out}

    def run_ours(params, cfg):
        out = jax.jit(lambda p: vit.apply(p, {"pixel_values": x}, cfg))(params)
        return {k: np.asarray(out[k]) for k in heads_out}

    attn, mlp = {}, {}
    for i in range(DEIT_KW["num_hidden_layers"]):
        k = f"deit.encoder.layer.{i}."
        a = f"{k}attention.attention."
        attn[f"encoder/layers/{i}/attn"] = ({"q": f"{a}query", "k": f"{a}key", "v": f"{a}value",
                                             "o": f"{k}attention.output.dense"}, True)
        mlp[f"encoder/layers/{i}/mlp"] = ([f"{k}intermediate.dense"], f"{k}output.dense", True)
    return Case(transformers.DeiTForImageClassificationWithTeacher, 4, 4, 24, attn, mlp, run_hf,
                run_ours)


@pytest.fixture(scope="module")
def deit_src(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.DeiTForImageClassificationWithTeacher(
        transformers.DeiTConfig(**DEIT_KW))
    randomize_torch(model, 4)
    path = tmp_path_factory.mktemp("deit_src")
    model.save_pretrained(path)
    return str(path)


def test_deit_pruned_matches_zeroed_pytorch(deit_src, tmp_path):
    heads = {"encoder/layers/0/attn": (1, 2), "encoder/layers/1/attn": (0, 1, 2, 3),
             "encoder/layers/2/attn": (0, 3)}
    hidden = {"encoder/layers/0/mlp": tuple(range(24)), "encoder/layers/1/mlp": (2, 3, 5, 7, 11),
              "encoder/layers/2/mlp": tuple(range(12, 24))}
    cfg, pruned, _ = check_pruned(deit_case(), deit_src, tmp_path, heads, hidden)
    # Scaled attention keeps the original 1/sqrt(d_head) after heads are removed.
    assert pruned["encoder"]["layers"][0]["attn"]["heads"].scale == pytest.approx(0.5)


def test_deit_per_layer_sizes_export(deit_src, tmp_path):
    cfg, _ = load_pretrained(deit_src)
    sizes = [LayerSizes(2, 4, 24), LayerSizes(4, 4, 7), LayerSizes(3, 4, 16)]
    params = randomize_tree(jax.eval_shape(lambda: vit.init(jax.random.PRNGKey(0), cfg,
                                                            layers=sizes)), 6)
    params = replace_paths(params, {"encoder/layers/1/attn": nn.keep_heads(
        params["encoder"]["layers"][1]["attn"], [1, 2, 3])})
    check_exported(deit_case(), cfg, params, tmp_path)


def test_scaled_attention_with_another_head_width_is_refused(deit_src):
    """ViT scales logits by 1/sqrt(hidden_size / heads); a layer initialized with another head
    width has another scale, which a Hugging Face checkpoint cannot express."""
    cfg, _ = load_pretrained(deit_src)
    params = jax.eval_shape(lambda: vit.init(jax.random.PRNGKey(0), cfg, layers=[
        LayerSizes(4, 4, 24), LayerSizes(4, 2, 24), LayerSizes(4, 4, 24)]))
    with pytest.raises(ShapeError, match=r"encoder/layers/1/attn: logit scale 0\.707107, but "
                                         r"the PyTorch class applies 0\.5"):
        state_dict_from_params(cfg, randomize_tree(params, 0))


# ---------------------------------------------------------------------------------------------
# BERT (a classifier: prefixed base-model keys, post-norm layers).

BERT_KW = dict(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
               intermediate_size=24, max_position_embeddings=16, type_vocab_size=2,
               num_labels=3)


def bert_case() -> Case:
    rs = np.random.RandomState(0)
    ids = rs.randint(0, 40, (2, 9))
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    types = rs.randint(0, 2, (2, 9))

    def run_hf(model):
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                        token_type_ids=torch.from_numpy(types), output_hidden_states=True)
        return {"logits": out.logits.numpy(), "last_hidden_state": out.hidden_states[-1].numpy()}

    def run_ours(params, cfg):
        out = jax.jit(lambda p: bert.apply(p, {"input_ids": ids, "attention_mask": mask,
                                               "token_type_ids": types}, cfg))(params)
        return {k: np.asarray(out[k]) for k in ("logits", "last_hidden_state")}

    attn, mlp = {}, {}
    for i in range(BERT_KW["num_hidden_layers"]):
        k = f"bert.encoder.layer.{i}."
        a = f"{k}attention.self."
        attn[f"encoder/layers/{i}/attn"] = ({"q": f"{a}query", "k": f"{a}key", "v": f"{a}value",
                                             "o": f"{k}attention.output.dense"}, True)
        mlp[f"encoder/layers/{i}/mlp"] = ([f"{k}intermediate.dense"], f"{k}output.dense", True)
    return Case(transformers.BertForSequenceClassification, 4, 4, 24, attn, mlp, run_hf,
                run_ours)


@pytest.fixture(scope="module")
def bert_src(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT_KW))
    randomize_torch(model, 5)
    path = tmp_path_factory.mktemp("bert_src")
    model.save_pretrained(path)
    return str(path)


def test_bert_pruned_matches_zeroed_pytorch(bert_src, tmp_path):
    heads = {"encoder/layers/0/attn": (0, 1, 2, 3), "encoder/layers/1/attn": (3,),
             "encoder/layers/2/attn": (0, 2)}
    hidden = {"encoder/layers/0/mlp": (0, 1, 2, 20), "encoder/layers/1/mlp": tuple(range(24)),
              "encoder/layers/2/mlp": tuple(range(1, 24, 3))}
    check_pruned(bert_case(), bert_src, tmp_path, heads, hidden)


def test_bert_per_layer_sizes_export(bert_src, tmp_path):
    cfg, _ = load_pretrained(bert_src)
    sizes = [LayerSizes(4, 4, 9), LayerSizes(1, 4, 24), LayerSizes(3, 4, 18)]
    params = randomize_tree(jax.eval_shape(lambda: bert.init(jax.random.PRNGKey(0), cfg,
                                                             layers=sizes)), 7)
    params = replace_paths(params, {"encoder/layers/2/attn": nn.keep_heads(
        params["encoder"]["layers"][2]["attn"], [0, 2])})
    check_exported(bert_case(), cfg, params, tmp_path)


# ---------------------------------------------------------------------------------------------
# Query-key objects other than QueryKey.

def test_other_query_key_objects_export_exactly_or_are_refused(t5_src, joint_qk):
    """A query-key object of a type the exporter has never seen is rewritten as q/k weights by
    a per-head SVD of its joint tensor: exact when every slice has rank <= the head width (the
    exported ``W^Q_h (W^K_h)^T`` equal the slices, checked in NumPy), refused with a
    ``ShapeError`` naming the block and the heads when a slice's rank is larger."""
    cfg, params = load_pretrained(t5_src)
    attn = params["decoder"]["layers"][1]["cross_attn"]
    d_kv, heads = cfg.d_kv, cfg.num_heads
    rng = np.random.default_rng(3)
    ranks = (0, 1, d_kv, 2)  # a zero slice, rank 1, full head width, rank 2
    slices = []
    for r in ranks:  # small integer factors: the slices are exactly of rank r in float32
        a, b = rng.integers(-3, 4, size=(cfg.d_model, r)), rng.integers(-3, 4, size=(cfg.d_model, r))
        slices.append((a @ b.T).astype(np.float64))
    y = np.stack(slices, axis=-1).astype(np.float32)
    good = replace_paths(params, {"decoder/layers/1/cross_attn": {**attn, "qk": joint_qk(
        jnp.asarray(y), heads)}})
    sd, _, _ = state_dict_from_params(cfg, good)
    pre = "decoder.block.1.layer.1.EncDecAttention."
    wq, wk = np.asarray(sd[pre + "q.weight"]).T, np.asarray(sd[pre + "k.weight"]).T
    for h in range(heads):
        cols = slice(h * d_kv, (h + 1) * d_kv)
        got = wq[:, cols].astype(np.float64) @ wk[:, cols].astype(np.float64).T
        np.testing.assert_allclose(got, y[..., h], rtol=0, atol=1e-4 * np.abs(y).max(),
                                   err_msg=f"head {h}")
    y[..., 3] = rng.normal(size=(cfg.d_model, cfg.d_model))  # full rank 16 > d_kv
    bad = replace_paths(params, {"decoder/layers/1/cross_attn": {**attn, "qk": joint_qk(
        jnp.asarray(y), heads)}})
    with pytest.raises(ShapeError, match="decoder/layers/1/cross_attn"):
        state_dict_from_params(cfg, bad)
