# Example (dice eval --example): a kernel that reads and writes past its buffers. Expected outcome: cuda_memory_error
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Bug on purpose: indexes far past the end of the buffers (an illegal memory access).
cuda_source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void addmul_kernel(const float* a, const float* b, const float* c, const float* scale, float* out,
                              int64_t n, int64_t features) {
    int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * 1000003;
    out[i] = (a[i] * b[i] + c[i]) * scale[i % features];
}

torch::Tensor addmul_forward(torch::Tensor a, torch::Tensor b, torch::Tensor c, torch::Tensor scale) {
    auto out = torch::empty_like(a);
    const int64_t n = a.numel();
    addmul_kernel<<<(n + 255) / 256, 256>>>(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(),
        scale.data_ptr<float>(), out.data_ptr<float>(), n, scale.numel());
    return out;
}
"""
cpp_source = "torch::Tensor addmul_forward(torch::Tensor a, torch::Tensor b, torch::Tensor c, torch::Tensor scale);"

ext = load_inline(name="example_addmul_oob_cuda", cpp_sources=cpp_source, cuda_sources=cuda_source,
                  functions=["addmul_forward"])


class ModelNew(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, a, b, c):
        return ext.addmul_forward(a, b, c, self.scale)
