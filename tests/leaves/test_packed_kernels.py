"""The packed-binary products against NumPy: the Pallas kernel (interpret mode on CPU) for
several shapes, including widths that are not multiples of 32 bits and grids of several
programs on every axis; the bit-pattern unpacking ``PackedBinary.linear`` uses on CPU; the
kernel's selection by backend.

The NumPy reference builds the words itself with ``np.packbits`` from a ternary matrix and
multiplies in float64; it shares no code with lowrank_jax."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import execution
from lowrank_jax import leaves as L
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import packed_kernels as K


def np_words(bits: np.ndarray) -> np.ndarray:
    """``bool [d_out, d_in] -> uint32 [d_out, ceil(d_in / 32)]``, input ``32 q + k`` at bit
    ``k`` of word ``q`` (NumPy's packbits, little bit order, read as little-endian words)."""
    d_out, d_in = bits.shape
    w = -(-d_in // 32)
    padded = np.zeros((d_out, 32 * w), bool)
    padded[:, :d_in] = bits
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(np.uint32)


def ternary(seed: int, d_in: int, d_out: int, keep: float = 0.5) -> np.ndarray:
    r = np.random.default_rng(seed)
    t = np.where(r.random((d_in, d_out)) < 0.5, -1, 1) * (r.random((d_in, d_out)) < keep)
    return t.astype(np.int64)  # [d_in, d_out] in {-1, 0, 1}


def check_close(got, x, w):
    """float32 round-off: |got - x @ w| <= 1e-5 (|x| @ |w|) elementwise (x @ w in float64)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = x64 @ w64
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64)) + 1e-30
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) / bound))


@pytest.mark.parametrize("lead,d_in,d_out,blocks", [
    ((5,), 70, 9, dict(block_m=8, block_n=8, block_words=1)),      # 70 = 2 words + 6 bits
    ((2, 19), 100, 45, dict(block_m=16, block_n=16, block_words=2)),  # grid 3 x 3 x 2
    ((33,), 64, 130, dict(block_m=8, block_n=128, block_words=1)),  # exact words, 2 x 128 outs
    ((3,), 33, 1, {}),                                              # default blocks, 1 output
])
def test_kernel_interpret_matches_numpy(lead, d_in, d_out, blocks):
    t = ternary(d_in + d_out, d_in, d_out)
    sign = np_words((t < 0).T)
    mask = np_words((t != 0).T)
    alpha = np.float32(0.37)
    x = np.random.default_rng(1).standard_normal(lead + (d_in,)).astype(np.float32)
    got = K.packed_matmul(jnp.asarray(x), jnp.asarray(sign), jnp.asarray(mask),
                          jnp.float32(alpha), d_in, interpret=True, **blocks)
    assert got.dtype == jnp.float32 and got.shape == lead + (d_out,)
    check_close(np.asarray(got).reshape(-1, d_out), x.reshape(-1, d_in),
                np.float64(alpha) * t)


def test_kernel_through_linear_matches_reference_leaf(monkeypatch):
    """With the kernel switched on, ``linear`` on a packed leaf (bias included, jitted) equals
    the float masked-binary leaf's output to float32 round-off, and the program holds a
    pallas_call; by default on CPU it holds none."""
    r = np.random.default_rng(3)
    mb = L.MaskedBinary(jnp.asarray(r.standard_normal((45, 20)), jnp.float32),
                        jnp.asarray(r.standard_normal((45, 20)), jnp.float32),
                        jnp.asarray(r.standard_normal(20), jnp.float32), keep=0.3)
    pb = L.PackedBinary.from_leaf(mb)
    x = jnp.asarray(r.standard_normal((4, 6, 45)), jnp.float32)
    # The switch is read when a program is traced: fresh lambdas, not jax's cached traces.
    run = jax.jit(lambda p, v: L.linear(p, v))
    assert "pallas_call" not in str(run.trace(pb, x).jaxpr)
    with execution.settings(packed_kernel="on"):  # part of the trace's key: traced again
        assert "pallas_call" in str(run.trace(pb, x).jaxpr)
        got = np.asarray(run(pb, x))
    w = np.asarray(mb.to_dense(), np.float64)  # alpha * sign(w) * M, the reference leaf's
    check_close(got.reshape(-1, 20) - np.asarray(mb.b), np.asarray(x).reshape(-1, 45), w)


def test_unpacked_weight_matches_numpy():
    """The bit-pattern unpacking: kept weights are +-alpha (negative alpha too), pruned ones 0,
    whatever their sign bit holds; d_in not a multiple of 32."""
    t = ternary(7, 77, 13, keep=0.6)
    sign = np_words((t < 0).T)
    mask = np_words((t != 0).T)
    r = np.random.default_rng(8)
    sign_noisy = sign | (np_words((r.random((13, 77)) < 0.5)) & ~mask)  # junk where pruned
    for alpha in (np.float32(0.8125), np.float32(-1.5)):
        w = np.asarray(jax.jit(L.packed_binary.unpacked_weight, static_argnums=3)(
            jnp.asarray(sign_noisy), jnp.asarray(mask), jnp.float32(alpha), 77))
        assert w.dtype == np.float32 and w.shape == (77, 13)
        np.testing.assert_array_equal(w, (np.float64(alpha) * t).astype(np.float32))


def test_permute_inputs_order():
    x = np.arange(3 * 128, dtype=np.float32).reshape(3, 128)
    got = np.asarray(K.permute_inputs(jnp.asarray(x), 2))
    # block b of 64 inputs, column k * 2 + q holds input 64 b + 32 q + k
    ref = np.empty_like(x)
    for b in range(2):
        for q in range(2):
            for k in range(32):
                ref[:, 64 * b + 2 * k + q] = x[:, 64 * b + 32 * q + k]
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(ShapeError):
        K.permute_inputs(jnp.zeros((2, 96)), 2)


def test_auto_never_chooses_the_unverified_kernel_on_gpu(monkeypatch):
    """Under ``auto`` a packed leaf traced on a (pretended) ``gpu`` backend holds no
    pallas_call: the kernel races there (a multi-block grid was 0.67 off on an H200) and no
    backend has been verified."""
    r = np.random.default_rng(4)
    mb = L.MaskedBinary(jnp.asarray(r.standard_normal((70, 40)), jnp.float32),
                        jnp.asarray(r.standard_normal((70, 40)), jnp.float32), keep=0.5)
    pb = L.PackedBinary.from_leaf(mb)
    x = jnp.asarray(r.standard_normal((3, 70)), jnp.float32)
    assert execution.current().packed_kernel == "auto"
    for backend in ("gpu", "cuda", "rocm", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert not K.use_kernel()
        assert "pallas_call" not in str(jax.make_jaxpr(lambda p, v: L.linear(p, v))(pb, x))
    with execution.settings(packed_kernel="on"):  # still available on request
        assert "pallas_call" in str(jax.make_jaxpr(lambda p, v: L.linear(p, v))(pb, x))


def test_selection_by_backend_and_bad_input(monkeypatch):
    assert K.VERIFIED == ()
    for backend in ("cpu", "gpu", "cuda", "rocm", "tpu"):
        assert not K.use_kernel(backend)
    monkeypatch.setattr(K, "VERIFIED", ("gpu",))  # a verified backend: auto uses the kernel
    assert K.use_kernel("gpu") and not K.use_kernel("cpu")
    with execution.settings(packed_kernel="off"):
        assert not K.use_kernel("gpu")
    with execution.settings(packed_kernel="on"):
        assert K.use_kernel("cpu")
    with pytest.raises(ConfigError, match="packed_kernel"):
        execution.Execution(packed_kernel="fast")


def test_environment_sets_the_default_at_import():
    """``LOWRANK_JAX_PACKED_KERNEL`` sets the process's default setting when lowrank_jax is
    imported (a bad value is refused then, naming the variable)."""
    import subprocess
    import sys

    code = "from lowrank_jax import execution; print(execution.current().packed_kernel)"
    for value, want in (("on", "on"), ("OFF", "off"), ("", "auto")):
        env = dict(os.environ, **{K.ENV: value or "auto"})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == want
    bad = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{K.ENV: "fast"}),
                         capture_output=True, text=True)
    assert bad.returncode != 0 and K.ENV in bad.stderr
    words = jnp.zeros((4, 2), jnp.uint32)
    with pytest.raises(ShapeError, match="d_in=40"):
        K.packed_matmul(jnp.zeros((2, 41)), words, words, jnp.float32(1.0), 40, interpret=True)
    with pytest.raises(ShapeError, match="sign_bits"):
        K.packed_matmul(jnp.zeros((2, 70)), words, words, jnp.float32(1.0), 70, interpret=True)
