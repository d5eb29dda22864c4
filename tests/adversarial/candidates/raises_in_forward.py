"""Broken: passes a transposed (non-contiguous) view, which the binding rejects."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(x.t()).t()
