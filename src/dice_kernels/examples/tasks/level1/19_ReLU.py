import torch
import torch.nn as nn


class Model(nn.Module):
    """Applies ReLU element-wise."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


batch_size = 64
dim = 4096


def get_inputs():
    # signed inputs: on torch.rand's [0, 1) ReLU is the identity and an input copy would pass
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
