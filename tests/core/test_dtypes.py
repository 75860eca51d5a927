"""`compute_dtype`: the one place the package decides what narrow data computes in."""

import re
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core.dtypes import compute_dtype


@pytest.mark.parametrize(
    "dtypes, expected",
    [
        ((jnp.float16,), np.float32),
        ((jnp.bfloat16,), np.float32),
        ((ml_dtypes.float8_e4m3fn,), np.float32),
        ((ml_dtypes.float4_e2m1fn,), np.float32),
        ((np.float32,), np.float32),
        ((np.float64,), np.float64),
        ((np.int32,), np.int32),
        ((jnp.float16, np.float32), np.float32),
        ((jnp.bfloat16, np.float64), np.float64),
        ((np.int32, jnp.float16), np.float32),
    ],
)
def test_compute_dtype(dtypes, expected):
    assert compute_dtype(*dtypes) == np.dtype(expected)


def test_needs_a_dtype():
    with pytest.raises(TypeError, match="at least one dtype"):
        compute_dtype()


def test_the_package_computes_narrow_data_in_float32():
    """A float16 value past float16's range (2^20 * 2^-10) comes back through to_array in
    float32 because the product is computed in compute_dtype's float32."""
    x = jsa.scaled_array(np.full(3, 2.0**10, np.float16), np.float32(2.0**10))
    np.testing.assert_array_equal(x.to_array(jnp.float32), np.full(3, 2.0**20, np.float32))
    assert jsa.lax.base.compute_dtype is compute_dtype


def test_no_other_module_writes_the_choice_again():
    """The float32-or-float64 choice was written out in 14 places; it is `compute_dtype`."""
    package = Path(jsa.__file__).parent
    pattern = re.compile(r"float64 if |float64\)? else ")
    written = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "dtypes.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not written, written
