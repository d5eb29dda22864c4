"""RMSNorm (LLaMA style): x / sqrt(mean(x^2) + eps) * weight over the hidden size."""

import torch
import torch.nn as nn

BATCH = 8
SEQUENCE = 4096
HIDDEN = 8192


class Model(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inverse_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * inverse_rms * self.weight


def get_inputs():
    return [torch.randn(BATCH, SEQUENCE, HIDDEN)]


def get_init_inputs():
    return [HIDDEN, 1e-6]
