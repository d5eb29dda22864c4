"""Precision drop: computes an fp32 problem in bf16; within tolerance, so it passes with a warning."""

import kp_kernels
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.relu_bf16(x)
