"""Checkpoints of ScaledArray pytrees: Flax serialization and Orbax, bit-exact and checked.

A ScaledArray is saved as its two arrays, `data` (in its own dtype: float16, bfloat16,
float8_e4m3fn, ...) and `scale`, so a restore gives back the same bits.

- Flax (`flax.serialization.to_bytes` / `from_bytes`, `to_state_dict` / `from_state_dict`):
  ScaledArray and `quantization.MXArray` are registered with `flax.serialization` when Flax
  is installed, as soon as both `jax_scaled_arithmetics` and `flax.serialization` are
  imported, in either order (`import jax_scaled_arithmetics` does not import Flax). Their
  state dicts are `{"data": data, "scale": scale}` (both types);
  restoring into one whose arrays have another dtype or shape raises a ValueError naming
  the path.
- Orbax (`orbax-checkpoint`): ScaledArray is a pytree, so Orbax saves and restores it
  without registration, but a restore into a template of another dtype silently casts.
  :func:`save` and :func:`restore` wrap `orbax.checkpoint.StandardCheckpointer` and check the
  stored dtypes and shapes against the template first (:func:`check_compatible`). A save
  that fails or is killed leaves the previous checkpoint whole (docs/design.md,
  "Checkpoints: what a failed save leaves").
- Sharded state: :func:`save` writes arrays sharded over the devices of this process as
  they are (each shard once), and :func:`restore` reads them onto any mesh: the template's
  shardings, or `shardings=` (one `jax.sharding.Sharding`, or a tree as
  `jsa.sharding.like` gives: data as the parameter, per-tensor scales replicated, block
  scales with their blocks). The bits are the same whatever the meshes.

Neither Flax nor Orbax is needed to import this module.

Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> import flax.serialization
    >>> import jax_scaled_arithmetics as jsa
    >>> params = {"w": jsa.scaled_array(jnp.array([1.5, -2.0], jnp.float16), 2.0**-20)}
    >>> raw = flax.serialization.to_bytes(params)
    >>> back = flax.serialization.from_bytes(params, raw)
    >>> back["w"].data.dtype, float(back["w"].scale) == 2.0**-20
    (dtype('float16'), True)
    >>> path = tempfile.mkdtemp() + "/step_1"
    >>> jsa.checkpoint.save(path, params)
    >>> jsa.checkpoint.restore(path, params)["w"].data
    Array([ 1.5, -2. ], dtype=float16)
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    >>> back = jsa.checkpoint.restore(path, params, shardings=NamedSharding(mesh, P("fsdp")))
    >>> back["w"].data.sharding.spec, back["w"].scale.sharding.spec
    (P('fsdp',), P())
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import sys
import tempfile
from typing import Any

import jax
import numpy as np

from . import sharding as jsa_sharding
from .core.datatype import PackedScales, ScaledArray, is_scaled_leaf, pack_scales
from .quantization.mx_array import MXArray

__all__ = [
    "FLAX_REGISTERED",
    "check_compatible",
    "mx_array_from_state_dict",
    "mx_array_to_state_dict",
    "restore",
    "save",
    "scaled_array_from_state_dict",
    "scaled_array_to_state_dict",
]


# --- dtypes ------------------------------------------------------------------------------


def _is_extended(dtype: Any) -> bool:
    """JAX's own dtypes (typed PRNG keys), which numpy cannot interpret."""
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))


def _same_dtype(a: Any, b: Any) -> bool:
    if _is_extended(a) or _is_extended(b):
        return _is_extended(a) and _is_extended(b) and a == b
    return bool(np.dtype(a) == np.dtype(b))


def _describe(x: Any) -> str:
    name = str(x.dtype) if _is_extended(x.dtype) else np.dtype(x.dtype).name
    return f"{name}{list(np.shape(x))}"


# --- Flax serialization ------------------------------------------------------------------


def scaled_array_to_state_dict(x: ScaledArray) -> dict[str, Any]:
    """Flax state dict of a ScaledArray: `{"data": x.data, "scale": x.scale}`.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> sorted(jsa.checkpoint.scaled_array_to_state_dict(jsa.scaled_array([1.0], 2.0)))
        ['data', 'scale']
    """
    return {"data": x.data, "scale": x.scale}


def _checked_state(target: Any, state: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """`state` if it is a state dict of `fields` with `target`'s dtypes and shapes."""
    kind, where = type(target).__name__, _flax_path()
    if not isinstance(state, dict) or set(state) != set(fields):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"Cannot restore the {kind} at {where}: expected a state dict with keys "
            f"{sorted(fields)}, got {got}."
        )
    for field in fields:
        stored, expected = state[field], getattr(target, field)
        if not hasattr(stored, "dtype"):
            stored = np.asarray(stored)
        if not _same_dtype(stored.dtype, expected.dtype) or np.shape(stored) != np.shape(expected):
            raise ValueError(
                f"Cannot restore the {kind} at {where}: its stored {field} is "
                f"{_describe(stored)}, the template's is {_describe(expected)}."
            )
    return state


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
    state = _checked_state(target, state, ("data", "scale"))
    return ScaledArray(state["data"], state["scale"])


def mx_array_to_state_dict(x: MXArray) -> dict[str, Any]:
    """Flax state dict of an MXArray: `{"data": x.data, "scale": x.scale}`.

    Its format, block size, axis and length are not stored: a restore takes them from the
    target.

    Examples:
        >>> import jax.numpy as jnp, jax_scaled_arithmetics as jsa
        >>> mx = jsa.quantization.block_quantize(jnp.ones(4), "float8_e4m3fn", block_size=2)
        >>> sorted(jsa.checkpoint.mx_array_to_state_dict(mx))
        ['data', 'scale']
    """
    return {"data": x.data, "scale": x.scale}


def mx_array_from_state_dict(target: MXArray, state: Any) -> MXArray:
    """Rebuild an MXArray from its Flax state dict, checked against `target`.

    The restored `data` and `scale` must have the dtypes and shapes of `target`'s; their
    bits are used as stored, and `target`'s format, block size, axis and length are kept.

    Raises:
        ValueError: `state` is not an MXArray state dict, or a dtype or shape differs
            (the message names the path in the restored tree).

    Examples:
        >>> import jax.numpy as jnp, jax_scaled_arithmetics as jsa
        >>> mx = jsa.quantization.block_quantize(jnp.arange(4.0), "float8_e4m3fn", block_size=2)
        >>> zero = jsa.quantization.block_quantize(jnp.zeros(4), "float8_e4m3fn", block_size=2)
        >>> state = jsa.checkpoint.mx_array_to_state_dict(mx)
        >>> jsa.checkpoint.mx_array_from_state_dict(zero, state).dequantize()
        Array([0., 1., 2., 3.], dtype=float32)
    """
    state = _checked_state(target, state, ("data", "scale"))
    return dataclasses.replace(target, data=state["data"], scale=state["scale"])


def _packed_to_state_dict(x: PackedScales) -> Any:
    """A packed tree's Flax state: its unpacked tree's, so either form restores into
    either."""
    from flax.serialization import to_state_dict

    return to_state_dict(x.unpack())


def _packed_from_state_dict(target: PackedScales, state: Any) -> PackedScales:
    from flax.serialization import from_state_dict

    return pack_scales(from_state_dict(target.unpack(), state))


def _flax_path() -> str:
    """The path being restored, as `params/0/w` (Flax records it as `./params/0/w`)."""
    from flax.serialization import current_path

    path = current_path()
    path = path[1:] if path.startswith(".") else path
    return path.strip("/") or "the root"


def _register_flax() -> bool:
    """Register ScaledArray, MXArray and PackedScales with `flax.serialization`; False
    without Flax.

    Also called by the import hook of `_flax_registration` while `flax.serialization` is
    being imported (before Flax sets it as an attribute of `flax`): hence `sys.modules`.
    """
    try:
        import flax.serialization  # noqa: F401
    except ImportError:
        return False
    serialization = sys.modules["flax.serialization"]
    for cls, to_state_dict, from_state_dict in (
        (ScaledArray, scaled_array_to_state_dict, scaled_array_from_state_dict),
        (MXArray, mx_array_to_state_dict, mx_array_from_state_dict),
        (PackedScales, _packed_to_state_dict, _packed_from_state_dict),
    ):
        if not serialization.is_serializable(cls):
            serialization.register_serialization_state(cls, to_state_dict, from_state_dict)
    return True


FLAX_REGISTERED: bool = _register_flax()
"""Whether ScaledArray and MXArray are registered with `flax.serialization` (Flax is
installed). Importing this module imports Flax when it is installed.

Examples:
    >>> import jax_scaled_arithmetics as jsa
    >>> jsa.checkpoint.FLAX_REGISTERED  # Flax is installed here
    True
"""


# --- checks ------------------------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flat(tree: Any, is_leaf: Any = None) -> dict[tuple[str, ...], Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {tuple(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _mismatch(want: Any, have: Any) -> str | None:
    """How a stored leaf differs from the template's, or None."""
    problem = f"stored {_describe(have)}, template {_describe(want)}"
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key) and not _is_extended(have.dtype):
        # Orbax stores a typed key as its key data (uint32, with a trailing axis).
        data = jax.eval_shape(jax.random.key_data, want)
        problem += f" (saved as {_describe(data)})"
        want = data
    if _same_dtype(want.dtype, have.dtype) and tuple(np.shape(want)) == tuple(have.shape):
        return None
    return problem


def check_compatible(template: Any, stored: Any) -> None:
    """Check that `stored` has `template`'s structure, dtypes and shapes, leaf by leaf.

    `stored` may be any tree of arrays or of array metadata (Orbax's
    `checkpointer.metadata(path).item_metadata`, a Flax state dict, `jax.eval_shape`'s
    output). Leaves are matched by path, a ScaledArray counting as its `data` and `scale`;
    template leaves without a dtype (Python scalars) are matched by path only. A typed PRNG
    key of the template matches a key of the same implementation, or its key data (as
    Orbax stores it: `jax.random.key_data`'s dtype and shape).

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
        problem = _mismatch(want, have)
        if problem is not None:
            problems.append(f"{name}: {problem}")
    for path, have in actual.items():
        if path not in expected:
            what = f" ({_describe(have)})" if hasattr(have, "dtype") else ""
            problems.append(f"{'/'.join(path)}: in the checkpoint{what}, not in the template")
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        lines = "\n  ".join(problems[:10])
        raise ValueError(f"The checkpoint does not match the template:\n  {lines}{more}")


# --- Orbax: write beside, then swap --------------------------------------------------------
#
# `save(".../ckpt")` writes into a fresh hidden sibling `.ckpt.jsa-staging-<host>-<pid>-<x>/`
# (Orbax's own temporaries live inside it), then moves the finished checkpoint into place:
# `ckpt` -> `.ckpt.jsa-previous`, staged -> `ckpt`, remove `.ckpt.jsa-previous`. At every
# moment `ckpt` or `.ckpt.jsa-previous` is a whole checkpoint; `restore` reads the latter
# when the former is missing. See docs/design.md.


def _sibling(path: str, suffix: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.jsa-{suffix}")


def _process_alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # on Windows, os.kill(pid, 0) would kill it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _clean_up_after_dead_saves(path: str) -> None:
    """Remove the staging directories of dead processes on this host, and settle a backup.

    A backup beside an existing checkpoint is stale (its save died before removing it);
    without one, a save died between its two renames: the backup is put back.
    """
    parent, host = os.path.dirname(path), socket.gethostname()
    prefix = os.path.basename(_sibling(path, "staging-"))
    for entry in os.listdir(parent):
        owner = entry[len(prefix) :].rsplit("-", 2) if entry.startswith(prefix) else []
        if len(owner) == 3 and owner[0] == host and owner[1].isdigit():
            if not _process_alive(int(owner[1])):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    backup = _sibling(path, "previous")
    if os.path.lexists(backup):
        if os.path.lexists(path):
            _remove(backup)
        else:
            os.rename(backup, path)


def _swap_into_place(staged: str, path: str) -> None:
    if not os.path.lexists(path):
        os.rename(staged, path)
        return
    backup = _sibling(path, "previous")
    os.rename(path, backup)
    try:
        os.rename(staged, path)
    except BaseException:
        # If this fails too, `restore` reads the backup and the next save puts it back.
        with contextlib.suppress(OSError):
            os.rename(backup, path)
        raise
    with contextlib.suppress(OSError):  # else the next save removes it
        _remove(backup)


def save(directory: str | os.PathLike[str], tree: Any, *, force: bool = False) -> None:
    """Save a pytree (ScaledArrays included) with Orbax's `StandardCheckpointer`.

    The checkpoint is written beside `directory`, in a hidden staging directory, and
    renamed into place when complete: a save that fails (or is killed) leaves the previous
    checkpoint at `directory`, whole. Saves to one `directory` must not run concurrently.
    Arrays sharded over this process's devices are saved as they are, each shard once
    (:func:`restore` can read them onto another mesh).

    Args:
        directory: the checkpoint's directory (created; it must not exist unless `force`).
        tree: parameters, optimizer states, ... with ScaledArray, array and scalar leaves.
        force: overwrite an existing checkpoint.

    Raises:
        ValueError: `directory` exists and `force` is False (raised before anything is
            written); Orbax cannot save a leaf (strings, dtypes that tensorstore lacks).
        NotImplementedError: JAX runs several processes (multi-host): each would stage
            the checkpoint in its own directory.

    Examples:
        >>> import tempfile, jax.numpy as jnp, jax_scaled_arithmetics as jsa
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> jsa.checkpoint.save(path, {"w": jsa.as_scaled_array(jnp.ones(2), dtype=jnp.float16)})
        >>> sorted(os.listdir(path))[:1]
        ['_CHECKPOINT_METADATA']
    """
    import orbax.checkpoint as ocp

    if jax.process_count() > 1:
        raise NotImplementedError(
            "jsa.checkpoint.save writes from one process only; with several JAX processes, "
            "use orbax.checkpoint directly (and jsa.checkpoint.restore to restore)."
        )
    path = os.path.abspath(directory)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _clean_up_after_dead_saves(path)
    if os.path.lexists(path) and not force:
        raise ValueError(f"Destination {path} already exists.")  # Orbax's message
    owner = f"{socket.gethostname()}-{os.getpid()}-"
    staging = tempfile.mkdtemp(prefix=f".{name}.jsa-staging-{owner}", dir=parent)
    try:
        staged = os.path.join(staging, name)
        # Directories created asynchronously outlive a save that raises (a leaf Orbax
        # cannot save): Orbax 0.12.8 creates them after the call returns, too late to remove.
        options = ocp.options.AsyncOptions(create_directories_asynchronously=False)
        with ocp.StandardCheckpointer(async_options=options) as checkpointer:
            checkpointer.save(staged, tree)
            checkpointer.wait_until_finished()
        _swap_into_place(staged, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _checkpoint_directory(path: str) -> str:
    """`path`, or the backup that a save killed between its two renames left."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"No checkpoint at {path}: it is a file, not a directory.")
    for candidate in (path, _sibling(path, "previous"), path):  # a save may swap meanwhile
        if os.path.isdir(candidate):
            return candidate
    raise FileNotFoundError(f"No checkpoint at {path}: no such directory.")


def _path_name(path: tuple[Any, ...]) -> str:
    return "/".join(_key_name(k) for k in path) or "the root"


def _aligned_shardings(template: Any, shardings: Any) -> Any:
    """`shardings` as a tree of `template`'s structure (leaves matched by path), expanded
    by `jsa.sharding.like`: a ScaledArray of shardings where the template has a ScaledArray."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jsa_sharding.like(template, shardings)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_scaled_leaf)
    wanted = [tuple(_key_name(k) for k in path) for path, _ in leaves]
    given = _flat(shardings, is_leaf=is_scaled_leaf)
    missing = [p for p in wanted if p not in given]
    extra = [p for p in given if p not in set(wanted)]
    if missing or extra:
        problems = [f"{'/'.join(p)}: in the template, not in the shardings" for p in missing]
        problems += [f"{'/'.join(p)}: in the shardings, not in the template" for p in extra]
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        lines = "\n  ".join(problems[:10])
        raise ValueError(f"The shardings do not match the template:\n  {lines}{more}")
    for path in wanted:
        placement = given[path]
        parts = (
            [placement.data, placement.scale] if isinstance(placement, ScaledArray) else [placement]
        )
        for part in parts:
            if part is not None and not isinstance(part, jax.sharding.Sharding):
                raise TypeError(
                    f"jsa.checkpoint.restore: the shardings hold {part!r} at "
                    f"{'/'.join(path) or 'the root'}: expected a jax.sharding.Sharding "
                    "(or None)."
                )
    aligned = jax.tree_util.tree_unflatten(treedef, [given[p] for p in wanted])
    return jsa_sharding.like(template, aligned)


def _sharded_target(template: Any, shardings: Any) -> Any:
    """`template` with `jax.ShapeDtypeStruct`s carrying `shardings` (None: kept as is)."""

    def place(path: tuple[Any, ...], leaf: Any, sharding: Any) -> Any:
        if sharding is None or not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            return leaf
        try:
            target = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            sharding.shard_shape(tuple(leaf.shape))  # an axis split unevenly raises
        except ValueError as e:
            raise ValueError(
                f"Cannot restore {_path_name(path)} ({_describe(leaf)}) with the sharding "
                f"{sharding}: {e}"
            ) from e
        return target

    return jax.tree_util.tree_map_with_path(place, template, shardings)


def restore(directory: str | os.PathLike[str], template: Any, *, shardings: Any = None) -> Any:
    """Restore an Orbax checkpoint into `template`'s structure, checking dtypes and shapes.

    Each array comes back with the sharding of its template leaf (an array's, or a
    `jax.ShapeDtypeStruct`'s `sharding`), or of `shardings` when given: Orbax reads each
    device's shard onto it, whatever mesh the checkpoint was saved from. A leaf without a
    sharding is restored as it was saved (which needs the same devices).

    Args:
        directory: a checkpoint written by :func:`save` (or `StandardCheckpointer`).
        template: a tree like the saved one: arrays or `jax.ShapeDtypeStruct`s (for
            instance `jax.eval_shape` of the initialisation), ScaledArrays of either.
        shardings: None, one `jax.sharding.Sharding` for every leaf, or a tree of
            shardings matching `template` by path, as `jsa.sharding.like` gives (a
            ScaledArray's place may also hold the sharding of the array it represents:
            its scale then follows `jsa.sharding.like`); None leaves keep the template's.

    Returns:
        The saved tree, with ScaledArrays where the template has them, bit-exact. Where a
        save to `directory` was killed while swapping checkpoints, the previous one.

    Raises:
        FileNotFoundError: there is no checkpoint at `directory` (nor one a killed save
            set aside).
        ValueError: `directory` is a file, or a directory that holds no Orbax checkpoint;
            or the checkpoint's structure, dtypes or shapes differ from the template's
            (Orbax itself would cast to the template's dtype); or `shardings` does not
            match the template's structure, or a sharding does not fit its array; or a
            leaf without a sharding was saved from devices that this process lacks.
        TypeError: `shardings` holds something other than a sharding or None.

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp, numpy as np, jax_scaled_arithmetics as jsa
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> x = {"w": jsa.scaled_array(jnp.array([1.0, 3.0], jnp.bfloat16), 2.0**-30)}
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> jsa.checkpoint.save(path, x)
        >>> y = jsa.checkpoint.restore(path, jax.eval_shape(lambda: x))
        >>> y["w"].data, float(y["w"].scale) == 2.0**-30
        (Array([1, 3], dtype=bfloat16), True)
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
        >>> y = jsa.checkpoint.restore(path, x, shardings={"w": NamedSharding(mesh, P("fsdp"))})
        >>> y["w"].data.sharding.spec, y["w"].scale.sharding.spec  # the scale replicated
        (P('fsdp',), P())
        >>> jsa.checkpoint.restore(path + "_2", x)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: No checkpoint at ..._2: no such directory.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(directory)
    found = _checkpoint_directory(path)
    if shardings is not None:
        target = _sharded_target(template, _aligned_shardings(template, shardings))
    else:
        target = template
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(found).item_metadata
        if stored is None:
            raise ValueError(
                f"No checkpoint at {path}: it is a directory, but holds no checkpoint "
                "that Orbax's StandardCheckpointer can read."
            )
        check_compatible(template, stored)
        try:
            return checkpointer.restore(found, target)  # ocp.args.StandardRestore(target)
        except ValueError as e:
            if "Topology mismatch" not in str(e):
                raise
            raise ValueError(
                f"Cannot restore {path} as saved: it was saved from devices this process "
                "does not have. Give the template's leaves shardings, or pass shardings= "
                "(e.g. a NamedSharding on a mesh of this process's devices)."
            ) from e
