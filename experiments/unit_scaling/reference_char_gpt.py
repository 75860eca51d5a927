"""The PyTorch twin of `char_gpt.py`, trained with the reference library (`unit-scaling`,
Graphcore's PyTorch unit scaling, 0.3.x): the same model, data, batches and optimiser.

The one difference from `char_gpt.py`'s model: the embedding sum is written `Tensor.add`
(see `CharGPT.forward`), which the reference's transform leaves as a plain sum.

Needs `torch` and `unit-scaling` (not dependencies of this project; e.g. in a separate venv:
`pip install torch unit-scaling==0.3.5 numpy`). No JAX needed.

Modes:
    fp32       nanoGPT's initialisation, float32.
    unit       `unit_scaling.transforms.unit_scale(model)` (which also unit-scales the
               weights and zeroes the biases).
    unit-fp8   `simulate_fp8(unit_scale(model))`.

Run: python experiments/unit_scaling/reference_char_gpt.py --data-dir ../shared/data \\
         --mode fp32 unit unit-fp8 --out-dir experiments/results/unit-scaling
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from experiments.unit_scaling.chardata import Config, batch_offsets, char_ids  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)
        causal = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("causal", causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (
            t.view(batch, seq, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_head)
        scores = scores.masked_fill(~self.causal[:seq, :seq], float("-inf"))
        out = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq, d)
        x = x + self.proj(out)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        d = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.block_size, d)
        self.blocks = nn.ModuleList(
            Block(d, config.n_head, config.block_size) for _ in range(config.n_layer)
        )
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 2:
                std = proj_std if name.endswith(("proj.weight", "fc_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1])
        # `Tensor.add`, not `+`: the reference's `unit_scale` replaces a non-residual `+`
        # (this one) by its `U.add`, after which it no longer finds the residual adds that
        # follow (they read the replaced node) and fails with "add() got multiple values
        # for argument 'constraint'" (unit-scaling 0.3.5, torch 2.4 and 2.14).
        x = self.wte(tokens).add(self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def windows(ids: np.ndarray, offsets: np.ndarray, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = offsets[..., None] + np.arange(block)
    return torch.from_numpy(ids[index]).long(), torch.from_numpy(ids[index + 1]).long()


def train(mode: str, lr: float, config: Config, text: str) -> dict[str, Any]:
    from unit_scaling.transforms import simulate_fp8, unit_scale

    torch.manual_seed(config.seed)
    train_ids, val_ids, vocab = char_ids(text)
    config = dataclasses.replace(config, vocab_size=vocab)
    model: nn.Module = CharGPT(config)
    if mode != "fp32":
        model = unit_scale(model)
    if mode == "unit-fp8":
        model = simulate_fp8(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(config.b1, config.b2))
    train_off, val_off = batch_offsets(len(train_ids), len(val_ids), config)
    val_batches = [windows(val_ids, o, config.block_size) for o in val_off]

    def evaluate() -> float:
        with torch.no_grad():
            return float(np.mean([float(model(x, y)) for x, y in val_batches]))

    curve = [(0, evaluate())]
    train_curve = []
    start = time.perf_counter()
    for i in range(config.steps):
        x, y = windows(train_ids, train_off[i], config.block_size)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        train_curve.append(float(loss))
        if (i + 1) % config.eval_every == 0 or i + 1 == config.steps:
            curve.append((i + 1, evaluate()))
            print(f"reference {mode} lr={lr:g} step {i + 1}: val {curve[-1][1]:.3f}", flush=True)
    return {
        "mode": f"reference-{mode}",
        "lr": lr,
        "config": dataclasses.asdict(config),
        "val_curve": curve,
        "train_curve": train_curve,
        "final_val_loss": curve[-1][1],
        "wall_s": time.perf_counter() - start,
        "versions": {"torch": torch.__version__, "unit_scaling": _version("unit-scaling")},
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def read_text(data_dir: str) -> str:
    folder = Path(data_dir)
    for candidate in (folder / "tinyshakespeare", folder):
        if (candidate / "input.txt").exists():
            return (candidate / "input.txt").read_text(encoding="utf-8")
        if (candidate / "input.txt.gz").exists():
            return gzip.decompress((candidate / "input.txt.gz").read_bytes()).decode("utf-8")
    raise FileNotFoundError(f"no tiny-shakespeare input.txt(.gz) under {data_dir}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", nargs="+", default=["unit"], choices=("fp32", "unit", "unit-fp8"))
    parser.add_argument("--lr", type=float, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--tag", default="", help="added to the log's file name")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    config = Config(steps=args.steps, seed=args.seed)
    text = read_text(args.data_dir)
    for mode in args.mode:
        for lr in args.lr or [1e-3 if mode == "fp32" else 2e-2]:
            result = train(mode, lr, config, text)
            print(
                f"reference {mode} lr={lr:g}: final validation loss {result['final_val_loss']:.4f}"
            )
            if args.out_dir:
                out = Path(args.out_dir)
                out.mkdir(parents=True, exist_ok=True)
                name = (
                    f"reference-{mode}{args.tag}-d{config.n_embd}-l{config.n_layer}-lr{lr:g}.json"
                )
                (out / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
