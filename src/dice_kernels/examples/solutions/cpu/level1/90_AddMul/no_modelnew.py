# Example (dice eval --example): model output that never defines ModelNew (a common generation slip). Expected outcome: python_error
import torch
import torch.nn as nn


# A typical generation failure mode: the class is named after the task instead of ModelNew.
class FusedAddMul(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, a, b, c):
        return (a * b + c) * self.scale
