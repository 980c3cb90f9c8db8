"""Compressing a small Llama-style language model pretrained on the Python standard library's
source: truncated SVD, compressed-by-design pretraining (flow-of-ranks and uniform rank) and
structured pruning with fine-tuning, at one attention parameter budget, by held-out perplexity
over several pretraining seeds.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility" claims that attention pretrained low-rank from the start with ranks growing
with depth (flow-of-ranks) beats a uniform rank and truncating a trained dense model at the
same budget; "Less is More" (arXiv:2505.23195) that pruning then fine-tuning keeps quality.
This study tests those claims on language, offline.

Data: the standard library's ``.py`` files (:func:`lowrank_jax.text.stdlib_corpus`, ``test``
packages left out, 10 % of the files held out by a hash of their path; the Python version and
the file-list hash are recorded), a byte-level BPE trained on the training files
(:func:`lowrank_jax.text.train_bpe`), non-overlapping windows of the token stream.

Model: Llama-style (RMSNorm, rotary embeddings, SwiGLU), d_model 128, 4 layers, 4 heads of
width 32 (one key-value head per query head, so removing a head removes its q, k, v and o
columns), d_ff 344, vocabulary 4096, windows of 128 tokens (``--quick``: d_model 64, 2 layers,
vocabulary 1024, windows of 64, fewer steps).

Methods, every one at the same attention budget (``--budget``, default half of the dense
attention's q/k/v/o parameters; MLPs and embeddings untouched and dense everywhere):

* ``dense``: the pretrained dense model (the reference, full attention);
* ``svd uniform``: truncated SVD of the pretrained dense model's attention weights at the
  uniform rank that meets the budget (no training after);
* ``pretrained uniform rank``: attention factorized from initialization at that rank
  (``factorize``), pretrained with the dense model's steps and data;
* ``pretrained flow-of-ranks``: factorized from initialization with ranks ``d0 (1 + i)`` over
  layers ``i``, ``d0`` chosen so that the attention parameters are at most the budget;
* ``prune heads + fine-tune``: the dense model's heads pruned by their importance
  (``prune_heads``) to the budget, then fine-tuned for ``--finetune-steps`` steps.

Every seed sets the initialization, the batch order and the factor draws (the corpus, the
tokenizer and the held-out windows are the same). Reported per method: attention parameters,
total parameters, held-out perplexity mean +- sample standard deviation over the seeds, and
per seed.

Usage::

    python -m benchmarks.methods lm_study --json lm_study.json     # about 45 min on 2 cores
    python -m benchmarks.methods lm_study --quick                  # under 5 min
"""

from __future__ import annotations

import math
import time

import numpy as np

from benchmarks import _harness as H

FULL = dict(d_model=128, layers=4, heads=4, d_ff=344, vocab=4096, seq=128, batch=8,
            steps=300, finetune=60, lr=3e-3, corpus_bytes=3_000_000, eval_windows=128)
QUICK = dict(d_model=64, layers=2, heads=4, d_ff=172, vocab=1024, seq=64, batch=8, steps=150,
             finetune=30, lr=5e-3, corpus_bytes=400_000, eval_windows=48)
ATTN = r"attn/(qk/q|qk/k|v|o)$"

TABLE = H.Table(
    H.Col("method", "method", width=30), H.Col("attn params", "attention_params", "d", 12),
    H.Col("params", "params", "d", 9), H.Col("ppl mean", "ppl_mean", ".2f", 9),
    H.Col("ppl std", "ppl_std", ".2f", 8))


def attention_params(params) -> int:
    from lowrank_jax.compress import select
    from lowrank_jax.leaves import param_count

    return int(sum(param_count(s.node) for s in select(params, (ATTN,))))


def corpus_windows(c: dict):
    """The standard library's source as token windows of ``c["seq"] + 1`` tokens: a byte-level
    BPE of ``c["vocab"]`` tokens trained on ``c["corpus_bytes"]`` of the training files, the
    training windows, and the first ``c["eval_windows"]`` windows of a fifth as many bytes of
    the held-out files. Returns ``(corpus, train, held)``."""
    from lowrank_jax.text import encode_texts, stdlib_corpus, token_windows, train_bpe

    corpus = stdlib_corpus()
    texts = corpus.read("train", max_bytes=c["corpus_bytes"])
    tok = train_bpe(texts, c["vocab"])
    train = token_windows(encode_texts(tok, texts), c["seq"] + 1)
    held = token_windows(encode_texts(tok, corpus.read("held_out", max_bytes=c["corpus_bytes"]
                                                        // 5)), c["seq"] + 1)
    return corpus, train, held[:c["eval_windows"]]


def window_batches(train: np.ndarray, batch: int, seed: int):
    """``get(j)``: batch ``j`` of ``batch`` training windows drawn with replacement by
    ``np.random.default_rng([seed, j])``, as ``{"input_ids": ...}``."""
    import jax.numpy as jnp

    def get(j):
        rng = np.random.default_rng([seed, j])
        return {"input_ids": jnp.asarray(train[rng.integers(0, len(train), batch)])}
    return get


def fit(loss_fn, params, train: np.ndarray, *, steps: int, seed: int, lr: float, batch: int):
    """``steps`` steps of AdamW (weight decay 0.01; learning rate warmed up linearly over the
    first twentieth of the steps to ``lr``, then cosine-decayed to 0) on batches of
    :func:`window_batches` with seed ``seed + 1000``; ``loss_fn(params, batch, key)`` a family's
    loss. Returns the trained parameters."""
    import jax
    import optax

    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps),
                      weight_decay=0.01)
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(lambda q: loss_fn(q, batch, None)[0])(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    get = window_batches(train, batch, seed + 1000)
    for j in range(steps):
        params, state, _ = step(params, state, get(j))
    return params


def perplexity_fn(loss_fn, held: np.ndarray, chunk: int = 16):
    """``perplexity(params)``: ``exp`` of the mean over chunks of ``chunk`` held-out windows of
    each chunk's mean token loss (one compiled evaluation shared by every call; a shorter last
    chunk counts as one chunk)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def eval_nll(params, ids):
        return loss_fn(params, {"input_ids": ids}, None)[0]

    def perplexity(params) -> float:
        chunks = [float(eval_nll(params, jnp.asarray(held[i:i + chunk])))
                  for i in range(0, len(held), chunk)]
        return math.exp(float(np.mean(chunks)))
    return perplexity


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="d_model 64, 2 layers, vocabulary 1024, 150 steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget", type=float, default=0.5,
                   help="attention parameters kept, as a fraction of the dense attention's")
    p.add_argument("--steps", type=int, default=None, help="pretraining steps")
    args = p.parse_args(argv)
    c = dict(QUICK if args.quick else FULL)
    if args.steps:
        c["steps"] = args.steps

    import jax

    from lowrank_jax.compress import Step, apply_plan, factorize_init
    from lowrank_jax.compress.prune import register_batches
    from lowrank_jax.leaves import param_count
    from lowrank_jax.models import LlamaConfig, llama
    t_start = time.perf_counter()
    corpus, train, held = corpus_windows(c)
    cfg = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["d_model"],
                      intermediate_size=c["d_ff"], num_hidden_layers=c["layers"],
                      num_attention_heads=c["heads"], num_key_value_heads=c["heads"],
                      max_position_embeddings=c["seq"] + 1, tie_word_embeddings=True)
    run = H.Run(__name__, argv, config=c, seeds=args.seeds, budget=args.budget,
                corpus=corpus.info(), train_tokens=int(train.size),
                held_out_tokens=int(held.size))
    print(f"# {run.describe()}; corpus {corpus.info()}; {train.shape[0]} training and "
          f"{held.shape[0]} held-out windows of {c['seq'] + 1} tokens", flush=True)

    loss_fn = llama.loss(cfg)

    register_batches("lm_study", lambda config, *, batch_size, seed: window_batches(
        train, c["batch"], seed))

    def train_for(params, steps, seed, lr):
        return fit(loss_fn, params, train, steps=steps, seed=seed, lr=lr, batch=c["batch"])

    perplexity = perplexity_fn(loss_fn, held)

    d = c["d_model"]
    dense_attn = 4 * d * d
    budget_attn = args.budget * c["layers"] * dense_attn
    r_uniform = int(budget_attn // (c["layers"] * 4 * 2 * d))  # r (d + d) per matrix
    # flow-of-ranks r_i = d0 (1 + i): the largest d0 whose total stays within the budget
    scale = budget_attn / (4 * 2 * d)
    d0 = scale / sum(1 + i for i in range(c["layers"]))
    flow = [max(1, int(d0 * (1 + i))) for i in range(c["layers"])]
    prune_target = 1.0 - args.budget
    per_seed: dict[str, list[float]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for seed in args.seeds:
        t0 = time.perf_counter()
        init = llama.init(jax.random.PRNGKey(seed), cfg)
        dense = train_for(init, c["steps"], seed, c["lr"])
        results = {"dense": dense}
        results[f"svd uniform r={r_uniform}"] = apply_plan(
            dense, Step("svd", [ATTN], {"rank": r_uniform}))[0]
        fac_u, _ = factorize_init(init, key=jax.random.PRNGKey(seed + 7), rules=(ATTN,),
                                  rank=r_uniform)
        results[f"pretrained uniform rank r={r_uniform}"] = train_for(fac_u, c["steps"], seed,
                                                                      c["lr"])
        fac_f, _ = factorize_init(init, key=jax.random.PRNGKey(seed + 7), rules=(ATTN,),
                                  schedule=flow)
        results[f"pretrained flow-of-ranks {flow}"] = train_for(fac_f, c["steps"], seed,
                                                                c["lr"])
        pruned, _ = apply_plan(dense, Step("prune_heads", [r"attn/o$"], {
            "target": prune_target, "unit": "group", "data": "lm_study", "batch_size": 8,
            "steps": 4, "seed": seed}), config=cfg)
        results["prune heads + fine-tune"] = train_for(pruned, c["finetune"], seed + 500,
                                                       c["lr"] / 3)
        line = []
        for name, prm in results.items():
            ppl = perplexity(prm)
            per_seed.setdefault(name, []).append(ppl)
            sizes[name] = (attention_params(prm), int(param_count(prm)))
            line.append(f"{name} {ppl:.2f}")
        print(f"# seed {seed} ({time.perf_counter() - t0:.0f} s): " + "; ".join(line),
              flush=True)

    rows = []
    for name, vals in per_seed.items():
        a = np.asarray(vals)
        rows.append({"method": name, "attention_params": sizes[name][0],
                     "params": sizes[name][1], "ppl_mean": float(a.mean()),
                     "ppl_std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
                     "ppl_per_seed": [float(v) for v in vals]})
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    by = {r["method"].split(" r=")[0].split(" [")[0]: r for r in rows}
    flow_row = next(r for r in rows if r["method"].startswith("pretrained flow-of-ranks"))
    uni_row = next(r for r in rows if r["method"].startswith("pretrained uniform"))
    svd_row = next(r for r in rows if r["method"].startswith("svd uniform"))
    wins = sum(f < u for f, u in zip(flow_row["ppl_per_seed"], uni_row["ppl_per_seed"],
                                     strict=True))
    goals = {
        **H.goal("flow-of-ranks vs uniform rank, pretrained (ppl ratio)",
                 flow_row["ppl_mean"] / uni_row["ppl_mean"],
                 measured=f"{flow_row['ppl_mean']:.2f} vs {uni_row['ppl_mean']:.2f}; flow "
                          f"better in {wins} of {len(args.seeds)} seeds"),
        **H.goal("pretrained uniform rank vs truncated SVD (ppl ratio)",
                 uni_row["ppl_mean"] / svd_row["ppl_mean"],
                 measured=f"{uni_row['ppl_mean']:.2f} vs {svd_row['ppl_mean']:.2f}"),
        **H.goal("prune + fine-tune vs dense (ppl ratio)",
                 by["prune heads + fine-tune"]["ppl_mean"] / by["dense"]["ppl_mean"],
                 measured=f"{by['prune heads + fine-tune']['ppl_mean']:.2f} vs "
                          f"{by['dense']['ppl_mean']:.2f}"),
    }
    run.setup.update(total_s=time.perf_counter() - t_start, flow_schedule=flow,
                     uniform_rank=r_uniform, budget_attention_params=int(budget_attn))
    return run.finish(args.json, rows=rows, goals=goals)


if __name__ == "__main__":
    H.run_as_main(__spec__)
