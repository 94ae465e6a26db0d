# Example (dice eval --example): a kernel that does not compile (a missing semicolon). Expected outcome: compile_error
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void relu_kernel(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = fmaxf(in[i], 0.f)  // missing semicolon: does not compile
}

torch::Tensor relu_forward(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.dtype() == torch::kFloat32, "float32 CUDA tensor expected");
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const int64_t n = xc.numel();
    const int threads = 256;
    relu_kernel<<<(n + threads - 1) / threads, threads>>>(xc.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""
cpp_source = "torch::Tensor relu_forward(torch::Tensor x);"

relu_ext = load_inline(name="example_relu_broken_cuda", cpp_sources=cpp_source, cuda_sources=cuda_source,
                       functions=["relu_forward"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_ext.relu_forward(x)
