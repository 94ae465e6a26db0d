"""The reward service: one harness `Evaluator` kept for a whole RL run (workers, fork server, build cache and
reference baselines paid once; or several on a Ray cluster, `reward.fanout = "ray"`), turning each step's (task,
candidate) pairs into rewards, and recording every outcome per step in SQLite. Reward (rule "robust"): 1 for
correct, `partial_credit` for partial (own kernels beside PyTorch ops it kept), 0 for deceptive and failures,
optionally plus a bounded speed bonus when the speedup's 95 % interval clears 1 and no timing flag was raised.
Rule "dice" reproduces DICE's own reward: compile and one trial at 1e-2, no robust check."""

from __future__ import annotations

import importlib.util
import json
import math
import sqlite3
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from dice_kernels.harness import (BuildConfig, Candidate, EvalConfig, EvalResult, Evaluator, Outcome, RobustConfig,
                                  SandboxConfig, TimingConfig)
from dice_kernels.harness.metrics import deceptive_extensions
from dice_kernels.tasks import Task
from dice_kernels.config_io import ConfigError


REWARD_RULES = ("robust", "dice")


@dataclass
class RewardConfig:
    backend: str = "auto"  # harness backend: cuda, cpu (C++ candidates), auto
    # "robust": our harness as configured here; "dice": DICE's reward (compile + one trial at atol = rtol = 1e-2,
    # no robust check, so a cheat that matches the outputs is paid), for reproduction and ablations. "dice"
    # overrides trials and robust
    rule: str = "robust"
    trials: int = 5  # correctness trials, each with fresh random inputs (DICE: one)
    robust: bool = True  # the robust check: correct-but-deceptive candidates get no reward
    # reward of a `partial` candidate (correct, its kernels beside PyTorch ops it kept: KernelBench's rule allows
    # it): 1 = as correct, 0 < f < 1 = a factor, 0 = none (only full replacement pays)
    partial_credit: float = 1.0
    # speed-aware reward: binary + min(speed_bonus_max, speed_bonus * log2(lower 95 % bound of the speedup)) when
    # that bound is above 1; never for deceptive or timing-flagged candidates. 0 = DICE's binary reward (no timing)
    speed_bonus: float = 0.0
    speed_bonus_max: float = 0.5
    cache_dir: str = ""  # harness build cache ("" = the harness default, $DICE_CACHE_DIR or ~/.cache)
    # a program scored before (same task, syntax tree and settings on this machine) gets that verdict again without
    # running (EvalConfig.reuse_verdicts): a run's later steps and other arms meet the same programs many times
    reuse_verdicts: bool = True
    run_timeout_s: float = 60.0
    compile_timeout_s: float = 300.0
    # where candidates are scored: "local" (one Evaluator in this process) or "ray" (`ray_actors` Evaluators on a
    # Ray cluster, a step's candidates sharded by task: train/rl/reward_fanout.py, the `ray` extra)
    fanout: Literal["local", "ray"] = "local"
    ray_actors: int = 0  # 0: one per GPU of the cluster (cuda), one per node (cpu)
    ray_address: str = ""  # "": RAY_ADDRESS, else a cluster `ray start` began here, else a local one; "auto"; host:port

    def __post_init__(self) -> None:
        if self.rule not in REWARD_RULES:
            raise ConfigError(f"reward.rule must be one of {', '.join(REWARD_RULES)}, not {self.rule!r}")
        if not 0 <= self.partial_credit <= 1:
            raise ConfigError(f"reward.partial_credit must be in [0, 1], not {self.partial_credit}")
        if self.fanout == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("reward.fanout=ray needs Ray, which is not installed: pip install 'dice-kernels[ray]'")

    def evaluator(self):
        """The harness evaluator the run scores with: one `Evaluator` here, or the Ray fan-out of several."""
        if self.fanout == "ray":
            from dice_kernels.train.rl.reward_fanout import RayEvaluator

            return RayEvaluator(self.eval_config(), self.ray_actors, self.ray_address)
        return Evaluator(self.eval_config())

    def eval_config(self) -> EvalConfig:
        dice = self.rule == "dice"
        cfg = EvalConfig(backend=self.backend, trials=1 if dice else self.trials,
                         robust=RobustConfig(enabled=self.robust and not dice), atol=1e-2, rtol=1e-2,
                         timing=TimingConfig(enabled=self.speed_bonus > 0),
                         sandbox=SandboxConfig(run_timeout_s=self.run_timeout_s),
                         build=BuildConfig(timeout_s=self.compile_timeout_s), reuse_verdicts=self.reuse_verdicts)
        return replace(cfg, cache_dir=Path(self.cache_dir)) if self.cache_dir else cfg  # EvalConfig is frozen


def reward_of(result: EvalResult, cfg: RewardConfig) -> float:
    """1 for correct, `partial_credit` for partial (the harness labels deceptive candidates `deceptive`, never
    either), times the speed bonus's 1 + bonus where it applies."""
    base = {Outcome.CORRECT: 1.0, Outcome.PARTIAL: cfg.partial_credit}.get(result.outcome, 0.0)
    ci = result.timing.speedup_ci95 if result.timing else None
    if base == 0 or cfg.speed_bonus <= 0 or not ci or result.timing_flags or ci[0] <= 1.0:
        return base
    return base * (1.0 + min(cfg.speed_bonus_max, cfg.speed_bonus * math.log2(ci[0])))


@dataclass
class StepRewards:
    rewards: list[float]
    results: list[EvalResult]
    seconds: float
    outcomes: dict[str, int] = field(default_factory=dict)  # outcome -> count
    deceptive: dict[str, int] = field(default_factory=dict)  # deceptive kind -> count
    # deceptive candidates by what their extension did (never built / loaded but not called / called)
    deceptive_extension: dict[str, int] = field(default_factory=dict)

    @property
    def exec_rate(self) -> float:
        """Exec under KernelBench's rule: the fraction correct or partial, not deceptive."""
        return sum(1 for r in self.results if r.outcome.passes) / max(1, len(self.results))


class RewardService:
    """`with RewardService(cfg, run_dir) as rs: rs.score(step, pairs)` for every step of a run. Harness results
    also go to `run_dir/harness/results.sqlite`, so a resumed step does not evaluate a candidate twice."""

    def __init__(self, cfg: RewardConfig, run_dir: str | Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.evaluator = cfg.evaluator()
        self.db = sqlite3.connect(self.run_dir / "rewards.sqlite")
        self.db.execute("CREATE TABLE IF NOT EXISTS rewards (step INTEGER, rollout INTEGER, task_id TEXT, "
                        "candidate_id TEXT, candidate_sha256 TEXT, outcome TEXT, deceptive_kind TEXT, reward REAL, "
                        "speedup REAL, speedup_ci95 TEXT, error TEXT, PRIMARY KEY (step, rollout))")
        self.db.commit()

    def score(self, step: int, pairs: list[tuple[Task, Candidate]], progress: bool = False) -> StepRewards:
        start = time.monotonic()
        results = self.evaluator.evaluate(pairs, out_dir=self.run_dir / "harness", resume=True, progress=progress)
        rewards = [reward_of(r, self.cfg) for r in results]
        self.db.execute("DELETE FROM rewards WHERE step = ?", (step,))  # a step redone after a resume
        self.db.executemany("INSERT INTO rewards VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [
            (step, i, r.task_id, r.candidate_id, r.candidate_sha256, r.outcome.value, r.deceptive_kind, reward,
             r.speedup, json.dumps(r.timing.speedup_ci95 if r.timing else None), r.error[:500])
            for i, (r, reward) in enumerate(zip(results, rewards))])
        self.db.commit()
        out = StepRewards(rewards=rewards, results=results, seconds=time.monotonic() - start,
                          deceptive_extension=deceptive_extensions(results))
        for r in results:
            out.outcomes[r.outcome.value] = out.outcomes.get(r.outcome.value, 0) + 1
            if r.deceptive_kind:
                out.deceptive[r.deceptive_kind] = out.deceptive.get(r.deceptive_kind, 0) + 1
        return out

    def close(self) -> None:
        self.evaluator.close()
        self.db.close()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
