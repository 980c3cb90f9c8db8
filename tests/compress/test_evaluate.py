"""compare_models and sample_inputs: numbers recomputed here with NumPy and plain Python."""

import types

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import models
from lowrank_jax.compress import compare_models, compress, sample_inputs, top_k_jaccard


@pytest.fixture(scope="module")
def t5_small():
    cfg = models.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=16, num_layers=1,
                          num_heads=2)
    params = models.t5.init(jax.random.PRNGKey(0), cfg)
    small, _ = compress(params, rank=2, keep_dense_if_larger=False)
    return cfg, params, small


def test_sample_inputs_come_from_the_family(t5_small):
    cfg, _, _ = t5_small
    a = sample_inputs(cfg, batch=3, seed=5)
    b = models.family_of(cfg).sample_inputs(cfg, np.random.default_rng(5), 3)
    assert sorted(a) == sorted(b) == ["attention_mask", "decoder_input_ids", "input_ids"]
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
        assert a[k].shape[0] == 3


def _plain_jaccard(a, b, k):
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    out = []
    for x, y in zip(a, b, strict=True):
        sx = set(sorted(range(len(x)), key=lambda i: -x[i])[:k])
        sy = set(sorted(range(len(y)), key=lambda i: -y[i])[:k])
        out.append(len(sx & sy) / len(sx | sy))
    return float(np.mean(out))


def test_compare_models_numbers(t5_small):
    cfg, params, small = t5_small
    inputs = sample_inputs(cfg, batch=2)
    ev = compare_models(cfg, params, small, inputs=inputs, measure_time=False)
    fwd = jax.jit(lambda p, inp: models.apply(p, inp, cfg)["logits"])
    y, ys = (np.asarray(fwd(p, inputs), np.float64) for p in (params, small))
    assert ev["output"] == "logits"
    assert ev["max_abs_error"] == pytest.approx(np.max(np.abs(y - ys)), rel=1e-4, abs=1e-6)
    assert ev["rel_error"] == pytest.approx(np.linalg.norm(y - ys) / np.linalg.norm(y),
                                            rel=1e-4)
    assert ev["rel_error"] > 1e-3  # rank 2 really changed the model
    assert ev["top10_jaccard"] == pytest.approx(_plain_jaccard(y, ys, 10), abs=1e-12)
    assert ev["param_ratio"] == lj.param_count(small) / lj.param_count(params) < 1
    n_tok = 2 * inputs["input_ids"].shape[1]
    assert ev["flop_ratio"] == lj.flops(small, n_tok) / lj.flops(params, n_tok) < 1
    assert "time_ratio" not in ev
    same = compare_models(cfg, params, params, inputs=inputs, measure_time=False)
    assert same["max_abs_error"] == 0.0 and same["top10_jaccard"] == 1.0


def test_top_k_jaccard_plain():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 4, 20)), rng.normal(size=(3, 4, 20))
    assert top_k_jaccard(a, b, 5) == pytest.approx(_plain_jaccard(a, b, 5), abs=1e-12)
    assert top_k_jaccard(a, a, 5) == 1.0


def test_time_ratio_spread_from_paired_runs(t5_small, monkeypatch):
    """The timed forward calls advance a fake clock by known durations (round k: the original
    takes ``orig[k]``, the compressed ``comp[k]`` seconds, whatever order the round runs
    them in): the reported median ratio and quartiles are recomputed here from them."""
    import lowrank_jax.compress.evaluate as evaluate
    import lowrank_jax.timing as timing

    cfg, params, small = t5_small
    inputs = sample_inputs(cfg, batch=2)
    orig = [4.0, 5.0, 3.0, 8.0, 6.0]
    comp = [2.0, 4.0, 3.0, 2.0, 9.0]
    now = [0.0]
    calls = {id(params): [None, *orig], id(small): [None, *comp]}  # first call: the outputs
    real_forward = evaluate._forward

    def forward(p, inp, config):
        step = calls[id(p)].pop(0)
        if step is not None:
            now[0] += step
        return real_forward(p, inp, config)

    monkeypatch.setattr(evaluate, "_forward", forward)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0],
                                                              process_time=lambda: 0.0))
    ev = compare_models(cfg, params, small, inputs=inputs, time_runs=len(orig))
    assert calls == {id(params): [], id(small): []}  # one output call, then one per round
    ratios = sorted(b / a for a, b in zip(orig, comp, strict=True))  # .25 .5 .8 1 1.5
    # the 25th and 75th (linear) percentiles of 5 sorted values: the 2nd and the 4th
    assert ev["time_ratio_quartiles"] == pytest.approx([ratios[1], ratios[3]], abs=1e-12)
    assert ev["time_ratio"] == pytest.approx(3.0 / 5.0, abs=1e-12)  # median / median
    assert ev["time_ms"] == pytest.approx({"original": 5e3, "compressed": 3e3})
    assert ev["time_runs"] == len(orig)
