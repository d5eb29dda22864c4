"""Honest: ReLU in one kernel. Passes."""

import kp_kernels
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.relu(x)
