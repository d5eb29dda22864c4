"""Honest: row softmax, one block per row, warp-shuffle reductions. Passes."""

import kp_kernels
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_kernels.row_softmax(x)
