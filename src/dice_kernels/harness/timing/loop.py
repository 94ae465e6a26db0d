"""Timing protocol building blocks (issue 4): how one model is timed so speedups reproduce and resist gaming.

This module owns the measurement itself and the arithmetic on it, nothing else: how many rotating input sets to
pre-generate, their refresh (new content after each call, so no timed call sees content an earlier one saw), the
GPU lead that keeps host launch latency out of the events, the adaptive timed loop with its clocks (per-call CUDA
events or `perf_counter`, and the tail per iteration: how long every stream and thread the call started ran on
after the per-call clock stopped), the samples it returns (cache_flush.py holds the flush before each call,
timing/stats.py the statistics, speed_of_light.py the bounds; KernelBench's timer, kept for comparison, is
benchmarks/kernelbench_style.py's). It never imports candidate code, writes files or spawns processes (it reads
/proc and sysfs); the worker calls it inside its sandbox, with the device to itself (gpu_lock.py).
See docs/timing.md for the protocol and what each step defends against."""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dice_kernels.harness.timing.cache_flush import is_cuda
from dice_kernels.harness.timing.stats import TimingSamples, _rel_half_width, median_ci, pool_loops

# Bound when this module is imported, which the worker does before it runs any candidate code: a candidate that
# later replaces time.perf_counter*, torch.cuda.synchronize or torch.cuda.Event does not reach these references.
_now_ns = time.perf_counter_ns
_now_s = time.perf_counter
_cuda_sync = torch.cuda.synchronize
_CudaEvent = torch.cuda.Event
_event_done = torch.cuda.Event.query
_cuda_spin = torch.cuda._sleep  # a kernel that spins for a number of GPU clock cycles


def host_seconds() -> float:
    """The host clock bound at import (immune to later patching), for bookkeeping outside timed regions."""
    return _now_s()


# ---------------------------------------------------------------------------------------------- plan and inputs


@dataclass(frozen=True)
class TimingPlan:
    """How long to time: warm-up for at least `warmup` calls and `warmup_s`, then time at least `min_iters` calls
    and `min_time_s`, then until the median's 95 % CI is within `target_rel_ci` of it, but never past `max_iters`
    or `max_time_s`. `lead_ms` is the GPU lead queued before each timed CUDA call (see `lead_ms_for`): None sizes
    it from this call's own warm-up, which is how the trusted reference is timed; a candidate is given the
    reference's, so it gets exactly as much hidden host time as the reference needed and no more."""

    warmup: int = 3
    warmup_s: float = 0.05
    min_iters: int = 20
    max_iters: int = 2000
    min_time_s: float = 0.1
    max_time_s: float = 2.0
    target_rel_ci: float = 0.01
    input_bytes_target: int | None = None  # total bytes of rotating input sets; None: 2 x the cache size
    input_memory_budget: int = 4 << 30  # never pre-generate more input bytes than this
    max_input_sets: int = 64
    lead_ms: float | None = None
    max_lead_ms: float = 2.0
    # independent timing loops (each with its own warm-up, lead sizing and calibration) sharing the iteration and
    # time limits; the reported time is the mean of their medians (`_pool_loops`). On the H200 a 5-10 us
    # kernel's loops settle at levels about 0.3 us apart, one level per loop; four loops did not narrow the
    # spread across processes there (docs/timing.md), so one is the default
    loops: int = 1


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) list/tuple/dict of inputs or outputs; other values count zero."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def n_input_sets(set_bytes: int, l2_bytes: int, plan: TimingPlan = TimingPlan()) -> int:
    """How many distinct input sets to pre-generate and rotate through.

    Enough that together they exceed the target (default 2 x L2), so an iteration never finds its inputs left in
    cache by the previous one even without the flush, and at least 2 so consecutive calls never see the same
    content or pointers (defeats output caching keyed on either). Capped by the memory budget (at least 1 set)
    and by `max_input_sets`: tiny inputs then fall short of the target, and the flush alone keeps them cold.
    """
    target = plan.input_bytes_target if plan.input_bytes_target is not None else 2 * l2_bytes
    n = max(2, target // max(1, set_bytes) + 1)
    return max(1, min(n, plan.max_input_sets, plan.input_memory_budget // max(1, set_bytes)))


class Rotation:
    """The input sets a timing loop cycles through. With `refresh` (new content written into a set, same tensors),
    each set is refreshed right after every call that used it, outside the clocks, so no call ever sees content an
    earlier call saw: a cache keyed on content (however much of it the key reads) never hits, and the call the
    worker re-checks after the loop is no different from a timed one. Refreshes count in the loop's time limits
    (a get_inputs() slow on the host leaves fewer samples and a wider interval, never a repeat). Without a
    refresh, the timed calls on content an earlier call saw are counted (`repeated`)."""

    def __init__(self, sets: Sequence[Sequence[Any]], refresh: Callable[[Sequence[Any]], None] | None = None):
        if not sets:
            raise ValueError("time_calls needs at least one input set")
        self.sets, self.refresh = sets, refresh
        self.repeated = 0
        self._seen: set[int] = set()  # sets whose content some call has seen since their last refresh
        self._calls = 0

    def take(self, timed: bool = True) -> Sequence[Any]:
        """The next set; then `renew()` it once the call is done."""
        k = self._calls % len(self.sets)
        self._calls += 1
        if k in self._seen and timed:
            self.repeated += 1
        self._seen.add(k)
        self._last = k
        return self.sets[k]

    def renew(self) -> None:
        """New content for the set just used."""
        if self.refresh is not None:
            self.refresh(self.sets[self._last])
            self._seen.discard(self._last)


# ---------------------------------------------------------------------------------------------- threads


def _threads() -> frozenset[str]:
    """Ids of this process's OS threads: sees native threads too, not only `threading` ones."""
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:
        return frozenset(str(t.native_id) for t in threading.enumerate())


def _wait_new_threads(before: frozenset[str], deadline: float) -> bool:
    """Block until every thread that did not exist in `before` has ended (or the deadline passes), so work a
    call left running on a thread is charged to whatever clock is running. Python threads are joined (exact),
    native ones polled. Returns whether there was anything to wait for."""
    new = _threads() - before
    if not new:
        return False
    for t in threading.enumerate():
        if str(t.native_id) in new and t is not threading.current_thread():
            t.join(max(0.0, deadline - _now_s()))
    while _threads() & new and _now_s() < deadline:
        time.sleep(50e-6)
    return True


# ---------------------------------------------------------------------------------------------- statistics


def synchronize(device: str | torch.device) -> None:
    """Wait for all work on every stream of a CUDA device; nothing to wait for on CPU."""
    if is_cuda(device):
        _cuda_sync(torch.device(device))


def _noop(*_: Any) -> None:
    return None


def _step(call: Callable[..., Any], inputs: Sequence[Any], device: torch.device, flush: Callable[[], None],
          deadline: float, lead_cycles: int = 0) -> tuple[float, float, float, float]:
    """One timed iteration; returns (per-call ms, host ms, tail ms, lead ms: the GPU time of the lead's spin).

    CUDA: flush, synchronize (the device is idle and flushed), a spin of `lead_cycles` queued ahead of the call
    (the GPU is still busy with it while the host launches the call, so the events time the call's GPU work, not
    the host's launch latency), events around the call on the stream current before it, wait for threads the
    call started, spin until the end event is done, then a device-wide synchronize, which waits for every
    stream: the tail runs from the end event seen done to that synchronize's return, the host clock from just
    before the lead to the same point (the lead is in the no-op calibration too). The lead has an event of its
    own before it, so its cycles over its time give the SM clock of this iteration. CPU: `perf_counter` around
    the call; the tail runs on until every thread the call started has ended."""
    flush()
    before = _threads()
    if device.type == "cuda":
        _cuda_sync(device)
        stream = torch.cuda.current_stream(device)
        lead, start, end = (_CudaEvent(enable_timing=True) for _ in range(3))
        t0 = _now_ns()
        if lead_cycles:
            lead.record(stream)
            _cuda_spin(lead_cycles)
        start.record(stream)
        call(*inputs)
        end.record(stream)  # on `stream`, whatever stream the call made current
        _wait_new_threads(before, deadline)  # a thread may still queue GPU work: wait for it before the sync
        while not _event_done(end):  # a spin, not a blocking wait: no wake-up delay before the tail starts
            pass
        t1 = _now_ns()
        _cuda_sync(device)
        t2 = _now_ns()
        lead_ms = lead.elapsed_time(start) if lead_cycles else 0.0
        return start.elapsed_time(end), (t2 - t0) / 1e6, (t2 - t1) / 1e6, lead_ms
    t0 = _now_ns()
    call(*inputs)
    t1 = _now_ns()
    t2 = _now_ns() if _wait_new_threads(before, deadline) else t1
    return (t1 - t0) / 1e6, (t2 - t0) / 1e6, (t2 - t1) / 1e6, 0.0


def sm_clock_stats(lead_cycles: int, lead_ms: Sequence[float],
                   times_ms: Sequence[float]) -> tuple[tuple[float, ...], float]:
    """(10th, 50th, 90th percentile of the SM clock in MHz, Spearman correlation of per-call time with it) from
    each iteration's lead: `lead_cycles` cycles of spin in `lead_ms[i]` ms. The lead's events also hold the spin's
    launch, so the clock reads a few percent low; its changes are what matter. ((), 0.0) without leads."""
    pairs = [(lead_cycles / ms / 1e3, t) for ms, t in zip(lead_ms, times_ms) if ms > 0]
    if not lead_cycles or len(pairs) < 3:
        return (), 0.0
    mhz = np.array([m for m, _ in pairs])
    t = np.array([x for _, x in pairs])
    quantiles = tuple(float(q) for q in np.percentile(mhz, [10, 50, 90]))
    ranks = [np.argsort(np.argsort(v)) for v in (mhz, t)]
    corr = float(np.corrcoef(*ranks)[0, 1]) if np.ptp(mhz) > 0 and np.ptp(t) > 0 else 0.0
    return quantiles, corr


def synchronized_ms(call: Callable[..., Any], rotation: Rotation, device: str | torch.device,
                    flush: Callable[[], None], iters: int = 21) -> float:
    """CUDA: the median host ms of `iters` calls, each timed from just before it to a device-wide synchronize after
    it (every stream waited for, no lead: launch latency counts), less the same around a no-op. What a call costs
    when nothing hides any of its work: charged to a candidate whose work escaped the events (`stream_escape`),
    since side-stream work runs beside the lead and the tail sees only what is left after it."""
    dev = torch.device(device)

    def step(fn: Callable[..., Any], inputs: Sequence[Any]) -> float:
        flush()
        _cuda_sync(dev)
        t0 = _now_ns()
        fn(*inputs)
        _cuda_sync(dev)
        return (_now_ns() - t0) / 1e6

    calls, noops = [], []
    for _ in range(iters):
        calls.append(step(call, rotation.take()))
        rotation.renew()
        noops.append(step(_noop, ()))
    return max(0.0, float(np.median(calls)) - float(np.median(noops)))


def _spin_cycles_per_ms(device: torch.device, cycles: int = 200_000) -> float:
    """GPU clock cycles the spin kernel burns per millisecond, measured (clocks differ by GPU and power state)."""
    rates = []
    for _ in range(3):
        start, end = _CudaEvent(enable_timing=True), _CudaEvent(enable_timing=True)
        start.record()
        _cuda_spin(cycles)
        end.record()
        _cuda_sync(device)
        rates.append(cycles / max(start.elapsed_time(end), 1e-3))
    return float(np.median(rates))


def lead_ms_for(issue_ms: Sequence[float], plan: TimingPlan) -> float:
    """The GPU lead for a call whose host side took `issue_ms` to return (warm-up samples, idle device): 1.5 x
    the median plus 20 us, at most `plan.max_lead_ms`. Like NVBench's blocking kernel, it keeps host launch
    latency (which varies with CPU load and clocks, and was the main run-to-run noise of small kernels) out of
    the events. Work the host does beyond the lead (a slow Python path, a synchronizing copy and what follows
    it) still shows as GPU idle time inside the events, as it would in a real program."""
    return min(plan.max_lead_ms, 1.5 * float(np.median(issue_ms)) + 0.02) if issue_ms else plan.max_lead_ms


def _warm_up(call: Callable[..., Any], rotation: Rotation, plan: TimingPlan, dev: torch.device,
             flush: Callable[[], None]) -> list[float]:
    """Run `plan.warmup` calls and at least `plan.warmup_s` (clocks and caches settle), each after a flush on
    an idle device and followed by its set's refresh; returns each call's host issue time (ms until it
    returned), which sizes the lead."""
    issue_ms: list[float] = []
    start, i = _now_s(), 0
    while i < plan.warmup or _now_s() - start < plan.warmup_s:
        flush()  # warms the flush too: a thread pool its first parallel fill creates must predate timing
        synchronize(dev)
        t0 = _now_ns()
        call(*rotation.take(timed=False))
        issue_ms.append((_now_ns() - t0) / 1e6)
        rotation.renew()
        i += 1
    synchronize(dev)
    return issue_ms


def time_calls(call: Callable[..., Any], input_sets: Sequence[Sequence[Any]] | Rotation, plan: TimingPlan,
               device: str | torch.device, flush: Callable[[], None]) -> TimingSamples:
    """Time `call(*input_sets[i % n])` under the protocol (call it under `torch.no_grad()`, with the device alone).

    `input_sets` may be a `Rotation` that refreshes each set's content after every call (outside the clocks).
    Warm-up calls (`_warm_up`, each after a flush) rotate the input sets and size the GPU lead (unless the plan
    brings one); then each iteration (`_step`) flushes, times one call on the next set with the per-call clock and
    the host clock, and leaves the device and the process quiescent (all streams synchronized, all threads the
    call started ended) before the next. The host and tail samples are corrected by the step's own: the medians
    of no-op steps (same lead), interleaved with the timed ones so the correction follows drifting CPU and GPU
    clocks.
    Stops when min_iters and min_time_s are both reached and the median's relative CI half-width is <=
    target_rel_ci, or at max_iters / max_time_s. With `plan.loops` > 1: that many such loops, each with its share
    of the limits, pooled by `_pool_loops`.
    """
    rotation = input_sets if isinstance(input_sets, Rotation) else Rotation(input_sets)
    if plan.loops <= 1:
        return _time_loop(call, rotation, plan, device, flush)
    k = plan.loops
    share = replace(plan, loops=1, min_iters=max(8, math.ceil(plan.min_iters / k)),
                    max_iters=max(8, math.ceil(plan.max_iters / k)), min_time_s=plan.min_time_s / k,
                    max_time_s=plan.max_time_s / k)
    return pool_loops([_time_loop(call, rotation, share, device, flush) for _ in range(k)])


def _time_loop(call: Callable[..., Any], rotation: Rotation, plan: TimingPlan, device: str | torch.device,
               flush: Callable[[], None]) -> TimingSamples:
    """One timing loop of `time_calls`."""
    dev = torch.device(device)
    n_sets = len(rotation.sets)
    issue_ms = _warm_up(call, rotation, plan, dev, flush)
    cuda = dev.type == "cuda"
    lead_ms = (plan.lead_ms if plan.lead_ms is not None else lead_ms_for(issue_ms, plan)) if cuda else 0.0
    lead = max(1, int(lead_ms * _spin_cycles_per_ms(dev))) if cuda else 0
    noop_deadline = _now_s() + 60.0

    def noop() -> tuple[float, float]:  # (host, tail) of a step around nothing
        return _step(_noop, (), dev, flush, noop_deadline, lead)[1:3]

    noops = [noop() for _ in range(5)] if cuda else []
    times: list[float] = []
    host: list[float] = []
    tails: list[float] = []
    leads: list[float] = []
    stop_reason, next_check = "max_iters", max(plan.min_iters, 8)  # fewer than 8 samples bound nothing
    start_ns, repeated = _now_ns(), rotation.repeated
    deadline = _now_s() + plan.max_time_s
    while len(times) < plan.max_iters:
        t, h, tail, lead_gpu_ms = _step(call, rotation.take(), dev, flush, deadline, lead)
        rotation.renew()
        times.append(t)
        host.append(h)
        tails.append(tail)
        leads.append(lead_gpu_ms)
        if cuda and len(times) % 8 == 0:
            noops.append(noop())
        elapsed = (_now_ns() - start_ns) / 1e9
        if elapsed >= plan.max_time_s:
            stop_reason = "max_time"
            break
        # the CI check sorts all samples, so it runs on a geometric schedule: amortised cost stays ~constant
        if len(times) >= next_check and elapsed >= plan.min_time_s:
            if _rel_half_width(times) <= plan.target_rel_ci:
                stop_reason = "converged"
                break
            next_check = max(len(times) + 8, int(len(times) * 1.1))
    overhead_ms = float(np.median([h for h, _ in noops])) if noops else 0.0
    noop_tail_ms = float(np.median([t for _, t in noops])) if noops else 0.0
    sm_clock_mhz, time_sm_clock_corr = sm_clock_stats(lead, leads, times)
    return TimingSamples(times_ms=tuple(times), median_ms=float(np.median(times)), ci_ms=median_ci(times),
                         host_ms_per_iter=max(0.0, float(np.median(host)) - overhead_ms), overhead_ms=overhead_ms,
                         n_input_sets=n_sets,
                         total_s=(_now_ns() - start_ns) / 1e9, stop_reason=stop_reason,
                         clock="cuda_event" if dev.type == "cuda" else "perf_counter", lead_ms=lead_ms,
                         tail_ms=max(0.0, float(np.median(tails)) - noop_tail_ms), sm_clock_mhz=sm_clock_mhz,
                         time_sm_clock_corr=time_sm_clock_corr, repeated_calls=rotation.repeated - repeated)
