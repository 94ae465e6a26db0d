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
def eval_cmd(
    solutions: list[Path] = typer.Argument(None, help="Solution files (.py, or model output .md/.txt) for --task."),
    task: Optional[Path] = typer.Option(None, "--task", help="One KernelBench-format task file; evaluates SOLUTIONS against it."),
    tasks: Optional[Path] = typer.Option(None, "--tasks", help="Task directory (KernelBench layout) or JSONL file; use with --solutions."),
    solutions_dir: Optional[Path] = typer.Option(None, "--solutions", help="Directory of solutions, paired to --tasks by file name (19_ReLU.py, level1/19_ReLU/*.py, 19_ReLU_s3.md)."),
    example: bool = typer.Option(False, "--example", help="Evaluate the small example set shipped with the package."),
    backend: str = typer.Option("auto", help="cuda | cpu | auto (cuda when a GPU is present). CPU candidates are C++ extensions."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (results.sqlite, results.jsonl, summary.json, report.md, outcomes.png). Default: runs/eval-<time>."),
    resume: bool = typer.Option(False, "--resume", help="Skip candidates already recorded in --out's database (harness errors are retried)."),
    jobs: int = typer.Option(0, "--jobs", "-j", help="Builds in flight (default: 1.25 per CPU core; a build waiting for the precompiled header compiles only its CUDA unit)."),
    trials: int = typer.Option(5, help="Correctness trials, each with freshly seeded inputs."),
    atol: float = typer.Option(1e-2, help="Absolute tolerance."),
    rtol: float = typer.Option(1e-2, help="Relative tolerance."),
    timing: bool = typer.Option(True, "--timing/--no-timing", help="Time correct candidates and references."),
    timing_iters: int = typer.Option(20, help="Least timed calls per model; more follow until the median's 95% CI is within 1% (docs/timing.md)."),
    timing_max_s: float = typer.Option(2.0, help="Most seconds of timed calls per model."),
    inputs_on_device: bool = typer.Option(True, "--inputs-on-device/--inputs-on-cpu",
                                          help="CUDA: run the task's get_inputs() with the GPU as default device "
                                          "(no CPU generation and copy of multi-GiB inputs); --inputs-on-cpu "
                                          "generates them on the CPU, as KernelBench does."),
    timing_loops: int = typer.Option(1, help="Independent timing loops per model, sharing the limits above; the "
                                     "time is the mean of their medians (docs/timing.md)."),
    run_timeout_s: float = typer.Option(300.0, "--run-timeout-s", help="Wall-clock seconds for one candidate's run, "
                                        "or 3x its task's reference run when that is longer."),
    compile_timeout_s: float = typer.Option(600.0, "--compile-timeout-s",
                                            help="Wall-clock seconds for one candidate's build."),
    memory_gb: float = typer.Option(32.0, help="Host memory limit per worker, GiB."),
    output_memory_gb: float = typer.Option(0.0, help="Host memory, GiB, this process may hold for tasks' outputs "
                                           "(a task's reference trials and its candidates' frames in flight); a task "
                                           "that does not fit beside the others waits its turn. 0: half of what is "
                                           "available at the start."),
    cache_dir: Optional[Path] = typer.Option(None, help="Build cache (default $DICE_CACHE_DIR or ~/.cache/dice-kernels/builds)."),
    compile_baseline: bool = typer.Option(False, "--compile-baseline", help="Also time torch.compile(Model) per task and report speedups and fast_p against it (compiling costs seconds to minutes per task)."),
    speed_of_light: str = typer.Option("cuda", "--speed-of-light", help="cuda | always | off. Quarantine a speedup whose time beats the task's speed-of-light bound (minimum bytes moved at the measured memory bandwidth): it keeps its outcome but gets no speedup and the flag faster_than_light. Beating the reference's FLOPs at the measured peak only adds the flag fewer_flops_than_reference. 'cuda': on the CUDA backend only, where the bound is reliable (docs/timing.md)."),
    baselines: str = typer.Option("reuse", "--baselines", help="reuse | fresh | off. Reference timings (eager, torch.compile) and speed-of-light inputs are cached per task, machine, torch version and timing settings in the cache folder's baselines.sqlite: 'reuse' a cached one (the reference still runs for its outputs, untimed), 'fresh' measures again and replaces it, 'off' measures and caches nothing."),
    fast_build: bool = typer.Option(True, "--fast-build/--no-fast-build", help="Precompile torch/extension.h for C++ units and try CUDA units without it first (falls back to the candidate's own sources; docs/harness.md)."),
    robust: bool = typer.Option(True, "--robust/--no-robust", help="Run the robust check: correct candidates caught by an integrity check become `deceptive` (docs/robust_check.md)."),
    allow_op: list[str] = typer.Option([], "--allow-op", help="An ATen op forward may dispatch without counting as a PyTorch fallback, e.g. aten::mm (repeatable; added to the default allow-list)."),
    run_workers: int = typer.Option(0, "--run-workers", help="Concurrent run workers (a timing loop has the device to itself); 0: 1 on cpu; on cuda 4, or 8 on a GPU with 128 GiB or more."),
    warm_workers: int = typer.Option(-1, "--warm-workers", help="Worker processes started ahead of their job (each still runs one job); -1: as many as run workers, 0: none."),
    warm_build_workers: int = typer.Option(4, "--warm-build-workers", help="Build workers started ahead of their job likewise, for the builds after the first --jobs; 0: none."),
    fork_workers: bool = typer.Option(True, "--fork-workers/--no-fork-workers", help="Fork each worker from a process that imported torch once, instead of starting an interpreter that imports it (each is still a fresh process; docs/harness.md)."),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="Show a progress bar; without one, a line per result (for logs)."),
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
    from dice_kernels.harness import EvalConfig, evaluate, load_candidate
    from dice_kernels.harness.candidate import pair_solutions
    from dice_kernels.tasks import TaskError, load_task_file, load_tasks

    config = EvalConfig(backend=backend, trials=trials, atol=atol, rtol=rtol, timing=timing,
                        timing_iters=timing_iters, timing_max_s=timing_max_s, timing_loops=timing_loops,
                        inputs_on_device=inputs_on_device, run_timeout_s=run_timeout_s, compile_timeout_s=compile_timeout_s,
                        memory_limit_gb=memory_gb, output_memory_gb=output_memory_gb, robust=robust,
                        fast_build=fast_build, compile_baseline=compile_baseline, speed_of_light=speed_of_light,
                        baselines=baselines, run_workers=run_workers, warm_workers=warm_workers,
                        warm_build_workers=warm_build_workers, fork_workers=fork_workers)
    try:
        config.check()
    except ValueError as e:
        _fail(str(e))
    bad_ops = [op for op in allow_op if not op.startswith("aten::")]
    if bad_ops:
        _fail(f"--allow-op takes ATen op names such as aten::mm, not {', '.join(bad_ops)}")
    config.allowed_ops = (*config.allowed_ops, *allow_op)
    if jobs:
        config.jobs = jobs
    if cache_dir:
        config.cache_dir = cache_dir
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
