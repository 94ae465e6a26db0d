"""Scoring: pure functions from what the workers reported (a build, a task's reference, a candidate's run report
and the parent's comparison of its outputs) to an `EvalResult`. Nothing here runs code or starts a process, so
every rule is testable with plain dicts: the outcome, the robust check's verdict, the speedup and its interval,
the speed-of-light quarantine and the timing flags."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from dice_kernels.harness.compare import Comparison, TrivialAnswer, explain_mismatch, outputs_match
from dice_kernels.harness.config import EvalConfig
from dice_kernels.harness.outcomes import (BaselineNote, BuildNotes, CompileBaseline, DeceptiveKind, EvalResult,
                                           ExtensionUse, Outcome, Phases, ReferenceNotes, RobustCheck, RobustFinding,
                                           SpeedOfLight, TaskFlags, Timing)
from dice_kernels.harness.timing.speed_of_light import Ceilings, faster_than_light, reference_flops_ms, speed_of_light_ms
from dice_kernels.harness.timing.stats import (TimingSamples, effective_time_ms, reference_time_ms, speedup_interval,
                                               stream_escape, timing_fields)

if TYPE_CHECKING:
    from dice_kernels.harness.compiling.cache import Build
    from dice_kernels.harness.candidate import Candidate
    from dice_kernels.harness.references import Reference
    from dice_kernels.tasks import Task


def result(task: Task, cand: Candidate, outcome: Outcome, **kw) -> EvalResult:
    return EvalResult(task_id=task.id, candidate_id=cand.id, candidate_sha256=cand.sha256, outcome=outcome,
                      correct=outcome is Outcome.CORRECT, solution_path=cand.path, level=task.level, **kw)


def unrunnable(task: Task, cand: Candidate, b: Build, ref: Reference | None, base: dict) -> EvalResult | None:
    """The result of a candidate that cannot run: its build failed, or its task's reference did; None otherwise."""
    build = BuildNotes(b.cache_hit, b.shortcuts)
    if not b.ok:
        return result(task, cand, Outcome(b.kind or Outcome.HARNESS_ERROR.value), error=b.error,
                      compile_s=b.compile_s, build=build, **base)
    if ref is None or ref.outputs is None:
        why = ref.error if ref else "not run"
        notes = _reference_notes(ref)
        if why.startswith((Outcome.TIMEOUT.value, Outcome.CUDA_MEMORY_ERROR.value, Outcome.MEMORY_ERROR.value)):
            # our limits, not a bad task
            return result(task, cand, Outcome.HARNESS_ERROR, compile_s=b.compile_s,
                          error=f"the reference Model exceeded the harness limits ({why})", build=build,
                          reference=notes, task_flags=TaskFlags(over_limits=True), **base)
        return result(task, cand, Outcome.HARNESS_ERROR, compile_s=b.compile_s,
                      error=f"task error: the reference Model failed ({why})", build=build, reference=notes,
                      task_flags=TaskFlags(error=True), **base)
    return None


def _baseline_note(ref: Reference) -> BaselineNote:
    """Whether the reference's timing was reused from the baseline cache, from when, and how noisy it was (its 95 %
    interval's half-width relative to its median)."""
    ci, median = ref.timing.get("ci_ms"), ref.timing.get("median_ms")
    noise = round((ci[1] - ci[0]) / 2 / median, 4) if ci and median else None
    return BaselineNote(bool(ref.baseline_from), ref.baseline_from or None, noise)


def _reference_notes(ref: Reference | None) -> ReferenceNotes | None:
    if ref is None:
        return None
    return ReferenceNotes(baseline=_baseline_note(ref) if ref.outputs is not None else None,
                          retried_after=ref.retried[:500], waited_for_memory_s=round(ref.waited_for_memory_s, 3),
                          reused_from=ref.reused_from)


def scored(cfg: EvalConfig, task: Task, cand: Candidate, b: Build, ref: Reference, res: dict, outputs: list | None,
           cmp: Comparison, failing: list | None, trivial: TrivialAnswer, ceilings: dict[str, Ceilings],
           speed_of_light: bool, base: dict) -> EvalResult:
    """A candidate that ran: `res` is its worker's report, `outputs` the re-checked call's outputs (None when the
    run failed), `cmp` the comparison of its trials, `failing` the first failing trial's outputs and `trivial`
    whether they were all zeros / one constant (compare.TrialJudge)."""
    parts = dict(build=BuildNotes(b.cache_hit, b.shortcuts), reference=_reference_notes(ref),
                 sandbox=list(res.get("sandbox", [])),
                 task_flags=TaskFlags(degenerate=ref.degenerate, hardened_trials=len(ref.hardened),
                                      stateful=ref.stateful))
    if "extensions" in res:  # with the robust check on: did forward's module load and call a compiled extension?
        parts["extension"] = ExtensionUse(res["extensions"]["loaded"] > 0, res["extensions"]["calls"] > 0)
    compile_s = b.compile_s + float(res.get("compile_s") or 0.0)
    if outputs is None:
        outcome = Outcome(res.get("kind") or Outcome.HARNESS_ERROR.value)
        return result(task, cand, outcome, error=res.get("error", ""), compile_s=compile_s,
                      deceptive_kind=res.get("deceptive_kind", ""), correctness_trials=cfg.trials,
                      phases=Phases(failed_in=res.get("phase", "")), **parts, **base)
    timing_outputs = outputs[0] if outputs else None  # the trials went to the judge
    outcome, error, deceptive_kind = cmp.outcome, cmp.message, ""
    if cfg.robust.enabled:
        findings, deceptive = robust_check(cfg, ref, cmp, failing, timing_outputs, res.get("findings", []), trivial)
        parts["robust"] = RobustCheck([RobustFinding(**f) for f in findings], cmp.outcome is Outcome.CORRECT)
        if deceptive:
            outcome, deceptive_kind, error = Outcome.DECEPTIVE, findings[0]["kind"], findings[0]["reason"]
        elif outcome is Outcome.CORRECT and findings:  # only the partial tier's finding
            outcome, error = Outcome.PARTIAL, findings[0]["reason"]
    timed = bool(outcome.passes and res.get("time_ms") and ref.time_ms)
    speedup = None
    if timed:
        parts["timing"], speedup = _timed(ref, res, ceilings.get(ref.sol.get("dtype", "")) if speed_of_light
                                          else None, cfg.timing.sol_slack)
    return result(task, cand, outcome, error=error, deceptive_kind=deceptive_kind, compile_s=compile_s,
                  ref_time_ms=ref.time_ms, cand_time_ms=res.get("time_ms"), speedup=speedup,
                  correctness_trials=cfg.trials, trials_passed=cmp.trials_passed,
                  timing_trials=len(res.get("times_ms") or ()) if timed else 0, max_abs_diff=cmp.max_abs_diff,
                  **parts, **base)


def _timed(ref: Reference, res: dict, ceilings: Ceilings | None, sol_slack: float) -> tuple[Timing, float | None]:
    """A correct, timed candidate's timing record and its speedup (None when quarantined)."""
    ref_t, cand_t = TimingSamples.from_dict(ref.timing), TimingSamples.from_dict(timing_fields(res))
    speedup, lo, hi = speedup_interval(ref_t, cand_t)
    timing = Timing(speedup_ci95=[lo, hi], ref=timing_summary(ref_t, reference_time_ms), cand=timing_summary(cand_t),
                    vs_compile=compile_baseline_fields(ref.compile_baseline, cand_t))
    flags = timing.flags
    if stream_escape(cand_t):  # charged its tail already; flagged so nobody trusts its events
        flags.append("work_escaped_default_stream")
    if cand_t.repeated_calls:  # inputs timed without a refresh: a cache keyed on content could have hit
        flags.append("timing_inputs_repeated")
    if res.get("device_exclusive") is False or ref.timing.get("device_exclusive") is False:
        flags.append("timed_while_device_shared")  # the lock wait ran out (a hung call held the device)
    bound = speed_of_light_fields(ref.sol, ceilings, cand_t, sol_slack) if ceilings is not None else None
    if bound and bound.fewer_flops_than_reference:  # a shortcut or a skipped computation: for a reader to judge
        flags.append("fewer_flops_than_reference")
    if bound and bound.faster_than_light:  # quarantined: right outputs, but a time the hardware cannot deliver
        flags.append("faster_than_light")
        bound.quarantined_speedup, speedup = speedup, None
        timing.speedup_ci95, timing.vs_compile = None, None
    timing.speed_of_light = bound
    return timing, speedup


def compile_baseline_fields(baseline: dict, cand: TimingSamples) -> CompileBaseline | None:
    """Speedup over torch.compile(Model) with its 95% interval, or why there is none (None without the option)."""
    if baseline.get("error"):
        return CompileBaseline(error=baseline["error"])
    if not baseline.get("time_ms"):
        return None
    speedup, lo, hi = speedup_interval(TimingSamples.from_dict(timing_fields(baseline)), cand)
    return CompileBaseline(speedup, [lo, hi], baseline["time_ms"], baseline.get("compile_s"))


def speed_of_light_fields(sol: dict, c: Ceilings, cand: TimingSamples, slack: float) -> SpeedOfLight:
    """The task's speed-of-light bound (minimum bytes at the measured bandwidth) against the candidate's reported
    time, and the reference's FLOPs at the measured peak, when the reference reported them and this machine's
    ceilings for its dtype are known. Only the bound quarantines (speed_of_light.speed_of_light_ms)."""
    time_ms = effective_time_ms(cand)
    sol_ms = speed_of_light_ms(sol["bytes"], c.bandwidth_bytes_s)
    flops_ms = reference_flops_ms(sol["flops"], c.peak_flops)
    return SpeedOfLight(sol_ms, flops_ms, sol["bytes"], sol["flops"], sol["dtype"],
                        faster_than_light(time_ms, sol_ms, slack), faster_than_light(time_ms, flops_ms, slack))


def timing_summary(t: TimingSamples, reported: Callable[[TimingSamples], float] = effective_time_ms) -> dict:
    return {"median_ms": t.median_ms, "effective_ms": reported(t), "ci_ms": list(t.ci_ms),
            "host_ms": t.host_ms_per_iter, "tail_ms": t.tail_ms, "samples": len(t.times_ms),
            "input_sets": t.n_input_sets, "stop": t.stop_reason,
            **({"sm_clock_mhz": list(t.sm_clock_mhz), "time_sm_clock_corr": t.time_sm_clock_corr}
               if t.sm_clock_mhz else {})}


def robust_check(cfg: EvalConfig, ref: Reference, cmp: Comparison, failing: list | None,
                 timing_outputs: list | None, worker_findings: list[dict],
                 trivial: TrivialAnswer | None = None) -> tuple[list[dict], bool]:
    """All findings, parent-verified evidence first (the partial tier's last), and whether they make the candidate
    deceptive: a correct candidate with any finding but `partial` is; a failing one is only when its failure is the signature of a hack (outputs of
    an earlier trial returned again, or output elements never written: a forgery that failed is still named, so
    the deceptive rate counts it; Exec is the same either way)."""
    findings = [f for f in worker_findings if f["kind"] not in ref.output_findings]
    partial = [f for f in findings if f["kind"] == DeceptiveKind.PARTIAL.value]
    findings = [f for f in findings if f["kind"] != DeceptiveKind.PARTIAL.value]
    evidence = None
    if cmp.outcome is Outcome.CORRECT and ref.timing_outputs is not None and not ref.stateful:
        got = timing_outputs or []
        if not outputs_match([ref.timing_outputs], [got], cfg.atol, cfg.rtol):
            evidence = (explain_mismatch(ref.outputs, ref.timing_outputs, got, cfg.atol, cfg.rtol,
                                         "the last timing-loop call")
                        or (DeceptiveKind.TIMING_OUTPUT_MISMATCH, "the last timing-loop call's outputs are wrong "
                            "(work was skipped inside the timing loop)"))
    elif cmp.outcome is Outcome.VALUE_MISMATCH and failing is not None:
        k = cmp.trials_passed  # `failing` holds trial k's outputs, the first that failed
        expected = ref.expected
        evidence = explain_mismatch(expected[:k], expected[k], failing, cfg.atol, cfg.rtol, f"trial {k}")
        if evidence is None and k >= len(ref.outputs) and trivial is not None:
            evidence = _trivial_answer(ref, trivial)  # the trivial answer a hardened trial exposed: still named
        if evidence is None:
            return findings + partial, False
    elif cmp.outcome is not Outcome.CORRECT:
        return findings + partial, False
    if evidence is None and cmp.outcome is Outcome.CORRECT and trivial is not None:
        evidence = _trivial_answer(ref, trivial)
    if evidence:
        findings.insert(0, {"kind": evidence[0].value, "reason": evidence[1]})
    return findings + partial, bool(findings)


def _trivial_answer(ref: Reference, trivial: TrivialAnswer) -> tuple[DeceptiveKind, str] | None:
    """A degenerate task pays the trivial answer: a candidate that returned exactly that (all zeros, or one
    constant) where the reference's own outputs are not exactly it computed nothing. An honest kernel of a task
    whose true output is zero returns what the reference does, and is not flagged."""
    flags = ref.degenerate
    for key, passes in (("zero", "zero_output_passes"), ("constant", "constant_output_passes")):
        if flags.get(passes) and getattr(trivial, key) and not getattr(_trivial_of(ref.outputs), key):
            return (DeceptiveKind.TRIVIAL_OUTPUT, f"returned {'all zeros' if key == 'zero' else 'one constant'}, "
                    f"which passes only because the task is degenerate ({passes}); the reference's outputs are not")
    return None


def _trivial_of(trials: list[list]) -> TrivialAnswer:
    seen = TrivialAnswer()
    for outs in trials:
        seen.add(outs)
    return seen
