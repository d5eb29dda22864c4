"""Broken: the kernel writes each result a second time, 1 TiB past the end of the output."""

import kp_kernels
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.relu_far_write(x)
