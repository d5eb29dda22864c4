"""Honest: x * scale + shift fused into one kernel. Passes."""

import kp_kernels
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, scale, shift):
        super().__init__()
        self.scale = scale
        self.shift = shift

    def forward(self, x):
        return kp_kernels.scale_shift(x, self.scale, self.shift)
