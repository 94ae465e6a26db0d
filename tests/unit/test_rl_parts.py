"""Group advantages and the curriculum scheduler (pure Python, no model)."""

from __future__ import annotations

import pytest
from conftest import EXAMPLES

from dice_kernels.train.rl.advantages import group_advantages
from dice_kernels.train.rl.config import RolloutConfig
from dice_kernels.train.rl.curriculum import Curriculum, RLTask, load_task_set


def test_advantages_are_per_group_z_scores_with_population_std_and_flat_groups_dropped():
    rewards = [1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    adv = group_advantages(rewards, groups)
    # group a: mean 0.25, population std sqrt(0.1875)
    std = 0.1875 ** 0.5
    assert adv.values[:4] == pytest.approx([0.75 / std] + [-0.25 / std] * 3)
    assert adv.kept == [True] * 4 + [False] * 8 and adv.values[4:] == [0.0] * 8
    assert (adv.groups, adv.dropped_groups) == (3, 2)
    interleaved = group_advantages([1, 0, 0, 1], ["x", "y", "x", "y"])  # groups need not be contiguous
    assert interleaved.values == pytest.approx([1, -1, -1, 1]) and interleaved.dropped_groups == 0


def _tasks(levels):
    return [RLTask(id=f"t{i}", level=lv, reference="") for i, lv in enumerate(levels)]


def test_sequential_curriculum_goes_easy_to_hard_wraps_and_resumes():
    tasks = load_task_set(EXAMPLES / "tasks", "e2e")
    assert [t.id for t in tasks] == ["L1/19", "L1/90"]
    from dice_kernels.train.rl.curriculum import by_level

    ordered = by_level(_tasks([3, 1, None, 2, 1]))
    assert [t.id for t in ordered] == ["t1", "t4", "t3", "t0", "t2"]  # stable within a level, unknown last
    cur = Curriculum(ordered, per_step=3)
    assert [t.id for t in cur.next_batch()] == ["t1", "t4", "t3"]
    assert [t.id for t in cur.next_batch()] == ["t0", "t2", "t1"]  # wraps around
    saved = cur.state_dict()
    resumed = Curriculum(ordered, per_step=3)
    resumed.load_state_dict(saved)
    assert [t.id for t in resumed.next_batch()] == [t.id for t in cur.next_batch()] == ["t4", "t3", "t0"]
    with pytest.raises(ValueError, match="not this one"):
        Curriculum(ordered[:2], per_step=3).load_state_dict(saved)


def test_mixed_curriculum_covers_every_task_once_per_pass_and_is_reproducible():
    tasks = _tasks([1] * 10)
    a, b = Curriculum(tasks, per_step=4, order="mixed", seed=7), Curriculum(tasks, per_step=4, order="mixed", seed=7)
    first = [t.id for _ in range(5) for t in a.next_batch()]  # two passes
    assert first == [t.id for _ in range(5) for t in b.next_batch()]
    assert sorted(first[:10]) == sorted(t.id for t in tasks) == sorted(first[10:20])
    assert first[:10] != [t.id for t in tasks] and first[:10] != first[10:20]  # shuffled, and anew each pass
    other = Curriculum(tasks, per_step=4, order="mixed", seed=8)
    assert [t.id for t in other.next_batch()] != first[:4]


def test_rewards_binary_and_speed_aware():
    import math

    from dice_kernels.harness import EvalResult, Outcome
    from dice_kernels.harness.outcomes import Timing
    from dice_kernels.train.rl.reward import RewardConfig, reward_of

    def result(outcome, ci=None, flags=None, kind=""):
        timing = Timing(speedup_ci95=ci, flags=flags or []) if ci or flags else None
        return EvalResult(task_id="t", candidate_id="c", candidate_sha256="x", outcome=outcome,
                          correct=outcome is Outcome.CORRECT, deceptive_kind=kind, timing=timing)

    binary, speed = RewardConfig(), RewardConfig(speed_bonus=0.25, speed_bonus_max=0.5)
    assert not binary.eval_config().timing.enabled and speed.eval_config().timing.enabled  # timing only when speed counts
    fast = result(Outcome.CORRECT, ci=[2.0, 2.6])
    assert reward_of(fast, binary) == 1.0  # DICE: binary
    assert reward_of(fast, speed) == pytest.approx(1 + 0.25 * math.log2(2.0))  # bonus from the interval's low end
    assert reward_of(result(Outcome.CORRECT, ci=[64.0, 80.0]), speed) == 1.5  # bounded
    assert reward_of(result(Outcome.CORRECT, ci=[0.95, 3.0]), speed) == 1.0  # interval does not clear 1
    assert reward_of(result(Outcome.CORRECT, ci=[2.0, 2.6], flags=["work_escaped_default_stream"]), speed) == 1.0
    assert reward_of(result(Outcome.DECEPTIVE, ci=[9.0, 9.5], kind="cached_output"), speed) == 0.0
    assert reward_of(result(Outcome.VALUE_MISMATCH), speed) == 0.0
    # the partial tier (own kernels beside kept PyTorch ops): full, a factor, or no credit; the bonus scales with it
    partial = result(Outcome.PARTIAL, ci=[2.0, 2.6])
    assert reward_of(partial, binary) == 1.0
    assert reward_of(partial, RewardConfig(partial_credit=0.5)) == 0.5
    assert reward_of(partial, RewardConfig(partial_credit=0.0, speed_bonus=0.25)) == 0.0
    assert reward_of(partial, RewardConfig(partial_credit=0.5, speed_bonus=0.25)) == pytest.approx(0.5 * 1.25)
    # DICE's own reward: one trial at 1e-2, no robust check, whatever trials / robust say
    dice = RewardConfig(rule="dice", trials=5, robust=True).eval_config()
    assert (dice.trials, dice.robust.enabled, dice.atol, dice.rtol) == (1, False, 1e-2, 1e-2)
    ours = RewardConfig(trials=5).eval_config()
    assert (ours.trials, ours.robust.enabled) == (5, True)
    from dice_kernels.config_io import ConfigError

    for bad in (dict(rule="naive"), dict(partial_credit=1.5)):
        with pytest.raises(ConfigError, match="reward.rule|reward.partial_credit"):
            RewardConfig(**bad)


@pytest.mark.parametrize("name", ["dice", "dice-infill", "dice-e2e"])
def test_shipped_dice_configs_use_dices_update_and_say_their_reward(name):
    """Issue 41: DICE's update (one optimizer step per 256 replayed rows, a fresh AdamW each RL step), our robust
    reward with partial replacement paid, and phase 1 handed to phase 2 in fp32."""
    from dice_kernels import config_io
    from dice_kernels.train.rl.config import RLConfig

    cfg = config_io.load(RLConfig, config_io.config_path("rl", name))
    assert (cfg.update.rows_per_update, cfg.update.reset_optimizer) == (256, True)
    assert (cfg.reward.rule, cfg.reward.partial_credit) == ("robust", 1.0)
    if name == "dice-infill":
        assert cfg.checkpoint.export_dtype == "float32"


def test_cuda_infilling_tasks_are_named_before_a_cpu_reward_runs_them():
    from dice_kernels.train.rl.trainer import unrunnable_tasks

    cuda = RLTask("t/cuda", 1, "ref", prefix='src = """__global__ void k(float* x) {\n',
                  suffix='}"""\nload_inline(cuda_sources=src)')
    cpp = RLTask("t/cpp", 1, "ref", prefix='src = """torch::Tensor f(torch::Tensor x) {\n', suffix='}"""')
    e2e = RLTask("t/e2e", 1, "ref")
    sets = {"infill": [cuda, cpp], "e2e": [e2e]}
    (warning,) = unrunnable_tasks(sets, "cpu")
    assert warning.startswith("phase infill: 1 of 2 tasks") and "t/cuda" in warning and "needs_gpu" in warning
    assert unrunnable_tasks(sets, "cuda") == []
    assert unrunnable_tasks({"infill": [cpp], "e2e": [e2e]}, "cpu") == []


def test_rollouts_decode_compiled_groups_with_shared_prompt_copies_unless_turned_off():
    # the decoder shares only when compiled on CUDA with no refill; the rollout config must pass both settings on
    on = RolloutConfig(compile=True, tasks_per_step=4, group=8, batch_rows=32).sampling()
    assert on.compile and on.share_prompts and on.temperature == 1.0
    assert not RolloutConfig(compile=True, share_prompts=False).sampling().share_prompts
