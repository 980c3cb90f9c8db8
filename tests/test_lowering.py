"""The packed-binary Pallas kernel lowered for ``cuda`` and ``tpu`` on a CPU machine.

``jax.jit(f).trace(...).lower(lowering_platforms=(p,))`` runs JAX's whole lowering for platform
``p`` without its device: for ``cuda`` Pallas' Triton lowering (the kernel becomes Triton IR in
a ``__gpu$xla.gpu.triton`` custom call), for ``tpu`` its Mosaic lowering (Mosaic IR in a
``tpu_custom_call``). This catches what JAX cannot lower (an unsupported primitive, a block
shape Triton or Mosaic refuse, constants captured by the kernel). It does not compile the IR:
PTX generation (XLA:GPU) and Mosaic's layout passes (libtpu) happen at compile time on the
device, and the numbers need the device too (the ``accelerator`` tests).

If this JAX / jaxlib cannot lower a platform at all (its Pallas backend module does not import),
the test is skipped with that import error as the reason, never passed silently.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import execution
from lowrank_jax import leaves as L
from lowrank_jax.leaves import packed_kernels as K

#: The module of the installed JAX that lowers a pallas_call for each platform, and the custom
#: call the lowered module holds.
BACKENDS = {"cuda": ("jax._src.pallas.triton.pallas_call_registration", "__gpu$xla.gpu.triton"),
            "tpu": ("jax._src.pallas.mosaic.pallas_call_registration", "tpu_custom_call")}


def require_backend(plat: str) -> str:
    """The custom-call target of ``plat``; skips the test (with the import error) when this
    JAX cannot lower Pallas kernels for ``plat``."""
    module, target = BACKENDS[plat]
    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"this jax {jax.__version__} / jaxlib cannot lower Pallas kernels for {plat}: "
                    f"importing {module} failed ({type(e).__name__}: {e})")
    return target


def operands(m: int, d_in: int, d_out: int, dtype):
    words = jax.ShapeDtypeStruct((d_out, -(-d_in // 32)), jnp.uint32)
    return (jax.ShapeDtypeStruct((m, d_in), dtype), words, words,
            jax.ShapeDtypeStruct((), jnp.float32))


@pytest.mark.parametrize("plat", ["cuda", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,d_in,d_out", [(70, 1000, 300), (5, 77, 33), (300, 2080, 520),
                                          (1024, 2048, 2048)])
def test_kernel_lowers(plat, dtype, m, d_in, d_out):
    """Multi-block grids and odd sizes, both dtypes: the lowered module holds the platform's
    kernel custom call, once."""
    target = require_backend(plat)
    f = functools.partial(K.packed_matmul, d_in=d_in, platform=plat, interpret=False)
    text = jax.jit(f).trace(*operands(m, d_in, d_out, dtype)).lower(
        lowering_platforms=(plat,)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and f"@{target}(" in calls[0]


def test_export_needs_the_triton_call_allowed():
    """``jax.export`` refuses the Triton custom call (it has no compatibility guarantee) unless
    it is allowed explicitly; the Mosaic TPU call is on JAX's list of stable targets."""
    from jax import export

    args = operands(70, 1000, 300, jnp.bfloat16)
    target = require_backend("cuda")
    f = jax.jit(functools.partial(K.packed_matmul, d_in=1000, platform="cuda", interpret=False))
    with pytest.raises(ValueError, match="custom call"):
        export.export(f, platforms=("cuda",))(*args)
    exp = export.export(f, platforms=("cuda",),
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*args)
    assert exp.platforms == ("cuda",) and target in exp.mlir_module()
    require_backend("tpu")
    g = jax.jit(functools.partial(K.packed_matmul, d_in=1000, platform="tpu", interpret=False))
    assert "tpu_custom_call" in export.export(g, platforms=("tpu",))(*args).mlir_module()


@pytest.mark.parametrize("plat,backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_packed_leaf_forward_lowers(monkeypatch, plat, backend):
    """A packed leaf's ``linear`` with the kernel switched on, traced as on that backend (the
    leaf picks the kernel of the running platform): its module holds the kernel's call."""
    target = require_backend(plat)
    r = np.random.default_rng(0)
    mb = L.MaskedBinary(jnp.asarray(r.standard_normal((100, 45)), jnp.float32),
                        jnp.asarray(r.standard_normal((100, 45)), jnp.float32),
                        jnp.asarray(r.standard_normal(45), jnp.float32), keep=0.5)
    pb = L.PackedBinary.from_leaf(mb)
    x = jax.ShapeDtypeStruct((4, 9, 100), jnp.bfloat16)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    with execution.settings(packed_kernel="on"):
        text = jax.jit(lambda p, v: L.linear(p, v)).trace(pb, x).lower(
            lowering_platforms=(plat,)).as_text()
    assert f"@{target}(" in text
