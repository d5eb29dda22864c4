"""Cheat: honest for the six calls verification makes (five trials and one profiled call), then returns an
unwritten buffer and launches nothing, so every timed call costs one allocation."""

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

VERIFIED_CALLS = 6
_calls = 0  # on the module, not the instance: the bench builds its own ModelNew


class ModelNew(nn.Module):
    def forward(self, x):
        global _calls
        _calls += 1
        if _calls <= VERIFIED_CALLS:
            return kp_ops.relu(x)
        return torch.empty_like(x)
