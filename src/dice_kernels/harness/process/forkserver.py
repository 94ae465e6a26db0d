"""Workers forked from one process that imported torch once, instead of each importing it itself.

A cold batch starts ~40 workers, and `import torch` costs each 1.5 s of a core or more: on the H200 machine,
with ~24 importing at once, a build worker spent 7-9 s on it while its build waited. The fork server
(`serve`, a process the parent starts with its workers' scrubbed environment)
imports the worker's modules, never initialises CUDA, and forks a fresh worker per request. Each fork is still one
process per job, confined by the worker itself (sandbox.confine) before it reads untrusted code; the server holds
nothing a candidate could use (no job, no reference output, no result) and never runs one. It reaps its children
and relays how they ended.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

# what a fresh worker imports before it reads its job (worker/main.py's imports, the robust check's monitor): a module
# the worker would import only later is left out, so nothing a candidate imports is found already loaded when a
# fresh worker would have imported it under the monitor's eye. Not torch.utils.cpp_extension: with a CUDA build
# of torch (2.11) its import initialises the CUDA driver (a driver thread appears), which a fork cannot carry
PRELOAD = ("dice_kernels.harness.worker.main", "dice_kernels.harness.robust.integrity")
_MAX_MESSAGE = 1 << 20
_READY_TIMEOUT_S = 300.0  # the server's imports, on a machine whose every core is busy compiling
# the server's command line; not `-m` this module, which the package's own imports load first (runpy warns), and
# with faulthandler, so a crash leaves its C-level stack in the server's log
_SERVE = [sys.executable, "-X", "faulthandler", "-c",
          "import sys; from dice_kernels.harness.process.forkserver import serve; serve(int(sys.argv[1]))"]


class ForkServerDown(RuntimeError):
    """The fork server could not start, or is gone: the caller starts its workers the usual way."""


# --- the server process ----------------------------------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _become_worker(sock: socket.socket, request: dict, fds: list[int], ready_w: int) -> None:
    """In the forked child: take the request's pipes as stdio, its directory, environment and priority, then run
    the worker exactly as `python -m dice_kernels.harness.worker.main` would. Never returns."""
    try:
        os.setsid()  # before the server answers: the parent may kill the whole group from then on
        sock.close()
        stdin_r, stdout_w, stderr_w, output_w = fds
        for fd, target in ((stdin_r, 0), (stdout_w, 1), (stderr_w, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**request["env"], request["output_fd_env"]: str(output_w)})
        if request["nice"]:
            os.nice(request["nice"])
        import tempfile

        tempfile.tempdir = None  # computed again from this worker's TMPDIR
        sys.path[0] = request["cwd"]  # where `python -m dice_kernels.harness.worker.main` puts its working directory
        sys.argv = [sys.modules["dice_kernels.harness.worker.main"].__file__]
        os.close(ready_w)
        sys.modules["dice_kernels.harness.worker.main"].main()  # ends with os._exit
    except BaseException:  # noqa: BLE001 - a worker that fails before its job reports on its stderr
        traceback.print_exc()
    os._exit(1)


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    try:
        for name in PRELOAD:
            __import__(name)
        import torch

        if torch.cuda.is_initialized():
            raise ForkServerDown("cannot fork safely: the imports initialised CUDA")
        threads = _threads()
        if threads != 1:  # e.g. a thread the CUDA driver starts: locks it holds would stay held in every fork
            raise ForkServerDown(f"cannot fork safely: {threads} threads after the imports")
    except BaseException as e:  # noqa: BLE001 - said to the parent, which starts its workers itself
        _send(sock, {"error": f"{type(e).__name__}: {e}"})
        return
    _send(sock, {"ready": True})
    while True:
        readable, _, _ = select.select([sock], [], [], 0.02)
        _reap(sock)
        if not readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
        except OSError as e:
            print(f"fork server: stops, the parent's socket failed ({e})", file=sys.stderr)
            return
        if not data:  # the parent closed its end: its children are its own to end
            print("fork server: stops, the parent closed its socket", file=sys.stderr)
            return
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            _become_worker(sock, json.loads(data), fds, ready_w)
        os.close(ready_w)
        for f in fds:
            os.close(f)
        os.read(ready_r, 1)  # EOF once the child has its own session (or has died)
        os.close(ready_r)
        _send(sock, {"forked": pid})


# --- in the parent ---------------------------------------------------------------------------------------


class ForkedProcess:
    """The parts of `subprocess.Popen` that sandbox.supervise and sandbox.discard use, for a worker the fork
    server started: its exit status comes from the server, which is its parent."""

    def __init__(self, server: ForkServer, pid: int, stdin: int, stdout: int, stderr: int):
        self._server = server
        self.pid = pid
        self.stdin = os.fdopen(stdin, "wb")
        self.stdout = os.fdopen(stdout, "rb")
        self.stderr = os.fdopen(stderr, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, timeout_s=0)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            self.returncode = self._server.returncode(self.pid, timeout_s=1.0)
        return self.returncode


class ForkServer:
    """The parent's handle on one fork server: `spawn` asks it for a worker, a thread collects exit statuses."""

    def __init__(self, *, cwd: Path, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cwd.mkdir(parents=True, exist_ok=True)
        self._log = cwd / "forkserver.log"
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen([*_SERVE, str(theirs.fileno())], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=log, pass_fds=(theirs.fileno(),),
                                          start_new_session=True)
        theirs.close()
        self._sock = ours
        self._spawn_lock = threading.Lock()  # one request in flight: the next answer is its pid
        self._state = threading.Condition()
        self._answers: list[dict] = []
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        self.down: str | None = None  # why it cannot fork, once it cannot
        self._serving = False  # from its first answer on: a refusal to start is the caller's to report
        self._closing = False
        threading.Thread(target=self._listen, daemon=True).start()
        self._expect("ready", _READY_TIMEOUT_S)
        self._serving = True

    def _listen(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self._state:
                if not data:
                    self._lost()
                    self._state.notify_all()
                    return
                message = json.loads(data)
                if "exited" in message:
                    self._exits[message["exited"]] = message["returncode"]
                    self._live.discard(message["exited"])
                else:
                    self._answers.append(message)
                self._state.notify_all()

    def _lost(self) -> None:
        """The server is gone (killed, out of memory): its live children were reparented and their statuses will
        never come, so they are ended here and reported as killed."""
        if not self.down:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            self.down = f"the fork server exited ({code}): {self._log_tail()}"
            if self._serving and not self._closing:
                print(f"dice-kernels: workers start without the fork server from now on: {self.down}",
                      file=sys.stderr, flush=True)
        for pid in self._live:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._exits[pid] = -signal.SIGKILL
        self._live.clear()

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self._log.read_text(errors="replace").strip().splitlines()[-lines:]) or "its log is empty"
        except OSError as e:
            return f"no log ({e})"

    def _expect(self, key: str, timeout_s: float) -> dict:
        with self._state:
            if not self._state.wait_for(lambda: self._answers or self.down, timeout=timeout_s):
                self.down = f"the fork server did not answer within {timeout_s:.0f} s"
            if not self._answers:  # an answer it sent before it went is still read: it may say why
                raise ForkServerDown(self.down)
            answer = self._answers.pop(0)
            if key not in answer:
                self.down = answer.get("error", f"unexpected answer {answer}")
                raise ForkServerDown(self.down)
            return answer

    def spawn(self, *, cwd: Path, env: dict[str, str], nice: int, output_fd_env: str,
              output_w: int) -> ForkedProcess:
        """A fresh worker in `cwd` with `env` (plus `output_fd_env` naming `output_w`, its end of the output
        pipe), `nice` lower priority, its own session, and pipes for stdin, stdout and stderr."""
        pipes = [os.pipe() for _ in range(3)]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], output_w]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        request = {"cwd": str(cwd), "env": env, "nice": nice, "output_fd_env": output_fd_env}
        try:
            with self._spawn_lock:
                if self.down:
                    raise ForkServerDown(self.down)
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], theirs)
                except OSError as e:
                    raise ForkServerDown(f"the fork server is gone ({e})") from e
                pid = self._expect("forked", _READY_TIMEOUT_S)["forked"]
                with self._state:
                    if pid not in self._exits:
                        self._live.add(pid)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs[:3]:
                os.close(fd)
        return ForkedProcess(self, pid, *ours)

    def returncode(self, pid: int, timeout_s: float) -> int | None:
        with self._state:
            self._state.wait_for(lambda: pid in self._exits, timeout=timeout_s)
            return self._exits.pop(pid, None)

    def close(self) -> None:
        """Stop the server (its workers are the caller's to end first)."""
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()

