"""The README's "From data to a benchmark, on a CPU" block, run as written from a temporary folder: each command
(`dice` as this interpreter's `python -m dice_kernels`) must succeed and leave what the next one reads. The corpora
the block says to fetch come from ../shared/data (skipped when absent, as in a fresh clone)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
FETCHED = {"dice_infill_eval_99.json": SHARED / "corpora" / "dice_infill_eval_99.json",
           "tasks.jsonl": SHARED / "kernelbench" / "tasks.jsonl"}


def readme_commands() -> list[list[str]]:
    """The commands of the README's marked block: comments dropped, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- readme-sequence: begin -->\n```bash\n(.*?)```\n<!-- readme-sequence: end -->", text,
                      re.S)
    assert block, "README.md lost its readme-sequence block"
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]


def test_the_readme_block_names_only_dice_commands():
    commands = readme_commands()
    assert [c[:3] for c in commands] == [["dice", "data", "build"], ["dice", "train", "sft"],
                                         ["dice", "train", "rl"], ["dice", "bench", "-c"],
                                         ["dice", "generate", "-c"]]


@pytest.mark.slow
@pytest.mark.skipif(not all(p.is_file() for p in FETCHED.values()), reason="../shared/data corpora absent")
def test_the_readme_sequence_runs_from_a_temporary_folder(tmp_path, build_cache):
    (tmp_path / "data").mkdir()
    for name, source in FETCHED.items():
        shutil.copy(source, tmp_path / "data" / name)
    env = {**os.environ, "DICE_CACHE_DIR": str(build_cache), "COLUMNS": "200"}
    for command in readme_commands():
        r = subprocess.run([sys.executable, "-m", "dice_kernels", *command[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{shlex.join(command)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (tmp_path / "runs" / "rl-tiny" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "bench-tiny" / "report.md").is_file()
