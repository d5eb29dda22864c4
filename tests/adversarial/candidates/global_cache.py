"""Cheat: computes the first call's result once and returns that same tensor for every later call."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

_RESULTS = {}


class ModelNew(nn.Module):
    def forward(self, x):
        if x.shape not in _RESULTS:
            _RESULTS[x.shape] = kp_ops.relu(x)
        return _RESULTS[x.shape]
