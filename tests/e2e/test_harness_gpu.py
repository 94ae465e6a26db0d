"""The CUDA backend on a real GPU: the shipped CUDA examples, builds for the present GPU's architecture."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from dice_kernels.harness import BuildConfig, EvalConfig, Outcome, TimingConfig, evaluate
from dice_kernels.harness.timing.platform import Platform

pytestmark = pytest.mark.gpu


def test_platform_arch_is_the_present_gpu():
    major, minor = torch.cuda.get_device_capability(0)
    assert Platform.detect("cuda").cuda_arch == f"{major}.{minor}"


def test_cuda_examples(build_cache, tmp_path, example_pairs):
    pairs = example_pairs("cuda")
    config = EvalConfig(backend="cuda", trials=3, cache_dir=build_cache, build=BuildConfig(jobs=8),
                        timing=TimingConfig(iters=20))
    res = {r.candidate_id: r for r in evaluate(pairs, config, out_dir=tmp_path, progress=False)}
    expected = {"19_ReLU/correct": Outcome.CORRECT, "19_ReLU/wrong": Outcome.VALUE_MISMATCH,
                "19_ReLU/broken": Outcome.COMPILE_ERROR, "90_AddMul/correct": Outcome.CORRECT,
                "90_AddMul/out_of_bounds": Outcome.CUDA_MEMORY_ERROR, "90_AddMul/no_modelnew": Outcome.PYTHON_ERROR}
    assert {k: r.outcome for k, r in res.items()} == expected, {k: r.error[:300] for k, r in res.items()}
    good = res["19_ReLU/correct"]
    assert good.speedup and good.speedup > 0 and good.hardware and good.backend == "cuda"
    # the speed-of-light bound is on by default on CUDA: reported, and an honest kernel stays below it
    assert good.timing.speed_of_light.sol_ms > 0 and not good.timing.speed_of_light.faster_than_light
    assert (build_cache / "ceilings.json").exists()
    # the build targets the present GPU's architecture (e.g. sm_90 on an H200), not a hard-coded older one
    from torch.utils.cpp_extension import CUDA_HOME

    cuobjdump = shutil.which("cuobjdump") or shutil.which("cuobjdump", path=f"{CUDA_HOME}/bin" if CUDA_HOME else "")
    if not cuobjdump:  # everything above passed; this last check needs the CUDA toolkit's cuobjdump
        pytest.skip("cuobjdump not found (PATH, $CUDA_HOME/bin): the build's GPU architecture was not checked")
    major, minor = torch.cuda.get_device_capability(0)
    sos = list(build_cache.rglob("example_relu_cuda*.so"))
    assert sos
    listing = subprocess.run([cuobjdump, "--list-elf", str(sos[0])], capture_output=True, text=True).stdout
    assert f"sm_{major}{minor}" in listing, listing


def test_light_cuda_header_is_used_and_falls_back_when_the_kernel_needs_the_full_one(tmp_path, example_pairs):
    """The CUDA unit builds with the lean headers when it can, and from its own sources when it cannot."""
    import hashlib

    from dice_kernels.harness import Candidate

    (task, plain), = [p for p in example_pairs("cuda") if p[1].id == "19_ReLU/correct"]
    # torch::cuda::device_count() is declared by torch/cuda.h, which <torch/extension.h> brings and
    # <torch/types.h> does not: the light attempt fails to compile, the candidate's own sources succeed
    code = plain.code.replace("auto xc = x.contiguous();",
                              "TORCH_CHECK(torch::cuda::device_count() > 0);\n    auto xc = x.contiguous();")
    code = code.replace('name="example_relu_cuda"', 'name="example_relu_cuda_full_header"')
    needs_full = Candidate("19_ReLU/needs_full_header", code, raw_sha256=hashlib.sha256(code.encode()).hexdigest())
    config = EvalConfig(backend="cuda", trials=2, cache_dir=tmp_path / "cache", build=BuildConfig(jobs=2),
                        timing=TimingConfig(enabled=False))
    res = {r.candidate_id: r for r in evaluate([(task, plain), (task, needs_full)], config, progress=False)}
    assert {k: r.outcome for k, r in res.items()} == {"19_ReLU/correct": Outcome.CORRECT,
                                                     "19_ReLU/needs_full_header": Outcome.CORRECT}
    # the lean headers serve the plain kernel; the one that needs torch/cuda.h falls back to its own
    assert [s["headers"] for s in res["19_ReLU/correct"].build.shortcuts] == [["lean"]]
    # its cpp_sources only declare relu_forward: main.cpp took the light torch/extension.h, and the bindings work
    assert [(s.get("light_main"), s["pch"]) for s in res["19_ReLU/correct"].build.shortcuts] == [
        (True, True)]  # ...and its precompiled form, which this cold run built
    assert [s["headers"] for s in res["19_ReLU/needs_full_header"].build.shortcuts] == [["lean", "own"]]


def test_inputs_are_generated_on_the_gpu_and_on_the_cpu_where_get_inputs_needs_it():
    from types import ModuleType, SimpleNamespace

    from dice_kernels.harness.worker.trial_inputs import _generated_inputs

    task = ModuleType("task")
    exec("import torch\n"
         "def get_inputs():\n    return [torch.randn(1024, 1024), torch.randint(0, 9, (8,))]\n"
         "def cpu_only():\n    return [torch.tensor(torch.randn(4, 4).numpy())]\n", task.__dict__)
    job = SimpleNamespace(inputs_on_device=True, device="cuda")
    x, i = _generated_inputs(task, job, seed=7)
    assert x.is_cuda and i.is_cuda and i.dtype == torch.int64  # integer inputs keep their dtype
    assert torch.equal(x, _generated_inputs(task, job, seed=7)[0])  # seeded: reference and candidate agree
    task.get_inputs = task.cpu_only  # .numpy() fails on a CUDA tensor: generated on the CPU, then moved
    [y] = _generated_inputs(task, job, seed=7)
    assert y.is_cuda and torch.equal(y, _generated_inputs(task, job, seed=7)[0])


def test_a_cuda_compile_error_on_a_cold_cache_skips_main_cpp(tmp_path, example_pairs):
    """On a cold cache the broken kernel's CUDA unit fails while the precompiled header is still being built: its
    main.cpp, waiting for the header, is then not compiled at all. Outcome and message stay the compiler's."""
    (task, broken), = [p for p in example_pairs("cuda") if p[1].id == "19_ReLU/broken"]
    config = EvalConfig(backend="cuda", trials=1, cache_dir=tmp_path / "cache", build=BuildConfig(jobs=1),
                        timing=TimingConfig(enabled=False))
    (r,) = evaluate([(task, broken)], config, progress=False)
    assert r.outcome is Outcome.COMPILE_ERROR and "expected a \";\"" in r.error
    assert "skipped" not in r.error  # the excerpt holds the compiler's error lines, not the waiting compiler's
    (shortcut,) = r.build.shortcuts
    assert shortcut["headers"] == ["lean", "own"]
    assert shortcut.get("main_skipped", 0) >= 1  # the lean attempt's at least: it fails seconds into its parse
