"""jax.nn, jax.numpy, jax.scipy.special and lax control flow programs under autoscale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import pytest

from tests.integration.checks import check_forward_backward

RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 6)).astype(np.float32)
POS = RNG.uniform(0.2, 3.0, (4, 6)).astype(np.float32)
UNIT = RNG.uniform(0.05, 0.95, (4, 6)).astype(np.float32)

ACTIVATIONS = {
    "celu": jax.nn.celu,
    "elu": jax.nn.elu,
    "gelu": jax.nn.gelu,
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "glu": jax.nn.glu,
    "hard_sigmoid": jax.nn.hard_sigmoid,
    "hard_silu": jax.nn.hard_silu,
    "hard_tanh": jax.nn.hard_tanh,
    "identity": jax.nn.identity,
    "leaky_relu": jax.nn.leaky_relu,
    "log_sigmoid": jax.nn.log_sigmoid,
    "mish": jax.nn.mish,
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "selu": jax.nn.selu,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "soft_sign": jax.nn.soft_sign,
    "softplus": jax.nn.softplus,
    "sparse_plus": jax.nn.sparse_plus,
    "sparse_sigmoid": jax.nn.sparse_sigmoid,
    "squareplus": jax.nn.squareplus,
    "tanh": jax.nn.tanh,
}


@pytest.mark.slow
def test_jax_nn_activations():
    check_forward_backward(lambda x: {k: f(x) for k, f in ACTIVATIONS.items()}, X, rtol=2e-5)


@pytest.mark.slow
def test_jax_nn_normalisations_and_attention():
    labels = jnp.asarray([1, 0, 5, 3])

    def fn(p):
        x, q, k, v = p["x"], p["q"], p["k"], p["v"]
        return {
            "softmax": jax.nn.softmax(x, axis=-1),
            "log_softmax": jax.nn.log_softmax(x, axis=0),
            "logsumexp": jax.nn.logsumexp(x, axis=-1),
            "standardize": jax.nn.standardize(x, axis=-1),
            "one_hot_ce": -jnp.sum(jax.nn.one_hot(labels, 6) * jax.nn.log_softmax(x)),
            "attention": jax.nn.dot_product_attention(q, k, v),
        }

    qkv = RNG.normal(size=(3, 2, 5, 2, 4)).astype(np.float32)  # (q/k/v, B, T, N, H)
    params = {"x": X, "q": qkv[0], "k": qkv[1], "v": qkv[2]}
    check_forward_backward(fn, params, rtol=2e-5)


@pytest.mark.slow
def test_jax_nn_causal_attention():
    mask = jnp.tril(jnp.ones((5, 5), bool))[None, None]

    def fn(p):
        q, k, v = p
        return (
            jax.nn.dot_product_attention(q, k, v, is_causal=True),
            jax.nn.softmax(jnp.einsum("bqnh,bknh->bnqk", q, k), where=mask, axis=-1),
        )

    qkv = RNG.normal(size=(3, 2, 5, 2, 4)).astype(np.float32)
    check_forward_backward(fn, tuple(qkv), rtol=2e-5)


@pytest.mark.slow
def test_jax_numpy_math_indexing_and_updates():
    idx = jnp.asarray([2, 0, 3])

    def fn(p):
        x, y, w = p["x"], p["pos"], p["w"]
        return {
            "math": jnp.exp(x * 0.5) - jnp.log(y) + jnp.sqrt(y) * jnp.tanh(x) / (1 + x**2),
            "pow": jnp.power(y, 1.5) + jnp.abs(x) ** 3 + jnp.reciprocal(y),
            "minmax": jnp.maximum(x, 0.3) + jnp.clip(x, -0.5, 0.5) + jnp.where(x > 0, x, -2 * x),
            "reduce": jnp.mean(x, axis=0) + jnp.var(x, axis=0) + jnp.max(x, axis=0),
            "cumsum": jnp.cumsum(x, axis=1),
            "index": x[1:3, ::2] * x[idx][:2, :3],
            "gather": jnp.take_along_axis(x, jnp.argsort(y, axis=1), axis=1),
            "at_set": x.at[0, 1].set(3.0).at[idx, 2].add(y[0, :3]),
            "at_mul": x.at[1].multiply(2.0).at[:, 0].max(0.1),
            "einsum": jnp.einsum("ij,kj->ik", x, w) + jnp.einsum("ij,ij->i", x, y)[:, None],
            "matmul": x @ w.T,
            "norm": jnp.linalg.norm(x, axis=-1) + jnp.linalg.norm(w) * jnp.ones(()),
            "sort": jnp.sort(x, axis=-1),
            "concat": jnp.concatenate([x, jnp.flip(y, 0)], axis=1).reshape(2, -1),
        }

    w = RNG.normal(size=(5, 6)).astype(np.float32)
    check_forward_backward(fn, {"x": X, "pos": POS, "w": w}, rtol=3e-5)


@pytest.mark.slow
def test_jax_scipy_special():
    def fn(p):
        x, pos, unit = p["x"], p["pos"], p["unit"]
        return {
            "erf": jss.erf(x),
            "erfc": jss.erfc(x),
            "erfinv": jss.erfinv(unit * 2 - 1),
            "expit": jss.expit(x),
            "logit": jss.logit(unit),
            "logsumexp": jss.logsumexp(x, axis=0),
            "softmax": jss.softmax(x, axis=0),
            "gammaln": jss.gammaln(pos),
            "digamma": jss.digamma(pos),
            "xlogy": jss.xlogy(pos, unit),
            "xlog1py": jss.xlog1py(pos, unit),
            "entr": jss.entr(unit),
            "ndtr": jss.ndtr(x),
            "i0e": jss.i0e(x),
        }

    check_forward_backward(fn, {"x": X, "pos": POS, "unit": UNIT}, rtol=5e-5)


@pytest.mark.slow
def test_lax_control_flow_program():
    def fn(p):
        w, xs = p["w"], p["xs"]

        def rnn_step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, jnp.sum(h * h)

        h, energies = jax.lax.scan(rnn_step, jnp.zeros(w.shape[0]), xs)
        h3 = jax.lax.fori_loop(0, 3, lambda i, c: jax.nn.gelu(c @ w) * 0.5 + c, h)
        c = jax.lax.cond(jnp.sum(h3) > 0, lambda a: a * 2, lambda a: jax.nn.relu(a) - 1, h3)
        s = jax.lax.switch(jnp.argmax(h) % 3, [jnp.sin, jnp.cos, lambda a: a * a], c)
        cp = jax.checkpoint(lambda a: jnp.exp(jnp.tanh(a @ w)))(s)
        return h, energies, cp

    params = {
        "w": (RNG.normal(size=(4, 4)) * 0.5).astype(np.float32),
        "xs": RNG.normal(size=(5, 4)).astype(np.float32),
    }
    check_forward_backward(fn, params, rtol=1e-4)


def test_while_loops_forward():
    """while_loop, and fori_loop with a traced trip count: not reverse-differentiable."""

    def fn(p):
        n = jnp.asarray(jnp.sum(p > 0), jnp.int32)
        a = jax.lax.fori_loop(0, n, lambda i, c: c * 0.5 + p, p)
        _, b = jax.lax.while_loop(
            lambda s: jnp.max(jnp.abs(s[1])) < 10.0 * jnp.max(jnp.abs(p)),
            lambda s: (s[0] + 1, jnp.sin(s[1]) + s[1] * 2),
            (0, p),
        )
        return a, b

    check_forward_backward(fn, X, backward=False)
