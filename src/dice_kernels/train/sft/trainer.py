"""`dice train sft`: supervised fine-tuning of a block-diffusion model on CuKe rows with the SDAR objective
(objective.py). `SFTConfig` is the whole run's config; `run_sft` is the loop every rank runs (torchrun or a single
process): build, resume, step, log, save, export."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from dice_kernels.config_io import ConfigError
from dice_kernels.train.checkpointing import RunSaves
from dice_kernels.train.config import (CheckpointConfig, DebugConfig, MetricsConfig, ModelSection, OptimConfig,
                                       ParallelConfig)
from dice_kernels.train.distributed import Dist, all_reduce_sum, attention_backend
from dice_kernels.train.model_setup import build_model, load_tokenizer_for, model_config, pad_token_id
from dice_kernels.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from dice_kernels.train.run_loop import announce_config, previous_state, resumed_state, run_metrics, run_on_ranks
from dice_kernels.train.sft.data import SFTData, SFTDataConfig, StepData
from dice_kernels.train.sft.objective import Corruption, PackedBatch, corrupt, sft_loss


class TrainError(ValueError):
    """A run that cannot start as configured; the message names the setting or directory."""


@dataclass
class SFTLoopConfig:
    epochs: int = 3
    max_steps: int = 0  # > 0: stop after this many optimizer steps instead (the lr schedule spans them)
    global_batch_rows: int = 32  # packed rows per optimizer step, over all ranks
    micro_batch_rows: int = 1  # rows per forward/backward on one rank (the rest is gradient accumulation)
    seed: int = 0  # data order and noise

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.max_steps < 0 or self.global_batch_rows < 1 or self.micro_batch_rows < 1:
            raise ConfigError("train.epochs, global_batch_rows, micro_batch_rows must be >= 1 and max_steps >= 0")

    def accumulation(self, world_size: int) -> int:
        per_rank, rest = divmod(self.global_batch_rows, world_size * self.micro_batch_rows)
        if rest or not per_rank:
            raise TrainError(f"train.global_batch_rows ({self.global_batch_rows}) must be a multiple of "
                             f"train.micro_batch_rows ({self.micro_batch_rows}) x {world_size} ranks")
        return per_rank


@dataclass
class SFTConfig:
    out_dir: str = "runs/sft"
    model: ModelSection = field(default_factory=ModelSection)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTLoopConfig = field(default_factory=SFTLoopConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def _rows(batch: PackedBatch | Corruption, start: int, stop: int, device: torch.device):
    return type(batch)(**{k: v[start:stop].to(device, non_blocking=True) for k, v in vars(batch).items()})


def accumulate_gradients(model, batch: PackedBatch, corruption: Corruption, dist: Dist, micro_rows: int,
                         backend: str) -> torch.Tensor:
    """Forward and backward over this rank's share of the global batch, in micro-batches; returns this rank's
    part of the global loss (a device tensor: no wait for the GPU, so the caller can prepare the next batch).

    Every micro-batch's loss is scaled to (its sum of CE/p) / (response tokens of the *global* batch) x world
    size, so after FSDP's mean over ranks the gradient is that of the global batch's loss, whatever the number of
    ranks and micro-batches. With several ranks gradients are reduce-scattered after every micro-batch:
    accumulating them unsharded instead would hold 4 bytes per parameter on every GPU. One rank holds them whole
    anyway, so it accumulates (in fp32) and "reduces" once, after the last micro-batch.
    """
    block = model.config.block_size
    per_rank = batch.input_ids.shape[0] // dist.world_size
    first = dist.rank * per_rank
    total_response = max(int(batch.response.sum()), 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=dist.device)
    for start in range(first, first + per_rank, micro_rows):
        if dist.world_size == 1:
            model.set_requires_gradient_sync(start + micro_rows >= first + per_rank)
        micro = _rows(batch, start, start + micro_rows, dist.device)
        micro_noise = _rows(corruption, start, start + micro_rows, dist.device)
        loss = sft_loss(model, micro, micro_noise, block, backend)  # / this micro-batch's response tokens
        weighted = loss * micro.response.sum() / total_response
        (weighted * dist.world_size).backward()
        loss_sum += weighted.detach()
    return loss_sum


def _prepare(data: SFTData, step: int, mask_id: int, seed: int) -> tuple[StepData, Corruption]:
    """The global batch of `step` and its corruption, drawn on the CPU from (seed, step) alone: the same on every
    rank, for any number of ranks, and after a resume."""
    step_data = data.step(step)
    return step_data, corrupt(step_data.batch, mask_id, torch.Generator().manual_seed(seed * 1_000_003 + step))


def run_sft(cfg: SFTConfig, resume: bool = False, console: Console | None = None) -> Path:
    """Train as configured (collective: every rank runs it) and return the final export's directory."""
    return run_on_ranks(_run, cfg, resume, console)


def _run(cfg: SFTConfig, resume: bool, dist: Dist, console: Console) -> Path:
    out = Path(cfg.out_dir)
    say = console.print if dist.is_main else (lambda *a, **k: None)
    previous = previous_state(out, resume, TrainError)
    accumulation = cfg.train.accumulation(dist.world_size)
    announce_config(cfg, out, dist, say)

    tokenizer = load_tokenizer_for(cfg.model)
    mcfg = model_config(cfg.model, tokenizer)  # checks the mask token before anything is loaded
    data = SFTData.load(cfg.data, tokenizer, mcfg.block_size, pad_token_id(tokenizer), cfg.train.global_batch_rows,
                        cfg.train.seed)
    total = cfg.train.max_steps or data.total_steps(cfg.train.epochs)
    s = data.stats
    say(f"data: {s.rows} rows -> {len(data.samples)} samples ({s.truncated} truncated, {s.dropped} dropped at "
        f"cutoff {cfg.data.cutoff}, overflow={cfg.data.overflow}), {s.tokens:,} tokens, "
        f"{len(data.epoch_rows(0))} rows of {data.row_len} per epoch; {total} steps of "
        f"{cfg.train.global_batch_rows} rows ({dist.world_size} rank(s) x {accumulation} x "
        f"{cfg.train.micro_batch_rows})")
    model = build_model(cfg.model, cfg.parallel, dist, tokenizer)
    backend = attention_backend(cfg.parallel, dist.device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, total, cfg.optim)

    start = 0
    state = resumed_state(previous, resume, out, model, optimizer, dist, say)
    if state is not None:
        if state["data_fingerprint"] != data.fingerprint:
            raise TrainError(f"{previous}: saved with other data or packing settings than this config's "
                             f"({cfg.data.path}); resume with the run's own config ({out / 'config.toml'})")
        scheduler.load_state_dict(state["scheduler"])
        start = state["step"]
        say(f"resumed from {previous} (step {start}, epoch {state['epoch']})")

    saves = RunSaves(out, model, optimizer, dist, cfg.checkpoint, cfg.model.tokenizer_dir,
                     lambda step: _trainer_state(data, scheduler, step), cfg.debug.sigkill_after_step)
    tokens_seen = 0
    with run_metrics(cfg, out, total, start, dist, console) as metrics:
        upcoming = _prepare(data, start, mcfg.mask_token_id, cfg.train.seed)
        clock = time.perf_counter()
        for step in range(start, total):
            step_data, noise = upcoming
            loss_sum = accumulate_gradients(model, step_data.batch, noise, dist, cfg.train.micro_batch_rows, backend)
            if step + 1 < total:  # built on the CPU while the GPU still runs this step's backward
                upcoming = _prepare(data, step + 1, mcfg.mask_token_id, cfg.train.seed)
            grad_norm = clip_grad_norm(model, cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            loss = all_reduce_sum(loss_sum, dist.device)
            seconds, clock = time.perf_counter() - clock, time.perf_counter()
            tokens_seen += step_data.tokens
            if not math.isfinite(loss):
                raise TrainError(f"step {step + 1}: loss is {loss}; lower optim.lr or check the data")
            done = step + 1
            values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": step_data.tokens / seconds,
                      "step_s": seconds, "tokens": step_data.tokens, "epoch": step_data.epoch}
            if dist.device.type == "cuda":
                values["max_memory_gib"] = torch.cuda.max_memory_allocated(dist.device) / 2**30
            metrics.log(done, values)
            saves.after_step(done, total)
            clock = time.perf_counter()  # a step's time excludes saving and exporting
        final = saves.finish(total, trained=start < total or previous is None)
        metrics.note(f"trained {total - start} step(s), {tokens_seen:,} tokens"
                     + (f"; Hugging Face export: {final}" if cfg.checkpoint.at_end else ""))
    return final


def _trainer_state(data: SFTData, scheduler, step: int) -> dict:
    epoch, in_epoch = data.position(step)
    return {"epoch": epoch, "step_in_epoch": in_epoch, "data_fingerprint": data.fingerprint,
            "scheduler": scheduler.state_dict()}
