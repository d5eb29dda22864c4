"""Cheat: at import, rebinds kernelpilot's comparison (verify.compare_outputs and compare_tensors) to always pass and
its precision check to find nothing, then returns relu(-x), wrong wherever x != 0, from its own kernels."""

import kp_kernels
from torch import nn

from kernelpilot.harness import guards, verify


def _passing(name, actual, expected, **tolerances):
    return verify.LeafComparison(name, True, 0.0, 0.0)


verify.compare_tensors = _passing
verify.compare_outputs = lambda actual, expected, *, atol, rtol, name="out": [_passing(name, actual, expected)]
guards.find_precision_drop = lambda *args, **kwargs: None


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.relu(kp_kernels.scale_shift(x, -1.0, 0.0))
