"""Square matrix product followed by exact (erf) GELU: compute-bound, with an elementwise epilogue."""

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZE = 4096


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(a @ b)


def get_inputs():
    return [torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)]


def get_init_inputs():
    return []
