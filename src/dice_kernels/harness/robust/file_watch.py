"""The robust check's watch on files (`disk_persistence`): files a candidate opens while forward's calls, the timed
loop or the re-checked call after it run (Python's audit hook), and files that appeared or changed in its private
directory meanwhile, however they were written (C++ `fopen`, torch's zip writer, raw syscalls). Outputs replayed
from disk need a file written in the run: Landlock leaves the worker no other writable place."""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager
from typing import Callable, Iterator

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# the harness's own writes in the private directory: extensions built late (build_worker), Python's bytecode cache
_HARNESS_DIRS = ("late_builds", "__pycache__")
# where Python reads a module's source on its own: a warning's or traceback's source line (linecache, through
# tokenize.open) and the import system
_SOURCE_READERS = {os.path.join(os.path.dirname(os.__file__), name) for name in ("linecache.py", "tokenize.py")}


def _opened_by_python(frame: types.FrameType | None) -> bool:
    """Did the standard library's source readers call `open` (the frame that called it)?"""
    return frame is not None and (frame.f_code.co_filename in _SOURCE_READERS
                                  or frame.f_code.co_filename.startswith("<frozen importlib"))


def _tree(root: str) -> dict[str, tuple[int, int]]:
    """Every file under `root` but the harness's own directories: relative path -> (size, mtime in ns)."""
    files = {}
    for folder, dirs, names in os.walk(root):
        if folder == root:
            dirs[:] = [d for d in dirs if d not in _HARNESS_DIRS]
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            files[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return files


class FileWatch:
    """Reports (through `found(reason)`) each file the candidate reads or writes while `watching`, but not files
    the harness opens on its behalf (`harness_io`) nor Python reading the candidate's own source; and each file
    that appeared or changed in the private directory between `start()` and `check()`."""

    def __init__(self, candidate_path: str, workdir: str, found: Callable[[str], None]):
        self.candidate_path = os.path.realpath(candidate_path)
        self.workdir = os.path.realpath(workdir)
        self.found = found
        self.watching = False  # the timed loop and the re-checked call (`timed_calls`); forward's calls too
        self._harness = 0  # > 0 while the harness itself works on the candidate's behalf
        self._before: dict[str, tuple[int, int]] | None = None

    @contextmanager
    def harness_io(self) -> Iterator[None]:
        self._harness += 1
        try:
            yield
        finally:
            self._harness -= 1

    def start(self) -> None:
        """The private directory as forward's first call finds it (what __init__ wrote is the candidate's setup)."""
        if self._before is None:
            self._before = _tree(self.workdir)

    def check(self) -> None:
        if self._before is None:
            return
        now = _tree(self.workdir)
        written = sorted(p for p, st in now.items() if self._before.get(p) != st)
        if written:
            more = f" and {len(written) - 1} more" if len(written) > 1 else ""
            self.found(f"forward wrote a file in its directory ({written[0]}{more})")
        self._before = now

    def on_open(self, args: tuple) -> None:
        """An `open` audit event while watching (called from the audit hook: two frames below `open`'s caller)."""
        path, mode, flags = (list(args) + [None, None, None])[:3]
        if isinstance(path, int) or self._harness:
            return
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and mode is None and flags & _WRITE_FLAGS)
        real = os.path.realpath(os.fsdecode(path))
        if not writes and real == self.candidate_path and _opened_by_python(sys._getframe(2)):
            return  # a warning or traceback showing the candidate's own line: Python's doing, not the candidate's
        if writes or real.startswith(self.workdir + os.sep):
            self.found(f"forward {'writes' if writes else 'reads'} a file ({os.path.basename(os.fsdecode(path))})")
