"""Timing statistics, on the parent's side and in the worker alike: `TimingSamples` (what one timed loop
measured), the times we report from them (`reference_time_ms`, `effective_time_ms` with the tail charged), the
stream-escape flag, several loops pooled into one set, and bootstrap intervals of a median and of a speedup.
Pure arithmetic: no clock, no device."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import numpy as np

_Z95 = 1.959964  # two-sided 95 % normal quantile


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
    # timed calls whose inputs held content an earlier call had seen (a loop given no refresh: timing.Rotation); a
    # cache keyed on content could hit on those
    repeated_calls: int = 0
    # CUDA, when work escaped the events (`stream_escape`): the median host ms of a call timed from just before it
    # to a device-wide synchronize, with no lead and less a no-op's (timing.synchronized_ms). Launch latency is in
    # it, so escaped work is never charged less than the same work on the timed stream. 0 when not measured
    sync_ms: float = 0.0

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


def timing_fields(res: dict) -> dict:
    """A run report's timing samples (TimingSamples fields) and whether they were taken with the device alone."""
    return {k: res[k] for k in (*TimingSamples.__dataclass_fields__, "device_exclusive") if k in res}


def effective_time_ms(samples: TimingSamples) -> float:
    """A candidate's reported time: the per-call median, plus the tail when work escaped the per-call clock
    (`stream_escape`: side streams, background threads), or the synchronized time if more (`sync_ms`: side-stream
    work runs beside the GPU lead, which the tail does not see), so escaped work is paid for in full. The trusted
    reference is reported at its median (`speedup_interval`)."""
    if not stream_escape(samples):
        return samples.median_ms
    return max(samples.median_ms + samples.tail_ms, samples.sync_ms)


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


def pool_loops(loops: Sequence[TimingSamples], n_boot: int = 1000) -> TimingSamples:
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
        loop_sizes=tuple(len(s.times_ms) for s in loops), repeated_calls=sum(s.repeated_calls for s in loops),
        sync_ms=max(s.sync_ms for s in loops))
    boot = _bootstrap_times(pooled, np.random.default_rng(0), n_boot)
    return replace(pooled, ci_ms=(float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))))
