"""Generate docs/operators.md: every JAX primitive and its scaled-rule status, from the registry.

Usage:
    python scripts/gen_operators_doc.py          # write docs/operators.md
    python scripts/gen_operators_doc.py --check  # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
from jax.extend.core import Primitive
from jax.extend.core import primitives as jax_primitives

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import registry

DOC_PATH = pathlib.Path(__file__).resolve().parent.parent / "docs" / "operators.md"

# Primitives that never see floating-point values, or whose values are not tensors to scale.
NOT_APPLICABLE = {
    "after_all": "tokens",
    "and": "bitwise (bool/int)",
    "axis_index": "integer axis index",
    "clz": "integer only",
    "create_token": "tokens",
    "iota": "no float inputs: stays plain, promoted where it meets scaled data",
    "not": "bitwise (bool/int)",
    "or": "bitwise (bool/int)",
    "population_count": "integer only",
    "random_bits": "PRNG keys",
    "random_fold_in": "PRNG keys",
    "random_seed": "PRNG keys",
    "random_split": "PRNG keys",
    "random_wrap": "PRNG keys",
    "random_unwrap": "PRNG keys",
    "rng_bit_generator": "PRNG state",
    "rng_uniform": "PRNG (its bounds are plain)",
    "shift_left": "integer only",
    "shift_right_arithmetic": "integer only",
    "shift_right_logical": "integer only",
    "threefry2x32": "PRNG (integer)",
    "xor": "bitwise (bool/int)",
    "reduce_and": "bool only",
    "reduce_or": "bool only",
    "reduce_xor": "bool/int only",
    "eq_to": "internal shape comparison of integers",
    "le_to": "internal shape comparison of integers",
    "lt_to": "internal shape comparison of integers",
    "empty2": "internal",
    "get": "internal (mutable refs)",
    "swap": "internal (mutable refs)",
    "call": "legacy call primitive; closed_call and jit are handled",
    "real": "complex operands only (ScaledArray data is real)",
    "imag": "complex operands only (ScaledArray data is real)",
    "conj": "complex operands only (ScaledArray data is real)",
    "select_and_scatter": "only built by JAX internals; max-pool gradients use "
    "select_and_scatter_add",
}


def all_primitives() -> dict[str, Primitive]:
    prims = {p.name: p for p in vars(jax_primitives).values() if isinstance(p, Primitive)}
    for name, info in jsa.coverage().items():
        prims.setdefault(name, info.primitive)
    return dict(sorted(prims.items()))


def render() -> str:
    rules = jsa.coverage()
    block_rules = {p.name for p in registry._BLOCK_RULES}
    rows = []
    counts = {"supported": 0, "not applicable": 0, "not yet": 0}
    for name in all_primitives():
        if name in rules:
            info = rules[name]
            status, family, remark = "supported", info.family, info.remark
        elif name in NOT_APPLICABLE:
            status, family, remark = "not applicable", "", NOT_APPLICABLE[name]
        else:
            status, family, remark = "not yet", "", ""
        counts[status] += 1
        if name in block_rules:
            blocks = "kept"
        elif status == "supported":
            blocks = "per tensor"
        else:
            blocks = ""
        rows.append(f"| `{name}` | {status} | {family} | {blocks} | {remark} |")
    header = [
        "# Scaled operator coverage",
        "",
        "Generated from the rule registry by `python scripts/gen_operators_doc.py`; do not edit.",
        "A test fails when this file is stale.",
        "",
        f"Generated with JAX {jax.__version__} (older releases lack a few primitives).",
        "",
        "Every primitive that `jax.extend.core.primitives` exposes, plus this library's own",
        "scaling primitives. *supported*: `autoscale` has a scaled rule for it; *not applicable*:",
        "it never sees floating-point tensors; *not yet*: `autoscale` raises",
        "`NotImplementedError` naming it when one of its inputs is scaled (register a rule",
        "with `jsa.register_scaled_op`).",
        "",
        "*block scales*: with an operand whose scale is finer than one per tensor (per row,",
        "channel, MX block, tile, stacked layer), *kept* rules keep the blocks",
        "(`jax_scaled_arithmetics/lax/block_rules.py`); *per tensor* rules get such operands",
        "brought to one scale first (the largest block scale; smaller blocks lose the",
        "precision their data dtype has below its smallest normal number).",
        "",
        f"Supported: {counts['supported']}. Not applicable: {counts['not applicable']}. "
        f"Not yet: {counts['not yet']}. Keeping block scales: {len(block_rules & set(rules))}.",
        "",
        "| primitive | status | rule family | block scales | remark |",
        "| --- | --- | --- | --- | --- |",
    ]
    return "\n".join(header + rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/operators.md is stale")
    args = parser.parse_args(argv)
    content = render()
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != content:
            print(f"{DOC_PATH} is stale: run python scripts/gen_operators_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
