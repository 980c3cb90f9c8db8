"""The Partitioned leaf ("Partitioning Transformer Networks with Low Intercommunication", eqs.
26-34): NumPy reference of its matrix and counts, surgery, placement, and shard_map execution on
8 simulated CPU devices (tests/conftest.py) against the single-device leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lowrank_jax as lj
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import Partitioned


def random_leaf(m, a, c, r, *, bias=True, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return Partitioned(diag=f(m, a, c), send=f(m, a, r), recv=f(m, m - 1, r, c),
                       b=f(m, c) if bias else None)


def reference_matrix(leaf) -> np.ndarray:
    """W [d_in, d_out] from the fields, written block by block: machine m' sends
    x_m' @ send[m']; machine k adds that times recv[k, j] for the sender m' = (k + 1 + j) % M."""
    diag, send, recv = (np.asarray(x, np.float64) for x in (leaf.diag, leaf.send, leaf.recv))
    m, a, c = diag.shape
    w = np.zeros((m * a, m * c))
    for k in range(m):
        w[k * a:(k + 1) * a, k * c:(k + 1) * c] = diag[k]
        for j in range(m - 1):
            p = (k + 1 + j) % m
            w[p * a:(p + 1) * a, k * c:(k + 1) * c] = send[p] @ recv[k, j]
    return w


def rel(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))


@pytest.mark.parametrize("m,a,c,r,bias", [(4, 3, 5, 2, True), (3, 2, 4, 0, False)])
def test_matrix_apply_and_counts_against_numpy(m, a, c, r, bias):
    leaf = random_leaf(m, a, c, r, bias=bias, seed=m + r)
    want = reference_matrix(leaf)
    np.testing.assert_allclose(lj.materialize_host(leaf), want, rtol=1e-12, atol=1e-12)
    x = np.random.default_rng(1).normal(size=(2, 3, m * a)).astype(np.float32)
    b = np.asarray(leaf.b, np.float64).reshape(-1) if bias else 0.0
    np.testing.assert_allclose(np.asarray(lj.linear(leaf, x)), x.astype(np.float64) @ want + b,
                               rtol=1e-5, atol=1e-5 * np.abs(x @ want).max())
    assert leaf.shape == (m * a, m * c) and leaf.machines == m and leaf.rank == r
    # eq. 43 of the paper (its d0 = d_in, d1 = d_out); the bias adds d1
    d0, d1 = m * a, m * c
    assert leaf.param_count() == d0 * d1 // m + r * d0 + (m - 1) * r * d1 + (d1 if bias else 0)
    assert leaf.storage_bits() == 32 * leaf.param_count()
    # multiply-adds per token: diagonal blocks, the messages, the received products (eq. 59)
    assert leaf.flops(7) == 7 * (d0 * d1 // m + m * a * r + m * (m - 1) * r * c)
    assert leaf.bytes_sent(5) == 5 * r * 4


def test_bias_and_surgery_against_numpy():
    leaf = random_leaf(4, 3, 5, 2)
    w = reference_matrix(leaf)
    b = np.arange(20, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(leaf.with_bias(b).bias), b)
    assert leaf.with_bias(None).bias is None
    with pytest.raises(ShapeError, match=r"\(20,\)"):
        leaf.with_bias(np.zeros(19))
    keep_in = np.array([0, 2, 4, 5, 6, 7, 10, 11])  # two of the three inputs of every machine
    keep_out = np.array([1, 3, 5, 9, 12, 14, 16, 17])  # two of the five outputs of every machine
    sub = lj.keep_outputs(lj.keep_inputs(leaf, keep_in), keep_out)
    np.testing.assert_allclose(lj.materialize_host(sub), w[np.ix_(keep_in, keep_out)],
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(sub.bias), np.asarray(leaf.bias)[keep_out])
    with pytest.raises(ShapeError, match="same number"):
        lj.keep_inputs(leaf, np.array([0, 1, 2, 3]))  # machine 0 keeps 3, machine 1 one


def test_construction_errors():
    leaf = random_leaf(4, 3, 5, 2)
    with pytest.raises(ShapeError, match="recv"):
        Partitioned(diag=leaf.diag, send=leaf.send, recv=leaf.recv[:, :2])
    with pytest.raises(ShapeError, match=r"\(M, c\)"):
        Partitioned(diag=leaf.diag, send=leaf.send, recv=leaf.recv, b=jnp.zeros(20))
    with pytest.raises(ConfigError, match="mesh_axis"):
        Partitioned(diag=leaf.diag, send=leaf.send, recv=leaf.recv, mesh_axis="")


def test_placement_names_the_machine_axis():
    leaf = random_leaf(4, 3, 5, 2)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    specs = lj.leaves.partition_specs({"w": leaf}, mesh, {"machine": "model"})["w"]
    assert tuple(specs.diag) == ("model", None, None)
    assert tuple(specs.send) == ("model", None, None)
    assert tuple(specs.recv) == ("model", None, None, None)
    assert tuple(specs.b) == ("model", None)


@pytest.fixture(scope="module")
def leaf8():
    return random_leaf(8, 2, 3, 2, seed=3)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_shard_map_equals_single_device(m):
    leaf = random_leaf(m, 3, 2, 2, bias=m != 2, seed=10 + m)
    x = np.random.default_rng(m).normal(size=(2, 5, 3 * m)).astype(np.float32)
    single = np.asarray(lj.linear(leaf, x))
    mesh = Mesh(np.array(jax.devices()[:m]), ("model",))
    with jax.set_mesh(mesh):
        y = jax.jit(lj.linear)(leaf, x)
    assert rel(y, single) <= 1e-5
    assert tuple(y.sharding.spec)[-1] == "model"  # outputs stay sharded over the machines


def test_several_machines_per_device_and_data_parallel(leaf8):
    x = np.random.default_rng(4).normal(size=(4, 3, 16)).astype(np.float32)
    single = np.asarray(lj.linear(leaf8, x))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    with jax.set_mesh(mesh):  # 8 machines on a model axis of 4: two per device
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        y = jax.jit(lj.linear)(leaf8, xs)
        loss = lambda w, x: jnp.sum(jnp.sin(lj.linear(w, x)))  # noqa: E731
        g = jax.jit(jax.grad(loss))(leaf8, xs)
    assert rel(y, single) <= 1e-5
    assert tuple(y.sharding.spec) == ("data", None, "model")
    g1 = jax.grad(loss)(leaf8, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g1), strict=True):
        assert rel(a, b) <= 1e-5


def test_mesh_axis_size_must_divide_the_machines():
    leaf = random_leaf(4, 2, 2, 1)
    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    with jax.set_mesh(mesh), pytest.raises(ShapeError, match="multiple of the axis size"):
        jax.jit(lj.linear)(leaf, np.ones((2, 8), np.float32))


def test_inside_a_manual_shard_map(leaf8):
    """A model written in shard_map passes the leaf's shards; the leaf runs its device part."""
    x = np.random.default_rng(5).normal(size=(3, 16)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    specs = jax.tree_util.tree_map(lambda _: P("model"), leaf8)
    fn = jax.shard_map(lj.linear, mesh=mesh, in_specs=(specs, P(None, "model")),
                       out_specs=P(None, "model"))
    y = jax.jit(fn)(leaf8, x)
    assert rel(y, np.asarray(lj.linear(leaf8, x))) <= 1e-5


def test_save_load_round_trip(tmp_path, leaf8):
    from lowrank_jax.io import load_params, save_params

    save_params(tmp_path / "p", {"w": leaf8})
    back = load_params(tmp_path / "p")["w"]
    assert isinstance(back, Partitioned) and back.mesh_axis == "model"
    np.testing.assert_array_equal(np.asarray(back.recv), np.asarray(leaf8.recv))


# -- CompressedKeys: sec. III.A, tokens split over machines ------------------------------------

def compressed_keys(num, *, seed=0):
    from lowrank_jax.leaves.partitioned import CompressedKeys

    rng = np.random.default_rng(seed)
    q = lj.Dense(jnp.asarray(rng.normal(size=(12, 8)), jnp.float32),
                 jnp.asarray(rng.normal(size=8), jnp.float32))
    k = lj.Dense(jnp.asarray(rng.normal(size=(12, 8)), jnp.float32),
                 jnp.asarray(rng.normal(size=8), jnp.float32))
    u = np.stack([np.linalg.qr(rng.normal(size=(4, 4)))[0] for _ in range(2)])  # 2 heads of 4
    off = rng.normal(size=2) if num < 4 else np.zeros(2)
    return CompressedKeys(q=q, k=k, basis=jnp.asarray(u[:, :, :num], jnp.float32),
                          offset=jnp.asarray(off, jnp.float32), widths=(4, 4)), u, off


def reference_logits(ck, u, off, num, xq, xk):
    """(q_h U_h)(k_h U_h)^T + c_h per head (eqs. 123-124), in float64."""
    q = xq.astype(np.float64) @ np.asarray(ck.q.w, np.float64) + np.asarray(ck.q.b)
    k = xk.astype(np.float64) @ np.asarray(ck.k.w, np.float64) + np.asarray(ck.k.b)
    out = []
    for h in range(2):
        fq = q[..., 4 * h:4 * h + 4] @ u[h, :, :num]
        fk = k[..., 4 * h:4 * h + 4] @ u[h, :, :num]
        out.append(np.einsum("bqk,bsk->bqs", fq, fk) + off[h])
    return np.stack(out, axis=1)


def test_compressed_keys_against_numpy_and_exact_at_full_width():
    rng = np.random.default_rng(1)
    xq = rng.normal(size=(2, 4, 12)).astype(np.float32)
    xk = rng.normal(size=(2, 6, 12)).astype(np.float32)
    for num in (1, 4):
        ck, u, off = compressed_keys(num)
        got = np.asarray(lj.attention_logits(ck, xq, xk))
        want = reference_logits(ck, u, off, num, xq, xk)
        assert rel(got, want) <= 1e-5
        assert ck.score_flops(4, 6) == 4 * 6 * 2 * num + (4 + 6) * 2 * 4 * num
        joint = np.asarray(ck.joint())
        for h in range(2):
            wq = np.asarray(ck.q.w)[:, 4 * h:4 * h + 4] @ u[h, :, :num]
            wk = np.asarray(ck.k.w)[:, 4 * h:4 * h + 4] @ u[h, :, :num]
            np.testing.assert_allclose(joint[..., h], wq @ wk.T, rtol=1e-5, atol=1e-5)
    exact = lj.attention_logits(lj.QueryKey(q=ck.q, k=ck.k, widths=(4, 4)), xq, xk)
    assert rel(lj.attention_logits(ck, xq, xk), exact) <= 1e-5  # K = d_head: exact
    one = ck.keep_heads([1])
    assert rel(lj.attention_logits(one, xq, xk), np.asarray(exact)[:, 1:]) <= 1e-5
    with pytest.raises(ShapeError, match="basis"):
        type(ck)(q=ck.q, k=ck.k, basis=ck.basis[:, :3], offset=ck.offset, widths=(4, 4))


def test_compressed_keys_split_tokens_over_machines():
    ck, _, _ = compressed_keys(2)
    x = np.random.default_rng(2).normal(size=(2, 8, 12)).astype(np.float32)
    single = np.asarray(lj.attention_logits(ck, x, x))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    from lowrank_jax.compress.partitioning import collective_bytes

    fn = jax.jit(lambda c, x: lj.attention_logits(c, x, x))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
        got = fn(ck, xs)
        cols = collective_bytes(fn.lower(ck, xs).compile())
    assert rel(got, single) <= 1e-5
    assert tuple(got.sharding.spec) == ("data", None, "model")  # rows: this machine's queries
    # one all-gather: K = 2 numbers per key per head, 2 of the 8 keys of 1 sequence per device
    assert [c.kind for c in cols] == ["all-gather"]
    assert cols[0].bytes == 1 * 2 * 2 * 2 * 4 and cols[0].group_size == 4
