"""The build cache across processes: a program is built once however many evaluators ask for it at the same time."""

from __future__ import annotations

import threading

from dice_kernels.harness import EvalConfig, SchedulerConfig
from dice_kernels.harness.runner import Evaluator
from dice_kernels.harness.timing.platform import Platform


def test_two_evaluators_building_one_program_at_once_build_it_once(tmp_path):
    # two evaluators stand for two processes on one cache (a reward service beside `dice eval`): the lock is a file
    # lock, which threads holding their own open files take in turn as processes do
    code = "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x.relu()\n"
    config = EvalConfig(backend="cpu", cache_dir=tmp_path / "cache", scheduler=SchedulerConfig(warm_workers=0))
    evaluators = [Evaluator(config, Platform.detect("cpu")) for _ in range(2)]
    builds, start = [None, None], threading.Barrier(2)

    def build(i: int) -> None:
        start.wait()
        builds[i] = evaluators[i].builds.build(code, began=0.0)

    try:
        threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for ev in evaluators:
            ev.close()
    assert all(b.ok for b in builds), [b.error for b in builds]
    assert sorted(b.cache_hit for b in builds) == [False, True]  # one built it, the other waited and found it
    assert builds[0].dir == builds[1].dir
