"""The timing protocol's building blocks (harness/timing/loop.py): adaptive stopping, input rotation, escape detection,
bootstrap intervals, speed-of-light arithmetic. CPU tests are fast; the CUDA paths are marked gpu."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dice_kernels.harness.timing import speed_of_light, stats as timing_stats
from dice_kernels.harness.timing import cache_flush as F
from dice_kernels.harness.timing import loop as T

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernelbench_style  # noqa: E402 - the KernelBench-style evaluator's timer, for comparison

SMALL_CACHE = 1 << 16  # a 128 KiB flush keeps CPU tests fast; the flush size itself is tested separately


def _flush():
    return F.make_flush("cpu", l2_bytes=SMALL_CACHE)


def _samples(times, tail=0.0) -> timing_stats.TimingSamples:
    med = float(np.median(times))
    return timing_stats.TimingSamples(times_ms=tuple(times), median_ms=med, ci_ms=timing_stats.median_ci(times),
                           host_ms_per_iter=med + tail, overhead_ms=0.0, n_input_sets=1,
                           total_s=0.0, stop_reason="max_iters", clock="perf_counter", tail_ms=tail)


# ---------------------------------------------------------------------------------------------- input refresh


def test_refreshed_sets_never_show_a_call_content_an_earlier_call_saw():
    """A cache keyed on content (here: the first value, the weakest key) never hits when every set is renewed
    after each call; rotation alone repeats content from the second pass on, and the repeats are counted."""
    plan = T.TimingPlan(warmup=3, warmup_s=0.0, min_iters=12, max_iters=12, min_time_s=0.0, max_time_s=30.0,
                        target_rel_ci=0.0)
    fresh = iter(range(1, 10_000))

    def refresh(inputs):
        inputs[0].fill_(next(fresh))

    def sets():
        return [[torch.full((4,), -1.0 - k)] for k in range(2)]

    for rotation, repeats in ((T.Rotation(sets(), refresh), 0), (T.Rotation(sets()), 12)):
        seen: list[float] = []
        s = T.time_calls(lambda x: seen.append(float(x[0])), rotation, plan, "cpu", _flush())
        assert len(seen) == 3 + 12 and s.repeated_calls == repeats
        assert (len(set(seen)) == len(seen)) is (repeats == 0)


# ---------------------------------------------------------------------------------------------- adaptive stopping


def test_stops_exactly_at_max_iters_when_never_converged():
    plan = T.TimingPlan(warmup=2, min_iters=5, max_iters=30, min_time_s=0.0, max_time_s=30.0, target_rel_ci=0.0)
    s = T.time_calls(lambda x: x + 1, [[torch.ones(4)]], plan, "cpu", _flush())
    assert len(s.times_ms) == 30 and s.stop_reason == "max_iters"


def test_stops_at_max_time():
    plan = T.TimingPlan(warmup=0, min_iters=1, max_iters=10_000, min_time_s=0.0, max_time_s=0.1, target_rel_ci=0.0)
    s = T.time_calls(lambda: time.sleep(0.005), [[]], plan, "cpu", _flush())
    assert s.stop_reason == "max_time" and s.total_s >= 0.1  # not before its time was up
    assert len(s.times_ms) <= 21  # 5 ms each: no more than the time allows


def test_respects_min_iters_and_min_time_before_converging():
    # target_rel_ci=10 is met from the start, so only the minimums can hold the loop; max_iters is out of reach
    # (10,000 calls of ~20 us had ended before 0.2 s on a quiet CI machine, and the loop stopped at max_iters)
    plan = T.TimingPlan(warmup=0, min_iters=50, max_iters=10_000_000, min_time_s=0.2, max_time_s=5.0,
                        target_rel_ci=10.0)
    s = T.time_calls(lambda x: x * 2, [[torch.ones(4)]], plan, "cpu", _flush())
    assert s.stop_reason == "converged"
    assert len(s.times_ms) >= 50 and s.total_s >= 0.2


def test_converges_well_before_max_for_a_steady_call():
    plan = T.TimingPlan(warmup=1, min_iters=16, max_iters=5000, min_time_s=0.0, max_time_s=5.0, target_rel_ci=0.5)
    s = T.time_calls(lambda: time.sleep(0.001), [[]], plan, "cpu", _flush())
    assert s.stop_reason == "converged" and len(s.times_ms) < 5000
    lo, hi = s.ci_ms
    assert lo <= s.median_ms <= hi and (hi - lo) / 2 / s.median_ms <= 0.5


# ---------------------------------------------------------------------------------------------- rotation


def test_rotation_uses_every_input_set_evenly_and_never_twice_in_a_row():
    sets = [[torch.full((4,), float(k))] for k in range(4)]
    seen: list[int] = []
    plan = T.TimingPlan(warmup=3, warmup_s=0.0, min_iters=40, max_iters=40, min_time_s=0.0, target_rel_ci=0.0)
    T.time_calls(lambda x: seen.append(int(x[0])), sets, plan, "cpu", _flush())
    timed = seen[3:]
    assert len(timed) == 40 and Counter(timed) == {0: 10, 1: 10, 2: 10, 3: 10}
    assert all(a != b for a, b in zip(timed, timed[1:]))


def test_number_of_input_sets_grows_with_cache_and_covers_twice_l2():
    set_bytes = 3 << 20
    counts = [T.n_input_sets(set_bytes, l2 << 20) for l2 in (1, 8, 32, 60)]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    for l2, n in zip((1, 8, 32, 60), counts):
        assert n >= 2 and n * set_bytes > 2 * (l2 << 20)
    # capped by the memory budget and by max_input_sets, never below one set
    assert T.n_input_sets(1 << 30, 60 << 20, T.TimingPlan(input_memory_budget=3 << 30)) == 2
    assert T.n_input_sets(8 << 30, 60 << 20, T.TimingPlan(input_memory_budget=4 << 30)) == 1
    assert T.n_input_sets(1, 60 << 20) == T.TimingPlan().max_input_sets


def test_tensor_bytes_and_min_bytes_moved_count_nested_tensors_once():
    x, y = torch.zeros(10, dtype=torch.float32), torch.zeros(3, dtype=torch.float16)
    assert T.tensor_bytes([x, (y, 5), {"a": x}]) == 40 + 6 + 40
    assert speed_of_light.min_bytes_moved([x, 2.0], y, params=[torch.zeros(2, dtype=torch.float64)]) == 40 + 6 + 16


# ---------------------------------------------------------------------------------------------- escape (CPU)


def _background_worker(seconds: float):
    """A 'kernel' that returns at once and finishes its output on a thread `seconds` later."""

    def call(x):
        out = torch.empty_like(x)

        def work():
            time.sleep(seconds)
            out.copy_(x * 2)

        threading.Thread(target=work).start()
        return out

    return call


def test_background_thread_work_is_charged_and_flagged():
    work_s = 0.05  # long enough that a thread start on a loaded 2-core machine (up to ~8 ms seen) is far below it
    plan = T.TimingPlan(warmup=2, min_iters=10, max_iters=10, min_time_s=0.0, max_time_s=10.0, target_rel_ci=0.0)
    s = T.time_calls(_background_worker(work_s), [[torch.ones(8)], [torch.zeros(8)]], plan, "cpu", _flush())
    assert s.median_ms < work_s * 1e3 / 2  # the per-call clock only sees the thread start
    assert timing_stats.effective_time_ms(s) >= work_s * 1e3
    assert timing_stats.stream_escape(s)
    # the comparison protocol is fooled: its mean is far below the work done
    fooled = kernelbench_style.kernelbench_style_ms(_background_worker(work_s), [torch.ones(8)], trials=10, device="cpu")
    assert fooled < work_s * 1e3 / 2
    time.sleep(3 * work_s)  # let the comparison's threads finish before other tests count threads


def test_honest_call_of_the_same_duration_is_not_flagged():
    plan = T.TimingPlan(warmup=1, min_iters=10, max_iters=10, min_time_s=0.0, target_rel_ci=0.0)
    s = T.time_calls(lambda: time.sleep(0.02), [[]], plan, "cpu", _flush())
    assert not timing_stats.stream_escape(s) and s.escaped_ratio == pytest.approx(1.0)
    assert timing_stats.effective_time_ms(s) == pytest.approx(s.median_ms)


def test_escaped_work_is_charged_its_synchronized_time_when_that_is_more():
    """Side-stream work runs beside the GPU lead, so the tail misses part of it; the synchronized time (no lead)
    is charged when larger. Unflagged samples keep their median whatever sync_ms says."""
    escaped = dataclasses.replace(_samples([0.1] * 5, tail=0.9), sync_ms=1.3)
    assert timing_stats.effective_time_ms(escaped) == pytest.approx(1.3)
    assert timing_stats.effective_time_ms(dataclasses.replace(escaped, sync_ms=0.5)) == pytest.approx(1.0)
    assert timing_stats.effective_time_ms(dataclasses.replace(_samples([1.0] * 5), sync_ms=5.0)) == pytest.approx(1.0)


def test_escape_thresholds_need_both_relative_and_absolute_gaps():
    assert not timing_stats.stream_escape(_samples([0.004] * 5, tail=0.008))  # 3x but 8 us: below the floor
    assert not timing_stats.stream_escape(_samples([10.0] * 5, tail=1.0))  # 1 ms but 10 %: noise
    assert timing_stats.stream_escape(_samples([0.1] * 5, tail=0.9))
    assert timing_stats.stream_escape(_samples([0.005] * 5, tail=0.015))  # 15 us hidden behind a 5 us kernel


# ---------------------------------------------------------------------------------------------- statistics


def test_bootstrap_interval_contains_true_ratio_and_narrows_with_more_samples():
    rng = np.random.default_rng(1)
    widths = []
    for n in (30, 600):
        ref = 2.0 * np.exp(rng.normal(0, 0.05, n))
        cand = 1.0 * np.exp(rng.normal(0, 0.05, n))
        med, lo, hi = timing_stats.speedup_interval(_samples(ref), _samples(cand))
        assert lo <= 2.0 <= hi and lo <= med <= hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2
    # deterministic: fixed seed
    assert timing_stats.speedup_interval(_samples(ref), _samples(cand)) == timing_stats.speedup_interval(_samples(ref), _samples(cand))


def test_speedup_uses_host_time_when_work_escapes():
    ref = _samples([1.0] * 50)
    escaped = _samples([0.01] * 50, tail=0.99)  # events say 100x; the work went on 0.99 ms after them
    med, lo, hi = timing_stats.speedup_interval(ref, escaped)
    assert med == pytest.approx(1.0) and hi <= 1.0 + 1e-9


def test_tails_below_the_escape_threshold_are_not_charged_and_never_to_the_reference():
    assert timing_stats.effective_time_ms(_samples([0.005] * 9, tail=0.006)) == pytest.approx(0.005)  # 6 us: below the floor
    assert timing_stats.effective_time_ms(_samples([1.0] * 9, tail=0.2)) == pytest.approx(1.0)  # 20 %: below 25 %
    assert timing_stats.effective_time_ms(_samples([1.0] * 9, tail=0.3)) == pytest.approx(1.3)  # escaped: paid in full
    # a reference's tail is not charged (its code is trusted): the speedup uses its median
    med, _, _ = timing_stats.speedup_interval(_samples([1.0] * 9, tail=2.0), _samples([0.5] * 9))
    assert med == pytest.approx(2.0)


def test_median_ci_is_an_order_statistic_interval_covering_the_median():
    xs = list(np.random.default_rng(0).exponential(1.0, 2001))
    lo, hi = timing_stats.median_ci(xs)
    assert lo < np.median(xs) < hi and lo < np.log(2) < hi  # true median of Exp(1) is ln 2
    assert timing_stats.median_ci([3.0]) == (3.0, 3.0)


def test_samples_round_trip_through_json_dict():
    s = _samples([1.0, 2.0, 3.0], tail=0.5)
    d = s.to_dict()
    assert d["escaped_ratio"] == pytest.approx(1.25)
    assert timing_stats.TimingSamples.from_dict(d) == s
    # samples stored before the tail was measured (cached baselines, old results) still load
    old = {k: v for k, v in d.items() if k != "tail_ms"}
    assert timing_stats.TimingSamples.from_dict(old).tail_ms == 0.0
    clocked = dataclasses.replace(s, sm_clock_mhz=(1900.0, 1980.0, 1980.0), time_sm_clock_corr=-0.2)
    assert timing_stats.TimingSamples.from_dict(json.loads(json.dumps(clocked.to_dict()))) == clocked


def test_several_loops_share_the_limits_and_report_the_mean_of_their_medians():
    plan = T.TimingPlan(warmup=1, min_iters=8, max_iters=40, min_time_s=0.0, max_time_s=30.0, target_rel_ci=0.0,
                        loops=4)
    s = T.time_calls(lambda x: x + 1, [[torch.ones(4)]], plan, "cpu", _flush())
    assert s.loop_sizes == (10, 10, 10, 10) and len(s.times_ms) == 40  # max_iters shared, not multiplied
    assert s.median_ms == pytest.approx(np.mean(s.loop_medians_ms)) and s.stop_reason == "max_iters"
    assert s.ci_ms[0] <= s.median_ms <= s.ci_ms[1]
    assert timing_stats.TimingSamples.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    from dice_kernels.harness import EvalConfig, TimingConfig

    assert EvalConfig(timing=TimingConfig(loops=4)).timing.plan()["loops"] == 4
    with pytest.raises(ValueError, match="timing.loops"):
        EvalConfig(timing=TimingConfig(loops=0)).check()


def test_pooled_loops_average_a_per_loop_level_and_carry_it_in_the_interval():
    # the H200's pattern: each loop settles at one of two levels 10 % apart, steady within the loop
    levels = [1.0, 1.1, 1.0, 1.1]
    loops = [_samples(list(level * np.exp(np.random.default_rng(i).normal(0, 0.001, 50))))
             for i, level in enumerate(levels)]
    pooled = timing_stats.pool_loops(loops)
    assert pooled.median_ms == pytest.approx(1.05, rel=1e-3)  # one loop would report 1.0 or 1.1
    lo, hi = pooled.ci_ms
    assert lo < 1.03 and hi > 1.07  # loops resampled too: the interval spans the levels, not the 0.1 % noise
    assert (hi - lo) / pooled.median_ms > 20 * (loops[0].ci_ms[1] - loops[0].ci_ms[0]) / loops[0].median_ms
    med, lo, hi = timing_stats.speedup_interval(pooled, _samples([0.5] * 50))
    assert med == pytest.approx(2.1, rel=1e-3) and lo < 2.06 and hi > 2.14


# ---------------------------------------------------------------------------------------------- speed of light


def test_speed_of_light_is_the_memory_bound_and_reference_flops_never_quarantine():
    assert speed_of_light.speed_of_light_ms(1e9, 1e12) == pytest.approx(1.0)  # 1 GB at 1 TB/s
    assert speed_of_light.speed_of_light_ms(1e9, 0) == 0.0  # unknown bandwidth: no bound
    assert speed_of_light.reference_flops_ms(1e12, 1e14) == pytest.approx(10.0)
    # KernelBench L1/12 on the H200: diag(A) @ B as a dense 4096^3 matmul (137 GFLOP) against an honest row-scaling
    # kernel measured at 0.086 ms; only the 134 MB it must move bound it
    sol, flops = speed_of_light.speed_of_light_ms(134_234_112, 4.0e12), speed_of_light.reference_flops_ms(137_438_953_472, 5.1e13)
    assert not speed_of_light.faster_than_light(0.086, sol) and speed_of_light.faster_than_light(0.086, flops)


def test_faster_than_light():
    assert speed_of_light.faster_than_light(0.5, 1.0)
    assert not speed_of_light.faster_than_light(0.95, 1.0)
    assert speed_of_light.faster_than_light(0.95, 1.0, slack=1.0)
    assert not speed_of_light.faster_than_light(0.001, 0.0)  # unknown bound never quarantines


def test_flop_counter_gives_2mnk_for_matmul_and_zero_when_unknown():
    m, k, n = 8, 16, 32
    assert speed_of_light.count_flops(torch.matmul, [torch.randn(m, k), torch.randn(k, n)]) == 2 * m * n * k
    assert speed_of_light.count_flops(torch.nn.Linear(k, n, bias=False), [torch.randn(m, k)]) == 2 * m * n * k

    def broken(x):
        raise RuntimeError("no")

    assert speed_of_light.count_flops(broken, [torch.randn(2)]) == 0


def test_cpu_ceilings_and_cache_are_plausible():
    c = speed_of_light.measure_ceilings("cpu", reps=2)
    assert 1e8 < c.bandwidth_bytes_s < 1e13 and 1e7 < c.peak_flops < 1e14
    assert F.l2_size_bytes("cpu") >= 1 << 16
    if not torch.cuda.is_available():
        assert F.reset_persisting_l2() is False  # a no-op, never an exception


# ---------------------------------------------------------------------------------------------- CUDA paths


def _side_stream_matmul(a, b):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        return a @ b


@pytest.mark.gpu
def test_cuda_side_stream_work_is_flagged_and_charged():
    dev = "cuda"
    sets = [[torch.randn(4096, 4096, device=dev), torch.randn(4096, 4096, device=dev)] for _ in range(2)]
    plan = T.TimingPlan(min_iters=20, max_iters=60, min_time_s=0.0, max_time_s=5.0)
    flush = F.make_flush(dev)
    with torch.no_grad():
        honest = T.time_calls(torch.matmul, sets, plan, dev, flush)
        rotation = T.Rotation(sets)
        sneaky = T.time_calls(_side_stream_matmul, rotation, plan, dev, flush)
        tail_only = timing_stats.effective_time_ms(sneaky)
        # what the harness adds for an escape (model_calls.time_forward): the call timed to a device-wide sync
        sneaky = dataclasses.replace(sneaky, sync_ms=T.synchronized_ms(_side_stream_matmul, rotation, dev, flush))
        kb = kernelbench_style.kernelbench_style_ms(_side_stream_matmul, sets[0], device=dev)
    assert timing_stats.stream_escape(sneaky) and not timing_stats.stream_escape(honest)
    # issue 33: the tail alone charged the side stream ~14 % less than its default-stream twin (the side kernel
    # runs beside the lead); with the synchronized time it is never charged less, within noise
    assert timing_stats.effective_time_ms(sneaky) >= 0.97 * timing_stats.effective_time_ms(honest), (
        tail_only, sneaky.sync_ms, timing_stats.effective_time_ms(honest))
    assert kb < 0.2 * honest.median_ms  # the comparison protocol is fooled


@pytest.mark.gpu
def test_cuda_events_and_host_clock_agree_for_an_honest_kernel():
    dev = "cuda"
    sets = [[torch.randn(1 << 24, device=dev)] for _ in range(T.n_input_sets(1 << 26, F.l2_size_bytes(dev)))]
    with torch.no_grad():
        s = T.time_calls(torch.relu, sets, T.TimingPlan(), dev, F.make_flush(dev))
    assert not timing_stats.stream_escape(s)
    assert 0.75 < s.escaped_ratio < 1.25
    assert s.clock == "cuda_event" and s.ci_ms[0] <= s.median_ms <= s.ci_ms[1]
    assert 200 < s.sm_clock_mhz[1] < 4000  # read off the leads: a plausible SM clock


@pytest.mark.gpu
def test_cuda_ceilings_and_l2():
    c = speed_of_light.measure_ceilings("cuda", reps=3)
    assert c.bandwidth_bytes_s > 1e11 and c.peak_flops > 1e12
    assert F.l2_size_bytes("cuda") > 1 << 20


def test_lead_is_sized_from_the_host_issue_time_and_capped():
    plan = T.TimingPlan(max_lead_ms=2.0)
    assert T.lead_ms_for([0.010, 0.012, 0.008], plan) == pytest.approx(1.5 * 0.010 + 0.02)
    assert T.lead_ms_for([5.0, 6.0], plan) == 2.0
    assert timing_stats.TimingSamples.from_dict({**_samples([1.0]).to_dict(), "lead_ms": 0.05}).lead_ms == 0.05


@pytest.mark.gpu
def test_cuda_host_work_beyond_the_given_lead_shows_in_the_events():
    """A candidate is timed with its reference's lead: host work before its launch (here a 0.5 ms sleep, as CPU
    compute would be) that outlasts the lead leaves the GPU idle inside the events; sized from its own warm-up,
    the lead would have hidden it."""
    dev = "cuda"
    sets = [[torch.randn(1 << 20, device=dev)] for _ in range(2)]

    def host_then_launch(t):
        time.sleep(0.0005)
        return torch.relu(t)

    plan = T.TimingPlan(min_iters=20, max_iters=50, min_time_s=0.0, max_time_s=5.0)
    with torch.no_grad():
        given = T.time_calls(host_then_launch, sets, dataclasses.replace(plan, lead_ms=0.03), dev,
                             F.make_flush(dev))
        own = T.time_calls(host_then_launch, sets, plan, dev, F.make_flush(dev))
    assert given.lead_ms == 0.03 and given.median_ms > 0.4
    assert own.lead_ms > 0.5 and own.median_ms < 0.2


def test_sm_clock_is_read_off_the_leads_and_correlated_with_the_times():
    # a 20,000-cycle lead that took 10 us at 2 GHz and 20 us at 1 GHz; the call is slower at the lower clock
    leads = [0.010, 0.010, 0.020, 0.020, 0.010, 0.020]
    times = [0.005, 0.0051, 0.009, 0.0095, 0.0049, 0.0092]
    mhz, corr = T.sm_clock_stats(20_000, leads, times)
    assert mhz[1] == pytest.approx(1500.0) and mhz[0] == pytest.approx(1000.0) and mhz[2] == pytest.approx(2000.0)
    assert corr < -0.8  # the slower the clock, the longer the call
    assert T.sm_clock_stats(0, [0.0, 0.0, 0.0], times) == ((), 0.0)  # no lead (CPU): nothing to read
    steady, corr = T.sm_clock_stats(20_000, [0.010] * 4, [0.005, 0.006, 0.005, 0.006])
    assert steady == (2000.0, 2000.0, 2000.0) and corr == 0.0
