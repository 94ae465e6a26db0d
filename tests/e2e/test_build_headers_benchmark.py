"""benchmarks/build_headers.py: the load_inline arguments each header mode builds with, and its summary (fast,
nothing is compiled)."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import build_headers as bh  # noqa: E402

SOURCES = "#include <torch/extension.h>\n__global__ void k(float* y) {}\n// torch::relu\n"


def test_each_mode_changes_only_what_it_names(tmp_path):
    arguments = {"name": "ext", "cpp_sources": "", "cuda_sources": SOURCES, "extra_cuda_cflags": ["-O3"]}
    assert bh.mode_arguments(arguments, "own", tmp_path) == arguments
    light = bh.mode_arguments(arguments, "light", tmp_path)
    assert "#include <torch/extension.h>" not in light["cuda_sources"][0] and light["extra_cuda_cflags"] == ["-O3"]
    lean = bh.mode_arguments(arguments, "lean", tmp_path)
    assert lean["cuda_sources"] == light["cuda_sources"]
    assert lean["extra_cuda_cflags"] == ["-O3", "-DAT_PER_OPERATOR_HEADERS", f"-I{tmp_path / 'lean_include'}"]
    assert (tmp_path / "lean_include" / "ATen" / "Functions.h").exists()
    # sources without the include: the light mode would change nothing and is not built
    assert bh.mode_arguments({**arguments, "cuda_sources": "__global__ void k() {}"}, "light", tmp_path) is None


def test_summary_compares_modes_on_the_kernels_every_mode_compiled():
    def built(s: float) -> dict:
        return {"compiled": True, "nvcc_s": s, "error": ""}

    failed = {"compiled": False, "nvcc_s": None, "error": "x"}
    results = [{"id": "1", "modes": {"own": built(60.0), "light": built(30.0), "lean": built(20.0)}},
               {"id": "2", "modes": {"own": built(40.0), "light": built(20.0), "lean": failed}},
               {"id": "3", "error": "no load_inline call with cuda_sources"}]
    s = bh.summarize(results, bh.MODES)
    assert s["compared"] == 1
    assert s["lean"] == {"tried": 2, "compiled": 1, "median_nvcc_s": 20.0, "median_speedup_vs_own": pytest.approx(3.0)}
    assert s["own"]["median_nvcc_s"] == 50.0 and s["light"]["median_speedup_vs_own"] == pytest.approx(2.0)


def test_rows_of_either_corpus_are_named_as_the_harness_names_them():
    assert bh.row_id({"id": 6995, "cuda_code": ""}) == "6995"
    assert bh.row_id({"level": "1", "problem_id": "39", "file": "f8c57e5701cb", "code": ""}) == "L1/40/f8c5"


def test_nvcc_steps_are_read_from_its_own_timing_table(tmp_path):
    """A real `nvcc --time` table of a small unit: numbered steps of one kind add up, every step is there."""
    import shutil
    import subprocess

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    (tmp_path / "k.cu").write_text("__global__ void k(float* y) { y[threadIdx.x] = 1.0f; }\n")
    table = tmp_path / "time.csv"
    subprocess.run(["nvcc", "-c", "k.cu", "-o", "k.o", "--time", str(table)], cwd=tmp_path, check=True, timeout=300)
    stages = bh.nvcc_stage_seconds(table.read_text())
    assert {"gcc (preprocessing)", "cudafe++", "cicc", "ptxas", "gcc (compiling)"} <= set(stages)
    assert all(s >= 0 for s in stages.values()) and stages["cicc"] > 0
    numbered = [float(ln.split(",")[-2]) / 1000 for ln in table.read_text().splitlines() if "preprocessing" in ln]
    assert len(numbered) == 2  # two preprocessing passes (host and device) become one entry
    assert stages["gcc (preprocessing)"] == pytest.approx(sum(numbered))
