"""build_speed: the light CUDA header rewrite, flag normalisation, and a real build through the precompiled header."""

from __future__ import annotations

from dice_kernels.harness import EvalConfig, Outcome, evaluate
from dice_kernels.harness.build_speed import build_pch, light_cuda_sources, normalize_cflags, plan_pch

KERNEL = "#include <torch/extension.h>\n#include <cuda_runtime.h>\n__global__ void k() {}\n"


def test_light_sources_drop_only_the_extension_include():
    (light,) = light_cuda_sources(KERNEL)
    assert "#include <torch/extension.h>" not in light
    assert "#include <cuda_runtime.h>" in light and "__global__ void k() {}" in light
    assert light_cuda_sources([KERNEL, "int x;"])[1] == "int x;"


def test_light_sources_leave_code_that_needs_the_full_header():
    assert light_cuda_sources(None) is None
    assert light_cuda_sources("#include <torch/types.h>\n__global__ void k() {}") is None  # nothing to drop
    assert light_cuda_sources(KERNEL + "PYBIND11_MODULE(m, m) {}") is None
    assert light_cuda_sources(KERNEL + "auto y = torch::nn::functional::relu(x);") is None


def test_cflags_normalise_like_torch():
    assert normalize_cflags(None) == ()
    assert normalize_cflags([""]) == ()  # the leaderboard's common extra_cflags=[""]
    assert normalize_cflags(["-O3 ", ""]) == ("-O3",)
    assert normalize_cflags("-O3") == ("-O3",)


def test_cpu_build_uses_the_precompiled_header_and_keeps_the_outcome(tmp_path, example_pairs):
    pairs = [p for p in example_pairs("cpu") if p[1].id in ("19_ReLU/correct", "19_ReLU/broken")]
    # evaluate() prepares the header in the background (early builds do without it); prepared first here so
    # these builds take it
    assert build_pch(plan_pch(tmp_path / "fast", with_cuda=False))
    fast = EvalConfig(backend="cpu", trials=2, timing=False, cache_dir=tmp_path / "fast")
    plain = EvalConfig(backend="cpu", trials=2, timing=False, cache_dir=tmp_path / "plain", fast_build=False)
    with_pch = {r.candidate_id: r for r in evaluate(pairs, fast, progress=False)}
    without = {r.candidate_id: r for r in evaluate(pairs, plain, progress=False)}
    assert {k: r.outcome for k, r in with_pch.items()} == {k: r.outcome for k, r in without.items()} == {
        "19_ReLU/correct": Outcome.CORRECT, "19_ReLU/broken": Outcome.COMPILE_ERROR}
    assert [s["pch"] for s in with_pch["19_ReLU/correct"].extra["build_shortcuts"]] == [True]
    assert [s["pch"] for s in without["19_ReLU/correct"].extra["build_shortcuts"]] == [False]
    assert list((tmp_path / "fast" / "pch").glob("*/torch/extension.h.gch"))
    assert not (tmp_path / "plain" / "pch").exists()
    # the compiler's own message, not one about the header shortcut
    assert "extension.h" not in with_pch["19_ReLU/broken"].error


def test_a_cold_batch_publishes_the_header_for_the_next_run(tmp_path, example_pairs):
    pairs = [p for p in example_pairs("cpu") if p[1].id == "19_ReLU/broken"]
    config = EvalConfig(backend="cpu", trials=1, timing=False, cache_dir=tmp_path)
    (result,) = evaluate(pairs, config, progress=False)
    assert result.outcome is Outcome.COMPILE_ERROR
    headers = list((tmp_path / "pch").glob("*/torch/extension.h.gch"))
    assert len(headers) == 2  # extra_cflags [] and ["-O3"]
    assert all((h.parent / "extension.h").resolve().name == "extension.h" for h in headers)
