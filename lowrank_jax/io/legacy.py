"""Readers for older checkpoint formats.

Format version 1 (lowrank_jax 0.1) differs from version 2 in three ways:

* skeleton nodes of weight leaves are ``{"type": "leaf", "class": short name, "qualname":
  "module.QualName", "data", "static"}`` (version 2: ``"type": "node"`` with the qualified
  name in ``"class"``, for every registered node class);
* stored arrays carry no checksum;
* an attention block is a dict of four weight leaves ``{'q', 'k', 'v', 'o'}``. Since 0.2 it is
  ``{'qk': QueryKey(q, k, widths), 'v', 'o', 'heads': HeadLayout(ids, v, scale)}``: the head
  structure is static data in the tree.

Configs were stored as ``'module:QualName'`` (``'lowrank_jax.models.t5:T5Config'``); their
fields are unchanged, and :func:`lowrank_jax.io.config_from_dict` reads both spellings.

:func:`upgrade_model_tree` upgrades the attention blocks of a model checkpoint from the head
structure its model family builds for its config; :func:`upgrade_attention` does it for a bare
parameter tree given the number of heads.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from lowrank_jax.errors import CheckpointError, ShapeError
from lowrank_jax.leaves import HeadLayout, QueryKey, get_path, is_leaf, named_leaves, replace_paths
from lowrank_jax.models import family_of

#: Keys of a lowrank_jax 0.1 attention block.
V1_ATTENTION_KEYS = frozenset({"q", "k", "v", "o"})


def skeleton_from_v1(spec: Any) -> Any:
    """A version 1 skeleton in the version 2 form (without checksums).

    Malformed parts are passed through unchanged, so that the validator reports them with
    their path.

    Args:
      spec: the ``tree`` object of a version 1 ``tree.json``.

    Returns:
      The same skeleton with ``"leaf"`` nodes as ``"node"`` nodes.
    """
    if not isinstance(spec, dict):
        return spec
    t = spec.get("type")
    if t == "leaf":
        name = spec.get("qualname") if isinstance(spec.get("qualname"), str) else spec.get("class")
        data = spec.get("data")
        if isinstance(data, dict):
            data = {k: skeleton_from_v1(v) for k, v in data.items()}
        static = spec.get("static")
        if isinstance(name, str) and name.endswith("MaskedBinary") and isinstance(static, dict):
            # 0.1 divided Biprop's alpha by the number of kept entries; keep its outputs
            static = {**static, "divisor": "kept"}
        return {"type": "node", "class": name, "data": data, "static": static}
    if t in ("dict", "list", "tuple") and isinstance(spec.get("items"), list):
        if t == "dict":
            items = [[it[0], skeleton_from_v1(it[1])] if isinstance(it, list) and len(it) == 2
                     else it for it in spec["items"]]
        else:
            items = [skeleton_from_v1(it) for it in spec["items"]]
        return dict(spec, items=items)
    return spec


def _is_weight(x: Any) -> bool:
    return is_leaf(x) or (isinstance(x, (jax.Array, np.ndarray)) and np.ndim(x) == 2)


def _is_v1_block(x: Any) -> bool:
    return (type(x) is dict and set(x) == V1_ATTENTION_KEYS
            and all(_is_weight(v) for v in x.values()))


def find_v1_attention(tree: Any) -> list[str]:
    """Paths of the lowrank_jax 0.1 attention blocks (``{'q', 'k', 'v', 'o'}`` dicts of weights)
    in ``tree``, in traversal order.

    Args:
      tree: a parameter tree.

    Returns:
      ``['encoder/layers/0/attn', ...]`` (``''`` when ``tree`` itself is one).
    """
    out: list[str] = []

    def walk(node, path):
        if _is_v1_block(node):
            out.append(path)
        elif type(node) is dict:
            for k, v in node.items():
                walk(v, f"{path}/{k}" if path else str(k))
        elif type(node) in (list, tuple):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}" if path else str(i))

    walk(tree, "")
    return out


def _width(w: Any) -> int:
    return int(w.shape[1])  # Leaf.shape and array shapes are both (d_in, d_out)


def upgrade_attention(tree: Any, num_heads: int, *, scaled: bool = True) -> Any:
    """Upgrade the lowrank_jax 0.1 attention blocks of a parameter tree to the current layout.

    Every ``{'q', 'k', 'v', 'o'}`` dict of weights becomes ``{'qk': QueryKey(q, k, widths),
    'v', 'o', 'heads': HeadLayout}`` with ``num_heads`` heads of equal width; the weight leaves
    (dense or compressed) are kept as they are. Use this for a bare parameter tree saved by
    lowrank_jax 0.1; :func:`lowrank_jax.io.load_model` upgrades model checkpoints by itself.

    Args:
      tree: a parameter tree (not modified).
      num_heads: heads of every attention block (0.1 models had one head count per model).
      scaled: attention logits are scaled by ``1/sqrt(d_head)`` (ViT, BERT, the patch encoder);
        ``False`` for T5 and Chronos, whose attention is unscaled.

    Returns:
      A new tree.

    Raises:
      ShapeError: ``num_heads`` does not divide a block's query/key or value width.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ShapeError(f"upgrade_attention: num_heads must be a positive int, got {num_heads!r}",
                         where="num_heads", expected="int >= 1", actual=num_heads)
    new = {}
    for path in find_v1_attention(tree):
        block = get_path(tree, path)
        d_qk, d_v = _width(block["q"]), _width(block["v"])
        if d_qk % num_heads or d_v % num_heads or _width(block["k"]) != d_qk:
            raise ShapeError(
                f"upgrade_attention: at '{path}', num_heads={num_heads} does not divide the "
                f"query/key width {d_qk} (k: {_width(block['k'])}) and value width {d_v}",
                where=path, expected=f"widths divisible by {num_heads}", actual=(d_qk, d_v))
        d_head = d_qk // num_heads
        new[path] = {
            "qk": QueryKey(q=block["q"], k=block["k"], widths=(d_head,) * num_heads),
            "v": block["v"], "o": block["o"],
            "heads": HeadLayout.uniform(num_heads, d_v // num_heads,
                                        1.0 / math.sqrt(d_head) if scaled else 1.0),
        }
    return replace_paths(tree, new)


def upgrade_model_tree(tree: Any, config: Any, source: str) -> Any:
    """Upgrade a version 1 model tree using the structure its family builds for ``config``.

    The family's ``init`` is traced (``jax.eval_shape``, nothing is computed) to get the
    current tree; at every 0.1 attention block the static parts of that tree (the query-key
    object's per-head widths, the :class:`~lowrank_jax.HeadLayout`'s ids, value widths and
    scale) are reused and the stored weight leaves, dense or compressed, put in place.

    Args:
      tree: the parameter tree read from a version 1 model checkpoint.
      config: its model config.
      source: the checkpoint's ``tree.json``, for messages.

    Returns:
      The upgraded tree.

    Raises:
      CheckpointError: the stored tree does not fit the model its config describes (missing or
        unexpected weights, or weights of other shapes).
    """
    family = family_of(config)
    abstract = jax.eval_shape(lambda: family.init(jax.random.PRNGKey(0), config))
    new = {}
    for path in find_v1_attention(tree):
        try:
            target = get_path(abstract, path)
        except (KeyError, IndexError, ValueError, AttributeError):
            target = None
        if type(target) is not dict or not {"qk", "v", "o", "heads"} <= set(target):
            raise CheckpointError(source, message=(
                f"load_model: {source} holds a 0.1 attention block at '{path}', but a "
                f"{family.name} model with its config has no attention block there"))
        block = get_path(tree, path)
        try:
            new[path] = replace_paths(target, {"qk/q": block["q"], "qk/k": block["k"],
                                               "v": block["v"], "o": block["o"]})
        except (ShapeError, ValueError) as e:
            raise CheckpointError(source, message=(
                f"load_model: the attention block at '{path}' in {source} does not fit the "
                f"{family.name} model of its config: {e}")) from e
    upgraded = replace_paths(tree, new)
    want = {p: tuple(x.shape) for p, x in named_leaves(abstract)}
    have = {p: tuple(x.shape) for p, x in named_leaves(upgraded)}
    missing = {p: s for p, s in want.items() if p not in have}
    unexpected = {p: s for p, s in have.items() if p not in want}
    mismatched = {p: (want[p], s) for p, s in have.items() if p in want and want[p] != s}
    if missing or unexpected or mismatched:
        raise CheckpointError(source, missing=missing, unexpected=unexpected,
                              mismatched=mismatched, message=(
                                  f"load_model: the 0.1 parameter tree in {source} does not "
                                  f"match the {family.name} model of its config:"))
    return upgraded


__all__ = ["V1_ATTENTION_KEYS", "find_v1_attention", "skeleton_from_v1", "upgrade_attention",
           "upgrade_model_tree"]
