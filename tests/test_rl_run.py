"""`dice train rl` as a user runs it: a TOML config, a run killed (SIGKILL) after a step, `--resume` finishing it
with one metrics curve, every step's rewards in SQLite, and a Hugging Face export. Toy tokenizer of code fragments
(tests/test_rl_loop.py), tiny random model, CPU backend: the rewards are real compiles and runs."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys

from conftest import EXAMPLES
from test_rl_loop import _toy_tokenizer


def _dice(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dice_kernels", "train", "rl", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=600)


def test_killed_run_resumes_to_the_end(tmp_path, build_cache):
    _toy_tokenizer().save_pretrained(tmp_path / "tok")
    out = tmp_path / "run"
    config = tmp_path / "rl.toml"
    config.write_text(f"""
out_dir = "{out}"
[model]
shape = "tiny"
tokenizer = "{tmp_path / 'tok'}"
[tasks]
e2e = "{EXAMPLES / 'tasks'}"
[rl]
phase = "e2e"
e2e_steps = 3
[rollout]
tasks_per_step = 2
group = 4
max_new_tokens = 1
[reward]
backend = "cpu"
trials = 1
cache_dir = "{build_cache}"
[optim]
lr = 1e-2
[checkpoint]
every_steps = 1
export_dtype = "float32"
[metrics]
progress = false
tensorboard = false
plot = false
[debug]
sigkill_after_step = 2
""")
    first = _dice([str(config)])
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    again = _dice([str(config)])  # without --resume: refused, one line, exit 2
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr
    resumed = _dice([str(config), "--resume", "--set", "debug.sigkill_after_step=0"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step 3/3 e2e: reward" in resumed.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # one curve: no step logged twice
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["rollouts"] == 8 and sum(row["outcomes"].values()) == 8
    assert {"reward_mean", "exec", "kl", "clip_fraction", "rollout_s", "reward_s", "update_s", "lr"} <= set(row)
    rewards = sqlite3.connect(out / "rewards.sqlite").execute(
        "SELECT step, COUNT(*) FROM rewards GROUP BY step").fetchall()
    assert rewards == [(0, 8), (1, 8), (2, 8)]
    state = json.loads((out / "checkpoints" / "step-00000003" / "train_state.json").read_text())
    assert state["curricula"]["e2e"]["position"] == 6  # 3 steps x 2 tasks: the curriculum went on where it stopped
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()
