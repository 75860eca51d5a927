"""Modules renamed by role, importable under their old names with a DeprecationWarning.

`import jax_scaled_arithmetics.lax.blocks` (or `jsa.lax.blocks`) still gives the module
now named `jax_scaled_arithmetics.lax.block_rules`, and warns once per old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["RENAMED_MODULES", "install", "package_getattr"]

_PACKAGE = __name__.rpartition(".")[0]

RENAMED_MODULES: dict[str, str] = {
    f"{_PACKAGE}.{old}": f"{_PACKAGE}.{new}"
    for old, new in [
        ("core.scale_primitives", "core.scale_arithmetic"),
        ("core.blocks", "core.block_scales"),
        ("lax.scales", "lax.scale_algebra"),
        ("lax.scaling", "lax.scaling_primitives"),
        ("lax.blocks", "lax.block_rules"),
        ("ops.rescaling", "ops.dynamic_rescaling"),
    ]
}


def _renamed_module(old: str) -> types.ModuleType:
    new = RENAMED_MODULES[old]
    warnings.warn(
        f"`{old}` is renamed `{new}`; the old name will be removed in a future release.",
        DeprecationWarning,
        stacklevel=_caller_stacklevel(),
    )
    return importlib.import_module(new)


def _caller_stacklevel() -> int:
    """`stacklevel` for `_renamed_module`'s warning: the code that imported the old name.

    Frames of this module and of `importlib` are passed over; `warnings.warn` skips the
    import machinery's own (`importlib._bootstrap`) frames, so those are not counted.
    """
    frame = sys._getframe(1)  # `_renamed_module`, stacklevel 1
    level = 1
    while frame is not None and (
        frame.f_code.co_filename == _THIS_FILE or "importlib" in frame.f_code.co_filename
    ):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is not None and not _is_import_machinery(frame.f_code.co_filename):
            level += 1
    return level


def _is_import_machinery(filename: str) -> bool:
    return "importlib" in filename and "_bootstrap" in filename


_THIS_FILE = _renamed_module.__code__.co_filename


class _RenamedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of an old module name with the renamed module itself."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in RENAMED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _renamed_module(spec.name)
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # Already executed under its new name; the import system has just set its
        # `__spec__` to the old name's, which the module's own spec replaces again.
        module.__spec__ = self._own_specs.pop(module.__name__)


def install() -> None:
    """Registers the finder (once) after the interpreter's own finders."""
    if not any(isinstance(finder, _RenamedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_RenamedModuleFinder())


def package_getattr(package: str) -> Callable[[str], Any]:
    """A package's module `__getattr__`: `jsa.lax.blocks` resolves to the renamed module."""

    def __getattr__(name: str) -> Any:
        old = f"{package}.{name}"
        if old in RENAMED_MODULES:
            return importlib.import_module(old)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
