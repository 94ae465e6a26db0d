"""harness/store.py's verdict cache through the Evaluator: with `reuse_verdicts`, a program evaluated in an earlier run gets that
verdict without running (in a new evaluator, under another candidate id); another setting, or the option off,
evaluates it again, except that an untimed run takes the same settings' timed verdict (without its times)."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from conftest import EXAMPLES
from dice_kernels.harness import EvalConfig, TimingConfig, load_candidate
from dice_kernels.harness.runner import Evaluator
from dice_kernels.tasks import load_task_file, task_from_code

SOLUTIONS = EXAMPLES / "solutions" / "cpu" / "level1" / "19_ReLU"


class CountingEvaluator(Evaluator):
    """Counts the candidates it runs."""

    runs = 0

    def run(self, *args, **kwargs):
        CountingEvaluator.runs += 1
        return super().run(*args, **kwargs)


def _evaluate(config: EvalConfig, pairs: list, out) -> tuple[list, int]:
    CountingEvaluator.runs = 0
    with CountingEvaluator(config) as ev:
        results = ev.evaluate(pairs, out_dir=out)
    return results, CountingEvaluator.runs


@pytest.mark.slow  # two C++ builds (the session's cache) and a few runs
def test_an_earlier_verdict_is_given_without_running_and_only_under_the_same_settings(tmp_path, build_cache):
    base = load_task_file(EXAMPLES / "tasks" / "level1" / "19_ReLU.py")
    # a task no other test evaluated (its code is part of the key), so the first run cannot find a verdict
    task = task_from_code(base.code + f"\n# {uuid.uuid4()}\n", id=base.id, name=base.name, level=base.level)
    correct, wrong = SOLUTIONS / "correct.py", SOLUTIONS / "wrong.py"
    # short timing loops (timed, not measured precisely): the settings a verdict is kept under all the same
    config = EvalConfig(backend="cpu", cache_dir=build_cache, trials=2, reuse_verdicts=True,
                        timing=TimingConfig(iters=5, max_s=0.3))

    first, runs = _evaluate(config, [(task, load_candidate(correct, id="a")), (task, load_candidate(wrong, id="w"))],
                            tmp_path / "first")
    assert runs == 2 and [r.outcome.value for r in first] == ["correct", "value_mismatch"]
    assert [r.duplicate_of for r in first] == ["", ""]

    # a new evaluator (another run), new ids, and a duplicate within the batch: nothing runs
    again = [(task, load_candidate(correct, id="b")), (task, load_candidate(wrong, id="w2")),
             (task, load_candidate(correct, id="b2"))]
    second, runs = _evaluate(config, again, tmp_path / "second")
    assert runs == 0
    assert [(r.candidate_id, r.outcome.value, r.duplicate_of) for r in second] == [
        ("b", "correct", "a"), ("w2", "value_mismatch", "w"), ("b2", "correct", "a")]
    assert second[1].max_abs_diff == first[1].max_abs_diff and second[0].wall_s == 0.0

    # another setting decides another verdict, and the option off measures afresh
    _, runs = _evaluate(replace(config, trials=3), again[:2], tmp_path / "third")
    assert runs == 2
    _, runs = _evaluate(replace(config, reuse_verdicts=False), again[:2], tmp_path / "fourth")
    assert runs == 2

    # untimed, the same settings' timed verdict is taken, its times dropped; timed, an untimed verdict never is
    no_timing = replace(config, timing=replace(config.timing, enabled=False))
    fifth, runs = _evaluate(no_timing, again[:2], tmp_path / "fifth")
    assert runs == 0 and [(r.outcome.value, r.duplicate_of) for r in fifth] == [("correct", "a"), ("value_mismatch", "w")]
    assert first[0].speedup is not None and fifth[0].speedup is None and fifth[0].timing is None
    fresh = task_from_code(base.code + f"\n# {uuid.uuid4()}\n", id=base.id, name=base.name, level=base.level)
    _, runs = _evaluate(no_timing, [(fresh, load_candidate(correct, id="u"))], tmp_path / "sixth")
    assert runs == 1
    timed, runs = _evaluate(config, [(fresh, load_candidate(correct, id="t"))], tmp_path / "seventh")
    assert runs == 1 and timed[0].duplicate_of == "" and timed[0].speedup is not None
