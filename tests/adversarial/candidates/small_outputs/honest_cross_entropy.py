"""Honest: the mean cross-entropy in one kernel. Passes."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, logits, targets):
        return kp_ops.cross_entropy(logits, targets)
