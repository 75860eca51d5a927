"""FSDP training with ScaledArrays over several processes (`jax.distributed`, CPU + gloo).

A 2-layer MLP (width 64, float16 ScaledArray parameters, Adam through
`jsa.optax.scale_optimizer`) trains for a few steps on random data from a fixed seed. The
mesh `("fsdp",)` spans every device of every process: weights are sharded `P("fsdp", None)`,
biases replicated, the batch split `P("fsdp")`. The step is `jax.jit(jsa.autoscale(step))`:
inside a `jax.shard_map`, `jsa.sharding.gather_params` all-gathers the weight shards in
float8_e4m3fn and reduce-scatters their gradients in bfloat16 (biases' gradients
all-reduced in bfloat16); the optimizer update runs outside the `shard_map`, under `jit`.

With `--processes N` (N > 1) the script starts N copies of itself on localhost, each with
`--devices-per-process K` CPU devices, joined by `jax.distributed.initialize` (cross-process
collectives through gloo). Process 0 writes to `--out` the losses (the `pmean`, and each
device's) and the final parameters (data, scales, represented values). 1 x 8 and 2 x 4
devices give bit-identical parameters and per-device losses; the `pmean` differs by a few
float32 ulps, the all-reduce adding the same terms in another order
(`tests/integration/test_multiprocess.py`).

Run (from the repository root):
    python -m experiments.distributed.multiprocess --out /tmp/one.npz
    python -m experiments.distributed.multiprocess --processes 2 --devices-per-process 4 \\
        --out /tmp/two.npz
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.optax as jsa_optax

WIDTH = 64
BATCH = 32
STEPS = 5
LEARNING_RATE = 1e-2
SEED = 0
AXIS = "fsdp"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--devices-per-process", type=int, default=8)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=Path, default=None, help="an .npz file (process 0)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (launcher)")
    parser.add_argument("--process-id", type=int, default=None, help="(set by the launcher)")
    parser.add_argument("--coordinator", default=None, help="host:port (set by the launcher)")
    return parser.parse_args(argv)


# --- data and parameters, on the host from a fixed seed ----------------------------------


def host_problem(steps: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """float32 parameters, and `steps` batches of inputs and of a random teacher's targets."""
    rng = np.random.default_rng(SEED)

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    params = {
        "w1": dense(WIDTH, WIDTH),
        "b1": np.zeros(WIDTH, np.float32),
        "w2": dense(WIDTH, WIDTH),
        "b2": np.zeros(WIDTH, np.float32),
    }
    teacher = dense(WIDTH, WIDTH)
    x = rng.standard_normal((steps, BATCH, WIDTH)).astype(np.float32)
    y = np.tanh(x @ teacher).astype(np.float32)
    return params, x, y


# The parameters' `PartitionSpec`s: weights split by rows, biases replicated.
SPECS = {"w1": P(AXIS, None), "b1": P(), "w2": P(AXIS, None), "b2": P()}


def predict(params: dict[str, Any], x: Any) -> Any:
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


# --- one process's part of the run ---------------------------------------------------------


def _put(tree: Any, shardings: Any) -> Any:
    """Host arrays (the same on every process) onto a global sharding, each process
    filling its own devices."""

    def put(value: Any, sharding: Any) -> Any:
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(put, tree, shardings)


def train(steps: int) -> dict[str, np.ndarray]:
    """Train on the global mesh; every process returns the losses and final values."""
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    params32, xs, ys = host_problem(steps)
    # float16 data at scale 1, back on the host: every process holds the whole tree and
    # fills its own devices' shards from it.
    scaled = jax.tree.map(np.asarray, jsa.as_scaled_array(params32, dtype=np.float16))
    shardings = jsa.sharding.like(scaled, jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS))
    params = _put(scaled, shardings)
    batch = NamedSharding(mesh, P(AXIS))
    opt = jsa_optax.scale_optimizer(optax.adam(LEARNING_RATE), state_dtype=jnp.float16)
    opt_state = jax.jit(opt.init)(params)

    def local_grads(params: Any, x: Any, y: Any) -> tuple[tuple[Any, Any], Any]:
        def loss_fn(params: Any) -> tuple[Any, Any]:
            full = jsa.sharding.gather_params(
                params, SPECS, AXIS, dtype=jnp.float8_e4m3fn, grad_dtype=jnp.bfloat16
            )
            local = jnp.mean((predict(full, x) - y) ** 2)
            # The mean over the global batch (so gradients are means), and each device's.
            return jax.lax.pmean(local, AXIS), local[None]

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    def step(params: Any, opt_state: Any, x: Any, y: Any) -> tuple[Any, ...]:
        (loss, device_losses), grads = jax.shard_map(
            local_grads,
            mesh=mesh,
            in_specs=(SPECS, P(AXIS), P(AXIS)),
            out_specs=((P(), P(AXIS)), SPECS),
        )(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = jsa_optax.apply_updates(params, updates)
        losses = jsa.asarray((loss, device_losses), jnp.float32)
        return params, opt_state, losses

    step = jax.jit(jsa.autoscale(step))
    history = []
    for i in range(steps):
        x, y = _put((xs[i], ys[i]), (batch, batch))
        params, opt_state, losses = step(params, opt_state, x, y)
        history.append(losses)
    # Every (global) array onto every process, as numpy.
    history, params = multihost_utils.process_allgather((history, params), tiled=True)
    out = {
        "loss": np.stack([np.asarray(loss) for loss, _ in history]),
        "device_losses": np.stack([np.asarray(local) for _, local in history]),
    }
    for name, p in params.items():
        # data * a power-of-two scale: exact in float64.
        out[f"value/{name}"] = np.asarray(p.data, np.float64) * np.asarray(p.scale, np.float64)
        out[f"data/{name}"] = np.asarray(p.data)
        out[f"scale/{name}"] = np.asarray(p.scale)
    return out


def run_process(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Configure JAX (before any computation), join the other processes, train."""
    jax.config.update("jax_num_cpu_devices", args.devices_per_process)
    if args.coordinator is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
    try:
        out = train(args.steps)
    finally:
        if args.coordinator is not None:
            jax.distributed.shutdown()
    if args.out is not None and (args.process_id or 0) == 0:
        np.savez(args.out, **out)
    return out


# --- the launcher ------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on localhost now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace) -> None:
    """Start `args.processes` copies of this script and wait for all of them; if one fails
    or the timeout passes, stop the others (they would wait for it forever)."""
    coordinator = f"localhost:{free_port()}"
    common = [
        "--processes", str(args.processes),
        "--devices-per-process", str(args.devices_per_process),
        "--steps", str(args.steps),
        "--coordinator", coordinator,
    ]  # fmt: skip
    if args.out is not None:
        common += ["--out", str(args.out)]
    script = str(Path(__file__).resolve())
    children = [
        subprocess.Popen([sys.executable, script, *common, "--process-id", str(i)])
        for i in range(args.processes)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        while any(child.poll() is None for child in children):
            failed = [c.returncode for c in children if c.returncode not in (None, 0)]
            if failed:
                raise SystemExit(f"a process failed (exit status {failed[0]})")
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out after {args.timeout:.0f} s")
            time.sleep(0.1)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    codes = [child.returncode for child in children]
    if any(codes):
        raise SystemExit(f"processes exited with {codes}")


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if args.processes > 1 and args.coordinator is None:
        launch(args)
        return
    out = run_process(args)
    if (args.process_id or 0) == 0:
        print("losses:", " ".join(f"{v:.6f}" for v in out["loss"]))


if __name__ == "__main__":
    main()
