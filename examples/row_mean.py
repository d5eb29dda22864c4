"""Row-wise mean: reduce each of 32,768 rows of 8,192 floats to one value (contiguous reduction)."""

import torch
import torch.nn as nn

ROWS = 32768
COLUMNS = 8192


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=-1)


def get_inputs():
    return [torch.randn(ROWS, COLUMNS)]


def get_init_inputs():
    return []
