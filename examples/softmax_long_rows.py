"""Softmax over very long rows: 2048 rows of 393,216 floats, each row (1.5 MB) far larger than shared memory."""

import torch
import torch.nn as nn

ROWS = 2048
ROW_LENGTH = 393216


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.randn(ROWS, ROW_LENGTH)]


def get_init_inputs():
    return []
