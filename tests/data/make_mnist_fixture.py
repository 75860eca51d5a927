"""Cut the tests' MNIST fixture from the genuine test split.

Writes the first `--count` images and labels of the genuine `t10k` files (found, checked
and cached by `experiments.data.mnist`) as IDX `.gz` files, gzip-compressed
deterministically (no file name, mtime 0), and prints their SHA-256s.

Run from the repository root:
    python tests/data/make_mnist_fixture.py --data-dir ../shared/data/mnist
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import data  # noqa: E402


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array."""
    assert array.dtype == np.uint8
    header = struct.pack(f">HBB{array.ndim}I", 0, 0x08, array.ndim, *array.shape)
    return header + array.tobytes()


def write_gz(path: Path, payload: bytes) -> None:
    with open(path, "wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as f:
        f.write(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(__file__).parent / f"mnist-t10k-first-{args.count}"
    out.mkdir(parents=True, exist_ok=True)
    images, labels = data.mnist("test", args.data_dir)
    for name, array in (
        ("t10k-images-idx3-ubyte.gz", images[: args.count]),
        ("t10k-labels-idx1-ubyte.gz", labels[: args.count].astype(np.uint8)),
    ):
        payload = idx_bytes(array)
        write_gz(out / name, payload)
        gz_sha = hashlib.sha256((out / name).read_bytes()).hexdigest()
        print(f"{name}  gz sha256 {gz_sha}  content sha256 {hashlib.sha256(payload).hexdigest()}")


if __name__ == "__main__":
    main()
