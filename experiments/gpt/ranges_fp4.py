"""Where the GPT's gradients lie for 4 bits: range charts (`jsa.analysis`) of the float32
gradient program against E2M1, and what each scaling of the 4-bit recipes keeps of the
matmul-output gradients.

The model, initialisation and first batch are those of `train.py` with `--n-layer 4` (the
4-bit experiment's config, seed 0). Two parts:

1. `jsa.analysis.tensor_ranges(jax.grad(loss))` on the float32 parameters, drawn against
   `float4_e2m1fn` (`docs/images/gpt_ranges_fp4_e2m1.png`): every tensor of the forward and
   backward pass, unscaled. Printed: per pass, the fraction of the elements that flush to
   zero in E2M1 and in E4M3.
2. The gradient of the loss with respect to each linear layer's output (the `g` that the
   recipes quantise for both backward matmuls), captured exactly: each bias is broadcast to
   one copy per token, so its gradient is `g`. For each, the relative error
   ``||q(g) - g|| / ||g||`` and the fraction of its nonzero entries that become zero, for:
   E2M1 without a scale; one float32 scale per tensor (`fp4_tensor`); NVFP4 and MXFP4
   (scale rounded up, and floor) in blocks along the features (the input gradient's
   operand); NVFP4 along the tokens (the weight gradient's operand), without and with the
   random Hadamard transform of size 16. Printed as a table (mean over the layers and per
   layer with `--per-layer`) and drawn in `docs/images/gpt_fp4_gradient_error.png`.

Run: python experiments/gpt/ranges_fp4.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.quantization as Q

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

from experiments import data as datasets  # noqa: E402
from experiments.gpt import model as gpt  # noqa: E402
from experiments.gpt import ranges, train  # noqa: E402

IMAGES = REPO_ROOT / "docs" / "images"
LINEAR_BIASES = ("qkv_b", "proj_b", "fc_b", "fc_proj_b")
"""The bias of each linear layer of a block (`model.py`), in program order."""


def _per_tensor(g: jax.Array) -> jax.Array:
    scale = jnp.max(jnp.abs(g)) / 6
    return Q.float_quantize(g / scale, "float4_e2m1fn", saturate=True) * scale


def _mx(rounding: str) -> Callable[[jax.Array], jax.Array]:
    return lambda g: Q.block_fake_quantize(g, "mxfp4_e2m1", 32, -1, scale_rounding=rounding)


def _tokens_hadamard(g: jax.Array) -> jax.Array:
    """NVFP4 along the tokens after the random Hadamard transform, transformed back (the
    weight gradient sees the transformed operands; its error is that of the round trip)."""
    key = jax.random.key(0)
    h = Q.random_hadamard(g, axis=0, key=key, size=16)
    return Q.inverse_random_hadamard(Q.nvfp4_fake_quantize(h, axis=0), axis=0, key=key, size=16)


SCALINGS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "E2M1, no scale": lambda g: Q.float_quantize(g, "float4_e2m1fn", saturate=True),
    "E2M1, one scale per tensor": _per_tensor,
    "NVFP4 along features": lambda g: Q.nvfp4_fake_quantize(g, axis=1),
    "MXFP4 along features, scale up": _mx("up"),
    "MXFP4 along features, scale floor": _mx("floor"),
    "NVFP4 along tokens": lambda g: Q.nvfp4_fake_quantize(g, axis=0),
    "NVFP4 along tokens, Hadamard": _tokens_hadamard,
}
"""How the 4-bit recipes could store a matmul-output gradient (tokens, features)."""


def output_gradients(params32: Any, x: Any, y: Any, model: gpt.GPTConfig) -> dict[str, Any]:
    """name -> the loss's gradient with respect to that linear layer's output, (tokens, N)."""
    batch, seq = x.shape
    params = dict(params32)
    params["blocks"] = [
        {
            k: jnp.broadcast_to(v, (batch, seq, v.shape[-1])) if k in LINEAR_BIASES else v
            for k, v in block.items()
        }
        for block in params32["blocks"]
    ]
    with jax.numpy_rank_promotion("allow"):
        grads = jax.jit(jax.grad(gpt.loss_fn), static_argnums=3)(params, x, y, model)
    return {
        f"block {i} {name[:-2]}": np.asarray(block[name]).reshape(batch * seq, -1)
        for i, block in enumerate(grads["blocks"])
        for name in LINEAR_BIASES
    }


def scaling_errors(gradients: dict[str, Any]) -> dict[str, dict[str, tuple[float, float]]]:
    """scaling -> layer -> (relative error, fraction of nonzero entries flushed to zero)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for scaling, quantize in SCALINGS.items():
        fn = jax.jit(quantize)
        for layer, g in gradients.items():
            q = np.asarray(fn(jnp.asarray(g)), np.float64)
            g64 = np.asarray(g, np.float64)
            error = float(np.linalg.norm(q - g64) / np.linalg.norm(g64))
            nonzero = g64 != 0
            flushed = float(np.mean(q[nonzero] == 0)) if nonzero.any() else 0.0
            out.setdefault(scaling, {})[layer] = (error, flushed)
    return out


def error_table(errors: dict[str, dict[str, tuple[float, float]]], per_layer: bool) -> str:
    """Markdown: per scaling, mean relative error and flushed fraction over the layers (and
    the range over the layers)."""
    lines = [
        "| scaling | relative error, mean (min-max) | flushed to zero, mean (min-max) |",
        "| --- | --- | --- |",
    ]
    for scaling, layers in errors.items():
        e = np.array([v[0] for v in layers.values()])
        f = np.array([v[1] for v in layers.values()])
        lines.append(
            f"| {scaling} | {e.mean():.3f} ({e.min():.3f}-{e.max():.3f}) | "
            f"{f.mean():.1%} ({f.min():.1%}-{f.max():.1%}) |"
        )
    if per_layer:
        names = list(next(iter(errors.values())))
        lines += ["", "| layer | " + " | ".join(errors) + " |"]
        lines.append("| --- | " + " | ".join("---" for _ in errors) + " |")
        for layer in names:
            cells = [f"{errors[s][layer][0]:.3f}" for s in errors]
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_errors(errors: dict[str, dict[str, tuple[float, float]]], path: str | Path) -> Any:
    """Relative error of each matmul-output gradient (x: layers in program order) under each
    scaling, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.6, 4.6))
    layers = list(next(iter(errors.values())))
    for scaling, values in errors.items():
        ax.plot(range(len(layers)), [values[name][0] for name in layers], "o-", label=scaling)
    ax.set_xticks(range(len(layers)), layers, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("||q(g) - g|| / ||g||")
    ax.set_title("4-bit storage of the matmul-output gradients (GPT, first step)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="as train.py's")
    parser.add_argument("--out-dir", type=Path, default=IMAGES, help="where the PNGs go")
    parser.add_argument("--n-layer", type=int, default=4, help="depth (the experiment's: 4)")
    parser.add_argument("--per-layer", action="store_true", help="also the error per layer")
    args = parser.parse_args(argv)

    text = datasets.tinyshakespeare(args.data_dir)
    config = train.TrainConfig(n_layer=args.n_layer)
    params32, x, y, model = ranges.first_batch(text, config)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def loss(p: Any, tokens: Any, targets: Any) -> Any:
        return gpt.loss_fn(p, tokens, targets, model)

    grad = jax.grad(loss)
    grad.__name__ = "grad_float32"  # the chart's title
    formats = ("float4_e2m1fn", "float8_e4m3fn")
    with jax.numpy_rank_promotion("allow"):
        table = jsa.analysis.tensor_ranges(grad, params32, x, y, formats=formats, scaled=False)
    print(f"float32 gradient program: {len(table.rows)} tensors")
    for phase in ("forward", "backward"):
        rows = table.select(phase)
        cells = [
            f"{fmt}: {ranges.flushed_fraction(rows, fmt):.1%} of elements flush to zero"
            for fmt in formats
        ]
        print(f"  {phase} ({len(rows)} tensors): " + "; ".join(cells))
    path = args.out_dir / "gpt_ranges_fp4_e2m1.png"
    jsa.analysis.plot_ranges(table, "float4_e2m1fn", path=path)
    print(f"  wrote {path}\n")

    errors = scaling_errors(output_gradients(params32, x, y, model))
    print(error_table(errors, args.per_layer))
    path = args.out_dir / "gpt_fp4_gradient_error.png"
    plot_errors(errors, path)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
