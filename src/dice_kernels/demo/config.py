"""`DemoConfig`: every knob of one `dice demo` run in one typed place, with a preset per scale (cpu: ~26 minutes
of two idle cores, docs/demo.md; gpu: one GPU in under half an hour). The CLI picks a preset and applies `--set`
overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

SCALES = ("cpu", "gpu")


@dataclass
class WorldSection:
    seed: int = 0
    n_train: int = 1500  # training tasks (SFT pairs and RL task sets)
    n_heldout: int = 24  # benchmark tasks: families never seen in training
    heldout_fraction: float = 0.2  # share of multi-step families held out


@dataclass
class ModelShape:
    """A Qwen3-shaped block-diffusion decoder small enough to learn the world from scratch."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 4096  # the BPE's budget; the model's vocabulary is what the BPE learned, rounded up to 64


@dataclass
class SFTSection:
    steps: int = 1500  # at 720 (loss 0.30) the model did not yet read the prompt: 0 of 24 held-out tasks
    batch_rows: int = 8  # packed rows per step (small: more optimizer steps for the same compute)
    export_every: int = 0  # also export a checkpoint every this many steps (0: only the final one)
    lr: float = 3e-3  # from scratch: far above DICE's 1e-5 for a pretrained model
    # packed row length; 0: the longest sample, one sample a row (dense attention costs the square of the row)
    row_tokens: int = 0


@dataclass
class RLSection:
    infill_steps: int = 3  # BiC-RL phase 1
    e2e_steps: int = 3  # phase 2 (and the whole of the SFT + e2e RL arm)
    tasks_per_step: int = 4
    group: int = 4  # rollouts per task
    # a from-scratch model far from DICE's pretrained one: a few steps at DICE's 1e-6 would not move it
    lr: float = 1e-4
    temperature: float = 0.7  # below DICE's 1.0: a small model's samples at 1.0 rarely compile, so groups are flat


@dataclass
class BenchSection:
    samples: int = 1  # greedy generations per held-out task
    max_new_tokens: int = 112  # the longest template solution is ~103 tokens


@dataclass
class DemoConfig:
    out: Path = Path("runs/demo")
    scale: str = "cpu"
    progress: bool = True  # progress bars (else log lines)
    backend: str = "cpu"  # harness backend: cpu runs the C++ solutions, cuda the CUDA ones
    world: WorldSection = field(default_factory=WorldSection)
    model: ModelShape = field(default_factory=ModelShape)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    bench: BenchSection = field(default_factory=BenchSection)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.scale not in SCALES:
            raise ValueError(f"--scale must be one of {', '.join(SCALES)}, not {self.scale!r}")


def preset(scale: str, out: Path) -> DemoConfig:
    """The settings of one scale; the gpu preset trains a larger model longer and evaluates CUDA kernels."""
    cfg = DemoConfig(out=out, scale=scale)
    if scale == "gpu":
        cfg = dataclasses.replace(
            cfg, backend="cuda",
            world=WorldSection(n_train=4000, n_heldout=32),
            model=ModelShape(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                             num_key_value_heads=2, head_dim=64),
            # stopped early: at 2,000 steps (loss 5e-5) every RL rollout was correct, so RL had nothing to learn;
            # at 800, 31-50 % of the RL rollouts were correct, so RL groups have reward variance
            sft=SFTSection(steps=800, batch_rows=32, lr=2e-3),
            # every distinct rollout is a CUDA build (~20 s of nvcc): 16 rollouts are one round on 16 cores. lr 2e-4
            # is where SFT's cosine ends, so a few RL steps move the model as much as the last SFT steps did
            rl=RLSection(infill_steps=2, e2e_steps=3, tasks_per_step=4, group=4, lr=2e-4),
        )
    return cfg


def load_config(scale: str, out: Path, overrides: list[str], progress: bool = True) -> DemoConfig:
    """The scale's preset with `--set key=value` overrides (an unknown key is an error that names it)."""
    from dice_kernels.train.config import apply_override, from_dict, to_dict

    if scale not in SCALES:
        raise ValueError(f"--scale must be one of {', '.join(SCALES)}, not {scale!r}")
    data = to_dict(preset(scale, out)) | {"progress": progress}
    for override in overrides:
        apply_override(data, DemoConfig, override)
    return from_dict(DemoConfig, data)
