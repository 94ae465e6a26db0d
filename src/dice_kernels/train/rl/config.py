"""`dice train rl`'s run config: `RLConfig`, the whole run's, composed of the trainers' shared sections
(train/config.py) and RL's own: the task sets (`RLTasksConfig`), the phases and their steps (`RLLoopConfig`), the
rollouts (`RolloutConfig`), the TraceRL update (`UpdateConfig`) and the reward (rl/reward.py's `RewardConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dice_kernels.config_io import ConfigError
from dice_kernels.sampling.decoder import SamplingConfig
from dice_kernels.train.config import (CheckpointConfig, DebugConfig, MetricsConfig, ModelSection, OptimConfig,
                                       ParallelConfig)
from dice_kernels.train.rl.curriculum import ORDERS
from dice_kernels.train.rl.reward import RewardConfig


@dataclass
class RLTasksConfig:
    infill: str = ""  # infilling task set: `dice data`'s rl_infill table, or a task directory (with solutions)
    e2e: str = ""  # end-to-end task set: rl_e2e table, or a KernelBench task directory / JSONL
    solutions: str = ""  # infilling from a task directory: programs to cut prefix / suffix from
    order: str = "sequential"  # sequential (by level, wrapping, as DICE) | mixed (reshuffled each pass)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ConfigError(f"tasks.order must be one of {ORDERS}, got {self.order!r}")


@dataclass
class RLLoopConfig:
    phase: Literal["infill", "e2e", "schedule"] = "schedule"  # schedule: infill_steps, then e2e_steps
    infill_steps: int = 20
    e2e_steps: int = 100

    def __post_init__(self) -> None:
        if self.infill_steps < 0 or self.e2e_steps < 0:
            raise ConfigError("rl.infill_steps and rl.e2e_steps must be >= 0")

    @property
    def total_steps(self) -> int:
        return {"infill": self.infill_steps, "e2e": self.e2e_steps}.get(self.phase, self.infill_steps + self.e2e_steps)

    def phase_of(self, step: int) -> str:
        """The phase of 0-based step `step`."""
        if self.phase != "schedule":
            return self.phase
        return "infill" if step < self.infill_steps else "e2e"


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
    batch_rows: int = 64  # responses decoded together (per rank)
    seed: int = 0
    # CUDA: decode through the compiled decoder (fused layer regions and flex over the KV cache in place, then CUDA
    # graphs: `SamplingConfig.compile`); the first step pays its compiles. Ignored on CPU
    compile: bool = False
    # compiled, with batch_rows = tasks_per_step x group (no row takes a second prompt): each forward reads a group's
    # prompt K/V once per few rows instead of once per row (`SamplingConfig.share_prompts`; the 1.7B step's rollouts
    # 1.22x faster on an H100, docs/bench.md). Tokens may differ from unshared decoding by bf16 rounding
    share_prompts: bool = True
    # rollouts read the trained model's own gathered weights in place (`PolicyView`) instead of a copy refreshed each
    # step (`PolicySnapshot`), which stays allocated through the update (SDAR-4B: 7.5 GiB of bf16). The same tokens as
    # the copy (tests/e2e/test_rl_policy_view.py, CPU and GPU); the 1.7B step on an H100 held 7.0 GiB after its
    # rollouts instead of 10.2 at the same speed (docs/rl.md)
    share_weights: bool = True
    # every step's rollouts (text, reward, candidate id) in <out_dir>/rollouts/step-NNNNN.rankR.jsonl.gz: what the
    # policy wrote, to read and to score again (~1 KB a rollout gzipped)
    save_texts: bool = True

    def __post_init__(self) -> None:
        if min(self.tasks_per_step, self.group, self.max_new_tokens, self.batch_rows, self.steps) < 1:
            raise ConfigError("rollout.tasks_per_step, group, max_new_tokens, batch_rows and steps must be >= 1")
        if self.temperature <= 0:
            raise ConfigError("rollout.temperature must be > 0: RL samples (greedy rollouts of a group are identical)")

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=self.max_new_tokens, block_size=self.block_size, steps=self.steps,
                              strategy=self.strategy, threshold=self.threshold, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed, compile=self.compile,
                              share_prompts=self.share_prompts)


@dataclass
class UpdateConfig:
    clip: float = 0.2  # PPO ratio clip
    kl_beta: float = 0.01  # k3 KL to the rollout (old) policy
    micro_rows: int = 8  # trajectories per scoring forward (gradient accumulation inside an optimizer step)
    # optimizer steps per RL step, against log-probs frozen at the step's start (so the clip and KL act from the
    # second on): the step's trained responses are split into this many parts ...
    updates_per_step: int = 1
    # ... or, when > 0, one optimizer step per this many replayed rows, a row being one response at one denoising
    # step (DICE: 256 = batch 1 x 8 ranks x accumulation 32), at most one per trained response
    rows_per_update: int = 0
    # a fresh optimizer state (AdamW moments) at every RL step, as DICE's per-step process that reloads the
    # weights has; False keeps the moments across steps
    reset_optimizer: bool = False

    def __post_init__(self) -> None:
        if (self.micro_rows < 1 or self.updates_per_step < 1 or self.rows_per_update < 0 or not 0 < self.clip < 1
                or self.kl_beta < 0):
            raise ConfigError("update.micro_rows and updates_per_step must be >= 1, update.rows_per_update >= 0, "
                              "update.clip in (0, 1), update.kl_beta >= 0")


@dataclass
class RLConfig:
    out_dir: str = "runs/rl"
    model: ModelSection = field(default_factory=ModelSection)
    tasks: RLTasksConfig = field(default_factory=RLTasksConfig)
    rl: RLLoopConfig = field(default_factory=RLLoopConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, warmup_fraction=0.0))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_steps=10))
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
