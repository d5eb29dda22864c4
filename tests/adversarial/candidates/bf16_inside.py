"""Precision drop: computes an fp32 problem in bf16; within tolerance, so it passes with a warning."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu_bf16(x)
