"""`evaluate()`: the evaluation pipeline for a batch of (task, candidate) pairs.

Builds run in a thread pool (one sandboxed build worker each, content-addressed cache) while a pool of run threads
runs references and candidates in fresh sandboxed workers (a task whose outputs do not fit beside other tasks'
waits its turn: host_memory.py), compares their outputs with the reference's, and records each result in the
store the moment it is known.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from dice_kernels import __version__
from dice_kernels.harness import gpu_lock, sandbox
from dice_kernels.harness.baselines import Baseline, BaselineStore, baseline_key
from dice_kernels.harness.build_speed import announce_pch, build_pch, pch_variants, plan_pch, planned_pch
from dice_kernels.harness.candidate import Candidate
from dice_kernels.harness.compare import Comparison, TrialJudge, explain_mismatch, outputs_match
from dice_kernels.harness.config import EvalConfig
from dice_kernels.harness.degenerate import degenerate_flags
from dice_kernels.harness.forkserver import ForkServer, ForkServerDown
from dice_kernels.harness.host_memory import OutputLedger, OutputsDeferred, task_need_bytes
from dice_kernels.harness.outcomes import DeceptiveKind, EvalResult, Outcome
from dice_kernels.harness.store import ResultStore
from dice_kernels.harness.tensor_stream import OutputsTooLarge, read_trials
from dice_kernels.harness.timing import (Ceilings, TimingSamples, effective_time_ms, faster_than_light,
                                         reference_flops_ms, reference_time_ms, speed_of_light_ms, speedup_interval,
                                         stream_escape, tensor_bytes)
from dice_kernels.tasks import Task

_WORKER = "dice_kernels.harness.worker"


@dataclass(frozen=True)
class Platform:
    """The machine and software a run measures on; part of every result and of the build-cache key."""

    backend: str
    hardware: str
    cuda_arch: str  # "9.0" on an H200; "" on the CPU backend
    torch_version: str
    gpu_memory_gib: float = 0.0  # the GPU's memory (how many run workers it holds at once); 0 on the CPU backend

    @classmethod
    def detect(cls, backend: str) -> "Platform":
        if backend == "cuda":
            name, arch, memory_gib = _gpu_name_arch_memory()
            return cls("cuda", name, arch, torch.__version__, memory_gib)
        return cls("cpu", _cpu_name(), "", torch.__version__)


def _first_visible_gpu() -> str:
    """The GPU workers see as cuda:0: CUDA_VISIBLE_DEVICES' first entry (an index or a UUID; "0" when unset)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"


def device_lock_key(platform: Platform) -> str:
    """The device an evaluation's workers use, named as every evaluation on this machine names it: "cpu", or
    "cuda-" plus `_first_visible_gpu()`."""
    if platform.backend != "cuda":
        return "cpu"
    return "cuda-" + re.sub(r"[^A-Za-z0-9_.-]", "_", _first_visible_gpu())


def _gpu_name_arch_memory() -> tuple[str, str, float]:
    # the GPU the workers will see first, named as nvidia-smi -i takes it; nvidia-smi keeps the parent free of a
    # CUDA context
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,memory.total",
                               "--format=csv,noheader,nounits", "-i", _first_visible_gpu()],
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        name, cap, mib = (s.strip() for s in line.rsplit(",", 2))
        # "[N/A]" where the driver does not say (MIG instances): counted as a small GPU
        return name, cap, round(float(mib) / 1024, 1) if mib.replace(".", "", 1).isdigit() else 0.0
    except (OSError, subprocess.SubprocessError, ValueError):
        major, minor = torch.cuda.get_device_capability(0)
        memory = torch.cuda.get_device_properties(0).total_memory
        return torch.cuda.get_device_name(0), f"{major}.{minor}", round(memory / (1 << 30), 1)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class _Build:
    """Outcome of building one distinct candidate program (shared by identical candidates)."""

    dir: Path | None
    ok: bool
    kind: str = ""
    error: str = ""
    compile_s: float = 0.0
    cache_hit: bool = False
    shortcuts: list = field(default_factory=list)  # build_speed savings per extension (worker BuildLog)
    wall_s: float = 0.0  # this run's wall time for the build (near zero on a cache hit)
    started_s: float = 0.0  # when it started, in seconds since the evaluation began (Evaluator.began)


@dataclass
class _Reference:
    outputs: list | None  # per correctness trial
    time_ms: float | None
    error: str = ""
    timing: dict = field(default_factory=dict)  # timing.TimingSamples.to_dict() of the reference
    timing_outputs: list | None = None  # the last timing-loop call's outputs (with timing on)
    degenerate: dict = field(default_factory=dict)  # degenerate.degenerate_flags
    output_findings: frozenset[str] = frozenset()  # aliasing/mutation the reference itself shows (not cheats)
    # its outputs depend on the calls before (a second call on the same inputs differs): the call after a timing
    # loop, which ran another number of calls than a candidate's, cannot be re-checked against a candidate's
    stateful: bool = False
    wall_s: float = 0.0
    compile_baseline: dict = field(default_factory=dict)  # torch.compile(Model) timing, or {"error": ...}
    sol: dict = field(default_factory=dict)  # the task's FLOPs, minimum bytes moved and dtype (worker._speed_of_light)
    baseline_from: str = ""  # when the timing above was measured, if it came from the baseline cache ("" = now)
    retried: str = ""  # the first run's failure when the reference ran twice ("" = it ran once)
    deferred_need: int = 0  # bytes its outputs need, when they did not fit beside other tasks' (host_memory.py)
    waited_for_memory_s: float = 0.0  # how long the task waited for other tasks' outputs to be released


@dataclass
class _WorkerReport:
    result: dict | None  # result.json, or None when the worker died before reporting
    exit: sandbox.WorkerExit
    workdir: Path


@dataclass
class Evaluator:
    """A long-lived evaluation session: platform, scratch space, warm workers and fork server, build cache,
    baselines and ceilings are set up once and serve every `evaluate` call until `close` (or the `with` block's
    end). The RL reward service keeps one for a whole training run:

        with Evaluator(config) as ev:
            results = ev.evaluate(pairs)  # list[EvalResult], input order; call it as often as needed
    """

    config: EvalConfig
    platform: Platform | None = None  # detected from config.backend when not given
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dice-eval-")))
    pch: dict[str, str] = field(default_factory=dict)  # build_speed.planned_pch: headers build workers may use
    pch_light: dict[str, str] = field(default_factory=dict)  # the same for the light header
    pch_compiler: str | None = None  # build_speed.announce_pch: while some of them are being built
    _seq: int = 0
    _seq_lock: threading.Lock = field(default_factory=threading.Lock)
    # started workers waiting for a job (sandbox.Started), per mode: "run", and "build" (at build_nice)
    _ready: dict[str, deque] = field(default_factory=lambda: {"run": deque(), "build": deque()})
    _ready_lock: threading.Lock = field(default_factory=threading.Lock)
    _forks: ForkServer | None = None  # forkserver.py: workers forked with their imports done
    _forks_lock: threading.Lock = field(default_factory=threading.Lock)
    fork_server_down: str | None = None  # why workers are not forked, when the server failed to start
    began: float = field(default_factory=time.monotonic)  # the clock the results' `timeline_s` counts from

    def __post_init__(self) -> None:
        self.config.check()
        if self.platform is None:
            self.platform = Platform.detect(self.config.resolved_backend())
        self._batch_lock = threading.Lock()  # one batch at a time: a batch owns the run and build pools
        # shared with every other evaluation on this device (a private one if the shared folder is unsafe)
        shared = gpu_lock.machine_prefix(device_lock_key(self.platform))
        self.gpu_lock = gpu_lock.create(shared or self.scratch / "gpu")
        self._ceilings_lock = threading.Lock()
        self.ceilings = self._read_ceilings().get(self._ceilings_key(), {})  # dtype -> Ceilings, cached across runs
        self.baselines = BaselineStore(self.config.cache_dir / "baselines.sqlite")

    # --- hardware ceilings (speed of light) ------------------------------------------------------------------

    def _ceilings_file(self) -> Path:
        return self.config.cache_dir / "ceilings.json"

    def _ceilings_key(self) -> str:
        return f"{self.platform.backend}|{self.platform.hardware}|torch {self.platform.torch_version}"

    def _read_ceilings(self) -> dict[str, dict[str, Ceilings]]:
        """Measured ceilings per machine key and dtype, cached across runs in the build cache's folder (measuring
        takes seconds on a GPU: a 1 GiB copy and an 8192^3 matmul)."""
        try:
            everything = json.loads(self._ceilings_file().read_text())
            return {key: {dtype: Ceilings(**c) for dtype, c in per_dtype.items()}
                    for key, per_dtype in everything.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def remember_ceilings(self, dtype: str, measured: list[dict]) -> None:
        """Merge measurements into the cache. Ceilings only ever go up: every measurement is a rate the machine
        reached, so the highest one seen is the tightest valid bound, and one taken under load cannot lower it."""
        with self._ceilings_lock:
            everything = self._read_ceilings()  # again: another run may have written since this one started
            known = everything.setdefault(self._ceilings_key(), {})
            for c in (Ceilings(**m) for m in measured):
                old = known.get(dtype, c)
                known[dtype] = Ceilings(max(old.bandwidth_bytes_s, c.bandwidth_bytes_s),
                                        max(old.peak_flops, c.peak_flops), dtype)
            self.ceilings = known
            path = self._ceilings_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({key: {d: asdict(c) for d, c in per_dtype.items()}
                                       for key, per_dtype in everything.items()}, indent=1))
            os.replace(tmp, path)

    def warm_up(self, builds: int = 0) -> None:
        """Start the configured number of run workers ahead of their jobs (EvalConfig.warm_workers), and of build
        workers (EvalConfig.warm_build_workers), as many as `builds` to come leave for after the first `jobs`."""
        wanted = {"run": self.config.resolved_warm_workers(self.platform.backend, self.platform.gpu_memory_gib),
                  "build": min(self.config.warm_build_workers, max(0, builds - self.config.jobs))}
        with self._ready_lock:
            for mode, n in wanted.items():
                while len(self._ready[mode]) < n:
                    self._ready[mode].append(self._start_worker(self._nice(mode)))

    def _nice(self, mode: str) -> int:
        return self.config.build_nice if mode == "build" else 0

    # --- workers ------------------------------------------------------------------------------------------

    def _fingerprint(self) -> str:
        return json.dumps({"harness": __version__, "torch": self.platform.torch_version,
                           "backend": self.platform.backend, "arch": self.platform.cuda_arch,
                           "cuda": torch.version.cuda}, sort_keys=True)

    def _new_workdir(self) -> Path:
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        d = self.scratch / f"{seq:06d}"
        d.mkdir(mode=0o700, parents=True)
        return d

    def _worker_env(self, home: Path) -> dict[str, str]:
        extra_env = {"TORCH_EXTENSIONS_DIR": str(home / "torch_extensions"), "MAX_JOBS": "2",
                     "OMP_NUM_THREADS": str(self.config.cpu_threads)}
        if self.platform.backend == "cuda":
            extra_env["TORCH_CUDA_ARCH_LIST"] = self.platform.cuda_arch
        return sandbox.scrubbed_env(home, extra_env)

    def _fork_server(self) -> ForkServer | None:
        """The fork server (EvalConfig.fork_workers), started on first use; None where it is off or failed to
        start (then every worker imports torch itself, as before, and stderr and `fork_server_down` say why)."""
        with self._forks_lock:
            if self.config.fork_workers and self._forks is None and self.fork_server_down is None:
                home = self.scratch / "forkserver"
                try:
                    self._forks = ForkServer(cwd=home, env=self._worker_env(home))
                except (ForkServerDown, OSError) as e:
                    self.fork_server_down = str(e)
                    print(f"dice-kernels: workers start without the fork server: {e}", file=sys.stderr, flush=True)
            return self._forks

    def _start_worker(self, nice: int = 0) -> sandbox.Started:
        workdir = self._new_workdir()
        return sandbox.start(sandbox.python_argv(_WORKER), cwd=workdir, env=self._worker_env(workdir), nice=nice,
                             forks=self._fork_server())

    def _take_worker(self, mode: str = "run") -> sandbox.Started:
        """A fresh worker for one job, never one that already ran a job: one started earlier (its imports done or
        under way) when there is one, and a replacement is started at once. Build workers run at `build_nice`
        (the compilers they spawn inherit it), so compiles on every core never starve the run workers' trials
        and timing."""
        with self._ready_lock:
            ready = self._ready[mode]
            worker = ready.popleft() if ready else None
            if worker is not None:
                ready.append(self._start_worker(self._nice(mode)))
        if worker is not None and worker.proc.poll() is not None:  # died while waiting (e.g. out of memory)
            sandbox.discard(worker)
            _cleanup(worker.workdir)
            worker = None
        return worker or self._start_worker(self._nice(mode))

    def _run_worker(self, *, mode: str, role: str, task: Task, code: str | None, build_dir: Path | None,
                    writable_build: bool, timeout_s: float, lead_ms: float | None = None,
                    baseline_cached: bool = False, judge: TrialJudge | None = None,
                    max_output_bytes: int | None = None, admit: Callable[[int], None] | None = None) -> _WorkerReport:
        cfg = self.config
        worker = self._take_worker(mode)
        workdir = worker.workdir
        (workdir / "task.py").write_text(task.code)
        if code is not None:
            (workdir / "candidate.py").write_text(code)
        cuda = self.platform.backend == "cuda"
        writable = [str(workdir), *sandbox.device_files()]
        if writable_build and build_dir is not None:
            writable.append(str(build_dir))
        limits = sandbox.Limits(memory_bytes=None if cuda else cfg.memory_limit_bytes,
                                file_bytes=cfg.file_limit_mb << 20, writable=tuple(writable),
                                isolate_network=cfg.isolate_network, restrict_writes=cfg.restrict_writes)
        job = {"mode": mode, "role": role, "workdir": str(workdir), "task_path": str(workdir / "task.py"),
               "candidate_path": str(workdir / "candidate.py") if code is not None else None,
               "build_dir": str(build_dir) if build_dir else None, "device": "cuda" if cuda else "cpu",
               "seed": cfg.seed, "trials": cfg.trials, "timing": cfg.timing and mode == "run",
               "timing_plan": cfg.timing_plan(lead_ms), "gpu_lock": self.gpu_lock,
               "limits": {**limits.__dict__, "writable": list(limits.writable)}, "atol": cfg.atol, "rtol": cfg.rtol,
               "pch": self.pch if mode == "build" else None,
               "pch_light": self.pch_light if mode == "build" else None,
               "pch_compiler": self.pch_compiler if mode == "build" else None,
               "compile_baseline": cfg.compile_baseline and mode == "run" and role == "reference",
               "speed_of_light": cfg.resolved_speed_of_light(self.platform.backend) and mode == "run"
               and role == "reference",
               "ceilings_known": sorted(self.ceilings) if mode == "run" and role == "reference" else [],
               "baseline_cached": baseline_cached, "verdict": judge is not None,
               "inputs_on_device": cfg.inputs_on_device and cuda,
               "light_headers": cfg.fast_build and mode == "build" and cuda,
               "robust": {"allowed_ops": list(cfg.allowed_ops),
                          "min_extension_gpu_share": cfg.min_extension_gpu_share}
               if cfg.robust and mode == "run" and role == "candidate" else None}
        (workdir / "job.json").write_text(json.dumps(job))
        max_bytes = cfg.memory_limit_bytes
        # one frame (a trial's outputs) at most what a worker may hold; all frames at most what the caller allows
        limits = _OutputLimits(max_bytes, max_output_bytes or (cfg.trials + 1) * max_bytes, cfg.trials)
        exit_ = sandbox.supervise(worker, str(workdir / "job.json"), timeout_s=timeout_s, rss_limit_bytes=max_bytes,
                                  read_data=(lambda f, reply: _read_outputs(f, limits, judge, reply, admit))
                                  if mode == "run" else None)
        result_file = workdir / "result.json"
        result = None
        if result_file.exists():
            try:
                result = json.loads(result_file.read_text())
            except (json.JSONDecodeError, OSError):
                result = None
        return _WorkerReport(result if isinstance(result, dict) else None, exit_, workdir)

    # --- build --------------------------------------------------------------------------------------------

    def build(self, code: str) -> _Build:
        """Build (or fetch from the cache) the extensions a candidate compiles at import time."""
        start = time.monotonic()
        b = self._build(code)
        b.wall_s, b.started_s = time.monotonic() - start, start - self.began
        return b

    def _cache_entry(self, code: str) -> tuple[str, Path]:
        key = hashlib.sha256((self._fingerprint() + "\0" + code).encode()).hexdigest()
        return key, self.config.cache_dir / key[:2] / key

    def is_cached(self, code: str) -> bool:
        return (self._cache_entry(code)[1] / "manifest.json").exists()

    def _build(self, code: str) -> _Build:
        key, final = self._cache_entry(code)
        manifest = final / "manifest.json"
        if manifest.exists():
            m = json.loads(manifest.read_text())
            return _Build(final, m["ok"], m.get("kind", ""), m.get("error", ""), m.get("compile_s", 0.0), True,
                          m.get("shortcuts", []))
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=final.parent))
        rep = self._run_worker(mode="build", role="candidate", task=_NO_TASK, code=code, build_dir=staging,
                               writable_build=True, timeout_s=self.config.compile_timeout_s)
        res = rep.result
        if res is None:
            kind, error = _death_outcome(rep.exit, self.config, phase="build", limit_s=self.config.compile_timeout_s)
            shutil.rmtree(staging, ignore_errors=True)
            _cleanup(rep.workdir)
            return _Build(None, False, kind.value, error)  # not cached: deaths may be transient
        ok = res["status"] == "ok"
        entry = {"ok": ok, "kind": res.get("kind", ""), "error": res.get("error", ""),
                 "compile_s": res.get("compile_s", 0.0), "built": res.get("built", []),
                 "shortcuts": res.get("build_shortcuts", [])}
        _cleanup(rep.workdir)
        if ok or entry["kind"] == Outcome.COMPILE_ERROR.value:  # deterministic results are cached
            (staging / "manifest.json").write_text(json.dumps(entry))
            try:
                os.replace(staging, final)
            except OSError:  # another process finished the same build first
                shutil.rmtree(staging, ignore_errors=True)
            return _Build(final, ok, entry["kind"], entry["error"], entry["compile_s"], shortcuts=entry["shortcuts"])
        shutil.rmtree(staging, ignore_errors=True)
        return _Build(None, ok, entry["kind"], entry["error"], entry["compile_s"], shortcuts=entry["shortcuts"])

    # --- run ----------------------------------------------------------------------------------------------

    def run(self, task: Task, code: str | None, build_dir: Path | None, lead_ms: float | None = None,
            baseline_cached: bool = False, judge: TrialJudge | None = None,
            max_output_bytes: int | None = None, timeout_s: float | None = None,
            admit: Callable[[int], None] | None = None) -> tuple[dict, list | None]:
        """Run Model (code None) or ModelNew (timed with the reference's GPU lead); returns (report, outputs or
        None). A reference whose baseline is cached runs untimed. A candidate's trials go to `judge` as they
        arrive (its outputs are then only the re-checked call's), and it is timed and profiled only if they
        are right. `max_output_bytes` bounds everything the worker may send (default: trials + 1 frames of
        `memory_limit_gb`); `timeout_s` its wall clock (default: `run_timeout_s`); `admit` sees the first
        frame's size and may stop the worker (OutputsDeferred: the report's status is then "deferred")."""
        limit = timeout_s or self.config.run_timeout_s
        rep = self._run_worker(mode="run", role="candidate" if code is not None else "reference", task=task,
                               code=code, build_dir=build_dir, writable_build=False, timeout_s=limit,
                               lead_ms=lead_ms, baseline_cached=baseline_cached, judge=judge,
                               max_output_bytes=max_output_bytes, admit=admit)
        outputs = None
        res = rep.result
        if isinstance(rep.exit.data_error, OutputsDeferred):
            res = {"status": "deferred", "need": rep.exit.data_error.need, "error": str(rep.exit.data_error)}
        elif isinstance(rep.exit.data_error, OutputsTooLarge):  # a memory limit, like a worker over its own
            res = {"status": "error", "kind": Outcome.CUDA_MEMORY_ERROR.value,
                   "error": f"outputs too large: {rep.exit.data_error}"}
        elif res is None:
            kind, error = _death_outcome(rep.exit, self.config, phase="run", limit_s=limit)
            res = {"status": "error", "kind": kind.value, "error": error}
        elif res.get("status") == "ok":
            outputs = rep.exit.data
            if outputs is None:
                why = rep.exit.data_error or "no outputs were sent"
                res = {"status": "error", "kind": Outcome.RUNTIME_ERROR.value, "error": f"worker outputs unreadable: {why}"}
        _cleanup(rep.workdir)
        return res, outputs

    def reference(self, task: Task, admit: Callable[[int], None] | None = None) -> _Reference:
        """Run the task's Model for its outputs, and time it unless its baseline is cached (EvalConfig.baselines).
        `admit` sees the size of its first frame of outputs and may defer the task (`_Reference.deferred_need`)."""
        start = time.monotonic()
        cfg = self.config
        key = baseline_key(task.sha256, self._ceilings_key(), cfg) if cfg.timing else ""
        cached = self._cached_baseline(key)
        res, outputs = self.run(task, None, None, baseline_cached=cached is not None, admit=admit)
        if res.get("status") == "deferred":
            return _Reference(None, None, res["error"], wall_s=time.monotonic() - start, deferred_need=res["need"])
        retried = ""
        if outputs is None and res.get("kind") != Outcome.TIMEOUT.value:
            # the trusted Model failing may be the machine's doing, not the task's (one H200 reference failed CUDA
            # initialisation, error 304, among ~500 that ran): once more in a fresh worker before the task is called
            # broken and every candidate of it a harness error. A timeout would only cost its limit again.
            retried = f"{res.get('kind')}: {res.get('error', '')}"
            start = time.monotonic()
            res, outputs = self.run(task, None, None, baseline_cached=cached is not None, admit=admit)
        if outputs is None:
            return _Reference(None, None, f"{res.get('kind')}: {res.get('error', '')}",
                              wall_s=time.monotonic() - start, retried=retried)
        trials, timing = _split(outputs, cfg.trials)
        baseline = cached if cached is not None else self._measured_baseline(key, task, res)
        return _Reference(trials, baseline.timing.get("time_ms"), timing=baseline.timing, timing_outputs=timing,
                          sol=baseline.sol, compile_baseline=baseline.compile_baseline,
                          baseline_from=cached.measured_at if cached else "",
                          degenerate=degenerate_flags(trials, cfg.atol, cfg.rtol, bool(res.get("input_copy_passes"))),
                          output_findings=frozenset(res.get("output_findings", [])), stateful=bool(res.get("stateful")),
                          wall_s=time.monotonic() - start,
                          retried=retried)

    def _measured_baseline(self, key: str, task: Task, res: dict) -> Baseline:
        """The baseline a timed reference run reported; stored for later runs unless EvalConfig.baselines is "off"
        or the timed loop could not have the device alone."""
        sol = dict(res.get("speed_of_light") or {})
        if "ceilings" in sol:
            self.remember_ceilings(sol["dtype"], sol.pop("ceilings"))
        measured = Baseline({**_timing_fields(res), "time_ms": res.get("time_ms")}, res.get("compile_baseline") or {},
                            sol)
        if key and self.config.baselines != "off" and measured.timing.get("device_exclusive") is not False:
            self.baselines.put(key, task.sha256, self._ceilings_key(), measured)
        return measured

    def _cached_baseline(self, key: str) -> Baseline | None:
        """The task's cached baseline when the run may reuse one: not with EvalConfig.baselines "fresh" or "off",
        and not when the speed-of-light bound would need this machine's ceilings for a dtype not cached yet (a
        fresh reference run measures them)."""
        if not key or self.config.baselines != "reuse":
            return None
        cached = self.baselines.get(key)
        if cached is None or not cached.timing.get("time_ms"):
            return None
        if cached.sol and cached.sol.get("dtype") not in self.ceilings:
            return None
        return cached

    def evaluate(self, pairs: Sequence[tuple[Task, Candidate]], out_dir: str | Path | None = None,
                 resume: bool = False, progress: bool = False,
                 on_result: Callable[[EvalResult], None] | None = None) -> list[EvalResult]:
        """Evaluate every (task, candidate) pair; results come back in input order.

        With `out_dir`, each result is written to `out_dir/results.sqlite` as soon as it is known; with `resume`,
        pairs already in that database are not evaluated again. Identical (task, code) pairs are evaluated once.
        `on_result` sees each result as it is recorded. Warm workers, the fork server and cached baselines carry over
        to the next call; one call runs at a time.
        """
        with self._batch_lock:
            self.began = time.monotonic()
            return self._evaluate(pairs, out_dir, resume, progress, on_result)

    def _evaluate(self, pairs: Sequence[tuple[Task, Candidate]], out_dir: str | Path | None, resume: bool,
                  progress: bool, on_result: Callable[[EvalResult], None] | None) -> list[EvalResult]:
        ev, config, plat = self, self.config, self.platform
        backend = plat.backend
        store = ResultStore(Path(out_dir) / "results.sqlite") if out_dir is not None else None
        if store:
            store.set_meta("config", {k: str(v) for k, v in config.__dict__.items()})
            store.set_meta("platform", plat.__dict__)
        done: dict[tuple[str, str, str], EvalResult] = {}
        if store and resume:
            done = store.finished()
        results: list[EvalResult | None] = [None] * len(pairs)
        base = dict(backend=plat.backend, hardware=plat.hardware, torch_version=plat.torch_version,
                    harness_version=__version__)
        lock = threading.Lock()
        bar = _Progress(len(pairs), enabled=progress)

        def record(i: int, r: EvalResult, fresh: bool = True) -> None:
            with lock:
                results[i] = r
                if store and fresh:
                    store.put(r)
                bar.advance(r, resumed=not fresh)
            if on_result:
                on_result(r)

        first_of: dict[tuple[str, str], int] = {}  # dedupe key -> index evaluated for it
        duplicates: dict[int, list[int]] = {}
        for i, (task, cand) in enumerate(pairs):
            key = (task.id, cand.id, cand.sha256)
            if key in done:
                record(i, done[key], fresh=False)
            elif cand.code is None:
                record(i, _result(task, cand, Outcome.GENERATION_FAILURE, error=cand.problem, **base))
            elif (k := _dedupe_key(task, cand)) in first_of:
                duplicates.setdefault(first_of[k], []).append(i)
            else:
                first_of[k] = i
        todo = sorted(first_of.values())
        users: dict[str, int] = {}
        for i in todo:
            users[pairs[i][0].id] = users.get(pairs[i][0].id, 0) + 1
        run_workers = config.resolved_run_workers(backend, plat.gpu_memory_gib)
        refs = _References(ev, users, OutputLedger(_output_budget_bytes(config)), run_workers)
        uncached = [pairs[i][1].code for i in todo if not ev.is_cached(pairs[i][1].code)]
        pch_thread, batch_over = None, threading.Event()
        if config.fast_build and uncached:
            # the light header serves the lighter CUDA attempts only, so CUDA builds only
            plans = plan_pch(config.cache_dir, with_cuda=backend == "cuda", variants=pch_variants(uncached),
                             light=backend == "cuda")
            ev.pch, ev.pch_light = planned_pch(plans), planned_pch(plans, light=True)
            ev.pch_compiler = announce_pch(plans, config.cache_dir)
            if ev.pch_compiler:  # once per machine and torch; builds that start earlier wait for it in main.cpp only
                def _build() -> None:
                    build_pch(plans, abandon=batch_over)
                    ev.pch_compiler = None

                pch_thread = threading.Thread(target=_build, name="pch", daemon=True)
                pch_thread.start()
        if todo:  # after the header's build started: starting the fork server waits for its imports
            ev.warm_up(builds=len(uncached))

        def build_for(i: int) -> _Build:
            bar.phase(pairs[i][1].id, "build")
            return ev.build(pairs[i][1].code)

        def process(i: int, build: Future) -> int | None:
            """Evaluate pair i, whose build is done, and record it; returns i when its task must wait for memory (the
            caller requeues it)."""
            task, cand = pairs[i]
            start, b = time.monotonic(), None
            try:
                b = build.result()
                bar.phase(cand.id, "reference")
                ref, computed = refs.get(task) if b.ok else (None, False)
                bar.phase(cand.id, "run")
                r = _evaluate_one(ev, task, cand, b, ref, base)
                r.extra["phase_s"] = {"build": round(b.wall_s, 3),
                                      "reference": round(ref.wall_s, 3) if ref and computed else 0.0,
                                      **r.extra.get("phase_s", {})}
                # where the pipeline's time goes: when its build ran and when it was done, on the batch's clock
                r.extra["timeline_s"] = {"build": [round(b.started_s, 2), round(b.started_s + b.wall_s, 2)],
                                         "done": round(time.monotonic() - ev.began, 2)}
            except _Deferred:  # nothing was recorded or released: the pair comes back once another task is done
                bar.phase(cand.id, "waiting for memory")
                refs.wait_for_room()
                return i
            except Exception as e:  # noqa: BLE001 - our own fault: record it, keep the batch going
                r = _result(task, cand, Outcome.HARNESS_ERROR, error=f"{type(e).__name__}: {e}", **base)
            refs.release(task)
            r.wall_s = time.monotonic() - start + (b.wall_s if b is not None else 0.0)  # its build, then the rest
            record(i, r)
            for j in duplicates.get(i, []):
                dup = pairs[j][1]
                record(j, EvalResult(**{**r.__dict__, "candidate_id": dup.id, "candidate_sha256": dup.sha256,
                                        "solution_path": dup.path,
                                        # the work was done once, for the row above: its seconds are not counted twice
                                        "extra": {**r.extra, "duplicate_of": cand.id, "phase_s": {},
                                                  "timeline_s": {}}}))
            return None

        try:
            with ThreadPoolExecutor(max(1, config.jobs), thread_name_prefix="build") as build_pool, \
                    ThreadPoolExecutor(run_workers, thread_name_prefix="run") as run_pool:
                builds: dict[str, Future] = {}
                users_of: dict[Future, list[int]] = {}  # a build -> the pairs that wait for it
                for i in todo:  # submitted in task order
                    sha = pairs[i][1].sha256
                    if sha not in builds:
                        builds[sha] = build_pool.submit(build_for, i)
                    users_of.setdefault(builds[sha], []).append(i)
                # each task's reference runs while its candidates build: the run workers and the GPU are idle then
                for task in {pairs[i][0].id: pairs[i][0] for i in todo}.values():
                    run_pool.submit(refs.prefetch, task)
                # a pair goes to the run pool once its build is done, in the order builds end: a run thread never
                # waits for a build while another pair's build is ready
                building, pending = set(users_of), set()
                while building or pending:
                    finished, _ = wait(building | pending, return_when=FIRST_COMPLETED)
                    for f in finished:
                        if f in building:
                            building.discard(f)
                            pending.update(run_pool.submit(process, i, f) for i in users_of[f])
                            continue
                        pending.discard(f)
                        if (again := f.result()) is not None:  # to the back of the queue: holders finish first
                            pending.add(run_pool.submit(process, again, builds[pairs[again][1].sha256]))
        finally:
            bar.close()
            if pch_thread is not None:
                # a half-written header is never published: the batch's own headers are finished for the next run,
                # a spare-time one not done yet is left for a run that needs it
                batch_over.set()
                pch_thread.join()
            if store:
                store.close()
        return [r for r in results if r is not None]

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._ready_lock:
            for ready in self._ready.values():
                while ready:
                    sandbox.discard(ready.popleft())
        with self._forks_lock:
            if self._forks is not None:
                self._forks.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


_NO_TASK = Task(id="-", name="-", code="")


@dataclass(frozen=True)
class _OutputLimits:
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
        return (f"a frame may be {self.frame / 2**30:g} GiB (--memory-gb), all frames "
                f"{self.total / 2**30:.1f} GiB, {received / 2**30:.1f} GiB already received{room}")


def _read_outputs(f, limits: _OutputLimits, judge: TrialJudge | None, reply: Callable[[bytes], None],
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


def _read_frame(f, limits: _OutputLimits, received: int, admit: Callable[[int], None] | None = None) -> list | None:
    try:
        return read_trials(f, limits.next_frame(received), admit)
    except OutputsTooLarge as e:
        raise OutputsTooLarge(f"{e} ({limits.explain(received)})") from None


def _split(outputs: list, trials: int) -> tuple[list, list | None]:
    """A worker's stream: the correctness trials, then (with timing on) the last timing-loop call's outputs."""
    return outputs[:trials], (outputs[trials] if len(outputs) > trials else None)


def _cleanup(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)


def _death_outcome(exit_: sandbox.WorkerExit, cfg: EvalConfig, phase: str, limit_s: float) -> tuple[Outcome, str]:
    """Outcome for a worker that ended without writing its report (`limit_s`: its wall-clock limit)."""
    tail = (exit_.stderr or exit_.stdout)[-1500:].strip()
    if exit_.timed_out:
        return Outcome.TIMEOUT, f"{phase} exceeded the {limit_s:.4g}s wall-clock limit"
    if exit_.memory_exceeded:
        return Outcome.CUDA_MEMORY_ERROR, f"exceeded the host memory limit of {cfg.memory_limit_gb:g} GiB"
    sig = exit_.signal_name
    if sig == "SIGXFSZ":
        return Outcome.RUNTIME_ERROR, f"wrote a file larger than the {cfg.file_limit_mb} MiB limit"
    if sig:
        kind = Outcome.CUDA_MEMORY_ERROR if "memory" in tail.lower() else Outcome.RUNTIME_ERROR
        return kind, f"worker crashed with {sig}" + (f": {tail}" if tail else "")
    kind = Outcome.PYTHON_ERROR if phase == "build" else Outcome.RUNTIME_ERROR
    return kind, f"worker exited with code {exit_.returncode} without reporting (os._exit or abort?)" + (
        f": {tail}" if tail else "")


def _dedupe_key(task: Task, cand: Candidate) -> tuple[str, str]:
    """Candidates with this key in common behave identically: the same task and the same syntax tree."""
    return task.sha256, cand.program_sha256


class _Deferred(Exception):
    """The task's outputs do not fit beside other tasks' yet: its candidate goes back in the queue."""


class _References:
    """Reference outputs per task: computed once (even with concurrent callers), freed after the last candidate.
    A task holds its outputs' bytes in `ledger` from its reference's first frame until its last candidate is done;
    one that does not fit beside the tasks already holding theirs is deferred (host_memory.py)."""

    def __init__(self, ev: "Evaluator", users: dict[str, int], ledger: OutputLedger, in_flight: int):
        self._ev, self._users, self._ledger, self._in_flight = ev, dict(users), ledger, in_flight
        self._refs: dict[str, _Reference] = {}
        self._charged: set[str] = set()  # tasks whose reference time a candidate's result carries
        self._locks: dict[str, threading.Lock] = {t: threading.Lock() for t in users}
        self._guard = threading.Lock()
        self._need: dict[str, int] = {}  # deferred tasks: bytes to reserve before their reference runs again
        self._deferred_at: dict[str, float] = {}

    def get(self, task: Task, ahead: bool = False) -> tuple[_Reference, bool]:
        """The task's reference, and whether its time is charged to this call (one candidate's: not a call `ahead` of
        the candidates, `prefetch`). Raises _Deferred while the task's outputs do not fit beside other tasks'."""
        with self._locks[task.id]:
            if task.id not in self._refs:
                self._refs[task.id] = self._compute(task)
            charge = not ahead and task.id not in self._charged
            if charge:
                self._charged.add(task.id)
            return self._refs[task.id], charge

    def _compute(self, task: Task) -> _Reference:
        """Run the task's reference (its lock held); raises _Deferred while its outputs do not fit."""
        need = self._need.get(task.id)
        if need is not None and not self._ledger.reserve(task.id, need):
            raise _Deferred
        ref = self._ev.reference(task, admit=self._admit(task) if need is None else None)
        if ref.deferred_need:
            self._need[task.id] = ref.deferred_need
            self._deferred_at[task.id] = time.monotonic()
            raise _Deferred
        if task.id in self._deferred_at:
            ref.waited_for_memory_s = time.monotonic() - self._deferred_at.pop(task.id)
        if ref.outputs is None:
            self._ledger.release(task.id)
        return ref

    def prefetch(self, task: Task) -> None:
        """Compute the task's reference while its candidates are still being built: the run workers and the GPU
        are idle then, and the task's first candidate would otherwise wait for it after its build. A task whose
        outputs do not fit yet is left for its candidates (`get`)."""
        try:
            self.get(task, ahead=True)
        except _Deferred:
            pass

    def _admit(self, task: Task) -> Callable[[int], None]:
        """What the reference's first frame must pass: its task's peak need reserved (once, retries included)."""
        reserved = False

        def admit(frame_bytes: int) -> None:
            nonlocal reserved
            if reserved:
                return
            with self._guard:
                in_flight = min(self._in_flight, self._users[task.id])
            need = task_need_bytes(frame_bytes, self._ev.config.trials, in_flight)
            if not self._ledger.reserve(task.id, need):
                raise OutputsDeferred(need, self._ledger.held(but=task.id), self._ledger.budget)
            reserved = True

        return admit

    def release(self, task: Task) -> None:
        with self._guard:
            self._users[task.id] -= 1
            if self._users[task.id] == 0:
                self._refs.pop(task.id, None)  # reference outputs can be large: keep only live tasks'
                self._ledger.release(task.id)

    def wait_for_room(self, timeout_s: float = 1.0) -> None:
        self._ledger.wait_for_release(timeout_s)


def evaluate(pairs: Sequence[tuple[Task, Candidate]], config: EvalConfig, out_dir: str | Path | None = None,
             resume: bool = False, progress: bool = True,
             on_result: Callable[[EvalResult], None] | None = None) -> list[EvalResult]:
    """Evaluate every (task, candidate) pair in a session of its own (`Evaluator.evaluate`); results come back in
    input order."""
    with Evaluator(config) as ev:
        return ev.evaluate(pairs, out_dir=out_dir, resume=resume, progress=progress, on_result=on_result)


def _output_budget_bytes(config: EvalConfig) -> int:
    """EvalConfig.output_memory_gb, or half the memory available now (no limit where the OS does not say)."""
    if config.output_memory_gb > 0:
        return int(config.output_memory_gb * (1 << 30))
    available = sandbox.available_memory_bytes()
    return available // 2 if available is not None else sys.maxsize


def _result(task: Task, cand: Candidate, outcome: Outcome, **kw) -> EvalResult:
    return EvalResult(task_id=task.id, candidate_id=cand.id, candidate_sha256=cand.sha256, outcome=outcome,
                      correct=outcome is Outcome.CORRECT, solution_path=cand.path, level=task.level, **kw)


def _evaluate_one(ev: Evaluator, task: Task, cand: Candidate, b: _Build, ref: _Reference | None,
                  base: dict) -> EvalResult:
    cfg = ev.config
    extra = {"build_cache_hit": b.cache_hit, "build_shortcuts": b.shortcuts}
    if not b.ok:
        return _result(task, cand, Outcome(b.kind or Outcome.HARNESS_ERROR.value), error=b.error,
                       compile_s=b.compile_s, extra=extra, **base)
    if ref is not None and ref.retried:
        extra["reference_retried_after"] = ref.retried[:500]
    if ref is not None and ref.waited_for_memory_s:
        extra["reference_waited_for_memory_s"] = round(ref.waited_for_memory_s, 3)
    if ref is None or ref.outputs is None:
        why = ref.error if ref else "not run"
        if why.startswith((Outcome.TIMEOUT.value, Outcome.CUDA_MEMORY_ERROR.value)):  # our limits, not a bad task
            return _result(task, cand, Outcome.HARNESS_ERROR, compile_s=b.compile_s,
                           error=f"the reference Model exceeded the harness limits ({why})",
                           extra={**extra, "reference_over_limits": True}, **base)
        return _result(task, cand, Outcome.HARNESS_ERROR, compile_s=b.compile_s,
                       error=f"task error: the reference Model failed ({why})",
                       extra={**extra, "task_error": True}, **base)
    start = time.monotonic()
    judge = TrialJudge(ref.outputs, cfg.atol, cfg.rtol)  # fed in the reader thread while the worker runs
    # a right candidate sends what the reference did; the worker's own limit covers small tasks' wrong ones
    sendable = max(cfg.memory_limit_bytes, tensor_bytes(ref.outputs) + tensor_bytes(ref.timing_outputs or []))
    res, outputs = ev.run(task, cand.code, b.dir, lead_ms=ref.timing.get("lead_ms"), judge=judge,
                          max_output_bytes=sendable, timeout_s=cfg.candidate_run_timeout_s(ref.wall_s))
    ran = time.monotonic()
    phase_s = {"run": round(ran - start, 3), **{f"run.{k}": v for k, v in (res.get("phase_s") or {}).items()}}
    extra.update(sandbox=res.get("sandbox", []), phase_s=phase_s)
    compile_s = b.compile_s + float(res.get("compile_s") or 0.0)
    extra["task_degenerate"] = ref.degenerate
    if ref.stateful:
        extra["task_stateful"] = True  # so the timing loop's last call was not re-checked (_robust_check)
    extra["reference_baseline"] = {"cached": bool(ref.baseline_from), "measured_at": ref.baseline_from or None}
    if outputs is None:
        outcome = Outcome(res.get("kind") or Outcome.HARNESS_ERROR.value)
        return _result(task, cand, outcome, error=res.get("error", ""), compile_s=compile_s,
                       deceptive_kind=res.get("deceptive_kind", ""), correctness_trials=cfg.trials,
                       extra={**extra, "phase": res.get("phase", "")}, **base)
    timing_outputs = outputs[0] if outputs else None  # the trials went to the judge
    cmp = judge.comparison()
    outcome, error, deceptive_kind = cmp.outcome, cmp.message, ""
    if cfg.robust:
        findings, deceptive = _robust_check(cfg, ref, cmp, judge.failing, timing_outputs, res.get("findings", []))
        extra["robust"] = {"findings": findings, "passed_comparison": cmp.outcome is Outcome.CORRECT}
        if deceptive:
            outcome, deceptive_kind, error = Outcome.DECEPTIVE, findings[0]["kind"], findings[0]["reason"]
    timed = bool(outcome is Outcome.CORRECT and res.get("time_ms") and ref.time_ms)
    speedup = None
    if timed:
        ref_t, cand_t = TimingSamples.from_dict(ref.timing), TimingSamples.from_dict(_timing_fields(res))
        speedup, lo, hi = speedup_interval(ref_t, cand_t)
        extra["speedup_ci95"] = [lo, hi]
        extra["timing"] = {"ref": _timing_summary(ref_t, reference_time_ms), "cand": _timing_summary(cand_t)}
        flags = []
        if stream_escape(cand_t):  # charged its tail already; flagged so nobody trusts its events
            flags.append("work_escaped_default_stream")
        if res.get("device_exclusive") is False or ref.timing.get("device_exclusive") is False:
            flags.append("timed_while_device_shared")  # the lock wait ran out (a hung call held the device)
        extra.update(_compile_baseline_fields(ref.compile_baseline, cand_t))
        bound = _speed_of_light_fields(ev, ref, cand_t) if cfg.resolved_speed_of_light(ev.platform.backend) else {}
        if bound.get("fewer_flops_than_reference"):  # a shortcut or a skipped computation: for a reader to judge
            flags.append("fewer_flops_than_reference")
        if bound.get("faster_than_light"):  # quarantined: right outputs, but a time the hardware cannot deliver
            flags.append("faster_than_light")
            bound["quarantined_speedup"], speedup = speedup, None
            for key in ("speedup_ci95", "speedup_vs_compile", "speedup_vs_compile_ci95"):
                extra.pop(key, None)
        if bound:
            extra["speed_of_light"] = bound
        if flags:
            extra["timing_flags"] = flags
    phase_s["compare"] = round(time.monotonic() - ran, 3)
    return _result(task, cand, outcome, error=error, deceptive_kind=deceptive_kind, compile_s=compile_s,
                   ref_time_ms=ref.time_ms, cand_time_ms=res.get("time_ms"), speedup=speedup,
                   correctness_trials=cfg.trials, trials_passed=cmp.trials_passed,
                   timing_trials=len(res.get("times_ms") or ()) if timed else 0, max_abs_diff=cmp.max_abs_diff,
                   extra=extra, **base)


def _compile_baseline_fields(baseline: dict, cand: TimingSamples) -> dict:
    """Speedup over torch.compile(Model) with its 95% interval, or why there is none (nothing without the option)."""
    if baseline.get("error"):
        return {"compile_baseline_error": baseline["error"]}
    if not baseline.get("time_ms"):
        return {}
    speedup, lo, hi = speedup_interval(TimingSamples.from_dict(_timing_fields(baseline)), cand)
    return {"speedup_vs_compile": speedup, "speedup_vs_compile_ci95": [lo, hi],
            "compile_ref_ms": baseline["time_ms"], "compile_ref_compile_s": baseline.get("compile_s")}


def _speed_of_light_fields(ev: Evaluator, ref: _Reference, cand: TimingSamples) -> dict:
    """The task's speed-of-light bound (minimum bytes at the measured bandwidth) against the candidate's reported
    time, and the reference's FLOPs at the measured peak, when the reference reported them and this machine's
    ceilings for its dtype are known; {} otherwise. Only the bound quarantines (timing.speed_of_light_ms)."""
    c = ev.ceilings.get(ref.sol.get("dtype", ""))
    if c is None:
        return {}
    time_ms, slack = effective_time_ms(cand), ev.config.sol_slack
    sol_ms = speed_of_light_ms(ref.sol["bytes"], c.bandwidth_bytes_s)
    flops_ms = reference_flops_ms(ref.sol["flops"], c.peak_flops)
    return {"sol_ms": sol_ms, "reference_flops_ms": flops_ms, "bytes": ref.sol["bytes"], "flops": ref.sol["flops"],
            "dtype": ref.sol["dtype"], "faster_than_light": faster_than_light(time_ms, sol_ms, slack),
            "fewer_flops_than_reference": faster_than_light(time_ms, flops_ms, slack)}


def _timing_fields(res: dict) -> dict:
    """A run report's timing samples (TimingSamples fields) and whether they were taken with the device alone."""
    return {k: res[k] for k in (*TimingSamples.__dataclass_fields__, "device_exclusive") if k in res}


def _timing_summary(t: TimingSamples, reported: Callable[[TimingSamples], float] = effective_time_ms) -> dict:
    return {"median_ms": t.median_ms, "effective_ms": reported(t), "ci_ms": list(t.ci_ms),
            "host_ms": t.host_ms_per_iter, "tail_ms": t.tail_ms, "samples": len(t.times_ms),
            "input_sets": t.n_input_sets, "stop": t.stop_reason,
            **({"sm_clock_mhz": list(t.sm_clock_mhz), "time_sm_clock_corr": t.time_sm_clock_corr}
               if t.sm_clock_mhz else {})}


def _robust_check(cfg: EvalConfig, ref: _Reference, cmp: Comparison, failing: list | None,
                  timing_outputs: list | None, worker_findings: list[dict]) -> tuple[list[dict], bool]:
    """All findings, parent-verified evidence first, and whether they make the candidate deceptive: a correct
    candidate with any finding is; a failing one is only when its failure is the signature of a hack after it
    passed earlier trials (cached outputs, stale memory)."""
    findings = [f for f in worker_findings if f["kind"] not in ref.output_findings]
    evidence = None
    if cmp.outcome is Outcome.CORRECT and ref.timing_outputs is not None and not ref.stateful:
        got = timing_outputs or []
        if not outputs_match([ref.timing_outputs], [got], cfg.atol, cfg.rtol):
            evidence = (explain_mismatch(ref.outputs, ref.timing_outputs, got, cfg.atol, cfg.rtol,
                                         "the last timing-loop call")
                        or (DeceptiveKind.TIMING_OUTPUT_MISMATCH, "the last timing-loop call's outputs are wrong "
                            "(work was skipped inside the timing loop)"))
    elif cmp.outcome is Outcome.VALUE_MISMATCH and cmp.trials_passed > 0:
        k = cmp.trials_passed  # `failing` holds trial k's outputs, the first that failed
        evidence = explain_mismatch(ref.outputs[:k], ref.outputs[k], failing, cfg.atol, cfg.rtol, f"trial {k}")
        if evidence is None:
            return findings, False
    elif cmp.outcome is not Outcome.CORRECT:
        return findings, False
    if evidence:
        findings.insert(0, {"kind": evidence[0].value, "reason": evidence[1]})
    return findings, bool(findings)


class _Progress:
    """A rich progress bar with live outcome counts. When disabled (batch jobs, logs without a terminal): one plain
    line per result evaluated, and every `heartbeat_s` a line naming what is in flight and in which phase, so a
    long unattended run shows where it is and which candidate it is stuck on."""

    def __init__(self, total: int, enabled: bool, heartbeat_s: float = 60.0):
        self.counts: dict[str, int] = {}
        self.total = total
        self._inflight: dict[str, tuple[str, float]] = {}  # candidate id -> (phase, since)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._p = None
        if enabled and total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                               TextColumn("{task.description}"))
            self._p.start()
            self._id = self._p.add_task("", total=total)
        elif total:
            threading.Thread(target=self._heartbeat, args=(heartbeat_s,), name="heartbeat", daemon=True).start()

    def phase(self, candidate_id: str, name: str) -> None:
        """`candidate_id` entered phase `name` (build, reference, run)."""
        with self._lock:
            self._inflight[candidate_id] = (name, time.monotonic())

    def advance(self, r: EvalResult, resumed: bool = False) -> None:
        key = "resumed" if resumed else r.outcome.value
        with self._lock:
            self._inflight.pop(r.candidate_id, None)
            self.counts[key] = self.counts.get(key, 0) + 1
            done = sum(self.counts.values())
        if self._p:
            self._p.update(self._id, advance=1,
                           description=" ".join(f"{k}={v}" for k, v in sorted(self.counts.items())))
        elif not resumed:
            print(f"eval {done}/{self.total} {r.candidate_id}: {r.outcome.value} ({r.wall_s or 0.0:.1f}s)",
                  file=sys.stderr, flush=True)

    def _heartbeat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            now = time.monotonic()
            with self._lock:
                busy = sorted(self._inflight.items(), key=lambda kv: kv[1][1])
                done = sum(self.counts.values())
            if busy:
                items = ", ".join(f"{cid} {phase} {now - since:.0f}s" for cid, (phase, since) in busy)
                print(f"eval {done}/{self.total} done; in flight: {items}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._p:
            self._p.stop()
