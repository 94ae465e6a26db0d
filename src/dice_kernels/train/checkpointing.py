"""Where a trainer's weights go (the initial model comes from model_setup.py): resumable states (model,
optimizer, trainer state, RNG) written with torch.distributed.checkpoint under <out_dir>/checkpoints/step-N;
Hugging Face exports gathered on rank 0; a trainer loop's save schedule (`RunSaves`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dice_kernels.model.checkpoint import save_model
from dice_kernels.model.transformer import BlockDiffusionLM
from dice_kernels.train.config import CheckpointConfig
from dice_kernels.train.distributed import Dist, barrier

CHECKPOINTS = "checkpoints"
STATE_FILE = "train_state.json"  # written last: a step directory without it was never finished
PARTIAL = ".partial"


# --------------------------------------------------------------------------- resumable states


def _step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / CHECKPOINTS / f"step-{step:08d}"


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """Finished resumable states, oldest first (a save killed half-way has no train_state.json, or is .partial)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.suffix != PARTIAL and (p / STATE_FILE).is_file())


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def _states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def save_state(out_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
               dist: Dist, keep: int) -> Path:
    """Write a resumable state for `step` (collective: every rank calls it).

    Sharded model and optimizer through DCP, each rank's RNG, and `trainer_state` (JSON: data position,
    scheduler, anything the trainer needs to continue exactly). The directory is renamed into place only once
    complete, so a kill at any moment leaves the previous state usable. Keeps the newest `keep` states.
    """
    import torch.distributed.checkpoint as dcp

    final = _step_dir(out_dir, step)
    partial = final.with_suffix(PARTIAL)
    if dist.is_main:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
        partial.mkdir(parents=True)
    barrier()
    dcp.save(_states(model, optimizer), checkpoint_id=partial)
    torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if dist.device.type == "cuda"
                else None}, partial / f"rng-rank{dist.rank}.pt")
    barrier()
    if dist.is_main:
        (partial / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in complete_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, dist: Dist) -> dict:
    """Restore model, optimizer and this rank's RNG from a `save_state` directory; return its trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    states = _states(model, optimizer)
    dcp.load(states, checkpoint_id=path)
    set_model_state_dict(model, states["model"])
    set_optimizer_state_dict(model, optimizer, states["optim"])
    rng_file = path / f"rng-rank{dist.rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved: RNG then restarts from the seed
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and dist.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / STATE_FILE).read_text())


# --------------------------------------------------------------------------- Hugging Face export


def export_hf(model: BlockDiffusionLM, directory: Path, tokenizer_dir: str | Path, dtype: str, dist: Dist) -> Path:
    """Gather the full state dict on rank 0 and write a Hugging Face directory that model/checkpoint.py
    `load_model` and `dice generate` read (collective: every rank calls it). Written beside, then renamed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main:
        cfg = replace(model.config, dtype=dtype)
        with torch.device("meta"):
            plain = BlockDiffusionLM(cfg)
        plain.load_state_dict({k: v.to(cfg.torch_dtype) for k, v in full.items()}, assign=True)
        plain.tie_weights()
        partial = directory.with_name(directory.name + PARTIAL)
        shutil.rmtree(partial, ignore_errors=True)
        save_model(plain, partial, tokenizer_dir=tokenizer_dir)
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
    del full
    barrier()
    return directory


# --------------------------------------------------------------------------- a trainer loop's saves


@dataclass
class RunSaves:
    """When a trainer's loop writes: a resumable state every `cfg.every_steps`, a Hugging Face export every
    `cfg.export_every_steps`, both at the end, and the debug kill after `sigkill_after_step` (resume tests).
    `trainer_state(step)` is the loop's own JSON state (data or curriculum position, schedule)."""

    out: Path
    model: BlockDiffusionLM
    optimizer: torch.optim.Optimizer
    dist: Dist
    cfg: CheckpointConfig
    tokenizer_dir: str
    trainer_state: Callable[[int], dict]
    sigkill_after_step: int = 0

    def after_step(self, done: int, total: int) -> None:
        """Collective: every rank calls it after each of the `total` steps (`done` of them finished)."""
        ck = self.cfg
        if ck.every_steps and done % ck.every_steps == 0 and done < total:
            save_state(self.out, done, self.model, self.optimizer, self.trainer_state(done), self.dist, ck.keep)
        if ck.export_every_steps and done % ck.export_every_steps == 0 and done < total:
            export_hf(self.model, self.out / "export" / f"step-{done:08d}", self.tokenizer_dir, ck.export_dtype,
                      self.dist)
        if self.sigkill_after_step == done:
            os.kill(os.getpid(), signal.SIGKILL)  # as a crash would: no cleanup, nothing flushed

    def finish(self, total: int, trained: bool) -> Path:
        """The final resumable state (skipped when this run trained nothing past the newest one) and export;
        returns the export's directory (written only when `cfg.at_end`)."""
        final = self.out / "final"
        if self.cfg.at_end:
            if trained:
                save_state(self.out, total, self.model, self.optimizer, self.trainer_state(total), self.dist,
                           self.cfg.keep)
            export_hf(self.model, final, self.tokenizer_dir, self.cfg.export_dtype, self.dist)
        return final
