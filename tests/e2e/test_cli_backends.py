"""Backends as a user meets them (a real `dice eval`): CUDA code on the CPU backend is set aside as `needs_gpu`,
never built and not counted against Exec, and the report says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "dice_kernels" / "examples"


def test_cuda_code_on_the_cpu_backend_is_set_aside_not_failed(tmp_path, build_cache):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "dice_kernels", "eval", "--task",
                        str(EXAMPLES / "tasks" / "level1" / "19_ReLU.py"),
                        str(EXAMPLES / "solutions" / "cuda" / "level1" / "19_ReLU" / "correct.py"),
                        "--backend", "cpu", "--out", str(out), "--trials", "1", "--no-timing"],
                       capture_output=True, text=True, env={**os.environ, "DICE_CACHE_DIR": str(build_cache)},
                       timeout=600)
    assert r.returncode == 0, r.stderr
    row = json.loads((out / "results.jsonl").read_text())
    assert row["outcome"] == "needs_gpu" and "CUDA code (cuda_sources) on the CPU backend" in row["error"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["needs_gpu"] == 1 and summary["metrics"]["all"]["n"] == 0  # not counted against Exec
    assert "set aside on the CPU backend" in (out / "report.md").read_text()
