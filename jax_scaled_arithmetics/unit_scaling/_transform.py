"""`unit_scale`: a jaxpr transform giving a plain JAX function unit scaling.

Stages, on the jaxpr of the function (and of every `jit`/`scan`/`while`/`cond`/
`checkpoint` body in it):

1. the user's replacements (`replace={function: replacement}`);
2. `dot_general` and `conv_general_dilated` become unit-scaled matmuls/convolutions,
   calls of recognised library functions (`jax.nn.gelu`, `jax.nn.silu`, `jax.nn.softmax`)
   their unit-scaled versions, and a parameter broadcast over rows (a bias added, a gain
   multiplied) gets its gradient, a sum over the rows, scaled by 1/sqrt(rows);
3. residual adds, found by dependency analysis (an `add` one of whose operands is computed
   from the other), become `residual_add`, and the branch leaving the skip connection gets
   the matching `residual_split` gradient scaling;
4. the ops after the final residual add are unconstrained (their forward and backward
   factors are chosen independently: a scale mismatch there only multiplies every
   gradient by one constant), and constant multiplications there (the `1/N` of a mean loss)
   act on the forward pass only;
5. :func:`unit_init` unit-scales the weights and zeroes the biases of a parameter pytree.

The analysis behind stages 3 and 4 (residual adds, their branches and `tau`, the tail) is
in `_residual_analysis`.

Functions are recognised from the Python frames JAX records for each equation: the
equations traced inside one call of `jax.nn.gelu` carry `gelu`'s code object in their
traceback (JAX inlines `gelu`, so no `jit` boundary marks it). Jitted functions are also
recognised by the name of their `jit` equation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import _compat
from ..core.rewrite import code_of, find_calls, rewrite_call
from ..core.walker import Frame, Group, JaxprWalker, unwrap_outer
from . import _activations, _fwd_bwd, _linear, _ops_common, _residual, _softmax
from ._fwd_bwd import Constraint
from ._residual_analysis import TAU_RULES
from ._residual_analysis import Context as _Context
from ._residual_analysis import analyse as _analyse
from ._residual_analysis import residual_kinds as _residual_kinds
from ._residual_analysis import residual_tau as _residual_tau
from ._residual_analysis import tau_weights as _tau_weights

__all__ = ["unit_scale", "unit_init"]

# Library functions recognised by default: name -> the function (its code is looked up).
_LIBRARY: dict[str, Callable[..., Any]] = {
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "softmax": jax.nn.softmax,
}


def _literal_scalar(atom: Any) -> float | None:
    if not isinstance(atom, _compat.Literal):
        return None
    value = np.asarray(atom.val)
    if value.shape != () or not np.issubdtype(value.dtype, np.floating):
        return None
    return float(value)


class _UnitScaleRewriter(JaxprWalker):
    """`unit_scale`'s walk: recognised functions (groups of equations traced in one call)
    and matmuls, convolutions, broadcasts of parameters and residual adds get their
    unit-scaled versions; every other equation is kept (bodies walked too)."""

    def __init__(
        self,
        entries: dict[str, Callable[..., Any] | None],
        by_code: dict[Any, str],
        by_name: dict[str, str],
        tau: Any,
        constraint: Any,
        readout: str = "unit",
        attention: str = "plain",
    ):
        self.entries = entries  # key -> replacement (None: the library's unit-scaled version)
        self.by_code = by_code  # code object -> key
        self.by_name = by_name  # jit name -> key
        self.tau = tau
        self.constraint = constraint
        self.readout = readout
        self.attention = attention
        self.depth = 0
        self.replaced = 0
        self.taus: dict[tuple[int, int], float] = {}
        self.kinds: tuple[str, ...] = ()  # "attention" | "mlp" of every residual branch
        self.matmul_factor: dict[Any, float] = {}  # matmul output variable -> forward factor

    # --- analysis plumbing ---------------------------------------------------------------

    def enter(self, frame: Frame, parent: Any) -> _Context:
        if parent is None:
            self.kinds = tuple(_residual_kinds(frame.jaxpr, self.by_code))
        return _analyse(frame.jaxpr, "search" if parent is None else parent)

    def groups(self, jaxpr: Any, context: Any) -> list[Group]:
        return find_calls(jaxpr, self.by_code)

    def constraint_at(self, context: _Context, index: int) -> Any:
        return None if index in context.tail else self.constraint

    def tau_of(self, context: _Context, k: int, now: int) -> float:
        key = (id(context.jaxpr), k)
        if key not in self.taus:
            ahead = sum(1 for r in context.residual if now <= r < k)
            index = min(self.depth + ahead, max(len(self.kinds) - 1, 0))
            self.taus[key] = _residual_tau(self.tau, index, self.kinds)
        return self.taus[key]

    def bias_factor(self, bias: Any, other: Any, context: _Context) -> float | None:
        """The forward factor of the matmul whose output `other` is, when `bias` is a
        parameter broadcast over its rows (a vector, or a broadcast of one) added to it;
        None otherwise."""
        if isinstance(bias, _compat.Literal) or isinstance(other, _compat.Literal):
            return None
        if other not in self.matmul_factor:
            return None
        source = bias
        j = context.producer.get(bias)
        if j is not None and context.jaxpr.eqns[j].primitive.name == "broadcast_in_dim":
            source = context.jaxpr.eqns[j].invars[0]
        if not _is_parameter(source, context):
            return None
        # A bias is broadcast over the output's rows (a parameter as large as the output is
        # an input, such as the stream entering a block).
        if math.prod(source.aval.shape) >= math.prod(other.aval.shape):
            return None
        return self.matmul_factor[other]

    def split(self, context: _Context, index: int, position: int, value: Any) -> Any:
        """`residual_split`: a read of a skip connection that starts a residual branch gives
        the branch's gradient the weight `a` the forward pass gave the branch."""
        for k in context.branch_reads.get((index, position), ()):
            a, _ = _tau_weights(self.tau_of(context, k, index))
            value = _fwd_bwd.scale_bwd(value, a)
        return value

    # --- rewriting -----------------------------------------------------------------------

    def replace(
        self, key: str, eqns: list[Any], invals: list[Any], outvars: Any, constraint: Any
    ) -> list[Any] | None:
        replacement = self.entries[key]
        if key == "softmax" and self.attention == "plain":
            return None
        if replacement is not None:
            outs = replacement(*invals)
        else:
            outs = _library_call(key, eqns, invals, tuple(outvars), constraint)
            if outs is None:
                return None
        self.replaced += 1
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    def eval_group(self, group: Group, invals: list[Any], frame: Frame) -> list[Any] | None:
        context = frame.context
        eqns = context.jaxpr.eqns
        for i, var in enumerate(group.inputs):
            j, p = next(
                (j, p)
                for j in range(group.start, group.stop)
                for p, atom in enumerate(eqns[j].invars)
                if atom is var
            )
            invals[i] = self.split(context, j, p, invals[i])
        constraint = self.constraint_at(context, group.start)
        return self.replace(
            group.key, eqns[group.start : group.stop], invals, group.outputs, constraint
        )

    def eval_eqn(self, eqn: Any, invals: list[Any], frame: Frame) -> list[Any]:
        context, index = frame.context, frame.index
        outs = self.rewrite(eqn, index, invals, context)
        if outs is None:  # kept (on the operands `rewrite` may have replaced)
            outs = self.eval_higher_order(eqn, invals, context.child_mode.get(index, "none"))
        return outs

    def rewrite(
        self, eqn: Any, index: int, invals: list[Any], context: _Context
    ) -> list[Any] | None:
        """The unit-scaled outputs of equation `index`, or None to keep it (`invals` may
        be replaced in place: the kept equation is then bound on them)."""
        for p in range(len(invals)):
            invals[p] = self.split(context, index, p, invals[p])
        prim = eqn.primitive.name
        constraint = self.constraint_at(context, index)
        if eqn.primitive is _compat.jit_p:
            key = self.by_name.get(eqn.params.get("name", ""))
            if key is None:
                return None
            inner = eqn.params["jaxpr"].jaxpr
            return self.replace(key, inner.eqns, invals, eqn.outvars, constraint)
        if prim == "dot_general":
            self.replaced += 1
            _, params = _compat.get_bind_params(eqn)
            params = dict(params)
            dimension_numbers = params.pop("dimension_numbers")
            rhs = eqn.invars[1]
            rhs_computed = not isinstance(rhs, _compat.Literal) and rhs in context.computed
            lhs_atom = eqn.invars[0]
            lhs_computed = (
                not isinstance(lhs_atom, _compat.Literal) and lhs_atom in context.computed
            )
            if lhs_computed and rhs_computed and self.attention == "plain":
                return None  # a product of two activations (attention's): kept as written
            lhs, rhs_value = invals
            lhs_rows, rhs_rows = _vmapped_rows(rhs_value, lhs), _vmapped_rows(lhs, rhs_value)
            out = _linear.dot_general_with_rows(
                lhs,
                rhs_value,
                dimension_numbers,
                constraint=constraint,
                constrain_rhs=rhs_computed,
                lhs_grad_rows=lhs_rows,
                rhs_grad_rows=rhs_rows,
                **params,
            )
            fwd, _, _ = _linear.dot_general_factors(
                _ops_common.shape_of(lhs),
                _ops_common.shape_of(rhs_value),
                dimension_numbers,
                constraint,
                rhs_computed,
            )
            if index == context.readout and self.readout == "umup":
                (contracting, _), _ = dimension_numbers
                fan_in = math.prod(eqn.invars[0].aval.shape[d] for d in contracting)
                out = _fwd_bwd.scale_fwd(out, fan_in**-0.5)
                fwd *= fan_in**-0.5
            self.matmul_factor[eqn.outvars[0]] = fwd
            return [out]
        if prim == "conv_general_dilated":
            self.replaced += 1
            out, self.matmul_factor[eqn.outvars[0]] = _unit_conv(eqn, invals, constraint)
            return [out]
        if prim == "add" and index not in context.residual:
            # A bias added to a matmul's output enters the scaled product (as in the
            # reference's `U.linear`): it is multiplied by the matmul's forward factor, so its
            # effect per unit of parameter is the weight's (u-muP's bias rule assumes so).
            for p, atom in enumerate(eqn.invars):
                factor = self.bias_factor(atom, eqn.invars[1 - p], context)
                if factor is not None:
                    invals[p] = _fwd_bwd.scale_fwd(invals[p], factor)
        if prim in ("broadcast_in_dim", "add", "sub", "mul"):
            # A bias or a gain (any parameter) broadcast over rows: its gradient is a sum
            # over the rows, scaled back to unit like a weight gradient.
            # Under `jax.vmap`, the examples it maps the other operand over are rows too.
            size_out = math.prod(eqn.outvars[0].aval.shape)
            for p, atom in enumerate(eqn.invars):
                rows = math.prod(_vmapped_rows(v, invals[p]) for v in invals)
                size = math.prod(atom.aval.shape)
                if _is_parameter(atom, context) and 0 < size < size_out * rows:
                    factor = math.sqrt(size / (size_out * rows))
                    invals[p] = _fwd_bwd.scale_bwd(invals[p], factor)
        if index in context.residual:
            skip_pos = context.residual[index]
            tau = self.tau_of(context, index, index)
            self.depth += 1
            self.replaced += 1
            skip, branch = invals[skip_pos], invals[1 - skip_pos]
            _, b = _tau_weights(tau)
            # With the branch reads' `a`, this is `residual_split`: the true gradient reaches
            # the skip connection, the branch sees a unit one.
            return [_residual.residual_add(branch, _fwd_bwd.scale_bwd(skip, b), tau=tau)]
        if index in context.output_chain and prim in ("mul", "div"):
            return _forward_only_constant(eqn, invals)
        return None


def _vmapped_rows(value: Any, other: Any) -> int:
    """How many examples the enclosing `jax.vmap`s map `value` over and not `other` (1 with
    no vmap): a gradient of `other` summed over rows of `value` sums over those examples
    too, which the per-example shapes the transform sees do not show. So `jax.vmap(unit_
    scale(f))` gives a weight shared by the examples the gradient factor of `unit_scale(
    jax.vmap(f))`."""
    mine, others = _compat.vmap_sizes(value), _compat.vmap_sizes(other)
    return math.prod(size for level, size in mine.items() if level not in others)


def _is_computed(atom: Any, context: _Context) -> bool:
    """Computed by arithmetic from the inputs (an activation), not only reshaped from one."""
    return not isinstance(atom, _compat.Literal) and atom in context.computed


def _is_parameter(atom: Any, context: _Context) -> bool:
    """A floating input of the function (or a reshaping of one): a weight or a bias."""
    if isinstance(atom, _compat.Literal) or atom in context.computed:
        return False
    return bool(jnp.issubdtype(atom.aval.dtype, jnp.floating)) and len(atom.aval.shape) >= 1


def _forward_only_constant(eqn: Any, invals: list[Any]) -> list[Any] | None:
    """A multiplication or division by a literal constant whose gradient is not scaled by
    the constant (the 1/N of a mean loss after the final residual add)."""
    prim = eqn.primitive.name
    positions = (1, 0) if prim == "mul" else (1,)
    for pos in positions:
        constant = _literal_scalar(eqn.invars[pos])
        if constant is None or constant == 0.0 or not math.isfinite(constant):
            continue
        other = 1 - pos
        undo = 1.0 / constant if prim == "mul" else constant
        operands = list(invals)
        operands[other] = _fwd_bwd.scale_bwd(operands[other], undo)
        subfuns, bind_params = _compat.get_bind_params(eqn)
        return [eqn.primitive.bind(*subfuns, *operands, **bind_params)]
    return None


def _library_call(
    name: str, eqns: list[Any], invals: list[Any], outputs: tuple[Any, ...], constraint: Any
) -> Any:
    """A recognised library function's unit-scaled version, or None when the call does not
    have the expected form (one array in, one array of the same shape out)."""
    if len(invals) != 1 or len(outputs) != 1:
        return None
    (x,) = invals
    if tuple(outputs[0].aval.shape) != tuple(jnp.shape(x)):
        return None
    names = {e.primitive.name for e in eqns}
    if name == "gelu":
        approximate = "tanh" in names or not ({"erf", "erfc"} & names)
        return _activations.gelu(x, approximate=approximate, constraint=constraint)
    if name == "silu":
        return _activations.silu(x, constraint=constraint)
    if name == "softmax":
        axes = {
            tuple(e.params["axes"])
            for e in eqns
            if e.primitive.name in ("reduce_max", "reduce_sum")
        }
        if len(axes) != 1 or len(next(iter(axes))) != 1:
            return None
        return _softmax.softmax(x, axis=next(iter(axes))[0], constraint=constraint)
    return None


def _unit_conv(eqn: Any, invals: list[Any], constraint: Any) -> tuple[Any, float]:
    """`conv_general_dilated` times 1/sqrt(fan-in) forward, with unit-scaled gradients; and
    that forward factor."""
    lhs, rhs = invals
    params = eqn.params
    _, rhs_spec, out_spec = params["dimension_numbers"]
    kernel_shape = eqn.invars[1].aval.shape
    out_shape = eqn.outvars[0].aval.shape
    spatial = math.prod(kernel_shape[d] for d in rhs_spec[2:])
    groups = params.get("feature_group_count", 1)
    fan_in = spatial * kernel_shape[rhs_spec[1]]
    fan_out = spatial * kernel_shape[rhs_spec[0]] // max(groups, 1)
    kernel_fan = math.prod(out_shape) // out_shape[out_spec[1]] * _vmapped_rows(lhs, rhs)
    output_scale, (lhs_scale,) = _fwd_bwd.apply_constraint(constraint, fan_in**-0.5, fan_out**-0.5)
    kernel_scale = kernel_fan**-0.5
    subfuns, bind_params = _compat.get_bind_params(eqn)
    out = eqn.primitive.bind(
        *subfuns,
        _fwd_bwd.scale_bwd(lhs, lhs_scale / output_scale),
        _fwd_bwd.scale_bwd(rhs, kernel_scale / output_scale),
        **bind_params,
    )
    return out * jnp.asarray(output_scale, out.dtype), output_scale


def _resolve_replace(
    replace: Mapping[Any, Any] | None,
) -> tuple[dict[str, Callable[..., Any] | None], dict[Any, str], dict[str, str]]:
    entries: dict[str, Callable[..., Any] | None] = {}
    by_code: dict[Any, str] = {}
    by_name: dict[str, str] = {}
    for name, fn in _LIBRARY.items():
        key = name
        entries[key] = None
        code = code_of(fn)
        if code is not None:
            by_code[code] = key
        by_name[name] = key
    for target, replacement in (replace or {}).items():
        if not callable(target):
            raise TypeError(
                f"unit_scale: a `replace` key must be the function to replace, got "
                f"{type(target).__name__} {target!r}."
            )
        if not callable(replacement):
            raise TypeError(
                f"unit_scale: the replacement of {getattr(target, '__name__', target)!r} must be "
                f"callable, got {type(replacement).__name__}."
            )
        name = getattr(target, "__name__", None) or repr(target)
        code = code_of(target)
        key = f"replace:{name}:{id(target)}"
        entries[key] = replacement
        if code is not None:
            by_code[code] = key
        by_name[name] = key
    return entries, by_code, by_name


def unit_scale(
    fn: Callable[..., Any],
    replace: Mapping[Callable[..., Any], Callable[..., Any]] | None = None,
    *,
    tau: Any = "umup",
    constraint: Constraint = "to_output_scale",
    readout: str = "unit",
    attention: str = "plain",
) -> Callable[..., Any]:
    """A unit-scaled version of a plain JAX function (a model's apply, a loss).

    The function is traced to a jaxpr and evaluated again with: the `replace`ments;
    every `dot_general` a unit-scaled :func:`dot_general` (convolutions likewise);
    `jax.nn.gelu`, `jax.nn.silu` and `jax.nn.softmax` their unit-scaled versions; every
    residual add (an `add` of a value and something computed from it through a matmul) a
    :func:`residual_add` whose branch gets the matching :func:`residual_split` gradient
    weight; a bias or gain broadcast over rows a gradient scaled by 1/sqrt(rows) (and a bias
    added to a matmul's output the matmul's forward factor); the ops
    after the final residual add unconstrained, with the constant multiplications on the
    path to a loss (a mean's `1/N`) on the forward pass only. Other primitives
    pass through unchanged. Combine with :func:`unit_init` on the parameters.

    Args:
        fn: the function. Array arguments are traced; other arguments (numbers, configs) are
            static.
        replace: `{function: replacement}`. The equations traced inside each call of
            `function` (recognised from the frames JAX records, or by the name of a `jit`)
            are replaced by `replacement` called on the call's array inputs in the order the
            function first uses them; it must return the same number of arrays, same shapes.
        tau: the residual weight of each residual add (`a = tau / sqrt(1 + tau^2)` on the
            branch, `b = 1 / sqrt(1 + tau^2)` on the skip): a number (every add), or a rule
            for branch `i` (from 0) of the program's L residual branches:
            `"umup"` (the default; u-muP's transformer rule with equal weights:
            `tau_i = 1 / sqrt(L / 2 + i)`, so the embedding weighs as much as all the
            attention branches together, and as all the MLP branches), `"running_mean"`
            (`tau_i = 1 / sqrt(i + 1)`: the input and every branch weigh the same),
            `"reference"` (the PyTorch library's `unit_scale`: 0.01 on an attention branch,
            0.5 on the others), or a function `tau(i, kinds)`, `kinds` the tuple of
            `"attention"`/`"mlp"` of every branch (attention: the branch calls a softmax or an
            attention function). A residual add inside a `scan` body is counted once.
        constraint: the constraint of the ops before the final residual add (see
            `U.Constraint`); "to_output_scale" (the default) keeps their forward factors
            those of unit outputs, as the reference library's default does.
        readout: the factor of the readout (the first matmul after the final residual add):
            `"unit"` (1/sqrt(fan-in): logits of unit variance at initialisation) or
            `"umup"` (1/fan-in: u-muP's readout, logits near zero at initialisation, so the
            loss starts at log(vocabulary)).
        attention: `"plain"` (the default): products of two activations (attention's
            `q k^T` and `weights @ v`) and `jax.nn.softmax` are kept as written (with the
            user's own `1/sqrt(d)`, an attention's output is a weighted average of unit
            values); `"unit"`: they become :func:`dot_general` and :func:`softmax` (factors
            for full, unmasked rows: a causal mask then leaves early positions large).

    Raises:
        TypeError: `fn`, a `replace` key or a replacement is not callable.
        ValueError: the function has nothing to unit-scale (no matmul, convolution,
            recognised function or residual add), or it computes a gradient (see below).

    `jax.grad` goes outside: `jax.grad(unit_scale(f))` (or `jax.value_and_grad`, any
    `argnums` and `has_aux`, jitted or not) differentiates the unit-scaled function. A
    function whose program computes a gradient (`unit_scale(jax.grad(f))`, a training step,
    `jax.vjp`) raises a ValueError saying so: its traced program no longer says which
    backward equation belongs to which forward op (JAX's name stack marks backward
    equations, which is how it is detected).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.PRNGKey(0), (512, 256))
        >>> w = jax.random.normal(jax.random.PRNGKey(1), (256, 256))
        >>> y = U.unit_scale(lambda x, w: jax.nn.gelu(x @ w))(x, w)
        >>> round(float(jnp.std(y)), 1)  # plain: about 9.2
        1.0
    """
    if not callable(fn):
        raise TypeError(f"unit_scale expects a callable, got {type(fn).__name__}.")
    entries, by_code, by_name = _resolve_replace(replace)
    if not (
        (isinstance(tau, (int, float)) and not isinstance(tau, bool) and tau > 0)
        or tau in TAU_RULES
        or callable(tau)
    ):
        raise ValueError(
            f"unit_scale: tau must be a positive number, one of {TAU_RULES} or a function, "
            f"got {tau!r}."
        )
    _fwd_bwd.apply_constraint(constraint, 1.0, 1.0)  # validates the constraint's name
    if readout not in ("unit", "umup"):
        raise ValueError(f"unit_scale: readout must be 'unit' or 'umup', got {readout!r}.")
    if attention not in ("plain", "unit"):
        raise ValueError(f"unit_scale: attention must be 'plain' or 'unit', got {attention!r}.")
    inner, rewrap = unwrap_outer(fn)
    if inner is not fn:  # unit_scale(autoscale(f)) is autoscale(unit_scale(f)), likewise FP8
        return rewrap(
            unit_scale(
                inner,
                replace,
                tau=tau,
                constraint=constraint,
                readout=readout,
                attention=attention,
            )
        )

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        rewriter = _UnitScaleRewriter(
            entries, by_code, by_name, tau, constraint, readout, attention
        )
        out = rewrite_call("unit_scale", fn, rewriter, args, kwargs)
        if rewriter.replaced == 0:
            raise ValueError(
                f"unit_scale: {getattr(fn, '__name__', 'the function')} has nothing to "
                "unit-scale: no matmul, convolution, recognised function (jax.nn.gelu, silu, "
                "softmax or a `replace` key) or residual add."
            )
        return out

    return wrapped


def unit_init(params: Any, *, is_bias: Callable[[Any], bool] | None = None) -> Any:
    """Parameters for a unit-scaled model: weights of unit variance, biases zero.

    Every floating array of rank 2 or more is divided by its standard deviation (the same
    random draw, unit variance; a constant array is left as is); rank-0/1 floating arrays
    are biases and become zeros, except those that are all ones (the gains of layer norms),
    or, when given, those for which `is_bias(array)` is false.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> params = {"w": 0.02 * jax.random.normal(jax.random.PRNGKey(0), (64, 64)),
        ...           "b": jnp.full((64,), 0.1), "gain": jnp.ones((64,))}
        >>> p = U.unit_init(params)
        >>> round(float(jnp.std(p["w"])), 3), float(p["b"].max()), float(p["gain"].min())
        (1.0, 0.0, 1.0)
    """

    def init(leaf: Any) -> Any:
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        leaf = jnp.asarray(leaf)
        if leaf.ndim >= 2:
            std = jnp.std(leaf.astype(jnp.float32))
            safe = jnp.where(std > 0, std, 1.0)
            return (leaf.astype(jnp.float32) / safe).astype(leaf.dtype)
        bias = bool(is_bias(leaf)) if is_bias is not None else not bool(jnp.all(leaf == 1))
        return jnp.zeros_like(leaf) if bias else leaf

    return jax.tree_util.tree_map(init, params)
