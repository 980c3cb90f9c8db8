"""The ``prune`` workflow on a decoder-only language model (GPT-2, Llama-style): structured
pruning of query heads, whole key-value groups and MLP channels, scored and fine-tuned on text
with the next-token loss.

1. text: the Python standard library's own source (:func:`lowrank_jax.text.stdlib_corpus`:
   its training files for scoring and fine-tuning, its held-out files for perplexity), or a
   text file / directory of text files given by the user (every file, sorted by path, in one
   token stream whose last tenth of windows is held out). It is tokenized with the model
   directory's ``tokenizer.json`` (or another one) and cut into windows of ``seq_len`` tokens;
   batch ``j`` is a deterministic draw of ``batch_size`` training windows from ``(seed, j)``;
2. ``kv_groups``: that fraction of every layer's key-value groups (a key-value head with every
   query head reading it, which shrinks the key-value cache too) is removed, then ``heads``:
   that fraction of the query heads of every key-value group (of every layer in GPT-2), both by
   the ``prune_heads`` plan method (:mod:`lowrank_jax.compress.head_pruning`: importance of a
   gate on each head's output, "Are Sixteen Heads Really Better than One?",
   arXiv:1905.10650), the same number from every layer;
3. ``mlp``: that fraction of all MLP hidden channels is removed, the least important first,
   ranked across layers (so layers may keep different widths; every layer keeps one), or
   with ``mlp_equal`` the same share of every layer, by the
   same first-order importance of a gate on each channel's output
   (:func:`mlp_channel_scores`), averaged over ``prune_steps`` batches; only hidden channels
   go (the residual-width channels stay, unlike the forecaster workflow's Algorithm 1);
4. the largest difference between the logits of the masked model (the original with the
   removed heads' outputs and the removed channels switched off) and of the physically pruned
   model is reported, on a held-out batch;
5. ``finetune_steps`` steps of fine-tuning (all weights, or LoRA updates of rank ``lora``) with
   the next-token loss on further training batches;
6. held-out perplexity before pruning, after pruning and after fine-tuning.

A Hugging Face config has one head count and one MLP width (Llama's ``intermediate_size``,
GPT-2's ``n_inner``) for all layers: the report says whether ``lowrank-jax export`` of the
result will be physically smaller (every layer kept the same counts, and the config can say
so) or zero-padded to the config's widths (exact, but as large as the original there), and
which blocks are padded. GPT-2's pruned heads are always zero-padded (its head width is
``n_embd / n_head``); its MLPs are written smaller when they kept equal widths.
"""

from __future__ import annotations

import os
import time

import numpy as np

from lowrank_jax.errors import ConfigError, DataError, MissingFileError
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress

#: The MLP weights whose hidden channels ``mlp`` prunes.
MLP_RULES = (r"mlp/(wi|wi_0|wi_1|wo)$",)
#: The name of the batch source registered for the ``prune_heads`` steps.
BATCHES = "lowrank-jax prune: text"
#: Share of the windows of a user's text held out for perplexity.
HELD_OUT = 0.1


def is_language_model(config) -> bool:
    """Whether ``config``'s family is a decoder-only language model
    (:attr:`lowrank_jax.models.ModelFamily.is_language_model`)."""
    from lowrank_jax.models import family_of

    return family_of(config).is_language_model


def max_positions(config) -> int | None:
    """The longest sequence the model takes: GPT-2's ``n_positions``, a Llama-style model's
    ``max_position_embeddings`` (and a Mistral model's ``sliding_window``)."""
    sizes = [getattr(config, n, None) for n in ("n_positions", "max_position_embeddings",
                                                "sliding_window")]
    sizes = [int(s) for s in sizes if s is not None]
    return min(sizes) if sizes else None


def _files_of(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
    return sorted(files)


def text_windows(tokenizer, *, text: str | None, seq_len: int, vocab_size: int,
                 max_bytes: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(train windows, held-out windows, description)``: token windows ``[n, seq_len]``.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``.
      text: ``None`` for the standard library's source (training and held-out files), or a
        text file / directory (every file read as UTF-8, invalid bytes replaced; the last
        :data:`HELD_OUT` of the windows held out, at least one).
      seq_len: tokens per window.
      vocab_size: the model's vocabulary (every token id must be below it).
      max_bytes: at most about this many characters of text are read per part.

    Raises:
      MissingFileError: ``text`` does not exist; DataError: no text, too little for two
        windows, or token ids beyond the model's vocabulary.
    """
    from lowrank_jax.text import encode_texts, stdlib_corpus, token_windows

    if text is None:
        corpus = stdlib_corpus()
        train = token_windows(encode_texts(tokenizer, corpus.read("train", max_bytes)),
                              seq_len)
        held = token_windows(encode_texts(tokenizer, corpus.read("held_out", max_bytes)),
                             seq_len)
        info = {"source": "python standard library", **corpus.info()}
    else:
        if not os.path.exists(text):
            raise MissingFileError(f"--text {text}: no such file or directory", where="--text")
        files = _files_of(text)
        texts, total = [], 0
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())
            total += len(texts[-1])
            if total > 2 * max_bytes:
                break
        stream = encode_texts(tokenizer, [t for t in texts if t])
        n = len(stream) // seq_len
        if n < 2:
            raise DataError(f"--text {text}: {len(stream)} tokens make fewer than 2 windows of "
                            f"--seq-len {seq_len} (one to train on, one held out)",
                            where="--text", expected=f">= {2 * seq_len} tokens",
                            actual=len(stream))
        windows = token_windows(stream, seq_len)
        n_held = max(1, int(round(HELD_OUT * n)))
        train, held = windows[:-n_held], windows[-n_held:]
        info = {"source": os.path.abspath(text), "files": len(texts)}
    top = int(max(train.max(), held.max()))
    if top >= vocab_size:
        raise DataError(f"--tokenizer: the text encodes to token id {top}, beyond the model's "
                        f"vocabulary of {vocab_size}: the tokenizer is not the model's",
                        where="--tokenizer", expected=f"< {vocab_size}", actual=top)
    info.update(train_windows=int(len(train)), held_out_windows=int(len(held)),
                seq_len=int(seq_len))
    return train, held, info


def tokenizer_file(tokenizer: str | None, model: str | None) -> str | None:
    """The ``tokenizer.json`` a language model's text is tokenized with: ``tokenizer`` (a file,
    or a directory holding ``tokenizer.json``) or, without it, the one in the model directory
    ``model``; ``None`` when that file does not exist."""
    from lowrank_jax.recipes.generate import TOKENIZER_NAME

    where = tokenizer if tokenizer is not None else model
    if where is None:
        return None
    file = os.path.join(where, TOKENIZER_NAME) if os.path.isdir(where) else where
    return file if os.path.isfile(file) else None


def default_seq_len(config, seq_len: int | None = None) -> int:
    """``seq_len``, or 128 tokens (at most the model's longest sequence) without it.

    Raises:
      ConfigError: ``seq_len`` longer than the model's longest sequence.
    """
    limit = max_positions(config)
    seq = seq_len or min(128, limit or 128)
    if limit is not None and seq > limit:
        raise ConfigError(f"--seq-len {seq} exceeds the model's longest sequence {limit}",
                          where="--seq-len", expected=f"<= {limit}", actual=seq)
    return seq


def model_text(config, model: str | None, *, text: str | None = None,
               tokenizer: str | None = None, seq_len: int | None = None,
               max_bytes: int = 200_000, command: str = "prune"):
    """``(train windows, held-out windows, description)`` of a language model's text: the
    standard library's source (or ``text``) tokenized with ``tokenizer`` or the model
    directory's ``tokenizer.json`` (:func:`tokenizer_file`), cut into windows of
    :func:`default_seq_len` tokens (:func:`text_windows`).

    Args:
      config: the model's config.
      model: the model directory (where ``tokenizer.json`` is looked for without
        ``tokenizer``), or ``None``.
      text, tokenizer, seq_len: as ``lowrank-jax prune``'s ``--text``, ``--tokenizer``,
        ``--seq-len``.
      max_bytes: at most about this many characters of text per part.
      command: the command named in errors.

    Raises:
      ConfigError: ``seq_len`` too long; MissingFileError: no tokenizer; DataError: as
        :func:`text_windows`.
    """
    from lowrank_jax.recipes.generate import TOKENIZER_NAME, load_tokenizer

    seq = default_seq_len(config, seq_len)
    file = tokenizer_file(tokenizer, model)
    if file is None:
        where = tokenizer if tokenizer is not None else os.path.join(str(model), TOKENIZER_NAME)
        raise MissingFileError(f"{command}: no tokenizer at {where}; pass --tokenizer with a "
                               "tokenizer.json (or a directory holding one)", where="--tokenizer")
    train, held, info = text_windows(load_tokenizer(file), text=text, seq_len=seq,
                                     vocab_size=int(config.vocab_size), max_bytes=max_bytes)
    info["tokenizer"] = os.path.abspath(file)
    return train, held, info


def text_batches(windows: np.ndarray):
    """A batch source of token windows for
    :func:`lowrank_jax.compress.prune.register_batches`: ``make(config, *, batch_size, seed)``
    whose batch ``j`` is ``{'input_ids': [batch_size, seq_len]}``, a deterministic draw of
    ``windows`` from ``(seed, j)``."""
    def make(config, *, batch_size, seed=0):
        return _Windows(windows, batch_size, seed).batch

    return make


class _Windows:
    """Batches of training windows, batch ``j`` drawn from ``(seed, j)`` (a
    :class:`lowrank_jax.train.BatchSource`)."""

    def __init__(self, windows: np.ndarray, batch_size: int, seed: int):
        self.windows, self.batch_size, self.seed, self.position = windows, batch_size, seed, 0

    def batch(self, j: int) -> dict:
        rng = np.random.default_rng((int(self.seed), int(j)))
        idx = rng.integers(0, len(self.windows), size=self.batch_size)
        return {"input_ids": self.windows[idx]}


def _head_layout(block):
    from lowrank_jax.nn.attention.grouped import is_grouped_block

    return block["q_heads"] if is_grouped_block(block) else block["heads"]


def _kv_heads(block) -> int | None:
    from lowrank_jax.nn.attention.grouped import is_grouped_block

    return block["kv_heads"].num_heads if is_grouped_block(block) else None


def _gated(original, pruned):
    """``original`` with the output rows of the query heads that ``pruned`` no longer has set
    to zero (the masked model of head pruning)."""
    import jax.numpy as jnp

    from lowrank_jax.leaves import Dense, bias_of, get_path, materialize, replace_paths

    new = {}
    for i, (lo, lp) in enumerate(zip(original["layers"], pruned["layers"], strict=True)):
        before, after = _head_layout(lo["attn"]), _head_layout(lp["attn"])
        if after.ids == before.ids:
            continue
        off = np.concatenate([[0], np.cumsum(before.v)])
        keep = np.zeros(int(off[-1]), np.float32)
        for n, h in enumerate(before.ids):
            if h in after.ids:
                keep[off[n]:off[n + 1]] = 1.0
        o = get_path(original, f"layers/{i}/attn/o")
        new[f"layers/{i}/attn/o"] = Dense(w=jnp.asarray(materialize(o)) * keep[:, None],
                                          b=bias_of(o))
    return replace_paths(original, new)


def mlp_channel_scores(params, loss_fn, batches, steps: int) -> list[np.ndarray]:
    """Per layer, the importance of every MLP hidden channel: the magnitude of the loss
    derivative with respect to a gate on the channel's output, ``|sum_r W_o[c, r] dL/dW_o[c,
    r]|`` (the first-order change of the loss when the channel is switched off, as
    ``prune_heads`` scores heads), averaged over ``batches(0 .. steps - 1)``."""
    import jax
    import jax.numpy as jnp

    from lowrank_jax.leaves import Dense, bias_of, get_path, materialize, replace_paths

    paths = [f"layers/{i}/mlp/wo" for i in range(len(params["layers"]))]
    dense = [jnp.asarray(materialize(get_path(params, p))) for p in paths]
    biases = [bias_of(get_path(params, p)) for p in paths]

    def loss(ws, batch):
        new = {p: Dense(w=w, b=b) for p, w, b in zip(paths, ws, biases, strict=True)}
        return loss_fn(replace_paths(params, new), batch, None)[0]

    grad = jax.jit(jax.grad(loss))
    total = [np.zeros(w.shape[0], np.float64) for w in dense]
    for j in range(steps):
        for acc, w, g in zip(total, dense, grad(dense, batches(j)), strict=True):
            acc += np.sum(np.asarray(w, np.float64) * np.asarray(g, np.float64), axis=1)
    return [np.abs(t / steps) for t in total]


def select_channels(scores: list[np.ndarray], fraction: float, *,
                    equal: bool = False) -> list[np.ndarray]:
    """Boolean keep masks: the ``floor(fraction * total)`` lowest-scored channels removed,
    ranked across layers (ties by layer, then channel), every layer keeping at least one; with
    ``equal``, the ``floor(fraction * n)`` lowest of every layer of ``n`` channels instead."""
    if equal:
        keep = []
        for sc in scores:
            k = np.ones(len(sc), bool)
            m = min(int(np.floor(fraction * len(sc) + 1e-9)), len(sc) - 1)
            k[np.argsort(sc, kind="stable")[:m]] = False
            keep.append(k)
        return keep
    pool = sorted((float(v), i, c) for i, sc in enumerate(scores) for c, v in enumerate(sc))
    keep = [np.ones(len(sc), bool) for sc in scores]
    m = int(np.floor(fraction * len(pool) + 1e-9))
    for _, i, c in pool:
        if m == 0:
            break
        if keep[i].sum() > 1:
            keep[i][c] = False
            m -= 1
    return keep


def export_form(config, params) -> dict:
    """What ``save_pretrained`` (``lowrank-jax export``) will write for ``params``:
    ``{'physically_smaller': bool, 'zero_padded': [block paths], 'config': {changed sizes}}``.

    It runs the export's own preparation and state-dict construction in memory (a float32 copy
    of the weights), so it says exactly what the export does."""
    from lowrank_jax.convert.export import state_dict_from_params
    from lowrank_jax.convert.load import hf_spec
    from lowrank_jax.models import family_of

    spec = hf_spec(family_of(config))
    new_cfg, prepared, padded = spec.prepare_export(config, params)
    _, _, widened = state_dict_from_params(new_cfg, prepared)
    padded = sorted(set(padded) | set(widened))
    before, after = spec.config_to_hf(config), spec.config_to_hf(new_cfg)
    changed = {k: after[k] for k in after if before.get(k) != after[k]}
    return {"physically_smaller": not padded, "zero_padded": padded, "config": changed}


def prune_language_model(src, *, heads: float = 0.0, kv_groups: float = 0.0, mlp: float = 0.0,
                         mlp_equal: bool = False, text: str | None = None, tokenizer: str | None = None,
                         seq_len: int | None = None, prune_steps: int = 20,
                         batch_size: int = 32, finetune_steps: int = 0, lr: float = 1e-4, lora: int = 0,
                         eval_batches: int = 8, seed: int = 0, out: str | None = None,
                         overwrite: bool = False, status: Progress) -> Outcome:
    """Prune, then fine-tune, a decoder-only language model (module docstring).

    Args:
      src: the loaded model (:class:`lowrank_jax.recipes.Source` of a GPT-2 or Llama-style
        family).
      heads: fraction of the query heads of every key-value group (GPT-2: of every layer)
        to remove, in [0, 1); every group keeps at least one.
      kv_groups: fraction of every layer's key-value groups to remove, in [0, 1) (a
        grouped-query model only); every layer keeps at least one.
      mlp: fraction of all MLP hidden channels to remove, in [0, 1), ranked across layers.
      mlp_equal: remove ``floor(mlp * width)`` channels from every layer instead, so that every
        layer keeps the same width (a physically smaller export when the layers had equal
        widths).
      text: a text file or a directory of text files (default: the standard library's source).
      tokenizer: a ``tokenizer.json`` or a directory with one (default: the model
        directory's).
      seq_len: tokens per window (default: 128, at most the model's longest sequence).
      prune_steps: scoring batches of the head and MLP-channel importance.
      batch_size: windows per scoring, pruning, fine-tuning and evaluation batch.
      finetune_steps, lr, lora: the fine-tuning (AdamW, warmup over 5 % of the steps, cosine
        decay from ``lr``; LoRA updates of rank ``lora`` on the attention and MLP weights
        instead of all weights when ``lora > 0``).
      eval_batches: at most this many batches of held-out windows per perplexity.
      seed: seed of the batches.
      out: save the pruned (and fine-tuned) model there (a lowrank_jax checkpoint that keeps
        the source's Hugging Face files for ``lowrank-jax export``).
      overwrite: replace ``out`` if lowrank-jax wrote it.
      status: progress reporting.

    Returns:
      The report: text and settings, parameters before and after, per-layer kept counts (and
      kept head ids and MLP channel ids, in the original numbering), ``max_abs_diff_masked``,
      ``export`` (:func:`export_form`), ``perplexity`` before / pruned / finetuned; ``values``:
      ``params`` and ``config``.
    """
    import jax

    from lowrank_jax import execution, param_count
    from lowrank_jax.compress import Step, apply_plan
    from lowrank_jax.compress.prune import (
        DEFAULT_RULES,
        add_channel_masks,
        add_lora_to,
        register_batches,
        remove_masked,
    )
    from lowrank_jax.leaves import get_path, weight_shape, with_channel_masks
    from lowrank_jax.models import apply, family_of
    from lowrank_jax.train import default_optimizer, fit, full_params

    cfg, params = src.config, src.params
    fam = family_of(cfg)
    grouped = _kv_heads(params["layers"][0]["attn"]) is not None
    if kv_groups and not grouped:
        raise ConfigError(f"--kv-groups: family {fam.name!r} has no key-value groups (every "
                          "head has its own keys and values); use --heads", where="--kv-groups",
                          expected="a grouped-query model", actual=fam.name)
    if not (heads or kv_groups or mlp):
        raise ConfigError("prune: give what to remove from the language model: --heads, "
                          "--kv-groups and/or --mlp (fractions)", where="--heads",
                          expected="a fraction > 0", actual=0)
    seq = default_seq_len(cfg, seq_len)
    need = (prune_steps + finetune_steps + eval_batches) * batch_size * seq
    with status.phase("reading and tokenizing the text"):
        train, held, text_info = model_text(cfg, src.path, text=text, tokenizer=tokenizer,
                                            seq_len=seq, max_bytes=max(200_000, 8 * need))
    held = held[:eval_batches * batch_size]
    windows = _Windows(train, batch_size, seed)
    register_batches(BATCHES, text_batches(train))
    loss_fn = fam.loss(cfg)
    loss_jit = jax.jit(lambda p, b: loss_fn(p, b, None)[0])

    def perplexity(p, what):
        with status.phase(f"held-out perplexity of {what}"):
            nll = [float(loss_jit(p, {"input_ids": held[i:i + batch_size]}))
                   for i in range(0, len(held), batch_size)]
            sizes = [len(held[i:i + batch_size]) for i in range(0, len(held), batch_size)]
            return float(np.exp(np.average(nll, weights=sizes)))

    settings = {"heads": heads, "kv_groups": kv_groups, "mlp": mlp, "mlp_equal": mlp_equal,
                "prune_steps": prune_steps,
                "batch_size": batch_size,
                "finetune_steps": finetune_steps, "lr": lr, "lora": lora, "seed": seed}
    report = Outcome({"model": src.path, "family": fam.name, "text": text_info,
                      "settings": settings})
    text_lines = report.lines
    ppl = {"before": perplexity(params, "the original model")}
    t0 = time.perf_counter()
    head_pruned = params
    for unit, frac in (("group", kv_groups), ("query", heads)):
        if frac:
            what = "key-value groups" if unit == "group" else "query heads"
            with status.phase(f"removing {frac:.0%} of the {what} of every layer"):
                head_pruned, _ = apply_plan(head_pruned, Step("prune_heads", [r"attn/o$"], {
                    "target": float(frac), "unit": unit, "data": BATCHES,
                    "batch_size": batch_size, "steps": prune_steps, "seed": seed}), config=cfg)
    pruned, masked, removal, struct = head_pruned, head_pruned, None, None
    if mlp:
        with status.phase(f"removing {mlp:.0%} of the MLP channels, ranked across layers by "
                          f"their importance on {prune_steps} batches of {batch_size} windows"):
            scores = mlp_channel_scores(head_pruned, loss_fn, windows.batch, prune_steps)
            keep = select_channels(scores, float(mlp), equal=mlp_equal)
            masked = add_channel_masks(head_pruned, MLP_RULES)
            ones = {}
            for i, k in enumerate(keep):
                hid = k.astype(np.float32)
                for name in ("wi", "wi_0", "wi_1", "wo"):
                    path = f"layers/{i}/mlp/{name}"
                    if name not in head_pruned["layers"][i]["mlp"]:
                        continue
                    d_in, d_out = weight_shape(get_path(head_pruned, path))
                    ones[path] = ((hid, np.ones(d_out, np.float32)) if name == "wo"
                                  else (np.ones(d_in, np.float32), hid))
            masked = with_channel_masks(masked, ones)
            pruned, struct, removal = remove_masked(masked, config=cfg, return_structure=True)
    prune_s = time.perf_counter() - t0
    with status.phase("comparing the masked and the pruned model on a held-out batch"), \
            execution.reference_precision():
        batch = {"input_ids": held[:batch_size]}
        fwd = jax.jit(lambda p: apply(p, batch, cfg)["logits"])
        ref = np.asarray(fwd(pruned))
        diff = float(np.max(np.abs(np.asarray(fwd(masked)) - ref)))
        if head_pruned is not params:  # the original with the removed heads' outputs off
            gated = _gated(params, head_pruned)  # and the MLP masks of the pruning
            gated = {**gated, "layers": [{**lg, "mlp": lm["mlp"]} for lg, lm in zip(
                gated["layers"], masked["layers"], strict=True)]}
            diff = max(diff, float(np.max(np.abs(np.asarray(fwd(gated)) - ref))))
    layers = []
    hidden = {} if removal is None else {b.path: removal.hidden[b.path] for b in struct.mlp}
    for i, (lo, lp) in enumerate(zip(params["layers"], pruned["layers"], strict=True)):
        a0, a1 = lo["attn"], lp["attn"]
        row = {"layer": i, "heads": _head_layout(a1).num_heads,
               "heads_total": _head_layout(a0).num_heads,
               "head_ids": [int(h) for h in _head_layout(a1).ids]}
        if grouped:
            row.update(kv_heads=_kv_heads(a1), kv_heads_total=_kv_heads(a0),
                       kv_head_ids=[int(h) for h in a1["kv_heads"].ids])
        h = hidden.get(f"layers/{i}/mlp")
        total = int(getattr(cfg, "intermediate_size", None) or cfg.d_ff)
        row.update(mlp=total if h is None else int(h.sum()), mlp_total=total,
                   mlp_ids=(list(range(total)) if h is None
                            else [int(c) for c in np.flatnonzero(h)]))
        layers.append(row)
    text_lines.append(f"{'layer':<7}{'q heads':>10}{'kv heads':>10}{'mlp':>12}")
    for r in layers:
        kv = f"{r['kv_heads']}/{r['kv_heads_total']}" if grouped else "-"
        text_lines.append(f"{r['layer']:<7}{r['heads']:>6}/{r['heads_total']:<3}{kv:>10}"
                          f"{r['mlp']:>8}/{r['mlp_total']:<3}")
    p0, p1 = int(param_count(params)), int(param_count(pruned))
    text_lines.append(f"model parameters {p0} -> {p1} ({p1 / p0:.3f}); max |masked - pruned| "
                      f"logit = {diff:.2e}")
    report.update(params_before=p0, params_after=p1, max_abs_diff_masked=diff,
                  prune_seconds=prune_s, layers=layers)
    ppl["pruned"] = perplexity(pruned, "the pruned model")
    final = pruned
    if finetune_steps:
        tuned = (add_lora_to(pruned, DEFAULT_RULES, rank=lora, key=jax.random.PRNGKey(seed + 1))
                 if lora else pruned)
        status.say(f"fine-tuning {'LoRA updates of rank ' + str(lora) if lora else 'all'}"
                   f" weights: {finetune_steps} steps on the next-token loss")
        opt = default_optimizer(learning_rate=lr, total_steps=finetune_steps,
                                warmup_steps=finetune_steps // 20)
        tune_batches = _Windows(train, batch_size, seed + 1)  # not the pruning batches
        state, hist = fit(loss_fn, tuned, tune_batches, steps=finetune_steps,
                          key=jax.random.PRNGKey(seed), batch_fn=lambda b: b, optimizer=opt,
                          progress=status.bars, desc="fine-tune")
        final = full_params(state)
        report["finetune_loss"] = [h["loss"] for h in hist]
        ppl["finetuned"] = perplexity(final, "the fine-tuned model")
    report["perplexity"] = ppl
    text_lines.append("held-out perplexity " + "   ".join(f"{k} {v:.3f}" for k, v in ppl.items())
                      + f"   ({len(held)} windows of {seq} tokens)")
    with status.phase("checking what the Hugging Face export will be"):
        form = export_form(cfg, final)
    report["export"] = form
    sizes = ", ".join(f"{k} {v}" for k, v in form["config"].items())
    if form["physically_smaller"]:
        text_lines.append("lowrank-jax export will write a physically smaller model"
                          + (f" (config: {sizes})" if sizes else ""))
    else:
        text_lines.append("lowrank-jax export will zero-pad these blocks to the config's widths "
                          "(exact, but not smaller there): " + ", ".join(form["zero_padded"])
                          + (f"; smaller elsewhere (config: {sizes})" if sizes else ""))
    if out:
        from lowrank_jax.io import save_model
        from lowrank_jax.recipes import outputs

        meta = {**src.metadata, "prune": settings}
        with status.phase(f"saving to {out}"), outputs.writing_checkpoint(
                out, overwrite=overwrite):
            save_model(out, cfg, final, metadata=meta, overwrite=overwrite,
                       extra_files=src.extra_files())
        text_lines.append(f"saved the pruned model to {out}")
    report.values.update(params=final, config=cfg)
    return report


__all__ = ["BATCHES", "HELD_OUT", "MLP_RULES", "default_seq_len", "export_form",
           "is_language_model", "max_positions", "model_text", "prune_language_model",
           "text_batches", "text_windows", "tokenizer_file"]
