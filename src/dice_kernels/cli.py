"""The `dice` command: one subcommand per pipeline stage. It parses arguments and calls the stage; the work
lives in the stage packages (heavy imports happen inside the commands so `dice --help` stays fast)."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from dice_kernels import __version__
from dice_kernels.data.cli import app as data_app
from dice_kernels.harness.cli_options import eval_options
from dice_kernels.bench.cli import app as bench_app
from dice_kernels.demo.cli import demo
from dice_kernels.sampling.cli import generate
from dice_kernels.train.cli import app as train_app

app = typer.Typer(help="dice-kernels: train diffusion LLMs to write CUDA kernels, and evaluate kernels honestly.",
                  no_args_is_help=True, add_completion=False)
console = Console(stderr=True)
app.add_typer(data_app, name="data")  # stage commands live with their stage (heavy imports stay inside them)
app.command("generate")(generate)
app.add_typer(train_app, name="train")
app.add_typer(bench_app, name="bench")
app.command("demo")(demo)

EXAMPLES = Path(__file__).parent / "examples"


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


@app.command("eval")
@eval_options
def eval_cmd(
    solutions: list[Path] = typer.Argument(None, help="Solution files (.py, or model output .md/.txt) for --task."),
    task: Optional[Path] = typer.Option(None, "--task", help="One KernelBench-format task file; evaluates SOLUTIONS against it."),
    tasks: Optional[Path] = typer.Option(None, "--tasks", help="Task directory (KernelBench layout) or JSONL file; use with --solutions."),
    solutions_dir: Optional[Path] = typer.Option(None, "--solutions", help="Directory of solutions, paired to --tasks by file name (19_ReLU.py, level1/19_ReLU/*.py, 19_ReLU_s3.md)."),
    example: bool = typer.Option(False, "--example", help="Evaluate the small example set shipped with the package."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (results.sqlite, results.jsonl, summary.json, report.md, outcomes.png). Default: runs/eval-<time>."),
    resume: bool = typer.Option(False, "--resume", help="Skip candidates already recorded in --out's database (harness errors are retried)."),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="Show a progress bar; without one, a line per result (for logs)."),
    eval_config=None,  # the harness's options (harness/cli_options.py), one flag per EvalConfig field
) -> None:
    """Evaluate CUDA (or C++) kernel solutions against KernelBench-format tasks.

    \b
    Examples:
      dice eval --example                                   # shipped examples, CPU or GPU
      dice eval --task level1/19_ReLU.py sol_a.py sol_b.md  # several solutions, one task
      dice eval --tasks KernelBench/level1 --solutions runs/samples --out runs/l1 --jobs 16
      dice eval --tasks KernelBench/level1 --solutions runs/samples --out runs/l1 --resume

    Each candidate gets one outcome: correct, generation_failure, compile_error, python_error,
    cuda_memory_error, runtime_error, timeout, shape_mismatch, value_mismatch, deceptive or harness_error.
    """
    from dice_kernels.harness import evaluate, load_candidate
    from dice_kernels.harness.candidate import pair_solutions
    from dice_kernels.tasks import TaskError, load_task_file, load_tasks

    config = eval_config
    try:
        resolved = config.resolved_backend()
    except ValueError as e:
        _fail(str(e))
    try:
        if example:
            tasks, solutions_dir = EXAMPLES / "tasks", EXAMPLES / "solutions" / resolved
        if task is not None:
            if not solutions:
                _fail("--task needs at least one SOLUTION file")
            t = load_task_file(task)
            missing = [str(p) for p in solutions if not p.is_file()]
            if missing:
                _fail(f"solution file(s) not found: {', '.join(missing)}")
            pairs = [(t, load_candidate(p)) for p in solutions]
        elif tasks is not None:
            if solutions_dir is None or not solutions_dir.is_dir():
                _fail(f"--tasks needs --solutions DIR (got {solutions_dir})")
            pairs, unmatched = pair_solutions(load_tasks(tasks), solutions_dir)
            if unmatched:
                console.print(f"[yellow]{len(unmatched)} solution file(s) match no task, skipped:[/] "
                              + ", ".join(unmatched[:10]) + (" …" if len(unmatched) > 10 else ""))
            if not pairs:
                _fail(f"no solution under {solutions_dir} matches a task in {tasks}")
        else:
            _fail("give --task TASK.py SOLUTION..., --tasks DIR|FILE.jsonl --solutions DIR, or --example "
                  "(see dice eval --help)")
    except TaskError as e:
        _fail(str(e))
    if resume and out is None:
        _fail("--resume needs --out pointing at the run to resume")
    out = out or Path("runs") / f"eval-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"evaluating {len(pairs)} candidate(s) on [bold]{resolved}[/] → {out}")
    start = time.monotonic()
    evaluate(pairs, config, out_dir=out, resume=resume, progress=progress)
    _write_report(out, {"wall_s": round(time.monotonic() - start, 1), "command": " ".join(sys.argv)})


def _write_report(run_dir: Path, meta: dict) -> None:
    from dice_kernels.harness.store import ResultStore
    from dice_kernels.report.eval_report import console_table, outcome_table, write_report

    store = ResultStore(run_dir / "results.sqlite")
    results = store.all()
    store.export_jsonl(run_dir / "results.jsonl")
    meta = {**(store.get_meta("platform") or {}), "harness_version": __version__, **meta}
    store.close()
    s = write_report(run_dir, results, meta)
    out_console = Console()
    out_console.print(console_table(s))
    out_console.print(outcome_table(s))
    if s["internal_harness_errors"]:
        console.print(f"[bold red]{s['internal_harness_errors']} internal harness error(s): please report[/]")
    console.print(f"report: {run_dir / 'report.md'}")


@app.command("report")
def report_cmd(run_dir: Path = typer.Argument(..., help="A `dice eval --out` directory.")) -> None:
    """Rewrite results.jsonl, summary.json, report.md and outcomes.png from a run's results.sqlite."""
    if not (run_dir / "results.sqlite").is_file():
        _fail(f"{run_dir} has no results.sqlite (is it a `dice eval --out` directory?)")
    _write_report(run_dir, {})
