"""Reference baselines cached across runs: each task's eager and torch.compile timings and speed-of-light inputs,
measured once per (task, machine, torch, timing settings) and reused by every later run on that machine.

The store is a SQLite file beside the build cache (`<cache_dir>/baselines.sqlite`), shared by concurrent runs.
Only the parent reads and writes it: no worker, and so no candidate, can change a baseline.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from dice_kernels import __version__
from dice_kernels.harness.config import EvalConfig

_SCHEMA = """CREATE TABLE IF NOT EXISTS baselines (
    key TEXT PRIMARY KEY, task_sha256 TEXT NOT NULL, machine TEXT NOT NULL, measured_at TEXT NOT NULL,
    baseline TEXT NOT NULL)"""


def baseline_key(task_sha256: str, machine: str, cfg: EvalConfig) -> str:
    """Everything a reference's timing depends on: the task's code, the machine and software (`machine`, e.g.
    "cuda|NVIDIA H200|torch 2.11.0"), the harness version and every setting that changes what is timed or how.
    Machine-only settings (jobs, cache_dir, worker counts) are left out: they change nothing measured."""
    measured = {"warmup": cfg.timing.warmup, "timing_iters": cfg.timing.iters, "timing_max_s": cfg.timing.max_s,
                "timing_target_ci": cfg.timing.target_ci, "seed": cfg.seed, "trials": cfg.trials,
                "cpu_threads": cfg.scheduler.cpu_threads, "compile_baseline": cfg.timing.compile_baseline,
                "speed_of_light": cfg.timing.speed_of_light,
                # only when set, so the baselines cached before the setting existed keep their keys
                **({"timing_loops": cfg.timing.loops} if cfg.timing.loops != 1 else {}),
                **({"inputs_on_device": True} if cfg.inputs_on_device else {})}
    text = json.dumps({"task": task_sha256, "machine": machine, "harness": __version__, "settings": measured},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Baseline:
    """A reference's measured side: the run report's timing fields (timing_stats.TimingSamples plus time_ms and
    device_exclusive), the torch.compile baseline ({} when not asked for) and the speed-of-light inputs."""

    timing: dict
    compile_baseline: dict
    sol: dict
    measured_at: str = ""


class BaselineStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=60)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(_SCHEMA)
        return conn

    def get(self, key: str) -> Baseline | None:
        try:
            with closing(self._connect()) as conn:
                row = conn.execute("SELECT baseline, measured_at FROM baselines WHERE key = ?", (key,)).fetchone()
        except sqlite3.DatabaseError:  # an unreadable cache is a cache miss, never a failed evaluation
            return None
        if row is None:
            return None
        try:
            d = json.loads(row[0])
            return Baseline(d["timing"], d["compile_baseline"], d["sol"], row[1])
        except (ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, task_sha256: str, machine: str, baseline: Baseline) -> Baseline:
        """Store (or replace) a baseline; returns it with its measurement time."""
        stamped = Baseline(baseline.timing, baseline.compile_baseline, baseline.sol,
                           datetime.now(timezone.utc).isoformat(timespec="seconds"))
        body = json.dumps({"timing": stamped.timing, "compile_baseline": stamped.compile_baseline, "sol": stamped.sol})
        for attempt in range(3):
            try:
                with closing(self._connect()) as conn, conn:
                    conn.execute("INSERT OR REPLACE INTO baselines VALUES (?, ?, ?, ?, ?)",
                                 (key, task_sha256, machine, stamped.measured_at, body))
                break
            except sqlite3.OperationalError:  # locked by another run for over a minute: try again, then give up
                time.sleep(1.0 + attempt)
        return stamped

