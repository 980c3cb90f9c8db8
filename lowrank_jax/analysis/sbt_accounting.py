"""Size and FLOP accounting of "Sparse Binary Transformers for Multivariate Time Series
Modeling" (Gorbett et al., KDD 2023, arXiv:2308.04637, sec. 5.1, Table 5), reproducing its
Table 6, next to what the library really executes and stores.

:func:`paper_counts` applies the paper's conventions, reconstructed from its text, Table 5 and
its code, and reproduces every integer behind Table 6 (the test suite checks all eleven rows):

FLOPs (non-zero multiply-adds of one window of ``w`` steps):
  * linears outside attention (embedding, decoder, O, FF1, FF2): ``d_in d_out``, times ``k``
    (keep) in the SBT, **without** a factor ``w`` (sec. 5.1: "linear layers outside of attention
    do not need window size added ... because the inputs are permuted");
  * Q, K, V projections: ``d^2 w`` each, times ``k`` in the SBT;
  * attention per layer, ``d' = d / h``: full attention ``w d + h (2 w^2 d' + w^2)`` (Q scaling,
    ``QK^T``, ``AV``, softmax); step-T mask ``w d + h (2 (w-1) d' + w)`` (Table 5 prints
    ``AV = 2 (w-1) d'``, the numbers use ``(w-1) d'``); fixed Q/K/V masks
    ``w d k + 3 w d + h (floor(w k)^2 d' + w^2 + w floor(w k) d')`` (here the Q scaling is the
    ``w d k`` term);
  * sinusoidal positional encoding ``w d`` (a learnable one: 0); LayerNorm ``2 d w`` each in the
    dense model, ``d w / 2`` in the SBT (its masked gain); BatchNorm 0.
Bits:
  * dense: 32 per parameter, biases and the learnable ``1024 x d`` positional table of the
    dense classifier (the code's ``max_len``) included; the dense anomaly-detection model has
    the same time-axis LayerNorms as the forecaster (its code configs do);
  * SBT: 1 bit per weight *position* of the 14 binarized linears (pruned positions included),
    1 bit per masked LayerNorm gain (forecasting: the "18 modules"), 32 bits per BatchNorm
    weight (not its bias); ``alpha`` and the frozen Q/K/V/O biases are not counted.

Where the paper disagrees with itself (each reproduced as the table has it, see
:data:`TABLE6_NOTES`): Table 6 swaps ``m`` for Weather (12 features) and ETTm1 (7); ECL's SBT
FLOPs are computed at ``k = 0.5`` although its row says ``p = 0.75``; Arabic Digits' FLOPs
(2.8M / 1.3M) cannot come from the stated ``w = 93`` and fit ``w = 65``; two SBT parameter
counts (Arabic, FaceDetection) differ from the binary positions; JapaneseVowels' SBT size is
truncated to 0.04M.

:func:`model_counts` gives the library's own numbers for a built model: the multiply-adds
actually executed per token (every projection times ``w``, attention scores over the full
``w x w`` grid, since masks do not skip work in XLA) and the bits actually stored (float
masked-binary leaves: ``n_keep`` bits + ``alpha`` per the leaf's accounting; packed leaves:
their bit planes).
"""

from __future__ import annotations

import dataclasses

import jax

from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import flops as leaf_flops
from lowrank_jax.leaves import pack_binary_tree, param_count, storage_bits
from lowrank_jax.nn import attention_score_flops

TASKS = ("classification", "anomaly", "forecast")
PE_ROWS = 1024  # the reference dense classifier's learnable positional table


@dataclasses.dataclass(frozen=True)
class PaperConfig:
    """One row of Table 6: task, ``m`` features, window ``w``, width ``d``, keep ``k = 1 - p``,
    heads, layers, MLP width and (classification) classes."""

    name: str
    task: str
    m: int
    w: int
    d: int
    keep: float
    n_out: int
    heads: int = 2
    layers: int = 2
    d_ff: int = 256
    flops_keep: float | None = None  # the keep the FLOPs were computed at, when not `keep`

    def __post_init__(self):
        if self.task not in TASKS:
            raise ConfigError(f"PaperConfig.task must be one of {TASKS}, got {self.task!r}",
                              where="task", expected=TASKS, actual=self.task)
        if self.d % self.heads:
            raise ConfigError(f"PaperConfig: heads={self.heads} must divide d={self.d}",
                              where="heads", expected=f"a divisor of {self.d}",
                              actual=self.heads)


def _flops(c: PaperConfig, binary: bool) -> int:
    k = (c.flops_keep if c.flops_keep is not None else c.keep) if binary else 1.0
    m, w, d, h, f, n = c.m, c.w, c.d, c.heads, c.d_ff, c.layers
    dh = d // h
    outside = m * d + d * c.n_out + n * (d * d + 2 * d * f)
    qkv = n * 3 * d * d * w
    if not binary:
        attn = w * d + h * (2 * w * w * dh + w * w)
    elif c.task == "classification":
        wk = int(w * k)
        attn = w * d * k + 3 * w * d + h * (wk * wk * dh + w * w + w * wk * dh)
    else:
        attn = w * d + h * (2 * (w - 1) * dh + w)
    pe = 0 if (c.task == "classification" and not binary) else w * d
    n_ln = 2 * n if (c.task == "forecast" or (c.task == "anomaly" and not binary)) else 0
    ln = n_ln * (2 * d * w if not binary else d * w * 0.5)
    total = k * (outside + qkv) + n * attn + pe + ln
    return int(round(total))


def _dense_params(c: PaperConfig) -> int:
    m, w, d, f, n = c.m, c.w, c.d, c.d_ff, c.layers
    layer = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    if c.task == "classification":
        layer += 2 * 2 * d  # two BatchNorms, weight and bias
    else:
        layer += 2 * 2 * w  # two time-axis LayerNorms (w gains and biases); AD dense too
    pe = PE_ROWS * d if c.task == "classification" else 0
    return (m * d + d) + n * layer + (d * c.n_out + c.n_out) + pe


def _binary_positions(c: PaperConfig) -> int:
    m, d, f, n = c.m, c.d, c.d_ff, c.layers
    return m * d + d * c.n_out + n * (4 * d * d + 2 * d * f)


def paper_counts(c: PaperConfig) -> dict:
    """The paper's Table 6 quantities for one configuration (exact integers).

    Returns:
      ``dense_params``, ``dense_bits``, ``dense_flops``, ``sbt_params`` (binary weight
      positions, plus masked LayerNorm gains for forecasting), ``sbt_bits``, ``sbt_flops``,
      ``size_ratio``, ``flops_ratio``.
    """
    dp = _dense_params(c)
    pos = _binary_positions(c)
    if c.task == "forecast":
        sbt_params = pos + 2 * c.layers * c.w  # masked LN gains, 1 bit each
        sbt_bits = sbt_params
    elif c.task == "classification":
        sbt_params = pos
        sbt_bits = pos + 32 * 2 * c.layers * c.d  # BatchNorm weights in float32
    else:
        sbt_params = sbt_bits = pos
    df, sf = _flops(c, False), _flops(c, True)
    return {"dense_params": dp, "dense_bits": 32 * dp, "dense_flops": df,
            "sbt_params": sbt_params, "sbt_bits": sbt_bits, "sbt_flops": sf,
            "size_ratio": 32 * dp / sbt_bits, "flops_ratio": df / sf}


def _row(name, task, m, w, d, p, n_out, **kw):
    return PaperConfig(name=name, task=task, m=m, w=w, d=d, keep=round(1.0 - p, 6), n_out=n_out,
                       **kw)


#: The eleven configurations of Table 6 as the paper states them (Weather and ETTm1 with ``m``
#: corrected, ECL's FLOPs at ``k = 0.5``, Insect with the code's ``N = 3, h = 8``). Arabic
#: Digits is listed with its stated ``w = 93``: its size columns match, its FLOPs do not
#: (see :data:`TABLE6_NOTES`).
TABLE6_CONFIGS = {
    "Heartbeat": _row("Heartbeat", "classification", 61, 405, 64, 0.5, 2),
    "InsectWingbeat": _row("InsectWingbeat", "classification", 200, 30, 128, 0.5, 10,
                           heads=8, layers=3),
    "ArabicDigits": _row("ArabicDigits", "classification", 13, 93, 64, 0.5, 10),
    "JapaneseVowels": _row("JapaneseVowels", "classification", 12, 29, 32, 0.5, 9),
    "FaceDetection": _row("FaceDetection", "classification", 144, 62, 128, 0.5, 2),
    "MSL": _row("MSL", "anomaly", 55, 50, 110, 0.75, 55),
    "SMAP": _row("SMAP", "anomaly", 25, 50, 50, 0.75, 25),
    "SMD": _row("SMD", "anomaly", 38, 200, 76, 0.75, 38),
    "ECL": _row("ECL", "forecast", 321, 200, 350, 0.75, 321, flops_keep=0.5),
    "Weather": _row("Weather", "forecast", 12, 200, 100, 0.5, 12),
    "ETTm1": _row("ETTm1", "forecast", 7, 200, 64, 0.5, 7),
}

#: Table 6 as printed: dense params (K), size (M bits), FLOPs (M); SBT params (K), size
#: (M bits), FLOPs (M); savings size x, FLOPs x.
TABLE6 = {
    "Heartbeat": (169.6, 5.4, 52.7, 102.3, 0.1, 21.6, 49.1, 2.4),
    "InsectWingbeat": (555.5, 17.8, 5.4, 420.1, 0.4, 2.7, 40.0, 2.0),
    "ArabicDigits": (167.1, 5.3, 2.8, 100.0, 0.1, 1.3, 49.5, 2.2),
    "JapaneseVowels": (75.5, 2.4, 0.3, 41.6, 0.04, 0.2, 52.9, 2.1),
    "FaceDetection": (414.9, 13.3, 8.3, 281.3, 0.3, 4.0, 44.7, 2.1),
    "MSL": (223.7, 7.2, 4.9, 221.5, 0.2, 1.0, 32.3, 5.0),
    "SMAP": (75.2, 2.4, 1.3, 73.7, 0.1, 0.2, 32.6, 6.1),
    "SMD": (132.8, 4.2, 19.5, 129.8, 0.1, 1.9, 32.7, 10.5),
    "ECL": (1569.4, 50.2, 204.8, 1563.9, 1.6, 74.5, 32.1, 2.7),
    "Weather": (188.0, 6.0, 28.5, 185.6, 0.2, 6.2, 32.4, 4.6),
    "ETTm1": (102.0, 3.3, 15.5, 100.0, 0.1, 2.6, 32.6, 5.9),
}

TABLE6_NOTES = {
    "Weather": "Table 6 prints m = 7; the numbers need m = 12 (Weather has 12 features, the "
               "m of Weather and ETTm1 are swapped).",
    "ETTm1": "Table 6 prints m = 12; the numbers need m = 7.",
    "ECL": "The row says p = 0.75, but its SBT FLOPs (74.5M) are computed at k = 0.5; its "
           "size column (1 bit per position) does not depend on p.",
    "ArabicDigits": "The FLOPs (2.8M dense / 1.3M SBT) do not follow from the stated w = 93 "
                    "(which gives 4.6M / 2.1M); they fit w = 65 (ARABIC_FLOPS_WINDOW). The SBT "
                    "parameter count is printed as 100.0K where the binary positions give 99.8K "
                    "(no stated dimension gives 100.0K). Dense params and both sizes match.",
    "FaceDetection": "The SBT parameter count is printed as 281.3K; the binary positions give "
                     "280.8K (281.3K would add the 512 BatchNorm weights, which no other row "
                     "adds). Sizes and FLOPs match.",
    "JapaneseVowels": "The SBT size, 45,728 bits, is printed as 0.04M (truncated, not "
                      "rounded); the ratio 52.9 matches.",
    "InsectWingbeat": "The paper states N = 2, h = 2 for every model; the Insect row fits the "
                      "code's configuration N = 3, h = 8 (Table 8 prints the SBT parameter "
                      "count as 420.9K, Table 6 as 420.1K; the positions give 420.1K).",
}

ARABIC_FLOPS_WINDOW = 65


def table6_row(name: str) -> dict:
    """``paper_counts`` of a Table 6 configuration in the table's units (K params, M bits,
    M FLOPs), next to the printed row."""
    if name not in TABLE6_CONFIGS:
        raise ConfigError(f"table6_row: unknown configuration {name!r}; known: "
                          f"{sorted(TABLE6_CONFIGS)}", where="name",
                          expected=sorted(TABLE6_CONFIGS), actual=name)
    c = paper_counts(TABLE6_CONFIGS[name])
    ours = (c["dense_params"] / 1e3, c["dense_bits"] / 1e6, c["dense_flops"] / 1e6,
            c["sbt_params"] / 1e3, c["sbt_bits"] / 1e6, c["sbt_flops"] / 1e6, c["size_ratio"],
            c["flops_ratio"])
    return {"name": name, "exact": c, "computed": ours, "printed": TABLE6[name],
            "note": TABLE6_NOTES.get(name)}


# ---------------------------------------------------------------------------------------------
# What the library executes and stores.

def model_counts(params, cfg) -> dict:
    """Honest counts of a built SBT / dense model (:mod:`lowrank_jax.models.sbt`).

    Returns:
      ``flops_per_token``: multiply-adds executed per time step of one window (every weight
      leaf at ``w`` tokens, non-zero weights for float masked-binary leaves as their count
      says, plus the attention scores and weighted values over the full ``w x w`` grid:
      XLA computes masked entries too); ``flops_window`` (= per token x ``w``);
      ``params``; ``stored_bits`` (the leaves' own accounting: float32 arrays, 1 bit per kept
      binary weight + alpha); ``packed_bits`` (the bits a :class:`PackedBinary` model really
      stores: 2 bit planes per binary weight + alpha + float32 rest; equal to
      ``stored_bits`` for a dense model).
    """
    w = cfg.window
    f = leaf_flops(params, w)
    for lp in params["layers"]:
        f += attention_score_flops(lp["attn"], w, w)
    packed = pack_binary_tree(params)
    return {"flops_window": int(f), "flops_per_token": f / w,
            "params": int(param_count(params)), "stored_bits": int(storage_bits(params)),
            "packed_bits": int(storage_bits(packed)),
            "float32_bits": int(32 * sum(x.size for x in jax.tree_util.tree_leaves(params)
                                         if x.dtype.kind == "f"))}


__all__ = ["ARABIC_FLOPS_WINDOW", "PaperConfig", "TABLE6", "TABLE6_CONFIGS", "TABLE6_NOTES",
           "model_counts", "paper_counts", "table6_row"]
