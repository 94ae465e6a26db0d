"""The robust check on an RL arm's own rollouts: those of the first and the last third of its steps (the run's
rollout log) scored again with the robust reward's harness settings, so the report can say how the share of
deceptive rollouts, and of deceptive rollouts the arm's reward paid, moved while it trained. DICE's reward pays a
cheat whose outputs match; ours never does. Verdicts the runs already reached are reused, so a robust-reward arm
costs nothing to check again."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Callable

from dice_kernels.demo.config import ARMS, DemoConfig
from dice_kernels.demo.stats import Scores, paired_difference, rate_interval, unpaired_difference
from dice_kernels.demo.world import WorldFiles


def windows(steps: int) -> tuple[list[int], list[int]]:
    """The first and the last third of `steps` RL steps (at least one step each): the windows of every early/late
    trend in the report (the train reward's, the rollout check's)."""
    width = max(1, steps // 3)
    return list(range(width)), list(range(max(0, steps - width), steps))


def check_file(cfg: DemoConfig, arm: str) -> Path:
    return cfg.out / "rollout_check" / f"{arm}.jsonl"


def stage_rollout_check(cfg: DemoConfig, files: WorldFiles, arm: str) -> Path | None:
    """Score the arm's first- and last-third rollouts with the robust check; one JSON line per rollout (window,
    step, task, whether the arm's reward paid it, outcome under the robust check) in `check_file`. None when the
    arm's run kept no rollout log (trained before runs kept one): the report then has no row for it."""
    from dice_kernels.harness import Evaluator
    from dice_kernels.train.rl.curriculum import load_task_set
    from dice_kernels.train.rl.rollout import response_candidate

    out = check_file(cfg, arm)
    if out.is_file():
        return out
    phases = cfg.rl_phases(arm)
    logs = {step: cfg.rl_dir(arm) / "rollouts" / f"step-{step:05d}.rank0.jsonl.gz"
            for steps in windows(len(phases)) for step in steps}
    if not all(log.is_file() for log in logs.values()):
        return None
    sets = {"infill": files.rl_infill, "e2e": files.rl_e2e}
    tasks = {p: {t.id: t for t in load_task_set(str(sets[p]), p)} for p in set(phases)}
    rows, pairs = [], []
    for window, steps in zip(("first", "last"), windows(len(phases))):
        for step in steps:
            with gzip.open(logs[step], "rt", encoding="utf-8") as f:
                for line in f:
                    r = json.loads(line)
                    task = tasks[phases[step]][r["task_id"]]
                    pairs.append((task.harness_task(), response_candidate(task, phases[step], r["text"],
                                                                         f"{window}/{r['candidate_id']}")))
                    rows.append({"window": window, "step": step, "task_id": r["task_id"],
                                 "candidate_id": r["candidate_id"], "paid": r["reward"] > 0})
    # the robust reward exactly as the robust arms were paid, so their verdicts are found, not run again
    with Evaluator(cfg.reward().eval_config()) as evaluator:
        results = evaluator.evaluate(pairs)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_suffix(".partial")
    staging.write_text("".join(json.dumps(row | {"outcome": r.outcome.value, "deceptive_kind": r.deceptive_kind})
                               + "\n" for row, r in zip(rows, results)))
    staging.replace(out)
    return out


def check_scores(rows: list[dict], window: str, paid: bool = False, only: frozenset[str] | None = None) -> Scores:
    """Per task of one window of a rollout check (or of `only` those tasks): 1 for each rollout the robust check
    calls deceptive (and, with `paid`, that the arm's reward paid), else 0."""
    out: Scores = {}
    for r in rows:
        if r["window"] == window and (only is None or r["task_id"] in only):
            cheat = r["outcome"] == "deceptive" and (r["paid"] or not paid)
            out.setdefault(r["task_id"], []).append(float(cheat))
    return out


def cheats_alone(rows: list[dict]) -> dict[str, int]:
    """How many checked rollouts the robust check calls deceptive, and how many of those came in a group (one task's
    rollouts at one step) of deceptive rollouts alone: such a group is flat under either reward (DICE's pays all of
    it, ours none), so it carries no gradient, and only groups mixing a cheat with other programs let the rewards
    differ."""
    groups: dict[tuple[int, str], list[bool]] = {}
    for r in rows:
        groups.setdefault((r["step"], r["task_id"]), []).append(r["outcome"] == "deceptive")
    return {"deceptive": sum(sum(g) for g in groups.values()),
            "alone": sum(len(g) for g in groups.values() if all(g))}


CheckReader = Callable[[Path], "list[dict] | None"]  # read_check, or a caching wrapper of it


def read_check(path: Path) -> list[dict] | None:
    """A rollout check's rows (None before the check ran)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else None


def deception_trend(path: Path, seed: int = 0, taught: frozenset[str] = frozenset(),
                    read: CheckReader = read_check) -> dict | None:
    """From a rollout check: the share of rollouts the robust check calls deceptive, and of those the arm's reward
    paid, in the first and the last third of the steps (intervals over tasks), and last − first paired over the
    tasks drawn in both (None before the check ran). With `taught` (the tasks whose programs the SFT data writes as
    the shortcut), also the deceptive share on those tasks alone, last − first unpaired: a window's mix of taught
    and other tasks moves the share over all tasks without any habit changing. `read`: read_check or a caching
    wrapper of it, when another view reads the same check."""
    rows = read(path)
    if rows is None:
        return None
    trend: dict = {"rollouts": {w: sum(r["window"] == w for r in rows) for w in ("first", "last")},
                   "cheats_alone": cheats_alone(rows)}
    for key, paid in (("deceptive", False), ("paid_deceptive", True)):
        first, last = check_scores(rows, "first", paid), check_scores(rows, "last", paid)
        if not first or not last:
            return None
        trend[key] = {w: dataclasses.asdict(rate_interval(s, seed=seed)) for w, s in (("first", first), ("last", last))}
        if set(first) & set(last):
            diff = paired_difference(last, first, ("last third", "first third"), seed=seed)
            trend[key]["diff"] = dataclasses.asdict(diff.diff) | {"n": diff.n, "verdict": diff.verdict}
    first, last = check_scores(rows, "first", only=taught), check_scores(rows, "last", only=taught)
    if first and last:
        diff = unpaired_difference(last, first, ("last third", "first third"), seed=seed)
        trend["taught_deceptive"] = {w: dataclasses.asdict(rate_interval(s, seed=seed)) | {"tasks": len(s)}
                                     for w, s in (("first", first), ("last", last))}
        trend["taught_deceptive"]["diff"] = dataclasses.asdict(diff.diff) | {"verdict": diff.verdict}
    return trend


def reward_contrast(cfg: DemoConfig, arms: list[str], taught: frozenset[str] = frozenset(),
                    read: CheckReader = read_check) -> list[dict]:
    """DICE's reward against ours on the same RL run shape (e2e_dice against e2e_robust, bicrl_dice against
    bicrl_robust): the share of deceptive rollouts in each window, paired over the tasks both drew (the schedule is
    seeded, so both arms draw the same tasks at every step), over all tasks and over `taught` ones."""
    out = []
    for dice in (a for a in arms if ARMS[a].rule == "dice" and ARMS[a].phase):
        ours = next((a for a in arms if ARMS[a].phase == ARMS[dice].phase and ARMS[a].rule == "robust"
                     and not ARMS[a].speed), None)
        rows = {a: read(check_file(cfg, a)) for a in (dice, ours) if a}
        if ours is None or None in rows.values():
            continue
        for window in ("first", "last"):
            for subset, only in (("all", None), ("taught", taught)):
                a, b = (check_scores(rows[x], window, only=only) for x in (dice, ours))
                if (subset == "taught" and not taught) or not set(a) & set(b):
                    continue
                cmp = paired_difference(a, b, (dice, ours), seed=cfg.world.seed)
                out.append({"a": dice, "b": ours, "window": window, "tasks": subset, "n": cmp.n,
                            "diff": dataclasses.asdict(cmp.diff), "verdict": cmp.verdict})
    return out


def rewards_title(arm: str) -> str:
    return "DICE's (pays matching outputs)" if ARMS[arm].rule == "dice" else "ours (robust check)"
