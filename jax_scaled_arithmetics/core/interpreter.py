"""`autoscale`: trace a function to a jaxpr, then run every equation's scaled rule."""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat, block_scales, bounded, normalization, registry
from .config import get_autoscale_config
from .datatype import (
    ScaledArray,
    invalid_scale_values,
    is_array,
    is_floating,
    set_operator_transform,
    unpack_scales,
)
from .known_scalars import fold_known, fold_known_call, known_scalar
from .promotion import promote_to_scaled
from .registry import operand_constants
from .scale_arithmetic import is_pow2, mark_pow2
from .walker import (
    Frame,
    Group,
    JaxprWalker,
    bind_equation,
    declare_rewrap,
    equation_observers,
    observe_equations,
)

__all__ = [
    "autoscale",
    "scalify",
    "promote_to_scaled",
    "operand_constants",
    "observe_equations",
    "trace_notes",
    "tracing_a_scaled_function",
]


class _State(threading.local):
    def __init__(self) -> None:
        self.tracing_depth = 0
        self.trace_notes: list[dict[Any, Any]] = []


_STATE = _State()


@contextlib.contextmanager
def _tracing_user_function() -> Iterator[None]:
    """While `autoscale` traces the user's function. Linear algebra that JAX computes in
    float32/float64 only (LU, QR, SVD...) is traced in float32 on float16/bfloat16 operands,
    between two converts (`_compat.narrow_linalg_in_float32`; docs/design.md, "Narrow floats
    in linear algebra"): the rules compute in float32 anyway, and the jaxpr stays one that
    the installed JAX accepts."""
    _STATE.tracing_depth += 1
    _STATE.trace_notes.append({})
    try:
        with _compat.narrow_linalg_in_float32():
            yield
    finally:
        _STATE.trace_notes.pop()
        _STATE.tracing_depth -= 1


def trace_notes() -> dict[Any, Any] | None:
    """A dict that lives as long as the trace of the function `autoscale` is tracing (the
    user's step), None outside one: library code traced as part of the same step leaves
    notes about the tracers it made for other library code of that step (the optimizer's
    update for `jsa.optax.apply_updates`). Key notes by `id(tracer)` and keep the tracer in
    the note: a note is valid only for that very object."""
    return _STATE.trace_notes[-1] if _STATE.trace_notes else None


def _check_outputs(eqn: _compat.JaxprEqn, outs: Sequence[Any]) -> None:
    if len(outs) != len(eqn.outvars):
        raise TypeError(
            f"Scaled rule of '{eqn.primitive.name}' returned {len(outs)} outputs, "
            f"expected {len(eqn.outvars)}."
        )
    for out, var in zip(outs, eqn.outvars):
        data = out.data if isinstance(out, ScaledArray) else out
        expected: Any = var.aval
        shape, dtype = tuple(np.shape(data)), getattr(data, "dtype", None)
        if shape != tuple(expected.shape) or (
            dtype is not None and jnp.dtype(dtype) != jnp.dtype(expected.dtype)
        ):
            raise TypeError(
                f"Scaled rule of '{eqn.primitive.name}' returned {dtype}{list(shape)}, "
                f"but the primitive returns {expected.str_short()}."
            )
        if isinstance(out, ScaledArray) and np.shape(out.scale) != ():
            scale_shape = tuple(np.shape(out.scale))
            if len(scale_shape) != len(shape) or any(
                s < 1 or n % s for s, n in zip(scale_shape, shape)
            ):
                raise TypeError(
                    f"Scaled rule of '{eqn.primitive.name}' returned a scale of shape "
                    f"{scale_shape}, which is not a block scale of its output {list(shape)}."
                )


def _per_tensor(value: Any) -> Any:
    """A block-scaled operand in per-tensor form, for rules that do not keep blocks."""
    if isinstance(value, ScaledArray) and np.ndim(value.scale):
        return ScaledArray(*block_scales.to_per_tensor(value.data, value.scale))
    return value


# A scalar ScaledArray read by this many equations or more is computed once: its data (when
# it is a scalar) and its traced scale end in a division, which XLA does not copy into each
# consumer's kernel (it copies cheap scalar chains, such as the scale algebra's exponent-bit
# arithmetic, into every kernel that reads them: `clip_by_global_norm`'s factor, a chain
# through every leaf's sum, went into each leaf's kernel).
_FAN_OUT = 3


def _materialized(x: ScaledArray) -> ScaledArray:
    """A scalar ScaledArray (a global norm, a clipping factor) with its traced data and
    scale each computed once. Tensors are left alone: their scale is shared by identity with
    the values it came from (`same_scale`), which a new tracer would hide."""
    if np.ndim(x.data) != 0 or not _compat.is_tracer(x.data):
        return x
    scale = x.scale
    if np.ndim(scale) == 0 and _compat.is_tracer(scale):
        pow2 = is_pow2(scale)
        scale = block_scales.materialize_scalar(scale)
        if pow2:
            mark_pow2(scale)
    return ScaledArray(block_scales.materialize_scalar(x.data), scale)


def _computed_once(x: ScaledArray, invals: Sequence[Any]) -> ScaledArray:
    """A tensor that two or more equations read, rescaled by the rule that made it, with its
    data computed once on XLA:CPU (`block_scales.materialize_on_cpu`, an exact division by
    one there, nothing elsewhere).

    XLA:CPU fuses cheap elementwise producers into each of their consumers and recomputes
    them there. A plain residual stream's adds are one instruction each; a scaled add is two
    multiplies by ratios (scalar parameters, broadcast) and the add, so the backward pass's
    residual chain, recomputed inside every block's kernels, made fusions of 1,400-1,760
    instructions on an 8-block GPT (plain: about 300) and most of its compile time. Written
    once instead, each kernel reads it. A tensor whose scale is an operand's (a shape op, an
    add of operands that share one scale) had no ratio applied and is left alone."""
    if np.ndim(x.data) == 0 or np.ndim(x.scale) != 0 or not _compat.is_tracer(x.data):
        return x
    if any(isinstance(v, ScaledArray) and v.scale is x.scale for v in invals):
        return x
    return ScaledArray(block_scales.materialize_on_cpu(x.data), x.scale)


def materialize_for_readers(out: Any, readers: int, operands: Sequence[Any]) -> Any:
    """The materialisation step after each rule: a scaled output that `readers` equations
    read is computed once where XLA would otherwise copy its scale arithmetic (a scalar read
    by three or more, `_materialized`) or its rescaled data (a tensor read by two or more, on
    XLA:CPU, `_computed_once`) into every reader's kernel. Values are unchanged; only what
    XLA fuses differs. `operands` are the rule's inputs (an output that kept an operand's
    scale had no ratio applied)."""
    if not isinstance(out, ScaledArray):
        return out
    if readers >= _FAN_OUT:
        out = _materialized(out)
    if readers >= 2:
        out = _computed_once(out, operands)
    return out


class _AutoscaleContext:
    """Per-jaxpr state of `autoscale`'s walk: what is statically known of each variable
    (the scalar it is a broadcast of, or None), how many equations read it, and the
    exponents of the scales the normalization runs gave their outputs (which their
    backward passes read)."""

    __slots__ = ("known", "uses", "exponents")

    def __init__(self, known: dict[Any, Any], uses: collections.Counter[Any]) -> None:
        self.known = known
        self.uses = uses
        self.exponents: dict[Any, Any] = {}

    def read(self, atom: Any) -> Any:
        if isinstance(atom, _compat.Literal):
            return known_scalar(atom.val)
        return self.known.get(atom)


def _vary_data_like(value: Any, aval: Any) -> Any:
    axes = _compat.varying_axes(aval)
    if not axes:
        return value
    if isinstance(value, ScaledArray):
        data = _compat.vary_over(value.data, axes)
        return value if data is value.data else ScaledArray(data, value.scale)
    return _compat.vary_over(value, axes)


def _transposed_dot(jaxpr: Any, index: int, uses: collections.Counter[Any]) -> Any:
    """The `dot_general` equation that computes equation `index + 1`, a transpose of the
    product equation `index` makes (and nothing else reads), in one: the same product of
    the operands swapped, whose output axes (batch, rhs free, lhs free) are the
    transpose's. None when the two equations are not such a pair.

    Autodiff writes a matmul's weight gradient so (`transpose(dot_general(g, x))`); plain
    XLA folds the transpose into the product, but a scaled product's data is the product
    times a ratio, and XLA:CPU then writes it transposed in a pass of its own (a strided
    copy of the weight-sized gradient)."""
    dot, transpose = jaxpr.eqns[index], jaxpr.eqns[index + 1]
    if dot.primitive is not lax.dot_general_p or transpose.primitive is not lax.transpose_p:
        return None
    out = dot.outvars[0]
    if transpose.invars[0] is not out or uses[out] != 1 or any(v is out for v in jaxpr.outvars):
        return None
    params = dict(dot.params)
    if params.get("out_sharding") is not None:
        # Traced under a mesh: the fused product is sharded as the transpose's output.
        sharding = getattr(transpose.outvars[0].aval, "sharding", None)
        if sharding is None:
            return None
        params["out_sharding"] = sharding
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    nb = len(lb)
    nl = len(dot.invars[0].aval.shape) - nb - len(lc)
    nr = len(dot.invars[1].aval.shape) - nb - len(rc)
    swapped = (*range(nb), *range(nb + nl, nb + nl + nr), *range(nb, nb + nl))
    if tuple(transpose.params["permutation"]) != swapped:
        return None
    params["dimension_numbers"] = ((tuple(rc), tuple(lc)), (tuple(rb), tuple(lb)))
    precision = params.get("precision")
    if isinstance(precision, tuple) and len(precision) == 2:
        params["precision"] = precision[::-1]
    return _compat.replace_eqn(
        dot, invars=dot.invars[::-1], outvars=list(transpose.outvars), params=params
    )


class _Autoscale(JaxprWalker):
    """`autoscale`'s walk: values are ScaledArrays or plain arrays; an equation with a
    ScaledArray operand (or a primitive that is always scaled) runs its scaled rule, any
    other is bound again unchanged."""

    def __init__(self, known_args: Sequence[Any]) -> None:
        self.known_args = known_args
        self.config = get_autoscale_config()

    def enter(self, frame: Frame, parent: Any) -> _AutoscaleContext:
        jaxpr = frame.jaxpr
        known: dict[Any, Any] = {}
        for var in jaxpr.constvars:
            known[var] = known_scalar(frame.read(var))
        for var, k in zip(jaxpr.invars, self.known_args):
            known[var] = k if k is not None else known_scalar(frame.read(var))
        uses: collections.Counter[Any] = collections.Counter(
            a for e in jaxpr.eqns for a in e.invars if not isinstance(a, _compat.Literal)
        )
        return _AutoscaleContext(known, uses)

    def observers(self) -> Sequence[Any]:
        return equation_observers()

    def groups(self, jaxpr: Any, context: _AutoscaleContext) -> Sequence[Group]:
        """Each product whose output only a transpose reads (a weight gradient), offered
        to `eval_group` as one product of the operands swapped; each softmax (`exp` of a
        value shifted by its maximum, its sum and quotient when they follow), offered as
        the plain equations on the represented values at the scales their bounds give
        (`bounded`); each normalization's float32 statistics and their backward pass,
        offered as the plain equations at the static rules' scales (`normalization`)."""
        found = []
        producers = {v: e for e in jaxpr.eqns for v in e.outvars}
        # A normalization run ends at or after a square root (its own, or one in a function
        # it calls): none after the last one.
        last_root = max(
            (
                i
                for i, e in enumerate(jaxpr.eqns)
                if any(normalization.primitive_names(e)[root] for root in normalization.ROOTS)
            ),
            default=-1,
        )
        constants = normalization.constant_variables(jaxpr) if last_root >= 0 else {}
        anchors: set[Any] = set()  # the normalization runs' outputs, read by their backward
        index = 0
        while index < len(jaxpr.eqns):
            fused = (
                _transposed_dot(jaxpr, index, context.uses) if index + 1 < len(jaxpr.eqns) else None
            )
            if fused is not None:
                found.append(
                    Group(index, index + 2, fused, tuple(fused.invars), tuple(fused.outvars))
                )
                index += 2
                continue
            group = bounded.shifted_exp_group(
                jaxpr, index, producers, context.uses
            ) or bounded.exp_at_most_one_group(jaxpr, index, producers)
            if group is None and index <= last_root:
                group = normalization.normalization_run(jaxpr, index, context.uses, constants)
            if group is None and anchors:
                group = normalization.normalization_backward_run(
                    jaxpr, index, context.uses, constants, anchors
                )
            if group is not None:
                if isinstance(group.key, normalization.NormalizationRun) and not group.key.backward:
                    anchors.update(group.outputs)
                found.append(group)
                index = group.stop
                continue
            index += 1
        return found

    def eval_group(self, group: Group, invals: list[Any], frame: Frame) -> list[Any] | None:
        scaled = [v for v in invals if isinstance(v, ScaledArray)]
        # Block scales are laid out per operand (`block_rules`): left to the equations.
        if not scaled or any(np.ndim(v.scale) for v in scaled):
            return None
        if isinstance(group.key, bounded.ShiftedExp):
            return bounded.evaluate_shifted_exp(
                group.key, invals[0], group.outputs, self.observers()
            )
        if isinstance(group.key, bounded.ExpAtMostOne):
            return bounded.evaluate_exp_at_most_one(group.key, invals[0], self.observers())
        if isinstance(group.key, normalization.NormalizationRun):
            if not isinstance(invals[0], ScaledArray):
                return None
            return normalization.evaluate_normalization_run(
                group.key,
                dict(zip(group.inputs, invals)),
                group.outputs,
                functools.partial(self._evaluate_foreign, frame),
                self.observers(),
                lambda var, value: promote_to_scaled(value, frame.context.read(var)),
                frame.context.exponents,
                lambda value, readers: materialize_for_readers(value, readers, ()),
            )
        fused = group.key
        with _compat.eqn_context(fused):
            outs = self.eval_eqn(fused, invals, frame)
        for observer in self.observers():
            observer(fused, invals, outs)
        return outs

    def _evaluate_foreign(self, frame: Frame, eqn: Any, invals: list[Any]) -> list[Any]:
        """An equation inside a group that the group does not replace, evaluated (and
        observed, and stored) as the walk would."""
        with _compat.eqn_context(eqn):
            outs = self.eval_eqn(eqn, invals, frame)
        for observer in self.observers():
            observer(eqn, invals, outs)
        for var, out in zip(eqn.outvars, outs):
            frame.write(var, out)
        return outs

    def eval_eqn(self, eqn: Any, invals: list[Any], frame: Frame) -> list[Any]:
        context: _AutoscaleContext = frame.context
        in_known = [context.read(a) for a in eqn.invars]
        any_scaled = any(isinstance(v, ScaledArray) for v in invals)
        info = registry.find_rule(eqn.primitive)
        if any_scaled or (info is not None and info.always_scaled):
            outs = self._scaled(eqn, invals, in_known)
            # A plain output of a call (jit...) keeps what is statically known of it.
            out_known: list[Any] = [
                None if isinstance(out, ScaledArray) else k
                for out, k in zip(outs, fold_known_call(eqn, in_known))
            ]
        else:
            invals = _compat.vary_like_plain(eqn, invals)
            outs = _compat.bind_pvary(eqn, invals) or bind_equation(eqn, invals)
            out_known = fold_known(eqn, in_known)
        for index, (var, k) in enumerate(zip(eqn.outvars, out_known)):
            if isinstance(var, _compat.Var) and not _compat.is_drop_var(var):
                context.known[var] = k
                outs[index] = materialize_for_readers(outs[index], context.uses[var], invals)
        return outs

    def _scaled(self, eqn: Any, invals: list[Any], in_known: list[Any]) -> list[Any]:
        info = registry.get_scaled_rule(eqn.primitive)
        any_scaled = any(isinstance(v, ScaledArray) for v in invals)
        if any_scaled:
            for guard in info.guards:
                guard(eqn, invals)
        if info.promote and any_scaled:
            invals = [promote_to_scaled(v, k) for v, k in zip(invals, in_known)]
        # Inside `shard_map`: data (of a promoted constant, say) varies over at least the
        # mesh axes the plain program's operand did, so the rule's data ops type-check.
        invals = [
            v if isinstance(var, _compat.Literal) else _vary_data_like(v, var.aval)
            for v, var in zip(invals, eqn.invars)
        ]
        rule = info.rule
        if any(isinstance(v, ScaledArray) and np.ndim(v.scale) for v in invals):
            if info.block_rule is not None:
                rule = info.block_rule
            else:
                invals = [_per_tensor(v) for v in invals]
        with registry.with_operand_constants(in_known):
            outs = rule(*invals, **eqn.params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        if self.config.check:
            _check_outputs(eqn, outs)
        return outs


def interpret_jaxpr(
    jaxpr: _compat.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    known_args: Sequence[Any] | None = None,
) -> tuple[list[Any], list[Any]]:
    """Evaluate `jaxpr` on (possibly scaled) arguments, dispatching to scaled rules.

    Returns the outputs and, for each, the scalar it is statically known to be a
    broadcast of (or None).
    """
    known_args = [None] * len(args) if known_args is None else list(known_args)
    walker = _Autoscale(known_args)
    frame = walker.start(jaxpr, consts, args)
    walker.walk(frame)
    return [frame.read(v) for v in jaxpr.outvars], [frame.context.read(v) for v in jaxpr.outvars]


def _interpret_closed(
    closed_jaxpr: _compat.ClosedJaxpr, args: Sequence[Any], known: Sequence[Any] | None
) -> list[Any]:
    outs, _ = interpret_jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.consts, args, known)
    return outs


registry.set_jaxpr_interpreter(_interpret_closed)


def _normalize_argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(argnums, int):
        return (argnums,)
    return tuple(argnums)


def _normalize_argnames(argnames: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(argnames, str):
        return (argnames,)
    return tuple(argnames)


def _check_hashable(value: Any, where: str) -> None:
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"autoscale static argument {where} must be hashable, got an unhashable "
            f"{type(value).__name__}: {value!r}."
        ) from None


# A ScaledArray built by a function mapped over pytree leaves: `jax.tree.map` descends into
# a ScaledArray, so it maps the data and the scale separately (an optax `init` does).
_MAPPED_OVER_LEAVES = (
    " Was it built by a function mapped over pytree leaves? jax.tree.map descends into a "
    "ScaledArray and maps its data and its scale separately, as an optax optimizer's init "
    "does on ScaledArray parameters. Initialise the state with "
    "jsa.optax.scale_optimizer(tx).init(params), or from the values: "
    "jsa.as_scaled_array(tx.init(jsa.asarray(params)))."
)


def _validate_scaled_input(x: ScaledArray, path: str) -> None:
    if not is_floating(x.data):
        raise TypeError(
            f"autoscale input {path}: ScaledArray data must be floating point, got "
            f"{getattr(x.data, 'dtype', type(x.data))}.{_MAPPED_OVER_LEAVES}"
        )
    if not (hasattr(x.scale, "shape") or isinstance(x.scale, (int, float))):
        raise TypeError(
            f"autoscale input {path}: ScaledArray scale must be an array, got "
            f"{type(x.scale).__name__}.{_MAPPED_OVER_LEAVES}"
        )
    if np.shape(x.scale) != ():
        scale_shape, data_shape = tuple(np.shape(x.scale)), tuple(np.shape(x.data))
        if len(scale_shape) != len(data_shape) or any(
            s < 1 or n % s for s, n in zip(scale_shape, data_shape)
        ):
            raise ValueError(
                f"autoscale input {path}: ScaledArray scale of shape {scale_shape} is not a "
                f"block scale of data of shape {data_shape}: a scale is a scalar, or an array "
                f"of the data's rank whose every dimension divides the data's."
            )
    if not is_floating(x.scale):
        raise TypeError(
            f"autoscale input {path}: ScaledArray scale must be floating point, got "
            f"{getattr(x.scale, 'dtype', type(x.scale))}.{_MAPPED_OVER_LEAVES}"
        )
    problem = invalid_scale_values(x.scale)
    if problem is not None:
        raise ValueError(
            f"autoscale input {path}: ScaledArray scale {problem}. A scale must be finite and "
            f"non-negative (zero represents zeros); build ScaledArrays with jsa.scaled_array "
            f"or jsa.as_scaled_array, which check it."
        )


def _argument_path(path: Sequence[Any], dynamic_positions: Sequence[int]) -> str:
    """`path` in the `(dynamic args, kwargs)` tree as the user wrote the call:
    `argument 0['w']` or `argument 'x'[1]`."""
    which, key = path[0], path[1]
    rest = jax.tree_util.keystr(tuple(path[2:]))
    if which.idx == 0:
        return f"argument {dynamic_positions[key.idx]}{rest}"
    return f"argument {key.key!r}{rest}"


def _is_scaled(x: Any) -> bool:
    return isinstance(x, ScaledArray)


def _leaf_aval(leaf: Any) -> Any:
    """What `fun` is traced with for an argument leaf: a ScaledArray's data type (shape,
    dtype, its sharding over a mesh's explicit axes; never weakly typed: a ScaledArray's
    dtype is its data's), a plain leaf as it is."""
    if isinstance(leaf, ScaledArray):
        aval = _compat.typeof(leaf.data)
        if getattr(aval, "weak_type", False):
            return _compat.shape_dtype_struct(aval.update(weak_type=False))
        return leaf.data
    return leaf


def _as_output(value: Any, mapped: bool = False) -> Any:
    """An output as users get it: a scale that rules folded at trace time (a NumPy scalar)
    becomes a JAX array, like every other scale, and so does an output the jaxpr holds as
    a constant (a NumPy value there), as `jax.jit` returns it."""
    if isinstance(value, (np.ndarray, np.generic)):
        return jnp.asarray(value)
    if isinstance(value, ScaledArray) and isinstance(value.scale, (np.ndarray, np.generic)):
        value = ScaledArray(value.data, jnp.asarray(value.scale))
    if (
        isinstance(value, ScaledArray)
        and np.ndim(value.scale) == 0
        and np.ndim(value.data) > 0
        and (mapped or _compat.is_batched(value.data) or _compat.is_batched(value.scale))
    ):
        # Under `jax.vmap`, a per-example scale goes out at the data's rank, so that the
        # stacked scales form a block scale with one block per example, `(B, 1, ...)`.
        value = ScaledArray(value.data, jnp.reshape(value.scale, (1,) * np.ndim(value.data)))
    return value


def autoscale(
    fun: Callable[..., Any],
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
) -> Callable[..., Any]:
    """Transform `fun` so that it computes on ScaledArrays.

    The returned function accepts the same arguments as `fun`, where any
    floating-point array may be a ScaledArray. It traces `fun` on the arrays the
    ScaledArrays represent, then runs each equation of the jaxpr with its scaled
    rule when one of its inputs is scaled (and binds it unchanged otherwise).
    Outputs computed from scaled inputs are ScaledArrays.

    It composes with `jit`, `vmap` and `grad` in either order. Inside another
    `autoscale`, it is the identity (the outer transform already scales
    everything). `autoscale(jax.grad(f))` returns gradients as ScaledArrays;
    `jax.grad(autoscale(f))` differentiates with respect to the pytree leaves, so the
    gradient of a ScaledArray argument is `ScaledArray(dL/d data, dL/d scale)`: two
    cotangents, not a value to call `to_array` on.

    A `jsa.tree.PackedScales` argument (scales carried as one vector across `jit`) is
    unpacked into its ScaledArrays first.

    It traces `fun` at every call (nothing is cached, so what `fun` closes over is read
    when it is called); under `jax.jit` that is once per compilation. A ScaledArray
    argument with a concrete scale that is NaN, infinite or negative is refused.

    Args:
        fun: the function to transform; pytrees in and out.
        static_argnums: positional arguments passed through as Python values
            (they must be hashable).
        static_argnames: keyword arguments passed through as Python values.

    Raises:
        NotImplementedError: an equation with a scaled input has no rule.
        ValueError: a ScaledArray argument's concrete scale is NaN, infinite or negative,
            or its shape is not a block layout of its data.
        TypeError: a ScaledArray argument's data or scale is not floating point.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array(jnp.array([1.0, 2.0], jnp.float16), 2.0**-20)
        >>> y = jsa.autoscale(lambda a: a * a)(x)  # values 2^-40, 2^-38: zero in plain float16
        >>> y.data, y.scale == 2.0**-40
        (Array([1., 4.], dtype=float16), Array(True, dtype=bool))
    """
    argnums = _normalize_argnums(static_argnums)
    argnames = _normalize_argnames(static_argnames)

    @functools.wraps(fun)
    def scaled_fun(*args: Any, **kwargs: Any) -> Any:
        if _STATE.tracing_depth > 0:
            return fun(*args, **kwargs)
        nargs = len(args)
        static_pos = {i % nargs if nargs else i for i in argnums}
        for i in sorted(static_pos):
            if i >= nargs:
                raise TypeError(
                    f"autoscale static_argnums {i} is out of range for {nargs} positional "
                    f"arguments."
                )
            _check_hashable(args[i], f"at position {i}")
        for name in argnames:
            if name in kwargs:
                _check_hashable(kwargs[name], f"'{name}'")
        dynamic_positions = [i for i in range(nargs) if i not in static_pos]
        # A `PackedScales` argument is its tree of ScaledArrays (the scales sliced from
        # its vector), not data arrays beside a vector of numbers.
        dyn_args = [unpack_scales(args[i]) for i in dynamic_positions]
        dyn_kwargs = {k: unpack_scales(v) for k, v in kwargs.items() if k not in argnames}

        all_leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs), is_leaf=_is_scaled)
        paths = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs), is_leaf=_is_scaled)[0]
        for path, leaf in paths:
            if isinstance(leaf, ScaledArray):
                _validate_scaled_input(leaf, _argument_path(path, dynamic_positions))
        # Arrays are traced; every other leaf (a Python float such as a dropout rate, a
        # function, a string) stays a Python value the function sees as it is, as
        # `eqx.filter_jit` keeps it: `eqx.filter_value_and_grad` then differentiates the
        # same leaves with and without autoscale.
        is_dynamic = [isinstance(leaf, ScaledArray) or is_array(leaf) for leaf in all_leaves]
        leaves = [leaf for leaf, dyn in zip(all_leaves, is_dynamic) if dyn]
        # Traced at every call, as `jax.grad` and `jax.vmap` trace: what `fun` closes over
        # (weights in a dict a training loop updates, a Python number) is read when it is
        # called, never from an earlier trace. Under `jax.jit` this runs once per
        # compilation; eagerly it adds the trace (a small part of running equations one by
        # one: docs/design.md, "What autoscale caches").
        out_tree_box: list[Any] = []

        def flat_fun(*flat: Any) -> list[Any]:
            flat_iter = iter(flat)
            full = [next(flat_iter) if dyn else leaf for leaf, dyn in zip(all_leaves, is_dynamic)]
            dargs, dkwargs = jax.tree_util.tree_unflatten(in_tree, full)
            dargs_iter = iter(dargs)
            full_args = [args[i] if i in static_pos else next(dargs_iter) for i in range(nargs)]
            full_kwargs = {k: (kwargs[k] if k in argnames else dkwargs[k]) for k in kwargs}
            out = fun(*full_args, **full_kwargs)
            out_leaves, out_tree = jax.tree_util.tree_flatten(out)
            # Non-array outputs (an Equinox model's functions and Python floats) go back as
            # they are, as `eqx.filter_jit` returns them; only arrays are traced.
            statics = [None if is_array(o) else (o,) for o in out_leaves]
            out_tree_box.append((out_tree, statics))
            return [o for o, st in zip(out_leaves, statics) if st is None]

        with _tracing_user_function():
            closed = jax.make_jaxpr(flat_fun)(*[_leaf_aval(leaf) for leaf in leaves])
        # Equations nothing uses (parameters an optimizer converts but never reads) are
        # neither interpreted nor handed to XLA in scaled form.
        closed = _compat.dce_closed_jaxpr(closed)
        out_tree = out_tree_box[-1]
        in_avals = closed.in_avals
        values: list[Any] = []
        known: list[Any] = []
        for leaf, aval in zip(leaves, in_avals):
            if isinstance(leaf, np.generic):
                values.append(np.asarray(leaf, dtype=aval.dtype))
                known.append(leaf.item())
            else:
                values.append(leaf)
                known.append(None)
        outs, _ = interpret_jaxpr(closed.jaxpr, closed.consts, values, known)
        # Called under `jax.vmap` (an input is mapped): per-example output scales go out at
        # their data's rank, also where an output is the same for every example.
        mapped = any(
            _compat.is_batched(part)
            for leaf in leaves
            for part in ((leaf.data, leaf.scale) if isinstance(leaf, ScaledArray) else (leaf,))
        )
        out_tree, out_statics = out_tree
        outs_iter = iter(outs)
        out_leaves = [
            _as_output(next(outs_iter), mapped) if st is None else st[0] for st in out_statics
        ]
        return jax.tree_util.tree_unflatten(out_tree, out_leaves)

    # Lets a transform applied on top (`unit_scale`, `simulate_fp8`) act on `fun` first:
    # `unit_scale(autoscale(f))` is `autoscale(unit_scale(f))`.
    return declare_rewrap(
        scaled_fun,
        fun,
        lambda inner: autoscale(
            inner, static_argnums=static_argnums, static_argnames=static_argnames
        ),
    )


scalify = autoscale


def tracing_a_scaled_function() -> bool:
    """Whether `autoscale` is tracing a user's function now (an inner `autoscale` is then
    the identity)."""
    return _STATE.tracing_depth > 0


set_operator_transform(autoscale, tracing_a_scaled_function)
