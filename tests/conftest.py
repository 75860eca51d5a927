"""Test-session settings: strict rank promotion, four CPU devices (for collectives and
`shard_map` over a real mesh), and the rule output check always on.

Leaked-tracer checking (`jax.check_tracer_leaks`) makes every trace several times
slower, so it runs in dedicated tests (tests/core/test_tracer_leaks.py) rather
than around every test.

Compiled programs are shared through JAX's persistent compilation cache, in
`.pytest_cache/jax-compilation-cache` (`JSA_TEST_COMPILATION_CACHE=0` turns it off, `1` on;
a path puts it there). Tests build fresh `jax.jit(jsa.autoscale(f))` functions for the same
programs case after case, and the two xdist workers compile the same programs: the cache,
keyed by the program, the compile options and the JAX version, compiles each once. Even
cold (CI's fresh clone) it cuts about a quarter of the run; the executables, and so the
numbers, are the ones a compile gives.

The default run compiles with XLA:CPU's code generation unoptimised
(`--xla_backend_optimization_level=0`, appended to `XLA_FLAGS`): its programs are small and
run once or a few times, so LLVM's optimisation was much of their compile time (the
times before and after: docs/benchmarks.md, "The test suite"). The HLO passes, fusion and
numerics contracts are XLA's usual ones; only the machine code, and with it float32
contraction and summation order, may differ in the last bits. Runs that select the `slow`
tests (whole models, training runs, every combination of the rule tables) keep XLA's
defaults, so CI covers both. `JSA_TEST_XLA_OPT=default` or `=quick` chooses explicitly; a
level already in `XLA_FLAGS` wins.
"""

import os
import shutil
from collections import defaultdict
from pathlib import Path

import jax
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core.config import default_config

# Before any computation initialises the CPU backend (importing the package does not).
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_rank_promotion", "raise")

_CACHE = os.environ.get("JSA_TEST_COMPILATION_CACHE", "")
if _CACHE.lower() in ("1", "true", "on"):
    _CACHE = ""  # on, in the default place (not a directory named "1")
if _CACHE.lower() not in ("0", "false", "off"):
    _root = Path(__file__).resolve().parents[1]
    jax.config.update(
        "jax_compilation_cache_dir",
        _CACHE or str(_root / ".pytest_cache" / "jax-compilation-cache"),
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # (No `jax_compilation_cache_max_size`: its eviction lists the directory at every
    # write, which made the run slower than no cache. `pytest_configure` bounds it.) The
    # workers share it without a lock: an entry read while another writes it fails to load
    # and is compiled again (pyproject.toml lets that warning through).

_CACHE_LIMIT = 2 << 30  # bytes: a larger cache is emptied when a run starts


def pytest_configure(config):
    """Choose XLA's code generation (before any computation starts the backend); then, in
    the controller process only, send each test file to one xdist worker and empty the
    compilation cache when it outgrew its limit."""
    _choose_xla_optimization(config)
    _one_worker_per_file(config)
    directory = jax.config.jax_compilation_cache_dir
    if directory is None or hasattr(config, "workerinput") or not os.path.isdir(directory):
        return
    size = sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())
    if size > _CACHE_LIMIT:
        shutil.rmtree(directory, ignore_errors=True)


_QUICK_XLA_FLAG = "--xla_backend_optimization_level=0"


def _choose_xla_optimization(config):
    """Unoptimised XLA:CPU code generation for the default run (module docstring). The
    xdist workers inherit the controller's environment and find the flag already set."""
    choice = os.environ.get("JSA_TEST_XLA_OPT", "").lower()
    if choice not in ("", "quick", "default"):
        raise pytest.UsageError(f"JSA_TEST_XLA_OPT must be 'quick' or 'default', not {choice!r}")
    if not choice:
        markexpr = config.option.markexpr or ""
        choice = "default" if "slow" in markexpr.replace("not slow", "") else "quick"
    flags = os.environ.get("XLA_FLAGS", "")
    if choice == "quick" and "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_QUICK_XLA_FLAG}".strip()


def _one_worker_per_file(config):
    """`-n 2` distributes the tests file by file (xdist's `loadfile`) unless `--dist` says
    otherwise: the tests of a file compile the same shapes and programs, and a worker
    compiles each once in memory where two workers would both compile it (10% less time
    measured on tests/quantization + tests/unit_scaling). Not in `addopts`, where `--dist`
    would break `-p no:xdist`."""
    args = config.invocation_params.args
    explicit = any(str(a) == "--dist" or str(a).startswith("--dist=") for a in args)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "loadfile"


@pytest.fixture(autouse=True)
def _strict_autoscale():
    """Every test runs with the rule output check on."""
    with default_config(jsa.AutoScaleConfig(check=True)):
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The default run takes each parameter value of a test function at least once; the
    other combinations of its parameters get the `slow` mark and run in the slow step.

    A function parametrized over dtypes x jit x scales runs every dtype, every jit mode and
    every scale by default, not their whole product (every rule still meets float32,
    float16 and bfloat16, jitted and eager). Before the cases are marked slow here, a test's
    own `slow` marks apply; `@pytest.mark.every_case` keeps a function's whole product in
    the default run; `JSA_TEST_EVERY_CASE=1`, or a node id with parameters on the command
    line, turns the selection off. `@pytest.mark.one_case` (a test that compiles a whole
    training step or model, several seconds each case) keeps only its first case."""
    if os.environ.get("JSA_TEST_EVERY_CASE", "") == "1" or any("[" in str(a) for a in config.args):
        return
    groups = defaultdict(list)
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or any(item.get_closest_marker(m) for m in ("slow", "every_case")):
            continue
        function = (item.path, item.cls, getattr(item, "originalname", item.name))
        pairs = {(name, _value_key(value)) for name, value in callspec.params.items()}
        groups[function].append((item, pairs))
    for cases in groups.values():
        one_case = cases[0][0].get_closest_marker("one_case") is not None
        for item in _left_for_the_slow_step(cases, one_case):
            item.add_marker(pytest.mark.slow)


def _left_for_the_slow_step(cases, one_case):
    """The cases of one test function that the default run leaves out: all but the first
    with `one_case`, else those beyond each value once (`_beyond_each_choice`)."""
    if one_case:
        return [item for item, _ in cases[1:]]
    return _beyond_each_choice(cases)


def _beyond_each_choice(cases):
    """The cases left over once a greedy cover (in collection order on ties) has taken each
    (parameter, value) pair of `cases` at least once."""
    uncovered = set().union(*(pairs for _, pairs in cases))
    remaining = list(cases)
    while uncovered:
        best = max(remaining, key=lambda case: len(case[1] & uncovered))
        uncovered -= best[1]
        remaining.remove(best)
    return [item for item, _ in remaining]


def _value_key(value):
    """A parameter value as a set element (its repr when it is not hashable)."""
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return ("value", type(value), value)
