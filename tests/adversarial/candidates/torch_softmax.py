"""Cheat: launches a custom kernel for show, then lets torch.softmax compute the answer."""

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        same = kp_ops.scale_shift(x, 1.0, 0.0)
        return torch.softmax(same, dim=-1)
