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

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.leaves import init_dense, linear
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.models.t5 import _layer_sizes, check_inputs
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
            distillation_head=arch.endswith("WithTeacher"),
            pooler=not is_classifier,
            pooler_output_size=d.get("pooler_output_size"),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


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
    layers = _layer_sizes(layers, cfg.encoder_sizes, "vit.init: layers", cfg.num_hidden_layers)
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


FAMILY = register_family(ModelFamily(
    name="vit", config_cls=ViTConfig, init=init, apply=apply, sample_inputs=sample_inputs,
    primary_outputs=("logits", "last_hidden_state"), loss=loss))
