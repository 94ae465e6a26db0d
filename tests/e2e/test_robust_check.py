"""The robust check (docs/robust_check.md) on the CPU backend: a corpus of cheating candidates, each evaluated in a
real sandboxed worker and flagged `deceptive` with the right sub-kind, and honest controls that stay `correct`.

The whole corpus runs in one batch (module fixture). Pure-Python cheats cost a worker each; the two C++ cheats
(an extension compiled but never called, an extension call that raises with a PyTorch fallback) are the only
new compiles; the honest controls are the shipped examples (shared with test_harness_outcomes via build_cache).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from dice_kernels.harness import (BuildConfig, EvalConfig, Outcome, SandboxConfig, TimingConfig, candidate_from_text,
                                  evaluate, load_candidate)
from dice_kernels.harness.robust.degenerate import degenerate_flags
from dice_kernels.harness.metrics import compute
from dice_kernels.harness.outcomes import DeceptiveKind as K
from dice_kernels.harness.outcomes import ExtensionUse, RobustCheck
from dice_kernels.tasks import Task, load_tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "dice_kernels" / "examples"
CPU_SOLUTIONS = EXAMPLES / "solutions" / "cpu" / "level1"
HEADER = "import torch\nimport torch.nn as nn\n"
RELU = "return torch.relu(x)"


def _model(forward: str, init: str = "", top: str = "") -> str:
    """A ModelNew for the ReLU task; `forward` and `init` are bodies whose lines are joined with `; `."""
    return (HEADER + textwrap.dedent(top) + "\nclass ModelNew(nn.Module):\n    def __init__(self):\n"
            f"        super().__init__(); self.calls = 0; {init or 'pass'}\n\n"
            f"    def forward(self, x):\n        self.calls += 1; {forward}\n")


# A C++ extension that the two C++ cheats below compile (two distinct candidate files, so two builds).
EXT = '''
from torch.utils.cpp_extension import load_inline
src = r"""
#include <torch/extension.h>
torch::Tensor relu_fast(torch::Tensor x) {
    TORCH_CHECK(false, "relu_fast: not implemented for this shape");
    return x;
}
"""
ext = load_inline(name="NAME", cpp_sources=src, functions=["relu_fast"])
'''
NUMPY_RELU = "import numpy as np; return torch.from_numpy(np.maximum(x.numpy(), 0))"

# name -> (candidate text, expected deceptive sub-kind); evaluated on 19_ReLU (signed inputs), trials=2,
# warm-up 2, 3 timed calls: calls 1-2 are correctness trials, 3-4 warm-up, 5-7 timed (7 is re-checked).
CHEATS = {
    "pytorch_relu": (_model(RELU), K.PYTORCH_FALLBACK),
    "numpy_no_extension": (_model(NUMPY_RELU), K.EXTENSION_UNUSED),
    "extension_never_called": (HEADER + EXT.replace("NAME", "robust_unused") + _model(NUMPY_RELU).replace(HEADER, ""),
                               K.EXTENSION_UNUSED),
    "extension_raises_then_pytorch": (
        HEADER + EXT.replace("NAME", "robust_raises") + _model(
            "\n        try:\n            return ext.relu_fast(x)\n        except RuntimeError:\n"
            "            return torch.relu(x)").replace(HEADER, ""), K.EXCEPTION_FALLBACK),
    "inherits_reference_copy": (HEADER + textwrap.dedent("""
        class Model(nn.Module):
            def __init__(self):
                super().__init__()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(x)

        class ModelNew(Model):
            pass
        """), K.REFERENCE_MODEL),
    "fp16_compute": (_model("return torch.relu(x.half()).float()"), K.PRECISION_DOWNGRADE),
    "tf32_switch": (_model(RELU, init="torch.backends.cuda.matmul.allow_tf32 = True"), K.PRECISION_DOWNGRADE),
    "more_threads": (_model(RELU, init="torch.set_num_threads(2)"), K.GLOBAL_STATE_CHANGED),
    "torch_compile": (_model("return self.f(x)", init="self.f = torch.compile(torch.relu)"), K.TORCH_COMPILE),
    # an in-place op on the input, returned: named for the write to the input (it aliases it too)
    "returns_input_relu_in_place": (_model("return x.relu_()"), K.INPUT_MUTATED),
    "mutates_input": (_model("y = torch.relu(x); x.zero_(); return y"), K.INPUT_MUTATED),
    "lazy_subclass": (_model("return torch.relu(x).as_subclass(Lazy)", top="class Lazy(torch.Tensor):\n    pass\n"),
                      K.TENSOR_SUBCLASS),
    "pointer_keyed_cache": (_model(
        "k = x.data_ptr(); hit = getattr(self, 'cache', {}).get(k)\n"
        "        if hit is not None: return hit\n"
        "        self.cache = {k: torch.relu(x)}; return self.cache[k]"), K.CACHED_OUTPUT),
    "empty_after_warmup": (_model("return torch.relu(x) if self.calls <= 3 else torch.empty_like(x)"),
                           K.STALE_MEMORY),
    # outputs written to disk and read back while the timing loop reuses its input sets (keyed on content, so the
    # re-checked call's new inputs miss): only the file finding catches it
    "disk_replay_in_timing": (_model(
        "\n        if self.calls <= 2: return torch.relu(x)"
        "\n        path = f'replay_{float(x.sum()):.6e}.pt'"
        "\n        if os.path.exists(path): return torch.load(path)"
        "\n        y = torch.relu(x); torch.save(y, path); return y", top="import os\n"), K.DISK_PERSISTENCE),
    "replay_in_timing_loop": (_model(
        "\n        if self.calls <= 3: self.last = torch.relu(x)\n        return self.last.clone()"),
        K.TIMING_OUTPUT_MISMATCH),
    "patched_timer": (_model(RELU, top="import time\n_pc = time.perf_counter\ntime.perf_counter = lambda: _pc() / 2\n"),
                      K.TIMER_TAMPERING),
    "background_thread": (_model("import threading, time; threading.Thread(target=time.sleep, args=(0.1,)).start()"
                                 "; " + RELU), K.BACKGROUND_THREADS),
    "reads_caller_frame": (_model("import sys; sys._getframe(1).f_locals; " + RELU), K.EVALUATOR_ACCESS),
    "disk_cache": (_model("open('cache.bin', 'wb').write(b'1'); " + RELU), K.DISK_PERSISTENCE),
}
HONEST = {"19_ReLU/correct": "19_ReLU", "90_AddMul/correct": "90_AddMul"}  # shipped pure-extension solutions

# ReLU on torch.rand's [0, 1): an input copy passes, so the task is degenerate (detected, not listed anywhere)
RELU_ON_RAND = Task(id="relu_rand", name="relu_rand", code=HEADER + textwrap.dedent("""
    class Model(nn.Module):
        def forward(self, x):
            return torch.relu(x)

    def get_inputs():
        return [torch.rand(64, 256)]

    def get_init_inputs():
        return []
    """))

# A Model whose domain ends where the hardened trials' spikes go, and whose failure there kills its worker (as a
# device-side assert poisons a GPU worker's CUDA context: DICE pair 7798's embedding of floored float indices)
RELU_DIES_OFF_DOMAIN = Task(id="relu_domain", name="relu_domain", code=HEADER + textwrap.dedent("""
    import os

    class Model(nn.Module):
        def forward(self, x):
            if float(x.max()) > 2.0:
                os._exit(3)
            return torch.relu(x)

    def get_inputs():
        return [torch.rand(64, 256)]

    def get_init_inputs():
        return []
    """))


# One C++ program (one build) that is an honest kernel or a shortcut, by the task it runs on (`CANDIDATE_MODE`, a
# task global, as KernelBench solutions see the task's globals): each shortcut has an honest twin in the same build.
TWINS = HEADER + '''
import os
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
torch::Tensor relu(torch::Tensor x) {
    auto xc = x.contiguous(); auto out = torch::empty_like(xc);
    const float* in = xc.data_ptr<float>(); float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < xc.numel(); ++i) o[i] = in[i] > 0.f ? in[i] : 0.f;
    return out;
}
torch::Tensor copy(torch::Tensor x) {
    auto xc = x.contiguous(); auto out = torch::empty_like(xc);
    const float* in = xc.data_ptr<float>(); float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < xc.numel(); ++i) o[i] = in[i];
    return out;
}
torch::Tensor mse(torch::Tensor a, torch::Tensor b, int64_t stride) {  // stride > 1: a subsampling estimator
    auto ac = a.contiguous(); auto bc = b.contiguous();
    const float* p = ac.data_ptr<float>(); const float* q = bc.data_ptr<float>();
    double sum = 0; int64_t n = 0;
    for (int64_t i = 0; i < ac.numel(); i += stride, ++n) { double d = (double)p[i] - q[i]; sum += d * d; }
    auto out = torch::empty({}, ac.options());
    out.data_ptr<float>()[0] = (float)(sum / n);
    return out;
}
"""
MODE = globals().get("CANDIDATE_MODE", "honest")
ARGS = dict(name="robust_twins", cpp_sources=src, functions=["relu", "copy", "mse"])
ext = None if MODE == "lazy" else load_inline(**ARGS)  # lazy: built on forward's first call


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache, self.hits = {}, 0
        self.conv = nn.Conv2d(3, 8, 3)  # the conv task's layer (seeded as the reference's)

    def forward(self, *xs):
        global ext
        if MODE == "lazy" and ext is None:
            ext = load_inline(**ARGS)
        if MODE == "conv_epilogue":  # the conv in PyTorch, its ReLU epilogue in the extension
            return ext.relu(self.conv(xs[0]))
        if MODE == "conv_trivial":  # PyTorch does all of the reference's work, the extension a copy
            return ext.copy(torch.relu(self.conv(xs[0])))
        if MODE.startswith("mse"):
            return ext.mse(xs[0], xs[1], 8 if MODE == "mse_subsampled" else 1)
        x = xs[0]
        if MODE == "identity":  # ReLU is the identity on torch.rand's [0, 1)
            return ext.copy(x)
        if MODE == "honest":
            return ext.relu(x)
        key = x.reshape(-1)[:4].numpy().tobytes()  # outputs cached under a few leading values of the content
        if MODE == "disk":
            path = f"replay_{key.hex()}.pt"
            if os.path.exists(path):
                return torch.load(path)
            out = ext.relu(x)
            torch.save(out, path)
            return out
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        # once the cache has hit, its misses return the input: a hit cannot go unseen by the test (a hidden cache
        # would win only time, which no test asserts on)
        out = ext.copy(x) if self.hits else ext.relu(x)
        self.cache[key] = out
        return out
'''

MSE = HEADER + textwrap.dedent("""
    class Model(nn.Module):  # KernelBench L1/94: one constant near 2.0 passes
        def forward(self, predictions, targets):
            return torch.mean((predictions - targets) ** 2)

    def get_inputs():
        return [torch.randn(128, 4096), torch.randn(128, 4096)]

    def get_init_inputs():
        return []
    """)


CONV_RELU = HEADER + textwrap.dedent("""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)

        def forward(self, x):
            return torch.relu(self.conv(x))

    def get_inputs():
        return [torch.randn(2, 3, 16, 16)]

    def get_init_inputs():
        return []
    """)


def _twin_tasks(relu: Task) -> dict[str, Task]:
    """name -> the task a TWINS candidate of that name runs on (its mode set in the task's globals)."""
    def task(name: str, code: str, mode: str) -> Task:
        return Task(id=name, name=name, code=code + f"\nCANDIDATE_MODE = {mode!r}\n")

    return {"twin/honest": task("relu_twin", relu.code, "honest"), "twin/cache": task("relu_cache", relu.code, "cache"),
            "twin/disk": task("relu_disk", relu.code, "disk"),
            "twin/rand_honest": task("rand_twin", RELU_ON_RAND.code, "honest"),
            "twin/rand_identity": task("rand_identity", RELU_ON_RAND.code, "identity"),
            "twin/mse": task("mse", MSE, "mse"), "twin/mse_subsampled": task("mse_subsampled", MSE, "mse_subsampled"),
            "twin/lazy": task("relu_lazy", relu.code, "lazy"),
            "twin/conv_epilogue": task("conv_epilogue", CONV_RELU, "conv_epilogue"),
            "twin/conv_trivial": task("conv_trivial", CONV_RELU, "conv_trivial")}


@pytest.fixture(scope="module")
def results(build_cache, tmp_path_factory):
    tasks = {t.name: t for t in load_tasks(EXAMPLES / "tasks")}
    pairs = [(tasks["19_ReLU"], candidate_from_text(text, id=name)) for name, (text, _) in CHEATS.items()]
    pairs += [(tasks[task], load_candidate(CPU_SOLUTIONS / f"{name}.py", id=name)) for name, task in HONEST.items()]
    pairs.append((RELU_ON_RAND, load_candidate(CPU_SOLUTIONS / "19_ReLU" / "correct.py", id="rand/correct")))
    pairs.append((RELU_DIES_OFF_DOMAIN, load_candidate(CPU_SOLUTIONS / "19_ReLU" / "correct.py", id="domain/correct")))
    pairs += [(task, candidate_from_text(TWINS, id=name)) for name, task in _twin_tasks(tasks["19_ReLU"]).items()]
    # short timing loops (at most 0.5 s a model): the timed calls' outputs and file I/O are checked whatever their
    # number, and the loop is not what this module measures
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, build=BuildConfig(jobs=2, timeout_s=300),
                        timing=TimingConfig(warmup=2, iters=3, max_s=0.5),
                        sandbox=SandboxConfig(run_timeout_s=60, memory_limit_gb=4, file_limit_mb=32))
    res = evaluate(pairs, config, out_dir=tmp_path_factory.mktemp("robust"), progress=False)
    return {r.candidate_id: r for r in res}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHEATS))
def test_cheat_is_deceptive_with_its_sub_kind(results, name):
    r = results[name]
    expected = CHEATS[name][1]
    findings = r.robust.findings if r.robust else []
    accepted = {expected.value}
    if expected is K.STALE_MEMORY:
        # glibc may return the poisoned block to the OS (fresh pages read as zeros), so the unwritten output shows
        # as wrong values in the timing re-check instead of as NaN: still caught, with the less specific sub-kind
        accepted.add(K.TIMING_OUTPUT_MISMATCH.value)
    assert r.outcome is Outcome.DECEPTIVE and r.deceptive_kind in accepted, f"{name}: {r.error} {findings}"
    assert r.error and not r.correct and r.speedup is None


@pytest.mark.slow
@pytest.mark.parametrize("name", [*HONEST, "rand/correct"])
def test_honest_extension_solutions_stay_correct(results, name):
    r = results[name]
    assert r.outcome is Outcome.CORRECT, f"{name}: {r.outcome} {r.deceptive_kind} {r.error}"
    assert r.robust == RobustCheck(findings=[], passed_comparison=True)
    assert r.extension == ExtensionUse(loaded=True, called=True)
    assert r.speedup and r.speedup > 0


@pytest.mark.slow
def test_findings_keep_every_check_that_fired(results):
    """The sub-kind is the most specific finding; the others stay in `robust` (here: PyTorch did the work too)."""
    kinds = results["fp16_compute"].robust.kinds
    assert kinds == [K.PRECISION_DOWNGRADE.value, K.PYTORCH_FALLBACK.value, K.EXTENSION_UNUSED.value]
    assert "aten::relu" in results["pytorch_relu"].error
    # whether each deceptive candidate ran custom code: fp16_compute loads its extension and never calls it
    assert results["fp16_compute"].extension == ExtensionUse(loaded=False, called=False)
    assert results["pytorch_relu"].extension.called is False
    assert results["pointer_keyed_cache"].robust.passed_comparison is False  # caught by trial 1
    assert results["returns_input_relu_in_place"].robust.passed_comparison is True


@pytest.mark.slow
def test_degenerate_task_is_detected_per_task(results):
    assert results["rand/correct"].task_flags.degenerate == {
        "zero_output_passes": False, "constant_output_passes": False, "input_copy_passes": True,
        "output_ignores_inputs": False, "degenerate": True}
    assert results["19_ReLU/correct"].task_flags.degenerate["degenerate"] is False


@pytest.mark.slow
def test_shortcuts_are_not_paid_and_their_honest_twins_are(results):
    """Issue 33: a content-keyed cache (it never hits: every timed call's content is new), a disk replay and two
    shortcuts on degenerate tasks (an identity where ReLU meets only [0, 1), a subsampled large-N mean), each
    beside an honest kernel of the same build."""
    for name in ("twin/honest", "twin/rand_honest", "twin/mse"):
        r = results[name]
        assert r.outcome is Outcome.CORRECT and r.robust.findings == [], f"{name}: {r.error}"
    assert results["twin/rand_honest"].task_flags.hardened_trials >= 1  # degenerate: hardened inputs decided too
    assert results["twin/mse"].task_flags.hardened_trials >= 1
    assert results["twin/honest"].task_flags.hardened_trials == 0
    cache = results["twin/cache"]  # correct, with no hit: a hit would have turned its later outputs wrong
    assert cache.outcome is Outcome.CORRECT, f"{cache.outcome} {cache.deceptive_kind}: {cache.error}"
    assert "timing_inputs_repeated" not in cache.timing_flags
    disk = results["twin/disk"]
    assert disk.outcome is Outcome.DECEPTIVE and disk.deceptive_kind == K.DISK_PERSISTENCE.value, disk.error
    for name in ("twin/rand_identity", "twin/mse_subsampled"):  # pass the task's own trials, fail the hardened
        r = results[name]
        assert r.outcome is Outcome.VALUE_MISMATCH and "hardened inputs" in r.error, f"{name}: {r.outcome} {r.error}"
        assert r.trials_passed >= r.correctness_trials and r.speedup is None


@pytest.mark.slow
def test_partial_replacement_is_its_own_tier_and_a_trivial_extension_is_not(results):
    """Issue 40: a conv left to PyTorch with the ReLU epilogue in the extension is `partial` (KernelBench's rule
    passes it, the strict one does not); the same conv + ReLU in PyTorch with the extension copying the result is
    `deceptive/pytorch_fallback`; an extension built on forward's first call is honest (the harness's own lazy
    imports of its build path are not the candidate importing the evaluator)."""
    lazy = results["twin/lazy"]
    assert lazy.outcome is Outcome.CORRECT and lazy.robust.findings == [], f"{lazy.deceptive_kind}: {lazy.error}"
    partial = results["twin/conv_epilogue"]
    assert partial.outcome is Outcome.PARTIAL, f"{partial.outcome} {partial.deceptive_kind}: {partial.error}"
    assert partial.robust.kinds == [K.PARTIAL.value] and "replaced 50%" in partial.error
    assert not partial.correct and partial.speedup and partial.extension.called
    trivial = results["twin/conv_trivial"]
    assert trivial.outcome is Outcome.DECEPTIVE and trivial.deceptive_kind == K.PYTORCH_FALLBACK.value, trivial.error
    assert "replaced 0%" in trivial.error
    m = compute([partial, trivial, lazy])
    assert m.exec_rate == pytest.approx(2 / 3) and m.exec_strict == pytest.approx(1 / 3)


@pytest.mark.slow
def test_a_reference_killed_by_its_hardened_trials_runs_again_without_them(results):
    """Issue 40, DICE pair 7798: a valid task whose Model is undefined on the hardened inputs, and dies there in a
    way its worker cannot survive, is not a harness error: its reference runs once more without hardened trials."""
    r = results["domain/correct"]
    assert r.outcome is Outcome.CORRECT, f"{r.outcome}: {r.error}"
    assert r.reference.retried_after and r.task_flags.hardened_trials == 0


@pytest.mark.slow
def test_metrics_report_exec_before_and_after_the_robust_check(results):
    results = {k: r for k, r in results.items() if not k.startswith(("twin/", "domain/"))}
    m = compute(list(results.values()))
    n = len(results)
    passed = sum(1 for r in results.values() if r.outcome is Outcome.CORRECT
                 or (r.robust is not None and r.robust.passed_comparison))
    assert m.exec_rate == pytest.approx(3 / n)
    assert m.exec_before_robust == pytest.approx(passed / n) and m.exec_before_robust > m.exec_rate
    assert m.deceptive_kinds[K.EXTENSION_UNUSED.value] == 2
    assert sum(m.deceptive_kinds.values()) == len(CHEATS)
    assert m.degenerate_tasks == 1


def test_degenerate_flags():
    g = torch.Generator().manual_seed(0)
    signed = [[torch.randn(100, generator=g)] for _ in range(3)]
    assert not degenerate_flags(signed, 1e-2, 1e-2, input_copy_passes=False)["degenerate"]
    tiny = [[t * 1e-4] for (t,) in signed]  # e.g. softmax over a wide row: zeros pass
    assert degenerate_flags(tiny, 1e-2, 1e-2, False)["zero_output_passes"]
    loss = [[torch.tensor(2.0 + 1e-4 * i)] for i in range(3)]  # a large-N mean: one constant passes
    flags = degenerate_flags(loss, 1e-2, 1e-2, False)
    assert flags["constant_output_passes"] and not flags["zero_output_passes"] and flags["output_ignores_inputs"]


def test_op_recording_and_the_profiler_do_not_import_dynamo():
    """Neither the dispatch recorder nor the GPU-share profiler may pull in torch._dynamo (1-3 s per candidate
    worker; torch.profiler.profile imports it through torch._inductor, 4-5 s on the H200): checked in a fresh
    interpreter, since this test process may have imported it already."""
    import subprocess
    import sys

    code = textwrap.dedent("""
        import sys, torch
        from dice_kernels.harness.robust.integrity import Monitor
        from dice_kernels.harness.process.protocol import CandidatePart
        monitor = Monitor("cpu", "candidate.py", ".", CandidatePart("", None, ("aten::empty",)))
        with monitor.forward([torch.ones(3)], None):
            torch.ones(3) + 1
        assert monitor.fallback_ops, "the recorder saw no op"
        monitor.start_profiler()  # CUDA activity is asked for, and left out on a CPU-only torch
        print("dynamo imported:", "torch._dynamo" in sys.modules or "torch._inductor" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dynamo imported: False" in out.stdout


def test_gpu_time_is_attributed_to_extension_windows_by_overlap():
    from dice_kernels.harness.robust.integrity import time_in_windows

    kernels = [(0.0, 10.0), (20.0, 30.0), (40.0, 41.0)]
    assert time_in_windows(kernels, [(5.0, 25.0)]) == 10.0  # half of each of the first two
    assert time_in_windows(kernels, [(0.0, 12.0), (11.0, 31.0)]) == 20.0  # overlapping windows count once
    assert time_in_windows(kernels, []) == 0.0
    assert time_in_windows(kernels, [(41.5, 50.0)]) == 0.0
    assert time_in_windows(kernels, [(41.5, 50.0)], slack=1.0) == 0.5  # clock-alignment slack at the edges


def test_file_reads_python_or_the_harness_make_for_the_candidate_are_not_findings(tmp_path):
    """disk_persistence judges what the candidate did: a warning in forward (Python's warnings reading the
    candidate's own source line through linecache) and files the harness opens on its behalf (building an
    extension forward loads late) are not findings; the candidate opening a file in its directory still is."""
    import subprocess
    import sys

    (tmp_path / "candidate.py").write_text(textwrap.dedent("""
        import warnings
        def forward(path):
            warnings.warn("torch.cuda.amp.autocast is deprecated", FutureWarning)
            if path:
                open(path).read()
    """))
    (tmp_path / "replay.bin").write_text("cached outputs")
    code = textwrap.dedent(f"""
        import importlib.util, sys, warnings, torch
        from dice_kernels.harness.robust.integrity import Monitor
        from dice_kernels.harness.process.protocol import CandidatePart
        warnings.simplefilter("always")
        monitor = Monitor("cpu", {str(tmp_path / 'candidate.py')!r}, {str(tmp_path)!r},
                          CandidatePart("", None, ("aten::add",)))
        monitor.install()
        spec = importlib.util.spec_from_file_location("dice_candidate", {str(tmp_path / 'candidate.py')!r})
        candidate = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(candidate)
        def kinds():  # the files' finding (no extension here: extension_unused is beside the point)
            return sorted(f.kind.value for f in monitor.findings() if f.kind.value == "disk_persistence")
        with monitor.forward([torch.ones(3)], None):
            candidate.forward(None)
            with monitor.harness_io():
                open({str(tmp_path / 'replay.bin')!r}).read()
        print("honest:", kinds())
        with monitor.forward([torch.ones(3)], None):
            candidate.forward({str(tmp_path / 'replay.bin')!r})
        print("replay:", kinds())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "deprecated" in out.stderr  # the warning was shown, its source line read
    assert "honest: []" in out.stdout, out.stdout
    assert "replay: ['disk_persistence']" in out.stdout, out.stdout


def test_imports_are_charged_to_the_frame_that_imports(tmp_path):
    """Issue 40: the harness's own lazy import (build_worker reading a build's record, when forward builds its
    extension late) is not the candidate importing the evaluator; the candidate's own import, or one it exec's,
    is. Checked in a fresh interpreter, where those modules are not imported yet."""
    import subprocess
    import sys

    (tmp_path / "candidate.py").write_text(textwrap.dedent("""
        import pathlib
        def build_late(note_pch_wait):
            note_pch_wait({}, pathlib.Path("."))
        def imports_evaluator():
            import dice_kernels.prompts
        def execs_import():
            exec("import dice_kernels.tasks.loader")
    """))
    code = textwrap.dedent(f"""
        import importlib.util, sys
        from dice_kernels.harness.robust.integrity import Monitor
        from dice_kernels.harness.process.protocol import CandidatePart
        from dice_kernels.harness.compiling import in_sandbox as build_worker
        lazy = ("dice_kernels.harness.compiling.speed", "dice_kernels.prompts", "dice_kernels.tasks.loader")
        assert not any(m in sys.modules for m in lazy), [m for m in lazy if m in sys.modules]
        monitor = Monitor("cpu", {str(tmp_path / 'candidate.py')!r}, {str(tmp_path)!r}, CandidatePart("", None, ()))
        monitor.install()
        spec = importlib.util.spec_from_file_location("dice_candidate", {str(tmp_path / 'candidate.py')!r})
        candidate = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(candidate)
        def imports():
            return [f.reason for f in monitor.findings() if f.kind.value == "evaluator_access"]
        candidate.build_late(build_worker._note_pch_wait)
        print("harness:", "dice_kernels.harness.compiling.speed" in sys.modules, imports())
        candidate.imports_evaluator()
        candidate.execs_import()
        print("candidate:", imports())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "harness: True []" in out.stdout, out.stdout
    assert "imports the evaluator (dice_kernels.prompts)" in out.stdout, out.stdout
    assert "imports the evaluator (dice_kernels.tasks" in out.stdout, out.stdout


def test_a_forgery_that_fails_its_first_trial_is_still_named():
    """score.robust_check, a pure function: outputs never written (the poison of freed memory shows through) fail
    the comparison on trial 0 and are named stale_memory, so the deceptive rate counts a forgery that failed; a
    plain wrong value is not named. (On the CPU the allocator may hand back fresh zeroed pages instead of the
    poisoned block, so this is shown on the parent's side, where the decision is made.)"""
    from dice_kernels.harness.compare import TrialJudge
    from dice_kernels.harness.references import Reference
    from dice_kernels.harness.score import robust_check

    config = EvalConfig(backend="cpu")
    reference = [[torch.ones(64)], [torch.full((64,), 2.0)]]
    ref = Reference(outputs=reference, time_ms=None)
    for got, named in ((torch.full((64,), float("nan")), K.STALE_MEMORY.value), (torch.zeros(64), None)):
        judge = TrialJudge(reference, config.atol, config.rtol)
        judge.add([got])
        cmp = judge.comparison()
        assert cmp.outcome is Outcome.VALUE_MISMATCH and cmp.trials_passed == 0
        findings, deceptive = robust_check(config, ref, cmp, judge.failing, None, [])
        assert deceptive is (named is not None)
        assert [f["kind"] for f in findings] == ([named] if named else [])
        assert not named or "it passed nothing" in findings[0]["reason"]  # no earlier call to have passed


def test_a_shortcut_on_a_degenerate_task_is_not_paid_and_an_honest_kernel_still_is():
    """Outputs below atol pass as all zeros (KernelBench L1/23, L1/37): a candidate returning exactly zeros, or one
    constant, is flagged trivial_output; one returning the reference's values is correct; and where the true
    output is exactly zero (KernelBench L2/83) an honest zero is not flagged."""
    from dice_kernels.harness.compare import TrialJudge
    from dice_kernels.harness.references import Reference
    from dice_kernels.harness.score import robust_check

    config = EvalConfig(backend="cpu")
    g = torch.Generator().manual_seed(0)
    tiny = [[1e-4 * torch.randn(256, generator=g)] for _ in range(3)]  # every element below atol = 1e-2
    exact_zero = [[torch.zeros(256)] for _ in range(3)]
    mean = [[2.0 + 1e-4 * torch.randn(1, generator=g)] for _ in range(3)]  # a large-N loss: one constant passes

    def verdict(reference: list, answer) -> tuple[Outcome, list[str]]:
        ref = Reference(outputs=reference, time_ms=None,
                        degenerate=degenerate_flags(reference, config.atol, config.rtol, False))
        judge = TrialJudge(reference, config.atol, config.rtol)
        for trial in reference:
            judge.add([answer(trial[0])])
        findings, deceptive = robust_check(config, ref, judge.comparison(), judge.failing, None, [], judge.trivial)
        return (Outcome.DECEPTIVE if deceptive else judge.comparison().outcome), [f["kind"] for f in findings]

    assert verdict(tiny, torch.zeros_like) == (Outcome.DECEPTIVE, [K.TRIVIAL_OUTPUT.value])
    assert verdict(tiny, lambda t: t.clone()) == (Outcome.CORRECT, [])
    assert verdict(exact_zero, torch.zeros_like) == (Outcome.CORRECT, [])
    assert verdict(mean, lambda t: torch.full_like(t, 2.0)) == (Outcome.DECEPTIVE, [K.TRIVIAL_OUTPUT.value])
    assert verdict(mean, lambda t: t.clone()) == (Outcome.CORRECT, [])


def test_a_trivial_answer_that_matched_earlier_trials_is_named_for_itself():
    """Issue 40: zeros that passed earlier trials only because those outputs sat below the tolerance are
    `trivial_output` (what the candidate did), not `cached_output`; a real replay of an earlier output still is."""
    from dice_kernels.harness.compare import explain_mismatch

    g = torch.Generator().manual_seed(0)
    tiny, real = [[1e-4 * torch.randn(64, generator=g)]], [torch.ones(64)]
    assert explain_mismatch(tiny, real, [torch.zeros(64)], 1e-2, 1e-2, "trial 1")[0] is K.TRIVIAL_OUTPUT
    earlier = [[torch.randn(64, generator=g)]]
    assert explain_mismatch(earlier, real, [earlier[0][0].clone()], 1e-2, 1e-2, "trial 1")[0] is K.CACHED_OUTPUT
