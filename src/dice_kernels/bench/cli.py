"""`dice bench`: a checkpoint (or a folder of generations) to the paper's KernelBench table, and `dice bench compare`.
Thin: it fills in `BenchConfig` and calls `run.run`; heavy imports happen inside the commands."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from dice_kernels.cli_errors import fail, need_extra
from dice_kernels.harness.cli_options import eval_options

app = typer.Typer(add_completion=False, invoke_without_command=True)  # help: the callback's docstring
console = Console(stderr=True)


@app.callback()
@eval_options
def bench(
    ctx: typer.Context,
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", "-c",
                                             help="Block-diffusion (SDAR) checkpoint directory to generate with, "
                                                  "or a Hub id (JetLM/SDAR-4B-Chat) already in the Hugging Face "
                                                  "cache."),
    generations: Optional[Path] = typer.Option(None, "--generations", "-g", file_okay=False,
                                               help="Instead of generating: a folder of any model's outputs (.md, "
                                                    ".txt or .py), paired to tasks by name (level1/19_ReLU/s0.md, "
                                                    "19_ReLU_s3.py, ...)."),
    tasks: Optional[Path] = typer.Option(None, "--tasks", help="KernelBench checkout or level folder, task "
                                         "directory, or JSONL (e.g. ../shared/data/kernelbench/tasks.jsonl). "
                                         "Default: the two example tasks shipped with the package."),
    level: list[int] = typer.Option([], "--level", "-l", help="Keep only this KernelBench level (repeatable)."),
    task: list[str] = typer.Option([], "--task", "-t", help="Keep only this task, by id (L1/19) or name "
                                   "(19_ReLU) (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run folder. Running again with the same folder "
                                       "resumes: nothing generated or evaluated is done again. "
                                       "Default: runs/bench-<time>."),
    samples: int = typer.Option(1, "--samples", "-k", help="Generations per task; the report adds pass@k for "
                                "k = 1, 5, 10 and K (only meaningful with --temperature > 0)."),
    batch_size: int = typer.Option(32, "--batch-size", "-b", help="Prompts decoded at once (rows of the batch); a "
                                   "row whose output ended takes the next waiting prompt."),
    max_new_tokens: int = typer.Option(4096, help="Stop each generation after this many tokens (DICE: 4,096)."),
    block_size: int = typer.Option(4, help="Tokens per diffusion block (DICE: 4)."),
    steps: int = typer.Option(4, help="Denoising forwards per block (DICE: 4, i.e. 1 token per forward)."),
    strategy: str = typer.Option("static", help="Remasking: static, dynamic or sequential (DICE evaluates static)."),
    threshold: float = typer.Option(0.9, help="Confidence threshold of the dynamic strategy."),
    temperature: float = typer.Option(0.0, help="0 = greedy (DICE's evaluation setting)."),
    top_k: int = typer.Option(0, help="Sample among the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1 = off)."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling (temperature > 0)."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--eager", help="Replay the decode step as CUDA graphs "
                                     "(GPU only; --eager launches every kernel from Python)."),
    compile_layers: bool = typer.Option(False, "--compile/--no-compile", help="Fuse each layer's norms, RoPE "
                                        "and element-wise work, attend through a flex-decoding kernel and pick "
                                        "greedy tokens in one fused reduction, with torch.compile (CUDA only; "
                                        "batch 128 on an H200: 8,666 tokens/s against 6,684 without; the first "
                                        "call compiles and autotunes; bf16 rounding may change tokens)."),
    dtype: str = typer.Option("auto", help="Model weights: auto (the checkpoint's on GPU, float32 on CPU), "
                              "bfloat16, float16 (DICE), float32."),
    device: str = typer.Option("auto", help="Where the model generates: cuda, cpu, cuda:1 ... (auto: cuda when "
                               "present)."),
    stage: str = typer.Option("all", help="all; generate (stop after generating, e.g. to evaluate elsewhere); "
                              "evaluate (evaluate the generations already written)."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", show_default="bars on a terminal",
                                            help="Progress bars, or a line per generated output and evaluated "
                                                 "candidate (for logs). Default: bars when stdout is a terminal."),
    eval_config=None,  # the harness's options, the same as `dice eval`'s (harness/cli_options.py)
) -> None:
    """Generate kernels for KernelBench tasks with a checkpoint (or take any model's outputs), evaluate them in the
    sandboxed harness and write the DICE paper's table: Exec / fast_1 / fast_2 per level, Exec before and after the
    robust check, failure modes per level, generation tokens/s and the time split (report.md, report.png).

    \b
    Examples:
      dice bench -c ckpt/DICE-4B --tasks KernelBench/KernelBench --out runs/dice4b
      dice bench -c ckpt/DICE-4B --tasks ../shared/data/kernelbench/tasks.jsonl --level 1 --max-new-tokens 512
      dice bench -g outputs/gpt --tasks KernelBench/KernelBench --out runs/gpt
      dice bench -c ckpt/tiny --backend cpu --out runs/smoke          # the two shipped examples, on a CPU
      dice bench compare runs/dice4b runs/gpt
    """
    if ctx.invoked_subcommand is not None:
        return
    from dice_kernels.bench.config import BenchConfig
    from dice_kernels.bench.run import run
    from dice_kernels.sampling.decoder import SamplingConfig
    from dice_kernels.tasks import TaskError

    from dice_kernels.model.checkpoint import CheckpointError, resolve_checkpoint

    for flag, path in (("--generations", generations), ("--tasks", tasks)):
        if path is not None and not path.exists():
            fail(f"{flag} {path}: no such file or directory")
    try:
        folder = resolve_checkpoint(checkpoint) if checkpoint is not None else None
    except CheckpointError as e:
        fail(f"--checkpoint {e}")
    if folder is not None:
        need_extra("model", "dice bench --checkpoint")
    try:
        decoding = SamplingConfig(max_new_tokens=max_new_tokens, block_size=block_size, steps=steps,
                                  strategy=strategy, threshold=threshold, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, cuda_graphs=cuda_graphs,
                                  compile=compile_layers)
        cfg = BenchConfig(out=out or Path("runs") / f"bench-{datetime.now():%Y%m%d-%H%M%S}", checkpoint=folder,
                          generations=generations, tasks=tasks, levels=tuple(level), task_filter=tuple(task),
                          samples=samples, batch_size=batch_size, decoding=decoding, dtype=dtype, device=device,
                          stage=stage, eval=eval_config)
        cfg.check()
    except ValueError as e:
        fail(str(e))
    if samples > 1 and temperature == 0:
        console.print("[yellow]--samples > 1 with greedy decoding (--temperature 0) gives identical samples[/]")
    import torch

    try:
        summary = run(cfg, progress=sys.stdout.isatty() if progress is None else progress, echo=console.print)
    except (ValueError, TaskError, FileNotFoundError) as e:
        fail(str(e))
    except torch.OutOfMemoryError:
        fail(f"out of memory while generating batches of {batch_size}: lower --batch-size (or --max-new-tokens) "
              f"and run the same command again; the generations already written in {cfg.out} are kept")
    if summary is None:
        console.print(f"generations written under {cfg.out / 'generations'}; evaluate them with "
                      f"`dice bench ... --out {cfg.out} --stage evaluate`")
        return
    _print_table(summary)
    console.print(f"report: {cfg.out / 'report.md'}")


def _print_table(summary: dict) -> None:
    from rich.table import Table

    table = Table(title="Exec / fast_1 / fast_2 (%, vs PyTorch eager)")
    for col in ("level", "n", "Exec before robust", "Exec", "fast_1", "fast_2"):
        table.add_column(col, justify="right")
    for level, m in summary["metrics"].items():
        table.add_row(level, str(m["n"]), *(f"{100 * x:.1f}" for x in (
            m["exec_before_robust"], m["exec_rate"], m["fast"]["fast_1"], m["fast"]["fast_2"])))
    Console().print(table)
    t = summary["time"]
    console.print(f"time: generation {t['generate_s']:.1f} s ({t['tokens_per_s'] or 0:,.1f} tokens/s), "
                  f"evaluation {t['evaluate_s']:.1f} s")


@app.command("compare")
def compare_cmd(
    run_a: Path = typer.Argument(..., help="A `dice bench --out` folder."),
    run_b: Path = typer.Argument(..., help="Another one."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Also write the comparison to this Markdown file."),
) -> None:
    """Two bench runs side by side: their tables, then each task's outcome and speedup (or k/n correct)."""
    from dice_kernels.report.bench_report import compare

    try:
        text = compare(run_a, run_b)
    except FileNotFoundError as e:
        fail(str(e))
    typer.echo(text)
    if out is not None:
        out.write_text(text)
