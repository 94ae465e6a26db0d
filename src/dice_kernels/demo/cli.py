"""`dice demo`: the command (registered in dice_kernels/cli.py); it fills a DemoConfig and calls demo/run.py."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console(stderr=True)


def demo(
    scale: str = typer.Option("cpu", "--scale", help="cpu: a small model, C++ kernels, SFT + one RL arm, ~20 "
                              "minutes on 2 idle cores; gpu: a larger model, CUDA kernels, five arms on one GPU."),
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Run folder; running again with the same folder "
                             "resumes (each finished stage is skipped)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Override a setting, e.g. --set sft.steps=100 "
                                             "--set world.n_heldout=8 --set arms=sft,e2e_dice (sections: world, model, "
                                             "sft, rl, bench; arms: demo/config.py's ARMS)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars (else log lines)."),
) -> None:
    """The whole recipe at small scale, as an experiment: build a verified synthetic task world, train a tokenizer,
    SFT a small block-diffusion model from scratch, run the RL arms from it (end-to-end RL or BiC-RL, DICE's reward
    or ours), benchmark each with the robust check on held-out instances of trained families, and report Exec with
    95 % intervals and paired differences between arms. Writes OUT/report.md, report.json and curves.png.

    \b
    dice demo                      # CPU scale
    dice demo --scale gpu --out runs/demo-gpu
    """
    from dice_kernels.demo.config import load_config
    from dice_kernels.demo.run import run_demo, stop_on_sigterm
    from dice_kernels.config_io import ConfigError

    try:
        cfg = load_config(scale, out, set_ or [], progress)
    except ConfigError as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2)
    try:
        with stop_on_sigterm():
            run_demo(cfg, echo=lambda m: console.print(m, highlight=False))
    except KeyboardInterrupt as e:
        console.print(f"[bold yellow]stopped[/] ({e or 'interrupted'}): run the same command again to resume")
        raise typer.Exit(130)
