"""A dense layer partitioned over machines with low intercommunication.

"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar), sec. II.B-C:
machine ``m`` owns the input block ``x_m`` (``d_in / M`` features) and computes the output block
``m`` (``d_out / M`` features). It keeps its diagonal block ``W_mm`` exactly and receives, from
every other machine ``m'``, only the ``r`` numbers ``y~_m' = Sigma~_m' V~_m'^T x_m'`` (eq. 29);
it then computes ``W_mm x_m + sum_{m' != m} U~_{m,m'} y~_m' + b_m`` (eq. 33). One broadcast of
``r`` numbers per machine per token per layer (eq. 34), one round, no central node.

:class:`Partitioned` holds exactly that, in the library's orientation (``y = x @ W``) and in
*machine order*: input feature ``j`` belongs to machine ``j // (d_in / M)`` and output feature
``i`` to machine ``i // (d_out / M)``. Which original outputs a machine computes (the paper's
Algorithm 1) is decided by :mod:`lowrank_jax.compress.partitioning`, which permutes the hidden
features of a block so that the machines' outputs become contiguous; the next layer's inputs
are then already where they must be, and no permutation runs between layers.

Execution. ``linear(leaf, x)`` runs under ``jax.shard_map`` over the mesh axis ``mesh_axis``
(default ``'model'``) when the call is traced under a mesh that has that axis
(``with jax.set_mesh(mesh): ...``): every device holds the blocks of its ``M / n`` machines,
computes their ``r`` numbers each, one ``all_gather`` over the axis exchanges them, and the
output stays sharded over the axis (features ``P(..., mesh_axis)``) for the next layer. Other
mesh axes (data parallelism) stay automatic. Inside a ``shard_map`` that is already manual over
``mesh_axis``, the leaf's arrays are taken as this device's shards and the same per-device code
runs directly. With no such mesh the same per-machine code runs on one device (every machine in
turn, the exchange being a no-op), so results are identical up to float reduction order.

Counts (multiply-adds, the library's convention; the paper counts 2 FLOPs per multiply-add):
per token ``M a c + M a r + M (M - 1) r c`` with ``a = d_in / M``, ``c = d_out / M``: the
diagonal blocks, the ``r`` numbers each machine sends (eq. 29; the paper's eqs. 51-54 leave
them out, its eq. 46 counts them for the baseline) and the received low-rank products. This is
the paper's ``N_2`` (eq. 59). Parameters: ``d_in d_out / M + r d_in + (M - 1) r d_out + d_out``
with a bias, the paper's eq. 43.

:class:`CompressedKeys` is the paper's sec. III.A for attention: a query-key object whose
tokens are split over the machines, each machine sending ``K`` numbers per key and head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves.base import (
    CONCRETE,
    Array,
    Leaf,
    array_bits,
    array_size,
    keep_inputs,
    keep_outputs,
    leaf_dataclass,
    linear,
    materialize,
)
from lowrank_jax.leaves.heads import as_int_tuple, head_offsets, is_uniform, split_heads
from lowrank_jax.leaves.query_key import QK


def sender_index(machines: np.ndarray, num_machines: int) -> np.ndarray:
    """Which machine each received slot comes from: ``[k, M - 1]`` with row ``j`` for machine
    ``m = machines[j]`` listing ``(m + 1) % M, (m + 2) % M, ..., (m + M - 1) % M``.

    :attr:`Partitioned.recv` stores machine ``m``'s factors ``U~_{m,m'}`` in this order, so a
    machine never stores (nor multiplies by) a block for itself.

    Args:
      machines: machine indices ``[k]``.
      num_machines: ``M``.

    Returns:
      ``[k, M - 1]`` sender indices.
    """
    machines = np.asarray(machines, np.int64)
    return (machines[:, None] + np.arange(1, num_machines)[None, :]) % num_machines


def _received(every: Array, first, k: int) -> Array:
    """``[..., M, r]`` (every machine's message) -> ``[..., k, M - 1, r]``: for each of the
    ``k`` machines ``first, ..., first + k - 1`` held here, the messages of the others in
    :func:`sender_index` order. A static ``first`` (one device) is one gather; a traced one
    (the device's index under ``shard_map``) takes contiguous slices of ``[every, every]``."""
    m = every.shape[-2]
    if isinstance(first, (int, np.integer)):  # one device: a static gather (fewer, larger ops)
        return every[..., sender_index(np.arange(first, first + k), m), :]
    twice = jnp.concatenate([every, every], axis=-2)
    return jnp.stack([jax.lax.dynamic_slice_in_dim(twice, (first + j + 1) % m, m - 1,
                                                   axis=twice.ndim - 2)
                      for j in range(k)], axis=-3)


def _machine_outputs(x: Array, diag: Array, send: Array, recv: Array, b: Array | None,
                     gather, first) -> Array:
    """The per-device computation for the ``k`` machines ``first, ..., first + k - 1``.

    ``x: [..., k * a]``, ``diag: [k, a, c]``, ``send: [k, a, r]``, ``recv: [k, M - 1, r, c]``,
    ``b: [k, c]``; ``gather(y)`` turns this device's ``[..., k, r]`` into every machine's
    ``[..., M, r]`` (an ``all_gather`` under ``shard_map``; the identity on one device).
    Returns ``[..., k * c]``.
    """
    k, a, c = diag.shape
    num_machines = recv.shape[1] + 1
    r = send.shape[-1]
    xs = x.reshape(*x.shape[:-1], k, a)  # [..., k, a]
    out = jnp.einsum("...ka,kac->...kc", xs, diag)  # W_mm x_m
    if r > 0 and num_machines > 1:
        y = jnp.einsum("...ka,kar->...kr", xs, send)  # eq. 29: the r numbers each machine sends
        received = _received(gather(y), first, k)  # [..., k, M - 1, r]
        out = out + jnp.einsum("...kjr,kjrc->...kc", received, recv)  # eq. 33
    if b is not None:
        out = out + b
    return out.reshape(*x.shape[:-1], k * c)


def _token_specs(mesh, axis: str, x: Array, token_axis: int | None):
    """``(spec of x, manual axes)`` for a ``shard_map`` over ``axis``.

    ``axis`` splits the last dimension of ``x`` (features, ``token_axis=None``) or dimension
    ``token_axis`` (tokens). A collective must not meet an automatic mesh axis (XLA would first
    replicate its operand over it), so the mesh's other free axes are made manual too and split
    the leading (batch) dimension of ``x``, as the train step places batches; when it does not
    divide, they stay automatic.
    """
    others = tuple(a for a in mesh.axis_names if a != axis and a not in mesh.manual_axes)
    size = int(np.prod([mesh.shape[a] for a in others], dtype=np.int64))
    spec: list = [None] * x.ndim
    spec[x.ndim - 1 if token_axis is None else token_axis] = axis
    names = {axis}
    if others and x.ndim >= 2 and spec[0] is None and x.shape[0] % size == 0:
        spec[0] = others if len(others) > 1 else others[0]
        names |= set(others)
    return P(*spec), names


class Partitioned(Leaf):
    """``W`` split over ``M`` machines: dense diagonal blocks, rank-``r`` off-diagonal factors.

    "Partitioning Transformer Networks with Low Intercommunication", eqs. 26-34. With
    ``a = d_in / M`` inputs and ``c = d_out / M`` outputs per machine, in machine order (see
    the module docstring):

    Fields:
      diag: ``[M, a, c]``: ``diag[m]`` is machine ``m``'s block ``W_mm`` (``x_m @ diag[m]``).
      send: ``[M, a, r]``: ``send[m] = (Sigma~_m V~_m^T)^T``: machine ``m`` sends
        ``x_m @ send[m]``, ``r`` numbers per token (eq. 29).
      recv: ``[M, M - 1, r, c]``: ``recv[m, j] = U~_{m,m'}^T`` for the sender
        ``m' = (m + 1 + j) % M`` (:func:`sender_index`): machine ``m`` stores one ``[r, c]``
        factor per other machine and none for itself.
      b: optional bias ``[M, c]`` (machine ``m`` adds ``b[m]``).
      mesh_axis: static name of the mesh axis the machines are laid over when ``linear`` is
        traced under a mesh that has it (``jax.set_mesh``). Placement by the train step:
        :meth:`logical_axes` names the leading dimension ``'machine'``, mapped to this axis
        with ``axis_rules={'machine': 'model'}``.

    The dense matrix (:meth:`to_dense`) has block ``(m', m)`` (inputs of ``m'``, outputs of
    ``m``) equal to ``diag[m]`` for ``m' = m`` and ``send[m'] @ recv[m, (m' - m - 1) % M]``
    otherwise.
    """

    diag: Array
    send: Array
    recv: Array
    b: Array | None = None
    mesh_axis: str = "model"

    def __post_init__(self):
        if not isinstance(self.mesh_axis, str) or not self.mesh_axis:
            raise ConfigError(f"Partitioned: mesh_axis must be a non-empty string, got "
                              f"{self.mesh_axis!r}", where="mesh_axis", expected="str",
                              actual=self.mesh_axis)
        arrays = (self.diag, self.send, self.recv)
        if not all(isinstance(x, CONCRETE) for x in arrays):
            return
        d, s, u = (tuple(x.shape) for x in arrays)
        ok = len(d) == 3 and len(s) == 3 and len(u) == 4
        if ok:
            m, a, c = d
            r = s[2]
            ok = s == (m, a, r) and u == (m, m - 1, r, c) and m >= 1
        if not ok:
            raise ShapeError(
                "Partitioned: expected diag [M, a, c], send [M, a, r] and recv [M, M - 1, r, c], "
                f"got diag {d}, send {s}, recv {u}", where="Partitioned",
                expected="diag [M, a, c], send [M, a, r], recv [M, M-1, r, c]",
                actual={"diag": d, "send": s, "recv": u})
        if isinstance(self.b, CONCRETE) and tuple(self.b.shape) != (d[0], d[2]):
            raise ShapeError(f"Partitioned: bias b must have shape (M, c) = {(d[0], d[2])}, got "
                             f"{tuple(self.b.shape)}", where="b", expected=(d[0], d[2]),
                             actual=tuple(self.b.shape))

    # -- sizes ------------------------------------------------------------------------------

    @property
    def machines(self) -> int:
        """``M``: the number of machines."""
        return int(self.recv.shape[1]) + 1

    @property
    def rank(self) -> int:
        """``r``: numbers each machine sends per token."""
        return int(self.send.shape[-1])

    @property
    def block_shape(self) -> tuple[int, int]:
        """``(a, c) = (d_in / M, d_out / M)``."""
        return int(self.diag.shape[1]), int(self.diag.shape[2])

    @property
    def shape(self) -> tuple[int, int]:
        # from the blocks present: inside a shard_map manual over mesh_axis, a device's shards
        # describe the device's part of x @ W
        k, a, c = (int(v) for v in self.diag.shape)
        return (k * a, k * c)

    # -- compute ----------------------------------------------------------------------------

    def apply(self, x: Array) -> Array:
        mesh = jax.sharding.get_abstract_mesh()
        axis = self.mesh_axis
        if mesh.empty or axis not in mesh.axis_names or int(mesh.shape[axis]) == 1:
            return _machine_outputs(x, self.diag, self.send, self.recv, self.b, lambda y: y, 0)
        n = int(mesh.shape[axis])
        if axis in mesh.manual_axes:
            return self._apply_manual(x, n)
        if self.machines % n:
            raise ShapeError(
                f"Partitioned: {self.machines} machines cannot be laid over mesh axis {axis!r} of "
                f"size {n}; the number of machines must be a multiple of the axis size",
                where=axis, expected=f"a divisor of {self.machines}", actual=n)
        x_spec, names = _token_specs(mesh, axis, x, None)
        b_spec = None if self.b is None else P(axis)
        fn = jax.shard_map(
            lambda x, d, s, u, b: self._device(x, d, s, u, b, n),
            mesh=mesh, axis_names=names, check_vma=True,
            in_specs=(x_spec, P(axis), P(axis), P(axis), b_spec), out_specs=x_spec)
        return fn(x, self.diag, self.send, self.recv, self.b)

    def _device(self, x, diag, send, recv, b, n: int) -> Array:
        """One device's machines under ``shard_map`` over ``mesh_axis`` (``n`` devices)."""
        axis = self.mesh_axis
        k = diag.shape[0]
        first = jax.lax.axis_index(axis) * k
        return _machine_outputs(
            x, diag, send, recv, b,
            lambda y: jax.lax.all_gather(y, axis, axis=y.ndim - 2, tiled=True), first)

    def _apply_manual(self, x: Array, n: int) -> Array:
        """Inside a ``shard_map`` already manual over ``mesh_axis``: arrays are local shards."""
        k = int(self.diag.shape[0])
        if k * n != self.machines:
            raise ShapeError(
                f"Partitioned: inside a shard_map over {self.mesh_axis!r} ({n} devices) the leaf's "
                f"arrays must be this device's shards (in_specs P({self.mesh_axis!r})): diag "
                f"holds {k} machines but recv says there are {self.machines}",
                where="diag", expected=self.machines // n if self.machines % n == 0 else None,
                actual=k)
        return self._device(x, self.diag, self.send, self.recv, self.b, n)

    def to_dense(self) -> Array:
        m = self.machines
        a, c = self.block_shape
        if m == 1:
            return self.diag[0]
        # recv slot of sender m' at receiver m: (m' - m - 1) % M
        slot = (np.arange(m)[:, None] - np.arange(m)[None, :] - 1) % m  # [m', m]
        slot = np.where(np.eye(m, dtype=bool), 0, slot)  # the m' = m entries are masked below
        recv = self.recv[np.arange(m)[None, :], slot]  # [m', m, r, c]
        off = jnp.einsum("par,pqrc->paqc", self.send, recv)  # [m', a, m, c]
        eye = jnp.eye(m, dtype=bool)[:, None, :, None]
        blocks = jnp.where(eye, 0.0, off).astype(self.diag.dtype)
        diag = jnp.einsum("pac,pq->paqc", self.diag, jnp.eye(m, dtype=self.diag.dtype))
        return (blocks + diag).reshape(m * a, m * c)

    # -- counts -----------------------------------------------------------------------------

    def param_count(self) -> int:
        return (array_size(self.diag) + array_size(self.send) + array_size(self.recv)
                + array_size(self.b))

    def storage_bits(self) -> int:
        return (array_bits(self.diag) + array_bits(self.send) + array_bits(self.recv)
                + array_bits(self.b))

    def flops(self, n_tokens: int) -> int:
        m, r = self.machines, self.rank
        a, c = self.block_shape
        send = a * r if m > 1 else 0  # one machine sends nothing
        return int(n_tokens) * m * (a * c + send + (m - 1) * r * c)

    def bytes_sent(self, n_tokens: int = 1) -> int:
        """Bytes one machine broadcasts for ``n_tokens`` tokens: ``r`` numbers each (eq. 34),
        in the dtype of :attr:`send`."""
        return int(n_tokens) * self.rank * jnp.dtype(self.send.dtype).itemsize

    # -- surgery ----------------------------------------------------------------------------

    @property
    def bias(self) -> Array | None:
        return None if self.b is None else self.b.reshape(-1)

    def with_bias(self, b: Array | None) -> "Partitioned":
        if b is not None:
            b = jnp.asarray(b)
            if tuple(b.shape) != (self.d_out,):
                raise ShapeError(f"Partitioned.with_bias: bias must have shape ({self.d_out},), got "
                                 f"{tuple(b.shape)}", where="b", expected=(self.d_out,),
                                 actual=tuple(b.shape))
            b = b.reshape(self.machines, -1)
        return dataclasses.replace(self, b=b)

    def _per_machine(self, idx: np.ndarray, block: int, what: str) -> np.ndarray:
        """``idx`` as ``[M, kept]`` positions inside each machine's block, or a ShapeError when
        the machines would keep different numbers of channels."""
        owner = idx // block
        counts = np.bincount(owner, minlength=self.machines)
        if len(set(counts.tolist())) != 1:
            raise ShapeError(
                f"Partitioned.keep_{what}: every machine must keep the same number of {what} "
                f"channels (equal blocks), got {counts.tolist()} per machine; choose channels "
                "evenly per machine, or materialize the leaf first", where=what,
                expected="equal counts per machine", actual=counts.tolist())
        return (idx % block).reshape(self.machines, -1)

    def keep_inputs(self, idx: np.ndarray) -> "Partitioned":
        a, _ = self.block_shape
        local = self._per_machine(np.asarray(idx), a, "inputs")  # [M, a']
        rows = np.arange(self.machines)[:, None]
        return dataclasses.replace(self, diag=self.diag[rows, local], send=self.send[rows, local])

    def keep_outputs(self, idx: np.ndarray) -> "Partitioned":
        _, c = self.block_shape
        local = self._per_machine(np.asarray(idx), c, "outputs")  # [M, c']
        rows = np.arange(self.machines)[:, None]
        diag = jnp.take_along_axis(self.diag, jnp.asarray(local)[:, None, :], axis=2)
        recv = jnp.take_along_axis(self.recv, jnp.asarray(local)[:, None, None, :], axis=3)
        b = None if self.b is None else self.b[rows, local]
        return dataclasses.replace(self, diag=diag, recv=recv, b=b)

    # -- placement --------------------------------------------------------------------------

    def logical_axes(self):
        return {"diag": ("machine", None, None), "send": ("machine", None, "rank"),
                "recv": ("machine", None, "rank", None), "b": ("machine", None)}


Partitioned = leaf_dataclass(Partitioned, meta=("mesh_axis",))


class CompressedKeys(QK):
    """Attention logits from keys compressed to ``K`` numbers per head, tokens split over
    machines.

    "Partitioning Transformer Networks with Low Intercommunication", sec. III.A: every machine
    holds the queries and keys of its own tokens and sends, per key and head, the ``K``
    coefficients ``f(k) = U_h^T k`` (eq. 123) in an orthonormal basis ``U_h`` (from ``C_qk``,
    eq. 135, or PCA of the keys, eq. 136: :mod:`lowrank_jax.compress.partitioning.keys`); the
    logits are estimated as ``g = (q^T U_h)(U_h^T k) + c_h`` (eq. 124, ``c_h`` the expected
    rest). With ``K = d_head`` and ``c = 0`` they are exact.

    Fields:
      q, k: weight leaves ``[d_in, heads * d_head]`` (any leaf that is replicated on the mesh;
        biases allowed).
      basis: ``[heads, d_head, K]``: ``U_h``'s first ``K`` columns.
      offset: ``[heads]``: ``c_h``.
      widths: static per-head widths of ``q``/``k`` (equal: ``d_head``).
      mesh_axis: static mesh axis the *tokens* are split over when the logits are traced under
        a mesh that has it: each device projects its queries and keys, one ``all_gather`` of
        ``K`` numbers per key per head exchanges the compressed keys, and the logits come out
        split by query ``[b, h, q / n, k]``. (The block's values, which the paper does not
        compress, are then gathered by XLA: eq. 118 needs every machine's ``V_m'``.) The
        queries' and keys' lengths must be divisible by the axis size; otherwise the logits
        are computed as on one device.
    """

    q: Any
    k: Any
    basis: Array
    offset: Array
    widths: tuple[int, ...] = ()
    mesh_axis: str = "model"

    def __post_init__(self):
        object.__setattr__(self, "widths", as_int_tuple(self.widths, "CompressedKeys widths"))
        if not is_uniform(self.widths):
            raise ShapeError(f"CompressedKeys: heads must have equal widths, got {self.widths}",
                             where="widths", expected="equal widths", actual=self.widths)
        for name in ("q", "k"):
            leaf = getattr(self, name)
            if isinstance(leaf, Leaf) and leaf.d_out != sum(self.widths):
                raise ShapeError(f"CompressedKeys: '{name}' has {leaf.d_out} outputs but the "
                                 f"head widths sum to {sum(self.widths)}", where=name,
                                 expected=sum(self.widths), actual=leaf.d_out)
        h, w = len(self.widths), (self.widths[0] if self.widths else 0)
        if isinstance(self.basis, CONCRETE) and (self.basis.ndim != 3
                                                 or tuple(self.basis.shape[:2]) != (h, w)):
            raise ShapeError(f"CompressedKeys: basis must be [heads, d_head, K] = [{h}, {w}, K], "
                             f"got {tuple(self.basis.shape)}", where="basis",
                             expected=[h, w, "K"], actual=tuple(self.basis.shape))
        if isinstance(self.offset, CONCRETE) and tuple(self.offset.shape) != (h,):
            raise ShapeError(f"CompressedKeys: offset must be [heads] = [{h}], got "
                             f"{tuple(self.offset.shape)}", where="offset", expected=[h],
                             actual=tuple(self.offset.shape))

    @classmethod
    def from_query_key(cls, qk: Any, basis, offset, *, mesh_axis: str = "model"):
        """Compressed keys on the projections of a :class:`~lowrank_jax.QueryKey`.

        Args:
          qk: a ``QueryKey`` with equal head widths.
          basis: ``[heads, d_head, K]``.
          offset: ``[heads]``.
          mesh_axis: the mesh axis tokens are split over.
        """
        from lowrank_jax.leaves.query_key import QueryKey

        if not isinstance(qk, QueryKey):
            raise ShapeError(f"CompressedKeys.from_query_key: expected a QueryKey (per-head "
                             f"query and key projections), got {type(qk).__name__}",
                             where="qk", expected="QueryKey", actual=type(qk).__name__)
        return cls(q=qk.q, k=qk.k, basis=basis, offset=offset, widths=qk.widths,
                   mesh_axis=mesh_axis)

    @property
    def num_heads(self) -> int:
        return len(self.widths)

    @property
    def num_coefficients(self) -> int:
        """``K``: numbers sent per key and head."""
        return int(self.basis.shape[-1])

    @property
    def d_q_in(self) -> int:
        return self.q.d_in

    @property
    def d_k_in(self) -> int:
        return self.k.d_in

    def _project(self, leaf, x, mask):
        y = split_heads(linear(leaf, x), self.widths)  # [b, len, h, d_head]
        if mask is not None:
            y = y * mask[:, None, :].astype(y.dtype)
        return jnp.einsum("blhd,hdk->blhk", y, self.basis)  # eq. 123: U_h^T k

    def _local(self, xq, xkv, q_mask, k_mask, gather) -> Array:
        fq = self._project(self.q, xq, q_mask)
        fk = gather(self._project(self.k, xkv, k_mask))  # every machine's compressed keys
        g = jnp.einsum("bqhk,bshk->bhqs", fq, fk)  # eq. 124, first term
        return g + self.offset[None, :, None, None].astype(g.dtype)

    def logits(self, xq, xkv, *, q_mask=None, k_mask=None):
        mesh = jax.sharding.get_abstract_mesh()
        axis = self.mesh_axis
        if mesh.empty or axis not in mesh.axis_names or int(mesh.shape[axis]) == 1 or (
                axis in mesh.manual_axes):
            return self._local(xq, xkv, q_mask, k_mask, lambda f: f)
        n = int(mesh.shape[axis])
        if xq.shape[1] % n or xkv.shape[1] % n:
            return self._local(xq, xkv, q_mask, k_mask, lambda f: f)
        q_spec, names = _token_specs(mesh, axis, xq, 1)
        k_spec, _ = _token_specs(mesh, axis, xkv, 1)
        out_spec = P(q_spec[0], None, axis, None)
        rep = lambda tree: jax.tree_util.tree_map(lambda _: P(), tree)  # noqa: E731
        mask_spec = lambda m: None if m is None else P(axis, None)  # noqa: E731

        def body(me, xq, xkv, q_mask, k_mask):
            return me._local(xq, xkv, q_mask, k_mask,
                             lambda f: jax.lax.all_gather(f, axis, axis=1, tiled=True))

        fn = jax.shard_map(body, mesh=mesh, axis_names=names, check_vma=True,
                           in_specs=(rep(self), q_spec, k_spec, mask_spec(q_mask),
                                     mask_spec(k_mask)), out_specs=out_spec)
        return fn(self, xq, xkv, q_mask, k_mask)

    def score_flops(self, q_len, k_len):
        h, k = self.num_heads, self.num_coefficients
        d = self.widths[0] if self.widths else 0
        return int(q_len) * int(k_len) * h * k + (int(q_len) + int(k_len)) * h * d * k

    def joint(self):
        q, k = materialize(self.q), materialize(self.k)
        off = head_offsets(self.widths)
        slices = []
        for h in range(self.num_heads):
            u = self.basis[h]
            slices.append((q[:, off[h]:off[h + 1]] @ u) @ (k[:, off[h]:off[h + 1]] @ u).T)
        return jnp.stack(slices, axis=-1)  # [d_q, d_k, h]

    def keep_heads(self, idx):
        idx = [int(i) for i in idx]
        off = head_offsets(self.widths)
        cols = np.concatenate([np.arange(off[h], off[h + 1]) for h in idx] or
                              [np.zeros(0, np.int64)]).astype(np.int64)
        return CompressedKeys(q=keep_outputs(self.q, cols), k=keep_outputs(self.k, cols),
                              basis=self.basis[np.asarray(idx, np.int64)],
                              offset=self.offset[np.asarray(idx, np.int64)],
                              widths=tuple(self.widths[h] for h in idx), mesh_axis=self.mesh_axis)

    def keep_inputs(self, idx, side):
        if side not in ("q", "k"):
            raise ShapeError(f"CompressedKeys.keep_inputs: side must be 'q' or 'k', got {side!r}")
        q = keep_inputs(self.q, idx) if side == "q" else self.q
        k = keep_inputs(self.k, idx) if side == "k" else self.k
        return dataclasses.replace(self, q=q, k=k)


CompressedKeys = leaf_dataclass(CompressedKeys, meta=("widths", "mesh_axis"))


__all__ = ["CompressedKeys", "Partitioned", "sender_index"]
