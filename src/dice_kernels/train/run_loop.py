"""What both trainers (sft/trainer.py, rl/trainer.py) do around their steps: every rank joins the process group
for the run and leaves it after (`run_on_ranks`); a run directory that already holds resumable states is only
continued with --resume (`previous_state`); rank 0 saves and shows the full config (`announce_config`); a resumed
run loads its newest state (`resumed_state`); and the run's metrics are kept on rank 0 (`run_metrics`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from dice_kernels import config_io
from dice_kernels.train.checkpointing import latest_checkpoint, load_state
from dice_kernels.train.distributed import Dist, init_distributed, shutdown
from dice_kernels.train.metrics import Metrics


def run_on_ranks(run: Callable[[Any, bool, Dist, Console], Path], cfg: Any, resume: bool,
                 console: Console | None) -> Path:
    """`run(cfg, resume, dist, console)` inside the process group (collective: every rank calls it)."""
    dist = init_distributed()
    try:
        return run(cfg, resume, dist, console or Console(stderr=True))
    finally:
        shutdown()


def previous_state(out: Path, resume: bool, error: type[Exception]) -> Path | None:
    """The newest resumable state in `out` (None when there is none); `error` when there is one and the run was
    not asked to resume it."""
    previous = latest_checkpoint(out)
    if previous is not None and not resume:
        raise error(f"{out} already holds resumable states (newest {previous.name}): pass --resume to continue "
                    "that run, or set out_dir to a new directory")
    return previous


def announce_config(cfg: Any, out: Path, dist: Dist, say: Callable[..., None]) -> None:
    """Rank 0 writes the full config to <out>/config.toml and shows it."""
    if dist.is_main:
        config_io.save(cfg, out)
        say(f"[bold]config[/] ({out / 'config.toml'}):")
        say(config_io.to_toml(cfg), markup=False, highlight=False)


def resumed_state(previous: Path | None, resume: bool, out: Path, model, optimizer, dist: Dist,
                  say: Callable[..., None]) -> dict | None:
    """The trainer state of `previous`, loaded into `model` and `optimizer`, when resuming; None otherwise (a
    resume with nothing to resume says so and starts from step 0)."""
    if resume and previous is not None:
        return load_state(previous, model, optimizer, dist)
    if resume:
        say(f"[yellow]no resumable state in {out}: starting from step 0[/]")
    return None


def run_metrics(cfg: Any, out: Path, total: int, start: int, dist: Dist, console: Console) -> Metrics:
    """The run's metrics (kept by rank 0), from step `start` of `total`, with the full config as the run's."""
    return Metrics(out, cfg.metrics, total, start, enabled=dist.is_main, run_config=config_io.to_dict(cfg),
                   console=console)
