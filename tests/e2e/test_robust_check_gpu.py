"""The robust check's CUDA-only sub-kinds on a real GPU: work left on a side stream, CUDA graphs, and compiled
kernels that do a negligible share of the GPU work (the real work launched outside the dispatcher, here through
the jiterator). The shipped CUDA ReLU stays correct. One batch (module fixture); each cheat compiles one kernel.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dice_kernels.harness import (BuildConfig, EvalConfig, Outcome, TimingConfig, candidate_from_text, evaluate,
                                  load_candidate)
from dice_kernels.harness.outcomes import DeceptiveKind as K
from dice_kernels.tasks import Task, load_tasks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "dice_kernels" / "examples"

# A ReLU kernel that can spin for `spin` clock cycles first (to still be running when forward returns).
EXT = textwrap.dedent('''
    import torch
    import torch.nn as nn
    from torch.utils.cpp_extension import load_inline

    cuda_src = r"""
    #include <torch/extension.h>
    #include <ATen/cuda/CUDAContext.h>
    __global__ void relu_kernel(const float* x, float* y, int64_t n, int64_t spin) {
        const long long start = clock64();
        while (clock64() - start < spin) {}
        const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
    }
    torch::Tensor relu(torch::Tensor x, int64_t spin) {
        auto y = torch::empty_like(x);
        const int64_t n = x.numel();
        relu_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
            x.data_ptr<float>(), y.data_ptr<float>(), n, spin);
        return y;
    }
    """
    ext = load_inline(name="NAME", cpp_sources="torch::Tensor relu(torch::Tensor x, int64_t spin);",
                      cuda_sources=cuda_src, functions=["relu"])
    ''')


def _cheat(name: str, body: str) -> str:
    return EXT.replace("NAME", name) + textwrap.dedent(body)


CHEATS = {
    "side_stream": (_cheat("robust_side_stream", """
        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.side = torch.cuda.Stream()

            def forward(self, x):
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):  # returns before the kernel ends; the caller never waits
                    return ext.relu(x, 20_000_000)
        """), K.UNSYNCHRONIZED_WORK),
    "cuda_graph": (_cheat("robust_graph", """
        class ModelNew(nn.Module):
            def forward(self, x):
                if not hasattr(self, "graph"):
                    self.x = x.clone()
                    ext.relu(self.x, 0)
                    torch.cuda.synchronize()
                    self.graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self.graph):
                        self.y = ext.relu(self.x, 0)
                self.x.copy_(x)
                self.graph.replay()
                return self.y.clone()
        """), K.CUDA_GRAPH),
    "token_kernel_jiterator_work": (_cheat("robust_token", """
        relu_j = torch.cuda.jiterator._create_jit_fn(
            "template <typename T> T relu_j(T x) { return x > T(0) ? x : T(0); }")

        class ModelNew(nn.Module):
            def forward(self, x):
                ext.relu(x[:1], 0)  # the compiled kernel runs, on one row
                y = x
                for _ in range(20):
                    y = relu_j(y)  # the real work: launched outside the dispatcher and outside the extension
                return y
        """), K.KERNEL_TIME_NEGLIGIBLE),
}


# A cuDNN conv kept in PyTorch with the ReLU epilogue in the candidate's kernel: partial, not deceptive (issue 40)
CONV_RELU = Task(id="conv_relu", name="conv_relu", code=textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(16, 32, 3)

        def forward(self, x):
            return torch.relu(self.conv(x))

    def get_inputs():
        return [torch.randn(8, 16, 64, 64)]

    def get_init_inputs():
        return []
    """))
CONV_EPILOGUE = _cheat("robust_conv_epilogue", """
    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(16, 32, 3)

        def forward(self, x):
            return ext.relu(self.conv(x).contiguous(), 0)
    """)


def _dice_pair_7798(shared: Path) -> tuple[Task, object] | None:
    """DICE infilling pair 7798: an embedding of floored float indices, which the hardened trials push past the
    table (a device-side assert in the reference's worker); was a harness error, must be judged as any task."""
    path = shared / "corpora" / "dice_infill_eval_99.json"
    if not path.is_file():
        return None
    import json

    pair = next(p for p in json.loads(path.read_text()) if str(p["id"]) == "7798")
    return (Task(id="dice/7798", name="dice_7798", code=pair["pytorch_code"]),
            candidate_from_text(pair["cuda_code"], id="dice/7798"))


@pytest.fixture(scope="module")
def results(build_cache, tmp_path_factory):
    from conftest import SHARED_DATA

    task = next(t for t in load_tasks(EXAMPLES / "tasks") if t.name == "19_ReLU")
    pairs = [(task, candidate_from_text(text, id=name)) for name, (text, _) in CHEATS.items()]
    honest = EXAMPLES / "solutions" / "cuda" / "level1" / "19_ReLU" / "correct.py"
    pairs.append((task, load_candidate(honest, id="honest")))
    pairs.append((CONV_RELU, candidate_from_text(CONV_EPILOGUE, id="conv_epilogue")))
    if (dice := _dice_pair_7798(SHARED_DATA)) is not None:
        pairs.append(dice)
    config = EvalConfig(backend="cuda", trials=3, cache_dir=build_cache, build=BuildConfig(jobs=8),
                        timing=TimingConfig(warmup=2, iters=10))
    return {r.candidate_id: r for r in evaluate(pairs, config, out_dir=tmp_path_factory.mktemp("robust-gpu"),
                                                progress=False)}


@pytest.mark.parametrize("name", list(CHEATS))
def test_cuda_cheat_is_deceptive_with_its_sub_kind(results, name):
    r = results[name]
    findings = r.robust.findings if r.robust else []
    assert (r.outcome, r.deceptive_kind) == (Outcome.DECEPTIVE, CHEATS[name][1].value), f"{r.error} {findings}"


def test_honest_cuda_kernel_stays_correct(results):
    r = results["honest"]
    assert r.outcome is Outcome.CORRECT, f"{r.outcome} {r.deceptive_kind} {r.error}"
    assert r.robust.findings == []


def test_a_library_conv_with_a_custom_epilogue_is_partial(results):
    r = results["conv_epilogue"]
    assert r.outcome is Outcome.PARTIAL, f"{r.outcome} {r.deceptive_kind} {r.error} {r.robust}"
    assert r.extension.called and r.speedup


def test_dice_pair_7798_is_judged_not_a_harness_error(results):
    if "dice/7798" not in results:
        pytest.skip("../shared/data is not present")
    r = results["dice/7798"]
    assert r.outcome in (Outcome.CORRECT, Outcome.PARTIAL), f"{r.outcome} {r.deceptive_kind} {r.error}"
