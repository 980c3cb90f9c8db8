"""Dependency groups of structured pruning and the physical removal of masked channels.

"Less is More: Unlocking Specialization of Time Series Foundation Models via Structured
Pruning" (arXiv:2505.23195) masks the input and the output channels of every linear layer
independently (sec. 4.1, eq. 4). A masked model is exactly as expensive as the original; this
module turns the masks into a smaller model that computes the same outputs, following the
dependencies between layers:

* **query/key channel pairs**: channel ``c`` of an attention block's queries and keys is used
  only in their product, so it goes from both ``q`` and ``k`` when either output mask removes
  it (a masked channel is exactly zero, with its bias). A head left with no query/key channels
  has constant logits: it attends uniformly (up to a relative-position bias), as the masked
  model does.
* **value/output channel pairs**: channel ``c`` of the values goes from ``v`` (an output) and
  from ``o`` (an input) when either mask removes it. A head left with no value channels
  contributes nothing and disappears with its query/key channels (its original id stays in the
  block's :class:`~lowrank_jax.HeadLayout`, so a shared relative-bias table is read right, and
  the logit scale stays the original ``1/sqrt(d_head)``).
* **MLP hidden channels**: channel ``j`` goes from the input projection(s) (``wi``, or both
  gates ``wi_0``, ``wi_1``) and from ``wo`` when any of their masks removes it (every
  activation maps 0 to 0).
* **empty blocks**: a block may lose every head (it then adds its output projection's bias
  alone) or every hidden channel (``wo``'s bias alone), and a layer both (only the residual
  stream and the norms are left); the head layout keeps no id and the scale stays.
* **residual-width channels** (the inputs of ``q``, ``k``, ``v``, ``wi``; the outputs of ``o``
  and ``wo``; both sides of any other selected weight): the model width and the norms stay, so
  a removed input is a row the leaf no longer reads (gathered away) and a removed output a
  column it no longer computes (written as zero): a
  :class:`~lowrank_jax.leaves.ChannelPruned` leaf.

These dependencies are :class:`~lowrank_jax.compress.prune.groups.PruneGroup` s
(:attr:`Structure.groups`: ``'qk'``, ``'vo'``, ``'hidden'``, and ``'residual'`` for a weight's
own channels), the description the Flax interop builds from its declared channel groups too. A
leaf that can only lose whole heads of outputs (a :class:`~lowrank_jax.HeadLowRank`) makes the
masks of its group act per head (:meth:`Structure.granularity`: the group's unit is the least
common multiple of its weights' granularities). Chronos-Bolt's decoder
attends over a single step: its self-attention queries and keys get exactly zero gradient and
can go (the head then "attends uniformly" over its one key, which changes nothing), while its
values and output projection carry the decoder's input and are scored like any other weight.

The counts of a removal (:meth:`Structure.counts`) are computed from the masks without slicing
arrays (:func:`~lowrank_jax.leaves.kept_counts`), so the pruning schedule can evaluate many
candidate masks; :meth:`Structure.remove` builds the smaller tree, whose counts are the same.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.prune.groups import PruneGroup, Span
from lowrank_jax.errors import PlanError, ShapeError
from lowrank_jax.leaves import (
    HeadLayout,
    QueryKey,
    get_path,
    head_offsets,
    is_leaf,
    is_query_key,
    keep_inputs,
    keep_outputs,
    named_leaves,
    replace_paths,
)
from lowrank_jax.leaves.channel_masked import (
    channel_masks,
    input_granularity,
    is_channel_masked,
    kept_counts,
    output_granularity,
    pruned_leaf,
    surgery_form,
    unmask,
)

#: Names of the weights of an MLP block (``nn.init_mlp``): input projection(s) and output.
MLP_INPUTS = ("wi", "wi_0", "wi_1")


@dataclasses.dataclass
class Member:
    """A weight that pruning touches: selected (masked) or the partner of one in a block."""

    path: str
    leaf: Any          # the unmasked leaf
    count_leaf: Any    # its surgery form (for counts)
    masked: bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.leaf.shape


@dataclasses.dataclass
class Attention:
    """An attention block: member paths and its head structure."""

    path: str
    q: str
    k: str
    v: str
    o: str
    query_key: bool           # qk is a QueryKey: q/k channel pairs can go
    qk_widths: tuple          # per-head query/key widths (QueryKey only)
    heads: HeadLayout
    qk: Any                   # the (unmasked) query-key object


@dataclasses.dataclass
class MLP:
    """An MLP block: its input projection(s) and output projection."""

    path: str
    wi: tuple[str, ...]
    wo: str


@dataclasses.dataclass
class Removal:
    """What physical removal keeps, in original coordinates.

    Fields:
      rows, cols: ``{member path: bool [d_in] / [d_out]}`` kept input and output channels.
      heads: ``{attention path: bool [heads]}`` kept heads.
      qk: ``{attention path: bool [sum(widths)]}`` kept query/key channels (QueryKey blocks).
      vo: ``{attention path: bool [sum(v)]}`` kept value channels.
      hidden: ``{mlp path: bool [d_ff]}`` kept hidden channels.
    """

    rows: dict
    cols: dict
    heads: dict
    qk: dict
    vo: dict
    hidden: dict


def _lcm(values) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def find_blocks(tree: Any) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """``(attention blocks, MLP blocks)`` of a tree, each a list of ``(path, dict)`` in tree
    order. An attention block is a dict with a query-key object ``'qk'``, weights ``'v'``,
    ``'o'`` and a :class:`~lowrank_jax.HeadLayout` ``'heads'``; an MLP block a dict with
    ``'wo'`` and ``'wi'`` (or ``'wi_0'`` and ``'wi_1'``) weights."""
    attn, mlp = [], []

    def walk(node, prefix):
        if isinstance(node, dict):
            if isinstance(node.get("heads"), HeadLayout) and is_query_key(node.get("qk")) \
                    and {"v", "o"} <= set(node):
                attn.append((prefix, node))
                return
            names = [n for n in MLP_INPUTS if is_leaf(node.get(n))]
            if is_leaf(node.get("wo")) and (names == ["wi"] or names == ["wi_0", "wi_1"]):
                mlp.append((prefix, node))
                return
            for k in node:
                walk(node[k], f"{prefix}/{k}" if prefix else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{prefix}/{i}" if prefix else str(i))

    walk(tree, "")
    return attn, mlp


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def attention_with_activation_masks(config: Any) -> list[str]:
    """Names of the attention configs inside ``config`` (a model config dataclass) that use
    fixed Q/K/V activation masks (``AttentionConfig.qkv_keep``)."""
    found = []

    def walk(obj, name):
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            if getattr(obj, "qkv_keep", None) is not None and hasattr(obj, "qkv_mask_seed"):
                found.append(name or type(obj).__name__)
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), _join(name, f.name))

    walk(config, "")
    return found


class Structure:
    """The dependency structure of the masked leaves of a tree (see the module docstring).

    Args:
      tree: a parameter tree whose selected weights are
        :class:`~lowrank_jax.leaves.ChannelMasked` leaves.
      tokens: ``{path: rows}``: input rows each weight sees in one forward pass of one sample
        (:func:`~lowrank_jax.leaves.count_rows`), for FLOP counts; ``None`` counts one row
        per weight and no attention scores.
      config: the model config, to refuse fixed Q/K/V activation masks (they do not compose
        with channel removal inside heads).

    Raises:
      PlanError: a masked leaf that cannot lose channels (a partitioned leaf), or masks on an
        attention block whose config uses fixed activation masks.

    Attributes:
      members: ``{path: Member}`` the masked weights and their block partners, in tree order.
      attention, mlp: the blocks that hold members.
      groups: the :class:`~lowrank_jax.compress.prune.groups.PruneGroup` s: per attention
        block ``'<path>/qk'`` (QueryKey blocks) and ``'<path>/vo'``, per MLP
        ``'<path>/hidden'``, then ``'<weight>/in'`` / ``'<weight>/out'`` (``'residual'``) for
        every member side no block group spans; each span's ``size`` is its unit.
    """

    def __init__(self, tree: Any, *, tokens: dict | None = None, config: Any = None):
        self.masked_paths = [p for p, n in named_leaves(tree) if is_channel_masked(n)]
        if not self.masked_paths:
            raise PlanError("prune: the tree has no masked weights (add channel masks to the "
                            "weights to prune first: add_channel_masks)", where="params")
        self.plain = unmask(tree)
        masked = set(self.masked_paths)
        self.members: dict[str, Member] = {}
        self.attention: list[Attention] = []
        self.mlp: list[MLP] = []
        attn, mlp = find_blocks(self.plain)
        in_blocks = set()
        for path, block in attn:
            names = {"v": _join(path, "v"), "o": _join(path, "o")}
            qk = block["qk"]
            proj = qk.projections()
            is_qk = proj is not None
            if is_qk:
                names["q"], names["k"] = _join(path, "qk/q"), _join(path, "qk/k")
            paths = list(names.values())
            if not any(p in masked for p in paths) and not (
                    not is_qk and any(p.startswith(_join(path, "qk/")) for p in masked)):
                continue
            self.attention.append(Attention(
                path=path, q=names.get("q", ""), k=names.get("k", ""), v=names["v"],
                o=names["o"], query_key=is_qk,
                qk_widths=tuple(proj.widths) if is_qk else (), heads=block["heads"], qk=qk))
            in_blocks.update(paths)
        for path, block in mlp:
            wi = tuple(_join(path, n) for n in MLP_INPUTS if n in block)
            wo = _join(path, "wo")
            if not any(p in masked for p in (*wi, wo)):
                continue
            self.mlp.append(MLP(path=path, wi=wi, wo=wo))
            in_blocks.update((*wi, wo))
        leaves = dict(named_leaves(self.plain))
        for p in sorted(in_blocks | masked, key=list(leaves).index):
            leaf = leaves[p]
            self.members[p] = Member(path=p, leaf=leaf, count_leaf=None, masked=p in masked)
        self.groups = self._build_groups()
        self._sizes = {(sp.path, sp.side): sp.size for g in self.groups for sp in g.spans}
        for m, form in zip(self.members.values(), _surgery_forms([m.leaf for m in
                                                                   self.members.values()]),
                           strict=True):
            m.count_leaf = form
        if config is not None and any(self.members[p].masked for a in self.attention
                                      for p in (a.q, a.k, a.v, a.o) if p):
            names = attention_with_activation_masks(config)
            if names:
                raise PlanError(
                    "prune: fixed Q/K/V activation masks (AttentionConfig.qkv_keep, in "
                    f"{', '.join(names)}) are drawn over a block's current head width, so they "
                    "do not compose with removing channels inside heads; prune the MLPs only "
                    "(rules like 'mlp/') or use a model without activation masks",
                    where="config", expected="qkv_keep=None", actual=names)
        self.tokens = {p: 1 for p in self.members} if tokens is None else {
            p: int(tokens.get(p, 0)) for p in self.members}
        self.score_tokens = tokens is not None
        full = self.full_removal()
        self.total_params, self.total_flops = self.counts(full)

    # -- structure --------------------------------------------------------------------------

    def _build_groups(self) -> list[PruneGroup]:
        own = {}  # (path, side): channels the leaf can lose at a time
        for m in self.members.values():
            gi, go = input_granularity(m.leaf), output_granularity(m.leaf)
            if m.masked and (gi is None or go is None):
                raise PlanError(f"prune: {m.path} is a {type(m.leaf).__name__}, which cannot "
                                "lose single channels; leave it out of the rules",
                                where=m.path, expected="a prunable weight leaf",
                                actual=type(m.leaf).__name__)
            own[m.path, "in"], own[m.path, "out"] = gi or 1, go or 1

        def tied(block: str, kind: str, sides: list[tuple[str, str]]) -> PruneGroup:
            g = _lcm(own[side] for side in sides)
            path, side = sides[0]
            d = self.members[path].shape[0 if side == "in" else 1]
            group = PruneGroup(_join(block, kind), tuple(Span(p, s, g) for p, s in sides),
                               d // g, kind)
            self._tied[block, kind] = group
            return group

        self._tied: dict[tuple[str, str], PruneGroup] = {}
        groups = []
        for a in self.attention:
            if a.query_key:
                groups.append(tied(a.path, "qk", [(a.q, "out"), (a.k, "out")]))
                g = groups[-1].spans[0].size
                if any(w % g for w in a.qk_widths):
                    raise PlanError(f"prune: {a.path}: query/key outputs can only go {g} at a "
                                    f"time, which does not divide the head widths "
                                    f"{a.qk_widths}", where=a.path)
            groups.append(tied(a.path, "vo", [(a.v, "out"), (a.o, "in")]))
            g = groups[-1].spans[0].size
            if any(w % g for w in a.heads.v):
                raise PlanError(f"prune: {a.path}: value channels can only go {g} at a time, "
                                f"which does not divide the value widths {a.heads.v}",
                                where=a.path)
        for b in self.mlp:
            groups.append(tied(b.path, "hidden", [(p, "out") for p in b.wi] + [(b.wo, "in")]))
        spanned = {(sp.path, sp.side) for g in groups for sp in g.spans}
        for m in self.members.values():
            for side, d in zip(("in", "out"), m.shape, strict=True):
                if (m.path, side) not in spanned:
                    g = own[m.path, side]
                    groups.append(PruneGroup(f"{m.path}/{side}", (Span(m.path, side, g),),
                                             d // g, "residual"))
        return groups

    def granularity(self, path: str) -> tuple[int, int]:
        """``(input, output)`` channels per pruning unit of the weight at ``path``: 1, or a
        whole head where a leaf of the group can only lose heads."""
        return self._sizes[path, "in"], self._sizes[path, "out"]

    # -- removal ----------------------------------------------------------------------------

    def full_removal(self) -> Removal:
        """The removal that keeps everything."""
        return self.removal({})

    def removal(self, keep: dict[str, tuple[np.ndarray, np.ndarray]]) -> Removal:
        """What physical removal keeps, given the masks.

        Args:
          keep: ``{path: (bool [d_in], bool [d_out])}`` kept channels of masked weights (a
            weight not listed keeps everything).

        Returns:
          A :class:`Removal`.
        """
        rows, cols = {}, {}
        for p, m in self.members.items():
            r, c = keep.get(p, (None, None))
            rows[p] = np.ones(m.shape[0], bool) if r is None else np.asarray(r, bool).copy()
            cols[p] = np.ones(m.shape[1], bool) if c is None else np.asarray(c, bool).copy()
        shared = {key: _shared_channels(g, rows, cols) for key, g in self._tied.items()}
        heads, qk, vo = {}, {}, {}
        for a in self.attention:
            v_keep = shared[a.path, "vo"]
            off = head_offsets(a.heads.v)
            v_width = np.array([v_keep[off[h]:off[h + 1]].sum() for h in range(len(a.heads.v))])
            h_keep = v_width > 0
            heads[a.path], vo[a.path] = h_keep, v_keep
            if a.query_key:  # a head with no value channels loses its query/key channels
                c = shared[a.path, "qk"] & np.repeat(h_keep, a.qk_widths)
                qk[a.path] = c
                cols[a.q], cols[a.k] = c.copy(), c.copy()
        hidden = {b.path: shared[b.path, "hidden"] for b in self.mlp}
        for p in self.members:  # a leaf with no outputs reads nothing
            if not cols[p].any():
                rows[p][:] = False
        return Removal(rows=rows, cols=cols, heads=heads, qk=qk, vo=vo, hidden=hidden)

    def counts(self, removal: Removal) -> tuple[int, int]:
        """``(parameters, multiply-adds per sample)`` of the members after ``removal``: the
        weights' own counts (:func:`~lowrank_jax.leaves.kept_counts`, with the rows each weight
        sees) plus, with token counts, the attention score products of the blocks (``q k^T``
        and the weighted values, executed padded to the widest head, as
        :func:`lowrank_jax.nn.attention_score_flops` counts them)."""
        params = flops = 0
        for p, m in self.members.items():
            a, f = kept_counts(m.count_leaf, removal.rows[p], removal.cols[p], self.tokens[p])
            params += a
            flops += f
        if self.score_tokens:
            for a in self.attention:
                flops += self._score_flops(a, removal)
        return int(params), int(flops)

    def _score_flops(self, a: Attention, removal: Removal) -> int:
        q_len = self.tokens.get(a.q) or self.tokens.get(a.v, 0)
        k_len = self.tokens.get(a.k) or self.tokens.get(a.v, 0)
        hk = removal.heads[a.path]
        n = int(hk.sum())
        if not n:
            return 0
        off = head_offsets(a.heads.v)
        vw = max(int(removal.vo[a.path][off[h]:off[h + 1]].sum()) for h in np.flatnonzero(hk))
        if a.query_key:
            qo = head_offsets(a.qk_widths)
            qw = max(int(removal.qk[a.path][qo[h]:qo[h + 1]].sum()) for h in np.flatnonzero(hk))
            scores = q_len * k_len * n * qw
        else:
            scores = a.qk.keep_heads(np.flatnonzero(hk)).score_flops(q_len, k_len)
        return int(scores + q_len * k_len * n * vw)

    def fractions(self, removal: Removal) -> tuple[float, float]:
        """Removed fraction of the members' parameters and FLOPs."""
        p, f = self.counts(removal)
        return (1.0 - p / self.total_params if self.total_params else 0.0,
                1.0 - f / self.total_flops if self.total_flops else 0.0)

    def removal_from_tree(self, tree: Any) -> Removal:
        """The removal given by the current masks of ``tree`` (a channel is removed where its
        mask is 0)."""
        keep = {p: (m_in != 0, m_out != 0) for p, (m_in, m_out) in channel_masks(tree).items()
                if p in self.members}
        return self.removal(keep)

    # -- physical removal -------------------------------------------------------------------

    def remove(self, removal: Removal) -> Any:
        """The smaller tree (built from the unmasked tree on the host, returned as device
        arrays): blocks lose heads and channels, residual-width channels become
        :class:`~lowrank_jax.leaves.ChannelPruned` leaves. It computes what the masked tree
        with ``removal``'s masks computes (to float32 round-off)."""
        host = jax.tree_util.tree_map(np.asarray, self.plain)
        leaves = dict(named_leaves(host))
        new: dict[str, Any] = {}
        done = set()
        for a in self.attention:
            block = get_path(host, a.path)
            hk = np.flatnonzero(removal.heads[a.path])
            v_idx = np.flatnonzero(removal.vo[a.path])
            off = head_offsets(a.heads.v)
            v_widths = tuple(int(removal.vo[a.path][off[h]:off[h + 1]].sum()) for h in hk)
            layout = HeadLayout(ids=tuple(a.heads.ids[h] for h in hk), v=v_widths,
                                scale=a.heads.scale)
            v = self._restrict(leaves[a.v], removal.rows[a.v], removal.cols[a.v], scatter=False,
                               path=a.v)
            o = self._restrict(leaves[a.o], removal.rows[a.o], removal.cols[a.o], gather=False,
                               path=a.o)
            if a.query_key:
                qo = head_offsets(a.qk_widths)
                widths = tuple(int(removal.qk[a.path][qo[h]:qo[h + 1]].sum()) for h in hk)
                q = self._restrict(leaves[a.q], removal.rows[a.q], removal.cols[a.q],
                                   scatter=False, path=a.q)
                k = self._restrict(leaves[a.k], removal.rows[a.k], removal.cols[a.k],
                                   scatter=False, path=a.k)
                qk = QueryKey(q=q, k=k, widths=widths)
                done.update((a.q, a.k))
            else:
                qk = block["qk"]
                if hk.size != len(a.heads.ids):
                    qk = qk.keep_heads(hk)
                qk = self._generic_qk(a.path, qk, removal)
            if v.d_out != v_idx.size or o.d_in != v_idx.size:  # cannot happen: say so if it does
                raise ShapeError(f"prune: {a.path}: value/output widths {v.d_out}/{o.d_in} after "
                                 f"removal, expected {v_idx.size}", where=a.path)
            new[a.path] = {**block, "qk": qk, "v": v, "o": o, "heads": layout}
            done.update((a.v, a.o))
        for b in self.mlp:
            for p in b.wi:
                new[p] = self._restrict(leaves[p], removal.rows[p], removal.cols[p],
                                        scatter=False, path=p)
            new[b.wo] = self._restrict(leaves[b.wo], removal.rows[b.wo], removal.cols[b.wo],
                                       gather=False, path=b.wo)
            done.update((*b.wi, b.wo))
        for p in self.members:
            if p not in done and not any(p.startswith(a.path + "/qk/") for a in self.attention
                                         if not a.query_key):
                new[p] = self._restrict(leaves[p], removal.rows[p], removal.cols[p],
                                        path=p)
        out = replace_paths(host, new)
        return jax.tree_util.tree_map(jnp.asarray, out)

    def _generic_qk(self, path: str, qk: Any, removal: Removal) -> Any:
        """A non-QueryKey query-key object: its masked inner weights lose rows and columns in
        place (gather/scatter), since their outputs are not per-head channels."""
        repl = {}
        for p in self.members:
            if p.startswith(path + "/qk/"):
                name = p[len(path) + 4:]
                repl[name] = self._restrict(get_path(qk, name), removal.rows[p],
                                            removal.cols[p])
        return replace_paths(qk, repl) if repl else qk

    def _restrict(self, leaf: Any, rows: np.ndarray, cols: np.ndarray, *, gather: bool = True,
                  scatter: bool = True, path: str | None = None) -> Any:
        """``leaf`` on the kept channels. Kept rows are gathered from the full input width
        (``gather``) or the leaf's input simply shrinks (the previous layer shrank too); kept
        columns are scattered into the full output width (``scatter``) or the output shrinks.
        With the member ``path``, its surgery form (computed once, when the structure is built)
        is sliced instead of the leaf when channels go: the same result without computing the
        form again. A leaf that keeps everything stays as it is."""
        d_in, d_out = leaf.shape
        r, c = np.flatnonzero(rows), np.flatnonzero(cols)
        base = leaf
        if path is not None and (r.size != d_in or c.size != d_out):
            base = jax.tree_util.tree_map(np.asarray, self.members[path].count_leaf)
        if r.size != d_in:
            base = keep_inputs(base, r)
        if c.size != d_out:
            base = keep_outputs(base, c)
        if base is leaf:
            return leaf
        return pruned_leaf(base, r if gather else None, c if scatter else None,
                           d_in if gather else base.d_in, d_out if scatter else base.d_out)


def _shared_channels(group: PruneGroup, rows: dict, cols: dict) -> np.ndarray:
    """Channel ``c`` of a block's group goes from every weight it spans when any of their masks
    removes it: the channels all spans keep, written back to each span (as copies)."""
    sides = [(rows if sp.side == "in" else cols, sp.path) for sp in group.spans]
    keep = np.logical_and.reduce([kept[p] for kept, p in sides])
    for kept, p in sides:
        kept[p] = keep.copy()
    return keep


_compiled_forms = jax.jit(lambda leaves: [surgery_form(leaf) for leaf in leaves])


def _surgery_forms(leaves: list) -> list:
    """:func:`~lowrank_jax.leaves.channel_masked.surgery_form` of every leaf; the leaves whose
    form is computed (a MaskedBinary is frozen: a top-k selection) go through one compiled
    program instead of one eager program per leaf (24 binary weights of a small SBT: seconds
    instead of a minute)."""
    plain = surgery_form.dispatch(object)
    todo = [i for i, leaf in enumerate(leaves) if surgery_form.dispatch(type(leaf)) is not plain]
    out = list(leaves)
    if todo:
        for i, form in zip(todo, _compiled_forms([leaves[i] for i in todo]), strict=True):
            out[i] = form
    return out


def check_removal(struct: Structure, removal: Removal, pruned: Any) -> None:
    """Check that the counts of ``removal`` equal the leaves' own counts in ``pruned`` (the
    schedule's accounting and the built tree agree).

    Raises:
      ShapeError: naming the first weight whose count differs.
    """
    for p in struct.members:
        try:
            node = get_path(pruned, p)
        except (KeyError, AttributeError, IndexError):
            continue
        m = struct.members[p]
        want, _ = kept_counts(m.count_leaf, removal.rows[p], removal.cols[p], 1)
        if node.param_count() != want:
            raise ShapeError(f"prune: {p} has {node.param_count()} parameters after removal but "
                             f"the removal plan counts {want}", where=p, expected=want,
                             actual=node.param_count())


__all__ = ["Attention", "MLP", "MLP_INPUTS", "Member", "Removal", "Structure",
           "attention_with_activation_masks", "check_removal", "find_blocks"]
