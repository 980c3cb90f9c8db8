"""BERT encoder (Devlin et al. 2019): the computation of Hugging Face ``BertModel`` in eval mode.

Word + absolute position + token-type embeddings and a LayerNorm, a post-norm encoder
(``norm(x + f(x))``) with scaled, biased attention and an exact-gelu MLP, and a pooler (dense +
tanh on the ``[CLS]`` token). Optionally the ``BertForSequenceClassification`` head on the
pooled output. Built from :mod:`lowrank_jax.nn` blocks, so every weight matrix is a leaf.

Parameter tree::

    embeddings/word        [vocab_size, d]
    embeddings/position    [max_position_embeddings, d]
    embeddings/token_type  [type_vocab_size, d]
    embeddings/norm        {'scale', 'bias'} [d]
    encoder                see lowrank_jax.nn.init_encoder (no 'final_norm': post-norm)
    pooler                 leaf [d, d]              (if cfg.pooler)
    classifier             leaf [d, num_labels]     (if cfg.num_labels > 0)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.leaves import init_dense, linear
from lowrank_jax.models.common import check_inputs, check_token_ids, layer_sizes
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.models.hf import (
    HFConfigFiles,
    HFRow,
    HFSpec,
    hf_files_field,
    linear_rows,
    norm_rows,
)
from lowrank_jax.models.vit import (
    activation_from_hf,
    activation_to_hf,
    hf_encoder_rows,
    hf_labels,
    hf_load_kwargs,
    layernorm_encoder,
    layernorm_encoder_sizes,
)
from lowrank_jax.nn import (
    EncoderConfig,
    LayerSizes,
    NormConfig,
    apply_encoder,
    apply_norm,
    init_encoder,
    init_norm,
    padding_mask,
)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT configuration (field names as in Hugging Face ``BertConfig``).

    Attributes:
      vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size: sizes.
      hidden_act: lowrank_jax activation name (``'gelu'`` is the exact erf form, as HF).
      max_position_embeddings: rows of the absolute position table (longest input).
      type_vocab_size: number of token types (segments).
      layer_norm_eps: LayerNorm epsilon.
      pooler: dense + tanh on ``[CLS]`` (``BertModel(add_pooling_layer=True)``).
      num_labels: ``BertForSequenceClassification`` head on the pooled output; ``0`` = none.
      hf_files: the Hugging Face configuration files the model was loaded from (set by
        ``load_pretrained``; see :class:`~lowrank_jax.models.hf.HFConfigFiles`), written back
        by an export; not compared, hashed or shown.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pooler: bool = True
    num_labels: int = 0
    hf_files: HFConfigFiles | None = hf_files_field()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ConfigError(f"BertConfig: {name} must be a positive int, got {val!r}")
        if not isinstance(self.num_labels, int) or self.num_labels < 0:
            raise ConfigError(f"BertConfig: num_labels must be an int >= 0, got "
                             f"{self.num_labels!r}")
        if self.num_labels > 0 and not self.pooler:
            raise ConfigError("BertConfig: a classification head (num_labels > 0) needs the "
                             "pooler (pooler=True), as BertForSequenceClassification")
        self.encoder  # noqa: B018  (the nn configs validate activation, eps)
        self.encoder_sizes  # noqa: B018  (heads must divide the width)

    @property
    def encoder(self) -> EncoderConfig:
        return layernorm_encoder(self, prenorm=False)

    @property
    def encoder_sizes(self) -> tuple[LayerSizes, ...]:
        return layernorm_encoder_sizes(self)

    @property
    def embedding_norm(self) -> NormConfig:
        return NormConfig(kind="layer", eps=self.layer_norm_eps)

    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "BertConfig":
        """Configuration from a Hugging Face ``config.json`` dict (``model_type`` bert).

        ``BertForSequenceClassification`` gets ``num_labels`` classes; other architectures a
        pooler and no head. ``add_pooling_layer`` is not recorded in ``config.json``: pass
        ``pooler=False`` (the converter decides from the checkpoint's keys).

        Args:
          d: the parsed ``config.json``.
          **overrides: fields to set explicitly after reading ``d``.

        Returns:
          The configuration.
        """
        if d.get("model_type", "bert") != "bert":
            raise ConfigError(f"BertConfig.from_hf_dict: model_type must be 'bert', "
                             f"got {d.get('model_type')!r}")
        if d.get("is_decoder", False) or d.get("add_cross_attention", False):
            raise ConfigError("BertConfig.from_hf_dict: only the bidirectional encoder is "
                             "supported (is_decoder and add_cross_attention must be false)")
        pet = d.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise ConfigError(f"BertConfig.from_hf_dict: position_embedding_type must be "
                             f"'absolute', got {pet!r}")
        arch = (d.get("architectures") or [""])[0]
        is_classifier = arch.endswith("ForSequenceClassification")
        n_labels = len(d["id2label"]) if "id2label" in d else int(d.get("num_labels", 2))
        kwargs = dict(
            vocab_size=d.get("vocab_size", 30522),
            hidden_size=d.get("hidden_size", 768),
            num_hidden_layers=d.get("num_hidden_layers", 12),
            num_attention_heads=d.get("num_attention_heads", 12),
            intermediate_size=d.get("intermediate_size", 3072),
            hidden_act=activation_from_hf(d.get("hidden_act", "gelu"),
                                          "BertConfig.from_hf_dict"),
            max_position_embeddings=d.get("max_position_embeddings", 512),
            type_vocab_size=d.get("type_vocab_size", 2),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            pooler=True,
            num_labels=n_labels if is_classifier else 0,
        )
        kwargs.update(overrides)
        return cls(**kwargs)


    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` of this configuration (``BertModel`` or
        ``BertForSequenceClassification``)."""
        arch = "BertForSequenceClassification" if self.num_labels > 0 else "BertModel"
        d = {
            "model_type": "bert", "architectures": [arch],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": activation_to_hf(self.hidden_act, "BertConfig"),
            "max_position_embeddings": self.max_position_embeddings,
            "type_vocab_size": self.type_vocab_size, "layer_norm_eps": self.layer_norm_eps,
            "position_embedding_type": "absolute", "is_decoder": False,
            "add_cross_attention": False,
        }
        if self.num_labels > 0:
            d.update(hf_labels(self.num_labels))
        return d


def init(key: Array, cfg: BertConfig, *, layers=None) -> dict:
    """Random parameters (Dense leaves; embeddings ``N(0, 0.02^2)`` as HF).

    Args:
      key: PRNG key.
      cfg: model configuration.
      layers: optional per-layer :class:`~lowrank_jax.nn.LayerSizes` (default
        ``cfg.encoder_sizes``).

    Returns:
      The parameter tree described in the module docstring.
    """
    kw, kp, kt, ke, kpool, kh = jax.random.split(key, 6)
    d = cfg.hidden_size
    params = {
        "embeddings": {
            "word": 0.02 * jax.random.normal(kw, (cfg.vocab_size, d), jnp.float32),
            "position": 0.02 * jax.random.normal(kp, (cfg.max_position_embeddings, d),
                                                 jnp.float32),
            "token_type": 0.02 * jax.random.normal(kt, (cfg.type_vocab_size, d), jnp.float32),
            "norm": init_norm(d, cfg.embedding_norm),
        },
        "encoder": init_encoder(ke, cfg.encoder, d_model=d, layers=layer_sizes(
            layers, cfg.encoder_sizes, "bert.init: layers", cfg.num_hidden_layers)),
    }
    if cfg.pooler:
        params["pooler"] = init_dense(kpool, d, d, bias=True)
    if cfg.num_labels > 0:
        params["classifier"] = init_dense(kh, d, cfg.num_labels, bias=True)
    return params


def embed(params: dict, input_ids: Array, cfg: BertConfig, *,
          token_type_ids: Array | None = None) -> Array:
    """``LayerNorm(word[input_ids] + token_type[token_type_ids] + position[arange(seq)])``.

    Returns:
      ``[batch, seq, hidden_size]``.
    """
    emb = params["embeddings"]
    seq = input_ids.shape[1]
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    input_ids = check_token_ids(input_ids, emb["word"].shape[0], "input_ids", "bert")
    token_type_ids = check_token_ids(token_type_ids, emb["token_type"].shape[0],
                                     "token_type_ids", "bert")
    x = jnp.take(emb["word"], input_ids, axis=0)  # [b, s, d]
    x = x + jnp.take(emb["token_type"], token_type_ids, axis=0)
    x = x + emb["position"][:seq][None]
    return apply_norm(emb["norm"], x, cfg.embedding_norm)


INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def apply(params: dict, inputs: dict, cfg: BertConfig) -> dict:
    """Run BERT (eval mode: no dropout).

    Args:
      params: from :func:`init` or :func:`lowrank_jax.convert.load_pretrained`.
      inputs: a dict with ``input_ids``: ``int[batch, seq]`` with
        ``seq <= max_position_embeddings``; ``attention_mask``: ``[batch, seq]``, 1 for real
        tokens and 0 for padding (keys that are padding get no attention), default all ones;
        ``token_type_ids``: ``int[batch, seq]`` segment ids, default zeros.
      cfg: model configuration.

    Returns:
      ``last_hidden_state [batch, seq, d]``, plus ``pooler_output [batch, d]`` if
      ``cfg.pooler`` and ``logits [batch, num_labels]`` if ``cfg.num_labels > 0``.
    """
    inputs = check_inputs(inputs, INPUTS, "bert.apply")
    if "input_ids" not in inputs:
        raise DataError("bert.apply: inputs need 'input_ids'", where="inputs",
                        expected="input_ids")
    input_ids = jnp.asarray(inputs["input_ids"])
    attention_mask, token_type_ids = inputs.get("attention_mask"), inputs.get("token_type_ids")
    if input_ids.ndim != 2:
        raise DataError(f"bert.apply: input_ids must be [batch, seq], got shape "
                        f"{tuple(input_ids.shape)}", where="input_ids")
    if input_ids.shape[1] > cfg.max_position_embeddings:
        raise DataError(
            f"bert.apply: sequence length {input_ids.shape[1]} exceeds "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    for name, arr in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if arr is not None and tuple(jnp.shape(arr)) != tuple(input_ids.shape):
            raise DataError(f"bert.apply: {name} must have the shape of input_ids "
                             f"{tuple(input_ids.shape)}, got {tuple(jnp.shape(arr))}")
    if token_type_ids is not None:
        token_type_ids = jnp.asarray(token_type_ids)
    x = embed(params, input_ids, cfg, token_type_ids=token_type_ids)  # [b, s, d]
    mask = None if attention_mask is None else padding_mask(jnp.asarray(attention_mask))
    h = apply_encoder(params["encoder"], x, cfg.encoder, mask=mask)  # [b, s, d]
    out = {"last_hidden_state": h}
    if cfg.pooler:
        pooled = jnp.tanh(linear(params["pooler"], h[:, 0]))  # [b, d]
        out["pooler_output"] = pooled
        if cfg.num_labels > 0:
            out["logits"] = linear(params["classifier"], pooled)  # [b, num_labels]
    return out


def sample_inputs(cfg: BertConfig, rng: np.random.Generator, batch: int) -> dict:
    """Random token ids (32 per row, some padding in the first row)."""
    ids = rng.integers(1, cfg.vocab_size, size=(batch, 32))
    mask = np.ones_like(ids)
    mask[0, -5:] = 0
    ids = jnp.asarray(ids, jnp.int32)
    return {"input_ids": ids, "attention_mask": jnp.asarray(mask, jnp.int32),
            "token_type_ids": jnp.zeros_like(ids)}


def loss(cfg: BertConfig):
    """Default objective of a classifier: cross-entropy of ``logits`` on integer
    ``batch['labels'] [batch]`` (other batch entries are the model inputs)."""

    def loss_fn(params, batch, key):
        del key  # no dropout
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = apply(params, inputs, cfg)["logits"].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.asarray(batch["labels"])[:, None], axis=-1)
        acc = jnp.mean(jnp.argmax(logits, -1) == batch["labels"])
        return jnp.mean(nll), {"accuracy": acc}

    return loss_fn


# ---------------------------------------------------------------------------------------------
# Hugging Face mapping (BertModel, BertForSequenceClassification).

def hf_key_table(cfg: BertConfig) -> list[HFRow]:
    """Every tensor of the Hugging Face checkpoint of ``cfg``, as ``save_pretrained`` names
    them (``BertModel`` unprefixed; ``BertForSequenceClassification`` under ``bert.``). Heads of
    other architectures (``BertForMaskedLM``'s ``cls.*``) are not part of it: loading such a
    checkpoint reports them as unexpected rather than dropping them silently."""
    base = "bert." if cfg.num_labels > 0 else ""
    d, e = cfg.hidden_size, f"{base}embeddings."
    rows = [
        HFRow(f"{e}word_embeddings.weight", "embeddings/word", "array", (cfg.vocab_size, d)),
        HFRow(f"{e}position_embeddings.weight", "embeddings/position", "array",
              (cfg.max_position_embeddings, d)),
        HFRow(f"{e}token_type_embeddings.weight", "embeddings/token_type", "array",
              (cfg.type_vocab_size, d)),
    ]
    rows += norm_rows(f"{e}LayerNorm", "embeddings/norm", d)
    rows += hf_encoder_rows(cfg, base, prenorm=False)
    if cfg.pooler:
        rows += linear_rows(f"{base}pooler.dense", "pooler", d, d, bias=True)
    if cfg.num_labels > 0:
        rows += linear_rows("classifier", "classifier", d, cfg.num_labels, bias=True)
    return rows


def hf_optional_keys(cfg: BertConfig) -> dict:
    """The ``embeddings.position_ids`` buffer old files store (``arange``, not a parameter)."""
    del cfg
    return {"embeddings.position_ids": None, "bert.embeddings.position_ids": None}


def detect_hf(hf_config: dict) -> bool:
    """Whether a ``config.json`` dict describes a BERT model."""
    return hf_config.get("model_type") == "bert"


def config_from_hf(hf_config: dict, state) -> BertConfig:
    """:class:`BertConfig` from a ``config.json`` dict and the checkpoint's keys: a base model
    has a pooler iff the checkpoint has ``pooler.dense`` weights (``add_pooling_layer`` is not
    recorded in ``config.json``)."""
    cfg = BertConfig.from_hf_dict(dict(hf_config))
    if cfg.num_labels == 0 and not any(k.endswith("pooler.dense.weight") for k in state):
        cfg = dataclasses.replace(cfg, pooler=False)
    return cfg


HF_SPEC = HFSpec(detect=detect_hf, config_from_hf=config_from_hf,
                 config_to_hf=lambda cfg: cfg.to_hf_dict(), key_table=hf_key_table,
                 optional=hf_optional_keys, base_prefixes=("bert.",),
                 load_kwargs=hf_load_kwargs)

FAMILY = register_family(ModelFamily(
    name="bert", config_cls=BertConfig, init=init, apply=apply, sample_inputs=sample_inputs,
    primary_outputs=("logits", "last_hidden_state"), loss=loss, hf=HF_SPEC))


__all__ = [
    "BertConfig", "FAMILY", "apply", "embed", "init", "loss", "sample_inputs",
]
