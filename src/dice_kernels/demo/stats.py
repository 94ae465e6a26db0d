"""Intervals and paired comparisons for the demo's arms: pure functions over per-task scores, no I/O.

Scores are grouped by task (`{task_id: [score of sample 1, ...]}`, each score 0/1 or a reward); a task's k samples
are not independent, so every bootstrap resamples tasks (clusters), never samples. Two arms are compared on the
tasks both scored, task by task (a paired bootstrap), and one is said to beat the other only when the 95 % interval
of the difference excludes 0. Over several independent runs (seeds), runs are resampled too (`runs_difference`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Scores = dict[str, list[float]]  # task id -> one score per sample


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95 % interval."""

    value: float
    lo: float
    hi: float

    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0


@dataclass(frozen=True)
class Comparison:
    """Arm `a` minus arm `b` over the `n` tasks both scored."""

    a: str
    b: str
    n: int
    diff: Interval

    @property
    def verdict(self) -> str:
        """Which way the difference goes, not which arm is better: a higher share of deceptive or slipped programs is
        worse, a higher Exec better."""
        if self.diff.lo > 0:
            return f"{self.a} higher than {self.b}"
        if self.diff.hi < 0:
            return f"{self.a} lower than {self.b}"
        return "no difference shown (the interval contains 0)"


def wilson(successes: int, n: int, z: float = 1.96) -> Interval:
    """The Wilson score interval of a proportion (one sample per task: tasks are independent trials)."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson needs 0 <= successes <= n and n > 0, got {successes} of {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


def _task_means(scores: Scores, tasks: list[str]) -> np.ndarray:
    for t in tasks:
        if not scores[t]:
            raise ValueError(f"task {t!r} has no scores")
    return np.array([float(np.mean(scores[t])) for t in tasks])


def _bootstrap(values: np.ndarray, n_boot: int, seed: int) -> Interval:
    """Percentile interval of the mean of `values` (one per task), resampling tasks with replacement."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(n_boot, len(values)))
    means = values[picks].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return Interval(float(values.mean()), float(lo), float(hi))


def rate_interval(scores: Scores, n_boot: int = 2000, seed: int = 0) -> Interval:
    """Mean score over tasks with its 95 % interval: Wilson when every task has one 0/1 score, else a bootstrap
    over tasks (a task's k samples move together)."""
    if not scores:
        raise ValueError("rate_interval needs at least one task")
    tasks = sorted(scores)
    flat = [s for t in tasks for s in scores[t]]
    if all(len(scores[t]) == 1 for t in tasks) and set(flat) <= {0.0, 1.0}:
        return wilson(int(sum(flat)), len(flat))
    return _bootstrap(_task_means(scores, tasks), n_boot, seed)


def _task_differences(a: Scores, b: Scores, names: tuple[str, str]) -> np.ndarray:
    """a's task mean minus b's, one per task both scored (sorted by task id)."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError(f"{names[0]} and {names[1]} share no task to compare on")
    return _task_means(a, shared) - _task_means(b, shared)


def paired_difference(a: Scores, b: Scores, names: tuple[str, str] = ("A", "B"), n_boot: int = 2000,
                      seed: int = 0) -> Comparison:
    """Mean of (a's task mean - b's task mean) over the tasks both scored, with a seeded paired bootstrap over
    those tasks."""
    diffs = _task_differences(a, b, names)
    return Comparison(names[0], names[1], len(diffs), _bootstrap(diffs, n_boot, seed))


def unpaired_difference(a: Scores, b: Scores, names: tuple[str, str] = ("A", "B"), n_boot: int = 2000,
                        seed: int = 0) -> Comparison:
    """a's mean over its tasks minus b's over theirs, when the two scored different tasks (each side's tasks
    resampled on their own): wider than a paired difference, which needs the same tasks on both sides. `n`: the
    tasks on the smaller side."""
    if not a or not b:
        raise ValueError(f"{names[0]} and {names[1]} both need a task to compare")
    va, vb = _task_means(a, sorted(a)), _task_means(b, sorted(b))
    rng = np.random.default_rng(seed)
    means = (va[rng.integers(0, len(va), size=(n_boot, len(va)))].mean(axis=1)
             - vb[rng.integers(0, len(vb), size=(n_boot, len(vb)))].mean(axis=1))
    lo, hi = np.percentile(means, [2.5, 97.5])
    return Comparison(names[0], names[1], min(len(va), len(vb)), Interval(float(va.mean() - vb.mean()), float(lo),
                                                                          float(hi)))


def runs_difference(runs: list[tuple[Scores, Scores]], names: tuple[str, str] = ("A", "B"), n_boot: int = 2000,
                    seed: int = 0) -> Comparison:
    """a − b over independent runs of an experiment (each its own world, tasks and training: one seed), from each
    run's paired task differences. Every run weighs alike (the value is the mean of the runs' mean differences), and
    the bootstrap draws runs with replacement, then tasks within each drawn run: the interval carries the spread
    between training runs as well as the sampling of tasks, which pooling every task as one set would hide."""
    if not runs:
        raise ValueError("runs_difference needs at least one run")
    diffs = []
    for k, (a, b) in enumerate(runs):
        try:
            diffs.append(_task_differences(a, b, names))
        except ValueError as e:
            raise ValueError(f"run {k}: {e}") from None
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for i in range(n_boot):
        drawn = (diffs[r] for r in rng.integers(0, len(diffs), size=len(diffs)))
        means[i] = np.mean([d[rng.integers(0, len(d), size=len(d))].mean() for d in drawn])
    lo, hi = np.percentile(means, [2.5, 97.5])
    value = float(np.mean([d.mean() for d in diffs]))
    return Comparison(names[0], names[1], sum(len(d) for d in diffs), Interval(value, float(lo), float(hi)))
