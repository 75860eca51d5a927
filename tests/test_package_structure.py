"""The package's import structure: no import circle, and no module importing a name that
its source module does not export (its `__all__`, or its public names where it has none).

Both read the sources (`ast`), function-level imports included, so that a deferred import
cannot hide a circle.
"""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

import jax_scaled_arithmetics

ROOT = Path(jax_scaled_arithmetics.__file__).parent
PACKAGE = "jax_scaled_arithmetics"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _relative_imports(module: str):
    """(source module, imported name) of each `from ... import name` inside the package."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                yield source, alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    yield alias.name, None


def _dependencies(module: str) -> set[str]:
    deps = set()
    for source, name in _relative_imports(module):
        submodule = f"{source}.{name}"
        deps.add(submodule if submodule in MODULES else source)
    parts = module.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
    return {d for d in deps if d in MODULES and d != module and d not in ancestors}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_circle():
    graph = {module: _dependencies(module) for module in MODULES}
    assert _cycles(graph) == []
    # The check sees circles: two modules importing each other are one.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_modules_import_only_what_their_source_exports():
    unexported = []
    for module in sorted(MODULES):
        for source, name in _relative_imports(module):
            if name is None or source not in MODULES or f"{source}.{name}" in MODULES:
                continue
            loaded = importlib.import_module(source)
            public = [n for n in dir(loaded) if not n.startswith("_")]
            if name not in getattr(loaded, "__all__", public):
                unexported.append(f"{module} imports {name} from {source}")
    assert unexported == []


def test_version_is_the_installed_distribution_s():
    """`jsa.__version__` is the version pip installed (pyproject.toml reads it from the
    package: one place to change)."""
    from importlib.metadata import version

    assert jax_scaled_arithmetics.__version__ == version("jax_scaled_arithmetics")


def test_package_data_is_installed():
    """`py.typed` ships with the package (PEP 561), wheel included."""
    assert (ROOT / "py.typed").is_file()


@pytest.mark.skipif(
    not os.environ.get("JSA_TEST_INSTALLED"),
    reason="only when testing an installed wheel (JSA_TEST_INSTALLED=1, as .ci/run does)",
)
def test_tests_run_against_the_installed_wheel():
    """With JSA_TEST_INSTALLED=1 the suite runs against a non-editable install: the package
    imported is the one in site-packages, not a source tree beside the tests."""
    import sysconfig

    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert ROOT.resolve().parent == site_packages, ROOT
    assert not (Path(__file__).resolve().parents[1] / PACKAGE).exists()
