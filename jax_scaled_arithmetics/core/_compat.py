"""The single home of every JAX-internal import and version branch.

JAX's `jax.extend` and `jax.interpreters` modules promise no compatibility across
releases. Everything the library needs from them is imported here, under names
of our own, so that a JAX upgrade is a change to this file only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import config as _jax_config
from jax._src import core as _jax_core
from jax._src.interpreters.batching import BatchTracer as _BATCH_TRACER  # vmap's tracer
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
# The oldest release the package supports (`jax>=0.10.0` in pyproject.toml).
MIN_JAX_VERSION: tuple[int, ...] = (0, 10, 0)

Primitive = jex_core.Primitive
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
jaxpr_as_fun = jex_core.jaxpr_as_fun


class _PrimitiveNamespace:
    """`jax.extend.core.primitives`, falling back to JAX's internal modules for primitives it
    does not export (stack_p, tile_p, reshard_p, call_hi_primitive_p...)."""

    _INTERNAL_MODULES = (
        "jax._src.ad_checkpoint",
        "jax._src.lax.lax",
        "jax._src.lax.linalg",
        "jax._src.lax.scaled_dot",
        "jax._src.lax.control_flow",
        "jax._src.lax.slicing",
        "jax._src.lax.windowed_reductions",
        "jax._src.lax.special",
        "jax._src.debugging",
        "jax._src.pjit",
        "jax._src.dispatch",
        "jax._src.interpreters.ad",
        "jax._src.custom_derivatives",
        "jax._src.callback",
        "jax._src.hijax",
    )

    def __getattr__(self, name: str) -> Any:
        prim = getattr(jex_primitives, name, None)
        if prim is not None:
            return prim
        import importlib

        for module_name in self._INTERNAL_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            prim = getattr(module, name, None)
            if prim is not None:
                return prim
        raise AttributeError(f"JAX {jax.__version__} has no primitive {name!r}.")


primitives: Any = _PrimitiveNamespace()


def lax_implementation_primitives() -> dict[str, Primitive]:
    """The primitives defined in the modules behind `jax.lax` and `jax.lax.linalg` (the
    collectives of `jax._src.lax.parallel` left out: most there are internal forms of the
    exported ones), by name: those public functions bind, whether or not
    `jax.extend.core.primitives` exports them."""
    import importlib
    import pkgutil

    import jax._src.lax as lax_impl

    found: dict[str, Primitive] = {}
    for module_info in pkgutil.walk_packages(lax_impl.__path__, "jax._src.lax."):
        if module_info.name.endswith(".parallel"):
            continue
        try:
            module = importlib.import_module(module_info.name)
        except ImportError:  # a platform's module (e.g. a GPU library's) this install lacks
            continue
        for value in vars(module).values():
            if isinstance(value, Primitive):
                found.setdefault(value.name, value)
    return found


def cudnn_scaled_matmul_primitives() -> tuple[Primitive, ...]:
    """The primitives of `jax.nn.scaled_matmul` (its `scaled_matmul_wrapper`, which a jaxpr
    holds, then the `scaled_matmul` that one binds when evaluated), found by name in the
    module that defines them; none where this install lacks it."""
    import importlib

    try:
        module = importlib.import_module("jax._src.cudnn.scaled_matmul_stablehlo")
    except ImportError:
        return ()
    wanted = ("scaled_matmul_wrapper", "scaled_matmul")
    found = {v.name: v for v in vars(module).values() if isinstance(v, Primitive)}
    return tuple(found[name] for name in wanted if name in found)


def optional_primitive(name: str) -> Primitive | None:
    """A primitive that only some supported JAX releases have (None in the others).

    For primitives JAX introduced after the minimum supported release (see
    `PRIMITIVE_RELEASES`): older releases express the operation with other primitives,
    which have rules of their own.
    """
    try:
        return primitives.__getattr__(name)
    except AttributeError:
        return getattr(jax.lax, name, None)


@dataclasses.dataclass(frozen=True)
class PrimitiveReleases:
    """The supported JAX releases that have a primitive (by its name).

    Attributes:
        since: the first release that has it (None: every supported release up to `until`).
        until: the first release that no longer has it (None: up to the newest).
        note: what the releases without it have instead.
    """

    since: tuple[int, ...] | None = None
    until: tuple[int, ...] | None = None
    note: str = ""

    def has(self, version: tuple[int, ...]) -> bool:
        return (self.since is None or version >= self.since) and (
            self.until is None or version < self.until
        )

    def describe(self) -> str:
        """'JAX >= 0.11', 'JAX < 0.11' or 'JAX 0.10.2 .. 0.11' (and the note)."""
        fmt = lambda v: ".".join(str(p) for p in v)  # noqa: E731
        if self.since and self.until:
            text = f"JAX {fmt(self.since)} .. {fmt(self.until)}"
        elif self.since:
            text = f"JAX >= {fmt(self.since)}"
        else:
            text = f"JAX < {fmt(self.until or ())}"
        return f"{text} ({self.note})" if self.note else text


# Every primitive (by name) that some supported releases have and others do not, among those
# `jax.extend.core.primitives` exports and those the library has rules for: so that the
# operator listing (docs/operators.md) is the same whichever release generates it. A test
# on each release checks the table against what that release has.
PRIMITIVE_RELEASES: dict[str, PrimitiveReleases] = {
    "call": PrimitiveReleases(until=(0, 11), note="then eval_jaxpr"),
    "closed_call": PrimitiveReleases(until=(0, 11), note="then eval_jaxpr"),
    "eval_jaxpr": PrimitiveReleases(since=(0, 11), note="call and closed_call before"),
    "log2": PrimitiveReleases(since=(0, 11), note="log and div before"),
    "one_minus_square": PrimitiveReleases(since=(0, 11), note="sub and mul before"),
    "polynomial": PrimitiveReleases(since=(0, 12), note="mul and add before"),
    "stack": PrimitiveReleases(since=(0, 10, 2), note="broadcast_in_dim and concatenate before"),
    "unstack": PrimitiveReleases(since=(0, 10, 2), note="slice and squeeze before"),
}

# One primitive that releases name differently: {name in older releases: name in newer ones}.
# A rule registered for it (by object) covers both names.
PRIMITIVE_RENAMES: dict[str, str] = {"closed_call": "eval_jaxpr"}


def has_primitive(name: str) -> bool:
    """Whether the installed JAX has the primitive `name` (by `PRIMITIVE_RELEASES`; True for
    primitives every supported release has)."""
    releases = PRIMITIVE_RELEASES.get(name)
    return releases is None or releases.has(JAX_VERSION)


jit_p: Primitive = jex_primitives.jit_p
custom_jvp_call_p: Primitive = jex_primitives.custom_jvp_call_p
custom_vjp_call_p: Primitive = jex_primitives.custom_vjp_call_p
closed_call_p: Primitive = jex_primitives.closed_call_p
composite_p: Primitive = primitives.composite_p


def composite_decomposition(params: dict[str, Any]) -> Any:
    """The decomposition (a ClosedJaxpr) of a `composite` equation: its `call_jaxpr` param
    (JAX >= 0.11), `jaxpr` before."""
    return params["call_jaxpr"] if "call_jaxpr" in params else params["jaxpr"]


remat_p: Primitive = primitives.remat_p
scan_p: Primitive = jex_primitives.scan_p
while_p: Primitive = jex_primitives.while_p
cond_p: Primitive = jex_primitives.cond_p

# From JAX 0.11, `jax.shard_map` infers `in_specs` from the arguments' own shardings when
# they are left out (and given, they must match them); 0.10 needs them.
SHARD_MAP_INFERS_IN_SPECS: bool = JAX_VERSION >= (0, 11)

# Per-argument parameters of the jit primitive, which a rule that changes the
# number of arguments (one scaled input becomes data + scale) must expand.
JIT_PER_INPUT_PARAMS = ("in_shardings", "in_layouts", "donated_invars")
JIT_PER_OUTPUT_PARAMS = ("out_shardings", "out_layouts")

ad = _ad
batching = _batching
mlir = _mlir


def unspecified_sharding() -> Any:
    """The 'no sharding given' marker jit uses for an argument or output."""
    from jax._src import sharding_impls

    return sharding_impls.UNSPECIFIED


def jit_places_nothing(params: dict[str, Any]) -> bool:
    """Whether a jit equation's parameters give no sharding or layout for any argument or
    output (inlining it then changes nothing XLA is told)."""
    unspecified = unspecified_sharding()
    for name in ("in_shardings", "out_shardings"):
        if any(s is not unspecified for s in params.get(name, ())):
            return False
    return all(
        layout is None for name in ("in_layouts", "out_layouts") for layout in params.get(name, ())
    )


def default_per_arg_value(param_name: str) -> Any:
    """The value a jit per-argument parameter takes for an added scale argument."""
    if param_name in ("in_shardings", "out_shardings"):
        return unspecified_sharding()
    if param_name == "donated_invars":
        return False
    return None


def eqn_context(eqn: JaxprEqn) -> Any:
    """Context manager reproducing an equation's source info and context while binding it."""
    import contextlib

    from jax._src import source_info_util

    stack = contextlib.ExitStack()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack.enter_context(
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
    )
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and getattr(ctx, "manager", None) is not None:
        stack.enter_context(ctx.manager)
    return stack


def replace_eqn(eqn: JaxprEqn, **fields: Any) -> JaxprEqn:
    """A copy of `eqn` with some of its fields (`invars`, `outvars`, `params`...) replaced,
    its source information and context kept."""
    return eqn.replace(**fields)


def get_bind_params(eqn: JaxprEqn) -> tuple[list[Any], dict[str, Any]]:
    """Split an equation's params into the positional sub-functions and keyword params of bind
    (every supported release passes sub-functions as the `subfuns` param: none positional)."""
    return [], eqn.primitive.get_bind_params(eqn.params)


def is_symbolic_zero(x: Any) -> bool:
    """True for the objects JAX uses as symbolic zero cotangents (Zero, SymbolicZero, None)."""
    from jax._src import ad_util
    from jax._src.custom_derivatives import SymbolicZero

    return x is None or isinstance(x, (ad_util.Zero, SymbolicZero))


def typeof(x: Any) -> Any:
    """The abstract value (aval) of an array or tracer."""
    return jax.typeof(x)


def current_trace() -> Any:
    """The trace that values computed now belong to (the evaluation trace outside any
    transform; a new one inside each `make_jaxpr` / `jit` / `scan` body being traced)."""
    from jax._src import core as _core

    return _core.trace_ctx.trace


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def is_batched(x: Any) -> bool:
    """Whether `x` is a value being mapped by an enclosing `jax.vmap` (its tracer)."""
    return isinstance(x, _BATCH_TRACER)


def vmap_sizes(x: Any) -> dict[int, int]:
    """`{id(vmap level): batch size}` of the enclosing `jax.vmap`s that map `x` (nested
    vmaps from the innermost out; a level that does not map `x` is absent). Empty for a
    value no vmap maps, or one seen through another transform's tracer."""
    sizes: dict[int, int] = {}
    while isinstance(x, _BATCH_TRACER):
        dim = getattr(x, "batch_dim", None)
        if isinstance(dim, int):
            sizes[id(getattr(x, "_trace", None))] = int(x.val.shape[dim])
        x = x.val
    return sizes


def new_primitive(name: str, multiple_results: bool = False) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    return prim


def lowered_for_one_device(ctx: Any) -> bool:
    """Whether the lowering context `ctx` lowers a program that one device runs as is: a
    `jit` over one device, a `shard_map` body manual over every axis of more than one device,
    or (older JAX) a `pmap` body; not a program the SPMD partitioner splits over devices."""
    context = ctx.module_context.axis_context
    num_devices = getattr(context, "num_devices", None)
    if num_devices is not None:  # ShardingContext: jit over `num_devices`
        return bool(num_devices == 1)
    mesh = getattr(context, "mesh", None)
    if mesh is not None:  # SPMDAxisContext: shard_map, manual over `manual_axes`
        manual: frozenset[Any] = getattr(context, "manual_axes", frozenset())
        return all(size == 1 or name in manual for name, size in mesh.shape.items())
    return True


def register_lowering(
    prim: Primitive,
    impl: Any,
    multiple_results: bool = False,
    platform: str | None = None,
    *,
    partitioned_impl: Any = None,
) -> None:
    """`impl`, lowered, as `prim`'s lowering (on `platform` only, when given); with
    `partitioned_impl`, that one instead in a program partitioned over devices (see
    `lowered_for_one_device`)."""
    rule = _mlir.lower_fun(impl, multiple_results=multiple_results)
    if partitioned_impl is not None:
        one_device_rule = rule
        partitioned_rule = _mlir.lower_fun(partitioned_impl, multiple_results=multiple_results)

        def rule(ctx: Any, *args: Any, **params: Any) -> Any:
            chosen = one_device_rule if lowered_for_one_device(ctx) else partitioned_rule
            return chosen(ctx, *args, **params)

    if platform is None:
        _mlir.register_lowering(prim, rule)
    else:
        _mlir.register_lowering(prim, rule, platform=platform)


def register_batching(prim: Primitive, rule: Any) -> None:
    _batching.primitive_batchers[prim] = rule


def register_jvp(prim: Primitive, rule: Any) -> None:
    _ad.primitive_jvps[prim] = rule


def instantiate_zeros(x: Any) -> Any:
    return _ad.instantiate_zeros(x)


def hoist_consts(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """Turn a closed jaxpr's consts into leading arguments (closure conversion)."""
    from jax._src.interpreters import partial_eval as pe

    if not closed.consts:
        return closed, []
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    return ClosedJaxpr(jaxpr, ()), list(closed.consts)


def call_custom_vjp_bwd(bwd: Any, *residuals_and_cotangents: Any) -> list[Any]:
    """The input cotangents a `custom_vjp_call` equation's flattened `bwd` returns: a list
    up to JAX 0.10; from 0.11 a pair of that list and the rule's logs (None or a dict)."""
    out = bwd.call_wrapped(*residuals_and_cotangents)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple)):
        return list(out[0])
    return list(out)


def scan_layout(params: dict[str, Any]) -> tuple[ClosedJaxpr, int, int]:
    """A `scan` equation's body as a ClosedJaxpr, its number of consts and of carries.

    Up to JAX 0.10 the params hold `num_consts`, `num_carry` and a ClosedJaxpr; from 0.11,
    `ft_in` (the flat (consts, carries, xs) groups) and a Jaxpr.
    """
    jaxpr = params["jaxpr"]
    if not isinstance(jaxpr, ClosedJaxpr):
        jaxpr = ClosedJaxpr(jaxpr, ())
    if "num_consts" in params:
        return jaxpr, params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return jaxpr, len(consts), len(carry)


def is_drop_var(var: Any) -> bool:
    return type(var).__name__ == "DropVar"


def shape_dtype_struct(aval: Any) -> jax.ShapeDtypeStruct:
    """A `ShapeDtypeStruct` for `aval` keeping its weak type, inside `shard_map` the mesh
    axes it varies over (`manual_axis_type`, with the abstract-mesh sharding it needs), and
    its sharding over a mesh's explicit axes, so that a jaxpr traced over it types its
    operations as the original did."""
    kwargs: dict[str, Any] = {"weak_type": getattr(aval, "weak_type", False)}
    mat = getattr(aval, "mat", None)
    sharding = getattr(aval, "sharding", None)
    if mat is not None and not getattr(mat, "empty", True):
        kwargs.update(manual_axis_type=mat, sharding=sharding)
    elif any(entry is not None for entry in getattr(sharding, "spec", ())):
        # Sharded over a mesh's explicit axes: the sharding is part of the value's type.
        kwargs.update(sharding=sharding)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, **kwargs)


def varying_axes(aval: Any) -> frozenset[Any]:
    """Mesh axes over which a value varies inside `shard_map` (`aval.mat.varying`; empty
    when not tracked)."""
    return frozenset(getattr(getattr(aval, "mat", None), "varying", None) or ())


def vary_over(value: Any, axes: frozenset[Any]) -> Any:
    """`value` (an array) made to vary over every mesh axis of `axes` it does not vary over
    yet (inside `shard_map`; a type cast, the values are unchanged)."""
    if not axes or not hasattr(value, "shape"):
        return value
    missing = axes - varying_axes(typeof(value))
    if not missing:
        return value
    return jax.lax.pcast(value, tuple(sorted(missing, key=str)), to="varying")


def vary_like_plain(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Operands for binding `eqn`'s primitive again, typed (inside `shard_map`) as varying
    over the mesh axes the plain program's variables varied over.

    A value the interpreter computed can vary over other axes than the plain program's
    variable did: fewer (a cotangent built from a constant, data split from its scale) or
    more (a scale computed per device where the plain program had a constant). Each operand
    is first made to vary like its variable; when the equation's operands all varied alike
    in the plain program (JAX's check for most primitives), they are then made to vary
    alike again, over the union, as `jax.lax` does when it binds them."""
    variables = eqn.invars
    plain = [frozenset() if isinstance(v, Literal) else varying_axes(v.aval) for v in variables]
    out = [vary_over(value, wanted) for value, wanted in zip(invals, plain)]
    if len(out) < 2 or any(p != plain[0] for p in plain) or eqn.params.get("jaxpr") is not None:
        return out
    have = [varying_axes(typeof(v)) if hasattr(v, "shape") else frozenset() for v in out]
    if all(h == have[0] for h in have):
        return out
    return list(match_varying(*out))


def bind_pvary(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any] | None:
    """Bind a `pvary` equation over only the axes its operand does not vary over yet (the
    interpreter's value may already vary where the plain program's did not); None for any
    other equation."""
    if eqn.primitive.name != "pvary" or len(invals) != 1:
        return None
    value = invals[0]
    axes = tuple(a for a in eqn.params["axes"] if a not in varying_axes(typeof(value)))
    if not axes:
        return [value]
    out = eqn.primitive.bind(value, **{**eqn.params, "axes": axes})
    return list(out) if eqn.primitive.multiple_results else [out]


def eqn_source_summary(eqn: JaxprEqn, exclude: str = "") -> str:
    """An equation's user source location, 'file:line:col (function)' ('' when unknown): the
    innermost frame outside JAX (and outside files whose path starts with `exclude`)."""
    from jax._src import source_info_util

    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        if not exclude or not frame.file_name.startswith(exclude):
            location = f"{frame.file_name}:{frame.start_line}:{frame.start_column}"
            return f"{location} ({frame.function_name})"
    return ""


def _jax_hypot_with_unit_vector() -> Callable[..., Any] | None:
    """JAX >= 0.12's `jnp.hypot` core: a `custom_jvp` function returning `(r, x1 / r, x2 / r)`
    (None on earlier releases, whose `jnp.hypot` is ordinary `jax.numpy` code)."""
    from jax._src.numpy import ufuncs

    fun = getattr(ufuncs, "_hypot", None)
    return fun if isinstance(fun, jax.custom_jvp) else None


hypot_with_unit_vector: Callable[..., Any] | None = _jax_hypot_with_unit_vector()


def jax_hypot_outputs(call_jaxpr: Any) -> tuple[int, ...] | None:
    """Where a `custom_jvp_call`'s primal is `hypot_with_unit_vector` (`jnp.hypot`'s core on
    JAX >= 0.12, known by the function name and file JAX traced it from): which of its
    outputs `(r, x1 / r, x2 / r)` the call returns, in order (dead-code elimination drops
    the unused ones); None otherwise, or where its form is not the one known here.

    A unit-vector output is a `div` whose numerator is the selection, per element, among
    `x`, `x * 2**k` and `x * 2**-k` of one operand: its first case leads to that operand.
    """
    if hypot_with_unit_vector is None:
        return None
    jaxpr = getattr(call_jaxpr, "jaxpr", call_jaxpr)
    source = str(getattr(getattr(jaxpr, "debug_info", None), "func_src_info", "") or "")
    if not (source.startswith("_hypot ") and "numpy" in source and "ufuncs.py" in source):
        return None
    if len(jaxpr.invars) != 2 or not jaxpr.outvars:
        return None
    producers = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    operands = [id(v) for v in jaxpr.invars]

    def operand_of(var: Any) -> int | None:
        for _ in range(8):
            if id(var) in operands:
                return operands.index(id(var))
            eqn = producers.get(id(var))
            if eqn is None or eqn.primitive.name not in ("select_n", "mul"):
                return None
            var = eqn.invars[1 if eqn.primitive.name == "select_n" else 0]
        return None

    roles = []
    for var in jaxpr.outvars:
        eqn = producers.get(id(var))
        if eqn is None:
            return None
        if eqn.primitive.name != "div":
            roles.append(0)
            continue
        which = operand_of(eqn.invars[0])
        if which is None:
            return None
        roles.append(1 + which)
    if roles != sorted(set(roles)):
        return None
    return tuple(roles)


def accumulation_operands(lhs: Any, rhs: Any, acc_dtype: Any) -> tuple[Any, Any]:
    """Operands of a contraction accumulated in `acc_dtype`, as the backend can run it.

    XLA:CPU (jaxlib 0.10) has no bfloat16 x bfloat16 -> float32 dot for some batched
    layouts ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32", e.g. an
    attention score's gradient): there, bfloat16 operands are converted to float32 first,
    which is what XLA:CPU does with a bfloat16 dot anyway. Other backends get them as they
    are.
    """
    wide = jax.numpy.dtype(acc_dtype) == jax.numpy.dtype(jax.numpy.float32)
    bf16 = jax.numpy.dtype(jax.numpy.bfloat16)
    if wide and bf16 in (lhs.dtype, rhs.dtype) and jax.default_backend() == "cpu":
        return lhs.astype(jax.numpy.float32), rhs.astype(jax.numpy.float32)
    return lhs, rhs


def dce_closed_jaxpr(closed: Any) -> Any:
    """`closed` without the equations whose outputs nothing uses (and that have no
    effects), sub-jaxprs included; its inputs and outputs unchanged."""
    from jax._src.interpreters import partial_eval as pe

    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, True, instantiate=True)
    return ClosedJaxpr(jaxpr, closed.consts)


def eqn_user_frames(eqn: JaxprEqn) -> list[tuple[str, int, str]]:
    """An equation's source frames outside JAX, innermost first: (file, line, function)."""
    from jax._src import source_info_util

    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return []
    return [
        (frame.file_name, frame.start_line, frame.function_name)
        for frame in source_info_util.user_frames(traceback)
    ]


def eqn_name_stack(eqn: JaxprEqn) -> str:
    """An equation's name stack as text, e.g. 'transpose(jvp(mlp))' in a backward pass."""
    return str(eqn.source_info.name_stack)


def aval_like(
    aval: Any, shape: Sequence[int], dtype: Any, from_axes: Sequence[int | None] | None = None
) -> Any:
    """An abstract value of `shape` and `dtype` derived from `aval` (varying mesh axes kept,
    so that a value computed from one inside `shard_map` is typed as varying where it
    does). Its sharding keeps the partition spec entry of `aval`'s axis `from_axes[i]` for
    its axis `i` (None, or no `from_axes`: replicated): over a mesh's explicit axes a
    value's type holds its spec, one entry per axis."""
    shape = tuple(shape)
    update: dict[str, Any] = {"shape": shape, "dtype": jax.numpy.dtype(dtype), "weak_type": False}
    sharding: Any = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is not None and (len(spec) or shape):
        entries = tuple(spec) + (None,) * (len(aval.shape) - len(spec))
        axes = list(from_axes) if from_axes is not None else [None] * len(shape)
        new_spec = [entries[a] if a is not None else None for a in axes]
        update["sharding"] = sharding.update(spec=jax.sharding.PartitionSpec(*new_spec))
    return aval.update(**update)


def scalar_aval_like(aval: Any, dtype: Any) -> Any:
    """A scalar abstract value of `dtype` derived from `aval` (`aval_like`)."""
    return aval_like(aval, (), dtype)


# How `jax.lax`'s binary operations make their operands vary alike inside `shard_map`:
# `auto_insert_reshard` from JAX 0.10.2, `standard_insert_pvary` in 0.10.0 and 0.10.1.
INSERT_VARYING: str = (
    "auto_insert_reshard" if hasattr(_jax_core, "auto_insert_reshard") else "standard_insert_pvary"
)
_insert_varying: Callable[..., Any] = getattr(_jax_core, INSERT_VARYING)


def match_varying(*args: Any) -> tuple[Any, ...]:
    """Operands made to vary over the same mesh axes (inside `shard_map`), as `jax.lax`'s
    binary operations do before binding their primitive."""
    return tuple(_insert_varying(*args))


def eqn_code_frames(eqn: JaxprEqn) -> list[tuple[Any, int]]:
    """The Python frames (code object, bytecode offset) that were live when the equation was
    traced, innermost first; empty when JAX recorded no traceback."""
    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return []
    codes, offsets = traceback.raw_frames()
    return list(zip(codes, offsets))


def program_state(name: str, default: Any, help_text: str) -> Any:
    """A JAX configuration state whose value changes the programs traced under it, as
    `jax.default_matmul_precision`'s does: part of jit's cache key and of JAX's trace
    context, so that a jitted function is traced again under another value.

    `state.value` reads it (the thread's value, else the global one); `swap_local`/
    `set_local` set the thread's, `get_global`/`set_global` the process's. Values must be
    hashable.
    """
    return _jax_config.State(
        name, default, help_text, include_in_jit_key=True, include_in_trace_context=True
    )


# --- float16/bfloat16 linear algebra while autoscale traces ----------------------------------

# `jax.lax.linalg` primitives with float32/float64 (and complex) kernels only. From JAX 0.11
# their abstract evaluation refuses float16 and bfloat16 operands ("lu does not accept dtype
# float16"); JAX 0.10 accepted them, and most then failed to lower on CPU ("Unsupported dtype
# float16"). triangular_solve and lu_pivots_to_permutation take any float or integer.
FLOAT32_ONLY_LINALG: tuple[str, ...] = (
    "cholesky",
    "cholesky_update",
    "eig",
    "eigh",
    "geqp3",
    "geqrf",
    "hessenberg",
    "householder_product",
    "lu",
    "ormqr",
    "qr",
    "schur",
    "svd",
    "symmetric_product",
    "tridiagonal",
    "tridiagonal_solve",
)

# Set while `autoscale` traces the user's function. A JAX configuration state included in
# JAX's trace context, so that every cache JAX keys by it (jit's traces, abstract
# evaluations) keeps what was traced with it set apart from what was traced without: a
# function jitted inside `autoscale` and called again outside it is traced again there.
_LINALG_IN_FLOAT32 = _jax_config.State(
    "jax_scaled_arithmetics_narrow_linalg_in_float32",
    False,
    "Bind float16/bfloat16 operands of float32-only jax.lax.linalg primitives in float32 "
    "(set by jax_scaled_arithmetics.autoscale while it traces a function).",
    include_in_trace_context=True,
)


def _narrow_float_dtype(args: Sequence[Any]) -> Any:
    """The floating dtype narrower than float32 that every floating operand has, or None."""
    dtypes = {
        np.dtype(a.dtype)
        for a in args
        if hasattr(a, "dtype") and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
    }
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    return dtype if dtype.itemsize < 4 else None


def _float32_bind(prim: Primitive, bind: Callable[..., Any]) -> Callable[..., Any]:
    """`prim.bind`, computing in float32 (operands converted, float32 outputs converted
    back) when the trace flag is set and the floating operands are float16 or bfloat16."""

    def float32_bind(*args: Any, **params: Any) -> Any:
        if not _LINALG_IN_FLOAT32.value:
            return bind(*args, **params)
        narrow = _narrow_float_dtype(args)
        if narrow is None:
            return bind(*args, **params)
        f32 = np.dtype(np.float32)
        wide = [
            jax.lax.convert_element_type(a, f32) if getattr(a, "dtype", None) == narrow else a
            for a in args
        ]
        outs = bind(*wide, **params)
        back = lambda y: jax.lax.convert_element_type(y, narrow) if y.dtype == f32 else y  # noqa: E731
        return [back(y) for y in outs] if prim.multiple_results else back(outs)

    float32_bind.jsa_original_bind = bind  # type: ignore[attr-defined]
    return float32_bind


def _install_float32_linalg() -> None:
    """Wrap the `bind` of every `FLOAT32_ONLY_LINALG` primitive (once)."""
    from jax._src.lax import linalg as _linalg

    for name in FLOAT32_ONLY_LINALG:
        prim = getattr(_linalg, f"{name}_p")
        if not hasattr(prim.bind, "jsa_original_bind"):
            prim.bind = _float32_bind(prim, prim.bind)


@contextlib.contextmanager
def narrow_linalg_in_float32() -> Iterator[None]:
    """While active, `FLOAT32_ONLY_LINALG` primitives bound on float16/bfloat16 operands are
    traced as float32 ones between two converts (`autoscale` sets it while it traces the
    user's function; see docs/design.md, "Narrow floats in linear algebra"). Outside it,
    they behave as JAX defines them."""
    _install_float32_linalg()
    with _LINALG_IN_FLOAT32(True):
        yield


# --- hijax primitives ------------------------------------------------------------------------

call_hi_primitive_p: Primitive = primitives.call_hi_primitive_p


def hi_primitive_expansion(params: dict[str, Any]) -> ClosedJaxpr:
    """The jaxpr of a `call_hi_primitive` equation's operation in ordinary primitives (its
    `HiPrim`'s `expand`, as JAX lowers it), over the equation's flat operands.

    The expansion is wrapped in a `jax.custom_vjp` whose backward pass is JAX's own VJP of
    the HiPrim (its `vjp_fwd`/`vjp_bwd` or `jvp` and `transpose` rules): expansions such as
    those of `jnp.frexp` and `jnp.ldexp` go through bit casts, which have no derivative,
    and `grad(autoscale(f))` differentiates as `grad(f)` does.

    Raises:
        NotImplementedError: an operand of the hijax primitive is not an array.
    """
    hi_prim = params["_prim"]
    avals = list(hi_prim.in_avals_flat)
    if not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in avals):
        raise NotImplementedError(
            f"No scaled rule for the hijax primitive {type(hi_prim).__name__}: an operand is "
            f"not an array ({avals}). Convert its inputs with `jsa.lax.stop_scaling`."
        )

    @jax.custom_vjp
    def expanded(*args: Any) -> list[Any]:
        return list(call_hi_primitive_p.to_lojax(*args, **params))

    def fwd(*args: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return expanded(*args), args

    def bwd(args: tuple[Any, ...], cts: Sequence[Any]) -> tuple[Any, ...]:
        _, vjp = jax.vjp(lambda *a: list(call_hi_primitive_p.bind(*a, **params)), *args)
        return tuple(vjp(list(cts)))

    expanded.defvjp(fwd, bwd)
    return jax.make_jaxpr(expanded)(*[shape_dtype_struct(a) for a in avals])
