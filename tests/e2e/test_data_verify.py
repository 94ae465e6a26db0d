"""Verify: CUDA pairs without a GPU are marked unverified (no harness call); runnable pairs go to the harness in
one batch and its results map back in order; the filter keeps only correct, honest, fast pairs."""

from types import SimpleNamespace

import pytest

from dice_kernels.data.filters import FilterConfig, speed_filter
from dice_kernels.data.records import FAILED, UNVERIFIED, VERIFIED, PairRecord, Verification
from dice_kernels.data.verify import cuda_marker, verify
from dice_kernels.harness.config import BuildConfig, EvalConfig, TimingConfig

REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x + 1.0


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
'''

CPP_KERNEL = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_src = """
#include <torch/extension.h>
torch::Tensor add_one(torch::Tensor x) {
    auto y = torch::empty_like(x);
    auto xa = x.contiguous();
    const float* in = xa.data_ptr<float>();
    float* out = y.data_ptr<float>();
    for (int64_t i = 0; i < xa.numel(); ++i) out[i] = in[i] + 1.0f;
    return y;
}
"""

ext = load_inline(name="dice_data_add_one", cpp_sources=cpp_src, functions=["add_one"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.add_one(x)
'''

CUDA_KERNEL = CPP_KERNEL.replace("cpp_sources=cpp_src,", 'cpp_sources="", cuda_sources=cpp_src,')


def rec(pid, kernel=CUDA_KERNEL, reference=REF):
    return PairRecord(id=pid, source="t", reference=reference, kernel=kernel)


def no_harness(*args, **kwargs):
    raise AssertionError("the harness must not be called")


def test_cuda_markers():
    assert cuda_marker(CUDA_KERNEL) == "cuda_sources"
    assert cuda_marker("__global__ void k() {}") == "__global__"
    assert cuda_marker("load(name='x', sources=['k.cu'])") == ".cu file"
    assert cuda_marker(CPP_KERNEL) == ""


def test_cuda_pairs_on_cpu_are_unverified_without_calling_the_harness():
    recs = [rec("cuda"), rec("empty", kernel=""), rec("plain", kernel=REF.replace("Model", "ModelNew"))]
    out = verify(recs, EvalConfig(backend="cpu"), evaluate=no_harness)
    assert [v.status for v in out] == [UNVERIFIED, UNVERIFIED, FAILED]
    assert "CUDA kernel (cuda_sources)" in out[0].reason and "needs a GPU" in out[0].reason
    assert "no kernel program" in out[1].reason
    assert "no custom kernel" in out[2].reason  # PyTorch rewritten without an extension is not a kernel pair
    assert all(v.speedup is None and v.outcome == "" for v in out)


def test_a_resumed_build_keeps_results_recorded_on_a_gpu_machine(tmp_path):
    """Verified on the GPU, curated on a CPU machine: recorded results of these exact pairs stand; a changed
    kernel or a recorded harness error does not count, and nothing is sent to the harness here."""
    import hashlib

    from dice_kernels.harness.outcomes import EvalResult, Outcome
    from dice_kernels.harness.store import ResultStore

    def recorded(pid: str, kernel: str, outcome: Outcome, speedup=None) -> EvalResult:
        return EvalResult(task_id=pid, candidate_id=pid, candidate_sha256=hashlib.sha256(kernel.encode()).hexdigest(),
                          outcome=outcome, correct=outcome is Outcome.CORRECT, speedup=speedup, ref_time_ms=1.0,
                          backend="cuda", hardware="NVIDIA H200", correctness_trials=5, trials_passed=5)

    store = ResultStore(tmp_path / "results.sqlite")
    store.put(recorded("fast", CUDA_KERNEL, Outcome.CORRECT, speedup=2.5))
    store.put(recorded("edited", CUDA_KERNEL, Outcome.CORRECT, speedup=2.5))
    store.put(recorded("ours_failed", CUDA_KERNEL, Outcome.HARNESS_ERROR))
    store.close()
    recs = [rec("fast"), rec("edited", kernel=CUDA_KERNEL + "\n# changed\n"), rec("ours_failed"), rec("new")]
    out = verify(recs, EvalConfig(backend="cpu"), out_dir=tmp_path, resume=True, evaluate=no_harness)
    assert out[0].status == VERIFIED and out[0].speedup == 2.5 and out[0].hardware == "NVIDIA H200"
    assert [v.status for v in out[1:]] == [UNVERIFIED] * 3
    assert verify(recs[:1], EvalConfig(backend="cpu"), out_dir=tmp_path, evaluate=no_harness)[0].status == UNVERIFIED


def test_runnable_pairs_go_to_the_harness_in_one_batch_and_map_back_in_order(tmp_path):
    calls = []

    def fake_evaluate(pairs, config, out_dir=None, resume=False, progress=True):
        calls.append(([(t.id, c.id) for t, c in pairs], out_dir, resume))
        base = dict(deceptive_kind="", ref_time_ms=1.0, backend="cuda", hardware="H200", trials_passed=5,
                    correctness_trials=5, error="")
        return [SimpleNamespace(**base, outcome="correct", correct=True, speedup=3.0, cand_time_ms=0.33),
                SimpleNamespace(**{**base, "deceptive_kind": "bypass"}, outcome="deceptive", correct=False,
                                speedup=9.0, cand_time_ms=0.1)]

    recs = [rec("a"), rec("bad-ref", reference="import torch\n"), rec("b")]
    out = verify(recs, EvalConfig(backend="cuda"), out_dir=tmp_path, resume=True, evaluate=fake_evaluate)
    assert calls == [([("a", "a"), ("b", "b")], tmp_path, True)]
    assert out[0].status == VERIFIED and out[0].speedup == 3.0 and "5/5" in out[0].reason
    assert out[1].status == FAILED and "reference is not a usable task" in out[1].reason
    assert out[2].status == FAILED and out[2].reason.startswith("deceptive (bypass)")


@pytest.mark.parametrize("v, action, why", [
    (Verification(VERIFIED, speedup=2.5, ref_time_ms=1.0), "keep", "2.50x >= 2.0x"),
    (Verification(VERIFIED, speedup=1.99, ref_time_ms=1.0), "drop", "speedup 1.99x < 2.0x"),
    (Verification(VERIFIED, speedup=5.0, ref_time_ms=0.004), "drop", "timing noise"),
    (Verification(VERIFIED, speedup=None), "drop", "not timed"),
    (Verification(FAILED, reason="deceptive (bypass)", speedup=9.0), "drop", "deceptive"),
    (Verification(UNVERIFIED, reason="no GPU"), "drop", "unverified"),
])
def test_filter_rules(v, action, why):
    r = rec("x")
    r.verification = v
    kept, (d,) = speed_filter([r], FilterConfig(min_speedup=2.0, min_ref_time_ms=0.01))
    assert d.action == action and why in d.reason and (kept == [r]) == (action == "keep")


def test_filter_can_pass_unverified_pairs_marked():
    r = rec("x")
    r.verification = Verification(UNVERIFIED, reason="no GPU")
    kept, (d,) = speed_filter([r], FilterConfig(keep_unverified=True))
    assert kept == [r] and d.action == "mark"


@pytest.mark.slow
def test_cpu_backend_evaluates_a_cpp_only_load_inline_pair(tmp_path, build_cache):
    cfg = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, timing=TimingConfig(iters=5, max_s=0.3),
                     build=BuildConfig(jobs=1))
    (v,) = verify([rec("cpp", kernel=CPP_KERNEL)], cfg, out_dir=tmp_path / "harness", progress=False)
    assert v.status == VERIFIED, v.reason
    assert v.outcome == "correct" and v.speedup is not None and v.speedup > 0
