"""Where a low-precision program leaves its low-precision dtype: promotions to float32."""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import _compat
from ..core.datatype import ScaledArray, is_array
from ..core.rewrite import of_leaves
from ._program import sub_jaxprs

__all__ = ["DtypePromotion", "PromotionReport", "dtype_promotions"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple(
    {os.path.abspath(p) + os.sep for p in (sysconfig.get_paths()["purelib"],)} | {_PACKAGE_DIR}
)


@dataclasses.dataclass(frozen=True)
class DtypePromotion:
    """One place where low-precision data becomes wider.

    Attributes:
        kind: "input" (an argument leaf already in a wide dtype, e.g. float32 parameters
            of a `param_dtype=float32` layer), or the primitive of an equation that takes
            the low-precision dtype and returns a wider one: `convert_element_type` (e.g.
            Flax's `promote_dtype` when float16 activations meet float32 parameters), a
            mixed-dtype `dot_general`... This library's own float32 work (the update of
            `jsa.optax.scale_optimizer`) is not listed.
        where: the argument's path, or the source line of the user's code that traced the
            conversion ("file:line (function)": the innermost frame outside installed
            packages, falling back to the innermost frame outside JAX).
        library_source: the innermost frame outside JAX (often inside Flax or Equinox).
        shape: the tensor's shape.
        from_dtype: the low-precision dtype ("" for an input).
        to_dtype: the wide dtype.
        count: how many equations (or leaves) of this kind, place and dtypes.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jnp.ones(3, jnp.float16)
        >>> report = jsa.analysis.dtype_promotions(lambda x: x.astype(jnp.float32) * 2, x)
        >>> p = report.promotions[0]
        >>> p.kind, p.from_dtype, p.to_dtype, p.shape
        ('convert_element_type', 'float16', 'float32', (3,))
    """

    kind: str
    where: str
    library_source: str
    shape: tuple[int, ...]
    from_dtype: str
    to_dtype: str
    count: int = 1


@dataclasses.dataclass(frozen=True)
class PromotionReport:
    """The result of :func:`dtype_promotions`.

    Attributes:
        low_dtype: the dtype the program is meant to compute in.
        promotions: inputs in a wider dtype and conversions to one, in program order.
        tensors_by_dtype: floating tensor outputs of the program's equations (rank >= 1,
            sub-jaxprs included, wide accumulations of reductions left out) counted by
            dtype: the share left in the low dtype.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jnp.ones(3, jnp.float16)
        >>> report = jsa.analysis.dtype_promotions(lambda x: x.astype(jnp.float32) * 2, x)
        >>> report.low_dtype, report.tensors_by_dtype, report.wide_fraction
        ('float16', {'float32': 2}, 1.0)
    """

    low_dtype: str
    promotions: tuple[DtypePromotion, ...]
    tensors_by_dtype: dict[str, int]

    @property
    def wide_fraction(self) -> float:
        """Fraction of the floating tensors computed in a dtype wider than `low_dtype`."""
        total = sum(self.tensors_by_dtype.values())
        low = np.dtype(self.low_dtype).itemsize
        wide = sum(n for d, n in self.tensors_by_dtype.items() if np.dtype(d).itemsize > low)
        return wide / total if total else 0.0

    def __str__(self) -> str:
        lines = [
            f"{100 * self.wide_fraction:.1f}% of floating tensors wider than {self.low_dtype} "
            f"({', '.join(f'{d}: {n}' for d, n in sorted(self.tensors_by_dtype.items()))})"
        ]
        for p in self.promotions:
            src = f"{p.from_dtype}->" if p.from_dtype else ""
            times = f" x{p.count}" if p.count > 1 else ""
            lines.append(f"  {p.kind:7s} {src}{p.to_dtype} {p.shape}{times} at {p.where}")
        return "\n".join(lines)


def _frame_text(frame: tuple[str, int, str]) -> str:
    return f"{frame[0]}:{frame[1]} ({frame[2]})"


def _sources(eqn: Any) -> tuple[str, str] | None:
    """(user source, library source); None for this library's own conversions (the float32
    update of `jsa.optax.scale_optimizer`, `stop_scaling`): deliberate, not a promotion."""
    frames = _compat.eqn_user_frames(eqn)
    if not frames or frames[0][0].startswith(_PACKAGE_DIR):
        return None
    frames = [f for f in frames if not f[0].startswith(_PACKAGE_DIR)]
    user = next((f for f in frames if not f[0].startswith(_LIBRARY_DIRS)), frames[0])
    return _frame_text(user), _frame_text(frames[0])


def _is_wider_float(dtype: Any, low: np.dtype) -> bool:
    dtype = np.dtype(dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize > low.itemsize


def _accumulation_only(eqn: Any, consumers: dict[Any, list[Any]], low: np.dtype) -> bool:
    """A conversion whose every use is a reduction whose result goes straight back to `low`
    (wide accumulation, as `jnp.sum`/`jnp.mean` of float16 do): not a promotion."""
    if eqn.primitive.name != "convert_element_type":
        return False
    uses = consumers.get(eqn.outvars[0], [])
    if not uses:
        return False
    for use in uses:
        if not use.primitive.name.startswith(("reduce_", "cum", "argm")):
            return False
        for out in use.outvars:
            if not _returns_to(out, consumers, low):
                return False
    return True


_REDUCED_STEPS = ("div", "mul", "add", "sub", "sqrt", "rsqrt", "max", "min")


def _returns_to(var: Any, consumers: dict[Any, list[Any]], low: np.dtype, depth: int = 0) -> bool:
    """Every use of a reduction's result ends, within a few elementwise steps (`jnp.mean`'s
    division by the count), in a conversion back to `low`."""
    uses = consumers.get(var, [])
    if not uses or depth > 4:
        return False
    for use in uses:
        name = use.primitive.name
        if name == "convert_element_type":
            if np.dtype(use.outvars[0].aval.dtype) != low:
                return False
        elif name not in _REDUCED_STEPS or not _returns_to(
            use.outvars[0], consumers, low, depth + 1
        ):
            return False
    return True


def dtype_promotions(
    fun: Callable[..., Any], *args: Any, low_dtype: Any = None, **kwargs: Any
) -> PromotionReport:
    """Report where `fun` computes in a dtype wider than its low-precision one.

    A model whose layers promote (a Flax `nn.Dense` with float32 `param_dtype` and no
    `dtype`, an Equinox layer built in float32) silently computes in float32 even when its
    inputs are float16: this lists the argument leaves already wide and every conversion
    from the low dtype to a wider one, with the user's source line, and counts the
    floating tensors by dtype. It traces `fun` (forward and backward if `fun` takes a
    gradient) on the arrays the arguments represent; nothing is run. Conversions of
    scalars (a loss, a learning rate) are not listed.

    Args:
        fun: the function, e.g. a training step or a loss.
        *args: its arguments: ScaledArrays, arrays, any pytrees.
        low_dtype: the dtype the program is meant to compute in; default: the narrowest
            floating dtype among the arguments' arrays.
        **kwargs: its keyword arguments.

    Raises:
        ValueError: no floating argument, and no `low_dtype`.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> w = jnp.ones((4, 4), jnp.float32)  # parameters left in float32
        >>> x = jsa.as_scaled_array(jnp.ones((2, 4)), dtype=jnp.float16)
        >>> report = jsa.analysis.dtype_promotions(lambda w, x: jnp.tanh(x @ w), w, x)
        >>> [(p.kind, p.from_dtype, p.to_dtype) for p in report.promotions]
        [('input', '', 'float32'), ('dot_general', 'float16', 'float32')]
        >>> report.wide_fraction
        1.0
    """
    is_scaled = lambda x: isinstance(x, ScaledArray)  # noqa: E731
    paths_leaves = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_scaled)[0]
    floats = [
        (path, leaf)
        for path, leaf in paths_leaves
        if (is_scaled(leaf) or is_array(leaf)) and jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    if low_dtype is None:
        if not floats:
            raise ValueError("dtype_promotions: no floating argument; pass `low_dtype=`.")
        low = min((np.dtype(leaf.dtype) for _, leaf in floats), key=lambda d: d.itemsize)
    else:
        low = np.dtype(low_dtype)

    promotions: list[DtypePromotion] = []
    for path, leaf in floats:
        if _is_wider_float(leaf.dtype, low):
            name = "args" + jax.tree_util.keystr(path[1:]) if path[0].idx == 0 else "kwargs"
            promotions.append(
                DtypePromotion("input", name, "", tuple(leaf.shape), "", np.dtype(leaf.dtype).name)
            )

    # Trace on what the arguments represent (a ScaledArray stands for its data's dtype).
    flat, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_scaled)
    dynamic = [i for i, x in enumerate(flat) if is_scaled(x) or is_array(x)]
    flat_fun = of_leaves(fun, tree, flat, dynamic)
    avals = [
        jax.ShapeDtypeStruct(np.shape(flat[i]), flat[i].dtype) if is_scaled(flat[i]) else flat[i]
        for i in dynamic
    ]
    closed = jax.make_jaxpr(flat_fun)(*avals)

    counts: dict[str, int] = {}
    merged: dict[tuple[Any, ...], int] = {}
    stack = [closed.jaxpr]
    while stack:
        jaxpr = stack.pop(0)
        consumers: dict[Any, list[Any]] = {}
        for eqn in jaxpr.eqns:
            for var in eqn.invars:
                if isinstance(var, _compat.Var):
                    consumers.setdefault(var, []).append(eqn)
        for eqn in jaxpr.eqns:
            for param in eqn.params.values():
                stack.extend(sub_jaxprs(param))
            if _accumulation_only(eqn, consumers, low):
                continue  # e.g. jnp.sum of float16 data accumulating in float32
            for var in eqn.outvars:
                aval: Any = var.aval  # a ShapedArray (typed AbstractValue from JAX 0.11)
                if getattr(aval, "shape", ()) and jnp.issubdtype(aval.dtype, jnp.floating):
                    counts[np.dtype(aval.dtype).name] = counts.get(np.dtype(aval.dtype).name, 0) + 1
            in_avals: list[Any] = [v.aval for v in eqn.invars]
            out_avals: list[Any] = [v.aval for v in eqn.outvars]
            in_dtypes = {np.dtype(a.dtype) for a in in_avals if hasattr(a, "dtype")}
            out_dtypes = [np.dtype(a.dtype) for a in out_avals]
            if low not in in_dtypes or not out_dtypes or not _is_wider_float(out_dtypes[0], low):
                continue
            src_dtype, dst_dtype = low, out_dtypes[0]
            shape = tuple(out_avals[0].shape)
            if not shape:
                continue  # a scalar (a loss, a learning rate): not a tensor the model holds
            sources = _sources(eqn)
            if sources is None:
                continue
            where, library = sources
            key = (eqn.primitive.name, where, library, shape, src_dtype.name, dst_dtype.name)
            if key in merged:
                old = promotions[merged[key]]
                promotions[merged[key]] = dataclasses.replace(old, count=old.count + 1)
            else:
                merged[key] = len(promotions)
                promotions.append(DtypePromotion(*key))
    return PromotionReport(low.name, tuple(promotions), counts)
