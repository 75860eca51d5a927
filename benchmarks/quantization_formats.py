"""Time posit and lookup-table quantisation against `float_quantize` to float8, same input.

On 4M float32 values (standard normal, `--size`), each case one jitted call:

    float8_e4m3fn   float_quantize(x, "float8_e4m3fn"), the baseline of the ratios
    posit8_es0      posit_quantize(x, 8, 0)
    posit16_es1     posit_quantize(x, 16, 1)
    table16         table_quantize(x, NF4): 16 entries
    table256        table_quantize(x, t): 256 sorted entries
    argmin256       the same as an argmin over all entries: t[argmin(|x[:, None] - t|)]
    hadamard16      random_hadamard(x, key=k, size=16): the 4-bit recipes' rotation
    nvfp4           nvfp4_fake_quantize(x): E2M1, E4M3 per 16, float32 per tensor
    mxfp4           block_fake_quantize(x, "mxfp4_e2m1", 32, scale_rounding="up")

The CPU may be shared: the cases are timed in interleaved rounds (every round runs every
case once, after one warm-up call each) and the report gives each case's median over the
rounds, with its ratio to the float8 median and the argmin form's ratio to the search.

Run: python benchmarks/quantization_formats.py --rounds 15
     python benchmarks/quantization_formats.py --rounds 21 --cases hadamard16 nvfp4 mxfp4
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_scaled_arithmetics.quantization import (
    NF4,
    block_fake_quantize,
    float_quantize,
    nvfp4_fake_quantize,
    posit_quantize,
    random_hadamard,
    table_quantize,
)


def cases(table256: np.ndarray) -> dict[str, Callable[[jax.Array], jax.Array]]:
    entries = jnp.asarray(table256)

    @jax.jit
    def argmin_form(x: jax.Array) -> jax.Array:
        return entries[jnp.argmin(jnp.abs(x[:, None] - entries[None, :]), axis=1)]

    return {
        "float8_e4m3fn": lambda x: float_quantize(x, "float8_e4m3fn"),
        "posit8_es0": lambda x: posit_quantize(x, 8, 0),
        "posit16_es1": lambda x: posit_quantize(x, 16, 1),
        "table16": lambda x: table_quantize(x, NF4),
        "table256": lambda x: table_quantize(x, table256),
        "argmin256": argmin_form,
        "hadamard16": jax.jit(lambda x: random_hadamard(x, key=jax.random.key(0), size=16)),
        "nvfp4": nvfp4_fake_quantize,
        "mxfp4": lambda x: block_fake_quantize(x, "mxfp4_e2m1", 32, scale_rounding="up"),
    }


def measure(
    size: int, rounds: int, seed: int = 0, only: list[str] | None = None
) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(size).astype(np.float32))
    table256 = np.sort(rng.standard_normal(256)).astype(np.float32)
    fns = cases(table256)
    if only:
        unknown = sorted(set(only) - set(fns))
        if unknown:
            raise SystemExit(f"unknown cases {unknown}; choose from {sorted(fns)}")
        fns = {name: fn for name, fn in fns.items() if name in only or name == "float8_e4m3fn"}
    if "argmin256" in fns:
        # The argmin form measures float32 distances, rounded: it may differ where they tie.
        differ = int(jnp.sum(fns["argmin256"](x) != table_quantize(x, table256)))
        print(f"argmin form and search differ on {differ} of {size} values (rounded distances)")
    for fn in fns.values():
        jax.block_until_ready(fn(x))  # compile
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times[name].append(time.perf_counter() - start)
    return times


def report(times: dict[str, list[float]], size: int) -> str:
    medians = {name: float(np.median(t)) for name, t in times.items()}
    base = medians["float8_e4m3fn"]
    machine = platform.processor() or platform.machine()
    lines = [
        f"{size:,} float32 values, median of {len(times['float8_e4m3fn'])} interleaved rounds "
        f"(jax {jax.__version__}, {jax.default_backend()}, {machine}, {os.cpu_count()} CPUs)",
        "",
        "| case | median (ms) | min (ms) | ratio to float8_e4m3fn |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, t in times.items():
        lines.append(
            f"| {name} | {1e3 * medians[name]:.1f} | {1e3 * min(t):.1f} | "
            f"{medians[name] / base:.2f}x |"
        )
    if "argmin256" in medians and "table256" in medians:
        speedup = medians["argmin256"] / medians["table256"]
        lines += ["", f"table search vs argmin form at 256 entries: {speedup:.1f}x faster"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4 * 2**20)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="time only these cases (and the float8 baseline); the argmin form's 4 GiB of "
        "distances slow the cases timed after it on a small machine",
    )
    args = parser.parse_args(argv)
    print(report(measure(args.size, args.rounds, only=args.cases), args.size))


if __name__ == "__main__":
    main()
