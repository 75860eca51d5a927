import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests import helpers
from tests.helpers import FLOAT_DTYPES, RTOL, WIDE_SCALES, assert_close, make_scaled, represented


def mlp(params, x):
    for w, b in params:
        x = jax.nn.relu(x @ w + b[None, :])
    return jnp.sum(x * x)


def mlp_inputs(dtype, scale):
    """Unit-scaled parameters (as after initialisation) and an input of any scale."""
    rng = np.random.default_rng(0)
    params = [
        (rng.normal(size=(8, 16)), rng.normal(size=(16,)) / 10),
        (rng.normal(size=(16, 4)), np.zeros(4)),
    ]
    x = rng.normal(size=(5, 8))
    sparams = [
        (make_scaled(w, dtype, 1 / np.sqrt(w.shape[0])), make_scaled(b, dtype, scale))
        for w, b in params
    ]
    sx = make_scaled(x, dtype, scale)
    return sparams, sx


def plain(tree):
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(represented(a), jnp.float32), tree, is_leaf=jsa.is_scaled_leaf
    )


def _pairwise_ids(cases):
    return [f"{use_jit}-{scale}-{dtype}" for dtype, scale, use_jit in cases]


MLP_CASES = [
    (dtype, scale, use_jit)
    for dtype in FLOAT_DTYPES
    for scale in [2.0**-8, 1.0, 2.0**8]
    for use_jit in [False, True]
]
# Built once: a compile per dtype, whichever scale (a value of the inputs).
MLP_JIT = jax.jit(jsa.autoscale(mlp)), jax.jit(jsa.autoscale(jax.grad(mlp)))
MLP_REFERENCE = jax.jit(lambda p, x: (mlp(p, x), jax.grad(mlp)(p, x)))


def _mlp_in_default_run(dtype, scale, use_jit):
    """Jitted, every (dtype, scale): a compile per dtype. Eagerly (each operation a compile
    per dtype), float32 at 2^-8 and 2^8; the slow step runs float16 and bfloat16 eagerly (the
    eager forward rules in those dtypes: test_wide_scales_mlp_forward)."""
    return use_jit or (np.dtype(dtype) == np.float32 and scale != 1.0)


@pytest.mark.parametrize(
    "dtype, scale, use_jit",
    [
        pytest.param(*c, marks=() if _mlp_in_default_run(*c) else pytest.mark.slow)
        for c in MLP_CASES
    ],
    ids=_pairwise_ids(MLP_CASES),
)
def test_mlp_forward_and_backward(dtype, scale, use_jit):
    sparams, sx = mlp_inputs(dtype, scale)
    fwd, grad = MLP_JIT if use_jit else (jsa.autoscale(mlp), jsa.autoscale(jax.grad(mlp)))
    out = fwd(sparams, sx)
    assert isinstance(out, jsa.ScaledArray) and out.dtype == dtype
    ref, expected = MLP_REFERENCE(plain(sparams), plain(sx))
    assert_close(out, ref, 4 * RTOL[np.dtype(dtype)])
    grads = grad(sparams, sx)
    for g, e in zip(
        jax.tree_util.tree_leaves(grads, is_leaf=jsa.is_scaled_leaf),
        jax.tree_util.tree_leaves(expected),
    ):
        assert isinstance(g, jsa.ScaledArray) and g.dtype == dtype
        assert_close(g, e, 8 * RTOL[np.dtype(dtype)])


def f_for_composition(x, y):
    return jnp.tanh(x * y + 1.0).sum(axis=-1) * 0.5


def _composition_inputs():
    x = make_scaled(np.linspace(-1, 1, 12).reshape(3, 4), np.float16, 2.0**-10)
    y = make_scaled(np.linspace(0.5, 2, 12).reshape(3, 4), np.float16, 2.0**10)
    return x, y


# vmap over the data of ScaledArrays, not over their scalar scales.
SCALED_AXES = jsa.ScaledArray(data=0, scale=None)


def _expected_composition():
    x, y = _composition_inputs()
    return np.asarray(f_for_composition(*plain((x, y))))


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.jit(jsa.autoscale(f)),
        lambda f: jsa.autoscale(jax.jit(f)),
        lambda f: jsa.autoscale(jsa.autoscale(f)),
        lambda f: jax.vmap(jsa.autoscale(f), in_axes=(SCALED_AXES,) * 2, out_axes=SCALED_AXES),
        lambda f: jsa.autoscale(jax.vmap(f)),
        lambda f: jax.jit(
            jax.vmap(jsa.autoscale(jax.jit(f)), in_axes=(SCALED_AXES,) * 2, out_axes=SCALED_AXES)
        ),
    ],
    ids=[
        "jit(autoscale)",
        "autoscale(jit)",
        "autoscale(autoscale)",
        "vmap(autoscale)",
        "autoscale(vmap)",
        "jit(vmap(autoscale(jit)))",
    ],
)
def test_composition_forward(transform):
    x, y = _composition_inputs()
    out = transform(f_for_composition)(x, y)
    assert isinstance(out, jsa.ScaledArray)
    assert out.shape == (3,)
    assert_close(out, _expected_composition(), 4e-3)


def test_vmap_with_scaled_array_axes_prefix():
    x, y = _composition_inputs()
    axes = jsa.ScaledArray(data=0, scale=None)
    out = jax.vmap(jsa.autoscale(f_for_composition), in_axes=(axes, axes), out_axes=axes)(x, y)
    assert np.shape(out.scale) == ()
    assert_close(out, _expected_composition(), 4e-3)


def test_grad_of_autoscale_on_data_and_autoscale_of_grad():
    x, y = _composition_inputs()
    px, py = plain((x, y))
    expected = jax.grad(lambda a: f_for_composition(a, py).sum())(px)

    def loss(data):
        return jsa.autoscale(f_for_composition)(jsa.ScaledArray(data, x.scale), y).sum()

    grad_data = jax.grad(lambda d: loss(d).to_array(jnp.float32))(x.data)
    # d loss / d data = d loss / d value * scale.
    assert_close(np.asarray(grad_data, np.float64) / float(x.scale), expected, 1e-2)

    grad_scaled = jsa.autoscale(jax.grad(lambda a, b: f_for_composition(a, b).sum()))(x, y)
    assert isinstance(grad_scaled, jsa.ScaledArray)
    assert_close(grad_scaled, expected, 1e-2)
    grad_jit = jax.jit(jsa.autoscale(jax.grad(lambda a, b: f_for_composition(a, b).sum())))(x, y)
    assert_close(grad_jit, expected, 1e-2)


def test_grad_with_respect_to_whole_scaled_array():
    x = make_scaled(np.array([1.0, 2.0, 3.0]), np.float32, 4.0)
    grads = jax.grad(lambda a: jsa.autoscale(lambda v: (v * v).sum())(a).to_array())(x)
    value = represented(x)
    # d/d data = 2 v * scale; d/d scale = sum(2 v * data).
    np.testing.assert_allclose(grads.data, 2 * value * 4.0, rtol=1e-6)
    np.testing.assert_allclose(
        grads.scale, np.sum(2 * value * np.array([1.0, 2.0, 3.0])), rtol=1e-6
    )


@jax.custom_jvp
def twisted_sin(x):
    return jnp.sin(x)


@twisted_sin.defjvp
def _twisted_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # Deliberately not the true derivative (cos x): 3 * t.
    return twisted_sin(x), 3.0 * t


@jax.custom_vjp
def twisted_square(x):
    return x * x


def _twisted_square_fwd(x):
    return x * x, x


def _twisted_square_bwd(x, ct):
    # Deliberately not the true derivative (2 x): -x.
    return (-x * ct,)


twisted_square.defvjp(_twisted_square_fwd, _twisted_square_bwd)


# Gradients with respect to the data are d loss / d value * scale, in the data's dtype: keep
# them representable (float16 holds neither 2^-40 nor 2^40).
DATA_GRAD_CASES = [
    (dtype, scale)
    for dtype in FLOAT_DTYPES
    for scale in ([2.0**-20, 1.0, 2.0**20] if dtype == np.float32 else [2.0**-6, 1.0, 2.0**6])
]


# The default run: every (dtype, scale), (dtype, jit) and (scale, jit) pair; the slow step
# runs the whole product.
DATA_GRAD_PARAMS = helpers.pairwise_params(
    [(dtype, scale, use_jit) for dtype, scale in DATA_GRAD_CASES for use_jit in (False, True)]
)
DATA_GRAD_IDS = _pairwise_ids(
    [(dtype, scale, use_jit) for dtype, scale in DATA_GRAD_CASES for use_jit in (False, True)]
)


@pytest.mark.parametrize("dtype, scale, use_jit", DATA_GRAD_PARAMS, ids=DATA_GRAD_IDS)
def test_grad_of_autoscale_uses_custom_jvp_rule(dtype, scale, use_jit):
    x = make_scaled(np.array([0.25, 0.5, 1.0]), dtype, scale)

    def loss(data):
        sx = jsa.ScaledArray(data, x.scale)
        return jsa.autoscale(lambda v: twisted_sin(v).sum())(sx).to_array(jnp.float32)

    grad_fn = jax.jit(jax.grad(loss)) if use_jit else jax.grad(loss)
    grads = grad_fn(x.data)
    # Custom rule: d loss / d value = 3 (not cos), so d loss / d data = 3 * scale.
    assert_close(np.asarray(grads, np.float64), np.full(3, 3.0 * scale), 2 * RTOL[np.dtype(dtype)])

    # autoscale(grad(f)) uses it too (the jaxpr is already linearised with the custom rule).
    g = jsa.autoscale(jax.grad(lambda v: twisted_sin(v).sum()))(x)
    assert_close(g, np.full(3, 3.0), RTOL[np.dtype(dtype)])


@pytest.mark.parametrize("dtype, scale, use_jit", DATA_GRAD_PARAMS, ids=DATA_GRAD_IDS)
def test_grad_of_autoscale_uses_custom_vjp_rule(dtype, scale, use_jit):
    x = make_scaled(np.array([0.25, 0.5, 1.0]), dtype, scale)
    value = represented(x)

    def loss(data):
        sx = jsa.ScaledArray(data, x.scale)
        return jsa.autoscale(lambda v: twisted_square(v).sum())(sx).to_array(jnp.float32)

    grad_fn = jax.jit(jax.grad(loss)) if use_jit else jax.grad(loss)
    grads = grad_fn(x.data)
    # Custom cotangent -value (not 2 value), times d value / d data = scale.
    assert_close(np.asarray(grads, np.float64), -value * scale, 2 * RTOL[np.dtype(dtype)])
    # The forward value is the true one.
    out = jsa.autoscale(twisted_square)(x)
    assert isinstance(out, jsa.ScaledArray)
    assert_close(out, value * value, 2 * RTOL[np.dtype(dtype)])
    # autoscale(grad(f)) too.
    g = jsa.autoscale(jax.grad(lambda v: twisted_square(v).sum()))(x)
    assert_close(g, -value, 2 * RTOL[np.dtype(dtype)])


def test_relu_custom_jvp_kept_in_jaxpr():
    x = make_scaled(np.array([-1.0, 2.0]), np.float16, 2.0**-10)
    jaxpr = jax.make_jaxpr(jsa.autoscale(jax.nn.relu))(x)
    assert "custom_jvp_call" in str(jaxpr)
    out = jsa.autoscale(jax.nn.relu)(x)
    assert float(out.scale) == 2.0**-10  # relu keeps the input scale
    grads = jax.grad(
        lambda d: (
            jsa.autoscale(jax.nn.relu)(jsa.ScaledArray(d, x.scale)).to_array(jnp.float32).sum()
        )
    )(x.data)
    np.testing.assert_array_equal(np.asarray(grads, np.float64), [0.0, 2.0**-10])


def test_jit_inside_autoscale_is_kept_with_donation_and_name():
    def inner(a):
        return a * 2.0

    jitted = jax.jit(inner, donate_argnums=0)
    x = make_scaled(np.ones(3), np.float32, 4.0)
    jaxpr = jax.make_jaxpr(jsa.autoscale(lambda a: jitted(a) + 1.0))(x)
    jit_eqns = [
        e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit") and e.params["name"] == "inner"
    ]
    assert len(jit_eqns) == 1
    params = jit_eqns[0].params
    assert params["name"] == "inner"
    # data donated, scale not.
    assert params["donated_invars"] == (True, False)
    assert len(params["in_shardings"]) == 2 and len(params["out_shardings"]) == 2


def test_pytrees_keywords_and_static_arguments():
    def fn(tree, *, factor, mode):
        a, b = tree["a"], tree["b"]
        out = a * factor + b if mode == "add" else a * factor - b
        return {"out": out, "count": tree["count"] + 1, "mode_len": len(mode)}

    tree = {
        "a": make_scaled(np.array([1.0, 2.0]), np.float16, 2.0**-20),
        "b": jnp.array([0.5, 0.5], jnp.float16) * 0,
        "count": jnp.int32(3),
    }
    scaled = jsa.autoscale(fn, static_argnames="mode")
    out = scaled(tree, factor=2.0, mode="add")
    assert isinstance(out["out"], jsa.ScaledArray)
    assert_close(out["out"], np.array([2.0, 4.0]) * 2.0**-20, 2e-3)
    assert int(out["count"]) == 4 and out["mode_len"] == 3
    out_sub = jax.jit(scaled, static_argnames="mode")(tree, factor=2.0, mode="sub")
    assert_close(out_sub["out"], np.array([2.0, 4.0]) * 2.0**-20, 2e-3)

    scaled_pos = jsa.autoscale(lambda x, n: x * n, static_argnums=1)
    assert_close(scaled_pos(tree["a"], 3), np.array([3.0, 6.0]) * 2.0**-20, 2e-3)


def test_unhashable_static_argument_raises():
    scaled = jsa.autoscale(lambda x, opts: x, static_argnums=1)
    with pytest.raises(TypeError, match="static argument at position 1 must be hashable"):
        scaled(jnp.ones(2), {"a": 1})
    scaled_kw = jsa.autoscale(lambda x, opts=None: x, static_argnames="opts")
    with pytest.raises(TypeError, match="static argument 'opts' must be hashable"):
        scaled_kw(jnp.ones(2), opts=[1])


def test_unsupported_primitive_raises_naming_it():
    from jax.extend.core import Primitive

    prim = Primitive("no_rule_example")
    prim.def_abstract_eval(lambda x: x)
    prim.def_impl(lambda x: x)
    x = make_scaled(np.array([1.0, 2.0]), np.float32, 1.0)
    with pytest.raises(
        NotImplementedError,
        match=r"No scaled rule for JAX primitive 'no_rule_example'.*register_scaled_op",
    ):
        jsa.autoscale(prim.bind)(x)
    # Without scaled inputs the primitive is bound as it is.
    np.testing.assert_array_equal(jsa.autoscale(prim.bind)(np.ones(2, np.float32)), [1.0, 1.0])


def test_unscaled_inputs_stay_unscaled():
    out = jsa.autoscale(lambda a, b: (a * 2.0, b + 1))(jnp.ones(2), jnp.int32(1))
    assert not isinstance(out[0], jsa.ScaledArray)
    np.testing.assert_array_equal(out[0], [2.0, 2.0])
    assert int(out[1]) == 2


def test_python_scalars_and_numpy_constants():
    x = make_scaled(np.array([1.0, 2.0]), np.float16, 2.0**-24)
    out = jsa.autoscale(lambda a, c, n: a * c + n)(x, 0.5, np.float16(0.0))
    assert isinstance(out, jsa.ScaledArray)
    assert_close(out, np.array([0.5, 1.0]) * 2.0**-24, 2e-3)


def test_known_constants_get_sensible_scales():
    x = make_scaled(np.array([1.0, 1.5]), np.float16, 2.0**-30)
    # 0.5 * x: the constant gets scale 0.5 and data 1, so the product keeps unit data.
    half = jsa.autoscale(lambda a: 0.5 * a)(x)
    assert float(half.scale) == 2.0**-31
    np.testing.assert_array_equal(np.asarray(half.data, np.float32), [1.0, 1.5])
    # x + zeros_like(x): the zero has scale 0, so the sum keeps x's scale.
    plus_zero = jsa.autoscale(lambda a: a + jnp.zeros_like(a))(x)
    assert float(plus_zero.scale) == 2.0**-30
    # x + 1.0: the constant's scale is 1, sqrt(1 + tiny) rounds to 1.
    plus_one = jsa.autoscale(lambda a: a + 1.0)(x)
    assert float(plus_one.scale) == 1.0
    # relu: max against a static zero keeps the input scale.
    assert float(jsa.autoscale(lambda a: jnp.maximum(a, 0.0))(x).scale) == 2.0**-30


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_constants_computed_inside_a_jit_stay_known(use_jit):
    """A constant a jitted helper returns (as `jnp.var` returns its normalizer `N - ddof`
    and NaN fill) is known outside it: dividing by it moves the power of two to the scale,
    as dividing by the literal does, rather than shrinking the data."""

    @jax.jit
    def normalizer(ddof):
        return jnp.float32(128.0) - ddof, jnp.full((2,), jnp.nan, jnp.float16)

    def fn(a):
        n, fill = normalizer(0)
        return jnp.where(jnp.isnan(fill), a / n, fill)

    x = make_scaled(np.array([1.0, 1.5]), np.float16, 2.0**-30)
    out = (jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn))(x)
    assert float(out.scale) == 2.0**-37
    np.testing.assert_array_equal(np.asarray(out.data, np.float32), [1.0, 1.5])


def test_scaled_input_validation():
    bad_scale = jsa.ScaledArray(jnp.ones(4), jnp.ones(3))
    with pytest.raises(ValueError, match=r"scale of shape \(3,\) is not a block scale of data"):
        jsa.autoscale(lambda a: a)(bad_scale)
    bad_data = jsa.ScaledArray(jnp.ones(3, jnp.int32), jnp.float32(1))
    with pytest.raises(TypeError, match="data must be floating point"):
        jsa.autoscale(lambda a: a)(bad_data)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", [s for s in WIDE_SCALES if s <= 2.0**40])
def test_wide_scales_mlp_forward(dtype, scale):
    # The output is a sum of squares: scale**2 must stay in the float32 range.
    sparams, sx = mlp_inputs(dtype, scale)
    out = jsa.autoscale(mlp)(sparams, sx)
    expected = mlp(plain(sparams), jnp.asarray(represented(sx), jnp.float32))
    assert_close(out, expected, 4 * RTOL[np.dtype(dtype)])


def test_check_mode_reports_wrong_rule_output():
    from jax.extend.core import Primitive

    prim = Primitive("bad_rule_example")
    prim.def_abstract_eval(lambda x: x)
    prim.def_impl(lambda x: x)

    @jsa.register_scaled_op(prim)
    def bad_rule(x):
        return jsa.ScaledArray(x.data.astype(jnp.float16), x.scale)

    try:
        with jsa.AutoScaleConfig(check=True):
            with pytest.raises(
                TypeError, match="Scaled rule of 'bad_rule_example' returned float16"
            ):
                jsa.autoscale(prim.bind)(make_scaled(np.ones(2), np.float32, 1.0))
    finally:
        from jax_scaled_arithmetics.core.registry import unregister_scaled_op

        unregister_scaled_op(prim)


def test_rounding_modes():
    x = make_scaled(np.ones(2), np.float32, 1.0)
    y = make_scaled(np.ones(2), np.float32, 1.0)
    with jsa.AutoScaleConfig(rounding_mode=jsa.Pow2RoundMode.DOWN):
        assert float(jsa.autoscale(lambda a, b: a + b)(x, y).scale) == 1.0
    with jsa.AutoScaleConfig(rounding_mode=jsa.Pow2RoundMode.UP):
        assert float(jsa.autoscale(lambda a, b: a + b)(x, y).scale) == 2.0
    with jsa.AutoScaleConfig(rounding_mode=jsa.Pow2RoundMode.NONE):
        out = jsa.autoscale(lambda a, b: a + b)(x, y)
        np.testing.assert_allclose(float(out.scale), np.sqrt(2), rtol=1e-6)
        np.testing.assert_allclose(out.to_array(), [2.0, 2.0], rtol=1e-6)


def test_no_recompilation_on_second_call():
    traces = []

    @jax.jit
    @jsa.autoscale
    def fn(a):
        traces.append(1)
        return a * 2.0

    x = make_scaled(np.ones(2), np.float16, 2.0)
    fn(x)
    fn(jsa.ScaledArray(x.data, np.float32(8.0)))
    assert len(traces) == 1


def test_autoscale_preserves_function_metadata():
    def my_function(a):
        """Doc."""
        return a

    wrapped = jsa.autoscale(my_function)
    assert wrapped.__name__ == "my_function" and wrapped.__doc__ == "Doc."
    assert jsa.scalify is jsa.autoscale


def test_import_prints_no_warning():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import jax_scaled_arithmetics as jsa"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""


del functools


def test_results_are_never_stale_what_the_function_closes_over_is_read_at_each_call():
    """As `jax.grad` and `jax.vmap` do, autoscale reads a closed-over number, a dict of
    weights a training loop updates, or a global, when it is called."""
    factor = 2.0
    times = jsa.autoscale(lambda a: a * factor)
    weights = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0]])}
    predict = jsa.autoscale(lambda a: a @ weights["w"])
    x = make_scaled(np.ones(2), np.float16, 2.0)
    np.testing.assert_array_equal(times(x).to_array(), [4.0, 4.0])
    np.testing.assert_array_equal(predict(x).to_array(), [2.0, 2.0])
    factor = 3.0
    weights["w"] = weights["w"] * 5.0
    np.testing.assert_array_equal(times(x).to_array(), [6.0, 6.0])
    np.testing.assert_array_equal(predict(x).to_array(), [10.0, 10.0])
    # Plain `jax.grad` sees the same: autoscale gives what it gives.
    grad = jax.grad(lambda v: jnp.sum(v @ weights["w"]))(x.to_array(jnp.float32))
    autoscaled_grad = jsa.autoscale(jax.grad(lambda v: jnp.sum(v @ weights["w"])))(x)
    np.testing.assert_array_equal(jsa.asarray(autoscaled_grad), grad)


def test_static_arguments_and_shapes_trace_again_and_jit_caches_as_for_plain_functions():
    traces = []

    def fn(a, n):
        traces.append(1)
        return a * n

    scaled = jsa.autoscale(fn, static_argnums=1)
    x = make_scaled(np.ones(2), np.float16, 2.0)
    np.testing.assert_array_equal(scaled(x, 3).to_array(), [6.0, 6.0])
    np.testing.assert_array_equal(scaled(x, 5).to_array(), [10.0, 10.0])
    out = scaled(make_scaled(np.ones(3), np.float16, 1.0), 2)
    np.testing.assert_array_equal(out.to_array(), [2.0] * 3)
    assert len(traces) == 3
    # Under `jax.jit` the autoscaled function is traced once per compilation, as any function.
    jitted = jax.jit(scaled, static_argnums=1)
    traces.clear()
    jitted(x, 3)
    jitted(jsa.ScaledArray(x.data * 2, np.float32(4.0)), 3)
    assert len(traces) == 1


def test_closures_over_outer_tracers_are_not_cached_across_traces():
    @jax.jit
    def outer(x, y):
        return jsa.autoscale(lambda a: a * y)(x)

    x = make_scaled(np.ones(2), np.float32, 1.0)
    np.testing.assert_array_equal(outer(x, 2.0).to_array(), [2.0, 2.0])
    np.testing.assert_array_equal(outer(x, 3.0).to_array(), [3.0, 3.0])
    scaled = jsa.autoscale(lambda a, b: a * b)
    np.testing.assert_array_equal(jax.jit(scaled)(x, 5.0).to_array(), [5.0, 5.0])
    np.testing.assert_array_equal(scaled(x, 7.0).to_array(), [7.0, 7.0])


def test_captured_scaled_array_has_a_clear_error():
    """A ScaledArray closed over by the traced function used to recurse without end."""
    captured = jsa.scaled_array(np.ones(3, np.float32), np.float32(2.0))
    x = jsa.as_scaled_array(np.ones(3, np.float32))
    for fn in (lambda v: v * captured, lambda v: captured - v, lambda v: -captured + v):
        with pytest.raises(TypeError, match="captured by a function that autoscale traces"):
            jsa.autoscale(fn)(x)
        with pytest.raises(TypeError, match="pass it as an argument"):
            jax.jit(jsa.autoscale(fn))(x)
    # As an argument, it works.
    out = jsa.autoscale(lambda v, c: v * c)(x, captured)
    np.testing.assert_array_equal(out.to_array(), np.full(3, 2.0, np.float32))


def test_non_array_leaves_stay_python_values_as_under_filter_jit():
    """Python scalars, functions and strings in the arguments are passed as they are (not
    traced): the function sees a Python float, and a new value traces again."""
    seen = []

    def f(tree):
        seen.append(type(tree["rate"]))
        return tree["act"](tree["x"]) * (1.0 - tree["rate"])

    x = jsa.as_scaled_array(jnp.array([1.0, -2.0], jnp.float16))
    g = jsa.autoscale(f)
    out = g({"x": x, "rate": 0.25, "act": jnp.tanh, "name": "layer"})
    np.testing.assert_allclose(represented(out), np.tanh([1.0, -2.0]) * 0.75, rtol=2e-3)
    assert seen == [float]
    out = g({"x": x, "rate": 0.5, "act": jnp.tanh, "name": "layer"})  # a new value: retraced
    np.testing.assert_allclose(represented(out), np.tanh([1.0, -2.0]) * 0.5, rtol=2e-3)
    assert seen == [float, float]


def test_equinox_filter_value_and_grad_has_the_same_structure_under_autoscale():
    """`eqx.filter_value_and_grad` differentiates the inexact arrays only: a Dropout rate (a
    Python float) must not become a traced, differentiated leaf under autoscale."""
    import equinox as eqx

    key = jax.random.PRNGKey(0)
    model = eqx.nn.Sequential([eqx.nn.Linear(4, 4, key=key), eqx.nn.Dropout(0.1)])
    x = jnp.ones((4,))

    def loss(model, x):
        return jnp.sum(model(x, key=key) ** 2)

    step = lambda m, x: eqx.filter_value_and_grad(loss)(m, x)  # noqa: E731
    _, plain_grads = eqx.filter_jit(step)(model, x)
    scaled = jsa.as_scaled_array(model, dtype=jnp.float16)
    _, grads = eqx.filter_jit(jsa.autoscale(step))(scaled, x)
    is_leaf = lambda v: isinstance(v, jsa.ScaledArray)  # noqa: E731
    assert jax.tree.structure(grads, is_leaf=is_leaf) == jax.tree.structure(plain_grads)
    assert grads.layers[1].p is None
    np.testing.assert_allclose(
        represented(grads.layers[0].weight), plain_grads.layers[0].weight, rtol=2e-2, atol=1e-2
    )


def test_non_array_outputs_are_returned_as_they_are():
    """An Equinox step returns the model, functions and Python floats included."""
    x = jsa.as_scaled_array(jnp.array([1.0, 2.0], jnp.float16))
    out = jsa.autoscale(lambda t: {"f": t["f"], "rate": t["rate"], "y": t["x"] * 2})(
        {"f": jnp.tanh, "rate": 0.1, "x": x}
    )
    assert out["f"] is jnp.tanh and out["rate"] == 0.1
    np.testing.assert_array_equal(represented(out["y"]), [2.0, 4.0])


def _count(jaxpr, name):
    return sum(e.primitive.name == name for e in jaxpr.jaxpr.eqns)


# Losses whose weight gradient autodiff writes as `transpose(dot_general(g, x))`: a matmul,
# an einsum contracting two axes, a batched product (batch axes kept first).
WEIGHT_GRADIENTS = {
    "matmul": (lambda w, x: jnp.sum(jnp.tanh(x @ w)), (8, 4), (3, 8)),
    "einsum": (lambda w, x: jnp.sum(jnp.tanh(jnp.einsum("btd,de->bte", x, w))), (8, 4), (2, 3, 8)),
    "batched": (
        lambda w, x: jnp.sum(jnp.tanh(jnp.einsum("bij,bjk->bik", x, w))),
        (2, 8, 4),
        (2, 3, 8),
    ),
}


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(WEIGHT_GRADIENTS))
def test_weight_gradient_is_one_product_in_the_weights_layout(case, dtype, use_jit):
    """A product only a transpose reads is computed with its operands swapped: plain XLA
    folds the transpose into the product, but a scaled product's data is the product times a
    ratio, and XLA:CPU wrote it transposed in a pass of its own (the 784-1024x4-10 MLP's
    SGD step ran at 1.5x plain, 1.0x since)."""
    loss, w_shape, x_shape = WEIGHT_GRADIENTS[case]
    rng = np.random.default_rng(1)
    w = rng.normal(size=w_shape) / np.sqrt(w_shape[-2])
    x = rng.normal(size=x_shape)
    grad = jax.grad(loss)
    plain_jaxpr = jax.make_jaxpr(grad)(jnp.asarray(w, jnp.float32), jnp.asarray(x, jnp.float32))
    scaled_grad = jsa.autoscale(grad)
    scaled_jaxpr = jax.make_jaxpr(scaled_grad)(
        make_scaled(w, dtype, 1.0), make_scaled(x, dtype, 1.0)
    )
    assert _count(plain_jaxpr, "transpose") == 1
    assert _count(scaled_jaxpr, "transpose") == 0
    assert _count(scaled_jaxpr, "dot_general") == _count(plain_jaxpr, "dot_general") == 2
    run = jax.jit(scaled_grad) if use_jit else scaled_grad
    for scale in (2.0**-30, 1.0, 2.0**30):
        sw, sx = make_scaled(w, dtype, scale), make_scaled(x, dtype, 1 / scale)
        out = run(sw, sx)
        assert isinstance(out, jsa.ScaledArray) and out.shape == w_shape and out.dtype == dtype
        assert_close(out, jax.grad(loss)(*plain((sw, sx))), 8 * RTOL[np.dtype(dtype)])


@pytest.mark.parametrize("permutation", [(2, 0, 1), (1, 0, 2)])
def test_a_products_transposes_other_than_the_swap_and_other_readers_are_kept(permutation):
    """Only a transpose that is the swapped product, the product's one reader, is fused."""
    rng = np.random.default_rng(2)
    w, x = rng.normal(size=(8, 4)), rng.normal(size=(2, 3, 8))

    def transposed(w, x):
        return jnp.transpose(jnp.einsum("btd,de->bte", x, w), permutation)

    def read_twice(w, x):
        y = x[0] @ w
        return y.T * 2.0 + jnp.sum(y)

    sw, sx = make_scaled(w, np.float16, 2.0**-20), make_scaled(x, np.float16, 2.0**10)
    for fun, fused in ((transposed, permutation == (2, 0, 1)), (read_twice, False)):
        jaxpr = jax.make_jaxpr(jsa.autoscale(fun))(sw, sx)
        assert _count(jaxpr, "transpose") == (0 if fused else 1)
        assert_close(
            jsa.autoscale(fun)(sw, sx), fun(*plain((sw, sx))), 4 * RTOL[np.dtype(np.float16)]
        )


def test_a_sharded_weight_gradient_is_one_product_sharded_as_the_transpose():
    """Under a mesh of explicit axes every product carries its output's sharding: the fused
    product takes the transpose's (the weights' columns over the mesh here), so the program
    is the same product as without a mesh, and a `delayed_scaling` history made without a
    mesh is read under one (its sites' shapes are the fused products')."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    loss, w_shape, x_shape = WEIGHT_GRADIENTS["matmul"]
    rng = np.random.default_rng(5)
    w = make_scaled(rng.normal(size=w_shape) / 3, np.float16, 2.0**-8)
    x = make_scaled(rng.normal(size=x_shape), np.float16, 2.0**8)
    mesh = jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    grad = jax.grad(loss)
    _, history = jsa.delayed_scaling(grad).init(w, x)
    with jax.set_mesh(mesh):
        columns = NamedSharding(mesh, P(None, "i"))
        sw = jsa.scaled_array(jax.device_put(w.data, columns), w.scale)
        jaxpr = jax.make_jaxpr(jsa.autoscale(grad))(sw, x)
        out = jax.jit(jsa.autoscale(grad))(sw, x)
        delayed, _ = jax.jit(jsa.delayed_scaling(grad))(history, sw, x)
    assert _count(jaxpr, "transpose") == 0
    assert out.data.sharding.spec == P(None, "i")
    want = jax.grad(loss)(*plain((w, x)))
    assert_close(out, want, 8 * RTOL[np.dtype(np.float16)])
    assert_close(delayed, want, 8 * RTOL[np.dtype(np.float16)])


def test_block_scaled_weight_gradient_keeps_its_two_equations():
    """Block scales are laid out per operand: the product and its transpose stay apart."""
    loss, w_shape, x_shape = WEIGHT_GRADIENTS["matmul"]
    rng = np.random.default_rng(3)
    w = jsa.as_scaled_array(jnp.asarray(rng.normal(size=w_shape), jnp.float16))
    w = jsa.scaled_array(w.data, jnp.asarray([[2.0**-3, 2.0, 1.0, 2.0**5]], jnp.float32))
    x = make_scaled(rng.normal(size=x_shape), np.float16, 2.0**-10)
    out = jax.jit(jsa.autoscale(jax.grad(loss)))(w, x)
    assert_close(out, jax.grad(loss)(*plain((w, x))), 8 * RTOL[np.dtype(np.float16)])


def test_observers_see_the_fused_product():
    """`jsa.analysis.tensor_ranges` records the weight gradient's product in its layout."""
    loss, w_shape, x_shape = WEIGHT_GRADIENTS["matmul"]
    rng = np.random.default_rng(4)
    w = make_scaled(rng.normal(size=w_shape), np.float16, 1.0)
    x = make_scaled(rng.normal(size=x_shape), np.float16, 1.0)
    table = jsa.analysis.tensor_ranges(jax.grad(loss), w, x)
    products = [tuple(row.shape) for row in table.rows if row.primitive == "dot_general"]
    assert products == [(3, 4), w_shape]


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_weakly_typed_data_promotes_as_its_dtype(use_jit):
    """A ScaledArray's dtype is its data's, weak type or not (`jnp.asarray(2.0)` is weakly
    typed): traced as float32, times float16 it gives float32, as before arguments were
    traced with their sharding (git f94c6ef)."""
    x = jsa.scaled_array(jnp.asarray(2.0), np.float32(4.0))
    assert jax.typeof(x.data).weak_type
    fun = jsa.autoscale(lambda a, b: a * b)
    out = (jax.jit(fun) if use_jit else fun)(x, jnp.ones(3, jnp.float16))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(represented(out), np.full(3, 8.0))
