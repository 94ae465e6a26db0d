"""Every outcome of the taxonomy, produced by real candidates in real sandboxed workers (CPU backend).

The whole corpus is evaluated in one batch (module fixture); each test then checks one candidate's outcome.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from dice_kernels.harness import (BuildConfig, EvalConfig, Outcome, RobustConfig, SandboxConfig, SchedulerConfig,
                                  TimingConfig, candidate_from_text, evaluate)
from dice_kernels.tasks import load_tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "dice_kernels" / "examples"
ESCAPE = Path("/tmp") / f"dice-escape-{os.getpid()}"

HEADER = "import torch\nimport torch.nn as nn\n"
OK_MODEL = HEADER + textwrap.dedent("""
    class ModelNew(nn.Module):
        def forward(self, x):
            return torch.relu(x)
    """)


def _model(forward_body: str, top: str = "", init_args: str = "") -> str:
    """A ModelNew whose forward runs `forward_body` (one line, or lines joined with `; `)."""
    return (HEADER + top + "\nclass ModelNew(nn.Module):\n"
            f"    def __init__(self{init_args}):\n        super().__init__()\n\n"
            f"    def forward(self, x):\n        {forward_body}\n")


# name -> (candidate text, expected outcome, substring of the recorded error)
CORPUS = {
    "pytorch_relu": (OK_MODEL, Outcome.DECEPTIVE, "aten::relu"),  # robust check: PyTorch did the work
    "pytorch_relu_reformatted": ("# same program, other layout\n" + OK_MODEL.replace("(nn.Module)", "( nn.Module )"),
                                 Outcome.DECEPTIVE, "aten::relu"),
    "prose_only": ("I am sorry, I cannot write this kernel.", Outcome.GENERATION_FAILURE, "no code"),
    "truncated": ("```python\nimport torch\nclass ModelNew(torch.nn.Mod", Outcome.GENERATION_FAILURE, "truncated"),
    "syntax_error": ("```python\nimport torch\nclass ModelNew(:\n    pass\n```", Outcome.PYTHON_ERROR, "SyntaxError"),
    "no_modelnew": (HEADER + "class Other(nn.Module):\n    pass\n", Outcome.PYTHON_ERROR, "does not define class ModelNew"),
    "import_error": (HEADER + "import not_a_real_module\n" + OK_MODEL, Outcome.PYTHON_ERROR, "not_a_real_module"),
    "wrong_constructor": (_model("return x", init_args=", a, b"),
                          Outcome.PYTHON_ERROR, "constructor"),
    "wrong_forward": (HEADER + "class ModelNew(nn.Module):\n    def forward(self, x, y, z):\n        return x\n",
                      Outcome.PYTHON_ERROR, "forward"),
    "sys_exit_at_import": (HEADER + "import sys\nsys.exit(3)\n", Outcome.PYTHON_ERROR, "sys.exit(3)"),
    "os_exit_in_forward": (_model("import os; os._exit(0)"), Outcome.RUNTIME_ERROR, "without reporting"),
    "segfault": (_model("import ctypes; ctypes.string_at(0)"), Outcome.RUNTIME_ERROR, "SIGSEGV"),
    "raises": (_model("raise RuntimeError('kernel launch failed: bad grid')"), Outcome.RUNTIME_ERROR,
               "bad grid"),
    "hang": (_model("while True: pass"), Outcome.TIMEOUT, "wall-clock"),
    "huge_allocation": (_model("return torch.empty(1 << 40, dtype=torch.uint8)"), Outcome.MEMORY_ERROR, ""),
    "prints_gigabytes": (_model("import sys\n        while True: sys.stdout.write('x' * (1 << 20))"),
                         Outcome.TIMEOUT, ""),
    "writes_outside": (HEADER + f"open({str(ESCAPE)!r}, 'w').write('pwned')\n" + OK_MODEL, Outcome.PYTHON_ERROR,
                       "Permission"),
    "wrong_values": (_model("return x * 2"), Outcome.VALUE_MISMATCH, "values differ"),
    "wrong_shape": (_model("return x.sum(0)"), Outcome.SHAPE_MISMATCH, "shape"),
    "returns_list_of_two": (_model("return [torch.relu(x), x]"), Outcome.SHAPE_MISMATCH, "2 tensors"),
    "returns_string": (_model("return 'relu'"), Outcome.PYTHON_ERROR, "returned str"),
    # KernelBench execs task and solution into one namespace: a solution may use the task's globals (`dim`)
    "uses_task_globals": (_model("return torch.relu(x) if x.shape[-1] == dim else x"), Outcome.DECEPTIVE,
                          "aten::relu"),
    "big_file": (_model("open('big.bin', 'wb').write(b'0' * (64 << 20)); return torch.relu(x)"),
                 Outcome.RUNTIME_ERROR, "File too large"),
}


@pytest.fixture(scope="module")
def results(build_cache, tmp_path_factory):
    task = next(t for t in load_tasks(EXAMPLES / "tasks") if t.name == "19_ReLU")
    pairs = [(task, candidate_from_text(text, id=name)) for name, (text, _, _) in CORPUS.items()]
    # run_timeout_s: `hang` and `prints_gigabytes` each hold the one run worker (and a core) for all of it; every
    # other candidate's run takes under 0.4 s here, alone or beside three busy processes on the 2 cores
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=2, timeout_s=120),
                        timing=TimingConfig(enabled=False),
                        sandbox=SandboxConfig(run_timeout_s=8, memory_limit_gb=4, file_limit_mb=32))
    out = tmp_path_factory.mktemp("outcomes")
    res = evaluate(pairs, config, out_dir=out, progress=False)
    return {r.candidate_id: r for r in res}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CORPUS))
def test_outcome(results, name):
    _, expected, fragment = CORPUS[name]
    r = results[name]
    assert r.outcome is expected, f"{name}: {r.outcome} ({r.error})"
    assert fragment in r.error
    assert r.correct is False


@pytest.mark.slow
def test_a_program_differing_only_in_layout_is_evaluated_once(results):
    dup, first = results["pytorch_relu_reformatted"], results["pytorch_relu"]
    assert dup.duplicate_of == "pytorch_relu" and dup.candidate_sha256 != first.candidate_sha256
    assert results["pytorch_relu"].duplicate_of == ""


@pytest.mark.slow
def test_a_fallback_finding_carries_every_op_it_saw_with_counts(results):
    [finding] = [f for f in results["pytorch_relu"].robust.findings if f.kind == "pytorch_fallback"]
    assert finding.ops == {"aten::relu": 2}  # two correctness trials, one relu each; nothing else is compute


@pytest.mark.slow
def test_sandbox_blocked_the_write_and_isolated_the_network(results):
    assert not ESCAPE.exists()
    notes = results["pytorch_relu"].sandbox
    assert any("landlock" in n for n in notes) and any("network namespace" in n for n in notes)


@pytest.mark.slow
def test_example_set_real_cpp_extensions(build_cache, tmp_path, example_pairs):
    """The shipped CPU examples compile for real: correct ones pass and get a speedup, the rest fail as labelled."""
    pairs = example_pairs("cpu")
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=2),
                        timing=TimingConfig(iters=5, max_s=0.3))  # timed, not measured precisely
    res = {r.candidate_id: r for r in evaluate(pairs, config, out_dir=tmp_path, progress=False)}
    expected = {"19_ReLU/correct": Outcome.CORRECT, "19_ReLU/wrong": Outcome.VALUE_MISMATCH,
                "19_ReLU/broken": Outcome.COMPILE_ERROR, "90_AddMul/correct": Outcome.CORRECT,
                "90_AddMul/wrong_shape": Outcome.SHAPE_MISMATCH, "90_AddMul/no_modelnew": Outcome.PYTHON_ERROR}
    assert {k: r.outcome for k, r in res.items()} == expected
    assert "not declared" in res["19_ReLU/broken"].error
    for name in ("19_ReLU/correct", "90_AddMul/correct"):
        assert res[name].speedup and res[name].speedup > 0 and res[name].compile_s is not None
    # second evaluation: every build comes from the content-addressed cache (untimed: the cache's key is the code)
    again = evaluate(pairs, replace(config, timing=TimingConfig(enabled=False)), progress=False)
    assert all(r.build.cache_hit for r in again)


def test_a_time_faster_than_the_hardware_allows_is_quarantined(build_cache, tmp_path, example_pairs):
    """The speed-of-light bound, end to end (forced on for the CPU backend): the reference reports the task's bytes
    and FLOPs and measures this machine's ceilings once, into the cache; against ceilings the kernel cannot have
    beaten the result stands, and against ceilings it beat (as if the timing had been gamed) the correct candidate
    keeps its outcome but loses its speedup."""
    import json
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(build_cache, cache)
    ceilings_file = cache / "ceilings.json"
    ceilings_file.unlink(missing_ok=True)
    pairs = [p for p in example_pairs("cpu") if p[1].id == "19_ReLU/correct"]
    config = EvalConfig(backend="cpu", trials=2, cache_dir=cache, build=BuildConfig(jobs=2),
                        timing=TimingConfig(iters=5, max_s=0.3, speed_of_light="always"))

    def evaluate_with(bandwidth: float | None):
        if bandwidth is not None:
            ceilings = json.loads(ceilings_file.read_text())
            for per_dtype in ceilings.values():
                per_dtype["float32"].update(bandwidth_bytes_s=bandwidth, peak_flops=bandwidth)
            ceilings_file.write_text(json.dumps(ceilings))
        result, = evaluate(pairs, config, progress=False)
        assert result.outcome is Outcome.CORRECT
        return result

    evaluate_with(None)  # measures
    (measured,) = json.loads(ceilings_file.read_text()).values()
    assert measured["float32"]["bandwidth_bytes_s"] > 1e8 and measured["float32"]["peak_flops"] > 1e8

    honest = evaluate_with(1e18)
    assert honest.speedup and not honest.timing.speed_of_light.faster_than_light
    assert honest.timing.speed_of_light.bytes == 2 * 4 * 64 * 4096  # the ReLU task: input read, output written

    beaten = evaluate_with(1e3)
    assert beaten.speedup is None and "faster_than_light" in beaten.timing_flags
    assert beaten.timing.speed_of_light.quarantined_speedup > 0 and beaten.timing.speedup_ci95 is None


@pytest.mark.slow
def test_only_candidates_whose_trials_are_right_are_timed(build_cache, example_pairs):
    """The worker waits for the parent's verdict on its trials: a wrong candidate is never timed or profiled."""
    honest = next(p for p in example_pairs("cpu") if p[1].id == "19_ReLU/correct")
    pairs = [honest, (honest[0], candidate_from_text(_model("return x * 2"), id="wrong"))]
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=2),
                        timing=TimingConfig(warmup=2, iters=3, max_s=0.3))
    right, wrong = evaluate(pairs, config, progress=False)
    assert right.outcome is Outcome.CORRECT and right.speedup and "run.timing" in right.phases.seconds
    assert wrong.outcome is Outcome.VALUE_MISMATCH and wrong.timing_trials == 0 and wrong.cand_time_ms is None
    assert "run.verdict" in wrong.phases.seconds and "run.timing" not in wrong.phases.seconds


def test_the_worker_always_gets_a_verdict_even_on_unreadable_outputs():
    """A worker waiting for the verdict must never be left to its deadline: garbage gets "stop" and the error.
    A candidate's trials are judged as they arrive and only the re-checked call's outputs are kept."""
    import io

    import torch

    from dice_kernels.harness.compare import TrialJudge
    from dice_kernels.harness.process.pool import OutputLimits, _read_outputs
    from dice_kernels.harness.process.tensor_stream import StreamError, write_trials

    reference = [[torch.ones(3)], [torch.ones(3)]]
    said = []
    limits = OutputLimits(frame=1 << 20, total=1 << 21, trials=2)
    with pytest.raises(StreamError):
        _read_outputs(io.BytesIO(b"not a tensor stream"), limits, TrialJudge(reference, 0.01, 0.01), said.append)
    assert said == [b"stop\n"]

    def stream(*frames) -> io.BytesIO:
        f = io.BytesIO()
        for frame in frames:
            write_trials(f, frame)
        f.seek(0)
        return f

    # one frame per trial, then the re-checked call's; right trials get "time"
    said.clear()
    judge = TrialJudge(reference, 0.01, 0.01)
    outputs = _read_outputs(stream([[torch.ones(3)]], [[torch.ones(3)]], [[torch.zeros(3)]]), limits, judge,
                            said.append)
    assert said == [b"time\n"] and judge.comparison().outcome is Outcome.CORRECT
    assert len(outputs) == 1 and outputs[0][0].sum() == 0
    # a wrong second trial gets "stop", and the judge keeps that trial for the robust check
    said.clear()
    judge = TrialJudge(reference, 0.01, 0.01)
    _read_outputs(stream([[torch.ones(3)]], [[torch.full((3,), 7.0)]], []), limits, judge, said.append)
    assert said == [b"stop\n"] and judge.comparison().trials_passed == 1 and judge.failing[0][0] == 7.0
    # a reference's trials are kept, before the re-checked call's
    assert len(_read_outputs(stream([[torch.ones(3)]], [[torch.ones(3)]], [[torch.zeros(3)]]), limits, None,
                             said.append)) == 3
    # a worker that stopped after its first trial sent no usable outputs
    said.clear()
    assert _read_outputs(stream([[torch.ones(3)]]), limits, TrialJudge(reference, 0.01, 0.01), said.append) is None
    assert said == [b"stop\n"]
    # a frame larger than a worker may hold, or more bytes in all than allowed, is refused before allocation
    with pytest.raises(StreamError, match="exceed"):
        _read_outputs(stream([[torch.ones(1 << 19)]]), limits, None, said.append)
    with pytest.raises(StreamError, match="exceed"):
        _read_outputs(stream([[torch.ones(1 << 17)]], [[torch.ones(1 << 17)]], [[torch.ones(1 << 17)]]),
                      OutputLimits(frame=1 << 20, total=(1 << 20) + 8, trials=2), None, said.append)

BIG_OUTPUT_TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2.0


def get_inputs():
    return [torch.randn(64, 1 << 20)]  # 256 MiB per call


def get_init_inputs():
    return []
'''


@pytest.mark.slow
def test_outputs_larger_than_a_worker_may_hold_over_all_trials_are_streamed(tmp_path, build_cache):
    """Five trials of 256 MiB outputs under a 2.25 GiB address-space limit, of which importing torch takes about
    0.7 and the inputs up to 0.5: a worker that kept every trial's outputs until the end needed 2.7 and ran out of
    memory, which made the reference a harness error. Each trial's outputs now leave the worker as it ends."""
    from dice_kernels.tasks import task_from_code

    task = task_from_code(BIG_OUTPUT_TASK, id="big/1", name="big")
    candidate = candidate_from_text(BIG_OUTPUT_TASK.replace("class Model", "class ModelNew"), id="same")
    config = EvalConfig(backend="cpu", trials=5, cache_dir=build_cache, build=BuildConfig(jobs=1),
                        timing=TimingConfig(enabled=False), robust=RobustConfig(enabled=False),
                        sandbox=SandboxConfig(run_timeout_s=240, memory_limit_gb=2.25))
    [r] = evaluate([(task, candidate)], config, out_dir=tmp_path / "out", progress=False)
    assert r.outcome is Outcome.CORRECT, r.error
    assert r.trials_passed == 5


@pytest.mark.slow
def test_outputs_the_parent_has_no_memory_for_fail_with_a_clear_error(tmp_path, build_cache, monkeypatch):
    """On a machine about to run out of memory, a worker's outputs are refused before they are allocated (the
    OOM killer would take the parent and every worker in flight): here the reference's, so every candidate of
    the task is a harness error that says which limit."""
    from dice_kernels.harness.process import sandbox
    from dice_kernels.tasks import task_from_code

    monkeypatch.setattr(sandbox, "available_memory_bytes", lambda: (2 << 30) + (1 << 20))  # 1 MiB above reserve
    task = task_from_code(BIG_OUTPUT_TASK.replace("torch.randn(64, 1 << 20)", "torch.randn(4, 1 << 20)"),
                          id="big/2", name="big")
    candidate = candidate_from_text(BIG_OUTPUT_TASK.replace("class Model", "class ModelNew"), id="same")
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=1),
                        timing=TimingConfig(enabled=False), robust=RobustConfig(enabled=False),
                        sandbox=SandboxConfig(run_timeout_s=120))
    [r] = evaluate([(task, candidate)], config, out_dir=tmp_path / "out", progress=False)
    assert r.outcome is Outcome.HARNESS_ERROR and r.task_flags.over_limits
    assert "outputs too large" in r.error and "GiB of memory available" in r.error


SLEEPY_TASK = '''import time
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        time.sleep(1.0)
        return x + 1


def get_inputs():
    return [torch.randn(8)]


def get_init_inputs():
    return []
'''


@pytest.mark.slow
@pytest.mark.parametrize("factor, outcome", [(1.0, Outcome.TIMEOUT), (4.0, Outcome.CORRECT)])
def test_a_candidate_gets_time_in_proportion_to_its_reference(tmp_path, build_cache, factor, outcome):
    """The reference takes about 3 s (three trials of 1 s), the candidate about 7.5 s: over the 6 s run limit, but
    within 4 x the reference's run, which is what a task whose reference needs minutes gives its candidates."""
    from dice_kernels.tasks import task_from_code

    task = task_from_code(SLEEPY_TASK, id="sleepy/1", name="sleepy")
    slower = SLEEPY_TASK.replace("class Model", "class ModelNew").replace("time.sleep(1.0)", "time.sleep(2.5)")
    config = EvalConfig(backend="cpu", trials=3, cache_dir=build_cache, build=BuildConfig(jobs=1),
                        timing=TimingConfig(enabled=False), robust=RobustConfig(enabled=False),
                        sandbox=SandboxConfig(run_timeout_s=6, run_timeout_reference_factor=factor))
    [r] = evaluate([(task, candidate_from_text(slower, id="slower"))], config, out_dir=tmp_path / "out",
                   progress=False)
    assert r.outcome is outcome, r.error
    if outcome is Outcome.TIMEOUT:
        assert "exceeded the 6s wall-clock limit" in r.error


@pytest.mark.slow
def test_a_reference_that_fails_once_is_run_again_before_the_task_is_called_broken(tmp_path, build_cache,
                                                                                     monkeypatch):
    """A transient failure of the trusted Model (on the H200, CUDA initialisation failing once) costs one more
    reference run, not a harness error for every candidate of the task; a task that fails every time is still
    reported broken."""
    from dice_kernels.harness.process import pool as workers
    from dice_kernels.tasks import task_from_code

    marker = tmp_path / "fail-once"
    marker.touch()
    flaky = SLEEPY_TASK.replace("time.sleep(1.0)", f"assert not __import__('os').path.exists({str(marker)!r}), "
                                                   "'transient failure'")
    real_run = workers.Workers.run

    def run_then_clear_marker(self, job, task_code, code, *args, **kwargs):
        try:
            return real_run(self, job, task_code, code, *args, **kwargs)
        finally:
            if code is None:
                marker.unlink(missing_ok=True)  # the machine "recovers" after the first reference run

    monkeypatch.setattr(workers.Workers, "run", run_then_clear_marker)
    broken = flaky.replace(f"{str(marker)!r}", "'/'")  # "/" always exists: fails every time
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=1),
                        timing=TimingConfig(enabled=False), robust=RobustConfig(enabled=False),
                        sandbox=SandboxConfig(run_timeout_s=60))
    pairs = [(task_from_code(code, id=f"{name}/1", name=name),
              candidate_from_text(code.replace("class Model", "class ModelNew"), id=name))
             for name, code in (("flaky", flaky), ("broken", broken))]
    by_id = {r.candidate_id: r for r in evaluate(pairs, config, out_dir=tmp_path / "out", progress=False)}
    assert by_id["flaky"].outcome is Outcome.CORRECT, by_id["flaky"].error
    assert "transient failure" in by_id["flaky"].reference.retried_after
    assert by_id["broken"].outcome is Outcome.HARNESS_ERROR and "task error" in by_id["broken"].error


def test_output_ledger_admits_what_fits_and_anything_when_alone():
    from dice_kernels.harness.process.host_memory import OutputLedger, task_need_bytes

    ledger = OutputLedger(budget=100)
    assert ledger.reserve("a", 150)  # nothing else held: admitted however large (the machine's limit decides)
    assert not ledger.reserve("b", 1)  # nothing fits beside a task over the budget
    assert ledger.reserve("a", 10) and ledger.held() == 160  # a task's own reservation never blocks it
    ledger.release("a")
    assert ledger.reserve("b", 60) and not ledger.reserve("c", 41) and ledger.reserve("c", 40)
    assert ledger.held(but="b") == 40
    assert task_need_bytes(8, trials=5, candidates_in_flight=2) == 8 * (5 + 1 + 4)


@pytest.mark.slow
def test_a_task_whose_outputs_do_not_fit_beside_another_waits_its_turn(tmp_path, build_cache):
    """Two tasks' references start together (two run workers, pairs in the order A, B, A, B) under an output
    budget neither fits beside the other: the first to send a frame holds the budget until its candidates are
    done, the other is stopped at its first frame and runs again after. Five such tasks at once, 30-48 GiB each,
    got the parent OOM-killed on the H200."""
    from dice_kernels.tasks import task_from_code

    code = BIG_OUTPUT_TASK.replace("torch.randn(64, 1 << 20)", "torch.randn(1, 1 << 20)")  # 4 MiB per trial
    tasks = [task_from_code(f"# task {name}\n{code}", id=f"{name}/1", name=name) for name in ("a", "b")]
    new = code.replace("class Model", "class ModelNew")
    pairs = [(t, candidate_from_text(body, id=f"{t.name}{k}"))
             for k, body in enumerate((new, new.replace("x * 2.0", "x + x"))) for t in tasks]
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=1),
                        timing=TimingConfig(enabled=False), robust=RobustConfig(enabled=False),
                        sandbox=SandboxConfig(run_timeout_s=120),
                        scheduler=SchedulerConfig(run_workers=2, output_memory_gb=1 / 1024))
    results = evaluate(pairs, config, out_dir=tmp_path / "out", progress=False)
    assert [r.outcome for r in results] == [Outcome.CORRECT] * 4, [r.error for r in results]
    waited = {r.task_id for r in results if r.reference and r.reference.waited_for_memory_s}
    assert len(waited) == 1, [r.reference for r in results]


@pytest.mark.slow
def test_a_stateful_task_is_not_called_a_timing_cheat(tmp_path, build_cache):
    """KernelBench L3/33 (a vanilla RNN cell) keeps its hidden state across calls, so the call after a timing
    loop depends on how many calls the loop made, which differs between reference and candidate: an honest
    kernel was flagged `timing_output_mismatch` on the H200. The reference is now called twice on its last
    trial's inputs; a task whose outputs differ is marked stateful and its timing-loop call is not re-checked (the
    correctness trials, the same calls in the same order for both, still are)."""
    from dice_kernels.tasks import task_from_code

    relu = EXAMPLES / "tasks" / "level1" / "19_ReLU.py"
    task_code = relu.read_text().replace(
        "        super().__init__()\n",
        "        super().__init__()\n        self.calls = 0\n").replace(
        "        return torch.relu(x)\n",
        "        out = torch.relu(x) + self.calls\n        self.calls += 1\n        return out\n")
    solution = (EXAMPLES / "solutions" / "cpu" / "level1" / "19_ReLU" / "correct.py").read_text()
    solution = (solution.replace("relu_forward(torch::Tensor x)", "relu_forward(torch::Tensor x, double c)")
                .replace("in[i] > 0.f ? in[i] : 0.f;", "(in[i] > 0.f ? in[i] : 0.f) + (float)c;")
                .replace("example_relu_cpu", "stateful_relu_cpu")
                .replace("        super().__init__()\n", "        super().__init__()\n        self.calls = 0\n")
                .replace("        return relu_ext.relu_forward(x)\n",
                         "        out = relu_ext.relu_forward(x, float(self.calls))\n        self.calls += 1\n"
                         "        return out\n"))
    assert "self.calls" in task_code and "(float)c" in solution and "self.calls += 1" in solution
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=1),
                        timing=TimingConfig(max_s=0.3), sandbox=SandboxConfig(run_timeout_s=120))
    [r] = evaluate([(task_from_code(task_code, id="stateful/1", name="stateful"),
                     candidate_from_text(solution, id="counts_calls"))], config, out_dir=tmp_path / "out",
                   progress=False)
    assert r.outcome is Outcome.CORRECT, r.error
    assert r.task_flags.stateful is True and r.speedup


def test_get_inputs_runs_with_the_device_as_default_and_falls_back_to_the_cpu():
    """The mechanism that puts CUDA inputs straight into GPU memory, shown with the meta device (no GPU needed):
    factory calls inside get_inputs follow the default device; a get_inputs that cannot run that way (here a
    `.numpy()`) runs on the CPU, and its result is moved as before."""
    from types import ModuleType, SimpleNamespace

    import torch

    from dice_kernels.harness.worker.trial_inputs import _generated_inputs

    task = ModuleType("task")
    exec("import torch\n"
         "def get_inputs():\n    return [torch.randn(4, 4), str(torch.empty(0).device)]\n"
         "def cpu_only():\n    return [torch.tensor(torch.randn(4).numpy())]\n", task.__dict__)
    x, default = _generated_inputs(task, SimpleNamespace(inputs_on_device=True, device="meta"), seed=1)
    assert x.device.type == "meta" and default == "meta"  # get_inputs ran with the device as its default
    x, default = _generated_inputs(task, SimpleNamespace(inputs_on_device=False, device="meta"), seed=1)
    assert x.device.type == "meta" and default == "cpu"  # generated on the CPU, then moved
    task.get_inputs = task.cpu_only  # .numpy() fails on a meta tensor: this get_inputs runs on the CPU
    [z] = _generated_inputs(task, SimpleNamespace(inputs_on_device=True, device="meta"), seed=1)
    assert z.device.type == "meta"
    [y] = _generated_inputs(task, SimpleNamespace(inputs_on_device=True, device="cpu"), seed=1)
    assert torch.equal(y, _generated_inputs(task, SimpleNamespace(inputs_on_device=False, device="cpu"), seed=1)[0])


def test_a_tasks_reference_runs_while_its_candidates_are_being_built(tmp_path, build_cache, monkeypatch):
    """The run workers are idle while a cold batch compiles: each task's reference runs then, not after its first
    candidate's build, and its time is still charged to one candidate (the first whose run it serves)."""
    import time

    from dice_kernels.harness import runner
    from dice_kernels.tasks import task_from_code

    clock: dict[str, list[float]] = {"reference": [], "built": []}
    real_build, real_reference = runner.Evaluator.build, runner.Evaluator.reference

    def slow_build(self, code):
        time.sleep(4.0)  # a compile, as far as the schedule can tell
        try:
            return real_build(self, code)
        finally:
            clock["built"].append(time.monotonic())

    def timed_reference(self, task, *args, **kwargs):
        clock["reference"].append(time.monotonic())
        return real_reference(self, task, *args, **kwargs)

    monkeypatch.setattr(runner.Evaluator, "build", slow_build)
    monkeypatch.setattr(runner.Evaluator, "reference", timed_reference)
    task = task_from_code(BIG_OUTPUT_TASK.replace("torch.randn(64, 1 << 20)", "torch.randn(4, 256)"), id="t/1",
                          name="t")
    new = BIG_OUTPUT_TASK.replace("class Model", "class ModelNew")
    pairs = [(task, candidate_from_text(body, id=f"c{k}"))
             for k, body in enumerate((new, new.replace("x * 2.0", "x + x")))]
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=2, fast=False),
                        timing=TimingConfig(enabled=False), robust=RobustConfig(enabled=False))
    results = evaluate(pairs, config, out_dir=tmp_path / "out", progress=False)
    assert [r.outcome for r in results] == [Outcome.CORRECT] * 2, [r.error for r in results]
    assert len(clock["reference"]) == 1 and clock["reference"][0] < min(clock["built"])
    charged = [r.phases.seconds["reference"] for r in results]
    assert sorted(c > 0 for c in charged) == [False, True], charged


def test_a_candidate_runs_once_its_own_build_is_done_not_after_those_submitted_before_it(tmp_path, build_cache,
                                                                                          monkeypatch):
    """One run worker, and the first candidate's build takes seconds longer than the second's: the second is run
    while the first still builds (a run thread that waited for the first build held the second back)."""
    import time

    from dice_kernels.harness import runner
    from dice_kernels.tasks import task_from_code

    real_build = runner.Evaluator.build
    built_at: dict[str, float] = {}

    def build(self, code):
        if "SLOW_BUILD" in code:
            time.sleep(8.0)
        try:
            return real_build(self, code)
        finally:
            built_at["slow" if "SLOW_BUILD" in code else "fast"] = time.monotonic()

    monkeypatch.setattr(runner.Evaluator, "build", build)
    task = task_from_code(BIG_OUTPUT_TASK.replace("torch.randn(64, 1 << 20)", "torch.randn(4, 256)"), id="t/1",
                          name="t")
    new = BIG_OUTPUT_TASK.replace("class Model", "class ModelNew")
    pairs = [(task, candidate_from_text("SLOW_BUILD = True\n" + new, id="slow")),
             (task, candidate_from_text(new, id="fast"))]
    done_at: dict[str, float] = {}
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=2, fast=False),
                        scheduler=SchedulerConfig(run_workers=1), timing=TimingConfig(enabled=False),
                        robust=RobustConfig(enabled=False))
    results = evaluate(pairs, config, out_dir=tmp_path / "out", progress=False,
                       on_result=lambda r: done_at.setdefault(r.candidate_id, time.monotonic()))
    assert [r.outcome for r in results] == [Outcome.CORRECT] * 2, [r.error for r in results]
    assert done_at["fast"] < built_at["slow"] < done_at["slow"]


def test_a_typed_result_survives_the_store_and_an_old_store_is_refused(tmp_path):
    """Issue 30: the typed parts go to one JSON column and come back as the same dataclasses; a database an older
    harness wrote (untyped `extra`) is refused with a message that says what to do."""
    import sqlite3

    from dice_kernels.harness.outcomes import (BaselineNote, BuildNotes, CompileBaseline, EvalResult, ExtensionUse,
                                               Phases, ReferenceNotes, RobustCheck, RobustFinding, SpeedOfLight,
                                               TaskFlags, Timing)
    from dice_kernels.harness.store import ResultStore, StoreFormatError

    full = EvalResult(
        "L1/19", "c", "sha", Outcome.DECEPTIVE, deceptive_kind="pytorch_fallback", speedup=None, duplicate_of="b",
        build=BuildNotes(True, [{"pch": True}]), reference=ReferenceNotes(BaselineNote(True, "2026-12-01", 0.02)),
        task_flags=TaskFlags({"degenerate": True}, hardened_trials=1), extension=ExtensionUse(True, False),
        robust=RobustCheck([RobustFinding("pytorch_fallback", "ops", {"aten::relu": 2})], True),
        timing=Timing([1.1, 1.3], {"median_ms": 1.0}, {}, ["faster_than_light"], CompileBaseline(error="x"),
                      SpeedOfLight(0.1, 0.2, 64, 0.0, "float32", True, False, 1.2)),
        phases=Phases({"run": 1.5}, {"done": 3.0}), sandbox=["no landlock"])
    store = ResultStore(tmp_path / "results.sqlite")
    store.put(full)
    store.put(EvalResult("L1/19", "bare", "sha", Outcome.COMPILE_ERROR))
    (back, bare) = store.all()
    store.close()
    assert back == full and bare.robust is None and bare.timing is None and bare.timing_flags == []
    old = tmp_path / "old.sqlite"
    with sqlite3.connect(old) as db:
        db.execute("CREATE TABLE results (rowid INTEGER PRIMARY KEY, task_id, extra TEXT)")
    with pytest.raises(StoreFormatError, match="older harness.*new --out"):
        ResultStore(old)
