"""The sections every trainer's run config shares (model, optim, parallel, checkpoint, metrics, debug). A stage
composes them into its own root config (sft/trainer.py's SFTConfig, rl/config.py's RLConfig), so each setting has
one typed place; loading, `--set` overrides, saving and finding the shipped configs (configs/<stage>/<name>.toml)
are dice_kernels/config_io.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dice_kernels.config_io import ConfigError


# --------------------------------------------------------------------------- shared sections


@dataclass
class ModelSection:
    """Where the weights come from: a Hugging Face checkpoint directory, or random init of a named shape
    ("tiny", or the SDAR shapes "1.7B", "4B", "8B" for benchmarks) with a tokenizer directory."""

    checkpoint: str = ""  # HF directory (config.json, safetensors, tokenizer files)
    shape: str = ""  # random init instead of a checkpoint
    tokenizer: str = ""  # tokenizer directory; default: the checkpoint directory
    seed: int = 0  # random init only

    def __post_init__(self) -> None:
        if bool(self.checkpoint) == bool(self.shape):
            raise ConfigError("model: set exactly one of model.checkpoint (a Hugging Face directory) or model.shape "
                              "(random init: tiny, 1.7B, 4B, 8B)")
        if self.shape and not self.tokenizer:
            raise ConfigError("model.shape needs model.tokenizer (a directory with tokenizer.json)")

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.checkpoint


@dataclass
class OptimConfig:
    """AdamW with linear warm-up, then a constant (DICE) or cosine learning rate; global-norm gradient clipping."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_fraction: float = 0.03  # of the total optimizer steps (DICE: 3 %)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_fraction: float = 0.0  # cosine only: the final lr as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; 0 = off

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"optim.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass
class ParallelConfig:
    """How one step runs: FSDP2 over all ranks (always, also for one process), mixed precision, activation
    checkpointing, and the attention kernel."""

    mixed_precision: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    attention: Literal["auto", "flex", "dense"] = "auto"  # auto: flex on CUDA, dense on CPU (no CPU flex backward)


@dataclass
class CheckpointConfig:
    """Resumable states (torch.distributed.checkpoint) under <out_dir>/checkpoints, HF exports under
    <out_dir>/export/step-N and <out_dir>/final."""

    every_steps: int = 200  # resumable save interval; 0 = only at the end
    keep: int = 2  # resumable states kept (older ones are deleted)
    export_every_steps: int = 0  # periodic HF export; 0 = only the final one
    export_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    at_end: bool = True  # a resumable state and the final export when training ends (off: throughput runs)

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.export_every_steps < 0 or self.keep < 1:
            raise ConfigError("checkpoint.every_steps and export_every_steps must be >= 0, checkpoint.keep >= 1")


@dataclass
class MetricsConfig:
    """metrics.jsonl always; TensorBoard and W&B optional; a loss-curve PNG at the end."""

    log_every: int = 1
    progress: bool = True  # rich progress bar on a terminal (else, and in logs, a line per log_every steps)
    tensorboard: bool = True  # needs the `tensorboard` package; skipped with a note when absent
    wandb_project: str = ""  # "" = off; needs the `wandb` package
    plot: bool = True  # loss_curve.png (needs matplotlib)

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ConfigError(f"metrics.log_every must be >= 1, got {self.log_every}")


@dataclass
class DebugConfig:
    """Fault injection for tests of resumption."""

    sigkill_after_step: int = 0  # the process kills itself (SIGKILL, as a crash would) after this step; 0 = off
