"""The evaluation report's time accounting (per-phase seconds summed over results, largest first), timing flags
and fast_p against torch.compile."""

from __future__ import annotations

from dice_kernels.harness.outcomes import (BaselineNote, EvalResult, ExtensionUse, Outcome, Phases, ReferenceNotes,
                                           RobustCheck, RobustFinding, Timing)
from dice_kernels.report.eval_report import markdown, seconds_by_phase, summary


def _result(cid: str, phase_s: dict | None) -> EvalResult:
    return EvalResult(task_id="L1/19", candidate_id=cid, candidate_sha256=cid, outcome=Outcome.CORRECT, correct=True,
                      level=1, speedup=1.5, phases=Phases(seconds=phase_s or {}))


def test_seconds_by_phase_sums_and_orders_and_skips_rows_without_phases():
    results = [_result("a", {"build": 10.0, "run": 2.0, "run.trials": 1.5}),
               _result("b", {"build": 5.0, "run": 4.0}),
               _result("dup", {}), _result("old", None)]
    assert seconds_by_phase(results) == {"build": 15.0, "run": 6.0, "run.trials": 1.5}
    assert list(seconds_by_phase(results)) == ["build", "run", "run.trials"]


def test_timing_flags_are_counted_and_reported():
    flagged = [EvalResult(task_id="L1/19", candidate_id=c, candidate_sha256=c, outcome=Outcome.CORRECT, correct=True,
                          level=1, speedup=None, timing=Timing(flags=flags))
               for c, flags in (("a", ["faster_than_light"]), ("b", ["faster_than_light", "timed_while_device_shared"]))]
    s = summary(flagged + [_result("c", None)], {})
    assert s["timing_flags"] == {"faster_than_light": 2, "timed_while_device_shared": 1}
    assert "faster_than_light 2, timed_while_device_shared 1" in markdown(s)
    assert "Timing flags" not in markdown(summary([_result("c", None)], {}))


def test_report_has_a_time_section_only_when_there_are_phases():
    with_phases = markdown(summary([_result("a", {"build": 3.0})], {}))
    assert "## Where the time went" in with_phases and "| build | 3.0 |" in with_phases
    assert "## Where the time went" not in markdown(summary([_result("old", None)], {}))


def test_compile_baseline_gives_speedups_and_fast_p_against_torch_compile(tmp_path, build_cache, example_pairs):
    """The reference worker times torch.compile(Model) too (real inductor compile, in the sandbox) when asked."""
    from dice_kernels.harness import EvalConfig, TimingConfig, evaluate
    from dice_kernels.harness.metrics import compute

    pairs = [p for p in example_pairs("cpu") if p[1].id == "19_ReLU/correct"]
    config = EvalConfig(backend="cpu", trials=1, cache_dir=build_cache,
                        timing=TimingConfig(iters=5, max_s=0.3, compile_baseline=True))
    (r,) = evaluate(pairs, config, progress=False)
    assert r.outcome is Outcome.CORRECT, r.error
    vs = r.timing.vs_compile
    assert vs.error == ""
    assert vs.speedup > 0 and vs.ref_ms > 0
    lo, hi = vs.ci95
    assert lo <= vs.speedup <= hi
    assert set(compute([r]).fast_vs_compile) == {"fast_0", "fast_1", "fast_1.5", "fast_2"}
    assert "## fast_p vs torch.compile" in markdown(summary([r], {}))


def test_no_fast_p_vs_compile_without_the_baseline():
    from dice_kernels.harness.metrics import compute

    assert compute([_result("a", {"build": 1.0})]).fast_vs_compile == {}


def test_fallback_ops_count_candidates_per_op_named_in_their_finding():
    def flagged(cid: str, kind: str, error: str, ops: dict | None = None) -> EvalResult:
        findings = [RobustFinding(kind, error, ops or {})]
        return EvalResult(task_id="L2/9", candidate_id=cid, candidate_sha256=cid, outcome=Outcome.DECEPTIVE,
                          level=2, deceptive_kind=kind, error=error, robust=RobustCheck(findings))

    ops = "forward dispatched PyTorch compute ops: "
    six = {f"aten::op{i}": 6 - i for i in range(6)}  # the message names five; the finding keeps all six
    results = [flagged("a", "pytorch_fallback", ops + "aten::addmm x5, aten::relu x5"),  # recorded before ops were
               flagged("b", "pytorch_fallback", ops + "aten::addmm x10", {"aten::addmm": 10}),
               flagged("c", "pytorch_fallback", ops + ", ".join(f"{k} x{v}" for k, v in list(six.items())[:5]), six),
               flagged("d", "input_mutated", "forward wrote into its input aten::add_"),  # not a fallback: not counted
               _result("e", None)]
    s = summary(results, {})
    assert s["fallback_ops"] == {"aten::addmm": 2, "aten::relu": 1, **{k: 1 for k in six}}
    assert "aten::addmm 2, aten::relu 1" in markdown(s)
    assert "PyTorch ops behind" not in markdown(summary([_result("d", None)], {}))


def test_fast_p_counts_a_speedup_only_when_its_interval_clears_p():
    """A 1.6x point estimate whose interval reaches below 1 is noise for fast_1 (KernelBench issue #166); the
    point-estimate fast_p is reported beside it; the report says when a reference baseline was reused."""
    from dice_kernels.harness.metrics import compute

    def timed(cid: str, speedup: float, ci: list, baseline: BaselineNote) -> EvalResult:
        return EvalResult(task_id="L1/19", candidate_id=cid, candidate_sha256=cid, outcome=Outcome.CORRECT,
                          correct=True, level=1, speedup=speedup, timing=Timing(speedup_ci95=ci),
                          reference=ReferenceNotes(baseline=baseline))

    fresh = BaselineNote(cached=False, measured_at=None, rel_ci=0.02)
    reused = BaselineNote(cached=True, measured_at="2026-12-01T10:00:00+00:00", rel_ci=0.08)
    untimed = EvalResult(task_id="L1/19", candidate_id="u", candidate_sha256="u", outcome=Outcome.CORRECT,
                         correct=True, level=1)
    results = [timed("noisy", 1.6, [0.9, 2.4], fresh), timed("clear", 1.6, [1.2, 2.0], reused), untimed]
    m = compute(results)
    assert m.fast["fast_1"] == 1 / 3 and m.fast_point["fast_1"] == 2 / 3
    assert m.fast["fast_1.5"] == 0 and m.fast_point["fast_1.5"] == 2 / 3
    assert m.fast["fast_0"] == 2 / 3  # the low ends lie above 0; an untimed result never counts
    s = summary(results, {"backend": "cpu"})
    assert s["reference_baselines"] == {"timed": 2, "reused": 1, "reused_measured": [reused.measured_at] * 2,
                                        "rel_ci_median": 0.08, "rel_ci_max": 0.08}
    report = markdown(s)
    assert "1 of 2 timed results used a reference baseline reused from the cache" in report
    assert "fast_p of the point estimates" in report and "speedups are indicative only" in report


def test_the_report_says_whether_deceptive_candidates_built_and_called_an_extension():
    def deceptive(cid: str, ext: ExtensionUse | None) -> EvalResult:
        return EvalResult(task_id="L1/19", candidate_id=cid, candidate_sha256=cid, outcome=Outcome.DECEPTIVE,
                          level=1, deceptive_kind="pytorch_fallback", extension=ext)

    results = [deceptive("never_built", ExtensionUse(loaded=False, called=False)),
               deceptive("unused", ExtensionUse(loaded=True, called=False)),
               deceptive("partial", ExtensionUse(loaded=True, called=True)), deceptive("old_record", None),
               _result("honest", None)]
    s = summary(results, {})
    assert s["deceptive_extensions"] == {"none_loaded": 1, "loaded_not_called": 1, "called": 1, "unknown": 1}
    assert "none loaded 1, loaded not called 1, called 1, unknown 1" in markdown(s)
