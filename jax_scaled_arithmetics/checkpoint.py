"""Checkpoints of ScaledArray pytrees: Flax serialization and Orbax, bit-exact and checked.

A ScaledArray is saved as its two arrays, `data` (in its own dtype: float16, bfloat16,
float8_e4m3fn, ...) and `scale`, so a restore gives back the same bits.

- Flax (`flax.serialization.to_bytes` / `from_bytes`, `to_state_dict` / `from_state_dict`):
  importing this module (`import jax_scaled_arithmetics.checkpoint`, or the first use of
  `jsa.checkpoint`) registers ScaledArray with `flax.serialization` when Flax is
  installed. Its state dict is
  `{"data": data, "scale": scale}`; restoring into a ScaledArray whose data or scale has
  another dtype or shape raises a ValueError naming the path.
- Orbax (`orbax-checkpoint`): ScaledArray is a pytree, so Orbax saves and restores it
  without registration, but a restore into a template of another dtype silently casts.
  :func:`save` and :func:`restore` wrap `orbax.checkpoint.StandardCheckpointer` and check the
  stored dtypes and shapes against the template first (:func:`check_compatible`).

Neither Flax nor Orbax is needed to import this module.

Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> import flax.serialization
    >>> import jax_scaled_arithmetics as jsa
    >>> import jax_scaled_arithmetics.checkpoint  # registers ScaledArray with Flax
    >>> params = {"w": jsa.scaled_array(jnp.array([1.5, -2.0], jnp.float16), 2.0**-20)}
    >>> raw = flax.serialization.to_bytes(params)
    >>> back = flax.serialization.from_bytes(params, raw)
    >>> back["w"].data.dtype, float(back["w"].scale) == 2.0**-20
    (dtype('float16'), True)
    >>> path = tempfile.mkdtemp() + "/step_1"
    >>> jsa.checkpoint.save(path, params)
    >>> jsa.checkpoint.restore(path, params)["w"].data
    Array([ 1.5, -2. ], dtype=float16)
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from .core.datatype import ScaledArray

__all__ = [
    "FLAX_REGISTERED",
    "check_compatible",
    "restore",
    "save",
    "scaled_array_from_state_dict",
    "scaled_array_to_state_dict",
]


# --- Flax serialization ------------------------------------------------------------------


def scaled_array_to_state_dict(x: ScaledArray) -> dict[str, Any]:
    """Flax state dict of a ScaledArray: `{"data": x.data, "scale": x.scale}`.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> sorted(jsa.checkpoint.scaled_array_to_state_dict(jsa.scaled_array([1.0], 2.0)))
        ['data', 'scale']
    """
    return {"data": x.data, "scale": x.scale}


def _describe(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}{list(np.shape(x))}"


def scaled_array_from_state_dict(target: ScaledArray, state: Any) -> ScaledArray:
    """Rebuild a ScaledArray from its Flax state dict, checked against `target`.

    The restored `data` and `scale` must have the dtypes and shapes of `target`'s; their
    bits are used as stored.

    Raises:
        ValueError: `state` is not a ScaledArray state dict, or a dtype or shape differs
            (the message names the path in the restored tree).

    Examples:
        >>> import numpy as np, jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array(np.array([1.0], np.float16), 4.0, npapi=np)
        >>> y = jsa.checkpoint.scaled_array_from_state_dict(
        ...     x, {"data": np.array([3.0], np.float16), "scale": np.float32(0.5)})
        >>> y.data, y.scale
        (array([3.], dtype=float16), np.float32(0.5))
    """
    where = _flax_path()
    if not isinstance(state, dict) or set(state) != {"data", "scale"}:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"Cannot restore the ScaledArray at {where}: expected a state dict with keys "
            f"['data', 'scale'], got {got}."
        )
    for field in ("data", "scale"):
        stored, expected = state[field], getattr(target, field)
        if not hasattr(stored, "dtype"):
            stored = np.asarray(stored)
        if np.dtype(stored.dtype) != np.dtype(expected.dtype) or np.shape(stored) != np.shape(
            expected
        ):
            raise ValueError(
                f"Cannot restore the ScaledArray at {where}: its stored {field} is "
                f"{_describe(stored)}, the template's is {_describe(expected)}."
            )
    return ScaledArray(state["data"], state["scale"])


def _flax_path() -> str:
    """The path being restored, as `params/0/w` (Flax records it as `./params/0/w`)."""
    from flax.serialization import current_path

    path = current_path()
    path = path[1:] if path.startswith(".") else path
    return path.strip("/") or "the root"


def _register_flax() -> bool:
    try:
        from flax import serialization
    except ImportError:
        return False
    if not serialization.is_serializable(ScaledArray):
        serialization.register_serialization_state(
            ScaledArray, scaled_array_to_state_dict, scaled_array_from_state_dict
        )
    return True


FLAX_REGISTERED: bool = _register_flax()
"""Whether ScaledArray is registered with `flax.serialization` (Flax is installed)."""


# --- checks and Orbax --------------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(_key_name(k) for k in path): leaf for path, leaf in leaves}


def check_compatible(template: Any, stored: Any) -> None:
    """Check that `stored` has `template`'s structure, dtypes and shapes, leaf by leaf.

    `stored` may be any tree of arrays or of array metadata (Orbax's
    `checkpointer.metadata(path).item_metadata`, a Flax state dict, `jax.eval_shape`'s
    output). Leaves are matched by path, a ScaledArray counting as its `data` and `scale`;
    template leaves without a dtype (Python scalars) are matched by path only.

    Raises:
        ValueError: a leaf is missing on either side or differs in dtype or shape; the
            message lists them (the first ten), with their paths.

    Examples:
        >>> import jax.numpy as jnp, jax_scaled_arithmetics as jsa
        >>> x = {"w": jsa.as_scaled_array(jnp.ones(2), dtype=jnp.float16)}
        >>> jsa.checkpoint.check_compatible(x, {"w": {"data": jnp.zeros(2, jnp.float16),
        ...                                           "scale": jnp.float32(1)}})
        >>> jsa.checkpoint.check_compatible(x, {"w": jnp.ones(2)})
        Traceback (most recent call last):
        ...
        ValueError: The checkpoint does not match the template:
          w/data: in the template (float16[2]), not in the checkpoint
          w/scale: in the template (float32[]), not in the checkpoint
          w: in the checkpoint (float32[2]), not in the template
    """
    stored = getattr(stored, "tree", stored)  # Orbax's TreeMetadata
    expected, actual = _flat(template), _flat(stored)
    problems = []
    for path, want in expected.items():
        name = "/".join(path)
        if path not in actual:
            what = f" ({_describe(want)})" if hasattr(want, "dtype") else ""
            problems.append(f"{name}: in the template{what}, not in the checkpoint")
            continue
        have = actual[path]
        if not hasattr(want, "dtype") or not hasattr(have, "dtype"):
            continue
        if np.dtype(want.dtype) != np.dtype(have.dtype) or tuple(np.shape(want)) != tuple(
            have.shape
        ):
            problems.append(f"{name}: stored {_describe(have)}, template {_describe(want)}")
    for path, have in actual.items():
        if path not in expected:
            what = f" ({_describe(have)})" if hasattr(have, "dtype") else ""
            problems.append(f"{'/'.join(path)}: in the checkpoint{what}, not in the template")
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        lines = "\n  ".join(problems[:10])
        raise ValueError(f"The checkpoint does not match the template:\n  {lines}{more}")


def save(directory: str | os.PathLike[str], tree: Any, *, force: bool = False) -> None:
    """Save a pytree (ScaledArrays included) with Orbax's `StandardCheckpointer`.

    Args:
        directory: the checkpoint's directory (created; it must not exist unless `force`).
        tree: parameters, optimizer states, ... with ScaledArray, array and scalar leaves.
        force: overwrite an existing checkpoint.

    Examples:
        >>> import tempfile, jax.numpy as jnp, jax_scaled_arithmetics as jsa
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> jsa.checkpoint.save(path, {"w": jsa.as_scaled_array(jnp.ones(2), dtype=jnp.float16)})
        >>> sorted(os.listdir(path))[:1]
        ['_CHECKPOINT_METADATA']
    """
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(directory), tree, force=force)
        checkpointer.wait_until_finished()


def restore(directory: str | os.PathLike[str], template: Any) -> Any:
    """Restore an Orbax checkpoint into `template`'s structure, checking dtypes and shapes.

    Args:
        directory: a checkpoint written by :func:`save` (or `StandardCheckpointer`).
        template: a tree like the saved one: arrays or `jax.ShapeDtypeStruct`s (for
            instance `jax.eval_shape` of the initialisation), ScaledArrays of either.

    Returns:
        The saved tree, with ScaledArrays where the template has them, bit-exact.

    Raises:
        ValueError: the checkpoint's structure, dtypes or shapes differ from the template's
            (Orbax itself would cast to the template's dtype).

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp, jax_scaled_arithmetics as jsa
        >>> x = {"w": jsa.scaled_array(jnp.array([1.0, 3.0], jnp.bfloat16), 2.0**-30)}
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> jsa.checkpoint.save(path, x)
        >>> y = jsa.checkpoint.restore(path, jax.eval_shape(lambda: x))
        >>> y["w"].data, float(y["w"].scale) == 2.0**-30
        (Array([1, 3], dtype=bfloat16), True)
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(directory)
    with ocp.StandardCheckpointer() as checkpointer:
        check_compatible(template, checkpointer.metadata(path).item_metadata)
        return checkpointer.restore(path, template)
