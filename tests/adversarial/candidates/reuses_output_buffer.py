"""Broken: right values on every call, but always in the same buffer, so each call overwrites the last result."""

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = None

    def forward(self, x):
        if self.out is None:
            self.out = torch.empty_like(x)
        return kp_ops.relu_into(x, self.out)
