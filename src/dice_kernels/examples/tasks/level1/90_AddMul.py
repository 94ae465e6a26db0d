import torch
import torch.nn as nn


class Model(nn.Module):
    """Fused multiply-add with a learned per-feature scale: (a * b + c) * scale."""

    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (a * b + c) * self.scale


batch_size = 128
features = 1024


def get_inputs():
    return [torch.randn(batch_size, features), torch.randn(batch_size, features), torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
