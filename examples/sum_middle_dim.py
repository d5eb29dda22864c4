"""Sum over the middle dimension of a 3-D tensor: a strided reduction where each output reads a column."""

import torch
import torch.nn as nn

BATCH = 64
REDUCED = 4096
INNER = 1024


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=self.dim)


def get_inputs():
    return [torch.randn(BATCH, REDUCED, INNER)]


def get_init_inputs():
    return [1]
