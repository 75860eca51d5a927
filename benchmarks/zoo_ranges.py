"""Where the zoo transformers' tensors sit in float16 and FP8 E5M2: plain vs scaled data.

For each model of `tests/integration/zoo.py` (a Flax linen GPT, a Flax NNX Llama-like LM,
an Equinox BERT-like classifier), one forward and backward pass (`jax.value_and_grad` of
its loss, the Equinox one through `eqx.filter_value_and_grad`) on float16 data, recorded
by `jsa.analysis.tensor_ranges`, once with the parameters as ScaledArrays (`scaled`) and
once as plain float16 arrays (`plain`, every scale 1). Reported per variant: the share of
floating tensors (equation outputs) with more than 1% of their nonzero entries subnormal in
float16 (precision lost, the step before flushing), and with more than 1% of them flushing
to zero if cast to float8_e5m2; and the number of tensors.

Run:
    python benchmarks/zoo_ranges.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax_scaled_arithmetics as jsa  # noqa: E402
from tests.integration import zoo  # noqa: E402

F16 = jnp.float16


def linen_program() -> tuple[Any, tuple[Any, ...]]:
    _, variables = zoo.linen_lm_init()
    model = zoo.linen_lm(zoo.CONFIG, F16)
    params = jsa.as_scaled_array(variables["params"], dtype=F16)
    return functools.partial(zoo.linen_loss_and_grad, model.apply), (params, zoo.lm_batch())


def nnx_program() -> tuple[Any, tuple[Any, ...]]:
    graphdef, params, rest = nnx.split(zoo.nnx_init(), nnx.Param, ...)
    params = jsa.as_scaled_array(params, dtype=F16)
    return functools.partial(zoo.nnx_loss_and_grad, graphdef, rest), (params, zoo.lm_batch())


def equinox_program() -> tuple[Any, tuple[Any, ...]]:
    model = jsa.as_scaled_array(zoo.equinox_init(), dtype=F16)
    batch, key = zoo.classification_batch(), jax.random.PRNGKey(0)
    return eqx.filter_value_and_grad(zoo.equinox_loss), (model, batch, key)


def shares(table: Any) -> tuple[float, float, int]:
    rows = [r for r in table.rows if r.dtype == "float16" and r.shape]
    sub = sum(r.subnormal > 0.01 for r in rows) / len(rows)
    e5m2 = sum(r.flush["float8_e5m2"] > 0.01 for r in rows) / len(rows)
    return sub, e5m2, len(rows)


def main() -> None:
    print(f"jax {jax.__version__}, {jax.default_backend()}")
    print("| model | data | tensors | >1% subnormal in float16 | >1% flushed in E5M2 |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, build in (
        ("linen", linen_program),
        ("nnx", nnx_program),
        ("equinox", equinox_program),
    ):
        fn, args = build()
        for scaled in (False, True):
            table = jsa.analysis.tensor_ranges(fn, *args, formats=("float8_e5m2",), scaled=scaled)
            sub, e5m2, n = shares(table)
            label = "scaled float16" if scaled else "plain float16"
            print(f"| {name} | {label} | {n} | {100 * sub:.1f}% | {100 * e5m2:.1f}% |")


if __name__ == "__main__":
    main()
