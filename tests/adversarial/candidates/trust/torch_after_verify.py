"""Cheat: its own kernel for the six calls verification makes (five trials and one profiled call), then torch's
relu with the dispatch modes popped, so the op recorder sees nothing. Its answers stay right and its time is
torch's; what it breaks is the rule that the work runs in the workspace's kernels (a candidate calling a fused
torch op this way would claim torch's speed as its own)."""

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

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
        with _disable_current_modes():
            return torch.relu(x)
