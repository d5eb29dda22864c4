"""Honest: ReLU in one kernel on every call. The yardstick the timing cheats' honest-looking times are held to."""

import kp_kernels
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.relu(x)
