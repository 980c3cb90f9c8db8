"""Decoder-only language model decoding: tokens per second of cached greedy generation against
Hugging Face ``generate`` on the same CPU threads, and the key-value cache's bytes per token.

The model is a random Llama-style ``LlamaForCausalLM`` (6 layers, d_model 512, 8 query heads
over 4 key-value heads of width 64, d_ff 1376, vocabulary 4096; ``--quick``: 4 layers,
d_model 256, 4 over 2 heads), loaded into lowrank_jax with ``load_pretrained``. Prompts of 32
tokens (left-padded to differing lengths in a batch), 64 new tokens (``--quick``: 24), batch 1
and 16 (``--quick``: 1 and 4).

Rows per batch, timed in one interleaved loop (median of ``--runs``):

* ``torch generate``: ``model.generate(do_sample=False)`` under ``inference_mode`` (Hugging
  Face's own key-value cache);
* ``jax cached``: :func:`lowrank_jax.models.generate` (prefill and every step in one compiled
  program);
* ``jax cached, low-rank v r=R``: the value projections truncated to rank ``d_model / 8``,
  full cache;
* ``jax factored cache, low-rank v r=R``: the same model with the factored cache (values kept
  as ``x U_v``; rotary keys stay full), which decodes the same tokens.

Before timing, greedy tokens of ``jax cached`` are compared with ``generate``'s
(``greedy_equal_hf``) and those of the factored cache with the full cache's. The cache's bytes
per token (all layers, float32) are reported for the full and the factored cache.

Threads: ``--threads`` (default 2): this process pinned to that many CPUs before jax is
imported, ``torch.set_num_threads`` the same, ``OMP_WAIT_POLICY=PASSIVE``.

Where the time goes, and what was tried for it (docs/design/language_models.md, "Where a
decoding step's time goes"): the grouped cache is laid out ``[batch, kv heads, len, w]`` so
that no step copies it, and the prefill computes the last token's logits only; the rest is
mostly the weight products, within 15-19 % of a scan doing those products alone. Tried without
a measurable gain: fused q/k/v and gate/up products, keys stored transposed, an optimization
barrier after the cache write, other XLA:CPU matrix libraries; slower: attention as multiply
and sum, block-diagonal keys.

Usage::

    python -m benchmarks.models decode_lm --json decode_lm.json
    python -m benchmarks.models decode_lm --quick
"""

from __future__ import annotations

import time

from benchmarks import _harness as H
from benchmarks.models import forward as M  # imports no framework at load

FULL = dict(d_model=512, layers=6, heads=8, kv_heads=4, d_ff=1376, vocab=4096, prompt=32,
            new=64, batches=(1, 16))
QUICK = dict(d_model=256, layers=4, heads=4, kv_heads=2, d_ff=688, vocab=4096, prompt=32,
             new=24, batches=(1, 4))

TABLE = H.Table(
    H.Col("decoder", "name", width=44), H.Col("batch", "batch", "d", 6),
    H.Col("s/call", "median_s", ".3f", 8), H.Col("tokens/s", "tokens_per_s", ".0f", 9),
    H.Col("vs torch", "speedup_vs_torch", ".2f", 9))


def build_hf(c: dict, seed: int):
    """A random ``LlamaForCausalLM`` with O(1) logits (weights ``N(0, 1/d_in)``), eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["d_model"], intermediate_size=c["d_ff"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], max_position_embeddings=256, pad_token_id=0,
        bos_token_id=None, eos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
            elif n.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="4 layers, d_model 256, 24 new tokens, batches 1 and 4")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 5; quick 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    c = dict(QUICK if args.quick else FULL)
    runs = args.runs if args.runs is not None else (2 if args.quick else 5)
    xla_flags = M._set_threads(args.threads)

    import tempfile

    import numpy as np
    import torch

    from lowrank_jax.compress import Step, apply_plan
    from lowrank_jax.convert import load_pretrained
    from lowrank_jax.models import generate, llama
    from lowrank_jax.nn.attention.factored_cache import cache_bytes_per_token

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    model = build_hf(c, args.seed)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        cfg, params = load_pretrained(d)
    rank = c["d_model"] // 8
    lowrank, _ = apply_plan(params, Step("svd", [r"attn/v$"], {"rank": rank}))
    run = H.Run(__name__, argv, torch=torch.__version__, threads=args.threads,
                torch_threads=torch.get_num_threads(), config=c, runs=runs, seed=args.seed,
                value_rank=rank)
    print(f"# {run.describe()}; torch {torch.__version__}; {args.threads} threads (XLA_FLAGS "
          f"'{xla_flags}'); config {c}", flush=True)

    full_cache = llama.init_cache(lowrank, cfg, batch=1, max_len=8)
    fact_cache = llama.init_cache(lowrank, cfg, batch=1, max_len=8, factored=True)
    bytes_full = sum(cache_bytes_per_token(x, 8) for x in full_cache["layers"])
    bytes_fact = sum(cache_bytes_per_token(x, 8) for x in fact_cache["layers"])
    print(f"# cache bytes per token (all layers, float32): full {bytes_full}, factored "
          f"(values rank {rank}) {bytes_fact} ({bytes_fact / bytes_full:.3f} of full)")

    rows, goals, checks = [], {}, {}
    new = c["new"]
    for batch in c["batches"]:
        rng = np.random.default_rng([args.seed, batch])
        ids = rng.integers(1, c["vocab"], (batch, c["prompt"]))
        mask = np.ones_like(ids)
        for b in range(1, batch):  # differing prompt lengths, left-padded
            mask[b, :b % 8] = 0
        ids[mask == 0] = 0
        ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)

        def torch_generate(ids=ids, ids_t=ids_t, mask_t=mask_t):
            with torch.inference_mode():
                out = model.generate(input_ids=ids_t, attention_mask=mask_t, do_sample=False,
                                     max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
            return out[:, ids.shape[1]:].numpy()

        def jax_gen(prm, factored=False, ids=ids, mask=mask):
            return generate(prm, cfg, ids, mask, max_new_tokens=new, factored_cache=factored)

        t0 = time.perf_counter()
        hf_tokens, jax_tokens = torch_generate(), jax_gen(params)
        equal = bool(np.array_equal(hf_tokens, jax_tokens))
        same = bool(np.array_equal(jax_gen(lowrank), jax_gen(lowrank, True)))
        checks[batch] = {"greedy_equal_hf": equal, "factored_equals_full": same,
                         "tokens_equal_fraction": float(np.mean(hf_tokens == jax_tokens))}
        print(f"# batch {batch}: greedy equal HF generate {equal}, factored cache tokens equal "
              f"full cache {same} ({time.perf_counter() - t0:.0f} s incl. compile)", flush=True)
        contenders = {
            "torch generate": torch_generate,
            "jax cached": lambda: jax_gen(params),
            f"jax cached, low-rank v r={rank}": lambda: jax_gen(lowrank),
            f"jax factored cache, low-rank v r={rank}": lambda: jax_gen(lowrank, True),
        }
        m = H.measure(contenders, runs=runs, warmup=1)
        med = {k: m.timings.median(k) for k in contenders}
        tokens = batch * new
        for k in contenders:
            rows.append({"name": k, "batch": batch, "median_s": med[k],
                         "times_s": list(m.timings.seconds(k)), "tokens": tokens,
                         "tokens_per_s": tokens / med[k],
                         "speedup_vs_torch": med["torch generate"] / med[k]})
        speed = med["torch generate"] / med["jax cached"]
        goals.update(H.goal(f"cached decoding vs torch generate, batch {batch} (speedup)",
                            speed, target=">= 2", holds=speed >= 2.0, measured=f"{speed:.3g}"))
        goals.update(H.goal(f"greedy tokens equal HF generate, batch {batch}", equal,
                            target="True", holds=equal))
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    goals.update(H.goal("factored cache bytes per token / full", bytes_fact / bytes_full,
                        measured=f"{bytes_fact} / {bytes_full} bytes"))
    run.setup.update(total_s=time.perf_counter() - t_start, checks=checks,
                     cache_bytes_per_token={"full": bytes_full, "factored": bytes_fact})
    return run.finish(args.json, rows=rows, goals=goals)


if __name__ == "__main__":
    H.run_as_main(__spec__)
