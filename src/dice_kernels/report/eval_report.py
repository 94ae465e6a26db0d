"""Writes an evaluation run's `summary.json`, `report.md` and `outcomes.png`, and prints its console table."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from dice_kernels.harness.metrics import FAST_P, by_level, deceptive_extensions
from dice_kernels.harness.outcomes import DeceptiveKind, EvalResult, Outcome

_ATEN_OP = re.compile(r"aten::[\w.]+")  # as integrity.Monitor names ops in a pytorch_fallback finding's message
# what a solution file says it should get (the shipped examples do): "Expected outcome: compile_error"
_EXPECTED = re.compile(r"Expected outcome: ([a-z_]+(?:/[a-z_]+)?)")


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def summary(results: list[EvalResult], meta: dict) -> dict:
    levels = by_level(results)
    harness_errors = [r for r in results if r.outcome is Outcome.HARNESS_ERROR]
    task_errors = sorted({r.task_id for r in harness_errors if r.task_flags.error})
    over_limits = sorted({r.task_id for r in harness_errors if r.task_flags.over_limits})
    speedups = sorted(r.speedup for r in results if r.outcome.passes and r.speedup is not None)
    return {
        **meta,
        "metrics": {k: m.to_dict() for k, m in levels.items()},
        "tasks_with_failing_reference": task_errors,
        "tasks_whose_reference_exceeds_limits": over_limits,
        "needs_gpu": sum(1 for r in results if r.outcome is Outcome.NEEDS_GPU),
        "internal_harness_errors": sum(1 for r in harness_errors
                                       if not (r.task_flags.error or r.task_flags.over_limits)),
        "speedup_quantiles": _quantiles(speedups),
        "timing_flags": timing_flags(results),
        "fallback_ops": fallback_ops(results),
        "seconds_by_phase": seconds_by_phase(results),
        "reference_baselines": reference_baselines(results),
        "reused_references": reused_references(results),
        "deceptive_extensions": deceptive_extensions(results),
    }


def reference_baselines(results: list[EvalResult]) -> dict:
    """How the speedups' reference timings came about: measured in this run, or reused from the baseline cache
    (from when, and how noisy those were)."""
    notes = [r.reference.baseline for r in results if r.speedup is not None and r.reference and r.reference.baseline]
    reused = [b for b in notes if b.cached]
    noise = sorted(b.rel_ci for b in notes if b.rel_ci is not None)
    return {"timed": len(notes), "reused": len(reused),
            "reused_measured": [min(b.measured_at for b in reused), max(b.measured_at for b in reused)]
            if reused else [], "rel_ci_median": noise[len(noise) // 2] if noise else None,
            "rel_ci_max": noise[-1] if noise else None}


def reused_references(results: list[EvalResult]) -> dict:
    """The tasks whose candidates were compared with reference outputs an earlier batch of the process kept
    (`reuse_verdicts`) instead of running the reference, of the tasks a candidate ran against in this run (not a
    reused verdict or a duplicate, whose notes are their first evaluation's), and when those were computed."""
    ran = {r.task_id: r.reference.reused_from for r in results
           if r.reference and r.reference.baseline and not r.duplicate_of}
    reused = sorted(when for when in ran.values() if when)
    return {"tasks": len(ran), "reused": len(reused), "computed": [reused[0], reused[-1]] if reused else []}


def fallback_ops(results: list[EvalResult]) -> dict[str, int]:
    """For each ATen op behind a `pytorch_fallback` finding, how many candidates it made deceptive, most first:
    whether a run's fallbacks are cuDNN convolutions kept beside a fused epilogue or reductions left to PyTorch
    decides what `--robust-allow-ops` would change."""
    counts: Counter[str] = Counter()
    for r in results:
        if r.outcome is Outcome.DECEPTIVE and r.deceptive_kind == DeceptiveKind.PYTORCH_FALLBACK.value:
            counts.update(_fallback_ops_of(r))
    return dict(counts.most_common())


def _fallback_ops_of(r: EvalResult) -> set[str]:
    """The ops of a result's `pytorch_fallback` finding: all of them as recorded, or, for results recorded before
    findings carried their ops, the five its message names."""
    for f in r.robust.findings if r.robust else ():
        if f.kind == DeceptiveKind.PYTORCH_FALLBACK.value and f.ops:
            return set(f.ops)
    return set(_ATEN_OP.findall(r.error))


def timing_flags(results: list[EvalResult]) -> dict[str, int]:
    """How many timed candidates carry each timing flag (`faster_than_light` ones were given no speedup)."""
    counts: dict[str, int] = {}
    for r in results:
        for flag in r.timing_flags:
            counts[flag] = counts.get(flag, 0) + 1
    return dict(sorted(counts.items()))


def seconds_by_phase(results: list[EvalResult]) -> dict[str, float]:
    """Where the evaluation's time went: `phases.seconds` summed over results (duplicates carry none), largest
    first. Work in parallel workers adds up, so the sum exceeds the wall time."""
    totals: dict[str, float] = {}
    for r in results:
        for phase, seconds in r.phases.seconds.items():
            totals[phase] = totals.get(phase, 0.0) + float(seconds)
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def candidate_work(results: list[EvalResult]) -> dict:
    """Where an evaluation's work went (`seconds_by_phase`), over how many candidates, and how many of them were built
    rather than found in the build cache (or never built: duplicates, no code)."""
    return {"n": len(results), "phases": seconds_by_phase(results),
            "built": sum(r.build is not None and not r.build.cache_hit for r in results)}


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"min": xs[0], "p25": pick(0.25), "median": pick(0.5), "p75": pick(0.75), "max": xs[-1]}


def expected_outcome(solution_path: str) -> str:
    """The outcome a solution file says it should get ("Expected outcome: X" in it), or ""."""
    try:
        found = _EXPECTED.search(Path(solution_path).read_text(errors="replace")) if solution_path else None
    except OSError:
        return ""
    return found.group(1) if found else ""


def candidate_rows(results: list[EvalResult]) -> list[dict]:
    """One row per candidate: task, file, outcome, sub-kind, speedup, and the outcome its file expects (if it
    says)."""
    rows = []
    for r in results:
        path = Path(r.solution_path) if r.solution_path else None
        rows.append({"task": r.task_id, "file": "/".join(path.parts[-2:]) if path else r.candidate_id,
                     "outcome": r.outcome.value, "sub_kind": r.deceptive_kind or "",
                     "speedup": f"{r.speedup:.2f}×" if r.speedup is not None else "–",
                     "expected": expected_outcome(r.solution_path)})
    return rows


def _got_expected(row: dict) -> bool:
    got = row["outcome"] + (f"/{row['sub_kind']}" if row["sub_kind"] else "")
    return got == row["expected"] or row["outcome"] == row["expected"]


def expectation_note(results: list[EvalResult]) -> str:
    """Whether the candidates whose files say what they should get got it ("" when none says)."""
    said = [r for r in candidate_rows(results) if r["expected"]]
    missed = [r["file"] for r in said if not _got_expected(r)]
    if not said:
        return ""
    if not missed:
        return f"all {len(said)} candidates got the outcome their file expects"
    return f"{len(missed)} of {len(said)} candidates did not get the outcome their file expects: {', '.join(missed)}"


def candidate_table(results: list[EvalResult]):
    from rich.table import Table

    rows = candidate_rows(results)
    # a column only when some row fills it, so the table fits 80 columns (a long file name wraps, never cut)
    columns = ["task", "file", "outcome", *(["sub_kind"] if any(r["sub_kind"] for r in rows) else []), "speedup",
               *(["expected"] if any(r["expected"] for r in rows) else [])]
    table = Table(title="candidates")
    for col in columns:
        table.add_column(col.replace("_", "-"), justify="right" if col == "speedup" else "left",
                         overflow="fold", no_wrap=col != "file")
    for r in rows:
        mark = "" if not r["expected"] else " [green]✓[/]" if _got_expected(r) else " [red]✗[/]"
        table.add_row(*(r[col] + (mark if col == "expected" else "") for col in columns))
    return table


def markdown(s: dict, rows: list[dict] | None = None, chart: bool = False) -> str:
    lines = ["# Evaluation report", ""]
    for key in ("backend", "hardware", "torch_version", "harness_version", "wall_s", "command"):
        if key in s:
            lines.append(f"- **{key}**: {s[key]}")
    lines += ["", "## Exec and fast_p (vs PyTorch eager)", "",
              "| level | n | Exec before robust check | Exec | Exec strict | " + " | ".join(f"fast_{p:g}" for p in FAST_P)
              + " | median speedup | degenerate tasks |",
              "|---|---|---|---|---|" + "---|" * len(FAST_P) + "---|---|"]
    for level, m in s["metrics"].items():
        med = f"{m['median_speedup']:.2f}×" if m["median_speedup"] else "–"
        lines.append(f"| {level} | {m['n']} | {_pct(m['exec_before_robust'])} | {_pct(m['exec_rate'])} | "
                     f"{_pct(m.get('exec_strict'))} | " + " | ".join(_pct(m["fast"][f"fast_{p:g}"]) for p in FAST_P)
                     + f" | {med} | {m['degenerate_tasks']} |")
    lines += ["", "Exec is KernelBench's rule: correct, or `partial` (the candidate's kernels replaced some of the "
              "reference's PyTorch ops and kept the others); Exec strict counts `correct` only (no PyTorch compute "
              "op left). Both are after the robust check.", "", "fast_p counts a candidate only when its speedup's 95% interval lies above p. Speedups are "
              "medians of bootstrap ratios of the two timing samples (docs/timing.md); each result's interval is in "
              "`results.jsonl` (`details.timing.speedup_ci95`). fast_p of the point estimates, as papers report it: "
              + ", ".join(f"{level} " + " / ".join(_pct(m["fast_point"][f"fast_{p:g}"]) for p in FAST_P)
                          for level, m in s["metrics"].items() if m.get("fast_point"))]
    base = s.get("reference_baselines") or {}
    if base.get("timed"):
        noise = (f"; reference intervals ±{100 * base['rel_ci_median']:.1f}% of the median (worst "
                 f"±{100 * base['rel_ci_max']:.1f}%)" if base.get("rel_ci_median") is not None else "")
        reused = (f"{base['reused']} of {base['timed']} timed results used a reference baseline reused from the "
                  f"cache (measured {base['reused_measured'][0]} to {base['reused_measured'][1]}; `--timing-baselines "
                  "fresh` measures again)" if base["reused"] else f"all {base['timed']} reference timings measured "
                  "in this run")
        lines += ["", f"Reference baselines: {reused}{noise}."]
    kept = s.get("reused_references") or {}
    if kept.get("reused"):
        lines += ["", f"Reference outputs: {kept['reused']} of {kept['tasks']} tasks' candidates were compared with "
                  f"reference outputs an earlier batch of this process kept (computed {kept['computed'][0]} to "
                  f"{kept['computed'][1]}; `--reuse-verdicts`), their references not run again."]
    if s.get("backend") == "cpu":
        lines += ["", "CPU backend: speedups are indicative only. They are C++ against PyTorch on one intra-op "
                  "thread, on a machine whose load the harness does not control, and say nothing about GPU kernels."]
    if any(m.get("fast_vs_compile") for m in s["metrics"].values()):
        lines += ["", "## fast_p vs torch.compile", "", "| level | n | " + " | ".join(f"fast_{p:g}" for p in FAST_P)
                  + " |", "|---|---|" + "---|" * len(FAST_P)]
        for level, m in s["metrics"].items():
            if m.get("fast_vs_compile"):
                lines.append(f"| {level} | {m['n']} | "
                             + " | ".join(_pct(m["fast_vs_compile"][f"fast_{p:g}"]) for p in FAST_P) + " |")
    lines += ["", "## Outcomes", "", "| outcome | count |", "|---|---|"]
    for outcome, count in s["metrics"]["all"]["outcomes"].items():
        if count:
            lines.append(f"| {outcome} | {count} |")
    if s.get("needs_gpu"):
        lines += ["", f"{s['needs_gpu']} candidate(s) with CUDA code were set aside on the CPU backend (`needs_gpu`): "
                  "not built and not counted in n, Exec or fast_p; evaluate them on a GPU"]
    if s["tasks_whose_reference_exceeds_limits"]:
        lines += ["", "Tasks whose reference `Model` exceeds the harness's time or memory limits (their candidates "
                  "are counted as harness_error; raise --sandbox-memory-limit-gb / --sandbox-run-timeout-s): "
                  + ", ".join(s["tasks_whose_reference_exceeds_limits"])]
    kinds = s["metrics"]["all"]["deceptive_kinds"]
    if kinds:
        lines += ["", "## Robust check: deceptive candidates by sub-kind", "", "| sub-kind | count |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in kinds.items()]
    if s.get("deceptive_extensions"):
        d = s["deceptive_extensions"]
        lines += ["", "Deceptive candidates by their extension: "
                  + ", ".join(f"{k.replace('_', ' ')} {d[k]}" for k in
                              ("none_loaded", "loaded_not_called", "called", "unknown") if d.get(k))
                  + " (none loaded: the extension never built or was never loaded, e.g. a try/except fallback)"]
    if s.get("fallback_ops"):
        lines += ["", "PyTorch ops behind `pytorch_fallback` (candidates whose forward dispatched each; `--robust-allow-ops` "
                  "admits one): " + ", ".join(f"{op} {n}" for op, n in list(s["fallback_ops"].items())[:12])]
    if s["tasks_with_failing_reference"]:
        lines += ["", "Tasks whose reference `Model` itself fails (their candidates are counted as harness_error "
                  "with `task_error`): " + ", ".join(s["tasks_with_failing_reference"])]
    if s["speedup_quantiles"]:
        q = s["speedup_quantiles"]
        lines += ["", "Speedup of correct candidates: " + ", ".join(f"{k} {v:.2f}×" for k, v in q.items())]
    if s.get("timing_flags"):
        lines += ["", "Timing flags (docs/timing.md; `faster_than_light` candidates count for Exec, never for fast_p): "
                  + ", ".join(f"{k} {v}" for k, v in s["timing_flags"].items())]
    if s.get("seconds_by_phase"):
        lines += ["", "## Where the time went", "",
                  "Seconds summed over evaluated candidates (parallel workers add up; `run.*` is inside `run`; "
                  "docs/harness.md):", "", "| phase | seconds |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in s["seconds_by_phase"].items()]
    if rows:
        expected = any(r["expected"] for r in rows)
        lines += ["", "## Candidates", "", "| task | file | outcome | sub-kind | speedup |"
                  + (" expected |" if expected else ""), "|---|---|---|---|---|" + ("---|" if expected else "")]
        lines += [f"| {r['task']} | {r['file']} | {r['outcome']} | {r['sub_kind']} | {r['speedup']} |"
                  + (f" {r['expected']} |" if expected else "") for r in rows]
    if chart:
        lines += ["", "![outcomes](outcomes.png)"]
    lines.append("")
    return "\n".join(lines)


def outcome_chart(metrics_all: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    items = [(k, v) for k, v in metrics_all["outcomes"].items() if v]
    fig, ax = plt.subplots(figsize=(7, 0.45 * max(3, len(items)) + 1))
    names = [k for k, _ in items][::-1]
    counts = [v for _, v in items][::-1]
    colors = ["#2e7d32" if n == "correct" else "#81c784" if n == "partial" else "#c62828" if n in ("deceptive", "harness_error") else "#757575"
              for n in names]
    ax.barh(names, counts, color=colors)
    for y, c in enumerate(counts):
        ax.text(c, y, f" {c}", va="center")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # counts: whole candidates
    ax.set_xlabel("candidates")
    ax.set_title(f"Outcomes ({metrics_all['n']} candidates)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out_dir: str | Path, results: list[EvalResult], meta: dict) -> dict:
    out = Path(out_dir)
    s = summary(results, meta)
    (out / "summary.json").write_text(json.dumps(s, indent=2))
    chart = out / "outcomes.png"
    chart.unlink(missing_ok=True)  # a chart of an earlier state of the run must not stand for this one
    if results:
        try:
            outcome_chart(s["metrics"]["all"], chart)
        except ImportError:  # matplotlib missing (a minimal install): the markdown still lists the counts
            pass
    (out / "report.md").write_text(markdown(s, candidate_rows(results), chart=chart.exists()))
    return s


def console_table(s: dict):
    from rich.table import Table

    table = Table(title="dice eval")
    for col in ("level", "n", "Exec (pre-robust)", "Exec", "Exec strict", *(f"fast_{p:g}" for p in FAST_P),
                "median speedup"):
        table.add_column(col, justify="right")
    for level, m in s["metrics"].items():
        med = f"{m['median_speedup']:.2f}×" if m["median_speedup"] else "–"
        table.add_row(level, str(m["n"]), _pct(m["exec_before_robust"]), _pct(m["exec_rate"]),
                      _pct(m.get("exec_strict")), *(_pct(m["fast"][f"fast_{p:g}"]) for p in FAST_P), med)
    return table


def outcome_table(s: dict):
    from rich.table import Table

    table = Table(title="outcomes")
    table.add_column("outcome")
    table.add_column("count", justify="right")
    for outcome, count in s["metrics"]["all"]["outcomes"].items():
        if count:
            table.add_row(outcome, str(count))
    for kind, count in s["metrics"]["all"]["deceptive_kinds"].items():
        table.add_row(f"  deceptive/{kind}", str(count))
    return table


