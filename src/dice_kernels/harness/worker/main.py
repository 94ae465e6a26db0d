"""The sandboxed worker: the only process that executes task or candidate code.

`python -m dice_kernels.harness.worker.main` imports what it needs, reads its job path from stdin (the parent may
start it before the job exists), confines itself (sandbox.confine), then runs its job (protocol.py): a `BuildJob`
builds a candidate's extensions into the build cache (compiling/in_sandbox.py); a `RunJob` runs the task's `Model`
(`run_reference`) or the candidate's `ModelNew` (`run_candidate`) on seeded inputs, writing `result.json` into
its private directory and its outputs into a pipe to the parent (tensor_stream). It never sees reference
outputs: the parent compares.

Trial protocol (both, so outputs line up; `_trials`): trial k runs on inputs seeded `seed + 1 + k`; odd trials
write their values into the previous trial's input tensors (same pointers, new content) so caching keyed on
pointers shows; the job's hardened trials come last (trial_inputs.harden: they decide degenerate tasks). With
timing on, one more output follows the trials: the call after the timing loop, on inputs rewritten in place just
before it, as every timed call's were. A candidate worker with the robust check on also runs `integrity.Monitor`.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

# timing binds the clocks it uses at import, before any candidate code could replace them
from dice_kernels.harness.process import gpu_lock
from dice_kernels.harness.timing import loop as timing
from dice_kernels.harness.compiling.in_sandbox import BuildLog, StageError, build, classify, load_module, patch_extension_loaders
from dice_kernels.harness.worker.model_calls import (checked_call, compile_baseline, depends_on_earlier_calls, forward_once,
                                              input_copy_passes, nbytes, speed_of_light_inputs, time_forward)
from dice_kernels.harness.process.protocol import BuildJob, RunJob, read_job
from dice_kernels.harness.process.sandbox import OUTPUT_FD_ENV, Limits, confine
from dice_kernels.harness.process.tensor_stream import write_trials
from dice_kernels.harness.worker.trial_inputs import HARDENED_SEED, harden, seed_all, trial_inputs

if TYPE_CHECKING:
    from collections import Counter

    from dice_kernels.harness.robust.integrity import Monitor


def _check_signature(cls: type, reference: type, init_inputs: list) -> None:
    """ModelNew must take the task's init inputs and the same forward arguments as Model."""
    try:
        inspect.signature(cls).bind(*init_inputs)
    except TypeError as e:
        raise StageError("python_error", "init",
                         f"ModelNew's constructor does not accept the task's get_init_inputs() ({e})") from None
    try:
        ours = inspect.signature(cls.forward)
        theirs = inspect.signature(reference.forward)
    except (TypeError, ValueError):
        return
    required = [p for p in theirs.parameters.values() if p.name != "self" and p.kind in
                (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    try:
        ours.bind(None, *[object()] * len(required))
    except TypeError as e:
        raise StageError("python_error", "init",
                         f"ModelNew.forward does not accept Model.forward's {len(required)} arguments ({e})") from None


class _PhaseClock:
    """Seconds spent per phase of a run, for the report of where evaluation time goes; `waited_s` sums the waits
    for the device lock inside those phases."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.waited_s = 0.0
        self._last = timing.host_seconds()

    def lap(self, name: str) -> None:
        now = timing.host_seconds()
        self.laps[name] = round(now - self._last, 4)
        self._last = now


def _await_verdict(control_fd: int) -> bool:
    """The parent's verdict on the trials' outputs, a line on the job pipe: b"time" (they are right: time and
    profile the model) or anything else, EOF included (stop)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(control_fd, 64)
        if not chunk:
            break
        line += chunk
    return line.strip() == b"time"


@dataclass
class _Trials:
    """What the trial loop saw: the last trial's inputs, the worker's findings on aliasing and mutation, whether an
    input copy passed every trial and whether a second call differs (references), trial 0's outputs' sizes."""

    inputs: list | None = None
    findings: list = field(default_factory=list)
    copy_passes: bool = True
    hardened_copy_passes: list = field(default_factory=list)  # per hardened trial (references)
    stateful: bool = False
    first_sizes: list = field(default_factory=list)
    first: list = field(default_factory=list)  # trial 0's outputs, where the speed-of-light bound needs them


def _trials(model, task: types.ModuleType, where: str, job: RunJob, monitor: Monitor | None, stream,
            spent: _PhaseClock) -> _Trials:
    """The correctness trials, shared by reference and candidate: each trial's outputs go to the parent in one
    frame as the trial ends (so a worker never holds more than two trials' outputs)."""
    from dice_kernels.harness.robust.output_checks import tensors_in

    seen, sizes = _Trials(), []
    reference = job.reference
    normal = job.usual_trials  # then the hardened trials (trial_inputs.harden), seeded by their variant
    for trial in range(job.trials):
        variant = job.hardened[trial - normal] if trial >= normal else None
        seed = job.seed + 1 + trial if variant is None else job.seed + HARDENED_SEED + variant
        with gpu_lock.shared(job.gpu_lock) as hold:
            seen.inputs = trial_inputs(task, job, seed, into=seen.inputs if trial % 2 else None)
            if variant is not None:
                harden(seen.inputs, variant, seed)
            poison = sizes if trial else nbytes(tensors_in(seen.inputs))  # the last outputs' sizes
            outs, found = _defined_where(reference and trial >= normal, model, seen.inputs, where, job, monitor,
                                         poison)
            # only a timed run has a call after its loop, the one a stateful task's cannot be re-checked
            if reference and job.timing and trial == normal - 1:
                seen.stateful = depends_on_earlier_calls(model, seen.inputs, outs, where, job)
        spent.waited_s += hold.waited_s
        seen.findings += found
        if reference and trial >= normal:
            seen.hardened_copy_passes.append(bool(outs) and input_copy_passes(seen.inputs, outs, job))
        elif reference:
            seen.copy_passes = seen.copy_passes and input_copy_passes(seen.inputs, outs, job)
        write_trials(stream, [outs])
        sizes = nbytes(outs)
        if trial == 0:
            seen.first_sizes, seen.first = sizes, outs if reference and reference.speed_of_light else []
        del outs
    stream.flush()
    spent.lap("trials")
    return seen


def _defined_where(optional: bool, model, inputs: list, where: str, job: RunJob, monitor: Monitor | None,
                   poison: list[int]) -> tuple[list, list]:
    """forward_once; for a reference's hardened trial (`optional`), no outputs where its Model is not defined
    (it raises): the parent then does not use that trial."""
    if not optional:
        return forward_once(model, inputs, where, job, monitor, poison)
    try:
        return forward_once(model, inputs, where, job, monitor, poison)
    except Exception:  # noqa: BLE001 - the trusted Model outside its domain: not a task error
        return [], []


def _timed(model, task: types.ModuleType, where: str, job: RunJob, monitor: Monitor | None, spent: _PhaseClock,
           seen: _Trials) -> tuple[dict, list]:
    """The timing protocol on fresh inputs: its report and the re-checked call's outputs."""
    seen.inputs = trial_inputs(task, job, job.seed + 1 + job.usual_trials)
    report, last = time_forward(model, task, seen.inputs, where, job, monitor, seen.first_sizes)
    spent.waited_s += report.pop("device_lock_wait_s")
    spent.lap("timing")
    return report, last


def run_reference(job: RunJob, model, task: types.ModuleType, where: str, stream, spent: _PhaseClock) -> dict:
    """The task's Model: trials, then (timed) the timing protocol, torch.compile's baseline and the speed-of-light
    inputs, or, when the parent has the task's baseline cached, only the re-checked call."""
    ref = job.reference
    seen = _trials(model, task, where, job, None, stream, spent)
    report, checked = {}, []
    if job.timing and ref.baseline_cached:
        seen.inputs = trial_inputs(task, job, job.seed + 1 + job.usual_trials)
        last, waited_s = checked_call(model, task, seen.inputs, where, job, None, [])
        spent.waited_s += waited_s
        checked.append(last)
        spent.lap("checked_call")
    elif job.timing:
        report, last = _timed(model, task, where, job, None, spent, seen)
        checked.append(last)
        if ref.compile_baseline:
            report["compile_baseline"] = compile_baseline(model, task, seen.inputs, where, job)
            spent.lap("compile_baseline")
        if ref.speed_of_light:
            report["speed_of_light"] = speed_of_light_inputs(model, seen.inputs, seen.first, job)
            spent.lap("speed_of_light")
    write_trials(stream, checked)  # the re-checked call after the timed loop, if there was one
    return {**report, "trials": job.trials + len(checked), "input_copy_passes": seen.copy_passes,
            "hardened_copy_passes": seen.hardened_copy_passes,
            "output_findings": sorted({f.kind.value for f in seen.findings}), "stateful": seen.stateful}


def run_candidate(job: RunJob, model, task: types.ModuleType, where: str, stream, spent: _PhaseClock,
                  monitor: Monitor | None, control_fd: int) -> dict:
    """The candidate's ModelNew: trials, then, only if the parent says they are right, timing and the GPU-share
    profile (nothing about a wrong candidate depends on its time)."""
    seen = _trials(model, task, where, job, monitor, stream, spent)
    if monitor:
        monitor.check_globals("after forward")
    wanted = _await_verdict(control_fd)
    spent.lap("verdict")
    report, checked = {}, []
    if wanted and job.timing:
        report, last = _timed(model, task, where, job, monitor, spent, seen)
        checked.append(last)
        if monitor:
            monitor.check_globals("after timing")
    if wanted and monitor and job.device.startswith("cuda") and monitor.ext_calls:
        # only the profiled forward holds the device lock: a timing loop of another worker waits for it
        monitor.start_profiler()
        spent.lap("gpu_share.start")
        with gpu_lock.shared(job.gpu_lock) as hold:
            profiled = monitor.profile_forward(model, seen.inputs)
        spent.waited_s += hold.waited_s
        spent.lap("gpu_share")
        monitor.check_gpu_share(profiled)
        del profiled
        spent.lap("gpu_share.read")
    write_trials(stream, checked)
    report["trials"] = job.trials + len(checked)
    if monitor:
        for f in seen.findings:
            monitor.add(f.kind, f.reason)
        report["findings"] = [f.to_dict() for f in monitor.findings()]
        # whether a deceptive candidate ran custom code at all: a broken kernel is not the same as a cheat
        report["extensions"] = {"loaded": len(monitor.extensions), "calls": sum(monitor.ext_calls.values())}
    return report


def _load(job: RunJob, log: BuildLog, monitor: Monitor | None, spent: _PhaseClock) -> tuple[types.ModuleType, type]:
    """The task's module and the class to run: its Model, or the candidate's ModelNew."""
    task = load_module("dice_task", job.task_path)
    if job.candidate is None:
        return task, task.Model
    if monitor:
        monitor.reference_ops = _reference_ops(task, job, monitor)
        monitor.watch_reference(task.Model)
    # KernelBench execs the task's source and then the solution's into one namespace, and solutions use the task's
    # globals (`batch_size`, helper functions): they see them here too. `Model` among them is watched (the robust
    # check's reference_model).
    candidate = load_module("dice_candidate", job.candidate.candidate_path, preset=task)
    if log.failures:
        raise StageError("compile_error", "build", log.failures[0])
    cls = getattr(candidate, "ModelNew", None)
    if not isinstance(cls, type):
        raise StageError("python_error", "import", "the solution does not define class ModelNew")
    return task, cls


def _reference_ops(task: types.ModuleType, job: RunJob, monitor: Monitor) -> Counter | None:
    """The PyTorch compute ops one forward of the task's Model dispatches (on trial 0's inputs), counted before any
    candidate code runs: what a candidate that keeps some of them beside its own kernels is measured against (its
    replaced share decides `partial` against `pytorch_fallback`). None when the Model cannot run here."""
    import torch

    try:
        seed_all(job.seed)
        model = task.Model(*task.get_init_inputs())
        if isinstance(model, torch.nn.Module):
            model = model.to(job.device).eval()
        with gpu_lock.shared(job.gpu_lock), torch.no_grad():
            inputs = trial_inputs(task, job, job.seed + 1)
            return monitor.count_ops(model, inputs)
    except Exception:  # noqa: BLE001 - the trusted Model failing here only leaves the share unknown
        return None


def run_model(job: RunJob, log: BuildLog, monitor: Monitor | None, control_fd: int) -> dict:
    """Load, construct and run the reference or the candidate; every error it raises becomes an outcome."""
    import torch

    phase, spent = "import", _PhaseClock()
    stream = os.fdopen(int(os.environ.pop(OUTPUT_FD_ENV)), "wb")
    try:
        if job.device.startswith("cuda"):
            torch.zeros(1, device=job.device)  # the CUDA context, so its cost shows as its own phase
            spent.lap("device")
        task, cls = _load(job, log, monitor, spent)
        spent.lap("load")
        phase = "init"
        seed_all(job.seed)
        init_inputs = list(task.get_init_inputs())
        if job.candidate:
            _check_signature(cls, task.Model, init_inputs)
        seed_all(job.seed)
        model = cls(*init_inputs)
        if isinstance(model, torch.nn.Module):
            model = model.to(job.device).eval()
        if monitor:
            monitor.check_model(cls, model)
            monitor.check_globals("after __init__")
        spent.lap("init")
        phase = "forward"
        where = cls.__name__ + ".forward"
        with torch.no_grad():
            if job.candidate:
                report = run_candidate(job, model, task, where, stream, spent, monitor, control_fd)
            else:
                report = run_reference(job, model, task, where, stream, spent)
        stream.flush()
        return {"status": "ok", **report,
                "phase_s": {**spent.laps, "device_lock_wait": round(spent.waited_s, 4)}}
    except BaseException as e:  # noqa: BLE001 - everything the candidate raises becomes an outcome
        err = classify(e, phase, log)
        return {"status": "error", "kind": err.kind, "phase": err.phase, "error": err.message,
                "deceptive_kind": err.deceptive_kind}
    finally:
        try:
            stream.close()
        except OSError:  # the parent stopped reading: its report says why
            pass


def _monitor(job: BuildJob | RunJob) -> Monitor | None:
    """The robust check's instrumentation, installed before the candidate's module is executed."""
    if not isinstance(job, RunJob) or job.candidate is None or job.candidate.allowed_ops is None:
        return None
    from dice_kernels.harness.robust.integrity import Monitor

    monitor = Monitor(job.device, job.candidate.candidate_path, job.workdir, job.candidate)
    monitor.install()
    return monitor


def main() -> None:
    # Started ahead of its job (sandbox.Started): everything above is imported by now; the job path comes on stdin.
    job_path = sys.stdin.readline().strip()
    control_fd = os.dup(0)  # the parent's later word (run_candidate's verdict), kept off fd 0 and out of children
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if not job_path:  # the parent discarded this worker
        os._exit(0)
    received = timing.host_seconds()
    job = read_job(job_path)
    os.unlink(job_path)  # trials, seeds and iteration counts are not for the candidate to read
    notes = confine(Limits(**{**job.limits, "writable": tuple(job.limits["writable"])}))
    log = BuildLog()
    monitor = _monitor(job)
    patch_extension_loaders(job, log, monitor)
    setup_s = round(timing.host_seconds() - received, 4)
    if isinstance(job, BuildJob):
        result = build(job, log)
    else:
        result = run_model(job, log, monitor, control_fd)
        result["phase_s"] = {"setup": setup_s, **result.get("phase_s", {})}
    result.update(built=log.built, compile_s=log.compile_s, build_shortcuts=log.shortcuts, sandbox=notes)
    # Written last and atomically: a worker that dies earlier leaves no result and the parent says so.
    tmp = Path(job.workdir) / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, Path(job.workdir) / "result.json")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: candidate atexit hooks and destructors must not run after the report


if __name__ == "__main__":
    main()
