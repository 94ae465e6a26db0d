"""compiling/bare_cuda.py: torch/types.h's surroundings under nvcc, measured for real, and the second bare CUDA attempt
whose failure is final (nvcc compiles here; nothing runs the result); and the bare module (compiling/bare_cpp.py with
CUDA sources): which demo-world programs take it, its units compiled and linked here, the attempts it leads, and on a
GPU its build through the harness."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sysconfig
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

from dice_kernels.demo.world import FAST, SHORTCUT, SLIP, SLOW, WorldSizes, WorldTask, build_world
from dice_kernels.harness.compiling import bare_cuda
from dice_kernels.harness.compiling.bare_cpp import bare_load_arguments, build_bare_cpp, scalar_functions
from dice_kernels.harness.compiling.light_headers import bare_cuda_arguments
from dice_kernels.harness.process.protocol import BuildJob

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

KERNEL = "__global__ void k(float* p, int n) { if (threadIdx.x < n) p[threadIdx.x] = 1.0f; }\n"
NEEDS_VECTOR = "std::vector<int> sizes() { return {1, 2}; }\n" + KERNEL  # <vector> comes with torch's header
BROKEN = "__global__ void k(float* p) { p[0] = undeclared_name; }\n"


@pytest.fixture(scope="module")
def surroundings() -> bare_cuda.Surroundings:
    found = bare_cuda.measure("nvcc")
    assert found is not None
    return found


@needs_nvcc
def test_the_surroundings_are_what_torch_types_h_brings_from_outside_torch(surroundings):
    headers = set(surroundings.headers)
    assert {"vector", "cmath", "cuda_fp16.h", "thrust/complex.h"} <= headers
    assert not {"hip/hip_runtime.h", "sycl/sycl.hpp", "arm_neon.h"} & headers  # other platforms' includes
    assert not any(h.startswith(("c10/", "ATen/", "torch/")) for h in headers)
    assert {"TORCH_CHECK", "AT_DISPATCH_FLOATING_TYPES", "C10_HOST_DEVICE"} <= surroundings.macros
    assert "__CUDACC__" not in surroundings.macros and "M_PI" not in surroundings.macros  # defined without torch


def _compile(source: str, header: str, tmp: Path) -> subprocess.CompletedProcess:
    """`source` as load_inline writes its CUDA unit, with `header` as the torch/types.h nvcc finds."""
    arguments = bare_cuda_arguments({"name": "e", "cpp_sources": "", "cuda_sources": source}, tmp / "inc", header)
    unit = tmp / "unit.cu"
    unit.write_text("#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n" + source)
    return subprocess.run(["nvcc", *bare_cuda.nvcc_flags(), *arguments["extra_cuda_cflags"], "-c", str(unit),
                           "-o", str(tmp / "unit.o")], capture_output=True, text=True, timeout=300)


@needs_nvcc
def test_the_wide_stub_mends_what_torchs_header_would_and_not_a_real_error(surroundings, tmp_path):
    empty = "// empty\n"
    assert _compile(NEEDS_VECTOR, empty, tmp_path).returncode != 0  # the bare attempt fails ...
    assert _compile(NEEDS_VECTOR, surroundings.stub(), tmp_path).returncode == 0  # ... the wide one builds it
    broken = _compile(BROKEN, surroundings.stub(), tmp_path)
    assert broken.returncode != 0 and "undeclared_name" in broken.stderr
    assert bare_cuda.failure_is_final(BROKEN, surroundings)  # torch's header could not declare it either


def test_a_failure_is_final_only_for_sources_without_torchs_macros_or_globals():
    around = bare_cuda.Surroundings(("vector",), frozenset({"TORCH_CHECK", "AT_ASSERT"}))
    assert bare_cuda.failure_is_final(BROKEN, around)
    assert not bare_cuda.failure_is_final(BROKEN + "void f(int n) { TORCH_CHECK(n > 0, \"n\"); }\n", around)
    assert not bare_cuda.failure_is_final(BROKEN + "PyObject* THPVariable_Wrap(void*);\n", around)
    assert bare_cuda.failure_is_final(BROKEN + "// TORCH_CHECK in a comment\n", around)


def test_cuda_builds_that_fail_bare_try_the_wide_stub_before_torchs_header(tmp_path):
    from dice_kernels.harness.compiling.in_sandbox import BuildLog, _build_attempts

    stored = tmp_path / "surroundings.json"
    stored.write_text(json.dumps({"headers": ["vector", "cmath"], "macros": ["TORCH_CHECK"]}))
    arguments = {"name": "ext", "cpp_sources": "void f(int64_t p);", "cuda_sources": BROKEN}
    job = BuildJob(workdir="", device="cuda", limits={}, candidate_path="", build_dir="", light_headers=True,
                   cuda_surroundings=str(stored))
    attempts = _build_attempts(job, arguments, tmp_path / "ext_1", BuildLog(), "ext#1")
    assert [(a.headers, a.directory.name) for a in attempts] == [
        ("bare", "ext_1"), ("bare-wide", "ext_1_wide"), ("own", "ext_1_own")]
    assert (tmp_path / "ext_1_wide_include" / "torch" / "types.h").read_text().endswith(
        "#include <vector>\n#include <cmath>\n")
    assert attempts[0].conclusive is None and attempts[1].conclusive()  # its failure ends the build
    macro = {**arguments, "cuda_sources": BROKEN + "#define CHECK(x) TORCH_CHECK(x, \"\")\n"}
    assert not _build_attempts(job, macro, tmp_path / "m", BuildLog(), "m#1")[1].conclusive()
    # before the parent has measured the surroundings: the bare attempt, then torch's header, as before
    unmeasured = BuildJob(workdir="", device="cuda", limits={}, candidate_path="", build_dir="", light_headers=True,
                          cuda_surroundings=str(tmp_path / "not-yet.json"))
    assert [a.headers for a in _build_attempts(unmeasured, arguments, tmp_path / "u", BuildLog(), "u#1")] == [
        "bare", "own"]


def test_the_surroundings_file_is_named_for_this_torch_and_nvcc(tmp_path):
    # torch/types.h lives in one of torch's include folders, not at torch/include/torch/types.h: naming the file
    # must not assume where (it raised FileNotFoundError on every CUDA evaluation)
    path = bare_cuda.surroundings_file(tmp_path, "no-such-nvcc")
    assert path.parent == tmp_path / "pch" and path.name.startswith("torch-cuda-surroundings-")
    assert bare_cuda.surroundings_file(tmp_path, "no-such-nvcc") == path
    assert bare_cuda.surroundings_file(tmp_path, "another-missing-nvcc") != path  # another compiler, another file


@needs_nvcc
def test_the_stored_surroundings_read_back_as_measured(surroundings, tmp_path):
    path = bare_cuda.surroundings_file(tmp_path, "nvcc")
    bare_cuda.store(path, "nvcc")
    assert bare_cuda.load(str(path)) == surroundings


@cache
def _world() -> tuple[WorldTask, ...]:
    """A demo world whose train tasks carry every solution variant."""
    return tuple(build_world(1, WorldSizes(n_train=40, n_heldout=8, shortcut_fraction=0.2, slow_fraction=0.3,
                                           slip_fraction=0.3)))


def _load_inline_arguments(program: str) -> dict:
    """What a program passes to `load_inline`, read by running it with torch's function replaced by a recorder."""
    import torch.utils.cpp_extension as cpp

    calls = []
    with mock.patch.object(cpp, "load_inline", lambda **kwargs: calls.append(kwargs)):
        exec(compile(program, "<demo program>", "exec"), {"__name__": "demo_program"})
    (arguments,) = calls
    return arguments


def _world_arguments(variant: str) -> list[dict]:
    return [_load_inline_arguments(t.cuda) for t in _world() if t.variant == variant]


def test_the_demo_worlds_cuda_programs_take_the_bare_module():
    for variant in (FAST, SLOW, SLIP):
        programs = _world_arguments(variant)
        assert programs, variant
        for arguments in programs:
            assert arguments["cuda_sources"] and arguments["functions"] == ["fused"]
            (fused,) = scalar_functions(arguments, cuda=True)
            assert fused.name == "fused" and set(fused.params) == {"int64_t"} and fused.returns == "void"
            assert scalar_functions(arguments) is None  # the C++-only build takes no CUDA sources
    # the libtorch shortcut: C++ on tensors, no CUDA unit
    shortcuts = _world_arguments(SHORTCUT)
    assert shortcuts and all(scalar_functions(a, cuda=True) is None for a in shortcuts)


def _changed(key: str, old: str, new: str):
    def change(arguments: dict) -> dict:
        assert old in arguments[key]
        return {**arguments, key: arguments[key].replace(old, new)}
    return change


@pytest.mark.parametrize("change", [
    _changed("cuda_sources", "void fused(int64_t x,", "void fused(torch::Tensor x,"),  # a tensor parameter
    _changed("cuda_sources", "int64_t n = ", "at::cuda::getCurrentCUDAStream(); int64_t n = "),  # at:: in a body
    _changed("cuda_sources", "#include <cstdint>", "#include <cstdint>\nvoid g(const Tensor& t);"),  # a Tensor
    _changed("cuda_sources", "#include <cstdint>", "#include <torch/extension.h>"),  # torch's header
    _changed("cpp_sources", "void fused(int64_t x,", "torch::Tensor fused(torch::Tensor x,"),  # a tensor launcher
    _changed("cpp_sources", "void fused(int64_t x,", "void fused(float* x,"),  # a pointer
    lambda a: {**a, "cuda_sources": []},
    lambda a: {k: v for k, v in a.items() if k != "cuda_sources"},
    lambda a: {**a, "sycl_sources": "void k() {}"},
    lambda a: {**a, "with_cuda": False},
    lambda a: {**a, "is_python_module": False},
    lambda a: {**a, "use_pch": True},
    lambda a: {**a, "functions": None},
], ids=["tensor-parameter", "at-in-body", "Tensor", "torch-header", "tensor-launcher", "pointer", "no-cuda-sources",
        "cpp-only", "sycl", "without-cuda", "not-a-python-module", "use-pch", "binds-itself"])
def test_cuda_modules_that_name_torch_or_take_more_than_scalars_are_not_bare_modules(change):
    arguments = _world_arguments(FAST)[0]
    assert scalar_functions(arguments, cuda=True) is not None
    assert scalar_functions(change(arguments), cuda=True) is None
    # and a C++-only module that asks for CUDA without sources is not a bare C++ build either
    assert scalar_functions({**arguments, "cuda_sources": None, "cpp_sources": "void fused(int64_t x) {}",
                             "with_cuda": True}) is None


@needs_nvcc
@pytest.mark.parametrize("variant", [FAST, SLOW])
def test_a_bare_modules_units_compile_and_link_into_a_module_here(variant, tmp_path):
    """main.cpp and cuda.cu as the bare module's builder writes them, compiled (g++ with Python's headers and the
    stub; nvcc with torch's CUDA flags and the empty torch/types.h) and linked by nvcc: the module imports
    (its `fused` defined in the CUDA unit, found from the C API bindings) and parses its arguments; nothing launches
    (no GPU here)."""
    arguments = _world_arguments(variant)[0]
    built = bare_load_arguments(**{**arguments, "extra_cuda_cflags": ["-O3"]}, build_directory=tmp_path)
    main, unit = map(Path, built["sources"])
    assert (main.name, unit.name, built["with_cuda"]) == ("main.cpp", "cuda.cu", True)
    text = main.read_text()
    assert "#define TORCH_EXTENSION_NAME fused\n" in text and "PYBIND11" not in text  # torch's -D name wins
    assert unit.read_text() == ("#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n"
                                + arguments["cuda_sources"])
    include = tmp_path / "bare_include"
    assert built["extra_cuda_cflags"] == ["-O3", f"-I{include}"] and built["extra_include_paths"] == [str(include)]
    assert (include / "torch" / "types.h").read_text().startswith("// dice-kernels")  # empty: comments only
    python = sysconfig.get_path("include")
    steps = [
        ["c++", "-std=c++17", "-fPIC", "-c", str(main), *(f"-I{d}" for d in built["extra_include_paths"]),
         f"-I{python}", "-o", str(tmp_path / "main.o")],
        ["nvcc", *bare_cuda.nvcc_flags(), *built["extra_cuda_cflags"], "-Xcompiler", "-fPIC", "-c", str(unit),
         "-o", str(tmp_path / "cuda.o")]]
    # nvcc links them with its own cudart
    steps.append(["nvcc", "-shared", str(tmp_path / "main.o"), str(tmp_path / "cuda.o"), "-o", str(tmp_path / "fused.so")])
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command[0], done.stderr[-2000:])
    spec = importlib.util.spec_from_file_location("fused", tmp_path / "fused.so")
    module = importlib.util.module_from_spec(spec)  # Python loads it with RTLD_NOW: every symbol resolved
    assert module.fused.__doc__ == "fused"
    with pytest.raises(TypeError):  # no float for an address, as pybind11
        module.fused(*[1.5] * len(scalar_functions(arguments, cuda=True)[0].params))


def test_a_cuda_module_that_takes_scalars_is_first_built_bare_in_both_units(tmp_path):
    from dice_kernels.harness.compiling.in_sandbox import BuildLog, _build_attempts

    stored = tmp_path / "surroundings.json"
    stored.write_text(json.dumps({"headers": ["vector"], "macros": ["TORCH_CHECK"]}))
    stub = tmp_path / "stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "extension.h").write_text("// the published stub\n")
    (stub / "torch" / "extension.h.gch").write_bytes(b"")
    job = BuildJob(workdir="", device="cuda", limits={}, candidate_path="", build_dir="", light_headers=True,
                   cuda_surroundings=str(stored), pch_bare={"[]": str(stub)})
    calls = []
    arguments = {**_world_arguments(FAST)[0], "extra_cflags": [], "extra_cuda_cflags": ["-O3"],
                 "extra_ldflags": ["-lm"], "extra_include_paths": ["/extra"]}
    log = BuildLog()
    attempts = _build_attempts(job, arguments, tmp_path / "fused_1", log, "fused#1", lambda **kw: calls.append(kw))
    assert [(a.headers, a.directory.name) for a in attempts] == [
        ("bare-module", "fused_1"), ("bare-wide", "fused_1_wide"), ("own", "fused_1_own")]
    first = attempts[0]
    assert first.builder is build_bare_cpp and first.conclusive is None and first.env is None  # never final
    assert log.shortcuts[-1]["pch"] is True  # the stub's precompiled form is there
    # what the builder gives torch's `load`: both units, torch's CUDA build, the candidate's flags
    directory = first.directory
    directory.mkdir(parents=True)
    first.builder(**{**first.arguments, "build_directory": str(directory)})
    (given,) = calls
    assert given["sources"] == [str(directory / "main.cpp"), str(directory / "cuda.cu")] and given["with_cuda"]
    assert given["extra_cuda_cflags"] == ["-O3", f"-I{directory / 'bare_include'}"]
    assert (given["extra_cflags"], given["extra_ldflags"]) == ([], ["-lm"])
    assert given["extra_include_paths"] == [str(stub), "/extra"]  # the published stub first
    # before the parent has measured the surroundings: the bare module, then torch's header
    unmeasured = BuildJob(workdir="", device="cuda", limits={}, candidate_path="", build_dir="", light_headers=True)
    assert [a.headers for a in _build_attempts(unmeasured, arguments, tmp_path / "u", BuildLog(), "u#1")] == [
        "bare-module", "own"]
    # a launcher that takes a pointer: the bare CUDA unit, main.cpp with torch's header and pybind11
    pointer = {**arguments, "cpp_sources": arguments["cpp_sources"].replace("int64_t x,", "float* x,")}
    assert [a.headers for a in _build_attempts(job, pointer, tmp_path / "p", BuildLog(), "p#1")] == [
        "bare", "bare-wide", "own"]


@pytest.mark.gpu
def test_a_demo_worlds_cuda_program_builds_as_a_bare_module_and_computes_the_reference(build_cache, tmp_path):
    """On a GPU: built directly and through the harness, the bare module imports, `fused` computes the reference's
    values on CUDA tensors, and the build record says the bare module decided (a second batch finds the stub's
    precompiled form the first published)."""
    import torch

    from dice_kernels.harness import EvalConfig, Outcome, TimingConfig, candidate_from_text, evaluate
    from dice_kernels.tasks import task_from_code

    tasks = [t for t in _world() if t.variant in (FAST, SLOW)][:4]
    assert {t.variant for t in tasks} == {FAST, SLOW}
    for n, task in enumerate(tasks):
        module = build_bare_cpp(**_load_inline_arguments(task.cuda), build_directory=_mkdir(tmp_path / f"b{n}"))
        # torch renames a later module of one name with other sources in this process: fused_v1, ...
        assert re.fullmatch(r"fused(_v\d+)?", module.__name__), module.__name__
        reference, candidate = {"__name__": "reference"}, {"__name__": "candidate"}
        exec(compile(task.reference, "<reference>", "exec"), reference)
        import torch.utils.cpp_extension as cpp

        with mock.patch.object(cpp, "load_inline", lambda **kwargs: module):
            exec(compile(task.cuda, "<candidate>", "exec"), candidate)
        torch.manual_seed(n)
        inputs = [x.cuda() for x in reference["get_inputs"]()]
        expected = reference["Model"](*reference["get_init_inputs"]()).cuda()(*inputs)
        got = candidate["ModelNew"]()(*inputs)
        torch.cuda.synchronize()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    config = EvalConfig(backend="cuda", trials=2, cache_dir=build_cache, timing=TimingConfig(enabled=False))
    pairs = [(task_from_code(t.reference, id=t.id), candidate_from_text(t.cuda, id=t.id)) for t in tasks]
    results = evaluate(pairs, config, progress=False)
    assert [r.outcome for r in results] == [Outcome.CORRECT] * len(pairs), [r.error[:300] for r in results]
    assert [r.build.shortcuts[0]["headers"] for r in results] == [["bare-module"]] * len(pairs), [
        r.build.shortcuts for r in results]
    again = candidate_from_text(tasks[0].cuda + "\n# another program\n", id="again")
    (result,) = evaluate([(pairs[0][0], again)], config, progress=False)
    assert result.outcome is Outcome.CORRECT and result.build.shortcuts[0]["headers"] == ["bare-module"]
    assert result.build.shortcuts[0]["pch"] is True, result.build.shortcuts


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path
