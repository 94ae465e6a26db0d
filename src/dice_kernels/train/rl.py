"""BiC-RL (DESIGN.md §5): per step, the curriculum's tasks -> `group` rollouts each (block-diffusion sampler,
trajectories kept) -> rewards from the long-lived harness service -> group z-scored advantages -> TraceRL update.
Phase infill, e2e, or the schedule infill then e2e. `RLConfig` holds every knob; `RLStep` does one step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dice_kernels.model.transformer import BlockDiffusionLM
from dice_kernels.sampling.decoder import SamplingConfig
from dice_kernels.train.advantages import group_advantages
from dice_kernels.train.curriculum import Curriculum
from dice_kernels.train.reward import RewardConfig, RewardService
from dice_kernels.train.rollout import Rollout, generate_rollouts
from dice_kernels.train.tracerl import ReplayBatch, Trajectory, policy_loss, replay_batch, row_of_scored, token_logprobs

PHASES = ("infill", "e2e", "schedule")


@dataclass
class RolloutConfig:
    tasks_per_step: int = 64
    group: int = 16  # rollouts per task
    max_new_tokens: int = 4096
    block_size: int = 4
    steps: int = 4  # denoising forwards per block, at most
    strategy: str = "dynamic"
    threshold: float = 0.9  # dynamic remasking
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    batch_rows: int = 64  # responses decoded together
    seed: int = 0

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=self.max_new_tokens, block_size=self.block_size, steps=self.steps,
                              strategy=self.strategy, threshold=self.threshold, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed)


@dataclass
class UpdateConfig:
    lr: float = 1e-6  # AdamW, constant
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    clip: float = 0.2  # PPO ratio clip
    kl_beta: float = 0.01  # k3 KL to the rollout (old) policy
    micro_rows: int = 8  # trajectories per scoring forward (gradient accumulation inside an update)
    updates_per_step: int = 1  # optimizer steps per RL step: the step's trajectories split into this many parts
    attention: str = "auto"  # flex (CUDA) | dense (CPU) | auto


@dataclass
class RLStats:
    """What one step reports (one JSONL row)."""

    step: int
    phase: str
    tasks: int
    rollouts: int
    reward_mean: float
    exec: float
    outcomes: dict[str, int]
    deceptive: dict[str, int]
    groups: int
    dropped_groups: int
    trained_rollouts: int
    tokens_generated: int
    loss: float
    kl: float
    clip_fraction: float
    grad_norm: float
    seconds: dict[str, float] = field(default_factory=dict)  # rollout / reward / update


class RLStep:
    """One RL step over a model, its optimizer, a tokenizer and a reward service (all owned by the caller)."""

    def __init__(self, model: BlockDiffusionLM, optimizer: torch.optim.Optimizer, tokenizer, rewards: RewardService,
                 rollout: RolloutConfig, update: UpdateConfig, backend: str, stop_ids: list[int], pad_id: int):
        self.model, self.optimizer, self.tokenizer, self.rewards = model, optimizer, tokenizer, rewards
        self.rollout, self.update, self.backend = rollout, update, backend
        self.stop_ids, self.pad_id = stop_ids, pad_id
        device = next(model.parameters()).device
        self.attention = update.attention if update.attention != "auto" else (
            "flex" if device.type == "cuda" else "dense")

    def __call__(self, step: int, phase: str, curriculum: Curriculum) -> RLStats:
        seconds: dict[str, float] = {}
        t0 = time.monotonic()
        tasks = curriculum.next_batch()
        rollouts = generate_rollouts(self.model, self.tokenizer, tasks, self.rollout.group, phase, self.backend,
                                     self.rollout.sampling(), self.rollout.batch_rows, step, self.stop_ids)
        seconds["rollout"] = time.monotonic() - t0
        scored = self.rewards.score(step, [(r.task.harness_task(), r.candidate) for r in rollouts])
        seconds["reward"] = scored.seconds
        # a task may come twice in one step (the curriculum wraps): groups are per position in the batch
        adv = group_advantages(scored.rewards, [str(i // self.rollout.group) for i in range(len(rollouts))])
        t1 = time.monotonic()
        kept = [(r, a) for r, a, k in zip(rollouts, adv.values, adv.kept) if k]
        upd = self._update([r.trajectory for r, _ in kept], [a for _, a in kept]) if kept else _NO_UPDATE
        seconds["update"] = time.monotonic() - t1
        return RLStats(step=step, phase=phase, tasks=len(tasks), rollouts=len(rollouts),
                       reward_mean=sum(scored.rewards) / len(rollouts), exec=scored.exec_rate,
                       outcomes=scored.outcomes, deceptive=scored.deceptive, groups=adv.groups,
                       dropped_groups=adv.dropped_groups, trained_rollouts=len(kept),
                       tokens_generated=sum(len(r.trajectory.tokens) for r in rollouts), seconds=seconds, **upd)

    def _micro_batches(self, trajs: list[Trajectory], rows: list[int]) -> list[tuple[list[int], ReplayBatch]]:
        """(rows, their scoring layout) in groups of `micro_rows`, longest first so that rows of similar length
        share a forward (less padding); flex rows are padded to multiples of 128 (few shapes to compile)."""
        rows = sorted(rows, key=lambda i: -len(trajs[i].prompt) - len(trajs[i].tokens))
        n, mask_id = self.update.micro_rows, self.model.config.mask_token_id
        multiple = 128 if self.attention == "flex" else 1
        return [(part, replay_batch([trajs[i] for i in part], self.rollout.block_size, mask_id, self.pad_id, multiple))
                for part in (rows[i: i + n] for i in range(0, len(rows), n))]

    def _update(self, trajectories: list[Trajectory], advantages: list[float]) -> dict:
        block, upd = self.rollout.block_size, self.update
        # DESIGN §5: each row's sum over its tokens divided by the padded response length (the step's longest
        # response, rounded up to whole blocks), so every row is weighed on one scale
        norm_len = max(-(-len(t.tokens) // block) * block for t in trajectories)
        device = next(self.model.parameters()).device
        adv = torch.tensor(advantages, dtype=torch.float32, device=device)
        # old-policy log-probs: the rollout policy's, before any update of this step
        old: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for rows, batch in self._micro_batches(trajectories, list(range(len(trajectories)))):
                logp = token_logprobs(self.model, batch, self.attention, self.rollout.temperature)
                old.update(zip(rows, torch.split(logp, batch.scored.sum(1).tolist())))
        order = list(range(len(trajectories)))
        parts = [order[k:: upd.updates_per_step] for k in range(upd.updates_per_step)]
        losses, kls, clipped, tokens, norms = [], [], 0, 0, []
        self.model.train()
        for part in (p for p in parts if p):
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for rows, batch in self._micro_batches(trajectories, part):
                new = token_logprobs(self.model, batch, self.attention, self.rollout.temperature)
                local = torch.tensor(rows, device=device)
                terms = policy_loss(new, torch.cat([old[i] for i in rows]), adv[local], row_of_scored(batch).to(device),
                                    norm_len, len(part), upd.clip, upd.kl_beta)
                terms.loss.backward()
                total += terms.loss.item()
                kls.append(terms.kl.sum().item())
                clipped += int(terms.clipped.sum())
                tokens += terms.kl.numel()
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), upd.grad_clip)))
            self.optimizer.step()
            losses.append(total)
        return {"loss": sum(losses) / len(losses), "kl": sum(kls) / max(1, tokens),
                "clip_fraction": clipped / max(1, tokens), "grad_norm": max(norms)}


_NO_UPDATE = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0}


def phase_of(phase: str, step: int, infill_steps: int) -> str:
    """The phase of step `step` (0-based): the schedule runs `infill_steps` infilling steps, then end-to-end."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if phase != "schedule":
        return phase
    return "infill" if step < infill_steps else "e2e"


__all__ = ["RLStats", "RLStep", "RolloutConfig", "RewardConfig", "Rollout", "UpdateConfig", "phase_of"]
