"""The device lock between concurrent run workers (harness/process/gpu_lock.py): correctness calls share the device,
a timing loop waits for them and holds new ones back, and nobody waits forever behind a hung holder; every
evaluation on one device takes the same lock. Real processes, real flocks."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from dice_kernels.harness.process import gpu_lock
from dice_kernels.harness.config import EvalConfig, SchedulerConfig
from dice_kernels.harness.timing.platform import Platform, device_lock_key
from dice_kernels.harness.runner import Evaluator

HOLD = """
import sys
from dice_kernels.harness.process import gpu_lock
with gpu_lock.{kind}(sys.argv[1]) as held:
    print("held" if held else "not held", flush=True)
    sys.stdin.readline()  # until the test says release
print("released", flush=True)
"""


def _holder(prefix: str, kind: str, expect: str = "held") -> subprocess.Popen:
    """A process that takes the lock and holds it until `_release`; returns once it says whether it got it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(kind=kind), prefix], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if expect:
        assert proc.stdout.readline().strip() == expect
    return proc


def _release(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "released"
    proc.wait()


def test_correctness_calls_share_and_timing_waits_for_them(tmp_path):
    prefix = gpu_lock.create(tmp_path / "gpu")
    reader = _holder(prefix, "shared")
    with gpu_lock.shared(prefix, wait_s=30) as held:  # a second reader gets in while the first holds it
        assert held and reader.poll() is None
    with gpu_lock.exclusive(prefix, wait_s=0.2) as alone:  # the timer cannot have it while a reader holds it
        assert not alone
    _release(reader)
    with gpu_lock.exclusive(prefix, wait_s=30) as alone:  # ...and gets it once the reader is done
        assert alone


def _queued_at_turnstile(prefix: str, timeout_s: float = 30.0) -> bool:
    """True once someone (the timer) holds the turnstile."""
    fd = os.open(f"{prefix}.turnstile", os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                time.sleep(0.01)
            except BlockingIOError:
                return True
        return False
    finally:
        os.close(fd)


def test_a_waiting_timer_holds_new_correctness_calls_back(tmp_path):
    prefix = gpu_lock.create(tmp_path / "gpu")
    reader = _holder(prefix, "shared")
    timer = _holder(prefix, "exclusive", expect="")
    assert _queued_at_turnstile(prefix)  # the timer now waits for the reader, ahead of anyone after it
    with gpu_lock.shared(prefix, wait_s=0.2) as held:  # a new correctness call waits behind the timer...
        assert not held
    _release(reader)
    assert timer.stdout.readline().strip() == "held"  # ...which gets the device once the reader is done
    with gpu_lock.shared(prefix, wait_s=0.2) as held:  # and keeps it for its whole loop
        assert not held
    _release(timer)
    with gpu_lock.shared(prefix, wait_s=30) as held:
        assert held


def test_nobody_waits_forever_behind_a_hung_holder(tmp_path):
    prefix = gpu_lock.create(tmp_path / "gpu")
    timer = _holder(prefix, "exclusive")
    try:
        with gpu_lock.shared(prefix, wait_s=0.3) as held:  # gives up while the holder still holds it
            assert not held and timer.poll() is None
        with gpu_lock.exclusive(prefix, wait_s=0.3) as alone:
            assert not alone
    finally:
        timer.kill()
        timer.wait()
    with gpu_lock.exclusive(prefix, wait_s=2) as alone:  # a dead holder's locks are gone with its files
        assert alone


def test_evaluations_on_one_device_take_one_lock(tmp_path, monkeypatch):
    """Two runs on one device (here the CPU) keep out of each other's timing loops: same lock, own scratch."""
    a, b = (Evaluator(EvalConfig(backend="cpu", cache_dir=tmp_path / name, scheduler=SchedulerConfig(warm_workers=0)),
                      Platform.detect("cpu")) for name in ("a", "b"))
    try:
        assert a.workers.gpu_lock == b.workers.gpu_lock and a.scratch != b.scratch
        assert os.path.basename(os.path.dirname(a.workers.gpu_lock)) == f"dice-kernels-{os.getuid()}"
    finally:
        a.close()
        b.close()
    gpu = Platform("cuda", "NVIDIA H200", "9.0", "2.11.0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_lock_key(gpu) == "cuda-0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert device_lock_key(gpu) == "cuda-1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2c/../x")
    assert device_lock_key(gpu) == "cuda-GPU-8f2c_.._x"  # a file name, never a path


def test_a_shared_folder_open_to_others_is_not_used(tmp_path):
    folder = tmp_path / f"dice-kernels-{os.getuid()}"
    assert gpu_lock.machine_prefix("cpu", root=tmp_path) == folder / "device-cpu"
    folder.chmod(0o777)
    assert gpu_lock.machine_prefix("cpu", root=tmp_path) is None
