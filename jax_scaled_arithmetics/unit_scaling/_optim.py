"""`U.optim`: the u-muP learning-rate rules as optax transformations.

In u-muP (unit scaling with the maximal-update parametrisation) each parameter's learning
rate is the global one times a multiplier fixed by what the parameter is (its *kind*), its
fan-in and the depth of the residual stack it sits in, so that one learning rate transfers
across widths and depths. The rules and their defaults follow the PyTorch library
`unit-scaling` (0.3.5, `unit_scaling/optim.py`):

====================  ==========================  =========================================
kind                  Adam / AdamW                SGD, readout `"to_output_scale"`
====================  ==========================  =========================================
`"weight"`            `fan_in ** -0.5`            `fan_in ** 0.5`
`"embedding"`         `width ** -0.5`             `width ** 0.5`
`"bias"`, `"norm"`    1                           the vector's size
`"output"`            1                           1
====================  ==========================  =========================================

times `depth ** -0.5` for a parameter inside the residual stack of a model of `depth`
layers. SGD with an unconstrained readout (`readout_constraint=None`, the default, as
`U.linear_readout`'s) has unit-scaled gradients, hence Adam's rules.

Weight decay is independent of the learning rate: each step decays a parameter by
`weight_decay * p * lr(t) / peak_learning_rate` (`weight_decay * p` for a constant
learning rate), whatever its multiplier.

Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jax_scaled_arithmetics.unit_scaling as U
    >>> params = {"w": jnp.ones((256, 64)), "b": jnp.zeros(64)}
    >>> opt = U.optim.adam(1e-2, {"w": "weight", "b": "bias"})
    >>> grads = {"w": jnp.ones((256, 64)), "b": jnp.ones(64)}
    >>> updates, state = opt.update(grads, opt.init(params), params)
    >>> round(float(updates["w"][0, 0]), 6), round(float(updates["b"][0]), 6)  # -lr * mult
    (-0.000625, -0.01)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from ..core.datatype import is_floating, is_scaled_leaf

if TYPE_CHECKING:
    import optax

__all__ = [
    "KINDS",
    "OPTIMIZERS",
    "ParamSpec",
    "adam",
    "adamw",
    "lr_scales",
    "scale_by_umup",
    "sgd",
]

KINDS = ("weight", "embedding", "bias", "norm", "output")
"""The parameter kinds: hidden weights (matmul and convolution kernels), input embedding
tables, biases, normalisation gains, and the readout (final projection) weight."""

OPTIMIZERS = ("adam", "sgd")
"""The rule sets: `"adam"` (Adam and AdamW) and `"sgd"`."""

READOUT_CONSTRAINTS = (None, "to_output_scale")

# A spec tree's leaves: a ParamSpec, a kind string, or None (a parameter with no rule).
Spec = Any
Specs = Any


def _check_count(value: Any, name: str, kind: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"ParamSpec({kind!r}): {name} must be an int or None, got {value!r}.")
    if value <= 0:
        raise ValueError(f"ParamSpec({kind!r}): {name} must be positive, got {value}.")
    return int(value)


def _check_kind(kind: Any) -> str:
    if not isinstance(kind, str):
        raise TypeError(f"a parameter kind must be a string, one of {KINDS}, got {kind!r}.")
    if kind not in KINDS:
        raise ValueError(f"unknown parameter kind {kind!r}: expected one of {KINDS}.")
    return kind


def _uses_sgd_rules(optimizer: str, readout_constraint: str | None) -> bool:
    """Whether the SGD rules apply (else Adam's); checks both arguments."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {OPTIMIZERS}.")
    if readout_constraint not in READOUT_CONSTRAINTS:
        raise ValueError(
            f"readout_constraint must be one of {READOUT_CONSTRAINTS}, got {readout_constraint!r}."
        )
    if optimizer == "adam" and readout_constraint is not None:
        raise ValueError(
            "readout_constraint chooses between SGD's rules; Adam's do not depend on it "
            f"(got optimizer='adam', readout_constraint={readout_constraint!r})."
        )
    return optimizer == "sgd" and readout_constraint == "to_output_scale"


def _fan_in_from_shape(kind: str, shape: Sequence[int] | None) -> int:
    """A weight's fan-in, `prod(shape[:-1])` ((in, out) kernel, HWIO convolution kernel),
    or an embedding's width, `shape[-1]` ((vocab, width) table)."""
    if shape is None:
        raise ValueError(
            f"ParamSpec({kind!r}) without fan_in reads it from the parameter's shape: pass shape=."
        )
    if len(shape) < 2:
        raise ValueError(
            f"a {kind!r} parameter of shape {tuple(shape)}: its fan-in is read from a shape of "
            f"rank 2 or more; give it as ParamSpec({kind!r}, fan_in)."
        )
    fan_in = math.prod(shape[:-1]) if kind == "weight" else shape[-1]
    if fan_in <= 0:
        raise ValueError(
            f"a {kind!r} parameter of shape {tuple(shape)} has fan_in {fan_in}: it must be "
            "positive."
        )
    return int(fan_in)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What a parameter is, for the u-muP learning-rate rules.

    A spec is one leaf of a spec tree (it is not a pytree node, so `jax.tree.map` over a
    tree of specs sees each spec whole).

    Attributes:
        kind: one of :data:`KINDS`: `"weight"` (a hidden matmul or convolution kernel),
            `"embedding"` (an input embedding table), `"bias"`, `"norm"` (a normalisation
            gain) or `"output"` (the readout weight).
        fan_in: for a weight, the number of inputs each output sums over; for an embedding,
            its width. None: read from the parameter's shape (weight `prod(shape[:-1])`,
            embedding `shape[-1]`). Not used by the other kinds.
        depth: the number of layers of the residual stack the parameter is in (a
            transformer's number of blocks, each holding an attention and an MLP branch);
            None outside it.

    Examples:
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> U.optim.ParamSpec("weight", fan_in=1024, depth=4).lr_scale()  # 1024**-0.5 / 2
        0.015625
    """

    kind: str
    fan_in: int | None = None
    depth: int | None = None

    def __post_init__(self) -> None:
        kind = _check_kind(self.kind)
        object.__setattr__(self, "fan_in", _check_count(self.fan_in, "fan_in", kind))
        object.__setattr__(self, "depth", _check_count(self.depth, "depth", kind))

    def lr_scale(
        self,
        optimizer: str = "adam",
        *,
        shape: Sequence[int] | None = None,
        readout_constraint: str | None = None,
    ) -> float:
        """The learning-rate multiplier of a parameter with this spec.

        Args:
            optimizer: `"adam"` (Adam and AdamW) or `"sgd"`.
            shape: the parameter's shape, needed when `fan_in` is None (weights and
                embeddings) and for SGD's bias and norm rule (their size).
            readout_constraint: SGD only: the readout's constraint, `None` (Adam's rules)
                or `"to_output_scale"`.

        Examples:
            >>> import jax_scaled_arithmetics.unit_scaling as U
            >>> U.optim.ParamSpec("embedding").lr_scale(shape=(1000, 64))  # 64**-0.5
            0.125
            >>> U.optim.ParamSpec("bias").lr_scale(
            ...     "sgd", shape=(64,), readout_constraint="to_output_scale")
            64.0
        """
        sgd_rules = _uses_sgd_rules(optimizer, readout_constraint)
        depth = 1.0 if self.depth is None else self.depth**-0.5
        if self.kind == "output":
            return depth
        if self.kind in ("bias", "norm"):
            if not sgd_rules:
                return depth
            if shape is None:
                raise ValueError(f"SGD's rule for a {self.kind!r} needs its shape: pass shape=.")
            return depth * math.prod(shape)
        fan_in = self.fan_in if self.fan_in is not None else _fan_in_from_shape(self.kind, shape)
        return depth * fan_in ** (0.5 if sgd_rules else -0.5)


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (ParamSpec, str))


def _map_specs(fn: Callable[[Spec, Any], Any], specs: Specs, tree: Any, where: str) -> Any:
    """`fn(spec, leaf)` for every leaf of `tree` (a ScaledArray is one leaf), `spec` the leaf
    of `specs` (a prefix of `tree`, or a callable making one from `tree`) above it."""
    spec_leaves, spec_def = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec_leaf)
    # A callable is a function making the specs, unless it is a tree of them (an Equinox
    # module is callable).
    if callable(specs) and not all(_is_spec_leaf(spec) for spec in spec_leaves):
        specs = specs(tree)
        spec_leaves, spec_def = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec_leaf)
    for spec in spec_leaves:
        if isinstance(spec, str):
            _check_kind(spec)
        elif not _is_spec_leaf(spec):
            raise TypeError(
                f"{where}: a spec is a ParamSpec, a kind ({', '.join(KINDS)}) or None, got "
                f"{type(spec).__name__}."
            )
    try:
        subtrees = spec_def.flatten_up_to(tree)  # type: ignore[attr-defined]
    except (ValueError, TypeError):
        params_def = jax.tree_util.tree_structure(tree, is_leaf=is_scaled_leaf)
        try:  # JAX's message names the mismatch; with the arrays as 0s it prints no values
            zeros = jax.tree_util.tree_map(lambda _: 0, tree)
            spec_def.flatten_up_to(zeros)  # type: ignore[attr-defined]
            detail = ""
        except (ValueError, TypeError) as err:
            detail = f": {err}"
        raise ValueError(
            f"{where}: the specs do not match the parameters' structure (specs: {spec_def}; "
            f"parameters: {params_def}){detail}"
        ) from None
    mapped = [
        jax.tree_util.tree_map(lambda leaf, s=spec: fn(s, leaf), subtree, is_leaf=is_scaled_leaf)
        for spec, subtree in zip(spec_leaves, subtrees)
    ]
    return jax.tree_util.tree_unflatten(spec_def, mapped)


def _leaf_lr_scale(
    spec: Spec,
    leaf: Any,
    optimizer: str,
    readout_constraint: str | None,
    allow_non_unit_scaling_params: bool,
    where: str,
) -> float | None:
    """The multiplier of one parameter leaf; None for a leaf that is not a floating array."""
    if not is_floating(leaf) or not hasattr(leaf, "shape"):
        return None
    if spec is None:
        if allow_non_unit_scaling_params:
            return 1.0
        raise ValueError(
            f"{where}: a floating parameter of shape {tuple(leaf.shape)} has no spec (None): "
            "give it a ParamSpec or a kind, or pass allow_non_unit_scaling_params=True to "
            "leave its learning rate unscaled."
        )
    if isinstance(spec, str):
        spec = ParamSpec(spec)
    return spec.lr_scale(optimizer, shape=tuple(leaf.shape), readout_constraint=readout_constraint)


def lr_scales(
    specs: Specs,
    params: Any,
    *,
    optimizer: str = "adam",
    readout_constraint: str | None = None,
    allow_non_unit_scaling_params: bool = False,
) -> Any:
    """The learning-rate multiplier of every parameter, as a tree like `params`.

    Args:
        specs: a tree like `params` (or a prefix of it) whose leaves are
            :class:`ParamSpec`s, kind strings (fan-in from the parameter's shape) or None;
            or a callable `params -> specs`.
        params: the parameters (arrays, ScaledArrays, shape structs; None leaves pass).
        optimizer: `"adam"` (Adam and AdamW) or `"sgd"`.
        readout_constraint: SGD only: `None` (Adam's rules) or `"to_output_scale"`.
        allow_non_unit_scaling_params: a floating parameter whose spec is None gets 1
            instead of raising `ValueError`.

    Returns:
        A float per floating parameter, None for other leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> params = {"emb": jnp.ones((1000, 64)), "w": jnp.ones((1024, 64)), "b": jnp.ones(64)}
        >>> specs = {"emb": "embedding", "w": U.optim.ParamSpec("weight", depth=4), "b": "bias"}
        >>> U.optim.lr_scales(specs, params)
        {'b': 1.0, 'emb': 0.125, 'w': 0.015625}
    """
    where = "lr_scales"
    return _map_specs(
        lambda spec, leaf: _leaf_lr_scale(
            spec, leaf, optimizer, readout_constraint, allow_non_unit_scaling_params, where
        ),
        specs,
        params,
        where,
    )


def scale_by_umup(
    specs: Specs,
    *,
    optimizer: str = "adam",
    readout_constraint: str | None = None,
    allow_non_unit_scaling_params: bool = False,
) -> optax.GradientTransformation:
    """An optax transformation multiplying each update by its u-muP learning-rate multiplier.

    Place it between the optimizer's direction (`optax.scale_by_adam`, `optax.trace`) and
    `optax.scale_by_learning_rate`. The multipliers are Python floats computed from the
    specs and the shapes while tracing (a multiplier of 1 costs nothing); it has no state.
    `init` checks the specs against the parameters.

    Args:
        specs: a tree like the parameters (or a prefix of it) of :class:`ParamSpec`s, kind
            strings or None; or a callable making it, called (as optax's masks are) with
            the parameters in `init` and the updates in `update`.
        optimizer: `"adam"` (Adam and AdamW) or `"sgd"`.
        readout_constraint: SGD only: `None` (Adam's rules) or `"to_output_scale"`.
        allow_non_unit_scaling_params: leave floating parameters whose spec is None
            unscaled (else `ValueError`).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> params = {"w": jnp.ones((256, 64)), "b": jnp.ones(64)}
        >>> tx = U.optim.scale_by_umup({"w": "weight", "b": "bias"})
        >>> updates, _ = tx.update(params, tx.init(params))
        >>> float(updates["w"][0, 0]), float(updates["b"][0])  # 256**-0.5, 1
        (0.0625, 1.0)
    """
    import optax

    where = "scale_by_umup"
    _uses_sgd_rules(optimizer, readout_constraint)

    def scale(spec: Spec, leaf: Any) -> Any:
        multiplier = _leaf_lr_scale(
            spec, leaf, optimizer, readout_constraint, allow_non_unit_scaling_params, where
        )
        return leaf if multiplier is None or multiplier == 1.0 else leaf * multiplier

    def init_fn(params: Any) -> optax.EmptyState:
        lr_scales(
            specs,
            params,
            optimizer=optimizer,
            readout_constraint=readout_constraint,
            allow_non_unit_scaling_params=allow_non_unit_scaling_params,
        )
        return optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        return _map_specs(scale, specs, updates, where), state

    return optax.GradientTransformation(init_fn, update_fn)


def _weight_decay(
    weight_decay: float,
    learning_rate: optax.ScalarOrSchedule,
    peak_learning_rate: float | None,
    independent_weight_decay: bool,
    mask: Any,
    where: str,
) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
    """(decay before the u-muP multipliers, decay after them): one of them the identity."""
    import optax

    if callable(weight_decay) or isinstance(weight_decay, bool):
        raise TypeError(f"{where}: weight_decay must be a number, got {weight_decay!r}.")
    if weight_decay < 0:
        raise ValueError(f"{where}: weight_decay must be non-negative, got {weight_decay}.")
    if weight_decay == 0:
        return optax.identity(), optax.identity()
    if not independent_weight_decay:  # through the multiplier and the learning rate
        return optax.add_decayed_weights(weight_decay, mask), optax.identity()
    if peak_learning_rate is None:
        if callable(learning_rate):
            raise ValueError(
                f"{where}: a learning-rate schedule with independent weight decay needs "
                "peak_learning_rate= (the decay per step is "
                "weight_decay * lr(step) / peak_learning_rate)."
            )
        peak_learning_rate = float(learning_rate)
    if not peak_learning_rate > 0:
        raise ValueError(
            f"{where}: independent weight decay divides by the peak learning rate, which must "
            f"be positive, got {peak_learning_rate}."
        )
    # Added before scale_by_learning_rate, so the step's decay is lr(t) * this rate.
    return optax.identity(), optax.add_decayed_weights(weight_decay / peak_learning_rate, mask)


def adam(
    learning_rate: optax.ScalarOrSchedule,
    specs: Specs,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    nesterov: bool = False,
    allow_non_unit_scaling_params: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Adam with the u-muP learning-rate multipliers (the reference's `Adam`, no decay).

    `optax.chain(optax.scale_by_adam(...), scale_by_umup(specs),
    optax.scale_by_learning_rate(learning_rate))`: with every multiplier 1 it is
    `optax.adam`. For weight decay use :func:`adamw`.

    Args:
        learning_rate: the global learning rate, or an optax schedule.
        specs: the parameters' specs, see :func:`scale_by_umup`.
        b1, b2, eps, eps_root, mu_dtype, nesterov: as in `optax.adam`.
        allow_non_unit_scaling_params: see :func:`scale_by_umup`.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> params = {"kernel": jnp.ones((3, 3, 16, 32)), "bias": jnp.zeros(32)}  # HWIO
        >>> opt = U.optim.adam(0.1, {"kernel": "weight", "bias": "bias"})
        >>> updates, _ = opt.update(params, opt.init(params), params)
        >>> round(float(updates["kernel"][0, 0, 0, 0]), 6)  # -0.1 / sqrt(3 * 3 * 16)
        -0.008333
    """
    import optax

    return optax.chain(
        optax.scale_by_adam(
            b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
        ),
        scale_by_umup(
            specs, optimizer="adam", allow_non_unit_scaling_params=allow_non_unit_scaling_params
        ),
        optax.scale_by_learning_rate(learning_rate),
    )


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    specs: Specs,
    *,
    weight_decay: float = 0.0,
    independent_weight_decay: bool = True,
    peak_learning_rate: float | None = None,
    mask: Any = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    nesterov: bool = False,
    allow_non_unit_scaling_params: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """AdamW with the u-muP learning-rate multipliers and learning-rate-independent decay.

    With `independent_weight_decay` (the default, as in the reference), each step moves a
    parameter `p` by `-lr(t) * mult * adam_step - weight_decay * p * lr(t) / peak`, where
    `peak` is `peak_learning_rate`, by default the constant `learning_rate` (so the decay
    is `weight_decay * p` per step); a schedule needs `peak_learning_rate`. Without it,
    the decay is `optax.adamw`'s scaled by the multiplier: `-lr(t) * mult * (adam_step +
    weight_decay * p)`.

    Args:
        learning_rate: the global learning rate, or an optax schedule.
        specs: the parameters' specs, see :func:`scale_by_umup`.
        weight_decay: the decay per step (relative to the peak learning rate).
        independent_weight_decay: decay independent of the learning rate and multipliers.
        peak_learning_rate: what the schedule's value is relative to (see above).
        mask: which parameters decay, as in `optax.add_decayed_weights`.
        b1, b2, eps, eps_root, mu_dtype, nesterov: as in `optax.adamw`.
        allow_non_unit_scaling_params: see :func:`scale_by_umup`.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> params = {"w": jnp.full((4, 4), 2.0)}
        >>> opt = U.optim.adamw(1e-3, {"w": "weight"}, weight_decay=0.1)
        >>> updates, _ = opt.update({"w": jnp.zeros((4, 4))}, opt.init(params), params)
        >>> round(float(updates["w"][0, 0]), 6)  # zero gradient: -0.1 * 2 per step
        -0.2
    """
    import optax

    before, after = _weight_decay(
        weight_decay, learning_rate, peak_learning_rate, independent_weight_decay, mask, "adamw"
    )
    return optax.chain(
        optax.scale_by_adam(
            b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
        ),
        before,
        scale_by_umup(
            specs, optimizer="adam", allow_non_unit_scaling_params=allow_non_unit_scaling_params
        ),
        after,
        optax.scale_by_learning_rate(learning_rate),
    )


def sgd(
    learning_rate: optax.ScalarOrSchedule,
    specs: Specs,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
    readout_constraint: str | None = None,
    weight_decay: float = 0.0,
    independent_weight_decay: bool = True,
    peak_learning_rate: float | None = None,
    mask: Any = None,
    allow_non_unit_scaling_params: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """SGD with the u-muP learning-rate multipliers.

    `readout_constraint` is the constraint of the model's `U.linear_readout`: `None` (its
    default) gives unit-scaled gradients and Adam's rules; `"to_output_scale"` SGD's own
    (see the module's table). Weight decay as in :func:`adamw`; it is added to the update
    after the momentum (the reference, through `torch.optim.SGD`, adds it to the gradient
    before the momentum: the same without momentum).

    Args:
        learning_rate: the global learning rate, or an optax schedule.
        specs: the parameters' specs, see :func:`scale_by_umup`.
        momentum, nesterov, accumulator_dtype: as in `optax.sgd`.
        readout_constraint: `None` or `"to_output_scale"`.
        weight_decay, independent_weight_decay, peak_learning_rate, mask: as in
            :func:`adamw`.
        allow_non_unit_scaling_params: see :func:`scale_by_umup`.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> params = {"w": jnp.ones((16, 8)), "b": jnp.ones(8)}
        >>> opt = U.optim.sgd(0.1, {"w": "weight", "b": "bias"},  # -0.1 * 16**0.5, -0.1 * 8
        ...                   readout_constraint="to_output_scale")
        >>> updates, _ = opt.update(params, opt.init(params), params)
        >>> round(float(updates["w"][0, 0]), 6), round(float(updates["b"][0]), 6)
        (-0.4, -0.8)
    """
    import optax

    before, after = _weight_decay(
        weight_decay, learning_rate, peak_learning_rate, independent_weight_decay, mask, "sgd"
    )
    direction = (
        optax.identity()
        if momentum is None
        else optax.trace(decay=momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
    )
    return optax.chain(
        direction,
        before,
        scale_by_umup(
            specs,
            optimizer="sgd",
            readout_constraint=readout_constraint,
            allow_non_unit_scaling_params=allow_non_unit_scaling_params,
        ),
        after,
        optax.scale_by_learning_rate(learning_rate),
    )
