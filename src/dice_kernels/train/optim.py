"""AdamW over the (sharded) parameters and the learning-rate schedule: linear warm-up, then constant (DICE's SFT and
RL) or cosine. The schedule is a LambdaLR, so its state is saved and restored with the rest."""

from __future__ import annotations

import math

import torch
from torch import nn

from dice_kernels.train.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW: fused on CUDA (one kernel pass over weights, gradients and moments, no temporaries; the same
    state keys as foreach), foreach on CPU."""
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=not fused, fused=fused)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The lr multiplier for 0-based optimizer step `step` (warm-up steps: ceil(fraction x total))."""
    warmup = math.ceil(cfg.warmup_fraction * total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.min_lr_fraction + (1 - cfg.min_lr_fraction) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                    cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global gradient norm over all ranks (DTensor-aware); clipped to `max_norm` unless it is 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
