"""The source's config.json and generation_config.json survive convert -> save/load -> export.

For every family (T5, Chronos, Chronos-Bolt, ViT, DeiT, BERT) a tiny random Hugging Face model
with settings lowrank_jax does not model (dropout 0.0 where the default is 0.1, an initializer
factor, ``use_cache=False``, named labels, a generation config with non-default fields) is
saved with ``save_pretrained`` and taken through the Python API (``load_pretrained`` ->
``save_model`` -> ``load_model`` -> ``save_pretrained``) and through the command line
(``convert`` -> ``compress`` -> ``export``). The exported files must equal the source's except
the bookkeeping keys listed in ``BOOKKEEPING``; a model whose config changed (an MLP narrowed
and the config's width with it, a nested ``chronos_config`` entry, bfloat16 tensors exported
as float32) must differ in exactly those fields. Every export must load in transformers and
give the JAX model's outputs to 1e-4. A checkpoint that records no source files (a 0.1
fixture) exports as before.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax import io as lio  # noqa: E402
from lowrank_jax import nn  # noqa: E402
from lowrank_jax.cli.main import main  # noqa: E402
from lowrank_jax.convert import load_pretrained, save_pretrained  # noqa: E402
from lowrank_jax.leaves import Dense, get_path, named_leaves, replace_paths  # noqa: E402
from lowrank_jax.models import apply as model_apply  # noqa: E402

torch.set_num_threads(1)

MODEL = 1e-4  # whole-model float32 parity (design.md)
#: Keys an unchanged export may write differently from the source (none is rewritten now:
#: the source's transformers_version is kept, as the file keeps that version's conventions).
BOOKKEEPING = frozenset({"transformers_version"})
#: ... and in a config reloaded by transformers: ``from_pretrained`` records the directory.
RELOADED = BOOKKEEPING | {"_name_or_path"}
#: Non-default decoding settings of the generative sources.
GENERATION = {"max_new_tokens": 11, "num_beams": 3, "length_penalty": 0.6,
              "no_repeat_ngram_size": 2}

_forward = jax.jit(model_apply, static_argnums=2)  # a config carrying files is a static arg
_MISSING = object()


def differing(a: dict, b: dict) -> set:
    """The keys whose values differ between two dicts (a key missing from one counts)."""
    return {k for k in a.keys() | b.keys() if a.get(k, _MISSING) != b.get(k, _MISSING)}


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# The families: a tiny Hugging Face model with non-default settings, its inputs, its outputs.

T5_SETTINGS = dict(dropout_rate=0.0, initializer_factor=0.37, use_cache=False,
                   classifier_dropout=0.25)
T5_SIZES = dict(vocab_size=40, d_model=16, d_kv=6, d_ff=24, num_layers=2, num_heads=2,
                relative_attention_num_buckets=8, relative_attention_max_distance=20,
                decoder_start_token_id=0)
CHRONOS_CONFIG = dict(
    tokenizer_class="MeanScaleUniformBins",
    tokenizer_kwargs={"low_limit": -15.0, "high_limit": 15.0}, context_length=16,
    prediction_length=4, n_tokens=40, n_special_tokens=2, pad_token_id=0, eos_token_id=1,
    use_eos_token=True, model_type="seq2seq", num_samples=3, temperature=1.0, top_k=50,
    top_p=1.0)
VIT_SETTINGS = dict(hidden_dropout_prob=0.05, attention_probs_dropout_prob=0.07,
                    initializer_range=0.03)
BERT_SETTINGS = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     initializer_range=0.05, classifier_dropout=0.3, use_cache=False)
LABELS = {0: "cat", 1: "dog", 2: "owl"}


@dataclasses.dataclass
class Family:
    """A source model: its class, the non-default settings to find again, sample inputs and
    the output compared."""

    name: str
    hf_cls: type
    settings: dict
    inputs: dict  # name -> np.ndarray, the same names for transformers and lowrank_jax
    output: str
    generative: bool


def _t5_ids(seed=0):
    rs = np.random.RandomState(seed)
    return {"input_ids": rs.randint(2, 40, (2, 7)), "decoder_input_ids": rs.randint(2, 40, (2, 5))}


def _build_t5(kind):
    cfg = transformers.T5Config(**T5_SIZES, **T5_SETTINGS, feed_forward_proj="gated-gelu",
                                **({"chronos_config": CHRONOS_CONFIG} if kind == "chronos"
                                   else {}))
    model = transformers.T5ForConditionalGeneration(cfg)
    for k, v in GENERATION.items():
        setattr(model.generation_config, k, v)
    return model, Family(kind, transformers.T5ForConditionalGeneration,
                         {**T5_SETTINGS, **({"chronos_config": CHRONOS_CONFIG}
                                            if kind == "chronos" else {})},
                         _t5_ids(), "logits", True)


def _build_bolt():
    bolt = pytest.importorskip("chronos.chronos_bolt")
    chronos_config = dict(context_length=32, prediction_length=8, input_patch_size=4,
                          input_patch_stride=4, quantiles=[0.1, 0.5, 0.9], use_reg_token=True)
    cfg = transformers.T5Config(
        d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=1, num_heads=4,
        feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        architectures=["ChronosBoltModelForForecasting"], chronos_config=chronos_config,
        **T5_SETTINGS)
    context = np.random.RandomState(0).rand(2, 30).astype(np.float32) * 4
    return bolt.ChronosBoltModelForForecasting(cfg), Family(
        "chronos_bolt", bolt.ChronosBoltModelForForecasting,
        {**T5_SETTINGS, "chronos_config": chronos_config}, {"context": context},
        "quantile_preds", False)


def _build_vit(kind):
    base = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, **VIT_SETTINGS)
    if kind == "vit":
        cls, cfg = transformers.ViTForImageClassification, transformers.ViTConfig(**base)
    else:
        cls = transformers.DeiTForImageClassificationWithTeacher
        cfg = transformers.DeiTConfig(**base)
    pixels = np.random.RandomState(1).randn(2, 3, 32, 32).astype(np.float32)
    return cls(cfg), Family(kind, cls, {**VIT_SETTINGS, "id2label": LABELS},
                            {"pixel_values": pixels}, "logits", False)


def _build_bert():
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=48,
                                  max_position_embeddings=16, id2label=LABELS,
                                  label2id={v: k for k, v in LABELS.items()},
                                  problem_type="single_label_classification", **BERT_SETTINGS)
    ids = np.random.RandomState(2).randint(0, 40, (2, 9))
    return transformers.BertForSequenceClassification(cfg), Family(
        "bert", transformers.BertForSequenceClassification,
        {**BERT_SETTINGS, "id2label": LABELS, "problem_type": "single_label_classification"},
        {"input_ids": ids}, "logits", False)


BUILDERS = {"t5": lambda: _build_t5("t5"), "chronos": lambda: _build_t5("chronos"),
            "chronos_bolt": _build_bolt, "vit": lambda: _build_vit("vit"),
            "deit": lambda: _build_vit("deit"), "bert": _build_bert}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def source(request, tmp_path_factory, randomize):
    """``(family, torch model, source directory)``: the model saved by transformers."""
    torch.manual_seed(0)
    model, fam = BUILDERS[request.param]()
    model = randomize(model, 11)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(str(path))
    return fam, model, path


def hf_load(cls, path):
    """``cls.from_pretrained`` insisting on a complete, exactly matching checkpoint."""
    model, info = cls.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def hf_outputs(model, fam: Family) -> np.ndarray:
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in fam.inputs.items()})
    return getattr(out, fam.output).numpy()


def our_outputs(params, cfg, fam: Family) -> np.ndarray:
    return np.asarray(_forward(params, fam.inputs, cfg)[fam.output])


def check_settings(model, fam: Family) -> None:
    """The reloaded transformers model has the source's non-default settings."""
    for k, v in fam.settings.items():
        assert getattr(model.config, k) == v, k
    if fam.generative:
        for k, v in GENERATION.items():
            assert getattr(model.generation_config, k) == v, k
        assert model.generation_config.use_cache is False


def assert_same_files(src, out, *, changed=frozenset()) -> dict:
    """``out`` holds the source's configuration files: the same file names (besides the
    weights and the CLI's marker), the same generation config, and a config.json that differs
    in ``changed`` and the bookkeeping keys at most. Returns the exported config.json."""
    extra = {"lowrank_jax_output.json"}
    names = sorted(n for n in os.listdir(src) if n.endswith(".json"))
    assert sorted(n for n in os.listdir(out) if n.endswith(".json") and n not in extra) == names
    for name in names:
        diff = differing(read_json(src / name), read_json(out / name))
        allowed = (BOOKKEEPING | changed) if name == "config.json" else BOOKKEEPING
        assert diff <= allowed, (name, {k: (read_json(src / name).get(k),
                                            read_json(out / name).get(k)) for k in diff})
    return read_json(out / "config.json")


# ---------------------------------------------------------------------------------------------
# Unchanged models: the Python API and the command line.

def test_python_api_keeps_the_configuration_files(source, tmp_path):
    fam, model, src = source
    cfg, params = load_pretrained(src)
    lio.save_model(tmp_path / "ckpt", cfg, params)
    cfg2, params2 = lio.load_model(tmp_path / "ckpt")
    summary = save_pretrained(cfg2, params2, tmp_path / "out")
    assert_same_files(src, tmp_path / "out")
    assert summary["config_changed"] == []
    assert ("generation_config.json" in summary["files"]) == fam.generative
    back = hf_load(fam.hf_cls, tmp_path / "out")
    assert differing(back.config.to_dict(), model.config.to_dict()) <= RELOADED
    check_settings(back, fam)
    ours = our_outputs(params2, cfg2, fam)
    assert np.max(np.abs(hf_outputs(back, fam) - ours)) <= MODEL
    assert np.max(np.abs(hf_outputs(model, fam) - ours)) <= MODEL


def test_command_line_keeps_the_configuration_files(source, tmp_path, capsys):
    fam, model, src = source
    native, small, out = tmp_path / "native", tmp_path / "small", tmp_path / "out"
    assert main(["convert", str(src), "--out", str(native), "--no-progress"]) == 0
    assert main(["compress", str(native), "--rank", "2", "--out", str(small), "--no-eval",
                 "--no-progress"]) == 0
    assert main(["export", str(small), "--out", str(out), "--no-progress", "--json",
                 str(tmp_path / "export.json")]) == 0
    capsys.readouterr()
    assert_same_files(src, out)  # the configuration files are the source's...
    summary = read_json(tmp_path / "export.json")
    assert summary["config_changed"] == [] and summary["materialized"]  # ...though compressed
    back = hf_load(fam.hf_cls, out)
    check_settings(back, fam)
    cfg, params = lio.load_model(small)
    ours = our_outputs(params, cfg, fam)
    assert np.max(np.abs(hf_outputs(back, fam) - ours)) <= MODEL
    assert np.max(np.abs(hf_outputs(model, fam) - ours)) > 1e-3  # rank 2 changed the model


# ---------------------------------------------------------------------------------------------
# Changed configs: exactly the changed fields differ.

def _narrow_mlps(params, cfg, width: int, d_ff: int, name: str):
    """Every MLP physically narrowed to ``width`` of its ``d_ff`` channels (different ones per
    layer) and the config's width set to ``width``."""
    rs = np.random.RandomState(3)
    blocks = sorted({p.rsplit("/", 1)[0] for p, _ in named_leaves(params)
                     if p.endswith("/mlp/wo")})
    assert blocks
    new = {b: nn.keep_hidden(get_path(params, b), np.sort(rs.permutation(d_ff)[:width]))
           for b in blocks}
    return replace_paths(params, new), dataclasses.replace(cfg, **{name: width})


@pytest.mark.parametrize("case", ["t5_d_ff", "bert_intermediate_size", "chronos_nested"])
def test_changed_fields_are_the_only_differences(case, tmp_path, randomize):
    kind = case.split("_")[0]
    torch.manual_seed(0)
    model, fam = BUILDERS[kind]()
    model = randomize(model, 12)
    src = tmp_path / "hf"
    model.save_pretrained(str(src))
    if case == "chronos_nested":  # an entry lowrank_jax does not model (a newer release's)
        hf_config = read_json(src / "config.json")
        hf_config["chronos_config"]["unmodelled_entry"] = [1, "kept"]
        (src / "config.json").write_text(json.dumps(hf_config))
    cfg, params = load_pretrained(src)
    if case == "t5_d_ff":
        params, cfg = _narrow_mlps(params, cfg, 16, 24, "d_ff")
        # one head of the first encoder layer removed: zero-padded, the config keeps num_heads
        attn = "encoder/layers/0/attn"
        params = replace_paths(params, {attn: nn.keep_heads(get_path(params, attn), [1])})
        changed = {"d_ff": 16}
    elif case == "bert_intermediate_size":
        params, cfg = _narrow_mlps(params, cfg, 32, 48, "intermediate_size")
        changed = {"intermediate_size": 32}
    else:
        cfg = dataclasses.replace(cfg, prediction_length=6)
        changed = {"chronos_config": {**CHRONOS_CONFIG, "prediction_length": 6,
                                      "unmodelled_entry": [1, "kept"]}}
    lio.save_model(tmp_path / "ckpt", cfg, params)
    cfg, params = lio.load_model(tmp_path / "ckpt")
    summary = save_pretrained(cfg, params, tmp_path / "out")
    written = assert_same_files(src, tmp_path / "out", changed=frozenset(changed))
    assert summary["config_changed"] == sorted(changed)
    assert {k: written[k] for k in changed} == changed
    if case == "chronos_nested":  # the other chronos_config entries are the source's
        source_cc = read_json(src / "config.json")["chronos_config"]
        assert differing(source_cc, written["chronos_config"]) == {"prediction_length"}
    else:
        assert summary["widened"] == (["encoder/layers/0/attn"] if kind == "t5" else [])
    back = hf_load(fam.hf_cls, tmp_path / "out")
    check_settings(back, dataclasses.replace(fam, settings={
        k: v for k, v in fam.settings.items() if k not in changed}))
    ours = our_outputs(params, cfg, fam)
    assert np.max(np.abs(hf_outputs(back, fam) - ours)) <= MODEL
    assert load_pretrained(tmp_path / "out")[0] == cfg


def test_bfloat16_source_exports_float32_and_says_so(tmp_path, randomize):
    torch.manual_seed(0)
    model, fam = BUILDERS["t5"]()
    model = randomize(model, 13).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "hf"))
    assert read_json(tmp_path / "hf" / "config.json")["dtype"] == "bfloat16"
    cfg, params = load_pretrained(tmp_path / "hf")
    summary = save_pretrained(cfg, params, tmp_path / "out")
    written = assert_same_files(tmp_path / "hf", tmp_path / "out", changed=frozenset({"dtype"}))
    assert written["dtype"] == "float32" and summary["config_changed"] == ["dtype"]
    back = hf_load(fam.hf_cls, tmp_path / "out")
    assert back.dtype == torch.float32
    assert np.max(np.abs(hf_outputs(back, fam) - our_outputs(params, cfg, fam))) <= MODEL


def test_live_module_source_records_what_its_save_pretrained_writes(tmp_path, randomize):
    """``load_pretrained(model)``: the config and generation config of the module, as its own
    ``save_pretrained`` would write them (architecture included; the tensors' dtype, which
    ``save_pretrained`` adds from the module, is left out: the export's tensors are float32,
    which transformers reads without it)."""
    torch.manual_seed(0)
    model, fam = BUILDERS["t5"]()
    model = randomize(model, 14)
    cfg, params = load_pretrained(model)
    save_pretrained(cfg, params, tmp_path / "out")
    model.save_pretrained(str(tmp_path / "hf"))
    written = assert_same_files(tmp_path / "hf", tmp_path / "out", changed=frozenset({"dtype"}))
    assert written["architectures"] == ["T5ForConditionalGeneration"] and "dtype" not in written
    check_settings(hf_load(fam.hf_cls, tmp_path / "out"), fam)


def test_a_change_that_depends_on_a_default_writes_the_field_it_depends_on(tmp_path):
    """A transformers 4 T5 file has no ``scale_decoder_outputs`` (it follows
    ``tie_word_embeddings``). Untying the head while keeping the scaling changes
    ``tie_word_embeddings``; written alone, the file would read back unscaled, so the export
    also writes ``scale_decoder_outputs`` and reads back as the exported config."""
    torch.manual_seed(0)
    model, _ = BUILDERS["t5"]()
    model.save_pretrained(str(tmp_path / "hf"))
    old = read_json(tmp_path / "hf" / "config.json")
    del old["scale_decoder_outputs"]
    old["tie_word_embeddings"] = True
    (tmp_path / "hf" / "config.json").write_text(json.dumps(old))
    cfg, params = load_pretrained(tmp_path / "hf")
    assert cfg.tie_word_embeddings and cfg.scales_decoder_outputs
    untied = dataclasses.replace(cfg, tie_word_embeddings=False, scale_decoder_outputs=True)
    params = dict(params, lm_head=Dense(w=np.asarray(params["shared"]).T.copy()))
    summary = save_pretrained(untied, params, tmp_path / "out")
    written = read_json(tmp_path / "out" / "config.json")
    assert written["tie_word_embeddings"] is False and written["scale_decoder_outputs"] is True
    assert set(summary["config_changed"]) == {"tie_word_embeddings", "scale_decoder_outputs"}
    back = load_pretrained(tmp_path / "out")[0]
    assert back.to_hf_dict() == untied.to_hf_dict()
    assert differing(old, written) == {"tie_word_embeddings", "scale_decoder_outputs"}


# ---------------------------------------------------------------------------------------------
# Checkpoints without recorded files export as before.

V1 = os.path.join(os.path.dirname(os.path.dirname(__file__)), "io", "data", "v1")


def test_checkpoint_without_recorded_files_exports_its_config_alone(tmp_path, capsys):
    """A lowrank_jax 0.1 checkpoint (no source files in its metadata): config.json is what the
    config determines, no generation_config.json, and transformers reproduces the outputs the
    0.1 release recorded for the fixture."""
    out = tmp_path / "out"
    assert main(["export", os.path.join(V1, "t5"), "--out", str(out), "--no-progress",
                 "--json", str(tmp_path / "export.json")]) == 0
    capsys.readouterr()
    assert read_json(tmp_path / "export.json")["config_changed"] is None
    assert sorted(os.listdir(out)) == ["config.json", "lowrank_jax_output.json",
                                       "model.safetensors"]
    cfg, _ = lio.load_model(os.path.join(V1, "t5"))
    assert read_json(out / "config.json") == json.loads(json.dumps(cfg.to_hf_dict()))
    ref = np.load(os.path.join(V1, "t5.npz"))
    back = hf_load(transformers.T5ForConditionalGeneration, out)
    with torch.no_grad():
        logits = back(input_ids=torch.from_numpy(ref["in_input_ids"]).long(),
                      attention_mask=torch.from_numpy(ref["in_attention_mask"]).long(),
                      decoder_input_ids=torch.from_numpy(ref["in_decoder_input_ids"]).long()
                      ).logits.numpy()
    assert np.max(np.abs(logits - ref["out_logits"])) <= MODEL
