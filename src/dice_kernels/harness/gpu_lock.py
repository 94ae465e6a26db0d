"""Who may use the device when, across one evaluation's concurrent run workers: correctness calls share it, a
timing loop has it alone. A readers-writer lock on two files (`flock`), with writer priority through a
turnstile so a steady stream of correctness calls cannot starve a timing loop."""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_POLL_S = 0.001


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
def shared(prefix: str | None, wait_s: float = 60.0) -> Iterator[bool]:
    """Use the device alongside other correctness calls, never during another worker's timing loop. Yields
    whether the lock was held (False without a lock, or when `wait_s` passed: the call then goes ahead anyway,
    since a correctness call's result does not depend on the device being quiet)."""
    if not prefix:
        yield False
        return
    deadline = time.monotonic() + wait_s
    with _files(prefix) as (lock, turnstile):
        held = _acquire(turnstile, fcntl.LOCK_EX, deadline)  # queue behind any waiting timer
        if held:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            held = _acquire(lock, fcntl.LOCK_SH, deadline)
        yield held


@contextmanager
def exclusive(prefix: str | None, wait_s: float = 120.0) -> Iterator[bool]:
    """Have the device alone: wait for running correctness calls to end, hold new ones back, then yield whether
    that worked (False without a lock or after `wait_s`, e.g. behind a hung call: timing goes ahead, contended,
    and the caller records it)."""
    if not prefix:
        yield False
        return
    deadline = time.monotonic() + wait_s
    with _files(prefix) as (lock, turnstile):
        yield _acquire(turnstile, fcntl.LOCK_EX, deadline) and _acquire(lock, fcntl.LOCK_EX, deadline)
