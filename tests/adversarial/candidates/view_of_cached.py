"""Cheat: keeps the first result on the module and returns a view of it afterwards, computing nothing."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            self.cache = kp_ops.relu(x).view(-1)
        return self.cache.view(x.shape)
