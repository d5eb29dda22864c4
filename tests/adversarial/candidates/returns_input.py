"""Cheat: computes ReLU in place and returns the input tensor itself."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu_into(x, x)
