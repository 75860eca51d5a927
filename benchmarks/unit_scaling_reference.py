"""`U`'s ops against the reference PyTorch library's (`unit-scaling`, Graphcore, 0.3.x), op by
op: the same float64 inputs and output cotangent (unit normal, from one numpy seed), each
library's standard deviation of the output and of every input gradient, in a markdown table.

Needs `torch` and `unit-scaling` beside this package (not dependencies; e.g. a separate
venv: `pip install torch unit-scaling==0.3.5 -e .`). JAX runs in float64 here.

Each op is called with each library's defaults (constraint "to_output_scale" in both for
the constrained ops), or, where the note says so, unconstrained (`constraint=None`), which
shows how close each factor is to unit on its own.

Run: python benchmarks/unit_scaling_reference.py [--markdown docs/unit_scaling_reference.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class Case:
    """One op: its inputs' shapes, and the call in each library on those inputs (as
    float64 arrays/tensors, the differentiable ones first)."""

    name: str
    shapes: Sequence[tuple[int, ...]]  # differentiable inputs
    ours: Callable[..., Any]
    reference: Callable[..., Any]
    extra: Callable[[np.random.Generator], Sequence[Any]] = lambda rng: ()  # e.g. labels
    note: str = ""


def _cases() -> list[Case]:
    import jax
    import jax.numpy as jnp
    import torch
    import unit_scaling.functional as RF

    import jax_scaled_arithmetics.unit_scaling as U

    n, d, v, seq, heads = 4096, 256, 10, 64, 4
    ids = lambda rng: (rng.integers(0, 1000, (n,)),)  # noqa: E731
    labels = lambda rng: (rng.integers(0, v, (n,)),)  # noqa: E731

    def t(a: Any) -> Any:
        return torch.as_tensor(np.asarray(a))

    cases = [
        Case(
            "gelu",
            [(n, d)],
            lambda x: U.gelu(x, approximate=False, constraint=None),
            lambda x: RF.gelu(x, constraint=None),
            note="unconstrained, erf form",
        ),
        Case(
            "gelu (defaults)",
            [(n, d)],
            lambda x: U.gelu(x, approximate=False),
            lambda x: RF.gelu(x),
        ),
        Case(
            "gelu mult=4",
            [(n, d)],
            lambda x: U.gelu(x, approximate=False, mult=4.0, constraint=None),
            lambda x: RF.gelu(x, mult=4.0, constraint=None),
            note="unconstrained",
        ),
        Case(
            "softmax n=16 mult=4",
            [(n, 16)],
            lambda x: U.softmax(x, mult=4.0, constraint=None),
            lambda x: RF.softmax(x, dim=-1, mult=4.0, constraint=None),
            note="unconstrained",
        ),
        Case(
            "cross_entropy V=10, label_smoothing=0.1",
            [(n, v)],
            lambda x, y: U.cross_entropy(x, y, label_smoothing=0.1),
            lambda x, y: RF.cross_entropy(x, t(y), label_smoothing=0.1),
            extra=labels,
        ),
        Case(
            "scaled_dot_product_attention, causal, 1/d logits",
            [(8, heads, seq, 64)] * 3,
            lambda q, k, w: U.scaled_dot_product_attention(q, k, w, is_causal=True, scale="1/d"),
            lambda q, k, w: RF.scaled_dot_product_attention(q, k, w, is_causal=True),
            note="the reference's attention always uses 1/d",
        ),
        Case(
            "silu",
            [(n, d)],
            lambda x: U.silu(x, constraint=None),
            lambda x: RF.silu(x, constraint=None),
            note="unconstrained",
        ),
        Case("silu_glu", [(n, d), (n, d)], U.silu_glu, RF.silu_glu),
        Case(
            "softmax n=16",
            [(n, 16)],
            lambda x: U.softmax(x, constraint=None),
            lambda x: RF.softmax(x, dim=-1, constraint=None),
            note="unconstrained",
        ),
        Case(
            "softmax n=256",
            [(n, d)],
            lambda x: U.softmax(x, constraint=None),
            lambda x: RF.softmax(x, dim=-1, constraint=None),
            note="unconstrained",
        ),
        Case(
            "matmul (M,K)@(K,N)",
            [(n, d), (d, 512)],
            lambda a, b: U.matmul(a, b),
            lambda a, b: RF.matmul(a, b),
        ),
        Case(
            "matmul, weight broadcast over a batch",
            [(16, 256, d), (d, 512)],
            lambda a, b: U.matmul(a, b, constraint=None),
            lambda a, b: RF.matmul(a, b, constraint=None),
            note="unconstrained",
        ),
        Case(
            "linear",
            [(n, d), (d, 512)],
            lambda x, w: U.linear(x, w),
            lambda x, w: RF.linear(x, w.T, None),
        ),
        Case(
            "linear_readout",
            [(n, d), (d, v)],
            lambda x, w: U.linear_readout(x, w),
            lambda x, w: RF.linear_readout(x, w.T, None),
        ),
        Case(
            "layer_norm",
            [(n, d), (d,), (d,)],
            lambda x, g, b: U.layer_norm(x, g, b),
            lambda x, g, b: RF.layer_norm(x, (d,), g, b),
        ),
        Case(
            "rms_norm",
            [(n, d), (d,)],
            lambda x, g: U.rms_norm(x, g),
            lambda x, g: RF.rms_norm(x, (d,), g),
        ),
        Case(
            "embedding",
            [(1000, d)],
            lambda w, i: U.embedding(i, w),
            lambda w, i: RF.embedding(t(i), w),
            extra=ids,
        ),
        Case(
            "add",
            [(n, d), (n, d)],
            lambda a, b: U.add(a, b, constraint=None),
            lambda a, b: RF.add(a, b, constraint=None),
            note="unconstrained",
        ),
        Case(
            "residual_split + residual_add, tau=0.5",
            [(n, d)],
            lambda x: _residual(U, x, 0.5),
            lambda x: _residual(RF, x, 0.5),
            note="branch f(x) = x",
        ),
        Case("mse_loss", [(n, d), (n, d)], U.mse_loss, RF.mse_loss),
        Case(
            "cross_entropy V=10",
            [(n, v)],
            lambda x, y: U.cross_entropy(x, y),
            lambda x, y: RF.cross_entropy(x, t(y)),
            extra=labels,
        ),
        Case(
            "scaled_dot_product_attention, causal",
            [(8, heads, seq, 64)] * 3,
            lambda q, k, w: U.scaled_dot_product_attention(q, k, w, is_causal=True),
            lambda q, k, w: RF.scaled_dot_product_attention(q, k, w, is_causal=True),
        ),
        Case(
            "scaled_dot_product_attention",
            [(8, heads, seq, 64)] * 3,
            lambda q, k, w: U.scaled_dot_product_attention(q, k, w),
            lambda q, k, w: RF.scaled_dot_product_attention(q, k, w),
        ),
        Case(
            "conv1d k=3",
            [(32, 128, 64), (5, 64, 64)],
            lambda x, w: U.conv1d(x, w, padding="VALID"),
            lambda x, w: RF.conv1d(x.transpose(1, 2), w.permute(2, 1, 0)).transpose(1, 2),
            note="ours NWC/WIO, the reference's NCW/OIW",
        ),
    ]
    del jax, jnp
    return cases


def _residual(module: Any, x: Any, tau: float) -> Any:
    residual, skip = module.residual_split(x, tau)
    return module.residual_add(residual, skip, tau)


def _std(a: Any) -> float:
    return float(np.std(np.asarray(a, dtype=np.float64)))


def measure(case: Case, seed: int = 0) -> dict[str, Any]:
    import jax
    import torch

    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(shape) for shape in case.shapes]
    extra = list(case.extra(rng))

    # ours
    def ours_fn(*xs: Any) -> Any:
        return case.ours(*xs, *extra)

    out, vjp = jax.vjp(ours_fn, *[jax.numpy.asarray(x) for x in inputs])
    cot = rng.standard_normal(np.shape(out)) if np.ndim(out) else np.float64(1.0)
    ours_grads = vjp(jax.numpy.asarray(cot, dtype=out.dtype))
    ours = [_std(out)] + [_std(g) for g in ours_grads]

    # reference
    tensors = [torch.tensor(x, requires_grad=True) for x in inputs]
    note = case.note
    try:
        ref_out = case.reference(*tensors, *extra)
        ref_out.backward(torch.as_tensor(cot, dtype=ref_out.dtype).reshape(ref_out.shape))
        ref = [_std(ref_out.detach().numpy())] + [_std(x.grad.numpy()) for x in tensors]
    except Exception as error:  # an argument the reference does not support: say so
        ref = [math.nan] * len(ours)
        note = f"the reference raises {type(error).__name__}: {str(error).split('.')[0]}"
    scalar = np.ndim(out) == 0
    return {"name": case.name, "ours": ours, "reference": ref, "scalar": scalar, "note": note}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| op | output std: ours / reference | input-gradient stds: ours / reference | note |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        out = (
            "(scalar loss)"
            if row["scalar"]
            else f"{row['ours'][0]:.3f} / {row['reference'][0]:.3f}"
        )
        grads = ", ".join(
            f"{a:.3f} / {b:.3f}" for a, b in zip(row["ours"][1:], row["reference"][1:], strict=True)
        )
        lines.append(f"| {row['name']} | {out} | {grads} | {row['note']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    import jax

    jax.config.update("jax_enable_x64", True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", default=None, help="write the table to this file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = []
    for case in _cases():
        try:
            rows.append(measure(case, args.seed))
        except Exception as error:  # an op one library lacks: say so in the table
            rows.append(
                {
                    "name": case.name,
                    "ours": [math.nan],
                    "reference": [math.nan],
                    "scalar": False,
                    "note": f"failed: {type(error).__name__}: {error}"[:120],
                }
            )
    text = table(rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
