"""Execution settings: explicit, validated, part of every trace's key; no module-level knobs.

The settings change how blocks run, never what they compute: each test compares the outputs
of both settings against each other and the program's structure (a chunk loop, a folded
product) against what the setting asks for.
"""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex

import lowrank_jax
from lowrank_jax import execution, nn
from lowrank_jax.errors import ConfigError

CFG = nn.AttentionConfig()


def test_defaults_and_validation():
    s = execution.current()
    assert s == execution.Execution() == execution.DEFAULT
    assert s.fold_keys and s.cpu_chunks is None and s.packed_kernel == "auto"
    for bad in ({"fold_keys": "yes"}, {"cpu_chunks": 1}, {"attention_chunk_bytes": 0},
                {"mlp_chunk_above_bytes": -1}, {"attention_chunk_above_bytes": 1.5},
                {"packed_kernel": "fast"}):
        name = next(iter(bad))
        with pytest.raises(ConfigError, match=name):
            execution.Execution(**bad)
    with pytest.raises(ConfigError, match="no settings"):
        with execution.settings(fold_key=False):  # a typo is an error, not ignored
            pass
    with pytest.raises(ConfigError, match="Execution"):
        with execution.settings({"fold_keys": False}):
            pass


def test_settings_nest_and_restore():
    with execution.settings(fold_keys=False) as outer:
        assert execution.current() is outer and not outer.fold_keys
        with execution.settings(cpu_chunks=True) as inner:
            assert not inner.fold_keys and inner.cpu_chunks  # on top of the active ones
        assert execution.current() == outer
        with execution.settings(execution.Execution(), mlp_chunk_bytes=7) as whole:
            assert whole.fold_keys and whole.mlp_chunk_bytes == 7  # a whole record, then changes
    assert execution.current() == execution.DEFAULT
    with pytest.raises(RuntimeError):
        with execution.settings(fold_keys=False):
            raise RuntimeError("boom")
    assert execution.current() == execution.DEFAULT  # restored after an error too


def _equations(jaxpr):
    """Every equation of a jaxpr, inner programs (pjit, custom rules) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def cross_attention_params():
    return nn.init_attention(jax.random.PRNGKey(0), CFG, d_model=16, num_heads=4)


def test_changing_a_setting_after_jit_retraces():
    """The same jitted function, called under two settings, is traced twice and runs both
    programs: folded (no key projection of the 9 keys) and projected; equal outputs."""
    p = cross_attention_params()
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 1, 16))
    enc = jax.random.normal(jax.random.PRNGKey(2), (2, 9, 16))
    traces = []

    @jax.jit
    def run(p, x, enc):
        traces.append(execution.current())
        return nn.apply_attention(p, x, CFG, kv=enc)

    def key_rows(closed) -> bool:  # a dot_general producing the 9 projected key rows
        return any(e.primitive.name == "dot_general"
                   and tuple(e.outvars[0].aval.shape) == (2, 9, 16)
                   for e in _equations(closed.jaxpr))

    folded = run(p, x, enc)
    assert not key_rows(run.trace(p, x, enc).jaxpr)
    with execution.settings(fold_keys=False):
        projected = run(p, x, enc)
        assert key_rows(run.trace(p, x, enc).jaxpr)
    again = run(p, x, enc)  # back to the default: the first trace is reused
    assert [t.fold_keys for t in traces][:2] == [True, False]
    assert sum(1 for t in traces if t.fold_keys) == sum(1 for t in traces if not t.fold_keys)
    np.testing.assert_allclose(np.asarray(folded), np.asarray(projected), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(folded), np.asarray(again))


def test_chunk_setting_retraces_the_mlp():
    cfg = nn.MLPConfig(activation="gelu")
    p = nn.init_mlp(jax.random.PRNGKey(3), cfg, d_model=8, d_ff=12)
    x = jax.random.normal(jax.random.PRNGKey(4), (10, 8))
    run = jax.jit(lambda p, x: nn.apply_mlp(p, x, cfg))
    whole_program = str(run.trace(p, x).jaxpr)
    whole = run(p, x)
    with execution.settings(cpu_chunks=True, mlp_chunk_above_bytes=0, mlp_chunk_bytes=200):
        chunked_program = str(run.trace(p, x).jaxpr)
        chunked = run(p, x)
    assert "while" not in whole_program and "scan" not in whole_program
    assert "while" in chunked_program or "scan" in chunked_program
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), atol=1e-6)


KNOB_TYPES = (int, float, bool, type(None))


def _is_knob(value: ast.AST) -> bool:
    """A module-level scalar (or arithmetic on scalars) assigned to a name: a setting someone
    could flip from outside."""
    if isinstance(value, ast.Constant):
        return isinstance(value.value, KNOB_TYPES)
    if isinstance(value, ast.BinOp):
        return _is_knob(value.left) and _is_knob(value.right)
    if isinstance(value, ast.UnaryOp):
        return _is_knob(value.operand)
    return False


def test_no_module_level_knobs_in_the_blocks():
    """No module of ``lowrank_jax/nn`` assigns a module-level scalar (the chunk thresholds and
    the fold switch were such knobs: flipping one after a function was jitted did nothing)."""
    root = pathlib.Path(lowrank_jax.__file__).parent / "nn"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = []
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if _is_knob(value):
                found += [f"{path.relative_to(root.parent)}:{node.lineno} "
                          f"{ast.unparse(t)}" for t in targets]
    assert not found, found
    # the scan sees a knob when there is one
    assert _is_knob(ast.parse("X = 64 << 20").body[0].value)
    assert _is_knob(ast.parse("X = None").body[0].value)
    assert not _is_knob(ast.parse("X = jax.Array").body[0].value)


def test_packed_kernel_setting_reaches_the_leaf():
    from lowrank_jax.leaves import MaskedBinary, PackedBinary, linear

    r = np.random.default_rng(0)
    leaf = PackedBinary.from_leaf(MaskedBinary(jnp.asarray(r.normal(size=(40, 8)), jnp.float32),
                                               jnp.asarray(r.normal(size=(40, 8)), jnp.float32),
                                               keep=0.5))
    x = jnp.asarray(r.normal(size=(3, 40)), jnp.float32)
    run = jax.jit(lambda p, v: linear(p, v))
    assert "pallas_call" not in str(run.trace(leaf, x).jaxpr)
    with execution.settings(packed_kernel="on"):
        assert "pallas_call" in str(run.trace(leaf, x).jaxpr)
        on = run(leaf, x)
    np.testing.assert_allclose(np.asarray(on), np.asarray(run(leaf, x)), atol=1e-5)
