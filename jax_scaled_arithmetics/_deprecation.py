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

__all__ = ["moved_names", "warn_renamed"]


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that the public name `old` is now `new` (both written as users write them)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next minor release: use {new}.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


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
