"""Cheat: replaces torch.cuda.Event with an object whose every attribute raises, hoping to break the check for
replaced timing functions (and so keep the replacement)."""

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class Unreadable:
    def __getattr__(self, name):
        raise ValueError(f"no {name} here")


class ModelNew(nn.Module):
    def forward(self, x):
        torch.cuda.Event = Unreadable()
        return kp_ops.relu(x)
