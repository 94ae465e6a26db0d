"""The sandboxed worker: the only process that executes task or candidate code.

`python -m dice_kernels.harness.worker` imports what it needs, reads its job path from stdin (the parent may
start it before the job exists), confines itself (sandbox.confine), then runs its job (protocol.py): a `BuildJob`
builds a candidate's extensions into the build cache (build_worker.py); a `RunJob` runs the task's `Model`
(`run_reference`) or the candidate's `ModelNew` (`run_candidate`) on seeded inputs, writing `result.json` into
its private directory and its outputs into a pipe to the parent (tensor_stream). It never sees reference
outputs: the parent compares.

Trial protocol (both, so outputs line up; `_trials`): trial k runs on inputs seeded `seed + 1 + k`; odd trials
write their values into the previous trial's input tensors (same pointers, new content) so caching keyed on
pointers shows. With timing on, one more output follows the trials: the last timing-loop iteration's, on inputs
rewritten in place just before it. A candidate worker with the robust check on also runs `integrity.Monitor`.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import types
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

# timing binds the clocks it uses at import, before any candidate code could replace them
from dice_kernels.harness import gpu_lock, speed_of_light, timing, timing_stats
from dice_kernels.harness.build_worker import BuildLog, StageError, build, classify, load_module, patch_extension_loaders
from dice_kernels.harness.protocol import BuildJob, RunJob, read_job
from dice_kernels.harness.sandbox import OUTPUT_FD_ENV, Limits, confine
from dice_kernels.harness.tensor_stream import write_trials
from dice_kernels.harness.trial_inputs import copy_into, seed_all, trial_inputs

if TYPE_CHECKING:
    from dice_kernels.harness.integrity import Monitor


def _flatten(out, where: str) -> list:
    import torch

    if isinstance(out, torch.Tensor):
        if type(out) is not torch.Tensor and not isinstance(out, torch.nn.Parameter):
            raise StageError("deceptive", "forward", f"{where} returned a tensor subclass ({type(out).__name__}); "
                             "only plain tensors count", deceptive_kind="tensor_subclass")
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _flatten(item, where)]
    if isinstance(out, (int, float, bool)):
        return [torch.tensor(out)]
    raise StageError("python_error", "forward", f"{where} returned {type(out).__name__}, not tensors")


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


def _collect(result, where: str, job: RunJob, monitor: Monitor | None) -> list:
    """Forward's outputs as CPU copies, taken once all device work is done."""
    outs = _flatten(result, where)
    if monitor:
        monitor.check_side_streams(outs)
    timing.synchronize(job.device)
    return outs


def _forward_once(model, inputs: list, where: str, job: RunJob, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[list, list]:
    """One correctness call: (CPU outputs, findings on aliasing and input mutation)."""
    from dice_kernels.harness import output_checks

    before = output_checks.snapshot_inputs(inputs)
    if monitor:
        output_checks.poison_free_memory(job.device, poison_sizes)
    with monitor.forward(inputs, model) if monitor else nullcontext():
        result = model(*inputs)
    outs = _collect(result, where, job, monitor)
    findings = output_checks.output_findings(inputs, before, outs)
    return [t.detach().to("cpu", copy=True) for t in outs], findings


def _depends_on_earlier_calls(model, inputs: list, outs: list, where: str, job: RunJob) -> bool:
    """Does the reference give other outputs when called again on the same inputs (state kept across calls, like
    an RNN cell's hidden state, or inputs it rewrites)? Its outputs then depend on how many calls came before."""
    from dice_kernels.harness.compare import outputs_match

    again, _ = _forward_once(model, inputs, where, job, None, [])
    return not outputs_match([outs], [again], job.atol, job.rtol)


def _input_copy_passes(inputs: list, outputs: list, job: RunJob) -> bool:
    """Would returning an input (of the output's shape) pass the comparison for every output?"""
    from dice_kernels.harness.compare import outputs_match
    from dice_kernels.harness.output_checks import tensors_in

    ins = [t.detach().cpu() for t in tensors_in(inputs)]
    return all(any(outputs_match([[o]], [[i]], job.atol, job.rtol) for i in ins) for o in outputs)


def _time_forward(model, task: types.ModuleType, inputs: list, where: str, job: RunJob, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[dict, list]:
    """The timing protocol (harness/timing.py) over rotating input sets, then one more call whose outputs the
    parent re-checks: it runs on inputs rewritten in place just before it (and, with a monitor, after poisoning
    the allocator's free blocks), so work skipped or cached inside the loop shows as wrong outputs there.

    Only the timed loop has the device to itself (gpu_lock: no other worker's correctness calls or timing
    overlap it); generating the input sets and the checked call share it. A loop that could not get the device
    alone says so (`device_exclusive`)."""
    plan = timing.TimingPlan(**job.timing_plan)
    with gpu_lock.shared(job.gpu_lock) as prepared:
        n_sets = timing.n_input_sets(timing.tensor_bytes(inputs), timing.l2_size_bytes(job.device), plan)
        sets = [inputs] + [trial_inputs(task, job, job.seed + 1000 + k) for k in range(1, n_sets)]
        flush = timing.make_flush(job.device)
        timing.synchronize(job.device)
    with gpu_lock.exclusive(job.gpu_lock) as alone, monitor.timed_calls() if monitor else nullcontext():
        samples = timing.time_calls(model, sets, plan, job.device, flush)
    del sets[1:], flush
    outs, checked_wait_s = _checked_call(model, task, inputs, where, job, monitor, poison_sizes)
    reported = timing_stats.effective_time_ms if job.candidate else timing_stats.reference_time_ms
    return {**samples.to_dict(), "time_ms": reported(samples), "device_exclusive": alone.held,
            "device_lock_wait_s": prepared.waited_s + alone.waited_s + checked_wait_s}, outs


def _checked_call(model, task: types.ModuleType, inputs: list, where: str, job: RunJob, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[list, float]:
    """The call after the timed loop whose outputs the parent re-checks (and its device-lock wait): new values
    written into the loop's input tensors, and, with a monitor, the allocator's free blocks poisoned first."""
    from dice_kernels.harness.output_checks import poison_free_memory

    with gpu_lock.shared(job.gpu_lock) as checked:
        copy_into(inputs, trial_inputs(task, job, job.seed + 2 + job.trials))
        if monitor:  # allocates nothing but the poison, so the poisoned blocks are the next ones handed out
            poison_free_memory(job.device, poison_sizes)
        outs = _collect(model(*inputs), where, job, monitor)
        outs = [t.detach().to("cpu", copy=True) for t in outs]
    return outs, checked.waited_s


def _compile_baseline(model, task: types.ModuleType, inputs: list, where: str, job: RunJob) -> dict:
    """`torch.compile(Model)` (default mode) timed with the same protocol: KernelBench's second baseline. Runs in
    the reference worker only; a failure is recorded, not raised (the eager baseline still stands)."""
    import torch

    start = timing.host_seconds()
    try:
        compiled = torch.compile(model)
        compiled(*inputs)  # compiles
        compile_s = timing.host_seconds() - start
        report, _ = _time_forward(compiled, task, inputs, where + " under torch.compile", job, None, [])
        return {**report, "compile_s": round(compile_s, 2)}
    except Exception as e:  # noqa: BLE001 - an uncompilable reference leaves only the eager baseline
        first = str(e).splitlines()[0] if str(e) else ""
        return {"error": f"{type(e).__name__}: {first}"[:300]}


def _speed_of_light(model, inputs: list, outputs: list, job: RunJob) -> dict:
    """The task's side of the speed-of-light bound, from the trusted reference: FLOPs of one forward and the
    minimum bytes it must move, plus measurements of the device's ceilings for the task's dtype when the parent
    has none cached (taken with the device alone; the parent keeps the highest)."""
    import torch
    import torch.utils.flop_counter as flop_counter

    from dice_kernels.harness.integrity import skip_dynamo_import
    from dice_kernels.harness.output_checks import tensors_in

    skip_dynamo_import(getattr(flop_counter, "_FlopCounterMode", type(None)))  # 1.1 s per reference otherwise
    floats = [t.dtype for t in tensors_in(inputs) if t.is_floating_point()]
    dtype = floats[0] if floats else torch.float32
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    with gpu_lock.shared(job.gpu_lock):  # one more forward, under the FLOP counter
        flops = speed_of_light.count_flops(model, inputs)
    sol = {"flops": flops, "bytes": speed_of_light.min_bytes_moved(inputs, outputs, params),
           "dtype": str(dtype).removeprefix("torch.")}
    if sol["dtype"] not in job.reference.ceilings_known:
        threads = torch.get_num_threads()
        # on CPU, once with one thread and once with every core: a parallel copy is the first to suffer from load
        counts = sorted({1, os.cpu_count() or 1}) if job.device == "cpu" else [threads]
        try:
            with gpu_lock.exclusive(job.gpu_lock):
                sol["ceilings"] = []
                for n in counts:
                    torch.set_num_threads(n)
                    sol["ceilings"].append(asdict(speed_of_light.measure_ceilings(job.device, dtype)))
        finally:
            torch.set_num_threads(threads)
    return sol


def _nbytes(tensors: list) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]


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
    stateful: bool = False
    first_sizes: list = field(default_factory=list)
    first: list = field(default_factory=list)  # trial 0's outputs, where the speed-of-light bound needs them


def _trials(model, task: types.ModuleType, where: str, job: RunJob, monitor: Monitor | None, stream,
            spent: _PhaseClock) -> _Trials:
    """The correctness trials, shared by reference and candidate: each trial's outputs go to the parent in one
    frame as the trial ends (so a worker never holds more than two trials' outputs)."""
    from dice_kernels.harness.output_checks import tensors_in

    seen, sizes = _Trials(), []
    reference = job.reference
    for trial in range(job.trials):
        with gpu_lock.shared(job.gpu_lock) as hold:
            seen.inputs = trial_inputs(task, job, job.seed + 1 + trial, into=seen.inputs if trial % 2 else None)
            poison = sizes if trial else _nbytes(tensors_in(seen.inputs))  # the last outputs' sizes
            outs, found = _forward_once(model, seen.inputs, where, job, monitor, poison)
            # only a timed run has a call after its loop, the one a stateful task's cannot be re-checked
            if reference and job.timing and trial == job.trials - 1:
                seen.stateful = _depends_on_earlier_calls(model, seen.inputs, outs, where, job)
        spent.waited_s += hold.waited_s
        seen.findings += found
        if reference:
            seen.copy_passes = seen.copy_passes and _input_copy_passes(seen.inputs, outs, job)
        write_trials(stream, [outs])
        sizes = _nbytes(outs)
        if trial == 0:
            seen.first_sizes, seen.first = sizes, outs if reference and reference.speed_of_light else []
        del outs
    stream.flush()
    spent.lap("trials")
    return seen


def _timed(model, task: types.ModuleType, where: str, job: RunJob, monitor: Monitor | None, spent: _PhaseClock,
           seen: _Trials) -> tuple[dict, list]:
    """The timing protocol on fresh inputs: its report and the re-checked call's outputs."""
    seen.inputs = trial_inputs(task, job, job.seed + 1 + job.trials)
    report, last = _time_forward(model, task, seen.inputs, where, job, monitor, seen.first_sizes)
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
        seen.inputs = trial_inputs(task, job, job.seed + 1 + job.trials)
        last, waited_s = _checked_call(model, task, seen.inputs, where, job, None, [])
        spent.waited_s += waited_s
        checked.append(last)
        spent.lap("checked_call")
    elif job.timing:
        report, last = _timed(model, task, where, job, None, spent, seen)
        checked.append(last)
        if ref.compile_baseline:
            report["compile_baseline"] = _compile_baseline(model, task, seen.inputs, where, job)
            spent.lap("compile_baseline")
        if ref.speed_of_light:
            report["speed_of_light"] = _speed_of_light(model, seen.inputs, seen.first, job)
            spent.lap("speed_of_light")
    write_trials(stream, checked)  # the re-checked call after the timed loop, if there was one
    return {**report, "trials": job.trials + len(checked), "input_copy_passes": seen.copy_passes,
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
    from dice_kernels.harness.integrity import Monitor

    monitor = Monitor(job.device, job.candidate.candidate_path, job.workdir, job.candidate.allowed_ops,
                      job.candidate.min_extension_gpu_share)
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
