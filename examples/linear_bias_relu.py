"""Linear layer with bias followed by ReLU: a GEMM whose epilogue (bias + ReLU) can be fused into it."""

import torch
import torch.nn as nn

BATCH = 4096
IN_FEATURES = 8192
OUT_FEATURES = 8192


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def get_inputs():
    return [torch.randn(BATCH, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]
