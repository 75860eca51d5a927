"""Step time of a jitted MLP training step: plain float32 / float16 vs autoscale'd scaled float16.

The scaled steps compute the same model with scaled arithmetic, without and with
dynamic rescaling of gradients and parameters in the update; this measures what
each costs once compiled. Trace + compile time is reported separately.

Run: python benchmarks/step_time.py [--batch 256] [--width 1024] [--depth 4] [--iters 50]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled_arithmetics as jsa


def init(key, width, depth, n_in=784, n_out=10):
    sizes = [n_in] + [width] * depth + [n_out]
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def loss_fn(params, x, y):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b[None, :])
    w, b = params[-1]
    logits = x @ w + b[None, :]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


def plain_step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), loss


def scaled_step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = jsa.ops.dynamic_rescale_l2(grads)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)
    return jsa.ops.dynamic_rescale_max(params), loss


def measure(step, params, x, y, iters):
    start = time.perf_counter()
    out = step(params, x, y)
    jax.block_until_ready(out)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = step(params, x, y)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return compile_s, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()

    key = jax.random.PRNGKey(0)
    params = init(key, args.width, args.depth)
    x = jax.random.normal(key, (args.batch, 784))
    y = jax.nn.one_hot(jax.random.randint(key, (args.batch,), 0, 10), 10)
    cases = {
        "plain float32": (jax.jit(plain_step), params, x, y),
        "plain float16": (
            jax.jit(plain_step),
            *jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), (params, x, y)),
        ),
        "autoscale float16, SGD": (
            jax.jit(jsa.autoscale(plain_step)),
            *jsa.as_scaled_array((params, x, y), dtype=jnp.float16),
        ),
        "autoscale float16, SGD + dynamic rescaling": (
            jax.jit(jsa.autoscale(scaled_step)),
            *jsa.as_scaled_array((params, x, y), dtype=jnp.float16),
        ),
    }
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({platform.processor()}), "
        f"batch {args.batch}, width {args.width}, depth {args.depth}"
    )
    print("| step | trace + compile (s) | median step (ms) |")
    print("| --- | --- | --- |")
    for name, (step, p, xx, yy) in cases.items():
        compile_s, step_s = measure(step, p, xx, yy, args.iters)
        print(f"| {name} | {compile_s:.2f} | {step_s * 1e3:.2f} |")


if __name__ == "__main__":
    main()
