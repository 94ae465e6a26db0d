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
    ("data build, a mistyped source", lambda t: ["data", "build", "--out", str(t / "d"), "--dice-pairs",
                                                str(t / "pairs.jsn")], "input file(s) not found: {t}/pairs.jsn"),
    ("generate from a run folder", lambda t: ["generate", "-c", str(_run_folder(t)), "-p", "hi"],
     "--checkpoint {t}/sft is a training run folder: give its export, {t}/sft/final"),
    ("bench from a run folder", lambda t: ["bench", "-c", str(_run_folder(t)), "--backend", "cpu"],
     "--checkpoint {t}/sft is a training run folder: give its export, {t}/sft/final"),
    ("bench, a Hub id not in the cache", lambda t: ["bench", "-c", "JetLM/SDAR-4B-Chat", "--backend", "cpu"],
     "JetLM/SDAR-4B-Chat: no such folder, and the Hugging Face cache does not hold this Hub id: fetch it first "
     "(huggingface-cli download JetLM/SDAR-4B-Chat)"),
    ("train sft, a mistyped checkpoint", lambda t: ["train", "sft", "tiny", "--set", f"model.checkpoint={t}/ckpt"],
     "{t}/ckpt: no such checkpoint folder"),
    ("train rl, a checkpoint without config.json", lambda t: ["train", "rl", "tiny", "--set",
                                                              f"model.checkpoint={_checkpoint_without_config(t)}"],
     "{t}/ckpt: no config.json"),
    ("train rl, an unknown config", lambda t: ["train", "rl", "tiniest"], "tiniest: no such config file"),
]


def _run_folder(tmp: Path) -> Path:
    """A `dice train sft` run folder: its Hugging Face export is final/."""
    (tmp / "sft" / "final").mkdir(parents=True)
    (tmp / "sft" / "final" / "config.json").write_text("{}")
    return tmp / "sft"


@pytest.mark.parametrize("case,argv,message", BAD_INPUTS, ids=[c for c, _, _ in BAD_INPUTS])
def test_a_bad_input_is_one_line_and_exit_code_2(tmp_path, case, argv, message):
    r = subprocess.run([sys.executable, "-m", "dice_kernels", *argv(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "DICE_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
                            "HF_HUB_CACHE": str(tmp_path / "hub")}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr  # one line, no traceback
    assert message.format(t=tmp_path) in r.stderr
    assert not (tmp_path / "cache").exists()  # nothing was built


# (command, a module of its extra hidden from the import system, the extra the one line names)
MISSING_EXTRAS = [
    (["data", "build", "--out", "{t}/d", "--dice-pairs", str(TASK)], "datasketch", "data"),
    (["train", "sft", "tiny", "--set", "data.path={t}/sft.jsonl"], "transformers", "train"),
    (["train", "rl", "tiny"], "transformers", "train"),
    (["generate", "--random-init", "-p", "hi"], "transformers", "model"),
]


@pytest.mark.parametrize("argv,module,extra", MISSING_EXTRAS, ids=[" ".join(a[:2]) for a, _, _ in MISSING_EXTRAS])
def test_a_missing_extra_is_one_line_naming_the_install(tmp_path, argv, module, extra):
    """A real `dice` process without the extra's module: one line with the pip command, not a rank-0 traceback."""
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv = ['dice', *sys.argv[1:]]; "
            "from dice_kernels.cli import app; app()")
    r = subprocess.run([sys.executable, "-c", code, *(a.format(t=tmp_path) for a in argv)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"needs the [{extra}] extra ({module} is not installed): pip install 'dice-kernels[{extra}]'" in r.stderr


def _hub_cache(cache: Path, hub_id: str, files: dict[str, str]) -> None:
    """What `huggingface-cli download` leaves in $HF_HUB_CACHE: refs/main naming a snapshot that holds the files."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    for name, text in files.items():
        (repo / "snapshots" / commit / name).write_text(text)


def test_a_hub_id_in_the_cache_plans_offline_from_its_config_alone(tmp_path):
    """`--plan` with a Hub id whose cached snapshot holds config.json only (no weights), the network off."""
    import json

    from dice_kernels.model.config import SDAR_SHAPES

    _hub_cache(tmp_path / "hub", "JetLM/SDAR-8B-Chat", {"config.json": json.dumps(SDAR_SHAPES["8B"].to_hf())})
    r = subprocess.run([sys.executable, "-m", "dice_kernels", "train", "sft", "sdar-8b", "--plan", "--gpus", "8",
                        "--set", "model.checkpoint=JetLM/SDAR-8B-Chat"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 0, r.stderr
    assert "memory plan: " in r.stdout and "models--JetLM--SDAR-8B-Chat/snapshots/" in r.stdout


def test_rl_from_a_checkpoint_replaces_the_shipped_shape_and_shows_it(tmp_path):
    """`dice train rl tiny --set model.checkpoint=...` needs no second flag to clear the tiny shape; --show prints
    the config the run would use."""
    ckpt = _run_folder(tmp_path) / "final"
    r = subprocess.run([sys.executable, "-m", "dice_kernels", "train", "rl", "tiny", "--set",
                        f"model.checkpoint={ckpt}", "--show"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f'checkpoint = "{ckpt}"\nshape = ""\ntokenizer = ""' in r.stdout  # "": the checkpoint's tokenizer


def test_input_errors_fail_without_importing_torch():
    """`dice eval`'s input checks run before torch is imported (a bad flag costs a fraction of a second)."""
    code = ("import sys; from dice_kernels.cli import app; sys.argv = ['dice', 'eval', '--trials', '0']\n"
            "try:\n    app()\nexcept SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], r.stderr


def test_config_paths_resolve_from_any_working_directory(tmp_path):
    """Shipped configs name package resources (pkg:), found from any folder; a user's config names its inputs
    relative to its own folder; a --set path stays relative to the working directory."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "my.toml").write_text('[model]\nshape = "tiny"\ntokenizer = "pkg:assets/qwen3-tokenizer"\n'
                                              '[data]\npath = "d/sft.jsonl"\n')
    (tmp_path / "cwd").mkdir()

    def show(*argv: str) -> str:
        r = subprocess.run([sys.executable, "-m", "dice_kernels", "train", *argv, "--show"], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path / "cwd")
        assert r.returncode == 0, r.stderr
        return r.stdout

    import tomllib

    rl = tomllib.loads(show("rl", "tiny"))
    assert all(Path(p).is_dir() for p in (rl["model"]["tokenizer"], rl["tasks"]["infill"], rl["tasks"]["solutions"]))
    assert (Path(rl["model"]["tokenizer"]) / "tokenizer.json").is_file()
    sft = tomllib.loads(show("sft", str(tmp_path / "cfg" / "my.toml")))
    assert sft["data"]["path"] == str(tmp_path / "cfg" / "d" / "sft.jsonl")
    sft = tomllib.loads(show("sft", str(tmp_path / "cfg" / "my.toml"), "--set", "data.path=mine.jsonl"))
    assert sft["data"]["path"] == "mine.jsonl"
