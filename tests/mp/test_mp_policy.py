"""Tests of `jsa.mp` policies: parsing, defaults, errors and casting."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics.mp as mp
from jax_scaled_arithmetics.core.datatype import ScaledArray, scaled_array

F16, BF16, F32, F64 = (jnp.dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)

DTYPE_NAMES = [
    ("f16", F16),
    ("float16", F16),
    ("bf16", BF16),
    ("bfloat16", BF16),
    ("f32", F32),
    ("float32", F32),
    ("full", F32),
    ("single", F32),
    ("f64", F64),
    ("float64", F64),
    ("double", F64),
    ("f8e4m3", E4M3),
    ("e4m3", E4M3),
    ("float8_e4m3fn", E4M3),
    ("f8e5m2", E5M2),
    ("e5m2", E5M2),
    ("float8_e5m2", E5M2),
    ("half", None),  # platform dependent: mp.half_dtype()
]

FULL_FLOAT8_NAMES = [
    name
    for name in (
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e4m3",
        "float8_e3m4",
        "float8_e8m0fnu",
    )
    if hasattr(jnp, name)
]


@pytest.mark.parametrize("key", ["p", "params"])
@pytest.mark.parametrize("name, dtype", DTYPE_NAMES)
def test_dtype_names_for_params(key, name, dtype):
    expected = mp.half_dtype() if dtype is None else dtype
    policy = mp.get_policy(f"{key}={name}")
    # Compute follows params, output follows compute.
    assert policy == mp.Policy(expected, expected, expected)


@pytest.mark.parametrize("key", ["c", "compute"])
@pytest.mark.parametrize("name, dtype", DTYPE_NAMES)
def test_dtype_names_for_compute(key, name, dtype):
    expected = mp.half_dtype() if dtype is None else dtype
    policy = mp.get_policy(f"{key}={name}")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        F32,
        expected,
        expected,
    )


@pytest.mark.parametrize("key", ["o", "output"])
@pytest.mark.parametrize("name, dtype", DTYPE_NAMES)
def test_dtype_names_for_output(key, name, dtype):
    expected = mp.half_dtype() if dtype is None else dtype
    policy = mp.get_policy(f"{key}={name}")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, F32, expected)


@pytest.mark.parametrize("name", FULL_FLOAT8_NAMES)
def test_full_float8_names(name):
    dtype = jnp.dtype(getattr(jnp, name))
    policy = mp.get_policy(f"c={name}")
    assert policy.compute_dtype == dtype
    assert mp.get_policy(str(policy)) == policy


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        ("c=bf16", (F32, BF16, BF16)),
        ("p=f16", (F16, F16, F16)),
        ("o=bf16", (F32, F32, BF16)),
        ("p=f16,o=f32", (F16, F16, F32)),
        ("o=f32,c=e4m3,p=bf16", (BF16, E4M3, F32)),
        (" P = F32 , C = BF16 ", (F32, BF16, BF16)),  # whitespace and case are ignored
    ],
)
def test_get_policy(spec, expected):
    policy = mp.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


def test_str_and_round_trip():
    policy = mp.get_policy("p=f32,c=bf16,o=f16")
    assert str(policy) == "p=float32,c=bfloat16,o=float16"
    assert mp.get_policy(str(policy)) == policy
    fp8 = mp.get_policy("c=e5m2,o=f32")
    assert str(fp8) == "p=float32,c=float8_e5m2,o=float32"
    assert mp.get_policy(str(fp8)) == fp8


@pytest.mark.parametrize(
    "spec, match",
    [
        ("q=f32", r"Unknown key 'q' in policy 'q=f32'"),
        ("p=f32,compte=bf16", r"Unknown key 'compte' in policy 'p=f32,compte=bf16'"),
    ],
)
def test_unknown_key(spec, match):
    with pytest.raises(ValueError, match=match):
        mp.get_policy(spec)


def test_unknown_dtype_lists_accepted_names():
    with pytest.raises(ValueError, match=r"Unknown dtype 'f8' for key 'c'") as info:
        mp.get_policy("p=f32,c=f8")
    message = str(info.value)
    assert "'p=f32,c=f8'" in message
    for name in ("bf16", "f16", "f32", "e4m3", "e5m2", "float8_e4m3fn"):
        assert name in message


@pytest.mark.parametrize("spec", ["p=f32,", "p=f32,,c=bf16", "p=", "=f32", "p=f32,c"])
def test_malformed_entries(spec):
    with pytest.raises(ValueError, match=r"Malformed entry"):
        mp.get_policy(spec)


@pytest.mark.parametrize("name, dtype", DTYPE_NAMES)
def test_one_dtype_name_is_the_dtype_of_all_three(name, dtype):
    """As in jmp: `get_policy("float16")`."""
    expected = mp.half_dtype() if dtype is None else dtype
    policy = mp.get_policy(name)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (expected,) * 3


@pytest.mark.parametrize("spec", ["", "p", "compute_float16", "f8"])
def test_a_name_alone_that_is_no_dtype_is_an_unknown_dtype(spec):
    with pytest.raises(ValueError, match=rf"Unknown dtype '{spec}' in policy '{spec}'"):
        mp.get_policy(spec)


def test_duplicate_key():
    with pytest.raises(ValueError, match=r"given twice"):
        mp.get_policy("p=f32,params=bf16")


def test_get_policy_needs_a_string():
    with pytest.raises(TypeError, match=r"expects a string"):
        mp.get_policy(jnp.float32)  # type: ignore[arg-type]


def test_policy_constructor_normalises_dtypes():
    policy = mp.Policy("f32", "bf16", np.float32)
    assert policy == mp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    assert isinstance(policy.compute_dtype, np.dtype)
    assert hash(policy) == hash(mp.get_policy("p=f32,c=bf16,o=f32"))


@pytest.mark.parametrize("bad", [jnp.int32, "int8", "notadtype"])
def test_policy_rejects_non_floating(bad):
    with pytest.raises(TypeError, match=r"compute_dtype must be a floating dtype"):
        mp.Policy(jnp.float32, bad, jnp.float32)


def test_policy_is_frozen():
    policy = mp.get_policy("c=bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = F16  # type: ignore[misc]


def test_with_output_dtype():
    policy = mp.get_policy("p=f32,c=bf16,o=bf16")
    out = policy.with_output_dtype(jnp.float32)
    assert out == mp.Policy(F32, BF16, F32)
    assert policy.output_dtype == BF16  # the original is unchanged
    assert policy.with_output_dtype("e4m3").output_dtype == E4M3


def _params():
    return {
        "w": scaled_array(jnp.array([1.0, 2.5], jnp.float32), 0.25),
        "b": jnp.array([0.5, -1.0], jnp.float32),
        "step": jnp.array(3, jnp.int32),
        "mask": jnp.array([True, False]),
        "np": np.array([1.5], np.float32),
        "lr": 0.1,
        "name": "layer",
        "none": None,
        "nested": [(jnp.ones((2, 2), jnp.float16), jnp.arange(3))],
    }


@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_policy_casting(method):
    policy = mp.Policy(F16, BF16, E4M3)
    target = {"cast_to_param": F16, "cast_to_compute": BF16, "cast_to_output": E4M3}[method]
    params = _params()
    out = getattr(policy, method)(params)

    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
    assert isinstance(out["w"], ScaledArray)
    assert out["w"].dtype == target
    assert out["w"].scale is params["w"].scale  # the scale is kept as is
    assert out["b"].dtype == target
    assert out["np"].dtype == target
    assert out["nested"][0][0].dtype == target
    # Non-floating leaves, Python scalars and other objects pass through.
    assert out["step"] is params["step"]
    assert out["mask"] is params["mask"]
    assert out["nested"][0][1] is params["nested"][0][1]
    assert out["lr"] == 0.1 and out["name"] == "layer" and out["none"] is None


def test_casting_values():
    policy = mp.get_policy("p=f32,c=bf16,o=f32")
    x = scaled_array(jnp.array([1.0, 3.0]), 2.0**-20)
    y = policy.cast_to_compute(x)
    np.testing.assert_array_equal(np.asarray(y.data, np.float32), [1.0, 3.0])
    z = policy.cast_to_output(y)
    assert z.dtype == F32
    np.testing.assert_array_equal(z.to_array(), x.to_array())


def test_casting_under_jit():
    policy = mp.get_policy("p=f32,c=f16,o=f32")
    out = jax.jit(policy.cast_to_compute)(_params_arrays())
    assert out["w"].dtype == F16 and out["w"].scale.dtype == F32
    assert out["step"].dtype == jnp.int32


def _params_arrays():
    return {
        "w": scaled_array(jnp.ones(2), 4.0),
        "step": jnp.array(3, jnp.int32),
    }


def test_cast_to_full_and_half():
    params = _params()
    half = mp.cast_to_half(params)
    assert half["w"].dtype == mp.half_dtype() and half["b"].dtype == mp.half_dtype()
    assert half["step"].dtype == jnp.int32
    full = mp.cast_to_full(half)
    assert full["w"].dtype == F32 and full["nested"][0][0].dtype == F32
    assert float(full["w"].scale) == 0.25


def test_half_dtype():
    expected = BF16 if jax.default_backend() == "tpu" else F16
    assert mp.half_dtype() == expected
    assert mp.get_policy("c=half").compute_dtype == expected


def test_public_names():
    expected = {
        "BooleanScalarError",
        "Policy",
        "get_policy",
        "cast_to_full",
        "cast_to_half",
        "half_dtype",
        "LossScale",
        "NoOpLossScale",
        "StaticLossScale",
        "DynamicLossScale",
        "all_finite",
        "select_tree",
    }
    assert set(mp.__all__) == expected
    for name in expected:
        assert hasattr(mp, name)
