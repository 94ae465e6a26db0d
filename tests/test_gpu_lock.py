"""The device lock between concurrent run workers (harness/gpu_lock.py): correctness calls share the device,
a timing loop waits for them and holds new ones back, and nobody waits forever behind a hung holder. Real
processes, real flocks."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from dice_kernels.harness import gpu_lock

HOLD = """
import sys, time
from dice_kernels.harness import gpu_lock
with gpu_lock.{kind}(sys.argv[1]) as held:
    print("held" if held else "not held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(prefix: str, kind: str, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(kind=kind), prefix, str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_correctness_calls_share_and_timing_waits_for_them(tmp_path):
    prefix = gpu_lock.create(tmp_path / "gpu")
    reader = _holder(prefix, "shared", 1.0)
    start = time.monotonic()
    with gpu_lock.shared(prefix, wait_s=5) as held:  # a second reader gets in at once
        assert held and time.monotonic() - start < 0.5
    with gpu_lock.exclusive(prefix, wait_s=10) as alone:  # the timer waits for the other reader to finish
        assert alone and time.monotonic() - start >= 0.8
    reader.wait()


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
    reader = _holder(prefix, "shared", 3.0)
    timer = subprocess.Popen([sys.executable, "-c", HOLD.format(kind="exclusive"), prefix, "1.0"],
                             stdout=subprocess.PIPE, text=True)
    assert _queued_at_turnstile(prefix)  # the timer now waits for the reader, ahead of anyone after it
    start = time.monotonic()
    with gpu_lock.shared(prefix, wait_s=30) as held:
        # not before the reader is done and then the whole timing loop (1 s) has run
        assert held and time.monotonic() - start >= 1.0
    assert timer.stdout.read().strip() == "held"
    timer.wait()
    reader.wait()


def test_nobody_waits_forever_behind_a_hung_holder(tmp_path):
    prefix = gpu_lock.create(tmp_path / "gpu")
    timer = _holder(prefix, "exclusive", 30.0)
    try:
        start = time.monotonic()
        with gpu_lock.shared(prefix, wait_s=0.3) as held:
            assert not held and time.monotonic() - start < 2
        with gpu_lock.exclusive(prefix, wait_s=0.3) as alone:
            assert not alone
    finally:
        timer.kill()
        timer.wait()
    with gpu_lock.exclusive(prefix, wait_s=2) as alone:  # a dead holder's locks are gone with its files
        assert alone
    with gpu_lock.shared(None) as held:
        assert not held
