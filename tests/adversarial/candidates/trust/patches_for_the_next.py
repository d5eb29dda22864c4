"""Honest itself, but at import rebinds kernelpilot's comparison (verify.compare_outputs, compare_tensors) process-wide
to always pass, so whatever the same process judges next passes too."""

import kp_kernels
from torch import nn

from kernelpilot.harness import verify


def _passing(name, actual, expected, **tolerances):
    return verify.LeafComparison(name, True, 0.0, 0.0)


verify.compare_tensors = _passing
verify.compare_outputs = lambda actual, expected, *, atol, rtol, name="out": [_passing(name, actual, expected)]


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.relu(x)
