"""The bare C++ build (harness/compiling/bare_cpp.py): which `load_inline` calls it takes, that what it builds is a
Python module whose functions behave as torch's bindings would, that its stub declares what torch's header does
outside torch, and that the harness falls back to torch's own build where torch's header could make a difference."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from dice_kernels.harness.compiling.bare_cpp import (STANDARD_HEADERS, bare_failure_is_final, build_bare_cpp,
                                                     scalar_functions, torch_macro_names, write_stub)

LAUNCHER = """#include <cstdint>
// the kernel: fused(...) below is bound; its calls in comments and bodies are not declarations
void fused(int64_t x, int64_t out, int64_t rows, const int64_t cols) {
    const float* px = (const float*)x;
    float* po = (float*)out;
    for (int64_t i = 0; i < rows * cols; ++i) po[i] = px[i] > 0 ? px[i] : 0.0f;
}
"""

needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")


def _functions(sources, functions=("fused",), **arguments):
    return scalar_functions({"name": "ext", "cpp_sources": sources, "functions": list(functions), **arguments})


def test_launchers_with_scalar_signatures_take_the_bare_build():
    (fused,) = _functions(LAUNCHER)
    assert (fused.name, fused.params, fused.returns) == ("fused", ("int64_t",) * 4, "void")
    # a declaration and a definition that agree, a call, a default argument, several functions and their docstrings
    text = "double scale(double v, int n = 2);\ndouble scale(double v, int n) { return v * n; }\n" \
           "bool positive(float v) { return scale(v, 1) > 0; }\nint64_t count() { return 3; }"
    bound = scalar_functions({"name": "ext", "cpp_sources": [text], "functions": {"scale": "doc", "positive": "p",
                                                                                    "count": "c"}})
    assert [(f.name, f.doc, f.params, f.returns) for f in bound] == [
        ("scale", "doc", ("double", "int"), "double"), ("positive", "p", ("float",), "bool"),
        ("count", "c", (), "int64_t")]
    assert scalar_functions({"name": "ext", "cpp_sources": LAUNCHER, "functions": None}) is None  # binds itself


@pytest.mark.parametrize("sources, arguments", [
    ("torch::Tensor fused(torch::Tensor x) { return x; }", {}),  # torch's types
    ("void fused(int64_t x) { at::Tensor t; }", {}),  # torch named in the body
    ("void fused(float* x) {}", {}),  # a pointer: pybind11 would not bind it as an address
    ("std::vector<float> fused(int64_t n) { return {}; }", {}),  # a container
    ("void fused(int64_t a) {}\nvoid fused(double a) {}", {}),  # overloads
    ("template <typename T> T fused(T a) { return a; }", {}),  # a template
    ("void other(int64_t a) {}", {}),  # the bound function is not declared
    ('void fused(int64_t a) {}\nPYBIND11_MODULE(ext, m) { m.def("g", &fused); }', {}),  # its own bindings
    (LAUNCHER, {"cuda_sources": "__global__ void k() {}"}),  # a CUDA unit
    (LAUNCHER, {"is_python_module": False}),
    (LAUNCHER, {"name": "not-an-identifier"}),
])
def test_everything_else_builds_as_torch_would(sources, arguments):
    assert _functions(sources, **arguments) is None


@needs_cxx
def test_a_bare_build_is_a_module_whose_functions_behave_as_torchs_bindings(tmp_path):
    import torch

    sources = LAUNCHER + """
#include <stdexcept>
double mean(double a, double b) { return (a + b) / 2; }
int64_t twice(int n) { return 2 * (int64_t)n; }
bool refuse(int64_t n) { if (n < 0) throw std::invalid_argument("n must be >= 0"); return n > 3; }
double magnitude(double v) { return abs(v); }  // std::abs(double) under torch's header, not C's int abs
"""
    functions = {"fused": "fused", "mean": 'the "mean" \u2014 of two\\', "twice": "twice", "refuse": "refuse",
                 "magnitude": "magnitude"}
    module = build_bare_cpp("bare_ext", sources, functions, extra_cflags=["-O2"], build_directory=tmp_path)
    assert module.__name__ == "bare_ext" and (tmp_path / "bare_ext.so").exists()
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    assert module.fused(x.data_ptr(), out.data_ptr(), 4, 8) is None
    assert torch.equal(out, torch.relu(x))
    assert module.mean(1, 2.0) == 1.5 and module.twice(21) == 42 and module.refuse(5) is True
    assert module.magnitude(-2.5) == 2.5
    with pytest.raises(RuntimeError, match="n must be >= 0"):  # a C++ exception, as torch's bindings raise it
        module.refuse(-1)
    with pytest.raises(TypeError):  # no float for an integer, as pybind11
        module.twice(2.5)
    with pytest.raises(TypeError):  # positional arguments, all of them
        module.mean(1.0)
    assert module.mean.__doc__ == 'the "mean" \u2014 of two\\'  # any docstring, escaped into C


@needs_cxx
def test_a_second_module_of_the_same_name_in_one_process_imports_under_torchs_versioned_name(tmp_path):
    """torch's `load` renames a second module of one name with other sources (`twin_v1`) and compiles it with that
    TORCH_EXTENSION_NAME: the C API init function must follow the macro, or the import finds no PyInit_twin_v1."""
    import torch

    x = torch.randn(4, 8)
    for n, sources in enumerate((LAUNCHER, LAUNCHER.replace("px[i] : 0.0f", "px[i] : -1.0f"))):
        built = tmp_path / f"b{n}"
        built.mkdir()
        module = build_bare_cpp("twin", sources, ["fused"], build_directory=built)
        out = torch.empty(4, 8)
        module.fused(x.data_ptr(), out.data_ptr(), 4, 8)
        assert torch.equal(out, torch.where(x > 0, x, torch.tensor(0.0 if n == 0 else -1.0)))
    assert module.__name__ == "twin_v1"


@needs_cxx
def test_a_published_stub_is_found_with_its_precompiled_form_under_torchs_own_flags(tmp_path):
    """The harness precompiles the stub once per flags (compiling/speed.py) and a bare build finds it there: the
    compile torch's ninja file runs takes the precompiled form (GCC checks it is valid for that compile)."""
    import shlex

    import torch

    from dice_kernels.harness.compiling.speed import build_pch, pch_file, plan_pch, planned_pch

    plans = plan_pch(tmp_path / "cache", with_cuda=False, variants=(("-O3",),), bare=True)
    (stub,) = [p for p in plans if p.kind == "bare"]
    assert build_pch([stub]) == {} and stub.ready  # published beside torch's own, which stays unbuilt
    built = tmp_path / "build"
    built.mkdir()
    module = build_bare_cpp("stub_ext", LAUNCHER, ["fused"], extra_cflags=["-O3"], build_directory=built,
                            stub_dir=planned_pch(plans, "bare")['["-O3"]'])
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    module.fused(x.data_ptr(), out.data_ptr(), 4, 8)
    assert torch.equal(out, torch.relu(x)) and not (built / "bare_include").exists()
    ninja = dict(line.split(" = ", 1) for line in (built / "build.ninja").read_text().splitlines() if " = " in line)
    compile_main = [*shlex.split(ninja["cxx"]), *shlex.split(ninja["cflags"]), "-c", str(built / "main.cpp"),
                    *shlex.split(ninja.get("post_cflags", "")), "-H", "-Winvalid-pch", "-o", str(tmp_path / "m.o")]
    done = subprocess.run(compile_main, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"! {pch_file(stub.root)}" in done.stderr


def _included_files(header: str, include_dirs: list[str]) -> set[str]:
    done = subprocess.run(["c++", "-M", "-std=c++20", *(f"-I{d}" for d in include_dirs), "-x", "c++", "-"],
                          input=header, capture_output=True, text=True, check=True)
    return {str(Path(f).resolve()) for f in done.stdout.replace("\\\n", " ").split()[1:]}


@needs_cxx
def test_the_stub_pulls_in_exactly_the_system_files_torchs_extension_header_does(tmp_path):
    """Every standard and system file (Python's too) torch/extension.h includes, and nothing more: code that names
    nothing of torch sees the same declarations under both."""
    import torch.utils.cpp_extension as cpp

    python = sysconfig.get_path("include")
    write_stub(tmp_path)
    torch_root = str(Path(cpp.include_paths()[0]).resolve())
    under_torch = {f for f in _included_files("#include <torch/extension.h>\n", [*cpp.include_paths(), python])
                   if not f.startswith(torch_root)}
    under_stub = _included_files("#include <torch/extension.h>\n", [str(tmp_path), python])
    assert under_stub - {str((tmp_path / "torch" / "extension.h").resolve())} == under_torch
    assert {Path(f).name for f in under_torch} >= set(STANDARD_HEADERS)


def test_a_failed_bare_build_reads_the_macro_names_the_harness_stored(tmp_path):
    stored = tmp_path / "torch-macros.json"
    stored.write_text('["DICE_TORCH_ONLY_MACRO"]')
    uses = LAUNCHER + "int64_t n() { return DICE_TORCH_ONLY_MACRO; }"
    assert not bare_failure_is_final(uses, str(stored))
    assert bare_failure_is_final(LAUNCHER.replace("po[i] = ", "po[i] = undeclared + "), str(stored))


@needs_cxx
def test_torchs_macros_make_a_bare_failure_inconclusive():
    macros = torch_macro_names()
    assert {"TORCH_CHECK", "AT_DISPATCH_FLOATING_TYPES", "C10_UNUSED", "CHECK"} <= macros
    assert not {"INFINITY", "NAN", "assert", "Py_RETURN_NONE"} & macros  # the stub defines these too
    assert bare_failure_is_final(LAUNCHER.replace("po[i] = ", "po[i] = undeclared + "))
    assert not bare_failure_is_final(LAUNCHER + "void check(int64_t n) { TORCH_CHECK(n > 0, \"n\"); }")
    assert not bare_failure_is_final(LAUNCHER + "// pybind11 in a comment is fine\nvoid g(int64_t p) { pybind11::none(); }")
    assert bare_failure_is_final(LAUNCHER + "// TORCH_CHECK in a comment is fine")


@needs_cxx
def test_the_harness_takes_the_bare_build_and_falls_back_to_torchs_own(build_cache):
    from dice_kernels.harness import EvalConfig, Outcome, TimingConfig, candidate_from_text, evaluate
    from dice_kernels.tasks import task_from_code

    task = task_from_code("""import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(16, 64)]


def get_init_inputs():
    return []
""", id="relu")

    def candidate(source: str, id: str):
        return candidate_from_text(f'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ext = load_inline(name="relu_ext", cpp_sources={source!r}, functions=["fused"], extra_cflags=["-O3"])


class ModelNew(nn.Module):
    def forward(self, x):
        out = x.new_empty(x.shape)
        ext.fused(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
        return out
''', id=id)

    broken = LAUNCHER.replace("po[i] = ", "po[i] = undeclared + ")
    # TORCH_CHECK names no torch namespace, so the bare build is tried; without torch's macro it does not compile
    checked = LAUNCHER.replace("float* po = (float*)out;", "float* po = (float*)out;\n    TORCH_CHECK(rows > 0);")
    pairs = [(task, candidate(LAUNCHER, "bare")), (task, candidate(broken, "broken")),
             (task, candidate(checked, "torch_macro"))]
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, timing=TimingConfig(enabled=False))
    results = {r.candidate_id: r for r in evaluate(pairs, config, progress=False)}
    assert results["bare"].outcome is Outcome.CORRECT, results["bare"].error
    assert results["bare"].build.shortcuts[0]["headers"] == ["bare"]
    # a compile error torch's header cannot mend ends with the bare attempt: no second, ~8 s build
    assert results["broken"].outcome is Outcome.COMPILE_ERROR
    assert results["broken"].build.shortcuts[0]["headers"] == ["bare"]
    assert "'undeclared' was not declared" in results["broken"].error.replace("‘", "'").replace("’", "'")
    # one that uses torch's macro falls back to torch's own build, which compiles it
    assert results["torch_macro"].outcome is Outcome.CORRECT, results["torch_macro"].error
    assert results["torch_macro"].build.shortcuts[0]["headers"] == ["bare", "own"]
    # the batch published the stub's precompiled form before it ended; the next batch's bare builds take it
    (again,) = evaluate([(task, candidate(LAUNCHER + "// another program", "again"))], config, progress=False)
    assert again.outcome is Outcome.CORRECT and again.build.shortcuts[0]["pch"] is True
    # and it stored torch's macro names, which a failed bare build reads instead of asking the preprocessor
    from dice_kernels.harness.compiling.bare_cpp import read_macro_names
    from dice_kernels.harness.compiling.speed import torch_macros_file

    assert read_macro_names(str(torch_macros_file(build_cache))) == torch_macro_names()
