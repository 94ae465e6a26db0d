"""Workers started ahead of their job: each runs exactly one job, the pool refills, idle ones die on close;
build workers come from their own pool, at a lower CPU priority; a batch has as many builds in flight as
`jobs`."""

from __future__ import annotations

import os
import threading

import pytest

from conftest import EXAMPLES
from dice_kernels.harness import (BuildConfig, EvalConfig, SchedulerConfig, TimingConfig, candidate_from_text,
                                  evaluate)
from dice_kernels.harness.process import sandbox
from dice_kernels.harness.runner import Evaluator
from dice_kernels.harness.timing.platform import Platform
from dice_kernels.tasks import load_task_file


def test_each_job_gets_its_own_fresh_started_worker(tmp_path):
    ev = Evaluator(EvalConfig(backend="cpu", cache_dir=tmp_path, scheduler=SchedulerConfig(warm_workers=2)),
                   Platform.detect("cpu"))
    try:
        ev.workers.warm_up()
        waiting = list(ev.workers.ready["run"])
        assert len(waiting) == 2 and all(w.proc.poll() is None for w in waiting)
        first, second = ev.workers.take(), ev.workers.take()
        assert [first, second] == waiting  # the ones started ahead, oldest first
        assert first.proc.pid != second.proc.pid and first.workdir != second.workdir
        refills = list(ev.workers.ready["run"])
        assert len(refills) == 2 and not {id(w) for w in refills} & {id(first), id(second)}
        for taken in (first, second):  # a taken worker belongs to its job (supervise); here nobody runs it
            sandbox.discard(taken)
    finally:
        ev.close()
    assert all(w.proc.poll() is not None for w in refills)  # close kills every worker still waiting
    assert not ev.scratch.exists()


def test_no_workers_are_started_ahead_when_disabled(tmp_path):
    ev = Evaluator(EvalConfig(backend="cpu", cache_dir=tmp_path, scheduler=SchedulerConfig(warm_workers=0)),
                   Platform.detect("cpu"))
    try:
        ev.workers.warm_up()
        assert not ev.workers.ready["run"]
        worker = ev.workers.take()
        assert worker.proc.poll() is None and not ev.workers.ready["run"]
    finally:
        ev.close()


def test_build_workers_come_from_their_own_pool_at_a_lower_priority(tmp_path):
    import os

    config = EvalConfig(backend="cpu", cache_dir=tmp_path, build=BuildConfig(jobs=2, warm_workers=1, nice=7),
                        scheduler=SchedulerConfig(warm_workers=1))
    ev = Evaluator(config, Platform.detect("cpu"))
    try:
        ev.workers.warm_up(builds=2)
        assert not ev.workers.ready["build"]  # both builds start at once: none is started ahead
        ev.workers.warm_up(builds=5)
        waiting, (ahead,) = list(ev.workers.ready["run"]), list(ev.workers.ready["build"])
        build = ev.workers.take("build")
        assert build is ahead and list(ev.workers.ready["run"]) == waiting  # the run pool is left for runs
        (refill,) = ev.workers.ready["build"]
        assert refill is not build and refill.proc.poll() is None
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, build.proc.pid) == min(19, mine + 7)
        assert os.getpriority(os.PRIO_PROCESS, refill.proc.pid) == min(19, mine + 7)
        assert os.getpriority(os.PRIO_PROCESS, waiting[0].proc.pid) == mine
        sandbox.discard(build)
    finally:
        ev.close()
    assert refill.proc.poll() is not None


def test_run_workers_default_to_what_the_device_holds():
    config = EvalConfig()
    assert config.scheduler.resolved_run_workers("cpu", 0.0) == 1
    assert config.scheduler.resolved_run_workers("cuda", 23.6) == 4  # a 24 GB card keeps the old default
    assert config.scheduler.resolved_run_workers("cuda", 79.6) == 4
    assert config.scheduler.resolved_run_workers("cuda", 140.4) == 8  # an H200
    assert config.scheduler.resolved_warm_workers("cuda", 140.4) == 8
    assert SchedulerConfig(run_workers=3).resolved_run_workers("cuda", 140.4) == 3


def test_a_negative_build_pool_is_refused():
    with pytest.raises(ValueError, match="build.warm_workers must be 0"):
        EvalConfig(backend="cpu", build=BuildConfig(warm_workers=-1)).check()


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_batch_builds_up_to_jobs_at_once(tmp_path, jobs):
    """Real workers, three distinct programs that fail in Python (nothing to compile): as many build threads as `jobs`."""
    task = load_task_file(EXAMPLES / "tasks" / "level1" / "90_AddMul.py")
    code = (EXAMPLES / "solutions" / "cpu" / "level1" / "90_AddMul" / "no_modelnew.py").read_text()
    cands = [candidate_from_text(f"```python\n{code}\nVARIANT = {i}\n```", id=f"c{i}") for i in range(3)]
    seen: list[int] = []
    config = EvalConfig(backend="cpu", cache_dir=tmp_path, build=BuildConfig(jobs=jobs, fast=False),
                        timing=TimingConfig(enabled=False))  # no precompiled header: nothing here compiles
    results = evaluate([(task, c) for c in cands], config, progress=False,
                       on_result=lambda r: seen.append(sum(t.name.startswith("build") for t in threading.enumerate())))
    assert [r.outcome.value for r in results] == ["python_error"] * 3
    assert max(seen) == jobs


@pytest.mark.parametrize("memory, gib", [("143771", 140.4), ("[N/A]", 0.0)])
def test_the_gpu_is_read_from_nvidia_smi(tmp_path, monkeypatch, memory, gib):
    from dice_kernels.harness.timing import platform

    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho 'NVIDIA H200, 9.0, {memory}'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert platform._gpu_name_arch_memory() == ("NVIDIA H200", "9.0", gib)


def test_a_session_serves_consecutive_batches_with_the_workers_it_started_once(tmp_path):
    """`Evaluator` is long-lived (the RL reward calls it every step): the second batch is served by the same fork
    server, and by workers the first batch left started and waiting, not by a new set-up."""
    from dice_kernels.harness import Evaluator

    task = load_task_file(EXAMPLES / "tasks" / "level1" / "90_AddMul.py")
    code = (EXAMPLES / "solutions" / "cpu" / "level1" / "90_AddMul" / "no_modelnew.py").read_text()
    config = EvalConfig(backend="cpu", cache_dir=tmp_path, build=BuildConfig(jobs=1, fast=False),
                        scheduler=SchedulerConfig(warm_workers=1), timing=TimingConfig(enabled=False))
    with Evaluator(config) as ev:
        first = ev.evaluate([(task, candidate_from_text(f"```python\n{code}\nSTEP = 1\n```", id="a"))])
        server = ev.workers.server
        assert server is not None and server._proc.poll() is None
        waiting = list(ev.workers.ready["run"])  # started by the first batch, for the next job
        assert waiting and all(w.proc.poll() is None for w in waiting)
        second = ev.evaluate([(task, candidate_from_text(f"```python\n{code}\nSTEP = 2\n```", id="b"))])
        assert ev.workers.server is server and server._proc.poll() is None  # not restarted
        # the second batch's jobs ran in them: each exited on its own after its one job (close kills the idle)
        assert all(w.proc.poll() == 0 for w in waiting)
    assert [r.outcome.value for r in first + second] == ["python_error", "python_error"]
    assert [r.candidate_id for r in second] == ["b"]
    assert server._proc.poll() is not None  # closed on exit
