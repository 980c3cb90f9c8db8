"""Checks that mean something only on a GPU or TPU (marked ``accelerator``: skipped, with the
reason, when JAX's backend is the CPU). On a GPU machine, from the repository root::

    JAX_PLATFORMS=cuda PYTHONPATH=. python -m pytest -m accelerator tests -q -p no:cacheprovider

(the packed kernel compiled for the device against NumPy is in
``tests/leaves/test_packed_kernels.py``). Every reference here is NumPy in float64.

* float32 matmuls at ``highest`` precision are float32-exact on the device (1e-5 of
  ``|x| @ |w|``), and the default precision stays within TF32 round-off (NVIDIA GPUs multiply
  float32 as TF32 by default, 10-bit significands: the reason conversion-parity figures hold
  on CPU or at ``highest`` only);
* a Chronos-Bolt forward in bf16 (:func:`lowrank_jax.nn.precision.bf16_forward`) is within
  bf16 round-off of the float32 forward at ``highest``, dense and compressed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt
from lowrank_jax.nn.precision import bf16_forward

pytestmark = pytest.mark.accelerator


def relative_to_magnitude(got, x, w) -> float:
    """``max |got - x @ w| / (|x| @ |w|)`` elementwise, in float64."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - x64 @ w64)
                        / (np.abs(x64) @ np.abs(w64) + 1e-30)))


def test_float32_highest_is_exact_and_default_within_tf32():
    r = np.random.default_rng(0)
    x = r.standard_normal((256, 1024)).astype(np.float32)
    w = r.standard_normal((1024, 384)).astype(np.float32)
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    highest = jax.jit(lambda a, b: jnp.matmul(a, b, precision="highest"))(xj, wj)
    with jax.default_matmul_precision("default"):
        default = jax.jit(lambda a, b: jnp.matmul(a, b))(xj, wj)
    assert relative_to_magnitude(highest, x, w) <= 1e-5
    # TF32 rounds each operand to a 10-bit significand: at most 2 * 2^-11 relative per
    # product, summed in float32.
    assert relative_to_magnitude(default, x, w) <= 2.0 ** -10


@pytest.mark.parametrize("compressed", [False, True])
def test_chronos_bolt_bf16_error_on_the_device(compressed):
    cfg = ChronosBoltConfig(t5=T5Config(vocab_size=2, d_model=128, d_kv=32, d_ff=256,
                                        num_layers=2, num_decoder_layers=2, num_heads=4),
                            context_length=256, prediction_length=16, input_patch_size=16,
                            input_patch_stride=16, use_reg_token=True)
    params = chronos_bolt.init(jax.random.PRNGKey(0), cfg)
    if compressed:
        plan = lj.Plan((lj.Step("svd", (r"attn/(qk/q|qk/k|v|o)$",), {"rank": 16}),))
        params, _ = lj.apply_plan(params, plan, config=cfg, key=jax.random.PRNGKey(1))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 256)).cumsum(1), jnp.float32)

    def fwd(p, c):
        return chronos_bolt.forecast(p, c, cfg)

    with jax.default_matmul_precision("highest"):
        y32 = np.asarray(jax.jit(fwd)(params, x), np.float64)
    y16 = np.asarray(jax.jit(bf16_forward(fwd))(params, x), np.float64)
    rel = np.max(np.abs(y16 - y32)) / np.max(np.abs(y32))
    assert 1e-5 < rel < 1e-2, rel  # bf16 has an 8-bit significand: 2^-9 = 2e-3 per rounding
