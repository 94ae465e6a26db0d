# Example (dice eval --example): a kernel whose output has the wrong shape. Expected outcome: shape_mismatch
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Bug on purpose: reduces over the feature dimension, so the output has the wrong shape.
cpp_source = r"""
#include <torch/extension.h>

torch::Tensor addmul_forward(torch::Tensor a, torch::Tensor b, torch::Tensor c, torch::Tensor scale) {
    auto ac = a.contiguous(), bc = b.contiguous(), cc = c.contiguous(), sc = scale.contiguous();
    const int64_t rows = ac.size(0), features = sc.numel();
    auto out = torch::zeros({rows}, ac.options());
    const float *pa = ac.data_ptr<float>(), *pb = bc.data_ptr<float>(), *pc = cc.data_ptr<float>();
    const float* ps = sc.data_ptr<float>();
    float* po = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t f = 0; f < features; ++f)
            po[r] += (pa[r * features + f] * pb[r * features + f] + pc[r * features + f]) * ps[f];
    return out;
}
"""

ext = load_inline(name="example_addmul_shape_cpu", cpp_sources=cpp_source, functions=["addmul_forward"])


class ModelNew(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, a, b, c):
        return ext.addmul_forward(a, b, c, self.scale)
