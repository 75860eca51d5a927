from .. import _renamed

# Old module names (see `jax_scaled_arithmetics._renamed`): `jsa.lax.blocks` still resolves.
__getattr__ = _renamed.package_getattr(__name__)
