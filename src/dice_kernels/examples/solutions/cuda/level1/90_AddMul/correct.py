# Example (dice eval --example): a fused add-multiply with a parameter, matching the reference. Expected outcome: correct
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void addmul_kernel(const float* a, const float* b, const float* c, const float* scale, float* out,
                              int64_t n, int64_t features) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = (a[i] * b[i] + c[i]) * scale[i % features];
}

torch::Tensor addmul_forward(torch::Tensor a, torch::Tensor b, torch::Tensor c, torch::Tensor scale) {
    auto ac = a.contiguous(), bc = b.contiguous(), cc = c.contiguous(), sc = scale.contiguous();
    auto out = torch::empty_like(ac);
    const int64_t n = ac.numel();
    const int threads = 256;
    addmul_kernel<<<(n + threads - 1) / threads, threads>>>(ac.data_ptr<float>(), bc.data_ptr<float>(),
        cc.data_ptr<float>(), sc.data_ptr<float>(), out.data_ptr<float>(), n, sc.numel());
    return out;
}
"""
cpp_source = "torch::Tensor addmul_forward(torch::Tensor a, torch::Tensor b, torch::Tensor c, torch::Tensor scale);"

ext = load_inline(name="example_addmul_cuda", cpp_sources=cpp_source, cuda_sources=cuda_source,
                  functions=["addmul_forward"])


class ModelNew(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, a, b, c):
        return ext.addmul_forward(a, b, c, self.scale)
