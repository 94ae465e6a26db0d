"""The RL update's direction and its PPO machinery, through the trainer's own `RLStep.update_policy` (FSDP2 on one
CPU process, no harness): with the true advantages the log-likelihood of the rewarded responses rises against the
penalised ones, with the sign flipped it falls; and with two optimizer steps in one RL step, the first sees a PPO
ratio of exactly 1 (old log-probs are this step's) while the second sees a moved policy, so the clip and the KL act.
A flipped sign in the loss, advantages paired with the wrong rows, or old log-probs refreshed between the optimizer
steps each fail one assertion here."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import VOCAB, tiny_model

from dice_kernels.sampling.decoder import SamplingConfig, decode
from dice_kernels.train.rl.config import RolloutConfig, UpdateConfig
from dice_kernels.train.rl.trainer import RLStep, flex_rows
from dice_kernels.train.rl.tracerl import Trajectory, denoising_rows, replay_batch, token_logprobs

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
ADVANTAGES = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0]


@pytest.fixture(scope="module")
def dist():
    from dice_kernels.train.distributed import init_distributed, shutdown

    yield init_distributed("cpu")
    shutdown()


@pytest.fixture(scope="module")
def trajectories() -> list[Trajectory]:
    model = tiny_model(0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, VOCAB - 1, (n,), generator=g).tolist() for n in (3, 6, 9, 4, 7, 5, 8, 2)]
    out = decode(model, prompts, SamplingConfig(max_new_tokens=8, temperature=1.0, strategy="dynamic", seed=0), [7])
    return [Trajectory(p, t, s) for p, t, s in zip(prompts, out.tokens, out.unmask_steps)]


def _objective(sharded, trajs: list[Trajectory]) -> float:
    """Σ advantage x mean token log-prob of each response under the weights of `sharded`, read into a plain copy
    (measured outside the trainer's FSDP module, so the measurement leaves its state alone): what the update
    should raise."""
    model = tiny_model(0)
    model.load_state_dict({k: v.full_tensor() for k, v in sharded.state_dict().items()})
    batch = replay_batch(trajs, 4, model.config.mask_token_id, 0)
    with torch.no_grad():
        logp = token_logprobs(model, batch, "dense")
    per_row = torch.split(logp, batch.scored.sum(1).tolist())
    return sum(a * float(r.mean()) for a, r in zip(ADVANTAGES, per_row))


def _update(dist, trajs, sign: float, lr: float, update: UpdateConfig):
    from dice_kernels.train.config import OptimConfig, ParallelConfig
    from dice_kernels.train.distributed import parallelize
    from dice_kernels.train.optim import build_optimizer

    model = tiny_model(0)
    parallelize(model, model.model.layers, ParallelConfig(), dist.device, forward_methods=("hidden_states",))
    before = _objective(model, trajs)
    optimizer = build_optimizer(model, OptimConfig(lr=lr, warmup_fraction=0.0))
    step = RLStep.__new__(RLStep)  # the update alone: no tokenizer, sampler or reward service involved
    step.model, step.optimizer, step.dist, step.attention, step.scheduler = model, optimizer, dist, "dense", None
    step.rollout, step.update, step.grad_clip, step.pad_id = RolloutConfig(block_size=4), update, 1.0, 0
    stats = step.update_policy([(i, t, sign * a) for i, (t, a) in enumerate(zip(trajs, ADVANTAGES))], trajs[0])
    return before, _objective(model, trajs), stats


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_update_moves_the_policy_toward_the_advantages(dist, trajectories, sign):
    before, after, _ = _update(dist, trajectories, sign, lr=1e-3, update=UpdateConfig(micro_rows=4))
    assert (after - before) * sign > 1e-3, (before, after)


def test_the_second_optimizer_step_of_a_step_sees_the_clip_and_the_kl(dist, trajectories):
    _, _, stats = _update(dist, trajectories, 1.0, lr=5e-2, update=UpdateConfig(micro_rows=4, updates_per_step=2))
    first, second = stats["updates"]
    assert first["ratio_rms_dev"] < 1e-6 and first["kl"] < 1e-9 and first["clip_fraction"] == 0.0
    assert second["ratio_rms_dev"] > 1e-3 and second["kl"] > 0 and second["clip_fraction"] > 0
    assert first["tokens"] + second["tokens"] == sum(len(t.tokens) for t in trajectories)


def test_dice_rule_takes_one_optimizer_step_per_rows_of_replayed_states(dist, trajectories):
    rows = sum(denoising_rows(t, 4) for t in trajectories)
    assert rows > len(trajectories)  # several denoising states per response
    _, _, stats = _update(dist, trajectories, 1.0, lr=1e-3,
                          update=UpdateConfig(micro_rows=4, rows_per_update=-(-rows // 3)))
    assert len(stats["updates"]) == 3
    _, _, stats = _update(dist, trajectories, 1.0, lr=1e-3, update=UpdateConfig(micro_rows=4, rows_per_update=1))
    assert len(stats["updates"]) == len(trajectories)  # at most one per response


def test_flex_micro_batches_pad_rows_to_a_power_of_two_not_to_micro_rows(trajectories):
    """Compiled flex compiles once per shape, but a padding row costs a whole row's forward and backward: an
    optimizer step of 1, 2 or 3 responses at micro_rows 4 lays out as 1, 2 or 4 rows, one of 5 as 4 + 4 (the last
    micro-batch keeps the step's shape), each as long as the longest replay rounded up to 1,024; every response is
    scored exactly once."""
    step = RLStep.__new__(RLStep)
    step.model, step.attention, step.pad_id = tiny_model(0), "flex", 0
    step.rollout, step.update = RolloutConfig(block_size=4), UpdateConfig(micro_rows=4)
    shapes = {n: [tuple(batch.ids.shape) for _, batch in step._micro_batches(trajectories[:n])] for n in (1, 2, 3, 5)}
    assert shapes == {1: [(1, 1024)], 2: [(2, 1024)], 3: [(4, 1024)], 5: [(4, 1024), (4, 1024)]}
    plan = step._micro_batches(trajectories[:5])
    assert sorted(i for rows, _ in plan for i in rows) == list(range(5))
    assert [int(batch.scored.any(1).sum()) for _, batch in plan] == [4, 1]
    assert [flex_rows(r, 8) for r in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 8]


@pytest.mark.parametrize("updates", [1, 2])
def test_only_rows_after_the_first_optimizer_step_pay_an_old_policy_forward(dist, trajectories, monkeypatch, updates):
    """The first optimizer step's rows are scored by the weights that rolled them out, so their old log-probs are
    their own, detached: one RL step with one optimizer step runs no forward without gradient; with two, only the
    second step's micro-batches run one (before the first step moves the weights)."""
    from dice_kernels.train.rl import trainer

    no_grad = []
    score = trainer.token_logprobs

    def counting(*args, **kwargs):
        no_grad.append(not torch.is_grad_enabled())
        return score(*args, **kwargs)

    monkeypatch.setattr(trainer, "token_logprobs", counting)
    _, _, stats = _update(dist, trajectories, 1.0, lr=1e-3, update=UpdateConfig(micro_rows=4, updates_per_step=updates))
    assert len(stats["updates"]) == updates
    parts = trainer.update_parts(list(range(len(trajectories))), updates)
    second_step_rows = len(parts[-1]) if updates > 1 else 0
    assert sum(no_grad) == -(-second_step_rows // 4)  # its micro-batches of 4 rows
    # one forward with gradient per micro-batch, as before
    assert len(no_grad) - sum(no_grad) == sum(-(-len(p) // 4) for p in parts)
