"""Autoregressive decoding: tokens per second with and without the key-value cache, against
PyTorch ``generate`` on the same CPU threads.

The workload is Chronos' forecast: one full context of real data (the first series shipped with
aeon that is long enough, via ``lowrank_jax.datasets.builtin_series``), tokenized by Chronos' mean-scale
tokenizer, then ``num_samples`` sample paths of ``horizon`` tokens (top-k 50, EOS suppressed:
``min_new_tokens = max_new_tokens``), exactly what ``ChronosModel.forward`` asks of
``generate``. The model is a Chronos-T5-small-sized ``T5ForConditionalGeneration`` (d_model
512, 6 + 6 layers, 8 heads, d_ff 2048, vocab 4096; ``--quick``: d_model 256, 4 + 4 layers, 4
heads, d_ff 1024, the Chronos-T5-tiny sizes) with random weights; the JAX model is the same
module through ``load_pretrained``.

Rows, timed in one interleaved loop (median of ``--runs``):

* ``torch generate``: ``model.generate(...)`` under ``inference_mode`` (Hugging Face's own
  key-value cache);
* ``jax cached``: :func:`lowrank_jax.models.chronos.sample_tokens` (encoder once, a key-value
  cache of ``horizon`` positions, one ``jit``-compiled ``fori_loop``);
* ``jax uncached``: the same with ``use_cache=False`` (the decoder re-run on the whole
  ``[n, horizon + 1]`` token buffer at every step: what this library did before the cache);
* ``jax cached, low-rank decoder``: every decoder projection (attention q/k/v/o and MLP)
  truncated to rank ``d_model / 4`` (random weights: a speed row, its samples are not the
  dense model's).

``tokens/s`` counts every generated token of every sample path (``num_samples * horizon`` per
call). Before timing, greedy decoding (``top_k=1``) of the JAX cached path is checked token for
token against ``generate`` (``greedy_equal_hf`` in the JSON): the two decode the same model.

Threads as in ``forward.py``: ``torch.set_num_threads(N)`` and this process pinned to N CPUs
before jax is imported; ``OMP_WAIT_POLICY=PASSIVE``.

Usage::

    python -m benchmarks.models decode --json decode.json   # small sizes, horizon 64, 20 paths
    python -m benchmarks.models decode --quick              # tiny sizes, horizon 32
"""

from __future__ import annotations

import os
import time

from benchmarks import _harness as H
from benchmarks.models import forward as M  # imports no framework at load

SMALL = dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=4096,
             context=512, horizon=64, num_samples=20)
TINY = dict(d_model=256, d_kv=64, d_ff=1024, num_layers=4, num_heads=4, vocab_size=4096,
            context=256, horizon=32, num_samples=20)


def build_hf(c: dict, seed: int):
    """A random ``T5ForConditionalGeneration`` with O(1) logits (HF's own init gives nearly
    uniform ones), in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.T5Config(
        vocab_size=c["vocab_size"], d_model=c["d_model"], d_kv=c["d_kv"], d_ff=c["d_ff"],
        num_layers=c["num_layers"], num_heads=c["num_heads"], feed_forward_proj="relu",
        tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        dropout_rate=0.0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "layer_norm" in n:
                p.fill_(1.0)
            elif n == "shared.weight" or "relative_attention_bias" in n:
                p.normal_(0.0, 1.0)
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


TABLE = H.Table(
    H.Col("decoder", "name", width=36), H.Col("s/call", "median_s", ".3f", 8),
    H.Col("tokens/s", "tokens_per_s", ".0f", 9), H.Col("vs torch", "speedup_vs_torch", ".2f", 9))


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="tiny sizes, horizon 32, 3 runs")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 5; quick 3)")
    p.add_argument("--threads", type=int, default=None, help="default: CPUs available")
    p.add_argument("--num-samples", type=int, default=None, help="sample paths (default 20)")
    p.add_argument("--horizon", type=int, default=None, help="tokens per path")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    c = dict(TINY if args.quick else SMALL)
    if args.num_samples:
        c["num_samples"] = args.num_samples
    if args.horizon:
        c["horizon"] = args.horizon
    runs = args.runs if args.runs is not None else (3 if args.quick else 5)
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads if args.threads is not None else avail
    xla_flags = M._set_threads(threads)

    import jax
    import numpy as np
    import torch

    from lowrank_jax.compress import compress
    from lowrank_jax.convert import load_pretrained
    from lowrank_jax.datasets import builtin_series
    from lowrank_jax.models import chronos

    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    model = build_hf(c, args.seed)
    t5_cfg, params = load_pretrained(model)
    cfg = chronos.ChronosConfig(t5=t5_cfg, n_tokens=c["vocab_size"],
                                context_length=c["context"], prediction_length=c["horizon"],
                                num_samples=c["num_samples"], top_k=50)
    rank = c["d_model"] // 4
    lowrank, _ = compress(params, rules=(r"decoder/.*(attn/(qk/q|qk/k|v|o)|mlp/(wi|wo))$",),
                          rank=rank)
    series, _ = builtin_series()
    long = next(s for s in series if s.size >= c["context"])  # a full context of real data
    context = np.asarray(long[-c["context"]:], np.float32)[None]
    ids, mask, _ = chronos.context_input_transform(cfg, context)
    ids_t, mask_t = torch.tensor(np.asarray(ids)), torch.tensor(np.asarray(mask))
    n, h = c["num_samples"], c["horizon"]
    run = H.Run(__name__, argv, torch=torch.__version__, threads=threads,
                torch_threads=torch.get_num_threads(), config=c, runs=runs, seed=args.seed,
                lowrank_rank=rank, context_tokens=int(ids.shape[1]))
    print(f"# {run.describe()}; torch {torch.__version__}; {threads} threads (XLA_FLAGS "
          f"'{xla_flags}'); config {c}; {ids.shape[1]} context tokens", flush=True)

    def torch_generate(top_k=50):
        with torch.inference_mode():
            out = model.generate(input_ids=ids_t, attention_mask=mask_t, min_new_tokens=h,
                                 max_new_tokens=h, do_sample=True, num_return_sequences=n,
                                 eos_token_id=1, pad_token_id=0, temperature=1.0, top_k=top_k,
                                 top_p=1.0)
        return out[:, 1:].numpy()

    def jax_sample(prm, use_cache=True, top_k=50, key=0):
        return jax.block_until_ready(chronos.sample_tokens(
            prm, ids, mask, cfg, jax.random.PRNGKey(key), horizon=h, num_samples=n,
            temperature=1.0, top_k=top_k, top_p=1.0, use_cache=use_cache))

    # Greedy (top_k=1): the cached JAX path and generate decode the same model.
    t0 = time.perf_counter()
    greedy_jax = np.asarray(jax_sample(params, top_k=1)).reshape(n, h)
    greedy_hf = torch_generate(top_k=1)
    greedy_equal = bool(np.array_equal(greedy_jax, greedy_hf))
    print(f"# greedy tokens equal HF generate: {greedy_equal} ({time.perf_counter() - t0:.0f} s "
          "incl. compile)", flush=True)

    contenders = {
        "torch generate": torch_generate,
        "jax cached": lambda: jax_sample(params),
        "jax uncached": lambda: jax_sample(params, use_cache=False),
        f"jax cached, low-rank decoder r={rank}": lambda: jax_sample(lowrank),
    }
    names = list(contenders)
    t0 = time.perf_counter()
    m = H.measure(contenders, runs=runs, warmup=1)
    loop_s = time.perf_counter() - t0
    load = m.load
    med = {k: m.timings.median(k) for k in names}
    tokens = n * h
    rows = [{"name": k, "median_s": med[k], "times_s": list(m.timings.seconds(k)),
             "tokens": tokens, "tokens_per_s": tokens / med[k],
             "speedup_vs_torch": med["torch generate"] / med[k]} for k in names]
    ld = "n/a" if load is None else f"{100 * load:.0f}%"
    print(f"# {n} paths x {h} tokens per call; median of {runs} interleaved runs (loop "
          f"{loop_s:.0f} s, other processes used {ld} of the CPUs)")
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    cached_vs_torch = med["torch generate"] / med["jax cached"]
    cached_vs_uncached = med["jax uncached"] / med["jax cached"]
    goals = {
        **H.goal("cached decoding vs torch generate (speedup)", cached_vs_torch, target=">= 1",
                 holds=cached_vs_torch >= 1.0, measured=f"{cached_vs_torch:.3g}"),
        **H.goal("cached vs uncached decoding (speedup)", cached_vs_uncached, target="> 1",
                 holds=cached_vs_uncached > 1.0, measured=f"{cached_vs_uncached:.3g}"),
        **H.goal("jax cached tokens/s", tokens / med["jax cached"],
                 measured=f"{tokens / med['jax cached']:.4g}"),
        **H.goal("greedy tokens equal HF generate", greedy_equal, target="True",
                 holds=greedy_equal),
    }
    run.setup.update(loop_other_load=load, loop_s=loop_s,
                     total_s=time.perf_counter() - t_start, greedy_equal_hf=greedy_equal)
    return run.finish(args.json, rows=rows, goals=goals)


if __name__ == "__main__":
    H.run_as_main(__spec__)
