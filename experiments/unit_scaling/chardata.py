"""The char GPT runs' configuration and batches, without JAX (shared with the PyTorch twin)."""

from __future__ import annotations

import dataclasses

import numpy as np

VAL_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class Config:
    """The model, the data and the run."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    batch_size: int = 32
    steps: int = 300
    eval_every: int = 50
    eval_batches: int = 16
    seed: int = 0
    b1: float = 0.9
    b2: float = 0.99


def char_ids(text: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Training and held-out character ids (vocabulary sorted by code point)."""
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((lookup[c] for c in text), dtype=np.int32, count=len(text))
    n_train = int(round(len(ids) * (1 - VAL_FRACTION)))
    return ids[:n_train], ids[n_train:], len(vocab)


def batch_offsets(n_train: int, n_val: int, config: Config) -> tuple[np.ndarray, np.ndarray]:
    """Start positions of the training windows (steps, batch), uniform draws seeded with
    `config.seed`, and of the fixed held-out windows (eval_batches, batch), evenly spaced."""
    rng = np.random.default_rng(config.seed)
    train = rng.integers(0, n_train - config.block_size - 1, size=(config.steps, config.batch_size))
    count = config.eval_batches * config.batch_size
    val = np.linspace(0, n_val - config.block_size - 1, count).round().astype(np.int64)
    return train, val.reshape(config.eval_batches, config.batch_size)
