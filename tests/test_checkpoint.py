"""jsa.checkpoint: ScaledArray parameters and optimizer states through Flax and Orbax, bit-exact."""

from __future__ import annotations

import functools
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import time

import flax.serialization as fs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.checkpoint as jsa_checkpoint

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn]
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@functools.lru_cache
def training_state(dtype):
    """Parameters and a `scale_optimizer` Adam state with `dtype` data, after two steps.

    The scales are far from 1 (gradients ~1e-3, second moments ~1e-7), so a lost or
    rounded scale, or data restored in another dtype, would show.
    """
    params = jsa.as_scaled_array(
        {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 3)), "b": jnp.zeros(3)},
        dtype=jnp.float32,
    )
    params = jsa.tree.astype(jsa.ops.dynamic_rescale_max(params), dtype)
    opt = jsa.optax.scale_optimizer(optax.adam(1e-2), state_dtype=dtype)

    @jax.jit
    @jsa.autoscale
    def step(params, state):
        grads = jax.grad(lambda p: jnp.sum((p["w"] * 1e-3) ** 2) + 1e-3 * jnp.sum(p["b"]))(params)
        updates, state = opt.update(grads, state, params)
        return jsa.optax.apply_updates(params, updates), state

    params, state = params, opt.init(params)
    for _ in range(2):
        params, state = step(params, state)
    return {"params": params, "opt_state": state, "step": jnp.int32(2)}


def assert_bit_identical(restored, original):
    """Same structure, ScaledArrays where the original has them, same dtypes and bits."""
    treedef = jax.tree_util.tree_structure(original)
    assert jax.tree_util.tree_structure(restored) == treedef
    pairs = zip(
        jax.tree_util.tree_leaves(restored, is_leaf=jsa.is_scaled_leaf),
        jax.tree_util.tree_leaves(original, is_leaf=jsa.is_scaled_leaf),
    )
    n_scaled = 0
    for got, want in pairs:
        if isinstance(want, jsa.ScaledArray):
            assert isinstance(got, jsa.ScaledArray)
            n_scaled += 1
            arrays = [(got.data, want.data), (got.scale, want.scale)]
        else:
            arrays = [(got, want)]
        for a, b in arrays:
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape
            uint = _UINT[a.dtype.itemsize]
            np.testing.assert_array_equal(a.view(uint), b.view(uint))
    assert n_scaled == 6  # params w, b; Adam mu w, b; nu w, b


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: jnp.dtype(d).name)
def state(request):
    return training_state(request.param)


def test_training_state_is_scaled_low_precision(state):
    mu = state["opt_state"][0].mu["w"]
    assert isinstance(mu, jsa.ScaledArray) and mu.dtype == state["params"]["w"].dtype
    assert float(mu.scale) not in (0.0, 1.0)


def test_flax_bytes_round_trip(state):
    raw = fs.to_bytes(state)
    restored = fs.from_bytes(state, raw)
    assert_bit_identical(restored, state)
    # The template's values are not used: a zeroed template restores the same bits.
    zeros = jax.tree_util.tree_map(jnp.zeros_like, state)
    assert_bit_identical(fs.from_bytes(zeros, raw), state)


def test_flax_state_dict_round_trip(state):
    state_dict = fs.to_state_dict(state)
    w = state_dict["params"]["w"]
    assert set(w) == {"data", "scale"} and w["data"].dtype == state["params"]["w"].dtype
    assert_bit_identical(fs.from_state_dict(state, state_dict), state)
    # The state dict of a restored byte string is plain msgpack: check it against the template.
    jsa.checkpoint.check_compatible(state, fs.msgpack_restore(fs.to_bytes(state)))


def test_packed_trees_round_trip_and_share_the_unpacked_format(state, tmp_path):
    """A tree packed with `jsa.tree.pack_scales` saves and restores through Flax (bytes:
    those of the unpacked tree, so either form restores into either) and Orbax, bit-exact."""
    packed = {
        "params": jsa.tree.pack_scales(state["params"]),
        "opt_state": jsa.tree.pack_scales(state["opt_state"]),
        "step": state["step"],
    }
    raw = fs.to_bytes(packed)
    assert raw == fs.to_bytes(state)
    restored = fs.from_bytes(packed, raw)
    assert isinstance(restored["params"], jsa.tree.PackedScales)
    assert_bit_identical(jsa.tree.unpack_scales(restored), state)
    assert_bit_identical(fs.from_bytes(state, fs.to_bytes(packed)), state)
    jsa.checkpoint.save(tmp_path / "ckpt", packed)
    restored = jsa.checkpoint.restore(tmp_path / "ckpt", packed)
    assert isinstance(restored["opt_state"], jsa.tree.PackedScales)
    assert_bit_identical(jsa.tree.unpack_scales(restored), state)
    # An abstract packed template (`jax.eval_shape`) restores the same.
    restored = jsa.checkpoint.restore(tmp_path / "ckpt", jax.eval_shape(lambda: packed))
    assert_bit_identical(jsa.tree.unpack_scales(restored), state)


def test_flax_restore_into_another_dtype_fails():
    raw = fs.to_bytes(training_state(jnp.float16))
    template = training_state(jnp.bfloat16)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Cannot restore the ScaledArray at params/b: its stored data is float16[3], the "
            "template's is bfloat16[3]."
        ),
    ):
        fs.from_bytes(template, raw)


def test_flax_restore_into_another_shape_fails():
    x = {"w": jsa.as_scaled_array(jnp.ones((2, 3)), dtype=jnp.float16)}
    template = {"w": jsa.as_scaled_array(jnp.ones((3, 2)), dtype=jnp.float16)}
    with pytest.raises(ValueError, match=r"at w: its stored data is float16\[2, 3\], the tem"):
        fs.from_bytes(template, fs.to_bytes(x))
    vector_scale = {"w": jsa.scaled_array(jnp.ones(2, jnp.float16), jnp.ones(2, jnp.float32))}
    with pytest.raises(
        ValueError, match=r"stored scale is float32\[2\], the template's is float32"
    ):
        fs.from_bytes({"w": jsa.as_scaled_array(jnp.ones(2), dtype=jnp.float16)},
                      fs.to_bytes(vector_scale))  # fmt: skip


def test_flax_restore_of_a_plain_array_into_a_scaled_template_fails():
    raw = fs.to_bytes({"w": jnp.ones(2, jnp.float16)})
    template = {"w": jsa.as_scaled_array(jnp.ones(2), dtype=jnp.float16)}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Cannot restore the ScaledArray at w: expected a state dict with keys "
            "['data', 'scale'], got ndarray."
        ),
    ):
        fs.from_bytes(template, raw)


def test_orbax_round_trip(state, tmp_path):
    jsa.checkpoint.save(tmp_path / "ckpt", state)
    assert_bit_identical(jsa.checkpoint.restore(tmp_path / "ckpt", state), state)
    # An abstract template (no values, no allocation) restores the same.
    abstract = jax.eval_shape(lambda: state)
    assert_bit_identical(jsa.checkpoint.restore(tmp_path / "ckpt", abstract), state)


def test_plain_orbax_needs_no_registration(state, tmp_path):
    """ScaledArray is a pytree: Orbax's own checkpointers save and restore it as is."""
    path = str(tmp_path / "ckpt")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
        assert_bit_identical(checkpointer.restore(path, state), state)
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(str(tmp_path / "pytree"), state)
        restore_args = ocp.checkpoint_utils.construct_restore_args(state)
        restored = checkpointer.restore(
            str(tmp_path / "pytree"), args=ocp.args.PyTreeRestore(state, restore_args=restore_args)
        )
        assert_bit_identical(restored, state)


def test_plain_orbax_casts_silently_and_restore_refuses(tmp_path):
    """Why `jsa.checkpoint.restore` checks: Orbax casts to the template's dtype."""
    x = {"w": jsa.scaled_array(jnp.array([1.0, 1.0 + 2.0**-10], jnp.float16), 2.0**-40)}
    template = {"w": jsa.scaled_array(jnp.zeros(2, jnp.bfloat16), 1.0)}
    jsa.checkpoint.save(tmp_path / "ckpt", x)
    with ocp.StandardCheckpointer() as checkpointer:
        cast = checkpointer.restore(str(tmp_path / "ckpt"), template)
    assert cast["w"].dtype == jnp.bfloat16  # 1 + 2**-10 rounded to 1: bits lost
    with pytest.raises(
        ValueError,
        match=re.escape(
            "The checkpoint does not match the template:\n"
            "  w/data: stored float16[2], template bfloat16[2]"
        ),
    ):
        jsa.checkpoint.restore(tmp_path / "ckpt", template)


def test_orbax_restore_into_another_shape_or_structure_fails(tmp_path):
    x = {"w": jsa.as_scaled_array(jnp.ones((2, 3)), dtype=jnp.float16), "n": jnp.int32(1)}
    jsa.checkpoint.save(tmp_path / "ckpt", x)
    other_shape = {"w": jsa.as_scaled_array(jnp.ones((3, 2)), dtype=jnp.float16), "n": x["n"]}
    with pytest.raises(
        ValueError, match=re.escape("w/data: stored float16[2, 3], template float16[3, 2]")
    ):
        jsa.checkpoint.restore(tmp_path / "ckpt", other_shape)
    plain = {"w": jnp.ones((2, 3), jnp.float16), "n": x["n"], "extra": jnp.ones(1)}
    with pytest.raises(ValueError) as info:
        jsa.checkpoint.restore(tmp_path / "ckpt", plain)
    assert str(info.value) == (
        "The checkpoint does not match the template:\n"
        "  extra: in the template (float32[1]), not in the checkpoint\n"
        "  w: in the template (float16[2, 3]), not in the checkpoint\n"
        "  w/data: in the checkpoint (float16[2, 3]), not in the template\n"
        "  w/scale: in the checkpoint (float32[]), not in the template"
    )
    jsa.checkpoint.save(tmp_path / "ckpt", x, force=True)  # overwriting needs force
    with pytest.raises(ValueError, match="already exists"):
        jsa.checkpoint.save(tmp_path / "ckpt", x)


def test_check_compatible_lists_at_most_ten_problems():
    template = {f"k{i:02d}": jnp.ones(1) for i in range(12)}
    with pytest.raises(ValueError, match=r"k09: in the template .*\n  \.\.\. and 2 more$"):
        jsa.checkpoint.check_compatible(template, {})


def test_lazy_public_module_and_registration():
    assert jsa.checkpoint is jsa_checkpoint and "checkpoint" in jsa.__all__
    assert jsa.checkpoint.FLAX_REGISTERED and fs.is_serializable(jsa.ScaledArray)
    assert fs.is_serializable(jsa.quantization.MXArray)


@pytest.mark.slow
def test_core_does_not_import_flax_and_checkpoint_works_without_it():
    code = (
        "import sys\n"
        "import numpy as np\n"
        "import jax_scaled_arithmetics as jsa\n"
        "assert 'flax' not in sys.modules and 'orbax' not in sys.modules\n"
        "sys.modules['flax'] = None  # as if flax were not installed\n"
        "from jax_scaled_arithmetics import checkpoint\n"
        "assert checkpoint.FLAX_REGISTERED is False\n"
        "stored = {'w': {'data': np.ones(1, np.float32), 'scale': np.float32(1)}}\n"
        "checkpoint.check_compatible({'w': jsa.scaled_array([1.0], 1.0)}, stored)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# --- PRNG keys ---------------------------------------------------------------------------


def test_orbax_round_trip_of_typed_prng_keys(tmp_path):
    """Orbax stores a typed key as its key data (uint32[..., 2]); restore gives the key back."""
    x = {
        "k": jax.random.key(0),
        "ks": jax.random.split(jax.random.key(1), 3),
        "w": jsa.as_scaled_array(jnp.ones(2), dtype=jnp.float16),
    }
    jsa.checkpoint.save(tmp_path / "ckpt", x)
    for template in (x, jax.eval_shape(lambda: x)):
        y = jsa.checkpoint.restore(tmp_path / "ckpt", template)
        for name in ("k", "ks"):
            assert jax.dtypes.issubdtype(y[name].dtype, jax.dtypes.prng_key)
            assert y[name].dtype == x[name].dtype and y[name].shape == x[name].shape
            np.testing.assert_array_equal(
                jax.random.key_data(y[name]), jax.random.key_data(x[name])
            )
        np.testing.assert_array_equal(y["w"].data, x["w"].data)
    # Another implementation stores key data of another shape: refused, not reinterpreted.
    rbg = dict(x, k=jax.random.key(0, impl="rbg"))
    with pytest.raises(ValueError, match=re.escape("k: stored uint32[2], template key<rbg>[]")):
        jsa.checkpoint.restore(tmp_path / "ckpt", rbg)
    # Keys on both sides (abstract trees) compare by dtype.
    jsa.checkpoint.check_compatible(x, jax.eval_shape(lambda: x))
    with pytest.raises(ValueError, match=re.escape("k: stored key<fry>[], template key<rbg>[]")):
        jsa.checkpoint.check_compatible(rbg, jax.eval_shape(lambda: x))


# --- what a failed or interrupted save leaves ----------------------------------------------


def versioned(v, size=1 << 16):
    """A tree whose every leaf holds `v`: float16, int32 and ScaledArray leaves (~1 MB)."""
    return {
        "a": jnp.full((size,), v, jnp.float16),
        "b": jsa.scaled_array(jnp.full((size,), v, jnp.bfloat16), 2.0**-v),
        "c": {"d": jnp.full((size // 2,), v, jnp.int32), "e": jnp.full((4, size), v, jnp.float16)},
        "f": jsa.scaled_array(jnp.full((size,), v, jnp.float16), jnp.float32(v)),
    }


def assert_same_bits(restored, original):
    leaves = [jax.tree_util.tree_leaves(t) for t in (restored, original)]
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(original)
    for a, b in zip(*leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(
            a.view(_UINT[a.dtype.itemsize]), b.view(_UINT[b.dtype.itemsize])
        )


def only_the_checkpoint_is_left(path):
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


@pytest.mark.parametrize(
    "bad",
    [{"s": "not an array"}, {"w": jnp.ones(2, jnp.float8_e4m3)}],  # tensorstore has no e4m3
    ids=["str-leaf", "float8_e4m3-leaf"],
)
def test_failed_overwrite_keeps_the_previous_checkpoint(tmp_path, bad):
    path = tmp_path / "ckpt"
    jsa.checkpoint.save(path, versioned(1, size=8))
    with pytest.raises(ValueError):
        jsa.checkpoint.save(path, bad, force=True)
    assert_same_bits(jsa.checkpoint.restore(path, versioned(0, size=8)), versioned(1, size=8))
    only_the_checkpoint_is_left(path)


@pytest.mark.parametrize("rollback_fails", [False, True], ids=["rolled-back", "as-if-killed"])
def test_failure_between_the_two_renames_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, rollback_fails
):
    """`save` renames the old checkpoint aside, then the new one into place: make the
    second rename fail (and the rename back too, as if the process had died there)."""
    path = tmp_path / "ckpt"
    jsa.checkpoint.save(path, versioned(1, size=8))
    rename, failures = os.rename, []

    def failing_rename(src, dst, *args, **kwargs):
        if os.fspath(dst) == os.fspath(path) and (rollback_fails or not failures):
            failures.append(src)
            raise OSError("injected failure")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="injected failure"):
        jsa.checkpoint.save(path, versioned(2, size=8), force=True)
    monkeypatch.setattr(os, "rename", rename)
    assert len(failures) == (2 if rollback_fails else 1)
    assert path.exists() != rollback_fails  # else only the previous one, set aside, is left
    assert_same_bits(jsa.checkpoint.restore(path, versioned(0, size=8)), versioned(1, size=8))
    # The next save puts the previous checkpoint back first, so it needs `force`.
    with pytest.raises(ValueError, match="already exists"):
        jsa.checkpoint.save(path, versioned(3, size=8))
    only_the_checkpoint_is_left(path)
    jsa.checkpoint.save(path, versioned(3, size=8), force=True)
    assert_same_bits(jsa.checkpoint.restore(path, versioned(0, size=8)), versioned(3, size=8))
    only_the_checkpoint_is_left(path)


def test_save_cleans_up_after_dead_saves_only(tmp_path):
    path = tmp_path / "ckpt"
    jsa.checkpoint.save(path, versioned(1, size=8))
    command = [sys.executable, "-c", "import os; print(os.getpid())"]
    dead = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    host = socket.gethostname()
    stale = tmp_path / f".ckpt.jsa-staging-{host}-{dead}-abc123"
    live = tmp_path / f".ckpt.jsa-staging-{host}-{os.getppid()}-abc123"
    other_host = tmp_path / f".ckpt.jsa-staging-{host}x-{dead}-abc123"
    backup = tmp_path / ".ckpt.jsa-previous"
    for p in (stale, live, other_host, backup):
        (p / "ckpt").mkdir(parents=True)
    jsa.checkpoint.save(path, versioned(2, size=8), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt", live.name, other_host.name]
    )


def test_overwriting_without_force_fails_before_writing(tmp_path):
    path = tmp_path / "ckpt"
    jsa.checkpoint.save(path, versioned(1, size=8))
    with pytest.raises(ValueError, match=f"Destination {re.escape(str(path))} already exists"):
        jsa.checkpoint.save(path, {"s": "not an array"})
    only_the_checkpoint_is_left(path)


def test_save_refuses_several_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(NotImplementedError, match="one process only"):
        jsa.checkpoint.save(tmp_path / "ckpt", versioned(1, size=8))
    assert not list(tmp_path.iterdir())


_SAVE_LOOP = """
import sys
import jax.numpy as jnp
import jax_scaled_arithmetics as jsa
{versioned}
for v in range(1, 10**6):
    jsa.checkpoint.save(sys.argv[1], versioned(v), force=True)
    print(v, flush=True)
"""


# Each kill a process of its own (~4 s to start): one in the default run, three in the slow
# step.
@pytest.mark.parametrize("kills", [1, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_killed_save_leaves_a_whole_checkpoint(tmp_path, kills):
    """A process saving versions 1, 2, 3, ... is killed at random times: the checkpoint is
    always one whole version (the last one saved, or the one being saved)."""
    code = _SAVE_LOOP.format(versioned=inspect.getsource(versioned))
    rng = np.random.default_rng(0)
    template = jax.eval_shape(lambda: versioned(0))
    for i, delay in enumerate(rng.uniform(0.0, 0.4, size=3)[:kills]):
        path = tmp_path / f"ckpt{i}"
        command = [sys.executable, "-c", code, str(path)]
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
            try:
                assert child.stdout is not None and child.stdout.readline().strip() == "1"
                time.sleep(delay)
            finally:
                os.kill(child.pid, signal.SIGKILL)
            last = max([1, *(int(line) for line in child.stdout)])
        restored = jsa.checkpoint.restore(path, template)
        version = int(np.asarray(restored["a"])[0])
        assert version in (last, last + 1), (version, last)
        assert_same_bits(restored, versioned(version))
        # The next save removes what the killed one left (its staging directory, a backup).
        jsa.checkpoint.save(path, versioned(0, size=8), force=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"ckpt{j}" for j in range(i + 1)]


# --- errors for what is not a checkpoint -------------------------------------------------


def test_restore_of_a_missing_checkpoint_or_of_another_directory(tmp_path):
    template = {"w": jnp.ones(2)}
    with pytest.raises(FileNotFoundError, match=f"No checkpoint at {re.escape(str(tmp_path))}/no"):
        jsa.checkpoint.restore(tmp_path / "no", template)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: it is a directory, but holds no checkpoint"):
        jsa.checkpoint.restore(tmp_path / "empty", template)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"file: it is a file"):
        jsa.checkpoint.restore(tmp_path / "file", template)


# --- MXArray with Flax, and registration without importing jsa.checkpoint ----------------


@pytest.mark.slow
def test_flax_round_trip_of_mx_arrays():
    from jax_scaled_arithmetics.quantization import block_quantize

    x = jnp.linspace(-3.0, 5.0, 128).reshape(2, 64)
    tree = {
        "e2m1": block_quantize(x, "float4_e2m1fn", block_size=32),
        "e4m3": block_quantize(x, "float8_e4m3fn", block_size=16, axis=0, pad=True),
        "e2m3": block_quantize(x, "float6_e2m3fn", block_size=32),  # float32-held elements
    }
    state_dict = fs.to_state_dict(tree)
    assert set(state_dict["e2m1"]) == {"data", "scale"}
    zeros = jax.tree_util.tree_map(jnp.zeros_like, tree)
    restored = fs.from_bytes(zeros, fs.to_bytes(tree))
    for name, mx in tree.items():
        got = restored[name]
        assert isinstance(got, type(mx))
        meta = ("format", "block_size", "axis", "length")
        assert [getattr(got, f) for f in meta] == [getattr(mx, f) for f in meta]
        assert_same_bits([got.data, got.scale], [mx.data, mx.scale])
    other_dtype = dict(tree, e2m1=block_quantize(x, "float8_e5m2", block_size=32))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Cannot restore the MXArray at e2m1: its stored data is float4_e2m1fn[2, 64], the "
            "template's is float8_e5m2[2, 64]."
        ),
    ):
        fs.from_bytes(other_dtype, fs.to_bytes(tree))
    other_blocks = dict(tree, e2m1=block_quantize(x, "float4_e2m1fn", block_size=16))
    with pytest.raises(ValueError, match=r"at e2m1: its stored scale is float8_e8m0fnu\[2, 2\]"):
        fs.from_bytes(other_blocks, fs.to_bytes(tree))
    with pytest.raises(ValueError, match=r"MXArray at e2m1: expected a state dict with keys"):
        fs.from_state_dict(tree, dict(state_dict, e2m1={"data": x}))


_FLAX_ROUND_TRIP = """
import sys
{first}
{second}
import jax.numpy as jnp
x = jnp.linspace(-3.0, 5.0, 64)
tree = {{
    "s": jsa.scaled_array(x.astype(jnp.float16), 2.0**-20),
    "m": jsa.quantization.block_quantize(x, "float4_e2m1fn", block_size=32),
}}
back = flax.serialization.from_bytes(tree, flax.serialization.to_bytes(tree))
for a, b in [(back["s"].data, tree["s"].data), (back["s"].scale, tree["s"].scale),
             (back["m"].data, tree["m"].data), (back["m"].scale, tree["m"].scale)]:
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
assert not [f for f in sys.meta_path if type(f).__name__ == "_FlaxSerializationFinder"]
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("flax_first", [True, False], ids=["flax-first", "jsa-first"])
def test_flax_registration_needs_only_the_package(flax_first):
    imports = ["import jax_scaled_arithmetics as jsa", "import flax.serialization"]
    first, second = imports[::-1] if flax_first else imports
    code = _FLAX_ROUND_TRIP.format(first=first, second=second)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
