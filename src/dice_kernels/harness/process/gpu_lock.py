"""Who may use the device when, across the concurrent run workers of every evaluation on the machine: correctness
calls share it, a timing loop has it alone. A readers-writer lock on two files (`flock`), with writer priority
through a turnstile so a steady stream of correctness calls cannot starve a timing loop."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator

_POLL_S = 0.001


@dataclass
class Hold:
    """What a lock request got: whether it is held, and the seconds spent waiting for it."""

    held: bool
    waited_s: float = 0.0

    def __bool__(self) -> bool:
        return self.held


def machine_prefix(device_key: str, root: str | Path | None = None) -> Path | None:
    """The lock prefix every evaluation of this user on this machine uses for one device (`device_key`, e.g.
    "cuda-0"), so two runs on one GPU keep out of each other's timing loops too: <tmp>/dice-kernels-<uid>/. None
    when that folder is not safely this user's alone (another owner, or open to others): the caller then keeps a
    lock of its own."""
    folder = Path(root if root is not None else tempfile.gettempdir()) / f"dice-kernels-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return folder / f"device-{device_key}"


def create(prefix: Path) -> str:
    """Make the lock's two files next to `prefix` (done once by the parent); returns what workers are given."""
    for suffix in (".lock", ".turnstile"):
        Path(f"{prefix}{suffix}").touch()
    return str(prefix)


def _acquire(fd: int, op: int, deadline: float) -> bool:
    """Take a flock before the deadline (polling, so a hung holder cannot hang us); False if it never came."""
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)


def _take_shared(lock: int, turnstile: int, deadline: float) -> bool:
    if not _acquire(turnstile, fcntl.LOCK_EX, deadline):  # queue behind any waiting timer
        return False
    fcntl.flock(turnstile, fcntl.LOCK_UN)
    return _acquire(lock, fcntl.LOCK_SH, deadline)


def _take_exclusive(lock: int, turnstile: int, deadline: float) -> bool:
    # the turnstile stays held until release, so correctness calls that arrive meanwhile wait
    return _acquire(turnstile, fcntl.LOCK_EX, deadline) and _acquire(lock, fcntl.LOCK_EX, deadline)


@contextmanager
def _holding(prefix: str | None, wait_s: float, take: Callable[[int, int, float], bool]) -> Iterator[Hold]:
    if not prefix:
        yield Hold(False)
        return
    start = time.monotonic()
    # read-only opens: flock needs no write access, and a worker may write only inside its own directory
    lock = os.open(f"{prefix}.lock", os.O_RDONLY | os.O_CLOEXEC)
    turnstile = os.open(f"{prefix}.turnstile", os.O_RDONLY | os.O_CLOEXEC)
    try:
        held = take(lock, turnstile, start + wait_s)
        yield Hold(held, time.monotonic() - start)
    finally:
        os.close(lock)  # closing releases any flock still held
        os.close(turnstile)


def shared(prefix: str | None, wait_s: float = 60.0) -> ContextManager[Hold]:
    """Use the device alongside other correctness calls, never during another worker's timing loop. Yields a
    `Hold`: not held without a lock, or when `wait_s` passed (the call then goes ahead anyway, since a
    correctness call's result does not depend on the device being quiet)."""
    return _holding(prefix, wait_s, _take_shared)


def exclusive(prefix: str | None, wait_s: float = 120.0) -> ContextManager[Hold]:
    """Have the device alone: wait for running correctness calls to end, hold new ones back, then yield a
    `Hold` (not held without a lock or after `wait_s`, e.g. behind a hung call: timing goes ahead, contended,
    and the caller records it)."""
    return _holding(prefix, wait_s, _take_exclusive)
