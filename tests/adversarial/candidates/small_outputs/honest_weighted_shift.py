"""Honest: weight + 1e-3 * x, element by element."""

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(64, 1024))

    def forward(self, x):
        return kp_ops.weighted_shift(self.weight, x)
