"""GroupNorm then SiLU, the normalisation block of a diffusion UNet (32 groups of 640 channels, 32x32 latents)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 32
CHANNELS = 640
GROUPS = 32
HEIGHT = 32
WIDTH = 32


class Model(nn.Module):
    def __init__(self, groups: int, channels: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, eps=1e-6)
        # Random affine parameters, so a kernel that ignores them cannot pass verification.
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(x))


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH) * 2 + 0.5]


def get_init_inputs():
    return [GROUPS, CHANNELS]
