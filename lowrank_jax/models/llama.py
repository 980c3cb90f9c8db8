"""Llama-style decoder-only language models: the computation of Hugging Face
``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` in eval mode.

Token embeddings, pre-norm layers with RMSNorm, grouped-query causal self-attention with rotary
position embeddings (:mod:`lowrank_jax.nn.attention.grouped`, :mod:`lowrank_jax.nn.rotary`), a
SwiGLU MLP (``silu(x W_gate) * (x W_up) W_down``, the gated :func:`~lowrank_jax.nn.apply_mlp`),
a final RMSNorm and an output projection, tied to the embeddings or not ("LLaMA: Open and
Efficient Foundation Language Models", arXiv:2302.13971).

What the three Hugging Face model types differ in is a field here: Llama has ``attention_bias``
(biases on q, k, v and o) and ``mlp_bias``; Qwen2 always has q, k and v biases and no o bias;
Mistral has neither and a ``sliding_window``. Sequences longer than the sliding window are
refused rather than attended past it (the window is not implemented).

Parameter tree::

    embed                   [vocab_size, d]
    layers/i/input_norm     {'scale'} [d]
    layers/i/attn           grouped-query block: qk/{q,k}, v, o, q_heads, kv_heads
    layers/i/post_norm      {'scale'} [d]
    layers/i/mlp            {'wi_0' (gate), 'wi_1' (up): [d, d_ff], 'wo' (down): [d_ff, d]}
    norm                    {'scale'} [d]
    lm_head                 leaf [d, vocab_size]      (untied embeddings only)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.leaves import (
    Dense,
    HeadLayout,
    bias_of,
    init_dense,
    linear,
    materialize,
    weight_shape,
)
from lowrank_jax.models import causal
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.models.hf import (
    HFConfigFiles,
    HFRow,
    HFSpec,
    hf_files_field,
    linear_rows,
    norm_rows,
)
from lowrank_jax.nn import MLPConfig, NormConfig, apply_mlp, apply_norm, init_mlp, init_norm
from lowrank_jax.nn.attention.factored_cache import (
    apply_attention_factored,
    init_factored_cache,
)
from lowrank_jax.nn.attention.grouped import (
    GroupedAttentionConfig,
    apply_grouped_attention,
    apply_grouped_attention_cached,
    init_grouped_attention,
    init_grouped_cache,
)
from lowrank_jax.nn.rotary import RopeConfig

Array = jax.Array

MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu"}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama-style configuration (Hugging Face field names where they exist).

    Attributes:
      model_type: ``'llama'``, ``'mistral'`` or ``'qwen2'`` (what an export writes).
      vocab_size, hidden_size, intermediate_size, num_hidden_layers: sizes.
      num_attention_heads, num_key_value_heads: query heads and key-value heads (grouped-query
        attention when fewer key-value heads; they must divide the query heads).
      head_dim: per-head width (``None``: ``hidden_size // num_attention_heads``).
      max_position_embeddings: recorded for the export (rotary embeddings have no table).
      rms_norm_eps: RMSNorm epsilon.
      tie_word_embeddings: the output projection is the embedding matrix.
      rope: rotary embedding settings.
      qkv_bias: biases on the q, k and v projections (Llama ``attention_bias``; Qwen2 always).
      o_bias: a bias on the output projection (Llama ``attention_bias``; never Qwen2).
      mlp_bias: biases on the MLP projections (Llama ``mlp_bias``).
      sliding_window: Mistral's (and Qwen2's with ``use_sliding_window``) attention window:
        longer inputs are refused. ``None``: no window.
      hf_files: the Hugging Face configuration files the model was loaded from (see
        :class:`~lowrank_jax.models.hf.HFConfigFiles`); not compared, hashed or shown.
    """

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    hf_files: HFConfigFiles | None = hf_files_field()

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"LlamaConfig: model_type must be one of {MODEL_TYPES}, got "
                              f"{self.model_type!r}", where="model_type", expected=MODEL_TYPES,
                              actual=self.model_type)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ConfigError(f"LlamaConfig: {name} must be a positive int, got {val!r}",
                                  where=name, expected="int >= 1", actual=val)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"LlamaConfig: num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}", where="num_key_value_heads",
                expected=f"a divisor of {self.num_attention_heads}",
                actual=self.num_key_value_heads)
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}; give head_dim", where="head_dim")
        if self.d_head % 2 or self.d_head < 2:
            raise ConfigError(f"LlamaConfig: head_dim must be even (rotary pairs), got "
                              f"{self.d_head}", where="head_dim", expected="even",
                              actual=self.d_head)
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ConfigError(f"LlamaConfig: sliding_window must be None or a positive int, got "
                              f"{self.sliding_window!r}", where="sliding_window")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ConfigError("LlamaConfig: a qwen2 model has q, k, v biases and no o or MLP "
                              "bias (qkv_bias=True, o_bias=False, mlp_bias=False)",
                              where="qkv_bias")
        if self.model_type == "mistral" and (self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ConfigError("LlamaConfig: a mistral model has no biases", where="qkv_bias")
        if self.model_type == "llama" and self.qkv_bias != self.o_bias:
            raise ConfigError("LlamaConfig: a llama model has biases on all of q, k, v, o "
                              "(attention_bias) or none; use model_type='qwen2' for q, k, v "
                              "biases alone", where="o_bias", expected=self.qkv_bias,
                              actual=self.o_bias)

    @property
    def d_head(self) -> int:
        """The per-head width."""
        return self.head_dim if self.head_dim is not None else (
            self.hidden_size // self.num_attention_heads)

    @property
    def attention(self) -> GroupedAttentionConfig:
        return GroupedAttentionConfig(group=self.num_attention_heads // self.num_key_value_heads,
                                      rope=self.rope, qkv_bias=self.qkv_bias,
                                      o_bias=self.o_bias)

    @property
    def mlp(self) -> MLPConfig:
        return MLPConfig(activation="silu", gated=True, use_bias=self.mlp_bias)

    @property
    def norm(self) -> NormConfig:
        return NormConfig(kind="rms", eps=self.rms_norm_eps)

    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "LlamaConfig":
        """Configuration from a Hugging Face ``config.json`` dict (``model_type`` llama,
        mistral or qwen2); rotary settings from ``rope_parameters`` or the older
        ``rope_theta`` / ``rope_scaling``."""
        mt = d.get("model_type", "llama")
        owner = "LlamaConfig.from_hf_dict"
        if mt not in MODEL_TYPES:
            raise ConfigError(f"{owner}: model_type must be one of {MODEL_TYPES}, got {mt!r}",
                              where="model_type", expected=MODEL_TYPES, actual=mt)
        act = d.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ConfigError(f"{owner}: hidden_act {act!r} is not supported (only silu)",
                              where="hidden_act", expected="silu", actual=act)
        heads = int(d.get("num_attention_heads", 32))
        kv = d.get("num_key_value_heads")
        kv = heads if kv is None else int(kv)
        window = d.get("sliding_window")
        if mt == "qwen2" and not d.get("use_sliding_window", False):
            window = None
        if mt == "llama":
            bias = bool(d.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias = bias, bias, bool(d.get("mlp_bias", False))
            window = None
        elif mt == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias = o_bias = mlp_bias = False
        kwargs = dict(
            model_type=mt, vocab_size=int(d.get("vocab_size", 32000)),
            hidden_size=int(d.get("hidden_size", 4096)),
            intermediate_size=int(d.get("intermediate_size", 11008)),
            num_hidden_layers=int(d.get("num_hidden_layers", 32)),
            num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=None if d.get("head_dim") is None else int(d["head_dim"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_hf(d, owner), qkv_bias=qkv_bias, o_bias=o_bias,
            mlp_bias=mlp_bias, sliding_window=None if window is None else int(window))
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` of this configuration (``rope_parameters`` in the
        transformers 5 form)."""
        d = {
            "model_type": self.model_type, "architectures": [ARCHITECTURES[self.model_type]],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.d_head,
            "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": self.rope.to_hf(),
        }
        if self.model_type == "llama":
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        else:
            d.update(use_sliding_window=self.sliding_window is not None,
                     sliding_window=self.sliding_window)
        return d


def init(key: Array, cfg: LlamaConfig) -> dict:
    """Random parameters (Dense leaves; embeddings ``N(0, 0.02^2)``)."""
    ke, kl, kh = jax.random.split(key, 3)
    d = cfg.hidden_size
    layers = []
    for lk in jax.random.split(kl, cfg.num_hidden_layers):
        ka, km = jax.random.split(lk)
        layers.append({
            "input_norm": init_norm(d, cfg.norm),
            "attn": init_grouped_attention(ka, cfg.attention, d_model=d,
                                           num_heads=cfg.num_attention_heads,
                                           num_kv_heads=cfg.num_key_value_heads,
                                           d_head=cfg.d_head),
            "post_norm": init_norm(d, cfg.norm),
            "mlp": init_mlp(km, cfg.mlp, d_model=d, d_ff=cfg.intermediate_size),
        })
    params = {"embed": 0.02 * jax.random.normal(ke, (cfg.vocab_size, d), jnp.float32),
              "layers": layers, "norm": init_norm(d, cfg.norm)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = init_dense(kh, d, cfg.vocab_size, bias=False)
    return params


def _logits(params: dict, h: Array, cfg: LlamaConfig) -> Array:
    h = apply_norm(params["norm"], h, cfg.norm)
    if cfg.tie_word_embeddings:
        return jnp.einsum("bsd,vd->bsv", h, params["embed"])
    return linear(params["lm_head"], h)


def _check_window(cfg: LlamaConfig, length: int, owner: str) -> None:
    if cfg.sliding_window is not None and length > cfg.sliding_window:
        raise DataError(
            f"{owner}: {length} positions exceed the model's sliding_window="
            f"{cfg.sliding_window}; the sliding window is not implemented, so longer sequences "
            "are refused rather than attended past it", where="sliding_window",
            expected=f"<= {cfg.sliding_window}", actual=length)


def apply(params: dict, inputs: dict, cfg: LlamaConfig) -> dict:
    """Run the model on whole sequences (eval mode).

    Args:
      params: from :func:`init` or :func:`lowrank_jax.convert.load_pretrained`.
      inputs: ``input_ids`` ``int[batch, seq]``; optional ``attention_mask`` ``[batch, seq]``
        (0 = padding, never attended to) and ``position_ids`` (default ``0 .. seq - 1``, as
        the Hugging Face forward; left-padded rows take
        :func:`~lowrank_jax.models.causal.positions_from_mask`).
      cfg: model configuration.

    Returns:
      ``{'logits': [batch, seq, vocab_size], 'last_hidden_state': [batch, seq, d]}`` (the
      hidden state after the final norm).
    """
    ids, mask, pos = causal.lm_inputs(inputs, params["embed"].shape[0], "llama.apply")
    _check_window(cfg, ids.shape[1], "llama.apply")
    x = jnp.take(params["embed"], ids, axis=0)
    m = causal.causal_padding_mask(mask, ids.shape[1])
    for lp in params["layers"]:
        x = x + apply_grouped_attention(lp["attn"], apply_norm(lp["input_norm"], x, cfg.norm),
                                        cfg.attention, positions=pos, mask=m)
        x = x + apply_mlp(lp["mlp"], apply_norm(lp["post_norm"], x, cfg.norm), cfg.mlp)
    return {"logits": _logits(params, x, cfg),
            "last_hidden_state": apply_norm(params["norm"], x, cfg.norm)}


def init_cache(params: dict, cfg: LlamaConfig, *, batch: int, max_len: int,
               dtype=jnp.float32, factored: bool = False) -> dict:
    """An empty key-value cache of ``max_len`` positions: per layer ``{'k', 'v'}`` of shape
    ``[batch, num_key_value_heads, max_len, head_dim]`` (once per key-value head). With
    ``factored``, a low-rank value projection's layer keeps ``x U_v`` instead of the values
    (:mod:`lowrank_jax.nn.attention.factored_cache`; keys stay full: rotary embeddings)."""
    _check_window(cfg, int(max_len), "llama.init_cache")
    make = ((lambda a: init_factored_cache(a, batch, max_len, dtype=dtype)) if factored
            else (lambda a: init_grouped_cache(a, batch, max_len, dtype)))
    return {"index": jnp.zeros((), jnp.int32),
            "layers": [make(lp["attn"]) for lp in params["layers"]]}


def apply_cached(params: dict, input_ids: Array, cfg: LlamaConfig, cache: dict, *,
                 positions: Array, key_mask: Array | None = None,
                 last_only: bool = False) -> tuple[Array, dict]:
    """The next ``n`` tokens against the cache (see :class:`~lowrank_jax.models.ModelFamily`
    ``apply_cached``): ``(logits [batch, n, vocab], cache)``; equals :func:`apply` on the
    whole sequence at those positions. ``last_only``: the last token's logits alone
    (``[batch, 1, vocab]``)."""
    causal.check_cache(cache, len(params["layers"]), "llama.apply_cached")
    x = jnp.take(params["embed"], jnp.asarray(input_ids), axis=0)
    index, layers = cache["index"], []
    for lp, c in zip(params["layers"], cache["layers"], strict=True):
        h = apply_norm(lp["input_norm"], x, cfg.norm)
        if set(c) == {"k", "v"}:
            out, c = apply_grouped_attention_cached(lp["attn"], h, cfg.attention, c,
                                                    index=index, positions=positions,
                                                    mask=key_mask)
        else:
            out, c = apply_attention_factored(lp["attn"], h, cfg.attention, c, index=index,
                                              positions=positions, mask=key_mask)
        x = x + out
        x = x + apply_mlp(lp["mlp"], apply_norm(lp["post_norm"], x, cfg.norm), cfg.mlp)
        layers.append(c)
    n = x.shape[1]
    return (_logits(params, x[:, -1:] if last_only else x, cfg),
            {"index": index + n, "layers": layers})


def sample_inputs(cfg: LlamaConfig, rng: np.random.Generator, batch: int) -> dict:
    """Random token ids (16 per row, left padding in the first row)."""
    return causal.sample_token_inputs(cfg.vocab_size, rng, batch)


def loss(cfg: LlamaConfig):
    """Next-token cross-entropy over the real tokens (:func:`causal.next_token_loss`)."""
    return causal.next_token_loss(apply, cfg)


# ---------------------------------------------------------------------------------------------
# Hugging Face mapping (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM).

def hf_key_table(cfg: LlamaConfig) -> list[HFRow]:
    """Every tensor of the ``*ForCausalLM`` checkpoint of ``cfg``."""
    d, w = cfg.hidden_size, cfg.d_head
    h, g = cfg.num_attention_heads, cfg.num_key_value_heads
    rows = [HFRow("model.embed_tokens.weight", "embed", "array", (cfg.vocab_size, d))]
    for i in range(cfg.num_hidden_layers):
        p, t = f"layers/{i}", f"model.layers.{i}"
        rows += norm_rows(f"{t}.input_layernorm", f"{p}/input_norm", d, bias=False)
        rows += linear_rows(f"{t}.self_attn.q_proj", f"{p}/attn/qk/q", d, h * w,
                            bias=cfg.qkv_bias)
        rows += linear_rows(f"{t}.self_attn.k_proj", f"{p}/attn/qk/k", d, g * w,
                            bias=cfg.qkv_bias)
        rows += linear_rows(f"{t}.self_attn.v_proj", f"{p}/attn/v", d, g * w,
                            bias=cfg.qkv_bias)
        rows += linear_rows(f"{t}.self_attn.o_proj", f"{p}/attn/o", h * w, d, bias=cfg.o_bias)
        rows += norm_rows(f"{t}.post_attention_layernorm", f"{p}/post_norm", d, bias=False)
        rows += linear_rows(f"{t}.mlp.gate_proj", f"{p}/mlp/wi_0", d, cfg.intermediate_size,
                            bias=cfg.mlp_bias)
        rows += linear_rows(f"{t}.mlp.up_proj", f"{p}/mlp/wi_1", d, cfg.intermediate_size,
                            bias=cfg.mlp_bias)
        rows += linear_rows(f"{t}.mlp.down_proj", f"{p}/mlp/wo", cfg.intermediate_size, d,
                            bias=cfg.mlp_bias)
    rows += norm_rows("model.norm", "norm", d, bias=False)
    if not cfg.tie_word_embeddings:
        rows += linear_rows("lm_head", "lm_head", d, cfg.vocab_size, bias=False)
    return rows


def hf_optional_keys(cfg: LlamaConfig) -> dict:
    """A tied model's copy of the embeddings under ``lm_head.weight`` (older files) and the
    rotary buffers some files carry."""
    out = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": None
           for i in range(cfg.num_hidden_layers)}
    out["model.rotary_emb.inv_freq"] = None
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def rename_hf_key(key: str) -> str:
    """A base model's keys (``layers.0...``, ``embed_tokens...``) under ``model.``."""
    if key.startswith(("model.", "lm_head.")):
        return key
    return f"model.{key}"


def detect_hf(hf_config: dict) -> bool:
    """Whether a ``config.json`` dict describes a Llama, Mistral or Qwen2 model."""
    return hf_config.get("model_type") in MODEL_TYPES


def config_from_hf(hf_config: dict, state) -> LlamaConfig:
    """:class:`LlamaConfig` from a ``config.json`` dict."""
    del state
    return LlamaConfig.from_hf_dict(dict(hf_config))


def _regular_groups(q_ids: tuple, kv_ids: tuple, group: int) -> int | None:
    """``r`` when the kept query heads are ``r`` per kept key-value head, in order (so that a
    config with ``len(q_ids)`` heads over ``len(kv_ids)`` key-value heads maps them the same)."""
    if not kv_ids or len(q_ids) % len(kv_ids):
        return None
    r = len(q_ids) // len(kv_ids)
    owners = [i // group for i in q_ids]
    return r if owners == [k for k in kv_ids for _ in range(r)] else None


def _scatter_cols(a: np.ndarray, ids, width: int, total: int, axis: int) -> np.ndarray:
    """Head ``n`` of ``a`` (``width`` channels along ``axis``) to slot ``ids[n]`` of ``total``
    heads; other slots zero."""
    shape = list(a.shape)
    shape[axis] = total * width
    out = np.zeros(shape, np.float32)
    idx = np.concatenate([np.arange(i * width, (i + 1) * width) for i in ids] or
                         [np.zeros(0, np.int64)]).astype(np.int64)
    sl = [slice(None)] * a.ndim
    sl[axis] = idx
    out[tuple(sl)] = a
    return out


def _dense(w: np.ndarray, b) -> Dense:
    return Dense(w=jnp.asarray(w), b=None if b is None else jnp.asarray(b))


def _pad_attention(block: dict, cfg: LlamaConfig) -> dict:
    """A grouped block with removed heads as a full-width block of Dense leaves: kept heads at
    their original positions, the others zero (exact: a removed query head's output rows are
    zero, a removed key-value head is read by no kept query head)."""
    w, h, g = cfg.d_head, cfg.num_attention_heads, cfg.num_key_value_heads
    qh, kvh = block["q_heads"], block["kv_heads"]
    out = {}
    for name, leaf, ids, total in (("q", block["qk"]["q"], qh.ids, h),
                                   ("k", block["qk"]["k"], kvh.ids, g),
                                   ("v", block["v"], kvh.ids, g)):
        b = bias_of(leaf)
        out[name] = _dense(_scatter_cols(np.asarray(materialize(leaf)), ids, w, total, 1),
                           None if b is None else _scatter_cols(np.asarray(b), ids, w, total, 0))
    o = block["o"]
    out["o"] = _dense(_scatter_cols(np.asarray(materialize(o)), qh.ids, w, h, 0), bias_of(o))
    return {**block, "qk": {"q": out["q"], "k": out["k"]}, "v": out["v"], "o": out["o"],
            "q_heads": HeadLayout.uniform(h, w, qh.scale), "kv_heads": HeadLayout.uniform(g, w)}


def _pad_mlp(mlp: dict, d_ff: int) -> dict:
    """An MLP narrower than ``d_ff`` with zero hidden channels appended (exact: ``silu(0) * 0``
    adds nothing)."""
    out = dict(mlp)
    for name in ("wi_0", "wi_1"):
        leaf = mlp[name]
        a, b = np.asarray(materialize(leaf)), bias_of(leaf)
        pad = d_ff - a.shape[1]
        out[name] = _dense(np.pad(a, ((0, 0), (0, pad))),
                           None if b is None else np.pad(np.asarray(b), (0, pad)))
    wo = mlp["wo"]
    a = np.asarray(materialize(wo))
    out["wo"] = _dense(np.pad(a, ((0, d_ff - a.shape[0]), (0, 0))), bias_of(wo))
    return out


def prepare_export(cfg: LlamaConfig, params: dict) -> tuple[LlamaConfig, dict, list[str]]:
    """The config and params of a Hugging Face export (``HFSpec.prepare_export``).

    Hugging Face configs have one head count and one ``intermediate_size`` for all layers.
    When every layer kept the same number of query heads per key-value head and the same
    number of key-value heads (whole groups removed, or the same query heads of every group),
    the config gets those counts (``head_dim`` stays explicit) and the export is physically
    smaller; likewise ``intermediate_size`` when every MLP kept the same width. Otherwise the
    narrower blocks are zero-padded to the config's widths (exact), and their paths are
    returned (the export summary's ``widened``).
    """
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    layers = params["layers"]
    counts, regular = set(), True
    for lp in layers:
        qh, kvh = lp["attn"]["q_heads"], lp["attn"]["kv_heads"]
        r = _regular_groups(qh.ids, kvh.ids, group)
        regular = regular and r is not None
        counts.add((qh.num_heads, kvh.num_heads))
    ffs = {weight_shape(lp["mlp"]["wo"])[0] for lp in layers}
    new_layers, padded, updates = list(layers), [], {}
    if regular and len(counts) == 1:
        h, g = counts.pop()
        if (h, g) != (cfg.num_attention_heads, cfg.num_key_value_heads):
            updates.update(num_attention_heads=h, num_key_value_heads=g, head_dim=cfg.d_head)
    else:
        for i, lp in enumerate(layers):
            a = lp["attn"]
            if (a["q_heads"].ids != tuple(range(cfg.num_attention_heads))
                    or a["kv_heads"].ids != tuple(range(cfg.num_key_value_heads))):
                new_layers[i] = {**new_layers[i], "attn": _pad_attention(a, cfg)}
                padded.append(f"layers/{i}/attn")
    if len(ffs) == 1:
        if ffs != {cfg.intermediate_size}:
            updates["intermediate_size"] = ffs.pop()
    else:
        for i, lp in enumerate(layers):
            if weight_shape(lp["mlp"]["wo"])[0] != cfg.intermediate_size:
                new_layers[i] = {**new_layers[i], "mlp": _pad_mlp(lp["mlp"],
                                                                  cfg.intermediate_size)}
                padded.append(f"layers/{i}/mlp")
    if updates:
        cfg = dataclasses.replace(cfg, **updates)
    return cfg, {**params, "layers": new_layers}, padded


HF_SPEC = HFSpec(detect=detect_hf, config_from_hf=config_from_hf,
                 config_to_hf=lambda cfg: cfg.to_hf_dict(), key_table=hf_key_table,
                 optional=hf_optional_keys, rename=rename_hf_key,
                 prepare_export=prepare_export)

FAMILY = register_family(ModelFamily(
    name="llama", config_cls=LlamaConfig, init=init, apply=apply, sample_inputs=sample_inputs,
    primary_outputs=("logits",), token_outputs=True, loss=loss, hf=HF_SPEC,
    init_cache=init_cache, apply_cached=apply_cached))


__all__ = ["FAMILY", "LlamaConfig", "apply", "apply_cached", "init", "init_cache", "loss",
           "prepare_export", "sample_inputs"]
