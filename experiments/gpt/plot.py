"""Plot the experiments' JSON logs and print their final numbers as markdown tables.

- GPT (`experiments/gpt/train.py --out-dir DIR`): the validation-loss curves of every mode
  on one figure, `docs/images/gpt_val_loss.png`, and a table of final validation losses.
- MNIST (`experiments/mnist/train_mlp.py` / `train_cnn.py --out-dir DIR`): the test-accuracy
  curves, one panel per model, `docs/images/mnist_accuracy.png`, and a table of final
  accuracies.

Run: python experiments/gpt/plot.py --gpt-logs experiments/results/gpt \\
         --mnist-logs experiments/results/mnist
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGES = REPO_ROOT / "docs" / "images"
GPT_MODES = (
    "fp32",
    "bf16",
    "fp8-plain",
    "scaled-fp16",
    "scaled-fp8",
    "scaled-fp8-rowwise",
    "scaled-mxfp8",
    "unit-scaled-fp8",
)
MNIST_MODES = (
    "fp32",
    "mixed-fp16",
    "scaled-fp16",
    "scaled-bf16",
    "plain-bf16",
    "plain-fp16",
    "fp8-plain",
    "scaled-fp8",
)
STYLE = {  # mode -> (colour, line style)
    "fp32": ("black", "-"),
    "bf16": ("tab:brown", "-"),
    "mixed-fp16": ("tab:brown", "-"),
    "fp8-plain": ("tab:red", "--"),
    "scaled-fp16": ("tab:blue", "-"),
    "scaled-bf16": ("tab:cyan", "-"),
    "scaled-fp8": ("tab:green", "-"),
    "scaled-fp8-rowwise": ("tab:olive", "--"),
    "scaled-mxfp8": ("tab:pink", "-"),
    "unit-scaled-fp8": ("tab:purple", "-."),
    "plain-bf16": ("tab:olive", ":"),
    "plain-fp16": ("tab:orange", ":"),
    "nvfp4": ("tab:green", "-"),
    "nvfp4-no-hadamard": ("tab:olive", "--"),
    "nvfp4-nearest": ("tab:orange", "--"),
    "nvfp4-1d-weights": ("tab:cyan", "--"),
    "nvfp4-all-layers": ("tab:purple", "--"),
    "mxfp4": ("tab:blue", "-"),
    "mxfp4-floor": ("tab:pink", "-."),
    "fp4-tensor": ("tab:red", ":"),
}


def load_logs(folder: str | Path, experiment_prefix: str) -> list[dict[str, Any]]:
    """The JSON logs in `folder` whose `experiment` starts with `experiment_prefix`."""
    logs = []
    for path in sorted(Path(folder).glob("*.json")):
        log = json.loads(path.read_text())
        if str(log.get("experiment", "")).startswith(experiment_prefix):
            logs.append(log)
    return logs


def _order(logs: list[dict[str, Any]], modes: Sequence[str]) -> list[dict[str, Any]]:
    rank = {m: i for i, m in enumerate(modes)}
    return sorted(logs, key=lambda log: (rank.get(log["mode"], len(rank)), log["mode"]))


def _style(mode: str) -> dict[str, Any]:
    colour, line = STYLE.get(mode, ("grey", "-"))
    return {"color": colour, "linestyle": line}


def _figure(ncols: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6.4 * ncols, 4.4), squeeze=False)
    return fig, axes[0]


def _text(x: float | None, missing: str = "nan") -> str:
    return missing if x is None else f"{x:.3f}"


def _finite(values: Sequence[Any]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def plot_gpt(logs: list[dict[str, Any]], path: str | Path) -> Any:
    """Validation loss against step, one line per mode (left), and its difference from
    fp32's at the same step (right, when an fp32 log is there); saved to `path`."""
    base = next((log for log in logs if log["mode"] == "fp32"), None)
    fig, axes = _figure(2 if base is not None else 1)
    ax = axes[0]
    for log in _order(logs, GPT_MODES):
        label = f"{log['mode']} (lr {log['lr']:g}): {_text(log['final_val_loss'])}"
        ax.plot(log["val_steps"], _finite(log["val_loss"]), label=label, **_style(log["mode"]))
    if logs:
        c = logs[0]["config"]
        ax.set_title(
            f"char GPT on tiny-shakespeare: {c['n_layer']} layers, width {c['n_embd']}, "
            f"context {c['block_size']}, batch {c['batch_size']}",
            fontsize=10,
        )
        finals = [log["final_val_loss"] for log in logs if log["final_val_loss"] is not None]
        if finals:  # zoom on the end of training, where the modes differ
            ax.set_ylim(min(finals) - 0.1, min(finals) + 1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats / character)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if base is not None:
        ax = axes[1]
        reference = dict(zip(base["val_steps"], _finite(base["val_loss"])))
        for log in _order(logs, GPT_MODES):
            steps = [s for s in log["val_steps"] if s in reference and s > 0]
            values = dict(zip(log["val_steps"], _finite(log["val_loss"])))
            ax.plot(
                steps,
                [values[s] - reference[s] for s in steps],
                label=log["mode"],
                **_style(log["mode"]),
            )
        ax.axhspan(-0.05, 0.05, color="tab:green", alpha=0.12, label="within 0.05 nats")
        ax.set_ylim(-0.15, 0.4)
        ax.set_title("validation loss minus fp32's, same step and batches", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("difference (nats / character)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def plot_mnist(logs: list[dict[str, Any]], path: str | Path) -> Any:
    """Test accuracy against step, one panel per model (mlp, cnn); saved to `path`."""
    models = sorted({log["model"] for log in logs}, key=lambda m: (m != "mlp", m))
    fig, axes = _figure(max(len(models), 1))
    for ax, model in zip(axes, models):
        runs = _order([log for log in logs if log["model"] == model], MNIST_MODES)
        best = 0.0
        for log in runs:
            accuracy = [100 * a for a in log["curve_accuracy"]]
            best = max([best, *accuracy])
            label = f"{log['mode']}: {100 * log['accuracy']:.2f}%"
            ax.plot(log["curve_steps"], accuracy, label=label, **_style(log["mode"]))
        ax.set_ylim(max(best - 8, 0), min(best + 1, 100))
        ax.set_title(f"MNIST {model.upper()}: test accuracy (last 2,000 test images)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def gpt_table(logs: list[dict[str, Any]]) -> str:
    """Markdown: mode, lr, steps, final validation loss (and its difference from fp32), the
    same with the mode's own numerics, tokens/s and wall time."""
    base = next((log["final_val_loss"] for log in logs if log["mode"] == "fp32"), None)
    lines = [
        "| mode | lr | steps | final val loss | vs fp32 | own numerics | tokens/s | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for log in _order(logs, GPT_MODES):
        loss = log["final_val_loss"]
        delta = "" if base is None or loss is None else f"{loss - base:+.3f}"
        own = log.get("final_val_loss_own_numerics")
        lines.append(
            f"| `{log['mode']}` | {log['lr']:g} | {log['steps']} | {_text(loss)} | {delta} | "
            f"{_text(own, '-')} | {log['tokens_per_s']:,.0f} | {log['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def mnist_table(logs: list[dict[str, Any]]) -> str:
    """Markdown: model, mode, steps, final test accuracy (and its difference from the same
    model's fp32), the first step (counted from 1) whose loss is NaN, training time."""
    base = {log["model"]: log["accuracy"] for log in logs if log["mode"] == "fp32"}
    lines = [
        "| model | mode | steps | test accuracy | vs fp32 (points) | loss NaN from step | s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    models = sorted({log["model"] for log in logs}, key=lambda m: (m != "mlp", m))
    for model in models:
        for log in _order([g for g in logs if g["model"] == model], MNIST_MODES):
            acc = 100 * log["accuracy"]
            delta = f"{acc - 100 * base[model]:+.2f}" if model in base else ""
            # 1-based: the step whose loss is the first NaN
            nan = "-" if log["first_nan_step"] is None else str(log["first_nan_step"] + 1)
            lines.append(
                f"| {model} | `{log['mode']}` | {log['steps']} | {acc:.2f}% | {delta} | {nan} | "
                f"{log['wall_s']:.0f} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt-logs", type=Path, default=None, help="folder of GPT JSON logs")
    parser.add_argument("--mnist-logs", type=Path, default=None, help="folder of MNIST logs")
    parser.add_argument("--out-dir", type=Path, default=IMAGES, help="where the PNGs go")
    args = parser.parse_args(argv)
    if args.gpt_logs is None and args.mnist_logs is None:
        parser.error("give --gpt-logs and/or --mnist-logs")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.gpt_logs is not None:
        logs = load_logs(args.gpt_logs, "gpt")
        if not logs:
            raise SystemExit(f"no GPT logs in {args.gpt_logs}")
        path = args.out_dir / "gpt_val_loss.png"
        plot_gpt(logs, path)
        print(gpt_table(logs))
        print(f"\nwrote {path}\n")
    if args.mnist_logs is not None:
        logs = load_logs(args.mnist_logs, "mnist")
        if not logs:
            raise SystemExit(f"no MNIST logs in {args.mnist_logs}")
        path = args.out_dir / "mnist_accuracy.png"
        plot_mnist(logs, path)
        print(mnist_table(logs))
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
