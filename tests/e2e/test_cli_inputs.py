"""A newcomer's bad inputs, through the real `dice` command: each is one line naming the file or flag and what to
do, exit code 2, no traceback, and it fails before any build (no worker, no torch import where none is needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "dice_kernels" / "examples"
TASK = EXAMPLES / "tasks" / "level1" / "19_ReLU.py"
SOLUTION = EXAMPLES / "solutions" / "cpu" / "level1" / "19_ReLU" / "correct.py"


def _damaged_run(tmp: Path) -> Path:
    (tmp / "damaged").mkdir()
    (tmp / "damaged" / "results.sqlite").write_text("not a database\n")
    return tmp / "damaged"


def _run(tmp: Path, settings: dict | None = None, name: str = "run") -> Path:
    """A run directory as `dice eval` leaves it (its database and stored settings; by default today's, trials 5)."""
    from dice_kernels.harness.config import EvalConfig
    from dice_kernels.harness.store import ResultStore

    store = ResultStore(tmp / name / "results.sqlite")
    store.set_meta("config", settings or {k: str(v) for k, v in EvalConfig(backend="cpu").settings().items()})
    store.close()
    return tmp / name


# settings as a version before the nested EvalConfig stored them: flat names
FLAT_SETTINGS = {"backend": "cpu", "trials": "5", "timing": "True", "timing_iters": "20", "run_timeout_s": "300.0"}


def _file(tmp: Path, name: str, data: bytes) -> Path:
    (tmp / name).write_bytes(data)
    return tmp / name


def _checkpoint_without_config(tmp: Path) -> Path:
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "model.safetensors").write_bytes(b"")
    return tmp / "ckpt"


EVAL = ("eval", "--task", str(TASK), str(SOLUTION), "--backend", "cpu")
# (case, argv given a tmp dir, what the one line says)
BAD_INPUTS = [
    ("out is a file", lambda t: [*EVAL, "--out", str(_file(t, "f", b""))], "--out {t}/f: exists and is not a directory"),
    ("out under a file", lambda t: [*EVAL, "--out", str(_file(t, "f", b"")) + "/run"],
     "--out {t}/f/run: cannot write there (Not a directory)"),
    ("non-UTF-8 JSONL", lambda t: ["eval", "--tasks", str(_file(t, "tasks.jsonl", b'\xff{"code": 1}\n')),
                                   "--solutions", str(t)], "{t}/tasks.jsonl: not UTF-8 text (byte 0xff at offset 0)"),
    ("non-UTF-8 task file", lambda t: ["eval", "--task", str(_file(t, "19_ReLU.py", b"x = '\xe9'\n")), str(SOLUTION)],
     "{t}/19_ReLU.py: not UTF-8 text"),
    ("damaged results.sqlite, --resume", lambda t: [*EVAL, "--out", str(_damaged_run(t)), "--resume"],
     "--resume {t}/damaged: results.sqlite is not a readable results database"),
    ("damaged results.sqlite, report", lambda t: ["report", str(_damaged_run(t))],
     "dice report {t}/damaged: results.sqlite is not a readable results database"),
    ("existing run without --resume", lambda t: [*EVAL, "--out", str(_run(t))],
     "--out {t}/run already holds a run: add --resume to continue it, --overwrite to replace it"),
    ("resume with other settings", lambda t: [*EVAL, "--out", str(_run(t)), "--resume", "--trials", "3"],
     "--resume: {t}/run was evaluated with other settings (trials: 5 -> 3)"),
    ("an allowed op that is no ATen op", lambda t: [*EVAL, "--robust-allow-ops", "mm"],
     "--robust-allow-ops takes ATen op names such as aten::mm, not mm"),
    ("resume a run stored with flat settings", lambda t: [*EVAL, "--out", str(_run(t, FLAT_SETTINGS, "flat")),
                                                          "--resume"],
     "--resume: {t}/flat was recorded by an older dice whose settings have other names (run_timeout_s, timing, "
     "timing_iters, ...)"),
    ("resume a missing run", lambda t: [*EVAL, "--out", str(t / "nothing"), "--resume"],
     "--resume: {t}/nothing holds no run"),
    ("resume without --out", lambda t: [*EVAL, "--resume"], "--resume needs --out"),
    ("--trials 0", lambda t: [*EVAL, "--trials", "0"], "--trials must be at least 1"),
    ("--trials -1", lambda t: [*EVAL, "--trials", "-1"], "--trials must be at least 1"),
    ("--build-jobs -3", lambda t: [*EVAL, "--build-jobs", "-3"], "--build-jobs must be at least 1, not -3"),
    ("memory above the machine's", lambda t: [*EVAL, "--sandbox-memory-limit-gb", "100000"],
     "--sandbox-memory-limit-gb must be at most this machine's memory"),
    ("unknown backend", lambda t: [*EVAL, "--backend", "gpu"], "--backend must be 'cpu', 'cuda' or 'auto'"),
    ("checkpoint without config.json", lambda t: ["generate", "-c", str(_checkpoint_without_config(t)), "-p", "hi"],
     "--checkpoint {t}/ckpt: no config.json"),
    ("data build without sources", lambda t: ["data", "build", "--out", str(t / "d")], "give at least one source"),
]


@pytest.mark.parametrize("case,argv,message", BAD_INPUTS, ids=[c for c, _, _ in BAD_INPUTS])
def test_a_bad_input_is_one_line_and_exit_code_2(tmp_path, case, argv, message):
    r = subprocess.run([sys.executable, "-m", "dice_kernels", *argv(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "DICE_CACHE_DIR": str(tmp_path / "cache")}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr  # one line, no traceback
    assert message.format(t=tmp_path) in r.stderr
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_data_build_without_the_data_extra_names_the_install(tmp_path):
    """The [data] extra missing (datasketch hidden from the import system in a real `dice` process)."""
    code = ("import sys; sys.modules['datasketch'] = None; sys.argv = ['dice', 'data', 'build', '--out', sys.argv[1], "
            "'--dice-pairs', sys.argv[1]]; from dice_kernels.cli import app; app()")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "needs the [data] extra (datasketch is not installed): pip install 'dice-kernels[data]'" in r.stderr


def test_input_errors_fail_without_importing_torch():
    """`dice eval`'s input checks run before torch is imported (a bad flag costs a fraction of a second)."""
    code = ("import sys; from dice_kernels.cli import app; sys.argv = ['dice', 'eval', '--trials', '0']\n"
            "try:\n    app()\nexcept SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], r.stderr
