"""The package as a user installs it: the wheel built from this tree, installed into a fresh virtual environment
(torch and the other dependencies from the machine: --system-site-packages, --no-deps), and its `dice` run from a
temporary folder: shipped configs and their package resources (the tokenizer, the example tasks) resolve inside the
installed package, and a tiny random model generates."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_WHEEL_MB = 10  # the shipped Qwen3 tokenizer is most of it (11 MB of JSON, ~3 MB compressed)


@pytest.mark.slow
def test_the_wheel_installs_and_runs_from_a_temporary_folder(tmp_path):
    # build isolation would fetch setuptools from an index: build with the machine's (pyproject's build-system)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("dice_kernels-*.whl")
    assert wheel.stat().st_size < MAX_WHEEL_MB * 2**20
    names = zipfile.ZipFile(wheel).namelist()
    assert "dice_kernels/assets/qwen3-tokenizer/LICENSE" in names and "dice_kernels/train/configs/rl/tiny.toml" in names

    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, not this tree
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, env=env, timeout=600)
    (tmp_path / "work").mkdir()

    def dice(*argv: str) -> str:
        r = subprocess.run([str(tmp_path / "venv" / "bin" / "dice"), *argv], cwd=tmp_path / "work", env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    site = tmp_path / "venv" / "lib"
    rl = tomllib.loads(dice("train", "rl", "tiny", "--show"))
    for path in (rl["model"]["tokenizer"], rl["tasks"]["infill"], rl["tasks"]["solutions"]):
        assert Path(path).is_relative_to(site) and Path(path).is_dir(), path
    assert "memory plan" in dice("train", "sft", "tiny", "--plan")  # loads the shipped tokenizer
    dice("generate", "--random-init", "-p", "hi", "--max-new-tokens", "4")
