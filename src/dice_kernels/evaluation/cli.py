"""`dice eval` and `dice report`: evaluate solution files against tasks into a run directory (made, resumed only
with the settings it was judged with, or replaced on request), and write its report from the results database.
The harness does the evaluating (harness.evaluate); this module owns the run directory and its files."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from dice_kernels import __version__
from dice_kernels.cli_errors import fail
from dice_kernels.harness.cli_options import eval_options

console = Console(stderr=True, soft_wrap=True)  # a message stays one line in a log, whatever its width
EXAMPLES = Path(__file__).parent.parent / "examples"
# what a run writes in --out (--overwrite removes them before the new run)
RUN_FILES = ("results.sqlite", "results.sqlite-wal", "results.sqlite-shm", "results.jsonl", "summary.json",
             "report.md", "outcomes.png")


@eval_options
def eval_cmd(
    solutions: list[Path] = typer.Argument(None, help="Solution files (.py, or model output .md/.txt) for --task."),
    task: Optional[Path] = typer.Option(None, "--task", help="One KernelBench-format task file; evaluates SOLUTIONS against it."),
    tasks: Optional[Path] = typer.Option(None, "--tasks", help="Task directory (KernelBench layout) or JSONL file; use with --solutions."),
    solutions_dir: Optional[Path] = typer.Option(None, "--solutions", help="Directory of solutions, paired to --tasks by file name (19_ReLU.py, level1/19_ReLU/*.py, 19_ReLU_s3.md)."),
    example: bool = typer.Option(False, "--example", help="Evaluate the small example set shipped with the package (each file says what it shows and the outcome it should get)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (results.sqlite, results.jsonl, summary.json, report.md, outcomes.png). Default: runs/eval-<time>."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out: skip candidates already recorded (harness errors are retried); refused when the settings that decide verdicts differ from the run's."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run already in --out (without it, an existing run is never overwritten)."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", show_default="a bar on a terminal",
                                            help="A progress bar, or a line per result (for logs). Default: a bar "
                                                 "when stdout is a terminal."),
    eval_config=None,  # the harness's options (harness/cli_options.py), one flag per EvalConfig field
) -> None:
    """Evaluate CUDA (or C++) kernel solutions against KernelBench-format tasks.

    \b
    Examples:
      dice eval --example                                   # shipped examples, CPU or GPU
      dice eval --task level1/19_ReLU.py sol_a.py sol_b.md  # several solutions, one task
      dice eval --tasks KernelBench/level1 --solutions runs/samples --out runs/l1 --build-jobs 16
      dice eval --tasks KernelBench/level1 --solutions runs/samples --out runs/l1 --resume

    Each candidate gets one outcome: correct, generation_failure, compile_error, python_error,
    cuda_memory_error, memory_error, runtime_error, timeout, shape_mismatch, value_mismatch, deceptive,
    needs_gpu (CUDA code on the CPU backend: set aside) or harness_error.
    """
    config = eval_config
    if task is None and tasks is None and not example:
        fail("give --task TASK.py SOLUTION..., --tasks DIR|FILE.jsonl --solutions DIR, or --example "
              "(see dice eval --help)")
    if task is not None and not solutions:
        fail("--task needs at least one SOLUTION file")
    if tasks is not None and (solutions_dir is None or not solutions_dir.is_dir()):
        fail(f"--tasks needs --solutions DIR (got {solutions_dir})")
    if task is not None and (missing := [str(p) for p in solutions if not p.is_file()]):
        fail(f"solution file(s) not found: {', '.join(missing)}")
    if resume and out is None:
        fail("--resume needs --out pointing at the run to resume")
    if example:  # (resolving "auto" imports torch: after the checks above, which fail fast without it)
        tasks, solutions_dir = EXAMPLES / "tasks", EXAMPLES / "solutions" / config.resolved_backend()
    pairs = _pairs(task, solutions, tasks, solutions_dir)
    out = _run_dir(out or Path("runs") / f"eval-{datetime.now():%Y%m%d-%H%M%S}", resume, overwrite)
    if resume:
        _check_resumable(out, config)
    elif overwrite:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
    if example:
        console.print(f"the shipped examples: {len(pairs)} candidates for {len({t.id for t, _ in pairs})} tasks, each "
                      "file saying what it shows and the outcome it should get (the 'expected' column below)")

    from dice_kernels.harness import evaluate
    from dice_kernels.harness.process.pool import WorkersCannotStart

    cache_was_empty = not any(config.cache_dir.glob("*")) if config.cache_dir.is_dir() else True
    console.print(f"evaluating {len(pairs)} candidate(s) on [bold]{config.resolved_backend()}[/] → {out}")
    start = time.monotonic()
    try:
        evaluate(pairs, config, out_dir=out, resume=resume,
                 progress=sys.stdout.isatty() if progress is None else progress)
    except WorkersCannotStart as e:
        fail(str(e))
    wall_s = round(time.monotonic() - start, 1)
    _write_report(out, {"wall_s": wall_s, "command": shlex.join(["dice", *sys.argv[1:]])}, show_candidates=example or len(pairs) <= 40)
    if cache_was_empty and (size := _size_mb(config.cache_dir)) > 100:  # said once: the first run that compiled
        console.print(f"first run with this build cache: {wall_s:.0f} s, most of it compiling (the extensions and "
                      f"precompiled headers); {config.cache_dir} now holds {size:.0f} MB and makes later runs fast "
                      "(delete it any time; --cache-dir or $DICE_CACHE_DIR move it)")


def _pairs(task: Path | None, solutions: list[Path], tasks: Path | None, solutions_dir: Path | None) -> list:
    """The (task, candidate) pairs the options name; a task file that cannot be used is an input error."""
    from dice_kernels.harness import load_candidate
    from dice_kernels.harness.candidate import pair_solutions
    from dice_kernels.tasks import TaskError, load_task_file, load_tasks

    try:
        if task is not None:
            t = load_task_file(task)
            return [(t, load_candidate(p)) for p in solutions]
        pairs, unmatched = pair_solutions(load_tasks(tasks), solutions_dir)
    except TaskError as e:
        fail(str(e))
    if unmatched:
        console.print(f"[yellow]{len(unmatched)} solution file(s) match no task, skipped:[/] "
                      + ", ".join(unmatched[:10]) + (" …" if len(unmatched) > 10 else ""))
    if not pairs:
        fail(f"no solution under {solutions_dir} matches a task in {tasks}")
    return pairs


def _run_dir(out: Path, resume: bool, overwrite: bool) -> Path:
    """`--out`, made and writable; an existing run in it is continued (--resume) or replaced (--overwrite), never
    silently overwritten."""
    if out.exists() and not out.is_dir():
        fail(f"--out {out}: exists and is not a directory; give a directory for the run")
    has_run = (out / "results.sqlite").is_file()
    if resume and overwrite:
        fail("--resume continues the run in --out, --overwrite replaces it: give one of them")
    if resume and not has_run:
        fail(f"--resume: {out} holds no run (no results.sqlite); drop --resume to start one there")
    if has_run and not (resume or overwrite):
        fail(f"--out {out} already holds a run: add --resume to continue it, --overwrite to replace it, or "
              "choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".dice-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        fail(f"--out {out}: cannot write there ({e.strerror or e}); choose a directory you can write to")
    return out


def _open_store(run_dir: Path, flag: str):
    """The run's results store; a file that is not a results database is an input error naming it."""
    import sqlite3

    from dice_kernels.harness.store import ResultStore

    try:
        store = ResultStore(run_dir / "results.sqlite")
        store.get_meta("config")  # reads the file: a damaged one fails here, not half-way through a run
        return store
    except sqlite3.DatabaseError as e:
        fail(f"{flag} {run_dir}: results.sqlite is not a readable results database ({e}); move it away or "
              "choose another directory")


def _check_resumable(run_dir: Path, config) -> None:
    """A resumed run must judge with the settings its results were judged with."""
    store = _open_store(run_dir, "--resume")
    stored, platform = store.get_meta("config") or {}, store.get_meta("platform") or {}
    store.close()
    if "backend" in platform:  # the backend the run used ("auto" and "cpu" agree on a machine without a GPU)
        stored, config = {**stored, "backend": platform["backend"]}, replace(config, backend=config.resolved_backend())
    if old := config.unknown_settings(stored):
        fail(f"--resume: {run_dir} was recorded by an older dice whose settings have other names ({', '.join(old[:3])}, "
             "...), so its verdicts cannot be checked against these settings: give another --out, or --overwrite")
    if differences := config.differences(stored):
        fail(f"--resume: {run_dir} was evaluated with other settings ({'; '.join(differences)}); resume with the "
              "run's settings, or give another --out for new ones")


def _kept_from_summary(run_dir: Path) -> dict:
    """The wall time and command of a run recorded before the database kept them: from its summary.json."""
    try:
        old = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: old[k] for k in ("wall_s", "command") if k in old} if isinstance(old, dict) else {}


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6


def _write_report(run_dir: Path, meta: dict, show_candidates: bool = True) -> None:
    """Export results.jsonl and write summary.json, report.md and outcomes.png from the run's database; what is
    not recomputed from it (the run's wall time and command) is kept in the database's meta."""
    from dice_kernels.report.eval_report import (candidate_table, console_table, expectation_note, outcome_table,
                                                 write_report)

    store = _open_store(run_dir, "dice report")
    if meta:
        store.set_meta("run", meta)
    results = store.all()
    store.export_jsonl(run_dir / "results.jsonl")
    meta = {**(store.get_meta("platform") or {}), "harness_version": __version__,
            **(store.get_meta("run") or _kept_from_summary(run_dir))}
    store.close()
    s = write_report(run_dir, results, meta)
    out_console = Console()
    if show_candidates:
        out_console.print(candidate_table(results))
        if expected := expectation_note(results):
            out_console.print(expected)
    out_console.print(console_table(s))
    out_console.print(outcome_table(s))
    if s["internal_harness_errors"]:
        console.print(f"[bold red]{s['internal_harness_errors']} internal harness error(s): please report[/]")
    console.print(f"report: {run_dir / 'report.md'}")


def report_cmd(run_dir: Path = typer.Argument(..., help="A `dice eval --out` directory.")) -> None:
    """Rewrite results.jsonl, summary.json, report.md and outcomes.png from a run's results.sqlite (the run's wall
    time and command are kept)."""
    if not (run_dir / "results.sqlite").is_file():
        fail(f"{run_dir} has no results.sqlite (is it a `dice eval --out` directory?)")
    _write_report(run_dir, {})
