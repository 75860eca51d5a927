"""Old public names kept for one minor release, with a `DeprecationWarning` naming the new one
(CONTRIBUTING.md, "Deprecations"). The changelog lists each under "Deprecated".

A module keeps its moved names by ending with
`__getattr__ = moved_names(__name__, {"old": ("jax_scaled_arithmetics.ops", "new")})`: the
old name is found only when asked for (it is not in `__all__`, `dir()` or the API reference),
and each access warns."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RenamedAttribute", "moved_names", "warn_renamed"]


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that the public name `old` is now `new` (both written as users write them)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next minor release: use {new}.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class RenamedAttribute:
    """A class attribute that reads the attribute `new` of the instance, warning that it is
    deprecated. `owner` is the class as users write it (`"jsa.quantization.MXArray"`)."""

    def __init__(self, owner: str, new: str) -> None:
        self.owner, self.new = owner, new
        self.old = ""

    def __set_name__(self, cls: type, name: str) -> None:
        self.old = name

    def __get__(self, instance: Any, cls: type | None = None) -> Any:
        if instance is None:
            return self
        warn_renamed(f"{self.owner}.{self.old}", f"{self.owner}.{self.new}")
        return getattr(instance, self.new)


def moved_names(module: str, moved: Mapping[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module `__getattr__` that serves each old name of `moved` (old name -> (module of
    the new name, new name)) with a `DeprecationWarning`, and raises AttributeError for any
    other missing name."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module '{module}' has no attribute '{name}'")
        home, new = moved[name]
        warn_renamed(f"{_public(module)}.{name}", f"{_public(home)}.{new}")
        return getattr(importlib.import_module(home), new)

    return __getattr__


def _public(module: str) -> str:
    """`jsa.ops` for `jax_scaled_arithmetics.ops`: the spelling of the docs."""
    return "jsa" + module[len("jax_scaled_arithmetics") :]
