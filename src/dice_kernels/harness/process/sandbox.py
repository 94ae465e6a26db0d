"""Confinement a worker applies to itself before it touches untrusted code, and the parent-side launcher.

The worker (our code) calls `confine()` first thing: resource limits, a private network namespace and a
Landlock ruleset that allows writes only inside its own directories and forbids signalling or ptracing
anything outside. The parent starts workers with `start()` (a scrubbed environment, a new session so the
whole process group can be killed, a private output pipe; forked by forkserver.py or run as an interpreter),
possibly ahead of their job, and runs each with `supervise()`: the job path on stdin, a wall-clock deadline,
a host-memory watchdog and capped output capture.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import site
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

from dice_kernels.harness.process.forkserver import ForkedProcess, ForkServer, ForkServerDown

# Environment variables a worker inherits; everything else (tokens, credentials, proxies) is dropped.
_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
             "PYTHONPATH", "CC", "CXX", "NVCC_CCBIN", "CUDA_DEVICE_ORDER")

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the folder holding dice_kernels/
OUTPUT_CAP = 64 * 1024  # bytes of stdout/stderr kept from each end of a worker's output
OUTPUT_FD_ENV = "DICE_OUTPUT_FD"


@dataclass(frozen=True)
class Limits:
    """What `confine()` enforces inside a worker. Serialised into the job file."""

    memory_bytes: int | None  # RLIMIT_AS; None where the address space must stay open (CUDA reserves terabytes)
    file_bytes: int  # RLIMIT_FSIZE: the largest file the worker may write
    writable: tuple[str, ...]  # directories the worker may write under (Landlock)
    isolate_network: bool = True
    restrict_writes: bool = True


# --- inside the worker ------------------------------------------------------------------------------------

_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _write_access_mask(abi: int) -> int:
    """Landlock filesystem rights that modify the tree (reads and ioctls stay unrestricted)."""
    mask = 0
    for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12):  # WRITE_FILE, REMOVE_*, MAKE_*
        mask |= 1 << bit
    if abi >= 2:
        mask |= 1 << 13  # REFER (link/rename across directories)
    if abi >= 3:
        mask |= 1 << 14  # TRUNCATE
    return mask


def _landlock_restrict_writes(writable: tuple[str, ...]) -> str:
    """Allow writes only beneath `writable`; with ABI >= 6 also scope signals and abstract unix sockets."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return "landlock unavailable"
    handled = _write_access_mask(abi)
    attr = _RulesetAttr(handled, 0, 0b11 if abi >= 6 else 0)  # SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16
    ruleset_fd = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                              ctypes.c_uint32(0))
    if ruleset_fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        file_rights = handled & ((1 << 1) | (1 << 14))  # WRITE_FILE, TRUNCATE: all a file rule may carry
        for path in writable:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(handled if os.path.isdir(path) else file_rights, fd)
                if libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset_fd),
                                ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(rule),
                                ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS) failed")
        if libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset_fd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset_fd)
    return f"landlock abi {abi}"


def _unshare_network() -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) == 0:
        return "network namespace"
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:  # unprivileged: a user namespace grants the right
        return "user+network namespace"
    return "network isolation unavailable"


def confine(limits: Limits) -> list[str]:
    """Apply `limits` to the current process (irreversibly). Returns notes on what was applied."""
    notes = []
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    if limits.memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    if limits.isolate_network:
        notes.append(_unshare_network())
    if limits.restrict_writes:
        notes.append(_landlock_restrict_writes(limits.writable))
    return notes


# --- in the parent ----------------------------------------------------------------------------------------


@dataclass
class WorkerExit:
    returncode: int | None
    timed_out: bool
    memory_exceeded: bool
    wall_s: float
    stdout: str = ""
    stderr: str = ""
    peak_rss_bytes: int = 0
    data: object = None  # what `read_data` returned
    data_error: Exception | None = None

    @property
    def signal_name(self) -> str | None:
        if self.returncode is not None and self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return None


@dataclass
class _CappedReader:
    """Drains a pipe, keeping only the first and last `OUTPUT_CAP` bytes (a candidate may print gigabytes)."""

    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def drain(self, stream) -> None:
        for chunk in iter(lambda: stream.read(65536), b""):
            room = OUTPUT_CAP - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail += chunk
                if len(self.tail) > OUTPUT_CAP:
                    self.dropped += len(self.tail) - OUTPUT_CAP
                    del self.tail[:-OUTPUT_CAP]

    def text(self) -> str:
        mid = f"\n[... {self.dropped} bytes dropped ...]\n" if self.dropped else ""
        return (bytes(self.head).decode(errors="replace") + mid + bytes(self.tail).decode(errors="replace"))


def device_files() -> list[str]:
    """Paths a worker must be able to write besides its own directories: /dev/null, the NVIDIA driver's nodes,
    and any listed in $DICE_SANDBOX_WRITABLE (colon-separated; for drivers or runtimes that need more)."""
    import glob

    extra = [p for p in os.environ.get("DICE_SANDBOX_WRITABLE", "").split(":") if p and os.path.exists(p)]
    # The CUDA driver writes to its own /proc/<pid> entries at initialisation; "/proc/self" is resolved by
    # the worker itself in confine(), so the rule covers the worker's own entry and nobody else's.
    return ["/dev/null", "/proc/self", *sorted(glob.glob("/dev/nvidia*")), *extra]


def scrubbed_env(home: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
    env["PYTHONPATH"] = worker_pythonpath(os.environ.get("PYTHONPATH", ""))
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(HOME=str(home), TMPDIR=str(home), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
               PYTHONNOUSERSITE="1", TRITON_CACHE_DIR=str(home / ".triton"),
               TORCHINDUCTOR_CACHE_DIR=str(home / ".inductor"),
               # PyTorch's own JIT (jiterator, NVRTC) would write compiled kernels under $HOME/.cache/torch, and
               # the CUDA driver its PTX-to-SASS JIT under $HOME/.nv/ComputeCache: the robust check's file watch
               # would charge those writes to the candidate as disk persistence.
               USE_PYTORCH_KERNEL_CACHE="0", CUDA_CACHE_DISABLE="1")
    env.update(extra)
    return env


def worker_pythonpath(parent: str) -> str:
    """The parent's PYTHONPATH for a worker, whose working directory is its private one: relative entries made
    absolute, and the folder this package was imported from added last, so a worker imports the parent's code (a
    `PYTHONPATH=src` run without an install left every worker unable to import the harness, and every candidate
    a `python_error`). Not a site-packages folder (an installed wheel): the interpreter finds that itself, and on
    PYTHONPATH it would come before the standard library, where an old backport (`typing`, `enum34`) would
    shadow it."""
    entries = [os.path.abspath(p) for p in parent.split(os.pathsep) if p]
    sites = {os.path.realpath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    if os.path.realpath(_PACKAGE_ROOT) not in sites:
        entries.append(str(_PACKAGE_ROOT))
    return os.pathsep.join(dict.fromkeys(entries))


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Started:
    """A worker process started ahead of its job: interpreter up, imports done, waiting for a job path on stdin.

    It is still one fresh process per job (never reused); starting it early only hides `import torch`. Its
    private directory and output pipe are made at start, since its environment names them."""

    proc: subprocess.Popen | ForkedProcess
    workdir: Path
    pipe_r: int  # read end of the private output pipe (the worker has the write end as $DICE_OUTPUT_FD)


def start(argv: list[str], *, cwd: Path, env: dict[str, str], nice: int = 0,
          forks: ForkServer | None = None) -> Started:
    """Start a worker that waits for its job (see `Started`): new session, scrubbed env, private output pipe;
    with `nice`, at that lower CPU priority (inherited by every process it starts). With `forks`, the fork
    server forks it (its imports already done) unless that server is down; otherwise `argv` is run."""
    pipe_r, pipe_w = os.pipe()  # non-inheritable: only this child gets it, through pass_fds
    try:
        proc: subprocess.Popen | ForkedProcess | None = None
        if forks is not None and not forks.down:
            try:
                proc = forks.spawn(cwd=cwd, env=env, nice=nice, output_fd_env=OUTPUT_FD_ENV, output_w=pipe_w)
            except ForkServerDown:  # gone since it was asked: this worker starts as an interpreter
                pass
        if proc is None:
            proc = subprocess.Popen(argv, cwd=cwd, env={**env, OUTPUT_FD_ENV: str(pipe_w)}, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    pass_fds=(pipe_w,))
            if nice:
                try:  # before it reads its job: nothing it spawns runs at the old priority
                    os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
                except OSError:  # already gone: supervise reports its death
                    pass
    except BaseException:
        os.close(pipe_r)
        raise
    finally:
        os.close(pipe_w)
    return Started(proc, cwd, pipe_r)


def discard(worker: Started) -> None:
    """Kill a started worker that never got a job and release its pipe."""
    _kill_group(worker.proc)
    worker.proc.wait()
    for stream in (worker.proc.stdin, worker.proc.stdout, worker.proc.stderr):
        if stream:
            stream.close()
    os.close(worker.pipe_r)


def available_memory_bytes() -> int | None:
    """Memory the kernel says can be allocated without swapping (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class StopWorker(Exception):
    """Raised by `supervise`'s `read_data` to end the worker at once: what it would still send or report is not
    wanted (other exceptions let it finish, its stream drained, so its report can say what went wrong)."""


def supervise(worker: Started, job: str, *, timeout_s: float, rss_limit_bytes: int | None = None,
              read_data: Callable[[BinaryIO, Callable[[bytes], None]], object] | None = None) -> WorkerExit:
    """Hand `worker` its job path and run it to completion; kill its whole process group on timeout or when its
    RSS passes the limit. The deadline counts from the hand-over.

    With `read_data`, `read_data(output pipe, reply)` runs concurrently in the parent; its return value (or
    exception) lands in `.data`, and `reply(line)` sends the worker a line on the stdin it got its job from (the
    worker keeps that pipe to itself). Without it the pipe is closed, and a worker writing to it gets EPIPE.
    """
    begin = time.monotonic()
    proc = worker.proc
    try:
        proc.stdin.write(job.encode() + b"\n")
        proc.stdin.flush()
        if read_data is None:
            proc.stdin.close()
    except OSError:  # it died while waiting: supervision below records how
        pass

    def reply(line: bytes) -> None:
        try:
            proc.stdin.write(line)
            proc.stdin.flush()
        except (OSError, ValueError):  # gone (or stdin closed): its exit says why
            pass

    readers = (_CappedReader(), _CappedReader())
    threads = [threading.Thread(target=r.drain, args=(s,), daemon=True)
               for r, s in zip(readers, (proc.stdout, proc.stderr))]
    data: dict[str, object] = {}
    if read_data is not None:
        def _read() -> None:
            with os.fdopen(worker.pipe_r, "rb") as f:
                try:
                    data["value"] = read_data(f, reply)
                except StopWorker as e:
                    data["error"] = e
                    _kill_group(proc)
                except Exception as e:  # noqa: BLE001 - the worker controls these bytes
                    data["error"] = e
                    for _ in iter(lambda: f.read(1 << 20), b""):  # keep draining (in bounded chunks) so the
                        pass                                        # worker never blocks on a full pipe
        threads.append(threading.Thread(target=_read, daemon=True))
    else:
        os.close(worker.pipe_r)
    for t in threads:
        t.start()
    timed_out = memory_exceeded = False
    peak = 0
    while proc.poll() is None:
        if time.monotonic() - begin > timeout_s:
            timed_out = True
        elif rss_limit_bytes:
            peak = max(peak, _rss_bytes(proc.pid))
            memory_exceeded = peak > rss_limit_bytes
        if timed_out or memory_exceeded:
            _kill_group(proc)
            break
        time.sleep(0.05)
    proc.wait()
    _kill_group(proc)  # children a candidate may have left behind in its session
    for t in threads:
        t.join(timeout=5)
    try:
        proc.stdin.close()
    except OSError:
        pass
    return WorkerExit(proc.returncode, timed_out, memory_exceeded, time.monotonic() - begin,
                      readers[0].text(), readers[1].text(), peak, data.get("value"), data.get("error"))


def _kill_group(proc: subprocess.Popen | ForkedProcess) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
