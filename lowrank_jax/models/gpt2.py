"""GPT-2 decoder-only language model: the computation of Hugging Face ``GPT2LMHeadModel`` in eval
mode ("Language Models are Unsupervised Multitask Learners", Radford et al. 2019).

Token and learned absolute position embeddings, pre-norm layers (LayerNorm, causal scaled
multi-head attention with biases, a GELU MLP with biases), a final LayerNorm and the output
projection tied to the token embeddings (or a separate one). The attention block is the
library's ordinary :func:`~lowrank_jax.nn.apply_attention` block with a causal mask, so every
method that works on BERT or ViT attention (per-head truncation, irregular attention, head
pruning, key folding) works here.

Hugging Face stores GPT-2's projections as ``Conv1D`` weights ``[in, out]`` (already the
``x @ W`` layout here) and the query, key and value projections fused in one ``c_attn``
``[d, 3 d]``. The converter splits ``c_attn`` into ``q``, ``k`` and ``v`` leaves on import and
fuses them back on export (:attr:`HFSpec.from_checkpoint` / ``to_checkpoint``).

Parameter tree::

    wte                 [vocab_size, d]
    wpe                 [n_positions, d]
    layers/i/ln_1       {'scale', 'bias'} [d]
    layers/i/attn       {'qk': QueryKey(q, k), 'v', 'o', 'heads'} (biases on all four)
    layers/i/ln_2       {'scale', 'bias'} [d]
    layers/i/mlp        {'wi': [d, n_inner], 'wo': [n_inner, d]}
    ln_f                {'scale', 'bias'} [d]
    lm_head             leaf [d, vocab_size]      (untied embeddings only)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import CheckpointError, ConfigError, DataError
from lowrank_jax.leaves import init_dense, linear, weight_shape
from lowrank_jax.models import causal
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
from lowrank_jax.models.vit import activation_from_hf, activation_to_hf
from lowrank_jax.nn import (
    AttentionConfig,
    MLPConfig,
    NormConfig,
    apply_attention,
    apply_attention_cached,
    apply_mlp,
    apply_norm,
    init_attention,
    init_attention_cache,
    init_mlp,
    init_norm,
)
from lowrank_jax.nn.attention.factored_cache import (
    apply_attention_factored,
    init_factored_cache,
)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 configuration (field names as in Hugging Face ``GPT2Config``).

    Attributes:
      vocab_size, n_positions, n_embd, n_layer, n_head: sizes (``n_positions`` is the longest
        input).
      n_inner: MLP width (``None``: ``4 * n_embd``).
      activation_function: lowrank_jax activation name (``'gelu_tanh'`` is Hugging Face's
        ``gelu_new``).
      layer_norm_epsilon: LayerNorm epsilon.
      scale_attn_weights: logits divided by ``sqrt(head width)``.
      tie_word_embeddings: the output projection is ``wte``.
      hf_files: the Hugging Face configuration files the model was loaded from (see
        :class:`~lowrank_jax.models.hf.HFConfigFiles`); not compared, hashed or shown.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_tanh"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    tie_word_embeddings: bool = True
    hf_files: HFConfigFiles | None = hf_files_field()

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ConfigError(f"GPT2Config: {name} must be a positive int, got {val!r}",
                                  where=name, expected="int >= 1", actual=val)
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPT2Config: n_head={self.n_head} must divide "
                              f"n_embd={self.n_embd}", where="n_head",
                              expected=f"a divisor of {self.n_embd}", actual=self.n_head)
        self.mlp  # noqa: B018  (validates the activation)

    @property
    def d_ff(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def d_head(self) -> int:
        return self.n_embd // self.n_head

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(use_bias=True, scaled=self.scale_attn_weights)

    @property
    def mlp(self) -> MLPConfig:
        return MLPConfig(activation=self.activation_function, use_bias=True)

    @property
    def norm(self) -> NormConfig:
        return NormConfig(kind="layer", eps=self.layer_norm_epsilon)

    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "GPT2Config":
        """Configuration from a Hugging Face ``config.json`` dict (``model_type`` gpt2)."""
        owner = "GPT2Config.from_hf_dict"
        if d.get("model_type", "gpt2") != "gpt2":
            raise ConfigError(f"{owner}: model_type must be 'gpt2', got "
                              f"{d.get('model_type')!r}", where="model_type", expected="gpt2",
                              actual=d.get("model_type"))
        for key in ("add_cross_attention", "scale_attn_by_inverse_layer_idx"):
            if d.get(key, False):
                raise ConfigError(f"{owner}: {key}=true is not supported", where=key,
                                  expected=False, actual=d[key])
        kwargs = dict(
            vocab_size=int(d.get("vocab_size", 50257)),
            n_positions=int(d.get("n_positions", 1024)), n_embd=int(d.get("n_embd", 768)),
            n_layer=int(d.get("n_layer", 12)), n_head=int(d.get("n_head", 12)),
            n_inner=None if d.get("n_inner") is None else int(d["n_inner"]),
            activation_function=activation_from_hf(d.get("activation_function", "gelu_new"),
                                                   owner),
            layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
            scale_attn_weights=bool(d.get("scale_attn_weights", True)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` of this configuration (``GPT2LMHeadModel``)."""
        return {
            "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "vocab_size": self.vocab_size, "n_positions": self.n_positions,
            "n_embd": self.n_embd, "n_layer": self.n_layer, "n_head": self.n_head,
            "n_inner": self.n_inner,
            "activation_function": activation_to_hf(self.activation_function, "GPT2Config"),
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


def init(key: Array, cfg: GPT2Config) -> dict:
    """Random parameters (Dense leaves; embeddings ``N(0, 0.02^2)``)."""
    kt, kp, kl, kh = jax.random.split(key, 4)
    d = cfg.n_embd
    layers = []
    for lk in jax.random.split(kl, cfg.n_layer):
        ka, km = jax.random.split(lk)
        layers.append({
            "ln_1": init_norm(d, cfg.norm),
            "attn": init_attention(ka, cfg.attention, d_model=d, num_heads=cfg.n_head),
            "ln_2": init_norm(d, cfg.norm),
            "mlp": init_mlp(km, cfg.mlp, d_model=d, d_ff=cfg.d_ff),
        })
    params = {"wte": 0.02 * jax.random.normal(kt, (cfg.vocab_size, d), jnp.float32),
              "wpe": 0.01 * jax.random.normal(kp, (cfg.n_positions, d), jnp.float32),
              "layers": layers, "ln_f": init_norm(d, cfg.norm)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = init_dense(kh, d, cfg.vocab_size, bias=False)
    return params


def _embed(params: dict, ids: Array, pos: Array) -> Array:
    return jnp.take(params["wte"], ids, axis=0) + jnp.take(params["wpe"], pos, axis=0)


def _logits(params: dict, h: Array, cfg: GPT2Config) -> Array:
    h = apply_norm(params["ln_f"], h, cfg.norm)
    if cfg.tie_word_embeddings:
        return jnp.einsum("bsd,vd->bsv", h, params["wte"])
    return linear(params["lm_head"], h)


def _mlp(lp: dict, x: Array, cfg: GPT2Config) -> Array:
    return x + apply_mlp(lp["mlp"], apply_norm(lp["ln_2"], x, cfg.norm), cfg.mlp)


def apply(params: dict, inputs: dict, cfg: GPT2Config) -> dict:
    """Run GPT-2 on whole sequences (eval mode).

    Args:
      params: from :func:`init` or :func:`lowrank_jax.convert.load_pretrained`.
      inputs: ``input_ids`` ``int[batch, seq]`` (``seq <= n_positions``); optional
        ``attention_mask`` (0 = padding) and ``position_ids`` (default ``0 .. seq - 1``, as
        the Hugging Face forward).
      cfg: model configuration.

    Returns:
      ``{'logits': [batch, seq, vocab_size], 'last_hidden_state': [batch, seq, d]}`` (after
      ``ln_f``).
    """
    ids, mask, pos = causal.lm_inputs(inputs, params["wte"].shape[0], "gpt2.apply",
                                      max_len=params["wpe"].shape[0])
    x = _embed(params, ids, pos)
    m = causal.causal_padding_mask(mask, ids.shape[1])
    for lp in params["layers"]:
        x = x + apply_attention(lp["attn"], apply_norm(lp["ln_1"], x, cfg.norm), cfg.attention,
                                mask=m)
        x = _mlp(lp, x, cfg)
    return {"logits": _logits(params, x, cfg),
            "last_hidden_state": apply_norm(params["ln_f"], x, cfg.norm)}


def init_cache(params: dict, cfg: GPT2Config, *, batch: int, max_len: int,
               dtype=jnp.float32, factored: bool = False) -> dict:
    """An empty key-value cache of ``max_len`` positions (what each layer's query-key object
    keeps of the keys, :func:`~lowrank_jax.nn.init_attention_cache`). With ``factored``, a
    layer with low-rank keys or values keeps ``x U_k`` / ``x U_v`` instead
    (:mod:`lowrank_jax.nn.attention.factored_cache`)."""
    if max_len > params["wpe"].shape[0]:
        raise DataError(f"gpt2.init_cache: max_len {max_len} exceeds n_positions="
                        f"{params['wpe'].shape[0]}", where="max_len",
                        expected=f"<= {params['wpe'].shape[0]}", actual=max_len)
    del cfg
    make = ((lambda a: init_factored_cache(a, batch, max_len, dtype=dtype)) if factored
            else (lambda a: init_attention_cache(a, batch, max_len, dtype)))
    return {"index": jnp.zeros((), jnp.int32),
            "layers": [make(lp["attn"]) for lp in params["layers"]]}


def apply_cached(params: dict, input_ids: Array, cfg: GPT2Config, cache: dict, *,
                 positions: Array, key_mask: Array | None = None,
                 last_only: bool = False) -> tuple[Array, dict]:
    """The next ``n`` tokens against the cache (see :class:`~lowrank_jax.models.ModelFamily`
    ``apply_cached``): ``(logits [batch, n, vocab], cache)``. ``last_only``: the last token's
    logits alone (``[batch, 1, vocab]``)."""
    causal.check_cache(cache, len(params["layers"]), "gpt2.apply_cached")
    x = _embed(params, jnp.asarray(input_ids), jnp.asarray(positions))
    index, layers = cache["index"], []
    for lp, c in zip(params["layers"], cache["layers"], strict=True):
        h = apply_norm(lp["ln_1"], x, cfg.norm)
        if set(c) == {"k", "v"}:
            out, c = apply_attention_cached(lp["attn"], h, cfg.attention, c, index=index,
                                            mask=key_mask)
        else:
            out, c = apply_attention_factored(lp["attn"], h, cfg.attention, c, index=index,
                                              mask=key_mask)
        x = _mlp(lp, x + out, cfg)
        layers.append(c)
    n = x.shape[1]
    return (_logits(params, x[:, -1:] if last_only else x, cfg),
            {"index": index + n, "layers": layers})


def sample_inputs(cfg: GPT2Config, rng: np.random.Generator, batch: int) -> dict:
    """Random token ids (16 per row, left padding in the first row)."""
    return causal.sample_token_inputs(cfg.vocab_size, rng, batch, seq=min(16, cfg.n_positions))


def loss(cfg: GPT2Config):
    """Next-token cross-entropy over the real tokens (:func:`causal.next_token_loss`)."""
    return causal.next_token_loss(apply, cfg)


# ---------------------------------------------------------------------------------------------
# Hugging Face mapping (GPT2LMHeadModel; GPT2Model checkpoints read too).

_CONV1D = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_QKV = ("q", "k", "v")


def hf_key_table(cfg: GPT2Config) -> list[HFRow]:
    """Every tensor of the checkpoint of ``cfg`` in the table's form: the fused ``c_attn`` as
    three rows ``...attn.c_attn.q`` / ``.k`` / ``.v`` and every ``Conv1D`` weight as
    ``[out, in]`` (:func:`split_checkpoint` makes that form of a file's tensors)."""
    d = cfg.n_embd
    rows = [HFRow("transformer.wte.weight", "wte", "array", (cfg.vocab_size, d)),
            HFRow("transformer.wpe.weight", "wpe", "array", (cfg.n_positions, d))]
    scale = (1.0 / np.sqrt(cfg.d_head)) if cfg.scale_attn_weights else 1.0
    for i in range(cfg.n_layer):
        p, t = f"layers/{i}", f"transformer.h.{i}"
        rows += norm_rows(f"{t}.ln_1", f"{p}/ln_1", d)
        names = {n: f"{t}.attn.c_attn.{n}" for n in _QKV}
        names["o"] = f"{t}.attn.c_proj"
        rows += attention_rows(names, f"{p}/attn", d_q=d, d_kv_in=d, d_out=d,
                               num_heads=cfg.n_head, d_head=cfg.d_head, scale=float(scale),
                               bias=True)
        rows += norm_rows(f"{t}.ln_2", f"{p}/ln_2", d)
        rows += mlp_rows({"wi": f"{t}.mlp.c_fc", "wo": f"{t}.mlp.c_proj"}, f"{p}/mlp",
                         d_model=d, d_ff=cfg.d_ff, bias=True)
    rows += norm_rows("transformer.ln_f", "ln_f", d)
    if not cfg.tie_word_embeddings:
        rows += linear_rows("lm_head", "lm_head", d, cfg.vocab_size, bias=False)
    return rows


def split_checkpoint(state) -> dict:
    """A GPT-2 checkpoint's tensors in the key table's form: ``c_attn`` ``[d, 3 d]`` (and its
    bias) split into ``c_attn.q`` / ``.k`` / ``.v`` ``[d, d]`` in ``[out, in]`` orientation,
    the other ``Conv1D`` weights transposed to ``[out, in]``. Other keys pass unchanged."""
    out = {}
    for key, val in state.items():
        if key.endswith("attn.c_attn.weight") or key.endswith("attn.c_attn.bias"):
            a = np.asarray(val)
            base, kind = key.rsplit(".", 1)
            if a.shape[-1] % 3:
                raise CheckpointError(key, message=f"gpt2: {key} has {a.shape[-1]} outputs, "
                                                   "not a multiple of 3 (fused q, k, v)")
            for name, part in zip(_QKV, np.split(a, 3, axis=-1), strict=True):
                out[f"{base}.{name}.{kind}"] = part.T if kind == "weight" else part
        elif key.endswith(_CONV1D):
            out[key] = np.asarray(val).T
        else:
            out[key] = val
    return out


def fuse_checkpoint(cfg: GPT2Config, state: dict) -> dict:
    """The inverse of :func:`split_checkpoint`: the file layout ``save_pretrained`` of
    ``GPT2LMHeadModel`` writes."""
    del cfg
    out, parts = {}, {}
    for key, val in state.items():
        base, name, kind = (key.rsplit(".", 2) + ["", ""])[:3]
        if base.endswith("attn.c_attn") and name in _QKV:
            parts.setdefault(f"{base}.{kind}", {})[name] = val
        elif key.endswith(_CONV1D):
            out[key] = np.asarray(val).T
        else:
            out[key] = val
    for key, p in parts.items():
        if key.endswith("weight"):
            out[key] = np.concatenate([p[n].T for n in _QKV], axis=1)
        else:
            out[key] = np.concatenate([p[n] for n in _QKV], axis=0)
    return out


def hf_optional_keys(cfg: GPT2Config) -> dict:
    """Causal-mask buffers of older files and a tied model's copy of ``wte``."""
    out = {}
    for i in range(cfg.n_layer):
        out[f"transformer.h.{i}.attn.bias"] = None
        out[f"transformer.h.{i}.attn.masked_bias"] = None
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.n_embd)
    return out


def rename_hf_key(key: str) -> str:
    """A ``GPT2Model`` checkpoint's keys under ``transformer.``."""
    if key.startswith(("transformer.", "lm_head.")):
        return key
    return f"transformer.{key}"


def detect_hf(hf_config: dict) -> bool:
    """Whether a ``config.json`` dict describes a GPT-2 model."""
    return hf_config.get("model_type") == "gpt2"


def config_from_hf(hf_config: dict, state) -> GPT2Config:
    """:class:`GPT2Config` from a ``config.json`` dict."""
    del state
    return GPT2Config.from_hf_dict(dict(hf_config))


def prepare_export(cfg: GPT2Config, params: dict) -> tuple[GPT2Config, dict, list[str]]:
    """The config and params of a Hugging Face export (``HFSpec.prepare_export``).

    A GPT-2 config has one MLP width, ``n_inner``, for all layers: when every layer's MLP kept
    the same number of hidden channels, the config gets that ``n_inner`` and the export is
    physically smaller. Otherwise the export zero-pads the narrower MLPs to the config's width
    (exact; the export summary's ``widened`` lists them). Attention heads are always
    zero-padded: ``GPT2Attention`` takes its head width as ``n_embd / n_head`` and its fused
    ``c_attn`` as ``[n_embd, 3 n_embd]``, so fewer heads cannot be written without changing
    the residual width ``n_embd``.
    """
    widths = {weight_shape(lp["mlp"]["wo"])[0] for lp in params["layers"]}
    if len(widths) == 1 and widths != {cfg.d_ff}:
        cfg = dataclasses.replace(cfg, n_inner=int(widths.pop()))
    return cfg, params, []


HF_SPEC = HFSpec(detect=detect_hf, config_from_hf=config_from_hf,
                 config_to_hf=lambda cfg: cfg.to_hf_dict(), key_table=hf_key_table,
                 optional=hf_optional_keys, rename=rename_hf_key,
                 from_checkpoint=split_checkpoint, to_checkpoint=fuse_checkpoint,
                 prepare_export=prepare_export)

FAMILY = register_family(ModelFamily(
    name="gpt2", config_cls=GPT2Config, init=init, apply=apply, sample_inputs=sample_inputs,
    primary_outputs=("logits",), token_outputs=True, loss=loss, hf=HF_SPEC,
    init_cache=init_cache, apply_cached=apply_cached))


__all__ = ["FAMILY", "GPT2Config", "apply", "apply_cached", "fuse_checkpoint", "init",
           "init_cache", "loss", "prepare_export", "sample_inputs", "split_checkpoint"]
