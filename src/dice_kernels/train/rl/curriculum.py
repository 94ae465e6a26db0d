"""Which tasks each RL step sees: the task set (`RLTask`, from `dice data`'s rl_e2e / rl_infill tables or a
KernelBench directory) ordered easy -> hard, and `Curriculum`, the resumable scheduler: sequential by level with
wrap-around as DICE (64 a step), or mixed (a fresh seeded shuffle of the whole set per pass)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

ORDERS = ("sequential", "mixed")


@dataclass(frozen=True)
class RLTask:
    id: str
    level: int | None
    reference: str  # the KernelBench program (class Model, get_inputs, get_init_inputs)
    prefix: str | None = None  # infilling: the program around the kernel source the model writes
    suffix: str | None = None

    @property
    def infill(self) -> bool:
        return self.prefix is not None and self.suffix is not None

    def harness_task(self):
        from dice_kernels.tasks import task_from_code

        return task_from_code(self.reference, id=self.id, level=self.level, source=self.id)


def by_level(tasks: list[RLTask]) -> list[RLTask]:
    """Stable sort by level, unknown levels last: single operators, then fusions, then whole models."""
    return sorted(tasks, key=lambda t: t.level if t.level is not None else 1 << 30)


def load_task_set(path: str | Path, phase: str, solutions: str | Path | None = None) -> list[RLTask]:
    """The tasks of one phase ("infill" | "e2e"), ordered by level.

    `path`: a `dice data` table (rl_infill / rl_e2e, .jsonl or .parquet), or a KernelBench-layout directory or task
    file. From a directory, infilling tasks need `solutions`: every solution program there that cuts
    (data/infill.split_program) gives one infilling task around its kernel source.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such task set (a dice data rl_infill/rl_e2e table or a task directory)")
    rows = _table_rows(path) if path.suffix in (".jsonl", ".parquet") else []
    if rows and "reference" in rows[0]:
        if phase == "infill" and rows and "prefix" not in rows[0]:
            raise ValueError(f"{path}: not an infilling task set (no prefix/suffix columns): use rl_infill")
        tasks = [RLTask(id=r["id"], level=r.get("level"), reference=r["reference"],
                        prefix=r.get("prefix") if phase == "infill" else None,
                        suffix=r.get("suffix") if phase == "infill" else None) for r in rows]
    else:
        tasks = _kernelbench_tasks(path, phase, solutions)
    if not tasks:
        raise ValueError(f"{path}: no {phase} tasks")
    return by_level(tasks)


def _table_rows(path: Path) -> list[dict]:
    """A `dice data` table's rows (a KernelBench JSONL task file has `code`, not `reference`: loaded as tasks)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _kernelbench_tasks(path: Path, phase: str, solutions: str | Path | None) -> list[RLTask]:
    from dice_kernels.tasks import load_tasks

    tasks = load_tasks(path)
    if phase != "infill":
        return [RLTask(id=t.id, level=t.level, reference=t.code) for t in tasks]
    if solutions is None:
        raise ValueError(f"{path}: infilling from a task directory needs a solutions directory to cut programs from")
    from dice_kernels.data.infill import InfillError, split_program
    from dice_kernels.harness.candidate import pair_solutions

    pairs, _ = pair_solutions(tasks, solutions)
    out = []
    for task, cand in pairs:
        try:
            cut = split_program(cand.code or "")
        except InfillError:
            continue
        stem = Path(cand.id).stem
        out.append(RLTask(id=f"{task.id}#{stem}", level=task.level, reference=task.code, prefix=cut.prefix,
                          suffix=cut.suffix))
    return out


@dataclass
class Curriculum:
    """Hands out `per_step` tasks a step. `position` counts the tasks handed out so far: it is the whole state, so
    a resumed run continues exactly where it stopped. Pass k over the set is the level order (sequential) or a
    shuffle seeded by (seed, k) (mixed); a step may straddle two passes."""

    tasks: list[RLTask]
    per_step: int = 64
    order: str = "sequential"
    seed: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("cannot schedule an empty task set")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.per_step < 1:
            raise ValueError(f"per_step must be at least 1, got {self.per_step}")
        self._pass: tuple[int, list[int]] | None = None

    def _order_of(self, k: int) -> list[int]:
        if self._pass is None or self._pass[0] != k:
            idx = list(range(len(self.tasks)))
            if self.order == "mixed":
                random.Random(f"{self.seed}/{k}").shuffle(idx)
            self._pass = (k, idx)
        return self._pass[1]

    def next_batch(self) -> list[RLTask]:
        n, out = len(self.tasks), []
        for p in range(self.position, self.position + self.per_step):
            out.append(self.tasks[self._order_of(p // n)[p % n]])
        self.position += self.per_step
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "order": self.order, "seed": self.seed, "tasks": len(self.tasks)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("tasks") != len(self.tasks) or state.get("order") != self.order:
            raise ValueError(f"the saved curriculum ({state.get('tasks')} tasks, {state.get('order')}) is not this "
                             f"one ({len(self.tasks)} tasks, {self.order}): resume with the same task set and order")
        self.position, self.seed = int(state["position"]), int(state["seed"])
