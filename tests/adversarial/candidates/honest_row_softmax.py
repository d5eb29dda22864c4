"""Honest: row softmax, one block per row, warp-shuffle reductions. Passes."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.row_softmax(x)
