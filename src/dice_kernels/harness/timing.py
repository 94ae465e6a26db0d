"""Timing protocol building blocks (issue 4): how one model is timed so speedups reproduce and resist gaming.

This module owns the measurement itself and the arithmetic on it, nothing else: how many rotating input sets to
pre-generate, the cache flush (and persisting-L2 reset), the GPU lead that keeps host launch latency out of the
events, the adaptive timed loop with its clocks (per-call CUDA events or `perf_counter`, and the tail per
iteration: how long every stream and thread the call started ran on after the per-call clock stopped), the
times we report, the stream-escape flag, bootstrap speedup intervals, speed-of-light bounds and the
KernelBench-style timer kept for comparison. It never imports candidate code, writes files or spawns processes
(it reads /proc and sysfs); the worker calls it inside its sandbox, with the device to itself (gpu_lock.py).
See docs/timing.md for the protocol and what each step defends against."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

_MiB = 1 << 20
_CPU_L2_FALLBACK = 32 * _MiB  # when sysfs is unreadable: a typical server last-level cache
_Z95 = 1.959964  # two-sided 95 % normal quantile

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


# ---------------------------------------------------------------------------------------------- caches


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _cpu_cache_bytes() -> int:
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(path).read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=_CPU_L2_FALLBACK)


def l2_size_bytes(device: str | torch.device) -> int:
    """The cache a flush must evict: the GPU's L2, or on CPU the largest cache level cpu0 reports."""
    if _is_cuda(device):
        return int(torch.cuda.get_device_properties(torch.device(device)).L2_cache_size)
    return _cpu_cache_bytes()


@functools.lru_cache(maxsize=1)
def _libcudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch itself loaded (so the call reaches the same context), else any on the path."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
        for path in paths:
            if os.path.exists(path):
                return ctypes.CDLL(path)
    except OSError:
        pass
    name = ctypes.util.find_library("cudart")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_CUDA_LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize


def reset_persisting_l2(disable: bool = True) -> bool:
    """Best effort: demote all persisting L2 lines to normal (and, with `disable`, shrink the persisting carve-out
    to 0), so an access-policy window set by a candidate cannot keep its data resident across the flush. True if
    the calls succeeded; never raises (False without CUDA or libcudart)."""
    if not torch.cuda.is_available():
        return False
    try:
        lib = _libcudart()
        if lib is None:
            return False
        ok = True
        if disable:
            ok = lib.cudaDeviceSetLimit(ctypes.c_int(_CUDA_LIMIT_PERSISTING_L2), ctypes.c_size_t(0)) == 0
        return lib.cudaCtxResetPersistingL2Cache() == 0 and ok
    except (OSError, AttributeError):
        return False


def make_flush(device: str | torch.device, l2_bytes: int | None = None) -> Callable[[], None]:
    """A callable that overwrites 2 x the cache size (and, on CUDA, resets persisting L2) so every timed iteration
    starts cold. CUDA: a `zero_()` on a device buffer, queued on the current stream; CPU: `fill_` of a host array."""
    size = 2 * (l2_bytes if l2_bytes is not None else l2_size_bytes(device))
    if _is_cuda(device):
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        reset_persisting_l2(disable=True)  # once: changing a device limit may be slow; a candidate re-raising it
        # still has its persisting lines demoted before every call

        def flush_cuda() -> None:
            reset_persisting_l2(disable=False)
            buf.zero_()

        return flush_cuda
    host = torch.empty(size, dtype=torch.uint8)
    counter = [0]

    def flush_cpu() -> None:
        counter[0] = (counter[0] + 1) & 0xFF  # a new value each time so no layer can skip a no-op write
        host.fill_(counter[0])

    return flush_cpu


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


def median_ci(samples: Sequence[float], z: float = _Z95) -> tuple[float, float]:
    """Distribution-free CI of the median from order statistics: the ranks n/2 -/+ z*sqrt(n)/2 (normal
    approximation of Binomial(n, 1/2)). Deterministic and O(n log n), so it is cheap enough to evaluate inside
    the adaptive loop, and makes no assumption about the (skewed, multi-modal) shape of kernel timings."""
    xs = sorted(samples)
    n = len(xs)
    if n == 0:
        return (math.nan, math.nan)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return (xs[lo], xs[max(lo, hi)])


def _rel_half_width(samples: Sequence[float]) -> float:
    lo, hi = median_ci(samples)
    med = float(np.median(samples))
    return (hi - lo) / 2 / med if med > 0 else math.inf


@dataclass(frozen=True)
class TimingSamples:
    """One model's timing under the protocol. `times_ms`: per-iteration samples (CUDA events on the stream the
    call was issued on, or `perf_counter` around the call on CPU). `host_ms_per_iter`: median of the per-iteration
    host clock, which waits for every stream and thread the call started (see `_step`), step overhead removed.
    `tail_ms`: median host time from the moment the call's own clock stopped (its stream's end event complete; on
    CPU, the call returned) until every stream and thread it started was done, less the same for a no-op call:
    work that escaped the per-call clock (`stream_escape`)."""

    times_ms: tuple[float, ...]
    median_ms: float
    ci_ms: tuple[float, float]
    host_ms_per_iter: float
    overhead_ms: float  # CUDA: host ms a step adds around a no-op call, removed from host samples; CPU: 0
    n_input_sets: int
    total_s: float
    stop_reason: str  # "converged" | "max_iters" | "max_time"
    clock: str  # "cuda_event" | "perf_counter"
    lead_ms: float = 0.0  # the GPU lead queued before each timed call (CUDA)
    tail_ms: float = 0.0
    # CUDA: the SM clock during the timed iterations (10th, 50th and 90th percentile, MHz; `sm_clock_stats`), read
    # off each iteration's lead, and the rank correlation of the per-call times with it: whether clock changes
    # (power states, boost) drive the spread. Recorded, not yet used by any rule. () and 0 on CPU.
    sm_clock_mhz: tuple[float, ...] = ()
    time_sm_clock_corr: float = 0.0
    # with several loops (TimingPlan.loops): each loop's sample count, in `times_ms` order; median_ms is then the
    # mean of the loop medians. () for one loop
    loop_sizes: tuple[int, ...] = ()

    @property
    def loop_times_ms(self) -> list[np.ndarray]:
        """Each loop's per-call times (one array for a single loop)."""
        x = np.asarray(self.times_ms, dtype=np.float64)
        return np.split(x, np.cumsum(self.loop_sizes)[:-1]) if len(self.loop_sizes) > 1 else [x]

    @property
    def loop_medians_ms(self) -> tuple[float, ...]:
        return tuple(float(np.median(t)) for t in self.loop_times_ms) if len(self.loop_sizes) > 1 else ()

    @property
    def escaped_ratio(self) -> float:
        """(per-iteration median + tail) / median: about 1 for honest work, large when work escapes the clock."""
        return (self.median_ms + self.tail_ms) / self.median_ms if self.median_ms > 0 else math.inf

    def to_dict(self) -> dict:
        return {**asdict(self), "escaped_ratio": self.escaped_ratio}

    @classmethod
    def from_dict(cls, d: dict) -> "TimingSamples":
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, "times_ms": tuple(fields["times_ms"]), "ci_ms": tuple(fields["ci_ms"]),
                      **{k: tuple(fields.get(k, ())) for k in ("sm_clock_mhz", "loop_sizes")}})


def effective_time_ms(samples: TimingSamples) -> float:
    """A candidate's reported time: the per-call median, plus the tail when work escaped the per-call clock
    (`stream_escape`: side streams, background threads), so escaped work is paid for in full. The trusted
    reference is reported at its median (`speedup_interval`)."""
    return samples.median_ms + samples.tail_ms if stream_escape(samples) else samples.median_ms


def stream_escape(samples: TimingSamples, rel: float = 0.25, abs_ms: float = 0.01) -> bool:
    """True when work went on after the per-call clock stopped (`tail_ms`) for more than `rel` of the per-call
    median AND `abs_ms`.

    The tail starts when the call's own stream is seen done (a spin on its end event) and ends when the whole
    device (every stream) or, on CPU, every thread the call started is done; a no-op call's tail is taken off.
    Host launch latency and a synchronize's wake-up under CPU load fall before the tail starts, so neither can
    flag an honest kernel: H200 runs at `bc30937` and `692c025` saw both push the whole step's host time 20-40 us
    above the events of honest microsecond kernels, which the earlier rule (host time against events) read as
    escapes. A flagged candidate is reported at median + tail (`effective_time_ms`) and the harness marks it
    `work_escaped_default_stream`."""
    return samples.tail_ms > abs_ms and samples.tail_ms > rel * samples.median_ms


def _effective_scale(samples: TimingSamples) -> float:
    return effective_time_ms(samples) / samples.median_ms if samples.median_ms > 0 else 1.0


def reference_time_ms(samples: TimingSamples) -> float:
    """The reference's reported time: its per-call median. The reference is the task's own trusted `Model`, so a
    tail is noise, never escaped work; charging it would inflate every candidate's speedup."""
    return samples.median_ms


def _bootstrap_medians(x: np.ndarray, rng: np.random.Generator, n_boot: int, chunk: int = 256) -> np.ndarray:
    """Medians of `n_boot` resamples of `x`, in chunks so 5000 samples never need a 5000 x 2000 matrix."""
    return np.concatenate([np.median(x[rng.integers(0, len(x), (min(chunk, n_boot - i), len(x)))], axis=1)
                           for i in range(0, n_boot, chunk)])


def _bootstrap_times(samples: TimingSamples, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Bootstrap replicates of a sample set's median, or with several loops of the mean of their medians: loops
    drawn with replacement, and each drawn loop's samples resampled within it, so the replicates carry the
    variation between loops as well as within them."""
    loops = samples.loop_times_ms
    if len(loops) == 1:
        return _bootstrap_medians(loops[0], rng, n_boot)
    per_loop = np.stack([_bootstrap_medians(part, rng, n_boot) for part in loops])
    drawn = rng.integers(0, len(loops), (n_boot, len(loops)))
    return per_loop[drawn, np.arange(n_boot)[:, None]].mean(axis=1)


def speedup_interval(ref: TimingSamples, cand: TimingSamples, n_boot: int = 2000, conf: float = 0.95,
                     seed: int = 0) -> tuple[float, float, float]:
    """(median, lo, hi) of speedup = ref / cand: point estimate from the reported times (`reference_time_ms`,
    `effective_time_ms`), percentile bootstrap over both sample sets (resampled independently: they come from
    separate processes; `_bootstrap_times`). The candidate's times are scaled by effective / median, so the
    interval is about the same times that are reported."""
    rng = np.random.default_rng(seed)
    ratios = _bootstrap_times(ref, rng, n_boot) / (_bootstrap_times(cand, rng, n_boot) * _effective_scale(cand))
    alpha = (1 - conf) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return (reference_time_ms(ref) / effective_time_ms(cand), float(lo), float(hi))


# ---------------------------------------------------------------------------------------------- timed loops


def synchronize(device: str | torch.device) -> None:
    """Wait for all work on every stream of a CUDA device; nothing to wait for on CPU."""
    if _is_cuda(device):
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


def _warm_up(call: Callable[..., Any], input_sets: Sequence[Sequence[Any]], plan: TimingPlan, dev: torch.device,
             flush: Callable[[], None]) -> list[float]:
    """Run `plan.warmup` calls and at least `plan.warmup_s` (clocks and caches settle), each after a flush on
    an idle device; returns each call's host issue time (ms until it returned), which sizes the lead."""
    issue_ms: list[float] = []
    start, i = _now_s(), 0
    while i < plan.warmup or _now_s() - start < plan.warmup_s:
        flush()  # warms the flush too: a thread pool its first parallel fill creates must predate timing
        synchronize(dev)
        t0 = _now_ns()
        call(*input_sets[i % len(input_sets)])
        issue_ms.append((_now_ns() - t0) / 1e6)
        i += 1
    synchronize(dev)
    return issue_ms


def time_calls(call: Callable[..., Any], input_sets: Sequence[Sequence[Any]], plan: TimingPlan,
               device: str | torch.device, flush: Callable[[], None]) -> TimingSamples:
    """Time `call(*input_sets[i % n])` under the protocol (call it under `torch.no_grad()`, with the device alone).

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
    if not input_sets:
        raise ValueError("time_calls needs at least one input set")
    if plan.loops <= 1:
        return _time_loop(call, input_sets, plan, device, flush)
    k = plan.loops
    share = replace(plan, loops=1, min_iters=max(8, math.ceil(plan.min_iters / k)),
                    max_iters=max(8, math.ceil(plan.max_iters / k)), min_time_s=plan.min_time_s / k,
                    max_time_s=plan.max_time_s / k)
    return _pool_loops([_time_loop(call, input_sets, share, device, flush) for _ in range(k)])


def _pool_loops(loops: Sequence[TimingSamples], n_boot: int = 1000) -> TimingSamples:
    """Several loops' samples as one set: all their times, the mean of their medians as the median (a level each
    loop settles at averages out), a bootstrap interval over loops and samples (`_bootstrap_times`), and the
    median of each loop's host, overhead, lead, tail and clock figures."""
    def mid(values: Sequence[float]) -> float:
        return float(np.median(values))

    clocks = [s.sm_clock_mhz for s in loops if s.sm_clock_mhz]
    unfinished = [s.stop_reason for s in loops if s.stop_reason != "converged"]
    pooled = TimingSamples(
        times_ms=tuple(t for s in loops for t in s.times_ms), median_ms=float(np.mean([s.median_ms for s in loops])),
        ci_ms=(0.0, 0.0), host_ms_per_iter=mid([s.host_ms_per_iter for s in loops]),
        overhead_ms=mid([s.overhead_ms for s in loops]), n_input_sets=loops[0].n_input_sets,
        total_s=sum(s.total_s for s in loops), stop_reason=unfinished[0] if unfinished else "converged",
        clock=loops[0].clock, lead_ms=mid([s.lead_ms for s in loops]), tail_ms=mid([s.tail_ms for s in loops]),
        sm_clock_mhz=(min(c[0] for c in clocks), mid([c[1] for c in clocks]), max(c[2] for c in clocks))
        if clocks else (), time_sm_clock_corr=mid([s.time_sm_clock_corr for s in loops]),
        loop_sizes=tuple(len(s.times_ms) for s in loops))
    boot = _bootstrap_times(pooled, np.random.default_rng(0), n_boot)
    return replace(pooled, ci_ms=(float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))))


def _time_loop(call: Callable[..., Any], input_sets: Sequence[Sequence[Any]], plan: TimingPlan,
               device: str | torch.device, flush: Callable[[], None]) -> TimingSamples:
    """One timing loop of `time_calls`."""
    dev = torch.device(device)
    n_sets = len(input_sets)
    issue_ms = _warm_up(call, input_sets, plan, dev, flush)
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
    start_ns = _now_ns()
    deadline = _now_s() + plan.max_time_s
    while len(times) < plan.max_iters:
        t, h, tail, lead_gpu_ms = _step(call, input_sets[len(times) % n_sets], dev, flush, deadline, lead)
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
                         time_sm_clock_corr=time_sm_clock_corr)


def kernelbench_style_ms(call: Callable[..., Any], inputs: Sequence[Any], trials: int = 100, warmup: int = 3,
                         device: str | torch.device = "cuda") -> float:
    """KernelBench's protocol, for comparison only: mean of `trials` per-call times on one fixed input set, no
    flush, CUDA events on the default stream with a synchronize after each (CPU: `perf_counter`)."""
    for _ in range(warmup):
        call(*inputs)
    synchronize(device)
    times = []
    for _ in range(trials):
        if _is_cuda(device):
            start, end = _CudaEvent(enable_timing=True), _CudaEvent(enable_timing=True)
            start.record()
            call(*inputs)
            end.record()
            _cuda_sync(torch.device(device))
            times.append(start.elapsed_time(end))
        else:
            t0 = _now_ns()
            call(*inputs)
            times.append((_now_ns() - t0) / 1e6)
    return float(np.mean(times))


# ---------------------------------------------------------------------------------------------- speed of light


@dataclass(frozen=True)
class Ceilings:
    """Measured hardware ceilings of one device: memory bandwidth (read + write bytes per second) and peak
    matmul FLOP/s for one dtype."""

    bandwidth_bytes_s: float
    peak_flops: float
    dtype: str


def min_bytes_moved(inputs: Any, outputs: Any, params: Iterable[torch.Tensor] = ()) -> int:
    """A lower bound on DRAM traffic: every input (and parameter) read once, every output written once."""
    return tensor_bytes(inputs) + tensor_bytes(outputs) + tensor_bytes(list(params))


def count_flops(model: Callable[..., Any], inputs: Sequence[Any]) -> int:
    """FLOPs of one forward as counted by `FlopCounterMode` (matmul/conv family; 2*M*N*K for a matmul), 0 when
    unknown. Call it on the task's reference `Model`, never on candidate code: the bound belongs to the task."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(*inputs)
        return int(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - an op the counter cannot trace means "unknown", not a failure
        return 0


def speed_of_light_ms(bytes_moved: float, bandwidth_bytes_s: float) -> float:
    """Lower bound on one call of any correct implementation: the minimum bytes moved at full bandwidth (0 when
    unknown). The reference's FLOPs are no such bound: a candidate may compute the same result with fewer
    (KernelBench L1/12 builds `diag(A) @ B` as a dense matmul; a row scaling does it with N*M multiplies), so
    they give `reference_flops_ms` instead, which is reported and never quarantines."""
    return bytes_moved / bandwidth_bytes_s * 1e3 if bandwidth_bytes_s > 0 else 0.0


def reference_flops_ms(flops: float, peak_flops: float) -> float:
    """The reference algorithm's FLOPs at the measured peak (0 when unknown): beating it means doing less
    arithmetic than the reference does, which is either an algorithmic shortcut or a result not computed."""
    return flops / peak_flops * 1e3 if peak_flops > 0 else 0.0


def faster_than_light(time_ms: float, bound_ms: float, slack: float = 0.9) -> bool:
    """True when a measured time beats a lower bound by more than the slack allows."""
    return bound_ms > 0 and time_ms < slack * bound_ms


def measure_ceilings(device: str | torch.device, dtype: torch.dtype = torch.float32, reps: int = 5) -> Ceilings:
    """Best-of-`reps` copy bandwidth (bytes read + written) and FLOP/s of a large square matmul in `dtype`.

    CUDA: a 1 GiB copy (the HBM rate: the protocol flushes L2 before every timed call, so a kernel's data comes
    from HBM) and an 8192^3 matmul, events. CPU: the best of 256 KiB, 4 MiB and 64 MiB copies and a 512^3
    matmul, perf_counter: on a CPU the flush cannot be trusted to evict a large shared last-level cache (nor a
    VM's view of it), so the bound uses the fastest rate any working-set size reaches. Measure once per
    (device, torch version, dtype) and cache: it takes seconds on a GPU."""
    cuda = _is_cuda(device)
    copy_sizes, n = ([1 << 30], 8192) if cuda else ([256 << 10, 4 * _MiB, 64 * _MiB], 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def best_ms(fn: Callable[[], Any]) -> float:
        fn()
        synchronize(device)
        best = math.inf
        for _ in range(reps):
            if cuda:
                start, end = _CudaEvent(enable_timing=True), _CudaEvent(enable_timing=True)
                start.record()
                fn()
                end.record()
                _cuda_sync(torch.device(device))
                best = min(best, start.elapsed_time(end))
            else:
                t0 = _now_ns()
                fn()
                best = min(best, (_now_ns() - t0) / 1e6)
        return best

    bandwidth = 0.0
    for size in copy_sizes:
        src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        bandwidth = max(bandwidth, 2 * size / (best_ms(lambda: dst.copy_(src)) / 1e3))
    mm_ms = best_ms(lambda: torch.mm(a, b))
    return Ceilings(bandwidth_bytes_s=bandwidth, peak_flops=2 * n**3 / (mm_ms / 1e3),
                    dtype=str(dtype).removeprefix("torch."))
