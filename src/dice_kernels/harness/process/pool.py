"""The parent's side of the sandboxed workers: a pool of workers started ahead of their job (forked from the fork
server, forkserver.py, when it runs), one fresh worker per job, and `Workers.run_job`, which hands a worker its
job (protocol.py), supervises it (sandbox.py), reads its output frames (tensor_stream.py) and its report."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dice_kernels.harness.process import gpu_lock, sandbox
from dice_kernels.harness.compare import TrialJudge
from dice_kernels.harness.config import EvalConfig, total_memory_gib
from dice_kernels.harness.process.forkserver import ForkServer, ForkServerDown
from dice_kernels.harness.process.host_memory import OutputsDeferred
from dice_kernels.harness.outcomes import Outcome
from dice_kernels.harness.timing.platform import Platform, device_lock_key
from dice_kernels.harness.process.protocol import Job, RunJob, write_job
from dice_kernels.harness.process.tensor_stream import OutputsTooLarge, read_trials
from dice_kernels.harness.timing.loop import tensor_bytes

_WORKER = "dice_kernels.harness.worker.main"

# host memory exhausted (a worker over --sandbox-memory-limit-gb, outputs too large): not a CUDA fault
MEMORY_ERROR = Outcome.MEMORY_ERROR


class WorkersCannotStart(RuntimeError):
    """A worker cannot import the harness in its environment: every candidate would fail alike (and be charged
    for it), so the evaluation stops instead."""


def worker_import_failure(env: dict[str, str], cwd: Path) -> str | None:
    """Why a worker's interpreter, in `env` and `cwd`, cannot import the worker module (its traceback's end), or
    None when it can."""
    done = subprocess.run([sys.executable, "-c", f"import {_WORKER}"], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    return None if done.returncode == 0 else (done.stderr or done.stdout)[-1500:].strip() or f"exit {done.returncode}"


@dataclass
class WorkerReport:
    result: dict | None  # result.json, or None when the worker died before reporting
    exit: sandbox.WorkerExit
    workdir: Path


class Workers:
    """Worker processes for one `Evaluator`: started ahead of their job per mode ("run", and "build" at
    `build.nice`), each used for exactly one job, all killed on `close`."""

    def __init__(self, config: EvalConfig, platform: Platform, scratch: Path):
        self.config, self.platform, self.scratch = config, platform, scratch
        # shared with every other evaluation on this device (a private one if the shared folder is unsafe)
        shared = gpu_lock.machine_prefix(device_lock_key(platform))
        self.gpu_lock = gpu_lock.create(shared or scratch / "gpu")
        self._seq = 0
        self._seq_lock = threading.Lock()
        self.ready: dict[str, deque[sandbox.Started]] = {"run": deque(), "build": deque()}
        self._ready_lock = threading.Lock()
        self.server: ForkServer | None = None  # forkserver.py: workers forked with their imports done
        self._server_lock = threading.Lock()
        self.server_down: str | None = None  # why workers are not forked, when the server failed to start

    def warm_up(self, builds: int = 0) -> None:
        """Start the configured number of run workers ahead of their jobs (scheduler.warm_workers), and of build
        workers (build.warm_workers), as many as `builds` to come leave for after the first `jobs`."""
        wanted = {"run": self.config.scheduler.resolved_warm_workers(self.platform.backend, self.platform.gpu_memory_gib),
                  "build": min(self.config.build.warm_workers, max(0, builds - self.config.build.jobs))}
        with self._ready_lock:
            for mode, n in wanted.items():
                while len(self.ready[mode]) < n:
                    self.ready[mode].append(self._start(self._nice(mode)))

    def _nice(self, mode: str) -> int:
        return self.config.build.nice if mode == "build" else 0

    def _new_workdir(self) -> Path:
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        d = self.scratch / f"{seq:06d}"
        d.mkdir(mode=0o700, parents=True)
        return d

    def env(self, home: Path) -> dict[str, str]:
        """A worker's environment: scrubbed, with its own extension directory, threads and CUDA arch."""
        extra_env = {"TORCH_EXTENSIONS_DIR": str(home / "torch_extensions"), "MAX_JOBS": "2",
                     "OMP_NUM_THREADS": str(self.config.scheduler.cpu_threads)}
        if self.platform.backend == "cuda":
            extra_env["TORCH_CUDA_ARCH_LIST"] = self.platform.cuda_arch
        return sandbox.scrubbed_env(home, extra_env)

    def _fork_server(self) -> ForkServer | None:
        """The fork server (scheduler.fork_workers), started on first use; None where it is off or failed to
        start (then every worker imports torch itself, and stderr and `server_down` say why)."""
        with self._server_lock:
            if self.config.scheduler.fork_workers and self.server is None and self.server_down is None:
                home = self.scratch / "forkserver"
                try:
                    self.server = ForkServer(cwd=home, env=self.env(home))
                except (ForkServerDown, OSError) as e:
                    # a server that failed on the harness's own imports would leave every worker failing the same
                    home.mkdir(parents=True, exist_ok=True)
                    if why := worker_import_failure(self.env(home), home):
                        raise WorkersCannotStart(
                            f"sandboxed workers cannot import the harness ({why.splitlines()[-1]}); install "
                            "dice-kernels into this Python (pip install -e .) or put its src/ folder on "
                            "PYTHONPATH") from e
                    self.server_down = str(e)
                    print(f"dice-kernels: workers start without the fork server: {e}", file=sys.stderr, flush=True)
            return self.server

    def _start(self, nice: int = 0) -> sandbox.Started:
        workdir = self._new_workdir()
        return sandbox.start(sandbox.python_argv(_WORKER), cwd=workdir, env=self.env(workdir), nice=nice,
                             forks=self._fork_server())

    def take(self, mode: str = "run") -> sandbox.Started:
        """A fresh worker for one job, never one that already ran a job: one started earlier (its imports done or
        under way) when there is one, and a replacement is started at once. Build workers run at `build.nice`
        (the compilers they spawn inherit it), so compiles on every core never starve the run workers' trials
        and timing."""
        with self._ready_lock:
            ready = self.ready[mode]
            worker = ready.popleft() if ready else None
            if worker is not None:
                ready.append(self._start(self._nice(mode)))
        if worker is not None and worker.proc.poll() is not None:  # died while waiting (e.g. out of memory)
            sandbox.discard(worker)
            cleanup(worker.workdir)
            worker = None
        return worker or self._start(self._nice(mode))

    def limits(self, workdir: Path, writable_build: str | None = None) -> dict:
        """sandbox.Limits for a job in `workdir` (its fields, as the job carries them)."""
        cfg = self.config
        writable = [str(workdir), *sandbox.device_files(), *([writable_build] if writable_build else [])]
        limits = sandbox.Limits(memory_bytes=None if self.platform.backend == "cuda" else cfg.sandbox.memory_limit_bytes,
                                file_bytes=cfg.sandbox.file_limit_mb << 20, writable=tuple(writable),
                                isolate_network=cfg.sandbox.isolate_network, restrict_writes=cfg.sandbox.restrict_writes)
        return {**limits.__dict__, "writable": list(limits.writable)}

    def run_job(self, mode: str, job: Callable[[Path], Job], *, task_code: str | None, code: str | None,
                timeout_s: float, judge: TrialJudge | None = None, max_output_bytes: int | None = None,
                admit: Callable[[int], None] | None = None) -> WorkerReport:
        """Run one job in a fresh worker of `mode` ("build" or "run"): `job(workdir)` makes it once the worker's
        directory is known (the task's code is in workdir/task.py, the candidate's in workdir/candidate.py). A
        run job's output frames are read as they come (`_read_outputs`); the report is the worker's result.json."""
        worker = self.take(mode)
        workdir = worker.workdir
        if task_code is not None:
            (workdir / "task.py").write_text(task_code)
        if code is not None:
            (workdir / "candidate.py").write_text(code)
        spec = job(workdir)
        write_job(spec, workdir / "job.json")
        cap = self.config.sandbox.memory_limit_bytes
        read_data = None
        if isinstance(spec, RunJob):
            # one frame (a trial's outputs) at most what a worker may hold; all frames at most what the caller allows
            limits = OutputLimits(cap, max_output_bytes or (spec.trials + 1) * cap, spec.trials)
            read_data = lambda f, reply: _read_outputs(f, limits, judge, reply, admit)  # noqa: E731
        exit_ = sandbox.supervise(worker, str(workdir / "job.json"), timeout_s=timeout_s, rss_limit_bytes=cap,
                                  read_data=read_data)
        result = None
        try:
            result = json.loads((workdir / "result.json").read_text())
        except (OSError, ValueError):
            pass
        return WorkerReport(result if isinstance(result, dict) else None, exit_, workdir)

    def run(self, job: Callable[[Path], RunJob], task_code: str, code: str | None, run_timeout_s: float,
            judge: TrialJudge | None = None, max_output_bytes: int | None = None,
            admit: Callable[[int], None] | None = None) -> tuple[dict, list | None]:
        """Run a model (the reference when `code` is None); returns (report, outputs or None). A candidate's trials
        go to `judge` as they arrive (its outputs are then only the re-checked call's). `max_output_bytes` bounds
        everything the worker may send (default: trials + 1 frames of `sandbox.memory_limit_gb`); `admit` sees the first
        frame's size and may stop the worker (OutputsDeferred: the report's status is then "deferred")."""
        rep = self.run_job("run", job, task_code=task_code, code=code, timeout_s=run_timeout_s, judge=judge,
                           max_output_bytes=max_output_bytes, admit=admit)
        outputs = None
        res = rep.result
        if isinstance(rep.exit.data_error, OutputsDeferred):
            res = {"status": "deferred", "need": rep.exit.data_error.need, "error": str(rep.exit.data_error)}
        elif isinstance(rep.exit.data_error, OutputsTooLarge):  # a memory limit, like a worker over its own
            res = {"status": "error", "kind": MEMORY_ERROR.value,
                   "error": f"outputs too large: {rep.exit.data_error}"}
        elif res is None:
            kind, error = death_outcome(rep.exit, self.config, phase="run", timeout_s=run_timeout_s)
            res = {"status": "error", "kind": kind.value, "error": error}
        elif res.get("status") == "ok":
            outputs = rep.exit.data
            if outputs is None:
                why = rep.exit.data_error or "no outputs were sent"
                res = {"status": "error", "kind": Outcome.RUNTIME_ERROR.value, "error": f"worker outputs unreadable: {why}"}
        cleanup(rep.workdir)
        return res, outputs

    def close(self) -> None:
        with self._ready_lock:
            for ready in self.ready.values():
                while ready:
                    sandbox.discard(ready.popleft())
        with self._server_lock:
            if self.server is not None:
                self.server.close()


@dataclass(frozen=True)
class OutputLimits:
    """Bytes a run worker may send: per frame (one trial's outputs) and in all; and how many trial frames come.
    A frame is also refused when reading it would leave the machine less than `reserve` of available memory:
    the worker's outputs then fail with a clear error instead of the kernel's OOM killer taking the parent (and
    every worker in flight) down."""

    frame: int
    total: int
    trials: int
    reserve: int = 2 << 30

    def next_frame(self, received: int) -> int:
        cap = min(self.frame, self.total - received)
        available = sandbox.available_memory_bytes()
        return cap if available is None else max(0, min(cap, available - self.reserve))

    def explain(self, received: int) -> str:
        available = sandbox.available_memory_bytes()
        room = "" if available is None else f", {available / 2**30:.1f} GiB of memory available to the parent"
        return (f"a frame may be {self.frame / 2**30:g} GiB (--sandbox-memory-limit-gb), all frames "
                f"{self.total / 2**30:.1f} GiB, {received / 2**30:.1f} GiB already received{room}")


def _read_outputs(f, limits: OutputLimits, judge: TrialJudge | None, reply: Callable[[bytes], None],
                  admit: Callable[[int], None] | None = None) -> list | None:
    """A run worker's frames: one per correctness trial, sent as each trial ends, and then one for the re-checked
    call (empty without timing); None unless every trial's frame came. A reference's trials are kept and
    returned before the re-checked call's outputs. A candidate's go to `judge` one by one and only the re-checked
    call's are returned; the worker waits after its trials for the verdict on them (b"time" or b"stop").
    `admit` sees the first frame's size before it is read."""
    kept, received, n, go = [], 0, 0, False
    try:
        while n < limits.trials:
            frame = _read_frame(f, limits, received, admit if n == 0 else None)
            if frame is None:  # the worker ended before its last trial: its report says why
                return None
            received, n = received + tensor_bytes(frame), n + len(frame)
            for outs in frame:
                if judge is None:
                    kept.append(outs)
                else:
                    judge.add(outs)
        go = judge is None or judge.comparison().outcome is Outcome.CORRECT
    finally:  # always answer, unreadable trials included: a worker left waiting would only run into its deadline
        if judge is not None:
            reply(b"time\n" if go else b"stop\n")
    rest = _read_frame(f, limits, received)
    return kept + (rest or [])


def _read_frame(f, limits: OutputLimits, received: int, admit: Callable[[int], None] | None = None) -> list | None:
    try:
        return read_trials(f, limits.next_frame(received), admit)
    except OutputsTooLarge as e:
        raise OutputsTooLarge(f"{e} ({limits.explain(received)})") from None


def cleanup(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)


def death_outcome(exit_: sandbox.WorkerExit, cfg: EvalConfig, phase: str, timeout_s: float) -> tuple[Outcome, str]:
    """Outcome for a worker that ended without writing its report (`timeout_s`: its wall-clock limit)."""
    tail = (exit_.stderr or exit_.stdout)[-1500:].strip()
    if exit_.timed_out:
        return Outcome.TIMEOUT, f"{phase} exceeded the {timeout_s:.4g}s wall-clock limit"
    if exit_.memory_exceeded:
        return MEMORY_ERROR, (f"exceeded the host memory limit of {cfg.sandbox.memory_limit_gb:g} GiB (--sandbox-memory-limit-gb; "
                              f"this machine has {total_memory_gib() or 0:.1f} GiB)")
    sig = exit_.signal_name
    if sig == "SIGXFSZ":
        return Outcome.RUNTIME_ERROR, f"wrote a file larger than the {cfg.sandbox.file_limit_mb} MiB limit"
    if sig == "SIGKILL" and exit_.peak_rss_bytes * 2 > cfg.sandbox.memory_limit_bytes:
        # not ours (a timeout or the watchdog says so above), and it held much memory: the OS's OOM killer
        return MEMORY_ERROR, (f"killed by the operating system (SIGKILL) at {exit_.peak_rss_bytes / 2**30:.1f} GiB "
                              "resident, most likely its out-of-memory killer: lower --sandbox-memory-limit-gb (now "
                              f"{cfg.sandbox.memory_limit_gb:g} GiB) or run fewer workers")
    if sig:
        kind = (Outcome.CUDA_MEMORY_ERROR if cfg.resolved_backend() == "cuda" else MEMORY_ERROR) \
            if "memory" in tail.lower() else Outcome.RUNTIME_ERROR
        return kind, f"worker crashed with {sig}" + (f": {tail}" if tail else "")
    kind = Outcome.PYTHON_ERROR if phase == "build" else Outcome.RUNTIME_ERROR
    return kind, f"worker exited with code {exit_.returncode} without reporting (os._exit or abort?)" + (
        f": {tail}" if tail else "")
