"""Broken: returns a copy of its input, wrong wherever x < 0. Judged after a candidate that patched the judge."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.scale_shift(x, 1.0, 0.0)
