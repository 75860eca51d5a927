"""docs/api/: the generated pages are current, and every public name has a docstring with an
`Examples:` section that runs (here for constants and type aliases, in test_doctests.py for
the rest); no MkDocs needed."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import pathlib
import textwrap

import pytest

from tests.helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
API_DIR = ROOT / "docs" / "api"

generator = load_script("gen_api_docs", "scripts/gen_api_docs.py")


def _public() -> list[tuple[str, str]]:
    return [(m, n) for m in generator.public_modules() for n in generator.public_names(m)]


def _source_module(module_name: str, name: str) -> tuple[str, str]:
    """The module (and the name there) that assigns `module_name.name`, following the
    `from .x import y as z` re-exports of the package's `__init__` files."""
    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    package = module_name if hasattr(module, "__path__") else module.__package__
                    target = importlib.util.resolve_name(
                        "." * node.level + (node.module or ""), package
                    )
                    if hasattr(importlib.import_module(target), "__path__") and not node.module:
                        return target + "." + alias.name, ""  # `from . import mod`
                    return _source_module(target, alias.name)
    return module_name, name


def _attribute_docstring(module_name: str, name: str) -> str:
    """The string literal under `name = ...` (what MkDocs shows for a constant)."""
    source_name, source_attr = _source_module(module_name, name)
    tree = ast.parse(inspect.getsource(importlib.import_module(source_name)))
    for node, following in zip(tree.body, tree.body[1:]):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == source_attr for t in targets):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                return inspect.cleandoc(str(following.value.value))
            return ""
    return ""


def _own_docstring(module_name: str, name: str) -> str | None:
    """The docstring of a class or function of the package (None for anything else)."""
    obj = getattr(importlib.import_module(module_name), name)
    if str(getattr(obj, "__module__", "")).startswith(generator.PACKAGE) and (
        inspect.isclass(obj) or inspect.isroutine(obj)
    ):
        own = obj.__doc__ or ""
        # A dataclass or NamedTuple without a docstring gets its signature as one.
        return "" if own.startswith(f"{obj.__name__}(") else inspect.cleandoc(own)
    return None


def docstring(module_name: str, name: str) -> str:
    """What MkDocs shows: the object's own docstring for the package's classes and
    functions, else the string under the assignment (constants, type aliases)."""
    own = _own_docstring(module_name, name)
    return own if own is not None else _attribute_docstring(module_name, name)


def test_api_pages_are_current():
    pages = generator.render()
    committed = {path.name: path.read_text() for path in API_DIR.glob("*.md")}
    assert committed == pages, "docs/api/ is stale: run `python scripts/gen_api_docs.py`"


def test_every_public_name_has_a_docstring():
    missing = [f"{m}.{n}" for m, n in _public() if not docstring(m, n).strip()]
    assert not missing, missing


def test_function_docstrings_are_written_in_their_def():
    """MkDocs reads docstrings from the source: one set at import (a template filled in, a
    factory's function) would be missing from the API reference."""
    built = []
    for module_name, name in _public():
        obj = getattr(importlib.import_module(module_name), name)
        if inspect.isfunction(obj) and str(obj.__module__).startswith(generator.PACKAGE):
            (definition,) = ast.parse(textwrap.dedent(inspect.getsource(obj))).body
            if ast.get_docstring(definition) != inspect.cleandoc(obj.__doc__ or ""):
                built.append(f"{module_name}.{name}")
    assert not built, built


def test_every_public_name_has_an_example():
    without = [f"{m}.{n}" for m, n in _public() if "Examples:" not in docstring(m, n)]
    assert not without, f"{len(without)} public names have no `Examples:` section: {without}"


# Constants and type aliases: their docstring is the string under the assignment, which
# `doctest.testmod` (tests/docs/test_doctests.py, every other example) does not see.
ATTRIBUTE_DOCUMENTED = [(m, n) for m, n in _public() if _own_docstring(m, n) is None]


@pytest.mark.parametrize("module_name, name", ATTRIBUTE_DOCUMENTED, ids=lambda x: x)
def test_examples_of_constants_run(module_name, name):
    """The examples under each public constant and type alias, run as a doctest in the
    namespace of the module that assigns it."""
    text = _attribute_docstring(module_name, name)
    home = _source_module(module_name, name)[0]
    globs = dict(vars(importlib.import_module(home)))  # as `doctest.testmod` runs them
    test = doctest.DocTestParser().get_doctest(text, globs, f"{module_name}.{name}", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0
