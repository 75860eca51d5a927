"""Generate docs/operators.md: every JAX primitive and its scaled-rule status, from the registry.

Usage:
    python scripts/gen_operators_doc.py          # write docs/operators.md
    python scripts/gen_operators_doc.py --check  # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jax.extend.core import Primitive
from jax.extend.core import primitives as jax_primitives

from jax_scaled_arithmetics.core import _compat, registry

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


def installed_primitives() -> dict[str, Primitive]:
    """The primitives of the installed JAX that the listing shows: those
    `jax.extend.core.primitives` exports and those with a scaled rule."""
    prims = {p.name: p for p in vars(jax_primitives).values() if isinstance(p, Primitive)}
    for name, info in registry.coverage().items():
        prims.setdefault(name, info.primitive)
    return dict(sorted(prims.items()))


def all_primitive_names() -> list[str]:
    """The names listed: those of the installed JAX, and those that other supported releases
    have (`_compat.PRIMITIVE_RELEASES`, and rules declared for them), so that every supported
    release generates the same file."""
    names = set(installed_primitives()) | set(registry.declared_rules())
    names |= set(_compat.PRIMITIVE_RELEASES)
    return sorted(names)


def _rule_of(name: str, rules: dict[str, registry.RuleInfo]) -> registry.RuleInfo | None:
    """The rule listed for `name`: its own, or that of the same primitive under the name
    other releases give it (`_compat.PRIMITIVE_RENAMES`)."""
    if name in rules:
        return rules[name]
    for old, new in _compat.PRIMITIVE_RENAMES.items():
        other = {old: new, new: old}.get(name)
        if other is not None and other in rules:
            return rules[other]
    return None


def _releases(name: str) -> str:
    releases = _compat.PRIMITIVE_RELEASES.get(name)
    return releases.describe() if releases is not None else ""


def render() -> str:
    rules = registry.declared_rules()
    block_rules = {name for name, info in registry.coverage().items() if info.block_rule}
    rows = []
    counts = {"supported": 0, "not applicable": 0, "not yet": 0}
    kept = 0
    for name in all_primitive_names():
        info = _rule_of(name, rules)
        if info is not None:
            status, family, remark = "supported", info.family, info.remark
        elif name in NOT_APPLICABLE:
            status, family, remark = "not applicable", "", NOT_APPLICABLE[name]
        else:
            status, family, remark = "not yet", "", ""
        counts[status] += 1
        if info is not None and info.primitive is not None and info.primitive.name in block_rules:
            blocks = "kept"
            kept += 1
        elif status == "supported":
            blocks = "per tensor"
        else:
            blocks = ""
        rows.append(f"| `{name}` | {status} | {family} | {blocks} | {_releases(name)} | {remark} |")
    minimum = ".".join(str(p) for p in _compat.MIN_JAX_VERSION)
    header = [
        "# Scaled operator coverage",
        "",
        "Generated from the rule registry by `python scripts/gen_operators_doc.py`; do not edit.",
        "A test fails when this file is stale; every supported JAX release generates the same",
        "file.",
        "",
        "Every primitive that `jax.extend.core.primitives` exposes in a supported JAX release",
        f"(JAX >= {minimum}), plus the others `autoscale` has rules for (this library's own",
        "scaling primitives, hijax calls). *supported*: `autoscale` has a scaled rule for it;",
        "*not applicable*: it never sees floating-point tensors; *not yet*: `autoscale` raises",
        "`NotImplementedError` naming it when one of its inputs is scaled (register a rule",
        "with `jsa.register_scaled_op`). *JAX*: the releases that have the primitive, where not",
        "every supported one does (the others express the operation with other primitives).",
        "",
        "*block scales*: with an operand whose scale is finer than one per tensor (per row,",
        "channel, MX block, tile, stacked layer), *kept* rules keep the blocks",
        "(`jax_scaled_arithmetics/lax/block_rules/`); *per tensor* rules get such operands",
        "brought to one scale first (the largest block scale; smaller blocks lose the",
        "precision their data dtype has below its smallest normal number).",
        "",
        f"Supported: {counts['supported']}. Not applicable: {counts['not applicable']}. "
        f"Not yet: {counts['not yet']}. Keeping block scales: {kept}.",
        "",
        "| primitive | status | rule family | block scales | JAX | remark |",
        "| --- | --- | --- | --- | --- | --- |",
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
