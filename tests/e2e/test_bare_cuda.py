"""compiling/bare_cuda.py: torch/types.h's surroundings under nvcc, measured for real, and the second bare CUDA attempt
whose failure is final (nvcc compiles here; nothing runs the result)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dice_kernels.harness.compiling import bare_cuda
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
