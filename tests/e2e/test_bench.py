"""`dice bench` on the CPU backend: a tiny random checkpoint through generation, evaluation and the report; a folder
of generations with known outcomes; a run killed by SIGKILL resumes without generating or evaluating anything again.

Cost: the generations-folder test builds two C++ extensions (the shipped ReLU solution and test_robust_check's
extension-never-called cheat, both shared with other tests through the session's build cache); everything else is
a tiny model's garbage output (generation_failure, no build)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from model_fixtures import save_tiny_checkpoint
from test_robust_check import CHEATS
from typer.testing import CliRunner

from dice_kernels.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "dice_kernels" / "examples"
RELU_CORRECT = (EXAMPLES / "solutions" / "cpu" / "level1" / "19_ReLU" / "correct.py").read_text()
FAST = ["--backend", "cpu", "--no-progress", "--trials", "2", "--no-timing", "--build-jobs", "2"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-ckpt")
    save_tiny_checkpoint(path)
    return path


def _bench(*args: str) -> str:
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def _generation_files(run: Path) -> dict[str, tuple[int, int]]:
    """Finished generation (its record is written last) -> mtimes (ns) of its text and record."""
    return {str(p.relative_to(run).with_suffix("")): (p.with_suffix(".md").stat().st_mtime_ns, p.stat().st_mtime_ns)
            for p in (run / "generations").rglob("s*.json")}


def _timing(run: Path, phase: str) -> list[dict]:
    return [r for line in (run / "timing.jsonl").read_text().splitlines() if (r := json.loads(line))["phase"] == phase]


def test_bench_with_a_tiny_checkpoint_writes_generations_and_the_report(checkpoint, tmp_path, build_cache):
    run = tmp_path / "run"
    output = _bench("-c", str(checkpoint), "--out", str(run), "--samples", "2", "--max-new-tokens", "24",
                    "--temperature", "1", "--seed", "0", "--cache-dir", str(build_cache), *FAST)
    assert "generating: 4/4 (" in output  # --no-progress: a line per generated output, for logs
    records = sorted((run / "generations").rglob("s*.json"))
    assert [p.relative_to(run / "generations").as_posix() for p in records] == [
        "level1/19_ReLU/s0.json", "level1/19_ReLU/s1.json", "level1/90_AddMul/s0.json", "level1/90_AddMul/s1.json"]
    record = json.loads(records[0].read_text())
    assert record["settings"]["decoding"]["block_size"] == 4 and record["settings"]["decoding"]["steps"] == 4
    assert record["settings"]["prompt_backend"] == "cpu" and record["tokens"] <= 24
    summary = json.loads((run / "summary.json").read_text())
    assert summary["n"] == 4 and summary["samples"] == 2
    assert sum(summary["metrics"]["all"]["outcomes"].values()) == 4
    assert summary["metrics"]["all"]["outcomes"]["harness_error"] == 0
    assert set(summary["pass_at_k"]["L1"]) == {f"{m}@{k}" for m in ("exec", "fast_1", "fast_2") for k in (1, 2)}
    assert summary["time"]["generated_outputs"] == 4 and summary["time"]["tokens_per_s"] > 0
    report = (run / "report.md").read_text()
    assert "L1 Exec | L1 fast_1 | L1 fast_2" in report and "Exec before" in report and "tokens/s" in report
    assert (run / "report.png").stat().st_size > 1000
    compared = _bench("compare", str(run), str(run))
    assert "| L1/19 |" in compared and "| L1/90 |" in compared
    # mistakes get one line naming the flag, exit status 2
    runner = CliRunner()
    other = runner.invoke(app, ["bench", "-c", str(checkpoint), "--out", str(run), "--samples", "2",
                                "--max-new-tokens", "32", "--cache-dir", str(build_cache), *FAST])
    assert other.exit_code == 2 and "other generation settings" in other.output
    neither = runner.invoke(app, ["bench", "--out", str(tmp_path / "x")])
    assert neither.exit_code == 2 and "exactly one of --checkpoint" in neither.output


@pytest.mark.slow  # two C++ builds (shared with test_harness_outcomes and test_robust_check in a full run)
def test_generations_folder_gives_exactly_the_expected_outcomes(tmp_path, build_cache):
    folder = tmp_path / "outputs" / "level1" / "19_ReLU"
    folder.mkdir(parents=True)
    (folder / "correct.md").write_text(f"Here is my kernel:\n\n```python\n{RELU_CORRECT}```\n")
    (folder / "deceptive.md").write_text(f"```python\n{CHEATS['extension_never_called'][0]}```\n")
    (folder / "truncated.md").write_text(f"```python\n{RELU_CORRECT[:300]}")  # cut off: the fence never closes
    run = tmp_path / "run"
    _bench("-g", str(tmp_path / "outputs"), "--out", str(run), "--cache-dir", str(build_cache), *FAST)
    m = json.loads((run / "summary.json").read_text())["metrics"]["all"]
    assert {k: v for k, v in m["outcomes"].items() if v} == {"correct": 1, "deceptive": 1, "generation_failure": 1}
    assert m["exec_rate"] == pytest.approx(1 / 3) and m["exec_before_robust"] == pytest.approx(2 / 3)
    assert m["deceptive_kinds"] == {"extension_unused": 1}
    summary = json.loads((run / "summary.json").read_text())
    # where the work went: the two programs that compiled were built (or found in the session's build cache) and run
    assert summary["phases"]["run"] > 0 and summary["built"] <= 2
    assert "Evaluation work by phase" in (run / "report.md").read_text()
    # a second run over the same folder evaluates nothing again
    out = _bench("-g", str(tmp_path / "outputs"), "--out", str(run), "--cache-dir", str(build_cache), *FAST)
    assert "0 to evaluate, 3 already recorded" in out
    assert json.loads((run / "summary.json").read_text())["metrics"]["all"]["outcomes"] == m["outcomes"]


def test_a_killed_run_resumes_without_generating_or_evaluating_again(checkpoint, tmp_path, build_cache):
    run = tmp_path / "run"
    args = ["-c", str(checkpoint), "--out", str(run), "--samples", "3", "--batch-size", "1", "--max-new-tokens",
            "32", "--temperature", "1", "--seed", "0", "--cache-dir", str(build_cache), *FAST]
    # first only one task, to completion: its generations and evaluations must carry over to the full run
    _bench(*args, "--task", "19_ReLU")
    first = _generation_files(run)
    assert len(first) == 3
    # the full run in a real process, killed (SIGKILL) once it has written one more generation; its output is kept
    # for the message of a run that ended on its own first
    log = tmp_path / "killed-run.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "dice_kernels", "bench", *args], stdout=sink,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            while proc.poll() is None and len(_generation_files(run)) < 4:
                time.sleep(0.01)  # polling the file system: the kill must land while the run is still going
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
    killed = _generation_files(run)
    assert len(killed) >= 4, f"exit status {proc.returncode}, {len(killed)} outputs:\n{log.read_text()[-3000:]}"
    assert {k: killed[k] for k in first} == first
    out = _bench(*args)
    done = _generation_files(run)
    assert len(done) == 6 and {k: done[k] for k in killed} == killed  # nothing written twice
    assert f"{6 - len(killed)} to generate, {len(killed)} already written" in out
    assert "3 already recorded" in out  # the 19_ReLU candidates, evaluated by the first run
    generated = sum(r["rows"] for r in _timing(run, "generate"))
    assert generated <= 6  # the killed run may die before logging its generation call, never regenerate an output
    out = _bench(*args)
    assert "0 to generate, 6 already written" in out and "0 to evaluate, 6 already recorded" in out
    assert _generation_files(run) == done
    assert json.loads((run / "summary.json").read_text())["n"] == 6


def test_pass_at_k_and_compare_on_recorded_results(tmp_path):
    from dice_kernels.harness import EvalResult, Outcome
    from dice_kernels.harness.outcomes import Timing
    from dice_kernels.report.bench_report import compare, pass_at, pass_at_k

    assert pass_at_k(5, 2, 1) == pytest.approx(0.4) and pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    with pytest.raises(ValueError, match="at least 3 samples"):
        pass_at_k(2, 1, 3)

    def result(task: str, sample: int, outcome: Outcome, speedup: float | None = None) -> EvalResult:
        timing = Timing(speedup_ci95=[speedup * 0.9, speedup * 1.1]) if speedup else None
        return EvalResult(task_id=task, candidate_id=f"{task}#s{sample}", candidate_sha256="x", outcome=outcome,
                          level=1, speedup=speedup, timing=timing)

    a = [result("L1/1", 0, Outcome.CORRECT, 2.5), result("L1/1", 1, Outcome.VALUE_MISMATCH),
         result("L1/2", 0, Outcome.COMPILE_ERROR), result("L1/2", 1, Outcome.COMPILE_ERROR)]
    b = [result("L1/1", 0, Outcome.COMPILE_ERROR), result("L1/2", 0, Outcome.CORRECT, 1.05)]
    exec_ok = lambda r: r.outcome is Outcome.CORRECT  # noqa: E731
    assert pass_at(a, 1, exec_ok) == pytest.approx(0.25) and pass_at(a, 2, exec_ok) == pytest.approx(0.5)
    for name, results in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text("".join(json.dumps(r.to_row()) + "\n" for r in results))
    text = compare(tmp_path / "a", tmp_path / "b")
    assert "| L1/1 | 1/2 correct, best 2.50× | compile_error | A only |" in text
    assert "| L1/2 | 0/2 correct | correct 1.05× | B only |" in text
