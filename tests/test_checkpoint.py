"""jsa.checkpoint: ScaledArray parameters and optimizer states through Flax and Orbax, bit-exact."""

from __future__ import annotations

import doctest
import functools
import re
import subprocess
import sys

import flax.serialization as fs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.checkpoint as jsa_checkpoint

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn]
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@functools.lru_cache
def training_state(dtype):
    """Parameters and a `scale_optimizer` Adam state with `dtype` data, after two steps.

    The scales are far from 1 (gradients ~1e-3, second moments ~1e-7), so a lost or
    rounded scale, or data restored in another dtype, would show.
    """
    params = jsa.as_scaled_array(
        {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 3)), "b": jnp.zeros(3)},
        dtype=jnp.float32,
    )
    params = jsa.tree.astype(jsa.ops.dynamic_rescale_max(params), dtype)
    opt = jsa.optax.scale_optimizer(optax.adam(1e-2), state_dtype=dtype)

    @jax.jit
    @jsa.autoscale
    def step(params, state):
        grads = jax.grad(lambda p: jnp.sum((p["w"] * 1e-3) ** 2) + 1e-3 * jnp.sum(p["b"]))(params)
        updates, state = opt.update(grads, state, params)
        return jsa.optax.apply_updates(params, updates), state

    params, state = params, opt.init(params)
    for _ in range(2):
        params, state = step(params, state)
    return {"params": params, "opt_state": state, "step": jnp.int32(2)}


def assert_bit_identical(restored, original):
    """Same structure, ScaledArrays where the original has them, same dtypes and bits."""
    treedef = jax.tree_util.tree_structure(original)
    assert jax.tree_util.tree_structure(restored) == treedef
    pairs = zip(
        jax.tree_util.tree_leaves(restored, is_leaf=jsa.is_scaled_leaf),
        jax.tree_util.tree_leaves(original, is_leaf=jsa.is_scaled_leaf),
    )
    n_scaled = 0
    for got, want in pairs:
        if isinstance(want, jsa.ScaledArray):
            assert isinstance(got, jsa.ScaledArray)
            n_scaled += 1
            arrays = [(got.data, want.data), (got.scale, want.scale)]
        else:
            arrays = [(got, want)]
        for a, b in arrays:
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape
            uint = _UINT[a.dtype.itemsize]
            np.testing.assert_array_equal(a.view(uint), b.view(uint))
    assert n_scaled == 6  # params w, b; Adam mu w, b; nu w, b


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: jnp.dtype(d).name)
def state(request):
    return training_state(request.param)


def test_training_state_is_scaled_low_precision(state):
    mu = state["opt_state"][0].mu["w"]
    assert isinstance(mu, jsa.ScaledArray) and mu.dtype == state["params"]["w"].dtype
    assert float(mu.scale) not in (0.0, 1.0)


def test_flax_bytes_round_trip(state):
    raw = fs.to_bytes(state)
    restored = fs.from_bytes(state, raw)
    assert_bit_identical(restored, state)
    # The template's values are not used: a zeroed template restores the same bits.
    zeros = jax.tree_util.tree_map(jnp.zeros_like, state)
    assert_bit_identical(fs.from_bytes(zeros, raw), state)


def test_flax_state_dict_round_trip(state):
    state_dict = fs.to_state_dict(state)
    w = state_dict["params"]["w"]
    assert set(w) == {"data", "scale"} and w["data"].dtype == state["params"]["w"].dtype
    assert_bit_identical(fs.from_state_dict(state, state_dict), state)
    # The state dict of a restored byte string is plain msgpack: check it against the template.
    jsa.checkpoint.check_compatible(state, fs.msgpack_restore(fs.to_bytes(state)))


def test_flax_restore_into_another_dtype_fails():
    raw = fs.to_bytes(training_state(jnp.float16))
    template = training_state(jnp.bfloat16)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Cannot restore the ScaledArray at params/b: its stored data is float16[3], the "
            "template's is bfloat16[3]."
        ),
    ):
        fs.from_bytes(template, raw)


def test_flax_restore_into_another_shape_fails():
    x = {"w": jsa.as_scaled_array(jnp.ones((2, 3)), dtype=jnp.float16)}
    template = {"w": jsa.as_scaled_array(jnp.ones((3, 2)), dtype=jnp.float16)}
    with pytest.raises(ValueError, match=r"at w: its stored data is float16\[2, 3\], the tem"):
        fs.from_bytes(template, fs.to_bytes(x))
    vector_scale = {"w": jsa.scaled_array(jnp.ones(2, jnp.float16), jnp.ones(2, jnp.float32))}
    with pytest.raises(
        ValueError, match=r"stored scale is float32\[2\], the template's is float32"
    ):
        fs.from_bytes({"w": jsa.as_scaled_array(jnp.ones(2), dtype=jnp.float16)},
                      fs.to_bytes(vector_scale))  # fmt: skip


def test_flax_restore_of_a_plain_array_into_a_scaled_template_fails():
    raw = fs.to_bytes({"w": jnp.ones(2, jnp.float16)})
    template = {"w": jsa.as_scaled_array(jnp.ones(2), dtype=jnp.float16)}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Cannot restore the ScaledArray at w: expected a state dict with keys "
            "['data', 'scale'], got ndarray."
        ),
    ):
        fs.from_bytes(template, raw)


def test_orbax_round_trip(state, tmp_path):
    jsa.checkpoint.save(tmp_path / "ckpt", state)
    assert_bit_identical(jsa.checkpoint.restore(tmp_path / "ckpt", state), state)
    # An abstract template (no values, no allocation) restores the same.
    abstract = jax.eval_shape(lambda: state)
    assert_bit_identical(jsa.checkpoint.restore(tmp_path / "ckpt", abstract), state)


def test_plain_orbax_needs_no_registration(state, tmp_path):
    """ScaledArray is a pytree: Orbax's own checkpointers save and restore it as is."""
    path = str(tmp_path / "ckpt")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
        assert_bit_identical(checkpointer.restore(path, state), state)
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(str(tmp_path / "pytree"), state)
        restore_args = ocp.checkpoint_utils.construct_restore_args(state)
        restored = checkpointer.restore(
            str(tmp_path / "pytree"), args=ocp.args.PyTreeRestore(state, restore_args=restore_args)
        )
        assert_bit_identical(restored, state)


def test_plain_orbax_casts_silently_and_restore_refuses(tmp_path):
    """Why `jsa.checkpoint.restore` checks: Orbax casts to the template's dtype."""
    x = {"w": jsa.scaled_array(jnp.array([1.0, 1.0 + 2.0**-10], jnp.float16), 2.0**-40)}
    template = {"w": jsa.scaled_array(jnp.zeros(2, jnp.bfloat16), 1.0)}
    jsa.checkpoint.save(tmp_path / "ckpt", x)
    with ocp.StandardCheckpointer() as checkpointer:
        cast = checkpointer.restore(str(tmp_path / "ckpt"), template)
    assert cast["w"].dtype == jnp.bfloat16  # 1 + 2**-10 rounded to 1: bits lost
    with pytest.raises(
        ValueError,
        match=re.escape(
            "The checkpoint does not match the template:\n"
            "  w/data: stored float16[2], template bfloat16[2]"
        ),
    ):
        jsa.checkpoint.restore(tmp_path / "ckpt", template)


def test_orbax_restore_into_another_shape_or_structure_fails(tmp_path):
    x = {"w": jsa.as_scaled_array(jnp.ones((2, 3)), dtype=jnp.float16), "n": jnp.int32(1)}
    jsa.checkpoint.save(tmp_path / "ckpt", x)
    other_shape = {"w": jsa.as_scaled_array(jnp.ones((3, 2)), dtype=jnp.float16), "n": x["n"]}
    with pytest.raises(
        ValueError, match=re.escape("w/data: stored float16[2, 3], template float16[3, 2]")
    ):
        jsa.checkpoint.restore(tmp_path / "ckpt", other_shape)
    plain = {"w": jnp.ones((2, 3), jnp.float16), "n": x["n"], "extra": jnp.ones(1)}
    with pytest.raises(ValueError) as info:
        jsa.checkpoint.restore(tmp_path / "ckpt", plain)
    assert str(info.value) == (
        "The checkpoint does not match the template:\n"
        "  extra: in the template (float32[1]), not in the checkpoint\n"
        "  w: in the template (float16[2, 3]), not in the checkpoint\n"
        "  w/data: in the checkpoint (float16[2, 3]), not in the template\n"
        "  w/scale: in the checkpoint (float32[]), not in the template"
    )
    jsa.checkpoint.save(tmp_path / "ckpt", x, force=True)  # overwriting needs force
    with pytest.raises(ValueError, match="already exists"):
        jsa.checkpoint.save(tmp_path / "ckpt", x)


def test_check_compatible_lists_at_most_ten_problems():
    template = {f"k{i:02d}": jnp.ones(1) for i in range(12)}
    with pytest.raises(ValueError, match=r"k09: in the template .*\n  \.\.\. and 2 more$"):
        jsa.checkpoint.check_compatible(template, {})


def test_lazy_public_module_and_registration():
    assert jsa.checkpoint is jsa_checkpoint and "checkpoint" in jsa.__all__
    assert jsa.checkpoint.FLAX_REGISTERED and fs.is_serializable(jsa.ScaledArray)


def test_core_does_not_import_flax_and_checkpoint_works_without_it():
    code = (
        "import sys\n"
        "import numpy as np\n"
        "import jax_scaled_arithmetics as jsa\n"
        "assert 'flax' not in sys.modules and 'orbax' not in sys.modules\n"
        "sys.modules['flax'] = None  # as if flax were not installed\n"
        "from jax_scaled_arithmetics import checkpoint\n"
        "assert checkpoint.FLAX_REGISTERED is False\n"
        "stored = {'w': {'data': np.ones(1, np.float32), 'scale': np.float32(1)}}\n"
        "checkpoint.check_compatible({'w': jsa.scaled_array([1.0], 1.0)}, stored)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_doctests():
    result = doctest.testmod(jsa_checkpoint, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 10 and result.failed == 0
