"""The throughput benchmark's batch construction and the KernelBench-style outcome mapping (fast, no builds)."""

from __future__ import annotations

import ast
import sys
from dataclasses import replace

import pytest

from conftest import REPO
from dice_kernels.harness import Candidate, candidate_from_text

sys.path.insert(0, str(REPO / "benchmarks"))
import eval_throughput as et  # noqa: E402
import kernelbench_style as kbs  # noqa: E402

CUDA = r'''
#include <torch/extension.h>
__global__ void scale_kernel(const float* x, float* tmp, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) tmp[i] = x[i] * 2.0f;
}
__global__ void add_kernel(const float* __restrict__ a, float* __restrict__ out, int64_t* idx, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { out[i] = a[i]; idx[i] = i; out[i] = a[i] + 1.0f; }
}
torch::Tensor run(torch::Tensor x) {
    auto t = torch::empty_like(x), o = torch::empty_like(x);
    scale_kernel<<<1, 32>>>(x.data_ptr<float>(), t.data_ptr<float>(), x.numel());
    add_kernel<<<1, 32>>>(t.data_ptr<float>(), o.data_ptr<float>(), nullptr, x.numel());
    return o;
}
'''


def test_mutations_edit_the_last_store_of_the_last_launched_kernel():
    store = et.find_store(CUDA)
    assert store is not None
    wrong = et.mutate_store(CUDA, store, "({v}) + 1.0f")
    assert "out[i] = (a[i] + 1.0f) + 1.0f;" in wrong and "tmp[i] = x[i] * 2.0f;" in wrong
    broken = et.undeclared_identifier(CUDA, store)
    assert f"int dice_tile = {et.UNDECLARED};" in broken.split("add_kernel(", 1)[1].split("}")[0]


def test_no_store_when_outputs_are_not_floating_point():
    assert et.find_store("__global__ void k(const float* x, bool* out) { out[0] = x[0] > 0; }\n"
                         "void f() { k<<<1, 1>>>(0, 0); }") is None


def test_layout_duplicates_share_the_syntax_tree_and_truncation_fails_generation():
    code = "import torch\nsrc = '''\n  // kernel\n'''\nx = 1\n"
    a, b = Candidate("a", code), Candidate("b", et.layout_variant(code, 3))
    assert a.sha256 != b.sha256 and a.program_sha256 == b.program_sha256
    assert candidate_from_text(et.truncated_output(code), id="t").code is None


def test_kinds_keep_priority_order_and_repeat_beyond_twelve():
    assert et.kinds_for(12) == list(et.KINDS)
    assert et.kinds_for(3) == ["correct", "wrong_offset", "dup_exact"]
    assert set(et.kinds_for(15)[12:]) <= set(et.EXTRA_KINDS)


def test_smoke_batch():
    items = et.smoke_batch()
    d = et.describe(items)
    assert d["n"] == 7 and d["distinct_programs"] == 4
    assert d["fingerprint"] == et.fingerprint(et.smoke_batch())


def test_cuda_batch_is_deterministic_and_parses(shared_data):
    items = et.cuda_batch(shared_data, 3, 12, seed=1)
    assert et.fingerprint(items) == et.fingerprint(et.cuda_batch(shared_data, 3, 12, seed=1))
    assert len(items) == 36 and not {it.task.id for it in items} & {f"dice/{i}" for i in et.EXCLUDED_PAIRS}
    for it in items:
        if it.cand.code is not None:
            ast.parse(it.cand.code)


@pytest.mark.parametrize("res, stage, outcome", [
    ({"correctness": True}, "done", "correct"),
    ({"metadata": {"compilation_error": "Error building extension 'x': ..."}}, "compile", "compile_error"),
    ({"metadata": {"compilation_error": "name 'load_inline' is not defined"}}, "compile", "python_error"),
    ({"metadata": {"other_error": "'NoneType' object is not callable"}}, "init", "python_error"),
    ({"metadata": {"runtime_error": "boom", "runtime_error_name": "builtins.RuntimeError"}}, "init", "python_error"),
    ({"metadata": {"runtime_error": "x", "runtime_error_name": "builtins.AttributeError"}}, "correctness",
     "python_error"),
    ({"metadata": {"runtime_error": "bad", "runtime_error_name": "builtins.RuntimeError"}}, "correctness",
     "runtime_error"),
    ({"metadata": {"runtime_error": "ModelNew.forward() takes 2 positional arguments but 3 were given",
                   "runtime_error_name": "builtins.TypeError"}}, "correctness", "python_error"),
    ({"metadata": {"runtime_error": "fused(): incompatible function arguments",
                   "runtime_error_name": "builtins.TypeError"}}, "correctness", "runtime_error"),
    ({"metadata": {"runtime_error": "CUDA error: an illegal memory access was encountered"}}, "correctness",
     "cuda_memory_error"),
    ({"metadata": {"correctness_issue": "Output shape mismatch: Expected [2], got [1]"}}, "correctness",
     "shape_mismatch"),
    ({"metadata": {"correctness_issue": "Output mismatch"}}, "correctness", "value_mismatch"),
    (None, "", "harness_error"),
])
def test_kernelbench_results_map_to_our_outcomes(res, stage, outcome):
    assert kbs.our_outcome(res, stage, timed_out=False) == outcome
    assert kbs.our_outcome(res, stage, timed_out=True) == "timeout"


def _run(wall: float, outcomes: dict[str, str]) -> dict:
    return {"wall_s": wall, "rate_per_min": 60.0 * len(outcomes) / wall,
            "rows": [{"id": i, "outcome": o} for i, o in outcomes.items()]}


def test_repeated_cold_runs_report_the_median_and_flag_outcomes_that_change():
    runs = [_run(58.2, {"a": "correct"}), _run(73.3, {"a": "correct"}), _run(63.8, {"a": "timeout"})]
    assert et.median_run(runs)["wall_s"] == 63.8
    assert et.median_run(runs[:2])["wall_s"] == 73.3  # of two, the slower: the ratio is not flattered
    ours = {"cold_subset": et.median_run(runs), "cold_full": _run(90.0, {"a": "timeout"}),
            "cold_subset_runs": [et.run_summary(r) for r in runs]}
    doc = {"ours": ours, "batch": {"candidates": [{"id": "a", "kind": "correct"}]},
           "kb": {"results": [{"key": "a", "outcome": "timeout", "kb": None, "retry_error": ""}]}}
    cmp = et.compare(doc)
    assert cmp["identical"] == 1 and cmp["ours_runs_disagree"] == ["a"]  # two of the three runs said correct
    doc["ours"]["cold_subset_runs"] = [et.run_summary(runs[2])]
    assert et.compare(doc)["ours_runs_disagree"] == []


def test_the_phase_table_reads_runs_beside_the_list_of_repeats(capsys):
    from rich.console import Console

    run = {**_run(58.2, {"a": "correct"}), "phases_s": {"build": 690.0, "run": 33.0}}
    doc = {"ours": {"cold_subset": run, "cold_subset_runs": [et.run_summary(run)], "cold_full": run}}
    et._print_phases(Console(width=140), doc)
    printed = capsys.readouterr().out
    assert "ours cold_subset (wall 58 s)" in printed and "build 690.0" in printed
    assert "cold_subset_runs" not in printed


def test_the_cpu_trace_sees_a_compiler_run(tmp_path):
    import subprocess

    source = tmp_path / "unit.cpp"
    source.write_text("#include <regex>\n#include <iostream>\nint main() { std::regex r(\"a+\"); return 0; }\n")
    with et.CpuTrace(interval_s=0.1) as trace:
        subprocess.run(["c++", "-O2", "-c", str(source), "-o", str(tmp_path / "unit.o")], check=True, timeout=300)
    cpu = trace.to_dict()
    assert len(cpu["busy"]) >= 3 and all(0.0 <= b <= 1.0 for b in cpu["busy"])
    assert max(cpu["running"]["cc1plus"]) >= 1 and max(cpu["busy"]) > 0.3
    assert {len(v) for v in cpu["running"].values()} == {len(cpu["busy"])}  # one count per sample


def test_the_kernelbench_style_run_reports_every_finished_candidate_as_it_goes(tmp_path):
    """Real child processes, nothing compiled: a Python error, a truncated output, and the same Python error once
    more with the time budget already spent (not_run). Every snapshot covers every candidate."""
    items = [it for it in et.smoke_batch() if it.kind in ("python_error", "truncated")]
    jobs = [kbs.KBJob(it.cand.id, it.task.id, it.task.code, it.cand.code) for it in items]
    jobs.append(kbs.KBJob("late", items[0].task.id, items[0].task.code, items[0].cand.code))
    snapshots: list[kbs.KBRun] = []

    def progress(run: kbs.KBRun) -> None:
        snapshots.append(run)
        if run.finished == 2:  # the budget ends here: the third candidate must not start
            cfg.deadline = 0.0

    cfg = kbs.KBConfig(backend="cpu", workers=2, timeout_s=120, build_root=tmp_path)
    run = kbs.evaluate_kb_style(jobs, cfg, log=lambda s: None, on_progress=progress)
    assert [r.outcome for r in run.results] == ["python_error", "generation_failure", "not_run"]
    assert [s.finished for s in snapshots] == [0, 1, 2]  # before the first candidate and after each one
    assert all(len(s.results) == len(jobs) for s in snapshots)
    assert [r.outcome for r in snapshots[0].results] == ["not_run"] * 3
    assert run.finished == 2 and kbs.rate_per_min(run) > 0
    section = et.kb_section(snapshots[1], len(jobs), cfg)  # what a call killed during the second had saved
    assert section["outcomes"] == {"python_error": 1, "not_run": 2} and section["n"] == 3


@pytest.fixture(scope="module")
def session_header(build_cache) -> str:
    """`-I` of the session cache's precompiled torch header for extra_cflags [] (built here where no batch has
    built it yet; a build in the other test worker is waited for, not repeated)."""
    from dice_kernels.harness.compiling.speed import build_pch, plan_pch

    plans = plan_pch(build_cache, with_cuda=False, variants=((),))
    build_pch(plans)
    return f"-I{plans[0].root}" if plans else "-O0"


def _with_header(item: et.Item, include: str) -> kbs.KBJob:
    """The KernelBench-style job of a smoke item whose program is the shipped C++ ReLU, built with the session's
    precompiled torch header found first (`include`) instead of its -O3: the same torch build of the same sources,
    whose main.cpp then does not parse torch's header (28 -> 10.5 s a build here under load, five builds below;
    27 s at -O3). What these tests check is which process builds, not what it makes."""
    assert 'extra_cflags=["-O3"]' in item.cand.code
    code = item.cand.code.replace('extra_cflags=["-O3"]', f"extra_cflags=[{include!r}]")
    return kbs.KBJob(item.cand.id, item.task.id, item.task.code, code)


@pytest.mark.slow
def test_the_kernelbench_style_eval_rebuilds_what_its_reused_precompile_process_built_twice(tmp_path, session_header):
    """Real C++ builds: one pre-compile process builds the same program (one extension name) for two candidates.
    Reused for both (KernelBench's pool), torch names the second `<name>_v1`, and its fresh eval process builds it
    again. (With a fresh process per build, the eval phase builds nothing: the resume test below.)"""
    (item,) = [it for it in et.smoke_batch() if it.kind == "correct"]
    jobs = [replace(_with_header(item, session_header), key=f"c{i}") for i in range(2)]
    cfg = kbs.KBConfig(backend="cpu", workers=1, timeout_s=300, build_root=tmp_path, num_perf_trials=2,
                       reuse_precompile_workers=True)
    run = kbs.evaluate_kb_style(jobs, cfg, log=lambda s: None)
    assert [r.precompile["ok"] for r in run.results] == [True, True]
    assert [r.outcome for r in run.results] == ["correct", "correct"]
    assert [r.built_in_eval for r in run.results] == [False, True]
    assert et.kb_section(run, 2, cfg)["rebuilt_precompiled"] == 1


@pytest.mark.slow
def test_a_kernelbench_style_run_cut_short_goes_on_in_a_later_process(tmp_path, session_header):
    """Real C++ builds: the time budget ends after the first candidate; resuming evaluates the other two (the same
    program, one extension name, each pre-compiled in a fresh process: KernelBench's default) on the libraries
    pre-compiled before, building nothing (a stale build lock left in a directory is cleared), keeping the first's
    seconds."""
    python_error, correct = (next(it for it in et.smoke_batch() if it.kind == k) for k in ("python_error", "correct"))
    correct_job = _with_header(correct, session_header)
    jobs = [kbs.KBJob(python_error.cand.id, python_error.task.id, python_error.task.code, python_error.cand.code),
            correct_job, replace(correct_job, key="twin")]

    def stop_after_one(run: kbs.KBRun) -> None:
        if run.finished == 1:
            cfg.deadline = 0.0

    cfg = kbs.KBConfig(backend="cpu", workers=1, timeout_s=120, build_root=tmp_path / "kb", num_perf_trials=2)
    first = kbs.KBRun.from_dict(kbs.evaluate_kb_style(jobs, cfg, log=lambda s: None, on_progress=stop_after_one)
                                .to_dict())  # through JSON's shape, as a second call reads it
    assert [r.outcome for r in first.results] == ["python_error", "not_run", "not_run"]
    assert [r.precompile["ok"] for r in first.results[1:]] == [True, True]
    with pytest.raises(ValueError, match="pre-compiled libraries of the run to resume are not under"):
        kbs.evaluate_kb_style(jobs, kbs.KBConfig(backend="cpu", build_root=tmp_path / "elsewhere"), resume=first)
    (lock_dir,) = (tmp_path / "kb" / "build" / "00001").iterdir()
    (lock_dir / "lock").touch()
    cfg = kbs.KBConfig(backend="cpu", workers=1, timeout_s=120, build_root=tmp_path / "kb", num_perf_trials=2)
    run = kbs.evaluate_kb_style(jobs, cfg, log=lambda s: None, resume=first)
    assert [r.outcome for r in run.results] == ["python_error", "correct", "correct"] and run.finished == 3
    assert [r.built_in_eval for r in run.results[1:]] == [False, False]
    assert et.kb_section(run, 3, cfg)["rebuilt_precompiled"] == 0
    assert (run.precompile_s, run.baseline_s) == (first.precompile_s, first.baseline_s) and run.eval_s > first.eval_s
    with pytest.raises(ValueError, match="other candidates"):
        kbs.evaluate_kb_style(jobs[::-1], cfg, resume=first)
