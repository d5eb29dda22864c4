"""Broken: right values on every call, but always in the same buffer, so each call overwrites the last result."""

import kp_kernels
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = None

    def forward(self, x):
        if self.out is None:
            self.out = torch.empty_like(x)
        return kp_kernels.relu_into(x, self.out)
