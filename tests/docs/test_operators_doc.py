import pathlib

from tests.helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_generator():
    return load_script("gen_operators_doc", "scripts/gen_operators_doc.py")


def test_operators_doc_is_current():
    # The same file on every supported JAX release: primitives that only some releases
    # have are listed on all, with the releases that have them.
    generator = _load_generator()
    committed = (ROOT / "docs" / "operators.md").read_text()
    assert committed == generator.render(), (
        "docs/operators.md is stale: run `python scripts/gen_operators_doc.py`"
    )


def test_primitive_release_table_matches_this_jax():
    """`_compat.PRIMITIVE_RELEASES` says which primitives the installed JAX has, and the
    listing shows every one it has (a new primitive in a new release fails here first)."""
    from jax_scaled_arithmetics.core import _compat

    generator = _load_generator()
    installed = set(generator.installed_primitives())
    for name in _compat.PRIMITIVE_RELEASES:
        assert _compat.has_primitive(name) == (name in installed), name
    assert installed <= set(generator.all_primitive_names())


def test_operators_doc_lists_every_registered_rule_as_supported():
    from jax_scaled_arithmetics.core import registry

    text = (ROOT / "docs" / "operators.md").read_text()
    for name in registry.declared_rules():
        assert f"| `{name}` | supported |" in text


def test_every_primitive_of_this_jax_has_a_rule_or_never_sees_floats():
    """A primitive the installed JAX has (a new release's new one included) either has a
    scaled rule or is listed as never seeing floating-point tensors: none is 'not yet'."""
    from jax_scaled_arithmetics.core import registry

    generator = _load_generator()
    rules = registry.declared_rules()
    missing = [
        name
        for name in generator.installed_primitives()
        if name not in rules and name not in generator.NOT_APPLICABLE
    ]
    assert not missing, f"primitives with no scaled rule: {missing}"


# Primitives of the modules behind `jax.lax` that no user function binds on floating-point
# tensors (the listing's scope is what `jax.extend` exports plus the rules; these are
# checked here so that a new public one is not missed).
INTERNAL_LAX_PRIMITIVES = {
    "empty": "no operands (shape and dtype)",
    "from_edtype": "extended dtypes (PRNG keys)",
    "to_edtype": "extended dtypes (PRNG keys)",
    "geqp3": "pivoted QR inside the lowering of qr(pivoting=True), which has a rule",
    "geqrf": "Householder QR inside the lowering of qr, which has a rule",
    "ormqr": "applies Householder reflectors inside qr's lowering",
    "lu_pivots_to_permutation": "integer pivots",
    "mulhi": "integer only",
    "platform_index": "no operands (lax.platform_dependent's branch index)",
    "stage": "identity that lifts a constant into a trace (gone from the jaxpr)",
    "tie": "internal to JAX (no public function binds it)",
}


def test_every_primitive_behind_jax_lax_has_a_rule_or_is_internal():
    """A primitive that a `jax.lax` function binds but `jax.extend` does not export (such as
    `composite`, `scaled_dot`, `cholesky_update`) has a rule, is listed as never seeing
    floating-point tensors, or is one of JAX's internal forms above."""
    from jax_scaled_arithmetics.core import _compat, registry

    generator = _load_generator()
    rules = registry.declared_rules()
    missing = sorted(
        name
        for name in _compat.lax_implementation_primitives()
        if generator._rule_of(name, rules) is None  # a renamed one: its other name's rule
        and name not in generator.NOT_APPLICABLE
        and name not in INTERNAL_LAX_PRIMITIVES
    )
    assert not missing, f"jax.lax primitives with no scaled rule: {missing}"
