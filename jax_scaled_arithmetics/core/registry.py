"""The table of scaled rules: one record per JAX primitive (`RuleInfo`), holding everything
the interpreter needs to run it: the per-tensor rule, the block-scale rule, the guards, whether
operands are promoted and whether the rule runs with no scaled operand."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import _compat

Primitive = _compat.Primitive
ScaledRule = Callable[..., Any]
EquationGuard = Callable[[Any, Sequence[Any]], None]

__all__ = [
    "register_scaled_op",
    "get_scaled_rule",
    "has_scaled_rule",
    "coverage",
    "declared_rules",
    "installed_primitive",
    "register_block_rule",
    "get_block_rule",
    "register_equation_guard",
    "equation_guards",
    "RuleInfo",
    "interpret_closed_jaxpr",
    "set_jaxpr_interpreter",
    "find_rule",
    "operand_constants",
    "with_operand_constants",
]


@dataclasses.dataclass(frozen=True)
class RuleInfo:
    """A registered rule and how the interpreter must call it.

    Attributes:
        primitive: the JAX primitive (None for a rule declared by name for a primitive the
            installed JAX does not have).
        rule: `rule(*operands, **params)` returning the primitive's output(s),
            with ScaledArrays where the output is scaled.
        always_scaled: call the rule even when no operand is scaled (scaling
            primitives, and higher-order primitives whose inner jaxpr may
            create scaled values).
        promote: promote unscaled floating operands to ScaledArrays before the
            call (the default); rules that handle plain operands themselves set
            this to False.
        family: the rule family, shown in the coverage listing.
        remark: a short note for the coverage listing.
        block_rule: the rule used when an operand has a block scale (finer than one per
            tensor), same calling convention; None: block-scaled operands are brought to
            per-tensor form (`core.block_scales.to_per_tensor`) and `rule` runs.
        guards: `guard(eqn, operands)` functions called before the rule of every equation
            with a scaled operand (`register_equation_guard`).
    """

    primitive: Primitive | None
    rule: ScaledRule
    always_scaled: bool = False
    promote: bool = True
    family: str = ""
    remark: str = ""
    block_rule: ScaledRule | None = None
    guards: tuple[EquationGuard, ...] = ()


def _no_rule(*operands: Any, **params: Any) -> Any:
    raise NotImplementedError("This primitive has a block rule or guards but no scaled rule.")


# One record per primitive. A record whose rule is `_no_rule` holds a block rule or guards
# registered before the primitive's rule (module import order does not matter).
_RULES: dict[Primitive, RuleInfo] = {}
# Rules declared by name for primitives the installed JAX does not have (other releases do).
_ABSENT_RULES: dict[str, RuleInfo] = {}


def register_scaled_op(
    primitive: Primitive | str,
    rule: ScaledRule | None = None,
    *,
    always_scaled: bool = False,
    promote: bool = True,
    family: str = "",
    remark: str = "",
) -> Any:
    """Register the scaled rule of a JAX primitive; usable as a decorator.

    The rule is called as `rule(*operands, **params)`, with the equation's
    params passed through unchanged; it returns what the primitive returns,
    with ScaledArrays in place of scaled outputs.

    A primitive that only some supported JAX releases have is given by its name in
    `core/_compat.PRIMITIVE_RELEASES` (e.g. `"polynomial"`, JAX >= 0.12): where the
    installed JAX has it, the rule is registered for it; elsewhere the rule is only
    declared (`declared_rules()` lists it, with its family and remark), so that the
    operator listing is the same on every release.

    Raises:
        ValueError: the primitive already has a rule, or a name is not in
            `PRIMITIVE_RELEASES`.
        TypeError: `primitive` is neither a JAX primitive nor a name.
        RuntimeError: the release table and the installed JAX disagree about a named
            primitive.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics as jsa
        >>> from jax.extend.core import Primitive
        >>> twice_p = Primitive("twice_example")
        >>> @jsa.register_scaled_op(twice_p)
        ... def scaled_twice(x, **params):
        ...     return jsa.ScaledArray(x.data, x.scale * 2)
    """
    if isinstance(primitive, str):
        installed = installed_primitive(primitive)
        if installed is None:
            return _declare_absent(primitive, rule, always_scaled, promote, family, remark)
        primitive = installed
    if not isinstance(primitive, _compat.Primitive):
        raise TypeError(f"register_scaled_op expects a JAX primitive, got {primitive!r}.")
    prim = primitive  # narrowed, for `register`

    def register(fn: ScaledRule) -> ScaledRule:
        record = _RULES.get(prim)
        if record is not None and record.rule is not _no_rule:
            raise ValueError(
                f"A scaled rule is already registered for primitive '{prim.name}' "
                f"({record.rule.__qualname__})."
            )
        _RULES[prim] = dataclasses.replace(
            record or RuleInfo(prim, _no_rule),
            rule=fn,
            always_scaled=always_scaled,
            promote=promote,
            family=family,
            remark=remark,
        )
        return fn

    if rule is not None:
        return register(rule)
    return register


def _declare_absent(
    name: str,
    rule: ScaledRule | None,
    always_scaled: bool,
    promote: bool,
    family: str,
    remark: str,
) -> Any:
    """Declare the rule of `name`, a primitive the installed JAX does not have."""

    def declare(fn: ScaledRule) -> ScaledRule:
        _ABSENT_RULES[name] = RuleInfo(
            None, fn, always_scaled=always_scaled, promote=promote, family=family, remark=remark
        )
        return fn

    return declare(rule) if rule is not None else declare


def installed_primitive(name: str) -> Primitive | None:
    """The primitive `name` of `core/_compat.PRIMITIVE_RELEASES` in the installed JAX (None
    where this release does not have it).

    Raises:
        ValueError: `name` is not in `PRIMITIVE_RELEASES` (every supported release has it:
            use the primitive itself).
        RuntimeError: the release table and the installed JAX disagree.
    """
    if name not in _compat.PRIMITIVE_RELEASES:
        raise ValueError(
            f"'{name}' is not in core/_compat.PRIMITIVE_RELEASES (the primitives only some "
            f"supported JAX releases have): give a primitive every release has as itself, "
            f"e.g. `register_scaled_op(jax.lax.add_p, ...)`, not by its name."
        )
    prim = _compat.optional_primitive(f"{name}_p")
    expected = _compat.has_primitive(name)
    if (prim is not None) != expected:
        raise RuntimeError(
            f"JAX {_compat.JAX_VERSION} {'lacks' if expected else 'has'} the primitive "
            f"'{name}', which core/_compat.PRIMITIVE_RELEASES says it "
            f"{'has' if expected else 'lacks'} ({_compat.PRIMITIVE_RELEASES[name].describe()})."
        )
    return prim


def unregister_scaled_op(primitive: Primitive) -> None:
    """Remove a primitive's record: its rule, block rule and guards (for tests and for
    replacing a rule)."""
    _RULES.pop(primitive, None)


def find_rule(primitive: Primitive) -> RuleInfo | None:
    """The record of `primitive` when it has a rule, else None."""
    record = _RULES.get(primitive)
    return record if record is not None and record.rule is not _no_rule else None


def get_scaled_rule(primitive: Primitive) -> RuleInfo:
    """The rule of `primitive`.

    Raises:
        NotImplementedError: no rule is registered; the message names the
            primitive and says how to register one.
    """
    info = find_rule(primitive)
    if info is None:
        raise NotImplementedError(
            f"No scaled rule for JAX primitive '{primitive.name}': autoscale cannot apply it to "
            f"ScaledArray inputs. Register one with "
            f"`@jsa.register_scaled_op({primitive.name}_p)` on a function "
            f"`rule(*operands, **params)`, or convert its inputs with `jsa.lax.stop_scaling`."
        )
    return info


def _update(primitive: Primitive, **changes: Any) -> None:
    _RULES[primitive] = dataclasses.replace(
        _RULES.get(primitive) or RuleInfo(primitive, _no_rule), **changes
    )


def register_block_rule(primitive: Primitive, rule: ScaledRule | None = None) -> Any:
    """Register the rule a primitive uses when an operand has a block scale; usable as a
    decorator. Same calling convention as :func:`register_scaled_op` (operands are
    ScaledArrays with scalar or block scales, or plain values); it may return block-scaled
    outputs (a scale whose dimensions divide the output's). A primitive without one gets its
    block-scaled operands in per-tensor form (`core.block_scales.to_per_tensor`) and its
    ordinary rule."""

    def register(fn: ScaledRule) -> ScaledRule:
        record = _RULES.get(primitive)
        if record is not None and record.block_rule is not None:
            raise ValueError(f"A block rule is already registered for '{primitive.name}'.")
        _update(primitive, block_rule=fn)
        return fn

    return register(rule) if rule is not None else register


def get_block_rule(primitive: Primitive) -> ScaledRule | None:
    """The block-scale rule of `primitive`, or None (its operands then go per tensor)."""
    record = _RULES.get(primitive)
    return record.block_rule if record is not None else None


def register_equation_guard(primitive: Primitive, guard: EquationGuard) -> EquationGuard:
    """Register `guard(eqn, operands)`, called by the interpreter before the scaled rule of
    every `primitive` equation that has a scaled operand. A guard raises, at trace time,
    where the rule would compute a silently wrong number that the program's source can tell
    (see `lax/optimizer_guard.py`); it returns None otherwise."""
    record = _RULES.get(primitive)
    _update(primitive, guards=(*(record.guards if record else ()), guard))
    return guard


def equation_guards(primitive: Primitive) -> Sequence[EquationGuard]:
    """The guards registered for `primitive` (empty for most)."""
    record = _RULES.get(primitive)
    return record.guards if record is not None else ()


def has_scaled_rule(primitive: Primitive) -> bool:
    return find_rule(primitive) is not None


def coverage() -> dict[str, RuleInfo]:
    """All registered rules, by primitive name (for the generated operator docs).

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> rules = jsa.coverage()
        >>> rules["mul"].family, rules["mul"].remark
        ('mul', 'scales multiply')
        >>> "dot_general" in rules
        True
    """
    return {
        p.name: info
        for p, info in sorted(_RULES.items(), key=lambda kv: kv[0].name)
        if info.rule is not _no_rule
    }


def declared_rules() -> dict[str, RuleInfo]:
    """The rules of `coverage()`, and those declared by name for primitives that other
    supported JAX releases have (`primitive` None): the same names on every release, as
    docs/operators.md lists them."""
    return dict(sorted({**coverage(), **_ABSENT_RULES}.items()))


# Statically known scalar values of the operands of the rule being called, set by the
# interpreter around each rule call (one entry per operand: the Python scalar the operand is
# a broadcast of, or None).
class _OperandConstants(threading.local):
    def __init__(self) -> None:
        self.stack: list[Sequence[Any]] = []


_OPERAND_CONSTANTS = _OperandConstants()


def operand_constants() -> Sequence[Any]:
    """Statically known scalar values of the operands of the rule being called.

    One entry per operand: the Python scalar the operand is a broadcast of, or None.
    Rules use them to pick scales (a constant bound needs no scale of its own), and
    higher-order rules pass them on to the inner interpretation.
    """
    stack = _OPERAND_CONSTANTS.stack
    return stack[-1] if stack else ()


@contextlib.contextmanager
def with_operand_constants(known: Sequence[Any]) -> Iterator[None]:
    _OPERAND_CONSTANTS.stack.append(known)
    try:
        yield
    finally:
        _OPERAND_CONSTANTS.stack.pop()


# Higher-order rules re-interpret inner jaxprs. The interpreter installs itself here,
# so that rules never import it (and it never knows a rule by name).
_JAXPR_INTERPRETER: list[Callable[..., Any]] = []


def set_jaxpr_interpreter(fn: Callable[..., Any]) -> None:
    _JAXPR_INTERPRETER[:] = [fn]


def interpret_closed_jaxpr(
    closed_jaxpr: _compat.ClosedJaxpr, args: Sequence[Any], known: Sequence[Any] | None = None
) -> list[Any]:
    """Run `closed_jaxpr` on (possibly scaled) `args` with the scaled interpreter.

    `known` gives, per argument, a statically known scalar value the argument is
    a broadcast of (or None).
    """
    if not _JAXPR_INTERPRETER:
        raise RuntimeError("The autoscale interpreter is not installed.")
    return _JAXPR_INTERPRETER[0](closed_jaxpr, args, known)
