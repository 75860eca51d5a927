"""The 4-bit training ablation: tables and plots from `train.py --mode fp4` logs, one folder
per seed.

Prints two markdown tables: the final validation loss of every mode on every seed with its
relative difference from the same seed's fp32 (and whether the issue's targets hold: full
NVFP4 within 1.5%, full MXFP4 within 3%, on every seed; naive per-tensor FP4 at least 5x
the full NVFP4 recipe's gap), and each ingredient's effect (the ablated mode minus the full
recipe, mean over seeds). Writes `docs/images/gpt_fp4_val_loss.png`: the validation-loss
curves of the first folder's seed (left) and every mode's difference from fp32, mean over
the seeds (right).

Run: python experiments/gpt/plot_fp4.py experiments/results/gpt-fp4 \\
         experiments/results/gpt-fp4-seed1 experiments/results/gpt-fp4-seed2
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

from experiments.gpt import plot  # noqa: E402

FP4_MODES = (
    "fp32",
    "nvfp4",
    "nvfp4-no-hadamard",
    "nvfp4-nearest",
    "nvfp4-1d-weights",
    "nvfp4-all-layers",
    "mxfp4",
    "mxfp4-floor",
    "fp4-tensor",
)
ABLATIONS = {  # ablated mode -> (full recipe, what is removed)
    "nvfp4-no-hadamard": ("nvfp4", "no random Hadamard transform"),
    "nvfp4-nearest": ("nvfp4", "gradients rounded to nearest, not stochastically"),
    "nvfp4-1d-weights": ("nvfp4", "1D (16x1) weight blocks, not 16x16"),
    "nvfp4-all-layers": ("nvfp4", "first and last linear layers in 4 bits too"),
    "mxfp4-floor": ("mxfp4", "E8M0 scales rounded down (OCP), not up"),
    "fp4-tensor": ("nvfp4", "naive: one scale per tensor, nothing else of the recipe"),
}
TARGETS = {"nvfp4": 0.015, "mxfp4": 0.03}
"""Largest relative difference from fp32's final validation loss, on every seed."""
NAIVE_FACTOR = 5.0
"""Naive per-tensor FP4's gap must be at least this many times the full NVFP4 recipe's."""


def load_seeds(folders: Sequence[str | Path]) -> dict[int, dict[str, dict[str, Any]]]:
    """seed -> mode -> log, from the GPT logs of each folder."""
    runs: dict[int, dict[str, dict[str, Any]]] = {}
    for folder in folders:
        for log in plot.load_logs(folder, "gpt"):
            if log["mode"] in FP4_MODES:
                runs.setdefault(log["config"]["seed"], {})[log["mode"]] = log
    return runs


def relative_gaps(runs: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[int, float]]:
    """mode -> seed -> (final val loss - fp32's) / fp32's, where both are there."""
    gaps: dict[str, dict[int, float]] = {}
    for seed, logs in runs.items():
        base = logs.get("fp32", {}).get("final_val_loss")
        for mode, log in logs.items():
            loss = log["final_val_loss"]
            if base is None or mode == "fp32":
                continue
            gaps.setdefault(mode, {})[seed] = math.inf if loss is None else (loss - base) / base
    return gaps


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def results_table(runs: dict[int, dict[str, dict[str, Any]]]) -> str:
    """Markdown: mode, final validation loss per seed (relative difference from fp32), mean
    gap, target and whether it holds."""
    seeds = sorted(runs)
    gaps = relative_gaps(runs)
    header = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        f"| mode | {header} | mean vs fp32 | target |",
        "| --- | " + " | ".join("---" for _ in seeds) + " | --- | --- |",
    ]
    nvfp4_gap = _mean(list(gaps.get("nvfp4", {}).values()))
    for mode in FP4_MODES:
        if not any(mode in runs[seed] for seed in seeds):
            continue
        cells = []
        for seed in seeds:
            log = runs[seed].get(mode)
            if log is None:
                cells.append("-")
                continue
            loss = log["final_val_loss"]
            gap = gaps.get(mode, {}).get(seed)
            cells.append(plot._text(loss) + ("" if gap is None else f" ({100 * gap:+.2f}%)"))
        mean_gap = _mean(list(gaps.get(mode, {}).values()))
        mean_text = "" if mode == "fp32" else f"{100 * mean_gap:+.2f}%"
        target = ""
        if mode in TARGETS:
            met = len(gaps.get(mode, {})) == len(seeds) and all(
                g <= TARGETS[mode] for g in gaps[mode].values()
            )
            target = f"<= {100 * TARGETS[mode]:.1f}% each seed: {'met' if met else 'missed'}"
        elif mode == "fp4-tensor":
            ratio = mean_gap / nvfp4_gap if nvfp4_gap > 0 else math.inf
            met = mean_gap >= NAIVE_FACTOR * max(nvfp4_gap, 0.0) and mean_gap > 0
            target = f">= {NAIVE_FACTOR:g}x nvfp4's gap: {ratio:.1f}x, {'met' if met else 'missed'}"
        lines.append(f"| `{mode}` | " + " | ".join(cells) + f" | {mean_text} | {target} |")
    return "\n".join(lines)


def ablation_table(runs: dict[int, dict[str, dict[str, Any]]]) -> str:
    """Markdown: each ingredient removed, its effect on the final validation loss (ablated
    minus full recipe, nats, per seed and mean)."""
    seeds = sorted(runs)
    lines = [
        "| removed | mode | " + " | ".join(f"seed {s}" for s in seeds) + " | mean (nats) |",
        "| --- | --- | " + " | ".join("---" for _ in seeds) + " | --- |",
    ]
    for mode, (full, what) in ABLATIONS.items():
        if not any(mode in runs[seed] for seed in seeds):
            continue
        deltas = []
        for seed in seeds:
            a, b = runs[seed].get(mode), runs[seed].get(full)
            if a is None or b is None or a["final_val_loss"] is None:
                deltas.append(None)
            else:
                deltas.append(a["final_val_loss"] - b["final_val_loss"])
        known = [d for d in deltas if d is not None]
        cells = ["-" if d is None else f"{d:+.3f}" for d in deltas]
        lines.append(
            f"| {what} | `{mode}` vs `{full}` | " + " | ".join(cells) + f" | {_mean(known):+.3f} |"
        )
    return "\n".join(lines)


def plot_fp4(runs: dict[int, dict[str, dict[str, Any]]], path: str | Path) -> Any:
    """Left: validation loss per step of the first seed's modes; right: each mode's
    validation loss minus fp32's at the same step, mean over the seeds."""
    fig, axes = plot._figure(2)
    first = sorted(runs)[0]
    ax = axes[0]
    for mode in FP4_MODES:
        log = runs[first].get(mode)
        if log is not None:
            label = f"{mode}: {plot._text(log['final_val_loss'])}"
            ax.plot(
                log["val_steps"], plot._finite(log["val_loss"]), label=label, **plot._style(mode)
            )
    c = next(iter(runs[first].values()))["config"]
    ax.set_title(
        f"char GPT, {c['n_layer']} blocks, width {c['n_embd']}, batch {c['batch_size']}: "
        f"seed {first}",
        fontsize=10,
    )
    finals = [g["final_val_loss"] for g in runs[first].values() if g["final_val_loss"]]
    if finals:
        ax.set_ylim(min(finals) - 0.1, min(finals) + 1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats / character)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    for mode in FP4_MODES[1:]:
        per_seed = []
        for logs in runs.values():
            if mode in logs and "fp32" in logs:
                base = dict(zip(logs["fp32"]["val_steps"], plot._finite(logs["fp32"]["val_loss"])))
                values = dict(zip(logs[mode]["val_steps"], plot._finite(logs[mode]["val_loss"])))
                per_seed.append({s: values[s] - base[s] for s in values if s in base and s > 0})
        if per_seed:
            steps = sorted(set.intersection(*(set(d) for d in per_seed)))
            mean = [_mean([d[s] for d in per_seed]) for s in steps]
            ax.plot(steps, mean, label=f"{mode} ({len(per_seed)} seeds)", **plot._style(mode))
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_title("validation loss minus fp32's, mean over seeds", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("difference (nats / character)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="log folders, one per seed")
    parser.add_argument("--out-dir", type=Path, default=plot.IMAGES, help="where the PNG goes")
    args = parser.parse_args(argv)
    runs = load_seeds(args.folders)
    if not runs:
        raise SystemExit(f"no 4-bit GPT logs in {', '.join(map(str, args.folders))}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "gpt_fp4_val_loss.png"
    plot_fp4(runs, path)
    print(results_table(runs))
    print()
    print(ablation_table(runs))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
