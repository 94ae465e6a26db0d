'''The end-to-end prompt: KernelBench's one-shot layout (instructions, an element-wise-add `Model` / `ModelNew`
example, the task's code, "name it ModelNew, no testing code"). The one place this template lives; data curation
and RL build their prompts here too. Wording is ours; the structure follows KernelBench's one-shot prompt.'''

from __future__ import annotations

EXAMPLE_MODEL = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def get_inputs():
    return [torch.randn(1, 128).cuda(), torch.randn(1, 128).cuda()]


def get_init_inputs():
    return []
'''

EXAMPLE_MODEL_NEW = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void add_kernel(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}

torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    int n = a.numel();
    int threads = 256;
    int blocks = (n + threads - 1) / threads;
    add_kernel<<<blocks, threads>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

cpp_source = "torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b);"

add = load_inline(name="add", cpp_sources=cpp_source, cuda_sources=source, functions=["add_cuda"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add = add

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.add.add_cuda(a, b)
'''

INSTRUCTIONS = (
    "You write custom CUDA kernels that replace PyTorch operators in a given architecture to make it faster.\n\n"
    "You may replace any subset of the operators: keep some as they are, fuse several into one kernel (for "
    "example matmul + relu), or change the algorithm (for example an online softmax)."
)

TASK_INSTRUCTION = (
    "Optimize the architecture named Model with custom CUDA operators. Name the optimized architecture ModelNew. "
    "Write real, complete code that compiles and runs, not pseudocode. Output only the new model code in a "
    "code block: no explanations and no testing code."
)


def kernelbench_prompt(task_code: str) -> str:
    """The user message asking for a `ModelNew` that speeds up the KernelBench task `task_code`."""
    return (
        f"{INSTRUCTIONS}\n\n"
        f"Here is an example of embedding a custom CUDA operator in PyTorch. The given architecture:\n\n"
        f"```python\n{EXAMPLE_MODEL}```\n\n"
        f"The same architecture with a custom CUDA kernel:\n\n"
        f"```python\n{EXAMPLE_MODEL_NEW}```\n\n"
        f"You are given the following architecture:\n\n"
        f"```python\n{task_code.rstrip()}\n```\n\n"
        f"{TASK_INSTRUCTION}\n"
    )
