"""A Pallas kernel for the packed-binary matmul: ``x @ (alpha * sign * mask)`` with the weight
read as bits and unpacked inside the kernel, one block at a time.

:class:`~lowrank_jax.leaves.PackedBinary` stores a binary weight as two ``uint32`` bit planes
(bit ``k`` of word ``q`` of output row ``j`` is input ``32 q + k``). Its ``linear`` normally
unpacks the whole weight once per call and calls XLA's dot. :func:`packed_matmul` instead never
builds the weight in float in device memory: every block of words is unpacked in registers (GPU)
or VMEM (TPU) and multiplied there, so a weight costs 2 bits of memory traffic instead of 16 or
32.

Structure (correct by construction). The output is split into ``[bm, bn]`` blocks; each block
is written by exactly one program, once, after the whole reduction over ``d_in`` has been
accumulated in float32:

* **GPU** (``cuda``; ``rocm`` is lowered the same way but never chosen by ``auto``): a
  two-dimensional grid ``(row blocks, output blocks)``. Each program loops over the reduction
  inside the kernel (``lax.fori_loop`` over blocks of ``bw`` words, i.e. ``32 bw`` inputs),
  keeps a float32 accumulator in registers and stores it once at the end. No program reads or
  writes another's output, whatever order the GPU runs them in. (The previous kernel added into
  its output block across a third, reduction grid axis: valid where the grid runs sequentially,
  a race on a GPU, where a multi-block case came out 0.67 off on an NVIDIA H200.)
* **TPU**: a three-dimensional grid ``(row blocks, output blocks, word blocks)`` with dimension
  semantics ``("parallel", "parallel", "arbitrary")`` declared to Mosaic
  (:class:`jax.experimental.pallas.tpu.CompilerParams`): the reduction axis runs in order on one
  core, so a VMEM float32 scratch accumulator (zeroed at the first word block, written to the
  output at the last) is correct, and Mosaic pipelines the blocks' copies from HBM. This is the
  layout of Pallas' own TPU matmul.

Unpacking. A block of words ``uint32 [bw, bn]`` becomes the weight block ``[32 bw, bn]`` by
one broadcast shift (``(words[:, None, :] >> k[None, :, None]) & 1``, ``[bw, 32, bn]``) and a
reshape that merges the two leading axes, so row ``32 q + k`` of the block is input
``32 q + k``: the activations are read in their natural order. Then one product per block,
``[bm, 32 bw] @ [32 bw, bn]``, with a contraction of ``32 bw`` (128 by default on GPU, 256 on
TPU): what matrix units need, and a kernel whose size (and compile time) does not grow with
the block (the previous kernel unrolled 32 products of contraction ``bw`` per block; a
``[1024, 2048] x [2048, 2048]`` call was still compiling after 2 minutes on the H200). The gain
``alpha`` multiplies the output once, outside (results equal the float leaf's to float32
round-off, not bit for bit). Products on bf16 inputs multiply bf16 operands (the weights
``-1, 0, +1`` are exact in bf16) with float32 accumulation; float32 inputs use
``Precision.HIGHEST`` (no TF32 rounding of the activations).

Pallas backend on GPU: **Triton**, chosen explicitly (:class:`jax.experimental.pallas.triton.
CompilerParams`) rather than left to the ``jax_pallas_use_mosaic_gpu`` flag. In the installed
JAX (0.10) the Triton lowering handles everything this kernel uses (pointer loads of dynamic
slices, shifts on unsigned integers, a 3-D broadcast, ``tt.reshape``, ``fori_loop`` as
``scf.for``, ``tt.dot`` in IEEE float32 or bf16), on every NVIDIA GPU JAX supports and on
ROCm; Mosaic GPU targets Hopper and newer only, its ``pallas_call`` entry point is deprecated in
favour of ``plgpu.kernel`` with warpgroup-level programming (explicit SMEM copies, barriers,
``wgmma`` layouts), a different kernel to write and to verify. Triton's rule that every
loaded array has a power-of-two size is why block sizes are powers of two.

TPU design (on paper: never run on a TPU). Matrix units of 128 x 128 (256 x 256 on v6e):
output blocks of 128 lanes, word blocks of at least 8 sublanes (``32 bw >= 256`` inputs per
product), row blocks of at least 16 (bf16 packs 16 rows per vreg); inputs in bf16 by default on
TPU (the bf16 forward), float32 through ``HIGHEST`` (several bf16 passes). Mosaic lowering.

Selection: under ``auto`` (the default) :func:`use_kernel` is true only for a combination
``(backend, Pallas backend, JAX version)`` listed in :data:`VERIFIED`: those on which this
kernel has been run on that hardware against a NumPy reference (multi-block grids, odd sizes,
float32 and bf16; ``pytest -m accelerator tests/leaves/test_packed_kernels.py``). The table is
empty: no run of this kernel on a GPU or a TPU has happened yet, so every backend takes the XLA
path (unpack, then XLA's dot). ``rocm`` is never chosen by ``auto``. The execution setting
``packed_kernel`` (:func:`lowrank_jax.execution.settings`; default from the environment
variable ``LOWRANK_JAX_PACKED_KERNEL``, read at import) overrides it: ``'off'`` never uses the
kernel, ``'on'`` always does (interpreted on CPU). It is part of the traced function's cache
key: changing it re-traces.

Checked without a device: both structures in interpret mode against NumPy
(``tests/leaves/test_packed_kernels.py``), and lowering for ``cuda`` (to Triton IR) and
``tpu`` (to Mosaic IR) on a CPU machine (``tests/test_lowering.py``). Lowering stops before PTX
compilation and before Mosaic's layout passes (which run in libtpu): those, and the numbers,
need the device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lowrank_jax import execution
from lowrank_jax.errors import ConfigError, ShapeError

WORD = 32
ENV = execution.PACKED_KERNEL_ENV

#: The Pallas backend :func:`packed_matmul` lowers to on each platform (``cpu``: the GPU
#: kernel run by Pallas' interpreter).
PALLAS_BACKEND: dict[str, str] = {"cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu",
                                  "cpu": "interpret"}

#: ``(backend, Pallas backend, JAX version)`` combinations on which ``auto`` uses the kernel:
#: only those where it has run on that hardware against a NumPy reference (multi-block grids,
#: odd sizes, float32 and bf16: ``pytest -m accelerator tests/leaves/test_packed_kernels.py``),
#: for example ``("cuda", "triton", "0.10.2")``. A row is added only in the commit that records
#: such a run. Empty: this kernel has not run on a GPU or a TPU yet.
VERIFIED: tuple[tuple[str, str, str], ...] = ()

#: Default blocks per platform: ``(rows, outputs, words)``. Not tuned on hardware (no device
#: run yet): GPU blocks in the range of Triton's matmul tutorials (a ``[32 bw, bn] = [128,
#: 128]`` unpacked weight per step); TPU blocks of 128 lanes and 8 word sublanes.
DEFAULT_BLOCKS: dict[str, tuple[int, int, int]] = {
    "cuda": (64, 128, 4), "rocm": (64, 128, 4), "cpu": (64, 128, 4), "tpu": (128, 128, 8)}
#: Smallest blocks per platform ``(rows, outputs, words)``: GPU matrix units multiply 16 x 16
#: tiles; a TPU block's last two dimensions must be multiples of (8, 128) unless they span the
#: array, and bf16 packs 16 rows per vreg.
MIN_BLOCKS: dict[str, tuple[int, int, int]] = {
    "cuda": (16, 16, 1), "rocm": (16, 16, 1), "cpu": (16, 16, 1), "tpu": (16, 128, 8)}


def platform(backend: str | None = None) -> str:
    """The platform name the kernel tables use: ``'cuda'``, ``'rocm'``, ``'tpu'`` or
    ``'cpu'``.

    Args:
      backend: a JAX backend or platform name; default ``jax.default_backend()``. ``'gpu'`` is
        resolved to ``'cuda'`` or ``'rocm'`` by the first GPU device's platform version.
    """
    b = (backend or jax.default_backend()).lower()
    if b != "gpu":
        return b
    try:
        version = str(jax.devices("gpu")[0].client.platform_version).lower()
    except RuntimeError:  # no GPU in this process: a name given by the caller
        return "cuda"
    return "rocm" if ("rocm" in version or "hip" in version) else "cuda"


def use_kernel(backend: str | None = None) -> bool:
    """Whether :class:`~lowrank_jax.leaves.PackedBinary` runs :func:`packed_matmul`.

    Args:
      backend: a JAX backend or platform name; default ``jax.default_backend()``.

    Returns:
      By the active :func:`lowrank_jax.execution.current` setting ``packed_kernel``: ``'on'``
      always, ``'off'`` never, ``'auto'`` only when ``(platform, Pallas backend,
      jax.__version__)`` is in :data:`VERIFIED` (none yet), and never on ``rocm``.
    """
    mode = execution.current().packed_kernel
    if mode != "auto":
        return mode == "on"
    p = platform(backend)
    if p == "rocm" or p not in PALLAS_BACKEND:
        return False
    return (p, PALLAS_BACKEND[p], jax.__version__) in VERIFIED


def _round_up(n: int, m: int) -> int:
    return -(-int(n) // int(m)) * int(m)


def _is_pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and not n & (n - 1)


def _clip_block(block: int, size: int, floor: int) -> int:
    """``min(block, max(floor, next power of two >= size))``: no block larger than the problem
    rounded up, none below the platform's smallest."""
    return max(int(floor), min(int(block), 1 << max(0, int(size) - 1).bit_length()))


def _unpack(sign, mask, dtype):
    """``uint32 [bw, bn]`` sign and mask words -> weights ``[32 bw, bn]`` in ``{-1, 0, +1}``
    (``dtype``), row ``32 q + k`` from bit ``k`` of word ``q``."""
    bw, bn = sign.shape
    shifts = lax.broadcasted_iota(jnp.uint32, (1, WORD, 1), 1)
    keep = (mask[:, None, :] >> shifts) & jnp.uint32(1)  # [bw, 32, bn]
    neg = (sign[:, None, :] >> shifts) & jnp.uint32(1)
    w = keep.astype(jnp.int32) - 2 * (neg & keep).astype(jnp.int32)
    # Merge the leading axes in a 32-bit type (whole sublane tiles on TPU), then narrow.
    return w.reshape(bw * WORD, bn).astype(jnp.float32).astype(dtype)


def _loop_kernel(x_ref, s_ref, m_ref, o_ref, *, bw: int, steps: int, precision):
    """GPU program ``(i, j)``: ``o[i, j] = sum_t x[i, t] @ W[t, j]`` in a loop inside the
    kernel, accumulated in float32 and stored once.

    ``x_ref``: ``[bm, 32 bw steps]`` (the block row's whole padded width); ``s_ref``, ``m_ref``:
    ``uint32 [bw steps, bn]``; ``o_ref``: ``float32 [bm, bn]``.
    """
    from jax.experimental import pallas as pl

    width = WORD * bw

    def step(t, acc):
        xs = x_ref[:, pl.ds(pl.multiple_of(t * width, width), width)]
        rows = pl.ds(pl.multiple_of(t * bw, bw), bw)
        w = _unpack(s_ref[rows, :], m_ref[rows, :], xs.dtype)
        return acc + jnp.dot(xs, w, preferred_element_type=jnp.float32, precision=precision)

    o_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))


def _grid_kernel(x_ref, s_ref, m_ref, o_ref, acc_ref, *, precision):
    """TPU program ``(i, j, t)`` (``t`` declared ``arbitrary``: run in order): accumulate
    ``x[i, t] @ W[t, j]`` into a float32 VMEM scratch; write ``o[i, j]`` at the last ``t``."""
    from jax.experimental import pallas as pl

    t = pl.program_id(2)

    @pl.when(t == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    xs = x_ref[...]
    acc_ref[...] += jnp.dot(xs, _unpack(s_ref[...], m_ref[...], xs.dtype),
                            preferred_element_type=jnp.float32, precision=precision)

    @pl.when(t == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...]


def _call(xp, s_t, m_t, *, plat: str, bm: int, bn: int, bw: int, interpret: bool):
    """The ``pallas_call`` of platform ``plat`` on padded operands: ``xp [mp, 32 wp]``,
    ``s_t``, ``m_t``: ``uint32 [wp, np]``; returns ``float32 [mp, np]``."""
    from jax.experimental import pallas as pl

    mp, wp, np_ = xp.shape[0], s_t.shape[0], s_t.shape[1]
    precision = lax.Precision.HIGHEST if xp.dtype == jnp.float32 else None
    out_shape = jax.ShapeDtypeStruct((mp, np_), jnp.float32)
    if plat == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pl.pallas_call(
            functools.partial(_grid_kernel, precision=precision),
            out_shape=out_shape,
            grid=(mp // bm, np_ // bn, wp // bw),
            in_specs=[pl.BlockSpec((bm, WORD * bw), lambda i, j, t: (i, t)),
                      pl.BlockSpec((bw, bn), lambda i, j, t: (t, j)),
                      pl.BlockSpec((bw, bn), lambda i, j, t: (t, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, t: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="packed_binary_matmul")(xp, s_t, m_t)
    compiler_params = None
    if plat in ("cuda", "rocm"):
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=4, num_stages=3)
    return pl.pallas_call(
        functools.partial(_loop_kernel, bw=bw, steps=wp // bw, precision=precision),
        out_shape=out_shape,
        grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, WORD * wp), lambda i, j: (i, 0)),
                  pl.BlockSpec((wp, bn), lambda i, j: (0, j)),
                  pl.BlockSpec((wp, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=compiler_params,
        interpret=interpret, name="packed_binary_matmul")(xp, s_t, m_t)


def packed_matmul(x: jax.Array, sign_bits: jax.Array, mask_bits: jax.Array, alpha: jax.Array,
                  d_in: int, *, block_m: int | None = None, block_n: int | None = None,
                  block_words: int | None = None, platform: str | None = None,
                  interpret: bool | None = None) -> jax.Array:
    """``x @ (alpha * sign * mask)`` for a packed binary weight, by a Pallas kernel that unpacks
    the bits block by block.

    Args:
      x: inputs ``[..., d_in]`` (float; bf16 inputs multiply as bf16, others as float32).
      sign_bits, mask_bits: ``uint32 [d_out, ceil(d_in / 32)]``
        (:func:`~lowrank_jax.leaves.pack_bits` layout: 1 = negative, 1 = kept).
      alpha: scalar gain.
      d_in: number of inputs.
      block_m, block_n: rows and outputs per program (powers of two); default per platform
        (:data:`DEFAULT_BLOCKS`), clipped to the problem's size rounded up to a power of two
        and raised to the platform's smallest (:data:`MIN_BLOCKS`).
      block_words: words per reduction step (``32 block_words`` inputs per product), a power of
        two, clipped the same way.
      platform: whose kernel to build: ``'cuda'`` / ``'rocm'`` (Triton, reduction looped inside
        each program), ``'tpu'`` (Mosaic, reduction on an ``arbitrary`` grid axis) or ``'cpu'``
        (the GPU kernel, interpreted); default: the running backend's (:func:`platform`). A
        platform other than the running one is for lowering (``lowering_platforms``) or, with
        ``interpret=True``, for running its structure in the interpreter.
      interpret: run the kernel in Pallas' interpreter; default: on CPU only.

    Returns:
      ``[..., d_out]`` in ``result_type(x, float32)``, the product accumulated in float32.

    Raises:
      ShapeError: ``x`` does not end in ``d_in``, or the words do not match it.
      ConfigError: a block size that is not a power of two, or an unknown platform.
    """
    # The platform and interpret mode are resolved here, outside the jitted function, so that
    # they are part of its cache key.
    plat = _platform_arg(platform)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _packed_matmul(x, sign_bits, mask_bits, alpha, d_in, block_m=block_m,
                          block_n=block_n, block_words=block_words, plat=plat,
                          interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("d_in", "block_m", "block_n", "block_words",
                                             "plat", "interpret"))
def _packed_matmul(x, sign_bits, mask_bits, alpha, d_in, *, block_m, block_n, block_words,
                   plat: str, interpret: bool):
    """:func:`packed_matmul` for a resolved platform and interpret mode."""
    x = jnp.asarray(x)
    if x.shape[-1] != d_in:
        raise ShapeError(f"packed_matmul: x must end in d_in={d_in}, got shape {x.shape}",
                         where="x", expected=d_in, actual=x.shape[-1])
    d_out, n_w = sign_bits.shape
    if n_w != -(-d_in // WORD) or mask_bits.shape != sign_bits.shape:
        raise ShapeError(f"packed_matmul: sign_bits and mask_bits must be uint32 "
                         f"[d_out, {-(-d_in // WORD)}], got {sign_bits.shape} and "
                         f"{mask_bits.shape}", where="sign_bits",
                         expected=(d_out, -(-d_in // WORD)), actual=tuple(sign_bits.shape))
    blocks = DEFAULT_BLOCKS[plat]
    requested = [blocks[i] if b is None else b
                 for i, b in enumerate((block_m, block_n, block_words))]
    for name, b in zip(("block_m", "block_n", "block_words"), requested, strict=True):
        if not _is_pow2(b):
            raise ConfigError(f"packed_matmul: {name} must be a power of two >= 1, got {b!r}",
                              where=name, expected="power of two", actual=b)
    out_dtype = jnp.result_type(x.dtype, jnp.float32)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in)
    if x2.dtype != jnp.bfloat16:
        x2 = x2.astype(jnp.float32)
    m = x2.shape[0]
    lo = MIN_BLOCKS[plat]
    bm = _clip_block(requested[0], m, lo[0])
    bn = _clip_block(requested[1], d_out, lo[1])
    bw = _clip_block(requested[2], n_w, lo[2])
    wp, mp, np_ = _round_up(n_w, bw), _round_up(max(m, 1), bm), _round_up(d_out, bn)

    # Zero padding: padded inputs are 0 and padded words have mask bits 0, so they add nothing.
    xp = jnp.pad(x2, ((0, mp - m), (0, wp * WORD - d_in)))
    s_t = jnp.pad(jnp.asarray(sign_bits, jnp.uint32), ((0, np_ - d_out), (0, wp - n_w))).T
    m_t = jnp.pad(jnp.asarray(mask_bits, jnp.uint32), ((0, np_ - d_out), (0, wp - n_w))).T
    out = _call(xp, s_t, m_t, plat=plat, bm=bm, bn=bn, bw=bw, interpret=interpret)
    y = out[:m, :d_out] * jnp.asarray(alpha, jnp.float32)
    return y.astype(out_dtype).reshape(lead + (d_out,))


def _platform_arg(value: str | None) -> str:
    """``packed_matmul``'s ``platform``: checked, ``None`` resolved to the running one."""
    plat = platform(value)
    if plat not in PALLAS_BACKEND:
        raise ConfigError(f"packed_matmul: platform must be one of {sorted(PALLAS_BACKEND)}, "
                          f"got {value!r}", where="platform",
                          expected=" | ".join(sorted(PALLAS_BACKEND)), actual=value)
    return plat


__all__ = ["DEFAULT_BLOCKS", "ENV", "MIN_BLOCKS", "PALLAS_BACKEND", "VERIFIED", "packed_matmul",
           "platform", "use_kernel"]
