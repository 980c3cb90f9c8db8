"""ViT and DeiT image encoders (Dosovitskiy et al. 2021; Touvron et al. 2021).

Same computation as Hugging Face ``ViTModel`` / ``ViTForImageClassification`` and ``DeiTModel`` /
``DeiTForImageClassification`` / ``DeiTForImageClassificationWithTeacher`` in eval mode, built
from :mod:`lowrank_jax.nn` blocks: a pre-norm LayerNorm encoder with scaled, biased attention and
an exact-gelu MLP. The patch embedding (a convolution with stride = kernel = patch) is computed as
"cut into patches, then :func:`~lowrank_jax.leaves.linear`", so its weight is a leaf
``[C * p * p, d]`` that can be compressed like any other.

Parameter tree::

    embeddings/patch        leaf [C*p*p, d] (+ bias); rows ordered (c, i, j) as the conv weight
    embeddings/cls_token    [d]
    embeddings/dist_token   [d]                  (DeiT only)
    embeddings/position     [num_tokens, d]      (num_tokens = patches + 1, or + 2 for DeiT)
    encoder                 see lowrank_jax.nn.init_encoder ('final_norm' = HF 'layernorm')
    pooler                  leaf [d, pooler_output_size]   (if cfg.pooler)
    classifier              leaf [d, num_labels]           (if cfg.num_labels > 0)
    distillation_classifier leaf [d, num_labels]           (DeiT with teacher head)
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.leaves import init_dense, linear
from lowrank_jax.models.common import check_inputs, layer_sizes
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.models.hf import (
    HFConfigFiles,
    HFRow,
    HFSpec,
    attention_rows,
    hf_files_field,
    linear_rows,
    mlp_rows,
    norm_rows,
)
from lowrank_jax.nn import (
    AttentionConfig,
    EncoderConfig,
    EncoderLayerConfig,
    LayerSizes,
    MLPConfig,
    NormConfig,
    apply_encoder,
    init_encoder,
)

Array = jax.Array

# Hugging Face ``hidden_act`` names -> lowrank_jax.nn.ACTIVATIONS names.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


# lowrank_jax.nn.ACTIVATIONS names -> Hugging Face ``hidden_act`` (the inverse of
# HF_ACTIVATIONS; 'gelu_new' is Hugging Face's tanh approximation).
TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def activation_to_hf(name: str, owner: str) -> str:
    """Map an :data:`lowrank_jax.nn.ACTIVATIONS` key to a Hugging Face ``hidden_act``."""
    if name not in TO_HF_ACTIVATION:
        raise ConfigError(f"{owner}: activation {name!r} has no Hugging Face name; supported: "
                          f"{tuple(TO_HF_ACTIVATION)}", where="hidden_act",
                          expected=tuple(TO_HF_ACTIVATION), actual=name)
    return TO_HF_ACTIVATION[name]


def hf_labels(num_labels: int) -> dict:
    """``id2label`` / ``label2id`` entries of a classifier's ``config.json``."""
    id2label = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    return {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}


def activation_from_hf(name: str, owner: str) -> str:
    """Map a Hugging Face ``hidden_act`` to an :data:`lowrank_jax.nn.ACTIVATIONS` key."""
    if name not in HF_ACTIVATIONS:
        raise ConfigError(
            f"{owner}: hidden_act {name!r} is not supported; expected one of "
            f"{tuple(HF_ACTIVATIONS)}", where="hidden_act", expected=tuple(HF_ACTIVATIONS),
            actual=name)
    return HF_ACTIVATIONS[name]


def layernorm_encoder(cfg, *, prenorm: bool) -> EncoderConfig:
    """The BERT/ViT encoder: biased scaled attention, biased MLP, LayerNorm.

    ``cfg`` has the Hugging Face field names (``hidden_act``, ``layer_norm_eps``). Pre-norm
    with a final LayerNorm is ViT/DeiT; post-norm without one is BERT.
    """
    layer = EncoderLayerConfig(
        attention=AttentionConfig(use_bias=True, scaled=True),
        mlp=MLPConfig(activation=cfg.hidden_act, use_bias=True),
        norm=NormConfig(kind="layer", eps=cfg.layer_norm_eps),
        prenorm=prenorm,
    )
    return EncoderConfig(layer=layer, final_norm=prenorm)


def layernorm_encoder_sizes(cfg) -> tuple[LayerSizes, ...]:
    """Hugging Face sizes of every layer of a BERT/ViT encoder (``hidden_size`` divided among
    ``num_attention_heads``, ``intermediate_size`` MLP)."""
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(
            f"{type(cfg).__name__}: num_attention_heads={cfg.num_attention_heads} must divide "
            f"hidden_size={cfg.hidden_size}", where="num_attention_heads",
            expected=f"a divisor of {cfg.hidden_size}", actual=cfg.num_attention_heads)
    return LayerSizes.uniform(cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                              d_head=cfg.hidden_size // cfg.num_attention_heads,
                              d_ff=cfg.intermediate_size)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """ViT / DeiT configuration (field names as in Hugging Face ``ViTConfig``/``DeiTConfig``).

    Attributes:
      image_size: square input side in pixels.
      patch_size: square patch side; must divide ``image_size``.
      num_channels: input channels.
      hidden_size, num_hidden_layers, num_attention_heads, intermediate_size: encoder sizes.
      hidden_act: lowrank_jax activation name (``'gelu'`` is the exact erf form, as HF).
      layer_norm_eps: LayerNorm epsilon.
      qkv_bias: biases on the query/key/value projections (the output projection always has
        one, as HF). Without them the leaves carry zero biases.
      num_labels: classifier outputs; ``0`` means no classification head.
      distillation: DeiT: a distillation token follows the class token.
      distillation_head: DeiT with ``num_labels > 0``: a second head on the distillation token,
        ``logits = (cls_logits + distillation_logits) / 2``
        (``DeiTForImageClassificationWithTeacher``). ``False``: a single head on the class
        token (``DeiTForImageClassification``).
      pooler: dense + tanh on the class token (``ViTModel(add_pooling_layer=True)``).
      pooler_output_size: width of the pooler output (HF default: ``hidden_size``).
      hf_files: the Hugging Face configuration files the model was loaded from (set by
        ``load_pretrained``; see :class:`~lowrank_jax.models.hf.HFConfigFiles`), written back
        by an export; not compared, hashed or shown.
    """

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    qkv_bias: bool = True
    num_labels: int = 0
    distillation: bool = False
    distillation_head: bool = True
    pooler: bool = False
    pooler_output_size: int | None = None
    hf_files: HFConfigFiles | None = hf_files_field()

    def __post_init__(self):
        for name in ("image_size", "patch_size", "num_channels", "hidden_size",
                     "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ConfigError(f"ViTConfig: {name} must be a positive int, got {val!r}")
        if not isinstance(self.num_labels, int) or self.num_labels < 0:
            raise ConfigError(f"ViTConfig: num_labels must be an int >= 0, got {self.num_labels!r}")
        if self.image_size % self.patch_size:
            raise ConfigError(
                f"ViTConfig: patch_size={self.patch_size} must divide "
                f"image_size={self.image_size}"
            )
        if self.pooler_output_size is not None and (
            not isinstance(self.pooler_output_size, int) or self.pooler_output_size < 1
        ):
            raise ConfigError(
                "ViTConfig: pooler_output_size must be None or a positive int, got "
                f"{self.pooler_output_size!r}"
            )
        # The nn configs validate the rest (activation name, eps); heads must divide the width.
        self.encoder  # noqa: B018
        self.encoder_sizes  # noqa: B018

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_prefix_tokens(self) -> int:
        """Class token, plus the distillation token for DeiT."""
        return 2 if self.distillation else 1

    @property
    def num_tokens(self) -> int:
        return self.num_patches + self.num_prefix_tokens

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size

    @property
    def pooler_width(self) -> int:
        return self.hidden_size if self.pooler_output_size is None else self.pooler_output_size

    @property
    def teacher_head(self) -> bool:
        """Whether there are two heads (class and distillation token), averaged."""
        return self.distillation and self.distillation_head and self.num_labels > 0

    @property
    def encoder(self) -> EncoderConfig:
        return layernorm_encoder(self, prenorm=True)

    @property
    def encoder_sizes(self) -> tuple[LayerSizes, ...]:
        return layernorm_encoder_sizes(self)

    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "ViTConfig":
        """Configuration from a Hugging Face ``config.json`` dict (``model_type`` vit or deit).

        The head is read from ``architectures[0]``: ``*ForImageClassification`` gets
        ``num_labels`` classes, ``DeiTForImageClassificationWithTeacher`` two averaged heads,
        ``ViTModel``/``DeiTModel`` (or no architecture) a pooler and no head. ``add_pooling_layer``
        is not recorded in ``config.json``; pass ``pooler=False`` (the converter decides from the
        checkpoint's keys).

        Args:
          d: the parsed ``config.json``.
          **overrides: fields to set explicitly after reading ``d``.

        Returns:
          The configuration.
        """
        model_type = d.get("model_type", "vit")
        if model_type not in ("vit", "deit"):
            raise ConfigError(f"ViTConfig.from_hf_dict: model_type must be 'vit' or 'deit', "
                             f"got {model_type!r}")
        for name in ("image_size", "patch_size"):
            if not isinstance(d.get(name, 0), int):
                raise ConfigError(
                    f"ViTConfig.from_hf_dict: only square images and patches are supported; "
                    f"{name} must be an int, got {d[name]!r}"
                )
        arch = (d.get("architectures") or [""])[0]
        is_classifier = "ForImageClassification" in arch
        if "id2label" in d:
            n_labels = len(d["id2label"])
        else:
            n_labels = int(d.get("num_labels", 2))
        pooler_act = d.get("pooler_act", "tanh")
        if pooler_act != "tanh":
            raise ConfigError(f"ViTConfig.from_hf_dict: pooler_act must be 'tanh', "
                             f"got {pooler_act!r}")
        kwargs = dict(
            image_size=d.get("image_size", 224),
            patch_size=d.get("patch_size", 16),
            num_channels=d.get("num_channels", 3),
            hidden_size=d.get("hidden_size", 768),
            num_hidden_layers=d.get("num_hidden_layers", 12),
            num_attention_heads=d.get("num_attention_heads", 12),
            intermediate_size=d.get("intermediate_size", 3072),
            hidden_act=activation_from_hf(d.get("hidden_act", "gelu"), "ViTConfig.from_hf_dict"),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            qkv_bias=bool(d.get("qkv_bias", True)),
            num_labels=n_labels if is_classifier else 0,
            distillation=model_type == "deit",
            # Only a DeiT classifier has a choice of heads; elsewhere keep the default.
            distillation_head=not (model_type == "deit" and is_classifier)
            or arch.endswith("WithTeacher"),
            pooler=not is_classifier,
            pooler_output_size=d.get("pooler_output_size"),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


    @property
    def architecture(self) -> str:
        """The ``transformers`` class of this configuration."""
        base = "DeiT" if self.distillation else "ViT"
        if self.num_labels == 0:
            return f"{base}Model"
        if self.teacher_head:
            return "DeiTForImageClassificationWithTeacher"
        return f"{base}ForImageClassification"

    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` of this configuration (dropout off)."""
        d = {
            "model_type": "deit" if self.distillation else "vit",
            "architectures": [self.architecture],
            "image_size": self.image_size, "patch_size": self.patch_size,
            "num_channels": self.num_channels, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": activation_to_hf(self.hidden_act, "ViTConfig"),
            "layer_norm_eps": self.layer_norm_eps, "qkv_bias": self.qkv_bias,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "pooler_act": "tanh",
        }
        if self.pooler_output_size is not None:  # Hugging Face's default is hidden_size too
            d["pooler_output_size"] = self.pooler_output_size
        if self.num_labels > 0:
            d.update(hf_labels(self.num_labels))
        return d


def init(key: Array, cfg: ViTConfig, *, layers=None) -> dict:
    """Random parameters (Dense leaves; tokens and positions ``N(0, 0.02^2)`` as HF).

    Args:
      key: PRNG key.
      cfg: model configuration.
      layers: optional per-layer :class:`~lowrank_jax.nn.LayerSizes` (default
        ``cfg.encoder_sizes``).

    Returns:
      The parameter tree described in the module docstring.
    """
    kp, kc, kd, kpos, ke, kpool, kh, kdh = jax.random.split(key, 8)
    d = cfg.hidden_size
    emb = {
        "patch": init_dense(kp, cfg.patch_dim, d, bias=True),
        "cls_token": 0.02 * jax.random.normal(kc, (d,), jnp.float32),
        "position": 0.02 * jax.random.normal(kpos, (cfg.num_tokens, d), jnp.float32),
    }
    if cfg.distillation:
        emb["dist_token"] = 0.02 * jax.random.normal(kd, (d,), jnp.float32)
    layers = layer_sizes(layers, cfg.encoder_sizes, "vit.init: layers", cfg.num_hidden_layers)
    params = {"embeddings": emb,
              "encoder": init_encoder(ke, cfg.encoder, d_model=d, layers=layers)}
    if cfg.pooler:
        params["pooler"] = init_dense(kpool, d, cfg.pooler_width, bias=True)
    if cfg.num_labels > 0:
        params["classifier"] = init_dense(kh, d, cfg.num_labels, bias=True)
        if cfg.teacher_head:
            params["distillation_classifier"] = init_dense(kdh, d, cfg.num_labels, bias=True)
    return params


def patchify(pixel_values: Array, cfg: ViTConfig) -> Array:
    """Cut NCHW images into flattened patches in the conv weight's ``(c, i, j)`` order.

    ``patchify(x) @ conv_w.reshape(d, -1).T`` equals the stride-``p`` convolution, with the
    patches in row-major ``(row, column)`` order as HF's ``flatten(2)``.

    Args:
      pixel_values: ``[batch, C, H, W]``.
      cfg: model configuration.

    Returns:
      ``[batch, num_patches, C * p * p]``.
    """
    x = jnp.asarray(pixel_values)
    expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
    if x.ndim != 4 or tuple(x.shape[1:]) != expected:
        raise DataError(
            f"vit.apply: pixel_values must be NCHW [batch, {expected[0]}, {expected[1]}, "
            f"{expected[2]}], got shape {tuple(x.shape)}"
        )
    b, c, p = x.shape[0], cfg.num_channels, cfg.patch_size
    g = cfg.image_size // p
    x = x.reshape(b, c, g, p, g, p)  # [b, c, gh, i, gw, j]
    x = x.transpose(0, 2, 4, 1, 3, 5)  # [b, gh, gw, c, i, j]
    return x.reshape(b, g * g, c * p * p)  # [b, num_patches, C*p*p]


def embed(params: dict, pixel_values: Array, cfg: ViTConfig) -> Array:
    """Patch embedding, class (and distillation) tokens and absolute positions.

    Returns:
      ``[batch, num_tokens, hidden_size]``.
    """
    emb = params["embeddings"]
    x = linear(emb["patch"], patchify(pixel_values, cfg).astype(jnp.float32))  # [b, n, d]
    b, d = x.shape[0], cfg.hidden_size
    prefix = [emb["cls_token"]]
    if cfg.distillation:
        prefix.append(emb["dist_token"])
    prefix = jnp.broadcast_to(jnp.stack(prefix)[None], (b, len(prefix), d)).astype(x.dtype)
    x = jnp.concatenate([prefix, x], axis=1)  # [b, num_tokens, d]
    return x + emb["position"][None].astype(x.dtype)


INPUTS = ("pixel_values",)


def apply(params: dict, inputs: dict, cfg: ViTConfig) -> dict:
    """Run ViT / DeiT on a batch of images (eval mode: no dropout).

    Args:
      params: from :func:`init` or :func:`lowrank_jax.convert.load_pretrained`.
      inputs: ``{'pixel_values': [batch, num_channels, image_size, image_size]}`` (NCHW, as
        PyTorch).
      cfg: model configuration.

    Returns:
      ``last_hidden_state [batch, num_tokens, d]`` (after the final LayerNorm), plus
      ``pooler_output [batch, pooler_width]`` if ``cfg.pooler``; ``logits [batch, num_labels]``
      if ``cfg.num_labels > 0``, and with the DeiT teacher head also ``cls_logits`` and
      ``distillation_logits`` (``logits`` is their mean).
    """
    inputs = check_inputs(inputs, INPUTS, "vit.apply")
    if "pixel_values" not in inputs:
        raise DataError("vit.apply: inputs need 'pixel_values'", where="inputs",
                        expected="pixel_values")
    x = embed(params, inputs["pixel_values"], cfg)  # [b, num_tokens, d]
    h = apply_encoder(params["encoder"], x, cfg.encoder)  # [b, num_tokens, d]
    out = {"last_hidden_state": h}
    if cfg.pooler:
        out["pooler_output"] = jnp.tanh(linear(params["pooler"], h[:, 0]))
    if cfg.num_labels > 0:
        cls_logits = linear(params["classifier"], h[:, 0])  # [b, num_labels]
        if cfg.teacher_head:
            dist_logits = linear(params["distillation_classifier"], h[:, 1])
            out["cls_logits"] = cls_logits
            out["distillation_logits"] = dist_logits
            out["logits"] = (cls_logits + dist_logits) / 2
        else:
            out["logits"] = cls_logits
    return out


def sample_inputs(cfg: ViTConfig, rng: np.random.Generator, batch: int) -> dict:
    """Standard-normal images ``[batch, C, H, W]``."""
    x = rng.normal(size=(batch, cfg.num_channels, cfg.image_size, cfg.image_size))
    return {"pixel_values": jnp.asarray(x, jnp.float32)}


def loss(cfg: ViTConfig):
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
# Hugging Face mapping (ViTModel, ViTForImageClassification, DeiTModel,
# DeiTForImageClassification, DeiTForImageClassificationWithTeacher).

def hf_encoder_rows(cfg, base: str, *, prenorm: bool, qkv_bias: bool = True) -> list[HFRow]:
    """Rows of the Hugging Face ``encoder.layer.N`` stack of ViT (``prenorm``) or BERT.

    Args:
      cfg: a config with the Hugging Face field names (``hidden_size``,
        ``num_attention_heads``, ``intermediate_size``, ``num_hidden_layers``).
      base: key prefix of the base model (``'vit.'``, ``'bert.'`` or ``''``).
      prenorm: ViT names (``attention.attention.query``, ``layernorm_before/after``) if
        ``True``, else BERT names (``attention.self.query``, ``...LayerNorm``).
      qkv_bias: the checkpoint stores the query/key/value biases.

    Returns:
      The rows; attention is scaled by ``1/sqrt(hidden_size / num_attention_heads)``.
    """
    d, ff, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    d_head = d // h
    rows = []
    for i in range(cfg.num_hidden_layers):
        k, p = f"{base}encoder.layer.{i}.", f"encoder/layers/{i}"
        att = f"{k}attention.attention." if prenorm else f"{k}attention.self."
        names = {"q": f"{att}query", "k": f"{att}key", "v": f"{att}value",
                 "o": f"{k}attention.output.dense"}
        rows += attention_rows(names, f"{p}/attn", d_q=d, d_kv_in=d, d_out=d, num_heads=h,
                               d_head=d_head, scale=1.0 / math.sqrt(d_head), bias=True,
                               qkv_bias=qkv_bias)
        rows += mlp_rows({"wi": f"{k}intermediate.dense", "wo": f"{k}output.dense"},
                         f"{p}/mlp", d_model=d, d_ff=ff, bias=True)
        if prenorm:
            rows += norm_rows(f"{k}layernorm_before", f"{p}/attn_norm", d)
            rows += norm_rows(f"{k}layernorm_after", f"{p}/mlp_norm", d)
        else:
            rows += norm_rows(f"{k}attention.output.LayerNorm", f"{p}/attn_norm", d)
            rows += norm_rows(f"{k}output.LayerNorm", f"{p}/mlp_norm", d)
    return rows


def hf_key_table(cfg: ViTConfig) -> list[HFRow]:
    """Every tensor of the Hugging Face checkpoint of ``cfg``, as ``save_pretrained`` names
    them: a base model unprefixed, a classifier's base model under ``vit.``/``deit.``. The
    patch convolution ``[d, C, p, p]`` is the leaf ``[C*p*p, d]`` (see :func:`patchify`)."""
    base = ("deit." if cfg.distillation else "vit.") if cfg.num_labels > 0 else ""
    d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
    e = f"{base}embeddings."
    rows = [
        HFRow(f"{e}patch_embeddings.projection.weight", "embeddings/patch", "linear", (d, c, p, p)),
        HFRow(f"{e}patch_embeddings.projection.bias", "embeddings/patch", "bias", (d,)),
        HFRow(f"{e}cls_token", "embeddings/cls_token", "array", (1, 1, d)),
        HFRow(f"{e}position_embeddings", "embeddings/position", "array", (1, cfg.num_tokens, d)),
    ]
    if cfg.distillation:
        rows.append(HFRow(f"{e}distillation_token", "embeddings/dist_token", "array", (1, 1, d)))
    rows += hf_encoder_rows(cfg, base, prenorm=True, qkv_bias=cfg.qkv_bias)
    rows += norm_rows(f"{base}layernorm", "encoder/final_norm", d)
    if cfg.pooler:
        rows += linear_rows(f"{base}pooler.dense", "pooler", d, cfg.pooler_width, bias=True)
    if cfg.num_labels > 0:
        if cfg.teacher_head:
            rows += linear_rows("cls_classifier", "classifier", d, cfg.num_labels, bias=True)
            rows += linear_rows("distillation_classifier", "distillation_classifier", d,
                                cfg.num_labels, bias=True)
        else:
            rows += linear_rows("classifier", "classifier", d, cfg.num_labels, bias=True)
    return rows


# transformers 5 in-memory module names -> the names save_pretrained writes.
_IN_MEMORY_NAMES = (
    (re.compile(r"(^|\.)layers\.(\d+)\."), r"\1encoder.layer.\2."),
    (re.compile(r"\.attention\.q_proj\."), ".attention.attention.query."),
    (re.compile(r"\.attention\.k_proj\."), ".attention.attention.key."),
    (re.compile(r"\.attention\.v_proj\."), ".attention.attention.value."),
    (re.compile(r"\.attention\.o_proj\."), ".attention.output.dense."),
    (re.compile(r"\.mlp\.fc1\."), ".intermediate.dense."),
    (re.compile(r"\.mlp\.fc2\."), ".output.dense."),
)


def rename_hf_key(key: str) -> str:
    """A key of a transformers 5 ViT/DeiT module (``layers.0.attention.q_proj.weight``) in the
    names ``save_pretrained`` writes (``encoder.layer.0.attention.attention.query.weight``)."""
    for pat, rep in _IN_MEMORY_NAMES:
        key = pat.sub(rep, key)
    return key


def detect_hf(hf_config: dict) -> bool:
    """Whether a ``config.json`` dict describes a ViT or DeiT model."""
    return hf_config.get("model_type") in ("vit", "deit")


def config_from_hf(hf_config: dict, state) -> ViTConfig:
    """:class:`ViTConfig` from a ``config.json`` dict and the checkpoint's keys: the head
    follows ``architectures`` (:meth:`ViTConfig.from_hf_dict`); a base model has a pooler iff
    the checkpoint has ``pooler.dense`` weights (``add_pooling_layer`` is not recorded)."""
    cfg = ViTConfig.from_hf_dict(dict(hf_config))
    if cfg.pooler and not any(k.endswith("pooler.dense.weight") for k in state):
        cfg = dataclasses.replace(cfg, pooler=False)
    return cfg


def hf_load_kwargs(cfg) -> dict:
    """A ViT/DeiT/BERT base model without pooler loads with ``add_pooling_layer=False``."""
    return {} if (cfg.pooler or cfg.num_labels > 0) else {"add_pooling_layer": False}


HF_SPEC = HFSpec(detect=detect_hf, config_from_hf=config_from_hf,
                 config_to_hf=lambda cfg: cfg.to_hf_dict(), key_table=hf_key_table,
                 rename=rename_hf_key, base_prefixes=("vit.", "deit."),
                 load_kwargs=hf_load_kwargs)

FAMILY = register_family(ModelFamily(
    name="vit", config_cls=ViTConfig, init=init, apply=apply, sample_inputs=sample_inputs,
    primary_outputs=("logits", "last_hidden_state"), loss=loss, hf=HF_SPEC))


__all__ = [
    "FAMILY", "ViTConfig", "apply", "embed", "init", "loss", "patchify", "sample_inputs",
]
