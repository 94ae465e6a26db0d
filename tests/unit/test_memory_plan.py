"""The RL memory plan (`dice train rl --plan`): its sizes against the structures the code really allocates (the
decoder's KV cache, a replayed row), against the GPU measurements it was checked on, and its advice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_fixtures import VOCAB, tiny_config, tiny_model
from typer.testing import CliRunner

from dice_kernels import config_io
from dice_kernels.cli import app
from dice_kernels.model.config import SDAR_SHAPES
from dice_kernels.sampling import decoder
from dice_kernels.train.plan import GiB, format_rl_plan, rl_memory_plan
from dice_kernels.train.rl.config import RLConfig, RolloutConfig
from dice_kernels.train.rl.tracerl import REPLAY_MULTIPLE, Trajectory, replay_length

BLOCK = 4


@pytest.mark.parametrize("prompt_len,new,group,compiled", [(5, 14, 1, False), (130, 300, 4, True), (61, 67, 8, True),
                                                              (100, 30, 4, True)])
def test_kv_cache_is_the_decoders(prompt_len, new, group, compiled):
    """The plan's cache bytes are those of the cache the decoder builds for the same batch: each row's slots and,
    decoding whole groups compiled, the shared copies of their prompts."""
    tasks = 3
    prompts = [[7 + t] * prompt_len for t in range(tasks) for _ in range(group)]
    state = decoder._initial_state(prompts, BLOCK, 4, new, VOCAB - 1, torch.device("cpu"), prompt_len)
    run = decoder.prompt_runs(prompts, BLOCK) if compiled else 1
    forward = decoder._CachedForward(tiny_model(), state, BLOCK, graphs=False, graph_denoise=False, compiled=False,
                                     run=run, prompt_slots=state.seq.shape[1] - new)
    elements = forward.cache.k.numel() + (forward.prompts.k.numel() if forward.prompts is not None else 0)
    rollout = RolloutConfig(tasks_per_step=tasks, group=group, max_new_tokens=new, batch_rows=tasks * group,
                            block_size=BLOCK, compile=compiled)
    plan = rl_memory_plan(tiny_config(), 1, prompt_len, rollout, micro_rows=1)
    assert plan.kv_slots == forward.cache.k.shape[3]
    assert plan.prompt_copies == (forward.prompts.k.shape[1] if forward.prompts is not None else 0)
    assert (forward.prompts is not None) == (group > 1 and compiled)
    assert plan.kv_cache == 2 * elements * 2  # keys and values, bf16


def test_replayed_row_holds_the_longest_trajectory():
    """A response that runs to max_new_tokens with every block decoded in all its steps is the longest row the
    update replays; the plan's row holds it, padded as flex pads it."""
    prompt_len, new, steps = 37, 64, 4
    traj = Trajectory(prompt=[5] * prompt_len, tokens=[9] * new, steps=[(prompt_len + j) % BLOCK for j in range(new)])
    longest = replay_length(traj, BLOCK)
    plan = rl_memory_plan(tiny_config(), 1, prompt_len, RolloutConfig(max_new_tokens=new, steps=steps), 1)
    assert longest <= plan.replay_tokens == -(-longest // REPLAY_MULTIPLE) * REPLAY_MULTIPLE


def test_plan_matches_the_gpu_measurements():
    """Checked against `benchmarks/rl_step.py --compile-rollouts --rollouts-again` on one H200 (16 tasks x 8 rollouts
    of 1,024 tokens, the prompts' longest 926 tokens; docs/rl.md): the rollouts' peaks up to 3 % above the plan's
    (the compiled decoder keeps ~0.6 GiB the plan leaves to its slack line), the updates' up to 10 % below it. And on one H100, the 4B step's states at its out-of-memory snapshot: 16.54 GiB of weights, 16.44 of
    gradients, 2 x 16.43 of moments."""
    rollout = RolloutConfig(tasks_per_step=16, group=8, max_new_tokens=1024, batch_rows=128, compile=True)
    for shape, first_rollouts, update, rollouts_again in (("1.7B", 44.3, 35.7, 57.8), ("4B", 76.5, 83.7, 109.9)):
        plan = rl_memory_plan(SDAR_SHAPES[shape], 1, 926, rollout, micro_rows=4)
        assert 0.97 * first_rollouts <= (plan.rollout_peak() - plan.adam) / GiB <= first_rollouts  # no moments yet
        assert 0.97 * rollouts_again <= plan.rollout_peak() / GiB <= rollouts_again
        assert update <= plan.update_peak(True) / GiB <= 1.1 * update
    big = rl_memory_plan(SDAR_SHAPES["4B"], 1, 926, rollout, micro_rows=1)
    for planned, measured in ((big.weights, 16.54), (big.grads, 16.44), (big.adam, 2 * 16.43)):
        assert planned / GiB == pytest.approx(measured, rel=0.01)
    assert big.update_peak(True) > 80 * GiB  # that update ran out of memory on the H100


def test_advice_names_batch_rows_that_fit():
    checkpoint = SDAR_SHAPES["8B"]
    rollout = RolloutConfig()  # DICE's: 64 tasks x 16, 4,096 new tokens, 64 rows a rank at once
    plan = rl_memory_plan(checkpoint, 8, 2048, rollout, micro_rows=4)
    budget = 0.95 * 80 * GiB
    assert plan.rollout_peak() > budget
    rows = plan.rollout_rows_within(budget)
    assert 0 < rows < 64
    fewer = rl_memory_plan(checkpoint, 8, 2048, dataclasses.replace(rollout, batch_rows=rows), 4)
    more = rl_memory_plan(checkpoint, 8, 2048, dataclasses.replace(rollout, batch_rows=rows + 1), 4)
    assert fewer.rollout_peak() <= budget < more.rollout_peak()
    text = format_rl_plan(plan, 80, checkpointing=True)
    assert f"rollout.batch_rows = {rows}" in text and "does NOT fit  <- this config" in text
    assert "fits  <- this config" in format_rl_plan(plan, 141, checkpointing=True)


def test_copy_of_the_weights_costs_the_update():
    shared = rl_memory_plan(SDAR_SHAPES["4B"], 8, 2048, RolloutConfig(), 4)
    copied = rl_memory_plan(SDAR_SHAPES["4B"], 8, 2048, RolloutConfig(share_weights=False), 4)
    assert shared.policy_copy == 0 and copied.policy_copy == 2 * copied.params
    assert copied.update_peak(True) - shared.update_peak(True) == copied.policy_copy
    assert copied.refresh == 4 * copied.params and shared.refresh == 0  # the fp32 state dict, gathered whole
    assert "kept through the update" in format_rl_plan(copied, 80, True)


def test_cli_plan(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["train", "rl", "tiny", "--plan", "--gpus", "2", "--prompt-tokens", "900"])
    assert result.exit_code == 0, result.output
    assert "prompts of up to 900 tokens" in result.output and "sharded over 2 GPU(s)" in result.output
    assert "rolling out, 4 rows at once" in result.output  # 2 tasks x 4 rollouts over 2 GPUs
    for bad, message in ((["--gpus", "0"], "--gpus must be >= 1"), (["--prompt-tokens", "0"], "--prompt-tokens")):
        result = runner.invoke(app, ["train", "rl", "tiny", "--plan", *bad])
        assert result.exit_code == 2 and message in result.output
    # DICE's config names a checkpoint a new user does not have yet: the error says how to plan without it, and
    # that way works
    result = runner.invoke(app, ["train", "rl", "dice", "--plan", "--gpus", "8", "--set",
                                 f"model.checkpoint={tmp_path / 'absent'}"])
    assert result.exit_code == 2 and "no such checkpoint folder" in result.output
    hint = result.output.split("without it: ")[1].split(" (")[0].split()
    result = runner.invoke(app, ["train", "rl", "dice", "--plan", "--gpus", "8", *hint])
    assert result.exit_code == 0 and "rollout.batch_rows = 47" in result.output  # 8B on 80 GB GPUs


def test_run_warns_before_its_first_rollout_when_a_step_may_not_fit():
    """`dice train rl` on a GPU checks the plan with the task sets' longest prompt: a warning that names the fix
    where the step may not fit, nothing where it fits."""
    from importlib.resources import files

    from dice_kernels.model.tokenizer import load_tokenizer
    from dice_kernels.train.rl.curriculum import load_task_set
    from dice_kernels.train.rl.rollout import rollout_prompt
    from dice_kernels.train.rl.trainer import memory_warning

    root = files("dice_kernels")
    tokenizer = load_tokenizer(str(root / "assets" / "qwen3-tokenizer"))
    sets = {"e2e": load_task_set(str(root / "examples" / "tasks"), "e2e")}
    longest = max(len(tokenizer.encode(rollout_prompt(t, "e2e", "cuda"), add_special_tokens=False))
                  for t in sets["e2e"])
    cfg = config_io.load(RLConfig, config_io.config_path("rl", "dice"))  # DICE's: 64 x 16, 4,096 new tokens
    warning = memory_warning(cfg, sets, tokenizer, SDAR_SHAPES["8B"], "cuda", 8, 64.0)
    plan = rl_memory_plan(SDAR_SHAPES["8B"], 8, longest, cfg.rollout, cfg.update.micro_rows)
    rows = plan.rollout_rows_within(0.95 * 64.0 * GiB)
    assert warning is not None and f"prompts of up to {longest} tokens" in warning
    assert f"rollout.batch_rows = {rows}" in warning and rows < 64
    assert memory_warning(cfg, sets, tokenizer, SDAR_SHAPES["8B"], "cuda", 8, 139.8) is None
