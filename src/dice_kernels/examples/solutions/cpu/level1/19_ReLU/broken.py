# Example (dice eval --example): a kernel that does not compile (a variable used before it is declared). Expected outcome: compile_error
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Does not compile: `out` is used before it is declared.
cpp_source = r"""
#include <torch/extension.h>

torch::Tensor relu_forward(torch::Tensor x) {
    float* o = out.data_ptr<float>();
    return x;
}
"""

relu_ext = load_inline(name="example_relu_broken_cpu", cpp_sources=cpp_source, functions=["relu_forward"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_ext.relu_forward(x)
