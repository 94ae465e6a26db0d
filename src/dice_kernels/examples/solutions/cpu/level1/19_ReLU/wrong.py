# Example (dice eval --example): a kernel that compiles and runs but computes the wrong values. Expected outcome: value_mismatch
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Bug on purpose: clamps at 0.1 instead of 0, so small positive values come out wrong.
cpp_source = r"""
#include <torch/extension.h>

torch::Tensor relu_forward(torch::Tensor x) {
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const float* in = xc.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < xc.numel(); ++i) o[i] = in[i] > 0.1f ? in[i] : 0.f;
    return out;
}
"""

relu_ext = load_inline(name="example_relu_wrong_cpu", cpp_sources=cpp_source, functions=["relu_forward"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_ext.relu_forward(x)
