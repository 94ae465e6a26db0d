"""Reference outputs kept across batches (harness/process/reference_cache.py) through the Evaluator: with
`reuse_verdicts`, a new program of a known task is compared with the reference an earlier evaluator of the process
kept, its reference worker not run, and gets the result a run would give; nothing of it reaches the disk, where a
candidate could read it; another deciding setting or another task runs it; the option off keeps nothing."""

from __future__ import annotations

import time
import uuid
from dataclasses import fields, replace

import pytest

from conftest import EXAMPLES
from dice_kernels.harness import EvalConfig, Outcome, RobustConfig, TimingConfig, candidate_from_text
from dice_kernels.harness.process.host_memory import OutputLedger, task_need_bytes
from dice_kernels.harness.process.reference_cache import KEPT_REFERENCES, reference_key
from dice_kernels.harness.references import BatchReferences, Deferred
from dice_kernels.report.eval_report import reused_references
from dice_kernels.harness.runner import Evaluator
from dice_kernels.tasks import load_task_file, task_from_code

BASE = load_task_file(EXAMPLES / "tasks" / "level1" / "19_ReLU.py")
HEADER = "import torch\nimport torch.nn as nn\n\n"


def _task(id: str = BASE.id):
    """A task no other test evaluated (its code is part of the key), so nothing is kept for it yet."""
    return task_from_code(BASE.code + f"\n# {uuid.uuid4()}\n", id=id, name=BASE.name, level=BASE.level)


def _python(forward: str, top: str = "") -> str:
    """A ModelNew without an extension (nothing to compile): deceptive with the robust check on."""
    return HEADER + top + f"\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        {forward}\n"


def _evaluate(config: EvalConfig, pairs: list) -> tuple[list, int]:
    """The results, and how many reference workers ran (a run job without candidate code)."""
    with Evaluator(config) as ev:
        run, ran = ev.workers.run, []

        def recording(job, task_code, code, *args, **kwargs):
            ran.append(code is None)
            return run(job, task_code, code, *args, **kwargs)

        ev.workers.run = recording
        return ev.evaluate(pairs), sum(ran)


def _kept(config: EvalConfig, task) -> dict | None:
    """What the process keeps for `task` under `config`'s deciding settings."""
    with Evaluator(config) as ev:
        context = ev.references.kept_context
    return KEPT_REFERENCES.get(reference_key(context, task.sha256)) if context else None


def _files_holding(root, needle: bytes, since: float) -> list:
    """Files under `root` written since `since` (up to 64 MiB: not the precompiled headers) that hold `needle`."""
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_mtime >= since
            and p.stat().st_size < 64 << 20 and needle in p.read_bytes()]


def _untimed(build_cache) -> EvalConfig:
    return EvalConfig(backend="cpu", cache_dir=build_cache, trials=2, reuse_verdicts=True,
                      timing=TimingConfig(enabled=False))


@pytest.mark.slow  # three evaluators, candidates that compile nothing
def test_a_new_program_of_a_known_task_reuses_its_reference_and_gets_the_same_result(build_cache):
    task, began = _task(), time.time()
    # timed with short loops: a kept reference stands in where the baseline is reused (the default), and both
    # batches below take the baseline the first one measured. The robust check off: PyTorch candidates are correct
    config = EvalConfig(backend="cpu", cache_dir=build_cache, trials=2, reuse_verdicts=True,
                        timing=TimingConfig(iters=5, max_s=0.3), robust=RobustConfig(enabled=False))
    first, refs = _evaluate(config, [(task, candidate_from_text(_python("return torch.relu(x)"), id="first"))])
    assert refs == 1 and not first[0].reference.reused_from
    kept = _kept(config, task)
    assert kept is not None
    # reads are not confined (docs/harness.md): no file may hold what a candidate's outputs are compared with
    needle = kept["outputs"][0][0].flatten()[:64].numpy().tobytes()
    assert not _files_holding(build_cache, needle, began)

    second = [(task, candidate_from_text(_python("return x.clamp(min=0)"), id="second"))]
    reused, refs = _evaluate(config, second)
    assert refs == 0
    [honest] = reused
    assert honest.outcome is Outcome.CORRECT and honest.reference.reused_from and honest.duplicate_of == ""
    assert honest.phases.seconds["reference"] < 0.5  # the lookup, not the earlier run's seconds
    assert reused_references(reused) == {"tasks": 1, "reused": 1, "computed": [honest.reference.reused_from] * 2}

    fresh, refs = _evaluate(replace(config, reuse_verdicts=False), second)
    assert refs == 1 and not fresh[0].reference.reused_from
    # everything but the work's seconds, the build (cached by now), the candidate's own times and where the
    # reference came from
    mine = {"wall_s", "phases", "build", "compile_s", "reference", "cand_time_ms", "speedup", "timing", "timing_trials"}
    for f in fields(fresh[0]):
        if f.name not in mine:
            assert getattr(honest, f.name) == getattr(fresh[0], f.name), f.name
    assert honest.ref_time_ms == fresh[0].ref_time_ms and honest.timing_trials and fresh[0].timing_trials
    assert honest.reference.baseline == fresh[0].reference.baseline


@pytest.mark.slow  # five evaluators, untimed, candidates that compile nothing
def test_another_deciding_setting_task_or_a_full_budget_runs_the_reference(build_cache):
    task, config = _task(), _untimed(build_cache)
    pair = [(task, candidate_from_text(_python("return torch.relu(x)"), id="a"))]
    other = candidate_from_text(_python("return x.clamp(min=0)"), id="b")  # a new program: no kept verdict answers
    assert _evaluate(config, pair)[1] == 1
    # a scheduling setting decides nothing; another task is another reference
    results, refs = _evaluate(replace(config, scheduler=replace(config.scheduler, run_workers=2)),
                              [(task, other), (_task("L1/19b"), other)])
    assert refs == 1 and results[0].reference.reused_from and not results[1].reference.reused_from
    assert _evaluate(replace(config, atol=0.02), [(task, other)])[1] == 1
    # outputs larger than the whole budget are not kept (the ReLU's two trials take 2 MiB)
    small = replace(config, seed=config.seed + 1, scheduler=replace(config.scheduler, reference_cache_mb=1))
    assert _evaluate(small, pair)[1] == 1 and _kept(small, task) is None

    with Evaluator(config) as ev:
        # a kept reference is admitted like a run's first frame: deferred while another task holds the budget
        ledger = OutputLedger(budget=1)
        refs = BatchReferences(ev.reference, config.trials, {task.id: 1, "other": 1}, ledger, in_flight=1)
        assert ledger.reserve("other", 1)
        with pytest.raises(Deferred):
            refs.get(task)
        ledger.release("other")
        ref, _ = refs.get(task)
        assert ref.reused_from and ledger.held() == task_need_bytes(4 * 64 * 4096, config.trials, 1)


@pytest.mark.slow
def test_without_reuse_verdicts_nothing_is_kept(build_cache):
    task, config = _task(), replace(_untimed(build_cache), reuse_verdicts=False)
    results, refs = _evaluate(config, [(task, candidate_from_text(_python("return torch.relu(x)"), id="a"))])
    assert refs == 1 and results[0].outcome is Outcome.DECEPTIVE
    assert _kept(replace(config, reuse_verdicts=True), task) is None


def test_two_different_tasks_under_one_id_are_refused_before_anything_runs(build_cache):
    """A batch keeps one reference per task id: a second task under the same id would be judged by the first's
    outputs. The same task twice is fine (its candidates share the reference)."""
    cand = candidate_from_text(_python("return torch.relu(x)"), id="a")
    with pytest.raises(ValueError, match=f"two different tasks share the id '{BASE.id}'"):
        _evaluate(_untimed(build_cache), [(_task(), cand), (_task(), cand)])
    task = _task()
    results, refs = _evaluate(_untimed(build_cache), [(task, cand), (task, candidate_from_text(_python(
        "return x.clamp(min=0)"), id="b"))])
    assert [r.outcome for r in results] == [Outcome.DECEPTIVE] * 2 and refs == 1
