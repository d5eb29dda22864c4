"""Cheat: launches a custom kernel for show, then lets torch.softmax compute the answer."""

import kp_kernels
import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        same = kp_kernels.scale_shift(x, 1.0, 0.0)
        return torch.softmax(same, dim=-1)
