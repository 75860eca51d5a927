"""Plot the learning-rate sweeps of `char_gpt.py` across widths (hyperparameter transfer):
final validation loss against learning rate, one curve per width, one panel per
parametrisation (standard: `--mode fp32`, tag `-sp`; u-muP: `--mode unit --umup`, tag
`-umup`), and print the best learning rate of each width and its shift per doubling.

Run: python experiments/unit_scaling/plot_transfer.py \\
         --runs experiments/results/unit-scaling/transfer \\
         --out docs/images/unit_scaling_transfer.png
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PARAMETRISATIONS = {"sp": "standard (nanoGPT init, Adam)", "umup": "u-muP (U.unit_scale + U.optim)"}


def load(runs: Path) -> dict[str, dict[tuple[int, int], dict[float, float | None]]]:
    """{parametrisation: {(width, depth): {lr: final validation loss}}}."""
    table: dict[str, dict[tuple[int, int], dict[float, float | None]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for path in sorted(runs.glob("*.json")):
        run = json.loads(path.read_text())
        name = "umup" if run.get("umup") else "sp"
        config = run["config"]
        key = (config["n_embd"], config["n_layer"])
        table[name][key][run["lr"]] = run["final_val_loss"]
    return table


def best(curve: dict[float, float | None]) -> tuple[float, float]:
    finite = {lr: loss for lr, loss in curve.items() if loss is not None and math.isfinite(loss)}
    lr = min(finite, key=finite.__getitem__)
    return lr, finite[lr]


def summary(table: dict[str, Any]) -> list[str]:
    lines = []
    for name, curves in table.items():
        optima = {key: best(curve) for key, curve in sorted(curves.items())}
        for (width, depth), (lr, loss) in optima.items():
            lines.append(f"{name} width {width} depth {depth}: best lr {lr:g}, loss {loss:.3f}")
        for depth in sorted({d for _, d in optima}):
            widths = sorted(w for w, d in optima if d == depth)
            if len(widths) >= 2:
                first, last = optima[(widths[0], depth)][0], optima[(widths[-1], depth)][0]
                shift = math.log2(last / first)
                doublings = math.log2(widths[-1] / widths[0])
                lines.append(
                    f"{name} depth {depth}: optimum moves {shift:+.0f} factor-2 steps from width "
                    f"{widths[0]} to {widths[-1]} ({shift / doublings:+.2f} per width doubling)"
                )
        for width in sorted({w for w, _ in optima}):
            depths = sorted(d for w, d in optima if w == width)
            if len(depths) >= 2:
                first, last = optima[(width, depths[0])][0], optima[(width, depths[-1])][0]
                lines.append(
                    f"{name} width {width}: optimum moves {math.log2(last / first):+.0f} "
                    f"factor-2 steps from depth {depths[0]} to {depths[-1]}"
                )
    return lines


def plot(table: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(5.5 * len(table), 4), squeeze=False)
    for ax, name in zip(axes[0], sorted(table, reverse=True), strict=True):
        for (width, depth), curve in sorted(table[name].items()):
            lrs = sorted(curve)
            losses = [curve[lr] if curve[lr] is not None else float("nan") for lr in lrs]
            ax.plot(lrs, losses, marker="o", label=f"width {width}, depth {depth}")
            lr, loss = best(curve)
            ax.plot([lr], [loss], marker="*", markersize=14, color=ax.lines[-1].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learning rate" if name == "sp" else "learning rate (u-muP global)")
        ax.set_ylabel("final validation loss (300 steps)")
        ax.set_title(PARAMETRISATIONS.get(name, name))
        ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    table = load(args.runs)
    lines = summary(table)
    print("\n".join(lines))
    if args.out is not None:
        plot(table, args.out)
    return lines


if __name__ == "__main__":
    main()
