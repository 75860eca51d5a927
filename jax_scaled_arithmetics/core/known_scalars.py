"""What is statically known of each value of a jaxpr: the Python scalar it is a broadcast of
(a literal, a constant, or a fold of known scalars through elementwise and shape
primitives), or None.

`autoscale` carries this beside every value: a rule whose operand is a known scalar (layer
norm's epsilon, `N - ddof`, a `where`'s fill) takes its power of two into the scale or needs
no scale of its own (`registry.operand_constants()`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import _compat
from .datatype import ScaledArray
from .walker import Frame, JaxprWalker

__all__ = ["CALL_BODY_PARAMS", "fold_known", "fold_known_call", "known_scalar"]

_MAX_CONST_SCAN = 4096

# Primitives whose output is a broadcast of the same scalar when their first operand is.
_SCALAR_PRESERVING = {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "copy",
    "copy_p",
    "rev",
    "slice",
    "dynamic_slice",
    "reduce_precision",
    "convert_element_type",
    # Inside `shard_map` a constant used with a value that varies over a mesh axis is first
    # made to vary (a type cast): it stays the constant (layer norm's epsilon, `+ 1e-5`).
    "pvary",
}
# Elementwise primitives folded when every operand is a known scalar.
_FOLDABLE_ELEMENTWISE = {
    "neg",
    "abs",
    "add",
    "sub",
    "mul",
    "div",
    "max",
    "min",
    "sqrt",
    "rsqrt",
    "exp",
    "log",
    "integer_pow",
    "pow",
    "square",
    "sign",
    "exp2",
    "log1p",
    "expm1",
    "tanh",
    "logistic",
}


def known_scalar(value: Any) -> Any:
    """The scalar `value` is a broadcast of, when it is concrete and constant; else None."""
    if _compat.is_tracer(value) or isinstance(value, ScaledArray):
        return None
    if isinstance(value, (bool, int, float)):
        return value
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0 or size > _MAX_CONST_SCAN:
        return None
    try:
        arr = np.asarray(value)
    except Exception:  # an object without a concrete value: nothing is known
        return None
    first = arr.reshape(-1)[0]
    if size > 1 and not np.all(arr == first):
        return None
    return first.item() if hasattr(first, "item") else first


def fold_known(eqn: _compat.JaxprEqn, in_known: Sequence[Any]) -> list[Any]:
    nout = len(eqn.outvars)
    name = eqn.primitive.name
    if eqn.primitive in CALL_BODY_PARAMS:
        return fold_known_call(eqn, in_known)
    if not eqn.invars or eqn.primitive.multiple_results:
        return [None] * nout
    if name in _SCALAR_PRESERVING:
        value = in_known[0]
        if value is None:
            return [None]
        if name == "convert_element_type":
            out_dtype = getattr(eqn.outvars[0].aval, "dtype", None)
            with np.errstate(over="ignore", invalid="ignore"):
                value = np.asarray(value).astype(out_dtype).item()
        return [value]
    if name in _FOLDABLE_ELEMENTWISE and all(k is not None for k in in_known):
        with np.errstate(over="ignore", invalid="ignore"):
            args = [
                np.asarray(k, dtype=getattr(atom.aval, "dtype", None))
                for k, atom in zip(in_known, eqn.invars)
            ]
        with jax.ensure_compile_time_eval():
            out = eqn.primitive.bind(*args, **eqn.params)
        return [np.asarray(out).item()]
    return [None]


# Call-like primitives: the output of each is its body's, on the same operands.
CALL_BODY_PARAMS = {
    _compat.jit_p: "jaxpr",
    _compat.closed_call_p: "call_jaxpr",
    _compat.remat_p: "jaxpr",
    _compat.custom_jvp_call_p: "call_jaxpr",
    _compat.custom_vjp_call_p: "call_jaxpr",
}


def fold_known_call(eqn: _compat.JaxprEqn, in_known: Sequence[Any]) -> list[Any]:
    """The scalars the outputs of a call-like equation (jit, closed_call, remat, custom
    derivatives) are statically known broadcasts of, folded through its body.

    A jit boundary must not hide constants. Linearised inside a `scan` body, `jnp.var`
    becomes two jits: one computes the normalizer (`N - ddof`) and the NaN fill of an
    empty reduction from literals, the other divides by the normalizer and selects with
    the fill. Unknown, the normalizer was promoted at scale 1 (the variance's data N times
    below its value's scale) and the fill asked the `where` for scale 1 (the variance's
    data then its value, 2^-10 for float16 activations near 2^-5), and the layer norm's
    derivative `rsqrt(v) / v` overflowed float16 (NaN gradients). Known, the normalizer
    takes its power of two into the scale and the fill asks for no scale, as without jit.
    """
    nout = len(eqn.outvars)
    name = CALL_BODY_PARAMS.get(eqn.primitive)
    body = eqn.params.get(name) if name is not None else None
    if body is None:
        return [None] * nout
    jaxpr = getattr(body, "jaxpr", body)
    consts = getattr(body, "consts", ())
    if len(jaxpr.invars) != len(in_known) or len(jaxpr.outvars) != nout:
        return [None] * nout
    return _KNOWN_SCALARS.run(jaxpr, [known_scalar(c) for c in consts], list(in_known))


class _KnownScalars(JaxprWalker):
    """A walk whose values are what is statically known of each variable: the scalar it
    is a broadcast of, or None."""

    keep_source_info = False  # nothing is bound

    def literal(self, value: Any) -> Any:
        return known_scalar(value)

    def eval_eqn(self, eqn: Any, invals: list[Any], frame: Frame) -> list[Any]:
        return fold_known(eqn, invals)


_KNOWN_SCALARS = _KnownScalars()
