"""Where results live. The results store: one SQLite database per run directory, the source of truth, written as
each candidate finishes (so a killed run loses nothing), plus the `results.jsonl` export. The verdict cache
(`EvalConfig.reuse_verdicts`): one SQLite table beside the build cache, keyed by the task, the candidate's program
(its syntax tree) and everything that decides a verdict (the settings that do, the machine, torch and the harness's
code), so a program met again, in a later RL step or another arm's benchmark, is not run again. Only the trusted
parent opens either: workers may write nowhere but their own folders."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from dataclasses import replace
from functools import cache
from pathlib import Path

from dice_kernels.harness.candidate import Candidate
from dice_kernels.harness.config import SCHEDULING
from dice_kernels.harness.outcomes import EvalResult, Outcome, Phases
from dice_kernels.tasks import Task

_COLUMNS = list(EvalResult("", "", "", Outcome.CORRECT).to_row())  # flat fields, then `details` (JSON)


class StoreFormatError(sqlite3.DatabaseError):
    """A results database an older harness wrote (its results keep an untyped `extra` column): not readable as
    results, like a damaged file (the CLI says so in one line)."""


class ResultStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            _create(self.path)
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        _check_format(self._db, self.path)
        _create_tables(self._db)

    def put(self, result: EvalResult) -> None:
        row = result.to_row()
        row["details"] = json.dumps(row["details"])
        placeholders = ", ".join("?" for _ in _COLUMNS)
        self._db.execute(f"INSERT OR REPLACE INTO results ({', '.join(_COLUMNS)}) VALUES ({placeholders})",
                         [row[c] for c in _COLUMNS])
        self._db.commit()

    def done_keys(self) -> set[tuple[str, str, str]]:
        """(task_id, candidate_id, candidate_sha256) of every finished evaluation, for --resume."""
        cur = self._db.execute("SELECT task_id, candidate_id, candidate_sha256 FROM results")
        return set(cur.fetchall())

    def finished(self) -> dict[tuple[str, str, str], EvalResult]:
        """What a resumed run keeps, by (task_id, candidate_id, candidate_sha256): every recorded result except
        harness errors, which are ours (or transient) and are tried again."""
        return {(r.task_id, r.candidate_id, r.candidate_sha256): r for r in self.all()
                if r.outcome is not Outcome.HARNESS_ERROR}

    def import_from(self, other: str | Path) -> int:
        """Copy in the results of another run's database (e.g. shards of one batch verified on several GPUs), except
        where this one already has a result for the key that is not a harness error; returns how many came in."""
        source = ResultStore(other)
        try:
            theirs = source.all()
        finally:
            source.close()
        mine = self.finished()
        new = [r for r in theirs if (r.task_id, r.candidate_id, r.candidate_sha256) not in mine]
        for r in new:
            self.put(r)
        return len(new)

    def all(self) -> list[EvalResult]:
        cur = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM results ORDER BY rowid")
        out = []
        for values in cur.fetchall():
            row = dict(zip(_COLUMNS, values))
            row["details"] = json.loads(row["details"] or "{}")
            row["correct"] = bool(row["correct"])
            out.append(EvalResult.from_row(row))
        return out

    def set_meta(self, key: str, value) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))
        self._db.commit()

    def get_meta(self, key: str, default=None):
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def export_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for r in self.all():
                f.write(json.dumps(r.to_row()) + "\n")

    def close(self) -> None:
        self._db.close()


def _check_format(db: sqlite3.Connection, path: Path) -> None:
    columns = {row[1] for row in db.execute("PRAGMA table_info(results)")}
    if "extra" in columns and "details" not in columns:
        db.close()
        raise StoreFormatError(f"{path} was written by an older harness (untyped `extra` results): evaluate into a "
                               "new --out folder, or delete that file to start over")


def _create_tables(db: sqlite3.Connection) -> None:
    cols = ", ".join(f"{c} TEXT" if c == "details" else c for c in _COLUMNS)
    db.execute(f"CREATE TABLE IF NOT EXISTS results (rowid INTEGER PRIMARY KEY, {cols}, "
               "UNIQUE(task_id, candidate_id, candidate_sha256))")
    db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
    db.commit()


def _create(path: Path) -> None:
    """Create the database beside its final name and link it into place complete, tables included: a reader of a
    run that is still starting (a progress watcher, `dice report`) never finds a file without its tables."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    db = sqlite3.connect(tmp)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        _create_tables(db)
    finally:
        db.close()  # the last connection checkpoints and removes the -wal file
    try:
        os.link(tmp, path)  # never replaces: a database another process created first wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


# -- verdicts kept across runs
VERDICTS_FILE = "verdicts.sqlite"
# outcomes that may depend on what else ran at the time (load, memory taken by other workers) or are our own fault:
# never kept, so a later run decides them afresh
NOT_KEPT = frozenset({Outcome.HARNESS_ERROR, Outcome.TIMEOUT, Outcome.MEMORY_ERROR, Outcome.CUDA_MEMORY_ERROR})


@cache
def harness_source() -> str:
    """A hash of the harness's own code (every .py file of the harness folder): a verdict reached by other code,
    an edited checkout's included, whatever its version says, is not reused."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def verdict_context(settings: dict[str, object], platform: dict[str, object], harness: str) -> str:
    """The part of a verdict's key one batch shares: the settings that decide verdicts (all but config.SCHEDULING,
    as `--resume` compares them), the machine and torch (`platform`) and the harness's code (`harness`:
    harness_source()), hashed."""
    decided_by = [harness, {k: str(v) for k, v in sorted(settings.items()) if k not in SCHEDULING},
                  {k: str(v) for k, v in sorted(platform.items())}]
    return hashlib.sha256(json.dumps(decided_by).encode()).hexdigest()


def verdict_key(task: Task, cand: Candidate, context: str) -> str:
    """What a verdict depends on: the same task code and the same program under the same `verdict_context`."""
    return hashlib.sha256(f"{context}:{task.sha256}:{cand.program_sha256}".encode()).hexdigest()


class VerdictCache:
    """`get(key)` an earlier verdict or None; `put(key, result)` a new one (not one of NOT_KEPT). Safe to call from
    the batch's run threads."""

    def __init__(self, cache_dir: Path):
        cache_dir.mkdir(parents=True, exist_ok=True)
        # several evaluators may share one cache folder (a reward service beside `dice bench`): wait for a writer
        self._db = sqlite3.connect(cache_dir / VERDICTS_FILE, timeout=60, check_same_thread=False)
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


def untimed(timed: EvalResult) -> EvalResult:
    """A timed verdict as an untimed run reports it: the outcome and its checks, none of the times."""
    return replace(timed, ref_time_ms=None, cand_time_ms=None, speedup=None, timing_trials=0, timing=None)


def reused(earlier: EvalResult, task: Task, cand: Candidate) -> EvalResult:
    """An earlier verdict as this pair's result: this task's and candidate's names, `duplicate_of` the candidate
    it was evaluated for, and no seconds of work (none was done)."""
    return replace(earlier, task_id=task.id, candidate_id=cand.id, candidate_sha256=cand.sha256,
                   solution_path=cand.path, level=task.level, duplicate_of=earlier.candidate_id, wall_s=0.0,
                   phases=Phases(failed_in=earlier.phases.failed_in))
