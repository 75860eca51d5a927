"""Quickstart: train a small MLP with FP16 scaled parameters under `jsa.autoscale`.

The model and the SGD step are plain JAX. Parameters and inputs become
ScaledArrays with float16 data, and the whole step (forward, backward, update)
runs in scaled arithmetic. The update dynamically rescales gradients and
parameters, so their data stays in float16's comfortable range whatever the
static scale rules did during the step.

Run: python experiments/quickstart.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled_arithmetics as jsa

LEARNING_RATE = 0.05


def init_params(key: jax.Array, sizes: list[int]) -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in), jnp.zeros(n_out))
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:])
    ]


def predict(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def sgd_update(params, grads):
    return jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads)


@jax.jit
def step_float32(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return sgd_update(params, grads), loss


@jax.jit
@jsa.autoscale
def step_scaled(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = jsa.ops.dynamic_rescale_l2(grads)
    params = jsa.ops.dynamic_rescale_max(sgd_update(params, grads))
    return params, loss


def main(steps: int = 300) -> tuple[float, float]:
    key = jax.random.PRNGKey(0)
    k_init, k_x, k_w = jax.random.split(key, 3)
    x = jax.random.normal(k_x, (256, 16))
    y = jnp.sin(x @ jax.random.normal(k_w, (16, 1)))
    params32 = init_params(k_init, [16, 64, 64, 1])

    p32 = params32
    for _ in range(steps):
        p32, loss32 = step_float32(p32, x, y)

    # Scaled FP16: float16 data, float32 power-of-two scales.
    params = jsa.as_scaled_array(params32, dtype=jnp.float16)
    x16, y16 = jsa.as_scaled_array((x, y), dtype=jnp.float16)
    for _ in range(steps):
        params, loss16 = step_scaled(params, x16, y16)

    loss32_final = float(loss32)
    loss16_final = float(loss16.to_array(jnp.float32))
    print(
        f"loss after {steps} SGD steps: float32 {loss32_final:.4f}, "
        f"scaled float16 {loss16_final:.4f}"
    )
    return loss32_final, loss16_final


if __name__ == "__main__":
    main()
