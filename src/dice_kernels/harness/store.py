"""The results store: one SQLite database per run directory, the source of truth, written as each candidate
finishes (so a killed run loses nothing), plus the `results.jsonl` export."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from dice_kernels.harness.outcomes import EvalResult, Outcome

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
