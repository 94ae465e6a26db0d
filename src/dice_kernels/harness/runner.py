"""`Evaluator`, the long-lived evaluator, and its scheduling: `evaluate()` for a batch of (task, candidate) pairs.

Builds run in a thread pool (compiling/cache.py) while a pool of run threads runs each task's reference
(references.py) and the candidates in fresh sandboxed workers (process/pool.py); the parent compares their outputs with
the reference's as they arrive (compare.py), scores them (score.py) and records each result in the store the
moment it is known. The evaluator's workers, fork server, build cache, baselines and ceilings serve every batch.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from dice_kernels import __version__
from dice_kernels.harness import score
from dice_kernels.harness.compiling.cache import Build, BuildCache
from dice_kernels.harness.candidate import Candidate
from dice_kernels.harness.compare import TrialJudge
from dice_kernels.harness.config import EvalConfig
from dice_kernels.harness.process.host_memory import OutputLedger
from dice_kernels.harness.outcomes import EvalResult, Outcome, Phases
from dice_kernels.harness.timing.platform import Platform, device_lock_key  # noqa: F401 - part of this module's API
from dice_kernels.harness.progress import QUEUED, Progress
from dice_kernels.harness.process.protocol import CandidatePart, RunJob
from dice_kernels.harness.references import (BatchReferences, Deferred, Reference, ReferenceRunner,
                                             common_run_fields, output_budget_bytes)
from dice_kernels.harness.store import (ResultStore, VerdictCache, harness_source, reused, untimed, verdict_context,
                                       verdict_key)
from dice_kernels.harness.timing.loop import tensor_bytes
from dice_kernels.harness.process.pool import Workers
from dice_kernels.tasks import Task


class Evaluator:
    """A long-lived evaluator: platform, scratch space, warm workers and fork server, build cache,
    baselines and ceilings are set up once and serve every `evaluate` call until `close` (or the `with` block's
    end). The RL reward service keeps one for a whole training run:

        with Evaluator(config) as ev:
            results = ev.evaluate(pairs)  # list[EvalResult], input order; call it as often as needed
    """

    def __init__(self, config: EvalConfig, platform: Platform | None = None):
        config.check()
        self.config = config
        self.platform = platform or Platform.detect(config.resolved_backend())
        self.scratch = Path(tempfile.mkdtemp(prefix="dice-eval-"))
        self.workers = Workers(config, self.platform, self.scratch)
        self.builds = BuildCache(config, self.platform, self.workers)
        self.references = ReferenceRunner(config, self.platform, self.workers)
        self.began = time.monotonic()  # the clock the results' `timeline_s` counts from (reset per batch)
        self._batch_lock = threading.Lock()  # one batch at a time: a batch owns the run and build pools

    # the three kinds of work a batch schedules (tests wrap them to observe or delay one)
    def build(self, code: str) -> Build:
        return self.builds.build(code, self.began)

    def reference(self, task: Task, admit: Callable[[int], None] | None = None) -> Reference:
        return self.references.reference(task, admit)

    def run(self, task: Task, cand: Candidate, b: Build, ref: Reference, judge: TrialJudge) -> tuple[dict, list | None]:
        """Run a candidate whose build is done against its task's reference: its trials go to `judge`, it is
        timed with the reference's GPU lead, and it may send what the reference did (or its own memory limit)."""
        cfg = self.config
        part = CandidatePart(candidate_path="", build_dir=str(b.dir) if b.dir else None,
                             allowed_ops=tuple(cfg.robust.allowed_ops) if cfg.robust.enabled else None,
                             min_extension_gpu_share=cfg.robust.min_extension_gpu_share,
                             min_replaced_ops_share=cfg.robust.min_replaced_ops_share,
                             min_partial_gpu_share=cfg.robust.min_partial_gpu_share)

        def job(workdir: Path) -> RunJob:
            fields = common_run_fields(cfg, self.platform, self.workers, workdir, ref.timing.get("lead_ms"),
                                       tuple(variant for variant, _ in ref.hardened))
            return RunJob(**fields, candidate=CandidatePart(**{**part.__dict__,
                                                               "candidate_path": str(workdir / "candidate.py")}))

        sendable = max(cfg.sandbox.memory_limit_bytes, tensor_bytes(ref.outputs) + tensor_bytes(ref.timing_outputs or [])
                       + tensor_bytes([outs for _, outs in ref.hardened]))
        # --sandbox-run-timeout-s, or its reference factor times the reference's run when longer: a candidate does what the
        # reference did plus the checks, and a task whose reference needs minutes must not time out every candidate
        run_timeout_s = max(cfg.sandbox.run_timeout_s, cfg.sandbox.run_timeout_reference_factor * ref.wall_s)
        return self.workers.run(job, task.code, cand.code, run_timeout_s=run_timeout_s, judge=judge,
                                max_output_bytes=sendable)

    def evaluate(self, pairs: Sequence[tuple[Task, Candidate]], out_dir: str | Path | None = None,
                 resume: bool = False, progress: bool = False,
                 on_result: Callable[[EvalResult], None] | None = None) -> list[EvalResult]:
        """Evaluate every (task, candidate) pair; results come back in input order.

        With `out_dir`, each result is written to `out_dir/results.sqlite` as soon as it is known; with `resume`,
        pairs already in that database are not evaluated again. Identical (task, code) pairs are evaluated once.
        `on_result` sees each result as it is recorded, one call at a time (results come from several run threads).
        Warm workers, the fork server and cached baselines carry over to the next call; one call runs at a time.
        """
        one_code_per_task_id(pairs)  # before anything is opened or run
        with self._batch_lock:
            self.began = time.monotonic()
            store = ResultStore(Path(out_dir) / "results.sqlite") if out_dir is not None else None
            verdicts = VerdictCache(self.config.cache_dir) if self.config.reuse_verdicts else None
            try:
                return self._evaluate(pairs, store, resume, Progress(len(pairs), enabled=progress), on_result,
                                      verdicts)
            finally:
                if store:
                    store.close()
                if verdicts:
                    verdicts.close()

    def _evaluate(self, pairs: Sequence[tuple[Task, Candidate]], store: ResultStore | None, resume: bool,
                  bar: Progress, on_result: Callable[[EvalResult], None] | None,
                  verdicts: VerdictCache | None = None) -> list[EvalResult]:
        config, plat = self.config, self.platform
        settings = config.settings()
        if store:
            store.set_meta("config", {k: str(v) for k, v in settings.items()})
            store.set_meta("platform", plat.__dict__)
        done = store.finished() if store and resume else {}
        results: list[EvalResult | None] = [None] * len(pairs)
        base = dict(backend=plat.backend, hardware=plat.hardware, torch_version=plat.torch_version,
                    harness_version=__version__)
        lock = threading.Lock()

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
        given: dict[int, EvalResult] = {}  # index -> the verdict an earlier run reached for its program
        verdict_keys: dict[int, str] = {}  # index -> its key in `verdicts`
        context = verdict_context(settings, plat.__dict__, harness_source()) if verdicts else ""
        # an untimed run also takes the verdict of the same settings timed, its times dropped: the timed run ran the
        # same seeded trials and then re-checked the outputs after its timing loop, a stricter check (a demo's
        # learning-curve benchmarks meet its timed benchmarks' programs); never the other way round
        timed = (verdict_context(settings | {"timing.enabled": True}, plat.__dict__, harness_source())
                 if verdicts and not config.timing.enabled else "")
        for i, (task, cand) in enumerate(pairs):
            key = (task.id, cand.id, cand.sha256)
            if key in done:
                record(i, done[key], fresh=False)
            elif cand.code is None:
                record(i, score.result(task, cand, Outcome.GENERATION_FAILURE, error=cand.problem, **base))
            elif (k := (task.sha256, cand.program_sha256)) in first_of:  # same task, same syntax tree
                duplicates.setdefault(first_of[k], []).append(i)
            else:
                first_of[k] = i
                if verdicts:
                    verdict_keys[i] = verdict_key(task, cand, context)
                    if earlier := verdicts.get(verdict_keys[i]):
                        given[i] = earlier
                    elif timed and (earlier := verdicts.get(verdict_key(task, cand, timed))):
                        given[i] = untimed(earlier)
        for i, earlier in given.items():  # verdicts reached before: nothing runs for them or their duplicates
            for j in (i, *duplicates.pop(i, [])):
                record(j, reused(earlier, *pairs[j]))
        todo = sorted(i for i in first_of.values() if i not in given)
        users: dict[str, int] = {}
        for i in todo:
            users[pairs[i][0].id] = users.get(pairs[i][0].id, 0) + 1
        run_workers = config.scheduler.resolved_run_workers(plat.backend, plat.gpu_memory_gib)
        refs = BatchReferences(self.reference, config.trials, users, OutputLedger(output_budget_bytes(config)),
                               run_workers)
        uncached = [pairs[i][1].code for i in todo if not self.builds.is_cached(pairs[i][1].code)]
        self.builds.acceleration.start(uncached)
        if todo:  # after the header's build started: starting the fork server waits for its imports
            self.workers.warm_up(builds=len(uncached))

        def build_for(i: int) -> Build:
            bar.phase(pairs[i][1].id, "build")
            return self.build(pairs[i][1].code)

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
                r = self._score(task, cand, b, ref, base)
                r.phases.seconds = {"build": round(b.wall_s, 3),
                                    "reference": round(ref.spent_s, 3) if ref and computed else 0.0, **r.phases.seconds}
                # where the pipeline's time goes: when its build ran and when it was done, on the batch's clock
                r.phases.timeline = {"build": [round(b.started_s, 2), round(b.started_s + b.wall_s, 2)],
                                     "done": round(time.monotonic() - self.began, 2)}
            except Deferred:  # nothing was recorded or released: the pair comes back once another task is done
                bar.phase(cand.id, "waiting for memory")
                refs.wait_for_room()
                return i
            except Exception as e:  # noqa: BLE001 - our own fault: record it, keep the batch going
                r = score.result(task, cand, Outcome.HARNESS_ERROR, error=f"{type(e).__name__}: {e}", **base)
            refs.release(task)
            r.wall_s = time.monotonic() - start + (b.wall_s if b is not None else 0.0)  # its build, then the rest
            record(i, r)
            if verdicts:
                verdicts.put(verdict_keys[i], r)
            for j in duplicates.get(i, []):
                dup = pairs[j][1]
                # the work was done once, for the row above: its seconds are not counted twice
                record(j, replace(r, candidate_id=dup.id, candidate_sha256=dup.sha256, solution_path=dup.path,
                                  duplicate_of=cand.id, phases=Phases(failed_in=r.phases.failed_in)))
            return None

        try:
            with ThreadPoolExecutor(max(1, config.build.jobs), thread_name_prefix="build") as build_pool, \
                    ThreadPoolExecutor(run_workers, thread_name_prefix="run") as run_pool:
                builds: dict[str, Future] = {}
                users_of: dict[Future, list[int]] = {}  # a build -> the pairs that wait for it
                for i in todo:  # submitted in task order
                    bar.phase(pairs[i][1].id, QUEUED)
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
                            for i in users_of[f]:  # built: waiting for a run worker
                                bar.phase(pairs[i][1].id, QUEUED)
                            pending.update(run_pool.submit(process, i, f) for i in users_of[f])
                            continue
                        pending.discard(f)
                        if (again := f.result()) is not None:  # to the back of the queue: holders finish first
                            pending.add(run_pool.submit(process, again, builds[pairs[again][1].sha256]))
        finally:
            bar.close()
            self.builds.acceleration.finish()
        return [r for r in results if r is not None]

    def _score(self, task: Task, cand: Candidate, b: Build, ref: Reference | None, base: dict) -> EvalResult:
        """Run a built candidate against its task's reference and score it (score.py)."""
        early = score.unrunnable(task, cand, b, ref, base)
        if early is not None:
            return early
        start = time.monotonic()
        judge = TrialJudge(ref.expected, self.config.atol, self.config.rtol, len(ref.outputs))  # fed as it runs
        res, outputs = self.run(task, cand, b, ref, judge)
        ran = time.monotonic()
        r = score.scored(self.config, task, cand, b, ref, res, outputs, judge.comparison(), judge.failing,
                         judge.trivial, self.references.ceilings.known, self.config.timing.resolved_speed_of_light(self.platform.backend),
                         base)
        r.phases.seconds = {"run": round(ran - start, 3),
                            **{f"run.{k}": v for k, v in (res.get("phase_s") or {}).items()},
                            **({"compare": round(time.monotonic() - ran, 3)} if outputs is not None else {})}
        return r

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.workers.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def one_code_per_task_id(pairs: Sequence[tuple[Task, Candidate]]) -> None:
    """Raise ValueError when two different tasks of a batch share an id: a batch keeps one reference per task id
    (and a result store keys results by it), so the second task's candidates would be judged by the first's
    outputs. `load_tasks` refuses such a set; a caller that builds its pairs itself meets the error here."""
    code_of: dict[str, Task] = {}
    for task, _ in pairs:
        first = code_of.setdefault(task.id, task)
        if first.sha256 != task.sha256:
            raise ValueError(f"two different tasks share the id {task.id!r} ({first.source or 'no source'} and "
                             f"{task.source or 'no source'}): give each task its own id")


def evaluate(pairs: Sequence[tuple[Task, Candidate]], config: EvalConfig, out_dir: str | Path | None = None,
             resume: bool = False, progress: bool = True,
             on_result: Callable[[EvalResult], None] | None = None) -> list[EvalResult]:
    """Evaluate every (task, candidate) pair with an evaluator of its own (`Evaluator.evaluate`); results come back in
    input order."""
    with Evaluator(config) as ev:
        return ev.evaluate(pairs, out_dir=out_dir, resume=resume, progress=progress, on_result=on_result)
