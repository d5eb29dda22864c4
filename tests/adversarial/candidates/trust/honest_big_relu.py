"""Honest: ReLU in one kernel on every call. The yardstick the timing cheats' honest-looking times are held to."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(x)
