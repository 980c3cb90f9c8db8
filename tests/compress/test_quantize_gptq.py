"""GPTQ against a NumPy implementation of the paper's Algorithm 1 (arXiv:2210.17323) written
here: same column order, lazy-batch blocks, damping, grouping; identical integer codes in
float64, reconstruction in float32 within 1e-5 relative of the float64 one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.compress.gptq import gptq


def np_gptq(w, h, bits, group, zero_point, block=128, damp=0.01):
    """NumPy GPTQ in the paper's orientation (rows = outputs). Returns codes [d_in, d_out],
    scales and zeros [G, d_out]."""
    W = np.array(w, np.float64).T.copy()
    H = np.array(h, np.float64).copy()
    n = W.shape[1]
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * np.mean(np.diag(H)) * np.eye(n)
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    lo, hi = (0, 2 ** bits - 1) if zero_point else (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1)

    def params(x):  # x [d_out, cols]
        if zero_point:
            xmin, xmax = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
            flat = (xmin == 0) & (xmax == 0)
            xmin, xmax = np.where(flat, -1, xmin), np.where(flat, 1, xmax)
            s = (xmax - xmin) / hi
            return s, np.clip(np.round(-xmin / s), lo, hi)
        amax = np.abs(x).max(1)
        return np.where(amax == 0, 1, amax / hi), np.zeros(x.shape[0])

    g = n if group is None else group
    if group is not None:
        block = -(-block // g) * g
    Q = np.zeros_like(W)
    S, Z = [], []
    if group is None:
        s, z = params(W)
        S.append(s)
        Z.append(z)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1, U1 = W[:, i1:i2].copy(), U[i1:i2, i1:i2]
        Err1 = np.zeros_like(W1)
        for i in range(i2 - i1):
            if group is not None and (i1 + i) % g == 0:
                s, z = params(W1[:, i:i + g])
                S.append(s)
                Z.append(z)
            w = W1[:, i]
            q = np.clip(np.round(w / s) + z, lo, hi)
            Q[:, i1 + i] = q
            err = (w - s * (q - z)) / U1[i, i]
            W1[:, i:] -= np.outer(err, U1[i, i:])
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return Q.T, np.stack(S), np.stack(Z)


def layer(seed, d_in, d_out, n=200):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, d_in)) @ r.standard_normal((d_in, d_in)) / np.sqrt(d_in)
    x[:, 3] = 0.0  # a dead input
    return r.standard_normal((d_in, d_out)), x.T @ x


@pytest.mark.parametrize("bits,group,zero_point,d_in,block", [
    (4, 32, False, 300, 128),   # groups inside blocks, a short last group and block
    (4, 64, True, 200, 128),
    (8, None, False, 150, 64),  # per output channel, scales from the weight before updates
    (4, 48, False, 100, 32),    # block rounded up to a multiple of the group
])
def test_gptq_codes_identical_to_numpy_in_float64(bits, group, zero_point, d_in, block):
    w, h = layer(0, d_in, 24)
    with jax.enable_x64(True):
        c, s, z, sizes = gptq(jnp.asarray(w), jnp.asarray(h), bits=bits, group=group,
                              zero_point=zero_point, scale_dtype=None, block=block)
        assert c.dtype == np.float64
    rc, rs, rz = np_gptq(w, h, bits, group, zero_point, block)
    np.testing.assert_array_equal(c, rc)
    np.testing.assert_allclose(s, rs, rtol=1e-12)
    np.testing.assert_array_equal(z, rz)
    assert sum(sizes) == d_in


def test_gptq_float32_reconstruction_and_beats_round_to_nearest():
    w, h = layer(1, 256, 32)
    rc, rs, rz = np_gptq(w, h, 4, 32, False)
    g = np.repeat(np.arange(8), 32)
    ref = (rc - rz[g]) * rs[g]
    c, s, z, _ = gptq(jnp.asarray(w, jnp.float32), jnp.asarray(h, jnp.float32), bits=4, group=32)
    got = (c.astype(np.float64) - z[g]) * s[g]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
    # GPTQ's objective, ||X (W - Q)||_F^2 = tr((W - Q)^T H (W - Q)), below round to nearest's
    from lowrank_jax.leaves import Int4, materialize

    rtn = np.asarray(materialize(Int4.quantize(w.astype(np.float32), group=32)), np.float64)

    def loss(q):
        d = w - q
        return float(np.trace(d.T @ h @ d))

    assert loss(got) < 0.9 * loss(rtn)
