"""jsa.checkpoint of sharded ScaledArray state: saved from a 4-device mesh, restored onto
other meshes (2 devices, a (2, 2) mesh with another spec, one device), bit-exact."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jax_scaled_arithmetics as jsa

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
WEIGHTS = ("f16", "bf16", "f8", "block", "plain")


def make_state() -> dict[str, Any]:
    """Per-tensor ScaledArrays (float16, bfloat16, float8_e4m3fn data) with scales far from
    1, a block-scaled one (a float8 row per scale), a plain array and an int step."""
    w = jax.random.normal(jax.random.PRNGKey(0), (8, 4)) * 1e-3

    def per_tensor(dtype: Any) -> Any:
        rescaled = jsa.ops.dynamic_rescale_max(jsa.as_scaled_array(w, dtype=jnp.float32))
        return jsa.tree.astype(rescaled, dtype)

    return {
        "f16": per_tensor(jnp.float16),
        "bf16": per_tensor(jnp.bfloat16),
        "f8": per_tensor(jnp.float8_e4m3fn),
        "block": jsa.as_scaled_array(w, dtype=jnp.float8_e4m3fn, scale_shape=(8, 1)),
        "plain": w,
        "step": jnp.int32(7),
    }


def param_shardings(weights: Any, scalar: Any) -> dict[str, Any]:
    """The parameters' shardings: `weights` for every (8, 4) leaf, `scalar` for the step."""
    return {**dict.fromkeys(WEIGHTS, weights), "step": scalar}


def mesh(shape: tuple[int, ...], names: tuple[str, ...], devices: Any = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), names)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The state sharded `P("fsdp", None)` over 4 devices (scales as `jsa.sharding.like`
    places them), and its checkpoint."""
    mesh4 = mesh((4,), ("fsdp",))
    shardings = param_shardings(NamedSharding(mesh4, P("fsdp", None)), NamedSharding(mesh4, P()))
    state = jax.device_put(make_state(), jsa.sharding.like(make_state(), shardings))
    assert len(state["f8"].data.sharding.device_set) == 4
    assert state["f8"].scale.sharding.spec == P()
    assert state["block"].scale.sharding.spec == P("fsdp")  # 2 rows' scales a device
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    jsa.checkpoint.save(path, state)
    return path, state


def assert_bit_exact(restored: Any, original: Any) -> None:
    """Same structure, ScaledArrays where the original has them, same dtypes and bits."""
    assert jax.tree.structure(restored) == jax.tree.structure(original)
    pairs = zip(
        jax.tree.leaves(restored, is_leaf=jsa.is_scaled_leaf),
        jax.tree.leaves(original, is_leaf=jsa.is_scaled_leaf),
        strict=True,
    )
    for got, want in pairs:
        assert isinstance(got, jsa.ScaledArray) == isinstance(want, jsa.ScaledArray)
        arrays = [(got, want)]
        if isinstance(want, jsa.ScaledArray):
            arrays = [(got.data, want.data), (got.scale, want.scale)]
        for a, b in arrays:
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a.view(_UINT[a.itemsize]), b.view(_UINT[b.itemsize]))


def assert_placed(restored: Any, weights: Any, scale: Any, block_scale: Any, step: Any) -> None:
    """Every array of `restored` has the expected sharding (mesh, devices and spec)."""
    for name in WEIGHTS:
        x = restored[name]
        if isinstance(x, jsa.ScaledArray):
            assert x.data.sharding == weights, name
            assert x.scale.sharding == (block_scale if name == "block" else scale), name
        else:
            assert x.sharding == weights, name
    assert restored["step"].sharding == step


# Each target: the parameters' shardings there, and the expected scale/block-scale shardings.
def _two_devices() -> tuple[Any, ...]:
    m = mesh((2,), ("fsdp",))
    return NamedSharding(m, P("fsdp", None)), NamedSharding(m, P()), NamedSharding(m, P("fsdp"))


def _two_by_two() -> tuple[Any, ...]:
    # Another device order, both dimensions split; the block scales (8, 1) follow the rows.
    m = mesh((2, 2), ("data", "model"), devices=jax.devices()[::-1])
    weights = NamedSharding(m, P("model", "data"))
    return weights, NamedSharding(m, P()), NamedSharding(m, P("model"))


def _one_device() -> tuple[Any, ...]:
    one = SingleDeviceSharding(jax.devices()[3])
    return one, one, one


TARGETS = {"2-devices": _two_devices, "2x2-mesh": _two_by_two, "1-device": _one_device}


@pytest.mark.parametrize("how", ["like", "params", "abstract-template", "placed-template"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_restore_onto_another_mesh(saved, target, how):
    path, state = saved
    weights, scale, block_scale = TARGETS[target]()
    step = scale  # replicated (or the one device)
    params = param_shardings(weights, step)
    if how == "like":  # `jsa.sharding.like`'s output, as is
        restored = jsa.checkpoint.restore(path, state, shardings=jsa.sharding.like(state, params))
    elif how == "params":  # the parameters' shardings: the scales' are derived
        abstract = jax.eval_shape(make_state)
        restored = jsa.checkpoint.restore(path, abstract, shardings=params)
    elif how == "abstract-template":  # `jax.ShapeDtypeStruct`s with shardings
        abstract = jax.eval_shape(make_state)
        target_shardings = jsa.sharding.like(abstract, params)
        template = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract,
            target_shardings,
        )
        restored = jsa.checkpoint.restore(path, template)
    else:  # arrays already placed there (values unused)
        zeros = jax.tree.map(jnp.zeros_like, make_state())
        template = jsa.sharding.device_put(zeros, params)
        restored = jsa.checkpoint.restore(path, template)
    assert_bit_exact(restored, state)
    assert_placed(restored, weights, scale, block_scale, step)
    if isinstance(weights, NamedSharding):  # each device got its shard: check one
        spec = restored["f8"].data.sharding.spec
        assert spec == weights.spec and spec != P()
        shard = restored["f8"].data.addressable_shards[0]
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(state["f8"].data)[shard.index]
        )


def test_restore_with_one_sharding_and_as_saved(saved):
    path, state = saved
    one = SingleDeviceSharding(jax.devices()[1])
    restored = jsa.checkpoint.restore(path, jax.eval_shape(make_state), shardings=one)
    assert_bit_exact(restored, state)
    assert all(x.sharding == one for x in jax.tree.leaves(restored))
    # Without shardings, Orbax restores the arrays as they were saved.
    as_saved = jsa.checkpoint.restore(path, jax.eval_shape(make_state))
    assert_bit_exact(as_saved, state)
    for got, want in zip(jax.tree.leaves(as_saved), jax.tree.leaves(state), strict=True):
        assert got.sharding == want.sharding


def test_wrong_shardings_tree_raises(saved):
    path, state = saved
    m = mesh((2,), ("fsdp",))
    params = param_shardings(NamedSharding(m, P("fsdp", None)), NamedSharding(m, P()))
    missing = {k: v for k, v in params.items() if k != "plain"}
    with pytest.raises(ValueError) as info:
        jsa.checkpoint.restore(path, state, shardings=missing)
    assert str(info.value) == (
        "The shardings do not match the template:\n  plain: in the template, not in the shardings"
    )
    nested = dict(params, step={"inner": params["step"]}, extra=params["step"])
    with pytest.raises(ValueError) as info:
        jsa.checkpoint.restore(path, state, shardings=nested)
    assert str(info.value) == (
        "The shardings do not match the template:\n"
        "  step: in the template, not in the shardings\n"
        "  extra: in the shardings, not in the template\n"
        "  step/inner: in the shardings, not in the template"
    )
    spec = P("fsdp", None)  # a spec where a sharding belongs
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"jsa.checkpoint.restore: the shardings hold {spec!r} at plain: expected a "
            "jax.sharding.Sharding (or None)."
        ),
    ):
        jsa.checkpoint.restore(path, state, shardings=dict(params, plain=spec))
    # A sharding that does not fit its array: named, before anything is read.
    with pytest.raises(ValueError, match=r"Cannot restore step \(int32\[\]\) with the sharding"):
        jsa.checkpoint.restore(
            path, state, shardings=dict(params, step=NamedSharding(m, P("fsdp", None)))
        )
    three = mesh((3,), ("fsdp",))
    uneven = dict(params, f16=NamedSharding(three, P("fsdp")))
    with pytest.raises(ValueError, match=r"Cannot restore f16/data \(float16\[8, 4\]\) with"):
        jsa.checkpoint.restore(path, state, shardings=uneven)


_RESTORE_ON_ONE_DEVICE = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
import jax.numpy as jnp, numpy as np
import jax_scaled_arithmetics as jsa
w = jnp.arange(32.0).reshape(8, 4)
abstract = jax.eval_shape(lambda: {"w": jsa.as_scaled_array(w, dtype=jnp.float8_e4m3fn)})
try:
    jsa.checkpoint.restore(sys.argv[1], abstract)
except ValueError as e:
    print(str(e).split(":")[1].strip())
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
y = jsa.checkpoint.restore(sys.argv[1], abstract, shardings=one)
assert np.asarray(y["w"].data).tobytes() == np.asarray(w.astype(jnp.float8_e4m3fn)).tobytes()
print(y["w"].data.sharding == one and y["w"].scale.sharding == one)
"""


@pytest.mark.slow
def test_restore_in_a_process_with_fewer_devices(tmp_path):
    """A checkpoint saved from 4 devices restores in a 1-device process given shardings;
    without them, the error says so."""
    w = jnp.arange(32.0).reshape(8, 4)
    x = {"w": jsa.as_scaled_array(w, dtype=jnp.float8_e4m3fn)}
    mesh4 = mesh((4,), ("fsdp",))
    jsa.checkpoint.save(
        tmp_path / "ckpt", jsa.sharding.device_put(x, NamedSharding(mesh4, P("fsdp")))
    )
    command = [sys.executable, "-c", _RESTORE_ON_ONE_DEVICE, str(tmp_path / "ckpt")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "it was saved from devices this process does not have. Give the template's leaves "
        "shardings, or pass shardings= (e.g. a NamedSharding on a mesh of this process's "
        "devices).",
        "True",
    ]
