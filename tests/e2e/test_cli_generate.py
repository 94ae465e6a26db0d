"""`dice generate` without downloaded weights: a tiny random model over a byte tokenizer runs the command end to
end (prompt, block-diffusion decoding, the saved output), and a CPU task prompt asks for C++."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TASK = Path(__file__).resolve().parents[2] / "src" / "dice_kernels" / "examples" / "tasks" / "level1" / "19_ReLU.py"


def test_random_init_generates_and_saves_without_a_checkpoint(tmp_path):
    out = tmp_path / "answer.md"
    r = subprocess.run([sys.executable, "-m", "dice_kernels", "generate", "--random-init", "-p", "Write a ReLU.",
                        "--max-new-tokens", "8", "--seed", "3", "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[8 tokens in " in r.stderr and out.read_text() == r.stdout.removesuffix("\n")


def test_a_cpu_task_prompt_asks_for_cpp():
    from dice_kernels.prompts import e2e_user

    cpu, cuda = e2e_user(TASK.read_text(), "cpu"), e2e_user(TASK.read_text(), "cuda")
    assert "C++" in cpu and "cuda_sources" not in cpu and "CUDA" in cuda
