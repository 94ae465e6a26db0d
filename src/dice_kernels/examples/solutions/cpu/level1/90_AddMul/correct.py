# Example (dice eval --example): a fused add-multiply with a parameter, matching the reference. Expected outcome: correct
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <torch/extension.h>

torch::Tensor addmul_forward(torch::Tensor a, torch::Tensor b, torch::Tensor c, torch::Tensor scale) {
    auto ac = a.contiguous(), bc = b.contiguous(), cc = c.contiguous(), sc = scale.contiguous();
    auto out = torch::empty_like(ac);
    const int64_t features = sc.numel(), n = ac.numel();
    const float *pa = ac.data_ptr<float>(), *pb = bc.data_ptr<float>(), *pc = cc.data_ptr<float>();
    const float* ps = sc.data_ptr<float>();
    float* po = out.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) po[i] = (pa[i] * pb[i] + pc[i]) * ps[i % features];
    return out;
}
"""

ext = load_inline(name="example_addmul_cpu", cpp_sources=cpp_source, functions=["addmul_forward"],
                  extra_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, a, b, c):
        return ext.addmul_forward(a, b, c, self.scale)
