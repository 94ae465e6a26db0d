"""`dice eval` as a user runs it: real subprocesses, clear errors for bad input, and kill-then-resume."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "dice_kernels" / "examples"
TASK = EXAMPLES / "tasks" / "level1" / "19_ReLU.py"
SLOW_OK = ("import time\nimport torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n"
           "    def forward(self, x):\n        time.sleep({delay} + {i} * 1e-6)  # distinct programs: no dedupe\n"
           "        return torch.relu(x)\n")


def dice(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dice_kernels", *args], capture_output=True, text=True,
                          env=env, **kw)


def test_missing_solution_file_is_a_clear_error(tmp_path):
    r = dice("eval", "--task", str(TASK), str(tmp_path / "nope.py"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "solution file(s) not found" in r.stderr and "nope.py" in r.stderr


def test_bad_task_is_a_clear_error(tmp_path):
    bad = tmp_path / "7_Bad.py"
    bad.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    sol = tmp_path / "s.py"
    sol.write_text("x = 1\n")
    r = dice("eval", "--task", str(bad), str(sol), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "7_Bad.py" in r.stderr and "get_inputs" in r.stderr


def test_tasks_without_solutions_and_resume_without_out(tmp_path):
    r = dice("eval", "--tasks", str(EXAMPLES / "tasks"))
    assert r.returncode == 2 and "--solutions" in r.stderr
    r = dice("eval", "--task", str(TASK), str(TASK), "--resume")
    assert r.returncode == 2 and "--resume needs --out" in r.stderr


def _rows(db: Path) -> dict[str, tuple]:
    with sqlite3.connect(db) as con:
        return {cid: (rowid, wall) for rowid, cid, wall in con.execute("SELECT rowid, candidate_id, wall_s FROM results")}


def test_a_new_database_appears_with_its_tables(tmp_path):
    """A reader of a run that is starting (the kill-and-resume test below polls one) never sees a table-less file."""
    from dice_kernels.harness.store import ResultStore

    db = tmp_path / "run" / "results.sqlite"
    first = ResultStore(db)
    assert _rows(db) == {} and not list(db.parent.glob(".*.tmp"))
    second = ResultStore(db)  # an existing database is opened, not replaced
    assert second.path.stat().st_ino == first.path.stat().st_ino
    first.close()
    second.close()


@pytest.mark.slow
def test_kill_then_resume_loses_nothing_and_redoes_nothing(tmp_path, build_cache):
    sols = []
    for i in range(6):
        p = tmp_path / "sols" / f"s{i}.py"
        p.parent.mkdir(exist_ok=True)
        p.write_text(SLOW_OK.format(delay=0.3, i=i))
        sols.append(str(p))
    out = tmp_path / "run"
    env = {**os.environ, "DICE_CACHE_DIR": str(build_cache)}
    args = [sys.executable, "-m", "dice_kernels", "eval", "--task", str(TASK), *sols, "--out", str(out),
            "--backend", "cpu", "--build-jobs", "2", "--trials", "1", "--no-timing", "--no-progress"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    db = out / "results.sqlite"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if db.exists() and 1 <= len(_rows(db)) < len(sols):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to clean up: the worst case
    proc.wait()
    before = _rows(db)
    assert 1 <= len(before) < len(sols)

    r = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    after = _rows(db)
    assert set(after) == set(sols)
    for cid, row in before.items():  # finished results were neither lost nor evaluated again
        assert after[cid] == row
    assert (out / "report.md").exists() and (out / "results.jsonl").read_text().count("\n") == len(sols)


@pytest.mark.slow
def test_robust_switch_decides_whether_a_pytorch_rewrite_counts(tmp_path, build_cache):
    sol = tmp_path / "19_ReLU_torch.py"
    sol.write_text(SLOW_OK.format(delay=0, i=0))
    env = {**os.environ, "DICE_CACHE_DIR": str(build_cache)}
    outcomes = {}
    for flag in ("--robust", "--no-robust"):
        out = tmp_path / flag.strip("-")
        r = dice("eval", "--task", str(TASK), str(sol), "--out", str(out), "--backend", "cpu", "--trials", "1",
                 "--no-timing", "--no-progress", flag, env=env)
        assert r.returncode == 0, r.stderr
        row = json.loads((out / "results.jsonl").read_text())
        outcomes[flag] = (row["outcome"], row["deceptive_kind"])
    assert outcomes == {"--robust": ("deceptive", "pytorch_fallback"), "--no-robust": ("correct", "")}
    assert "eval 1/1 " in r.stderr and ": correct (" in r.stderr  # without a bar, a line per result (for logs)


def test_without_a_bar_a_heartbeat_names_what_is_in_flight_and_for_how_long(capsys):
    """A long unattended run (logs, no terminal) says every so often which candidates are in which phase, so one
    stuck in a build or a reference shows up by name instead of as silence."""
    from dice_kernels.harness.outcomes import Outcome
    from dice_kernels.harness.outcomes import EvalResult
    from dice_kernels.harness.progress import Progress

    bar = Progress(2, enabled=False, heartbeat_s=0.05)
    bar.phase("L1/11/slow", "build")
    bar.phase("L1/11/slow", "reference")
    bar.phase("L2/3/fast", "run")
    bar.phase("L3/1/later", "queued")  # waiting for a build slot or a run worker: counted, not listed
    time.sleep(0.3)
    bar.advance(EvalResult(task_id="L2/3", candidate_id="L2/3/fast", candidate_sha256="", outcome=Outcome.CORRECT,
                           correct=True, wall_s=1.5))
    time.sleep(0.3)
    bar.close()
    err = capsys.readouterr().err
    assert "L1/11/slow reference" in err and "L2/3/fast run" in err  # both in flight, each in its phase
    assert "eval 1/2 L2/3/fast: correct (1.5s)" in err
    last = [line for line in err.splitlines() if "in flight" in line][-1]
    assert last.startswith("eval 1/2 done") and "L2/3/fast" not in last  # a finished one leaves the list
    assert last.endswith("; 1 queued") and "L3/1/later" not in err


BIG_TASK = ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
            "        return torch.relu(x)\n\n\nbatch_size = 16\ndim = 2 ** 25  # 16 x 2^25 float32: 2 GiB\n\n\n"
            "def get_inputs():\n    x = torch.rand(batch_size, dim)\n    return [x]\n\n\n"
            "def get_init_inputs():\n    return []\n")


@pytest.mark.slow
def test_a_task_whose_inputs_cannot_fit_is_reported_before_it_runs_and_the_report_keeps_the_run(tmp_path, build_cache):
    """Over the memory limit: reported with the numbers and the flag, by the parent, before a worker could run out
    of memory on it (no worker is killed). Logs (stdout not a terminal) get a line per result by default, and
    `dice report` keeps the run's wall time and command."""
    task = tmp_path / "19_Big.py"
    task.write_text(BIG_TASK)
    sol = tmp_path / "sol.py"
    sol.write_text(SLOW_OK.format(delay=0, i=0))
    out = tmp_path / "run"
    env = {**os.environ, "DICE_CACHE_DIR": str(build_cache)}
    r = dice("eval", "--task", str(task), str(sol), "--out", str(out), "--backend", "cpu", "--sandbox-memory-limit-gb", "1",
             "--trials", "1", "--no-timing", env=env)
    assert r.returncode == 0, r.stderr
    row = json.loads((out / "results.jsonl").read_text())
    assert row["outcome"] == "harness_error" and row["details"]["task_flags"]["over_limits"]
    assert ("its inputs alone take 2.0 GiB (get_inputs), more than the 1 GiB a worker may hold (--sandbox-memory-limit-gb"
            in row["error"] and row["error"].endswith("not run)"))
    assert f"eval 1/1 {sol}: harness_error" in r.stderr  # no bar without a terminal: a line per result
    assert "raise --sandbox-memory-limit-gb" in (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tasks_whose_reference_exceeds_limits"] == ["19_Big"] and summary["wall_s"] > 0

    r = dice("report", str(out))
    assert r.returncode == 0, r.stderr
    again = json.loads((out / "summary.json").read_text())
    assert (again["wall_s"], again["command"]) == (summary["wall_s"], summary["command"])
