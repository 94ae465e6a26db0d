"""Workers forked from the fork server: each is a fresh process in its own session with its own directory,
environment and priority; how it ended reaches the parent; a dead server makes the parent start workers itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES
import dice_kernels
from dice_kernels.harness import BuildConfig, EvalConfig, SchedulerConfig, candidate_from_text, evaluate
from dice_kernels.harness.process import sandbox
from dice_kernels.harness.process.forkserver import ForkedProcess, ForkServer, ForkServerDown
from dice_kernels.harness.process.pool import WorkersCannotStart
from dice_kernels.harness.timing.platform import Platform
from dice_kernels.harness.runner import Evaluator
from dice_kernels.tasks import load_task_file


def _evaluator(tmp_path, build: BuildConfig | None = None, **scheduler) -> Evaluator:
    config = EvalConfig(backend="cpu", cache_dir=tmp_path, build=build or BuildConfig(),
                        scheduler=SchedulerConfig(warm_workers=0, **scheduler))
    return Evaluator(config, Platform.detect("cpu"))


def test_a_forked_worker_is_a_fresh_confinable_process_of_its_own(tmp_path):
    ev = _evaluator(tmp_path, build=BuildConfig(nice=5))
    try:
        worker = ev.workers.take("build")
        other = ev.workers.take("run")
        assert isinstance(worker.proc, ForkedProcess) and ev.workers.server_down is None
        pid = worker.proc.pid
        assert pid != other.proc.pid and pid != os.getpid()
        assert os.getsid(pid) == pid  # its own session: killing its group reaches nothing else
        assert os.readlink(f"/proc/{pid}/cwd") == str(worker.workdir)
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)
        assert os.getpriority(os.PRIO_PROCESS, other.proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        sandbox.discard(worker)
        assert worker.proc.returncode == -signal.SIGKILL  # relayed by the server, which reaped it
        sandbox.discard(other)
    finally:
        ev.close()


_REPORTS_ITS_ENVIRONMENT = """
import os, subprocess, sys, tempfile
seen = {"python": os.environ["HOME"], "child": subprocess.check_output(["sh", "-c", "printf %s $TMPDIR"]).decode(),
        "tempfile": tempfile.gettempdir(), "cwd": os.getcwd(), "path0": sys.path[0],
        "extensions": os.environ["TORCH_EXTENSIONS_DIR"]}
raise RuntimeError("seen " + repr(seen))
"""


def test_a_forked_worker_runs_in_its_own_directory_and_environment_and_so_do_its_children(tmp_path):
    import ast

    task = load_task_file(EXAMPLES / "tasks" / "level1" / "19_ReLU.py")
    (result,) = evaluate([(task, candidate_from_text(_REPORTS_ITS_ENVIRONMENT, id="env"))],
                         EvalConfig(backend="cpu", cache_dir=tmp_path), progress=False)
    assert result.outcome.value == "python_error"
    seen = ast.literal_eval(result.error[result.error.index("seen ") + 5:].splitlines()[0])
    workdir = seen["cwd"]
    assert re.fullmatch(r".*/dice-eval-[^/]+/\d{6}", workdir)  # a worker's own directory, not the server's
    assert seen["python"] == seen["child"] == seen["tempfile"] == seen["path0"] == workdir
    assert seen["extensions"] == workdir + "/torch_extensions"


def test_a_worker_that_fails_before_its_job_reports_it_on_stderr_with_its_exit_code(tmp_path):
    ev = _evaluator(tmp_path)
    try:
        worker = ev.workers.take()
        assert isinstance(worker.proc, ForkedProcess)
        exit_ = sandbox.supervise(worker, str(tmp_path / "no-such-job.json"), timeout_s=60)
        assert exit_.returncode == 1 and not exit_.timed_out
        assert "no-such-job.json" in exit_.stderr and "Traceback" in exit_.stderr
    finally:
        ev.close()


def test_when_the_server_dies_its_workers_are_ended_and_new_ones_start_the_usual_way(tmp_path):
    ev = _evaluator(tmp_path)
    try:
        waiting = ev.workers.take()
        assert isinstance(waiting.proc, ForkedProcess)
        os.kill(ev.workers.server._proc.pid, signal.SIGKILL)
        assert waiting.proc.wait() == -signal.SIGKILL  # ended by the parent: its status would never come
        assert ev.workers.server.down
        fresh = ev.workers.take()
        assert not isinstance(fresh.proc, ForkedProcess) and fresh.proc.poll() is None
        sandbox.discard(fresh)
        sandbox.discard(waiting)
    finally:
        ev.close()


def test_workers_import_torch_themselves_when_forking_is_off(tmp_path):
    ev = _evaluator(tmp_path, fork_workers=False)
    try:
        worker = ev.workers.take()
        assert not isinstance(worker.proc, ForkedProcess) and ev.workers.server is None
        sandbox.discard(worker)
    finally:
        ev.close()


def test_a_server_whose_imports_fail_says_why(tmp_path):
    shadow = tmp_path / "shadow" / "dice_kernels"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    env = sandbox.scrubbed_env(tmp_path, {"PYTHONPATH": str(shadow.parent)})
    with pytest.raises(ForkServerDown, match=r"exited \(1\).*broken on purpose"):
        ForkServer(cwd=tmp_path / "server", env=env)


def _threads_after_import(env: dict[str, str]) -> int:
    code = "import os, dice_kernels.harness.worker.main; print(len(os.listdir('/proc/self/task')))"
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout)


def test_a_server_that_cannot_fork_safely_refuses_and_workers_start_as_interpreters(tmp_path):
    ev = _evaluator(tmp_path, cpu_threads=2)  # OpenBLAS, through numpy, starts a thread pool at import
    try:
        if _threads_after_import(ev.workers.env(tmp_path)) == 1:
            pytest.skip("nothing the worker imports starts a thread here")
        worker = ev.workers.take()
        assert not isinstance(worker.proc, ForkedProcess)
        assert re.search(r"cannot fork safely: \d+ threads", ev.workers.server_down)
        sandbox.discard(worker)
    finally:
        ev.close()


def test_a_worker_imports_the_parents_package_from_its_own_directory(tmp_path, monkeypatch):
    # a relative PYTHONPATH (`PYTHONPATH=src python ...`) names nothing from a worker's private directory
    monkeypatch.setenv("PYTHONPATH", "src" + os.pathsep + str(tmp_path))
    env = sandbox.scrubbed_env(tmp_path, {})
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert all(os.path.isabs(p) for p in entries)
    assert entries[:2] == [os.path.abspath("src"), str(tmp_path)]
    code = "import dice_kernels; print(dice_kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).resolve() == Path(dice_kernels.__file__).resolve()


def test_workers_that_cannot_import_the_harness_stop_the_evaluation_instead_of_failing_each_candidate(
        tmp_path, monkeypatch):
    shadow = tmp_path / "shadow" / "dice_kernels"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))  # ahead of the parent's package in every worker
    task = load_task_file(EXAMPLES / "tasks" / "level1" / "19_ReLU.py")
    cand = candidate_from_text((EXAMPLES / "solutions" / "cpu" / "level1" / "19_ReLU" / "correct.py").read_text(),
                               id="relu")
    config = EvalConfig(backend="cpu", cache_dir=tmp_path / "cache", scheduler=SchedulerConfig(warm_workers=1))
    with pytest.raises(WorkersCannotStart, match="broken on purpose"):
        evaluate([(task, cand)], config)


def test_an_installed_package_is_not_put_ahead_of_the_standard_library(monkeypatch):
    import site

    monkeypatch.setattr(sandbox, "_PACKAGE_ROOT", Path(site.getsitepackages()[0]))  # a wheel's install
    assert sandbox.worker_pythonpath("a") == os.path.abspath("a")
    monkeypatch.setattr(sandbox, "_PACKAGE_ROOT", Path("/checkout/src"))  # an editable install or a checkout
    assert sandbox.worker_pythonpath("a") == os.pathsep.join([os.path.abspath("a"), "/checkout/src"])
