"""One bench run end to end: select the tasks, generate the outputs that are missing, evaluate the ones the harness
has not recorded, write the report. The run folder:

    bench.json      the run's settings, model, decoding, hardware and software (checked when a run resumes)
    generations/    one raw output (.md) and one record (.json) per task and sample (generation.py)
    eval/           the harness's results.sqlite, written per candidate and resumed
    timing.jsonl    seconds per phase (model load, each generation call, each evaluation), appended
    results.jsonl, summary.json, report.md, report.png
"""

from __future__ import annotations

import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from dice_kernels.bench.config import BenchConfig
from dice_kernels.bench.generation import Item, generate, output_paths, pending
from dice_kernels.tasks import Task, load_tasks

EXAMPLE_TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"


def select_tasks(cfg: BenchConfig) -> list[Task]:
    """The tasks of `cfg.tasks` (the package's examples when unset), filtered by level and by id or name."""
    tasks = load_tasks(cfg.tasks or EXAMPLE_TASKS)
    if cfg.levels:
        tasks = [t for t in tasks if t.level in cfg.levels]
    if cfg.task_filter:
        wanted = set(cfg.task_filter)
        unknown = wanted - {t.id for t in tasks} - {t.name for t in tasks}
        if unknown:
            raise ValueError(f"--task {', '.join(sorted(unknown))}: no such task id or name among the selected "
                             f"tasks of {cfg.tasks or EXAMPLE_TASKS}")
        tasks = [t for t in tasks if t.id in wanted or t.name in wanted]
    if not tasks:
        raise ValueError(f"no task left after the --level/--task filters ({cfg.tasks or EXAMPLE_TASKS})")
    return tasks


def _software() -> dict:
    import torch

    from dice_kernels import __version__

    return {"dice_kernels": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def _generation_hardware(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def record_run(cfg: BenchConfig, command: str) -> dict:
    """Write bench.json (creating the run folder), or check a resumed run's generation settings against it."""
    path = cfg.out / "bench.json"
    settings = cfg.generation_settings() if cfg.checkpoint else {"generations": str(cfg.generations.resolve())}
    info = {}
    if path.is_file():
        info = json.loads(path.read_text())
        if info.get("generation") != settings:
            raise ValueError(f"{cfg.out} holds a run made with other generation settings ({info.get('generation')});"
                             " resume it with the same --checkpoint/--generations and decoding options, or use a "
                             "new --out")
    cfg.out.mkdir(parents=True, exist_ok=True)
    info.setdefault("started", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    info.update({"generation": settings, "samples": cfg.samples,
                 "tasks": str(cfg.tasks or EXAMPLE_TASKS), "eval": {k: str(v) for k, v in cfg.eval.settings().items()},
                 "software": _software(), "generation_hardware": _generation_hardware(cfg.device),
                 "command": command})
    path.write_text(json.dumps(info, indent=1))
    return info


def timing_log(run_dir: Path) -> Callable[[dict], None]:
    """Append one JSON line per timed phase to timing.jsonl, flushed at once (a killed run keeps its times)."""

    def log(record: dict) -> None:
        with open(run_dir / "timing.jsonl", "a") as f:
            f.write(json.dumps({**record, "at": round(time.time(), 3)}) + "\n")

    return log


def _pairs_from_run(tasks: list[Task], samples: int, root: Path) -> list[tuple[Task, object]]:
    from dice_kernels.harness import load_candidate

    pairs = []
    for task in tasks:
        for k in range(samples):
            item = Item(task, k)
            text_path, record_path = output_paths(root, item)
            if record_path.is_file():
                pairs.append((task, load_candidate(text_path, id=item.candidate_id)))
    return pairs


def _pairs_from_folder(tasks: list[Task], folder: Path, echo: Callable[[str], None]) -> list[tuple[Task, object]]:
    from dice_kernels.harness.candidate import pair_solutions

    pairs, unmatched = pair_solutions(tasks, folder)
    if unmatched:
        echo(f"{len(unmatched)} file(s) under {folder} match no selected task, skipped: "
             + ", ".join(unmatched[:10]) + (" ..." if len(unmatched) > 10 else ""))
    if not pairs:
        raise ValueError(f"--generations {folder}: no file matches a selected task (name files or folders after "
                         "the task, e.g. level1/19_ReLU/s0.md or 19_ReLU_s3.py)")
    return pairs


def _recorded(eval_dir: Path) -> set[tuple[str, str, str]]:
    """Keys the harness will not evaluate again on resume (it retries harness errors)."""
    from dice_kernels.harness import Outcome
    from dice_kernels.harness.store import ResultStore

    if not (eval_dir / "results.sqlite").is_file():
        return set()
    store = ResultStore(eval_dir / "results.sqlite")
    try:
        return {k for k, r in store.finished().items() if r.outcome is not Outcome.HARNESS_ERROR}
    finally:
        store.close()


def run(cfg: BenchConfig, command: str = "", progress: bool = True,
        echo: Callable[[str], None] = print) -> dict | None:
    """Generate (what is missing), evaluate (what is not recorded) and report; returns the report's summary
    (None with `stage="generate"`)."""
    from dice_kernels.harness import evaluate
    from dice_kernels.report.bench_report import write_report

    cfg.check()
    tasks = select_tasks(cfg)
    info = record_run(cfg, command or " ".join(sys.argv))
    log = timing_log(cfg.out)
    root = cfg.out / "generations"
    if cfg.checkpoint is not None and cfg.stage != "evaluate":
        todo = pending(root, tasks, cfg.samples, cfg.generation_settings())
        done = len(tasks) * cfg.samples - len(todo)
        echo(f"generation: {len(todo)} to generate, {done} already written ({len(tasks)} task(s) x {cfg.samples} "
             f"sample(s)) -> {root}")
        if todo:
            with _bar(len(todo), "generating", progress, echo) as advance:
                generate(cfg, todo, root, log, advance)
    if cfg.stage == "generate":
        return None
    pairs = (_pairs_from_run(tasks, cfg.samples, root) if cfg.checkpoint is not None
             else _pairs_from_folder(tasks, cfg.generations, echo))
    eval_dir = cfg.out / "eval"
    recorded = _recorded(eval_dir)
    fresh = sum(1 for t, c in pairs if (t.id, c.id, c.sha256) not in recorded)
    echo(f"evaluation: {fresh} to evaluate, {len(pairs) - fresh} already recorded -> {eval_dir}")
    began = time.perf_counter()
    results = evaluate(pairs, cfg.eval, out_dir=eval_dir, resume=True, progress=progress)
    log({"phase": "evaluate", "seconds": time.perf_counter() - began, "candidates": fresh,
         "resumed": len(pairs) - fresh})
    with open(cfg.out / "results.jsonl", "w") as f:
        f.writelines(json.dumps(r.to_row()) + "\n" for r in results)
    return write_report(cfg.out, results, info, _read_timing(cfg.out))


def _read_timing(run_dir: Path) -> list[dict]:
    path = run_dir / "timing.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


class _bar:
    """A rich progress bar, or (for logs) a line per advance, used as
    `with _bar(n, label, on, echo) as advance: advance(k)`."""

    def __init__(self, total: int, label: str, enabled: bool, echo: Callable[[str], None]):
        self.total, self.label, self.enabled, self.echo, self.progress = total, label, enabled, echo, None
        self.done, self.began = 0, time.perf_counter()

    def _line(self, n: int) -> None:
        self.done += n
        self.echo(f"{self.label}: {self.done}/{self.total} ({time.perf_counter() - self.began:.0f} s)")

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return self._line
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
        self.progress.start()
        task = self.progress.add_task(self.label, total=self.total)
        return lambda n: self.progress.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
