"""Collectives and `shard_map` under autoscale, on a 4-device CPU mesh (tests/conftest.py).

Every per-shard function first rescales its inputs dynamically, and the shards hold
values of very different magnitudes (2^0 to 2^15 apart), so each device holds its own
scale: a collective that did not bring the shards to one scale would give wrong values.

XLA:CPU cannot run `ragged_all_to_all` nor `pbroadcast` (JAX lowers them for GPU/TPU
only), so this module lowers them on CPU through references written from their
documented semantics (the ragged one checked against the example in JAX's docs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.lax import collectives
from tests.helpers import (
    FLOAT_DTYPES,
    RTOL,
    WIDE_SCALES,
    assert_close,
    make_scaled,
    represented,
)
from tests.lax.test_control_flow import weighted_sum
from tests.lax.test_elementwise import primitives_of

N_DEVICES = 4
MESH = Mesh(np.array(jax.devices()[:N_DEVICES]), ("i",))
RNG = np.random.default_rng(7)


# --- a CPU lowering of ragged_all_to_all --------------------------------------------------


def reference_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
    axis_index_groups,
):  # fmt: skip
    """`ragged_all_to_all` from its documented semantics, with gathers and masks.

    Sender `d` writes `operand_d[input_offsets_d[k] : +send_sizes_d[k]]` at
    `output_offsets_d[k]` of device `k // (K / axis size)`'s output.
    """
    del recv_sizes  # equal to the matching send sizes, by the primitive's contract
    assert axis_index_groups is None, "the reference covers the whole axis"
    operands = jax.lax.all_gather(operand, axis_name)
    starts, sizes, targets = (
        jax.lax.all_gather(v, axis_name) for v in (input_offsets, send_sizes, output_offsets)
    )
    n_senders, n_slices = starts.shape
    per_device = n_slices // n_senders
    me = jax.lax.axis_index(axis_name)
    rows = jnp.arange(output.shape[0])
    result = output
    for sender in range(n_senders):
        for j in range(per_device):
            k = me * per_device + j
            target, size = targets[sender, k], sizes[sender, k]
            inside = (rows >= target) & (rows < target + size)
            source = jnp.clip(starts[sender, k] + rows - target, 0, operand.shape[0] - 1)
            mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
            result = jnp.where(mask, operands[sender][source].astype(output.dtype), result)
    return result


def reference_pbroadcast(x, *, axis_name, source):
    """`pbroadcast`: every device gets the value of device `source` (GPU-only in XLA)."""
    return jax.lax.all_gather(x, axis_name)[source]


for _prim, _reference_impl in (
    (collectives.ragged_all_to_all_p, reference_ragged_all_to_all),
    (collectives.pbroadcast_p, reference_pbroadcast),
):
    mlir.register_lowering(
        _prim, mlir.lower_fun(_reference_impl, multiple_results=False), platform="cpu"
    )


def test_reference_ragged_all_to_all_matches_the_documented_example():
    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))

    def per_shard(*args):
        return jax.lax.ragged_all_to_all(*(a[0] for a in args), axis_name="i")[None]

    args = [
        np.array(a)
        for a in (
            [[1.0, 2, 2], [3, 4, 0]],  # operand
            [[0.0, 0, 0, 0], [0, 0, 0, 0]],  # output
            [[0, 1], [0, 1]],  # input_offsets
            [[1, 2], [1, 1]],  # send_sizes
            [[0, 0], [1, 2]],  # output_offsets
            [[1, 1], [2, 1]],  # recv_sizes
        )
    ]
    out = jax.shard_map(per_shard, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(*args)
    np.testing.assert_array_equal(out, [[1, 3, 0, 0], [2, 2, 4, 0]])


def ragged_layout(rows: int = 8) -> tuple[np.ndarray, ...]:
    """Consistent offsets and sizes: device d sends sizes[d, k] rows to device k."""
    sizes = RNG.integers(0, 3, (N_DEVICES, N_DEVICES))
    input_offsets = np.cumsum(sizes, axis=1) - sizes
    output_offsets = np.cumsum(sizes, axis=0) - sizes  # receivers stack senders in order
    assert sizes.sum(axis=1).max() <= rows
    return tuple(
        a.astype(np.int32).reshape(-1) for a in (input_offsets, sizes, output_offsets, sizes.T)
    )


RAGGED_LAYOUT = ragged_layout()


# --- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A per-shard function on a 4-device mesh; scaled inputs are rescaled per shard first."""

    name: str
    per_shard: Callable[..., Any]
    shapes: Sequence[tuple[int, ...]]  # global shapes of the scaled inputs
    in_specs: Sequence[Any] | None = None  # default: every input split over "i"
    out_specs: Any = P("i")
    extra: Sequence[np.ndarray] = ()  # plain (integer) inputs, split over "i"
    grad: bool = True
    check_vma: bool = True
    _mapped: Callable[..., Any] = field(init=False, repr=False, compare=False)
    plain_jit: Callable[..., Any] = field(init=False, repr=False, compare=False)
    # jit(autoscale(fn)), built once: the tests of a case with the same dtype share its
    # compiled programs.
    scaled_jit: Callable[..., Any] = field(init=False, repr=False, compare=False)

    def inputs(self) -> list[np.ndarray]:
        out = []
        for shape in self.shapes:
            values = RNG.uniform(0.5, 1.5, shape) * RNG.choice([-1.0, 1.0], shape)
            magnitude = 2.0 ** (5 * np.arange(N_DEVICES))  # per shard
            values = values * np.repeat(magnitude, shape[0] // N_DEVICES)[:, None]
            out.append(values.astype(np.float32))
        return out

    def __post_init__(self) -> None:
        # One mapped function per case, so that JAX's caches compile it once.
        n_scaled = len(self.shapes)
        in_specs = tuple(self.in_specs or [P("i")] * n_scaled) + (P("i"),) * len(self.extra)

        def body(*shards: Any) -> Any:
            scaled = jsa.ops.dynamic_rescale_max(tuple(shards[:n_scaled]))
            return self.per_shard(*scaled, *shards[n_scaled:])

        mapped = jax.shard_map(
            body,
            mesh=MESH,
            in_specs=in_specs,
            out_specs=self.out_specs,
            check_vma=self.check_vma,
        )
        object.__setattr__(self, "_mapped", mapped)
        object.__setattr__(self, "plain_jit", jax.jit(self.fn))  # the reference
        object.__setattr__(self, "scaled_jit", jax.jit(jsa.autoscale(self.fn)))

    def fn(self, *args: Any) -> Any:
        return self._mapped(*args, *self.extra)


def _ring(x: Any) -> Any:
    return jax.lax.ppermute(x, "i", [(d, (d + 1) % N_DEVICES) for d in range(N_DEVICES)])


def _ragged(x: Any, out: Any, *layout: Any) -> Any:
    return jax.lax.ragged_all_to_all(x, out, *layout, axis_name="i")


def _ragged_into_zeros(x: Any, *layout: Any) -> Any:
    return jax.lax.ragged_all_to_all(x, jnp.zeros((12, 3), x.dtype), *layout, axis_name="i")


CASES = [
    Case("psum", lambda x: jax.lax.psum(x, "i"), [(8, 3)], out_specs=P()),
    # Without replication checks, `psum` binds `psum_p` (with them, `psum_invariant_p`).
    Case(
        "psum_unchecked", lambda x: jax.lax.psum(x, "i"), [(8, 3)], out_specs=P(), check_vma=False
    ),
    Case("psum_axis_tuple", lambda x: jax.lax.psum(x, ("i",)) * 2, [(8, 3)], out_specs=P()),
    Case("pmax", lambda x: jax.lax.pmax(x, "i"), [(8, 3)], out_specs=P(), grad=False),
    Case("pmin", lambda x: jax.lax.pmin(x, "i"), [(8, 3)], out_specs=P(), grad=False),
    Case("psum_of_invariant", lambda y: jax.lax.psum(y, "i"), [(4, 3)], [P()], P()),
    Case("all_gather", lambda x: jax.lax.all_gather(x, "i"), [(8, 3)]),
    Case("all_gather_tiled", lambda x: jax.lax.all_gather(x, "i", axis=1, tiled=True), [(8, 3)]),
    Case("psum_scatter", lambda x: jax.lax.psum_scatter(x, "i", tiled=True), [(16, 3)]),
    Case("all_to_all", lambda x: jax.lax.all_to_all(x, "i", 0, 0, tiled=True), [(16, 3)]),
    Case("ppermute_ring", _ring, [(8, 3)]),
    # JAX's own transpose of pbroadcast fails on non-scalars (`full_like` with an array).
    Case("pbroadcast", lambda x: jax.lax.pbroadcast(x, "i", 2), [(8, 3)], grad=False),
    Case(
        "pvary_then_add",
        lambda y, x: jax.lax.pcast(y, "i", to="varying") + x,
        [(4, 3), (16, 3)],
        [P(), P("i")],
    ),
    Case("ragged_all_to_all", _ragged, [(32, 3), (48, 3)], extra=RAGGED_LAYOUT),
    Case("ragged_all_to_all_into_zeros", _ragged_into_zeros, [(32, 3)], extra=RAGGED_LAYOUT),
]


def _case_id(case: Case) -> str:
    return case.name


def _scaled(case: Case, dtype: Any, scale: float) -> list[jsa.ScaledArray]:
    return [make_scaled(x, dtype, scale) for x in case.inputs()]


def _reference(case: Case, args: Sequence[jsa.ScaledArray]) -> Any:
    return case.plain_jit(*[jnp.asarray(represented(a), jnp.float32) for a in args])


def _dtype_of(case: Case) -> Any:
    """The case's data dtype in the default run: the dtypes in turn over the table (psum: all
    three, below), so that the zero-scale and inf/NaN tests reuse its compiled program."""
    return FLOAT_DTYPES[CASES.index(case) % len(FLOAT_DTYPES)]


@pytest.mark.parametrize(
    "case, dtype",
    [  # The default run: each case with one dtype, psum with all; the slow step: the rest.
        pytest.param(
            case,
            dtype,
            marks=() if dtype == _dtype_of(case) or case.name == "psum" else pytest.mark.slow,
            id=f"{case.name}-{dtype}",
        )
        for case in CASES
        for dtype in FLOAT_DTYPES
    ],
)
def test_collective_matches_plain_over_wide_scales(case, dtype):
    """One compiled program per dtype, run for every scale from 2^-60 to 2^60."""
    scaled_fn = case.scaled_jit
    for scale in WIDE_SCALES:
        args = _scaled(case, dtype, scale)
        out = scaled_fn(*args)
        assert isinstance(out, jsa.ScaledArray)
        assert out.dtype == dtype
        assert_close(out, _reference(case, args), RTOL[dtype])


# The collectives run eagerly in the default run (an eager `shard_map` dispatches each
# collective on its own, seconds a call: the others are marked slow; every case runs jitted
# in test_collective_matches_plain_over_wide_scales).
EAGER_CASES = ("psum",)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=() if case.name in EAGER_CASES else pytest.mark.slow)
        for case in CASES
    ],
    ids=_case_id,
)
def test_collective_without_jit(case):
    dtype = FLOAT_DTYPES[1]
    args = _scaled(case, dtype, 2.0**-30)
    assert_close(jsa.autoscale(case.fn)(*args), _reference(case, args), RTOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_collective_of_zero_scales(case):
    args = _scaled(case, _dtype_of(case), 2.0**-30)
    zeros = [jsa.ScaledArray(a.data, np.float32(0)) for a in args]
    np.testing.assert_array_equal(represented(case.scaled_jit(*zeros)), 0)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_collective_propagates_inf_and_nan_like_plain(case):
    dtype = _dtype_of(case)
    args = _scaled(case, dtype, 2.0**20)
    data = np.array(args[0].data)
    data[0, 0], data[-1, -1] = np.inf, np.nan  # first and last shard
    args[0] = jsa.ScaledArray(jnp.asarray(data), args[0].scale)
    assert_close(case.scaled_jit(*args), _reference(case, args), RTOL[dtype])


# The default run: the gradients of the collectives whose transposes differ, with the
# dtypes in turn (the variants psum_unchecked, psum_axis_tuple, psum_of_invariant,
# all_gather (untiled) and ragged_all_to_all_into_zeros run forward in
# test_collective_matches_plain_over_wide_scales); the slow step runs every case and dtype.
GRAD_DEFAULT = {
    "psum": FLOAT_DTYPES[0],
    "all_gather_tiled": FLOAT_DTYPES[1],
    "psum_scatter": FLOAT_DTYPES[2],
    "all_to_all": FLOAT_DTYPES[0],
    "ppermute_ring": FLOAT_DTYPES[1],
    "pvary_then_add": FLOAT_DTYPES[2],
    "ragged_all_to_all": FLOAT_DTYPES[1],
}


@pytest.mark.parametrize(
    "case, dtype",
    [
        pytest.param(
            case,
            dtype,
            marks=() if GRAD_DEFAULT.get(case.name) == dtype else pytest.mark.slow,
            id=f"{case.name}-{dtype}",
        )
        for case in CASES
        if case.grad
        for dtype in FLOAT_DTYPES
    ],
)
def test_collective_gradients(case, dtype):
    argnums = tuple(range(len(case.shapes)))
    loss = lambda *args: weighted_sum(case.fn(*args))  # noqa: E731
    grad_fn = jax.jit(jsa.autoscale(jax.grad(loss, argnums=argnums)))
    plain_grad_fn = jax.jit(jax.grad(loss, argnums=argnums))
    for scale in (2.0**-40, 2.0**40):
        args = _scaled(case, dtype, scale)
        plain = [jnp.asarray(represented(a), jnp.float32) for a in args]
        expected = plain_grad_fn(*plain)
        for got, want in zip(grad_fn(*args), expected, strict=True):
            assert isinstance(got, jsa.ScaledArray)
            assert_close(got, want, 4 * RTOL[dtype])


def test_table_covers_every_collective_rule():
    registered = {name for name, info in jsa.coverage().items() if info.family == "collective"}
    covered: set[str] = set()
    for case in CASES:
        covered |= primitives_of(case.fn, case.inputs())
        grad = jax.grad(lambda *a, c=case: weighted_sum(c.fn(*a)))
        covered |= primitives_of(grad, case.inputs()) if case.grad else set()
    assert not registered - covered, (
        f"Collective rules without a table entry: {registered - covered}"
    )


def test_ragged_all_to_all_holds_one_scale_across_devices():
    """The received slices and the kept output rows share the largest scale over the axis."""
    case = next(c for c in CASES if c.name == "ragged_all_to_all")
    x, out = make_scaled(case.inputs()[0], np.float16, 2.0**-50), case.inputs()[1]
    out_scaled = make_scaled(out / 2.0**20, np.float16, 2.0**-30)  # larger scale than x's

    def fn(x, out, *layout):
        per_shard = lambda x, out, *layout: _ragged(x, out, *layout)  # noqa: E731
        specs = (P("i"),) * (2 + len(layout))
        return jax.shard_map(per_shard, mesh=MESH, in_specs=specs, out_specs=P("i"))(
            x, out, *layout
        )

    result = jax.jit(jsa.autoscale(fn))(x, out_scaled, *RAGGED_LAYOUT)
    assert float(result.scale) == 2.0**-30
    expected = fn(
        *[jnp.asarray(represented(a), jnp.float32) for a in (x, out_scaled)], *RAGGED_LAYOUT
    )
    assert_close(result, expected, RTOL[np.dtype(np.float16)])


def test_shard_map_keeps_plain_outputs_and_mixes_collectives():
    def per_shard(x, y):
        total = jax.lax.psum(x, "i")
        gathered = jax.lax.all_gather(y, "i", tiled=True)
        count = jax.lax.psum(jnp.ones((), jnp.int32), "i")
        return total * 2, gathered[: x.shape[0]] + jax.lax.pmax(x, "i"), count

    def fn(x, y):
        specs = (P("i"), P("i"))
        return jax.shard_map(per_shard, mesh=MESH, in_specs=specs, out_specs=(P(), P("i"), P()))(
            x, y
        )

    x = make_scaled(RNG.uniform(-1, 1, (8, 3)), np.float16, 2.0**30)
    y = make_scaled(RNG.uniform(-1, 1, (8, 3)), np.float16, 2.0**-30)
    total, mixed, count = jax.jit(jsa.autoscale(fn))(x, y)
    ref_total, ref_mixed, ref_count = fn(
        *[jnp.asarray(represented(a), jnp.float32) for a in (x, y)]
    )
    assert_close(total, ref_total, 4e-3)
    assert_close(mixed, ref_mixed, 4e-3)
    assert not isinstance(count, jsa.ScaledArray) and int(count) == N_DEVICES == int(ref_count)


VMAP_COLLECTIVES = {
    "psum": lambda x: jax.lax.psum(x, "i"),
    "pmax": lambda x: jax.lax.pmax(x, "i"),
    "pmin": lambda x: jax.lax.pmin(x, "i"),
    "all_gather": lambda x: jax.lax.all_gather(x, "i"),
    "all_to_all": lambda x: jax.lax.all_to_all(x, "i", 0, 0, tiled=True),
    "psum_scatter": lambda x: jax.lax.psum_scatter(x, "i", tiled=True),
    "ppermute": lambda x: jax.lax.ppermute(x, "i", [(0, 1), (1, 2), (2, 3), (3, 0)]),
}


@pytest.mark.parametrize("name", sorted(VMAP_COLLECTIVES))
def test_collectives_over_a_named_vmap_axis_with_a_scale_per_element(name):
    """`vmap(..., axis_name=)` batches the scale too: each element has its own (scales
    around 2^-40 and 2^40: one compiled program for both)."""
    fn = VMAP_COLLECTIVES[name]
    in_axes = (jsa.ScaledArray(0, 0),)  # type: ignore[arg-type]
    scaled = jax.jit(jax.vmap(jsa.autoscale(fn), in_axes=in_axes, axis_name="i"))
    plain = jax.jit(jax.vmap(fn, axis_name="i"))
    for offset in (2.0**-40, 2.0**40):
        data = RNG.uniform(-1, 1, (4, 8)).astype(np.float16)
        scales = (offset * 2.0 ** np.array([-3, 0, 5, 9])).astype(np.float32)
        x = jsa.ScaledArray(jnp.asarray(data), jnp.asarray(scales))
        out = scaled(x)
        expected = plain(data.astype(np.float32) * scales[:, None])
        # One scale per element of the mapped axis: a (4, 1, ...) block scale.
        assert isinstance(out, jsa.ScaledArray)
        assert out.scale.shape == (4,) + (1,) * (out.ndim - 1)
        value = np.asarray(out.to_array(np.float32), np.float64)
        assert_close(value, expected, RTOL[np.dtype(np.float16)])


@pytest.mark.parametrize("groups", [None, [[0, 1], [2, 3]]], ids=["all", "pairs"])
@pytest.mark.parametrize("kind", ["psum", "psum_scatter"])
def test_sums_of_data_at_the_top_of_float16_do_not_overflow(kind, groups):
    """The sum's common scale leaves ceil(log2 n) binades free: float16 data near 65504 on
    every device sums to a finite value, as float32 on the represented values does."""
    x = jsa.scaled_array(jnp.full((8,), 60000.0, jnp.float16), np.float32(2.0**-10))
    n = N_DEVICES if groups is None else 2

    def body(v):
        if kind == "psum":
            return jax.lax.psum(v, "i", axis_index_groups=groups)
        return jax.lax.psum_scatter(v, "i", tiled=True, axis_index_groups=groups)

    out_spec = P() if kind == "psum" and groups is None else P("i")
    fn = jax.shard_map(
        body,
        mesh=MESH,
        in_specs=P("i") if kind == "psum" else P(),
        out_specs=out_spec,
        check_vma=False,
    )
    out = jax.jit(jsa.autoscale(fn))(x)
    values = np.asarray(out.to_array(jnp.float32))
    assert np.all(np.isfinite(values))
    np.testing.assert_allclose(values, n * 60000.0 * 2.0**-10, rtol=1e-3)
    assert float(out.scale) == 2.0**-10 * 2 ** int(np.ceil(np.log2(n)))


@pytest.mark.parametrize(
    "check_vma",
    # Without varying-axes checks in the slow step (the scaled collectives without them:
    # test_collective_matches_plain_over_wide_scales[psum_unchecked-...]).
    [True, pytest.param(False, marks=pytest.mark.slow)],
)
@pytest.mark.one_case
def test_layer_norm_of_per_device_values_in_shard_map_has_finite_gradients(check_vma):
    """Inside `shard_map` the constants used with per-device values (layer norm's epsilon)
    are made to vary first: they stay known constants (a scale of their own), and promoted
    data varies like the plain program's operand. With the epsilon promoted at scale 1,
    the float16 derivative `rsqrt(v) / v` overflowed (NaN gradients of an embedding)."""
    table = RNG.standard_normal((65, 32)).astype(np.float32) * 0.02
    tokens = jnp.asarray(RNG.integers(0, 65, (N_DEVICES * 2, 16)), jnp.int32)

    def loss(w, t):
        x = w[t]
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.var(x, axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5)
        return jax.lax.pmean(jnp.sum(y * jnp.arange(32.0)[None, None]), "i")

    grad = jax.shard_map(
        jax.grad(loss), mesh=MESH, in_specs=(P(), P("i")), out_specs=P(), check_vma=check_vma
    )
    expected = jax.jit(grad)(table, tokens)
    got = jax.jit(jsa.autoscale(grad))(jsa.as_scaled_array(table, dtype=jnp.float16), tokens)
    values = np.asarray(got.to_array(jnp.float32))
    assert np.all(np.isfinite(values))
    np.testing.assert_allclose(values, expected, atol=2e-2 * np.abs(expected).max())
