"""Register ScaledArray and MXArray with `flax.serialization` once Flax is imported.

Importing Flax takes ~0.1 s (it imports `flax.linen`), a fifth of `import
jax_scaled_arithmetics`, so the package does not import it. :func:`install` (run by the
package's `__init__`) registers the classes at once when `flax.serialization` is already
imported; otherwise it puts a finder first on `sys.meta_path` that waits for that import,
registers the classes just after the module has run, and removes itself. The registration
itself is `checkpoint._register_flax`.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_FLAX_SERIALIZATION = "flax.serialization"


def _register() -> None:
    from . import checkpoint

    checkpoint._register_flax()


class _RegisteringLoader(importlib.abc.Loader):
    """`flax.serialization`'s own loader, then the registration."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader: nothing of this hook stays on it.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        try:
            self.loader.exec_module(module)
        except BaseException:
            _insert_finder()  # a later import of it may succeed
            raise
        _register()


class _FlaxSerializationFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader that the other finders give `flax.serialization`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _FLAX_SERIALIZATION:
            return None
        _remove_finder()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = None if find_spec is None else find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FlaxSerializationFinder)]


def _insert_finder() -> None:
    if not any(isinstance(f, _FlaxSerializationFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FlaxSerializationFinder())


def install() -> None:
    """Register now if `flax.serialization` is imported, else when it is."""
    if sys.modules.get(_FLAX_SERIALIZATION) is not None:
        _register()
    else:
        _insert_finder()
