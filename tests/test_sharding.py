"""`jsa.sharding`: ScaledArray trees on a mesh, collectives with a low-precision wire format,
and the FSDP recipe, on the test session's 4 CPU devices."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics import sharding

N = 4
MESH = Mesh(np.array(jax.devices()[:N]), ("i",))
RNG = np.random.default_rng(0)


# --- like / device_put ---------------------------------------------------------------------


def test_like_replicates_per_tensor_scales_and_keeps_the_tree():
    params = {
        "w": jsa.as_scaled_array(jnp.ones((8, 4)), dtype=jnp.float16),
        "b": jnp.zeros(4),
        "step": 3,
        "frozen": None,
    }
    data = NamedSharding(MESH, P("i", None))
    replicated = NamedSharding(MESH, P())
    out = sharding.like(params, {"w": data, "b": replicated, "step": None, "frozen": None})
    assert isinstance(out["w"], jsa.ScaledArray)
    assert out["w"].data == data and out["w"].scale.spec == P()
    assert out["b"] == replicated and out["step"] is None and out["frozen"] is None
    # One sharding for every leaf.
    every = sharding.like(params, data)
    assert every["w"].data == data and every["step"] is None
    assert every["b"].spec == P()  # rank 1 < the spec's 2: replicated
    placed = sharding.device_put({**params, "step": jnp.int32(3)}, data)
    assert placed["step"].sharding.spec == P() and placed["w"].data.sharding.spec == P("i", None)


def test_like_shards_block_scales_with_their_blocks():
    w = jsa.as_scaled_array(jnp.ones((8, 6)), dtype=jnp.bfloat16, scale_shape=(8, 1))
    rows = sharding.like(w, NamedSharding(MESH, P("i", None)))
    assert rows.scale.spec == P("i")  # 2 rows of scales per device, with their rows
    cols = sharding.like(w, NamedSharding(MESH, P(None, "i")))
    assert cols.scale.spec == P()  # one scale column: replicated
    # 2 blocks of 4 rows do not split over 4 devices: replicated.
    coarse = jsa.as_scaled_array(jnp.ones((8, 6)), dtype=jnp.bfloat16, scale_shape=(2, 1))
    assert sharding.like(coarse, NamedSharding(MESH, P("i", None))).scale.spec == P()


def test_like_refuses_what_is_not_a_sharding():
    x = jsa.as_scaled_array(jnp.ones(4))
    with pytest.raises(TypeError, match="needs a jax.sharding.Sharding"):
        sharding.like({"x": x}, {"x": P("i")})


def test_device_put_and_jit_keep_the_layout():
    w = jsa.as_scaled_array(jnp.arange(32.0).reshape(8, 4), dtype=jnp.float16)
    shardings = sharding.like(w, NamedSharding(MESH, P("i", None)))
    placed = sharding.device_put(w, NamedSharding(MESH, P("i", None)))
    assert placed.data.sharding.spec == P("i", None) and placed.scale.sharding.spec == P()
    assert len(placed.data.addressable_shards) == N
    step = jax.jit(jsa.autoscale(lambda a: a * 2.0 + 1.0), out_shardings=shardings)
    out = step(placed)
    assert out.data.sharding.spec == P("i", None) and out.scale.sharding.spec == P()
    np.testing.assert_array_equal(out.to_array(jnp.float32), np.arange(32.0).reshape(8, 4) * 2 + 1)


def test_a_packed_tree_is_placed_like_its_scaled_arrays():
    """`like` and `device_put` on a `jsa.tree.PackedScales`: the data as the unpacked tree's
    shardings say, block scales with their blocks, the scale vector replicated; a jitted
    step on the packed tree keeps the layout and computes the unpacked step's values."""
    params = {
        "w": jsa.as_scaled_array(jnp.arange(32.0).reshape(8, 4), dtype=jnp.float16),
        "rows": jsa.as_scaled_array(jnp.ones((8, 6)), dtype=jnp.bfloat16, scale_shape=(8, 1)),
        "b": jsa.as_scaled_array(jnp.ones(4), dtype=jnp.float16),
    }
    shardings = {
        "w": NamedSharding(MESH, P("i", None)),
        "rows": NamedSharding(MESH, P("i", None)),
        "b": NamedSharding(MESH, P()),
    }
    packed = jsa.tree.pack_scales(params)
    placed = sharding.device_put(
        {"params": packed, "step": jnp.int32(0)},
        {
            "params": shardings,
            "step": NamedSharding(MESH, P()),
        },
    )["params"]
    assert isinstance(placed, jsa.tree.PackedScales)
    assert placed.scales.sharding.spec == P() and placed.scales.shape == (2,)
    tree = placed.unpack()
    assert tree["w"].data.sharding.spec == P("i", None) and tree["b"].data.sharding.spec == P()
    assert tree["rows"].scale.sharding.spec == P("i")  # a block scale: with its rows
    # One sharding for every leaf: the vector replicated all the same.
    every = sharding.like(packed, NamedSharding(MESH, P("i")))
    assert every.scales.spec == P() and every.leaves[-1].spec == P("i")
    abstract = sharding.like(jax.eval_shape(lambda: packed), shardings)  # shapes only
    assert abstract.scales.spec == P() and abstract.unpack()["w"].data.spec == P("i", None)

    def step(p):
        p = jsa.autoscale(lambda q: jax.tree.map(lambda x: x * 2.0, q))(p)
        return jsa.tree.pack_scales(p)

    out = jax.jit(step, out_shardings=sharding.like(packed, shardings))(placed)
    assert out.scales.sharding.spec == P()
    assert out.unpack()["w"].data.sharding.spec == P("i", None)
    for name, value in jsa.asarray(out, jnp.float32).items():
        np.testing.assert_array_equal(value, 2.0 * jsa.asarray(params[name], jnp.float32))


def _result_types(stablehlo: str, name: str) -> list[str]:
    """The result type of every `stablehlo.<name>` of a lowered program."""
    types = []
    for match in re.finditer(rf'"stablehlo\.{name}"', stablehlo):
        result = re.search(r"-> (tensor<[^>]*>)", stablehlo[match.end() :])
        assert result is not None
        types.append(result.group(1))
    return types


# --- collectives with a wire dtype ------------------------------------------------------------


def _exponent_bound(values: np.ndarray) -> int:
    """The e of `_shared_scale`: every finite |value| < 2^e (frexp's exponent)."""
    finite = np.abs(values[np.isfinite(values)]).astype(np.float64)
    return int(np.frexp(finite.max())[1])


def _quantized(values: np.ndarray, wire: np.dtype, headroom: int, storage=np.float32) -> np.ndarray:
    """value / t rounded to the wire format (finite values clamped), times t."""
    top = min(
        int(np.floor(np.log2(float(ml_dtypes.finfo(wire).max)))),
        int(np.floor(np.log2(float(ml_dtypes.finfo(storage).max)))),
        15,  # float16's: wider formats' payloads sit no higher
    )
    t = 2.0 ** (_exponent_bound(values) + headroom - top)
    bound = float(ml_dtypes.finfo(wire).max)
    payload = values.astype(np.float64) / t
    payload = np.where(np.isfinite(payload), np.clip(payload, -bound, bound), payload)
    return payload.astype(wire).astype(np.float64) * t


WIRES = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("wire", WIRES, ids=lambda d: jnp.dtype(d).name)
def test_all_gather_sends_the_values_rounded_at_one_shared_scale(wire):
    values = (RNG.standard_normal((8, 3)) * 2.0 ** RNG.integers(-6, 6, (8, 1))).astype(np.float32)
    gather = jax.jit(
        jax.shard_map(
            lambda w: sharding.all_gather(w, "i", tiled=True, dtype=wire),
            mesh=MESH,
            in_specs=P("i"),
            out_specs=P("i"),
        )
    )
    out = np.asarray(gather(values)).reshape(N, 8, 3)
    expected = _quantized(values, np.dtype(wire), 0)
    for device in range(N):  # every device holds the whole gathered tensor
        np.testing.assert_array_equal(out[device], expected.astype(np.float32))


def _collective_wire(kind):
    return jnp.float8_e4m3fn if kind == "all_gather" else jnp.bfloat16


@functools.cache
def _scaled_collective(kind):
    """`jax.jit(jsa.autoscale(shard_map(collective)))`, built once per collective: the cases
    of each data dtype share its compiled program (the scale is a value)."""
    wire = _collective_wire(kind)
    in_spec, out_spec = {
        "all_gather": (P("i"), P("i")),
        "psum_scatter": (P(), P("i")),
        "psum": (P(), P()),
    }[kind]

    def body(v):
        if kind == "all_gather":
            return sharding.all_gather(v, "i", tiled=True, dtype=wire)
        if kind == "psum_scatter":
            return sharding.psum_scatter(v, "i", tiled=True, dtype=wire)
        return sharding.psum(v, "i", dtype=wire)

    fn = jax.shard_map(body, mesh=MESH, in_specs=in_spec, out_specs=out_spec, check_vma=False)
    return jax.jit(jsa.autoscale(fn))


@pytest.mark.parametrize("data_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("log2_scale", [-40, 0, 40])
@pytest.mark.parametrize("kind", ["all_gather", "psum_scatter", "psum"])
def test_collectives_under_autoscale_move_the_data_and_match_plain(kind, log2_scale, data_dtype):
    """A ScaledArray's data travels; the represented result equals the plain function on
    the values (the same payloads), whatever the scale."""
    wire = _collective_wire(kind)
    data = RNG.standard_normal((8, 4)).astype(data_dtype)
    scale = np.float32(2.0**log2_scale)
    x = jsa.scaled_array(jnp.asarray(data), scale)
    values = np.asarray(data, np.float32).astype(np.float64) * float(scale)
    out = _scaled_collective(kind)(x)
    assert isinstance(out, jsa.ScaledArray) and out.dtype == data_dtype
    got = np.asarray(out.data, np.float32).astype(np.float64) * float(out.scale)
    # The same program on the values (float64 reference of the payloads).
    factor = 1 if kind == "all_gather" else N
    headroom = 0 if kind == "all_gather" else 2
    rounded = _quantized(values, np.dtype(wire), headroom, storage=np.dtype(data_dtype))
    if kind == "all_gather":
        expected = np.tile(rounded, (N, 1))
    elif kind == "psum_scatter":
        expected = factor * rounded
    else:
        expected = factor * rounded
    np.testing.assert_allclose(got, expected, rtol=2e-3 if data_dtype != jnp.float32 else 1e-6)


def test_reduce_scatter_of_float16_data_at_the_top_of_its_range_does_not_overflow():
    x = jsa.scaled_array(jnp.full((8,), 60000.0, jnp.float16), np.float32(2.0**20))
    for dtype in (None, jnp.float16, jnp.bfloat16):
        fn = jax.shard_map(
            lambda v, dtype=dtype: sharding.psum_scatter(v, "i", tiled=True, dtype=dtype),
            mesh=MESH,
            in_specs=P(),
            out_specs=P("i"),
        )
        out = jax.jit(jsa.autoscale(fn))(x)
        np.testing.assert_allclose(
            out.to_array(jnp.float32), np.full(8, 4 * 60000.0 * 2**20), rtol=4e-3
        )


def test_non_finite_values_and_zeros():
    values = np.array([np.inf, -1.0, 3.0, np.nan, 0.0, 0.0, 0.0, 0.0], np.float32)

    def gathered(wire):
        fn = jax.shard_map(
            lambda w: sharding.all_gather(w, "i", tiled=True, dtype=wire),
            mesh=MESH,
            in_specs=P("i"),
            out_specs=P("i"),
        )
        return np.asarray(jax.jit(fn)(values))[:8]

    bf16 = gathered(jnp.bfloat16)
    np.testing.assert_array_equal(bf16[[0, 1, 2]], [np.inf, -1.0, 3.0])
    assert np.isnan(bf16[3]) and np.all(bf16[4:] == 0)
    e4m3 = gathered(jnp.float8_e4m3fn)  # no infinity in the format: NaN
    assert np.isnan(e4m3[0]) and np.isnan(e4m3[3])
    np.testing.assert_array_equal(e4m3[[1, 2, 4]], [-1.0, 3.0, 0.0])
    zeros = jax.jit(
        jax.shard_map(
            lambda w: sharding.psum(w, "i", dtype=jnp.float8_e5m2),
            mesh=MESH,
            in_specs=P("i"),
            out_specs=P(),
        )
    )(np.zeros(8, np.float32))
    np.testing.assert_array_equal(zeros, np.zeros(2))


def test_wire_dtype_must_be_floating():
    fn = jax.shard_map(
        lambda w: sharding.all_gather(w, "i", dtype=jnp.int8),
        mesh=MESH,
        in_specs=P("i"),
        out_specs=P("i"),
    )
    with pytest.raises(TypeError, match="must be floating"):
        fn(np.ones(8, np.float32))


@pytest.mark.parametrize("grad_dtype", [None, jnp.bfloat16])
def test_gradient_of_all_gather_is_a_reduce_scatter_in_grad_dtype(grad_dtype):
    w = RNG.standard_normal(8).astype(np.float32)
    weights = RNG.standard_normal(8).astype(np.float32)

    def loss(shard):
        full = sharding.all_gather(
            shard, "i", tiled=True, dtype=jnp.float8_e4m3fn, grad_dtype=grad_dtype
        )
        return jnp.sum(jnp.sin(full) * weights)

    grad = jax.jit(jax.shard_map(jax.grad(loss), mesh=MESH, in_specs=P("i"), out_specs=P("i")))
    full = _quantized(w, np.dtype(jnp.float8_e4m3fn), 0)
    # Every device computed the same full cotangent: the reduce-scatter sums N copies.
    expected = N * np.cos(full) * weights
    rtol = 1e-6 if grad_dtype is None else 2**-8
    np.testing.assert_allclose(grad(w), expected, rtol=rtol, atol=1e-6)
    scaled = jax.jit(jsa.autoscale(grad))(jsa.as_scaled_array(w, scale=np.float32(2.0**-30)))
    np.testing.assert_allclose(scaled.to_array(), expected, rtol=max(rtol, 1e-5), atol=1e-6)
    text = grad.lower(w).as_text()
    assert _result_types(text, "all_gather") == ["tensor<8xui8>"]
    wire = "bf16" if grad_dtype is not None else "f32"
    assert _result_types(text, "reduce_scatter") == [f"tensor<2x{wire}>"]


# --- FSDP ----------------------------------------------------------------------------------

SPECS = {"w1": P("i", None), "b1": P(), "w2": P(None, "i"), "b2": P("i")}


def _mlp_params():
    rng = np.random.default_rng(1)  # the same parameters whatever ran before
    return {
        "w1": rng.standard_normal((16, 32)).astype(np.float32) * 0.3,
        "b1": rng.standard_normal(32).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((32, 8)).astype(np.float32) * 0.3,
        "b2": np.zeros(8, np.float32),
    }


def _relative_error(got, want):
    """||got - want|| / ||want||, over the whole tensor."""
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


def _inputs():
    return np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32)


def _mlp_loss(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"][None])
    return jnp.mean((h @ p["w2"] + p["b2"][None]) ** 2)


@functools.cache
def _reference_value_and_grad():
    """The one-device loss and gradient, jitted once for the tests below (operation by
    operation, each would be a compile of its own)."""
    return jax.jit(jax.value_and_grad(_mlp_loss))


@functools.cache
def _fp8_fsdp_steps():
    """(step under autoscale, the same step on float32 values): the FSDP recipe with FP8
    gathers and bfloat16 reductions, jitted once for the tests below."""
    wire = {"dtype": jnp.float8_e4m3fn, "grad_dtype": jnp.bfloat16}
    return jax.jit(jsa.autoscale(_fsdp_grad(**wire))), jax.jit(_fsdp_grad(**wire))


def _fsdp_grad(loss=None, **wire):
    """The mean loss over the mesh and its gradient, parameters gathered by the recipe."""
    loss = _mlp_loss if loss is None else loss

    def local(params, x):
        def mean_loss(p):
            full = sharding.gather_params(p, SPECS, "i", **wire)
            return jax.lax.pmean(loss(full, x), "i")

        return jax.value_and_grad(mean_loss)(params)

    return jax.shard_map(local, mesh=MESH, in_specs=(SPECS, P("i")), out_specs=(P(), SPECS))


def test_fsdp_gradients_match_one_device():
    params = _mlp_params()
    x = _inputs()
    loss, grads = jax.jit(_fsdp_grad())(params, x)
    want_loss, want = _reference_value_and_grad()(params, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for name in params:
        np.testing.assert_allclose(grads[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)


# bfloat16 data through each collective under autoscale, whatever the scale:
# test_collectives_under_autoscale_move_the_data_and_match_plain; the recipe with bfloat16
# parameters in the slow step.
@pytest.mark.parametrize("dtype", [jnp.float16, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_fsdp_under_autoscale_with_fp8_gathers_and_bf16_reductions(dtype):
    params = _mlp_params()
    x = _inputs()
    scaled = jsa.as_scaled_array(params, dtype=dtype)
    step, plain_step = _fp8_fsdp_steps()
    loss, grads = step(scaled, x)
    # The same recipe on the values, without autoscale: FP8 rounding of the same payloads.
    plain_loss, plain = plain_step(jsa.asarray(scaled, jnp.float32), x)
    _, exact = _reference_value_and_grad()(params, x)
    np.testing.assert_allclose(float(loss.to_array(jnp.float32)), float(plain_loss), rtol=2e-2)
    for name in params:
        got = np.asarray(grads[name].to_array(jnp.float32))
        assert isinstance(grads[name], jsa.ScaledArray) and grads[name].dtype == dtype
        assert np.all(np.isfinite(got))
        scale = np.abs(exact[name]).max()
        # FP8 weights (3 mantissa bits) against float32 weights: a few percent of the largest.
        # The plain recipe computes on float32 values, autoscale on the 8 or 11 bits of the
        # data: bfloat16 activations and gradients differ by a few of its ulps (2^-8).
        bound = 2e-2 if dtype == jnp.float16 else 6e-2
        np.testing.assert_allclose(got, plain[name], atol=bound * scale, err_msg=name)
        # The recipe itself against float32: FP8 weights (3 mantissa bits, 2^-4 relative)
        # through two layers, measured up to 0.12 of the largest entry (the same without
        # autoscale).
        np.testing.assert_allclose(got, exact[name], atol=0.2 * scale, err_msg=name)


def test_fsdp_moves_one_byte_per_parameter_and_bf16_gradients():
    params = _mlp_params()
    x = _inputs()
    scaled = jsa.as_scaled_array(params, dtype=jnp.float16)
    text = _fp8_fsdp_steps()[0].lower(scaled, x).as_text()
    gathers = _result_types(text, "all_gather")
    assert len(gathers) == 3 and all("ui8" in g for g in gathers), gathers  # w1, w2, b2
    scatters = _result_types(text, "reduce_scatter")
    assert len(scatters) == 3 and all("bf16" in s for s in scatters), scatters
    reduces = _result_types(text, "all_reduce")
    assert any("bf16" in r for r in reduces), reduces  # b1, replicated: an all-reduce


# A compiled program's collectives: (kind, result shape without layouts).
_HLO_COLLECTIVE = re.compile(
    r"=\s*(.*?)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)


def _collectives(jitted, *args):
    text = jitted.lower(*args).compile().as_text()
    found = [m.groups() for m in map(_HLO_COLLECTIVE.search, text.splitlines()) if m]
    return [(kind, re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", shape)) for shape, kind in found]


def _is_scalars(shape):
    """Whether a collective's result is float32 scalars only ("f32[]" or a tuple of them)."""
    return set(re.findall(r"\w+\[[^\]]*\]", shape)) == {"f32[]"}


def test_gspmd_step_measures_scales_with_scalar_all_reduces_only():
    """A `jit` with shardings (the SPMD partitioner, not `shard_map`): the scaled step's
    scale measurements (its dynamic scales, `scale_optimizer`'s state rescales, the sites of
    `delayed_scaling`) add scalar all-reduces to the plain step's collectives, never a
    sharded tensor gathered whole (which their one-device forms, the tensors' partials
    gathered into one vector, would)."""
    import optax

    params = _mlp_params()
    x = _inputs()
    shardings = {name: NamedSharding(MESH, spec) for name, spec in SPECS.items()}
    replicated = NamedSharding(MESH, P())

    def step(optimizer):
        def update(p, state, x):
            updates, state = optimizer.update(jax.grad(_mlp_loss)(p, x), state, p)
            return optax.apply_updates(p, updates), state

        return update

    def compiled_collectives(fun, optimizer, p, *leading):
        p_shardings = sharding.like(p, shardings)
        s_shardings = sharding.state_like(optimizer, p, p_shardings)
        state = jax.jit(optimizer.init, out_shardings=s_shardings)(p)
        in_shardings = (replicated,) * len(leading) + (p_shardings, s_shardings, replicated)
        return _collectives(jax.jit(fun, in_shardings=in_shardings), *leading, p, state, x)

    plain = compiled_collectives(step(optax.adam(1e-3)), optax.adam(1e-3), params)
    scaled_opt = jsa.optax.scale_optimizer(optax.adam(1e-3))
    scaled = jsa.as_scaled_array(params)
    dynamic = compiled_collectives(jsa.autoscale(step(scaled_opt)), scaled_opt, scaled)
    delayed_step = jsa.delayed_scaling(step(scaled_opt), history_length=2)
    _, history = jax.jit(delayed_step.init)(scaled, scaled_opt.init(scaled), x)
    delayed = compiled_collectives(delayed_step, scaled_opt, scaled, history)
    assert plain and not any(_is_scalars(shape) for _, shape in plain)
    for found in (dynamic, delayed):
        assert sorted(c for c in found if not _is_scalars(c[1])) == sorted(plain), found
        assert {kind for kind, shape in found if _is_scalars(shape)} == {"all-reduce"}


def test_state_like_of_plain_parameters_replicates_the_scales_of_scaled_moments():
    import optax

    optimizer = jsa.optax.scale_optimizer(optax.adam(1e-3))
    shardings = {name: NamedSharding(MESH, spec) for name, spec in SPECS.items()}
    spec = sharding.state_like(optimizer, _mlp_params(), shardings)
    for name in SPECS:
        mu = spec[0].mu[name]
        assert mu.data.spec == SPECS[name] and mu.scale.spec == P(), name


def test_gather_params_errors():
    bad = {"w1": "i", "b1": P(), "w2": P(None, "i"), "b2": P("i")}

    def run(specs):
        def local(params, x):
            return _mlp_loss(sharding.gather_params(params, specs, "i"), x)

        good = dict(SPECS)
        fn = jax.shard_map(
            local, mesh=MESH, in_specs=(good, P("i")), out_specs=P("i"), check_vma=False
        )
        # Traced only (the errors are raised while tracing): outside jit, every operation
        # before the error would compile a program.
        return jax.jit(fn).trace(_mlp_params(), np.ones((8, 16), np.float32))

    with pytest.raises(TypeError, match="expected a PartitionSpec"):
        run(bad)
    mesh2 = Mesh(np.array(jax.devices()[:N]).reshape(2, 2), ("i", "j"))

    def partial(w):
        return sharding.gather_params({"w": w}, {"w": P(("i", "j"))}, "i")["w"]

    with pytest.raises(NotImplementedError, match="only"):
        jax.jit(
            jax.shard_map(partial, mesh=mesh2, in_specs=P(("i", "j")), out_specs=P(("i", "j")))
        ).trace(np.ones(8, np.float32))


def test_reshard_and_device_put_under_autoscale_move_data_and_place_scales():
    mesh = jax.make_mesh((N,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = sharding.device_put(
        jsa.as_scaled_array(jnp.arange(16.0).reshape(4, 4), dtype=jnp.float16),
        NamedSharding(mesh, P("i", None)),
    )
    with jax.set_mesh(mesh):
        out = jax.jit(jsa.autoscale(lambda a: jax.sharding.reshard(a * 2.0, P(None, "i"))))(x)
    assert out.data.sharding.spec == P(None, "i") and out.scale.sharding.spec == P()
    np.testing.assert_array_equal(out.to_array(jnp.float32), np.arange(16.0).reshape(4, 4) * 2)
    # device_put inside a step: the data where asked, the per-tensor scale replicated.
    target = NamedSharding(MESH, P("i", None))
    text = str(jax.make_jaxpr(jsa.autoscale(lambda a: jax.device_put(a, target)))(x))
    assert "spec=P('i', None)" in text and "spec=P()" in text


def _explicit_step(opt):
    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


@pytest.mark.parametrize("variant", ["autoscale", "delayed_scaling"])
def test_a_training_step_on_a_mesh_of_explicit_axes(variant):
    """Data parallel over a mesh whose axes are explicit (JAX's sharding in types: every
    value's type holds its partition spec), as `jax.make_mesh` and `jax.set_mesh` users
    write it: the scaled step traces (a largest magnitude's scalar has a spec of its own, a
    ScaledArray argument is traced with its data's sharding) and gives float32's loss and
    gradients. (Before: `ValueError: Length of sharding.spec (2) must be equal to aval's
    ndim (0)` at the first dot, and a scaled batch met replicated values of the plain
    trace.)"""
    mesh = jax.make_mesh((N,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    opt = jsa.optax.scale_optimizer(optax.adam(1e-3))
    step = _explicit_step(opt)
    params, x = _mlp_params(), np.concatenate([_inputs()] * 2)
    want_loss, want = _reference_value_and_grad()(params, x)
    with jax.set_mesh(mesh):
        replicated = jax.device_put(params, NamedSharding(mesh, P()))
        scaled = jsa.as_scaled_array(replicated, dtype=jnp.float16)
        batch = jsa.as_scaled_array(
            jax.device_put(x, NamedSharding(mesh, P("i", None))), dtype=jnp.float16
        )
        opt_state = opt.init(scaled)
        if variant == "autoscale":
            new, _, loss, grads = jax.jit(jsa.autoscale(step))(scaled, opt_state, batch)
        else:
            delayed = jsa.delayed_scaling(step)
            _, history = jax.jit(delayed.init)(scaled, opt_state, batch)
            (new, _, loss, grads), _ = jax.jit(delayed)(history, scaled, opt_state, batch)
    assert batch.data.sharding.spec == P("i", None)
    np.testing.assert_allclose(float(loss.to_array(jnp.float32)), float(want_loss), rtol=2e-3)
    for name in params:
        got = np.asarray(grads[name].to_array(jnp.float32))
        scale = np.max(np.abs(np.asarray(want[name])))
        np.testing.assert_allclose(got, np.asarray(want[name]), rtol=2e-2, atol=2e-2 * scale)
        assert np.all(np.isfinite(np.asarray(new[name].to_array(jnp.float32))))


def _rowwise_fp8_loss(p, x):
    h = jnp.tanh(jsa.ops.rowwise_fp8_matmul(x, p["w1"]) + p["b1"][None])
    return jnp.mean((jsa.ops.rowwise_fp8_matmul(h, p["w2"]) + p["b2"][None]) ** 2)


def _simulate_fp8_loss(p, x):

    return jsa.ops.simulate_fp8(_mlp_loss, rescale=True)(p, x)


@pytest.mark.parametrize(
    "fp8_loss",
    [
        _simulate_fp8_loss,
        # The slowest program of the file (~20 s): rowwise_fp8_matmul under autoscale is in
        # the default run through tests/ops/test_fp8_matmul.py, FSDP composed with an FP8
        # recipe through [simulate_fp8], a custom_vjp (the gathers') inside the shard_map
        # under autoscale through test_fsdp_under_autoscale_with_fp8_gathers_*.
        pytest.param(_rowwise_fp8_loss, marks=pytest.mark.slow),
    ],
    ids=["simulate_fp8", "rowwise"],
)
@pytest.mark.slow
def test_fsdp_composes_with_fp8_matmul_recipes(fp8_loss):
    """`jsa.ops.simulate_fp8` / `rowwise_fp8_matmul` on the gathered parameters, inside the
    shard_map, under autoscale."""
    params = _mlp_params()
    x = _inputs()
    fn = _fsdp_grad(fp8_loss, dtype=jnp.float8_e4m3fn)
    loss, grads = jax.jit(jsa.autoscale(fn))(jsa.as_scaled_array(params, dtype=jnp.float16), x)
    want_loss, want = _reference_value_and_grad()(params, x)
    np.testing.assert_allclose(float(loss.to_array(jnp.float32)), float(want_loss), rtol=0.1)
    for name in params:
        got = np.asarray(grads[name].to_array(jnp.float32))
        assert np.all(np.isfinite(got))
        # E4M3 operands and E5M2 gradients (2 mantissa bits: up to 2^-3 an element): the
        # gradient as a whole, not each element, is close to float32's (0.02-0.12 measured
        # over 5 draws of the parameters).
        assert _relative_error(got, want[name]) < 0.2, name


def test_state_like_shards_moments_like_their_parameters():
    import optax

    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    shardings = {"w": NamedSharding(MESH, P("i", None)), "b": NamedSharding(MESH, P())}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    spec = sharding.state_like(opt, params, shardings)
    state = jax.jit(opt.init, out_shardings=spec)(params)
    adam = state[1][0]
    assert adam.mu["w"].sharding.spec == P("i", None) and adam.nu["b"].sharding.spec == P()
    assert adam.count.sharding.spec == P()
    scaled = jsa.as_scaled_array(params, dtype=jnp.bfloat16)
    scaled_opt = jsa.optax.scale_optimizer(optax.adam(1e-3))
    state = jax.jit(
        scaled_opt.init, out_shardings=sharding.state_like(scaled_opt, scaled, shardings)
    )(scaled)
    assert state[0].nu["w"].data.sharding.spec == P("i", None)
    assert state[0].nu["w"].scale.sharding.spec == P()


def test_set_scaling_to_a_shared_scale_is_the_same_on_every_device():
    """A scale the devices agree on stays invariant through `set_scaling` (its guard's
    fallback, x's own per-device scale, is taken at its largest over the axes)."""
    x = jsa.scaled_array(jnp.asarray(RNG.standard_normal(8), jnp.float16), np.float32(2.0**-3))

    def body(v):
        v = jsa.ops.dynamic_rescale_max(v)  # a scale per device
        shared = jax.lax.pmax(jnp.max(jnp.abs(v)).astype(jnp.float32), "i")
        out = jsa.lax.set_scaling(v, shared)
        # Under autoscale: the new scale, which out_specs=P() requires to be invariant.
        return out, jsa.lax.get_data_scale(out)[1]

    fn = jax.shard_map(body, mesh=MESH, in_specs=P("i"), out_specs=(P("i"), P()))
    out, scale = jax.jit(jsa.autoscale(fn))(x)
    np.testing.assert_allclose(out.to_array(jnp.float32), x.to_array(jnp.float32), rtol=2e-3)
    largest = float(np.max(np.abs(np.asarray(x.to_array(jnp.float32)))))
    np.testing.assert_allclose(float(np.asarray(scale)), largest, rtol=2e-3)
