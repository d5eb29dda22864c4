"""Broken: returns a copy of its input, wrong wherever x < 0. Judged after a candidate that patched the judge."""

import kp_kernels
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.scale_shift(x, 1.0, 0.0)
