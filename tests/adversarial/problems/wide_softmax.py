"""Softmax over 32768 columns: every output is about 3e-5, far below the default atol of 1e-2."""

import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.randn(256, 32768)]


def get_init_inputs():
    return []
