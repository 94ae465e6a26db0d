"""demo/report.py's readers and limits: train rewards per RL step grouped by rollout group (the bootstrap's
clusters), and the limits a small run states."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from dice_kernels.demo.config import DemoConfig, RLSection, WorldSection
from dice_kernels.demo.report import scale_limits, train_rewards


def test_train_rewards_group_a_step_by_task_and_position(tmp_path):
    with sqlite3.connect(tmp_path / "rewards.sqlite") as db:  # the schema train/rl/reward.py's RewardService writes
        db.execute("CREATE TABLE rewards (step INTEGER, rollout INTEGER, task_id TEXT, candidate_id TEXT, "
                   "candidate_sha256 TEXT, outcome TEXT, deceptive_kind TEXT, reward REAL, speedup REAL, "
                   "speedup_ci95 TEXT, error TEXT, PRIMARY KEY (step, rollout))")
        # step 1: task a twice (the curriculum wrapped: two groups), task b once; groups of 2 rollouts
        rows = [(1, 0, "a", 1.0), (1, 1, "a", 0.0), (1, 2, "b", 1.0), (1, 3, "b", 1.0), (1, 4, "a", 0.0),
                (1, 5, "a", 0.0), (2, 0, "c", 0.5), (2, 1, "c", 1.5)]
        db.executemany("INSERT INTO rewards VALUES (?, ?, ?, '', '', 'correct', '', ?, NULL, NULL, '')", rows)
    steps = train_rewards(tmp_path, group=2)
    assert steps == [(1, {"a#0": [1.0, 0.0], "b#1": [1.0, 1.0], "a#2": [0.0, 0.0]}), (2, {"c#0": [0.5, 1.5]})]
    assert train_rewards(tmp_path / "missing", group=2) == []


def test_a_small_cpu_run_states_what_it_cannot_show():
    cfg = DemoConfig(out=Path("x"), arms=("sft", "e2e_robust"), world=WorldSection(n_heldout=24),
                     rl=RLSection(export_every=0))
    limits = " | ".join(scale_limits(cfg))
    assert "24 held-out tasks" in limits and "+-20 points" in limits
    assert "e2e_dice" in limits and "bicrl_robust" in limits  # the arms not run
    assert "speed signal" in limits and "no held-out learning curve" in limits and "n_novel" in limits
