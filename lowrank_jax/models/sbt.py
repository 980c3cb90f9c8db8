"""The sparse binary transformer (SBT) for multivariate time series and its dense twin.

"Sparse Binary Transformers for Multivariate Time Series Modeling" (Gorbett, Shirazi, Ray,
KDD 2023, arXiv:2308.04637), sec. 3 and 4.4, built on the encoder of "A Transformer-based
Framework for Multivariate Time Series Representation Learning" (Zerveas et al., KDD 2021):

* input ``x [batch, w, m]`` -> linear ``m -> d`` scaled by ``sqrt(d)`` -> positional encoding
  (sinusoidal; learnable ``[w, d]`` for the dense classifier, sec. 3.1 and App. B);
* ``N`` post-norm encoder layers: ``z = Norm(z + MHA(z))``, ``z = Norm(z + W2 relu(W1 z))``;
* ``relu`` on the encoder output, then a decoder linear applied per time step.

Per task (sec. 3.1, 3.3, 4; App. B):

===============  =====================  ===========================  ========================
task             norm                   attention (SBT only)         output
===============  =====================  ===========================  ========================
classification   BatchNorm over batch   fixed random Q/K/V           ``logits [batch, C]``:
                 and time (running      activation masks             the per-step decoder
                 statistics in the      (sec. 3.3.1), keep = the     outputs averaged over
                 model state)           weight keep                  all ``w`` steps
anomaly          none                   step-T mask (sec. 3.3.2)     ``reconstruction``
forecast         LayerNorm over the     step-T mask                  ``reconstruction``
                 *time* axis (the                                    (the last input step is
                 code's LayerNorm(w))                                zeroed first)
===============  =====================  ===========================  ========================

In the SBT every linear is a :class:`~lowrank_jax.MaskedBinary` leaf (embedding, Q, K, V, O,
both MLP linears, decoder: the paper's 14 binarized modules for two layers) with no bias,
except Q/K/V/O, which carry a frozen random bias (:class:`~lowrank_jax.leaves.FixedBias`), as
the reference code's ``MultiheadAttention(bias=True)`` does. Weights and scores are drawn
``U(+-1/sqrt(fan_in))``, each layer its own draws. The dense variant uses
:class:`~lowrank_jax.Dense` leaves with trained biases (PyTorch's default init), full
attention, and the same norms.

Choices where the paper and its code are unclear or wrong (what users expect):

* The key-padding mask is applied the right way round (``True`` = real step): the reference
  code inverts it, so its model attends only to padding.
* Classification averages the decoder outputs over all ``w`` steps, padding included, as the
  paper and code do; BatchNorm statistics include padded steps too.
* The forecasting time-axis LayerNorm keeps float gain and bias ``[w]`` (the code masks the
  gain by its top-50% scores and counts it as 1 bit; the accounting in
  :mod:`lowrank_jax.analysis.sbt_accounting` follows the paper's count).
* Attention logits are scaled by ``1/sqrt(d/h)`` (the code; the paper writes ``sqrt(d)``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.leaves import (
    Dense,
    FixedBias,
    HeadLayout,
    QueryKey,
    init_masked_binary,
    linear,
)
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.nn import (
    AttentionConfig,
    BatchNormConfig,
    MLPConfig,
    apply_attention,
    apply_batch_norm,
    apply_mlp,
    combine_masks,
    init_batch_norm,
    padding_mask,
    step_t_mask,
)

TASKS = ("classification", "anomaly", "forecast")


@dataclasses.dataclass(frozen=True)
class SBTConfig:
    """A sparse binary (or dense) time-series transformer.

    Attributes:
      n_features: ``m``, input features per step.
      window: ``w``, steps per input window.
      task: ``'classification'``, ``'anomaly'`` or ``'forecast'``.
      n_classes: classification only: number of classes.
      d_model: ``d``.
      num_heads: ``h`` (must divide ``d``).
      d_ff: MLP hidden width.
      num_layers: ``N``.
      binary: SBT (masked-binary linears) if ``True``, else the dense transformer.
      keep: fraction of weights kept per binary linear (``1 - p``); also the keep fraction of
        the classification Q/K/V activation masks (the paper sets ``p_a = p``).
      qkv_masks: use fixed Q/K/V activation masks; ``None``: SBT classification only.
      step_t: use the step-T attention mask; ``None``: SBT anomaly detection / forecasting.
      learnable_pe: learnable positional encoding; ``None``: dense classification only.
      mask_seed: base seed of the Q/K/V activation masks (layer ``l`` uses ``seed + l``).
      bn_momentum: BatchNorm running-statistics momentum (PyTorch's 0.1).
    """

    n_features: int
    window: int
    task: str = "classification"
    n_classes: int = 0
    d_model: int = 32
    num_heads: int = 2
    d_ff: int = 256
    num_layers: int = 2
    binary: bool = True
    keep: float = 0.5
    qkv_masks: bool | None = None
    step_t: bool | None = None
    learnable_pe: bool | None = None
    mask_seed: int = 0
    bn_momentum: float = 0.1

    def __post_init__(self):
        if self.task not in TASKS:
            raise ConfigError(f"SBTConfig.task must be one of {TASKS}, got {self.task!r}",
                              where="task", expected=TASKS, actual=self.task)
        for f in ("n_features", "window", "d_model", "num_heads", "d_ff", "num_layers"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"SBTConfig.{f} must be a positive int, got {v!r}", where=f,
                                  expected="int >= 1", actual=v)
        if self.d_model % self.num_heads:
            raise ConfigError(f"SBTConfig: num_heads={self.num_heads} must divide "
                              f"d_model={self.d_model}", where="num_heads",
                              expected=f"a divisor of {self.d_model}", actual=self.num_heads)
        if self.task == "classification" and (not isinstance(self.n_classes, int)
                                               or self.n_classes < 2):
            raise ConfigError(f"SBTConfig.n_classes must be an int >= 2 for classification, got "
                              f"{self.n_classes!r}", where="n_classes", expected=">= 2",
                              actual=self.n_classes)
        if not (isinstance(self.keep, (int, float)) and 0.0 < self.keep <= 1.0):
            raise ConfigError(f"SBTConfig.keep must be in (0, 1], got {self.keep!r}",
                              where="keep", expected="(0, 1]", actual=self.keep)
        if self.use_step_t and self.window < 2:
            raise ConfigError("SBTConfig: the step-T mask needs window >= 2", where="window",
                              expected=">= 2", actual=self.window)

    @property
    def use_qkv_masks(self) -> bool:
        if self.qkv_masks is None:
            return self.binary and self.task == "classification"
        return bool(self.qkv_masks)

    @property
    def use_step_t(self) -> bool:
        if self.step_t is None:
            return self.binary and self.task != "classification"
        return bool(self.step_t)

    @property
    def use_learnable_pe(self) -> bool:
        if self.learnable_pe is None:
            return (not self.binary) and self.task == "classification"
        return bool(self.learnable_pe)

    @property
    def norm(self) -> str | None:
        """``'batch'``, ``'time_layer'`` or ``None`` (sec. 4.4, App. B)."""
        return {"classification": "batch", "forecast": "time_layer", "anomaly": None}[self.task]

    @property
    def n_out(self) -> int:
        return self.n_classes if self.task == "classification" else self.n_features

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(use_bias=True, scaled=True,
                               qkv_keep=self.keep if self.use_qkv_masks else None,
                               qkv_mask_seed=self.mask_seed)

    @property
    def stateful(self) -> bool:
        return self.norm == "batch"


def sinusoidal_encoding(w: int, d: int) -> np.ndarray:
    """Vaswani et al.'s positional encoding ``[w, d]``: ``sin(pos / 10000^(2i/d))`` at even,
    ``cos`` at odd channels (float32)."""
    pos = np.arange(w, dtype=np.float64)[:, None]
    div = np.exp(np.arange(0, d, 2, dtype=np.float64) * (-math.log(10000.0) / d))
    pe = np.zeros((w, d))
    pe[:, 0::2] = np.sin(pos * div)
    pe[:, 1::2] = np.cos(pos * div)[:, : d // 2]
    return pe.astype(np.float32)


def _uniform(key, shape, fan_in):
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def _linear(key, d_in, d_out, cfg: SBTConfig, *, frozen_bias: bool = False):
    """One linear of the model: a bias-free MaskedBinary (SBT; with a frozen random bias for
    Q/K/V/O) or a Dense with trained bias (PyTorch ``nn.Linear`` init)."""
    kw, kb = jax.random.split(key)
    if cfg.binary:
        leaf = init_masked_binary(kw, d_in, d_out, cfg.keep)
        return FixedBias(leaf, _uniform(kb, (d_out,), d_in)) if frozen_bias else leaf
    return Dense(_uniform(kw, (d_in, d_out), d_in), _uniform(kb, (d_out,), d_in))


def _init_norm(cfg: SBTConfig) -> dict:
    if cfg.norm == "batch":
        return init_batch_norm(cfg.d_model)[0]
    if cfg.norm == "time_layer":
        return {"scale": jnp.ones((cfg.window,)), "bias": jnp.zeros((cfg.window,))}
    return {}


def init(key, cfg: SBTConfig) -> dict:
    """Parameters ``{'embed', ['pos'], 'layers': [...], 'decoder'}``.

    Every layer ``{'attn': {'qk', 'v', 'o', 'heads'}, 'mlp': {'wi', 'wo'}, 'norm1', 'norm2'}``
    draws its own weights and scores (the reference's identical deep-copied layers are not
    reproduced).
    """
    d, h = cfg.d_model, cfg.num_heads
    dh = d // h
    keys = jax.random.split(key, 3 + cfg.num_layers)
    params = {"embed": _linear(keys[0], cfg.n_features, d, cfg)}
    if cfg.use_learnable_pe:
        params["pos"] = jax.random.uniform(keys[1], (cfg.window, d), jnp.float32, -0.02, 0.02)
    layers = []
    for i in range(cfg.num_layers):
        kq, kk, kv, ko, k1, k2 = jax.random.split(keys[3 + i], 6)
        lin = lambda k, a, b, fb=False: _linear(k, a, b, cfg, frozen_bias=fb)  # noqa: E731
        layers.append({
            "attn": {"qk": QueryKey(q=lin(kq, d, d, True), k=lin(kk, d, d, True),
                                    widths=(dh,) * h),
                     "v": lin(kv, d, d, True), "o": lin(ko, d, d, True),
                     "heads": HeadLayout.uniform(h, dh, 1.0 / math.sqrt(dh))},
            "mlp": {"wi": lin(k1, d, cfg.d_ff), "wo": lin(k2, cfg.d_ff, d)},
            "norm1": _init_norm(cfg), "norm2": _init_norm(cfg),
        })
    params["layers"] = layers
    params["decoder"] = _linear(keys[2], d, cfg.n_out, cfg)
    return params


def init_state(params: dict, cfg: SBTConfig) -> dict | None:
    """BatchNorm running statistics ``{'layers': [{'norm1': {mean, var}, 'norm2': ...}]}`` for
    classification; ``None`` for the stateless tasks."""
    if not cfg.stateful:
        return None
    return {"layers": [{"norm1": init_batch_norm(cfg.d_model)[1],
                        "norm2": init_batch_norm(cfg.d_model)[1]}
                       for _ in range(len(params["layers"]))]}


def _time_layer_norm(p: dict, z, eps: float = 1e-5):
    """PyTorch ``LayerNorm(w)`` applied to ``[batch, d, w]``: statistics over time per
    (sample, channel), gain and bias per time step. ``z: [batch, w, d]``."""
    mean = jnp.mean(z, axis=1, keepdims=True)
    var = jnp.mean(jnp.square(z - mean), axis=1, keepdims=True)
    y = (z - mean) * jax.lax.rsqrt(var + eps)
    return y * p["scale"][None, :, None] + p["bias"][None, :, None]


def _norm(p: dict, z, cfg: SBTConfig, state, train: bool):
    if cfg.norm == "batch":
        return apply_batch_norm(p, z, BatchNormConfig(momentum=cfg.bn_momentum), state=state,
                                train=train)
    if cfg.norm == "time_layer":
        return _time_layer_norm(p, z), state
    return z, state


def check_inputs(inputs: dict, cfg: SBTConfig):
    """``(x [batch, w, m] float32, valid [batch, w] bool or None)`` from ``inputs``."""
    if not isinstance(inputs, dict) or "x" not in inputs or not set(inputs) <= {"x", "valid"}:
        got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise DataError("sbt.apply: inputs must be {'x': [batch, w, m]} plus optionally "
                        "{'valid': [batch, w]}", where="inputs", expected=["x", "valid"],
                        actual=got)
    x = jnp.asarray(inputs["x"], jnp.float32)
    if x.ndim != 3 or x.shape[1:] != (cfg.window, cfg.n_features):
        raise DataError(f"sbt.apply: inputs['x'] must be [batch, window={cfg.window}, "
                        f"n_features={cfg.n_features}], got {tuple(x.shape)}", where="inputs/x",
                        expected=(cfg.window, cfg.n_features), actual=tuple(x.shape))
    valid = inputs.get("valid")
    if valid is not None:
        valid = jnp.asarray(valid)
        if valid.shape != x.shape[:2]:
            raise DataError(f"sbt.apply: inputs['valid'] must be [batch, window] = "
                            f"{tuple(x.shape[:2])}, got {tuple(valid.shape)}",
                            where="inputs/valid", expected=tuple(x.shape[:2]),
                            actual=tuple(valid.shape))
    return x, valid


def apply(params: dict, inputs: dict, cfg: SBTConfig, *, state: dict | None = None,
          train: bool = False) -> dict:
    """Run the model.

    Args:
      params: from :func:`init` (binary leaves may be packed: any leaf type runs).
      inputs: ``{'x': [batch, w, m]}``, plus ``'valid': [batch, w]`` (``True`` for real steps)
        for padded classification inputs.
      cfg: the config.
      state: classification: BatchNorm running statistics (:func:`init_state`); required.
      train: BatchNorm uses batch statistics and updates ``state`` (else running ones).

    Returns:
      classification: ``{'logits': [batch, C], 'state': new_state}``; anomaly / forecast:
      ``{'reconstruction': [batch, w, m]}`` (forecast zeroes the last input step first, so
      ``reconstruction[:, -1]`` is its forecast).
    """
    x, valid = check_inputs(inputs, cfg)
    if cfg.stateful and state is None:
        raise ConfigError("sbt.apply: a classification SBT needs its BatchNorm state "
                          "(sbt.init_state(params, cfg))", where="state", expected="a state",
                          actual=None)
    if cfg.task == "forecast":
        x = x.at[:, -1, :].set(0.0)
    d = cfg.d_model
    z = linear(params["embed"], x) * np.float32(math.sqrt(d))  # [batch, w, d]
    pe = params["pos"] if "pos" in params else jnp.asarray(sinusoidal_encoding(cfg.window, d))
    z = z + pe[None]
    mask = combine_masks(padding_mask(valid) if valid is not None else None,
                         step_t_mask(cfg.window) if cfg.use_step_t else None)
    att_cfg = cfg.attention
    mlp_cfg = MLPConfig(activation="relu")
    new_layers = []
    for i, lp in enumerate(params["layers"]):
        ls = state["layers"][i] if state is not None else {"norm1": None, "norm2": None}
        z = z + apply_attention(lp["attn"], z, att_cfg, mask=mask, layer_index=i)
        z, s1 = _norm(lp["norm1"], z, cfg, ls["norm1"], train)
        z = z + apply_mlp(lp["mlp"], z, mlp_cfg)
        z, s2 = _norm(lp["norm2"], z, cfg, ls["norm2"], train)
        new_layers.append({"norm1": s1, "norm2": s2})
    z = jax.nn.relu(z)
    y = linear(params["decoder"], z)  # [batch, w, n_out]
    if cfg.task == "classification":
        return {"logits": jnp.mean(y, axis=1), "state": {"layers": new_layers}}
    return {"reconstruction": y}


def loss(cfg: SBTConfig):
    """The paper's objective: cross-entropy of the time-averaged logits (classification,
    stateful: ``loss_fn(params, state, batch, key) -> (loss, aux, new_state)`` on
    ``{'x', 'valid', 'y'}``), or the MSE of the last step (anomaly / forecast,
    ``loss_fn(params, batch, key)`` on ``{'x'}``; features and batch averaged: the code sums
    over the batch, which Adam does not see apart from its epsilon)."""
    if cfg.stateful:
        def loss_fn(params, state, batch, key):
            del key
            inputs = {k: batch[k] for k in ("x", "valid") if k in batch}
            out = apply(params, inputs, cfg, state=state, train=True)
            logp = jax.nn.log_softmax(out["logits"], axis=-1)
            nll = -jnp.take_along_axis(logp, batch["y"][:, None].astype(jnp.int32), axis=1)
            acc = jnp.mean(jnp.argmax(logp, -1) == batch["y"])
            return jnp.mean(nll), {"accuracy": acc}, out["state"]
        return loss_fn

    def loss_fn(params, batch, key):
        del key
        out = apply(params, {"x": batch["x"]}, cfg)
        err = jnp.mean(jnp.square(out["reconstruction"][:, -1] - batch["x"][:, -1]))
        return err, {}
    return loss_fn


def sample_inputs(cfg: SBTConfig, rng: np.random.Generator, batch: int) -> dict:
    """Standard-normal windows ``{'x': [batch, w, m]}`` (inputs are z-scored per feature)."""
    return {"x": jnp.asarray(rng.standard_normal((batch, cfg.window, cfg.n_features)),
                             jnp.float32)}


FAMILY = register_family(ModelFamily(
    name="sbt", config_cls=SBTConfig, init=init, apply=apply, sample_inputs=sample_inputs,
    primary_outputs=("logits", "reconstruction"), loss=loss, init_state=init_state))

__all__ = ["FAMILY", "SBTConfig", "TASKS", "apply", "check_inputs", "init", "init_state", "loss",
           "sample_inputs", "sinusoidal_encoding"]
