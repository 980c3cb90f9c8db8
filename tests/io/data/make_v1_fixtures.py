"""Write the format version 1 fixtures of tests/io: two tiny compressed models saved by
lowrank_jax 0.1.0, and their outputs on fixed inputs.

This script needs the 0.1.0 release code (format version 1) on ``PYTHONPATH``, not the current
package::

    git worktree add /tmp/lowrank_jax-0.1.0 984970a      # the last 0.1.0 commit
    cd /tmp/lowrank_jax-0.1.0 && PYTHONPATH=$PWD python3 \
        /path/to/repo/tests/io/data/make_v1_fixtures.py /path/to/repo/tests/io/data/v1

It writes ``OUT/t5`` and ``OUT/vit`` (``save_model`` checkpoints) and ``OUT/t5.npz`` /
``OUT/vit.npz`` (``in_*``: the inputs, ``out_*``: the 0.1.0 model's outputs). The models are
compressed as a user of 0.1.0 would: attention weights replaced by truncated SVDs (``LowRank``),
per-head truncated SVDs with irregular ranks (``HeadLowRank``) and Biprop leaves
(``MaskedBinary``).
"""

import os
import sys

import jax
import numpy as np

import lowrank_jax as lj
from lowrank_jax import io as lio
from lowrank_jax.compress import head_truncated_svd, truncated_svd
from lowrank_jax.models import registry, t5, vit


def _t5(key):
    cfg = t5.T5Config(vocab_size=24, d_model=8, d_kv=4, d_ff=12, num_layers=1, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    params = t5.init(key, cfg)
    enc = params["encoder"]["layers"][0]["attn"]
    enc["q"] = truncated_svd(enc["q"].w, rank=3)
    enc["k"] = head_truncated_svd(enc["k"].w, 2, eps=0.6)  # irregular per-head ranks
    dec = params["decoder"]["layers"][0]
    dec["self_attn"]["v"] = lj.init_masked_binary(jax.random.fold_in(key, 1), 8, 8, 0.5)
    dec["cross_attn"]["o"] = truncated_svd(dec["cross_attn"]["o"].w, rank=2)
    rng = np.random.default_rng(0)
    inputs = {"input_ids": rng.integers(2, 24, (2, 5)).astype(np.int32),
              "attention_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32),
              "decoder_input_ids": rng.integers(2, 24, (2, 3)).astype(np.int32)}
    return cfg, params, inputs


def _vit(key):
    cfg = vit.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8,
                        num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
                        num_labels=3)
    params = vit.init(key, cfg)
    attn = params["encoder"]["layers"][0]["attn"]
    attn["q"] = lj.LowRank(u=truncated_svd(attn["q"].w, rank=3).u,
                           v=truncated_svd(attn["q"].w, rank=3).v, b=attn["q"].b)
    hl = head_truncated_svd(attn["v"].w, 2, eps=0.5)
    attn["v"] = lj.HeadLowRank(u=hl.u, v=hl.v, b=attn["v"].b, ranks=hl.ranks)
    params["encoder"]["layers"][0]["mlp"]["wi"] = lj.init_masked_binary(
        jax.random.fold_in(key, 2), 8, 12, 0.4, bias=True)
    rng = np.random.default_rng(1)
    inputs = {"pixel_values": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}
    return cfg, params, inputs


def main(out: str) -> None:
    assert lio.VERSION == 1, "run this with the lowrank_jax 0.1.0 release on PYTHONPATH"
    os.makedirs(out, exist_ok=True)
    for name, make in (("t5", _t5), ("vit", _vit)):
        cfg, params, inputs = make(jax.random.PRNGKey(0))
        outputs = registry.apply(cfg, params, **inputs)
        lio.save_model(os.path.join(out, name), cfg, params, overwrite=True)
        np.savez(os.path.join(out, f"{name}.npz"),
                 **{f"in_{k}": np.asarray(v) for k, v in inputs.items()},
                 **{f"out_{k}": np.asarray(v) for k, v in outputs.items()})
        kinds = sorted({type(leaf).__name__ for _, leaf in lj.named_leaves(params)})
        print(f"{name}: {lj.param_count(params)} parameters, leaf types {kinds}, "
              f"outputs {sorted(outputs)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "v1"))
