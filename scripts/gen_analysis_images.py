"""Generate docs/images/gpt_ranges_float16.png: the data range of every tensor of a char GPT's
gradient, computed with scaled float16 parameters (see docs/analysis.md).

Usage:
    python scripts/gen_analysis_images.py                 # write the image, print the summary
    python scripts/gen_analysis_images.py --rows 20       # also print the 20 worst rows
    python scripts/gen_analysis_images.py --output x.png  # write elsewhere
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jax_scaled_arithmetics as jsa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "gpt"))

from model import GPTConfig, init_params, loss_fn  # noqa: E402

DEFAULT_OUTPUT = ROOT / "docs" / "images" / "gpt_ranges_float16.png"
BATCH = 16


def gpt_ranges(batch: int = BATCH, seed: int = 0) -> jsa.analysis.RangeTable:
    """The range table of `jax.grad(loss_fn)` for a 2-layer char GPT in scaled float16."""
    config = GPTConfig(n_layer=2)
    key_params, key_tokens, key_targets = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = jsa.as_scaled_array(init_params(key_params, config), dtype=jnp.float16)
    shape = (batch, config.block_size)
    tokens = jax.random.randint(key_tokens, shape, 0, config.vocab_size, jnp.int32)
    targets = jax.random.randint(key_targets, shape, 0, config.vocab_size, jnp.int32)

    def grad_loss_fn(params: Any, tokens: jax.Array, targets: jax.Array) -> Any:
        return jax.grad(loss_fn)(params, tokens, targets, config)

    return jsa.analysis.tensor_ranges(grad_loss_fn, params, tokens, targets)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--format", default="float8_e4m3fn", help="format drawn in the plot")
    parser.add_argument("--rows", type=int, default=0, help="also print the N worst rows")
    args = parser.parse_args(argv)

    table = gpt_ranges()
    if args.rows:
        print(table.to_text(args.rows, by="clipped", format=args.format))
    else:
        print(table.summary_text())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    jsa.analysis.plot_ranges(table, args.format, path=args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
