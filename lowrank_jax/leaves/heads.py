"""Head structure of an attention block: which heads it keeps, their widths, its logit scale.

A ``[d, h * d_head]`` projection cannot tell ``h`` from ``d_head``, and after structured pruning
or per-head truncation every head may have its own width. So an attention block's parameters
carry a static :class:`HeadLayout` (values side) next to its query-key object (which knows its
own per-head query/key widths), and :func:`split_heads` / :func:`merge_heads` move between the
concatenated ``[..., sum(widths)]`` layout of the projections and a padded ``[..., h, max(w)]``
layout for the per-head products.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ShapeError
from lowrank_jax.leaves.base import leaf_dataclass

Array = jax.Array


def as_int_tuple(x, what: str) -> tuple[int, ...]:
    """``x`` as a tuple of ints >= 0 (a :class:`~lowrank_jax.errors.ShapeError` naming ``what``
    otherwise)."""
    try:
        out = tuple(int(v) for v in x)
    except TypeError:
        raise ShapeError(f"HeadLayout: {what} must be a sequence of ints, got {x!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in x) or any(
            v < 0 for v in out):
        raise ShapeError(f"HeadLayout: {what} must hold ints >= 0, got {x!r}")
    return out


class HeadLayout:
    """Static head layout of an attention block (a pytree node with no array children).

    Fields:
      ids: original index of every head the block keeps, in order. Head ``i`` of a block that
        kept ``ids`` reads column ``ids[i]`` of a relative-position-bias table shared by the
        stack, and of any per-head mask or bias passed to the block.
      v: value width of every head (``sum(v)`` is the value projection's output width and the
        output projection's input width). Pruning and per-head truncation of
        ``W^V_h (W^O_h)^T`` make them differ between heads.
      scale: the logit multiplier, fixed when the block is created: ``1/sqrt(d_head)`` of the
        *original* head width for scaled attention (it stays when heads or channels are
        removed), ``1.0`` for unscaled attention (T5).
    """

    ids: tuple[int, ...]
    v: tuple[int, ...]
    scale: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "ids", as_int_tuple(self.ids, "ids"))
        object.__setattr__(self, "v", as_int_tuple(self.v, "v"))
        object.__setattr__(self, "scale", float(self.scale))
        if len(self.ids) != len(self.v):
            raise ShapeError(f"HeadLayout: ids has {len(self.ids)} heads but v has "
                             f"{len(self.v)} widths", expected=len(self.ids), actual=len(self.v))
        if len(set(self.ids)) != len(self.ids):
            raise ShapeError(f"HeadLayout: ids must be distinct, got {self.ids}")

    @classmethod
    def uniform(cls, num_heads: int, d_v: int, scale: float = 1.0) -> "HeadLayout":
        """``num_heads`` heads ``0..h-1``, each of value width ``d_v``."""
        return cls(ids=tuple(range(num_heads)), v=(int(d_v),) * int(num_heads), scale=scale)

    @property
    def num_heads(self) -> int:
        return len(self.ids)

    @property
    def d_v(self) -> int:
        """``sum(v)``: the width of the value projection's output."""
        return int(sum(self.v))

    def keep(self, heads) -> "HeadLayout":
        """The layout of the heads at positions ``heads`` (positions in this layout)."""
        heads = [int(h) for h in heads]
        if any(b <= a for a, b in zip(heads, heads[1:], strict=False)) or (heads and (
                heads[0] < 0 or heads[-1] >= self.num_heads)):
            raise ShapeError(f"HeadLayout.keep: head positions must be sorted, distinct and in "
                             f"[0, {self.num_heads}), got {heads}", where="heads",
                             expected=f"[0, {self.num_heads})", actual=heads)
        return HeadLayout(ids=tuple(self.ids[h] for h in heads),
                          v=tuple(self.v[h] for h in heads), scale=self.scale)

    def __repr__(self) -> str:
        v = f"{self.v[0]}x{len(self.v)}" if len(set(self.v)) == 1 and self.v else str(self.v)
        return f"HeadLayout(heads={self.num_heads}, ids={self.ids}, v={v}, scale={self.scale:g})"


HeadLayout = leaf_dataclass(HeadLayout, meta=("ids", "v", "scale"))


def head_offsets(widths: tuple[int, ...]) -> np.ndarray:
    """Start of every head in the concatenated layout, plus the total: ``[h + 1]``."""
    return np.concatenate([[0], np.cumsum(widths, dtype=np.int64)])


@functools.lru_cache(maxsize=256)
def _split_index(widths: tuple[int, ...]) -> np.ndarray:
    total, w_max = int(sum(widths)), max(widths, default=0)
    idx = np.full((len(widths), w_max), total, np.int64)  # ``total``: an appended zero column
    off = head_offsets(widths)
    for h, w in enumerate(widths):
        idx[h, :w] = np.arange(off[h], off[h] + w)
    return idx


@functools.lru_cache(maxsize=256)
def _merge_index(widths: tuple[int, ...]) -> np.ndarray:
    w_max = max(widths, default=0)
    return np.concatenate([h * w_max + np.arange(w, dtype=np.int64)
                           for h, w in enumerate(widths)] or [np.zeros(0, np.int64)])


def is_uniform(widths: tuple[int, ...]) -> bool:
    """Whether every head has the same width (no heads or one head count as uniform)."""
    return len(set(widths)) <= 1


def split_heads(y: Array, widths: tuple[int, ...]) -> Array:
    """``[..., sum(widths)] -> [..., h, max(widths)]``, zero-padded per head.

    Uniform widths are a reshape; irregular ones a static gather (padding entries read an
    appended zero column, so they are exactly zero and receive no gradient).
    """
    widths = tuple(int(w) for w in widths)
    if y.shape[-1] != sum(widths):
        raise ShapeError(f"split_heads: expected {sum(widths)} features (head widths {widths}), "
                         f"got {y.shape[-1]}", expected=sum(widths), actual=y.shape[-1])
    h = len(widths)
    if is_uniform(widths):
        w = widths[0] if widths else 0
        return y.reshape(*y.shape[:-1], h, w)
    pad = jnp.zeros((*y.shape[:-1], 1), y.dtype)
    return jnp.concatenate([y, pad], axis=-1)[..., _split_index(widths)]


def merge_heads(y: Array, widths: tuple[int, ...]) -> Array:
    """Inverse of :func:`split_heads`: ``[..., h, max(widths)] -> [..., sum(widths)]``."""
    widths = tuple(int(w) for w in widths)
    h = len(widths)
    flat = y.reshape(*y.shape[:-2], h * y.shape[-1])
    if is_uniform(widths):
        return flat
    return flat[..., _merge_index(widths)]


__all__ = ["HeadLayout", "as_int_tuple", "head_offsets", "is_uniform", "merge_heads", "split_heads"]
