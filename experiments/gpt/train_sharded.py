"""Train the char-level GPT of `model.py` sharded over a mesh of devices: FSDP with the
parameters all-gathered in a low-precision wire format and the gradients reduce-scattered
in another (`jsa.sharding.gather_params`), on JAX's own SPMD engine (`jax.jit`,
`NamedSharding`, `jax.shard_map`).

Every parameter is stored sharded over the mesh axis "fsdp" (along its first dimension
that the device count divides; replicated when none does), the batch is split over the
same axis, and one jitted step does: `shard_map` of the loss and its gradient, in which
each layer's parameters are gathered (`gather_params`) and the per-device loss averaged
with `pmean`; then the optimizer update, sharded like the parameters. Recipes:

    fp32       float32 parameters, Adam and wire (plain JAX, no `autoscale`).
    bf16       bfloat16 parameters and compute (float32 master weights and Adam), the
               gathers and gradient reductions in bfloat16 (plain JAX).
    fp8-fsdp   `jsa.autoscale`: float16 ScaledArray parameters and Adam state
               (`jsa.optax.scale_optimizer`), parameters gathered in float8_e4m3fn
               (1 byte an entry at one power-of-two scale per tensor shared by all
               devices), gradients reduce-scattered in bfloat16 at a shared scale.

Data and evaluation are those of `train.py` (the same initialisation, batches and held-out
windows for the same `--seed`); the global batch is the same whatever the device count,
so a run on 8 devices is comparable step by step with one on 1 device.

`--devices N` simulates N devices on the CPU (`jax_num_cpu_devices`); on a machine with N
accelerators it uses them. `--hlo` prints, instead of training, the bytes every collective
of the compiled step moves (`collective_bytes`).

Run: python experiments/gpt/train_sharded.py --data-dir ../shared/data --devices 8 \
         --recipe fp8-fsdp --out-dir runs/sharded
     python experiments/gpt/train_sharded.py --devices 8 --hlo --recipe fp32 bf16 fp8-fsdp
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_scaled_arithmetics as jsa  # noqa: E402
from experiments import data as datasets  # noqa: E402
from experiments.gpt import model as gpt  # noqa: E402
from experiments.gpt import train as single  # noqa: E402

RECIPES = ("fp32", "bf16", "fp8-fsdp")
AXIS = "fsdp"


@dataclasses.dataclass
class Run:
    """A recipe's state and functions on a mesh: `step(params, state, x, y)`, and
    `values(params)` the float32 parameter values (replicated) for evaluation."""

    recipe: str
    mesh: Mesh
    params: Any
    state: Any
    step: Callable[..., Any]
    values: Callable[[Any], Any]
    specs: Any


def param_specs(params: Any, devices: int) -> Any:
    """Each leaf split over "fsdp" along its first dimension `devices` divides (its
    largest such one for matrices), replicated when none does."""

    def spec(leaf: Any) -> P:
        shape = np.shape(leaf)
        for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[dim] % devices == 0 and shape[dim] >= devices:
                entries: list[Any] = [None] * len(shape)
                entries[dim] = AXIS
                return P(*entries)
        return P()

    return jax.tree.map(spec, params)


def _loss_and_grad(loss: Callable[..., Any], specs: Any, mesh: Mesh, **wire: Any) -> Any:
    """`shard_map` of the mean loss over the mesh and its gradient, parameters gathered."""

    def local(params: Any, x: Any, y: Any) -> Any:
        def mean_loss(p: Any) -> Any:
            full = jsa.sharding.gather_params(p, specs, AXIS, **wire)
            return jax.lax.pmean(loss(full, x, y), AXIS)

        return jax.value_and_grad(mean_loss)(params)

    batch = P(AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, batch, batch), out_specs=(P(), specs))


def setup(recipe: str, params32: Any, model: gpt.GPTConfig, lr: float, mesh: Mesh) -> Run:
    """The recipe's sharded state and jitted step, from the float32 parameters."""
    devices = mesh.size
    specs = param_specs(params32, devices)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    replicated = NamedSharding(mesh, P())

    def loss(p: Any, x: Any, y: Any) -> Any:
        return gpt.loss_fn(p, x, y, model)

    if recipe in ("fp32", "bf16"):
        if recipe == "fp32":
            wire: dict[str, Any] = {}
            train_loss = loss
        else:
            wire = {"dtype": jnp.bfloat16, "grad_dtype": jnp.bfloat16}

            def train_loss(p: Any, x: Any, y: Any) -> Any:
                return loss(jsa.tree.astype(p, jnp.bfloat16), x, y).astype(jnp.float32)

        opt = optax.adam(lr)
        grad_fn = _loss_and_grad(train_loss, specs, mesh, **wire)

        @jax.jit
        def plain_step(params: Any, state: Any, x: Any, y: Any) -> Any:
            value, grads = grad_fn(params, x, y)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        params = jax.device_put(params32, shardings)
        if recipe == "bf16":
            # The wire dtype is the data's: gather bfloat16 copies of the float32 masters.
            inner = _loss_and_grad(loss, specs, mesh, **wire)

            def bf16_grads(params: Any, x: Any, y: Any) -> Any:
                low = jsa.tree.astype(params, jnp.bfloat16)
                value, grads = inner(low, x, y)
                return value, jsa.tree.astype(grads, jnp.float32)

            @jax.jit
            def bf16_step(params: Any, state: Any, x: Any, y: Any) -> Any:
                value, grads = bf16_grads(params, x, y)
                updates, state = opt.update(grads, state, params)
                return optax.apply_updates(params, updates), state, value

            step = bf16_step
        else:
            step = plain_step
        return Run(
            recipe,
            mesh,
            params,
            jax.jit(opt.init, out_shardings=jsa.sharding.state_like(opt, params, shardings))(
                params
            ),
            step,
            jax.jit(lambda p: p, out_shardings=replicated),
            specs,
        )
    if recipe == "fp8-fsdp":
        scaled_opt = jsa.optax.scale_optimizer(optax.adam(lr), state_dtype=jnp.float16)
        grad_fn = _loss_and_grad(
            loss, specs, mesh, dtype=jnp.float8_e4m3fn, grad_dtype=jnp.bfloat16
        )

        def scaled_step(params: Any, state: Any, x: Any, y: Any) -> Any:
            value, grads = grad_fn(params, x, y)
            updates, state = scaled_opt.update(grads, state, params)
            return jsa.optax.apply_updates(params, updates), state, value

        scaled_params = single._to_scaled_fp16(params32)  # noqa: SLF001 (same init as train.py)
        params = jsa.sharding.device_put(scaled_params, shardings)
        return Run(
            recipe,
            mesh,
            params,
            jax.jit(
                scaled_opt.init,
                out_shardings=jsa.sharding.state_like(scaled_opt, params, shardings),
            )(params),
            jax.jit(jsa.autoscale(scaled_step)),
            jax.jit(lambda p: jsa.asarray(p, jnp.float32), out_shardings=replicated),
            specs,
        )
    raise ValueError(f"Unknown recipe {recipe!r}; choose from {', '.join(RECIPES)}.")


# --- what the collectives move ------------------------------------------------------------

_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(
    r"(pred|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64)\[([0-9,]*)\]"
)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2}
_BYTES |= {"bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def parse_collectives(hlo: str) -> list[dict[str, Any]]:
    """Every collective of an HLO module's text: its kind, result type and bytes (the
    result's: what a device holds after an all-gather, sends into a reduce-scatter's or
    all-reduce's sum per element of its input for a reduce-scatter, see `collective_bytes`)."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        result, kind = match.groups()
        arrays = _ARRAY.findall(result)
        nbytes = sum(
            _BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d])) for t, dims in arrays
        )
        found.append({"kind": kind, "type": result.strip(), "bytes": nbytes})
    return found


@contextlib.contextmanager
def _no_persistent_cache() -> Iterator[None]:
    """A persistent-cache hit compiles nothing and so dumps no pass (the dump options are
    not part of the cache key): compile with JAX's persistent cache off. JAX decides once
    whether it uses the cache; `reset_cache` (internal) makes it decide again."""
    from jax._src import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def collective_bytes(jitted: Any, *args: Any) -> dict[str, dict[str, Any]]:
    """Bytes the collectives of `jitted(*args)` move per device and step, by kind, read
    from XLA's HLO after SPMD partitioning (what any backend is asked to move) and from the
    program XLA:CPU runs (its `all-reduce-promotion` pass widens bfloat16 reductions to
    float32 on the CPU).

    For an all-gather, the bytes of its result (the gathered array); for a reduce-scatter,
    of its operand (the array every device contributes: result bytes x devices); for an
    all-reduce, of its operand. Returned: `{"partitioned": {kind: bytes, ...}, "cpu": ...}`.
    """
    options = {"xla_dump_to": "", "xla_dump_hlo_pass_re": "all-reduce-promotion"}
    with tempfile.TemporaryDirectory() as dump, _no_persistent_cache():
        compiled = jitted.lower(*args).compile(compiler_options={**options, "xla_dump_to": dump})
        dumps = sorted(glob.glob(os.path.join(dump, "*before_all-reduce-promotion*")))
        if not dumps:
            raise RuntimeError(
                "collective_bytes: XLA dumped no module before its all-reduce-promotion pass "
                f"(files: {sorted(os.listdir(dump))[:5]})."
            )
        partitioned = Path(dumps[-1]).read_text()
    devices = len(jax.devices())

    def totals(hlo: str) -> dict[str, Any]:
        out: dict[str, Any] = {"count": {}}
        for c in parse_collectives(hlo):
            nbytes = c["bytes"] * (devices if c["kind"] == "reduce-scatter" else 1)
            out[c["kind"]] = out.get(c["kind"], 0) + nbytes
            out["count"][c["kind"]] = out["count"].get(c["kind"], 0) + 1
        return out

    return {"partitioned": totals(partitioned), "cpu": totals(compiled.as_text())}


# --- training ------------------------------------------------------------------------------


def train(
    recipe: str,
    text: str,
    devices: Sequence[Any],
    config: single.TrainConfig | None = None,
    lr: float | None = None,
    out_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Train the GPT on `text` with `recipe` over `devices`; return the run's log (and
    write it to `out_dir/<recipe>-<n>dev.json`)."""
    config = single.TrainConfig() if config is None else config
    lr = config.lr if lr is None else lr
    if config.batch_size % len(devices):
        raise ValueError(f"batch {config.batch_size} does not split over {len(devices)} devices.")
    corpus = single.CharData.from_text(text)
    model = config.model(len(corpus.vocab))
    params32 = single._init_params(jax.random.PRNGKey(config.seed), model)  # noqa: SLF001
    mesh = Mesh(np.array(devices), (AXIS,))
    run = setup(recipe, params32, model, lr, mesh)
    offsets = single.train_offsets(len(corpus.train), config)
    val_batches = [
        single.windows(corpus.val, o, config.block_size)
        for o in single.eval_offsets(len(corpus.val), config)
    ]
    eval_loss = jax.jit(functools.partial(single._float32_loss, model=model))  # noqa: SLF001
    batch_sharding = NamedSharding(mesh, P(AXIS))
    params, state = run.params, run.state
    val_steps: list[int] = []
    val_losses: list[float] = []

    def evaluate(step: int) -> None:
        values = jax.device_get(run.values(params))
        val_steps.append(step)
        val_losses.append(single.mean_loss(eval_loss, values, val_batches))

    evaluate(0)
    train_losses = []
    start = time.perf_counter()
    first_step_s = 0.0
    for i in range(config.steps):
        x, y = single.windows(corpus.train, offsets[i], config.block_size)
        x, y = jax.device_put((x, y), batch_sharding)
        params, state, loss = run.step(params, state, x, y)
        train_losses.append(float(np.asarray(loss, np.float32)))
        if i == 0:
            first_step_s = time.perf_counter() - start
        if i + 1 == config.steps or (config.eval_every > 0 and (i + 1) % config.eval_every == 0):
            evaluate(i + 1)
    wall_s = time.perf_counter() - start
    log = {
        "experiment": "gpt-sharded",
        "recipe": recipe,
        "devices": len(devices),
        "lr": lr,
        "config": dataclasses.asdict(config),
        "init_digest": single.digest(params32),
        "batches_digest": single.digest(offsets),
        "train_loss": train_losses,
        "val_steps": val_steps,
        "val_loss": val_losses,
        "final_val_loss": val_losses[-1],
        "first_step_s": first_step_s,
        "wall_s": wall_s,
        "platform": jax.default_backend(),
        "jax_version": jax.__version__,
    }
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{recipe}-{len(devices)}dev.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def hlo_report(recipes: Sequence[str], devices: Sequence[Any], config: single.TrainConfig) -> Any:
    """The collective bytes of one step of each recipe (random tokens, no data needed)."""
    model = config.model(65)
    params32 = single._init_params(jax.random.PRNGKey(config.seed), model)  # noqa: SLF001
    mesh = Mesh(np.array(devices), (AXIS,))
    tokens = jnp.zeros((config.batch_size, config.block_size), jnp.int32)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(AXIS)))
    report = {}
    for recipe in recipes:
        run = setup(recipe, params32, model, config.lr, mesh)
        report[recipe] = collective_bytes(run.step, run.params, run.state, tokens, tokens)
    return report


def main(argv: Sequence[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", nargs="+", default=["fp8-fsdp"], choices=RECIPES)
    parser.add_argument("--devices", type=int, default=8, help="mesh size")
    parser.add_argument("--data-dir", default=None, help="folder with tiny-shakespeare")
    parser.add_argument("--steps", type=int, default=single.TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=single.TrainConfig.batch_size)
    parser.add_argument("--n-layer", type=int, default=single.TrainConfig.n_layer)
    parser.add_argument("--n-embd", type=int, default=single.TrainConfig.n_embd)
    parser.add_argument("--lr", type=float, default=single.TrainConfig.lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=single.TrainConfig.eval_every)
    parser.add_argument("--out-dir", type=Path, default=None, help="JSON logs")
    parser.add_argument("--hlo", action="store_true", help="collective bytes, no training")
    args = parser.parse_args(argv)
    # Before any computation starts a backend; only the CPU backend reads it.
    jax.config.update("jax_num_cpu_devices", args.devices)
    devices = jax.devices()[: args.devices]
    config = single.TrainConfig(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        eval_every=args.eval_every,
    )
    if args.hlo:
        report = hlo_report(args.recipe, devices, config)
        print(json.dumps(report, indent=1))
        return report
    text = datasets.tinyshakespeare(args.data_dir)
    logs = []
    for recipe in args.recipe:
        log = train(recipe, text, devices, config, out_dir=args.out_dir)
        print(
            f"{recipe} on {len(devices)} devices: final val {log['final_val_loss']:.4f}, "
            f"{log['wall_s']:.1f} s"
        )
        logs.append(log)
    return logs


if __name__ == "__main__":
    main()
