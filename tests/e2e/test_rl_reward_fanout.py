"""The Ray reward fan-out (train/rl/reward_fanout.py) scores like the single-process reward service: real C++ builds and
runs on the CPU backend, two Ray actors, results and SQLite rows in input order."""

from __future__ import annotations

import sqlite3
from dataclasses import replace

import pytest

from dice_kernels.harness.store import ResultStore
from dice_kernels.train.rl.reward import RewardConfig, RewardService
from dice_kernels.train.rl.reward_fanout import shard_by_task


def test_shards_keep_each_task_together_largest_first():
    # a: 3 candidates -> shard 0, b: 2 -> shard 1, c: 1 -> shard 1 (less loaded), d: 1 -> shard 0 (tie: lowest)
    assert shard_by_task(["a", "b", "a", "c", "b", "a", "d"], 2) == [[0, 2, 5, 6], [1, 3, 4]]
    assert shard_by_task(["a", "a"], 3) == [[0, 1], [], []]


def _rows(run_dir) -> list[tuple]:
    with sqlite3.connect(run_dir / "rewards.sqlite") as db:
        return db.execute("SELECT step, rollout, task_id, candidate_id, outcome, deceptive_kind, reward "
                          "FROM rewards ORDER BY step, rollout").fetchall()


def test_ray_fanout_scores_like_the_local_service(tmp_path, build_cache, example_pairs):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install 'dice-kernels[ray]'")
    pairs = example_pairs("cpu")  # 19_ReLU: broken, correct, wrong; 90_AddMul: correct, no_modelnew, wrong_shape
    relu, addmul = pairs[:3], pairs[3:]
    pairs = [p for two in zip(addmul, relu) for p in two]  # the tasks interleaved: the merge must restore this order
    cfg = RewardConfig(backend="cpu", trials=1, cache_dir=str(build_cache))
    with RewardService(cfg, tmp_path / "local") as service:
        local = service.score(3, pairs)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        with RewardService(replace(cfg, fanout="ray", ray_actors=2), tmp_path / "ray") as service:
            assert len(service.evaluator.actors) == 2
            fanned = service.score(3, pairs)
    finally:
        ray.shutdown()

    assert local.rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # correct ones rewarded, wrong and broken not
    assert [r.candidate_id for r in fanned.results] == [c.id for _, c in pairs]
    assert fanned.rewards == local.rewards
    assert [(r.outcome, r.deceptive_kind) for r in fanned.results] == [(r.outcome, r.deceptive_kind)
                                                                       for r in local.results]
    assert fanned.outcomes == local.outcomes and fanned.exec_rate == local.exec_rate == 2 / 6
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "local")
    # the driver, not the actors, wrote the harness results, so a resumed step finds them
    store = ResultStore(tmp_path / "ray" / "harness" / "results.sqlite")
    assert sorted(r.candidate_id for r in store.all()) == sorted(c.id for _, c in pairs)
    store.close()
