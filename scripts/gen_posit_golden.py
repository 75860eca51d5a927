"""Generate tests/data/posit_golden.npz: SoftPosit's posit codes and values, for the tests.

SoftPosit (PyPI `softposit`, the reference posit implementation, built from source with
the machine's C compiler) is not a dependency of the project: install it by hand
(`pip install softposit`) to run this script. The tests check the library against this
file always, and against SoftPosit itself when it is importable.

For each format SoftPosit implements (posit8_es0, posit16_es1, and posit{n}_es2 for n in
4..16 through its `posit_2` type), the file holds:

* ``encode/<name>``: SoftPosit's codes (`convertDoubleToP8`, `convertDoubleToP16`,
  `convertDoubleToPX2`) of the float32 inputs of
  `tests/quantization/posit_reference.py:golden_inputs`, delta-encoded (int32,
  ``np.cumsum`` restores them) so that the file stays small;
* ``inputs_sha256/<name>``: the SHA-256 of those inputs' bytes, so that a change of the
  inputs is caught;
* ``decode_sha256/<name>``: the SHA-256 of SoftPosit's values of every code, as float32
  (NaR as the NaN 0x7FC00000).

Usage:
    python scripts/gen_posit_golden.py           # (re)write tests/data/posit_golden.npz
    python scripts/gen_posit_golden.py --check   # exit 1 if the file differs from SoftPosit
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "tests" / "data" / "posit_golden.npz"
NAN_BITS = 0x7FC00000


def _reference() -> Any:
    path = ROOT / "tests" / "quantization" / "posit_reference.py"
    spec = importlib.util.spec_from_file_location("posit_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def softposit_code(sp: Any, x: float, nbits: int, es: int) -> int:
    """SoftPosit's code of the double `x` in posit<nbits, es> (a supported format)."""
    if (nbits, es) == (8, 0):
        return int(sp.convertDoubleToP8(x).v)
    if (nbits, es) == (16, 1):
        return int(sp.convertDoubleToP16(x).v)
    if es == 2:
        return int(sp.convertDoubleToPX2(x, nbits).v) >> (32 - nbits)
    raise ValueError(f"SoftPosit has no posit{nbits}_es{es}")


def softposit_value(sp: Any, code: int, nbits: int, es: int) -> float:
    """SoftPosit's value of a code (NaR: NaN)."""
    if code == 1 << (nbits - 1):
        return float("nan")
    if (nbits, es) == (8, 0):
        p = sp.posit8_t()
        p.v = code
        return float(sp.convertP8ToDouble(p))
    if (nbits, es) == (16, 1):
        p = sp.posit16_t()
        p.v = code
        return float(sp.convertP16ToDouble(p))
    p = sp.posit_2_t()
    p.v = code << (32 - nbits)
    return float(sp.convertPX2ToDouble(p))


def float32_sha256(values: np.ndarray) -> str:
    bits = np.asarray(values, np.float32).view(np.uint32).copy()
    bits[np.isnan(np.asarray(values, np.float32))] = NAN_BITS
    return hashlib.sha256(bits.tobytes()).hexdigest()


def content() -> dict[str, np.ndarray]:
    import softposit as sp

    ref = _reference()
    arrays: dict[str, np.ndarray] = {}
    for nbits, es in ref.GOLDEN_FORMATS:
        name = f"posit{nbits}_es{es}"
        x = ref.golden_inputs(nbits, es)
        codes = np.array([softposit_code(sp, float(v), nbits, es) for v in x], np.int64)
        arrays[f"encode/{name}"] = np.diff(codes, prepend=0).astype(np.int32)
        arrays[f"inputs_sha256/{name}"] = np.array(hashlib.sha256(x.tobytes()).hexdigest())
        values = [softposit_value(sp, c, nbits, es) for c in range(2**nbits)]
        arrays[f"decode_sha256/{name}"] = np.array(float32_sha256(np.array(values)))
    return arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="file to write")
    args = parser.parse_args(argv)
    arrays = content()
    if args.check:
        with np.load(args.output) as saved:
            same = set(saved.files) == set(arrays) and all(
                np.array_equal(saved[k], v) for k, v in arrays.items()
            )
        if not same:
            print(f"{args.output} differs from SoftPosit: run python scripts/gen_posit_golden.py")
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "wb") as f:
        np.savez_compressed(f, **arrays)
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
