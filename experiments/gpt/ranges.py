"""Range charts (`jsa.analysis`) of the default GPT's training gradient in `fp8-plain` and
`scaled-fp8`: where every tensor of the forward and backward pass lies in FP8's range.

The model, initialisation and first batch are those of `train.py`'s default config (seed 0,
the first training batch of tiny-shakespeare). For each mode the gradient program is
analysed as the mode trains it:

- `fp8-plain`: `jax.grad(jsa.ops.simulate_fp8(loss))` on the float32 parameters (plain arrays:
  every scale is 1, the data are the values);
- `scaled-fp8`: `jax.grad(jsa.ops.simulate_fp8(loss, rescale=True))` on the float16 ScaledArray
  parameters, under `jsa.autoscale` (the data are what FP8 would store).

Writes `docs/images/gpt_ranges_fp8_plain.png` and `docs/images/gpt_ranges_scaled_fp8.png`
(drawn against E5M2, the backward format: an orange dot is a tensor of which more than 1% of
the nonzero elements flush to zero in E5M2) and prints, per mode and pass, how many tensors
lose elements and the fraction of the elements that flush to zero; the fraction of the
matmul-output gradients that flush to zero at the E5M2 casts (measured with the casts left
out, `backward_format="float32"`, so that no earlier flush hides values); and the fraction
of the parameter gradients' entries that would flush to zero in E5M2; and, per block, how
much of the query, key and value weights' gradients is left, against float32's.

Run: python experiments/gpt/ranges.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled_arithmetics as jsa

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

from experiments import data as datasets  # noqa: E402
from experiments.gpt import model as gpt  # noqa: E402
from experiments.gpt import train  # noqa: E402

FORMATS = ("float8_e4m3fn", "float8_e5m2")
IMAGES = REPO_ROOT / "docs" / "images"
MODES = ("fp8-plain", "scaled-fp8")


def first_batch(text: str, config: train.TrainConfig) -> tuple[Any, Any, gpt.GPTConfig, Any]:
    """The float32 parameters, the first training batch and the model config of `train.py`."""
    corpus = train.CharData.from_text(text)
    model = config.model(len(corpus.vocab))
    params32 = train._init_params(jax.random.PRNGKey(config.seed), model)
    offsets = train.train_offsets(len(corpus.train), config)[0]
    x, y = train.windows(corpus.train, offsets, config.block_size)
    return params32, x, y, model


def analyse(
    mode: str,
    params32: Any,
    x: Any,
    y: Any,
    model: gpt.GPTConfig,
    backward_format: str = "float8_e5m2",
) -> Any:
    """The range table and the parameter gradients of `mode`'s gradient program.

    `backward_format="float32"` keeps the matmul-output gradients unrounded (the backward
    casts are then identities), so that the rows of the casts show what E5M2 would flush
    in each of them, without earlier flushes hiding values."""

    def loss(p: Any, tokens: Any, targets: Any) -> Any:
        return gpt.loss_fn(p, tokens, targets, model)

    if mode == "fp8-plain":
        params = params32
        fp8_loss = jsa.ops.simulate_fp8(loss, backward_format=backward_format)
    elif mode == "scaled-fp8":
        params = train._to_scaled_fp16(params32)
        fp8_loss = jsa.ops.simulate_fp8(loss, backward_format=backward_format, rescale=True)
    else:
        raise ValueError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")
    grad = jax.grad(fp8_loss)
    grad.__name__ = f"grad_{mode.replace('-', '_')}"  # the charts' title
    with jax.numpy_rank_promotion("allow"):
        table = jsa.analysis.tensor_ranges(
            grad, params, x, y, formats=FORMATS, scaled=mode != "fp8-plain"
        )
        grads = jax.jit(jsa.autoscale(grad))(params, x, y)
    return table, grads


def cast_rows(table: Any) -> list[Any]:
    """The rows of the backward casts of the matmul-output gradients: `simulate_fp8` applies
    them to the data (`apply_to_data`), one per matmul."""
    return [r for r in table.select("backward") if r.primitive == "apply_to_data"]


def flushed_fraction(rows: Sequence[Any], fmt: str) -> float:
    """Fraction of the elements of `rows` that flush to zero in `fmt`, weighting each row's
    flushed fraction (of its nonzero elements) by its size."""
    sizes = [math.prod(r.shape) for r in rows]
    total = sum(sizes)
    return sum(r.flush[fmt] * n for r, n in zip(rows, sizes)) / total if total else math.nan


def gradient_flush(grads: Any, fmt: str = "float8_e5m2") -> float:
    """Fraction of the nonzero parameter-gradient entries (their stored data) that round to
    zero in `fmt` (magnitude at most half its smallest subnormal)."""
    tiny = float(jnp.finfo(jnp.dtype(fmt)).smallest_subnormal) / 2
    leaves = jax.tree_util.tree_leaves(grads, is_leaf=jsa.is_scaled_leaf)
    data = [
        np.abs(np.asarray(g.data if isinstance(g, jsa.ScaledArray) else g, np.float64))
        for g in leaves
    ]
    values = np.concatenate([d.ravel() for d in data])
    nonzero = values[values > 0]
    return float(np.mean(nonzero <= tiny)) if nonzero.size else math.nan


def float32_gradients(params32: Any, x: Any, y: Any, model: gpt.GPTConfig) -> Any:
    """The plain float32 parameter gradients (the reference of :func:`attention_gradients`)."""
    with jax.numpy_rank_promotion("allow"):
        return jax.jit(jax.grad(gpt.loss_fn), static_argnums=3)(params32, x, y, model)


def attention_gradients(grads: Any, reference: Any) -> list[str]:
    """Per block, for the query, key and value columns of the `qkv` weight's gradient: the
    fraction of exactly zero entries and the norm relative to the float32 gradient's."""
    lines = []
    for i, (block, ref) in enumerate(zip(grads["blocks"], reference["blocks"])):
        g = np.asarray(jsa.asarray(block["qkv"], jnp.float32), np.float64)
        r = np.asarray(ref["qkv"], np.float64)
        width = g.shape[1] // 3
        cells = []
        for j, name in enumerate(("query", "key", "value")):
            part, ref_part = g[:, j * width : (j + 1) * width], r[:, j * width : (j + 1) * width]
            ratio = np.linalg.norm(part) / np.linalg.norm(ref_part)
            cells.append(f"{name} {np.mean(part == 0):.0%} zero, norm x{ratio:.2f}")
        lines.append(f"  block {i} qkv weight gradient vs float32: " + "; ".join(cells))
    return lines


def report(mode: str, table: Any, grads: Any, unrounded: Any, reference: Any = None) -> str:
    """Per pass: tensors losing more than 1% and the fraction of elements that flush, in
    each format; the E5M2 flush of the matmul-output gradients (from `unrounded`, the
    table with float32 backward casts) and of the parameter gradients."""
    lines = [f"{mode}: {len(table.rows)} tensors"]
    for phase in ("forward", "backward"):
        rows = table.select(phase)
        cells = []
        for fmt in FORMATS:
            lossy = sum(r.flush[fmt] > 0.01 for r in rows)
            cells.append(
                f"{fmt}: {lossy} tensors flush >1%, {flushed_fraction(rows, fmt):.1%} of "
                "elements flush"
            )
        lines.append(f"  {phase} ({len(rows)} tensors): " + "; ".join(cells))
    casts = cast_rows(unrounded)
    e5m2 = [r.flush["float8_e5m2"] for r in casts]
    lines.append(
        f"  matmul-output gradients at the {len(casts)} E5M2 casts: "
        f"{flushed_fraction(casts, 'float8_e5m2'):.1%} of the elements flush to zero "
        f"(per cast: {', '.join(f'{100 * f:.0f}%' for f in e5m2)})"
    )
    lines.append(
        f"  parameter gradients: {gradient_flush(grads):.1%} of nonzero entries flush to zero "
        "in float8_e5m2"
    )
    if reference is not None:
        lines += attention_gradients(grads, reference)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="as train.py's")
    parser.add_argument("--out-dir", type=Path, default=IMAGES, help="where the PNGs go")
    parser.add_argument("--format", default="float8_e5m2", help="format drawn in the charts")
    parser.add_argument("--rows", type=int, default=0, help="also print the N worst rows")
    args = parser.parse_args(argv)

    text = datasets.tinyshakespeare(args.data_dir)
    params32, x, y, model = first_batch(text, train.TrainConfig())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    reference = float32_gradients(params32, x, y, model)
    for mode in MODES:
        table, grads = analyse(mode, params32, x, y, model)
        unrounded, _ = analyse(mode, params32, x, y, model, backward_format="float32")
        print(report(mode, table, grads, unrounded, reference))
        if args.rows:
            print(table.to_text(args.rows, by="flush", format=args.format))
        path = args.out_dir / f"gpt_ranges_{mode.replace('-', '_')}.png"
        jsa.analysis.plot_ranges(table, args.format, path=path)
        print(f"  wrote {path}")


if __name__ == "__main__":
    main()
