"""Exec and fast_p over a set of results, overall and per level, plus the outcome breakdown (pure functions)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from dice_kernels.harness.outcomes import EvalResult, Outcome

FAST_P = (0.0, 1.0, 1.5, 2.0)


@dataclass(frozen=True)
class Metrics:
    n: int
    # KernelBench's rule: fraction correct or partial (own kernels beside kept PyTorch ops), and not deceptive
    exec_rate: float
    # "fast_1" -> fraction correct, not deceptive, and faster than p beyond noise: the speedup's 95 % interval lies
    # above p (a point estimate above p is not enough: unchanged programs pass fast_1 half the time from noise alone)
    fast: dict[str, float]
    outcomes: dict[str, int]
    median_speedup: float | None  # over correct candidates that were timed
    exec_before_robust: float = 0.0  # fraction whose outputs passed the comparison, deceptive or not
    deceptive_kinds: dict[str, int] = field(default_factory=dict)  # robust check: count per sub-kind
    degenerate_tasks: int = 0  # distinct tasks where a trivial output passes (degenerate.degenerate_flags)
    # the same fractions against torch.compile(Model), when the run timed that baseline (timing.compile_baseline)
    fast_vs_compile: dict[str, float] = field(default_factory=dict)
    # fast_p as papers report it: the point estimate above p, whatever its interval (for comparison only)
    fast_point: dict[str, float] = field(default_factory=dict)
    exec_strict: float = 0.0  # fraction correct with no PyTorch compute op left (partial not counted)

    def to_dict(self) -> dict:
        return asdict(self)


def is_exec(r: EvalResult) -> bool:
    """Exec under KernelBench's rule: correct or partial, not deceptive."""
    return r.outcome.passes


def passed_comparison(r: EvalResult) -> bool:
    """Correct before the robust check: outputs matched the reference (the candidate may still be deceptive)."""
    return r.outcome.passes or bool(r.robust and r.robust.passed_comparison)


def compute(results: list[EvalResult], ps: tuple[float, ...] = FAST_P) -> Metrics:
    n = sum(1 for r in results if r.outcome is not Outcome.NEEDS_GPU)  # set aside, not failed: not in Exec
    good = [r for r in results if is_exec(r)]
    fast = _fast(good, n, ps, _speedup_low)
    counts = Counter(r.outcome.value for r in results)
    speedups = sorted(r.speedup for r in good if r.speedup is not None)
    median = speedups[len(speedups) // 2] if speedups else None
    kinds = Counter(r.deceptive_kind for r in results if r.outcome is Outcome.DECEPTIVE)
    degenerate = {r.task_id for r in results if r.task_flags.degenerate.get("degenerate")}
    vs_compile = {}
    if any(r.timing and r.timing.vs_compile and r.timing.vs_compile.speedup is not None for r in results):
        vs_compile = _fast(good, n, ps, _vs_compile_low)
    return Metrics(n=n, exec_rate=len(good) / n if n else 0.0, fast=fast,
                   outcomes={o.value: counts.get(o.value, 0) for o in Outcome}, median_speedup=median,
                   exec_before_robust=sum(map(passed_comparison, results)) / n if n else 0.0,
                   deceptive_kinds=dict(sorted(kinds.items())), degenerate_tasks=len(degenerate),
                   fast_vs_compile=vs_compile, fast_point=_fast(good, n, ps, lambda r: r.speedup),
                   exec_strict=sum(1 for r in good if r.outcome is Outcome.CORRECT) / n if n else 0.0)


def deceptive_extensions(results: list[EvalResult]) -> dict[str, int]:
    """Deceptive candidates by what their extension did: none loaded (it never built, or a fallback ran instead),
    loaded but never called, or called: a broken kernel reads differently from a cheat."""
    counts = Counter()
    for r in results:
        if r.outcome is Outcome.DECEPTIVE:
            ext = r.extension
            counts["unknown" if ext is None else "called" if ext.called else
                   "loaded_not_called" if ext.loaded else "none_loaded"] += 1
    return dict(counts)


def _speedup_low(r: EvalResult) -> float | None:
    """The low end of a result's 95 % speedup interval (None when it was not timed or has no interval)."""
    ci = r.timing.speedup_ci95 if r.timing else None
    return ci[0] if r.speedup is not None and ci else None


def _vs_compile_low(r: EvalResult) -> float | None:
    """The low end of a result's 95 % interval of the speedup over torch.compile (None without one)."""
    vs = r.timing.vs_compile if r.timing else None
    return vs.ci95[0] if vs and vs.ci95 else None


def _fast(good: list[EvalResult], n: int, ps: tuple[float, ...], speedup_of) -> dict[str, float]:
    """The fraction of all `n` results that pass (KernelBench's rule) and whose `speedup_of` is above p."""
    return {f"fast_{p:g}": (sum(1 for r in good if (s := speedup_of(r)) is not None and s > p) / n if n else 0.0)
            for p in ps}


def by_level(results: list[EvalResult]) -> dict[str, Metrics]:
    """Metrics per KernelBench level ("L1", ... or "other"), plus "all"."""
    groups: dict[str, list[EvalResult]] = {}
    for r in results:
        groups.setdefault(f"L{r.level}" if r.level is not None else "other", []).append(r)
    out = {k: compute(v) for k, v in sorted(groups.items())}
    out["all"] = compute(results)
    return out
