"""Each task's reference: the trusted `Model` run in a worker for its outputs (and, unless a cached baseline stands
in, its timing and speed-of-light inputs), computed once per task per batch, retried once when it fails, and
admitted only when its outputs fit beside other tasks' (host_memory.py); freed after the task's last candidate.
With `reuse_verdicts`, a reference an earlier batch of this process kept (process/reference_cache.py) stands in
for the run."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dice_kernels.harness.process import sandbox
from dice_kernels.harness.timing.baselines import Baseline, BaselineStore, baseline_key
from dice_kernels.harness.config import EvalConfig, total_memory_gib
from dice_kernels.harness.robust.degenerate import breaking_trials, degenerate_flags
from dice_kernels.harness.process.input_size import min_input_bytes
from dice_kernels.harness.process.host_memory import OutputLedger, OutputsDeferred, task_need_bytes
from dice_kernels.harness.process.reference_cache import KEPT_REFERENCES, reference_key
from dice_kernels.harness.outcomes import Outcome
from dice_kernels.harness.timing.platform import CeilingsCache, Platform
from dice_kernels.harness.process.protocol import ReferencePart, RunJob
from dice_kernels.harness.timing.loop import tensor_bytes
from dice_kernels.harness.timing.stats import timing_fields
from dice_kernels.harness.store import harness_source, verdict_context
from dice_kernels.harness.worker.trial_inputs import HARDENED_TRIALS
from dice_kernels.harness.process.pool import MEMORY_ERROR, Workers
from dice_kernels.tasks import Task


@dataclass
class Reference:
    outputs: list | None  # per correctness trial
    time_ms: float | None
    error: str = ""
    timing: dict = field(default_factory=dict)  # timing_stats.TimingSamples.to_dict() of the reference
    timing_outputs: list | None = None  # the last timing-loop call's outputs (with timing on)
    degenerate: dict = field(default_factory=dict)  # degenerate.degenerate_flags
    hardened: list = field(default_factory=list)  # degenerate.breaking_trials: (variant, outputs) that decide
    output_findings: frozenset[str] = frozenset()  # aliasing/mutation the reference itself shows (not cheats)
    # its outputs depend on the calls before (a second call on the same inputs differs): the call after a timing
    # loop, which ran another number of calls than a candidate's, cannot be re-checked against a candidate's
    stateful: bool = False
    wall_s: float = 0.0  # its run's wall time; for a reused one, the run that computed it (run timeouts scale with it)
    compile_baseline: dict = field(default_factory=dict)  # torch.compile(Model) timing, or {"error": ...}
    sol: dict = field(default_factory=dict)  # the task's FLOPs, minimum bytes moved and dtype (worker._speed_of_light)
    baseline_from: str = ""  # when the timing above was measured, if it came from the baseline cache ("" = now)
    retried: str = ""  # the first run's failure when the reference ran twice ("" = it ran once)
    deferred_need: int = 0  # bytes its outputs need, when they did not fit beside other tasks' (host_memory.py)
    waited_for_memory_s: float = 0.0  # how long the task waited for other tasks' outputs to be released
    reused_from: str = ""  # when its outputs were computed, if an earlier batch kept them ("" = run now)
    load_s: float = 0.0  # seconds loading a reused one

    @property
    def spent_s(self) -> float:
        """Seconds this batch spent on it: its run's, or loading it when it was reused."""
        return self.load_s if self.reused_from else self.wall_s

    @property
    def expected(self) -> list:
        """Every trial a candidate's outputs are compared with: the usual ones, then the hardened ones."""
        return (self.outputs or []) + [outs for _, outs in self.hardened]


def run_job(config: EvalConfig, platform: Platform, workers: Workers, ceilings: CeilingsCache,
            baseline_cached: bool, hardened: tuple[int, ...]) -> Callable[[Path], RunJob]:
    """The job of a reference run in `workdir`, with the hardened trials `hardened` after the usual ones."""
    part = ReferencePart(baseline_cached=baseline_cached, compile_baseline=config.timing.compile_baseline,
                         speed_of_light=config.timing.resolved_speed_of_light(platform.backend),
                         ceilings_known=tuple(sorted(ceilings.known)))
    return lambda workdir: RunJob(**common_run_fields(config, platform, workers, workdir, None, hardened),
                                  reference=part)


def reference_hardened(config: EvalConfig) -> tuple[int, ...]:
    """The hardened trials a reference runs after the usual ones: all of them with the robust check on (what
    decides its degenerate tasks), none without."""
    return tuple(range(HARDENED_TRIALS)) if config.robust.enabled else ()


def common_run_fields(config: EvalConfig, platform: Platform, workers: Workers, workdir: Path,
                      lead_ms: float | None, hardened: tuple[int, ...] = ()) -> dict:
    """What every run job carries, reference or candidate (`lead_ms`: the reference's GPU lead, for a candidate;
    `hardened`: the hardened trials it runs after the usual ones)."""
    return dict(workdir=str(workdir), device=platform.backend, limits=workers.limits(workdir),
                task_path=str(workdir / "task.py"), seed=config.seed, trials=config.trials + len(hardened),
                hardened=hardened, atol=config.atol,
                rtol=config.rtol, timing=config.timing.enabled, timing_plan=config.timing.plan(lead_ms),
                gpu_lock=workers.gpu_lock, inputs_on_device=config.inputs_on_device and platform.backend == "cuda")


class ReferenceRunner:
    """Runs references and keeps their baselines (timing.baselines) and this machine's ceilings."""

    def __init__(self, config: EvalConfig, platform: Platform, workers: Workers):
        self.config, self.platform, self.workers = config, platform, workers
        self.ceilings = CeilingsCache(config.cache_dir, platform)
        self.baselines = BaselineStore(config.cache_dir / "baselines.sqlite")
        context = verdict_context(config.settings(), platform.__dict__, harness_source())  # as the batch's verdicts
        self.kept_context = context if config.reuse_verdicts and config.scheduler.reference_cache_mb else ""
        self.kept_budget = config.scheduler.reference_cache_mb << 20

    def reference(self, task: Task, admit: Callable[[int], None] | None = None) -> Reference:
        """Run the task's Model for its outputs, and time it unless its baseline is cached (timing.baselines), or
        take the reference an earlier batch kept (`reuse_verdicts`). `admit` sees the size of its first frame of
        outputs and may defer the task (`Reference.deferred_need`)."""
        start = time.monotonic()
        cfg = self.config
        too_big = self.inputs_over_limits(task)
        if too_big:  # reported before a worker could run out of memory on it
            return Reference(None, None, too_big)
        key = baseline_key(task.sha256, self.ceilings.key(), cfg) if cfg.timing.enabled else ""
        cached = self._cached_baseline(key)
        # timed, a kept reference stands in only where a run would take the cached baseline (timing.baselines
        # "reuse"): it would then time nothing, and only its outputs are kept
        kept_key = reference_key(self.kept_context, task.sha256) if self.kept_context else ""
        if kept_key and (not cfg.timing.enabled or cached is not None):
            if (kept := KEPT_REFERENCES.get(kept_key)) is not None:
                return self._reused(kept, cached, admit, start)

        def run(hardened: tuple[int, ...]) -> tuple[dict, list | None]:
            job = run_job(cfg, self.platform, self.workers, self.ceilings, cached is not None, hardened)
            return self.workers.run(job, task.code, None, run_timeout_s=cfg.sandbox.run_timeout_s, admit=admit)

        hardened = reference_hardened(cfg)
        res, outputs = run(hardened)
        if res.get("status") == "deferred":
            return Reference(None, None, res["error"], wall_s=time.monotonic() - start, deferred_need=res["need"])
        retried = ""
        if outputs is None and res.get("kind") != Outcome.TIMEOUT.value:
            # the trusted Model failing may be the machine's doing, not the task's (one H200 reference failed CUDA
            # initialisation, error 304, among ~500 that ran): once more in a fresh worker before the task is called
            # broken and every candidate of it a harness error. A timeout would only cost its limit again.
            # The retry runs no hardened trials: their spiked inputs may leave the Model's domain, which on a GPU
            # can be a device-side assert (an embedding's float indices scaled past the table) that poisons the
            # worker's CUDA context, where a CPU raises an error the trial survives. The task then has no
            # hardened trials (its candidates run the usual ones only).
            retried = f"{res.get('kind')}: {res.get('error', '')}"
            start = time.monotonic()
            hardened = ()
            res, outputs = run(hardened)
        if outputs is None:
            return Reference(None, None, f"{res.get('kind')}: {res.get('error', '')}",
                             wall_s=time.monotonic() - start, retried=retried)
        n = cfg.trials + len(hardened)
        trials, hardened = outputs[:cfg.trials], outputs[cfg.trials:n]
        timing = outputs[n] if len(outputs) > n else None
        degenerate = degenerate_flags(trials, cfg.atol, cfg.rtol, bool(res.get("input_copy_passes")))
        baseline = cached if cached is not None else self._measured_baseline(key, task, res)
        ref = Reference(trials, baseline.timing.get("time_ms"), timing=baseline.timing, timing_outputs=timing,
                        sol=baseline.sol, compile_baseline=baseline.compile_baseline,
                        baseline_from=cached.measured_at if cached else "",
                        degenerate=degenerate,
                        hardened=breaking_trials(trials, hardened, degenerate, res.get("hardened_copy_passes", []),
                                                 cfg.atol, cfg.rtol),
                        output_findings=frozenset(res.get("output_findings", [])), stateful=bool(res.get("stateful")),
                        wall_s=time.monotonic() - start, retried=retried)
        if kept_key:
            KEPT_REFERENCES.put(kept_key, ref, self.kept_budget)
        return ref

    def _reused(self, kept: dict, cached: Baseline | None, admit: Callable[[int], None] | None,
                start: float) -> Reference:
        """A kept reference (ReferenceCache.get's fields) as this batch's: admitted like a run's first frame (a
        task whose outputs do not fit is deferred the same way; unlike a frame it is in memory already, at most
        scheduler.reference_cache_mb), with the timing side a run would have had: the cached baseline, or none
        untimed."""
        if admit is not None:
            try:
                admit(tensor_bytes(kept["outputs"][0]))
            except OutputsDeferred as e:
                return Reference(None, None, str(e), deferred_need=e.need)
        baseline = cached or Baseline({"time_ms": None}, {}, {})  # untimed: what _measured_baseline makes of no timing
        return Reference(time_ms=baseline.timing.get("time_ms"), timing=baseline.timing, sol=baseline.sol,
                         compile_baseline=baseline.compile_baseline,
                         baseline_from=cached.measured_at if cached else "", load_s=time.monotonic() - start, **kept)

    def inputs_over_limits(self, task: Task) -> str:
        """Why the task's inputs cannot fit where its reference would make them (input_size.py: a lower bound read
        from get_inputs), with the numbers and the flag to change; "" when they may fit."""
        need = min_input_bytes(task.code)
        on_gpu = self.platform.backend == "cuda" and self.config.inputs_on_device
        room = self.platform.gpu_memory_gib * (1 << 30) if on_gpu else self.config.sandbox.memory_limit_bytes
        if not need or not room or need <= room:
            return ""
        where = (f"the GPU's {self.platform.gpu_memory_gib:g} GiB (--no-inputs-on-device makes them in host memory)"
                 if on_gpu else f"the {self.config.sandbox.memory_limit_gb:g} GiB a worker may hold (--sandbox-memory-limit-gb; this "
                 f"machine has {total_memory_gib() or 0:.1f} GiB)")
        return (f"{MEMORY_ERROR.value}: its inputs alone take {need / 2**30:.1f} GiB (get_inputs), more than {where}; "
                "not run")

    def _measured_baseline(self, key: str, task: Task, res: dict) -> Baseline:
        """The baseline a timed reference run reported; stored for later runs unless timing.baselines is "off"
        or the timed loop could not have the device alone."""
        sol = dict(res.get("speed_of_light") or {})
        if "ceilings" in sol:
            self.ceilings.remember(sol["dtype"], sol.pop("ceilings"))
        measured = Baseline({**timing_fields(res), "time_ms": res.get("time_ms")}, res.get("compile_baseline") or {},
                            sol)
        if key and self.config.timing.baselines != "off" and measured.timing.get("device_exclusive") is not False:
            self.baselines.put(key, task.sha256, self.ceilings.key(), measured)
        return measured

    def _cached_baseline(self, key: str) -> Baseline | None:
        """The task's cached baseline when the run may reuse one: not with timing.baselines "fresh" or "off",
        and not when the speed-of-light bound would need this machine's ceilings for a dtype not cached yet (a
        fresh reference run measures them)."""
        if not key or self.config.timing.baselines != "reuse":
            return None
        cached = self.baselines.get(key)
        if cached is None or not cached.timing.get("time_ms"):
            return None
        if cached.sol and cached.sol.get("dtype") not in self.ceilings.known:
            return None
        return cached


class Deferred(Exception):
    """The task's outputs do not fit beside other tasks' yet: its candidate goes back in the queue."""


def output_budget_bytes(config: EvalConfig) -> int:
    """scheduler.output_memory_gb, or half the memory available now (no limit where the OS does not say)."""
    if config.scheduler.output_memory_gb > 0:
        return int(config.scheduler.output_memory_gb * (1 << 30))
    available = sandbox.available_memory_bytes()
    return available // 2 if available is not None else sys.maxsize


class BatchReferences:
    """Reference outputs per task for one batch: computed once (even with concurrent callers), freed after the last
    candidate. A task holds its outputs' bytes in `ledger` from its reference's first frame until its last
    candidate is done; one that does not fit beside the tasks already holding theirs is deferred."""

    def __init__(self, compute: Callable[..., Reference], trials: int, users: dict[str, int], ledger: OutputLedger,
                 in_flight: int):
        self._run, self._trials = compute, trials
        self._users, self._ledger, self._in_flight = dict(users), ledger, in_flight
        self._refs: dict[str, Reference] = {}
        self._charged: set[str] = set()  # tasks whose reference time a candidate's result carries
        self._locks: dict[str, threading.Lock] = {t: threading.Lock() for t in users}
        self._guard = threading.Lock()
        self._need: dict[str, int] = {}  # deferred tasks: bytes to reserve before their reference runs again
        self._deferred_at: dict[str, float] = {}

    def get(self, task: Task, ahead: bool = False) -> tuple[Reference, bool]:
        """The task's reference, and whether its time is charged to this call (one candidate's: not a call `ahead` of
        the candidates, `prefetch`). Raises Deferred while the task's outputs do not fit beside other tasks'."""
        with self._locks[task.id]:
            if task.id not in self._refs:
                self._refs[task.id] = self._compute(task)
            charge = not ahead and task.id not in self._charged
            if charge:
                self._charged.add(task.id)
            return self._refs[task.id], charge

    def _compute(self, task: Task) -> Reference:
        """Run the task's reference (its lock held); raises Deferred while its outputs do not fit."""
        need = self._need.get(task.id)
        if need is not None and not self._ledger.reserve(task.id, need):
            raise Deferred
        ref = self._run(task, admit=self._admit(task) if need is None else None)
        if ref.deferred_need:
            self._need[task.id] = ref.deferred_need
            self._deferred_at[task.id] = time.monotonic()
            raise Deferred
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
        except Deferred:
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
            need = task_need_bytes(frame_bytes, self._trials, in_flight)
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
