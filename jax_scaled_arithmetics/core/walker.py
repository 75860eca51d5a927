"""The one jaxpr walker every transform of the library is built on.

A transform here (`autoscale`, `unit_scale`, `simulate_fp8`, the constant folding that
`autoscale` runs over call bodies) is a subclass of :class:`JaxprWalker`: the walker
evaluates a jaxpr equation by equation (operands read, literals given as values, outputs
stored, dropped variables skipped, each equation under its own source information and
name stack), and the subclass says what one equation computes (:meth:`JaxprWalker.eval_eqn`,
usually a lookup in its rule table) and, optionally, which runs of equations it replaces as
a whole (:meth:`JaxprWalker.groups`). The values are the transform's own: ScaledArrays or
arrays for `autoscale`, tracers for the rewriting transforms, known scalars for constant
folding.

Higher-order primitives: :meth:`JaxprWalker.eval_higher_order` evaluates `jit` and
`closed_call` bodies with the walker (inlined) and rebuilds `scan`, `while`, `cond` and
`checkpoint` with the public `jax.lax` functions over bodies the walker evaluates, so a
rewriting transform reaches into every body. `autoscale`'s rules for the same primitives
(`lax/control_flow.py`) call the walker on their bodies too, with scaled carries.

Observers (`observe_equations`, used by `jsa.analysis`) see the equations of `autoscale`'s
walk.

Composition: a transform's walk sees the program of the function it is given. `autoscale`
and `simulate_fp8` declare how to re-apply themselves (:func:`declare_rewrap`), so that a
transform that must see the user's own program (`unit_scale`, `simulate_fp8`) applied to
their result acts on the function inside and re-wraps it (:func:`unwrap_outer`):
`unit_scale(autoscale(f))` is `autoscale(unit_scale(f))`.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax import lax
    >>> from jax_scaled_arithmetics.core.walker import JaxprWalker
    >>> class SinToCos(JaxprWalker):  # a transform: one rule
    ...     def eval_eqn(self, eqn, invals, frame):
    ...         if eqn.primitive is lax.sin_p:
    ...             return [lax.cos(invals[0])]
    ...         return self.eval_higher_order(eqn, invals, frame.context)
    >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(0.0)
    >>> SinToCos().run_closed(closed, [0.0])
    [Array(2., dtype=float32, weak_type=True)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from . import _compat

__all__ = [
    "Frame",
    "Group",
    "JaxprWalker",
    "EquationObserver",
    "observe_equations",
    "equation_observers",
    "bind_equation",
    "declare_rewrap",
    "own_rewrap",
    "unwrap_outer",
]


@dataclasses.dataclass(frozen=True)
class Group:
    """A run of equations `eqns[start:stop]` of one jaxpr that a transform may replace as a
    whole (one call of a function it recognises): `inputs` are the variables the run reads
    but does not define (in order of first use), `outputs` those it defines and something
    after it reads; `key` is the transform's name for it."""

    start: int
    stop: int
    key: Any
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]


class Frame:
    """The values of one jaxpr's variables during a walk, with the transform's `context`
    for that jaxpr (whatever :meth:`JaxprWalker.enter` returned) and the `index` of the
    equation being evaluated."""

    __slots__ = ("jaxpr", "env", "context", "index", "_literal")

    def __init__(self, jaxpr: Any, literal: Callable[[Any], Any]) -> None:
        self.jaxpr = jaxpr
        self.env: dict[Any, Any] = {}
        self.context: Any = None
        self.index = 0  # the equation being evaluated
        self._literal = literal

    def read(self, atom: Any) -> Any:
        """The value of a variable, or of a literal (as the walker's `literal` gives it)."""
        if isinstance(atom, _compat.Literal):
            return self._literal(atom.val)
        return self.env[atom]

    def write(self, var: Any, value: Any) -> None:
        """Store `value` for `var`; a dropped variable (`_`) stores nothing."""
        if isinstance(var, _compat.Var) and not _compat.is_drop_var(var):
            self.env[var] = value


EquationObserver = Callable[[_compat.JaxprEqn, Sequence[Any], Sequence[Any]], None]


class _Observers(threading.local):
    def __init__(self) -> None:
        self.stack: list[EquationObserver] = []


_OBSERVERS = _Observers()


@contextlib.contextmanager
def observe_equations(observer: EquationObserver) -> Iterator[None]:
    """Call `observer(eqn, inputs, outputs)` after `autoscale` evaluates each equation.

    Inputs and outputs are the values the interpreter holds (ScaledArrays or plain arrays,
    tracers inside re-traced sub-jaxprs). For diagnostics such as `jsa.analysis`; an
    observer must not change the values. Observers see the interpretation, which runs at
    every call of an autoscaled function (only when tracing, under an outer `jax.jit`).
    """
    _OBSERVERS.stack.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.stack.pop()


def equation_observers() -> Sequence[EquationObserver]:
    """The observers `observe_equations` installed (innermost last)."""
    return _OBSERVERS.stack


def bind_equation(eqn: _compat.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Bind `eqn`'s primitive again on `invals`, with its parameters (sub-jaxprs unchanged)."""
    subfuns, bind_params = _compat.get_bind_params(eqn)
    outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


class JaxprWalker:
    """Evaluates jaxprs equation by equation; a transform overrides :meth:`eval_eqn` (and
    optionally :meth:`enter`, :meth:`literal`, :meth:`groups`, :meth:`observers`).

    By default every equation is bound again unchanged (:func:`bind_equation`), so a walk
    rebuilds the same program under the current trace.
    """

    # --- what a transform overrides ------------------------------------------------------

    # Each equation is evaluated under its source information and name stack, so that what
    # it binds carries them (a transform whose values are not traced turns this off).
    keep_source_info = True

    def enter(self, frame: Frame, parent: Any) -> Any:
        """The context of a walk over `frame.jaxpr`, whose constants and inputs `frame`
        holds (`parent`: the context `run` was given)."""
        return parent

    def literal(self, value: Any) -> Any:
        """The value of a literal operand."""
        return value

    def eval_eqn(self, eqn: Any, invals: list[Any], frame: Frame) -> list[Any]:
        """The outputs of `eqn` on `invals` (one per output variable)."""
        return bind_equation(eqn, invals)

    def groups(self, jaxpr: Any, context: Any) -> Sequence[Group]:
        """Runs of equations of `jaxpr` to offer to :meth:`eval_group` (none by default)."""
        return ()

    def eval_group(self, group: Group, invals: list[Any], frame: Frame) -> list[Any] | None:
        """Outputs (for `group.outputs`) replacing a run of equations, or None to walk it."""
        return None

    def observers(self) -> Sequence[EquationObserver]:
        """Called with `(eqn, inputs, outputs)` after each equation (none by default)."""
        return ()

    # --- the walk ------------------------------------------------------------------------

    def run_closed(self, closed: Any, args: Sequence[Any], parent: Any = None) -> list[Any]:
        """:meth:`run` on a closed jaxpr."""
        return self.run(closed.jaxpr, closed.consts, args, parent)

    def run(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], parent: Any = None
    ) -> list[Any]:
        """Evaluate `jaxpr` on `consts` and `args`; returns its outputs' values."""
        frame = self.start(jaxpr, consts, args, parent)
        self.walk(frame)
        return [frame.read(v) for v in jaxpr.outvars]

    def start(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], parent: Any = None
    ) -> Frame:
        """A frame for a walk over `jaxpr`: its constants and inputs stored, its context
        entered (:meth:`walk` then evaluates the equations)."""
        if len(args) != len(jaxpr.invars):
            raise TypeError(f"jaxpr takes {len(jaxpr.invars)} arguments, got {len(args)}.")
        if len(consts) != len(jaxpr.constvars):
            raise TypeError(f"jaxpr takes {len(jaxpr.constvars)} constants, got {len(consts)}.")
        frame = Frame(jaxpr, self.literal)
        for var, value in zip(jaxpr.constvars, consts):
            frame.write(var, value)
        for var, value in zip(jaxpr.invars, args):
            frame.write(var, value)
        frame.context = self.enter(frame, parent)
        return frame

    def walk(self, frame: Frame) -> None:
        """Evaluate the equations of `frame.jaxpr`, its inputs being stored in `frame`."""
        eqns = frame.jaxpr.eqns
        starts = {g.start: g for g in self.groups(frame.jaxpr, frame.context)}
        observers = self.observers()
        index = 0
        while index < len(eqns):
            group = starts.get(index)
            if group is not None:
                outs = self.eval_group(group, [frame.read(v) for v in group.inputs], frame)
                if outs is not None:
                    if len(outs) != len(group.outputs):
                        raise ValueError(
                            f"replacement for {group.key!r} returned {len(outs)} outputs, "
                            f"the function it replaces has {len(group.outputs)}."
                        )
                    for var, out in zip(group.outputs, outs):
                        frame.write(var, _check_like(var, out, group.key))
                    index = group.stop
                    continue
            eqn = eqns[index]
            frame.index = index
            invals = [frame.read(a) for a in eqn.invars]
            if self.keep_source_info:
                with _compat.eqn_context(eqn):
                    outs = self.eval_eqn(eqn, invals, frame)
            else:
                outs = self.eval_eqn(eqn, invals, frame)
            if len(outs) != len(eqn.outvars):
                raise TypeError(
                    f"The rule of '{eqn.primitive.name}' returned {len(outs)} outputs, "
                    f"expected {len(eqn.outvars)}."
                )
            for observer in observers:
                observer(eqn, invals, outs)
            for var, out in zip(eqn.outvars, outs):
                frame.write(var, out)
            index += 1

    # --- higher-order primitives, for rewriting transforms -------------------------------

    def eval_higher_order(self, eqn: Any, invals: list[Any], context: Any) -> list[Any]:
        """`eqn` with its bodies evaluated by this walker: `jit` and `closed_call` inlined;
        `scan`, `while`, `cond` and `checkpoint` rebuilt with `jax.lax`'s functions; any
        other primitive (custom derivatives included) bound unchanged."""
        prim, params = eqn.primitive, eqn.params
        if prim is _compat.jit_p:
            return self.run_closed(params["jaxpr"], invals, context)
        if prim is _compat.closed_call_p:
            return self.run_closed(params["call_jaxpr"], invals, context)
        if prim is _compat.scan_p:
            return self._scan(params, invals, context)
        if prim is _compat.while_p:
            return self._while(params, invals, context)
        if prim is _compat.cond_p:
            return self._cond(params, invals, context)
        if prim is _compat.remat_p:
            return self._remat(params, invals, context)
        return bind_equation(eqn, invals)

    def _scan(self, params: Any, invals: list[Any], context: Any) -> list[Any]:
        body, num_consts, num_carry = _compat.scan_layout(params)
        consts = invals[:num_consts]
        carry = invals[num_consts : num_consts + num_carry]
        xs = invals[num_consts + num_carry :]

        def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            outs = self.run_closed(body, [*consts, *c, *x], context)
            return outs[:num_carry], outs[num_carry:]

        carry_out, ys = jax.lax.scan(
            step,
            carry,
            xs,
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*carry_out, *ys]

    def _while(self, params: Any, invals: list[Any], context: Any) -> list[Any]:
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        cond_consts = invals[:n_cond]
        body_consts = invals[n_cond : n_cond + n_body]
        init = invals[n_cond + n_body :]

        def cond_fun(carry: Any) -> Any:
            return self.run_closed(params["cond_jaxpr"], [*cond_consts, *carry], context)[0]

        def body_fun(carry: Any) -> Any:
            return self.run_closed(params["body_jaxpr"], [*body_consts, *carry], context)

        return list(jax.lax.while_loop(cond_fun, body_fun, init))

    def _cond(self, params: Any, invals: list[Any], context: Any) -> list[Any]:
        index, *operands = invals

        def branch(closed: Any) -> Callable[..., list[Any]]:
            return lambda *ops: self.run_closed(closed, list(ops), context)

        branches = [branch(b) for b in params["branches"]]
        return list(jax.lax.switch(index, branches, *operands))

    def _remat(self, params: Any, invals: list[Any], context: Any) -> list[Any]:
        inner = params["jaxpr"]

        def body(*args: Any) -> list[Any]:
            return self.run(inner, (), args, context)

        wrapped = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
        return list(wrapped(*invals))


def _check_like(var: Any, out: Any, key: Any) -> Any:
    """`out`, a replacement's output for `var`, if it has `var`'s shape."""
    shape = getattr(out, "shape", None)
    if shape is not None and tuple(shape) != tuple(var.aval.shape):
        raise ValueError(
            f"replacement for {key!r} returned shape {tuple(shape)}; the function it replaces "
            f"returns {tuple(var.aval.shape)}."
        )
    return out


# --- composing transforms ------------------------------------------------------------------

_REWRAP = "__jsa_rewrap__"


def declare_rewrap(wrapped: Any, inner: Callable[..., Any], rewrap: Callable[..., Any]) -> Any:
    """Declare that `wrapped` is `rewrap(inner)` (a transform of `inner`); returns `wrapped`.

    A transform that must act on the user's program (:func:`unwrap_outer`) then acts on
    `inner` and applies `rewrap` to the result.
    """
    setattr(wrapped, _REWRAP, (inner, rewrap))
    return wrapped


def own_rewrap(fn: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """`fn`'s own `(inner, rewrap)` declaration, or None. A wrapper made with
    `functools.wraps` (`jax.grad`, `jax.jit`) copies the attributes of the function it wraps,
    the declaration included: it is `fn`'s own only when `fn` wraps `inner` directly. A
    `jax.jit` (a wrapper that can be lowered) is looked through: jitting does not change
    values, and the re-wrapped function can be jitted again from outside."""
    entry = getattr(fn, _REWRAP, None)
    if entry is None:
        return None
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is entry[0]:
        return entry  # type: ignore[no-any-return]
    if wrapped is not None and callable(getattr(fn, "lower", None)):
        return own_rewrap(wrapped)
    return None


def unwrap_outer(fn: Any) -> tuple[Any, Callable[[Any], Any]]:
    """`(inner, rewrap)` with `rewrap(inner)` equal to `fn`, `inner` the function below every
    transform that declared how to re-apply itself; `(fn, identity)` for other functions.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> from jax_scaled_arithmetics.core.walker import unwrap_outer
        >>> def f(x):
        ...     return x
        >>> inner, rewrap = unwrap_outer(jsa.autoscale(f))
        >>> inner is f
        True
    """
    entry = own_rewrap(fn)
    if entry is None:
        return fn, lambda g: g
    inner, rewrap = entry
    inner, inner_rewrap = unwrap_outer(inner)
    return inner, lambda g: rewrap(inner_rewrap(g))
