"""Mixed-precision policies: which dtype parameters, computations and outputs use.

The API follows DeepMind's `jmp` (`Policy`, `get_policy`, `cast_to_full`,
`cast_to_half`, `half_dtype`), so that code can switch by changing an import.
Casting touches floating-point leaves only, and casts a ScaledArray by casting
its data (the scale is kept).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..tree._src import astype_leaf
from ..tree._src import map as _tree_map

DTypeLike = Any

__all__ = ["Policy", "get_policy", "cast_to_full", "cast_to_half", "half_dtype"]


def half_dtype() -> np.dtype:
    """The 16-bit float of the default backend: bfloat16 on TPU, float16 otherwise.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.mp.half_dtype() == ("bfloat16" if jax.default_backend() == "tpu" else "float16")
        True
    """
    return jnp.dtype(jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)


def _cast_floating_to(tree: Any, dtype: DTypeLike) -> Any:
    return _tree_map(lambda x: astype_leaf(x, dtype, floating_only=True), tree)


def cast_to_full(tree: Any) -> Any:
    """Cast the floating-point leaves of `tree` to float32 (ScaledArrays: their data).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.mp.cast_to_full({"x": jnp.ones(2, jnp.bfloat16), "n": jnp.arange(2)})["x"].dtype
        dtype('float32')
    """
    return _cast_floating_to(tree, jnp.float32)


def cast_to_half(tree: Any) -> Any:
    """Cast the floating-point leaves of `tree` to :func:`half_dtype` (ScaledArrays: their data).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.mp.cast_to_half(jnp.ones(2)).dtype == jsa.mp.half_dtype()
        True
    """
    return _cast_floating_to(tree, half_dtype())


def _dtype_aliases() -> dict[str, str]:
    """Accepted dtype names, mapped to the canonical `jnp` dtype name ("half": see `half_dtype`)."""
    aliases = {
        "f16": "float16",
        "float16": "float16",
        "bf16": "bfloat16",
        "bfloat16": "bfloat16",
        "f32": "float32",
        "float32": "float32",
        "full": "float32",
        "single": "float32",
        "f64": "float64",
        "float64": "float64",
        "double": "float64",
        "f8e4m3": "float8_e4m3fn",
        "e4m3": "float8_e4m3fn",
        "f8e5m2": "float8_e5m2",
        "e5m2": "float8_e5m2",
        "half": "half",
    }
    # Every other low-precision float of this JAX version, by its full name.
    jnp_names = set(dir(jnp))
    for name in sorted(jnp_names):
        if name.startswith(("float8_", "float6_", "float4_")):
            try:
                if jnp.issubdtype(jnp.dtype(getattr(jnp, name)), jnp.floating):
                    aliases[name] = name
            except TypeError:
                continue
    return {alias: target for alias, target in aliases.items() if target in jnp_names | {"half"}}


_DTYPE_ALIASES = _dtype_aliases()

_KEY_ALIASES = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}


def _accepted_dtype_names() -> str:
    return ", ".join(sorted(_DTYPE_ALIASES))


def _dtype_from_name(name: str) -> np.dtype | None:
    target = _DTYPE_ALIASES.get(name.strip().lower())
    if target is None:
        return None
    if target == "half":
        return half_dtype()
    return jnp.dtype(getattr(jnp, target))


def _as_floating_dtype(value: DTypeLike, what: str) -> np.dtype:
    dtype = _dtype_from_name(value) if isinstance(value, str) else None
    if dtype is None:
        try:
            dtype = jnp.dtype(value)
        except TypeError:
            raise TypeError(
                f"Policy {what} must be a floating dtype, got {value!r}; accepted names: "
                f"{_accepted_dtype_names()}."
            ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"Policy {what} must be a floating dtype, got {dtype}.")
    return dtype


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the dtypes of parameters, computations and outputs.

    Dtypes may be given as anything `jnp.dtype` accepts or by the names
    :func:`get_policy` accepts ("bf16", "f32", "e4m3", ...). Casting methods
    cast floating-point leaves only (integer, boolean and Python scalar leaves
    pass through) and cast a ScaledArray by casting its data, keeping its scale.

    Attributes:
        param_dtype: dtype parameters are stored in.
        compute_dtype: dtype computations run in.
        output_dtype: dtype of the outputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> policy = jsa.mp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
        >>> print(policy)
        p=float32,c=bfloat16,o=float32
        >>> x = jsa.scaled_array(jnp.ones(2), 4.0)
        >>> y = policy.cast_to_compute({"x": x, "step": jnp.int32(3)})
        >>> y["x"].dtype, y["x"].scale, y["step"].dtype
        (dtype(bfloat16), Array(4., dtype=float32), dtype('int32'))
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _as_floating_dtype(getattr(self, field), field))

    def cast_to_param(self, tree: Any) -> Any:
        """Cast the floating-point leaves of `tree` to `param_dtype`.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jax_scaled_arithmetics as jsa
            >>> jsa.mp.get_policy("p=f16").cast_to_param(jnp.ones(2)).dtype
            dtype('float16')
        """
        return _cast_floating_to(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Cast the floating-point leaves of `tree` to `compute_dtype`.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jax_scaled_arithmetics as jsa
            >>> jsa.mp.get_policy("c=bf16").cast_to_compute([jnp.ones(2)])[0].dtype
            dtype(bfloat16)
        """
        return _cast_floating_to(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Cast the floating-point leaves of `tree` to `output_dtype`.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jax_scaled_arithmetics as jsa
            >>> jsa.mp.get_policy("c=bf16,o=f32").cast_to_output(jnp.ones(2, jnp.bfloat16)).dtype
            dtype('float32')
        """
        return _cast_floating_to(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: DTypeLike) -> Policy:
        """A copy of this policy with another output dtype.

        Examples:
            >>> import jax_scaled_arithmetics as jsa
            >>> print(jsa.mp.get_policy("c=bf16").with_output_dtype("f32"))
            p=float32,c=bfloat16,o=float32
        """
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        return f"p={self.param_dtype.name},c={self.compute_dtype.name},o={self.output_dtype.name}"


def get_policy(policy_name: str) -> Policy:
    """Parse a policy string such as "p=f32,c=bf16,o=f32".

    Entries are `key=dtype`, separated by commas; a dtype name alone (`"float16"`, as in
    `jmp`) is the dtype of all three. Keys: `p`/`params`,
    `c`/`compute`, `o`/`output`. Dtype names: `f16`/`float16`, `bf16`/`bfloat16`,
    `f32`/`float32`/`full`/`single`, `f64`/`float64`/`double`,
    `f8e4m3`/`e4m3`/`float8_e4m3fn`, `f8e5m2`/`e5m2`/`float8_e5m2`, `half`
    (:func:`half_dtype`), and every other `jnp` float8 (and float6/float4) dtype
    by its full name. Keys and names are case-insensitive. Missing entries
    default as follows: params float32, compute follows params, output follows
    compute. `str(policy)` parses back to the same policy.

    Raises:
        ValueError: an entry is not `key=dtype`, a key is unknown or given twice,
            or a dtype name is unknown.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> print(jsa.mp.get_policy("p=f32,c=bf16,o=f32"))
        p=float32,c=bfloat16,o=float32
        >>> print(jsa.mp.get_policy("c=e4m3"))
        p=float32,c=float8_e4m3fn,o=float8_e4m3fn
        >>> print(jsa.mp.get_policy("bf16"))
        p=bfloat16,c=bfloat16,o=bfloat16
    """
    if not isinstance(policy_name, str):
        raise TypeError(f"get_policy expects a string, got {type(policy_name).__name__}.")
    if "=" not in policy_name and "," not in policy_name:
        # One dtype name for all three, as in `jmp` ("float16", "half", "f32").
        dtype = _dtype_from_name(policy_name.strip())
        if dtype is None:
            raise ValueError(
                f"Unknown dtype {policy_name!r} in policy {policy_name!r}; accepted names: "
                f"{_accepted_dtype_names()}."
            )
        return Policy(dtype, dtype, dtype)
    parsed: dict[str, np.dtype] = {}
    for entry in policy_name.split(","):
        key, sep, value = entry.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not key or not value:
            raise ValueError(
                f"Malformed entry {entry.strip()!r} in policy {policy_name!r}: expected "
                "comma-separated 'key=dtype' entries, e.g. 'p=f32,c=bf16,o=f32'."
            )
        field = _KEY_ALIASES.get(key)
        if field is None:
            raise ValueError(
                f"Unknown key {key!r} in policy {policy_name!r}; accepted keys: "
                f"{', '.join(_KEY_ALIASES)}."
            )
        if field in parsed:
            raise ValueError(f"Key {key!r} ({field}) given twice in policy {policy_name!r}.")
        dtype = _dtype_from_name(value)
        if dtype is None:
            raise ValueError(
                f"Unknown dtype {value!r} for key {key!r} in policy {policy_name!r}; accepted "
                f"names: {_accepted_dtype_names()}."
            )
        parsed[field] = dtype
    param_dtype = parsed.get("param_dtype", jnp.dtype(jnp.float32))
    compute_dtype = parsed.get("compute_dtype", param_dtype)
    output_dtype = parsed.get("output_dtype", compute_dtype)
    return Policy(param_dtype, compute_dtype, output_dtype)
