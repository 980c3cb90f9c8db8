"""The SBT model family against a plain NumPy forward (post-norm encoder, BatchNorm train and
eval with running statistics, fixed Q/K/V activation masks, padding), the step-T and forecast
masking properties, the trainable / frozen split, and the packed model (exact outputs, saved
as bits)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import leaves as L
from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.models import family_of, sbt
from lowrank_jax.nn import qkv_activation_masks

M, W, D, H, FF, C = 3, 6, 8, 2, 16, 3
RUN = jax.jit(sbt.apply, static_argnames=("cfg", "train"))  # one compile per config and mode


def cfg_of(task="classification", binary=True, layers=1, **kw):
    return sbt.SBTConfig(n_features=M, window=W, task=task, n_classes=C, d_model=D,
                         num_heads=H, d_ff=FF, num_layers=layers, binary=binary, keep=0.5,
                         mask_seed=3, **kw)


def inputs(seed=0, batch=4):
    r = np.random.default_rng(seed)
    x = r.standard_normal((batch, W, M)).astype(np.float32)
    valid = np.ones((batch, W), bool)
    valid[1, 4:] = False  # a padded series
    x[1, 4:] = 0.0
    return x, valid


def np_linear(leaf, x):
    w = np.asarray(L.materialize(leaf), np.float64)
    b = L.bias_of(leaf)
    return x @ w + (0.0 if b is None else np.asarray(b, np.float64))


def np_pe(w, d):
    pe = np.zeros((w, d))
    for pos in range(w):
        for i in range(0, d, 2):
            angle = pos / (10000 ** (i / d))
            pe[pos, i], pe[pos, i + 1] = math.sin(angle), math.cos(angle)
    return pe


def np_forward(params, x, valid, cfg, state, train):
    """Plain NumPy (float64) forward of the classification model."""
    z = np_linear(params["embed"], x.astype(np.float64)) * math.sqrt(D)
    z = z + (np.asarray(params["pos"], np.float64) if "pos" in params else np_pe(W, D))
    dh = D // H
    new_state = []
    for i, lp in enumerate(params["layers"]):
        a = lp["attn"]
        q, k, v = (np_linear(a["qk"].q, z), np_linear(a["qk"].k, z), np_linear(a["v"], z))
        q, k, v = (t.reshape(t.shape[0], W, H, dh) for t in (q, k, v))
        if cfg.use_qkv_masks:
            mk = qkv_activation_masks(cfg.mask_seed + i, W, dh, cfg.keep)
            q, k, v = q * mk["q"][:, None], k * mk["k"][:, None], v * mk["v"][:, None]
        logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
        logits = np.where(valid[:, None, None, :], logits, -1e30)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        att = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(-1, W, D)
        z = z + np_linear(a["o"], att)
        sts = []
        for name, f in (("norm1", None), ("norm2", lp["mlp"])):
            if f is not None:
                z = z + np_linear(f["wo"], np.maximum(np_linear(f["wi"], z), 0))
            st = state["layers"][i][name]
            if train:
                mu, var = z.mean((0, 1)), z.var((0, 1))
                n = z.shape[0] * z.shape[1]
                sts.append({"mean": 0.9 * np.asarray(st["mean"]) + 0.1 * mu,
                            "var": 0.9 * np.asarray(st["var"]) + 0.1 * var * n / (n - 1)})
            else:
                mu, var = np.asarray(st["mean"]), np.asarray(st["var"])
            g, b = (np.asarray(lp[name][k_], np.float64) for k_ in ("scale", "bias"))
            z = (z - mu) / np.sqrt(var + 1e-5) * g + b
        new_state.append(sts)
    y = np_linear(params["decoder"], np.maximum(z, 0))
    return y.mean(1), new_state


@pytest.mark.parametrize("binary", [True, False])
def test_classifier_matches_numpy_train_and_eval(binary):
    cfg = cfg_of(binary=binary, layers=1 if binary else 2)  # (binary: compile time)
    params = sbt.init(jax.random.PRNGKey(1), cfg)
    state = sbt.init_state(params, cfg)
    x, valid = inputs()
    out = RUN(params, {"x": x, "valid": valid}, cfg, state=state, train=True)
    ref, ref_state = np_forward(params, x, valid, cfg, state, train=True)
    np.testing.assert_allclose(np.asarray(out["logits"]), ref, atol=1e-4, rtol=1e-4)
    for i in range(cfg.num_layers):
        for j, name in enumerate(("norm1", "norm2")):
            for key in ("mean", "var"):
                np.testing.assert_allclose(np.asarray(out["state"]["layers"][i][name][key]),
                                           ref_state[i][j][key], atol=1e-4, rtol=1e-4)
    # Evaluation uses the running statistics given (here: the updated ones), not the batch's.
    st = out["state"]
    ev = RUN(params, {"x": x, "valid": valid}, cfg, state=st, train=False)
    ref_ev, _ = np_forward(params, x, valid, cfg, st, train=False)
    np.testing.assert_allclose(np.asarray(ev["logits"]), ref_ev, atol=1e-4, rtol=1e-4)
    # A sample's eval output does not depend on the rest of the batch; in train mode it does.
    x2, v2 = x.copy(), valid.copy()
    x2[2:] = np.random.default_rng(9).standard_normal(x2[2:].shape)
    ev2 = RUN(params, {"x": x2, "valid": v2}, cfg, state=st, train=False)["logits"]
    np.testing.assert_allclose(np.asarray(ev2)[:2], np.asarray(ev["logits"])[:2], atol=1e-6)
    tr2 = RUN(params, {"x": x2, "valid": v2}, cfg, state=state, train=True)["logits"]
    assert not np.allclose(np.asarray(tr2)[:2], np.asarray(out["logits"])[:2])
    assert ("pos" in params) == (not binary)


def test_step_t_and_forecast_masking():
    x, _ = inputs(2)
    x2 = x.copy()
    x2[:, -1] += 5.0
    cfg = cfg_of("anomaly")
    assert cfg.use_step_t and not cfg.use_qkv_masks and cfg.norm is None
    p = sbt.init(jax.random.PRNGKey(2), cfg)
    a = np.asarray(RUN(p, {"x": x}, cfg)["reconstruction"])
    b = np.asarray(RUN(p, {"x": x2}, cfg)["reconstruction"])
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])  # earlier steps attend only themselves
    assert np.abs(a[:, -1] - b[:, -1]).max() > 1e-3
    # perturbing an earlier step changes the last row (it attends the history)
    x3 = x.copy()
    x3[:, 0] += 5.0
    c = np.asarray(RUN(p, {"x": x3}, cfg)["reconstruction"])
    assert np.abs(c[:, -1] - a[:, -1]).max() > 1e-4
    fc = cfg_of("forecast")
    pf = sbt.init(jax.random.PRNGKey(3), fc)
    fa = np.asarray(RUN(pf, {"x": x}, fc)["reconstruction"])
    fb = np.asarray(RUN(pf, {"x": x2}, fc)["reconstruction"])
    np.testing.assert_array_equal(fa, fb)  # the forecast step is zeroed before the model


def test_trainable_split_and_family():
    cfg = cfg_of()
    params = sbt.init(jax.random.PRNGKey(4), cfg)
    mask = L.trainable_mask(params)
    att = mask["layers"][0]["attn"]
    assert att["qk"].q.b is False and att["qk"].q.leaf.w is False and att["qk"].q.leaf.s is True
    assert mask["embed"].w is False and mask["embed"].s is True and mask["embed"].b is None
    assert mask["layers"][0]["norm1"]["scale"] is True
    assert isinstance(params["layers"][0]["mlp"]["wi"], L.MaskedBinary)
    # every layer gets its own draws
    p2 = sbt.init(jax.random.PRNGKey(4), cfg_of(layers=2))
    w0 = np.asarray(p2["layers"][0]["mlp"]["wi"].w)
    assert not np.array_equal(w0, np.asarray(p2["layers"][1]["mlp"]["wi"].w))
    fam = family_of(cfg)
    assert fam.name == "sbt" and fam.init_state(params, cfg) is not None
    assert fam.init_state(params, cfg_of("anomaly")) is None
    with pytest.raises(ConfigError):
        sbt.SBTConfig(n_features=3, window=6, task="classification", n_classes=1)
    with pytest.raises(DataError):
        sbt.apply(params, {"x": np.zeros((2, W + 1, M))}, cfg, state=sbt.init_state(params, cfg))
    with pytest.raises(ConfigError):
        sbt.apply(params, {"x": np.zeros((2, W, M))}, cfg)


def test_loss_trains_scores_only():
    import optax

    from lowrank_jax.train import full_params, init_train_state, make_train_step

    cfg = cfg_of()
    params = sbt.init(jax.random.PRNGKey(5), cfg)
    x, valid = inputs(3)
    batch = {"x": jnp.asarray(x), "valid": jnp.asarray(valid), "y": jnp.asarray([0, 1, 2, 0])}
    opt = optax.adam(1e-2)
    st = init_train_state(params, opt, key=jax.random.PRNGKey(0),
                          model_state=sbt.init_state(params, cfg))
    step = make_train_step(sbt.loss(cfg), opt, stateful=True)
    for _ in range(2):
        st, m = step(st, batch)
    new = full_params(st)
    q0, q1 = params["layers"][0]["attn"]["qk"].q, new["layers"][0]["attn"]["qk"].q
    np.testing.assert_array_equal(np.asarray(q0.b), np.asarray(q1.b))  # frozen bias
    np.testing.assert_array_equal(np.asarray(q0.leaf.w), np.asarray(q1.leaf.w))  # frozen w
    assert not np.array_equal(np.asarray(q0.leaf.s), np.asarray(q1.leaf.s))
    assert not np.array_equal(np.asarray(st.model_state["layers"][0]["norm1"]["mean"]), 0)


def test_packed_model_exact_and_saved_as_bits(tmp_path):
    from lowrank_jax.io import load_model, load_model_state, save_model

    cfg = cfg_of()
    params = sbt.init(jax.random.PRNGKey(6), cfg)
    state = sbt.init_state(params, cfg)
    x, valid = inputs(4)
    ref = RUN(params, {"x": x, "valid": valid}, cfg, state=state)["logits"]
    packed = L.pack_binary_tree(params)
    got = RUN(packed, {"x": x, "valid": valid}, cfg, state=state)["logits"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    save_model(tmp_path / "m", cfg, packed, state=state)
    cfg2, p2 = load_model(tmp_path / "m")
    assert cfg2 == cfg and isinstance(p2["layers"][0]["mlp"]["wi"], L.PackedBinary)
    got2 = RUN(p2, {"x": x, "valid": valid}, cfg2,
                     state=load_model_state(tmp_path / "m"))["logits"]
    np.testing.assert_array_equal(np.asarray(got2), np.asarray(ref))
    # the packed leaves store 2 bits per weight position (+ alpha), not 32
    leaf = p2["layers"][0]["mlp"]["wi"]
    assert L.storage_bits(leaf) == 2 * FF * 32 + 32 and leaf.sign_bits.dtype == jnp.uint32
    # (d_in = 8 fills a quarter of each 32-bit word: tiny layers pay for padding)
