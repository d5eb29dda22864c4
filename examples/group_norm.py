"""GroupNorm with 32 groups over NCHW feature maps: statistics span channels and spatial positions."""

import torch
import torch.nn as nn

BATCH = 32
CHANNELS = 256
GROUPS = 32
HEIGHT = 64
WIDTH = 64


class Model(nn.Module):
    def __init__(self, groups: int, channels: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        # Random affine parameters, so a kernel that ignores them cannot pass verification.
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH)]


def get_init_inputs():
    return [GROUPS, CHANNELS]
