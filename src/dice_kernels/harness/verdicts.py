"""Verdicts kept across runs (`EvalConfig.reuse_verdicts`): one SQLite table beside the build cache, keyed by the
task, the candidate's program (its syntax tree) and everything that decides a verdict (the settings that do, the
machine, torch and the harness's code), so a program met again, in a later RL step or another arm's benchmark, is
not run again. Only the trusted parent reads and writes it: workers may write nowhere but their own folders."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from dataclasses import replace
from functools import cache
from pathlib import Path

from dice_kernels.harness.candidate import Candidate
from dice_kernels.harness.config import SCHEDULING
from dice_kernels.harness.outcomes import EvalResult, Outcome, Phases
from dice_kernels.tasks import Task

FILE = "verdicts.sqlite"
# outcomes that may depend on what else ran at the time (load, memory taken by other workers) or are our own fault:
# never kept, so a later run decides them afresh
NOT_KEPT = frozenset({Outcome.HARNESS_ERROR, Outcome.TIMEOUT, Outcome.MEMORY_ERROR, Outcome.CUDA_MEMORY_ERROR})


@cache
def harness_source() -> str:
    """A hash of the harness's own code (every .py file of this package folder): a verdict reached by other code,
    an edited checkout's included, whatever its version says, is not reused."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def verdict_key(task: Task, cand: Candidate, settings: dict[str, object], platform: dict[str, object],
                harness: str) -> str:
    """What a verdict depends on, hashed: the same task code, the same program, the settings that decide verdicts
    (all but config.SCHEDULING, as `--resume` compares them) on the same machine, torch and harness code
    (`harness`: harness_source())."""
    decided_by = [task.sha256, cand.program_sha256, harness,
                  {k: str(v) for k, v in sorted(settings.items()) if k not in SCHEDULING},
                  {k: str(v) for k, v in sorted(platform.items())}]
    return hashlib.sha256(json.dumps(decided_by).encode()).hexdigest()


class VerdictCache:
    """`get(key)` an earlier verdict or None; `put(key, result)` a new one (not one of NOT_KEPT). Safe to call from
    the batch's run threads."""

    def __init__(self, cache_dir: Path):
        cache_dir.mkdir(parents=True, exist_ok=True)
        # several evaluators may share one cache folder (a reward service beside `dice bench`): wait for a writer
        self._db = sqlite3.connect(cache_dir / FILE, timeout=60, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, result TEXT NOT NULL)")
        self._db.commit()
        self._lock = threading.Lock()  # one connection, several run threads

    def get(self, key: str) -> EvalResult | None:
        with self._lock:
            row = self._db.execute("SELECT result FROM verdicts WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        try:
            return EvalResult.from_row(json.loads(row[0]))
        except (ValueError, KeyError, TypeError):  # written by another harness version's fields: evaluate again
            return None

    def put(self, key: str, result: EvalResult) -> None:
        if result.outcome in NOT_KEPT:
            return
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?)", (key, json.dumps(result.to_row())))
            self._db.commit()

    def close(self) -> None:
        self._db.close()


def reused(earlier: EvalResult, task: Task, cand: Candidate) -> EvalResult:
    """An earlier verdict as this pair's result: this task's and candidate's names, `duplicate_of` the candidate
    it was evaluated for, and no seconds of work (none was done)."""
    return replace(earlier, task_id=task.id, candidate_id=cand.id, candidate_sha256=cand.sha256,
                   solution_path=cand.path, level=task.level, duplicate_of=earlier.candidate_id, wall_s=0.0,
                   phases=Phases(failed_in=earlier.phases.failed_in))
