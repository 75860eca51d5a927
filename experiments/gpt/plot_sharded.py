"""Plot the sharded GPT runs of `train_sharded.py`: validation loss against step for each
recipe on 1 and 8 devices (left), and the 8-device run minus the 1-device run (right);
print the largest difference per recipe as a markdown table.

Run: python experiments/gpt/plot_sharded.py --logs experiments/results/sharded
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("fp32", "bf16", "fp8-fsdp")


def load(logs: Path, recipe: str, devices: int) -> dict[str, Any] | None:
    path = logs / f"{recipe}-{devices}dev.json"
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logs", type=Path, default=REPO_ROOT / "experiments/results/sharded")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs/images/sharded_gpt.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, diffs) = plt.subplots(1, 2, figsize=(11, 4))
    rows = ["| recipe | final val, 1 device | 8 devices | largest abs. difference (step) |"]
    rows.append("| --- | ---: | ---: | ---: |")
    for recipe in RECIPES:
        one, eight = load(args.logs, recipe, 1), load(args.logs, recipe, 8)
        if one is None or eight is None:
            continue
        (line,) = curves.plot(one["val_steps"], one["val_loss"], label=f"{recipe}, 1 device")
        curves.plot(
            eight["val_steps"],
            eight["val_loss"],
            "--",
            color=line.get_color(),
            label=f"{recipe}, 8",
        )
        delta = [b - a for a, b in zip(one["val_loss"], eight["val_loss"])]
        diffs.plot(one["val_steps"], delta, color=line.get_color(), label=recipe)
        worst = max(range(len(delta)), key=lambda i: abs(delta[i]))
        rows.append(
            f"| {recipe} | {one['final_val_loss']:.4f} | {eight['final_val_loss']:.4f} | "
            f"{abs(delta[worst]):.4f} ({one['val_steps'][worst]}) |"
        )
    curves.set(xlabel="step", ylabel="validation loss (nats)", ylim=(2.2, 3.4))
    curves.legend(fontsize=7)
    diffs.axhline(0.01, color="gray", lw=0.5, ls=":")
    diffs.axhline(-0.01, color="gray", lw=0.5, ls=":")
    diffs.set(xlabel="step", ylabel="8 devices - 1 device (nats)", ylim=(-0.02, 0.02))
    diffs.legend(fontsize=7)
    fig.suptitle("char GPT, FSDP over a mesh: 8 simulated CPU devices against 1")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    table = "\n".join(rows)
    print(table)
    return table


if __name__ == "__main__":
    main()
