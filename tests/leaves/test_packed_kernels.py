"""The packed-binary products against NumPy: the Pallas kernel (interpret mode on CPU) for
several shapes and both dtypes, including widths that are not multiples of 32 bits and grids
of several programs on every axis; the bit-pattern unpacking ``PackedBinary.linear`` uses on CPU; the
kernel's selection by backend.

The GPU structure (reduction looped inside each program) and the TPU structure (reduction on
an ``arbitrary`` grid axis) both run in Pallas' interpreter here; ``accelerator`` tests run the
kernel compiled for the running GPU / TPU.

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


def check_close(got, x, w, rel=1e-5):
    """Round-off: |got - x @ w| <= rel (|x| @ |w|) elementwise (x @ w in float64)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = x64 @ w64
    bound = rel * (np.abs(x64) @ np.abs(w64)) + 1e-30
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) / bound))


def bf16_round(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bf16 (round to nearest even) and back to float64, by ml_dtypes."""
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


# Shapes with grids of several programs on every axis and sizes that are not multiples of the
# blocks or of 32 bits (zero padding), for both structures: "cpu" is the GPU kernel (reduction
# looped inside each program), "tpu" the TPU kernel (reduction on an "arbitrary" grid axis),
# both run by Pallas' interpreter.
CASES = [
    ("cpu", (5,), 70, 9, dict(block_m=16, block_n=16, block_words=1)),      # 2 words + 6 bits
    ("cpu", (2, 19), 100, 45, dict(block_m=16, block_n=16, block_words=2)),  # grid 3 x 3, 2 steps
    ("cpu", (64,), 1000, 300, dict(block_m=16, block_n=128, block_words=4)),  # the H200's case
    ("cpu", (33,), 64, 130, dict(block_m=16, block_n=128, block_words=1)),  # exact words
    ("cpu", (3,), 33, 1, {}),                                                # default blocks
    ("tpu", (70,), 1000, 300, dict(block_m=16)),  # grid 5 x 3 x 4: 128 outputs, 8 words a block
    ("tpu", (3,), 77, 33, {}),                    # one block on every axis
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("plat,lead,d_in,d_out,blocks", CASES)
def test_kernel_interpret_matches_numpy(plat, lead, d_in, d_out, blocks, dtype):
    """float32: to float32 round-off of the exact product. bf16: the kernel multiplies the
    bf16-rounded inputs exactly (weights are -1, 0, +1) and sums in float32, so it equals the
    product of the rounded inputs to float32 round-off, and the unrounded product to bf16
    round-off (2^-8 relative)."""
    t = ternary(d_in + d_out, d_in, d_out)
    sign = np_words((t < 0).T)
    mask = np_words((t != 0).T)
    alpha = np.float32(0.37)
    x = np.random.default_rng(1).standard_normal(lead + (d_in,)).astype(np.float32)
    got = K.packed_matmul(jnp.asarray(x, dtype), jnp.asarray(sign), jnp.asarray(mask),
                          jnp.float32(alpha), d_in, platform=plat, interpret=True, **blocks)
    assert got.dtype == jnp.float32 and got.shape == lead + (d_out,)
    got = np.asarray(got).reshape(-1, d_out)
    w = np.float64(alpha) * t
    if dtype == "float32":
        check_close(got, x.reshape(-1, d_in), w)
    else:
        check_close(got, bf16_round(x).reshape(-1, d_in), w)
        check_close(got, x.reshape(-1, d_in), w, rel=2.0 ** -8)


@pytest.mark.parametrize("plat", ["cpu", "cuda", "tpu"])
def test_kernel_size_does_not_grow_with_the_block(plat):
    """One product per reduction step whatever the block: the kernel's jaxpr holds a single
    ``dot_general`` (the previous kernel unrolled 32 per block), and the same number of
    equations at 1 and 32 words per block (what the compiler sees does not grow)."""
    x = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 128), jnp.uint32)
    a = jax.ShapeDtypeStruct((), jnp.float32)

    def kernel_eqns(bw):
        jaxpr = jax.make_jaxpr(lambda *v: K.packed_matmul(
            *v, 4096, block_words=bw, platform=plat, interpret=False))(x, w, w, a)
        (call,) = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
        inner = list(_all_eqns(call.params["jaxpr"]))
        return call, inner, [e for e in inner if e.primitive.name == "dot_general"]

    (call, n8, dots8), (_, n32, dots32) = kernel_eqns(8), kernel_eqns(32)
    assert len(dots8) == len(dots32) == 1 and len(n8) == len(n32)
    # Who owns an output block: on GPU (and the CPU interpreter of its kernel) a 2-D grid, one
    # program per output block; on TPU a 3-D grid whose reduction axis is declared sequential.
    grid = call.params["grid_mapping"].grid
    params = call.params["compiler_params"]
    if plat == "tpu":
        assert len(grid) == 3 and params.dimension_semantics == ("parallel", "parallel",
                                                                 "arbitrary")
    else:
        assert len(grid) == 2
        assert (type(params).__module__.endswith("triton.core") if plat == "cuda"
                else params is None)


def _all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and e.primitive.name != "pallas_call":
                    yield from _all_eqns(inner)


@pytest.mark.accelerator
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lead,d_in,d_out", [((64,), 1000, 300), ((2, 19), 100, 45),
                                             ((5,), 77, 33), ((300,), 2080, 520)])
def test_kernel_on_the_device_matches_numpy(lead, d_in, d_out, dtype):
    """The kernel compiled for the running GPU / TPU (not interpreted) against NumPy: the
    check a row of ``VERIFIED`` records. Blocks small enough for grids of several programs on
    every axis at these sizes."""
    plat = K.platform()
    blocks = dict(block_m=16, block_n=128 if plat == "tpu" else 32,
                  block_words=8 if plat == "tpu" else 2)
    t = ternary(d_in + d_out, d_in, d_out)
    sign, mask = np_words((t < 0).T), np_words((t != 0).T)
    x = np.random.default_rng(1).standard_normal(lead + (d_in,)).astype(np.float32)
    for kw in (blocks, {}):
        got = K.packed_matmul(jnp.asarray(x, dtype), jnp.asarray(sign), jnp.asarray(mask),
                              jnp.float32(0.37), d_in, interpret=False, **kw)
        got = np.asarray(got).reshape(-1, d_out)
        w = 0.37 * t
        if dtype == "float32":
            check_close(got, x.reshape(-1, d_in), w)
        else:
            check_close(got, bf16_round(x).reshape(-1, d_in), w)


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


def test_auto_never_chooses_the_unverified_kernel_on_gpu(monkeypatch):
    """Under ``auto`` a packed leaf traced on a (pretended) accelerator backend holds no
    pallas_call: no (backend, Pallas backend, JAX version) has been verified."""
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


def test_auto_uses_the_kernel_only_for_rows_of_the_table(monkeypatch):
    """``auto`` picks XLA for every combination not in ``VERIFIED`` (the table is empty), the
    kernel for a listed (platform, Pallas backend, JAX version), never on ROCm even if listed;
    ``on`` / ``off`` override it."""
    assert K.VERIFIED == ()
    for backend in ("cpu", "gpu", "cuda", "rocm", "tpu", "METAL"):
        assert not K.use_kernel(backend)
    v = jax.__version__
    monkeypatch.setattr(K, "VERIFIED", (("cuda", "triton", v), ("rocm", "triton", v),
                                        ("tpu", "mosaic_tpu", "0.0.1")))
    assert K.use_kernel("cuda") and K.use_kernel("gpu")  # no GPU here: 'gpu' reads as CUDA
    assert not K.use_kernel("rocm")  # never by auto
    assert not K.use_kernel("tpu")  # verified with another JAX version only
    assert not K.use_kernel("cpu")
    monkeypatch.setattr(K, "VERIFIED", (("cuda", "mosaic_gpu", v),))  # another Pallas backend
    assert not K.use_kernel("cuda")
    monkeypatch.setattr(K, "VERIFIED", (("cuda", "triton", v),))
    with execution.settings(packed_kernel="off"):
        assert not K.use_kernel("cuda")
    with execution.settings(packed_kernel="on"):
        assert K.use_kernel("cpu") and K.use_kernel("rocm")
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
    good = jnp.zeros((4, 3), jnp.uint32)
    with pytest.raises(ConfigError, match="block_n"):
        K.packed_matmul(jnp.zeros((2, 70)), good, good, jnp.float32(1.0), 70, block_n=48)
    with pytest.raises(ConfigError, match="platform"):
        K.packed_matmul(jnp.zeros((2, 70)), good, good, jnp.float32(1.0), 70, platform="metal")
