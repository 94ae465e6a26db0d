"""The timing-stability benchmark's variance probe (benchmarks/timing_stability.py --probe): how its summary
sets a reference's spread across processes beside its spreads within them (fast, nothing is timed)."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import timing_stability as ts  # noqa: E402


def _run(ref_ms: float, same: list[float], fresh: list[float], clock: list[float], corr: float = 0.0) -> dict:
    return {"id": "p", "ours": {"ref": {"median_ms": ref_ms, "sm_clock_mhz": clock, "time_sm_clock_corr": corr}},
            "probe": {"ref_same_sets_ms": same, "ref_fresh_sets_ms": fresh}}


def test_probe_summary_separates_placement_from_drift_and_clocks():
    # three processes 10 % apart; within each, the same sets agree to 1 % and fresh sets differ by 8 %
    runs = [_run(m, [m, m * 1.01], [m, m * 1.08], [1900.0, 1980.0, 1980.0], -0.1) for m in (1.0, 1.05, 1.10)]
    s = ts._probe_summary(runs)
    assert s["ref_across_processes"] == pytest.approx(1.10)
    assert s["ref_same_sets_within"] == pytest.approx(1.01)
    assert s["ref_fresh_sets_within"] == pytest.approx(1.08)  # placement explains most of the spread
    assert s["ref_loops_within"] == pytest.approx(1.08)  # all five loops of a process: its first timing included
    assert s["clock_across_processes"] == pytest.approx(1.0) and s["time_clock_corr"] == pytest.approx(-0.1)
    cpu = [_run(1.0, [1.0, 1.0], [1.0, 1.0], [])]  # no clock readings on a CPU run
    assert ts._probe_summary(cpu)["clock_across_processes"] is None



def test_probe_summary_sees_loops_that_differ_where_each_pair_of_re_timings_agrees():
    # the H200's pattern (pair 4212): within one process the first loop, the same-set pair and the fresh-set pair
    # each agree with their twin but sit at different levels
    runs = [_run(6.08, [6.94, 6.94], [6.98, 6.94], [1790.0, 1811.0, 1830.0]),
            _run(6.37, [5.79, 6.37], [5.82, 6.37], [1730.0, 1750.0, 1770.0])]
    s = ts._probe_summary(runs)
    assert s["ref_same_sets_within"] < 1.06 and s["ref_loops_within"] == pytest.approx((6.98 / 6.08 + 6.37 / 5.79) / 2)


def test_each_loop_count_is_aggregated_as_its_own_protocol():
    def run(pid: str, ours: float, k4: float, kb: float) -> dict:
        return {"id": pid, "ours": {"speedup": ours, "lo": 1.0, "hi": 1.0, "ref": {"median_ms": 0.01},
                                    "cand": {"escape": False}},
                "ours_k4": {"speedup": k4}, "kb": {"speedup": kb}}

    agg = ts.aggregate([run("a", 2.0, 2.0, 1.0), run("a", 2.1, 2.02, 1.5), run("b", 1.0, 1.0, 1.0),
                        run("b", 1.0, 1.01, 1.0), {"id": "b", "error": "timeout"}])
    assert list(agg["summary"]) == ["ours", "ours_k4", "kb"]
    assert agg["summary"]["ours"]["worst_spread"] == pytest.approx(1.05)
    assert agg["summary"]["ours_k4"]["worst_spread"] == pytest.approx(1.01)
    assert agg["summary"]["kb"]["worst_spread"] == pytest.approx(1.5)
    assert {r["id"]: r["reps"] for r in agg["rows"]} == {"a": 2, "b": 2}
