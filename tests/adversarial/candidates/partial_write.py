"""Broken: leaves the last 1000 outputs unwritten, holding whatever the allocator's memory held."""

import kp_kernels
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.relu_partial(x, 1000)
