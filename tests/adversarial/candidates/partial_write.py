"""Broken: leaves the last 1000 outputs unwritten, holding whatever the allocator's memory held."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu_partial(x, 1000)
