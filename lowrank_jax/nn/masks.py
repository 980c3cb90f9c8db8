"""Attention masks: padding, causal, step-T ("Sparse Binary Transformers", Fig. 2) and fixed Q/K/V
activation masks.

Boolean attention masks follow one convention everywhere in :mod:`lowrank_jax.nn`: ``True`` means
"may attend", and a mask is 4-D, broadcastable to ``[batch, heads, q_len, k_len]``. Masks are
combined with :func:`combine_masks` (logical AND) and consumed by
:func:`lowrank_jax.nn.apply_attention`.

The fixed Q/K/V activation masks of "Sparse Binary Transformers for Multivariate Time Series
Modeling", sec. 3.3.1, are not attention masks: they are 0/1
float masks multiplied onto the projected queries, keys and values.
"""

from __future__ import annotations

import decimal
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError

Array = jax.Array


def padding_mask(valid: Array) -> Array:
    """Key-padding mask from per-token validity.

    Args:
      valid: ``[batch, k_len]``, true (or non-zero) for real tokens, false for padding.

    Returns:
      ``bool[batch, 1, 1, k_len]``: every query may attend every valid key.
    """
    valid = jnp.asarray(valid)
    if valid.ndim != 2:
        raise ShapeError(
            f"padding_mask: valid must be 2-D [batch, k_len], got shape {tuple(valid.shape)}"
        )
    return valid.astype(bool)[:, None, None, :]  # [batch, 1, 1, k_len]


def causal_mask(q_len: int, k_len: int | None = None) -> Array:
    """Causal (autoregressive) mask.

    Query ``i`` sees key ``j`` iff ``j <= i + k_len - q_len``: queries are aligned to the *end*
    of the keys, so ``q_len < k_len`` (new tokens after a prefix) is causal too.

    Args:
      q_len: number of queries.
      k_len: number of keys (default ``q_len``).

    Returns:
      ``bool[1, 1, q_len, k_len]``.
    """
    k_len = q_len if k_len is None else k_len
    if q_len < 1 or k_len < 1:
        raise ConfigError(f"causal_mask: q_len and k_len must be >= 1, got {q_len} and {k_len}")
    q = np.arange(q_len)[:, None]
    k = np.arange(k_len)[None, :]
    return jnp.asarray(k <= q + (k_len - q_len))[None, None]  # [1, 1, q_len, k_len]


def step_t_mask(w: int) -> Array:
    """Step-T attention mask of "Sparse Binary Transformers", sec. 3.3.2 and Fig. 2 (right).

    Only the last time step ``t = w - 1`` does real attention: it attends every earlier step but
    not itself (forcing the prediction to use history). Every earlier step attends only itself
    (the "diagonal ones ... added to the attention mask at all past time points to add
    stability to training").

    Args:
      w: window length (number of time steps), at least 2.

    Returns:
      ``bool[1, 1, w, w]``.
    """
    if w < 2:
        raise ConfigError(f"step_t_mask: window length w must be >= 2, got {w}")
    m = np.eye(w, dtype=bool)
    m[w - 1, :] = True
    m[w - 1, w - 1] = False
    return jnp.asarray(m)[None, None]  # [1, 1, w, w]


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the non-``None`` masks (broadcasting), or ``None`` if all are ``None``."""
    present = [jnp.asarray(m) for m in masks if m is not None]
    if not present:
        return None
    for m in present:
        if m.dtype != jnp.bool_:
            raise ShapeError(f"combine_masks: masks must be boolean, got dtype {m.dtype}")
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


# ---------------------------------------------------------------------------------------------
# Fixed Q/K/V activation masks ("Sparse Binary Transformers", sec. 3.3.1).

def activation_keep_count(n: int, keep: float) -> int:
    """Entries kept out of ``n`` by a fixed activation mask with keep fraction ``keep``.

    ``round_half_up(keep * n)``, evaluated on the decimal value of ``keep`` as written
    (``Decimal(repr(keep))``), so ``keep=0.15, n=10`` keeps 2 and is not at the mercy of binary
    floating point. Note this differs from :func:`lowrank_jax.leaves.keep_count`, which rounds
    as the Biprop weight-mask code does.
    """
    if not 0.0 < keep <= 1.0:
        raise ConfigError(f"activation_keep_count: keep must be in (0, 1], got {keep!r}")
    exact = decimal.Decimal(repr(float(keep))) * n
    return int(exact.quantize(decimal.Decimal(1), rounding=decimal.ROUND_HALF_UP))


def _random_bits(key: Array, n: int) -> np.ndarray:
    """``n`` uint32 random words from ``key``: chunk ``i`` is ``bits(fold_in(key, i))``.

    Drawn in chunks of 4096 words (one compiled sampler for all sizes); the chunk size is part
    of the masks' definition (another size draws other masks), not a setting."""
    chunk = 4096
    chunks = [
        np.asarray(jax.random.bits(jax.random.fold_in(key, i), (chunk,), jnp.uint32))
        for i in range(-(-n // chunk))
    ]
    return np.concatenate(chunks)[:n]


@functools.lru_cache(maxsize=512)
def _qkv_masks_np(seed: int, seq_len: int, d_head: int, keep: float) -> tuple[np.ndarray, ...]:
    n = seq_len * d_head
    n_keep = activation_keep_count(n, keep)
    out = []
    # Computed eagerly even when called while tracing: the masks are constants of the program.
    with jax.ensure_compile_time_eval():
        keys = jax.random.split(jax.random.PRNGKey(seed), 3)
        for k in keys:
            # A uniformly random n_keep-subset: the positions of the n_keep smallest random
            # words (stable sort, so rare ties are broken by position, deterministically).
            idx = np.argsort(_random_bits(k, n), kind="stable")[:n_keep]
            m = np.zeros((n,), np.float32)
            m[idx] = 1.0
            m = m.reshape(seq_len, d_head)
            m.setflags(write=False)
            out.append(m)
    return tuple(out)


def qkv_activation_masks(seed: int, seq_len: int, d_head: int,
                         keep: float) -> dict[str, np.ndarray]:
    """Random fixed masks for the Q, K and V activations ("Sparse Binary Transformers", sec. 3.3.1).

    One mask per projection over the ``[seq_len, d_head]`` activation of a head; every head of
    the attention module gets the same mask ("attention heads within the same module inherit
    identical Q, K, or V masks"). The masks are drawn once, deterministically from ``seed``
    with ``jax.random``, and applied in training and at test time. Each mask has exactly
    :func:`activation_keep_count` ``(seq_len * d_head, keep)`` ones at uniformly random
    positions (the paper's prune rate is ``p_a = 1 - keep``).

    They are constants, never parameters: they are not in the params tree and get no gradient.
    They are returned as read-only NumPy arrays (cached per argument tuple), so that even when
    called while tracing under ``jit`` they are concrete compile-time constants.

    Args:
      seed: static integer seed (attention uses ``cfg.qkv_mask_seed + layer_index``).
      seq_len: sequence length of the activation.
      d_head: head dimension.
      keep: fraction of entries kept, in ``(0, 1]``.

    Returns:
      ``{'q', 'k', 'v'}``, each a read-only ``np.ndarray`` ``float32[seq_len, d_head]`` of 0/1.
    """
    for name, val in (("seed", seed), ("seq_len", seq_len), ("d_head", d_head)):
        if not isinstance(val, (int, np.integer)):
            raise ConfigError(f"qkv_activation_masks: {name} must be a static int, got {val!r}")
    if seq_len < 1 or d_head < 1:
        raise ConfigError(
            f"qkv_activation_masks: seq_len and d_head must be >= 1, got {seq_len} and {d_head}"
        )
    masks = _qkv_masks_np(int(seed), int(seq_len), int(d_head), float(keep))
    return dict(zip("qkv", masks, strict=True))


__all__ = ["activation_keep_count", "causal_mask", "combine_masks", "padding_mask",
           "qkv_activation_masks", "step_t_mask"]
