"""Who may use the device when, across one evaluation's concurrent run workers: correctness calls share it, a
timing loop has it alone. A readers-writer lock on two files (`flock`), with writer priority through a
turnstile so a steady stream of correctness calls cannot starve a timing loop."""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

_POLL_S = 0.001


@dataclass
class Hold:
    """What a lock request got: whether it is held, and the seconds spent waiting for it."""

    held: bool
    waited_s: float = 0.0

    def __bool__(self) -> bool:
        return self.held


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


@contextmanager
def _files(prefix: str) -> Iterator[tuple[int, int]]:
    # read-only opens: flock needs no write access, and a worker may write only inside its own directory
    lock = os.open(f"{prefix}.lock", os.O_RDONLY | os.O_CLOEXEC)
    turnstile = os.open(f"{prefix}.turnstile", os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield lock, turnstile
    finally:
        os.close(lock)  # closing releases any flock still held
        os.close(turnstile)


@contextmanager
def shared(prefix: str | None, wait_s: float = 60.0) -> Iterator[Hold]:
    """Use the device alongside other correctness calls, never during another worker's timing loop. Yields a
    `Hold`: not held without a lock, or when `wait_s` passed (the call then goes ahead anyway, since a
    correctness call's result does not depend on the device being quiet)."""
    if not prefix:
        yield Hold(False)
        return
    start = time.monotonic()
    deadline = start + wait_s
    with _files(prefix) as (lock, turnstile):
        held = _acquire(turnstile, fcntl.LOCK_EX, deadline)  # queue behind any waiting timer
        if held:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            held = _acquire(lock, fcntl.LOCK_SH, deadline)
        yield Hold(held, time.monotonic() - start)


@contextmanager
def exclusive(prefix: str | None, wait_s: float = 120.0) -> Iterator[Hold]:
    """Have the device alone: wait for running correctness calls to end, hold new ones back, then yield a
    `Hold` (not held without a lock or after `wait_s`, e.g. behind a hung call: timing goes ahead, contended,
    and the caller records it)."""
    if not prefix:
        yield Hold(False)
        return
    start = time.monotonic()
    deadline = start + wait_s
    with _files(prefix) as (lock, turnstile):
        held = _acquire(turnstile, fcntl.LOCK_EX, deadline) and _acquire(lock, fcntl.LOCK_EX, deadline)
        yield Hold(held, time.monotonic() - start)
