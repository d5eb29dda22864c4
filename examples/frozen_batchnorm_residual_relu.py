"""Per-channel scale and shift broadcast over NCHW, plus a residual, then ReLU (an inference-time BatchNorm block)."""

import torch
import torch.nn as nn

BATCH = 32
CHANNELS = 256
HEIGHT = 96
WIDTH = 96


class Model(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(channels, 1, 1) + 0.5)
        self.shift = nn.Parameter(torch.randn(channels, 1, 1))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.scale + self.shift + residual)


def get_inputs():
    shape = (BATCH, CHANNELS, HEIGHT, WIDTH)
    return [torch.randn(shape), torch.randn(shape)]


def get_init_inputs():
    return [CHANNELS]
