"""FSDP training over 2 processes x 4 CPU devices equals 1 process x 8 devices.

Runs `experiments/distributed/multiprocess.py` (a float16 ScaledArray MLP, weights sharded
over a global `("fsdp",)` mesh, gathered in float8_e4m3fn, gradients reduce-scattered in
bfloat16, Adam through `jsa.optax.scale_optimizer`) twice in fresh interpreters: once as one
process with 8 CPU devices, once as two processes of 4 joined by `jax.distributed` on
localhost (cross-process collectives through gloo). The final parameters (data and scales)
and every device's loss are bit-identical.

The reported loss, the `pmean` of the 8 per-device float32 losses, is compared within
`LOSS_RTOL`: XLA:CPU's in-process all-reduce adds the 8 terms in device order, gloo in
another (measured: up to 2 float32 ulps apart, each the sum of the same bit-identical terms
in some order). The gradients do not depend on that order (each device's loss has the
constant cotangent 1/8). The parameters' sums are order-independent in practice: XLA:CPU
widens the bfloat16 reduce-scatters and all-reduces to float32, where a sum of 8 bfloat16
payloads at one shared scale is exact unless its terms span more than about 13 binades,
and the optimizer's float32 norms only choose powers of two (bit-identical in every run,
over 20 steps too).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import ROOT

STEPS = 5
TIMEOUT_S = 240  # per run; the launcher stops its processes at TIMEOUT_S - 40
# Two sums of the same 8 non-negative float32 terms, in any orders: each within
# 7 * 2^-24 (relative) of the exact sum (7 additions, each rounded).
LOSS_RTOL = 14 * 2.0**-24
# An OS that will not start a process (or more of them) right now.
_CANNOT_SPAWN = {errno.EPERM, errno.EACCES, errno.EAGAIN, errno.ENOMEM, errno.ENOSYS}


def _localhost_usable() -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("localhost", 0))
    except OSError:
        return False
    return True


def _train(tmp_path: Path, processes: int, devices: int) -> dict[str, np.ndarray]:
    """Run the script in a fresh interpreter; process 0's results."""
    out = tmp_path / f"{processes}x{devices}.npz"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["JAX_PLATFORMS"] = "cpu"
    command = [
        sys.executable, "-m", "experiments.distributed.multiprocess",
        "--processes", str(processes),
        "--devices-per-process", str(devices),
        "--steps", str(STEPS),
        "--timeout", str(TIMEOUT_S - 40),
        "--out", str(out),
    ]  # fmt: skip
    try:
        # A session of its own: on a timeout its whole group (the launcher's children
        # too) is stopped.
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    except OSError as error:
        if error.errno in _CANNOT_SPAWN:
            pytest.skip(f"cannot start a process: {error}")
        raise
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{processes} x {devices}: no result in {TIMEOUT_S} s:\n{output}")
    assert proc.returncode == 0, f"{processes} x {devices} failed:\n{output}"
    with np.load(out) as results:
        return dict(results)


# Three fresh interpreters: the slow step. The default run checks the same FSDP program on
# one process's devices (tests/test_sharding.py); this adds JAX's multi-process runtime.
@pytest.mark.slow
def test_two_processes_match_one(tmp_path: Path) -> None:
    if not _localhost_usable():
        pytest.skip("no TCP socket on localhost: the processes cannot reach each other")
    one = _train(tmp_path, 1, 8)
    two = _train(tmp_path, 2, 4)
    assert one.keys() == two.keys()
    assert one["device_losses"].shape == (STEPS, 8)
    assert one["loss"][-1] < one["loss"][0]  # it trains
    for name in sorted(one):
        if name != "loss":
            np.testing.assert_array_equal(two[name], one[name], err_msg=name)
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=LOSS_RTOL, atol=0)
    # Both are sums of the same per-device losses, within the tolerance of their mean.
    mean = np.mean(one["device_losses"].astype(np.float64), axis=1)
    np.testing.assert_allclose(one["loss"], mean, rtol=LOSS_RTOL, atol=0)
