"""demo/stats.py: Wilson and bootstrap intervals, the task-clustered bootstrap, and the paired comparison's verdict."""

from __future__ import annotations

import pytest

from dice_kernels.demo.stats import (Interval, paired_difference, rate_interval, runs_difference, unpaired_difference,
                                    wilson)


def test_wilson_matches_known_values_and_stays_in_0_1():
    iv = wilson(5, 10)  # the textbook figure: 0.237 .. 0.763
    assert iv.value == 0.5 and iv.lo == pytest.approx(0.2366, abs=1e-3) and iv.hi == pytest.approx(0.7634, abs=1e-3)
    zero = wilson(0, 20)
    assert zero.lo == 0.0 and 0.1 < zero.hi < 0.2  # no successes still leaves an upper bound above 0
    assert wilson(20, 20).hi == 1.0 and wilson(20, 20).lo > 0.8
    with pytest.raises(ValueError, match="successes"):
        wilson(3, 2)


def test_rate_interval_uses_wilson_for_one_binary_sample_per_task():
    scores = {f"t{i}": [1.0 if i < 3 else 0.0] for i in range(12)}
    assert rate_interval(scores) == wilson(3, 12)


def test_k_samples_per_task_are_clustered_by_task():
    # 8 tasks, 4 identical samples each: 32 scores but only 8 independent units. Clustering must give the interval
    # of 8 task means, wider than a (wrong) interval treating 32 samples as independent.
    per_task = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    clustered = rate_interval({f"t{i}": [v] * 4 for i, v in enumerate(per_task)}, seed=1)
    independent = rate_interval({f"s{i}": [v] for i, v in enumerate(per_task * 4)})
    assert clustered.value == independent.value == 0.5
    assert clustered.hi - clustered.lo > 1.3 * (independent.hi - independent.lo)


def test_bootstrap_is_seeded():
    scores = {f"t{i}": [0.25 * (i % 5)] for i in range(30)}
    assert rate_interval(scores, seed=3) == rate_interval(scores, seed=3)
    assert rate_interval(scores, seed=3) != rate_interval(scores, seed=4)


def test_paired_difference_sees_a_consistent_gain_that_unpaired_rates_would_blur():
    # B solves 40 of 100 tasks; A solves the same 40 and 12 more. The paired interval excludes 0.
    b = {f"t{i}": [1.0 if i < 40 else 0.0] for i in range(100)}
    a = {f"t{i}": [1.0 if i < 52 else 0.0] for i in range(100)}
    cmp = paired_difference(a, b, ("A", "B"), seed=0)
    assert cmp.n == 100 and cmp.diff.value == pytest.approx(0.12)
    assert cmp.diff.lo > 0 and cmp.verdict == "A higher than B"
    assert paired_difference(b, a, ("B", "A")).verdict == "B lower than A"
    # unpaired, the two Wilson intervals overlap: only pairing shows the gain
    assert wilson(52, 100).lo < wilson(40, 100).hi


def test_paired_difference_of_noise_claims_nothing_and_uses_shared_tasks_only():
    a = {f"t{i}": [float(i % 2)] for i in range(40)}
    b = {f"t{i}": [float((i + 1) % 2)] for i in range(40)} | {"extra": [1.0]}
    cmp = paired_difference(a, b, ("A", "B"))
    assert cmp.n == 40 and cmp.diff.lo < 0 < cmp.diff.hi
    assert cmp.verdict.startswith("no difference")
    with pytest.raises(ValueError, match="share no task"):
        paired_difference({"x": [1.0]}, {"y": [0.0]})


def test_interval_excludes_zero():
    assert Interval(0.1, 0.01, 0.2).excludes_zero() and not Interval(0.1, -0.01, 0.2).excludes_zero()


def _run(n: int, a_passes: set[int], b_passes: set[int]) -> tuple[dict, dict]:
    return ({f"t{i}": [float(i in a_passes)] for i in range(n)}, {f"t{i}": [float(i in b_passes)] for i in range(n)})


def test_runs_difference_carries_the_spread_between_runs():
    # two runs that disagree (A gains 12 of 20 tasks in one, loses 12 in the other): pooling the 40 tasks as one set
    # would give 0 with a narrow interval; the runs' spread makes it wide
    gain, loss = _run(20, set(range(12)), set()), _run(20, set(), set(range(12)))
    pooled = paired_difference({**{f"g{k}": v for k, v in gain[0].items()}, **{f"l{k}": v for k, v in loss[0].items()}},
                               {**{f"g{k}": v for k, v in gain[1].items()}, **{f"l{k}": v for k, v in loss[1].items()}})
    across = runs_difference([gain, loss])
    assert across.diff.value == pytest.approx(0.0) and pooled.diff.value == pytest.approx(0.0)
    assert across.n == 40
    assert across.diff.lo < -0.45 and across.diff.hi > 0.45  # one draw of runs is both "gain" runs, another both "loss"
    assert pooled.diff.hi - pooled.diff.lo < 0.6 < across.diff.hi - across.diff.lo


def test_runs_difference_of_runs_that_agree_excludes_zero_and_weighs_runs_alike():
    runs = [_run(10, set(range(4)), set()), _run(30, set(range(6)), set())]  # +0.4 and +0.2
    cmp = runs_difference(runs, ("rl", "sft"))
    assert cmp.diff.value == pytest.approx(0.3)  # the runs' mean, not the tasks' (10/40 = 0.25)
    assert cmp.diff.excludes_zero() and cmp.verdict == "rl higher than sft"
    assert runs_difference(runs, seed=3) == runs_difference(runs, seed=3)


def test_runs_difference_refuses_a_run_without_shared_tasks():
    with pytest.raises(ValueError, match="run 1: A and B share no task"):
        runs_difference([_run(3, {0}, set()), ({"x": [1.0]}, {"y": [0.0]})])
    with pytest.raises(ValueError, match="at least one run"):
        runs_difference([])


def test_unpaired_difference_compares_different_tasks_and_is_wider_than_paired():
    up = {f"t{i}": [1.0] for i in range(20)} | {f"t{i}": [0.0] for i in range(20, 30)}  # 2/3 of 30 tasks
    down = {f"u{i}": [1.0] for i in range(5)} | {f"u{i}": [0.0] for i in range(5, 20)}  # 1/4 of 20 other tasks
    cmp = unpaired_difference(up, down, ("late", "early"))
    assert cmp.n == 20 and cmp.diff.value == pytest.approx(2 / 3 - 1 / 4)
    assert cmp.diff.excludes_zero() and cmp.verdict == "late higher than early"
    same = unpaired_difference({"a": [1.0], "b": [0.0]}, {"c": [1.0], "d": [0.0]})
    assert same.diff.value == 0 and not same.diff.excludes_zero()
    with pytest.raises(ValueError, match="both need a task"):
        unpaired_difference(up, {})
