"""What a compiled program sends between devices, read from its HLO.

:func:`collective_bytes` lists every collective of a compiled XLA program (``all-gather``,
``all-reduce``, ``reduce-scatter``, ``all-to-all``, ``collective-permute``, and their async
``-start`` forms, each counted once) with its dtype, shapes, replica groups and the bytes each
device contributes: for an all-gather the operand (result / group size), for the others the
operand as printed. This is the measurement behind the claim of "Partitioning Transformer
Networks with Low Intercommunication" (eq. 34) that a partitioned layer broadcasts ``r``
numbers per machine per token: the partitioned leaves' ``all_gather`` shows up as one
collective whose operand is ``[..., machines here, r]``.

Caveats: the bytes are what each device *contributes* to a collective, not what crosses the
wire (a ring all-gather over ``n`` devices moves ``(n - 1)/n`` of the result through every
link; a broadcast medium, the paper's setting, moves the operand once). XLA's CPU backend
computes bfloat16 collectives in float32, so read the dtype from the listing.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from lowrank_jax.errors import ShapeError

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<result>.+?)\s+"
    r"(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<suffix>-start)?\((?P<args>.*)$")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program.

    Fields:
      name: the HLO instruction name.
      kind: one of :data:`KINDS`.
      dtype: element type (``'f32'``, ...).
      result_shapes: result shape(s) (a combined collective has several).
      group_size: devices per replica group (0 if unknown).
      groups: the replica groups as printed.
      dimension: the gathered / scattered dimension, if any.
      bytes: bytes each device contributes (see the module docstring).
      op_name: the JAX op that produced it (from the metadata), if printed.
    """

    name: str
    kind: str
    dtype: str
    result_shapes: tuple[tuple[int, ...], ...]
    group_size: int
    groups: str
    dimension: int | None
    bytes: int
    op_name: str = ""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["result_shapes"] = [list(s) for s in self.result_shapes]
        return d


def _group_size(args: str) -> tuple[int, str]:
    """Devices per replica group, in the three spellings XLA prints: explicit groups
    ``{{0,1},{2,3}}``, iota groups ``[2,2]<=[4]``, and mesh groups
    ``mesh['a'=2,'b'=4] {'b'}`` (the product of the listed axes)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\S+)?\s*\{([^}]*)\}",
                  args)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        axes = re.findall(r"'([^']+)'", m.group(2))
        return int(np.prod([sizes.get(a, 1) for a in axes], dtype=np.int64)), m.group(0)[15:]
    m = re.search(r"replica_groups=(\{\{[^=]*?\}\}|\{\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)",
                  args)
    if not m:
        pairs = re.search(r"source_target_pairs=(\{[^=]*?\}\})", args)
        return (2, pairs.group(1)) if pairs else (0, "")
    text = m.group(1)
    if text.startswith("{{"):
        first = text[2:].split("}", 1)[0]
        return len([t for t in first.split(",") if t.strip()]), text
    if text == "{}":
        return 0, text
    dims = [int(v) for v in text[1:text.index("]")].split(",")]  # [groups, size] <= [...]
    return dims[-1], text


def collective_bytes(compiled: Any) -> list[Collective]:
    """Every collective of a compiled program, with the bytes each device contributes.

    Args:
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``) or its HLO text
        (``compiled.as_text()``).

    Returns:
      :class:`Collective` s in program order (``-done`` halves of async pairs are skipped).
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    if not isinstance(text, str):
        raise ShapeError("collective_bytes: expected a compiled program or its HLO text",
                         where="compiled", expected="jax.stages.Compiled or str",
                         actual=type(compiled).__name__)
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        shapes = [(dt, tuple(int(v) for v in dims.split(",") if v))
                  for dt, dims in _SHAPE.findall(m.group("result"))]
        if not shapes:
            continue
        if m.group("suffix"):  # async start: the result tuple holds the operand(s) first
            shapes = shapes[len(shapes) // 2:] if len(shapes) > 1 else shapes
        kind = m.group("op")
        args = m.group("args")
        size, groups = _group_size(args)
        dim = re.search(r"dimensions=\{(\d+)\}", args)
        result_bytes = sum(int(np.prod(s, dtype=np.int64)) * _BYTES.get(dt, 4) for dt, s in shapes)
        if kind == "all-gather":
            contributed = result_bytes // max(size, 1)
        elif kind == "reduce-scatter":
            contributed = result_bytes * max(size, 1)
        else:
            contributed = result_bytes
        op = re.search(r'op_name="([^"]*)"', args)
        out.append(Collective(name=m.group("name"), kind=kind, dtype=shapes[0][0],
                              result_shapes=tuple(s for _, s in shapes), group_size=size,
                              groups=groups, dimension=int(dim.group(1)) if dim else None,
                              bytes=int(contributed), op_name=op.group(1) if op else ""))
    return out


def format_collectives(collectives: list[Collective], tokens: int | None = None) -> str:
    """A table of :func:`collective_bytes`' result (bytes per token if ``tokens`` is given)."""
    head = f"{'kind':<19}{'dtype':<6}{'result':<22}{'group':>6}{'bytes/device':>14}"
    head += f"{'bytes/token':>13}" if tokens else ""
    lines = [head + "  op"]
    for c in collectives:
        res = ";".join("x".join(map(str, s)) for s in c.result_shapes)
        line = f"{c.kind:<19}{c.dtype:<6}{res:<22}{c.group_size:>6}{c.bytes:>14}"
        line += f"{c.bytes / tokens:>13.2f}" if tokens else ""
        lines.append(line + "  " + c.op_name.split("/")[-1])
    return "\n".join(lines)


__all__ = ["Collective", "KINDS", "collective_bytes", "format_collectives"]
