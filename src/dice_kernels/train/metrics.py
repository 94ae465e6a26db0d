"""What a run shows and keeps: a rich progress bar (step, loss, tokens/s, ETA), metrics.jsonl in the run directory
(the record every plot and comparison reads), TensorBoard and W&B when available, a loss-curve PNG at the end.
Only rank 0 writes; on other ranks a `Metrics` does nothing."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from dice_kernels.train.config import MetricsConfig

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss_curve.png"


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Metrics:
    """Per-step scalars to JSONL / TensorBoard / W&B, and the progress bar. Use as a context manager.

    `start_step` > 0 (a resumed run) drops the records of steps after it, which the killed run logged but never
    saved, so metrics.jsonl stays one curve.
    """

    def __init__(self, out_dir: Path, cfg: MetricsConfig, total_steps: int, start_step: int = 0,
                 enabled: bool = True, run_config: dict | None = None, console: Console | None = None):
        self.out_dir, self.cfg, self.enabled = Path(out_dir), cfg, enabled
        self.total, self.start = total_steps, start_step
        self.console = console or Console(stderr=True)
        self._tb = self._wandb = self._progress = self._task = None
        self._began = time.monotonic()
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.out_dir) if r.get("step", 0) <= start_step]
        path = self.out_dir / METRICS_FILE
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = path.open("a")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_step + 1)
            except ImportError:
                self.console.print("[yellow]tensorboard is not installed: no TensorBoard logs "
                                   "(pip install 'dice-kernels[train]')[/]")
        if cfg.wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=cfg.wandb_project, name=self.out_dir.name, config=run_config,
                                         dir=str(self.out_dir), resume="allow")
            except ImportError:
                self.console.print("[yellow]wandb is not installed: metrics.wandb_project ignored[/]")

    def __enter__(self) -> Metrics:
        if self.enabled and self.cfg.progress and self.console.is_terminal:  # logs (torchrun, CI) get lines
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                      TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=self.console)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start, loss="-", tps="-")
        return self

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record the scalars of optimizer step `step` (1-based) and advance the progress bar."""
        if not self.enabled:
            return
        record = {"step": step, **values, "time": round(time.monotonic() - self._began, 3)}
        if step % self.cfg.log_every == 0 or step == self.total:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._tb is not None:
                for k, v in values.items():
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        self._tb.add_scalar(f"train/{k}", v, step)
            if self._wandb is not None:
                self._wandb.log(values, step=step)
            if self._progress is None:
                self.console.print(f"step {step}/{self.total} " + " ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()))
        if self._progress is not None:
            loss, tps = values.get("loss"), values.get("tokens_per_s")
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}" if loss is not None else "-",
                                  tps=f"{tps:,.0f}" if tps is not None else "-")

    def note(self, message: str) -> None:
        """A line for the user (rank 0 only), above the progress bar."""
        if self.enabled:
            self.console.print(message)

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self.cfg.plot and exc[0] is None:
            path = plot_loss(self.out_dir)
            if path is not None:
                self.console.print(f"loss curve: {path}")


def plot_loss(out_dir: Path, key: str = "loss") -> Path | None:
    """loss_curve.png from metrics.jsonl; None (and nothing written) without matplotlib or records."""
    records = [r for r in read_metrics(out_dir) if key in r]
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r[key] for r in records], lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(key)
    ax.set_title(f"{Path(out_dir).name}: {key}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(out_dir) / PLOT_FILE
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
