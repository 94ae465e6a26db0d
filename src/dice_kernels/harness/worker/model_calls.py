"""The calls a worker makes of a model, the same for the reference and a candidate: a correctness call (outputs
copied to the CPU once the device is done, aliasing and input mutation checked), the timed loop and the call after
it whose outputs the parent re-checks, and the reference's extras (torch.compile's baseline, speed-of-light inputs)."""

from __future__ import annotations

import itertools
import types
from contextlib import nullcontext
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from dice_kernels.harness.config import usable_cpus
from dice_kernels.harness.process import gpu_lock
from dice_kernels.harness.timing import cache_flush, loop as timing, speed_of_light, stats as timing_stats
from dice_kernels.harness.compiling.in_sandbox import StageError
from dice_kernels.harness.process.protocol import RunJob
from dice_kernels.harness.worker.trial_inputs import copy_into, trial_inputs

if TYPE_CHECKING:
    from dice_kernels.harness.robust.integrity import Monitor


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


def _collect(result, where: str, job: RunJob, monitor: Monitor | None) -> list:
    """Forward's outputs as CPU copies, taken once all device work is done."""
    outs = _flatten(result, where)
    if monitor:
        monitor.check_side_streams(outs)
    timing.synchronize(job.device)
    return outs


def forward_once(model, inputs: list, where: str, job: RunJob, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[list, list]:
    """One correctness call: (CPU outputs, findings on aliasing and input mutation)."""
    from dice_kernels.harness.robust import output_checks

    before = output_checks.snapshot_inputs(inputs)
    if monitor:
        output_checks.poison_free_memory(job.device, poison_sizes)
    with monitor.forward(inputs, model) if monitor else nullcontext():
        result = model(*inputs)
    outs = _collect(result, where, job, monitor)
    findings = output_checks.output_findings(inputs, before, outs)
    return [t.detach().to("cpu", copy=True) for t in outs], findings


def depends_on_earlier_calls(model, inputs: list, outs: list, where: str, job: RunJob) -> bool:
    """Does the reference give other outputs when called again on the same inputs (state kept across calls, like
    an RNN cell's hidden state, or inputs it rewrites)? Its outputs then depend on how many calls came before."""
    from dice_kernels.harness.compare import outputs_match

    again, _ = forward_once(model, inputs, where, job, None, [])
    return not outputs_match([outs], [again], job.atol, job.rtol)


def input_copy_passes(inputs: list, outputs: list, job: RunJob) -> bool:
    """Would returning an input (of the output's shape) pass the comparison for every output?"""
    from dice_kernels.harness.compare import outputs_match
    from dice_kernels.harness.robust.output_checks import tensors_in

    ins = [t.detach().cpu() for t in tensors_in(inputs)]
    return all(any(outputs_match([[o]], [[i]], job.atol, job.rtol) for i in ins) for o in outputs)


def time_forward(model, task: types.ModuleType, inputs: list, where: str, job: RunJob, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[dict, list]:
    """The timing protocol (harness/timing/loop.py) over rotating input sets whose content is renewed after every call
    (`timing.Rotation`: a cache keyed on content never hits), then one more call whose outputs the parent
    re-checks: it runs on inputs rewritten in place just before it, as every timed call's were (and, with a
    monitor, after poisoning the allocator's free blocks), so work skipped or cached inside the loop shows as
    wrong outputs there.

    Only the timed loop has the device to itself (gpu_lock: no other worker's correctness calls or timing
    overlap it); generating the input sets and the checked call share it. A loop that could not get the device
    alone says so (`device_exclusive`)."""
    plan = timing.TimingPlan(**job.timing_plan)
    with gpu_lock.shared(job.gpu_lock) as prepared:
        n_sets = timing.n_input_sets(timing.tensor_bytes(inputs), cache_flush.l2_size_bytes(job.device), plan)
        sets = [inputs] + [trial_inputs(task, job, job.seed + 1000 + k) for k in range(1, n_sets)]
        flush = cache_flush.make_flush(job.device)
        timing.synchronize(job.device)
    seeds = itertools.count(job.seed + 100_000)

    def refresh(inputs: list) -> None:  # the task's own get_inputs(): its file reads are not the candidate's
        with monitor.harness_io() if monitor else nullcontext():
            inputs[:] = trial_inputs(task, job, next(seeds), into=inputs)

    rotation = timing.Rotation(sets, refresh)
    with gpu_lock.exclusive(job.gpu_lock) as alone, monitor.timed_calls() if monitor else nullcontext():
        samples = timing.time_calls(model, rotation, plan, job.device, flush)
        if job.candidate and job.device.startswith("cuda") and timing_stats.stream_escape(samples):
            samples = replace(samples, sync_ms=timing.synchronized_ms(model, rotation, job.device, flush))
    del sets[1:], flush, rotation
    outs, checked_wait_s = checked_call(model, task, inputs, where, job, monitor, poison_sizes)
    reported = timing_stats.effective_time_ms if job.candidate else timing_stats.reference_time_ms
    return {**samples.to_dict(), "time_ms": reported(samples), "device_exclusive": alone.held,
            "device_lock_wait_s": prepared.waited_s + alone.waited_s + checked_wait_s}, outs


def checked_call(model, task: types.ModuleType, inputs: list, where: str, job: RunJob, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[list, float]:
    """The call after the timed loop whose outputs the parent re-checks (and its device-lock wait): new values
    written into the loop's input tensors, and, with a monitor, the allocator's free blocks poisoned first."""
    from dice_kernels.harness.robust.output_checks import poison_free_memory

    with gpu_lock.shared(job.gpu_lock) as checked:
        copy_into(inputs, trial_inputs(task, job, job.seed + 2 + job.usual_trials))
        if monitor:  # allocates nothing but the poison, so the poisoned blocks are the next ones handed out
            poison_free_memory(job.device, poison_sizes)
        with monitor.timed_calls() if monitor else nullcontext():  # files watched as in the loop it continues
            result = model(*inputs)
        outs = _collect(result, where, job, monitor)
        outs = [t.detach().to("cpu", copy=True) for t in outs]
    return outs, checked.waited_s


def compile_baseline(model, task: types.ModuleType, inputs: list, where: str, job: RunJob) -> dict:
    """`torch.compile(Model)` (default mode) timed with the same protocol: KernelBench's second baseline. Runs in
    the reference worker only; a failure is recorded, not raised (the eager baseline still stands)."""
    import torch

    start = timing.host_seconds()
    try:
        compiled = torch.compile(model)
        compiled(*inputs)  # compiles
        compile_s = timing.host_seconds() - start
        report, _ = time_forward(compiled, task, inputs, where + " under torch.compile", job, None, [])
        return {**report, "compile_s": round(compile_s, 2)}
    except Exception as e:  # noqa: BLE001 - an uncompilable reference leaves only the eager baseline
        first = str(e).splitlines()[0] if str(e) else ""
        return {"error": f"{type(e).__name__}: {first}"[:300]}


def speed_of_light_inputs(model, inputs: list, outputs: list, job: RunJob) -> dict:
    """The task's side of the speed-of-light bound, from the trusted reference: FLOPs of one forward and the
    minimum bytes it must move, plus measurements of the device's ceilings for the task's dtype when the parent
    has none cached (taken with the device alone; the parent keeps the highest)."""
    import torch
    import torch.utils.flop_counter as flop_counter

    from dice_kernels.harness.robust.integrity import skip_dynamo_import
    from dice_kernels.harness.robust.output_checks import tensors_in

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
        counts = sorted({1, usable_cpus()}) if job.device == "cpu" else [threads]
        try:
            with gpu_lock.exclusive(job.gpu_lock):
                sol["ceilings"] = []
                for n in counts:
                    torch.set_num_threads(n)
                    sol["ceilings"].append(asdict(speed_of_light.measure_ceilings(job.device, dtype)))
        finally:
            torch.set_num_threads(threads)
    return sol


def nbytes(tensors: list) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]
