"""Honest: x * scale + shift fused into one kernel. Passes."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self, scale, shift):
        super().__init__()
        self.scale = scale
        self.shift = shift

    def forward(self, x):
        return kp_ops.scale_shift(x, self.scale, self.shift)
